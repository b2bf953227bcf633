"""The ``attnlab`` command: parse, call the library, render. No math here.

One typer app (:mod:`attnlab.cli.app`), one module per command, all output through
one :class:`Output` object and user errors turned into one line on stderr with exit
status 2 in one place (:mod:`attnlab.cli.output`). A command signals a user error by
raising :class:`UserError` (or by letting a library ``ValueError``/``TypeError`` pass
through :func:`user_input`).
"""

from __future__ import annotations

from importlib import import_module

from attnlab import _startup

# The command modules register themselves on `app` when imported; this order is the
# order of `attnlab --help`. Every command module is imported at start-up, so each imports
# what only its own command needs (models, loaders, training, figures, the server and its
# optional starlette) inside the command: a command pays for its own libraries, not for all.
COMMAND_MODULES = (
    "walkthrough",
    "train",
    "generate",
    "embed",
    "explain",
    "heads",
    "attribute",
    "patch",
    "ring_demo",
    "info",
    "list_models",
    "serve",
)
# The command line's libraries (typer, rich) and its command modules, like attnlab's own
# imports, without the collector's passes over what they create (attnlab._startup).
with _startup.collector_paused():
    from attnlab.cli.app import app, main
    from attnlab.cli.output import Output, UserError, output, user_input

    for _name in COMMAND_MODULES:
        import_module(f"attnlab.cli.{_name}")


__all__ = ["Output", "UserError", "app", "main", "output", "user_input"]
