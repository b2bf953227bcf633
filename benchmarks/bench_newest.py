"""Chunked attention and a mixture-of-experts layer against what they replace.

- Chunked attention (Llama 4): ``blockwise`` with ``ChunkedMask(chunk)`` against the same
  backend with a plain causal mask, forward in fp32, B=1, H=4, D=64 (the issue's target:
  at most 0.2x at T=8192, chunks of 1024).
- Mixture of experts at one token: ``MixtureOfExperts`` (E experts, top k, width F)
  against a dense gated MLP of width ``k*F`` (the same active parameters; the target: at
  most 1.3x).

Both pairs run interleaved (``_quiet.timed_pairs``: the best time over pairs during which
other processes used little CPU), with 2 threads. Printed: the times and the ratios, and
how many pairs were quiet.

Usage::

    python benchmarks/bench_newest.py --seq-len 8192 --chunk 1024
"""

from __future__ import annotations

import argparse

import torch
from _quiet import timed_pairs

from attnlab import CausalMask, ChunkedMask, scaled_dot_product_attention
from attnlab.models.decoder import MLP
from attnlab.models.moe import MixtureOfExperts, MoEConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--width", type=int, default=1024, help="MoE: model width C")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert-size", type=int, default=1408)
    args = parser.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    T = args.seq_len
    q, k, v = (torch.randn(1, 4, T, 64) for _ in range(3))
    with torch.no_grad():
        res = timed_pairs(
            {
                "chunked": lambda: scaled_dot_product_attention(
                    q, k, v, ChunkedMask(args.chunk), backend="blockwise"
                ),
                "causal": lambda: scaled_dot_product_attention(
                    q, k, v, CausalMask(), backend="blockwise"
                ),
            },
            args.pairs,
        )
    t = res.best
    print(
        f"blockwise fp32 forward, T={T}, chunks of {args.chunk}: chunked {t['chunked'] * 1e3:.1f}"
        f" ms, causal {t['causal'] * 1e3:.1f} ms: ratio {t['chunked'] / t['causal']:.3f} "
        f"({res.quiet_pairs} of {res.pairs} pairs quiet)"
    )
    C, E, K, F = args.width, args.experts, args.top_k, args.expert_size
    moe = MixtureOfExperts(C, MoEConfig(E, K, F))
    dense = MLP(C, K * F, gated=True, activation="silu", bias=False)
    x = torch.randn(1, 1, C)

    def repeat(fn: MLP | MixtureOfExperts) -> None:
        for _ in range(50):
            fn(x)

    with torch.no_grad():
        res = timed_pairs({"moe": lambda: repeat(moe), "dense": lambda: repeat(dense)}, 20)
    t = res.best
    print(
        f"one token, C={C}: experts (E={E}, k={K}, F={F}) {t['moe'] / 50 * 1e6:.0f} us, dense "
        f"gated MLP (F={K * F}) {t['dense'] / 50 * 1e6:.0f} us: ratio "
        f"{t['moe'] / t['dense']:.2f} ({res.quiet_pairs} of {res.pairs} pairs quiet)"
    )


if __name__ == "__main__":
    main()
