"""From a family description and a file's config and tensors to a loaded attnlab model.

Shared by every source (Hugging Face directories, GGUF files, the packaged models):

- :func:`build_config` reads a :class:`~attnlab.models.decoder.DecoderConfig` /
  :class:`~attnlab.models.encoder.EncoderConfig` out of a config (``config.json`` or GGUF
  metadata) through the family's key map, and refuses what the family cannot express and
  any size that is not a sane positive integer, naming the field;
- :func:`plan_weights` maps source tensor names to ours with the family's weight rules;
- :func:`build_model` checks that the weights on disk can hold what the config asks for
  (before allocating anything), builds the model without random initialisation and fills
  every parameter exactly once, shapes checked.

No math here: only names, shapes and checks.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from attnlab.models.decoder import Decoder, DecoderConfig
from attnlab.models.encoder import Encoder, EncoderConfig
from attnlab.models.encoder_decoder import EncoderDecoder, EncoderDecoderConfig
from attnlab.models.families import ACTIVATION_NAMES, Family, WeightRule
from attnlab.norms import QKNorm
from attnlab.pretrained.errors import ModelFileError
from attnlab.rope import (
    FrequencyFactors,
    LinearScaling,
    LongRopeScaling,
    RopeConfig,
    RopeScaling,
)

__all__ = [
    "LIMITS",
    "build_config",
    "build_model",
    "find_family",
    "find_gguf_family",
    "plan_weights",
    "skip_random_init",
]

# The largest value any size field may take; anything larger is refused before allocation
# (the largest public models are well inside: width 16k-25k, 126 layers, 256k vocabulary).
LIMITS = {
    "vocab_size": 1 << 22,
    "hidden_size": 1 << 16,
    "num_layers": 512,
    "num_heads": 1024,
    "num_kv_heads": 1024,
    "intermediate_size": 1 << 18,
    "context_length": 1 << 24,
    "max_position_embeddings": 1 << 20,
    "type_vocab_size": 1 << 10,
    "pad_token_id": 1 << 22,
    "sliding_window": 1 << 24,
    "head_dim": 1 << 12,
    "num_decoder_layers": 512,
    "relative_buckets": 1 << 12,
    "relative_max_distance": 1 << 24,
    "decoder_start_token_id": 1 << 22,
}
_TOKEN_IDS = ("pad_token_id", "decoder_start_token_id")
AnyConfig = DecoderConfig | EncoderConfig | EncoderDecoderConfig
AnyModel = Decoder | Encoder | EncoderDecoder
_MISSING = object()


def lookup(source: Mapping[str, Any], key: str) -> Any:
    """``source[key]`` (GGUF's flat dotted keys), else ``a.b`` read as a nested dict;
    ``_MISSING`` when absent."""
    if key in source:
        return source[key]
    value: Any = source
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _check_field(name: str, value: Any, kind: Any, where: str) -> Any:
    """Type- and range-check one config field; return it (ints stay ints)."""
    if name in LIMITS:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ModelFileError(where, f"`{name}` must be an integer, got {value!r}")
        low = 0 if name in _TOKEN_IDS else 1
        if not low <= value <= LIMITS[name]:
            raise ModelFileError(
                where,
                f"`{name}` = {value} is outside the sane range {low}..{LIMITS[name]}; "
                "refusing to allocate it",
            )
        return value
    if kind is float or name in ("norm_eps", "layer_norm_eps", "rope_theta"):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ModelFileError(where, f"`{name}` must be a positive number, got {value!r}")
        if not math.isfinite(float(value)):
            raise ModelFileError(where, f"`{name}` must be finite, got {value!r}")
        return float(value)
    if kind is bool and not isinstance(value, bool):
        raise ModelFileError(where, f"`{name}` must be true or false, got {value!r}")
    return value


def find_family(name: object, where: str | Path) -> Family:
    """The family for ``model_type`` / ``general.architecture`` ``name``.

    Raises:
        ModelFileError: a missing or unknown name (the message lists the supported ones).
    """
    from attnlab.models.families import FAMILIES

    if not isinstance(name, str):
        raise ModelFileError(where, f"lacks the model type (which family this is), got {name!r}")
    if name not in FAMILIES:
        raise ModelFileError(
            where,
            f"model type {name!r} is not supported; supported: {', '.join(sorted(FAMILIES))}",
        )
    return FAMILIES[name]


def find_gguf_family(arch: object, where: str | Path) -> Family:
    """The family for a GGUF file's ``general.architecture`` (llama.cpp's names, e.g.
    ``gptneox`` for ``gpt_neox``).

    Raises:
        ModelFileError: a missing or unknown architecture (the message lists the known ones).
    """
    from attnlab.models.families import FAMILIES

    by_arch = {f.gguf_architecture: f for f in FAMILIES.values()}
    if not isinstance(arch, str):
        raise ModelFileError(where, f"lacks `general.architecture`, got {arch!r}")
    if arch not in by_arch:
        raise ModelFileError(
            where,
            f"model type {arch!r} is not supported; supported: {', '.join(sorted(by_arch))}",
        )
    return by_arch[arch]


def build_config(
    family: Family,
    source: Mapping[str, Any],
    *,
    where: str | Path,
    keys: Mapping[str, tuple[str, ...]] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> AnyConfig:
    """Read a family's config from ``source`` (``config.json`` or GGUF metadata).

    Args:
        family: the family description.
        source: the parsed config (a dict).
        where: the file, for messages.
        keys: the key map (default ``family.keys``; GGUF passes ``family.gguf_keys``
            with ``{arch}`` already filled in).
        extra: fields known from elsewhere (GGUF: tied embeddings, vocabulary size).

    Returns:
        The config, every size checked against :data:`LIMITS`.

    Raises:
        ModelFileError: a missing required key, a value of the wrong type or size, an
            option this family cannot express yet, an unknown activation.
    """
    where = str(where)
    gguf = keys is not None and keys is not family.keys
    keys = family.keys if keys is None else keys
    defaults = {**family.defaults, **family.gguf_defaults} if gguf else family.defaults
    cls = family.config_class
    hints = typing.get_type_hints(cls)
    fields: dict[str, Any] = dict(family.fixed)
    for key, allowed in family.refuse.items():
        value = lookup(source, key)
        if value is not _MISSING and value not in allowed:
            shown = [a for a in allowed if a is not None] or [None]
            raise ModelFileError(
                where,
                f"`{key}` = {value!r} is not supported for {family.name} yet "
                f"(supported: {', '.join(repr(a) for a in shown)})",
            )
    for name, candidates in keys.items():
        for key in candidates:
            value = lookup(source, key)
            if name == "sliding_window" and value == 0:  # GGUF's "no window"
                continue
            if value is not _MISSING and value is not None:
                fields[name] = value
                break
    for name, value in (extra or {}).items():
        fields.setdefault(name, value)
    for name, default in defaults.items():
        if name not in fields:
            fields[name] = default(fields) if callable(default) else default
    _window_layers(fields, where)
    _score_scales(fields, where)
    required = {f.name for f in dataclasses.fields(cls)} - {"family"}
    missing = sorted(required - set(fields) - _optional(cls))
    if missing:
        wanted = [keys.get(m, (m,))[0] for m in missing]
        raise ModelFileError(where, f"lacks the required key(s) {wanted} for {family.name}")
    if "activation" in fields:
        act = fields["activation"]
        if act not in ACTIVATION_NAMES:
            raise ModelFileError(
                where,
                f"activation {act!r} is not supported; supported: {sorted(ACTIVATION_NAMES)}",
            )
        fields["activation"] = ACTIVATION_NAMES[act]
    for name in list(fields):
        if fields[name] is not None and name not in (
            "rope",
            "qk_norm",
            "layer_types",
            "layer_scales",
        ):
            fields[name] = _check_field(name, fields[name], hints.get(name), where)
    if cls is DecoderConfig:
        _rope_and_qk_norm(fields, source, where, gguf=gguf)
    config = cls(**fields)
    heads = config.num_heads
    if config.hidden_size % heads and getattr(config, "head_dim", None) is None:
        raise ModelFileError(
            where, f"hidden size {config.hidden_size} is not divisible by {heads} heads"
        )
    if isinstance(config, DecoderConfig) and heads % config.num_kv_heads:
        raise ModelFileError(
            where, f"{heads} query heads are not divisible by {config.num_kv_heads} kv heads"
        )
    return config


def _window_layers(fields: dict[str, Any], where: str) -> None:
    """Qwen2/Qwen3's window rule, in place: ``sliding_window`` only with
    ``use_sliding_window``, and then (unless ``layer_types`` says it per layer) on the layers
    from ``max_window_layers`` on, as transformers builds its ``layer_types``."""
    if "use_sliding_window" not in fields:
        return
    use = fields.pop("use_sliding_window")
    first = fields.pop("max_window_layers")
    if not isinstance(use, bool):
        raise ModelFileError(where, f"`use_sliding_window` must be true or false, got {use!r}")
    if isinstance(first, bool) or not isinstance(first, int) or first < 0:
        raise ModelFileError(where, f"`max_window_layers` must be an integer >= 0, got {first!r}")
    if not use:
        fields.pop("sliding_window", None)
    window, types = fields.get("sliding_window"), fields.get("layer_types")
    layers = fields.get("num_layers")
    if types is None and window is not None and isinstance(layers, int) and layers <= 1 << 16:
        fields["layer_types"] = [
            "sliding_attention" if i >= first else "full_attention" for i in range(layers)
        ]
    elif window is None and isinstance(types, list) and "sliding_attention" in types:
        # transformers: the sliding layers have no window when use_sliding_window is off
        fields["layer_types"] = ["full_attention"] * len(types)


def _score_scales(fields: dict[str, Any], where: str) -> None:
    """GPT-2's score-scale switches, in place: ``scale_attn_weights`` (``1/sqrt(D)``, or
    no scaling when false) and ``scale_attn_by_inverse_layer_idx`` (layer i's scores also
    divided by ``i + 1``) become ``layer_scales`` when they change anything;
    ``reorder_and_upcast_attn`` (scores in fp32) is checked and dropped: attnlab's scores are
    fp32 in an fp32 model, and bf16 runs keep attnlab's own backends' precision."""
    switches = {}
    for key in ("scale_attn_weights", "scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if key in fields:
            value = fields.pop(key)
            if not isinstance(value, bool):
                raise ModelFileError(where, f"`{key}` must be true or false, got {value!r}")
            switches[key] = value
    scaled = switches.get("scale_attn_weights", True)
    inverse = switches.get("scale_attn_by_inverse_layer_idx", False)
    if scaled and not inverse:
        return
    width, heads, layers = (
        fields.get("hidden_size"),
        fields.get("num_heads"),
        fields.get("num_layers"),
    )
    sizes = (width, heads, layers)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in sizes):
        return  # the size checks that follow name the field
    assert isinstance(width, int) and isinstance(heads, int) and isinstance(layers, int)
    if layers > LIMITS["num_layers"]:
        return
    base = (width // heads) ** -0.5 if scaled else 1.0
    fields["layer_scales"] = tuple(base / (i + 1 if inverse else 1) for i in range(layers))


def _rope_and_qk_norm(
    fields: dict[str, Any], source: Mapping[str, Any], where: str, *, gguf: bool
) -> None:
    """Turn the rotary settings and the QK-norm kind into their frozen configs, in place."""
    base = fields.pop("rope_theta", None)
    scalar = fields.pop("query_pre_attn_scalar", None)
    if scalar is not None:
        if isinstance(scalar, bool) or not isinstance(scalar, (int, float)) or scalar <= 0:
            raise ModelFileError(where, f"`query_pre_attn_scalar` must be > 0, got {scalar!r}")
        fields["attn_scale"] = float(scalar) ** -0.5
    types = fields.pop("layer_types", None)
    if types is not None:
        if not isinstance(types, list) or len(types) != fields.get("num_layers"):
            raise ModelFileError(where, "`layer_types` must list one type per layer")
        window = fields.get("sliding_window")
        if any(t not in ("full_attention", "sliding_attention") for t in types):
            raise ModelFileError(
                where, f"`layer_types` {sorted(set(map(str, types)))} holds an unsupported type"
            )
        if "sliding_attention" in types and window is None:
            raise ModelFileError(where, "`layer_types` has sliding layers but no `sliding_window`")
        fields["layer_windows"] = tuple(window if t == "sliding_attention" else None for t in types)
        fields["sliding_window"] = None

    rope_dims = fields.pop("rope_dims", None)
    factors = fields.pop("rope_factors", None)
    longrope = fields.pop("rope_longrope", None)
    if fields.get("positions", "rope") == "rope":
        if gguf:
            fields["rope"] = _gguf_rope(
                fields,
                source,
                where,
                base=base,
                rope_dims=rope_dims,
                factors=factors,
                longrope=longrope,
            )
        else:
            try:
                fields["rope"] = RopeConfig.from_hf_config(source)
            except (ValueError, TypeError) as e:
                raise ModelFileError(where, f"rope settings: {e}") from None
    kind = fields.pop("qk_norm", None)
    if kind is not None:
        eps = float(fields.get("norm_eps", 1e-6))
        fields["qk_norm"] = QKNorm("rms", "head" if kind == "rms_head" else "all", eps=eps)


def _gguf_rope(
    fields: Mapping[str, Any],
    source: Mapping[str, Any],
    where: str,
    *,
    base: float | None,
    rope_dims: Any,
    factors: tuple[float, ...] | None = None,
    longrope: Mapping[str, tuple[float, ...]] | None = None,
) -> RopeConfig:
    """The rotary settings of a GGUF file: ``rope.freq_base``, ``rope.dimension_count``
    (partial rotary, Phi-3), ``rope.scaling.type`` none / linear, the ``rope_freqs``
    tensor's per-frequency divisors (``factors``: Llama 3 scaling as llama.cpp writes it),
    and Phi-3's ``rope_factors_long`` / ``rope_factors_short`` tensors (``longrope``) with
    ``rope.scaling.original_context_length`` and ``rope.scaling.attn_factor``; any other
    scaling is refused naming the key."""
    arch = source.get("general.architecture", "")
    head_dim = fields.get("head_dim") or fields["hidden_size"] // fields["num_heads"]
    fraction = 1.0
    if rope_dims is not None:
        key = f"{arch}.rope.dimension_count"
        if isinstance(rope_dims, bool) or not isinstance(rope_dims, int):
            raise ModelFileError(where, f"`{key}` must be an integer, got {rope_dims!r}")
        fraction = rope_dims / head_dim
        if not 2 <= rope_dims <= head_dim or rope_dims % 2 or int(head_dim * fraction) != rope_dims:
            raise ModelFileError(
                where, f"`{key}` = {rope_dims} must be an even number in 2..{head_dim} (head dim)"
            )
    kind = source.get(f"{arch}.rope.scaling.type", "none")
    scaling: RopeScaling | None = None
    if kind == "linear":
        factor = source.get(f"{arch}.rope.scaling.factor")
        if (
            isinstance(factor, bool)
            or not isinstance(factor, (int, float))
            or not 0 < factor < math.inf
        ):
            raise ModelFileError(
                where, f"`{arch}.rope.scaling.factor` must be a finite number > 0, got {factor!r}"
            )
        scaling = LinearScaling(float(factor))
    elif kind != "none":
        raise ModelFileError(
            where,
            f"`{arch}.rope.scaling.type` = {kind!r} is not supported for GGUF files yet "
            "(supported: 'none', 'linear')",
        )
    if factors is not None:
        pairs = int(head_dim * fraction) // 2
        if scaling is not None or len(factors) != pairs:
            raise ModelFileError(
                where,
                f"tensor 'rope_freqs.weight' must hold {pairs} factors (one per rotating "
                f"pair) and come without `{arch}.rope.scaling.type`; got {len(factors)} "
                f"with scaling {kind!r}",
            )
        try:
            scaling = FrequencyFactors(factors)
        except (TypeError, ValueError) as e:
            raise ModelFileError(where, f"tensor 'rope_freqs.weight': {e}") from None
    if longrope is not None:
        pairs = int(head_dim * fraction) // 2
        scaling = _gguf_longrope(fields, source, where, arch, kind, scaling, longrope, pairs)
    return RopeConfig(base=float(base or 10000.0), fraction=fraction, scaling=scaling)


def _gguf_longrope(
    fields: Mapping[str, Any],
    source: Mapping[str, Any],
    where: str,
    arch: str,
    kind: str,
    scaling: RopeScaling | None,
    longrope: Mapping[str, tuple[float, ...]],
    pairs: int,
) -> LongRopeScaling:
    """Phi-3's LongRoPE as llama.cpp's converter writes it: the two factor tensors, the
    original context in ``rope.scaling.original_context_length`` and the attention factor
    in ``rope.scaling.attn_factor`` (the default formula on ``context_length / original``
    when absent)."""
    if scaling is not None:
        raise ModelFileError(
            where,
            "tensors 'rope_factors_long.weight' / 'rope_factors_short.weight' come without "
            f"`{arch}.rope.scaling.type` or 'rope_freqs.weight'; got scaling {kind!r}",
        )
    for name, values in longrope.items():
        if len(values) != pairs:
            raise ModelFileError(
                where,
                f"tensor 'rope_factors_{name}.weight' must hold {pairs} factors (one per "
                f"rotating pair), got {len(values)}",
            )
    key = f"{arch}.rope.scaling.original_context_length"
    orig = source.get(key)
    if isinstance(orig, bool) or not isinstance(orig, int) or orig <= 0:
        raise ModelFileError(
            where,
            f"Phi-3 LongRoPE factor tensors need `{key}` (an integer > 0), got {orig!r}",
        )
    attn = source.get(f"{arch}.rope.scaling.attn_factor")
    context = fields.get("context_length")
    factor = context / orig if isinstance(context, int) and context > 0 else 1.0
    try:
        return LongRopeScaling(
            short_factor=longrope["short"],
            long_factor=longrope["long"],
            original_max_position_embeddings=orig,
            factor=factor,
            attention_factor=None if attn is None else attn,
        )
    except (TypeError, ValueError) as e:
        raise ModelFileError(where, f"tensors 'rope_factors_*.weight': {e}") from None


def _optional(cls: type) -> set[str]:
    """Fields with a default in ``cls`` that a source may leave out."""
    ok = {"norm", "norm_bias", "norm_placement", "mlp", "mlp_bias", "parallel_residual"}
    ok |= {"positions", "qkv_bias", "out_bias", "sliding_window", "rope_theta"}
    ok |= {"positions_from_padding", "pad_token_id", "activation", "type_vocab_size"}
    ok |= {"tie_embeddings", "num_kv_heads", "norm_eps", "context_length", "head_dim"}
    ok |= {"rope", "qk_norm", "layer_windows", "attn_scale", "attn_softcap", "final_softcap"}
    ok |= {"layer_scales"}
    ok |= {"embed_scale", "embed_norm"}
    ok |= {"relative_buckets", "relative_max_distance", "causal", "cross_attention"}
    ok |= {"output_head", "head_input_scale", "decoder_start_token_id"}
    ok |= {"gated_mlp", "scale_decoder_outputs", "num_decoder_layers"}
    return ok & {f.name for f in dataclasses.fields(cls)}


# --------------------------------------------------------------------------- weights

_PIECES = {"{qkv}": ("W_query", "W_key", "W_value"), "{gate_up}": ("gate", "up")}


def _rule_regex(pattern: str) -> re.Pattern[str]:
    body = re.escape(pattern).replace(r"\{i\}", r"(?P<i>\d+)")
    return re.compile(rf"^{body}\.(?P<leaf>weight|bias)$")


def plan_weights(
    names: Iterable[str],
    rules: tuple[WeightRule, ...],
    *,
    prefixes: tuple[str, ...] = (),
    ignore: tuple[str, ...] = (),
    num_layers: int,
    where: str | Path,
) -> dict[str, tuple[tuple[str, ...], str]]:
    """Map source tensor names to ours.

    Returns:
        source name -> (our parameter name(s), transform). Names matching ``ignore`` are
        left out.

    Raises:
        ModelFileError: a tensor no rule knows, or a layer index beyond ``num_layers``.
    """
    compiled = [(_rule_regex(src), ours, t) for src, ours, t in rules]
    dropped = [re.compile(p) for p in ignore]
    plan: dict[str, tuple[tuple[str, ...], str]] = {}
    for name in names:
        key = name
        for prefix in prefixes:
            if key.startswith(prefix):
                key = key[len(prefix) :]
                break
        if any(p.match(key) for p in dropped):
            continue
        for regex, ours, transform in compiled:
            m = regex.match(key)
            if m is None:
                continue
            layer = m.groupdict().get("i")
            if layer is not None and int(layer) >= num_layers:
                raise ModelFileError(
                    where, f"tensor {name!r} is for layer {layer}, the config has {num_layers}"
                )
            target = ours.replace("{i}", layer or "")
            pieces = next((v for k, v in _PIECES.items() if k in target), None)
            if pieces is None:
                targets: tuple[str, ...] = (f"{target}.{m['leaf']}",)
            else:
                key = next(k for k in _PIECES if k in target)
                targets = tuple(f"{target.replace(key, p)}.{m['leaf']}" for p in pieces)
            plan[name] = (targets, transform)
            break
        else:
            raise ModelFileError(where, f"tensor {name!r} is not part of this model family")
    return plan


def apply_transform(
    tensor: torch.Tensor, transform: str, config: AnyConfig
) -> tuple[torch.Tensor, ...]:
    """One source tensor -> our tensor(s); see :mod:`attnlab.models.families`."""
    from attnlab.pretrained.gguf_file import unpermute_rotary

    parts = transform.split("+") if transform else []
    out: tuple[torch.Tensor, ...] = (tensor,)
    for part in parts:
        t = out[0]
        if part == "T":
            out = (t.T,) if t.ndim == 2 else (t,)
        elif part == "qkv":
            D = _head_dim(config)
            G = getattr(config, "num_kv_heads", config.num_heads)
            out = tuple(torch.split(t, [config.num_heads * D, G * D, G * D], dim=0))
        elif part == "qkv_heads":  # rows (H, 3, D): each head's q, k, v together
            H, D = config.num_heads, _head_dim(config)
            per_head = t.reshape(H, 3, D, *t.shape[1:])  # (H, 3, D, ...)
            # One copy into (3, H, D, ...): q, k, v are then row blocks of one tensor,
            # which the fused QKV product reuses (attnlab.quant.fuse_rows).
            grouped = per_head.transpose(0, 1).reshape(3 * H * D, *t.shape[1:])
            out = tuple(grouped.split(H * D, dim=0))
        elif part == "plus1":
            out = (t.float() + 1.0,)
        elif part == "gate_up":
            out = tuple(torch.chunk(t, 2, dim=0))
        elif part in ("rope_q", "rope_k") and t.ndim == 2:
            heads = config.num_heads if part == "rope_q" else config.num_kv_heads  # type: ignore[union-attr]
            out = (unpermute_rotary(t, heads),)
        elif part in ("rope_q", "rope_k"):  # a bias: (H*D,) rows, same permutation
            heads = config.num_heads if part == "rope_q" else config.num_kv_heads  # type: ignore[union-attr]
            out = (unpermute_rotary(t[:, None], heads)[:, 0],)
        else:  # pragma: no cover - the families are data checked by the tests
            raise AssertionError(f"unknown transform {part!r}")
    return out


def _head_dim(config: AnyConfig) -> int:
    if isinstance(config, DecoderConfig):
        return config.attention_head_dim
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_heads


# --------------------------------------------------------------------------- the model

_INIT_FUNCTIONS = ("uniform_", "normal_", "kaiming_uniform_", "trunc_normal_", "zeros_", "ones_")


@contextmanager
def skip_random_init() -> Iterator[None]:
    """Build modules without their random initialisation (every weight is overwritten next).

    ``nn.Linear``/``nn.Embedding``/``nn.LayerNorm`` call ``torch.nn.init`` functions in
    their constructors; for 135M parameters that costs seconds. :func:`fill` then checks
    that every parameter is loaded, so no uninitialised value can survive.
    """
    saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}

    def keep(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        return tensor

    try:
        for name in _INIT_FUNCTIONS:
            setattr(nn.init, name, keep)
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def fill(
    model: nn.Module,
    weights: Mapping[str, torch.Tensor],
    where: str | Path,
    dtype: torch.dtype | None = None,
) -> None:
    """Put ``weights`` into ``model`` by name; every parameter exactly once, shapes checked.

    Raises:
        ModelFileError: a missing or unused tensor, or a shape that disagrees.
    """
    params = dict(model.named_parameters())  # tied weights appear once
    missing = sorted(set(params) - set(weights))
    unused = sorted(set(weights) - set(params))
    if missing or unused:
        raise ModelFileError(
            where, f"tensors do not match the model: missing {missing[:5]}, unused {unused[:5]}"
        )
    with torch.no_grad():
        for name, p in params.items():
            w = weights[name]
            if w.shape != p.shape:
                raise ModelFileError(
                    where,
                    f"{name} has shape {tuple(w.shape)}, the config (config.json / metadata) "
                    f"implies {tuple(p.shape)}",
                )
            # Take the loaded tensor itself (no copy when the dtype already fits), in the
            # layout it came in when a matrix product reads it as is: GPT-2's Conv1D
            # weights stay transposed views of the file (F.linear multiplies by the
            # stored (in, out) matrix), a fused tensor's pieces stay row slices of it.
            w = w.to(dtype=dtype or p.dtype)
            p.data = w if _matrix_layout(w) else w.contiguous()


def _matrix_layout(w: torch.Tensor) -> bool:
    """A 2-D tensor whose rows or columns are contiguous: a layout BLAS reads without a copy."""
    return w.ndim == 2 and (w.stride(1) == 1 or w.stride(0) == 1) and min(w.stride()) > 0


def model_class(
    config: AnyConfig,
) -> type[Decoder] | type[Encoder] | type[EncoderDecoder]:
    """:class:`Decoder`, :class:`Encoder` or :class:`EncoderDecoder`, by config type."""
    if isinstance(config, EncoderDecoderConfig):
        return EncoderDecoder
    return Decoder if isinstance(config, DecoderConfig) else Encoder


def parameter_count(config: AnyConfig) -> int:
    """Parameters the config implies (counted on the meta device: nothing is allocated)."""
    with skip_random_init(), torch.device("meta"):
        model = model_class(config)(config)  # type: ignore[arg-type]
    return sum(p.numel() for p in model.parameters())


def build_model(
    config: AnyConfig,
    rules: tuple[WeightRule, ...],
    names: Mapping[str, int],
    get: Callable[[str], torch.Tensor],
    *,
    family: Family,
    where: str | Path,
    dtype: torch.dtype,
    backend: str,
    gguf: bool = False,
) -> AnyModel:
    """Build the model for ``config`` and fill it from the source tensors.

    Args:
        config: from :func:`build_config`.
        rules: the family's weight rules for this source.
        names: every source tensor name -> its element count.
        get: loads one source tensor by name.
        family: for prefixes and ignored names.
        where: the file or directory, for messages.
        dtype: the model's parameter dtype.
        backend: attention backend of every layer.
        gguf: the source uses llama.cpp names (no prefixes to strip).

    Raises:
        ModelFileError: the weights cannot hold what the config asks for (checked before
            any allocation), or tensors that do not match the model.
    """
    needed = parameter_count(config)
    held = sum(names.values())
    if needed > held:
        raise ModelFileError(
            where,
            f"the config (config.json / metadata) implies {needed:,} parameters but the "
            f"weights hold only {held:,} values; the config does not belong to these weights",
        )
    plan = plan_weights(
        names,
        rules,
        prefixes=() if gguf else family.prefixes,
        ignore=() if gguf else family.ignore,
        num_layers=max(config.num_layers, getattr(config, "num_decoder_layers", 0)),
        where=where,
    )
    with skip_random_init():
        model = model_class(config)(config, backend=backend)  # type: ignore[arg-type]
    weights: dict[str, torch.Tensor] = {}
    for name, (targets, transform) in plan.items():
        parts = apply_transform(get(name), transform, config)
        if len(parts) != len(targets):
            raise ModelFileError(where, f"tensor {name!r} cannot be split into {targets}")
        for target, t in zip(targets, parts, strict=True):
            if target in weights:
                raise ModelFileError(where, f"two tensors map to {target!r}")
            weights[target] = t
    if getattr(config, "tie_embeddings", False):
        # tied: the embedding serves both
        weights.pop(
            "decoder.lm_head.weight"
            if isinstance(config, EncoderDecoderConfig)
            else "lm_head.weight",
            None,
        )
    fill(model, weights, where, dtype)
    return model.eval()
