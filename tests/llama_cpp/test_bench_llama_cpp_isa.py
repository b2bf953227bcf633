"""benchmarks/bench_llama_cpp.py's CPU classes and repacking without building or timing
anything: when the script starts itself again and with what environment, which builds it
asks for, the record's config per setting, and the stand-in for a failing repacking build
(fake llama-bench scripts)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

import bench_llama_cpp as bench  # noqa: E402
from _isa import ISAS  # noqa: E402

PEERS = bench.peers
SETTINGS = {k for v in ISAS.values() for k in v}


def _clean_env() -> dict[str, str]:
    """This process's environment as a native run's: no class settings, no marker."""
    drop = SETTINGS | {bench.ISA_MARKER, "ATTNLAB_NATIVE"}
    return {k: v for k, v in os.environ.items() if k not in drop}


def test_native_runs_in_this_process():
    assert bench.reexec_env("native", _clean_env()) is None


def test_a_cpu_class_starts_again_once_with_its_settings():
    env = _clean_env()
    for isa in ("avx2", "avx512-core"):
        again = bench.reexec_env(isa, env)
        assert again is not None
        assert again.items() >= ISAS[isa].items()
        assert again[bench.ISA_MARKER] == isa and again["ATTNLAB_NATIVE"] == "1"
        assert {k: v for k, v in again.items() if k not in SETTINGS | {
            bench.ISA_MARKER, "ATTNLAB_NATIVE"}} == env  # fmt: skip
        assert bench.reexec_env(isa, again) is None  # the started process does not loop


def test_a_stray_setting_is_cleared_or_replaced():
    capped = {**_clean_env(), "ONEDNN_MAX_CPU_ISA": "AVX2"}
    again = bench.reexec_env("native", capped)
    assert again is not None and "ONEDNN_MAX_CPU_ISA" not in again  # native means uncapped
    as_avx2 = bench.reexec_env("avx2", _clean_env())
    assert as_avx2 is not None
    other = bench.reexec_env("avx512-core", as_avx2)  # started as avx2, asked for another
    assert other is not None and other["ATEN_CPU_CAPABILITY"] == "avx512"


def test_a_started_process_without_the_settings_stops_instead_of_looping():
    stripped = {**_clean_env(), bench.ISA_MARKER: "avx2"}
    with pytest.raises(SystemExit, match="ATEN_CPU_CAPABILITY"):
        bench.reexec_env("avx2", stripped)


def test_main_starts_itself_again_with_the_same_arguments(monkeypatch):
    for name in (*SETTINGS, bench.ISA_MARKER, "ATTNLAB_NATIVE"):
        monkeypatch.delenv(name, raising=False)
    started = []

    class StartedError(Exception):
        pass

    def execve(program, argv, env):
        started.append((program, argv, env))
        raise StartedError

    monkeypatch.setattr(bench.os, "execve", execve)
    args = ["--isa", "avx2", "--agreement-only", "--model", "smollm2-135m-instruct"]
    with pytest.raises(StartedError):
        bench.main(args)
    ((program, argv, env),) = started
    assert program == sys.executable
    assert argv == [sys.executable, str(ROOT / "benchmarks" / "bench_llama_cpp.py"), *args]
    assert env[bench.ISA_MARKER] == "avx2" and env["ONEDNN_MAX_CPU_ISA"] == "AVX2"


def test_every_setting_has_its_own_config():
    names = {bench.config_name("smollm2", i, r) for i in ISAS for r in (False, True)}
    assert len(names) == 2 * len(ISAS)
    assert bench.config_name("smollm2", "native", False) == "smollm2"  # the records before
    assert bench.config_name("gemma3-270m", "avx2", True, quick=True) == (
        "gemma3-270m-avx2-repack-quick"
    )


def _fake_build(root: Path, isa: str, repack: bool, script: str) -> PEERS.LlamaCpp:
    """A folder that find() counts as a variant build, its llama-bench a shell script."""
    tool = root / "build" / "bin" / "llama-bench"
    tool.parent.mkdir(parents=True)
    tool.write_text("#!/bin/sh\n" + script)
    os.chmod(tool, 0o755)
    info = {"llama_cpp_python": "0.3.36", "isa": isa, "repack": repack, "tools": ["llama-bench"]}
    (root / PEERS.RECORD).write_text(json.dumps(info))
    found = PEERS.find(root)
    assert found is not None
    return found


def test_a_missing_build_names_the_command_that_builds_it(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNLAB_PEERS", str(tmp_path))
    with pytest.raises(SystemExit, match=r"`python benchmarks/peers/llama_cpp.py --isa avx2`"):
        bench.find_peer("avx2")
    _fake_build(PEERS.peer_dir("avx2", True), "avx2", True, "exit 0\n")
    with pytest.raises(SystemExit, match=r"stands in.*llama_cpp.py --isa avx2`.*--build-peer"):
        bench.find_peer("avx2", repack=True)  # the repacking build alone is not enough
    _fake_build(PEERS.peer_dir("avx2"), "avx2", False, "exit 0\n")
    builds = bench.find_peer("avx2", repack=True)
    assert builds.plain.root == tmp_path / "llama.cpp-avx2"
    assert builds.repack is not None and builds.repack.root == tmp_path / "llama.cpp-avx2-repack"
    assert builds.measured == builds.repack
    assert bench.build_command("avx512-core", True) == (
        "python benchmarks/peers/llama_cpp.py --isa avx512-core --repack"
    )


def test_a_build_for_the_tests_alone_is_no_peer_to_time_against(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNLAB_PEERS", str(tmp_path))
    root = PEERS.peer_dir("avx2")
    _fake_build(root, "avx2", False, "exit 0\n")
    info = json.loads((root / PEERS.RECORD).read_text())
    (root / PEERS.RECORD).write_text(json.dumps({**info, "for_tests": True}))
    with pytest.raises(SystemExit, match=r"for the tests alone.*llama_cpp.py --isa avx2`"):
        bench.find_peer("avx2")
    built = []
    monkeypatch.setattr(PEERS, "build", lambda **kw: built.append(kw) or "release")
    assert bench.find_peer("avx2", build=True).plain == "release"
    assert built == [{"isa": "avx2", "repack": False}]


BENCH_JSON = json.dumps([
    {"n_prompt": 8, "n_gen": 0, "avg_ts": 100.0, "samples_ts": [100.0], "n_threads": 2},
    {"n_prompt": 0, "n_gen": 4, "avg_ts": 20.0, "samples_ts": [20.0], "n_threads": 2},
])  # fmt: skip


def test_the_plain_build_stands_in_where_the_repacking_build_crashes(tmp_path):
    calls = tmp_path / "calls"
    crash = f'echo repack "$@" >> {calls}\nkill -SEGV $$\n'
    plain = f"echo plain \"$@\" >> {calls}\ncat <<'JSON'\n{BENCH_JSON}\nJSON\n"
    builds = bench.Builds(
        plain=_fake_build(tmp_path / "llama.cpp-avx2", "avx2", False, plain),
        repack=_fake_build(tmp_path / "llama.cpp-avx2-repack", "avx2", True, crash),
    )
    kw = {"threads": 2, "prompt": 8, "new": 4, "reps": 1}
    figures = bench.run_llama_bench(builds, tmp_path / "m.gguf", **kw)
    assert figures["tg4"].avg_ts == 20.0 and figures["pp8"].avg_ts == 100.0
    note = builds.repack_failed
    assert note is not None and note in bench.FALLBACKS
    assert "died by signal 11 (SIGSEGV)" in note and PEERS.cpu_name() in note
    assert str(builds.repack.root) in note and str(builds.plain.root) in note
    assert builds.measured == builds.plain
    bench.run_llama_bench(builds, tmp_path / "m.gguf", **kw)  # from now on the plain build
    lines = calls.read_text().splitlines()
    assert [line.split()[0] for line in lines] == ["repack", "plain", "plain"]
    assert lines[0].endswith("--repack 1") and "--repack" not in lines[1]
    bench.FALLBACKS.discard(note)


def test_a_repacking_build_that_runs_is_the_peer(tmp_path):
    ok = f"cat <<'JSON'\n{BENCH_JSON}\nJSON\n"
    builds = bench.Builds(
        plain=_fake_build(tmp_path / "plain", "avx512-core", False, "exit 3\n"),
        repack=_fake_build(tmp_path / "repack", "avx512-core", True, ok),
    )
    figures = bench.run_llama_bench(builds, tmp_path / "m.gguf", threads=2, prompt=8, new=4,
                                    reps=1)  # fmt: skip
    assert figures["tg4"].avg_ts == 20.0
    assert builds.repack_failed is None and builds.measured == builds.repack


def test_a_failure_note_says_how_it_failed():
    note = bench.repack_failure(1, "Some CPU", Path("/a"), Path("/b"))
    assert note == (
        "llama-bench of the repacking build (/a) exited with status 1 on this CPU (Some CPU); "
        "the build without repacking (/b) stood in"
    )
    assert "died by signal 4 (SIGILL)" in bench.repack_failure(-4, "x", Path("/a"), Path("/b"))
