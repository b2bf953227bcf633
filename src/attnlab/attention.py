"""The production attention layer: multi-head, grouped-query, multi-query and cross
attention, rotary position embedding, a KV cache, and a choice of backend.

Shape legend: B batch, H query heads, G key/value heads, T query length, S key length
(cached + new), D head dim, C = H*D model width (``embed_dim``).
"""

from __future__ import annotations

import torch
from torch import nn

from attnlab.backends import WeightsRequest, available_backends
from attnlab.backends.request import check_sinks, check_softcap
from attnlab.functional import exact_attention_weights, scaled_dot_product_attention
from attnlab.masks import AttentionMask, as_mask

__all__ = ["Attention", "KVCache", "RotaryEmbedding", "rotate_half"]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` on the last dim (the "rotate half" RoPE convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoPE), "rotate half" convention (as Hugging Face Llama).

    Dimension pair ``(i, i + D/2)`` of a head vector at position p is rotated by the angle
    ``p * base^(-2i/D)``. The cos/sin tables are cached and grown on demand; they are not
    saved in the state dict.

    Args:
        head_dim: D, even.
        base: the frequency base (10000 in the RoPE paper, 500000 in Llama 3).

    Raises:
        ValueError: odd or non-positive ``head_dim``, non-positive ``base``.
    """

    def __init__(self, head_dim: int, base: float = 10000.0) -> None:
        super().__init__()
        if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
            raise ValueError(f"`head_dim` must be a positive even int, got {head_dim!r}")
        if not base > 0:
            raise ValueError(f"`base` must be positive, got {base!r}")
        self.head_dim = head_dim
        self.base = float(base)
        inv_freq = 1.0 / (
            self.base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        )
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self._cos: torch.Tensor | None = None  # (L, D) float64
        self._sin: torch.Tensor | None = None

    def _tables(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos is None or self._cos.shape[0] < length or self._cos.device != device:
            n = max(length, 2 * (self._cos.shape[0] if self._cos is not None else 0), 256)
            # Angles in fp64 so that long positions keep their precision, then fp32.
            steps = torch.arange(0, self.head_dim, 2, dtype=torch.float64, device=device)
            inv = 1.0 / self.base ** (steps / self.head_dim)  # (D/2,)
            freqs = torch.arange(n, device=device, dtype=torch.float64)[:, None] * inv  # (L, D/2)
            emb = torch.cat((freqs, freqs), dim=-1)  # (L, D)
            self._cos, self._sin = emb.cos(), emb.sin()  # float64; cast per use
        assert self._sin is not None
        return self._cos, self._sin

    def cos_sin(
        self, position_ids: torch.Tensor, device: torch.device | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for the given positions, float64, shape ``position_ids.shape + (D,)``."""
        dev = device if device is not None else position_ids.device
        cos, sin = self._tables(int(position_ids.max()) + 1, dev)
        idx = position_ids.to(dev)
        return cos[idx], sin[idx]

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` by the positions.

        Args:
            x: ``(B, H, T, D)``.
            position_ids: ``(T,)`` or ``(B, T)`` integer positions.

        Returns:
            The rotated tensor, same shape and dtype as ``x`` (computed in fp32 or fp64).

        Shape:
            - x: ``(B, H, T, D)``; position_ids: ``(T,)`` or ``(B, T)``; output: like x.
        """
        if x.shape[-1] != self.head_dim:
            raise ValueError(
                f"`x` must have head dim {self.head_dim} for this RotaryEmbedding, "
                f"got {x.shape[-1]}"
            )
        cos, sin = self.cos_sin(position_ids, x.device)  # (T, D) or (B, T, D)
        if cos.ndim == 3:
            cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, D)
        cd = torch.float64 if x.dtype == torch.float64 else torch.float32
        xc = x.to(cd)
        return (xc * cos.to(cd) + rotate_half(xc) * sin.to(cd)).to(x.dtype)


class KVCache:
    """One layer's key/value cache for incremental decoding.

    Keys and values are appended along the sequence dim into buffers that grow by
    doubling, so decoding N tokens costs O(N) copies, not O(N^2).

    Shape:
        - update(key ``(B, G, T, D)``, value ``(B, G, T, Dv)``) returns all keys
          ``(B, G, S, D)`` and values ``(B, G, S, Dv)`` so far, S = seq_len.
    """

    def __init__(self) -> None:
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._len = 0

    @property
    def seq_len(self) -> int:
        """Number of cached positions."""
        return self._len

    def reset(self) -> None:
        """Forget everything cached."""
        self._k = self._v = None
        self._len = 0

    def update(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new keys and values; return all cached keys and values.

        Raises:
            ValueError: shapes that do not match each other or the cache.
        """
        if key.ndim != 4 or value.ndim != 4 or key.shape[:3] != value.shape[:3]:
            raise ValueError(
                "`key` and `value` must be (B, G, T, D) and (B, G, T, Dv) with matching "
                f"B, G, T, got {tuple(key.shape)} and {tuple(value.shape)}"
            )
        n = key.shape[2]
        if self._k is None or self._v is None:
            cap = max(16, n)
            self._k = key.new_empty(key.shape[0], key.shape[1], cap, key.shape[3])
            self._v = value.new_empty(value.shape[0], value.shape[1], cap, value.shape[3])
        else:
            expect = (self._k.shape[0], self._k.shape[1], self._k.shape[3], self._v.shape[3])
            got = (key.shape[0], key.shape[1], key.shape[3], value.shape[3])
            if expect != got:
                raise ValueError(
                    f"`key`/`value` do not match the cache: (B, G, D, Dv) = {expect}, got "
                    f"{got}; call reset() to start a new sequence"
                )
        if key.requires_grad or value.requires_grad:
            # Keep the autograd graph: concatenate instead of writing into the buffer.
            k_all = torch.cat([self._k[:, :, : self._len], key], dim=2)
            v_all = torch.cat([self._v[:, :, : self._len], value], dim=2)
            self._k, self._v, self._len = k_all, v_all, k_all.shape[2]
            return k_all, v_all
        need = self._len + n
        if need > self._k.shape[2]:
            cap = max(need, 2 * self._k.shape[2])
            k_new = self._k.new_empty(*self._k.shape[:2], cap, self._k.shape[3])
            v_new = self._v.new_empty(*self._v.shape[:2], cap, self._v.shape[3])
            k_new[:, :, : self._len] = self._k[:, :, : self._len]
            v_new[:, :, : self._len] = self._v[:, :, : self._len]
            self._k, self._v = k_new, v_new
        self._k[:, :, self._len : need] = key.to(self._k.dtype)
        self._v[:, :, self._len : need] = value.to(self._v.dtype)
        self._len = need
        return self._k[:, :, :need], self._v[:, :, :need]


