"""The weight-name and key tables several pages share: the Llama layout under
Hugging Face's and llama.cpp's names, and llama.cpp's keys."""

from __future__ import annotations

from typing import Any

from attnlab.models.families.base import (
    WeightTable,
    same_as,
)

# Hugging Face Llama-layout names (Llama, Mistral, Qwen2, ...), after "model." is stripped.
LLAMA_WEIGHTS: WeightTable = {
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
QK_NORM_WEIGHTS: WeightTable = {
    "blocks.{i}.attention.q_norm": ("layers.{i}.self_attn.q_norm", ""),
    "blocks.{i}.attention.k_norm": ("layers.{i}.self_attn.k_norm", ""),
}

# llama.cpp's names for the same layout (llama, qwen2, qwen3, ... in GGUF).
LLAMA_GGUF: WeightTable = {
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
QK_NORM_GGUF: WeightTable = {
    "blocks.{i}.attention.q_norm": ("blk.{i}.attn_q_norm", ""),
    "blocks.{i}.attention.k_norm": ("blk.{i}.attn_k_norm", ""),
}

LLAMA_KEYS: dict[str, tuple[str, ...]] = {
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
LLAMA_DEFAULTS: dict[str, Any] = {
    "num_kv_heads": same_as("num_heads"),
    "tie_embeddings": False,
    "activation": "silu",
}
ATTENTION_BIAS_KEYS = {"qkv_bias": ("attention_bias",), "out_bias": ("attention_bias",)}
NO_BIAS = {"qkv_bias": False, "out_bias": False}
# Every architecture's keys as llama.cpp writes them. The head dims (key_length,
# value_length) are written by its converters whenever `head_dim` is in config.json, for
# every architecture; `value_head_dim` is checked against the head dim by the loader.
GGUF_KEYS: dict[str, tuple[str, ...]] = {
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
GGUF_KEYS_NO_WINDOW = {k: v for k, v in GGUF_KEYS.items() if k != "sliding_window"}


DENSE_MLP = ("blocks.{i}.mlp.gate", "blocks.{i}.mlp.up", "blocks.{i}.mlp.down")
EXPERT_KEYS: dict[str, tuple[str, ...]] = {
    "num_local_experts": ("num_local_experts", "num_experts"),
    "num_experts_per_tok": ("num_experts_per_tok",),
}

Q_K_V = tuple(f"blocks.{{i}}.attention.{w}" for w in ("W_query", "W_key", "W_value"))

LAYER_NORM_GGUF_KEYS = {
    **GGUF_KEYS_NO_WINDOW,
    "norm_eps": ("{arch}.attention.layer_norm_epsilon",),
}
