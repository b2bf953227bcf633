"""The one decoder's options and what it trades in: :class:`DecoderConfig` (the sizes
and the choices real decoders differ in), each layer's options, the layer cache with the
cross-attention cache beside it, and what a pass through the stack returns; the decoder
itself is :class:`attnlab.models.decoder.Decoder`. The options real decoders differ in:

- ``norm``: ``"rms"`` (RMSNorm, computed in fp32) or ``"layer"`` (LayerNorm, ``norm_bias``);
- ``norm_placement``: ``"pre"`` ``x + f(norm(x))`` (Llama, GPT-2), ``"post"``
  ``x + norm(f(x))`` (OLMo 2) or ``"sandwich"`` ``x + norm2(f(norm1(x)))`` (Gemma 2);
- ``mlp``: ``"gated"`` ``down(act(gate(h)) * up(h))`` (SwiGLU) or ``"plain"``
  ``down(act(up(h)))`` (GPT-2), with ``activation`` and ``mlp_bias``;
- ``parallel_residual``: ``x + attn(norm1(x)) + mlp(norm2(x))`` (GPT-NeoX) instead of
  the sequential form;
- ``positions``: ``"alibi"`` (BLOOM: the bias of :class:`attnlab.biases.AlibiBias` on every
  layer's scores), ``"rope"`` (:class:`attnlab.rope.RotaryEmbedding` configured by a
  :class:`attnlab.rope.RopeConfig`: base, partial rotary, scaling) or ``"learned"`` (an
  absolute position table, GPT-2) or ``"relative"`` (T5: one
  :class:`attnlab.biases.RelativePositionBias` table per stack, ``relative_buckets`` x
  heads, shared by every layer; bidirectional bucketing when not ``causal``);
- ``causal``: False makes the stack bidirectional (T5's encoder is this stack with
  ``causal=False`` and ``output_head=False``: its blocks are pre-norm like Llama's, not
  BERT's post-LN); ``valid`` then masks padded keys;
- ``cross_attention``: each block attends to a ``context`` (the encoder output) between
  self-attention and the MLP, pre-norm (T5's decoder); its keys/values are cached once;
- ``output_head`` / ``head_input_scale``: no LM head (an encoder stack), or the final
  hidden state scaled before the head (T5 with tied embeddings: ``d_model**-0.5``);
- attention: query/key/value heads, ``head_dim`` (when ``H * D != C``), ``qkv_bias`` /
  ``out_bias``, ``qk_norm`` (:class:`attnlab.norms.QKNorm`), ``sliding_window`` (Mistral's
  convention: a query sees itself and the ``window - 1`` keys before it; the layer keeps a
  rolling KV cache of that many positions);
- ``mla``: multi-head latent attention (:class:`attnlab.latent.LatentAttention`, DeepSeek)
  instead of per-head key/value projections; the cache holds the latent;
- ``tie_embeddings``: the output projection is the token embedding.

Shape legend: B batch, T new tokens, S keys, C width, H query heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from torch import nn

from attnlab.attention import KVCache
from attnlab.latent import MLAConfig
from attnlab.models.mlp import Activation
from attnlab.models.moe import MoEConfig
from attnlab.norms import QKNorm, RMSNorm
from attnlab.rope import RopeConfig

__all__ = [
    "Activation",
    "DecoderConfig",
    "DecoderLayerCache",
    "LayerOptions",
    "StackOutput",
    "make_norm",
]


class LayerOptions(NamedTuple):
    """One layer's options (:meth:`DecoderConfig.per_layer`)."""

    window: int | None  # keys a query sees, itself included; None = all
    scale: float | None  # the score scale; None = the model's
    rope: RopeConfig | None  # this layer's rotary settings; None = the model's
    rotary: bool  # whether the layer rotates queries and keys (False: NoPE)
    chunk: int | None  # chunked local attention's chunk length, or None
    qk_norm: bool  # whether the layer applies the model's QK-norm
    moe: bool  # the mixture of experts instead of the dense MLP


