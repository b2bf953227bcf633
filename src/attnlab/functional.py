"""The math of self-attention as plain functions.

Shape legend (used in every module that reshapes):
    B batch, H query heads, G key/value heads, T query length, S key length,
    D head dim, C = H*D model width, ``...`` any leading batch dimensions.

These are the seed text's steps, one function each:

1. :func:`attention_scores`  -- dot products of queries with keys (``Q @ K^T``).
2. :func:`attention_weights` -- optional scaling, then softmax over the last dim.
3. :func:`context_vectors`   -- the weighted sum of the values (``weights @ V``).

:func:`simplified_self_attention` chains them without trainable weights or scaling
(the seed's section 3.3). The production entry point,
``scaled_dot_product_attention``, dispatches to a backend (see ``attnlab.backends``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from attnlab.backends import (
    WeightsRequest,
    exact_weights,
    prepare_call,
    resolve_call,
    select_weights,
)

if TYPE_CHECKING:
    from attnlab.masks import AttentionMask

__all__ = [
    "SimplifiedAttention",
    "attention_scores",
    "attention_weights",
    "check_tensor",
    "context_vectors",
    "default_scale",
    "exact_attention_weights",
    "scaled_dot_product_attention",
    "simplified_self_attention",
]


def check_tensor(
    name: str,
    tensor: object,
    *,
    ndims: tuple[int, ...] | None = None,
    floating: bool = True,
    finite: bool = True,
    nonempty: bool = True,
) -> torch.Tensor:
    """Validate a public tensor argument and return it.

    Raises ``TypeError`` for a non-tensor or a non-floating tensor and ``ValueError``
    for a wrong rank, an empty tensor or non-finite values. Every message names the
    argument, what was expected, what was got, and how to fix it.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type(tensor).__name__}")
    if floating and not tensor.is_floating_point():
        raise TypeError(
            f"`{name}` must be a floating-point tensor, got dtype {tensor.dtype}; "
            f"convert it with `{name}.float()`"
        )
    if ndims is not None and tensor.ndim not in ndims:
        expected = " or ".join(f"{n}-D" for n in ndims)
        raise ValueError(
            f"`{name}` must be {expected}, got a {tensor.ndim}-D tensor of shape "
            f"{tuple(tensor.shape)}"
        )
    if nonempty and tensor.numel() == 0:
        raise ValueError(
            f"`{name}` must not be empty, got shape {tuple(tensor.shape)}; "
            "attention needs at least one token"
        )
    if finite and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise ValueError(
            f"`{name}` contains NaN or inf; attention of non-finite values is undefined "
            "(check the embedding or the previous layer)"
        )
    return tensor


