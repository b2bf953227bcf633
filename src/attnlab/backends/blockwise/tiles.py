"""One tile of blockwise attention, two implementations, forward and backward.

Shape legend: B batch, Hs/Gs the query/key-value heads of one worker's group, R = Hs // Gs,
tq/tk the rows/keys of one tile, D head dim, Dv value head dim.

* ``"fused"``: PyTorch's CPU flash-attention op, which returns the row log-sum-exp beside
  the output, with ``is_causal`` for diagonal tiles and a dense additive mask of the tile
  only for partial ones.
* ``"pure"``: the same tile in plain PyTorch (``bmm``, ``exp``; fp32 statistics), the
  fallback for what the op cannot express and the tested reference of the fused one.

Both return the output normalised within the tile and the row log-sum-exp ``lse``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch

from attnlab import native
from attnlab.backends.blockwise.paths import FUSED_OPS, TilePath
from attnlab.backends.blockwise.plan import Geometry, RowBlock, Tile, resolve
from attnlab.backends.math import compute_dtype
from attnlab.masks import MaskBlock

NEG_INF = float("-inf")

#: A tile's bias gradient: called with dL/d(bias) of the tile's query heads h0:h0+Hs.
BiasGrad = Callable[[torch.Tensor, Tile, int], None]


def heads(t: torch.Tensor, h0: int, h1: int) -> torch.Tensor:
    """A mask tensor as 4-D ``(b, h, tq, tk)``, restricted to query heads ``h0:h1``."""
    while t.ndim < 4:
        t = t.unsqueeze(0)
    return t if t.shape[1] == 1 else t[:, h0:h1]


def dense_tile(blk: MaskBlock, h0: int, h1: int, dtype: torch.dtype) -> torch.Tensor:
    """The tile's mask as one additive float tensor (``-inf`` = not allowed), 4-D."""
    if blk.bias is not None:
        dense = heads(blk.bias, h0, h1).to(dtype)
        if blk.allowed is not None:
            dense = dense.masked_fill(~heads(blk.allowed, h0, h1), NEG_INF)
        return dense
    assert blk.allowed is not None, "a partial tile carries allowed and/or bias"
    allowed = heads(blk.allowed, h0, h1)
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, NEG_INF
    )


@functools.lru_cache(maxsize=16)
def _above_diagonal(tq: int, tk: int, device: torch.device) -> torch.Tensor:
    """``(tq, tk)`` bool, True above the top-left diagonal: what a causal tile hides."""
    return torch.ones(tq, tk, dtype=torch.bool, device=device).triu_(1)


def mask_scores(s: torch.Tensor, tile: Tile, h0: int, h1: int, fill: float = NEG_INF) -> None:
    """Apply a tile's mask in place to scores ``s`` (B, Hs, tq, tk): its bias is added
    and what it hides becomes ``fill`` (``-inf``; or 0 on probabilities, which a tile
    with a bias cannot be given)."""
    if tile.kind == "causal" and tile.blk is not None:  # a causal square with its bias
        assert tile.blk.bias is not None and fill == NEG_INF
        s.add_(heads(tile.blk.bias, h0, h1).to(s.dtype))
    if tile.kind == "causal" and fill == 0.0:
        s.tril_()
    elif tile.kind == "causal":
        s.masked_fill_(_above_diagonal(*s.shape[-2:], s.device), fill)
    elif tile.kind == "partial":
        assert tile.blk is not None
        if tile.blk.bias is not None:
            assert fill == NEG_INF, "a bias is added to scores, not to probabilities"
            s.add_(heads(tile.blk.bias, h0, h1).to(s.dtype))
        if tile.blk.allowed is not None:
            s.masked_fill_(~heads(tile.blk.allowed, h0, h1), fill)


def _shift(tile: Tile, h0: int, h1: int, dtype: torch.dtype) -> torch.Tensor:
    """A shifted tile's constant per head, ``(1, Hs, 1)`` (broadcasts against an lse)."""
    assert tile.kind == "shifted" and tile.blk is not None and tile.blk.bias is not None
    return heads(tile.blk.bias, h0, h1).detach().to(dtype)[..., 0]


_LOG2E = 1.4426950408889634


def _exp_(t: torch.Tensor) -> torch.Tensor:
    """``exp(t)`` in place, as ``exp2(t log2 e)``: PyTorch's CPU exp2 is faster than its
    exp (benchmarks/bench_attention.py, the pure tiles' rows)."""
    return t.mul_(_LOG2E).exp2_()


