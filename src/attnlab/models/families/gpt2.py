"""GPT-2, GPT-NeoX and BLOOM: the LayerNorm decoders with a fused query/key/value
projection."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from attnlab.models.families.base import (
    Family,
    Source,
    WeightTable,
    partial_rope,
    pop_flag,
    same_as,
)
from attnlab.models.families.layouts import (
    ATTENTION_BIAS_KEYS,
    GGUF_KEYS,
    LAYER_NORM_GGUF_KEYS,
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
        "num_kv_heads": same_as("num_heads"),
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
    gguf_keys={k: v for k, v in LAYER_NORM_GGUF_KEYS.items() if k != "context_length"},
    gguf_weights={**_FUSED_GGUF, "embed_norm": ("token_embd_norm", "")},
)


def _gpt_neox_rope(fields: dict[str, Any], config: Mapping[str, Any], source: Source) -> None:
    """GPT-NeoX's own names for its RoPE in ``config.json`` (Pythia's hub configs):
    ``rotary_emb_base`` (default 10000) and ``rotary_pct`` (default 0.25, transformers'
    ``GPTNeoXConfig``), where ``rope_parameters`` / ``rope_scaling`` give none."""
    if source == "hf":
        partial_rope(fields, config, base_key="rotary_emb_base", fraction_key="rotary_pct")


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
        **ATTENTION_BIAS_KEYS,
    },
    defaults={
        "num_kv_heads": same_as("num_heads"),  # GPT-NeoX has no grouped-query attention
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
        **LAYER_NORM_GGUF_KEYS,
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
    scaled = pop_flag(fields, "scale_attn_weights", True)
    inverse = pop_flag(fields, "scale_attn_by_inverse_layer_idx", False)
    pop_flag(fields, "reorder_and_upcast_attn", False)
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
        "num_kv_heads": same_as("num_heads"),
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
        **GGUF_KEYS,
        "norm_eps": ("{arch}.attention.layer_norm_epsilon",),
    },
    # llama.cpp's converter stores GPT-2's Conv1D weights transposed (as nn.Linear's)
    gguf_weights={**_FUSED_GGUF, "pos_embeddings": ("position_embd", "")},
    hook=_gpt2_score_scales,
)
