"""GGUF reading, dequantisation, rotary un-permutation and the GGUF tokenizer.

Small GGUF files are written in the test with the ``gguf`` package's own writer and
quantiser, so these tests need ``gguf`` and ``tokenizers`` but no model weights.
"""

from __future__ import annotations

import importlib.util
import math
import os

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.pretrained

if importlib.util.find_spec("gguf") is None or importlib.util.find_spec("tokenizers") is None:
    pytest.skip(
        "needs gguf and tokenizers: pip install 'attnlab[pretrained]'", allow_module_level=True
    )

from gguf import GGMLQuantizationType, GGUFWriter  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402
from gguf.quants import quantize as gguf_quantize  # noqa: E402

from attnlab import native  # noqa: E402
from attnlab.pretrained.gguf_file import dequantize, read_gguf, unpermute_rotary  # noqa: E402
from attnlab.pretrained.tokenizer import tokenizer_from_gguf  # noqa: E402
from attnlab.quant.base import native_kernels  # noqa: E402


def _finish(w: GGUFWriter) -> None:
    """Write what a GGUFWriter was given, header to tensors, and close the file."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def llama_cpp_permute(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to q/k rows: ``reshape(H, 2, D/2, C).swapaxes(1, 2)``."""
    rows, cols = weight.shape
    return (
        weight.reshape(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)
    )


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    rng = np.random.default_rng(0)
    arrays = {
        "f32": rng.standard_normal((3, 5)).astype(np.float32),
        "q8_0": rng.standard_normal((4, 64)).astype(np.float32),
        "q4_1": rng.standard_normal((6, 96)).astype(np.float32),
        "q4_0": rng.standard_normal((2, 32)).astype(np.float32),
        "q5_0": rng.standard_normal((5, 64)).astype(np.float32),
    }
    types = {
        "f32": GGMLQuantizationType.F32,
        "q8_0": GGMLQuantizationType.Q8_0,
        "q4_1": GGMLQuantizationType.Q4_1,
        "q4_0": GGMLQuantizationType.Q4_0,
        "q5_0": GGMLQuantizationType.Q5_0,
    }
    stored = {name: gguf_quantize(a, types[name]) for name, a in arrays.items()}
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    w = GGUFWriter(path, "llama")
    w.add_uint32("llama.block_count", 2)
    w.add_float32("llama.rope.freq_base", 100000.0)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    # Byte-level BPE: "Ġ" is the space byte. "12" exists but digits are split before BPE.
    tokens = ["<|end|>", "a", "b", "ab", "Ġ", "Ġab", "1", "2", "12", "é", "Ã", "©"]
    w.add_token_list(tokens)
    w.add_token_types([3] + [1] * (len(tokens) - 1))
    w.add_token_merges(["a b", "Ġ ab", "1 2"])
    w.add_eos_token_id(0)
    w.add_chat_template("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}")
    for name, data in stored.items():
        w.add_tensor(name, data, raw_dtype=types[name])
    _finish(w)
    return path, arrays, stored, types


def test_read_gguf_metadata_and_tables(tiny_gguf):
    path, arrays, _, types = tiny_gguf
    g = read_gguf(path)
    assert g.metadata["general.architecture"] == "llama"
    assert g.metadata["llama.block_count"] == 2
    assert g.metadata["llama.rope.freq_base"] == 100000.0
    assert g.metadata["tokenizer.ggml.add_bos_token"] is False
    # The vocabulary and merges are read lazily: counted now, decoded on first use
    from attnlab.pretrained.gguf_file import _LazyStrings

    assert isinstance(g._tokens, _LazyStrings) and isinstance(g._merges, _LazyStrings)
    assert g._tokens._items is None and g.token_count == len(g.tokens)
    assert g.tokens[:6] == ["<|end|>", "a", "b", "ab", "Ġ", "Ġab"]
    assert g.token_types[:3] == [3, 1, 1]
    assert g.merges == ["a b", "Ġ ab", "1 2"]
    assert {n: i.type_name for n, i in g.tensor_infos.items()} == {
        n: t.name for n, t in types.items()
    }
    assert {n: i.shape for n, i in g.tensor_infos.items()} == {
        n: a.shape for n, a in arrays.items()
    }


