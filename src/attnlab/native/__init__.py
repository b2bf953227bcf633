"""attnlab's compiled CPU code: the decode step's short loop in C++, built explicitly.

The Python decode step spends about as long around its weight products as in them
(``benchmarks/bench_decode_step.py`` measures the two loops side by side).
``decode_step.cpp`` runs the same layers with the same product kernels and plain loops for
everything between them. It is compiled once per machine by
:func:`torch.utils.cpp_extension.load` (tens of seconds; a C++ compiler needed, and Ninja,
which the ``ninja`` package, one of attnlab's dependencies, brings) into attnlab's cache
folder and loaded from there by later processes.

When it is built. :func:`extension` builds it (or loads an earlier build) and is called
where a model is loaded or prepared for decoding; the weight products only ask
:func:`loaded` for what the process already has, so a forward never starts a build.

Nothing depends on it: without a compiler, or when the build fails, decoding takes the
Python loop (same numbers up to the order of float32 sums) and :func:`why_not_native`
says why. ``ATTNLAB_NATIVE=0`` turns it off; ``ATTNLAB_NATIVE=1`` makes a failed build an
error instead of a note, and retries one that failed before. A failure is written to
``failed.log`` beside the build with the toolchain it was built with; it is retried when
the compiler or Ninja changes, after :data:`RETRY_AFTER_S`, with ``ATTNLAB_NATIVE=1``, or
when the file is deleted (:func:`retry_hint`).

This package imports nothing from attnlab but :mod:`attnlab.paths` (the cache folder).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

from attnlab.paths import cache_dir

__all__ = [
    "MARCH_ENV",
    "NATIVE_ENV",
    "PRODUCT_KINDS",
    "RETRY_AFTER_S",
    "STEP_ACTIVATIONS",
    "build_dir",
    "extension",
    "load_built",
    "loaded",
    "march",
    "retry_hint",
    "status",
    "why_not_native",
]

#: ``0`` (off), ``1`` (required: a failed build raises) or unset (on when it builds).
NATIVE_ENV = "ATTNLAB_NATIVE"
#: A failed build is tried again after this many seconds (a full disk, a killed compiler).
RETRY_AFTER_S = 24 * 3600
SOURCES = ("decode_step.cpp",)
#: The ``-march`` the module is built for: unset, ``native`` (this CPU's widest branch).
#: ``x86-64-v3`` (AVX2), ``x86-64`` (no SIMD branch) or ``skylake-avx512`` build the other
#: branches of the kernels on any machine that can run them: how the tests cover every
#: branch, and how a machine is made to behave like an older one.
MARCH_ENV = "ATTNLAB_NATIVE_MARCH"
_MARCH = re.compile(r"[a-z0-9][a-z0-9_.+-]*")
# -fopenmp: at::parallel_for (q8_0.h) is OpenMP inlined into the caller, serial without it;
# the module then links the libgomp.so.1 that torch has already loaded.
_BASE_FLAGS = ("-O3", "-fopenmp", "-fno-math-errno")


def march() -> str:
    """The ``-march`` of this process's build (:data:`MARCH_ENV`, default ``native``).

    Raises:
        ValueError: :data:`MARCH_ENV` is not a plain architecture name.
    """
    value = os.environ.get(MARCH_ENV, "").strip() or "native"
    if not _MARCH.fullmatch(value):
        raise ValueError(
            f"{MARCH_ENV} must be an architecture name as gcc's -march takes it "
            f"(native, x86-64-v3, x86-64, skylake-avx512, ...), got {value!r}"
        )
    return value


#: CPU flags with which a ``native`` build leaves out bf16 dot products
#: (``-mno-avx512bf16``), so that it is the ``avx512`` branch whose kernels all code their
#: rows as integers, and decode rows stay float32 (:func:`attnlab.quant.base.native_rows_dtype`).
#: On a Xeon with AMX that build decoded Gemma 3 int4 in 15.5-15.7 ms a step against
#: 17.7-17.9 with q5_0's bf16 dot products, and its decode-path argmax agreement with float32
#: went from 0.977 to 1.000. Not measured on other CPUs with bf16 dots (AMD's Zen 4 keeps them).
INTEGER_ROWS_FLAGS = frozenset({"amx_bf16"})


def _flags() -> tuple[str, ...]:
    flags: tuple[str, ...] = (*_BASE_FLAGS, f"-march={march()}")
    if march() == "native" and INTEGER_ROWS_FLAGS & set(cpu_flags().split()):
        flags = (*flags, "-mno-avx512bf16")
    return flags


_TOOLCHAIN_LINE = "toolchain: "
_TIME_LINE = "failed at: "

#: The compiled step's product kinds by attnlab's names (``Kind`` in ``decode_step.cpp``):
#: :class:`attnlab.quant.NativeProduct`'s ``kind``. The module exports its own table and a
#: build whose table differs is not used.
PRODUCT_KINDS: dict[str, int] = {
    "int4": 0,
    "int8": 2,
    "linear": 3,
    "q8_0": 4,
    "q5_0": 5,
    "q4": 6,
}
#: The compiled step's activations, by their index there (``Act``), checked the same way.
STEP_ACTIVATIONS: tuple[str, ...] = ("silu", "gelu_tanh", "gelu", "relu")

_loaded: ModuleType | None = None
_why: str | None = None
_tried = False
_skipped = False  # this process did not try: a failed.log stood


def cpu_flags() -> str:
    """The CPU's feature flags line from ``/proc/cpuinfo`` (x86 ``flags``, Arm
    ``Features``; ``-march=native`` builds for them), or the processor's name where there
    is no such file."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


