"""The one-token decode step with little per-token overhead, for any pre-norm decoder.

Prefill (many new tokens) runs through the model's modules and the attention backends.
One new token per row with a :class:`attnlab.attention.StaticKVCache` takes this path:

- one QKV product and one gate/up product per layer (:func:`attnlab.quant.fuse_rows`,
  built once; the separate ``W_query``/``W_key``/``W_value`` then view the fused rows);
- RoPE from cos/sin tables built once (fp32 values of the same fp64 angles the
  :class:`~attnlab.attention.RotaryEmbedding` uses), applied to queries and keys together;
- attention of one query row as two batched products and a softmax over the cache
  (no mask: the last position sees every key), keys and values written in place;
- norms as single ``torch.nn.functional`` calls, no shape checks per step.

The fp32 result equals the module path up to the order of floating-point sums
(tests: greedy tokens identical to the full recompute and to transformers).

Shape legend: B batch, H query heads, G key/value heads, D head dim, C width, S cached
keys, F feed-forward width, V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from attnlab.attention import KVCache, StaticKVCache, recording_attention
from attnlab.quant import fuse_rows
from attnlab.rope import DynamicNTKScaling, RotaryEmbedding

__all__ = ["DecodePlan", "why_not_fast_decode"]

Norm = Callable[[torch.Tensor], torch.Tensor]


def _norm_fn(norm: nn.Module) -> Norm:
    """One functional call for an RMSNorm (``weight``, ``eps``) or an ``nn.LayerNorm``."""
    if isinstance(norm, nn.LayerNorm):
        ln = norm
        return lambda x: nn.functional.layer_norm(
            x, ln.normalized_shape, ln.weight, ln.bias, ln.eps
        )
    rms: Any = norm
    shape = (rms.weight.shape[0],)
    return lambda x: nn.functional.rms_norm(x, shape, rms.weight, float(rms.eps))


def why_not_fast_decode(model: Any) -> str | None:
    """Why ``model``'s layout has no fast decode step, or None if it has one."""
    for name in ("tok_embeddings", "blocks", "norm", "lm_head"):
        if not hasattr(model, name):
            return f"the model has no `{name}`"
    for block in model.blocks:
        if getattr(block, "placement", "pre") != "pre":
            return f"norm placement {block.placement!r} (only 'pre')"
        if getattr(block, "parallel", False):
            return "parallel residual"
        if getattr(block, "sliding_window", None) is not None:
            return "sliding-window attention"
        att = block.attention
        if att.kdim != att.embed_dim or att.vdim != att.embed_dim:
            return "cross-attention widths"
        norm = block.attn_norm
        if not isinstance(norm, nn.LayerNorm) and not hasattr(norm, "eps"):
            return f"norm {type(norm).__name__}"
    return None


@dataclass
class _Layer:
    norm1: Norm
    qkv: nn.Module | None  # fused, or None: q, k, v separately
    q: nn.Module
    k: nn.Module
    v: nn.Module
    out: nn.Module
    norm2: Norm
    gate_up: nn.Module | None  # fused, or None: gate, up separately
    gate: nn.Module | None
    up: nn.Module
    down: nn.Module
    act: Callable[[torch.Tensor], torch.Tensor]


