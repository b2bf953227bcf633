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
tiles needs no dense bias at all: it is one more head dimension (:class:`_LinearBias`).
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
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch

from attnlab.backends.base import (
    AttentionRequest,
    Backend,
    BackendResult,
    add_sinks,
)
from attnlab.backends.math import compute_dtype as _compute_dtype
from attnlab.biases import AlibiBias
from attnlab.masks import AndMask, AttentionMask, CausalMask, ChunkedMask, MaskBlock

__all__ = [
    "BACKEND",
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

TilePath = Literal["fused", "pure"]
TileKind = Literal["full", "causal", "partial", "shifted"]
_PATHS = ("fused", "pure")
_NEG_INF = float("-inf")
# Pure tiles: elements per score tile: 2**20 fp32 = 4 MiB, large enough that the matmuls
# run efficiently and Python overhead is amortised, small enough to stay cache-friendly.
# 256 keys per tile: smaller tiles waste less work on the causal diagonal, larger ones
# amortise overhead; 256 measured best for B*H = 12, D = 64 on CPU.
_TILE_ELEMENTS = 1 << 20
_BLOCK_K = 256
# Fused tiles under a mask other than plain causal: smaller tiles skip more masked work (a
# window's edges), larger ones run the op's own blocking better (it splits rows by 256 from
# 768 rows on, by 64 below). 256 x 256 measured best or equal of 256 / 512 / 1024 at
# T = 8192 (1 thread, CPU time) for window and causal & padding masks, forward and
# forward+backward, and for biases (ALiBi, T5). A mask whose rows see a narrow band of
# keys (a window) takes row blocks of 128: a block's diagonal and edge tiles are then a
# smaller share of its work (measured, window 512 at T = 8192, 2 threads: forward 0.246x
# -> 0.227x plain causal, forward+backward 0.206x -> 0.190x), where wide rows lose by it
# (causal & padding 1.08x -> 1.22x torch's causal kernel).
_FUSED_BLOCK_Q = 256
_FUSED_BLOCK_K = 256
_NARROW_BLOCK_Q = 128
_NARROW_KEYS = 1024  # a row block of 256 rows seeing at most this many keys is narrow
# ALiBi as one more head dim (see _LinearBias): rows per block. The key column is centred on
# each row block, so its rounding error grows with the block (fp32: ~6e-8 * slope * rows / 2
# on a score); plain causal in row blocks of 1024 measured 1.01x one call, of 512 1.04x.
_LINEAR_BLOCK_Q = 1024


def _find_fused_ops() -> tuple[Any, Any] | None:
    """PyTorch's CPU flash-attention forward/backward ops, or None if this build lacks them."""
    try:
        aten = torch.ops.aten
        return (
            aten._scaled_dot_product_flash_attention_for_cpu.default,
            aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        )
    except (AttributeError, RuntimeError):
        return None


_FUSED_OPS = _find_fused_ops()  # checked once
_FORCED: list[TilePath | None] = [None]


def fused_tiles_available() -> bool:
    """Whether this PyTorch build has the fused CPU tile ops."""
    return _FUSED_OPS is not None


def force_tile_path(path: TilePath | None) -> AbstractContextManager[None]:
    """Run every blockwise tile with ``path`` (``"fused"`` or ``"pure"``; None = choose)
    inside the ``with`` block, e.g. to test or benchmark one path through the public API.

    Raises:
        ValueError: an unknown path.
    """
    if path is not None and path not in _PATHS:
        raise ValueError(f"`path` must be 'fused', 'pure' or None, got {path!r}")
    return _forced(path)


@contextmanager
def _forced(path: TilePath | None) -> Iterator[None]:
    saved = _FORCED[0]
    _FORCED[0] = path
    try:
        yield
    finally:
        _FORCED[0] = saved


def _pure_because(softcap: float | None) -> str | None:
    if softcap is not None:
        return "the fused tile op has no logit soft-capping"
    return None


def why_not_fused(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> str | None:
    """Why the fused tile op cannot serve these inputs, or None when it can."""
    if _FUSED_OPS is None:
        return "this PyTorch build has no aten._scaled_dot_product_flash_attention_for_cpu"
    if query.device.type != "cpu":
        return f"the fused tile op runs on CPU, the tensors are on {query.device.type}"
    if value.shape[-1] != query.shape[-1]:
        return (
            f"the fused tile op needs the value head dim equal to the query head dim "
            f"(D={query.shape[-1]}), got Dv={value.shape[-1]}"
        )
    if query.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        return f"the fused tile op does not take dtype {query.dtype}"
    return None


def _choose_path(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    tile_path: TilePath | None,
    pure_because: str | None = None,
) -> TilePath:
    """The tile path; ``pure_because`` says why the call needs the pure tiles (softcap,
    bias gradients), or None: then a path forced by :func:`force_tile_path` yields to
    it, an explicit ``tile_path="fused"`` is an error."""
    path = tile_path if tile_path is not None else _FORCED[0]
    if pure_because is not None and tile_path is None:
        path = "pure"
    if path is not None and path not in _PATHS:
        raise ValueError(f"`tile_path` must be 'fused', 'pure' or None, got {path!r}")
    why = pure_because or why_not_fused(query, key, value)
    if path == "fused" and why is not None:
        raise ValueError(f"tile_path='fused' cannot serve this call: {why}; use 'pure'")
    if path is not None:
        return path
    return "pure" if why is not None else "fused"


def default_blocks(BH: int, T: int, S: int) -> tuple[int, int]:
    """Query rows and keys per *pure* tile for ``BH = B * H`` query heads in the batch.

    Keys per tile are fixed (256); rows per tile are the power of two (64 to 4096)
    that keeps a tile near ``_TILE_ELEMENTS`` elements.
    """
    block_k = max(1, min(S, _BLOCK_K))
    rows = _TILE_ELEMENTS // max(1, BH * _BLOCK_K)
    block_q = 1 << max(6, min(12, rows.bit_length() - 1))
    return max(1, min(T, block_q)), block_k


# -- The plan: row blocks and their tiles -------------------------------------------------


@dataclass(frozen=True)
class _Tile:
    """Keys ``c0:c1`` (local to the chunk) of one row block, and what masks them."""

    c0: int
    c1: int
    kind: TileKind
    blk: MaskBlock | None = None
    # A biased tile's MaskBlock is not kept in the plan (every tile of a bias is partial:
    # keeping them all would hold H x T x S numbers); it is recomputed when the tile runs.
    # A "shifted" tile is unmasked with a bias that is one number per head (its blk.bias,
    # (1, H, 1, 1)): computed as a full tile whose log-sum-exp moves by that number.
    lazy: bool = False
    # A lazy, biased tile that is the square on the row block's diagonal: when the rest of
    # its mask is exactly the causal triangle it runs as a "causal" tile carrying the bias
    # (the op's is_causal with the bias as its mask: the half above the diagonal skipped).
    diagonal: bool = False


@dataclass(frozen=True)
class _RowBlock:
    """Rows ``r0:r1`` (local) and their non-empty tiles, left to right."""

    r0: int
    r1: int
    tiles: tuple[_Tile, ...]


def _full_tiles(c0: int, c1: int, bk: int | None) -> list[_Tile]:
    """Keys ``c0:c1`` as full tiles of ``bk`` keys (one tile when ``bk`` is None)."""
    if c1 <= c0:
        return []
    step = c1 - c0 if bk is None else bk
    return [_Tile(k0, min(c1, k0 + step), "full") for k0 in range(c0, c1, step)]


def _plan(
    mask: AttentionMask | None,
    T: int,
    S: int,
    *,
    q_offset: int,
    k_offset: int,
    T_total: int,
    S_total: int,
    bq: int,
    bk: int,
    coalesce: bool,
    causal_tiles: bool,
    device: torch.device,
) -> list[_RowBlock]:
    """Row blocks of ``bq`` rows and their tiles of ``bk`` keys; rows in no block (or in a
    block without tiles) may attend to nothing.

    ``coalesce`` joins each run of adjacent full tiles into one tile. ``causal_tiles``
    plans a plain causal mask as full tiles left of the diagonal and one ``"causal"``
    square on it (top-left aligned, as the op's ``is_causal``) per row block.
    """
    blocks: list[_RowBlock] = []
    if mask is None:
        for r0 in range(0, T, bq):
            tiles = _full_tiles(0, S, None if coalesce else bk)
            blocks.append(_RowBlock(r0, min(T, r0 + bq), tuple(tiles)))
        return blocks
    if causal_tiles and isinstance(mask, CausalMask):
        # Local row i may see local keys j <= i + d.
        d = q_offset + mask.offset(T_total, S_total) - k_offset
        for r0 in range(max(0, -d), T, bq):  # rows before -d see nothing
            r1 = min(T, r0 + bq)
            c_end = min(S, r1 + d)  # the block's last row sees keys < c_end
            # Keys every row of the block sees (all of them for one row, e.g. decoding).
            c_diag = c_end if r1 - r0 == 1 else min(S, r0 + d)
            tiles = _full_tiles(0, c_diag, None if coalesce else bk)
            if c_end > c_diag:
                tiles.append(_Tile(c_diag, c_end, "causal"))
            blocks.append(_RowBlock(r0, r1, tuple(tiles)))
        return blocks
    # With causal_tiles, key tiles are cut at the row block's diagonal so that the square on
    # it can be an is_causal tile when the mask is exactly causal there.
    diag = _diagonal_offset(mask, T_total, S_total) if causal_tiles else None
    for r0 in range(0, T, bq):
        r1 = min(T, r0 + bq)
        lo, hi = mask.col_range(T_total, S_total, q_offset + r0, q_offset + r1)
        lo, hi = min(max(lo - k_offset, 0), S), min(max(hi - k_offset, 0), S)
        cuts = set(range(lo, hi, bk)) | {hi}
        d0 = d1 = -1
        if diag is not None:
            d0 = q_offset + r0 + diag - k_offset  # the key on row r0's diagonal
            d1 = d0 + r1 - r0
            cuts = {c for c in range(d0, lo, -bk)} | {c for c in range(d1, hi, bk)}
            cuts = {c for c in cuts if lo < c < hi} | {lo, hi}
        edges = sorted(cuts)
        tiles = []
        run = -1  # start of the current run of full tiles, or -1
        shifted: tuple[int, torch.Tensor] | None = None  # start and constant of a shifted run
        for k0, k1 in itertools.pairwise(edges):
            rows, cols = slice(q_offset + r0, q_offset + r1), slice(k_offset + k0, k_offset + k1)
            status = mask.block_status(T_total, S_total, rows, cols)
            blk = None
            if status == "partial" and not mask.has_bias:  # small: keep it in the plan
                blk = mask.block(T_total, S_total, rows, cols, device=device)
                status = blk.status
            shift = None
            if status == "partial" and mask.has_bias:
                shift = mask.constant_bias(T_total, S_total, rows, cols, device=device)
            if shift is not None:  # a shifted tile: joins a run of the same constant
                if run >= 0:
                    tiles.append(_Tile(run, k0, "full"))
                    run = -1
                if shifted is not None and coalesce and torch.equal(shift, shifted[1]):
                    continue
                if shifted is not None:
                    tiles.append(_Tile(shifted[0], k0, "shifted", lazy=True))
                shifted = (k0, shift)
                continue
            if shifted is not None:
                tiles.append(_Tile(shifted[0], k0, "shifted", lazy=True))
                shifted = None
            if status == "full" and coalesce:
                run = k0 if run < 0 else run
                continue
            if run >= 0:
                tiles.append(_Tile(run, k0, "full"))
                run = -1
            if status == "full":
                tiles.append(_Tile(k0, k1, "full"))
            elif status == "partial" and blk is None:  # a biased tile is computed when it runs
                tiles.append(_Tile(k0, k1, "partial", lazy=True, diagonal=(k0, k1) == (d0, d1)))
            elif status == "partial":
                assert blk is not None
                causal = (k0, k1) == (d0, d1) and _is_causal_square(blk)
                tiles.append(_Tile(k0, k1, "causal") if causal else _Tile(k0, k1, "partial", blk))
        if run >= 0:
            tiles.append(_Tile(run, hi, "full"))
        if shifted is not None:
            tiles.append(_Tile(shifted[0], hi, "shifted", lazy=True))
        if tiles:
            blocks.append(_RowBlock(r0, r1, tuple(tiles)))
    return blocks


def _diagonal_offset(mask: AttentionMask, T: int, S: int) -> int | None:
    """Key position of query 0 under the mask's causal-style part (a mask with an
    ``offset(T, S)``, e.g. causal or sliding window), or None when it has none."""
    for part in mask.parts if isinstance(mask, AndMask) else (mask,):
        offset = getattr(part, "offset", None)
        if callable(offset):
            return int(offset(T, S))
    return None


def _is_causal_square(blk: MaskBlock) -> bool:
    """Whether a square tile's mask is exactly the top-left causal triangle (no bias)."""
    if blk.bias is not None or blk.allowed is None:
        return False
    allowed = blk.allowed
    n = allowed.shape[-1]
    if allowed.shape[-2] != n:
        return False
    tril = torch.ones(n, n, dtype=torch.bool, device=allowed.device).tril_()
    return bool((allowed == tril).all())


@dataclass(frozen=True)
class _Geometry:
    """Where a chunk sits in the full problem the mask is defined on."""

    mask: AttentionMask | None
    q_offset: int
    k_offset: int
    T_total: int
    S_total: int
    device: torch.device


def _resolve(tile: _Tile, rb: _RowBlock, geo: _Geometry) -> _Tile:
    """The tile with its MaskBlock (recomputed for a lazy, biased tile)."""
    if not tile.lazy:
        return tile
    assert geo.mask is not None
    q0, k0 = geo.q_offset, geo.k_offset
    rows, cols = slice(q0 + rb.r0, q0 + rb.r1), slice(k0 + tile.c0, k0 + tile.c1)
    if tile.kind == "shifted":
        shift = geo.mask.constant_bias(geo.T_total, geo.S_total, rows, cols, device=geo.device)
        assert shift is not None, "the plan found this tile's bias constant"
        return _Tile(tile.c0, tile.c1, "shifted", MaskBlock("partial", bias=shift))
    blk = geo.mask.block(geo.T_total, geo.S_total, rows, cols, device=geo.device)
    if blk.status != "partial":  # block_status was conservative: nothing to see here
        shape = (1, 1, rb.r1 - rb.r0, tile.c1 - tile.c0)
        blk = MaskBlock("partial", allowed=torch.zeros(shape, dtype=torch.bool, device=geo.device))
    if (
        tile.diagonal
        and blk.bias is not None
        and _is_causal_square(MaskBlock("partial", blk.allowed))
    ):
        return _Tile(tile.c0, tile.c1, "causal", MaskBlock("partial", bias=blk.bias))
    return _Tile(tile.c0, tile.c1, "partial", blk)


# A tile's bias gradient: called with dL/d(bias) of the tile's query heads h0:h0+Hs.
BiasGrad = Callable[[torch.Tensor, _Tile, int], None]


# -- One tile, two implementations --------------------------------------------------------


def _heads(t: torch.Tensor, h0: int, h1: int) -> torch.Tensor:
    """A mask tensor as 4-D ``(b, h, tq, tk)``, restricted to query heads ``h0:h1``."""
    while t.ndim < 4:
        t = t.unsqueeze(0)
    return t if t.shape[1] == 1 else t[:, h0:h1]


def _dense_tile(blk: MaskBlock, h0: int, h1: int, dtype: torch.dtype) -> torch.Tensor:
    """The tile's mask as one additive float tensor (``-inf`` = not allowed), 4-D."""
    if blk.bias is not None:
        dense = _heads(blk.bias, h0, h1).to(dtype)
        if blk.allowed is not None:
            dense = dense.masked_fill(~_heads(blk.allowed, h0, h1), _NEG_INF)
        return dense
    assert blk.allowed is not None, "a partial tile carries allowed and/or bias"
    allowed = _heads(blk.allowed, h0, h1)
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, _NEG_INF
    )


@functools.lru_cache(maxsize=16)
def _above_diagonal(tq: int, tk: int, device: torch.device) -> torch.Tensor:
    """``(tq, tk)`` bool, True above the top-left diagonal: what a causal tile hides."""
    return torch.ones(tq, tk, dtype=torch.bool, device=device).triu_(1)


def _mask_scores(s: torch.Tensor, tile: _Tile, h0: int, h1: int, fill: float = _NEG_INF) -> None:
    """Apply a tile's mask in place to scores ``s`` (B, Hs, tq, tk): its bias is added
    and what it hides becomes ``fill`` (``-inf``; or 0 on probabilities, which a tile
    with a bias cannot be given)."""
    if tile.kind == "causal" and tile.blk is not None:  # a causal square with its bias
        assert tile.blk.bias is not None and fill == _NEG_INF
        s.add_(_heads(tile.blk.bias, h0, h1).to(s.dtype))
    if tile.kind == "causal" and fill == 0.0:
        s.tril_()
    elif tile.kind == "causal":
        s.masked_fill_(_above_diagonal(*s.shape[-2:], s.device), fill)
    elif tile.kind == "partial":
        assert tile.blk is not None
        if tile.blk.bias is not None:
            assert fill == _NEG_INF, "a bias is added to scores, not to probabilities"
            s.add_(_heads(tile.blk.bias, h0, h1).to(s.dtype))
        if tile.blk.allowed is not None:
            s.masked_fill_(~_heads(tile.blk.allowed, h0, h1), fill)


def _shift(tile: _Tile, h0: int, h1: int, dtype: torch.dtype) -> torch.Tensor:
    """A shifted tile's constant per head, ``(1, Hs, 1)`` (broadcasts against an lse)."""
    assert tile.kind == "shifted" and tile.blk is not None and tile.blk.bias is not None
    return _heads(tile.blk.bias, h0, h1).detach().to(dtype)[..., 0]


_LOG2E = 1.4426950408889634


def _exp_(t: torch.Tensor) -> torch.Tensor:
    """``exp(t)`` in place, as ``exp2(t log2 e)``: PyTorch's CPU exp2 is vectorised, 2-3x
    faster than its exp (measured: a 12 x 256 x 256 fp32 tile, AVX-512)."""
    return t.mul_(_LOG2E).exp2_()


def _gqa(q: torch.Tensor, Gs: int) -> torch.Tensor:
    """(B, Gs*R, tq, D) -> (B, Gs, R*tq, D): a key/value head's query heads stacked as rows."""
    B, Hs, tq, D = q.shape
    return q.reshape(B, Gs, (Hs // Gs) * tq, D)


class _Scratch:
    """One worker's reusable scratch for pure tiles: a flat buffer per name, grown as needed.

    A pure tile is a few matmuls and passes over ``(rows, keys)`` scores; allocating each
    result afresh (3 MiB for a 12 x 256 x 256 fp32 tile) measured 1.3x slower than
    writing into the same memory every time (matmul loop of a 4096 causal pass, 1
    thread: 427 -> 323 ms): the allocator's cost, not the arithmetic's. A view handed
    out is valid until the same name is taken again, so a tile's results must be used (or
    added into the caller's sums) before the next tile runs.
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


def _mm(a: torch.Tensor, b: torch.Tensor, ws: _Scratch | None, name: str) -> torch.Tensor:
    """``a @ b``, written into ``ws``'s buffer ``name`` when there is a scratch."""
    if ws is None:
        return a @ b
    return torch.matmul(a, b, out=ws.take(name, (*a.shape[:-1], b.shape[-1]), a))


def _tile_forward(
    path: TilePath,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tile: _Tile,
    scale: float,
    h0: int,
    softcap: float | None = None,
    ws: _Scratch | None = None,
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
        assert _FUSED_OPS is not None
        dense = None
        if tile.blk is not None and tile.kind in ("partial", "causal"):
            dense = _dense_tile(tile.blk, h0, h0 + Hs, _compute_dtype(q.dtype))
        out, lse = _FUSED_OPS[0](
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
                hidden = dense == _NEG_INF
                if tile.kind == "causal":  # its bias only: the triangle hides the rest
                    hidden |= _above_diagonal(*hidden.shape[-2:], hidden.device)
                lse = lse.masked_fill(maybe & hidden.all(dim=-1), _NEG_INF)
        return out, lse
    Gs, tk = k.shape[1], k.shape[2]
    cd = _compute_dtype(q.dtype)
    # A soft-capped score is taken as c tanh(s / c) + c = 2c sigmoid(2 s / c): PyTorch's CPU
    # sigmoid is 4-6x faster than its tanh (measured, fp32 tile); 2 / c joins the query
    # scale, and the + c (the same for every score) comes off the lse at the end.
    qscale = scale if softcap is None else 2.0 * scale / softcap
    qg = _gqa(q.to(cd) * qscale, Gs)  # (B, Gs, R*tq, D)
    s = _mm(qg, k.to(cd).transpose(-2, -1), ws, "s")  # (B, Gs, R*tq, tk)
    if softcap is not None:
        s.sigmoid_().mul_(2.0 * softcap)
    masked = tile.kind not in ("full", "shifted")
    if masked:
        _mask_scores(s.view(B, Hs, tq, tk), tile, h0, h0 + Hs)
    m = s.amax(dim=-1, keepdim=True)  # (B, Gs, R*tq, 1)
    if masked:  # a row that sees nothing has max -inf: subtract 0 there, not -inf
        m.masked_fill_(m == _NEG_INF, 0.0)
    p = _exp_(s.sub_(m))  # in place
    l = p.sum(dim=-1, keepdim=True)  # (B, Gs, R*tq, 1)
    out = _mm(p, v.to(cd), ws, "pv").div_(l.clamp(min=torch.finfo(cd).tiny))  # 0 if l == 0
    lse = m.add_(l.log_()).view(B, Hs, tq)  # -inf where l == 0
    if softcap is not None:  # every score carried + c
        lse = lse.sub_(softcap)
    if tile.kind == "shifted":
        lse = lse + _shift(tile, h0, h0 + Hs, cd)
    return out.view(B, Hs, tq, -1), lse


def _capped_row_block(
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    rb: _RowBlock,
    geo: _Geometry,
    scale: float,
    softcap: float,
    h0: int,
    out: torch.Tensor,
    lse: torch.Tensor,
    ws: _Scratch | None,
) -> bool:
    """One row block of soft-capped attention on pure tiles, without a running max.

    A soft-capped score is bounded: ``c tanh(s / c) - c`` lies in ``(-2c, 0)``, and it is
    ``-2c sigmoid(-2 s / c)``. So every tile's probabilities can share one reference, the
    bound itself: ``p = exp(c tanh(s / c) - c)``, no row maximum, no rescaling, and the
    tiles of the row block add up (``acc += p @ v``, ``l += rowsum(p)``) instead of being
    merged one by one; at the end ``out = acc / l`` and ``lse = log(l) + c``. Three passes
    over a tile (sigmoid, scale, exp2) where the general tile makes seven, plus a merge.

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
    cd = _compute_dtype(q.dtype)
    qs = _gqa(q.to(cd) * (-2.0 * scale / softcap), Gs)  # (B, Gs, R*tq, D): -2 s / c
    rows = qs.shape[2]
    acc = torch.zeros(B, Gs, rows, Dv, dtype=cd, device=q.device)
    l = torch.zeros(B, Gs, rows, 1, dtype=cd, device=q.device)
    for lazy in rb.tiles:
        tile = _resolve(lazy, rb, geo)
        k, v = key[:, :, tile.c0 : tile.c1].to(cd), value[:, :, tile.c0 : tile.c1].to(cd)
        p = _mm(qs, k.transpose(-2, -1), ws, "s").sigmoid_()
        p.mul_(-2.0 * softcap * _LOG2E).exp2_()
        if tile.kind != "full":
            _mask_scores(p.view(B, Hs, tq, -1), tile, h0, h0 + Hs, fill=0.0)
        l.add_(p.sum(dim=-1, keepdim=True))
        acc.add_(_mm(p, v, ws, "pv"))  # (B, Gs, R*tq, Dv)
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


def _tile_backward(
    path: TilePath,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor | None,
    tile: _Tile,
    scale: float,
    h0: int,
    softcap: float | None = None,
    bias_grad: BiasGrad | None = None,
    ws: _Scratch | None = None,
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
        assert _FUSED_OPS is not None
        dense = None
        if tile.blk is not None and tile.kind in ("partial", "causal"):
            dense = _dense_tile(tile.blk, h0, h0 + Hs, _compute_dtype(q.dtype))
        dq, dk, dv = _FUSED_OPS[1](
            dout, q, k, v, out, lse, 0.0, tile.kind == "causal", attn_mask=dense, scale=scale
        )
        return dq, dk, dv
    assert delta is not None
    B, _, tq, D = q.shape
    Gs, tk = k.shape[1], k.shape[2]
    cd = _compute_dtype(q.dtype)
    # With a soft-cap, q carries 2 / c too: s is then 2 s / c, the sigmoid's argument.
    q_scale = scale if softcap is None else 2.0 * scale / softcap
    qg = _gqa(q.to(cd) * q_scale, Gs)  # (B, Gs, R*tq, D)
    dog = _gqa(dout.to(cd), Gs)  # (B, Gs, R*tq, Dv)
    kc, vc = k.to(cd), v.to(cd)
    s = _mm(qg, kc.transpose(-2, -1), ws, "s")  # (B, Gs, R*tq, tk)
    sig = None
    biased = tile.blk is not None and tile.blk.bias is not None
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
            _mask_scores(p.view(B, Hs, tq, tk), tile, h0, h0 + Hs, fill=0.0)
    else:
        if sig is not None and softcap is not None:
            s = sig * (2.0 * softcap)
        if tile.kind not in ("full", "shifted"):
            _mask_scores(s.view(B, Hs, tq, tk), tile, h0, h0 + Hs)
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
    dq = _mm(ds, kc, ws, "dq").mul_(scale * chain)  # (B, Gs, R*tq, D)
    dk = _mm(ds.transpose(-2, -1), qg, ws, "dk")  # (B, Gs, tk, D); qg carries q_scale
    if chain * scale != q_scale:
        dk.mul_(chain * scale / q_scale)
    return dq.view(B, Hs, tq, D), dk, dv


# -- Parallelism --------------------------------------------------------------------------
# When one fused tile covers the whole call, that one op forks once over (batch, head, row
# block) itself, with PyTorch's intra-op threads: exactly PyTorch's kernel. Otherwise a call
# is many tiles, each several ops (pure) or one op with its own fork (fused); measured
# under load, 2-thread op calls per tile were 1.7-2x slower than the split below. A pure
# tile is a handful of PyTorch ops. Run with intra-op threads, every op is a parallel
# region ending in a barrier: hundreds per call, and on a shared, oversubscribed CPU each
# barrier waits for the slowest descheduled thread (measured: 4-20x slower than PyTorch's
# fused kernel, which forks once). So, like that kernel, attnlab forks once: the key/value
# head groups are split over N Python threads (N = torch.get_num_threads()) and each runs
# its ops single-threaded (the ops release the GIL). PyTorch's thread count is global, so
# it is set to 1 for the duration (reference-counted, restored afterwards).
_POOL_LOCK = threading.Lock()
_POOL_STATE = {"users": 0, "saved": 1}
_POOL: ThreadPoolExecutor | None = None


@contextmanager
def _one_thread_per_op() -> Iterator[int]:
    """Set intra-op threads to 1; yield how many worker threads to use instead."""
    global _POOL
    with _POOL_LOCK:
        if _POOL_STATE["users"] == 0:
            _POOL_STATE["saved"] = torch.get_num_threads()
            torch.set_num_threads(1)
        _POOL_STATE["users"] += 1
        workers = _POOL_STATE["saved"]
        if _POOL is None or _POOL._max_workers < workers:
            _POOL = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="attnlab")
    try:
        yield workers
    finally:
        with _POOL_LOCK:
            _POOL_STATE["users"] -= 1
            if _POOL_STATE["users"] == 0:
                torch.set_num_threads(_POOL_STATE["saved"])


def _profiler_enabled() -> bool:
    check = getattr(getattr(torch._C, "_autograd", None), "_profiler_enabled", None)
    return bool(check()) if check is not None else False


def _run_groups(G: int, work: Callable[[int, int], None]) -> None:
    """Run ``work(g0, g1)`` over contiguous ranges of the G key/value heads."""
    threads = torch.get_num_threads()
    if (
        threads <= 1
        or G < 2
        or threading.current_thread().name.startswith("attnlab")
        # torch.profiler records allocations of the profiled thread only: run the groups
        # there so that it sees them all. The scratch is the same either way: each
        # group's tiles scale with its heads, so concurrent groups add up to one tile.
        or _profiler_enabled()
    ):
        work(0, G)
        return
    grad_mode = torch.is_grad_enabled()  # thread-local: carry the caller's into workers

    def run(g0: int, g1: int) -> None:
        with torch.set_grad_enabled(grad_mode):
            work(g0, g1)

    with _one_thread_per_op() as workers:
        n = min(workers, G)
        cuts = [G * i // n for i in range(n + 1)]
        assert _POOL is not None
        futures = [_POOL.submit(run, cuts[i], cuts[i + 1]) for i in range(n)]
        for f in futures:
            f.result()  # re-raises a worker's exception


def _blocks(
    path: TilePath,
    mask: AttentionMask | None,
    BH: int,
    T: int,
    S: int,
    block_q: int | None,
    block_k: int | None,
    T_total: int,
    S_total: int,
) -> tuple[int, int, bool]:
    """``(rows, keys, coalesce)`` per tile for this path (``T_total``, ``S_total``: the
    problem the mask is defined on); explicit sizes are kept as given (tests use them to
    get many tiles of each kind)."""
    if path == "pure":
        bq, bk = default_blocks(BH, T, S)
        return block_q or bq, block_k or bk, False
    if mask is None or isinstance(mask, CausalMask):
        # The op blocks the whole problem itself (and skips above its causal diagonal).
        return block_q or max(1, T), block_k or max(1, S), block_k is None
    if isinstance(mask, ChunkedMask) and mask.offset(T_total, S_total) % mask.chunk == 0:
        # One row block per chunk: its keys are one square on the diagonal, one causal op call
        return block_q or mask.chunk, block_k or mask.chunk, block_k is None
    bq = _FUSED_BLOCK_Q
    if not mask.has_bias:  # biased tiles measured slower in narrow ones (T5: 1.26x -> 1.42x)
        mid = max(0, T_total // 2 - _FUSED_BLOCK_Q // 2)
        lo, hi = mask.col_range(T_total, S_total, mid, min(T_total, mid + _FUSED_BLOCK_Q))
        bq = _NARROW_BLOCK_Q if hi - lo <= _NARROW_KEYS else bq
    return block_q or bq, block_k or _FUSED_BLOCK_K, block_k is None


@dataclass(frozen=True)
class _LinearBias:
    """ALiBi on the fused path, as one more head dimension: no dense bias at all.

    For query position ``P_i`` and key ``j``, ``-slope_h (P_i - j) = slope_h (j - c) -
    slope_h (P_i - c)`` for any ``c``. The first term is a product of a per-head and a
    per-key number: query column ``D`` holds ``slope_h``, key column ``D`` holds
    ``(j - c) / scale`` (value column ``D`` is 0), so the op's ``scale * q'.k'`` adds it.
    The second term is constant along a row: it leaves the softmax unchanged and only moves
    the row's log-sum-exp, subtracted after the row block. ``c`` is the row block's middle
    row, so the added numbers stay small where the weights are (near the diagonal: at most
    ``slope * rows / 2``, whose fp32 rounding is ~1.5e-5 for slope 1/2 and 1024 rows; far
    keys, where they are large, have vanishing weights); half precision is not taken (its
    key column would round). The rest of the mask (causal or nothing) is planned
    as usual, so plain causal's op calls serve ALiBi.
    """

    slopes: torch.Tensor  # (H,), in the query dtype
    rest: AttentionMask | None

    @staticmethod
    def of(mask: AttentionMask | None, path: TilePath, query: torch.Tensor) -> _LinearBias | None:
        """The helper when the call is ALiBi (& causal) on fused fp32/fp64 tiles, else None."""
        if path != "fused" or query.dtype not in (torch.float32, torch.float64):
            return None
        parts = mask.parts if isinstance(mask, AndMask) else (mask,)
        alibi = [p for p in parts if isinstance(p, AlibiBias)]
        rest = [p for p in parts if not isinstance(p, AlibiBias)]
        if len(alibi) != 1 or alibi[0].slopes.requires_grad or len(rest) > 1:
            return None
        if rest and not isinstance(rest[0], CausalMask):
            return None
        slopes = alibi[0].slopes.to(device=query.device, dtype=query.dtype)
        return _LinearBias(slopes, rest[0] if rest else None)

    @staticmethod
    def widen(t: torch.Tensor, column: torch.Tensor | None = None) -> torch.Tensor:
        """``t`` ``(B, N, L, D)`` with a column ``D`` appended: ``column`` or zeros."""
        out = t.new_zeros(*t.shape[:-1], t.shape[-1] + 1)  # (B, N, L, D + 1)
        out[..., :-1] = t
        if column is not None:
            out[..., -1] = column
        return out

    def widen_query(self, query: torch.Tensor) -> torch.Tensor:
        return self.widen(query, self.slopes[None, :, None])  # slope_h in every row

    @staticmethod
    def _center(rb: _RowBlock, geo: _Geometry) -> int:
        return geo.q_offset + (rb.r0 + rb.r1) // 2 + geo.S_total - geo.T_total

    def enter(
        self, key: torch.Tensor, g0: int, g1: int, rb: _RowBlock, geo: _Geometry, scale: float
    ) -> None:
        """Write key column ``D`` of heads ``g0:g1`` for row block ``rb``: ``(j - c) / scale``."""
        j = torch.arange(key.shape[2], device=key.device, dtype=torch.float64) + geo.k_offset
        key[:, g0:g1, :, -1] = ((j - self._center(rb, geo)) / scale).to(key.dtype)

    def row_shift(self, rb: _RowBlock, geo: _Geometry, h0: int, h1: int) -> torch.Tensor:
        """``slope_h (P_i - c)`` for the rows of ``rb``, ``(1, Hs, tq)``: op lse - true lse."""
        first = geo.q_offset + geo.S_total - geo.T_total
        pos = torch.arange(rb.r0, rb.r1, device=self.slopes.device, dtype=torch.float64) + first
        rel = (pos - self._center(rb, geo)).to(self.slopes.dtype)
        return (self.slopes[h0:h1, None] * rel[None])[None]


def _prepare(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: AttentionMask | None,
    q_offset: int,
    k_offset: int,
    T_total: int | None,
    S_total: int | None,
    block_q: int | None,
    block_k: int | None,
    tile_path: TilePath | None,
    pure_because: str | None = None,
    linear_bias: bool = False,
) -> tuple[TilePath, list[_RowBlock], _Tile | None, _Geometry, _LinearBias | None]:
    """The call's tile path, its plan, the plan's one tile when a single fused tile
    covers the whole chunk (then the op's results are used as they are), where the
    chunk sits in the mask's problem, and the ALiBi helper when ALiBi runs as one more
    head dim (then the plan is the rest of the mask's; only where ``linear_bias``: the
    forward. The op's backward is ~18% slower at D + 1 than at D, measured, so the
    backward keeps ALiBi's 256 x 256 tiles with a dense bias, which measured faster)."""
    B, H, T, _ = query.shape
    S = key.shape[2]
    path = _choose_path(query, key, value, tile_path, pure_because)
    lin = _LinearBias.of(mask, path, query) if linear_bias else None
    if lin is not None:
        mask, block_q = lin.rest, block_q or _LINEAR_BLOCK_Q
    geo = _Geometry(mask, q_offset, k_offset, T if T_total is None else T_total,
                    S if S_total is None else S_total, query.device)  # fmt: skip
    bq, bk, coalesce = _blocks(path, mask, B * H, T, S, block_q, block_k, geo.T_total,
                               geo.S_total)  # fmt: skip
    plan = _plan(mask, T, S, q_offset=q_offset, k_offset=k_offset,
                 T_total=T if T_total is None else T_total,
                 S_total=S if S_total is None else S_total,
                 bq=bq, bk=bk, coalesce=coalesce,
                 causal_tiles=path == "fused" or bq <= bk,
                 device=query.device)  # fmt: skip
    if path == "fused" and lin is None and len(plan) == 1 and len(plan[0].tiles) == 1:
        rb, tile = plan[0], plan[0].tiles[0]
        if (rb.r0, rb.r1, tile.c0, tile.c1) == (0, T, 0, S):
            return path, plan, _resolve(tile, rb, geo), geo, None
    return path, plan, None, geo, lin


def _forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: AttentionMask | None,
    scale: float,
    *,
    q_offset: int,
    k_offset: int,
    T_total: int | None,
    S_total: int | None,
    block_q: int | None,
    block_k: int | None,
    tile_path: TilePath | None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attend_chunk`, except that ``out`` is in the input dtype when one fused
    tile covers the whole chunk (no conversion round trip)."""
    path, plan, whole, geo, lin = _prepare(query, key, value, mask, q_offset, k_offset,
                                           T_total, S_total, block_q, block_k, tile_path,
                                           _pure_because(softcap), linear_bias=True)  # fmt: skip
    if whole is not None:  # one tile: the op's own result (PyTorch's kernel, nothing more)
        return _tile_forward(path, query, key, value, whole, scale, 0, softcap)
    if lin is not None:
        query, key, value = lin.widen_query(query), lin.widen(key), lin.widen(value)
    B, H, T, _ = query.shape
    G, Dv = key.shape[1], value.shape[3]
    R = H // G
    cd = _compute_dtype(query.dtype)
    out = torch.zeros(B, H, T, Dv, dtype=cd, device=query.device)
    lse = torch.full((B, H, T), _NEG_INF, dtype=cd, device=query.device)
    # Soft-capped scores are bounded: pure tiles then need no running maximum.
    bounded = path == "pure" and (mask is None or not mask.has_bias)
    cap = softcap if bounded else None

    def work(g0: int, g1: int) -> None:
        h0, h1 = g0 * R, g1 * R
        k, v = key[:, g0:g1], value[:, g0:g1]
        ws = _Scratch()  # this worker's
        for rb in plan:
            if lin is not None:
                lin.enter(key, g0, g1, rb, geo, scale)
            q = query[:, h0:h1, rb.r0 : rb.r1]  # (B, Hs, tq, D)
            acc, acc_lse = out[:, h0:h1, rb.r0 : rb.r1], lse[:, h0:h1, rb.r0 : rb.r1]
            capped = cap is not None and _capped_row_block(
                q, k, v, rb, geo, scale, cap, h0, acc, acc_lse, ws
            )
            if capped:
                continue
            for i, lazy in enumerate(rb.tiles):
                tile = _resolve(lazy, rb, geo)
                o, l = _tile_forward(path, q, k[:, :, tile.c0 : tile.c1],
                                     v[:, :, tile.c0 : tile.c1], tile, scale, h0,
                                     softcap, ws)  # fmt: skip
                if i == 0:
                    acc.copy_(o)
                    acc_lse.copy_(l)
                else:
                    merge_partials(acc, acc_lse, o.to(cd), l, inplace=True)
            if lin is not None:
                acc_lse.sub_(lin.row_shift(rb, geo, h0, h1))

    _run_groups(G, work)
    if lin is not None:
        out = out[..., :-1].contiguous()  # (B, H, T, Dv)
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
        block_q, block_k: tile size (default: per path, see :func:`default_blocks`).
        tile_path: ``"fused"``, ``"pure"`` or None (the module's choice).
        softcap: logit soft-cap of the scaled scores (pure tiles), or None.

    Returns:
        ``(out, lse)``: the output normalised within this chunk ``(B, H, T, Dv)`` and the
        per-row log-sum-exp ``(B, H, T)`` (``-inf`` where a row saw nothing), both in the
        compute dtype (fp32 for fp16/bf16). Merge chunks with :func:`merge_partials`.

    Raises:
        ValueError: ``tile_path="fused"`` for inputs the op cannot take.
    """
    out, lse = _forward(query, key, value, mask, scale, q_offset=q_offset, k_offset=k_offset,
                        T_total=T_total, S_total=S_total, block_q=block_q, block_k=block_k,
                        tile_path=tile_path, softcap=softcap)  # fmt: skip
    cd = _compute_dtype(query.dtype)
    return out.to(cd), lse.to(cd)


def _backward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    grad_out: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask: AttentionMask | None,
    scale: float,
    *,
    q_offset: int,
    k_offset: int,
    T_total: int | None,
    S_total: int | None,
    block_q: int | None,
    block_k: int | None,
    tile_path: TilePath | None,
    softcap: float | None = None,
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
    path, plan, whole, geo, _ = _prepare(query, key, value, mask, q_offset, k_offset,
                                         T_total, S_total, block_q, block_k, tile_path,
                                         _pure_because(softcap))  # fmt: skip
    B, H, T, D = query.shape
    G, S, Dv = key.shape[1], key.shape[2], value.shape[3]
    R = H // G
    cd = _compute_dtype(query.dtype)
    # A row that saw nothing has lse = -inf; +inf makes its probabilities exp(s - inf) = 0.
    lse_use = lse.to(cd).masked_fill(lse == _NEG_INF, float("inf"))  # (B, H, T)
    # BLAS needs real strides (the gradient of .sum() is an expanded, stride-0 tensor).
    grad_out = grad_out.contiguous()
    delta = None  # fused: the op computes rowsum(dout * out) itself
    if path == "pure" or bias_params:
        delta = (grad_out.to(cd) * out.to(cd)).sum(dim=-1)  # (B, H, T)
    if path == "fused":
        out = out.to(query.dtype)
    if whole is not None and not bias_params:
        return (*_tile_backward(path, query, key, value, grad_out, out, lse_use, None, whole,
                                scale, 0), [])  # fmt: skip
    dparams = [torch.zeros_like(p) for p in bias_params]
    bias_lock = threading.Lock()

    def bias_grad(ds: torch.Tensor, tile: _Tile, h0: int) -> None:
        """Route a tile's dL/d(bias) ``(B, Hs, tq, tk)`` to the tensors it came from."""
        assert tile.blk is not None and tile.blk.bias is not None
        with torch.enable_grad():
            bias = _heads(tile.blk.bias, h0, h0 + ds.shape[1])  # (b, h, tq, tk), in the graph
        dims = [d for d in range(4) if bias.shape[d] == 1 and ds.shape[d] != 1]
        g = ds.sum(dim=dims, keepdim=True) if dims else ds
        with bias_lock:
            grads = torch.autograd.grad(bias, bias_params, g.to(bias.dtype),
                                        retain_graph=True, allow_unused=True)  # fmt: skip
            for acc, gi in zip(dparams, grads, strict=True):
                if gi is not None:
                    acc.add_(gi)

    dq = torch.zeros(B, H, T, D, dtype=cd, device=query.device)
    dk = torch.zeros(B, G, S, D, dtype=cd, device=query.device)
    dv = torch.zeros(B, G, S, Dv, dtype=cd, device=query.device)

    def work(g0: int, g1: int) -> None:
        h0, h1 = g0 * R, g1 * R
        k, v = key[:, g0:g1], value[:, g0:g1]
        ws = _Scratch()  # this worker's
        for rb in plan:
            rows = slice(rb.r0, rb.r1)
            q, do, o = query[:, h0:h1, rows], grad_out[:, h0:h1, rows], out[:, h0:h1, rows]
            l_b = lse_use[:, h0:h1, rows]
            d_b = None if delta is None else delta[:, h0:h1, rows]
            dq_b = dq[:, h0:h1, rows]
            fused_shift: _Tile | None = None  # the shifted tile run fused (bias gradients)
            rowsum = torch.zeros_like(l_b) if bias_params and path == "fused" else None

            def routed(ds: torch.Tensor, tile: _Tile, h0: int, rowsum=rowsum) -> None:
                bias_grad(ds, tile, h0)
                if rowsum is not None:
                    rowsum.add_(ds.sum(dim=-1))

            for lazy in rb.tiles:
                with torch.set_grad_enabled(bool(bias_params)):  # the bias in its graph
                    tile = _resolve(lazy, rb, geo)
                t_path = path
                if bias_params and path == "fused" and tile.blk is not None:
                    if tile.kind == "shifted" and fused_shift is None:
                        fused_shift = tile
                    elif tile.blk.bias is not None:
                        t_path = "pure"
                cols = slice(tile.c0, tile.c1)
                dq_t, dk_t, dv_t = _tile_backward(
                    t_path, q, k[:, :, cols], v[:, :, cols], do, o, l_b, d_b, tile, scale, h0,
                    softcap, routed if bias_params and t_path == "pure" else None, ws,
                )  # fmt: skip
                dq_b.add_(dq_t)
                dk[:, g0:g1, cols].add_(dk_t)
                dv[:, g0:g1, cols].add_(dv_t)
            if fused_shift is not None:
                assert rowsum is not None and d_b is not None
                far = rowsum.neg_()  # (B, Hs, tq): dS summed over the shifted tile
                if sink_share is not None:
                    far.add_(d_b * sink_share[:, h0:h1, rows])
                bias_grad(far.unsqueeze(-1), fused_shift, h0)

    _run_groups(G, work)
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
    grads = _backward(query, key, value, grad_out, out, lse, mask, scale, q_offset=q_offset,
                      k_offset=k_offset, T_total=T_total, S_total=S_total, block_q=block_q,
                      block_k=block_k, tile_path=tile_path, softcap=softcap)  # fmt: skip
    cd = _compute_dtype(query.dtype)
    return grads[0].to(cd), grads[1].to(cd), grads[2].to(cd)


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
    safe = lse.masked_fill(lse == _NEG_INF, 0.0)
    wa = torch.exp(lse_a - safe).unsqueeze(-1)  # exp(-inf) = 0 for an empty side
    wb = torch.exp(lse_b - safe).unsqueeze(-1)
    if not inplace:
        return out_a * wa + out_b * wb, lse
    out_a.mul_(wa).add_(out_b.mul_(wb))
    lse_a.copy_(lse)
    return out_a, lse_a


class _BlockwiseAttention(torch.autograd.Function):
    """Blockwise forward; backward recomputes tiles from the saved log-sum-exp.

    Attention sinks join at the end, in log-sum-exp form: ``lse' = logaddexp(lse, sink)``
    and ``out' = out * exp(lse - lse')``. The tile backward with ``out'`` and ``lse'`` is
    then exactly the gradient of the softmax with the sink column (whose value is 0), and
    ``d sink = -sum over rows of exp(sink - lse') * rowsum(dout * out')``.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: AttentionMask | None,
        scale: float,
        block_q: int | None,
        block_k: int | None,
        tile_path: TilePath | None,
        softcap: float | None,
        sinks: torch.Tensor | None,
        *bias_params: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Decide the path now: the backward runs outside any force_tile_path block. (Bias
        # gradients take pure tiles in the backward where they need dS: see _backward.)
        path = _choose_path(query, key, value, tile_path, _pure_because(softcap))
        out, lse = _forward(query, key, value, mask, scale, q_offset=0, k_offset=0,
                            T_total=None, S_total=None, block_q=block_q, block_k=block_k,
                            tile_path=path, softcap=softcap)  # fmt: skip
        if sinks is not None:
            cd = _compute_dtype(query.dtype)
            lse = lse.to(cd)
            with_sinks = add_sinks(lse, sinks.to(cd))  # (B, H, T)
            out = out.to(cd) * torch.exp(lse - with_sinks).unsqueeze(-1)  # 0 where lse = -inf
            lse = with_sinks
        out = out.to(query.dtype)
        ctx.save_for_backward(query, key, value, out, lse, sinks, *bias_params)
        ctx.mask, ctx.scale, ctx.blocks, ctx.path = mask, scale, (block_q, block_k), path
        ctx.softcap = softcap
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor, grad_lse: torch.Tensor | None):  # type: ignore[override]
        query, key, value, out, lse, sinks, *bias_params = ctx.saved_tensors
        cd = _compute_dtype(query.dtype)
        share = None  # the sink's weight in each row's softmax, (B, H, T)
        if sinks is not None:
            share = torch.exp(sinks.to(cd)[None, :, None] - lse.to(cd))
        dq, dk, dv, dparams = _backward(
            query, key, value, grad_out, out, lse, ctx.mask, ctx.scale,
            q_offset=0, k_offset=0, T_total=None, S_total=None, block_q=ctx.blocks[0],
            block_k=ctx.blocks[1], tile_path=ctx.path, softcap=ctx.softcap,
            bias_params=tuple(bias_params), sink_share=share,
        )  # fmt: skip
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[9]:
            assert share is not None
            delta = (grad_out.to(cd) * out.to(cd)).sum(dim=-1)  # (B, H, T)
            dsinks = -(share * delta).sum(dim=(0, 2)).to(sinks.dtype)  # (H,)
        return (
            dq.to(query.dtype),
            dk.to(key.dtype),
            dv.to(value.dtype),
            None,
            None,
            None,
            None,
            None,
            None,
            dsinks,
            *(g.to(p.dtype) for g, p in zip(dparams, bias_params, strict=True)),
        )


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

    Shape:
        - query ``(B, H, T, D)``, key ``(B, G, S, D)``, value ``(B, G, S, Dv)``
        - output ``(B, H, T, Dv)``, lse ``(B, H, T)`` (with sinks: including them)
    """
    if dropout_p > 0:
        raise ValueError(_why_not_dropout(dropout_p))
    grad_on = torch.is_grad_enabled()
    bias_params = mask.grad_tensors() if (mask is not None and grad_on) else ()
    out, lse = _BlockwiseAttention.apply(
        query, key, value, mask, scale, block_q, block_k, tile_path, softcap, sinks,
        *bias_params,
    )  # fmt: skip
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
