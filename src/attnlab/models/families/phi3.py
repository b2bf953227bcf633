"""Phi-3: Llama's layout with fused projections, and LongRoPE."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from attnlab.models.families.base import GgufRope, without
from attnlab.models.families.layouts import (
    LLAMA_DEFAULTS,
    LLAMA_GGUF,
    LLAMA_KEYS,
    LLAMA_WEIGHTS,
    Q_K_V,
)
from attnlab.models.families.llama import LLAMA
from attnlab.rope import LongRopeScaling, RopeScaling

# llama.cpp stores Phi-3's LongRoPE factors as two 1-D tensors (one value per rotating pair)
LONGROPE_TENSORS = {"long": "rope_factors_long.weight", "short": "rope_factors_short.weight"}


def _phi3_gguf_rope(
    fields: dict[str, Any], metadata: Mapping[str, Any], found: GgufRope
) -> RopeScaling | None:
    """Phi-3's LongRoPE as llama.cpp's converter writes it: the two factor tensors, the
    original context in ``rope.scaling.original_context_length`` and the attention factor
    in ``rope.scaling.attn_factor`` (the default formula on ``context_length / original``
    when absent); without the tensors, the generic reading."""
    scaling = found.read(None)
    longrope = {k: fields.pop(f"rope_factors_{k}", None) for k in LONGROPE_TENSORS}
    present = [LONGROPE_TENSORS[k] for k, v in longrope.items() if v is not None]
    if not present:
        return scaling
    if len(present) != len(LONGROPE_TENSORS):
        raise ValueError(
            f"tensor {present[0]!r} (Phi-3 LongRoPE factors) needs its partner "
            f"{sorted(set(LONGROPE_TENSORS.values()) - set(present))[0]!r}, which is missing"
        )
    arch = found.arch
    if scaling is not None:
        raise ValueError(
            "tensors 'rope_factors_long.weight' / 'rope_factors_short.weight' come without "
            f"`{arch}.rope.scaling.type` or 'rope_freqs.weight'; got scaling {found.kind!r}"
        )
    for name, values in longrope.items():
        if len(values) != found.pairs:
            raise ValueError(
                f"tensor 'rope_factors_{name}.weight' must hold {found.pairs} factors (one per "
                f"rotating pair), got {len(values)}"
            )
    key = f"{arch}.rope.scaling.original_context_length"
    orig = metadata.get(key)
    if isinstance(orig, bool) or not isinstance(orig, int) or orig <= 0:
        raise ValueError(
            f"Phi-3 LongRoPE factor tensors need `{key}` (an integer > 0), got {orig!r}"
        )
    attn = metadata.get(f"{arch}.rope.scaling.attn_factor")
    context = fields.get("context_length")
    factor = context / orig if isinstance(context, int) and context > 0 else 1.0
    try:
        return LongRopeScaling(
            short_factor=longrope["short"],
            long_factor=longrope["long"],
            original_max_position_embeddings=orig,
            factor=factor,
            attention_factor=None if attn is None else attn,
        )
    except (TypeError, ValueError) as e:
        raise ValueError(f"tensors 'rope_factors_*.weight': {e}") from None


PHI3 = dataclasses.replace(
    LLAMA,
    name="phi3",
    fixed={**LLAMA.fixed, "family": "phi3"},
    keys=LLAMA_KEYS,
    defaults=LLAMA_DEFAULTS,
    refuse={},
    # fused: one qkv projection, one gate/up projection (gate first)
    weights={
        **without(LLAMA_WEIGHTS, *Q_K_V, "blocks.{i}.mlp.gate", "blocks.{i}.mlp.up"),
        "blocks.{i}.attention.{qkv}": ("layers.{i}.self_attn.qkv_proj", "qkv"),
        "blocks.{i}.mlp.{gate_up}": ("layers.{i}.mlp.gate_up_proj", "gate_up"),
    },
    # llama.cpp keeps Phi-3's fused tensors: attn_qkv, and ffn_up holding gate then up.
    gguf_weights={
        **without(LLAMA_GGUF, *Q_K_V, "blocks.{i}.mlp.gate", "blocks.{i}.mlp.up"),
        "blocks.{i}.attention.{qkv}": ("blk.{i}.attn_qkv", "qkv"),
        "blocks.{i}.mlp.{gate_up}": ("blk.{i}.ffn_up", "gate_up"),
    },
    gguf_rope=_phi3_gguf_rope,
    gguf_tensors={f"rope_factors_{k}": name for k, name in LONGROPE_TENSORS.items()},
)
