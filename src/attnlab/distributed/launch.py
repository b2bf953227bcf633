"""Run a function on N local processes joined in a gloo process group on 127.0.0.1.

Used by ``attnlab ring-demo``, the tests and the benchmark. Never hangs: the parent
collects each rank's result (or error) until a deadline, then kills what is left.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

__all__ = ["RankOutcome", "free_port", "spawn_local"]


@dataclass(frozen=True)
class RankOutcome:
    """What one spawned rank did."""

    rank: int
    ok: bool
    value: Any = None  # the function's return value when ok
    error_type: str = ""  # exception class name, "died" (no result, exit code), or "timeout"
    error: str = ""  # the exception's message
    traceback: str = ""
    elapsed_s: float = 0.0  # from spawn to the result arriving in the parent


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: mp.Queue,
    pg_timeout_s: float,
    threads: int,
) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        value = fn(rank, world_size, *args)
        payload = (rank, True, pickle.dumps(value), "", "", "")
    except BaseException as exc:
        payload = (rank, False, b"", type(exc).__name__, str(exc), traceback.format_exc())
    results.put(payload)
    results.close()
    results.join_thread()
    # Skip destroy_process_group and interpreter teardown: after a peer failure they can block.
    os._exit(0)


def _context() -> Any:
    """A forkserver that has imported torch once (fast starts), else plain spawn.

    Children are fresh processes either way: the server forks them before any torch thread
    pool exists, so none inherits OpenMP state from the caller.
    """
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed", "attnlab.distributed"])
        return ctx
    return mp.get_context("spawn")


def spawn_local(
    fn: Callable[..., Any],
    nproc: int,
    args: Sequence[Any] = (),
    *,
    timeout: float = 120.0,
    pg_timeout: float = 60.0,
    threads: int = 1,
) -> list[RankOutcome]:
    """Run ``fn(rank, world_size, *args)`` on ``nproc`` spawned processes (gloo, 127.0.0.1).

    Args:
        fn: a module-level (picklable) function; its return value must pickle.
        nproc: number of processes (ranks).
        args: extra positional arguments for ``fn``.
        timeout: seconds to wait for all ranks before killing the rest.
        pg_timeout: the process group's timeout in each rank.
        threads: torch threads per rank.

    Returns:
        One :class:`RankOutcome` per rank, in rank order.

    Raises:
        ValueError: ``nproc`` below 1.
    """
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"`nproc` must be a positive int, got {nproc!r}")
    ctx = _context()
    results: mp.Queue = ctx.Queue()
    port = free_port()
    t0 = time.monotonic()
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, nproc, port, fn, tuple(args), results, pg_timeout, threads),
            daemon=True,
        )
        for r in range(nproc)
    ]
    for p in procs:
        p.start()
    outcomes: dict[int, RankOutcome] = {}
    exited_at: dict[int, float] = {}
    deadline = t0 + timeout
    try:
        while len(outcomes) < nproc and time.monotonic() < deadline:
            try:
                rank, ok, blob, etype, msg, tb = results.get(timeout=0.1)
                value = pickle.loads(blob) if ok else None
                elapsed = time.monotonic() - t0
                outcomes[rank] = RankOutcome(rank, ok, value, etype, msg, tb, elapsed)
                continue
            except queue.Empty:
                pass
            now = time.monotonic()
            for r, p in enumerate(procs):
                if r in outcomes or p.exitcode is None:
                    continue
                # Give its queued result a moment to arrive before calling it dead.
                if now - exited_at.setdefault(r, now) > 2.0:
                    outcomes[r] = RankOutcome(
                        r,
                        False,
                        error_type="died",
                        error=f"exit code {p.exitcode}",
                        elapsed_s=now - t0,
                    )
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
    for r in range(nproc):
        if r not in outcomes:
            outcomes[r] = RankOutcome(
                r,
                False,
                error_type="timeout",
                error=f"no result within {timeout:g} s",
                elapsed_s=time.monotonic() - t0,
            )
    return [outcomes[r] for r in range(nproc)]
