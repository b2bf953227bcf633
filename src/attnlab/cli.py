"""The ``attnlab`` command: parse, call the library, render. No math here.

One typer app, one function per command, all output through one :class:`Output`
object, and user errors turned into one line on stderr with exit status 2 in one
place (:func:`main`). A command signals a user error by raising :class:`UserError`
(or by letting a library ``ValueError``/``TypeError`` pass through :func:`user_input`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console, RenderableType

import attnlab

__all__ = ["Output", "UserError", "app", "main", "output", "user_input"]

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

    def error(self, text: str) -> None:
        """One line on stderr, never wrapped."""
        line = " ".join(str(text).split())
        sys.stderr.write(f"attnlab: error: {line}\n")
        sys.stderr.flush()


output = Output()

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
    from attnlab.examples import EXAMPLES, get_example
    from attnlab.explain.i18n import LANGS, normalize_lang
    from attnlab.explain.trace import trace_example

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
    from attnlab.explain.i18n import message

    try:
        paths = save_walkthrough_figures(trace, out_dir)
    except OSError as e:
        reason = e.strerror or str(e)
        raise UserError(f"cannot write figures to `--out` {str(out_dir)!r}: {reason}") from e
    listing = "\n".join(f"  {p}" for p in paths)
    text = f"{message('label.wrote', lang)}\n{listing}"
    if json_out:
        output.note(text)
    else:
        output.console.print(text, markup=False, soft_wrap=True)


# Above this many dense weights (layers x heads x T x T) `explain` keeps only the
# strongest keys of each query (unless --top-k says otherwise).
EXPLAIN_DENSE_LIMIT = 1 << 24
EXPLAIN_AUTO_TOP_K = 32


def _load_checkpoint_model(directory: Path) -> tuple[Any, Any, str]:
    """A GPT trained with ``attnlab train``, its tokenizer, and a label."""
    try:
        from attnlab.checkpoint import load_checkpoint
        from attnlab.data import get_tokenizer
        from attnlab.models.gpt import GPTConfig, GPTModel
    except ImportError as e:  # pragma: no cover - a partial install
        raise UserError(f"--checkpoint needs attnlab's GPT model, which is missing: {e}") from e
    with user_input():
        ckpt = load_checkpoint(directory, model_type="gpt", with_training_state=False)
        model = GPTModel(GPTConfig.from_dict(ckpt.model_config))
        model.load_state_dict(ckpt.state_dict)
    return model.eval(), get_tokenizer(), f"GPT checkpoint {directory} (step {ckpt.step})"


def _load_pretrained_model(name: str) -> tuple[Any, Any, str]:
    """A packaged pretrained model, its tokenizer, and a label."""
    try:
        from attnlab.pretrained import load_pretrained
    except ImportError as e:  # pragma: no cover - a partial install
        raise UserError(f"--model needs attnlab.pretrained, which is missing: {e}") from e
    try:
        with user_input():
            model, tokenizer = load_pretrained(name)
    except ImportError as e:  # the weights' package is not installed
        raise UserError(str(e)) from e
    return model, tokenizer, name


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
            "--model", "-m", help="A pretrained model: all-minilm-l6-v2 or smollm2-135m-instruct."
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
) -> None:
    """Show what attention looked at: an interactive page (and figures) for an example or model.

    With no model, the seed's example (--example journey|toy) with its walkthrough; with
    --checkpoint DIR or --model NAME, the attention of that model on TEXT.
    """
    from attnlab.examples import EXAMPLES
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

    walk = None
    flow_trace = None
    if checkpoint is None and model is None:
        if text is not None:
            raise UserError("TEXT needs a model: pass --checkpoint DIR or --model NAME")
        if example not in EXAMPLES:
            raise UserError(f"unknown --example {example!r}; choose one of {', '.join(EXAMPLES)}")
        from attnlab.explain.html import walkthrough_from_renderables
        from attnlab.explain.model_trace import trace_from_walkthrough
        from attnlab.explain.text import walkthrough_renderables
        from attnlab.explain.trace import trace_example

        flow_trace = trace_example(example)
        trace = trace_from_walkthrough(flow_trace)
        walk = walkthrough_from_renderables(walkthrough_renderables(flow_trace, lang))
    else:
        if text is None or not text.strip():
            raise UserError("TEXT must not be empty: give the text to run through the model")
        if checkpoint is not None:
            net, tokenizer, source = _load_checkpoint_model(checkpoint)
        else:
            assert model is not None
            net, tokenizer, source = _load_pretrained_model(model)
        from attnlab.explain.model_trace import attention_layers, trace_model

        with user_input():
            n_tokens = len(tokenizer.encode(text))
            blocks = attention_layers(net)
            dense = len(blocks) * int(blocks[0].num_heads) * n_tokens**2
            if top_k is None and dense > EXPLAIN_DENSE_LIMIT:
                top_k = EXPLAIN_AUTO_TOP_K
            trace = trace_model(net, text, tokenizer=tokenizer, top_k=top_k, source=source)

    if not 0 <= layer < trace.num_layers:
        raise UserError(f"`--layer` must be in 0..{trace.num_layers - 1} here, got {layer}")
    if not 0 <= head < trace.num_heads:
        raise UserError(f"`--head` must be in 0..{trace.num_heads - 1} here, got {head}")

    output.show(*_explain_renderables(trace, layer, head, lang))

    from attnlab.explain.html import write_html

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
        paths = _explain_figures(trace, flow_trace, layer, head, out, png=png, svg=svg)
        listing = "\n".join(f"  {p}" for p in paths)
        output.console.print(
            f"{message('label.wrote', lang)}\n{listing}", markup=False, soft_wrap=True
        )


def _explain_renderables(trace: Any, layer: int, head: int, lang: str) -> list[RenderableType]:
    """The terminal part of `explain`: a summary line and the chosen head's weights."""
    from rich.table import Table
    from rich.text import Text

    from attnlab.explain.i18n import message
    from attnlab.explain.text import format_number, matrix_table

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
    if len(tokens) <= 12:
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


