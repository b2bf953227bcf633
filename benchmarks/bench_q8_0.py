"""q8_0's one-row product: attnlab's native kernel against the int4-halves path.

:class:`attnlab.quant.Q8Linear` runs a few rows by attnlab's own kernel
(``attnlab/native/q8_0.h``: int8 codes and per-32 float16 scales, 1.0625 bytes a weight)
and, where the native build is unavailable, by PyTorch's int4 kernel on the codes' two
4-bit halves (2N rows, 1.25 bytes a weight, the halves summed). This times both on the
same layer, one bf16 row (``--rows``), for Gemma 3 270M's shapes (its fused Q/K/V,
attention output, fused gate/up and down products, and the 262144 x 640 output head),
interleaved in one process at each thread count: the best of ``--repeats`` rounds of
calls for each, so that a busy shared machine slows both alike. With ``--rows`` above one
the dense product (the weight dequantised to bf16, then ``mm``: the prompt path) runs too:
where it overtakes the native kernel is ``Q8Linear.dense_from_tokens``.

    PYTHONPATH=src python benchmarks/bench_q8_0.py --threads 2 1
    PYTHONPATH=src python benchmarks/bench_q8_0.py --threads 1 --rows 16
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
from _quiet import call_run, timed_pairs
from _records import Recorder

from attnlab import native
from attnlab.quant import Q8Linear

# Gemma 3 270M (hidden 640, 4 query heads and 1 key/value head of 256, MLP 2048, vocab
# 262144): its products as the decode step runs them.
SHAPES = {
    "qkv 1536x640": (1536, 640),
    "out 640x1024": (640, 1024),
    "gate_up 4096x640": (4096, 640),
    "down 640x2048": (640, 2048),
    "head 262144x640": (262144, 640),
}


PEERS = {
    "halves": "int4 halves (PyTorch's int4 kernel, 2N rows)",
    "dense": "dense (dequantised to bf16, then mm)",
}


def _dense(layer: Q8Linear, x: torch.Tensor) -> torch.Tensor:
    """The layer's prompt path whatever the rows."""
    saved = layer.dense_from_tokens
    layer.dense_from_tokens = 1
    try:
        return layer.product(x)
    finally:
        layer.dense_from_tokens = saved


def _kernels(ext: Any, layer: Q8Linear, x: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The native kernel, the int4 halves and (several rows) the dense product, on ``x``."""
    codes, scales, n = layer.codes, layer.scales, layer.out_features
    halves = layer._halves().decode_kernel()

    def summed() -> torch.Tensor:
        both = halves(x)  # (M, 2N)
        return both[:, :n] + both[:, n:]

    kernels: dict[str, Callable[[], object]] = {
        "native": lambda: ext.q8_0_mm(x, codes, scales),
        "halves": summed,
    }
    if x.shape[0] > 1:  # the prompt path: the weight dequantised to bf16, then mm
        kernels["dense"] = lambda: _dense(layer, x)
    return kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    ext = native.extension()
    if ext is None:
        raise SystemExit(f"the native build is unavailable: {native.why_not_native()}")
    recorder = Recorder(
        benchmark="bench_q8_0",
        config=f"gemma3-shapes-rows{args.rows}",
        measured=(
            f"q8_0 product of {args.rows} bf16 row(s) by attnlab's native kernel against "
            "the int4-halves path (PyTorch's int4 kernel, 2N rows) and, for several rows, "
            "the dense product of the dequantised weight; same codes, interleaved "
            "(_quiet.timed_pairs); best of the quiet rounds, microseconds a call"
        ),
        threads=max(args.threads),
    )
    torch.manual_seed(0)
    for label, (N, K) in SHAPES.items():
        layer = Q8Linear.from_float(torch.randn(N, K) * 0.02)
        x = torch.randn(args.rows, K).bfloat16()
        kernels = _kernels(ext, layer, x)
        seconds = 0.05 if N * K < 10**7 else 0.3
        for threads in args.threads:
            torch.set_num_threads(threads)
            runs = {name: call_run(fn, seconds) for name, fn in kernels.items()}
            res = timed_pairs({name: run for name, (run, _) in runs.items()}, args.repeats)
            best = {name: res.best[name] / calls for name, (_, calls) in runs.items()}
            us = {name: 1e6 * t for name, t in best.items()}
            gbs = N * K * 1.0625 / best["native"] / 1e9
            print(
                f"{label:>18} threads={threads}: native {us['native']:8.1f} us "
                f"({gbs:5.1f} GB/s)  "
                + "  ".join(
                    f"{name} {us[name]:8.1f} us (x{best[name] / best['native']:.2f})"
                    for name in kernels
                    if name != "native"
                )
            )
            for name in kernels:
                if name == "native":
                    continue
                recorder.add(
                    f"{label}, {threads} thread(s), against {name}",
                    us["native"],
                    "us",
                    peer=PEERS[name],
                    peer_value=us[name],
                    better="lower",
                    note=f"native {gbs:.1f} GB/s of codes and scales",
                )
    recorder.write()


if __name__ == "__main__":
    main()
