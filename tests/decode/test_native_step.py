"""The compiled decode step (attnlab.native) against the Python short loop it replaces.

Both run the same product kernels on the same rows; the compiled one sums norms, RoPE and
attention in another order. In float32 that is a last-bit difference; with bf16 rows
(bf16 / int8 / int4 weights) a last-bit difference can round a product's input the other
way, so those are compared one step at a time from identical caches.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from test_fast_decode import CONFIG, LAYOUTS, _model

from attnlab import native, quant
from attnlab.attention import StaticWindowKVCache
from attnlab.generation import generate
from attnlab.models.decoder import Decoder
from attnlab.models.fast_decode import DecodePlan
from attnlab.quant import quantize_model

# the `ext` fixture builds the module in the first test that needs it (or skips, saying
# why), never at collection, where every worker would wait on the same build
pytestmark = pytest.mark.usefixtures("ext")

# Llama; Qwen3 (QK-norm per head vector); Gemma 3 (sandwich norms, local windows with
# their own RoPE, gelu_tanh, embeddings x sqrt(C), its own scale); Mistral (one window);
# Qwen2 (Q/K/V biases).
NATIVE_LAYOUTS = {
    "llama": {},
    "qwen3-like": LAYOUTS["qwen3-like"],
    "gemma3-like": LAYOUTS["gemma3-like"],
    "mistral-like": LAYOUTS["mistral-like"],
    "qwen2-like": {"qkv_bias": True},
}


def _prepared(layout: str, dtype: str, seed: int = 5):
    model = _model(seed, **NATIVE_LAYOUTS[layout])
    if dtype == "float32":
        model.prepare_decode(share_float=True)
    else:
        quantize_model(model, dtype)
    plan = model.prepare_decode()
    assert plan.rows is not None and plan.native_step() is not None, (layout, dtype)
    return model, plan


def _python_step(plan: DecodePlan, ids: torch.Tensor, caches) -> torch.Tensor:
    native_step, plan._native = plan._native, False
    try:
        return plan.step(ids, caches)
    finally:
        plan._native = native_step


def _copy(caches):
    """The caches as they are, buffers cloned (a window layer's ring keeps its slots)."""
    out = []
    for c in caches:
        new = copy.copy(c)
        new._k, new._v = c._k.clone(), c._v.clone()
        out.append(new)
    return out


def _slot(cache, position):
    """Where ``position`` is in ``cache``'s buffers (a ring of a window's slots wraps)."""
    return position % cache.window if isinstance(cache, StaticWindowKVCache) else position


@pytest.mark.parametrize("layout", sorted(NATIVE_LAYOUTS))
def test_float32_native_step_gives_the_python_loops_logits_tokens_and_caches(layout):
    model, plan = _prepared(layout, "float32")
    ids = torch.randint(0, CONFIG.vocab_size, (2, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        compiled, python = model.new_kv_cache(max_len=16), model.new_kv_cache(max_len=16)
        model(ids[:, :3], kv_cache=compiled)
        model(ids[:, :3], kv_cache=python)
        nxt_c = nxt_p = ids[:, 3:4]
        for _ in range(10):  # positions 3..12: past every window (4, 5)
            a, b = plan.step(nxt_c, compiled), _python_step(plan, nxt_p, python)
            torch.testing.assert_close(a, b, atol=5e-5, rtol=1e-5)
            nxt_c, nxt_p = a[:, -1].argmax(-1, True), b[:, -1].argmax(-1, True)
            assert torch.equal(nxt_c, nxt_p)
    for c, p in zip(compiled, python, strict=True):
        assert c.seq_len == p.seq_len == 13
        torch.testing.assert_close(c._k[:, :, :13], p._k[:, :, :13], atol=5e-5, rtol=1e-5)
        torch.testing.assert_close(c._v[:, :, :13], p._v[:, :, :13], atol=5e-5, rtol=1e-5)


# Caches deeper than attend.h's chunks: several chunks a group whose partial softmaxes are
# merged, shared between the threads. Query heads a group: 2 (Llama's here), 3 (SmolLM2's)
# with a window of all layers shorter than the depth, 4 in one group (Gemma 3's) with its
# local layers' windows shorter than the depth; two rows each. (heads a group, options)
DEPTH_LAYOUTS = {
    "llama": (2, {}),
    "3-heads-a-group-window": (
        3,
        {"num_heads": 6, "num_kv_heads": 2, "head_dim": 32, "sliding_window": 300},
    ),
    "gemma3-one-group": (
        4,
        {**LAYOUTS["gemma3-like"], "num_kv_heads": 1, "layer_windows": (300, None, 300)},
    ),
}


@pytest.mark.parametrize("layout", sorted(DEPTH_LAYOUTS))
def test_a_deep_cache_gives_the_python_loops_logits(layout):
    heads_a_group, options = DEPTH_LAYOUTS[layout]
    model = _model(5, context_length=1200, **options)
    model.prepare_decode(share_float=True)
    plan = model.prepare_decode()
    assert plan.native_step() is not None
    assert heads_a_group == plan.H // plan.G
    ids = torch.randint(0, CONFIG.vocab_size, (2, 1105), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        compiled, python = model.new_kv_cache(max_len=1200), model.new_kv_cache(max_len=1200)
        model(ids[:, :1100], kv_cache=compiled)
        model(ids[:, :1100], kv_cache=python)
        for t in range(1100, 1105):
            a = plan.step(ids[:, t : t + 1], compiled)
            b = _python_step(plan, ids[:, t : t + 1], python)
            torch.testing.assert_close(a, b, atol=5e-5, rtol=1e-5)


def _assert_same_choice_beyond_ties(got: torch.Tensor, want: torch.Tensor, step: int) -> int:
    """The same greedy token in every row whose top two logits (of ``want``) are apart by
    more than a few flipped bf16 roundings.

    With bf16 rows the head's output itself is bf16-rounded: its logits lie on a grid of
    2^-7 relative steps, so two of them tie exactly often enough, and one product input
    rounded the other way moves a logit by a step or two. Below ``8`` steps of the largest
    logit's magnitude the choice is a coin toss for either loop; above it a wrong layer
    shows. Returns how many rows had a clear choice.

    Shape:
        got, want ``(B, V)``.
    """
    top2 = want.topk(2, dim=-1).values  # (B, 2)
    step_size = 2.0**-7 * top2[:, 0].abs().clamp_min(1.0)  # (B,)
    clear = (top2[:, 0] - top2[:, 1]) > 8 * step_size  # (B,)
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear]), step
    return int(clear.sum())


# int4 twice, PyTorch's int4 kernels reporting AVX-512 and AVX2 (the capability stubbed): the
# q4 kind (attnlab's own) where the build sums integer products or PyTorch's are AVX2 ones,
# PyTorch's int4 kernel for a plain build beside its AVX-512 ones (quant.int4.native_q4)
@pytest.mark.parametrize("dtype", ["bfloat16", "int8", "int4@AVX512", "int4@AVX2", "q8_0"])
@pytest.mark.parametrize("layout", sorted(NATIVE_LAYOUTS))
def test_native_step_with_bf16_rows_matches_the_python_loop_step_by_step(
    layout, dtype, monkeypatch
):
    dtype, _, capability = dtype.partition("@")
    if capability:
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    model, plan = _prepared(layout, dtype)
    if capability:
        spec = quant.native_product(plan.layers[0].out)
        assert spec is not None
        integer = bool(getattr(native.loaded(), "Q4_INTEGER", False))
        pytorchs = capability == "AVX512" and not integer
        assert spec.kind == (quant.NATIVE_INT4 if pytorchs else quant.NATIVE_Q4)
    ids = torch.randint(0, CONFIG.vocab_size, (2, 14), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        caches = model.new_kv_cache(max_len=16)
        model(ids[:, :3], kv_cache=caches)
        clear = 0
        for t in range(3, 13):
            python = _copy(caches)
            a = plan.step(ids[:, t : t + 1], caches)
            b = _python_step(plan, ids[:, t : t + 1], python)
            # one step from identical caches: a flipped bf16 rounding moves the logits by
            # a fraction of a percent, a wrong layer by tens of percent
            assert ((a - b).norm() / b.norm()).item() < 1e-2, t
            clear += _assert_same_choice_beyond_ties(a[:, -1], b[:, -1], t)
            for c, p in zip(caches, python, strict=True):
                k, want = c._k[:, :, _slot(c, t)], p._k[:, :, _slot(p, t)]
                assert ((k - want).norm() / want.norm()).item() < 1e-2
                v, want = c._v[:, :, _slot(c, t)], p._v[:, :, _slot(p, t)]
                assert ((v - want).norm() / want.norm()).item() < 1e-2
    assert clear >= 5, f"only {clear} of 20 greedy choices were clear of ties"


def test_generation_takes_the_native_step(monkeypatch):
    model, _ = _prepared("llama", "int4")
    ids = torch.tensor([[3, 1, 4]])
    calls = []
    monkeypatch.setattr(
        DecodePlan, "_step_short", lambda *a: calls.append(1) or pytest.fail("Python loop")
    )
    out = generate(model, ids, 12)
    assert out.shape == (1, 15) and not calls


@pytest.mark.parametrize("layout", ["llama", "gemma3-like"])
def test_float32_native_generation_is_the_full_recomputes(layout):
    """60 tokens from a one-token prompt: past the windows and the context (48), so the
    window slides and a prefill rewrites the caches the compiled step wrote."""
    model, _ = _prepared(layout, "float32")
    ids = torch.tensor([[3]])
    with torch.no_grad():
        slow = generate(model, ids, 60, use_cache=False)
    fast = generate(model, ids, 60)
    assert torch.equal(fast, slow)
    assert not fast.is_inference()


@pytest.mark.parametrize("layout", sorted(NATIVE_LAYOUTS))
def test_a_float16_cache_gives_the_python_loops_logits_and_cache_step_by_step(layout):
    """Both loops read the float16 values the cache holds and write the new position
    rounded to float16. Their float32 keys and values may differ in a last bit, which now
    and then rounds a new slot's value to the next float16 (a relative 2^-11), and the
    layers after it see that: from identical caches the new slots agree within a few such
    roundings, and the logits as far as they move them (a wrong read of the cache would
    move them by tens of percent)."""
    model, plan = _prepared(layout, "float32")
    model.kv_cache_dtype = torch.float16
    ids = torch.randint(0, CONFIG.vocab_size, (2, 14), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        caches = model.new_kv_cache(max_len=16)
        model(ids[:, :3], kv_cache=caches)
        for t in range(3, 13):  # past every window (4, 5)
            python = _copy(caches)
            a = plan.step(ids[:, t : t + 1], caches)
            b = _python_step(plan, ids[:, t : t + 1], python)
            assert ((a - b).norm() / b.norm()).item() < 1e-3, t
            assert torch.equal(a[:, -1].argmax(-1), b[:, -1].argmax(-1))
            for c, p in zip(caches, python, strict=True):
                assert c._k.dtype == c._v.dtype == torch.float16
                for got, want in ((c._k, p._k), (c._v, p._v)):
                    g, w = got[:, :, _slot(c, t)].float(), want[:, :, _slot(p, t)].float()
                    assert ((g - w).norm() / w.norm()).item() < 2e-3, t


def test_generation_over_a_float16_cache_takes_the_native_step(monkeypatch):
    model, _ = _prepared("gemma3-like", "int4")
    model.kv_cache_dtype = torch.float16
    calls = []
    monkeypatch.setattr(
        DecodePlan, "_step_short", lambda *a: calls.append(1) or pytest.fail("Python loop")
    )
    out = generate(model, torch.tensor([[3, 1, 4]]), 12)
    assert out.shape == (1, 15) and not calls


def test_the_native_step_refuses_a_key_beyond_float16_rather_than_keep_infinity():
    model, plan = _prepared("llama", "float32")
    model.kv_cache_dtype = torch.float16
    with torch.no_grad():
        caches = model.new_kv_cache(max_len=16)
        model(torch.tensor([[1, 2, 3]]), kv_cache=caches)
        # the step's fused Q/K/V product shares the layer's weights: keys of about 1e6
        model.blocks[1].attention.W_key.weight.mul_(1e6)
        with pytest.raises(RuntimeError, match=r"layer 1's new key or value is beyond float16"):
            plan.step(torch.tensor([[4]]), caches)


def test_native_step_refuses_what_it_cannot_call():
    # int8 layers whose width the int8 kernel gets wrong: no native product, Python loop
    torch.manual_seed(0)
    odd = dataclasses.replace(CONFIG, hidden_size=120, intermediate_size=120)
    model = quantize_model(Decoder(odd).eval(), "int8")
    plan = model.prepare_decode()
    assert plan.rows is not None
    assert quant.native_product(plan.layers[0].out) is None  # K = 120: not a multiple of 16
    assert plan.native_step() is None
    with torch.no_grad():
        out = generate(model, torch.tensor([[1, 2]]), 4)
    assert out.shape == (1, 6)


def test_attnlab_native_0_turns_it_off(monkeypatch):
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    assert native.extension() is None
    assert native.why_not_native() == "ATTNLAB_NATIVE=0"
    model = quantize_model(_model(5), "int4")
    assert model.prepare_decode().native_step() is None
    with torch.no_grad():
        assert generate(model, torch.tensor([[1, 2]]), 5).shape == (1, 7)


def test_a_failed_build_is_a_note_once_and_an_error_when_required(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path))
    monkeypatch.delenv(native.NATIVE_ENV, raising=False)
    builds = []

    def broken():
        builds.append(1)
        raise RuntimeError("error: 'at::Tensor' has no member named 'frobnicate'")

    monkeypatch.setattr(native, "_build", broken)
    state = native._loaded, native._why, native._tried
    native._reset()
    try:
        assert native.extension() is None
        why = native.why_not_native()
        assert why is not None and "failed" in why and str(tmp_path) in why
        log = native.build_dir() / "failed.log"
        assert "frobnicate" in log.read_text()
        assert "could not be built" in capsys.readouterr().err
        native._reset()  # a new process: the marker stops a second attempt
        assert native.extension() is None and builds == [1]
        assert "delete it to try again" in (native.why_not_native() or "")
        monkeypatch.setenv(native.NATIVE_ENV, "1")
        native._reset()
        with pytest.raises(RuntimeError, match="ATTNLAB_NATIVE=1"):
            native.extension()
    finally:
        native._loaded, native._why, native._tried = state


def test_the_compiled_module_exports_the_kinds_and_activations_python_names():
    ext = native.extension()
    assert ext is not None
    assert dict(ext.PRODUCT_KINDS) == native.PRODUCT_KINDS
    assert dict(ext.ACTIVATIONS) == {n: i for i, n in enumerate(native.STEP_ACTIVATIONS)}
    kinds = (quant.NATIVE_INT4, quant.NATIVE_INT8, quant.NATIVE_LINEAR, quant.NATIVE_Q8)
    assert (*kinds, quant.NATIVE_Q5, quant.NATIVE_Q4) == tuple(
        native.PRODUCT_KINDS[k] for k in ("int4", "int8", "linear", "q8_0", "q5_0", "q4")
    )


def test_a_build_whose_enums_differ_from_pythons_is_not_used(monkeypatch, tmp_path, capsys):
    import types

    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path))
    monkeypatch.delenv(native.NATIVE_ENV, raising=False)
    stale = types.ModuleType("stale")
    stale.PRODUCT_KINDS = {**native.PRODUCT_KINDS, "q5_0": 6}  # type: ignore[attr-defined]
    stale.ACTIVATIONS = {n: i for i, n in enumerate(native.STEP_ACTIVATIONS)}  # type: ignore[attr-defined]
    monkeypatch.setattr(native, "_build", lambda: stale)
    state = native._loaded, native._why, native._tried
    native._reset()
    try:
        assert native.extension() is None
        why = native.why_not_native() or ""
        assert "PRODUCT_KINDS" in why and "'q5_0': 6" in why and "decode_step.cpp" in why
        assert "not used" in capsys.readouterr().err
        assert not (native.build_dir() / "failed.log").exists()  # the next build retries
        monkeypatch.setenv(native.NATIVE_ENV, "1")
        native._reset()
        with pytest.raises(RuntimeError, match="PRODUCT_KINDS"):
            native.extension()
    finally:
        native._loaded, native._why, native._tried = state


def test_the_compiled_step_takes_one_named_spec_per_layer():
    """Each layer reaches C++ as one NativeLayer whose fields are read by name: a spec
    missing a field is refused with that field's name."""
    from attnlab.models.decode.compiled import NativeLayer

    _, plan = _prepared("llama", "int4")
    ext = native.extension()
    assert ext is not None and plan.path().loop == "compiled"
    C, F = CONFIG.hidden_size, CONFIG.intermediate_size
    step = ext.Step(C, plan.H, plan.G, plan.D, F)
    compiled = plan.native_step()
    assert compiled is not None and compiled.num_layers() == CONFIG.num_layers
    fields = {f for f in NativeLayer.__dataclass_fields__}
    assert {"norm1", "qkv", "gate_up", "act", "window", "rope"} <= fields

    class Missing:
        norm1 = (torch.ones(C), 1e-5)

    with pytest.raises(AttributeError, match="norm2"):
        step.add_layer(Missing())
    assert step.num_layers() == 0


@pytest.mark.parametrize("dtype", ["int4", "q8_0"])
def test_the_step_keeps_float32_rows_on_a_build_that_quantises_them(dtype):
    """On this build (each branch in CI, tests/native_branches.py) the compiled step's
    layers take the rows in the dtype the build's kernels read best: float32 where they
    quantise rows to 16-bit codes (AVX2, AVX-512 without bf16 dots), bf16 elsewhere; and
    one step gives the Python loop's logits on them."""
    from attnlab.quant.base import native_rows_dtype

    model, plan = _prepared("llama", dtype)
    want = native_rows_dtype(native.loaded())
    assert plan.kernel_layers is not None
    assert {layer.dtype for layer in plan.kernel_layers} == {want}
    ids = torch.randint(0, CONFIG.vocab_size, (2, 5), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        caches = model.new_kv_cache(max_len=8)
        model(ids[:, :4], kv_cache=caches)
        python = _copy(caches)
        a = plan.step(ids[:, 4:5], caches)
        b = _python_step(plan, ids[:, 4:5], python)
    # float32 rows end to end (q8_0: the head too): the two loops' float sums differ in
    # order, and a row's 16-bit codes may round one step the other way (2^-16 of a block's
    # largest value). A flipped bf16 rounding (2^-9) moves more: bf16 rows, or the int4
    # model's head (96 rows, held as int8: PyTorch's kernel, bf16 rows).
    bound = 1e-3 if want == torch.float32 and dtype == "q8_0" else 1e-2
    assert ((a - b).norm() / b.norm()).item() < bound
