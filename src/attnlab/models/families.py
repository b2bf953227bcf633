"""Model families as data: one page each, read by the one decoder and the one encoder.

A :class:`Family` says, for one ``model_type`` (Hugging Face ``config.json``) or
``general.architecture`` (GGUF):

- ``fixed``: the architecture options that never vary in this family (norm kind and
  placement, MLP kind, residual style, position scheme, biases), as fields of
  :class:`attnlab.models.decoder.DecoderConfig` / :class:`attnlab.models.encoder.EncoderConfig`;
- ``keys``: where each remaining field is read in ``config.json`` (the first key present
  wins; ``a.b`` reads a nested dict) and ``defaults`` when none is (a callable default gets
  the fields read so far);
- ``refuse``: config keys whose value this family cannot express unless it is one of the
  given values (the loader then names the field);
- ``weights``: ``(source module, our module, transform)`` with ``{i}`` for the layer index;
  ``.weight``/``.bias`` follow the module name. Transforms: ``""`` as is, ``"T"`` transpose
  (GPT-2's ``Conv1D``), ``"qkv"`` split a fused query/key/value projection into ours,
  ``"T+qkv"`` both, ``"qkv_heads"`` split one interleaved per head (GPT-NeoX's
  ``(H, 3, D)`` rows), ``"gate_up"`` split a fused gate/up projection (Phi-3),
  ``"plus1"`` add 1 (Gemma's RMSNorm multiplies by ``1 + weight``),
  ``"rope_q"``/``"rope_k"`` undo llama.cpp's q/k row permutation; the targets
  ``{qkv}`` and ``{gate_up}`` stand for the pieces;
- ``prefixes`` stripped from source names and ``ignore`` (regexes) for tensors that carry
  nothing the model uses (a pooler, a masked-LM head, buffers);
- the same for GGUF: ``gguf_keys`` (``{arch}`` is the architecture), ``gguf_defaults``
  (what llama.cpp's loader assumes for this architecture where the file says nothing, over
  ``defaults``) and ``gguf_weights`` under llama.cpp's tensor names; ``gguf_arch`` is
  llama.cpp's name for the architecture where it is not ``name`` (GPT-NeoX: ``gptneox``).

This is the llama.cpp ``LLM_ARCH`` idea: a new family is a page here, not a module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from attnlab.models.decoder import DecoderConfig
from attnlab.models.encoder import EncoderConfig
from attnlab.models.encoder_decoder import EncoderDecoderConfig

__all__ = ["ACTIVATION_NAMES", "FAMILIES", "Family", "WeightRule", "family_for"]

# (source module pattern, our module pattern, transform)
WeightRule = tuple[str, str, str]

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


@dataclass(frozen=True)
class Family:
    """One model family, as data (see the module docstring for every field)."""

    name: str
    kind: Literal["decoder", "encoder", "encoder-decoder"]
    fixed: Mapping[str, Any]
    keys: Mapping[str, tuple[str, ...]]
    defaults: Mapping[str, Any] = field(default_factory=dict)
    refuse: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)
    weights: tuple[WeightRule, ...] = ()
    prefixes: tuple[str, ...] = ()
    ignore: tuple[str, ...] = ()
    gguf_keys: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    gguf_defaults: Mapping[str, Any] = field(default_factory=dict)
    gguf_weights: tuple[WeightRule, ...] = ()
    gguf_arch: str = ""

    @property
    def gguf_architecture(self) -> str:
        """llama.cpp's ``general.architecture`` for this family (``gguf_arch``, else ``name``)."""
        return self.gguf_arch or self.name

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


def _same_as(name: str) -> Callable[[dict[str, Any]], Any]:
    return lambda fields: fields[name]


# --------------------------------------------------------------------------- decoders

