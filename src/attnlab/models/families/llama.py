"""Llama and the families that keep its layout with a rule or two of their own: Mistral,
Granite, SmolLM3 (NoPE layers), OLMo 2 (post-norm, QK-norm) and Mixtral (experts)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from attnlab.models.families.base import (
    Family,
    Source,
    moe_config,
    pop_flag,
    pop_layer_flags,
    pop_period,
    without,
)
from attnlab.models.families.layouts import (
    ATTENTION_BIAS_KEYS,
    DENSE_MLP,
    EXPERT_KEYS,
    GGUF_KEYS,
    GGUF_KEYS_NO_WINDOW,
    LLAMA_DEFAULTS,
    LLAMA_GGUF,
    LLAMA_KEYS,
    LLAMA_WEIGHTS,
    NO_BIAS,
    QK_NORM_GGUF,
    QK_NORM_WEIGHTS,
)

LLAMA = Family(
    name="llama",
    kind="decoder",
    fixed={"norm": "rms", "mlp": "gated", "positions": "rope", "family": "llama"},
    keys={**LLAMA_KEYS, **ATTENTION_BIAS_KEYS, "mlp_bias": ("mlp_bias",)},
    defaults={**LLAMA_DEFAULTS, **NO_BIAS, "mlp_bias": False},
    refuse={"pretraining_tp": (None, 1)},
    weights=LLAMA_WEIGHTS,
    prefixes=("model.",),
    ignore=(r".*rotary_emb\.inv_freq$",),
    gguf_keys=GGUF_KEYS,
    # llama.cpp's converter permutes the q/k rows of the "llama" architecture (only).
    gguf_weights={
        **LLAMA_GGUF,
        "blocks.{i}.attention.W_query": ("blk.{i}.attn_q", "rope_q"),
        "blocks.{i}.attention.W_key": ("blk.{i}.attn_k", "rope_k"),
    },
)

MISTRAL = dataclasses.replace(
    LLAMA,
    name="mistral",
    fixed={**LLAMA.fixed, "family": "mistral"},
    keys=LLAMA_KEYS,
    defaults=LLAMA_DEFAULTS,
    refuse={},
    gguf_weights={},
    gguf_note="llama.cpp writes Mistral as 'llama'",
)


OLMO2 = dataclasses.replace(
    LLAMA,
    name="olmo2",
    fixed={**LLAMA.fixed, "family": "olmo2", "norm_placement": "post", "qk_norm": "rms_all"},
    keys={**LLAMA_KEYS, **ATTENTION_BIAS_KEYS},
    defaults={**LLAMA_DEFAULTS, **NO_BIAS},
    # post-norm: the norms after attention and after the MLP
    weights={
        **LLAMA_WEIGHTS,
        **QK_NORM_WEIGHTS,
        "blocks.{i}.attn_norm": ("layers.{i}.post_attention_layernorm", ""),
        "blocks.{i}.mlp_norm": ("layers.{i}.post_feedforward_layernorm", ""),
    },
    # llama.cpp writes a window only for OLMo 3 (with a per-layer pattern): not expressed
    refuse={"olmo2.attention.sliding_window": (None,)},
    gguf_keys=GGUF_KEYS_NO_WINDOW,
    gguf_weights={
        **LLAMA_GGUF,
        **QK_NORM_GGUF,
        "blocks.{i}.attn_norm": ("blk.{i}.post_attention_norm", ""),
        "blocks.{i}.mlp_norm": ("blk.{i}.post_ffw_norm", ""),
    },
)


def _smollm3(fields: dict[str, Any], config: Mapping[str, Any], source: Source) -> None:
    """SmolLM3's NoPE layers and windows, as transformers' ``SmolLM3Config`` derives them.

    ``no_rope_layers`` holds one 1 (the layer rotates) or 0 (no rotary: NoPE) per layer;
    without it every ``no_rope_layer_interval``-th layer (default 4) is NoPE. A window
    counts only with ``use_sliding_window``, and then (unless ``layer_types`` says it per
    layer) on the NoPE layers.
    """
    period = pop_period(fields, "no_rope_layer_interval")
    rotary = pop_layer_flags(fields, "no_rope_layers")
    if rotary is None:
        rotary = tuple(bool((i + 1) % period) for i in range(fields["num_layers"]))
    if not all(rotary):
        fields["layer_rotary"] = rotary
    if not pop_flag(fields, "use_sliding_window", False):
        fields.pop("sliding_window", None)
        fields["layer_types"] = None
    elif fields.get("layer_types") is None and fields.get("sliding_window") is not None:
        fields["layer_types"] = ["full_attention" if r else "sliding_attention" for r in rotary]


SMOLLM3 = dataclasses.replace(
    LLAMA,
    name="smollm3",
    fixed={**LLAMA.fixed, "family": "smollm3"},
    keys={
        **LLAMA_KEYS,
        **ATTENTION_BIAS_KEYS,
        "mlp_bias": ("mlp_bias",),
        "layer_types": ("layer_types",),
        "use_sliding_window": ("use_sliding_window",),
        "no_rope_layers": ("no_rope_layers",),
        "no_rope_layer_interval": ("no_rope_layer_interval",),
    },
    defaults={
        **LLAMA_DEFAULTS,
        **NO_BIAS,
        "mlp_bias": False,
        "tie_embeddings": True,
        "no_rope_layer_interval": 4,
    },
    refuse={},
    # llama.cpp's smollm3: every 4th layer NoPE (fixed), no window; q/k rows permuted as
    # for "llama" (its converter is the llama one)
    gguf_keys=GGUF_KEYS_NO_WINDOW,
    gguf_defaults={"no_rope_layer_interval": 4},
    gguf_weights=LLAMA.gguf_weights,
    hook=_smollm3,
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
        **GGUF_KEYS,
        "attn_scale": ("{arch}.attention.scale",),
        "embed_multiplier": ("{arch}.embedding_scale",),
        "residual_multiplier": ("{arch}.residual_scale",),
        "logits_scaling": ("{arch}.logit_scale",),
    },
    # llama.cpp: no attention.scale in the file means 1/sqrt(D)
    gguf_defaults={"attn_scale": None},
    # llama.cpp's GraniteModel is its LlamaModel: q/k rows permuted (LLAMA's gguf_weights)
)


def _mixtral(fields: dict[str, Any], config: Mapping[str, Any], source: Source) -> None:
    """Mixtral: every layer's feed-forward is the experts (softmax router, top-k weights
    renormalised), each of ``intermediate_size``; ``router_jitter_noise`` only trains."""
    fields["moe"] = moe_config(fields, size_key="intermediate_size", renormalize=True)


MIXTRAL = dataclasses.replace(
    LLAMA,
    name="mixtral",
    fixed={**LLAMA.fixed, "family": "mixtral"},
    keys={**LLAMA_KEYS, **EXPERT_KEYS},
    defaults={**LLAMA_DEFAULTS, **NO_BIAS, "num_local_experts": 8, "num_experts_per_tok": 2},
    refuse={},
    weights={
        **without(LLAMA_WEIGHTS, "blocks.{i}.mlp.gate", "blocks.{i}.mlp.up", "blocks.{i}.mlp.down"),
        "blocks.{i}.mlp.router": ("layers.{i}.block_sparse_moe.gate", ""),
        # one tensor per expert in the file, stacked into (E, ...) rows
        "blocks.{i}.mlp.experts.gate": ("layers.{i}.block_sparse_moe.experts.{j}.w1", ""),
        "blocks.{i}.mlp.experts.up": ("layers.{i}.block_sparse_moe.experts.{j}.w3", ""),
        "blocks.{i}.mlp.experts.down": ("layers.{i}.block_sparse_moe.experts.{j}.w2", ""),
    },
    # llama.cpp writes Mixtral as architecture "llama" with `llama.expert_count`; q/k rows
    # permuted as for llama, the experts stacked
    gguf_arch="llama",
    gguf_variant_key="llama.expert_count",
    gguf_keys={
        **GGUF_KEYS_NO_WINDOW,  # llama.cpp's llama architecture has no window
        "num_local_experts": ("{arch}.expert_count",),
        "num_experts_per_tok": ("{arch}.expert_used_count",),
    },
    gguf_weights={
        **without(LLAMA.gguf_weights, *DENSE_MLP),
        "blocks.{i}.mlp.router": ("blk.{i}.ffn_gate_inp", ""),
        "blocks.{i}.mlp.experts.gate": ("blk.{i}.ffn_gate_exps", ""),
        "blocks.{i}.mlp.experts.up": ("blk.{i}.ffn_up_exps", ""),
        "blocks.{i}.mlp.experts.down": ("blk.{i}.ffn_down_exps", ""),
    },
    hook=_mixtral,
)
