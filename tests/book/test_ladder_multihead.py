"""The ladder's causal and multi-head rungs: the book's printed outputs, each rung
against the one before, and the production Attention layer against the last rung."""

from __future__ import annotations

import pytest
import torch

from attnlab.attention import Attention
from attnlab.ladder import (
    CausalAttention,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    SelfAttentionV2,
)
from attnlab.masks import CausalMask
from reference import reference_attention, tol

INPUTS = torch.tensor(
    [
        [0.43, 0.15, 0.89],  # Your
        [0.55, 0.87, 0.66],  # journey
        [0.57, 0.85, 0.64],  # starts
        [0.22, 0.58, 0.33],  # with
        [0.77, 0.25, 0.10],  # one
        [0.05, 0.80, 0.55],  # step
    ]
)
BATCH = torch.stack((INPUTS, INPUTS))  # (2, 6, 3), the book's batch

# The book's printed outputs (chapter 3, sections 3.5.3 and 3.6), 4 decimals.
BOOK_CAUSAL = [
    [-0.4519, 0.2216],
    [-0.5874, 0.0058],
    [-0.6300, -0.0632],
    [-0.5675, -0.0843],
    [-0.5526, -0.0981],
    [-0.5299, -0.1081],
]
BOOK_WRAPPER_HEAD2 = [
    [0.4772, 0.1063],
    [0.5891, 0.3257],
    [0.6202, 0.3860],
    [0.5478, 0.3589],
    [0.5321, 0.3428],
    [0.5077, 0.3493],
]
BOOK_MHA = [
    [0.3190, 0.4858],
    [0.2943, 0.3897],
    [0.2856, 0.3593],
    [0.2693, 0.3873],
    [0.2639, 0.3928],
    [0.2575, 0.4028],
]
PRINTED = {"atol": 6e-5, "rtol": 0}


def test_causal_attention_reproduces_the_book():
    torch.manual_seed(123)
    ca = CausalAttention(3, 2, BATCH.shape[1], 0.0)
    out = ca(BATCH)
    assert out.shape == (2, 6, 2)
    torch.testing.assert_close(out[0], torch.tensor(BOOK_CAUSAL), **PRINTED)
    torch.testing.assert_close(out[1], out[0])


def test_wrapper_reproduces_the_book():
    torch.manual_seed(123)
    mha = MultiHeadAttentionWrapper(3, 2, BATCH.shape[1], 0.0, num_heads=2)
    out = mha(BATCH)
    assert out.shape == (2, 6, 4)
    expect = torch.cat([torch.tensor(BOOK_CAUSAL), torch.tensor(BOOK_WRAPPER_HEAD2)], dim=-1)
    torch.testing.assert_close(out[0], expect, **PRINTED)


def test_multi_head_attention_reproduces_the_book():
    torch.manual_seed(123)
    mha = MultiHeadAttention(3, 2, BATCH.shape[1], 0.0, num_heads=2)
    torch.testing.assert_close(mha(BATCH)[0], torch.tensor(BOOK_MHA), **PRINTED)
    names = [n for n, _ in mha.named_parameters()]
    assert names[:3] == ["W_query.weight", "W_key.weight", "W_value.weight"]
    assert names[3:] == ["out_proj.weight", "out_proj.bias"]


def test_causal_rung_is_v2_plus_the_mask():
    """CausalAttention = SelfAttentionV2 with the future hidden (the rung before)."""
    torch.manual_seed(7)
    v2 = SelfAttentionV2(3, 4).double()
    ca = CausalAttention(3, 4, 6, 0.0).double()
    ca.load_state_dict(v2.state_dict(), strict=False)
    x = BATCH.double()
    q, k, v = v2.project(x)
    ref, _ = reference_attention(q[:, None], k[:, None], v[:, None], CausalMask().dense(6, 6))
    torch.testing.assert_close(ca(x), ref[:, 0], **tol(torch.float64))
    # The last token sees everything: it equals V2's output there.
    torch.testing.assert_close(ca(x)[:, -1], v2(x)[:, -1], **tol(torch.float64))


def test_multi_head_equals_wrapper_with_split_weights():
    """MultiHeadAttention with out_proj = identity equals the wrapper whose heads hold the
    row blocks of its projections."""
    torch.manual_seed(8)
    H, hd = 3, 2
    wrapper = MultiHeadAttentionWrapper(3, hd, 6, 0.0, num_heads=H).double()
    mha = MultiHeadAttention(3, H * hd, 6, 0.0, num_heads=H).double()
    with torch.no_grad():
        for name in ("W_query", "W_key", "W_value"):
            blocks = [getattr(h, name).weight for h in wrapper.heads]
            getattr(mha, name).weight.copy_(torch.cat(blocks, dim=0))
        mha.out_proj.weight.copy_(torch.eye(H * hd))
        mha.out_proj.bias.zero_()
    torch.testing.assert_close(mha(BATCH.double()), wrapper(BATCH.double()), **tol(torch.float64))


@pytest.mark.parametrize("backend", ["math", "blockwise", "sdpa"])
@pytest.mark.parametrize("qkv_bias", [False, True])
def test_attention_layer_equals_ladder_after_weight_copy(backend, qkv_bias):
    torch.manual_seed(9)
    ladder = MultiHeadAttention(12, 12, 10, 0.0, num_heads=4, qkv_bias=qkv_bias).double()
    layer = Attention(12, 4, bias=qkv_bias, backend=backend).double()
    missing = layer.load_state_dict(ladder.state_dict(), strict=False)
    assert missing.missing_keys == [] and missing.unexpected_keys == ["mask"]
    x = torch.randn(3, 10, 12, dtype=torch.float64)
    torch.testing.assert_close(layer(x, is_causal=True), ladder(x), **tol(torch.float64))


def test_dropout_applies_in_training_only():
    torch.manual_seed(10)
    mha = MultiHeadAttention(4, 4, 6, 0.5, num_heads=2)
    x = torch.rand(1, 6, 4)
    mha.eval()
    a, b = mha(x), mha(x)
    torch.testing.assert_close(a, b)
    mha.train()
    assert not torch.allclose(mha(x), a)


@pytest.mark.parametrize(
    ("make", "exc", "match"),
    [
        (
            lambda: MultiHeadAttention(3, 5, 6, 0.0, num_heads=2),
            ValueError,
            r"`d_out` \(5\) must be divisible by `num_heads` \(2\).*\[1, 5\]",
        ),
        (lambda: MultiHeadAttention(3, 4, 6, 0.0, num_heads=0), ValueError, "`num_heads`"),
        (lambda: CausalAttention(3, 2, 0, 0.0), ValueError, "`context_length`"),
        (lambda: CausalAttention(3, 2, 6, 1.5), ValueError, r"`dropout` must be in \[0, 1\)"),
        (
            lambda: MultiHeadAttentionWrapper(3, 2, 6, 0.0, num_heads=2.0),
            TypeError,
            "`num_heads` must be an int",
        ),
    ],
)
def test_constructor_errors(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


@pytest.mark.parametrize(
    "module",
    [
        CausalAttention(3, 2, 4, 0.0),
        MultiHeadAttentionWrapper(3, 2, 4, 0.0, num_heads=2),
        MultiHeadAttention(3, 2, 4, 0.0, num_heads=2),
    ],
    ids=lambda m: type(m).__name__,
)
def test_input_longer_than_context_length_is_a_clear_error(module):
    with pytest.raises(ValueError, match=r"`x` has 6 tokens, more than the context_length=4"):
        module(BATCH)
    with pytest.raises(ValueError, match="d_in=3"):
        module(torch.rand(2, 3, 5))
