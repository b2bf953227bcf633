"""Attention's layer options (QK-norm, biases, head_dim, scale, sliding window, rolling KV
cache) against transformers' own attention modules, built tiny here, and the fp64 reference."""

from __future__ import annotations

import copy

import pytest
import torch

from attnlab.attention import Attention, AttentionCall, KVCache, RollingKVCache, record_attention
from attnlab.backends import WeightsRequest, available_backends
from attnlab.masks import SlidingWindowMask
from attnlab.norms import QKNorm
from attnlab.rope import RopeConfig, YarnScaling
from reference import reference_attention, tol

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    Gemma3TextConfig,
    MistralConfig,
    Olmo2Config,
    Qwen2Config,
    Qwen3Config,
)
from transformers.masking_utils import (  # noqa: E402
    causal_mask_function,
    sliding_window_causal_mask_function,
)
from transformers.models.gemma3 import modeling_gemma3  # noqa: E402
from transformers.models.mistral import modeling_mistral  # noqa: E402
from transformers.models.olmo2 import modeling_olmo2  # noqa: E402
from transformers.models.qwen2 import modeling_qwen2  # noqa: E402
from transformers.models.qwen3 import modeling_qwen3  # noqa: E402

BACKENDS = [b for b in available_backends() if b not in ("auto", "ring")]
F64 = tol(torch.float64)
# transformers computes cos/sin and its RMSNorm in fp32 even for fp64 modules
HF = tol(torch.float32)
C, H, G, WINDOW, THETA = 48, 4, 2, 5, 1e6
SIZES = dict(
    hidden_size=C,
    num_attention_heads=H,
    num_key_value_heads=G,
    max_position_embeddings=256,
    rope_theta=THETA,
    attn_implementation="eager",
)

# family: (HF config, HF attention class, HF rotary class, attnlab layer options)
FAMILIES = {
    "qwen2-biases": (
        lambda: Qwen2Config(**SIZES),
        modeling_qwen2.Qwen2Attention,
        modeling_qwen2.Qwen2RotaryEmbedding,
        dict(bias=True, out_bias=False),
    ),
    "qwen3-qknorm-head": (
        lambda: Qwen3Config(**SIZES, head_dim=16, rms_norm_eps=1e-6),
        modeling_qwen3.Qwen3Attention,
        modeling_qwen3.Qwen3RotaryEmbedding,
        dict(head_dim=16, qk_norm=QKNorm("rms", scope="head", eps=1e-6), out_bias=False),
    ),
    "olmo2-qknorm-all": (
        lambda: Olmo2Config(**SIZES, rms_norm_eps=1e-6),
        modeling_olmo2.Olmo2Attention,
        modeling_olmo2.Olmo2RotaryEmbedding,
        dict(qk_norm=QKNorm("rms", scope="all", eps=1e-6), out_bias=False),
    ),
    "mistral-sliding": (
        lambda: MistralConfig(**SIZES, sliding_window=WINDOW),
        modeling_mistral.MistralAttention,
        modeling_mistral.MistralRotaryEmbedding,
        dict(sliding_window=WINDOW, out_bias=False),
    ),
    "gemma3-local": (
        lambda: Gemma3TextConfig(
            **SIZES,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=WINDOW,
            layer_types=["sliding_attention"],
            num_hidden_layers=1,
            rms_norm_eps=1e-6,
        ),
        modeling_gemma3.Gemma3Attention,
        modeling_gemma3.Gemma3RotaryEmbedding,
        dict(
            head_dim=16,
            scale=24**-0.5,
            qk_norm=QKNorm("rms", scope="head", eps=1e-6),
            sliding_window=WINDOW,
            out_bias=False,
        ),
    ),
}


