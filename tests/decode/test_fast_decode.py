"""The static KV cache and the fused one-token decode step, on small random decoders of
every layout (Llama, GPT-2, Gemma 2, Gemma 3, GPT-NeoX, OLMo 2, Qwen3, Mistral)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attnlab import quant
from attnlab.attention import KVCache, RollingKVCache, StaticKVCache, StaticWindowKVCache
from attnlab.generation import generate
from attnlab.latent import MLAConfig
from attnlab.models.decoder import Decoder, DecoderConfig
from attnlab.models.fast_decode import why_not_fast_decode
from attnlab.native import NATIVE_ENV
from attnlab.norms import QKNorm
from attnlab.quant import quantize_model
from attnlab.rope import RopeConfig

CONFIG = DecoderConfig(  # a Llama
    vocab_size=96,
    hidden_size=128,  # k/v rows 2 * 32 = 64: the int4 tile, so int4 fuses too
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=128,
    context_length=48,
)


def _model(seed: int = 0, **options: object) -> Decoder:
    torch.manual_seed(seed)
    model = Decoder(dataclasses.replace(CONFIG, **options)).eval()
    with torch.no_grad():  # larger weights than the default init: logits far from ties
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.2)
    return model


# --------------------------------------------------------------------------- StaticKVCache


def test_static_cache_returns_what_the_growing_cache_returns():
    g = torch.Generator().manual_seed(0)
    grow, static = KVCache(), StaticKVCache(10)
    for n in (4, 1, 1, 3):
        k, v = torch.randn(2, 3, n, 8, generator=g), torch.randn(2, 3, n, 5, generator=g)
        for a, b in zip(grow.update(k, v), static.update(k, v), strict=True):
            assert torch.equal(a, b)
    assert static.seq_len == grow.seq_len == 9


def test_static_cache_past_its_size_is_an_error_and_reset_keeps_the_buffers():
    cache = StaticKVCache(4)
    k = torch.zeros(1, 2, 3, 8)
    cache.update(k, k)
    buffer = cache.update(k[:, :, :1], k[:, :, :1])[0].data_ptr()
    with pytest.raises(ValueError, match=r"holds 4 positions, 5 needed.*max_len"):
        cache.update(k[:, :, :1], k[:, :, :1])
    cache.reset()
    assert cache.seq_len == 0
    assert cache.update(k, k)[0].data_ptr() == buffer  # the same memory, not a new one


def test_static_cache_refuses_bad_input():
    with pytest.raises(ValueError, match="`max_len` must be a positive int"):
        StaticKVCache(0)
    cache = StaticKVCache(8)
    with pytest.raises(ValueError, match="matching"):
        cache.update(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 4, 8))
    cache.update(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8))
    with pytest.raises(ValueError, match="do not match the cache"):
        cache.update(torch.zeros(1, 3, 1, 8), torch.zeros(1, 3, 1, 8))
    with pytest.raises(ValueError, match="inference"):
        cache.update(torch.zeros(1, 2, 1, 8, requires_grad=True), torch.zeros(1, 2, 1, 8))


def test_window_cache_updates_return_what_the_rolling_cache_returns():
    g = torch.Generator().manual_seed(0)
    rolling, ring = RollingKVCache(4), StaticWindowKVCache(4)
    for n in (3, 1, 1, 6, 1, 2, 9, 1):  # chunks shorter and longer than the window
        k, v = torch.randn(2, 3, n, 8, generator=g), torch.randn(2, 3, n, 5, generator=g)
        for a, b in zip(rolling.update(k, v), ring.update(k, v), strict=True):
            assert torch.equal(a, b)
        assert ring.seq_len == rolling.seq_len
        assert ring.cached_len == min(ring.seq_len, 4)
    assert ring.nbytes == 2 * 3 * 4 * (8 + 5) * 4  # four slots, however long the sequence


def test_window_cache_appends_hold_exactly_the_window_in_some_slot_order():
    g = torch.Generator().manual_seed(1)
    ring, full = StaticWindowKVCache(5), StaticKVCache(40)
    k0, v0 = torch.randn(1, 2, 3, 4, generator=g), torch.randn(1, 2, 3, 4, generator=g)
    ring.update(k0, v0)
    full.update(k0, v0)
    buffer = ring._k.data_ptr()
    for _ in range(17):
        k, v = torch.randn(1, 2, 4, generator=g), torch.randn(1, 2, 4, generator=g)
        keys, values = ring.append(k, v)
        want_k, want_v = (t[:, :, -5:] for t in full.append(k, v))
        # the same rows as the window's last 5 positions, in slot order: sort to compare
        for got, want in ((keys, want_k), (values, want_v)):
            order = lambda t: t[0, 0, :, 0].argsort()  # noqa: E731
            assert torch.equal(got[:, :, order(got)], want[:, :, order(want)])
        # cached(): in position order
        for got, want in zip(ring.cached(), (want_k, want_v), strict=True):
            assert torch.equal(got, want)
    assert ring.seq_len == full.seq_len == 20 and ring._k.data_ptr() == buffer
    ring.reset()
    assert ring.seq_len == 0 and ring.cached_len == 0


def test_window_cache_refuses_bad_input():
    with pytest.raises(ValueError, match="`window` must be an int >= 1"):
        StaticWindowKVCache(0)
    ring = StaticWindowKVCache(3)
    ring.update(torch.zeros(1, 2, 2, 8), torch.zeros(1, 2, 2, 8))
    with pytest.raises(ValueError, match="do not match the cache"):
        ring.update(torch.zeros(1, 3, 1, 8), torch.zeros(1, 3, 1, 8))
    with pytest.raises(ValueError, match="inference"):
        ring.update(torch.zeros(1, 2, 1, 8, requires_grad=True), torch.zeros(1, 2, 1, 8))
    with pytest.raises(ValueError, match=r"holds torch\.float32"):
        ring.update(torch.zeros(1, 2, 1, 8, dtype=torch.bfloat16), torch.zeros(1, 2, 1, 8))


def _half_rounded(*ts: torch.Tensor) -> list[torch.Tensor]:
    return [t.half().float() for t in ts]


def test_a_float16_cache_returns_what_a_float32_cache_of_the_rounded_values_returns():
    """Each key and value is rounded once to float16 as it is written; what comes back is
    float32 again: the float32 cache's answer on the rounded values, at half the bytes."""
    g = torch.Generator().manual_seed(2)
    half, full = StaticKVCache(12, torch.float16), StaticKVCache(12)
    for n in (4, 1, 3):
        k, v = torch.randn(2, 3, n, 8, generator=g), torch.randn(2, 3, n, 5, generator=g)
        got, want = half.update(k, v), full.update(*_half_rounded(k, v))
        for a, b in zip(got, want, strict=True):
            assert a.dtype == torch.float32 and torch.equal(a, b)
    k, v = torch.randn(2, 3, 8, generator=g), torch.randn(2, 3, 5, generator=g)
    for a, b in zip(half.append(k, v), full.append(*_half_rounded(k, v)), strict=True):
        assert a.dtype == torch.float32 and torch.equal(a, b)
    for a, b in zip(half.cached(), full.cached(), strict=True):
        assert torch.equal(a, b)
    assert half._k.dtype == half._v.dtype == torch.float16
    assert 2 * half.nbytes == full.nbytes == 2 * 3 * 12 * (8 + 5) * 4


