"""The blockwise autograd function: tiled forward, backward recomputed from the lse.

Shape legend: B batch, H query heads, T query length, Dv value head dim.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from attnlab.backends.base import add_sinks
from attnlab.backends.blockwise.chunk import backward, forward
from attnlab.backends.blockwise.paths import TILE_PATHS, pure_because
from attnlab.backends.blockwise.plan import ChunkOptions
from attnlab.backends.math import compute_dtype
from attnlab.masks import AttentionMask


@dataclass(frozen=True, eq=False)
class BlockwiseCall:
    """What a blockwise call computes besides its tensors: one argument of the autograd
    function, so that its backward answers it with one gradient (None).

    Attributes:
        mask: attnlab mask, or None.
        scale: score scale.
        opts: block sizes, tile path and soft-cap (the chunk is the whole problem).
    """

    mask: AttentionMask | None
    scale: float
    opts: ChunkOptions


class BlockwiseAttention(torch.autograd.Function):
    """Blockwise forward; backward recomputes tiles from the saved log-sum-exp.

    Attention sinks join at the end, in log-sum-exp form: ``lse' = logaddexp(lse, sink)``
    and ``out' = out * exp(lse - lse')``. The tile backward with ``out'`` and ``lse'`` is
    then exactly the gradient of the softmax with the sink column (whose value is 0), and
    ``d sink = -sum over rows of exp(sink - lse') * rowsum(dout * out')``.

    Inputs: ``query``, ``key``, ``value``, ``sinks`` (or None), the :class:`BlockwiseCall`
    and the mask's bias tensors that need gradients.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        sinks: torch.Tensor | None,
        call: BlockwiseCall,
        *bias_params: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Decide the path now: the backward runs outside any force_tile_path block. (Bias
        # gradients take pure tiles in the backward where they need dS: see chunk.backward.)
        opts = call.opts
        path = TILE_PATHS.choose(query, key, value, opts.tile_path, pure_because(opts.softcap))
        call = dataclasses.replace(call, opts=dataclasses.replace(opts, tile_path=path))
        out, lse = forward(query, key, value, call.mask, call.scale, call.opts)
        if sinks is not None:
            cd = compute_dtype(query.dtype)
            lse = lse.to(cd)
            with_sinks = add_sinks(lse, sinks.to(cd))  # (B, H, T)
            out = out.to(cd) * torch.exp(lse - with_sinks).unsqueeze(-1)  # 0 where lse = -inf
            lse = with_sinks
        out = out.to(query.dtype)
        ctx.save_for_backward(query, key, value, out, lse, sinks, *bias_params)
        ctx.call = call
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor, grad_lse: torch.Tensor | None):  # type: ignore[override]
        query, key, value, out, lse, sinks, *bias_params = ctx.saved_tensors
        call: BlockwiseCall = ctx.call
        cd = compute_dtype(query.dtype)
        share = None  # the sink's weight in each row's softmax, (B, H, T)
        if sinks is not None:
            share = torch.exp(sinks.to(cd)[None, :, None] - lse.to(cd))
        dq, dk, dv, dparams = backward(
            query,
            key,
            value,
            grad_out,
            out,
            lse,
            call.mask,
            call.scale,
            call.opts,
            bias_params=tuple(bias_params),
            sink_share=share,
        )
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            assert share is not None
            delta = (grad_out.to(cd) * out.to(cd)).sum(dim=-1)  # (B, H, T)
            dsinks = -(share * delta).sum(dim=(0, 2)).to(sinks.dtype)  # (H,)
        dcall = None  # the call's settings have no gradient
        dbias = (g.to(p.dtype) for g, p in zip(dparams, bias_params, strict=True))
        return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), dsinks, dcall, *dbias
