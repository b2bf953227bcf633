"""Attention backends: one signature, a registry, the ``auto`` choice and its reasons.

Every backend computes the same function (see ``attnlab.backends.math`` for the
readable reference) from query ``(B, H, T, D)``, key ``(B, G, S, D)`` and value
``(B, G, S, Dv)`` with an attnlab mask.

``auto`` chooses by measurement: the crossover table (:mod:`attnlab.backends.table`,
shipped as ``attnlab/data/dispatch_table.json``) ranks the backends fastest first for the
call's dtype, pass, mask kind and length; a backend that cannot serve the call (its
``why_not``) is never chosen, and one with a reason to step aside (``why_not_auto``, e.g.
a dense mask too large to materialise) is passed over while another can serve. A call no
row covers, or no table at all, walks the fixed :data:`AUTO_ORDER`. :func:`explain_dispatch`
says, for every backend, why it was or was not chosen, and which table row decided.

The decision is cached per call signature (shapes, dtypes, devices, autograd pass, mask
structure, dropout, scale, backend): a repeated call skips validation and selection.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from attnlab.backends import blockwise as _blockwise
from attnlab.backends import math as _math
from attnlab.backends import ring as _ring
from attnlab.backends import sdpa as _sdpa
from attnlab.backends.base import AttentionRequest, Backend, BackendResult, WeightsRequest
from attnlab.backends.decisions import (
    _DECISIONS,
    DispatchCacheInfo,
    _call_key,
    clear_dispatch_cache,
    dispatch_cache_info,
)
from attnlab.backends.registry import REGISTRY as _REGISTRY
from attnlab.backends.registry import available_backends, get_backend
from attnlab.backends.request import PreparedCall, prepare_call
from attnlab.backends.table import (
    DEFAULT_TABLE_PATH,
    DispatchTable,
    DispatchTableError,
    TableRow,
    load_dispatch_table,
    mask_kind,
    pass_name,
)
from attnlab.backends.weights import exact_weights, select_weights
from attnlab.biases import AlibiBias, RelativePositionBias
from attnlab.masks import (
    AttentionMask,
    CausalMask,
    ChunkedMask,
    DocumentMask,
    PaddingMask,
    SlidingWindowMask,
    as_mask,
)

__all__ = [
    "AUTO_ORDER",
    "AttentionRequest",
    "Backend",
    "BackendResult",
    "DispatchCacheInfo",
    "DispatchExplanation",
    "DispatchTable",
    "DispatchTableError",
    "PreparedCall",
    "TableRow",
    "WeightsRequest",
    "available_backends",
    "clear_dispatch_cache",
    "dispatch_cache_info",
    "dispatch_table",
    "exact_weights",
    "explain_dispatch",
    "get_backend",
    "prepare_call",
    "register_backend",
    "resolve_call",
    "select_backend",
    "select_weights",
    "set_dispatch_table",
    "variant_support",
]

#: The fixed order ``auto`` tries backends in when no table row covers a call.
AUTO_ORDER: list[str] = []


def register_backend(backend: Backend, *, auto_rank: int | None = None) -> None:
    """Register a backend under ``backend.name``.

    Args:
        backend: the backend.
        auto_rank: position in :data:`AUTO_ORDER` (0 = tried first); None keeps it out
            of ``auto`` (it can still be asked for by name).
    """
    _REGISTRY[backend.name] = backend
    if backend.name in AUTO_ORDER:
        AUTO_ORDER.remove(backend.name)
    if auto_rank is not None:
        AUTO_ORDER.insert(auto_rank, backend.name)
    clear_dispatch_cache()


# --- the crossover table ------------------------------------------------------------------

_NOT_LOADED = object()


class _TableSource:
    """The crossover table ``auto`` ranks by: loaded on first use (see
    :func:`dispatch_table`), replaced by :func:`set_dispatch_table`, and the note saying
    why there is none when there is none."""

    def __init__(self) -> None:
        self.table: DispatchTable | object | None = _NOT_LOADED
        self.note = ""

    def get(self) -> DispatchTable | None:
        """The table, loading it on first use."""
        if self.table is _NOT_LOADED:
            self.table, self.note = self._load()
        return self.table  # type: ignore[return-value]

    def set(self, table: DispatchTable | object | None) -> None:
        """Use ``table`` (None: none; ``_NOT_LOADED``: load the default on next use)."""
        self.table = table
        self.note = "set_dispatch_table(None)" if table is None else ""

    @staticmethod
    def _load() -> tuple[DispatchTable | None, str]:
        env = os.environ.get("ATTNLAB_DISPATCH_TABLE")
        if env is not None and env.strip().lower() in ("", "none", "off"):
            return None, "ATTNLAB_DISPATCH_TABLE=none"
        if env is not None:
            if not Path(env).is_file():
                raise FileNotFoundError(
                    f"ATTNLAB_DISPATCH_TABLE={env!r} does not exist; point it at a table "
                    "written by `python benchmarks/bench_attention.py --write-table FILE`, "
                    "or set it to 'none' for the fixed order"
                )
            return load_dispatch_table(env, tuple(_REGISTRY)), ""
        if DEFAULT_TABLE_PATH.is_file():
            return load_dispatch_table(DEFAULT_TABLE_PATH, tuple(_REGISTRY)), ""
        return None, f"no table file ({DEFAULT_TABLE_PATH} is missing)"


#: The table source every ``auto`` decision of this process reads.
_TABLE = _TableSource()


def dispatch_table() -> DispatchTable | None:
    """The crossover table ``auto`` uses, or None (fixed order).

    Loaded on first use from ``$ATTNLAB_DISPATCH_TABLE`` (a path; ``none`` for no table)
    or else the packaged ``attnlab/data/dispatch_table.json``; a missing packaged file
    means no table.

    Raises:
        DispatchTableError: the table file is malformed.
        FileNotFoundError: ``$ATTNLAB_DISPATCH_TABLE`` names a file that does not exist.
    """
    return _TABLE.get()


def set_dispatch_table(table: DispatchTable | str | Path | object | None = _NOT_LOADED) -> None:
    """Use another crossover table (and forget every cached decision).

    Args:
        table: a :class:`DispatchTable`, a path to a table file, None for no table (the
            fixed order), or nothing to go back to the default (the environment variable,
            else the packaged file) on next use.

    Raises:
        DispatchTableError, FileNotFoundError: as :func:`load_dispatch_table`.
    """
    if isinstance(table, (str, Path)):
        table = load_dispatch_table(table, tuple(_REGISTRY))
    _TABLE.set(table)
    clear_dispatch_cache()


def _table_row(request: AttentionRequest) -> tuple[TableRow | None, str]:
    """The row covering the request and a note saying why there is none."""
    table = dispatch_table()
    if table is None:
        return None, _TABLE.note
    if request.device_type != table.device:
        return (
            None,
            f"the table was timed on {table.device}, this call is on {request.device_type}",
        )
    dtype = str(request.dtype).removeprefix("torch.")
    kind = mask_kind(request.mask, request.T, request.S)
    row = table.lookup(dtype, pass_name(request.needs_grad), kind, request.T, request.S)
    if row is None:
        return None, (
            f"no table row for {dtype}, {pass_name(request.needs_grad)}, mask {kind!r}, "
            f"T={request.T}, S={request.S} (the table has masks {', '.join(table.masks)})"
        )
    return row, ""


# --- the choice ---------------------------------------------------------------------------


def _auto(request: AttentionRequest) -> tuple[Backend, list[str], TableRow | None, str]:
    """``auto``'s choice: (backend, ranking it came from, deciding row, note)."""
    row, note = _table_row(request)
    ranked = [n for n in row.order if n in AUTO_ORDER] if row is not None else []
    ranked += [n for n in AUTO_ORDER if n not in ranked]
    capable = [n for n in ranked if _REGISTRY[n].why_not(request) is None]
    stepping_aside = [n for n in capable if _REGISTRY[n].why_not_auto(request) is not None]
    if row is None or stepping_aside:  # the materialising reference only as a last resort
        capable = [n for n in capable if not _REGISTRY[n].last_resort] or capable
    for n in capable:  # fastest first, unless it has a reason to step aside ...
        if n not in stepping_aside:
            return _REGISTRY[n], ranked, row, note
    if capable:  # ... which it does not when only slower backends are left
        return _REGISTRY[capable[0]], ranked, row, note
    return _REGISTRY["math"], ranked, row, note  # the reference serves every request


