"""The order the suite's files run in (the longest first), and which tests are slow.

pytest-xdist hands each worker one test file at a time (``--dist loadfile``), in the
order they were collected (``--no-loadscope-reorder``). A file of one long test collected
last would keep one worker busy for minutes after the other has run out of files, so the
files are ordered by their measured seconds, longest first: ``tests/file_costs.json``,
written by ``python benchmarks/suite_time.py --costs`` from a run of the whole suite. A
file the table does not know (a new one) counts a tenth of a second a test.

The same run measures each test: one that took at least :data:`SLOW_TEST_S` seconds
(setup, call and teardown) is listed under ``slow_tests``, and the suite marks it ``slow``
as if it carried ``@pytest.mark.slow`` (:func:`slow_tests`), so that ``-m "not slow"``
leaves out every long test, not only those marked by hand.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, TypeVar

COSTS_FILE = Path(__file__).with_name("file_costs.json")
UNKNOWN_TEST_S = 0.1
#: A test measured at least this long (seconds, on the machine the table was measured on)
#: is ``slow``.
SLOW_TEST_S = 1.0


class _HasNodeId(Protocol):
    nodeid: str


T = TypeVar("T", bound=_HasNodeId)


def file_costs(path: Path = COSTS_FILE) -> dict[str, float]:
    """Measured seconds of each test file, by its path from the repository root; empty if
    the table is missing or unreadable (the order is then the count of tests)."""
    try:
        seconds = json.loads(path.read_text(encoding="utf-8"))["seconds"]
        return {str(name): float(s) for name, s in seconds.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def slow_tests(path: Path = COSTS_FILE) -> frozenset[str]:
    """The node ids of the tests the table measured at :data:`SLOW_TEST_S` seconds or more;
    empty if the table is missing or unreadable."""
    try:
        seconds = json.loads(path.read_text(encoding="utf-8"))["slow_tests"]
        return frozenset(str(node) for node, s in seconds.items() if float(s) >= SLOW_TEST_S)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return frozenset()


def longest_first(items: Sequence[T], costs: dict[str, float]) -> list[T]:
    """The items grouped by file, the files in decreasing cost (equal costs in collection
    order), each file's items in their own order."""
    by_file: dict[str, list[T]] = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::", 1)[0], []).append(item)

    def cost(name: str) -> float:
        return costs.get(name, UNKNOWN_TEST_S * len(by_file[name]))

    return [item for name in sorted(by_file, key=lambda n: -cost(n)) for item in by_file[name]]
