"""The ``attnlab`` typer app, its root options, and :func:`main`, the entry point."""

from __future__ import annotations

import contextlib
import gc
import sys
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
            command has ended, leaves Python's exit-time garbage collection out
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
    if argv is None:
        _leave_quickly()
    raise SystemExit(code if isinstance(code, int) else 0)


def _leave_quickly() -> None:
    """Spare the program's exit the collector's passes over every object alive now.

    Python's shutdown runs the cyclic garbage collector over all live objects, several
    times while it clears the modules: with torch imported that is 165k objects and
    0.4-0.6 s after the command's last line (``python -c "import torch"`` spends as long
    exiting as importing beyond its first second). ``gc.freeze`` moves them to the
    generation no collection visits; their memory goes back to the system with the
    process, and atexit handlers still run (the output streams are flushed first). Only the
    program does it: a caller of :func:`main` in its own process (the tests) keeps its
    collector whole.
    """
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing to say
            stream.flush()
    gc.freeze()
