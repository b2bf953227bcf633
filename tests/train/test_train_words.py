"""The word tokenizer of `attnlab train --tokenizer words`, through checkpoints and commands,
and the documented short run that grows an induction head."""

from __future__ import annotations

import json

import pytest

import induction_run
from attnlab.checkpoint import CheckpointError, load_checkpoint
from attnlab.data import (
    WordTokenizer,
    checkpoint_tokenizer,
    get_tokenizer,
    repeated_random_text,
    tokenizer_from_dict,
    tokenizer_to_dict,
)
from attnlab.models.gpt import GPTConfig, GPTModel
from attnlab.train import TrainConfig, train
from cli_runner import run_main

SMALL = GPTConfig(
    vocab_size=50257, context_length=16, emb_dim=16, n_heads=2, n_layers=2, drop_rate=0.0
)


def test_word_tokenizer_round_trips_the_repeated_words_text():
    text = repeated_random_text(40, 6, min_length=3, n_words=30, seed=5)
    tok = WordTokenizer.from_text(text)
    words = text.split()
    assert tok.words == tuple(sorted(set(words))) and tok.n_vocab == len(set(words)) + 1
    ids = tok.encode(text)
    assert len(ids) == len(words) and 0 not in ids  # one id per word, none unknown
    assert tok.decode(ids) == text
    # GPT-2 also spells each of these words as one token: the same segmentation.
    assert len(get_tokenizer().encode(text)) == len(ids)
    assert tok.encode("zzzz, " + words[0]) == [0, 0, tok.encode(words[0])[0]]
    assert tok.decode([0]) == " <unk>"
    assert tok.encode(text, allowed_special="all") == ids  # tiktoken's keyword is accepted
    assert WordTokenizer.split("It's 3.5!") == ["It", "'", "s", "3", ".", "5", "!"]


@pytest.mark.parametrize(
    ("words", "needle"),
    [
        ([], "at least one"),
        (["a", "a"], "distinct"),
        (["a b"], "single tokens"),
        (["<unk>"], "single tokens"),
        ([""], "single tokens"),
        (["ab", 3], "single tokens"),
    ],
)
def test_word_tokenizer_names_bad_words(words, needle):
    with pytest.raises(ValueError, match=needle):
        WordTokenizer(words)


def test_word_tokenizer_refuses_ids_outside_its_vocabulary():
    tok = WordTokenizer(["a", "b"])
    with pytest.raises(ValueError, match="token id 3 is outside the vocabulary"):
        tok.decode([1, 3])
    with pytest.raises(ValueError, match="no words"):
        WordTokenizer.from_text("   ")


def test_tokenizer_dicts_round_trip_and_bad_ones_are_named():
    tok = WordTokenizer(["cat", "dog"])
    assert tokenizer_from_dict(tokenizer_to_dict(tok)) == tok
    assert tokenizer_to_dict(get_tokenizer()) == {"kind": "gpt2"}
    assert tokenizer_from_dict({"kind": "gpt2"}) is get_tokenizer()
    assert tokenizer_from_dict(None) is get_tokenizer()  # checkpoints without the field
    for bad in ({"kind": "bpe"}, {"kind": "words"}, {"kind": "words", "words": "ab"}, [1]):
        with pytest.raises(ValueError, match="the `tokenizer` of ckpt must be"):
            tokenizer_from_dict(bad, source="ckpt")
    with pytest.raises(ValueError, match=r"the `tokenizer` of ckpt is invalid.*distinct"):
        tokenizer_from_dict({"kind": "words", "words": ["a", "a"]}, source="ckpt")
    with pytest.raises(TypeError, match="`tokenizer`"):
        tokenizer_to_dict(object())
    with pytest.raises(ValueError, match="`tokenizer` must be one of gpt2, words"):
        TrainConfig(tokenizer="bpe")


def _words_run(tmp_path, steps=2):
    text = repeated_random_text(600, 6, min_length=3, n_words=40, seed=1)
    cfg = TrainConfig(
        model=SMALL,
        steps=steps,
        batch_size=4,
        eval_interval=2,
        sample_tokens=3,
        tokenizer="words",
    )
    return text, train(cfg, out_dir=tmp_path, text=text)


