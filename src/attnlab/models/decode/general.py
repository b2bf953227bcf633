"""The general loop: one new token per row through every layout the decode step covers.

Pre-, post- (OLMo 2) and sandwich (Gemma 2) norms, sequential or parallel (GPT-NeoX)
residual, QK-norm of either scope, attention soft-capping, sliding windows, attention
sinks (gpt-oss: one more softmax column with no value, dropped after the softmax),
mixtures of experts (the module called on the rows: routing is per token), rotary or
learned positions. Each layer's products are its modules' (fused where
:func:`attnlab.quant.fuse_linears` could), norms single calls, attention two batched
products and a softmax over the cache (no mask: the last position sees every key).

Shape legend: B batch, H query heads, G key/value heads, D head dim, C width, S cached
keys, F feed-forward width, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from attnlab.attention import KVCache
from attnlab.backends.base import softcap_scores
from attnlab.models._lm import embed_scaled
from attnlab.norms import norm_heads

if TYPE_CHECKING:
    from attnlab.models.decode.plan import DecodePlan

__all__ = ["step_general"]


def step_general(
    plan: DecodePlan, input_ids: torch.Tensor, kv_cache: Sequence[KVCache]
) -> torch.Tensor:
    """Logits (B, 1, V) of one new token per row (``input_ids`` (B, 1)) by ``plan``'s
    layers (:class:`attnlab.models.decode.layout.Layer`), appending to ``kv_cache``."""
    H, G, D = plan.H, plan.G, plan.D
    parts = plan.parts
    B = input_ids.shape[0]
    pos = kv_cache[0].seq_len
    # Rows are (B, width) 2-D tensors throughout: the products go straight to mm.
    x = parts.embedding.forward(input_ids[:, 0])  # (B, C)
    if parts.embed_scale:
        x = embed_scaled(x)
    if parts.positions is not None:
        x = x + parts.positions.weight[pos]  # (B, C)
    if plan.rope_tables:  # each rotary embedding's (cos, sin) at pos, (D,) each
        rotations = {}
        for rope in plan.ropes:
            cos_t, sin_t = plan._rope_tables(pos + 1, x.device, rope)
            rotations[rope] = cos_t[pos].to(x.dtype), sin_t[pos].to(x.dtype)
    elif plan.ropes:
        positions = torch.full((1,), pos, dtype=torch.long, device=x.device)
    nq, nk = H * D, G * D
    for layer, cache in zip(plan.layers, kv_cache, strict=True):
        post = layer.placement == "post"  # OLMo 2: the norms act on the outputs
        h = x if post else layer.norm1(x)  # (B, C)
        qk: torch.Tensor | None = None  # (B, H + G, D) queries and keys together
        if layer.qkv is not None:
            qkv = layer.qkv.forward(h)  # (B, (H + 2G) D)
            q_flat, k_flat, v = qkv[:, :nq], qkv[:, nq : nq + nk], qkv[:, nq + nk :]
            qk = qkv[:, : nq + nk].view(B, H + G, D)
        else:
            q_flat, k_flat, v = layer.q.forward(h), layer.k.forward(h), layer.v.forward(h)
        v = v.view(B, G, 1, D)
        if layer.qk_norm is not None and layer.q_norm is not None and layer.k_norm is not None:
            q = norm_heads(layer.qk_norm, layer.q_norm, q_flat.unsqueeze(1), H)  # (B, H, 1, D)
            k = norm_heads(layer.qk_norm, layer.k_norm, k_flat.unsqueeze(1), G)  # (B, G, 1, D)
            qk = torch.cat((q, k), dim=1).view(B, H + G, D)
        elif qk is None:
            qk = torch.cat((q_flat, k_flat), dim=-1).view(B, H + G, D)
        if layer.rope is None:
            pass
        elif plan.rope_tables:
            cos, sin = rotations[layer.rope]
            qk = qk * cos + qk.roll(D // 2, dims=-1) * sin  # (B, H + G, D)
        else:
            qk = layer.rope(qk.unsqueeze(2), positions).squeeze(2)  # (B, H + G, D)
        keys, values = cache.update(qk[:, H:].unsqueeze(2), v)  # (B, G, S, D)
        if layer.window is not None and keys.shape[2] > layer.window:
            keys, values = keys[:, :, -layer.window :], values[:, :, -layer.window :]
        S = keys.shape[2]
        q = qk[:, :H].reshape(B * G, H // G, D)  # a group's queries together
        keys = keys.reshape(B * G, S, D)  # a view unless the window sliced the cache
        scale = plan.scale if layer.scale is None else layer.scale
        scores = torch.bmm(q, keys.transpose(1, 2)).mul_(scale)  # (B G, H/G, S)
        scores = softcap_scores(scores, layer.softcap, inplace=True)  # Gemma 2
        if layer.sinks is not None:  # one more softmax column with no value, dropped
            sink = layer.sinks.to(scores.dtype).repeat(B, 1, 1)  # (B G, H/G, 1)
            weights = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :S]
        else:
            weights = torch.softmax(scores, dim=-1)
        o = torch.bmm(weights, values.reshape(B * G, S, D)).view(B, H * D)  # (B, C)
        a = layer.out.forward(o)  # (B, C)
        if post:
            a = layer.norm1(a)
        elif layer.attn_post is not None:
            a = layer.attn_post(a)
        if layer.parallel:  # GPT-NeoX: the MLP reads the block's input too
            h, x = layer.norm2(x), x + a  # (B, C)
        else:
            x = x + a  # (B, C)
            h = x if post else layer.norm2(x)
        if layer.down is None or layer.act is None:  # a mixture of experts, routed per row
            m = layer.up(h)  # (B, C)
        else:
            if layer.gate_up is not None:
                gate, up = layer.gate_up.forward(h).chunk(2, dim=-1)  # (B, F) each
                m = layer.act(gate) * up  # (B, F)
            elif layer.gate is not None:
                m = layer.act(layer.gate.forward(h)) * layer.up.forward(h)
            else:
                m = layer.act(layer.up.forward(h))
            m = layer.down.forward(m)  # (B, C)
        if post:
            m = layer.norm2(m)
        elif layer.mlp_post is not None:
            m = layer.mlp_post(m)
        x = x + m  # (B, C)
    return parts.head(plan.final_norm(x).unsqueeze(1))  # (B, 1, V)
