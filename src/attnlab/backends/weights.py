"""Exact attention weights from the fast path, for chosen heads and query rows only.

Shape legend: B batch, H query heads, G key/value heads, T query length, S key length,
D head dim; h selected heads, t selected rows.

The fast backends never hold the ``(B, H, T, S)`` weights. Given the per-row log-sum-exp
of the scaled, masked scores (saved by ``blockwise``; recomputed here in one extra pass
over key blocks when a backend did not save it), the weights of any row are exactly
``exp(score - lse)``. They are written block by block into a ``(B, h, t, S)`` result, so
the memory used is the size of what was asked for (plus one key block of scratch).
"""

from __future__ import annotations

import torch

from attnlab.backends.base import WeightsRequest, add_sinks, softcap_scores
from attnlab.masks import AttentionMask

__all__ = ["exact_weights", "select_weights"]

_BLOCK_K = 1024


def _select_heads(t: torch.Tensor, heads: torch.Tensor | None) -> torch.Tensor:
    if heads is None or t.ndim < 4 or t.shape[1] == 1:
        return t
    return t.index_select(1, heads.to(t.device))


def _apply_mask(
    s: torch.Tensor,
    mask: AttentionMask | None,
    T: int,
    S: int,
    rows: torch.Tensor | None,
    k0: int,
    k1: int,
    heads: torch.Tensor | None,
    softcap: float | None,
) -> torch.Tensor:
    """Soft-cap scores ``s`` (B, h, t, k1-k0) and apply the mask's tile ``rows x k0:k1``,
    in place."""
    softcap_scores(s, softcap, inplace=True)
    if mask is None:
        return s
    blk = mask.block(T, S, rows, slice(k0, k1), device=s.device)
    if blk.status == "empty":
        return s.fill_(float("-inf"))
    if blk.bias is not None:
        s.add_(_select_heads(blk.bias, heads).to(s.dtype))
    if blk.allowed is not None:
        s.masked_fill_(~_select_heads(blk.allowed, heads), float("-inf"))
    return s


def select_weights(weights: torch.Tensor, request: WeightsRequest) -> torch.Tensor:
    """Select heads and rows from full ``(B, H, T, S)`` weights."""
    heads = request.head_index(weights.shape[1], weights.device)
    rows = request.row_index(weights.shape[2], weights.device)
    if heads is not None:
        weights = weights.index_select(1, heads)
    if rows is not None:
        weights = weights.index_select(2, rows)
    return weights  # (B, h, t, S)


@torch.no_grad()
def exact_weights(
    query: torch.Tensor,
    key: torch.Tensor,
    mask: AttentionMask | None,
    scale: float,
    request: WeightsRequest,
    lse: torch.Tensor | None = None,
    *,
    block_k: int = _BLOCK_K,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact softmax weights for the requested heads and rows, block by block.

    Args:
        query: ``(B, H, T, D)``.
        key: ``(B, G, S, D)``.
        mask: the attnlab mask of the call, or None.
        scale: the score scale.
        request: which heads and rows.
        lse: per-row log-sum-exp ``(B, H, T)`` saved by the backend (including the
            sinks), or None to recompute it for the selected rows only.
        block_k: keys per block.
        softcap: the call's logit soft-cap, or None.
        sinks: the call's per-head sink logits ``(H,)``, or None; they take their share
            of each row's mass, so the returned rows sum to less than 1.

    Returns:
        Detached weights ``(B, h, t, S)`` in the query's dtype; rows that may attend to
        nothing are zeros.
    """
    B, H, T, _ = query.shape
    G, S = key.shape[1], key.shape[2]
    dev = query.device
    heads = request.head_index(H, dev)
    rows = request.row_index(T, dev)
    cd = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    q = query if heads is None else query.index_select(1, heads)
    q = q if rows is None else q.index_select(2, rows)  # (B, h, t, D)
    q = q.to(cd) * scale
    kv_heads = (heads if heads is not None else torch.arange(H, device=dev)) // (H // G)
    k = key.index_select(1, kv_heads) if (heads is not None or G != H) else key  # (B, h, S, D)
    k = k.to(cd)
    h, t = q.shape[1], q.shape[2]

    if lse is None:
        m = torch.full((B, h, t), float("-inf"), dtype=cd, device=dev)
        acc = torch.zeros((B, h, t), dtype=cd, device=dev)
        for k0 in range(0, S, block_k):
            k1 = min(S, k0 + block_k)
            s = q @ k[:, :, k0:k1].transpose(-2, -1)  # (B, h, t, tk)
            s = _apply_mask(s, mask, T, S, rows, k0, k1, heads, softcap)
            m_new = torch.maximum(m, s.amax(dim=-1))
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            acc = acc * torch.exp(m - m_safe) + torch.exp(s - m_safe[..., None]).sum(-1)
            m = m_new
        lse_sel = torch.where(acc > 0, m + torch.log(acc), torch.full_like(m, float("-inf")))
        if sinks is not None:
            sel = sinks if heads is None else sinks.index_select(0, heads)
            lse_sel = add_sinks(lse_sel, sel)
    else:
        lse_sel = lse if heads is None else lse.index_select(1, heads)
        lse_sel = lse_sel if rows is None else lse_sel.index_select(2, rows)  # (B, h, t)
        lse_sel = lse_sel.to(cd)
    # A row with nothing to attend to has lse = -inf; +inf makes exp(s - lse) = 0 there.
    lse_use = torch.where(lse_sel == float("-inf"), torch.full_like(lse_sel, float("inf")), lse_sel)

    out = torch.empty((B, h, t, S), dtype=cd, device=dev)
    for k0 in range(0, S, block_k):
        k1 = min(S, k0 + block_k)
        s = q @ k[:, :, k0:k1].transpose(-2, -1)  # (B, h, t, tk)
        s = _apply_mask(s, mask, T, S, rows, k0, k1, heads, softcap)
        out[..., k0:k1] = s.sub_(lse_use[..., None]).exp_()
    return out.to(query.dtype)
