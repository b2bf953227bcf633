"""attnlab._threads: work beside a load, and the load's one PyTorch thread."""

from __future__ import annotations

import threading

import pytest
import torch

from attnlab._threads import Beside, _flushing, one_intra_op_thread, subnormals_flushed


def test_beside_runs_in_another_thread_and_returns_its_value():
    seen: list[str] = []
    started = threading.Event()

    def work() -> int:
        seen.append(threading.current_thread().name)
        started.set()
        return 7

    beside = Beside(work, "attnlab-test")
    assert started.wait(10)
    assert beside.result() == 7 and beside.result() == 7
    assert seen == ["attnlab-test"]


def test_beside_raises_the_works_error_in_the_caller():
    def work() -> None:
        raise KeyError("the tokenizer's table")

    beside = Beside(work)
    with pytest.raises(KeyError, match="the tokenizer's table"):
        beside.result()


def test_one_intra_op_thread_restores_the_count_also_on_an_error():
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError), one_intra_op_thread():
        assert torch.get_num_threads() == 1
        raise RuntimeError
    assert torch.get_num_threads() == before


def _can_flush() -> bool:
    ok = torch.set_flush_denormal(True)
    torch.set_flush_denormal(False)
    return ok


@pytest.mark.skipif(not _can_flush(), reason="PyTorch cannot flush subnormals on this CPU")
def test_subnormals_flushed_on_this_thread_only_and_put_back():
    tiny = torch.full((4,), 2.0**-140)  # float32 subnormals
    assert not _flushing() and bool((tiny * 2).ne(0).all())
    other: list[bool] = []
    inside = threading.Event()

    def look() -> None:
        assert inside.wait(10)
        other.append(_flushing())

    t = threading.Thread(target=look)  # started before: its setting is its own
    t.start()
    with subnormals_flushed():
        assert _flushing() and bool((tiny * 2).eq(0).all())
        inside.set()
        t.join()
    assert other == [False]
    assert not _flushing()
    with pytest.raises(RuntimeError), subnormals_flushed():
        raise RuntimeError("inside")
    assert not _flushing()
    torch.set_flush_denormal(True)  # a caller that flushes already stays so
    try:
        with subnormals_flushed():
            pass
        assert _flushing()
    finally:
        torch.set_flush_denormal(False)
