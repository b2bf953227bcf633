"""A prompt's forward in bfloat16 against float32 products, per CPU class.

For each ``--isa`` setting (``benchmarks/_isa.py``: the machine as it is, AVX-512 without
BF16, AVX2 alone) and each prompt arithmetic (``ATTNLAB_PROMPT_DTYPE`` = ``bfloat16``,
``float32``), a child process loads the GGUF file at ``--dtype`` (int4 by default) and
times one forward of ``--tokens`` tokens (the last position's logits, as a prefill),
best of ``--rounds``, with the two arithmetics' processes interleaved. It prints
tokens/s per side, which one attnlab chooses there (:mod:`attnlab.quant.arith`), and
whether that choice is the faster one.

    PYTHONPATH=src python benchmarks/bench_prompt_arith.py --model gemma3-270m
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from _isa import ISAS, isa_env
from _records import Recorder

ARITHS = ("bfloat16", "float32")


def _child(path: str, dtype: str, tokens: int, rounds: int, threads: int) -> None:
    import torch

    from attnlab.pretrained import load_pretrained
    from attnlab.quant.arith import prompt_arithmetic

    torch.set_num_threads(threads)
    model, _ = load_pretrained(path, dtype=dtype)
    ids = torch.randint(100, 20_000, (1, tokens), generator=torch.Generator().manual_seed(0))
    best = float("inf")
    with torch.inference_mode():
        model(ids[:, : min(tokens, 160)], logits_to_keep=1)  # warm-up
        for _ in range(rounds):
            t0 = time.perf_counter()
            model(ids, logits_to_keep=1)
            best = min(best, time.perf_counter() - t0)
    os.environ.pop("ATTNLAB_PROMPT_DTYPE", None)
    prompt_arithmetic.cache_clear()
    chosen, why = prompt_arithmetic()  # what this setting chooses on its own
    print("RESULT " + json.dumps({"tps": tokens / best, "auto": str(chosen), "why": why}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="gemma3-270m", help="smollm2-135m-instruct or gemma3-270m"
    )
    parser.add_argument("--file", type=Path, help="a GGUF file instead of --model")
    parser.add_argument("--dtype", default="int4")
    parser.add_argument("--isa", default=",".join(ISAS), help=f"comma-separated: {', '.join(ISAS)}")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3, help="timed forwards per process")
    parser.add_argument("--repeats", type=int, default=2, help="processes per side, interleaved")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(str(args.file), args.dtype, args.tokens, args.rounds, args.threads)
        return
    from bench_llama_cpp import find_file

    path = args.file or find_file(args.model)
    isas = [s.strip() for s in args.isa.split(",") if s.strip()]
    rec = Recorder(
        "bench_prompt_arith",
        f"{path.stem}-{args.dtype}",
        f"{path.name} at --dtype {args.dtype}: one forward of {args.tokens} tokens (last "
        "position's logits) with the prompt products in bfloat16 against float32, per CPU "
        f"class ({', '.join(isas)}; benchmarks/_isa.py), best of {args.rounds} forwards in "
        f"each of {args.repeats} interleaved processes",
        args.threads,
    )
    print(f"{path.name}, --dtype {args.dtype}, {args.tokens} tokens, {args.threads} threads")
    print(f"  {'cpu class':<12} {'bf16 tok/s':>11} {'fp32 tok/s':>11} {'fp32/bf16':>10}  chosen")
    for isa in isas:
        best: dict[str, float] = dict.fromkeys(ARITHS, 0.0)
        auto = why = ""
        for i in range(args.repeats):
            for arith in ARITHS if i % 2 == 0 else ARITHS[::-1]:
                env = isa_env(isa)
                env["ATTNLAB_PROMPT_DTYPE"] = arith
                cmd = [sys.executable, __file__, "--child", "--file", str(path),
                       "--dtype", args.dtype, "--tokens", str(args.tokens),
                       "--rounds", str(args.rounds), "--threads", str(args.threads)]  # fmt: skip
                out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
                line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
                if out.returncode != 0 or line is None:
                    raise SystemExit(
                        f"bench_prompt_arith: {isa} {arith} failed:\n{out.stderr[-2000:]}"
                    )
                got = json.loads(line[len("RESULT ") :])
                best[arith] = max(best[arith], got["tps"])
                auto, why = got["auto"].removeprefix("torch."), got["why"]
        faster = max(ARITHS, key=best.__getitem__)
        ratio = best["float32"] / best["bfloat16"]
        mark = "" if auto == faster else "  (not the faster)"
        print(
            f"  {isa:<12} {best['bfloat16']:11.0f} {best['float32']:11.0f} {ratio:9.2f}x  "
            f"{auto}{mark}"
        )
        rec.add(f"{isa}: prefill of {args.tokens}, float32 products", best["float32"], "tokens/s",
                peer="bfloat16 products", peer_value=best["bfloat16"])  # fmt: skip
        rec.note(f"{isa}: attnlab chooses {auto} ({why}); the faster here is {faster}")
    rec.write()


if __name__ == "__main__":
    main()
