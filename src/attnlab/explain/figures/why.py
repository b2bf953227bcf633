"""Figures of why a token came out: the direct logit attribution grid
(:func:`plot_attribution`) and an activation-patching grid (:func:`plot_patch`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from attnlab.explain.figures.base import _luminance, _new_axes, _tick_positions

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


def _symmetric(values: torch.Tensor) -> float:
    """The half-range of a diverging colour scale centred on 0 (never 0 itself)."""
    top = float(values.abs().max()) if values.numel() else 0.0
    return top if top > 0 else 1.0


def _grid_cells(ax: Axes, values: torch.Tensor, vmax: float, fmt: str) -> None:
    """Write each value in its cell when the grid is small enough to read them."""
    from matplotlib import colormaps

    rows, cols = values.shape
    if rows * cols > 400:
        return
    cmap = colormaps["RdBu_r"]
    for i in range(rows):
        for j in range(cols):
            v = float(values[i, j])
            ink = "white" if _luminance(cmap(0.5 + 0.5 * v / vmax)) < 0.2 else "black"
            ax.text(j, i, format(v, fmt), ha="center", va="center", fontsize=7, color=ink)


def plot_attribution(
    attribution: Any, *, title: str | None = None, source: str | None = None
) -> Figure:
    """Direct logit attribution: the layers x heads grid beside the MLP bars.

    Red is a push towards the target (or towards the target rather than the contrast),
    blue a push away; one colour scale is centred on 0 and shared by no other figure.
    The MLP bars carry the embedding and the constant terms as two more bars.

    Args:
        attribution: an :class:`~attnlab.explain.Attribution`.
        title: the figure's title (default: the total and the error).
        source: a model label put before the title.

    Returns:
        The Figure: the heads grid (first Axes, with a colour bar) and the bars (last Axes).
    """
    from matplotlib.figure import Figure

    heads = attribution.heads.detach().float().cpu()  # (L, H)
    mlp = attribution.mlp.detach().float().cpu()  # (L,)
    L, H = heads.shape
    height = max(3.2, 0.24 * L + 1.4)
    fig = Figure(figsize=(0.42 * H + 5.8, height), layout="constrained")
    grid_ax, bar_ax = fig.subplots(1, 2, width_ratios=[max(H, 3), 4])
    vmax = _symmetric(heads)
    image = grid_ax.imshow(heads.numpy(), cmap="RdBu_r", vmin=-vmax, vmax=vmax, aspect="auto")
    _grid_cells(grid_ax, heads, vmax, ".1f" if vmax >= 1 else ".2f")
    grid_ax.set_xticks(range(H))
    grid_ax.set_yticks(_tick_positions(L))
    grid_ax.set_xlabel("head")
    grid_ax.set_ylabel("layer")
    grid_ax.set_title("heads", fontsize=10)
    fig.colorbar(image, ax=grid_ax, shrink=0.8, label="logit difference")
    names = ["embedding", *[f"mlp {layer}" for layer in range(L)], "bias"]
    values = [float(attribution.embedding), *mlp.tolist(), float(attribution.bias)]
    colours = ["#b2182b" if v >= 0 else "#2166ac" for v in values]
    bar_ax.barh(range(len(values)), values, color=colours)
    bar_ax.set_yticks(range(len(values)), names, fontsize=7 if L > 16 else 8)
    bar_ax.invert_yaxis()
    bar_ax.axvline(0, color="#4a5568", linewidth=0.8)
    bar_ax.set_title("MLPs, embedding, bias", fontsize=10)
    bar_ax.set_xlabel("logit difference")
    total = float(attribution.total)
    error = float(attribution.error)
    label = title if title is not None else f"total {total:+.3f} (error {error:+.1e})"
    fig.suptitle(f"{source + ': ' if source else ''}{label}", fontsize=11)
    return fig


def plot_patch(
    grid: torch.Tensor,
    *,
    over: str = "heads",
    tokens: Sequence[str] | None = None,
    title: str | None = None,
    ax: Axes | None = None,
) -> Figure:
    """An activation-patching grid: 1 where the patch restores the clean answer, 0 where
    it changes nothing; a diverging scale centred on 0.

    Args:
        grid: ``(L, H)`` (``over="heads"``) or ``(L, T)`` (``"residual"``, ``"mlp"``).
        over: what was patched; names the columns.
        tokens: column labels of an ``(L, T)`` grid (the clean prompt's tokens).
        title: the Axes' title.
        ax: draw into this Axes (default: a new Figure).

    Returns:
        The Figure.
    """
    values = grid.detach().float().cpu()
    L, C = values.shape
    fig, ax = _new_axes(ax, (0.42 * C + 2.6, max(3.0, 0.24 * L + 1.4)))
    vmax = _symmetric(values)
    image = ax.imshow(values.numpy(), cmap="RdBu_r", vmin=-vmax, vmax=vmax, aspect="auto")
    _grid_cells(ax, values, vmax, ".2f")
    ax.set_yticks(_tick_positions(L))
    ax.set_ylabel("layer")
    if over == "heads" or tokens is None:
        ax.set_xticks(range(C))
        ax.set_xlabel("head" if over == "heads" else "position")
    else:
        ticks = _tick_positions(C)
        ax.set_xticks(ticks, [repr(tokens[j])[1:-1] for j in ticks], rotation=90, fontsize=8)
        ax.set_xlabel("position (clean prompt)")
    ax.set_title(title if title is not None else f"patching over {over}", fontsize=10)
    fig.colorbar(image, ax=ax, shrink=0.8, label="share of the answer restored")
    return fig
