"""Is the fp32 decode step memory-bandwidth bound? Bytes of weights per token over step time.

Loads SmolLM2-135M (fp32 by default), counts the bytes of every weight one decode step
reads (the fused products, the norms, the output head and one embedding row), times the
step (median of ``--steps`` after a 64-token prompt) and prints the achieved GB/s beside
the machine's streaming bandwidth measured in the same process with the same threads:

- ``F.linear`` of one row on an fp32 matrix of the size of one token's weights, stored
  row-major (N, K) and column-major (:func:`attnlab.quant.column_major`, what the loaded
  model uses): the same operation with no model around it;
- ``sum`` of that matrix (read only) and ``copy_`` of it (read + write, both counted).

Then a ``torch.profiler`` table of one step: where its time goes, products vs the rest.

    PYTHONPATH=src python benchmarks/bench_decode_bandwidth.py --threads 2
    PYTHONPATH=src python benchmarks/bench_decode_bandwidth.py --threads 1 --dtype int4
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from attnlab.models.fast_decode import decode_plan
from attnlab.pretrained import load_pretrained


def _median_s(fn: Callable[[], object], n: int) -> float:
    """The median of ``n`` timed calls, or their best with ``--best`` (a shared machine)."""
    fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts) if BEST else statistics.median(ts)


BEST = False


_WEIGHTS = (
    "weight",
    "weight_bf16",
    "qweight",
    "codes",
    "scales",
    "packed",
    "scales_and_zeros",
    "bias",
)


def step_bytes(model: nn.Module) -> int:
    """Bytes of the weights one decode step reads: each layer's products (fused ones once),
    the output head, one embedding row (norm weights, ~0.1 MB, left out)."""
    plan = decode_plan(model)
    total = 0

    def add(module: object) -> None:
        nonlocal total
        for name in _WEIGHTS:
            if isinstance(getattr(type(module), name, None), property):
                continue  # the int layers' `weight`: dequantised on the fly, not read
            t = getattr(module, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()

    for layer in plan.layers:
        for m in [layer.qkv] if layer.qkv is not None else [layer.q, layer.k, layer.v]:
            add(m)
        add(layer.out)
        gate_up = [layer.gate_up] if layer.gate_up is not None else [layer.gate, layer.up]
        for m in [*gate_up, layer.down]:
            add(m)
    add(getattr(model, "lm_head", None) or getattr(model, "out_head", None))
    emb = plan.parts.embedding.weight
    return total + emb.shape[1] * emb.element_size()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument(
        "--best", action="store_true", help="best instead of median (while others hold cores)"
    )
    args = parser.parse_args()
    global BEST
    BEST = args.best
    torch.set_num_threads(args.threads)
    model, _ = load_pretrained("smollm2-135m-instruct", dtype=args.dtype)
    nbytes = step_bytes(model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 49152, (1, 64), generator=g)
    nxt = torch.tensor([[5]])
    with torch.no_grad():
        cache = model.new_kv_cache(max_len=64 + args.steps + 8)

        def step() -> None:
            model(nxt, kv_cache=cache, logits_to_keep=1)

        model(ids, kv_cache=cache, logits_to_keep=1)
        t_step = _median_s(step, args.steps)
        # The machine: the same bytes as one fp32 matrix (K = 576 like the model's rows).
        k = 576
        w = torch.randn(max(nbytes // (4 * k), 1), k, generator=g)
        x = torch.randn(1, k, generator=g)
        dst = torch.empty_like(w)
        t_row = _median_s(lambda: nn.functional.linear(x, w), 15)
        wc = w.t().contiguous().t()  # the same matrix column-major (quant.column_major)
        t_col = _median_s(lambda: nn.functional.linear(x, wc), 15)
        t_sum = _median_s(lambda: w.sum(), 15)
        t_copy = _median_s(lambda: dst.copy_(w), 15)
    gb = 1e-9
    mb = w.numel() * 4
    print(
        f"threads {torch.get_num_threads()}, loadavg {os.getloadavg()[0]:.2f}; SmolLM2 "
        f"{args.dtype} decode step reads {nbytes / 1e6:.0f} MB of weights; "
        f"{'best' if BEST else 'median'} of timed calls"
    )
    rows = [
        ("decode step", t_step, nbytes),
        (f"F.linear, 1 row, {mb / 1e6:.0f} MB, row-major", t_row, mb),
        (f"F.linear, 1 row, {mb / 1e6:.0f} MB, column-major", t_col, mb),
        ("sum (read)", t_sum, mb),
        ("copy_ (read + write)", t_copy, 2 * mb),
    ]
    for name, t, n in rows:
        print(f"  {name:40s} {t * 1e3:7.2f} ms  {n / t * gb:6.1f} GB/s")
    print(f"  step / column-major F.linear of the same bytes: {t_step / t_col:.2f}x")

    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14)
    print("One decode step, torch.profiler, sorted by self CPU time:")
    print(table)
    print(f"loadavg after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
