"""attnlab.masks: semantics (True = may attend), tiles agree with the dense mask,
validation."""

from __future__ import annotations

import pytest
import torch

from attnlab.masks import (
    AdditiveMask,
    AndMask,
    BooleanMask,
    CausalMask,
    ChunkedMask,
    PaddingMask,
    SlidingWindowMask,
    as_mask,
)


def test_causal_bottom_right_and_top_left():
    T, S = 3, 5
    br = CausalMask().dense(T, S)[0, 0]
    tl = CausalMask("top_left").dense(T, S)[0, 0]
    for i in range(T):
        for j in range(S):
            assert bool(br[i, j]) == (j <= i + S - T)
            assert bool(tl[i, j]) == (j <= i)
    # The last query sees every key when aligned bottom-right (decoding with a cache).
    assert bool(br[-1].all())


def test_causal_more_queries_than_keys_gives_empty_rows():
    m = CausalMask().dense(5, 2)[0, 0]
    assert not bool(m[:3].any()) and bool(m[3, 0]) and bool(m[4].all())
    assert CausalMask().may_empty_rows(5, 2)
    assert not CausalMask().may_empty_rows(2, 5)


@pytest.mark.parametrize("causal", [True, False])
def test_sliding_window(causal):
    T = S = 9
    w = 3
    m = SlidingWindowMask(w, causal=causal).dense(T, S)[0, 0]
    for i in range(T):
        for j in range(S):
            expect = (0 <= i - j < w) if causal else abs(i - j) < w
            assert bool(m[i, j]) == expect


@pytest.mark.parametrize(
    ("T", "S", "alignment"),
    [(10, 10, "bottom_right"), (4, 11, "bottom_right"), (6, 3, "bottom_right"), (7, 9, "top_left")],
)
def test_chunked_sees_its_own_chunk_causally(T, S, alignment):
    c = 3
    m = ChunkedMask(c, alignment=alignment)
    dense = m.dense(T, S)[0, 0]
    off = S - T if alignment == "bottom_right" else 0
    for i in range(T):
        p = i + off  # the query's absolute position
        for j in range(S):
            expect = p >= 0 and j <= p and j // c == p // c
            assert bool(dense[i, j]) == expect, (i, j)
    assert m.may_empty_rows(T, S) == (off < 0)
    # col_range bounds every row block's keys: nothing allowed outside it.
    for q0 in range(T):
        for q1 in range(q0 + 1, T + 1):
            lo, hi = m.col_range(T, S, q0, q1)
            assert not bool(dense[q0:q1, :lo].any()) and not bool(dense[q0:q1, hi:].any())


def test_chunked_tiles_across_chunks_are_empty():
    m = ChunkedMask(4)
    # rows 8..11 (chunk 2) against keys 0..7 (chunks 0, 1): skipped though causal allows
    assert m.block_status(16, 16, slice(8, 12), slice(0, 8)) == "empty"
    assert m.block(16, 16, slice(8, 12), slice(0, 8)).status == "empty"
    assert m.block(16, 16, slice(8, 12), slice(8, 12)).status == "partial"
    assert m.block(16, 16, slice(10, 12), slice(8, 10)).status == "full"
    assert m.col_range(16, 16, 9, 12) == (8, 12)


def test_padding_from_lengths():
    m = PaddingMask.from_lengths([2, 4], 4)
    assert m.valid.tolist() == [[True, True, False, False], [True] * 4]
    d = m.dense(3, 4)
    assert d.shape == (2, 1, 3, 4)
    assert not bool(d[0, 0, :, 2:].any()) and bool(d[1].all())


def test_and_combines_allowed_and_adds_biases():
    a = CausalMask()
    b = PaddingMask.from_lengths([3], 5)
    both = (a & b).dense(5, 5)
    torch.testing.assert_close(both, a.dense(5, 5) & b.dense(5, 5))
    bias = torch.randn(5, 5)
    m = AdditiveMask(bias) & CausalMask() & AdditiveMask(bias)
    assert isinstance(m, AndMask) and len(m.parts) == 3
    d = m.dense(5, 5)[0, 0]
    expect = (2 * bias).masked_fill(~CausalMask().dense(5, 5)[0, 0], float("-inf"))
    torch.testing.assert_close(d, expect)


