"""Render an :class:`~attnlab.explain.trace.AttentionTrace` as terminal tables.

Builds rich renderables (labelled tables, numbers to 4 decimals, one or two
sentences per step) and returns them; printing is the caller's job (the CLI owns
the one console). Every number comes from the trace.

The package's modules: ``base`` (numbers, matrices, wrapped text), ``walkthrough``,
``steps`` (one head, step by step), ``model`` (heads' roles, ablation, attribution,
patching) and ``heatmap``.
"""

from __future__ import annotations

from attnlab.explain.text.base import (
    DECIMALS,
    Paragraph,
    format_number,
    matrix_table,
    wrap_text,
)
from attnlab.explain.text.heatmap import (  # noqa: F401  (old import paths)
    HEAT_CELL,
    heatmap_tables,
)
from attnlab.explain.text.model import (
    ablation_table,
    attribution_components,
    attribution_table,
    patch_table,
    roles_table,
)
from attnlab.explain.text.steps import (  # noqa: F401  (old import paths)
    MAX_COLS,
    MAX_ROWS,
    step_renderables,
)
from attnlab.explain.text.walkthrough import (
    walkthrough_renderables,
)

__all__ = [
    "DECIMALS",
    "Paragraph",
    "ablation_table",
    "attribution_components",
    "attribution_table",
    "format_number",
    "heatmap_tables",
    "matrix_table",
    "patch_table",
    "roles_table",
    "step_renderables",
    "walkthrough_renderables",
    "wrap_text",
]
