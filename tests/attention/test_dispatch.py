"""``auto`` by measurement: the crossover table (read, validated, missing, malformed), the
rows named in explanations, capability before speed, and the decision cache."""

from __future__ import annotations

import copy
import importlib.util
import itertools
import json
import math
from pathlib import Path

import pytest
import torch

import attnlab.backends as backends
from attnlab.backends import (
    DispatchTable,
    DispatchTableError,
    clear_dispatch_cache,
    dispatch_cache_info,
    dispatch_table,
    explain_dispatch,
    resolve_call,
    set_dispatch_table,
)
from attnlab.backends.table import DEFAULT_TABLE_PATH, load_dispatch_table, mask_kind
from attnlab.functional import scaled_dot_product_attention
from attnlab.masks import CausalMask, PaddingMask, SlidingWindowMask
from reference import reference_attention, tol

ROOT = Path(__file__).resolve().parents[2]
KNOWN = ("sdpa", "blockwise", "math", "ring")


def _row(order, mask="causal", t_from=0, t_below=None, dtype="float32", pass_="forward"):
    return {
        "dtype": dtype,
        "pass": pass_,
        "mask": mask,
        "t_from": t_from,
        "t_below": t_below,
        "order": order,
        "ms": {"16": {n: 1.0 + i for i, n in enumerate(order)}},
    }


def _doc(*rows):
    return {"format": "attnlab-dispatch-table/1", "machine": {}, "shape": {}, "rows": list(rows)}


@pytest.fixture
def use_table(tmp_path):
    """Install a table written to a file (as the benchmark writes it); restore after."""

    def install(doc) -> Path:
        path = tmp_path / "table.json"
        path.write_text(json.dumps(doc))
        set_dispatch_table(path)
        return path

    yield install
    set_dispatch_table()  # back to the default (environment / packaged file) on next use


def _qkv(T=8, S=None, dtype=torch.float32, H=2, D=16, grad=False):
    gen = torch.Generator().manual_seed(T)
    S = T if S is None else S
    q = torch.randn(1, H, T, D, generator=gen).to(dtype).requires_grad_(grad)
    k = torch.randn(1, H, S, D, generator=gen).to(dtype).requires_grad_(grad)
    v = torch.randn(1, H, S, D, generator=gen).to(dtype).requires_grad_(grad)
    return q, k, v


# --- the shipped table -----------------------------------------------------------------------


def test_shipped_table_is_valid_and_covers_the_grid():
    table = load_dispatch_table(DEFAULT_TABLE_PATH, KNOWN)
    assert table.machine["threads"] >= 1 and "others_busy_before" in table.machine
    for dtype in ("float32", "bfloat16"):
        for pass_ in ("forward", "forward+backward"):
            for mask in ("causal", "none", "padding"):
                rows = [r for r in table.rows if (r.dtype, r.pass_, r.mask) == (dtype, pass_, mask)]
                assert rows, (dtype, pass_, mask)
                rows.sort(key=lambda r: r.t_from)
                assert rows[0].t_from == 0 and rows[-1].t_below is None
                for a, b in itertools.pairwise(rows):
                    assert a.t_below == b.t_from  # no gaps: every length has a row
                for r in rows:  # each row ranks by the times it was measured at
                    for t, per in r.ms.items():
                        ranked = [n for n in r.order if n in per]
                        times = [per[n] for n in ranked]
                        assert times[1:] == sorted(times[1:]), (r.index, t)
                        assert times[0] <= min(times) * 1.03, (r.index, t)  # ties: fixed order


def test_the_table_ships_in_the_package():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"data/*.json"' in pyproject
    assert DEFAULT_TABLE_PATH.parent == ROOT / "src" / "attnlab" / "data"


# --- reading and validating ----------------------------------------------------------------


