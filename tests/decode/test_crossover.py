"""Each int format's crossover to dense prompt products: measured here, cached, used."""

from __future__ import annotations

import json
import os

import pytest
import torch

from attnlab.paths import CACHE_ENV
from attnlab.quant import Int4Linear, Int8Linear, Q8Linear, crossover
from attnlab.quant.crossover import CROSSOVER_ENV, KERNEL_ALWAYS, choose


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """An empty cache, the measuring mode, and no crossover or GEMM choice remembered by
    this process (an earlier test's would otherwise answer, whatever the order)."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(CROSSOVER_ENV, raising=False)
    monkeypatch.setattr(crossover, "_found", {})
    monkeypatch.setattr(crossover, "_gemm", {})
    return tmp_path


SHAPE = (64, 64)


@pytest.fixture
def small_probe(monkeypatch):
    """Fewer row counts and repeats (a layer's own shape is measured: 64 x 64 here)."""
    monkeypatch.setattr(crossover, "PROBE_ROWS", (16, 32, 64))
    monkeypatch.setattr(crossover, "PROBE_REPEATS", 1)


def test_choose_takes_dense_from_where_it_wins_at_every_larger_count():
    rows = (16, 32, 64, 128)
    k = [1, 2, 4, 8]
    assert choose(rows, k, [2, 3, 3, 5], default=16) == 64
    assert choose(rows, k, [0.5, 3, 3, 5], default=16) == 64  # a win below a loss is noise
    assert choose(rows, k, [0.5, 1, 2, 4], default=1000) == 16
    assert choose(rows, k, [2, 3, 3, 9], default=16) == KERNEL_ALWAYS  # the kernel at the top
    # closer than the margin: a tie, which the default decides
    assert 1 - crossover.MARGIN < 0.95
    assert choose(rows, k, [0.95 * t for t in k], default=64) == 64
    assert choose(rows, k, [1.05 * t for t in k], default=32) == 32
    assert choose(rows, k, [1.05 * t for t in k], default=1000) == KERNEL_ALWAYS
    assert choose(rows, k, [1, 2, 4, 4], default=1000) == 128  # clearly faster: measured
    with pytest.raises(ValueError, match="one length"):
        choose(rows, [1, 2], [1, 2], default=16)


def test_measuring_times_the_kernel_and_the_dense_product_on_their_own_sides(
    fresh, small_probe, monkeypatch
):
    """The timings land on the side that ran: here dense is made to win from 32 rows."""
    ran = []

    def fake_timed(layer, x):
        dense = layer.dense_from_tokens == 1
        ran.append(("dense" if dense else "kernel", x.shape[0]))
        if dense:
            return 1.0 if x.shape[0] >= 32 else 3.0
        return 2.0

    monkeypatch.setattr(crossover, "_timed", fake_timed)
    found = crossover.measure(Int4Linear, SHAPE)
    assert found.dense_from == 32
    assert found.rows == (16, 32, 64)
    assert found.kernel_ms == (2.0, 2.0, 2.0) and found.dense_ms == (3.0, 1.0, 1.0)
    # both sides, warm-up round included, alternating which goes first
    assert ran[:4] == [("kernel", 16), ("dense", 16), ("dense", 16), ("kernel", 16)]
    assert "measured on this machine" in found.source


def test_a_measurement_is_cached_per_machine_and_shape_and_read_back(
    fresh, small_probe, monkeypatch
):
    found = crossover.crossover(Int4Linear, SHAPE)
    assert found is not None and found.rows == (16, 32, 64)
    assert found.dense_from in (16, 32, 64, KERNEL_ALWAYS)
    (path,) = (fresh / "crossover").glob("*.json")
    stored = json.loads(path.read_text())
    assert stored["machine"]["torch"] == torch.__version__
    assert stored["formats"]["int4 64x64"]["dense_from"] == found.dense_from

    # another process (nothing remembered) reads it back and measures nothing
    monkeypatch.setattr(crossover, "_found", {})
    monkeypatch.setattr(crossover, "measure", lambda cls, shape: pytest.fail("measured again"))
    again = crossover.crossover(Int4Linear, SHAPE)
    assert again is not None and again.dense_from == found.dense_from
    assert f"cached in {path}" in again.source
    # another format or another shape, not measured yet: none without measuring
    assert crossover.crossover(Q8Linear, SHAPE, measure_now=False) is None
    assert crossover.crossover(Int4Linear, (128, 64), measure_now=False) is None
    assert list(crossover.measured_here()[1]) == ["int4 64x64"]


def test_a_head_is_measured_on_a_slice_of_its_rows(monkeypatch):
    built = []

    class BuiltError(Exception):
        pass

    def from_float(weight):
        built.append(tuple(weight.shape))
        raise BuiltError

    monkeypatch.setattr(crossover, "PROBE_MAX_ROWS", 256)
    monkeypatch.setattr(Q8Linear, "from_float", from_float)
    with pytest.raises(BuiltError):
        crossover.measure(Q8Linear, (262_144, 640))  # a Gemma-sized head: 256 of its rows
    with pytest.raises(BuiltError):
        crossover.measure(Q8Linear, (96, 640))
    assert built == [(256, 640), (96, 640)]


def test_other_kernel_settings_are_another_machine(fresh, monkeypatch):
    here = crossover._cache_file(crossover.machine_key())
    current = os.environ.get("ATEN_CPU_CAPABILITY")  # set when the suite runs held to a class
    with monkeypatch.context() as m:
        m.setenv("ATEN_CPU_CAPABILITY", "default" if current == "avx2" else "avx2")
        assert crossover._cache_file(crossover.machine_key()) != here
    assert crossover._cache_file(crossover.machine_key()) == here
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert crossover._cache_file(crossover.machine_key()) != here
    finally:
        torch.set_num_threads(threads)


def test_a_damaged_cache_file_is_measured_again(fresh, small_probe):
    path = crossover._cache_file(crossover.machine_key())
    path.parent.mkdir(parents=True)
    for text in ["{", json.dumps({"formats": {"int8 64x64": {"dense_from": "x"}}})]:
        path.write_text(text)
        crossover._found.clear()
        found = crossover.crossover(Int8Linear, SHAPE)
        assert found is not None and "measured on this machine" in found.source
        stored = json.loads(path.read_text())["formats"]["int8 64x64"]
        assert stored["dense_from"] == found.dense_from


def test_defaults_and_a_bad_setting(fresh, monkeypatch):
    monkeypatch.setenv(CROSSOVER_ENV, "defaults")
    assert crossover.dense_from(Int4Linear, SHAPE) == Int4Linear.default_dense_from == 128
    assert crossover.dense_from(Q8Linear, SHAPE) == Q8Linear.default_dense_from
    assert not (fresh / "crossover").exists()  # nothing measured
    monkeypatch.setenv(CROSSOVER_ENV, "fast")
    with pytest.raises(ValueError, match="'defaults' or 'measure'"):
        crossover.dense_from(Int4Linear, SHAPE)


def test_a_layer_runs_dense_from_the_crossover_and_decoding_never_measures(fresh, monkeypatch):
    """Fewer rows than the first probe never measure; from there the crossover decides."""
    monkeypatch.setattr(crossover, "measure", lambda cls, shape: pytest.fail("measured"))
    layer = Int4Linear.from_float(torch.randn(64, 64))
    assert layer.dense_from_tokens is None
    x = torch.randn(crossover.FIRST_PROBE_ROWS - 1, 64)
    layer(x)  # decoding and short prompts: the kernel, nothing measured
    assert not layer.runs_dense(x.shape[0])

    memo = ("int4", (64, 64), *crossover._process_settings())
    crossover._found[memo] = crossover.Crossover(48, "set by the test")
    calls = {"mm": 0}
    real_mm = crossover.dense_mm

    def counting_mm(*args, **kwargs):
        calls["mm"] += 1
        return real_mm(*args, **kwargs)

    monkeypatch.setattr(crossover, "dense_mm", counting_mm)
    layer(torch.randn(47, 64))
    assert calls["mm"] == 0  # the kernel
    layer(torch.randn(48, 64))
    assert calls["mm"] == 1  # dequantised, one mm
    layer.dense_from_tokens = 1 << 30  # a layer's own setting decides over the machine's
    layer(torch.randn(48, 64))
    assert calls["mm"] == 1


def test_info_shows_the_crossovers_measured_here_and_where_they_are_kept(
    fresh, small_probe, monkeypatch
):
    from attnlab.cli.info import _info_crossovers

    assert "none measured on this machine yet" in _info_crossovers()
    crossover.crossover(Int4Linear, SHAPE)
    text = _info_crossovers()
    assert f"kept in {crossover._cache_file(crossover.machine_key())}" in text
    (line,) = [ln for ln in text.splitlines() if ln.strip().startswith("int4 64x64:")]
    assert "measured on this machine" in line
    monkeypatch.setenv(CROSSOVER_ENV, "defaults")
    assert "int4 128" in _info_crossovers() and "q8_0 20" in _info_crossovers()


def test_the_float32_gemm_is_measured_once_and_cached(fresh, monkeypatch):
    assert crossover.float32_gemm(measure_now=False) is None
    found = crossover.float32_gemm()
    assert found is not None
    name, why = found
    assert name in crossover.GEMMS and "measured on this machine" in why
    path = crossover._cache_file(crossover.machine_key())
    stored = json.loads(path.read_text())["formats"][crossover.GEMM_ENTRY]
    assert stored["chosen"] == name and set(stored["ms"]) <= set(crossover.GEMMS)
    assert crossover.GEMM_ENTRY not in crossover.measured_here()[1]  # not a crossover
    monkeypatch.setattr(crossover, "_gemm", {})
    monkeypatch.setattr(crossover, "measure_gemm", lambda: pytest.fail("measured again"))
    assert crossover.float32_gemm() == (name, why)
    from attnlab.cli.info import _info_crossovers

    assert f"float32 dense products: {name}" in _info_crossovers()
    monkeypatch.setenv(CROSSOVER_ENV, "defaults")
    assert crossover.float32_gemm() == ("mkl", f"{CROSSOVER_ENV}=defaults")


def test_onednn_wins_only_by_the_margin(monkeypatch):
    clock = iter(range(10**6))

    def fake_counter():
        return next(clock) * 1e-3  # every call takes 1 ms...

    calls = crossover._gemm_calls()
    if "onednn" not in calls:
        pytest.skip("this PyTorch has no oneDNN linear")
    monkeypatch.setattr(crossover.time, "perf_counter", fake_counter)
    chosen, ms = crossover.measure_gemm()
    assert ms == {"mkl": 1.0, "onednn": 1.0} and chosen == "mkl"  # a tie keeps PyTorch's mm


@pytest.mark.parametrize("gemm", ["mkl", "onednn"])
def test_dense_products_on_either_gemm_are_the_float32_product(gemm, monkeypatch):
    if gemm not in crossover._gemm_calls():
        pytest.skip("this PyTorch has no oneDNN linear")
    monkeypatch.setattr(crossover, "chosen_gemm", lambda: gemm)
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(40, 96, generator=g), torch.randn(72, 96, generator=g)
    exact = x.double() @ w.double().T
    bound = 96 * torch.finfo(torch.float32).eps * (x.abs().double() @ w.abs().double().T)
    for weight in (w, w.t().contiguous().t()):  # contiguous, and int4's transposed view
        got = crossover.dense_mm(x, weight)
        assert got.dtype == torch.float32 and got.shape == (40, 72)
        assert ((got.double() - exact).abs() <= bound).all()
    # every float32 format's dense path goes through it
    layer = Int4Linear.from_float(w[:64])
    layer.dense_from_tokens = 16
    torch.testing.assert_close(
        layer.product(x), torch.mm(x, layer.weight.t()), rtol=1e-5, atol=1e-5
    )
    # bfloat16 stays with PyTorch's mm
    xb, wb = x.bfloat16(), w.bfloat16()
    assert torch.equal(crossover.dense_mm(xb, wb), torch.mm(xb, wb.t()))


def test_the_key_counts_the_native_build_a_model_load_would_use(tmp_path, monkeypatch):
    """`attnlab info` (which never builds or loads it) finds the file a model's process
    wrote: the key names the compiled build that would load, not whether one is loaded; another
    build (new kernels, another -march) is another key, measured again."""
    from attnlab import native

    monkeypatch.setattr(native, "_loaded", None)
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "build_dir", lambda: tmp_path)
    monkeypatch.delenv(native.NATIVE_ENV, raising=False)
    assert not native.would_load()  # not built
    (tmp_path / "attnlab_native_0123.so").write_bytes(b"")
    assert native.would_load() and crossover.machine_key()["native"] == tmp_path.name
    other = tmp_path / "other-build"
    other.mkdir()
    (other / "attnlab_native_4567.so").write_bytes(b"")
    monkeypatch.setattr(native, "build_dir", lambda: other)
    assert crossover.machine_key()["native"] == "other-build"
    monkeypatch.setattr(native, "build_dir", lambda: tmp_path)
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    assert not native.would_load()
    monkeypatch.delenv(native.NATIVE_ENV)
    (tmp_path / "failed.log").write_text("a failed build")
    assert not native.would_load()
    (tmp_path / "failed.log").unlink()
    monkeypatch.setattr(native, "_tried", True)  # tried in this process, and not loaded
    assert not native.would_load()
    assert crossover.machine_key()["native"] == "not loaded"


