"""Gemma 2 and Gemma 3: sandwich norms, local and global layers, soft-capping."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from attnlab.models.families.base import (
    Source,
    WeightTable,
    alternating,
)
from attnlab.models.families.layouts import (
    ATTENTION_BIAS_KEYS,
    GGUF_KEYS,
    LLAMA_DEFAULTS,
    LLAMA_GGUF,
    LLAMA_KEYS,
    LLAMA_WEIGHTS,
    NO_BIAS,
    QK_NORM_GGUF,
)
from attnlab.models.families.llama import LLAMA
from attnlab.rope import RopeConfig


def _pre_attn_scalar(fields: dict[str, Any]) -> None:
    """Gemma's ``query_pre_attn_scalar`` as the score scale ``scalar ** -0.5``."""
    scalar = fields.pop("query_pre_attn_scalar", None)
    if scalar is None:
        return
    if isinstance(scalar, bool) or not isinstance(scalar, (int, float)) or not scalar > 0:
        raise ValueError(f"`query_pre_attn_scalar` must be > 0, got {scalar!r}")
    fields["attn_scale"] = float(scalar) ** -0.5


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
        fields["layer_types"] = alternating(fields["num_layers"], 2)
    _pre_attn_scalar(fields)
    if source == "gguf":
        _gguf_gemma_scale(fields, GEMMA2_27B_LAYERS)


# Gemma's Hugging Face norms multiply by (1 + weight); llama.cpp's converter stores the sum.
_GEMMA_WEIGHTS: WeightTable = {
    **LLAMA_WEIGHTS,
    "norm": ("norm", "plus1"),
    "blocks.{i}.attn_norm": ("layers.{i}.input_layernorm", "plus1"),
    "blocks.{i}.attn_post_norm": ("layers.{i}.post_attention_layernorm", "plus1"),
    "blocks.{i}.mlp_norm": ("layers.{i}.pre_feedforward_layernorm", "plus1"),
    "blocks.{i}.mlp_post_norm": ("layers.{i}.post_feedforward_layernorm", "plus1"),
}
_GEMMA_GGUF: WeightTable = {
    **LLAMA_GGUF,
    "blocks.{i}.attn_post_norm": ("blk.{i}.post_attention_norm", ""),
    "blocks.{i}.mlp_post_norm": ("blk.{i}.post_ffw_norm", ""),
}
_GEMMA_KEYS: dict[str, tuple[str, ...]] = {
    **LLAMA_KEYS,
    **ATTENTION_BIAS_KEYS,
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
        **LLAMA_DEFAULTS,
        **NO_BIAS,
        "activation": "gelu_pytorch_tanh",
        "tie_embeddings": True,
    },
    refuse={"use_bidirectional_attention": (None, False)},
    weights=_GEMMA_WEIGHTS,
    gguf_keys={
        **GGUF_KEYS,
        "attn_softcap": ("{arch}.attn_logit_softcapping",),
        "final_softcap": ("{arch}.final_logit_softcapping",),
    },
    gguf_weights=_GEMMA_GGUF,
    hook=_gemma2,
)

# transformers' Gemma3TextConfig defaults: the hub's multimodal configs leave most keys to
# them (a `text_config` of five keys is common).
_GEMMA3_DEFAULTS: dict[str, Any] = {
    **LLAMA_DEFAULTS,
    **NO_BIAS,
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
        fields["layer_types"] = alternating(fields["num_layers"], period)
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
    gguf_keys=GGUF_KEYS,
    gguf_defaults={
        "head_dim": lambda f: f["hidden_size"] // f["num_heads"],
        "query_pre_attn_scalar": None,
        "rope_theta": 1_000_000.0,
    },
    gguf_weights={**_GEMMA_GGUF, **QK_NORM_GGUF},
    hook=_gemma3,
    model_types=("gemma3_text",),
    text_config="text_config",
)