# Hugging Face Llama-layout names (Llama, Mistral, Qwen2, ...), after "model." is stripped.
_LLAMA_WEIGHTS: tuple[WeightRule, ...] = (
    ("embed_tokens", "tok_embeddings", ""),
    ("norm", "norm", ""),
    ("lm_head", "lm_head", ""),
    ("layers.{i}.input_layernorm", "blocks.{i}.attn_norm", ""),
    ("layers.{i}.self_attn.q_proj", "blocks.{i}.attention.W_query", ""),
    ("layers.{i}.self_attn.k_proj", "blocks.{i}.attention.W_key", ""),
    ("layers.{i}.self_attn.v_proj", "blocks.{i}.attention.W_value", ""),
    ("layers.{i}.self_attn.o_proj", "blocks.{i}.attention.out_proj", ""),
    ("layers.{i}.post_attention_layernorm", "blocks.{i}.mlp_norm", ""),
    ("layers.{i}.mlp.gate_proj", "blocks.{i}.mlp.gate", ""),
    ("layers.{i}.mlp.up_proj", "blocks.{i}.mlp.up", ""),
    ("layers.{i}.mlp.down_proj", "blocks.{i}.mlp.down", ""),
)

# llama.cpp's names for the same layout (llama, qwen2, mistral in GGUF).
_LLAMA_GGUF: tuple[WeightRule, ...] = (
    ("token_embd", "tok_embeddings", ""),
    ("output_norm", "norm", ""),
    ("output", "lm_head", ""),
    ("blk.{i}.attn_norm", "blocks.{i}.attn_norm", ""),
    ("blk.{i}.attn_q", "blocks.{i}.attention.W_query", ""),
    ("blk.{i}.attn_k", "blocks.{i}.attention.W_key", ""),
    ("blk.{i}.attn_v", "blocks.{i}.attention.W_value", ""),
    ("blk.{i}.attn_output", "blocks.{i}.attention.out_proj", ""),
    ("blk.{i}.ffn_norm", "blocks.{i}.mlp_norm", ""),
    ("blk.{i}.ffn_gate", "blocks.{i}.mlp.gate", ""),
    ("blk.{i}.ffn_up", "blocks.{i}.mlp.up", ""),
    ("blk.{i}.ffn_down", "blocks.{i}.mlp.down", ""),
)
# llama.cpp's converter permutes the q/k rows of the "llama" architecture (only).
_LLAMA_GGUF_PERMUTED = tuple(
    (src, ours, {"blk.{i}.attn_q": "rope_q", "blk.{i}.attn_k": "rope_k"}.get(src, t))
    for src, ours, t in _LLAMA_GGUF
)

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
_GGUF_KEYS: dict[str, tuple[str, ...]] = {
    "hidden_size": ("{arch}.embedding_length",),
    "num_layers": ("{arch}.block_count",),
    "num_heads": ("{arch}.attention.head_count",),
    "num_kv_heads": ("{arch}.attention.head_count_kv",),
    "intermediate_size": ("{arch}.feed_forward_length",),
    "context_length": ("{arch}.context_length",),
    "norm_eps": ("{arch}.attention.layer_norm_rms_epsilon", "{arch}.attention.layer_norm_epsilon"),
    "rope_theta": ("{arch}.rope.freq_base",),
    "rope_dims": ("{arch}.rope.dimension_count",),  # partial rotary: dims that rotate per head
    "vocab_size": ("{arch}.vocab_size",),
    # 0 or absent: no window (llama.cpp's converters write it for Mistral-style models only
    # where the architecture has it, e.g. phi3; the llama converter does not)
    "sliding_window": ("{arch}.attention.sliding_window",),
}
# Qwen2/Qwen3 windows apply to some layers only; llama.cpp ignores the key for them.
_GGUF_KEYS_NO_WINDOW = {k: v for k, v in _GGUF_KEYS.items() if k != "sliding_window"}
# Qwen2/Qwen3: `sliding_window` counts only with `use_sliding_window`, and then on the layers
# from `max_window_layers` on (transformers' rule; its configs also write the result as
# `layer_types`, which wins). The two keys are read here and resolved by the loader.
_QWEN_KEYS: dict[str, tuple[str, ...]] = {
    **_LLAMA_KEYS,
    "layer_types": ("layer_types",),
    "use_sliding_window": ("use_sliding_window",),
    "max_window_layers": ("max_window_layers",),
}
_QWEN_DEFAULTS: dict[str, Any] = {
    **_LLAMA_DEFAULTS,
    "use_sliding_window": False,
    "max_window_layers": 28,  # transformers' default
}

