"""Model families as data: one page each, read by the one decoder and the one encoder.

A :class:`Family` says, for one ``model_type`` (Hugging Face ``config.json``) or
``general.architecture`` (GGUF), everything attnlab needs to load it (llama.cpp's split:
tables for the names and hyperparameters, a little code per architecture):

- ``fixed``: the architecture options that never vary in this family (norm kind and
  placement, MLP kind, residual style, position scheme, biases), as fields of
  :class:`attnlab.models.decoder.DecoderConfig` / :class:`attnlab.models.encoder.EncoderConfig`;
- ``keys``: where each remaining field is read in ``config.json`` (the first key present
  wins; ``a.b`` reads a nested dict) and ``defaults`` when none is (a callable default gets
  the fields read so far); a name that is not a config field is an *option* that only the
  family's ``hook`` reads (and removes);
- ``required``: the fields a file must give (every other field has a default);
- ``refuse``: config keys whose value this family cannot express unless it is one of the
  given values (the loader then names the field);
- ``weights``: our module (``{i}`` for the layer index) -> ``(source module, transform)``;
  ``.weight``/``.bias`` follow the module name, ``a|b`` accepts either source name. Keyed
  by target, so a family that differs from another overrides or drops named entries.
  Transforms: ``""`` as is, ``"T"`` transpose (GPT-2's ``Conv1D``), ``"qkv"`` split a fused
  query/key/value projection into ours, ``"T+qkv"`` both, ``"qkv_heads"`` split one
  interleaved per head (GPT-NeoX's ``(H, 3, D)`` rows), ``"gate_up"`` split a fused
  gate/up projection (Phi-3), ``"plus1"`` add 1 (Gemma's RMSNorm multiplies by
  ``1 + weight``), ``"rope_q"``/``"rope_k"`` undo llama.cpp's q/k row permutation,
  ``"Tx"`` swap the last two dims of stacked experts, ``"gate_up_pairs"`` split stacked
  experts' gate/up rows that alternate (gpt-oss: gate the even ones); the targets ``{qkv}``
  and ``{gate_up}`` stand for the pieces; a target ending in ``.weight``, ``.bias`` or
  ``.sinks`` names the parameter itself (a bare tensor such as gpt-oss's
  ``down_proj_bias``);
- ``prefixes`` stripped from source names and ``ignore`` (regexes) for tensors that carry
  nothing the model uses (a pooler, a masked-LM head, buffers);
- the same for GGUF: ``gguf_keys`` (``{arch}`` is the architecture), ``gguf_defaults``
  (what llama.cpp's loader assumes for this architecture where the file says nothing, over
  ``defaults``) and ``gguf_weights`` under llama.cpp's tensor names (empty: no GGUF);
- ``hook``: the family's own code, ``hook(fields, config, source)``: it turns the options
  into config fields (Qwen's window rule, Gemma's local/global layers, GPT-2's score
  switches), in place, and raises ``ValueError`` naming the key it cannot accept;
- ``gguf_arch``: llama.cpp's ``general.architecture`` when it is not ``name``
  (``qwen3moe``, GPT-NeoX's ``gptneox``);
- ``model_types``: more ``model_type`` names for the same page (``gemma3_text``), and
  ``text_config``: the ``config.json`` key that holds the text model's settings in a
  multimodal checkpoint;
- ``mtp_layers``: the ``config.json`` key counting the multi-token-prediction layers a
  checkpoint stores after the model's own (DeepSeek-V3's ``num_nextn_predict_layers``):
  the next-token forward does not use them, so their tensors are left out, and the load
  says so (:attr:`attnlab.models.decoder.Decoder.load_notes`).

A new family is a page here, not a module.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from attnlab.latent import MLAConfig
from attnlab.models.decoder import DecoderConfig
from attnlab.models.encoder import EncoderConfig
from attnlab.models.encoder_decoder import EncoderDecoderConfig
from attnlab.models.moe import MoEConfig
from attnlab.rope import RopeConfig

__all__ = [
    "ACTIVATION_NAMES",
    "FAMILIES",
    "Family",
    "Source",
    "WeightRule",
    "WeightTable",
    "family_for",
]

# (source module pattern, our module pattern, transform): what the loader matches names by
WeightRule = tuple[str, str, str]
# our module pattern -> (source module pattern(s) "a|b", transform): what a page writes
WeightTable = Mapping[str, tuple[str, str]]
# where a config comes from: a Hugging Face config.json or GGUF metadata
Source = Literal["hf", "gguf"]
# hook(fields, config, source): the family's own rules, in place (see the module docstring)
Hook = Callable[[dict[str, Any], Mapping[str, Any], Source], None]

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
_SIZES = ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size")


@dataclass(frozen=True)
class Family:
    """One model family, as data (see the module docstring for every field)."""

    name: str
    kind: Literal["decoder", "encoder", "encoder-decoder"]
    fixed: Mapping[str, Any]
    keys: Mapping[str, tuple[str, ...]]
    defaults: Mapping[str, Any] = field(default_factory=dict)
    required: tuple[str, ...] = _SIZES
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


def _same_as(name: str) -> Callable[[dict[str, Any]], Any]:
    return lambda fields: fields[name]


def _without(table: WeightTable, *targets: str) -> dict[str, tuple[str, str]]:
    """``table`` less the entries for ``targets`` (each must be there: a typo fails)."""
    missing = [t for t in targets if t not in table]
    assert not missing, f"no weight rule for {missing}"
    return {k: v for k, v in table.items() if k not in targets}


def _flag(fields: dict[str, Any], key: str, default: bool) -> bool:
    """Pop a true/false option."""
    value = fields.pop(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"`{key}` must be true or false, got {value!r}")
    return value


def _alternating(layers: int, period: int) -> list[str]:
    """transformers' and llama.cpp's local/global pattern: every ``period``-th layer
    global, the others local (Gemma 2: period 2, layer 0 local; Gemma 3: 5 local, 1 global)."""
    return ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(layers)]


def _pre_attn_scalar(fields: dict[str, Any]) -> None:
    """Gemma's ``query_pre_attn_scalar`` as the score scale ``scalar ** -0.5``."""
    scalar = fields.pop("query_pre_attn_scalar", None)
    if scalar is None:
        return
    if isinstance(scalar, bool) or not isinstance(scalar, (int, float)) or not scalar > 0:
        raise ValueError(f"`query_pre_attn_scalar` must be > 0, got {scalar!r}")
    fields["attn_scale"] = float(scalar) ** -0.5


# --------------------------------------------------------------------------- decoders

# Hugging Face Llama-layout names (Llama, Mistral, Qwen2, ...), after "model." is stripped.
_LLAMA_WEIGHTS: WeightTable = {
    "tok_embeddings": ("embed_tokens", ""),
    "norm": ("norm", ""),
    "lm_head": ("lm_head", ""),
    "blocks.{i}.attn_norm": ("layers.{i}.input_layernorm", ""),
    "blocks.{i}.attention.W_query": ("layers.{i}.self_attn.q_proj", ""),
    "blocks.{i}.attention.W_key": ("layers.{i}.self_attn.k_proj", ""),
    "blocks.{i}.attention.W_value": ("layers.{i}.self_attn.v_proj", ""),
    "blocks.{i}.attention.out_proj": ("layers.{i}.self_attn.o_proj", ""),
    "blocks.{i}.mlp_norm": ("layers.{i}.post_attention_layernorm", ""),
    "blocks.{i}.mlp.gate": ("layers.{i}.mlp.gate_proj", ""),
    "blocks.{i}.mlp.up": ("layers.{i}.mlp.up_proj", ""),
    "blocks.{i}.mlp.down": ("layers.{i}.mlp.down_proj", ""),
}
_QK_NORM_WEIGHTS: WeightTable = {
    "blocks.{i}.attention.q_norm": ("layers.{i}.self_attn.q_norm", ""),
    "blocks.{i}.attention.k_norm": ("layers.{i}.self_attn.k_norm", ""),
}

# llama.cpp's names for the same layout (llama, qwen2, qwen3, ... in GGUF).
_LLAMA_GGUF: WeightTable = {
    "tok_embeddings": ("token_embd", ""),
    "norm": ("output_norm", ""),
    "lm_head": ("output", ""),
    "blocks.{i}.attn_norm": ("blk.{i}.attn_norm", ""),
    "blocks.{i}.attention.W_query": ("blk.{i}.attn_q", ""),
    "blocks.{i}.attention.W_key": ("blk.{i}.attn_k", ""),
    "blocks.{i}.attention.W_value": ("blk.{i}.attn_v", ""),
    "blocks.{i}.attention.out_proj": ("blk.{i}.attn_output", ""),
    "blocks.{i}.mlp_norm": ("blk.{i}.ffn_norm", ""),
    "blocks.{i}.mlp.gate": ("blk.{i}.ffn_gate", ""),
    "blocks.{i}.mlp.up": ("blk.{i}.ffn_up", ""),
    "blocks.{i}.mlp.down": ("blk.{i}.ffn_down", ""),
}
_QK_NORM_GGUF: WeightTable = {
    "blocks.{i}.attention.q_norm": ("blk.{i}.attn_q_norm", ""),
    "blocks.{i}.attention.k_norm": ("blk.{i}.attn_k_norm", ""),
}

_LLAMA_KEYS: dict[str, tuple[str, ...]] = {
    "vocab_size": ("vocab_size",),
    "hidden_size": ("hidden_size",),
    "num_layers": ("num_hidden_layers",),
    "num_heads": ("num_attention_heads",),
    "num_kv_heads": ("num_key_value_heads",),
    "intermediate_size": ("intermediate_size",),
    "context_length": ("max_position_embeddings",),
    "norm_eps": ("rms_norm_eps",),
    "tie_embeddings": ("tie_word_embeddings",),
    "activation": ("hidden_act",),
    "head_dim": ("head_dim",),
    "sliding_window": ("sliding_window",),
}
_LLAMA_DEFAULTS: dict[str, Any] = {
    "num_kv_heads": _same_as("num_heads"),
    "tie_embeddings": False,
    "activation": "silu",
}
_ATTENTION_BIAS_KEYS = {"qkv_bias": ("attention_bias",), "out_bias": ("attention_bias",)}
_NO_BIAS = {"qkv_bias": False, "out_bias": False}
# Every architecture's keys as llama.cpp writes them. The head dims (key_length,
# value_length) are written by its converters whenever `head_dim` is in config.json, for
# every architecture; `value_head_dim` is checked against the head dim by the loader.
_GGUF_KEYS: dict[str, tuple[str, ...]] = {
    "hidden_size": ("{arch}.embedding_length",),
    "num_layers": ("{arch}.block_count",),
    "num_heads": ("{arch}.attention.head_count",),
    "num_kv_heads": ("{arch}.attention.head_count_kv",),
    "intermediate_size": ("{arch}.feed_forward_length",),
    "context_length": ("{arch}.context_length",),
    "norm_eps": ("{arch}.attention.layer_norm_rms_epsilon", "{arch}.attention.layer_norm_epsilon"),
    "head_dim": ("{arch}.attention.key_length",),
    "value_head_dim": ("{arch}.attention.value_length",),
    "rope_theta": ("{arch}.rope.freq_base",),
    "rope_dims": ("{arch}.rope.dimension_count",),  # partial rotary: dims that rotate per head
    "vocab_size": ("{arch}.vocab_size",),
    # 0 or absent: no window (llama.cpp's converters write it for Mistral-style models only
    # where the architecture has it, e.g. phi3; the llama converter does not)
    "sliding_window": ("{arch}.attention.sliding_window",),
}
# Qwen2/Qwen3 windows apply to some layers only; llama.cpp ignores the key for them.
_GGUF_KEYS_NO_WINDOW = {k: v for k, v in _GGUF_KEYS.items() if k != "sliding_window"}


