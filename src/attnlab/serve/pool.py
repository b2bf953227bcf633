"""A bounded worker pool: model work runs off the event loop, and a full queue says so.

``workers`` threads run the work; at most ``workers + queue`` jobs are running or
waiting at any time. A job beyond that is refused at once with :class:`BusyError` (the
server answers 429), instead of piling up.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["BusyError", "WorkerPool"]

R = TypeVar("R")


class BusyError(RuntimeError):
    """Every slot of the pool is taken (running or queued)."""


class WorkerPool:
    """``workers`` threads and room for ``queue`` more jobs waiting.

    Args:
        workers: threads running jobs (>= 1).
        queue: jobs that may wait for a thread (>= 0).

    Raises:
        ValueError: a count out of range.
    """

    def __init__(self, workers: int = 2, queue: int = 16) -> None:
        for name, value, low in (("workers", workers, 1), ("queue", queue, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"`{name}` must be an int >= {low}, got {value!r}")
        self.workers, self.queue = workers, queue
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="attnlab-serve")
        self._slots = threading.BoundedSemaphore(workers + queue)
        self._lock = threading.Lock()
        self.busy = 0  # jobs running or waiting
        self.peak = 0
        self.refused = 0

    @property
    def capacity(self) -> int:
        """Jobs running or waiting at most."""
        return self.workers + self.queue

    def submit(self, fn: Callable[..., R], *args: Any) -> Future[R]:
        """Start ``fn(*args)`` on a worker thread, or raise :class:`BusyError` at once."""
        if not self._slots.acquire(blocking=False):
            with self._lock:
                self.refused += 1
            raise BusyError(
                f"the server is busy: {self.capacity} requests running or queued "
                f"(--workers {self.workers}, --queue {self.queue}); retry shortly"
            )
        with self._lock:
            self.busy += 1
            self.peak = max(self.peak, self.busy)
        try:
            future = self._executor.submit(fn, *args)
        except BaseException:
            self._release(None)
            raise
        future.add_done_callback(self._release)
        return future

    def _release(self, _: Any) -> None:
        with self._lock:
            self.busy -= 1
        self._slots.release()

    async def run(self, fn: Callable[..., R], *args: Any) -> R:
        """``fn(*args)`` on a worker thread, awaited (raises :class:`BusyError` when full)."""
        return await asyncio.wrap_future(self.submit(fn, *args))

    def shutdown(self) -> None:
        """Stop taking work; let running jobs finish."""
        self._executor.shutdown(wait=False, cancel_futures=True)
