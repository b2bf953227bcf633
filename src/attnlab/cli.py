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


# ---------------------------------------------------------------- pretrained models (issue 5)


def _load_pretrained(name: str, kind: str, backend: str) -> tuple[Any, Any]:
    """``load_pretrained`` with its errors as user errors; ``kind`` is encoder/causal-lm."""
    from attnlab.pretrained import PRETRAINED_MODELS, MissingPackageError, load_pretrained

    key = name.lower()
    fitting = sorted(n for n, (k, _) in PRETRAINED_MODELS.items() if k == kind)
    if key not in PRETRAINED_MODELS or PRETRAINED_MODELS[key][0] != kind:
        raise UserError(f"unknown --model {name!r} here; choose one of {', '.join(fitting)}")
    try:
        with user_input():
            return load_pretrained(key, backend=backend)
    except MissingPackageError as e:
        raise UserError(str(e)) from e


class _TextStream:
    """Turn token ids, arriving one by one, into text pieces that are safe to print.

    Byte-level BPE tokens can end inside a multi-byte character; the decoded text then
    ends in U+FFFD, and that tail is held back until the next token completes it.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.shown = 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        piece, self.shown = text[self.shown :], len(text)
        return piece

    def flush(self) -> str:
        text = self.tokenizer.decode(self.ids)
        piece, self.shown = text[self.shown :], len(text)
        return piece


def _generate_pretrained(
    name: str,
    prompt: str,
    *,
    chat: bool,
    backend: str,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    seed: int,
    use_cache: bool,
) -> None:
    """Stream a pretrained causal LM's continuation of ``prompt`` (or its chat reply)."""
    model, tok = _load_pretrained(name, "causal-lm", backend)
    import torch

    from attnlab.generation import generate_stream

    text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
    ids = tok.encode(text)[-model.context_length :]
    gen = torch.Generator().manual_seed(seed)
    stream = _TextStream(tok)
    started = False
    with user_input():
        for nxt in generate_stream(
            model,
            torch.tensor([ids]),
            max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            eos_id=tok.eos_id,
            use_cache=use_cache,
            generator=gen,
        ):
            if not started and not chat:
                output.stream(prompt)  # after the first step: the arguments are valid
            started = True
            token = int(nxt[0, 0])
            if token == tok.eos_id:
                break
            output.stream(stream.push(token))
    output.stream(("" if started or chat else prompt) + stream.flush() + "\n")


@app.command()
def generate(
    prompt: Annotated[str, typer.Argument(help="Text to continue (with --chat: the question).")],
    model: Annotated[
        str | None,
        typer.Option("--model", "-m", help="A pretrained model: smollm2-135m-instruct."),
    ] = None,
    chat: Annotated[
        bool,
        typer.Option("--chat", help="Apply the model's chat template (a user turn) first."),
    ] = False,
    backend: Annotated[
        str, typer.Option(help="Attention backend: auto, math, sdpa, ... (see `attnlab info`).")
    ] = "auto",
    max_new_tokens: Annotated[
        int, typer.Option("--max-new-tokens", "-n", help="Tokens to generate.")
    ] = 50,
    temperature: Annotated[float, typer.Option(help="0 = greedy; > 0 samples.")] = 0.0,
    top_k: Annotated[int | None, typer.Option("--top-k", help="Sample among the top k.")] = None,
    top_p: Annotated[
        float | None, typer.Option("--top-p", help="Nucleus sampling threshold.")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed for sampling.")] = 123,
    no_cache: Annotated[
        bool, typer.Option("--no-cache", help="Recompute the whole window for every token.")
    ] = False,
) -> None:
    """Continue a prompt with a language model, streaming the text as it is produced."""
    if not prompt:
        raise UserError("the prompt is empty; give some text to continue")
    if model is None:
        raise UserError("give the model to use: --model smollm2-135m-instruct")
    _generate_pretrained(
        model,
        prompt,
        chat=chat,
        backend=backend,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        use_cache=not no_cache,
    )


@app.command()
def embed(
    sentences: Annotated[list[str], typer.Argument(help="Two or more sentences to compare.")],
    model: Annotated[
        str, typer.Option("--model", "-m", help="A pretrained encoder: all-minilm-l6-v2.")
    ] = "all-minilm-l6-v2",
    backend: Annotated[
        str, typer.Option(help="Attention backend: auto, math, sdpa, ... (see `attnlab info`).")
    ] = "auto",
    json_out: Annotated[
        bool,
        typer.Option("--json", help="Print sentences and similarities as JSON on stdout."),
    ] = False,
) -> None:
    """Embed sentences (mean pooling, L2 norm) and print their cosine similarities."""
    import json

    from rich.table import Table

    from attnlab.pretrained import cosine_similarity_matrix, sentence_embeddings

    if len(sentences) < 2:
        raise UserError(f"give at least two sentences to compare, got {len(sentences)}")
    encoder, tok = _load_pretrained(model, "encoder", backend)
    with user_input():
        sim = cosine_similarity_matrix(sentence_embeddings(encoder, tok, sentences))
    if json_out:
        output.raw(
            json.dumps({"model": model.lower(), "sentences": sentences, "cosine": sim.tolist()})
        )
        return
    table = Table(title=f"cosine similarity, {model.lower()}", title_justify="left")
    table.add_column("#", justify="right", no_wrap=True)
    table.add_column("sentence")
    for j in range(len(sentences)):
        table.add_column(str(j + 1), justify="right", no_wrap=True)
    for i, s in enumerate(sentences):
        table.add_row(str(i + 1), s, *(f"{float(v):.3f}" for v in sim[i]))
    output.show(table)


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
