"""The worker threads a blockwise call splits its key/value head groups over.

A call of many tiles is hundreds of small ops; run with PyTorch's intra-op threads, each op
ends in a barrier that waits for the slowest (possibly descheduled) thread. So, like
PyTorch's fused kernel, a call forks once: the key/value head groups are split over N
Python threads (N = ``torch.get_num_threads()``), each running its ops single-threaded
(the ops release the GIL); benchmarks/bench_attention.py --targets backs the choice.
One fused tile covering the whole call is left to the op's own threads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext

import torch

from attnlab._threads import subnormals_flushed


def _profiler_enabled() -> bool:
    check = getattr(getattr(torch._C, "_autograd", None), "_profiler_enabled", None)
    return bool(check()) if check is not None else False


class WorkerPool:
    """Python threads for head groups, and PyTorch's intra-op thread count while they run.

    PyTorch's thread count is global: the pool sets it to 1 while any call uses the
    workers (counted, so that concurrent calls nest) and restores it after the last one.
    The executor grows to the largest thread count seen and is kept for later calls.
    """

    def __init__(self, thread_name_prefix: str) -> None:
        self.thread_name_prefix = thread_name_prefix
        self._lock = threading.Lock()
        self._users = 0  # calls inside one_thread_per_op now
        self._saved_threads = 1  # PyTorch's thread count before the first of them
        self._executor: ThreadPoolExecutor | None = None

    @contextmanager
    def _one_thread_per_op(self) -> Iterator[tuple[ThreadPoolExecutor, int]]:
        """Set intra-op threads to 1; yield the executor and how many workers to use."""
        with self._lock:
            if self._users == 0:
                self._saved_threads = torch.get_num_threads()
                torch.set_num_threads(1)
            self._users += 1
            workers = self._saved_threads
            if self._executor is None or self._executor._max_workers < workers:
                self._executor = ThreadPoolExecutor(
                    max_workers=workers, thread_name_prefix=self.thread_name_prefix
                )
            executor = self._executor
        try:
            yield executor, workers
        finally:
            with self._lock:
                self._users -= 1
                if self._users == 0:
                    torch.set_num_threads(self._saved_threads)

    def run_groups(self, G: int, work: Callable[[int, int], None]) -> None:
        """Run ``work(g0, g1)`` over contiguous ranges of the G key/value heads, float
        subnormals flushed to zero where the ops run on the workers (or on the caller's one
        thread): a weight below 2^-126 of its row's largest becomes 0 (see
        :func:`attnlab._threads.subnormals_flushed`)."""
        threads = torch.get_num_threads()
        if (
            threads <= 1
            or G < 2
            or threading.current_thread().name.startswith(self.thread_name_prefix)
            # torch.profiler records allocations of the profiled thread only: run the
            # groups there so that it sees them all (the scratch adds up the same).
            or _profiler_enabled()
        ):
            # Flushed only where every op runs on this thread: PyTorch's own threads would
            # keep the setting if the first op to use them started them here.
            with subnormals_flushed() if threads <= 1 else nullcontext():
                work(0, G)
            return
        grad_mode = torch.is_grad_enabled()  # thread-local: carry the caller's into workers

        def run(g0: int, g1: int) -> None:
            with torch.set_grad_enabled(grad_mode), subnormals_flushed():
                work(g0, g1)

        with self._one_thread_per_op() as (executor, workers):
            n = min(workers, G)
            cuts = [G * i // n for i in range(n + 1)]
            futures = [executor.submit(run, cuts[i], cuts[i + 1]) for i in range(n)]
            for f in futures:
                f.result()  # re-raises a worker's exception


#: The workers of every blockwise call in this process.
POOL = WorkerPool("attnlab")
