"""What the decode step reads off a model: its pieces, each layer's options and modules,
and why a layout has no step.

Shape legend: B batch, H query heads, G key/value heads, D head dim, C width.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from attnlab.models.moe import MixtureOfExperts
from attnlab.quant import column_major, fuse_linears
from attnlab.rope import RotaryEmbedding

__all__ = [
    "Layer",
    "Norm",
    "Parts",
    "block_parts",
    "model_parts",
    "norm_fn",
    "read_layer",
    "why_not_fast_decode",
]

Norm = Callable[[torch.Tensor], torch.Tensor]


def norm_fn(norm: nn.Module) -> Norm:
    """One functional call for an RMSNorm (``weight``, ``eps``), an ``nn.LayerNorm`` or the
    book's LayerNorm (``scale``, ``shift``, ``eps``)."""
    n: Any = norm
    if isinstance(norm, nn.LayerNorm):
        return lambda x: nn.functional.layer_norm(x, n.normalized_shape, n.weight, n.bias, n.eps)
    if hasattr(norm, "scale") and hasattr(norm, "shift"):
        shape = (n.scale.shape[0],)
        return lambda x: nn.functional.layer_norm(x, shape, n.scale, n.shift, n.eps)
    # An RMSNorm: its own forward (no hooks), the same numbers as the module path;
    # torch.nn.functional.rms_norm dispatches about a dozen operations with two copies here.
    return n.forward  # type: ignore[no-any-return]


# DecoderConfig fields the fast step handles whatever their value.
_STEP_OPTIONS = frozenset(
    {
        "vocab_size",
        "hidden_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "intermediate_size",
        "context_length",
        "norm_eps",
        "tie_embeddings",
        "norm",
        "norm_bias",
        "mlp",
        "activation",
        "mlp_bias",
        "positions",
        "rope",
        "head_dim",
        "qkv_bias",
        "out_bias",
        "attn_scale",
        "layer_scales",
        "layer_ropes",
        "family",
        "norm_placement",
        "parallel_residual",
        "qk_norm",
        "sliding_window",
        "layer_windows",
        "attn_softcap",
        "final_softcap",
        "embed_scale",
        "head_input_scale",
        "attn_sinks",
        "moe",
        "layer_moe",
    }
)


@dataclass
class Parts:
    """Where a decoder keeps its pieces (the one decoder's names, or the book's GPT's)."""

    embedding: nn.Module  # nn.Embedding, or a table held in a weight format
    positions: nn.Embedding | None
    blocks: list[Any]
    final_norm: nn.Module
    head: Callable[[torch.Tensor], torch.Tensor]  # (B, 1, C) -> (B, 1, V), modules called
    embed_scale: bool  # token embeddings times sqrt(C) (Gemma)


def model_parts(model: Any) -> Parts | str:
    """The model's pieces, or why its layout is not one this step knows."""
    if hasattr(model, "trf_blocks"):  # attnlab.models.gpt.GPTModel, the book's names
        return Parts(
            model.tok_emb,
            model.pos_emb,
            list(model.trf_blocks),
            model.final_norm,
            model.out_head,
            embed_scale=False,
        )
    for name in ("tok_embeddings", "blocks", "norm", "lm_head", "head"):
        if getattr(model, name, None) is None:
            return f"the model has no `{name}`"
    config = getattr(model, "config", None)
    return Parts(
        model.tok_embeddings,
        getattr(model, "pos_embeddings", None),
        list(model.blocks),
        model.norm,
        model.head,  # the one decoder's head: input scale, lm_head module, final softcap
        embed_scale=bool(getattr(config, "embed_scale", False)),
    )


def embedding_dtype(embedding: nn.Module) -> torch.dtype | None:
    """The dtype of the rows an embedding's lookup returns: its weight's, or the
    ``dtype`` of a table held in a weight format (:class:`attnlab.quant.HeldEmbedding`),
    read without dequantising the table."""
    if isinstance(embedding, nn.Embedding):
        return embedding.weight.dtype
    return getattr(embedding, "dtype", None)


def block_parts(block: Any) -> tuple[nn.Module, Any, nn.Module, Any, Any, Any, Any]:
    """(norm1, attention, norm2, gate or None, up, down, activation) of one block; for a
    mixture of experts, (norm1, attention, norm2, None, the module, None, None)."""
    if hasattr(block, "att"):  # the book's TransformerBlock: ff = Linear, GELU, Linear
        up, act, down = block.ff.layers
        return block.norm1, block.att, block.norm2, None, up, down, act
    mlp = block.mlp
    if isinstance(mlp, MixtureOfExperts):  # called as a module: routing is per token
        return block.attn_norm, block.attention, block.mlp_norm, None, mlp, None, None
    act = getattr(mlp, "act", nn.functional.silu)
    return block.attn_norm, block.attention, block.mlp_norm, mlp.gate, mlp.up, mlp.down, act


