"""The shared parts of every family page: the :class:`Family` type, the names the
loaders match weights by, and the small readers the pages' hooks share."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from attnlab.models.decoder import DecoderConfig
from attnlab.models.encoder import EncoderConfig
from attnlab.models.encoder_decoder import EncoderDecoderConfig
from attnlab.models.moe import MoEConfig
from attnlab.rope import RopeConfig, RopeScaling

__all__ = [
    "ACTIVATION_NAMES",
    "MAX_EXPERTS",
    "SIZES",
    "Family",
    "GgufRope",
    "GgufRopeRule",
    "Hook",
    "Source",
    "WeightRule",
    "WeightTable",
]

# (source module pattern, our module pattern, transform): what the loader matches names by
WeightRule = tuple[str, str, str]
# our module pattern -> (source module pattern(s) "a|b", transform): what a page writes
WeightTable = Mapping[str, tuple[str, str]]
# where a config comes from: a Hugging Face config.json or GGUF metadata
Source = Literal["hf", "gguf"]
# hook(fields, config, source): the family's own rules, in place (see the module docstring)
Hook = Callable[[dict[str, Any], Mapping[str, Any], Source], None]


@dataclass(frozen=True)
class GgufRope:
    """A GGUF file's RoPE as the loader's generic reading sees it, for a page's own rule.

    Attributes:
        arch: the file's ``general.architecture``.
        kind: its ``{arch}.rope.scaling.type`` (``"none"`` when absent).
        pairs: the rotating pairs per head.
        read: the generic reading of the scaling (``rope.scaling.*``: none, linear, yarn;
            the ``rope_freqs`` tensor), with the page's own YaRN when it passes one.
    """

    arch: str
    kind: str
    pairs: int
    read: Callable[[Callable[[], RopeScaling] | None], RopeScaling | None]


# gguf_rope(fields, metadata, found): a page's own reading of a GGUF file's RoPE scaling
# (it may set fields, such as the score scale that goes with it); raises ValueError
GgufRopeRule = Callable[[dict[str, Any], Mapping[str, Any], GgufRope], RopeScaling | None]

# Hugging Face activation names -> attnlab's.
ACTIVATION_NAMES = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_tanh": "gelu_tanh",
    "relu": "relu",
    # T5's `feed_forward_proj` when `dense_act_fn` is absent (older configs)
    "gated-gelu": "gelu_tanh",
    "gated-silu": "silu",
    "gated-relu": "relu",
}

# The sizes every file must give (each family adds its own).
SIZES = ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size")


@dataclass(frozen=True)
class Family:
    """One model family, as data (see the module docstring for every field)."""

    name: str
    kind: Literal["decoder", "encoder", "encoder-decoder"]
    fixed: Mapping[str, Any]
    keys: Mapping[str, tuple[str, ...]]
    defaults: Mapping[str, Any] = field(default_factory=dict)
    required: tuple[str, ...] = SIZES
    refuse: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)
    weights: WeightTable = field(default_factory=dict)
    prefixes: tuple[str, ...] = ()
    ignore: tuple[str, ...] = ()
    gguf_keys: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    gguf_defaults: Mapping[str, Any] = field(default_factory=dict)
    gguf_weights: WeightTable = field(default_factory=dict)
    hook: Hook | None = None
    gguf_arch: str | None = None
    model_types: tuple[str, ...] = ()
    text_config: str | None = None
    mtp_layers: str | None = None
    gguf_rope: GgufRopeRule | None = None
    gguf_tensors: Mapping[str, str] = field(default_factory=dict)
    gguf_variant_key: str | None = None
    gguf_note: str | None = None

    @property
    def config_class(
        self,
    ) -> type[DecoderConfig] | type[EncoderConfig] | type[EncoderDecoderConfig]:
        """:class:`DecoderConfig`, :class:`EncoderConfig` or :class:`EncoderDecoderConfig`."""
        if self.kind == "encoder-decoder":
            return EncoderDecoderConfig
        return DecoderConfig if self.kind == "decoder" else EncoderConfig

    def field_names(self) -> set[str]:
        """The config fields this family's config class has."""
        return {f.name for f in dataclasses.fields(self.config_class)}

    def key_map(self, source: Source) -> dict[str, tuple[str, ...]]:
        """Where each field is read for ``source`` (GGUF: ``{arch}`` filled in)."""
        if source == "hf":
            return dict(self.keys)
        return {
            name: tuple(k.replace("{arch}", self.arch) for k in candidates)
            for name, candidates in self.gguf_keys.items()
        }

    @property
    def arch(self) -> str:
        """The GGUF ``general.architecture`` of this family."""
        return self.gguf_arch or self.name

    def defaults_for(self, source: Source) -> dict[str, Any]:
        """The defaults for ``source`` (GGUF: llama.cpp's assumptions over ``defaults``)."""
        return {**self.defaults, **self.gguf_defaults} if source == "gguf" else dict(self.defaults)

    def weight_rules(self, source: Source) -> tuple[WeightRule, ...]:
        """The weight table for ``source`` as ``(source, ours, transform)`` rules."""
        table = self.weights if source == "hf" else self.gguf_weights
        return tuple(
            (src, ours, transform)
            for ours, (sources, transform) in table.items()
            for src in sources.split("|")
        )


def same_as(name: str) -> Callable[[dict[str, Any]], Any]:
    return lambda fields: fields[name]


def without(table: WeightTable, *targets: str) -> dict[str, tuple[str, str]]:
    """``table`` less the entries for ``targets`` (each must be there: a typo fails)."""
    missing = [t for t in targets if t not in table]
    assert not missing, f"no weight rule for {missing}"
    return {k: v for k, v in table.items() if k not in targets}


