"""The first token from the shell: `attnlab generate --model FILE -n 1 "Hi"` as a fresh
process, against `python -c "import torch"` (the floor every attnlab command stands on),
interleaved in one run.

Each round runs the commands one after another (the order alternating), and a round is
kept when other processes used under a quarter of a core during it
(``_quiet.timed_pairs``). The figures are each command's best kept time and the median of
the per-round ratios to `import torch`, with their range: the rounds are adjacent in
time, so slow drift of the machine cancels in the ratio.

    PYTHONPATH=src python benchmarks/bench_first_token.py --model gemma3-270m --rounds 7

Writes one record per model into ``benchmarks/results/`` (``_records.Recorder``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE)]
from _quiet import timed_pairs  # noqa: E402
from _records import Recorder  # noqa: E402

MODELS = ("gemma3-270m", "smollm2-135m-instruct")
QUICK_EXIT = (
    "import atexit, gc, os, threading, torch; gc.freeze(); threading._shutdown(); "
    "atexit._run_exitfuncs(); os._exit(0)"
)


def model_file(name: str) -> Path:
    """The packaged file of ``name`` (assembled into attnlab's cache on first use)."""
    from attnlab.pretrained.loaders import gemma3_path, smollm2_path

    if name == "gemma3-270m":
        return gemma3_path(announce=lambda line: print(line, file=sys.stderr))
    return smollm2_path()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", choices=MODELS, action="append", help="default: both")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds")
    args = parser.parse_args()
    # As a user runs it: the bytecode written once (the warm-up run below) and read after.
    env = {
        **{k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"},
        "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "HF_HUB_OFFLINE": "1",
    }

    def command(argv: list[str]) -> Callable[[], None]:
        def run() -> None:
            subprocess.run(argv, env=env, check=True, capture_output=True)

        return run

    for name in args.model or MODELS:
        path = model_file(name)
        generate = [sys.executable, "-m", "attnlab", "generate", "--model", str(path)]
        fns = {
            "import torch": command([sys.executable, "-c", "import torch"]),
            # The floor with the exit attnlab's program takes (`cli.app._leave_quickly`:
            # threads and exit handlers as Python's exit, then no teardown): the ratio
            # against it as well.
            "import torch, quick exit": command([sys.executable, "-c", QUICK_EXIT]),
            "int4": command([*generate, "--dtype", "int4", "-n", "1", "Hi"]),
            "float32": command([*generate, "-n", "1", "Hi"]),
        }
        fns["int4"]()  # the native step's build and the page cache, before any clock
        rec = Recorder(
            benchmark="bench_first_token",
            config=name,
            measured=f'`attnlab generate --model {path.name} -n 1 "Hi"` from the shell '
            "(a fresh process: Python, imports, the file's header, the model, the "
            "tokenizer, the prompt's forward, the exit), at --dtype int4 and at the default "
            '(float32), against `python -c "import torch"` and against it with the exit '
            "attnlab's program takes (threads and exit handlers as Python's exit, then "
            "os._exit: no teardown); interleaved rounds, the quiet ones kept",
            threads=os.cpu_count() or 1,
        )
        result = timed_pairs(fns, args.rounds)
        floor = result.best["import torch"]
        rec.add('python -c "import torch"', floor, "s", better="lower")
        floors = {  # label in fns: (figure suffix, the peer's command)
            "import torch": ("", 'python -c "import torch"'),
            "import torch, quick exit": (", against attnlab's exit", f'python -c "{QUICK_EXIT}"'),
        }
        for dtype in ("int4", "float32"):
            for label, (suffix, peer) in floors.items():
                rec.add(
                    f"first token, --dtype {dtype}{suffix}",
                    result.best[dtype],
                    "s",
                    peer=peer,
                    peer_value=result.best[label],
                    better="lower",
                    note=result.ratio_note(dtype, label),
                )
        rec.note(result.quietness())
        for label, times in result.times.items():
            rec.note(f"{label}: " + ", ".join(f"{t:.2f}" for t in times) + " s")
        rec.write()
        print(json.dumps({f.name: round(f.value, 3) for f in rec.figures}))


if __name__ == "__main__":
    main()
