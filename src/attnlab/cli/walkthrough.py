"""`attnlab walkthrough`: the seed's self-attention step by step, with figures."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from attnlab.cli.app import app
from attnlab.cli.output import DEFAULT_OUT, UserError, output, user_input
from attnlab.examples import EXAMPLES, get_example
from attnlab.explain.trace import trace_example


@app.command()
def walkthrough(
    example: Annotated[
        str, typer.Option("--example", "-e", help="Embedded example: journey or toy.")
    ] = "journey",
    lang: Annotated[
        str, typer.Option("--lang", "-l", help="Language of the explanations: en or zh-TW.")
    ] = "en",
    seed: Annotated[
        int | None,
        typer.Option(
            help="Seed of the trainable weights (journey only). Default: the book's, "
            "123 for the walk and SelfAttentionV1, 789 for SelfAttentionV2.",
        ),
    ] = None,
    token: Annotated[
        int, typer.Option(help="Token of the single-token walk, counted from 1 (the book's x_2).")
    ] = 2,
    json_out: Annotated[
        bool,
        typer.Option("--json", help="Print the trace as JSON on stdout and nothing else there."),
    ] = False,
    out: Annotated[
        Path | None,
        typer.Option(
            help="Folder for the figures (PNG and SVG). Default attnlab-out/; with --json, "
            "figures are written only when --out is given.",
        ),
    ] = None,
    no_figures: Annotated[bool, typer.Option("--no-figures", help="Do not write figures.")] = False,
) -> None:
    """Walk through the seed's self-attention step by step, with figures."""
    from attnlab.explain.i18n import LANGS, normalize_lang

    try:
        lang = normalize_lang(lang)
    except ValueError:
        raise UserError(f"unknown --lang {lang!r}; choose one of {', '.join(LANGS)}") from None
    out_dir = (
        None if no_figures else (out if out is not None else (None if json_out else DEFAULT_OUT))
    )
    if out_dir is not None and out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"cannot write figures to `--out` {str(out_dir)!r}: not a folder")
    if example not in EXAMPLES:
        raise UserError(f"unknown --example {example!r}; choose one of {', '.join(EXAMPLES)}")
    with user_input():
        ex = get_example(example)
        if not 1 <= token <= len(ex.tokens):
            raise ValueError(
                f"`--token` must be between 1 and {len(ex.tokens)} (the example's tokens, "
                f"counted from 1), got {token}"
            )
        trace = trace_example(ex, index=token - 1, seed=seed)

    if json_out:
        output.raw(trace.to_json())
    else:
        from attnlab.explain.text import walkthrough_renderables

        output.show(*walkthrough_renderables(trace, lang))

    if out_dir is None:
        return
    from attnlab.explain.figures import save_walkthrough_figures
    from attnlab.explain.fonts import figure_lang

    notice = figure_lang(lang).notice
    if notice is not None:
        output.note(notice)
    from attnlab.explain.i18n import message

    try:
        paths = save_walkthrough_figures(trace, out_dir, lang=lang)
    except OSError as e:
        reason = e.strerror or str(e)
        raise UserError(f"cannot write figures to `--out` {str(out_dir)!r}: {reason}") from e
    listing = "\n".join(f"  {p}" for p in paths)
    text = f"{message('label.wrote', lang)}\n{listing}"
    if json_out:
        output.note(text)
    else:
        output.console.print(text, markup=False, soft_wrap=True)