_cpu_flags = cpu_flags  # its former name


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (e.g. ``AMD EPYC``), or the processor's
    name where there is no such line."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def build_dir() -> Path:
    """Where this machine's build lives: one folder per source, torch version, compiler
    flags and CPU (``-march=native`` code must not run on another CPU)."""
    here = Path(__file__).parent
    key = hashlib.sha256()
    for path in sorted([*here.glob("*.cpp"), *here.glob("*.h")]):  # sources and headers
        key.update(path.read_bytes())
    for part in (torch.__version__, sys.version, " ".join(_flags()), cpu_flags()):
        key.update(part.encode())
    return cache_dir() / "native" / key.hexdigest()[:16]


def _compiler() -> str:
    return os.environ.get("CXX", "c++")


def _toolchain() -> str:
    """The rest of the build key: the compiler (its path and version) and Ninja's version.
    Not part of :func:`build_dir` (a new compiler need not rebuild a working module), but
    a build that failed is tried again when it changes."""
    parts = []
    for command in ([_compiler(), "--version"], [_ninja() or "ninja", "--version"]):
        path = shutil.which(command[0])
        try:
            run = subprocess.run(
                [path or command[0], *command[1:]], capture_output=True, text=True, timeout=10
            )
            first = (run.stdout or run.stderr).strip().splitlines()
            parts.append(f"{path} {first[0] if first else ''}".strip())
        except (OSError, subprocess.SubprocessError):
            parts.append(f"{command[0]} missing")
    return " | ".join(parts)


def _failed_log() -> Path:
    return build_dir() / "failed.log"


def _write_failure(failed: Path, err: BaseException) -> None:
    failed.parent.mkdir(parents=True, exist_ok=True)
    failed.write_text(
        f"{_TOOLCHAIN_LINE}{_toolchain()}\n"
        f"{_TIME_LINE}{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n"
        f"{type(err).__name__}: {err}\n"
    )


def _failed_before(failed: Path) -> bool:
    """Whether ``failed`` still stands: written with this toolchain, less than
    :data:`RETRY_AFTER_S` ago (a log without the toolchain, an older attnlab's, is retried)."""
    try:
        text = failed.read_text()
        age = time.time() - failed.stat().st_mtime
    except OSError:
        return False
    recorded = next((ln for ln in text.splitlines() if ln.startswith(_TOOLCHAIN_LINE)), None)
    if recorded is None or age > RETRY_AFTER_S:
        return False
    return recorded[len(_TOOLCHAIN_LINE) :] == _toolchain()


def retry_hint(failed: Path | None = None) -> str:
    """How a failed build is tried again, naming its ``failed.log``."""
    failed = _failed_log() if failed is None else failed
    return (
        f"{failed}: delete it to try again, or set {NATIVE_ENV}=1 to retry now; it is "
        f"retried by itself when the compiler or Ninja changes or after "
        f"{RETRY_AFTER_S // 3600} h"
    )


