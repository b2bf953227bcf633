"""Does ``torch.compile`` of the decode step pay for itself within one ``generate`` call?

Times SmolLM2's fast decode step eagerly and compiled (``torch.compile(plan.step,
dynamic=True)``: the cache length grows every step, so shapes are marked dynamic rather
than recompiled per position), interleaved after the compile, and prints the compile
time (the first compiled call), the per-token gain and the number of tokens after which
compiling would have paid off, against a 128-token generation. If inductor cannot run
here (no C++ compiler, an unsupported op), it prints the one-line reason and exits 0:
compiling is never required.

    PYTHONPATH=src python benchmarks/bench_compile_step.py --threads 1 --steps 20
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from _quiet import timed_pairs

from attnlab.models.fast_decode import decode_plan
from attnlab.pretrained import load_pretrained


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--mode", default=None, help="torch.compile mode (default: inductor's)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_pretrained("smollm2-135m-instruct", dtype=args.dtype)
    plan = decode_plan(model)
    ids = torch.randint(0, 49152, (1, 64), generator=torch.Generator().manual_seed(0))
    nxt = torch.tensor([[5]])
    n = args.steps
    with torch.no_grad():
        eager_cache = model.new_kv_cache(max_len=64 + 3 * n + 8)
        compiled_cache = model.new_kv_cache(max_len=64 + 3 * n + 8)
        model(ids, kv_cache=eager_cache, logits_to_keep=1)
        model(ids, kv_cache=compiled_cache, logits_to_keep=1)
        compiled = torch.compile(plan.step, dynamic=True, mode=args.mode)
        t0 = time.perf_counter()
        try:
            first = compiled(nxt, compiled_cache)
        except Exception as e:  # inductor missing a compiler, or an op it cannot take
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            print(f"torch.compile of the decode step does not run here: {reason[:200]}")
            return
        t_compile = time.perf_counter() - t0
        expected = plan.step(nxt, eager_cache)
        err = (first - expected).abs().max().item()
        # A second compiled call at the next length: a recompile would show here.
        t0 = time.perf_counter()
        compiled(nxt, compiled_cache)
        t_second = time.perf_counter() - t0
        plan.step(nxt, eager_cache)
        res = timed_pairs(
            {
                "eager": lambda: plan.step(nxt, eager_cache),
                "compiled": lambda: compiled(nxt, compiled_cache),
            },
            n,
        )
    eager, comp = (res.median(k) for k in ("eager", "compiled"))
    gain = eager - comp
    print(
        f"threads {torch.get_num_threads()}, loadavg {os.getloadavg()[0]:.2f}; SmolLM2 "
        f"{args.dtype} decode step, median of {n} interleaved steps ({res.quietness()})"
    )
    print(f"  first compiled call (compile): {t_compile:7.1f} s; second call {t_second:.3f} s")
    print(f"  eager    {eager * 1e3:7.2f} ms/step")
    print(f"  compiled {comp * 1e3:7.2f} ms/step  ({eager / comp:.2f}x eager)")
    print(f"  max |logit difference| at the first step: {err:.2e}")
    if gain > 0:
        print(
            f"  pays for itself after {t_compile / gain:,.0f} tokens "
            f"(a 128-token generate saves {128 * gain:.2f} s against {t_compile:.1f} s)"
        )
    else:
        print("  never pays for itself: the compiled step is not faster")
    print(f"loadavg after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
