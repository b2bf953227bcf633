"""Benchmark attnlab's attention backends against PyTorch and the textbook version.

Causal self-attention, B=1, H=12, D=64, fp32, T = 128 .. --max-t, forward (no grad) and
forward + backward. Every implementation runs in the same process, interleaved within
each repetition so that load from other processes hits them alike; the reported time is
the minimum over repetitions. Results are printed as ratios to PyTorch's own
``torch.nn.functional.scaled_dot_product_attention`` (on CPU: its flash-attention kernel).

Peak memory: measured in a separate run of each call with ``torch.profiler``
(``profile_memory=True``), whose records of every allocation and free by PyTorch's CPU
allocator give the peak bytes live at once above what was live before the call (inputs
excluded, outputs and gradients included). See ``attnlab._memory``.

Second table: the production ``attnlab.Attention(backend="auto")`` layer against the same
layer written directly on ``torch.nn.functional.scaled_dot_product_attention``.

``--dtype bfloat16`` runs the same tables in bfloat16.

``--targets`` prints instead the ratios issue 12 sets targets for, each measured against
its named peer in the same run (interleaved):

1. ``blockwise`` / ``F.scaled_dot_product_attention``, causal and unmasked, fp32 and bf16,
   forward and forward+backward, T = ``--target-ts`` (target <= 1.10), with ``blockwise``'s
   peak memory per T (linear);
2. masks at T = ``--mask-t`` (causal & key padding with a quarter padded, causal sliding
   window of T/4, and a document mask when ``attnlab.masks`` has one): ``blockwise`` against
   torch's kernel given the same mask as a dense tensor (target < 1) and against torch's
   causal-only time (target <= 1.2 where the mask keeps no more entries than causal; the
   share it keeps is printed);
3. exact weights (``WeightsRequest``, one head, the last 16 rows): the call with weights
   against the plain call plus the weights alone (target <= 1.1).

Each pass also runs with ``force_tile_path("pure")`` so the fused tiles' gain shows.

Usage::

    python benchmarks/bench_attention.py --max-t 8192 --plot docs/img/attention_benchmark.png
    python benchmarks/bench_attention.py --targets --threads 2     # the issue-12 ratios

Dispatch (the crossover table ``auto`` chooses by, and the check that it chose well):

    # measure every backend at every cell and write the table attnlab ships
    python benchmarks/bench_attention.py --write-table src/attnlab/data/dispatch_table.json
    # auto against the fastest capable backend, cell by cell; print the grid and draw it
    python benchmarks/bench_attention.py --grid --grid-plot docs/img/dispatch_grid.png

A cell is (dtype, pass, mask, T) with B=1, H=12, D=64, T = S; each backend runs through
``attnlab.functional.scaled_dot_product_attention(..., backend=name)`` (and ``auto``),
interleaved in one process. Both first check that the machine is quiet (the CPU time other
processes used, from ``/proc/stat``, minus this process's own) and record how quiet it was
before and during the run; ``--allow-busy`` measures anyway and says so in the table.

``--variants`` instead measures the attention variants of issue 10 on ``blockwise``
against plain causal ``blockwise`` in the same run (ALiBi, T5 relative bias, softcap,
sinks at T=4096; 8 packed documents of 512; a 512 sliding window at T=8192, also against
PyTorch's kernel given the same mask as a dense tensor)::

    python benchmarks/bench_attention.py --variants --reps 3
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from _quiet import timed_pairs
from _records import Recorder

from attnlab import masks as attn_masks
from attnlab import native
from attnlab._memory import peak_allocated
from attnlab.attention import Attention
from attnlab.backends import AUTO_ORDER, WeightsRequest, exact_weights, explain_dispatch
from attnlab.backends.blockwise import blockwise_attention, force_tile_path
from attnlab.backends.table import TABLE_FORMAT
from attnlab.functional import scaled_dot_product_attention
from attnlab.masks import PaddingMask

H, D = 12, 64
DTYPE = torch.float32  # set by --dtype
# The clock of bench(): wall time, or with --cpu-time (one thread) this thread's CPU time,
# which other processes on a loaded machine barely change.
TIMER: Callable[[], float] = time.perf_counter


def textbook(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The book's materialised causal attention (scores, -inf mask, softmax, @ V)."""
    T = q.shape[-2]
    scores = q @ k.transpose(-2, -1)  # (B, H, T, T)
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    scores = scores.masked_fill(mask, -torch.inf)
    weights = torch.softmax(scores / math.sqrt(q.shape[-1]), dim=-1)
    return weights @ v


IMPLS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "torch sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    "textbook": textbook,
    "attnlab auto": lambda q, k, v: scaled_dot_product_attention(q, k, v, is_causal=True),
    "attnlab blockwise": lambda q, k, v: scaled_dot_product_attention(
        q, k, v, is_causal=True, backend="blockwise"
    ),
    "attnlab math": lambda q, k, v: scaled_dot_product_attention(
        q, k, v, is_causal=True, backend="math"
    ),
}
MATERIALISED = {"textbook", "attnlab math"}


def make_call(name: str, T: int, backward: bool) -> Callable[[], object]:
    return make_fn_call(IMPLS[name], T, backward, DTYPE)


def make_fn_call(
    fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    T: int,
    backward: bool,
    dtype: torch.dtype,
) -> Callable[[], object]:
    """``fn(q, k, v)`` on fresh (1, H, T, D) inputs: no grad, or forward + backward."""
    gen = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(1, H, T, D, generator=gen).to(dtype) for _ in range(3))
    grad = torch.randn(1, H, T, D, generator=gen).to(dtype)
    if not backward:

        def fwd() -> object:
            with torch.no_grad():
                return fn(q, k, v)

        return fwd
    q.requires_grad_()
    k.requires_grad_()
    v.requires_grad_()

    def fwd_bwd() -> object:
        q.grad = k.grad = v.grad = None
        fn(q, k, v).backward(grad)
        return q.grad

    return fwd_bwd


def bench(
    fns: dict[str, Callable[[], object]], reps: int, budget_s: float = 3.0
) -> dict[str, float]:
    """Minimum time of each call over interleaved repetitions (at least ``reps``; up to 20
    while the rounds take under ``budget_s``; :func:`_quiet.timed_pairs`, the quiet ones):
    a shared machine's noise only ever adds time, so the minimum is the best estimate."""
    one_round = 0.0
    for f in fns.values():  # warm up, and size the repetitions
        t0 = TIMER()
        f()
        one_round += TIMER() - t0
    reps = max(reps, min(20, int(budget_s / max(one_round, 1e-6))))
    return timed_pairs(fns, reps, clock=TIMER).best


