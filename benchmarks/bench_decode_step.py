"""Where one decode step's time goes: its products against everything around them.

On SmolLM2-135M-Instruct (the packaged Q4_1 file) or the Gemma 3 270M Q4_K_M file
(``--model gemma3-270m``, found as ``bench_llama_cpp.py`` finds it).

For each weight precision, one new token after a 64-token prompt, three sides timed
interleaved in one process (order reversed every round, the cache cut back to the same
length after each step, so every side runs the same position):

- ``native``: :meth:`DecodePlan.step` as generation runs it where :mod:`attnlab.native`
  is built (the short loop's layers compiled: the same kernels, plain loops between them);
- ``short loop``: the same step in Python, :meth:`DecodePlan._step_short` (both models take
  it: bare kernels, RoPE as one product);
- ``general loop``: the same step with the short loop switched off (the loop every other
  layout takes);
- ``products only``: the step's product kernels alone (every layer's QKV, output, gate/up
  and down, and the output head) on rows of the right width: the floor that no change
  around the products can go under (the weights' bytes over the memory's bandwidth);
- ``head only``: the output head's kernel alone (part of ``products only``).

At a depth (``--depth N``) the cache holds ``N`` positions when each side runs its step:
the prompt's forward writes the first 64 and random keys and values stand for the rest
(what attention costs does not depend on what the keys hold), and every side runs at
position ``N``. The record's config gets ``-depthN``. The cache holds what
``load_pretrained`` gives the precision (float16 for the integer ones); ``--kv-cache
float32`` or ``float16`` chooses, and the config gets ``-kvfloat32`` / ``-kvfloat16``.

Each side is reported as wall time (best and median: on a shared machine the best is the
figure) and as the calling thread's CPU time (``time.thread_time``, best; at one thread
it holds the work of the step whatever else runs, since waiting for a core is not
counted), and its tensor operations per token (``torch.profiler``: the calls made from
Python, and all of them, nested ones included). One record per precision goes to
``benchmarks/results/``.

    PYTHONPATH=src python benchmarks/bench_decode_step.py                  # int4, 2 threads
    PYTHONPATH=src python benchmarks/bench_decode_step.py --threads 1 --dtypes int4,int8
    PYTHONPATH=src python benchmarks/bench_decode_step.py --model gemma3-270m
    PYTHONPATH=src python benchmarks/bench_decode_step.py --depth 4096 --rounds 10
    PYTHONPATH=src python benchmarks/bench_decode_step.py --depth 4096 --kv-cache float32
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _records import Recorder
from bench_llama_cpp import MODELS, find_file
from torch.profiler import profile

from attnlab.models.fast_decode import DecodePlan, decode_plan
from attnlab.native import why_not_native
from attnlab.pretrained import load_pretrained
from attnlab.quant import decode_product

PROMPT = 64
NAMES = {"smollm2-135m-instruct": "SmolLM2-135M-Instruct", "gemma3-270m": "Gemma 3 270M"}
# Record names: SmolLM2's as they were before Gemma 3 was measured too.
TAGS = {"smollm2-135m-instruct": "smollm2", "gemma3-270m": "gemma3-270m"}


def op_counts(fn: Callable[[], object]) -> tuple[int, int]:
    """(operations called from Python, all operations) of one call of ``fn``."""
    with profile() as prof:
        fn()
    events = list(prof.events())
    return sum(1 for e in events if e.cpu_parent is None), len(events)


def _kernel_call(m: Any) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]:
    found = decode_product(m)
    if found is None:
        raise SystemExit(f"bench_decode_step: no bare kernel for {type(m).__name__}")
    dtype, fn = found
    return fn, torch.randn(1, m.in_features).to(dtype)


def products(plan: DecodePlan, model: Any) -> Callable[[], None]:
    """The step's product kernels alone, on rows of the widths they take."""
    calls = []
    for layer in plan.layers:
        qkv = [layer.qkv] if layer.qkv is not None else [layer.q, layer.k, layer.v]
        gate_up = [layer.gate_up] if layer.gate_up is not None else [layer.gate, layer.up]
        for m in (*qkv, layer.out, *gate_up, layer.down):
            found = decode_product(m)
            if found is None:
                raise SystemExit(f"bench_decode_step: no bare kernel for {type(m).__name__}")
            dtype, fn = found
            calls.append((fn, torch.randn(1, m.in_features).to(dtype)))
    calls.append(_kernel_call(model.lm_head))

    def run() -> None:
        for fn, x in calls:
            fn(x)

    return run


def head_only(model: Any) -> Callable[[], None]:
    """The output head's kernel alone."""
    fn, x = _kernel_call(model.lm_head)

    def run() -> None:
        fn(x)

    return run


def fill(cache: list[Any], depth: int) -> None:
    """Random keys and values (float32 normal) from the cache's end up to ``depth``
    positions, as if a prompt of ``depth`` tokens had been read."""
    g = torch.Generator().manual_seed(1)
    for c in cache:
        for t in (c._k, c._v):
            part = t[:, :, c.seq_len : depth]
            part.copy_(torch.randn(part.shape, generator=g, dtype=part.dtype))
        c._len = depth