def test_a_table_is_read_and_looked_up(tmp_path):
    doc = _doc(_row(["math", "sdpa"], t_below=100), _row(["sdpa", "math"], t_from=100))
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    table = load_dispatch_table(path, KNOWN)
    assert table.lookup("float32", "forward", "causal", 64, 64).index == 0
    assert table.lookup("float32", "forward", "causal", 128, 128).index == 1
    # T != S: the row whose sqrt(T*S) range holds the call (1 x 4096 -> 64)
    assert table.lookup("float32", "forward", "causal", 1, 4096).index == 0
    assert table.lookup("bfloat16", "forward", "causal", 64, 64) is None
    assert table.lookup("float32", "forward+backward", "causal", 64, 64) is None
    assert table.lookup("float32", "forward", "padding", 64, 64) is None


def _mutate(path_, value):
    def f(doc):
        target = doc
        for p in path_[:-1]:
            target = target[p]
        if value is KeyError:
            del target[path_[-1]]
        else:
            target[path_[-1]] = value
        return doc

    return f


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda d: [], r"`\(top level\)` must be a JSON object"),
        (_mutate(["format"], "attnlab-dispatch-table/0"), r"`format` must be"),
        (_mutate(["rows"], []), r"`rows` must be a non-empty list"),
        (_mutate(["rows", 0, "dtype"], "int8"), r"`rows\[0\]\.dtype` must be one of"),
        (_mutate(["rows", 1, "pass"], "backward"), r"`rows\[1\]\.pass` must be one of"),
        (_mutate(["rows", 0, "mask"], ""), r"`rows\[0\]\.mask` must be a mask kind"),
        (_mutate(["rows", 0, "t_from"], -1), r"`rows\[0\]\.t_from` must be a number >= 0"),
        (_mutate(["rows", 0, "t_below"], 0), r"`rows\[0\]\.t_below` must be null or a number >"),
        (_mutate(["rows", 0, "order"], []), r"`rows\[0\]\.order` must be a non-empty list"),
        (_mutate(["rows", 0, "order"], ["sdpa", "sdpa"]), r"distinct backend names"),
        (_mutate(["rows", 0, "order"], ["flash9"]), r"backend names among .* \['flash9'\]"),
        (_mutate(["rows", 0, "ms", "16"], {"sdpa": -1}), r"`rows\[0\]\.ms\[16\]\[sdpa\]`"),
        (_mutate(["rows", 1, "t_from"], 50), r"rows\[0\] and rows\[1\] .* overlap"),
    ],
)
def test_a_malformed_table_is_a_clear_error(tmp_path, mutate, match):
    good = _doc(_row(["math", "sdpa"], t_below=100), _row(["sdpa", "math"], t_from=100))
    load_dispatch_table(_write(tmp_path, good), KNOWN)  # the unmutated table is fine
    path = _write(tmp_path, mutate(copy.deepcopy(good)))
    with pytest.raises(DispatchTableError, match=match) as info:
        load_dispatch_table(path, KNOWN)
    msg = str(info.value)
    assert str(path) in msg and "--write-table" in msg  # names the file and the fix


def _write(tmp_path, doc) -> Path:
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    return path


def test_a_table_that_is_not_json_is_a_clear_error(tmp_path):
    path = tmp_path / "t.json"
    path.write_text('{"format": "attnlab-dispatch-table/1", rows: [')
    with pytest.raises(DispatchTableError, match=r"t\.json is malformed: not JSON"):
        set_dispatch_table(path)
    assert isinstance(DispatchTableError("x"), ValueError)


def test_a_malformed_table_fails_the_call_that_loads_it(tmp_path, monkeypatch):
    path = _write(tmp_path, _doc(_row(["sdpa"], mask="")))
    monkeypatch.setenv("ATTNLAB_DISPATCH_TABLE", str(path))
    set_dispatch_table()  # load on next use, from the environment
    try:
        q, k, v = _qkv()
        with pytest.raises(DispatchTableError, match=r"rows\[0\]\.mask"):
            scaled_dot_product_attention(q, k, v, is_causal=True)
        # a backend asked for by name needs no table
        scaled_dot_product_attention(q, k, v, is_causal=True, backend="sdpa")
    finally:
        monkeypatch.delenv("ATTNLAB_DISPATCH_TABLE")
        set_dispatch_table()


