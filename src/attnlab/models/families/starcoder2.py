"""StarCoder2: Llama's names with LayerNorm and a plain MLP."""

from __future__ import annotations

from attnlab.models.families.base import (
    Family,
    without,
)
from attnlab.models.families.layouts import (
    GGUF_KEYS_NO_WINDOW,
    LLAMA_DEFAULTS,
    LLAMA_GGUF,
    LLAMA_KEYS,
    LLAMA_WEIGHTS,
)

_PLAIN_MLP_GGUF = without(LLAMA_GGUF, "blocks.{i}.mlp.gate")

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
        **LLAMA_KEYS,
        "norm_eps": ("norm_epsilon",),
        "qkv_bias": ("use_bias",),
        "out_bias": ("use_bias",),
        "mlp_bias": ("use_bias",),
    },
    defaults={
        **LLAMA_DEFAULTS,
        "activation": "gelu_pytorch_tanh",
        "tie_embeddings": True,
        "qkv_bias": True,
        "out_bias": True,
        "mlp_bias": True,
        "norm_eps": 1e-5,
    },
    refuse={"norm_type": (None, "layer_norm"), "mlp_type": (None, "default")},
    weights={
        **without(LLAMA_WEIGHTS, "blocks.{i}.mlp.gate"),
        "blocks.{i}.mlp.up": ("layers.{i}.mlp.c_fc", ""),
        "blocks.{i}.mlp.down": ("layers.{i}.mlp.c_proj", ""),
    },
    prefixes=("model.",),
    ignore=(r".*rotary_emb\.inv_freq$",),
    # llama.cpp writes no window for starcoder2 and applies none
    gguf_keys=GGUF_KEYS_NO_WINDOW,
    gguf_weights=_PLAIN_MLP_GGUF,
)
