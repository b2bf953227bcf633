"""The process side of data-parallel training: a worker joining its process group, and
:func:`launch`, which starts the workers with torch's elastic launcher and names the rank
whose failure stopped them.

:mod:`attnlab.train` holds the loop itself and re-exports :func:`launch`,
:data:`EXIT_INTERRUPTED` and :class:`DistributedTrainingError` under its own name.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "EXIT_INTERRUPTED",
    "DistributedTrainingError",
    "RankInfo",
    "join_process_group",
    "launch",
]

EXIT_INTERRUPTED = 130  # exit status of a run stopped by a signal (the shell's 128 + SIGINT)


class DistributedTrainingError(RuntimeError):
    """Another rank failed, so this one stopped instead of waiting forever."""


@dataclass
class RankInfo:
    """This process's place among the training workers (one process: rank 0 of 1)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    initialized_here: bool = False

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def join_process_group() -> RankInfo:
    """Join the process group torchrun's environment describes (gloo on CPU, NCCL on GPU),
    or return rank 0 of 1 when there is none."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return RankInfo()
    import torch.distributed as dist

    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if dist.is_initialized():
        return RankInfo(rank, world, local_rank, False)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend=backend)
    return RankInfo(rank, world, local_rank, True)


def launch(
    nproc: int,
    argv: list[str],
    *,
    host: str = "127.0.0.1",
    entry: tuple[str, ...] = ("-m", "attnlab"),
) -> bool:
    """Run ``python -m attnlab <argv>`` in ``nproc`` processes with torch's elastic launcher.

    This is ``torchrun --nproc-per-node nproc --rdzv-endpoint host:0 -m attnlab <argv>``:
    torch's own machinery starts the workers, sets RANK/WORLD_SIZE, and when one worker fails
    stops the others.

    Args:
        nproc: processes to start on this machine.
        argv: their command line arguments.
        host: the rendezvous address (a free port is picked).
        entry: what the workers run before ``argv`` (default ``-m attnlab``).

    Returns:
        True when the run was interrupted (SIGINT/SIGTERM, e.g. Ctrl-C): the launcher passed
        the signal on, the workers saved a checkpoint and stopped; False when they finished.

    Raises:
        DistributedTrainingError: when a worker failed, naming the rank, its exit code and
            its error.
    """
    import sys
    import tempfile
    import uuid

    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if nproc < 1:
        raise ValueError(f"`nproc` must be >= 1, got {nproc}")
    saved_env = {
        k: os.environ.get(k) for k in ("GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS", "PYTHONPATH")
    }
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo on 127.0.0.1 only
    # The workers must import this same attnlab (e.g. a source checkout that is not installed):
    # the folder that holds the attnlab package this file is in.
    here = str(Path(__file__).resolve().parents[2])
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if here not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([here, *paths])
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    # A known folder for the workers' error files: the launcher reports only the ranks that had
    # exited when it noticed a failure, and the rank that failed first may still be exiting.
    log_dir = tempfile.TemporaryDirectory(prefix="attnlab-launch-")
    config = LaunchConfig(
        logs_specs=DefaultLogsSpecs(log_dir=log_dir.name),
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"attnlab-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"{host}:0",
        max_restarts=0,
        monitor_interval=0.1,
        local_addr=host,
    )
    # The launcher installs its own handlers for these and leaves them; put ours back after.
    handled = [
        getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT") if hasattr(signal, n)
    ]
    saved_handlers = {sig: signal.getsignal(sig) for sig in handled}
    try:
        elastic_launch(config, sys.executable)(*entry, *argv)
    except SignalException:
        # The launcher sent the signal on to the workers and waited for them to stop.
        return True
    except ChildFailedError as exc:
        _restore_env(saved_env)
        if all(f.exitcode == EXIT_INTERRUPTED for f in exc.failures.values()):
            return True  # a worker was signalled directly; they all stopped and saved
        failures = _with_error_files(exc.failures, Path(log_dir.name))
        rank, failure = min(failures.items(), key=_root_cause_order)
        why = _failure_message(failure.message)
        code = f" (exit code {failure.exitcode})" if failure.exitcode is not None else ""
        raise DistributedTrainingError(
            f"training process rank {rank} failed{code}"
            + (f": {why}" if why else "")
            + "; the other processes were stopped"
        ) from exc
    finally:
        _restore_env(saved_env)
        log_dir.cleanup()
        for sig, prev in saved_handlers.items():
            with contextlib.suppress(ValueError, TypeError):  # not the main thread / not ours
                signal.signal(sig, prev)
    return False


def _restore_env(saved: dict[str, str | None]) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


# Errors a rank raises because a *peer* went away: symptoms, not the root cause.
_PEER_ERROR_MARKERS = ("gloo", "nccl", "connection closed", "connection reset", "remote worker")


@dataclass
class _RankError:
    """A rank's own error file, for a rank the launcher stopped before it saw it exit."""

    message: Any
    timestamp: float
    exitcode: int | None = None


def _with_error_files(failures: dict[int, Any], log_dir: Path) -> dict[int, Any]:
    """The launcher's failures plus every other rank that wrote an error file.

    When one rank raises, it writes its error file and starts to exit; its peers' collectives
    break at once and they may die first. The launcher then reports only the peers (it stops
    the ranks still running), and the rank that caused it all would be missed.
    """
    found = dict(failures)
    for path in sorted(log_dir.glob("*/attempt_*/*/error.json")):
        rank = int(path.parent.name) if path.parent.name.isdigit() else None
        if rank is None or rank in found:
            continue
        try:
            data = json.loads(path.read_text())
            message = data["message"]
            stamp = message["extraInfo"]["timestamp"] if isinstance(message, dict) else 0
            found[rank] = _RankError(message=message, timestamp=float(stamp))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a file cut short as the launcher stopped the rank: nothing to add
    return found


def _root_cause_order(item: tuple[int, Any]) -> tuple[bool, bool, bool, float, int]:
    """Sort key that puts the rank that failed by itself first.

    Failure timestamps have a resolution of one second, so a rank that died and the peer
    whose collective broke because of it often tie. The root cause is a rank with an error of
    its own (a Python error, not a lost-peer error), even one the launcher then stopped
    (SIGTERM) while it was exiting; then one that died of a signal it was not sent by the
    launcher; among those, the earliest, then the lowest rank.
    """
    rank, failure = item
    message = _failure_message(failure.message).lower()
    peer = any(m in message for m in _PEER_ERROR_MARKERS)
    stopped = failure.exitcode == -signal.SIGTERM
    # no error file (killed, or aborted in teardown), or the launcher's stop seen as an error
    signalled = message.startswith("signal ") or "got signal" in message
    own_error = bool(message) and not peer and not signalled
    return (not own_error, stopped, peer, float(failure.timestamp), rank)


def _failure_message(message: Any) -> str:
    """The one-line error from a torchelastic failure record (a str or the error-file dict)."""
    if isinstance(message, dict):
        message = message.get("message", "")
    text = str(message or "")
    if text.startswith("To enable traceback see"):
        return ""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return " ".join(lines[0].split()) if lines else ""
