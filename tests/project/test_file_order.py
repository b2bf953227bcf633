"""The suite runs its files longest first, by the measured table tests/file_costs.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from file_order import (
    COSTS_FILE,
    SLOW_TEST_S,
    UNKNOWN_TEST_S,
    file_costs,
    longest_first,
    slow_tests,
)

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


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
<testcase classname="tests.project.test_file_order" name="test_a[x-1]" time="2.5"/>
<testcase classname="tests.project.test_file_order" name="test_b" time="0.3"/>
<testcase classname="tests.project.test_file_order.TestGroup" name="test_c" time="1.0"/>
<testcase classname="tests.nowhere.test_gone" name="test_d" time="9.0"/>
</testsuite></testsuites>
"""


def test_a_run_lists_its_tests_of_a_second_or_more_by_node_id(tmp_path):
    import suite_time

    junit = tmp_path / "junit.xml"
    junit.write_text(JUNIT)
    here = "tests/project/test_file_order.py"
    # a class's name goes between the file and the test; a file that is not there is dropped
    assert suite_time.slow_tests(junit) == {
        f"{here}::test_a[x-1]": 2.5,
        f"{here}::TestGroup::test_c": 1.0,
    }
    out = tmp_path / "costs.json"
    suite_time.write_costs(junit, out)
    assert slow_tests(out) == {f"{here}::test_a[x-1]", f"{here}::TestGroup::test_c"}
    assert file_costs(out) == {here: 3.8}
    for text in ["{", json.dumps({"slow_tests": [1]}), json.dumps({"seconds": {}})]:
        out.write_text(text)
        assert slow_tests(out) == frozenset()
    # measured below the threshold, a listed test is not slow
    out.write_text(json.dumps({"seconds": {}, "slow_tests": {f"{here}::test_b": 0.3}}))
    assert slow_tests(out) == frozenset()


def test_costs_come_from_the_whole_suite_only(capsys):
    import suite_time

    with pytest.raises(SystemExit):
        suite_time.main(["--costs", "--", "-m", "not slow"])
    assert "takes no -m or -k" in capsys.readouterr().err


def test_the_tests_measured_slow_are_marked_slow_in_this_session(request):
    measured = slow_tests()
    assert measured, f"{COSTS_FILE} lists no slow tests"
    assert all(s >= SLOW_TEST_S for s in json.loads(COSTS_FILE.read_text())["slow_tests"].values())
    collected = [item for item in request.session.items if item.nodeid in measured]
    assert all(item.get_closest_marker("slow") is not None for item in collected)
