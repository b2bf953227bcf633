"""A candidate measured and not taken: the SmolLM2 decode step compiled by ``torch.compile``.

The short loop of :func:`attnlab.models.decode.short.step_short` is written out
here over the cache's views (its positions a dynamic dimension, so one graph serves every
position and cache length) and compiled with Inductor, whose on-disk cache
(``TORCHINDUCTOR_CACHE_DIR``, default under ``/tmp``) makes a later process skip the C++
compile but not Dynamo's tracing. Measured, interleaved in one process after a 64-token
prompt, the same position every round:

- the first call (trace + compile, or trace + cache hit: the record says which);
- the compiled step, the eager short loop and the products alone: wall (best, median) and
  the calling thread's CPU time (best), ms per token.

``--guards none`` drops every Dynamo guard (``guard_filter_fn``; unsafe in general, here a
measurement of what the guards cost); ``--cpp-wrapper`` has Inductor write its wrapper in
C++ instead of Python.

    PYTHONPATH=src python benchmarks/bench_decode_compile.py --threads 2
    PYTHONPATH=src python benchmarks/bench_decode_compile.py --threads 1 --guards none
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from _records import Recorder
from bench_decode_step import PROMPT, products
from torch import nn

from attnlab.models.fast_decode import decode_plan
from attnlab.norms import rms_norm
from attnlab.pretrained import load_pretrained


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--guards", choices=("all", "none"), default="all")
    parser.add_argument("--cpp-wrapper", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = f"smollm2-int4-t{args.threads}-guards-{args.guards}" + (
        "-cpp" if args.cpp_wrapper else ""
    )
    rec = Recorder(
        "bench_decode_compile",
        config,
        f"SmolLM2-135M-Instruct int4 decode step after a {PROMPT}-token prompt at "
        f"{args.threads} threads: torch.compile (Inductor, guards {args.guards}"
        f"{', C++ wrapper' if args.cpp_wrapper else ''}) against the eager short loop and "
        f"the products alone, {args.rounds} interleaved rounds",
        args.threads,
    )
    model, _ = load_pretrained("smollm2-135m-instruct", dtype="int4")
    ids = torch.randint(0, 49152, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    nxt = torch.tensor([[5]])
    with torch.no_grad():
        cache = model.new_kv_cache(max_len=PROMPT + 8)
        model(ids, kv_cache=cache, logits_to_keep=1)
    plan = decode_plan(model)
    rows = plan.rows
    assert rows is not None
    H, G, D = plan.H, plan.G, plan.D
    nqk = (H + G) * D

    def layers(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kvs: list[torch.Tensor],
               vvs: list[torch.Tensor]) -> torch.Tensor:  # fmt: skip
        """The short loop over views of the caches that end at the new position."""
        B, f32 = x.shape[0], x.dtype
        for row, kb, vb in zip(rows, kvs, vvs, strict=True):
            qkv = row.qkv(rms_norm(x, *row.norm1).to(row.dtype))
            qk = qkv[:, :nqk].to(f32).view(B, H + G, D)
            qk = qk * cos + qk.roll(D // 2, dims=-1) * sin  # fused by Inductor
            kb.select(2, -1).copy_(qk[:, H:])
            vb.select(2, -1).copy_(qkv[:, nqk:].view(B, G, D))
            S = kb.shape[2]
            q = qk[:, :H].reshape(B * G, H // G, D)
            scores = torch.bmm(q, kb.reshape(B * G, S, D).transpose(1, 2)) * row.scale
            o = torch.bmm(torch.softmax(scores, -1), vb.reshape(B * G, S, D)).view(B, H * D)
            x = x + row.out(o.to(row.dtype))
            gate, up = row.gate_up(rms_norm(x, *row.norm2).to(row.dtype)).to(f32).chunk(2, -1)
            x = x + row.down((row.act(gate) * up).to(row.dtype))
        return x

    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    inductor_config.cpp_wrapper = args.cpp_wrapper
    options: dict[str, Any] = {}
    if args.guards == "none":
        options["guard_filter_fn"] = lambda entries: [False] * len(entries)
    compiled = torch.compile(layers, fullgraph=True, options=options or None)
    first = [True]

    @torch.no_grad()
    def compiled_step() -> torch.Tensor:
        pos = cache[0].seq_len
        x = nn.functional.embedding(nxt[:, 0], plan.parts.embedding.weight)
        cos_t, sin_t = plan._rope_tables(pos + 1, x.device)
        kvs = [c._k.narrow(2, 0, pos + 1) for c in cache]  # type: ignore[union-attr]
        vvs = [c._v.narrow(2, 0, pos + 1) for c in cache]  # type: ignore[union-attr]
        if first[0]:  # one graph for every position
            for t in kvs + vvs:
                torch._dynamo.mark_dynamic(t, 2)
            first[0] = False
        x = compiled(x, cos_t[pos], sin_t[pos], kvs, vvs)
        for c in cache:
            c._len = pos + 1
        return plan.parts.head(plan.final_norm(x).unsqueeze(1))  # type: ignore[no-any-return]

    def rewind() -> None:
        for c in cache:
            c._len = PROMPT

    t0 = time.perf_counter()
    got = compiled_step()
    first_s = time.perf_counter() - t0
    hits = counters["inductor"]["fxgraph_cache_hit"]
    rewind()
    with torch.no_grad():
        want = plan.step(nxt, cache)
    rewind()
    same = bool(torch.equal(got.argmax(-1), want.argmax(-1)))
    diff = float((got - want).abs().max())
    print(f"first call {first_s:.1f} s (Inductor cache hit: {bool(hits)}); logits max diff "
          f"{diff:.3g} against the eager step, same argmax: {same}")  # fmt: skip

    def eager() -> None:
        with torch.no_grad():
            plan.step(nxt, cache)
        rewind()

    def comp() -> None:
        compiled_step()
        rewind()

    sides: dict[str, Callable[[], None]] = {
        "compiled step": comp,
        "eager short loop": eager,
        "products only": products(plan, model),
    }
    wall: dict[str, list[float]] = {n: [] for n in sides}
    cpu: dict[str, list[float]] = {n: [] for n in sides}
    for i in range(args.rounds):
        order = list(sides.items())
        for name, fn in order if i % 2 == 0 else reversed(order):
            c0, w0 = time.thread_time(), time.perf_counter()
            fn()
            wall[name].append(time.perf_counter() - w0)
            cpu[name].append(time.thread_time() - c0)
    rec.add("first call (trace + compile or cache hit)", first_s, "s", better="lower",
            note=f"Inductor FX graph cache hit: {bool(hits)}")  # fmt: skip
    rec.add("logits max abs difference from the eager step", diff, "logit", better="lower")
    base_w, base_c = min(wall["eager short loop"]), min(cpu["eager short loop"])
    for name in sides:
        w, c = min(wall[name]), min(cpu[name])
        med = statistics.median(wall[name])
        print(f"  {name:17s} wall best {w * 1e3:6.2f} median {med * 1e3:6.2f} | "
              f"cpu best {c * 1e3:6.2f} ms per token")  # fmt: skip
        peer = None if name == "eager short loop" else "eager short loop"
        rec.add(f"{name}: wall ms/token (best)", w * 1e3, "ms", better="lower", peer=peer,
                peer_value=None if peer is None else base_w * 1e3,
                note=f"median {med * 1e3:.2f} ms")  # fmt: skip
        rec.add(f"{name}: thread CPU ms/token (best)", c * 1e3, "ms", better="lower",
                peer=peer, peer_value=None if peer is None else base_c * 1e3)  # fmt: skip
    rec.write()


if __name__ == "__main__":
    main()
