"""Rotary position embedding (RoPE) and its variants, as today's open models use them.

One :class:`RotaryEmbedding` serves every variant; what varies is data in a frozen
:class:`RopeConfig`:

- ``fraction``: partial rotary. Only the first ``int(fraction * D)`` dims of each head
  rotate, the rest pass through (GPT-NeoX, Phi-2, GPT-J).
- ``interleaved``: which dims form a rotating pair. False: ``(i, i + R/2)``, "rotate half"
  (Llama, GPT-NeoX, Hugging Face's default). True: ``(2i, 2i + 1)`` (GPT-J, the RoPE paper,
  Meta's original Llama code).
- ``scaling``: how the frequencies stretch for contexts longer than training:
  :class:`LinearScaling`, :class:`DynamicNTKScaling`, :class:`Llama3Scaling`,
  :class:`YarnScaling`, :class:`LongRopeScaling` (one class per kind, each with the fields
  of Hugging Face's ``rope_scaling`` / ``rope_parameters`` dict and the same formulas as
  ``transformers.modeling_rope_utils``), or :class:`FrequencyFactors` (one divisor per
  frequency, as llama.cpp stores Llama 3 scaling in GGUF files).

:meth:`RopeConfig.from_hf_config` and :meth:`RotaryEmbedding.from_hf_config` read a Hugging
Face ``config.json`` dict (old ``rope_scaling`` and new ``rope_parameters`` forms).

Shape legend: B batch, H heads, T positions, D head dim, R rotated dims (``R <= D``, even).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch
from torch import nn

__all__ = [
    "DynamicNTKScaling",
    "FrequencyFactors",
    "LinearScaling",
    "Llama3Scaling",
    "LongRopeScaling",
    "RopeConfig",
    "RopeScaling",
    "RotaryEmbedding",
    "YarnScaling",
    "rotate_half",
    "rotate_pairs",
    "yarn_mscale",
]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` on the last dim (the "rotate half" RoPE convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """``[x0, x1, x2, x3, ...] -> [-x1, x0, -x3, x2, ...]`` (the interleaved convention, GPT-J)."""
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def _positive(name: str, value: Any, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"`{name}` must be a positive number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"`{name}` must be finite, got {value!r}")


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    """``base^(-2i/R)`` for i < R/2, float64 (R = ``dim``, the rotated dims).

    The inverse frequencies are always computed on the CPU: a model built under
    ``torch.device("meta")`` (a loader counting a config's parameters) then needs no meta
    kernels for float math, whose first use imports ``torch._dynamo`` (seconds).
    """
    return 1.0 / base ** (
        torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim
    )  # (R/2,)


@dataclass(frozen=True)
class LinearScaling:
    """Position interpolation: every frequency divided by ``factor`` (``rope_type="linear"``).

    Args:
        factor: how much longer than training the context may be, > 0.
    """

    factor: float
    kind: ClassVar[str] = "linear"

    def __post_init__(self) -> None:
        _positive("factor", self.factor)

    def frequencies(
        self, base: float, dim: int, seq_len: int | None = None
    ) -> tuple[torch.Tensor, float]:
        """Inverse frequencies ``(R/2,)`` float64 and the attention factor (1 here)."""
        return _default_inv_freq(base, dim) / self.factor, 1.0


@dataclass(frozen=True)
class DynamicNTKScaling:
    """Dynamic NTK scaling (``rope_type="dynamic"``): past ``max_position_embeddings`` the base
    grows with the sequence length, ``base * (factor * L / max_pos - (factor - 1))^(R/(R-2))``.

    The frequencies depend on the longest position seen, exactly as transformers'
    ``dynamic_rope_update``: they are recomputed when a call reaches past the longest length
    so far and reset when a call stays inside the original context (see
    :meth:`RotaryEmbedding.forward`).

    Args:
        factor: the scaling factor, > 0.
        max_position_embeddings: the context length the model was trained with.
    """

    factor: float
    max_position_embeddings: int
    kind: ClassVar[str] = "dynamic"

    def __post_init__(self) -> None:
        _positive("factor", self.factor)
        _positive("max_position_embeddings", self.max_position_embeddings)

    def frequencies(
        self, base: float, dim: int, seq_len: int | None = None
    ) -> tuple[torch.Tensor, float]:
        """Inverse frequencies for sequences of length ``seq_len`` (default: the original)."""
        n = self.max_position_embeddings if seq_len is None else max(seq_len, 0)
        n = max(n, self.max_position_embeddings)
        grown = base * ((self.factor * n / self.max_position_embeddings) - (self.factor - 1)) ** (
            dim / (dim - 2)
        )
        return _default_inv_freq(grown, dim), 1.0


@dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3.1's frequency-dependent scaling (``rope_type="llama3"``).

    Wavelengths shorter than ``original_max_position_embeddings / high_freq_factor`` are
    kept, those longer than ``original_max_position_embeddings / low_freq_factor`` are
    divided by ``factor``, and the band between is interpolated smoothly.

    Args:
        factor: 8 in Llama 3.1.
        low_freq_factor: 1 in Llama 3.1.
        high_freq_factor: 4 in Llama 3.1; must exceed ``low_freq_factor``.
        original_max_position_embeddings: 8192 in Llama 3.1.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    kind: ClassVar[str] = "llama3"

    def __post_init__(self) -> None:
        for f in fields(self):
            _positive(f.name, getattr(self, f.name))
        if not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"`high_freq_factor` ({self.high_freq_factor}) must be larger than "
                f"`low_freq_factor` ({self.low_freq_factor})"
            )

    def frequencies(
        self, base: float, dim: int, seq_len: int | None = None
    ) -> tuple[torch.Tensor, float]:
        """Inverse frequencies ``(R/2,)`` float64 and the attention factor (1 here)."""
        inv = _default_inv_freq(base, dim)
        old = self.original_max_position_embeddings
        low_wavelen, high_wavelen = old / self.low_freq_factor, old / self.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / self.factor, inv)
        smooth = (old / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0


def yarn_mscale(factor: float, m: float = 1.0) -> float:
    """YaRN's attention factor for a context extension ``factor``: ``0.1 * m * ln(factor) + 1``
    (1 when ``factor`` <= 1); ``m`` is DeepSeek's ``mscale`` / ``mscale_all_dim`` (1 in the
    paper). cos and sin are multiplied by it, so the scores by its square."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


