"""benchmarks/cpu_targets.py: the speed targets read from one CPU's newest records."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import cpu_targets
import pytest
from _quiet import PairResult

XEON = {"cpu": "Intel Xeon Test", "simd": ["avx2", "avx512f", "amx_int8"], "cores": 2}
EPYC = {"cpu": "AMD EPYC Test", "simd": ["avx2", "avx512f", "avx512_bf16"], "cores": 2}


def _record(machine: dict[str, Any], benchmark: str, config: str, date: str,
            figures: list[dict[str, Any]], quiet: bool = True) -> dict[str, Any]:  # fmt: skip
    return {
        "benchmark": benchmark, "config": config, "date": date, "machine": machine,
        "commit": "abcdef1234567", "quiet": {"quiet": quiet}, "figures": figures,
    }  # fmt: skip


def _fig(name: str, ratio: float | None, value: float = 1.0, note: str | None = None):
    return {"name": name, "value": value, "ratio": ratio, "note": note}


def _by_figure(checks, config: str, figure: str):
    (found,) = [c for c in checks if c.target.config == config and c.target.figure == figure]
    return found


def test_each_target_is_read_from_the_newest_record_of_its_cpu():
    decode, prefill = "attnlab int4 decode (64+128)", "attnlab int4 prefill of 512"
    agree = "attnlab int4 decode-path argmax agreement with float32"
    # three rounds of attnlab ("a") against import torch ("t"): ratios 1.31, 1.62, 1.70
    rounds = PairResult({}, 3, 3, times={"a": [1.31, 1.62, 1.70], "t": [1.0, 1.0, 1.0]})
    records = [
        _record(XEON, "bench_llama_cpp", "gemma3-270m", "2026-01-01",
                [_fig(decode, 0.9), _fig(prefill, 0.5)]),
        _record(XEON, "bench_llama_cpp", "gemma3-270m", "2026-01-02",
                [_fig(decode, 1.2), _fig(prefill, 0.97), _fig(agree, None, value=0.94)],
                quiet=False),
        _record(EPYC, "bench_llama_cpp", "gemma3-270m-avx2", "2026-01-03",
                [_fig(decode, 2.0)]),  # another CPU's: never this one's
        _record(XEON, "bench_first_token", "gemma3-270m", "2026-01-02",
                [_fig("first token, --dtype float32", 1.40, note=rounds.ratio_note("a", "t")),
                 _fig("first token, --dtype int4", 1.20)]),  # no median in its note
        _record(XEON, "bench_attention", "variants", "2026-01-02",
                [_fig("softcap, T=4096, fwd", 1.3), _fig("window, T=8192, fwd", 0.26)]),
    ]  # fmt: skip
    checks = cpu_targets.check(records, "Intel Xeon Test (AVX-512 with AMX)")
    assert len(checks) == len(cpu_targets.targets())
    status = {(c.target.config, c.target.figure): c.status for c in checks}
    assert status[("gemma3-270m", decode)] == "met"  # the newest record: 1.2x, not 0.9x
    assert status[("gemma3-270m", prefill)] == "NOT MET"
    assert status[("gemma3-270m", agree)] == "NOT MET"  # a value, 0.94 under 0.95
    assert status[("gemma3-270m-avx2", decode)] == "missing"
    first = _by_figure(checks, "gemma3-270m", "first token, --dtype float32")
    assert first.status == "NOT MET" and first.reading == pytest.approx(1.62)  # the median
    # a first token read only as the median of its rounds: without one, no reading
    assert status[("gemma3-270m", "first token, --dtype int4")] == "missing"
    assert status[("variants", "softcap, T=4096, fwd")] == "met"  # at most 1.3x: 1.3 is in
    assert status[("variants", "window, T=8192, fwd")] == "NOT MET"
    line = cpu_targets._line(_by_figure(checks, "gemma3-270m", decode))
    assert "1.2x" in line and "busy machine" in line and "abcdef1234" in line
    missing = cpu_targets._line(_by_figure(checks, "gemma3-270m-avx2", decode))
    assert "run: python benchmarks/bench_llama_cpp.py" in missing and "--isa avx2" in missing


def _write(folder: Path, records: list[dict[str, Any]]) -> None:
    for i, r in enumerate(records):
        (folder / f"r{i}.json").write_text(json.dumps(r))


def test_the_command_exits_1_unless_every_target_is_met(tmp_path, capsys):
    figures: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for t in cpu_targets.targets():
        bound = t.bound + (0.1 if t.sense == "at least" else -0.05)
        note = f"median of the per-round ratios {bound:.2f}x" if t.of == "median" else None
        fig = _fig(t.figure, bound if t.of == "ratio" else None, value=bound, note=note)
        figures.setdefault((t.benchmark, t.config), []).append(fig)
    every = [_record(EPYC, b, c, "2026-01-01", figs) for (b, c), figs in figures.items()]
    _write(tmp_path, every)
    assert cpu_targets.main(["--results", str(tmp_path), "--cpu", "epyc"]) == 0
    out = capsys.readouterr().out
    n = len(cpu_targets.targets())
    assert out.startswith(f"AMD EPYC Test (AVX-512 with BF16): {n} of {n} targets met")
    _write(tmp_path, [*every, _record(EPYC, "bench_attention", "variants", "2026-01-02", [])])
    assert cpu_targets.main(["--results", str(tmp_path), "--cpu", "epyc"]) == 1
    assert "missing  bench_attention variants" in capsys.readouterr().out
    assert cpu_targets.main(["--results", str(tmp_path), "--list"]) == 0
    assert capsys.readouterr().out.strip() == "AMD EPYC Test (AVX-512 with BF16)"
    with pytest.raises(SystemExit):
        cpu_targets.main(["--results", str(tmp_path), "--cpu", "xeon"])
    assert "the CPUs with records: AMD EPYC Test" in capsys.readouterr().err
