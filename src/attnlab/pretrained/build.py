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
import functools
import math
import re
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from attnlab.models.decoder import Decoder, DecoderConfig
from attnlab.models.encoder import Encoder, EncoderConfig
from attnlab.models.encoder_decoder import EncoderDecoder, EncoderDecoderConfig
from attnlab.models.families import (
    ACTIVATION_NAMES,
    Family,
    Source,
    WeightRule,
    family_for,
    gguf_family,
)
from attnlab.norms import QKNorm
from attnlab.pretrained.errors import ModelFileError
from attnlab.quant import WeightFormat, holding
from attnlab.rope import (
    FrequencyFactors,
    LinearScaling,
    LongRopeScaling,
    RopeConfig,
    RopeScaling,
    YarnScaling,
)

__all__ = [
    "LIMITS",
    "build_config",
    "build_model",
    "check_weights",
    "family_from",
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
_FLOAT32_MAX = 3.4028234663852886e38
_TOKEN_IDS = ("pad_token_id", "decoder_start_token_id")
# Numbers that must be finite and > 0.
_POSITIVE = (
    "norm_eps",
    "layer_norm_eps",
    "rope_theta",
    "attn_scale",
    "embed_multiplier",
    "residual_multiplier",
    "logits_scaling",
)
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


def _check_field(name: str, value: Any, kind: Any, where: str, key: str | None = None) -> Any:
    """Type- and range-check one config field; return it (ints stay ints). Messages name
    ``key``, the config key the value was read from (default: the field's name)."""
    label = key or name
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:60] + "..."
    if name in LIMITS:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ModelFileError(where, f"`{label}` must be an integer, got {shown}")
        low = 0 if name in _TOKEN_IDS else 1
        if not low <= value <= LIMITS[name]:
            raise ModelFileError(
                where,
                f"`{label}` = {shown} is outside the sane range {low}..{LIMITS[name]}; "
                "refusing to allocate it",
            )
        return value
    # `float | None` and `bool | None` fields are checked like `float` and `bool` (None
    # never reaches here).
    kinds = set(typing.get_args(kind)) - {type(None)} if typing.get_args(kind) else {kind}
    if kinds == {float} or name in _POSITIVE:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ModelFileError(where, f"`{label}` must be a positive number, got {shown}")
        if not isinstance(value, float) and value.bit_length() > 1000:  # float() overflows
            raise ModelFileError(where, f"`{label}` = {shown} is out of range")
        if not math.isfinite(float(value)):
            raise ModelFileError(where, f"`{label}` must be finite, got {shown}")
        if float(value) > _FLOAT32_MAX:  # the model computes in float32: it would be inf
            raise ModelFileError(where, f"`{label}` = {shown} is beyond float32's range")
        return float(value)
    if kinds == {bool} and not isinstance(value, bool):
        raise ModelFileError(where, f"`{label}` must be true or false, got {shown}")
    return value


def family_from(
    name: object,
    where: str | Path,
    source: Source = "hf",
    metadata: Mapping[str, Any] | None = None,
) -> Family:
    """:func:`attnlab.models.families.family_for` (with a GGUF file's ``metadata``:
    :func:`~attnlab.models.families.gguf_family`, which tells the families llama.cpp writes
    under one architecture apart), its refusal as a :class:`ModelFileError` naming the file."""
    try:
        if source == "gguf" and metadata is not None:
            return gguf_family(name, metadata)
        return family_for(name, source)
    except ValueError as e:
        raise ModelFileError(where, str(e)) from None