class Attention(nn.Module):
    """Multi-head attention as real models use it.

    Grouped-query attention when ``num_kv_heads < num_heads`` (multi-query when 1), cross
    attention when ``forward`` gets a ``context`` (of width ``kdim``/``vdim``), rotary
    position embedding, a KV cache, and any attnlab backend.

    Parameters are created in the order ``W_query``, ``W_key``, ``W_value``, ``out_proj``
    (the book's order, so seeded construction matches the book's classes).

    Args:
        embed_dim: model width C.
        num_heads: query heads H; ``head_dim = embed_dim // num_heads``.
        num_kv_heads: key/value heads G (default H); must divide H.
        kdim: width of the key source (default ``embed_dim``).
        vdim: width of the value source (default ``kdim``).
        bias: bias in the Q/K/V projections.
        out_bias: bias in the output projection.
        dropout: dropout on the attention weights, in training mode.
        rope: None, True (RoPE with base 10000), a float base, or a
            :class:`RotaryEmbedding` of head dim ``head_dim``.
        backend: the attention backend (``"auto"``, ``"math"``, ``"blockwise"``, ``"sdpa"``).
        softcap: logit soft-capping ``softcap * tanh(s / softcap)`` of the scaled scores
            (Gemma 2 uses 50.0), or None.
        sinks: attention sinks (gpt-oss): True for a learned per-head logit
            :attr:`sinks` (an ``nn.Parameter`` ``(H,)``, initialised to 0), a tensor
            ``(H,)`` for its initial value, or None/False for none.

    Attributes:
        capture: None by default. Set to True (all weights) or to a
            :class:`attnlab.backends.WeightsRequest` and every forward also stores the exact
            attention weights ``(B, h, t, S)`` in :attr:`captured` (via the same exact
            weights path as ``need_weights``).
        captured: the weights of the last forward when ``capture`` was set.

    Raises:
        ValueError: ``embed_dim`` not divisible by ``num_heads``, ``num_kv_heads`` not
            dividing ``num_heads``, bad dropout, unknown backend, a RotaryEmbedding of the
            wrong head dim.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        kdim: int | None = None,
        vdim: int | None = None,
        bias: bool = False,
        out_bias: bool = True,
        dropout: float = 0.0,
        rope: RotaryEmbedding | bool | float | None = None,
        backend: str = "auto",
        softcap: float | None = None,
        sinks: bool | torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        for name, val in (("embed_dim", embed_dim), ("num_heads", num_heads)):
            if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
                raise ValueError(f"`{name}` must be a positive int, got {val!r}")
        if embed_dim % num_heads:
            raise ValueError(
                f"`embed_dim` ({embed_dim}) must be divisible by `num_heads` ({num_heads}); "
                f"e.g. num_heads={_divisor_hint(embed_dim, num_heads)}"
            )
        G = num_heads if num_kv_heads is None else num_kv_heads
        if isinstance(G, bool) or not isinstance(G, int) or G <= 0 or num_heads % G:
            raise ValueError(
                f"`num_kv_heads` must be a positive divisor of num_heads={num_heads}, got {G!r}"
            )
        if not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"`dropout` must be in [0, 1), got {dropout!r}")
        if backend not in available_backends():
            raise ValueError(f"`backend` must be one of {available_backends()}, got {backend!r}")
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.num_kv_heads = G
        self.head_dim = embed_dim // num_heads
        self.kdim = embed_dim if kdim is None else kdim
        self.vdim = self.kdim if vdim is None else vdim
        self.dropout = float(dropout)
        self.backend = backend
        D = self.head_dim
        self.W_query = nn.Linear(embed_dim, num_heads * D, bias=bias)
        self.W_key = nn.Linear(self.kdim, G * D, bias=bias)
        self.W_value = nn.Linear(self.vdim, G * D, bias=bias)
        self.out_proj = nn.Linear(num_heads * D, embed_dim, bias=out_bias)
        if rope is None or rope is False:
            self.rope: RotaryEmbedding | None = None
        elif rope is True:
            self.rope = RotaryEmbedding(D)
        elif isinstance(rope, RotaryEmbedding):
            if rope.head_dim != D:
                raise ValueError(
                    f"`rope` has head_dim={rope.head_dim}, but this layer's head_dim is {D}"
                )
            self.rope = rope
        elif isinstance(rope, (int, float)):
            self.rope = RotaryEmbedding(D, base=float(rope))
        else:
            raise TypeError(
                f"`rope` must be None, True, a float base or a RotaryEmbedding, got "
                f"{type(rope).__name__}"
            )
        self.softcap = check_softcap(softcap)
        if sinks is None or sinks is False:
            self.sinks: nn.Parameter | None = None
        elif sinks is True:
            self.sinks = nn.Parameter(torch.zeros(num_heads))
        else:
            init = check_sinks(
                sinks,
                num_heads,
                sinks.device if isinstance(sinks, torch.Tensor) else torch.device("cpu"),
            )
            assert init is not None
            self.sinks = nn.Parameter(init.detach().clone())
        self.capture: bool | WeightsRequest | None = None
        self.captured: torch.Tensor | None = None

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        *,
        attn_mask: AttentionMask | torch.Tensor | None = None,
        is_causal: bool = False,
        kv_cache: KVCache | None = None,
        position_ids: torch.Tensor | None = None,
        need_weights: bool | WeightsRequest = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend from ``x`` to itself (or to ``context``).

        Args:
            x: queries' source ``(B, T, C)``.
            context: keys' and values' source ``(B, S_new, kdim)`` for cross attention;
                None for self-attention.
            attn_mask: as :func:`attnlab.functional.scaled_dot_product_attention`, over
                all ``S`` keys (cached + new).
            is_causal: causal masking; aligned bottom-right when ``T != S`` (cache).
            kv_cache: new keys/values are appended to it and all of them are used.
            position_ids: RoPE positions ``(T,)`` or ``(B, T)``; default
                ``cache.seq_len + arange(T)``.
            need_weights: False, True, or a ``WeightsRequest``.

        Returns:
            ``(B, T, C)``, or ``(output, weights (B, h, t, S))`` when ``need_weights``.

        Shape:
            - x: ``(B, T, C)``; context: ``(B, S_new, kdim)``; output: ``(B, T, C)``

        Raises:
            ValueError, TypeError: wrong shapes or widths, RoPE with cross attention,
                bad position ids, anything the attention function rejects.
        """
        if not isinstance(x, torch.Tensor) or x.ndim != 3 or x.shape[-1] != self.embed_dim:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"`x` must be (B, T, C={self.embed_dim}), got {got}")
        B, T, _ = x.shape
        H, G, D = self.num_heads, self.num_kv_heads, self.head_dim
        if context is not None:
            if not isinstance(context, torch.Tensor) or context.ndim != 3:
                raise ValueError("`context` must be a (B, S, kdim) tensor")
            if context.shape[0] != B or context.shape[-1] != self.kdim:
                raise ValueError(
                    f"`context` must be (B={B}, S, kdim={self.kdim}), got {tuple(context.shape)}"
                )
            if self.kdim != self.vdim:
                raise ValueError(
                    f"this layer has kdim={self.kdim} != vdim={self.vdim}; one `context` "
                    "cannot serve both (use equal widths)"
                )
            if self.rope is not None:
                raise ValueError(
                    "`context` (cross attention) with rope: rotary positions of two "
                    "different sequences are not comparable; build the layer with rope=None"
                )
        elif self.kdim != self.embed_dim or self.vdim != self.embed_dim:
            raise ValueError(
                f"self-attention needs kdim == vdim == embed_dim, this layer has "
                f"kdim={self.kdim}, vdim={self.vdim}; pass `context`"
            )
        src = x if context is None else context
        S_new = src.shape[1]

        queries = self.W_query(x).view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        keys = self.W_key(src).view(B, S_new, G, D).transpose(1, 2)  # (B, G, S_new, D)
        values = self.W_value(src).view(B, S_new, G, D).transpose(1, 2)  # (B, G, S_new, D)

        if self.rope is not None:
            pos = self._positions(position_ids, B, T, kv_cache, x.device)
            queries = self.rope(queries, pos)
            keys = self.rope(keys, pos)
        elif position_ids is not None:
            raise ValueError("`position_ids` is only used with rope; this layer has rope=None")

        if kv_cache is not None:
            keys, values = kv_cache.update(keys, values)  # (B, G, S, D)
        mask = as_mask(attn_mask, is_causal)
        dropout_p = self.dropout if self.training else 0.0

        capture = WeightsRequest.from_arg(self.capture, "capture") if self.capture else None
        asked = WeightsRequest.from_arg(need_weights)
        request = asked if asked is not None else capture
        result = scaled_dot_product_attention(
            queries,
            keys,
            values,
            mask,
            dropout_p,
            scale=None,
            backend=self.backend,
            need_weights=request if request is not None else False,
            softcap=self.softcap,
            sinks=self.sinks,
        )
        if request is not None:
            out, weights = result  # type: ignore[misc]
        else:
            out, weights = result, None  # type: ignore[assignment]
        if capture is not None:
            if capture == request:
                self.captured = weights.detach() if weights is not None else None
            else:
                self.captured = exact_attention_weights(
                    queries, keys, mask, heads=capture.heads, rows=capture.rows,
                    softcap=self.softcap, sinks=self.sinks,
                )  # fmt: skip
        out = out.transpose(1, 2).reshape(B, T, H * D)  # (B, T, C)
        out = self.out_proj(out)  # (B, T, C)
        if asked is not None:
            return out, weights  # type: ignore[return-value]
        return out

    def _positions(
        self,
        position_ids: torch.Tensor | None,
        B: int,
        T: int,
        kv_cache: KVCache | None,
        device: torch.device,
    ) -> torch.Tensor:
        if position_ids is None:
            start = kv_cache.seq_len if kv_cache is not None else 0
            return torch.arange(start, start + T, device=device)  # (T,)
        if not isinstance(position_ids, torch.Tensor) or position_ids.is_floating_point():
            raise TypeError("`position_ids` must be an integer tensor (T,) or (B, T)")
        if position_ids.shape not in ((T,), (B, T), (1, T)):
            raise ValueError(
                f"`position_ids` must have shape (T,) or (B, T) = ({B}, {T}), got "
                f"{tuple(position_ids.shape)}"
            )
        if bool((position_ids < 0).any()):
            raise ValueError("`position_ids` must be non-negative")
        return position_ids

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"backend={self.backend!r}, rope={self.rope is not None}"
            + (f", softcap={self.softcap}" if self.softcap is not None else "")
            + (", sinks=True" if self.sinks is not None else "")
        )


def _divisor_hint(embed_dim: int, num_heads: int) -> int:
    divisors = [d for d in range(1, embed_dim + 1) if embed_dim % d == 0]
    return min(divisors, key=lambda d: abs(d - num_heads))
