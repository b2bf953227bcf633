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
    "CausalAttention",
    "MultiHeadAttention",
    "MultiHeadAttentionWrapper",
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


# ---------------------------------------------------------------------------------------
# The seed's announced next steps: causal attention, then multi-head attention
# (the book's section 3.5 and 3.6), each marking with "# New:" what it changes.
# ---------------------------------------------------------------------------------------


def _check_context(module: nn.Module, x: torch.Tensor, context_length: int) -> None:
    T = x.shape[-2]
    if context_length < T:
        raise ValueError(
            f"`x` has {T} tokens, more than the context_length={context_length} this "
            f"{type(module).__name__} was built for; build it with "
            f"context_length >= {T} or feed at most {context_length} tokens"
        )


def _check_heads(d_out: int, num_heads: object, *, divides: bool) -> None:
    if isinstance(num_heads, bool) or not isinstance(num_heads, int):
        raise TypeError(f"`num_heads` must be an int, got {type(num_heads).__name__}")
    if num_heads < 1:
        raise ValueError(f"`num_heads` must be a positive int, got {num_heads}")
    if divides and d_out % num_heads:
        options = [h for h in range(1, d_out + 1) if d_out % h == 0]
        raise ValueError(
            f"`d_out` ({d_out}) must be divisible by `num_heads` ({num_heads}): each head "
            f"gets d_out // num_heads features; choose num_heads in {options}"
        )


