"""attnlab: self-attention from the dot product to real models, showing its work.

Public API, re-exported names only. See the README for a tour.
"""

from __future__ import annotations

from attnlab import _startup

# PyTorch's import and attnlab's without the collector's passes over what they create
# (attnlab._startup: about a tenth of a second of every start).
with _startup.collector_paused():
    from attnlab.attention import Attention, KVCache, RollingKVCache, RotaryEmbedding
    from attnlab.backends import WeightsRequest, explain_dispatch
    from attnlab.biases import AlibiBias, RelativePositionBias
    from attnlab.examples import EXAMPLES, Example, get_example
    from attnlab.explain.trace import AttentionTrace, trace_attention, trace_example
    from attnlab.functional import (
        attention_scores,
        attention_weights,
        context_vectors,
        default_scale,
        exact_attention_weights,
        scaled_dot_product_attention,
        simplified_self_attention,
    )
    from attnlab.ladder import SelfAttentionV1, SelfAttentionV2, copy_v2_weights_to_v1
    from attnlab.masks import (
        AdditiveMask,
        AttentionMask,
        BooleanMask,
        CausalMask,
        ChunkedMask,
        DocumentMask,
        PaddingMask,
        SlidingWindowMask,
        as_mask,
    )
    from attnlab.norms import QKNorm
    from attnlab.rope import RopeConfig

__version__ = "0.1.0"

__all__ = [
    "EXAMPLES",
    "AdditiveMask",
    "AlibiBias",
    "Attention",
    "AttentionMask",
    "AttentionTrace",
    "BooleanMask",
    "CausalMask",
    "ChunkedMask",
    "DocumentMask",
    "Example",
    "KVCache",
    "PaddingMask",
    "QKNorm",
    "RelativePositionBias",
    "RollingKVCache",
    "RopeConfig",
    "RotaryEmbedding",
    "SelfAttentionV1",
    "SelfAttentionV2",
    "SlidingWindowMask",
    "WeightsRequest",
    "__version__",
    "as_mask",
    "attention_scores",
    "attention_weights",
    "context_vectors",
    "copy_v2_weights_to_v1",
    "default_scale",
    "exact_attention_weights",
    "explain_dispatch",
    "get_example",
    "scaled_dot_product_attention",
    "simplified_self_attention",
    "trace_attention",
    "trace_example",
]