def _explain_figures(
    trace: Any, flow_trace: Any, layer: int, head: int, out: Path, *, png: bool, svg: bool
) -> list[Path]:
    from attnlab.explain.figures import (
        plot_attention_flow,
        plot_heads,
        plot_heatmap,
        plot_model,
    )

    figures = {
        f"attention-heatmap-L{layer}-H{head}": plot_heatmap(trace, layer, head),
        f"attention-heads-L{layer}": plot_heads(trace, layer),
        "attention-model": plot_model(trace),
    }
    if flow_trace is not None:
        figures["attention-flow"] = plot_attention_flow(flow_trace)
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


@app.command("ring-demo")
def ring_demo(
    nproc: Annotated[int, typer.Option("--nproc", "-n", help="Local processes (ranks).")] = 2,
    seq_len: Annotated[
        int, typer.Option("--seq-len", "-t", help="Full sequence length T (split over ranks).")
    ] = 4096,
    heads: Annotated[int, typer.Option(help="Attention heads H.")] = 8,
    head_dim: Annotated[int, typer.Option("--head-dim", help="Head dim D.")] = 64,
    batch: Annotated[int, typer.Option(help="Batch size B.")] = 1,
    layout: Annotated[
        str, typer.Option(help="How the sequence is split: zigzag or contiguous.")
    ] = "zigzag",
    causal: Annotated[bool, typer.Option("--causal/--no-causal", help="Causal mask.")] = True,
    dtype: Annotated[str, typer.Option(help="float32, float64 or bfloat16.")] = "float32",
    backward: Annotated[
        bool, typer.Option("--backward", help="Also run (and time) the backward pass.")
    ] = False,
    seed: Annotated[int, typer.Option(help="Seed of the random query/key/value.")] = 0,
    timeout: Annotated[float, typer.Option(help="Seconds before the run is abandoned.")] = 600.0,
) -> None:
    """Run ring attention on N local processes (gloo, 127.0.0.1) and check it against one."""
    from rich.table import Table

    from attnlab.distributed.demo import run_ring_demo

    with user_input():
        try:
            result = run_ring_demo(
                nproc, seq_len, batch=batch, heads=heads, head_dim=head_dim, causal=causal,
                layout=layout, dtype=dtype, backward=backward, seed=seed, timeout=timeout,
            )  # fmt: skip
        except RuntimeError as e:
            raise UserError(str(e)) from e
    r = result
    mib = 2.0**20
    table = Table(
        title=f"ring attention: T={r.seq_len} over {r.nproc} ranks ({r.layout}), B={r.batch} "
        f"H={r.heads} D={r.head_dim}, {'causal' if r.causal else 'not causal'}, {r.dtype}"
        + (", forward + backward" if r.backward else ", forward")
    )
    for col in ("rank", "time s", "compute s (CPU)", "waiting s", "sent MiB", "peak MiB"):
        table.add_column(col, justify="right")
    for x in r.ranks:
        table.add_row(
            str(x.rank), f"{x.seconds:.3f}", f"{x.compute_cpu_s:.3f}", f"{x.wait_s:.3f}",
            f"{x.bytes_sent / mib:.1f}",
            f"{x.peak_bytes / mib:.1f}" if r.memory_supported else "n/a",
        )  # fmt: skip
    output.show(table)
    output.console.print(
        f"max |ring - single process| = {r.max_error:.3e}  (single process: {r.reference}, "
        f"{r.reference_s:.3f} s)\npeak MiB: the rank's peak memory counted from before its "
        "inputs existed (its shards + the call; resident set on CPU)",
        markup=False,
        soft_wrap=True,
    )


def _framework_errors() -> tuple[tuple[type[BaseException], ...], tuple[type[BaseException], ...]]:
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


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``attnlab`` console script and ``python -m attnlab``.

    Exits with the command's status: 0 on success, 2 for a user error (one line on
    stderr, no traceback), 130 on Ctrl-C.
    """
    usage_errors, aborts = _framework_errors()
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
    raise SystemExit(code if isinstance(code, int) else 0)
