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

    _check_local_backend(backend)
    key = name.lower()
    fitting = sorted(n for n, (k, _) in PRETRAINED_MODELS.items() if k == kind)
    if key not in PRETRAINED_MODELS or PRETRAINED_MODELS[key][0] != kind:
        raise UserError(f"unknown --model {name!r} here; choose one of {', '.join(fitting)}")
    try:
        with user_input():
            return load_pretrained(key, backend=backend)
    except MissingPackageError as e:
        raise UserError(str(e)) from e


def _check_local_backend(backend: str) -> None:
    """``--backend`` must name a backend that runs in this one process."""
    from attnlab.backends import available_backends

    local = [b for b in available_backends() if b != "ring"]
    if backend == "ring":
        raise UserError(
            "--backend ring needs a torch.distributed process group (see `attnlab ring-demo`); "
            f"choose one of {', '.join(local)}"
        )
    if backend not in local:
        raise UserError(f"unknown --backend {backend!r}; choose one of {', '.join(local)}")


def _use_backend(model: Any, backend: str) -> None:
    """Run every attention layer of ``model`` on ``backend`` (checked first)."""
    from attnlab.attention import Attention

    _check_local_backend(backend)
    for module in model.modules():
        if isinstance(module, Attention):
            module.backend = backend
    if hasattr(model, "backend"):
        model.backend = backend


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


# ---------------------------------------------------------------------------- GPT (issue 4)

DEFAULT_TRAIN_OUT = Path("runs/gpt")


def _train_argv(**opts: Any) -> list[str]:
    """The ``attnlab train`` arguments that reproduce ``opts`` (for the workers of --nproc)."""
    argv = ["train"]
    for name, value in opts.items():
        if value is None:
            continue
        argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


