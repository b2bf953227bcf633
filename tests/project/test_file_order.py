"""The suite runs its files longest first, by the measured table tests/file_costs.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from file_order import COSTS_FILE, UNKNOWN_TEST_S, file_costs, longest_first

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Item:
    nodeid: str


def test_files_run_longest_first_and_keep_their_tests_together_in_order():
    items = [
        Item(f"tests/{f}.py::t{i}") for f, n in [("a", 3), ("b", 1), ("c", 2)] for i in range(n)
    ]
    costs = {"tests/a.py": 1.0, "tests/b.py": 90.0}
    order = [i.nodeid for i in longest_first(items, costs)]
    # b measured longest; c is unknown, 2 tests at UNKNOWN_TEST_S each, below a's second
    assert 2 * UNKNOWN_TEST_S < 1.0
    assert order == ["tests/b.py::t0", "tests/a.py::t0", "tests/a.py::t1", "tests/a.py::t2",
                     "tests/c.py::t0", "tests/c.py::t1"]  # fmt: skip
    # equal costs keep the collection order
    even = {"tests/a.py": 5.0, "tests/b.py": 5.0, "tests/c.py": 5.0}
    assert [i.nodeid for i in longest_first(items, even)] == [i.nodeid for i in items]


def test_the_cost_table_is_read_and_a_bad_one_is_ignored(tmp_path):
    costs = file_costs()
    assert costs, f"{COSTS_FILE} is missing or unreadable"
    assert all(s >= 0 for s in costs.values())
    # the table names test files of this repository (a stale entry would only be unused)
    assert sum((ROOT / name).is_file() for name in costs) >= 0.9 * len(costs)
    bad = tmp_path / "costs.json"
    for text in ["{", json.dumps({"seconds": [1, 2]}), json.dumps({"other": {}})]:
        bad.write_text(text)
        assert file_costs(bad) == {}


def test_this_session_collects_the_files_longest_first(request):
    # conftest's hook has ordered this session's items: ordering them again changes nothing
    # (collected in path order, the suite would not be longest first)
    items = request.session.items
    assert [i.nodeid for i in longest_first(items, file_costs())] == [i.nodeid for i in items]
