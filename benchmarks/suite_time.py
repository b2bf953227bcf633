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
    python benchmarks/suite_time.py --costs         # also rewrite tests/file_costs.json

``--costs`` writes each test file's seconds to ``tests/file_costs.json``, the table the
suite's ``conftest.py`` orders the files by (longest first, so that no long file starts
last on one worker while the other has nothing left to run), and the tests that took a
second or more, which the suite marks ``slow``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from pathlib import Path

from _records import ROOT, Recorder

sys.path.insert(0, str(ROOT / "tests"))
from file_order import SLOW_TEST_S

#: The README's budget for ``python -m pytest`` with every extra installed, in seconds,
#: on the slowest machine class CI may get (an AVX-512 Xeon without VNNI, 2 cores).
BUDGET_S = 2700.0

#: The table of seconds per test file that tests/conftest.py orders the files by.
COSTS = ROOT / "tests" / "file_costs.json"

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


def times_by_area(junit: Path) -> tuple[dict[str, float], Counter[str], int]:
    """Seconds and test counts by area from a JUnit XML report, and the failures."""
    seconds: dict[str, float] = defaultdict(float)
    counts: Counter[str] = Counter()
    failed = 0
    for case in ET.parse(junit).getroot().iter("testcase"):
        area = area_of(case.get("classname", "") or case.get("file", ""))
        seconds[area] += float(case.get("time", 0.0))
        counts[area] += 1
        failed += sum(1 for child in case if child.tag in ("failure", "error"))
    return seconds, counts, failed


def file_of(classname: str) -> str | None:
    """The test file of a JUnit classname (``tests.train.test_x`` or
    ``tests.train.test_x.TestClass``), as pytest names it from the root; None if no file
    of the repository matches."""
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        path = "/".join(parts[:end]) + ".py"
        if (ROOT / path).is_file():
            return path
    return None


def times_by_file(junit: Path) -> dict[str, float]:
    """Seconds of each test file (setup, call and teardown of its tests) from a JUnit
    report, the longest first."""
    seconds: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit).getroot().iter("testcase"):
        path = file_of(case.get("classname", ""))
        if path is not None:
            seconds[path] += float(case.get("time", 0.0))
    return {path: round(s, 2) for path, s in sorted(seconds.items(), key=lambda kv: -kv[1])}


def node_id(classname: str, name: str) -> str | None:
    """pytest's node id of a JUnit test case (``tests.train.test_x`` + ``test_y[a]`` ->
    ``tests/train/test_x.py::test_y[a]``; a class's name between them); None if no file of
    the repository matches."""
    path = file_of(classname)
    if path is None:
        return None
    inner = classname.split(".")[path.count("/") + 1 :]
    return "::".join([path, *inner, name])


def slow_tests(junit: Path, threshold: float = SLOW_TEST_S) -> dict[str, float]:
    """Node ids and seconds of the tests that took ``threshold`` seconds or more (setup,
    call and teardown), the longest first."""
    found: dict[str, float] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        seconds = float(case.get("time", 0.0))
        node = node_id(case.get("classname", ""), case.get("name", ""))
        if node is not None and seconds >= threshold:
            found[node] = round(seconds, 2)
    return dict(sorted(found.items(), key=lambda kv: -kv[1]))


def write_costs(junit: Path, out: Path = COSTS) -> None:
    """Write the per-file seconds of a run as the table the suite orders its files by, and
    the tests it marks ``slow`` for taking :data:`SLOW_TEST_S` seconds or more."""
    table = {
        "measured": "seconds of each test file's tests in one run of the whole suite, "
        "written by benchmarks/suite_time.py --costs; tests/conftest.py runs the files "
        f"longest first, and marks slow the tests under slow_tests (at least {SLOW_TEST_S:g} s "
        "each in that run)",
        "seconds": times_by_file(junit),
        "slow_tests": slow_tests(junit),
    }
    out.write_text(json.dumps(table, indent=1) + "\n", encoding="utf-8")
    print(
        f"wrote {out} ({len(table['seconds'])} files, "
        f"{len(table['slow_tests'])} tests of {SLOW_TEST_S:g} s or more)"
    )


def _cache_state() -> str:
    """Whether attnlab's cache was empty when the run started: with an empty one (as in CI
    and for a new user) the run also compiles every native build and makes the packaged
    model files, which a warm cache reads back."""
    from attnlab.paths import cache_dir

    folder = cache_dir()
    empty = not folder.is_dir() or not any(folder.iterdir())
    return f"attnlab cache {'empty' if empty else 'in use'} at the start ({folder})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--junit", type=Path, help="read this JUnit report instead of running")
    parser.add_argument("--wall", type=float, help="the wall time of that run, in seconds")
    parser.add_argument("--config", default="full", help="the record's config name")
    parser.add_argument(
        "--costs", action="store_true", help="also write tests/file_costs.json from the run"
    )
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args(argv)
    if args.costs and any(
        a in ("-m", "-k") or a.startswith(("-m=", "-k=")) for a in args.pytest_args
    ):
        parser.error("--costs measures the whole suite: it takes no -m or -k")
    cache = _cache_state()
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
    if args.costs:
        write_costs(report)
    total = sum(seconds.values())
    rec.add("wall time", round(wall, 1), "s", peer="the README's budget", peer_value=BUDGET_S,
            better="lower")  # fmt: skip
    rec.add("workers' time, all tests", round(total, 1), "s", better="lower")
    for area, s in sorted(seconds.items(), key=lambda kv: -kv[1]):
        rec.add(
            area,
            round(s, 1),
            "s",
            better="lower",
            note=f"{counts[area]} tests, {100 * s / total:.0f}% of the workers' time",
        )
    rec.note(cache)
    rec.note(f"{sum(counts.values())} tests, {failed} failed; pytest arguments: "
             f"{' '.join(args.pytest_args) or '(none)'}")  # fmt: skip
    rec.write(["benchmarks/suite_time.py", *(argv if argv is not None else sys.argv[1:])])
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
