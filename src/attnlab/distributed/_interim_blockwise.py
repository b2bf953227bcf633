"""INTERIM block kernel for ring attention, until ``attnlab.backends.blockwise`` lands.

Issue 3 owns the one shared copy of the online-softmax block kernel and the
log-sum-exp merge; ring attention must reuse it. This module exists only so the
ring can be written and tested before that lands, behind the two names the ring
imports (:func:`attend_block`, :func:`merge_partials`). Delete it and point
``attnlab.distributed.ring`` at the shared functions once they are on main.

Shape legend: ``...`` leading batch dims, T query length, S key length,
D head dim, Dv value head dim.
"""

from __future__ import annotations

import torch


def attend_block(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    scale: float,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a query block over one key/value block, with its log-sum-exp.

    Shape:
        query ``(..., T, D)``, key ``(..., S, D)``, value ``(..., S, Dv)``,
        mask bool broadcastable to ``(..., T, S)`` (True = may attend).
        Returns output ``(..., T, Dv)`` and lse ``(..., T)`` in the compute dtype
        (fp32 for half inputs). A row with nothing to attend to gets output 0, lse -inf.
    """
    compute = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    q, k, v = query.to(compute), key.to(compute), value.to(compute)
    scores = (q @ k.transpose(-2, -1)) * scale  # (..., T, S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    row_max = scores.amax(dim=-1)  # (..., T)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = torch.exp(scores - row_max.unsqueeze(-1))  # (..., T, S)
    denom = p.sum(dim=-1)  # (..., T)
    out = (p @ v) / torch.where(denom > 0, denom, torch.ones_like(denom)).unsqueeze(-1)
    return out, row_max + torch.log(denom)


def merge_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two normalised partial outputs over disjoint key sets by log-sum-exp.

    Shape:
        out ``(..., T, Dv)``, lse ``(..., T)``; returns the same shapes. Rows with
        lse -inf on both sides stay (0, -inf), never NaN.
    """
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)  # (..., T)
    total = w_a + w_b
    safe = torch.where(total > 0, total, torch.ones_like(total))
    out = (out_a * w_a.unsqueeze(-1) + out_b * w_b.unsqueeze(-1)) / safe.unsqueeze(-1)
    return out, m + torch.log(total)
