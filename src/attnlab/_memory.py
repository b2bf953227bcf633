"""Peak CPU memory of a call, read from PyTorch's own allocation records.

``torch.profiler`` with ``profile_memory=True`` records every allocation and free made by
PyTorch's CPU allocator while profiling (size and time). Sorting them by time and taking
the maximum of the running sum gives the peak number of bytes live at once *above what
was live before the call*: tensors created by the call, scratch included, freed or not.
Memory outside PyTorch's allocator (e.g. a BLAS library's private buffers) is not seen,
and only the calling thread's allocations are recorded: attnlab's blockwise backend, which
otherwise spreads head groups over worker threads, runs them in the calling thread while
the profiler is on (same scratch: each group's tiles scale with its share of the heads).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["peak_allocated"]


def peak_allocated(fn: Callable[[], Any]) -> tuple[Any, int]:
    """Run ``fn()`` and return ``(result, peak_bytes)``; see the module docstring."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    records: list[tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        extra = node.extra_fields
        if type(extra).__name__ == "_ExtraFields_Allocation":
            records.append((node.start_time_ns, int(extra.alloc_size)))
        stack.extend(node.children)
    records.sort(key=lambda r: r[0])
    live = peak = 0
    for _, size in records:
        live += size
        peak = max(peak, live)
    return result, peak