#: Written beside a module that built and imported: its file's size and mtime. A folder is
#: one build of one set of sources and flags (:func:`build_dir`), so a module that matches
#: its stamp is imported directly, without PyTorch's build tools (which import slowly and
#: run Ninja to see that nothing changed).
_STAMP = "built.json"


def _stamp_of(module_file: Path) -> dict[str, int]:
    stat = module_file.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _import_built(folder: Path, name: str) -> ModuleType | None:
    """The module built in ``folder`` when its stamp says it is complete, else None."""
    import importlib.util
    import json

    module_file = folder / f"{name}.so"
    try:
        stamp = json.loads((folder / _STAMP).read_text())
        if stamp != {"file": module_file.name, **_stamp_of(module_file)}:
            return None
    except (OSError, ValueError):
        return None
    spec = importlib.util.spec_from_file_location(name, module_file)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build() -> ModuleType:
    import json

    folder = build_dir()
    folder.mkdir(parents=True, exist_ok=True)
    name = "attnlab_native_" + folder.name
    built = _import_built(folder, name)
    if built is not None:
        return built
    from torch.utils.cpp_extension import load  # deferred: only a build needs it

    if not any(folder.glob(f"{name}*.so")):
        print(
            f"attnlab: compiling the native decode step (once per machine, tens of seconds) "
            f"into {folder}",
            file=sys.stderr,
            flush=True,
        )
    here = Path(__file__).parent
    with _ninja_on_path():
        module = load(
            name,
            [str(here / s) for s in SOURCES],
            extra_cflags=list(_flags()),
            extra_ldflags=["-fopenmp"],
            build_directory=str(folder),
            verbose=False,
        )
    module_file = folder / f"{name}.so"
    if module_file.is_file():
        stamp = {"file": module_file.name, **_stamp_of(module_file)}
        tmp = folder / f".{_STAMP}.{os.getpid()}"
        tmp.write_text(json.dumps(stamp))
        os.replace(tmp, folder / _STAMP)
    return module


def loaded() -> ModuleType | None:
    """The compiled module if this process has built or loaded it (:func:`extension`),
    else None; never builds. What the weight products call on every forward."""
    if os.environ.get(NATIVE_ENV, "") == "0":
        return None
    return _loaded


def extension() -> ModuleType | None:
    """The compiled module, built (or loaded from an earlier build) on the first call of a
    process, or None: see :func:`why_not_native`. Called where a model is loaded or
    prepared for decoding, never from a forward.

    Raises:
        RuntimeError: ``ATTNLAB_NATIVE=1`` and the module could not be built.
    """
    global _loaded, _why, _tried, _skipped
    mode = os.environ.get(NATIVE_ENV, "")
    if mode == "0":
        return None
    if not _tried or (mode == "1" and _skipped):  # required: a standing failure is retried
        _tried, _skipped = True, False
        _loaded, _why = None, None
        failed = _failed_log()
        if mode != "1" and failed.is_file() and _failed_before(failed):
            _skipped = True
            _why = f"its build failed before; see {retry_hint(failed)}"
        elif shutil.which(_compiler()) is None:
            _why = f"no C++ compiler (`{_compiler()}`) on PATH"
        elif _ninja() is None:
            _why = "no Ninja (pip install ninja, or apt-get install ninja-build)"
        else:
            try:
                _loaded = _build()
                failed.unlink(missing_ok=True)
                _why = _tables_differ(_loaded)
                if _why is not None:
                    _loaded = None
                    print(f"attnlab: the native decode step is not used: {_why}", file=sys.stderr)
            except Exception as err:  # a compiler error, a missing header, ...
                try:
                    _write_failure(failed, err)
                    _why = f"its build failed; see {retry_hint(failed)}"
                except OSError:  # a read-only cache: say it here instead
                    _why = f"its build failed: {type(err).__name__}: {err}"
                print(
                    f"attnlab: the native decode step could not be built ({failed}); "
                    "decoding takes the Python loop",
                    file=sys.stderr,
                    flush=True,
                )
    if _loaded is None and mode == "1":
        raise RuntimeError(f"{NATIVE_ENV}=1 but the native decode step is unavailable: {_why}")
    return _loaded


