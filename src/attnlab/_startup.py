"""What attnlab's import does before anything else: nothing here imports PyTorch.

Python's cyclic garbage collector runs a full pass over every tracked object whenever
enough new ones have piled up. Importing PyTorch creates about 165,000 of them, and the
passes that fall inside the import walk them again and again: 0.07-0.08 s of ``import
torch`` on a Xeon with AMX and 0.04 s more of attnlab's own imports, for no garbage (an
import makes modules, functions and classes that stay alive). :func:`collector_paused`
holds the collector off while ``import attnlab`` runs and gives it back as it was.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["collector_paused"]


@contextmanager
def collector_paused() -> Iterator[None]:
    """No collection inside the body; the collector afterwards as it was before (left off
    if the caller had turned it off, also when the body raises)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()
