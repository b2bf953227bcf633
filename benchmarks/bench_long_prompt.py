"""A long prompt's forward with glibc's large freed blocks kept in the heap, and without.

A load ends with :func:`attnlab._heap.keep_freed_blocks`: blocks under 256 MB come from
the heap and are reused when freed, where glibc would give each block of over 32 MB its
own memory map, faulted in and zeroed again at every element-wise operation of a long
prompt. Each side runs in a process of its own (the setting is per process), the peer with
``ATTNLAB_KEEP_FREED=0``: load the model at ``--dtype``, run one forward of ``--tokens``
tokens (last position's logits, as a generation's prompt) ``--reps`` times, and report the
best time, the process's peak resident memory (``VmHWM``) and what it holds after
(``VmRSS``). Rounds alternate the order of the two sides.

    PYTHONPATH=src python benchmarks/bench_long_prompt.py --model gemma3-270m
    PYTHONPATH=src python benchmarks/bench_long_prompt.py --model smollm2-135m-instruct \
        --tokens 2048
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from _records import Recorder
from bench_generate_memory import _status_mb
from bench_llama_cpp import MODELS, find_file

from attnlab._heap import KEEP_ENV

SIDES = {"kept": "1", "not kept": "0"}
PEER = f"{KEEP_ENV}=0"


def _side(model: str, dtype: str, tokens: int, reps: int, threads: int) -> dict[str, float]:
    """One process's run (``--side``): the best forward time and its memory."""
    import torch

    from attnlab.pretrained import load_pretrained

    torch.set_num_threads(threads)
    lm = load_pretrained(find_file(model), dtype=dtype)[0]
    ids = torch.randint(100, 20000, (1, tokens), generator=torch.Generator().manual_seed(0))
    times = []
    with torch.no_grad():
        for _ in range(reps):
            t0 = time.perf_counter()
            lm(ids, logits_to_keep=1)
            times.append(time.perf_counter() - t0)
    return {"s": min(times), "peak_mb": _status_mb("VmHWM"), "held_mb": _status_mb("VmRSS")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=MODELS, default="gemma3-270m")
    ap.add_argument("--dtype", default="int4")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3, help="forwards per process")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved pairs of processes")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--side", choices=tuple(SIDES), help=argparse.SUPPRESS)
    ap.add_argument("--results", type=Path, default=None, help="the records' folder")
    args = ap.parse_args()
    if args.tokens < 1 or args.reps < 1 or args.rounds < 1:
        ap.error("--tokens, --reps and --rounds must be positive")
    if args.side is not None:  # a child: one side, its figures on stdout
        print(json.dumps(_side(args.model, args.dtype, args.tokens, args.reps, args.threads)))
        return
    runs: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES}
    rec = Recorder(
        "bench_long_prompt",
        f"{args.model}-{args.dtype}-T{args.tokens}",
        f"{args.model} at --dtype {args.dtype}: one forward of {args.tokens} tokens (last "
        f"position's logits) in a fresh process after the load, best of {args.reps}, with "
        f"large freed blocks kept in glibc's heap (attnlab._heap) against {PEER}; "
        f"{args.rounds} interleaved pairs of processes",
        args.threads,
    )
    for r in range(args.rounds):
        order = list(SIDES) if r % 2 == 0 else list(reversed(SIDES))
        for side in order:
            env = {**os.environ, KEEP_ENV: SIDES[side]}
            cmd = [sys.executable, __file__, "--side", side, "--model", args.model,
                   "--dtype", args.dtype, "--tokens", str(args.tokens), "--reps",
                   str(args.reps), "--threads", str(args.threads)]  # fmt: skip
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            runs[side].append(json.loads(out.stdout.strip().splitlines()[-1]))
            got = runs[side][-1]
            print(f"  round {r + 1} {side:<9} {got['s']:.3f} s  peak {got['peak_mb']:.0f} MB  "
                  f"held {got['held_mb']:.0f} MB")  # fmt: skip
    best = {side: min(runs[side], key=lambda x: x["s"]) for side in SIDES}
    kept, peer = best["kept"], best["not kept"]
    rec.add(f"prompt of {args.tokens} tokens", kept["s"], "s", peer=PEER,
            peer_value=peer["s"], better="lower",
            note="runs " + ", ".join(f"{x['s']:.2f}" for x in runs["kept"]) + " s; the peer's "
            + ", ".join(f"{x['s']:.2f}" for x in runs["not kept"]))  # fmt: skip
    rec.add("peak resident memory of the process", kept["peak_mb"], "MB", peer=PEER,
            peer_value=peer["peak_mb"], better="lower")  # fmt: skip
    rec.add("resident memory after the forwards", kept["held_mb"], "MB", peer=PEER,
            peer_value=peer["held_mb"], better="lower")  # fmt: skip
    rec.note("the heap keeps, for reuse, up to what one forward had live at once; "
             "malloc_trim(0) gives it back")  # fmt: skip
    rec.write(folder=args.results)


if __name__ == "__main__":
    main()
