"""The crossover table ``auto`` dispatches by: which backend was fastest, as timed.

Shape legend: B batch, H query heads, T query length, S key length, D head dim.

The table is a JSON file shipped in the package (``attnlab/data/dispatch_table.json``),
written by ``benchmarks/bench_attention.py --write-table`` on a quiet machine. Each row
covers one (dtype, pass, mask kind) and a range of lengths, and ranks the backends
fastest first, with the times that ranking came from::

    {"format": "attnlab-dispatch-table/1",
     "machine": {... torch version, threads, how quiet the machine was ...},
     "shape": {"B": 1, "H": 12, "D": 64, "device": "cpu"},
     "rows": [{"dtype": "bfloat16", "pass": "forward+backward", "mask": "causal",
               "t_from": 45, "t_below": 181, "order": ["math", "sdpa", "blockwise"],
               "ms": {"64": {"math": 1.29, "sdpa": 1.76, "blockwise": 3.6}, ...}}, ...]}

A call matches a row when its dtype, pass (``"forward"`` without autograd, else
``"forward+backward"``) and mask kind (:func:`mask_kind`) are the row's and
``t_from <= sqrt(T*S) < t_below`` (``t_below`` null: no upper bound). Rows are timed
at ``T == S``; ``sqrt(T*S)`` carries them to calls with ``T != S`` by the size of the
score matrix. A call no row covers (another dtype, mask kind or device) uses the fixed
order.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnlab.masks import AttentionMask, CausalMask, PaddingMask

__all__ = [
    "DEFAULT_TABLE_PATH",
    "PASSES",
    "TABLE_FORMAT",
    "DispatchTable",
    "DispatchTableError",
    "TableRow",
    "load_dispatch_table",
    "mask_kind",
    "pass_name",
]

TABLE_FORMAT = "attnlab-dispatch-table/1"
PASSES = ("forward", "forward+backward")
DTYPES = ("float32", "bfloat16", "float16", "float64")
DEFAULT_TABLE_PATH = Path(__file__).resolve().parent.parent / "data" / "dispatch_table.json"
REGENERATE = "python benchmarks/bench_attention.py --write-table"


class DispatchTableError(ValueError):
    """The dispatch table file is malformed (the message names the file and the field)."""


def pass_name(needs_grad: bool) -> str:
    """``"forward+backward"`` when autograd will run backward through the call."""
    return PASSES[1] if needs_grad else PASSES[0]


def mask_kind(mask: AttentionMask | None, T: int, S: int) -> str:
    """The table's name for a mask's structure.

    ``"none"``, ``"causal"`` (a causal mask with query 0 at key 0: PyTorch's
    ``is_causal`` fast path), ``"causal_offset"`` (a causal mask with ``T != S``),
    ``"padding"``, else the mask's ``kind`` (``"sliding_window"``, ``"boolean"``,
    ``"additive"``, ``"and"``, ...).
    """
    if mask is None:
        return "none"
    if isinstance(mask, CausalMask):
        return "causal" if mask.offset(T, S) == 0 else "causal_offset"
    if isinstance(mask, PaddingMask):
        return "padding"
    return mask.kind


@dataclass(frozen=True)
class TableRow:
    """One row: backends fastest first for a (dtype, pass, mask kind, length range).

    Attributes:
        index: position in the file's ``rows`` list (0-based), as explanations cite it.
        dtype, pass_, mask: what the row covers.
        t_from, t_below: the range of ``sqrt(T*S)`` it covers (``t_below`` None: no bound).
        order: backend names, fastest first.
        ms: the recorded times in milliseconds, ``{T: {backend: ms}}``, for the lengths timed.
    """

    index: int
    dtype: str
    pass_: str
    mask: str
    t_from: float
    t_below: float | None
    order: tuple[str, ...]
    ms: Mapping[int, Mapping[str, float]] = field(default_factory=dict, compare=False)

    def covers(self, T: int, S: int) -> bool:
        n = math.sqrt(T * S)
        return self.t_from <= n and (self.t_below is None or n < self.t_below)

    def span(self) -> str:
        hi = "inf" if self.t_below is None else f"{self.t_below:g}"
        return f"sqrt(T*S) in [{self.t_from:g}, {hi})"

    def describe(self, T: int | None = None, S: int | None = None) -> str:
        """``row 12 (bfloat16, forward+backward, causal, sqrt(T*S) in [45, 91):
        math 1.29 < sdpa 1.76 < blockwise 3.6 ms at T=64)``, with the times recorded
        nearest the call's ``sqrt(T*S)`` (the largest length when not given)."""
        timing = ""
        if self.ms:
            n = math.sqrt(T * (S or T)) if T else max(self.ms)
            t = min(self.ms, key=lambda m: abs(math.log(m / n)))
            per = self.ms[t]
            ranked = [n for n in self.order if n in per]
            timing = ": " + " < ".join(f"{n} {per[n]:.3g}" for n in ranked) + f" ms at T={t}"
        else:
            timing = ": " + " < ".join(self.order)
        return f"row {self.index} ({self.dtype}, {self.pass_}, {self.mask}, {self.span()}{timing})"


