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

``--dtype bf16`` runs the same tables in bfloat16.

``--targets`` prints instead the ratios issue 12 sets targets for, each measured against
its named peer in the same run (interleaved):

1. ``blockwise`` / ``F.scaled_dot_product_attention``, causal and unmasked, fp32 and bf16,
   forward and forward+backward, T = ``--target-ts`` (target <= 1.10), with ``blockwise``'s
   peak memory per T (linear);
2. masks at T = ``--mask-t`` (causal & key padding with a quarter padded, causal sliding
   window of T/4, and a document mask when ``attnlab.masks`` has one): ``blockwise`` against
   torch's kernel given the same mask as a dense tensor (target < 1) and against torch's
   causal-only time (target <= 1.2 where the mask keeps no more entries than causal; the
   share it keeps is printed);
3. exact weights (``WeightsRequest``, one head, the last 16 rows): the call with weights
   against the plain call plus the weights alone (target <= 1.1).

Each pass also runs with ``force_tile_path("pure")`` so the fused tiles' gain shows.

Usage::

    python benchmarks/bench_attention.py --max-t 8192 --plot docs/img/attention_benchmark.png
    python benchmarks/bench_attention.py --targets --threads 2     # the issue-12 ratios
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from attnlab import masks as attn_masks
from attnlab._memory import peak_allocated
from attnlab.attention import Attention
from attnlab.backends import WeightsRequest, exact_weights
from attnlab.backends.blockwise import blockwise_attention, force_tile_path
from attnlab.functional import scaled_dot_product_attention

H, D = 12, 64
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DTYPE = torch.float32  # set by --dtype


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
    return make_fn_call(IMPLS[name], T, backward, DTYPE)


def make_fn_call(
    fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    T: int,
    backward: bool,
    dtype: torch.dtype,
) -> Callable[[], object]:
    """``fn(q, k, v)`` on fresh (1, H, T, D) inputs: no grad, or forward + backward."""
    gen = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(1, H, T, D, generator=gen).to(dtype) for _ in range(3))
    grad = torch.randn(1, H, T, D, generator=gen).to(dtype)
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


def _blockwise(mask: object, path: str | None = None) -> Callable[..., torch.Tensor]:
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with force_tile_path(path):  # type: ignore[arg-type]
            return scaled_dot_product_attention(q, k, v, mask, backend="blockwise")

    return run


def _sdpa(mask: torch.Tensor | None, is_causal: bool) -> Callable[..., torch.Tensor]:
    return lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal
    )


def load() -> str:
    with open("/proc/loadavg") as fh:
        return "load " + " ".join(fh.read().split()[:3])


def targets(args: argparse.Namespace) -> None:
    """The issue-12 ratio tables (see the module docstring)."""
    print(
        f"B=1, H={H}, D={D}, {args.threads} threads; time = min of >= {args.reps} interleaved "
        f"runs; ratio = attnlab / named peer in the same run; {load()}"
    )
    print("\n== 1. blockwise / torch sdpa, causal and unmasked (target <= 1.10) ==")
    print(f"{'T':>6} {'dtype':>5} {'mask':>6} {'pass':>8} {'sdpa ms':>9} {'fused':>6} {'pure':>6}")
    for T in args.target_ts:
        for dname in args.target_dtypes:
            dtype = DTYPES[dname]
            for causal in (True, False):
                mask = attn_masks.CausalMask() if causal else None
                for backward in (False, True):
                    impls = {"sdpa": _sdpa(None, causal), "fused": _blockwise(mask, "fused")}
                    if args.pure_max_t >= T:
                        impls["pure"] = _blockwise(mask, "pure")
                    fns = {n: make_fn_call(f, T, backward, dtype) for n, f in impls.items()}
                    best = bench(fns, args.reps if T <= 4096 else max(1, args.reps - 1))
                    pure = f"{best['pure'] / best['sdpa']:6.2f}" if "pure" in best else "     -"
                    print(
                        f"{T:>6} {dname:>5} {'causal' if causal else 'none':>6} "
                        f"{'fwd+bwd' if backward else 'fwd':>8} {best['sdpa'] * 1e3:9.1f} "
                        f"{best['fused'] / best['sdpa']:6.2f} {pure}",
                        flush=True,
                    )
    if not args.no_memory and args.target_ts:
        print("\nblockwise (fused) causal fwd+bwd peak MiB (x torch):", end="")
        for T in args.target_ts:
            ours = peak_allocated(make_fn_call(_blockwise(attn_masks.CausalMask()), T, True,
                                               torch.float32))[1]  # fmt: skip
            theirs = peak_allocated(make_fn_call(_sdpa(None, True), T, True, torch.float32))[1]
            print(f"  T={T}: {ours / 2**20:.1f} ({ours / max(1, theirs):.2f})", end="")
        print()

    if args.mask_t:
        _mask_table(args.mask_t, args)
    if args.weights_t:
        _weights_ratio(args.weights_t, args)
    print(f"\n{load()}")


