"""Property-based tests (hypothesis) on top of the conformance grid."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.backends import available_backends
from attnlab.backends.blockwise import attend_chunk, blockwise_attention, merge_partials
from attnlab.functional import scaled_dot_product_attention
from attnlab.masks import (
    BooleanMask,
    CausalMask,
    PaddingMask,
    SlidingWindowMask,
    as_mask,
)
from reference import reference_attention, tol

BACKENDS = [b for b in available_backends() if b not in ("auto", "ring")]
F64 = tol(torch.float64)
SETTINGS = settings(max_examples=30, deadline=None)


@st.composite
def problems(draw):
    B = draw(st.integers(1, 2))
    G = draw(st.integers(1, 2))
    H = G * draw(st.integers(1, 3))
    T = draw(st.integers(1, 20))
    S = draw(st.integers(1, 20))
    D = draw(st.integers(1, 12))
    seed = draw(st.integers(0, 2**16))
    kind = draw(st.sampled_from(["none", "causal_tl", "padding", "window", "boolean"]))
    is_causal = draw(st.booleans())
    gen = torch.Generator().manual_seed(seed)
    if kind == "none":
        mask = None
    elif kind == "causal_tl":
        mask = CausalMask("top_left")
    elif kind == "padding":
        mask = PaddingMask.from_lengths(torch.randint(0, S + 1, (B,), generator=gen), S)
    elif kind == "window":
        mask = SlidingWindowMask(draw(st.integers(1, 6)), causal=draw(st.booleans()))
    else:
        mask = BooleanMask(torch.rand(B, draw(st.sampled_from([1, H])), T, S, generator=gen) > 0.4)
    q = torch.randn(B, H, T, D, generator=gen, dtype=torch.float64)
    k = torch.randn(B, G, S, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, G, S, D, generator=gen, dtype=torch.float64)
    return q, k, v, mask, is_causal


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(problem=problems())
def test_every_backend_equals_the_reference(backend, problem):
    q, k, v, mask, is_causal = problem
    out, w = scaled_dot_product_attention(
        q, k, v, mask, is_causal=is_causal, backend=backend, need_weights=True
    )
    full = as_mask(mask, is_causal)
    dense = None if full is None else full.dense(q.shape[2], k.shape[2])
    ref, ref_w = reference_attention(q, k, v, mask=dense)
    torch.testing.assert_close(out, ref, **F64)
    torch.testing.assert_close(w, ref_w, **F64)
    sums = w.sum(-1)
    assert bool(((sums - 1).abs() < 1e-9).logical_or(sums == 0).all())


@SETTINGS
@given(problem=problems(), bq=st.integers(1, 9), bk=st.integers(1, 9))
def test_blockwise_is_independent_of_tile_size(problem, bq, bk):
    q, k, v, mask, is_causal = problem
    m = as_mask(mask, is_causal)
    a = blockwise_attention(q, k, v, m, dropout_p=0.0, scale=0.7, block_q=bq, block_k=bk)
    b = blockwise_attention(q, k, v, m, dropout_p=0.0, scale=0.7)
    torch.testing.assert_close(a.output, b.output, **F64)
    torch.testing.assert_close(a.lse, b.lse, **F64)


@SETTINGS
@given(problem=problems(), cut=st.integers(0, 20))
def test_merging_two_key_chunks_equals_one_pass(problem, cut):
    q, k, v, mask, is_causal = problem
    m = as_mask(mask, is_causal)
    S = k.shape[2]
    cut = min(cut, S)
    whole = attend_chunk(q, k, v, m, 0.5)
    left = attend_chunk(q, k[:, :, :cut], v[:, :, :cut], m, 0.5, S_total=S)
    right = attend_chunk(q, k[:, :, cut:], v[:, :, cut:], m, 0.5, k_offset=cut, S_total=S)
    out, lse = merge_partials(*left, *right)
    torch.testing.assert_close(out, whole[0], **F64)
    torch.testing.assert_close(lse, whole[1], **F64)


@settings(max_examples=60, deadline=None)
@given(
    T=st.integers(1, 30),
    S=st.integers(1, 30),
    window=st.integers(1, 8),
    causal=st.booleans(),
    top_left=st.booleans(),
    q0=st.integers(0, 29),
    k0=st.integers(0, 29),
    size=st.integers(1, 12),
)
def test_structured_tiles_and_key_ranges_agree_with_dense(
    T, S, window, causal, top_left, q0, k0, size
):
    align = "top_left" if top_left else "bottom_right"
    for mask in (CausalMask(align), SlidingWindowMask(window, causal=causal, alignment=align)):
        dense = mask.dense(T, S)[0, 0]
        q0c, k0c = min(q0, T - 1), min(k0, S - 1)
        q1, k1 = min(T, q0c + size), min(S, k0c + size)
        blk = mask.block(T, S, slice(q0c, q1), slice(k0c, k1))
        tile = dense[q0c:q1, k0c:k1]
        if blk.status == "empty":
            assert not bool(tile.any())
        elif blk.status == "full":
            assert bool(tile.all())
        else:
            assert torch.equal(blk.allowed[0, 0], tile)
        lo, hi = mask.col_range(T, S, q0c, q1)
        rows = dense[q0c:q1]
        assert not bool(rows[:, :lo].any()) and not bool(rows[:, hi:].any())
