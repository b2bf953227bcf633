"""The short loop: one new token per row through a plain stack's layers as bare kernels
(:class:`attnlab.models.decode.kernels.KernelLayer`), in Python.

Each product's kernel is called bare (:func:`attnlab.quant.decode_product`) on rows kept in
its dtype, QK-norm of every head is one call, RoPE one (D, D) product, the cache is written
by :meth:`attnlab.attention.StaticKVCache.append`, attention is one
``scaled_dot_product_attention`` call, in inference mode: fewer tensor operations a layer
than the general loop (``benchmarks/bench_decode_step.py`` counts and times both), the
same kernels on the same rows.

Shape legend: B batch, H query heads, G key/value heads, D head dim, C width, S cached
keys, V vocabulary.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from attnlab.attention import StaticKVCache
from attnlab.models._lm import embed_scaled
from attnlab.norms import rms_norm
from attnlab.rope import RotaryEmbedding

if TYPE_CHECKING:
    from attnlab.models.decode.plan import DecodePlan

__all__ = ["rotation", "step_short"]


def rotation(
    plan: DecodePlan, pos: int, like: torch.Tensor, rope: RotaryEmbedding | None = None
) -> torch.Tensor:
    """RoPE at ``pos`` as a (D, D) matrix in ``like``'s dtype:
    ``x @ R == x * cos + roll(x, D/2) * sin`` (two nonzeros a column: the product's sums
    add exact zeros), one product for all heads instead of four operations."""
    cos_t, sin_t = plan._rope_tables(pos + 1, like.device, rope)
    D = plan.D
    cols = torch.arange(D, device=like.device)
    r = torch.diag(cos_t[pos])  # (D, D)
    r[(cols + D // 2) % D, cols] = sin_t[pos]
    return r.to(like.dtype)


def step_short(
    plan: DecodePlan, input_ids: torch.Tensor, kv_cache: Sequence[StaticKVCache]
) -> torch.Tensor:
    """Logits (B, 1, V) of one new token per row (``input_ids`` (B, 1)) by ``plan``'s
    :attr:`~attnlab.models.decode.plan.DecodePlan.kernel_layers`, appending to
    ``kv_cache``."""
    H, G, D = plan.H, plan.G, plan.D
    parts = plan.parts
    B = input_ids.shape[0]
    pos = kv_cache[0].seq_len
    x = parts.embedding.forward(input_ids[:, 0])  # (B, C)
    if parts.embed_scale:
        x = embed_scaled(x)
    f32 = x.dtype
    rots = [rotation(plan, pos, x, rope) for rope in plan.ropes]  # (D, D) each
    # Inference mode spares each operation its version counter and view tracking
    # (bench_decode_step.py). Only once the caches hold the prompt: then no buffer is
    # allocated in it (an inference tensor could not be written outside it by a later
    # prefill); the tables are built before it.
    # (``inference_mode(False)`` would turn gradients back on: nullcontext instead.)
    with torch.inference_mode() if pos > 0 else contextlib.nullcontext():
        for layer, cache in zip(plan.kernel_layers or (), kv_cache, strict=True):
            h = rms_norm(x, *layer.norm1).to(layer.dtype)  # (B, C)
            qk, v = layer.qkv(h)  # (B, (H + G) D), (B, G D)
            qk = qk.to(f32)
            if layer.qk_norm is not None:  # each head vector, q's weight or k's
                qk = rms_norm(qk.view(B, H + G, D), *layer.qk_norm)
            # RoPE on queries and keys together, as one product (fp32, as the modules).
            qk = torch.mm(qk.reshape(-1, D), rots[layer.rope]).view(B, H + G, D)
            keys, values = cache.append(qk[:, H:], v.view(B, G, D))  # (B, G, S, D)
            if layer.window is not None and keys.shape[2] > layer.window:
                keys, values = keys[:, :, -layer.window :], values[:, :, -layer.window :]
            # One fused call over the cache's views, the groups shared by their heads.
            o = nn.functional.scaled_dot_product_attention(
                qk[:, :H].unsqueeze(2), keys, values, scale=layer.scale, enable_gqa=True
            ).view(B, H * D)  # (B, C)
            a = layer.out(o.to(layer.dtype))  # (B, C)
            if layer.attn_post is not None:
                a = rms_norm(a.to(f32), *layer.attn_post)
            x = x + a  # (B, C)
            h = rms_norm(x, *layer.norm2).to(layer.dtype)
            gate, up = layer.gate_up(h).to(f32).chunk(2, dim=-1)  # (B, F) each
            m = layer.down((layer.act(gate) * up).to(layer.dtype))  # (B, C)
            if layer.mlp_post is not None:
                m = rms_norm(m.to(f32), *layer.mlp_post)
            x = x + m  # (B, C)
    return parts.head(plan.final_norm(x).unsqueeze(1))  # (B, 1, V)
