"""The one decoder: every causal-LM family (Llama, Mistral, Qwen2, GPT-2, ...) on attnlab's
attention, configured by a :class:`DecoderConfig`.

A family does not get its own module: it is a description
(:class:`attnlab.models.families.Family`) that turns a checkpoint's config into a
:class:`DecoderConfig` (:mod:`attnlab.models.decoder_config`: the options real decoders
differ in) and names its weights.

The model follows attnlab's causal-LM protocol: ``model(input_ids, kv_cache=...)``
returns logits, ``model.new_kv_cache()`` gives one :class:`KVCache` per layer,
``model.context_length`` bounds the window. One new token per row over static caches is
handed to the one-token decode step (:meth:`Decoder.forward`; ``model.decode_path()`` says
which loop and why).

Shape legend: B batch, T new tokens, S keys (cached + new), C width, V vocabulary,
H query heads, G key/value heads, D head dim, F feed-forward width.
"""

from __future__ import annotations

import torch
from torch import nn

from attnlab.attention import Attention, KVCache
from attnlab.backends.base import softcap_scores
from attnlab.biases import AlibiBias, RelativePositionBias
from attnlab.latent import LatentAttention
from attnlab.masks import AttentionMask, PaddingMask
from attnlab.models._lm import (
    block_input,
    embed_scaled,
    first_block,
    keep_last,
    mlp_output,
    residual_after_block,
    set_attention_backend,
)
from attnlab.models.decoder_config import (  # re-exported from their former home
    Activation,  # noqa: F401
    DecoderConfig,
    DecoderLayerCache,
    StackOutput,
    make_norm,
)
from attnlab.models.fast_decode import (
    DecodePlan,
    FastDecoding,
    decode_plan,
    fast_step,
    new_caches,
)
from attnlab.models.mlp import ACTIVATIONS, MLP
from attnlab.models.moe import MixtureOfExperts
from attnlab.norms import RMSNorm
from attnlab.rope import RopeConfig, RotaryEmbedding

__all__ = [
    "ACTIVATIONS",
    "MLP",
    "Decoder",
    "DecoderBlock",
    "DecoderConfig",
    "DecoderLayerCache",
    "RMSNorm",
    "StackOutput",
    "make_norm",
]


def _latent_attention(
    config: DecoderConfig, rope: RotaryEmbedding | None, backend: str, scale: float | None
) -> LatentAttention | None:
    """The block's latent attention when the config asks for it (``mla``), else None."""
    if config.mla is None:
        return None
    assert rope is not None  # Decoder checks: MLA rotates on every layer
    return LatentAttention(
        config.hidden_size,
        config.num_heads,
        config.mla,
        rope=rope,
        backend=backend,
        scale=scale,
        bias=config.qkv_bias,
    )


