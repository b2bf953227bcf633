"""The encoders: BERT and RoBERTa."""

from __future__ import annotations

import dataclasses

from attnlab.models.families.base import (
    SIZES,
    Family,
)

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
    required=(*SIZES, "max_position_embeddings", "layer_norm_eps"),
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