def test_a_float16_window_cache_returns_what_the_rolling_cache_of_the_rounded_values_does():
    g = torch.Generator().manual_seed(3)
    rolling, ring = RollingKVCache(4), StaticWindowKVCache(4, torch.float16)
    for n in (3, 1, 6, 2):
        k, v = torch.randn(1, 2, n, 8, generator=g), torch.randn(1, 2, n, 8, generator=g)
        got = ring.update(k, v)
        want = rolling.update(*_half_rounded(k, v))
        # the held positions and the new ones as the slots hold them, in float32
        for a, b in zip(got, want, strict=True):
            assert a.dtype == torch.float32 and torch.equal(a, b)
    for _ in range(5):
        k, v = torch.randn(1, 2, 8, generator=g), torch.randn(1, 2, 8, generator=g)
        keys, _ = ring.append(k, v)
        assert keys.dtype == torch.float32 and torch.equal(
            keys[:, :, (ring.seq_len - 1) % 4], k.half().float()
        )
    assert ring._k.dtype == torch.float16 and ring.nbytes == 2 * 2 * 4 * 8 * 2


@pytest.mark.parametrize("window", [None, 4])
def test_a_float16_cache_refuses_a_value_beyond_float16_rather_than_keep_infinity(window):
    cache = (
        StaticKVCache(8, torch.float16) if window is None else StaticWindowKVCache(4, torch.float16)
    )
    k = torch.ones(1, 2, 2, 8)
    cache.update(k, k)
    big = k[:, :, :1].clone()
    big[0, 1, 0, 3] = 7e4  # float16 holds up to 65504
    with pytest.raises(ValueError, match=r"7e\+04 is beyond what this cache's torch.float16 holds"):
        cache.update(big, k[:, :, :1])
    with pytest.raises(ValueError, match="beyond"):
        cache.append(k[:, :, 0], big[:, :, 0])
    # what was infinite or NaN already is kept as it is (the model's own result)
    odd = k[:, :, :1].clone()
    odd[0, 0, 0, :2] = torch.tensor([float("inf"), float("nan")])
    keys, _ = StaticKVCache(4, torch.float16).update(odd, odd)
    assert keys[0, 0, 0, 0] == float("inf") and keys[0, 0, 0, 1].isnan()