LLAMA = Family(
    name="llama",
    kind="decoder",
    fixed={"norm": "rms", "mlp": "gated", "positions": "rope", "family": "llama"},
    keys={
        **_LLAMA_KEYS,
        "qkv_bias": ("attention_bias",),
        "out_bias": ("attention_bias",),
        "mlp_bias": ("mlp_bias",),
    },
    defaults={**_LLAMA_DEFAULTS, "qkv_bias": False, "out_bias": False, "mlp_bias": False},
    refuse={"pretraining_tp": (None, 1)},
    weights=_LLAMA_WEIGHTS,
    prefixes=("model.",),
    ignore=(r".*rotary_emb\.inv_freq$",),
    gguf_keys=_GGUF_KEYS,
    gguf_weights=_LLAMA_GGUF_PERMUTED,
)

MISTRAL = dataclasses.replace(
    LLAMA,
    name="mistral",
    fixed={**LLAMA.fixed, "family": "mistral"},
    keys=_LLAMA_KEYS,
    defaults=_LLAMA_DEFAULTS,
    refuse={},
    gguf_weights=(),  # llama.cpp writes Mistral files as architecture "llama"
)

QWEN2 = dataclasses.replace(
    LLAMA,
    name="qwen2",
    fixed={**LLAMA.fixed, "family": "qwen2", "qkv_bias": True, "out_bias": False},
    keys=_QWEN_KEYS,
    defaults=_QWEN_DEFAULTS,
    refuse={},
    gguf_keys=_GGUF_KEYS_NO_WINDOW,
    gguf_weights=_LLAMA_GGUF,  # the qwen2 converter does not permute q/k
)

QWEN3 = dataclasses.replace(
    LLAMA,
    name="qwen3",
    fixed={**LLAMA.fixed, "family": "qwen3", "qk_norm": "rms_head"},
    keys={
        **_QWEN_KEYS,
        "qkv_bias": ("attention_bias",),
        "out_bias": ("attention_bias",),
    },
    defaults={**_QWEN_DEFAULTS, "qkv_bias": False, "out_bias": False},
    refuse={},
    weights=(
        *_LLAMA_WEIGHTS,
        ("layers.{i}.self_attn.q_norm", "blocks.{i}.attention.q_norm", ""),
        ("layers.{i}.self_attn.k_norm", "blocks.{i}.attention.k_norm", ""),
    ),
    gguf_keys={**_GGUF_KEYS_NO_WINDOW, "head_dim": ("{arch}.attention.key_length",)},
    gguf_weights=(
        *_LLAMA_GGUF,  # the qwen3 converter does not permute q/k
        ("blk.{i}.attn_q_norm", "blocks.{i}.attention.q_norm", ""),
        ("blk.{i}.attn_k_norm", "blocks.{i}.attention.k_norm", ""),
    ),
)

