"""Build llama.cpp (converter, quantizer, bench tools) into a cache folder, once.

The source is the ``llama-cpp-python`` sdist from PyPI, which vendors llama.cpp under
``vendor/llama.cpp`` (``convert_hf_to_gguf.py``, ``gguf-py/``, the CMake project). The
tools are built with CMake + Ninja. The default build is for this CPU
(``GGML_NATIVE=ON``) with weight repacking off (``GGML_CPU_REPACK=OFF``): the repacked
CPU kernels crashed on a machine this project ran on.

Layout of the cache (``$ATTNLAB_PEERS/llama.cpp``, default
``~/.cache/attnlab/peers/llama.cpp``)::

    src/                 vendored llama.cpp source (convert_hf_to_gguf.py, gguf-py/, ...)
    build/bin/           llama-quantize, llama-bench, llama-perplexity
    converter-packages/  the transformers version the converter pins (pip --target)
    llama_cpp.json       versions and build flags; written last, so its presence means built

Variants for a CPU class (``--isa``, the classes of ``benchmarks/_isa.py``) or with weight
repacking on (``--repack``) live beside it, one folder each:
``llama.cpp-<isa>[-repack]`` (``llama.cpp-avx2``, ``llama.cpp-native-repack``). A variant
builds ``llama-bench`` alone, has no converter packages, and copies its source from the
default build's ``src/`` when that holds the same release (else it downloads the sdist).
Its ``llama_cpp.json`` says its ``isa``, ``repack`` and CMake flags. The classes:

- ``native``: ``GGML_NATIVE=ON`` (``-march=native``: whatever this CPU has, AMX included);
- ``avx512-core``: AVX-512 F/CD/VL/DQ/BW with AVX2, FMA, F16C, BMI2; no VNNI, VBMI, BF16
  or AMX (Skylake-SP);
- ``avx2``: AVX2, FMA, F16C, BMI2; no AVX-VNNI, no AVX-512 (x86-64-v3).

Running the script again does nothing when ``llama_cpp.json`` and the binaries exist.

``--for-tests`` builds the default folder for the tests alone (CI does): llama.cpp's own C++
(libllama, common, the tools) at ``-O0``, common's sources compiled eight to a unity file,
ggml's kernels at ``-O3`` as in a release build (``ggml_optimised.cmake``). It builds in
about a third of the time, converts, quantises and scores the tests' small files
exactly as the release build does (the arithmetic is ggml's), but it is no peer to time
against: ``bench_llama_cpp.py`` refuses it, and running this script without the flag
builds the release tools over it.

Usage::

    python benchmarks/peers/llama_cpp.py            # build if needed, print the folder
    python benchmarks/peers/llama_cpp.py --check    # exit 1 if not built, build nothing
    python benchmarks/peers/llama_cpp.py --version 0.3.36 --jobs 2
    python benchmarks/peers/llama_cpp.py --isa avx2 --jobs 1     # llama.cpp-avx2
    python benchmarks/peers/llama_cpp.py --isa avx512-core --repack
    python benchmarks/peers/llama_cpp.py --for-tests --jobs 2   # CI

Needs a C/C++ compiler, ``cmake`` (>= 3.14) and ``ninja`` on PATH (Debian: ``apt-get
install build-essential cmake ninja-build``; or ``pip install cmake ninja``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The llama-cpp-python release whose vendored llama.cpp the tests were written against.
# Pinned so that every machine converts and quantises with the same code.
DEFAULT_VERSION = "0.3.36"
TOOLS = ("llama-quantize", "llama-bench", "llama-perplexity")
# A variant (another CPU class, or repacking on) is for timing alone.
VARIANT_TOOLS = ("llama-bench",)
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    # Repacked weight layouts crashed on a CPU this project ran on; the plain kernels did not.
    "-DGGML_CPU_REPACK=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_EXAMPLES=ON",
)
# The instruction sets of each CPU class (benchmarks/_isa.py), as the vendored ggml's
# CMake options name them (ggml/CMakeLists.txt; ggml/src/ggml-cpu/CMakeLists.txt turns
# each into -m flags when GGML_NATIVE is off). Every x86 option is named, on or off, since
# their defaults depend on GGML_NATIVE and on SOURCE_DATE_EPOCH.
_X86_ON = ("SSE42", "AVX", "AVX2", "FMA", "F16C", "BMI2")
_X86_OFF = ("AVX_VNNI", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16", "AMX_TILE", "AMX_INT8",
            "AMX_BF16")  # fmt: skip
ISA_FLAGS: dict[str, tuple[str, ...]] = {
    "native": ("-DGGML_NATIVE=ON",),
    "avx512-core": (
        "-DGGML_NATIVE=OFF",
        *(f"-DGGML_{o}=ON" for o in (*_X86_ON, "AVX512")),
        *(f"-DGGML_{o}=OFF" for o in _X86_OFF),
    ),
    "avx2": (
        "-DGGML_NATIVE=OFF",
        *(f"-DGGML_{o}=ON" for o in _X86_ON),
        *(f"-DGGML_{o}=OFF" for o in ("AVX512", *_X86_OFF)),
    ),
}
ISAS = tuple(ISA_FLAGS)
RECORD = "llama_cpp.json"
# The converter is written against the transformers its requirements pin (4.x; the pin is
# read from the vendored requirements file): transformers 5 rewrites some hub configs on
# load (GPT-NeoX's `rotary_pct` becomes `rope_parameters`, which the converter does not
# read). So the converter gets its own transformers, with the hub client and tokenizers
# that version accepts, installed beside the build and put first on its PYTHONPATH.
CONVERTER_DEPS = ("huggingface-hub>=0.34,<1.0", "tokenizers>=0.22,<=0.23.0")


@dataclass(frozen=True)
class LlamaCpp:
    """Where a built llama.cpp lives.

    Attributes:
        root: The cache folder.
        src: The llama.cpp source tree (``convert_hf_to_gguf.py``, ``gguf-py/``).
        bin: The folder with the built tools.
        info: The contents of ``llama_cpp.json``.
    """

    root: Path
    src: Path
    bin: Path
    info: dict

    @property
    def converter(self) -> Path:
        """``convert_hf_to_gguf.py``."""
        return self.src / "convert_hf_to_gguf.py"

    @property
    def converter_packages(self) -> Path:
        """The converter's pinned Python packages (transformers 4), see :data:`CONVERTER_PINS`."""
        return self.root / "converter-packages"

    @property
    def gguf_py(self) -> Path:
        """The vendored ``gguf`` package's parent, to put on the converter's PYTHONPATH."""
        return self.src / "gguf-py"

    @property
    def isa(self) -> str:
        """The CPU class it was built for (``native`` for a record that does not say)."""
        return str(self.info.get("isa", "native"))

    @property
    def repack(self) -> bool:
        """Whether it was built with weight repacking (``GGML_CPU_REPACK=ON``)."""
        return bool(self.info.get("repack", False))

    @property
    def for_tests(self) -> bool:
        """Whether it was built for the tests alone (``--for-tests``: no peer to time against)."""
        return bool(self.info.get("for_tests", False))

    def tool(self, name: str) -> Path:
        """The path of one built tool, e.g. ``tool("llama-quantize")``."""
        return self.bin / name


