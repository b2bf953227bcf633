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
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from attnlab.explain.fonts import FigureLang, figure_lang
from attnlab.explain.i18n import message
from attnlab.explain.trace import AttentionTrace

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from attnlab.attention import Attention
    from attnlab.explain.model_trace import ModelTrace

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


def plot_attention_weights(
    weights: torch.Tensor,
    tokens: Sequence[str],
    ax: Axes | None = None,
    *,
    key_tokens: Sequence[str] | None = None,
    title: str | None = None,
    cmap: str = "Blues",
    annotate: bool | None = None,
    lang: str = "en",
) -> Figure:
    """Heatmap of attention weights with the tokens on both axes and values in the cells.

    Rows are queries (the token attending), columns keys (the token attended to);
    each row sums to 1. Cell text is the weight to 4 decimals, as in the tables.
    Long inputs (more than :data:`ANNOTATE_MAX` tokens) get no cell text by default,
    and at most :data:`MAX_TICK_LABELS` token labels per axis.

    Args:
        weights: ``(T, S)`` attention weights.
        tokens: ``T`` query labels (also the key labels when ``key_tokens`` is None).
        ax: draw into this Axes; by default a new Figure.
        key_tokens: ``S`` key labels.
        title: the axes title (default "Attention weights" in ``lang``).
        cmap: a matplotlib colormap name.
        annotate: write the weights in the cells; default when both sides have at
            most :data:`ANNOTATE_MAX` tokens.
        lang: ``"en"`` or ``"zh-TW"`` (axis labels and default title; English
            without a CJK font).

    Returns:
        The Figure.

    Raises:
        TypeError: ``weights`` is not a floating tensor.
        ValueError: ``weights`` not 2-D, or label counts that do not match.

    Shape:
        - weights: ``(T, S)``
    """
    from attnlab.functional import check_tensor

    w = check_tensor("weights", weights, ndims=(2,)).detach().float().cpu()
    n_rows, n_cols = w.shape
    keys = list(tokens if key_tokens is None else key_tokens)
    if len(tokens) != n_rows:
        raise ValueError(f"`tokens` must have {n_rows} labels (rows of weights), got {len(tokens)}")
    if len(keys) != n_cols:
        raise ValueError(
            f"`key_tokens` must have {n_cols} labels (columns of weights), got {len(keys)}"
        )
    if annotate is None:
        annotate = max(n_rows, n_cols) <= ANNOTATE_MAX
    with _drawing(lang) as fl:
        return _weights_figure(w, list(tokens), keys, ax, title, cmap, annotate, fl.lang)