# --- a missing table -------------------------------------------------------------------------


def test_a_missing_table_falls_back_to_the_fixed_order(tmp_path, monkeypatch):
    monkeypatch.delenv("ATTNLAB_DISPATCH_TABLE", raising=False)
    monkeypatch.setattr(backends, "DEFAULT_TABLE_PATH", tmp_path / "absent.json")
    set_dispatch_table()
    try:
        assert dispatch_table() is None
        q, k, v = _qkv()
        exp = explain_dispatch(q, k, v, is_causal=True)
        assert exp.chosen == "sdpa"  # the fixed order's first
        assert "fixed order sdpa > blockwise > math" in exp.decided_by
        assert "absent.json is missing" in exp.decided_by
        out = scaled_dot_product_attention(q, k, v, is_causal=True)
        mask = torch.ones(8, 8, dtype=torch.bool).tril()
        torch.testing.assert_close(
            out, reference_attention(q, k, v, mask)[0].float(), **tol(torch.float32)
        )
    finally:
        set_dispatch_table()


def test_table_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNLAB_DISPATCH_TABLE", "none")
    set_dispatch_table()
    assert dispatch_table() is None
    monkeypatch.setenv("ATTNLAB_DISPATCH_TABLE", str(tmp_path / "nope.json"))
    set_dispatch_table()
    with pytest.raises(FileNotFoundError, match=r"ATTNLAB_DISPATCH_TABLE=.*nope\.json"):
        dispatch_table()
    monkeypatch.setenv("ATTNLAB_DISPATCH_TABLE", str(_write(tmp_path, _doc(_row(["math"])))))
    set_dispatch_table()
    assert isinstance(dispatch_table(), DispatchTable)
    monkeypatch.delenv("ATTNLAB_DISPATCH_TABLE")
    set_dispatch_table()


# --- the table decides, and says so ------------------------------------------------------------


def test_the_table_decides_and_the_explanation_names_the_row(use_table):
    use_table(_doc(_row(["math", "sdpa", "blockwise"], t_below=32), _row(["blockwise"], t_from=32)))
    q, k, v = _qkv(T=8)
    exp = explain_dispatch(q, k, v, is_causal=True)
    assert exp.chosen == "math"
    assert exp.decided_by.startswith("dispatch table row 0 (float32, forward, causal")
    assert "math 1 < sdpa 2 < blockwise 3 ms at T=16" in exp.decided_by
    reasons = dict(exp.reasons)
    assert "table row 0 ranks math < sdpa < blockwise" in reasons["sdpa"]
    assert "decided by: dispatch table row 0" in str(exp)
    assert resolve_call(q, k, v, None, 0.0, True, None, "auto", False)[0].name == "math"
    out = scaled_dot_product_attention(q, k, v, is_causal=True)
    ref = reference_attention(q, k, v, torch.ones(8, 8, dtype=torch.bool).tril())[0]
    torch.testing.assert_close(out, ref.float(), **tol(torch.float32))

    q, k, v = _qkv(T=64)
    exp = explain_dispatch(q, k, v, is_causal=True)
    assert exp.chosen == "blockwise" and "row 1" in exp.decided_by
    # Backends the row does not rank come after it, in the fixed order; math last.
    assert "capable, but blockwise is faster" in dict(exp.reasons)["sdpa"]
    # A call no row covers (no mask; bf16; backward) uses the fixed order and says why.
    exp = explain_dispatch(q, k, v)
    assert exp.chosen == "sdpa" and "no table row for float32, forward, mask 'none'" in (
        exp.decided_by
    )
    qg, kg, vg = _qkv(T=8, grad=True)
    exp = explain_dispatch(qg, kg, vg, is_causal=True)
    assert exp.chosen == "sdpa" and "forward+backward" in exp.decided_by


