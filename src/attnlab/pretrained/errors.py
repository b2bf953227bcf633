"""The one error a model file (or directory) can raise: it names the file and the problem;
and the value check every reader runs on what it reads (:func:`check_finite`)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

__all__ = ["ModelFileError", "check_finite"]


class ModelFileError(ValueError):
    """A model file that is missing, broken, hostile or not what its config says.

    Attributes:
        path: the file (or directory) at fault.
        problem: what is wrong with it, in words.
    """

    def __init__(self, path: str | Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = Path(path)
        self.problem = problem


def check_finite(
    values: torch.Tensor | np.ndarray, name: str, where: str | Path, *, what: str = "value"
) -> None:
    """Refuse NaN or inf in a tensor's values (or its quantisation scales), naming the tensor:
    llama.cpp's ``--check-tensors``, on by default.

    One sum first: NaN and inf propagate through it, so a finite sum proves every value
    finite, and only a non-finite sum (a bad value, or large values overflowing the sum)
    pays for the element-wise test that tells the two apart. The sum runs in numpy (one
    thread): torch's reduction waits on its thread pool on a busy machine.

    Args:
        values: a float tensor or array (other dtypes pass).
        name: the tensor's name in the file.
        where: the file, for the message.
        what: what the values are, for the message (``"quantisation scale"``).

    Raises:
        ModelFileError: a NaN or an infinity (how many, the first index and its value).
    """
    if isinstance(values, torch.Tensor):
        t = values.detach()
        if t.dtype == torch.bfloat16:  # numpy has no bfloat16: its bits as int16
            values = t.cpu().view(torch.int16).numpy()
            bad = (values & 0x7F80) == 0x7F80  # exponent all ones: inf or NaN
            _raise_if(bad, t.float().numpy(), name, where, what)
            return
        if t.dtype == torch.float8_e4m3fn:  # no infinity; NaN: every bit but the sign set
            bits = t.cpu().view(torch.uint8).numpy()
            _raise_if((bits & 0x7F) == 0x7F, t.float().numpy(), name, where, what)
            return
        if not t.is_floating_point():
            return
        values = t.cpu().numpy()
    if values.dtype.kind != "f" or values.size == 0:
        return
    wide = np.float64 if values.dtype == np.float64 else np.float32
    with np.errstate(over="ignore", invalid="ignore"):
        if math.isfinite(float(np.sum(values, dtype=wide))):
            return
    _raise_if(~np.isfinite(values), values, name, where, what)


def _raise_if(bad: np.ndarray, values: np.ndarray, name: str, where: str | Path, what: str) -> None:
    if not bad.any():
        return
    first = np.unravel_index(int(np.flatnonzero(bad)[0]), bad.shape)
    raise ModelFileError(
        where,
        f"tensor {name!r} holds {int(bad.sum())} non-finite {what}(s) (NaN or inf), the "
        f"first at {[int(i) for i in first]}: {float(values[first])}; the file is corrupt",
    )