def _qwen_windows(fields: dict[str, Any], config: Mapping[str, Any], source: Source) -> None:
    """Qwen2/Qwen3's window rule: ``sliding_window`` counts only with
    ``use_sliding_window``, and then (unless ``layer_types`` says it per layer) on the
    layers from ``max_window_layers`` on, as transformers builds its ``layer_types``.
    llama.cpp ignores windows for these architectures (its GGUF keys read none)."""
    use = _flag(fields, "use_sliding_window", False)
    first = fields.pop("max_window_layers", 28)  # transformers' default
    if isinstance(first, bool) or not isinstance(first, int) or first < 0:
        raise ValueError(f"`max_window_layers` must be an integer >= 0, got {first!r}")
    if source == "gguf":
        return
    if not use:
        fields.pop("sliding_window", None)
    window, types = fields.get("sliding_window"), fields.get("layer_types")
    if types is None and window is not None:
        fields["layer_types"] = [
            "sliding_attention" if i >= first else "full_attention"
            for i in range(fields["num_layers"])
        ]
    elif window is None and isinstance(types, list) and "sliding_attention" in types:
        # transformers: the sliding layers have no window when use_sliding_window is off
        fields["layer_types"] = ["full_attention"] * len(types)


_QWEN_KEYS: dict[str, tuple[str, ...]] = {
    **_LLAMA_KEYS,
    "layer_types": ("layer_types",),
    "use_sliding_window": ("use_sliding_window",),
    "max_window_layers": ("max_window_layers",),
}

LLAMA = Family(
    name="llama",
    kind="decoder",
    fixed={"norm": "rms", "mlp": "gated", "positions": "rope", "family": "llama"},
    keys={**_LLAMA_KEYS, **_ATTENTION_BIAS_KEYS, "mlp_bias": ("mlp_bias",)},
    defaults={**_LLAMA_DEFAULTS, **_NO_BIAS, "mlp_bias": False},
    refuse={"pretraining_tp": (None, 1)},
    weights=_LLAMA_WEIGHTS,
    prefixes=("model.",),
    ignore=(r".*rotary_emb\.inv_freq$",),
    gguf_keys=_GGUF_KEYS,
    # llama.cpp's converter permutes the q/k rows of the "llama" architecture (only).
    gguf_weights={
        **_LLAMA_GGUF,
        "blocks.{i}.attention.W_query": ("blk.{i}.attn_q", "rope_q"),
        "blocks.{i}.attention.W_key": ("blk.{i}.attn_k", "rope_k"),
    },
)

MISTRAL = dataclasses.replace(
    LLAMA,
    name="mistral",
    fixed={**LLAMA.fixed, "family": "mistral"},
    keys=_LLAMA_KEYS,
    defaults=_LLAMA_DEFAULTS,
    refuse={},
    gguf_weights={},  # llama.cpp writes Mistral files as architecture "llama"
)

QWEN2 = dataclasses.replace(
    LLAMA,
    name="qwen2",
    fixed={**LLAMA.fixed, "family": "qwen2", "qkv_bias": True, "out_bias": False},
    keys=_QWEN_KEYS,
    defaults=_LLAMA_DEFAULTS,
    refuse={},
    gguf_keys=_GGUF_KEYS_NO_WINDOW,
    gguf_weights=_LLAMA_GGUF,  # the qwen2 converter does not permute q/k
    hook=_qwen_windows,
)

QWEN3 = dataclasses.replace(
    QWEN2,
    name="qwen3",
    fixed={**LLAMA.fixed, "family": "qwen3", "qk_norm": "rms_head"},
    keys={**_QWEN_KEYS, **_ATTENTION_BIAS_KEYS},
    defaults={**_LLAMA_DEFAULTS, **_NO_BIAS},
    weights={**_LLAMA_WEIGHTS, **_QK_NORM_WEIGHTS},
    gguf_weights={**_LLAMA_GGUF, **_QK_NORM_GGUF},  # the qwen3 converter does not permute q/k
)

OLMO2 = dataclasses.replace(
    LLAMA,
    name="olmo2",
    fixed={**LLAMA.fixed, "family": "olmo2", "norm_placement": "post", "qk_norm": "rms_all"},
    keys={**_LLAMA_KEYS, **_ATTENTION_BIAS_KEYS},
    defaults={**_LLAMA_DEFAULTS, **_NO_BIAS},
    # post-norm: the norms after attention and after the MLP
    weights={
        **_LLAMA_WEIGHTS,
        **_QK_NORM_WEIGHTS,
        "blocks.{i}.attn_norm": ("layers.{i}.post_attention_layernorm", ""),
        "blocks.{i}.mlp_norm": ("layers.{i}.post_feedforward_layernorm", ""),
    },
    # llama.cpp writes a window only for OLMo 3 (with a per-layer pattern): not expressed
    refuse={"olmo2.attention.sliding_window": (None,)},
    gguf_keys=_GGUF_KEYS_NO_WINDOW,
    gguf_weights={
        **_LLAMA_GGUF,
        **_QK_NORM_GGUF,
        "blocks.{i}.attn_norm": ("blk.{i}.post_attention_norm", ""),
        "blocks.{i}.mlp_norm": ("blk.{i}.post_ffw_norm", ""),
    },
)


def _per_layer_flags(fields: dict[str, Any], key: str) -> tuple[bool, ...] | None:
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