def test_capability_reasons_win_over_the_table(use_table):
    use_table(_doc(_row(["blockwise", "math", "sdpa"]), _row(["sdpa", "math"], mask="padding")))
    q, k, v = _qkv(T=8)
    # blockwise ranks first but cannot do dropout: the next capable backend in the row.
    exp = explain_dispatch(q, k, v, is_causal=True, dropout_p=0.1)
    assert exp.chosen == "math"
    assert "not chosen: blockwise does not implement attention dropout" in str(exp)
    # sdpa ranks first for padding but has no soft-capping: the row's next, math.
    small_pad = PaddingMask.from_lengths([6], 8)
    assert explain_dispatch(q, k, v, small_pad).chosen == "sdpa"
    exp = explain_dispatch(q, k, v, small_pad, softcap=30.0)
    assert exp.chosen == "math" and "no logit soft-capping" in dict(exp.reasons)["sdpa"]
    # sdpa ranks first for padding, but would materialise a huge dense mask: it steps
    # aside for blockwise, and the O(T*S) math is not chosen either.
    big = torch.zeros(1, 1, 1, 1).expand(1, 2, 8192, 16)
    pad = PaddingMask(torch.ones(1, 8192, dtype=torch.bool))
    exp = explain_dispatch(big, big, big, pad)
    assert exp.chosen == "blockwise" and "materialised" in dict(exp.reasons)["sdpa"]
    # The ring backend is never chosen by auto, whatever a table says.
    assert "ring: not chosen" in str(explain_dispatch(q, k, v, is_causal=True))


def test_auto_sends_a_narrow_window_over_long_keys_to_blockwise():
    # PyTorch's kernel would compute every score of a 1,024 x 1,024 call and mask three
    # quarters of them; blockwise skips the tiles outside the band (5x at 4,096).
    long = torch.zeros(1, 1, 1, 1).expand(1, 2, 1024, 16)
    exp = explain_dispatch(long, long, long, SlidingWindowMask(256))
    assert exp.chosen == "blockwise" and "256 of 1024 keys" in dict(exp.reasons)["sdpa"]
    # shorter calls, and a window that covers the keys, stay on PyTorch's kernel
    short = torch.zeros(1, 1, 1, 1).expand(1, 2, 512, 16)
    assert explain_dispatch(short, short, short, SlidingWindowMask(128)).chosen == "sdpa"
    assert explain_dispatch(long, long, long, SlidingWindowMask(1024)).chosen == "sdpa"
    # and the answer is the window's: blockwise against the reference on real numbers
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 1024, 16, generator=g) for _ in range(3))
    out = scaled_dot_product_attention(q, k, v, SlidingWindowMask(256))
    allowed = SlidingWindowMask(256).dense(1024, 1024)
    want = reference_attention(q, k, v, allowed)[0].float()
    torch.testing.assert_close(out, want, **tol(q.dtype))


@pytest.mark.parametrize(
    ("mask", "T", "S", "kind"),
    [
        (None, 4, 4, "none"),
        (CausalMask(), 4, 4, "causal"),
        (CausalMask(), 1, 4, "causal_offset"),
        (CausalMask("top_left"), 1, 4, "causal"),
        (PaddingMask.from_lengths([3], 4), 4, 4, "padding"),
        (SlidingWindowMask(2), 4, 4, "sliding_window"),
        (PaddingMask.from_lengths([3], 4) & CausalMask(), 4, 4, "and"),
    ],
)
def test_mask_kind(mask, T, S, kind):
    assert mask_kind(mask, T, S) == kind


# --- the decision cache ---------------------------------------------------------------------


