"""Chunked attention and a mixture-of-experts layer against what they replace.

- Chunked attention (Llama 4): ``blockwise`` with ``ChunkedMask(chunk)`` against the same
  backend with a plain causal mask, forward in fp32, B=1, H=4, D=64 (the issue's target:
  at most 0.2x at T=8192, chunks of 1024).
- Mixture of experts at one token: ``MixtureOfExperts`` (E experts, top k, width F)
  against a dense gated MLP of width ``k*F`` (the same active parameters; the target: at
  most 1.3x).

Both pairs run interleaved (``_quiet.timed_pairs``: order alternating, the machine's load
read around each pair), with ``--threads`` torch threads (default 2; on a machine other
processes keep busy, 1: a two-thread kernel then waits for its second thread, which
measures the machine, not the kernel). Printed and recorded (``benchmarks/_records.py``,
one record per comparison): the median times over the kept pairs and their ratio, the
median and range of the per-pair ratios (each pair adjacent in time, so a busy machine's
drift cancels), how many pairs were quiet, and the target.

Usage::

    python benchmarks/bench_newest.py --seq-len 8192 --chunk 1024 --threads 1
"""

from __future__ import annotations

import argparse

import torch
from _quiet import PairResult, timed_pairs
from _records import Recorder

from attnlab import CausalMask, ChunkedMask, scaled_dot_product_attention
from attnlab.models.decoder import MLP
from attnlab.models.moe import MixtureOfExperts, MoEConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--pairs", type=int, default=5, help="chunked: interleaved pairs")
    parser.add_argument("--moe-pairs", type=int, default=20, help="MoE: interleaved pairs")
    parser.add_argument("--width", type=int, default=1024, help="MoE: model width C")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert-size", type=int, default=1408)
    parser.add_argument(
        "--threads",
        type=int,
        default=2,
        help="torch threads (1 on a busy machine: two-thread kernels then wait on each other)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    T = args.seq_len
    rec = Recorder(
        "bench_newest",
        f"chunked-T{T}-c{args.chunk}",
        f"chunked attention (Llama 4): the blockwise backend with ChunkedMask({args.chunk}) "
        f"against the same backend with a plain causal mask, forward, fp32, B=1, H=4, T={T}, "
        f"D=64, {args.pairs} interleaved pairs (target: at most 0.2x)",
        args.threads,
    )
    q, k, v = (torch.randn(1, 4, T, 64) for _ in range(3))
    attend = {
        "chunked": lambda: scaled_dot_product_attention(
            q, k, v, ChunkedMask(args.chunk), backend="blockwise"
        ),
        "causal": lambda: scaled_dot_product_attention(q, k, v, CausalMask(), backend="blockwise"),
    }
    with torch.no_grad():
        for fn in attend.values():  # first calls (allocations, lazy set-up) are not timed
            fn()
        res = timed_pairs(attend, args.pairs)
    _report(rec, res, "chunked", "causal", 1e3, "ms", "blockwise, plain causal mask", 0.2)
    line = _line(res, "chunked", "causal")
    print(f"blockwise fp32 forward, T={T}, chunks of {args.chunk}: {line}")

    C, E, K, F = args.width, args.experts, args.top_k, args.expert_size
    rec = Recorder(
        "bench_newest",
        f"moe-one-token-E{E}-k{K}",
        f"a mixture-of-experts layer at one token (C={C}, E={E} experts of width F={F}, "
        f"top {K}, softmax router) against a dense gated MLP of width k*F={K * F} (the same "
        f"active parameters), fp32, 50 calls per timing, {args.moe_pairs} interleaved pairs "
        "(target: at most 1.3x)",
        args.threads,
    )
    moe = MixtureOfExperts(C, MoEConfig(E, K, F))
    dense = MLP(C, K * F, gated=True, activation="silu", bias=False)
    x = torch.randn(1, 1, C)

    def repeat(fn: MLP | MixtureOfExperts) -> None:
        for _ in range(50):
            fn(x)

    with torch.no_grad():
        repeat(moe)  # warm-up, not timed
        repeat(dense)
        res = timed_pairs(
            {"moe": lambda: repeat(moe), "dense": lambda: repeat(dense)}, args.moe_pairs
        )
    _report(rec, res, "moe", "dense", 1e6 / 50, "us", f"dense gated MLP (F={K * F})", 1.3)
    line = _line(res, "moe", "dense", 1e6 / 50, "us per call")
    print(f"one token, C={C}, E={E}, k={K}, F={F}: {line}")


def _line(res: PairResult, a: str, b: str, scale: float = 1e3, unit: str = "ms") -> str:
    med, lo, hi = res.ratio(a, b)
    return (
        f"{a} {res.median(a) * scale:.1f} {unit}, {b} {res.median(b) * scale:.1f} {unit} "
        "(medians): "
        f"per-pair ratio median {med:.3f} (range {lo:.3f}-{hi:.3f}); {res.quietness()}"
    )


def _report(
    rec: Recorder,
    res: PairResult,
    name: str,
    peer: str,
    scale: float,
    unit: str,
    peer_label: str,
    target: float,
) -> None:
    """One figure (median times, ratio) and the per-pair ratios as a note; written."""
    med, lo, hi = res.ratio(name, peer)
    rec.add(
        f"{name} (median over kept pairs)",
        res.median(name) * scale,
        unit,
        peer=peer_label,
        peer_value=res.median(peer) * scale,
        better="lower",
        note=f"target at most {target}x",
    )
    rec.note(
        f"per-pair ratio {name}/{peer}: median {med:.3f}, range {lo:.3f}-{hi:.3f} over "
        f"{len(res.times[name])} kept pairs; target at most {target}x: "
        f"{'met' if med <= target else 'not met'}; {res.quietness()}"
    )
    rec.write()


if __name__ == "__main__":
    main()
