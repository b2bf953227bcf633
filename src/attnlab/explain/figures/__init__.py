"""Figures of a trace: the attention-weights heatmap and the flow diagram.

For any model's :class:`~attnlab.explain.model_trace.ModelTrace`: one head
(:func:`plot_heatmap`), one layer's heads (:func:`plot_heads`) and every layer and
head as thumbnails (:func:`plot_model`).

matplotlib is imported lazily, inside each function, and figures are built with
``matplotlib.figure.Figure`` directly (no pyplot, no GUI backend, nothing global
changed); saving renders with Agg (PNG) or the SVG backend. Every plotting function
takes ``ax=None`` and returns the Figure. Figure text follows ``lang=``: Traditional
Chinese (``"zh-TW"``) when a CJK font is available (:mod:`attnlab.explain.fonts`; the
``zh-tw`` extra installs Noto Sans TC), else English, which matplotlib's bundled DejaVu
fonts render on any machine.

The package's modules, by figure family: ``walkthrough`` (one attention computation),
``model`` (a model trace), ``why`` (attribution and patching), ``base`` (what they share).
"""

from __future__ import annotations

from attnlab.explain.figures.base import (  # noqa: F401  (old import paths)
    ANNOTATE_MAX,
    MAX_TICK_LABELS,
    THUMB_BINS,
)
from attnlab.explain.figures.model import (
    plot_heads,
    plot_heatmap,
    plot_model,
)
from attnlab.explain.figures.walkthrough import (
    FlowShapes,
    flow_shapes,
    plot_attention_flow,
    plot_attention_weights,
    save_walkthrough_figures,
)
from attnlab.explain.figures.why import (
    plot_attribution,
    plot_patch,
)

__all__ = [
    "FlowShapes",
    "flow_shapes",
    "plot_attention_flow",
    "plot_attention_weights",
    "plot_attribution",
    "plot_heads",
    "plot_heatmap",
    "plot_model",
    "plot_patch",
    "save_walkthrough_figures",
]
