"""attnlab.attention: the production layer (GQA, cross attention, RoPE, KV cache, capture)."""

from __future__ import annotations

import math

import pytest
import torch

from attnlab.attention import Attention, KVCache, RotaryEmbedding
from attnlab.backends import WeightsRequest, available_backends
from attnlab.masks import CausalMask, PaddingMask
from reference import reference_attention, tol

BACKENDS = [b for b in available_backends() if b not in ("auto", "ring")]
F64 = tol(torch.float64)


def manual_forward(layer: Attention, x, context=None, mask=None):
    """The layer's math written out with the fp64 reference."""
    B, T, _ = x.shape
    src = x if context is None else context
    H, G, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
    q = layer.W_query(x).view(B, T, H, D).transpose(1, 2)
    k = layer.W_key(src).view(B, -1, G, D).transpose(1, 2)
    v = layer.W_value(src).view(B, -1, G, D).transpose(1, 2)
    out, w = reference_attention(q, k, v, mask=mask)
    return layer.out_proj(out.transpose(1, 2).reshape(B, T, H * D)), w


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("H", "G"), [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_layer_matches_reference(backend, H, G):
    torch.manual_seed(0)
    layer = Attention(32, H, num_kv_heads=G, bias=True, backend=backend).double()
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    out, w = layer(x, is_causal=True, need_weights=True)
    ref, ref_w = manual_forward(layer, x, mask=CausalMask().dense(9, 9))
    torch.testing.assert_close(out, ref, **F64)
    torch.testing.assert_close(w, ref_w, **F64)


def test_cross_attention_with_kdim():
    torch.manual_seed(1)
    layer = Attention(24, 3, kdim=10, vdim=10).double()
    x = torch.randn(2, 5, 24, dtype=torch.float64)
    ctx = torch.randn(2, 7, 10, dtype=torch.float64)
    valid = PaddingMask.from_lengths([7, 4], 7)
    out = layer(x, ctx, attn_mask=valid)
    ref, _ = manual_forward(layer, x, ctx, mask=valid.dense(5, 7))
    assert out.shape == (2, 5, 24)
    torch.testing.assert_close(out, ref, **F64)


def rope_by_complex_numbers(x: torch.Tensor, pos: torch.Tensor, base: float) -> torch.Tensor:
    """Independent RoPE: pair (i, i + D/2) as the complex number x_i + 1j x_{i+D/2}."""
    D = x.shape[-1]
    theta = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)  # (D/2,)
    angle = pos.double()[:, None] * theta  # (T, D/2)
    z = torch.complex(x[..., : D // 2].double(), x[..., D // 2 :].double())
    z = z * torch.polar(torch.ones_like(angle), angle)
    return torch.cat([z.real, z.imag], dim=-1)


@pytest.mark.parametrize("base", [10000.0, 500000.0])
def test_rope_rotate_half_matches_complex_rotation(base):
    rope = RotaryEmbedding(16, base=base)
    x = torch.randn(2, 3, 11, 16, dtype=torch.float64)
    pos = torch.arange(5, 16)
    torch.testing.assert_close(rope(x, pos), rope_by_complex_numbers(x, pos, base), **F64)


def test_rope_scores_depend_only_on_relative_position():
    rope = RotaryEmbedding(8)
    q, k = (
        torch.randn(1, 1, 1, 8, dtype=torch.float64),
        torch.randn(1, 1, 1, 8, dtype=torch.float64),
    )

    def score(pq: int, pk: int) -> torch.Tensor:
        return (rope(q, torch.tensor([pq])) * rope(k, torch.tensor([pk]))).sum()

    torch.testing.assert_close(score(7, 3), score(104, 100), **F64)
    assert not torch.allclose(score(7, 3), score(7, 4))


@pytest.mark.parametrize("backend", BACKENDS)
def test_kv_cache_incremental_equals_full(backend):
    torch.manual_seed(2)
    layer = Attention(32, 4, num_kv_heads=2, rope=True, backend=backend).eval()
    x = torch.randn(2, 12, 32)
    full = layer(x, is_causal=True)
    cache = KVCache()
    steps = [layer(x[:, :5], is_causal=True, kv_cache=cache)]
    steps += [layer(x[:, t : t + 1], is_causal=True, kv_cache=cache) for t in range(5, 12)]
    assert cache.seq_len == 12
    torch.testing.assert_close(torch.cat(steps, dim=1), full, **tol(torch.float32))
    cache.reset()
    assert cache.seq_len == 0


def test_kv_cache_rejects_mismatched_shapes():
    cache = KVCache()
    cache.update(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))
    with pytest.raises(ValueError, match="do not match the cache"):
        cache.update(torch.randn(1, 3, 1, 4), torch.randn(1, 3, 1, 4))


def test_position_ids_default_and_explicit_agree():
    torch.manual_seed(3)
    layer = Attention(16, 2, rope=RotaryEmbedding(8, base=100.0)).eval()
    x = torch.randn(2, 6, 16)
    a = layer(x, is_causal=True)
    b = layer(x, is_causal=True, position_ids=torch.arange(6).expand(2, 6))
    c = layer(x, is_causal=True, position_ids=torch.arange(10, 16))
    torch.testing.assert_close(a, b)
    # RoPE is relative: shifting every position leaves self-attention unchanged.
    torch.testing.assert_close(a, c, **tol(torch.float32))


def test_capture_stores_exact_weights():
    torch.manual_seed(4)
    layer = Attention(32, 4, num_kv_heads=2).double()
    x = torch.randn(1, 10, 32, dtype=torch.float64)
    _, full = manual_forward(layer, x, mask=CausalMask().dense(10, 10))
    assert layer.capture is None and layer.captured is None
    layer.capture = True
    out = layer(x, is_causal=True)
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(layer.captured, full, **F64)
    layer.capture = WeightsRequest(heads=(2,), rows=(9, 0))
    layer(x, is_causal=True, need_weights=True)
    torch.testing.assert_close(layer.captured, full[:, [2]][:, :, [9, 0]], **F64)


def test_dropout_zero_is_identity_and_dropout_only_in_training():
    torch.manual_seed(5)
    layer = Attention(16, 2, dropout=0.0, backend="math")
    x = torch.randn(2, 7, 16)
    layer.train()
    a = layer(x, is_causal=True)
    layer.eval()
    torch.testing.assert_close(a, layer(x, is_causal=True), rtol=0, atol=0)
    noisy = Attention(16, 2, dropout=0.5, backend="math")
    noisy.load_state_dict(layer.state_dict())
    noisy.train()
    assert not torch.allclose(noisy(x, is_causal=True), a)
    noisy.eval()
    torch.testing.assert_close(noisy(x, is_causal=True), layer(x, is_causal=True))


def test_parameters_created_in_book_order():
    layer = Attention(8, 2, bias=True)
    names = [n for n, _ in layer.named_parameters()]
    assert names == [
        "W_query.weight",
        "W_query.bias",
        "W_key.weight",
        "W_key.bias",
        "W_value.weight",
        "W_value.bias",
        "out_proj.weight",
        "out_proj.bias",
    ]
    assert "rope" not in "".join(Attention(8, 2, rope=True).state_dict())


@pytest.mark.parametrize(
    ("make", "exc", "match"),
    [
        (lambda: Attention(10, 3), ValueError, r"`embed_dim` \(10\) must be divisible"),
        (lambda: Attention(12, 4, num_kv_heads=3), ValueError, r"`num_kv_heads` must be"),
        (lambda: Attention(8, 2, dropout=-0.1), ValueError, r"`dropout` must be in"),
        (lambda: Attention(8, 2, backend="nope"), ValueError, r"`backend` must be one of"),
        (lambda: RotaryEmbedding(7), ValueError, r"`head_dim` must be a positive even"),
        (
            lambda: Attention(8, 2, rope=RotaryEmbedding(8)),
            ValueError,
            r"`rope` has head_dim=8",
        ),
    ],
)
def test_constructor_errors(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_forward_errors():
    layer = Attention(8, 2)
    with pytest.raises(ValueError, match=r"`x` must be \(B, T, C=8\)"):
        layer(torch.randn(2, 3, 9))
    with pytest.raises(ValueError, match="`context` must be"):
        layer(torch.randn(2, 3, 8), torch.randn(1, 3, 8))
    with pytest.raises(ValueError, match="rope"):
        Attention(8, 2, rope=True)(torch.randn(1, 3, 8), torch.randn(1, 2, 8))
    with pytest.raises(ValueError, match="position_ids"):
        Attention(8, 2, rope=True)(torch.randn(1, 3, 8), position_ids=torch.arange(4))


def test_scale_matches_book_convention():
    """The layer scales by 1/sqrt(head_dim), as the book's MultiHeadAttention."""
    torch.manual_seed(6)
    layer = Attention(12, 3).double()
    x = torch.randn(1, 4, 12, dtype=torch.float64)
    q = layer.W_query(x).view(1, 4, 3, 4).transpose(1, 2)
    k = layer.W_key(x).view(1, 4, 3, 4).transpose(1, 2)
    scores = q @ k.transpose(-2, -1) / math.sqrt(4)
    _, w = layer(x, need_weights=True)
    torch.testing.assert_close(w, torch.softmax(scores, -1), **F64)
