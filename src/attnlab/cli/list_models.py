"""`attnlab models`: the models this machine has, and whether attnlab can load each."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from attnlab.cli.app import app
from attnlab.cli.output import output, user_input

__all__ = ["models"]


@app.command("models")
def models(
    dirs: Annotated[
        list[Path] | None,
        typer.Option(
            "--dir",
            "-d",
            help="A folder of GGUF files or model directories to look in too (repeatable).",
        ),
    ] = None,
    stores: Annotated[
        bool,
        typer.Option(
            "--stores/--no-stores",
            help="Look in the Hugging Face cache, Ollama's store and LM Studio's folder.",
        ),
    ] = True,
    packaged: Annotated[
        bool, typer.Option("--packaged/--no-packaged", help="List the packaged models.")
    ] = True,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print JSON: one object per model.")
    ] = False,
) -> None:
    """List the models on this machine: the packaged ones, the Hugging Face cache
    (HF_HOME / HF_HUB_CACHE), Ollama's store (OLLAMA_MODELS), LM Studio's folder and any
    --dir; for each the name to pass to --model, family, parameters, file type, size,
    place, and why attnlab cannot load it when it cannot. Reads configs and headers, never
    weights."""
    from attnlab.pretrained.catalog import find_models, format_count, format_size

    with user_input():  # a --dir that is not a folder
        entries = find_models(tuple(dirs or ()), stores=stores, packaged=packaged)
    if as_json:
        output.raw(json.dumps([e.to_dict() for e in entries], indent=2))
        return
    from rich.table import Table
    from rich.text import Text

    table = Table(title="Models on this machine", title_justify="left")
    for column, justify in (
        ("--model", "left"),
        ("family", "left"),
        ("params", "right"),
        ("type", "left"),
        ("size", "right"),
        ("place", "left"),
        ("loads", "left"),
    ):
        table.add_column(column, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for e in entries:
        cells = (
            e.name,
            e.family or "-",
            format_count(e.parameters),
            e.file_type or "-",
            format_size(e.size),
            e.place,
            "yes" if e.loadable else f"no: {e.reason}",
        )
        table.add_row(*(Text(c) for c in cells))  # names and reasons are not markup
    output.show(table)
    if not entries:
        output.note("no models found")
    else:
        loadable = sum(e.loadable for e in entries)
        output.note(f"{len(entries)} models, {loadable} loadable; pass a name to --model")
