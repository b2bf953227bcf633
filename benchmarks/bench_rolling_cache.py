"""Decoding with a sliding-window layer: the rolling KV cache against the plain one.

One ``Attention(512, 8, num_kv_heads=2, sliding_window=W, rope=True)`` layer decodes N
tokens one at a time after a prefill of W tokens, once with ``RollingKVCache(W)`` (holds
the last W positions) and once with the plain ``KVCache`` (holds everything; the window is
then a mask over all cached keys). Both run in the same process, interleaved step by step
so that load from other processes hits them alike, single-threaded. Printed: the outputs'
largest difference (they must agree), the cache memory at the end, and the time of the
last 256 steps, each as the ratio rolling / plain.

Usage::

    python benchmarks/bench_rolling_cache.py --window 256 --tokens 4096
"""

from __future__ import annotations

import argparse
import time

import torch
from _records import Recorder

from attnlab.attention import Attention, KVCache, RollingKVCache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens decoded after prefill")
    parser.add_argument("--backend", default="auto")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rec = Recorder(
        "bench_rolling_cache",
        f"window-{args.window}",
        f"one sliding-window layer (C=512, H=8, G=2, window {args.window}, fp32, backend "
        f"{args.backend}) decoding {args.tokens} tokens: the rolling KV cache against a plain "
        "growing cache, stepped alternately; time of the last 256 steps and cache memory",
        1,
    )
    torch.manual_seed(0)
    W, N = args.window, args.tokens
    layer = Attention(512, 8, num_kv_heads=2, sliding_window=W, rope=True, backend=args.backend)
    x = torch.randn(1, W + N, 512)
    caches: dict[str, KVCache] = {"rolling": RollingKVCache(W), "plain": KVCache()}
    times = {name: 0.0 for name in caches}
    diff = 0.0
    with torch.no_grad():
        for cache in caches.values():
            layer(x[:, :W], is_causal=True, kv_cache=cache)
        for t in range(W, W + N):
            outs = {}
            for name, cache in caches.items():
                start = time.perf_counter()
                outs[name] = layer(x[:, t : t + 1], is_causal=True, kv_cache=cache)
                if t >= W + N - 256:
                    times[name] += time.perf_counter() - start
            diff = max(diff, float((outs["rolling"] - outs["plain"]).abs().max()))
    roll, plain = caches["rolling"], caches["plain"]
    print(f"window {W}, {N} tokens decoded after a prefill of {W}, backend {args.backend!r}")
    print(f"largest output difference rolling vs plain: {diff:.2e}")
    print(
        f"cache memory: rolling {roll.nbytes / 2**10:.0f} KiB ({roll.cached_len} positions), "
        f"plain {plain.nbytes / 2**10:.0f} KiB ({plain.cached_len} positions): "
        f"ratio {roll.nbytes / plain.nbytes:.3f}"
    )
    print(
        f"time of the last 256 steps: rolling {times['rolling'] * 1e3:.1f} ms, plain "
        f"{times['plain'] * 1e3:.1f} ms: ratio {times['rolling'] / times['plain']:.2f}"
    )
    rec.add("last 256 decode steps", times["rolling"] * 1e3, "ms", peer="plain KVCache",
            peer_value=times["plain"] * 1e3, better="lower")  # fmt: skip
    rec.add("cache memory", roll.nbytes / 2**10, "KiB", peer="plain KVCache",
            peer_value=plain.nbytes / 2**10, better="lower")  # fmt: skip
    rec.note(f"largest output difference rolling vs plain: {diff:.2e}")
    rec.write()


if __name__ == "__main__":
    main()
