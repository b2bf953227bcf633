"""Stepping into one head in the terminal: each section of
:func:`attnlab.explain.steps.step_sections` as a table, long vectors and many tokens
elided in the middle (:func:`step_renderables`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich import box
from rich.console import RenderableType
from rich.table import Table
from rich.text import Text

from attnlab.explain.i18n import DEFAULT_LANG, message, normalize_lang
from attnlab.explain.text.base import Paragraph, _step, format_number

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