def test_cache_hit_returns_the_same_decision_and_keys_tell_calls_apart(use_table):
    use_table(
        _doc(
            _row(["math", "sdpa"]),
            _row(["blockwise", "sdpa"], dtype="bfloat16"),
            _row(["sdpa"], mask="padding"),
            _row(["blockwise", "math"], pass_="forward+backward"),
        )
    )
    clear_dispatch_cache()

    def chosen(*args, **kw):
        return resolve_call(*args, **kw)[0].name

    q, k, v = _qkv(T=8)
    assert chosen(q, k, v, None, 0.0, True, None, "auto", False) == "math"
    assert dispatch_cache_info() == backends.DispatchCacheInfo(hits=0, misses=1, size=1)
    assert chosen(q, k, v, None, 0.0, True, None, "auto", False) == "math"
    assert dispatch_cache_info().hits == 1 and dispatch_cache_info().size == 1
    # New tensors of the same signature hit too.
    q2, k2, v2 = _qkv(T=8)
    assert chosen(q2, k2, v2, None, 0.0, True, None, "auto", False) == "math"
    assert dispatch_cache_info().hits == 2
    # A different dtype, mask kind, pass or shape is a different key, with its own decision.
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    assert chosen(qb, kb, vb, None, 0.0, True, None, "auto", False) == "blockwise"
    pad = PaddingMask.from_lengths([6], 8)
    assert chosen(q, k, v, pad, 0.0, False, None, "auto", False) == "sdpa"
    qg, kg, vg = _qkv(T=8, grad=True)
    assert chosen(qg, kg, vg, None, 0.0, True, None, "auto", False) == "blockwise"
    with torch.no_grad():  # no autograd: the forward pass, the first call's key (a hit)
        assert chosen(qg, kg, vg, None, 0.0, True, None, "auto", False) == "math"
    q3, k3, v3 = _qkv(T=9)
    assert chosen(q3, k3, v3, None, 0.0, True, None, "auto", False) == "math"
    assert dispatch_cache_info() == backends.DispatchCacheInfo(hits=3, misses=5, size=5)
    # Changing the table forgets every decision; the same call is decided again.
    use_table(_doc(_row(["sdpa", "math"])))
    assert dispatch_cache_info().size == 0
    assert chosen(q, k, v, None, 0.0, True, None, "auto", False) == "sdpa"


def test_cache_keeps_errors_for_bad_input():
    q, k, v = _qkv(T=8)
    scaled_dot_product_attention(q, k, v, is_causal=True)
    scaled_dot_product_attention(q, k, v, is_causal=True)  # cached now
    with pytest.raises(TypeError, match=r"`is_causal` must be a bool, got int"):
        scaled_dot_product_attention(q, k, v, is_causal=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`dropout_p` must be in \[0, 1\)"):
        scaled_dot_product_attention(q, k, v, dropout_p=1.5)
    with pytest.raises(TypeError, match=r"`dropout_p` must be a float, got bool"):
        scaled_dot_product_attention(q, k, v, dropout_p=False)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"same head dim as `query`"):
        scaled_dot_product_attention(q, k[..., :8], v, is_causal=True)
    for _ in range(2):  # a refused backend is refused every time, never cached
        with pytest.raises(ValueError, match="blockwise does not implement attention dropout"):
            scaled_dot_product_attention(q, k, v, dropout_p=0.1, backend="blockwise")
    with pytest.raises(ValueError, match=r"attn_mask.*broadcast"):
        scaled_dot_product_attention(q, k, v, torch.ones(8, 7, dtype=torch.bool))


def test_a_cache_hit_uses_this_calls_mask():
    """Same mask structure, different contents: each call gets its own mask applied."""
    q, k, v = _qkv(T=8)
    for n in (8, 5, 2, 0):
        pad = PaddingMask.from_lengths([n], 8)
        for attn_mask in (pad, pad.valid[:, None, None, :]):
            for causal in (False, True):
                out = scaled_dot_product_attention(q, k, v, attn_mask, is_causal=causal)
                dense = pad.valid[:, None, None, :].expand(1, 2, 8, 8)
                if causal:
                    dense = dense & torch.ones(8, 8, dtype=torch.bool).tril()
                ref = reference_attention(q, k, v, dense)[0].float()
                torch.testing.assert_close(out, ref, **tol(torch.float32), msg=f"{n} {causal}")
    bias = torch.randn(8, 8)
    for scale in (0.5, 0.25):
        out = scaled_dot_product_attention(q, k, v, bias, scale=scale)
        ref = reference_attention(q, k, v, bias=bias, scale=scale)[0].float()
        torch.testing.assert_close(out, ref, **tol(torch.float32))


