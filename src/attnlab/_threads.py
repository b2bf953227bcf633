"""One PyTorch thread for the many small operations of a load.

A load (a GGUF file's codes packed for the int4 kernel, scales converted, pieces fused
for the decode step) runs hundreds of operations of a few hundred kilobytes each. With
several intra-op threads each one opens a parallel region whose threads must all be
scheduled before it ends: on a machine whose cores are busy with other work, a thread
that waits for a core holds up the region, and the load takes several times as long (int4
SmolLM2's ``build_model`` on 2 busy cores: about 5 s with 2 threads, 1 s with one). On one
thread the same operations give the same results (each writes its own output elements),
and the calling thread keeps the core it already has.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["one_intra_op_thread"]


@contextmanager
def one_intra_op_thread() -> Iterator[None]:
    """Run the body with one PyTorch intra-op thread, then restore the count it had
    (also when the body raises)."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
