"""From a family page and a file's config (``config.json`` or GGUF metadata) to a model
config.

- :func:`family_from` finds the page (:mod:`attnlab.models.families`), naming the file
  when there is none;
- :func:`build_config` reads a :class:`~attnlab.models.decoder.DecoderConfig` /
  :class:`~attnlab.models.encoder.EncoderConfig` out of a config through the family's key
  map, and refuses what the family cannot express and any size that is not a sane
  positive integer, naming the field;
- :func:`gguf_rope` reads llama.cpp's RoPE keys, the same for every family, with the
  page's own rule where it has one (``Family.gguf_rope``).

No math here: only names, values and checks.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from attnlab.models.decoder import Decoder, DecoderConfig
from attnlab.models.encoder import Encoder, EncoderConfig
from attnlab.models.encoder_decoder import EncoderDecoder, EncoderDecoderConfig
from attnlab.models.families import (
    ACTIVATION_NAMES,
    Family,
    Source,
    family_for,
    gguf_family,
)
from attnlab.models.families.base import GgufRope, gguf_positive, gguf_yarn_context
from attnlab.norms import QKNorm
from attnlab.pretrained.errors import ModelFileError
from attnlab.rope import (
    FrequencyFactors,
    LinearScaling,
    RopeConfig,
    RopeScaling,
    YarnScaling,
    yarn_mscale,
)

__all__ = [
    "LIMITS",
    "AnyConfig",
    "AnyModel",
    "build_config",
    "family_from",
    "gguf_rope",
    "lookup",
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
        _decoder_fields(family, fields, config, where, source=source)
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
    family: Family,
    fields: dict[str, Any],
    config: Mapping[str, Any],
    where: str,
    *,
    source: Source,
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
    if fields.get("positions", "rope") == "rope" and "rope" not in fields:
        if source == "gguf":
            try:
                fields["rope"] = gguf_rope(
                    family, fields, config, base=base, rope_dims=rope_dims, factors=factors
                )
            except ValueError as e:
                raise ModelFileError(where, str(e)) from None
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


def gguf_rope(
    family: Family,
    fields: dict[str, Any],
    metadata: Mapping[str, Any],
    *,
    base: float | None,
    rope_dims: Any,
    factors: tuple[float, ...] | None = None,
) -> RopeConfig:
    """The rotary settings of a GGUF file: ``rope.freq_base``, ``rope.dimension_count``
    (partial rotary, Phi-3), ``rope.scaling.type`` none / linear / yarn and the
    ``rope_freqs`` tensor's per-frequency divisors (``factors``: Llama 3 scaling as
    llama.cpp writes it); any other scaling is refused naming the key. A page's own rule
    (``family.gguf_rope``: DeepSeek's YaRN and score scale, Phi-3's LongRoPE) decides the
    scaling where there is one.

    Raises:
        ValueError: a key or factor tensor that does not fit, named.
    """
    arch = metadata.get("general.architecture", "")
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
            raise ValueError(f"`{key}` must be an integer, got {rope_dims!r}")
        fraction = rope_dims / head_dim
        if not 2 <= rope_dims <= head_dim or rope_dims % 2 or int(head_dim * fraction) != rope_dims:
            raise ValueError(
                f"`{key}` = {rope_dims} must be an even number in 2..{head_dim} (head dim)"
            )
    kind = metadata.get(f"{arch}.rope.scaling.type", "none")
    pairs = int(head_dim * fraction) // 2

    def read(yarn: Callable[[], RopeScaling] | None) -> RopeScaling | None:
        scaling: RopeScaling | None = None
        if kind == "linear":
            factor = metadata.get(f"{arch}.rope.scaling.factor")
            if (
                isinstance(factor, bool)
                or not isinstance(factor, (int, float))
                or not 0 < factor < math.inf
            ):
                raise ValueError(
                    f"`{arch}.rope.scaling.factor` must be a finite number > 0, got {factor!r}"
                )
            scaling = LinearScaling(float(factor))
        elif kind == "yarn":
            scaling = _gguf_yarn(fields, metadata, arch) if yarn is None else yarn()
        elif kind != "none":
            raise ValueError(
                f"`{arch}.rope.scaling.type` = {kind!r} is not supported for GGUF files yet "
                "(supported: 'none', 'linear', 'yarn')"
            )
        if factors is not None:
            if scaling is not None or len(factors) != pairs:
                raise ValueError(
                    f"tensor 'rope_freqs.weight' must hold {pairs} factors (one per rotating "
                    f"pair) and come without `{arch}.rope.scaling.type`; got {len(factors)} "
                    f"with scaling {kind!r}"
                )
            try:
                scaling = FrequencyFactors(factors)
            except (TypeError, ValueError) as e:
                raise ValueError(f"tensor 'rope_freqs.weight': {e}") from None
        return scaling

    found = GgufRope(arch=arch, kind=kind, pairs=pairs, read=read)
    scaling = read(None) if family.gguf_rope is None else family.gguf_rope(fields, metadata, found)
    return RopeConfig(base=float(base or 10000.0), fraction=fraction, scaling=scaling)


def _gguf_yarn(fields: Mapping[str, Any], metadata: Mapping[str, Any], arch: str) -> YarnScaling:
    """YaRN as llama.cpp applies it to a GGUF file (gpt-oss): ``rope.scaling.factor``,
    ``rope.scaling.original_context_length`` (else ``context_length``),
    ``rope.scaling.yarn_beta_fast`` / ``yarn_beta_slow`` (32 and 1 when absent), the ramp's
    ends rounded to whole dims (ggml's ``rope_yarn_corr_dims``), and the attention factor
    ``0.1 ln(factor) + 1`` times ``rope.scaling.attn_factor`` (1 when absent). The keys that
    make llama.cpp mix or scale otherwise (``yarn_ext_factor``, ``yarn_attn_factor``,
    ``yarn_log_multiplier``) are refused, naming the key."""
    prefix = f"{arch}.rope.scaling."
    for name in ("yarn_ext_factor", "yarn_attn_factor", "yarn_log_multiplier"):
        if metadata.get(prefix + name) is not None:
            raise ValueError(f"`{prefix}{name}` is not supported for GGUF files with YaRN yet")
    factor = gguf_positive(metadata, prefix + "factor", None)
    return YarnScaling(
        factor=factor,
        original_max_position_embeddings=gguf_yarn_context(fields, metadata, prefix),
        beta_fast=gguf_positive(metadata, prefix + "yarn_beta_fast", 32.0),
        beta_slow=gguf_positive(metadata, prefix + "yarn_beta_slow", 1.0),
        attention_factor=yarn_mscale(factor) * gguf_positive(metadata, prefix + "attn_factor", 1.0),
        truncate=True,
    )
