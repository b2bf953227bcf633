"""Chunked attention and a mixture-of-experts layer against what they replace.

- Chunked attention (Llama 4): ``blockwise`` with ``ChunkedMask(chunk)`` against the same
  backend with a plain causal mask, forward in fp32, B=1, H=4, D=64 (the issue's target:
  at most 0.2x at T=8192, chunks of 1024).
- Mixture of experts at one token: ``MixtureOfExperts`` (E experts, top k, width F)
  against a dense gated MLP of width ``k*F`` (the same active parameters; the target: at
  most 1.3x).

- Multi-head latent attention (``--mla``): one DeepSeek-V2-Lite-sized layer (C=2048,
  H=16, nope 128 + rope 64, values 128, latent 512) decoding after a prompt of
  ``--context`` tokens, the absorbed step against the expanded one over the same latent
  cache (the target: at least as fast), and the latent cache's bytes per token against
  the formula ``(kv_lora_rank + qk_rope_head_dim) * 4`` and plain multi-head attention's.
  Written as a record (``benchmarks/results/``).

Both pairs run interleaved (``_quiet.timed_pairs``: order alternating, the machine's load
read around each pair), with ``--threads`` torch threads (default 2; on a machine other
processes keep busy, 1: a two-thread kernel then waits for its second thread, which
measures the machine, not the kernel). Printed and recorded (``benchmarks/_records.py``,
one record per comparison): the median times over the kept pairs and their ratio, the
median and range of the per-pair ratios (each pair adjacent in time, so a busy machine's
drift cancels), how many pairs were quiet, and the target.

Usage::

    python benchmarks/bench_newest.py --seq-len 8192 --chunk 1024 --threads 1
    python benchmarks/bench_newest.py --mla --context 2048
"""

from __future__ import annotations

import argparse

import torch
from _quiet import PairResult, timed_pairs
from _records import Recorder

from attnlab import CausalMask, ChunkedMask, scaled_dot_product_attention
from attnlab.latent import LatentAttention, LatentKVCache, MLAConfig
from attnlab.models.decoder import MLP
from attnlab.models.moe import MixtureOfExperts, MoEConfig
from attnlab.rope import RopeConfig


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
    parser.add_argument("--mla", action="store_true", help="only the latent attention decode")
    parser.add_argument("--context", type=int, default=2048, help="MLA: prompt tokens")
    parser.add_argument("--steps", type=int, default=4, help="MLA: decode steps per timing")
    parser.add_argument(
        "--threads",
        type=int,
        default=2,
        help="torch threads (1 on a busy machine: two-thread kernels then wait on each other)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.mla:
        mla_decode(args.context, args.steps, args.pairs)
        return
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


def mla_decode(context: int, steps: int, pairs: int) -> None:
    """One MLA layer decoding after ``context`` tokens: absorbed against expanded steps
    (interleaved, each over its own copy of the same latent cache), and the cache's bytes
    per token; writes the record."""
    rec = Recorder(
        "bench_newest",
        f"mla-decode-{context}",
        f"one multi-head latent attention layer (C=2048, H=16, Dn=128, Dr=64, Dv=128, "
        f"kv_lora_rank=512, fp32, 2 threads) decoding {steps} tokens at a time after a "
        f"{context}-token prompt: the absorbed step against the expanded one over the same "
        "latent cache, interleaved (best of the quiet pairs); the cache's bytes per token",
        2,
    )
    torch.manual_seed(0)
    mla = MLAConfig(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    layer = LatentAttention(2048, 16, mla, rope=RopeConfig(base=10000.0, interleaved=True))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.02)
    total = context + steps * (pairs + 1)
    x = torch.randn(1, total, 2048)
    caches = {"absorbed": LatentKVCache(total), "expanded": LatentKVCache(total)}
    with torch.no_grad():
        layer.absorbed = False
        for cache in caches.values():  # the same prompt into both
            layer(x[:, :context], is_causal=True, kv_cache=cache)
        outs: dict[str, list[torch.Tensor]] = {"absorbed": [], "expanded": []}

        def decode(path: str) -> None:
            layer.absorbed = path == "absorbed"
            cache = caches[path]
            for _ in range(steps):
                t = cache.seq_len
                outs[path].append(layer(x[:, t : t + 1], kv_cache=cache))

        res = timed_pairs({p: (lambda p=p: decode(p)) for p in caches}, pairs)  # type: ignore[misc]
    diff = max(
        float((a - b).abs().max()) for a, b in zip(outs["absorbed"], outs["expanded"], strict=True)
    )
    t = {k: v / steps * 1e3 for k, v in res.best.items()}
    cache = caches["absorbed"]
    per_token = cache.nbytes / total  # a fixed-size cache of `total` positions
    formula = mla.cache_bytes_per_token(1, 4)
    mha = mla.mha_bytes_per_token(16, 1, 4)
    print(
        f"MLA decode at {context} tokens: absorbed {t['absorbed']:.2f} ms/token, expanded "
        f"{t['expanded']:.2f} ms/token: ratio {t['absorbed'] / t['expanded']:.3f} "
        f"({res.quiet_pairs} of {res.pairs} pairs quiet); largest difference {diff:.2e}"
    )
    print(
        f"latent cache: {per_token:.0f} B/token (formula {formula} B), plain multi-head "
        f"attention {mha} B/token: {mha / per_token:.1f}x"
    )
    rec.add(
        "absorbed decode step",
        t["absorbed"],
        "ms",
        peer="expanded step",
        peer_value=t["expanded"],
        better="lower",
    )
    rec.add(
        "latent cache per token and layer",
        per_token,
        "B",
        peer="plain multi-head cache",
        peer_value=mha,
        better="lower",
    )
    rec.note(
        f"cache formula (kv_lora_rank + qk_rope_head_dim) * 4 = {formula} B per token: held "
        f"{per_token:.0f}; absorbed vs expanded outputs differ by at most {diff:.2e}; "
        f"{res.quiet_pairs} of {res.pairs} pairs quiet"
    )
    rec.write()


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