@dataclass(frozen=True)
class YarnScaling:
    """YaRN (``rope_type="yarn"``): high frequencies kept, low ones interpolated by ``factor``,
    a linear ramp between (set by ``beta_fast`` / ``beta_slow`` rotations), and an attention
    factor that multiplies cos and sin (so the scores by its square).

    Args:
        factor: the context extension factor, > 0.
        original_max_position_embeddings: the context length the model was trained with.
        beta_fast: rotations where the ramp starts (32 in the paper).
        beta_slow: rotations where it ends (1 in the paper).
        attention_factor: explicit attention factor; None derives it from ``factor``:
            ``0.1 * ln(factor) + 1`` (or DeepSeek's ratio of ``mscale`` / ``mscale_all_dim``
            forms when both are given).
        mscale: DeepSeek's attention-factor parameter, or None.
        mscale_all_dim: DeepSeek's attention-factor parameter for all dims, or None.
        truncate: round the ramp's ends to whole dims (transformers' default).
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    kind: ClassVar[str] = "yarn"

    def __post_init__(self) -> None:
        _positive("factor", self.factor)
        _positive("original_max_position_embeddings", self.original_max_position_embeddings)
        _positive("beta_fast", self.beta_fast)
        _positive("beta_slow", self.beta_slow)
        _positive("attention_factor", self.attention_factor, allow_none=True)
        _positive("mscale", self.mscale, allow_none=True)
        _positive("mscale_all_dim", self.mscale_all_dim, allow_none=True)

    def resolved_attention_factor(self) -> float:
        """The factor cos and sin are multiplied by."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return yarn_mscale(self.factor)

    def frequencies(
        self, base: float, dim: int, seq_len: int | None = None
    ) -> tuple[torch.Tensor, float]:
        """Inverse frequencies ``(R/2,)`` float64 and the attention factor."""
        orig = self.original_max_position_embeddings

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp
        ramp = (
            (torch.arange(dim // 2, dtype=torch.float64, device="cpu") - low) / (high - low)
        ).clamp(0, 1)
        extrapolation = 1 - ramp  # 1: keep the frequency, 0: interpolate it
        inv = _default_inv_freq(base, dim)
        inv = (inv / self.factor) * (1 - extrapolation) + inv * extrapolation
        return inv, self.resolved_attention_factor()


@dataclass(frozen=True)
class LongRopeScaling:
    """LongRoPE (``rope_type="longrope"``, Phi-3 128k / Phi-3.5): one divisor per frequency,
    ``inv_freq_i / factors[i]``, from ``short_factor`` while the sequence fits the original
    context and from ``long_factor`` once it is longer, and an attention factor that
    multiplies cos and sin.

    Which set applies is decided per call by the longest position, as transformers'
    ``longrope_frequency_update`` does: a sequence of L positions uses ``long_factor`` when
    ``L > original_max_position_embeddings``, ``short_factor`` otherwise. Keys cached by an
    earlier, shorter call keep the short rotation, so a KV cache must be rebuilt when a
    sequence crosses that length (:attr:`RotaryEmbedding.switch_length`; attnlab's
    generation loop does it, as transformers' Phi-3 ``prepare_inputs_for_generation``).

    Args:
        short_factor: R/2 positive divisors for sequences within the original context.
        long_factor: R/2 positive divisors for longer sequences.
        original_max_position_embeddings: the context length the model was trained with.
        factor: the context extension factor (``max_position_embeddings / original``
            when the config does not give it); only sets the default attention factor.
        attention_factor: explicit attention factor; None derives it from ``factor``:
            ``sqrt(1 + ln(factor) / ln(original_max_position_embeddings))`` (1 when
            ``factor <= 1``).
    """

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    factor: float = 1.0
    attention_factor: float | None = None
    kind: ClassVar[str] = "longrope"

    def __post_init__(self) -> None:
        for name in ("short_factor", "long_factor"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not value:
                raise TypeError(
                    f"`{name}` must be a non-empty tuple of numbers, got {type(value).__name__}"
                )
            for v in value:
                _positive(name, v)
        if len(self.short_factor) != len(self.long_factor):
            raise ValueError(
                f"`short_factor` and `long_factor` must have the same length (R/2), got "
                f"{len(self.short_factor)} and {len(self.long_factor)}"
            )
        _positive("original_max_position_embeddings", self.original_max_position_embeddings)
        _positive("factor", self.factor)
        _positive("attention_factor", self.attention_factor, allow_none=True)

    def resolved_attention_factor(self) -> float:
        """The factor cos and sin are multiplied by."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.factor <= 1.0:
            return 1.0
        return math.sqrt(
            1 + math.log(self.factor) / math.log(self.original_max_position_embeddings)
        )

    def frequencies(
        self, base: float, dim: int, seq_len: int | None = None
    ) -> tuple[torch.Tensor, float]:
        """Inverse frequencies ``(R/2,)`` float64 for sequences of length ``seq_len`` (None:
        the original context, the short factors) and the attention factor.

        Raises:
            ValueError: the factors do not hold R/2 values.
        """
        inv = _default_inv_freq(base, dim)
        long = seq_len is not None and seq_len > self.original_max_position_embeddings
        factors = self.long_factor if long else self.short_factor
        if len(factors) != inv.numel():
            raise ValueError(
                f"`short_factor` / `long_factor` must hold one value per rotating pair "
                f"(R/2 = {inv.numel()}), got {len(factors)}"
            )
        return inv / torch.tensor(
            factors, dtype=torch.float64, device="cpu"
        ), self.resolved_attention_factor()


@dataclass(frozen=True)
class FrequencyFactors:
    """Every inverse frequency divided by a factor of its own: ``inv_freq_i / factors[i]``.

    This is how llama.cpp stores Llama 3 scaling in a GGUF file (the ``rope_freqs``
    tensor, which its converter computes from ``rope_scaling``), so a file is read without
    knowing the parameters it came from.

    Args:
        factors: R/2 positive numbers, one per rotating pair.
    """

    factors: tuple[float, ...]
    kind: ClassVar[str] = "factors"

    def __post_init__(self) -> None:
        if not isinstance(self.factors, tuple) or not self.factors:
            raise TypeError(
                f"`factors` must be a non-empty tuple of numbers, got {type(self.factors).__name__}"
            )
        for value in self.factors:
            _positive("factors", value)

    def frequencies(
        self, base: float, dim: int, seq_len: int | None = None
    ) -> tuple[torch.Tensor, float]:
        """Inverse frequencies ``(R/2,)`` float64 and the attention factor (1 here).

        Raises:
            ValueError: ``factors`` does not hold R/2 values.
        """
        inv = _default_inv_freq(base, dim)
        if len(self.factors) != inv.numel():
            raise ValueError(
                f"`factors` must hold one value per rotating pair (R/2 = {inv.numel()}), "
                f"got {len(self.factors)}"
            )
        return inv / torch.tensor(self.factors, dtype=torch.float64, device="cpu"), 1.0


RopeScaling = (
    LinearScaling
    | DynamicNTKScaling
    | Llama3Scaling
    | YarnScaling
    | LongRopeScaling
    | FrequencyFactors
)
_SCALINGS: dict[str, type] = {
    c.kind: c
    for c in (LinearScaling, DynamicNTKScaling, Llama3Scaling, YarnScaling, LongRopeScaling)
}
_SCALING_CLASSES = (*_SCALINGS.values(), FrequencyFactors)


@dataclass(frozen=True)
class RopeConfig:
    """Everything about a rotary embedding except the head dim (frozen, comparable, hashable).

    Args:
        base: the frequency base (``rope_theta``; 10000 in the RoPE paper).
        fraction: share of each head's dims that rotate (``partial_rotary_factor``), in
            (0, 1]; ``int(fraction * D)`` must be even (checked against D when built).
        interleaved: rotate pairs ``(2i, 2i+1)`` (GPT-J) instead of ``(i, i + R/2)``.
        scaling: None, or one of :class:`LinearScaling`, :class:`DynamicNTKScaling`,
            :class:`Llama3Scaling`, :class:`YarnScaling`, :class:`LongRopeScaling`,
            :class:`FrequencyFactors`.

    Raises:
        ValueError: non-positive base, fraction outside (0, 1], an unknown scaling (e.g. a
            string).
        TypeError: ``interleaved`` not a bool, ``scaling`` of another type.
    """

    base: float = 10000.0
    fraction: float = 1.0
    interleaved: bool = False
    scaling: RopeScaling | None = field(default=None)

    def __post_init__(self) -> None:
        _positive("base", self.base)
        if (
            isinstance(self.fraction, bool)
            or not isinstance(self.fraction, (int, float))
            or not 0 < self.fraction <= 1
        ):
            raise ValueError(
                f"`fraction` (the share of head dims that rotate) must be in (0, 1], "
                f"got {self.fraction!r}"
            )
        if not isinstance(self.interleaved, bool):
            raise TypeError(f"`interleaved` must be a bool, got {type(self.interleaved).__name__}")
        if self.scaling is not None and not isinstance(self.scaling, _SCALING_CLASSES):
            kinds = ", ".join(repr(k) for k in _SCALINGS)
            if isinstance(self.scaling, (str, Mapping)):
                raise ValueError(
                    f"`scaling` must be a scaling object, got {self.scaling!r}; known kinds: "
                    f"{kinds}: build e.g. LinearScaling(factor=2.0), or read a Hugging Face "
                    "dict with RopeConfig.from_hf_config"
                )
            raise TypeError(
                f"`scaling` must be None or one of LinearScaling, DynamicNTKScaling, "
                f"Llama3Scaling, YarnScaling, LongRopeScaling, FrequencyFactors, got "
                f"{type(self.scaling).__name__}"
            )

    def rotary_dims(self, head_dim: int) -> int:
        """R, the number of dims of a ``head_dim``-wide head that rotate.

        Raises:
            ValueError: R odd or zero, naming ``fraction``.
        """
        R = int(head_dim * self.fraction)
        if R < 2 or R % 2:
            raise ValueError(
                f"`fraction`={self.fraction} of head_dim={head_dim} leaves {R} rotated dims; "
                "that must be an even number >= 2 (pick a fraction with an even "
                "int(fraction * head_dim))"
            )
        return R

    @classmethod
    def from_hf_config(
        cls,
        config: Mapping[str, Any],
        *,
        interleaved: bool = False,
        layer_type: str | None = None,
    ) -> RopeConfig:
        """Read the RoPE settings of a Hugging Face ``config.json`` dict.

        Understands the transformers 4 form (``rope_theta``, ``rope_scaling`` with ``type``
        or ``rope_type``, ``partial_rotary_factor`` / ``rotary_pct`` / ``rotary_dim``) and
        the transformers 5 form (``rope_parameters``, optionally one dict per layer type).

        Args:
            config: the parsed ``config.json``.
            interleaved: the family's pair convention (the file does not say; GPT-J: True).
            layer_type: for per-layer-type ``rope_parameters`` (Gemma 3:
                ``"full_attention"`` / ``"sliding_attention"``).

        Raises:
            ValueError: an unknown ``rope_type``, missing or invalid fields, each named.
        """
        if not isinstance(config, Mapping):
            raise TypeError(f"`config` must be a dict, got {type(config).__name__}")
        for key in ("rope_parameters", "rope_scaling"):
            if config.get(key) is not None and not isinstance(config[key], Mapping):
                raise TypeError(
                    f"`{key}` must be an object (dict), got {type(config[key]).__name__} "
                    f"{config[key]!r}"
                )
        params: Mapping[str, Any] = config.get("rope_parameters") or {}
        if layer_type is not None:
            if layer_type not in params or not isinstance(params[layer_type], Mapping):
                raise ValueError(
                    f"`layer_type` {layer_type!r} is not a key of rope_parameters "
                    f"(keys: {sorted(params)})"
                )
            params = params[layer_type]
        elif any(isinstance(v, Mapping) for v in params.values()):
            raise ValueError(
                f"rope_parameters holds one dict per layer type ({sorted(params)}); pass "
                "`layer_type`"
            )
        scaling_params: Mapping[str, Any] = config.get("rope_scaling") or {}
        merged = {**scaling_params, **params}
        kind = merged.get("rope_type", merged.get("type", "default"))
        base = merged.get("rope_theta") or config.get("rope_theta") or 10000.0
        fraction = merged.get("partial_rotary_factor", config.get("partial_rotary_factor"))
        if fraction is None and "rotary_pct" in config:
            fraction = config["rotary_pct"]
        if fraction is None and config.get("rotary_dim") is not None:
            fraction = config["rotary_dim"] / (config.get("head_dim") or _hf_head_dim(config))
        max_pos = config.get("max_position_embeddings")
        orig = config.get("original_max_position_embeddings") or merged.get(
            "original_max_position_embeddings", max_pos
        )

        def need(name: str, value: Any = None) -> Any:
            value = merged.get(name) if value is None else value
            if value is None:
                raise ValueError(f"rope_type {kind!r} needs `{name}` in the config, none found")
            return value

        scaling: RopeScaling | None
        if kind == "default":
            scaling = None
        elif kind == "linear":
            scaling = LinearScaling(factor=need("factor"))
        elif kind == "dynamic":
            scaling = DynamicNTKScaling(
                factor=need("factor"),
                max_position_embeddings=need("max_position_embeddings", max_pos),
            )
        elif kind == "llama3":
            scaling = Llama3Scaling(
                factor=need("factor"),
                low_freq_factor=need("low_freq_factor"),
                high_freq_factor=need("high_freq_factor"),
                original_max_position_embeddings=need("original_max_position_embeddings", orig),
            )
        elif kind == "yarn":
            orig = need("original_max_position_embeddings", orig)
            factor = merged.get("factor")
            if factor is None:
                factor = need("max_position_embeddings", max_pos) / orig
            scaling = YarnScaling(
                factor=factor,
                original_max_position_embeddings=orig,
                beta_fast=merged.get("beta_fast") or 32.0,
                beta_slow=merged.get("beta_slow") or 1.0,
                attention_factor=merged.get("attention_factor"),
                mscale=merged.get("mscale"),
                mscale_all_dim=merged.get("mscale_all_dim"),
                truncate=bool(merged.get("truncate", True)),
            )
        elif kind == "longrope":
            orig = need("original_max_position_embeddings", orig)
            factors = {}
            for name in ("short_factor", "long_factor"):
                value = need(name)
                if not isinstance(value, (list, tuple)):
                    raise ValueError(
                        f"rope_type 'longrope' needs `{name}` as a list of numbers, got "
                        f"{type(value).__name__}"
                    )
                factors[name] = tuple(value)
            factor = merged.get("factor")
            if factor is None:
                factor = need("max_position_embeddings", max_pos) / orig
            scaling = LongRopeScaling(
                short_factor=factors["short_factor"],
                long_factor=factors["long_factor"],
                original_max_position_embeddings=orig,
                factor=factor,
                attention_factor=merged.get("attention_factor"),
            )
        else:
            raise ValueError(
                f"`rope_type` (rope_scaling / rope_parameters) must be one of 'default', "
                f"{', '.join(repr(k) for k in _SCALINGS)}, got {kind!r}"
            )
        return cls(
            base=float(base),
            fraction=1.0 if fraction is None else float(fraction),
            interleaved=interleaved,
            scaling=scaling,
        )


def _hf_head_dim(config: Mapping[str, Any]) -> int:
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    if not isinstance(hidden, int) or not isinstance(heads, int) or heads <= 0:
        raise ValueError(
            "the config needs `head_dim`, or `hidden_size` and `num_attention_heads`, to size "
            f"the rotary embedding; got hidden_size={hidden!r}, num_attention_heads={heads!r}"
        )
    return hidden // heads


def table_length(have: int, need: int) -> int:
    """Positions a table of ``have`` rows (0: none yet) grows to when ``need`` are needed:
    at least a quarter more and 1,024 more (so that decoding one position after another
    rebuilds it a few times, not at every step), never doubled: a 4,096-token prompt's
    tables grow to 5,120 positions for the steps after it, where doubling gave 8,192 (and
    the steps' own tables then 16,384: 64 MB of float64 for one of Gemma 3's rotations)."""
    return max(need, have + max(have // 4, 1024))


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoPE) with partial rotary, either pair convention and
    frequency scaling.

    The first R dims of a head vector at position p (``R = int(fraction * D)``) are rotated
    in pairs by the angles ``p * inv_freq`` (``inv_freq_i = base^(-2i/R)`` unless
    ``scaling`` says otherwise); the other ``D - R`` dims pass through. The cos/sin tables
    are cached (fp64) and grown on demand; nothing is saved in the state dict.

    Args:
        head_dim: D, even.
        base: the frequency base (10000 in the RoPE paper, 500000 in Llama 3).
        fraction: share of the head dims that rotate (partial rotary), in (0, 1].
        interleaved: pairs ``(2i, 2i+1)`` (GPT-J) instead of ``(i, i + R/2)`` (rotate half).
        scaling: a frequency scaling (see :class:`RopeConfig`), or None.

    Attributes:
        config: the :class:`RopeConfig` (frozen).
        rotary_dims: R.
        attention_factor: what cos and sin are multiplied by (YaRN's; 1 otherwise).

    Raises:
        ValueError: odd or non-positive ``head_dim``, non-positive ``base``, a ``fraction``
            leaving an odd number of rotated dims, an unknown ``scaling``.
    """

    def __init__(
        self,
        head_dim: int,
        base: float = 10000.0,
        *,
        fraction: float = 1.0,
        interleaved: bool = False,
        scaling: RopeScaling | None = None,
    ) -> None:
        super().__init__()
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
            raise ValueError(f"`head_dim` must be a positive even int, got {head_dim!r}")
        if head_dim % 2:
            raise ValueError(f"`head_dim` must be a positive even int, got {head_dim!r}")
        self.config = RopeConfig(
            base=float(base) if isinstance(base, int) else base,
            fraction=fraction,
            interleaved=interleaved,
            scaling=scaling,
        )
        self.head_dim = head_dim
        self.base = float(self.config.base)
        self.rotary_dims = self.config.rotary_dims(head_dim)
        if isinstance(scaling, DynamicNTKScaling) and self.rotary_dims <= 2:
            raise ValueError(
                f"dynamic NTK scaling needs more than 2 rotated dims, got {self.rotary_dims}; "
                "raise `fraction` or use another `scaling`"
            )
        inv, self.attention_factor = self._frequencies(None)
        self._original_inv = inv
        self._inv = inv  # (R/2,) float64, what the tables are built from
        # Dynamic NTK state, as transformers' dynamic_rope_update keeps it.
        self._dynamic_len = (
            scaling.max_position_embeddings if isinstance(scaling, DynamicNTKScaling) else 0
        )
        # LongRoPE: the long factors' frequencies, switched to past the original context.
        self._long_inv = (
            self._frequencies(scaling.original_max_position_embeddings + 1)[0]
            if isinstance(scaling, LongRopeScaling)
            else None
        )
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv.float(), persistent=False)
        self._cos: torch.Tensor | None = None  # (L, R) float64
        self._sin: torch.Tensor | None = None

    @classmethod
    def from_config(cls, head_dim: int, config: RopeConfig) -> RotaryEmbedding:
        """Build from a :class:`RopeConfig` for heads of width ``head_dim``."""
        if not isinstance(config, RopeConfig):
            raise TypeError(f"`config` must be a RopeConfig, got {type(config).__name__}")
        return cls(
            head_dim,
            config.base,
            fraction=config.fraction,
            interleaved=config.interleaved,
            scaling=config.scaling,
        )

    @classmethod
    def from_hf_config(
        cls,
        config: Mapping[str, Any],
        *,
        interleaved: bool = False,
        layer_type: str | None = None,
    ) -> RotaryEmbedding:
        """Build from a Hugging Face ``config.json`` dict (see :meth:`RopeConfig.from_hf_config`);
        the head dim is ``head_dim`` or ``hidden_size // num_attention_heads``."""
        rope = RopeConfig.from_hf_config(config, interleaved=interleaved, layer_type=layer_type)
        return cls.from_config(config.get("head_dim") or _hf_head_dim(config), rope)

    def _frequencies(self, seq_len: int | None) -> tuple[torch.Tensor, float]:
        if self.config.scaling is None:
            return _default_inv_freq(self.base, self.rotary_dims), 1.0
        inv, factor = self.config.scaling.frequencies(self.base, self.rotary_dims, seq_len)
        return inv, float(factor)

    def _set_inv(self, inv: torch.Tensor) -> None:
        self._inv = inv
        self.inv_freq = inv.to(self.inv_freq.device, torch.float32)
        self._cos = self._sin = None

    def _dynamic_update(self, seq_len: int) -> None:
        """transformers' ``dynamic_rope_update``: grow past the longest length so far, reset
        inside the original context."""
        scaling = self.config.scaling
        assert isinstance(scaling, DynamicNTKScaling)
        original = scaling.max_position_embeddings
        if seq_len > self._dynamic_len:
            self._set_inv(self._frequencies(seq_len)[0])
            self._dynamic_len = seq_len
        elif seq_len < original < self._dynamic_len:
            self._set_inv(self._original_inv)
            self._dynamic_len = original

    @property
    def switch_length(self) -> int | None:
        """The sequence length past which the frequencies change (LongRoPE's original
        context), or None. Keys cached while a sequence was at most this long were rotated
        with the other frequencies: a KV cache is rebuilt when a sequence crosses it."""
        scaling = self.config.scaling
        if isinstance(scaling, LongRopeScaling):
            return scaling.original_max_position_embeddings
        return None

    @property
    def length_dependent(self) -> bool:
        """True when the frequencies depend on the sequence length (dynamic NTK, LongRoPE):
        one cos/sin table built once does not serve every call."""
        return isinstance(self.config.scaling, (DynamicNTKScaling, LongRopeScaling))

    def _longrope_update(self, seq_len: int) -> None:
        """transformers' ``longrope_frequency_update``: the long factors when the sequence
        is longer than the original context, the short ones otherwise."""
        assert self._long_inv is not None
        long = seq_len > int(self.switch_length or 0)
        inv = self._long_inv if long else self._original_inv
        if inv is not self._inv:
            self._set_inv(inv)

    def _tables(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos is None or self._cos.shape[0] < length or self._cos.device != device:
            n = table_length(self._cos.shape[0] if self._cos is not None else 0, length)
            self._cos = self._sin = None  # the old tables go before the new are built
            # Angles in fp64 so that long positions keep their precision.
            inv = self._inv.to(device)
            freqs = torch.arange(n, device=device, dtype=torch.float64)[:, None] * inv  # (L, R/2)
            if self.config.interleaved:
                emb = freqs.repeat_interleave(2, dim=-1)  # (L, R): f0 f0 f1 f1 ...
            else:
                emb = torch.cat((freqs, freqs), dim=-1)  # (L, R): f0 f1 ... f0 f1 ...
            del freqs
            a = self.attention_factor
            cos, sin = emb.cos(), emb.sin_()  # float64; cast per use
            if a != 1.0:
                cos.mul_(a)
                sin.mul_(a)
            self._cos, self._sin = cos, sin
        assert self._sin is not None
        return self._cos, self._sin

    def cos_sin(
        self, position_ids: torch.Tensor, device: torch.device | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (times the attention factor) for the given positions, float64,
        shape ``position_ids.shape + (R,)``, laid out for this convention."""
        dev = device if device is not None else position_ids.device
        longest = int(position_ids.max()) + 1
        if self._dynamic_len:
            self._dynamic_update(longest)
        elif self._long_inv is not None:
            self._longrope_update(longest)
        cos, sin = self._tables(longest, dev)
        idx = position_ids.to(dev)
        return cos[idx], sin[idx]

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Rotate the first R dims of ``x`` by the positions; the rest pass through.

        With :class:`DynamicNTKScaling` the frequencies follow the longest position of this
        call as transformers' ``dynamic_rope_update`` does (grow when it passes the longest
        so far, reset when it is inside the original context), so, as there, keys cached at
        an earlier length keep their earlier rotation. With :class:`LongRopeScaling` the
        call's longest position picks the short or the long factors (see there).

        Args:
            x: ``(B, H, T, D)``.
            position_ids: ``(T,)`` or ``(B, T)`` integer positions.

        Returns:
            The rotated tensor, same shape and dtype as ``x`` (computed in fp32 or fp64).

        Shape:
            - x: ``(B, H, T, D)``; position_ids: ``(T,)`` or ``(B, T)``; output: like x.
        """
        if x.shape[-1] != self.head_dim:
            raise ValueError(
                f"`x` must have head dim {self.head_dim} for this RotaryEmbedding, "
                f"got {x.shape[-1]}"
            )
        cos, sin = self.cos_sin(position_ids, x.device)  # (T, R) or (B, T, R)
        if cos.ndim == 3:
            cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, R)
        cd = torch.float64 if x.dtype == torch.float64 else torch.float32
        r = self.rotary_dims
        xr = x[..., :r].to(cd)  # (B, H, T, R)
        turn = rotate_pairs if self.config.interleaved else rotate_half
        out = (xr * cos.to(cd) + turn(xr) * sin.to(cd)).to(x.dtype)
        if self.head_dim == r:
            return out
        return torch.cat((out, x[..., r:]), dim=-1)  # (B, H, T, D)

    def extra_repr(self) -> str:
        c = self.config
        parts = [f"head_dim={self.head_dim}", f"base={c.base:g}"]
        if c.fraction != 1.0:
            parts.append(f"rotary_dims={self.rotary_dims}")
        if c.interleaved:
            parts.append("interleaved=True")
        if c.scaling is not None:
            parts.append(f"scaling={c.scaling!r}")
        return ", ".join(parts)
