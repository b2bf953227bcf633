"""Render an :class:`~attnlab.explain.trace.AttentionTrace` as terminal tables.

Builds rich renderables (labelled tables, numbers to 4 decimals, one or two
sentences per step) and returns them; printing is the caller's job (the CLI owns
the one console). Every number comes from the trace.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from rich import box
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from attnlab.explain.i18n import DEFAULT_LANG, message, normalize_lang
from attnlab.explain.trace import AttentionTrace

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

DECIMALS = 4


def format_number(value: float) -> str:
    """A number as the book prints it: 4 decimals."""
    return f"{value:.{DECIMALS}f}"


def matrix_table(
    title: str,
    matrix: torch.Tensor,
    *,
    row_labels: Sequence[str] | None = None,
    col_labels: Sequence[str] | None = None,
    corner: str = "",
    extra: tuple[str, torch.Tensor] | None = None,
) -> Table:
    """A labelled table of a 1-D or 2-D tensor, 4 decimals.

    Args:
        title: the table's label.
        matrix: ``(R, C)``, or ``(C,)`` shown as one row.
        row_labels: one per row; default none.
        col_labels: one per column; default ``0, 1, ...``.
        corner: header of the row-label column.
        extra: ``(header, values (R,))`` appended as a last, highlighted column.

    Returns:
        The table.
    """
    m = matrix.detach().reshape(1, -1) if matrix.ndim == 1 else matrix.detach()  # (R, C)
    n_rows, n_cols = m.shape
    table = Table(
        title=title,
        title_justify="left",
        title_style="bold",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        show_edge=False,
    )
    if row_labels is not None:
        table.add_column(corner, style="cyan", no_wrap=True)
    for name in col_labels if col_labels is not None else [str(j) for j in range(n_cols)]:
        table.add_column(name, justify="right", no_wrap=True)
    if extra is not None:
        table.add_column(extra[0], justify="right", style="green", no_wrap=True)
    rows = m.tolist()
    extra_values = extra[1].detach().reshape(-1).tolist() if extra is not None else None
    for i in range(n_rows):
        cells = [format_number(v) for v in rows[i]]
        if row_labels is not None:
            cells.insert(0, row_labels[i])
        if extra_values is not None:
            cells.append(format_number(extra_values[i]))
        table.add_row(*cells)
    return table


def _is_wide(ch: str) -> bool:
    return cell_len(ch) == 2


def wrap_text(text: str, width: int) -> list[str]:
    """Wrap ``text`` to ``width`` terminal cells, breaking at spaces or between CJK characters.

    Chinese has no spaces between words, so a line may break after any CJK character
    (but not before closing punctuation); Latin words and numbers are kept whole.
    """
    units: list[str] = []  # words, single CJK characters, and " " break points
    word = ""
    for ch in text:
        if ch == " " or _is_wide(ch):
            if word:
                units.append(word)
                word = ""
            if ch != " " and ch in _NO_BREAK_BEFORE and units and units[-1] != " ":
                units[-1] += ch  # keep closing punctuation on the line it closes
            else:
                units.append(ch)
        else:
            word += ch
    if word:
        units.append(word)
    lines: list[str] = []
    line = ""
    for unit in units:
        if unit == " ":
            if line:
                line += " "
            continue
        if line.strip() and cell_len(line + unit) > width:
            lines.append(line.rstrip(" "))
            line = ""
        line += unit
    if line.strip():
        lines.append(line.rstrip(" "))
    return lines


_NO_BREAK_BEFORE = set("，。、；：？！）」』》〉")


class Paragraph:
    """Text wrapped to the console width (CJK-aware), indented, no trailing spaces."""

    def __init__(self, text: str, indent: int = 2, style: str = "") -> None:
        self.text = text
        self.indent = indent
        self.style = style

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = max(20, options.max_width - self.indent)
        for line in wrap_text(self.text, width):
            yield Text(" " * self.indent + line, style=self.style, no_wrap=True)


def _step(title: str, text: str, *tables: RenderableType) -> RenderableType:
    return Group(
        Paragraph(title, indent=0, style="bold magenta"),
        Paragraph(text),
        *(Group(Text(""), Padding(t, (0, 0, 0, 2), expand=False)) for t in tables),
        Text(""),
    )


def _part(title: str) -> RenderableType:
    return Group(Paragraph(title, indent=0, style="bold underline"), Text(""))


def walkthrough_renderables(
    trace: AttentionTrace, lang: str = DEFAULT_LANG
) -> list[RenderableType]:
    """The walkthrough of ``trace`` as renderables, in the seed text's order.

    Part 1 is the simplified form (scores, weights with row sums, context vectors),
    part 2 the trainable walk for token ``trace.index`` then all tokens at once, part
    3 the ``SelfAttentionV1`` / ``SelfAttentionV2`` outputs and the weight copy.

    Args:
        trace: the computed trace.
        lang: ``"en"`` or ``"zh-TW"``.

    Returns:
        Renderables to print in order.

    Raises:
        ValueError: an unsupported language.
    """
    lang = normalize_lang(lang)

    def msg(key: str, **values: object) -> str:
        return message(key, lang, **values)

    t = trace
    n, d_in, d = t.n_tokens, t.d_in, t.d_out
    tokens = list(t.tokens)
    pos = t.index + 1  # the book counts tokens from 1 (x_2 is inputs[1])
    token = t.tokens[t.index]
    tok_label = msg("label.token")
    row_sum = msg("label.row_sum")
    in_cols = [f"x[{j}]" for j in range(d_in)]
    out_cols = [f"[{j}]" for j in range(d)]
    s, tr, tt, proj = t.simplified, t.trainable, t.trainable_token, t.projection
    explicit = proj.convention == "x @ W.T"

    def op(w: str) -> str:
        return f"@ {w}.T" if explicit else f"@ {w}"

    out: list[RenderableType] = [
        Paragraph(msg("header", example=t.example, n=n, d_in=d_in), indent=0, style="bold"),
        Paragraph(
            msg(f"example.{t.example}" if t.example in ("journey", "toy") else "example.custom"),
            indent=0,
        ),
        Text(""),
        _part(msg("part.simplified")),
        _step(
            msg("inputs.title", n=n, d_in=d_in),
            msg("inputs.text"),
            matrix_table(
                "inputs", t.inputs, row_labels=tokens, col_labels=in_cols, corner=tok_label
            ),
        ),
        _step(
            msg("scores.title", n=n),
            msg("scores.text"),
            matrix_table("attn_scores", s.scores, row_labels=tokens, col_labels=tokens),
        ),
        _step(
            msg("weights.title", n=n),
            msg("weights.text"),
            matrix_table(
                "attn_weights",
                s.weights,
                row_labels=tokens,
                col_labels=tokens,
                extra=(row_sum, s.row_sums),
            ),
        ),
        _step(
            msg("context.title", n=n, d=d_in),
            msg("context.text"),
            matrix_table("all_context_vecs", s.context, row_labels=tokens, col_labels=in_cols),
        ),
        _part(msg("part.trainable", pos=pos, token=token)),
    ]

    shape = tuple(proj.W_query.shape)
    w_cols = [f"[{j}]" for j in range(shape[1])]
    matrices_text = msg("matrices.explicit") if explicit else msg("matrices.seeded", seed=proj.seed)
    out.append(
        _step(
            msg("matrices.title", rows=shape[0], cols=shape[1]),
            matrices_text,
            *(
                matrix_table(name, w, col_labels=w_cols)
                for name, w in (
                    ("W_query", proj.W_query),
                    ("W_key", proj.W_key),
                    ("W_value", proj.W_value),
                )
            ),
        )
    )
    qkv = torch.stack([tt.query, tt.key, tt.value])  # (3, d)
    out.append(
        _step(
            msg("token_qkv.title", pos=pos, token=token),
            msg("token_qkv.text"),
            matrix_table(f"x_{pos}", tt.x, col_labels=in_cols),
            matrix_table(
                f"x_{pos} projected",
                qkv,
                row_labels=[
                    f"query_{pos} = x_{pos} {op('W_query')}",
                    f"key_{pos} = x_{pos} {op('W_key')}",
                    f"value_{pos} = x_{pos} {op('W_value')}",
                ],
                col_labels=out_cols,
            ),
        )
    )
    out.append(
        _step(
            msg("keys_values.title", n=n, d=d),
            msg("keys_values.text", pos=pos, op_k=op("W_key"), op_v=op("W_value")),
            matrix_table("keys", tr.keys, row_labels=tokens, col_labels=out_cols),
            matrix_table("values", tr.values, row_labels=tokens, col_labels=out_cols),
        )
    )
    out.append(
        _step(
            msg("score_self.title", pos=pos),
            msg("score_self.text", pos=pos),
            Text(f"attn_score_{pos}{pos} = {format_number(tt.score_self)}", style="bold"),
        )
    )
    out.append(
        _step(
            msg("token_scores.title", pos=pos, n=n),
            msg("token_scores.text", pos=pos),
            matrix_table(f"attn_scores_{pos}", tt.scores, col_labels=tokens),
        )
    )
    scale = tr.scale if tr.scale is not None else 1.0
    out.append(
        _step(
            msg("token_weights.title", pos=pos, d_k=tr.d_k),
            msg("token_weights.text", sqrt_dk=1.0 / scale),
            matrix_table(f"attn_scores_{pos} / √d_k", tt.scaled_scores, col_labels=tokens),
            matrix_table(
                f"attn_weights_{pos}",
                tt.weights,
                col_labels=tokens,
                extra=(msg("label.row_sum"), torch.tensor([tt.weights_sum])),
            ),
        )
    )
    out.append(
        _step(
            msg("token_context.title", pos=pos, d=d),
            msg("token_context.text"),
            matrix_table(f"context_vec_{pos}", tt.context, col_labels=out_cols),
        )
    )
    out.append(
        _step(
            msg("all.title", n=n),
            msg("all.text", pos=pos, diff=t.checks.token_vs_all),
            matrix_table(
                "attn_weights",
                tr.weights,
                row_labels=tokens,
                col_labels=tokens,
                extra=(row_sum, tr.row_sums),
            ),
            matrix_table("context_vecs", tr.context, row_labels=tokens, col_labels=out_cols),
        )
    )

    out.append(_part(msg("part.modules")))
    for run in t.modules:
        if run.role == "v1":
            text = msg("v1.text.seeded", pos=pos, diff=t.checks.module_vs_walk)
        elif run.role == "v2":
            text = (
                msg("v2.text.explicit", diff=t.checks.module_vs_walk)
                if explicit
                else msg("v2.text.seeded")
            )
        else:
            text = msg("copy.text", diff=t.checks.v1_from_v2_vs_v2)
        out.append(
            _step(
                f"{run.name}: {run.built}",
                text,
                matrix_table(run.name, run.output, row_labels=tokens, col_labels=out_cols),
            )
        )
    return out


# ------------------------------------------------------------- step into a head

MAX_COLS = 8  # vector entries shown in the terminal (the first 6, "…", the last 2)
MAX_ROWS = 16  # token rows shown (the first 12, "…", the last 4)


def _keep(n: int, limit: int, tail: int) -> list[int | None]:
    """Indices to show of ``n`` (None marks the gap), at most ``limit`` of them."""
    if n <= limit:
        return list(range(n))
    head = limit - tail
    return [*range(head), None, *range(n - tail, n)]


def _section_table(tbl: dict[str, Any], lang: str) -> RenderableType:
    """One table of :func:`attnlab.explain.steps.step_sections`, truncated for a terminal."""
    values: list[list[float | None]] = tbl["values"]
    rows, cols = tbl["rows"], tbl["cols"]
    name = tbl["name"]
    if len(values) == 1 and rows is None and cols and not cols[0].isdigit():
        # A value per token: one row per token reads better than a very wide row.
        values = [[v] for v in values[0]]
        rows, cols = cols, [name]
    n_rows, n_cols = len(values), len(values[0]) if values else 0
    keep_r = _keep(n_rows, MAX_ROWS, 4)
    keep_c = _keep(n_cols, MAX_COLS, 2)
    table = Table(
        title=name,
        title_justify="left",
        title_style="bold",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        show_edge=False,
    )
    if rows is not None:
        corner = tbl.get("corner")
        header = message("label.token", lang) if corner is None else corner
        table.add_column(header, style="cyan", no_wrap=True)
    for j in keep_c:
        table.add_column("…" if j is None else cols[j], justify="right", no_wrap=True)

    def cell(v: float | None) -> str:
        return "-inf" if v is None else format_number(v)

    for i in keep_r:
        if i is None:
            table.add_row(*(["…"] * (len(keep_c) + (rows is not None))))
            continue
        cells = ["…" if j is None else cell(values[i][j]) for j in keep_c]
        if rows is not None:
            cells.insert(0, str(rows[i]))
        table.add_row(*cells)
    if n_rows > MAX_ROWS or n_cols > MAX_COLS:
        shown = f"{len(keep_r) - (n_rows > MAX_ROWS)}×{len(keep_c) - (n_cols > MAX_COLS)}"
        table.caption = message("step.more", lang, n=shown, total=f"{n_rows}×{n_cols}")
        table.caption_justify = "left"
    return table


def step_renderables(
    summary: str, sections: Sequence[dict[str, Any]], lang: str = DEFAULT_LANG
) -> list[RenderableType]:
    """A walk into a head (:func:`attnlab.explain.steps.step_sections`) as renderables.

    Long vectors and long token lists are shown truncated (the page shows them whole).

    Args:
        summary: the header line (:func:`attnlab.explain.steps.step_summary`).
        sections: the sections, in order.
        lang: ``"en"`` or ``"zh-TW"`` (the table labels).

    Returns:
        Renderables to print in order.
    """
    lang = normalize_lang(lang)
    out: list[RenderableType] = [Paragraph(summary, indent=0, style="bold"), Text("")]
    for i, sec in enumerate(sections, 1):
        out.append(
            _step(
                f"{i}. {sec['title']}",
                sec["body"],
                *(_section_table(t, lang) for t in sec["tables"]),
            )
        )
    return out


def roles_table(scores: dict[str, torch.Tensor], k: int = 5) -> Table:
    """The strongest ``k`` heads of every role (:func:`attnlab.explain.head_scores`).

    Args:
        scores: role -> ``(L, H)`` scores.
        k: heads shown per role.

    Returns:
        A table, one row per role, cells ``"L.H score"`` strongest first.
    """
    from attnlab.explain.heads import strongest_heads

    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    table.add_column("role", style="cyan", no_wrap=True)
    for j in range(k):
        table.add_column(f"#{j + 1}", justify="right", no_wrap=True)
    for role, values in scores.items():
        cells = [f"{layer}.{head} {score:.2f}" for layer, head, score in strongest_heads(values, k)]
        table.add_row(role.replace("_", " "), *cells)
    return table


def ablation_table(
    title: str,
    before: tuple[list[str], list[float]],
    after: tuple[list[str], list[float]],
    after_header: str,
) -> Table:
    """Two top-k next-token lists side by side: the model's own and with heads ablated.

    Args:
        title: the table's label.
        before: (token texts, probabilities) of the unchanged model, most likely first.
        after: the same with the heads switched off.
        after_header: the second column's header (which heads are off).

    Returns:
        A table, one row per rank.
    """
    table = Table(
        title=title or None,
        title_justify="left",
        title_style="bold",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        show_edge=False,
    )
    table.add_column("#", justify="right")
    table.add_column("model", no_wrap=True)
    table.add_column(after_header, no_wrap=True)
    for i, (b_tok, b_p, a_tok, a_p) in enumerate(zip(*before, *after, strict=True), 1):
        table.add_row(str(i), f"{b_tok!r} {b_p:.3f}", f"{a_tok!r} {a_p:.3f}")
    return table


def attribution_components(attribution: Any) -> list[tuple[str, float]]:
    """Every part of an :class:`~attnlab.explain.Attribution`, largest ``|value|`` first.

    Heads are named ``"L.H"``, feed-forward blocks ``"mlp L"``, and the two constant parts
    ``"embedding"`` and ``"bias"``; the parts sum to ``total - error``.

    Returns:
        ``[(name, value), ...]``, sorted by ``|value|`` descending.
    """
    heads = attribution.heads.detach().float()  # (L, H)
    mlp = attribution.mlp.detach().float()  # (L,)
    parts = [("embedding", float(attribution.embedding)), ("bias", float(attribution.bias))]
    parts += [
        (f"{layer}.{head}", float(heads[layer, head]))
        for layer in range(heads.shape[0])
        for head in range(heads.shape[1])
    ]
    parts += [(f"mlp {layer}", float(mlp[layer])) for layer in range(mlp.shape[0])]
    return sorted(parts, key=lambda p: -abs(p[1]))


def attribution_table(attribution: Any, k: int = 10) -> Table:
    """The ``k`` largest parts of an attribution: value and share of ``total``.

    Args:
        attribution: an :class:`~attnlab.explain.Attribution`.
        k: rows shown (the largest ``|value|`` first).

    Returns:
        A table: component (``L.H``, ``mlp L``, ``embedding``, ``bias``), value, share.
    """
    total = float(attribution.total)
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    table.add_column("component", style="cyan", no_wrap=True)
    table.add_column("value", justify="right", no_wrap=True)
    table.add_column("share", justify="right", no_wrap=True)
    for name, value in attribution_components(attribution)[:k]:
        share = f"{100 * value / total:+.1f}%" if total != 0 else "-"
        table.add_row(name, f"{value:+.4f}", share)
    return table


def patch_table(grid: torch.Tensor, over: str, tokens: Sequence[str] | None = None) -> Table:
    """An activation-patching grid: layers down, heads (or positions) across.

    Args:
        grid: ``(L, H)`` for ``over="heads"``, ``(L, T)`` for ``"residual"`` / ``"mlp"``.
        over: what was patched (the columns' name).
        tokens: the column labels of an ``(L, T)`` grid (the clean prompt's tokens).

    Returns:
        A table of the normalised effects to 2 decimals (1 = the clean answer restored).
    """
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    table.add_column("layer" if over == "heads" else "layer \\ token", style="cyan")
    values = grid.detach().float()
    for j in range(values.shape[1]):
        label = str(j) if over == "heads" or tokens is None else f"{j} {tokens[j]!r}"
        table.add_column(label, justify="right", no_wrap=True)
    for layer in range(values.shape[0]):
        table.add_row(str(layer), *(f"{float(v):.2f}" for v in values[layer]))
    return table


def _viridis_hex(v: float) -> str:
    """The viridis colour of ``v`` in [0, 1] (9 stops, linear between them)."""
    stops = (
        (68, 1, 84),
        (71, 44, 122),
        (59, 81, 139),
        (44, 113, 142),
        (33, 144, 141),
        (39, 173, 129),
        (92, 200, 99),
        (170, 220, 50),
        (253, 231, 37),
    )
    x = min(max(v, 0.0), 1.0) * (len(stops) - 1)
    i = min(int(x), len(stops) - 2)
    f = x - i
    rgb = (round(a + (b - a) * f) for a, b in zip(stops[i], stops[i + 1], strict=True))
    return "#" + "".join(f"{c:02x}" for c in rgb)


HEAT_CELL = 4  # "0.12": two decimals always fit; a number is never cut


def heatmap_tables(
    title: str,
    matrix: torch.Tensor,
    row_labels: Sequence[str],
    col_labels: Sequence[str],
    width: int = 80,
) -> list[Table]:
    """A weights matrix as shaded terminal cells: two decimals on a viridis background.

    The shade runs from 0 to the matrix's largest value (the caption says which); a 0
    (a masked key) is a dot. Columns that do not fit ``width`` go on to a further table
    (as numpy wraps a wide array), so no number is ever truncated.

    Args:
        title: the first table's label.
        matrix: ``(R, C)`` values in [0, 1].
        row_labels: one per row (queries); shown whole up to 12 characters.
        col_labels: one per column (keys); shown in the cell's 4 characters, with the
            column number above.
        width: the terminal width to fit.

    Returns:
        One or more tables.
    """
    m = matrix.detach().float()
    R, C = m.shape
    top = float(m.max()) if m.numel() else 0.0
    labels = [repr(t)[1:-1] for t in row_labels]
    label_w = min(12, max((cell_len(t) for t in labels), default=1))
    per = max(1, (width - label_w - 2) // (HEAT_CELL + 1))
    tables: list[Table] = []
    for start in range(0, C, per):
        cols = range(start, min(C, start + per))
        table = Table(
            title=title if start == 0 else None,
            title_justify="left",
            title_style="bold",
            box=None,
            pad_edge=False,
            show_edge=False,
            padding=(0, 1, 0, 0),
            caption=f"shade: 0 .. {top:.2f} (viridis)" if start == 0 else None,
            caption_justify="left",
        )
        table.add_column("", style="cyan", no_wrap=True, max_width=label_w, overflow="ellipsis")
        for j in cols:
            key = repr(col_labels[j])[1:-1].strip() or "\u2423"
            table.add_column(
                Text(f"{j}\n{key[:HEAT_CELL]}", style="bold"),
                justify="right",
                no_wrap=True,
                min_width=HEAT_CELL,
                max_width=HEAT_CELL,
            )
        for i in range(R):
            cells: list[Any] = [labels[i]]
            for j in cols:
                v = float(m[i, j])
                shade = v / top if top > 0 else 0.0
                ink = "black" if shade > 0.6 else "white"
                text = f"{v:.2f}" if v > 0 else "\u00b7"
                cells.append(Text(text, style=f"{ink} on {_viridis_hex(shade)}"))
            table.add_row(*cells)
        tables.append(table)
    return tables
