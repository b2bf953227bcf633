"""The walkthrough's figures of one attention computation: the weights heatmap
(:func:`plot_attention_weights`), the flow diagram of shapes and operations
(:func:`plot_attention_flow`, :func:`flow_shapes`) and both saved for every step
(:func:`save_walkthrough_figures`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from attnlab.explain.figures.base import (
    _ARROW,
    _NOTE,
    _OP_EDGE,
    _OP_FACE,
    _TENSOR_EDGE,
    _TENSOR_FACE,
    ANNOTATE_MAX,
    _drawing,
    _luminance,
    _new_axes,
    _tick_positions,
)
from attnlab.explain.fonts import figure_lang
from attnlab.explain.i18n import message
from attnlab.explain.trace import AttentionTrace

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from attnlab.attention import Attention


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