def test_the_overflow_check_is_exact_at_float16s_edge_and_for_large_finite_sums():
    """The write's quick test (a finite float32 sum of what was written) never decides a
    refusal by itself: 65519 rounds to 65504 and is kept, 65520 rounds to inf and is
    refused; values whose sum overflows float32 but each of which the buffer holds (a
    bfloat16 cache) are kept."""
    cache = StaticKVCache(4, torch.float16)
    k = torch.full((1, 2, 1, 8), 65519.0)
    keys, _ = cache.update(k, k)
    assert torch.equal(keys, torch.full_like(k, 65504.0))
    with pytest.raises(ValueError, match="beyond"):
        cache.update(torch.full_like(k, 65520.0), k)
    wide = StaticKVCache(4, torch.bfloat16)
    huge = torch.full((1, 2, 1, 8), 3e38)  # bfloat16 holds it; 16 of them sum past float32
    keys, values = wide.update(huge, huge)
    assert keys.isfinite().all() and values.isfinite().all()


@pytest.mark.parametrize("make", [lambda: StaticKVCache(6), lambda: StaticWindowKVCache(3)])
def test_a_cache_without_dtype_holds_keys_and_values_in_their_own_dtypes(make):
    """Without ``dtype`` nothing is converted: values of another dtype than the keys' are
    held and returned as given (bfloat16 values beside float32 keys here)."""
    cache = make()
    k, v = torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8).bfloat16()
    keys, values = cache.update(k, v)
    assert keys.dtype == torch.float32 and values.dtype == torch.bfloat16
    assert torch.equal(keys, k) and torch.equal(values, v)
    keys, values = cache.append(k[:, :, 0], v[:, :, 0])
    assert keys.dtype == torch.float32 and values.dtype == torch.bfloat16
    assert cache._v.dtype == torch.bfloat16


def test_a_cache_dtype_must_be_a_floating_dtype():
    for bad in ("float16", torch.int8, 16):
        with pytest.raises(ValueError, match=r"floating torch\.dtype"):
            StaticKVCache(4, bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"floating torch\.dtype"):
            StaticWindowKVCache(4, bad)  # type: ignore[arg-type]
    model = _model()
    with pytest.raises(ValueError, match=r"floating torch\.dtype"):
        model.kv_cache_dtype = "half"


def test_the_models_kv_cache_dtype_gives_its_static_caches_that_dtype():
    model = _model(sliding_window=None, layer_windows=(4, None, 4))
    assert model.kv_cache_dtype is None
    model.kv_cache_dtype = torch.float16
    caches = model.new_kv_cache(max_len=20)
    assert [c.dtype for c in caches] == [torch.float16] * 3
    # the growing caches (rolling ones for the window layers) hold the keys' own dtype
    assert not any(isinstance(c, StaticKVCache) for c in model.new_kv_cache())
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]), kv_cache=caches)
    assert all(c._k.dtype == torch.float16 for c in caches)
    latent = Decoder(dataclasses.replace(CONFIG, mla=MLAConfig(16, 8, 8, 8, None)))
    assert latent.why_no_cache_dtype() == "latent attention"
    with pytest.raises(ValueError, match="latent attention caches"):
        latent.kv_cache_dtype = torch.float16
    latent.kv_cache_dtype = None  # the keys' own: always
    assert latent.kv_cache_dtype is None


def test_new_kv_cache_gives_a_window_layer_its_ring_when_the_window_is_shorter():
    model = _model(sliding_window=None, layer_windows=(4, None, 4))
    caches = model.new_kv_cache(max_len=20)
    assert [type(c) for c in caches] == [StaticWindowKVCache, StaticKVCache, StaticWindowKVCache]
    assert caches[0].window == 4 and caches[1].max_len == 20
    assert all(type(c) is StaticKVCache for c in model.new_kv_cache(max_len=4))


# --------------------------------------------------------------------------- fast step


