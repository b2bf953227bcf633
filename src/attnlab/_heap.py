"""The C library's heap around a loaded model: freed heap handed back after a load, and
large freed blocks kept for reuse while the model runs.

glibc serves a block of at least its mmap threshold with a fresh memory map and unmaps it
when it is freed, so the next such block faults in (and the kernel zeroes) every page
again. The threshold adapts to the blocks freed, up to 32 MB; a prompt's activations pass
that early (Gemma 3's MLP tensors are 4,096 x 2,048 float32, 34 MB, at 4,096 tokens), so
every element-wise operation of a long prompt paid for fresh pages: its 4,096-token
prompt took 4.0-4.5 s, 3.1-3.3 s with such blocks kept in the heap
(:func:`keep_freed_blocks`). Prompts of 512 tokens (4 MB blocks, under the adapted
threshold) take the same time either way.

Linux with glibc only; elsewhere both do nothing.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from typing import Any

__all__ = ["KEEP_ENV", "KEEP_UNDER", "keep_freed_blocks", "trim_heap"]

#: Set to ``0`` to leave glibc's mmap threshold as it is.
KEEP_ENV = "ATTNLAB_KEEP_FREED"
#: Blocks under this many bytes come from the heap and are kept for reuse when freed.
KEEP_UNDER = 256 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


@functools.cache
def _glibc() -> Any | None:
    if not sys.platform.startswith("linux"):
        return None
    import ctypes  # here: a command that never loads a model does not import it

    with contextlib.suppress(OSError, AttributeError):  # musl, or no such library
        libc = ctypes.CDLL("libc.so.6")
        if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim"):
            return libc
    return None


def trim_heap() -> None:
    """Hand back to the system the heap the C library keeps after a load: the float copies
    of weights that a load reads, converts and drops. glibc keeps such freed memory for
    reuse (int4 SmolLM2 held about 370 MB more than its tensors after loading);
    ``malloc_trim(0)`` returns it."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


@functools.cache
def keep_freed_blocks() -> bool:
    """Have glibc serve blocks under :data:`KEEP_UNDER` from its heap, and keep up to as
    much freed at the heap's top, for reuse, instead of a memory map each that is faulted
    in again every time (see the module docstring). Once per process, after a model's load (whose
    transient copies are handed back first, :func:`trim_heap`); what the heap keeps is
    at most what one forward had live at once, and ``malloc_trim`` still returns it.
    ``ATTNLAB_KEEP_FREED=0`` leaves the threshold alone.

    Returns:
        Whether the threshold is now set.
    """
    if os.environ.get(KEEP_ENV, "").strip() == "0":
        return False
    libc = _glibc()
    if libc is None:
        return False
    # Both: setting one stops glibc adapting the other, and a freed block at the top of the
    # heap would go back to the system at once under the default trim threshold.
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, KEEP_UNDER)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, KEEP_UNDER)
    )