def _weights_figure(
    w: torch.Tensor,
    tokens: list[str],
    keys: list[str],
    ax: Axes | None,
    title: str | None,
    cmap: str,
    annotate: bool,
    lang: str,
) -> Figure:
    n_rows, n_cols = w.shape
    size = min(12.0, max(4.5, 0.9 * n_cols + 2.5))
    fig, ax = _new_axes(ax, (size + 1.0, size))
    vmax = max(float(w.max()), 1e-12)
    im = ax.imshow(w.numpy(), cmap=cmap, vmin=0.0, vmax=vmax, interpolation="nearest")
    font = 10 if n_cols <= 8 else max(5, 10 - (n_cols - 8) // 2)
    for i in range(n_rows if annotate else 0):
        for j in range(n_cols):
            v = float(w[i, j])
            dark = _luminance(im.cmap(v / vmax)) < 0.2  # the cell's colour (vmin is 0)
            ax.text(
                j,
                i,
                f"{v:.4f}",
                ha="center",
                va="center",
                fontsize=font,
                color="white" if dark else "#1a202c",
            )
    xs, ys = _tick_positions(n_cols), _tick_positions(n_rows)
    ax.set_xticks(xs, [keys[j] for j in xs], rotation=35, ha="right", rotation_mode="anchor")
    ax.set_yticks(ys, [tokens[i] for i in ys])
    ax.set_xlabel(message("fig.key_axis", lang))
    ax.set_ylabel(message("fig.query_axis", lang))
    ax.set_title(
        title if title is not None else message("fig.weights", lang), loc="left", fontsize=11
    )
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    cbar = fig.colorbar(im, ax=ax, shrink=0.8, pad=0.03)
    cbar.set_label(message("fig.weight_bar", lang))
    return fig


def _box(
    ax: Axes,
    xy: tuple[float, float],
    lines: Sequence[str],
    *,
    op: bool,
    width: float,
    height: float,
    bold: str = "bold",
) -> None:
    from matplotlib.patches import FancyBboxPatch

    x, y = xy
    face, edge = (_OP_FACE, _OP_EDGE) if op else (_TENSOR_FACE, _TENSOR_EDGE)
    ax.add_patch(
        FancyBboxPatch(
            (x - width / 2, y - height / 2),
            width,
            height,
            boxstyle="round,pad=0,rounding_size=1.2",
            facecolor=face,
            edgecolor=edge,
            linewidth=1.4,
            zorder=2,
        )
    )
    n = len(lines)
    step = min(2.6, (height - 1.6) / max(n - 1, 1))
    top = y + step * (n - 1) / 2
    for k, line in enumerate(lines):
        ax.text(
            x,
            top - k * step,
            line,
            ha="center",
            va="center",
            zorder=3,
            fontsize=10.5 if k == 0 else 9.5,
            fontweight=bold if k == 0 else "normal",
            color="#1a202c" if k == 0 else _NOTE,
        )


def _arrow(
    ax: Axes,
    start: tuple[float, float],
    end: tuple[float, float],
    *,
    label: str | None = None,
    label_xy: tuple[float, float] | None = None,
    connection: str = "arc3",
) -> None:
    from matplotlib.patches import FancyArrowPatch

    ax.add_patch(
        FancyArrowPatch(
            start,
            end,
            arrowstyle="-|>",
            mutation_scale=14,
            color=_ARROW,
            linewidth=1.3,
            connectionstyle=connection,
            zorder=1,
            shrinkA=0,
            shrinkB=0,
        )
    )
    if label:
        lx, ly = label_xy if label_xy is not None else ((start[0] + end[0]) / 2, end[1] + 1.6)
        ax.text(lx, ly, label, ha="center", va="bottom", fontsize=9, color=_NOTE, zorder=3)


@dataclass(frozen=True)
class FlowShapes:
    """What the flow diagram writes in its boxes: the shapes of one attention computation.

    Build it with :func:`flow_shapes` from the seed example's trace or from any model's
    :class:`~attnlab.attention.Attention` layer and an input length.
    """

    title: str
    note: str  # the projection convention / head layout, under the title
    inputs: str
    projections: tuple[str, str, str]  # formula per box: Q, K, V
    q: str
    k: str
    v: str
    scores: str
    d_k: int
    weights: str
    context: str
    output: str | None = None  # the layer's output after out_proj, when there is one


def _dims(*sizes: int) -> str:
    # Tight for 3-D and 4-D shapes, so that they fit the operation boxes.
    return (" × " if len(sizes) <= 2 else "×").join(str(n) for n in sizes)


def flow_shapes(
    source: AttentionTrace | Attention,
    *,
    n_tokens: int | None = None,
    batch: int = 1,
    lang: str = "en",
) -> FlowShapes:
    """The shapes of one attention computation, for :func:`plot_attention_flow`.

    Args:
        source: the seed example's trace, or a model's attention layer.
        n_tokens: with a layer: the number of tokens T (keys S = T, self-attention).
        batch: with a layer: the batch size B.
        lang: the language of the title (``"en"`` or ``"zh-TW"``).

    Returns:
        The shapes, as the diagram writes them.

    Raises:
        TypeError: ``source`` is neither.
        ValueError: a layer without a positive ``n_tokens``, or a batch below 1.
    """
    from attnlab.attention import Attention

    if isinstance(source, AttentionTrace):
        n, d_in, d = source.n_tokens, source.d_in, source.d_out
        explicit = source.projection.convention == "x @ W.T"
        t = "^{\\top}" if explicit else ""
        note = (
            f"projection inputs @ W.T, W of shape (d_out, d_in) = ({d}, {d_in}) (nn.Linear)"
            if explicit
            else f"projection x @ W, W of shape (d_in, d_out) = ({d_in}, {d})"
        )
        return FlowShapes(
            title=message("fig.flow_example", lang, example=source.example, n=n, d_in=d_in, d=d),
            note=note,
            inputs=_dims(n, d_in),
            projections=(f"$Q = X\\,W_q{t}$", f"$K = X\\,W_k{t}$", f"$V = X\\,W_v{t}$"),
            q=_dims(n, d),
            k=_dims(n, d),
            v=_dims(n, d),
            scores=_dims(n, n),
            d_k=source.trainable.d_k,
            weights=_dims(n, n),
            context=_dims(n, d),
        )
    if not isinstance(source, Attention):
        raise TypeError(
            f"`source` must be an AttentionTrace or an attnlab.attention.Attention layer, "
            f"got {type(source).__name__}"
        )
    if not isinstance(n_tokens, int) or isinstance(n_tokens, bool) or n_tokens < 1:
        raise ValueError(f"`n_tokens` must be a positive int for a layer, got {n_tokens!r}")
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"`batch` must be a positive int, got {batch!r}")
    B, T, C = batch, n_tokens, source.embed_dim
    H, G, D = source.num_heads, source.num_kv_heads, source.head_dim
    heads = f"H = {H} query heads" + (f", G = {G} key/value heads" if G != H else "")
    rope = ", RoPE on Q and K" if source.rope is not None else ""
    return FlowShapes(
        title=message("fig.flow_layer", lang, B=B, T=T, C=C, D=D),
        note=f"shapes (B, heads, T, D); {heads}{rope}; output projection back to C",
        inputs=_dims(B, T, C),
        projections=("$Q = X\\,W_q$", "$K = X\\,W_k$", "$V = X\\,W_v$"),
        q=_dims(B, H, T, D),
        k=_dims(B, G, T, D),
        v=_dims(B, G, T, D),
        scores=_dims(B, H, T, T),
        d_k=D,
        weights=_dims(B, H, T, T),
        context=_dims(B, H, T, D),
        output=_dims(B, T, C),
    )


