"""attnlab.explain.figures: the heatmap and the flow diagram."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from attnlab.explain.figures import (
    plot_attention_flow,
    plot_attention_weights,
    save_walkthrough_figures,
)
from attnlab.explain.trace import trace_example


@pytest.fixture(scope="module")
def journey():
    return trace_example("journey")


def _texts(fig) -> list[str]:
    return [t.get_text() for ax in fig.axes for t in ax.texts]


def test_heatmap_has_tokens_and_values(journey):
    fig = plot_attention_weights(journey.simplified.weights, journey.tokens)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == list(journey.tokens)
    assert [t.get_text() for t in ax.get_yticklabels()] == list(journey.tokens)
    cells = _texts(fig)
    assert len(cells) == 36
    assert cells[0] == f"{float(journey.simplified.weights[0, 0]):.4f}" == "0.2098"
    assert len(fig.axes) == 2  # heatmap + colorbar


def test_plot_functions_draw_into_a_given_ax(journey):
    from matplotlib.figure import Figure

    fig = Figure()
    ax1, ax2 = fig.subplots(1, 2)
    assert plot_attention_weights(journey.trainable.weights, journey.tokens, ax=ax1) is fig
    assert plot_attention_flow(journey, ax=ax2) is fig


def test_plotting_never_imports_pyplot():
    # In a fresh interpreter: other tests (the docs' examples) import pyplot in this one.
    code = (
        "import sys\n"
        "from matplotlib.figure import Figure\n"
        "from attnlab.explain.figures import plot_attention_flow, plot_attention_weights\n"
        "from attnlab.explain.trace import trace_example\n"
        "j = trace_example('journey')\n"
        "ax1, ax2 = Figure().subplots(1, 2)\n"
        "plot_attention_weights(j.trainable.weights, j.tokens, ax=ax1)\n"
        "plot_attention_flow(j, ax=ax2)\n"
        "print('matplotlib.pyplot' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"  # no pyplot, no GUI backend


def test_flow_diagram_is_annotated_with_this_examples_shapes(journey):
    texts = _texts(plot_attention_flow(journey))
    expected = ["inputs X", "6 × 3", "queries Q", "keys K", "values V", "6 × 2", "6 × 6"]
    expected += ["softmax", "dim = -1", "d_k = 2", "weights A", "context Z"]
    for label in expected:
        assert label in texts, label
    assert not {"collect", "clean", "deploy", "monitor"} & set(texts)  # the seed's erratum
    toy = _texts(plot_attention_flow(trace_example("toy")))
    assert any("W_q^{\\top}" in t for t in toy) and "6 × 2" in toy


def test_bad_arguments():
    with pytest.raises(ValueError, match="`tokens` must have 3 labels"):
        plot_attention_weights(torch.ones(3, 3) / 3, ["a", "b"])
    with pytest.raises(ValueError, match="`weights` must be 2-D"):
        plot_attention_weights(torch.ones(3), ["a", "b", "c"])
    with pytest.raises(TypeError, match="`trace` must be an AttentionTrace"):
        plot_attention_flow("journey")  # type: ignore[arg-type]


def test_save_writes_png_and_svg(journey, tmp_path):
    paths = save_walkthrough_figures(journey, tmp_path / "out")
    names = sorted(p.name for p in paths)
    assert names == sorted(
        f"{stem}.{ext}"
        for stem in (
            "attention-flow",
            "attention-weights-simplified",
            "attention-weights-trainable",
        )
        for ext in ("png", "svg")
    )
    for p in paths:
        data = p.read_bytes()
        assert len(data) > 1000
        if p.suffix == ".png":
            assert data[:8] == b"\x89PNG\r\n\x1a\n"
        else:
            assert b"<svg" in data[:2000]


def test_flow_diagram_for_a_model_layer_shows_its_head_layout():
    from attnlab.attention import Attention
    from attnlab.explain.figures import FlowShapes, flow_shapes

    layer = Attention(64, 8, num_kv_heads=2, rope=True)
    shapes = flow_shapes(layer, n_tokens=5, batch=3)
    assert isinstance(shapes, FlowShapes)
    texts = _texts(plot_attention_flow(shapes))
    # (B, T, C) in; queries (B, H, T, D); grouped keys/values (B, G, T, D); (B, H, T, T) scores.
    assert "3×5×64" in texts
    assert "3×8×5×8" in texts
    assert texts.count("3×2×5×8") == 2
    assert "3×8×5×5" in texts
    assert "d_k = 8" in texts
    assert "out_proj → 3×5×64" in texts
    joined = " ".join(texts)
    assert "G = 2 key/value heads" in joined and "RoPE" in joined


def test_flow_shapes_refuses_bad_sources():
    from attnlab.attention import Attention
    from attnlab.explain.figures import flow_shapes

    with pytest.raises(TypeError, match="`source` must be an AttentionTrace"):
        flow_shapes("journey")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`n_tokens` must be a positive int"):
        flow_shapes(Attention(16, 2), n_tokens=0)
    with pytest.raises(TypeError, match="`trace` must be an AttentionTrace or FlowShapes"):
        plot_attention_flow(42)  # type: ignore[arg-type]
