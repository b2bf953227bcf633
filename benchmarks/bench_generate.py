"""Generation with the KV cache against without: gpt2-124m preset (random init), greedy.

With the cache the 256-token prompt is encoded once and each new token is one step over the
cache; without it every new token re-encodes the whole (growing) window.

The cached side is measured two ways in interleaved pairs (``benchmarks/_quiet.py``: only
pairs during which other processes used under a quarter of a core count, and the run
says how quiet it was): the path before issue 14 (growing ``KVCache``, every layer's
modules per token) and the static cache with the fused one-token step
(``attnlab.models.fast_decode``), in each weight precision of ``--dtypes``.

    PYTHONPATH=src python benchmarks/bench_generate.py [--prompt 256] [--new 256] [--threads 2]
    PYTHONPATH=src python benchmarks/bench_generate.py --dtypes float32,bfloat16,int8,int4

By default the uncached side is *sampled*: it times the uncached forward at ``--samples``
evenly spaced window lengths and integrates over all ``--new`` steps (trapezoid rule), because
256 full uncached steps of a 124M model take many minutes on 2 CPU cores; ``--full`` runs every
step instead. The cached side always runs all steps. Both use the same model and prompt, and
``--check N`` verifies that the first N tokens are identical.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import time
from typing import Any

import torch
from _quiet import timed_pairs
from _records import Recorder

from attnlab.generation import generate
from attnlab.models.gpt import GPTConfig, GPTModel
from attnlab.quant import quantize_model


class GrowingCache:
    """``model`` as generation saw it before issue 14: a growing KVCache (no ``max_len``),
    so every token runs through the layers' modules."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.context_length = model.context_length

    def forward(
        self, input_ids: torch.Tensor, *, kv_cache: Any = None, logits_to_keep: int | None = None
    ) -> torch.Tensor:
        return self.model(input_ids, kv_cache=kv_cache, logits_to_keep=logits_to_keep)

    __call__ = forward

    def new_kv_cache(self) -> Any:
        return self.model.new_kv_cache()


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt2-124m")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--check", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtypes", default="float32", help="comma-separated weight precisions")
    ap.add_argument("--reps", type=int, default=3, help="timed pairs of the cached paths")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rec = Recorder(
        "bench_generate",
        args.preset,
        f"{args.preset} (random init), greedy generation of {args.new} tokens after a "
        f"{args.prompt}-token prompt: the fast one-token step per weight precision against the "
        "module path over a growing cache, and the cached path against no cache",
        args.threads,
    )
    torch.manual_seed(123)
    cfg = GPTConfig.preset(args.preset)
    model = GPTModel(cfg).eval()
    prompt = torch.randint(0, cfg.vocab_size, (1, args.prompt))

    if args.check:
        a = generate(model, prompt, args.check, use_cache=True)
        b = generate(model, prompt, args.check, use_cache=False)
        assert torch.equal(a, b), "cached and uncached greedy tokens differ"

    before = GrowingCache(model)
    dtypes = args.dtypes.split(",")
    models = {d: quantize_model(copy.deepcopy(model), d) for d in dtypes}
    fns: dict[str, Any] = {"before": lambda: generate(before, prompt, args.new)}
    for d in dtypes:
        fns[d] = lambda m=models[d]: generate(m, prompt, args.new)
    same = torch.equal(generate(before, prompt, 16), generate(models[dtypes[0]], prompt, 16))
    res = timed_pairs(fns, args.reps)
    cached = res.best[dtypes[0]]

    if args.full:
        t0 = time.perf_counter()
        generate(model, prompt, args.new, use_cache=False)
        uncached = time.perf_counter() - t0
        how = f"all {args.new} steps"
    else:
        # Step i (0-based) of the uncached loop feeds a window of prompt + i tokens.
        steps = torch.linspace(0, args.new - 1, args.samples).round().long().unique().tolist()
        per_step = []
        for i in steps:
            x = torch.randint(0, cfg.vocab_size, (1, min(args.prompt + i, cfg.context_length)))
            model(x)  # warm
            t0 = time.perf_counter()
            model(x)
            per_step.append(time.perf_counter() - t0)
        # Trapezoid rule over the step index, plus the first step itself: `new` steps in all.
        pts = list(zip(steps, per_step, strict=True))
        uncached = per_step[0] + sum(
            (i1 - i0) * (ta + tb) / 2 for (i0, ta), (i1, tb) in itertools.pairwise(pts)
        )
        how = f"{len(steps)} window lengths timed, {args.new} steps integrated"
    print(
        f"{args.preset}: prompt {args.prompt} tokens, {args.new} new tokens, greedy, "
        f"{args.threads} threads"
    )
    print(f"  cached pairs: {res.quietness()}")
    t_before = res.best["before"]
    print(
        f"  with KV cache, before issue 14 (growing cache, module path): {t_before:8.2f} s  "
        f"({args.new / t_before:6.1f} tokens/s)"
    )
    for d in dtypes:
        t = res.best[d]
        print(
            f"  with static cache + fast step, {d:9s}: {t:8.2f} s  ({args.new / t:6.1f} "
            f"tokens/s)  {t_before / t:5.2f}x before (target >= 2x)"
        )
    print(f"  first 16 tokens equal ({dtypes[0]} fast step vs before): {same}")
    print(f"  with KV cache   : {cached:8.2f} s  ({args.new / cached:6.1f} tokens/s, {dtypes[0]})")
    print(f"  without cache   : {uncached:8.2f} s  ({args.new / uncached:6.1f} tokens/s; {how})")
    print(f"speed-up with cache: {uncached / cached:.1f}x  (target >= 5x)")
    for d in dtypes:
        rec.add(
            f"fast step, {d} weights",
            args.new / res.best[d],
            "tokens/s",
            peer="module path, growing cache (fp32)",
            peer_value=args.new / t_before,
        )
    rec.add(
        f"with KV cache ({dtypes[0]})",
        args.new / cached,
        "tokens/s",
        peer=f"without cache ({how})",
        peer_value=args.new / uncached,
    )
    rec.note(f"cached pairs: {res.quietness()}")
    rec.note(f"first 16 tokens equal ({dtypes[0]} fast step vs module path): {same}")
    rec.write()


if __name__ == "__main__":
    main()