def test_a_one_token_prompt_runs_on_the_modules_and_the_next_token_builds_the_plan():
    # The first token must not wait for the plan's fused copies (`attnlab generate -n 1`
    # on a one-token prompt): on empty caches the token is the prompt.
    model = _model()
    cache = model.new_kv_cache(max_len=8)
    with torch.no_grad():
        first = model(torch.tensor([[3]]), kv_cache=cache)
        assert model._decode_plan is None and cache[0].seq_len == 1
        second = model(first[:, -1].argmax(-1, keepdim=True), kv_cache=cache)
        assert model._decode_plan is not None  # the fast step ran
        slow = model.new_kv_cache()
        model(torch.tensor([[3]]), kv_cache=slow)
        ref = model(first[:, -1].argmax(-1, keepdim=True), kv_cache=slow)
    tol = CONFIG.hidden_size * torch.finfo(torch.float32).eps * ref.abs().max().item()
    torch.testing.assert_close(second, ref, atol=tol, rtol=1e-5)


def test_fast_step_logits_equal_the_module_path():
    model = _model()
    ids = torch.randint(0, CONFIG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    slow, fast = model.new_kv_cache(), model.new_kv_cache(max_len=20)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, kv_cache=slow), model(ids, kv_cache=fast))
        nxt = ids[:, -1:]
        for _ in range(5):
            a = model(nxt, kv_cache=slow)
            b = model(nxt, kv_cache=fast)
            assert model._decode_plan is not None  # the fast step ran
            # Two float32 summation orders (the kernels' order depends on the CPU's vector
            # width): each logit's error is bounded by its longest sum, C terms, in eps.
            tol = CONFIG.hidden_size * torch.finfo(torch.float32).eps * a.abs().max().item()
            torch.testing.assert_close(b, a, atol=tol, rtol=1e-5)
            nxt = a[:, -1].argmax(-1, keepdim=True)


def test_fused_qkv_and_gate_up_equal_the_separate_products():
    model = _model(vocab_size=256)  # a head wider than the model
    assert model.prepare_decode().layers[0].qkv is None  # float weights: fused only if asked
    ids = torch.randint(0, CONFIG.vocab_size, (2, 7), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        before = model(ids)
    plan = model.prepare_decode(share_float=True)
    # Fused and wide (N > K) float products now column-major (one-row products up to 2x
    # faster), the others row-major as they were; the same numbers.
    for layer in plan.layers:
        assert layer.qkv.weight.stride(0) == 1 and layer.gate_up.weight.stride(0) == 1
        assert layer.out.weight.stride(1) == 1 and layer.down.weight.stride(1) == 1  # N <= K
    assert model.lm_head.weight.stride(0) == 1  # 256 x 128
    with torch.no_grad():
        torch.testing.assert_close(model(ids), before, atol=1e-5, rtol=1e-5)
    h = torch.randn(2, 1, CONFIG.hidden_size)
    for layer, block in zip(plan.layers, model.blocks, strict=True):
        att, mlp = block.attention, block.mlp
        assert layer.qkv is not None and layer.gate_up is not None
        separate = torch.cat([att.W_query(h), att.W_key(h), att.W_value(h)], dim=-1)
        torch.testing.assert_close(layer.qkv(h), separate)
        torch.testing.assert_close(layer.gate_up(h), torch.cat([mlp.gate(h), mlp.up(h)], -1))
        # The book's names still hold the weights, as views of the fused rows.
        rows_k = layer.qkv.weight[att.W_query.out_features :]
        assert att.W_key.weight.data_ptr() == rows_k.data_ptr()
    # Still the same Parameter objects (an optimizer holding them keeps working).
    assert all(isinstance(p, torch.nn.Parameter) for p in model.parameters())
    assert len(list(model.parameters())) == len(dict(model.named_parameters()))


@pytest.mark.slow
@pytest.mark.parametrize("share_float", [False, True])
def test_fp32_greedy_tokens_equal_the_full_recompute_even_as_the_window_slides(share_float):
    model = _model()
    model.prepare_decode(share_float=share_float)
    ids = torch.randint(0, CONFIG.vocab_size, (1, 30), generator=torch.Generator().manual_seed(2))
    cached = generate(model, ids, 40)  # 70 tokens > context 48: the window slides
    assert torch.equal(cached, generate(model, ids, 40, use_cache=False))


def test_the_cache_is_allocated_once_however_long_the_generation(monkeypatch):
    model = _model()
    made: list[int | None] = []
    real = model.new_kv_cache

    def counting(max_len: int | None = None):
        made.append(max_len)
        return real(max_len)

    monkeypatch.setattr(model, "new_kv_cache", counting)
    ids = torch.zeros(1, 4, dtype=torch.long)
    generate(model, ids, 60)  # slides 16 times past the 48-token window
    assert made == [48]


@pytest.mark.parametrize("dtype", ["bfloat16", "int8", "int4", "q8_0", "q5_0"])
def test_each_precision_decodes_through_the_fast_step_as_its_module_path(dtype):
    # Accuracy against fp32 is measured on real weights (test_pretrained.py): random
    # Gaussian weights are the worst case for 4 bits. Here: the same weights, two paths.
    model = quantize_model(_model(), dtype)
    ids = torch.randint(0, CONFIG.vocab_size, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        slow = model(ids)
        cache = model.new_kv_cache(max_len=12)
        fast = torch.cat([model(ids[:, i : i + 1], kv_cache=cache) for i in range(12)], dim=1)
    assert model._decode_plan is not None and model._decode_plan.layers[0].qkv is not None
    # Each product's output is rounded to bf16 by the kernels, and the fused products sum
    # in another order than the separate ones: agreement to bf16 precision, not bits.
    rel = ((fast - slow).norm() / slow.norm()).item()
    assert rel < 1e-2, rel
    assert torch.equal(fast.argmax(-1), slow.argmax(-1))


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_int_prefill_dequantises_and_gives_the_one_row_kernels_logits(dtype, monkeypatch):
    """A prompt (many rows: a dense mm of dequantised weights, in the prompt arithmetic's
    dtype) against the same tokens fed one at a time (the int kernels). The paths differ
    by bf16 roundings only (int4: of the dequantised weight; int8: of the product before
    its row scale), 2^-8 relative per product, which this random 3-layer model amplifies
    to a few percent of the logits; against fp32 both carry the same quantisation error."""
    from attnlab import quant
    from attnlab.quant.arith import prompt_dtype

    fp32 = _model(3)
    model = quantize_model(_model(3), dtype)
    monkeypatch.setattr(quant.Int8Linear, "dense_from_tokens", 8)
    monkeypatch.setattr(quant.Int4Linear, "dense_from_tokens", 8)
    ids = torch.randint(0, CONFIG.vocab_size, (2, 12), generator=torch.Generator().manual_seed(5))
    calls = {"dense": 0}
    real_mm = torch.mm

    def counting_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        calls["dense"] += a.dtype == prompt_dtype()
        return real_mm(a, b)

    with torch.no_grad():
        reference = fp32(ids)
        monkeypatch.setattr(torch, "mm", counting_mm)
        prompt = model(ids)  # (B, T, V): 24 rows per product
        monkeypatch.setattr(torch, "mm", real_mm)
        assert calls["dense"] >= 7 * CONFIG.num_layers  # every layer's products dequantised
        cache = model.new_kv_cache(max_len=16)
        steps = torch.cat([model(ids[:, i : i + 1], kv_cache=cache) for i in range(12)], 1)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).norm() / b.norm()).item()

    assert rel(prompt, steps) < 0.05, rel(prompt, steps)
    assert rel(prompt, reference) <= 1.25 * rel(steps, reference)