OLMO2 = dataclasses.replace(
    LLAMA,
    name="olmo2",
    fixed={**LLAMA.fixed, "family": "olmo2", "norm_placement": "post", "qk_norm": "rms_all"},
    keys={
        **_LLAMA_KEYS,
        "qkv_bias": ("attention_bias",),
        "out_bias": ("attention_bias",),
    },
    defaults={**_LLAMA_DEFAULTS, "qkv_bias": False, "out_bias": False},
    weights=(
        *(r for r in _LLAMA_WEIGHTS if "layernorm" not in r[0]),
        ("layers.{i}.post_attention_layernorm", "blocks.{i}.attn_norm", ""),
        ("layers.{i}.post_feedforward_layernorm", "blocks.{i}.mlp_norm", ""),
        ("layers.{i}.self_attn.q_norm", "blocks.{i}.attention.q_norm", ""),
        ("layers.{i}.self_attn.k_norm", "blocks.{i}.attention.k_norm", ""),
    ),
    # llama.cpp writes a window only for OLMo 3 (with a per-layer pattern): not expressed
    refuse={"olmo2.attention.sliding_window": (None,)},
    gguf_keys=_GGUF_KEYS_NO_WINDOW,
    gguf_weights=(
        *(r for r in _LLAMA_GGUF if "norm" not in r[0]),
        ("output_norm", "norm", ""),
        ("blk.{i}.post_attention_norm", "blocks.{i}.attn_norm", ""),
        ("blk.{i}.post_ffw_norm", "blocks.{i}.mlp_norm", ""),
        ("blk.{i}.attn_q_norm", "blocks.{i}.attention.q_norm", ""),
        ("blk.{i}.attn_k_norm", "blocks.{i}.attention.k_norm", ""),
    ),
)

PHI3 = dataclasses.replace(
    LLAMA,
    name="phi3",
    fixed={**LLAMA.fixed, "family": "phi3"},
    keys=_LLAMA_KEYS,
    defaults=_LLAMA_DEFAULTS,
    refuse={},
    weights=(
        *(r for r in _LLAMA_WEIGHTS if "_proj" not in r[0] or "o_proj" in r[0]),
        ("layers.{i}.self_attn.qkv_proj", "blocks.{i}.attention.{qkv}", "qkv"),
        ("layers.{i}.mlp.gate_up_proj", "blocks.{i}.mlp.{gate_up}", "gate_up"),
        ("layers.{i}.mlp.down_proj", "blocks.{i}.mlp.down", ""),
    ),
    # llama.cpp keeps Phi-3's fused tensors: attn_qkv, and ffn_up holding gate then up.
    gguf_weights=(
        *(r for r in _LLAMA_GGUF if r[0][-2:] not in ("_q", "_k", "_v") and "ffn_" not in r[0]),
        ("blk.{i}.ffn_norm", "blocks.{i}.mlp_norm", ""),
        ("blk.{i}.attn_qkv", "blocks.{i}.attention.{qkv}", "qkv"),
        ("blk.{i}.ffn_up", "blocks.{i}.mlp.{gate_up}", "gate_up"),
        ("blk.{i}.ffn_down", "blocks.{i}.mlp.down", ""),
    ),
)

