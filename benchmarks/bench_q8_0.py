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

With ``--baseline FOLDER`` (the build folder of another attnlab's native module, e.g. one
under ``~/.cache/attnlab/native/`` built before a kernel change) that module's ``q8_0_mm``
runs too, on the same codes and row: the kernel before and after. ``--shape N K``
(repeatable) times those shapes instead of Gemma's, and ``ATTNLAB_NATIVE_MARCH`` picks the
build (``x86-64-v3``: the AVX2 kernel on any machine that runs it; the baseline folder must
be a build of the same ``-march``).

    PYTHONPATH=src python benchmarks/bench_q8_0.py --threads 2 1
    PYTHONPATH=src python benchmarks/bench_q8_0.py --threads 1 --rows 16
    PYTHONPATH=src python benchmarks/bench_q8_0.py --threads 1 --shape 262144 640 \
        --shape 1536 576 --baseline ~/.cache/attnlab/native/<folder> --no-halves
"""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
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
    "baseline": "the --baseline build's q8_0_mm",
}


def _baseline(folder: Path) -> ModuleType:
    """The native module built in ``folder`` (its ``attnlab_native_*.so``)."""
    found = sorted(folder.expanduser().glob("attnlab_native_*.so"))
    if not found:
        raise SystemExit(f"no attnlab_native_*.so in {folder}")
    spec = importlib.util.spec_from_file_location(found[0].stem, found[0])
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {found[0]}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _dense(layer: Q8Linear, x: torch.Tensor) -> torch.Tensor:
    """The layer's prompt path whatever the rows."""
    saved = layer.dense_from_tokens
    layer.dense_from_tokens = 1
    try:
        return layer.product(x)
    finally:
        layer.dense_from_tokens = saved


def _kernels(
    ext: Any, layer: Q8Linear, x: torch.Tensor, baseline: Any | None, halves: bool
) -> dict[str, Callable[[], object]]:
    """The native kernel, the int4 halves, the baseline build's kernel and (several rows)
    the dense product, on ``x``."""
    codes, scales, n = layer.codes, layer.scales, layer.out_features
    kernels: dict[str, Callable[[], object]] = {"native": lambda: ext.q8_0_mm(x, codes, scales)}
    if halves:
        int4 = layer._halves().decode_kernel()

        def summed() -> torch.Tensor:
            both = int4(x)  # (M, 2N)
            return both[:, :n] + both[:, n:]

        kernels["halves"] = summed
    if baseline is not None:
        kernels["baseline"] = lambda: baseline.q8_0_mm(x, codes, scales)
    if x.shape[0] > 1:  # the prompt path: the weight dequantised to bf16, then mm
        kernels["dense"] = lambda: _dense(layer, x)
    return kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--shape", type=int, nargs=2, action="append", metavar=("N", "K"),
        help="a weight shape to time (repeatable); default Gemma 3 270M's",
    )  # fmt: skip
    parser.add_argument("--baseline", type=Path, help="another native build's folder")
    parser.add_argument("--no-halves", action="store_true", help="skip the int4 halves")
    args = parser.parse_args()
    ext = native.extension()
    if ext is None:
        raise SystemExit(f"the native build is unavailable: {native.why_not_native()}")
    baseline = _baseline(args.baseline) if args.baseline is not None else None
    shapes = {f"{n}x{k}": (n, k) for n, k in args.shape} if args.shape else SHAPES
    config = f"gemma3-shapes-rows{args.rows}" if not args.shape else f"shapes-rows{args.rows}"
    if baseline is not None:
        config += f"-vs-baseline-{getattr(ext, 'SIMD', 'unknown')}"
    recorder = Recorder(
        benchmark="bench_q8_0",
        config=config,
        measured=(
            f"q8_0 product of {args.rows} bf16 row(s) by attnlab's native kernel against "
            "the int4-halves path (PyTorch's int4 kernel, 2N rows) and, for several rows, "
            "the dense product of the dequantised weight (with --baseline, another "
            "build's q8_0_mm); same codes, interleaved "
            "(_quiet.timed_pairs); best of the quiet rounds, microseconds a call"
        ),
        threads=max(args.threads),
    )
    torch.manual_seed(0)
    for label, (N, K) in shapes.items():
        layer = Q8Linear.from_float(torch.randn(N, K) * 0.02)
        x = torch.randn(args.rows, K).bfloat16()
        kernels = _kernels(ext, layer, x, baseline, not args.no_halves)
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
