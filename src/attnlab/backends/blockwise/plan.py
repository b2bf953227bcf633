"""The plan of a blockwise call: row blocks, their key tiles, and what masks each tile.

Shape legend: B batch, H query heads, T query length, S key length; tq/tk the rows/keys
of one tile.

A tile is ``"full"`` (nothing masked), ``"causal"`` (a square on the diagonal of a causal
mask, top-left aligned within the tile), ``"partial"`` (the mask's :class:`MaskBlock` for
the tile) or ``"shifted"`` (unmasked, with a bias that is one number per head over the
tile); tiles the mask removes entirely are not planned.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Literal

import torch

from attnlab.backends.blockwise.paths import TilePath
from attnlab.masks import AndMask, AttentionMask, CausalMask, ChunkedMask, MaskBlock

TileKind = Literal["full", "causal", "partial", "shifted"]

# Pure tiles: about 2**20 scores (4 MiB fp32) per tile and 256 keys, the best sizes for
# B*H = 12, D = 64 (benchmarks/bench_attention.py --targets).
_TILE_ELEMENTS = 1 << 20
_BLOCK_K = 256
# Fused tiles under a mask other than plain causal: 256 x 256 skips a window's masked edges
# and still runs the op's own blocking well (benchmarks/bench_attention.py --targets).
_FUSED_BLOCK_Q = 256
_FUSED_BLOCK_K = 256
# Rows that see a narrow band of keys (a window) take 128-row blocks, so diagonal and edge
# tiles are less of a block's work; wide rows are slower so (bench_attention.py --targets).
_NARROW_BLOCK_Q = 128
_NARROW_KEYS = 1024  # a row block of 256 rows seeing at most this many keys is narrow


@dataclass(frozen=True)
class ChunkOptions:
    """Where a chunk sits in the full problem and how its tiles are cut: the settings that
    travel together from :func:`~attnlab.backends.blockwise.attend_chunk` to every tile.

    Attributes:
        q_offset, k_offset: absolute position of the chunk's first row/column.
        T_total, S_total: size of the full problem the mask is defined on (None: the
            chunk's own length).
        block_q, block_k: tile size (None: per path, see :func:`block_sizes`).
        tile_path: ``"fused"``, ``"pure"`` or None (the process's choice).
        softcap: logit soft-cap of the scaled scores (pure tiles), or None.
    """

    q_offset: int = 0
    k_offset: int = 0
    T_total: int | None = None
    S_total: int | None = None
    block_q: int | None = None
    block_k: int | None = None
    tile_path: TilePath | None = None
    softcap: float | None = None


@dataclass(frozen=True)
class Tile:
    """Keys ``c0:c1`` (local to the chunk) of one row block, and what masks them.

    A biased tile's ``blk`` is not kept in the plan (every tile of a bias is partial: all
    of them would hold H x T x S numbers); :func:`resolve` computes it when the tile runs.
    """

    c0: int
    c1: int
    kind: TileKind
    blk: MaskBlock | None = None

    @property
    def lazy(self) -> bool:
        """Whether the tile's MaskBlock is computed when it runs (a biased tile)."""
        return self.blk is None and self.kind in ("partial", "shifted")


@dataclass(frozen=True)
class RowBlock:
    """Rows ``r0:r1`` (local) and their non-empty tiles, left to right."""

    r0: int
    r1: int
    tiles: tuple[Tile, ...]


@dataclass(frozen=True)
class Geometry:
    """Where a chunk sits in the full problem the mask is defined on.

    ``diagonal``: the key of query 0 under the mask's causal-style part when tiles are cut
    at each row block's diagonal (so that the square on it can run as a causal tile), else
    None.
    """

    mask: AttentionMask | None
    q_offset: int
    k_offset: int
    T_total: int
    S_total: int
    device: torch.device
    diagonal: int | None = None

    def diagonal_keys(self, rb: RowBlock) -> tuple[int, int]:
        """Local keys ``(d0, d1)`` of the square on ``rb``'s diagonal (``(-1, -1)``: none)."""
        if self.diagonal is None:
            return -1, -1
        d0 = self.q_offset + rb.r0 + self.diagonal - self.k_offset
        return d0, d0 + rb.r1 - rb.r0

    def rows_cols(self, rb: RowBlock, c0: int, c1: int) -> tuple[slice, slice]:
        """Absolute rows of ``rb`` and keys ``c0:c1`` in the full problem."""
        rows = slice(self.q_offset + rb.r0, self.q_offset + rb.r1)
        return rows, slice(self.k_offset + c0, self.k_offset + c1)


def default_blocks(BH: int, T: int, S: int) -> tuple[int, int]:
    """Query rows and keys per *pure* tile for ``BH = B * H`` query heads in the batch.

    Keys per tile are fixed (256); rows per tile are the power of two (64 to 4096)
    that keeps a tile near ``_TILE_ELEMENTS`` elements.
    """
    block_k = max(1, min(S, _BLOCK_K))
    rows = _TILE_ELEMENTS // max(1, BH * _BLOCK_K)
    block_q = 1 << max(6, min(12, rows.bit_length() - 1))
    return max(1, min(T, block_q)), block_k


def block_sizes(
    path: TilePath, mask: AttentionMask | None, BH: int, T: int, S: int, opts: ChunkOptions
) -> tuple[int, int, bool]:
    """``(rows, keys, coalesce)`` per tile for this path; explicit sizes in ``opts`` are
    kept as given (tests use them to get many tiles of each kind)."""
    block_q, block_k = opts.block_q, opts.block_k
    if path == "pure":
        bq, bk = default_blocks(BH, T, S)
        return block_q or bq, block_k or bk, False
    if mask is None or isinstance(mask, CausalMask):
        # The op blocks the whole problem itself (and skips above its causal diagonal).
        return block_q or max(1, T), block_k or max(1, S), block_k is None
    bq = _FUSED_BLOCK_Q
    T_total = T if opts.T_total is None else opts.T_total
    S_total = S if opts.S_total is None else opts.S_total
    if isinstance(mask, ChunkedMask) and mask.offset(T_total, S_total) % mask.chunk == 0:
        # One row block per chunk: its keys are one square on the diagonal, one causal op call
        return block_q or mask.chunk, block_k or mask.chunk, block_k is None
    if not mask.has_bias:  # biased tiles run slower in narrow blocks (--variants)
        mid = max(0, T_total // 2 - _FUSED_BLOCK_Q // 2)
        lo, hi = mask.col_range(T_total, S_total, mid, min(T_total, mid + _FUSED_BLOCK_Q))
        bq = _NARROW_BLOCK_Q if hi - lo <= _NARROW_KEYS else bq
    return block_q or bq, block_k or _FUSED_BLOCK_K, block_k is None


def _full_tiles(c0: int, c1: int, bk: int | None) -> list[Tile]:
    """Keys ``c0:c1`` as full tiles of ``bk`` keys (one tile when ``bk`` is None)."""
    if c1 <= c0:
        return []
    step = c1 - c0 if bk is None else bk
    return [Tile(k0, min(c1, k0 + step), "full") for k0 in range(c0, c1, step)]


def plan_tiles(
    geo: Geometry, T: int, S: int, *, bq: int, bk: int, coalesce: bool, causal_tiles: bool
) -> list[RowBlock]:
    """Row blocks of ``bq`` rows and their tiles of ``bk`` keys; rows in no block (or in a
    block without tiles) may attend to nothing.

    ``coalesce`` joins each run of adjacent full tiles into one tile. ``causal_tiles``
    plans a plain causal mask as full tiles left of the diagonal and one ``"causal"``
    square on it (top-left aligned, as the op's ``is_causal``) per row block; other masks
    are then cut at ``geo.diagonal``.
    """
    mask, T_total, S_total = geo.mask, geo.T_total, geo.S_total
    blocks: list[RowBlock] = []
    if mask is None:
        for r0 in range(0, T, bq):
            tiles = _full_tiles(0, S, None if coalesce else bk)
            blocks.append(RowBlock(r0, min(T, r0 + bq), tuple(tiles)))
        return blocks
    if causal_tiles and isinstance(mask, CausalMask):
        # Local row i may see local keys j <= i + d.
        d = geo.q_offset + mask.offset(T_total, S_total) - geo.k_offset
        for r0 in range(max(0, -d), T, bq):  # rows before -d see nothing
            r1 = min(T, r0 + bq)
            c_end = min(S, r1 + d)  # the block's last row sees keys < c_end
            # Keys every row of the block sees (all of them for one row, e.g. decoding).
            c_diag = c_end if r1 - r0 == 1 else min(S, r0 + d)
            tiles = _full_tiles(0, c_diag, None if coalesce else bk)
            if c_end > c_diag:
                tiles.append(Tile(c_diag, c_end, "causal"))
            blocks.append(RowBlock(r0, r1, tuple(tiles)))
        return blocks
    for r0 in range(0, T, bq):
        r1 = min(T, r0 + bq)
        lo, hi = mask.col_range(T_total, S_total, geo.q_offset + r0, geo.q_offset + r1)
        lo, hi = min(max(lo - geo.k_offset, 0), S), min(max(hi - geo.k_offset, 0), S)
        cuts = set(range(lo, hi, bk)) | {hi}
        d0, d1 = geo.diagonal_keys(RowBlock(r0, r1, ()))
        if geo.diagonal is not None:
            cuts = {c for c in range(d0, lo, -bk)} | {c for c in range(d1, hi, bk)}
            cuts = {c for c in cuts if lo < c < hi} | {lo, hi}
        edges = sorted(cuts)
        tiles = []
        run = -1  # start of the current run of full tiles, or -1
        shifted: tuple[int, torch.Tensor] | None = None  # start and constant of a shifted run
        for k0, k1 in itertools.pairwise(edges):
            rows = slice(geo.q_offset + r0, geo.q_offset + r1)
            cols = slice(geo.k_offset + k0, geo.k_offset + k1)
            status = mask.block_status(T_total, S_total, rows, cols)
            blk = None
            if status == "partial" and not mask.has_bias:  # small: keep it in the plan
                blk = mask.block(T_total, S_total, rows, cols, device=geo.device)
                status = blk.status
            shift = None
            if status == "partial" and mask.has_bias:
                shift = mask.constant_bias(T_total, S_total, rows, cols, device=geo.device)
            if shift is not None:  # a shifted tile: joins a run of the same constant
                if run >= 0:
                    tiles.append(Tile(run, k0, "full"))
                    run = -1
                if shifted is not None and coalesce and torch.equal(shift, shifted[1]):
                    continue
                if shifted is not None:
                    tiles.append(Tile(shifted[0], k0, "shifted"))
                shifted = (k0, shift)
                continue
            if shifted is not None:
                tiles.append(Tile(shifted[0], k0, "shifted"))
                shifted = None
            if status == "full" and coalesce:
                run = k0 if run < 0 else run
                continue
            if run >= 0:
                tiles.append(Tile(run, k0, "full"))
                run = -1
            if status == "full":
                tiles.append(Tile(k0, k1, "full"))
            elif status == "partial" and blk is None:  # a biased tile is computed when it runs
                tiles.append(Tile(k0, k1, "partial"))
            elif status == "partial":
                assert blk is not None
                causal = (k0, k1) == (d0, d1) and is_causal_square(blk)
                tiles.append(Tile(k0, k1, "causal") if causal else Tile(k0, k1, "partial", blk))
        if run >= 0:
            tiles.append(Tile(run, hi, "full"))
        if shifted is not None:
            tiles.append(Tile(shifted[0], hi, "shifted"))
        if tiles:
            blocks.append(RowBlock(r0, r1, tuple(tiles)))
    return blocks


def diagonal_offset(mask: AttentionMask, T: int, S: int) -> int | None:
    """Key position of query 0 under the mask's causal-style part (a mask with an
    ``offset(T, S)``, e.g. causal or sliding window), or None when it has none."""
    for part in mask.parts if isinstance(mask, AndMask) else (mask,):
        offset = getattr(part, "offset", None)
        if callable(offset):
            return int(offset(T, S))
    return None


def is_causal_square(blk: MaskBlock) -> bool:
    """Whether a square tile's mask is exactly the top-left causal triangle (no bias)."""
    if blk.bias is not None or blk.allowed is None:
        return False
    allowed = blk.allowed
    n = allowed.shape[-1]
    if allowed.shape[-2] != n:
        return False
    # torch.equal compares the bytes in one pass; `(allowed == tril).all()` would first
    # build a whole boolean tile and then reduce it
    tril = _tril(n, allowed.device).expand_as(allowed)
    return allowed.dtype == torch.bool and torch.equal(allowed, tril)


@functools.lru_cache(maxsize=8)
def _tril(n: int, device: torch.device) -> torch.Tensor:
    """The ``(n, n)`` causal triangle, kept for comparisons only (never handed out)."""
    return torch.ones(n, n, dtype=torch.bool, device=device).tril_()


def resolve(tile: Tile, rb: RowBlock, geo: Geometry) -> Tile:
    """The tile with its MaskBlock (computed now for a lazy, biased tile).

    A shifted tile gets its per-head constant as ``blk.bias``. A biased tile that is the
    square on the row block's diagonal, with exactly the causal triangle as the rest of
    its mask, runs as a ``"causal"`` tile carrying the bias (the half above is skipped).
    """
    if not tile.lazy:
        return tile
    assert geo.mask is not None
    rows, cols = geo.rows_cols(rb, tile.c0, tile.c1)
    if tile.kind == "shifted":
        shift = geo.mask.constant_bias(geo.T_total, geo.S_total, rows, cols, device=geo.device)
        assert shift is not None, "the plan found this tile's bias constant"
        return Tile(tile.c0, tile.c1, "shifted", MaskBlock("partial", bias=shift))
    blk = geo.mask.block(geo.T_total, geo.S_total, rows, cols, device=geo.device)
    if blk.status != "partial":  # block_status was conservative: nothing to see here
        shape = (1, 1, rb.r1 - rb.r0, tile.c1 - tile.c0)
        blk = MaskBlock("partial", allowed=torch.zeros(shape, dtype=torch.bool, device=geo.device))
    if (
        (tile.c0, tile.c1) == geo.diagonal_keys(rb)
        and blk.bias is not None
        and is_causal_square(MaskBlock("partial", blk.allowed))
    ):
        return Tile(tile.c0, tile.c1, "causal", MaskBlock("partial", bias=blk.bias))
    return Tile(tile.c0, tile.c1, "partial", blk)
