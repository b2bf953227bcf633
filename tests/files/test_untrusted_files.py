"""A corpus of broken and hostile model files, generated here. Each must raise one
ModelFileError (a ValueError) naming the file and the problem, within a second, without
allocating what the file claims."""

from __future__ import annotations

import importlib.util
import json
import re
import struct
import time

import pytest
import torch

if not all(importlib.util.find_spec(m) for m in ("transformers", "tokenizers", "gguf")):
    pytest.skip("needs transformers, tokenizers and gguf", allow_module_level=True)

from attnlab.pretrained import ModelFileError, load_pretrained
from model_files import save_hf, write_gguf

LLAMA = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    root = tmp_path_factory.mktemp("good")
    folder = save_hf("llama", LLAMA, root / "llama", torch.float32)
    gguf_path = root / "llama.gguf"
    write_gguf(folder, gguf_path, "llama", "Q8_0")
    load_pretrained(folder)  # both load when intact
    load_pretrained(gguf_path)
    return folder, gguf_path.read_bytes()


# ------------------------------------------------------------------ GGUF byte surgery


def _find(blob: bytes, text: str) -> int:
    i = blob.find(text.encode())
    assert i > 0, text
    return i + len(text)


def _tensor_info(blob: bytes, name: str) -> int:
    """Offset of the n_dims field of tensor ``name``'s info."""
    return _find(blob, name)


def _patch(blob: bytes, at: int, fmt: str, value) -> bytes:
    return blob[:at] + struct.pack(fmt, value) + blob[at + struct.calcsize(fmt) :]


def _header_end(blob: bytes) -> int:
    i = _tensor_info(blob, "blk.1.ffn_down.weight")
    return i + 4 + 2 * 8 + 4 + 8


_BEYOND = r"needs \d+ bytes at offset \d+, the file has \d+ left \(truncated or corrupt\)"
_NO_FIT = r"cannot fit in the \d+ bytes left"
_NOT_GGUF = r"is not a GGUF file of version 2 or 3"


