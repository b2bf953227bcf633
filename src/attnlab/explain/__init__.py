"""Explaining attention: compute every intermediate (trace), then render it.

``trace`` computes and holds the numbers; ``text`` turns a trace into terminal
tables; ``figures`` draws it with matplotlib (imported lazily); ``i18n`` holds the
explanations in English and Traditional Chinese; ``model_trace`` captures any attnlab
model's attention (:func:`trace_model`) and ``html`` writes the interactive page;
``heads`` says what heads do (:func:`head_scores`, :func:`ablate`, :func:`logit_lens`,
:func:`rollout`); ``why`` says why a token came out (:func:`attribute`, :func:`patch`,
:func:`attribution_patching`).
"""

from __future__ import annotations

from attnlab.explain import html as _html  # noqa: F401  (registers ModelTrace's Jupyter view)
from attnlab.explain.heads import (
    AblationEffect,
    ablate,
    ablation_effect,
    head_scores,
    logit_lens,
    rollout,
    top_tokens,
)
from attnlab.explain.model_trace import ExpertTrace, ModelTrace, trace_model
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
from attnlab.explain.why import (
    Attribution,
    Patching,
    attribute,
    attribution_patching,
    patch,
    patching,
)

__all__ = [
    "AblationEffect",
    "AttentionForm",
    "AttentionTrace",
    "Attribution",
    "Checks",
    "ExpertTrace",
    "ModelTrace",
    "ModuleRun",
    "Patching",
    "Projection",
    "TokenStep",
    "ablate",
    "ablation_effect",
    "attribute",
    "attribution_patching",
    "head_scores",
    "logit_lens",
    "patch",
    "patching",
    "rollout",
    "top_tokens",
    "trace_attention",
    "trace_example",
    "trace_model",
]
