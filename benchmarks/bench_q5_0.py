"""q5_0's one-row product against q8_0's on the same Q5_0 weights, both attnlab's native kernels.

A GGUF file's Q5_0 tensors (Gemma 3 270M's Q4_K_M file holds 63M of its 88M layer weights
so: width 640 is not a multiple of the K-quants' 256) are held by
:class:`attnlab.quant.Q5Linear` as stored, 22 bytes per 32 weights (0.6875 bytes a weight,
``attnlab/native/q5_0.h``), where :class:`attnlab.quant.Q8Linear` would hold them as 8-bit
codes with a float16 scale per 32 (1.0625 bytes, ``attnlab/native/q8_0.h``). This times
both kernels on one bf16 row of the same weights (gguf-py's Q5_0 of a Gaussian weight; q8_0
holds its values to 8 bits) for Gemma 3's products of Q5_0 shape, interleaved in one process
at each thread count: the best of ``--repeats`` rounds for each, so that a busy shared machine
slows both alike.

    PYTHONPATH=src python benchmarks/bench_q5_0.py --threads 2 1
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np
import torch
from _quiet import call_run, timed_pairs
from _records import Recorder

from attnlab import native
from attnlab.quant import Q5Linear, Q8Linear

# Gemma 3 270M (hidden 640, MLP 2048): an MLP gate or up projection, the down projection's
# shape, and the gate and up fused as the decode step runs them.
SHAPES = {
    "2048x640": (2048, 640),
    "640x2048": (640, 2048),
    "gate_up 4096x640": (4096, 640),
}
PEER = "q8_0 (attnlab's native Q8_0 kernel, the same weights as 8-bit codes)"


def _gguf_q5_0(N: int, K: int) -> torch.Tensor:
    """gguf-py's Q5_0 blocks of a Gaussian (N, K) weight, (N, K/32 * 22) uint8."""
    import gguf.quants as gquants

    w = (np.random.default_rng(N + K).standard_normal((N, K)) * 0.02).astype(np.float32)
    raw = gquants.quantize(w, gquants.GGMLQuantizationType.Q5_0)
    return torch.from_numpy(np.ascontiguousarray(raw).reshape(N, -1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    ext = native.extension()
    if ext is None:
        raise SystemExit(f"the native build is unavailable: {native.why_not_native()}")
    recorder = Recorder(
        benchmark="bench_q5_0",
        config="gemma3-shapes-rows1",
        measured=(
            "one bf16 row times a Q5_0 weight held as q5_0 (its blocks, 0.6875 bytes a "
            "weight) against the same weight's values as q8_0 (1.0625 bytes a weight), both "
            "by attnlab's native kernels; interleaved (_quiet.timed_pairs); best of the quiet "
            "rounds, microseconds a call"
        ),
        threads=max(args.threads),
    )
    for label, (N, K) in SHAPES.items():
        q5 = Q5Linear(_gguf_q5_0(N, K))
        q8 = Q8Linear.from_float(q5.weight)
        x = torch.randn(1, K, generator=torch.Generator().manual_seed(0)).bfloat16()
        kernels: dict[str, Callable[[], object]] = {
            "q5_0": lambda q5=q5, x=x: ext.q5_0_mm(x, q5.blocks),
            "q8_0": lambda q8=q8, x=x: ext.q8_0_mm(x, q8.codes, q8.scales),
        }
        for threads in args.threads:
            torch.set_num_threads(threads)
            runs = {name: call_run(fn, 0.02) for name, fn in kernels.items()}
            res = timed_pairs({name: run for name, (run, _) in runs.items()}, args.repeats)
            best = {name: res.best[name] / calls for name, (_, calls) in runs.items()}
            us = {name: 1e6 * t for name, t in best.items()}
            gbs = {"q5_0": N * K * 0.6875 / best["q5_0"] / 1e9}
            gbs["q8_0"] = N * K * 1.0625 / best["q8_0"] / 1e9
            print(
                f"{label:>18} threads={threads}: q5_0 {us['q5_0']:7.1f} us ({gbs['q5_0']:5.1f} "
                f"GB/s)  q8_0 {us['q8_0']:7.1f} us ({gbs['q8_0']:5.1f} GB/s)  "
                f"q5_0/q8_0 {best['q5_0'] / best['q8_0']:.2f}"
            )
            recorder.add(
                f"{label}, {threads} thread(s)",
                us["q5_0"],
                "us",
                peer=PEER,
                peer_value=us["q8_0"],
                better="lower",
                note=f"q5_0 {gbs['q5_0']:.1f} GB/s of blocks, q8_0 {gbs['q8_0']:.1f} GB/s",
            )
    recorder.write()


if __name__ == "__main__":
    main()