GEMMA2 = dataclasses.replace(
    LLAMA,
    name="gemma2",
    fixed={
        **LLAMA.fixed,
        "family": "gemma2",
        "norm_placement": "sandwich",
        "embed_scale": True,
    },
    keys={
        **{k: v for k, v in _LLAMA_KEYS.items() if k != "activation"},
        "activation": ("hidden_activation", "hidden_act"),
        "attn_softcap": ("attn_logit_softcapping",),
        "final_softcap": ("final_logit_softcapping",),
        "query_pre_attn_scalar": ("query_pre_attn_scalar",),
        "layer_types": ("layer_types",),
        "qkv_bias": ("attention_bias",),
        "out_bias": ("attention_bias",),
    },
    defaults={
        **_LLAMA_DEFAULTS,
        "activation": "gelu_pytorch_tanh",
        "tie_embeddings": True,
        "qkv_bias": False,
        "out_bias": False,
    },
    refuse={"use_bidirectional_attention": (None, False)},
    weights=(
        *(r for r in _LLAMA_WEIGHTS if "layernorm" not in r[0] and r[0] != "norm"),
        ("norm", "norm", "plus1"),
        ("layers.{i}.input_layernorm", "blocks.{i}.attn_norm", "plus1"),
        ("layers.{i}.post_attention_layernorm", "blocks.{i}.attn_post_norm", "plus1"),
        ("layers.{i}.pre_feedforward_layernorm", "blocks.{i}.mlp_norm", "plus1"),
        ("layers.{i}.post_feedforward_layernorm", "blocks.{i}.mlp_post_norm", "plus1"),
    ),
    gguf_keys={
        **_GGUF_KEYS,
        "head_dim": ("{arch}.attention.key_length",),
        "attn_softcap": ("{arch}.attn_logit_softcapping",),
        "final_softcap": ("{arch}.final_logit_softcapping",),
    },
    gguf_defaults={
        # llama.cpp: even layers local (window), odd layers global, as transformers'
        # default `layer_types`; the score scale 1/sqrt(head_dim), 1/sqrt(C/H) for the
        # 46-layer 27B (the file has no `query_pre_attn_scalar`).
        "layer_types": lambda f: (
            [("sliding_attention", "full_attention")[i % 2] for i in range(f["num_layers"])]
            if f.get("sliding_window")
            else None
        ),
        "query_pre_attn_scalar": lambda f: (
            f["hidden_size"] // f["num_heads"]
            if f["num_layers"] == 46
            else f.get("head_dim") or f["hidden_size"] // f["num_heads"]
        ),
    },
    # llama.cpp's converter stores Gemma's norms as `1 + weight` already: taken as they are.
    gguf_weights=(
        *(r for r in _LLAMA_GGUF if "norm" not in r[0]),
        ("output_norm", "norm", ""),
        ("blk.{i}.attn_norm", "blocks.{i}.attn_norm", ""),
        ("blk.{i}.post_attention_norm", "blocks.{i}.attn_post_norm", ""),
        ("blk.{i}.ffn_norm", "blocks.{i}.mlp_norm", ""),
        ("blk.{i}.post_ffw_norm", "blocks.{i}.mlp_post_norm", ""),
    ),
)