def cache_dir() -> Path:
    """``$ATTNLAB_PEERS/llama.cpp``, or ``~/.cache/attnlab/peers/llama.cpp``."""
    peers = os.environ.get("ATTNLAB_PEERS")
    base = Path(peers) if peers else Path.home() / ".cache" / "attnlab" / "peers"
    return base / "llama.cpp"


def _check_isa(isa: str) -> None:
    if isa not in ISA_FLAGS:
        raise SystemExit(f"llama_cpp.py: unknown isa {isa!r}; choose from {', '.join(ISAS)}")


def is_default(isa: str, repack: bool) -> bool:
    """Whether ``(isa, repack)`` is the default build (native, no repacking)."""
    return isa == "native" and not repack


def peer_dir(isa: str = "native", repack: bool = False) -> Path:
    """The folder of a build: :func:`cache_dir` for the default one, else
    ``llama.cpp-<isa>[-repack]`` beside it."""
    _check_isa(isa)
    root = cache_dir()
    if is_default(isa, repack):
        return root
    return root.with_name(f"{root.name}-{isa}{'-repack' if repack else ''}")


# A build for the tests alone: llama.cpp's C++ unoptimised, ggml's kept at -O3 by a file
# CMake includes after ggml's project() (a directory-scoped setting, so only ggml's targets).
FOR_TESTS_FLAGS = (
    "-DCMAKE_CXX_FLAGS_RELEASE=-O0 -DNDEBUG",
    f"-DCMAKE_PROJECT_ggml_INCLUDE={Path(__file__).resolve().with_name('ggml_optimised.cmake')}",
)


