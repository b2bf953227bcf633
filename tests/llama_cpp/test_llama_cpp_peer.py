"""benchmarks/peers/llama_cpp.py without building anything: where the cache is, when a
folder counts as built, which llama.cpp commit a llama-cpp-python release vendors, and
the variants per CPU class and repacking (flags, folders, what a variant builds)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _peer():
    spec = importlib.util.spec_from_file_location(
        "peer_llama_cpp", ROOT / "benchmarks" / "peers" / "llama_cpp.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


peer = _peer()

CHANGELOG = """# Changelog

## [Unreleased]

## [0.3.36]

- feat: update llama.cpp to ggml-org/llama.cpp@0c1e57098

## [0.3.35]

- feat: update llama.cpp to ggml-org/llama.cpp@4df29be4f
- fix(example): retain recurrent state
- feat: update llama.cpp to ggml-org/llama.cpp@adb55e514

## [0.3.34]

- fix: something without a llama.cpp update
"""


def test_the_vendored_commit_is_the_newest_of_the_release_section():
    assert peer._vendored_commit(CHANGELOG, "0.3.36") == "0c1e57098"
    assert peer._vendored_commit(CHANGELOG, "0.3.35") == "4df29be4f"
    assert peer._vendored_commit(CHANGELOG, "0.3.34") is None
    assert peer._vendored_commit(CHANGELOG, "0.3.3") is None  # not a prefix match


def test_the_cache_folder_follows_attnlab_peers(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNLAB_PEERS", str(tmp_path))
    assert peer.cache_dir() == tmp_path / "llama.cpp"
    monkeypatch.delenv("ATTNLAB_PEERS")
    assert peer.cache_dir() == Path.home() / ".cache" / "attnlab" / "peers" / "llama.cpp"


def test_a_folder_counts_as_built_only_with_its_record_tools_and_converter(tmp_path):
    root = tmp_path / "llama.cpp"
    assert peer.find(root) is None
    (root / "src").mkdir(parents=True)
    (root / "src" / "convert_hf_to_gguf.py").write_text("")
    (root / "converter-packages" / "transformers").mkdir(parents=True)
    (root / peer.RECORD).write_text(json.dumps({"llama_cpp_python": "0.3.36"}))
    assert peer.find(root) is None  # no tools
    (root / "build" / "bin").mkdir(parents=True)
    for tool in peer.TOOLS:
        path = root / "build" / "bin" / tool
        path.write_text("")
        os.chmod(path, 0o755)
    found = peer.find(root)
    assert found is not None and found.tool("llama-quantize") == path.parent / "llama-quantize"
    assert found.info["llama_cpp_python"] == "0.3.36"
    (root / peer.RECORD).unlink()  # written last: without it the build did not finish
    assert peer.find(root) is None


def _flags(isa: str, repack: bool = False) -> dict[str, str]:
    """The build's -D options as name -> value (each named once)."""
    flags = peer.cmake_flags(isa, repack)
    pairs = [f.removeprefix("-D").split("=", 1) for f in flags]
    assert len({k for k, _ in pairs}) == len(pairs), f"an option named twice: {flags}"
    return dict(pairs)


def test_the_default_build_keeps_its_flags():
    assert peer.cmake_flags() == peer.CMAKE_FLAGS
    assert _flags("native")["GGML_NATIVE"] == "ON"
    assert _flags("native")["GGML_CPU_REPACK"] == "OFF"