def build_config(
    family: Family,
    config: Mapping[str, Any],
    *,
    where: str | Path,
    source: Source = "hf",
    extra: Mapping[str, Any] | None = None,
) -> AnyConfig:
    """Read a family's config from ``config.json`` or GGUF metadata.

    The fields are read through the family's key map for ``source``, defaults fill the
    rest, the sizes are checked, then the family's hook turns its options into fields;
    the RoPE, the per-layer windows and the QK-norm become their frozen configs last.

    Args:
        family: the family description.
        config: the parsed config (a dict): ``config.json`` or the GGUF metadata.
        where: the file, for messages.
        source: ``"hf"`` or ``"gguf"``: which of the family's key maps and defaults apply.
        extra: fields known from elsewhere (GGUF: tied embeddings, vocabulary size).

    Returns:
        The config, every size checked against :data:`LIMITS`.

    Raises:
        ModelFileError: a missing required key, a value of the wrong type or size, an
            option this family cannot express yet, an unknown activation.
    """
    where = str(where)
    if source == "hf" and family.text_config is not None:
        nested = config.get(family.text_config)
        if isinstance(nested, Mapping):  # a multimodal checkpoint: the text model's part
            config = nested
    keys = family.key_map(source)
    cls = family.config_class
    hints = typing.get_type_hints(cls)
    fields: dict[str, Any] = dict(family.fixed)
    for key, allowed in family.refuse.items():
        value = lookup(config, key)
        if value is not _MISSING and value not in allowed:
            shown = [a for a in allowed if a is not None] or [None]
            raise ModelFileError(
                where,
                f"`{key}` = {value!r} is not supported for {family.name} yet "
                f"(supported: {', '.join(repr(a) for a in shown)})",
            )
    read_from: dict[str, str] = {}  # field -> the key it was read from, for messages
    for name, candidates in keys.items():
        for key in candidates:
            value = lookup(config, key)
            if name == "sliding_window" and value == 0:  # GGUF's "no window"
                continue
            if value is not _MISSING and value is not None:
                fields[name] = value
                read_from[name] = key
                break
    for name, value in (extra or {}).items():
        fields.setdefault(name, value)
    for name, default in family.defaults_for(source).items():
        if name not in fields:
            fields[name] = default(fields) if callable(default) else default
    missing = sorted(set(family.required) - {n for n, v in fields.items() if v is not None})
    if missing:
        wanted = [keys.get(m, (m,))[0] for m in missing]
        raise ModelFileError(where, f"lacks the required key(s) {wanted} for {family.name}")
    if "activation" in fields:
        act = fields["activation"]
        if not isinstance(act, str) or act not in ACTIVATION_NAMES:
            raise ModelFileError(
                where,
                f"activation {act!r} is not supported; supported: {sorted(ACTIVATION_NAMES)}",
            )
        fields["activation"] = ACTIVATION_NAMES[act]
    for name in list(fields):
        if fields[name] is not None and name not in _STRUCTURED:
            value = fields[name]
            fields[name] = _check_field(name, value, hints.get(name), where, read_from.get(name))
    if family.hook is not None:
        try:
            family.hook(fields, config, source)
        except (ValueError, TypeError) as e:
            raise ModelFileError(where, str(e)) from None
    if cls is DecoderConfig:
        _decoder_fields(fields, config, where, source=source)
    unknown = sorted(set(fields) - family.field_names())
    assert not unknown, f"{family.name}: options {unknown} left over (a page without its hook?)"
    config_obj = cls(**fields)
    heads = config_obj.num_heads
    if isinstance(config_obj, DecoderConfig) and config_obj.positions == "rope":
        _check_rotary(config_obj, keys, where)
    if config_obj.hidden_size % heads and getattr(config_obj, "head_dim", None) is None:
        raise ModelFileError(
            where, f"hidden size {config_obj.hidden_size} is not divisible by {heads} heads"
        )
    if isinstance(config_obj, DecoderConfig) and heads % config_obj.num_kv_heads:
        raise ModelFileError(
            where,
            f"{heads} query heads are not divisible by {config_obj.num_kv_heads} kv heads",
        )
    return config_obj


def _check_rotary(config: DecoderConfig, keys: Mapping[str, tuple[str, ...]], where: str) -> None:
    """The rotary embeddings the model will build, built once here (they are small): a head
    dim or rotary fraction they refuse becomes an error naming the keys it comes from."""
    from attnlab.rope import RotaryEmbedding

    for rope in [config.rope, *(config.layer_ropes or ())]:
        if rope is None:
            continue
        try:
            RotaryEmbedding.from_config(config.rotary_head_dim, rope)
        except (ValueError, TypeError) as e:
            width, heads = keys["hidden_size"][0], keys["num_heads"][0]
            source = f"`{keys['head_dim'][0]}`" if "head_dim" in keys else ""
            source += f"{' or ' if source else ''}`{width}` / `{heads}`"
            raise ModelFileError(
                where,
                f"the rotary embedding refuses head dim {config.rotary_head_dim} (from "
                f"{source}) with the rope settings: {e}",
            ) from None


