"""Timed pairs that know how busy the machine was while they ran (``/proc/stat``).

On a shared machine a best-of taken while another process holds a core misleads: the
two-thread kernels slow down far more than one-thread code. :func:`timed_pairs` runs
the named functions interleaved (order alternating), reads the machine's busy time
around each pair, and keeps a pair only when the CPU time *other* processes used
during it stays under ``max_other`` of one core. The summary line says how many pairs
were quiet and how busy the rest of the machine was.

Every time is kept (:attr:`PairResult.times`), so a script can report the median of the
per-pair ratios between two names (:meth:`PairResult.ratio`, each pair adjacent in time,
so slow drift of the machine cancels) and their spread, not only a best-of.

A call too short to time alone (a kernel of microseconds) is timed as a run of calls:
:func:`call_run` makes the run, and each of its times divided by its length is the mean
time of one call.
"""

from __future__ import annotations

import os
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

#: How a figure's note gives the median of its per-round ratios (:meth:`PairResult.ratio_note`).
MEDIAN_NOTE = "median of the per-round ratios"


def _machine_busy_s() -> float | None:
    """Busy CPU seconds of the whole machine since boot (all cores), or None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    ticks = [int(x) for x in fields]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    """CPU seconds of this process and of its finished children (a peer tool the benchmark
    ran, e.g. llama-bench, is its own work, not another process's load)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime + c.ru_utime + c.ru_stime


@dataclass
class PairResult:
    """Best quiet time per name, every time, and how quiet the run was."""

    best: dict[str, float]
    quiet_pairs: int
    pairs: int
    other_load: list[float] = field(default_factory=list)  # cores used by others, per pair
    # name -> wall time of each kept pair (the quiet ones; all when none was quiet)
    times: dict[str, list[float]] = field(default_factory=dict)

    def median(self, name: str) -> float:
        """Median wall time of ``name`` over the kept pairs."""
        return statistics.median(self.times[name])

    def ratios(self, slow: str, fast: str) -> list[float]:
        """``time[slow] / time[fast]`` within each kept pair, sorted (> 1: ``fast`` is faster)."""
        return sorted(a / b for a, b in zip(self.times[slow], self.times[fast], strict=True))

    def ratio(self, slow: str, fast: str) -> tuple[float, float, float]:
        """(median, lowest, highest) of the per-pair ratios :meth:`ratios`."""
        r = self.ratios(slow, fast)
        return statistics.median(r), r[0], r[-1]

    def ratio_note(self, slow: str, fast: str) -> str:
        """:meth:`ratio` as a figure's note, e.g. ``"median of the per-round ratios 1.35x
        (1.30-1.39)"`` (:data:`MEDIAN_NOTE`; ``benchmarks/cpu_targets.py`` reads it back)."""
        median, low, high = self.ratio(slow, fast)
        return f"{MEDIAN_NOTE} {median:.2f}x ({low:.2f}-{high:.2f})"

    def quietness(self) -> str:
        """e.g. ``"quiet pairs 4/6, others used 0.05-1.30 cores (loadavg 0.8)"``."""
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        lo = min(self.other_load, default=float("nan"))
        hi = max(self.other_load, default=float("nan"))
        return (
            f"quiet pairs {self.quiet_pairs}/{self.pairs}, other processes used "
            f"{lo:.2f}-{hi:.2f} cores during pairs (loadavg {load:.2f})"
        )


def call_run(fn: Callable[[], object], seconds: float) -> tuple[Callable[[], None], int]:
    """``fn`` called back to back for about ``seconds`` in all, and how many calls that is.

    ``fn`` runs twice first (a warm-up, then a call that sets the count). Time the run
    (e.g. in :func:`timed_pairs`) and divide by the count: the mean time of one call.
    """
    fn()
    t0 = time.perf_counter()
    fn()
    calls = max(1, int(seconds / max(time.perf_counter() - t0, 1e-6)))

    def run() -> None:
        for _ in range(calls):
            fn()

    return run, calls


def timed_pairs(
    fns: dict[str, Callable[[], object]],
    pairs: int,
    *,
    max_other: float = 0.25,
    before: Callable[[str], object] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> PairResult:
    """Run ``fns`` ``pairs`` times interleaved; best time per name over quiet pairs.

    A pair is quiet when the CPU used by other processes during it stays below
    ``max_other`` cores. When no pair is quiet, the best over all pairs is reported
    (and the summary says 0 quiet pairs). ``before(name)`` runs untimed before each
    call (e.g. drop the model the previous load made, so that freeing it is not timed).
    ``clock`` times each call: wall time, or ``time.thread_time`` for the calling
    thread's CPU time.
    """
    best_quiet = {name: float("inf") for name in fns}
    best_all = dict(best_quiet)
    kept: dict[str, list[float]] = {name: [] for name in fns}
    every: dict[str, list[float]] = {name: [] for name in fns}
    quiet, other = 0, []
    for rep in range(pairs):
        items = list(fns.items())
        b0, c0, w0 = _machine_busy_s(), _own_cpu_s(), time.perf_counter()
        times = {}
        for name, fn in items if rep % 2 == 0 else reversed(items):
            if before is not None:
                before(name)
            t0 = clock()
            fn()
            times[name] = clock() - t0
        b1, c1, w1 = _machine_busy_s(), _own_cpu_s(), time.perf_counter()
        used = ((b1 - b0) - (c1 - c0)) / (w1 - w0) if b0 is not None and b1 is not None else 0.0
        other.append(max(used, 0.0))
        for name, t in times.items():
            best_all[name] = min(best_all[name], t)
            every[name].append(t)
        if used < max_other:
            quiet += 1
            for name, t in times.items():
                best_quiet[name] = min(best_quiet[name], t)
                kept[name].append(t)
    if quiet:
        return PairResult(best_quiet, quiet, pairs, other, kept)
    return PairResult(best_all, quiet, pairs, other, every)