def test_each_cpu_class_builds_with_its_instruction_sets_alone():
    common = {"GGML_NATIVE": "OFF", "GGML_AVX": "ON", "GGML_AVX2": "ON", "GGML_FMA": "ON",
              "GGML_F16C": "ON", "GGML_AVX512_VNNI": "OFF", "GGML_AVX512_BF16": "OFF",
              "GGML_AMX_TILE": "OFF", "GGML_AMX_INT8": "OFF", "GGML_AMX_BF16": "OFF"}  # fmt: skip
    avx512, avx2 = _flags("avx512-core"), _flags("avx2")
    assert avx512.items() >= common.items() and avx2.items() >= common.items()
    assert avx512["GGML_AVX512"] == "ON" and avx2["GGML_AVX512"] == "OFF"
    assert avx2["GGML_AVX_VNNI"] == "OFF"  # x86-64-v3 has no VNNI of any width
    for isa in peer.ISAS:  # repacking changes that option alone
        on, off = _flags(isa, True), _flags(isa)
        assert on["GGML_CPU_REPACK"] == "ON" and off["GGML_CPU_REPACK"] == "OFF"
        assert {k: v for k, v in on.items() if k != "GGML_CPU_REPACK"} == {
            k: v for k, v in off.items() if k != "GGML_CPU_REPACK"
        }
    with pytest.raises(SystemExit, match="unknown isa 'avx'"):
        peer.cmake_flags("avx")


def test_the_cpu_classes_are_the_benchmarks_classes():
    import _isa

    assert tuple(peer.ISA_FLAGS) == tuple(_isa.ISAS)


def test_the_ggml_options_named_exist_in_the_vendored_source():
    built = peer.find()
    if built is None:
        pytest.skip("llama.cpp is not built: its source is not here")
    text = (built.src / "ggml" / "CMakeLists.txt").read_text()
    declared = set(re.findall(r"option\((GGML_\w+)", text))
    named = {k for isa in peer.ISAS for k in _flags(isa, True) if k.startswith("GGML_")}
    assert named <= declared, f"not options of this ggml: {sorted(named - declared)}"


