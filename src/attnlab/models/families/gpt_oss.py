"""gpt-oss: attention sinks, alternating windows, biased experts with a clamped SwiGLU."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from attnlab.models.families.base import (
    Family,
    Source,
    alternating,
    moe_config,
    pop_positive,
    without,
)
from attnlab.models.families.layouts import (
    ATTENTION_BIAS_KEYS,
    DENSE_MLP,
    EXPERT_KEYS,
    GGUF_KEYS,
    LLAMA_DEFAULTS,
    LLAMA_GGUF,
    LLAMA_KEYS,
    LLAMA_WEIGHTS,
)
from attnlab.rope import RopeConfig

# transformers' GptOssConfig defaults where config.json says nothing: YaRN x32 over 4096
# positions with the ramp's ends not rounded (truncate false), base 150000.
_GPT_OSS_ROPE: dict[str, Any] = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
GPT_OSS_ROPE_THETA = 150_000.0
# The clamped SwiGLU's (limit, alpha): transformers' defaults, and what llama.cpp's
# gpt-oss graph hard-codes (its GGUF files carry neither).
GPT_OSS_SWIGLU = (7.0, 1.702)


def _gpt_oss(fields: dict[str, Any], config: Mapping[str, Any], source: Source) -> None:
    """gpt-oss, as transformers' ``GptOssConfig`` / ``GptOssModel`` and llama.cpp's
    ``gpt-oss`` architecture build it.

    Attention: a learned sink logit per head joins every softmax (``attn_sinks``), biases on
    the q/k/v/o projections (``attention_bias``), YaRN RoPE, and layers that alternate
    between a window of ``sliding_window`` (128) and the full context: ``layer_types``, else
    the even layers local (transformers' default; llama.cpp's SWA pattern 2). Every layer's
    feed-forward is ``num_local_experts`` experts of width ``intermediate_size``, the top
    ``num_experts_per_tok`` chosen per token by a router with a bias, their weights the
    softmax over the chosen logits (= softmax over all, renormalised over the top k); each
    expert has biases and computes the clamped SwiGLU of ``swiglu_limit`` / ``swiglu_alpha``.
    """
    limit = pop_positive(fields, "swiglu_limit")
    alpha = pop_positive(fields, "swiglu_alpha")
    moe = moe_config(fields, size_key="intermediate_size", renormalize=True)
    fields["moe"] = dataclasses.replace(
        moe, router_bias=True, expert_bias=True, clamped_swiglu=(limit, alpha)
    )
    layers = fields["num_layers"]
    if source == "gguf":
        if fields.get("sliding_window") is None:
            raise ValueError(
                "lacks `gpt-oss.attention.sliding_window` (llama.cpp requires it for gpt-oss)"
            )
        fields["layer_types"] = alternating(layers, 2)
        return
    quant = config.get("quantization_config")
    method = quant.get("quant_method") if isinstance(quant, Mapping) else quant
    if quant is not None and method != "mxfp4":  # the loader reads MXFP4's tensor pairs
        raise ValueError(
            f"`quantization_config` with quant_method {method!r} is not supported "
            "(supported: 'mxfp4', the hub's gpt-oss experts)"
        )
    if "sliding_window" in config and config["sliding_window"] is None:
        fields.pop("sliding_window", None)  # transformers: no window on any layer
        fields["layer_types"] = None
    elif fields.get("layer_types") is None:
        fields["layer_types"] = alternating(layers, 2)
    if not config.get("rope_parameters") and not config.get("rope_scaling"):
        config = {**config, "rope_parameters": _GPT_OSS_ROPE}
    params = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    if params.get("rope_theta") is None and config.get("rope_theta") is None:
        params["rope_theta"] = GPT_OSS_ROPE_THETA  # transformers' default_theta for gpt_oss
    try:
        fields["rope"] = RopeConfig.from_hf_config({**config, "rope_parameters": params})
    except (ValueError, TypeError) as e:
        raise ValueError(f"rope settings: {e}") from None


_GPT_OSS_EXPERTS = "layers.{i}.mlp.experts"
GPT_OSS = Family(
    name="gpt_oss",
    kind="decoder",
    fixed={
        "norm": "rms",
        "mlp": "gated",
        "positions": "rope",
        "attn_sinks": True,
        "family": "gpt_oss",
    },
    keys={
        **LLAMA_KEYS,
        **ATTENTION_BIAS_KEYS,
        **EXPERT_KEYS,
        "layer_types": ("layer_types",),
        "swiglu_limit": ("swiglu_limit",),
        "swiglu_alpha": ("swiglu_alpha",),
    },
    # transformers' GptOssConfig defaults
    defaults={
        **LLAMA_DEFAULTS,
        "qkv_bias": True,
        "out_bias": True,
        "head_dim": 64,
        "sliding_window": 128,
        "num_local_experts": 128,
        "num_experts_per_tok": 4,
        "swiglu_limit": GPT_OSS_SWIGLU[0],
        "swiglu_alpha": GPT_OSS_SWIGLU[1],
    },
    weights={
        **without(LLAMA_WEIGHTS, *DENSE_MLP),
        "blocks.{i}.attention.sinks": ("layers.{i}.self_attn.sinks", ""),
        "blocks.{i}.mlp.router": ("layers.{i}.mlp.router", ""),
        # stacked (E, C, 2F): x @ it; gate and up alternate along 2F
        "blocks.{i}.mlp.experts.{gate_up}": (
            f"{_GPT_OSS_EXPERTS}.gate_up_proj",
            "Tx+gate_up_pairs",
        ),
        "blocks.{i}.mlp.experts.{gate_up}.bias": (
            f"{_GPT_OSS_EXPERTS}.gate_up_proj_bias",
            "gate_up_pairs",
        ),
        "blocks.{i}.mlp.experts.down": (f"{_GPT_OSS_EXPERTS}.down_proj", "Tx"),
        "blocks.{i}.mlp.experts.down.bias": (f"{_GPT_OSS_EXPERTS}.down_proj_bias", ""),
    },
    prefixes=("model.",),
    ignore=(r".*rotary_emb\.inv_freq$",),
    gguf_arch="gpt-oss",
    gguf_keys={
        **GGUF_KEYS,
        "num_local_experts": ("{arch}.expert_count",),
        "num_experts_per_tok": ("{arch}.expert_used_count",),
        "intermediate_size": (
            "{arch}.expert_feed_forward_length",
            "{arch}.feed_forward_length",
        ),
    },
    # llama.cpp: head dim C / H unless key_length says otherwise, biases always, the
    # window required (the hook), a per-layer window pattern not read (refused)
    gguf_defaults={
        "head_dim": lambda f: f["hidden_size"] // f["num_heads"],
        "sliding_window": None,
    },
    refuse={"gpt-oss.attention.sliding_window_pattern": (None,)},
    # llama.cpp's gpt-oss rotates "neox" style (halves): no q/k permutation
    gguf_weights={
        **without(LLAMA_GGUF, *DENSE_MLP),
        "blocks.{i}.mlp_norm": ("blk.{i}.post_attention_norm", ""),
        "blocks.{i}.attention.sinks": ("blk.{i}.attn_sinks", ""),
        "blocks.{i}.mlp.router": ("blk.{i}.ffn_gate_inp", ""),
        "blocks.{i}.mlp.experts.gate": ("blk.{i}.ffn_gate_exps", ""),
        "blocks.{i}.mlp.experts.up": ("blk.{i}.ffn_up_exps", ""),
        "blocks.{i}.mlp.experts.down": ("blk.{i}.ffn_down_exps", ""),
    },
    hook=_gpt_oss,
)