def _string_items(strings: list[bytes]) -> memoryview:
    """GGUF string items as a file holds them: a u64 length, then the bytes."""
    import struct

    return memoryview(b"".join(struct.pack("<Q", len(b)) + b for b in strings)).cast("B")


@pytest.mark.parametrize("seed", range(4))
def test_strings_decoded_together_equal_one_by_one(seed, reading):
    """The bulk decoder (each length field a NUL, one decode, one split) gives the strings
    the string-by-string reader gives: empty ones, many-byte characters, a NUL inside a
    string (which the split cannot tell apart: read one by one), and it leaves the cursor
    after the last string."""
    from pathlib import Path

    from attnlab.pretrained.gguf_file import _Cursor

    rng = np.random.default_rng(seed)
    alphabet = ["a", "▁", "é", "中", "🙂", " ", "<0x0A>", "\n", "Ġ"] + (["\x00"] if seed else [])
    texts = ["".join(rng.choice(alphabet, size=int(rng.integers(0, 6)))) for _ in range(500)]
    buf = _string_items([t.encode() for t in texts] + [b"tail"])
    bulk = _Cursor(buf, Path("x.gguf"))
    assert bulk.strings(len(texts)) == texts
    one = _Cursor(buf, Path("x.gguf"))
    assert one._strings_one_by_one(len(texts)) == texts
    assert bulk.pos == one.pos == len(buf) - 12
    assert bulk.strings(1) == ["tail"]


@pytest.mark.parametrize(
    ("items", "count", "message"),
    [
        ([b"ab", b"\xff"], 2, "string 1 is not valid UTF-8"),
        ([b"ab", "é".encode()[:1], b"c"], 3, "string 1 is not valid UTF-8"),
        ([b"ab"], 2, "string 1 length needs 8 bytes"),
        ([b"ab", b"cd"], 2, None),
    ],
)
def test_strings_refused_as_one_by_one_names_them(items, count, message, reading):
    """A bad byte, a character cut at a string's end, a run cut short: the string at fault
    is named, as the string-by-string reader names it; a length past the end too."""
    import struct
    from pathlib import Path

    from attnlab.pretrained.errors import ModelFileError
    from attnlab.pretrained.gguf_file import _Cursor

    buf = _string_items(items)
    if message is None:  # the second length claims more than the file holds
        raw = bytearray(buf)
        raw[10 : 10 + 8] = struct.pack("<Q", 1 << 62)
        buf, message = memoryview(bytes(raw)).cast("B"), "string 1 of length"
    with pytest.raises(ModelFileError, match=message):
        _Cursor(buf, Path("x.gguf")).strings(count)
    # Read lazily (a vocabulary): a run cut short is refused at once, a bad string when it
    # is first used, with the same name.
    cursor = _Cursor(buf, Path("x.gguf"))
    cursor.field = "value of 'tokenizer.ggml.tokens'"
    with pytest.raises(ModelFileError, match=message):
        cursor.strings(count, lazy=True).get()