def _check_dropout(dropout: object) -> None:
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)):
        raise TypeError(f"`dropout` must be a float, got {type(dropout).__name__}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"`dropout` must be in [0, 1), got {dropout}")


def _check_context_length(context_length: object) -> None:
    if isinstance(context_length, bool) or not isinstance(context_length, int):
        raise TypeError(f"`context_length` must be an int, got {type(context_length).__name__}")
    if context_length < 1:
        raise ValueError(f"`context_length` must be a positive int, got {context_length}")


class CausalAttention(nn.Module):
    """Causal (masked) self-attention: a token attends only to itself and the past.

    What changed from :class:`SelfAttentionV2`::

        self.dropout = nn.Dropout(dropout)                     # New
        self.register_buffer("mask", torch.triu(ones, 1))      # New: the future
        scores.masked_fill_(future, -torch.inf)                # New: before the softmax
        weights = self.dropout(weights)                        # New

    Masking with ``-inf`` *before* the softmax makes the future's weights exactly 0 and
    each row still sums to 1 (no renormalisation needed). The ``mask`` buffer is the
    book's: a float ``triu`` with 1 marking the *future*, kept so that the book's
    checkpoints load; attnlab's convention (True = may attend) is applied in ``forward``.

    Args:
        d_in: width of each input token.
        d_out: width of queries, keys, values and the output.
        context_length: the longest input supported (size of the mask buffer).
        dropout: dropout probability on the attention weights (training only).
        qkv_bias: whether the three projections have a bias.

    Raises:
        TypeError, ValueError: bad sizes or dropout; in ``forward``, more than
            ``context_length`` tokens.

    Shape:
        - x: ``(T, d_in)`` or ``(B, T, d_in)``, ``T <= context_length``
        - output: ``(T, d_out)`` or ``(B, T, d_out)``
    """

    mask: torch.Tensor  # the book's buffer: 1 marks the future

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int,
        dropout: float,
        qkv_bias: bool = False,
    ) -> None:
        super().__init__()
        _check_dims(d_in, d_out)
        _check_context_length(context_length)
        _check_dropout(dropout)
        self.d_in = d_in
        self.d_out = d_out
        self.context_length = context_length
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(dropout)  # New
        self.register_buffer(  # New: 1 marks the future (the book's buffer)
            "mask", torch.triu(torch.ones(context_length, context_length), diagonal=1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Causal context vectors.

        Args:
            x: input tokens.

        Returns:
            The context vectors.

        Raises:
            TypeError: non-tensor, integer or wrong-dtype ``x``.
            ValueError: wrong rank or ``d_in``, or more than ``context_length`` tokens.

        Shape:
            - x: ``(T, d_in)`` or ``(B, T, d_in)``
            - output: ``(T, d_out)`` or ``(B, T, d_out)``
        """
        x = _check_input(self, x, self.d_in, self.W_query.weight)
        _check_context(self, x, self.context_length)
        T = x.shape[-2]
        queries, keys, values = self.W_query(x), self.W_key(x), self.W_value(x)  # (..., T, d_out)
        scores = queries @ keys.transpose(-2, -1)  # (..., T, T)
        allowed = self.mask[:T, :T] == 0  # New: True = may attend (attnlab's convention)
        scores = scores.masked_fill(~allowed, -torch.inf)  # New: hide the future
        weights = torch.softmax(scores / keys.shape[-1] ** 0.5, dim=-1)  # (..., T, T)
        weights = self.dropout(weights)  # New
        return weights @ values  # (..., T, d_out)

    def extra_repr(self) -> str:
        return f"d_in={self.d_in}, d_out={self.d_out}, context_length={self.context_length}"


class MultiHeadAttentionWrapper(nn.Module):
    """Several :class:`CausalAttention` heads side by side, outputs concatenated.

    What changed from :class:`CausalAttention`::

        self.heads = nn.ModuleList([CausalAttention(...) for _ in range(num_heads)])  # New
        return torch.cat([head(x) for head in self.heads], dim=-1)                     # New

    Here ``d_out`` is *per head*: the output has ``num_heads * d_out`` features, and there
    is no output projection. The heads are created one after another, so
    ``torch.manual_seed(123)`` gives head 0 the weights a lone ``CausalAttention`` gets.

    Args:
        d_in: width of each input token.
        d_out: width of each head's output.
        context_length: the longest input supported.
        dropout: dropout on each head's attention weights.
        num_heads: number of heads.
        qkv_bias: whether the projections have a bias.

    Raises:
        TypeError, ValueError: bad sizes, heads or dropout; in ``forward``, more than
            ``context_length`` tokens.

    Shape:
        - x: ``(T, d_in)`` or ``(B, T, d_in)``
        - output: ``(T, num_heads * d_out)`` or ``(B, T, num_heads * d_out)``
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int,
        dropout: float,
        num_heads: int,
        qkv_bias: bool = False,
    ) -> None:
        super().__init__()
        _check_heads(d_out, num_heads, divides=False)
        self.heads = nn.ModuleList(  # New: one CausalAttention per head
            [
                CausalAttention(d_in, d_out, context_length, dropout, qkv_bias)
                for _ in range(num_heads)
            ]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Every head's context vectors, concatenated on the last dim.

        Shape:
            - x: ``(T, d_in)`` or ``(B, T, d_in)``
            - output: ``(..., T, num_heads * d_out)``
        """
        return torch.cat([head(x) for head in self.heads], dim=-1)  # New: (..., T, H * d_out)


class MultiHeadAttention(nn.Module):
    """Multi-head attention with one projection per Q/K/V, split into heads.

    What changed from :class:`MultiHeadAttentionWrapper`::

        self.head_dim = d_out // num_heads                      # New: d_out is the total
        q = self.W_query(x).view(b, T, H, head_dim).transpose(1, 2)   # New: split heads
        out = (weights @ values).transpose(1, 2).reshape(b, T, d_out) # New: merge heads
        self.out_proj = nn.Linear(d_out, d_out)                 # New: mixes the heads

    One matrix product per projection serves all heads (instead of one module per head),
    and ``out_proj`` lets heads combine. Parameters are created in the order
    ``W_query``, ``W_key``, ``W_value``, ``out_proj``.

    Args:
        d_in: width of each input token.
        d_out: total output width; ``head_dim = d_out // num_heads``.
        context_length: the longest input supported.
        dropout: dropout on the attention weights.
        num_heads: number of heads; must divide ``d_out``.
        qkv_bias: whether the Q/K/V projections have a bias (``out_proj`` always has).

    Raises:
        TypeError, ValueError: ``d_out`` not divisible by ``num_heads``, bad sizes or
            dropout; in ``forward``, more than ``context_length`` tokens.

    Shape:
        - x: ``(T, d_in)`` or ``(B, T, d_in)``
        - output: ``(T, d_out)`` or ``(B, T, d_out)``
    """

    mask: torch.Tensor  # the book's buffer: 1 marks the future

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int,
        dropout: float,
        num_heads: int,
        qkv_bias: bool = False,
    ) -> None:
        super().__init__()
        _check_dims(d_in, d_out)
        _check_heads(d_out, num_heads, divides=True)
        _check_context_length(context_length)
        _check_dropout(dropout)
        self.d_in = d_in
        self.d_out = d_out
        self.context_length = context_length
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads  # New
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)  # New: combines the heads' outputs
        self.dropout = nn.Dropout(dropout)
        self.register_buffer(
            "mask", torch.triu(torch.ones(context_length, context_length), diagonal=1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Multi-head causal context vectors, projected by ``out_proj``.

        Args:
            x: input tokens.

        Returns:
            The context vectors.

        Raises:
            TypeError: non-tensor, integer or wrong-dtype ``x``.
            ValueError: wrong rank or ``d_in``, or more than ``context_length`` tokens.

        Shape:
            - x: ``(T, d_in)`` or ``(B, T, d_in)``
            - output: ``(T, d_out)`` or ``(B, T, d_out)``
        """
        x = _check_input(self, x, self.d_in, self.W_query.weight)
        _check_context(self, x, self.context_length)
        single = x.ndim == 2
        if single:
            x = x.unsqueeze(0)  # (1, T, d_in)
        b, T, _ = x.shape
        H, hd = self.num_heads, self.head_dim
        # New: split the last dim into heads, and move heads before tokens.
        queries = self.W_query(x).view(b, T, H, hd).transpose(1, 2)  # (b, H, T, hd)
        keys = self.W_key(x).view(b, T, H, hd).transpose(1, 2)  # (b, H, T, hd)
        values = self.W_value(x).view(b, T, H, hd).transpose(1, 2)  # (b, H, T, hd)
        scores = queries @ keys.transpose(2, 3)  # (b, H, T, T): every head at once
        allowed = self.mask[:T, :T] == 0  # True = may attend
        scores = scores.masked_fill(~allowed, -torch.inf)
        weights = torch.softmax(scores / keys.shape[-1] ** 0.5, dim=-1)  # (b, H, T, T)
        weights = self.dropout(weights)
        context = (weights @ values).transpose(1, 2)  # (b, T, H, hd)
        context = context.reshape(b, T, self.d_out)  # New: merge heads, (b, T, d_out)
        out = self.out_proj(context)  # New: (b, T, d_out)
        return out[0] if single else out

    def extra_repr(self) -> str:
        return (
            f"d_in={self.d_in}, d_out={self.d_out}, context_length={self.context_length}, "
            f"num_heads={self.num_heads}"
        )
