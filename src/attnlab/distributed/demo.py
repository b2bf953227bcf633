"""The ``attnlab ring-demo`` computation: ring attention on N local processes, timed.

Library code: returns data (frozen dataclasses), never prints; the CLI renders it.

Shape legend: B batch, H heads, T full sequence length, D head dim, N processes.
"""

from __future__ import annotations

import gc
import math
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from attnlab.distributed.launch import spawn_local
from attnlab.distributed.ring import RingStats, ring_attention
from attnlab.distributed.sharding import (
    check_divisible,
    check_layout,
    gather_sequence,
    shard_sequence,
)

__all__ = [
    "PeakMemory",
    "RankReport",
    "RingDemoResult",
    "current_memory",
    "run_ring_demo",
    "track_cpu_memory_exactly",
]

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def track_cpu_memory_exactly() -> bool:
    """Make the resident set follow live tensor memory in this process (glibc only).

    glibc keeps freed mid-sized blocks on its heap, so the resident set (and its peak)
    also counts freed-but-kept memory. A fixed mmap threshold of 64 KiB gives every tensor
    its own mapping, returned to the system when freed. Costs a little speed (page faults).
    Returns False where this is not glibc.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        m_mmap_threshold = -3
        return bool(libc.mallopt(m_mmap_threshold, 64 * 1024))
    except (OSError, AttributeError):
        return False


def current_memory(device: torch.device) -> int:
    """Bytes in use now: the CUDA allocator's, or the process's resident set on CPU (0 if
    unknown)."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    try:
        return PeakMemory._status("VmRSS")
    except OSError:
        return 0


class PeakMemory:
    """Peak memory above a baseline while a block of code runs, in bytes.

    CUDA: the allocator's peak. CPU: the process's peak resident set (Linux ``VmHWM``, reset
    through ``/proc/self/clear_refs`` on entry). The baseline is the use at entry, or
    ``baseline`` (from :func:`current_memory`) taken earlier, e.g. before the inputs were
    made, so that the inputs count. ``supported`` is False where the CPU peak cannot be
    reset; ``peak_bytes`` is then 0.
    """

    def __init__(self, device: torch.device, baseline: int | None = None) -> None:
        self.device = device
        self.peak_bytes = 0
        self.supported = True
        self._start = 0
        self._baseline = baseline

    @staticmethod
    def _status(field: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        raise OSError(f"{field} not in /proc/self/status")

    def __enter__(self) -> PeakMemory:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
            if self._baseline is not None:
                self._start = self._baseline
            return self
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
            self._start = self._status("VmRSS") if self._baseline is None else self._baseline
        except OSError:
            self.supported = False
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._start
        elif self.supported:
            self.peak_bytes = max(0, self._status("VmHWM") - self._start)


@dataclass(frozen=True)
class RankReport:
    """One rank's measurements."""

    rank: int
    seconds: float  # wall time of the ring_attention call
    compute_s: float  # wall time in block kernels
    compute_cpu_s: float  # CPU time in block kernels (the work, independent of core sharing)
    wait_s: float  # blocked on transfers (communication not hidden by overlap)
    bytes_sent: int
    peak_bytes: int  # peak memory from before the inputs were made: shards + the call


@dataclass(frozen=True)
class RingDemoResult:
    """What ``attnlab ring-demo`` found: each rank's time, bytes sent and peak memory, and
    the largest difference from one process."""

    nproc: int
    seq_len: int
    batch: int
    heads: int
    head_dim: int
    causal: bool
    layout: str
    dtype: str
    backward: bool
    max_error: float  # max |ring - single-process| over the output
    reference: str  # what the single-process result came from
    reference_s: float
    ranks: tuple[RankReport, ...]
    memory_supported: bool


def _demo_worker(
    rank: int,
    n: int,
    seq_len: int,
    batch: int,
    heads: int,
    head_dim: int,
    causal: bool,
    layout: str,
    dtype_name: str,
    backward: bool,
    block_size: int | None,
    overlap: bool,
    seed: int,
    compare: bool,
) -> tuple[RankReport, bool, float, float]:
    dtype = DTYPES[dtype_name]
    device = torch.device("cpu")
    track_cpu_memory_exactly()
    # Warm up on a tiny input first, so that code pages, thread pools and transport buffers
    # touched for the first time are not counted as the call's memory.
    tiny = torch.zeros(1, 1, 2 * n, 8, dtype=dtype)
    ring_attention(*(shard_sequence(tiny, layout=layout) for _ in "qkv"), layout=layout)
    gc.collect()
    # Memory is counted from before the inputs exist: a rank's peak includes its shards.
    baseline = current_memory(device)
    full = _inputs(seed, batch, heads, seq_len, head_dim, dtype)
    shards = [shard_sequence(x, layout=layout).requires_grad_(backward) for x in full]
    del full
    stats = RingStats()
    dist.barrier()
    with PeakMemory(device, baseline=baseline) as mem:
        t0 = time.perf_counter()
        out = ring_attention(
            *shards,
            is_causal=causal,
            layout=layout,
            block_size=block_size,
            overlap=overlap,
            stats=stats,
        )
        if backward:
            out.sum().backward()
        seconds = time.perf_counter() - t0
    report = RankReport(
        rank,
        seconds,
        stats.compute_s,
        stats.compute_cpu_s,
        stats.wait_s,
        stats.bytes_sent,
        mem.peak_bytes,
    )
    max_error, ref_s = math.nan, math.nan
    if compare:
        whole = gather_sequence(out.detach(), layout=layout)
        if rank == 0:
            full = _inputs(seed, batch, heads, seq_len, head_dim, dtype)
            t0 = time.perf_counter()
            ref = _single_process(*full, causal=causal)
            ref_s = time.perf_counter() - t0
            max_error = (whole.double() - ref.double()).abs().max().item()
    return report, mem.supported, max_error, ref_s


def _inputs(
    seed: int, batch: int, heads: int, seq_len: int, head_dim: int, dtype: torch.dtype
) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, seq_len, head_dim, generator=g, dtype=dtype) for _ in "qkv"]


