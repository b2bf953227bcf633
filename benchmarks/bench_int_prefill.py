"""Where the int layers should leave their one-row kernels for dequantise + bf16 ``mm``.

For SmolLM2-135M's four product shapes (fused QKV 960x576, output 576x576, fused gate/up
3072x576, down 576x1536) and M rows of input, times one layer's forward both ways,
interleaved (order reversed every round), and prints the median per side summed over the
four shapes, their ratio, and the smallest M from which dequantising wins: the
``dense_from_tokens`` of :class:`attnlab.quant.Int8Linear` / :class:`~attnlab.quant.Int4Linear`.

    PYTHONPATH=src python benchmarks/bench_int_prefill.py --threads 1 --rounds 15
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from _records import Recorder

from attnlab.quant import Int4Linear, Int8Linear

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (N, K)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128,256,512")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rec = Recorder(
        "bench_int_prefill",
        "smollm2-shapes",
        "the four SmolLM2 product shapes through Int8Linear / Int4Linear: the int kernel "
        "against dequantising to bf16 and one mm, per number of rows M (median of "
        f"{args.rounds} interleaved rounds)",
        args.threads,
    )
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=g) * 0.02 for n, k in SHAPES]
    print(
        f"threads {torch.get_num_threads()}, loadavg {os.getloadavg()[0]:.2f}; ms per forward of "
        "the four SmolLM2 shapes, median of interleaved rounds"
    )
    for cls in (Int8Linear, Int4Linear):
        layers = [cls.from_float(w) for w in weights]
        print(f"{cls.__name__} (dense_from_tokens now {cls.dense_from_tokens})")
        print(f"  {'M':>4} {'int kernel':>11} {'dequant+mm':>11} {'kernel/dense':>13}")
        crossover = None
        for m in [int(r) for r in args.rows.split(",")]:
            xs = [torch.randn(m, k, generator=g) for _, k in SHAPES]
            times: dict[str, list[float]] = {"kernel": [], "dense": []}
            for i in range(args.rounds + 1):
                sides = ["kernel", "dense"] if i % 2 == 0 else ["dense", "kernel"]
                for side in sides:
                    t = 0.0
                    for layer, x in zip(layers, xs, strict=True):
                        layer.dense_from_tokens = 1 if side == "dense" else 1 << 30
                        t0 = time.perf_counter()
                        layer(x)
                        t += time.perf_counter() - t0
                    if i:  # the first round warms up
                        times[side].append(t)
            k, d = (statistics.median(times[s]) * 1e3 for s in ("kernel", "dense"))
            if crossover is None and d < k:
                crossover = m
            print(f"  {m:4d} {k:11.3f} {d:11.3f} {k / d:12.2f}x")
            rec.add(f"{cls.__name__} dequantise + mm, M={m}", d, "ms", peer="int kernel",
                    peer_value=k, better="lower")  # fmt: skip
        print(f"  dequantising wins from M = {crossover}")
        rec.note(f"{cls.__name__}: dequantising wins from M = {crossover}")
    print(f"loadavg after: {os.getloadavg()[0]:.2f}")
    rec.write()


if __name__ == "__main__":
    main()
