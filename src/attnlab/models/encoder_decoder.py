"""The encoder-decoder (T5): two stacks of the one decoder, configured by an
:class:`EncoderDecoderConfig`.

No block is written here. The encoder is :class:`attnlab.models.decoder.Decoder` with
``causal=False`` and no LM head (T5's encoder blocks are pre-norm RMS blocks, the same
as Llama's, with a bidirectional relative position bias); the decoder is the same class
with ``cross_attention=True`` (self-attention with a causal relative bias, then attention
to the encoder output, then the MLP). Both share one token embedding (``shared``).

T5's choices, as data in :class:`EncoderDecoderConfig`: RMSNorm without mean subtraction
or bias, no biases anywhere, no score scaling (``scale=1.0``: T5 folds ``1/sqrt(D)`` into
its query weights), a relative position bias table per stack (its first layer's in the
checkpoint) shared by all layers of the stack, a ReLU MLP (T5) or a gated-GELU one (T5
v1.1, Flan-T5), and the final decoder state scaled by ``d_model**-0.5`` before a head
tied to the embedding (``scale_decoder_outputs``).

Generation: :func:`attnlab.generation.generate` takes the encoder's input as ``idx``;
:meth:`EncoderDecoder.decoder_lm` encodes it once and returns a causal LM over the
decoder's tokens (the generation protocol), so sampling and caching are generation's.

Shape legend: B batch, S source (encoder) tokens, T target (decoder) tokens, C width,
V vocabulary, H heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from attnlab.attention import KVCache
from attnlab.models._lm import keep_last, set_attention_backend
from attnlab.models.decoder import Decoder, DecoderConfig

__all__ = ["EncoderDecoder", "EncoderDecoderConfig", "EncoderDecoderWeights", "SourceBoundLM"]

# Relative positions have no length limit; this bounds what one call may ask for.
NO_LIMIT = 1 << 20


@dataclass(frozen=True)
class EncoderDecoderConfig:
    """Sizes and options of a T5-style encoder-decoder (defaults: t5-small).

    Attributes:
        vocab_size: V.
        hidden_size: model width C (``d_model``).
        num_layers: encoder blocks.
        num_decoder_layers: decoder blocks.
        num_heads: heads H.
        head_dim: D (``d_kv``) when ``H * D != C`` (Flan-T5 small: 6 x 64 in 512); None = C / H.
        intermediate_size: feed-forward width (``d_ff``).
        norm_eps: RMSNorm epsilon.
        activation: feed-forward activation (a key of ``ACTIVATIONS``).
        gated_mlp: ``down(act(gate(x)) * up(x))`` (v1.1's ``gated-gelu``) instead of
            ``down(act(up(x)))``.
        tie_embeddings: the LM head is the shared embedding.
        scale_decoder_outputs: multiply the final decoder state by ``d_model**-0.5``
            before the head (the original T5; v1.1 does not).
        relative_buckets: relative position buckets.
        relative_max_distance: distance from which all positions share the last bucket.
        pad_token_id: padding id.
        decoder_start_token_id: the first decoder token of every generation.
        family: the family name this config came from.
    """

    vocab_size: int = 32128
    hidden_size: int = 512
    num_layers: int = 6
    num_decoder_layers: int = 6
    num_heads: int = 8
    head_dim: int | None = None
    intermediate_size: int = 2048
    norm_eps: float = 1e-6
    activation: str = "relu"
    gated_mlp: bool = False
    tie_embeddings: bool = True
    scale_decoder_outputs: bool = True
    relative_buckets: int = 32
    relative_max_distance: int = 128
    pad_token_id: int = 0
    decoder_start_token_id: int = 0
    family: str = "t5"

    def stack(self, *, decoder: bool) -> DecoderConfig:
        """The :class:`DecoderConfig` of the encoder (``decoder=False``) or decoder stack."""
        return DecoderConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_layers=self.num_decoder_layers if decoder else self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            context_length=NO_LIMIT,
            norm_eps=self.norm_eps,
            tie_embeddings=False,  # tied below, to the one shared embedding
            norm="rms",
            norm_placement="pre",
            mlp="gated" if self.gated_mlp else "plain",
            activation=self.activation,  # type: ignore[arg-type]
            positions="relative",
            relative_buckets=self.relative_buckets,
            relative_max_distance=self.relative_max_distance,
            causal=decoder,
            cross_attention=decoder,
            attn_scale=1.0,
            output_head=decoder,
            head_input_scale=self.hidden_size**-0.5 if self.scale_decoder_outputs else 1.0,
            family=self.family,
        )


@dataclass(frozen=True)
class EncoderDecoderWeights:
    """Every attention layer's weights from one encoder-decoder pass.

    Attributes:
        encoder: per encoder layer, self-attention ``(B, H, S, S)``.
        decoder: per decoder layer, causal self-attention ``(B, H, T, T_all)``.
        cross: per decoder layer, attention to the encoder output ``(B, H, T, S)``.
    """

    encoder: list[torch.Tensor]
    decoder: list[torch.Tensor]
    cross: list[torch.Tensor]


class EncoderDecoder(nn.Module):
    """A T5-style encoder-decoder on attnlab's attention.

    Args:
        config: the sizes and options.
        backend: attnlab attention backend for every layer.
    """

    is_encoder_decoder = True

    def __init__(self, config: EncoderDecoderConfig, *, backend: str = "auto") -> None:
        super().__init__()
        self.config = config
        self.shared = nn.Embedding(config.vocab_size, config.hidden_size)
        self.encoder = Decoder(config.stack(decoder=False), backend=backend)
        self.decoder = Decoder(config.stack(decoder=True), backend=backend)
        self.encoder.tok_embeddings = self.decoder.tok_embeddings = self.shared
        if config.tie_embeddings:
            assert self.decoder.lm_head is not None
            self.decoder.lm_head.weight = self.shared.weight

    @property
    def context_length(self) -> None:
        """No limit: positions are relative."""
        return None

    def set_backend(self, backend: str) -> None:
        """Use ``backend`` in every attention layer from now on.

        Raises:
            ValueError: an unknown backend name.
        """
        set_attention_backend(self, backend)

    def new_kv_cache(self) -> list[KVCache]:
        """An empty decoder cache: per layer, self-attention and cross-attention keys."""
        return self.decoder.new_kv_cache()

    def encode(self, input_ids: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """The encoder's output.

        Args:
            input_ids: (B, S) source token ids.
            valid: (B, S) bool, False = padding; None = no padding.

        Returns:
            (B, S, C) hidden states (final-normed).

        Shape:
            input_ids (B, S) -> (B, S, C).
        """
        return self.encoder.run(input_ids, valid=valid).hidden

    def decoder_start(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, 1) long: the decoder start token for each row of ``input_ids`` (B, S)."""
        start = self.config.decoder_start_token_id
        return torch.full((input_ids.shape[0], 1), start, dtype=torch.long, device=input_ids.device)

    def shift_right(self, labels: torch.Tensor) -> torch.Tensor:
        """T5's decoder input for target ``labels`` (B, T): the start token, then
        ``labels[:, :-1]`` (teacher forcing)."""
        start = torch.full_like(labels[:, :1], self.config.decoder_start_token_id)
        return torch.cat([start, labels[:, :-1]], dim=1)  # (B, T)

    def forward(
        self,
        input_ids: torch.Tensor,
        decoder_input_ids: torch.Tensor | None = None,
        *,
        valid: torch.Tensor | None = None,
        decoder_valid: torch.Tensor | None = None,
        kv_cache: list[KVCache] | None = None,
        need_weights: bool = False,
        logits_to_keep: int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, EncoderDecoderWeights]:
        """Decoder logits for ``decoder_input_ids`` given the source ``input_ids``.

        Args:
            input_ids: (B, S) source token ids.
            decoder_input_ids: (B, T) decoder token ids (they follow the cached ones);
                None: :meth:`shift_right` of ``input_ids`` (the text through both stacks,
                teacher-forced, which is what ``trace_model`` shows).
            valid: (B, S) bool, False = padded source token.
            decoder_valid: (B, T_all) bool, False = a padded decoder token (transformers'
                ``decoder_attention_mask``); T_all counts the cached tokens too. Padded
                decoder keys get no weight in the decoder's self-attention (on top of
                the causal mask). A query whose every visible key is padded (left padding:
                the pads before the first token) has no defined output; transformers gives
                it a uniform row, attnlab another value: ignore those positions.
            kv_cache: the decoder's, from :meth:`new_kv_cache`; updated in place.
            need_weights: also return every layer's weights
                (:class:`EncoderDecoderWeights`).
            logits_to_keep: logits for the last this many positions only.

        Returns:
            Logits (B, T, V), or ``(logits, EncoderDecoderWeights)``.

        Raises:
            TypeError, ValueError: as :meth:`attnlab.models.decoder.Decoder.run`.

        Shape:
            input_ids (B, S), decoder_input_ids (B, T) -> (B, T, V).
        """
        if decoder_input_ids is None:
            if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
                raise ValueError("`input_ids` must be a (B, S) tensor of token ids")
            decoder_input_ids = self.shift_right(input_ids)
        enc = self.encoder.run(input_ids, valid=valid, need_weights=need_weights)
        dec = self.decoder.run(
            decoder_input_ids,
            kv_cache=kv_cache,
            need_weights=need_weights,
            valid=decoder_valid,
            context=enc.hidden,
            context_valid=valid,
        )
        logits = self.decoder.head(keep_last(dec.hidden, logits_to_keep))  # (B, T, V)
        if need_weights:
            return logits, EncoderDecoderWeights(enc.weights, dec.weights, dec.cross_weights)
        return logits

    def decoder_lm(
        self, input_ids: torch.Tensor, valid: torch.Tensor | None = None
    ) -> SourceBoundLM:
        """Encode ``input_ids`` once; a causal LM over decoder tokens, for generation.

        Args:
            input_ids: (B, S) source token ids.
            valid: (B, S) bool, False = padding.

        Returns:
            A :class:`SourceBoundLM` (the causal-LM protocol of
            :mod:`attnlab.generation`).
        """
        return SourceBoundLM(self, input_ids, valid)


class SourceBoundLM:
    """An encoder-decoder with its source encoded: a causal LM over the decoder's tokens.

    It follows the protocol of :mod:`attnlab.generation` (``forward(ids, kv_cache=...,
    logits_to_keep=...)``, ``new_kv_cache()``, ``context_length``), so one generation loop
    serves decoder-only and encoder-decoder models.

    Args:
        model: the encoder-decoder.
        input_ids: (B, S) source token ids.
        valid: (B, S) bool, False = padding.

    Attributes:
        start_ids: (B, 1) the decoder start token, where generation begins.
    """

    context_length = None

    def __init__(
        self, model: EncoderDecoder, input_ids: torch.Tensor, valid: torch.Tensor | None
    ) -> None:
        self.model = model
        self.valid = valid
        self.encoded = model.encode(input_ids, valid)  # (B, S, C)
        self.start_ids = model.decoder_start(input_ids)  # (B, 1)

    def new_kv_cache(self) -> list[KVCache]:
        """An empty decoder cache."""
        return self.model.new_kv_cache()

    def __call__(
        self,
        input_ids: torch.Tensor,
        *,
        kv_cache: list[KVCache] | None = None,
        logits_to_keep: int | None = None,
    ) -> torch.Tensor:
        return self.forward(input_ids, kv_cache=kv_cache, logits_to_keep=logits_to_keep)

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        kv_cache: list[KVCache] | None = None,
        logits_to_keep: int | None = None,
    ) -> torch.Tensor:
        """Decoder logits (B, T, V) for decoder tokens ``input_ids`` (B, T)."""
        dec = self.model.decoder.run(
            input_ids, kv_cache=kv_cache, context=self.encoded, context_valid=self.valid
        )
        return self.model.decoder.head(keep_last(dec.hidden, logits_to_keep))  # (B, T, V)
