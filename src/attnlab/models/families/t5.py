"""T5, the encoder-decoder (v1.0 with ReLU, v1.1 and Flan gated)."""

from __future__ import annotations

from collections.abc import Mapping

from attnlab.models.families.base import (
    Family,
    same_as,
)


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
        "num_decoder_layers": same_as("num_layers"),
        "activation": "relu",
        "gated_mlp": lambda f: str(f["activation"]).startswith("gated-"),
        "tie_embeddings": True,
        "scale_decoder_outputs": True,
        "relative_buckets": 32,
        "relative_max_distance": 128,
        "pad_token_id": 0,
        "decoder_start_token_id": same_as("pad_token_id"),
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
