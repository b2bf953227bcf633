"""Qwen2, Qwen3 and Qwen3-MoE: Llama's layout with Qwen's window rule."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from attnlab.models.families.base import (
    Source,
    moe_config,
    pop_count,
    pop_flag,
    without,
)
from attnlab.models.families.layouts import (
    ATTENTION_BIAS_KEYS,
    DENSE_MLP,
    EXPERT_KEYS,
    GGUF_KEYS_NO_WINDOW,
    LLAMA_DEFAULTS,
    LLAMA_GGUF,
    LLAMA_KEYS,
    LLAMA_WEIGHTS,
    NO_BIAS,
    QK_NORM_GGUF,
    QK_NORM_WEIGHTS,
)
from attnlab.models.families.llama import LLAMA


def qwen_windows(fields: dict[str, Any], config: Mapping[str, Any], source: Source) -> None:
    """Qwen2/Qwen3's window rule: ``sliding_window`` counts only with
    ``use_sliding_window``, and then (unless ``layer_types`` says it per layer) on the
    layers from ``max_window_layers`` on, as transformers builds its ``layer_types``.
    llama.cpp ignores windows for these architectures (its GGUF keys read none)."""
    use = pop_flag(fields, "use_sliding_window", False)
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
    **LLAMA_KEYS,
    "layer_types": ("layer_types",),
    "use_sliding_window": ("use_sliding_window",),
    "max_window_layers": ("max_window_layers",),
}


QWEN2 = dataclasses.replace(
    LLAMA,
    name="qwen2",
    fixed={**LLAMA.fixed, "family": "qwen2", "qkv_bias": True, "out_bias": False},
    keys=_QWEN_KEYS,
    defaults=LLAMA_DEFAULTS,
    refuse={},
    gguf_keys=GGUF_KEYS_NO_WINDOW,
    gguf_weights=LLAMA_GGUF,  # the qwen2 converter does not permute q/k
    hook=qwen_windows,
)

QWEN3 = dataclasses.replace(
    QWEN2,
    name="qwen3",
    fixed={**LLAMA.fixed, "family": "qwen3", "qk_norm": "rms_head"},
    keys={**_QWEN_KEYS, **ATTENTION_BIAS_KEYS},
    defaults={**LLAMA_DEFAULTS, **NO_BIAS},
    weights={**LLAMA_WEIGHTS, **QK_NORM_WEIGHTS},
    gguf_weights={**LLAMA_GGUF, **QK_NORM_GGUF},  # the qwen3 converter does not permute q/k
)


def _qwen3_moe(fields: dict[str, Any], config: Mapping[str, Any], source: Source) -> None:
    """Qwen3-MoE: Qwen3's attention and window rule; the experts (softmax router,
    ``norm_topk_prob`` renormalises, each of ``moe_intermediate_size``) on every
    ``decoder_sparse_step``-th layer not in ``mlp_only_layers``, the dense MLP of
    ``intermediate_size`` on the others (every layer with 0 experts), as transformers'
    ``Qwen3MoeDecoderLayer`` chooses."""
    qwen_windows(fields, config, source)
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
    moe = moe_config(fields, size_key="moe_intermediate_size", renormalize="norm_topk_prob")
    step = pop_count(fields, "decoder_sparse_step")
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


QWEN3_MOE = dataclasses.replace(
    QWEN3,
    name="qwen3_moe",
    fixed={**QWEN3.fixed, "family": "qwen3_moe"},
    keys={
        **QWEN3.keys,
        **EXPERT_KEYS,
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
        **GGUF_KEYS_NO_WINDOW,
        "num_local_experts": ("{arch}.expert_count",),
        "num_experts_per_tok": ("{arch}.expert_used_count",),
        "moe_intermediate_size": ("{arch}.expert_feed_forward_length",),
    },
    gguf_defaults={"norm_topk_prob": True, "decoder_sparse_step": 1},
    gguf_weights={
        **without(LLAMA_GGUF, *DENSE_MLP),
        **QK_NORM_GGUF,
        "blocks.{i}.mlp.router": ("blk.{i}.ffn_gate_inp", ""),
        "blocks.{i}.mlp.experts.gate": ("blk.{i}.ffn_gate_exps", ""),
        "blocks.{i}.mlp.experts.up": ("blk.{i}.ffn_up_exps", ""),
        "blocks.{i}.mlp.experts.down": ("blk.{i}.ffn_down_exps", ""),
    },
    hook=_qwen3_moe,
)
