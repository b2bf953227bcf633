"""The ``blockwise`` backend: attention tile by tile in linear memory (the FlashAttention
algorithm), each tile computed by PyTorch's fused CPU kernel or by plain PyTorch.

Shape legend: B batch, H query heads, G key/value heads, R = H // G query heads per
key/value head, T query length, S key length, D head dim, Dv value head dim;
tq/tk the rows/keys of one tile.

The score matrix is cut into row blocks, and each row block into key tiles. A tile is
``"full"`` (nothing masked), ``"causal"`` (a square on the diagonal of a causal mask,
top-left aligned within the tile), ``"partial"`` (the mask's :class:`MaskBlock` for
the tile: a small dense ``allowed`` and/or ``bias``) or ``"shifted"`` (unmasked, with a
bias that is one number per head over the tile, e.g. T5's beyond ``max_distance``: run as a
full tile whose log-sum-exp moves by that number); tiles the mask removes entirely
(``status == "empty"``) are never computed. ALiBi (& causal) forward on fused fp32/fp64
tiles needs no dense bias at all: it is one more head dimension (``linear_bias.LinearBias``).
**One tile step, two implementations:**

* ``"fused"``: PyTorch's CPU flash-attention kernel as an op that returns the row
  log-sum-exp beside the output
  (``aten._scaled_dot_product_flash_attention_for_cpu`` and its ``_backward``), with
  ``is_causal`` for diagonal tiles and a dense additive mask of the tile only for partial
  ones. It handles grouped-query heads itself and keeps fp32 softmax statistics for
  bf16/fp16. Its tiles are big: an unmasked or causal call is one or two op calls for the
  whole problem (the op blocks and parallelises internally); other masks use 256 x 256
  tiles whose runs of full tiles coalesce into one call.
* ``"pure"``: the same tile in plain PyTorch (``bmm``, ``exp``; fp32 statistics), the
  fallback for what the op cannot express (value head dim != query head dim, non-CPU
  tensors, a missing op) and the tested reference of the fused one.

Per tile, both return the output normalised within the tile and the row log-sum-exp
``lse``; the tiles of a row block merge by log-sum-exp, in place (:func:`merge_partials`)::

    s     = (q * scale) @ k_tile^T  (+ bias, -inf where not allowed)   one (tq, tk) tile
    out_t = softmax(s) @ v_tile,    lse_t = logsumexp(s)
    out   = (exp(lse_a) out_a + exp(lse_t) out_t) / (exp(lse_a) + exp(lse_t))

The backward pass (a custom autograd function) recomputes each tile's probabilities from
the final per-row log-sum-exp instead of storing them, so training memory stays linear::

    p  = exp(s - lse);  dv += p^T @ dout;  dp = dout @ v_tile^T
    ds = p * (dp - rowsum(dout * out));    dq += ds @ k_tile * scale;  dk += ds^T @ (q * scale)

:func:`attend_chunk`, :func:`attend_chunk_backward` and :func:`merge_partials` are the
reusable pieces: ring attention runs them on the key/value chunk each process holds and
the exact-weights path reads the log-sum-exp (one copy of this logic).

A query row that may attend to nothing has output 0 and log-sum-exp ``-inf`` (its
probabilities in the backward are 0); never NaN.

Choosing the path: ``tile_path=`` on :func:`blockwise_attention` / :func:`attend_chunk`,
else :func:`force_tile_path` (a context manager, for tests and benchmarks), else
``"fused"`` whenever the op can serve the call.

Modules: ``paths`` (the fused ops and the path choice), ``plan`` (row blocks and tiles,
:class:`ChunkOptions`), ``tiles`` (one tile, forward and backward, both paths), ``pool``
(the worker threads), ``linear_bias`` (ALiBi as a head dimension), ``chunk`` (a chunk
tile by tile: :func:`attend_chunk` and its backward) and ``function`` (the autograd
function).
"""

from __future__ import annotations

import torch

from attnlab.backends.base import AttentionRequest, Backend, BackendResult
from attnlab.backends.blockwise.chunk import attend_chunk, attend_chunk_backward, merge_partials
from attnlab.backends.blockwise.function import BlockwiseAttention, BlockwiseCall
from attnlab.backends.blockwise.paths import (
    TilePath,
    force_tile_path,
    fused_tiles_available,
    why_not_fused,
)
from attnlab.backends.blockwise.plan import ChunkOptions, default_blocks
from attnlab.masks import AttentionMask, CausalMask, ChunkedMask

