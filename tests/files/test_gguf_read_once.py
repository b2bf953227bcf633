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


def test_the_references_shared_parse_reads_what_gguf_py_reads(gguf_path):
    """``gguf_read_once`` (the transformers references' reader) parses a file once, over a
    plain array of its bytes: every field and tensor equal to gguf-py's own reading."""
    import gguf
    import numpy as np

    from model_files import gguf_read_once

    own = gguf.GGUFReader(gguf_path)
    assert type(own.data) is np.memmap
    with gguf_read_once():
        shared = gguf.GGUFReader(gguf_path)
        assert gguf.GGUFReader(str(gguf_path)) is shared  # parsed once
    assert type(shared.data) is np.ndarray and np.array_equal(shared.data, own.data)
    assert list(shared.fields) == list(own.fields)
    for name, field in own.fields.items():
        other = shared.fields[name]
        assert other.types == field.types and other.data == field.data, name
        assert len(other.parts) == len(field.parts), name
        for a, b in zip(other.parts, field.parts, strict=True):
            assert a.dtype == b.dtype and np.array_equal(a, b), name
    assert [t.name for t in shared.tensors] == [t.name for t in own.tensors]
    for a, b in zip(shared.tensors, own.tensors, strict=True):
        assert a.tensor_type == b.tensor_type and list(a.shape) == list(b.shape), a.name
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name
    assert type(gguf.GGUFReader(gguf_path).data) is np.memmap  # gguf-py's own again


def test_the_largest_tensor_is_read_ahead_and_asked_for_last(gguf_path, monkeypatch, ext):
    """A float32 load reads the file's largest tensor (when the compiled kernels read its
    type) in a helper thread, asks for it last, and gets the same model as without."""
    plain, _ = loaders.load_gguf(gguf_path)
    monkeypatch.setattr(loaders.ReadAhead, "FROM_BYTES", 0)
    started, asked = [], []
    real_init, real_tensor = loaders.ReadAhead.__init__, loaders.ReadAhead.tensor

    def init(self, contents, name):
        started.append(name)
        real_init(self, contents, name)

    def tensor(self, name):
        asked.append(name)
        return real_tensor(self, name)

    monkeypatch.setattr(loaders.ReadAhead, "__init__", init)
    monkeypatch.setattr(loaders.ReadAhead, "tensor", tensor)
    model, _ = loaders.load_gguf(gguf_path)
    contents = loaders.read_gguf(gguf_path)
    names = loaders.gguf_weight_names(contents, loaders.gguf_config(contents)[0])
    assert started == [max(names, key=lambda n: names[n])] and asked[-1] == started[0]
    assert len(asked) == len(set(asked))  # every tensor once
    ours, theirs = model.state_dict(), plain.state_dict()
    assert list(ours) == list(theirs)
    for name, value in theirs.items():
        assert torch.equal(ours[name], value), name
    # not for another dtype or a weight precision: their conversions read the values
    started.clear()
    loaders.load_gguf(gguf_path, dtype=torch.bfloat16)
    loaders.load_gguf(gguf_path, weight="int8")
    assert started == []


def test_a_read_ahead_error_is_raised_where_the_tensor_is_asked_for(gguf_path):
    """The helper's exception (a bad scale, named) reaches the caller when the model asks
    for the tensor, and waiting after a failed build swallows nothing else."""
    import types

    from attnlab.pretrained.errors import ModelFileError

    def broken(name):
        raise ModelFileError(gguf_path, f"tensor {name!r} holds 1 non-finite value(s)")

    ahead = loaders.ReadAhead(types.SimpleNamespace(tensor=broken), "token_embd.weight")
    with pytest.raises(ModelFileError, match=r"'token_embd\.weight' holds"):
        ahead.tensor("token_embd.weight")
    ahead.wait()  # the error was the caller's to see; waiting again raises nothing


def test_a_failed_build_leaves_no_read_ahead_running(gguf_path, monkeypatch, ext):
    """The build fails before it asks for the tensor read ahead: the load's error is
    raised, and the helper has finished by then."""
    import threading

    from attnlab.pretrained.errors import ModelFileError

    monkeypatch.setattr(loaders.ReadAhead, "FROM_BYTES", 0)

    def failing(*args, **kwargs):
        raise ModelFileError(gguf_path, "tensors do not match the model")

    monkeypatch.setattr(loaders, "build_model", failing)
    with pytest.raises(ModelFileError, match="do not match"):
        loaders.load_gguf(gguf_path)
    assert not [t for t in threading.enumerate() if t.name == "attnlab-read-ahead"]