@dataclass(frozen=True, eq=False)
class DispatchTable:
    """A validated crossover table.

    Attributes:
        path: the file it was read from ("" when built in memory).
        machine: what the file says about where and how it was timed.
        shape: the B, H, D (and device) it was timed at.
        rows: the rows, in file order.
    """

    path: str
    machine: Mapping[str, Any]
    shape: Mapping[str, Any]
    rows: tuple[TableRow, ...]

    def lookup(self, dtype: str, pass_: str, mask: str, T: int, S: int) -> TableRow | None:
        """The row covering the call, or None."""
        for row in self.rows:
            if row.dtype == dtype and row.pass_ == pass_ and row.mask == mask and row.covers(T, S):
                return row
        return None

    @property
    def masks(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(r.mask for r in self.rows))

    @property
    def device(self) -> str:
        return str(self.shape.get("device", "cpu"))

    @staticmethod
    def from_json(data: object, path: str = "", known: tuple[str, ...] = ()) -> DispatchTable:
        """Validate parsed JSON into a table.

        Args:
            data: the parsed document.
            path: the file name, for error messages.
            known: registered backend names; when given, ``order`` may name only these.

        Raises:
            DispatchTableError: naming the file, the field and what was wrong.
        """
        where = f"dispatch table {path or '(in memory)'}"

        def bad(field_: str, expected: str, got: object) -> DispatchTableError:
            return DispatchTableError(
                f"{where} is malformed: `{field_}` must be {expected}, got {got!r}; "
                f"regenerate it with `{REGENERATE} FILE`, or set ATTNLAB_DISPATCH_TABLE=none "
                "to dispatch by the fixed order"
            )

        if not isinstance(data, dict):
            raise bad("(top level)", "a JSON object", type(data).__name__)
        if data.get("format") != TABLE_FORMAT:
            raise bad("format", repr(TABLE_FORMAT), data.get("format"))
        machine = data.get("machine", {})
        shape = data.get("shape", {})
        if not isinstance(machine, dict):
            raise bad("machine", "an object", machine)
        if not isinstance(shape, dict):
            raise bad("shape", "an object", shape)
        raw_rows = data.get("rows")
        if not isinstance(raw_rows, list) or not raw_rows:
            raise bad("rows", "a non-empty list", raw_rows)
        rows: list[TableRow] = []
        for i, r in enumerate(raw_rows):
            f = f"rows[{i}]"
            if not isinstance(r, dict):
                raise bad(f, "an object", r)
            if r.get("dtype") not in DTYPES:
                raise bad(f"{f}.dtype", f"one of {list(DTYPES)}", r.get("dtype"))
            if r.get("pass") not in PASSES:
                raise bad(f"{f}.pass", f"one of {list(PASSES)}", r.get("pass"))
            if not isinstance(r.get("mask"), str) or not r["mask"]:
                raise bad(f"{f}.mask", "a mask kind such as 'causal'", r.get("mask"))
            t_from, t_below = r.get("t_from"), r.get("t_below")
            if isinstance(t_from, bool) or not isinstance(t_from, (int, float)) or t_from < 0:
                raise bad(f"{f}.t_from", "a number >= 0", t_from)
            if t_below is not None and (
                isinstance(t_below, bool)
                or not isinstance(t_below, (int, float))
                or t_below <= t_from
            ):
                raise bad(f"{f}.t_below", f"null or a number > t_from ({t_from})", t_below)
            order = r.get("order")
            if (
                not isinstance(order, list)
                or not order
                or not all(isinstance(n, str) for n in order)
                or len(set(order)) != len(order)
            ):
                raise bad(f"{f}.order", "a non-empty list of distinct backend names", order)
            unknown = [n for n in order if known and n not in known]
            if unknown:
                raise bad(f"{f}.order", f"backend names among {list(known)}", unknown)
            ms_raw = r.get("ms", {})
            if not isinstance(ms_raw, dict):
                raise bad(f"{f}.ms", "an object {T: {backend: ms}}", ms_raw)
            ms: dict[int, dict[str, float]] = {}
            for t, per in ms_raw.items():
                if not str(t).isdigit() or not isinstance(per, dict):
                    raise bad(f"{f}.ms", "an object {T: {backend: ms}}", {t: per})
                for n, v in per.items():
                    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                        raise bad(f"{f}.ms[{t}][{n}]", "a positive number of ms", v)
                ms[int(t)] = {str(n): float(v) for n, v in per.items()}
            rows.append(
                TableRow(
                    index=i,
                    dtype=r["dtype"],
                    pass_=r["pass"],
                    mask=r["mask"],
                    t_from=float(t_from),
                    t_below=None if t_below is None else float(t_below),
                    order=tuple(order),
                    ms=ms,
                )
            )
        groups: dict[tuple[str, str, str], list[TableRow]] = {}
        for row in rows:
            groups.setdefault((row.dtype, row.pass_, row.mask), []).append(row)
        for group in groups.values():
            group.sort(key=lambda r: r.t_from)
            for a, b in itertools.pairwise(group):
                if a.t_below is None or a.t_below > b.t_from:
                    raise DispatchTableError(
                        f"{where} is malformed: rows[{a.index}] and rows[{b.index}] "
                        f"({a.dtype}, {a.pass_}, {a.mask}) overlap: {a.span()} and {b.span()}; "
                        f"regenerate it with `{REGENERATE} FILE`"
                    )
        return DispatchTable(path=path, machine=machine, shape=shape, rows=tuple(rows))


def load_dispatch_table(path: str | Path, known: tuple[str, ...] = ()) -> DispatchTable:
    """Read and validate a dispatch table file.

    Args:
        path: the JSON file.
        known: registered backend names (``order`` may name only these).

    Raises:
        FileNotFoundError: no such file.
        DispatchTableError: not JSON, or not a valid table (the message says which field).
    """
    p = Path(path)
    text = p.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DispatchTableError(
            f"dispatch table {p} is malformed: not JSON ({e}); regenerate it with "
            f"`{REGENERATE} FILE`, or set ATTNLAB_DISPATCH_TABLE=none"
        ) from None
    return DispatchTable.from_json(data, str(p), known)