def bench(dtype: str, args: argparse.Namespace) -> None:
    depth = max(args.depth, PROMPT)
    at = f"after a {PROMPT}-token prompt" if depth == PROMPT else f"at depth {depth}"
    kv = "" if args.kv_cache == "auto" else f"-kv{args.kv_cache}"
    rec = Recorder(
        "bench_decode_step",
        f"{TAGS[args.model]}-{dtype}-t{args.threads}"
        + (f"-depth{depth}" if args.depth else "")
        + kv,
        f"{NAMES[args.model]} ({dtype} weights) one-token decode step {at} at "
        f"{args.threads} threads: the native step, the short loop, the general loop and the "
        f"products alone, {args.rounds} interleaved rounds, the same position every round",
        args.threads,
    )
    model, _ = load_pretrained(find_file(args.model), dtype=dtype, kv_cache_dtype=args.kv_cache)
    ids = torch.randint(0, 49152, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    nxt = torch.tensor([[5]])
    with torch.no_grad():
        cache = model.new_kv_cache(max_len=depth + 8)
        model(ids, kv_cache=cache, logits_to_keep=1)
        fill(cache, depth)
        plan = decode_plan(model)
        rows = plan.rows
        if rows is None:
            raise SystemExit(f"bench_decode_step: {NAMES[args.model]} did not get the short loop")

        def rewind() -> None:
            for c in cache:
                c._len = depth  # the same position every call: equal work

        compiled = plan.native_step()
        if compiled is None:
            raise SystemExit(f"bench_decode_step: no native step: {why_not_native()}")

        def native() -> None:
            plan.step(nxt, cache)
            rewind()

        def short() -> None:
            plan._native = False
            try:
                plan.step(nxt, cache)
            finally:
                plan._native = compiled
            rewind()

        def general() -> None:
            plan.rows = None
            try:
                plan.step(nxt, cache)
            finally:
                plan.rows = rows
            rewind()

        sides: dict[str, Callable[[], None]] = {
            "native": native,
            "short loop": short,
            "general loop": general,
            "products only": products(plan, model),
            "head only": head_only(model),
        }
        ops = {name: op_counts(fn) for name, fn in sides.items()}
        wall: dict[str, list[float]] = {name: [] for name in sides}
        cpu: dict[str, list[float]] = {name: [] for name in sides}
        for fn in sides.values():
            fn()  # warm
        for i in range(args.rounds):
            order = list(sides.items())
            for name, fn in order if i % 2 == 0 else reversed(order):
                c0, t0 = time.thread_time(), time.perf_counter()
                fn()
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.thread_time() - c0)
    print(f"{NAMES[args.model]} {dtype} {at}, {args.threads} threads, {args.rounds} interleaved "
          "rounds")  # fmt: skip
    print(f"  {'side':14s} {'ops (python/all)':>17s} {'wall best':>10s} {'median':>8s} "
          f"{'cpu best':>9s}  (ms per token)")  # fmt: skip
    for name in sides:
        w, med, c = min(wall[name]), statistics.median(wall[name]), min(cpu[name])
        print(f"  {name:14s} {ops[name][0]:8d}/{ops[name][1]:<8d} {w * 1e3:10.2f} "
              f"{med * 1e3:8.2f} {c * 1e3:9.2f}")  # fmt: skip
    base_w, base_c = min(wall["general loop"]), min(cpu["general loop"])
    for name in sides:
        w, c = min(wall[name]), min(cpu[name])
        peer = None if name == "general loop" else "general loop"
        rec.add(f"{name}: wall ms/token (best)", w * 1e3, "ms", better="lower",
                peer=peer, peer_value=None if peer is None else base_w * 1e3,
                note=f"median {statistics.median(wall[name]) * 1e3:.2f} ms")  # fmt: skip
        rec.add(f"{name}: thread CPU ms/token (best)", c * 1e3, "ms", better="lower",
                peer=peer, peer_value=None if peer is None else base_c * 1e3)  # fmt: skip
        rec.add(f"{name}: tensor operations per token", ops[name][1], "operations",
                better="lower", note=f"{ops[name][0]} called from Python")  # fmt: skip
    prod_w, short_w = min(wall["products only"]), min(wall["short loop"])
    native_w = min(wall["native"])
    print(f"  around the products: native {(native_w - prod_w) * 1e3:.2f} ms, short loop "
          f"{(short_w - prod_w) * 1e3:.2f} ms, general loop {(base_w - prod_w) * 1e3:.2f} ms "
          "(wall best)")  # fmt: skip
    rec.note("products only: the step's int4 / int8 / float kernels called back to back on "
             "one row each (the memory-bound floor of the step)")  # fmt: skip
    if args.depth:
        rec.note(f"depth {depth}: the prompt's forward wrote {PROMPT} positions, random "
                 f"normal keys and values the rest")  # fmt: skip
    held = model.kv_cache_dtype or torch.float32
    rec.note(f"the key/value cache holds {str(held).removeprefix('torch.')} "
             f"(--kv-cache {args.kv_cache})")  # fmt: skip
    rec.write(folder=args.results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default=MODELS[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--dtypes", default="int4", help="comma-separated weight precisions")
    parser.add_argument("--depth", type=int, default=0,
                        help=f"positions in the cache at the timed step (default: the "
                             f"{PROMPT}-token prompt's)")  # fmt: skip
    parser.add_argument("--kv-cache", choices=("auto", "float32", "float16"), default="auto",
                        help="what the cache holds (load_pretrained's kv_cache_dtype; a "
                             "setting other than auto goes in the record's config)")  # fmt: skip
    parser.add_argument(
        "--results",
        type=Path,
        default=None,
        help="where the record goes (default benchmarks/results)",
    )
    args = parser.parse_args()
    if args.depth < 0:
        parser.error(f"--depth must be >= 0, got {args.depth}")
    torch.set_num_threads(args.threads)
    for dtype in args.dtypes.split(","):
        bench(dtype, args)


if __name__ == "__main__":
    main()
