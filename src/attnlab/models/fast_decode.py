"""The hand-off from a model's forward to its one-token decode step.

Prefill (many new tokens) runs through the model's modules and the attention backends. One
new token per row over :class:`attnlab.attention.StaticKVCache` s, with the model in eval
mode, gradients off, no attention weights asked for or recorded, no block edit and no
PyTorch hook on a module the step skips (:func:`takes_fast_step`, :func:`fast_step`), takes
the model's :class:`~attnlab.models.decode.plan.DecodePlan` instead: for every layout of
:class:`attnlab.models.decoder.Decoder` with rotary or learned positions and for the book's
GPT. :meth:`FastDecoding.decode_path` tells a user which way a model decodes and why.

The plan (:mod:`attnlab.models.decode`) is named parts: what it reads off the model
(``layout``), the general loop (``general``), the layers as bare kernels (``kernels``) and
the short loop over them (``short``), the compiled loop (``compiled``), and the plan that
dispatches between them (``plan``). ``benchmarks/bench_decode_step.py`` measures each loop.

Shape legend: B batch, V vocabulary.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from attnlab._threads import one_intra_op_thread
from attnlab.attention import (
    KVCache,
    StaticKVCache,
    StaticWindowKVCache,
    check_cache_dtype,
    recording_attention,
)
from attnlab.models._lm import editing_blocks
from attnlab.models.decode.layout import why_not_fast_decode
from attnlab.models.decode.plan import DecodePath, DecodePlan, hook_tables, module_hooks

__all__ = [
    "DecodePath",
    "DecodePlan",
    "FastDecoding",
    "decode_plan",
    "defer_decode_plan",
    "fast_step",
    "hook_tables",
    "module_hooks",
    "new_caches",
    "takes_fast_step",
    "why_not_fast_decode",
]


def takes_fast_step(
    model: Any, input_ids: torch.Tensor, kv_cache: Any, need_weights: bool = False
) -> bool:
    """Whether ``model(input_ids, kv_cache=...)`` may take :meth:`DecodePlan.step`.

    One new token per row after a prompt (on empty caches the token is the prompt, which
    runs on the modules: a one-token prompt and ``-n 1`` never wait for the plan's fused
    copies), every layer's cache a :class:`StaticKVCache`, eval mode, no gradients, no
    weights asked for or recorded (:func:`attnlab.attention.record_attention`; a layer's
    ``capture`` is checked by :meth:`DecodePlan.capturing`), no block hook point in use
    (:func:`attnlab.models._lm.editing_blocks`). A PyTorch forward hook or pre-hook on a
    module the step would skip is checked by :meth:`DecodePlan.hooked` (from the plan's
    list of the modules' hook tables, without walking the modules), so that a user's
    ``register_forward_hook`` keeps firing while :func:`attnlab.generation.generate`
    decodes.
    """
    if input_ids.shape[1] != 1 or need_weights or not kv_cache or model.training:
        return False
    if torch.is_grad_enabled() or recording_attention() or editing_blocks():
        return False
    if not all(isinstance(c, StaticKVCache) for c in kv_cache):
        return False
    return kv_cache[0].seq_len > 0


def new_caches(
    n_layers: int,
    max_len: int | None,
    windows: Sequence[int | None] | None = None,
    dtype: torch.dtype | None = None,
) -> list[KVCache]:
    """The causal-LM protocol's ``new_kv_cache(max_len)``: growing caches for None,
    :class:`StaticKVCache` s of ``max_len`` positions (the fast step's) otherwise, holding
    ``dtype`` (None: the keys' own); a layer whose sliding window (``windows``, one per
    layer) is under ``max_len`` gets a :class:`StaticWindowKVCache` of its window's slots.
    The growing caches (for training and gradients) hold the keys' dtype whatever
    ``dtype`` is."""
    if max_len is None:
        return [KVCache() for _ in range(n_layers)]
    caches: list[KVCache] = []
    for i in range(n_layers):
        window = windows[i] if windows is not None else None
        caches.append(
            StaticWindowKVCache(window, dtype)
            if window and window < max_len
            else StaticKVCache(max_len, dtype)
        )
    return caches


_PLAN_LOCK = threading.Lock()  # one build per model when threads share it (serve)


class FastDecoding:
    """Where a model keeps its :class:`DecodePlan` (mixed into the one decoder and the
    book's GPT): built at the first one-token step (:func:`decode_plan`), dropped by
    :meth:`invalidate_decode_plan` when the layers it fused are replaced
    (:func:`attnlab.quant.quantize_model` calls it)."""

    #: The plan once built; None until then and after an invalidation.
    _decode_plan: DecodePlan | None = None
    #: ``share_float`` for a plan built without one asked for (:func:`defer_decode_plan`).
    _decode_share_float: bool = False
    _kv_cache_dtype: torch.dtype | None = None

    @property
    def kv_cache_dtype(self) -> torch.dtype | None:
        """What ``new_kv_cache(max_len=N)`` (and so generation) caches keys and values in:
        None (the default) for the keys' own dtype (float32), or e.g. ``torch.float16``:
        half the memory, and half the bytes a decode step at depth reads, each key and
        value rounded once to float16 (:class:`attnlab.attention.StaticKVCache`).

        Raises:
            ValueError: set to something that is not None or a floating dtype, or to a
                dtype on a model whose caches hold their keys' own (:meth:`why_no_cache_dtype`).
        """
        return self._kv_cache_dtype

    @kv_cache_dtype.setter
    def kv_cache_dtype(self, dtype: torch.dtype | None) -> None:
        dtype = check_cache_dtype(dtype)
        why = self.why_no_cache_dtype() if dtype is not None else None
        if why is not None:
            raise ValueError(
                f"kv_cache_dtype={dtype} is for the self-attention caches; this model's "
                f"layers have {why} caches, which hold their keys' own dtype"
            )
        self._kv_cache_dtype = dtype

    def why_no_cache_dtype(self) -> str | None:
        """What keeps this model's caches from holding another dtype than their keys' (a
        kind of cache, e.g. ``"latent attention"``), or None: they can."""
        return None

    def invalidate_decode_plan(self) -> None:
        """Drop the plan: it holds the layers as they were; the next step builds it again."""
        with _PLAN_LOCK:
            self._decode_plan = None

    def decode_path(self, batch: int = 1) -> DecodePath:
        """How ``model(ids, kv_cache=model.new_kv_cache(max_len=N))`` decodes one new token
        per row of ``batch``, and why: on the model's modules, or by the decode plan's
        general, short or compiled loop (:meth:`DecodePlan.path`).

        It reads the model as it is now (eval or training mode, module hooks, a layer's
        ``capture``) and builds the plan (and the compiled step) if they are not built
        yet; what a call adds (gradients on, ``need_weights``, ``record_attention``, a
        block edit, a prompt of more than one token) sends that call to the modules.
        """
        why = why_not_fast_decode(self)
        if why is not None:
            return DecodePath("modules", f"the decode step does not cover {why}")
        if getattr(self, "training", False):
            return DecodePath("modules", "training mode (model.eval() turns the step on)")
        plan = decode_plan(self)
        if plan.capturing():
            return DecodePath("modules", "a layer captures its attention weights")
        if plan.hooked():
            return DecodePath("modules", "a PyTorch forward hook on a module the step skips")
        return plan.path(batch)


def decode_plan(model: FastDecoding, *, share_float: bool | None = None) -> DecodePlan:
    """``model``'s :class:`DecodePlan`, built once (again when ``share_float`` is newly
    asked for, or after :meth:`FastDecoding.invalidate_decode_plan`).

    Args:
        model: the model.
        share_float: as :class:`DecodePlan`; None: what :func:`defer_decode_plan`
            recorded for this model (the loaders: True), else False.
    """
    if share_float is None:
        share_float = model._decode_share_float
    with _PLAN_LOCK:
        plan = model._decode_plan
        if plan is None or (share_float and not plan.share_float):
            with one_intra_op_thread():  # small copies and packs (attnlab._threads)
                plan = DecodePlan(model, share_float=share_float)
            model._decode_plan = plan
    return plan


def defer_decode_plan(model: FastDecoding, *, share_float: bool) -> None:
    """Build ``model``'s :class:`DecodePlan` at its first one-token step, with
    ``share_float``, instead of now.

    The loaders call it: a plan with shared float weights copies the Q/K/V (and gate/up)
    weights into one fused tensor each, unless the file already stores them side by
    side, and fp32 weights into column-major memory; a model that is only traced,
    explained or embedded never needs that, and loading stays a read of the file.
    """
    model._decode_share_float = share_float


def fast_step(
    model: Any, input_ids: torch.Tensor, kv_cache: Any, need_weights: bool = False
) -> torch.Tensor | None:
    """The logits of :meth:`DecodePlan.step` when :func:`takes_fast_step` allows it, no
    layer captures its weights and no PyTorch hook would fire on a module the step skips;
    None: run the model's modules instead."""
    if not takes_fast_step(model, input_ids, kv_cache, need_weights):
        return None
    plan = model._decode_plan
    if plan is None:
        if why_not_fast_decode(model) is not None:
            return None  # checked per call only for layouts that stay on their modules
        plan = decode_plan(model)
    if plan.capturing() or plan.hooked():
        return None
    return plan.step(input_ids, kv_cache)
