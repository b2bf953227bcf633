"""Pretraining the GPT on a text file: the loop, evaluation, checkpoints, resume and DDP.

One loop serves one process and many: under ``torchrun`` (or :func:`launch`, which starts
torch's own elastic launcher on 127.0.0.1) each rank takes an equal slice of every global
batch, DistributedDataParallel averages the gradients (gloo on CPU, NCCL on GPU), and the
loss curve matches a single process with the same global batch within floating-point
tolerance (dropout aside: each process draws its own masks). Only rank 0 reports, writes
checkpoints and figures. Joining the process group and launching the workers live in
:mod:`attnlab.distributed.training`.

Determinism: batch order is a seeded permutation per epoch, so the data position is a function
of the step; a checkpoint stores the optimizer, every RNG state, the step and the loss history,
so on CPU a resumed run reproduces the uninterrupted run's losses bit for bit.

Shape legend: ``B`` batch, ``T`` window length, ``V`` vocabulary size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import random
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from attnlab.checkpoint import (
    CheckpointError,
    atomic_write_bytes,
    check_state_dict,
    load_checkpoint,
    save_checkpoint,
)
from attnlab.data import (
    TOKENIZERS,
    WindowDataset,
    WordTokenizer,
    checkpoint_tokenizer,
    get_tokenizer,
    load_text,
    split_text,
    tokenizer_to_dict,
)
from attnlab.distributed.training import (
    EXIT_INTERRUPTED,
    DistributedTrainingError,
    RankInfo,
    join_process_group,
    launch,
)
from attnlab.generation import generate
from attnlab.models.gpt import GPTConfig, GPTModel
from attnlab.optim import AdamW

__all__ = [
    "DEFAULT_OUT_DIR",
    "EXIT_INTERRUPTED",
    "CheckpointSaved",
    "DistributedTrainingError",
    "EvalResult",
    "StepResult",
    "TrainConfig",
    "TrainResult",
    "TrainStart",
    "Trainer",
    "calc_loss_batch",
    "launch",
    "lr_at",
    "plot_losses",
    "train",
]

DEFAULT_OUT_DIR = Path("runs/gpt")
HISTORY_FILE = "history.json"
LOSS_PNG = "loss_curve.png"


@dataclass(frozen=True)
class TrainConfig:
    """How to train.

    Args:
        preset: GPT preset name (ignored when ``model`` is given).
        model: an explicit model config instead of the preset.
        steps: optimizer steps; exclusive with ``epochs``. Default (both None): 200.
        epochs: passes over the training windows (``drop_last``); exclusive with ``steps``.
        batch_size: the global batch (split evenly over the ranks).
        lr: peak learning rate of AdamW; default 2e-3 for the tiny preset and small custom
            models (emb_dim <= 256), 4e-4 (the book's) for the GPT-2 sizes.
        min_lr_ratio: the cosine decay ends at ``lr * min_lr_ratio``.
        warmup_steps: linear warm-up steps; default 5% of the steps (at least 1).
        weight_decay: AdamW weight decay, applied to matrices and embeddings only.
        grad_clip: clip the global gradient norm to this (0 = off).
        eval_interval: evaluate (train/val loss, a sample) every this many steps.
        eval_batches: batches of each split used for an evaluation (None = all).
        save_interval: write a checkpoint every this many steps (0 = at evaluations only).
        seed: seeds model init, dropout and the batch order.
        train_ratio: fraction of the text (by characters) used for training.
        stride: window stride (default: the window length, i.e. no overlap).
        sample_prompt: prompt of the greedy sample generated at each evaluation.
        sample_tokens: tokens of that sample.
        backend: attention backend of the model.
        tokenizer: ``"gpt2"`` (GPT-2's BPE, 50,257 ids) or ``"words"`` (a
            :class:`attnlab.data.WordTokenizer` of the training text's words: a vocabulary of
            a few hundred ids for a text of few words, such as
            :func:`attnlab.data.repeated_random_text`), whose size becomes the model's
            ``vocab_size``. The checkpoint records the tokenizer, vocabulary included.
    """

    preset: str = "tiny"
    model: GPTConfig | None = None
    steps: int | None = None
    epochs: int | None = None
    batch_size: int = 8
    lr: float | None = None
    min_lr_ratio: float = 0.1
    warmup_steps: int | None = None
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_interval: int = 25
    eval_batches: int | None = 4
    save_interval: int = 0
    seed: int = 123
    train_ratio: float = 0.9
    stride: int | None = None
    sample_prompt: str = "Every effort moves you"
    sample_tokens: int = 20
    backend: str = "auto"
    tokenizer: str = "gpt2"

    def __post_init__(self) -> None:
        if self.steps is not None and self.epochs is not None:
            raise ValueError("give `steps` or `epochs`, not both")
        for name in ("steps", "epochs", "warmup_steps", "eval_batches", "stride"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"`{name}` must be an int >= 1 or None, got {v!r}")
        for name in ("batch_size", "eval_interval", "sample_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"`{name}` must be an int >= 1, got {v!r}")
        if self.save_interval < 0:
            raise ValueError(f"`save_interval` must be >= 0, got {self.save_interval}")
        if self.lr is not None and not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"`lr` must be a positive number, got {self.lr!r}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"`min_lr_ratio` must be in [0, 1], got {self.min_lr_ratio}")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError("`weight_decay` and `grad_clip` must be >= 0")
        if self.model is None:
            GPTConfig.preset(self.preset)  # raises for an unknown preset
        if self.tokenizer not in TOKENIZERS:
            raise ValueError(
                f"`tokenizer` must be one of {', '.join(TOKENIZERS)}, got {self.tokenizer!r}"
            )

    def model_config(self) -> GPTConfig:
        return self.model if self.model is not None else GPTConfig.preset(self.preset)

    def peak_lr(self) -> float:
        """``lr``, or its default for the model's size."""
        if self.lr is not None:
            return self.lr
        return 2e-3 if self.model_config().emb_dim <= 256 else 4e-4

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["model"] = None if self.model is None else self.model.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        d = dict(d)
        if d.get("model") is not None:
            d["model"] = GPTConfig.from_dict(d["model"])
        return cls(**d)


# ---------------------------------------------------------------------------- events


@dataclass(frozen=True)
class TrainStart:
    total_steps: int
    start_step: int
    tokens_per_step: int
    num_parameters: int
    world_size: int
    device: str
    train_windows: int
    val_windows: int


@dataclass(frozen=True)
class StepResult:
    step: int  # 1-based count of optimizer steps done
    total_steps: int
    loss: float  # mean over the global batch
    lr: float
    tokens_seen: int
    tokens_per_sec: float


@dataclass(frozen=True)
class EvalResult:
    step: int
    tokens_seen: int
    train_loss: float
    val_loss: float
    sample: str


@dataclass(frozen=True)
class CheckpointSaved:
    step: int
    path: Path
    reason: str  # "interval", "eval", "final", "interrupt"


@dataclass(frozen=True)
class TrainResult:
    """What a run did.

    Attributes:
        out_dir: the run's directory (checkpoint, history, loss curve).
        steps_done: optimizer steps done in total (including before a resume).
        total_steps: the planned steps.
        interrupted: stopped early by a signal (Ctrl-C / SIGTERM); a checkpoint was saved.
        step_losses: the loss of every step since step 1.
        evals: every evaluation since the start.
        loss_png: the loss-curve figure, or None on ranks other than 0 and when nothing was
            trained.
        start_step: the step this call started from: 0, or the checkpoint's step when resuming.
        history_json: the loss history (``history.json``), None when ``loss_png`` is.
    """

    out_dir: Path
    steps_done: int
    total_steps: int
    interrupted: bool
    step_losses: tuple[float, ...]
    evals: tuple[EvalResult, ...]
    loss_png: Path | None
    start_step: int = 0
    history_json: Path | None = None

    @property
    def trained(self) -> bool:
        """False when a resumed run was already at (or past) ``total_steps``: nothing was
        trained and nothing written."""
        return self.steps_done > self.start_step


Event = TrainStart | StepResult | EvalResult | CheckpointSaved


# ---------------------------------------------------------------------------- helpers


def lr_at(step: int, total: int, warmup: int, peak: float, min_lr: float) -> float:
    """Learning rate of 0-based ``step``: linear warm-up to ``peak``, cosine decay to ``min_lr``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (peak - min_lr) * (1.0 + math.cos(math.pi * progress))


def calc_loss_batch(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of a batch.

    Shape:
        inputs, targets ``(B, T)`` -> scalar.
    """
    logits = model(inputs)  # (B, T, V)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuple(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(x: Any) -> Any:
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def plot_losses(
    step_losses: list[float] | tuple[float, ...],
    evals: list[EvalResult] | tuple[EvalResult, ...],
    *,
    title: str = "",
):
    """Draw the loss curve: per-step training loss (thin), evaluated train/val loss (markers).

    Returns:
        A matplotlib Figure (not shown; save it with ``fig.savefig``).
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=110)
    ax = fig.add_subplot()
    if step_losses:
        ax.plot(
            range(1, len(step_losses) + 1),
            step_losses,
            lw=0.8,
            alpha=0.45,
            color="tab:blue",
            label="training loss (each step)",
        )
    if evals:
        steps = [e.step for e in evals]
        ax.plot(
            steps,
            [e.train_loss for e in evals],
            "o-",
            color="tab:blue",
            ms=3,
            label="training loss (eval)",
        )
        ax.plot(
            steps,
            [e.val_loss for e in evals],
            "s--",
            color="tab:orange",
            ms=3,
            label="validation loss (eval)",
        )
        if evals[-1].step > 0 and evals[-1].tokens_seen > 0:
            per_step = evals[-1].tokens_seen / evals[-1].step

            def to_tokens(step: Any) -> Any:
                return step * per_step

            def to_steps(tokens: Any) -> Any:
                return tokens / per_step

            top = ax.secondary_xaxis("top", functions=(to_tokens, to_steps))
            top.set_xlabel("tokens seen")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy loss (nats/token)")
    if title:
        ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------- the trainer


@dataclass
class _State:
    step: int = 0
    step_losses: list[float] = field(default_factory=list)
    evals: list[EvalResult] = field(default_factory=list)
    tokens_seen: int = 0


class Trainer:
    """Train a GPTModel on a text, with checkpoints, resume and optional DDP.

    Args:
        config: the :class:`TrainConfig` (ignored for the model and data settings when
            resuming: the checkpoint's are used, only ``steps``/``epochs`` may extend the run).
        out_dir: where checkpoints, ``history.json`` and ``loss_curve.png`` go. Default: the
            ``resume`` directory when resuming (the run continues where it was), else
            ``runs/gpt``. When resuming into another directory, that directory gets the
            continued run (its checkpoint, and the history and loss curve from step 0) and
            the ``resume`` directory is only read.
        text: the training text; None for the embedded story (or the checkpoint's text hash
            must match when resuming).
        resume: a checkpoint directory to continue from. If it is already at (or past) the
            requested steps, :meth:`run` trains nothing, writes nothing and returns a result
            whose ``trained`` is False.
        callback: called on rank 0 with each event (TrainStart, StepResult, EvalResult,
            CheckpointSaved). It may call :meth:`request_stop`.
        device: torch device; default CUDA (this rank's GPU) if available, else CPU.

    Raises:
        ValueError: for empty text, text shorter than one window, a bad config.
        CheckpointError: for a damaged or mismatched checkpoint to resume from.
    """

    def __init__(
        self,
        config: TrainConfig | None = None,
        *,
        out_dir: str | os.PathLike[str] | None = None,
        text: str | None = None,
        resume: str | os.PathLike[str] | None = None,
        callback: Callable[[Event], None] | None = None,
        device: str | torch.device | None = None,
    ) -> None:
        self.config = config or TrainConfig()
        self.resume = Path(resume) if resume is not None else None
        if out_dir is None:
            out_dir = self.resume if self.resume is not None else DEFAULT_OUT_DIR
        self.out_dir = Path(out_dir)
        self.callback = callback
        self._epoch_order: tuple[int, torch.Tensor] | None = None  # (epoch, permutation)
        self._stop_requested = False
        self.text = load_text(None) if text is None else text
        if not self.text.strip():
            raise ValueError("the training text is empty; give a file with some text in it")
        self._device_arg = device
        self._prepared = False
        self._dist = RankInfo()

    def request_stop(self) -> None:
        """Finish the current step, save a checkpoint and return (all ranks agree)."""
        self._stop_requested = True

    # ------------------------------------------------------------------ set-up

    def _build(self, dist_info: RankInfo) -> None:
        cfg = self.config
        ckpt = None
        if self.resume is not None:
            ckpt = load_checkpoint(self.resume, model_type="gpt")
            if ckpt.training_state is None:
                raise CheckpointError(
                    f"{self.resume} holds weights but no training state; it cannot be resumed"
                )
            saved = TrainConfig.from_dict(ckpt.extra["train_config"])
            # The run's shape comes from the checkpoint; only its length may change.
            length_from = saved if cfg.steps is None and cfg.epochs is None else cfg
            cfg = dataclasses.replace(saved, steps=length_from.steps, epochs=length_from.epochs)
            self.config = cfg
            text_sha = hashlib.sha256(self.text.encode("utf-8")).hexdigest()
            if ckpt.extra.get("text_sha256") not in (None, text_sha):
                raise ValueError(
                    f"the text differs from the one {self.resume} was trained on; "
                    "resume with the same --text"
                )
        # The tokenizer: the checkpoint's when resuming (its vocabulary is the weights'),
        # else GPT-2's or one built from the words of the text.
        if ckpt is not None:
            tok = checkpoint_tokenizer(ckpt)
        elif cfg.tokenizer == "words":
            tok = WordTokenizer.from_text(self.text)
        else:
            tok = get_tokenizer()
        self.tokenizer = tok
        if ckpt is not None:
            model_cfg = GPTConfig.from_dict(ckpt.model_config)
        elif isinstance(tok, WordTokenizer):
            model_cfg = dataclasses.replace(cfg.model_config(), vocab_size=tok.n_vocab)
        else:
            model_cfg = cfg.model_config()
        if self._device_arg is not None:
            device = torch.device(self._device_arg)
        elif torch.cuda.is_available():
            device = torch.device("cuda", dist_info.local_rank)
        else:
            device = torch.device("cpu")
        self.device = device
        self.model_cfg = model_cfg

        # Data: windows of the model's context length, train/val split by characters.
        train_text, val_text = split_text(self.text, cfg.train_ratio)
        T = model_cfg.context_length
        stride = cfg.stride or T
        need = T + 1
        n_train = len(tok.encode(train_text, allowed_special="all"))
        n_val = len(tok.encode(val_text, allowed_special="all"))
        if n_train < need or n_val < need:
            enough = int(need / min(cfg.train_ratio, 1 - cfg.train_ratio)) + 1
            raise ValueError(
                f"the text is too short for one window: its training part has {n_train} tokens "
                f"and its validation part {n_val}, each needs at least {need} (context length "
                f"{T} + 1); give a longer text (about {enough} tokens) or a model with a shorter "
                "context"
            )
        self.train_ds = WindowDataset.from_text(train_text, T, stride, tokenizer=tok)
        self.val_ds = WindowDataset.from_text(val_text, T, T, tokenizer=tok)
        if cfg.batch_size % dist_info.world_size:
            raise ValueError(
                f"`batch_size` ({cfg.batch_size}) must be divisible by the number of processes "
                f"({dist_info.world_size})"
            )
        self.batches_per_epoch = len(self.train_ds) // cfg.batch_size
        if self.batches_per_epoch < 1:
            raise ValueError(
                f"the text gives {len(self.train_ds)} training windows of {T} tokens, fewer than "
                f"one batch of {cfg.batch_size}; use a smaller --batch-size or a longer text"
            )
        if cfg.steps is not None:
            self.total_steps = cfg.steps
        elif cfg.epochs is not None:
            self.total_steps = cfg.epochs * self.batches_per_epoch
        else:
            self.total_steps = 200
        self.warmup = cfg.warmup_steps or max(1, self.total_steps // 20)

        # Model: seeded like the book, so the same seed gives the same initial weights.
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        model = GPTModel(model_cfg, backend=cfg.backend)
        if ckpt is not None:
            check_state_dict(model, ckpt.state_dict, source=str(self.resume))
            model.load_state_dict(ckpt.state_dict)
        self.model = model.to(device)

        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        # On CPU attnlab's AdamW: PyTorch's update bit for bit, without the 2 s import of
        # torch._dynamo that any torch.optim optimizer costs (attnlab.optim).
        self.optimizer: AdamW | torch.optim.AdamW = (
            torch.optim.AdamW(groups, lr=cfg.peak_lr(), betas=(0.9, 0.95), fused=True)
            if device.type == "cuda"
            else AdamW(groups, lr=cfg.peak_lr(), betas=(0.9, 0.95))
        )
        self.state = _State()
        if ckpt is not None:
            ts = ckpt.training_state
            assert ts is not None
            self.optimizer.load_state_dict(ts["optimizer"])
            self.state = _State(
                step=int(ts["step"]),
                step_losses=[float(x) for x in ts["step_losses"]],
                evals=[EvalResult(**e) for e in ts["evals"]],
                tokens_seen=int(ts["tokens_seen"]),
            )
            _set_rng_state(ts["rng"])
        self.ddp_model: nn.Module = self.model
        if dist_info.enabled:
            from torch.nn.parallel import DistributedDataParallel

            self.ddp_model = DistributedDataParallel(
                self.model, device_ids=[device.index] if device.type == "cuda" else None
            )

    # ------------------------------------------------------------------ pieces

    def _batch_indices(self, step: int, dist_info: RankInfo) -> torch.Tensor:
        """This rank's window indices for 0-based ``step`` (the data position is the step)."""
        cfg = self.config
        epoch, k = divmod(step, self.batches_per_epoch)
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            # One permutation an epoch, kept: windows at every offset of a long text are
            # millions, and a permutation of them each step would cost more than the step.
            order = torch.randperm(
                len(self.train_ds), generator=torch.Generator().manual_seed(cfg.seed + epoch)
            )
            self._epoch_order = (epoch, order)
        order = self._epoch_order[1]
        glob = order[k * cfg.batch_size : (k + 1) * cfg.batch_size]  # (B,)
        per = cfg.batch_size // dist_info.world_size
        return glob[dist_info.rank * per : (dist_info.rank + 1) * per]  # (B / world,)

    @torch.no_grad()
    def _eval_loss(self, ds: WindowDataset, dist_info: RankInfo) -> float:
        cfg = self.config
        batches = ds.epoch_order(cfg.batch_size, shuffle=False, seed=0, drop_last=False)
        if cfg.eval_batches is not None:
            batches = batches[: cfg.eval_batches]
        total = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss sum, windows
        for i, idx in enumerate(batches):
            if i % dist_info.world_size != dist_info.rank:
                continue
            x, y = ds.batch(idx)
            loss = calc_loss_batch(self.model, x.to(self.device), y.to(self.device))
            total += torch.tensor(
                [loss.item() * len(idx), len(idx)], device=self.device, dtype=torch.float64
            )
        if dist_info.enabled:
            self._all_reduce(total)
        return float(total[0] / total[1])

    def _all_reduce(self, t: torch.Tensor) -> None:
        import torch.distributed as dist

        try:
            dist.all_reduce(t)
        except (RuntimeError, dist.DistBackendError) as exc:
            raise DistributedTrainingError(
                f"rank {self._dist.rank}: another process stopped during training ({exc}); "
                "stopping too — see the failing rank's error above"
            ) from exc

    def _sample(self) -> str:
        tok = self.tokenizer
        ids = tok.encode(self.config.sample_prompt, allowed_special="all")
        ids = ids[-self.model_cfg.context_length :] or [0]
        idx = torch.tensor([ids], device=self.device)
        out = generate(self.model, idx, self.config.sample_tokens, temperature=0.0)
        return tok.decode(out[0].tolist())

    def _evaluate(self, dist_info: RankInfo) -> EvalResult:
        self.model.eval()
        train_loss = self._eval_loss(self.train_ds, dist_info)
        val_loss = self._eval_loss(self.val_ds, dist_info)
        sample = self._sample() if dist_info.is_main else ""
        self.model.train()
        return EvalResult(self.state.step, self.state.tokens_seen, train_loss, val_loss, sample)

    def _save(self, reason: str, dist_info: RankInfo) -> None:
        if not dist_info.is_main:
            return
        st = self.state
        training_state = {
            "optimizer": self.optimizer.state_dict(),
            "rng": _rng_state(),
            "step": st.step,
            "data_position": {
                "epoch": st.step // self.batches_per_epoch,
                "batch": st.step % self.batches_per_epoch,
            },
            "tokens_seen": st.tokens_seen,
            "step_losses": list(st.step_losses),
            "evals": [dataclasses.asdict(e) for e in st.evals],
        }
        path = save_checkpoint(
            self.out_dir,
            self.model.state_dict(),
            model_type="gpt",
            model_config=self.model_cfg.to_dict(),
            step=st.step,
            training_state=training_state,
            extra={
                "train_config": self.config.to_dict(),
                "text_sha256": hashlib.sha256(self.text.encode("utf-8")).hexdigest(),
                "total_steps": self.total_steps,
                "tokenizer": tokenizer_to_dict(self.tokenizer),
            },
        )
        self._write_history()
        self._emit(CheckpointSaved(st.step, path.parent, reason))

    def _write_history(self) -> None:
        st = self.state
        history = {
            "step_losses": st.step_losses,
            "evals": [dataclasses.asdict(e) for e in st.evals],
            "total_steps": self.total_steps,
            "model_config": self.model_cfg.to_dict(),
        }
        atomic_write_bytes(self.out_dir / HISTORY_FILE, json.dumps(history, indent=1).encode())
        fig = plot_losses(
            st.step_losses,
            st.evals,
            title=f"GPT {self._model_label()} on {len(self.train_ds)} windows of "
            f"{self.model_cfg.context_length} tokens",
        )
        tmp = self.out_dir / f".{LOSS_PNG}.tmp-{os.getpid()}.png"
        fig.savefig(tmp)
        os.replace(tmp, self.out_dir / LOSS_PNG)

    def _model_label(self) -> str:
        c = self.model_cfg
        n = sum(p.numel() for p in self.model.parameters())
        return f"({c.n_layers} layers, {c.emb_dim} wide, {n / 1e6:.1f}M params)"

    def _emit(self, event: Event) -> None:
        if self.callback is not None and self._dist.is_main:
            self.callback(event)

    # ------------------------------------------------------------------ the loop

    def prepare(self) -> None:
        """Join the process group (under torchrun), load the data, build or restore the model.

        Called by :meth:`run` when needed; call it first to get input errors (text too short,
        bad checkpoint) before training starts.

        Raises:
            ValueError: for a text shorter than one window or a bad batch size.
            CheckpointError: for a damaged or mismatched checkpoint.
        """
        if self._prepared:
            return
        dist_info = join_process_group()
        self._dist = dist_info
        try:
            self._build(dist_info)
        except BaseException:
            self._teardown()
            raise
        self._prepared = True

    def _teardown(self) -> None:
        if self._dist.initialized_here:
            import torch.distributed as dist

            with contextlib.suppress(Exception):
                dist.destroy_process_group()
            self._dist.initialized_here = False

    def run(self) -> TrainResult:
        """Train until ``total_steps`` or a stop request; return what happened."""
        self.prepare()
        try:
            return self._run(self._dist)
        finally:
            self._teardown()

    def _run(self, dist_info: RankInfo) -> TrainResult:
        cfg = self.config
        start_step = self.state.step
        if start_step >= self.total_steps:
            # Resumed at or past the requested length: no step to take, so nothing is written
            # (not even the output directory).
            return TrainResult(
                out_dir=self.out_dir,
                steps_done=start_step,
                total_steps=self.total_steps,
                interrupted=False,
                step_losses=tuple(self.state.step_losses),
                evals=tuple(self.state.evals),
                loss_png=None,
                start_step=start_step,
            )
        if dist_info.is_main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        tokens_per_step = cfg.batch_size * self.model_cfg.context_length
        self._emit(
            TrainStart(
                total_steps=self.total_steps,
                start_step=self.state.step,
                tokens_per_step=tokens_per_step,
                num_parameters=sum(p.numel() for p in self.model.parameters()),
                world_size=dist_info.world_size,
                device=str(self.device),
                train_windows=len(self.train_ds),
                val_windows=len(self.val_ds),
            )
        )
        if self.state.step == 0 and not self.state.evals:
            ev = self._evaluate(dist_info)
            self.state.evals.append(ev)
            self._emit(ev)
        self.model.train()
        interrupted = False
        while self.state.step < self.total_steps:
            t0 = time.perf_counter()
            step = self.state.step
            peak = cfg.peak_lr()
            lr = lr_at(step, self.total_steps, self.warmup, peak, peak * cfg.min_lr_ratio)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            idx = self._batch_indices(step, dist_info)
            x, y = self.train_ds.batch(idx)
            x, y = x.to(self.device), y.to(self.device)
            self.optimizer.zero_grad(set_to_none=True)
            loss = self._forward_loss(x, y)
            loss.backward()
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
            self.optimizer.step()
            # One collective per step: the global mean loss and whether any rank must stop.
            stats = torch.tensor(
                [loss.detach().item(), 1.0 if self._stop_requested else 0.0],
                dtype=torch.float64,
                device=self.device,
            )
            if dist_info.enabled:
                self._all_reduce(stats)
                stats[0] /= dist_info.world_size
            stop = bool(stats[1] > 0)
            self.state.step += 1
            self.state.tokens_seen += tokens_per_step
            self.state.step_losses.append(float(stats[0]))
            dt = max(time.perf_counter() - t0, 1e-9)
            self._emit(
                StepResult(
                    step=self.state.step,
                    total_steps=self.total_steps,
                    loss=float(stats[0]),
                    lr=lr,
                    tokens_seen=self.state.tokens_seen,
                    tokens_per_sec=tokens_per_step / dt,
                )
            )
            if not dist_info.enabled:
                stop = self._stop_requested  # includes a request made by the callback just now
            last = self.state.step == self.total_steps
            evaluate = self.state.step % cfg.eval_interval == 0 or last
            if evaluate:
                ev = self._evaluate(dist_info)
                self.state.evals.append(ev)
                self._emit(ev)
            if stop and not last:
                interrupted = True
                self._save("interrupt", dist_info)
                break
            if evaluate:
                self._save("final" if last else "eval", dist_info)
            elif cfg.save_interval and self.state.step % cfg.save_interval == 0:
                self._save("interval", dist_info)
        if dist_info.enabled:
            import torch.distributed as dist

            dist.barrier()
        return TrainResult(
            out_dir=self.out_dir,
            steps_done=self.state.step,
            total_steps=self.total_steps,
            interrupted=interrupted,
            step_losses=tuple(self.state.step_losses),
            evals=tuple(self.state.evals),
            loss_png=self.out_dir / LOSS_PNG if dist_info.is_main else None,
            start_step=start_step,
            history_json=self.out_dir / HISTORY_FILE if dist_info.is_main else None,
        )

    def _forward_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return calc_loss_batch(self.ddp_model, x, y)


@contextlib.contextmanager
def stop_on_signals(trainer: Trainer) -> Iterator[None]:
    """While active, the first SIGINT/SIGTERM asks ``trainer`` to stop after the current step
    (it then saves a checkpoint); a second one interrupts at once.

    Under torch's elastic launcher (``attnlab train --nproc``, ``torchrun``) a Ctrl-C reaches
    each worker twice, from the terminal and forwarded by the launcher, so there a repeated
    signal only repeats the request; the launcher kills workers that have not stopped 30 s
    after it.
    """
    previous: dict[signal.Signals, Any] = {}
    under_launcher = "TORCHELASTIC_RUN_ID" in os.environ

    def handler(signum: int, frame: Any) -> None:
        if trainer._stop_requested and not under_launcher:
            raise KeyboardInterrupt
        trainer.request_stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(ValueError):  # ValueError: not the main thread
            previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, prev in previous.items():
            signal.signal(sig, prev)


def train(
    config: TrainConfig | None = None,
    *,
    out_dir: str | os.PathLike[str] | None = None,
    text: str | None = None,
    resume: str | os.PathLike[str] | None = None,
    callback: Callable[[Event], None] | None = None,
    device: str | torch.device | None = None,
    handle_signals: bool = False,
) -> TrainResult:
    """Train a GPT (see :class:`Trainer` for the arguments).

    Args:
        handle_signals: catch Ctrl-C/SIGTERM: finish the step, save, return with
            ``interrupted=True``.
    """
    trainer = Trainer(
        config, out_dir=out_dir, text=text, resume=resume, callback=callback, device=device
    )
    if handle_signals:
        with stop_on_signals(trainer):
            return trainer.run()
    return trainer.run()