def test_gpt_decodes_through_the_fast_step_with_the_same_logits():
    from attnlab.models.gpt import GPTConfig, GPTModel

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, context_length=24, emb_dim=32, n_heads=4, n_layers=2)
    model = GPTModel(cfg).eval()
    ids = torch.randint(0, 64, (2, 7))
    slow, fast = model.new_kv_cache(), model.new_kv_cache(max_len=12)
    with torch.no_grad():
        model(ids, kv_cache=slow), model(ids, kv_cache=fast)
        for _ in range(4):
            a, b = model(ids[:, -1:], kv_cache=slow), model(ids[:, -1:], kv_cache=fast)
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    assert model._decode_plan is not None
    out = generate(model, ids, 30)  # slides past the 24-token window
    assert torch.equal(out, generate(model, ids, 30, use_cache=False))


def test_recording_or_capturing_takes_the_module_path():
    from attnlab.attention import record_attention

    model = _model()
    calls = []

    class Recorder:
        def request(self, layer):
            return False

        def record(self, call):
            calls.append(call)

    cache = model.new_kv_cache(max_len=8)
    with torch.no_grad():
        model(torch.zeros(1, 3, dtype=torch.long), kv_cache=cache)
        with record_attention(Recorder()):
            model(torch.zeros(1, 1, dtype=torch.long), kv_cache=cache)
    assert len(calls) == CONFIG.num_layers  # the step ran through every layer
    model.blocks[1].attention.capture = True
    with torch.no_grad():
        model(torch.zeros(1, 1, dtype=torch.long), kv_cache=cache)
    assert model.blocks[1].attention.captured is not None


