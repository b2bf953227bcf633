"""The book's attention classes, in the order they are taught.

Shape legend: B batch, T tokens, ``d_in`` input width, ``d_out`` output width.

Each rung is numerically tested against the rung before it. The names and
signatures are the book's (``d_in``, ``d_out``, ``qkv_bias``, ``W_query``,
``W_key``, ``W_value``) so that readers of the text find them; ``# New:`` marks
what a rung changes.

1. :class:`SelfAttentionV1` -- three ``nn.Parameter(torch.rand(d_in, d_out))``,
   projected as ``x @ W`` (``W`` is ``(d_in, d_out)``).
2. :class:`SelfAttentionV2` -- three ``nn.Linear(d_in, d_out)``, i.e.
   ``x @ W.T + b`` with ``W`` of shape ``(d_out, d_in)`` (the ``nn.Linear``
   convention) and a better weight initialisation.

Both fix the seed text's erratum ``keys.T``: ``.T`` reverses *all* dimensions of a
batched ``(B, T, d)`` tensor; the scores use ``keys.transpose(-2, -1)`` (inside
:func:`attnlab.functional.attention_scores`).
"""

from __future__ import annotations

import torch
from torch import nn

from attnlab import functional as F

__all__ = [
    "SelfAttentionV1",
    "SelfAttentionV2",
    "copy_v2_weights_to_v1",
]