@dataclass(frozen=True)
class DecoderConfig:
    """Sizes and architecture options of a decoder (defaults: SmolLM2-135M, a Llama).

    Attributes:
        vocab_size: V.
        hidden_size: model width C.
        num_layers: decoder blocks.
        num_heads: query heads H.
        num_kv_heads: key/value heads G (H % G == 0).
        intermediate_size: feed-forward width F.
        context_length: longest sequence the model accepts.
        norm_eps: epsilon of every norm.
        tie_embeddings: output projection shares the token embedding's weight.
        norm: ``"rms"`` or ``"layer"``.
        norm_bias: LayerNorms have a bias.
        norm_placement: ``"pre"``, ``"post"`` or ``"sandwich"`` (module docstring).
        mlp: ``"gated"`` or ``"plain"``.
        activation: ``"silu"``, ``"gelu"``, ``"gelu_tanh"`` or ``"relu"``.
        mlp_bias: biases in the feed-forward projections.
        parallel_residual: attention and MLP read the same input and add together.
        parallel_shared_norm: in the parallel form, the MLP reads the attention's normed
            input (one norm per block: StableLM 2, GPT-J) rather than its own norm.
        positions: ``"rope"``, ``"learned"`` or ``"alibi"`` (:class:`attnlab.biases.AlibiBias`
            with the standard slopes, BLOOM) or ``"relative"`` (T5).
        rope: the rotary embedding's settings (base, partial rotary, scaling).
        head_dim: D when ``H * D != C`` (Qwen3, Gemma); None = C / H.
        qk_norm: normalisation of queries and keys (Qwen3, OLMo 2), or None.
        layer_windows: a window (or None) per layer, overriding ``sliding_window``
            (Gemma 2's alternating local and global layers).
        layer_ropes: a rotary embedding's settings per layer, None = ``rope`` (Gemma 3's
            local layers rotate with their own base).
        layer_rotary: whether each layer rotates its queries and keys; a layer that does
            not has no position signal but the causal mask (SmolLM3's and Llama 4's NoPE
            layers). None = every layer rotates.
        layer_chunks: a chunk length (or None) per layer: chunked local attention, each
            query sees its own chunk causally (Llama 4's rotary layers); None = no chunks.
        layer_qk_norm: whether each layer applies ``qk_norm`` (Llama 4: its rotary layers
            only); None = every layer.
        attn_sinks: every layer's attention has a learned sink logit per head that joins
            each softmax row (gpt-oss), the ``sinks`` of :class:`attnlab.attention.Attention`.
        attn_temperature: ``(floor_scale, scale)`` of Llama 4's attention temperature
            tuning, applied on the layers that do not rotate (``layer_rotary``), or None.
        moe: the mixture-of-experts feed-forward (:class:`attnlab.models.moe.MoEConfig`) of
            the layers ``layer_moe`` names, or None (every layer dense).
        layer_moe: whether each layer's feed-forward is the mixture of experts (the others:
            the dense MLP of ``intermediate_size``); None = every layer when ``moe`` is set.
        mla: multi-head latent attention's sizes (:class:`attnlab.latent.MLAConfig`,
            DeepSeek-V2/V3, Kimi K2) on every layer, or None (per-head projections).
            ``head_dim`` is then ``qk_nope_head_dim + qk_rope_head_dim`` and the rotary
            embedding turns the ``qk_rope_head_dim`` dims; ``qkv_bias`` puts biases on the
            down-projections.
        attn_scale: the score scale (Gemma 2: ``query_pre_attn_scalar ** -0.5``); None =
            ``1/sqrt(D)``.
        layer_scales: a score scale per layer, overriding ``attn_scale`` (GPT-2's
            ``scale_attn_by_inverse_layer_idx``: layer i's ``1/(sqrt(D) (i + 1))``).
        attn_softcap: attention logit soft-capping (Gemma 2: 50), or None.
        final_softcap: output logit soft-capping ``c * tanh(logits / c)`` (Gemma 2: 30).
        embed_scale: multiply the token embeddings by ``sqrt(C)`` (Gemma).
        embed_multiplier: multiply the token embeddings by it (Granite's
            ``embedding_multiplier``).
        residual_multiplier: each block adds its attention and MLP outputs scaled by it
            (Granite).
        logits_scaling: the logits are divided by it (Granite), before any soft-capping.
        embed_norm: a norm right after the token embedding (BLOOM).
        qkv_bias: biases on the query/key/value projections.
        out_bias: bias on the attention output projection.
        sliding_window: each query sees at most this many keys (itself included); None = all.
        relative_buckets: T5 relative-position buckets (``positions="relative"``).
        relative_max_distance: distance from which all positions share the last bucket.
        causal: causal self-attention (False: bidirectional, an encoder stack).
        cross_attention: blocks attend to a ``context`` too (an encoder-decoder's decoder).
        output_head: end in an LM head (False: return hidden states, an encoder stack).
        head_input_scale: the final hidden state is multiplied by it before the head.
        family: the family name this config came from (for messages and ``info``).
    """

    vocab_size: int = 49152
    hidden_size: int = 576
    num_layers: int = 30
    num_heads: int = 9
    num_kv_heads: int = 3
    intermediate_size: int = 1536
    context_length: int = 8192
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    norm: Literal["rms", "layer"] = "rms"
    norm_bias: bool = False
    norm_placement: Literal["pre", "post", "sandwich"] = "pre"
    mlp: Literal["gated", "plain"] = "gated"
    activation: Activation = "silu"
    mlp_bias: bool = False
    parallel_residual: bool = False
    parallel_shared_norm: bool = False
    positions: Literal["rope", "learned", "alibi", "relative"] = "rope"
    rope: RopeConfig = RopeConfig(base=100000.0)  # noqa: RUF009 (frozen, shared safely)
    head_dim: int | None = None
    qkv_bias: bool = False
    out_bias: bool = False
    qk_norm: QKNorm | None = None
    sliding_window: int | None = None
    layer_windows: tuple[int | None, ...] | None = None
    layer_ropes: tuple[RopeConfig | None, ...] | None = None
    layer_rotary: tuple[bool, ...] | None = None
    layer_chunks: tuple[int | None, ...] | None = None
    layer_qk_norm: tuple[bool, ...] | None = None
    attn_temperature: tuple[float, float] | None = None
    attn_sinks: bool = False
    moe: MoEConfig | None = None
    layer_moe: tuple[bool, ...] | None = None
    mla: MLAConfig | None = None
    attn_scale: float | None = None
    layer_scales: tuple[float, ...] | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    embed_scale: bool = False
    embed_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    relative_buckets: int = 32
    relative_max_distance: int = 128
    causal: bool = True
    cross_attention: bool = False
    output_head: bool = True
    head_input_scale: float = 1.0
    embed_norm: bool = False
    family: str = "llama"

    @property
    def attention_head_dim(self) -> int:
        """D: ``head_dim``, or C / H when it is not set."""
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def rotary_head_dim(self) -> int:
        """The dims per head the rotary embedding is built for: ``qk_rope_head_dim`` with
        latent attention, else D."""
        return self.mla.qk_rope_head_dim if self.mla is not None else self.attention_head_dim

    def check_layout(self) -> None:
        """Check the options that must agree with each other (the decoder's constructor
        calls it).

        Raises:
            ValueError: ``hidden_size`` not divisible by ``num_heads`` without a
                ``head_dim``, cross attention in a layout other than T5's, latent
                attention with windows, chunks or other positions.
        """
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"`hidden_size` ({self.hidden_size}) must be divisible by `num_heads` "
                f"({self.num_heads})"
            )
        if self.cross_attention and (self.norm_placement != "pre" or self.parallel_residual):
            raise ValueError(
                "`cross_attention` needs norm_placement='pre' and parallel_residual=False "
                f"(T5's layout), got {self.norm_placement!r}, {self.parallel_residual}"
            )
        if self.mla is not None and (
            self.positions != "rope"
            or self.cross_attention
            or self.sliding_window is not None
            or self.layer_windows is not None
            or self.layer_chunks is not None
            or self.layer_rotary is not None
        ):
            raise ValueError(
                "`mla` (latent attention) needs positions='rope' on every layer, without "
                "cross attention, windows or chunks"
            )

    def per_layer(self) -> list[LayerOptions]:
        """Each layer's options, the ``layer_*`` tuples or the model-wide settings.

        Raises:
            ValueError: a ``layer_*`` tuple without one entry per layer, ``layer_moe``
                without ``moe``.
        """
        n = self.num_layers
        if self.layer_moe is not None and self.moe is None:
            raise ValueError("`layer_moe` needs `moe` (the experts' configuration)")
        columns = {
            "layer_windows": self.layer_windows or (self.sliding_window,) * n,
            "layer_scales": self.layer_scales or (None,) * n,
            "layer_ropes": self.layer_ropes or (None,) * n,
            "layer_rotary": self.layer_rotary or (True,) * n,
            "layer_chunks": self.layer_chunks or (None,) * n,
            "layer_qk_norm": self.layer_qk_norm or (True,) * n,
            "layer_moe": self.layer_moe or (self.moe is not None,) * n,
        }
        for name, values in columns.items():
            if len(values) != n:
                raise ValueError(f"`{name}` must have one entry per layer ({n}), got {len(values)}")
        return [LayerOptions(*row) for row in zip(*columns.values(), strict=True)]


