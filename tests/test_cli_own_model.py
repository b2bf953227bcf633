"""The commands on a model the user brings: a Hugging Face directory or a GGUF file,
built here (tiny random weights), run through the real CLI."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

if not all(importlib.util.find_spec(m) for m in ("transformers", "tokenizers", "gguf")):
    pytest.skip("needs transformers, tokenizers and gguf", allow_module_level=True)

from cli_runner import run_main
from model_files import save_hf, write_gguf

LLAMA = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}
BERT = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 64,
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("own")
    llama = save_hf("llama", LLAMA, root / "llama", torch.float32)
    gguf_path = root / "llama.Q8_0.gguf"
    write_gguf(llama, gguf_path, "llama", "Q8_0")
    bert = save_hf("bert", BERT, root / "bert", torch.float32, encoder=True)
    return llama, gguf_path, bert


def test_info_model_json_and_table(files, capsys):
    from attnlab.pretrained import load_pretrained

    code, out, err = run_main(capsys, "info", "--model", str(files[0]), "--json", "-t", "16")
    assert code == 0, err
    data = json.loads(out)
    model, _ = load_pretrained(files[0])
    assert data["family"] == "llama" and data["kind"] == "decoder"
    assert (data["layers"], data["heads"], data["kv_heads"], data["head_dim"]) == (2, 4, 2, 16)
    assert data["parameters"] == sum(p.numel() for p in model.parameters())
    assert data["rope"]["base"] == 10000.0 and data["dtype"] == "float32"
    assert len(data["per_layer"]) == 2 and all(lay["backend"] for lay in data["per_layer"])
    code, out, err = run_main(capsys, "info", "--model", str(files[1]))
    assert code == 0, err
    assert "llama" in out and "heads / kv heads" in out and "4 / 2" in out


def test_generate_from_a_gguf_file_matches_the_library(files, capsys):
    from attnlab.generation import generate
    from attnlab.pretrained import load_pretrained

    code, out, err = run_main(capsys, "generate", "--model", str(files[1]), "The cat", "-n", "6")
    assert code == 0, err
    model, tok = load_pretrained(files[1])
    ids = torch.tensor([tok.encode("The cat")])
    expected = tok.decode(generate(model, ids, 6)[0].tolist())
    assert expected in out.replace("\n", "") or expected.strip() in out


def test_embed_and_explain_take_a_directory(files, tmp_path, capsys):
    code, out, err = run_main(capsys, "embed", "--model", str(files[2]), "the cat", "a dog")
    assert code == 0, err
    assert "the cat" in out and "a dog" in out
    code, out, err = run_main(
        capsys, "explain", "--model", str(files[0]), "The cat sat", "--out", str(tmp_path)
    )
    assert code == 0, err
    assert "2 layers x 4 heads" in out and (tmp_path / "attention.html").is_file()


def test_broken_model_path_is_one_line_and_exit_2(files, tmp_path, capsys):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "mamba9"}')
    for args in (
        ("info", "--model", str(bad)),
        ("generate", "--model", str(bad), "hi"),
        ("generate", "--model", str(files[2]), "hi"),  # an encoder cannot generate
    ):
        code, _, err = run_main(capsys, *args)
        assert code == 2, (args, err)
        assert len(err.strip().splitlines()) == 1, err
