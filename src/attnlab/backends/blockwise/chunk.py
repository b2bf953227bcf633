"""Attention of a chunk of queries to a chunk of keys/values, tile by tile, and its gradient.

Shape legend: B batch, H query heads, G key/value heads, R = H // G, T query length, S key
length, D head dim, Dv value head dim; Hs the query heads of one worker's group.

The tiles of a row block merge by log-sum-exp, in place (:func:`merge_partials`). The
backward recomputes each tile's probabilities from the final per-row log-sum-exp instead
of storing them, so training memory stays linear. Ring attention runs
:func:`attend_chunk`, :func:`attend_chunk_backward` and :func:`merge_partials` on the
key/value chunk each process holds.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import NamedTuple

import torch

from attnlab import native
from attnlab.backends.blockwise import tiles
from attnlab.backends.blockwise.band import BandRun, band_forward
from attnlab.backends.blockwise.linear_bias import LINEAR_BLOCK_Q, LinearBias
from attnlab.backends.blockwise.paths import TILE_PATHS, TilePath, pure_because
from attnlab.backends.blockwise.plan import (
    ChunkOptions,
    Geometry,
    RowBlock,
    Tile,
    block_sizes,
    diagonal_offset,
    plan_tiles,
    resolve,
)
from attnlab.backends.blockwise.pool import POOL
from attnlab.backends.blockwise.tiles import NEG_INF, Scratch, heads
from attnlab.backends.math import compute_dtype
from attnlab.masks import AttentionMask, CausalMask


class Prepared(NamedTuple):
    """A chunk's tile path and plan.

    Attributes:
        path: the tile path.
        plan: row blocks and their tiles.
        whole: the plan's one tile when a single fused tile covers the whole chunk (the
            op's results are then used as they are), else None.
        geo: where the chunk sits in the mask's problem.
        linear_bias: the ALiBi helper when ALiBi runs as one more head dim (the plan is
            then the rest of the mask's), else None.
    """

    path: TilePath
    plan: list[RowBlock]
    whole: Tile | None
    geo: Geometry
    linear_bias: LinearBias | None


def prepare(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: AttentionMask | None,
    opts: ChunkOptions,
    *,
    linear_bias: bool = False,
) -> Prepared:
    """Plan a chunk. ALiBi runs as one more head dim only where ``linear_bias`` (the
    forward): the op's backward is slower at D + 1 than 256 x 256 tiles with a dense bias
    (benchmarks/bench_attention.py --variants)."""
    B, H, T, _ = query.shape
    S = key.shape[2]
    path = TILE_PATHS.choose(query, key, value, opts.tile_path, pure_because(opts.softcap))
    lin = LinearBias.of(mask, path, query) if linear_bias else None
    if lin is not None:
        mask, opts = lin.rest, dataclasses.replace(opts, block_q=opts.block_q or LINEAR_BLOCK_Q)
    T_total = T if opts.T_total is None else opts.T_total
    S_total = S if opts.S_total is None else opts.S_total
    bq, bk, coalesce = block_sizes(path, mask, B * H, T, S, opts)
    causal_tiles = path == "fused" or bq <= bk
    diagonal = None
    if causal_tiles and mask is not None:
        diagonal = diagonal_offset(mask, T_total, S_total)
    geo = Geometry(mask, opts.q_offset, opts.k_offset, T_total, S_total, query.device, diagonal)
    plan = plan_tiles(geo, T, S, bq=bq, bk=bk, coalesce=coalesce, causal_tiles=causal_tiles)
    if path == "fused" and lin is None and len(plan) == 1 and len(plan[0].tiles) == 1:
        rb, tile = plan[0], plan[0].tiles[0]
        if (rb.r0, rb.r1, tile.c0, tile.c1) == (0, T, 0, S):
            return Prepared(path, plan, resolve(tile, rb, geo), geo, None)
    return Prepared(path, plan, None, geo, lin)


def forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: AttentionMask | None,
    scale: float,
    opts: ChunkOptions,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attend_chunk`, except that ``out`` is in the input dtype when one fused
    tile covers the whole chunk (no conversion round trip)."""
    if TILE_PATHS.choose(query, key, value, opts.tile_path, pure_because(opts.softcap)) == "fused":
        run = BandRun.of(mask, opts, query.shape[2], key.shape[2])
        if run is not None:
            return _banded(query, key, value, mask, scale, opts, run)
    path, plan, whole, geo, lin = prepare(query, key, value, mask, opts, linear_bias=True)
    softcap = opts.softcap
    if whole is not None:  # one tile: the op's own result (PyTorch's kernel, nothing more)
        return tiles.tile_forward(path, query, key, value, whole, scale, 0, softcap)
    key_norms: list[float] = []
    if lin is not None:
        key_norms = torch.linalg.vector_norm(key.double(), dim=-1).amax(dim=(0, 2)).tolist()
        query, key, value = lin.widen_query(query), lin.widen(key), lin.widen(value)
    B, H, T, _ = query.shape
    G, S, Dv = key.shape[1], key.shape[2], value.shape[3]
    R = H // G
    cd = compute_dtype(query.dtype)
    out = torch.zeros(B, H, T, Dv, dtype=cd, device=query.device)
    lse = torch.full((B, H, T), NEG_INF, dtype=cd, device=query.device)
    # Soft-capped scores are bounded: pure tiles then need no running maximum.
    bounded = path == "pure" and (geo.mask is None or not geo.mask.has_bias)
    cap = softcap if bounded else None
    if cap is not None and cd == torch.float32:
        native.load_built()  # its one-pass capped probabilities (tiles.py), if built

    def row_block(rb: RowBlock, ga: int, gb: int, first_key: int, ws: Scratch) -> None:
        """Rows of ``rb``, key heads ``ga:gb``, their full tiles from key ``first_key``."""
        ha, hb = ga * R, gb * R
        k, v = key[:, ga:gb], value[:, ga:gb]
        q = query[:, ha:hb, rb.r0 : rb.r1]  # (B, Hs, tq, D)
        acc, acc_lse = out[:, ha:hb, rb.r0 : rb.r1], lse[:, ha:hb, rb.r0 : rb.r1]
        if cap is not None and tiles.capped_row_block(
            q, k, v, rb, geo, scale, cap, ha, acc, acc_lse, ws
        ):
            return
        merged = False
        for lazy in rb.tiles:
            tile = resolve(lazy, rb, geo)
            c0 = max(tile.c0, first_key) if tile.kind == "full" else tile.c0
            if c0 >= tile.c1:
                continue
            cols = slice(c0, tile.c1)
            o, l = tiles.tile_forward(
                path, q, k[:, :, cols], v[:, :, cols], tile, scale, ha, softcap, ws
            )
            if not merged:
                acc.copy_(o)
                acc_lse.copy_(l)
                merged = True
            else:
                merge_partials(acc, acc_lse, o.to(cd), l, inplace=True)

    def work(g0: int, g1: int) -> None:
        ws = Scratch()  # this worker's
        for rb in plan:
            runs = [(g0, g1, 0)]
            if lin is not None:
                lin.enter(key, g0, g1, rb, geo, scale)
                runs = lin.first_keys(query, key_norms, rb, geo, S, g0, g1, scale)
            for ga, gb, first_key in runs:
                row_block(rb, ga, gb, first_key, ws)
            if lin is not None:
                rows = slice(rb.r0, rb.r1)
                lse[:, g0 * R : g1 * R, rows].sub_(lin.row_shift(rb, geo, g0 * R, g1 * R))

    POOL.run_groups(G, work)
    if lin is not None:
        out = out[..., :-1].contiguous()  # (B, H, T, Dv)
    return out, lse


def _banded(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: AttentionMask | None,
    scale: float,
    opts: ChunkOptions,
    run: BandRun,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`forward` with the band's interior rows in one op call
    (:func:`~attnlab.backends.blockwise.band.band_forward`) and the rows above and below
    them as chunks of their own."""
    B, H, T, _ = query.shape
    cd = compute_dtype(query.dtype)
    out = torch.empty(B, H, T, value.shape[3], dtype=cd, device=query.device)
    lse = torch.empty(B, H, T, dtype=cd, device=query.device)
    band_forward(query, key, value, run, scale, out, lse)
    S = key.shape[2]
    T_total = T if opts.T_total is None else opts.T_total
    S_total = S if opts.S_total is None else opts.S_total
    # The rows above the band see the keys from 0 to their band's end, i + b: causal on
    # their own (for a square call one op call), when those keys exist.
    b = run.c0 - run.r0 + run.width - 1
    head = run.r0 if 0 < run.r0 + b <= S else 0
    if head:
        whole = ChunkOptions(tile_path=opts.tile_path)
        k, v = key[:, :, : head + b], value[:, :, : head + b]
        o, l = forward(query[:, :, :head], k, v, CausalMask(), scale, whole)
        out[:, :, :head].copy_(o)
        lse[:, :, :head].copy_(l)
    for e0, e1 in ((head, run.r0), (run.r1, T)):
        if e1 > e0:
            edge = dataclasses.replace(
                opts, q_offset=opts.q_offset + e0, T_total=T_total, S_total=S_total
            )
            o, l = forward(query[:, :, e0:e1], key, value, mask, scale, edge)
            out[:, :, e0:e1].copy_(o)
            lse[:, :, e0:e1].copy_(l)
    return out, lse


def attend_chunk(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: AttentionMask | None,
    scale: float,
    *,
    q_offset: int = 0,
    k_offset: int = 0,
    T_total: int | None = None,
    S_total: int | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    tile_path: TilePath | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a chunk of queries to a chunk of keys/values, tile by tile.

    The chunks sit at rows ``q_offset..`` and columns ``k_offset..`` of the full
    ``(T_total, S_total)`` problem the mask is defined on (defaults: the chunks are the
    whole problem).

    Args:
        query: ``(B, H, T, D)``.
        key: ``(B, G, S, D)``.
        value: ``(B, G, S, Dv)``.
        mask: attnlab mask of the full problem, or None.
        scale: score scale.
        q_offset, k_offset: absolute position of the chunks' first row/column.
        T_total, S_total: size of the full problem.
        block_q, block_k: tile size (default: per path, see
            :func:`~attnlab.backends.blockwise.default_blocks`).
        tile_path: ``"fused"``, ``"pure"`` or None (the process's choice).
        softcap: logit soft-cap of the scaled scores (pure tiles), or None.

    Returns:
        ``(out, lse)``: the output normalised within this chunk ``(B, H, T, Dv)`` and the
        per-row log-sum-exp ``(B, H, T)`` (``-inf`` where a row saw nothing), both in the
        compute dtype (fp32 for fp16/bf16). Merge chunks with :func:`merge_partials`.

    Raises:
        ValueError: ``tile_path="fused"`` for inputs the op cannot take.
    """
    opts = ChunkOptions(q_offset, k_offset, T_total, S_total, block_q, block_k, tile_path, softcap)
    out, lse = forward(query, key, value, mask, scale, opts)
    cd = compute_dtype(query.dtype)
    return out.to(cd), lse.to(cd)


def backward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    grad_out: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask: AttentionMask | None,
    scale: float,
    opts: ChunkOptions,
    *,
    bias_params: tuple[torch.Tensor, ...] = (),
    sink_share: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """:func:`attend_chunk_backward`, except that the gradients are in the input dtype
    when one fused tile covers the whole chunk, plus the gradients of ``bias_params``
    (the mask's :meth:`~attnlab.masks.AttentionMask.grad_tensors`).

    With ``bias_params`` on the fused path, a tile whose bias needs its gradient (dS)
    runs pure, except one shifted tile per row block: it runs fused, and the gradient of
    its constant comes from the row sums of dS. Over all of a row's keys dS sums to
    ``delta * sink_share`` (0 without sinks: softmax is shift-invariant), so the shifted
    tile's sum is that minus the pure tiles' sums. This needs the chunk to hold every
    key (the whole problem: ``sink_share`` ``(B, H, T)`` is the sinks' probability, or
    None for none)."""
    path, plan, whole, geo, _ = prepare(query, key, value, mask, opts)
    softcap = opts.softcap
    B, H, T, D = query.shape
    G, S, Dv = key.shape[1], key.shape[2], value.shape[3]
    R = H // G
    cd = compute_dtype(query.dtype)
    # A row that saw nothing has lse = -inf; +inf makes its probabilities exp(s - inf) = 0.
    lse_use = lse.to(cd).masked_fill(lse == NEG_INF, float("inf"))  # (B, H, T)
    # BLAS needs real strides (the gradient of .sum() is an expanded, stride-0 tensor).
    grad_out = grad_out.contiguous()
    delta = None  # fused: the op computes rowsum(dout * out) itself
    if path == "pure" or bias_params:
        delta = (grad_out.to(cd) * out.to(cd)).sum(dim=-1)  # (B, H, T)
    if path == "fused":
        out = out.to(query.dtype)
    if whole is not None and not bias_params:
        grads = tiles.tile_backward(
            path, query, key, value, grad_out, out, lse_use, None, whole, scale, 0
        )
        return (*grads, [])
    dparams = [torch.zeros_like(p) for p in bias_params]
    bias_lock = threading.Lock()

    def bias_grad(ds: torch.Tensor, tile: Tile, h0: int) -> None:
        """Route a tile's dL/d(bias) ``(B, Hs, tq, tk)`` to the tensors it came from."""
        assert tile.blk is not None and tile.blk.bias is not None
        with torch.enable_grad():
            bias = heads(tile.blk.bias, h0, h0 + ds.shape[1])  # (b, h, tq, tk), in the graph
        dims = [d for d in range(4) if bias.shape[d] == 1 and ds.shape[d] != 1]
        g = ds.sum(dim=dims, keepdim=True) if dims else ds
        with bias_lock:
            grads = torch.autograd.grad(
                bias, bias_params, g.to(bias.dtype), retain_graph=True, allow_unused=True
            )
            for acc, gi in zip(dparams, grads, strict=True):
                if gi is not None:
                    acc.add_(gi)

    dq = torch.zeros(B, H, T, D, dtype=cd, device=query.device)
    dk = torch.zeros(B, G, S, D, dtype=cd, device=query.device)
    dv = torch.zeros(B, G, S, Dv, dtype=cd, device=query.device)

    def work(g0: int, g1: int) -> None:
        h0, h1 = g0 * R, g1 * R
        k, v = key[:, g0:g1], value[:, g0:g1]
        ws = Scratch()  # this worker's
        for rb in plan:
            rows = slice(rb.r0, rb.r1)
            q, do, o = query[:, h0:h1, rows], grad_out[:, h0:h1, rows], out[:, h0:h1, rows]
            l_b = lse_use[:, h0:h1, rows]
            d_b = None if delta is None else delta[:, h0:h1, rows]
            dq_b = dq[:, h0:h1, rows]
            fused_shift: Tile | None = None  # the shifted tile run fused (bias gradients)
            rowsum = torch.zeros_like(l_b) if bias_params and path == "fused" else None

            def routed(ds: torch.Tensor, tile: Tile, h0: int, rowsum=rowsum) -> None:
                bias_grad(ds, tile, h0)
                if rowsum is not None:
                    rowsum.add_(ds.sum(dim=-1))

            for lazy in rb.tiles:
                with torch.set_grad_enabled(bool(bias_params)):  # the bias in its graph
                    tile = resolve(lazy, rb, geo)
                t_path = path
                if bias_params and path == "fused" and tile.blk is not None:
                    if tile.kind == "shifted" and fused_shift is None:
                        fused_shift = tile
                    elif tile.blk.bias is not None:
                        t_path = "pure"
                cols = slice(tile.c0, tile.c1)
                dq_t, dk_t, dv_t = tiles.tile_backward(
                    t_path,
                    q,
                    k[:, :, cols],
                    v[:, :, cols],
                    do,
                    o,
                    l_b,
                    d_b,
                    tile,
                    scale,
                    h0,
                    softcap,
                    routed if bias_params and t_path == "pure" else None,
                    ws,
                )
                dq_b.add_(dq_t)
                dk[:, g0:g1, cols].add_(dk_t)
                dv[:, g0:g1, cols].add_(dv_t)
            if fused_shift is not None:
                assert rowsum is not None and d_b is not None
                far = rowsum.neg_()  # (B, Hs, tq): dS summed over the shifted tile
                if sink_share is not None:
                    far.add_(d_b * sink_share[:, h0:h1, rows])
                bias_grad(far.unsqueeze(-1), fused_shift, h0)

    POOL.run_groups(G, work)
    return dq, dk, dv, dparams


def attend_chunk_backward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    grad_out: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask: AttentionMask | None,
    scale: float,
    *,
    q_offset: int = 0,
    k_offset: int = 0,
    T_total: int | None = None,
    S_total: int | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    tile_path: TilePath | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of a chunk pair, recomputing each tile from the row log-sum-exp.

    Args:
        query, key, value: as :func:`attend_chunk`.
        grad_out: gradient of the (final, merged) output ``(B, H, T, Dv)``.
        out: the final, merged output ``(B, H, T, Dv)`` (its ``rowsum(grad_out * out)``
            enters every tile's gradient).
        lse: the final per-row log-sum-exp ``(B, H, T)`` over *all* keys.
        mask, scale, q_offset, k_offset, T_total, S_total, block_q, block_k, tile_path,
            softcap: as :func:`attend_chunk`.

    Returns:
        ``(dq, dk, dv)`` contributions of this chunk pair in the compute dtype, shaped as
        query, key and value.
    """
    opts = ChunkOptions(q_offset, k_offset, T_total, S_total, block_q, block_k, tile_path, softcap)
    dq, dk, dv, _ = backward(query, key, value, grad_out, out, lse, mask, scale, opts)
    cd = compute_dtype(query.dtype)
    return dq.to(cd), dk.to(cd), dv.to(cd)


def merge_partials(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    *,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial attentions over disjoint key sets by their log-sum-exp.

    ``out = (exp(lse_a) * out_a + exp(lse_b) * out_b) / (exp(lse_a) + exp(lse_b))``,
    computed stably; a side with ``lse = -inf`` (saw nothing) contributes nothing.

    Args:
        out_a, lse_a: the first partial (with ``inplace``, the accumulator: may be views,
            e.g. row slices of a larger output).
        out_b, lse_b: the second partial.
        inplace: write the result into ``out_a`` and ``lse_a`` and use ``out_b`` as
            scratch (it is overwritten), so that merging allocates nothing of ``out``'s
            size; ring attention merges each chunk into its accumulators this way.

    Returns:
        ``(out, lse)``; with ``inplace``, ``out_a`` and ``lse_a`` themselves.

    Shape:
        - out_a, out_b: ``(..., T, Dv)``; lse_a, lse_b: ``(..., T)``; returns the same.
    """
    lse = torch.logaddexp(lse_a, lse_b)  # (..., T); -inf only if both are -inf
    safe = lse.masked_fill(lse == NEG_INF, 0.0)
    wa = torch.exp(lse_a - safe).unsqueeze(-1)  # exp(-inf) = 0 for an empty side
    wb = torch.exp(lse_b - safe).unsqueeze(-1)
    if not inplace:
        return out_a * wa + out_b * wb, lse
    out_a.mul_(wa).add_(out_b.mul_(wb))
    lse_a.copy_(lse)
    return out_a, lse_a