def test_each_variant_has_its_own_folder_beside_the_default(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNLAB_PEERS", str(tmp_path))
    assert peer.peer_dir() == tmp_path / "llama.cpp"
    assert peer.peer_dir("native", True) == tmp_path / "llama.cpp-native-repack"
    assert peer.peer_dir("avx2") == tmp_path / "llama.cpp-avx2"
    assert peer.peer_dir("avx512-core", True) == tmp_path / "llama.cpp-avx512-core-repack"
    folders = {peer.peer_dir(i, r) for i in peer.ISAS for r in (False, True)}
    assert len(folders) == 2 * len(peer.ISAS)


def _tool(root: Path, name: str) -> None:
    path = root / "build" / "bin" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")
    os.chmod(path, 0o755)


def test_a_variant_counts_as_built_with_the_tools_its_record_lists(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNLAB_PEERS", str(tmp_path))
    root = peer.peer_dir("avx2")
    assert peer.find(isa="avx2") is None
    root.mkdir()
    info = {"llama_cpp_python": "0.3.36", "isa": "avx2", "repack": False,
            "tools": ["llama-bench"], "cmake_flags": list(peer.cmake_flags("avx2"))}  # fmt: skip
    (root / peer.RECORD).write_text(json.dumps(info))
    assert peer.find(isa="avx2") is None  # no llama-bench
    _tool(root, "llama-bench")
    found = peer.find(isa="avx2")  # no converter, no converter packages, no llama-quantize
    assert found is not None and found.root == root
    assert (found.isa, found.repack) == ("avx2", False)
    assert peer.find(root) == found
    assert peer.find(isa="avx2", repack=True) is None  # another folder
    # A record of the default build still needs every tool and the converter.
    default = peer.peer_dir()
    default.mkdir()
    (default / peer.RECORD).write_text(json.dumps({**info, "isa": "native"}))
    for tool in peer.TOOLS:
        _tool(default, tool)
    assert peer.find() is None


def _fake_toolchain(monkeypatch):
    """cmake and ninja that record their commands; ninja 'builds' the tools asked for."""
    commands: list[list[str]] = []

    def run(cmd, **kwargs):
        commands.append(cmd)
        if cmd[0] == "ninja":
            for name in cmd[cmd.index("-C") + 2 :]:
                _tool(Path(cmd[cmd.index("-C") + 1]).parent, name)

    monkeypatch.setattr(peer, "_need", lambda program: program)
    monkeypatch.setattr(peer, "_run", run)
    monkeypatch.setattr(peer, "_compiler", lambda: "c++ (fake) 1.0")
    return commands


def _fake_default(root: Path, version: str = "0.3.36") -> None:
    (root / "src" / "ggml").mkdir(parents=True)
    (root / "src" / "convert_hf_to_gguf.py").write_text("# the converter\n")
    (root / "src" / "ggml" / "CMakeLists.txt").write_text(
        "set(GGML_VERSION_MAJOR 0)\nset(GGML_VERSION_MINOR 25)\nset(GGML_VERSION_PATCH 3)\n"
    )
    (root / "converter-packages" / "transformers").mkdir(parents=True)
    for tool in peer.TOOLS:
        _tool(root, tool)
    info = {"llama_cpp_python": version, "llama_cpp_commit": "0c1e57098"}
    (root / peer.RECORD).write_text(json.dumps(info))


def test_a_variant_builds_llama_bench_from_a_copy_of_the_default_source(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNLAB_PEERS", str(tmp_path))
    commands = _fake_toolchain(monkeypatch)

    def no_download(version, root):
        raise AssertionError("the default build's source was there to copy")

    monkeypatch.setattr(peer, "_download_source", no_download)
    _fake_default(peer.peer_dir())
    built = peer.build(isa="avx2", repack=True, jobs=1)
    root = tmp_path / "llama.cpp-avx2-repack"
    assert built.root == root and peer.find(isa="avx2", repack=True) == built
    assert (root / "src" / "convert_hf_to_gguf.py").read_text() == "# the converter\n"
    assert not (root / "converter-packages").exists()
    cmake, ninja = commands
    assert cmake[cmake.index("Ninja") + 1 :] == [
        *peer.cmake_flags("avx2", True), "-DLLAMA_BUILD_COMMIT=0c1e57098"
    ]  # fmt: skip
    assert ninja[-3:] == ["-j", "1", "llama-bench"]
    info = json.loads((root / peer.RECORD).read_text())
    assert (info["isa"], info["repack"], info["tools"]) == ("avx2", True, ["llama-bench"])
    assert info["cmake_flags"] == cmake[cmake.index("Ninja") + 1 :]
    assert info["llama_cpp_commit"] == "0c1e57098" and info["ggml_version"] == "0.25.3"
    assert "converter_packages" not in info
    assert peer.build(isa="avx2", repack=True) == built and len(commands) == 2  # built: once


def test_a_variant_downloads_when_the_default_holds_another_release(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNLAB_PEERS", str(tmp_path))
    _fake_toolchain(monkeypatch)
    downloads = []

    def download(version, root):
        downloads.append((version, root))
        _fake_default(tmp_path / "sdist")
        shutil.move(tmp_path / "sdist" / "src", root / "src")
        (root / "llama_cpp_commit.txt").write_text("4df29be4f\n")

    monkeypatch.setattr(peer, "_download_source", download)
    _fake_default(peer.peer_dir(), version="0.3.35")
    built = peer.build(version="0.3.36", isa="avx512-core")
    assert downloads == [("0.3.36", tmp_path / "llama.cpp-avx512-core")]
    assert built.info["llama_cpp_commit"] == "4df29be4f"


def test_check_names_the_variant_folder(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("ATTNLAB_PEERS", str(tmp_path))
    assert peer.main(["--check", "--isa", "avx512-core", "--repack"]) == 1
    assert str(tmp_path / "llama.cpp-avx512-core-repack") in capsys.readouterr().out


@pytest.mark.parametrize("data_filter", [True, False])
def test_the_sdist_is_extracted_inside_its_folder_with_or_without_the_data_filter(
    tmp_path, monkeypatch, data_filter
):
    """Debian's Python 3.11.2 has no ``filter`` argument to ``extractall``: the source
    still extracts there, and a member that would land outside the folder (``..``, an
    absolute name, a link out) is refused with its name, with or without the filter."""
    import io
    import tarfile

    def sdist(*entries: tarfile.TarInfo) -> Path:
        path = tmp_path / f"sdist{len(list(tmp_path.glob('*.tar')))}.tar"
        with tarfile.open(path, "w") as tar:
            for info in entries:
                data = b"x" if info.isfile() else None
                if data is not None:
                    info.size = len(data)
                tar.addfile(info, io.BytesIO(data) if data is not None else None)
        return path

    def member(name: str, link: str | None = None) -> tarfile.TarInfo:
        info = tarfile.TarInfo(name)
        if link is not None:
            info.type, info.linkname = tarfile.SYMTYPE, link
        return info

    if not data_filter:
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
    good = sdist(member("src/a.c"), member("src/link", "a.c"))
    dest = tmp_path / "out"
    with tarfile.open(good) as tar:
        peer._extract(tar, tar.getmembers(), dest)
    assert (dest / "src" / "a.c").read_bytes() == b"x"
    for bad in (member("../escape.c"), member("/abs.c"), member("src/out", "../../x")):
        with tarfile.open(sdist(bad)) as tar, pytest.raises(SystemExit, match="outside"):
            peer._extract(tar, tar.getmembers(), tmp_path / "out2")
        assert not (tmp_path / "escape.c").exists()


def test_a_build_for_the_tests_keeps_ggml_optimised_and_is_rebuilt_in_release_for_timing(
    monkeypatch, tmp_path
):
    monkeypatch.setenv("ATTNLAB_PEERS", str(tmp_path))
    commands = _fake_toolchain(monkeypatch)
    root = peer.peer_dir()
    _fake_default(root)
    for tool in peer.TOOLS:  # the source and packages stay, the tools are not built yet
        (root / "build" / "bin" / tool).unlink()
    (root / peer.RECORD).unlink()
    built = peer.build(jobs=2, for_tests=True)
    assert built.for_tests and peer.find() == built
    cmake = commands[0]
    flags = cmake[cmake.index("Ninja") + 1 :]
    assert "-DCMAKE_CXX_FLAGS_RELEASE=-O0 -DNDEBUG" in flags
    (include,) = [f for f in flags if f.startswith("-DCMAKE_PROJECT_ggml_INCLUDE=")]
    # The file CMake includes after ggml's project() puts ggml's C++ back at -O3.
    text = Path(include.split("=", 1)[1]).read_text()
    assert re.search(r'^set\(CMAKE_CXX_FLAGS_RELEASE "-O3 -DNDEBUG"\)$', text, re.M)
    # and compiles llama-common as unity sources, json.cpp on its own, once the target exists
    assert "set_target_properties(llama-common PROPERTIES UNITY_BUILD ON" in text
    assert "common/json.cpp" in text and "SKIP_UNITY_BUILD_INCLUSION ON" in text
    assert 'cmake_language(DEFER DIRECTORY "${CMAKE_SOURCE_DIR}"' in text
    assert json.loads((root / peer.RECORD).read_text())["for_tests"] is True
    # It serves the tests again without a rebuild; asked for without the flag (a peer to
    # time against), it is built again in release, from a fresh CMake cache.
    assert peer.build(for_tests=True) == built and len(commands) == 2
    (root / "build" / "CMakeCache.txt").write_text("CMAKE_CXX_FLAGS_RELEASE:STRING=-O0\n")
    release = peer.build(jobs=2)
    assert not release.for_tests and not (root / "build" / "CMakeCache.txt").exists()
    cmake = commands[2]
    assert cmake[cmake.index("Ninja") + 1 : -1] == list(peer.cmake_flags())
    assert not any("O0" in f or "ggml_INCLUDE" in f for f in peer.cmake_flags())
    # A release build serves the tests as it is.
    assert peer.build(for_tests=True) == release and len(commands) == 4
    with pytest.raises(SystemExit, match="default folder"):
        peer.build(isa="avx2", for_tests=True)