MASKS = [
    CausalMask(),
    CausalMask("top_left"),
    SlidingWindowMask(4),
    SlidingWindowMask(3, causal=False, alignment="top_left"),
    PaddingMask.from_lengths([0, 5, 11], 11),
    BooleanMask(torch.rand(3, 1, 13, 11) > 0.5),
    PaddingMask.from_lengths([4, 7, 11], 11) & SlidingWindowMask(5),
    ChunkedMask(4),
    ChunkedMask(3, alignment="top_left"),
    ChunkedMask(5) & PaddingMask.from_lengths([4, 7, 11], 11),
]


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: type(m).__name__)
def test_tiles_agree_with_dense(mask):
    T, S = 13, 11
    dense = mask.dense(T, S).expand(3, 1, T, S)
    for q0 in range(0, T, 4):
        for k0 in range(0, S, 3):
            q1, k1 = min(T, q0 + 4), min(S, k0 + 3)
            tile = dense[:, :, q0:q1, k0:k1]
            blk = mask.block(T, S, slice(q0, q1), slice(k0, k1))
            if blk.status == "empty":
                assert not bool(tile.any())
            elif blk.status == "full":
                assert bool(tile.all())
            else:
                assert blk.allowed is not None
                assert torch.equal(blk.allowed.expand_as(tile), tile)


def test_rows_and_cols_as_index_tensors():
    m = SlidingWindowMask(2) & PaddingMask.from_lengths([3, 6], 6)
    dense = m.dense(6, 6)
    rows, cols = torch.tensor([5, 0, 3]), torch.tensor([1, 4, 5])
    part = m.dense(6, 6, rows, cols)
    torch.testing.assert_close(part, dense[:, :, rows][:, :, :, cols])


def test_causal_tile_skipping_is_structural():
    m = CausalMask()
    assert m.block(8, 8, slice(0, 4), slice(4, 8)).status == "empty"
    assert m.block(8, 8, slice(4, 8), slice(0, 4)).status == "full"
    assert m.block(8, 8, slice(0, 4), slice(0, 4)).status == "partial"


def test_as_mask_normalises():
    assert as_mask(None) is None
    assert isinstance(as_mask(None, True), CausalMask)
    assert isinstance(as_mask(torch.ones(2, 2, dtype=torch.bool)), BooleanMask)
    assert isinstance(as_mask(torch.zeros(2, 2)), AdditiveMask)
    assert isinstance(as_mask(PaddingMask.from_lengths([1], 2), True), AndMask)


def test_bad_masks_raise():
    with pytest.raises(TypeError, match="bool tensor"):
        as_mask(torch.ones(2, 2, dtype=torch.long))
    with pytest.raises(TypeError, match="attn_mask"):
        as_mask([[True]])
    with pytest.raises(ValueError, match=r"broadcast to \(B, H, T, S\)"):
        BooleanMask(torch.ones(3, 4, dtype=torch.bool)).validate(1, 2, 5, 4)
    with pytest.raises(ValueError, match="NaN"):
        AdditiveMask(torch.tensor([[float("nan")]]))
    with pytest.raises(ValueError, match="window"):
        SlidingWindowMask(0)
    with pytest.raises(ValueError, match="`chunk` must be an int >= 1, got 0"):
        ChunkedMask(0)
    with pytest.raises(ValueError, match="alignment"):
        CausalMask("bottom")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"\(B, S\)"):
        PaddingMask.from_lengths([2], 3).validate(1, 1, 3, 4)
    with pytest.raises(TypeError, match="valid"):
        PaddingMask(torch.ones(1, 3))
    with pytest.raises(ValueError, match="lengths"):
        PaddingMask.from_lengths([5], 3)


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: type(m).__name__)
@pytest.mark.parametrize(("T", "S"), [(13, 11), (11, 13)])
def test_key_band_agrees_with_dense(mask, T, S):
    """Where a mask says its keys are one diagonal band, the dense mask is that band."""
    band = mask.key_band(T, S)
    if band is None:
        assert not isinstance(mask, (CausalMask, SlidingWindowMask))
        return
    first, last = band
    t = torch.arange(T)[:, None]
    j = torch.arange(S)[None, :]
    expect = j <= t + last
    if first is not None:
        expect &= j >= t + first
    assert torch.equal(mask.dense(T, S).expand(1, 1, T, S)[0, 0], expect)


def test_key_band_of_and_masks_intersects_bands():
    both = SlidingWindowMask(5) & CausalMask()
    assert both.key_band(9, 9) == SlidingWindowMask(5).key_band(9, 9) == (-4, 0)
    assert CausalMask().key_band(4, 9) == (None, 5)
    assert SlidingWindowMask(3, causal=False, alignment="top_left").key_band(9, 9) == (-2, 2)
    assert (SlidingWindowMask(5) & PaddingMask.from_lengths([3], 9)).key_band(9, 9) is None
