"""What every terminal view shares: numbers to :data:`DECIMALS` places, a matrix as a
labelled table, text wrapped by display width (CJK included), and a paragraph that wraps
to the console.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from rich import box
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

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
