"""`attnlab ring-demo`, run for real: N local processes, checked against one."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from attnlab.cli import main

SRC = Path(__file__).resolve().parents[2] / "src"

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]


def test_ring_demo_prints_error_time_and_memory_per_rank(tmp_path: Path) -> None:
    env = dict(os.environ, COLUMNS="120")
    env["PYTHONPATH"] = str(SRC) + os.pathsep + env.get("PYTHONPATH", "")
    # Shards big enough to show in the memory column: each rank holds q, k, v of T/2 tokens.
    T, H, D = 4096, 2, 64
    args = ["ring-demo", "--nproc", "2", "--seq-len", str(T), "--heads", str(H),
            "--head-dim", str(D)]  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", "attnlab", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"T={T} over 2 ranks (zigzag)" in out
    error = float(re.search(r"max \|ring - single process\| = (\S+)", out).group(1))
    assert error < 1e-5
    rows = re.findall(r"│\s+(\d)\s+│\s+([\d.]+)\s+│.*│\s+([\d.]+|n/a)\s+│", out)
    assert [r[0] for r in rows] == ["0", "1"]
    assert all(float(r[1]) > 0 for r in rows)
    # Peak MiB (last column): at least the rank's own q, k, v shards, far below what one
    # process would hold for a T x T score matrix per head (128 MiB here).
    shards_mib = 3 * H * (T // 2) * D * 4 / 2**20  # 3 MiB
    if sys.platform == "linux":  # the resident-set peak can be reset: the column is measured
        peaks = [float(r[2]) for r in rows]
        assert all(shards_mib <= p < H * T * T * 4 / 2**20 for p in peaks), (peaks, out)


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (("--nproc", "4", "--seq-len", "100"), r"needs a multiple of 8; pad it to 104"),
        (("--nproc", "0"), r"`nproc` must be a positive integer, got 0"),
        (("--layout", "spiral"), r"`layout` must be one of \('contiguous', 'zigzag'\)"),
        (("--dtype", "int8"), r"`dtype` must be one of"),
    ],
)
def test_ring_demo_user_errors_are_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], args: tuple[str, ...], pattern: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["ring-demo", *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert re.search(pattern, err), err
    assert err.count("\n") == 1 and "Traceback" not in err