def _single_process(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool
) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


def run_ring_demo(
    nproc: int,
    seq_len: int,
    *,
    batch: int = 1,
    heads: int = 8,
    head_dim: int = 64,
    causal: bool = True,
    layout: str = "zigzag",
    dtype: str = "float32",
    backward: bool = False,
    block_size: int | None = None,
    overlap: bool = True,
    seed: int = 0,
    compare: bool = True,
    timeout: float = 600.0,
    threads: int = 1,
) -> RingDemoResult:
    """Run ring attention on ``nproc`` local processes (gloo, 127.0.0.1) and measure it.

    Args:
        nproc: number of processes ``N``.
        seq_len: full sequence length ``T`` (a multiple of N, or of 2N for zigzag).
        batch, heads, head_dim: ``B``, ``H``, ``D`` of the random query/key/value.
        causal: causal attention.
        layout: ``"contiguous"`` or ``"zigzag"``.
        dtype: ``"float32"``, ``"float64"`` or ``"bfloat16"``.
        backward: also run the backward pass (timed with the forward).
        block_size: tile size of the block kernel (default: the blockwise backend's).
        overlap: overlap transfers with compute.
        seed: seed of the random inputs.
        compare: gather the output and compare with single-process attention on rank 0.
        timeout: seconds before the run is abandoned.
        threads: torch threads per process.

    Returns:
        A :class:`RingDemoResult`.

    Raises:
        ValueError: bad arguments (before any process starts).
        RuntimeError: a rank failed; the message carries its error.
    """
    for name, val in (
        ("nproc", nproc),
        ("seq_len", seq_len),
        ("batch", batch),
        ("heads", heads),
        ("head_dim", head_dim),
        ("block_size", 1 if block_size is None else block_size),
    ):
        if not isinstance(val, int) or val < 1:
            raise ValueError(f"`{name}` must be a positive integer, got {val!r}")
    check_layout(layout)
    if dtype not in DTYPES:
        raise ValueError(f"`dtype` must be one of {tuple(DTYPES)}, got {dtype!r}")
    if nproc > (os.cpu_count() or 1) * 8:
        raise ValueError(f"`nproc`={nproc} is far more than this machine's CPUs; use fewer")
    check_divisible(seq_len, nproc, layout, what="`seq_len`")
    args = (
        seq_len,
        batch,
        heads,
        head_dim,
        causal,
        layout,
        dtype,
        backward,
        block_size,
        overlap,
        seed,
        compare,
    )
    outcomes = spawn_local(
        _demo_worker, nproc, args, timeout=timeout, pg_timeout=min(timeout, 300.0), threads=threads
    )
    failed = [o for o in outcomes if not o.ok]
    if failed:
        o = failed[0]
        raise RuntimeError(f"ring-demo: rank {o.rank} failed: {o.error_type}: {o.error}")
    values = [o.value for o in outcomes]
    return RingDemoResult(
        nproc=nproc,
        seq_len=seq_len,
        batch=batch,
        heads=heads,
        head_dim=head_dim,
        causal=causal,
        layout=layout,
        dtype=dtype,
        backward=backward,
        max_error=values[0][2],
        reference="torch.nn.functional.scaled_dot_product_attention (one process)",
        reference_s=values[0][3],
        ranks=tuple(v[0] for v in values),
        memory_supported=all(v[1] for v in values),
    )
