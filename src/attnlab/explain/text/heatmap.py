"""A weights matrix as shaded terminal cells (:func:`heatmap_tables`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from rich.cells import cell_len
from rich.table import Table
from rich.text import Text


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
