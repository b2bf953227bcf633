"""attnlab._threads: work beside a load, and the load's one PyTorch thread."""

from __future__ import annotations

import threading

import pytest
import torch

from attnlab._threads import Beside, one_intra_op_thread


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