def cmake_flags(
    isa: str = "native", repack: bool = False, for_tests: bool = False
) -> tuple[str, ...]:
    """The CMake flags of a build (the default one's are :data:`CMAKE_FLAGS`; with
    ``for_tests``, :data:`FOR_TESTS_FLAGS` added)."""
    _check_isa(isa)
    out: list[str] = []
    for flag in CMAKE_FLAGS:
        if flag == "-DGGML_NATIVE=ON":
            out.extend(ISA_FLAGS[isa])
        elif flag == "-DGGML_CPU_REPACK=OFF":
            out.append(f"-DGGML_CPU_REPACK={'ON' if repack else 'OFF'}")
        else:
            out.append(flag)
    if for_tests:
        out.extend(FOR_TESTS_FLAGS)
    return tuple(out)


def find(root: Path | None = None, isa: str = "native", repack: bool = False) -> LlamaCpp | None:
    """The built peer in ``root`` (default: :func:`peer_dir` of ``isa`` and ``repack``), or
    None if not built.

    What counts as built follows the folder's record: the default build (a record without
    ``isa`` and ``repack``, or native without repacking) needs every tool of :data:`TOOLS`,
    the converter and its packages; a variant needs the tools its record lists.
    """
    root = peer_dir(isa, repack) if root is None else root
    record = root / RECORD
    if not record.is_file():
        return None
    peer = LlamaCpp(
        root=root, src=root / "src", bin=root / "build" / "bin", info=json.loads(record.read_text())
    )
    default = is_default(peer.isa, peer.repack)
    needed = TOOLS if default else tuple(peer.info.get("tools") or VARIANT_TOOLS)
    tools = all(os.access(peer.tool(t), os.X_OK) for t in needed)
    if not tools:
        return None
    if default:
        packages = (peer.converter_packages / "transformers").is_dir()
        if not peer.converter.is_file() or not packages:
            return None
    return peer


def _run(cmd: list[str], **kwargs: object) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kwargs)  # type: ignore[call-overload]


def _need(program: str) -> str:
    path = shutil.which(program)
    if path is None:
        raise SystemExit(
            f"llama_cpp.py: `{program}` not found on PATH; install it\n"
            "(Debian: apt-get install build-essential cmake ninja-build; pip: cmake ninja)"
        )
    return path


def _vendored_commit(changelog: str, version: str) -> str | None:
    """The llama.cpp commit that llama-cpp-python ``version`` vendors, from its CHANGELOG.

    The sdist carries no git metadata (``vendor/llama.cpp/.git`` points outside it), so
    llama.cpp's CMake would report commit "unknown"; the changelog names the commit in
    each release's section ("update llama.cpp to ggml-org/llama.cpp@<sha>", newest first).
    """
    section = re.search(
        rf"^## \[{re.escape(version)}\]\n(.*?)(?=^## \[|\Z)", changelog, re.M | re.S
    )
    if section is None:
        return None
    m = re.search(r"llama\.cpp@([0-9a-f]{7,40})", section.group(1))
    return m.group(1) if m else None


def _converter_transformers_pin(src: Path) -> str:
    """``transformers==X`` as the vendored converter's requirements pin it."""
    for req in sorted((src / "requirements").glob("requirements-convert*.txt")):
        m = re.search(r"^transformers\s*==\s*([\w.]+)", req.read_text(), re.M)
        if m:
            return f"transformers=={m.group(1)}"
    return "transformers>=4.45,<5"


