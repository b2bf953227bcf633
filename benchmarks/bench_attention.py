"""Benchmark attnlab's attention backends against PyTorch and the textbook version.

Causal self-attention, B=1, H=12, D=64, fp32, T = 128 .. --max-t, forward (no grad) and
forward + backward. Every implementation runs in the same process, interleaved within
each repetition so that load from other processes hits them alike; the reported time is
the minimum over repetitions. Results are printed as ratios to PyTorch's own
``torch.nn.functional.scaled_dot_product_attention`` (on CPU: its flash-attention kernel).

Peak memory: measured in a separate run of each call with ``torch.profiler``
(``profile_memory=True``), whose records of every allocation and free by PyTorch's CPU
allocator give the peak bytes live at once above what was live before the call (inputs
excluded, outputs and gradients included). See ``attnlab._memory``.

Second table: the production ``attnlab.Attention(backend="auto")`` layer against the same
layer written directly on ``torch.nn.functional.scaled_dot_product_attention``.

Usage::

    python benchmarks/bench_attention.py --max-t 8192 --plot docs/img/attention_benchmark.png

``--variants`` instead measures the attention variants of issue 10 on ``blockwise``
against plain causal ``blockwise`` in the same run (ALiBi, T5 relative bias, softcap,
sinks at T=4096; 8 packed documents of 512; a 512 sliding window at T=8192, also against
PyTorch's kernel given the same mask as a dense tensor)::

    python benchmarks/bench_attention.py --variants --reps 3
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from attnlab._memory import peak_allocated
from attnlab.attention import Attention
from attnlab.functional import scaled_dot_product_attention

H, D = 12, 64


def textbook(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The book's materialised causal attention (scores, -inf mask, softmax, @ V)."""
    T = q.shape[-2]
    scores = q @ k.transpose(-2, -1)  # (B, H, T, T)
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    scores = scores.masked_fill(mask, -torch.inf)
    weights = torch.softmax(scores / math.sqrt(q.shape[-1]), dim=-1)
    return weights @ v


IMPLS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "torch sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    "textbook": textbook,
    "attnlab auto": lambda q, k, v: scaled_dot_product_attention(q, k, v, is_causal=True),
    "attnlab blockwise": lambda q, k, v: scaled_dot_product_attention(
        q, k, v, is_causal=True, backend="blockwise"
    ),
    "attnlab math": lambda q, k, v: scaled_dot_product_attention(
        q, k, v, is_causal=True, backend="math"
    ),
}
MATERIALISED = {"textbook", "attnlab math"}


def make_call(name: str, T: int, backward: bool) -> Callable[[], object]:
    gen = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(1, H, T, D, generator=gen) for _ in range(3))
    grad = torch.randn(1, H, T, D, generator=gen)
    fn = IMPLS[name]
    if not backward:

        def fwd() -> object:
            with torch.no_grad():
                return fn(q, k, v)

        return fwd
    q.requires_grad_()
    k.requires_grad_()
    v.requires_grad_()

    def fwd_bwd() -> object:
        q.grad = k.grad = v.grad = None
        fn(q, k, v).backward(grad)
        return q.grad

    return fwd_bwd


