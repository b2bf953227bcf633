"""`attnlab train`: train a GPT (one process, or DDP with --nproc)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from attnlab.cli.app import app
from attnlab.cli.output import UserError, output, user_input


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
            p.console.print(  # soft_wrap: a path is never folded over two lines
                f"checkpoint saved: {event.path} (step {event.step})", markup=False, soft_wrap=True
            )

    def close(self) -> None:
        if self.task is not None:
            self.progress.stop()


@app.command()
def train(
    preset: Annotated[
        str, typer.Option(help="Model size: tiny, gpt2-124m, gpt2-medium, gpt2-large, gpt2-xl.")
    ] = "tiny",
    context_length: Annotated[
        int | None,
        typer.Option(
            "--context-length",
            help="Tokens per training window and the model's context length "
            "(default: the preset's).",
        ),
    ] = None,
    layers: Annotated[
        int | None,
        typer.Option("--layers", help="Transformer blocks of the model (default: the preset's)."),
    ] = None,
    emb_dim: Annotated[
        int | None,
        typer.Option("--emb-dim", help="Model width (default: the preset's)."),
    ] = None,
    heads: Annotated[
        int | None,
        typer.Option("--heads", help="Attention heads per block (default: the preset's)."),
    ] = None,
    dropout: Annotated[
        float | None,
        typer.Option("--dropout", help="Dropout probability (default: the preset's)."),
    ] = None,
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
    warmup_steps: Annotated[
        int | None,
        typer.Option(
            "--warmup-steps",
            help="Steps of linear warm-up to the peak learning rate (default: 5% of the steps).",
            show_default=False,
        ),
    ] = None,
    text: Annotated[
        Path | None, typer.Option(help="UTF-8 text file (default: the embedded story).")
    ] = None,
    repeated_words: Annotated[
        str | None,
        typer.Option(
            "--repeated-words",
            metavar="MIN-MAX",
            help="Instead of a text, train on random one-token words: sequences of MIN to MAX "
            "words (drawn by --seed), each followed by its copy, the data that grows "
            "induction heads.",
        ),
    ] = None,
    stride: Annotated[
        int | None,
        typer.Option(
            "--stride",
            help="Tokens between the starts of training windows. Default: the context "
            "length (windows side by side), or 1 with --repeated-words (a window at every "
            "offset, so the copies sit at every position of a window).",
            show_default=False,
        ),
    ] = None,
    tokenizer: Annotated[
        str | None,
        typer.Option(
            "--tokenizer",
            help="gpt2 (GPT-2's BPE, 50,257 ids) or words (one id per word of the training "
            "text; a small vocabulary trains fast). Default: words with --repeated-words, "
            "else gpt2. The checkpoint records it.",
            show_default=False,
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            help="Folder for the checkpoint, history.json and loss_curve.png "
            "(default: runs/gpt, or the --resume folder).",
            show_default=False,
        ),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the weights, dropout and batch order.")] = 123,
    resume: Annotated[
        Path | None,
        typer.Option(help="Continue the run saved in this checkpoint folder (and write there)."),
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
    import shlex

    from attnlab.train import (
        EXIT_INTERRUPTED,
        DistributedTrainingError,
        TrainConfig,
    )

    if nproc is not None and int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        if nproc < 1:
            raise UserError(f"`--nproc` must be >= 1, got {nproc}")
        argv = _train_argv(
            preset=preset,
            context_length=context_length,
            layers=layers,
            emb_dim=emb_dim,
            heads=heads,
            dropout=dropout,
            steps=steps,
            epochs=epochs,
            batch_size=batch_size,
            lr=lr,
            warmup_steps=warmup_steps,
            text=text,
            repeated_words=repeated_words,
            stride=stride,
            tokenizer=tokenizer,
            out=out,
            seed=seed,
            resume=resume,
            eval_interval=eval_interval,
            backend=backend,
        )
        with user_input():
            TrainConfig(
                preset=preset,
                model=_model_config(preset, context_length, layers, emb_dim, heads, dropout),
                steps=steps,
                epochs=epochs,
                batch_size=batch_size,
                lr=lr,
                warmup_steps=warmup_steps,
                tokenizer=_tokenizer(tokenizer, repeated_words),
                stride=_stride(stride, repeated_words),
            )
            _corpus(text, repeated_words, seed)
        from attnlab.train import launch

        try:
            interrupted = launch(nproc, argv)
        except KeyboardInterrupt:  # before the launcher took over the signals
            interrupted = True
        except DistributedTrainingError as e:
            output.error(str(e))
            raise typer.Exit(1) from None
        if interrupted:  # rank 0 said where the checkpoint is and how to continue
            raise typer.Exit(EXIT_INTERRUPTED)
        return

    from attnlab.train import Trainer, stop_on_signals

    with user_input():
        config = TrainConfig(
            preset=preset,
            model=_model_config(preset, context_length, layers, emb_dim, heads, dropout),
            steps=steps,
            epochs=epochs,
            batch_size=batch_size,
            lr=lr,
            warmup_steps=warmup_steps,
            seed=seed,
            eval_interval=eval_interval,
            backend=backend,
            tokenizer=_tokenizer(tokenizer, repeated_words),
            stride=_stride(stride, repeated_words),
        )
        corpus = _corpus(text, repeated_words, seed)
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
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if int(os.environ.get("RANK", "0")) != 0:
        return
    if not result.trained:
        output.note(
            f"the run in {resume} is already at step {result.steps_done} (asked for "
            f"{result.total_steps}); nothing was trained"
        )
        return
    if result.interrupted:
        again = ["attnlab", "train", "--resume", str(result.out_dir)]
        again += ["--text", str(text)] if text is not None else []
        if repeated_words is not None:
            again += ["--repeated-words", repeated_words, "--seed", str(seed)]
        again += ["--nproc", str(world)] if world > 1 else []
        output.note(
            f"interrupted at step {result.steps_done}/{result.total_steps}; checkpoint saved in "
            f"{result.out_dir}; continue with: {shlex.join(again)}"
        )
        raise typer.Exit(EXIT_INTERRUPTED)
    last = result.evals[-1]
    output.console.print(
        f"done: {result.steps_done} steps, train loss {last.train_loss:.3f}, val loss "
        f"{last.val_loss:.3f}\nwrote {result.history_json}, {result.loss_png}",
        markup=False,
        soft_wrap=True,
    )


def _stride(stride: int | None, repeated_words: str | None) -> int | None:
    """``--stride``, or its default: 1 for the ``--repeated-words`` data, else None (the
    context length). With windows side by side, a few thousand steps see the same windows
    again and again, and a small model learns them by heart instead of learning to copy."""
    if stride is not None:
        if stride < 1:
            raise ValueError(f"`--stride` must be >= 1, got {stride}")
        return stride
    return 1 if repeated_words is not None else None


def _tokenizer(tokenizer: str | None, repeated_words: str | None) -> str:
    """``--tokenizer``, or its default: words for the ``--repeated-words`` data, else gpt2."""
    from attnlab.data import TOKENIZERS

    if tokenizer is None:
        return "words" if repeated_words is not None else "gpt2"
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"`--tokenizer` must be one of {', '.join(TOKENIZERS)}, got {tokenizer!r}")
    return tokenizer


def _model_config(
    preset: str,
    context_length: int | None,
    layers: int | None,
    emb_dim: int | None = None,
    heads: int | None = None,
    dropout: float | None = None,
) -> Any:
    """The preset's model config with ``--context-length``, ``--layers``, ``--emb-dim``,
    ``--heads`` and ``--dropout`` applied; None when none is given (the preset itself)."""
    sizes = (
        ("--context-length", "context_length", context_length),
        ("--layers", "n_layers", layers),
        ("--emb-dim", "emb_dim", emb_dim),
        ("--heads", "n_heads", heads),
    )
    if all(v is None for _, _, v in sizes) and dropout is None:
        return None
    from attnlab.models.gpt import GPTConfig

    overrides: dict[str, Any] = {}
    for flag, name, value in sizes:
        if value is not None:
            if value < 1:
                raise ValueError(f"`{flag}` must be >= 1, got {value}")
            overrides[name] = value
    if dropout is not None:
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"`--dropout` must be in [0, 1), got {dropout}")
        overrides["drop_rate"] = dropout
    try:
        return GPTConfig.preset(preset, **overrides)
    except ValueError as exc:  # emb_dim not divisible by n_heads: name the flags
        raise ValueError(f"{exc} (--emb-dim / --heads)") from exc


# Tokens of --repeated-words data: a few hundred steps of 8 windows never see a window twice.
REPEATED_TOKENS = 200_000


def _corpus(text: Path | None, repeated_words: str | None, seed: int) -> str:
    """The training text: ``--text``, the ``--repeated-words`` data, or the embedded story."""
    from attnlab.data import load_text, repeated_random_text

    if repeated_words is None:
        return load_text(text)
    if text is not None:
        raise ValueError("give `--text` or `--repeated-words`, not both")
    low, sep, high = repeated_words.partition("-")
    if not (sep and low.isdigit() and high.isdigit() and 1 <= int(low) <= int(high)):
        raise ValueError(
            f"`--repeated-words` must be MIN-MAX with 1 <= MIN <= MAX, e.g. 5-20; "
            f"got {repeated_words!r}"
        )
    n_sequences = max(1, REPEATED_TOKENS // (int(low) + int(high)))  # mean 2 * (MIN+MAX)/2
    return repeated_random_text(n_sequences, int(high), min_length=int(low), seed=seed)


def _run_recorded(trainer: Any) -> Any:
    """Run the trainer; under torchrun, record a failure for the launcher's report."""
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from torch.distributed.elastic.multiprocessing.errors import record

        return record(trainer.run)()
    return trainer.run()