def pop_flag(fields: dict[str, Any], key: str, default: bool) -> bool:
    """Pop a true/false option."""
    value = fields.pop(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"`{key}` must be true or false, got {value!r}")
    return value


def alternating(layers: int, period: int) -> list[str]:
    """transformers' and llama.cpp's local/global pattern: every ``period``-th layer
    global, the others local (Gemma 2: period 2, layer 0 local; Gemma 3: 5 local, 1 global)."""
    return ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(layers)]


def pop_layer_flags(fields: dict[str, Any], key: str) -> tuple[bool, ...] | None:
    """Pop a list of one 0/1 (or true/false) per layer, checked, as booleans."""
    value = fields.pop(key, None)
    if value is None:
        return None
    layers = fields["num_layers"]
    if (
        not isinstance(value, list)
        or len(value) != layers
        or any(v not in (0, 1) or isinstance(v, float) for v in value)
    ):
        raise ValueError(f"`{key}` must list one 0 or 1 per layer ({layers}), got {value!r}")
    return tuple(bool(v) for v in value)


def pop_period(fields: dict[str, Any], key: str) -> int:
    """Pop an every-n-th-layer period (an integer >= 1)."""
    value = fields.pop(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{key}` must be an integer >= 1, got {value!r}")
    return value


MAX_EXPERTS = 1 << 12


def pop_count(fields: dict[str, Any], key: str, *, least: int = 1) -> int:
    """Pop an integer option that must be at least ``least``."""
    value = fields.pop(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"`{key}` must be an integer >= {least}, got {value!r}")
    return value


def moe_config(
    fields: dict[str, Any],
    *,
    size_key: str = "",
    size: int | None = None,
    renormalize: bool | str,
    router: str = "softmax",
    shared_size: int | None = None,
    weight_inputs: bool = False,
) -> MoEConfig:
    """The experts' configuration from ``num_local_experts``, ``num_experts_per_tok`` and
    the expert width ``size`` or the one under ``size_key`` (popped); ``renormalize`` a
    fixed rule or the key of a true/false option (Qwen3-MoE's ``norm_topk_prob``)."""
    experts = pop_count(fields, "num_local_experts")
    if experts > MAX_EXPERTS:  # an untrusted file must not make us allocate them
        raise ValueError(f"`num_local_experts` = {experts} is more than {MAX_EXPERTS}")
    top_k = pop_count(fields, "num_experts_per_tok")
    if top_k > experts:
        raise ValueError(
            f"`num_experts_per_tok` = {top_k} chooses more experts than exist "
            f"(`num_local_experts` = {experts})"
        )
    if size is None:
        size = fields["intermediate_size"] if size_key == "intermediate_size" else None
        size = pop_count(fields, size_key) if size is None else size
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= 1 << 18:
        raise ValueError(f"the experts' width must be an integer in 1..{1 << 18}, got {size!r}")
    norm = renormalize if isinstance(renormalize, bool) else pop_flag(fields, renormalize, False)
    return MoEConfig(
        experts,
        top_k,
        size,
        router=router,  # type: ignore[arg-type]
        renormalize=norm,
        shared_size=shared_size,
        weight_inputs=weight_inputs,
    )


def pop_positive(fields: dict[str, Any], key: str) -> float:
    """Pop a finite number > 0."""
    value = fields.pop(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"`{key}` must be a finite number > 0, got {value!r}")
    return float(value)


def partial_rope(
    fields: dict[str, Any],
    config: Mapping[str, Any],
    *,
    base_key: str | None = None,
    fraction_key: str | None = None,
    fraction: float = 0.25,
) -> None:
    """RoPE from ``config.json`` for a family whose rotated fraction defaults to
    ``fraction`` (not 1) and whose base and fraction may have their own names; the keys
    of ``rope_parameters`` / ``rope_scaling`` come first."""
    params = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    base = params.get("rope_theta", config.get("rope_theta"))
    if base is None and base_key is not None:
        base = config.get(base_key)
    part = params.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if part is None and fraction_key is not None:
        part = config.get(fraction_key)
    params["rope_theta"] = 10_000.0 if base is None else base
    params["partial_rotary_factor"] = fraction if part is None else part
    fields["rope"] = RopeConfig.from_hf_config({**config, "rope_parameters": params})


def pop_option(fields: dict[str, Any], config: Mapping[str, Any], key: str, source: Source) -> Any:
    """An option whose explicit ``null`` in ``config.json`` means "none" (not the default,
    which the loader fills for a null): ``q_lora_rank``, ``n_group``."""
    value = fields.pop(key, None)
    if source == "hf" and key in config and config[key] is None:
        return None
    return value


def gguf_positive(metadata: Mapping[str, Any], key: str, default: float | None) -> float:
    """The finite number > 0 at a GGUF ``key`` (``default`` when absent; None: required)."""
    value = metadata.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"`{key}` must be a finite number > 0, got {value!r}")
    return float(value)


def gguf_yarn_context(fields: Mapping[str, Any], metadata: Mapping[str, Any], prefix: str) -> int:
    """YaRN's original context: ``rope.scaling.original_context_length``, else the file's
    ``context_length`` (llama.cpp's ``n_ctx_orig_yarn``)."""
    orig = metadata.get(prefix + "original_context_length", fields.get("context_length"))
    if isinstance(orig, bool) or not isinstance(orig, int) or orig <= 0:
        raise ValueError(f"`{prefix}original_context_length` must be an integer > 0, got {orig!r}")
    return orig