# llama.cpp's names for the LayerNorm decoders with a fused qkv (gpt_neox, bloom); their
# converters reorder the per-head (H, 3, D) rows to q, k, v one after the other.
_FUSED_GGUF: tuple[WeightRule, ...] = (
    ("token_embd", "tok_embeddings", ""),
    ("output_norm", "norm", ""),
    ("output", "lm_head", ""),
    ("blk.{i}.attn_norm", "blocks.{i}.attn_norm", ""),
    ("blk.{i}.attn_qkv", "blocks.{i}.attention.{qkv}", "qkv"),
    ("blk.{i}.attn_output", "blocks.{i}.attention.out_proj", ""),
    ("blk.{i}.ffn_norm", "blocks.{i}.mlp_norm", ""),
    ("blk.{i}.ffn_up", "blocks.{i}.mlp.up", ""),
    ("blk.{i}.ffn_down", "blocks.{i}.mlp.down", ""),
)
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
    weights=(
        ("word_embeddings", "tok_embeddings", ""),
        ("word_embeddings_layernorm", "embed_norm", ""),
        ("ln_f", "norm", ""),
        ("lm_head", "lm_head", ""),
        ("h.{i}.input_layernorm", "blocks.{i}.attn_norm", ""),
        ("h.{i}.post_attention_layernorm", "blocks.{i}.mlp_norm", ""),
        ("h.{i}.self_attention.query_key_value", "blocks.{i}.attention.{qkv}", "qkv_heads"),
        ("h.{i}.self_attention.dense", "blocks.{i}.attention.out_proj", ""),
        ("h.{i}.mlp.dense_h_to_4h", "blocks.{i}.mlp.up", ""),
        ("h.{i}.mlp.dense_4h_to_h", "blocks.{i}.mlp.down", ""),
    ),
    prefixes=("transformer.",),
    # ALiBi has no position table: the file's context_length (llama.cpp's converter writes
    # `seq_length` or else the width there) bounds nothing
    gguf_keys={k: v for k, v in _LAYER_NORM_GGUF_KEYS.items() if k != "context_length"},
    gguf_weights=(*_FUSED_GGUF, ("token_embd_norm", "embed_norm", "")),
)

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
        "qkv_bias": ("attention_bias",),
        "out_bias": ("attention_bias",),
    },
    defaults={
        "num_kv_heads": _same_as("num_heads"),  # GPT-NeoX has no grouped-query attention
        "tie_embeddings": False,
        "activation": "gelu",
        "parallel_residual": True,
        "qkv_bias": True,
        "out_bias": True,
    },
    weights=(
        ("embed_in", "tok_embeddings", ""),
        ("final_layer_norm", "norm", ""),
        ("lm_head", "lm_head", ""),
        ("embed_out", "lm_head", ""),
        ("layers.{i}.input_layernorm", "blocks.{i}.attn_norm", ""),
        ("layers.{i}.post_attention_layernorm", "blocks.{i}.mlp_norm", ""),
        ("layers.{i}.attention.query_key_value", "blocks.{i}.attention.{qkv}", "qkv_heads"),
        ("layers.{i}.attention.dense", "blocks.{i}.attention.out_proj", ""),
        ("layers.{i}.mlp.dense_h_to_4h", "blocks.{i}.mlp.up", ""),
        ("layers.{i}.mlp.dense_4h_to_h", "blocks.{i}.mlp.down", ""),
    ),
    prefixes=("gpt_neox.",),
    ignore=(r".*rotary_emb\.inv_freq$", r".*attention\.(masked_)?bias$"),
    gguf_keys={
        **_LAYER_NORM_GGUF_KEYS,
        "parallel_residual": ("{arch}.use_parallel_residual",),
    },
    gguf_weights=_FUSED_GGUF,
)

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
        # turned into `layer_scales` by the loader (attnlab.pretrained.build)
        "scale_attn_weights": ("scale_attn_weights",),
        "scale_attn_by_inverse_layer_idx": ("scale_attn_by_inverse_layer_idx",),
        # fp32 scores: what attnlab computes in fp32 anyway (read, checked, not needed)
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
    weights=(
        ("wte", "tok_embeddings", ""),
        ("wpe", "pos_embeddings", ""),
        ("ln_f", "norm", ""),
        ("lm_head", "lm_head", ""),
        ("h.{i}.ln_1", "blocks.{i}.attn_norm", ""),
        ("h.{i}.attn.c_attn", "blocks.{i}.attention.{qkv}", "T+qkv"),
        ("h.{i}.attn.c_proj", "blocks.{i}.attention.out_proj", "T"),
        ("h.{i}.ln_2", "blocks.{i}.mlp_norm", ""),
        ("h.{i}.mlp.c_fc", "blocks.{i}.mlp.up", "T"),
        ("h.{i}.mlp.c_proj", "blocks.{i}.mlp.down", "T"),
    ),
    prefixes=("transformer.",),
    ignore=(r".*\.attn\.(masked_)?bias$",),
    gguf_keys={
        **_GGUF_KEYS,
        "norm_eps": ("{arch}.attention.layer_norm_epsilon",),
    },
    gguf_weights=(
        ("token_embd", "tok_embeddings", ""),
        ("position_embd", "pos_embeddings", ""),
        ("output_norm", "norm", ""),
        ("output", "lm_head", ""),
        ("blk.{i}.attn_norm", "blocks.{i}.attn_norm", ""),
        ("blk.{i}.attn_qkv", "blocks.{i}.attention.{qkv}", "qkv"),
        ("blk.{i}.attn_output", "blocks.{i}.attention.out_proj", ""),
        ("blk.{i}.ffn_norm", "blocks.{i}.mlp_norm", ""),
        ("blk.{i}.ffn_up", "blocks.{i}.mlp.up", ""),
        ("blk.{i}.ffn_down", "blocks.{i}.mlp.down", ""),
    ),
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
    refuse={
        "position_embedding_type": (None, "absolute"),
        "is_decoder": (None, False),
        "add_cross_attention": (None, False),
    },
    weights=(
        ("embeddings.word_embeddings", "word_embeddings", ""),
        ("embeddings.position_embeddings", "position_embeddings", ""),
        ("embeddings.token_type_embeddings", "token_type_embeddings", ""),
        ("embeddings.LayerNorm", "embed_norm", ""),
        ("encoder.layer.{i}.attention.self.query", "layers.{i}.attention.W_query", ""),
        ("encoder.layer.{i}.attention.self.key", "layers.{i}.attention.W_key", ""),
        ("encoder.layer.{i}.attention.self.value", "layers.{i}.attention.W_value", ""),
        ("encoder.layer.{i}.attention.output.dense", "layers.{i}.attention.out_proj", ""),
        ("encoder.layer.{i}.attention.output.LayerNorm", "layers.{i}.attn_norm", ""),
        ("encoder.layer.{i}.intermediate.dense", "layers.{i}.ffn_in", ""),
        ("encoder.layer.{i}.output.dense", "layers.{i}.ffn_out", ""),
        ("encoder.layer.{i}.output.LayerNorm", "layers.{i}.ffn_norm", ""),
    ),
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