def test_a_vocabulary_is_decoded_on_first_use_once_for_every_thread(reading):
    """The header's parse reads a vocabulary's lengths only (the cursor moves past it); the
    strings are decoded once, on first use, and every thread gets the same list."""
    import threading
    from pathlib import Path

    from attnlab.pretrained.gguf_file import _Cursor, _LazyStrings

    texts = [f"tok{i}é" for i in range(3000)]
    buf = _string_items([t.encode() for t in texts] + [b"next"])
    cursor = _Cursor(buf, Path("x.gguf"))
    lazy = cursor.strings(len(texts), lazy=True)
    assert isinstance(lazy, _LazyStrings) and len(lazy) == 3000 and lazy._items is None
    assert cursor.strings(1) == ["next"]  # what follows the vocabulary
    got: list[list[str]] = []
    threads = [threading.Thread(target=lambda: got.append(lazy.get())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got[0] == texts and all(g is got[0] for g in got)


def test_read_gguf_without_importing_the_gguf_package(tiny_gguf):
    """A fresh process reads the header with gguf's constants module run on its own (the
    package's ``__init__`` imports its reader, writer and yaml): the same type names and
    the same table of block sizes as the package's, and the package left unimported."""
    import subprocess
    import sys

    from gguf.constants import GGML_QUANT_SIZES

    path, _, _, types = tiny_gguf
    script = (
        "import json, sys\n"
        "from attnlab.pretrained.gguf_file import _ggml_types, read_gguf\n"
        f"g = read_gguf({str(path)!r})\n"
        "_, sizes = _ggml_types()\n"
        "print(json.dumps([{n: i.type_name for n, i in g.tensor_infos.items()},\n"
        "    {t.name: list(v) for t, v in sizes.items()}, 'gguf' in sys.modules]))\n"
    )
    import os
    from pathlib import Path

    import attnlab

    src = str(Path(attnlab.__file__).parent.parent)  # the attnlab under test
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=False
    )
    assert run.returncode == 0, run.stderr
    import json

    names, sizes, imported = json.loads(run.stdout)
    assert names == {n: t.name for n, t in types.items()}
    assert sizes == {t.name: list(v) for t, v in GGML_QUANT_SIZES.items()}
    assert imported is False


@pytest.fixture(params=["numpy", "native"])
def reading(request, monkeypatch):
    """Both float32 readings of the block types: numpy's, and the compiled kernels' (where
    this process has them; skipped, named, where they cannot be built)."""
    if request.param == "native":
        request.getfixturevalue("ext")
        assert native_kernels() is not None
        from attnlab.pretrained import gguf_file

        monkeypatch.setattr(gguf_file, "_NATIVE_RUN_FROM", 1)  # every run of strings too
    else:
        monkeypatch.setenv(native.NATIVE_ENV, "0")
        assert native_kernels() is None
    return request.param


def test_dequantize_equals_gguf_reference_bit_for_bit(tiny_gguf, reading):
    path, arrays, stored, types = tiny_gguf
    g = read_gguf(path)
    for name, data in stored.items():
        ref = gguf_dequantize(data, types[name])
        ours = g.tensor(name)
        assert ours.dtype == torch.float32 and tuple(ours.shape) == arrays[name].shape
        assert np.array_equal(ours.numpy(), ref), name
    # And the quantisation error is what 4 or 8 bits allow (a wrong layout would be far off).
    assert np.allclose(g.tensor("f32").numpy(), arrays["f32"])
    for name, bits in (("q8_0", 8), ("q4_1", 4), ("q4_0", 4), ("q5_0", 5)):
        blocks = arrays[name].reshape(-1, 32)
        step = (blocks.max(1) - blocks.min(1)) / (2**bits - 1)
        err = np.abs(g.tensor(name).numpy().reshape(-1, 32) - blocks).max(1)
        assert (err <= 1.01 * step).all(), name


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int8, np.uint8, np.int64])
def test_fresh_arrays_are_numpy_arrays_over_torch_storage(dtype):
    """The loaders' outputs (:func:`attnlab.quant.base.fresh`): numpy arrays of the asked
    shape and dtype, C-contiguous and writable, over a tensor's storage (so that
    ``torch.from_numpy`` shares it), and ``fresh_copy`` of a strided view of file bytes
    equal to numpy's own copy."""
    from attnlab.quant.base import fresh, fresh_copy

    a = fresh((3, 5), dtype)
    assert a.shape == (3, 5) and a.dtype == dtype and a.flags.c_contiguous and a.flags.writeable
    a[...] = 7
    t = torch.from_numpy(a)
    a[1, 2] = 1
    assert int(t[1, 2]) == 1 and int(t.sum()) == 7 * 14 + 1
    blocks = np.random.default_rng(0).integers(0, 256, size=(40, 34), dtype=np.uint8)
    view = blocks[:, 2:].view(np.int8)  # the codes of Q8_0 blocks, 34 bytes apart
    copied = fresh_copy(view)
    assert copied.flags.c_contiguous and np.array_equal(copied, np.ascontiguousarray(view))
    as_float = fresh_copy(view, np.float32)  # converted on the way, as the loaders' float32
    assert as_float.dtype == np.float32 and np.array_equal(as_float, view.astype(np.float32))


