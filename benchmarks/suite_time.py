"""Where the test suite's time goes, by area of the code, as a record.

Runs the README's test command (``python -m pytest``, extra arguments passed on) with a
JUnit report, or reads one made before (``--junit FILE``), and sums every test's time
(setup, call and teardown, as pytest reports them) by area: the attention core, the
families and file formats, the llama.cpp corpus, fuzzing, the docs and the notebook,
training, serve and the browser, the compiled step and the weight formats, explain, the
CLI, several processes. The record holds the wall time against the budget the README
states, and each area's share of the workers' time.

Usage::

    python benchmarks/suite_time.py                 # the whole suite, as CI runs it
    python benchmarks/suite_time.py -- -m "not slow"
    python benchmarks/suite_time.py --junit report.xml --wall 640
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

from _records import ROOT, Recorder

#: The README's budget for ``python -m pytest`` with every extra installed, in seconds,
#: on the slowest machine class CI may get (an AVX-512 Xeon without VNNI, 2 cores).
BUDGET_S = 2700.0

#: The areas of the suite: the folders of tests/, each the tests of one area of the code.
AREAS: dict[str, str] = {
    "attention": "attention core",
    "book": "the book's ladder and GPT",
    "families": "families",
    "files": "model files and stores",
    "llama_cpp": "llama.cpp corpus",
    "decode": "decode step, native and weight formats",
    "explain": "explain",
    "serve": "serve and browser",
    "cli": "cli",
    "train": "training",
    "distributed": "several processes",
    "project": "docs, notebook, records, imports",
}


def area_of(module: str) -> str:
    """The area of a test module (``tests/<folder>/test_x.py``, or JUnit's dotted
    ``tests.<folder>.test_x``); ``other`` if it is in no area's folder."""
    parts = module.replace("\\", "/").replace("/", ".").split(".")
    for folder in parts:
        if folder in AREAS:
            return AREAS[folder]
    return "other"


def times_by_area(junit: Path) -> tuple[Counter[str], Counter[str], int]:
    """Seconds and test counts by area from a JUnit XML report, and the failures."""
    seconds: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    failed = 0
    for case in ET.parse(junit).getroot().iter("testcase"):
        area = area_of(case.get("classname", "") or case.get("file", ""))
        seconds[area] += float(case.get("time", 0.0))
        counts[area] += 1
        failed += sum(1 for child in case if child.tag in ("failure", "error"))
    return seconds, counts, failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--junit", type=Path, help="read this JUnit report instead of running")
    parser.add_argument("--wall", type=float, help="the wall time of that run, in seconds")
    parser.add_argument("--config", default="full", help="the record's config name")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args(argv)
    rec = Recorder(
        "suite_time",
        args.config,
        "the README's test command: wall time against its budget, and the workers' time "
        "by area of the code",
        threads=1,
    )
    if args.junit is None:
        report = Path(tempfile.mkdtemp()) / "junit.xml"
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "pytest", f"--junitxml={report}", *args.pytest_args],
            cwd=ROOT,
            check=False,
        )
        wall = time.perf_counter() - start
        if done.returncode not in (0, 1):
            print(f"pytest exited with {done.returncode}", file=sys.stderr)
            return done.returncode
    else:
        report, wall = args.junit, args.wall
        if wall is None:
            parser.error("--junit needs --wall (the run's wall time in seconds)")
    seconds, counts, failed = times_by_area(report)
    total = sum(seconds.values())
    rec.add("wall time", round(wall, 1), "s", peer="the README's budget", peer_value=BUDGET_S,
            better="lower")  # fmt: skip
    rec.add("workers' time, all tests", round(total, 1), "s", better="lower")
    for area, s in seconds.most_common():
        rec.add(
            area,
            round(s, 1),
            "s",
            better="lower",
            note=f"{counts[area]} tests, {100 * s / total:.0f}% of the workers' time",
        )
    rec.note(f"{sum(counts.values())} tests, {failed} failed; pytest arguments: "
             f"{' '.join(args.pytest_args) or '(none)'}")  # fmt: skip
    rec.write(["benchmarks/suite_time.py", *(argv if argv is not None else sys.argv[1:])])
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