def _tables_differ(module: ModuleType) -> str | None:
    """Why ``module``'s exported product kinds or activations differ from
    :data:`PRODUCT_KINDS` and :data:`STEP_ACTIVATIONS` (one of the two was edited without
    the other), or None when they agree."""
    expected = {
        "PRODUCT_KINDS": PRODUCT_KINDS,
        "ACTIVATIONS": {name: i for i, name in enumerate(STEP_ACTIVATIONS)},
    }
    for name, want in expected.items():
        got = dict(getattr(module, name, None) or {})
        if got != want:
            return (
                f"its {name} {got} differ from attnlab.native's {want}: make "
                "decode_step.cpp's enums and attnlab/native/__init__.py agree"
            )
    return None


def status() -> str:
    """One line on the compiled step for ``attnlab info``, without building it."""
    mode = os.environ.get(NATIVE_ENV, "")
    if mode == "0":
        return f"off ({NATIVE_ENV}=0)"
    if _loaded is not None:
        branch = getattr(_loaded, "SIMD", "unknown")
        return f"loaded from {build_dir()} (-march={march()}: the {branch} kernels)"
    folder = build_dir()
    failed = folder / "failed.log"
    if failed.is_file():
        standing = "stands" if _failed_before(failed) else "will be retried at the next load"
        return f"its build failed (the failure {standing}); see {retry_hint(failed)}"
    if any(folder.glob("attnlab_native_*.so")):
        return f"built in {folder} (-march={march()}); loaded when a model is loaded for decoding"
    return (
        f"not built yet; built into {folder} when a model is first loaded for decoding "
        f"(a C++ compiler and Ninja needed; {NATIVE_ENV}=0 turns it off)"
    )


def would_load() -> bool:
    """Whether a model loaded in this process runs the compiled module: it is loaded, or
    not tried yet and built for this machine (never builds). What keys the measurements
    made with it (:mod:`attnlab.quant.crossover`), so that ``attnlab info`` finds them."""
    if loaded() is not None:
        return True
    if os.environ.get(NATIVE_ENV, "") == "0" or _tried:
        return False
    folder = build_dir()
    return not (folder / "failed.log").is_file() and any(folder.glob("attnlab_native_*.so"))


def load_built() -> ModuleType | None:
    """The compiled module where this process has it or a build for this machine exists
    (then loaded, never built: milliseconds), else None. For work that is faster with the
    kernels but must not wait tens of seconds for a build (a file's header, a soft-capped
    attention call)."""
    return extension() if would_load() else loaded()


def _ninja() -> str | None:
    """Ninja's path: the one on PATH, else the ``ninja`` package's (a dependency of
    attnlab), whose binary sits in the environment's scripts folder: on PATH only where
    the environment is activated, not for ``.venv/bin/python`` run by its path. None if
    neither."""
    found = shutil.which("ninja")
    if found is not None:
        return found
    try:
        import ninja  # type: ignore[import-not-found]
    except ImportError:
        return None
    folder = str(getattr(ninja, "BIN_DIR", "") or "")
    exe = Path(folder) / ("ninja.exe" if os.name == "nt" else "ninja")
    return str(exe) if folder and exe.is_file() else None


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """While open, Ninja is on PATH: PyTorch's build runs ``ninja`` by name. The ``ninja``
    package's folder goes first when no ``ninja`` is on PATH; PATH is restored after."""
    ninja = None if shutil.which("ninja") is not None else _ninja()
    if ninja is None:  # on PATH already, or nowhere (the build then says so)
        yield
        return
    before = os.environ.get("PATH")
    os.environ["PATH"] = os.pathsep.join(p for p in (str(Path(ninja).parent), before) if p)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = before


def why_not_native() -> str | None:
    """Why decoding does not take the native step on this machine, or None if it does
    (building it first if this process has not tried)."""
    if os.environ.get(NATIVE_ENV, "") == "0":
        return f"{NATIVE_ENV}=0"
    if extension() is not None:
        return None
    return _why


def _reset() -> None:
    """Forget this process's attempt (tests)."""
    global _loaded, _why, _tried, _skipped
    _loaded, _why, _tried, _skipped = None, None, False, False