def build(family: str, backend: str):
    """A tiny transformers attention module with random weights (norms included) and the
    attnlab layer with the same weights."""
    make_cfg, hf_cls, rot_cls, options = FAMILIES[family]
    cfg = make_cfg()
    torch.manual_seed(0)
    hf = hf_cls(cfg, layer_idx=0).double().eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
    layer_types = getattr(cfg, "layer_types", None)
    rot = rot_cls(cfg)
    layer_type = layer_types[0] if family.startswith("gemma3") else None
    # Gemma 3's local layers have their own rope_theta: read it as a loader would
    rope = RopeConfig.from_hf_config(cfg.to_dict(), layer_type=layer_type)
    ours = Attention(C, H, num_kv_heads=G, rope=rope, backend=backend, **options)
    ours = ours.double()
    with torch.no_grad():
        ours.W_query.weight.copy_(hf.q_proj.weight)
        ours.W_key.weight.copy_(hf.k_proj.weight)
        ours.W_value.weight.copy_(hf.v_proj.weight)
        ours.out_proj.weight.copy_(hf.o_proj.weight)
        for mine, theirs in (
            (ours.W_query, hf.q_proj),
            (ours.W_key, hf.k_proj),
            (ours.W_value, hf.v_proj),
            (ours.out_proj, hf.o_proj),
        ):
            assert (mine.bias is None) == (theirs.bias is None), "bias layout differs"
            if mine.bias is not None:
                mine.bias.copy_(theirs.bias)
        if ours.q_norm is not None:
            gemma = family.startswith("gemma")  # Gemma's RMSNorm scales by (1 + weight)
            ours.q_norm.weight.copy_(hf.q_norm.weight + gemma)
            ours.k_norm.weight.copy_(hf.k_norm.weight + gemma)

    def run_hf(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T = x.shape[1]
        pos = torch.arange(T)[None]
        args = (x, pos, layer_type) if layer_type else (x, pos)
        cos, sin = rot(*args)
        fn = (
            sliding_window_causal_mask_function(cfg.sliding_window)
            if options.get("sliding_window")
            else causal_mask_function
        )
        allowed = fn(0, 0, torch.arange(T)[:, None], torch.arange(T)[None, :])  # (T, S)
        mask = torch.zeros(T, T, dtype=x.dtype).masked_fill(~allowed, float("-inf"))
        out, w = hf(x, (cos.double(), sin.double()), mask[None, None])
        return out, w

    return hf, ours, run_hf


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_layer_matches_transformers_module(family, backend):
    """Full pass (output and weights), the KV cache (rolling for sliding layers, with a
    prefill longer than the window, decode steps and a chunk) and the capture hook all give
    transformers' numbers."""
    _, ours, run_hf = build(family, backend)
    x = torch.randn(2, 16, C, dtype=torch.float64)
    with torch.no_grad():
        expected, expected_w = run_hf(x)
        out, w = ours(x, is_causal=True, need_weights=True)
        torch.testing.assert_close(out, expected, **HF)
        torch.testing.assert_close(w, expected_w, **HF)

        cache = ours.new_kv_cache()
        assert isinstance(cache, RollingKVCache) == ("sliding" in family or "local" in family)
        parts = [ours(x[:, :7], is_causal=True, kv_cache=cache)]  # 7 > WINDOW
        parts += [ours(x[:, t : t + 1], is_causal=True, kv_cache=cache) for t in range(7, 13)]
        parts.append(ours(x[:, 13:], is_causal=True, kv_cache=cache))
        torch.testing.assert_close(torch.cat(parts, dim=1), expected, **HF)

        class Keep:
            def __init__(self) -> None:
                self.calls: list[AttentionCall] = []

            def request(self, layer: Attention) -> WeightsRequest:
                return WeightsRequest(heads=(1,))

            def record(self, call: AttentionCall) -> None:
                self.calls.append(call)

        keep = Keep()
        with record_attention(keep):
            ours(x, is_causal=True)
        (call,) = keep.calls
        assert call.scale == pytest.approx(ours.scale or ours.head_dim**-0.5)
        assert call.weights is not None
        torch.testing.assert_close(call.weights, expected_w[:, 1:2], **HF)


def test_qk_norm_layernorm_against_fp64_reference():
    """LayerNorm QK-norm per head, written out directly (no transformers module has it in
    this form at this size)."""
    torch.manual_seed(3)
    layer = Attention(32, 4, qk_norm=QKNorm("layer", eps=1e-5), rope=True, backend="math")
    layer = layer.double()
    with torch.no_grad():
        for p in (*layer.q_norm.parameters(), *layer.k_norm.parameters()):  # type: ignore[union-attr]
            p.normal_()
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    q = layer.W_query(x).view(2, 9, 4, 8).transpose(1, 2)
    k = layer.W_key(x).view(2, 9, 4, 8).transpose(1, 2)
    v = layer.W_value(x).view(2, 9, 4, 8).transpose(1, 2)

    def ln(t: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
        mu = t.mean(-1, keepdim=True)
        var = t.var(-1, unbiased=False, keepdim=True)
        return (t - mu) / torch.sqrt(var + 1e-5) * norm.weight + norm.bias

    pos = torch.arange(9)
    rope = layer.rope
    assert rope is not None and layer.q_norm is not None and layer.k_norm is not None
    q, k = rope(ln(q, layer.q_norm), pos), rope(ln(k, layer.k_norm), pos)
    mask = torch.ones(9, 9, dtype=torch.bool).tril()
    ref, _ = reference_attention(q, k, v, mask=mask)
    expected = layer.out_proj(ref.transpose(1, 2).reshape(2, 9, 32))
    torch.testing.assert_close(layer(x, is_causal=True), expected, **F64)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_causal_sliding_window_is_symmetric(backend):
    torch.manual_seed(4)
    layer = Attention(32, 4, num_kv_heads=2, sliding_window=3, backend=backend).double()
    x = torch.randn(1, 10, 32, dtype=torch.float64)
    _, w = layer(x, need_weights=True)
    d = torch.arange(10)[:, None] - torch.arange(10)[None, :]
    assert bool((w[0, :, d.abs() >= 3] == 0).all())
    assert bool((w[0, :, d.abs() < 3] > 0).all())
    torch.testing.assert_close(
        layer(x), layer(x, attn_mask=SlidingWindowMask(3, causal=False), is_causal=False), **F64
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_rolling_cache_generates_four_windows_with_bounded_memory(backend):
    """Generating 4x the window token by token (after a prefill longer than the window)
    equals the full pass, and the cache never holds more than the window."""
    torch.manual_seed(5)
    W, B, D = 8, 2, 8
    layer = Attention(32, 4, num_kv_heads=2, sliding_window=W, rope=True, backend=backend).double()
    x = torch.randn(B, 12 + 4 * W, 32, dtype=torch.float64)
    with torch.no_grad():
        full = layer(x, is_causal=True)
        cache = layer.new_kv_cache()
        assert isinstance(cache, RollingKVCache) and cache.window == W
        bound = 2 * B * 2 * W * D * 8  # keys + values, (B, G, W, D) fp64
        outs = [layer(x[:, :12], is_causal=True, kv_cache=cache)]
        assert cache.cached_len == W - 1 and cache.nbytes < bound
        for t in range(12, x.shape[1]):
            outs.append(layer(x[:, t : t + 1], is_causal=True, kv_cache=cache))
            assert cache.cached_len == W - 1 and cache.nbytes < bound
            assert cache.seq_len == t + 1
    torch.testing.assert_close(torch.cat(outs, dim=1), full, **F64)
    # the unbounded cache grows with every token
    plain = KVCache()
    with torch.no_grad():
        for t in range(0, x.shape[1], 4):
            layer(x[:, t : t + 4], is_causal=True, kv_cache=plain)
    assert plain.nbytes > 4 * bound


def test_window_of_one_sees_only_itself():
    torch.manual_seed(8)
    layer = Attention(16, 2, sliding_window=1, rope=True, backend="math").double()
    x = torch.randn(1, 6, 16, dtype=torch.float64)
    v = layer.W_value(x)  # with one key per query the weights are 1: output = out_proj(v)
    torch.testing.assert_close(layer(x, is_causal=True), layer.out_proj(v), **F64)
    cache = layer.new_kv_cache()
    steps = [layer(x[:, t : t + 1], is_causal=True, kv_cache=cache) for t in range(6)]
    assert cache.cached_len == 0
    torch.testing.assert_close(torch.cat(steps, dim=1), layer.out_proj(v), **F64)


def test_rolling_cache_keeps_gradients_in_training():
    torch.manual_seed(6)
    layer = Attention(16, 2, sliding_window=4, rope=True, backend="math").double()
    x = torch.randn(1, 10, 16, dtype=torch.float64, requires_grad=True)
    cache = layer.new_kv_cache()
    first = layer(x[:, :6], is_causal=True, kv_cache=cache)  # 6 > the window
    out = torch.cat([first, layer(x[:, 6:], is_causal=True, kv_cache=cache)], dim=1)
    (g_chunked,) = torch.autograd.grad(out.square().sum(), x)
    (g_full,) = torch.autograd.grad(layer(x, is_causal=True).square().sum(), x)
    torch.testing.assert_close(g_chunked, g_full, **F64)


def test_head_dim_and_scale_override_against_reference():
    torch.manual_seed(7)
    layer = Attention(24, 4, head_dim=10, scale=0.05, bias=True, out_bias=False).double()
    assert layer.W_query.weight.shape == (40, 24) and layer.out_proj.weight.shape == (24, 40)
    assert layer.out_proj.bias is None and layer.W_key.bias is not None
    x = torch.randn(2, 6, 24, dtype=torch.float64)
    q = layer.W_query(x).view(2, 6, 4, 10).transpose(1, 2)
    k = layer.W_key(x).view(2, 6, 4, 10).transpose(1, 2)
    v = layer.W_value(x).view(2, 6, 4, 10).transpose(1, 2)
    ref, ref_w = reference_attention(q, k, v, scale=0.05)
    out, w = layer(x, need_weights=True)
    torch.testing.assert_close(out, layer.out_proj(ref.transpose(1, 2).reshape(2, 6, 40)), **F64)
    torch.testing.assert_close(w, ref_w, **F64)


@pytest.mark.parametrize(
    ("make", "exc", "match"),
    [
        (lambda: Attention(32, 4, sliding_window=0), ValueError, "sliding_window"),
        (lambda: Attention(32, 4, scale=-1.0), ValueError, "scale"),
        (lambda: Attention(32, 4, head_dim=0), ValueError, "head_dim"),
        (lambda: Attention(30, 4), ValueError, "embed_dim"),
        (lambda: Attention(32, 4, qk_norm="rms"), TypeError, "qk_norm"),
        (lambda: QKNorm("batch"), ValueError, "kind"),
        (lambda: QKNorm(scope="token"), ValueError, "scope"),  # type: ignore[arg-type]
        (lambda: QKNorm(eps=0.0), ValueError, "eps"),
        (lambda: RollingKVCache(0), ValueError, "window"),
    ],
)
def test_bad_options_name_the_argument(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_rolling_cache_needs_a_sliding_window_layer():
    x = torch.randn(1, 3, 32)
    with pytest.raises(ValueError, match="kv_cache"):
        Attention(32, 4)(x, is_causal=True, kv_cache=RollingKVCache(8))
    with pytest.raises(ValueError, match="kv_cache"):
        Attention(32, 4, sliding_window=8)(x, is_causal=True, kv_cache=RollingKVCache(4))


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_options_together_fp32_forward_and_backward(backend):
    """Every option at once (partial interleaved YaRN RoPE, QK-norm across heads, head_dim,
    scale, biases, sliding window, GQA) in fp32 against the same layer in fp64, gradients
    of the input and of every parameter (the norms' included); bf16 runs and stays close."""
    torch.manual_seed(9)
    rope = RopeConfig(
        fraction=0.5,
        interleaved=True,
        scaling=YarnScaling(factor=4.0, original_max_position_embeddings=8),
    )
    layer = Attention(
        48, 4, num_kv_heads=2, head_dim=16, scale=0.2, bias=True, out_bias=False, rope=rope,
        qk_norm=QKNorm("rms", scope="all"), sliding_window=6, backend=backend,
    )  # fmt: skip
    ref = copy.deepcopy(layer).double()
    x = torch.randn(2, 20, 48)
    x64 = x.double().requires_grad_()
    x32 = x.clone().requires_grad_()
    out64 = ref(x64, is_causal=True)
    out32 = layer(x32, is_causal=True)
    torch.testing.assert_close(out32, out64.float(), **tol(torch.float32))
    g = torch.randn_like(out64)
    out64.backward(g)
    out32.backward(g.float())
    assert x32.grad is not None and x64.grad is not None
    torch.testing.assert_close(x32.grad, x64.grad.float(), **tol(torch.float32))
    for (name, p32), p64 in zip(layer.named_parameters(), ref.parameters(), strict=True):
        assert p32.grad is not None, name
        torch.testing.assert_close(p32.grad, p64.grad.float(), **tol(torch.float32), msg=name)
    bf = copy.deepcopy(layer).to(torch.bfloat16)
    with torch.no_grad():
        out_bf = bf(x.bfloat16(), is_causal=True)
    assert bool(torch.isfinite(out_bf).all())
    torch.testing.assert_close(out_bf.float(), out64.detach().float(), atol=0.1, rtol=0.1)
