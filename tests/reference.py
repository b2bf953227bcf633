"""The one fp64 reference every numeric test compares against.

Written as plainly as possible, independent of attnlab's backends: materialise
the scores in float64, mask, softmax, weighted sum. Masks here are dense boolean
tensors with True = may attend; a row with nothing to attend to yields zeros.
"""

from __future__ import annotations

import math

import torch

# One tolerance table per dtype, used by every numeric test.
TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float64: {"atol": 1e-10, "rtol": 1e-8},
    torch.float32: {"atol": 2e-5, "rtol": 2e-4},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


def tol(dtype: torch.dtype) -> dict[str, float]:
    """Keyword arguments for ``torch.testing.assert_close`` for this dtype."""
    return TOLERANCES[dtype]


def reference_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 attention. query (B, H, T, D), key/value (B, G, S, D), H % G == 0.

    ``mask`` is boolean, True = may attend, broadcastable to (B, H, T, S);
    ``bias`` is an additive float tensor broadcastable to (B, H, T, S);
    ``softcap`` c replaces the scaled scores s by c * tanh(s / c) before bias and mask;
    ``sinks`` (H,) is one more logit per head in every row's softmax, with no value.
    Returns (output (B, H, T, Dv), weights (B, H, T, S)) in float64; with sinks the
    weights of a row sum to less than 1.
    """
    q, k, v = query.double(), key.double(), value.double()
    h, g = q.shape[1], k.shape[1]
    if h != g:
        k = k.repeat_interleave(h // g, dim=1)  # (B, H, S, D)
        v = v.repeat_interleave(h // g, dim=1)  # (B, H, S, Dv)
    s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * s  # (B, H, T, S)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if bias is not None:
        scores = scores + bias.double()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    if sinks is not None:
        sink = sinks.double()[None, :, None, None]  # (1, H, 1, 1)
        row_max = torch.maximum(row_max, sink)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    e = torch.exp(scores - row_max)
    denom = e.sum(dim=-1, keepdim=True)
    if sinks is not None:
        denom = denom + torch.exp(sink - row_max)
    weights = torch.where(denom > 0, e / denom.clamp_min(1e-300), torch.zeros_like(e))
    return weights @ v, weights


def t5_relative_bucket(
    relative_position: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """T5's bucket of each ``key - query`` distance, written from the T5 paper's rule.

    Half the buckets per direction when bidirectional; below ``max_exact = n // 2`` each
    distance has its own bucket, then log-spaced buckets up to ``max_distance`` (the
    logarithm in float32, as the original code), beyond it the last bucket. Independent
    of attnlab; ``tests/attention/test_score_kinds.py`` also checks attnlab against transformers.
    """
    n = -relative_position.long()
    ret = torch.zeros_like(n)
    if bidirectional:
        num_buckets //= 2
        ret += (n < 0).long() * num_buckets
        n = n.abs()
    else:
        n = n.clamp_min(0)
    max_exact = num_buckets // 2
    far = (
        max_exact
        + (
            torch.log(n.float().clamp_min(1) / max_exact)
            / math.log(max_distance / max_exact)
            * (num_buckets - max_exact)
        ).long()
    )
    far = far.clamp_max(num_buckets - 1)
    return ret + torch.where(n < max_exact, n, far)
