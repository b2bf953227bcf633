"""Tables of a model's analyses: what heads do (:func:`roles_table`,
:func:`ablation_table`) and why a token came out (:func:`attribution_table`,
:func:`patch_table`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from rich import box
from rich.table import Table


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
