"""The compiled loop: the short loop's layers run by :mod:`attnlab.native`'s ``Step``.

The same product kernels on the same rows as the short loop, and plain C++ loops for the
norms, RoPE, the cache write, attention and the activation in place of some forty tensor
operations a layer (``benchmarks/bench_decode_step.py``: the ``native`` side against the
``short loop``). Its numbers are the short loop's up to the order of float32 sums.

Each layer goes to C++ as one :class:`NativeLayer`, its fields read there by name, each
product as an :class:`attnlab.quant.NativeProduct` (its fields read by name too); the
product kinds and activations are :data:`attnlab.native.PRODUCT_KINDS` and
:data:`attnlab.native.STEP_ACTIVATIONS`, which the build checks against the C++ enums.

Shape legend: B batch, G key/value heads, D head dim, C width, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from attnlab import native
from attnlab.attention import StaticKVCache
from attnlab.models._lm import embed_scaled
from attnlab.models.decode.layout import embedding_dtype
from attnlab.models.mlp import ACTIVATIONS
from attnlab.quant import NativeProduct, native_product

if TYPE_CHECKING:
    from attnlab.models.decode.kernels import KernelLayer
    from attnlab.models.decode.plan import DecodePlan

__all__ = ["NativeLayer", "build_compiled", "cache_slot_fits", "step_compiled"]

RmsSpec = tuple[torch.Tensor, float]


@dataclass(frozen=True)
class NativeLayer:
    """One layer as the compiled ``Step.add_layer`` reads it (``LayerSpec`` in
    ``attnlab/native/decode_step.cpp``): each field by its name."""

    norm1: RmsSpec  # RMSNorm (weight (C,), eps) before attention
    norm2: RmsSpec  # before the MLP
    attn_post: RmsSpec | None  # sandwich: norm of the attention output
    mlp_post: RmsSpec | None  # sandwich: norm of the MLP output
    qk_norm: RmsSpec | None  # (H + G, D) weight: q's per query head, then k's
    dtype: torch.dtype  # the rows every product of the layer takes
    qkv: list[NativeProduct]  # outputs side by side: (H + 2G) D columns
    out: list[NativeProduct]  # C columns
    gate_up: list[NativeProduct]  # 2F columns
    down: list[NativeProduct]  # C columns
    act: int  # the index of the activation in attnlab.native.STEP_ACTIVATIONS
    scale: float  # the score scale
    window: int  # keys a query sees, itself included; 0 = all
    rope: int  # the index of the layer's rotation in the step's list


def native_layer(layer: KernelLayer, activations: dict[int, int]) -> NativeLayer | str:
    """``layer`` as the compiled step takes it, or why it cannot (``activations``: the
    activation functions' ids to their native indices)."""
    slots = [[native_product(m) for m in modules] for modules in layer.products]
    if id(layer.act) not in activations:
        return "an activation the compiled step does not have"
    found: list[list[NativeProduct]] = []
    for slot in slots:
        if any(p is None for p in slot):
            return "a product kernel the compiled step does not call"
        found.append([p for p in slot if p is not None])
    qkv, out, gate_up, down = found
    return NativeLayer(
        norm1=layer.norm1,
        norm2=layer.norm2,
        attn_post=layer.attn_post,
        mlp_post=layer.mlp_post,
        qk_norm=layer.qk_norm,
        dtype=layer.dtype,
        qkv=qkv,
        out=out,
        gate_up=gate_up,
        down=down,
        act=activations[id(layer.act)],
        scale=layer.scale,
        window=layer.window or 0,
        rope=layer.rope,
    )


def build_compiled(plan: DecodePlan) -> Any | str:
    """The compiled ``Step`` over ``plan``'s kernel layers, or why there is none."""

    if plan.kernel_layers is None:
        return "no short loop"
    if embedding_dtype(plan.parts.embedding) != torch.float32:
        return "its rows are not float32"
    ext = native.extension()
    if ext is None:
        return f"attnlab.native is unavailable: {native.why_not_native()}"
    acts = {id(ACTIVATIONS[name]): i for i, name in enumerate(native.STEP_ACTIVATIONS)}
    first = plan.kernel_layers[0].products
    F = sum(m.out_features for m in first.gate_up) // 2
    C = plan.parts.embedding.embedding_dim
    step = ext.Step(C, plan.H, plan.G, plan.D, F)
    for i, layer in enumerate(plan.kernel_layers):
        spec = native_layer(layer, acts)
        if isinstance(spec, str):
            return f"layer {i}: {spec}"
        step.add_layer(spec)
    return step


def cache_slot_fits(slot: tuple[torch.Tensor, torch.Tensor] | None, B: int, G: int, D: int) -> bool:
    """Whether the compiled step can write a cache's next position: contiguous (B, G,
    max_len, D) keys and values, both float32 or both float16."""
    if slot is None:
        return False
    k, v = slot
    return (
        k.dtype in (torch.float32, torch.float16)
        and v.dtype == k.dtype
        and all(t.is_contiguous() and t.shape[:2] == (B, G) and t.shape[3] == D for t in slot)
    )


def step_compiled(
    plan: DecodePlan,
    compiled: Any,
    input_ids: torch.Tensor,
    kv_cache: Sequence[StaticKVCache],
    slots: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """Logits (B, 1, V) of one new token per row by the compiled ``Step``: the embedding,
    the rotations at this position and the head here, the layers there (writing each
    cache's next slot, :meth:`StaticKVCache.next_slot`)."""
    parts = plan.parts
    pos = kv_cache[0].seq_len
    x = parts.embedding.forward(input_ids[:, 0])  # (B, C)
    if parts.embed_scale:
        x = embed_scaled(x)
    rotations = []
    for rope in plan.ropes:
        cos_t, sin_t = plan._rope_tables(pos + 1, x.device, rope)
        rotations.append((cos_t[pos], sin_t[pos]))  # (D,) each
    x = compiled.run(x, pos, rotations, [t for pair in slots for t in pair])  # (B, C)
    for cache in kv_cache:
        cache.advance()
    return parts.head(plan.final_norm(x).unsqueeze(1))  # (B, 1, V)
