"""Llama 4's text model: NoPE and chunked layers, temperature tuning, experts on
some layers."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from attnlab.models.families.base import (
    Source,
    moe_config,
    pop_flag,
    pop_layer_flags,
    pop_period,
)
from attnlab.models.families.layouts import (
    ATTENTION_BIAS_KEYS,
    EXPERT_KEYS,
    GGUF_KEYS_NO_WINDOW,
    LLAMA_DEFAULTS,
    LLAMA_GGUF,
    LLAMA_KEYS,
    LLAMA_WEIGHTS,
    NO_BIAS,
)
from attnlab.models.families.llama import LLAMA
from attnlab.rope import RopeConfig


def _llama4(fields: dict[str, Any], config: Mapping[str, Any], source: Source) -> None:
    """Llama 4's text layers, as transformers' ``Llama4TextConfig`` derives them.

    NoPE layers from ``no_rope_layers`` (1 = rotates; empty or absent: every
    ``no_rope_layer_interval``-th layer, default 4, is NoPE). The rotary layers attend in
    chunks of ``attention_chunk_size`` (``layer_types`` ``"chunked_attention"`` where it is
    given) and normalise queries and keys with a weightless L2 norm (``use_qk_norm``); the
    NoPE layers sharpen their queries with ``attn_temperature_tuning`` (``floor_scale``,
    ``attn_scale``). RoPE rotates interleaved pairs (transformers' complex product).
    The layers in ``moe_layers`` (else every ``interleave_moe_layer_step``-th) route to
    experts of width ``intermediate_size`` (sigmoid router, the weight scaling the expert's
    input, a shared expert of the same width); the others run the dense MLP of
    ``intermediate_size_mlp``.
    """
    layers = fields["num_layers"]
    if source == "gguf":
        _llama4_gguf(fields, config)
    period = pop_period(fields, "no_rope_layer_interval")
    if fields.get("no_rope_layers") == []:
        fields.pop("no_rope_layers")
    rotary = pop_layer_flags(fields, "no_rope_layers")
    if rotary is None:
        rotary = tuple(bool((i + 1) % period) for i in range(layers))
    fields["layer_rotary"] = rotary
    chunk = fields.pop("attention_chunk_size")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"`attention_chunk_size` must be an integer >= 1 or null, got {chunk!r}")
    types = fields.pop("layer_types", None)
    if types is None:
        types = ["chunked_attention" if r and chunk else "full_attention" for r in rotary]
    if not isinstance(types, list) or len(types) != layers:
        raise ValueError(f"`layer_types` must list one type per layer ({layers}), got {types!r}")
    if any(t not in ("chunked_attention", "full_attention") for t in types):
        raise ValueError(f"`layer_types` holds an unsupported type: {sorted(set(map(str, types)))}")
    if "chunked_attention" in types and chunk is None:
        raise ValueError("`layer_types` has chunked layers but `attention_chunk_size` is null")
    fields["layer_chunks"] = tuple(chunk if t == "chunked_attention" else None for t in types)
    fields["layer_types"] = None
    if pop_flag(fields, "use_qk_norm", True):
        fields["qk_norm"] = "l2_head"
        fields["layer_qk_norm"] = rotary
    if pop_flag(fields, "attn_temperature_tuning", True):
        floor_scale, scale = fields.pop("temperature_floor"), fields.pop("temperature_scale")
        for key, value in (("floor_scale", floor_scale), ("attn_scale", scale)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"`{key}` must be a number, got {value!r}")
        if not floor_scale > 0:
            raise ValueError(f"`floor_scale` must be > 0, got {floor_scale!r}")
        fields["attn_temperature"] = (float(floor_scale), float(scale))
    else:
        fields.pop("temperature_floor")
        fields.pop("temperature_scale")
    step = fields.pop("interleave_moe_layer_step")
    moe = fields.pop("moe_layers", None)
    if moe is None:
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(f"`interleave_moe_layer_step` must be an integer, got {step!r}")
        moe = list(range(step - 1, layers, step)) if step > 0 else []
    if not isinstance(moe, list) or any(
        isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers for i in moe
    ):
        raise ValueError(f"`moe_layers` must list layer indices 0..{layers - 1}, got {moe!r}")
    # the experts' width (the dense MLP's is `intermediate_size_mlp`)
    width = fields.pop("expert_size") if source == "gguf" else config.get("intermediate_size", 8192)
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"`intermediate_size` must be an integer >= 1, got {width!r}")
    experts = moe_config(
        fields,
        size=width,
        renormalize=False,
        router="sigmoid",
        shared_size=width,
        weight_inputs=True,
    )
    if moe:
        fields["moe"] = experts
        fields["layer_moe"] = tuple(i in moe for i in range(layers))
    if source == "gguf":  # the file's rope keys are read by the loader, pairs interleaved
        fields["rope_interleaved"] = True
        return
    try:
        fields["rope"] = dataclasses.replace(RopeConfig.from_hf_config(config), interleaved=True)
    except (ValueError, TypeError) as e:
        raise ValueError(f"rope settings: {e}") from None


def _llama4_gguf(fields: dict[str, Any], metadata: Mapping[str, Any]) -> None:
    """What llama.cpp's ``llama4`` loader fixes rather than reads: chunks of 8192 on three
    layers in four, every 4th layer NoPE with temperature tuning (floor 8192, scale 0.1:
    ``gguf_defaults``), QK-norm on the rotary layers unless there are 128 experts (its
    Maverick rule). The keys that would change that are refused, naming the key."""
    window = metadata.get("llama4.attention.sliding_window")
    if window == 0:  # llama.cpp: no chunks, rotary on every layer but the last (MobileLLM)
        raise ValueError(
            "`llama4.attention.sliding_window` = 0 (no chunked attention) is not supported yet"
        )
    for key in ("llama4.attention.sliding_window_pattern", "llama4.rope.freq_base_swa"):
        if key in metadata and not (
            key.endswith("freq_base_swa") and metadata[key] == metadata.get("llama4.rope.freq_base")
        ):
            raise ValueError(f"`{key}` = {metadata[key]!r} is not supported for llama4 yet")
    fields["use_qk_norm"] = fields.get("num_local_experts") != 128


LLAMA4_TEXT = dataclasses.replace(
    LLAMA,
    name="llama4_text",
    fixed={**LLAMA.fixed, "family": "llama4_text"},
    keys={
        **LLAMA_KEYS,
        **ATTENTION_BIAS_KEYS,
        "intermediate_size": ("intermediate_size_mlp",),
        "layer_types": ("layer_types",),
        "no_rope_layers": ("no_rope_layers",),
        "no_rope_layer_interval": ("no_rope_layer_interval",),
        "attention_chunk_size": ("attention_chunk_size",),
        "use_qk_norm": ("use_qk_norm",),
        "attn_temperature_tuning": ("attn_temperature_tuning",),
        # not the score scale: Llama 4's temperature tuning
        "temperature_floor": ("floor_scale",),
        "temperature_scale": ("attn_scale",),
        "moe_layers": ("moe_layers",),
        "interleave_moe_layer_step": ("interleave_moe_layer_step",),
        **EXPERT_KEYS,
    },
    defaults={
        **LLAMA_DEFAULTS,
        **NO_BIAS,
        "intermediate_size": 16384,
        "no_rope_layer_interval": 4,
        "attention_chunk_size": 8192,
        "temperature_floor": 8192,
        "temperature_scale": 0.1,
        "interleave_moe_layer_step": 1,
        "num_local_experts": 16,
        "num_experts_per_tok": 1,
    },
    refuse={},
    weights={
        **LLAMA_WEIGHTS,
        "blocks.{i}.mlp.gate": ("layers.{i}.feed_forward.gate_proj", ""),
        "blocks.{i}.mlp.up": ("layers.{i}.feed_forward.up_proj", ""),
        "blocks.{i}.mlp.down": ("layers.{i}.feed_forward.down_proj", ""),
        "blocks.{i}.mlp.router": ("layers.{i}.feed_forward.router", ""),
        # transformers' stacked experts, (E, in, out), gate and up side by side
        "blocks.{i}.mlp.experts.{gate_up}": (
            "layers.{i}.feed_forward.experts.gate_up_proj",
            "Tx+gate_up",
        ),
        "blocks.{i}.mlp.experts.down": ("layers.{i}.feed_forward.experts.down_proj", "Tx"),
        **{
            f"blocks.{{i}}.mlp.shared.{w}": (
                f"layers.{{i}}.feed_forward.shared_expert.{w}_proj",
                "",
            )
            for w in ("gate", "up", "down")
        },
    },
    gguf_arch="llama4",
    gguf_keys={
        **GGUF_KEYS_NO_WINDOW,  # the window key is read by the hook (0: refused)
        "num_local_experts": ("{arch}.expert_count",),
        "num_experts_per_tok": ("{arch}.expert_used_count",),
        "expert_size": ("{arch}.expert_feed_forward_length",),
        "interleave_moe_layer_step": ("{arch}.interleave_moe_layer_step",),
    },
    gguf_defaults={
        "no_rope_layer_interval": 4,
        "attention_chunk_size": 8192,
        "temperature_floor": 8192,
        "temperature_scale": 0.1,
    },
    # llama4's converter does not permute q/k rows; the experts stacked (E, ...)
    gguf_weights={
        **LLAMA_GGUF,
        "blocks.{i}.mlp.router": ("blk.{i}.ffn_gate_inp", ""),
        "blocks.{i}.mlp.experts.gate": ("blk.{i}.ffn_gate_exps", ""),
        "blocks.{i}.mlp.experts.up": ("blk.{i}.ffn_up_exps", ""),
        "blocks.{i}.mlp.experts.down": ("blk.{i}.ffn_down_exps", ""),
        **{
            f"blocks.{{i}}.mlp.shared.{w}": (f"blk.{{i}}.ffn_{w}_shexp", "")
            for w in ("gate", "up", "down")
        },
    },
    hook=_llama4,
)
