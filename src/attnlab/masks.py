"""One mask type for every backend.

Shape legend: B batch, H query heads, T query length, S key length.

**Boolean semantics: True = may attend**, everywhere in attnlab. A mask describes which
query positions (rows, ``0..T-1``) may look at which key positions (columns, ``0..S-1``)
and, for :class:`AdditiveMask`, a float bias added to the scaled scores.

A mask knows its *structure*. Backends never need the dense ``(B, H, T, S)`` tensor:

* :meth:`AttentionMask.block` answers for one tile ``rows q0:q1`` x ``cols k0:k1``
  whether it is ``"empty"`` (nothing may attend; skip the tile), ``"full"`` (everything
  may attend and there is no bias; no masking work) or ``"partial"`` (here are the
  boolean ``allowed`` and/or float ``bias`` tensors for the tile, broadcastable to
  ``(B, H, q1-q0, k1-k0)``).
* :meth:`AttentionMask.dense` materialises the mask (or any rows/columns of it) on demand.
* :class:`CausalMask` is recognisable as such, so a backend can use PyTorch's ``is_causal``.

When ``T != S`` (decoding with a KV cache), causal masks align the *last* query with the
*last* key (``alignment="bottom_right"``, the default): query ``i`` sits at absolute
position ``i + S - T``. ``alignment="top_left"`` aligns the first query with the first key
(PyTorch's ``is_causal`` convention).

Masks combine with ``&`` (both must allow; additive biases add up). A query row that may
attend to nothing gets output 0 and weights 0 on every backend.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = [
    "AdditiveMask",
    "AndMask",
    "AttentionMask",
    "BlockStatus",
    "BooleanMask",
    "CausalMask",
    "ChunkedMask",
    "DocumentMask",
    "Index",
    "MaskBlock",
    "PaddingMask",
    "SlidingWindowMask",
    "as_mask",
]

BlockStatus = Literal["empty", "full", "partial"]
Alignment = Literal["bottom_right", "top_left"]
# Rows or columns of a mask: a slice of positions, or a 1-D long tensor of positions.
Index = slice | torch.Tensor | None


@dataclass(frozen=True)
class MaskBlock:
    """What a mask says about one tile of the ``(T, S)`` score matrix.

    Attributes:
        status: ``"empty"`` (no query may attend to any key of the tile), ``"full"``
            (all may, no bias) or ``"partial"``.
        allowed: bool tensor broadcastable to ``(B, H, rows, cols)``, True = may attend,
            or None when the tile has no boolean restriction.
        bias: float tensor broadcastable to ``(B, H, rows, cols)`` to add to the scaled
            scores, or None.
    """

    status: BlockStatus
    allowed: torch.Tensor | None = None
    bias: torch.Tensor | None = None


_FULL = MaskBlock("full")
_EMPTY = MaskBlock("empty")


def _positions(index: Index, n: int, device: torch.device | str | None) -> torch.Tensor:
    """Absolute positions selected by ``index`` among ``0..n-1`` as a 1-D long tensor."""
    if index is None:
        return torch.arange(n, device=device)
    if isinstance(index, slice):
        start, stop, step = index.indices(n)
        return torch.arange(start, stop, step, device=device)
    return index.to(device=device, dtype=torch.long)


def _span(index: Index, n: int) -> tuple[int, int] | None:
    """``(start, stop)`` of a contiguous step-1 slice, else None."""
    if index is None:
        return 0, n
    if isinstance(index, slice):
        start, stop, step = index.indices(n)
        return (start, stop) if step == 1 else None
    return None


@functools.lru_cache(maxsize=32)
def _band(
    d0: int, tq: int, tk: int, lo: int, hi: int | None, device: torch.device | str | None
) -> torch.Tensor:
    """``(1, 1, tq, tk)`` bool: row i may see key j when ``lo <= d0 + i - j <= hi`` (no
    upper bound for ``hi=None``), ``d0`` the first row's position minus the first key's.
    Causal and sliding-window tiles of a contiguous span depend on nothing else, so the
    tiles along a diagonal are one tensor (kept; callers must not write to it)."""
    d = torch.arange(d0, d0 + tq, device=device)[:, None] - torch.arange(tk, device=device)
    allowed = d >= lo
    if hi is not None:
        allowed &= d <= hi
    return allowed[None, None]


def _select(t: torch.Tensor, dim: int, index: Index) -> torch.Tensor:
    """Index one dim of a (possibly broadcast, size-1) mask tensor."""
    if index is None or t.shape[dim] == 1:
        return t
    if isinstance(index, slice):
        return t[(slice(None),) * (dim % t.ndim) + (index,)]
    return t.index_select(dim, index.to(device=t.device, dtype=torch.long))


def _as4d(t: torch.Tensor) -> torch.Tensor:
    while t.ndim < 4:
        t = t.unsqueeze(0)
    return t


def _check_broadcast(name: str, shape: tuple[int, ...], B: int, H: int, T: int, S: int) -> None:
    target = (B, H, T, S)
    padded = (1,) * (4 - len(shape)) + tuple(shape)
    if len(shape) > 4 or any(d not in (1, t) for d, t in zip(padded, target, strict=True)):
        raise ValueError(
            f"`{name}` must broadcast to (B, H, T, S) = {target}, got shape {tuple(shape)}; "
            "use size 1 for dimensions the mask does not depend on, e.g. (B, 1, 1, S) "
            "for key padding or (T, S) for a per-position mask"
        )


class AttentionMask:
    """Base class of attnlab's masks. True = may attend.

    Subclasses implement :meth:`block` (and :meth:`validate` when they hold tensors).
    """

    #: Short name of the mask's structure, used in dispatch explanations.
    kind: str = "mask"

    def validate(self, B: int, H: int, T: int, S: int) -> None:
        """Raise ``ValueError`` unless the mask fits query length T and key length S."""

    def block(
        self,
        T: int,
        S: int,
        rows: Index = None,
        cols: Index = None,
        *,
        device: torch.device | str | None = None,
    ) -> MaskBlock:
        """The mask restricted to ``rows`` x ``cols`` of the ``(T, S)`` score matrix.

        Args:
            T: query length.
            S: key length.
            rows: query positions (a slice or 1-D long tensor; None = all).
            cols: key positions (a slice or 1-D long tensor; None = all).
            device: device for tensors the mask has to create.

        Returns:
            A :class:`MaskBlock` whose tensors broadcast to ``(B, H, len(rows), len(cols))``.
        """
        raise NotImplementedError

    def block_status(self, T: int, S: int, rows: Index = None, cols: Index = None) -> BlockStatus:
        """Only the status of :meth:`block`'s tile, computed without building the tile's
        tensors where the mask can tell cheaply (a bias: always ``"partial"``). It may say
        ``"partial"`` for a tile :meth:`block` finds empty, never the reverse."""
        return self.block(T, S, rows, cols).status

    def constant_bias(
        self, T: int, S: int, rows: Index, cols: Index, *, device: torch.device | str | None = None
    ) -> torch.Tensor | None:
        """The tile's bias as ``(1, H, 1, 1)`` when it is one number per head over the whole
        tile and nothing in the tile is masked, else None (the default: unknown).

        Such a tile needs no dense bias: a constant added to every score leaves the
        softmax within the tile unchanged and only shifts its log-sum-exp, so a tiling
        backend computes it as an unmasked tile (T5's relative bias is constant beyond
        ``max_distance``). The result is computed from the mask's tensors, so gradients
        flow through it.
        """
        return None

    def col_range(self, T: int, S: int, q0: int, q1: int) -> tuple[int, int]:
        """Columns ``[lo, hi)`` outside which rows ``q0:q1`` may attend to nothing.

        Backends loop over keys only in this range (e.g. up to the causal diagonal), so
        a tile crossing the diagonal is trimmed instead of computed whole.
        """
        return 0, S

    def key_band(self, T: int, S: int) -> tuple[int | None, int] | None:
        """The keys of every query as one diagonal band, when the mask is exactly that.

        ``(first, last)`` means query t (0-based) sees exactly the keys ``t + first ..
        t + last`` that lie in ``0..S-1`` (``first`` None: from key 0 on, as causal); None
        when the mask is not such a band (a bias, documents, padding, chunks). A backend
        may then cut the band into equal blocks (the blockwise backend's sliding window).
        """
        return None

    @property
    def is_causal_only(self) -> bool:
        """True when the mask is exactly a causal mask (no other restriction)."""
        return False

    @property
    def has_bias(self) -> bool:
        """True when the mask carries an additive float bias."""
        return False

    @property
    def bias_requires_grad(self) -> bool:
        """True when the additive bias depends on a tensor that needs gradients."""
        return bool(self.grad_tensors())

    def grad_tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors requiring gradients that :meth:`block`'s bias is computed from
        (an additive mask, a relative-position table, ALiBi slopes), for backends that
        recompute tiles and must route the bias gradient to them."""
        return ()

    def may_empty_rows(self, T: int, S: int) -> bool:
        """Whether some query row may attend to nothing (conservative: True if unsure)."""
        return True

    def dense(
        self,
        T: int,
        S: int,
        rows: Index = None,
        cols: Index = None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """Materialise the mask (or some rows/columns of it).

        Returns a bool tensor (True = may attend) when the mask has no bias, else a float
        tensor of ``dtype`` (default float32) holding the bias with ``-inf`` where
        attending is not allowed. The result broadcasts to ``(B, H, rows, cols)``.
        """
        r = _positions(rows, T, "cpu").numel() if rows is not None else T
        c = _positions(cols, S, "cpu").numel() if cols is not None else S
        blk = self.block(T, S, rows, cols, device=device)
        if not self.has_bias:
            if blk.status == "empty":
                return torch.zeros(1, 1, r, c, dtype=torch.bool, device=device)
            if blk.allowed is None:
                return torch.ones(1, 1, r, c, dtype=torch.bool, device=device)
            return _as4d(blk.allowed).expand(*_as4d(blk.allowed).shape[:2], r, c)
        ftype = dtype or torch.float32
        out = torch.zeros(1, 1, r, c, dtype=ftype, device=device)
        if blk.status == "empty":
            return out.fill_(float("-inf"))
        if blk.bias is not None:
            out = out + _as4d(blk.bias).to(ftype)
        if blk.allowed is not None:
            out = out.masked_fill(~_as4d(blk.allowed), float("-inf"))
        return out

    def __and__(self, other: AttentionMask) -> AttentionMask:
        if not isinstance(other, AttentionMask):
            return NotImplemented
        left = self.parts if isinstance(self, AndMask) else (self,)
        right = other.parts if isinstance(other, AndMask) else (other,)
        return AndMask(*left, *right)


class _BandMask(AttentionMask):
    """A mask that allows query position p to see key j when ``lo <= p - j <= hi``
    (``hi`` None: no upper bound): causal and sliding-window masks. Subclasses give
    :meth:`offset` and :meth:`_limits`; the tiles, their status and their tensors follow."""

    def offset(self, T: int, S: int) -> int:
        raise NotImplementedError

    def _limits(self) -> tuple[int, int | None]:
        raise NotImplementedError

    def key_band(self, T: int, S: int) -> tuple[int | None, int] | None:
        lo, hi = self._limits()  # lo <= (t + offset) - key <= hi
        off = self.offset(T, S)
        return (None if hi is None else off - hi), off - lo

    def _span_block(self, T: int, S: int, rows: Index, cols: Index) -> MaskBlock | None:
        """The tile's block without tensors when it is empty or full, else None."""
        rs, cs = _span(rows, T), _span(cols, S)
        if rs is None or cs is None:
            return None
        (q0, q1), (k0, k1) = rs, cs
        if q1 <= q0 or k1 <= k0:
            return _EMPTY
        lo, hi = self._limits()
        off = self.offset(T, S)
        d_min, d_max = q0 + off - (k1 - 1), q1 - 1 + off - k0  # query - key over the tile
        if d_max < lo or (hi is not None and d_min > hi):
            return _EMPTY
        if d_min >= lo and (hi is None or d_max <= hi):
            return _FULL
        return None

    def block_status(self, T, S, rows=None, cols=None):
        known = self._span_block(T, S, rows, cols)
        return "partial" if known is None else known.status

    def block(self, T, S, rows=None, cols=None, *, device=None):
        known = self._span_block(T, S, rows, cols)
        if known is not None:
            return known
        lo, hi = self._limits()
        off = self.offset(T, S)
        rs, cs = _span(rows, T), _span(cols, S)
        if rs is not None and cs is not None:
            (q0, q1), (k0, k1) = rs, cs
            band = _band(q0 + off - k0, q1 - q0, k1 - k0, lo, hi, device)
            return MaskBlock("partial", allowed=band)
        d = (_positions(rows, T, device) + off)[:, None] - _positions(cols, S, device)[None, :]
        allowed = d >= lo
        if hi is not None:
            allowed &= d <= hi
        return MaskBlock("partial", allowed=allowed[None, None])


@dataclass(frozen=True, eq=False)
class CausalMask(_BandMask):
    """Causal mask: query i may attend to key j when j is not in its future.

    Args:
        alignment: ``"bottom_right"`` (default; the last query lines up with the last key,
            as when decoding with a cache: query i is at position ``i + S - T``) or
            ``"top_left"`` (query i is at position i; PyTorch's ``is_causal``).
    """

    alignment: Alignment = "bottom_right"
    kind = "causal"

    def __post_init__(self) -> None:
        if self.alignment not in ("bottom_right", "top_left"):
            raise ValueError(
                f"`alignment` must be 'bottom_right' or 'top_left', got {self.alignment!r}"
            )

    def offset(self, T: int, S: int) -> int:
        """Absolute position of query 0."""
        return S - T if self.alignment == "bottom_right" else 0

    @property
    def is_causal_only(self) -> bool:
        return True

    def col_range(self, T: int, S: int, q0: int, q1: int) -> tuple[int, int]:
        return 0, max(0, min(S, q1 + self.offset(T, S)))

    def may_empty_rows(self, T: int, S: int) -> bool:
        return self.offset(T, S) < 0

    def _limits(self) -> tuple[int, int | None]:
        return 0, None


@dataclass(frozen=True, eq=False)
class SlidingWindowMask(_BandMask):
    """Each query attends only to keys within ``window`` positions of it.

    With ``causal=True`` (default) query at position p attends to keys ``p-window+1 .. p``
    (itself and the ``window-1`` before it, Mistral's convention); with ``causal=False``
    to keys with ``|p - j| < window``. Positions align as in :class:`CausalMask`.

    Args:
        window: window size, >= 1.
        causal: also forbid the future.
        alignment: ``"bottom_right"`` (default) or ``"top_left"``.
    """

    window: int
    causal: bool = True
    alignment: Alignment = "bottom_right"
    kind = "sliding_window"

    def __post_init__(self) -> None:
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"`window` must be an int >= 1, got {self.window!r}")
        if self.alignment not in ("bottom_right", "top_left"):
            raise ValueError(
                f"`alignment` must be 'bottom_right' or 'top_left', got {self.alignment!r}"
            )

    def offset(self, T: int, S: int) -> int:
        return S - T if self.alignment == "bottom_right" else 0

    def col_range(self, T: int, S: int, q0: int, q1: int) -> tuple[int, int]:
        off = self.offset(T, S)
        hi = q1 - 1 + off if self.causal else q1 - 1 + off + self.window - 1
        lo = max(0, q0 + off - self.window + 1)
        return min(lo, S), max(0, min(S, hi + 1))

    def may_empty_rows(self, T: int, S: int) -> bool:
        off = self.offset(T, S)
        # A row is empty when its window lies entirely outside 0..S-1.
        return off < 0 or (T - 1 + off) - self.window + 1 > S - 1

    def _limits(self) -> tuple[int, int | None]:
        return (0 if self.causal else 1 - self.window), self.window - 1


@dataclass(frozen=True, eq=False)
class ChunkedMask(AttentionMask):
    """Chunked local attention (Llama 4): the sequence is cut into chunks of ``chunk``
    positions and a query sees only the keys of its own chunk, causally.

    Query at position p attends to key j when ``j <= p`` and ``j // chunk == p // chunk``.
    Positions align as in :class:`CausalMask` (bottom-right by default, so a KV cache
    that holds every key from position 0 gives the same mask as the full pass). Tiles
    whose rows and columns lie in different chunks are ``"empty"``, so a tiling backend
    costs about ``T * chunk`` instead of ``T**2 / 2``.

    Args:
        chunk: chunk length in positions, >= 1.
        alignment: ``"bottom_right"`` (default) or ``"top_left"``.

    Raises:
        ValueError: ``chunk`` is not an int >= 1, or an unknown ``alignment``.
    """

    chunk: int
    alignment: Alignment = "bottom_right"
    kind = "chunked"

    def __post_init__(self) -> None:
        if isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or self.chunk < 1:
            raise ValueError(f"`chunk` must be an int >= 1, got {self.chunk!r}")
        if self.alignment not in ("bottom_right", "top_left"):
            raise ValueError(
                f"`alignment` must be 'bottom_right' or 'top_left', got {self.alignment!r}"
            )

    def offset(self, T: int, S: int) -> int:
        """Absolute position of query 0."""
        return S - T if self.alignment == "bottom_right" else 0

    def col_range(self, T: int, S: int, q0: int, q1: int) -> tuple[int, int]:
        if q1 <= q0:
            return 0, 0
        off = self.offset(T, S)
        first = max(0, q0 + off)  # rows before key 0 see nothing
        lo = min(S, (first // self.chunk) * self.chunk)
        return lo, max(lo, min(S, q1 + off))

    def may_empty_rows(self, T: int, S: int) -> bool:
        return self.offset(T, S) < 0

    def _span_status(self, T: int, S: int, rows: Index, cols: Index) -> BlockStatus | None:
        """The tile's status from its corners when it is a contiguous span, else None."""
        rs, cs = _span(rows, T), _span(cols, S)
        if rs is None or cs is None:
            return None
        (q0, q1), (k0, k1) = rs, cs
        if q1 <= q0 or k1 <= k0:
            return "empty"
        off, c = self.offset(T, S), self.chunk
        p0, p1 = q0 + off, q1 - 1 + off  # first and last query position
        if p1 < k0 or p1 // c < k0 // c or p0 // c > (k1 - 1) // c:
            return "empty"  # all keys in the future, or the chunks never meet
        if p0 >= k1 - 1 and p0 // c == p1 // c == k0 // c == (k1 - 1) // c:
            return "full"
        return "partial"

    def block_status(self, T, S, rows=None, cols=None):
        return self._span_status(T, S, rows, cols) or "partial"

    def block(self, T, S, rows=None, cols=None, *, device=None):
        status = self._span_status(T, S, rows, cols)
        if status == "empty":
            return _EMPTY
        if status == "full":
            return _FULL
        p = _positions(rows, T, device) + self.offset(T, S)  # (rows,)
        j = _positions(cols, S, device)  # (cols,)
        allowed = j[None, :] <= p[:, None]
        span = _span(rows, T), _span(cols, S)
        c = self.chunk
        one_chunk = (
            span[0] is not None
            and span[1] is not None
            and (p[0] >= 0)
            and int(p[0]) // c == int(p[-1]) // c == int(j[0]) // c == int(j[-1]) // c
        )
        if one_chunk:  # a tile inside one chunk is its causal part only: cheaper
            if int(p[-1]) < int(j[0]):
                return _EMPTY
            return MaskBlock("partial", allowed=allowed[None, None])
        # floor division keeps negative positions (rows before key 0) out of every chunk
        allowed &= (
            torch.div(j, c, rounding_mode="floor")[None, :]
            == torch.div(p, c, rounding_mode="floor")[:, None]
        )
        if not bool(allowed.any()):
            return _EMPTY
        return MaskBlock("partial", allowed=allowed[None, None])


class PaddingMask(AttentionMask):
    """Key padding: keys marked False in ``valid`` are never attended to.

    Args:
        valid: bool tensor ``(B, S)``, True = a real token (may be attended to).

    Raises:
        TypeError: ``valid`` is not a bool tensor.
        ValueError: ``valid`` is not 2-D.
    """

    kind = "padding"

    def __init__(self, valid: torch.Tensor) -> None:
        if not isinstance(valid, torch.Tensor):
            raise TypeError(f"`valid` must be a bool torch.Tensor, got {type(valid).__name__}")
        if valid.dtype != torch.bool:
            raise TypeError(
                f"`valid` must be a bool tensor (True = real token), got dtype {valid.dtype}; "
                "use `lengths` with PaddingMask.from_lengths, or `valid.bool()`"
            )
        if valid.ndim != 2:
            raise ValueError(f"`valid` must be 2-D (B, S), got shape {tuple(valid.shape)}")
        self.valid = valid

    @classmethod
    def from_lengths(
        cls, lengths: torch.Tensor | list[int], S: int, *, device: torch.device | str | None = None
    ) -> PaddingMask:
        """Padding mask where batch item b has ``lengths[b]`` real tokens, then padding.

        Args:
            lengths: number of real tokens per batch item, ``(B,)``.
            S: key length (padded).
            device: device of the mask.
        """
        lens = torch.as_tensor(lengths, device=device)
        if lens.ndim != 1 or lens.is_floating_point():
            raise ValueError(f"`lengths` must be a 1-D integer sequence (B,), got {lengths!r}")
        if bool((lens < 0).any()) or bool((lens > S).any()):
            raise ValueError(f"`lengths` must lie in 0..S={S}, got {lens.tolist()}")
        return cls(torch.arange(S, device=lens.device)[None, :] < lens[:, None])

    def validate(self, B: int, H: int, T: int, S: int) -> None:
        if self.valid.shape[0] not in (1, B) or self.valid.shape[1] != S:
            raise ValueError(
                f"PaddingMask `valid` must have shape (B, S) = ({B}, {S}), "
                f"got {tuple(self.valid.shape)}"
            )

    def block(self, T, S, rows=None, cols=None, *, device=None):
        v = _select(self.valid, 1, cols).to(device)  # (B, cols)
        if v.numel() == 0 or not bool(v.any()):
            return _EMPTY
        if bool(v.all()):
            return _FULL
        return MaskBlock("partial", allowed=v[:, None, None, :])


def _check_ids(name: str, ids: object, expect: str) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor):
        raise TypeError(
            f"`{name}` must be an integer torch.Tensor {expect}, got {type(ids).__name__}"
        )
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise ValueError(
            f"`{name}` must be an integer tensor {expect} of document ids, got dtype "
            f"{ids.dtype}; use `{name}.long()`"
        )
    if ids.ndim != 2 or ids.numel() == 0:
        raise ValueError(
            f"`{name}` must be a non-empty 2-D tensor {expect}, got shape {tuple(ids.shape)}; "
            f"for one sequence use `{name}[None]`"
        )
    return ids.long()


class DocumentMask(AttentionMask):
    """Packed sequences: a token attends only to tokens of its own document.

    ``segment_ids[b, i]`` is the document of query i; ``key_segment_ids[b, j]`` that of
    key j (default: the same ids, for self-attention with ``T == S``). Combine with
    ``& CausalMask()`` for packed causal training. Tiles whose query and key documents
    never meet are reported ``"empty"`` and skipped by tiling backends, so the cost is
    the sum of the documents' squares, not ``T**2``; when the key ids are sorted
    (documents packed one after another) :meth:`col_range` narrows each block of
    queries to the keys of its own documents.

    Args:
        segment_ids: integer tensor ``(B, T)``.
        key_segment_ids: integer tensor ``(B, S)``, or None to use ``segment_ids``.

    Raises:
        TypeError: not a tensor.
        ValueError: not 2-D integer tensors, or batch sizes that differ.
    """

    kind = "document"

    def __init__(
        self, segment_ids: torch.Tensor, key_segment_ids: torch.Tensor | None = None
    ) -> None:
        self.segment_ids = _check_ids("segment_ids", segment_ids, "(B, T)")
        if key_segment_ids is None:
            self.key_segment_ids = self.segment_ids
            self._shared = True
        else:
            self.key_segment_ids = _check_ids("key_segment_ids", key_segment_ids, "(B, S)")
            self._shared = False
            if self.key_segment_ids.shape[0] != self.segment_ids.shape[0]:
                raise ValueError(
                    "`key_segment_ids` must have the batch size of `segment_ids` "
                    f"({self.segment_ids.shape[0]}), got shape "
                    f"{tuple(self.key_segment_ids.shape)}"
                )
        k = self.key_segment_ids
        # Sorted key ids (documents packed in order) let col_range cut each query block
        # down to its documents' keys with a binary search.
        self._keys_sorted = bool((k[:, 1:] >= k[:, :-1]).all()) if k.shape[1] > 1 else True

    def validate(self, B: int, H: int, T: int, S: int) -> None:
        q, k = self.segment_ids, self.key_segment_ids
        if q.shape[0] not in (1, B) or q.shape[1] != T:
            raise ValueError(
                f"`segment_ids` must have shape (B, T) = ({B}, {T}), got {tuple(q.shape)}"
            )
        if k.shape[1] != S:
            if self._shared:
                raise ValueError(
                    f"`segment_ids` has T={T} ids but there are S={S} keys; pass "
                    "`key_segment_ids` of shape (B, S) when the keys are not the queries"
                )
            raise ValueError(
                f"`key_segment_ids` must have shape (B, S) = ({B}, {S}), got {tuple(k.shape)}"
            )

    def may_empty_rows(self, T: int, S: int) -> bool:
        return not self._shared

    def col_range(self, T: int, S: int, q0: int, q1: int) -> tuple[int, int]:
        if not self._keys_sorted or q1 <= q0:
            return 0, S
        q = self.segment_ids[:, q0:q1]
        k = self.key_segment_ids.contiguous()
        lo = torch.searchsorted(k, q.amin(dim=1, keepdim=True).contiguous(), right=False)
        hi = torch.searchsorted(k, q.amax(dim=1, keepdim=True).contiguous(), right=True)
        return int(lo.min()), int(hi.max())

    def _status(self, q: torch.Tensor, k: torch.Tensor) -> BlockStatus:
        if q.numel() == 0 or k.numel() == 0:
            return "empty"
        qmin, qmax = q.amin(dim=1), q.amax(dim=1)  # (B,)
        kmin, kmax = k.amin(dim=1), k.amax(dim=1)
        if not bool(((qmin <= kmax) & (kmin <= qmax)).any()):
            return "empty"  # the id ranges do not even overlap: no document meets
        if bool(((qmin == qmax) & (kmin == kmax) & (qmin == kmin)).all()):
            return "full"  # one document on both sides, in every batch item
        return "partial"

    def block_status(self, T, S, rows=None, cols=None):
        return self._status(
            _select(self.segment_ids, 1, rows), _select(self.key_segment_ids, 1, cols)
        )

    def block(self, T, S, rows=None, cols=None, *, device=None):
        q = _select(self.segment_ids, 1, rows)  # (B, rows)
        k = _select(self.key_segment_ids, 1, cols)  # (B, cols)
        status = self._status(q, k)
        if status != "partial":
            return _EMPTY if status == "empty" else _FULL
        allowed = (q[:, :, None] == k[:, None, :]).to(device)  # (B, rows, cols)
        if not bool(allowed.any()):
            return _EMPTY
        return MaskBlock("partial", allowed=allowed[:, None])


class BooleanMask(AttentionMask):
    """An arbitrary boolean mask, True = may attend.

    Args:
        mask: bool tensor broadcastable to ``(B, H, T, S)``.

    Raises:
        TypeError: not a bool tensor (a float tensor is an :class:`AdditiveMask`).
    """

    kind = "boolean"

    def __init__(self, mask: torch.Tensor, *, name: str = "attn_mask") -> None:
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"`{name}` must be a torch.Tensor, got {type(mask).__name__}")
        if mask.dtype != torch.bool:
            raise TypeError(
                f"`{name}` must be a bool tensor (True = may attend), got dtype {mask.dtype}; "
                "pass `mask.bool()`, or a float tensor for an additive bias"
            )
        if mask.ndim > 4:
            raise ValueError(
                f"`{name}` must have at most 4 dims (B, H, T, S), got shape {tuple(mask.shape)}"
            )
        self.mask = _as4d(mask)
        self.name = name

    def validate(self, B: int, H: int, T: int, S: int) -> None:
        _check_broadcast(self.name, tuple(self.mask.shape), B, H, T, S)

    def block(self, T, S, rows=None, cols=None, *, device=None):
        m = _select(_select(self.mask, 2, rows), 3, cols).to(device)
        if not bool(m.any()):
            return _EMPTY
        if bool(m.all()):
            return _FULL
        return MaskBlock("partial", allowed=m)


class AdditiveMask(AttentionMask):
    """A float bias added to the scaled scores (e.g. ALiBi); ``-inf`` forbids attending.

    Args:
        bias: float tensor broadcastable to ``(B, H, T, S)``; no NaN or ``+inf``.

    Raises:
        TypeError: not a floating tensor.
        ValueError: NaN or +inf entries.
    """

    kind = "additive"

    def __init__(self, bias: torch.Tensor, *, name: str = "attn_mask") -> None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"`{name}` must be a torch.Tensor, got {type(bias).__name__}")
        if not bias.is_floating_point():
            raise TypeError(
                f"`{name}` must be a bool mask or a float bias, got dtype {bias.dtype}; "
                "use `mask.bool()` for True = may attend"
            )
        if bias.ndim > 4:
            raise ValueError(
                f"`{name}` must have at most 4 dims (B, H, T, S), got shape {tuple(bias.shape)}"
            )
        with torch.no_grad():
            if bool(torch.isnan(bias).any()) or bool((bias == float("inf")).any()):
                raise ValueError(f"`{name}` must not contain NaN or +inf; use -inf to forbid")
        self.bias = _as4d(bias)
        self.name = name

    @property
    def has_bias(self) -> bool:
        return True

    def grad_tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.bias,) if self.bias.requires_grad else ()

    def validate(self, B: int, H: int, T: int, S: int) -> None:
        _check_broadcast(self.name, tuple(self.bias.shape), B, H, T, S)

    def block(self, T, S, rows=None, cols=None, *, device=None):
        return MaskBlock("partial", bias=_select(_select(self.bias, 2, rows), 3, cols).to(device))


