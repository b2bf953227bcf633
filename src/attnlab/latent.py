"""Multi-head latent attention (MLA): DeepSeek-V2/V3/R1's and Kimi K2's attention.

Plain multi-head attention caches a key and a value per head per token. MLA caches one
compressed *latent* per token instead, shared by every head, and rebuilds the heads' keys
and values from it:

- ``c = RMSNorm(x W_dkv)`` ``(T, r)``, ``r = kv_lora_rank`` (the latent);
- each head's key is ``[c W_uk_h, k_rope]``: a "nope" part from the latent
  (``qk_nope_head_dim`` dims, no position) and a *decoupled rotary key* ``k_rope``
  (``qk_rope_head_dim`` dims) computed from ``x`` once and shared by all heads;
- each head's value is ``c W_uv_h`` (``v_head_dim`` dims);
- queries come from ``x`` directly or through a low-rank pair
  ``RMSNorm(x W_dq) W_uq`` (``q_lora_rank``), split the same way into nope and rotary dims.

The cache holds ``[c, k_rope]``: ``kv_lora_rank + qk_rope_head_dim`` numbers per token and
layer, against ``H * (qk_nope_head_dim + qk_rope_head_dim + v_head_dim)`` for the same
heads as plain multi-head attention (:meth:`MLAConfig.cache_bytes_per_token`).

There are two ways to compute it, with one result:

- **expanded** (the textbook form): multiply the cached latent by ``W_uk``/``W_uv`` into
  per-head keys and values, then attend as usual. It is what the explainer shows, and the
  cheaper form for a long prompt (the expansion is paid once per key);
- **absorbed** (the decode form): ``q_nope · (c W_uk_h) = (q_nope W_uk_hᵀ) · c``, so the
  up-projection moves into the query, and ``W_uv`` moves to after the weighted sum of the
  latents. Every head then attends to the same keys ``[c, k_rope]`` with values ``c``:
  multi-query attention of head dim ``r + qk_rope_head_dim``, and nothing per head is ever
  built for the cached tokens. That is the cheaper form for one new token over a long cache.

Shape legend: B batch, H heads, T new tokens, S keys (cached + new), C width, r the latent
rank (``kv_lora_rank``), Dn / Dr / Dv the nope, rotary and value head dims, D = Dn + Dr.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from attnlab.attention import (
    _EDITOR,
    _RECORDER,
    Attention,
    KVCache,
)
from attnlab.backends import WeightsRequest, available_backends
from attnlab.functional import scaled_dot_product_attention
from attnlab.masks import AttentionMask
from attnlab.norms import RMSNorm
from attnlab.rope import RopeConfig, RotaryEmbedding

__all__ = [
    "HeadUpProjection",
    "LatentAttention",
    "LatentKVCache",
    "LatentProjections",
    "LowRankProjection",
    "MLAConfig",
]


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive int, got {value!r}")


@dataclass(frozen=True)
class MLAConfig:
    """The sizes of multi-head latent attention (DeepSeek's ``config.json`` names).

    Attributes:
        kv_lora_rank: r, the width of the cached latent.
        qk_nope_head_dim: Dn, the query/key dims without position (from the latent).
        qk_rope_head_dim: Dr, the rotary dims (the key's shared by all heads).
        v_head_dim: Dv, each head's value width.
        q_lora_rank: the rank of the query's low-rank pair, or None (one projection).
        latent_eps: epsilon of the latent norms (transformers' and DeepSeek's code: 1e-6;
            llama.cpp: the model's RMSNorm epsilon).

    Raises:
        ValueError: a size that is not a positive int, a bad epsilon, an odd ``qk_rope_head_dim``.
    """

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    latent_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            _positive_int(name, getattr(self, name))
        if self.q_lora_rank is not None:
            _positive_int("q_lora_rank", self.q_lora_rank)
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                f"`qk_rope_head_dim` must be even (RoPE rotates pairs), got {self.qk_rope_head_dim}"
            )
        eps = self.latent_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
            raise ValueError(f"`latent_eps` must be a number in (0, 1), got {eps!r}")

    @property
    def qk_head_dim(self) -> int:
        """D = Dn + Dr, the query/key head dim of the expanded form."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """What one token caches per layer: r + Dr numbers."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def cache_bytes_per_token(self, num_layers: int, element_size: int) -> int:
        """Bytes the latent cache holds per token: ``(r + Dr) * layers * element_size``."""
        return self.latent_dim * num_layers * element_size

    def mha_bytes_per_token(self, num_heads: int, num_layers: int, element_size: int) -> int:
        """Bytes a plain multi-head cache of the same heads would hold per token:
        keys ``H * D`` and values ``H * Dv`` per layer."""
        return num_heads * (self.qk_head_dim + self.v_head_dim) * num_layers * element_size


class LatentKVCache(KVCache):
    """The cache of one MLA layer: per token the latent and the rotated shared key,
    ``[c, k_rope]`` ``(B, 1, S, r + Dr)``, in one buffer (the values are its first r dims).

    Growing (doubling) like :class:`attnlab.attention.KVCache`, or allocated once for
    ``max_len`` positions (then it never grows, and :meth:`reset` keeps the buffer).

    Args:
        max_len: positions to allocate once, or None to grow.

    Raises:
        ValueError: ``max_len`` not a positive int.
    """

    def __init__(self, max_len: int | None = None) -> None:
        super().__init__()
        if max_len is not None:
            _positive_int("max_len", max_len)
        self.max_len = max_len

    def reset(self) -> None:
        """Forget everything cached (a fixed-size cache keeps its buffer)."""
        if self.max_len is None:
            super().reset()
        self._len = 0

    def update(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Not for this cache: it holds latents (:meth:`update_latent`).

        Raises:
            TypeError: always.
        """
        raise TypeError(
            "a LatentKVCache holds MLA latents, not per-head keys and values; it belongs "
            "to a LatentAttention layer (use layer.new_kv_cache())"
        )

    def update_latent(self, entry: torch.Tensor) -> torch.Tensor:
        """Append ``entry`` ``(B, 1, T, r + Dr)``; return every cached entry ``(B, 1, S, r + Dr)``.

        Raises:
            ValueError: a shape or dtype that does not match the cache, or more than
                ``max_len`` positions.
        """
        if entry.ndim != 4 or entry.shape[1] != 1:
            raise ValueError(f"`entry` must be (B, 1, T, r + Dr), got {tuple(entry.shape)}")
        buf, n = self._k, entry.shape[2]
        if buf is not None and (buf.shape[0], buf.shape[3]) != (entry.shape[0], entry.shape[3]):
            raise ValueError(
                f"`entry` does not match the cache: (B, r + Dr) = {(buf.shape[0], buf.shape[3])}, "
                f"got {(entry.shape[0], entry.shape[3])}; call reset() and start again"
            )
        if entry.requires_grad:  # keep the autograd graph: concatenate
            if self.max_len is not None:
                raise ValueError(
                    "a fixed-size LatentKVCache is for inference; run under torch.no_grad()"
                )
            all_ = entry if buf is None else torch.cat([buf[:, :, : self._len], entry], dim=2)
            self._k, self._len = all_, all_.shape[2]
            return all_
        need = self._len + n
        if self.max_len is not None and need > self.max_len:
            raise ValueError(
                f"the LatentKVCache holds {self.max_len} positions, {need} needed; create it "
                "with a larger max_len"
            )
        if buf is None or need > buf.shape[2]:
            cap = self.max_len or max(16, need, 2 * (0 if buf is None else buf.shape[2]))
            grown = entry.new_empty(entry.shape[0], 1, cap, entry.shape[3])  # (B, 1, cap, r+Dr)
            if buf is not None:
                grown[:, :, : self._len] = buf[:, :, : self._len]
            buf = self._k = grown
        buf[:, :, self._len : need] = entry.to(buf.dtype)
        self._len = need
        return buf[:, :, :need]


Path = Literal["expanded", "absorbed"]


class HeadUpProjection(nn.Module):
    """Every head's up-projection from the latent, ``weight`` ``(H * out, r)`` (an
    ``nn.Linear``'s layout). Not an ``nn.Linear``: both forms multiply it per head in
    einsums (the absorbed one into the query), so weight quantisation leaves it in float.

    Args:
        heads: H.
        out_features: each head's width (Dn or Dv).
        rank: r.
    """

    def __init__(self, heads: int, out_features: int, rank: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(heads * out_features, rank))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # nn.Linear's

    def extra_repr(self) -> str:
        return f"in_features={self.weight.shape[1]}, out_features={self.weight.shape[0]}"


class LowRankProjection(nn.Module):
    """``up(RMSNorm(down(x)))``: DeepSeek's low-rank query projection (``q_lora_rank``).

    Args:
        dim: input width C.
        rank: the rank in between.
        out_features: output width.
        eps: the norm's epsilon.
        bias: a bias on ``down``.
    """

    def __init__(self, dim: int, rank: int, out_features: int, eps: float, *, bias: bool) -> None:
        super().__init__()
        self.down = nn.Linear(dim, rank, bias=bias)
        self.norm = RMSNorm(rank, eps)
        self.up = nn.Linear(rank, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., C) -> (..., out_features)."""
        return self.steps(x)[2]

    def steps(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``down(x)``, its norm, and ``up`` of that: the output with what leads to it.

        Shape:
            - x: ``(..., C)``; out: ``(..., rank)``, ``(..., rank)``, ``(..., out_features)``.
        """
        down = self.down(x)
        normed = self.norm(down)
        return down, normed, self.up(normed)


@dataclass(frozen=True)
class LatentProjections:
    """What an MLA layer computes from its input before any position enters
    (:meth:`LatentAttention.project`); the forward pass and the explainer's step walk
    both start from it.

    Attributes:
        queries: every head's query ``(B, H, T, D)``, before RoPE: ``[q_nope, q_rope]``.
        query_down: ``x W_dq`` ``(B, T, q_lora_rank)`` before its norm, or None (the
            layer has one query projection).
        query_latent: ``RMSNorm(query_down)`` ``(B, T, q_lora_rank)``, or None.
        latent_raw: the first r dims of ``x W_dkv`` ``(B, T, r)``, before the norm.
        latent: ``RMSNorm(latent_raw)`` ``(B, T, r)``: the latent the cache holds.
        k_rope: the shared rotary key ``(B, T, Dr)``, before RoPE.
        nope_dim: Dn, where a query splits into its nope and rotary parts.
    """

    queries: torch.Tensor
    query_down: torch.Tensor | None
    query_latent: torch.Tensor | None
    latent_raw: torch.Tensor
    latent: torch.Tensor
    k_rope: torch.Tensor
    nope_dim: int

    @property
    def q_nope(self) -> torch.Tensor:
        """The queries' nope dims ``(B, H, T, Dn)`` (a view)."""
        return self.queries[..., : self.nope_dim]

    @property
    def q_rope(self) -> torch.Tensor:
        """The queries' rotary dims ``(B, H, T, Dr)``, before RoPE (a view)."""
        return self.queries[..., self.nope_dim :]


class LatentAttention(Attention):
    """Multi-head latent attention (see the module docstring), a drop-in for
    :class:`attnlab.attention.Attention` in a decoder block.

    It is an :class:`~attnlab.attention.Attention` to everything that reads layers: its
    per-head queries ``(B, H, T, D)``, keys ``(B, H, S, D)`` and values ``(B, H, S, Dv)``
    (the expanded form) are what ``need_weights``, :attr:`capture`, recorders and head
    editors see. Its cache is a :class:`LatentKVCache`.

    Args:
        embed_dim: width C.
        num_heads: H.
        mla: the sizes.
        rope: the rotary embedding of the ``qk_rope_head_dim`` dims (a
            :class:`~attnlab.rope.RotaryEmbedding` of that head dim or a
            :class:`~attnlab.rope.RopeConfig`).
        backend: the attention backend.
        scale: the score scale; default ``1/sqrt(Dn + Dr)``.
        bias: biases on the down-projections and the output (DeepSeek's ``attention_bias``).
        dropout: dropout on the weights, in training mode.

    Attributes:
        absorbed: which form to compute: None (default) the absorbed form for one new token
            and the expanded one for several; True or False to force one. Whatever it says,
            a call that must show per-head weights (``need_weights``, :attr:`capture`, a
            recorder, a head editor) runs expanded.
        last_path: ``"expanded"`` or ``"absorbed"``: what the last forward ran.

    Raises:
        ValueError: bad sizes, an unknown backend, a rotary embedding of another head dim.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        mla: MLAConfig,
        *,
        rope: RotaryEmbedding | RopeConfig,
        backend: str = "auto",
        scale: float | None = None,
        bias: bool = False,
        dropout: float = 0.0,
    ) -> None:
        # Not Attention.__init__: the projections differ; the attributes its helpers and
        # the code that reads layers use are set here.
        nn.Module.__init__(self)
        _positive_int("embed_dim", embed_dim)
        _positive_int("num_heads", num_heads)
        if not isinstance(mla, MLAConfig):
            raise TypeError(f"`mla` must be an MLAConfig, got {type(mla).__name__}")
        if backend not in available_backends():
            raise ValueError(f"`backend` must be one of {available_backends()}, got {backend!r}")
        if scale is not None and (
            isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < 1e300
        ):
            raise ValueError(f"`scale` must be a positive finite number or None, got {scale!r}")
        if not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"`dropout` must be in [0, 1), got {dropout!r}")
        C, H, Dn, Dr, Dv, r = (
            embed_dim,
            num_heads,
            mla.qk_nope_head_dim,
            mla.qk_rope_head_dim,
            mla.v_head_dim,
            mla.kv_lora_rank,
        )
        self.mla = mla
        self.embed_dim = self.kdim = self.vdim = C
        self.num_heads = self.num_kv_heads = H  # expanded: every head its own key and value
        self.head_dim = Dn + Dr
        self.v_head_dim = Dv
        self.dropout = float(dropout)
        self.backend = backend
        self.scale = None if scale is None else float(scale)
        self.sliding_window = self.attention_chunk = None
        self.temperature = None
        self.qk_norm = None
        self.q_norm = self.k_norm = None
        self.softcap = None
        self.sinks = None
        self.capture: bool | WeightsRequest | None = None
        self.captured: torch.Tensor | None = None
        self.absorbed: bool | None = None
        self.last_path: Path | None = None
        # the queries: one projection, or the low-rank pair with its norm between
        query: nn.Module = (
            nn.Linear(C, H * (Dn + Dr), bias=False)
            if mla.q_lora_rank is None
            else LowRankProjection(C, mla.q_lora_rank, H * (Dn + Dr), mla.latent_eps, bias=bias)
        )
        self.W_query = query  # type: ignore[assignment]
        self.kv_down = nn.Linear(C, r + Dr, bias=bias)  # the latent and the shared rotary key
        self.kv_norm = RMSNorm(r, mla.latent_eps)
        self.k_up = HeadUpProjection(H, Dn, r)  # W_uk: the heads' nope keys
        self.v_up = HeadUpProjection(H, Dv, r)  # W_uv: the heads' values
        self.out_proj = nn.Linear(H * Dv, C, bias=bias)
        if isinstance(rope, RopeConfig):
            rope = RotaryEmbedding.from_config(Dr, rope)
        if not isinstance(rope, RotaryEmbedding):
            raise TypeError(
                f"`rope` must be a RotaryEmbedding or a RopeConfig, got {type(rope).__name__}"
            )
        if rope.head_dim != Dr:
            raise ValueError(
                f"`rope` has head_dim={rope.head_dim}, but this layer rotates "
                f"qk_rope_head_dim={Dr} dims"
            )
        self.rope = rope

    def new_kv_cache(self, max_len: int | None = None) -> LatentKVCache:  # type: ignore[override]
        """An empty :class:`LatentKVCache` (growing, or of ``max_len`` positions)."""
        return LatentKVCache(max_len)

    def _up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_uk`` ``(H, Dn, r)`` and ``W_uv`` ``(H, Dv, r)``: views of ``k_up``, ``v_up``."""
        H, r = self.num_heads, self.mla.kv_lora_rank
        return self.k_up.weight.view(H, -1, r), self.v_up.weight.view(H, -1, r)

    def forward(  # type: ignore[override]
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
        """Self-attention of ``x`` through the latent (the arguments are
        :meth:`attnlab.attention.Attention.forward`'s).

        Shape:
            - x: ``(B, T, C)``; output: ``(B, T, C)``; weights ``(B, H, T, S)``.

        Raises:
            ValueError: a ``context`` (MLA is self-attention), a cache that is not a
                :class:`LatentKVCache`, wrong shapes.
        """
        if context is not None:
            raise ValueError("`context`: latent attention is self-attention only")
        if not isinstance(x, torch.Tensor) or x.ndim != 3 or x.shape[-1] != self.embed_dim:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"`x` must be (B, T, C={self.embed_dim}), got {got}")
        if kv_cache is not None and not isinstance(kv_cache, LatentKVCache):
            raise ValueError(
                f"`kv_cache` must be a LatentKVCache (layer.new_kv_cache()), got "
                f"{type(kv_cache).__name__}"
            )
        B, T, _ = x.shape
        Dn = self.mla.qk_nope_head_dim
        p = self.project(x)
        pos = self._positions(position_ids, B, T, kv_cache, x.device)
        queries, entry = self.rotate(p, pos)  # (B, H, T, D), (B, 1, T, r+Dr)
        cached = kv_cache.update_latent(entry) if kv_cache is not None else entry  # (B,1,S,r+Dr)
        S = cached.shape[2]
        mask = self._mask(attn_mask, is_causal, S)
        scale = self.scale if self.scale is not None else self.head_dim**-0.5
        shown = bool(
            need_weights or self.capture or _RECORDER.get() is not None or _EDITOR.get() is not None
        )
        absorbed = (T == 1 if self.absorbed is None else self.absorbed) and not shown
        self.last_path = "absorbed" if absorbed else "expanded"
        if absorbed:
            return self._absorbed(p.q_nope, queries[..., Dn:], cached, mask, scale)
        keys, values = self.expand(cached)  # (B, H, S, D), (B, H, S, Dv)
        new_keys = keys[:, :, S - T :]
        return self._attend_heads(
            x, p.queries, new_keys, queries, keys, values, mask, scale, need_weights
        )

    def project(self, x: torch.Tensor) -> LatentProjections:
        """The layer's projections of ``x``: queries (through the low-rank pair when the
        layer has one), the normalised latent and the shared rotary key, none rotated yet.

        Shape:
            - x: ``(B, T, C)``; see :class:`LatentProjections` for the rest.
        """
        B, T, _ = x.shape
        H, Dn, Dr = self.num_heads, self.mla.qk_nope_head_dim, self.mla.qk_rope_head_dim
        r = self.mla.kv_lora_rank
        query_down = query_latent = None
        if isinstance(self.W_query, LowRankProjection):
            query_down, query_latent, q = self.W_query.steps(x)  # (B, T, H*D)
        else:
            q = self.W_query(x)  # (B, T, H*D)
        q = q.view(B, T, H, Dn + Dr).transpose(1, 2)  # (B, H, T, D)
        latent_raw, k_rope = self.kv_down(x).split([r, Dr], dim=-1)  # (B, T, r), (B, T, Dr)
        return LatentProjections(
            queries=q,
            query_down=query_down,
            query_latent=query_latent,
            latent_raw=latent_raw,
            latent=self.kv_norm(latent_raw),
            k_rope=k_rope,
            nope_dim=Dn,
        )

    def rotate(
        self, projections: LatentProjections, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE on the queries' rotary dims and the shared key at ``positions``.

        Returns:
            The queries the attention uses ``(B, H, T, D)`` (nope dims unchanged) and the
            cache entry ``[latent, rotated k_rope]`` ``(B, 1, T, r + Dr)``.
        """
        p, rope = projections, self.rope
        assert rope is not None  # set in __init__
        q_rope = rope(p.q_rope, positions)  # (B, H, T, Dr)
        k_rope = rope(p.k_rope[:, None], positions)  # (B, 1, T, Dr)
        queries = torch.cat([p.q_nope, q_rope], dim=-1)  # (B, H, T, D)
        return queries, torch.cat([p.latent[:, None], k_rope], dim=-1)  # (B, 1, T, r+Dr)

    def expand(self, cached: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every head's keys and values from cache entries (the expanded form): key
        ``[latent W_uk_hᵀ, k_rope]``, value ``latent W_uv_hᵀ``.

        Shape:
            - cached: ``(B, 1, S, r + Dr)``; keys ``(B, H, S, D)``; values ``(B, H, S, Dv)``.
        """
        B, _, S, _ = cached.shape
        H, r = self.num_heads, self.mla.kv_lora_rank
        w_uk, w_uv = self._up_weights()
        k_nope = torch.einsum("bsr,hdr->bhsd", cached[:, 0, :, :r], w_uk)  # (B, H, S, Dn)
        values = torch.einsum("bsr,hvr->bhsv", cached[:, 0, :, :r], w_uv)  # (B, H, S, Dv)
        shared = cached[:, :, :, r:].expand(B, H, S, cached.shape[-1] - r)  # (B, H, S, Dr)
        return torch.cat([k_nope, shared], dim=-1), values  # (B, H, S, D), (B, H, S, Dv)

    def _absorbed(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        cached: torch.Tensor,
        mask: AttentionMask | None,
        scale: float,
    ) -> torch.Tensor:
        """The absorbed form: multi-query attention over ``[c, k_rope]`` with values ``c``."""
        B, H, T, _ = q_nope.shape
        r = self.mla.kv_lora_rank
        w_uk, w_uv = self._up_weights()
        q_latent = torch.einsum("bhtd,hdr->bhtr", q_nope, w_uk)  # (B, H, T, r)
        query = torch.cat([q_latent, q_rope], dim=-1)  # (B, H, T, r+Dr)
        values = cached[..., :r]  # (B, 1, S, r): a view, the latent itself
        dropout_p = self.dropout if self.training else 0.0
        if mask is None:
            # the heads share one key set: fold them into the query axis, (B, 1, H*T, r+Dr)
            folded = query.reshape(B, 1, H * T, query.shape[-1])
            out = scaled_dot_product_attention(
                folded, cached, values, None, dropout_p, scale=scale, backend=self.backend
            )
            out = out.view(B, H, T, r)  # type: ignore[union-attr]
        else:
            out = scaled_dot_product_attention(  # type: ignore[assignment]
                query, cached, values, mask, dropout_p, scale=scale, backend=self.backend
            )  # (B, H, T, r)
        context = torch.einsum("bhtr,hvr->bthv", out, w_uv).reshape(B, T, -1)  # (B, T, H*Dv)
        return self.out_proj(context)  # (B, T, C)

    def extra_repr(self) -> str:
        m = self.mla
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"kv_lora_rank={m.kv_lora_rank}, q_lora_rank={m.q_lora_rank}, "
            f"qk_nope_head_dim={m.qk_nope_head_dim}, qk_rope_head_dim={m.qk_rope_head_dim}, "
            f"v_head_dim={m.v_head_dim}, backend={self.backend!r}"
            + (f", scale={self.scale}" if self.scale is not None else "")
        )
