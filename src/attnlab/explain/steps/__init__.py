"""Step into one head of a real model: the seed's walk, on the layer's own numbers.

Shape legend: T tokens, S keys (``S == T`` here), D head dim, C model width.

:func:`head_steps` runs the model once under a per-call recorder
(:func:`attnlab.attention.record_attention`) and takes, for one layer, what that
layer computed: its input, its queries before and after RoPE, its keys and values,
its mask, its exact attention weights, its per-head outputs and its output. It then
walks one query of one head through the seed text's steps with the library's own
functions (:func:`attnlab.functional.attention_scores`, ``attention_weights``,
``context_vectors``) on those tensors, and checks that the walk lands on what the
layer itself computed (the weights and the head's context vector), so every number
shown is the model's.

The package's modules: ``compute`` (the steps themselves) and ``sections`` (the steps as
labelled tables for the terminal, the page and the server).
"""

from __future__ import annotations

from attnlab.explain.steps.compute import (
    HeadSteps,
    LatentWalk,
    head_steps,
)
from attnlab.explain.steps.sections import (
    step_sections,
    step_summary,
)

__all__ = [
    "HeadSteps",
    "LatentWalk",
    "head_steps",
    "step_sections",
    "step_summary",
]
