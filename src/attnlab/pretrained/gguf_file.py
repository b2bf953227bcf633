"""Read a GGUF file: metadata, tokenizer tables and weights dequantised to float32.

The header is parsed here (the format is small: gguf.md in llama.cpp), tensor data is
memory-mapped, and the block formats this project meets (Q4_0, Q4_1, Q8_0) are
dequantised here, vectorised over every block of a tensor at once (numpy). Any other
quantisation type (the K-quants, ...) falls back to ``gguf.quants.dequantize``, which
is vectorised numpy.

GGUF stores a 2-D weight with ``shape = [ne0, ne1]``: ``ne0`` is the contiguous (input)
dimension, so the torch tensor is ``(ne1, ne0)`` = ``(out_features, in_features)``, exactly
``nn.Linear.weight``'s layout.

Block layouts (``ggml-common.h``), 32 weights per block, all little-endian:

- ``Q4_0``: ``d: f16``, ``qs: u8[16]``; weight ``j`` is ``(nibble_j - 8) * d``.
- ``Q4_1``: ``d: f16``, ``m: f16``, ``qs: u8[16]``; weight ``j`` is ``nibble_j * d + m``.
- ``Q8_0``: ``d: f16``, ``qs: i8[32]``; weight ``j`` is ``qs[j] * d``.

For the 4-bit formats weights ``0..15`` are the low nibbles of ``qs[0..15]`` and weights
``16..31`` the high nibbles.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

# Shape legend: N blocks, Q = 32 weights per block, R rows, K = row length (ne0).

QK = 32  # weights per block for Q4_0, Q4_1, Q8_0


def _f16_columns(blocks: np.ndarray, n: int) -> np.ndarray:
    """The first ``n`` little-endian float16 values of every block, as (N, n) float32."""
    return np.ascontiguousarray(blocks[:, : 2 * n]).view(np.float16).astype(np.float32)


def _unpack_nibbles(qs: np.ndarray) -> np.ndarray:
    """(N, 16) packed bytes -> (N, 32) float32 in 0..15: low nibbles first, then high."""
    out = np.empty((qs.shape[0], QK), dtype=np.float32)  # (N, Q)
    np.bitwise_and(qs, 0x0F, out=out[:, : QK // 2], casting="unsafe")
    np.right_shift(qs, 4, out=out[:, QK // 2 :], casting="unsafe")
    return out


def dequantize_q4_0(blocks: np.ndarray) -> np.ndarray:
    """Q4_0 blocks (N, 18) uint8 -> (N, 32) float32, ``(q - 8) * d``."""
    out = _unpack_nibbles(blocks[:, 2:])
    out -= 8.0
    out *= _f16_columns(blocks, 1)  # (N, 1) broadcast
    return out


def dequantize_q4_1(blocks: np.ndarray) -> np.ndarray:
    """Q4_1 blocks (N, 20) uint8 -> (N, 32) float32, ``q * d + m`` (two roundings, as ggml)."""
    dm = _f16_columns(blocks, 2)  # (N, 2): d, m
    out = _unpack_nibbles(blocks[:, 4:])
    out *= dm[:, :1]
    out += dm[:, 1:]
    return out


def dequantize_q8_0(blocks: np.ndarray) -> np.ndarray:
    """Q8_0 blocks (N, 34) uint8 -> (N, 32) float32, ``q * d``."""
    out = np.ascontiguousarray(blocks[:, 2:]).view(np.int8).astype(np.float32)  # (N, Q)
    out *= _f16_columns(blocks, 1)
    return out


def int4_codes(
    data: np.ndarray, type_name: str, shape: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 / Q4_1 blocks as 4-bit codes with per-block scale and zero, not dequantised.

    In the convention of ``attnlab.quant.Int4Linear``, ``w = (q - 8) * scale + zero``:
    Q4_0 is ``(q - 8) * d`` (zero 0), Q4_1 is ``q * d + m`` (zero ``m + 8 d``).

    Args:
        data: the tensor's bytes as stored in the file.
        type_name: ``"Q4_0"`` or ``"Q4_1"``.
        shape: the torch shape (R, K).

    Returns:
        codes (R, K) uint8 in 0..15, scales (R, K/32) float32, zeros (R, K/32) float32.

    Raises:
        ValueError: another type, or a shape that is not 2-D with K a multiple of 32.
    """
    if type_name not in ("Q4_0", "Q4_1") or len(shape) != 2 or shape[1] % QK:
        raise ValueError(f"int4 codes need a 2-D Q4_0/Q4_1 tensor, got {type_name} {shape}")
    block_bytes, n_half = (18, 1) if type_name == "Q4_0" else (20, 2)
    blocks = np.asarray(data).view(np.uint8).reshape(-1, block_bytes)  # (N, bytes)
    qs = blocks[:, 2 * n_half :]  # (N, 16)
    codes = np.empty((blocks.shape[0], QK), dtype=np.uint8)  # (N, Q)
    np.bitwise_and(qs, 0x0F, out=codes[:, : QK // 2])
    np.right_shift(qs, 4, out=codes[:, QK // 2 :])
    dm = _f16_columns(blocks, n_half)  # (N, 1 or 2)
    scales = dm[:, 0]
    zeros = dm[:, 1] + 8.0 * scales if n_half == 2 else np.zeros_like(scales)
    R, K = shape
    return (
        torch.from_numpy(codes).reshape(R, K),
        torch.from_numpy(np.ascontiguousarray(scales)).reshape(R, K // QK),
        torch.from_numpy(np.ascontiguousarray(zeros)).reshape(R, K // QK),
    )


_BLOCK_KERNELS = {
    "Q4_0": (18, dequantize_q4_0),
    "Q4_1": (20, dequantize_q4_1),
    "Q8_0": (34, dequantize_q8_0),
}


def dequantize(data: np.ndarray, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Dequantise one GGUF tensor's raw data to a float32 torch tensor of ``shape``.

    The kernels are numpy, not torch, on purpose: numpy's element-wise operations run on
    one thread, while torch's split across its thread pool, and on a machine whose few
    cores are shared that pool's waiting made loading 5-20x slower in our measurements.

    Args:
        data: the tensor's bytes as stored in the file (any numpy dtype; viewed as bytes).
        type_name: the GGML type name, e.g. ``"Q4_1"``.
        shape: the torch shape, outermost first (reverse of GGUF's ``ne`` order).

    Returns:
        A new float32 tensor of ``shape`` (it does not alias the memory-mapped file).

    Raises:
        NotImplementedError: for a type neither this module nor ``gguf`` can dequantise.
    """
    if type_name in ("F32", "F16"):
        raw = np.asarray(data).view(np.uint8)
        out = np.array(raw.view(np.float32 if type_name == "F32" else np.float16))
        return torch.from_numpy(out.astype(np.float32, copy=False)).reshape(shape)
    if type_name == "BF16":
        bits = np.asarray(data).view(np.uint8).view(np.uint16).astype(np.uint32) << 16
        return torch.from_numpy(bits.view(np.float32)).reshape(shape)
    if type_name in _BLOCK_KERNELS:
        block_bytes, kernel = _BLOCK_KERNELS[type_name]
        blocks = np.asarray(data).view(np.uint8).reshape(-1, block_bytes)  # (N, bytes)
        return torch.from_numpy(kernel(blocks)).reshape(shape)  # (N, Q) -> shape
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    out = gguf_dequantize(np.asarray(data), GGMLQuantizationType[type_name])
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(shape)


def unpermute_rotary(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation, back to the "rotate half" RoPE layout.

    llama.cpp's converter stores each head's rows of ``W_q``/``W_k`` interleaved
    (pairs ``(x0, x1), (x2, x3), ...`` rotate together), while the Hugging Face layout
    that ``attnlab.attention.RotaryEmbedding`` uses rotates ``x_i`` with ``x_{i + D/2}``.
    The converter did ``reshape(H, 2, D/2, C).swapaxes(1, 2)``; this is its inverse.

    Args:
        weight: (H*D, C) rows of one projection as stored in the GGUF file.
        n_heads: heads of this projection (query heads for q, key/value heads for k).

    Returns:
        (H*D, C) weight in "rotate half" layout.
    """
    rows, cols = weight.shape
    head_dim = rows // n_heads
    if weight.device.type == "cpu" and not weight.requires_grad:
        # The same permutation copied by numpy (one thread; see `dequantize`).
        w_np = weight.numpy().reshape(n_heads, head_dim // 2, 2, cols)  # (H, D/2, 2, C)
        return torch.from_numpy(np.ascontiguousarray(w_np.swapaxes(1, 2)).reshape(rows, cols))
    w = weight.reshape(n_heads, head_dim // 2, 2, cols)  # (H, D/2, 2, C)
    return w.transpose(1, 2).reshape(rows, cols)  # (H, 2, D/2, C) -> (H*D, C)


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lies in the file.

    Attributes:
        name: GGUF tensor name, e.g. ``"blk.0.attn_q.weight"``.
        type_name: GGML type name, e.g. ``"Q4_1"``.
        shape: torch shape, outermost first (reverse of GGUF's ``ne``).
        offset: absolute byte offset of the data in the file.
        nbytes: size of the data in bytes.
    """

    name: str
    type_name: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class GGUFContents:
    """What one GGUF file holds: metadata read eagerly, tensors dequantised on request.

    Attributes:
        path: the file.
        metadata: every key/value pair except the big tokenizer arrays, as Python values.
        tokens: the vocabulary in id order (``tokenizer.ggml.tokens``).
        token_types: llama.cpp token type per id (1 normal, 3 control, ...).
        merges: BPE merges as ``"left right"`` strings, in rank order.
        tensor_infos: name -> :class:`GGUFTensorInfo`, in file order.
    """

    path: Path
    metadata: dict[str, Any]
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    tensor_infos: dict[str, GGUFTensorInfo]
    _data: np.ndarray  # the whole file, memory-mapped uint8

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name`` dequantised to float32 (a fresh tensor, not a view of the file)."""
        if name not in self.tensor_infos:
            raise KeyError(f"tensor {name!r} is not in {self.path.name}")
        info = self.tensor_infos[name]
        raw = self._data[info.offset : info.offset + info.nbytes]
        return dequantize(raw, info.type_name, info.shape)

    def raw(self, name: str) -> np.ndarray:
        """Tensor ``name``'s bytes as stored (a view of the memory-mapped file)."""
        if name not in self.tensor_infos:
            raise KeyError(f"tensor {name!r} is not in {self.path.name}")
        info = self.tensor_infos[name]
        return self._data[info.offset : info.offset + info.nbytes]

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor dequantised to float32, by GGUF name, in file order."""
        return {name: self.tensor(name) for name in self.tensor_infos}


_BIG_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")

# GGUF value types (gguf.md): id -> struct format; 8 = string, 9 = array.
_SCALAR_FORMATS = {
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


class _Cursor:
    """Sequential little-endian reads from a bytes-like buffer."""

    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.pos = 0

    def scalar(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        text = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8")
        self.pos += n
        return text

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item_type = self.scalar("<I")
            count = self.scalar("<Q")
            if item_type in _SCALAR_FORMATS and item_type != 7:
                fmt = _SCALAR_FORMATS[item_type]
                size = struct.calcsize(fmt)
                arr = np.frombuffer(self.buf, dtype=np.dtype(fmt), count=count, offset=self.pos)
                self.pos += size * count
                return arr.tolist()
            return [self.value(item_type) for _ in range(count)]
        return self.scalar(_SCALAR_FORMATS[vtype])


def read_gguf(path: str | Path) -> GGUFContents:
    """Open a GGUF file (version 2 or 3) and read its metadata and tokenizer tables.

    The header is parsed here in one pass (the ``gguf`` package's reader builds a numpy
    view per string and takes seconds on a 49k-token vocabulary); tensor data stays
    memory-mapped until :meth:`GGUFContents.tensor` dequantises it.

    Args:
        path: the ``.gguf`` file.

    Returns:
        A :class:`GGUFContents`.

    Raises:
        ValueError: if the file is not GGUF version 2 or 3.
    """
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(data.data)
    magic = bytes(cur.buf[0:4])
    cur.pos = 4
    version = cur.scalar("<I")
    if magic != b"GGUF" or version not in (2, 3):
        raise ValueError(
            f"`path` must be a GGUF file of version 2 or 3, got magic {magic!r} version {version} "
            f"in {path}; re-convert it with a current llama.cpp"
        )
    n_tensors = cur.scalar("<Q")
    n_kv = cur.scalar("<Q")
    kv: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        kv[key] = cur.value(cur.scalar("<I"))
    raw_infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.scalar("<I")
        ne = [cur.scalar("<Q") for _ in range(n_dims)]
        type_id = cur.scalar("<I")
        offset = cur.scalar("<Q")
        raw_infos.append((name, ne, type_id, offset))
    alignment = int(kv.get("general.alignment", 32))
    data_start = (cur.pos + alignment - 1) // alignment * alignment
    infos: dict[str, GGUFTensorInfo] = {}
    for name, ne, type_id, offset in raw_infos:
        qtype = GGMLQuantizationType(type_id)
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        n_elements = int(np.prod(ne))
        infos[name] = GGUFTensorInfo(
            name=name,
            type_name=qtype.name,
            shape=tuple(int(n) for n in reversed(ne)),
            offset=data_start + offset,
            nbytes=n_elements // block_size * type_size,
        )
    metadata = {k: v for k, v in kv.items() if k not in _BIG_ARRAYS}
    return GGUFContents(
        path=path,
        metadata=metadata,
        tokens=kv.get("tokenizer.ggml.tokens", []),
        token_types=kv.get("tokenizer.ggml.token_type", []),
        merges=kv.get("tokenizer.ggml.merges", []),
        tensor_infos=infos,
        _data=data,
    )