class DecoderBlock(nn.Module):
    """One decoder block (norm placement and residual style from the config).

    Args:
        config: the sizes and options.
        rope: the rotary embedding shared by all layers, or None.
        backend: attnlab attention backend.
    """

    def __init__(
        self,
        config: DecoderConfig,
        rope: RotaryEmbedding | None,
        *,
        backend: str,
        window: int | None = None,
        scale: float | None = None,
        chunk: int | None = None,
        qk_norm: bool = True,
        moe: bool = False,
    ) -> None:
        super().__init__()
        C = config.hidden_size
        scale = config.attn_scale if scale is None else scale
        self.placement = config.norm_placement
        self.parallel = config.parallel_residual
        self.residual_multiplier = config.residual_multiplier
        self.causal = config.causal
        self.attn_norm = make_norm(config)
        self.attention: Attention = _latent_attention(config, rope, backend, scale) or Attention(
            C,
            config.num_heads,
            num_kv_heads=config.num_kv_heads,
            bias=config.qkv_bias,
            out_bias=config.out_bias,
            rope=rope,
            backend=backend,
            head_dim=config.head_dim,
            qk_norm=config.qk_norm if qk_norm else None,
            sliding_window=window,
            scale=scale,
            softcap=config.attn_softcap,
            attention_chunk=chunk,
            temperature=config.attn_temperature if rope is None else None,  # NoPE layers
            sinks=config.attn_sinks or None,
        )
        if config.cross_attention:  # between self-attention and the MLP, pre-norm (T5)
            self.cross_norm: nn.Module | None = make_norm(config)
            self.cross_attention: Attention | None = Attention(
                C,
                config.num_heads,
                num_kv_heads=config.num_kv_heads,
                bias=config.qkv_bias,
                out_bias=config.out_bias,
                backend=backend,
                head_dim=config.head_dim,
                scale=config.attn_scale,
                softcap=config.attn_softcap,
            )
        else:
            self.cross_norm = self.cross_attention = None
        self.shared_norm = config.parallel_residual and config.parallel_shared_norm
        self.mlp_norm: nn.Module | None = None if self.shared_norm else make_norm(config)
        self.mlp: MLP | MixtureOfExperts
        if moe and config.moe is not None:
            self.mlp = MixtureOfExperts(C, config.moe, activation=config.activation)
        else:
            self.mlp = MLP(
                C,
                config.intermediate_size,
                gated=config.mlp == "gated",
                activation=config.activation,
                bias=config.mlp_bias,
            )
        if self.placement == "sandwich":
            self.attn_post_norm: nn.Module | None = make_norm(config)
            self.mlp_post_norm: nn.Module | None = make_norm(config)
        else:
            self.attn_post_norm = self.mlp_post_norm = None

    def _attend(
        self,
        h: torch.Tensor,
        kv_cache: KVCache | None,
        need_weights: bool,
        bias: AttentionMask | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # One new token (decoding) is the last position: it may see every key, so the
        # causal mask is all True and is left out (fused kernels then need no mask). The
        # layer adds its own sliding window.
        causal = self.causal and h.shape[1] > 1
        kw = {"attn_mask": bias, "is_causal": causal, "kv_cache": kv_cache}
        if need_weights:
            a, w = self.attention(h, need_weights=True, **kw)
            return a, w
        out = self.attention(h, **kw)
        return out, None  # type: ignore[return-value]

    def _cross(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None,
        context_mask: AttentionMask | None,
        kv_cache: KVCache | None,
        need_weights: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.cross_attention is None or self.cross_norm is None:
            return x, None
        if context is None:
            raise ValueError(
                "this decoder has cross attention: pass `context` (the encoder output)"
            )
        cache = kv_cache.cross if isinstance(kv_cache, DecoderLayerCache) else None
        h = self.cross_norm(x)
        if need_weights:
            c, w = self.cross_attention(
                h, context, attn_mask=context_mask, kv_cache=cache, need_weights=True
            )
            return x + c, w  # (B, T, C)
        c = self.cross_attention(h, context, attn_mask=context_mask, kv_cache=cache)
        return x + c, None  # type: ignore[operator]

    def forward(
        self,
        x: torch.Tensor,
        kv_cache: KVCache | None,
        *,
        need_weights: bool = False,
        bias: AttentionMask | None = None,
        context: torch.Tensor | None = None,
        context_mask: AttentionMask | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(B, T, C) -> ((B, T, C), self weights (B, H, T, S) or None, cross weights
        (B, H, T, S_ctx) or None).

        ``bias`` (ALiBi, a relative position bias, padding) is added to the
        self-attention's own causal or window mask; ``context``/``context_mask`` feed the
        cross attention.
        """
        r = self.residual_multiplier
        if self.placement == "post":
            a, weights = self._attend(x, kv_cache, need_weights, bias)
            x = x + self.attn_norm(a) * r if r != 1.0 else x + self.attn_norm(a)  # (B, T, C)
            m = mlp_output(self, self.mlp_norm(self.mlp(x)))  # type: ignore[misc]
            return (x + m * r if r != 1.0 else x + m), weights, None
        normed = self.attn_norm(x)
        a, weights = self._attend(normed, kv_cache, need_weights, bias)
        if self.attn_post_norm is not None:
            a = self.attn_post_norm(a)
        h = None
        if self.parallel:  # both read x (through one norm when shared)
            h = normed if self.mlp_norm is None else self.mlp_norm(x)
        x = x + a * r if r != 1.0 else x + a  # (B, T, C)
        cross_weights = None
        if h is None:
            x, cross_weights = self._cross(x, context, context_mask, kv_cache, need_weights)
            h = self.mlp_norm(x)  # type: ignore[misc]
        m = self.mlp(h)
        if self.mlp_post_norm is not None:
            m = self.mlp_post_norm(m)
        m = mlp_output(self, m)
        return (x + m * r if r != 1.0 else x + m), weights, cross_weights  # (B, T, C)


class Decoder(nn.Module, FastDecoding):
    """A decoder-only language model, any family, configured by ``config``.

    With ``causal=False`` and ``output_head=False`` the same stack is a pre-norm encoder,
    and with ``cross_attention`` it is an encoder-decoder's decoder
    (:class:`attnlab.models.encoder_decoder.EncoderDecoder` holds both).

    Args:
        config: the sizes and options.
        backend: attnlab attention backend for every layer.

    Raises:
        ValueError: ``hidden_size`` not divisible by ``num_heads``, or options this
            decoder does not know.
    """

    # what a loader left out of the file it built this model from, one line each (DeepSeek-
    # V3's multi-token-prediction layer): shown by `attnlab info` and on loading
    load_notes: tuple[str, ...] = ()

    def __init__(self, config: DecoderConfig, *, backend: str = "auto") -> None:
        super().__init__()
        if config.activation not in ACTIVATIONS:
            raise ValueError(
                f"`activation` must be one of {sorted(ACTIVATIONS)}, got {config.activation!r}"
            )
        config.check_layout()
        per_layer = config.per_layer()
        self.config = config
        C = config.hidden_size
        self.rope = (
            RotaryEmbedding.from_config(config.rotary_head_dim, config.rope)
            if config.positions == "rope"
            else None
        )
        self.tok_embeddings = nn.Embedding(config.vocab_size, C)
        self.embed_norm = make_norm(config) if config.embed_norm else None
        self.alibi = AlibiBias(config.num_heads) if config.positions == "alibi" else None
        self.pos_embeddings = (
            nn.Embedding(config.context_length, C) if config.positions == "learned" else None
        )
        # One embedding per distinct setting, shared by the layers that use it.
        embeddings: dict[RopeConfig, RotaryEmbedding] = {}
        if self.rope is not None:
            embeddings[config.rope] = self.rope

        def layer_rope(settings: RopeConfig | None, rotates: bool) -> RotaryEmbedding | None:
            if not rotates:
                return None
            if settings is None or self.rope is None:
                return self.rope
            if settings not in embeddings:
                embeddings[settings] = RotaryEmbedding.from_config(config.rotary_head_dim, settings)
            return embeddings[settings]

        self.blocks = nn.ModuleList(
            DecoderBlock(
                config,
                layer_rope(layer.rope, layer.rotary),
                backend=backend,
                window=layer.window,
                scale=layer.scale,
                chunk=layer.chunk,
                qk_norm=layer.qk_norm,
                moe=layer.moe,
            )
            for layer in per_layer
        )
        # T5: one table per stack (its first layer's in the checkpoint), shared by all layers.
        self.relative_bias = (
            nn.Embedding(config.relative_buckets, config.num_heads)
            if config.positions == "relative"
            else None
        )
        self.norm = make_norm(config)
        if config.output_head:
            self.lm_head: nn.Linear | None = nn.Linear(C, config.vocab_size, bias=False)
            if config.tie_embeddings:
                self.lm_head.weight = self.tok_embeddings.weight
        else:
            self.lm_head = None

    @property
    def context_length(self) -> int:
        """Longest window the model accepts (the protocol's ``context_length``)."""
        return self.config.context_length

    def new_kv_cache(self, max_len: int | None = None) -> list[KVCache]:
        """An empty cache, one per layer (a rolling one for sliding-window layers).

        Args:
            max_len: None for growing caches (a rolling one for a sliding-window layer; a
                :class:`DecoderLayerCache` per layer when the blocks have cross attention);
                a length for :class:`attnlab.attention.StaticKVCache` s allocated once for
                that many positions, over which one new token takes the fast decode step
                (:meth:`prepare_decode`). A sliding-window layer whose window is under
                ``max_len`` gets a :class:`attnlab.attention.StaticWindowKVCache` of its
                window's slots instead, reused in turn. They hold :attr:`kv_cache_dtype`.
        """
        if self.config.cross_attention:
            return [DecoderLayerCache() for _ in self.blocks]
        if self.config.mla is not None:  # the latent caches, growing or of max_len positions
            return [b.attention.new_kv_cache(max_len) for b in self.blocks]  # type: ignore[union-attr,operator]
        if max_len is not None:
            windows = [getattr(b.attention, "sliding_window", None) for b in self.blocks]
            return new_caches(len(self.blocks), max_len, windows, self.kv_cache_dtype)
        return [block.attention.new_kv_cache() for block in self.blocks]  # type: ignore[union-attr,operator]

    def why_no_cache_dtype(self) -> str | None:
        """Cross attention's and latent attention's caches hold their keys' own dtype."""
        if self.config.cross_attention:
            return "cross attention"
        return "latent attention" if self.config.mla is not None else None

    def prepare_decode(self, *, share_float: bool | None = None) -> DecodePlan:
        """Build (once) the fused products and tables of the fast one-token step
        (:mod:`attnlab.models.fast_decode`); the first step over a static cache calls it.

        Args:
            share_float: fuse float Q/K/V and gate/up weights too, the parameters becoming
                views of the fused ones, fp32 ones column-major (see
                :func:`attnlab.quant.fuse_linears`); None: as the loader asked
                (:func:`attnlab.models.fast_decode.defer_decode_plan`), else False.

        Raises:
            ValueError: a layout without the fast step (ALiBi or relative positions, an
                embedding norm, cross attention, attention sinks).
        """
        return decode_plan(self, share_float=share_float)

    def set_backend(self, backend: str) -> None:
        """Use ``backend`` in every attention layer from now on.

        Raises:
            ValueError: an unknown backend name.
        """
        set_attention_backend(self, backend)

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        kv_cache: list[KVCache] | None = None,
        need_weights: bool = False,
        logits_to_keep: int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """Logits for every position of ``input_ids`` (or the last ``logits_to_keep``).

        One new token per row over :class:`attnlab.attention.StaticKVCache` s
        (``new_kv_cache(max_len=N)``, as :func:`attnlab.generation.generate` uses), in eval
        mode with gradients off and no weights asked for, is handed to the decode plan's
        one-token step (:meth:`prepare_decode`) instead of the modules: the same numbers up
        to the order of floating-point sums. :meth:`decode_path` says whether this model
        takes it, by which loop, and why; a PyTorch hook on a module the step skips, a
        layer's ``capture``, ``record_attention`` or a block edit keeps every call on the
        modules.

        Args:
            input_ids: (B, T) long token ids; with ``kv_cache`` they follow the cached ones.
            kv_cache: from :meth:`new_kv_cache`; updated in place.
            need_weights: also return every layer's attention weights.
            logits_to_keep: compute logits for the last this many positions only
                (generation needs one: it skips the head over the rest of the prompt).

        Returns:
            Logits (B, T, V), or ``(logits, [weights (B, H, T, S)] * num_layers)``.

        Raises:
            TypeError: non-integer ids.
            ValueError: wrong shapes, a cache of the wrong length, or a sequence longer
                than ``context_length``.

        Shape:
            input_ids (B, T) -> (B, T, V).
        """
        self._check_ids(input_ids, kv_cache)
        logits = fast_step(self, input_ids, kv_cache, need_weights)
        if logits is not None:  # one new token over a static cache: the fused step
            return logits
        out = self.run(input_ids, kv_cache=kv_cache, need_weights=need_weights)
        logits = self.head(keep_last(out.hidden, logits_to_keep))  # (B, T, V)
        return (logits, out.weights) if need_weights else logits

    def _check_ids(self, input_ids: torch.Tensor, kv_cache: list[KVCache] | None) -> int:
        """Check ids and cache; return how many positions the cache already holds."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
            raise ValueError("`input_ids` must be a (B, T) tensor of token ids")
        if input_ids.is_floating_point():
            raise TypeError(f"`input_ids` must be an integer tensor, got {input_ids.dtype}")
        if kv_cache is not None and len(kv_cache) != len(self.blocks):
            raise ValueError(
                f"`kv_cache` must hold one KVCache per layer ({len(self.blocks)}), got "
                f"{len(kv_cache)}; use model.new_kv_cache()"
            )
        past = kv_cache[0].seq_len if kv_cache is not None else 0
        T = input_ids.shape[1]
        if past + T > self.context_length:
            raise ValueError(
                f"sequence of {past + T} tokens exceeds the context length "
                f"{self.context_length}; crop the input"
            )
        return past

    def run(
        self,
        input_ids: torch.Tensor,
        *,
        kv_cache: list[KVCache] | None = None,
        need_weights: bool = False,
        valid: torch.Tensor | None = None,
        context: torch.Tensor | None = None,
        context_valid: torch.Tensor | None = None,
    ) -> StackOutput:
        """The block stack: embeddings, every block, the final norm (no head).

        Args:
            input_ids: (B, T) long token ids; with ``kv_cache`` they follow the cached ones.
            kv_cache: from :meth:`new_kv_cache`; updated in place.
            need_weights: also return every layer's attention weights.
            valid: (B, S) bool, False = a padded key (S = cached + new); None = no padding.
            context: (B, S_ctx, C) the encoder output, for cross attention.
            context_valid: (B, S_ctx) bool, False = padded context position.

        Returns:
            A :class:`StackOutput`.

        Raises:
            TypeError: non-integer ids.
            ValueError: wrong shapes, a cache of the wrong length, a sequence longer than
                ``context_length``, ``context`` missing for cross attention.
        """
        past = self._check_ids(input_ids, kv_cache)
        B, T = input_ids.shape
        for name, flags, length in (
            ("valid", valid, past + T),
            ("context_valid", context_valid, None if context is None else context.shape[1]),
        ):
            if flags is not None and (
                not isinstance(flags, torch.Tensor)
                or flags.dtype != torch.bool
                or flags.shape != (B, length)
            ):
                got = (
                    f"{tuple(flags.shape)} {flags.dtype}"
                    if isinstance(flags, torch.Tensor)
                    else type(flags).__name__
                )
                raise ValueError(f"`{name}` must be a ({B}, {length}) bool tensor, got {got}")
        x = self.tok_embeddings(input_ids)  # (B, T, C)
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        if self.config.embed_scale:
            x = embed_scaled(x)
        if self.config.embed_multiplier != 1.0:
            x = x * self.config.embed_multiplier
        if self.pos_embeddings is not None:
            positions = torch.arange(past, past + T, device=input_ids.device)  # (T,)
            x = x + self.pos_embeddings(positions)  # (B, T, C)
        mask: AttentionMask | None = self.alibi
        if self.relative_bias is not None:
            mask = RelativePositionBias(
                self.relative_bias.weight,
                bidirectional=not self.config.causal,
                num_buckets=self.config.relative_buckets,
                max_distance=self.config.relative_max_distance,
            )
        if valid is not None and not bool(valid.all()):
            pad = PaddingMask(valid)
            mask = pad if mask is None else mask & pad
        context_mask = (
            PaddingMask(context_valid)
            if context_valid is not None and not bool(context_valid.all())
            else None
        )
        all_weights: list[torch.Tensor] = []
        cross_weights: list[torch.Tensor] = []
        start = first_block()
        for i, block in enumerate(self.blocks):
            if i < start:  # an experiment resumes from a stream it cached (edit_block_input)
                continue
            x = block_input(i, x)
            x, w, cw = block(
                x,
                kv_cache[i] if kv_cache is not None else None,
                need_weights=need_weights,
                bias=mask,
                context=context,
                context_mask=context_mask,
            )
            residual_after_block(i, x)
            if w is not None:
                all_weights.append(w)
            if cw is not None:
                cross_weights.append(cw)
        return StackOutput(self.norm(x), all_weights, cross_weights)

    def readout(self, x: torch.Tensor) -> torch.Tensor:
        """Logits from a residual stream: the final norm, then :meth:`head`.

        Shape:
            x ``(B, T, C)`` -> ``(B, T, V)``.
        """
        return self.head(self.norm(x))  # (B, T, V)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, V) from final hidden states (B, T, C).

        Raises:
            ValueError: this stack has no LM head (``output_head=False``).
        """
        if self.lm_head is None:
            raise ValueError("this stack has no LM head (output_head=False); use run()")
        if self.config.head_input_scale != 1.0:
            hidden = hidden * self.config.head_input_scale
        logits = self.lm_head(hidden)  # (B, T, V)
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        return softcap_scores(logits, self.config.final_softcap)  # (B, T, V)
