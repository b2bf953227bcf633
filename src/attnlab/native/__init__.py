"""attnlab's compiled CPU code: the decode step's short loop in C++, built on first use.

The Python decode step spends much of its time around its weight products (some forty
tensor operations a layer; ``benchmarks/bench_decode_step.py`` measures the split).
``decode_step.cpp`` runs the same layers with the same product kernels and plain loops for
everything between them. It is compiled once per machine by
:func:`torch.utils.cpp_extension.load` (a C++ compiler and Ninja needed) into attnlab's
cache folder and loaded from there by later processes.

Nothing depends on it: without a compiler, or when the build fails, decoding takes the
Python loop (same numbers up to the order of float32 sums) and :func:`why_not_native`
says why. ``ATTNLAB_NATIVE=0`` turns it off; ``ATTNLAB_NATIVE=1`` makes a failed build an
error instead of a note.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
from pathlib import Path
from types import ModuleType

import torch

__all__ = [
    "NATIVE_ENV",
    "PRODUCT_KINDS",
    "STEP_ACTIVATIONS",
    "build_dir",
    "extension",
    "why_not_native",
]

#: ``0`` (off), ``1`` (required: a failed build raises) or unset (on when it builds).
NATIVE_ENV = "ATTNLAB_NATIVE"
SOURCES = ("decode_step.cpp",)
# -fopenmp: at::parallel_for (q8_0.h) is OpenMP inlined into the caller, serial without it;
# the module then links the libgomp.so.1 that torch has already loaded.
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno")

#: The compiled step's product kinds by attnlab's names (``Kind`` in ``decode_step.cpp``):
#: :class:`attnlab.quant.NativeProduct`'s ``kind``. The module exports its own table and a
#: build whose table differs is not used.
PRODUCT_KINDS: dict[str, int] = {"int4": 0, "int8": 2, "linear": 3, "q8_0": 4, "q5_0": 5}
#: The compiled step's activations, by their index there (``Act``), checked the same way.
STEP_ACTIVATIONS: tuple[str, ...] = ("silu", "gelu_tanh", "gelu", "relu")

_loaded: ModuleType | None = None
_why: str | None = None
_tried = False


def _cpu_flags() -> str:
    """The CPU's feature flags (``-march=native`` builds for them), or its name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def build_dir() -> Path:
    """Where this machine's build lives: one folder per source, torch version, compiler
    flags and CPU (``-march=native`` code must not run on another CPU)."""
    from attnlab.pretrained.loaders import cache_dir

    here = Path(__file__).parent
    key = hashlib.sha256()
    for path in sorted([*here.glob("*.cpp"), *here.glob("*.h")]):  # sources and headers
        key.update(path.read_bytes())
    for part in (torch.__version__, sys.version, " ".join(_FLAGS), _cpu_flags()):
        key.update(part.encode())
    return cache_dir() / "native" / key.hexdigest()[:16]


def _build() -> ModuleType:
    from torch.utils.cpp_extension import load

    folder = build_dir()
    folder.mkdir(parents=True, exist_ok=True)
    name = "attnlab_native_" + folder.name
    if not any(folder.glob(f"{name}*.so")):
        print(
            f"attnlab: compiling the native decode step (once per machine, about 30 s) "
            f"into {folder}",
            file=sys.stderr,
            flush=True,
        )
    here = Path(__file__).parent
    return load(
        name,
        [str(here / s) for s in SOURCES],
        extra_cflags=list(_FLAGS),
        extra_ldflags=["-fopenmp"],
        build_directory=str(folder),
        verbose=False,
    )


def extension() -> ModuleType | None:
    """The compiled module (built on the first call of a process), or None: see
    :func:`why_not_native`.

    Raises:
        RuntimeError: ``ATTNLAB_NATIVE=1`` and the module could not be built.
    """
    global _loaded, _why, _tried
    mode = os.environ.get(NATIVE_ENV, "")
    if mode == "0":
        return None
    if not _tried:
        _tried = True
        _loaded, _why = None, None
        failed = build_dir() / "failed.log"
        if failed.is_file():  # this source on this machine failed before: do not retry
            _why = f"its build failed before; see {failed} (delete it to try again)"
        elif shutil.which(os.environ.get("CXX", "c++")) is None:
            _why = "no C++ compiler (`c++`) on PATH"
        elif shutil.which("ninja") is None and not _has_ninja_module():
            _why = "no Ninja (pip install ninja, or apt-get install ninja-build)"
        else:
            try:
                _loaded = _build()
                _why = _tables_differ(_loaded)
                if _why is not None:
                    _loaded = None
                    print(f"attnlab: the native decode step is not used: {_why}", file=sys.stderr)
            except Exception as err:  # a compiler error, a missing header, ...
                try:
                    failed.parent.mkdir(parents=True, exist_ok=True)
                    failed.write_text(f"{type(err).__name__}: {err}\n")
                    _why = f"its build failed; see {failed}"
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


def _has_ninja_module() -> bool:
    try:
        import ninja  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        return False
    return True


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
    global _loaded, _why, _tried
    _loaded, _why, _tried = None, None, False
