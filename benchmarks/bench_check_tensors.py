"""What refusing NaN / inf weights costs at load: a packaged model loaded with and without
:func:`attnlab.pretrained.errors.check_finite`, interleaved, best of N.

- ``smollm2-135m-instruct`` (Q4_1 GGUF): the GGUF reader checks the quantisation scales of
  Q4_0/Q4_1/Q8_0 blocks and every value of other types;
- ``gemma3-270m`` (Q4_K_M GGUF: K-quants, every dequantised value checked);
- ``all-minilm-l6-v2`` (a Hugging Face directory, fp32 safetensors): every value, which
  also reads the whole memory-mapped file at load.

    PYTHONPATH=src python benchmarks/bench_check_tensors.py --pairs 3

Writes one record per model into ``benchmarks/results/`` (``_records.Recorder``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _quiet import timed_pairs
from _records import Recorder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pairs", type=int, default=3, help="interleaved pairs (best of)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--models",
        nargs="+",
        default=["smollm2-135m-instruct", "gemma3-270m", "all-minilm-l6-v2"],
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from attnlab.pretrained import gguf_file, load_pretrained, safetensors_file

    checked = gguf_file.check_finite

    def skip(*args: object, **kwargs: object) -> None:
        return None

    spent = [0.0]  # CPU seconds inside the check during the current load

    def timed_check(*args: Any, **kwargs: Any) -> None:
        t0 = time.process_time()
        try:
            checked(*args, **kwargs)
        finally:
            spent[0] += time.process_time() - t0

    def load(name: str, check: bool) -> None:
        for module in (gguf_file, safetensors_file):
            module.check_finite = timed_check if check else skip  # type: ignore[attr-defined]
        try:
            load_pretrained(name)
        finally:
            for module in (gguf_file, safetensors_file):
                module.check_finite = checked  # type: ignore[attr-defined]

    for name in args.models:
        rec = Recorder(
            benchmark="bench_check_tensors",
            config=name,
            measured="load_pretrained with the non-finite weight check and without it "
            "(interleaved pairs, best of each), and the check's own CPU time in the load's",
            threads=args.threads,
        )
        load(name, True)  # warm the page cache and the imports
        result = timed_pairs(
            {"checked": lambda n=name: load(n, True), "unchecked": lambda n=name: load(n, False)},
            args.pairs,
        )
        on, off = result.best["checked"], result.best["unchecked"]
        print(f"{name}: load with the check {on:.3f} s, without {off:.3f} s: {on / off:.3f}x")
        print(f"  {result.quietness()}")
        # The check's own CPU time against the whole load's, this process only: robust to
        # what other processes do to the wall clock.
        shares = []
        for _ in range(args.pairs):
            spent[0] = 0.0
            t0 = time.process_time()
            load(name, True)
            shares.append((spent[0], time.process_time() - t0))
        check_cpu, load_cpu = min(shares, key=lambda s: s[1])
        print(
            f"  CPU time: the check {check_cpu:.3f} s of the load's {load_cpu:.3f} s "
            f"({100 * check_cpu / load_cpu:.1f}%)"
        )
        rec.add("load, checked", on, "s", peer="load, unchecked", peer_value=off, better="lower")
        rec.add("check CPU", check_cpu, "s", peer="load CPU", peer_value=load_cpu, better="lower")
        rec.note(result.quietness())
        print(f"  record: {rec.write()}")


if __name__ == "__main__":
    main()
