"""`attnlab explain`: what attention looked at, as a page, figures and terminal tables."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import RenderableType

from attnlab.cli.app import app
from attnlab.cli.models import load_model_arg
from attnlab.cli.output import DEFAULT_OUT, UserError, output, user_input
from attnlab.examples import EXAMPLES
from attnlab.explain.heads import ablate, ablation_effect, parse_heads, top_tokens
from attnlab.explain.html import walkthrough_from_renderables, write_html
from attnlab.explain.model_trace import (
    _encode,
    _token_texts,
    attention_layers,
    auto_top_k,
    trace_from_walkthrough,
    trace_model,
)
from attnlab.explain.trace import trace_example


@app.command()
def explain(
    text: Annotated[
        str | None,
        typer.Argument(help="Text to run through --checkpoint or --model (not for examples)."),
    ] = None,
    example: Annotated[
        str,
        typer.Option("--example", "-e", help="Embedded example when no model is given."),
    ] = "journey",
    checkpoint: Annotated[
        Path | None,
        typer.Option(help="A GPT checkpoint folder written by `attnlab train`."),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            "-m",
            help="A pretrained model: all-minilm-l6-v2, smollm2-135m-instruct, gemma3-270m, "
            "a model directory or a .gguf file.",
        ),
    ] = None,
    layer: Annotated[int, typer.Option(help="Layer shown first and in the terminal (from 0).")] = 0,
    head: Annotated[int, typer.Option(help="Head shown first and in the terminal (from 0).")] = 0,
    top_k: Annotated[
        int | None,
        typer.Option(
            "--top-k",
            help="Keep only each query's k strongest keys (default: all, or 32 for long inputs).",
        ),
    ] = None,
    out: Annotated[Path, typer.Option(help="Folder for the page and the figures.")] = DEFAULT_OUT,
    html: Annotated[
        Path | None,
        typer.Option("--html", help="Where to write the page (default OUT/attention.html)."),
    ] = None,
    png: Annotated[bool, typer.Option("--png", help="Also write PNG figures into OUT.")] = False,
    svg: Annotated[bool, typer.Option("--svg", help="Also write SVG figures into OUT.")] = False,
    lang: Annotated[
        str, typer.Option("--lang", "-l", help="Language of the page and text: en or zh-TW.")
    ] = "en",
    steps: Annotated[
        bool,
        typer.Option(
            "--steps",
            help="Step into --layer/--head for the query --token: every step of the "
            "computation with the layer's own numbers (needs a model).",
        ),
    ] = False,
    token: Annotated[
        int | None,
        typer.Option(help="Query token of --steps (from 0; default the last token)."),
    ] = None,
    ablate: Annotated[
        str | None,
        typer.Option(
            "--ablate",
            help="Switch these heads off (LAYER.HEAD pairs, e.g. 3.2,5.0) and show the "
            "next-token prediction with and without them (needs a model).",
        ),
    ] = None,
    ablate_mode: Annotated[
        str,
        typer.Option(
            "--ablate-mode",
            help="How --ablate removes a head's output: zero, or mean (its mean over positions).",
        ),
    ] = "zero",
) -> None:
    """Show what attention looked at: an interactive page (and figures) for an example or model.

    With no model, the seed's example (--example journey|toy) with its walkthrough; with
    --checkpoint DIR or --model NAME, the attention of that model on TEXT.
    """
    from attnlab.explain.i18n import LANGS, message, normalize_lang

    try:
        lang = normalize_lang(lang)
    except ValueError:
        raise UserError(f"unknown --lang {lang!r}; choose one of {', '.join(LANGS)}") from None
    if checkpoint is not None and model is not None:
        raise UserError("give either --checkpoint or --model, not both")
    page_path = html if html is not None else out / "attention.html"
    for folder, what in ((out, "--out"), (page_path.parent, "--html")):
        if folder.exists() and not folder.is_dir():
            raise UserError(f"cannot write to `{what}` {str(folder)!r}: not a folder")
    if top_k is not None and top_k < 1:
        raise UserError(f"`--top-k` must be at least 1, got {top_k}")
    if (steps or token is not None) and checkpoint is None and model is None:
        raise UserError(
            "--steps/--token need a model (--checkpoint DIR or --model NAME); for the "
            "examples, `attnlab walkthrough` is the step-by-step walk"
        )
    if token is not None and not steps:
        raise UserError("--token chooses the query of --steps; add --steps")
    ablated: list[tuple[int, int]] = []
    if ablate is not None:
        if checkpoint is None and model is None:
            raise UserError("--ablate needs a model (--checkpoint DIR or --model NAME)")
        if ablate_mode not in ("zero", "mean"):
            raise UserError(f"unknown --ablate-mode {ablate_mode!r}; choose zero or mean")
        with user_input():
            ablated = parse_heads(ablate)

    walk = None
    flow_source: Any = None
    if checkpoint is None and model is None:
        if text is not None:
            raise UserError("TEXT needs a model: pass --checkpoint DIR or --model NAME")
        if example not in EXAMPLES:
            raise UserError(f"unknown --example {example!r}; choose one of {', '.join(EXAMPLES)}")
        from attnlab.explain.text import walkthrough_renderables

        example_trace = trace_example(example)
        flow_source = example_trace
        trace = trace_from_walkthrough(example_trace)
        walk = walkthrough_from_renderables(walkthrough_renderables(example_trace, lang))
    else:
        if text is None or not text.strip():
            raise UserError("TEXT must not be empty: give the text to run through the model")
        net, tokenizer, source = load_model_arg(checkpoint, model)
        with user_input():
            n_tokens = len(tokenizer.encode(text))
            blocks = attention_layers(net)
            top_k = auto_top_k(net, n_tokens, top_k)
            trace = trace_model(net, text, tokenizer=tokenizer, top_k=top_k, source=source)
        from attnlab.explain.figures import flow_shapes
        from attnlab.explain.fonts import figure_lang

        flow_source = flow_shapes(
            blocks[layer if 0 <= layer < len(blocks) else 0],
            n_tokens=n_tokens,
            lang=figure_lang(lang).lang,
        )

    if not 0 <= layer < trace.num_layers:
        raise UserError(f"`--layer` must be in 0..{trace.num_layers - 1} here, got {layer}")
    if not 0 <= head < trace.num_heads:
        raise UserError(f"`--head` must be in 0..{trace.num_heads - 1} here, got {head}")

    output.show(*_explain_renderables(trace, layer, head, lang))
    if trace.experts is not None and layer in trace.experts.layers:
        output.show(*_expert_renderables(trace, layer, lang))
    if ablated:
        output.show(*_ablation_renderables(net, tokenizer, trace, ablated, ablate_mode))
    if steps:
        output.show(*_step_renderables(net, text, tokenizer, source, layer, head, token, lang))

    try:
        out.mkdir(parents=True, exist_ok=True)
        page_path.parent.mkdir(parents=True, exist_ok=True)
        write_html(page_path, trace, walk, lang=lang, layer=layer, heads=[head])
    except OSError as e:
        raise UserError(f"cannot write the page {str(page_path)!r}: {e.strerror or e}") from e
    output.console.print(
        message("explain.page", lang, path=str(page_path)), markup=False, soft_wrap=True
    )
    if png or svg:
        from attnlab.explain.fonts import figure_lang

        notice = figure_lang(lang).notice
        if notice is not None:
            output.note(notice)
        paths = _explain_figures(trace, flow_source, layer, head, out, png=png, svg=svg, lang=lang)
        listing = "\n".join(f"  {p}" for p in paths)
        output.console.print(
            f"{message('label.wrote', lang)}\n{listing}", markup=False, soft_wrap=True
        )


def _expert_renderables(trace: Any, layer: int, lang: str) -> list[RenderableType]:
    """The terminal part of `explain` for a layer with experts: each token's experts and
    router weights (the first 32 tokens; the page has them all)."""
    from rich.table import Table
    from rich.text import Text

    from attnlab.explain.i18n import message
    from attnlab.explain.text import format_number

    experts = trace.experts
    chosen, weights = experts.layer_routing(layer)  # (T, k) each
    title = message("explain.experts", lang, layer=layer, k=experts.top_k, n=experts.num_experts)
    if experts.shared:
        title += f"; {message('explain.experts_shared', lang)}"
    table = Table(title=title, title_justify="left")
    table.add_column("#", justify="right")
    table.add_column(message("label.token", lang))
    for j in range(experts.top_k):
        table.add_column(f"{message('explain.expert', lang)} {j + 1}")
    shown = min(32, len(trace.tokens))
    for q in range(shown):
        cells = [
            f"{e} ({format_number(w)})"
            for e, w in zip(chosen[q].tolist(), weights[q].tolist(), strict=True)
        ]
        table.add_row(str(q), repr(trace.tokens[q]), *cells)
    out: list[RenderableType] = [Text(""), table]
    if shown < len(trace.tokens):
        out.append(Text(message("explain.more", lang, n=len(trace.tokens) - shown), style="dim"))
    return out


def _explain_renderables(trace: Any, layer: int, head: int, lang: str) -> list[RenderableType]:
    """The terminal part of `explain`: a summary line and the chosen head's weights."""
    from rich.table import Table
    from rich.text import Text

    from attnlab.explain.i18n import message
    from attnlab.explain.text import format_number, heatmap_tables, matrix_table

    mode = (
        message("explain.dense", lang)
        if trace.mode == "dense"
        else message("explain.topk", lang, k=trace.top_k)
    )
    summary = message(
        "explain.summary",
        lang,
        source=trace.source,
        n=len(trace.tokens),
        layers=trace.num_layers,
        heads=trace.num_heads,
        mode=mode,
    )
    name = (
        trace.layer_names[trace.layers.index(layer)]
        if trace.layer_names is not None
        else f"layer {layer}"
    )
    tokens = list(trace.tokens)
    out: list[RenderableType] = [Text(summary, style="bold"), Text("")]
    if len(tokens) <= 12 and trace.layer_names is not None:  # the seed's numbers, 4 decimals
        out.append(Text(message("explain.weights", lang, layer=name, head=head), style="bold"))
        out.append(
            matrix_table(
                "attn_weights",
                trace.head_weights(layer, head),
                row_labels=tokens,
                col_labels=tokens,
            )
        )
        return out
    if len(tokens) <= 32:  # a model's weights: shaded cells, two decimals, never cut
        out.append(Text(message("explain.weights", lang, layer=name, head=head), style="bold"))
        weights = trace.head_weights(layer, head)
        keys = list(trace.key_tokens)
        out.extend(heatmap_tables("", weights, tokens, keys, width=output.console.width))
        return out
    shown = 12
    indices, values = trace.head_top_keys(layer, head, 3)  # (T, 3) each
    table = Table(title=message("explain.top", lang, layer=name, head=head), title_justify="left")
    table.add_column("#", justify="right")
    table.add_column(message("label.token", lang))
    for j in range(indices.shape[1]):
        table.add_column(f"{j + 1}")
    for q in range(min(shown, len(tokens))):
        cells = [
            f"{trace.key_tokens[int(k)]!r} {format_number(float(v))}"
            for k, v in zip(indices[q].tolist(), values[q].tolist(), strict=True)
            if v > 0
        ]
        table.add_row(str(q), repr(tokens[q]), *cells)
    out.append(table)
    out.append(Text(message("explain.more", lang, n=len(tokens) - shown), style="dim"))
    return out


