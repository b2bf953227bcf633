"""When attnlab's compiled step is built, and when a failed build is tried again.

No compiler needed: the build itself is replaced by a stand-in that records its calls.
"""

from __future__ import annotations

import os
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from attnlab import native
from attnlab.quant import Q5Linear, Q8Linear
from cli_runner import run_main


@pytest.fixture
def fresh(monkeypatch, tmp_path) -> Iterator[list[int]]:
    """A new process's state over an empty cache, the build replaced by a failing one
    that records its calls; the real state comes back afterwards."""
    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path))
    monkeypatch.delenv(native.NATIVE_ENV, raising=False)
    builds: list[int] = []

    def broken():
        builds.append(1)
        raise RuntimeError("error: no space left on device")

    monkeypatch.setattr(native, "_build", broken)
    monkeypatch.setattr(native, "_toolchain", lambda: "c++ 13.2 | ninja 1.11")
    state = native._loaded, native._why, native._tried, native._skipped
    native._reset()
    yield builds
    native._loaded, native._why, native._tried, native._skipped = state


def test_a_weight_products_forward_never_builds(fresh):
    q8 = Q8Linear.from_float(torch.randn(16, 64))
    q5 = Q5Linear.from_float(torch.randn(16, 64))
    x = torch.randn(3, 64)
    with torch.no_grad():
        q8(x), q5(x), q8(x[:1]), q5(x[:1])  # the prompt's product and the rows' kernel
    assert fresh == []
    assert native.loaded() is None


def test_load_built_loads_a_build_and_never_starts_one(fresh, monkeypatch, tmp_path):
    """What a soft-capped call and a GGUF header's read take: nothing without a build for
    this machine (and no build started), the build when one is there."""
    assert native.load_built() is None and fresh == []
    assert native.load_built() is None and fresh == []  # asked again: still no build
    module = types.ModuleType("attnlab_native_stand_in")
    folder = native.build_dir()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "attnlab_native_stand_in.so").write_bytes(b"")  # a build is there
    loads: list[int] = []

    def load():
        loads.append(1)
        return module

    monkeypatch.setattr(native, "_build", load)  # what extension() calls to load it
    monkeypatch.setattr(native, "_tables_differ", lambda m: None)  # a stand-in's tables
    assert native.would_load()
    assert native.load_built() is module and native.loaded() is module
    assert native.load_built() is module and loads == [1]  # loaded once


def test_a_failure_stands_for_the_same_toolchain_and_is_retried_for_another(fresh, monkeypatch):
    assert native.extension() is None and fresh == [1]
    log = native.build_dir() / "failed.log"
    assert "toolchain: c++ 13.2 | ninja 1.11" in log.read_text()
    native._reset()  # a new process, the same compiler: not tried again
    assert native.extension() is None and fresh == [1]
    why = native.why_not_native() or ""
    assert "failed before" in why and "ATTNLAB_NATIVE=1" in why and str(log) in why
    monkeypatch.setattr(native, "_toolchain", lambda: "c++ 14.1 | ninja 1.11")
    native._reset()  # a new compiler: tried again
    assert native.extension() is None and fresh == [1, 1]


def test_a_failed_log_without_a_toolchain_or_old_is_retried(fresh):
    log = native.build_dir() / "failed.log"
    log.parent.mkdir(parents=True)
    log.write_text("RuntimeError: killed\n")  # an older attnlab's log: no build key in it
    assert native.extension() is None and fresh == [1]
    assert "toolchain:" in log.read_text()
    old = time.time() - native.RETRY_AFTER_S - 60
    os.utime(log, (old, old))
    native._reset()
    assert native.extension() is None and fresh == [1, 1]


def test_required_retries_a_standing_failure_and_a_success_clears_it(fresh, monkeypatch):
    assert native.extension() is None and fresh == [1]
    log = native.build_dir() / "failed.log"
    # a build that exports the tables the step checks (native.PRODUCT_KINDS, ...)
    built = types.SimpleNamespace(
        PRODUCT_KINDS=dict(native.PRODUCT_KINDS),
        ACTIVATIONS={name: i for i, name in enumerate(native.STEP_ACTIVATIONS)},
    )
    monkeypatch.setattr(native, "_build", lambda: built)
    monkeypatch.setenv(native.NATIVE_ENV, "1")
    native._reset()
    assert native.extension() is built
    assert native.loaded() is built and not log.exists()


def test_info_says_how_to_retry_a_failed_build(fresh, capsys):
    assert native.extension() is None
    native._reset()
    code, out, err = run_main(capsys, "info", "--seq-len", "16")
    assert code == 0, err
    text = "".join(out.split())  # rich wraps long lines anywhere
    assert "compileddecodestep" in text and "failurestands" in text
    assert "ATTNLAB_NATIVE=1" in text and "failed.log" in text
    assert fresh == [1]  # info reports; it does not build


