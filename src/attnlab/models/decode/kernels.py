"""The layers of a plain stack as bare kernels: what the short loop and the compiled loop
call.

A layer qualifies when it is a pre-norm or sandwich layer of RMSNorms (Llama, Mistral,
Qwen2, Qwen3, SmolLM2, Gemma 3: QK-norm per head vector, windows, a rotary embedding per
layer) with table RoPE, a gated MLP, no soft-capping, no sinks and no parallel residual,
and every product of it has a bare kernel (:func:`attnlab.quant.decode_product`) taking rows
of one dtype.

Shape legend: B batch, H query heads, G key/value heads, D head dim, C width.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from attnlab.models.decode.layout import Layer, block_parts
from attnlab.norms import RMSNorm
from attnlab.quant import decode_product, fuse_linears

__all__ = ["SHORT_LOOP_MAX_BATCH", "KernelLayer", "LayerProducts", "kernel_layers"]

# The bare kernels are the int layers' few-row ones (their crossovers to dense products
# are never below attnlab.quant.crossover.FIRST_PROBE_ROWS, this many); a batch of this
# many rows or more takes the modules' products.
SHORT_LOOP_MAX_BATCH = 16

RmsSpec = tuple[torch.Tensor, float]  # an RMSNorm's weight and eps


class LayerProducts(NamedTuple):
    """The modules behind a :class:`KernelLayer`'s four products, each product's modules
    with their outputs side by side (the compiled loop calls their kernels)."""

    qkv: tuple[Any, ...]
    out: tuple[Any, ...]
    gate_up: tuple[Any, ...]
    down: tuple[Any, ...]


@dataclass(frozen=True)
class KernelLayer:
    """One layer as bare kernels, for the short and the compiled loop."""

    norm1: RmsSpec
    norm2: RmsSpec
    attn_post: RmsSpec | None  # sandwich: norm of the attention output
    mlp_post: RmsSpec | None  # sandwich: norm of the MLP output
    qk_norm: RmsSpec | None  # (H + G, D): q's weight per query head, then k's
    dtype: torch.dtype  # what the products take: every product of the layer the same
    qkv: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # -> (q k, v)
    out: Callable[[torch.Tensor], torch.Tensor]
    gate_up: Callable[[torch.Tensor], torch.Tensor]
    down: Callable[[torch.Tensor], torch.Tensor]
    act: Callable[[torch.Tensor], torch.Tensor]
    scale: float
    window: int | None  # keys a query sees (itself included); None = all
    rope: int  # index of this layer's rotation in the plan's list (DecodePlan.ropes)
    products: LayerProducts


def _rms_spec(norm: nn.Module) -> RmsSpec | None:
    """(weight, eps) of an attnlab RMSNorm (fp32 math, ``weight * normed``), else None."""
    if type(norm) is not RMSNorm:
        return None
    return norm.weight, float(norm.eps)


def _side_by_side_kernel(linears: Sequence[Any]) -> tuple[torch.dtype, Any] | None:
    """(dtype, fn): the bare products of ``linears`` (one input) with their outputs side by
    side, one product when ``linears`` is one module; None when a kernel is missing or
    they take different dtypes."""
    found = [decode_product(m) for m in linears]
    if any(f is None for f in found) or len({f[0] for f in found if f is not None}) != 1:
        return None
    kernels = [f[1] for f in found if f is not None]
    if len(kernels) == 1:
        return found[0]
    return found[0][0], lambda x: torch.cat([k(x) for k in kernels], dim=-1)  # type: ignore[index]


def _qkv_modules(layer: Layer, share: bool) -> list[Any]:
    """The products of queries, keys and values, outputs side by side: the fused one;
    else queries and keys fused when they can be (a GGUF file's Q and K often share a type
    that V does not: Gemma 3's Q4_K_M) and values; else all three."""
    if layer.qkv is not None:
        return [layer.qkv]
    qk = fuse_linears([layer.q, layer.k], share_float=share)
    return [qk, layer.v] if qk is not None else [layer.q, layer.k, layer.v]


def _qkv_kernel(modules: Sequence[Any], nqk: int) -> tuple[torch.dtype, Any] | None:
    """(dtype, fn): ``fn(h)`` gives queries and keys side by side (B, (H + G) D) and values
    (B, G D), from :func:`_qkv_modules`' products."""
    if len(modules) == 1:
        found = decode_product(modules[0])
        if found is None:
            return None
        kernel = found[1]

        def fused(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y = kernel(x)  # (B, (H + 2G) D)
            return y[:, :nqk], y[:, nqk:]

        return found[0], fused
    found_qk = _side_by_side_kernel(modules[:-1])
    found_v = decode_product(modules[-1])
    if found_qk is None or found_v is None or found_qk[0] != found_v[0]:
        return None
    qk_kernel, v_kernel = found_qk[1], found_v[1]
    return found_v[0], lambda x: (qk_kernel(x), v_kernel(x))


def kernel_layer(
    layer: Layer, block: Any, *, H: int, G: int, D: int, scale: float, rope: int, share: bool
) -> KernelLayer | str:
    """``layer`` (read from ``block``) as bare kernels, or why it cannot be.

    Args:
        layer: the general loop's reading of ``block``.
        block: the model's block (its norm modules).
        H, G, D: query heads, key/value heads, head dim.
        scale: the model's score scale (a layer's own wins).
        rope: the index of the layer's rotary embedding in the plan's list.
        share: fuse float products too (:func:`attnlab.quant.fuse_linears`).
    """
    if layer.placement not in ("pre", "sandwich"):
        return f"norm placement {layer.placement!r}"
    for what, bad in (
        ("a parallel residual", layer.parallel),
        ("attention soft-capping", layer.softcap is not None),
        ("attention sinks", layer.sinks is not None),
        ("a mixture of experts", layer.down is None),
        ("a QK-norm across heads", layer.qk_norm not in (None, "head")),
        ("a plain (ungated) MLP", layer.gate is None),
        ("a layer without RoPE", layer.rope is None),
    ):
        if bad:
            return what
    norm1, att, norm2 = block_parts(block)[:3]
    n1, n2 = _rms_spec(norm1), _rms_spec(norm2)
    posts = [getattr(block, name, None) for name in ("attn_post_norm", "mlp_post_norm")]
    attn_post, mlp_post = (None if n is None else _rms_spec(n) for n in posts)
    if n1 is None or n2 is None:
        return "norms that are not RMSNorms"
    if (posts[0] is None) != (attn_post is None) or (posts[1] is None) != (mlp_post is None):
        return "a sandwich norm that is not an RMSNorm"
    qk_norm = None
    if layer.qk_norm is not None:
        q_norm, k_norm = _rms_spec(att.q_norm), _rms_spec(att.k_norm)
        if q_norm is None or k_norm is None or q_norm[1] != k_norm[1]:
            return "a QK-norm that is not one RMSNorm eps"
        weight = torch.cat((q_norm[0].expand(H, -1), k_norm[0].expand(G, -1)))
        qk_norm = (weight, q_norm[1])  # (H + G, D): one product for every head
    qkv_modules = _qkv_modules(layer, share)
    qkv = _qkv_kernel(qkv_modules, (H + G) * D)
    gate_up_modules = [layer.gate_up] if layer.gate_up is not None else [layer.gate, layer.up]
    gate_up = _side_by_side_kernel(gate_up_modules)
    out, down = decode_product(layer.out), decode_product(layer.down)
    if qkv is None or out is None or gate_up is None or down is None:
        return "a product without a bare kernel"
    dtypes = {qkv[0], out[0], gate_up[0], down[0]}
    if len(dtypes) != 1:
        return "products taking rows of different dtypes"
    assert layer.act is not None  # a dense MLP here
    return KernelLayer(
        norm1=n1,
        norm2=n2,
        attn_post=attn_post,
        mlp_post=mlp_post,
        qk_norm=qk_norm,
        dtype=dtypes.pop(),
        qkv=qkv[1],
        out=out[1],
        gate_up=gate_up[1],
        down=down[1],
        act=layer.act,
        scale=scale if layer.scale is None else float(layer.scale),
        window=layer.window,
        rope=rope,
        products=LayerProducts(
            tuple(qkv_modules), (layer.out,), tuple(gate_up_modules), (layer.down,)
        ),
    )


def kernel_layers(
    layers: Sequence[Layer],
    blocks: Sequence[Any],
    ropes: list[Any],
    *,
    H: int,
    G: int,
    D: int,
    scale: float,
    share: bool,
) -> list[KernelLayer] | str:
    """Every layer as bare kernels (:func:`kernel_layer`), or why the first one that
    cannot be cannot (the stack then takes the general loop)."""
    found = []
    for i, (layer, block) in enumerate(zip(layers, blocks, strict=True)):
        rope = ropes.index(layer.rope) if layer.rope in ropes else -1
        one = kernel_layer(layer, block, H=H, G=G, D=D, scale=scale, rope=rope, share=share)
        if isinstance(one, str):
            return f"layer {i}: {one}"
        found.append(one)
    return found
