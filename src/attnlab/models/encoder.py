"""The one encoder: BERT-style families (BERT, RoBERTa, MiniLM) on attnlab's attention,
configured by an :class:`EncoderConfig`.

Embeddings are the sum of a word, a token-type and an absolute position embedding,
then LayerNorm. Each block is post-LayerNorm::

    x = LayerNorm(x + Attention(x, key padding mask))
    x = LayerNorm(x + W_out · act(W_in · x))

Attention is bidirectional; padded keys are masked with :class:`attnlab.masks.PaddingMask`,
so real tokens never look at padding (padded query rows still attend to the real tokens;
their outputs are simply ignored downstream).

Positions: BERT numbers tokens ``0..T-1``. RoBERTa (``positions_from_padding``) numbers the
non-padding tokens from ``pad_token_id + 1`` and gives padding the position
``pad_token_id`` (``position_offset`` = ``pad_token_id + 1``).

Shape legend: B batch, T tokens, C = H*D width, I intermediate (feed-forward) width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from attnlab.attention import Attention
from attnlab.masks import PaddingMask
from attnlab.models._lm import set_attention_backend
from attnlab.models.decoder import ACTIVATIONS

__all__ = ["Encoder", "EncoderConfig", "EncoderLayer"]


@dataclass(frozen=True)
class EncoderConfig:
    """Sizes and options of a BERT-style encoder (defaults: all-MiniLM-L6-v2).

    Attributes:
        vocab_size: word-piece vocabulary size.
        hidden_size: model width C.
        num_layers: number of encoder blocks.
        num_heads: attention heads H (C % H == 0).
        intermediate_size: feed-forward width I.
        max_position_embeddings: rows of the position table.
        type_vocab_size: number of token types (segments).
        layer_norm_eps: LayerNorm epsilon.
        pad_token_id: id of the padding token.
        activation: feed-forward activation (a key of ``ACTIVATIONS``).
        positions_from_padding: RoBERTa's positions (module docstring).
        family: the family name this config came from.
    """

    vocab_size: int = 30522
    hidden_size: int = 384
    num_layers: int = 6
    num_heads: int = 12
    intermediate_size: int = 1536
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    activation: str = "gelu"
    positions_from_padding: bool = False
    family: str = "bert"

    @property
    def max_tokens(self) -> int:
        """Longest input: the position table, less RoBERTa's offset."""
        if self.positions_from_padding:
            return self.max_position_embeddings - self.pad_token_id - 1
        return self.max_position_embeddings


class EncoderLayer(nn.Module):
    """One post-LayerNorm encoder block.

    Args:
        config: the sizes.
        backend: attnlab attention backend.
    """

    def __init__(self, config: EncoderConfig, *, backend: str = "auto") -> None:
        super().__init__()
        C, eps = config.hidden_size, config.layer_norm_eps
        self.attention = Attention(C, config.num_heads, bias=True, out_bias=True, backend=backend)
        self.attn_norm = nn.LayerNorm(C, eps=eps)
        self.ffn_in = nn.Linear(C, config.intermediate_size)
        self.ffn_out = nn.Linear(config.intermediate_size, C)
        self.ffn_norm = nn.LayerNorm(C, eps=eps)
        self.act = ACTIVATIONS[config.activation]

    def forward(
        self, x: torch.Tensor, mask: PaddingMask | None, *, need_weights: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, T, C) -> ((B, T, C), weights (B, H, T, T) or None)."""
        weights = None
        if need_weights:
            a, weights = self.attention(x, attn_mask=mask, need_weights=True)
        else:
            a = self.attention(x, attn_mask=mask)
        x = self.attn_norm(x + a)  # (B, T, C)
        h = self.act(self.ffn_in(x))  # type: ignore[operator]  # (B, T, I)
        return self.ffn_norm(x + self.ffn_out(h)), weights  # (B, T, C)


class Encoder(nn.Module):
    """BERT-style encoder: embeddings, then ``num_layers`` post-LN blocks; no pooler.

    Args:
        config: the sizes.
        backend: attnlab attention backend for every layer (``"auto"``, ``"math"``, ...).
    """

    def __init__(self, config: EncoderConfig, *, backend: str = "auto") -> None:
        super().__init__()
        if config.activation not in ACTIVATIONS:
            raise ValueError(
                f"`activation` must be one of {sorted(ACTIVATIONS)}, got {config.activation!r}"
            )
        self.config = config
        C = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, C)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, C)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, C)
        self.embed_norm = nn.LayerNorm(C, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(
            EncoderLayer(config, backend=backend) for _ in range(config.num_layers)
        )

    def set_backend(self, backend: str) -> None:
        """Use ``backend`` in every attention layer from now on.

        Raises:
            ValueError: an unknown backend name.
        """
        set_attention_backend(self, backend)

    def forward(
        self,
        input_ids: torch.Tensor,
        valid: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        *,
        need_weights: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """Encode a batch of token ids.

        Args:
            input_ids: (B, T) long token ids.
            valid: (B, T) bool, True = real token, False = padding; None = no padding.
            token_type_ids: (B, T) segment ids; default all zeros.
            need_weights: also return every layer's attention weights.

        Returns:
            Last hidden states (B, T, C), or ``(hidden, [weights (B, H, T, T)] * num_layers)``.

        Raises:
            ValueError: wrong shapes, or a sequence longer than the position table.
            TypeError: non-integer ids or a non-bool ``valid``.

        Shape:
            input_ids (B, T) -> (B, T, C).
        """
        if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
            raise ValueError("`input_ids` must be a (B, T) tensor of token ids")
        if input_ids.is_floating_point():
            raise TypeError(f"`input_ids` must be an integer tensor, got {input_ids.dtype}")
        B, T = input_ids.shape
        if self.config.max_tokens < T:
            raise ValueError(
                f"`input_ids` has T={T} tokens, more than the model's "
                f"{self.config.max_tokens} positions; truncate the input"
            )
        if valid is not None and (valid.shape != (B, T) or valid.dtype != torch.bool):
            raise ValueError(
                f"`valid` must be a (B, T) = ({B}, {T}) bool tensor, got "
                f"{tuple(valid.shape)} {valid.dtype}"
            )
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        if self.config.positions_from_padding:
            pad = self.config.pad_token_id
            real = (input_ids != pad).long()  # (B, T)
            positions = torch.cumsum(real, dim=1) * real + pad  # (B, T)
            pos_emb = self.position_embeddings(positions)  # (B, T, C)
        else:
            pos_emb = self.position_embeddings(torch.arange(T, device=input_ids.device))[None]
        # Summed in this order (word, type, position) so fp32 rounding matches the reference.
        x = (
            self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids) + pos_emb
        )  # (B, T, C)
        x = self.embed_norm(x)
        mask = PaddingMask(valid) if valid is not None and not bool(valid.all()) else None
        all_weights: list[torch.Tensor] = []
        for layer in self.layers:
            x, w = layer(x, mask, need_weights=need_weights)
            if w is not None:
                all_weights.append(w)
        return (x, all_weights) if need_weights else x
