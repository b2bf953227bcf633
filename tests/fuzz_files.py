"""A seeded mutation fuzzer for model files: a tiny Llama Q8_0 GGUF file and a tiny Hugging
Face directory, mutated one seed at a time and loaded in-process through
``attnlab.pretrained.load_pretrained`` under an address-space limit and a time alarm.

Every case must end in one of two outcomes: the model loads and its logits on a short input
are finite, or the loader raises ``ModelFileError``. Anything else is a finding: another
exception, non-finite logits, a ``MemoryError`` (over-allocation) or a timeout (hang).

Run as a script for the outcome counts of a sweep::

    PYTHONPATH=src python tests/fuzz_files.py --gguf 700 --hf 300
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import resource
import signal
import struct
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

# GGUF value types (gguf.md): id -> struct format; 8 string, 9 array.
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9
# ggml type ids and their (block elements, block bytes), the common ones.
_GGML_TYPES = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 8: (32, 34), 9: (32, 36), 30: (1, 2)}

LLAMA = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}

# What each outcome is called; only the first two are allowed.
LOADED, REFUSED = "loaded", "ModelFileError"
TIME_LIMIT_S = 20
ADDRESS_SPACE_HEADROOM = 3 << 30  # bytes a case may map/allocate beyond what the process has


# --------------------------------------------------------------------------- base files


def make_base_files(root: Path) -> tuple[Path, bytes]:
    """The intact files: a tiny Llama HF directory and its Q8_0 GGUF conversion (bytes); the
    tokenizer has merges."""
    from model_files import save_hf, write_gguf

    folder = save_hf("llama", LLAMA, root / "llama", torch.float32, tokenizer_vocab=320)
    gguf_path = root / "llama.gguf"
    write_gguf(folder, gguf_path, "llama", "Q8_0")
    return folder, gguf_path.read_bytes()


def make_gemma2_base_files(root: Path) -> tuple[Path, bytes]:
    """A tiny Gemma 2 HF directory (the GGUF tests' checkpoint: soft-caps, a window on every
    other layer, H * D != C) and its Q8_0 GGUF conversion with a SentencePiece vocabulary
    (scores, token types, byte tokens), as bytes."""
    from model_files import save_hf, tiny_config, write_gguf

    folder = save_hf("gemma2", tiny_config("gemma2", gguf=True), root / "gemma2", torch.float32)
    path = root / "gemma2.gguf"
    write_gguf(folder, path, "gemma2", "Q8_0")
    return folder, path.read_bytes()


# --------------------------------------------------------------------------- GGUF layout


@dataclass(frozen=True)
class Field:
    """One field of a GGUF header: where it lies and what it is."""

    offset: int
    fmt: str  # struct format, or "bytes" for string contents
    size: int
    kind: str  # count, length, vtype, value, string, ndims, dim, ggml_type, data_offset
    key: str  # the metadata key or tensor name it belongs to
    region: str  # metadata or tensor_info


@dataclass(frozen=True)
class Layout:
    """The fields of a GGUF file and where its tensor data lies."""

    fields: tuple[Field, ...]
    metadata: tuple[int, int]
    tensor_info: tuple[int, int]
    data_start: int
    # (name, ggml type, absolute offset, n elements)
    tensors: tuple[tuple[str, int, int, int], ...]


def gguf_layout(blob: bytes) -> Layout:
    """Walk an intact GGUF v3 file and record every field (independent of attnlab's reader)."""
    fields: list[Field] = []
    pos = 24
    fields += [
        Field(8, "<Q", 8, "count", "tensor count", "metadata"),
        Field(16, "<Q", 8, "count", "kv count", "metadata"),
    ]
    n_tensors, n_kv = struct.unpack_from("<QQ", blob, 8)

    def string(key: str, region: str) -> str:
        nonlocal pos
        (n,) = struct.unpack_from("<Q", blob, pos)
        fields.append(Field(pos, "<Q", 8, "length", key, region))
        fields.append(Field(pos + 8, "bytes", n, "string", key, region))
        text = blob[pos + 8 : pos + 8 + n].decode()
        pos += 8 + n
        return text

    def value(vtype: int, key: str) -> None:
        nonlocal pos
        if vtype == _STRING:
            string(key, "metadata")
        elif vtype == _ARRAY:
            (item,) = struct.unpack_from("<I", blob, pos)
            fields.append(Field(pos, "<I", 4, "vtype", key, "metadata"))
            (count,) = struct.unpack_from("<Q", blob, pos + 4)
            fields.append(Field(pos + 4, "<Q", 8, "length", key, "metadata"))
            pos += 12
            for _ in range(count):
                value(item, key)
        else:
            fmt = _SCALARS[vtype]
            fields.append(Field(pos, fmt, struct.calcsize(fmt), "value", key, "metadata"))
            pos += struct.calcsize(fmt)

    for _ in range(n_kv):
        key = string("key", "metadata")
        (vtype,) = struct.unpack_from("<I", blob, pos)
        fields.append(Field(pos, "<I", 4, "vtype", key, "metadata"))
        pos += 4
        value(vtype, key)
    meta_end = pos
    raw = []
    for _ in range(n_tensors):
        name = string("tensor name", "tensor_info")
        (n_dims,) = struct.unpack_from("<I", blob, pos)
        fields.append(Field(pos, "<I", 4, "ndims", name, "tensor_info"))
        pos += 4
        dims = []
        for _ in range(n_dims):
            dims.append(struct.unpack_from("<Q", blob, pos)[0])
            fields.append(Field(pos, "<Q", 8, "dim", name, "tensor_info"))
            pos += 8
        (gtype,) = struct.unpack_from("<I", blob, pos)
        fields.append(Field(pos, "<I", 4, "ggml_type", name, "tensor_info"))
        (offset,) = struct.unpack_from("<Q", blob, pos + 4)
        fields.append(Field(pos + 4, "<Q", 8, "data_offset", name, "tensor_info"))
        pos += 12
        raw.append((name, gtype, offset, math.prod(dims)))
    data_start = (pos + 31) // 32 * 32
    tensors = tuple((n, t, data_start + o, e) for n, t, o, e in raw)
    return Layout(tuple(fields), (24, meta_end), (meta_end, pos), data_start, tensors)


# --------------------------------------------------------------------------- GGUF mutators

_INTERESTING_INTS = (0, 1, 2, 3, 7, 31, 33, 255, 1 << 15, 1 << 16, 1 << 31, 1 << 32, 1 << 62)
_FLOATS = (math.nan, math.inf, -math.inf, 0.0, -1.0, 1e-30, 1e30, 65504.0, 3.0)
_F16_SPECIAL = (b"\x00\x7e", b"\x00\x7c", b"\x00\xfc", b"\xff\x7f")  # NaN, +inf, -inf, NaN


def _put(blob: bytearray, at: int, fmt: str, value: int | float) -> None:
    size = struct.calcsize(fmt)
    if fmt in ("<f", "<d"):
        blob[at : at + size] = struct.pack(fmt, float(value))
        return
    bits = 8 * size
    signed = fmt[1].islower() and fmt[1] != "?"
    v = int(value) % (1 << bits)
    if signed and v >= 1 << (bits - 1):
        v -= 1 << bits
    if fmt == "<?":
        v = int(value) & 0xFF
        blob[at] = v
        return
    blob[at : at + size] = struct.pack(fmt, v)


def _flip(rng: random.Random, blob: bytearray, lo: int, hi: int, n: int) -> str:
    where = []
    for _ in range(n):
        i = rng.randrange(lo, hi)
        bit = rng.randrange(8)
        blob[i] ^= 1 << bit
        where.append(f"{i}:{bit}")
    return "flip " + ",".join(where)


def mutate_gguf(blob: bytes, layout: Layout, rng: random.Random) -> tuple[bytes, str]:
    """One random mutation of the GGUF bytes; returns the new bytes and what was done."""
    out = bytearray(blob)
    kind = rng.choices(
        [
            "flip_meta",
            "flip_info",
            "flip_data",
            "truncate",
            "int_field",
            "swap_type",
            "scalar_value",
            "string_bytes",
            "bad_scale",
            "bad_f32",
            "merge_token",
        ],
        weights=[12, 10, 6, 6, 16, 10, 12, 10, 10, 4, 4],
    )[0]
    fields = layout.fields
    if kind == "flip_meta":
        return bytes(out), _flip(rng, out, *layout.metadata, rng.randint(1, 3))
    if kind == "flip_info":
        return bytes(out), _flip(rng, out, *layout.tensor_info, rng.randint(1, 3))
    if kind == "flip_data":
        return bytes(out), _flip(rng, out, layout.data_start, len(out), rng.randint(1, 8))
    if kind == "truncate":
        anywhere = rng.random() < 0.3
        cut = rng.randrange(len(blob) if anywhere else layout.data_start)
        return bytes(out[:cut]), f"truncate at {cut}"
    if kind == "int_field":
        f = rng.choice([f for f in fields if f.fmt not in ("bytes", "<f", "<d")])
        base = struct.unpack_from(f.fmt, blob, f.offset)[0]
        v = rng.choice(
            [*_INTERESTING_INTS, base + 1, base - 1, base * 2, -1, rng.randrange(1 << 20)]
        )
        _put(out, f.offset, f.fmt, v)
        return bytes(out), f"{f.kind} of {f.key!r} at {f.offset}: {base} -> {v}"
    if kind == "swap_type":
        f = rng.choice([f for f in fields if f.kind in ("vtype", "ggml_type")])
        base = struct.unpack_from(f.fmt, blob, f.offset)[0]
        choices = range(13) if f.kind == "vtype" else sorted(_GGML_TYPES)
        v = rng.choice([c for c in choices if c != base])
        _put(out, f.offset, f.fmt, v)
        return bytes(out), f"{f.kind} of {f.key!r}: {base} -> {v}"
    if kind == "scalar_value":
        f = rng.choice([f for f in fields if f.kind == "value" and not f.key.startswith("tok")])
        base = struct.unpack_from(f.fmt, blob, f.offset)[0]
        if f.fmt in ("<f", "<d"):
            v: float = rng.choice(_FLOATS)
        else:
            v = rng.choice([*_INTERESTING_INTS, -1, base + 1, base - 1, 0])
        _put(out, f.offset, f.fmt, v)
        return bytes(out), f"value of {f.key!r}: {base} -> {v}"
    if kind == "string_bytes":
        f = rng.choice([f for f in fields if f.kind == "string" and f.size > 0])
        i = f.offset + rng.randrange(f.size)
        new = rng.choice([ord(" "), ord("a"), ord("e"), 0, 0xC3, rng.randrange(256)])
        old = out[i]
        out[i] = new
        return bytes(out), f"string of {f.key!r} byte {i}: {old} -> {new}"
    if kind == "bad_scale":
        q8 = [t for t in layout.tensors if t[1] == 8]
        name, _, start, n = rng.choice(q8)
        block = rng.randrange(n // 32)
        at = start + 34 * block
        out[at : at + 2] = rng.choice(_F16_SPECIAL)
        return bytes(out), f"Q8_0 scale of {name!r} block {block} -> {bytes(out[at : at + 2])!r}"
    merges = [f for f in fields if f.kind == "string" and f.key == "tokenizer.ggml.merges"]
    if kind == "merge_token" and not merges:  # a SentencePiece vocabulary: its scores
        f = rng.choice([f for f in fields if f.kind == "value" and f.key.startswith("tok")])
        base = struct.unpack_from(f.fmt, blob, f.offset)[0]
        v = rng.choice(_FLOATS) if f.fmt in ("<f", "<d") else rng.choice(_INTERESTING_INTS)
        _put(out, f.offset, f.fmt, v)
        return bytes(out), f"value in {f.key!r} at {f.offset}: {base} -> {v}"
    if kind == "merge_token":  # one side of a merge -> another token of the same byte length
        tokens = [f for f in fields if f.kind == "string" and f.key == "tokenizer.ggml.tokens"]
        f = rng.choice(merges)
        left, right = blob[f.offset : f.offset + f.size].split(b" ", 1)
        side = rng.randrange(2)
        old = (left, right)[side]
        same = [t for t in tokens if t.size == len(old)]
        t = rng.choice(same)
        new = blob[t.offset : t.offset + t.size]
        merged = (new + b" " + right) if side == 0 else (left + b" " + new)
        out[f.offset : f.offset + f.size] = merged
        return bytes(out), f"merge {left + b' ' + right!r} -> {merged!r}"
    f32 = [t for t in layout.tensors if t[1] == 0]
    name, _, start, n = rng.choice(f32)
    at = start + 4 * rng.randrange(n)
    v = rng.choice([math.nan, math.inf, -math.inf])
    out[at : at + 4] = struct.pack("<f", v)
    return bytes(out), f"F32 value of {name!r} at {at} -> {v}"


# --------------------------------------------------------------------------- HF mutators

# Config keys the llama-layout families read (present or not in the base file).
LLAMA_CONFIG_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
    "hidden_act",
    "head_dim",
    "sliding_window",
    "attention_bias",
    "mlp_bias",
    "rope_theta",
    "rope_parameters",
    "rope_scaling",
    "partial_rotary_factor",
    "pretraining_tp",
    "model_type",
    "torch_dtype",
    "layer_types",
)
# Gemma 2's own keys on top.
GEMMA2_CONFIG_KEYS = (
    *LLAMA_CONFIG_KEYS,
    "hidden_activation",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "query_pre_attn_scalar",
    "layer_types",
    "pad_token_id",
)
_ROPE_KEYS = (
    "rope_type",
    "rope_theta",
    "factor",
    "original_max_position_embeddings",
    "low_freq_factor",
    "high_freq_factor",
    "partial_rotary_factor",
    "type",
)
_HOSTILE = (
    0,
    -1,
    1,
    3,
    7,
    2**31,
    2**63,
    10**400,
    0.5,
    -0.5,
    1e308,
    math.nan,
    math.inf,
    -math.inf,
    "",
    "silu",
    "llama3",
    "linear",
    "yarn",
    "dynamic",
    "longrope",
    [],
    [1, 2],
    ["silu"],
    {},
    {"a": 1},
    {"rope_type": "linear"},
    None,
    True,
    False,
)


def _st_split(path: Path) -> tuple[int, bytes, bytes]:
    blob = path.read_bytes()
    n = struct.unpack_from("<Q", blob, 0)[0]
    return n, blob[8 : 8 + n], blob[8 + n :]


def mutate_hf(folder: Path, rng: random.Random, keys: tuple[str, ...] = LLAMA_CONFIG_KEYS) -> str:
    """One random mutation of the directory, in place (config values among ``keys``);
    returns what was done."""
    kind = rng.choices(
        ["st_flip", "st_digit", "st_length", "st_data", "cfg_value", "cfg_rope", "cfg_delete"],
        weights=[8, 14, 4, 6, 40, 20, 8],
    )[0]
    st = folder / "model.safetensors"
    cfg_path = folder / "config.json"
    if kind.startswith("st_"):
        n, header, data = _st_split(st)
        if kind == "st_flip":
            h = bytearray(header)
            what = _flip(rng, h, 0, len(h), rng.randint(1, 3))
            st.write_bytes(struct.pack("<Q", n) + bytes(h) + data)
            return "safetensors header " + what
        if kind == "st_digit":
            h = bytearray(header)
            digits = [i for i, c in enumerate(h) if chr(c).isdigit()]
            i = rng.choice(digits)
            old, new = chr(h[i]), rng.choice("0123456789")
            h[i] = ord(new)
            st.write_bytes(struct.pack("<Q", n) + bytes(h) + data)
            return f"safetensors header digit {i}: {old} -> {new}"
        if kind == "st_length":
            v = rng.choice([n - 1, n + 1, 0, 1 << 63, n + len(data), rng.randrange(n)])
            st.write_bytes(struct.pack("<Q", v) + header + data)
            return f"safetensors header length {n} -> {v}"
        d = bytearray(data)
        at = 4 * rng.randrange(len(d) // 4)
        v = rng.choice([math.nan, math.inf, -math.inf])
        d[at : at + 4] = struct.pack("<f", v)
        st.write_bytes(struct.pack("<Q", n) + header + bytes(d))
        return f"safetensors data at {at} -> {v}"
    cfg = json.loads(cfg_path.read_text())
    if kind == "cfg_delete":
        key = rng.choice(sorted(cfg))
        del cfg[key]
        what = f"config: delete {key!r}"
    elif kind == "cfg_rope":
        rope = cfg.get("rope_parameters")
        rope = dict(rope) if isinstance(rope, dict) else {}
        key, value = rng.choice(_ROPE_KEYS), rng.choice(_HOSTILE)
        rope[key] = value
        cfg["rope_parameters"] = rope
        what = f"config: rope_parameters[{key!r}] = {value!r}"
    else:
        key, value = rng.choice(keys), rng.choice(_HOSTILE)
        cfg[key] = value
        what = f"config: {key!r} = {value!r}"
    cfg_path.write_text(json.dumps(cfg))  # NaN / Infinity as Python's json writes them
    return what


# --------------------------------------------------------------------------- replays
# The findings kept as regression cases, replayed by name rather than by seed: a seed's
# mutation depends on the base file's bytes, these edits only on its structure.


def _field(layout: Layout, kind: str, key: str, nth: int = 0) -> Field:
    return [f for f in layout.fields if f.kind == kind and f.key == key][nth]


def edit_string(blob: bytes, layout: Layout, key: str, old: str, new: str) -> bytes:
    """Replace the string ``old`` of metadata ``key`` (an array of strings or one string)
    by ``new`` of the same byte length."""
    a, b = old.encode(), new.encode()
    assert len(a) == len(b), (old, new)
    f = next(
        f
        for f in layout.fields
        if f.kind == "string" and f.key == key and blob[f.offset : f.offset + f.size] == a
    )
    return blob[: f.offset] + b + blob[f.offset + f.size :]


def edit_int(blob: bytes, layout: Layout, kind: str, key: str, value: int, nth: int = 0) -> bytes:
    """Set the ``nth`` integer field of ``kind`` (dim, ggml_type, ...) of ``key``."""
    f = _field(layout, kind, key, nth)
    out = bytearray(blob)
    _put(out, f.offset, f.fmt, value)
    return bytes(out)


def edit_last_type(blob: bytes, layout: Layout, ggml_type: int, fill: bytes) -> bytes:
    """Give the last tensor in the data another ggml type and fill its data with ``fill``
    bytes, the file grown to hold it (so that only the type or the values can stop it)."""
    name, _, start, n = max(layout.tensors, key=lambda t: t[2])
    block, size = _GGML_TYPES[ggml_type]
    out = edit_int(blob, layout, "ggml_type", name, ggml_type)
    end = start + n // block * size
    return out[:start] + fill * (end - start) + out[end:]


def edit_q8_scale(blob: bytes, layout: Layout, tensor: str, block: int, f16: bytes) -> bytes:
    """Set the fp16 scale of a Q8_0 tensor's ``block`` to the raw bytes ``f16``."""
    start = next(t[2] for t in layout.tensors if t[0] == tensor and t[1] == 8)
    at = start + 34 * block
    return blob[:at] + f16 + blob[at + 2 :]


def edit_f32(blob: bytes, layout: Layout, tensor: str, index: int, value: float) -> bytes:
    """Set one value of an F32 tensor."""
    start = next(t[2] for t in layout.tensors if t[0] == tensor and t[1] == 0)
    at = start + 4 * index
    return blob[:at] + struct.pack("<f", value) + blob[at + 4 :]


def edit_config(folder: Path, **changes: object) -> None:
    """Set values in ``config.json`` (as Python's json writes them: NaN, Infinity)."""
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def edit_safetensors(folder: Path, tensor: str | None, index: int, value: float) -> None:
    """Set one float32 value of ``tensor`` in ``model.safetensors``; with ``tensor`` None,
    shift the header length by ``index`` instead (the data then starts off by that much)."""
    st = folder / "model.safetensors"
    n, header, data = _st_split(st)
    if tensor is None:
        st.write_bytes(struct.pack("<Q", n + index) + header + data)
        return
    begin = json.loads(header)[tensor]["data_offsets"][0] + 4 * index
    d = data[:begin] + struct.pack("<f", value) + data[begin + 4 :]
    st.write_bytes(struct.pack("<Q", n) + header + d)


# --------------------------------------------------------------------------- running


class _Timeout(BaseException):
    """The case ran past its alarm (a BaseException: no ``except Exception`` swallows it)."""


@contextlib.contextmanager
def guarded(seconds: int = TIME_LIMIT_S, headroom: int = ADDRESS_SPACE_HEADROOM) -> Iterator[None]:
    """Run a block under a time alarm and an address-space limit (now + ``headroom``)."""

    def on_alarm(signum: int, frame: object) -> None:
        raise _Timeout(f"no answer within {seconds} s")

    used = _address_space()
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = used + headroom
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    old = signal.signal(signal.SIGALRM, on_alarm)
    threads = torch.get_num_threads()
    # One thread: a tiny model's matmuls wait on a busy machine's thread pool otherwise.
    torch.set_num_threads(1)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    # An outer alarm (pytest-timeout's signal method) is put back afterwards, less the time
    # the case took.
    outer, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    started = time.monotonic()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # numpy on NaN scales
            yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        if outer:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - started), 1e-3))
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        torch.set_num_threads(threads)


