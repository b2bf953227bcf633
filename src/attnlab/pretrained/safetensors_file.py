"""Read a ``.safetensors`` file that came from a stranger.

The format (huggingface/safetensors): 8 bytes little-endian ``N``, then ``N`` bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then
the data; offsets are relative to the end of the header. Everything is checked against
the file's real size before anything is read or allocated: the header length, every
dtype, shape and offset range, and that ``end - begin`` is exactly the tensor's size. The
data is memory-mapped (copy-on-write), so a tensor costs nothing until it is used. Nothing
is ever unpickled.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from attnlab.pretrained.errors import ModelFileError, check_finite

__all__ = ["SafetensorsFile", "TensorInfo", "read_safetensors"]

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the reference implementation's own limit

_DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 8),
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    # FP8 E4M3 (DeepSeek-V3's and Kimi K2's weights): read only with their block scales
    # (attnlab.pretrained.hf), never converted on their own
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "I64": (torch.int64, 8),
    "I32": (torch.int32, 4),
    "I16": (torch.int16, 2),
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "BOOL": (torch.bool, 1),
}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies: ``dtype``, ``shape``, absolute ``offset`` and ``nbytes``."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class SafetensorsFile:
    """A checked safetensors header and the file it describes.

    Attributes:
        path: the file.
        tensors: name -> :class:`TensorInfo`.
    """

    path: Path
    tensors: dict[str, TensorInfo]
    # the whole file, memory-mapped copy-on-write, as one uint8 tensor: every tensor read
    # from it is a view of this one storage, so tensors stored side by side (a gate and
    # an up projection) can be used as one without a copy (attnlab.quant.fuse_linears)
    _data: torch.Tensor | None = None

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name``, backed by a copy-on-write memory map of the file.

        Raises:
            ModelFileError: ``name`` is not in the file, or its values hold NaN or inf.
        """
        if name not in self.tensors:
            raise ModelFileError(self.path, f"has no tensor {name!r}")
        info = self.tensors[name]
        if info.nbytes == 0 or self._data is None:
            return torch.empty(info.shape, dtype=info.dtype)
        raw = self._data[info.offset : info.offset + info.nbytes]
        if info.offset % info.dtype.itemsize:
            raw = raw.clone()  # an unaligned tensor cannot be viewed as a wider dtype
        out = raw.view(info.dtype).reshape(info.shape)
        check_finite(out, name, self.path)
        return out


def _fail(path: Path, problem: str) -> ModelFileError:
    return ModelFileError(path, problem)


def read_safetensors(path: str | Path) -> SafetensorsFile:
    """Parse and check a safetensors header (nothing else is read).

    Args:
        path: the ``.safetensors`` file.

    Returns:
        A :class:`SafetensorsFile`.

    Raises:
        ModelFileError: a missing or unreadable file, or a header that lies: a length
            past the end of the file, JSON that is not an object, an unknown dtype, a bad
            shape, offsets outside the data or disagreeing with the shape, overlapping
            tensors.
    """
    path = Path(path)
    if not path.is_file():
        raise _fail(path, "is missing (expected a safetensors weights file)")
    size = path.stat().st_size
    if size < 8:
        raise _fail(path, f"is {size} bytes, too short for a safetensors header (8-byte length)")
    with path.open("rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n < 2 or n > size - 8 or n > MAX_HEADER_BYTES:
            raise _fail(
                path,
                f"safetensors header length {n} does not fit the file ({size} bytes) or the "
                f"{MAX_HEADER_BYTES}-byte limit; the file is truncated or not safetensors",
            )
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _fail(path, f"safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise _fail(path, "safetensors header must be a JSON object")
    data_start = 8 + n
    data_size = size - data_start
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise _fail(path, f"tensor {name!r}: header entry must be an object")
        dtype_name = entry.get("dtype")
        if dtype_name not in _DTYPES:
            raise _fail(
                path,
                f"tensor {name!r}: dtype {dtype_name!r} is not one of {sorted(_DTYPES)}",
            )
        dtype, itemsize = _DTYPES[dtype_name]
        shape = entry.get("shape")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise _fail(path, f"tensor {name!r}: shape {shape!r} is not a list of ints >= 0")
        offsets = entry.get("data_offsets")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        ):
            raise _fail(path, f"tensor {name!r}: data_offsets {offsets!r} must be [begin, end]")
        begin, end = offsets
        if not 0 <= begin <= end <= data_size:
            raise _fail(
                path,
                f"tensor {name!r}: data_offsets [{begin}, {end}] lie outside the "
                f"{data_size} data bytes",
            )
        # Python ints: a product of huge dims cannot overflow, it just fails the check.
        nbytes = math.prod(shape) * itemsize
        if end - begin != nbytes:
            raise _fail(
                path,
                f"tensor {name!r}: data_offsets hold {end - begin} bytes, shape {shape} "
                f"of {dtype_name} needs {nbytes}",
            )
        tensors[name] = TensorInfo(name, dtype, tuple(shape), data_start + begin, nbytes)
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors.values() if t.nbytes)
    for (_, end_a, a), (begin_b, _, b) in itertools.pairwise(spans):
        if begin_b < end_a:
            raise _fail(path, f"tensors {a!r} and {b!r} overlap in the data")
    data = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="c")) if data_size else None
    return SafetensorsFile(path, tensors, data)