class _TrainView:
    """Renders training events: a progress bar (step, loss, tokens/s), evaluation lines."""

    def __init__(self) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.progress = Progress(
            TextColumn("step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[tps]} tok/s"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=output.console,
            transient=False,
        )
        self.task: Any = None

    def __call__(self, event: Any) -> None:
        from attnlab.train import CheckpointSaved, EvalResult, StepResult, TrainStart

        p = self.progress
        if isinstance(event, TrainStart):
            output.show(
                f"training a {event.num_parameters / 1e6:.1f}M-parameter GPT on {event.device}"
                f" x{event.world_size}: {event.train_windows} training / {event.val_windows} "
                f"validation windows, {event.tokens_per_step} tokens per step"
                + (f", resuming at step {event.start_step}" if event.start_step else "")
            )
            p.start()
            self.task = p.add_task(
                "train", total=event.total_steps, completed=event.start_step, loss="-", tps="-"
            )
        elif isinstance(event, StepResult):
            p.update(
                self.task,
                completed=event.step,
                loss=f"{event.loss:.3f}",
                tps=f"{event.tokens_per_sec:,.0f}",
            )
        elif isinstance(event, EvalResult):
            p.console.print(
                f"step {event.step:>5}  tokens {event.tokens_seen:>9,}  "
                f"train loss {event.train_loss:.3f}  val loss {event.val_loss:.3f}",
                markup=False,
            )
            if event.sample:
                p.console.print("  sample: " + " ".join(event.sample.split()), markup=False)
        elif isinstance(event, CheckpointSaved) and event.reason in ("final", "interrupt"):
            p.console.print(f"checkpoint saved: {event.path} (step {event.step})", markup=False)

    def close(self) -> None:
        if self.task is not None:
            self.progress.stop()


@app.command()
def train(
    preset: Annotated[
        str, typer.Option(help="Model size: tiny, gpt2-124m, gpt2-medium, gpt2-large, gpt2-xl.")
    ] = "tiny",
    steps: Annotated[
        int | None, typer.Option(help="Optimizer steps (default 200, or use --epochs).")
    ] = None,
    epochs: Annotated[int | None, typer.Option(help="Passes over the training text.")] = None,
    batch_size: Annotated[
        int, typer.Option("--batch-size", help="Global batch, split over the processes.")
    ] = 8,
    lr: Annotated[
        float | None,
        typer.Option(help="Peak learning rate (AdamW, warm-up, cosine); default by size."),
    ] = None,
    text: Annotated[
        Path | None, typer.Option(help="UTF-8 text file (default: the embedded story).")
    ] = None,
    out: Annotated[
        Path, typer.Option(help="Folder for the checkpoint, history.json and loss_curve.png.")
    ] = DEFAULT_TRAIN_OUT,
    seed: Annotated[int, typer.Option(help="Seed of the weights, dropout and batch order.")] = 123,
    resume: Annotated[
        Path | None, typer.Option(help="Continue the run saved in this checkpoint folder.")
    ] = None,
    eval_interval: Annotated[
        int, typer.Option("--eval-interval", help="Evaluate and save every N steps.")
    ] = 25,
    backend: Annotated[
        str, typer.Option(help="Attention backend: auto, math, sdpa (or any registered one).")
    ] = "auto",
    nproc: Annotated[
        int | None,
        typer.Option(help="Train with N processes (DDP; torchrun on 127.0.0.1)."),
    ] = None,
) -> None:
    """Train a GPT on a text (default: the tiny preset on the embedded story)."""
    import os

    from attnlab.train import DistributedTrainingError, TrainConfig

    if nproc is not None and int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        if nproc < 1:
            raise UserError(f"`--nproc` must be >= 1, got {nproc}")
        argv = _train_argv(
            preset=preset,
            steps=steps,
            epochs=epochs,
            batch_size=batch_size,
            lr=lr,
            text=text,
            out=out,
            seed=seed,
            resume=resume,
            eval_interval=eval_interval,
            backend=backend,
        )
        with user_input():
            TrainConfig(preset=preset, steps=steps, epochs=epochs, batch_size=batch_size, lr=lr)
            if text is not None:
                from attnlab.data import load_text

                load_text(text)
        from attnlab.train import launch

        try:
            launch(nproc, argv)
        except DistributedTrainingError as e:
            output.error(str(e))
            raise typer.Exit(1) from None
        return

    from attnlab.data import load_text
    from attnlab.train import Trainer, stop_on_signals

    with user_input():
        config = TrainConfig(
            preset=preset,
            steps=steps,
            epochs=epochs,
            batch_size=batch_size,
            lr=lr,
            seed=seed,
            eval_interval=eval_interval,
            backend=backend,
        )
        corpus = load_text(text)
    view = _TrainView()
    try:
        with user_input():
            trainer = Trainer(config, out_dir=out, text=corpus, resume=resume, callback=view)
            trainer.prepare()  # input errors (short text, bad checkpoint) surface here
        with stop_on_signals(trainer):
            result = _run_recorded(trainer)
    except DistributedTrainingError as e:
        output.error(str(e))
        raise typer.Exit(1) from None
    finally:
        view.close()
    if result.loss_png is None:
        return
    if result.interrupted:
        output.note(
            f"interrupted at step {result.steps_done}/{result.total_steps}; checkpoint saved in "
            f"{out}; continue with: attnlab train --resume {out}"
        )
        raise typer.Exit(130)
    last = result.evals[-1]
    output.show(
        f"done: {result.steps_done} steps, train loss {last.train_loss:.3f}, val loss "
        f"{last.val_loss:.3f}\nwrote {out}/ (checkpoint), {result.loss_png}"
    )


def _run_recorded(trainer: Any) -> Any:
    """Run the trainer; under torchrun, record a failure for the launcher's report."""
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from torch.distributed.elastic.multiprocessing.errors import record

        return record(trainer.run)()
    return trainer.run()


@app.command()
def generate(
    prompt: Annotated[str, typer.Argument(help="Text to continue (with --chat: the question).")],
    checkpoint: Annotated[
        Path | None, typer.Option(help="A checkpoint folder written by `attnlab train`.")
    ] = None,
    model: Annotated[
        str | None,
        typer.Option("--model", "-m", help="A pretrained model instead: smollm2-135m-instruct."),
    ] = None,
    chat: Annotated[
        bool,
        typer.Option("--chat", help="With --model: apply its chat template (a user turn)."),
    ] = False,
    backend: Annotated[
        str, typer.Option(help="Attention backend: auto, math, sdpa, blockwise, ...")
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
    """Continue a prompt with a trained GPT or a pretrained model, streaming the text."""
    import codecs

    import torch

    from attnlab.checkpoint import CheckpointError
    from attnlab.data import EOT_TOKEN_ID, get_tokenizer
    from attnlab.generation import generate_stream

    if (checkpoint is None) == (model is None):
        raise UserError(
            "give the model to use: --checkpoint DIR (a folder from `attnlab train`) or "
            "--model smollm2-135m-instruct (one of the two)"
        )
    if not prompt:
        raise UserError("the prompt is empty; give some text to continue")
    if model is not None:
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
        return
    if chat:
        raise UserError("--chat needs --model (a chat model); a GPT checkpoint has no template")
    assert checkpoint is not None  # exactly one of the two was given
    try:
        from attnlab.models.gpt import GPTModel

        gpt = GPTModel.from_checkpoint(checkpoint)
    except CheckpointError as e:
        raise UserError(str(e)) from e
    _use_backend(gpt, backend)
    gpt.eval()
    tok = get_tokenizer()
    ids = tok.encode(prompt, allowed_special="all")[-gpt.context_length :]
    gen = torch.Generator().manual_seed(seed)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    output.stream(prompt)
    with user_input():
        stream = generate_stream(
            gpt,
            torch.tensor([ids]),
            max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            eos_id=EOT_TOKEN_ID,
            use_cache=not no_cache,
            generator=gen,
        )
        for nxt in stream:
            token = int(nxt[0, 0])
            if token == EOT_TOKEN_ID:
                break
            output.stream(decoder.decode(tok.decode_single_token_bytes(token)))
    output.stream(decoder.decode(b"", final=True) + "\n")


@app.command()
def embed(
    sentences: Annotated[list[str], typer.Argument(help="Two or more sentences to compare.")],
    model: Annotated[
        str, typer.Option("--model", "-m", help="A pretrained encoder: all-minilm-l6-v2.")
    ] = "all-minilm-l6-v2",
    backend: Annotated[
        str, typer.Option(help="Attention backend: auto, math, sdpa, blockwise, ...")
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


def _preset_table(name: str) -> Any:
    from rich.table import Table

    from attnlab.models.gpt import parameter_report

    r = parameter_report(name)
    c = r.config
    table = Table(
        title=f"{name}: {c.n_layers} layers, emb_dim {c.emb_dim}, {c.n_heads} heads, "
        f"context {c.context_length}, vocab {c.vocab_size}",
        title_justify="left",
    )
    table.add_column("module", no_wrap=True)
    table.add_column("parameters", justify="right", no_wrap=True)
    for module, count in r.per_module:
        table.add_row(module, f"{count:,}")
    table.add_section()
    table.add_row("total", f"{r.total:,}")
    table.add_row("total with weight tying (head = tok_emb)", f"{r.total_tied:,}")
    table.add_row("size in float32", f"{r.size_mb:,.2f} MB")
    return table


def _info_presets(preset: str | None) -> list[RenderableType]:
    """``attnlab info``'s model part: GPT presets' parameter counts and model sizes."""
    from attnlab.models.gpt import PRESETS

    if preset is not None:
        if preset == "all":
            names = list(PRESETS)
        elif preset in PRESETS:
            names = [preset]
        else:
            raise UserError(
                f"unknown --preset {preset!r}; choose one of: {', '.join(PRESETS)}, all"
            )
        return [_preset_table(n) for n in names]
    from rich.table import Table

    from attnlab.models.gpt import parameter_report

    table = Table(title="GPT presets (attnlab info --preset NAME for the details)")
    for col in ("preset", "layers", "emb_dim", "heads", "context", "parameters", "fp32 size"):
        table.add_column(col, justify="left" if col == "preset" else "right", no_wrap=True)
    for name in PRESETS:
        r = parameter_report(name)
        c = r.config
        table.add_row(
            name,
            str(c.n_layers),
            str(c.emb_dim),
            str(c.n_heads),
            str(c.context_length),
            f"{r.total:,}",
            f"{r.size_mb:,.1f} MB",
        )
    return [table]


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
    flow_source: Any = None
    if checkpoint is None and model is None:
        if text is not None:
            raise UserError("TEXT needs a model: pass --checkpoint DIR or --model NAME")
        if example not in EXAMPLES:
            raise UserError(f"unknown --example {example!r}; choose one of {', '.join(EXAMPLES)}")
        from attnlab.explain.html import walkthrough_from_renderables
        from attnlab.explain.model_trace import trace_from_walkthrough
        from attnlab.explain.text import walkthrough_renderables
        from attnlab.explain.trace import trace_example

        example_trace = trace_example(example)
        flow_source = example_trace
        trace = trace_from_walkthrough(example_trace)
        walk = walkthrough_from_renderables(walkthrough_renderables(example_trace, lang))
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
        from attnlab.explain.figures import flow_shapes

        flow_source = flow_shapes(
            blocks[layer if 0 <= layer < len(blocks) else 0], n_tokens=n_tokens
        )

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
        paths = _explain_figures(trace, flow_source, layer, head, out, png=png, svg=svg)
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
    trace: Any, flow_source: Any, layer: int, head: int, out: Path, *, png: bool, svg: bool
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
    if flow_source is not None:
        figures["attention-flow"] = plot_attention_flow(flow_source)
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


_INFO_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16",
                "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
                "float64": "float64", "fp64": "float64"}  # fmt: skip
_INFO_MASKS = ("none", "causal", "padding", "window", "boolean")


@app.command()
def info(
    seq_len: Annotated[int, typer.Option("--seq-len", "-t", help="Query length T.")] = 1024,
    key_len: Annotated[
        int | None, typer.Option("--key-len", "-s", help="Key length S (default T).")
    ] = None,
    batch: Annotated[int, typer.Option(help="Batch size B.")] = 1,
    heads: Annotated[int, typer.Option(help="Query heads H.")] = 12,
    kv_heads: Annotated[
        int | None, typer.Option("--kv-heads", help="Key/value heads G (default H).")
    ] = None,
    head_dim: Annotated[int, typer.Option("--head-dim", help="Head dim D.")] = 64,
    dtype: Annotated[str, typer.Option(help="float32, bfloat16, float16 or float64.")] = "float32",
    mask: Annotated[str, typer.Option(help="none, causal, padding, window or boolean.")] = "causal",
    dropout: Annotated[float, typer.Option(help="Attention dropout probability.")] = 0.0,
    backend: Annotated[str, typer.Option(help="Backend to explain (default auto).")] = "auto",
    backward: Annotated[
        bool, typer.Option("--backward", help="Explain a training call (forward+backward).")
    ] = False,
    show_table: Annotated[
        bool, typer.Option("--table", help="Show every row of auto's crossover table.")
    ] = False,
    preset: Annotated[
        str | None,
        typer.Option(
            help="GPT preset whose parameter counts to report (tiny, gpt2-124m, gpt2-medium, "
            "gpt2-large, gpt2-xl), or 'all'; shows only that."
        ),
    ] = None,
) -> None:
    """Report what attnlab has: the attention backends, the crossover table auto chooses
    by, which backend a call of this shape would run (and why not the others), and the GPT
    presets' parameter counts and sizes."""
    if preset is not None:
        output.show(*_info_presets(preset))
        return
    import torch
    from rich.table import Table

    from attnlab.backends import AUTO_ORDER, explain_dispatch, get_backend
    from attnlab.backends import available_backends as names
    from attnlab.masks import BooleanMask, CausalMask, PaddingMask, SlidingWindowMask

    if dtype not in _INFO_DTYPES:
        raise UserError(f"unknown --dtype {dtype!r}; choose one of {', '.join(_INFO_DTYPES)}")
    if mask not in _INFO_MASKS:
        raise UserError(f"unknown --mask {mask!r}; choose one of {', '.join(_INFO_MASKS)}")
    for name, value in (("--seq-len", seq_len), ("--batch", batch), ("--heads", heads),
                        ("--head-dim", head_dim), ("--key-len", key_len),
                        ("--kv-heads", kv_heads)):  # fmt: skip
        if value is not None and value < 1:
            raise UserError(f"`{name}` must be a positive int, got {value}")
    T, S, G = seq_len, key_len or seq_len, kv_heads or heads
    tdtype = getattr(torch, _INFO_DTYPES[dtype])

    def shaped(*shape: int) -> torch.Tensor:  # no memory: one element, expanded
        one = torch.zeros((1,) * len(shape), dtype=tdtype).requires_grad_(backward)
        return one.expand(*shape)

    attn_mask = {
        "none": None,
        "causal": CausalMask(),
        "padding": PaddingMask(torch.ones(1, 1, dtype=torch.bool).expand(batch, S)),
        "window": SlidingWindowMask(min(256, S)) if mask == "window" else None,
        "boolean": BooleanMask(torch.ones(1, 1, 1, 1, dtype=torch.bool).expand(1, 1, T, S)),
    }[mask]
    with user_input():
        exp = explain_dispatch(
            shaped(batch, heads, T, head_dim),
            shaped(batch, G, S, head_dim),
            shaped(batch, G, S, head_dim),
            attn_mask,
            dropout,
            backend=backend,
        )

    table = Table(title=f"attnlab {attnlab.__version__} attention backends (torch "
                        f"{torch.__version__}, {torch.get_num_threads()} threads)")  # fmt: skip
    table.add_column("backend")
    table.add_column("auto rank")
    table.add_column("what it is")
    for name in names():
        if name == "auto":
            continue
        rank = str(AUTO_ORDER.index(name) + 1) if name in AUTO_ORDER else "-"
        table.add_row(name, rank, get_backend(name).summary)
    call = (
        f"B={batch} H={heads} G={G} T={T} S={S} D={head_dim} {_INFO_DTYPES[dtype]} "
        f"mask={mask} dropout={dropout}"
    )
    pass_ = "forward+backward" if backward else "forward"
    verdict = Table(
        title=f"dispatch for {call} {pass_}: backend={backend!r} -> {exp.chosen}",
        caption=f"decided by {exp.decided_by}" if exp.decided_by else None,
    )
    verdict.add_column("backend")
    verdict.add_column("verdict")
    for name, why in exp.reasons:
        verdict.add_row(name, "chosen" if why is None else why)
    output.show(table, _info_dispatch_table(show_table), verdict, *_info_presets(None))


def _info_dispatch_table(full: bool) -> RenderableType:
    """``attnlab info``'s crossover table: where it was measured, how quiet, its rows."""
    from rich.table import Table
    from rich.text import Text

    from attnlab.backends import dispatch_table

    with user_input():
        table = dispatch_table()
    if table is None:
        return Text("auto's crossover table: none; auto uses the fixed order")
    m = table.machine
    busy = m.get("others_busy_during", m.get("others_busy_before"))
    quiet = (
        f"other processes used {busy:.0%} of the machine"
        if isinstance(busy, (int, float))
        else "quietness not recorded"
    )
    title = (
        f"auto's crossover table ({len(table.rows)} rows, {table.path}): measured "
        f"{m.get('date', '?')} on {m.get('cpu', '?')}, torch {m.get('torch', '?')}, "
        f"{m.get('threads', '?')} threads; {quiet}"
        + ("" if m.get("quiet", True) else " (NOT QUIET: provisional)")
    )
    if not full:
        return Text(title + "; `attnlab info --table` lists the rows")
    out = Table(title=title)
    for col in ("row", "dtype", "pass", "mask", "sqrt(T*S)", "fastest first", "ms (T: times)"):
        out.add_column(col)
    for r in table.rows:
        hi = "inf" if r.t_below is None else f"{r.t_below:g}"
        ms = "; ".join(
            f"{t}: " + " ".join(f"{per[n]:.3g}" for n in r.order if n in per)
            for t, per in sorted(r.ms.items())
        )
        out.add_row(
            str(r.index), r.dtype, r.pass_, r.mask, f"{r.t_from:g}..{hi}", " < ".join(r.order), ms
        )
    return out


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
