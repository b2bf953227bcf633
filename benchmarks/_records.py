"""One JSON record per benchmark run, written into ``benchmarks/results/``.

Every benchmark script opens a :class:`Recorder` before it measures and calls
:meth:`Recorder.write` at the end. A record says what was measured, the command that
measured it, the commit and whether the tree had local changes, the date, the machine
(CPU model, cores, torch), the torch threads, how quiet the machine was (load average
before and after, and the CPU other processes used during the whole run, read from
``/proc/stat`` as ``benchmarks/_quiet.py`` does), and every figure with its named peer.

The documentation's benchmarks page is generated from the latest record of each
(benchmark, config) by ``benchmarks/make_docs_page.py``; nobody types a number into it.

A figure is one measured value. When it is compared with a peer measured in the same
run (interleaved), the record holds the peer's name and value and their ratio
``value / peer_value``; ``better`` says which way is good (``"higher"`` for tokens/s,
``"lower"`` for milliseconds or bytes).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import itertools
import json
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from _isa import ISAS
from _quiet import _machine_busy_s, _own_cpu_s

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parents[1]

# Other processes using less than this many cores on average during the run: "quiet".
QUIET_CORES = 0.25


@dataclass(frozen=True)
class Figure:
    """One measured value and, when there is one, the peer it was measured against."""

    name: str
    value: float
    unit: str
    peer: str | None = None
    peer_value: float | None = None
    ratio: float | None = None
    better: Literal["higher", "lower"] = "higher"
    note: str | None = None


def _loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def _cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    m = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    return m.group(1).strip() if m else platform.machine()


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


# The vector extensions kernels are chosen by, as /proc/cpuinfo names them.
SIMD = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512_vnni",
        "avx512_bf16", "amx_bf16", "amx_int8", "asimd", "sve")  # fmt: skip


def _simd() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    m = re.search(r"^(?:flags|Features)\s*:\s*(.+)$", text, re.M)
    have = set(m.group(1).split()) if m else set()
    return [f for f in SIMD if f in have]


def machine() -> dict[str, Any]:
    """The machine a record was measured on (its SIMD features among them)."""
    import torch

    return {
        "cpu": _cpu_model(),
        "simd": _simd(),
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "isa_caps": {k: os.environ[k] for k in sorted(_CAP_VARS) if k in os.environ},
    }


_CAP_VARS = {name for caps in ISAS.values() for name in caps}


def running_isa() -> str | None:
    """The CPU class of ``benchmarks/_isa.py`` whose caps this process runs under: None
    with no caps, ``"capped"`` for caps that are no class's."""
    caps = {k: os.environ[k] for k in _CAP_VARS if k in os.environ}
    if not caps:
        return None
    return next((isa for isa, want in ISAS.items() if want and want == caps), "capped")