def select_backend(name: str, request: AttentionRequest) -> Backend:
    """The backend that serves ``request``: ``name``, or ``auto``'s choice.

    Raises:
        ValueError: unknown name, or the named backend cannot serve the request (the
            message gives its reason).
        DispatchTableError: ``auto`` and the crossover table is malformed.
    """
    if not isinstance(name, str):
        raise TypeError(f"`backend` must be a str, got {type(name).__name__}")
    if name == "auto":
        return _auto(request)[0]
    be = get_backend(name)
    why = be.why_not(request)
    if why is not None:
        raise ValueError(f"backend={name!r} cannot serve this call: {why}")
    return be


# --- the decision cache -------------------------------------------------------------------


def resolve_call(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: AttentionMask | torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    backend: str,
    need_weights: bool | WeightsRequest,
    *,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[
    Backend, AttentionMask | None, float, WeightsRequest | None, float | None, torch.Tensor | None
]:
    """Validate a call and choose its backend, from the cache when the call was seen.

    Calls with ``sinks`` (whose values are validated), a ``WeightsRequest`` or arguments
    of unusual types are validated every time.

    Returns:
        ``(backend, mask, scale, weights, softcap, sinks)``: the backend to run, the call's
        attnlab mask, the score scale, the weights request (None: no weights), the
        soft-cap and the sinks.

    Raises:
        TypeError, ValueError: as :func:`prepare_call` and :func:`select_backend`.
    """
    ck = None
    if sinks is None:
        ck = _call_key(
            query,
            key,
            value,
            attn_mask,
            dropout_p,
            is_causal,
            scale,
            backend,
            need_weights,
            softcap,
        )
    if ck is not None:
        try:
            hit = _DECISIONS.get(ck)
        except TypeError:  # an unhashable scale or dropout_p: validation will say so
            ck, hit = None, None
        if hit is not None:
            be, mask, scale_f, weights, softcap_f = hit
            if attn_mask is not None:  # the same structure, but this call's tensors
                mask = as_mask(attn_mask, is_causal)  # type: ignore[arg-type]
            return be, mask, scale_f, weights, softcap_f, None
    call = prepare_call(
        query,
        key,
        value,
        attn_mask,
        dropout_p,
        is_causal,
        scale,
        backend,
        need_weights,
        softcap=softcap,
        sinks=sinks,
    )
    be = select_backend(backend, call.request)
    if ck is not None and be.cache_decisions:
        kept = call.mask if attn_mask is None else None
        _DECISIONS.put(ck, (be, kept, call.scale, call.weights, call.softcap))
    return be, call.mask, call.scale, call.weights, call.softcap, call.sinks


# --- explanations -------------------------------------------------------------------------


@dataclass(frozen=True)
class DispatchExplanation:
    """Which backend a call would run on, and why every other one was not chosen.

    Attributes:
        requested: the ``backend`` argument.
        chosen: the backend that would run.
        reasons: ``(name, reason)`` for every registered backend; reason is None for the
            chosen one, else a human-readable sentence.
        decided_by: for ``auto``, the crossover-table row that ranked the backends
            (``"row 12 (bfloat16, forward+backward, causal, ...)"``), or why the fixed order
            was used; "" when a backend was asked for by name.
    """

    requested: str
    chosen: str
    reasons: tuple[tuple[str, str | None], ...]
    decided_by: str = ""

    def __str__(self) -> str:
        lines = [f"backend={self.requested!r} -> {self.chosen}"]
        if self.decided_by:
            lines.append(f"  decided by: {self.decided_by}")
        for name, why in self.reasons:
            lines.append(f"  {name}: {'chosen' if why is None else why}")
        return "\n".join(lines)


def explain(request: AttentionRequest, backend: str = "auto") -> DispatchExplanation:
    """Explain dispatch for an already-built request."""
    chosen = select_backend(backend, request)  # raises with the reason if it cannot serve
    decided_by = ""
    ranked: list[str] = list(AUTO_ORDER)
    row: TableRow | None = None
    if backend == "auto":
        _, ranked, row, note = _auto(request)
        decided_by = (
            f"dispatch table {row.describe(request.T, request.S)}"
            if row is not None
            else (f"the fixed order {' > '.join(AUTO_ORDER)} ({note})")
        )
    reasons: list[tuple[str, str | None]] = []
    for name, be in _REGISTRY.items():
        why = be.why_not(request)
        if why is None and backend == "auto":
            why = be.why_not_auto(request)
        if name == chosen.name:
            reasons.append((name, None))
        elif why is not None:
            reasons.append((name, f"not chosen: {why}"))
        elif backend != "auto":
            reasons.append((name, f"capable, but backend={backend!r} was asked for"))
        elif row is not None and name in row.order:
            reasons.append(
                (name, f"capable, but slower: table row {row.index} ranks {' < '.join(row.order)}")
            )
        elif (
            name in ranked
            and chosen.name in ranked
            and (ranked.index(name) > ranked.index(chosen.name) and not be.last_resort)
        ):
            reasons.append((name, f"capable, but {chosen.name} is faster and ranks first"))
        else:
            reasons.append((name, "capable, but slower; chosen only when nothing else can"))
    return DispatchExplanation(
        requested=backend, chosen=chosen.name, reasons=tuple(reasons), decided_by=decided_by
    )


def explain_dispatch(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: AttentionMask | torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    backend: str = "auto",
    need_weights: bool | WeightsRequest = False,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> DispatchExplanation:
    """Say which backend ``scaled_dot_product_attention`` would run, and why not the others.

    Takes the same arguments as :func:`attnlab.functional.scaled_dot_product_attention`
    and validates them the same way; computes nothing. For ``auto`` it names the
    crossover-table row that decided (``decided_by``). The pass is the one the call would
    run: ``forward+backward`` when autograd is on and an input requires grad.

    Returns:
        A :class:`DispatchExplanation`; ``str()`` of it is a readable report.

    Raises:
        ValueError, TypeError: the same as ``scaled_dot_product_attention``.
    """
    call = prepare_call(
        query,
        key,
        value,
        attn_mask,
        dropout_p,
        is_causal,
        scale,
        backend,
        need_weights,
        softcap=softcap,
        sinks=sinks,
    )
    request = call.request
    return explain(request, backend)


def _variant_calls() -> list[tuple[str, dict[str, object]]]:
    H, T = 2, 4
    ids = torch.tensor([[0, 0, 1, 1]])
    return [
        ("causal", {"is_causal": True}),
        ("PaddingMask", {"attn_mask": PaddingMask(torch.ones(1, T).bool())}),
        ("SlidingWindowMask", {"attn_mask": SlidingWindowMask(2)}),
        ("ChunkedMask (Llama 4)", {"attn_mask": ChunkedMask(2)}),
        ("AlibiBias (ALiBi)", {"attn_mask": AlibiBias(H), "is_causal": True}),
        (
            "RelativePositionBias (T5), learned",
            {"attn_mask": RelativePositionBias(torch.zeros(32, H, requires_grad=True))},
        ),
        (
            "DocumentMask & CausalMask",
            {"attn_mask": DocumentMask(ids) & CausalMask()},
        ),
        ("softcap= (Gemma 2)", {"softcap": 30.0, "is_causal": True}),
        ("sinks= (gpt-oss)", {"sinks": torch.zeros(H), "is_causal": True}),
    ]


def variant_support() -> list[tuple[str, dict[str, str | None]]]:
    """Which backend serves which attention variant: ``(variant, {backend: reason})``,
    reason None where the backend serves it (for ``attnlab info`` and the README)."""
    rows = []
    for label, kwargs in _variant_calls():
        x = torch.zeros(1, 2, 4, 8, requires_grad=True)
        with torch.enable_grad():
            call = prepare_call(
                x,
                x,
                x,
                kwargs.get("attn_mask"),
                0.0,
                kwargs.get("is_causal", False),
                None,
                "auto",
                False,
                softcap=kwargs.get("softcap"),
                sinks=kwargs.get("sinks"),
            )
        rows.append((label, {n: be.why_not(call.request) for n, be in _REGISTRY.items()}))
    return rows


register_backend(_sdpa.BACKEND, auto_rank=0)
register_backend(_blockwise.BACKEND, auto_rank=1)
register_backend(_math.BACKEND, auto_rank=2)
register_backend(_ring.BACKEND)  # by name only, never chosen by auto
