"""`attnlab train --resume`: the path a user takes, through the real command (issue 15).

Start a run, interrupt it with SIGINT, run exactly the command the message prints, and compare
with an uninterrupted run of the same length; resume a run that is already long enough; and
check that every "wrote"/"saved" line names a path that exists.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from attnlab.models.gpt import GPTConfig
from attnlab.train import TrainConfig, train
from cli_runner import SRC, run_cli, run_main

# One block 32 wide on 16-token windows, 2 windows a batch: a process builds and trains it in
# a few seconds (the tiny preset's 13.7M parameters took 0.18 s a step), and its evaluation
# at step 4 (a checkpoint and a figure, about a second) keeps the Ctrl-C inside the run.
STEPS = 8
ARGS = ("train", "--steps", str(STEPS), "--batch-size", "2", "--eval-interval", "4",
        "--layers", "1", "--emb-dim", "32", "--heads", "2", "--context-length", "16")  # fmt: skip
WIDE = 1000  # no line wrapping, so that paths are printed whole


def _named_paths(text: str, root: Path) -> list[Path]:
    """The paths under ``root`` named on the lines that say "wrote" or "saved"."""
    found = []
    for line in text.splitlines():
        if re.search(r"\b(wrote|saved)\b", line):
            for token in line.split():
                if token.startswith(str(root)):
                    found.append(Path(token.rstrip(",;:)")))
    return found


def _assert_named_paths_exist(text: str, root: Path) -> None:
    paths = _named_paths(text, root)
    assert paths, f"no path named on a wrote/saved line in:\n{text}"
    missing = [p for p in paths if not p.exists()]
    assert not missing, f"printed but missing: {missing}\n{text}"


def _interrupt(args: tuple[str, ...], cwd: Path) -> tuple[str, str, int]:
    """Run ``attnlab ARGS``, press Ctrl-C once training is under way; (stdout, stderr, rc)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(SRC) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(COLUMNS=str(WIDE), MPLBACKEND="Agg", HF_HUB_OFFLINE="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "attnlab", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal job is
    )
    assert proc.stdout is not None and proc.stderr is not None
    seen = []
    for line in proc.stdout:  # the step-0 evaluation: the training loop has started
        seen.append(line)
        if line.startswith("step"):
            break
    # Ctrl-C in a terminal signals the whole process group (the launcher and its workers).
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    return "".join(seen) + out, err, proc.returncode


def _history(directory: Path) -> dict:
    return json.loads((directory / "history.json").read_text(encoding="utf-8"))


def _check_interrupt_and_resume(tmp_path: Path, extra: tuple[str, ...]) -> None:
    full, cut = tmp_path / "full", tmp_path / "cut"
    done = run_cli(*ARGS, *extra, "--out", str(full), cwd=tmp_path, columns=WIDE)
    assert done.returncode == 0, done.stderr
    _assert_named_paths_exist(done.stdout, tmp_path)

    stdout, stderr, rc = _interrupt((*ARGS, *extra, "--out", str(cut)), tmp_path)
    assert rc == 130, stderr
    assert "Traceback" not in stderr
    reached = json.loads((cut / "config.json").read_text())["step"]
    assert 1 <= reached < STEPS
    assert f"interrupted at step {reached}/{STEPS}" in stderr
    _assert_named_paths_exist(stdout + stderr, tmp_path)
    command = re.search(r"continue with: (.+)$", stderr, re.MULTILINE)
    assert command is not None, stderr
    argv = shlex.split(command.group(1))
    assert argv[:2] == ["attnlab", "train"]

    resumed = run_cli(*argv[1:], cwd=tmp_path, columns=WIDE)  # exactly the printed command
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming at step {reached}" in resumed.stdout
    _assert_named_paths_exist(resumed.stdout, tmp_path)

    # The run continued where it was: final checkpoint, history and figure in `cut`.
    assert json.loads((cut / "config.json").read_text())["step"] == STEPS
    assert (cut / f"model-{STEPS:06d}.safetensors").is_file()
    assert (cut / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "runs").exists()  # nothing went to the default folder
    history, reference = _history(cut), _history(full)
    # Continuous: one loss per step 1..STEPS, evaluations at 0, 4, 8, none repeated.
    assert len(history["step_losses"]) == STEPS
    assert [e["step"] for e in history["evals"]] == [0, 4, 8]
    # And the same numbers as the uninterrupted run, bit for bit (CPU).
    assert history["step_losses"] == reference["step_losses"]
    assert history["evals"] == reference["evals"]


@pytest.mark.slow
def test_interrupted_run_continues_in_its_folder_with_the_printed_command(tmp_path):
    _check_interrupt_and_resume(tmp_path, ())


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_interrupted_two_process_run_continues_with_the_printed_command(tmp_path):
    _check_interrupt_and_resume(tmp_path, ("--nproc", "2"))


MICRO = GPTConfig(vocab_size=50257, context_length=16, emb_dim=16, n_heads=2, n_layers=1)


def _snapshot(directory: Path) -> dict[str, tuple[int, bytes]]:
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in directory.iterdir()}


def test_resume_at_or_below_the_reached_step_trains_and_writes_nothing(
    capsys, tmp_path, monkeypatch
):
    run = tmp_path / "run"
    train(
        TrainConfig(model=MICRO, steps=3, batch_size=2, eval_batches=1, sample_tokens=2),
        out_dir=run,
    )
    before = _snapshot(run)
    monkeypatch.chdir(tmp_path)
    for steps in ("2", "3"):
        code, out, err = run_main(capsys, "train", "--resume", str(run), "--steps", steps)
        assert code == 0, err
        assert out == ""
        assert err.splitlines() == [
            f"the run in {run} is already at step 3 (asked for {steps}); nothing was trained"
        ]
    code, out, err = run_main(
        capsys, "train", "--resume", str(run), "--steps", "1", "--out", str(tmp_path / "new")
    )
    assert code == 0 and "already at step 3" in err and out == ""
    assert _snapshot(run) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no new folder anywhere


def test_resume_with_out_continues_elsewhere_and_leaves_the_source(capsys, tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    train(
        TrainConfig(model=MICRO, steps=2, batch_size=2, eval_batches=1, sample_tokens=2),
        out_dir=src,
    )
    before = _snapshot(src)
    code, out, err = run_main(
        capsys, "train", "--resume", str(src), "--steps", "3", "--out", str(dst)
    )
    assert code == 0, err
    assert _snapshot(src) == before  # only read
    assert json.loads((dst / "config.json").read_text())["step"] == 3
    history = _history(dst)  # the whole run, from step 0
    assert len(history["step_losses"]) == 3
    assert history["step_losses"][:2] == _history(src)["step_losses"]
    _assert_named_paths_exist(out, tmp_path)
