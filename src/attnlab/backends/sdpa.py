"""The ``sdpa`` backend: PyTorch's ``torch.nn.functional.scaled_dot_product_attention``.

Shape legend: B batch, H query heads, G key/value heads, T query length, S key length,
D head dim, Dv value head dim.

Translation of attnlab masks to PyTorch's conventions:

* no mask -> no mask;
* a pure causal mask whose query 0 sits at key 0 (``T == S``, or ``alignment="top_left"``)
  -> ``is_causal=True``, PyTorch's fast path, nothing materialised;
* anything else -> one dense mask: bool (True = may attend, same as PyTorch) or, when the
  mask carries an additive bias, a float mask with ``-inf`` where attending is forbidden.

A query row that may attend to nothing gets zeros: such rows are opened up (so no kernel
sees an all ``-inf`` row) and their output is multiplied by 0, which also zeros their
gradients.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attnlab.backends.base import AttentionRequest, Backend, BackendResult
from attnlab.masks import AttentionMask, CausalMask, SlidingWindowMask, describe

__all__ = ["BACKEND", "sdpa_attention", "torch_mask"]

# Above this many mask elements, `auto` prefers a backend that applies the mask blockwise.
DENSE_MASK_LIMIT = 1 << 24
# From this many scores (T * S), `auto` sends a sliding window narrower than the keys to
# the blockwise backend, which skips the tiles outside the band: PyTorch's kernel computes
# every score and masks most of them. fp32, 2 threads, the EPYC: T = S = 1,024 with a
# window of 512, 1.1-1.5x faster; 4,096 with 512, 5x (Gemma 3's local layers: 4 heads of
# 256, one key head; and 12 heads of 64); at 512 with 128, 0.8-1.3x, so shorter calls stay.
BAND_SCORES_FROM = 1 << 20


def torch_mask(
    mask: AttentionMask | None, T: int, S: int, *, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor | None, bool, torch.Tensor | None]:
    """Translate an attnlab mask into ``(attn_mask, is_causal, row_ok)`` for PyTorch.

    ``row_ok`` (bool, broadcastable to ``(B, H, T, 1)``) is returned when some query rows
    may attend to nothing; the caller multiplies the output by it.
    """
    if mask is None:
        return None, False, None
    if isinstance(mask, CausalMask) and mask.offset(T, S) == 0:
        return None, True, None
    dense = mask.dense(T, S, device=device, dtype=dtype)  # (B|1, H|1, T, S)
    row_ok = None
    if mask.may_empty_rows(T, S):
        ok = (
            dense.any(dim=-1, keepdim=True)
            if dense.dtype == torch.bool
            else ((dense > float("-inf")).any(dim=-1, keepdim=True))
        )  # (B|1, H|1, T, 1)
        if not bool(ok.all()):
            row_ok = ok
            # Open the empty rows up (no kernel sees an all -inf row); zeroed afterwards.
            dense = dense | ~ok if dense.dtype == torch.bool else dense.masked_fill(~ok, 0.0)
    return dense, False, row_ok


def sdpa_attention(
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
    """Attention through PyTorch's fused kernels.

    Shape:
        - query ``(B, H, T, D)``, key ``(B, G, S, D)``, value ``(B, G, S, Dv)``
        - output ``(B, H, T, Dv)``
    """
    if softcap is not None or sinks is not None:
        raise ValueError(_why_not_scores(softcap, sinks is not None))
    T, S = query.shape[2], key.shape[2]
    if mask is None or (isinstance(mask, CausalMask) and mask.offset(T, S) == 0):
        # the common calls, without torch_mask's call: this path's cost is per call
        attn_mask, is_causal, row_ok = None, mask is not None, None
    else:
        attn_mask, is_causal, row_ok = torch_mask(
            mask, T, S, device=query.device, dtype=query.dtype
        )
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=query.shape[1] != key.shape[1],
    )  # (B, H, T, Dv)
    if row_ok is not None:
        out = out * row_ok
    return BackendResult(output=out)


def _why_not_scores(softcap: float | None, sinks: bool) -> str | None:
    if softcap is not None:
        return (
            f"PyTorch's kernel has no logit soft-capping (softcap={softcap}); "
            "use 'blockwise' or 'math'"
        )
    if sinks:
        return (
            "PyTorch's kernel does not return the row log-sum-exp that attention sinks "
            "join; use 'blockwise' or 'math'"
        )
    return None


def _why_not(request: AttentionRequest) -> str | None:
    return _why_not_scores(request.softcap, request.sinks)


def _why_not_auto(request: AttentionRequest) -> str | None:
    m = request.mask
    if m is None or (isinstance(m, CausalMask) and m.offset(request.T, request.S) == 0):
        return None
    if (
        isinstance(m, SlidingWindowMask)
        and m.window < request.S
        and request.T * request.S >= BAND_SCORES_FROM
    ):
        return (
            f"the mask ({describe(m)}) lets each query see {m.window} of {request.S} keys: "
            "PyTorch's kernel would compute every score and mask most of them; blockwise "
            "skips the tiles outside the band"
        )
    n = request.T * request.S * request.B
    if n > DENSE_MASK_LIMIT:
        return (
            f"the mask ({describe(m)}) has no PyTorch fast path and would be materialised "
            f"as a dense (B, ., T, S) tensor of {n:,} elements; blockwise applies it "
            "tile by tile"
        )
    return None


BACKEND = Backend(
    name="sdpa",
    run=sdpa_attention,
    why_not=_why_not,
    why_not_auto=_why_not_auto,
    summary="torch.nn.functional.scaled_dot_product_attention (fused kernels, is_causal fast path)",
)