def plot_attention_flow(
    source: AttentionTrace | FlowShapes, ax: Axes | None = None, *, lang: str = "en"
) -> Figure:
    """Diagram of scaled dot-product self-attention, annotated with real shapes.

    inputs X → Q, K, V → Q·Kᵀ → ÷√d_k → softmax → weights → weights·V → context.
    Blue boxes are tensors (with their shapes), amber boxes operations.

    Args:
        source: the seed example's trace, or :class:`FlowShapes` (e.g. from a model's
            layer via :func:`flow_shapes`).
        ax: draw into this Axes; by default a new Figure.
        lang: ``"en"`` or ``"zh-TW"`` (the labels; English without a CJK font).

    Returns:
        The Figure.

    Raises:
        TypeError: ``source`` is neither.
    """
    with _drawing(lang) as fl:
        return _flow_figure(source, ax, fl.lang)


def _flow_figure(source: AttentionTrace | FlowShapes, ax: Axes | None, lang: str) -> Figure:
    def t(key: str) -> str:
        return message(key, lang)

    bold = "bold" if lang == "en" else "normal"  # the CJK font has one weight

    if isinstance(source, AttentionTrace):
        source = flow_shapes(source, lang=lang)
    if not isinstance(source, FlowShapes):
        raise TypeError(
            f"`trace` must be an AttentionTrace or FlowShapes, got {type(source).__name__}"
        )
    fs = source

    fig, ax = _new_axes(ax, (13.8, 5.4))
    ax.set_xlim(0, 138)
    ax.set_ylim(0, 54)
    ax.set_aspect("equal")
    ax.axis("off")

    tw, th = 17.0, 10.0  # tensor box
    ow, oh = 13.0, 8.0  # operation box
    X, Q, K, V = (9.5, 27.0), (33.0, 43.0), (33.0, 27.0), (33.0, 8.0)
    QK, SC, SM = (54.0, 35.0), (72.0, 35.0), (90.0, 35.0)
    A, AV, Z = (110.0, 35.0), (110.0, 8.0), (128.5, 8.0)

    _box(ax, X, [t("fig.inputs"), fs.inputs], op=False, width=tw - 2, height=th + 4, bold=bold)
    for label, formula, shape, pos in zip(
        (t("fig.queries"), t("fig.keys"), t("fig.values")),
        fs.projections,
        (fs.q, fs.k, fs.v),
        (Q, K, V),
        strict=True,
    ):
        _box(ax, pos, [label, formula, shape], op=False, width=tw, height=th + 2, bold=bold)
        _arrow(ax, (X[0] + (tw - 2) / 2, X[1]), (pos[0] - tw / 2, pos[1]))

    _box(
        ax,
        QK,
        ["$Q\\,K^{\\top}$", t("fig.scores"), fs.scores],
        op=True,
        width=ow,
        height=oh + 3,
        bold=bold,
    )
    _arrow(ax, (Q[0] + tw / 2, Q[1]), (QK[0] - ow / 2, QK[1] + 2), connection="arc3,rad=-0.15")
    _arrow(ax, (K[0] + tw / 2, K[1]), (QK[0] - ow / 2, QK[1] - 2), connection="arc3,rad=0.15")

    _box(
        ax,
        SC,
        ["$\\div\\sqrt{d_k}$", f"d_k = {fs.d_k}", fs.scores],
        op=True,
        width=ow,
        height=oh + 3,
        bold=bold,
    )
    _arrow(ax, (QK[0] + ow / 2, QK[1]), (SC[0] - ow / 2, SC[1]))

    _box(ax, SM, ["softmax", "dim = -1", fs.weights], op=True, width=ow, height=oh + 3, bold=bold)
    _arrow(ax, (SC[0] + ow / 2, SC[1]), (SM[0] - ow / 2, SM[1]))

    a_lines = [t("fig.weights_a"), fs.weights, t("fig.rows_sum")]
    _box(ax, A, a_lines, op=False, width=tw, height=th + 2, bold=bold)
    _arrow(ax, (SM[0] + ow / 2, SM[1]), (A[0] - tw / 2, A[1]))

    _box(
        ax, AV, ["$A\\,V$", "weights · V", fs.context], op=True, width=ow, height=oh + 3, bold=bold
    )
    _arrow(ax, (V[0] + tw / 2, V[1]), (AV[0] - ow / 2, AV[1]))
    _arrow(ax, (A[0], A[1] - (th + 2) / 2), (AV[0], AV[1] + (oh + 3) / 2))

    z_lines = [t("fig.context_z"), fs.context]
    if fs.output is not None:
        z_lines.append(f"out_proj → {fs.output}")
    zw = tw - 2 if fs.output is None else tw
    _box(ax, Z, z_lines, op=False, width=zw, height=th + 2, bold=bold)
    _arrow(ax, (AV[0] + ow / 2, AV[1]), (Z[0] - zw / 2, Z[1]))

    ax.set_title(fs.title, loc="left", fontsize=12, fontweight=bold)
    ax.text(0.5, 51.0, fs.note, ha="left", va="center", fontsize=9.5, color=_NOTE)
    from matplotlib.patches import Patch

    ax.legend(
        handles=[
            Patch(facecolor=_TENSOR_FACE, edgecolor=_TENSOR_EDGE, label=t("fig.tensor")),
            Patch(facecolor=_OP_FACE, edgecolor=_OP_EDGE, label=t("fig.operation")),
        ],
        loc="upper right",
        bbox_to_anchor=(1.0, 1.02),
        frameon=False,
        fontsize=9,
        ncols=2,
    )
    return fig


