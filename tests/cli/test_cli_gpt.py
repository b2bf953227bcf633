"""`attnlab train`, `attnlab generate`, `attnlab info --preset`: real commands, real exit codes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from attnlab.models.gpt import GPTConfig
from attnlab.train import TrainConfig, train
from cli_runner import run_main

SRC = Path(__file__).resolve().parents[2] / "src"


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("attnlab: error: ")
    assert "Traceback" not in err
    return lines[0]


def test_train_bad_input_is_one_line_and_exit_2(capsys, tmp_path):
    code, _, err = run_main(capsys, "train", "--text", str(tmp_path / "missing.txt"))
    assert code == 2 and "does not exist" in _one_error_line(err)

    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n", encoding="utf-8")
    code, _, err = run_main(capsys, "train", "--text", str(empty), "--out", str(tmp_path / "o"))
    assert code == 2 and "is empty" in _one_error_line(err)

    short = tmp_path / "short.txt"
    short.write_text("A very short story. " * 5, encoding="utf-8")
    code, out, err = run_main(capsys, "train", "--text", str(short), "--out", str(tmp_path / "o"))
    assert code == 2 and "too short for one window" in _one_error_line(err)
    assert out.strip() == ""

    code, _, err = run_main(capsys, "train", "--preset", "gpt5")
    assert code == 2 and "unknown preset 'gpt5'" in _one_error_line(err)

    code, _, err = run_main(capsys, "train", "--resume", str(tmp_path / "nowhere"))
    assert code == 2 and "does not exist" in _one_error_line(err)


def test_info_reports_the_preset_parameter_counts(capsys):
    code, out, err = run_main(capsys, "info", "--preset", "gpt2-124m")
    assert code == 0, err
    for text in ("163,009,536", "124,412,160", "621.83 MB", "38,597,376", "trf_blocks (x12)"):
        assert text in out, text
    code, out, _ = run_main(capsys, "info", "--preset", "all")
    assert code == 0 and "1,637,792,000" in out and "406,212,608" in out
    code, _, err = run_main(capsys, "info", "--preset", "gpt-7")
    assert code == 2 and "unknown --preset" in _one_error_line(err)


@pytest.fixture(scope="module")
def micro_checkpoint(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ckpt")
    cfg = GPTConfig(vocab_size=50257, context_length=16, emb_dim=16, n_heads=2, n_layers=1)
    train(TrainConfig(model=cfg, steps=2, batch_size=2, eval_batches=1, sample_tokens=2),
          out_dir=out)  # fmt: skip
    return out


def test_generate_streams_from_a_checkpoint(capsys, micro_checkpoint):
    code, out, err = run_main(
        capsys, "generate", "--checkpoint", str(micro_checkpoint), "-n", "5", "Every effort"
    )
    assert code == 0, err
    assert out.startswith("Every effort") and len(out) > len("Every effort\n")
    # greedy, with and without the cache: the same text
    code2, out2, _ = run_main(
        capsys, "generate", "--checkpoint", str(micro_checkpoint), "-n", "5", "--no-cache",
        "Every effort",
    )  # fmt: skip
    assert code2 == 0 and out2 == out


def test_generate_bad_input(capsys, micro_checkpoint, tmp_path):
    code, _, err = run_main(capsys, "generate", "hello")
    assert code == 2 and "--checkpoint" in _one_error_line(err)
    code, _, err = run_main(capsys, "generate", "--checkpoint", str(tmp_path), "hello")
    assert code == 2 and "holds no checkpoint" in _one_error_line(err)
    code, _, err = run_main(
        capsys, "generate", "--checkpoint", str(micro_checkpoint), "--top-p", "2", "--temperature",
        "1", "hello",
    )  # fmt: skip
    assert code == 2 and "top_p" in _one_error_line(err)
    bad = tmp_path / "bad"
    bad.mkdir()
    for p in micro_checkpoint.iterdir():
        (bad / p.name).write_bytes(p.read_bytes())
    manifest = json.loads((bad / "config.json").read_text())
    manifest["model_config"]["n_heads"] = 4
    manifest["model_config"]["emb_dim"] = 32
    (bad / "config.json").write_text(json.dumps(manifest))
    code, _, err = run_main(capsys, "generate", "--checkpoint", str(bad), "hello")
    assert code == 2 and "does not match its weights" in _one_error_line(err)


def test_every_checkpoint_command_refuses_a_config_that_does_not_fit(
    capsys, micro_checkpoint, tmp_path, monkeypatch
):
    """`generate`, `explain`, `heads`, `attribute` and `patch` load a checkpoint the one
    way: its config is checked against its weights, and a mismatch is one error line
    naming the tensor."""
    bad = tmp_path / "bad"
    bad.mkdir()
    for p in micro_checkpoint.iterdir():
        (bad / p.name).write_bytes(p.read_bytes())
    manifest = json.loads((bad / "config.json").read_text())
    manifest["model_config"]["emb_dim"] = 32
    (bad / "config.json").write_text(json.dumps(manifest))
    monkeypatch.chdir(tmp_path)  # where a command that did load would write its files
    for command in (
        ("generate", "--checkpoint", str(bad), "hello"),
        ("explain", "--checkpoint", str(bad), "hello"),
        ("heads", "--checkpoint", str(bad)),
        ("attribute", "--checkpoint", str(bad), "hello", "--target-id", "1"),
        (
            "patch",
            "--checkpoint",
            str(bad),
            "--clean",
            "a b",
            "--corrupted",
            "a c",
            "--target-id",
            "1",
            "--contrast-id",
            "2",
        ),
    ):
        code, _, err = run_main(capsys, *command)
        line = _one_error_line(err)
        assert code == 2 and "does not match its weights" in line and "tok_emb.weight" in line


def test_generate_streams_multibyte_text_whole(capsys, micro_checkpoint, monkeypatch):
    """Characters whose UTF-8 bytes span several tokens (CJK, an emoji) come out whole and
    exactly as tiktoken decodes the tokens: the library's one decoder (`TextStream`) holds
    a character back until its last byte arrives."""
    import torch

    import attnlab.generation
    from attnlab.data import get_tokenizer

    text = " naïve café, 東京の猫 🐈‍⬛ and ß"
    tok = get_tokenizer()
    ids = tok.encode(text)
    partial = [i for i in ids if "\ufffd" in tok.decode([i])]
    assert len(partial) >= 3  # the text does split characters across tokens

    def scripted(model, idx, max_new_tokens, *args, **kwargs):
        for i in ids[:max_new_tokens]:
            yield torch.tensor([[i]])

    monkeypatch.setattr(attnlab.generation, "generate_stream", scripted)
    args = ("generate", "--checkpoint", str(micro_checkpoint), "Say")
    code, out, err = run_main(capsys, *args, "-n", str(len(ids)))
    assert code == 0, err
    assert out == "Say" + text + "\n" and "\ufffd" not in out
    # Cut inside the cat emoji: the bytes held back come out as the decoder writes them.
    n = ids.index(partial[-1])
    code, out, err = run_main(capsys, *args, "-n", str(n + 1))
    assert code == 0, err
    assert out == "Say" + tok.decode(ids[: n + 1]) + "\n"


@pytest.mark.slow
def test_ctrl_c_saves_a_checkpoint_and_resume_finishes(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(SRC) + os.pathsep + env.get("PYTHONPATH", "")
    env["MPLBACKEND"] = "Agg"
    out = tmp_path / "run"
    # One block 32 wide (a step ~35 ms): the Ctrl-C a second in lands a few seconds before
    # the end, and the run is cheap (the tiny preset took 0.18 s a step).
    args = [sys.executable, "-m", "attnlab", "train", "--steps", "100", "--batch-size", "2",
            "--eval-interval", "1000", "--layers", "1", "--emb-dim", "32", "--heads", "2",
            "--context-length", "16", "--out", str(out)]  # fmt: skip
    proc = subprocess.Popen(
        args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path
    )
    assert proc.stdout is not None
    for line in proc.stdout:  # the step-0 evaluation: training is under way
        if line.startswith("step"):
            break
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert "interrupted at step" in stderr and "--resume" in stderr
    manifest = json.loads((out / "config.json").read_text())
    done = manifest["step"]
    assert 1 <= done < 100
    resumed = subprocess.run(
        [*args[:3], "train", "--resume", str(out), "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming at step {done}" in resumed.stdout
    assert json.loads((out / "config.json").read_text())["step"] == 100


def test_train_context_length_sets_the_window_and_the_model(capsys, tmp_path):
    short = tmp_path / "short.txt"
    # 100 tokens: too short for windows of the tiny preset's 64 tokens, not for 8-token ones.
    short.write_text("A very short story. " * 20, encoding="utf-8")
    out = tmp_path / "run"
    args = ["train", "--text", str(short), "--out", str(out), "--steps", "1"]
    code, _, err = run_main(capsys, *args, "--context-length", "0")
    assert code == 2 and "`--context-length` must be >= 1" in _one_error_line(err)

    code, stdout, err = run_main(capsys, *args, "--context-length", "8", "--batch-size", "2")
    assert code == 0, err
    assert "16 tokens per step" in " ".join(stdout.split())
    from attnlab.checkpoint import load_checkpoint

    cfg = GPTConfig.from_dict(load_checkpoint(out).model_config)
    assert cfg == GPTConfig.preset("tiny", context_length=8)


def test_train_repeated_words_and_layers(capsys, tmp_path):
    from attnlab.checkpoint import load_checkpoint
    from attnlab.data import repeated_random_text

    out = tmp_path / "run"
    args = ["train", "--out", str(out), "--steps", "1", "--batch-size", "2"]
    args += ["--context-length", "16", "--eval-interval", "1", "--seed", "7"]
    for bad, needle in [("5", "MIN-MAX"), ("9-3", "MIN-MAX"), ("0-4", "MIN-MAX")]:
        code, _, err = run_main(capsys, *args, "--repeated-words", bad)
        assert code == 2 and needle in _one_error_line(err)
    code, _, err = run_main(capsys, *args, "--repeated-words", "3-6", "--text", "x.txt")
    assert code == 2 and "not both" in _one_error_line(err)
    code, _, err = run_main(capsys, *args, "--layers", "0")
    assert code == 2 and "`--layers` must be >= 1" in _one_error_line(err)

    code, _, err = run_main(capsys, *args, "--repeated-words", "3-6", "--layers", "2")
    assert code == 0, err
    ckpt = load_checkpoint(out)
    cfg = GPTConfig.from_dict(ckpt.model_config)
    # The words tokenizer (the default with --repeated-words): 200 words and <unk>.
    assert cfg == GPTConfig.preset("tiny", context_length=16, n_layers=2, vocab_size=201)
    assert ckpt.extra["tokenizer"]["kind"] == "words"
    # The run trained on the documented data: its text hash is that of the same draw.
    import hashlib

    text = repeated_random_text(200_000 // 9, 6, min_length=3, seed=7)
    assert ckpt.extra["text_sha256"] == hashlib.sha256(text.encode()).hexdigest()
    assert len(ckpt.extra["tokenizer"]["words"]) == len(set(text.split())) == 200
    # --tokenizer gpt2 keeps GPT-2's vocabulary for the same data.
    code, _, err = run_main(
        capsys, *args, "--repeated-words", "3-6", "--layers", "2", "--tokenizer", "gpt2"
    )
    assert code == 0, err
    assert load_checkpoint(out).model_config["vocab_size"] == 50257


def test_attribute_and_patch_on_a_checkpoint_are_the_library_numbers(capsys, micro_checkpoint):
    import torch

    from attnlab.explain import attribute, patch
    from attnlab.models.gpt import GPTModel

    model = GPTModel.from_checkpoint(micro_checkpoint).eval()
    ckpt = str(micro_checkpoint)
    args = ("Every effort moves you", "--target", " forward", "--json")
    code, out, err = run_main(capsys, "attribute", "--checkpoint", ckpt, *args)
    assert code == 0, err
    data = json.loads(out)
    expected = attribute(model, [6109, 3626, 6100, 345], 2651)
    assert data["total"] == pytest.approx(expected.total, abs=1e-6)
    torch.testing.assert_close(torch.tensor(data["heads"]), expected.heads.float())
    assert data["contrast"] is None
    code, out, err = run_main(capsys, "patch", "--checkpoint", str(micro_checkpoint),
                              "--clean", "Every effort moves you", "--corrupted",
                              "Every day moves you", "--target", " forward", "--contrast",
                              " back", "--over", "mlp", "--json")  # fmt: skip
    assert code == 0, err
    grid = patch(model, [6109, 3626, 6100, 345], [6109, 1110, 6100, 345], 2651, 736, over="mlp")
    torch.testing.assert_close(torch.tensor(json.loads(out)["grid"]), grid.float())
