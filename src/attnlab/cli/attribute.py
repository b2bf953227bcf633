"""`attnlab attribute`: why the model produced this token rather than that one, split into
what each head, each MLP, the embedding and the constant terms wrote towards it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from attnlab.cli.app import app
from attnlab.cli.models import load_model_arg, token_arg
from attnlab.cli.output import UserError, output, user_input
from attnlab.explain import attribute as attribute_
from attnlab.explain.html import attribution_html
from attnlab.explain.model_trace import _encode, _token_texts


@app.command()
def attribute(
    text: Annotated[str, typer.Argument(help="The prompt whose next token is explained.")],
    target: Annotated[
        str | None,
        typer.Option(help="The token to explain: text that is exactly one token (' Mary')."),
    ] = None,
    contrast: Annotated[
        str | None,
        typer.Option(help="Explain logit(target) - logit(contrast): text of exactly one token."),
    ] = None,
    target_id: Annotated[int | None, typer.Option(help="The target as a token id.")] = None,
    contrast_id: Annotated[int | None, typer.Option(help="The contrast as a token id.")] = None,
    position: Annotated[
        int, typer.Option(help="The position whose prediction is explained (default the last).")
    ] = -1,
    by_source: Annotated[
        bool,
        typer.Option(
            "--by-source", help="Also split the strongest heads over the source tokens they read."
        ),
    ] = False,
    model: Annotated[
        str | None,
        typer.Option(
            "--model", "-m", help="A pretrained model name, a model directory or a .gguf file."
        ),
    ] = None,
    checkpoint: Annotated[
        Path | None, typer.Option(help="A GPT checkpoint folder written by `attnlab train`.")
    ] = None,
    top: Annotated[int, typer.Option("--top", help="Components shown, largest first.")] = 12,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print every part as JSON (heads as layers x heads).")
    ] = False,
    png: Annotated[
        Path | None, typer.Option("--png", help="Draw the heads grid and MLP bars into FILE.")
    ] = None,
    svg: Annotated[Path | None, typer.Option("--svg", help="The same figure as SVG.")] = None,
    html: Annotated[
        Path | None, typer.Option("--html", help="A self-contained page: figure and table.")
    ] = None,
) -> None:
    """Direct logit attribution: which heads and MLPs wrote the target token.

    Each head's and each MLP's write to the residual stream, read through the final norm
    (its scale frozen at its value in this run) and the unembedding row of the target
    (minus the contrast's). The parts sum to the total; the difference is the error.
    """
    from attnlab.explain.text import attribution_components, attribution_table

    if top < 1:
        raise UserError(f"`--top` must be at least 1, got {top}")
    if not text.strip():
        raise UserError("TEXT must not be empty: give the prompt whose next token is explained")
    _check_outputs(png=png, svg=svg, html=html)
    net, tokenizer, source = load_model_arg(checkpoint, model)
    target_ = token_arg(tokenizer, target, target_id, "target")
    if target_ is None:
        raise UserError("give the token to explain: --target TEXT or --target-id N")
    contrast_ = token_arg(tokenizer, contrast, contrast_id, "contrast")
    ids = _encode(tokenizer, text)
    with user_input():
        result = attribute_(
            net, ids, target_, contrast_, position, by_source=by_source, tokenizer=tokenizer
        )
    tokens = _token_texts(tokenizer, ids)
    pos = position % len(ids)
    target_text = _token_texts(tokenizer, [target_])[0]
    contrast_text = None if contrast_ is None else _token_texts(tokenizer, [contrast_])[0]
    what = f"logit({target_text!r})" + (
        f" - logit({contrast_text!r})" if contrast_text is not None else ""
    )
    data = attribution_json(result, tokens, source, target_text, contrast_text)
    if as_json:
        output.raw(json.dumps(data))
    else:
        for line in (
            f"{source}: why {target_text!r} (id {target_})"
            + (f" rather than {contrast_text!r} (id {contrast_})" if contrast_ is not None else "")
            + f" after position {pos} {tokens[pos]!r}",
            f"total {what} = {float(result.total):+.4f}; the parts sum to it up to "
            f"{float(result.error):+.2e} (error)",
        ):
            output.console.print(line, markup=False, soft_wrap=True)
        output.show(attribution_table(result, top))
        if by_source and result.by_source is not None:
            _print_sources(result, tokens, attribution_components(result), top=3)
        if result.frozen:
            output.note(f"frozen: {_note(result)}")
    _write_figures(result, source, what, tokens, target_text, contrast_text, png, svg, html)


def _note(result: Any) -> str:
    """What was frozen or decomposed to make the parts exact, on one line."""
    return "; ".join(result.frozen)


def attribution_json(
    result: Any,
    tokens: list[str],
    source: str,
    target_text: str,
    contrast_text: str | None,
) -> dict[str, Any]:
    """Every part of an attribution as JSON-ready data (the CLI's `--json`)."""

    def listed(value: Any) -> Any:
        return None if value is None else value.detach().float().tolist()

    return {
        "model": source,
        "tokens": tokens,
        "position": int(result.position) % len(tokens),
        "target": {"id": int(result.target), "token": target_text},
        "contrast": None
        if result.contrast is None
        else {"id": int(result.contrast), "token": contrast_text},
        "total": float(result.total),
        "logit_difference": float(result.logit_difference),
        "embedding": float(result.embedding),
        "heads": listed(result.heads),
        "mlp": listed(result.mlp),
        "experts": listed(result.experts),
        "shared_experts": listed(result.shared_experts),
        "bias": float(result.bias),
        "error": float(result.error),
        "by_source": listed(result.by_source),
        "frozen": list(result.frozen),
    }


def _print_sources(
    result: Any, tokens: list[str], parts: list[tuple[str, float]], top: int
) -> None:
    heads = [name for name, _ in parts if "." in name][:top]
    output.console.print(
        "Where the strongest heads read it (value-weighted attention over the source tokens):",
        markup=False,
        soft_wrap=True,
    )
    for name in heads:
        layer, head = (int(x) for x in name.split("."))
        row = result.by_source[layer, head].detach().float()  # (S,)
        order = row.abs().argsort(descending=True)[:5].tolist()
        cells = ", ".join(f"{j} {tokens[j]!r} {float(row[j]):+.3f}" for j in order)
        output.console.print(f"  {name}: {cells}", markup=False, soft_wrap=True)


def _check_outputs(**paths: Path | None) -> None:
    for flag, path in paths.items():
        if path is not None and path.is_dir():
            raise UserError(f"cannot write `--{flag}` {str(path)!r}: it is a folder; give a file")
        if path is not None and path.parent.exists() and not path.parent.is_dir():
            raise UserError(f"cannot write `--{flag}` {str(path)!r}: {path.parent} is not a folder")


def _write_figures(
    result: Any,
    source: str,
    what: str,
    tokens: list[str],
    target_text: str,
    contrast_text: str | None,
    png: Path | None,
    svg: Path | None,
    html: Path | None,
) -> None:
    if png is None and svg is None and html is None:
        return
    from attnlab.explain.figures import plot_attribution

    fig = plot_attribution(
        result,
        title=f"{what} = {float(result.total):+.3f} (error {float(result.error):+.1e})",
        source=source,
    )
    for path, ext in ((png, "png"), (svg, "svg")):
        if path is None:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"Software": None} if ext == "png" else {"Date": None, "Creator": None}
        fig.savefig(path, format=ext, dpi=130, metadata=meta)
        output.note(f"wrote {path}")
    if html is not None:
        html.parent.mkdir(parents=True, exist_ok=True)
        html.write_text(attribution_html(result, fig, tokens, source, what), encoding="utf-8")
        output.note(f"wrote {html}")
