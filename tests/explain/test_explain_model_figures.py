"""Figures of a ModelTrace: axes, labels and image data (never pixels)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from matplotlib.figure import Figure

from attnlab.explain.figures import plot_heads, plot_heatmap, plot_model
from explain_helpers import synthetic_trace

JOURNEY = ["Your", " journey", " starts", " with", " one", " step"]


def _image(ax) -> np.ndarray:
    assert len(ax.images) == 1
    return np.asarray(ax.images[0].get_array())


def test_heatmap_small_has_values_in_cells():
    trace = synthetic_trace(6, layers=2, heads=3, tokens=JOURNEY, seed=5)
    fig = plot_heatmap(trace, 1, 2)
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    np.testing.assert_allclose(_image(ax), trace.head_weights(1, 2).numpy())
    assert [t.get_text() for t in ax.get_xticklabels()] == JOURNEY
    assert [t.get_text() for t in ax.get_yticklabels()] == JOURNEY
    assert ax.get_xlabel().startswith("key") and ax.get_ylabel().startswith("query")
    assert "layer 1, head 2" in ax.get_title(loc="left")
    cells = [t.get_text() for t in ax.texts]
    assert len(cells) == 36
    assert cells[6 * 3 + 1] == f"{trace.head_weights(1, 2)[3, 1].item():.4f}"


def test_heatmap_long_input_has_no_cell_text_and_few_labels():
    trace = synthetic_trace(300, layers=1, heads=1, seed=6, top_k=20)
    fig = plot_heatmap(trace, 0, 0)
    ax = fig.axes[0]
    np.testing.assert_allclose(_image(ax), trace.head_weights(0, 0).numpy())
    assert len(ax.texts) == 0
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert 2 <= len(labels) <= 41 and labels[0] == "t0" and labels[-1] == "t299"
    w, h = fig.get_size_inches()
    assert w <= 13.5 and h <= 12.5


def test_heatmap_into_a_given_axes_and_bad_head():
    trace = synthetic_trace(4, layers=1, heads=2)
    fig = Figure()
    ax = fig.add_subplot()
    assert plot_heatmap(trace, 0, 1, ax=ax) is fig
    with pytest.raises(ValueError, match="`head` must be one of the captured heads"):
        plot_heatmap(trace, 0, 2)


def test_heads_grid_shows_every_head_of_the_layer():
    trace = synthetic_trace(7, layers=2, heads=5, seed=8)
    fig = plot_heads(trace, 1, cols=3)
    assert len(fig.axes) == 6  # 2 rows x 3 columns, the last one empty
    shown = [ax for ax in fig.axes if ax.images]
    assert [ax.get_title() for ax in shown] == [f"head {h}" for h in range(5)]
    for h, ax in enumerate(shown):
        np.testing.assert_allclose(_image(ax), trace.head_weights(1, h).numpy())
    assert "layer 1" in fig.get_suptitle()


def test_heads_grid_pools_long_inputs_keeping_the_strong_weights():
    trace = synthetic_trace(300, layers=1, heads=2, seed=9, top_k=8)
    fig = plot_heads(trace, 0)
    img = _image(fig.axes[0])
    assert img.shape == (128, 128)
    w = trace.head_weights(0, 0)
    assert img.max() == pytest.approx(float(w.max()))
    want = torch.nn.functional.adaptive_max_pool2d(w[None, None], (128, 128))[0, 0]
    np.testing.assert_allclose(img, want.numpy())


def test_model_grid_is_layers_by_heads():
    trace = synthetic_trace(5, layers=3, heads=4, seed=10)
    fig = plot_model(trace)
    assert len(fig.axes) == 12
    for li in range(3):
        for h in range(4):
            ax = fig.axes[li * 4 + h]
            np.testing.assert_allclose(_image(ax), trace.head_weights(li, h).numpy())
    assert [fig.axes[i * 4].get_ylabel() for i in range(3)] == ["layer 0", "layer 1", "layer 2"]
    assert [fig.axes[h].get_title() for h in range(4)] == [f"head {h}" for h in range(4)]
    assert "3 layers x 4 heads" in fig.get_suptitle()
