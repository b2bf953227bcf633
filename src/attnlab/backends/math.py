"""The ``math`` backend: the readable reference. Materialises scores and weights.

Shape legend: B batch, H query heads, G key/value heads, T query length, S key length,
D head dim, Dv value head dim.

    scores  = (Q @ K^T) * scale            (B, H, T, S)
    scores  = c * tanh(scores / c)         with softcap=c
    scores += bias; scores[~allowed] = -inf
    weights = softmax([scores, sink_h])    the sink column joins each row's softmax
              [..., :S]                    and is dropped: it takes mass, gives no value
    output  = dropout(weights) @ V         (B, H, T, Dv); rows with nothing allowed -> 0

Softmax runs in fp32 for fp16/bf16 inputs. Memory is O(B*H*T*S): use it to read, to
check, and to get weights; use ``blockwise`` or ``sdpa`` for long sequences.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attnlab.backends.base import AttentionRequest, Backend, BackendResult, softcap_scores
from attnlab.masks import AttentionMask

__all__ = ["BACKEND", "compute_dtype", "math_attention", "safe_softmax"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype softmax and its sums run in: fp32 for fp16/bf16, else the input's."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def safe_softmax(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim where a row of only ``-inf`` gives zeros, not NaN.

    Gradients stay finite: the empty rows are replaced by zeros before the softmax and
    multiplied by 0 after it.
    """
    row_ok = scores.amax(dim=-1, keepdim=True) > float("-inf")  # (..., T, 1)
    if bool(row_ok.all()):
        return torch.softmax(scores, dim=-1)
    scores = torch.where(row_ok, scores, torch.zeros_like(scores))
    return torch.softmax(scores, dim=-1) * row_ok


def math_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: AttentionMask | None,
    *,
    dropout_p: float,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> BackendResult:
    """Materialised attention; returns the output and the (pre-dropout) weights.

    Shape:
        - query ``(B, H, T, D)``, key ``(B, G, S, D)``, value ``(B, G, S, Dv)``,
          sinks ``(H,)``
        - output ``(B, H, T, Dv)``, weights ``(B, H, T, S)``
    """
    H, T = query.shape[1], query.shape[2]
    G, S = key.shape[1], key.shape[2]
    cd = compute_dtype(query.dtype)
    q, k, v = query.to(cd), key.to(cd), value.to(cd)
    if G != H:  # grouped-query attention: each K/V head serves H // G query heads
        k = k.repeat_interleave(H // G, dim=1)  # (B, H, S, D)
        v = v.repeat_interleave(H // G, dim=1)  # (B, H, S, Dv)
    scores = softcap_scores((q @ k.transpose(-2, -1)) * scale, softcap)  # (B, H, T, S)
    if mask is not None:
        blk = mask.block(T, S, device=query.device)
        if blk.status == "empty":
            scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool), float("-inf"))
        else:
            if blk.bias is not None:
                scores = scores + blk.bias.to(cd)
            if blk.allowed is not None:
                scores = scores.masked_fill(~blk.allowed, float("-inf"))
    if sinks is None:
        weights = safe_softmax(scores)  # (B, H, T, S)
    else:  # the sink is one more column of each row's softmax, finite, with no value
        sink = sinks.to(cd)[None, :, None, None].expand(*scores.shape[:3], 1)  # (B, H, T, 1)
        weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :S]
    dropped = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights
    output = dropped @ v  # (B, H, T, Dv)
    return BackendResult(output=output.to(query.dtype), weights=weights.to(query.dtype))


def _why_not(request: AttentionRequest) -> str | None:
    return None


BACKEND = Backend(
    name="math",
    run=math_attention,
    why_not=_why_not,
    summary="readable reference; materialises scores and weights (O(T*S) memory)",
    last_resort=True,
)
