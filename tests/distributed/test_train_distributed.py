"""Two processes on 127.0.0.1 (gloo) against one: torch's elastic launcher, real DDP."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from attnlab.train import DistributedTrainingError, Trainer, launch

WORKER = str(Path(__file__).with_name("ddp_worker.py"))
pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600)]


def test_two_processes_match_one(tmp_path):
    from ddp_worker import CONFIG

    launch(2, [str(tmp_path / "ddp"), "6"], entry=(WORKER,))
    ddp = json.loads((tmp_path / "ddp" / "history.json").read_text())
    single = Trainer(dataclasses.replace(CONFIG, steps=6), out_dir=tmp_path / "one").run()
    # Same global batch of 4: each rank computes 2 windows, DDP averages the gradients.
    torch.testing.assert_close(
        torch.tensor(ddp["step_losses"]), torch.tensor(single.step_losses), rtol=1e-4, atol=1e-5
    )
    assert single.step_losses[-1] < single.step_losses[0]
    val = [e["val_loss"] for e in ddp["evals"]]
    torch.testing.assert_close(
        torch.tensor(val), torch.tensor([e.val_loss for e in single.evals]), rtol=1e-4, atol=1e-5
    )
    # Only rank 0 writes: one checkpoint, one history, one figure.
    names = sorted(p.name for p in (tmp_path / "ddp").iterdir())
    assert names == [
        "config.json",
        "history.json",
        "loss_curve.png",
        "model-000006.safetensors",
        "training-000006.pt",
    ]


def test_a_failing_rank_stops_the_others_with_a_clear_error(tmp_path):
    with pytest.raises(DistributedTrainingError) as info:
        launch(2, [str(tmp_path / "ddp"), "6", "1", "3"], entry=(WORKER,))
    msg = str(info.value)
    assert "rank 1 failed" in msg and "injected failure on rank 1" in msg
    assert "other processes were stopped" in msg


def test_the_rank_that_raised_is_named_when_its_peer_died_first(tmp_path, monkeypatch):
    """The race CI hit: rank 1 raised and wrote its error file, but rank 0's collective broke
    and it aborted first, so the launcher reported rank 0 alone and stopped rank 1."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
    from torch.distributed.elastic.multiprocessing.errors.error_handler import ErrorHandler

    from attnlab.distributed.training import _root_cause_order, _with_error_files

    rank_dir = tmp_path / "run-1" / "attempt_0"
    for rank in (0, 1):
        (rank_dir / str(rank)).mkdir(parents=True)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(rank_dir / "1" / "error.json"))
    try:
        raise RuntimeError("injected failure on rank 1")
    except RuntimeError as exc:
        ErrorHandler().record_exception(exc)  # what `record` writes as the rank exits
    peer = ProcessFailure(local_rank=0, pid=1, exitcode=-6, error_file="<N/A>")
    peer.message = "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer"

    assert min({0: peer}.items(), key=_root_cause_order)[0] == 0
    found = _with_error_files({0: peer}, tmp_path)
    rank, failure = min(found.items(), key=_root_cause_order)
    assert rank == 1 and failure.exitcode is None
    assert "injected failure on rank 1" in str(failure.message)


def test_the_rank_that_raised_is_named_when_the_launcher_stopped_it_while_it_exited():
    """The race a fresh clone hit: both ranks in the launcher's failures, rank 1 with its own
    error but stopped (SIGTERM) as it exited, rank 0 aborted (SIGABRT) on the lost peer."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from attnlab.distributed.training import _root_cause_order

    peer = ProcessFailure(local_rank=0, pid=1, exitcode=-6, error_file="<N/A>")
    peer.message = "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer"
    raised = ProcessFailure(local_rank=1, pid=2, exitcode=-15, error_file="<N/A>")
    raised.message = "RuntimeError: injected failure on rank 1"
    stopped = ProcessFailure(local_rank=2, pid=3, exitcode=-15, error_file="<N/A>")
    stopped.message = "SignalException: Process 3 got signal: 15"
    assert min({0: peer, 1: raised}.items(), key=_root_cause_order)[0] == 1
    assert min({0: peer, 2: stopped}.items(), key=_root_cause_order)[0] == 0