def why_not_fast_decode(model: Any) -> str | None:
    """Why ``model``'s layout has no fast decode step, or None if it has one."""
    parts = model_parts(model)
    if isinstance(parts, str):
        return parts
    config = getattr(model, "config", None)
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        # Options the step implements; any other option away from its default (ALiBi,
        # embedding norms, soft-capping, windows, ... and whatever is added later) keeps
        # the model on its modules, which are always right.
        positions = getattr(config, "positions", "rope")
        if positions not in ("rope", "learned"):
            return f"positions {positions!r}"
        for f in dataclasses.fields(config):
            if f.name in _STEP_OPTIONS or f.default is dataclasses.MISSING:
                continue
            if getattr(config, f.name) != f.default:
                return f"model option {f.name}={getattr(config, f.name)!r}"
    for block in parts.blocks:
        placement = getattr(block, "placement", "pre")
        if placement not in ("pre", "post", "sandwich"):
            return f"norm placement {placement!r}"
        if getattr(block, "cross_attention", None) is not None:
            return "cross attention"
        norm1, att, norm2 = block_parts(block)[:3]
        if att.kdim != att.embed_dim or att.vdim != att.embed_dim:
            return "cross-attention widths"
        qk_norm = getattr(att, "qk_norm", None)
        if qk_norm is not None and qk_norm.scope == "each_head":
            return "a QK-norm weight per head"
        norms = [norm1, norm2, getattr(block, "attn_post_norm", None)]
        norms += [getattr(block, "mlp_post_norm", None), getattr(att, "q_norm", None)]
        for norm in (n for n in norms if n is not None):
            if not isinstance(norm, nn.LayerNorm) and not hasattr(norm, "eps"):
                return f"norm {type(norm).__name__}"
    return None


@dataclass
class Layer:
    """One block as the general loop runs it: its options, norms as calls, its products."""

    attention: Any  # the Attention module (for `capture`)
    rope: RotaryEmbedding | None  # this layer's (Gemma 3: local and global layers differ)
    placement: str  # "pre", "post" (norms on the outputs) or "sandwich" (both)
    parallel: bool  # x + attn(norm1(x)) + mlp(norm2(x))
    window: int | None  # keys a query sees (itself included); None = all
    softcap: float | None  # score soft-capping c * tanh(s / c)
    sinks: torch.Tensor | None  # (G, H/G, 1) a sink logit per head (gpt-oss), else None
    scale: float | None  # this layer's score scale; None = the model's
    qk_norm: str | None  # None, or the QK-norm's scope: "head" or "all" (across heads)
    q_norm: Norm | None
    k_norm: Norm | None
    attn_post: Norm | None  # sandwich: norm of the attention output
    mlp_post: Norm | None  # sandwich: norm of the MLP output
    norm1: Norm
    qkv: nn.Module | None  # fused, or None: q, k, v separately
    q: nn.Module
    k: nn.Module
    v: nn.Module
    out: nn.Module
    norm2: Norm
    gate_up: nn.Module | None  # fused, or None: gate, up separately
    gate: nn.Module | None
    up: nn.Module  # a mixture of experts: the module (gate, down and act None)
    down: nn.Module | None
    act: Callable[[torch.Tensor], torch.Tensor] | None


def read_layer(block: Any, share: bool) -> Layer:
    """``block`` as a :class:`Layer`, its Q/K/V and gate/up products fused
    (:func:`attnlab.quant.fuse_linears`; float ones too when ``share``, and wide float weights
    then column-major)."""
    norm1, att, norm2, gate, up, down, act = block_parts(block)
    qk_norm = getattr(att, "qk_norm", None)
    attn_post = getattr(block, "attn_post_norm", None)
    mlp_post = getattr(block, "mlp_post_norm", None)
    placement = getattr(block, "placement", "pre")
    sinks = getattr(att, "sinks", None)
    layer = Layer(
        attention=att,
        rope=att.rope,
        placement=placement,
        # The modules' post-norm block is sequential whatever `parallel` says.
        parallel=bool(getattr(block, "parallel", False)) and placement != "post",
        window=getattr(att, "sliding_window", None),
        softcap=getattr(att, "softcap", None),
        sinks=None if sinks is None else sinks.detach().view(att.num_kv_heads, -1, 1),
        scale=getattr(att, "scale", None),
        qk_norm=None if qk_norm is None else qk_norm.scope,
        q_norm=None if qk_norm is None else norm_fn(att.q_norm),
        k_norm=None if qk_norm is None else norm_fn(att.k_norm),
        attn_post=None if attn_post is None else norm_fn(attn_post),
        mlp_post=None if mlp_post is None else norm_fn(mlp_post),
        norm1=norm_fn(norm1),
        qkv=fuse_linears([att.W_query, att.W_key, att.W_value], share_float=share),
        q=att.W_query,
        k=att.W_key,
        v=att.W_value,
        out=att.out_proj,
        norm2=norm_fn(norm2),
        gate_up=fuse_linears([gate, up], share_float=share) if gate is not None else None,
        gate=gate,
        up=up,
        down=down,
        act=act,
    )
    if share:  # wide float weights column-major: one-row products up to 2x faster
        mlp = (layer.gate, layer.up, layer.down) if layer.down is not None else ()
        for m in (layer.q, layer.k, layer.v, layer.out, *mlp):  # not into experts
            column_major(m)
    return layer