def save_walkthrough_figures(
    trace: AttentionTrace, out_dir: str | Path, *, lang: str = "en"
) -> list[Path]:
    """Write the walkthrough's figures as PNG and SVG into ``out_dir`` (created if needed).

    Files: ``attention-weights-simplified``, ``attention-weights-trainable`` (heatmaps)
    and ``attention-flow`` (diagram), each ``.png`` and ``.svg``.

    Args:
        trace: the computed trace.
        out_dir: the folder.
        lang: ``"en"`` or ``"zh-TW"`` (figure text; English without a CJK font).

    Returns:
        The paths written.

    Raises:
        OSError: the folder cannot be created or written.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokens = list(trace.tokens)
    figures = {
        "attention-weights-simplified": plot_attention_weights(
            trace.simplified.weights,
            tokens,
            title=message("fig.simplified", figure_lang(lang).lang),
            lang=lang,
        ),
        "attention-weights-trainable": plot_attention_weights(
            trace.trainable.weights,
            tokens,
            title=message("fig.trainable", figure_lang(lang).lang, d_k=trace.trainable.d_k),
            lang=lang,
        ),
        "attention-flow": plot_attention_flow(trace, lang=lang),
    }
    paths: list[Path] = []
    for stem, fig in figures.items():
        for ext in ("png", "svg"):
            path = out / f"{stem}.{ext}"
            # Fixed metadata keeps the files reproducible (no creation dates).
            meta = {"Software": None} if ext == "png" else {"Date": None, "Creator": None}
            fig.savefig(path, dpi=150, metadata=meta)
            paths.append(path)
    return paths


# ------------------------------------------------------------- model traces (issue 6)


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


# ------------------------------------------------------------------ why this token


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
