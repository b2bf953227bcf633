"""The one place the CLI writes to and reports errors from.

All output goes through one :class:`Output` object; a command signals a user error by
raising :class:`UserError` (or by letting a library ``ValueError``/``TypeError`` pass
through :func:`user_input`), and :func:`attnlab.cli.app.main` turns it into one line on
stderr with exit status 2.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import typer
from rich.console import Console, RenderableType

__all__ = [
    "DEFAULT_OUT",
    "EXIT_USER_ERROR",
    "Output",
    "UserError",
    "framework_errors",
    "output",
    "user_input",
]

EXIT_USER_ERROR = 2
DEFAULT_OUT = Path("attnlab-out")


class UserError(Exception):
    """A mistake in the command line: reported as one line on stderr, exit status 2."""


@contextmanager
def user_input() -> Iterator[None]:
    """Treat ``ValueError``/``TypeError`` raised inside as the user's error.

    Wrap only calls whose arguments come straight from the command line (the
    library validates them at its public boundary and names the argument).
    """
    try:
        yield
    except (ValueError, TypeError) as e:
        raise UserError(str(e)) from e


class Output:
    """The one place the CLI writes to: rich tables on stdout, notes and errors on stderr."""

    def __init__(self) -> None:
        self.console = Console(highlight=False)
        self.err_console = Console(stderr=True, highlight=False)

    def show(self, *renderables: RenderableType) -> None:
        """Print renderables (tables, text) on stdout."""
        for r in renderables:
            self.console.print(r)

    def raw(self, text: str) -> None:
        """Write ``text`` verbatim on stdout (machine-readable output such as JSON)."""
        sys.stdout.write(text)
        if not text.endswith("\n"):
            sys.stdout.write("\n")
        sys.stdout.flush()

    def note(self, text: str) -> None:
        """A message for the human on stderr (keeps stdout clean for ``--json``)."""
        self.err_console.print(text, markup=False, highlight=False, soft_wrap=True)

    def stream(self, text: str) -> None:
        """Write ``text`` on stdout at once, without a newline (text generated token by token)."""
        sys.stdout.write(text)
        sys.stdout.flush()

    def error(self, text: str) -> None:
        """One line on stderr, never wrapped."""
        line = " ".join(str(text).split())
        sys.stderr.write(f"attnlab: error: {line}\n")
        sys.stderr.flush()


output = Output()


def framework_errors() -> tuple[tuple[type[BaseException], ...], tuple[type[BaseException], ...]]:
    """(usage-error types, abort types) of typer and of click, whichever are installed.

    Recent typer vendors click (``typer.TyperException`` is the base of its usage
    errors); older typer raises ``click`` exceptions.
    """
    errors: list[type[BaseException]] = []
    aborts: list[type[BaseException]] = [KeyboardInterrupt]
    if hasattr(typer, "TyperException"):
        errors.append(typer.TyperException)
    aborts.append(typer.Abort)
    try:
        import click
    except ImportError:  # pragma: no cover - typer without click
        pass
    else:
        errors.append(click.ClickException)
        aborts.append(click.Abort)
    return tuple(errors), tuple(aborts)
