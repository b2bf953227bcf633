"""A GPT-2 style language model built on attnlab's attention layer (the book's chapter 4).

The layout, names and parameter-creation order are the book's: token and position
embeddings, embedding dropout, ``n_layers`` pre-LayerNorm transformer blocks (attention
``W_query``/``W_key``/``W_value``/``out_proj``, then the feed-forward network), a final
LayerNorm and an output head without bias. Creating parameters in that order means that
``torch.manual_seed(123); GPTModel(GPTConfig.preset("gpt2-124m"))`` draws the same initial
weights as the book. Attention runs through :class:`attnlab.attention.Attention`, so the
backend choice (``math``, ``blockwise``, ``sdpa``, ``auto``; ``ring`` for context
parallelism across ranks) and the KV cache come from there.

Shape legend: ``B`` batch, ``T`` new tokens, ``S`` tokens seen so far (cache + new),
``C`` embedding width (``emb_dim``), ``V`` vocabulary size.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from attnlab._meta import structure_only
from attnlab.attention import Attention, KVCache
from attnlab.backends import available_backends
from attnlab.checkpoint import Checkpoint, CheckpointError, check_state_dict, load_checkpoint
from attnlab.generation import generate, generate_stream
from attnlab.models._lm import (
    block_input,
    first_block,
    keep_last,
    mlp_output,
    residual_after_block,
)
from attnlab.models.fast_decode import (
    DecodePlan,
    FastDecoding,
    decode_plan,
    fast_step,
    new_caches,
)

__all__ = [
    "PRESETS",
    "FeedForward",
    "GPTConfig",
    "GPTModel",
    "LayerNorm",
    "ParameterReport",
    "TransformerBlock",
    "analytic_parameter_count",
    "generate",
    "generate_stream",
    "parameter_report",
]


@dataclass(frozen=True)
class GPTConfig:
    """The book's GPT configuration, validated on construction.

    Args:
        vocab_size: tokens in the vocabulary (50257 for GPT-2's BPE).
        context_length: the longest sequence the position embedding covers.
        emb_dim: model width ``C``; must be divisible by ``n_heads``.
        n_heads: attention heads per block.
        n_layers: transformer blocks.
        drop_rate: dropout probability on embeddings, attention weights and shortcut paths.
        qkv_bias: whether the query/key/value projections have a bias.

    Raises:
        ValueError: if a field is out of range or ``emb_dim % n_heads != 0``.
    """

    vocab_size: int = 50257
    context_length: int = 1024
    emb_dim: int = 768
    n_heads: int = 12
    n_layers: int = 12
    drop_rate: float = 0.1
    qkv_bias: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_length", "emb_dim", "n_heads", "n_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig `{name}` must be an int >= 1, got {value!r}")
        if self.emb_dim % self.n_heads:
            raise ValueError(
                f"GPTConfig `emb_dim` ({self.emb_dim}) must be divisible by `n_heads` "
                f"({self.n_heads}); pick n_heads among the divisors of emb_dim"
            )
        if isinstance(self.drop_rate, bool) or not isinstance(self.drop_rate, (int, float)):
            raise ValueError(f"GPTConfig `drop_rate` must be a float, got {self.drop_rate!r}")
        if not 0.0 <= self.drop_rate < 1.0:
            raise ValueError(f"GPTConfig `drop_rate` must be in [0, 1), got {self.drop_rate}")
        if not isinstance(self.qkv_bias, bool):
            raise ValueError(f"GPTConfig `qkv_bias` must be a bool, got {self.qkv_bias!r}")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> GPTConfig:
        """A named configuration, optionally with some fields replaced.

        Args:
            name: one of ``PRESETS`` ("gpt2-124m", "gpt2-medium", "gpt2-large", "gpt2-xl",
                "tiny").
            **overrides: fields to change, e.g. ``context_length=256``.

        Raises:
            ValueError: for an unknown preset name or an invalid override.
        """
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
        base = PRESETS[name]
        bad = sorted(set(overrides) - {f.name for f in dataclasses.fields(cls)})
        if bad:
            raise ValueError(f"unknown GPTConfig field(s) {bad}; valid: {cls.field_names()}")
        return dataclasses.replace(base, **overrides)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GPTConfig:
        """Build a config from ``to_dict()`` output; unknown or missing keys are an error."""
        names = set(cls.field_names())
        extra, missing = sorted(set(data) - names), sorted(names - set(data))
        if extra or missing:
            raise ValueError(
                f"GPT config has unknown keys {extra} and lacks keys {missing}; "
                f"expected exactly {sorted(names)}"
            )
        return cls(**data)


PRESETS: dict[str, GPTConfig] = {
    # The book's GPT_CONFIG_124M and the larger GPT-2 sizes of its exercise 4.2.
    "gpt2-124m": GPTConfig(50257, 1024, 768, 12, 12, 0.1, False),
    "gpt2-medium": GPTConfig(50257, 1024, 1024, 16, 24, 0.1, False),
    "gpt2-large": GPTConfig(50257, 1024, 1280, 20, 36, 0.1, False),
    "gpt2-xl": GPTConfig(50257, 1024, 1600, 25, 48, 0.1, False),
    # Small enough to train on "The Verdict" in a few minutes on 2 CPU cores.
    "tiny": GPTConfig(50257, 64, 128, 4, 4, 0.1, False),
}


class LayerNorm(nn.Module):
    """Layer normalisation with the book's parameter names (``scale``, ``shift``), eps 1e-5.

    Shape:
        ``(..., C)`` -> ``(..., C)``.
    """

    def __init__(self, emb_dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(emb_dim))
        self.shift = nn.Parameter(torch.zeros(emb_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same as the book's (x - mean) / sqrt(biased var + eps) * scale + shift, fused.
        return F.layer_norm(x, (x.size(-1),), self.scale, self.shift, self.eps)


class FeedForward(nn.Module):
    """``Linear(C, 4C)`` -> GELU (tanh approximation, as GPT-2) -> ``Linear(4C, C)``.

    Shape:
        ``(B, T, C)`` -> ``(B, T, C)``.
    """

    def __init__(self, emb_dim: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(emb_dim, 4 * emb_dim),
            nn.GELU(approximate="tanh"),
            nn.Linear(4 * emb_dim, emb_dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class TransformerBlock(nn.Module):
    """Pre-LayerNorm block: ``x + drop(att(norm1(x)))``, then ``x + drop(ff(norm2(x)))``.

    Shape:
        ``(B, T, C)`` -> ``(B, T, C)``.
    """

    def __init__(self, cfg: GPTConfig, *, backend: str = "auto") -> None:
        super().__init__()
        # Attention first (W_query, W_key, W_value, out_proj), then the feed-forward network:
        # the book's order of parameter creation.
        self.att = Attention(
            cfg.emb_dim,
            cfg.n_heads,
            bias=cfg.qkv_bias,
            out_bias=True,
            dropout=cfg.drop_rate,
            backend=backend,
        )
        self.ff = FeedForward(cfg.emb_dim)
        self.norm1 = LayerNorm(cfg.emb_dim)
        self.norm2 = LayerNorm(cfg.emb_dim)
        self.drop_shortcut = nn.Dropout(cfg.drop_rate)

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        shortcut = x
        x = self.att(self.norm1(x), is_causal=True, kv_cache=kv_cache)  # (B, T, C)
        x = self.drop_shortcut(x) + shortcut
        shortcut = x
        x = mlp_output(self, self.ff(self.norm2(x)))  # (B, T, C)
        return self.drop_shortcut(x) + shortcut


class GPTModel(nn.Module, FastDecoding):
    """The book's GPT model, following attnlab's causal language model protocol.

    Args:
        cfg: the configuration (see :class:`GPTConfig` and ``GPTConfig.preset``).
        backend: attention backend for every block ("auto", "math", "blockwise", "sdpa", or
            "ring" for context parallelism: inside ``attnlab.distributed.context_parallel``,
            each rank passes its shard of the sequence and its ``position_ids``).

    Raises:
        TypeError: if ``cfg`` is not a GPTConfig.
        ValueError: for an unknown backend.
    """

    def __init__(self, cfg: GPTConfig, *, backend: str = "auto") -> None:
        super().__init__()
        if not isinstance(cfg, GPTConfig):
            raise TypeError(
                f"`cfg` must be a GPTConfig, got {type(cfg).__name__}; "
                "fix: GPTConfig.preset('gpt2-124m') or GPTConfig(**fields)"
            )
        if backend not in available_backends():
            raise ValueError(f"`backend` must be one of {available_backends()}, got {backend!r}")
        self.cfg = cfg
        self.backend = backend
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.emb_dim)
        self.pos_emb = nn.Embedding(cfg.context_length, cfg.emb_dim)
        self.drop_emb = nn.Dropout(cfg.drop_rate)
        self.trf_blocks = nn.ModuleList(
            TransformerBlock(cfg, backend=backend) for _ in range(cfg.n_layers)
        )
        self.final_norm = LayerNorm(cfg.emb_dim)
        self.out_head = nn.Linear(cfg.emb_dim, cfg.vocab_size, bias=False)

    @classmethod
    def from_checkpoint(
        cls,
        directory: str | os.PathLike[str] | Checkpoint,
        *,
        backend: str = "auto",
        map_location: str | torch.device = "cpu",
    ) -> GPTModel:
        """Load a model saved by ``attnlab train`` (or :func:`attnlab.checkpoint.save_checkpoint`).

        Every GPT checkpoint attnlab loads goes through here, so its config is checked
        against its weights (:func:`attnlab.checkpoint.check_state_dict`) before they load.

        Args:
            directory: the checkpoint directory, or a :class:`attnlab.checkpoint.Checkpoint`
                already read by :func:`attnlab.checkpoint.load_checkpoint` (when its step or
                extra facts are needed too).
            backend: attention backend for every block.
            map_location: device for the weights.

        Raises:
            CheckpointError: if the checkpoint is missing, damaged, not a GPT, or its config
                does not match its weights.
        """
        if isinstance(directory, Checkpoint):
            ckpt = directory
            if ckpt.model_type != "gpt":
                raise CheckpointError(
                    f"{ckpt.directory} holds a {ckpt.model_type!r} model, expected 'gpt'"
                )
        else:
            ckpt = load_checkpoint(
                directory, model_type="gpt", with_training_state=False, map_location=map_location
            )
        try:
            cfg = GPTConfig.from_dict(ckpt.model_config)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(
                f"the model config in {ckpt.directory} is invalid: {exc}"
            ) from exc
        model = cls(cfg, backend=backend)
        check_state_dict(model, ckpt.state_dict, source=str(ckpt.directory))
        model.load_state_dict(ckpt.state_dict)
        return model.to(map_location)

    @property
    def context_length(self) -> int:
        return self.cfg.context_length

    def new_kv_cache(self, max_len: int | None = None) -> list[KVCache]:
        """An empty KV cache, one per transformer block: growing :class:`KVCache` s, or
        with ``max_len`` :class:`attnlab.attention.StaticKVCache` s allocated once, over
        which one new token takes the fast decode step (:mod:`attnlab.models.fast_decode`),
        holding :attr:`kv_cache_dtype`."""
        return new_caches(len(self.trf_blocks), max_len, dtype=self.kv_cache_dtype)

    def prepare_decode(self, *, share_float: bool | None = None) -> DecodePlan:
        """Build (once) the fast one-token step (see ``Decoder.prepare_decode``)."""
        return decode_plan(self, share_float=share_float)

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        kv_cache: list[KVCache] | None = None,
        position_ids: torch.Tensor | None = None,
        logits_to_keep: int | None = None,
    ) -> torch.Tensor:
        """Next-token logits for every position (or the last ``logits_to_keep``).

        Args:
            input_ids: token ids.
            kv_cache: from :meth:`new_kv_cache`; the new tokens' keys and values are appended
                and their positions continue after the ones the cache holds.
            position_ids: the tokens' positions in the full sequence, ``(T,)`` or ``(B, T)``
                integers (default: ``past + arange(T)``). Context parallelism passes each
                rank's global positions (``attnlab.distributed.shard_positions``), so a
                shard's learned position embeddings are those of the whole sequence.
            logits_to_keep: compute logits for the last this many positions only (generation
                needs one: it skips the output head over the rest of the prompt).

        Returns:
            Logits over the vocabulary.

        Raises:
            TypeError: if ``input_ids`` is not a 2-D integer tensor.
            ValueError: if the sequence would exceed ``context_length``, the cache has the
                wrong number of layers, or ``position_ids`` has the wrong shape or a position
                outside ``[0, context_length)``.

        Shape:
            input_ids ``(B, T)``, position_ids ``(T,)`` or ``(B, T)`` -> logits ``(B, T, V)``.
        """
        if (
            not isinstance(input_ids, torch.Tensor)
            or input_ids.dim() != 2
            or input_ids.dtype not in (torch.long, torch.int32, torch.int64)
        ):
            got = (
                f"{tuple(input_ids.shape)} {input_ids.dtype}"
                if isinstance(input_ids, torch.Tensor)
                else type(input_ids).__name__
            )
            raise TypeError(f"`input_ids` must be a (B, T) integer tensor, got {got}")
        past = 0
        if kv_cache is not None:
            if len(kv_cache) != len(self.trf_blocks):
                raise ValueError(
                    f"`kv_cache` must hold one KVCache per block ({len(self.trf_blocks)}), "
                    f"got {len(kv_cache)}; fix: use model.new_kv_cache()"
                )
            past = kv_cache[0].seq_len
        T = input_ids.size(1)
        if position_ids is None and past + T <= self.cfg.context_length:
            logits = fast_step(self, input_ids, kv_cache)
            if logits is not None:  # one new token over a static cache: the fused step
                return logits
        if position_ids is not None:
            positions = self._check_positions(position_ids, input_ids)  # (T,) or (B, T)
        elif past + T > self.cfg.context_length:
            raise ValueError(
                f"sequence of {past + T} tokens ({past} cached + {T} new) exceeds the "
                f"context length {self.cfg.context_length}; crop the input to the last "
                f"{self.cfg.context_length} tokens"
            )
        else:
            positions = torch.arange(past, past + T, device=input_ids.device)  # (T,)
        x = self.tok_emb(input_ids) + self.pos_emb(positions)  # (B, T, C)
        x = self.drop_emb(x)
        start = first_block()
        for i, block in enumerate(self.trf_blocks):
            if i < start:  # an experiment resumes from a stream it cached (edit_block_input)
                continue
            x = block_input(i, x)
            x = block(x, None if kv_cache is None else kv_cache[i])  # (B, T, C)
            residual_after_block(i, x)
        x = keep_last(x, logits_to_keep)  # (B, T or logits_to_keep, C)
        return self.readout(x)  # (B, T, V)

    def readout(self, x: torch.Tensor) -> torch.Tensor:
        """Logits from a residual stream: the final LayerNorm, then the output head.

        Shape:
            x ``(..., C)`` -> ``(..., V)``.
        """
        return self.out_head(self.final_norm(x))  # (..., V)

    def _check_positions(self, position_ids: object, input_ids: torch.Tensor) -> torch.Tensor:
        B, T = input_ids.shape
        if (
            not isinstance(position_ids, torch.Tensor)
            or position_ids.dtype not in (torch.long, torch.int32)
            or tuple(position_ids.shape) not in ((T,), (B, T))
        ):
            got = (
                f"{tuple(position_ids.shape)} {position_ids.dtype}"
                if isinstance(position_ids, torch.Tensor)
                else type(position_ids).__name__
            )
            raise ValueError(
                f"`position_ids` must be an integer tensor of shape ({T},) or ({B}, {T}) like "
                f"`input_ids`, got {got}"
            )
        if position_ids.numel() and (
            int(position_ids.min()) < 0 or int(position_ids.max()) >= self.cfg.context_length
        ):
            raise ValueError(
                f"`position_ids` must lie in [0, {self.cfg.context_length}) (the context "
                f"length), got [{int(position_ids.min())}, {int(position_ids.max())}]"
            )
        return position_ids.to(input_ids.device)

    def num_parameters(self, *, exclude_tied_head: bool = False) -> int:
        """Total parameters; ``exclude_tied_head`` leaves out the output head, as GPT-2
        counts when the head reuses the token embedding (weight tying)."""
        total = sum(p.numel() for p in self.parameters())
        return total - self.out_head.weight.numel() if exclude_tied_head else total


@dataclass(frozen=True)
class ParameterReport:
    """Parameter counts of a GPT configuration, as the book reports them.

    Attributes:
        config: the configuration counted.
        per_module: ``(name, count)`` for the embeddings, one transformer block's attention,
            feed-forward and norms, all blocks, the final norm and the output head.
        total: all parameters (163,009,536 for gpt2-124m).
        total_tied: total minus the output head, as GPT-2 counts with weight tying.
        size_mb: memory of all parameters in MB (MiB) at ``bytes_per_param`` bytes each.
        bytes_per_param: 4 for float32.
    """

    config: GPTConfig
    per_module: tuple[tuple[str, int], ...]
    total: int
    total_tied: int
    size_mb: float
    bytes_per_param: int = 4


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def parameter_report(cfg: GPTConfig | str, *, bytes_per_param: int = 4) -> ParameterReport:
    """Count a configuration's parameters without allocating its weights (meta device).

    Args:
        cfg: a GPTConfig or a preset name.
        bytes_per_param: bytes per parameter for the size (4 = float32, 2 = bf16).

    Returns:
        The :class:`ParameterReport`.
    """
    if isinstance(cfg, str):
        cfg = GPTConfig.preset(cfg)
    with structure_only():
        model = GPTModel(cfg)
    block = model.trf_blocks[0]
    assert isinstance(block, TransformerBlock)
    per_module = (
        ("tok_emb", _count(model.tok_emb)),
        ("pos_emb", _count(model.pos_emb)),
        ("block.att (each)", _count(block.att)),
        ("block.ff (each)", _count(block.ff)),
        ("block.norm1+norm2 (each)", _count(block.norm1) + _count(block.norm2)),
        (f"trf_blocks (x{cfg.n_layers})", _count(model.trf_blocks)),
        ("final_norm", _count(model.final_norm)),
        ("out_head", _count(model.out_head)),
    )
    total = _count(model)
    return ParameterReport(
        config=cfg,
        per_module=per_module,
        total=total,
        total_tied=total - model.out_head.weight.numel(),
        size_mb=total * bytes_per_param / (1024 * 1024),
        bytes_per_param=bytes_per_param,
    )


def analytic_parameter_count(cfg: GPTConfig) -> int:
    """The parameter count from the formula (a cross-check of :func:`parameter_report`)."""
    C, V, L = cfg.emb_dim, cfg.vocab_size, cfg.n_layers
    att = 3 * C * C + (3 * C if cfg.qkv_bias else 0) + C * C + C
    ff = C * 4 * C + 4 * C + 4 * C * C + C
    norms = 2 * 2 * C
    return V * C + cfg.context_length * C + L * (att + ff + norms) + 2 * C + C * V
