"""The walkthrough's terminal renderables turned into the page's walkthrough view
(:func:`walkthrough_from_renderables`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from attnlab.explain.html.page import PageWalkthrough, WalkthroughStep

if TYPE_CHECKING:
    pass


def _table_dict(table: Any) -> dict[str, Any]:
    """A rich Table of numbers as a page table: the very strings the terminal prints."""
    columns = list(table.columns)
    texts = [[str(c) for c in col.cells] for col in columns]
    # matrix_table puts the row labels first, left-justified; numbers are right-justified.
    has_labels = bool(columns) and columns[0].justify != "right"
    rows = texts[0] if has_labels else None
    value_cols = columns[1:] if has_labels else columns
    value_texts = texts[1:] if has_labels else texts
    n_rows = len(value_texts[0]) if value_texts else 0
    name = str(table.title or "")
    return {
        "name": name,
        "caption": name,
        "corner": str(columns[0].header) if has_labels else "",
        "rows": rows,
        "cols": [str(c.header) for c in value_cols],
        "cells": [[col[r] for col in value_texts] for r in range(n_rows)],
        "shade": "weights" in name,
    }


def walkthrough_from_renderables(renderables: list[Any]) -> PageWalkthrough:
    """The terminal walkthrough, as the page's walkthrough view.

    Takes what :func:`attnlab.explain.text.walkthrough_renderables` returns and keeps
    its titles, explanations and tables cell for cell, so the page shows the very
    numbers (and words, in the same language) that ``attnlab walkthrough`` prints.

    Args:
        renderables: the terminal walkthrough's renderables.

    Returns:
        The page walkthrough: one step per titled block, parts as ``part`` steps.
    """
    from rich.console import Group
    from rich.padding import Padding
    from rich.table import Table
    from rich.text import Text

    from attnlab.explain.text import Paragraph

    def collect(obj: Any, tables: list[dict[str, Any]], lines: list[str]) -> None:
        if isinstance(obj, Table):
            tables.append(_table_dict(obj))
        elif isinstance(obj, Text):
            if obj.plain.strip():
                lines.append(obj.plain.strip())
        elif isinstance(obj, Padding):
            collect(obj.renderable, tables, lines)
        elif isinstance(obj, Group):
            for sub in obj.renderables:
                collect(sub, tables, lines)

    intro: list[str] = []
    steps: list[WalkthroughStep] = []
    for r in renderables:
        if isinstance(r, Paragraph):
            if not steps:
                intro.append(r.text)
            continue
        if not isinstance(r, Group):
            continue
        items = list(r.renderables)
        if not items or not isinstance(items[0], Paragraph):
            continue
        title = items[0].text
        if "underline" in str(items[0].style):
            steps.append(WalkthroughStep(id=f"part-{len(steps)}", title=title, kind="part"))
            continue
        body = " ".join(p.text for p in items[1:] if isinstance(p, Paragraph))
        tables: list[dict[str, Any]] = []
        lines: list[str] = []
        for sub in items[1:]:
            if not isinstance(sub, Paragraph):
                collect(sub, tables, lines)
        steps.append(
            WalkthroughStep(
                id=f"step-{len(steps)}",
                title=title,
                body=body,
                code="\n".join(lines),
                tables=tuple(tables),
            )
        )
    return PageWalkthrough(steps=tuple(steps), intro=" \u2014 ".join(intro))
