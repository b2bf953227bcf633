"""The one-token decode step as named parts.

- :mod:`~attnlab.models.decode.layout`: what the step reads off a model, and
  :func:`why_not_fast_decode`;
- :mod:`~attnlab.models.decode.general`: the general loop, every layout the step covers;
- :mod:`~attnlab.models.decode.kernels`: a plain stack's layers as bare kernels;
- :mod:`~attnlab.models.decode.short`: the short loop over them, in Python;
- :mod:`~attnlab.models.decode.compiled`: the same loop compiled (:mod:`attnlab.native`);
- :mod:`~attnlab.models.decode.plan`: :class:`DecodePlan`, whose ``step`` dispatches
  between the three loops and whose ``path`` says which one runs and why.

A model hands its one-token calls over in :mod:`attnlab.models.fast_decode`.
"""

from __future__ import annotations

from attnlab.models.decode.layout import why_not_fast_decode
from attnlab.models.decode.plan import DecodePath, DecodePlan, Loop

__all__ = ["DecodePath", "DecodePlan", "Loop", "why_not_fast_decode"]
