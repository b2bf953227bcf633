"""One PyTorch thread for the many small operations of a load, and other work beside it.

A load (a GGUF file's codes packed for the int4 kernel, scales converted, pieces fused
for the decode step) runs hundreds of operations of a few hundred kilobytes each. With
several intra-op threads each one opens a parallel region whose threads must all be
scheduled before it ends: on a machine whose cores are busy with other work, a thread
that waits for a core holds up the region, and the load takes several times as long (int4
SmolLM2's ``build_model`` on 2 busy cores: about 5 s with 2 threads, 1 s with one). On one
thread the same operations give the same results (each writes its own output elements),
and the calling thread keeps the core it already has.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

import torch

__all__ = ["Beside", "one_intra_op_thread", "subnormals_flushed"]

T = TypeVar("T")


@contextmanager
def one_intra_op_thread() -> Iterator[None]:
    """Run the body with one PyTorch intra-op thread, then restore the count it had
    (also when the body raises)."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _flushing() -> bool:
    """Whether this thread reads float subnormals as zero (x86 DAZ): 2^-130 times 1."""
    return bool((torch.full((1,), 2.0**-130) * 1.0).item() == 0.0)


@contextmanager
def subnormals_flushed() -> Iterator[None]:
    """Run the body with float subnormals flushed to zero on this thread, then put the
    thread's setting back (also when the body raises).

    On Intel cores an arithmetic result below 2^-126 (float32), or such an input, takes
    a slow path: attention whose far keys get very low scores (ALiBi's steep heads) spends
    most of its time there (a T = 4,096 call 1.9x plain causal, 1.1x flushed). The setting
    is per thread (x86's MXCSR), so this changes nothing for the program's other threads,
    but a thread started inside the body starts with it: run here only work whose ops stay
    on this thread (no PyTorch intra-op threads, which may be started by the first op that
    uses them). Where PyTorch cannot set it (``torch.set_flush_denormal`` False) the body
    runs as is.
    """
    if _flushing() or not torch.set_flush_denormal(True):
        yield
        return
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


class Beside(Generic[T]):
    """``work()`` started in a helper thread while the caller goes on; :meth:`result`
    waits for it and returns its value or raises its exception in the caller's thread.

    A load's Python-heavy part (a tokenizer's tables) then runs beside its numpy part (the
    weights: numpy lets go of Python's lock inside its loops, and the load holds one
    PyTorch thread), on the core that part leaves idle. Call :meth:`result` on every path
    (``finally``) so that no helper outlives the load.
    """

    def __init__(self, work: Callable[[], T], name: str = "attnlab-beside") -> None:
        self._value: list[T] = []
        self._error: list[BaseException] = []

        def run() -> None:
            try:
                self._value.append(work())
            except BaseException as e:  # raised again by result()
                self._error.append(e)

        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()

    def result(self) -> T:
        """Wait for the work; its value, or its exception raised here."""
        self._thread.join()
        if self._error:
            raise self._error[0]
        return self._value[0]
