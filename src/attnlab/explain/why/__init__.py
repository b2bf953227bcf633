"""Why this token: direct logit attribution, activation patching and attribution patching.

Shape legend:
    L layers, H heads per layer, Dv a head's value dim, C model width, T tokens,
    S source (key) positions, E experts, B a batch of patched runs.

The metric is ``m = logit(target) - logit(contrast)`` (just ``logit(target)`` without a
contrast). Nothing here re-implements the model: every number is read from the model's
own forward through attnlab's named hook points (:func:`attnlab.attention.record_attention`
and :func:`attnlab.attention.edit_heads` for the heads' outputs before the output
projection, :func:`attnlab.models._lm.edit_block_input` for the stream entering each block,
:func:`attnlab.models._lm.edit_mlp` for each block's feed-forward write,
:func:`attnlab.models.moe.record_experts` for each expert's share,
:func:`attnlab.models._lm.watch_residual` for the stream the final norm reads), then
projected onto the logit difference through the weights (each head's slice of the output
projection, the unembedding rows) with the norms' scales frozen at their values in the run.

The package's modules: ``layout`` (what is read from the model, the shared arguments),
``attribution`` (:func:`attribute`), ``activation_patching`` (:func:`patching`,
:func:`patch`, :func:`attribution_patching`).
"""

from __future__ import annotations

from attnlab.explain.why.activation_patching import (
    Patching,
    attribution_patching,
    patch,
    patching,
)
from attnlab.explain.why.attribution import Attribution, attribute
from attnlab.explain.why.layout import (  # noqa: F401  (old import paths)
    Over,
    TokenArg,
    token_id,
)

__all__ = [
    "Attribution",
    "Patching",
    "attribute",
    "attribution_patching",
    "patch",
    "patching",
    "token_id",
]
