"""The production attention layer: multi-head, grouped-query, multi-query and cross
attention, rotary position embedding, a KV cache, and a choice of backend.

Shape legend: B batch, H query heads, G key/value heads, T query length, S key length
(cached + new), D head dim, C = H*D model width (``embed_dim``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from attnlab.backends import WeightsRequest, available_backends
from attnlab.backends.request import check_sinks, check_softcap
from attnlab.functional import (
    default_scale,
    exact_attention_weights,
    scaled_dot_product_attention,
)
from attnlab.masks import AttentionMask, ChunkedMask, SlidingWindowMask, as_mask
from attnlab.norms import QKNorm, norm_heads
from attnlab.rope import RopeConfig, RotaryEmbedding, rotate_half

__all__ = [
    "Attention",
    "AttentionCall",
    "AttentionRecorder",
    "HeadEditor",
    "KVCache",
    "QKNorm",
    "RollingKVCache",
    "RopeConfig",
    "RotaryEmbedding",
    "StaticKVCache",
    "StaticWindowKVCache",
    "edit_heads",
    "record_attention",
    "recording_attention",
    "rotate_half",
]


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
        """Number of positions seen so far (the position of the next token)."""
        return self._len

    @property
    def cached_len(self) -> int:
        """Number of positions held (here: all of them)."""
        return self._len

    @property
    def nbytes(self) -> int:
        """Bytes held by the key and value buffers."""
        return sum(t.numel() * t.element_size() for t in (self._k, self._v) if t is not None)

    def reset(self) -> None:
        """Forget everything cached."""
        self._k = self._v = None
        self._len = 0

    def _check(self, key: torch.Tensor, value: torch.Tensor) -> None:
        if key.ndim != 4 or value.ndim != 4 or key.shape[:3] != value.shape[:3]:
            raise ValueError(
                "`key` and `value` must be (B, G, T, D) and (B, G, T, Dv) with matching "
                f"B, G, T, got {tuple(key.shape)} and {tuple(value.shape)}"
            )
        if self._k is not None and self._v is not None:
            expect = (self._k.shape[0], self._k.shape[1], self._k.shape[3], self._v.shape[3])
            got = (key.shape[0], key.shape[1], key.shape[3], value.shape[3])
            if expect != got:
                raise ValueError(
                    f"`key`/`value` do not match the cache: (B, G, D, Dv) = {expect}, got "
                    f"{got}; call reset() to start a new sequence"
                )

    def update(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new keys and values; return all cached keys and values.

        Raises:
            ValueError: shapes that do not match each other or the cache.
        """
        self._check(key, value)
        n = key.shape[2]
        if self._k is None or self._v is None:
            cap = max(16, n)
            self._k = key.new_empty(key.shape[0], key.shape[1], cap, key.shape[3])
            self._v = value.new_empty(value.shape[0], value.shape[1], cap, value.shape[3])
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

    def cached(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All cached keys ``(B, G, S, D)`` and values ``(B, G, S, Dv)``, without adding any.

        Raises:
            ValueError: the cache is empty.
        """
        if self._k is None or self._v is None:
            raise ValueError("the cache is empty; update() it first")
        return self._k[:, :, : self._len], self._v[:, :, : self._len]


def check_cache_dtype(dtype: object) -> torch.dtype | None:
    """A cache's storage dtype as asked for: None (the keys' own) or a floating dtype.

    Raises:
        ValueError: anything else, named.
    """
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        return dtype
    raise ValueError(
        f"a cache's `dtype` must be None (the keys' own) or a floating torch.dtype such as "
        f"torch.float16, got {dtype!r}"
    )


class StaticKVCache(KVCache):
    """A :class:`KVCache` whose buffers are allocated once, for ``max_len`` positions.

    The buffers are created at the first :meth:`update` (when B, G, D and the dtype are
    known) and kept by :meth:`reset`, so a long generation, or one that rebuilds its cache
    as the window slides, keeps its memory flat. Filling it past ``max_len`` is an error
    (it does not grow). Inference only: keys that require grad are refused.

    With ``dtype`` (e.g. ``torch.float16``, what llama.cpp's cache holds) the buffers hold
    the keys and values in that dtype, each rounded once as it is written: half the
    memory of float32 and half the bytes a decode step at depth reads. What the cache
    returns is then in the keys' own dtype again (copies, where the buffers are views),
    so the attention after it runs as before on the values held; the compiled decode step
    reads a float16 cache as it is.

    Args:
        max_len: positions the cache holds.
        dtype: the buffers' dtype; None (the default) for the keys' own.

    Raises:
        ValueError: ``max_len`` not a positive int, ``dtype`` not a floating dtype.

    Shape:
        - update(key ``(B, G, T, D)``, value ``(B, G, T, Dv)``) returns all keys
          ``(B, G, S, D)`` and values ``(B, G, S, Dv)`` so far, S = seq_len <= max_len
          (views of the buffers when they hold the keys' dtype).
    """

    def __init__(self, max_len: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
            raise ValueError(f"`max_len` must be a positive int, got {max_len!r}")
        self.max_len = max_len
        self.dtype = check_cache_dtype(dtype)
        self._key_dtype: torch.dtype | None = None  # the keys' dtype, from the first update

    def _put(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst`` (part of a buffer) = ``src``, each value rounded to the buffers' dtype.

        Raises:
            ValueError: a finite value the buffers' dtype holds only as infinity (a key or
                value beyond float16's 65504): refused, not kept as inf.
        """
        dst.copy_(src)
        if dst.dtype == src.dtype:
            return
        # A finite float32 sum of the held values: none is inf (one op, where the exact
        # test below is four: a decode step's Python loops write every layer's row).
        if math.isfinite(dst.sum(dtype=torch.float32).item()):
            return
        if bool((dst.isinf() & src.isfinite()).any()):
            big = src[dst.isinf() & src.isfinite()].abs().max().item()
            raise ValueError(
                f"a key or value of {big:.4g} is beyond what this cache's {dst.dtype} holds; "
                "create the cache without `dtype` (model.kv_cache_dtype = None)"
            )

    def _returned_dtype(self, held: torch.dtype) -> torch.dtype:
        """The dtype a buffer holding ``held`` is returned in: ``held`` itself without
        ``dtype`` (the buffers hold what was given), else the keys' dtype."""
        kd = self._key_dtype
        return held if self.dtype is None or kd is None else kd

    def _as_keys(self, t: torch.Tensor) -> torch.Tensor:
        """Held keys or values as the cache returns them (:meth:`_returned_dtype`)."""
        want = self._returned_dtype(t.dtype)
        return t if t.dtype == want else t.to(want)

    def _value_dtype(self, value: torch.Tensor) -> torch.dtype:
        """What the value buffer holds: ``dtype``, else the first values' own (as before
        there was a ``dtype``)."""
        return self.dtype or value.dtype

    def cached(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All cached keys ``(B, G, S, D)`` and values ``(B, G, S, Dv)`` in the keys' dtype,
        without adding any.

        Raises:
            ValueError: the cache is empty.
        """
        k, v = super().cached()
        return self._as_keys(k), self._as_keys(v)

    def reset(self) -> None:
        """Forget everything cached; keep the buffers."""
        self._len = 0

    def update(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new keys and values after the cached ones; return all of them (views).

        Raises:
            ValueError: shapes that do not match each other or the buffers, or more than
                ``max_len`` positions in all.
        """
        if key.requires_grad or value.requires_grad:
            raise ValueError(
                "StaticKVCache is for inference: `key`/`value` require grad; use KVCache "
                "or run under torch.no_grad()"
            )
        if key.ndim != 4 or value.ndim != 4 or key.shape[:3] != value.shape[:3]:
            raise ValueError(
                "`key` and `value` must be (B, G, T, D) and (B, G, T, Dv) with matching "
                f"B, G, T, got {tuple(key.shape)} and {tuple(value.shape)}"
            )
        B, G, n, D = key.shape
        k, v = self._k, self._v
        if k is None or v is None:
            held = self.dtype or key.dtype
            k = self._k = key.new_empty(B, G, self.max_len, D, dtype=held)
            v = self._v = value.new_empty(
                B, G, self.max_len, value.shape[3], dtype=self._value_dtype(value)
            )
            self._key_dtype = key.dtype
        elif (B, G, D, value.shape[3], key.dtype) != (
            *k.shape[:2],
            k.shape[3],
            v.shape[3],
            self._key_dtype,
        ):
            raise ValueError(
                f"`key`/`value` do not match the cache: (B, G, D, Dv, dtype) = "
                f"{(*k.shape[:2], k.shape[3], v.shape[3], self._key_dtype)}, got "
                f"{(B, G, D, value.shape[3], key.dtype)}; create a new cache"
            )
        need = self._len + n
        if need > self.max_len:
            raise ValueError(
                f"StaticKVCache holds {self.max_len} positions, {need} needed; create it "
                f"with a larger max_len (model.new_kv_cache(max_len=...))"
            )
        self._put(k[:, :, self._len : need], key)
        self._put(v[:, :, self._len : need], value)
        self._len = need
        return self._as_keys(k[:, :, :need]), self._as_keys(v[:, :, :need])

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`update` with one position, ``key`` (B, G, D) and ``value`` (B, G, Dv);
        ``value`` is converted to the keys' dtype (``key``'s for a new cache).

        The fast decode step's: once the buffers exist, two copies and two views, where
        :meth:`update` spends a dozen tensor operations on one position. Anything else
        (no buffers yet, a full cache, shapes or a key dtype that do not match) is
        :meth:`update`'s, with its errors.
        """
        k, v, n = self._k, self._v, self._len
        if (
            k is None
            or v is None
            or n >= self.max_len
            or key.dtype != self._key_dtype
            or key.shape != (k.shape[0], k.shape[1], k.shape[3])
            or value.shape != (v.shape[0], v.shape[1], v.shape[3])
        ):
            value = value.to(key.dtype if v is None else self._returned_dtype(v.dtype))
            return self.update(key.unsqueeze(2), value.unsqueeze(2))
        self._put(k.select(2, n), key)
        self._put(v.select(2, n), value)
        self._len = n + 1
        return self._as_keys(k.narrow(2, 0, n + 1)), self._as_keys(v.narrow(2, 0, n + 1))

    def next_slot(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The buffers, (B, G, max_len, D) keys and (B, G, max_len, Dv) values, when a
        writer that fills position :attr:`seq_len` itself (the native decode step) may
        take them: they exist and have room for one more. Call :meth:`advance` after
        writing. None otherwise (then :meth:`append` creates or refuses)."""
        if self._k is None or self._v is None or self._len >= self.max_len:
            return None
        return self._k, self._v

    def advance(self) -> None:
        """Count the position written into :meth:`next_slot`'s buffers."""
        if self._k is None or self._len >= self.max_len:
            raise ValueError("advance() without a free slot: call next_slot() first")
        self._len += 1


class _WindowCache(KVCache):
    """What a sliding-window layer's cache adds to its buffers: the ``window``, and
    :attr:`seq_len` counting every position seen, which outgrows what the buffers hold
    (:class:`StaticWindowKVCache`, :class:`RollingKVCache`)."""

    window: int
    _seen: int

    def _start_window(self, window: int) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"`window` must be an int >= 1, got {window!r}")
        self.window = window
        self._seen = 0

    @property
    def seq_len(self) -> int:
        """Number of positions seen so far (the position of the next token)."""
        return self._seen

    def reset(self) -> None:
        """Forget everything cached (a static cache keeps its buffers)."""
        super().reset()
        self._seen = 0


class StaticWindowKVCache(_WindowCache, StaticKVCache):
    """A :class:`StaticKVCache` for a sliding-window layer: ``window`` slots allocated once
    and reused in turn, position ``p`` in slot ``p % window``.

    A query sees ``window`` keys, itself included, so the slots hold all that a later one
    may use: the layer's memory stays at ``window`` positions however long the sequence
    (Gemma 3 270M at a depth of 4,096 tokens: 39 MiB for its 18 layers' caches, where
    every position in every layer took 145 MiB). Keys are stored after RoPE, so their
    positions travel with them and the order of the slots does not matter to a one-token
    step: :meth:`append` and the native step attend over every filled slot. :meth:`update` (a
    prompt, or any call through the modules) returns the held keys in position order, the
    last ``window - 1``, followed by the new ones, as :class:`RollingKVCache` does, for a
    bottom-right aligned sliding-window mask. :attr:`seq_len` counts every position seen.
    ``model.new_kv_cache(max_len=N)`` gives one to each layer whose window is under ``N``.

    Args:
        window: the layer's sliding window (keys a query sees, itself included), >= 1.
        dtype: the buffers' dtype; None for the keys' own (as :class:`StaticKVCache`).

    Raises:
        ValueError: ``window`` not a positive int.
    """

    def __init__(self, window: int, dtype: torch.dtype | None = None) -> None:
        self._start_window(window)
        super().__init__(window, dtype)  # StaticKVCache's: buffers of `window` slots

    def _in_order(self, keep: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The last ``keep`` (<= :attr:`cached_len`) positions held, oldest first."""
        k, v = self._k, self._v
        assert k is not None and v is not None
        W, end = self.window, self._seen % self.window  # end: the slot after the newest
        if self._seen <= W:  # never wrapped: slot = position
            return k[:, :, self._seen - keep : self._seen], v[:, :, self._seen - keep : self._seen]
        start = (end - keep) % W
        if start < end:
            return k[:, :, start:end], v[:, :, start:end]
        order = torch.cat([torch.arange(start, W), torch.arange(0, end)]).to(k.device)
        return k.index_select(2, order), v.index_select(2, order)

    def cached(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The held keys ``(B, G, S, D)`` and values ``(B, G, S, Dv)`` in position order, S =
        :attr:`cached_len` <= ``window``.

        Raises:
            ValueError: the cache is empty.
        """
        if self._k is None or self._v is None:
            raise ValueError("the cache is empty; update() it first")
        k, v = self._in_order(self._len)
        return self._as_keys(k), self._as_keys(v)

    def update(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the last ``window - 1`` held keys/values in position order followed by the
        new ones (``S <= window - 1 + T``); keep the last ``window`` positions.

        Raises:
            ValueError: shapes that do not match each other or the buffers, or keys that
                require grad.
        """
        if key.requires_grad or value.requires_grad:
            raise ValueError(
                "StaticWindowKVCache is for inference: `key`/`value` require grad; use "
                "RollingKVCache or run under torch.no_grad()"
            )
        self._check(key, value)
        B, G, n, D = key.shape
        if self._k is not None and key.dtype != self._key_dtype:
            raise ValueError(
                f"`key` is {key.dtype} but the cache holds {self._key_dtype} keys; create a "
                "new cache"
            )
        held = min(self._len, self.window - 1)
        if held:
            hk, hv = self._in_order(held)
            k_all = torch.cat([self._as_keys(hk), key], dim=2)  # (B, G, held + n, D)
            hv = self._as_keys(hv)
            v_all = torch.cat([hv, value.to(hv.dtype)], dim=2)
        else:
            k_all, v_all = key, value
        if self._k is None or self._v is None:
            held_dtype = self.dtype or key.dtype
            self._k = key.new_empty(B, G, self.window, D, dtype=held_dtype)
            self._v = value.new_empty(
                B, G, self.window, value.shape[3], dtype=self._value_dtype(value)
            )
            self._key_dtype = key.dtype
        # The last min(n, window) new positions into their slots (at most two runs).
        m = min(n, self.window)
        first = self._seen + n - m
        src_k, src_v = key[:, :, n - m :], value[:, :, n - m :]
        slot, done = first % self.window, 0
        while done < m:
            run = min(m - done, self.window - slot)
            self._put(self._k[:, :, slot : slot + run], src_k[:, :, done : done + run])
            self._put(self._v[:, :, slot : slot + run], src_v[:, :, done : done + run])
            done, slot = done + run, 0
        self._seen += n
        self._len = min(self._seen, self.window)
        if self._k.dtype != key.dtype:  # the new positions as the slots hold them, as
            # StaticKVCache and the one-token steps give them (the held ones already are)
            k_all = k_all.to(self._k.dtype).to(key.dtype)
            v_all = v_all.to(self._k.dtype).to(key.dtype)
        return k_all, v_all

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One position, ``key`` (B, G, D) and ``value`` (B, G, Dv), written into its slot;
        returns every filled slot, ``(B, G, S, D)`` and ``(B, G, S, Dv)`` with S =
        :attr:`cached_len` (after this one), in slot order: the newest position's keys and
        the ``S - 1`` before it, all that its query sees. Anything the buffers cannot take
        (none yet, shapes or a key dtype that do not match) is :meth:`update`'s."""
        k, v = self._k, self._v
        if (
            k is None
            or v is None
            or key.dtype != self._key_dtype
            or key.shape != (k.shape[0], k.shape[1], k.shape[3])
            or value.shape != (v.shape[0], v.shape[1], v.shape[3])
        ):
            value = value.to(key.dtype if v is None else self._returned_dtype(v.dtype))
            self.update(key.unsqueeze(2), value.unsqueeze(2))
            assert self._k is not None and self._v is not None
            k, v = self._k, self._v
        else:
            slot = self._seen % self.window
            self._put(k.select(2, slot), key)
            self._put(v.select(2, slot), value)
            self._seen += 1
            self._len = min(self._seen, self.window)
        return self._as_keys(k.narrow(2, 0, self._len)), self._as_keys(v.narrow(2, 0, self._len))

    def next_slot(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The buffers, (B, G, window, D) keys and (B, G, window, Dv) values, once they
        exist: the native step writes position :attr:`seq_len` into slot ``seq_len %
        window`` and attends over every filled slot. Call :meth:`advance` after writing."""
        if self._k is None or self._v is None:
            return None
        return self._k, self._v

    def advance(self) -> None:
        """Count the position written into :meth:`next_slot`'s buffers."""
        if self._k is None:
            raise ValueError("advance() without buffers: call next_slot() first")
        self._seen += 1
        self._len = min(self._seen, self.window)


class RollingKVCache(_WindowCache):
    """A KV cache for a sliding-window layer: it holds only the last ``window - 1``
    positions, all that a later query may still see besides itself.

    Memory stays below ``window`` positions however many tokens are generated. ``update``
    returns the held keys followed by the new ones (``S = cached_len + T``, contiguous
    positions ending at the newest token), so a bottom-right aligned
    :class:`attnlab.masks.SlidingWindowMask` over them is exactly the full pass's window,
    also for a chunk longer than the window; for one new token ``S <= window`` and the
    window masks nothing. Keys are stored after RoPE, so their positions travel with them.
    Use it with ``Attention(sliding_window=w)`` and a ``window >= w``
    (``Attention.new_kv_cache()`` builds the right one).

    Args:
        window: the layer's sliding window, >= 1.

    Raises:
        ValueError: ``window`` not a positive int.
    """

    def __init__(self, window: int) -> None:
        self._start_window(window)
        super().__init__()

    def update(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the held keys/values followed by the new ones; keep the last ``window - 1``.

        Shape:
            - key ``(B, G, T, D)``, value ``(B, G, T, Dv)``; returns ``(B, G, S, D)`` and
              ``(B, G, S, Dv)`` with ``S = cached_len + T`` (before this update).

        Raises:
            ValueError: shapes that do not match each other or the cache.
        """
        self._check(key, value)
        if self._k is None or self._v is None:
            k_all, v_all = key, value
        else:
            k_all = torch.cat([self._k, key.to(self._k.dtype)], dim=2)  # (B, G, S, D)
            v_all = torch.cat([self._v, value.to(self._v.dtype)], dim=2)  # (B, G, S, Dv)
        keep = min(self.window - 1, k_all.shape[2])
        first = k_all.shape[2] - keep
        k_keep, v_keep = k_all[:, :, first:], v_all[:, :, first:]
        if not (k_keep.requires_grad or v_keep.requires_grad):
            # A copy, so that the held tensors do not pin the (window + T) buffer.
            k_keep, v_keep = k_keep.clone(), v_keep.clone()
        self._k, self._v, self._len = k_keep, v_keep, keep
        self._seen += key.shape[2]
        return k_all, v_all


@dataclass(frozen=True)
class AttentionCall:
    """What one forward of one :class:`Attention` layer computed, given to a recorder.

    The tensors are the layer's own (not copies): keep what you need, detached.

    Attributes:
        layer: the layer that ran.
        x: its input ``(B, T, C)``.
        queries_projected: ``W_query(x)`` per head ``(B, H, T, D)``, before RoPE.
        keys_projected: the new keys per head ``(B, G, S_new, D)``, before RoPE.
        queries: the queries the attention used ``(B, H, T, D)`` (after RoPE).
        keys: the keys it used ``(B, G, S, D)`` (after RoPE, cached + new).
        values: the values it used ``(B, G, S, Dv)``.
        mask: the attention mask of the call (an ``AttentionMask``) or None.
        scale: the score scale the call used.
        weights: the weights the recorder asked for ``(B, h, t, S)``, or None.
        context: the heads' outputs side by side ``(B, T, H*Dv)``, before ``out_proj``.
        output: the layer's output ``(B, T, C)``.
    """

    layer: Attention
    x: torch.Tensor
    queries_projected: torch.Tensor
    keys_projected: torch.Tensor
    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    mask: AttentionMask | None
    scale: float
    weights: torch.Tensor | None
    context: torch.Tensor
    output: torch.Tensor


class AttentionRecorder(Protocol):
    """Receives the :class:`AttentionCall` of every layer that runs in :func:`record_attention`."""

    def request(self, layer: Attention) -> bool | WeightsRequest | None:
        """None: do not record this layer; False: record it without weights; True or a
        ``WeightsRequest``: record it with (those) exact weights."""

    def record(self, call: AttentionCall) -> None:
        """Called once per forward of a recorded layer, before it returns."""


_RECORDER: ContextVar[AttentionRecorder | None] = ContextVar("attnlab_recorder", default=None)


# Changes a layer's per-head outputs before its output projection: (layer, context
# (B, T, H*Dv)) -> a tensor of the same shape. Set per call by `edit_heads`.
HeadEditor = Callable[["Attention", torch.Tensor], torch.Tensor]
_EDITOR: ContextVar[HeadEditor | None] = ContextVar("attnlab_head_editor", default=None)


def recording_attention() -> bool:
    """True inside :func:`record_attention` or :func:`edit_heads` (fast paths that skip
    the layers step aside)."""
    return _RECORDER.get() is not None or _EDITOR.get() is not None


@contextmanager
def edit_heads(editor: HeadEditor) -> Iterator[None]:
    """Let ``editor`` change every :class:`Attention` layer's per-head outputs, in this call only.

    Inside the block each layer calls ``editor(layer, context)`` with its heads' outputs
    side by side, ``context`` ``(B, T, H*Dv)`` (head ``h`` is the slice
    ``[h*Dv, (h+1)*Dv)``), right before its output projection, and projects what the
    editor returns (same shape) instead. This is the one place an experiment switches
    heads off (:func:`attnlab.explain.ablate`); like :func:`record_attention` it travels
    with the call (a context variable), so other threads using the model see no edit.

    Args:
        editor: ``(layer, context) -> context``; return ``context`` itself to leave a
            layer as it is.
    """
    token = _EDITOR.set(editor)
    try:
        yield
    finally:
        _EDITOR.reset(token)


@contextmanager
def record_attention(recorder: AttentionRecorder) -> Iterator[None]:
    """Record every :class:`Attention` forward run inside the block, in this call only.

    The recorder travels with the call (a context variable), not in the layers: two
    threads recording on one shared model each see only their own forwards.

    Args:
        recorder: an :class:`AttentionRecorder`.
    """
    token = _RECORDER.set(recorder)
    try:
        yield
    finally:
        _RECORDER.reset(token)


class Attention(nn.Module):
    """Multi-head attention as real models use it.

    Grouped-query attention when ``num_kv_heads < num_heads`` (multi-query when 1), cross
    attention when ``forward`` gets a ``context`` (of width ``kdim``/``vdim``), rotary
    position embedding and its variants, QK normalisation, a score scale of the model's
    choosing, a per-layer sliding window, a KV cache (a rolling one for sliding-window
    layers), and any attnlab backend.

    The order inside a forward is the one of Qwen3, Gemma 3 and OLMo 2: project, QK-norm,
    RoPE, cache, attend (``scale``, mask, sliding window), output projection.

    Parameters are created in the order ``W_query``, ``W_key``, ``W_value``, ``out_proj``
    (the book's order, so seeded construction matches the book's classes).

    Args:
        embed_dim: model width C.
        num_heads: query heads H.
        num_kv_heads: key/value heads G (default H); must divide H.
        kdim: width of the key source (default ``embed_dim``).
        vdim: width of the value source (default ``kdim``).
        bias: bias in the Q/K/V projections (Qwen2: True, with ``out_bias=False``).
        out_bias: bias in the output projection.
        dropout: dropout on the attention weights, in training mode.
        rope: None, True (RoPE with base 10000), a float base, a
            :class:`attnlab.rope.RopeConfig` (partial, interleaved, scaled RoPE), or a
            :class:`RotaryEmbedding` of head dim ``head_dim`` (to share one between layers).
        backend: the attention backend (``"auto"``, ``"math"``, ``"blockwise"``, ``"sdpa"``).
        head_dim: D; default ``embed_dim // num_heads``. Set it when ``H * D != C``
            (Gemma, Qwen3): the query/output projections are then ``C -> H*D -> C``.
        scale: the score scale; default ``1/sqrt(D)`` (Gemma: ``query_pre_attn_scalar**-0.5``).
        qk_norm: a :class:`attnlab.norms.QKNorm`: RMSNorm or LayerNorm on queries and keys
            before RoPE, per head or across heads; its parameters are ``q_norm`` and
            ``k_norm``.
        sliding_window: each query sees only itself and the ``sliding_window - 1`` keys
            before it (Mistral, Gemma 2's local layers; with ``is_causal=False``, keys
            within that distance on both sides); combined with any ``attn_mask``.
        softcap: logit soft-capping ``softcap * tanh(s / softcap)`` of the scaled scores
            (Gemma 2 uses 50.0), or None.
        sinks: attention sinks (gpt-oss): True for a learned per-head logit
            :attr:`sinks` (an ``nn.Parameter`` ``(H,)``, initialised to 0), a tensor
            ``(H,)`` for its initial value, or None/False for none.
        attention_chunk: chunked local attention (Llama 4): a query sees only the keys of
            its own chunk of this many positions, causally (:class:`attnlab.masks.ChunkedMask`;
            the cache keeps every key); combined with any ``attn_mask``.
        temperature: ``(floor_scale, scale)``: the queries at position p are multiplied by
            ``1 + scale * log(1 + floor((p + 1) / floor_scale))`` (Llama 4's attention
            temperature tuning on its NoPE layers), or None.

    Attributes:
        capture: None by default. Set to True (all weights) or to a
            :class:`attnlab.backends.WeightsRequest` and every forward also stores the exact
            attention weights ``(B, h, t, S)`` in :attr:`captured` (via the same exact
            weights path as ``need_weights``).
        captured: the weights of the last forward when ``capture`` was set.

    Raises:
        ValueError: ``embed_dim`` not divisible by ``num_heads`` (without ``head_dim``),
            ``num_kv_heads`` not dividing ``num_heads``, bad dropout, unknown backend, a
            RotaryEmbedding of the wrong head dim, a non-positive ``head_dim``, ``scale``,
            ``sliding_window`` or ``attention_chunk``, both a window and chunks, a bad
            ``temperature``.
        TypeError: ``qk_norm`` not a QKNorm.
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
        rope: RotaryEmbedding | RopeConfig | bool | float | None = None,
        backend: str = "auto",
        head_dim: int | None = None,
        scale: float | None = None,
        qk_norm: QKNorm | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
        sinks: bool | torch.Tensor | None = None,
        attention_chunk: int | None = None,
        temperature: tuple[float, float] | None = None,
    ) -> None:
        super().__init__()
        for name, val in (
            ("embed_dim", embed_dim),
            ("num_heads", num_heads),
            ("head_dim", 1 if head_dim is None else head_dim),
            ("sliding_window", 1 if sliding_window is None else sliding_window),
            ("attention_chunk", 1 if attention_chunk is None else attention_chunk),
        ):
            if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
                raise ValueError(f"`{name}` must be a positive int, got {val!r}")
        if scale is not None and (
            isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < 1e300
        ):
            raise ValueError(f"`scale` must be a positive finite number or None, got {scale!r}")
        if temperature is not None and (
            not isinstance(temperature, tuple)
            or len(temperature) != 2
            or any(isinstance(t, bool) or not isinstance(t, (int, float)) for t in temperature)
            or not temperature[0] > 0
            or not math.isfinite(temperature[1])
        ):
            raise ValueError(
                "`temperature` must be None or (floor_scale > 0, scale), e.g. (8192.0, 0.1), "
                f"got {temperature!r}"
            )
        if attention_chunk is not None and sliding_window is not None:
            raise ValueError("`attention_chunk` and `sliding_window` cannot both be set")
        if qk_norm is not None and not isinstance(qk_norm, QKNorm):
            raise TypeError(
                f"`qk_norm` must be None or a QKNorm, e.g. QKNorm('rms', scope='head'), got "
                f"{type(qk_norm).__name__}"
            )
        if head_dim is None and embed_dim % num_heads:
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
        self.head_dim = embed_dim // num_heads if head_dim is None else head_dim
        self.kdim = embed_dim if kdim is None else kdim
        self.vdim = self.kdim if vdim is None else vdim
        self.dropout = float(dropout)
        self.backend = backend
        D = self.head_dim
        self.W_query = nn.Linear(embed_dim, num_heads * D, bias=bias)
        self.W_key = nn.Linear(self.kdim, G * D, bias=bias)
        self.W_value = nn.Linear(self.vdim, G * D, bias=bias)
        self.out_proj = nn.Linear(num_heads * D, embed_dim, bias=out_bias)
        self.scale = None if scale is None else float(scale)
        self.sliding_window = sliding_window
        self.attention_chunk = attention_chunk
        self.temperature = (
            None if temperature is None else (float(temperature[0]), float(temperature[1]))
        )
        self.qk_norm = qk_norm
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if qk_norm is not None:
            across = qk_norm.scope == "all"
            self.q_norm = qk_norm.build(num_heads * D if across else D, heads=num_heads)
            self.k_norm = qk_norm.build(G * D if across else D, heads=G)
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
        elif isinstance(rope, RopeConfig):
            self.rope = RotaryEmbedding.from_config(D, rope)
        elif isinstance(rope, (int, float)):
            self.rope = RotaryEmbedding(D, base=float(rope))
        else:
            raise TypeError(
                f"`rope` must be None, True, a float base, a RopeConfig or a RotaryEmbedding, "
                f"got {type(rope).__name__}"
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
                all ``S`` keys the layer sees (cached + new; with a
                :class:`RollingKVCache`, the held ones + new).
            is_causal: causal masking; aligned bottom-right when ``T != S`` (cache).
            kv_cache: new keys/values are appended to it and all of them are used; a
                :class:`RollingKVCache` needs ``sliding_window`` (see
                :meth:`new_kv_cache`). With ``context`` (cross attention) it holds the
                context's keys/values instead: filled on the first call, reused as they
                are on later calls (the encoder output does not change while decoding), so
                ``context`` is projected once.
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

        if isinstance(kv_cache, RollingKVCache) and (
            self.sliding_window is None or kv_cache.window < self.sliding_window
        ):
            raise ValueError(
                f"`kv_cache` is a RollingKVCache of window {kv_cache.window}, but this layer "
                f"has sliding_window={self.sliding_window}; a rolling cache needs a window "
                "at least the layer's: use layer.new_kv_cache()"
            )
        # Cross attention with a filled cache: the context's keys/values as first computed.
        cross_cached = context is not None and kv_cache is not None and kv_cache.seq_len > 0
        q_flat = self.W_query(x)  # (B, T, H*D)
        queries = q_flat.view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        k_flat: torch.Tensor | None = None
        if cross_cached:
            assert kv_cache is not None
            keys, values = kv_cache.cached()  # (B, G, S, D), projected and normed once
        else:
            k_flat = self.W_key(src)  # (B, S_new, G*D)
            keys = k_flat.view(B, S_new, G, D).transpose(1, 2)  # (B, G, S_new, D)
            values = self.W_value(src).view(B, S_new, G, D).transpose(1, 2)  # (B, G, S_new, D)
        queries_projected, keys_projected = queries, keys
        if self.q_norm is not None and self.k_norm is not None and self.qk_norm is not None:
            # OLMo 2: over the heads' concatenation; Qwen3, Gemma 3: each head vector
            # (StableLM 2: each with its own weight)
            queries = norm_heads(self.qk_norm.scope, self.q_norm, q_flat, H)  # (B, H, T, D)
            if k_flat is not None:
                keys = norm_heads(self.qk_norm.scope, self.k_norm, k_flat, G)  # (B, G, S_new, D)

        if self.rope is not None:
            pos = self._positions(position_ids, B, T, kv_cache, x.device)
            queries = self.rope(queries, pos)
            keys = self.rope(keys, pos)
        elif position_ids is not None:
            raise ValueError("`position_ids` is only used with rope; this layer has rope=None")
        if self.temperature is not None:
            # Llama 4's NoPE layers: queries sharpen with the log of their position
            floor_scale, tscale = self.temperature
            pos = self._positions(position_ids, B, T, kv_cache, x.device)
            t = torch.log1p(torch.floor((pos.float() + 1.0) / floor_scale)) * tscale + 1.0
            t = t[:, None, :, None] if t.ndim == 2 else t[:, None]  # (B, 1, T, 1) or (T, 1)
            queries = queries * t.to(queries.dtype)  # (B, H, T, D)

        if kv_cache is not None and not cross_cached:
            keys, values = kv_cache.update(keys, values)  # (B, G, S, D)
        mask = self._mask(attn_mask, is_causal, keys.shape[2])
        scale = self.scale if self.scale is not None else default_scale(D)
        return self._attend_heads(
            x, queries_projected, keys_projected, queries, keys, values, mask, scale, need_weights
        )

    def _attend_heads(
        self,
        x: torch.Tensor,
        queries_projected: torch.Tensor,
        keys_projected: torch.Tensor,
        queries: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: AttentionMask | None,
        scale: float,
        need_weights: bool | WeightsRequest,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend with per-head queries ``(B, H, T, D)``, keys ``(B, G, S, D)`` and values
        ``(B, G, S, Dv)``, then the output projection; the weights asked for (``need_weights``,
        :attr:`capture`, a recorder) and a head editor are served here, for every layer kind
        (:class:`attnlab.latent.LatentAttention` expands its latent into these)."""
        B, T, _ = x.shape
        H = self.num_heads
        dropout_p = self.dropout if self.training else 0.0

        capture = WeightsRequest.from_arg(self.capture, "capture") if self.capture else None
        recorder = _RECORDER.get()
        wanted = recorder.request(self) if recorder is not None else None
        recorded = WeightsRequest.from_arg(wanted, "recorder") if wanted else None
        asked = WeightsRequest.from_arg(need_weights)
        request = next((r for r in (asked, capture, recorded) if r is not None), None)
        result = scaled_dot_product_attention(
            queries,
            keys,
            values,
            mask,
            dropout_p,
            scale=scale,
            backend=self.backend,
            need_weights=request if request is not None else False,
            softcap=self.softcap,
            sinks=self.sinks,
        )
        if request is not None:
            out, weights = result  # type: ignore[misc]
        else:
            out, weights = result, None  # type: ignore[assignment]

        def weights_for(req: WeightsRequest) -> torch.Tensor | None:
            if req == request:
                return weights.detach() if weights is not None else None
            return exact_attention_weights(
                queries,
                keys,
                mask,
                scale=scale,
                heads=req.heads,
                rows=req.rows,
                softcap=self.softcap,
                sinks=self.sinks,
            )

        if capture is not None:
            self.captured = weights_for(capture)
        context = out.transpose(1, 2).reshape(B, T, H * out.shape[-1])  # (B, T, H*Dv)
        editor = _EDITOR.get()
        if editor is not None:
            edited = editor(self, context)
            if not isinstance(edited, torch.Tensor) or edited.shape != context.shape:
                got = tuple(edited.shape) if isinstance(edited, torch.Tensor) else type(edited)
                raise RuntimeError(
                    f"a head editor must return a tensor of shape {tuple(context.shape)}, got {got}"
                )
            context = edited
        out = self.out_proj(context)  # (B, T, C)
        if recorder is not None and wanted is not None:
            recorder.record(
                AttentionCall(
                    layer=self,
                    x=x,
                    queries_projected=queries_projected,
                    keys_projected=keys_projected,
                    queries=queries,
                    keys=keys,
                    values=values,
                    mask=mask,
                    scale=scale,
                    weights=weights_for(recorded) if recorded is not None else None,
                    context=context,
                    output=out,
                )
            )
        if asked is not None:
            return out, weights  # type: ignore[return-value]
        return out

    def _mask(
        self, attn_mask: AttentionMask | torch.Tensor | None, is_causal: bool, S: int
    ) -> AttentionMask | None:
        """The call's mask: the user's, causal, and this layer's sliding window or chunks (left
        out when they cannot remove a key, S <= window or chunk, so fused kernels keep their
        fast path)."""
        if self.attention_chunk is not None and self.attention_chunk < S:
            # chunks are causal; they hold with a cache of every key from position 0
            chunks = ChunkedMask(self.attention_chunk)
            user = as_mask(attn_mask)
            return chunks if user is None else user & chunks
        if self.sliding_window is None or self.sliding_window >= S:
            return as_mask(attn_mask, is_causal)
        window = SlidingWindowMask(self.sliding_window, causal=is_causal)
        user = as_mask(attn_mask)  # the window already forbids the future when causal
        return window if user is None else user & window

    def new_kv_cache(self) -> KVCache:
        """An empty cache for this layer: a :class:`RollingKVCache` of ``sliding_window``
        positions for a sliding-window layer, else a :class:`KVCache`."""
        if self.sliding_window is not None:
            return RollingKVCache(self.sliding_window)
        return KVCache()

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
        extra = "".join(
            f", {name}={value!r}"
            for name, value in (
                ("scale", self.scale),
                ("qk_norm", self.qk_norm),
                ("sliding_window", self.sliding_window),
                ("attention_chunk", self.attention_chunk),
                ("temperature", self.temperature),
            )
            if value is not None
        )
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"backend={self.backend!r}, rope={self.rope is not None}{extra}"
            + (f", softcap={self.softcap}" if self.softcap is not None else "")
            + (", sinks=True" if self.sinks is not None else "")
        )


def _divisor_hint(embed_dim: int, num_heads: int) -> int:
    divisors = [d for d in range(1, embed_dim + 1) if embed_dim % d == 0]
    return min(divisors, key=lambda d: abs(d - num_heads))
