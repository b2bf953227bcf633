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