def _compiler() -> str | None:
    """The first line of ``c++ --version``."""
    out = subprocess.run(["c++", "--version"], capture_output=True, text=True, check=False)
    return out.stdout.splitlines()[0] if out.stdout else None


def _ggml_version(src: Path) -> str | None:
    text = (src / "ggml" / "CMakeLists.txt").read_text(errors="replace")
    parts = [
        re.search(rf"set\(GGML_VERSION_{k}\s+(\d+)\)", text) for k in ("MAJOR", "MINOR", "PATCH")
    ]
    return ".".join(p.group(1) for p in parts if p) if all(parts) else None


def _extract(tar: tarfile.TarFile, members: list[tarfile.TarInfo], dest: Path) -> None:
    """Extract ``members`` into ``dest``, refusing any that would land outside it.

    Python's ``data`` filter does this where it exists (3.12, and 3.11.4 on); Debian's
    Python 3.11.2 has no ``filter`` argument, so the same refusals are made here first:
    absolute names, ``..`` parts, links that point out of ``dest``, and devices.

    Raises:
        SystemExit: a member that would escape, named.
    """
    root = dest.resolve()
    for m in members:
        target = (root / m.name).resolve()
        bad = m.name.startswith("/") or ".." in Path(m.name).parts or m.isdev()
        if m.issym() or m.islnk():
            link = (target.parent / m.linkname) if m.issym() else (root / m.linkname)
            bad = bad or not link.resolve().is_relative_to(root)
        if bad or not target.is_relative_to(root):
            raise SystemExit(
                f"llama_cpp.py: the sdist's member {m.name!r} would land outside {dest}"
            )
    if hasattr(tarfile, "data_filter"):
        tar.extractall(dest, members=members, filter="data")
    else:
        tar.extractall(dest, members=members)  # checked above


