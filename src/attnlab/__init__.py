"""attnlab: self-attention from the dot product to real models, showing its work.

Public API, re-exported names only. See the README for a tour.
"""

from __future__ import annotations

from attnlab.examples import EXAMPLES, Example, get_example
from attnlab.explain.trace import AttentionTrace, trace_attention, trace_example
from attnlab.functional import (
    attention_scores,
    attention_weights,
    context_vectors,
    default_scale,
    simplified_self_attention,
)
from attnlab.ladder import SelfAttentionV1, SelfAttentionV2, copy_v2_weights_to_v1

__version__ = "0.1.0"

__all__ = [
    "EXAMPLES",
    "AttentionTrace",
    "Example",
    "SelfAttentionV1",
    "SelfAttentionV2",
    "__version__",
    "attention_scores",
    "attention_weights",
    "context_vectors",
    "copy_v2_weights_to_v1",
    "default_scale",
    "get_example",
    "simplified_self_attention",
    "trace_attention",
    "trace_example",
]