def make_norm(config: DecoderConfig) -> nn.Module:
    """The config's norm over width C."""
    if config.norm == "rms":
        return RMSNorm(config.hidden_size, config.norm_eps)
    return nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)


class DecoderLayerCache(KVCache):
    """A layer's self-attention cache, with the cross-attention cache beside it.

    It is the self-attention :class:`KVCache` (``seq_len`` counts decoded tokens) and
    holds :attr:`cross`, filled with the context's keys/values on the first step and reused
    after (an encoder-decoder's decoder projects the encoder output once per sequence).
    """

    def __init__(self) -> None:
        super().__init__()
        self.cross = KVCache()

    def reset(self) -> None:
        """Forget everything cached, the cross-attention keys/values too."""
        super().reset()
        self.cross.reset()


@dataclass(frozen=True)
class StackOutput:
    """What one pass through the block stack computed.

    Attributes:
        hidden: the final-normed hidden states ``(B, T, C)``.
        weights: each layer's self-attention weights ``(B, H, T, S)`` (when asked).
        cross_weights: each layer's cross-attention weights ``(B, H, T, S_ctx)`` (when
            asked and the blocks have cross attention).
    """

    hidden: torch.Tensor
    weights: list[torch.Tensor]
    cross_weights: list[torch.Tensor]