def _period(fields: dict[str, Any], key: str) -> int:
    """Pop an every-n-th-layer period (an integer >= 1)."""
    value = fields.pop(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{key}` must be an integer >= 1, got {value!r}")
    return value


def _smollm3(fields: dict[str, Any], config: Mapping[str, Any], source: Source) -> None:
    """SmolLM3's NoPE layers and windows, as transformers' ``SmolLM3Config`` derives them.

    ``no_rope_layers`` holds one 1 (the layer rotates) or 0 (no rotary: NoPE) per layer;
    without it every ``no_rope_layer_interval``-th layer (default 4) is NoPE. A window
    counts only with ``use_sliding_window``, and then (unless ``layer_types`` says it per
    layer) on the NoPE layers.
    """
    period = _period(fields, "no_rope_layer_interval")
    rotary = _per_layer_flags(fields, "no_rope_layers")
    if rotary is None:
        rotary = tuple(bool((i + 1) % period) for i in range(fields["num_layers"]))
    if not all(rotary):
        fields["layer_rotary"] = rotary
    if not _flag(fields, "use_sliding_window", False):
        fields.pop("sliding_window", None)
        fields["layer_types"] = None
    elif fields.get("layer_types") is None and fields.get("sliding_window") is not None:
        fields["layer_types"] = ["full_attention" if r else "sliding_attention" for r in rotary]


SMOLLM3 = dataclasses.replace(
    LLAMA,
    name="smollm3",
    fixed={**LLAMA.fixed, "family": "smollm3"},
    keys={
        **_LLAMA_KEYS,
        **_ATTENTION_BIAS_KEYS,
        "mlp_bias": ("mlp_bias",),
        "layer_types": ("layer_types",),
        "use_sliding_window": ("use_sliding_window",),
        "no_rope_layers": ("no_rope_layers",),
        "no_rope_layer_interval": ("no_rope_layer_interval",),
    },
    defaults={
        **_LLAMA_DEFAULTS,
        **_NO_BIAS,
        "mlp_bias": False,
        "tie_embeddings": True,
        "no_rope_layer_interval": 4,
    },
    refuse={},
    # llama.cpp's smollm3: every 4th layer NoPE (fixed), no window; q/k rows permuted as
    # for "llama" (its converter is the llama one)
    gguf_keys=_GGUF_KEYS_NO_WINDOW,
    gguf_defaults={"no_rope_layer_interval": 4},
    gguf_weights=LLAMA.gguf_weights,
    hook=_smollm3,
)


MAX_EXPERTS = 1 << 12
_DENSE_MLP = ("blocks.{i}.mlp.gate", "blocks.{i}.mlp.up", "blocks.{i}.mlp.down")
_EXPERT_KEYS: dict[str, tuple[str, ...]] = {
    "num_local_experts": ("num_local_experts", "num_experts"),
    "num_experts_per_tok": ("num_experts_per_tok",),
}


def _llama4(fields: dict[str, Any], config: Mapping[str, Any], source: Source) -> None:
    """Llama 4's text layers, as transformers' ``Llama4TextConfig`` derives them.

    NoPE layers from ``no_rope_layers`` (1 = rotates; empty or absent: every
    ``no_rope_layer_interval``-th layer, default 4, is NoPE). The rotary layers attend in
    chunks of ``attention_chunk_size`` (``layer_types`` ``"chunked_attention"`` where it is
    given) and normalise queries and keys with a weightless L2 norm (``use_qk_norm``); the
    NoPE layers sharpen their queries with ``attn_temperature_tuning`` (``floor_scale``,
    ``attn_scale``). RoPE rotates interleaved pairs (transformers' complex product).
    The layers in ``moe_layers`` (else every ``interleave_moe_layer_step``-th) route to
    experts of width ``intermediate_size`` (sigmoid router, the weight scaling the expert's
    input, a shared expert of the same width); the others run the dense MLP of
    ``intermediate_size_mlp``.
    """
    layers = fields["num_layers"]
    if source == "gguf":
        _llama4_gguf(fields, config)
    period = _period(fields, "no_rope_layer_interval")
    if fields.get("no_rope_layers") == []:
        fields.pop("no_rope_layers")
    rotary = _per_layer_flags(fields, "no_rope_layers")
    if rotary is None:
        rotary = tuple(bool((i + 1) % period) for i in range(layers))
    fields["layer_rotary"] = rotary
    chunk = fields.pop("attention_chunk_size")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"`attention_chunk_size` must be an integer >= 1 or null, got {chunk!r}")
    types = fields.pop("layer_types", None)
    if types is None:
        types = ["chunked_attention" if r and chunk else "full_attention" for r in rotary]
    if not isinstance(types, list) or len(types) != layers:
        raise ValueError(f"`layer_types` must list one type per layer ({layers}), got {types!r}")
    if any(t not in ("chunked_attention", "full_attention") for t in types):
        raise ValueError(f"`layer_types` holds an unsupported type: {sorted(set(map(str, types)))}")
    if "chunked_attention" in types and chunk is None:
        raise ValueError("`layer_types` has chunked layers but `attention_chunk_size` is null")
    fields["layer_chunks"] = tuple(chunk if t == "chunked_attention" else None for t in types)
    fields["layer_types"] = None
    if _flag(fields, "use_qk_norm", True):
        fields["qk_norm"] = "l2_head"
        fields["layer_qk_norm"] = rotary
    if _flag(fields, "attn_temperature_tuning", True):
        floor_scale, scale = fields.pop("temperature_floor"), fields.pop("temperature_scale")
        for key, value in (("floor_scale", floor_scale), ("attn_scale", scale)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"`{key}` must be a number, got {value!r}")
        if not floor_scale > 0:
            raise ValueError(f"`floor_scale` must be > 0, got {floor_scale!r}")
        fields["attn_temperature"] = (float(floor_scale), float(scale))
    else:
        fields.pop("temperature_floor")
        fields.pop("temperature_scale")
    step = fields.pop("interleave_moe_layer_step")
    moe = fields.pop("moe_layers", None)
    if moe is None:
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(f"`interleave_moe_layer_step` must be an integer, got {step!r}")
        moe = list(range(step - 1, layers, step)) if step > 0 else []
    if not isinstance(moe, list) or any(
        isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers for i in moe
    ):
        raise ValueError(f"`moe_layers` must list layer indices 0..{layers - 1}, got {moe!r}")
    # the experts' width (the dense MLP's is `intermediate_size_mlp`)
    width = fields.pop("expert_size") if source == "gguf" else config.get("intermediate_size", 8192)
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"`intermediate_size` must be an integer >= 1, got {width!r}")
    experts = _experts(
        fields,
        size=width,
        renormalize=False,
        router="sigmoid",
        shared_size=width,
        weight_inputs=True,
    )
    if moe:
        fields["moe"] = experts
        fields["layer_moe"] = tuple(i in moe for i in range(layers))
    if source == "gguf":  # the file's rope keys are read by the loader, pairs interleaved
        fields["rope_interleaved"] = True
        return
    try:
        fields["rope"] = dataclasses.replace(RopeConfig.from_hf_config(config), interleaved=True)
    except (ValueError, TypeError) as e:
        raise ValueError(f"rope settings: {e}") from None


def _llama4_gguf(fields: dict[str, Any], metadata: Mapping[str, Any]) -> None:
    """What llama.cpp's ``llama4`` loader fixes rather than reads: chunks of 8192 on three
    layers in four, every 4th layer NoPE with temperature tuning (floor 8192, scale 0.1:
    ``gguf_defaults``), QK-norm on the rotary layers unless there are 128 experts (its
    Maverick rule). The keys that would change that are refused, naming the key."""
    window = metadata.get("llama4.attention.sliding_window")
    if window == 0:  # llama.cpp: no chunks, rotary on every layer but the last (MobileLLM)
        raise ValueError(
            "`llama4.attention.sliding_window` = 0 (no chunked attention) is not supported yet"
        )
    for key in ("llama4.attention.sliding_window_pattern", "llama4.rope.freq_base_swa"):
        if key in metadata and not (
            key.endswith("freq_base_swa") and metadata[key] == metadata.get("llama4.rope.freq_base")
        ):
            raise ValueError(f"`{key}` = {metadata[key]!r} is not supported for llama4 yet")
    fields["use_qk_norm"] = fields.get("num_local_experts") != 128


LLAMA4_TEXT = dataclasses.replace(
    LLAMA,
    name="llama4_text",
    fixed={**LLAMA.fixed, "family": "llama4_text"},
    keys={
        **_LLAMA_KEYS,
        **_ATTENTION_BIAS_KEYS,
        "intermediate_size": ("intermediate_size_mlp",),
        "layer_types": ("layer_types",),
        "no_rope_layers": ("no_rope_layers",),
        "no_rope_layer_interval": ("no_rope_layer_interval",),
        "attention_chunk_size": ("attention_chunk_size",),
        "use_qk_norm": ("use_qk_norm",),
        "attn_temperature_tuning": ("attn_temperature_tuning",),
        # not the score scale: Llama 4's temperature tuning
        "temperature_floor": ("floor_scale",),
        "temperature_scale": ("attn_scale",),
        "moe_layers": ("moe_layers",),
        "interleave_moe_layer_step": ("interleave_moe_layer_step",),
        **_EXPERT_KEYS,
    },
    defaults={
        **_LLAMA_DEFAULTS,
        **_NO_BIAS,
        "intermediate_size": 16384,
        "no_rope_layer_interval": 4,
        "attention_chunk_size": 8192,
        "temperature_floor": 8192,
        "temperature_scale": 0.1,
        "interleave_moe_layer_step": 1,
        "num_local_experts": 16,
        "num_experts_per_tok": 1,
    },
    refuse={},
    weights={
        **_LLAMA_WEIGHTS,
        "blocks.{i}.mlp.gate": ("layers.{i}.feed_forward.gate_proj", ""),
        "blocks.{i}.mlp.up": ("layers.{i}.feed_forward.up_proj", ""),
        "blocks.{i}.mlp.down": ("layers.{i}.feed_forward.down_proj", ""),
        "blocks.{i}.mlp.router": ("layers.{i}.feed_forward.router", ""),
        # transformers' stacked experts, (E, in, out), gate and up side by side
        "blocks.{i}.mlp.experts.{gate_up}": (
            "layers.{i}.feed_forward.experts.gate_up_proj",
            "Tx+gate_up",
        ),
        "blocks.{i}.mlp.experts.down": ("layers.{i}.feed_forward.experts.down_proj", "Tx"),
        **{
            f"blocks.{{i}}.mlp.shared.{w}": (
                f"layers.{{i}}.feed_forward.shared_expert.{w}_proj",
                "",
            )
            for w in ("gate", "up", "down")
        },
    },
    gguf_arch="llama4",
    gguf_keys={
        **_GGUF_KEYS_NO_WINDOW,  # the window key is read by the hook (0: refused)
        "num_local_experts": ("{arch}.expert_count",),
        "num_experts_per_tok": ("{arch}.expert_used_count",),
        "expert_size": ("{arch}.expert_feed_forward_length",),
        "interleave_moe_layer_step": ("{arch}.interleave_moe_layer_step",),
    },
    gguf_defaults={
        "no_rope_layer_interval": 4,
        "attention_chunk_size": 8192,
        "temperature_floor": 8192,
        "temperature_scale": 0.1,
    },
    # llama4's converter does not permute q/k rows; the experts stacked (E, ...)
    gguf_weights={
        **_LLAMA_GGUF,
        "blocks.{i}.mlp.router": ("blk.{i}.ffn_gate_inp", ""),
        "blocks.{i}.mlp.experts.gate": ("blk.{i}.ffn_gate_exps", ""),
        "blocks.{i}.mlp.experts.up": ("blk.{i}.ffn_up_exps", ""),
        "blocks.{i}.mlp.experts.down": ("blk.{i}.ffn_down_exps", ""),
        **{
            f"blocks.{{i}}.mlp.shared.{w}": (f"blk.{{i}}.ffn_{w}_shexp", "")
            for w in ("gate", "up", "down")
        },
    },
    hook=_llama4,
)


def _count(fields: dict[str, Any], key: str, *, least: int = 1) -> int:
    """Pop an integer option that must be at least ``least``."""
    value = fields.pop(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"`{key}` must be an integer >= {least}, got {value!r}")
    return value


def _experts(
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
    experts = _count(fields, "num_local_experts")
    if experts > MAX_EXPERTS:  # an untrusted file must not make us allocate them
        raise ValueError(f"`num_local_experts` = {experts} is more than {MAX_EXPERTS}")
    top_k = _count(fields, "num_experts_per_tok")
    if top_k > experts:
        raise ValueError(
            f"`num_experts_per_tok` = {top_k} chooses more experts than exist "
            f"(`num_local_experts` = {experts})"
        )
    if size is None:
        size = fields["intermediate_size"] if size_key == "intermediate_size" else None
        size = _count(fields, size_key) if size is None else size
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= 1 << 18:
        raise ValueError(f"the experts' width must be an integer in 1..{1 << 18}, got {size!r}")
    norm = renormalize if isinstance(renormalize, bool) else _flag(fields, renormalize, False)
    return MoEConfig(
        experts,
        top_k,
        size,
        router=router,  # type: ignore[arg-type]
        renormalize=norm,
        shared_size=shared_size,
        weight_inputs=weight_inputs,
    )


def _mixtral(fields: dict[str, Any], config: Mapping[str, Any], source: Source) -> None:
    """Mixtral: every layer's feed-forward is the experts (softmax router, top-k weights
    renormalised), each of ``intermediate_size``; ``router_jitter_noise`` only trains."""
    fields["moe"] = _experts(fields, size_key="intermediate_size", renormalize=True)


def _qwen3_moe(fields: dict[str, Any], config: Mapping[str, Any], source: Source) -> None:
    """Qwen3-MoE: Qwen3's attention and window rule; the experts (softmax router,
    ``norm_topk_prob`` renormalises, each of ``moe_intermediate_size``) on every
    ``decoder_sparse_step``-th layer not in ``mlp_only_layers``, the dense MLP of
    ``intermediate_size`` on the others (every layer with 0 experts), as transformers'
    ``Qwen3MoeDecoderLayer`` chooses."""
    _qwen_windows(fields, config, source)
    if fields.get("num_local_experts") == 0:  # transformers: no experts, every layer dense
        for key in (
            "num_local_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "norm_topk_prob",
            "decoder_sparse_step",
            "mlp_only_layers",
        ):
            fields.pop(key, None)
        return
    moe = _experts(fields, size_key="moe_intermediate_size", renormalize="norm_topk_prob")
    step = _count(fields, "decoder_sparse_step")
    dense = fields.pop("mlp_only_layers", None) or []
    layers = fields["num_layers"]
    if not isinstance(dense, list) or any(
        isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers for i in dense
    ):
        raise ValueError(
            f"`mlp_only_layers` must list layer indices 0..{layers - 1}, got {dense!r}"
        )
    fields["moe"] = moe
    fields["layer_moe"] = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))


MIXTRAL = dataclasses.replace(
    LLAMA,
    name="mixtral",
    fixed={**LLAMA.fixed, "family": "mixtral"},
    keys={**_LLAMA_KEYS, **_EXPERT_KEYS},
    defaults={**_LLAMA_DEFAULTS, **_NO_BIAS, "num_local_experts": 8, "num_experts_per_tok": 2},
    refuse={},
    weights={
        **_without(
            _LLAMA_WEIGHTS, "blocks.{i}.mlp.gate", "blocks.{i}.mlp.up", "blocks.{i}.mlp.down"
        ),
        "blocks.{i}.mlp.router": ("layers.{i}.block_sparse_moe.gate", ""),
        # one tensor per expert in the file, stacked into (E, ...) rows
        "blocks.{i}.mlp.experts.gate": ("layers.{i}.block_sparse_moe.experts.{j}.w1", ""),
        "blocks.{i}.mlp.experts.up": ("layers.{i}.block_sparse_moe.experts.{j}.w3", ""),
        "blocks.{i}.mlp.experts.down": ("layers.{i}.block_sparse_moe.experts.{j}.w2", ""),
    },
    # llama.cpp writes Mixtral as architecture "llama" with `llama.expert_count` (read as
    # this page: GGUF_VARIANTS); q/k rows permuted as for llama, the experts stacked
    gguf_arch="llama",
    gguf_keys={
        **_GGUF_KEYS_NO_WINDOW,  # llama.cpp's llama architecture has no window
        "num_local_experts": ("{arch}.expert_count",),
        "num_experts_per_tok": ("{arch}.expert_used_count",),
    },
    gguf_weights={
        **_without(LLAMA.gguf_weights, *_DENSE_MLP),
        "blocks.{i}.mlp.router": ("blk.{i}.ffn_gate_inp", ""),
        "blocks.{i}.mlp.experts.gate": ("blk.{i}.ffn_gate_exps", ""),
        "blocks.{i}.mlp.experts.up": ("blk.{i}.ffn_up_exps", ""),
        "blocks.{i}.mlp.experts.down": ("blk.{i}.ffn_down_exps", ""),
    },
    hook=_mixtral,
)

QWEN3_MOE = dataclasses.replace(
    QWEN3,
    name="qwen3_moe",
    fixed={**QWEN3.fixed, "family": "qwen3_moe"},
    keys={
        **QWEN3.keys,
        **_EXPERT_KEYS,
        "moe_intermediate_size": ("moe_intermediate_size",),
        "norm_topk_prob": ("norm_topk_prob",),
        "decoder_sparse_step": ("decoder_sparse_step",),
        "mlp_only_layers": ("mlp_only_layers",),
    },
    defaults={
        **QWEN3.defaults,
        "num_local_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
    },
    weights={
        **QWEN3.weights,
        "blocks.{i}.mlp.router": ("layers.{i}.mlp.gate", ""),
        "blocks.{i}.mlp.experts.gate": ("layers.{i}.mlp.experts.{j}.gate_proj", ""),
        "blocks.{i}.mlp.experts.up": ("layers.{i}.mlp.experts.{j}.up_proj", ""),
        "blocks.{i}.mlp.experts.down": ("layers.{i}.mlp.experts.{j}.down_proj", ""),
    },
    # llama.cpp's qwen3moe: experts on every layer, the top-k weights always renormalised
    gguf_arch="qwen3moe",
    gguf_keys={
        **_GGUF_KEYS_NO_WINDOW,
        "num_local_experts": ("{arch}.expert_count",),
        "num_experts_per_tok": ("{arch}.expert_used_count",),
        "moe_intermediate_size": ("{arch}.expert_feed_forward_length",),
    },
    gguf_defaults={"norm_topk_prob": True, "decoder_sparse_step": 1},
    gguf_weights={
        **_without(_LLAMA_GGUF, *_DENSE_MLP),
        **_QK_NORM_GGUF,
        "blocks.{i}.mlp.router": ("blk.{i}.ffn_gate_inp", ""),
        "blocks.{i}.mlp.experts.gate": ("blk.{i}.ffn_gate_exps", ""),
        "blocks.{i}.mlp.experts.up": ("blk.{i}.ffn_up_exps", ""),
        "blocks.{i}.mlp.experts.down": ("blk.{i}.ffn_down_exps", ""),
    },
    hook=_qwen3_moe,
)

# --------------------------------------------------------------------------- gpt-oss

# transformers' GptOssConfig defaults where config.json says nothing: YaRN x32 over 4096
# positions with the ramp's ends not rounded (truncate false), base 150000.
_GPT_OSS_ROPE: dict[str, Any] = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
GPT_OSS_ROPE_THETA = 150_000.0
# The clamped SwiGLU's (limit, alpha): transformers' defaults, and what llama.cpp's
# gpt-oss graph hard-codes (its GGUF files carry neither).
GPT_OSS_SWIGLU = (7.0, 1.702)


def _positive_number(fields: dict[str, Any], key: str) -> float:
    """Pop a finite number > 0."""
    value = fields.pop(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"`{key}` must be a finite number > 0, got {value!r}")
    return float(value)


def _gpt_oss(fields: dict[str, Any], config: Mapping[str, Any], source: Source) -> None:
    """gpt-oss, as transformers' ``GptOssConfig`` / ``GptOssModel`` and llama.cpp's
    ``gpt-oss`` architecture build it.

    Attention: a learned sink logit per head joins every softmax (``attn_sinks``), biases on
    the q/k/v/o projections (``attention_bias``), YaRN RoPE, and layers that alternate
    between a window of ``sliding_window`` (128) and the full context: ``layer_types``, else
    the even layers local (transformers' default; llama.cpp's SWA pattern 2). Every layer's
    feed-forward is ``num_local_experts`` experts of width ``intermediate_size``, the top
    ``num_experts_per_tok`` chosen per token by a router with a bias, their weights the
    softmax over the chosen logits (= softmax over all, renormalised over the top k); each
    expert has biases and computes the clamped SwiGLU of ``swiglu_limit`` / ``swiglu_alpha``.
    """
    limit = _positive_number(fields, "swiglu_limit")
    alpha = _positive_number(fields, "swiglu_alpha")
    moe = _experts(fields, size_key="intermediate_size", renormalize=True)
    fields["moe"] = dataclasses.replace(
        moe, router_bias=True, expert_bias=True, clamped_swiglu=(limit, alpha)
    )
    layers = fields["num_layers"]
    if source == "gguf":
        if fields.get("sliding_window") is None:
            raise ValueError(
                "lacks `gpt-oss.attention.sliding_window` (llama.cpp requires it for gpt-oss)"
            )
        fields["layer_types"] = _alternating(layers, 2)
        return
    quant = config.get("quantization_config")
    method = quant.get("quant_method") if isinstance(quant, Mapping) else quant
    if quant is not None and method != "mxfp4":  # the loader reads MXFP4's tensor pairs
        raise ValueError(
            f"`quantization_config` with quant_method {method!r} is not supported "
            "(supported: 'mxfp4', the hub's gpt-oss experts)"
        )
    if "sliding_window" in config and config["sliding_window"] is None:
        fields.pop("sliding_window", None)  # transformers: no window on any layer
        fields["layer_types"] = None
    elif fields.get("layer_types") is None:
        fields["layer_types"] = _alternating(layers, 2)
    if not config.get("rope_parameters") and not config.get("rope_scaling"):
        config = {**config, "rope_parameters": _GPT_OSS_ROPE}
    params = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    if params.get("rope_theta") is None and config.get("rope_theta") is None:
        params["rope_theta"] = GPT_OSS_ROPE_THETA  # transformers' default_theta for gpt_oss
    try:
        fields["rope"] = RopeConfig.from_hf_config({**config, "rope_parameters": params})
    except (ValueError, TypeError) as e:
        raise ValueError(f"rope settings: {e}") from None


_GPT_OSS_EXPERTS = "layers.{i}.mlp.experts"
GPT_OSS = Family(
    name="gpt_oss",
    kind="decoder",
    fixed={
        "norm": "rms",
        "mlp": "gated",
        "positions": "rope",
        "attn_sinks": True,
        "family": "gpt_oss",
    },
    keys={
        **_LLAMA_KEYS,
        **_ATTENTION_BIAS_KEYS,
        **_EXPERT_KEYS,
        "layer_types": ("layer_types",),
        "swiglu_limit": ("swiglu_limit",),
        "swiglu_alpha": ("swiglu_alpha",),
    },
    # transformers' GptOssConfig defaults
    defaults={
        **_LLAMA_DEFAULTS,
        "qkv_bias": True,
        "out_bias": True,
        "head_dim": 64,
        "sliding_window": 128,
        "num_local_experts": 128,
        "num_experts_per_tok": 4,
        "swiglu_limit": GPT_OSS_SWIGLU[0],
        "swiglu_alpha": GPT_OSS_SWIGLU[1],
    },
    weights={
        **_without(_LLAMA_WEIGHTS, *_DENSE_MLP),
        "blocks.{i}.attention.sinks": ("layers.{i}.self_attn.sinks", ""),
        "blocks.{i}.mlp.router": ("layers.{i}.mlp.router", ""),
        # stacked (E, C, 2F): x @ it; gate and up alternate along 2F
        "blocks.{i}.mlp.experts.{gate_up}": (
            f"{_GPT_OSS_EXPERTS}.gate_up_proj",
            "Tx+gate_up_pairs",
        ),
        "blocks.{i}.mlp.experts.{gate_up}.bias": (
            f"{_GPT_OSS_EXPERTS}.gate_up_proj_bias",
            "gate_up_pairs",
        ),
        "blocks.{i}.mlp.experts.down": (f"{_GPT_OSS_EXPERTS}.down_proj", "Tx"),
        "blocks.{i}.mlp.experts.down.bias": (f"{_GPT_OSS_EXPERTS}.down_proj_bias", ""),
    },
    prefixes=("model.",),
    ignore=(r".*rotary_emb\.inv_freq$",),
    gguf_arch="gpt-oss",
    gguf_keys={
        **_GGUF_KEYS,
        "num_local_experts": ("{arch}.expert_count",),
        "num_experts_per_tok": ("{arch}.expert_used_count",),
        "intermediate_size": (
            "{arch}.expert_feed_forward_length",
            "{arch}.feed_forward_length",
        ),
    },
    # llama.cpp: head dim C / H unless key_length says otherwise, biases always, the
    # window required (the hook), a per-layer window pattern not read (refused)
    gguf_defaults={
        "head_dim": lambda f: f["hidden_size"] // f["num_heads"],
        "sliding_window": None,
    },
    refuse={"gpt-oss.attention.sliding_window_pattern": (None,)},
    # llama.cpp's gpt-oss rotates "neox" style (halves): no q/k permutation
    gguf_weights={
        **_without(_LLAMA_GGUF, *_DENSE_MLP),
        "blocks.{i}.mlp_norm": ("blk.{i}.post_attention_norm", ""),
        "blocks.{i}.attention.sinks": ("blk.{i}.attn_sinks", ""),
        "blocks.{i}.mlp.router": ("blk.{i}.ffn_gate_inp", ""),
        "blocks.{i}.mlp.experts.gate": ("blk.{i}.ffn_gate_exps", ""),
        "blocks.{i}.mlp.experts.up": ("blk.{i}.ffn_up_exps", ""),
        "blocks.{i}.mlp.experts.down": ("blk.{i}.ffn_down_exps", ""),
    },
    hook=_gpt_oss,
)

_Q_K_V = tuple(f"blocks.{{i}}.attention.{w}" for w in ("W_query", "W_key", "W_value"))
PHI3 = dataclasses.replace(
    LLAMA,
    name="phi3",
    fixed={**LLAMA.fixed, "family": "phi3"},
    keys=_LLAMA_KEYS,
    defaults=_LLAMA_DEFAULTS,
    refuse={},
    # fused: one qkv projection, one gate/up projection (gate first)
    weights={
        **_without(_LLAMA_WEIGHTS, *_Q_K_V, "blocks.{i}.mlp.gate", "blocks.{i}.mlp.up"),
        "blocks.{i}.attention.{qkv}": ("layers.{i}.self_attn.qkv_proj", "qkv"),
        "blocks.{i}.mlp.{gate_up}": ("layers.{i}.mlp.gate_up_proj", "gate_up"),
    },
    # llama.cpp keeps Phi-3's fused tensors: attn_qkv, and ffn_up holding gate then up.
    gguf_weights={
        **_without(_LLAMA_GGUF, *_Q_K_V, "blocks.{i}.mlp.gate", "blocks.{i}.mlp.up"),
        "blocks.{i}.attention.{qkv}": ("blk.{i}.attn_qkv", "qkv"),
        "blocks.{i}.mlp.{gate_up}": ("blk.{i}.ffn_up", "gate_up"),
    },
)

# llama.cpp's type for a Gemma of this many layers is its "27B", whose score scale is
# 1/sqrt(C/H) rather than 1/sqrt(head_dim) (its GGUF files carry no query_pre_attn_scalar).
GEMMA2_27B_LAYERS = 46
GEMMA3_27B_LAYERS = 62


def _gguf_gemma_scale(fields: dict[str, Any], layers_27b: int) -> None:
    """llama.cpp's Gemma score scale (``f_attention_scale``) for a GGUF file."""
    if fields["num_layers"] == layers_27b:
        fields["attn_scale"] = (fields["hidden_size"] // fields["num_heads"]) ** -0.5


def _gemma2(fields: dict[str, Any], config: Mapping[str, Any], source: Source) -> None:
    """Gemma 2's local/global layers and score scale. Without ``layer_types`` (the hub's
    configs, and every GGUF file) the even layers are local (the window) and the odd ones
    global, as transformers' ``Gemma2Config`` and llama.cpp (its SWA pattern 2) both do."""
    if fields.get("layer_types") is None and fields.get("sliding_window") is not None:
        fields["layer_types"] = _alternating(fields["num_layers"], 2)
    _pre_attn_scalar(fields)
    if source == "gguf":
        _gguf_gemma_scale(fields, GEMMA2_27B_LAYERS)


# Gemma's Hugging Face norms multiply by (1 + weight); llama.cpp's converter stores the sum.
_GEMMA_WEIGHTS: WeightTable = {
    **_LLAMA_WEIGHTS,
    "norm": ("norm", "plus1"),
    "blocks.{i}.attn_norm": ("layers.{i}.input_layernorm", "plus1"),
    "blocks.{i}.attn_post_norm": ("layers.{i}.post_attention_layernorm", "plus1"),
    "blocks.{i}.mlp_norm": ("layers.{i}.pre_feedforward_layernorm", "plus1"),
    "blocks.{i}.mlp_post_norm": ("layers.{i}.post_feedforward_layernorm", "plus1"),
}
_GEMMA_GGUF: WeightTable = {
    **_LLAMA_GGUF,
    "blocks.{i}.attn_post_norm": ("blk.{i}.post_attention_norm", ""),
    "blocks.{i}.mlp_post_norm": ("blk.{i}.post_ffw_norm", ""),
}
_GEMMA_KEYS: dict[str, tuple[str, ...]] = {
    **_LLAMA_KEYS,
    **_ATTENTION_BIAS_KEYS,
    "activation": ("hidden_activation", "hidden_act"),
    "attn_softcap": ("attn_logit_softcapping",),
    "final_softcap": ("final_logit_softcapping",),
    "query_pre_attn_scalar": ("query_pre_attn_scalar",),
    "layer_types": ("layer_types",),
}

GEMMA2 = dataclasses.replace(
    LLAMA,
    name="gemma2",
    fixed={
        **LLAMA.fixed,
        "family": "gemma2",
        "norm_placement": "sandwich",
        "embed_scale": True,
    },
    keys=_GEMMA_KEYS,
    defaults={
        **_LLAMA_DEFAULTS,
        **_NO_BIAS,
        "activation": "gelu_pytorch_tanh",
        "tie_embeddings": True,
    },
    refuse={"use_bidirectional_attention": (None, False)},
    weights=_GEMMA_WEIGHTS,
    gguf_keys={
        **_GGUF_KEYS,
        "attn_softcap": ("{arch}.attn_logit_softcapping",),
        "final_softcap": ("{arch}.final_logit_softcapping",),
    },
    gguf_weights=_GEMMA_GGUF,
    hook=_gemma2,
)

# transformers' Gemma3TextConfig defaults: the hub's multimodal configs leave most keys to
# them (a `text_config` of five keys is common).
_GEMMA3_DEFAULTS: dict[str, Any] = {
    **_LLAMA_DEFAULTS,
    **_NO_BIAS,
    "vocab_size": 262_208,
    "num_heads": 8,
    "num_kv_heads": 4,
    "head_dim": 256,
    "context_length": 131_072,
    "norm_eps": 1e-6,
    "activation": "gelu_pytorch_tanh",
    "tie_embeddings": True,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
}
# llama.cpp's base for the local layers of a gemma3 file (`rope_freq_base_train_swa`).
GEMMA3_GGUF_LOCAL_BASE = 10_000.0


def _gemma3(fields: dict[str, Any], config: Mapping[str, Any], source: Source) -> None:
    """Gemma 3's local/global layers, each kind with its own RoPE, and its score scale.

    The pattern is ``layer_types``, else ``sliding_window_pattern`` (every n-th layer
    global; transformers' default 6), and for GGUF files llama.cpp's rule (5 local : 1
    global). The local layers rotate with ``rope_local_base_freq`` and no scaling; the
    global ones with ``rope_theta`` and the ``rope_scaling`` (transformers 5 writes both
    as ``rope_parameters`` per layer type). In GGUF the local base is llama.cpp's 10000.
    """
    period = fields.pop("sliding_window_pattern")
    local_base = fields.pop("rope_local_base_freq")
    if isinstance(period, bool) or not isinstance(period, int) or period < 1:
        raise ValueError(f"`sliding_window_pattern` must be an integer >= 1, got {period!r}")
    if source == "gguf":
        local_base = GEMMA3_GGUF_LOCAL_BASE
        fields["layer_types"] = None
    if fields.get("layer_types") is None:
        fields["layer_types"] = _alternating(fields["num_layers"], period)
    _pre_attn_scalar(fields)
    if source == "gguf":
        _gguf_gemma_scale(fields, GEMMA3_27B_LAYERS)
        local = RopeConfig(base=local_base)
    else:
        params = config.get("rope_parameters")
        if isinstance(params, Mapping) and isinstance(params.get("sliding_attention"), Mapping):
            fields["rope"] = RopeConfig.from_hf_config(config, layer_type="full_attention")
            local = RopeConfig.from_hf_config(config, layer_type="sliding_attention")
        else:
            base = fields.pop("rope_theta")
            fields["rope"] = RopeConfig.from_hf_config({**config, "rope_theta": base})
            if isinstance(local_base, bool) or not isinstance(local_base, (int, float)):
                raise ValueError(f"`rope_local_base_freq` must be a number, got {local_base!r}")
            local = RopeConfig(base=float(local_base))
    types = fields["layer_types"]
    if isinstance(types, list):
        fields["layer_ropes"] = tuple(local if t == "sliding_attention" else None for t in types)


GEMMA3 = dataclasses.replace(
    GEMMA2,
    name="gemma3",
    fixed={**GEMMA2.fixed, "family": "gemma3", "qk_norm": "rms_head"},
    keys={
        **_GEMMA_KEYS,
        "rope_theta": ("rope_theta",),
        "rope_local_base_freq": ("rope_local_base_freq",),
        "sliding_window_pattern": ("sliding_window_pattern",),
    },
    defaults=_GEMMA3_DEFAULTS,
    required=("hidden_size", "num_layers", "intermediate_size"),
    weights={
        **_GEMMA_WEIGHTS,
        "blocks.{i}.attention.q_norm": ("layers.{i}.self_attn.q_norm", "plus1"),
        "blocks.{i}.attention.k_norm": ("layers.{i}.self_attn.k_norm", "plus1"),
    },
    # transformers 5's multimodal checkpoint nests the text model under
    # model.language_model, older ones under language_model.model; the vision tower and
    # its projector are not part of a text model.
    prefixes=("model.language_model.", "language_model.model.", "language_model.", "model."),
    ignore=(
        r".*rotary_emb\.inv_freq$",
        r"^(model\.)?vision_tower\..*",
        r"^(model\.)?multi_modal_projector\..*",
    ),
    gguf_keys=_GGUF_KEYS,
    gguf_defaults={
        "head_dim": lambda f: f["hidden_size"] // f["num_heads"],
        "query_pre_attn_scalar": None,
        "rope_theta": 1_000_000.0,
    },
    gguf_weights={**_GEMMA_GGUF, **_QK_NORM_GGUF},
    hook=_gemma3,
    model_types=("gemma3_text",),
    text_config="text_config",
)

# llama.cpp's names for the LayerNorm decoders with a fused qkv (gpt_neox, bloom); their
# converters reorder the per-head (H, 3, D) rows to q, k, v one after the other.
_FUSED_GGUF: WeightTable = {
    "tok_embeddings": ("token_embd", ""),
    "norm": ("output_norm", ""),
    "lm_head": ("output", ""),
    "blocks.{i}.attn_norm": ("blk.{i}.attn_norm", ""),
    "blocks.{i}.attention.{qkv}": ("blk.{i}.attn_qkv", "qkv"),
    "blocks.{i}.attention.out_proj": ("blk.{i}.attn_output", ""),
    "blocks.{i}.mlp_norm": ("blk.{i}.ffn_norm", ""),
    "blocks.{i}.mlp.up": ("blk.{i}.ffn_up", ""),
    "blocks.{i}.mlp.down": ("blk.{i}.ffn_down", ""),
}
_LAYER_NORM_GGUF_KEYS = {
    **_GGUF_KEYS_NO_WINDOW,
    "norm_eps": ("{arch}.attention.layer_norm_epsilon",),
}

BLOOM = Family(
    name="bloom",
    kind="decoder",
    fixed={
        "norm": "layer",
        "norm_bias": True,
        "mlp": "plain",
        "activation": "gelu_tanh",
        "positions": "alibi",
        "embed_norm": True,
        "qkv_bias": True,
        "out_bias": True,
        "mlp_bias": True,
        "family": "bloom",
    },
    keys={
        "vocab_size": ("vocab_size",),
        "hidden_size": ("hidden_size", "n_embed"),
        "num_layers": ("n_layer", "num_hidden_layers"),
        "num_heads": ("n_head", "num_attention_heads"),
        "norm_eps": ("layer_norm_epsilon",),
        "tie_embeddings": ("tie_word_embeddings",),
    },
    defaults={
        "num_kv_heads": _same_as("num_heads"),
        "intermediate_size": lambda f: 4 * f["hidden_size"],
        "context_length": 1 << 16,  # ALiBi has no position table; a bound, not an allocation
        "tie_embeddings": True,
        "norm_eps": 1e-5,
    },
    refuse={
        "apply_residual_connection_post_layernorm": (None, False),
        "slow_but_exact": (None, False),
    },
    weights={
        "tok_embeddings": ("word_embeddings", ""),
        "embed_norm": ("word_embeddings_layernorm", ""),
        "norm": ("ln_f", ""),
        "lm_head": ("lm_head", ""),
        "blocks.{i}.attn_norm": ("h.{i}.input_layernorm", ""),
        "blocks.{i}.mlp_norm": ("h.{i}.post_attention_layernorm", ""),
        "blocks.{i}.attention.{qkv}": ("h.{i}.self_attention.query_key_value", "qkv_heads"),
        "blocks.{i}.attention.out_proj": ("h.{i}.self_attention.dense", ""),
        "blocks.{i}.mlp.up": ("h.{i}.mlp.dense_h_to_4h", ""),
        "blocks.{i}.mlp.down": ("h.{i}.mlp.dense_4h_to_h", ""),
    },
    prefixes=("transformer.",),
    # ALiBi has no position table: the file's context_length (llama.cpp's converter writes
    # `seq_length` or else the width there) bounds nothing
    gguf_keys={k: v for k, v in _LAYER_NORM_GGUF_KEYS.items() if k != "context_length"},
    gguf_weights={**_FUSED_GGUF, "embed_norm": ("token_embd_norm", "")},
)


def _partial_rope(
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


def _gpt_neox_rope(fields: dict[str, Any], config: Mapping[str, Any], source: Source) -> None:
    """GPT-NeoX's own names for its RoPE in ``config.json`` (Pythia's hub configs):
    ``rotary_emb_base`` (default 10000) and ``rotary_pct`` (default 0.25, transformers'
    ``GPTNeoXConfig``), where ``rope_parameters`` / ``rope_scaling`` give none."""
    if source == "hf":
        _partial_rope(fields, config, base_key="rotary_emb_base", fraction_key="rotary_pct")


GPT_NEOX = Family(
    name="gpt_neox",
    gguf_arch="gptneox",  # llama.cpp's LLM_ARCH_GPTNEOX
    kind="decoder",
    fixed={
        "norm": "layer",
        "norm_bias": True,
        "mlp": "plain",
        "positions": "rope",
        "mlp_bias": True,
        "family": "gpt_neox",
    },
    keys={
        "vocab_size": ("vocab_size",),
        "hidden_size": ("hidden_size",),
        "num_layers": ("num_hidden_layers",),
        "num_heads": ("num_attention_heads",),
        "intermediate_size": ("intermediate_size",),
        "context_length": ("max_position_embeddings",),
        "norm_eps": ("layer_norm_eps",),
        "tie_embeddings": ("tie_word_embeddings",),
        "activation": ("hidden_act",),
        "parallel_residual": ("use_parallel_residual",),
        **_ATTENTION_BIAS_KEYS,
    },
    defaults={
        "num_kv_heads": _same_as("num_heads"),  # GPT-NeoX has no grouped-query attention
        "tie_embeddings": False,
        "activation": "gelu",
        "parallel_residual": True,
        "qkv_bias": True,
        "out_bias": True,
    },
    weights={
        "tok_embeddings": ("embed_in", ""),
        "norm": ("final_layer_norm", ""),
        "lm_head": ("embed_out|lm_head", ""),
        "blocks.{i}.attn_norm": ("layers.{i}.input_layernorm", ""),
        "blocks.{i}.mlp_norm": ("layers.{i}.post_attention_layernorm", ""),
        "blocks.{i}.attention.{qkv}": ("layers.{i}.attention.query_key_value", "qkv_heads"),
        "blocks.{i}.attention.out_proj": ("layers.{i}.attention.dense", ""),
        "blocks.{i}.mlp.up": ("layers.{i}.mlp.dense_h_to_4h", ""),
        "blocks.{i}.mlp.down": ("layers.{i}.mlp.dense_4h_to_h", ""),
    },
    prefixes=("gpt_neox.",),
    ignore=(r".*rotary_emb\.inv_freq$", r".*attention\.(masked_)?bias$"),
    gguf_keys={
        **_LAYER_NORM_GGUF_KEYS,
        "parallel_residual": ("{arch}.use_parallel_residual",),
    },
    gguf_weights=_FUSED_GGUF,
    hook=_gpt_neox_rope,
)


def _gpt2_score_scales(fields: dict[str, Any], config: Mapping[str, Any], source: Source) -> None:
    """GPT-2's score-scale switches: ``scale_attn_weights`` (``1/sqrt(D)``, or no scaling
    when false) and ``scale_attn_by_inverse_layer_idx`` (layer i's scores also divided by
    ``i + 1``) become ``layer_scales`` when they change anything;
    ``reorder_and_upcast_attn`` (scores in fp32) is checked and dropped: attnlab's scores are
    fp32 in an fp32 model, and bf16 runs keep attnlab's own backends' precision."""
    scaled = _flag(fields, "scale_attn_weights", True)
    inverse = _flag(fields, "scale_attn_by_inverse_layer_idx", False)
    _flag(fields, "reorder_and_upcast_attn", False)
    if scaled and not inverse:
        return
    width, heads, layers = fields["hidden_size"], fields["num_heads"], fields["num_layers"]
    base = (width // heads) ** -0.5 if scaled else 1.0
    fields["layer_scales"] = tuple(base / (i + 1 if inverse else 1) for i in range(layers))


GPT2 = Family(
    name="gpt2",
    kind="decoder",
    fixed={
        "norm": "layer",
        "norm_bias": True,
        "mlp": "plain",
        "positions": "learned",
        "qkv_bias": True,
        "out_bias": True,
        "mlp_bias": True,
        "family": "gpt2",
    },
    keys={
        "vocab_size": ("vocab_size",),
        "hidden_size": ("n_embd",),
        "num_layers": ("n_layer",),
        "num_heads": ("n_head",),
        "intermediate_size": ("n_inner",),
        "context_length": ("n_positions",),
        "norm_eps": ("layer_norm_epsilon",),
        "tie_embeddings": ("tie_word_embeddings",),
        "activation": ("activation_function",),
        # options of the hook (_gpt2_score_scales)
        "scale_attn_weights": ("scale_attn_weights",),
        "scale_attn_by_inverse_layer_idx": ("scale_attn_by_inverse_layer_idx",),
        "reorder_and_upcast_attn": ("reorder_and_upcast_attn",),
    },
    defaults={
        "num_kv_heads": _same_as("num_heads"),
        "intermediate_size": lambda f: 4 * f["hidden_size"],
        "tie_embeddings": True,
        "activation": "gelu_new",
        "norm_eps": 1e-5,
    },
    refuse={"add_cross_attention": (None, False)},
    weights={
        "tok_embeddings": ("wte", ""),
        "pos_embeddings": ("wpe", ""),
        "norm": ("ln_f", ""),
        "lm_head": ("lm_head", ""),
        "blocks.{i}.attn_norm": ("h.{i}.ln_1", ""),
        "blocks.{i}.attention.{qkv}": ("h.{i}.attn.c_attn", "T+qkv"),
        "blocks.{i}.attention.out_proj": ("h.{i}.attn.c_proj", "T"),
        "blocks.{i}.mlp_norm": ("h.{i}.ln_2", ""),
        "blocks.{i}.mlp.up": ("h.{i}.mlp.c_fc", "T"),
        "blocks.{i}.mlp.down": ("h.{i}.mlp.c_proj", "T"),
    },
    prefixes=("transformer.",),
    ignore=(r".*\.attn\.(masked_)?bias$",),
    gguf_keys={
        **_GGUF_KEYS,
        "norm_eps": ("{arch}.attention.layer_norm_epsilon",),
    },
    # llama.cpp's converter stores GPT-2's Conv1D weights transposed (as nn.Linear's)
    gguf_weights={**_FUSED_GGUF, "pos_embeddings": ("position_embd", "")},
    hook=_gpt2_score_scales,
)

GRANITE = dataclasses.replace(
    LLAMA,
    name="granite",
    fixed={**LLAMA.fixed, "family": "granite"},
    keys={
        **LLAMA.keys,
        "attn_scale": ("attention_multiplier",),
        "embed_multiplier": ("embedding_multiplier",),
        "residual_multiplier": ("residual_multiplier",),
        "logits_scaling": ("logits_scaling",),
    },
    # transformers' GraniteConfig: every multiplier 1 (the score scale too, not 1/sqrt(D))
    defaults={**LLAMA.defaults, "attn_scale": 1.0},
    refuse={},
    gguf_keys={
        **_GGUF_KEYS,
        "attn_scale": ("{arch}.attention.scale",),
        "embed_multiplier": ("{arch}.embedding_scale",),
        "residual_multiplier": ("{arch}.residual_scale",),
        "logits_scaling": ("{arch}.logit_scale",),
    },
    # llama.cpp: no attention.scale in the file means 1/sqrt(D)
    gguf_defaults={"attn_scale": None},
    # llama.cpp's GraniteModel is its LlamaModel: q/k rows permuted (LLAMA's gguf_weights)
)

_PLAIN_MLP_GGUF = _without(_LLAMA_GGUF, "blocks.{i}.mlp.gate")

STARCODER2 = Family(
    name="starcoder2",
    kind="decoder",
    fixed={
        "norm": "layer",
        "norm_bias": True,
        "mlp": "plain",
        "positions": "rope",
        "family": "starcoder2",
    },
    keys={
        **_LLAMA_KEYS,
        "norm_eps": ("norm_epsilon",),
        "qkv_bias": ("use_bias",),
        "out_bias": ("use_bias",),
        "mlp_bias": ("use_bias",),
    },
    defaults={
        **_LLAMA_DEFAULTS,
        "activation": "gelu_pytorch_tanh",
        "tie_embeddings": True,
        "qkv_bias": True,
        "out_bias": True,
        "mlp_bias": True,
        "norm_eps": 1e-5,
    },
    refuse={"norm_type": (None, "layer_norm"), "mlp_type": (None, "default")},
    weights={
        **_without(_LLAMA_WEIGHTS, "blocks.{i}.mlp.gate"),
        "blocks.{i}.mlp.up": ("layers.{i}.mlp.c_fc", ""),
        "blocks.{i}.mlp.down": ("layers.{i}.mlp.c_proj", ""),
    },
    prefixes=("model.",),
    ignore=(r".*rotary_emb\.inv_freq$",),
    # llama.cpp writes no window for starcoder2 and applies none
    gguf_keys=_GGUF_KEYS_NO_WINDOW,
    gguf_weights=_PLAIN_MLP_GGUF,
)


def _stablelm(fields: dict[str, Any], config: Mapping[str, Any], source: Source) -> None:
    """StableLM's rotated fraction (``partial_rotary_factor``, 0.25 when absent, as
    transformers' ``StableLmConfig``) and its QK-norm: a LayerNorm per head with its own
    weight, from ``qk_layernorm`` (GGUF: the ``attn_q_norm`` tensors, as llama.cpp)."""
    if source == "hf":
        _partial_rope(fields, config)
        qk = _flag(fields, "qk_layernorm", False)
    else:
        qk = fields.pop("qk_norm_tensors")
    if qk:
        fields["qk_norm"] = "layer_each_head"


STABLELM = Family(
    name="stablelm",
    kind="decoder",
    fixed={
        "norm": "layer",
        "norm_bias": True,
        "mlp": "gated",
        "positions": "rope",
        "out_bias": False,
        "mlp_bias": False,
        # the parallel form reads one norm for attention and MLP
        "parallel_shared_norm": True,
        "family": "stablelm",
    },
    keys={
        **_LLAMA_KEYS,
        "norm_eps": ("layer_norm_eps",),
        "qkv_bias": ("use_qkv_bias",),
        "parallel_residual": ("use_parallel_residual",),
        "qk_layernorm": ("qk_layernorm",),
    },
    defaults={**_LLAMA_DEFAULTS, "qkv_bias": False, "norm_eps": 1e-5},
    weights={
        **_LLAMA_WEIGHTS,
        "blocks.{i}.attention.q_norm": ("layers.{i}.self_attn.q_layernorm.norms.{j}", ""),
        "blocks.{i}.attention.k_norm": ("layers.{i}.self_attn.k_layernorm.norms.{j}", ""),
    },
    prefixes=("model.",),
    ignore=(r".*rotary_emb\.inv_freq$",),
    gguf_keys={
        **_LAYER_NORM_GGUF_KEYS,
        "parallel_residual": ("{arch}.use_parallel_residual",),
    },
    # llama.cpp's StableLMModel does not permute q/k; it stacks the per-head norms
    gguf_weights={**_LLAMA_GGUF, **_QK_NORM_GGUF},
    hook=_stablelm,
)


# --------------------------------------------------------------------------- DeepSeek (MLA)


def _option(fields: dict[str, Any], config: Mapping[str, Any], key: str, source: Source) -> Any:
    """An option whose explicit ``null`` in ``config.json`` means "none" (not the default,
    which the loader fills for a null): ``q_lora_rank``, ``n_group``."""
    value = fields.pop(key, None)
    if source == "hf" and key in config and config[key] is None:
        return None
    return value


def _mla(fields: dict[str, Any], config: Mapping[str, Any], source: Source) -> MLAConfig:
    """Latent attention's sizes; the heads' key/value dims come from it, not from
    ``head_dim`` (DeepSeek's ``config.json`` gives the rotary dims there)."""
    q_rank = _option(fields, config, "q_lora_rank", source)
    mla = {
        "kv_lora_rank": _count(fields, "kv_lora_rank"),
        "qk_nope_head_dim": _count(fields, "qk_nope_head_dim"),
        "qk_rope_head_dim": _count(fields, "qk_rope_head_dim"),
        "v_head_dim": _count(fields, "v_head_dim"),
    }
    if q_rank is not None and (
        isinstance(q_rank, bool) or not isinstance(q_rank, int) or q_rank < 1
    ):
        raise ValueError(f"`q_lora_rank` must be an integer >= 1 or null, got {q_rank!r}")
    width = fields["hidden_size"]
    for key in ("kv_lora_rank", "q_lora_rank"):
        rank = mla.get(key, q_rank)
        if rank is not None and rank > width:
            raise ValueError(
                f"`{key}` = {rank} does not fit: a low-rank projection of width "
                f"{width} (`hidden_size`) has rank at most {width}"
            )
    if mla["qk_rope_head_dim"] % 2:
        raise ValueError(
            f"`qk_rope_head_dim` must be even (RoPE turns pairs), got {mla['qk_rope_head_dim']}"
        )
    heads = fields["num_heads"]
    if fields.get("num_kv_heads", heads) != heads:
        raise ValueError(
            f"`num_key_value_heads` = {fields['num_kv_heads']} must equal `num_attention_heads` "
            f"({heads}): latent attention gives every head its own key and value"
        )
    fields["num_kv_heads"] = heads
    fields["head_dim"] = mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]
    # transformers and DeepSeek's code: the latent norms' epsilon is 1e-6; llama.cpp: the
    # model's RMSNorm epsilon
    eps = fields.get("norm_eps", 1e-6) if source == "gguf" else 1e-6
    return MLAConfig(q_lora_rank=q_rank, latent_eps=eps, **mla)


def _deepseek_rope(fields: dict[str, Any], config: Mapping[str, Any], interleaved: bool) -> None:
    """RoPE over the ``qk_rope_head_dim`` dims, and DeepSeek's YaRN score scale: the scale
    ``1/sqrt(Dn + Dr)`` times ``mscale**2``, ``mscale = 0.1 * mscale_all_dim * ln(factor) + 1``,
    whenever the RoPE is scaled (transformers' ``yarn_apply_mscale``)."""
    try:
        fields["rope"] = RopeConfig.from_hf_config(config, interleaved=interleaved)
    except (ValueError, TypeError) as e:
        raise ValueError(f"rope settings: {e}") from None
    params = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    scale = float(fields["head_dim"]) ** -0.5
    kind = params.get("rope_type", params.get("type", "default"))
    all_dim, factor = params.get("mscale_all_dim"), params.get("factor")
    if kind != "default" and all_dim:
        for key, value in (("mscale_all_dim", all_dim), ("factor", factor)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"rope `{key}` must be a number > 0, got {value!r}")
        f = float(factor)  # type: ignore[arg-type]
        mscale = 1.0 if f <= 1 else 0.1 * float(all_dim) * math.log(f) + 1.0
        scale *= mscale * mscale
    fields["attn_scale"] = scale


# the MoEConfig's names in its messages -> DeepSeek's config.json keys
_DEEPSEEK_MOE_NAMES = {
    "`groups`": "`n_group`",
    "`top_groups`": "`topk_group`",
    "`top_k`": "`num_experts_per_tok`",
    "`num_experts`": "`n_routed_experts`",
}
_DEEPSEEK_MOE_KEYS = (
    "num_experts_per_tok",
    "moe_intermediate_size",
    "n_shared_experts",
    "routed_scaling_factor",
    "n_group",
    "topk_group",
    "topk_method",
    "norm_topk_prob",
)


def _deepseek_experts(
    fields: dict[str, Any],
    config: Mapping[str, Any],
    source: Source,
    *,
    v3: bool,
    router: str | None = None,
) -> None:
    """DeepSeek's feed-forward: the first ``first_k_dense_replace`` layers dense (width
    ``intermediate_size``), the others ``n_routed_experts`` experts of
    ``moe_intermediate_size`` with ``n_shared_experts`` shared ones (one gated MLP of that
    many times the width), the weights times ``routed_scaling_factor``.

    DeepSeek-V2 routes by softmax, greedily or (``topk_method`` ``group_limited_greedy``)
    within the ``topk_group`` of ``n_group`` groups with the best expert; DeepSeek-V3 (and
    Kimi K2) by sigmoid plus ``e_score_correction_bias`` for the choice, within the groups
    with the best two experts summed, the top-k weights renormalised by ``norm_topk_prob``.
    """
    layers = fields["num_layers"]
    first = _count(fields, "first_k_dense_replace", least=0)
    experts = fields.pop("num_local_experts", None)
    if experts is None or experts == 0:
        for key in _DEEPSEEK_MOE_KEYS:
            fields.pop(key, None)
        return
    fields["num_local_experts"] = experts
    size = _count(fields, "moe_intermediate_size")
    shared = _count(fields, "n_shared_experts", least=0)
    scale = fields.pop("routed_scaling_factor")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"`routed_scaling_factor` must be a number > 0, got {scale!r}")
    groups = _option(fields, config, "n_group", source)
    top_groups = _option(fields, config, "topk_group", source)
    method = fields.pop("topk_method")
    renormalize = _flag(fields, "norm_topk_prob", v3)
    router = router or ("sigmoid" if v3 else "softmax")
    if (not v3 and method == "greedy") or groups in (None, 1):
        groups = top_groups = 1
    else:
        for key, value in (("n_group", groups), ("topk_group", top_groups)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{key}` must be an integer >= 1, got {value!r}")
    moe = _experts(
        fields,
        size=size,
        renormalize=renormalize,
        router=router,
        shared_size=size * shared if shared else None,
    )
    try:
        fields["moe"] = dataclasses.replace(
            moe,
            routed_scale=float(scale),
            groups=groups,
            top_groups=top_groups,
            group_score="top2" if v3 else "max",
            score_bias=router == "sigmoid",
        )
    except ValueError as e:
        message = str(e)
        for ours, theirs in _DEEPSEEK_MOE_NAMES.items():
            message = message.replace(ours, theirs)
        raise ValueError(message) from None
    fields["layer_moe"] = tuple(i >= first for i in range(layers))


def _deepseek_v2(fields: dict[str, Any], config: Mapping[str, Any], source: Source) -> None:
    """DeepSeek-V2: multi-head latent attention (`kv_lora_rank`, optional `q_lora_rank`,
    `qk_nope_head_dim` + `qk_rope_head_dim`, `v_head_dim`), RoPE on interleaved pairs with
    YaRN's `mscale_all_dim` in the score scale; dense layers before `first_k_dense_replace`,
    then experts with a softmax router (`group_limited_greedy`: within the best `topk_group`
    of `n_group` groups) and `n_shared_experts` shared ones.

    (Details: :func:`_mla`, :func:`_deepseek_rope`, :func:`_deepseek_experts`.)"""
    fields["mla"] = _mla(fields, config, source)
    if source == "hf":
        _deepseek_rope(fields, config, interleaved=True)
    _deepseek_experts(fields, config, source, v3=False)


def _deepseek_v3(fields: dict[str, Any], config: Mapping[str, Any], source: Source) -> None:
    """DeepSeek-V3/R1 and Kimi K2: DeepSeek-V2's latent attention (RoPE on interleaved
    pairs unless `rope_interleave` is false); experts with a sigmoid router, the
    `e_score_correction_bias` shifting the choice, groups scored by their best two experts,
    `norm_topk_prob` and `routed_scaling_factor`.

    GGUF files (llama.cpp's `deepseek2`): :func:`_deepseek2_gguf`."""
    if source == "gguf":
        _deepseek2_gguf(fields, config, source)
        return
    fields["mla"] = _mla(fields, config, source)
    interleaved = _flag(fields, "rope_interleave", True)
    if source == "hf":
        _deepseek_rope(fields, config, interleaved=interleaved)
    _deepseek_experts(fields, config, source, v3=True)


# llama.cpp's expert_gating_func: 1 softmax, 2 sigmoid (absent: softmax, as llama.cpp)
_GATING = {1: "softmax", 2: "sigmoid"}


def _deepseek2_gguf(fields: dict[str, Any], config: Mapping[str, Any], source: Source) -> None:
    """A ``deepseek2`` GGUF file as llama.cpp's converter writes it and llama.cpp runs it.

    The file describes the attention as multi-query attention over the latent
    (``attention.key_length`` = r + Dr, ``head_count_kv`` = 1) and gives the expanded
    heads' dims in ``attention.key_length_mla`` / ``value_length_mla``; ``attn_k_b`` /
    ``attn_v_b`` hold the up-projections split for the absorbed product. The router is
    ``expert_gating_func``'s (sigmoid with the ``exp_probs_b`` correction: DeepSeek-V3);
    groups (``expert_group_count`` / ``expert_group_used_count``) are scored by their best
    two experts, as llama.cpp does for every gating function. RoPE turns adjacent pairs,
    with llama.cpp's YaRN and score scale when ``rope.scaling.type`` is ``yarn``.
    """
    fields["family"] = "deepseek2"
    k_mla = fields.pop("key_length_mla")
    if k_mla is None:
        raise ValueError(
            "lacks `deepseek2.attention.key_length_mla`: a file with the unsplit kv_b "
            "tensor (older llama.cpp converters) is not supported; convert it again"
        )
    rope = fields.get("qk_rope_head_dim")
    for key, value in (("key_length_mla", k_mla), ("rope.dimension_count", rope)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`deepseek2.{key}` must be an integer >= 1, got {value!r}")
    fields["qk_nope_head_dim"] = k_mla - rope
    scaling = config.get("deepseek2.rope.scaling.type", "none")
    if scaling not in ("none", "yarn"):  # YaRN: the reader's _gguf_deepseek2_yarn
        raise ValueError(
            f"`deepseek2.rope.scaling.type` = {scaling!r} is not supported for deepseek2 "
            "files (supported: 'none', 'yarn')"
        )
    fields["num_kv_heads"] = fields["num_heads"]  # the file's 1 is the MQA view
    fields["mla"] = _mla(fields, config, source)
    gating = fields.pop("expert_gating_func")
    if gating not in _GATING:
        raise ValueError(
            f"`deepseek2.expert_gating_func` = {gating!r} is not supported (1: softmax, 2: sigmoid)"
        )
    _deepseek_experts(fields, config, source, v3=True, router=_GATING[gating])


# GGUF keys that describe deepseek2's attention as multi-query over the latent: not the heads
_GGUF_MQA_VIEW = ("num_kv_heads", "head_dim", "value_head_dim", "rope_dims")
_DEEPSEEK_ATTENTION: WeightTable = {
    **{
        f"blocks.{{i}}.attention.{ours}": (f"layers.{{i}}.self_attn.{theirs}", "")
        for ours, theirs in (
            ("W_query", "q_proj"),
            ("W_query.down", "q_a_proj"),
            ("W_query.norm", "q_a_layernorm"),
            ("W_query.up", "q_b_proj"),
            ("kv_down", "kv_a_proj_with_mqa"),
            ("kv_norm", "kv_a_layernorm"),
            ("out_proj", "o_proj"),
        )
    },
}
_DEEPSEEK_WEIGHTS: WeightTable = {
    **_without(_LLAMA_WEIGHTS, *_Q_K_V, "blocks.{i}.attention.out_proj"),
    **_DEEPSEEK_ATTENTION,
    "blocks.{i}.attention.{kv_up}": ("layers.{i}.self_attn.kv_b_proj", "kv_b"),
    "blocks.{i}.mlp.router": ("layers.{i}.mlp.gate", ""),
    # one tensor per expert (transformers' save), or stacked (E, 2F, C) and (E, C, F)
    "blocks.{i}.mlp.experts.gate": ("layers.{i}.mlp.experts.{j}.gate_proj", ""),
    "blocks.{i}.mlp.experts.up": ("layers.{i}.mlp.experts.{j}.up_proj", ""),
    "blocks.{i}.mlp.experts.{gate_up}": ("layers.{i}.mlp.experts.gate_up_proj", "gate_up"),
    "blocks.{i}.mlp.experts.down": (
        "layers.{i}.mlp.experts.{j}.down_proj|layers.{i}.mlp.experts.down_proj",
        "",
    ),
    **{
        f"blocks.{{i}}.mlp.shared.{w}": (f"layers.{{i}}.mlp.shared_experts.{w}_proj", "")
        for w in ("gate", "up", "down")
    },
}
_DEEPSEEK_KEYS: dict[str, tuple[str, ...]] = {
    **{k: v for k, v in _LLAMA_KEYS.items() if k not in ("head_dim", "sliding_window")},
    **_ATTENTION_BIAS_KEYS,
    "q_lora_rank": ("q_lora_rank",),
    "kv_lora_rank": ("kv_lora_rank",),
    "qk_nope_head_dim": ("qk_nope_head_dim",),
    "qk_rope_head_dim": ("qk_rope_head_dim",),
    "v_head_dim": ("v_head_dim",),
    "num_local_experts": ("n_routed_experts",),
    "num_experts_per_tok": ("num_experts_per_tok",),
    "moe_intermediate_size": ("moe_intermediate_size",),
    "n_shared_experts": ("n_shared_experts",),
    "routed_scaling_factor": ("routed_scaling_factor",),
    "n_group": ("n_group",),
    "topk_group": ("topk_group",),
    "topk_method": ("topk_method",),
    "norm_topk_prob": ("norm_topk_prob",),
    "first_k_dense_replace": ("first_k_dense_replace",),
}
# transformers' DeepseekV2Config defaults
_DEEPSEEK_V2_DEFAULTS: dict[str, Any] = {
    **_LLAMA_DEFAULTS,
    **_NO_BIAS,
    "norm_eps": 1e-6,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "num_local_experts": 64,
    "moe_intermediate_size": 1407,
    "n_shared_experts": 2,
    "routed_scaling_factor": 1.0,
    "topk_method": "greedy",
    "norm_topk_prob": False,
    "first_k_dense_replace": 0,
}

DEEPSEEK_V2 = Family(
    name="deepseek_v2",
    kind="decoder",
    fixed={"norm": "rms", "mlp": "gated", "positions": "rope", "family": "deepseek_v2"},
    keys=_DEEPSEEK_KEYS,
    defaults=_DEEPSEEK_V2_DEFAULTS,
    required=(*_SIZES, "num_experts_per_tok"),
    # transformers' DeepseekV2 router never renormalises, and its MoE layers are every
    # layer from first_k_dense_replace on; biases only where attention_bias says
    refuse={
        "norm_topk_prob": (None, False),
        "moe_layer_freq": (None, 1),
        "mlp_bias": (None, False),
        "topk_method": (None, "greedy", "group_limited_greedy"),
        "scoring_func": (None, "softmax"),
        "pretraining_tp": (None, 1),
    },
    weights=_DEEPSEEK_WEIGHTS,
    prefixes=("model.",),
    ignore=(r".*rotary_emb\.inv_freq$",),
    hook=_deepseek_v2,
)

DEEPSEEK_V3 = dataclasses.replace(
    DEEPSEEK_V2,
    name="deepseek_v3",
    fixed={**DEEPSEEK_V2.fixed, "family": "deepseek_v3"},
    keys={**_DEEPSEEK_KEYS, "rope_interleave": ("rope_interleave",)},
    # transformers' DeepseekV3Config defaults
    defaults={
        **_DEEPSEEK_V2_DEFAULTS,
        "num_local_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 2048,
        "n_shared_experts": 1,
        "routed_scaling_factor": 2.5,
        "n_group": 8,
        "topk_group": 4,
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "first_k_dense_replace": 3,
    },
    required=_SIZES,
    refuse={
        "moe_layer_freq": (None, 1),
        "topk_method": (None, "noaux_tc"),
        "scoring_func": (None, "sigmoid"),
        "pretraining_tp": (None, 1),
    },
    weights={
        **_DEEPSEEK_WEIGHTS,
        "blocks.{i}.mlp.score_correction.bias": ("layers.{i}.mlp.gate.e_score_correction_bias", ""),
    },
    hook=_deepseek_v3,
    # Kimi K2 is DeepSeek-V3's architecture under its own name
    model_types=("kimi_k2",),
    # DeepSeek-V3's checkpoints carry one (model.layers.61: enorm, hnorm, eh_proj,
    # shared_head, embed_tokens and a decoder layer); transformers ignores it too
    mtp_layers="num_nextn_predict_layers",
    # llama.cpp's deepseek2 (DeepSeek-V2, V3, R1, Kimi K2): see _deepseek2_gguf
    gguf_arch="deepseek2",
    gguf_keys={
        **{k: v for k, v in _GGUF_KEYS_NO_WINDOW.items() if k not in _GGUF_MQA_VIEW},
        "q_lora_rank": ("{arch}.attention.q_lora_rank",),
        "kv_lora_rank": ("{arch}.attention.kv_lora_rank",),
        "key_length_mla": ("{arch}.attention.key_length_mla",),
        "v_head_dim": ("{arch}.attention.value_length_mla",),
        "qk_rope_head_dim": ("{arch}.rope.dimension_count",),
        "first_k_dense_replace": ("{arch}.leading_dense_block_count",),
        "num_local_experts": ("{arch}.expert_count",),
        "num_experts_per_tok": ("{arch}.expert_used_count",),
        "moe_intermediate_size": ("{arch}.expert_feed_forward_length",),
        "n_shared_experts": ("{arch}.expert_shared_count",),
        "routed_scaling_factor": ("{arch}.expert_weights_scale",),
        "norm_topk_prob": ("{arch}.expert_weights_norm",),
        "n_group": ("{arch}.expert_group_count",),
        "topk_group": ("{arch}.expert_group_used_count",),
        "expert_gating_func": ("{arch}.expert_gating_func",),
    },
    # what llama.cpp assumes when the file says nothing
    gguf_defaults={
        "q_lora_rank": None,
        "key_length_mla": None,
        "first_k_dense_replace": 0,
        "n_shared_experts": 0,
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": False,
        "n_group": 1,
        "topk_group": 1,
        "expert_gating_func": 1,
    },
    gguf_weights={
        **_without(_LLAMA_GGUF, *_Q_K_V, "blocks.{i}.attention.out_proj"),
        "blocks.{i}.attention.W_query": ("blk.{i}.attn_q", ""),
        "blocks.{i}.attention.W_query.down": ("blk.{i}.attn_q_a", ""),
        "blocks.{i}.attention.W_query.norm": ("blk.{i}.attn_q_a_norm", ""),
        "blocks.{i}.attention.W_query.up": ("blk.{i}.attn_q_b", ""),
        "blocks.{i}.attention.kv_down": ("blk.{i}.attn_kv_a_mqa", ""),
        "blocks.{i}.attention.kv_norm": ("blk.{i}.attn_kv_a_norm", ""),
        "blocks.{i}.attention.k_up": ("blk.{i}.attn_k_b", "k_b"),
        "blocks.{i}.attention.v_up": ("blk.{i}.attn_v_b", "v_b"),
        "blocks.{i}.attention.out_proj": ("blk.{i}.attn_output", ""),
        "blocks.{i}.mlp.router": ("blk.{i}.ffn_gate_inp", ""),
        "blocks.{i}.mlp.score_correction.bias": ("blk.{i}.exp_probs_b", ""),
        **{
            f"blocks.{{i}}.mlp.experts.{w}": (f"blk.{{i}}.ffn_{w}_exps", "")
            for w in ("gate", "up", "down")
        },
        **{
            f"blocks.{{i}}.mlp.shared.{w}": (f"blk.{{i}}.ffn_{w}_shexp", "")
            for w in ("gate", "up", "down")
        },
    },
)

# --------------------------------------------------------------------------- encoders

BERT = Family(
    name="bert",
    kind="encoder",
    fixed={"family": "bert"},
    keys={
        "vocab_size": ("vocab_size",),
        "hidden_size": ("hidden_size",),
        "num_layers": ("num_hidden_layers",),
        "num_heads": ("num_attention_heads",),
        "intermediate_size": ("intermediate_size",),
        "max_position_embeddings": ("max_position_embeddings",),
        "type_vocab_size": ("type_vocab_size",),
        "layer_norm_eps": ("layer_norm_eps",),
        "pad_token_id": ("pad_token_id",),
        "activation": ("hidden_act",),
    },
    defaults={"pad_token_id": 0, "activation": "gelu", "type_vocab_size": 2},
    required=(*_SIZES, "max_position_embeddings", "layer_norm_eps"),
    refuse={
        "position_embedding_type": (None, "absolute"),
        "is_decoder": (None, False),
        "add_cross_attention": (None, False),
    },
    weights={
        "word_embeddings": ("embeddings.word_embeddings", ""),
        "position_embeddings": ("embeddings.position_embeddings", ""),
        "token_type_embeddings": ("embeddings.token_type_embeddings", ""),
        "embed_norm": ("embeddings.LayerNorm", ""),
        "layers.{i}.attention.W_query": ("encoder.layer.{i}.attention.self.query", ""),
        "layers.{i}.attention.W_key": ("encoder.layer.{i}.attention.self.key", ""),
        "layers.{i}.attention.W_value": ("encoder.layer.{i}.attention.self.value", ""),
        "layers.{i}.attention.out_proj": ("encoder.layer.{i}.attention.output.dense", ""),
        "layers.{i}.attn_norm": ("encoder.layer.{i}.attention.output.LayerNorm", ""),
        "layers.{i}.ffn_in": ("encoder.layer.{i}.intermediate.dense", ""),
        "layers.{i}.ffn_out": ("encoder.layer.{i}.output.dense", ""),
        "layers.{i}.ffn_norm": ("encoder.layer.{i}.output.LayerNorm", ""),
    },
    prefixes=("bert.",),
    ignore=(r"^pooler\..*", r"^cls\..*", r".*position_ids$"),
)

ROBERTA = dataclasses.replace(
    BERT,
    name="roberta",
    fixed={"family": "roberta", "positions_from_padding": True},
    defaults={**BERT.defaults, "pad_token_id": 1},
    prefixes=("roberta.",),
    ignore=(r"^pooler\..*", r"^lm_head\..*", r".*position_ids$"),
)

# --------------------------------------------------------------------------- encoder-decoders


def _t5_stack(stack: str, layer_names: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """T5's names for one stack; ``layer_names`` maps our sub-layer paths to its."""
    table = {
        f"{stack}.norm": (f"{stack}.final_layer_norm", ""),
        # The table lives in the first layer; attnlab's stack owns it and shares it.
        f"{stack}.relative_bias": (
            f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias",
            "",
        ),
    }
    for ours, src in layer_names.items():
        alternatives = "|".join(f"{stack}.block.{{i}}.{s}" for s in src.split("|"))
        table[f"{stack}.blocks.{{i}}.{ours}"] = (alternatives, "")
    return table


def _t5_attention(src: str, ours: str) -> dict[str, str]:
    return {
        f"{ours}.{b}": f"{src}.{a}"
        for a, b in (("q", "W_query"), ("k", "W_key"), ("v", "W_value"), ("o", "out_proj"))
    }


def _t5_mlp(layer: int) -> dict[str, str]:
    d = f"layer.{layer}.DenseReluDense"
    return {
        "mlp.gate": f"{d}.wi_0",  # gated (v1.1, Flan)
        "mlp.up": f"{d}.wi|{d}.wi_1",  # ReLU T5 | gated
        "mlp.down": f"{d}.wo",
        "mlp_norm": f"layer.{layer}.layer_norm",
    }


T5 = Family(
    name="t5",
    kind="encoder-decoder",
    fixed={"family": "t5"},
    keys={
        "vocab_size": ("vocab_size",),
        "hidden_size": ("d_model",),
        "num_layers": ("num_layers",),
        "num_decoder_layers": ("num_decoder_layers",),
        "num_heads": ("num_heads",),
        "head_dim": ("d_kv",),
        "intermediate_size": ("d_ff",),
        "norm_eps": ("layer_norm_epsilon",),
        "activation": ("dense_act_fn", "feed_forward_proj"),
        "gated_mlp": ("is_gated_act",),
        # transformers 5 writes tie_word_embeddings=true always and says in
        # scale_decoder_outputs whether the original config tied (and so scaled).
        "tie_embeddings": ("tie_word_embeddings",),
        "scale_decoder_outputs": ("scale_decoder_outputs", "tie_word_embeddings"),
        "relative_buckets": ("relative_attention_num_buckets",),
        "relative_max_distance": ("relative_attention_max_distance",),
        "pad_token_id": ("pad_token_id",),
        "decoder_start_token_id": ("decoder_start_token_id",),
    },
    defaults={
        "num_decoder_layers": _same_as("num_layers"),
        "activation": "relu",
        "gated_mlp": lambda f: str(f["activation"]).startswith("gated-"),
        "tie_embeddings": True,
        "scale_decoder_outputs": True,
        "relative_buckets": 32,
        "relative_max_distance": 128,
        "pad_token_id": 0,
        "decoder_start_token_id": _same_as("pad_token_id"),
        "norm_eps": 1e-6,
    },
    refuse={"is_decoder": (None, False), "is_encoder_decoder": (None, True)},
    weights={
        "shared": ("shared", ""),
        "decoder.lm_head": ("lm_head", ""),
        **_t5_stack(
            "encoder",
            {
                **_t5_attention("layer.0.SelfAttention", "attention"),
                "attn_norm": "layer.0.layer_norm",
                **_t5_mlp(1),
            },
        ),
        **_t5_stack(
            "decoder",
            {
                **_t5_attention("layer.0.SelfAttention", "attention"),
                "attn_norm": "layer.0.layer_norm",
                **_t5_attention("layer.1.EncDecAttention", "cross_attention"),
                "cross_norm": "layer.1.layer_norm",
                **_t5_mlp(2),
            },
        ),
    },
    # Copies of `shared` that some writers keep; the stacks use `shared` itself.
    ignore=(r"^(encoder|decoder)\.embed_tokens\.weight$",),
)

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        LLAMA,
        MISTRAL,
        QWEN2,
        QWEN3,
        OLMO2,
        PHI3,
        SMOLLM3,
        LLAMA4_TEXT,
        MIXTRAL,
        QWEN3_MOE,
        DEEPSEEK_V2,
        DEEPSEEK_V3,
        GPT_OSS,
        GEMMA2,
        GEMMA3,
        GRANITE,
        STARCODER2,
        STABLELM,
        GPT_NEOX,
        BLOOM,
        GPT2,
        BERT,
        ROBERTA,
        T5,
    )
}
# config.json `model_type` -> family (a page may answer to several names)
_BY_MODEL_TYPE = {t: f for f in FAMILIES.values() for t in (f.name, *f.model_types)}
# GGUF `general.architecture` -> family: the first page of an architecture answers for it
_BY_GGUF_ARCH: dict[str, Family] = {}
for _family in FAMILIES.values():
    _BY_GGUF_ARCH.setdefault(_family.arch, _family)
# Families llama.cpp writes under another's architecture, told apart by a metadata key
# that is present and not 0: Mixtral is "llama" with experts.
GGUF_VARIANTS: dict[str, tuple[tuple[str, str], ...]] = {
    "llama": (("llama.expert_count", "mixtral"),),
}


def gguf_family(architecture: object, metadata: Mapping[str, Any]) -> Family:
    """The family of a GGUF file: its ``general.architecture``'s (:func:`family_for`), or
    the variant its metadata names (:data:`GGUF_VARIANTS`).

    Raises:
        ValueError: as :func:`family_for`.
    """
    for key, name in GGUF_VARIANTS.get(architecture, ()) if isinstance(architecture, str) else ():
        if metadata.get(key) not in (None, 0):
            return FAMILIES[name]
    return family_for(architecture, "gguf")


def family_for(name: object, source: Source = "hf") -> Family:
    """The family for a ``config.json`` ``model_type`` or a GGUF ``general.architecture``.

    Raises:
        ValueError: a missing or unknown name (the message lists the supported ones), or a
            family that attnlab does not read from GGUF files.
    """
    if not isinstance(name, str):
        raise ValueError(f"lacks the model type (which family this is), got {name!r}")
    table = _BY_MODEL_TYPE if source == "hf" else _BY_GGUF_ARCH
    if name not in table:
        raise ValueError(
            f"model type {name!r} is not supported; supported: {', '.join(sorted(table))}"
        )
    family = table[name]
    if source == "gguf" and not family.gguf_weights:
        hint = "; llama.cpp writes Mistral as 'llama'" if family.name == "mistral" else ""
        raise ValueError(f"GGUF files of architecture {name!r} are not supported yet{hint}")
    return family
