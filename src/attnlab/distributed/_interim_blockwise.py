"""INTERIM stand-in for ``attnlab.backends.blockwise``'s reusable pieces (issue 3).

Issue 3 owns the one shared copy of the blockwise kernel: ``attend_chunk``,
``attend_chunk_backward`` and ``merge_partials``, with a causal ``attnlab.masks.CausalMask``.
Ring attention must reuse them. This module only lets the ring be written and tested
before they land on main, with the *same signatures* (causal masks only); delete it and
import from ``attnlab.backends.blockwise`` / ``attnlab.masks`` once they are there.

Shape legend: B batch, H query heads, G key/value heads, R = H/G, T query length,
S key length, D head dim, Dv value head dim.
"""

from __future__ import annotations

import torch


class CausalMask:
    """Causal over the full (T_total, S_total) problem, aligned top-left (T_total == S_total)."""


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _tiles(n: int, block: int | None) -> list[tuple[int, int]]:
    b = block or 512
    return [(i, min(n, i + b)) for i in range(0, n, b)]


def _tile_mask(
    mask: CausalMask | None, q0: int, q1: int, k0: int, k1: int, device: torch.device
) -> tuple[bool, torch.Tensor | None]:
    """(empty, allowed) for absolute rows q0:q1, cols k0:k1; allowed None = all allowed."""
    if mask is None or k1 - 1 <= q0:
        return False, None
    if k0 > q1 - 1:
        return True, None
    qpos = torch.arange(q0, q1, device=device)
    kpos = torch.arange(k0, k1, device=device)
    return False, kpos[None, :] <= qpos[:, None]  # (tq, tk)


def _split(query: torch.Tensor, key: torch.Tensor) -> tuple[int, int, int, int, int]:
    b, h, t, d = query.shape
    g = key.shape[1]
    return b, g, h // g, t, d


def attend_chunk(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: CausalMask | None,
    scale: float,
    *,
    q_offset: int = 0,
    k_offset: int = 0,
    T_total: int | None = None,
    S_total: int | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a query chunk over a key/value chunk: (out, lse) in the compute dtype.

    Shape: query ``(B, H, T, D)``, key ``(B, G, S, D)``, value ``(B, G, S, Dv)`` ->
    out ``(B, H, T, Dv)`` (normalised within the chunk), lse ``(B, H, T)`` (-inf: saw nothing).
    """
    b, g, r, t, d = _split(query, key)
    s, dv = key.shape[2], value.shape[3]
    cd = _compute_dtype(query.dtype)
    q5 = query.to(cd).reshape(b, g, r, t, d)  # (B, G, R, T, D)
    k5 = key.to(cd).unsqueeze(2)  # (B, G, 1, S, D)
    v5 = value.to(cd).unsqueeze(2)  # (B, G, 1, S, Dv)
    out = torch.zeros(b, g, r, t, dv, dtype=cd, device=query.device)
    lse = torch.full((b, g, r, t), float("-inf"), dtype=cd, device=query.device)
    for q0, q1 in _tiles(t, block_q):
        for k0, k1 in _tiles(s, block_k):
            empty, allowed = _tile_mask(
                mask, q_offset + q0, q_offset + q1, k_offset + k0, k_offset + k1, query.device
            )
            if empty:
                continue
            sc = (q5[..., q0:q1, :] @ k5[..., k0:k1, :].transpose(-2, -1)) * scale
            if allowed is not None:
                sc = sc.masked_fill(~allowed, float("-inf"))  # (B, G, R, tq, tk)
            m = sc.amax(dim=-1)
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
            p = torch.exp(sc - m.unsqueeze(-1))
            den = p.sum(dim=-1)
            o = (p @ v5[..., k0:k1, :]) / torch.where(den > 0, den, 1.0).unsqueeze(-1)
            merged = merge_partials(out[..., q0:q1, :], lse[..., q0:q1], o, m + torch.log(den))
            out[..., q0:q1, :], lse[..., q0:q1] = merged
    return out.reshape(b, g * r, t, dv), lse.reshape(b, g * r, t)


def attend_chunk_backward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    grad_out: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    mask: CausalMask | None,
    scale: float,
    *,
    q_offset: int = 0,
    k_offset: int = 0,
    T_total: int | None = None,
    S_total: int | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of a chunk pair given the final row lse and delta = rowsum(dout * out)."""
    b, g, r, t, d = _split(query, key)
    s, dvd = key.shape[2], value.shape[3]
    cd = _compute_dtype(query.dtype)
    q5 = query.to(cd).reshape(b, g, r, t, d)  # (B, G, R, T, D)
    do5 = grad_out.to(cd).reshape(b, g, r, t, dvd)  # (B, G, R, T, Dv)
    k5 = key.to(cd).unsqueeze(2)  # (B, G, 1, S, D)
    v5 = value.to(cd).unsqueeze(2)  # (B, G, 1, S, Dv)
    lse5 = lse.to(cd).reshape(b, g, r, t)
    lse5 = torch.where(torch.isfinite(lse5), lse5, torch.zeros_like(lse5))
    delta5 = delta.to(cd).reshape(b, g, r, t)
    dq = torch.zeros_like(q5)
    dk = torch.zeros(b, g, s, d, dtype=cd, device=query.device)
    dv = torch.zeros(b, g, s, dvd, dtype=cd, device=query.device)
    for q0, q1 in _tiles(t, block_q):
        for k0, k1 in _tiles(s, block_k):
            empty, allowed = _tile_mask(
                mask, q_offset + q0, q_offset + q1, k_offset + k0, k_offset + k1, query.device
            )
            if empty:
                continue
            qt, kt, vt = q5[..., q0:q1, :], k5[..., k0:k1, :], v5[..., k0:k1, :]
            sc = (qt @ kt.transpose(-2, -1)) * scale  # (B, G, R, tq, tk)
            if allowed is not None:
                sc = sc.masked_fill(~allowed, float("-inf"))
            p = torch.exp(sc - lse5[..., q0:q1].unsqueeze(-1))
            dot = do5[..., q0:q1, :]
            dv[:, :, k0:k1] += (p.transpose(-2, -1) @ dot).sum(dim=2)
            ds = p * (dot @ vt.transpose(-2, -1) - delta5[..., q0:q1].unsqueeze(-1))
            dq[..., q0:q1, :] += (ds @ kt) * scale
            dk[:, :, k0:k1] += (ds.transpose(-2, -1) @ qt).sum(dim=2) * scale
    return dq.reshape(b, g * r, t, d), dk, dv


def merge_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two normalised partial outputs over disjoint key sets by log-sum-exp."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = lse.masked_fill(lse == float("-inf"), 0.0)
    wa = torch.exp(lse_a - safe).unsqueeze(-1)
    wb = torch.exp(lse_b - safe).unsqueeze(-1)
    return out_a * wa + out_b * wb, lse
