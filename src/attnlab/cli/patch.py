"""`attnlab patch`: activation patching, which heads (or positions) of a clean run bring
its answer back into a corrupted run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from attnlab.cli.app import app
from attnlab.cli.models import load_model_arg, token_arg
from attnlab.cli.output import UserError, output, user_input
from attnlab.explain import patching
from attnlab.explain.model_trace import _encode, _token_texts

OVER = ("heads", "residual", "mlp")


@app.command()
def patch(
    clean: Annotated[str, typer.Option(help="The prompt the model answers (the clean run).")],
    corrupted: Annotated[
        str,
        typer.Option(help="The same prompt with the clue changed: as many tokens as --clean."),
    ],
    target: Annotated[
        str | None, typer.Option(help="The clean answer: text that is exactly one token.")
    ] = None,
    contrast: Annotated[
        str | None, typer.Option(help="The corrupted answer: text that is exactly one token.")
    ] = None,
    target_id: Annotated[int | None, typer.Option(help="The target as a token id.")] = None,
    contrast_id: Annotated[int | None, typer.Option(help="The contrast as a token id.")] = None,
    over: Annotated[
        str,
        typer.Option(
            help="What is patched: heads (layers x heads), residual or mlp (layers x positions)."
        ),
    ] = "heads",
    model: Annotated[
        str | None,
        typer.Option(
            "--model", "-m", help="A pretrained model name, a model directory or a .gguf file."
        ),
    ] = None,
    checkpoint: Annotated[
        Path | None, typer.Option(help="A GPT checkpoint folder written by `attnlab train`.")
    ] = None,
    top: Annotated[int, typer.Option("--top", help="Strongest cells listed.")] = 8,
    as_json: Annotated[bool, typer.Option("--json", help="Print the grid as JSON.")] = False,
    png: Annotated[Path | None, typer.Option("--png", help="Draw the grid into FILE.")] = None,
    svg: Annotated[Path | None, typer.Option("--svg", help="The same figure as SVG.")] = None,
) -> None:
    """Activation patching: run the corrupted prompt, put one component back from the clean
    run, and measure how much of the answer returns.

    With m = logit(target) - logit(contrast) at the last position, each cell is
    (m_patched - m_corrupted) / (m_clean - m_corrupted): 1 restores the clean answer,
    0 changes nothing.
    """
    from attnlab.explain.text import patch_table

    if over not in OVER:
        raise UserError(f"unknown --over {over!r}; choose one of {', '.join(OVER)}")
    if top < 1:
        raise UserError(f"`--top` must be at least 1, got {top}")
    for flag, value in (("--clean", clean), ("--corrupted", corrupted)):
        if not value.strip():
            raise UserError(f"`{flag}` must not be empty")
    for flag, path in (("--png", png), ("--svg", svg)):
        if path is not None and path.is_dir():
            raise UserError(f"cannot write `{flag}` {str(path)!r}: it is a folder; give a file")
    net, tokenizer, source = load_model_arg(checkpoint, model)
    target_ = token_arg(tokenizer, target, target_id, "target")
    contrast_ = token_arg(tokenizer, contrast, contrast_id, "contrast")
    if target_ is None or contrast_ is None:
        raise UserError(
            "patching needs both answers: --target TEXT (the clean one) and --contrast TEXT "
            "(the corrupted one), or --target-id / --contrast-id"
        )
    clean_ids, corrupted_ids = _encode(tokenizer, clean), _encode(tokenizer, corrupted)
    if len(clean_ids) != len(corrupted_ids):
        raise UserError(
            f"--clean is {len(clean_ids)} tokens and --corrupted is {len(corrupted_ids)}; "
            "patching needs prompts of the same token length"
        )
    with user_input():
        run = patching(net, clean_ids, corrupted_ids, target_, contrast_, over=over)  # type: ignore[arg-type]
    grid = run.grid
    tokens = _token_texts(tokenizer, clean_ids)
    target_text, contrast_text = _token_texts(tokenizer, [target_, contrast_])
    what = f"logit({target_text!r}) - logit({contrast_text!r})"
    if as_json:
        output.raw(
            json.dumps(
                {
                    "model": source,
                    "over": over,
                    "tokens": tokens,
                    "corrupted_tokens": _token_texts(tokenizer, corrupted_ids),
                    "target": {"id": target_, "token": target_text},
                    "contrast": {"id": contrast_, "token": contrast_text},
                    "clean": run.clean,
                    "corrupted": run.corrupted,
                    "grid": grid.detach().float().tolist(),
                }
            )
        )
    else:
        L, C = grid.shape
        cols = "heads" if over == "heads" else "positions"
        for line in (
            f"{source}: patching over {over} ({L} layers x {C} {cols}), metric {what} at the "
            "last position",
            f"m = {run.clean:+.4f} on the clean prompt, {run.corrupted:+.4f} on the corrupted one; "
            "each cell: the share of that difference a patch restores (1 all of it, 0 none).",
        ):
            output.console.print(line, markup=False, soft_wrap=True)
        output.show(patch_table(grid, over, tokens))
        flat = grid.detach().float().flatten()
        order = flat.abs().argsort(descending=True)[: min(top, flat.numel())].tolist()
        cells = []
        for i in order:
            layer, col = divmod(i, C)
            name = (
                f"{layer}.{col}" if over == "heads" else f"layer {layer} at {col} {tokens[col]!r}"
            )
            cells.append(f"{name} {float(flat[i]):+.2f}")
        output.console.print("Strongest: " + ", ".join(cells), markup=False, soft_wrap=True)
    if png is not None or svg is not None:
        from attnlab.explain.figures import plot_patch

        fig = plot_patch(grid, over=over, tokens=tokens, title=f"{source}: patching over {over}")
        for path, ext in ((png, "png"), (svg, "svg")):
            if path is None:
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            meta = {"Software": None} if ext == "png" else {"Date": None, "Creator": None}
            fig.savefig(path, format=ext, dpi=130, metadata=meta)
            output.note(f"wrote {path}")
