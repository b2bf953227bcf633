"""StableLM: LayerNorm, partial rotary, a per-head QK LayerNorm, the parallel form."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from attnlab.models.families.base import (
    Family,
    Source,
    partial_rope,
    pop_flag,
)
from attnlab.models.families.layouts import (
    LAYER_NORM_GGUF_KEYS,
    LLAMA_DEFAULTS,
    LLAMA_GGUF,
    LLAMA_KEYS,
    LLAMA_WEIGHTS,
    QK_NORM_GGUF,
)


def _stablelm(fields: dict[str, Any], config: Mapping[str, Any], source: Source) -> None:
    """StableLM's rotated fraction (``partial_rotary_factor``, 0.25 when absent, as
    transformers' ``StableLmConfig``) and its QK-norm: a LayerNorm per head with its own
    weight, from ``qk_layernorm`` (GGUF: the ``attn_q_norm`` tensors, as llama.cpp)."""
    if source == "hf":
        partial_rope(fields, config)
        qk = pop_flag(fields, "qk_layernorm", False)
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
        **LLAMA_KEYS,
        "norm_eps": ("layer_norm_eps",),
        "qkv_bias": ("use_qkv_bias",),
        "parallel_residual": ("use_parallel_residual",),
        "qk_layernorm": ("qk_layernorm",),
    },
    defaults={**LLAMA_DEFAULTS, "qkv_bias": False, "norm_eps": 1e-5},
    weights={
        **LLAMA_WEIGHTS,
        "blocks.{i}.attention.q_norm": ("layers.{i}.self_attn.q_layernorm.norms.{j}", ""),
        "blocks.{i}.attention.k_norm": ("layers.{i}.self_attn.k_layernorm.norms.{j}", ""),
    },
    prefixes=("model.",),
    ignore=(r".*rotary_emb\.inv_freq$",),
    gguf_keys={
        **LAYER_NORM_GGUF_KEYS,
        "parallel_residual": ("{arch}.use_parallel_residual",),
    },
    # llama.cpp's StableLMModel does not permute q/k; it stacks the per-head norms
    gguf_weights={**LLAMA_GGUF, **QK_NORM_GGUF},
    hook=_stablelm,
)