def _mask_table(T: int, args: argparse.Namespace) -> None:
    mask_set: dict[str, attn_masks.AttentionMask] = {
        "padding": attn_masks.PaddingMask.from_lengths([3 * T // 4], T) & attn_masks.CausalMask(),
        "window": attn_masks.SlidingWindowMask(T // 4),
    }
    document = getattr(attn_masks, "DocumentMask", None)
    if document is not None:  # documents of T/8 tokens, causal within each
        try:
            ids = torch.arange(T) // (T // 8)
            mask_set["document"] = document(ids[None]) & attn_masks.CausalMask()
        except (TypeError, ValueError) as e:  # its signature differs: say so, skip it
            print(f"(document mask skipped: {e})")
    causal_entries = T * (T + 1) / 2
    print(
        f"\n== 2. masks at T={T} fp32: blockwise / sdpa with the dense mask (target < 1), "
        f"blockwise / sdpa causal-only (target <= 1.2 where kept <= 1) =="
    )
    print(
        f"{'mask':>9} {'pass':>8} {'kept':>5} {'sdpa causal ms':>15} {'x dense':>8} {'x causal':>9}"
    )
    for name, m in mask_set.items():
        dense = m.dense(T, T)  # (1|B, 1, T, T) bool: True = may attend
        kept = float(dense.sum()) / causal_entries
        for backward in (False, True) if args.mask_backward else (False,):
            impls = {
                "causal": _sdpa(None, True),
                "dense": _sdpa(dense, False),
                "blockwise": _blockwise(m),
            }
            fns = {n: make_fn_call(f, T, backward, torch.float32) for n, f in impls.items()}
            best = bench(fns, max(1, args.reps - 1))
            print(
                f"{name:>9} {'fwd+bwd' if backward else 'fwd':>8} {kept:5.2f} "
                f"{best['causal'] * 1e3:15.1f} {best['blockwise'] / best['dense']:8.2f} "
                f"{best['blockwise'] / best['causal']:9.2f}",
                flush=True,
            )
        del dense


def _weights_ratio(T: int, args: argparse.Namespace) -> None:
    print(f"\n== 3. exact weights, T={T} causal fp32, head 0, last 16 rows (target <= 1.1) ==")
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, H, T, D, generator=gen) for _ in range(3))
    req = WeightsRequest(heads=(0,), rows=tuple(range(T - 16, T)))
    causal = attn_masks.CausalMask()
    lse = blockwise_attention(q, k, v, causal, dropout_p=0.0, scale=D**-0.5).lse

    def with_weights() -> object:
        return scaled_dot_product_attention(q, k, v, causal, backend="blockwise", need_weights=req)

    fns = {
        "with": with_weights,
        "plain": lambda: scaled_dot_product_attention(q, k, v, causal, backend="blockwise"),
        "weights": lambda: exact_weights(q, k, causal, D**-0.5, req, lse),
    }
    with torch.no_grad():
        best = bench(fns, args.reps)
    print(
        f"with weights {best['with'] * 1e3:.1f} ms, plain {best['plain'] * 1e3:.1f} ms, weights "
        f"alone {best['weights'] * 1e3:.2f} ms: ratio "
        f"{best['with'] / (best['plain'] + best['weights']):.3f}"
    )


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
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--targets", action="store_true", help="print the issue-12 ratio tables")
    ap.add_argument("--target-ts", type=int, nargs="*", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--target-dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    ap.add_argument("--pure-max-t", type=int, default=2048, help="largest T for the pure tiles")
    ap.add_argument("--mask-t", type=int, default=8192, help="0 skips the mask table")
    ap.add_argument("--mask-backward", action="store_true", help="masks: forward+backward too")
    ap.add_argument("--weights-t", type=int, default=4096, help="0 skips the weights")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    global DTYPE
    DTYPE = DTYPES[args.dtype]
    if args.targets:
        targets(args)
        return

    Ts = []
    T = args.min_t
    while args.max_t >= T:
        Ts.append(T)
        T *= 2
    results: dict[str, dict[str, dict[int, dict[str, float]]]] = {"fwd": {}, "fwd+bwd": {}}
    print(
        f"causal attention, B=1, H={H}, D={D}, {args.dtype}, {args.threads} threads; time = min of "
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
        layer = Attention(H * D, H).to(DTYPE).eval()
        direct = DirectLayer(layer).eval()
        x = torch.randn(1, T, H * D).to(DTYPE)

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
