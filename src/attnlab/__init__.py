"""attnlab: self-attention from the dot product to real models, showing its work.

Public API, re-exported names only. See the README for a tour.
"""

from __future__ import annotations

from attnlab.attention import Attention, KVCache, RotaryEmbedding
from attnlab.backends import WeightsRequest, explain_dispatch
from attnlab.functional import (
    attention_scores,
    attention_weights,
    context_vectors,
    exact_attention_weights,
    scaled_dot_product_attention,
    simplified_self_attention,
)
from attnlab.masks import (
    AdditiveMask,
    AttentionMask,
    BooleanMask,
    CausalMask,
    PaddingMask,
    SlidingWindowMask,
    as_mask,
)

__version__ = "0.1.0"

__all__ = [
    "AdditiveMask",
    "Attention",
    "AttentionMask",
    "BooleanMask",
    "CausalMask",
    "KVCache",
    "PaddingMask",
    "RotaryEmbedding",
    "SlidingWindowMask",
    "WeightsRequest",
    "__version__",
    "as_mask",
    "attention_scores",
    "attention_weights",
    "context_vectors",
    "exact_attention_weights",
    "explain_dispatch",
    "scaled_dot_product_attention",
    "simplified_self_attention",
]
