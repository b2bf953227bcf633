"""One SmolLM2 decode step per precision against transformers and the path before issue 14.

Each step is one new token after a 64-token prompt; the sides alternate (order reversed
every round) so load from other processes hits them alike; the median and best per side.
Tuning tool for a shared machine (one thread is the fair setting while others run).

    PYTHONPATH=src python benchmarks/bench_decode_step.py 1 30   # threads, rounds
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
from bench_pretrained import smollm2_reference

from attnlab.pretrained import load_pretrained

torch.set_num_threads(int(sys.argv[1]))
models = {
    d: load_pretrained("smollm2-135m-instruct", dtype=d)[0]
    for d in ["float32", "bfloat16", "int8", "int4"]
}
ids = torch.randint(0, 49152, (1, 64), generator=torch.Generator().manual_seed(0))
nxt = torch.tensor([[5]])
runs = {}
BEFORE = "before fp32 (growing cache, modules)"
PEER = "transformers fp32 (sdpa, DynamicCache)"
ref = smollm2_reference()


class _Peer:
    """transformers' model behind the same call: one token, its own cache."""

    def __call__(self, x: torch.Tensor, kv_cache: list, logits_to_keep: int) -> None:
        out = ref(x, past_key_values=kv_cache[0], use_cache=True, logits_to_keep=logits_to_keep)
        kv_cache[0] = out.past_key_values


with torch.no_grad():
    caches = {PEER: (_Peer(), [None])}
    caches[BEFORE] = (models["float32"], models["float32"].new_kv_cache())
    for d, m in models.items():
        caches[f"fast {d}"] = (m, m.new_kv_cache(max_len=64 + 200))
    for name, (m, c) in caches.items():
        m(ids, kv_cache=c, logits_to_keep=1)
        runs[name] = []
    for i in range(int(sys.argv[2])):
        for name, (m, c) in caches.items() if i % 2 == 0 else reversed(caches.items()):
            t = time.perf_counter()
            m(nxt, kv_cache=c, logits_to_keep=1)
            runs[name].append(time.perf_counter() - t)
peer = statistics.median(runs[PEER])
base = statistics.median(runs[BEFORE])
head = f"threads {torch.get_num_threads()}, loadavg {os.getloadavg()[0]:.1f}"
print(f"{head}, median of {len(runs[BEFORE])} interleaved steps after a 64-token prompt")
for name, ts in runs.items():
    med = statistics.median(ts)
    rate = f"{med * 1e3:7.1f} ms/step  ({1 / med:5.1f} tokens/s)"
    ratios = f"{peer / med:4.2f}x transformers, {base / med:4.2f}x before"
    print(f"  {name:40s} {rate}  {ratios}; best {min(ts) * 1e3:6.1f} ms")
print(f"loadavg after: {os.getloadavg()[0]:.1f}")