class DirectLayer(torch.nn.Module):
    """The same layer as attnlab.Attention, calling PyTorch's kernel directly."""

    def __init__(self, layer: Attention) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        L = self.layer
        B, T, C = x.shape
        q = L.W_query(x).view(B, T, H, D).transpose(1, 2)
        k = L.W_key(x).view(B, T, H, D).transpose(1, 2)
        v = L.W_value(x).view(B, T, H, D).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return L.out_proj(out.transpose(1, 2).reshape(B, T, C))


def variant_calls(T: int, backward: bool) -> dict[str, Callable[[], object]]:
    """The issue-10 variants on blockwise (and their peers), causal, B=1, fp32."""
    from attnlab.biases import AlibiBias, RelativePositionBias
    from attnlab.masks import CausalMask, DocumentMask, SlidingWindowMask

    gen = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(1, H, T, D, generator=gen) for _ in range(3))
    grad = torch.randn(1, H, T, D, generator=gen)
    table = torch.randn(32, H, generator=gen) * 0.1
    sinks = torch.zeros(H)
    docs = torch.arange(T // 512).repeat_interleave(512)[None]  # documents of 512 tokens
    if backward:
        for t in (q, k, v, table, sinks):
            t.requires_grad_()
    dense_window = SlidingWindowMask(512).dense(T, T)  # (1, 1, T, T) bool

    def bw(mask: object = None, **kw: object) -> Callable[[], object]:
        return lambda: scaled_dot_product_attention(
            q, k, v, mask, is_causal=mask is None, backend="blockwise", **kw
        )

    fns: dict[str, Callable[[], torch.Tensor]] = {
        "causal": bw(),
        "alibi": bw(AlibiBias(H) & CausalMask()),
        "relbias": bw(RelativePositionBias(table, bidirectional=False) & CausalMask()),
        "softcap": bw(softcap=30.0),
        "sinks": bw(sinks=sinks),
        "documents": bw(DocumentMask(docs) & CausalMask()),
        "window": bw(SlidingWindowMask(512)),
        "torch window": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense_window),
    }

    def run(fn: Callable[[], torch.Tensor]) -> Callable[[], object]:
        if not backward:

            def fwd() -> object:
                with torch.no_grad():
                    return fn()

            return fwd

        def fwd_bwd() -> object:
            for t in (q, k, v, table, sinks):
                t.grad = None
            fn().backward(grad)
            return q.grad

        return fwd_bwd

    return {n: run(f) for n, f in fns.items()}


def bench_variants(reps: int, threads: int) -> None:
    """Ratios of each variant to plain causal blockwise, measured interleaved in one run."""
    targets = {"alibi": 1.3, "relbias": 1.3, "softcap": 1.3, "sinks": 1.3,
               "documents": 0.35, "window": 0.25}  # fmt: skip
    plan = [
        (4096, ["causal", "alibi", "relbias", "softcap", "sinks", "documents"]),
        (8192, ["causal", "window", "torch window"]),
    ]
    clock = "thread CPU time" if TIMER is time.thread_time else "wall time"
    # as a model's load does: the compiled module (soft-cap's one-pass probabilities)
    ext = native.extension()
    compiled = f"compiled module {ext.SIMD}" if ext is not None else "no compiled module"
    rec = Recorder(
        "bench_attention",
        "variants",
        f"attention variants on blockwise, each against plain causal blockwise in the same run "
        f"(B=1, H={H}, D={D}, fp32, causal; min of >= {max(3, reps)} interleaved rounds, "
        f"{clock}; {compiled})",
        threads,
    )
    print(
        f"blockwise variants, causal, B=1, H={H}, D={D}, fp32, {threads} threads; time = "
        f"min of >= {max(3, reps)} interleaved runs ({clock}); ratio = x plain causal blockwise of "
        f"the same run; {compiled}; {load()}"
    )
    for mode in ("fwd", "fwd+bwd"):
        print(f"\n== {mode} ==")
        for T, names in plan:
            calls = variant_calls(T, mode == "fwd+bwd")
            # At least 3 interleaved rounds and ~15 s per table: this VM's neighbours
            # add 10-20% to single runs (measured: one-round ratios moved by 0.05).
            times = bench({n: calls[n] for n in names}, max(3, reps), budget_s=15.0)
            for n in names:
                ratio = times[n] / times["causal"]
                note = f"  (target <= {targets[n]})" if n in targets else ""
                if n == "window":
                    note += f"; x torch window {times[n] / times['torch window']:.2f} (target < 1)"
                print(f"T={T:>5} {n:<13} {times[n] * 1e3:9.1f} ms {ratio:6.2f}x{note}")
                if n not in ("causal", "torch window"):
                    rec.add(
                        f"{n}, T={T}, {mode}",
                        times[n] * 1e3,
                        "ms",
                        peer="plain causal blockwise",
                        peer_value=times["causal"] * 1e3,
                        better="lower",
                    )
                if n == "window":
                    rec.add(
                        f"window vs torch's kernel with the dense mask, T={T}, {mode}",
                        times[n] * 1e3,
                        "ms",
                        peer="torch sdpa, dense window mask",
                        peer_value=times["torch window"] * 1e3,
                        better="lower",
                    )
    print(f"\n{load()} at the end")
    rec.write()


def _blockwise(mask: object, path: str | None = None) -> Callable[..., torch.Tensor]:
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with force_tile_path(path):  # type: ignore[arg-type]
            return scaled_dot_product_attention(q, k, v, mask, backend="blockwise")

    return run


def _sdpa(mask: torch.Tensor | None, is_causal: bool) -> Callable[..., torch.Tensor]:
    return lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal
    )


def load() -> str:
    with open("/proc/loadavg") as fh:
        return "load " + " ".join(fh.read().split()[:3])


