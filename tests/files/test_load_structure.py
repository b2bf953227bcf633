"""``load_structure``: the model a file describes, on the meta device, with no weight read.

What ``attnlab info --model`` prints comes from it, so its summary must be the summary of
the model ``load_pretrained`` loads, for every family, from a Hugging Face directory and
from a GGUF file; and a file ``load_pretrained`` refuses before reading a weight must be
refused the same way."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

if not all(importlib.util.find_spec(m) for m in ("transformers", "tokenizers", "gguf")):
    pytest.skip("needs transformers, tokenizers and gguf", allow_module_level=True)

from attnlab.pretrained import ModelFileError, load_pretrained, load_structure
from attnlab.pretrained.summary import summarize_model
from cli_runner import run_main
from model_files import TINY_CONFIGS, TINY_ENCODERS, save_hf, tiny_config, write_gguf

DECODERS = [f for f in TINY_CONFIGS if f not in TINY_ENCODERS]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("structure")
    return {f: save_hf(f, tiny_config(f), root / f, torch.float32) for f in TINY_CONFIGS}


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("structure-gguf")
    files = {}
    for f in DECODERS:
        folder = save_hf(f, tiny_config(f, gguf=True), root / f, torch.float32)
        write_gguf(folder, root / f"{f}.gguf", f, "Q8_0")
        files[f] = root / f"{f}.gguf"
    return files


def _no_reads(monkeypatch):
    """Any read of a weight's values fails the test (a GGUF file's RoPE factor tensors
    are part of its config: those are read)."""
    from attnlab.pretrained import gguf_file, safetensors_file

    read = gguf_file.GGUFContents.tensor

    def refuse(self, name, *args, **kwargs):
        raise AssertionError(f"weight {name!r} was read")

    def config_only(self, name):
        return read(self, name) if name.startswith("rope_") else refuse(self, name)

    monkeypatch.setattr(gguf_file.GGUFContents, "tensor", config_only)
    monkeypatch.setattr(gguf_file.GGUFContents, "codes", refuse)
    monkeypatch.setattr(safetensors_file.SafetensorsFile, "tensor", refuse)


@pytest.mark.parametrize(
    ("source", "family"),
    [("hf_dirs", f) for f in sorted(TINY_CONFIGS)] + [("gguf_files", f) for f in sorted(DECODERS)],
)
def test_the_structure_is_the_loaded_models(request, source, family, monkeypatch):
    path = request.getfixturevalue(source)[family]  # a directory or a GGUF file
    loaded, _ = load_pretrained(path)
    _no_reads(monkeypatch)
    model = load_structure(path)
    assert all(p.is_meta for p in model.parameters())
    assert not model.training
    assert summarize_model(model) == summarize_model(loaded)
    half = load_structure(path, dtype=torch.bfloat16)
    assert summarize_model(half).dtype == "bfloat16"


def test_files_refused_before_a_weight_is_read_are_refused_alike(hf_dirs, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    # a config that asks for more than the weights hold
    big = shutil.copytree(hf_dirs["llama"], tmp_path / "big")
    config = json.loads((big / "config.json").read_text())
    (big / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 8}))
    # a tensor the family does not know
    odd = shutil.copytree(hf_dirs["llama"], tmp_path / "odd")
    state = load_file(odd / "model.safetensors")
    state["model.layers.0.self_attn.mystery.weight"] = torch.zeros(4, 4)
    save_file(state, str(odd / "model.safetensors"), metadata={"format": "pt"})
    for folder, needle in ((big, "implies"), (odd, "mystery")):
        with pytest.raises(ModelFileError, match=needle) as loaded:
            load_pretrained(folder)
        with pytest.raises(ModelFileError, match=needle) as described:
            load_structure(folder)
        assert str(described.value) == str(loaded.value)
    with pytest.raises(ValueError, match="no such file"):
        load_structure(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="dtype"):
        load_structure(hf_dirs["llama"], dtype=torch.int8)


def test_info_reads_no_weight(hf_dirs, gguf_files, capsys, monkeypatch):
    _no_reads(monkeypatch)
    for path in (hf_dirs["qwen3"], gguf_files["gemma2"]):
        code, out, err = run_main(capsys, "info", "--model", str(path), "--json")
        assert code == 0, err
        info = json.loads(out)
        assert info["model"] == str(path) and info["parameters"] > 0


def test_the_packaged_encoder_is_on_the_meta_device_too():
    from attnlab.pretrained import packaged_installed

    if not packaged_installed("all-minilm-l6-v2"):
        pytest.skip("pip install 'attnlab[pretrained]'")
    model = load_structure("all-minilm-l6-v2")
    assert all(p.is_meta for p in model.parameters())
    assert (
        summarize_model(model).family
        == summarize_model(load_pretrained("all-minilm-l6-v2")[0]).family
    )
