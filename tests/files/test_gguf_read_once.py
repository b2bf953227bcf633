"""A command checks a GGUF file's family, then loads it: the header is read once."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not all(importlib.util.find_spec(m) for m in ("transformers", "tokenizers", "gguf")):
    pytest.skip("needs transformers, tokenizers and gguf", allow_module_level=True)

from attnlab.cli.models import load_pretrained_model
from attnlab.pretrained import loaders
from model_files import save_hf, tiny_config, write_gguf


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("read-once")
    folder = save_hf("llama", tiny_config("llama", gguf=True), root / "llama", torch.float32)
    write_gguf(folder, root / "llama.gguf", "llama", "Q8_0")
    return root / "llama.gguf"


def test_the_family_check_and_the_load_read_the_header_once(gguf_path, monkeypatch):
    reads = []
    real = loaders.read_gguf
    monkeypatch.setattr(loaders, "read_gguf", lambda p: reads.append(p) or real(p))
    model, tok, _ = load_pretrained_model(str(gguf_path), kind="causal-lm")
    assert model.config.family == "llama"
    assert len(reads) == 1 and tok is not None
    assert loaders._READ == []  # taken by the load: nothing keeps the file mapped
    # a file changed between the check and the load is read again
    loaders.model_family(gguf_path)
    os.utime(gguf_path, ns=(1, 1))
    loaders.load_gguf(gguf_path)
    assert len(reads) == 3 and loaders._READ == []