def attention_scores(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Dot products of every query with every key (unnormalised attention scores).

    This is the seed's ``attn_scores = inputs @ inputs.T`` and, with trainable
    weights, ``query_2 @ keys.T``. It uses ``keys.transpose(-2, -1)`` rather than
    ``keys.T`` so that batched keys work (``.T`` reverses *all* dimensions of a
    3-D tensor, one of the seed text's errata).

    Args:
        queries: one query ``(D,)``, or queries ``(..., T, D)``.
        keys: keys ``(..., S, D)``.

    Returns:
        Scores ``(..., S)`` for a single query, else ``(..., T, S)``.

    Shape:
        - queries: ``(D,)`` or ``(..., T, D)``
        - keys: ``(..., S, D)``
        - output: ``(S,)`` or ``(..., T, S)``

    Raises:
        TypeError: non-tensor or non-floating input, or different dtypes.
        ValueError: keys not at least 2-D, or a different last dimension ``D``.
    """
    check_tensor("queries", queries, finite=False)
    check_tensor("keys", keys, finite=False)
    if keys.ndim < 2:
        raise ValueError(
            f"`keys` must be at least 2-D (S, D), got shape {tuple(keys.shape)}; "
            "for a single key use `keys.unsqueeze(0)`"
        )
    if queries.dtype != keys.dtype:
        raise TypeError(
            f"`keys` must have the same dtype as `queries` ({queries.dtype}), got {keys.dtype}; "
            f"convert one of them, e.g. `keys.to({queries.dtype})`"
        )
    if queries.shape[-1] != keys.shape[-1]:
        raise ValueError(
            f"`keys` must have the same last dimension as `queries` "
            f"(D={queries.shape[-1]}), got D={keys.shape[-1]}"
        )
    return queries @ keys.transpose(-2, -1)  # (..., T, S) or (S,)


def attention_weights(scores: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Normalise scores into attention weights: softmax over the last dimension.

    ``dim=-1`` is the key axis: for a ``(T, S)`` score matrix every *row* (one
    query) becomes a probability distribution over the keys and sums to 1. When
    ``scale`` is given the scores are multiplied by it first (``1/sqrt(d_k)`` in
    scaled dot-product attention). The softmax runs in fp32 for half-precision
    input and the result is cast back, so that fp16/bf16 sums stay accurate.

    Args:
        scores: attention scores ``(..., S)``.
        scale: factor applied to the scores before the softmax, or None.

    Returns:
        Weights of the same shape and dtype as ``scores``; each row sums to 1.

    Shape:
        - scores: ``(..., S)``
        - output: ``(..., S)``

    Raises:
        TypeError: non-floating scores or a non-number scale.
        ValueError: empty scores or a non-positive / non-finite scale.
    """
    check_tensor("scores", scores, finite=False)
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(
                f"`scale` must be a Python float or None, got {type(scale).__name__}; "
                "pass `float(scale)`"
            )
        if not (0 < scale < float("inf")):
            raise ValueError(f"`scale` must be a positive finite number, got {scale!r}")
    compute = scores.float() if scores.dtype in (torch.float16, torch.bfloat16) else scores
    if scale is not None:
        compute = compute * scale
    return torch.softmax(compute, dim=-1).to(scores.dtype)


def default_scale(head_dim: int) -> float:
    """The scaled dot-product factor ``1 / sqrt(d_k)`` for keys of width ``head_dim``.

    Dot products of ``d_k``-dimensional vectors grow like ``sqrt(d_k)``; dividing by
    it keeps the softmax out of its flat, small-gradient regions.

    Args:
        head_dim: the key dimension ``d_k`` (``keys.shape[-1]``).

    Returns:
        ``1 / sqrt(head_dim)``.

    Raises:
        TypeError: ``head_dim`` is not an int.
        ValueError: ``head_dim`` is not positive.
    """
    if isinstance(head_dim, bool) or not isinstance(head_dim, int):
        raise TypeError(f"`head_dim` must be an int, got {type(head_dim).__name__}")
    if head_dim < 1:
        raise ValueError(f"`head_dim` must be positive, got {head_dim}")
    return 1.0 / math.sqrt(head_dim)


def context_vectors(weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Weighted sums of the values: ``weights @ values``.

    Args:
        weights: attention weights ``(S,)`` or ``(..., T, S)``.
        values: values ``(..., S, Dv)``.

    Returns:
        Context vectors ``(Dv,)`` or ``(..., T, Dv)``.

    Shape:
        - weights: ``(S,)`` or ``(..., T, S)``
        - values: ``(..., S, Dv)``
        - output: ``(Dv,)`` or ``(..., T, Dv)``

    Raises:
        TypeError: non-floating input or different dtypes.
        ValueError: the number of weights per row does not match the number of values.
    """
    check_tensor("weights", weights, finite=False)
    check_tensor("values", values, finite=False)
    if values.ndim < 2:
        raise ValueError(f"`values` must be at least 2-D (S, Dv), got shape {tuple(values.shape)}")
    if weights.dtype != values.dtype:
        raise TypeError(
            f"`values` must have the same dtype as `weights` ({weights.dtype}), "
            f"got {values.dtype}; convert one of them, e.g. `values.to({weights.dtype})`"
        )
    if weights.shape[-1] != values.shape[-2]:
        raise ValueError(
            f"`weights` must have one weight per value (S={values.shape[-2]}), "
            f"got {weights.shape[-1]} in the last dimension"
        )
    return weights @ values  # (..., T, Dv)


@dataclass(frozen=True)
class SimplifiedAttention:
    """Result of :func:`simplified_self_attention`."""

    scores: torch.Tensor  # (..., T, T)
    weights: torch.Tensor  # (..., T, T)
    context: torch.Tensor  # (..., T, D)


def simplified_self_attention(inputs: torch.Tensor) -> SimplifiedAttention:
    """Self-attention with no trainable weights and no scaling (seed, section 3.3).

    Each token's embedding serves as its own query, key and value:
    ``scores = inputs @ inputs^T``, ``weights = softmax(scores, dim=-1)``,
    ``context = weights @ inputs``.

    Args:
        inputs: token embeddings ``(T, D)`` or a batch ``(B, T, D)``.

    Returns:
        The scores, weights and context vectors.

    Shape:
        - inputs: ``(T, D)`` or ``(B, T, D)``
        - scores, weights: ``(T, T)`` or ``(B, T, T)``
        - context: ``(T, D)`` or ``(B, T, D)``

    Raises:
        TypeError: non-tensor or integer input.
        ValueError: wrong rank, empty sequence, NaN or inf.
    """
    check_tensor("inputs", inputs, ndims=(2, 3))
    scores = attention_scores(inputs, inputs)  # (..., T, T)
    weights = attention_weights(scores)  # (..., T, T)
    context = context_vectors(weights, inputs)  # (..., T, D)
    return SimplifiedAttention(scores=scores, weights=weights, context=context)


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: AttentionMask | torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    backend: str = "auto",
    need_weights: bool | WeightsRequest = False,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention, computed by a chosen (or the fastest capable) backend.

    The math, for each batch item and query head h (served by key/value head
    ``h // (H // G)``)::

        scores  = query @ key^T * scale          # scale defaults to 1/sqrt(D)
        scores  = softcap * tanh(scores / softcap)   # only with softcap=
        scores += bias; scores[~allowed] = -inf  # from attn_mask (True = may attend)
        weights = softmax(scores, dim=-1)        # a row with nothing allowed -> zeros
        # with sinks=: softmax over [scores, sinks[h]], the sink column then dropped
        output  = dropout(weights, dropout_p) @ value

    Args:
        query: queries ``(B, H, T, D)``.
        key: keys ``(B, G, S, D)``; ``H`` must be a multiple of ``G`` (grouped-query).
        value: values ``(B, G, S, Dv)``.
        attn_mask: None, an :class:`attnlab.masks.AttentionMask`, a bool tensor
            broadcastable to ``(B, H, T, S)`` (True = may attend), or a float tensor
            added to the scaled scores.
        dropout_p: dropout probability on the attention weights (0 in evaluation).
        is_causal: apply a causal mask; when ``T != S`` it aligns the last query with
            the last key (bottom-right), as when decoding with a KV cache.
        scale: score scale; None means ``1/sqrt(D)``.
        backend: ``"auto"`` (the fastest backend that supports the call), ``"math"``,
            ``"blockwise"``, ``"sdpa"``, or any registered backend.
        need_weights: False; True for all weights; or a
            :class:`attnlab.backends.WeightsRequest` selecting heads and query rows.
            Fast backends return exact weights recomputed block by block from the
            row log-sum-exp (detached); ``math`` returns its own (differentiable).
            Weights are the pre-dropout softmax.
        softcap: logit soft-capping (Gemma 2): ``softcap * tanh(s / softcap)`` on the
            scaled scores, before masks and biases; None for none. Must be > 0.
        sinks: attention sinks (gpt-oss): a float tensor ``(H,)``, one learned logit per
            query head that joins every row's softmax denominator (it takes probability
            mass and contributes no value); gradients reach it. None for none.

    Returns:
        ``output`` ``(B, H, T, Dv)``, or ``(output, weights)`` with weights
        ``(B, h, t, S)`` for the selected h heads and t rows when ``need_weights``.

    Shape:
        - query: ``(B, H, T, D)``
        - key: ``(B, G, S, D)``
        - value: ``(B, G, S, Dv)``
        - sinks: ``(H,)``
        - output: ``(B, H, T, Dv)``

    Raises:
        TypeError: non-tensor or non-floating input, mixed dtypes, a mask of the wrong
            dtype.
        ValueError: wrong rank, mismatched batch / head dim / lengths, ``H`` not a
            multiple of ``G``, a mask that does not broadcast, ``dropout_p`` outside
            [0, 1), an unknown backend, a backend that cannot serve the call (with its
            reason), an unknown head or row in ``need_weights``, ``softcap <= 0``,
            ``sinks`` not a float tensor ``(H,)``.
    """
    # validated and chosen once per call signature, then cached
    chosen, mask, scale_f, wanted, softcap_f, sinks_t = resolve_call(
        query,
        key,
        value,
        attn_mask,
        dropout_p,
        is_causal,
        scale,
        backend,
        need_weights,
        softcap=softcap,
        sinks=sinks,
    )
    result = chosen.run(
        query,
        key,
        value,
        mask,
        dropout_p=dropout_p,
        scale=scale_f,
        softcap=softcap_f,
        sinks=sinks_t,
    )
    if wanted is None:
        return result.output
    if result.weights is not None:
        weights = select_weights(result.weights, wanted)
    else:
        weights = exact_weights(
            query,
            key,
            mask,
            scale_f,
            wanted,
            lse=result.lse,
            softcap=softcap_f,
            sinks=sinks_t,
        )
    return result.output, weights


def exact_attention_weights(
    query: torch.Tensor,
    key: torch.Tensor,
    attn_mask: AttentionMask | torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    heads: list[int] | tuple[int, ...] | None = None,
    rows: list[int] | tuple[int, ...] | slice | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact attention weights for chosen heads and query rows, without ``B x H x T x S``.

    Computed block by block over the keys (one pass for the row log-sum-exp, one for the
    weights); memory is the size of the result. This is the path ``need_weights`` takes
    on the fast backends, without computing the attention output.

    Args:
        query: ``(B, H, T, D)``.
        key: ``(B, G, S, D)``.
        attn_mask: as for :func:`scaled_dot_product_attention`.
        is_causal: as for :func:`scaled_dot_product_attention`.
        scale: as for :func:`scaled_dot_product_attention`.
        heads: query heads to return (None = all).
        rows: query positions to return (None = all).
        softcap: as for :func:`scaled_dot_product_attention`.
        sinks: as for :func:`scaled_dot_product_attention`.

    Returns:
        Detached weights ``(B, h, t, S)``.

    Shape:
        - query: ``(B, H, T, D)``, key: ``(B, G, S, D)``, output: ``(B, h, t, S)``

    Raises:
        ValueError, TypeError: as :func:`scaled_dot_product_attention`.
    """
    request = WeightsRequest(heads=heads, rows=rows)  # type: ignore[arg-type]
    value = key[..., :1]  # shape-only stand-in: the weights never touch the values
    call = prepare_call(
        query,
        key,
        value,
        attn_mask,
        0.0,
        is_causal,
        scale,
        "math",
        request,
        softcap=softcap,
        sinks=sinks,
    )
    return exact_weights(
        query, key, call.mask, call.scale, request, softcap=call.softcap, sinks=call.sinks
    )
