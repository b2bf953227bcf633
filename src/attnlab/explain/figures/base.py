"""What every figure shares: the colours, the limits on cell labels and tick labels,
the drawing context that follows ``lang=``, and a new Figure for ``ax=None``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from attnlab.explain.fonts import FigureLang, figure_lang

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


# Colours: tensors blue, operations amber; both readable in print and for colour-blind eyes.
_TENSOR_FACE, _TENSOR_EDGE = "#dbe9f6", "#2b6cb0"
_OP_FACE, _OP_EDGE = "#fde8c8", "#c05621"
_ARROW = "#4a5568"
_NOTE = "#4a5568"

# Heatmaps write each weight in its cell up to this many tokens a side.
ANNOTATE_MAX = 12
# At most this many token labels per heatmap axis (long inputs show every n-th).
MAX_TICK_LABELS = 40
# Thumbnails (plot_heads / plot_model) are max-pooled to at most this many bins a side.
THUMB_BINS = 128


@contextmanager
def _drawing(lang: str) -> Iterator[FigureLang]:
    """Build a figure in ``lang``: text created inside uses the CJK font when needed."""
    fl = figure_lang(lang)
    if fl.family is None:
        yield fl
        return
    from matplotlib import rc_context

    with rc_context({"font.family": [fl.family, "DejaVu Sans"]}):
        yield fl


def _luminance(rgba: tuple[float, float, float, float]) -> float:
    """WCAG relative luminance; below ~0.2 white text has the better contrast."""
    r, g, b = (c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in rgba[:3])
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def _tick_positions(n: int) -> list[int]:
    """Every position up to MAX_TICK_LABELS, else evenly spaced ones (first and last kept)."""
    if n <= MAX_TICK_LABELS:
        return list(range(n))
    step = -(-n // MAX_TICK_LABELS)
    ticks = list(range(0, n, step))
    if n - 1 - ticks[-1] < step / 2:
        ticks.pop()  # too close to the last label to be readable
    return [*ticks, n - 1]


def _new_axes(ax: Axes | None, figsize: tuple[float, float]) -> tuple[Figure, Axes]:
    if ax is not None:
        fig = ax.get_figure()
        assert fig is not None  # an Axes always belongs to a figure
        return fig, ax  # type: ignore[return-value]
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, layout="constrained")
    return fig, fig.add_subplot()
