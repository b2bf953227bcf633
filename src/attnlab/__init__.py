"""attnlab: self-attention from the dot product to real models, showing its work.

Public API, re-exported names only. See the README for a tour.
"""

from __future__ import annotations

from attnlab.functional import (
    attention_scores,
    attention_weights,
    context_vectors,
    simplified_self_attention,
)

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "attention_scores",
    "attention_weights",
    "context_vectors",
    "simplified_self_attention",
]
