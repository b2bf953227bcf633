"""`attnlab info`: the backends and the dispatch verdict for a call shape."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli_runner import run_cli, run_main

SRC = Path(__file__).resolve().parents[1] / "src"


def test_info_runs_for_real():
    env = dict(os.environ, PYTHONPATH=str(SRC), COLUMNS="160")
    result = subprocess.run(
        [sys.executable, "-m", "attnlab", "info", "--seq-len", "8192", "--mask", "padding"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for name in ("sdpa", "blockwise", "math"):
        assert name in out
    assert "backend='auto' -> blockwise" in out
    assert "materialised" in out  # why sdpa stepped aside


def test_info_explains_a_refused_backend_as_a_user_error(capsys):
    code, out, err = run_main(capsys, "info", "--dropout", "0.1", "--backend", "blockwise")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "does not implement attention dropout" in err


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (("--heads", "12", "--kv-heads", "5"), "H=12 query heads and G=5"),
        (("--mask", "diagonal"), "unknown --mask 'diagonal'"),
        (("--dtype", "int8"), "unknown --dtype 'int8'"),
        (("--backend", "flash9"), "`backend` must be one of"),
        (("--seq-len", "0"), "`--seq-len` must be a positive int"),
    ],
)
def test_info_user_errors(capsys, args, pattern):
    code, _, err = run_main(capsys, "info", *args)
    assert code == 2
    assert err.startswith("attnlab: error:") and pattern in err and err.count("\n") == 1


def test_info_default_is_sdpa_for_causal(capsys):
    code, out, _ = run_main(capsys, "info")
    assert code == 0 and "backend='auto' -> sdpa" in out.replace("\n", " ").replace("  ", " ")


def test_info_lists_the_variants_and_which_backend_serves_them():
    result = run_cli("info", "--mask", "document", "--softcap", "30", columns=240, timeout=120)
    flat = " ".join(result.stdout.split())
    assert result.returncode == 0, result.stderr
    for variant in ("AlibiBias", "RelativePositionBias", "DocumentMask", "softcap=", "sinks="):
        assert variant in flat
    assert "PyTorch's kernel has no logit soft-capping" in flat  # sdpa's reason, verbatim
    assert "backend='auto' -> sdpa" not in flat  # softcap: sdpa cannot serve this call


def test_info_sinks_and_bias_masks(capsys):
    for args in (("--mask", "alibi"), ("--mask", "relbias"), ("--sinks",)):
        code, _, err = run_main(capsys, "info", *args)
        assert code == 0, err
    code, _, err = run_main(capsys, "info", "--softcap", "0")
    assert code == 2 and "`softcap` must be a positive" in err
