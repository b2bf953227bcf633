"""Benchmark records (benchmarks/_records.py) and the docs page made from them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

import make_docs_page  # noqa: E402
from _records import Recorder, cpu_of, latest, load_records  # noqa: E402


@pytest.fixture(autouse=True)
def _no_cpu_class_caps(monkeypatch):
    """The records of these tests are this machine's own, whatever the run's environment
    (a run under a CPU class's caps files its records as that class's)."""
    from _isa import ISAS

    for name in {k for caps in ISAS.values() for k in caps}:
        monkeypatch.delenv(name, raising=False)


FIELDS = {"benchmark", "config", "measured", "command", "commit", "local_changes", "date",
          "machine", "threads", "quiet", "figures", "notes"}  # fmt: skip


def test_record_holds_what_was_measured_and_how(tmp_path: Path) -> None:
    rec = Recorder("bench_demo", "small", "a demo measurement", threads=2)
    sum(range(200_000))  # some work of our own, which must not count as other processes'
    rec.add("attnlab", 30.0, "tokens/s", peer="peer library", peer_value=20.0)
    rec.add("call", 2.0, "ms", peer="torch", peer_value=4.0, better="lower")
    rec.note("3/3 pairs quiet")
    path = rec.write(["benchmarks/bench_demo.py", "--reps", "2"], folder=tmp_path)
    data = json.loads(path.read_text())
    assert set(data) == FIELDS
    assert data["command"] == "python benchmarks/bench_demo.py --reps 2"
    assert data["machine"]["cores"] >= 1 and data["machine"]["cpu"]
    assert data["threads"] == 2 and data["date"].endswith("+00:00")
    quiet = data["quiet"]
    assert set(quiet) >= {"loadavg_before", "loadavg_after", "other_processes_cores", "quiet"}
    figs = data["figures"]
    assert figs[0]["ratio"] == pytest.approx(1.5) and figs[0]["peer"] == "peer library"
    assert figs[1]["ratio"] == pytest.approx(0.5) and figs[1]["better"] == "lower"
    assert path.name.startswith("bench_demo--small--")


def test_records_of_one_config_in_the_same_second_are_both_kept(tmp_path: Path) -> None:
    recs = [Recorder("bench_demo", "small", "a demo measurement", threads=1) for _ in range(3)]
    for i, rec in enumerate(recs):
        rec.add("attnlab", float(i), "tokens/s")
        rec._started = recs[0]._started  # the same second
    paths = [rec.write(["b.py"], folder=tmp_path) for rec in recs]
    assert len(set(paths)) == 3 and paths[1].stem == paths[0].stem + "-2"
    values = [json.loads(p.read_text())["figures"][0]["value"] for p in paths]
    assert values == [0.0, 1.0, 2.0]


def test_a_run_under_a_cpu_class_caps_is_that_class_record(tmp_path, monkeypatch) -> None:
    from _isa import ISAS

    assert Recorder("bench_demo", "small", "m", threads=1).config == "small"
    for name, value in ISAS["avx2"].items():
        monkeypatch.setenv(name, value)
    rec = Recorder("bench_demo", "small", "m", threads=1)
    assert rec.config == "small-avx2"
    data = json.loads(rec.write(["b.py"], folder=tmp_path).read_text())
    assert data["config"] == "small-avx2" and data["machine"]["isa_caps"] == ISAS["avx2"]
    assert Recorder("bench_demo", "smollm2-avx2", "m", threads=1).config == "smollm2-avx2"
    monkeypatch.delenv("ATTNLAB_NATIVE_MARCH")  # caps that are no class's
    assert Recorder("bench_demo", "small", "m", threads=1).config == "small-capped"


def test_latest_keeps_the_newest_record_of_each_config(tmp_path: Path) -> None:
    for date, config in [("2026-01-02", "a"), ("2026-01-01", "a"), ("2026-01-01", "b")]:
        rec = {"benchmark": "x", "config": config, "date": f"{date}T00:00:00+00:00", "v": date}
        (tmp_path / f"x--{config}--{date}.json").write_text(json.dumps(rec))
    got = latest(load_records(tmp_path))
    assert [(r["config"], r["v"]) for r in got] == [("a", "2026-01-02"), ("b", "2026-01-01")]


def test_latest_keeps_each_cpus_own_record(tmp_path: Path) -> None:
    """A record of another CPU never replaces this one's; a record from before the SIMD
    field gives way to a later one of the same CPU model, and stands alone otherwise."""
    epyc = {"cpu": "AMD EPYC", "simd": ["avx2", "avx512f", "avx512_bf16"]}
    xeon = {"cpu": "Intel Xeon", "simd": ["avx2", "avx512f"]}
    zen5 = {"cpu": "AMD EPYC", "simd": ["avx2", "avx_vnni", "avx512f", "avx512_bf16"]}
    rows = [
        ("2026-01-01", "a", {"cpu": "AMD EPYC"}),  # before the SIMD field
        ("2026-01-02", "a", epyc),
        ("2026-01-03", "a", xeon),
        ("2026-01-04", "a", zen5),  # another generation of the same model name
        ("2026-01-01", "b", {"cpu": "AMD EPYC"}),
    ]
    for i, (date, config, machine) in enumerate(rows):
        rec = {"benchmark": "x", "config": config, "date": f"{date}T00:00:00+00:00"}
        rec["machine"] = machine
        (tmp_path / f"x--{config}--{i}.json").write_text(json.dumps(rec))
    got = [(cpu_of(r), r["config"], r["date"][:10]) for r in latest(load_records(tmp_path))]
    assert got == [
        ("AMD EPYC (AVX-512 with BF16)", "a", "2026-01-02"),
        ("AMD EPYC (AVX-512 with BF16, AVX-VNNI)", "a", "2026-01-04"),
        ("AMD EPYC (SIMD not recorded)", "b", "2026-01-01"),
        ("Intel Xeon (AVX-512)", "a", "2026-01-03"),
    ]


def test_page_groups_the_records_by_cpu(tmp_path: Path, monkeypatch) -> None:
    import _records

    base = {"cores": 2, "platform": "Linux", "python": "3.11", "torch": "2", "isa_caps": {}}
    records = []
    for cpu, simd, value in (("CPU B", ["avx2"], 3.0), ("CPU A", ["avx2", "avx512f"], 2.0)):
        machine = {**base, "cpu": cpu, "simd": simd}
        monkeypatch.setattr(_records, "machine", lambda m=machine: m)
        rec = Recorder("bench_demo", "small", "a demo measurement", threads=1)
        rec.add("fast path", value, "tokens/s", peer="slow path", peer_value=1.0)
        records.append(json.loads(rec.write(["bench_demo.py"], folder=tmp_path).read_text()))
    text = make_docs_page.render(latest(records))
    a, b = text.index("## CPU A (AVX-512)"), text.index("## CPU B (AVX2)")
    assert a < text.index("2.00x") < b < text.index("3.00x")
    assert text.count("### bench_demo: small") == 2
    assert "#cpu-a-avx-512-bench-demo-small" in text and "#cpu-b-avx2-bench-demo-small" in text


def test_page_shows_each_figure_beside_its_peer(tmp_path: Path) -> None:
    rec = Recorder("bench_demo", "small", "a demo measurement", threads=1)
    rec.add("fast path", 12.0, "tokens/s", peer="slow path", peer_value=6.0)
    data = json.loads(rec.write(["bench_demo.py"], folder=tmp_path).read_text())
    text = make_docs_page.render([data])
    assert "| fast path | 12.0 tokens/s | slow path | 6.00 tokens/s | 2.00x ↑ |" in text
    assert "python bench_demo.py" in text and data["date"][:10] in text


def test_docs_page_is_made_from_the_latest_records() -> None:
    """docs/benchmarks.md is exactly what the records in benchmarks/results make."""
    records = latest(load_records())
    assert records, "benchmarks/results holds no record"
    for rec in records:
        assert set(rec) == FIELDS, f"{rec['benchmark']}/{rec['config']}: fields {sorted(rec)}"
        assert rec["figures"], f"{rec['benchmark']}/{rec['config']} has no figure"
    page = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert page == make_docs_page.render(records), (
        "docs/benchmarks.md is stale: run python benchmarks/make_docs_page.py"
    )
    assert (ROOT / "docs" / "img" / "benchmarks.png").is_file()


def test_records_written_earlier_in_a_run_are_not_local_changes(tmp_path, monkeypatch) -> None:
    """A benchmark that measures two models writes two records; the first, not yet
    committed, must not mark the second as measured on changed code. A changed source
    file must."""
    import subprocess

    import _records

    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    (tmp_path / "src").mkdir()
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "src" / "code.py").write_text("x = 1\n")
    git("init", "-q")
    git("add", "src")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "code")
    monkeypatch.setattr(_records, "ROOT", tmp_path)
    rec = Recorder("bench_demo", "small", "a demo measurement", threads=1)
    (tmp_path / "benchmarks" / "results" / "bench_demo--first.json").write_text("{}")
    assert rec.record(["bench_demo.py"])["local_changes"] is False
    (tmp_path / "src" / "code.py").write_text("x = 2\n")
    assert rec.record(["bench_demo.py"])["local_changes"] is True
