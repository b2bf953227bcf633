"""`attnlab attribute` and `attnlab patch`, run as the real command on a tiny Llama-layout
checkpoint and its GGUF file: they print what :func:`attnlab.explain.attribute` and
:func:`attnlab.explain.patch` return, draw it, and turn mistakes into one line."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

if not all(importlib.util.find_spec(m) for m in ("transformers", "tokenizers", "gguf")):
    pytest.skip("needs transformers, tokenizers and gguf", allow_module_level=True)

from cli_runner import run_cli, run_main
from model_files import save_hf, write_gguf

LLAMA = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}
CLEAN = "The cat sat on the mat, and the dog sat on the"
CORRUPTED = "The dog sat on the mat, and the cat sat on the"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("why-cli")
    folder = save_hf("llama", LLAMA, root / "llama", torch.float32)
    gguf_path = root / "llama.gguf"
    write_gguf(folder, gguf_path, "llama", "F32")
    return folder, gguf_path


@pytest.fixture(scope="module")
def loaded(files):
    from attnlab.pretrained import load_pretrained

    return load_pretrained(files[1])


def test_attribute_json_is_the_library_attribution_and_the_table_its_largest_parts(
    files, loaded, tmp_path
):
    from attnlab.explain import attribute

    model, tok = loaded
    target, contrast = "c", "d"  # the tiny model's tokenizer: one byte a token
    assert len(tok.encode(target)) == len(tok.encode(contrast)) == 1
    r = run_cli("attribute", CLEAN, "--model", str(files[1]), "--target", target,
                "--contrast", contrast, "--by-source", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    ids = tok.encode(CLEAN)
    expected = attribute(model, ids, tok.encode(target)[0], tok.encode(contrast)[0],
                         by_source=True)  # fmt: skip
    for name in ("total", "embedding", "bias", "error"):
        assert data[name] == pytest.approx(getattr(expected, name), abs=1e-6)
    for name in ("heads", "mlp", "by_source"):
        torch.testing.assert_close(torch.tensor(data[name]), getattr(expected, name).float())
    assert data["target"]["token"] == target and data["position"] == len(ids) - 1
    # The table: the largest parts first, with their share of the total.
    r = run_cli("attribute", CLEAN, "--model", str(files[1]), "--target", target,
                "--contrast", contrast, "--top", "3", "--png", "a.png", "--html", "a.html",
                cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr
    parts = {"embedding": expected.embedding, "bias": expected.bias}
    parts.update({f"{l_}.{h}": float(expected.heads[l_, h]) for l_ in range(2) for h in range(4)})
    parts.update({f"mlp {l_}": float(expected.mlp[l_]) for l_ in range(2)})
    best = sorted(parts.items(), key=lambda p: -abs(p[1]))[:3]
    rows = [ln.split() for ln in r.stdout.splitlines()]
    for name, value in best:
        row = next(x for x in rows if " ".join(x[: len(name.split())]) == name)
        assert row[len(name.split())] == f"{value:+.4f}"
        assert row[-1] == f"{100 * value / expected.total:+.1f}%"
    assert f"= {expected.total:+.4f}" in r.stdout
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (tmp_path / "a.html").read_text(encoding="utf-8")
    assert "<svg" in page and "<script" not in page and best[0][0] in page


def test_patch_json_is_the_library_grid(files, loaded, tmp_path):
    from attnlab.explain import patch

    model, tok = loaded
    assert len(tok.encode(CLEAN)) == len(tok.encode(CORRUPTED))
    t, c = "c", "d"
    r = run_cli("patch", "--model", str(files[1]), "--clean", CLEAN, "--corrupted", CORRUPTED,
                "--target", t, "--contrast", c, "--over", "residual", "--json",
                "--png", "p.png", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    expected = patch(model, tok.encode(CLEAN), tok.encode(CORRUPTED), tok.encode(t)[0],
                     tok.encode(c)[0], over="residual")  # fmt: skip
    torch.testing.assert_close(torch.tensor(data["grid"]), expected.float())
    assert len(data["tokens"]) == expected.shape[1] and data["over"] == "residual"
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["attribute", "hi", "--target-id", "1"], "give a model"),
        (["attribute", CLEAN, "--model", "FILE"], "--target TEXT or --target-id N"),
        (["attribute", CLEAN, "--model", "FILE", "--target", "abc"],
         "--target 'abc' is 3 tokens ('a', 'b', 'c')"),
        (["attribute", CLEAN, "--model", "FILE", "--target-id", "1", "--target", " a"],
         "not both"),
        (["attribute", CLEAN, "--model", "FILE", "--target-id", "100000"], "target"),
        (["attribute", CLEAN, "--model", "FILE", "--target-id", "1", "--position", "99"],
         "position"),
        (["patch", "--model", "FILE", "--clean", CLEAN, "--corrupted", "The dog sat",
          "--target-id", "1", "--contrast-id", "2"], "--clean is 46 tokens and --corrupted is 11"),
        (["patch", "--model", "FILE", "--clean", "a b", "--corrupted", "a c",
          "--target-id", "1"], "needs both answers"),
        (["patch", "--model", "FILE", "--clean", "a b", "--corrupted", "a c",
          "--target-id", "1", "--contrast-id", "2", "--over", "layers"], "unknown --over"),
    ],
)  # fmt: skip
def test_user_errors_are_one_line_and_exit_2(files, capsys, args, needle):
    args = [str(files[1]) if a == "FILE" else a for a in args]
    code, _, err = run_main(capsys, *args)
    assert code == 2, err
    assert err.count("\n") == 1 and needle in err, err
    assert "Traceback" not in err


def test_figures_are_returned(loaded):
    from attnlab.explain import attribute, patch
    from attnlab.explain.figures import plot_attribution, plot_patch

    model, tok = loaded
    ids = tok.encode(CLEAN)
    fig = plot_attribution(attribute(model, ids, 5, 7))
    grid_ax, bar_ax = fig.axes[0], fig.axes[1]
    assert grid_ax.get_xlabel() == "head" and grid_ax.get_ylabel() == "layer"
    assert [t.get_text() for t in bar_ax.get_yticklabels()] == ["embedding", "mlp 0", "mlp 1",
                                                                 "bias"]  # fmt: skip
    assert len(bar_ax.patches) == 4
    grid = patch(model, ids, tok.encode(CORRUPTED), 5, 7, over="mlp")
    fig = plot_patch(grid, over="mlp", tokens=[str(i) for i in ids])
    assert fig.axes[0].get_xlabel() == "position (clean prompt)"
    assert fig.axes[0].images[0].get_array().shape == tuple(grid.shape)