def _download_source(version: str, root: Path) -> None:
    """Put the sdist's vendored llama.cpp in ``root/src`` and the commit it vendors in
    ``root/llama_cpp_commit.txt``."""
    src = root / "src"
    with tempfile.TemporaryDirectory(prefix="llama-cpp-sdist-") as tmp:
        _run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             f"llama-cpp-python=={version}", "-d", tmp]
        )  # fmt: skip
        (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        top = sdist.name.removesuffix(".tar.gz")
        prefix = f"{top}/vendor/llama.cpp/"
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            for m in members:
                m.name = m.name[len(prefix) :]
            _extract(tar, members, Path(tmp) / "llama.cpp")
            changelog = tar.extractfile(f"{top}/CHANGELOG.md")
            text = changelog.read().decode("utf-8", "replace") if changelog else ""
        (root / "llama_cpp_commit.txt").write_text(
            (_vendored_commit(text, version) or "unknown") + "\n"
        )
        if src.exists():
            shutil.rmtree(src)
        shutil.move(str(Path(tmp) / "llama.cpp"), src)


def _copy_source(default: LlamaCpp, root: Path) -> None:
    """Copy the default build's source and commit file into ``root`` (a variant's folder)."""
    print(f"+ copy {default.src} -> {root / 'src'}", flush=True)
    with tempfile.TemporaryDirectory(prefix="src-", dir=root) as tmp:
        shutil.copytree(default.src, Path(tmp) / "src", symlinks=True)
        if (root / "src").exists():
            shutil.rmtree(root / "src")
        shutil.move(str(Path(tmp) / "src"), root / "src")
    commit = default.info.get("llama_cpp_commit") or "unknown"
    (root / "llama_cpp_commit.txt").write_text(f"{commit}\n")


def build(
    version: str = DEFAULT_VERSION,
    jobs: int | None = None,
    root: Path | None = None,
    isa: str = "native",
    repack: bool = False,
    for_tests: bool = False,
) -> LlamaCpp:
    """Download the llama-cpp-python sdist, build llama.cpp's tools into ``root``.

    Does nothing (returns the existing build) when the tools are already there. The default
    build (native, no repacking) has every tool of :data:`TOOLS` and the converter's
    packages; a variant has ``llama-bench`` alone, from a copy of the default build's
    source when the default build holds ``version`` (else from the sdist).

    Args:
        version: The llama-cpp-python release whose vendored llama.cpp is built.
        jobs: Parallel compile jobs (default: Ninja's choice).
        root: The cache folder (default: :func:`peer_dir` of ``isa`` and ``repack``).
        isa: The CPU class to build for (:data:`ISA_FLAGS`).
        repack: Build with weight repacking (``GGML_CPU_REPACK=ON``).
        for_tests: The default build for the tests alone (:data:`FOR_TESTS_FLAGS`). A
            release build already there serves the tests too; a build for the tests is
            rebuilt in release when asked without this.

    Returns:
        The built peer.
    """
    root = peer_dir(isa, repack) if root is None else root
    default = is_default(isa, repack)
    if for_tests and not default:
        raise SystemExit(
            "llama_cpp.py: --for-tests builds the default folder (native, no --repack)"
        )
    found = find(root)
    if found is not None and found.for_tests and not for_tests:
        print(f"llama_cpp.py: {root} was built for the tests alone; building the release tools")
        (root / RECORD).unlink()
        shutil.rmtree(root / "build")  # CMake's cache keeps the flags it was given
        found = None
    if found is not None:
        if found.info.get("llama_cpp_python") != version:
            built = found.info.get("llama_cpp_python")
            print(
                f"llama_cpp.py: {root} holds llama-cpp-python {built}, not {version}; "
                "delete the folder to rebuild",
                file=sys.stderr,
            )
        return found
    cmake, ninja = _need("cmake"), _need("ninja")
    _need("c++")
    root.mkdir(parents=True, exist_ok=True)
    src = root / "src"
    commit_file = root / "llama_cpp_commit.txt"
    if not (src / "convert_hf_to_gguf.py").is_file():
        base = None if default else find(peer_dir())
        if base is not None and base.info.get("llama_cpp_python") == version:
            _copy_source(base, root)
        else:
            _download_source(version, root)
    commit = commit_file.read_text().strip() if commit_file.exists() else "unknown"
    packages = root / "converter-packages"
    transformers_pin = _converter_transformers_pin(src)
    if default and not (packages / "transformers").is_dir():
        _run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
             str(packages), transformers_pin, *CONVERTER_DEPS]
        )  # fmt: skip
    build_dir = root / "build"
    flags = cmake_flags(isa, repack, for_tests)
    tools = TOOLS if default else VARIANT_TOOLS
    # The commit goes into the binaries too (`llama-bench` prints it), since CMake cannot
    # find it without git metadata.
    _run(
        [cmake, "-S", str(src), "-B", str(build_dir), "-G", "Ninja", *flags,
         f"-DLLAMA_BUILD_COMMIT={commit}"]
    )  # fmt: skip
    _run([ninja, "-C", str(build_dir), *(["-j", str(jobs)] if jobs else []), *tools])
    info = {
        "llama_cpp_python": version,
        "llama_cpp_commit": commit,
        "ggml_version": _ggml_version(src),
        "isa": isa,
        "repack": repack,
        **({"for_tests": True} if for_tests else {}),
        **({"converter_packages": [transformers_pin, *CONVERTER_DEPS]} if default else {}),
        "cmake_flags": [*flags, f"-DLLAMA_BUILD_COMMIT={commit}"],
        "tools": list(tools),
        "machine": platform.machine(),
        "compiler": _compiler(),
    }
    (root / RECORD).write_text(json.dumps(info, indent=2) + "\n")
    found = find(root)
    if found is None:
        raise SystemExit(
            f"llama_cpp.py: the build in {build_dir} did not produce {', '.join(tools)}"
        )
    return found


# Runs in the converter's own interpreter: imports convert_hf_to_gguf once (torch,
# transformers and the converter's model registry take seconds to import) and converts
# every job, noting each job's failure instead of stopping at the first.
_CONVERT_DRIVER = """
import json, sys, traceback
import convert_hf_to_gguf as converter
errors = {}
for model, outtype, outfile in json.loads(sys.argv[1]):
    sys.argv = ["convert_hf_to_gguf.py", model, "--outtype", outtype, "--outfile", outfile]
    try:
        converter.main()
    except SystemExit as exc:
        errors[outfile] = f"convert_hf_to_gguf.py exited with {exc.code}"
    except Exception:
        errors[outfile] = traceback.format_exc(limit=-3)
print("CONVERT-ERRORS " + json.dumps(errors))
"""