def targets(args: argparse.Namespace) -> None:
    """The issue-12 ratio tables (see the module docstring)."""
    print(
        f"B=1, H={H}, D={D}, {args.threads} threads; {'CPU' if args.cpu_time else 'wall'} "
        f"time = min of >= {args.reps} interleaved "
        f"runs; ratio = attnlab / named peer in the same run; {load()}"
    )
    print("\n== 1. blockwise / torch sdpa, causal and unmasked (target <= 1.10) ==")
    print(f"{'T':>6} {'dtype':>8} {'mask':>6} {'pass':>8} {'sdpa ms':>9} {'fused':>6} {'pure':>6}")
    for T in args.target_ts:
        for dname in args.target_dtypes:
            dtype = GRID_DTYPES[dname]
            for causal in (True, False):
                mask = attn_masks.CausalMask() if causal else None
                for backward in (False, True):
                    impls = {"sdpa": _sdpa(None, causal), "fused": _blockwise(mask, "fused")}
                    if args.pure_max_t >= T:
                        impls["pure"] = _blockwise(mask, "pure")
                    fns = {n: make_fn_call(f, T, backward, dtype) for n, f in impls.items()}
                    best = bench(fns, args.reps if T <= 4096 else max(1, args.reps - 1))
                    pure = f"{best['pure'] / best['sdpa']:6.2f}" if "pure" in best else "     -"
                    print(
                        f"{T:>6} {dname:>8} {'causal' if causal else 'none':>6} "
                        f"{'fwd+bwd' if backward else 'fwd':>8} {best['sdpa'] * 1e3:9.1f} "
                        f"{best['fused'] / best['sdpa']:6.2f} {pure}",
                        flush=True,
                    )
    if not args.no_memory and args.target_ts:
        print("\nblockwise (fused) causal fwd+bwd peak MiB (x torch):", end="")
        for T in args.target_ts:
            ours = peak_allocated(make_fn_call(_blockwise(attn_masks.CausalMask()), T, True,
                                               torch.float32))[1]  # fmt: skip
            theirs = peak_allocated(make_fn_call(_sdpa(None, True), T, True, torch.float32))[1]
            print(f"  T={T}: {ours / 2**20:.1f} ({ours / max(1, theirs):.2f})", end="")
        print()

    if args.mask_t:
        _mask_table(args.mask_t, args)
    if args.weights_t:
        _weights_ratio(args.weights_t, args)
    print(f"\n{load()}")