def test_a_stamped_build_is_imported_without_the_build_tools(tmp_path, monkeypatch):
    """A module whose stamp (size, mtime) matches is imported directly; one that does not
    (an interrupted link, a file changed since) goes through PyTorch's build tools, which
    then stamp it. Never a half-written module imported."""
    import json
    import shutil

    if native.extension() is None:
        pytest.skip(f"native build is unavailable: {native.why_not_native()}")
    built = native.build_dir()
    name = "attnlab_native_" + built.name
    folder = tmp_path / built.name
    folder.mkdir()
    shutil.copy2(built / f"{name}.so", folder / f"{name}.so")
    stamp = {"file": f"{name}.so", **native._stamp_of(folder / f"{name}.so")}
    (folder / native._STAMP).write_text(json.dumps(stamp))
    module = native._import_built(folder, name)
    assert module is not None and hasattr(module, "Step")
    os.utime(folder / f"{name}.so", ns=(1, 1))  # the file changed since it was stamped
    assert native._import_built(folder, name) is None
    (folder / native._STAMP).write_text("{not json")
    assert native._import_built(folder, name) is None
    calls = []
    monkeypatch.setattr(native, "build_dir", lambda: folder)
    import torch.utils.cpp_extension as cpp_extension

    def load(module_name, *args, **kwargs):
        calls.append(module_name)
        return types.SimpleNamespace(name=module_name)

    monkeypatch.setattr(cpp_extension, "load", load)
    assert native._build().name == name and calls == [name]
    assert json.loads((folder / native._STAMP).read_text())["mtime_ns"] == 1
    assert hasattr(native._build(), "Step") and calls == [name]  # stamped: imported


def test_the_sources_include_the_operators_they_call_not_all_of_pytorch():
    """Every build parses what the sources include: ``<ATen/ATen.h>`` (every operator) and
    ``<torch/extension.h>`` (the C++ frontend too) took 17 s of a 45-second build, and each
    branch of the kernels is built on its own (``tests/native_branches.py``)."""
    here = Path(native.__file__).parent
    sources = sorted([*here.glob("*.cpp"), *here.glob("*.h")])
    assert len(sources) >= 6
    for path in sources:
        includes = [
            line.split(None, 1)[1].strip()
            for line in path.read_text().splitlines()
            if line.startswith("#include")
        ]
        assert "<ATen/ATen.h>" not in includes and "<torch/extension.h>" not in includes, path
        assert "<torch/torch.h>" not in includes, path


def _fake_ninja_package(monkeypatch, folder: Path | None) -> None:
    """No ``ninja`` on PATH; the ``ninja`` package with its binary in ``folder`` (None:
    not installed)."""
    import shutil
    import sys

    real_which = shutil.which
    monkeypatch.setattr(
        native.shutil, "which", lambda cmd, *a, **k: None if cmd == "ninja" else real_which(cmd)
    )
    if folder is None:
        monkeypatch.setitem(sys.modules, "ninja", None)  # import ninja: ImportError
    else:
        monkeypatch.setitem(sys.modules, "ninja", types.SimpleNamespace(BIN_DIR=str(folder)))


def test_ninja_comes_from_the_package_when_none_is_on_path(fresh, monkeypatch, tmp_path):
    """The ``ninja`` package (a dependency) puts its binary in the environment's scripts
    folder, on PATH only where the environment is activated: the build finds it there and
    puts its folder on PATH while PyTorch runs ``ninja``, then restores PATH."""
    binary = tmp_path / "scripts" / "ninja"
    binary.parent.mkdir()
    binary.write_text("#!/bin/sh\necho 1.13.2\n")
    binary.chmod(0o755)
    _fake_ninja_package(monkeypatch, binary.parent)
    monkeypatch.setenv("PATH", "/nowhere")
    assert native._ninja() == str(binary)
    with native._ninja_on_path():
        assert os.environ["PATH"].split(os.pathsep) == [str(binary.parent), "/nowhere"]
    assert os.environ["PATH"] == "/nowhere"
    monkeypatch.delenv("PATH")
    with native._ninja_on_path():
        assert os.environ["PATH"] == str(binary.parent)
    assert "PATH" not in os.environ


def test_without_ninja_anywhere_the_build_is_not_tried_and_says_why(fresh, monkeypatch):
    _fake_ninja_package(monkeypatch, None)
    monkeypatch.setattr(native, "_compiler", lambda: "sh")  # a compiler on PATH
    assert native._ninja() is None
    assert native.extension() is None and fresh == []
    assert "no Ninja (pip install ninja" in (native.why_not_native() or "")
    _fake_ninja_package(monkeypatch, Path("/nowhere"))  # the package without its binary
    assert native._ninja() is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a POSIX toolchain in /usr/bin")
def test_a_real_build_with_no_ninja_on_path_takes_the_packages(monkeypatch, tmp_path):
    """PyTorch's build runs ``ninja`` by name: with none on PATH (a venv's python run by
    its path) the build still runs, with the ``ninja`` package's binary. A one-function
    module stands in for the sources (seconds, not the step's tens)."""
    import shutil

    ninja = pytest.importorskip("ninja")
    if shutil.which(native._compiler()) is None:
        pytest.skip("no C++ compiler")
    bin_dir = tmp_path / "bin"  # every program of the system's PATH but ninja
    bin_dir.mkdir()
    for folder in ("/usr/local/bin", "/usr/bin", "/bin"):
        for program in Path(folder).glob("*"):
            target = bin_dir / program.name
            if program.name != "ninja" and not target.exists():
                target.symlink_to(program)
    source = tmp_path / "stand_in.cpp"
    source.write_text(
        "#include <pybind11/pybind11.h>\n"
        "int answer() { return 42; }\n"
        'PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", &answer); }\n'
    )
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "SOURCES", (str(source),))
    monkeypatch.setattr(native, "_flags", lambda: ("-O0",))
    assert shutil.which("ninja") is None and Path(ninja.BIN_DIR, "ninja").is_file()
    module = native._build()
    assert module.answer() == 42
    assert os.environ["PATH"] == str(bin_dir)