__all__ = [
    "BACKEND",
    "ChunkOptions",
    "TilePath",
    "attend_chunk",
    "attend_chunk_backward",
    "blockwise_attention",
    "default_blocks",
    "force_tile_path",
    "fused_tiles_available",
    "merge_partials",
    "why_not_fused",
]


def blockwise_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: AttentionMask | None,
    *,
    dropout_p: float,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    tile_path: TilePath | None = None,
) -> BackendResult:
    """Tiled attention with linear memory; returns the output and the row LSE.

    Args:
        query, key, value, mask, dropout_p, scale: as every backend.
        softcap: logit soft-cap (computed on the pure tiles), or None.
        sinks: per-head sink logits ``(H,)`` joining every row's softmax, or None.
        block_q, block_k: tile size (default: per path).
        tile_path: ``"fused"`` (PyTorch's flash op per tile), ``"pure"`` (plain PyTorch)
            or None (fused whenever the op can serve the call; see
            :func:`force_tile_path`). Soft-capping takes the pure tiles (the op has
            none); with gradients of a bias (a learned relative-position table, an
            additive mask that requires grad) the backward runs pure the tiles whose dS
            the gradient needs (the op returns no dS).

    Raises:
        ValueError: ``dropout_p > 0``, or ``tile_path="fused"`` for a call the op cannot
            serve.

    Shape:
        - query ``(B, H, T, D)``, key ``(B, G, S, D)``, value ``(B, G, S, Dv)``
        - output ``(B, H, T, Dv)``, lse ``(B, H, T)`` (with sinks: including them)
    """
    if dropout_p > 0:
        raise ValueError(_why_not_dropout(dropout_p))
    T, S = query.shape[2], key.shape[2]
    if isinstance(mask, ChunkedMask) and T == S and T % mask.chunk == 0 and mask.chunk < T:
        # Whole chunks of a square call: each chunk is causal attention on its own, so the
        # chunks become batch rows and the call one causal call (on the fused path one
        # kernel call for every chunk, instead of a row block per chunk).
        n, c = T // mask.chunk, mask.chunk

        def fold(t: torch.Tensor) -> torch.Tensor:  # (B, H, n c, D) -> (B n, H, c, D)
            B, H, _, D = t.shape
            return t.view(B, H, n, c, D).transpose(1, 2).reshape(B * n, H, c, D)

        res = blockwise_attention(
            fold(query),
            fold(key),
            fold(value),
            CausalMask(),
            dropout_p=dropout_p,
            scale=scale,
            softcap=softcap,
            sinks=sinks,
            block_q=block_q,
            block_k=block_k,
            tile_path=tile_path,
        )
        B, H = query.shape[:2]
        assert res.lse is not None  # blockwise always returns it
        out = res.output.view(B, n, H, c, -1).transpose(1, 2).reshape(B, H, T, -1)
        lse = res.lse.view(B, n, H, c).transpose(1, 2).reshape(B, H, T)
        return BackendResult(output=out, lse=lse)
    grad_on = torch.is_grad_enabled()
    bias_params = mask.grad_tensors() if (mask is not None and grad_on) else ()
    opts = ChunkOptions(block_q=block_q, block_k=block_k, tile_path=tile_path, softcap=softcap)
    call = BlockwiseCall(mask, scale, opts)
    out, lse = BlockwiseAttention.apply(query, key, value, sinks, call, *bias_params)
    return BackendResult(output=out, lse=lse)


def _why_not_dropout(p: float) -> str:
    return (
        f"blockwise does not implement attention dropout (dropout_p={p}); use 'sdpa' or "
        "'math', or dropout_p=0 (evaluation)"
    )


def _why_not(request: AttentionRequest) -> str | None:
    if request.dropout_p > 0:
        return _why_not_dropout(request.dropout_p)
    return None


BACKEND = Backend(
    name="blockwise",
    run=blockwise_attention,
    why_not=_why_not,
    summary=(
        "attention tile by tile, each tile by PyTorch's fused flash op (or plain PyTorch); "
        "O(T) memory, skips masked tiles, returns log-sum-exp, recomputing backward"
    ),
)
