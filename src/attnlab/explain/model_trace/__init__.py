"""Capture what a model built on :class:`attnlab.attention.Attention` attended to.

Shape legend:
    L layers captured, H heads captured, T query tokens, S key tokens,
    K keys kept per query (top-k mode), D head dim; for mixtures of experts
    M routed layers captured, E experts, k experts per token.

:func:`trace_model` runs a model once inside :func:`attnlab.attention.record_attention`
(a per-call recorder: nothing is set on the shared layers, so concurrent traces of one
model do not meet), and keeps what the layers themselves computed through the
attention core's exact-weights path. Nothing here recomputes attention: what the trace holds
is what the model computed.

Long inputs are captured without holding all ``layers x heads x T x S`` weights at
once: choose the layers (``layers=``), the heads (``heads=``), or keep only the
``top_k`` strongest keys of every query. Each layer's weights are reduced (or
dropped) as soon as that layer has run, so the peak is one layer's weights.

In a mixture-of-experts model the same pass also keeps where the router of every
captured layer sent each token (:class:`ExpertTrace`, through
:func:`attnlab.models.moe.record_routing`): the experts it chose and their weights, as the
layer used them.

The package's modules: ``traces`` (the trace types), ``capture`` (running the
model and keeping what it computed).
"""

from __future__ import annotations

from attnlab.explain.model_trace.capture import (  # noqa: F401  (old import paths)
    AUTO_DENSE_LIMIT,
    AUTO_TOP_K,
    MAX_DENSE_ELEMENTS,
    _encode,
    _expert_trace,
    _resolve_input,
    _token_texts,
    attention_layers,
    auto_top_k,
    run_recorded,
    trace_from_walkthrough,
    trace_model,
)
from attnlab.explain.model_trace.traces import (  # noqa: F401  (old import paths)
    ExpertTrace,
    ModelTrace,
    set_html_renderer,
)

__all__ = [
    "ExpertTrace",
    "ModelTrace",
    "attention_layers",
    "auto_top_k",
    "trace_from_walkthrough",
    "trace_model",
]
