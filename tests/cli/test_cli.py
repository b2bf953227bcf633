"""The `attnlab` command, run for real: `python -m attnlab` in a subprocess."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from attnlab.explain.trace import trace_example
from cli_runner import run_cli, run_main

FIGURES = ("attention-weights-simplified", "attention-weights-trainable", "attention-flow")


def test_walkthrough_prints_the_tables_and_writes_figures(tmp_path):
    result = run_cli("walkthrough", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for label in ("attn_scores", "attn_weights", "row sum", "all_context_vecs", "query_2",
                  "attn_score_22 = 1.8524", "attn_weights_2", "context_vec_2",
                  "SelfAttentionV1", "SelfAttentionV2"):  # fmt: skip
        assert label in out, label
    # the seed's tables and the book's printed values, as computed
    for number in ("0.2098", "0.4421", "0.5931", "0.4306", "1.4551", "0.2264", "0.8210",
                   "0.2996", "0.8053", "-0.0739", "0.0713"):  # fmt: skip
        assert number in out, number
    assert "Attention weights = softmax" in out  # English explanations by default
    assert result.stderr == ""
    for stem in FIGURES:
        for ext in ("png", "svg"):
            path = tmp_path / "attnlab-out" / f"{stem}.{ext}"
            assert path.stat().st_size > 1000, path
            assert str(Path("attnlab-out") / f"{stem}.{ext}") in out


def test_walkthrough_in_traditional_chinese(tmp_path):
    result = run_cli("walkthrough", "--lang", "zh-TW", "--no-figures", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "注意力權重" in result.stdout and "上下文向量" in result.stdout
    assert "√d_k" in result.stdout and "0.2098" in result.stdout
    assert "Attention weights = softmax" not in result.stdout
    assert not (tmp_path / "attnlab-out").exists()


def test_json_is_the_trace_and_nothing_else(tmp_path):
    result = run_cli("walkthrough", "--json", "--seed", "7", "--token", "5", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)  # stdout is exactly one JSON document
    expected = trace_example("journey", index=4, seed=7)
    assert data["schema"] == "attnlab.trace/1"
    assert data["trainable_token"]["index"] == 4
    assert data["projection"]["seed"] == 7
    torch.testing.assert_close(
        torch.tensor(data["trainable"]["context"]), expected.trainable.context
    )
    assert not (tmp_path / "attnlab-out").exists()  # --json writes figures only with --out


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (("--example", "nope"), r"unknown --example 'nope'; choose one of journey, toy"),
        (("--lang", "fr"), r"unknown --lang 'fr'; choose one of en, zh-TW"),
    ],
)
def test_user_errors_are_one_line_and_exit_2(tmp_path, args, pattern):
    result = run_cli("walkthrough", *args, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert re.search(pattern, result.stderr), result.stderr
    assert result.stderr.startswith("attnlab: error: ")


# The same entry point in-process (faster: no interpreter and torch start-up per case).


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (("--example", "toy", "--seed", "1"), r"`seed` does not apply to example 'toy'"),
        (("--token", "0"), r"`--token` must be between 1 and 6"),
        (("--token", "x"), r"Invalid value for '--token'"),
        (("--bogus",), r"No such option: --bogus"),
        (("--out", "a-file"), r"cannot write figures to `--out` 'a-file': not a folder"),
    ],
)
def test_more_user_errors_in_process(capsys, tmp_path, monkeypatch, args, pattern):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("not a folder")
    code, out, err = run_main(capsys, "walkthrough", *args)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("attnlab: error: "), err
    assert re.search(pattern, err), err


def test_toy_example_in_process(capsys):
    code, out, _ = run_main(capsys, "walkthrough", "-e", "toy", "--token", "3", "--no-figures")
    assert code == 0
    assert "query_3 = x_3 @ W_query.T" in out
    assert "nn.Linear convention" in out


def test_json_with_out_writes_figures_and_keeps_stdout_clean(capsys, tmp_path):
    code, out, err = run_main(capsys, "walkthrough", "--json", "--out", str(tmp_path / "figs"))
    assert code == 0
    assert json.loads(out)["example"] == "journey"
    assert "attention-flow.svg" in err
    assert (tmp_path / "figs" / "attention-flow.png").stat().st_size > 1000


def test_version_and_help(capsys):
    code, out, _ = run_main(capsys, "--version")
    assert code == 0 and re.fullmatch(r"attnlab \d+\.\d+\.\d+\n", out)
    code, out, _ = run_main(capsys)
    assert code == 0 and "walkthrough" in out


def test_the_program_spares_its_exit_the_teardown_a_caller_keeps_it(capsys, monkeypatch):
    """As the program (``argv`` None: ``sys.argv``), :func:`main` freezes the collector's
    objects before the command (what the imports made is never walked again) and, once
    the command has ended, leaves by :func:`_leave_quickly` with the command's status;
    called with arguments (in a test, in a notebook) it does neither and raises
    SystemExit as before."""
    import gc
    import sys

    from attnlab.cli import main

    app_module = sys.modules["attnlab.cli.app"]
    frozen: list[str] = []
    left: list[tuple[int, str]] = []
    monkeypatch.setattr(gc, "freeze", lambda: frozen.append(capsys.readouterr().out))
    monkeypatch.setattr(
        app_module, "_leave_quickly", lambda s: left.append((s, capsys.readouterr().out))
    )
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and frozen == [] and left == []
    capsys.readouterr()
    for args, status in ((["--version"], 0), (["generate", "Hi"], 2)):
        monkeypatch.setattr(sys, "argv", ["attnlab", *args])
        with pytest.raises(SystemExit) as exc:  # where the real one has ended the process
            main()
        assert exc.value.code == status
    assert frozen == [""] * 2  # before each command: nothing printed yet
    assert left[0][0] == 0 and left[0][1].startswith("attnlab ")  # after the output
    assert left[1] == (2, "")


_LEAVING = r"""
import atexit, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from attnlab.cli.app import main  # imported first: the threads outlive the command
out = Path(sys.argv[1])
def late_thread():
    time.sleep(0.5)
    (out / "thread").write_text("done")