def convert(peer: LlamaCpp, jobs: list[tuple[Path, str, Path]]) -> dict[Path, str]:
    """Run llama.cpp's ``convert_hf_to_gguf.py`` on Hugging Face directories, in one process.

    The converter runs in a subprocess whose ``PYTHONPATH`` starts with the vendored
    ``gguf-py``, so that its ``gguf`` (which may be newer than the installed one) does not
    shadow the caller's.

    Args:
        peer: The built peer (:func:`find`).
        jobs: ``(model directory, outtype, output file)`` each; outtype as the converter's
            ``--outtype`` (``f32``, ``f16``, ``bf16``, ``q8_0``).

    Returns:
        The jobs that failed: output file -> the converter's error (empty if none did).
    """
    path = [peer.gguf_py, peer.converter_packages, peer.src]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in path)}
    payload = json.dumps([[str(m), t, str(o)] for m, t, o in jobs])
    proc = subprocess.run(
        [sys.executable, "-c", _CONVERT_DRIVER, payload],
        env=env,
        cwd=peer.src,
        capture_output=True,
        text=True,
        check=False,
    )
    marker = [line for line in proc.stdout.splitlines() if line.startswith("CONVERT-ERRORS ")]
    if proc.returncode != 0 or not marker:
        tail = (proc.stderr or proc.stdout)[-2000:]
        return {
            Path(o): f"the converter process failed ({proc.returncode}):\n{tail}"
            for _, _, o in jobs
        }
    errors = json.loads(marker[-1].removeprefix("CONVERT-ERRORS "))
    return {Path(k): v for k, v in errors.items()}


