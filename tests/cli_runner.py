"""Running the `attnlab` command in tests: as the real command, or in-process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from attnlab.cli import main

SRC = Path(__file__).resolve().parents[1] / "src"


def run_cli(
    *args: str,
    cwd: Path | None = None,
    columns: int = 120,
    timeout: float = 600,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m attnlab ARGS`` in a subprocess, on this checkout's sources, offline
    (``env``: extra environment variables)."""
    full = dict(os.environ)
    full["PYTHONPATH"] = str(SRC) + os.pathsep + full.get("PYTHONPATH", "")
    full.update(COLUMNS=str(columns), MPLBACKEND="Agg", HF_HUB_OFFLINE="1", **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "attnlab", *args],
        cwd=cwd,
        env=full,
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=timeout,
    )


def run_main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """Run ``attnlab ARGS`` in this process; return (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    captured = capsys.readouterr()
    return int(exc.value.code), captured.out, captured.err