def _check_dims(d_in: object, d_out: object) -> None:
    for name, value in (("d_in", d_in), ("d_out", d_out)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"`{name}` must be an int, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"`{name}` must be a positive int, got {value}")


def _check_input(module: nn.Module, x: object, d_in: int, param: torch.Tensor) -> torch.Tensor:
    """Validate ``x`` for a ``(T, d_in)`` / ``(B, T, d_in)`` attention module."""
    x = F.check_tensor("x", x, ndims=(2, 3))
    if x.shape[-1] != d_in:
        raise ValueError(
            f"`x` must have d_in={d_in} features in its last dimension for "
            f"{type(module).__name__}(d_in={d_in}, ...), got shape {tuple(x.shape)}"
        )
    if x.dtype != param.dtype:
        raise TypeError(
            f"`x` must have the module's dtype ({param.dtype}), got {x.dtype}; "
            f"use `x.to({param.dtype})` or `module.to({x.dtype})`"
        )
    return x


class SelfAttentionV1(nn.Module):
    """Self-attention with trainable weights, as the book first writes it.

    ``W_query``, ``W_key`` and ``W_value`` are created in that order with
    ``torch.rand``, so ``torch.manual_seed(123); SelfAttentionV1(3, 2)`` holds the
    same matrices as the text's step-by-step walk and reproduces its printed output.

    Args:
        d_in: width of each input token.
        d_out: width of queries, keys, values and the output.

    Raises:
        TypeError: ``d_in`` or ``d_out`` is not an int.
        ValueError: ``d_in`` or ``d_out`` is not positive.

    Shape:
        - x: ``(T, d_in)`` or ``(B, T, d_in)``
        - output: ``(T, d_out)`` or ``(B, T, d_out)``
    """

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        _check_dims(d_in, d_out)
        self.d_in = d_in
        self.d_out = d_out
        self.W_query = nn.Parameter(torch.rand(d_in, d_out))  # (d_in, d_out)
        self.W_key = nn.Parameter(torch.rand(d_in, d_out))  # (d_in, d_out)
        self.W_value = nn.Parameter(torch.rand(d_in, d_out))  # (d_in, d_out)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values: ``x @ W_query``, ``x @ W_key``, ``x @ W_value``.

        Args:
            x: input tokens.

        Returns:
            ``(queries, keys, values)``.

        Raises:
            TypeError: non-tensor, integer or wrong-dtype ``x``.
            ValueError: ``x`` not 2-D/3-D, wrong ``d_in``, empty, NaN or inf.

        Shape:
            - x: ``(T, d_in)`` or ``(B, T, d_in)``
            - each output: ``(T, d_out)`` or ``(B, T, d_out)``
        """
        x = _check_input(self, x, self.d_in, self.W_query)
        return x @ self.W_query, x @ self.W_key, x @ self.W_value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Context vectors ``softmax(Q Kᵀ / sqrt(d_k), dim=-1) V``.

        Args:
            x: input tokens.

        Returns:
            The context vectors.

        Raises:
            TypeError: non-tensor, integer or wrong-dtype ``x``.
            ValueError: ``x`` not 2-D/3-D, wrong ``d_in``, empty, NaN or inf.

        Shape:
            - x: ``(T, d_in)`` or ``(B, T, d_in)``
            - output: ``(T, d_out)`` or ``(B, T, d_out)``
        """
        queries, keys, values = self.project(x)  # each (..., T, d_out)
        # New vs the seed: transpose(-2, -1) inside attention_scores, not keys.T.
        scores = F.attention_scores(queries, keys)  # (..., T, T)
        weights = F.attention_weights(scores, scale=F.default_scale(keys.shape[-1]))
        return F.context_vectors(weights, values)  # (..., T, d_out)

    def extra_repr(self) -> str:
        return f"d_in={self.d_in}, d_out={self.d_out}"


class SelfAttentionV2(nn.Module):
    """Self-attention with ``nn.Linear`` projections (the book's second version).

    # New: ``nn.Linear(d_in, d_out, bias=qkv_bias)`` replaces ``nn.Parameter(torch.rand)``:
    the same matrix product (``x @ weight.T``, ``weight`` of shape ``(d_out, d_in)``)
    with an initialisation that trains better, and an optional bias. The layers are
    created in the order ``W_query``, ``W_key``, ``W_value``, so
    ``torch.manual_seed(789); SelfAttentionV2(3, 2)`` gives the book's printed output.

    Args:
        d_in: width of each input token.
        d_out: width of queries, keys, values and the output.
        qkv_bias: whether the three projections have a bias.

    Raises:
        TypeError: ``d_in`` or ``d_out`` is not an int.
        ValueError: ``d_in`` or ``d_out`` is not positive.

    Shape:
        - x: ``(T, d_in)`` or ``(B, T, d_in)``
        - output: ``(T, d_out)`` or ``(B, T, d_out)``
    """

    def __init__(self, d_in: int, d_out: int, qkv_bias: bool = False) -> None:
        super().__init__()
        _check_dims(d_in, d_out)
        self.d_in = d_in
        self.d_out = d_out
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)  # weight (d_out, d_in)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)

    @classmethod
    def from_weights(
        cls, W_query: torch.Tensor, W_key: torch.Tensor, W_value: torch.Tensor
    ) -> SelfAttentionV2:
        """A bias-free V2 whose ``nn.Linear`` weights are the given matrices.

        The matrices use the ``nn.Linear`` convention, shape ``(d_out, d_in)``, and the
        module projects ``x @ W.T`` -- as the seed text's 2-D toy does with its explicit
        ``W_q``, ``W_k``, ``W_v``.

        Args:
            W_query: query weight ``(d_out, d_in)``.
            W_key: key weight ``(d_out, d_in)``.
            W_value: value weight ``(d_out, d_in)``.

        Returns:
            A new module holding copies of the matrices.

        Raises:
            TypeError: a non-floating matrix.
            ValueError: a matrix that is not 2-D or not the shape of ``W_query``.
        """
        F.check_tensor("W_query", W_query, ndims=(2,))
        d_out, d_in = W_query.shape
        for name, w in (("W_key", W_key), ("W_value", W_value)):
            F.check_tensor(name, w, ndims=(2,))
            if w.shape != W_query.shape:
                raise ValueError(
                    f"`{name}` must have the shape of `W_query` {tuple(W_query.shape)} "
                    f"(d_out, d_in), got {tuple(w.shape)}"
                )
        module = cls(d_in, d_out, qkv_bias=False).to(W_query.dtype)
        with torch.no_grad():
            module.W_query.weight.copy_(W_query)
            module.W_key.weight.copy_(W_key)
            module.W_value.weight.copy_(W_value)
        return module

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values through the three ``nn.Linear`` layers.

        Args:
            x: input tokens.

        Returns:
            ``(queries, keys, values)``.

        Raises:
            TypeError: non-tensor, integer or wrong-dtype ``x``.
            ValueError: ``x`` not 2-D/3-D, wrong ``d_in``, empty, NaN or inf.

        Shape:
            - x: ``(T, d_in)`` or ``(B, T, d_in)``
            - each output: ``(T, d_out)`` or ``(B, T, d_out)``
        """
        x = _check_input(self, x, self.d_in, self.W_query.weight)
        return self.W_query(x), self.W_key(x), self.W_value(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Context vectors ``softmax(Q Kᵀ / sqrt(d_k), dim=-1) V``.

        Args:
            x: input tokens.

        Returns:
            The context vectors.

        Raises:
            TypeError: non-tensor, integer or wrong-dtype ``x``.
            ValueError: ``x`` not 2-D/3-D, wrong ``d_in``, empty, NaN or inf.

        Shape:
            - x: ``(T, d_in)`` or ``(B, T, d_in)``
            - output: ``(T, d_out)`` or ``(B, T, d_out)``
        """
        queries, keys, values = self.project(x)  # New: nn.Linear; each (..., T, d_out)
        scores = F.attention_scores(queries, keys)  # (..., T, T)
        weights = F.attention_weights(scores, scale=F.default_scale(keys.shape[-1]))
        return F.context_vectors(weights, values)  # (..., T, d_out)

    def extra_repr(self) -> str:
        return f"d_in={self.d_in}, d_out={self.d_out}"