def _t5_stack(stack: str, layer_names: tuple[tuple[str, str], ...]) -> tuple[WeightRule, ...]:
    """T5's names for one stack; ``layer_names`` maps its sub-layer paths to ours."""
    rules: list[WeightRule] = [
        (f"{stack}.final_layer_norm", f"{stack}.norm", ""),
        # The table lives in the first layer; attnlab's stack owns it and shares it.
        (
            f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias",
            f"{stack}.relative_bias",
            "",
        ),
    ]
    for src, ours in layer_names:
        rules.append((f"{stack}.block.{{i}}.{src}", f"{stack}.blocks.{{i}}.{ours}", ""))
    return tuple(rules)


def _t5_attention(src: str, ours: str) -> tuple[tuple[str, str], ...]:
    return tuple(
        (f"{src}.{a}", f"{ours}.{b}")
        for a, b in (("q", "W_query"), ("k", "W_key"), ("v", "W_value"), ("o", "out_proj"))
    )


def _t5_mlp(layer: int) -> tuple[tuple[str, str], ...]:
    return (
        (f"layer.{layer}.DenseReluDense.wi", "mlp.up"),  # ReLU T5
        (f"layer.{layer}.DenseReluDense.wi_0", "mlp.gate"),  # gated (v1.1, Flan)
        (f"layer.{layer}.DenseReluDense.wi_1", "mlp.up"),
        (f"layer.{layer}.DenseReluDense.wo", "mlp.down"),
        (f"layer.{layer}.layer_norm", "mlp_norm"),
    )


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
    weights=(
        ("shared", "shared", ""),
        ("lm_head", "decoder.lm_head", ""),
        *_t5_stack(
            "encoder",
            (
                *_t5_attention("layer.0.SelfAttention", "attention"),
                ("layer.0.layer_norm", "attn_norm"),
                *_t5_mlp(1),
            ),
        ),
        *_t5_stack(
            "decoder",
            (
                *_t5_attention("layer.0.SelfAttention", "attention"),
                ("layer.0.layer_norm", "attn_norm"),
                *_t5_attention("layer.1.EncDecAttention", "cross_attention"),
                ("layer.1.layer_norm", "cross_norm"),
                *_t5_mlp(2),
            ),
        ),
    ),
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
        GEMMA2,
        GPT_NEOX,
        BLOOM,
        GPT2,
        BERT,
        ROBERTA,
        T5,
    )
}


def family_for(name: str, *, source: str) -> Family:
    """The family for a ``model_type`` / GGUF architecture.

    Raises:
        ValueError: an unknown name; the message lists the supported ones.
    """
    if name not in FAMILIES:
        raise ValueError(
            f"{source}: model type {name!r} is not supported; supported: "
            f"{', '.join(sorted(FAMILIES))}"
        )
    return FAMILIES[name]
