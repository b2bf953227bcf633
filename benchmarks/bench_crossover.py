"""A prompt's forward with the crossovers measured on this machine against the defaults.

Each int format runs its kernel for a few rows and one dense ``mm`` from its crossover on
(:mod:`attnlab.quant.crossover`). For each ``--isa`` setting (``benchmarks/_isa.py``: the
machine as it is, AVX-512 without BF16, AVX2 alone), child processes load the GGUF file at
``--dtype`` (int4 by default) and time one forward of each of ``--tokens`` (the last
position's logits, as a prefill), best of ``--rounds``: with ``ATTNLAB_CROSSOVER=defaults``
(the crossovers measured on the EPYC) against the crossovers measured in that process
from an empty cache (the measuring is done in the warm-up forwards: their time is
reported for both sides). The two sides' processes are
interleaved.

    PYTHONPATH=src python benchmarks/bench_crossover.py --model gemma3-270m
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _isa import ISAS, isa_env
from _records import Recorder

from attnlab.paths import CACHE_ENV, cache_dir

SIDES = ("defaults", "measure")


def _child(path: str, dtype: str, tokens: list[int], rounds: int, threads: int) -> None:
    import torch

    from attnlab.pretrained import load_pretrained
    from attnlab.quant import WEIGHT_FORMATS, crossover

    torch.set_num_threads(threads)
    model, _ = load_pretrained(path, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    tps, first = {}, 0.0
    with torch.inference_mode():
        for n in tokens:
            ids = torch.randint(100, 20_000, (1, n), generator=gen)
            t0 = time.perf_counter()
            model(ids, logits_to_keep=1)  # warm-up (measuring the crossovers, the first time)
            first += time.perf_counter() - t0
            best = float("inf")
            for _ in range(rounds):
                t0 = time.perf_counter()
                model(ids, logits_to_keep=1)
                best = min(best, time.perf_counter() - t0)
            tps[n] = n / best
    if os.environ.get(crossover.CROSSOVER_ENV) != "defaults":
        chosen = {k: c.dense_from for k, c in crossover.measured_here()[1].items()}
    else:
        chosen = {
            name: cls.default_dense_from
            for name, cls in WEIGHT_FORMATS.items()
            if cls.dense_from_tokens is None
        }
    print("RESULT " + json.dumps({"tps": tps, "chosen": chosen, "first_s": first}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="gemma3-270m", help="smollm2-135m-instruct or gemma3-270m"
    )
    parser.add_argument("--file", type=Path, help="a GGUF file instead of --model")
    parser.add_argument("--dtype", default="int4")
    parser.add_argument("--isa", default=",".join(ISAS), help=f"comma-separated: {', '.join(ISAS)}")
    parser.add_argument("--tokens", default="64,512", help="comma-separated prompt lengths")
    parser.add_argument("--rounds", type=int, default=3, help="timed forwards per process")
    parser.add_argument("--repeats", type=int, default=4, help="processes per side, interleaved")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    if args.child:
        _child(str(args.file), args.dtype, tokens, args.rounds, args.threads)
        return
    from bench_llama_cpp import find_file

    path = args.file or find_file(args.model)
    isas = [s.strip() for s in args.isa.split(",") if s.strip()]
    rec = Recorder(
        "bench_crossover",
        f"{path.stem}-{args.dtype}",
        f"{path.name} at --dtype {args.dtype}: one forward of {args.tokens} tokens (last "
        "position's logits) with the int formats' crossovers to dense products measured on "
        "this machine (from an empty cache) against the defaults (ATTNLAB_CROSSOVER=defaults),"
        f" per CPU class ({', '.join(isas)}; benchmarks/_isa.py), best of {args.rounds} "
        f"forwards in each of {args.repeats} interleaved processes",
        args.threads,
    )
    print(f"{path.name}, --dtype {args.dtype}, {args.threads} threads; tokens/s")
    child = [sys.executable, __file__, "--child", "--file", str(path), "--dtype", args.dtype,
             "--tokens", args.tokens, "--rounds", str(args.rounds),
             "--threads", str(args.threads)]  # fmt: skip
    for isa in isas:
        best = {side: dict.fromkeys(tokens, 0.0) for side in SIDES}
        chosen: dict[str, list[dict[str, int]]] = {side: [] for side in SIDES}
        first: dict[str, list[float]] = {side: [] for side in SIDES}
        for i in range(args.repeats):
            for side in SIDES if i % 2 == 0 else SIDES[::-1]:
                env = isa_env(isa)
                env["ATTNLAB_CROSSOVER"] = side
                with tempfile.TemporaryDirectory() as fresh:
                    if side == "measure":  # measured from nothing, the native builds reused
                        (Path(fresh) / "native").symlink_to(cache_dir() / "native")
                        env[CACHE_ENV] = fresh
                    out = subprocess.run(
                        child, env=env, capture_output=True, text=True, check=False
                    )
                line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
                if out.returncode != 0 or line is None:
                    raise SystemExit(f"bench_crossover: {isa} {side} failed:\n{out.stderr[-2000:]}")
                got = json.loads(line[len("RESULT ") :])
                for n in tokens:
                    best[side][n] = max(best[side][n], got["tps"][str(n)])
                chosen[side].append(got["chosen"])
                first[side].append(got["first_s"])

        def shown(found: dict[str, int]) -> str:
            return ", ".join(
                f"{name} {'never' if n >= 1 << 30 else n}" for name, n in found.items()
            )

        print(f"  {isa}: defaults ({shown(chosen['defaults'][0])})")
        for run, found in enumerate(chosen["measure"]):
            print(f"  {isa}: measured, process {run + 1} ({shown(found)})")
        for n in tokens:
            d, m = best["defaults"][n], best["measure"][n]
            print(f"    {n:5d} tokens: defaults {d:8.1f}  measured {m:8.1f}  {m / d:5.2f}x")
            rec.add(f"{isa}: prefill of {n}, measured crossovers", m, "tokens/s",
                    peer="the defaults", peer_value=d)  # fmt: skip
        rec.note(
            f"{isa}: measured crossovers per process: "
            + "; ".join(shown(c) for c in chosen["measure"])
            + f" (defaults: {shown(chosen['defaults'][0])}); the warm-up forwards took "
            + ", ".join(f"{s:.2f} s" for s in first["measure"])
            + " measuring (each process from an empty cache) against "
            + ", ".join(f"{s:.2f} s" for s in first["defaults"])
            + " with the defaults"
        )
    rec.write()


if __name__ == "__main__":
    main()
