"""MkDocs hooks: the command-line reference, generated from the Typer app at build time.

``docs/reference/cli.md`` holds the marker ``<!-- cli-reference -->``; this hook replaces
it with every command's ``--help`` text, read from ``attnlab.cli.app`` itself, so the
page cannot drift from the code.
"""

from __future__ import annotations

from typing import Any

MARKER = "<!-- cli-reference -->"


def cli_reference_markdown(width: int = 88) -> str:
    """Markdown for every ``attnlab`` command: its one-line summary and its ``--help``."""
    import typer

    from attnlab.cli.app import app

    group: Any = typer.main.get_command(app)  # typer's own (vendored) click group
    Context = group.context_class
    root_ctx = Context(group, info_name="attnlab", terminal_width=width,
                             max_content_width=width)  # fmt: skip
    parts = ["## `attnlab`", "", "```text", group.get_help(root_ctx).rstrip(), "```", ""]
    for name in group.list_commands(root_ctx):
        cmd = group.get_command(root_ctx, name)
        assert cmd is not None
        ctx = Context(cmd, info_name=name, parent=root_ctx,
                            terminal_width=width, max_content_width=width)  # fmt: skip
        summary = cmd.get_short_help_str(limit=200)
        parts += [f"## `attnlab {name}`", "", summary, "", "```text",
                  cmd.get_help(ctx).rstrip(), "```", ""]  # fmt: skip
    return "\n".join(parts)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Fill the CLI reference page."""
    if MARKER in markdown:
        return markdown.replace(MARKER, cli_reference_markdown())
    return markdown