def _address_space() -> int:
    """This process's virtual size in bytes (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


@dataclass(frozen=True)
class Outcome:
    """How one case ended: ``kind`` is loaded / ModelFileError / a failure class."""

    kind: str
    detail: str

    @property
    def ok(self) -> bool:
        return self.kind in (LOADED, REFUSED)


def load_and_check(path: Path) -> Outcome:
    """Load ``path`` through the public entry point; classify the outcome."""
    from attnlab.pretrained import ModelFileError, load_pretrained

    try:
        with guarded():
            model, tok = load_pretrained(path)
            limit = getattr(model.config, "context_length", None) or 16
            ids = torch.tensor([tok.encode("Hello world, 42!")[: min(16, limit)] or [0]])
            with torch.no_grad():
                logits = model(ids)
            logits = logits[0] if isinstance(logits, tuple) else logits
            finite = bool(torch.isfinite(logits).all())
    except ModelFileError as e:
        if path.name not in str(e) and path.parent.name not in str(e):
            return Outcome("unnamed ModelFileError", str(e)[:300])
        return Outcome(REFUSED, str(e)[:300])
    except _Timeout as e:
        return Outcome("timeout", str(e))
    except MemoryError as e:
        return Outcome("MemoryError", str(e)[:300])
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # every other one is a finding (pyo3 panics are BaseExceptions)
        tb = traceback.extract_tb(e.__traceback__)[-1]
        where = f"{Path(tb.filename).name}:{tb.lineno}"
        return Outcome(f"{type(e).__name__}", f"{str(e)[:240]} [{where}]")
    if not finite:
        return Outcome("non-finite logits", "")
    return Outcome(LOADED, "")


def run_gguf_case(base: bytes, layout: Layout, seed: int, tmp: Path) -> tuple[str, Outcome]:
    """Mutate the GGUF file with ``seed``, load it; (what was done, outcome)."""
    blob, what = mutate_gguf(base, layout, random.Random(seed))
    path = tmp / f"fuzz-{seed}.gguf"
    path.write_bytes(blob)
    try:
        return what, load_and_check(path)
    finally:
        path.unlink()


def run_hf_case(
    base: Path, seed: int, tmp: Path, keys: tuple[str, ...] = LLAMA_CONFIG_KEYS
) -> tuple[str, Outcome]:
    """Mutate a copy of the HF directory with ``seed``, load it; (what was done, outcome)."""
    import shutil

    folder = tmp / f"fuzz-{seed}"
    shutil.copytree(base, folder)
    try:
        what = mutate_hf(folder, random.Random(seed), keys)
        return what, load_and_check(folder)
    finally:
        shutil.rmtree(folder)


def sweep(
    run: Callable[[int], tuple[str, Outcome]], seeds: range
) -> tuple[dict[str, int], list[tuple[int, str, Outcome]]]:
    """Outcome counts over ``seeds`` and the failing cases (seed, mutation, outcome)."""
    counts: dict[str, int] = {}
    failures = []
    for seed in seeds:
        what, outcome = run(seed)
        counts[outcome.kind] = counts.get(outcome.kind, 0) + 1
        if not outcome.ok:
            failures.append((seed, what, outcome))
    return counts, failures


def main() -> None:
    import argparse
    import sys
    import tempfile

    sys.path.insert(0, str(Path(__file__).parent))
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gguf", type=int, default=300, help="GGUF cases (seeds 0..N-1)")
    parser.add_argument("--hf", type=int, default=200, help="HF directory cases")
    parser.add_argument("--spm", type=int, default=0, help="Gemma 2 (SentencePiece) GGUF cases")
    parser.add_argument("--hf-gemma2", type=int, default=0, help="Gemma 2 HF directory cases")
    parser.add_argument("--first", type=int, default=0, help="first seed")
    args = parser.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        folder, blob = make_base_files(tmp)
        layout = gguf_layout(blob)
        g_folder, spm = make_gemma2_base_files(tmp)
        spm_layout = gguf_layout(spm)
        keys = GEMMA2_CONFIG_KEYS
        for name, n, run in (
            ("gguf", args.gguf, lambda s: run_gguf_case(blob, layout, s, tmp)),
            ("hf", args.hf, lambda s: run_hf_case(folder, s, tmp)),
            ("spm", args.spm, lambda s: run_gguf_case(spm, spm_layout, s, tmp)),
            ("hf-gemma2", args.hf_gemma2, lambda s: run_hf_case(g_folder, s, tmp, keys)),
        ):
            t0 = time.perf_counter()
            counts, failures = sweep(run, range(args.first, args.first + n))
            took = time.perf_counter() - t0
            print(f"{name}: {n} cases in {took:.1f} s: {dict(sorted(counts.items()))}")
            for seed, what, outcome in failures:
                print(f"  seed {seed}: {what}\n    -> {outcome.kind}: {outcome.detail}")


if __name__ == "__main__":
    main()