# Fields that are not single values (checked where they are built).
_STRUCTURED = (
    "rope",
    "qk_norm",
    "layer_types",
    "layer_scales",
    "layer_ropes",
    "no_rope_layers",
    "moe_layers",
    "mlp_only_layers",
    "moe",
    "mla",
)


def _decoder_fields(
    fields: dict[str, Any], config: Mapping[str, Any], where: str, *, source: Source
) -> None:
    """The decoder's structured fields, in place: ``layer_types`` as a window per layer,
    the GGUF value head dim checked, the rotary settings and the QK-norm kind as their
    frozen configs (a family's hook may have set ``rope`` already)."""
    base = fields.pop("rope_theta", None)
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
    head_dim = fields.get("head_dim") or fields["hidden_size"] // fields["num_heads"]
    value_dim = fields.pop("value_head_dim", None)
    if value_dim is not None and value_dim != head_dim:
        arch = config.get("general.architecture", "")
        raise ModelFileError(
            where,
            f"`{arch}.attention.value_length` = {value_dim} differs from the key head dim "
            f"{head_dim}; attnlab's attention has one head dim for keys and values",
        )
    interleaved = fields.pop("rope_interleaved", False)  # a hook's: pairs side by side
    rope_dims = fields.pop("rope_dims", None)
    factors = fields.pop("rope_factors", None)
    longrope = fields.pop("rope_longrope", None)
    if fields.get("positions", "rope") == "rope" and "rope" not in fields:
        if source == "gguf":
            fields["rope"] = _gguf_rope(
                fields,
                config,
                where,
                base=base,
                rope_dims=rope_dims,
                factors=factors,
                longrope=longrope,
            )
            if interleaved:
                fields["rope"] = dataclasses.replace(fields["rope"], interleaved=True)
        else:
            try:
                fields["rope"] = RopeConfig.from_hf_config(config)
            except (ValueError, TypeError) as e:
                raise ModelFileError(where, f"rope settings: {e}") from None
    present = fields.pop("qk_norm_tensors", False)  # GGUF: attn_q_norm tensors in the file
    kind = fields.pop("qk_norm", None)
    if present and kind is None:
        raise ModelFileError(
            where, "tensors 'blk.*.attn_q_norm' are in the file, but this family has no QK-norm"
        )
    if kind is not None:  # "<norm>_<scope>": rms_head, rms_all, layer_each_head
        norm, scope = kind.split("_", 1)
        fields["qk_norm"] = QKNorm(norm, scope, eps=float(fields.get("norm_eps", 1e-6)))


