from __future__ import annotations

import os
from types import ModuleType

import pytest
import torch

# Tests are deterministic and small. Alone, a process takes two threads (the CI machine's
# cores); under pytest-xdist (the README's command runs one worker a core) each worker
# takes its share of the cores, and so do the commands it starts (OMP_NUM_THREADS is
# inherited), so that workers never wait on each other's spinning threads.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
_threads = max(1, min(2, (os.cpu_count() or 2) // _workers))
torch.set_num_threads(_threads)
if _workers > 1:
    os.environ["OMP_NUM_THREADS"] = str(_threads)

# The int formats' crossovers to dense prompt products are their defaults here, not measured
# at first use (attnlab.quant.crossover): which path a test's prompt takes must not depend
# on the timings of whichever process measured first, nor a measurement run inside a test
# that counts calls. tests/decode/test_crossover.py measures; set it to `measure` to run
# the whole suite measuring.
os.environ.setdefault("ATTNLAB_CROSSOVER", "defaults")


@pytest.fixture(autouse=True)
def _threads_restored() -> object:
    """Each test leaves torch's thread count as it found it. The docs' examples run in the
    worker's process and set it, as users do (`torch.set_num_threads(2)`); left so, every
    later test of that worker ran two threads beside the other worker's, and its
    products' spinning threads waited on each other (a 10 s test took 188 s)."""
    yield
    if torch.get_num_threads() != _threads:
        torch.set_num_threads(_threads)


@pytest.fixture(scope="session")
def ext() -> ModuleType:
    """attnlab's compiled module; the test skips, naming why, where it is not built."""
    from attnlab import native

    module = native.extension()
    if module is None:
        pytest.skip(f"the native build is unavailable: {native.why_not_native()}")
    return module


# --------------------------------------------------------------------------- file order
# pytest-xdist hands a worker one test file at a time (`--dist loadfile`) in the order
# collected (`--no-loadscope-reorder`): the longest files first (tests/file_order.py).
# A test the same table measured at a second or more is `slow`, as if marked by hand;
# this runs before `-m` deselects (tryfirst).
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from file_order import file_costs, longest_first, slow_tests

    measured_slow = slow_tests()
    for item in items:
        if item.nodeid in measured_slow:
            item.add_marker(pytest.mark.slow)
    items[:] = longest_first(items, file_costs())


# --------------------------------------------------------------------------- time budget
# The suite states its own budget (README, "Run the tests"): past ATTNLAB_TEST_BUDGET_S
# seconds of wall time the run fails with one line saying so, naming the CPU, instead of
# running into CI's limit and ending without a word. Unset: the time is only reported.
BUDGET_ENV = "ATTNLAB_TEST_BUDGET_S"
_session_start: list[float] = []


def _cpu_model() -> str:
    from attnlab.native import cpu_model

    return cpu_model() or "an unknown CPU"


def pytest_sessionstart(session: pytest.Session) -> None:
    import time

    _session_start.append(time.monotonic())


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    import os
    import time

    if not _session_start or hasattr(session.config, "workerinput"):  # xdist workers: no
        return
    elapsed = time.monotonic() - _session_start[0]
    budget_text = os.environ.get(BUDGET_ENV, "")
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    line = f"attnlab: the suite took {elapsed:.0f} s on {_cpu_model()}"
    if reporter is not None:
        reporter.ensure_newline()
    if not budget_text:
        if reporter is not None:
            reporter.write_line(line)
        return
    try:
        budget = float(budget_text)
    except ValueError:
        budget = float("nan")
    if not budget > 0:
        raise pytest.UsageError(f"{BUDGET_ENV} must be a number of seconds, got {budget_text!r}")
    line += f", budget {budget:.0f} s"
    if elapsed > budget:
        line += (
            f": OVER BUDGET by {elapsed - budget:.0f} s. This machine is slower than the "
            "budget allows for, or the suite grew: see the slowest tests above"
        )
        if session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if reporter is not None:
        reporter.write_line(line)
