"""What refusing NaN / inf weights costs at load: SmolLM2-135M-Instruct (Q4_1 GGUF) loaded
with and without :func:`attnlab.pretrained.errors.check_finite` (the GGUF reader's NaN / inf
check: quantisation scales of Q4_0/Q4_1/Q8_0 blocks, every value of other types),
interleaved, best of N.

    PYTHONPATH=src python benchmarks/bench_check_tensors.py --pairs 3

Writes ``benchmarks/results/check_tensors.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _quiet import timed_pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pairs", type=int, default=3, help="interleaved pairs (best of)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results/check_tensors.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from attnlab.pretrained import gguf_file, load_pretrained

    checked = gguf_file.check_finite

    def skip(*args: object, **kwargs: object) -> None:
        return None

    def load(check: bool) -> None:
        gguf_file.check_finite = checked if check else skip  # type: ignore[assignment]
        try:
            load_pretrained("smollm2-135m-instruct")
        finally:
            gguf_file.check_finite = checked

    load(True)  # warm the page cache and the imports
    result = timed_pairs(
        {"checked": lambda: load(True), "unchecked": lambda: load(False)}, args.pairs
    )
    on, off = result.best["checked"], result.best["unchecked"]
    cost = on / off - 1
    print(f"load with the check {on:.3f} s, without {off:.3f} s: +{100 * cost:.1f}%")
    print(result.quietness())
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    record = {
        "benchmark": "check_tensors",
        "command": "PYTHONPATH=src python benchmarks/bench_check_tensors.py "
        f"--pairs {args.pairs} --threads {args.threads}",
        "commit": commit,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus {platform.processor()}".strip(),
        "threads": args.threads,
        "model": "smollm2-135m-instruct (Q4_1 GGUF)",
        "load_checked_s": round(on, 4),
        "load_unchecked_s": round(off, 4),
        "cost_fraction": round(cost, 4),
        "quietness": result.quietness(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
