"""Explaining attention: compute every intermediate (trace), then render it.

``trace`` computes and holds the numbers; ``text`` turns a trace into terminal
tables; ``figures`` draws it with matplotlib (imported lazily); ``i18n`` holds the
explanations in English and Traditional Chinese.
"""

from __future__ import annotations

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
    "ModuleRun",
    "Projection",
    "TokenStep",
    "trace_attention",
    "trace_example",
]
