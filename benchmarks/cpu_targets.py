"""The speed targets every CPU class must meet, checked against the newest records
measured on one CPU: llama.cpp's decode, prefill and decode at depth (and the repacking
build's, where it runs), the first token against `import torch`, and the attention
variants on blockwise.

    python benchmarks/cpu_targets.py              # this machine's CPU
    python benchmarks/cpu_targets.py --cpu "EPYC (AVX-512 with BF16)"   # another CPU
    python benchmarks/cpu_targets.py --list       # the CPUs that have records

Each line is one target: the record it is read from (benchmark and config), the figure,
the bound, the value, the record's commit and date, and "met", "NOT MET" or "missing"
(then the command that measures it). A record that ran on a busy machine is marked so.
Nothing is measured here: run the commands, then this. The exit status is 1 when a
target is not met or has no record.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

sys.path[:0] = [str(Path(__file__).resolve().parent)]
from _quiet import MEDIAN_NOTE  # noqa: E402
from _records import cpu_of, latest, load_records, machine  # noqa: E402

MODELS = ("smollm2-135m-instruct", "gemma3-270m")
_MEDIAN = re.compile(re.escape(MEDIAN_NOTE) + r" ([0-9.]+)x")


@dataclass(frozen=True)
class Target:
    """One bound on one figure of one (benchmark, config) record.

    Attributes:
        benchmark: the record's benchmark (its script's name).
        config: the record's configuration.
        figure: the figure's name in the record.
        bound: the limit the figure must reach.
        sense: ``"at least"`` or ``"at most"``.
        of: ``"ratio"`` (to the figure's peer), ``"median"`` (of the per-round ratios,
            from the figure's note: :data:`_quiet.MEDIAN_NOTE`) or ``"value"`` (the figure
            itself).
        command: the command that writes the record.
    """

    benchmark: str
    config: str
    figure: str
    bound: float
    sense: Literal["at least", "at most"]
    of: Literal["ratio", "median", "value"]
    command: str

    def reading(self, record: dict[str, Any]) -> float | None:
        """The figure's ratio or value in ``record``; None where it has no such figure."""
        for fig in record.get("figures", []):
            if fig["name"] != self.figure:
                continue
            if self.of == "value":
                return float(fig["value"])
            if self.of == "median":
                median = _MEDIAN.search(fig.get("note") or "")
                return None if median is None else float(median.group(1))
            return None if fig.get("ratio") is None else float(fig["ratio"])
        return None

    def met(self, reading: float) -> bool:
        return reading >= self.bound if self.sense == "at least" else reading <= self.bound


def targets() -> list[Target]:
    """Every target, in the order they are printed."""
    out: list[Target] = []
    llama = "python benchmarks/bench_llama_cpp.py --dtypes int4 --model {m}"
    for m in MODELS:
        for suffix, flags in (("", ""), ("-avx2", " --isa avx2"), ("-repack", " --repack")):
            cmd = llama.format(m=m) + flags
            out += [
                Target("bench_llama_cpp", m + suffix, "attnlab int4 decode (64+128)", 1.0,
                       "at least", "ratio", cmd),
                Target("bench_llama_cpp", m + suffix, "attnlab int4 prefill of 512", 1.0,
                       "at least", "ratio", cmd),
                Target("bench_llama_cpp", m + suffix,
                       "attnlab int4 decode-path argmax agreement with float32", 0.95,
                       "at least", "value", cmd),
            ]  # fmt: skip
        out.append(
            Target("bench_llama_cpp", f"{m}-depth4096",
                   "attnlab int4 decode at depth 4096 (32 tokens)", 1.0, "at least", "ratio",
                   llama.format(m=m) + " --depth 4096")
        )  # fmt: skip
    first = "python benchmarks/bench_first_token.py --rounds 7"
    for m in MODELS:
        for dtype in ("float32", "int4"):
            out.append(
                Target("bench_first_token", m, f"first token, --dtype {dtype}", 1.5,
                       "at most", "median", first)
            )  # fmt: skip
    variants = "python benchmarks/bench_attention.py --variants --reps 3"
    for name, bound in (("alibi", 1.3), ("relbias", 1.3), ("softcap", 1.3)):
        out.append(
            Target("bench_attention", "variants", f"{name}, T=4096, fwd", bound, "at most",
                   "ratio", variants)
        )  # fmt: skip
    out.append(
        Target("bench_attention", "variants", "window, T=8192, fwd", 0.25, "at most", "ratio",
               variants)
    )  # fmt: skip
    return out


@dataclass(frozen=True)
class Check:
    """A target read from a CPU's newest record of its (benchmark, config)."""

    target: Target
    record: dict[str, Any] | None
    reading: float | None

    @property
    def status(self) -> str:
        if self.reading is None:
            return "missing"
        return "met" if self.target.met(self.reading) else "NOT MET"


def check(records: Iterable[dict[str, Any]], cpu: str) -> list[Check]:
    """Every target read from the newest of ``records`` measured on ``cpu`` (as
    :func:`_records.cpu_of` names it)."""
    newest = {(r["benchmark"], r["config"]): r for r in latest(list(records)) if cpu_of(r) == cpu}
    out = []
    for t in targets():
        rec = newest.get((t.benchmark, t.config))
        out.append(Check(t, rec, None if rec is None else t.reading(rec)))
    return out


def _line(c: Check) -> str:
    t = c.target
    unit = "" if t.of == "value" else "x"
    head = f"{c.status:8} {t.benchmark} {t.config}: {t.figure} {t.sense} {t.bound:g}{unit}"
    if c.record is None or c.reading is None:
        return f"{head}\n         run: {t.command}"
    commit = (c.record.get("commit") or "?")[:10]
    busy = "" if (c.record.get("quiet") or {}).get("quiet", True) else ", busy machine"
    return f"{head}: {c.reading:.3g}{unit} (commit {commit}, {c.record['date'][:10]}{busy})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", help="a CPU whose records are here (part of its name)")
    parser.add_argument("--list", action="store_true", help="the CPUs that have records")
    parser.add_argument("--results", type=Path, help="the records' folder (default: ours)")
    args = parser.parse_args(argv)
    records = load_records(args.results)
    cpus = sorted({cpu_of(r) for r in records})
    if args.list:
        print("\n".join(cpus))
        return 0
    if args.cpu is None:
        cpu = cpu_of({"machine": machine()})
    else:
        named = [c for c in cpus if args.cpu.lower() in c.lower()]
        if len(named) != 1:
            found = "none" if not named else ", ".join(named)
            parser.error(f"--cpu {args.cpu!r} names {found}; the CPUs with records: "
                         + "; ".join(cpus))  # fmt: skip
        cpu = named[0]
    checks = check(records, cpu)
    print(f"{cpu}: {sum(c.status == 'met' for c in checks)} of {len(checks)} targets met")
    for c in checks:
        print(_line(c))
    return 0 if all(c.status == "met" for c in checks) else 1


if __name__ == "__main__":
    try:
        status = main()
    except BrokenPipeError:  # read through `| head`: what was wanted has been printed
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        status = 0
    raise SystemExit(status)