def _gqa(q: torch.Tensor, Gs: int) -> torch.Tensor:
    """(B, Gs*R, tq, D) -> (B, Gs, R*tq, D): a key/value head's query heads stacked as rows."""
    B, Hs, tq, D = q.shape
    return q.reshape(B, Gs, (Hs // Gs) * tq, D)


class Scratch:
    """One worker's reusable scratch for pure tiles: a flat buffer per name, grown as needed.

    Writing a tile's matmuls into the same memory every time spares the allocator's cost,
    which is a large share of a pure tile's (benchmarks/bench_attention.py --pure-max-t).
    A view handed out is valid until the same name is taken again, so a tile's results
    must be used (or added into the caller's sums) before the next tile runs.
    """

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """An uninitialised ``shape`` tensor with ``like``'s dtype and device."""
        n = math.prod(shape)
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < n or buf.dtype != like.dtype or buf.device != like.device:
            buf = torch.empty(n, dtype=like.dtype, device=like.device)
            self._bufs[name] = buf
        return buf[:n].view(shape)


def _mm(a: torch.Tensor, b: torch.Tensor, ws: Scratch | None, name: str) -> torch.Tensor:
    """``a @ b``, written into ``ws``'s buffer ``name`` when there is a scratch."""
    if ws is None:
        return a @ b
    return torch.matmul(a, b, out=ws.take(name, (*a.shape[:-1], b.shape[-1]), a))


def tile_forward(
    path: TilePath,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tile: Tile,
    scale: float,
    h0: int,
    softcap: float | None = None,
    ws: Scratch | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One tile: ``(out, lse)`` of queries ``q`` over keys ``k``/values ``v`` under the
    tile's mask, ``out`` normalised within the tile.

    q ``(B, Hs, tq, D)`` (query heads ``h0:h0+Hs``), k ``(B, Gs, tk, D)``, v
    ``(B, Gs, tk, Dv)``; returns out ``(B, Hs, tq, Dv)`` (fused: the input dtype; pure:
    the compute dtype) and lse ``(B, Hs, tq)`` (compute dtype; ``-inf`` for rows that see
    nothing in the tile). ``softcap`` (pure path only) caps the scaled scores before the
    mask. ``ws``: the worker's scratch (pure path; the results are then its views).
    """
    B, Hs, tq, _ = q.shape
    if path == "fused":
        assert softcap is None, "the fused op has no soft-capping"
        assert FUSED_OPS is not None
        dense = None
        if tile.blk is not None and tile.kind in ("partial", "causal"):
            dense = dense_tile(tile.blk, h0, h0 + Hs, compute_dtype(q.dtype))
        out, lse = FUSED_OPS[0](
            q, k, v, 0.0, tile.kind == "causal", attn_mask=dense, scale=scale
        )  # (B, Hs, tq, Dv), (B, Hs, tq)
        if tile.kind == "shifted":
            lse = lse + _shift(tile, h0, h0 + Hs, lse.dtype)
        if dense is not None:
            # The op gives a row that sees nothing lse 0 (and out 0); attnlab's is -inf.
            # Only rows with lse == 0 can be such rows: look at the tile only if there are
            # any (a bias tile has none, and the full check costs a pass over the tile).
            maybe = lse == 0
            if bool(maybe.any()):
                hidden = dense == NEG_INF
                if tile.kind == "causal":  # its bias only: the triangle hides the rest
                    hidden |= _above_diagonal(*hidden.shape[-2:], hidden.device)
                lse = lse.masked_fill(maybe & hidden.all(dim=-1), NEG_INF)
        return out, lse
    Gs, tk = k.shape[1], k.shape[2]
    cd = compute_dtype(q.dtype)
    # A soft-capped score is taken as c tanh(s / c) + c = 2c sigmoid(2 s / c): PyTorch's CPU
    # sigmoid is faster than its tanh (bench_attention.py --variants); 2 / c joins
    # the query scale, and the + c (the same for every score) comes off the lse at the end.
    qscale = scale if softcap is None else 2.0 * scale / softcap
    qg = _gqa(q.to(cd) * qscale, Gs)  # (B, Gs, R*tq, D)
    s = _mm(qg, k.to(cd).transpose(-2, -1), ws, "s")  # (B, Gs, R*tq, tk)
    if softcap is not None:
        s.sigmoid_().mul_(2.0 * softcap)
    masked = tile.kind not in ("full", "shifted")
    if masked:
        mask_scores(s.view(B, Hs, tq, tk), tile, h0, h0 + Hs)
    m = s.amax(dim=-1, keepdim=True)  # (B, Gs, R*tq, 1)
    if masked:  # a row that sees nothing has max -inf: subtract 0 there, not -inf
        m.masked_fill_(m == NEG_INF, 0.0)
    p = _exp_(s.sub_(m))  # in place
    l = p.sum(dim=-1, keepdim=True)  # (B, Gs, R*tq, 1)
    out = _mm(p, v.to(cd), ws, "pv").div_(l.clamp(min=torch.finfo(cd).tiny))  # 0 if l == 0
    lse = m.add_(l.log_()).view(B, Hs, tq)  # -inf where l == 0
    if softcap is not None:  # every score carried + c
        lse = lse.sub_(softcap)
    if tile.kind == "shifted":
        lse = lse + _shift(tile, h0, h0 + Hs, cd)
    return out.view(B, Hs, tq, -1), lse


def capped_row_block(
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    rb: RowBlock,
    geo: Geometry,
    scale: float,
    softcap: float,
    h0: int,
    out: torch.Tensor,
    lse: torch.Tensor,
    ws: Scratch | None,
) -> bool:
    """One row block of soft-capped attention on pure tiles, without a running max.

    A soft-capped score is bounded: ``c tanh(s / c) - c`` lies in ``(-2c, 0)``, and it is
    ``-2c sigmoid(-2 s / c)``. So every tile's probabilities can share one reference, the
    bound itself: ``p = exp(c tanh(s / c) - c)``, no row maximum, no rescaling, and the
    tiles of the row block add up (``acc += p @ v``, ``l += rowsum(p)``) instead of being
    merged one by one; at the end ``out = acc / l`` and ``lse = log(l) + c``. Four passes
    over a tile (sigmoid, scale, exp2, sum) where the general tile makes seven, plus a
    merge; one pass when the compiled module is loaded (float32 compute; its
    ``capped_probs``, which also skips a causal tile's hidden triangle): soft-cap then
    costs 1.2x plain causal attention, not 1.4-1.6x (bench_attention.py --variants).

    ``p >= exp(-2c)``: in fp32 that is a normal number for ``c`` up to 43 (Gemma 2 uses 30
    in its final logits, 50 in attention), so nothing underflows. For a larger ``c`` a row
    can underflow only if all its scores sit near ``-c`` (or it sees no key at all); when
    some row's ``l`` is that small this returns False without writing, and the caller runs
    the block through the general tiles. Masks without a bias only (the caller's check).

    q ``(B, Hs, tq, D)`` (query heads ``h0:``), key/value ``(B, Gs, S, D|Dv)``; writes
    ``out`` ``(B, Hs, tq, Dv)`` and ``lse`` ``(B, Hs, tq)``.
    """
    B, Hs, tq, _ = q.shape
    Gs, Dv = key.shape[1], value.shape[3]
    cd = compute_dtype(q.dtype)
    # the compiled pass (native/capped.h) takes the scores as -2 log2(e) s / c
    ext = native.loaded() if cd == torch.float32 else None
    qf = -2.0 * scale / softcap * (_LOG2E if ext is not None else 1.0)
    qs = _gqa(q.to(cd) * qf, Gs)  # (B, Gs, R*tq, D): -2 s / c (times log2 e)
    rows = qs.shape[2]
    acc = torch.zeros(B, Gs, rows, Dv, dtype=cd, device=q.device)
    l = torch.zeros(B, Gs, rows, 1, dtype=cd, device=q.device)
    acc3 = acc.view(B * Gs, rows, Dv)
    for lazy in rb.tiles:
        tile = resolve(lazy, rb, geo)
        k, v = key[:, :, tile.c0 : tile.c1].to(cd), value[:, :, tile.c0 : tile.c1].to(cd)
        p = _mm(qs, k.transpose(-2, -1), ws, "s")  # (B, Gs, R*tq, tk)
        # the compiled pass masks and sums full and causal tiles itself; a partial tile's
        # mask, and PyTorch's passes, come after
        whole = ext is not None and tile.kind in ("full", "causal")
        if ext is not None:
            ext.capped_probs(p, l if whole else None, softcap, tq, tile.kind == "causal")
        else:
            p.sigmoid_().mul_(-2.0 * softcap * _LOG2E).exp2_()
        if not whole:
            if tile.kind != "full":
                mask_scores(p.view(B, Hs, tq, -1), tile, h0, h0 + Hs, fill=0.0)
            l.add_(p.sum(dim=-1, keepdim=True))
        # acc += p @ v, the sum inside the product (B, Gs, R*tq, Dv)
        acc3.baddbmm_(p.view(B * Gs, rows, -1), v.reshape(B * Gs, -1, Dv))
    info = torch.finfo(cd)
    tiny = info.tiny
    # Every p is a normal number when exp(-2c) is; else a row's sum l >= S^2 tiny / eps
    # still bounds what underflowed (< tiny per key, even flushed to zero) below eps of
    # its largest p (>= l / S).
    n = key.shape[2]
    if 2.0 * softcap * _LOG2E > -math.log2(tiny) - 1 and bool((l < n * n * tiny / info.eps).any()):
        return False  # may have underflowed: the general tiles keep a row maximum
    out.copy_(acc.div_(l.clamp(min=tiny)).view(B, Hs, tq, Dv))  # 0 where l == 0
    lse.copy_(l.log_().add_(softcap).view(B, Hs, tq))  # -inf where l == 0
    return True


def tile_backward(
    path: TilePath,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor | None,
    tile: Tile,
    scale: float,
    h0: int,
    softcap: float | None = None,
    bias_grad: BiasGrad | None = None,
    ws: Scratch | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One tile's gradient contributions ``(dq, dk, dv)``, shaped as q, k, v.

    dout, out: rows of the final output's gradient and of the final output; lse: the
    final rows' log-sum-exp with ``+inf`` for rows that see nothing (probabilities 0);
    delta: ``rowsum(dout * out)`` (pure path only). Pure path only: ``softcap`` as in the
    forward (its derivative ``1 - tanh^2`` joins dS), ``bias_grad`` receives dS of a
    biased tile (the gradient of the bias, before the soft-cap's derivative); ``ws``:
    the worker's scratch (pure path: the gradients are then its views).
    """
    Hs = q.shape[1]
    if tile.kind == "shifted":  # p = exp(s + shift - lse)
        lse = lse - _shift(tile, h0, h0 + Hs, lse.dtype)
    if path == "fused":
        assert softcap is None and bias_grad is None, "the fused op has neither"
        assert FUSED_OPS is not None
        dense = None
        if tile.blk is not None and tile.kind in ("partial", "causal"):
            dense = dense_tile(tile.blk, h0, h0 + Hs, compute_dtype(q.dtype))
        dq, dk, dv = FUSED_OPS[1](
            dout, q, k, v, out, lse, 0.0, tile.kind == "causal", attn_mask=dense, scale=scale
        )
        return dq, dk, dv
    assert delta is not None
    B, _, tq, D = q.shape
    Gs, tk = k.shape[1], k.shape[2]
    cd = compute_dtype(q.dtype)
    biased = tile.blk is not None and tile.blk.bias is not None
    # A soft-cap without a bias takes the compiled passes where they are loaded
    # (native/capped.h): q then carries -2 log2(e) / c, as in capped_row_block.
    ext = native.loaded() if softcap is not None and not biased and cd == torch.float32 else None
    # With a soft-cap, q carries 2 / c too: s is then 2 s / c, the sigmoid's argument.
    q_scale = scale if softcap is None else 2.0 * scale / softcap
    if ext is not None:
        q_scale *= -_LOG2E
    qg = _gqa(q.to(cd) * q_scale, Gs)  # (B, Gs, R*tq, D)
    dog = _gqa(dout.to(cd), Gs)  # (B, Gs, R*tq, Dv)
    kc, vc = k.to(cd), v.to(cd)
    s = _mm(qg, kc.transpose(-2, -1), ws, "s")  # (B, Gs, R*tq, tk)
    if ext is not None:
        assert softcap is not None
        dv, ds = _capped_backward(ext, s, dog, vc, lse, delta, tile, softcap, h0, ws)
        return (*_input_grads(ds, kc, qg, scale, 4.0, q_scale, ws, (B, Hs, tq, D)), dv)
    sig = None
    if softcap is not None:  # as the forward: c tanh(s / c) + c; keep the sigmoid
        sig = s.sigmoid_()
        lse = lse + softcap
    if softcap is not None and not biased:
        # p = exp(2c sig - lse) in one pass from sig (the row constant broadcast), then
        # the tile's mask on p: 0 where hidden.
        assert sig is not None
        neg_lse = _gqa(lse.unsqueeze(-1), Gs) * -_LOG2E
        p = ws.take("p", sig.shape, sig) if ws is not None else torch.empty_like(sig)
        torch.add(neg_lse, sig, alpha=2.0 * softcap * _LOG2E, out=p).exp2_()
        if tile.kind not in ("full", "shifted"):
            mask_scores(p.view(B, Hs, tq, tk), tile, h0, h0 + Hs, fill=0.0)
    else:
        if sig is not None and softcap is not None:
            s = sig * (2.0 * softcap)
        if tile.kind not in ("full", "shifted"):
            mask_scores(s.view(B, Hs, tq, tk), tile, h0, h0 + Hs)
        p = _exp_(s.sub_(_gqa(lse.unsqueeze(-1), Gs)))  # probabilities, in place
    dv = _mm(p.transpose(-2, -1), dog, ws, "dv")  # (B, Gs, tk, Dv)
    dp = _mm(dog, vc.transpose(-2, -1), ws, "dp")  # (B, Gs, R*tq, tk)
    ds = p.mul_(dp.sub_(_gqa(delta.unsqueeze(-1), Gs)))  # dS = p * (dp - delta)
    if bias_grad is not None and tile.blk is not None and tile.blk.bias is not None:
        bias_grad(ds.view(B, Hs, tq, tk), tile, h0)
    chain = 1.0
    if sig is not None:  # d(c tanh(x / c))/dx = 1 - tanh^2 = 4 sig (1 - sig): the 4 below
        ds.mul_(sig.addcmul_(sig, sig, value=-1.0))
        chain = 4.0
    return (*_input_grads(ds, kc, qg, scale, chain, q_scale, ws, (B, Hs, tq, D)), dv)


def _input_grads(
    ds: torch.Tensor,
    kc: torch.Tensor,
    qg: torch.Tensor,
    scale: float,
    chain: float,
    q_scale: float,
    ws: Scratch | None,
    q_shape: tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dq, dk)`` from a tile's dS (before the factor ``chain`` of a soft-cap's
    derivative and the score's ``scale``), the keys, and the queries as multiplied
    (``qg`` carries ``q_scale``)."""
    dq = _mm(ds, kc, ws, "dq").mul_(scale * chain)  # (B, Gs, R*tq, D)
    dk = _mm(ds.transpose(-2, -1), qg, ws, "dk")  # (B, Gs, tk, D); qg carries q_scale
    if chain * scale != q_scale:
        dk.mul_(chain * scale / q_scale)
    return dq.view(q_shape), dk


def _capped_backward(
    ext: Any,
    t: torch.Tensor,
    dog: torch.Tensor,
    vc: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    tile: Tile,
    softcap: float,
    h0: int,
    ws: Scratch | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A soft-capped tile's ``(dv, dS)`` with the compiled passes: ``t`` (B, Gs, R*tq, tk)
    holds ``-2 log2(e) s / c`` and becomes p (one pass, which also writes u (1 - u) for
    the cap's derivative and zeroes a causal tile's hidden keys); then ``dS = p (dp -
    delta) u (1 - u)`` in a second, in place of p. ``lse`` (B, Hs, tq): the rows' final
    log-sum-exp, ``+inf`` for rows that see nothing."""
    B, Gs, _, tk = t.shape
    Hs, tq = lse.shape[1], lse.shape[2]
    l2 = (_gqa(lse.unsqueeze(-1), Gs) + softcap).mul_(_LOG2E).contiguous()  # (B, Gs, rows, 1)
    g = ws.take("g", tuple(t.shape), t) if ws is not None else torch.empty_like(t)
    ext.capped_grad_parts(t, l2, g, softcap, tq, tile.kind == "causal")
    p = t
    if tile.kind not in ("full", "causal"):  # a partial tile's mask, on p
        mask_scores(p.view(B, Hs, tq, tk), tile, h0, h0 + Hs, fill=0.0)
    dv = _mm(p.transpose(-2, -1), dog, ws, "dv")  # (B, Gs, tk, Dv)
    dp = _mm(dog, vc.transpose(-2, -1), ws, "dp")  # (B, Gs, R*tq, tk)
    ext.capped_grad_scores(p, dp, _gqa(delta.unsqueeze(-1), Gs).contiguous(), g)
    return dv, p