def pooled():
    time.sleep(0.5)
    (out / "pool").write_text("done")
threading.Thread(target=late_thread).start()
ThreadPoolExecutor(1).submit(pooled)
atexit.register(lambda: (out / "atexit").write_text(sys.stdout.write("from atexit") and "ran"))
sys.stdout.write("no newline yet ")
sys.argv = ["attnlab", *sys.argv[2:]]
main()
"""


@pytest.mark.parametrize(("args", "status"), [(["--version"], 0), (["generate", "Hi"], 2)])
def test_leaving_quickly_loses_nothing_a_thread_or_exit_handler_holds(tmp_path, args, status):
    """The program's quick exit (``os._exit`` after Python's own first steps) still lets a
    running thread and a thread pool's work finish, runs the atexit handlers, flushes
    what was written without a newline, and exits with the command's status."""
    import os
    import subprocess
    import sys

    from cli_runner import SRC

    env = {**os.environ, "PYTHONPATH": str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run(
        [sys.executable, "-c", _LEAVING, str(tmp_path), *args],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert run.returncode == status, run.stderr[-2000:]
    assert run.stdout.startswith("no newline yet ") and run.stdout.endswith("from atexit")
    if status == 0:
        assert "attnlab " in run.stdout
    else:
        assert "error" in run.stderr.lower() and "Traceback" not in run.stderr
    for name, text in (("thread", "done"), ("pool", "done"), ("atexit", "ran")):
        assert (tmp_path / name).read_text() == text, name


def test_a_command_parses_its_options_without_pydantic():
    """The options are parsed by typer as pinned (below 0.29, which coerces every option
    through pydantic: 0.045 s more on every command); a command imports no pydantic."""
    import subprocess
    import sys

    code = (
        "import sys\nfrom attnlab.cli import main\n"
        "try:\n    main(['generate', '--dtype', 'int4', '-n', '3', 'Hi'])\n"
        "except SystemExit as e:\n    assert e.code == 2, e.code\n"
        "print('pydantic' in sys.modules)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "False"


def test_importing_attnlab_leaves_the_collector_as_it_was():
    """``import attnlab`` holds the collector off while it imports (attnlab._startup) and
    gives it back as it was: on where it was on, off where the importer had turned it
    off; the pause gives it back when its body raises too."""
    import gc
    import subprocess
    import sys

    from attnlab._startup import collector_paused

    for before in ("", "gc.disable(); "):
        code = (
            f"import gc; {before}was = gc.isenabled(); import attnlab.cli; "
            "assert gc.isenabled() == was, (was, gc.isenabled())"
        )
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-2000:]
    assert gc.isenabled()
    with pytest.raises(KeyError), collector_paused():
        assert not gc.isenabled()
        raise KeyError("inside")
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_generate_help_lists_every_weight_precision(capsys):
    """``--dtype``'s help is built from the registered weight formats."""
    from attnlab.quant import WEIGHT_DTYPES

    code, out, _ = run_main(capsys, "generate", "--help")
    assert code == 0
    for name in WEIGHT_DTYPES:
        assert name in out, name