@pytest.mark.parametrize("kind", ["forward", "pre", "global"])
@pytest.mark.parametrize("gpt", [False, True], ids=["decoder", "gpt"])
def test_a_module_hook_keeps_firing_while_generate_decodes(kind, gpt, monkeypatch):
    """A PyTorch hook on a module the fused step would skip makes every decode step take
    the module path (the hook sees the prompt and each new token); without one the fused
    step is taken."""
    from torch.nn.modules.module import (
        register_module_forward_hook,
        register_module_forward_pre_hook,
    )

    from attnlab.models.fast_decode import DecodePlan
    from attnlab.models.gpt import GPTConfig, GPTModel

    if gpt:
        torch.manual_seed(0)
        model = GPTModel(
            GPTConfig(vocab_size=96, context_length=48, emb_dim=32, n_heads=4, n_layers=2)
        ).eval()
        target = model.trf_blocks[1].ff
    else:
        model = _model()
        target = model.blocks[1].mlp
    steps = []
    real_step = DecodePlan.step

    def counting_step(self, *args, **kwargs):
        steps.append(1)
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(DecodePlan, "step", counting_step)
    ids = torch.zeros(1, 4, dtype=torch.long)
    fast = generate(model, ids, 6)
    assert len(steps) == 5  # no hook: every token after the first is a fused step

    calls = []

    def seen(module, *args):
        if module is target:
            calls.append(1)

    if kind == "forward":
        handle = target.register_forward_hook(lambda m, a, o: seen(m))
    elif kind == "pre":
        handle = target.register_forward_pre_hook(lambda m, a: seen(m))
    else:
        handle = register_module_forward_hook(lambda m, a, o: seen(m))
    try:
        hooked = generate(model, ids, 6)
    finally:
        handle.remove()
    assert len(calls) == 6  # the prompt, then each of the 5 one-token steps
    assert len(steps) == 5  # none of them fused
    assert torch.equal(hooked, fast)
    handle = register_module_forward_pre_hook(lambda m, a: None)
    try:
        generate(model, ids, 3)
    finally:
        handle.remove()
    assert len(steps) == 5  # a global pre-hook takes the module path too
    generate(model, ids, 3)
    assert len(steps) == 7  # hooks removed: fused again


LAYOUTS = {
    "gpt2-like": {
        "norm": "layer",
        "norm_bias": True,
        "mlp": "plain",
        "activation": "gelu_tanh",
        "positions": "learned",
        "qkv_bias": True,
        "out_bias": True,
        "mlp_bias": True,
    },
    # Gemma 2: sandwich norms, both softcaps, a window shorter than the sequence on
    # alternate layers, embeddings x sqrt(C), its own score scale.
    "gemma2-like": {
        "norm_placement": "sandwich",
        "attn_softcap": 5.0,
        "final_softcap": 10.0,
        "layer_windows": (4, None, 4),
        "embed_scale": True,
        "activation": "gelu_tanh",
        "attn_scale": 0.3,
    },
    # GPT-NeoX: parallel residual, a quarter of each head rotary, LayerNorms, biases.
    "gpt_neox-like": {
        "norm": "layer",
        "norm_bias": True,
        "mlp": "plain",
        "activation": "gelu",
        "parallel_residual": True,
        "rope": RopeConfig(base=10000.0, fraction=0.25),
        "qkv_bias": True,
        "out_bias": True,
        "mlp_bias": True,
        "num_kv_heads": 4,
    },
    # Gemma 3: sandwich norms, QK-norm per head vector, local layers (window 4, their own
    # RoPE base) and a global one, embeddings x sqrt(C), its own score scale.
    "gemma3-like": {
        "norm_placement": "sandwich",
        "qk_norm": QKNorm("rms", "head"),
        "layer_windows": (4, None, 4),
        "layer_ropes": (RopeConfig(base=10.0), None, RopeConfig(base=10.0)),
        "embed_scale": True,
        "activation": "gelu_tanh",
        "attn_scale": 0.3,
    },
    "olmo2-like": {"norm_placement": "post", "qk_norm": QKNorm("rms", "all")},
    "qwen3-like": {"qk_norm": QKNorm("rms", "head"), "head_dim": 16},
    "mistral-like": {"sliding_window": 5},
    "alibi": {"positions": "alibi"},  # not a layout of the fast step: the modules decode
}


@pytest.mark.parametrize("share_float", [False, True], ids=["separate", "fused"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_layout_decodes_with_the_module_paths_logits(layout, share_float):
    # The reference: the modules over growing caches (rolling ones for windowed layers).
    model = _model(**LAYOUTS[layout])
    fast_step = layout != "alibi"
    if share_float and fast_step:
        model.prepare_decode(share_float=True)
    ids = torch.randint(0, CONFIG.vocab_size, (2, 6), generator=torch.Generator().manual_seed(4))
    slow, fast = model.new_kv_cache(), model.new_kv_cache(max_len=20)
    assert all(isinstance(c, StaticKVCache) for c in fast)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, kv_cache=fast), model(ids, kv_cache=slow))
        nxt = ids[:, -1:]
        for _ in range(10):  # 16 positions: past every window of 4 and 5
            a, b = model(nxt, kv_cache=slow), model(nxt, kv_cache=fast)
            # fp32 sums in another order (logits of magnitude up to ~10 here)
            torch.testing.assert_close(b, a, atol=3e-5, rtol=1e-5)
            nxt = a[:, -1].argmax(-1, keepdim=True)
    assert (model._decode_plan is not None) == fast_step
    assert (why_not_fast_decode(model) is None) == fast_step