class AndMask(AttentionMask):
    """Conjunction of masks (built with ``&``): a key is allowed when every part allows it;
    additive biases add up."""

    kind = "and"

    def __init__(self, *parts: AttentionMask) -> None:
        if not parts or not all(isinstance(p, AttentionMask) for p in parts):
            raise TypeError("AndMask parts must be AttentionMask instances")
        self.parts = tuple(parts)

    @property
    def is_causal_only(self) -> bool:
        return all(p.is_causal_only for p in self.parts)

    @property
    def has_bias(self) -> bool:
        return any(p.has_bias for p in self.parts)

    def grad_tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for p in self.parts for t in p.grad_tensors())

    def may_empty_rows(self, T: int, S: int) -> bool:
        if self.is_causal_only:
            return any(p.may_empty_rows(T, S) for p in self.parts)
        return True

    def validate(self, B: int, H: int, T: int, S: int) -> None:
        for p in self.parts:
            p.validate(B, H, T, S)

    def block_status(self, T, S, rows=None, cols=None):
        statuses = [p.block_status(T, S, rows, cols) for p in self.parts]
        if "empty" in statuses:
            return "empty"
        return "full" if all(st == "full" for st in statuses) else "partial"

    def constant_bias(self, T, S, rows, cols, *, device=None):
        total: torch.Tensor | None = None
        for p in self.parts:
            if not p.has_bias:
                if p.block_status(T, S, rows, cols) != "full":
                    return None
                continue
            c = p.constant_bias(T, S, rows, cols, device=device)
            if c is None:
                return None
            total = c if total is None else total + c
        return total

    def key_band(self, T: int, S: int) -> tuple[int | None, int] | None:
        bands = [p.key_band(T, S) for p in self.parts]
        if any(b is None for b in bands):
            return None
        firsts = [b[0] for b in bands if b is not None and b[0] is not None]
        return (max(firsts) if firsts else None), min(b[1] for b in bands if b is not None)

    def col_range(self, T: int, S: int, q0: int, q1: int) -> tuple[int, int]:
        lo, hi = 0, S
        for p in self.parts:
            a, b = p.col_range(T, S, q0, q1)
            lo, hi = max(lo, a), min(hi, b)
        return lo, max(lo, hi)

    def block(self, T, S, rows=None, cols=None, *, device=None):
        allowed: torch.Tensor | None = None
        bias: torch.Tensor | None = None
        for p in self.parts:
            b = p.block(T, S, rows, cols, device=device)
            if b.status == "empty":
                return _EMPTY
            if b.allowed is not None:
                allowed = b.allowed if allowed is None else allowed & b.allowed
            if b.bias is not None:
                bias = b.bias if bias is None else bias + b.bias
        if allowed is None and bias is None:
            return _FULL
        if allowed is not None and bias is None and not bool(allowed.any()):
            return _EMPTY
        return MaskBlock("partial", allowed=allowed, bias=bias)

    def __repr__(self) -> str:
        return " & ".join(repr(p) for p in self.parts)