def test_large_outputs_are_written_in_two_halves_with_the_same_result(monkeypatch, reading):
    """A large copy or Q8_0 reading runs in two threads (:func:`attnlab.quant.base.in_halves`):
    every row written once, the same bytes as one thread, and an error in the helper's half
    raised in the caller."""
    from attnlab.quant import base

    rng = np.random.default_rng(3)
    blocks = rng.integers(0, 256, size=(1001, 34), dtype=np.uint8)
    blocks[:, :2] = (rng.standard_normal((1001, 1)) * 0.01).astype(np.float16).view(np.uint8)
    one = dequantize(blocks, "Q8_0", (1001, 32)).numpy()
    ref = gguf_dequantize(blocks, GGMLQuantizationType.Q8_0)  # every code, both signs
    assert np.array_equal(one, ref)
    copied = base.fresh_copy(blocks[:, 2:])
    calls = []
    real = base.in_halves

    def counted(rows, nbytes, work):
        calls.append(rows)
        return real(rows, nbytes, work)

    monkeypatch.setattr(base, "HALVES_FROM", 1)
    monkeypatch.setattr(base.os, "cpu_count", lambda: 2)  # halves on a machine of one core too
    monkeypatch.setattr(base, "in_halves", counted)
    import attnlab.pretrained.gguf_file as gguf_file

    monkeypatch.setattr(gguf_file, "in_halves", counted)
    assert np.array_equal(dequantize(blocks, "Q8_0", (1001, 32)).numpy(), one)
    assert np.array_equal(base.fresh_copy(blocks[:, 2:]), copied)
    assert calls == [1001, 1001]
    seen = []

    def work(a, b):
        seen.append((a, b))
        if a > 0:
            raise ValueError("the second half failed")

    with pytest.raises(ValueError, match="second half"):
        real(10, 1 << 30, work)
    assert sorted(seen) == [(0, 5), (5, 10)]