def test_the_step_skips_nothing_it_cannot_do():
    assert why_not_fast_decode(_model(positions="alibi")) == "positions 'alibi'"
    assert why_not_fast_decode(_model(embed_norm=True)) == "model option embed_norm=True"
    sinks = _model()
    sinks.blocks[0].attention.sinks = torch.nn.Parameter(torch.zeros(CONFIG.num_heads))
    assert why_not_fast_decode(sinks) is None  # a softmax column more (test_fast_decode_sinks)


SHORT_LOOP_LAYOUTS = ("llama", "qwen3-like", "gemma3-like", "gemma3-like, mixed Q/K and V")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "int4", "q8_0", "q5_0"])
@pytest.mark.parametrize("layout", SHORT_LOOP_LAYOUTS)
def test_the_short_loop_gives_the_general_loops_tokens_and_logits(layout, dtype, monkeypatch):
    """Two rows through DecodePlan._step_short and through the general loop, from the same
    caches, past the local layers' window: the same kernels on the same rows, attention
    by another call (one SDPA against two batched products and a softmax). The Python
    short loop: the compiled one is test_native_step's."""
    monkeypatch.setenv(NATIVE_ENV, "0")
    options = LAYOUTS.get(layout.split(",")[0], {})
    model = _model(5, **options)
    if dtype == "float32":
        model.prepare_decode(share_float=True)  # fused float products: the short loop
    else:
        quantize_model(model, dtype)
    if layout.endswith("mixed Q/K and V"):  # as a GGUF file's Q5_0 Q/K and Q8_0 V
        for block in model.blocks:
            att = block.attention
            att.W_value = quant.Int8Linear.from_float(att.W_value.weight.detach())
        model.invalidate_decode_plan()
    plan = model.prepare_decode()
    rows = plan.rows
    if layout.endswith("mixed Q/K and V") and dtype == "float32":
        assert rows is None  # fp32 and bf16 rows in one layer: the general loop
        return
    assert rows is not None
    ids = torch.randint(0, CONFIG.vocab_size, (2, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        short, general = model.new_kv_cache(max_len=16), model.new_kv_cache(max_len=16)
        model(ids[:, :3], kv_cache=short)
        model(ids[:, :3], kv_cache=general)
        nxt_short = nxt_general = ids[:, 3:4]
        for _ in range(8):  # positions 3..10: past the window of 4
            a = model(nxt_short, kv_cache=short)
            plan.rows = None
            try:
                b = model(nxt_general, kv_cache=general)
            finally:
                plan.rows = rows
            if dtype == "float32":
                torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
            else:  # the rows are rounded to bf16 before each product: a last-bit difference
                # of the two attentions' fp32 sums can round a row the other way
                assert ((a - b).norm() / b.norm()).item() < 1e-2
            nxt_short, nxt_general = a[:, -1].argmax(-1, True), b[:, -1].argmax(-1, True)
            assert torch.equal(nxt_short, nxt_general)  # greedy tokens
        for c_short, c_general in zip(short, general, strict=True):
            for got, want in ((c_short._k, c_general._k), (c_short._v, c_general._v)):
                got, want = got[:, :, :11], want[:, :, :11]
                if dtype == "float32":
                    torch.testing.assert_close(got, want)
                else:
                    assert ((got - want).norm() / want.norm()).item() < 1e-2


def test_layouts_outside_the_short_loop_take_the_general_loop():
    for layout in ("gemma2-like", "gpt_neox-like", "olmo2-like", "gpt2-like"):  # softcaps,
        model = quantize_model(_model(**LAYOUTS[layout]), "int4")  # parallel, post, learned
        assert why_not_fast_decode(model) is None
        assert model.prepare_decode().rows is None, layout


def test_static_cache_append_writes_one_position_as_update():
    k = torch.randn(2, 3, 5, 4)
    a, b = StaticKVCache(8), StaticKVCache(8)
    a.update(k[:, :, :4], k[:, :, :4])
    b.update(k[:, :, :4], k[:, :, :4])
    ka, va = a.append(k[:, :, 4], k[:, :, 4].to(torch.bfloat16))
    kb, vb = b.update(k[:, :, 4:], k[:, :, 4:].to(torch.bfloat16).float())
    assert torch.equal(ka, kb) and torch.equal(va, vb) and a.seq_len == b.seq_len == 5
    full = StaticKVCache(4)
    full.update(k[:, :, :4], k[:, :, :4])
    with pytest.raises(ValueError, match="holds 4 positions"):
        full.append(k[:, :, 4], k[:, :, 4])  # past max_len: update's error
    fresh = StaticKVCache(4)
    keys, values = fresh.append(k[:, :, 0], k[:, :, 0].to(torch.bfloat16))  # no buffers yet
    assert keys.shape == (2, 3, 1, 4) and values.dtype == torch.float32


def test_the_short_loop_leaves_no_inference_tensor_behind(monkeypatch):
    """The short loop runs in inference mode once the caches hold a prompt; caches and
    logits stay ordinary tensors, so a later prefill (the window sliding) writes them.
    (The Python loop's inference mode; the compiled step's: test_native_step.)"""
    monkeypatch.setenv(NATIVE_ENV, "0")
    model = quantize_model(_model(), "int4")
    ids = torch.tensor([[3]])
    with torch.no_grad():
        slow = generate(model, ids, 60, use_cache=False)
    fast = generate(model, ids, 60)  # one-token prompt, past the window
    # The two paths round bf16 rows in different orders (the CPU's kernels choose it): they
    # agree token for token unless the uncached path met a near-tie, within 8 bf16 steps.
    differ = (fast != slow).nonzero()
    if differ.numel():
        i = int(differ[0, 1])
        with torch.no_grad():
            top2 = model(slow[:, :i][:, -CONFIG.context_length :])[0, -1].float().topk(2).values
        assert top2[0] - top2[1] <= 8 * 2**-8 * top2.abs().max(), (i, top2)
        assert i > 30, f"the paths part at token {i}, before the window slides"
    with torch.no_grad():
        cache = model.new_kv_cache(max_len=8)
        model(torch.tensor([[3, 4]]), kv_cache=cache)
        logits = model(ids, kv_cache=cache)
    assert model._decode_plan.rows is not None
    assert not logits.is_inference()
    assert not any(c._k.is_inference() or c._v.is_inference() for c in cache)


# --------------------------------------------------------------------------- which loop


def test_decode_path_names_the_loop_the_step_takes_and_why(monkeypatch):
    """:meth:`decode_path` (and :meth:`DecodePlan.path`) name the loop a one-token call
    runs, with a reason, and the step runs that loop."""
    from attnlab.models.decode.plan import DecodePlan

    monkeypatch.setenv(NATIVE_ENV, "0")
    taken = []
    for loop in ("general", "short"):
        real = getattr(DecodePlan, f"_step_{loop}")

        def counted(self, *args, _real=real, _loop=loop):
            taken.append(_loop)
            return _real(self, *args)

        monkeypatch.setattr(DecodePlan, f"_step_{loop}", counted)

    def decode(model: Decoder, batch: int) -> str:
        taken.clear()
        with torch.no_grad():
            cache = model.new_kv_cache(max_len=8)
            model(torch.zeros(batch, 2, dtype=torch.long), kv_cache=cache)
            model(torch.zeros(batch, 1, dtype=torch.long), kv_cache=cache)
        return taken[0] if taken else "modules"

    plain = quantize_model(_model(), "int4")
    path = plain.decode_path()
    assert path.loop == "short" and "ATTNLAB_NATIVE=0" in path.why, path
    assert decode(plain, 1) == "short"
    wide = plain.decode_path(batch=16)
    assert wide.loop == "general" and "16 rows" in wide.why
    assert decode(plain, 16) == "general"
    capped = quantize_model(_model(**LAYOUTS["gemma2-like"]), "int4")
    path = capped.decode_path()
    assert path.loop == "general" and "soft-capping" in path.why, path
    assert decode(capped, 1) == "general"
    assert str(path).startswith("general: ")
    alibi = _model(positions="alibi")
    assert alibi.decode_path().loop == "modules" and "alibi" in alibi.decode_path().why
    assert decode(alibi, 1) == "modules"
    plain.train()
    assert plain.decode_path().loop == "modules" and "training" in plain.decode_path().why
    plain.eval()
    handle = plain.blocks[0].mlp.register_forward_hook(lambda *a: None)
    try:
        assert plain.decode_path().loop == "modules" and "hook" in plain.decode_path().why
        assert decode(plain, 1) == "modules"
    finally:
        handle.remove()
    assert plain.decode_path().loop == "short"