def _mask_table(T: int, args: argparse.Namespace) -> None:
    mask_set: dict[str, attn_masks.AttentionMask] = {
        "padding": attn_masks.PaddingMask.from_lengths([3 * T // 4], T) & attn_masks.CausalMask(),
        "window": attn_masks.SlidingWindowMask(T // 4),
    }
    document = getattr(attn_masks, "DocumentMask", None)
    if document is not None:  # documents of T/8 tokens, causal within each
        try:
            ids = torch.arange(T) // (T // 8)
            mask_set["document"] = document(ids[None]) & attn_masks.CausalMask()
        except (TypeError, ValueError) as e:  # its signature differs: say so, skip it
            print(f"(document mask skipped: {e})")
    causal_entries = T * (T + 1) / 2
    print(
        f"\n== 2. masks at T={T} fp32: blockwise / sdpa with the dense mask (target < 1), "
        f"blockwise / sdpa causal-only (target <= 1.2 where kept <= 1) =="
    )
    print(
        f"{'mask':>9} {'pass':>8} {'kept':>5} {'sdpa causal ms':>15} {'x dense':>8} {'x causal':>9}"
    )
    for name, m in mask_set.items():
        dense = m.dense(T, T)  # (1|B, 1, T, T) bool: True = may attend
        kept = float(dense.sum()) / causal_entries
        for backward in (False, True) if args.mask_backward else (False,):
            impls = {
                "causal": _sdpa(None, True),
                "dense": _sdpa(dense, False),
                "blockwise": _blockwise(m),
            }
            fns = {n: make_fn_call(f, T, backward, torch.float32) for n, f in impls.items()}
            best = bench(fns, max(1, args.reps - 1))
            print(
                f"{name:>9} {'fwd+bwd' if backward else 'fwd':>8} {kept:5.2f} "
                f"{best['causal'] * 1e3:15.1f} {best['blockwise'] / best['dense']:8.2f} "
                f"{best['blockwise'] / best['causal']:9.2f}",
                flush=True,
            )
        del dense


def _weights_ratio(T: int, args: argparse.Namespace) -> None:
    print(f"\n== 3. exact weights, T={T} causal fp32, head 0, last 16 rows (target <= 1.1) ==")
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, H, T, D, generator=gen) for _ in range(3))
    req = WeightsRequest(heads=(0,), rows=tuple(range(T - 16, T)))
    causal = attn_masks.CausalMask()
    lse = blockwise_attention(q, k, v, causal, dropout_p=0.0, scale=D**-0.5).lse

    def with_weights() -> object:
        return scaled_dot_product_attention(q, k, v, causal, backend="blockwise", need_weights=req)

    fns = {
        "with": with_weights,
        "plain": lambda: scaled_dot_product_attention(q, k, v, causal, backend="blockwise"),
        "weights": lambda: exact_weights(q, k, causal, D**-0.5, req, lse),
    }
    with torch.no_grad():
        best = bench(fns, args.reps)
    print(
        f"with weights {best['with'] * 1e3:.1f} ms, plain {best['plain'] * 1e3:.1f} ms, weights "
        f"alone {best['weights'] * 1e3:.2f} ms: ratio "
        f"{best['with'] / (best['plain'] + best['weights']):.3f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--min-t", type=int, default=128)
    ap.add_argument("--max-t", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--materialised-max-t",
        type=int,
        default=4096,
        help="largest T for the O(T^2)-memory implementations",
    )
    ap.add_argument("--no-memory", action="store_true", help="skip the memory runs")
    ap.add_argument("--plot", default=None, help="write a PNG of time and memory vs T")
    ap.add_argument("--json", default=None, help="write the raw numbers as JSON")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument(
        "--cpu-time", action="store_true", help="time by this thread's CPU time (--threads 1)"
    )
    ap.add_argument("--targets", action="store_true", help="print the issue-12 ratio tables")
    ap.add_argument("--target-ts", type=int, nargs="*", default=[1024, 2048, 4096, 8192])
    ap.add_argument(
        "--target-dtypes",
        nargs="+",
        choices=["float32", "bfloat16"],
        default=["float32", "bfloat16"],
    )
    ap.add_argument("--pure-max-t", type=int, default=2048, help="largest T for the pure tiles")
    ap.add_argument("--mask-t", type=int, default=8192, help="0 skips the mask table")
    ap.add_argument("--mask-backward", action="store_true", help="masks: forward+backward too")
    ap.add_argument("--weights-t", type=int, default=4096, help="0 skips the weights")
    grid = ap.add_argument_group("dispatch grid and crossover table")
    grid.add_argument(
        "--write-table",
        metavar="FILE",
        default=None,
        help="measure every backend in every cell and write the crossover table auto uses",
    )
    grid.add_argument(
        "--grid", action="store_true", help="auto against the fastest backend in every cell"
    )
    grid.add_argument("--grid-plot", default=None, help="draw the --grid result (PNG)")
    grid.add_argument(
        "--grid-with",
        metavar="JSON",
        nargs="*",
        default=[],
        help="cells of earlier --grid --json runs (other lengths) to print and draw with this one",
    )
    grid.add_argument("--grid-min-t", type=int, default=16)
    grid.add_argument("--grid-max-t", type=int, default=2048)
    grid.add_argument("--grid-reps", type=int, default=5, help="interleaved rounds per cell")
    grid.add_argument(
        "--second-look",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="after the grid, time close or failing cells once more (the table ranks each "
        "backend by its slower look, auto's ratio takes each contender's faster one)",
    )
    grid.add_argument("--dtypes", default="float32,bfloat16")
    grid.add_argument("--passes", default="forward,forward+backward")
    grid.add_argument("--masks", default="causal,none,padding")
    grid.add_argument(
        "--math-max-t", type=int, default=1024, help="largest T the O(T^2) math backend runs at"
    )
    grid.add_argument(
        "--max-busy",
        type=float,
        default=0.1,
        help="most CPU (fraction of the machine) other processes may use before measuring",
    )
    grid.add_argument("--wait-quiet", type=float, default=60.0, help="seconds to wait for it")
    grid.add_argument("--allow-busy", action="store_true", help="measure on a busy machine")
    ap.add_argument(
        "--overhead",
        action="store_true",
        help="per-call cost of attnlab's dispatch at T=32 (1 thread): auto, sdpa, torch",
    )
    ap.add_argument(
        "--variants", action="store_true", help="measure the attention variants (issue 10) only"
    )
    args = ap.parse_args()
    if args.overhead:
        overhead_main()
        return
    torch.set_num_threads(args.threads)
    global DTYPE, TIMER
    if args.cpu_time:
        if args.threads != 1:
            print(
                "--cpu-time needs --threads 1 (other threads' work is not counted)", file=sys.stderr
            )
            sys.exit(2)
        TIMER = time.thread_time
    if args.variants:
        bench_variants(args.reps, args.threads)
        return
    DTYPE = GRID_DTYPES[args.dtype]
    if args.targets:
        targets(args)
        return
    if args.write_table or args.grid:
        grid_main(args)
        return

    Ts = []
    T = args.min_t
    while args.max_t >= T:
        Ts.append(T)
        T *= 2
    results: dict[str, dict[str, dict[int, dict[str, float]]]] = {"fwd": {}, "fwd+bwd": {}}
    rec = Recorder(
        "bench_attention",
        f"causal-{args.dtype}",
        f"causal self-attention, B=1, H={H}, D={D}, {args.dtype}: each implementation against "
        "torch.nn.functional.scaled_dot_product_attention, interleaved, min of "
        f"{args.reps} rounds; peak memory from torch.profiler's allocation records",
        args.threads,
    )
    print(
        f"causal attention, B=1, H={H}, D={D}, {args.dtype}, {args.threads} threads; time = min of "
        f"{args.reps} interleaved runs; memory = peak bytes allocated by the call "
        "(torch.profiler allocation records)"
    )
    for mode in ("fwd", "fwd+bwd"):
        backward = mode == "fwd+bwd"
        print(f"\n== {mode} ==")
        header = (
            f"{'T':>6} {'impl':<18} {'time ms':>10} {'x torch':>8} {'peak MiB':>10} {'x torch':>8}"
        )
        print(header)
        for T in Ts:
            names = [n for n in IMPLS if n not in MATERIALISED or args.materialised_max_t >= T]
            fns = {n: make_call(n, T, backward) for n in names}
            times = bench(fns, args.reps if T <= 4096 else max(1, args.reps - 1))
            mems = {}
            if not args.no_memory:
                for n in names:
                    mems[n] = peak_allocated(make_call(n, T, backward))[1]
            for n in names:
                row = {"time_s": times[n]}
                if mems:
                    row["peak_bytes"] = mems[n]
                results[mode].setdefault(n, {})[T] = row
                t_ratio = times[n] / times["torch sdpa"]
                mem = (
                    f"{mems[n] / 2**20:10.1f} {mems[n] / max(1, mems['torch sdpa']):8.2f}"
                    if mems
                    else ""
                )
                print(f"{T:>6} {n:<18} {times[n] * 1e3:10.1f} {t_ratio:8.2f} {mem}")
                if n != "torch sdpa":
                    rec.add(
                        f"{n}, T={T}, {mode}",
                        times[n] * 1e3,
                        "ms",
                        peer="torch sdpa",
                        peer_value=times["torch sdpa"] * 1e3,
                        better="lower",
                    )
                    if mems:
                        rec.add(
                            f"{n} peak memory, T={T}, {mode}",
                            mems[n] / 2**20,
                            "MiB",
                            peer="torch sdpa",
                            peer_value=mems["torch sdpa"] / 2**20,
                            better="lower",
                        )
            skipped = [n for n in IMPLS if n not in names]
            if skipped:
                print(f"{T:>6} (skipped {', '.join(skipped)}: O(T^2) memory)")

    print("\n== layer: attnlab.Attention(backend='auto') vs the same layer on torch sdpa ==")
    layer_rows = {}
    for T in [t for t in (512, 2048, 4096) if t <= args.max_t]:
        torch.manual_seed(0)
        layer = Attention(H * D, H).to(DTYPE).eval()
        direct = DirectLayer(layer).eval()
        x = torch.randn(1, T, H * D).to(DTYPE)

        def ours(layer: Attention = layer, x: torch.Tensor = x) -> object:
            with torch.no_grad():
                return layer(x, is_causal=True)

        def theirs(direct: DirectLayer = direct, x: torch.Tensor = x) -> object:
            with torch.no_grad():
                return direct(x)

        torch.testing.assert_close(ours(), theirs())
        best = bench({"attnlab": ours, "direct": theirs}, max(5, args.reps * 2))
        ratio = best["attnlab"] / best["direct"]
        layer_rows[T] = ratio
        rec.add(
            f"Attention(backend='auto') layer, T={T}, fwd",
            best["attnlab"] * 1e3,
            "ms",
            peer="the same layer on torch sdpa",
            peer_value=best["direct"] * 1e3,
            better="lower",
        )
        print(
            f"T={T:>5}: attnlab {best['attnlab'] * 1e3:8.1f} ms, direct "
            f"{best['direct'] * 1e3:8.1f} ms, ratio {ratio:.3f}"
        )

    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"results": results, "layer_ratio": layer_rows}, fh, indent=1)
    if args.plot:
        plot(results, args.plot, args.threads)
        print(f"\nplot written to {args.plot}")
    rec.write()


