"""Figures of a model trace (:class:`~attnlab.explain.model_trace.ModelTrace`): one
head (:func:`plot_heatmap`), one layer's heads (:func:`plot_heads`) and every layer and head
as thumbnails (:func:`plot_model`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from attnlab.explain.figures.base import THUMB_BINS, _drawing
from attnlab.explain.figures.walkthrough import plot_attention_weights
from attnlab.explain.fonts import figure_lang
from attnlab.explain.i18n import message

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from attnlab.explain.model_trace import ModelTrace


def _trace_label(trace: ModelTrace, layer: int, lang: str = "en") -> str:
    if trace.layer_names is not None:
        return trace.layer_names[trace.layers.index(layer)]
    return message("fig.layer", lang, i=layer)


def _pooled(weights: torch.Tensor, bins: int) -> torch.Tensor:
    """Max-pool a ``(T, S)`` map to at most ``bins`` a side (exact when it fits)."""
    T, S = weights.shape
    if max(T, S) <= bins:
        return weights
    pooled = torch.nn.functional.adaptive_max_pool2d(
        weights[None, None], (min(T, bins), min(S, bins))
    )  # (1, 1, T', S')
    return pooled[0, 0]


def plot_heatmap(
    trace: ModelTrace,
    layer: int,
    head: int,
    ax: Axes | None = None,
    *,
    annotate: bool | None = None,
    lang: str = "en",
) -> Figure:
    """One head's attention weights as a heatmap, tokens on both axes.

    Rows are queries, columns keys. Small matrices (up to 12 tokens) have each
    weight written in its cell; long inputs show a subset of the token labels.

    Args:
        trace: a :class:`~attnlab.explain.model_trace.ModelTrace`.
        layer: a captured layer (model numbering).
        head: a captured head.
        ax: draw into this Axes; by default a new Figure.
        annotate: write the values in the cells (default: when at most 12 tokens).
        lang: ``"en"`` or ``"zh-TW"`` (figure text; English without a CJK font).

    Returns:
        The Figure.

    Raises:
        ValueError: the layer or head is not in the trace.
    """
    weights = trace.head_weights(layer, head)  # (T, S)
    fl = figure_lang(lang).lang
    title = message("fig.layer_head", fl, layer=_trace_label(trace, layer, fl), h=head)
    if trace.source:
        title = f"{trace.source}: {title}"
    return plot_attention_weights(
        weights,
        list(trace.tokens),
        ax,
        key_tokens=list(trace.key_tokens),
        title=title,
        annotate=annotate,
        lang=lang,
    )


def _thumb(ax: Axes, weights: torch.Tensor, vmax: float, cmap: str) -> None:
    ax.imshow(
        _pooled(weights.float(), THUMB_BINS).numpy(),
        cmap=cmap,
        vmin=0.0,
        vmax=vmax,
        interpolation="nearest",
        aspect="auto",
    )
    ax.set_xticks([])
    ax.set_yticks([])


def plot_heads(
    trace: ModelTrace, layer: int, *, cols: int = 4, cmap: str = "Blues", lang: str = "en"
) -> Figure:
    """Every captured head of one layer, side by side (rows queries, columns keys).

    Long inputs are max-pooled to 128 bins a side so that strong weights stay visible.

    Args:
        trace: the trace.
        layer: a captured layer.
        cols: heads per row of the grid.
        cmap: a matplotlib colormap name.
        lang: ``"en"`` or ``"zh-TW"`` (figure text; English without a CJK font).

    Returns:
        The Figure (one Axes per head, titled ``head h``).

    Raises:
        ValueError: the layer is not in the trace, or ``cols`` < 1.
    """

    if cols < 1:
        raise ValueError(f"`cols` must be at least 1, got {cols}")
    with _drawing(lang) as fl:
        return _heads_figure(trace, layer, cols, cmap, fl.lang)


def _heads_figure(trace: ModelTrace, layer: int, cols: int, cmap: str, lang: str) -> Figure:
    from matplotlib.figure import Figure

    maps = [trace.head_weights(layer, h) for h in trace.heads]  # each (T, S)
    n = len(maps)
    ncols = min(cols, n)
    nrows = -(-n // ncols)
    fig = Figure(figsize=(2.6 * ncols + 0.6, 2.6 * nrows + 0.6), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for i, ax in enumerate(axes.flat):
        if i >= n:
            ax.set_axis_off()
            continue
        _thumb(ax, maps[i], 1.0, cmap)
        ax.set_title(message("fig.head", lang, h=trace.heads[i]), fontsize=10)
    axes[0, 0].set_ylabel(message("fig.query", lang))
    axes[-1, 0].set_xlabel(message("fig.key", lang))
    title = message(
        "fig.heads_title", lang, layer=_trace_label(trace, layer, lang), n=len(trace.tokens)
    )
    fig.suptitle(f"{trace.source + ': ' if trace.source else ''}{title}", fontsize=11)
    return fig


def plot_model(trace: ModelTrace, *, cmap: str = "Blues", lang: str = "en") -> Figure:
    """Thumbnails of every captured layer (rows) and head (columns).

    Args:
        trace: the trace.
        cmap: a matplotlib colormap name.
        lang: ``"en"`` or ``"zh-TW"`` (figure text; English without a CJK font).

    Returns:
        The Figure, one Axes per (layer, head) in row-major order.
    """
    with _drawing(lang) as fl:
        return _model_figure(trace, cmap, fl.lang)


def _model_figure(trace: ModelTrace, cmap: str, lang: str) -> Figure:
    from matplotlib.figure import Figure

    L, H = len(trace.layers), len(trace.heads)
    size = 1.3 if L * H <= 64 else 0.8
    fig = Figure(figsize=(size * H + 1.4, size * L + 0.9), layout="constrained")
    axes = fig.subplots(L, H, squeeze=False)
    for li, layer in enumerate(trace.layers):
        for hi, head in enumerate(trace.heads):
            ax = axes[li, hi]
            _thumb(ax, trace.head_weights(layer, head), 1.0, cmap)
            if li == 0:
                ax.set_title(message("fig.head", lang, h=head), fontsize=8)
            if hi == 0:
                ax.set_ylabel(_trace_label(trace, layer, lang), fontsize=8)
    title = message("fig.model_title", lang, L=L, H=H, n=len(trace.tokens))
    fig.suptitle(f"{trace.source + ': ' if trace.source else ''}{title}", fontsize=10)
    return fig