def copy_v2_weights_to_v1(v2: SelfAttentionV2, v1: SelfAttentionV1) -> SelfAttentionV1:
    """Copy a V2's ``nn.Linear`` weights into a V1 so both compute the same output.

    ``nn.Linear`` stores ``weight`` as ``(d_out, d_in)`` and computes ``x @ weight.T``;
    V1 computes ``x @ W`` with ``W`` of shape ``(d_in, d_out)``, so ``W = weight.T``
    (the book's exercise 3.1).

    Args:
        v2: the source; it must have no bias (V1 has none).
        v1: the destination, with the same ``d_in`` and ``d_out``; modified in place.

    Returns:
        ``v1``.

    Raises:
        TypeError: arguments of the wrong class.
        ValueError: different sizes, or a ``v2`` built with ``qkv_bias=True``.
    """
    if not isinstance(v2, SelfAttentionV2):
        raise TypeError(f"`v2` must be a SelfAttentionV2, got {type(v2).__name__}")
    if not isinstance(v1, SelfAttentionV1):
        raise TypeError(f"`v1` must be a SelfAttentionV1, got {type(v1).__name__}")
    if (v1.d_in, v1.d_out) != (v2.d_in, v2.d_out):
        raise ValueError(
            f"`v1` must have the sizes of `v2` (d_in={v2.d_in}, d_out={v2.d_out}), "
            f"got d_in={v1.d_in}, d_out={v1.d_out}"
        )
    if v2.W_query.bias is not None:
        raise ValueError(
            "`v2` must be built with qkv_bias=False: SelfAttentionV1 has no bias to copy "
            "the biases into"
        )
    with torch.no_grad():
        v1.W_query.copy_(v2.W_query.weight.T)  # (d_out, d_in) -> (d_in, d_out)
        v1.W_key.copy_(v2.W_key.weight.T)
        v1.W_value.copy_(v2.W_value.weight.T)
    return v1