def _ablation_renderables(
    net: Any, tokenizer: Any, trace: Any, heads: list[tuple[int, int]], mode: str, k: int = 5
) -> list[RenderableType]:
    """The next-token prediction at the last position with and without ``heads``."""
    from rich.text import Text

    from attnlab.explain.text import ablation_table

    ids = list(trace.token_ids)
    with user_input():
        after = ablate(net, ids, heads, mode=mode)  # type: ignore[arg-type]
    before = ablate(net, ids, [])
    effect = ablation_effect(before, after, k)
    names = ", ".join(f"{layer}.{h}" for layer, h in heads)
    columns = []
    for logits in (before, after):
        probs, top = top_tokens(logits[0, -1], k)  # (k,)
        texts = _token_texts(tokenizer, top.tolist())
        columns.append((texts, probs.tolist()))
    kl = effect.kl[0]
    worst = int(kl.argmax())
    return [
        Text(""),
        Text(
            f"Next token after {trace.tokens[-1]!r}, heads {names} switched off ({mode}):",
            style="bold",
        ),
        ablation_table(
            "",
            columns[0],
            columns[1],
            f"without {names}",
        ),
        Text(
            f"KL(model || ablated) at the last position: {float(kl[-1]):.4f} nats; "
            f"largest at position {worst} ({trace.tokens[worst]!r}): {float(kl[worst]):.4f}"
        ),
    ]


