"""The one-token decode step with little per-token overhead, for the one decoder's layouts.

Prefill (many new tokens) runs through the model's modules and the attention backends.
One new token per row with a :class:`attnlab.attention.StaticKVCache` takes this path,
for every layout of :class:`attnlab.models.decoder.Decoder` with rotary or learned
positions: pre-, post- (OLMo 2) and sandwich (Gemma 2) norms, sequential or parallel
(GPT-NeoX) residual, QK-norm, attention and final logit soft-capping, sliding windows
(the static cache holds every position; a windowed layer attends to its last ``window``
keys), embeddings scaled by ``sqrt(C)``, attention sinks (gpt-oss: one more softmax column
with no value, dropped after the softmax), mixtures of experts (the module called on the
rows: routing is per token); and for the book's GPT:

- one QKV product and one gate/up product per layer (:func:`attnlab.quant.fuse_rows`,
  built once; the separate ``W_query``/``W_key``/``W_value`` then view the fused rows);
- RoPE from cos/sin tables built once (fp32 values of the same fp64 angles the
  :class:`~attnlab.attention.RotaryEmbedding` uses), applied to queries and keys together;
- attention of one query row as two batched products and a softmax over the cache
  (no mask: the last position sees every key), keys and values written in place;
- norms as single ``torch.nn.functional`` calls, no shape checks per step;
- the output head through the model's own ``head`` (scaling, soft-capping), as a module.

A stack of pre-norm or sandwich-norm layers of RMSNorms with a gated MLP and table RoPE
(Llama, Mistral, Qwen2, Qwen3, SmolLM2, Gemma 3: QK-norm per head vector, windows, a rotary
embedding per layer, embeddings x sqrt(C)) takes a shorter loop,
:meth:`DecodePlan._step_rows`: each product's kernel called bare
(:func:`attnlab.quant.row_product`) on rows kept in its dtype, QK-norm of every head as one
call, RoPE as one (D, D) product, the cache written by :meth:`StaticKVCache.append`; the
same kernels on the same rows; attention is one ``scaled_dot_product_attention`` call, in
inference mode (SmolLM2 int4: 1,356 tensor operations called a token instead of 2,090;
``benchmarks/bench_decode_step.py``). Soft-capping (Gemma 2), parallel residuals,
post-norms, LayerNorms and learned positions take the general loop.

Where :mod:`attnlab.native` is built (a C++ compiler on the machine; it compiles once and
is cached), the short loop's layers run compiled (:meth:`DecodePlan.native_step`): the
same product kernels on the same rows, and plain loops for the norms, RoPE, the cache
write, attention and the activation in place of some forty tensor operations a layer
(SmolLM2 int4: 4.6 ms a token instead of 6.9 at 2 threads). Its numbers are the short
loop's up to the order of float32 sums.

The fp32 result equals the module path up to the order of floating-point sums
(tests: greedy tokens identical to the full recompute and to transformers).

Shape legend: B batch, H query heads, G key/value heads, D head dim, C width, S cached
keys, F feed-forward width, V vocabulary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from attnlab import native
from attnlab.attention import KVCache, StaticKVCache, recording_attention
from attnlab.models._lm import editing_blocks
from attnlab.models.mlp import ACTIVATIONS
from attnlab.models.moe import MixtureOfExperts
from attnlab.norms import RMSNorm
from attnlab.quant import column_major, fuse_rows, native_product, row_product
from attnlab.rope import RotaryEmbedding

__all__ = [
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

Norm = Callable[[torch.Tensor], torch.Tensor]


def _norm_fn(norm: nn.Module) -> Norm:
    """One functional call for an RMSNorm (``weight``, ``eps``), an ``nn.LayerNorm`` or the
    book's LayerNorm (``scale``, ``shift``, ``eps``)."""
    n: Any = norm
    if isinstance(norm, nn.LayerNorm):
        return lambda x: nn.functional.layer_norm(x, n.normalized_shape, n.weight, n.bias, n.eps)
    if hasattr(norm, "scale") and hasattr(norm, "shift"):
        shape = (n.scale.shape[0],)
        return lambda x: nn.functional.layer_norm(x, shape, n.scale, n.shift, n.eps)
    # An RMSNorm: its own forward (no hooks), the same numbers as the module path;
    # torch.nn.functional.rms_norm dispatches ~12 ops with two copies per call here.
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
class _Parts:
    """Where a decoder keeps its pieces (the one decoder's names, or the book's GPT's)."""

    embedding: nn.Embedding
    positions: nn.Embedding | None
    blocks: list[Any]
    final_norm: nn.Module
    head: Callable[[torch.Tensor], torch.Tensor]  # (B, 1, C) -> (B, 1, V), modules called
    embed_scale: bool  # token embeddings times sqrt(C) (Gemma)