def test_q5_0_every_code_and_fifth_bit_equals_gguf(reading):
    """Random Q5_0 blocks (every byte of qh and qs drawn, finite float16 scales of both
    signs): attnlab's reading equals gguf-py's bit for bit, and a hand-made block gives
    ``(q - 16) d`` with weight j's fifth bit at bit j of qh."""
    rng = np.random.default_rng(5)
    n = 4096
    blocks = rng.integers(0, 256, size=(n, 22), dtype=np.uint8)
    d = (rng.standard_normal(n) * 0.01).astype(np.float16)
    blocks[:, :2] = d.view(np.uint8).reshape(n, 2)
    ours = dequantize(blocks, "Q5_0", (n // 4, 128)).numpy()
    ref = gguf_dequantize(blocks.reshape(n // 4, 88), GGMLQuantizationType.Q5_0)
    assert np.array_equal(ours, ref)
    block = np.zeros(22, dtype=np.uint8)
    block[:2] = np.array([0.5], dtype=np.float16).view(np.uint8)
    block[2:6] = np.array([1 | 1 << 17], dtype="<u4").view(np.uint8)  # weights 0 and 17
    block[6] = 0x3F  # weight 0: low nibble 15, weight 16: high nibble 3
    want = np.full(32, -8.0, dtype=np.float32)  # (0 - 16) * 0.5
    want[0], want[16], want[17] = (31 - 16) * 0.5, (3 - 16) * 0.5, (16 - 16) * 0.5
    assert np.array_equal(dequantize(block, "Q5_0", (1, 32)).numpy()[0], want)


@pytest.mark.parametrize(
    ("type_name", "nbytes", "scales_at"), [("Q4_K", 144, 0), ("Q6_K", 210, 208)]
)
def test_k_quants_every_byte_equals_gguf(type_name, nbytes, scales_at, reading):
    """Random Q4_K and Q6_K super-blocks (every byte of the codes and the packed 6-bit or
    int8 scales drawn, finite float16 d / dmin of both signs): attnlab's float32 reading
    equals gguf-py's bit for bit, as one tensor of several rows."""
    rng = np.random.default_rng(11)
    n = 512
    blocks = rng.integers(0, 256, size=(n, nbytes), dtype=np.uint8)
    n_f16 = 2 if type_name == "Q4_K" else 1
    d = (rng.standard_normal((n, n_f16)) * 0.01).astype(np.float16)
    blocks[:, scales_at : scales_at + 2 * n_f16] = d.view(np.uint8).reshape(n, 2 * n_f16)
    ours = dequantize(blocks, type_name, (n // 4, 1024)).numpy()
    ref = gguf_dequantize(blocks.reshape(n // 4, 4 * nbytes), GGMLQuantizationType[type_name])
    assert ours.dtype == np.float32 and np.array_equal(ours.view(np.uint32), ref.view(np.uint32))


def test_q6_k_hand_made_block(reading):
    """ggml's layout of a Q6_K block, written out by hand: weight ``j`` of a half takes the
    low nibble of ``ql[j]`` (``j < 64``) or the high nibble of ``ql[j - 64]``, its two top
    bits from ``qh[j % 32]`` at bit ``2 (j // 32)``, and ``d * sc[j // 16] * (q - 32)``."""
    block = np.zeros(210, dtype=np.uint8)
    block[0] = 0x3A  # weight 0: low nibble 10; weight 64: high nibble 3
    block[64 + 5] = 0x07  # second half, weight 128 + 5: low nibble 7
    block[128] = 0b11_00_10_01  # weight 0: top 1, 32: top 2, 64: top 0, 96: top 3
    block[192 : 192 + 16] = np.arange(1, 17, dtype=np.int8).view(np.uint8)  # sc = 1..16
    block[192 + 4] = np.array([-3], dtype=np.int8).view(np.uint8)[0]  # sc[4] = -3
    block[208:210] = np.array([0.25], dtype=np.float16).view(np.uint8)
    q = np.zeros(256)
    q[0], q[32], q[64], q[96] = 10 + 16 * 1, 0 + 16 * 2, 3, 0 + 16 * 3
    q[128 + 5] = 7
    sc = np.arange(1, 17, dtype=np.float64)
    sc[4] = -3
    want = (0.25 * sc[np.arange(256) // 16] * (q - 32)).astype(np.float32)
    assert np.array_equal(dequantize(block, "Q6_K", (1, 256)).numpy()[0], want)


# type: (block bytes, byte offsets of its float16 scales)
_SCALED_BLOCKS = {
    "Q4_0": (18, (0,)),
    "Q4_1": (20, (0, 2)),
    "Q8_0": (34, (0,)),
    "Q5_0": (22, (0,)),
    "Q4_K": (144, (0, 2)),
    "Q6_K": (210, (208,)),  # d last, not first
}


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize(
    ("type_name", "scale"),
    [(t, i) for t, (_, offsets) in sorted(_SCALED_BLOCKS.items()) for i in range(len(offsets))],
)
def test_a_tensor_with_a_non_finite_scale_is_refused_by_name(
    tmp_path, reading, type_name, scale, bad
):
    """One block's scale (d, or Q4_1's m, Q4_K's dmin) inf or NaN: the float32 reading
    refuses the tensor, naming it, whether numpy reads it or the compiled kernels do (they
    count such blocks as they read); the good tensor beside it reads."""
    from attnlab.pretrained.errors import ModelFileError

    nbytes, offsets = _SCALED_BLOCKS[type_name]
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(8, nbytes), dtype=np.uint8)
    for at in offsets:
        blocks[:, at : at + 2] = np.array([0.01], dtype=np.float16).view(np.uint8)
    good = blocks.copy()
    at = offsets[scale]
    blocks[5, at : at + 2] = np.array([bad], dtype=np.float16).view(np.uint8)
    w = GGUFWriter(tmp_path / "bad.gguf", "llama")
    w.add_tensor("good", good, raw_dtype=GGMLQuantizationType[type_name])
    w.add_tensor("w", blocks, raw_dtype=GGMLQuantizationType[type_name])
    _finish(w)
    g = read_gguf(tmp_path / "bad.gguf")
    assert bool(torch.isfinite(g.tensor("good")).all())
    with pytest.raises(ModelFileError, match=r"tensor 'w'.*non-finite"):
        g.tensor("w")


def test_dequantize_q4_1_hand_made_block(reading):
    # d = 0.5, m = -1.0; low nibbles 0..15 -> weights 0..15, high nibbles 15..0 -> 16..31.
    qs = np.array([(15 - j) << 4 | j for j in range(16)], dtype=np.uint8)
    block = np.concatenate(
        [
            np.array([0.5], np.float16).view(np.uint8),
            np.array([-1.0], np.float16).view(np.uint8),
            qs,
        ]
    )
    out = dequantize(block, "Q4_1", (1, 32))
    expected = torch.tensor(
        [0.5 * j - 1.0 for j in range(16)] + [0.5 * (15 - j) - 1.0 for j in range(16)]
    )
    torch.testing.assert_close(out[0], expected, atol=0, rtol=0)


def _mxfp4_blocks(exponents: np.ndarray, seed: int = 0) -> np.ndarray:
    """MXFP4 blocks (one per exponent) with random nibbles: (N, 17) uint8."""
    rng = np.random.default_rng(seed)
    qs = rng.integers(0, 256, (len(exponents), 16), dtype=np.uint8)
    return np.concatenate([exponents.astype(np.uint8)[:, None], qs], axis=1)


def test_mxfp4_equals_gguf_py_for_every_exponent():
    """Every E8M0 exponent 0..255 and every nibble, against gguf-py's dequantisation of the
    same bytes: equal to the bit (inf included where 12 * 2**126 passes float32)."""
    blocks = _mxfp4_blocks(np.repeat(np.arange(256), 4))
    with np.errstate(over="ignore"):
        ref = gguf_dequantize(blocks.reshape(-1), GGMLQuantizationType.MXFP4)
    ours = dequantize(blocks, "MXFP4", (256, 4 * 32)).numpy()
    assert np.array_equal(ours.reshape(-1), ref.reshape(-1))
    assert np.isinf(ours).any() and (ours[:250] != 0).any()


def test_mxfp4_hand_made_block():
    # e = 128: scale 2**(128 - 127) = 2 on the E2M1 values; nibble j low, 15 - j high
    qs = np.array([(15 - j) << 4 | j for j in range(16)], dtype=np.uint8)
    block = np.concatenate([np.array([128], np.uint8), qs])
    e2m1 = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    expected = torch.tensor([2 * v for v in e2m1] + [2 * e2m1[15 - j] for j in range(16)])
    torch.testing.assert_close(dequantize(block, "MXFP4", (1, 32))[0], expected, atol=0, rtol=0)


def test_mxfp4_tensor_in_a_file_and_an_overflow_refused(tmp_path):
    """A file whose MXFP4 tensor reads as gguf-py reads it; one whose exponent overflows
    float32 is refused naming the tensor."""
    from attnlab.pretrained import ModelFileError

    path = tmp_path / "mx.gguf"
    good = _mxfp4_blocks(np.arange(100, 112), seed=1)  # 12 blocks: a (3, 128) tensor
    bad = _mxfp4_blocks(np.array([255]), seed=2)
    bad[0, 1] = 0x77  # a 12 (code 7) at an exponent of 255: 12 * 2**127 is inf
    w = GGUFWriter(path, "llama")
    # bytes (rows, blocks * 17): the writer records the shape (rows, blocks * 32)
    w.add_tensor("good", good.reshape(3, -1), raw_dtype=GGMLQuantizationType.MXFP4)
    w.add_tensor("bad", bad, raw_dtype=GGMLQuantizationType.MXFP4)
    _finish(w)
    g = read_gguf(path)
    assert g.tensor_infos["good"].shape == (3, 128)
    ref = gguf_dequantize(good.reshape(-1), GGMLQuantizationType.MXFP4).reshape(3, 128)
    assert np.array_equal(g.tensor("good").numpy(), ref)
    with pytest.raises(ModelFileError, match="'bad'"):
        g.tensor("bad")


def test_unpermute_inverts_llama_cpp_permute():
    w = torch.randn(3 * 8, 5)
    torch.testing.assert_close(unpermute_rotary(llama_cpp_permute(w, 3), 3), w, atol=0, rtol=0)
    assert not torch.equal(llama_cpp_permute(w, 3), w)


def test_unpermuted_weights_give_the_same_rope_scores_as_llama_cpp():
    """Interleaved RoPE on the stored (permuted) rows == rotate-half RoPE on un-permuted rows."""
    torch.manual_seed(0)
    H, D, C, T, base = 2, 8, 6, 5, 10000.0
    wq, wk, x = torch.randn(H * D, C), torch.randn(H * D, C), torch.randn(T, C)
    theta = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)  # (D/2,)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * theta  # (T, D/2)

    def interleaved(v):  # llama.cpp: pairs (2i, 2i+1)
        v = v.double().reshape(T, H, D // 2, 2)
        c, s = ang.cos()[:, None], ang.sin()[:, None]
        return torch.stack([v[..., 0] * c - v[..., 1] * s, v[..., 0] * s + v[..., 1] * c], -1)

    def rotate_half(v):  # Hugging Face / attnlab: pairs (i, i + D/2)
        v = v.double().reshape(T, H, D)
        a, b = v[..., : D // 2], v[..., D // 2 :]
        c, s = ang.cos()[:, None], ang.sin()[:, None]
        return torch.cat([a * c - b * s, a * s + b * c], -1)

    stored_q, stored_k = llama_cpp_permute(wq, H), llama_cpp_permute(wk, H)
    q1, k1 = interleaved(x @ stored_q.T), interleaved(x @ stored_k.T)
    q2 = rotate_half(x @ unpermute_rotary(stored_q, H).T)
    k2 = rotate_half(x @ unpermute_rotary(stored_k, H).T)
    s1 = torch.einsum("thd,shd->hts", q1.reshape(T, H, D), k1.reshape(T, H, D))
    s2 = torch.einsum("thd,shd->hts", q2, k2)
    torch.testing.assert_close(s1, s2, atol=1e-10, rtol=1e-10)
    # Without the un-permutation the scores differ: the test can fail.
    s3 = torch.einsum("thd,shd->hts", rotate_half(x @ stored_q.T), rotate_half(x @ stored_k.T))
    assert not torch.allclose(s1, s3, atol=1e-3)
    assert math.isfinite(float(s1.sum()))


def test_tokenizer_from_gguf_tables(tiny_gguf):
    tok = tokenizer_from_gguf(read_gguf(tiny_gguf[0]))
    assert tok.encode("ab ab") == [3, 5]  # "ab", "Ġab"
    assert tok.encode("12") == [6, 7]  # digits are pre-split ("smollm"), merge "1 2" unused
    assert tok.encode("ab<|end|>") == [3, 0]  # control token matched as one id
    assert tok.encode("é") == [10, 11]  # UTF-8 bytes 0xC3 0xA9 as byte-level symbols
    assert tok.decode([3, 5, 10, 11]) == "ab abé"
    assert tok.eos_id == 0
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user] hi"


def _resident_kib(path) -> int:
    """This process's resident KiB of its memory maps of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(maxsplit=1)[0]
            if "-" in first and not first.endswith(":"):  # a mapping's header line
                inside = line.rstrip().endswith(str(path))
            elif inside and first == "Rss:":
                total += int(line.split()[1])
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads /proc/self/smaps")
def test_a_tensor_read_lets_go_of_its_pages_and_a_second_read_gives_the_same(tmp_path):
    """The file's pages of a tensor that has been read leave the process's resident memory
    (they counted beside the tensors made from them until the load's end), and reading the
    bytes again faults them back from the file: the same values, nothing lost."""
    rng = np.random.default_rng(5)
    big = rng.standard_normal((256, 1024)).astype(np.float32)  # 1 MiB
    q8 = gguf_quantize(
        rng.standard_normal((512, 512)).astype(np.float32), GGMLQuantizationType.Q8_0
    )
    path = tmp_path / "pages.gguf"
    w = GGUFWriter(path, "llama")
    w.add_tensor("big", big)
    w.add_tensor("q8", q8, raw_dtype=GGMLQuantizationType.Q8_0)
    _finish(w)
    g = read_gguf(path)
    first = g.tensor("big").clone()
    # the header's pages at most, not the 1 MiB read (later reads may map a neighbour's
    # pages again: the kernel maps a fault's whole folio of the page cache)
    assert _resident_kib(path) < 64
    codes = [t.clone() for t in g.codes("q8")]
    assert torch.equal(g.tensor("big"), first) and np.array_equal(first.numpy(), big)
    assert all(torch.equal(a, b) for a, b in zip(g.codes("q8"), codes, strict=True))