class DecodePlan:
    """The fused weights and tables of one model, and its one-token :meth:`step`.

    Built once per model (``model.prepare_decode()``); it reads the model's modules as
    they are (float or :mod:`attnlab.quant` layers) and fuses their products.

    Args:
        model: a pre-norm decoder (``tok_embeddings``, optional ``pos_embeddings``,
            ``blocks`` of ``attn_norm``/``attention``/``mlp_norm``/``mlp``, ``norm``,
            ``lm_head``, optional ``rope``).

    Raises:
        ValueError: a layout :func:`why_not_fast_decode` rejects.
    """

    def __init__(self, model: Any) -> None:
        why = why_not_fast_decode(model)
        if why is not None:
            raise ValueError(f"no fast decode step for this model: {why}")
        self.model = model
        att0 = model.blocks[0].attention
        self.H, self.G, self.D = att0.num_heads, att0.num_kv_heads, att0.head_dim
        self.scale = 1.0 / math.sqrt(self.D)
        self.rope: RotaryEmbedding | None = att0.rope
        rope = self.rope
        # Full-width "rotate half" RoPE with fixed frequencies: tables once, two products.
        # Any other variant (partial, interleaved, dynamic NTK) is applied by the module.
        self.rope_tables = (
            rope is not None
            and rope.rotary_dims == self.D
            and not rope.config.interleaved
            and not isinstance(rope.config.scaling, DynamicNTKScaling)
        )
        self.layers = [self._layer(block) for block in model.blocks]
        self.final_norm = _norm_fn(model.norm)
        self._cos: torch.Tensor | None = None  # (L, D) fp32
        self._sin: torch.Tensor | None = None  # (L, D) fp32, first half negated

    @staticmethod
    def _layer(block: Any) -> _Layer:
        att, mlp = block.attention, block.mlp
        gate = getattr(mlp, "gate", None)
        act = getattr(mlp, "act", nn.functional.silu)
        return _Layer(
            norm1=_norm_fn(block.attn_norm),
            qkv=fuse_rows([att.W_query, att.W_key, att.W_value]),
            q=att.W_query,
            k=att.W_key,
            v=att.W_value,
            out=att.out_proj,
            norm2=_norm_fn(block.mlp_norm),
            gate_up=fuse_rows([gate, mlp.up]) if gate is not None else None,
            gate=gate,
            up=mlp.up,
            down=mlp.down,
            act=act,
        )

    def _rope_tables(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos is None or self._sin is None or self._cos.shape[0] < length:
            assert self.rope is not None
            n = max(length, 2 * (self._cos.shape[0] if self._cos is not None else 0), 256)
            cos, sin = self.rope.cos_sin(torch.arange(n, device=device))  # (L, D) fp64
            half = self.D // 2
            # rotate_half(x) * sin == roll(x, D/2) * [-sin_lo, sin_hi], bit for bit.
            sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
            self._cos, self._sin = cos.float(), sin.float()
        return self._cos, self._sin

    @torch.no_grad()
    def step(self, input_ids: torch.Tensor, kv_cache: Sequence[KVCache]) -> torch.Tensor:
        """Logits of one new token per row, appending its keys/values to ``kv_cache``.

        Args:
            input_ids: (B, 1) token ids following the cached ones.
            kv_cache: one cache per layer, all at the same length.

        Returns:
            (B, 1, V) logits.
        """
        H, G, D = self.H, self.G, self.D
        model = self.model
        B = input_ids.shape[0]
        pos = kv_cache[0].seq_len
        x = nn.functional.embedding(input_ids, model.tok_embeddings.weight)  # (B, 1, C)
        pos_emb = getattr(model, "pos_embeddings", None)
        if pos_emb is not None:
            x = x + pos_emb.weight[pos]  # (B, 1, C)
        if self.rope_tables:
            cos_t, sin_t = self._rope_tables(pos + 1, x.device)
            cos, sin = cos_t[pos], sin_t[pos]  # (D,)
        elif self.rope is not None:
            positions = torch.full((1,), pos, dtype=torch.long, device=x.device)
        nq, nk = H * D, G * D
        for layer, cache in zip(self.layers, kv_cache, strict=True):
            h = layer.norm1(x)  # (B, 1, C)
            if layer.qkv is not None:
                qkv = layer.qkv(h)  # (B, 1, (H + 2G) D)
                qk = qkv[..., : nq + nk].view(B, H + G, D)
                v = qkv[..., nq + nk :].view(B, G, 1, D)
            else:
                qk = torch.cat((layer.q(h), layer.k(h)), dim=-1).view(B, H + G, D)
                v = layer.v(h).view(B, G, 1, D)
            if self.rope_tables:
                qk = qk * cos + qk.roll(D // 2, dims=-1) * sin  # (B, H + G, D)
            elif self.rope is not None:
                qk = self.rope(qk.unsqueeze(2), positions).squeeze(2)  # (B, H + G, D)
            q = qk[:, :H].view(B, G, H // G, D)  # (B, G, H/G, D): a group's queries together
            keys, values = cache.update(qk[:, H:].unsqueeze(2), v)  # (B, G, S, D)
            scores = torch.matmul(q, keys.transpose(-1, -2)).mul_(self.scale)  # (B, G, H/G, S)
            weights = torch.softmax(scores, dim=-1)
            o = torch.matmul(weights, values).view(B, 1, H * D)  # (B, 1, C)
            x = x + layer.out(o)  # (B, 1, C)
            h = layer.norm2(x)
            if layer.gate_up is not None:
                gu = layer.gate_up(h)  # (B, 1, 2F)
                gate, up = gu.chunk(2, dim=-1)
                m = layer.act(gate) * up  # (B, 1, F)
            elif layer.gate is not None:
                m = layer.act(layer.gate(h)) * layer.up(h)
            else:
                m = layer.act(layer.up(h))
            x = x + layer.down(m)  # (B, 1, C)
        return model.lm_head(self.final_norm(x))  # (B, 1, V)


def takes_fast_step(model: Any, input_ids: torch.Tensor, kv_cache: Any, need_weights: bool) -> bool:
    """Whether ``model(input_ids, kv_cache=...)`` may take :meth:`DecodePlan.step`.

    One new token per row, every layer's cache a :class:`StaticKVCache`, no gradients, no
    weights asked for or recorded (:func:`attnlab.attention.record_attention`, ``capture``).
    """
    if input_ids.shape[1] != 1 or need_weights or torch.is_grad_enabled() or not kv_cache:
        return False
    if not all(isinstance(c, StaticKVCache) for c in kv_cache):
        return False
    if recording_attention():
        return False
    return not any(block.attention.capture for block in model.blocks)
