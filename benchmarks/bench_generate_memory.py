"""Memory of a long SmolLM2 generation: attnlab's static cache against transformers.

Each side runs in its own process (so that one's peak does not hide the other's): load
the fp32 model, read the resident memory (``VmRSS``), greedy-generate from a
``--prompt``-token prompt until the context holds ``--context`` tokens, reading the
resident memory every 16 new tokens, then the process's peak (``VmHWM``). Printed per
side: the memory after loading, the peak during generation above it, and the resident
memory over the decode steps (flat: the cache was sized once; growing: it grows).

    PYTHONPATH=src python benchmarks/bench_generate_memory.py --threads 1
    PYTHONPATH=src python benchmarks/bench_generate_memory.py --prompt 64 --context 4096
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _run_side(side: str, prompt_len: int, context: int, threads: int) -> dict[str, object]:
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 49000, (1, prompt_len), generator=g)
    new = context - prompt_len
    samples: list[float] = []
    if side == "attnlab":
        from attnlab.generation import generate_stream
        from attnlab.pretrained import load_pretrained

        model, _ = load_pretrained("smollm2-135m-instruct")
        loaded = _status_mb("VmRSS")
        for i, _tok in enumerate(generate_stream(model, ids, new)):
            if i % 16 == 0:
                samples.append(_status_mb("VmRSS"))
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from bench_pretrained import smollm2_reference
        from transformers.generation.streamers import BaseStreamer

        ref = smollm2_reference()
        loaded = _status_mb("VmRSS")

        class Sampler(BaseStreamer):
            n = 0

            def put(self, value: torch.Tensor) -> None:
                if self.n % 16 == 1:  # the first put is the prompt
                    samples.append(_status_mb("VmRSS"))
                self.n += 1

            def end(self) -> None:
                pass

        with torch.no_grad():
            ref.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
                streamer=Sampler(),
            )
    return {"loaded": loaded, "peak": _status_mb("VmHWM"), "samples": samples}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=3968)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--side", choices=["attnlab", "transformers"], default=None)
    args = parser.parse_args()
    if args.side:
        print(json.dumps(_run_side(args.side, args.prompt, args.context, args.threads)))
        return
    print(
        f"SmolLM2 fp32, greedy, prompt {args.prompt} -> context {args.context} tokens, "
        f"threads {args.threads}, loadavg {os.getloadavg()[0]:.2f}; MB resident"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    for side in ("attnlab", "transformers"):
        cmd = [sys.executable, __file__, "--side", side, "--threads", str(args.threads)]
        cmd += ["--prompt", str(args.prompt), "--context", str(args.context)]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        s = r["samples"]
        print(
            f"  {side:12s} after load {r['loaded']:7.0f}  peak {r['peak']:7.0f} "
            f"(+{r['peak'] - r['loaded']:5.0f})  during decode {s[0]:7.0f} -> {s[-1]:7.0f} "
            f"(+{s[-1] - s[0]:4.0f} over {16 * (len(s) - 1)} tokens)"
        )


if __name__ == "__main__":
    main()
