"""A Llama-style decoder on attnlab's attention (the layout of SmolLM2).

Each block is pre-RMSNorm::

    x = x + Attention(RMSNorm(x), causal, RoPE, grouped-query, KV cache)
    x = x + W_down · (silu(W_gate · h) * (W_up · h)),   h = RMSNorm(x)

then a final RMSNorm and the output projection, which may share (tie) its weight with
the token embedding. There are no biases anywhere. Rotary position embedding is
:class:`attnlab.attention.RotaryEmbedding` ("rotate half", base ``rope_theta``), shared
by every layer; grouped-query attention is ``Attention(num_kv_heads=G)``.

The model follows attnlab's causal-LM protocol: ``model(input_ids, kv_cache=...)``
returns logits, ``model.new_kv_cache()`` gives one :class:`KVCache` per layer,
``model.context_length`` bounds the window.

Shape legend: B batch, T new tokens, S keys (cached + new), C width, V vocabulary,
H query heads, G key/value heads, F feed-forward width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from attnlab.attention import Attention, KVCache, RotaryEmbedding
from attnlab.models._lm import keep_last, set_attention_backend
from attnlab.norms import RMSNorm

__all__ = ["LlamaConfig", "LlamaForCausalLM", "RMSNorm"]


@dataclass(frozen=True)
class LlamaConfig:
    """Sizes of a Llama-style decoder (defaults: SmolLM2-135M).

    Attributes:
        vocab_size: V.
        hidden_size: model width C.
        num_layers: decoder blocks.
        num_heads: query heads H.
        num_kv_heads: key/value heads G (H % G == 0).
        intermediate_size: SwiGLU width F.
        rope_theta: RoPE frequency base.
        rms_norm_eps: RMSNorm epsilon.
        context_length: longest sequence the model was trained for.
        tie_embeddings: output projection shares the token embedding's weight.
    """

    vocab_size: int = 49152
    hidden_size: int = 576
    num_layers: int = 30
    num_heads: int = 9
    num_kv_heads: int = 3
    intermediate_size: int = 1536
    rope_theta: float = 100000.0
    rms_norm_eps: float = 1e-5
    context_length: int = 8192
    tie_embeddings: bool = True


class SwiGLU(nn.Module):
    """The gated feed-forward: ``down(silu(gate(x)) * up(x))``, no biases."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) -> (B, T, C)."""
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))  # (B, T, F) -> (B, T, C)


class LlamaBlock(nn.Module):
    """One pre-norm decoder block.

    Args:
        config: the sizes.
        rope: the rotary embedding shared by all layers.
        backend: attnlab attention backend.
    """

    def __init__(self, config: LlamaConfig, rope: RotaryEmbedding, *, backend: str) -> None:
        super().__init__()
        C = config.hidden_size
        self.attn_norm = RMSNorm(C, config.rms_norm_eps)
        self.attention = Attention(
            C,
            config.num_heads,
            num_kv_heads=config.num_kv_heads,
            bias=False,
            out_bias=False,
            rope=rope,
            backend=backend,
        )
        self.mlp_norm = RMSNorm(C, config.rms_norm_eps)
        self.mlp = SwiGLU(C, config.intermediate_size)

    def forward(
        self, x: torch.Tensor, kv_cache: KVCache | None, *, need_weights: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, T, C) -> ((B, T, C), weights (B, H, T, S) or None)."""
        h = self.attn_norm(x)
        # One new token (decoding) is the last position: it may see every key, so the
        # causal mask is all True and is left out (fused kernels then need no mask at all).
        causal = x.shape[1] > 1
        weights = None
        if need_weights:
            a, weights = self.attention(h, is_causal=causal, kv_cache=kv_cache, need_weights=True)
        else:
            a = self.attention(h, is_causal=causal, kv_cache=kv_cache)
        x = x + a  # (B, T, C)
        return x + self.mlp(self.mlp_norm(x)), weights  # (B, T, C)


class LlamaForCausalLM(nn.Module):
    """Llama-style decoder with a language-model head.

    Args:
        config: the sizes.
        backend: attnlab attention backend for every layer.
    """

    def __init__(self, config: LlamaConfig, *, backend: str = "auto") -> None:
        super().__init__()
        if config.hidden_size % config.num_heads:
            raise ValueError(
                f"`hidden_size` ({config.hidden_size}) must be divisible by `num_heads` "
                f"({config.num_heads})"
            )
        self.config = config
        C = config.hidden_size
        self.rope = RotaryEmbedding(C // config.num_heads, base=config.rope_theta)
        self.tok_embeddings = nn.Embedding(config.vocab_size, C)
        self.blocks = nn.ModuleList(
            LlamaBlock(config, self.rope, backend=backend) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(C, config.rms_norm_eps)
        self.lm_head = nn.Linear(C, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_embeddings.weight

    @property
    def context_length(self) -> int:
        """Longest window the model accepts (the protocol's ``context_length``)."""
        return self.config.context_length

    def new_kv_cache(self) -> list[KVCache]:
        """An empty cache, one :class:`KVCache` per layer."""
        return [KVCache() for _ in self.blocks]

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
        if past + input_ids.shape[1] > self.context_length:
            raise ValueError(
                f"sequence of {past + input_ids.shape[1]} tokens exceeds the context length "
                f"{self.context_length}; crop the input"
            )
        x = self.tok_embeddings(input_ids)  # (B, T, C)
        all_weights: list[torch.Tensor] = []
        for i, block in enumerate(self.blocks):
            x, w = block(
                x, kv_cache[i] if kv_cache is not None else None, need_weights=need_weights
            )
            if w is not None:
                all_weights.append(w)
        x = keep_last(x, logits_to_keep)  # (B, T or logits_to_keep, C)
        logits = self.lm_head(self.norm(x))  # (B, T, V)
        return (logits, all_weights) if need_weights else logits