def describe(mask: AttentionMask | None) -> str:
    """Short human-readable name of a mask's structure (for dispatch explanations)."""
    if mask is None:
        return "no mask"
    if isinstance(mask, AndMask):
        return " & ".join(describe(p) for p in mask.parts)
    if isinstance(mask, CausalMask):
        return f"causal ({mask.alignment})"
    if isinstance(mask, ChunkedMask):
        return f"chunked ({mask.chunk})"
    return mask.kind


def as_mask(
    attn_mask: AttentionMask | torch.Tensor | None,
    is_causal: bool = False,
    *,
    name: str = "attn_mask",
) -> AttentionMask | None:
    """Normalise user input into an :class:`AttentionMask` (or None for no mask).

    Args:
        attn_mask: None, an :class:`AttentionMask`, a bool tensor (True = may attend)
            broadcastable to ``(B, H, T, S)``, or a float tensor (additive bias).
        is_causal: also apply a bottom-right aligned :class:`CausalMask`.
        name: argument name used in error messages.

    Returns:
        The mask, or None when nothing is masked.

    Raises:
        TypeError: anything else, e.g. an integer tensor.
    """
    if not isinstance(is_causal, bool):
        raise TypeError(f"`is_causal` must be a bool, got {type(is_causal).__name__}")
    causal = CausalMask() if is_causal else None
    if attn_mask is None:
        mask: AttentionMask | None = None
    elif isinstance(attn_mask, AttentionMask):
        mask = attn_mask
    elif isinstance(attn_mask, torch.Tensor):
        if attn_mask.dtype == torch.bool:
            mask = BooleanMask(attn_mask, name=name)
        elif attn_mask.is_floating_point():
            mask = AdditiveMask(attn_mask, name=name)
        else:
            raise TypeError(
                f"`{name}` must be a bool tensor (True = may attend) or a float bias, "
                f"got dtype {attn_mask.dtype}; use `{name}.bool()`"
            )
    else:
        raise TypeError(
            f"`{name}` must be None, an AttentionMask, or a bool/float tensor, "
            f"got {type(attn_mask).__name__}"
        )
    if causal is None:
        return mask
    return causal if mask is None else mask & causal
