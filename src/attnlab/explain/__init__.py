"""Explaining attention: compute every intermediate (trace), then render it.

``trace`` computes and holds the numbers; ``text`` turns a trace into terminal
tables; ``figures`` draws it with matplotlib (imported lazily); ``i18n`` holds the
explanations in English and Traditional Chinese; ``model_trace`` captures any attnlab
model's attention (:func:`trace_model`) and ``html`` writes the interactive page.
"""

from __future__ import annotations

from attnlab.explain.model_trace import ModelTrace, trace_model
from attnlab.explain.trace import (
    AttentionForm,
    AttentionTrace,
    Checks,
    ModuleRun,
    Projection,
    TokenStep,
    trace_attention,
    trace_example,
)

__all__ = [
    "AttentionForm",
    "AttentionTrace",
    "Checks",
    "ModelTrace",
    "ModuleRun",
    "Projection",
    "TokenStep",
    "trace_attention",
    "trace_example",
    "trace_model",
]
