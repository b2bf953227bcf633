"""`attnlab heads` and `attnlab explain --ablate`, run as the real command on a tiny
Llama-layout checkpoint and its GGUF file, checked against transformers."""

from __future__ import annotations

import importlib.util
import json
import os
import re

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
TEXT = "The cat sat on the mat, and the dog sat on the log."
SHORT = "The cat sat on the mat."


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("heads-cli")
    folder = save_hf("llama", LLAMA, root / "llama", torch.float32)
    gguf_path = root / "llama.gguf"
    write_gguf(folder, gguf_path, "llama", "F32")
    return folder, gguf_path


def test_heads_json_are_transformers_weights_on_the_documented_input(files):
    from transformers import AutoModelForCausalLM

    r = run_cli("heads", "--model", str(files[1]), "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    first = torch.randint(0, 512, (32,), generator=torch.Generator().manual_seed(0))
    assert data["ids"] == torch.cat([first, first]).tolist()
    assert data["roles"] == ["previous_token", "first_token", "current_token", "induction"]
    ref = AutoModelForCausalLM.from_pretrained(files[0], attn_implementation="eager").eval()
    with torch.no_grad():
        att = ref(torch.tensor([data["ids"]]), output_attentions=True).attentions
    A = torch.stack([a[0] for a in att])  # (L, H, 64, 64)
    T, n = 64, 32
    expected = {
        "previous_token": torch.stack([A[..., i, i - 1] for i in range(1, T)], -1).mean(-1),
        "first_token": A[..., 1:, 0].mean(-1),
        "current_token": torch.stack([A[..., i, i] for i in range(T)], -1).mean(-1),
        "induction": torch.stack([A[..., i, i - n + 1] for i in range(n, T)], -1).mean(-1),
    }
    for role, values in expected.items():
        torch.testing.assert_close(torch.tensor(data["scores"][role]), values, atol=1e-5, rtol=0)

    r = run_cli("heads", "--model", str(files[0]), "--top", "3")
    assert r.returncode == 0, r.stderr
    assert "2 layers x 4 heads" in r.stdout and "64 tokens" in r.stdout
    for role, values in expected.items():
        flat = values.flatten()
        best = int(flat.argmax())
        label = role.replace("_", " ")
        line = next(ln for ln in r.stdout.splitlines() if ln.startswith(label))
        assert line[len(label) :].split()[:2] == [f"{best // 4}.{best % 4}", f"{flat[best]:.2f}"]


def test_heads_on_text_leave_out_induction_and_say_so(files):
    r = run_cli("heads", TEXT, "--model", str(files[0]))
    assert r.returncode == 0, r.stderr
    assert "previous token" in r.stdout and "induction" not in r.stdout
    assert "induction is scored only on a sequence repeated twice" in r.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["heads"], "give a model"),
        (["heads", "--model", "FILE", "--top", "0"], "--top"),
        (["heads", "--model", "FILE", "--n", "100"], "context length 128"),
        (["explain", "hello", "--ablate", "0.1"], "--ablate needs a model"),
        (["explain", "hello", "--model", "FILE", "--ablate", "2.0"], "layers 0..1"),
        (["explain", "hello", "--model", "FILE", "--ablate", "1-0"], "LAYER.HEAD"),
        (["explain", "hello", "--model", "FILE", "--ablate", "1.0", "--ablate-mode", "x"],
         "--ablate-mode"),
    ],
)  # fmt: skip
def test_user_errors_are_one_line_and_exit_2(files, tmp_path, args, needle, capsys, monkeypatch):
    args = [str(files[0]) if a == "FILE" else a for a in args]
    monkeypatch.chdir(tmp_path)  # in this process: the tests above run the real command
    code, out, err = run_main(capsys, *args)
    assert code == 2, (out, err)
    assert err.count("\n") == 1 and needle in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("mode", ["zero", "mean"])
def test_explain_ablate_shows_the_prediction_with_and_without(files, tmp_path, mode):
    from transformers import AutoModelForCausalLM

    from attnlab.pretrained import load_pretrained

    _, tok = load_pretrained(files[0])
    ids = torch.tensor([tok.encode(TEXT)])
    ref = AutoModelForCausalLM.from_pretrained(files[0], attn_implementation="eager").eval()
    D = 16

    def pre(module, args):
        x = args[0].clone()
        part = x[..., 2 * D : 3 * D]
        x[..., 2 * D : 3 * D] = 0 if mode == "zero" else part.mean(1, keepdim=True)
        return (x,)

    with torch.no_grad():
        before = ref(ids).logits[0, -1].softmax(-1)
        handle = ref.model.layers[1].self_attn.o_proj.register_forward_pre_hook(pre)
        after = ref(ids).logits[0, -1].softmax(-1)
        handle.remove()
    r = run_cli("explain", TEXT, "--model", str(files[0]), "--ablate", "1.2",
                "--ablate-mode", mode, "--out", "o", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert f"heads 1.2 switched off ({mode})" in r.stdout
    rows = [ln.split() for ln in r.stdout.splitlines() if ln[:1] == "1" and "'" in ln]
    p_before, p_after = before.max().item(), after.max().item()
    assert any(f"{p_before:.3f}" in row and f"{p_after:.3f}" in row for row in rows), r.stdout
    kl = (before * (before.log() - after.log())).sum().item()
    assert f"last position: {kl:.4f} nats" in r.stdout


@pytest.mark.parametrize("columns", [60, 100])
def test_explain_terminal_heatmap_never_cuts_a_number(files, tmp_path, columns):
    from transformers import AutoModelForCausalLM

    from attnlab.pretrained import load_pretrained

    _, tok = load_pretrained(files[0])
    ids = tok.encode(SHORT)
    T = len(ids)
    assert 12 < T <= 32  # shown as a heatmap, wider than 60 columns
    ref = AutoModelForCausalLM.from_pretrained(files[0], attn_implementation="eager").eval()
    with torch.no_grad():
        weights = ref(torch.tensor([ids]), output_attentions=True).attentions[1][0, 3]
    r = run_cli("explain", SHORT, "--model", str(files[0]), "--layer", "1", "--head", "3",
                "--out", "o", cwd=tmp_path, columns=columns)  # fmt: skip
    assert r.returncode == 0, r.stderr
    table = [ln for ln in r.stdout.splitlines() if re.search(r"\d\.\d\d|\u00b7", ln)]
    assert table and max(len(line) for line in table) <= columns
    rows: dict[int, list[str]] = {}
    labels = [repr(t)[1:-1] for t in (tok.decode([i]) for i in ids)]
    row = 0
    for line in r.stdout.splitlines():
        cells = line.split()
        if (
            cells
            and all(re.fullmatch(r"\d\.\d\d|\u00b7", c) for c in cells[-1:])
            and any(re.fullmatch(r"\d\.\d\d|\u00b7", c) for c in cells)
        ):
            numbers = [c for c in cells if re.fullmatch(r"\d\.\d\d|\u00b7", c)]
            rows.setdefault(row % T, []).extend(numbers)
            row += 1
    assert sorted(rows) == list(range(T)) and row % T == 0 and row > 0
    for i in range(T):
        assert len(rows[i]) == T  # every column of every row, none cut
        for j, cell in enumerate(rows[i]):
            w = float(weights[i, j])
            if cell == "\u00b7":
                assert w == 0.0
            else:
                assert abs(float(cell) - w) <= 0.005 + 1e-6, (i, j, cell, w)
    assert "shade: 0 .. " in r.stdout
    assert labels[0] in r.stdout
