"""`attnlab info`: the backends and the dispatch verdict for a call shape."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli_runner import run_cli, run_main

SRC = Path(__file__).resolve().parents[2] / "src"


def test_info_runs_for_real():
    env = dict(os.environ, PYTHONPATH=str(SRC), COLUMNS="160")
    result = subprocess.run(
        [sys.executable, "-m", "attnlab", "info", "--seq-len", "8192", "--mask", "padding"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for name in ("sdpa", "blockwise", "math"):
        assert name in out
    assert "backend='auto' -> blockwise" in out
    assert "materialised" in out  # why sdpa stepped aside
    # The kernels chosen for this CPU, each with its reason.
    from attnlab.quant.arith import prompt_arithmetic

    dtype, why = prompt_arithmetic()
    flat = " ".join(out.split())
    assert f"prompt products of the int and bf16 weights: {str(dtype)[6:]} ({why})" in flat
    assert "int4 decode products: " in flat
    # a fresh process has not loaded the compiled step: PyTorch's int4 kernel's bf16 rows
    assert "rows of the int4, q8_0 and q5_0 decode products: bfloat16 (PyTorch's" in flat


def test_info_names_float32_decode_rows_on_a_build_that_codes_them(monkeypatch):
    import types

    from rich.console import Console

    from attnlab import native
    from attnlab.cli.info import _info_native

    ext = types.SimpleNamespace(SIMD="avx2", Q4_INTEGER=True, Q5_INTEGER=True)
    monkeypatch.setattr(native, "loaded", lambda: ext)
    console = Console(width=300, record=True)
    console.print(_info_native())
    text = " ".join(console.export_text().split())
    assert "decode products: float32 (this avx2 build's kernels code float32 rows" in text


def test_info_explains_a_refused_backend_as_a_user_error(capsys):
    code, out, err = run_main(capsys, "info", "--dropout", "0.1", "--backend", "blockwise")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "does not implement attention dropout" in err


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (("--heads", "12", "--kv-heads", "5"), "H=12 query heads and G=5"),
        (("--mask", "diagonal"), "unknown --mask 'diagonal'"),
        (("--dtype", "int8"), "unknown --dtype 'int8'"),
        (("--backend", "flash9"), "`backend` must be one of"),
        (("--seq-len", "0"), "`--seq-len` must be a positive int"),
    ],
)
def test_info_user_errors(capsys, args, pattern):
    code, _, err = run_main(capsys, "info", *args)
    assert code == 2
    assert err.startswith("attnlab: error:") and pattern in err and err.count("\n") == 1


@pytest.fixture
def table_env(monkeypatch):
    """Point auto at a table (a path, or 'none') through the environment; restore after."""
    from attnlab.backends import set_dispatch_table

    def use(value: str) -> None:
        monkeypatch.setenv("ATTNLAB_DISPATCH_TABLE", value)
        set_dispatch_table()  # read the environment again on next use

    yield use
    monkeypatch.delenv("ATTNLAB_DISPATCH_TABLE", raising=False)
    set_dispatch_table()


def test_info_default_is_sdpa_for_causal(capsys, table_env):
    table_env("none")  # the fixed order: the measured table may rank otherwise
    code, out, _ = run_main(capsys, "info")
    flat = " ".join(out.split())
    assert code == 0 and "backend='auto' -> sdpa" in flat
    assert "auto's crossover table: none; auto uses the fixed order" in flat
    assert "decided by the fixed order sdpa > blockwise > math" in flat


def _table_file(tmp_path, rows):
    path = tmp_path / "table.json"
    doc = {
        "format": "attnlab-dispatch-table/1",
        "machine": {"date": "2026-11-30 12:00 UTC", "threads": 2, "others_busy_during": 0.03},
        "shape": {"B": 1, "H": 12, "D": 64, "device": "cpu"},
        "rows": rows,
    }
    path.write_text(json.dumps(doc))
    return path


def test_info_shows_the_table_and_the_row_that_decided(capsys, table_env, tmp_path):
    row = {"dtype": "bfloat16", "pass": "forward+backward", "mask": "causal", "t_from": 0,
           "t_below": 256, "order": ["math", "sdpa", "blockwise"],
           "ms": {"64": {"math": 1.29, "sdpa": 1.76, "blockwise": 3.6}}}  # fmt: skip
    path = _table_file(tmp_path, [row])
    table_env(str(path))
    res = run_cli(
        "info", "--seq-len", "64", "--dtype", "bf16", "--backward", "--table", columns=240,
        env={"ATTNLAB_DISPATCH_TABLE": str(path)},
    )  # fmt: skip
    flat = " ".join(res.stdout.split())
    assert res.returncode == 0, res.stderr
    assert "auto's crossover table (1 rows" in flat and "other processes used 3%" in flat
    assert "math < sdpa < blockwise" in flat and "64: 1.29 1.76 3.6" in flat
    assert "forward+backward: backend='auto' -> math" in flat
    assert "decided by dispatch table row 0 (bfloat16, forward+backward, causal" in flat
    # The forward pass has no row: the fixed order, and info says so.
    code, out, _ = run_main(capsys, "info", "--seq-len", "64", "--dtype", "bf16")
    assert code == 0
    flat = " ".join(out.split())
    assert "-> sdpa" in flat and "no table row for bfloat16, forward" in flat
    assert "`attnlab info --table` lists the rows" in flat


def test_info_with_a_malformed_table_is_a_user_error(capsys, table_env, tmp_path):
    table_env(str(_table_file(tmp_path, [{"dtype": "float32"}])))
    code, out, err = run_main(capsys, "info")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "is malformed: `rows[0].pass` must be one of" in err


def test_info_lists_the_variants_and_which_backend_serves_them():
    result = run_cli("info", "--mask", "document", "--softcap", "30", columns=240, timeout=120)
    flat = " ".join(result.stdout.split())
    assert result.returncode == 0, result.stderr
    for variant in ("AlibiBias", "RelativePositionBias", "DocumentMask", "ChunkedMask", "softcap=",
                    "sinks="):  # fmt: skip
        assert variant in flat
    assert "PyTorch's kernel has no logit soft-capping" in flat  # sdpa's reason, verbatim
    assert "backend='auto' -> sdpa" not in flat  # softcap: sdpa cannot serve this call


def test_info_chunked_mask(capsys):
    code, out, err = run_main(capsys, "info", "--mask", "chunked", "--seq-len", "1024")
    assert code == 0, err
    assert "chunked (256)" in " ".join(out.split())


@pytest.mark.parametrize(
    ("args", "header", "verdicts"),
    [
        # The ring backend's refusal names the mask the dispatcher was given: what info built.
        (("--mask", "alibi"), "mask=alibi dropout=0.0 forward:",
         ["got alibi & causal (bottom_right)"]),
        (("--mask", "relbias"), "mask=relbias dropout=0.0 forward:",
         ["got relative_position"]),
        # Sinks: sdpa cannot serve them, so auto goes to blockwise, and says why.
        (("--sinks",), "dropout=0.0 sinks forward: backend='auto' -> blockwise",
         ["sdpa not chosen: PyTorch's kernel does not return the row log-sum-exp that "
          "attention sinks join", "ring not chosen: ring does not implement attention sinks"]),
    ],
)  # fmt: skip
def test_info_sinks_and_bias_masks(args, header, verdicts):
    result = run_cli("info", *args, columns=400, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = [" ".join(line.replace("│", " ").split()) for line in result.stdout.splitlines()]
    assert any(header in line for line in lines), header
    for verdict in verdicts:
        assert any(line.startswith(("ring", "sdpa")) and verdict in line for line in lines), verdict


def test_info_softcap_must_be_positive(capsys):
    code, _, err = run_main(capsys, "info", "--softcap", "0")
    assert code == 2 and "`softcap` must be a positive" in err
