"""From how many rows of input a weight format's product runs dense, measured on this CPU.

The int formats run a few rows (decoding) through their own kernels, and from some number
of rows on (a prompt) dequantise their weight and run one dense ``mm`` in the prompt
arithmetic's dtype (:mod:`attnlab.quant.arith`). Where the two cross depends on the CPU,
on which kernels it runs and on the weight's shape, and no feature flag says where. On an
EPYC with bf16 dot products dequantising wins from 64 rows for q5_0 and from 128 for
int4; on the same machine held to AVX-512 without bf16 (float32 products), PyTorch's
AVX-512 int4 kernel stays faster than dequantising at every prompt length measured; held
to AVX2, attnlab's own q4 kernel loses from 128 to 512 rows (``docs/guides/generation.md``).

So the crossover of each format and weight shape is measured on this machine the first
time a product of :data:`FIRST_PROBE_ROWS` rows or more runs (never for decoding alone),
and kept in attnlab's cache (``crossover/<key>.json``, one file per CPU, PyTorch version,
thread count, native build and the settings that choose kernels), so later processes read
it back:

- a weight of the layer's shape (at most :data:`PROBE_MAX_ROWS` of its rows: the
  crossover is a matter of rows of input, not of how many weight rows share them), at each
  of :data:`PROBE_ROWS` rows of input, both ways (kernel, dense) interleaved, the best of
  :data:`PROBE_REPEATS`;
- at each row count, the side that is faster by more than :data:`MARGIN` wins; closer
  than that it is a tie, and the format's default decides (a measurement corrects the
  defaults where they are clearly wrong, and noise does not move them);
- dense from the smallest row count from which dense wins at every larger count measured;
  the kernel at every row count when it wins at the largest.

The dense product itself, in float32 (a CPU without bf16 dot products), is
:func:`dense_mm`: PyTorch's ``mm`` calls MKL's sgemm, which on AMD CPUs runs its AVX2 code
whatever the CPU has (110 GFLOP/s on 2 cores of an EPYC with AVX-512), where oneDNN's
float32 matmul reaches 400. Which of the two is faster is measured once per machine
beside the crossovers (:func:`float32_gemm`).

``ATTNLAB_CROSSOVER=defaults`` uses each format's ``default_dense_from`` (measured on the
EPYC) and PyTorch's ``mm`` instead, and ``attnlab info`` shows what was measured here. A
layer's own ``dense_from_tokens``, when set, overrides both.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from attnlab import native
from attnlab.paths import cache_dir
from attnlab.quant.arith import PROMPT_DTYPE_ENV, prompt_dtype

__all__ = [
    "CROSSOVER_ENV",
    "KERNEL_ALWAYS",
    "Crossover",
    "choose",
    "chosen_gemm",
    "crossover",
    "dense_from",
    "dense_mm",
    "float32_gemm",
    "machine_key",
    "measured_here",
]

#: ``defaults``: each format's ``default_dense_from``; unset or ``measure``: measured here.
CROSSOVER_ENV = "ATTNLAB_CROSSOVER"
#: The row counts of input a crossover is measured at.
PROBE_ROWS: tuple[int, ...] = (16, 32, 64, 128, 256, 512)
#: A weight of more rows than this (an output head) is measured on this many of them.
PROBE_MAX_ROWS = 4096
PROBE_REPEATS = 5
#: A side wins a row count when its time is below ``1 - MARGIN`` of the other's.
MARGIN = 0.1
#: Fewer rows than this never measure anything: decoding runs the kernel.
FIRST_PROBE_ROWS = PROBE_ROWS[0]
#: The version of what is measured: a change to the products or to how they are timed
#: makes every machine measure again.
MEASURED_BY = "attnlab crossover 1: dense products by float32_gemm"
#: The ``dense_from`` of a format whose kernel won at every row count measured.
KERNEL_ALWAYS = 1 << 30

# The settings that choose which kernels run, besides the CPU and PyTorch's version.
_KERNEL_SETTINGS = (
    "ATEN_CPU_CAPABILITY",
    "ONEDNN_MAX_CPU_ISA",
    "MKL_ENABLE_INSTRUCTIONS",
    PROMPT_DTYPE_ENV,
    "ATTNLAB_NATIVE",
    "ATTNLAB_NATIVE_MARCH",
)


class _Format(Protocol):
    """What measuring needs of a weight format class."""

    name: str
    default_dense_from: int

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> Any: ...


@dataclass(frozen=True)
class Crossover:
    """A format's crossover here: dense from ``dense_from`` rows on, and where that came
    from; the timings (ms, the best of the repeats, per row count) when measured."""

    dense_from: int
    source: str
    rows: tuple[int, ...] = ()
    kernel_ms: tuple[float, ...] = ()
    dense_ms: tuple[float, ...] = ()

    def describe(self) -> str:
        """One line: from how many rows dense, and why."""
        if self.dense_from >= KERNEL_ALWAYS:
            where = "its kernel at every row count"
        else:
            where = f"dense from {self.dense_from} rows"
        return f"{where} ({self.source})"


def choose(
    rows: Sequence[int], kernel_ms: Sequence[float], dense_ms: Sequence[float], default: int
) -> int:
    """The crossover of one measurement: the smallest of ``rows`` (ascending) from which
    dense wins at that count and every larger one; :data:`KERNEL_ALWAYS` when the kernel
    wins at the largest. A count where neither side is faster by :data:`MARGIN` goes to
    the side ``default`` (the format's crossover without measuring) gives it."""
    if not rows or len(rows) != len(kernel_ms) or len(rows) != len(dense_ms):
        raise ValueError("rows, kernel_ms and dense_ms must be non-empty and of one length")
    chosen = KERNEL_ALWAYS
    for m, k, d in reversed(list(zip(rows, kernel_ms, dense_ms, strict=True))):
        if d < (1 - MARGIN) * k:
            dense = True
        elif k < (1 - MARGIN) * d:
            dense = False
        else:
            dense = m >= default
        if not dense:
            break
        chosen = m
    return chosen


def machine_key() -> dict[str, str]:
    """What a measurement holds for: the CPU, PyTorch, threads and the kernel settings."""
    key = {
        "measured_by": MEASURED_BY,
        "cpu": native.cpu_model() or sys.platform,
        "cpu_flags": native.cpu_flags(),
        "torch": torch.__version__,
        "threads": str(torch.get_num_threads()),
        "prompt_dtype": str(prompt_dtype()).removeprefix("torch."),
        # the build, not only whether there is one: its kernels are one side of every crossover,
        # so a changed kernel (a new attnlab, another -march) is measured again
        "native": native.build_dir().name if native.would_load() else "not loaded",
    }
    key.update({name: os.environ.get(name, "") for name in _KERNEL_SETTINGS})
    return key


def _process_settings() -> tuple[int | str | None, ...]:
    """What can change within a process and keys its measurements: threads and the
    kernel settings (a cheap lookup, asked on every prompt product)."""
    return (torch.get_num_threads(), *map(os.environ.get, _KERNEL_SETTINGS))


def _cache_file(key: dict[str, str]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "crossover" / f"{digest}.json"


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return data if isinstance(data, dict) and isinstance(data.get("formats"), dict) else {}
    except (OSError, ValueError):
        return {}


def _write_entry(path: Path, key: dict[str, str], name: str, entry: dict[str, Any]) -> None:
    """Add one entry to the machine's file (written whole, then renamed: a reader never
    sees half a file; two processes measuring at once keep one's)."""
    data = _read(path) or {"machine": key, "formats": {}}
    data["formats"][name] = entry
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache: measured again by the next process


def _timed(layer: Callable[[torch.Tensor], object], x: torch.Tensor) -> float:
    t0 = time.perf_counter()
    layer(x)
    return (time.perf_counter() - t0) * 1e3


def measure(cls: _Format, shape: tuple[int, int]) -> Crossover:
    """Time ``cls``'s product both ways for a weight of ``shape`` (N, K; at most
    :data:`PROBE_MAX_ROWS` of its rows) at :data:`PROBE_ROWS` rows of input (interleaved,
    best of :data:`PROBE_REPEATS`) and choose (:func:`choose`)."""
    g = torch.Generator().manual_seed(0)
    n, k = min(shape[0], PROBE_MAX_ROWS), shape[1]
    layer = cls.from_float(torch.randn(n, k, generator=g) * 0.02)
    kernel_ms, dense_ms = [], []
    with torch.inference_mode():
        for m in PROBE_ROWS:
            x = torch.randn(m, k, generator=g)
            best = {1: float("inf"), KERNEL_ALWAYS: float("inf")}
            for i in range(PROBE_REPEATS + 1):
                for side in (1, KERNEL_ALWAYS) if i % 2 else (KERNEL_ALWAYS, 1):
                    layer.dense_from_tokens = side
                    t = _timed(layer, x)
                    if i:  # the first round warms both up
                        best[side] = min(best[side], t)
            kernel_ms.append(round(best[KERNEL_ALWAYS], 4))
            dense_ms.append(round(best[1], 4))
    threads = torch.get_num_threads()
    busy = f", load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    return Crossover(
        choose(PROBE_ROWS, kernel_ms, dense_ms, cls.default_dense_from),
        f"measured on this machine at {threads} thread{'s' * (threads != 1)}{busy}",
        PROBE_ROWS,
        tuple(kernel_ms),
        tuple(dense_ms),
    )


_lock = threading.RLock()  # measuring a crossover asks for the GEMM choice
# This process's crossovers by format, weight shape, threads and kernel settings.
_found: dict[tuple[Any, ...], Crossover] = {}


def _entry(name: str, shape: tuple[int, int]) -> str:
    return f"{name} {shape[0]}x{shape[1]}"


def _stored(entry: Any, path: Path | None) -> Crossover | None:
    try:
        return Crossover(
            int(entry["dense_from"]),
            str(entry["source"]) + ("" if path is None else f"; cached in {path}"),
            *(tuple(entry[f]) for f in ("rows", "kernel_ms", "dense_ms")),
        )
    except (KeyError, TypeError, ValueError):
        return None


def crossover(
    cls: _Format, shape: tuple[int, int], *, measure_now: bool = True
) -> Crossover | None:
    """``cls``'s crossover here for a weight of ``shape`` (N, K):
    ``ATTNLAB_CROSSOVER=defaults`` its default; else the cached measurement of this
    machine, measured now if there is none (None instead when ``measure_now`` is false).

    Raises:
        ValueError: ``ATTNLAB_CROSSOVER`` set to anything but ``defaults`` or ``measure``.
    """
    mode = os.environ.get(CROSSOVER_ENV, "").strip() or "measure"
    if mode not in ("defaults", "measure"):
        raise ValueError(f"{CROSSOVER_ENV} must be 'defaults' or 'measure', got {mode!r}")
    if mode == "defaults":
        return Crossover(cls.default_dense_from, f"{CROSSOVER_ENV}=defaults")
    # Asked on every prompt product: what can change within a process, looked up first.
    memo = (cls.name, shape, *_process_settings())
    found = _found.get(memo)
    if found is not None:
        return found
    key = machine_key()
    path = _cache_file(key)
    entry = _entry(cls.name, shape)
    with _lock:
        if memo in _found:
            return _found[memo]
        found = _stored(_read(path).get("formats", {}).get(entry), path)
        if found is None:
            if not measure_now:
                return None
            try:
                found = measure(cls, shape)
            except (ValueError, RuntimeError) as e:  # kept for this process, not cached
                found = Crossover(cls.default_dense_from, f"the default: measuring failed ({e})")
            else:
                _write_entry(path, key, entry, asdict(found))
        _found[memo] = found
        return found


def measured_here() -> tuple[Path, dict[str, Crossover]]:
    """Where this machine's crossovers are kept (with this process's threads and
    settings), and those measured so far by ``"<format> <N>x<K>"``; measures nothing."""
    path = _cache_file(machine_key())
    entries = _read(path).get("formats", {})
    found = {
        name: _stored(entry, None) for name, entry in sorted(entries.items()) if name != GEMM_ENTRY
    }
    return path, {name: c for name, c in found.items() if c is not None}


def dense_from(cls: _Format, shape: tuple[int, int]) -> int:
    """From how many rows ``cls``'s product runs dense here for a weight of ``shape``
    (:func:`crossover`)."""
    found = crossover(cls, shape)
    assert found is not None
    return found.dense_from


# --------------------------------------------------------------------------- float32 GEMM
#: The cache entry of the float32 GEMM choice, and the product it is measured on (M, K, N).
GEMM_ENTRY = "float32 gemm"
GEMM_PROBE = (128, 1024, 2048)
#: The GEMMs a float32 dense product can run on.
GEMMS = ("mkl", "onednn")


def _onednn_mm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` by oneDNN's float32 matmul (the op PyTorch's compiler calls for a
    linear layer on the CPU); ``weight`` (N, K)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")  # type: ignore[no-any-return]


def _gemm_calls() -> dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    calls: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
        "mkl": lambda x, w: torch.mm(x, w.t())
    }
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        calls["onednn"] = _onednn_mm
    return calls


def measure_gemm() -> tuple[str, dict[str, float]]:
    """Time each available float32 GEMM on :data:`GEMM_PROBE` (interleaved, best of
    :data:`PROBE_REPEATS`): the faster by more than :data:`MARGIN` (else PyTorch's ``mm``),
    and each one's ms. A GEMM that fails or gives another product is left out."""
    g = torch.Generator().manual_seed(0)
    m, k, n = GEMM_PROBE
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    expected = torch.mm(x, w.t())
    calls = {}
    for name, call in _gemm_calls().items():
        try:
            got = call(x, w)
        except RuntimeError:
            continue
        if got.shape == expected.shape and torch.allclose(got, expected, rtol=1e-4, atol=1e-3):
            calls[name] = call
    best = dict.fromkeys(calls, float("inf"))
    with torch.inference_mode():
        for i in range(PROBE_REPEATS):
            for name in list(calls)[:: 1 if i % 2 else -1]:
                t0 = time.perf_counter()
                calls[name](x, w)
                best[name] = min(best[name], (time.perf_counter() - t0) * 1e3)
    ms = {name: round(t, 4) for name, t in best.items()}
    chosen = "mkl"
    if "onednn" in ms and ms["onednn"] < (1 - MARGIN) * ms["mkl"]:
        chosen = "onednn"
    return chosen, ms


def float32_gemm(*, measure_now: bool = True) -> tuple[str, str] | None:
    """``(name, why)``: the GEMM of this machine's float32 dense products, ``"mkl"``
    (PyTorch's ``mm``) or ``"onednn"``; measured at first use and cached beside the
    crossovers (``ATTNLAB_CROSSOVER=defaults``: ``"mkl"``, nothing measured). None when
    it is not measured yet and ``measure_now`` is false."""
    mode = os.environ.get(CROSSOVER_ENV, "").strip() or "measure"
    if mode == "defaults":
        return "mkl", f"{CROSSOVER_ENV}=defaults"
    memo = (GEMM_ENTRY, *_process_settings())
    known = _gemm.get(memo)
    if known is not None:
        return known
    key = machine_key()
    path = _cache_file(key)
    with _lock:
        entry = _read(path).get("formats", {}).get(GEMM_ENTRY)
        try:
            chosen, ms = str(entry["chosen"]), {str(a): float(b) for a, b in entry["ms"].items()}
            if chosen not in GEMMS:
                raise ValueError(chosen)
        except (KeyError, TypeError, ValueError, AttributeError):
            if not measure_now:
                return None
            chosen, ms = measure_gemm()
            _write_entry(path, key, GEMM_ENTRY, {"chosen": chosen, "ms": ms})
        times = ", ".join(f"{name} {t:.2f} ms" for name, t in ms.items())
        found = (chosen, f"measured on this machine: {times} for a {GEMM_PROBE} product")
        _gemm[memo] = found
        return found


_gemm: dict[tuple[Any, ...], tuple[str, str]] = {}


def chosen_gemm() -> str:
    """The name of :func:`float32_gemm`'s choice (measured now if it is not yet)."""
    found = float32_gemm()
    assert found is not None
    return found[0]


def dense_mm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` (x (M, K), weight (N, K), any strides) in ``x``'s dtype: a prompt's
    dense product. float32 goes to this machine's faster GEMM (:func:`float32_gemm`);
    bfloat16 to PyTorch's ``mm`` (oneDNN's bf16 kernels)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32 and chosen_gemm() == "onednn":
        return _onednn_mm(x, weight)
    return torch.mm(x, weight.t())
