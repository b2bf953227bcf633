"""The blockwise backend's tiles: many tiles per call, tile skipping, the reusable chunk
kernel and log-sum-exp merge, linear memory."""

from __future__ import annotations

import math

import pytest
import torch

from attnlab._memory import peak_allocated
from attnlab.backends.blockwise import (
    attend_chunk,
    attend_chunk_backward,
    blockwise_attention,
    merge_partials,
)
from attnlab.masks import AdditiveMask, CausalMask, as_mask
from reference import reference_attention, tol
from test_backends import MASK_KINDS, make_mask, reference_for

F64 = tol(torch.float64)


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(("T", "S"), [(23, 31), (31, 17)])
def test_many_small_tiles_match_reference(kind, is_causal, T, S):
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(2, 4, T, 9, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, S, 9, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, S, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(2, 4, T, 6, generator=gen, dtype=torch.float64)
    user_mask = make_mask(kind, T, S, gen)
    mask = as_mask(user_mask, is_causal)
    res = blockwise_attention(q, k, v, mask, dropout_p=0.0, scale=0.3, block_q=5, block_k=7)
    res.output.backward(dout)
    grads = [t.grad.clone() for t in (q, k, v)]
    dmask, dbias = reference_for(user_mask, is_causal, T, S)
    ref, w = reference_attention(q, k, v, mask=dmask, bias=dbias, scale=0.3)
    for t in (q, k, v):
        t.grad = None
    ref.backward(dout)
    torch.testing.assert_close(res.output, ref, **F64)
    for g, t in zip(grads, (q, k, v), strict=True):
        torch.testing.assert_close(g, t.grad, **F64)
    # The saved log-sum-exp reproduces the weights: w = exp(s - lse).
    assert res.lse is not None and res.lse.shape == (2, 4, T)
    empty = w.sum(-1) == 0
    assert torch.equal(res.lse == -math.inf, empty)


def test_very_negative_bias_is_not_flushed_to_zero():
    """A row whose scores are all around -1e4 (a soft mask) still gets a softmax."""
    q = torch.randn(1, 1, 12, 8, dtype=torch.float64)
    k = torch.randn(1, 1, 12, 8, dtype=torch.float64)
    v = torch.randn(1, 1, 12, 8, dtype=torch.float64)
    bias = torch.zeros(12, 12, dtype=torch.float64)
    bias[:, :4] = -math.inf
    bias[:, 4:] = -1e4
    mask = AdditiveMask(bias)
    res = blockwise_attention(q, k, v, mask, dropout_p=0.0, scale=1.0, block_q=4, block_k=4)
    ref, _ = reference_attention(q, k, v, bias=bias, scale=1.0)
    torch.testing.assert_close(res.output, ref, **F64)


def test_chunks_merged_by_lse_equal_the_whole():
    """What ring attention does: attend to key chunks separately, merge by log-sum-exp."""
    gen = torch.Generator().manual_seed(12)
    T, S = 20, 30
    q = torch.randn(1, 2, T, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 2, S, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(1, 2, S, 8, generator=gen, dtype=torch.float64)
    mask = CausalMask()
    full, full_lse = attend_chunk(q, k, v, mask, 0.5)
    out, lse = None, None
    for k0 in range(0, S, 11):
        part = attend_chunk(
            q, k[:, :, k0 : k0 + 11], v[:, :, k0 : k0 + 11], mask, 0.5,
            k_offset=k0, S_total=S, block_q=6, block_k=4,
        )  # fmt: skip
        out, lse = part if out is None else merge_partials(out, lse, *part)
    torch.testing.assert_close(out, full, **F64)
    torch.testing.assert_close(lse, full_lse, **F64)
    # In place, into row slices of accumulators (as ring attention merges): the same.
    acc = torch.zeros_like(full)
    acc_lse = torch.full_like(full_lse, float("-inf"))
    for k0 in range(0, S, 11):
        for q0 in (0, 7):  # two row pieces: the accumulator slices are views
            rows = slice(q0, 7 if q0 == 0 else T)
            part = attend_chunk(
                q[:, :, rows], k[:, :, k0 : k0 + 11], v[:, :, k0 : k0 + 11], mask, 0.5,
                q_offset=q0, k_offset=k0, T_total=T, S_total=S,
            )  # fmt: skip
            got = merge_partials(acc[:, :, rows], acc_lse[:, :, rows], *part, inplace=True)
            assert got[0].data_ptr() == acc[:, :, rows].data_ptr()
    torch.testing.assert_close(acc, full, **F64)
    torch.testing.assert_close(acc_lse, full_lse, **F64)
    # And the backward pieces add up to the whole.
    dout = torch.randn_like(full)
    delta = (dout * full).sum(-1)
    whole = attend_chunk_backward(q, k, v, dout, full_lse, delta, mask, 0.5)
    dk_parts, dq_sum = [], torch.zeros_like(q)
    for k0 in range(0, S, 11):
        dq, dk, _ = attend_chunk_backward(
            q, k[:, :, k0 : k0 + 11], v[:, :, k0 : k0 + 11], dout, full_lse, delta, mask, 0.5,
            k_offset=k0, S_total=S,
        )  # fmt: skip
        dq_sum += dq
        dk_parts.append(dk)
    torch.testing.assert_close(dq_sum, whole[0], **F64)
    torch.testing.assert_close(torch.cat(dk_parts, dim=2), whole[1], **F64)


def test_causal_tiles_above_the_diagonal_are_skipped(monkeypatch):
    calls = []
    real_bmm = torch.bmm

    def counting_bmm(a, b):
        if a.shape[-1] == 8:  # a score tile (q @ k^T, D = 8), not p @ v (tk = 16)
            calls.append(a.shape)
        return real_bmm(a, b)

    q = k = v = torch.randn(1, 1, 64, 8)
    monkeypatch.setattr(torch, "bmm", counting_bmm)
    blockwise_attention(q, k, v, CausalMask(), dropout_p=0.0, scale=1.0, block_q=16, block_k=16)
    causal_calls = len(calls)
    calls.clear()
    blockwise_attention(q, k, v, None, dropout_p=0.0, scale=1.0, block_q=16, block_k=16)
    # 4 x 4 tiles without a mask, 4 + 3 + 2 + 1 = 10 on and below the diagonal.
    assert (causal_calls, len(calls)) == (10, 16)


def test_training_memory_grows_linearly():
    """Forward + backward peak memory: doubling T at most doubles it (no T x S)."""

    def peak(T: int) -> int:
        q, k, v = (torch.randn(1, 2, T, 32, requires_grad=True) for _ in range(3))

        def step():
            res = blockwise_attention(q, k, v, CausalMask(), dropout_p=0.0, scale=0.2)
            res.output.sum().backward()

        return peak_allocated(step)[1]

    p1, p2 = peak(1024), peak(2048)
    assert p2 <= 2.1 * p1, (p1, p2)
    assert p2 < 2 * 2048 * 2048 * 4  # far below one fp32 T x S matrix per head