def _run_captured(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


def run_bench(
    peer: LlamaCpp,
    args: list[str],
    run: Callable[[list[str]], subprocess.CompletedProcess[str]] = _run_captured,
) -> tuple[subprocess.CompletedProcess[str], str | None]:
    """``llama-bench ARGS`` as its users run it; where it dies by a signal, once more with
    its extra buffer types off (``--repack 0``), and a line saying so. ``run`` starts each
    process and returns it finished, its output as text (a caller that also wants the
    process's resource use passes its own).

    llama-bench's default puts weights in the CPU's extra buffer types (repacked layouts,
    AMX tiles). On a virtual machine whose CPU reports AMX but does not run its tile
    instructions (``tilezero`` raised SIGILL inside ggml's AMX kernel on a Xeon here), that
    dies with no message; the plain CPU buffers are the peer there.

    Returns:
        The finished process, and None or the line that says the fallback was taken.
    """
    cmd = [str(peer.tool("llama-bench")), *args]
    proc = run(cmd)
    if proc.returncode >= 0 or "--repack" in args:
        return proc, None
    again = run([*cmd, "--repack", "0"])
    note = (
        f"llama-bench died by signal {-proc.returncode} with its extra buffer types (repacked "
        f"weights, AMX tiles) on this CPU ({cpu_name()}); measured with --repack 0"
    )
    return again, note


def cpu_name() -> str:
    """The CPU's model name as ``/proc/cpuinfo`` gives it (else what ``platform`` knows)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def quantize(peer: LlamaCpp, source: Path, target: Path, qtype: str, threads: int = 1) -> str:
    """``llama-quantize source target qtype`` (e.g. ``Q4_K_M``, ``IQ4_XS``).

    Returns:
        What llama-quantize printed (it names each tensor's type, and any fallback).

    Raises:
        RuntimeError: llama-quantize failed; the message holds the end of its output.
    """
    proc = subprocess.run(
        [str(peer.tool("llama-quantize")), str(source), str(target), qtype, str(threads)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0 or not target.is_file():
        raise RuntimeError(
            f"llama-quantize {source.name} -> {qtype} failed ({proc.returncode}):\n"
            + (proc.stderr + proc.stdout)[-2000:]
        )
    return proc.stdout + proc.stderr


@dataclass(frozen=True)
class LogProbs:
    """What ``llama-perplexity --kl-divergence-base`` saves of one run.

    Attributes:
        tokens: (chunks, n_ctx) int64, the token ids llama.cpp evaluated (its tokenizer's;
            a chunk's first one is replaced by BOS when the file says ``add_bos_token``).
        first: the first position whose log-probs are saved (``n_ctx // 2``).
        values: (chunks, n_ctx - 1 - first, n_vocab) float64 log-probabilities of the
            positions ``first .. n_ctx - 2``, as llama.cpp stores them: one uint16 step of
            ``step`` per value above ``max - 16`` (nan where the value is at or below it).
        step: (chunks, n_ctx - 1 - first) each row's step (its range / 65535).
    """

    tokens: Any
    first: int
    values: Any
    step: Any


def log_probs(
    peer: LlamaCpp, model: Path, text: str, n_ctx: int, workdir: Path, threads: int = 1
) -> LogProbs:
    """llama.cpp's log-probabilities of ``text``: ``llama-perplexity`` over one chunk of
    ``n_ctx`` tokens (float32 KV cache, no flash attention), read back from its
    ``--kl-divergence-base`` file.

    Raises:
        RuntimeError: llama-perplexity failed (the end of its output), or wrote a file
            that is not its logits format.
    """
    import numpy as np

    (workdir / "text.txt").write_text(text)
    out = workdir / "logits.bin"
    cmd = [
        str(peer.tool("llama-perplexity")),
        "-m", str(model), "-f", str(workdir / "text.txt"), "-c", str(n_ctx), "-b", str(n_ctx),
        "--chunks", "1", "-t", str(threads), "-ctk", "f32", "-ctv", "f32", "-fa", "off",
        "--kl-divergence-base", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(
            f"llama-perplexity on {model.name} failed ({proc.returncode}):\n"
            + (proc.stderr + proc.stdout)[-2000:]
        )
    raw = out.read_bytes()
    if raw[:8] != b"_logits_" or len(raw) < 20:
        raise RuntimeError(f"llama-perplexity wrote {out} without its `_logits_` header")
    ctx, vocab, chunks = (int(v) for v in np.frombuffer(raw[8:20], dtype=np.int32))
    tokens = np.frombuffer(raw, dtype=np.int32, count=chunks * ctx, offset=20)
    row = 2 * ((vocab + 1) // 2) + 4  # two float32 (step, lowest log-prob), then uint16s
    first = ctx // 2
    data = np.frombuffer(raw, dtype=np.uint16, offset=20 + 4 * chunks * ctx)
    data = data.reshape(chunks, ctx - 1 - first, row)
    head = np.ascontiguousarray(data[..., :4]).view(np.float32)  # (chunks, rows, 2)
    codes = data[..., 4 : 4 + vocab].astype(np.float64)
    values = head[..., 1:2].astype(np.float64) + codes * head[..., 0:1]
    values[codes == 0] = np.nan  # at or below the stored range: not kept
    return LogProbs(tokens.reshape(chunks, ctx).astype(np.int64), first, values, head[..., 0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", default=DEFAULT_VERSION, help="llama-cpp-python release")
    parser.add_argument("--jobs", type=int, default=None, help="parallel compile jobs")
    parser.add_argument("--check", action="store_true", help="only say whether it is built")
    parser.add_argument("--isa", choices=ISAS, default="native",
                        help="CPU class to build for (a variant: llama-bench alone)")  # fmt: skip
    parser.add_argument("--repack", action="store_true",
                        help="weight repacking on (GGML_CPU_REPACK=ON; a variant)")  # fmt: skip
    parser.add_argument("--for-tests", action="store_true",
                        help="for the tests alone: llama.cpp's C++ at -O0, ggml at -O3 (no peer "
                        "to time against)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.check:
        peer = find(isa=args.isa, repack=args.repack)
        print(peer.root if peer else f"not built in {peer_dir(args.isa, args.repack)}")
        return 0 if peer else 1
    peer = build(
        args.version, args.jobs, isa=args.isa, repack=args.repack, for_tests=args.for_tests
    )
    print(peer.root)
    print(json.dumps(peer.info, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