def plot(results: dict, path: str, threads: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8), constrained_layout=True)
    for col, mode in enumerate(("fwd", "fwd+bwd")):
        for row, (key, label, unit) in enumerate(
            (("time_s", "time", 1e3), ("peak_bytes", "peak memory", 1 / 2**20))
        ):
            ax = axes[row][col]
            for name, by_t in results[mode].items():
                Ts = sorted(by_t)
                if key not in by_t[Ts[0]]:
                    continue
                ax.plot(Ts, [by_t[t][key] * unit for t in Ts], marker="o", label=name)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length T")
            ax.set_ylabel("ms" if key == "time_s" else "MiB")
            ax.set_title(f"{mode}: {label}")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"causal attention, B=1, H={H}, D={D}, fp32, CPU, {threads} threads")
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- dispatch: the crossover table and the grid ----------------------------------------------


def _cpu_jiffies() -> tuple[int, int]:
    """(busy, total) CPU jiffies of the whole machine, from /proc/stat."""
    with open("/proc/stat") as fh:
        fields = [int(x) for x in fh.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already counted in user
    return total - idle, total


class QuietMeter:
    """CPU used by *other* processes, as a fraction of the machine, since ``start()``."""

    def start(self) -> QuietMeter:
        self.busy0, self.total0 = _cpu_jiffies()
        self.own0 = sum(os.times()[:2])
        return self

    def others(self) -> float:
        busy, total = _cpu_jiffies()
        tick = os.sysconf("SC_CLK_TCK")
        own = (sum(os.times()[:2]) - self.own0) * tick
        return max(0.0, (busy - self.busy0 - own) / max(1, total - self.total0))


def wait_until_quiet(args: argparse.Namespace, sample_s: float = 2.0) -> dict:
    """Sample the machine, ``sample_s`` seconds at a time, until others use at most
    ``--max-busy`` of it (or give up)."""
    deadline = time.monotonic() + args.wait_quiet
    while True:
        meter = QuietMeter().start()
        time.sleep(sample_s)
        busy = meter.others()
        quiet = busy <= args.max_busy
        if quiet or time.monotonic() > deadline:
            break
        print(f"machine busy: others use {busy:.0%} of it; waiting ...", flush=True)
    state = {
        "others_busy_before": round(busy, 3),
        "loadavg_before": os.getloadavg(),
        "max_busy": args.max_busy,
        "quiet": quiet,
    }
    if not quiet and not args.allow_busy:
        print(
            f"error: the machine is busy (other processes use {busy:.0%} of its CPU, more than "
            f"--max-busy {args.max_busy:.0%}); measure on a quiet machine, or pass "
            "--allow-busy to measure anyway (recorded as not quiet)",
            file=sys.stderr,
        )
        raise SystemExit(2)
    return state


GRID_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PASSES = ("forward", "forward+backward")
MASKS = ("causal", "none", "padding")


def grid_inputs(dtype: torch.dtype, pass_: str, T: int) -> tuple[torch.Tensor, ...]:
    """One cell's q, k, v and output gradient, shared by every contender of the cell: the
    same call on two sets of equal tensors measured up to 10% apart (bf16 forward+backward
    at T = 128, interleaved in either order), which is the tensors' placement in memory,
    not the backend."""
    gen = torch.Generator().manual_seed(T)
    q, k, v, grad = (torch.randn(1, H, T, D, generator=gen).to(dtype) for _ in range(4))
    if pass_ != "forward":
        for t in (q, k, v):
            t.requires_grad_()
    return q, k, v, grad


def grid_call(
    name: str, inputs: tuple[torch.Tensor, ...], pass_: str, mask: str, T: int
) -> Callable[[], object]:
    """One attention call of a grid cell through attnlab's function (``backend=name``)."""
    q, k, v, grad = inputs
    kwargs: dict = {"backend": name}
    if mask == "causal":
        kwargs["is_causal"] = True
    elif mask == "padding":  # the last eighth of the keys is padding
        kwargs["attn_mask"] = PaddingMask.from_lengths([max(1, T - T // 8)], T)
    if pass_ == "forward":

        def fwd() -> object:
            with torch.no_grad():
                return scaled_dot_product_attention(q, k, v, **kwargs)

        return fwd

    def fwd_bwd() -> object:
        q.grad = k.grad = v.grad = None
        scaled_dot_product_attention(q, k, v, **kwargs).backward(grad)  # type: ignore[union-attr]
        return q.grad

    return fwd_bwd


def grid_auto_choice(dtype: torch.dtype, pass_: str, mask: str, T: int) -> str:
    """The backend auto picks for the cell, and the table row that decided."""
    q = torch.zeros(1, 1, 1, 1, dtype=dtype).expand(1, H, T, D)
    q.requires_grad_(pass_ != "forward")
    args: dict = {"is_causal": mask == "causal"}
    if mask == "padding":
        args["attn_mask"] = PaddingMask.from_lengths([max(1, T - T // 8)], T)
    with torch.enable_grad():
        return explain_dispatch(q, q, q, **args).chosen


def bench_cell(
    fns: dict[str, Callable[[], object]], rounds: int, budget_s: float = 6.0
) -> dict[str, float]:
    """Seconds per call of each function: the minimum over interleaved rounds, each timing
    as many calls as fill ~5 ms (small calls are too short to time one by one). Cheap
    cells run more rounds (up to 4x, while under 2 s); a cell whose round takes over a
    second runs fewer (at least 2, as many as fit ``budget_s``), so that T = 8192 stays
    affordable."""
    inner = {}
    settle = {}
    one_round = 0.0
    for name, f in fns.items():  # warm up, and size the inner loops and the rounds
        t0 = time.perf_counter()
        f()
        once = time.perf_counter() - t0
        one_round += once
        inner[name] = max(1, min(200, int(0.005 / max(once, 1e-7))))
        # A short call is slower right after another kernel than after itself (measured:
        # bf16 math forward+backward at T = 128, 1.6 ms after itself, 1.8 after sdpa, 2.3
        # after blockwise), which in a fixed round order favoured whichever call follows
        # its twin (auto after the backend it picks) by up to 10%. One untimed call first
        # gives every timing the same predecessor: itself.
        settle[name] = once < 0.05
    if one_round > 1.0:
        rounds = max(2, min(rounds, int(budget_s / one_round)))
    best = dict.fromkeys(fns, math.inf)
    t_start = time.perf_counter()
    r = 0
    while r < rounds or (r < 4 * rounds and time.perf_counter() - t_start < 2.0):
        for name, f in fns.items():
            n = inner[name]
            if settle[name]:
                f()
            t0 = time.perf_counter()
            for _ in range(n):
                f()
            best[name] = min(best[name], (time.perf_counter() - t0) / n)
        r += 1
    return best


def grid_ts(args: argparse.Namespace) -> list[int]:
    Ts, T = [], args.grid_min_t
    while args.grid_max_t >= T:
        Ts.append(T)
        T *= 2
    return Ts


def _time_cell(
    args: argparse.Namespace,
    cell: dict,
    with_auto: bool,
    rounds: int,
    budget_s: float = 6.0,
    settle: bool = True,
) -> dict[str, float]:
    """Seconds per call of every capable backend (and auto) in one grid cell; ``settle``:
    re-time its close calls head to head (:func:`_settle_close_calls`)."""
    dname, pass_, mask, T = cell["dtype"], cell["pass"], cell["mask"], cell["T"]
    run = [n for n in AUTO_ORDER if n != "math" or args.math_max_t >= T]
    inputs = grid_inputs(GRID_DTYPES[dname], pass_, T)
    fns = {n: grid_call(n, inputs, pass_, mask, T) for n in run}
    if with_auto:
        fns["auto"] = grid_call("auto", inputs, pass_, mask, T)
    sec = bench_cell(fns, rounds, budget_s)
    if not settle:
        return sec
    return _settle_close_calls(fns, sec, run, cell.get("auto_chose", ""), rounds)


def _judge(cell: dict, sec: dict[str, float], with_auto: bool) -> None:
    """Fill a cell's times (ms) and, with auto, its fastest backend and auto's ratio."""
    ms = {n: sec[n] * 1e3 for n in sec}
    cell["ms"] = ms
    if with_auto:
        fastest = min((n for n in ms if n != "auto"), key=lambda n: ms[n])
        cell["fastest"] = fastest
        cell["ratio"] = ms["auto"] / ms[fastest]


def _cell_line(cell: dict, with_auto: bool) -> str:
    ms = cell["ms"]
    line = f"{cell['dtype']:>8} {cell['pass']:>16} {cell['mask']:>7} T={cell['T']:<5} "
    line += " ".join(f"{n} {ms[n]:.3g}" for n in ms)
    if with_auto:
        line += f"  -> auto={cell['auto_chose']} {cell['ratio']:.2f}x {cell['fastest']}"
    return line + " ms"


def _needs_second_look(cell: dict, with_auto: bool) -> bool:
    """A cell whose verdict may be a passing state of the machine: auto above 1.05x the
    fastest backend, or (building the table) the two fastest backends within ``CLOSE``."""
    if with_auto:
        return bool(cell["ratio"] > 1.05)
    t = sorted(v for n, v in cell["ms"].items() if n != "auto")
    return len(t) > 1 and t[1] <= t[0] * (1 + CLOSE)


def measure_grid(args: argparse.Namespace, with_auto: bool) -> list[dict]:
    """Time every capable backend (and auto) in every cell; one dict per cell.

    A cell is timed within a few seconds, and this VM's state can hold that long: the
    same cell measured sdpa 0.55 ms in one pass and 0.82 ms (every round) in the next,
    minutes apart, while math hardly moved, which decided the cell. So after the grid,
    the cells whose verdict is close or failing (:func:`_needs_second_look`) are timed
    once more, every contender again. Building the table, each backend then counts with
    the slower of its two looks: a backend that is fast in one state of the machine and
    slow in the other ranks behind one that is fast in both (fp32 forward+backward at
    T = 512: sdpa 20 or 23.5 ms depending on the minute, math 20 in both), since auto
    meets both states. Judging auto, each contender keeps the faster of its looks: the
    same rule for every contender, so a second look can show a gap that is real and
    remove one that was the machine. The first look's times stay in the cell
    (``first_ms``) and the report counts both."""
    cells = []
    for dname in args.dtypes.split(","):
        for pass_ in args.passes.split(","):
            for mask in args.masks.split(","):
                for T in grid_ts(args):
                    cell: dict = {"dtype": dname, "pass": pass_, "mask": mask, "T": T}
                    if with_auto:
                        cell["auto_chose"] = grid_auto_choice(GRID_DTYPES[dname], pass_, mask, T)
                    _judge(cell, _time_cell(args, cell, with_auto, args.grid_reps), with_auto)
                    print(_cell_line(cell, with_auto), flush=True)
                    cells.append(cell)
    again = [c for c in cells if _needs_second_look(c, with_auto)]
    if again and args.second_look:
        print(f"second look at {len(again)} cells:", flush=True)
        for cell in again:
            first = dict(cell["ms"])
            # Already 3x the rounds and the recheck's budget: no recheck of the recheck.
            sec = _time_cell(args, cell, with_auto, 3 * args.grid_reps, 24.0, settle=False)
            cell["first_ms"] = first
            if with_auto:
                cell["first_ratio"] = cell["ratio"]
            pick = min if with_auto else max
            _judge(cell, {n: pick(first[n], sec[n] * 1e3) / 1e3 for n in first}, with_auto)
            print(_cell_line(cell, with_auto), flush=True)
    return cells


CLOSE = 0.10  # timings this close are re-measured head to head before they decide anything


def _settle_close_calls(
    fns: dict[str, Callable[[], object]],
    sec: dict[str, float],
    run: list[str],
    auto_chose: str,
    rounds: int,
) -> dict[str, float]:
    """Re-time, head to head with 3x the rounds, the calls whose comparison decides something
    and that a first pass put within ``CLOSE`` of each other: the two fastest backends (their
    order becomes a table row), and auto against the fastest backend when auto looks slower
    by more than 5%. Each keeps its minimum over both passes, so a call only gets faster by
    more samples, never by another rule; a real difference survives, a scheduler hiccup in
    one sub-millisecond round does not flip a row or fail a cell."""
    best = sorted(run, key=lambda n: sec[n])
    again: set[str] = set()
    if len(best) > 1 and sec[best[1]] <= sec[best[0]] * (1 + CLOSE):
        again |= {best[0], best[1]}
    if auto_chose and sec["auto"] > sec[best[0]] * 1.05:
        again |= {"auto", best[0], auto_chose}
    if not again:
        return sec
    # 3x the rounds, and 4x the time budget: at T = 8192 a first pass is only 2 rounds of
    # seconds each, and one slow round on this VM moved a cell by 5-7% (measured).
    more = bench_cell({n: fns[n] for n in fns if n in again}, 3 * rounds, budget_s=24.0)
    return {n: min(sec[n], more.get(n, math.inf)) for n in sec}


TIE = 0.03  # a backend later in the fixed order must win by more than this to rank first


def ranking(ms: dict[str, float]) -> list[str]:
    """Backends fastest first; the fixed order's first stays first unless another beats it
    by more than ``TIE`` (a win inside the noise would only flip rows back and forth)."""
    order = sorted((n for n in ms if n != "auto"), key=lambda n: ms[n])
    preferred = next(n for n in AUTO_ORDER if n in order)
    if order[0] != preferred and ms[preferred] <= ms[order[0]] * (1 + TIE):
        order.remove(preferred)
        order.insert(0, preferred)
    return order


def table_rows(cells: list[dict]) -> list[dict]:
    """Crossover rows: consecutive lengths with the same ranking merge into one row, whose
    range ends halfway (geometrically) to the next measured length."""
    rows: list[dict] = []
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for c in cells:
        groups.setdefault((c["dtype"], c["pass"], c["mask"]), []).append(c)
    for (dname, pass_, mask), group in groups.items():
        group.sort(key=lambda c: c["T"])
        runs: list[list[dict]] = []
        for c in group:
            c["order"] = ranking(c["ms"])
            if runs and runs[-1][-1]["order"] == c["order"]:
                runs[-1].append(c)
            else:
                runs.append([c])
        for i, run in enumerate(runs):
            t_from = 0 if i == 0 else round(math.sqrt(runs[i - 1][-1]["T"] * run[0]["T"]), 1)
            t_below = (
                None
                if i == len(runs) - 1
                else round(math.sqrt(run[-1]["T"] * runs[i + 1][0]["T"]), 1)
            )
            rows.append(
                {
                    "dtype": dname,
                    "pass": pass_,
                    "mask": mask,
                    "t_from": t_from,
                    "t_below": t_below,
                    "order": run[0]["order"],
                    "ms": {
                        str(c["T"]): {n: float(f"{c['ms'][n]:.4g}") for n in c["order"]}
                        for c in run
                    },
                }
            )
    return rows


def machine_info(args: argparse.Namespace, quiet: dict, meter: QuietMeter) -> dict:
    from attnlab.native import cpu_model

    cpu = cpu_model()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python " + " ".join(sys.argv),
        "torch": torch.__version__,
        "threads": args.threads,
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        **quiet,
        "others_busy_during": round(meter.others(), 3),
        "loadavg_after": os.getloadavg(),
        "timing": f"min over >= {args.grid_reps} interleaved rounds of attnlab's function "
        "with backend=name",
    }


def print_grid(cells: list[dict]) -> None:
    masks = list(dict.fromkeys(c["mask"] for c in cells))
    by = {(c["dtype"], c["pass"], c["mask"], c["T"]): c for c in cells}
    worst = max(c["ratio"] for c in cells)
    for dname in dict.fromkeys(c["dtype"] for c in cells):
        for pass_ in dict.fromkeys(c["pass"] for c in cells):
            print(f"\n== {dname}, {pass_}: auto's choice, and auto's time / fastest backend's ==")
            print(f"{'T':>6} " + " ".join(f"{m:>24}" for m in masks))
            for T in sorted({c["T"] for c in cells}):
                parts = []
                for m in masks:
                    c = by.get((dname, pass_, m, T))
                    if c is None:
                        parts.append(f"{'':>24}")
                        continue
                    flag = "" if c["fastest"] == c["auto_chose"] else f" ({c['fastest']})"
                    parts.append(f"{c['auto_chose'] + flag} {c['ratio']:.2f}x".rjust(24))
                print(f"{T:>6} " + " ".join(parts))
    bad = [c for c in cells if c["ratio"] > 1.05]
    first = [c for c in cells if c.get("first_ratio", c["ratio"]) > 1.05]
    print(
        f"\nworst ratio {worst:.3f}; cells above 1.05x: {len(bad)} of {len(cells)} "
        f"({len(first)} at the first look)"
    )
    for c in first:
        second = f" (first look {c['first_ratio']:.2f}x)" if "first_ratio" in c else ""
        print(
            f"  {c['dtype']} {c['pass']} {c['mask']} T={c['T']}: auto={c['auto_chose']} "
            f"{c['ratio']:.2f}x the fastest ({c['fastest']}){second}"
        )


def plot_grid(cells: list[dict], path: str, title: str) -> None:
    # The Figure API, not pyplot: no global state, no GUI backend (tests call this in-process).
    from matplotlib.colors import LinearSegmentedColormap
    from matplotlib.figure import Figure

    dtypes = list(dict.fromkeys(c["dtype"] for c in cells))
    passes = list(dict.fromkeys(c["pass"] for c in cells))
    masks = list(dict.fromkeys(c["mask"] for c in cells))
    Ts = sorted({c["T"] for c in cells})
    by = {(c["dtype"], c["pass"], c["mask"], c["T"]): c for c in cells}
    cmap = LinearSegmentedColormap.from_list("ratio", ["#2e7d32", "#c8e6c9", "#fff59d", "#e53935"])
    fig = Figure(
        figsize=(3.4 * len(dtypes) * len(passes), 0.42 * len(Ts) + 2.0), layout="constrained"
    )
    axes = fig.subplots(
        1,
        len(dtypes) * len(passes),
        squeeze=False,
    )
    short = {"sdpa": "sdpa", "blockwise": "block", "math": "math"}
    for i, (dname, pass_) in enumerate((d, p) for d in dtypes for p in passes):
        ax = axes[0][i]
        grid = [[by[(dname, pass_, m, T)]["ratio"] for m in masks] for T in Ts]
        im = ax.imshow(grid, cmap=cmap, vmin=0.95, vmax=1.15, aspect="auto")
        for r, T in enumerate(Ts):
            for col, m in enumerate(masks):
                c = by[(dname, pass_, m, T)]
                label = short.get(c["auto_chose"], c["auto_chose"])
                if c["fastest"] != c["auto_chose"]:
                    label += "*"
                ax.text(col, r, f"{label}\n{c['ratio']:.2f}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(masks)), masks)
        ax.set_yticks(range(len(Ts)), [str(T) for T in Ts])
        ax.set_title(f"{dname}\n{pass_}", fontsize=10)
        if i == 0:
            ax.set_ylabel("T (= S)")
    fig.colorbar(im, ax=axes[0].tolist(), label="auto time / fastest backend's time", shrink=0.8)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)


def grid_main(args: argparse.Namespace) -> None:
    for d in args.dtypes.split(","):
        if d not in GRID_DTYPES:
            raise SystemExit(f"error: --dtypes: unknown {d!r}; choose from {list(GRID_DTYPES)}")
    for p in args.passes.split(","):
        if p not in PASSES:
            raise SystemExit(f"error: --passes: unknown {p!r}; choose from {list(PASSES)}")
    for m in args.masks.split(","):
        if m not in MASKS:
            raise SystemExit(f"error: --masks: unknown {m!r}; choose from {list(MASKS)}")
    quiet = wait_until_quiet(args)
    print(
        f"B=1, H={H}, D={D}, T = S = {args.grid_min_t}..{args.grid_max_t}, {args.threads} "
        f"threads; other processes used {quiet['others_busy_before']:.0%} of the machine "
        f"before (loadavg {quiet['loadavg_before'][0]:.2f})",
        flush=True,
    )
    t0 = time.perf_counter()
    if args.write_table:
        meter = QuietMeter().start()
        cells = measure_grid(args, with_auto=False)
        table = {
            "format": TABLE_FORMAT,
            "about": "backends fastest first per (dtype, pass, mask, length), timed by "
            "benchmarks/bench_attention.py --write-table; auto dispatches by it",
            "machine": machine_info(args, quiet, meter),
            "shape": {"B": 1, "H": H, "D": D, "device": "cpu"},
            "rows": table_rows(cells),
        }
        Path(args.write_table).write_text(json.dumps(table, indent=1) + "\n")
        m = table["machine"]
        print(
            f"\nwrote {len(table['rows'])} rows to {args.write_table} in "
            f"{time.perf_counter() - t0:.0f} s; others used {m['others_busy_before']:.0%} of "
            f"the machine before and {m['others_busy_during']:.0%} during the run"
        )
        from attnlab.backends import set_dispatch_table

        set_dispatch_table(args.write_table)  # validates it; --grid below then uses it
    if args.grid:
        meter = QuietMeter().start()
        cells = measure_grid(args, with_auto=True)
        busy = meter.others()
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"cells": cells, "others_busy_during": busy}, fh, indent=1)
        for earlier in args.grid_with:  # e.g. T <= 2048 with the table, then 4096..8192
            data = json.loads(Path(earlier).read_text())
            here = {(c["dtype"], c["pass"], c["mask"], c["T"]) for c in cells}
            cells += [
                c for c in data["cells"] if (c["dtype"], c["pass"], c["mask"], c["T"]) not in here
            ]
            busy = max(busy, data.get("others_busy_during", 0.0))
        print_grid(cells)
        print(
            f"grid took {time.perf_counter() - t0:.0f} s; other processes used {busy:.0%} of "
            f"the machine during it (loadavg now {os.getloadavg()[0]:.2f})"
        )
        if args.grid_plot:
            title = (
                f"auto / fastest backend, B=1 H={H} D={D}, CPU {args.threads} threads "
                f"(label: auto's choice; * = another backend was fastest); "
                f"others' CPU use {busy:.0%}"
            )
            plot_grid(cells, args.grid_plot, title)
            print(f"grid plot written to {args.grid_plot}")


def overhead_main(T: int = 32, calls: int = 200, rounds: int = 40) -> None:
    """What attnlab adds per call: T=32 fp32 causal forward, B=1, H=12, D=64, one thread.

    Interleaved rounds of ``calls`` calls each; the minimum per-call time of each, as CPU
    time of the calling thread (``time.thread_time``): with one thread the kernel runs in
    it, and time the machine's other processes take away from it is not counted, so the
    comparison holds on a busy machine too. Wall-clock minima are printed beside it."""
    torch.set_num_threads(1)
    q, k, v = (torch.randn(1, H, T, D) for _ in range(3))
    fns = {
        "torch F.scaled_dot_product_attention": lambda: F.scaled_dot_product_attention(
            q, k, v, is_causal=True
        ),
        "attnlab backend='sdpa'": lambda: scaled_dot_product_attention(
            q, k, v, is_causal=True, backend="sdpa"
        ),
        "attnlab backend='auto'": lambda: scaled_dot_product_attention(q, k, v, is_causal=True),
    }
    best = dict.fromkeys(fns, math.inf)
    wall = dict.fromkeys(fns, math.inf)
    with torch.no_grad():
        for _ in range(rounds):
            for name, f in fns.items():
                t0, w0 = time.thread_time(), time.perf_counter()
                for _ in range(calls):
                    f()
                best[name] = min(best[name], (time.thread_time() - t0) / calls)
                wall[name] = min(wall[name], (time.perf_counter() - w0) / calls)
    base, wbase = (
        best["torch F.scaled_dot_product_attention"],
        wall["torch F.scaled_dot_product_attention"],
    )
    print(
        f"T={T} fp32 causal forward, B=1, H={H}, D={D}, 1 thread; min over {rounds} "
        f"interleaved rounds of {calls} calls; loadavg {os.getloadavg()[0]:.2f}"
    )
    print(f"{'':<38} {'thread CPU time':>30}   {'wall clock':>28}")
    for name, t in best.items():
        w = wall[name]
        print(
            f"{name:<38} {t * 1e6:7.1f} us (+{(t - base) * 1e6:5.1f}, {t / base:.3f}x)   "
            f"{w * 1e6:7.1f} us (+{(w - wbase) * 1e6:5.1f}, {w / wbase:.3f}x)"
        )
    from attnlab.backends import explain_dispatch as explain

    exp = explain(q, k, v, is_causal=True)
    print(f"auto chose {exp.chosen}; decided by {exp.decided_by}")


if __name__ == "__main__":
    main()