def _gguf_cases():
    """Each case: (how to break the good file, what the error must say about the problem)."""
    cases = {
        "empty": (lambda b: b"", r"is 0 bytes, too short for a GGUF header"),
        "wrong magic": (lambda b: b"GGUX" + b[4:], _NOT_GGUF + r" \(magic b'GGUX'"),
        "version 1": (lambda b: _patch(b, 4, "<I", 1), _NOT_GGUF + r".*version 1\)"),
        "version 99": (lambda b: _patch(b, 4, "<I", 99), _NOT_GGUF + r".*version 99\)"),
        "tensor count beyond file": (
            lambda b: _patch(b, 8, "<Q", 1 << 60),
            r"tensor count = \d+ " + _NO_FIT,
        ),
        "kv count beyond file": (
            lambda b: _patch(b, 16, "<Q", 1 << 60),
            r"key-value count = \d+ " + _NO_FIT,
        ),
        "key length beyond file": (
            lambda b: _patch(b, 24, "<Q", 1 << 62),
            r"key 0: key of length \d+ " + _BEYOND,
        ),
        "unknown value type": (
            lambda b: _patch(b, 32 + struct.unpack_from("<Q", b, 24)[0], "<I", 77),
            r"unknown value type 77",
        ),
        "bad utf-8 token": (
            lambda b: _patch(b, _find(b, "tokenizer.ggml.tokens") + 24, "<B", 0xFF),
            r"'tokenizer.ggml.tokens': string 0 is not valid UTF-8",
        ),
        "bad utf-8 key": (lambda b: b[:32] + b"\xff\xfe" + b[34:], r"key is not valid UTF-8"),
        "token array length beyond file": (
            lambda b: _patch(b, _find(b, "tokenizer.ggml.tokens") + 8, "<Q", 1 << 55),
            r"'tokenizer.ggml.tokens': array length = \d+ " + _NO_FIT,
        ),
        "string length in array beyond file": (
            lambda b: _patch(b, _find(b, "tokenizer.ggml.tokens") + 16, "<Q", 1 << 50),
            r"'tokenizer.ggml.tokens': string 0 of length \d+ " + _BEYOND,
        ),
        "too many dims": (
            lambda b: _patch(b, _tensor_info(b, "token_embd.weight"), "<I", 100),
            r"'token_embd.weight': has 100 dimensions, expected 1..4",
        ),
        "dims product overflows": (
            lambda b: _patch(
                _patch(b, _tensor_info(b, "token_embd.weight") + 4, "<Q", 1 << 63),
                _tensor_info(b, "token_embd.weight") + 12,
                "<Q",
                1 << 63,
            ),
            r"'token_embd.weight': dimensions \[\d+, \d+\] .* are not a sane shape",
        ),
        "unknown ggml type": (
            lambda b: _patch(b, _tensor_info(b, "token_embd.weight") + 4 + 16, "<I", 999),
            r"'token_embd.weight': unknown ggml type 999",
        ),
        "tensor offset past end": (
            lambda b: _patch(
                b, _tensor_info(b, "blk.1.ffn_down.weight") + 4 + 16 + 4, "<Q", 1 << 40
            ),
            r"'blk.1.ffn_down.weight': data at offset 1099511627776 .* lies past the end",
        ),
        "tensor data cut off": (
            lambda b: b[: len(b) - 100],
            r"data at offset \d+ .* lies past the end of the file",
        ),
    }
    # Truncated inside each part of the header: every 1/14th of it.
    for k in range(1, 14):
        cases[f"truncated at {k}/14 of the header"] = (
            lambda b, k=k: b[: _header_end(b) * k // 14],
            f"{_NO_FIT}|{_BEYOND}",
        )
    return cases


GGUF_CASES = _gguf_cases()


@pytest.mark.parametrize("case", sorted(GGUF_CASES))
def test_broken_gguf_raises_one_clear_error(good, tmp_path, case):
    path = tmp_path / "broken.gguf"
    edit, problem = GGUF_CASES[case]
    path.write_bytes(edit(good[1]))
    t0 = time.perf_counter()
    with pytest.raises(ModelFileError) as err:
        load_pretrained(path)
    # fails fast, before reading or allocating the claimed sizes (generous: a busy machine)
    assert time.perf_counter() - t0 < 15.0
    message = str(err.value)
    assert message.startswith(f"{path}: "), message  # the file ...
    assert re.search(problem, message), message  # ... and the problem
    assert isinstance(err.value, ValueError)


# ------------------------------------------------------------------ directories


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _st_header(path):
    blob = path.read_bytes()
    n = struct.unpack_from("<Q", blob, 0)[0]
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def _st_write(path, header, data):
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _edit_st(fn):
    def edit(folder):
        path = folder / "model.safetensors"
        header, data = _st_header(path)
        result = fn(header, data)
        if isinstance(result, bytes):
            path.write_bytes(result)
        else:
            _st_write(path, *(result or (header, data)))
        return "model.safetensors"

    return edit


def _first(header):
    return next(k for k in header if k != "__metadata__")


def _edit_config(named="config.json", **changes):
    def edit(folder):
        cfg = json.loads((folder / "config.json").read_text())
        for k, v in changes.items():
            if v is None:
                cfg.pop(k, None)
            else:
                cfg[k] = v
        (folder / "config.json").write_text(json.dumps(cfg))
        return named

    return edit


def _index(weight_map_fn):
    def edit(folder):
        header, _ = _st_header(folder / "model.safetensors")
        names = [k for k in header if k != "__metadata__"]
        wm = weight_map_fn(names)
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
        return "model.safetensors.index.json"

    return edit


def _write(name, content):
    def edit(folder):
        (folder / name).write_bytes(content)
        return name

    return edit


def _delete_tensor(header, data):
    header.pop("model.layers.1.mlp.up_proj.weight")
    return header, data


def _set(key, field, value):
    def fn(header, data):
        header[_first(header) if key is None else key][field] = value
        return header, data

    return fn


def _overlap(header, data):
    names = [k for k in header if k != "__metadata__"]
    header[names[1]]["data_offsets"] = header[names[0]]["data_offsets"]
    return header, data


DIR_CASES = {
    "safetensors shorter than 8 bytes": _write("model.safetensors", b"\x01\x02"),
    "safetensors header length beyond file": _edit_st(
        lambda h, d: struct.pack("<Q", 1 << 40) + b"{}"
    ),
    "safetensors header length absurd": _edit_st(lambda h, d: struct.pack("<Q", 2**63) + b"{}"),
    "safetensors header not json": _edit_st(lambda h, d: struct.pack("<Q", 5) + b"{oops" + d),
    "safetensors header a json list": _edit_st(lambda h, d: struct.pack("<Q", 2) + b"[]" + d),
    "safetensors offsets past end": _edit_st(_set(None, "data_offsets", [0, 1 << 40])),
    "safetensors offsets disagree with shape": _edit_st(_set(None, "shape", [3, 3])),
    "safetensors unknown dtype": _edit_st(_set(None, "dtype", "F128")),
    "safetensors negative dim": _edit_st(_set(None, "shape", [-1, 64])),
    "safetensors overlapping tensors": _edit_st(_overlap),
    "missing tensor": _edit_st(_delete_tensor),
    "index names a missing shard": _index(
        lambda names: {n: "model-00009.safetensors" for n in names}
    ),
    "index path outside the directory": _index(
        lambda names: {n: "../outside/model.safetensors" for n in names}
    ),
    "index absolute path": _index(lambda names: {n: "/etc/passwd" for n in names}),
    "index names a tensor its shard lacks": _index(
        lambda names: {
            **{n: "model.safetensors" for n in names},
            "ghost.weight": "model.safetensors",
        }
    ),
    "config not json": _write("config.json", b"{model_type: llama"),
    "config a json list": _write("config.json", b"[1, 2]"),
    "config without model_type": _edit_config(model_type=None),
    "config unknown model_type": _edit_config(model_type="mamba9"),
    "config lacks hidden_size": _edit_config(hidden_size=None),
    "config 10^12-wide layer": _edit_config(hidden_size=10**12, intermediate_size=10**12),
    "config a million layers": _edit_config(num_hidden_layers=10**6),
    "config width a string": _edit_config(hidden_size="64"),
    # These two name the weights file and say the config disagrees with it.
    "config more than the weights hold": _edit_config("model.safetensors", intermediate_size=60000),
    "config shapes disagree": _edit_config("model.safetensors", vocab_size=500),
    "config longrope without its factors": _edit_config(
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0}
    ),
    "config heads do not divide": _edit_config(num_key_value_heads=3),
    # The folder, what it holds, and why attnlab will not open it.
    "only a pickle": lambda folder: (
        (folder / "model.safetensors").unlink(),
        (folder / "pytorch_model.bin").write_bytes(b"\x80\x04pickle"),
        f"{folder}: holds only pytorch_model.bin (a pickle, which attnlab never opens)",
    )[-1],
    "tokenizer.json garbage": _write("tokenizer.json", b"\x00\x01 not a tokenizer"),
}


@pytest.mark.parametrize("case", sorted(DIR_CASES))
def test_broken_model_directory_raises_one_clear_error(good, tmp_path, case):
    folder = _copy(good[0], tmp_path / "model")
    named = DIR_CASES[case](folder)
    t0 = time.perf_counter()
    with pytest.raises(ModelFileError) as err:
        load_pretrained(folder)
    # fails fast, before reading or allocating the claimed sizes (generous: a busy machine)
    assert time.perf_counter() - t0 < 15.0
    assert named in str(err.value), str(err.value)
    assert isinstance(err.value, ValueError)


def test_the_corpus_is_big_enough():
    assert len(GGUF_CASES) + len(DIR_CASES) >= 30
