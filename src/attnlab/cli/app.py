"""The ``attnlab`` typer app, its root options, and :func:`main`, the entry point."""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import sys
import threading
from typing import Annotated, Any

import typer

import attnlab
from attnlab.cli.output import EXIT_USER_ERROR, UserError, framework_errors, output

__all__ = ["app", "main"]

app = typer.Typer(
    name="attnlab",
    help="Self-attention from the dot product to real models, showing its work.",
    add_completion=False,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        output.raw(f"attnlab {attnlab.__version__}")
        raise typer.Exit()


@app.callback(invoke_without_command=True)
def _root(
    ctx: typer.Context,
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """Self-attention from the dot product to real models, showing its work."""
    if ctx.invoked_subcommand is None:
        output.raw(ctx.get_help())


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``attnlab`` console script and ``python -m attnlab``.

    Exits with the command's status: 0 on success, 2 for a user error (one line on
    stderr, no traceback), 130 on Ctrl-C.

    Args:
        argv: the arguments; None (the program itself) reads ``sys.argv``, freezes the
            collector's objects before the command (``gc.freeze``: what the imports
            made, held off the collector while they ran, is never walked by its passes
            during the load; about 0.05 s of a model's first token) and, once the
            command has ended, leaves Python's teardown of the interpreter out
            (:func:`_leave_quickly`).
    """
    if argv is None:
        gc.freeze()
    usage_errors, aborts = framework_errors()
    code: Any
    try:
        code = app(args=argv, prog_name="attnlab", standalone_mode=False)
    except UserError as e:
        output.error(str(e))
        code = EXIT_USER_ERROR
    except usage_errors as e:
        ctx = getattr(e, "ctx", None)
        hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
        output.error(f"{e.format_message()}{hint}")  # type: ignore[attr-defined]
        code = EXIT_USER_ERROR
    except aborts:
        output.error("aborted")
        code = 130
    status = code if isinstance(code, int) else 0
    if argv is None:
        _leave_quickly(status)
    raise SystemExit(status)


def _flush_output() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing to say
            stream.flush()


def _leave_quickly(status: int) -> None:
    """End the program with ``status`` as Python's exit would, without its teardown.

    Python's exit first waits for the threads that are not daemons (and the thread pools'
    work), then runs the atexit handlers, then tears the interpreter down: the collector's
    passes over every object (with torch imported 165k of them; ``gc.freeze`` before the
    command spares it those) and the clearing of every module and object, 0.09-0.12 s after
    a model's first token that the process's end gives back at once. This does the first
    two steps as Python does them (``threading._shutdown``, ``atexit._run_exitfuncs``),
    flushes the standard streams, and ends the process (``os._exit``): nothing an exit
    handler, a thread or the output holds is lost, and what is skipped is freeing memory
    the system takes back. (A file left open and unflushed, which the teardown would
    have flushed, would lose its buffer: the commands write their files in ``with``
    blocks.) Where
    this Python lacks either step, or this is not the main thread, the exit is Python's
    own, with the collector's objects frozen. Only the program does it: a caller of
    :func:`main` in its own process (the tests) keeps its interpreter.
    """
    _flush_output()
    gc.freeze()
    shutdown = getattr(threading, "_shutdown", None)
    run_exit_handlers = getattr(atexit, "_run_exitfuncs", None)
    if shutdown is None or run_exit_handlers is None:  # pragma: no cover - other Pythons
        return
    if threading.current_thread() is not threading.main_thread():
        return
    shutdown()
    run_exit_handlers()
    _flush_output()
    os._exit(status)