def _step_renderables(
    net: Any,
    text: Any,
    tokenizer: Any,
    source: str,
    layer: int,
    head: int,
    token: int | None,
    lang: str,
) -> list[RenderableType]:
    """The terminal part of `explain --steps`: the walk into one head for one query."""
    from attnlab.explain.steps import head_steps, step_sections, step_summary
    from attnlab.explain.text import step_renderables

    n = len(_encode(tokenizer, text))
    if token is None:
        token = n - 1
    if not 0 <= token < n:
        raise UserError(f"`--token` must be in 0..{n - 1} (the text's tokens), got {token}")
    with user_input():
        walk = head_steps(
            net, text, layer=layer, head=head, token=token, tokenizer=tokenizer, source=source
        )
    return step_renderables(step_summary(walk, lang), step_sections(walk, lang), lang)


def _explain_figures(
    trace: Any,
    flow_source: Any,
    layer: int,
    head: int,
    out: Path,
    *,
    png: bool,
    svg: bool,
    lang: str = "en",
) -> list[Path]:
    from attnlab.explain.figures import (
        plot_attention_flow,
        plot_heads,
        plot_heatmap,
        plot_model,
    )

    figures = {
        f"attention-heatmap-L{layer}-H{head}": plot_heatmap(trace, layer, head, lang=lang),
        f"attention-heads-L{layer}": plot_heads(trace, layer, lang=lang),
        "attention-model": plot_model(trace, lang=lang),
    }
    if flow_source is not None:
        figures["attention-flow"] = plot_attention_flow(flow_source, lang=lang)
    exts = [e for e, on in (("png", png), ("svg", svg)) if on]
    paths: list[Path] = []
    try:
        for stem, fig in figures.items():
            for ext in exts:
                path = out / f"{stem}.{ext}"
                meta = {"Software": None} if ext == "png" else {"Date": None, "Creator": None}
                fig.savefig(path, dpi=130, metadata=meta)
                paths.append(path)
    except OSError as e:
        raise UserError(f"cannot write figures to `--out` {str(out)!r}: {e.strerror or e}") from e
    return paths