def bench(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Minimum time of each call over interleaved repetitions (at least ``reps``; up to 20
    while a round takes under 3 s): a shared machine's noise only ever adds time, so the
    minimum is the best estimate."""
    one_round = 0.0
    for f in fns.values():  # warm up, and size the repetitions
        t0 = time.perf_counter()
        f()
        one_round += time.perf_counter() - t0
    reps = max(reps, min(20, int(3.0 / max(one_round, 1e-6))))
    best = dict.fromkeys(fns, math.inf)
    for _ in range(reps):
        for name, f in fns.items():
            t0 = time.perf_counter()
            f()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


class DirectLayer(torch.nn.Module):
    """The same layer as attnlab.Attention, calling PyTorch's kernel directly."""

    def __init__(self, layer: Attention) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        L = self.layer
        B, T, C = x.shape
        q = L.W_query(x).view(B, T, H, D).transpose(1, 2)
        k = L.W_key(x).view(B, T, H, D).transpose(1, 2)
        v = L.W_value(x).view(B, T, H, D).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return L.out_proj(out.transpose(1, 2).reshape(B, T, C))


def variant_calls(T: int, backward: bool) -> dict[str, Callable[[], object]]:
    """The issue-10 variants on blockwise (and their peers), causal, B=1, fp32."""
    from attnlab.biases import AlibiBias, RelativePositionBias
    from attnlab.masks import CausalMask, DocumentMask, SlidingWindowMask

    gen = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(1, H, T, D, generator=gen) for _ in range(3))
    grad = torch.randn(1, H, T, D, generator=gen)
    table = torch.randn(32, H, generator=gen) * 0.1
    sinks = torch.zeros(H)
    docs = torch.arange(T // 512).repeat_interleave(512)[None]  # documents of 512 tokens
    if backward:
        for t in (q, k, v, table, sinks):
            t.requires_grad_()
    dense_window = SlidingWindowMask(512).dense(T, T)  # (1, 1, T, T) bool

    def bw(mask: object = None, **kw: object) -> Callable[[], object]:
        return lambda: scaled_dot_product_attention(
            q, k, v, mask, is_causal=mask is None, backend="blockwise", **kw
        )

    fns: dict[str, Callable[[], torch.Tensor]] = {
        "causal": bw(),
        "alibi": bw(AlibiBias(H) & CausalMask()),
        "relbias": bw(RelativePositionBias(table, bidirectional=False) & CausalMask()),
        "softcap": bw(softcap=30.0),
        "sinks": bw(sinks=sinks),
        "documents": bw(DocumentMask(docs) & CausalMask()),
        "window": bw(SlidingWindowMask(512)),
        "torch window": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense_window),
    }

    def run(fn: Callable[[], torch.Tensor]) -> Callable[[], object]:
        if not backward:

            def fwd() -> object:
                with torch.no_grad():
                    return fn()

            return fwd

        def fwd_bwd() -> object:
            for t in (q, k, v, table, sinks):
                t.grad = None
            fn().backward(grad)
            return q.grad

        return fwd_bwd

    return {n: run(f) for n, f in fns.items()}