def _parts(model: Any) -> _Parts | str:
    """The model's pieces, or why its layout is not one this step knows."""
    if hasattr(model, "trf_blocks"):  # attnlab.models.gpt.GPTModel, the book's names
        return _Parts(
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
    return _Parts(
        model.tok_embeddings,
        getattr(model, "pos_embeddings", None),
        list(model.blocks),
        model.norm,
        model.head,  # the one decoder's head: input scale, lm_head module, final softcap
        embed_scale=bool(getattr(config, "embed_scale", False)),
    )


def _block_parts(block: Any) -> tuple[nn.Module, Any, nn.Module, Any, Any, Any, Any]:
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
    parts = _parts(model)
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
        norm1, att, norm2 = _block_parts(block)[:3]
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
class _Layer:
    attention: Any  # the Attention module (for `capture`)
    rope: RotaryEmbedding | None  # this layer's (Gemma 3: local and global layers differ)
    placement: str  # "pre", "post" (norms on the outputs) or "sandwich" (both)
    parallel: bool  # x + attn(norm1(x)) + mlp(norm2(x))
    window: int | None  # keys a query sees (itself included); None = all
    softcap: float | None  # score soft-capping c * tanh(s / c)
    sinks: torch.Tensor | None  # (G, H/G, 1) a sink logit per head (gpt-oss), else None
    scale: float | None  # this layer's score scale; None = the model's
    qk_norm: str | None  # None, "head" (each head vector) or "all" (across heads)
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


@dataclass(frozen=True)
class _Row:
    """One layer as bare kernels (:meth:`DecodePlan.step`'s short path)."""

    norm1: tuple[torch.Tensor, float]  # RMSNorm weight, eps
    norm2: tuple[torch.Tensor, float]
    attn_post: tuple[torch.Tensor, float] | None  # sandwich: norm of the attention output
    mlp_post: tuple[torch.Tensor, float] | None  # sandwich: norm of the MLP output
    qk_norm: tuple[torch.Tensor, float] | None  # (H + G, D): q's weight per query head, k's
    dtype: torch.dtype  # what the products take: every product of the layer the same
    qkv: Callable[[torch.Tensor], torch.Tensor]
    out: Callable[[torch.Tensor], torch.Tensor]
    gate_up: Callable[[torch.Tensor], torch.Tensor]
    down: Callable[[torch.Tensor], torch.Tensor]
    act: Callable[[torch.Tensor], torch.Tensor]
    scale: float
    window: int | None  # keys a query sees (itself included); None = all
    rope: int  # index of this layer's rotation in the step's list (:attr:`DecodePlan.ropes`)
    # The modules behind qkv, out, gate_up and down, each slot's outputs side by side (the
    # native step calls their kernels: :meth:`DecodePlan.native_step`).
    modules: tuple[tuple[Any, ...], ...] = ()


def _rms_parts(norm: nn.Module) -> tuple[torch.Tensor, float] | None:
    """(weight, eps) of an attnlab RMSNorm (fp32 math, ``weight * normed``), else None."""
    if type(norm) is not RMSNorm:
        return None
    return norm.weight, float(norm.eps)


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
            views of the fused weights (:func:`attnlab.quant.fuse_rows`), and store every
            fp32 product's weight column-major (:func:`attnlab.quant.column_major`);
            loaders of inference models ask for it (:func:`defer_decode_plan`), models
            being trained should not.

    Raises:
        ValueError: a layout :func:`why_not_fast_decode` rejects.
    """

    def __init__(self, model: Any, *, share_float: bool = False) -> None:
        why = why_not_fast_decode(model)
        if why is not None:
            raise ValueError(f"no fast decode step for this model: {why}")
        parts = _parts(model)
        assert not isinstance(parts, str)
        self.share_float = share_float
        self.parts = parts
        self._hook_tables = hook_tables(model)
        att0 = _block_parts(parts.blocks[0])[1]
        self.H, self.G, self.D = att0.num_heads, att0.num_kv_heads, att0.head_dim
        scale = getattr(att0, "scale", None)
        self.scale = 1.0 / math.sqrt(self.D) if scale is None else float(scale)
        self.rope: RotaryEmbedding | None = att0.rope  # the first layer's
        self.layers = [self._layer(block, share_float) for block in parts.blocks]
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
        self.final_norm = _norm_fn(parts.final_norm)
        # Per rotary embedding: cos (L, D) fp32 and sin (L, D) fp32, first half negated.
        self._tables: dict[RotaryEmbedding, tuple[torch.Tensor, torch.Tensor]] = {}
        self.rows = self._rows(share_float)
        self._native: Any = None  # the compiled step; False: none (native_step)

    @staticmethod
    def _layer(block: Any, share: bool) -> _Layer:
        norm1, att, norm2, gate, up, down, act = _block_parts(block)
        qk_norm = getattr(att, "qk_norm", None)
        attn_post = getattr(block, "attn_post_norm", None)
        mlp_post = getattr(block, "mlp_post_norm", None)
        placement = getattr(block, "placement", "pre")
        sinks = getattr(att, "sinks", None)
        layer = _Layer(
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
            q_norm=None if qk_norm is None else _norm_fn(att.q_norm),
            k_norm=None if qk_norm is None else _norm_fn(att.k_norm),
            attn_post=None if attn_post is None else _norm_fn(attn_post),
            mlp_post=None if mlp_post is None else _norm_fn(mlp_post),
            norm1=_norm_fn(norm1),
            qkv=fuse_rows([att.W_query, att.W_key, att.W_value], share_float=share),
            q=att.W_query,
            k=att.W_key,
            v=att.W_value,
            out=att.out_proj,
            norm2=_norm_fn(norm2),
            gate_up=fuse_rows([gate, up], share_float=share) if gate is not None else None,
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

    def _rows(self, share: bool) -> list[_Row] | None:
        """The layers as bare kernels when every one is a pre-norm or sandwich layer of
        RMSNorms (Llama, Mistral, Qwen2, Qwen3, SmolLM2, Gemma 3: QK-norm per head vector,
        windows, a rotary embedding per layer) with table RoPE, a gated MLP, no soft-capping
        and no parallel residual; None otherwise (the general loop)."""
        if not self.rope_tables or self.parts.positions is not None:
            return None
        H, G = self.H, self.G
        rows = []
        for layer, block in zip(self.layers, self.parts.blocks, strict=True):
            if (
                layer.placement not in ("pre", "sandwich")
                or layer.parallel
                or layer.softcap is not None
                or layer.sinks is not None
                or layer.down is None
                or layer.qk_norm not in (None, "head")
                or layer.gate is None
                or layer.rope is None
            ):
                return None
            norm1, att, norm2 = _block_parts(block)[:3]
            n1, n2 = _rms_parts(norm1), _rms_parts(norm2)
            posts = [getattr(block, name, None) for name in ("attn_post_norm", "mlp_post_norm")]
            attn_post, mlp_post = (None if n is None else _rms_parts(n) for n in posts)
            if n1 is None or n2 is None:
                return None
            if (posts[0] is None) != (attn_post is None) or (posts[1] is None) != (
                mlp_post is None
            ):
                return None  # a sandwich norm that is not an RMSNorm
            qk_norm = None
            if layer.qk_norm is not None:
                q_norm, k_norm = _rms_parts(att.q_norm), _rms_parts(att.k_norm)
                if q_norm is None or k_norm is None or q_norm[1] != k_norm[1]:
                    return None
                weight = torch.cat((q_norm[0].expand(H, -1), k_norm[0].expand(G, -1)))
                qk_norm = (weight, q_norm[1])  # (H + G, D): one product for every head
            qkv_modules = _qkv_modules(layer, share)
            qkv = _qkv_kernel(qkv_modules, (H + G) * self.D)
            gate_up_modules = (
                [layer.gate_up] if layer.gate_up is not None else [layer.gate, layer.up]
            )
            gate_up = _stacked_kernel(gate_up_modules)
            out, down = row_product(layer.out), row_product(layer.down)
            kernels = (qkv, out, gate_up, down)
            if any(k is None for k in kernels):
                return None
            dtypes = {k[0] for k in kernels if k is not None}
            if len(dtypes) != 1:
                return None
            assert qkv is not None and out is not None and gate_up is not None and down is not None
            assert layer.act is not None  # a dense MLP here
            rows.append(
                _Row(
                    n1,
                    n2,
                    attn_post,
                    mlp_post,
                    qk_norm,
                    dtypes.pop(),
                    qkv[1],
                    out[1],
                    gate_up[1],
                    down[1],
                    layer.act,
                    self.scale if layer.scale is None else float(layer.scale),
                    layer.window,
                    self.ropes.index(layer.rope),
                    (tuple(qkv_modules), (layer.out,), tuple(gate_up_modules), (layer.down,)),
                )
            )
        return rows

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
        positions up to ``length`` at least, fp32 (L, D); built once, doubled as needed."""
        rope = self.rope if rope is None else rope
        assert rope is not None
        tables = self._tables.get(rope)
        if tables is None or tables[0].shape[0] < length:
            n = max(length, 2 * (tables[0].shape[0] if tables is not None else 0), 256)
            cos, sin = rope.cos_sin(torch.arange(n, device=device))  # (L, D) fp64
            half = self.D // 2
            # rotate_half(x) * sin == roll(x, D/2) * [-sin_lo, sin_hi], bit for bit.
            sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
            tables = self._tables[rope] = (cos.float(), sin.float())
        return tables

    @torch.no_grad()
    def step(self, input_ids: torch.Tensor, kv_cache: Sequence[KVCache]) -> torch.Tensor:
        """Logits of one new token per row, appending its keys/values to ``kv_cache``.

        Args:
            input_ids: (B, 1) token ids following the cached ones.
            kv_cache: one cache per layer, all at the same length.

        Returns:
            (B, 1, V) logits.
        """
        H, G, D = self.H, self.G, self.D
        parts = self.parts
        B = input_ids.shape[0]
        pos = kv_cache[0].seq_len
        if self.rows is not None and B < _ROWS_MAX and isinstance(kv_cache[0], StaticKVCache):
            native = self.native_step()
            if native is not None:
                slots = [c.next_slot() for c in kv_cache]  # type: ignore[attr-defined]
                if all(_native_slot(t, B, G, D) for t in slots):
                    return self._step_native(native, input_ids, kv_cache, slots)  # type: ignore[arg-type]
            return self._step_rows(input_ids, kv_cache)  # type: ignore[arg-type]
        # Rows are (B, width) 2-D tensors throughout: the products go straight to mm.
        x = nn.functional.embedding(input_ids[:, 0], parts.embedding.weight)  # (B, C)
        if parts.embed_scale:  # Gemma: sqrt(C) rounded to the activation dtype first
            x = x * torch.tensor(x.shape[-1] ** 0.5, dtype=x.dtype)
        if parts.positions is not None:
            x = x + parts.positions.weight[pos]  # (B, C)
        if self.rope_tables:  # each rotary embedding's (cos, sin) at pos, (D,) each
            rotations = {}
            for rope in self.ropes:
                cos_t, sin_t = self._rope_tables(pos + 1, x.device, rope)
                rotations[rope] = cos_t[pos].to(x.dtype), sin_t[pos].to(x.dtype)
        elif self.ropes:
            positions = torch.full((1,), pos, dtype=torch.long, device=x.device)
        nq, nk = H * D, G * D
        for layer, cache in zip(self.layers, kv_cache, strict=True):
            post = layer.placement == "post"  # OLMo 2: the norms act on the outputs
            h = x if post else layer.norm1(x)  # (B, C)
            qk: torch.Tensor | None = None  # (B, H + G, D) queries and keys together
            if layer.qkv is not None:
                qkv = layer.qkv.forward(h)  # (B, (H + 2G) D)
                q_flat, k_flat, v = qkv[:, :nq], qkv[:, nq : nq + nk], qkv[:, nq + nk :]
                qk = qkv[:, : nq + nk].view(B, H + G, D)
            else:
                q_flat, k_flat, v = layer.q.forward(h), layer.k.forward(h), layer.v.forward(h)
            v = v.view(B, G, 1, D)
            if layer.q_norm is not None and layer.k_norm is not None:
                if layer.qk_norm == "all":  # OLMo 2: over the heads' concatenation
                    q_flat, k_flat = layer.q_norm(q_flat), layer.k_norm(k_flat)
                    qk = None
                else:  # Qwen3: each head vector
                    q, k = layer.q_norm(q_flat.view(B, H, D)), layer.k_norm(k_flat.view(B, G, D))
                    qk = torch.cat((q, k), dim=1)  # (B, H + G, D)
            if qk is None:
                qk = torch.cat((q_flat, k_flat), dim=-1).view(B, H + G, D)
            if layer.rope is None:
                pass
            elif self.rope_tables:
                cos, sin = rotations[layer.rope]
                qk = qk * cos + qk.roll(D // 2, dims=-1) * sin  # (B, H + G, D)
            else:
                qk = layer.rope(qk.unsqueeze(2), positions).squeeze(2)  # (B, H + G, D)
            keys, values = cache.update(qk[:, H:].unsqueeze(2), v)  # (B, G, S, D)
            if layer.window is not None and keys.shape[2] > layer.window:
                keys, values = keys[:, :, -layer.window :], values[:, :, -layer.window :]
            S = keys.shape[2]
            q = qk[:, :H].reshape(B * G, H // G, D)  # a group's queries together
            keys = keys.reshape(B * G, S, D)  # a view unless the window sliced the cache
            scale = self.scale if layer.scale is None else layer.scale
            scores = torch.bmm(q, keys.transpose(1, 2)).mul_(scale)  # (B G, H/G, S)
            if layer.softcap is not None:  # Gemma 2, as attnlab.backends.base.softcap_scores
                scores = scores.div_(layer.softcap).tanh_().mul_(layer.softcap)
            if layer.sinks is not None:  # one more softmax column with no value, dropped
                sink = layer.sinks.to(scores.dtype).repeat(B, 1, 1)  # (B G, H/G, 1)
                weights = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :S]
            else:
                weights = torch.softmax(scores, dim=-1)
            o = torch.bmm(weights, values.reshape(B * G, S, D)).view(B, H * D)  # (B, C)
            a = layer.out.forward(o)  # (B, C)
            if post:
                a = layer.norm1(a)
            elif layer.attn_post is not None:
                a = layer.attn_post(a)
            if layer.parallel:  # GPT-NeoX: the MLP reads the block's input too
                h, x = layer.norm2(x), x + a  # (B, C)
            else:
                x = x + a  # (B, C)
                h = x if post else layer.norm2(x)
            if layer.down is None or layer.act is None:  # a mixture of experts, routed per row
                m = layer.up(h)  # (B, C)
            else:
                if layer.gate_up is not None:
                    gate, up = layer.gate_up.forward(h).chunk(2, dim=-1)  # (B, F) each
                    m = layer.act(gate) * up  # (B, F)
                elif layer.gate is not None:
                    m = layer.act(layer.gate.forward(h)) * layer.up.forward(h)
                else:
                    m = layer.act(layer.up.forward(h))
                m = layer.down.forward(m)  # (B, C)
            if post:
                m = layer.norm2(m)
            elif layer.mlp_post is not None:
                m = layer.mlp_post(m)
            x = x + m  # (B, C)
        return parts.head(self.final_norm(x).unsqueeze(1))  # (B, 1, V)

    def native_step(self) -> Any | None:
        """The compiled step (:mod:`attnlab.native`) over :attr:`rows`' kernels, built on
        the first call; None when a layer has a kernel or activation it does not call, the
        model's rows are not float32, or the module is unavailable
        (:func:`attnlab.native.why_not_native`): :meth:`step` then runs the Python loop."""
        if self._native is None:
            self._native = self._build_native() or False
        return self._native or None

    def _build_native(self) -> Any | None:
        if self.rows is None or self.parts.embedding.weight.dtype != torch.float32:
            return None
        ext = native.extension()
        if ext is None:
            return None
        acts = {id(ACTIVATIONS[name]): i for i, name in enumerate(_NATIVE_ACTIVATIONS)}
        first = self.rows[0].modules
        F = sum(m.out_features for m in first[2]) // 2
        C = self.parts.embedding.weight.shape[1]
        step = ext.Step(C, self.H, self.G, self.D, F)
        for row in self.rows:
            slots = [[native_product(m) for m in slot] for slot in row.modules]
            if id(row.act) not in acts or any(p is None for slot in slots for p in slot):
                return None
            step.add_layer(
                row.norm1,
                row.norm2,
                row.attn_post,
                row.mlp_post,
                row.qk_norm,
                row.dtype,
                *slots,
                acts[id(row.act)],
                row.scale,
                row.window or 0,
                row.rope,
            )
        return step

    def _step_native(
        self,
        native: Any,
        input_ids: torch.Tensor,
        kv_cache: Sequence[StaticKVCache],
        slots: Sequence[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """:meth:`step` by the compiled short loop: the embedding, the rotations at this
        position and the head here, the layers there (writing the caches' next slot)."""
        parts = self.parts
        pos = kv_cache[0].seq_len
        x = nn.functional.embedding(input_ids[:, 0], parts.embedding.weight)  # (B, C)
        if parts.embed_scale:  # Gemma: sqrt(C) rounded to the activation dtype first
            x = x * torch.tensor(x.shape[-1] ** 0.5, dtype=x.dtype)
        rotations = []
        for rope in self.ropes:
            cos_t, sin_t = self._rope_tables(pos + 1, x.device, rope)
            rotations.append((cos_t[pos], sin_t[pos]))  # (D,) each
        x = native.run(x, pos, rotations, [t for pair in slots for t in pair])  # (B, C)
        for cache in kv_cache:
            cache.advance()
        return parts.head(self.final_norm(x).unsqueeze(1))  # (B, 1, V)

    def _rotation(
        self, pos: int, like: torch.Tensor, rope: RotaryEmbedding | None = None
    ) -> torch.Tensor:
        """RoPE at ``pos`` as a (D, D) matrix in ``like``'s dtype:
        ``x @ R == x * cos + roll(x, D/2) * sin`` (two nonzeros a column: the product's
        sums add exact zeros), one product for all heads instead of four operations."""
        cos_t, sin_t = self._rope_tables(pos + 1, like.device, rope)
        D = self.D
        cols = torch.arange(D, device=like.device)
        r = torch.diag(cos_t[pos])  # (D, D)
        r[(cols + D // 2) % D, cols] = sin_t[pos]
        return r.to(like.dtype)

    def _step_rows(
        self, input_ids: torch.Tensor, kv_cache: Sequence[StaticKVCache]
    ) -> torch.Tensor:
        """:meth:`step` for :attr:`rows`: the kernels called bare, rows kept in the kernels'
        dtype between them, QK-norm of every head as one call, RoPE as one product, the
        cache written by :meth:`StaticKVCache.append` (SmolLM2: 45 tensor operations a
        layer, against 70)."""
        H, G, D = self.H, self.G, self.D
        parts = self.parts
        B = input_ids.shape[0]
        pos = kv_cache[0].seq_len
        x = nn.functional.embedding(input_ids[:, 0], parts.embedding.weight)  # (B, C)
        if parts.embed_scale:  # Gemma: sqrt(C) rounded to the activation dtype first
            x = x * torch.tensor(x.shape[-1] ** 0.5, dtype=x.dtype)
        f32 = x.dtype
        rots = [self._rotation(pos, x, rope) for rope in self.ropes]  # (D, D) each
        # Inference mode spares each operation its version counter and view tracking
        # (a few percent of the step: bench_decode_step.py). Only once the caches hold
        # the prompt: then no buffer is allocated in it (an inference tensor could not be
        # written outside it by a later prefill); the tables are built before it.
        # (``inference_mode(False)`` would turn gradients back on: nullcontext instead.)
        with torch.inference_mode() if pos > 0 else contextlib.nullcontext():
            for row, cache in zip(self.rows or (), kv_cache, strict=True):
                qk, v = row.qkv(_rms(x, *row.norm1).to(row.dtype))  # (B, (H+G) D), (B, G D)
                qk = qk.to(f32)
                if row.qk_norm is not None:  # each head vector, q's weight or k's
                    qk = _rms(qk.view(B, H + G, D), *row.qk_norm)
                # RoPE on queries and keys together, as one product (fp32, as the modules).
                qk = torch.mm(qk.reshape(-1, D), rots[row.rope]).view(B, H + G, D)
                keys, values = cache.append(qk[:, H:], v.view(B, G, D))  # (B, G, S, D)
                if row.window is not None and keys.shape[2] > row.window:
                    keys, values = keys[:, :, -row.window :], values[:, :, -row.window :]
                # One fused call over the cache's views, the groups shared by their heads
                # (a few percent faster than the general loop's two batched products).
                o = nn.functional.scaled_dot_product_attention(
                    qk[:, :H].unsqueeze(2), keys, values, scale=row.scale, enable_gqa=True
                ).view(B, H * D)  # (B, C)
                a = row.out(o.to(row.dtype))  # (B, C)
                if row.attn_post is not None:
                    a = _rms(a.to(f32), *row.attn_post)
                x = x + a  # (B, C)
                gate, up = row.gate_up(_rms(x, *row.norm2).to(row.dtype)).to(f32).chunk(2, dim=-1)
                m = row.down((row.act(gate) * up).to(row.dtype))  # (B, C)
                if row.mlp_post is not None:
                    m = _rms(m.to(f32), *row.mlp_post)
                x = x + m  # (B, C)
        return parts.head(self.final_norm(x).unsqueeze(1))  # (B, 1, V)


# attnlab/native/decode_step.cpp's activations, by their index there.
_NATIVE_ACTIVATIONS = ("silu", "gelu_tanh", "gelu", "relu")


def _native_slot(slot: tuple[torch.Tensor, torch.Tensor] | None, B: int, G: int, D: int) -> bool:
    """Whether the native step can write a cache's next position: float32 contiguous
    (B, G, max_len, D) keys and values."""
    if slot is None:
        return False
    return all(
        t.dtype == torch.float32 and t.is_contiguous() and t.shape[:2] == (B, G) and t.shape[3] == D
        for t in slot
    )


# The bare kernels are the int layers' few-row ones (Int4Linear.dense_from_rows and
# Int8Linear's are larger); more rows per step than this take the modules' products.
_ROWS_MAX = 16


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """attnlab.norms.RMSNorm's numbers for fp32 rows (B, C), without its dtype round trip
    (``torch.rms_norm`` is no faster here: on the CPU it dispatches a dozen operations)."""
    return weight * (x * torch.rsqrt(x.square().mean(-1, keepdim=True).add_(eps)))


def _stacked_kernel(linears: Sequence[Any]) -> tuple[torch.dtype, Any] | None:
    """(dtype, fn): the bare products of ``linears`` (one input) side by side, as one
    product when ``linears`` is one module; None when a kernel is missing or they take
    different dtypes."""
    found = [row_product(m) for m in linears]
    if any(f is None for f in found) or len({f[0] for f in found if f is not None}) != 1:
        return None
    kernels = [f[1] for f in found if f is not None]
    if len(kernels) == 1:
        return found[0]
    return found[0][0], lambda x: torch.cat([k(x) for k in kernels], dim=-1)  # type: ignore[index]


def _qkv_modules(layer: _Layer, share: bool) -> list[Any]:
    """The products of queries, keys and values, outputs side by side: the fused one;
    else queries and keys fused when they can be (a GGUF file's Q and K often share a type
    that V does not: Gemma 3's Q4_K_M) and values; else all three."""
    if layer.qkv is not None:
        return [layer.qkv]
    qk = fuse_rows([layer.q, layer.k], share_float=share)
    return [qk, layer.v] if qk is not None else [layer.q, layer.k, layer.v]


def _qkv_kernel(modules: Sequence[Any], nqk: int) -> tuple[torch.dtype, Any] | None:
    """(dtype, fn): ``fn(h)`` gives queries and keys side by side (B, (H + G) D) and values
    (B, G D), from :func:`_qkv_modules`' products."""
    if len(modules) == 1:
        found = row_product(modules[0])
        if found is None:
            return None
        kernel = found[1]

        def fused(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y = kernel(x)  # (B, (H + 2G) D)
            return y[:, :nqk], y[:, nqk:]

        return found[0], fused
    found_qk = _stacked_kernel(modules[:-1])
    found_v = row_product(modules[-1])
    if found_qk is None or found_v is None or found_qk[0] != found_v[0]:
        return None
    qk_kernel, v_kernel = found_qk[1], found_v[1]
    return found_v[0], lambda x: (qk_kernel(x), v_kernel(x))


def takes_fast_step(
    model: Any, input_ids: torch.Tensor, kv_cache: Any, need_weights: bool = False
) -> bool:
    """Whether ``model(input_ids, kv_cache=...)`` may take :meth:`DecodePlan.step`.

    One new token per row, every layer's cache a :class:`StaticKVCache`, eval mode, no
    gradients, no weights asked for or recorded (:func:`attnlab.attention.record_attention`;
    a layer's ``capture`` is checked by :meth:`DecodePlan.capturing`), no block hook point
    in use (:func:`attnlab.models._lm.editing_blocks`). A PyTorch forward hook or pre-hook
    on a module the step would skip is checked by :meth:`DecodePlan.hooked` (from the
    plan's list of the modules' hook tables, a few microseconds), so that a user's
    ``register_forward_hook`` keeps firing while :func:`attnlab.generation.generate`
    decodes.
    """
    if input_ids.shape[1] != 1 or need_weights or not kv_cache or model.training:
        return False
    if torch.is_grad_enabled() or recording_attention() or editing_blocks():
        return False
    return all(isinstance(c, StaticKVCache) for c in kv_cache)


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


def new_caches(n_layers: int, max_len: int | None) -> list[KVCache]:
    """The causal-LM protocol's ``new_kv_cache(max_len)``: growing caches for None,
    :class:`StaticKVCache` s of ``max_len`` positions (the fast step's) otherwise."""
    if max_len is None:
        return [KVCache() for _ in range(n_layers)]
    return [StaticKVCache(max_len) for _ in range(n_layers)]


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

    def invalidate_decode_plan(self) -> None:
        """Drop the plan: it holds the layers as they were; the next step builds it again."""
        with _PLAN_LOCK:
            self._decode_plan = None


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
