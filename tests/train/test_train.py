from __future__ import annotations

import itertools
import json
import math

import pytest

from attnlab.models.gpt import GPTConfig
from attnlab.train import (
    CheckpointSaved,
    EvalResult,
    StepResult,
    TrainConfig,
    Trainer,
    lr_at,
    train,
)

MICRO = GPTConfig(
    vocab_size=50257, context_length=16, emb_dim=16, n_heads=2, n_layers=2, drop_rate=0.1
)


def _cfg(**kw):
    base = dict(
        model=MICRO,
        steps=12,
        batch_size=4,
        lr=2e-2,
        eval_interval=6,
        eval_batches=2,
        sample_tokens=4,
    )
    base.update(kw)
    return TrainConfig(**base)


def test_lr_schedule_warms_up_then_decays():
    lrs = [lr_at(s, 100, 10, 1.0, 0.1) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in itertools.pairwise(lrs[9:]))
    assert lrs[-1] == pytest.approx(0.1, abs=1e-3)


@pytest.mark.slow
def test_loss_falls_on_the_story_and_files_are_written(tmp_path):
    events = []
    result = train(_cfg(steps=20, eval_interval=10), out_dir=tmp_path, callback=events.append)
    assert result.steps_done == 20 and not result.interrupted
    assert [e.step for e in result.evals] == [0, 10, 20]
    assert result.evals[0].train_loss > 10.5  # ~ln(50257) = 10.8 at initialisation
    assert result.evals[-1].train_loss < result.evals[0].train_loss - 2.0
    assert result.evals[-1].val_loss < result.evals[0].val_loss
    assert all(math.isfinite(x) for x in result.step_losses)
    steps = [e for e in events if isinstance(e, StepResult)]
    assert [e.step for e in steps] == list(range(1, 21)) and steps[0].tokens_per_sec > 0
    assert sum(isinstance(e, EvalResult) for e in events) == 3
    assert any(isinstance(e, CheckpointSaved) and e.reason == "final" for e in events)
    assert result.evals[-1].sample.startswith("Every effort moves you")
    history = json.loads((tmp_path / "history.json").read_text())
    assert history["step_losses"] == list(result.step_losses)
    png = (tmp_path / "loss_curve.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_resume_gives_exactly_the_uninterrupted_losses(tmp_path):
    cfg = _cfg(steps=12, eval_interval=5)
    full = train(cfg, out_dir=tmp_path / "full")

    def stop_at_7(event):
        if isinstance(event, StepResult) and event.step == 7:
            trainer.request_stop()  # what Ctrl-C does

    trainer = Trainer(cfg, out_dir=tmp_path / "cut", callback=stop_at_7)
    part = trainer.run()
    assert part.interrupted and part.steps_done == 7
    rest = train(TrainConfig(), out_dir=tmp_path / "cut", resume=tmp_path / "cut")
    assert rest.steps_done == 12 and not rest.interrupted
    assert rest.step_losses == full.step_losses  # bit-identical, dropout included
    assert [(e.step, e.train_loss, e.val_loss) for e in rest.evals] == [
        (e.step, e.train_loss, e.val_loss) for e in full.evals
    ]


def test_resume_refuses_another_text(tmp_path):
    train(_cfg(steps=2), out_dir=tmp_path)
    with pytest.raises(ValueError, match="same --text"):
        Trainer(text="Some other text. " * 500, resume=tmp_path, out_dir=tmp_path).prepare()


def test_input_errors_are_clear():
    with pytest.raises(ValueError, match="too short for one window"):
        Trainer(_cfg(), text="just a few words here").prepare()
    with pytest.raises(ValueError, match="empty"):
        Trainer(_cfg(), text="   ")
    with pytest.raises(ValueError, match="unknown preset"):
        TrainConfig(preset="gpt9")
    with pytest.raises(ValueError, match="not both"):
        TrainConfig(steps=3, epochs=1)
    with pytest.raises(ValueError, match="fewer than one batch"):
        Trainer(_cfg(batch_size=512)).prepare()


def test_epochs_set_the_number_of_steps(tmp_path):
    trainer = Trainer(_cfg(steps=None, epochs=2), out_dir=tmp_path)
    trainer.prepare()
    assert trainer.total_steps == 2 * (len(trainer.train_ds) // 4)


def test_resume_writes_to_its_folder_and_does_nothing_when_already_there(tmp_path):
    first = train(_cfg(steps=2, eval_interval=2), out_dir=tmp_path)
    assert first.trained and first.start_step == 0
    assert Trainer(resume=tmp_path).out_dir == tmp_path  # no out_dir: continue in place
    files = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    again = train(TrainConfig(steps=2), resume=tmp_path)  # already at step 2
    assert not again.trained and again.steps_done == again.start_step == 2
    assert again.loss_png is None and again.history_json is None
    assert again.step_losses == first.step_losses
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == files
    more = train(TrainConfig(steps=3), resume=tmp_path)
    assert more.trained and more.start_step == 2 and more.steps_done == 3
    assert more.out_dir == tmp_path and more.history_json == tmp_path / "history.json"
    assert json.loads(more.history_json.read_text())["step_losses"] == list(more.step_losses)