def test_a_words_run_records_its_tokenizer_and_resumes_with_it(tmp_path):
    text, result = _words_run(tmp_path)
    assert result.steps_done == 2
    ckpt = load_checkpoint(tmp_path)
    tok = checkpoint_tokenizer(ckpt)
    assert tok == WordTokenizer.from_text(text) and tok.n_vocab == 41
    assert ckpt.model_config["vocab_size"] == 41  # the model's vocabulary is the words'
    assert ckpt.extra["tokenizer"] == {"kind": "words", "words": list(tok.words)}
    assert GPTModel.from_checkpoint(tmp_path).tok_emb.num_embeddings == 41
    assert set(result.evals[-1].sample.split()) <= {*tok.words, "<unk>"}
    more = train(TrainConfig(steps=3), out_dir=tmp_path, text=text, resume=tmp_path)
    assert more.steps_done == 3 and more.step_losses[:2] == result.step_losses


def test_commands_use_the_recorded_tokenizer(capsys, tmp_path):
    _, _ = _words_run(tmp_path)
    tok = checkpoint_tokenizer(load_checkpoint(tmp_path))
    # A text of its words repeated twice: encoded by the words, so induction is scored.
    text = " ".join(tok.words[:5] * 2)
    code, out, err = run_main(capsys, "heads", "--checkpoint", str(tmp_path), text, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["ids"] == tok.encode(text) and "induction" in data["roles"]
    prompt = " ".join(tok.words[:3])
    code, out, err = run_main(
        capsys, "generate", "--checkpoint", str(tmp_path), prompt, "-n", "4", "--temperature", "0"
    )
    assert code == 0, err
    assert set(out.split()) <= {*tok.words, "<unk>"} and out.split()[:3] == list(tok.words[:3])
    from attnlab.serve.models import checkpoint_spec

    loaded = checkpoint_spec(tmp_path).load()
    assert loaded.tokenizer == tok and loaded.eos_id is None  # words have no end token
    assert loaded.encode(prompt) == tok.encode(prompt)


def test_bad_tokenizer_option_is_one_line_naming_it(capsys, tmp_path):
    code, _, err = run_main(capsys, "train", "--tokenizer", "bpe", "--out", str(tmp_path))
    assert code == 2 and "`--tokenizer` must be one of gpt2, words" in err
    assert "Traceback" not in err


def test_a_changed_tokenizer_in_the_manifest_is_refused(capsys, tmp_path):
    _words_run(tmp_path)
    manifest = tmp_path / "config.json"
    data = json.loads(manifest.read_text())
    data["extra"]["tokenizer"]["words"].pop()
    manifest.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"`tokenizer`.*40 ids.*`vocab_size` is 41"):
        checkpoint_tokenizer(load_checkpoint(tmp_path))
    data["extra"]["tokenizer"] = {"kind": "sentencepiece"}
    manifest.write_text(json.dumps(data))
    code, _, err = run_main(capsys, "heads", "--checkpoint", str(tmp_path))
    assert code == 2 and "the `tokenizer` of" in err and "Traceback" not in err


def test_model_size_flags_set_the_config_and_bad_ones_are_named(capsys, tmp_path):
    out = tmp_path / "run"
    args = ["train", "--out", str(out), "--steps", "1", "--batch-size", "2", "--seed", "3"]
    args += ["--context-length", "16", "--eval-interval", "1", "--repeated-words", "2-5"]
    for bad, needle in [
        (["--emb-dim", "0"], "`--emb-dim` must be >= 1"),
        (["--heads", "0"], "`--heads` must be >= 1"),
        (["--dropout", "1.5"], "`--dropout` must be in [0, 1)"),
        (["--emb-dim", "30", "--heads", "4"], "(--emb-dim / --heads)"),
    ]:
        code, _, err = run_main(capsys, *args, *bad)
        assert code == 2 and needle in err and "Traceback" not in err, err
    code, _, err = run_main(
        capsys, *args, "--layers", "2", "--emb-dim", "32", "--heads", "2", "--dropout", "0"
    )
    assert code == 0, err
    cfg = GPTConfig.from_dict(load_checkpoint(out).model_config)
    assert cfg == GPTConfig(201, 16, 32, 2, 2, 0.0, False)


