"""A model's decode plan: its fused weights and tables, and the one-token step as a
dispatcher over three named loops.

- :func:`~attnlab.models.decode.general.step_general`, the general loop: every layout the
  step covers (:func:`~attnlab.models.decode.layout.why_not_fast_decode`);
- :func:`~attnlab.models.decode.short.step_short`, the short loop: a plain stack's layers
  as bare kernels (:mod:`attnlab.models.decode.kernels`), fewer tensor operations;
- :func:`~attnlab.models.decode.compiled.step_compiled`, the compiled loop: the short
  loop's layers in C++ (:mod:`attnlab.native`) where it builds.

:meth:`DecodePlan.path` says which loop a step takes and why; :meth:`DecodePlan.step`
takes it. The fp32 result equals the modules' up to the order of floating-point sums
(tests: greedy tokens identical to the full recompute and to transformers).

Shape legend: B batch, H query heads, G key/value heads, D head dim, C width, V
vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import torch
from torch import nn

from attnlab.attention import KVCache, StaticKVCache
from attnlab.models.decode.compiled import build_compiled, cache_slot_fits, step_compiled
from attnlab.models.decode.general import step_general
from attnlab.models.decode.kernels import SHORT_LOOP_MAX_BATCH, KernelLayer, kernel_layers
from attnlab.models.decode.layout import (
    block_parts,
    model_parts,
    norm_fn,
    read_layer,
    why_not_fast_decode,
)
from attnlab.models.decode.short import step_short
from attnlab.quant import column_major
from attnlab.rope import RotaryEmbedding, table_length

__all__ = ["DecodePath", "DecodePlan", "Loop", "hook_tables", "module_hooks"]

#: What runs one new token: the model's ``modules`` or one of the plan's three loops.
Loop = Literal["modules", "general", "short", "compiled"]


class DecodePath(NamedTuple):
    """Which loop one new token per row takes (:meth:`DecodePlan.path`,
    :meth:`attnlab.models.fast_decode.FastDecoding.decode_path`), and why."""

    loop: Loop
    why: str

    def __str__(self) -> str:
        return f"{self.loop}: {self.why}"


def hook_tables(model: nn.Module) -> list[dict[Any, Any]]:
    """The forward-hook and forward-pre-hook tables of every module inside ``model`` (not
    the model's own: its hooks fire around the step too). PyTorch registers and removes
    hooks in these tables in place, so one list answers :func:`module_hooks` for as long
    as the modules stay (a plan is rebuilt when they are replaced)."""
    return [
        table
        for m in model.modules()
        if m is not model
        for table in (m._forward_hooks, m._forward_pre_hooks)
    ]


def module_hooks(tables: list[dict[Any, Any]]) -> bool:
    """Whether a PyTorch forward hook or forward pre-hook would fire: a global one
    (``torch.nn.modules.module.register_module_forward_hook`` and ``..._pre_hook``) or one
    in ``tables`` (:func:`hook_tables`)."""
    from torch.nn.modules import module as torch_module

    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return True
    return any(tables)


class DecodePlan:
    """The fused weights and tables of one model, and its one-token :meth:`step`.

    Built once per model (``model.prepare_decode()``); it reads the model's modules as
    they are (float or :mod:`attnlab.quant` layers) and fuses their products.

    Args:
        model: the one decoder (``tok_embeddings``, optional ``pos_embeddings``,
            ``blocks`` of ``attn_norm``/``attention``/``mlp_norm``/``mlp`` and, for
            sandwich norms, ``attn_post_norm``/``mlp_post_norm``, ``norm``, ``lm_head``,
            ``head``) or the book's GPT (``tok_emb``, ``pos_emb``, ``trf_blocks``,
            ``final_norm``, ``out_head``).
        share_float: also fuse float (``nn.Linear``) products, the parameters becoming
            views of the fused weights (:func:`attnlab.quant.fuse_linears`), and store every
            fp32 product's weight column-major (:func:`attnlab.quant.column_major`);
            loaders of inference models ask for it
            (:func:`attnlab.models.fast_decode.defer_decode_plan`), models being trained
            should not.

    Raises:
        ValueError: a layout :func:`why_not_fast_decode` rejects.
    """

    def __init__(self, model: Any, *, share_float: bool = False) -> None:
        why = why_not_fast_decode(model)
        if why is not None:
            raise ValueError(f"no fast decode step for this model: {why}")
        parts = model_parts(model)
        assert not isinstance(parts, str)
        self.share_float = share_float
        self.parts = parts
        self._hook_tables = hook_tables(model)
        att0 = block_parts(parts.blocks[0])[1]
        self.H, self.G, self.D = att0.num_heads, att0.num_kv_heads, att0.head_dim
        scale = getattr(att0, "scale", None)
        self.scale = 1.0 / math.sqrt(self.D) if scale is None else float(scale)
        self.rope: RotaryEmbedding | None = att0.rope  # the first layer's
        self.layers = [read_layer(block, share_float) for block in parts.blocks]
        # The layers' rotary embeddings, each once (Gemma 3: one for the local layers, one
        # for the global ones); a layer's rotation is found by its index here.
        self.ropes: list[RotaryEmbedding] = list(
            dict.fromkeys(layer.rope for layer in self.layers if layer.rope is not None)
        )
        # Full-width "rotate half" RoPE with fixed frequencies: tables once, two products.
        # Any other variant (partial, interleaved, dynamic NTK, LongRoPE) is applied by the
        # module.
        self.rope_tables = bool(self.ropes) and all(
            rope.rotary_dims == self.D and not rope.config.interleaved and not rope.length_dependent
            for rope in self.ropes
        )
        if share_float:  # the output head too; a tied embedding follows (the same Parameter)
            for name in ("lm_head", "out_head"):
                column_major(getattr(model, name, None))
        self.final_norm = norm_fn(parts.final_norm)
        # Per rotary embedding: cos (L, D) fp32 and sin (L, D) fp32, first half negated.
        self._tables: dict[RotaryEmbedding, tuple[torch.Tensor, torch.Tensor]] = {}
        found = self._kernel_layers(share_float)
        #: The layers as bare kernels (the short and the compiled loop), or None: the
        #: stack takes the general loop, for :attr:`why_general`.
        self.kernel_layers: list[KernelLayer] | None = None if isinstance(found, str) else found
        #: Why the stack takes the general loop whatever the batch; None: it need not.
        self.why_general: str | None = found if isinstance(found, str) else None
        self._native: Any = None  # the compiled step; False: none (native_step)
        self._why_not_compiled = "it was turned off for this plan"

    def _kernel_layers(self, share: bool) -> list[KernelLayer] | str:
        if not self.rope_tables:
            return "positions other than full-width rotary ones with fixed frequencies"
        if self.parts.positions is not None:
            return "learned positions"
        return kernel_layers(
            self.layers,
            self.parts.blocks,
            self.ropes,
            H=self.H,
            G=self.G,
            D=self.D,
            scale=self.scale,
            share=share,
        )

    @property
    def rows(self) -> list[KernelLayer] | None:
        """:attr:`kernel_layers` by its former name."""
        return self.kernel_layers

    @rows.setter
    def rows(self, value: list[KernelLayer] | None) -> None:
        self.kernel_layers = value

    def capturing(self) -> bool:
        """True when a layer was asked to ``capture`` its weights (the step skips layers)."""
        return any(layer.attention.capture for layer in self.layers)

    def hooked(self) -> bool:
        """True when a PyTorch forward hook or pre-hook would fire on a module the step
        skips (:func:`module_hooks`): the model then runs its modules."""
        return module_hooks(self._hook_tables)

    def _rope_tables(
        self, length: int, device: torch.device, rope: RotaryEmbedding | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (first half negated) of ``rope`` (default: the first layer's) for
        positions up to ``length`` at least, fp32 (L, D); built once, grown as needed
        (:func:`attnlab.rope.table_length`)."""
        rope = self.rope if rope is None else rope
        assert rope is not None
        tables = self._tables.get(rope)
        if tables is None or tables[0].shape[0] < length:
            n = table_length(tables[0].shape[0] if tables is not None else 0, length)
            self._tables.pop(rope, None)  # the old tables go before the new are built
            cos, sin = rope.cos_sin(torch.arange(n, device=device))  # (L, D) fp64
            half = self.D // 2
            # rotate_half(x) * sin == roll(x, D/2) * [-sin_lo, sin_hi], bit for bit.
            sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
            tables = self._tables[rope] = (cos.float(), sin.float())
        return tables

    def native_step(self) -> Any | None:
        """The compiled step (:mod:`attnlab.native`) over :attr:`kernel_layers`, built on
        the first call; None when a layer has a kernel or activation it does not call, the
        model's rows are not float32, or the module is unavailable
        (:func:`attnlab.native.why_not_native`): :meth:`path` says which."""
        if self._native is None:
            built = build_compiled(self)
            if isinstance(built, str):
                self._native, self._why_not_compiled = False, built
            else:
                self._native = built
        return self._native or None

    def path(self, batch: int = 1, *, static: bool = True) -> DecodePath:
        """Which loop :meth:`step` runs for ``batch`` rows, and why.

        Args:
            batch: rows decoded together (B).
            static: whether the caches are :class:`attnlab.attention.StaticKVCache` s
                (the short and the compiled loop write only those).

        Returns:
            ``"compiled"`` (when the caches' buffers are float32 and contiguous; else the
            step takes ``"short"``), ``"short"`` or ``"general"``, with the reason.
        """
        if self.kernel_layers is None:
            return DecodePath("general", self.why_general or "no kernel layers")
        if batch >= SHORT_LOOP_MAX_BATCH:
            return DecodePath(
                "general", f"{batch} rows: the bare kernels take fewer than {SHORT_LOOP_MAX_BATCH}"
            )
        if not static:
            return DecodePath("general", "the caches are not StaticKVCaches")
        if self.native_step() is None:
            return DecodePath("short", f"no compiled step: {self._why_not_compiled}")
        return DecodePath("compiled", "a plain stack whose every product the compiled step calls")

    @torch.no_grad()
    def step(self, input_ids: torch.Tensor, kv_cache: Sequence[KVCache]) -> torch.Tensor:
        """Logits of one new token per row, appending its keys/values to ``kv_cache``, by
        the loop :meth:`path` names.

        Args:
            input_ids: (B, 1) token ids following the cached ones.
            kv_cache: one cache per layer, all at the same length.

        Returns:
            (B, 1, V) logits.
        """
        B = input_ids.shape[0]
        loop = self.path(B, static=isinstance(kv_cache[0], StaticKVCache)).loop
        if loop == "compiled":
            slots = [c.next_slot() for c in kv_cache]  # type: ignore[attr-defined]
            if all(cache_slot_fits(t, B, self.G, self.D) for t in slots):
                return self._step_compiled(self._native, input_ids, kv_cache, slots)  # type: ignore[arg-type]
            loop = "short"  # buffers the compiled loop cannot write
        if loop == "short":
            return self._step_short(input_ids, kv_cache)  # type: ignore[arg-type]
        return self._step_general(input_ids, kv_cache)

    def _step_general(self, input_ids: torch.Tensor, kv_cache: Sequence[KVCache]) -> torch.Tensor:
        """:func:`attnlab.models.decode.general.step_general` of this plan."""
        return step_general(self, input_ids, kv_cache)

    def _step_short(
        self, input_ids: torch.Tensor, kv_cache: Sequence[StaticKVCache]
    ) -> torch.Tensor:
        """:func:`attnlab.models.decode.short.step_short` of this plan."""
        return step_short(self, input_ids, kv_cache)

    def _step_compiled(
        self,
        compiled: Any,
        input_ids: torch.Tensor,
        kv_cache: Sequence[StaticKVCache],
        slots: Sequence[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """:func:`attnlab.models.decode.compiled.step_compiled` of this plan."""
        return step_compiled(self, compiled, input_ids, kv_cache, slots)