def bench_variants(reps: int, threads: int) -> None:
    """Ratios of each variant to plain causal blockwise, measured interleaved in one run."""
    targets = {"alibi": 1.3, "relbias": 1.3, "softcap": 1.3, "sinks": 1.3,
               "documents": 0.35, "window": 0.25}  # fmt: skip
    plan = [
        (4096, ["causal", "alibi", "relbias", "softcap", "sinks", "documents"]),
        (8192, ["causal", "window", "torch window"]),
    ]
    print(
        f"blockwise variants, causal, B=1, H={H}, D={D}, fp32, {threads} threads; time = "
        f"min of >= {reps} interleaved runs; ratio = x plain causal blockwise of the same run"
    )
    for mode in ("fwd", "fwd+bwd"):
        print(f"\n== {mode} ==")
        for T, names in plan:
            calls = variant_calls(T, mode == "fwd+bwd")
            times = bench({n: calls[n] for n in names}, reps)
            for n in names:
                ratio = times[n] / times["causal"]
                note = f"  (target <= {targets[n]})" if n in targets else ""
                if n == "window":
                    note += f"; x torch window {times[n] / times['torch window']:.2f} (target < 1)"
                print(f"T={T:>5} {n:<13} {times[n] * 1e3:9.1f} ms {ratio:6.2f}x{note}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--min-t", type=int, default=128)
    ap.add_argument("--max-t", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--materialised-max-t",
        type=int,
        default=4096,
        help="largest T for the O(T^2)-memory implementations",
    )
    ap.add_argument("--no-memory", action="store_true", help="skip the memory runs")
    ap.add_argument("--plot", default=None, help="write a PNG of time and memory vs T")
    ap.add_argument("--json", default=None, help="write the raw numbers as JSON")
    ap.add_argument(
        "--variants", action="store_true", help="measure the attention variants (issue 10) only"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.variants:
        bench_variants(args.reps, args.threads)
        return

    Ts = []
    T = args.min_t
    while args.max_t >= T:
        Ts.append(T)
        T *= 2
    results: dict[str, dict[str, dict[int, dict[str, float]]]] = {"fwd": {}, "fwd+bwd": {}}
    print(
        f"causal attention, B=1, H={H}, D={D}, fp32, {args.threads} threads; time = min of "
        f"{args.reps} interleaved runs; memory = peak bytes allocated by the call "
        "(torch.profiler allocation records)"
    )
    for mode in ("fwd", "fwd+bwd"):
        backward = mode == "fwd+bwd"
        print(f"\n== {mode} ==")
        header = (
            f"{'T':>6} {'impl':<18} {'time ms':>10} {'x torch':>8} {'peak MiB':>10} {'x torch':>8}"
        )
        print(header)
        for T in Ts:
            names = [n for n in IMPLS if n not in MATERIALISED or args.materialised_max_t >= T]
            fns = {n: make_call(n, T, backward) for n in names}
            times = bench(fns, args.reps if T <= 4096 else max(1, args.reps - 1))
            mems = {}
            if not args.no_memory:
                for n in names:
                    mems[n] = peak_allocated(make_call(n, T, backward))[1]
            for n in names:
                row = {"time_s": times[n]}
                if mems:
                    row["peak_bytes"] = mems[n]
                results[mode].setdefault(n, {})[T] = row
                t_ratio = times[n] / times["torch sdpa"]
                mem = (
                    f"{mems[n] / 2**20:10.1f} {mems[n] / max(1, mems['torch sdpa']):8.2f}"
                    if mems
                    else ""
                )
                print(f"{T:>6} {n:<18} {times[n] * 1e3:10.1f} {t_ratio:8.2f} {mem}")
            skipped = [n for n in IMPLS if n not in names]
            if skipped:
                print(f"{T:>6} (skipped {', '.join(skipped)}: O(T^2) memory)")

    print("\n== layer: attnlab.Attention(backend='auto') vs the same layer on torch sdpa ==")
    layer_rows = {}
    for T in [t for t in (512, 2048, 4096) if t <= args.max_t]:
        torch.manual_seed(0)
        layer = Attention(H * D, H).eval()
        direct = DirectLayer(layer).eval()
        x = torch.randn(1, T, H * D)

        def ours(layer: Attention = layer, x: torch.Tensor = x) -> object:
            with torch.no_grad():
                return layer(x, is_causal=True)

        def theirs(direct: DirectLayer = direct, x: torch.Tensor = x) -> object:
            with torch.no_grad():
                return direct(x)

        torch.testing.assert_close(ours(), theirs())
        best = bench({"attnlab": ours, "direct": theirs}, max(5, args.reps * 2))
        ratio = best["attnlab"] / best["direct"]
        layer_rows[T] = ratio
        print(
            f"T={T:>5}: attnlab {best['attnlab'] * 1e3:8.1f} ms, direct "
            f"{best['direct'] * 1e3:8.1f} ms, ratio {ratio:.3f}"
        )

    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"results": results, "layer_ratio": layer_rows}, fh, indent=1)
    if args.plot:
        plot(results, args.plot, args.threads)
        print(f"\nplot written to {args.plot}")


def plot(results: dict, path: str, threads: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8), constrained_layout=True)
    for col, mode in enumerate(("fwd", "fwd+bwd")):
        for row, (key, label, unit) in enumerate(
            (("time_s", "time", 1e3), ("peak_bytes", "peak memory", 1 / 2**20))
        ):
            ax = axes[row][col]
            for name, by_t in results[mode].items():
                Ts = sorted(by_t)
                if key not in by_t[Ts[0]]:
                    continue
                ax.plot(Ts, [by_t[t][key] * unit for t in Ts], marker="o", label=name)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length T")
            ax.set_ylabel("ms" if key == "time_s" else "MiB")
            ax.set_title(f"{mode}: {label}")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"causal attention, B=1, H={H}, D={D}, fp32, CPU, {threads} threads")
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