def test_stride_and_warmup_flags_are_recorded_and_bad_ones_are_named(capsys, tmp_path):
    args = ["train", "--steps", "1", "--batch-size", "2", "--context-length", "16"]
    args += ["--eval-interval", "1", "--layers", "1", "--emb-dim", "16", "--heads", "2"]
    for bad, needle in [
        (["--stride", "0"], "`--stride` must be >= 1"),
        (["--warmup-steps", "0"], "warmup_steps"),
    ]:
        code, _, err = run_main(capsys, *args, "--out", str(tmp_path / "bad"), *bad)
        assert code == 2 and needle in err and "Traceback" not in err, err
    saved = {}
    for name, extra in [
        ("words", ["--repeated-words", "2-5"]),  # a window at every offset by default
        ("story", []),  # windows side by side
        ("both", ["--repeated-words", "2-5", "--stride", "8", "--warmup-steps", "3"]),
    ]:
        code, _, err = run_main(capsys, *args, "--out", str(tmp_path / name), *extra)
        assert code == 0, err
        saved[name] = load_checkpoint(tmp_path / name).extra["train_config"]
    assert saved["words"]["stride"] == 1 and saved["story"]["stride"] is None
    assert saved["both"]["stride"] == 8 and saved["both"]["warmup_steps"] == 3


def test_the_documented_short_run_grew_an_induction_head():
    """The kept run of the guide's command (tests/induction_run.py): before training no head
    completes a repeated sequence; after it, a layer-1 head does on a held-out length (16
    words: the training sequences are 1 to 15 long, so a head that looks a fixed distance
    back cannot pass), fed by a layer-0 previous-token head, the two-head circuit of an
    induction head; and the training loss fell as it formed, as the guide says."""
    ckpt = load_checkpoint(induction_run.KEPT, with_training_state=False)
    assert ckpt.step == 6000 and ckpt.extra["train_config"]["steps"] == 6000
    ids, b, a = induction_run.scores()
    assert len(ids) == 32 and 0 not in ids
    assert float(b["induction"].max()) < 0.2
    assert float(a["induction"][1].max()) > 0.5, a["induction"]
    assert float(a["previous_token"][0].max()) > 0.5, a["previous_token"]
    losses = json.loads((induction_run.KEPT / "history.json").read_text())["step_losses"]
    assert len(losses) == 6000
    early, late = sum(losses[500:1000]) / 500, sum(losses[-500:]) / 500
    assert early > 4.6 and late < 4.2, (early, late)


def test_the_documented_command_trains_the_kept_run(capsys, tmp_path, monkeypatch):
    """The guide's command, run as a user would for its first steps, is the kept run: the
    same train config and tokenizer, and the same loss at every step within float32's drift
    across CPUs. If this fails after a deliberate change to training, make the run again:
    ``PYTHONPATH=src python tests/induction_run.py``."""
    import attnlab.train as training
    from attnlab.distributed.training import EXIT_INTERRUPTED

    steps = induction_run.CHECKED_STEPS

    class StopsEarly(training.Trainer):  # the command's trainer, asked to stop at `steps`
        def __init__(self, *args, callback=None, **kwargs):
            def stop_at(event):
                if callback is not None:
                    callback(event)
                if isinstance(event, training.StepResult) and event.step == steps:
                    self.request_stop()

            super().__init__(*args, callback=stop_at, **kwargs)

    monkeypatch.setattr(training, "Trainer", StopsEarly)
    out = tmp_path / "induction"
    code, _, err = run_main(capsys, *induction_run.ARGV, "--out", str(out))
    assert code == EXIT_INTERRUPTED, err
    now = load_checkpoint(out, with_training_state=False)
    kept = load_checkpoint(induction_run.KEPT, with_training_state=False)
    assert now.step == steps
    assert now.model_config == kept.model_config
    assert now.extra["train_config"] == kept.extra["train_config"]
    assert now.extra["tokenizer"] == kept.extra["tokenizer"]
    assert now.extra["text_sha256"] == kept.extra["text_sha256"]  # the same training text
    got = json.loads((out / "history.json").read_text())["step_losses"]
    want = json.loads((induction_run.KEPT / "history.json").read_text())["step_losses"]
    assert len(got) == steps
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want[:steps], strict=True))
    assert worst <= induction_run.LOSS_RTOL, (
        f"the first {steps} steps of the documented run moved from the kept run by "
        f"{worst:.2e} (relative); if training changed on purpose, make the run again: "
        "PYTHONPATH=src python tests/induction_run.py"
    )