# --- the writer agrees with the reader ----------------------------------------------------------


def _bench_module():
    spec = importlib.util.spec_from_file_location(
        "bench_attention", ROOT / "benchmarks" / "bench_attention.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_benchmarks_rows_make_a_valid_table_of_crossovers():
    bench = _bench_module()
    cells = []
    for T, ms in [(16, (3, 1, 2)), (32, (3, 1, 2)), (64, (1, 2, 3)), (128, (1.02, 3, 1))]:
        cells.append(
            {
                "dtype": "bfloat16",
                "pass": "forward+backward",
                "mask": "causal",
                "T": T,
                "ms": dict(zip(("sdpa", "math", "blockwise"), ms, strict=True)),
            }
        )
    rows = bench.table_rows(cells)
    table = DispatchTable.from_json(_doc(*rows), "", KNOWN)
    assert [r.order for r in table.rows] == [
        ("math", "blockwise", "sdpa"),
        ("sdpa", "math", "blockwise"),
        ("sdpa", "blockwise", "math"),
    ]  # 16 and 32 share a ranking: one row; at 128 blockwise wins by 2%, a tie: sdpa first
    assert table.rows[0].t_from == 0 and table.rows[0].t_below == round(math.sqrt(32 * 64), 1)
    assert table.rows[-1].t_below is None
    assert table.lookup("bfloat16", "forward+backward", "causal", 100, 100).index == 2


def test_a_backend_whose_capability_depends_on_state_is_not_cached(monkeypatch):
    """ring-like: capable only while some outside state holds; asked again every call."""
    state = {"up": True}
    flaky = backends.Backend(
        name="flaky",
        run=backends.get_backend("math").run,
        why_not=lambda r: None if state["up"] else "flaky needs its service up",
        cache_decisions=False,
    )
    monkeypatch.setitem(backends._REGISTRY, "flaky", flaky)
    clear_dispatch_cache()
    try:
        q, k, v = _qkv(T=8)
        scaled_dot_product_attention(q, k, v, backend="flaky")
        assert dispatch_cache_info().size == 0
        state["up"] = False
        with pytest.raises(ValueError, match="flaky needs its service up"):
            scaled_dot_product_attention(q, k, v, backend="flaky")
    finally:
        clear_dispatch_cache()


def test_the_benchmark_checks_that_the_machine_is_quiet(capsys):
    import argparse

    bench = _bench_module()
    meter = bench.QuietMeter().start()
    assert 0.0 <= meter.others() <= 1.0
    args = argparse.Namespace(max_busy=1.0, wait_quiet=0.0, allow_busy=False)
    state = bench.wait_until_quiet(args, 0.2)  # nothing can use more than all of the machine
    assert state["quiet"] is True and 0.0 <= state["others_busy_before"] <= 1.0
    assert len(state["loadavg_before"]) == 3
    args = argparse.Namespace(max_busy=-1.0, wait_quiet=0.0, allow_busy=False)
    with pytest.raises(SystemExit) as info:  # never quiet enough: refuses to measure
        bench.wait_until_quiet(args, 0.2)
    assert info.value.code == 2 and "--allow-busy" in capsys.readouterr().err
    args.allow_busy = True
    assert bench.wait_until_quiet(args, 0.2)["quiet"] is False  # measured anyway, and said so


def test_the_grid_runs_and_draws(tmp_path, capsys):
    """One tiny cell of ``bench_attention.py --grid``: measured, ranked, printed, drawn."""
    import argparse

    bench = _bench_module()
    args = argparse.Namespace(
        dtypes="bfloat16", passes="forward+backward", masks="causal", grid_min_t=16,
        grid_max_t=16, grid_reps=1, math_max_t=16, second_look=True,
    )  # fmt: skip
    cells = bench.measure_grid(args, with_auto=True)
    (cell,) = cells
    assert set(cell["ms"]) == {"sdpa", "blockwise", "math", "auto"}
    assert all(ms > 0 for ms in cell["ms"].values())
    assert cell["fastest"] == min(("sdpa", "blockwise", "math"), key=cell["ms"].get)
    assert cell["ratio"] == pytest.approx(cell["ms"]["auto"] / cell["ms"][cell["fastest"]])
    assert cell["auto_chose"] in ("sdpa", "blockwise", "math")
    DispatchTable.from_json(_doc(*bench.table_rows(cells)), "", KNOWN)
    bench.print_grid(cells)
    assert "worst ratio" in capsys.readouterr().out
    png = tmp_path / "grid.png"
    bench.plot_grid(cells, str(png), "test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_grid_takes_a_second_look_at_close_and_failing_cells(monkeypatch, capsys):
    """A failing or close cell is timed again after the grid; every contender keeps its
    minimum over both looks, and the report counts the first look too."""
    import argparse

    bench = _bench_module()
    looks = {  # (T, look) -> seconds: T=16 fails at first, T=32 fails twice, T=64 is clear
        (16, 0): {"sdpa": 1.0, "blockwise": 2.0, "math": 3.0, "auto": 1.3},
        (16, 1): {"sdpa": 1.1, "blockwise": 2.0, "math": 3.0, "auto": 1.02},
        (32, 0): {"sdpa": 2.0, "blockwise": 1.0, "math": 3.0, "auto": 2.0},
        (32, 1): {"sdpa": 1.9, "blockwise": 0.9, "math": 3.0, "auto": 1.9},
        (64, 0): {"sdpa": 1.0, "blockwise": 2.0, "math": 3.0, "auto": 1.0},
    }
    seen: list[int] = []

    def fake(args, cell, with_auto, rounds, budget_s=6.0, settle=True):
        assert settle == (cell["T"] not in seen)  # the second look is not rechecked again
        look = seen.count(cell["T"])
        seen.append(cell["T"])
        return dict(looks[(cell["T"], look)])

    monkeypatch.setattr(bench, "_time_cell", fake)
    args = argparse.Namespace(
        dtypes="float32", passes="forward", masks="causal", grid_min_t=16, grid_max_t=64,
        grid_reps=1, math_max_t=64, second_look=True,
    )  # fmt: skip
    cells = {c["T"]: c for c in bench.measure_grid(args, with_auto=True)}
    assert seen == [16, 32, 64, 16, 32]  # the clear cell is not timed again
    assert cells[16]["ms"]["sdpa"] == pytest.approx(1000.0)  # min over both looks
    assert cells[16]["ratio"] == pytest.approx(1.02) and cells[16]["first_ratio"] == 1.3
    assert cells[32]["ratio"] == pytest.approx(1.9 / 0.9) and cells[32]["fastest"] == "blockwise"
    assert "first_ratio" not in cells[64]
    bench.print_grid(list(cells.values()))
    out = capsys.readouterr().out
    assert "cells above 1.05x: 1 of 3 (2 at the first look)" in out
    assert "(first look 1.30x)" in out
    # Building the table: only cells whose two fastest backends are close look again.
    seen.clear()
    looks[(64, 0)] = {"sdpa": 1.0, "blockwise": 1.05, "math": 3.0}
    looks[(64, 1)] = {"sdpa": 1.2, "blockwise": 0.9, "math": 3.0}
    for key in [(16, 0), (32, 0)]:
        looks[key].pop("auto")
    table = {c["T"]: c for c in bench.measure_grid(args, with_auto=False)}
    assert seen == [16, 32, 64, 64]
    # Ranking, each backend counts with its slower look: fast in one state of the machine
    # and slow in the other ranks behind fast in both.
    assert table[64]["ms"] == pytest.approx({"sdpa": 1200.0, "blockwise": 1050.0, "math": 3000.0})
    assert bench.ranking(table[64]["ms"])[0] == "blockwise"
    args.second_look = False
    seen.clear()
    bench.measure_grid(args, with_auto=False)
    assert seen == [16, 32, 64]