def _gguf_rope(
    fields: dict[str, Any],
    source: Mapping[str, Any],
    where: str,
    *,
    base: float | None,
    rope_dims: Any,
    factors: tuple[float, ...] | None = None,
    longrope: Mapping[str, tuple[float, ...]] | None = None,
) -> RopeConfig:
    """The rotary settings of a GGUF file: ``rope.freq_base``, ``rope.dimension_count``
    (partial rotary, Phi-3), ``rope.scaling.type`` none / linear / yarn, the ``rope_freqs``
    tensor's per-frequency divisors (``factors``: Llama 3 scaling as llama.cpp writes it),
    and Phi-3's ``rope_factors_long`` / ``rope_factors_short`` tensors (``longrope``) with
    ``rope.scaling.original_context_length`` and ``rope.scaling.attn_factor``; any other
    scaling is refused naming the key. A latent-attention (``deepseek2``) file's YaRN sets
    ``fields["attn_scale"]`` too (:func:`_gguf_deepseek2_yarn`)."""
    arch = source.get("general.architecture", "")
    mla = fields.get("mla")
    head_dim = (
        mla.qk_rope_head_dim
        if mla is not None
        else fields.get("head_dim") or fields["hidden_size"] // fields["num_heads"]
    )
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
    elif kind == "yarn" and mla is not None:
        scaling, fields["attn_scale"] = _gguf_deepseek2_yarn(fields, source, where, arch)
    elif kind == "yarn":
        scaling = _gguf_yarn(fields, source, where, arch)
    elif kind != "none":
        raise ModelFileError(
            where,
            f"`{arch}.rope.scaling.type` = {kind!r} is not supported for GGUF files yet "
            "(supported: 'none', 'linear', 'yarn')",
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
    # llama.cpp's deepseek2 turns adjacent pairs (its "norm" RoPE) of weights its converter
    # does not permute: interleaved
    return RopeConfig(
        base=float(base or 10000.0), fraction=fraction, scaling=scaling, interleaved=mla is not None
    )


def _gguf_yarn(
    fields: Mapping[str, Any], source: Mapping[str, Any], where: str, arch: str
) -> YarnScaling:
    """YaRN as llama.cpp applies it to a GGUF file (gpt-oss): ``rope.scaling.factor``,
    ``rope.scaling.original_context_length`` (else ``context_length``),
    ``rope.scaling.yarn_beta_fast`` / ``yarn_beta_slow`` (32 and 1 when absent), the ramp's
    ends rounded to whole dims (ggml's ``rope_yarn_corr_dims``), and the attention factor
    ``0.1 ln(factor) + 1`` times ``rope.scaling.attn_factor`` (1 when absent). The keys that
    make llama.cpp mix or scale otherwise (``yarn_ext_factor``, ``yarn_attn_factor``,
    ``yarn_log_multiplier``) are refused, naming the key."""
    prefix = f"{arch}.rope.scaling."
    for name in ("yarn_ext_factor", "yarn_attn_factor", "yarn_log_multiplier"):
        if source.get(prefix + name) is not None:
            raise ModelFileError(
                where, f"`{prefix}{name}` is not supported for GGUF files with YaRN yet"
            )
    factor = _gguf_positive(source, prefix + "factor", None, where)
    mscale = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0
    return YarnScaling(
        factor=factor,
        original_max_position_embeddings=_gguf_yarn_context(fields, source, where, prefix),
        beta_fast=_gguf_positive(source, prefix + "yarn_beta_fast", 32.0, where),
        beta_slow=_gguf_positive(source, prefix + "yarn_beta_slow", 1.0, where),
        attention_factor=mscale * _gguf_positive(source, prefix + "attn_factor", 1.0, where),
        truncate=True,
    )


def _gguf_deepseek2_yarn(
    fields: Mapping[str, Any], source: Mapping[str, Any], where: str, arch: str
) -> tuple[YarnScaling, float]:
    """YaRN as llama.cpp runs a ``deepseek2`` file: the rotation's scaling, and the score
    scale that goes with it.

    llama.cpp's deepseek2 reads ``rope.scaling.factor`` f, ``original_context_length``,
    ``rope.scaling.attn_factor`` a (1 when absent) and ``yarn_log_multiplier``, which its
    converter writes as ``0.1 * mscale_all_dim`` and its loader divides by 0.1 (m). cos
    and sin are multiplied by g = a (with m; without it ``a * (0.1 ln f + 1)`` when
    f > 1), and the scores by ``(g * (0.1 m ln f + 1))**2 / sqrt(Dn + Dr)``: transformers'
    DeepSeek YaRN wherever ``mscale`` equals ``mscale_all_dim`` (DeepSeek-V2, V3, R1, Kimi
    K2). The ramp's ends are llama.cpp's fixed 32 and 1 rotations and its extrapolation
    factor 1: deepseek2 does not read ``yarn_beta_fast`` / ``yarn_beta_slow`` /
    ``yarn_ext_factor`` (its converter writes the config's), so a file whose value
    differs would run otherwise than it says and is refused naming the key, as is any
    ``yarn_attn_factor`` (written from a config's ``attention_factor``, never read)."""
    prefix = f"{arch}.rope.scaling."
    for name, used in (("yarn_beta_fast", 32.0), ("yarn_beta_slow", 1.0), ("yarn_ext_factor", 1.0)):
        found = source.get(prefix + name)
        if found is not None and found != used:
            raise ModelFileError(
                where,
                f"`{prefix}{name}` = {found!r} is not supported: llama.cpp's deepseek2 does "
                f"not read it and runs with {used:g} (supported: absent or {used:g})",
            )
    if source.get(prefix + "yarn_attn_factor") is not None:
        raise ModelFileError(
            where,
            f"`{prefix}yarn_attn_factor` is not supported: llama.cpp's deepseek2 does not "
            "read it (it derives the factor from `yarn_log_multiplier`)",
        )
    factor = _gguf_positive(source, prefix + "factor", None, where)
    attn_factor = _gguf_positive(source, prefix + "attn_factor", 1.0, where)
    if source.get(prefix + "yarn_log_multiplier") is None:
        multiplier = 0.0
        rotation = attn_factor * (1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0)
    else:
        multiplier = _gguf_positive(source, prefix + "yarn_log_multiplier", None, where) / 0.1
        rotation = attn_factor
    mscale = rotation * (0.1 * multiplier * math.log(factor) + 1.0)
    mla = fields["mla"]
    scaling = YarnScaling(
        factor=factor,
        original_max_position_embeddings=_gguf_yarn_context(fields, source, where, prefix),
        attention_factor=rotation,
        truncate=True,
    )
    return scaling, mscale * mscale / math.sqrt(mla.qk_nope_head_dim + mla.qk_rope_head_dim)


def _gguf_positive(source: Mapping[str, Any], key: str, default: float | None, where: str) -> float:
    """The finite number > 0 at ``key`` (``default`` when absent; None: required)."""
    value = source.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ModelFileError(where, f"`{key}` must be a finite number > 0, got {value!r}")
    return float(value)


def _gguf_yarn_context(
    fields: Mapping[str, Any], source: Mapping[str, Any], where: str, prefix: str
) -> int:
    """YaRN's original context: ``rope.scaling.original_context_length``, else the file's
    ``context_length`` (llama.cpp's ``n_ctx_orig_yarn``)."""
    orig = source.get(prefix + "original_context_length", fields.get("context_length"))
    if isinstance(orig, bool) or not isinstance(orig, int) or orig <= 0:
        raise ModelFileError(
            where, f"`{prefix}original_context_length` must be an integer > 0, got {orig!r}"
        )
    return orig


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


# --------------------------------------------------------------------------- weights

_PIECES = {
    "{qkv}": ("W_query", "W_key", "W_value"),
    "{gate_up}": ("gate", "up"),
    "{kv_up}": ("k_up", "v_up"),
}
# Parameter names a target may end in (then it names the parameter, not its module).
_LEAVES = ("weight", "bias", "sinks")


def _rule_regex(pattern: str) -> re.Pattern[str]:
    body = re.escape(pattern).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{j\}", r"(?P<j>\d+)")
    # transformers keeps some stacked tensors as bare parameters (Llama 4's experts)
    return re.compile(rf"^{body}(?:\.(?P<leaf>weight|bias))?$")


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
            # a target naming its parameter (a bare source tensor) takes no leaf
            leaf = "" if target.rsplit(".", 1)[-1] in _LEAVES else f".{m['leaf'] or 'weight'}"
            pieces = next((v for k, v in _PIECES.items() if k in target), None)
            if pieces is None:
                targets: tuple[str, ...] = (f"{target}{leaf}",)
            else:
                key = next(k for k in _PIECES if k in target)
                targets = tuple(f"{target.replace(key, p)}{leaf}" for p in pieces)
            row = m.groupdict().get("j")
            if row is not None:  # one row of a target stacked from several tensors
                transform = f"row:{row}"
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
            # which the fused QKV product reuses (attnlab.quant.fuse_linears).
            grouped = per_head.transpose(0, 1).reshape(3 * H * D, *t.shape[1:])
            out = tuple(grouped.split(H * D, dim=0))
        elif part == "plus1":
            out = (t.float() + 1.0,)
        elif part == "gate_up":  # (2F, C), or stacked experts (E, 2F, C)
            out = tuple(torch.chunk(t, 2, dim=0 if t.ndim < 3 else -2))
        elif part == "kv_b":  # MLA's (H * (Dn + Dv), r): each head's key rows, then value rows
            mla = getattr(config, "mla", None)
            assert mla is not None  # only MLA pages name this transform
            H, Dn, Dv = config.num_heads, mla.qk_nope_head_dim, mla.v_head_dim
            k, v = t.reshape(H, Dn + Dv, -1).split([Dn, Dv], dim=1)  # (H, Dn, r), (H, Dv, r)
            out = (k.reshape(H * Dn, -1), v.reshape(H * Dv, -1))
        elif part == "k_b":  # llama.cpp's attn_k_b (H, r, Dn), stored for the absorbed product
            out = (t.transpose(1, 2).reshape(-1, t.shape[1]),)
        elif part == "v_b":  # llama.cpp's attn_v_b (H, Dv, r)
            out = (t.reshape(-1, t.shape[2]),)
        elif part == "gate_up_pairs":  # stacked (E, 2F, ...): gate, up, gate, up, ... rows
            out = (t[:, 0::2], t[:, 1::2])
        elif part == "Tx":  # stacked experts stored (E, in, out): ours are (E, out, in)
            out = (t.transpose(-1, -2),)
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


@dataclass(frozen=True)
class HeldLinear:
    """How a source tensor's linear weights are stored as the model is built.

    Attributes:
        format: the weight format of each linear layer the tensor fills.
        codes: the format's codes read from the file (tensors whose first dimension is
            the weight's rows, :meth:`attnlab.quant.WeightFormat.from_stored`), which go
            through the weight plan's row transforms; None: the format is made from the
            tensor's float values (:meth:`attnlab.quant.WeightFormat.from_float`).
    """

    format: type[WeightFormat]
    codes: tuple[torch.Tensor, ...] | None = None


# Transforms that only rename, split or permute rows: they apply to codes as to values.
_ROW_TRANSFORMS = frozenset({"qkv", "qkv_heads", "gate_up", "rope_q", "rope_k"})


def _linear_targets(model: nn.Module, targets: tuple[str, ...], transform: str) -> bool:
    """True when every target is the weight of an ``nn.Linear`` and ``transform`` keeps rows."""
    if any(p not in _ROW_TRANSFORMS for p in transform.split("+") if p):
        return False
    for target in targets:
        module_name, _, leaf = target.rpartition(".")
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            return False
        if leaf != "weight" or not isinstance(module, nn.Linear):
            return False
    return True


def check_weights(
    config: AnyConfig,
    names: Mapping[str, int],
    *,
    family: Family,
    source: Source,
    where: str | Path,
) -> dict[str, tuple[tuple[str, ...], str]]:
    """The checks :func:`build_model` makes before it allocates or reads anything: the
    weights hold at least the parameters the config implies, and every tensor name is the
    family's (:func:`plan_weights`).

    Returns:
        :func:`plan_weights`' plan.

    Raises:
        ModelFileError: too few values for the config, a tensor the family does not know,
            a layer index beyond the config's.
    """
    needed = parameter_count(config)
    held_names = sum(names.values())
    if needed > held_names:
        raise ModelFileError(
            where,
            f"the config (config.json / metadata) implies {needed:,} parameters but the "
            f"weights hold only {held_names:,} values; the config does not belong to these weights",
        )
    gguf = source == "gguf"
    return plan_weights(
        names,
        family.weight_rules(source),
        prefixes=() if gguf else family.prefixes,
        ignore=() if gguf else family.ignore,
        num_layers=max(config.num_layers, getattr(config, "num_decoder_layers", 0)),
        where=where,
    )


def build_model(
    config: AnyConfig,
    names: Mapping[str, int],
    get: Callable[[str], torch.Tensor],
    *,
    family: Family,
    source: Source,
    where: str | Path,
    dtype: torch.dtype,
    backend: str,
    held: Callable[[str], HeldLinear | None] | None = None,
) -> AnyModel:
    """Build the model for ``config`` and fill it from the source tensors.

    Args:
        config: from :func:`build_config`.
        names: every source tensor name -> its element count.
        get: loads one source tensor by name.
        family: its weight rules, prefixes and ignored names.
        source: ``"hf"`` or ``"gguf"`` (llama.cpp's names: no prefixes, nothing ignored).
        where: the file or directory, for messages.
        dtype: the model's parameter dtype.
        backend: attention backend of every layer.
        held: for a source tensor whose targets are all linear weights, how they are
            stored (codes taken as the file stores them, read once, never dequantised);
            None (or no callable): float parameters of ``dtype``. A layer whose codes the
            format cannot take (a shape its kernel cannot pack) gets float values.

    Raises:
        ModelFileError: the weights cannot hold what the config asks for (checked before
            any allocation), or tensors that do not match the model.
    """
    plan = check_weights(config, names, family=family, source=source, where=where)
    with skip_random_init():
        model = model_class(config)(config, backend=backend)  # type: ignore[arg-type]
    weights: dict[str, torch.Tensor] = {}
    rows: dict[str, dict[int, torch.Tensor]] = {}
    # target -> (its format, its codes or its float values, its float values on request)
    linears: dict[str, tuple[type[WeightFormat], Any, Callable[[], torch.Tensor]]] = {}

    def split(name: str, tensor: torch.Tensor, transform: str) -> tuple[torch.Tensor, ...]:
        try:
            return apply_transform(tensor, transform, config)
        except (ValueError, RuntimeError) as e:  # a shape the transform cannot split
            raise ModelFileError(
                where,
                f"tensor {name!r} of shape {tuple(tensor.shape)} does not fit the config "
                f"(transform {transform!r}): {e}",
            ) from None

    def piece_values(name: str, transform: str, i: int) -> torch.Tensor:
        return split(name, get(name), transform)[i]

    for name, (targets, transform) in plan.items():
        if transform.startswith("row:"):  # StableLM's per-head norms, one tensor per head
            rows.setdefault(targets[0], {})[int(transform[4:])] = get(name)
            continue
        how = (
            held(name) if held is not None and _linear_targets(model, targets, transform) else None
        )
        if how is not None and how.codes is not None:
            pieces = [split(name, c, transform) for c in how.codes]
            parts: tuple[Any, ...] = tuple(zip(*pieces, strict=True))
        else:
            parts = split(name, get(name), transform)
        if len(parts) != len(targets):
            raise ModelFileError(where, f"tensor {name!r} cannot be split into {targets}")
        for i, (target, t) in enumerate(zip(targets, parts, strict=True)):
            if target in weights or target in linears:
                raise ModelFileError(where, f"two tensors map to {target!r}")
            if how is None:
                weights[target] = t
            else:
                # Codes the format cannot take are read again as values (rare).
                values = functools.partial(piece_values, name, transform, i)
                linears[target] = (how.format, t, values)
    for target, stacked in rows.items():
        if sorted(stacked) != list(range(len(stacked))) or target in weights:
            raise ModelFileError(
                where, f"{target!r} needs rows 0..n-1 once each, got rows {sorted(stacked)}"
            )
        try:
            weights[target] = torch.stack([stacked[j] for j in range(len(stacked))])
        except RuntimeError as e:  # rows of different shapes
            raise ModelFileError(where, f"the rows of {target!r} do not stack: {e}") from None
    if getattr(config, "tie_embeddings", False):
        # tied: the embedding serves both
        weights.pop(
            "decoder.lm_head.weight"
            if isinstance(config, EncoderDecoderConfig)
            else "lm_head.weight",
            None,
        )
    for target, (fmt, piece, again) in linears.items():
        _hold_linear(model, target, fmt, piece, again, weights, where)
    fill(model, weights, where, dtype)
    return model.eval()


def _hold_linear(
    model: nn.Module,
    target: str,
    fmt: type[WeightFormat],
    piece: tuple[torch.Tensor, ...] | torch.Tensor,
    values: Callable[[], torch.Tensor],
    weights: dict[str, torch.Tensor],
    where: str | Path,
) -> None:
    """Replace the ``nn.Linear`` whose weight is ``target`` by ``fmt`` made from ``piece``
    (its codes, of the weight's shape by :meth:`~attnlab.quant.WeightFormat.weight_shape`,
    or its float values), its bias
    taken out of ``weights``. Codes ``fmt`` cannot take (a shape its kernel cannot pack)
    leave the linear to :func:`fill`, with ``values()``.

    Raises:
        ModelFileError: a shape that is not the layer's, or a bias missing.
    """
    module_name, _, _ = target.rpartition(".")
    parent_name, _, leaf = module_name.rpartition(".")
    linear = model.get_submodule(module_name)
    assert isinstance(linear, nn.Linear)
    shape = fmt.weight_shape(piece) if isinstance(piece, tuple) else tuple(piece.shape)
    if shape != tuple(linear.weight.shape):
        raise ModelFileError(
            where,
            f"{target} has shape {shape}, the config (config.json / metadata) implies "
            f"{tuple(linear.weight.shape)}",
        )
    bias_name = f"{module_name}.bias"
    if linear.bias is not None and bias_name not in weights:
        raise ModelFileError(where, f"tensors do not match the model: missing [{bias_name!r}]")
    bias = weights.get(bias_name) if linear.bias is not None else None
    if isinstance(piece, tuple):
        try:
            module = fmt.from_stored(piece, bias)
        except ValueError:  # a shape the format's kernel cannot pack: float, quantised later
            weights[target] = values()
            return
    else:
        N, K = shape
        module = holding(fmt, N, K).from_float(piece, bias)
    weights.pop(bias_name, None)
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, leaf, module)