@dataclass
class Recorder:
    """Collects the figures of one run and writes them as one record.

    Args:
        benchmark: the script's name, e.g. ``"bench_generate"``.
        config: which configuration of the script ran (``"smollm2"``, ``"causal"``):
            the docs page shows the latest record of each (benchmark, config).
        measured: one sentence saying what was measured, and how.
        threads: the torch threads the run used.
    """

    benchmark: str
    config: str
    measured: str
    threads: int
    figures: list[Figure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    _load_before: list[float] = field(default_factory=_loadavg)
    _busy0: float | None = field(default_factory=_machine_busy_s)
    _own0: float = field(default_factory=_own_cpu_s)
    _wall0: float = field(default_factory=time.perf_counter)
    _started: str = field(
        default_factory=lambda: _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    )

    def __post_init__(self) -> None:
        # A run under a CPU class's caps (benchmarks/_isa.py) is that class's record, not
        # this machine's: its config says so, and the machine lists the caps.
        isa = running_isa()
        if isa is not None and f"-{isa}" not in self.config:
            self.config = f"{self.config}-{isa}"

    def add(
        self,
        name: str,
        value: float,
        unit: str,
        *,
        peer: str | None = None,
        peer_value: float | None = None,
        better: Literal["higher", "lower"] = "higher",
        note: str | None = None,
    ) -> Figure:
        """Add one figure; with ``peer_value`` its ratio ``value / peer_value``.

        ``better`` says which way is good: ``"higher"`` (tokens/s) or ``"lower"``
        (milliseconds, bytes).
        """
        ratio = None
        if peer_value is not None and peer_value:
            ratio = value / peer_value
        fig = Figure(
            name=name,
            value=float(value),
            unit=unit,
            peer=peer,
            peer_value=None if peer_value is None else float(peer_value),
            ratio=None if ratio is None else round(ratio, 4),
            better=better,
            note=note,
        )
        self.figures.append(fig)
        return fig

    def note(self, text: str) -> None:
        """A line of context the page prints under the record's table."""
        self.notes.append(text)

    def quiet(self) -> dict[str, Any]:
        """How busy the machine was during the run so far."""
        busy1, own1, wall1 = _machine_busy_s(), _own_cpu_s(), time.perf_counter()
        others = None
        if self._busy0 is not None and busy1 is not None and wall1 > self._wall0:
            used = (busy1 - self._busy0) - (own1 - self._own0)
            others = round(max(used, 0.0) / (wall1 - self._wall0), 3)
        return {
            "loadavg_before": self._load_before,
            "loadavg_after": _loadavg(),
            "other_processes_cores": others,
            "quiet": None if others is None else others < QUIET_CORES,
            "wall_s": round(wall1 - self._wall0, 1),
        }

    def record(self, command: list[str] | None = None) -> dict[str, Any]:
        """The record as a dict (what :meth:`write` stores)."""
        argv = command if command is not None else sys.argv
        script = Path(argv[0])
        if script.is_absolute():
            with contextlib.suppress(ValueError):
                script = script.relative_to(ROOT)
        # the code measured; records already written (an earlier model of the same run)
        # are results, not changes to it
        status = _git("status", "--porcelain", "--", "src", "benchmarks", ":!benchmarks/results")
        return {
            "benchmark": self.benchmark,
            "config": self.config,
            "measured": self.measured,
            "command": " ".join(["python", str(script), *argv[1:]]),
            "commit": _git("rev-parse", "--short=10", "HEAD"),
            "local_changes": bool(status) if status is not None else None,
            "date": self._started,
            "machine": machine(),
            "threads": self.threads,
            "quiet": self.quiet(),
            "figures": [asdict(f) for f in self.figures],
            "notes": self.notes,
        }

    def write(self, command: list[str] | None = None, folder: Path | None = None) -> Path:
        """Write the record to ``benchmarks/results/`` and say where, on stderr. Two runs
        of one config that end in the same second (two seeds run side by side) each keep
        their record: the second file's name gets ``-2`` (``-3``, ...), never overwriting."""
        rec = self.record(command)
        folder = RESULTS if folder is None else folder
        folder.mkdir(parents=True, exist_ok=True)
        stamp = rec["date"].replace(":", "").replace("-", "").replace("+0000", "Z")
        text = json.dumps(rec, indent=1, ensure_ascii=False) + "\n"
        for n in itertools.count(1):
            suffix = "" if n == 1 else f"-{n}"
            path = folder / f"{self.benchmark}--{self.config}--{stamp}{suffix}.json"
            try:
                with path.open("x", encoding="utf-8") as f:  # exclusive: never another's
                    f.write(text)
                break
            except FileExistsError:
                continue
        print(f"record written: {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}",
              file=sys.stderr)  # fmt: skip
        return path


def load_records(folder: Path | None = None) -> list[dict[str, Any]]:
    """Every record in ``folder`` (default ``benchmarks/results``), oldest first."""
    folder = RESULTS if folder is None else folder
    recs = [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]
    return sorted(recs, key=lambda r: r["date"])


def cpu_of(record: dict[str, Any]) -> str:
    """The CPU a record was measured on: the model name and the widest SIMD it has, e.g.
    ``"AMD EPYC (AVX-512 with BF16)"``, and ``AVX-VNNI`` where it has that too (two
    generations of one model name can differ only there: AMD's Zen 4 EPYC has no AVX-VNNI,
    its Zen 5 has it, and their speeds differ). That is the machine's own class, also for a
    run under a smaller class's caps (its config names the class it ran as)."""
    m = record.get("machine") or {}
    simd = set(m.get("simd") or [])
    if "simd" not in m:  # a record from before the field
        level = "SIMD not recorded"
    elif simd & {"amx_bf16", "amx_int8"}:
        level = "AVX-512 with AMX"
    elif "avx512_bf16" in simd:
        level = "AVX-512 with BF16"
    elif "avx512f" in simd:
        level = "AVX-512"
    elif "avx2" in simd:
        level = "AVX2"
    elif simd & {"asimd", "sve"}:
        level = "Arm"
    else:
        level = "no AVX2"
    if "avx_vnni" in simd and level.startswith("AVX-512"):
        level += ", AVX-VNNI"
    return f"{m.get('cpu') or 'unknown CPU'} ({level})"


def latest(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The newest record of each (CPU, benchmark, config), sorted by CPU, benchmark and
    config: a record from another CPU never stands in for this one's (:func:`cpu_of`)."""
    newest: dict[tuple[str, str, str], dict[str, Any]] = {}
    for r in records:
        newest[(cpu_of(r), r["benchmark"], r["config"])] = r  # records are oldest first
    # A record from before the SIMD field gives way to one of the same CPU model, benchmark
    # and config that has it (written later: the field has been in every record since).
    told = {
        ((r.get("machine") or {}).get("cpu"), r["benchmark"], r["config"])
        for r in newest.values()
        if "simd" in (r.get("machine") or {})
    }
    return [
        newest[k]
        for k in sorted(newest)
        if "simd" in (newest[k].get("machine") or {})
        or ((newest[k].get("machine") or {}).get("cpu"), k[1], k[2]) not in told
    ]