def test_a_failed_measurement_keeps_the_default_for_this_process(fresh, monkeypatch):
    def failing(cls, shape):
        raise RuntimeError("no memory for the probe")

    monkeypatch.setattr(crossover, "measure", failing)
    found = crossover.crossover(Q8Linear, SHAPE)
    assert found is not None and found.dense_from == Q8Linear.default_dense_from
    assert "measuring failed (no memory for the probe)" in found.source
    assert crossover.measured_here()[1] == {}  # nothing cached: measured again next time


def test_float32_linears_run_prompts_on_the_chosen_gemm_and_nothing_else(monkeypatch):
    from torch import nn

    from attnlab.quant import Float32Linear, use_float32_gemm

    g = torch.Generator().manual_seed(7)
    model = nn.Sequential(nn.Linear(96, 80), nn.ReLU(), nn.Linear(80, 64, bias=False))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(3, 20, 96, generator=g)  # 60 rows: a prompt
    with torch.no_grad():
        reference = model(x)
    assert use_float32_gemm(model) is model
    assert all(type(m) is Float32Linear for m in (model[0], model[2]))
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())

    used = []
    real = crossover.dense_mm
    monkeypatch.setattr(crossover, "dense_mm", lambda a, w: used.append(a.shape) or real(a, w))
    seen = []
    model[0].register_forward_hook(lambda mod, inp, out: seen.append(out.shape))
    for gemm in ("mkl", "onednn"):
        if gemm not in crossover._gemm_calls():
            continue
        monkeypatch.setattr(crossover, "chosen_gemm", lambda gemm=gemm: gemm)
        used.clear()
        with torch.inference_mode():
            got = model(x)
        torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-6)
        # oneDNN's GEMM only where it was chosen; PyTorch's own linear otherwise
        assert used == ([(60, 96), (60, 80)] if gemm == "onednn" else [])
    assert seen and seen[-1] == (3, 20, 80)  # hooks fire as on nn.Linear
    # with autograd, or a few rows: nn.Linear's own (gradients flow)
    used.clear()
    y = model(x)
    y.sum().backward()
    assert model[0].weight.grad is not None and used == []
    with torch.no_grad():
        model(x[:, :2])  # 6 rows: decoding
    assert used == []
