"""Activation patching (:func:`patching`, :func:`patch`): the clean run's activations swapped
into the corrupted run one component at a time; and :func:`attribution_patching`, its
first-order estimate from one forward and one backward per prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from attnlab.explain.why.layout import (
    Over,
    TokenArg,
    _eval_mode,
    _Layout,
    _layout,
    _metric,
    _one_sequence,
    _vocab,
    token_id,
)

_PATCH_BATCH = 64  # patched variants per batch (memory: B x T x C per layer)


@dataclass(frozen=True)
class Patching:
    """Activation patching of ``m = logit(target) - logit(contrast)`` at the last position.

    Attributes:
        grid: ``(m - corrupted) / (clean - corrupted)`` per patched component: ``(L, H)``
            for heads, ``(L, T)`` for the residual stream and the MLPs.
        raw: the patched runs' ``m``, same shape as ``grid``.
        clean: ``m`` on the clean prompt.
        corrupted: ``m`` on the corrupted prompt.
        over: ``"heads"``, ``"residual"`` or ``"mlp"``.
        target: the target id.
        contrast: the contrast id.
    """

    grid: torch.Tensor
    raw: torch.Tensor
    clean: float
    corrupted: float
    over: str
    target: int
    contrast: int | None


@dataclass
class _Run:
    """One prompt's forward, as the patching needs it."""

    m: float
    streams: list[torch.Tensor]  # (1, T, C) entering each block
    contexts: list[torch.Tensor]  # (1, T, H*Dv) heads' outputs before the out-projection
    mlps: list[torch.Tensor]  # (1, T, C) feed-forward writes


def _pair(
    model: nn.Module,
    clean_ids: Sequence[int] | torch.Tensor,
    corrupted_ids: Sequence[int] | torch.Tensor,
    target: TokenArg,
    contrast: TokenArg | None,
    tokenizer: Any,
    what: str,
) -> tuple[_Layout, torch.Tensor, torch.Tensor, int, int | None]:
    layout = _layout(model, what)
    clean = _one_sequence(model, clean_ids, "clean_ids")
    corrupted = _one_sequence(model, corrupted_ids, "corrupted_ids")
    if clean.shape[1] != corrupted.shape[1]:
        raise ValueError(
            f"`clean_ids` ({clean.shape[1]} tokens) and `corrupted_ids` "
            f"({corrupted.shape[1]} tokens) must have the same length: patching swaps "
            "activations position by position"
        )
    V = _vocab(layout)
    t = token_id(target, "target", V, tokenizer)
    c = None if contrast is None else token_id(contrast, "contrast", V, tokenizer)
    return layout, clean, corrupted, t, c


def _record_run(
    model: nn.Module, layout: _Layout, input_ids: torch.Tensor, t: int, c: int | None
) -> _Run:
    from attnlab.attention import edit_heads
    from attnlab.models._lm import edit_block_input, edit_mlp

    L = len(layout.blocks)
    index = {id(a): i for i, a in enumerate(layout.attentions)}
    blocks = {id(b): i for i, b in enumerate(layout.blocks)}
    streams: list[Any] = [None] * L
    contexts: list[Any] = [None] * L
    mlps: list[Any] = [None] * L

    def stream(i: int, x: torch.Tensor) -> torch.Tensor:
        streams[i] = x.detach()
        return x

    def heads(layer: Any, context: torch.Tensor) -> torch.Tensor:
        i = index.get(id(layer))
        if i is not None:
            contexts[i] = context.detach()
        return context

    def mlp(block: nn.Module, m: torch.Tensor) -> torch.Tensor:
        i = blocks.get(id(block))
        if i is not None:
            mlps[i] = m.detach()
        return m

    with (
        _eval_mode(model),
        torch.no_grad(),
        edit_block_input(stream),
        edit_heads(heads),
        edit_mlp(mlp),
    ):
        logits = model(input_ids, logits_to_keep=1)  # type: ignore[operator]
    return _Run(float(_metric(logits, t, c)[0]), streams, contexts, mlps)


def _patched(
    model: nn.Module,
    layout: _Layout,
    corrupted: torch.Tensor,
    layer: int,
    chosen: torch.Tensor,
    over: str,
    good: _Run,
    bad: _Run,
    t: int,
    c: int | None,
) -> torch.Tensor:
    """``m`` of the corrupted run with component ``chosen[b]`` of ``layer`` taken from the
    clean run in batch row ``b`` ``(B,)``: one batch, run from ``layer`` up."""
    from attnlab.attention import edit_heads
    from attnlab.models._lm import edit_block_input, edit_mlp

    B = chosen.numel()
    rows = torch.arange(B)
    x_in = bad.streams[layer].expand(B, -1, -1)  # (B, T, C)
    if over == "residual":
        x_in = x_in.clone()
        x_in[rows, chosen] = good.streams[layer][0, chosen]  # (B, C)
    attention, block = layout.attentions[layer], layout.blocks[layer]

    def start(i: int, x: torch.Tensor) -> torch.Tensor:
        return x_in if i == layer else x

    def heads(a: Any, context: torch.Tensor) -> torch.Tensor:
        if over != "heads" or a is not attention:
            return context
        _, T, HD = context.shape
        H = a.num_heads
        out = context.clone().view(B, T, H, HD // H)  # (B, T, H, Dv)
        clean = good.contexts[layer].view(T, H, HD // H)  # (T, H, Dv)
        out[rows, :, chosen] = clean[:, chosen].transpose(0, 1)  # (B, T, Dv)
        return out.view(B, T, HD)

    def mlp(b: nn.Module, m: torch.Tensor) -> torch.Tensor:
        if over != "mlp" or b is not block:
            return m
        out = m.clone()
        out[rows, chosen] = good.mlps[layer][0, chosen]  # (B, C)
        return out

    with (
        _eval_mode(model),
        torch.no_grad(),
        edit_block_input(start, start=layer),
        edit_heads(heads),
        edit_mlp(mlp),
    ):
        logits = model(corrupted, logits_to_keep=1)  # type: ignore[operator]
    return _metric(logits, t, c)


def patching(
    model: nn.Module,
    clean_ids: Sequence[int] | torch.Tensor,
    corrupted_ids: Sequence[int] | torch.Tensor,
    target: TokenArg,
    contrast: TokenArg | None,
    over: Over = "heads",
    *,
    tokenizer: Any = None,
) -> Patching:
    """:func:`patch` with the raw metric of every patched run and of both prompts.

    Args, Raises: as :func:`patch`.

    Returns:
        A :class:`Patching`.
    """

    if over not in ("heads", "residual", "mlp"):
        raise ValueError(f"`over` must be 'heads', 'residual' or 'mlp', got {over!r}")
    layout, clean, corrupted, t, c = _pair(
        model, clean_ids, corrupted_ids, target, contrast, tokenizer, "patch"
    )
    good = _record_run(model, layout, clean, t, c)
    bad = _record_run(model, layout, corrupted, t, c)
    if good.m == bad.m:
        raise ValueError(
            f"the clean and corrupted prompts give the same logit difference ({good.m:.6g}): "
            "there is nothing to restore; pick prompts (or tokens) that differ"
        )
    L, T = len(layout.blocks), clean.shape[1]
    width = [int(a.num_heads) for a in layout.attentions]
    columns = max(width) if over == "heads" else T
    raw = torch.full((L, columns), float("nan"), dtype=torch.float64)
    for layer in range(L):
        n = width[layer] if over == "heads" else T
        for lo in range(0, n, _PATCH_BATCH):
            chosen = torch.arange(lo, min(n, lo + _PATCH_BATCH))  # (B,)
            raw[layer, lo : lo + chosen.numel()] = _patched(
                model, layout, corrupted, layer, chosen, over, good, bad, t, c
            )
    grid = (raw - bad.m) / (good.m - bad.m)
    return Patching(
        grid=grid.to(torch.float32),
        raw=raw.to(torch.float32),
        clean=good.m,
        corrupted=bad.m,
        over=over,
        target=t,
        contrast=c,
    )


def patch(
    model: nn.Module,
    clean_ids: Sequence[int] | torch.Tensor,
    corrupted_ids: Sequence[int] | torch.Tensor,
    target: TokenArg,
    contrast: TokenArg | None,
    over: Over = "heads",
    *,
    tokenizer: Any = None,
) -> torch.Tensor:
    """Activation patching: how much of ``m`` each clean component restores in the
    corrupted run.

    ``m = logit(target) - logit(contrast)`` at the last position. The corrupted prompt
    runs with one component taken from the clean run, and the grid holds
    ``(m - m_corrupted) / (m_clean - m_corrupted)``: 1 = that component alone restores the
    clean answer, 0 = it changes nothing.

    - ``over="heads"``: ``(L, H)``, a head's output (its slice of the output projection's
      input) at every position;
    - ``over="residual"``: ``(L, T)``, the residual stream entering block ``l`` at
      position ``t``;
    - ``over="mlp"``: ``(L, T)``, block ``l``'s feed-forward write at position ``t``.

    The patched variants of one layer run as one batch, from that layer up: the
    corrupted stream entering it is cached once, the layers below are never recomputed.
    Layers with fewer heads than the widest leave their extra cells NaN.

    Args:
        model: an attnlab causal LM.
        clean_ids: the clean prompt's ids ``(T,)`` or ``(1, T)``.
        corrupted_ids: the corrupted prompt's ids, the same length.
        target: the token the clean prompt should produce: id or one token's text.
        contrast: the token to compare with (id or text), or None for ``logit(target)``.
        over: ``"heads"``, ``"residual"`` or ``"mlp"``.
        tokenizer: turns a text ``target`` / ``contrast`` into its id.

    Returns:
        The normalised grid, float32.

    Raises:
        TypeError: not attnlab's GPT or decoder; a text token without a tokenizer.
        ValueError: prompts of different lengths (naming both), bad ids or tokens, an
            unknown ``over``, prompts with the same ``m``.

    Shape:
        ``(L, H)`` for heads, ``(L, T)`` for residual and mlp.
    """
    return patching(
        model, clean_ids, corrupted_ids, target, contrast, over, tokenizer=tokenizer
    ).grid


def attribution_patching(
    model: nn.Module,
    clean_ids: Sequence[int] | torch.Tensor,
    corrupted_ids: Sequence[int] | torch.Tensor,
    target: TokenArg,
    contrast: TokenArg | None,
    *,
    tokenizer: Any = None,
) -> torch.Tensor:
    """Attribution patching: the first-order estimate of :func:`patch` over heads.

    One forward of both prompts (as a batch of two) records every head's output ``z`` (its
    slice of the output projection's input) on each, and one backward from the corrupted
    run's ``m`` gives ``dm/dz`` there. Each head's cell is ``sum over positions and its dims of
    dm/dz * (z_clean - z_corrupted)``, divided by ``m_clean - m_corrupted`` as
    :func:`patch` normalises. No parameter gradient is computed, and the fast one-token
    decode step is never taken with gradients on.

    Args, Raises: as :func:`patch`.

    Returns:
        ``(L, H)`` float32.

    Shape:
        ``(L, H)``.
    """
    from attnlab.attention import edit_heads
    from attnlab.models._lm import edit_block_input

    layout, clean, corrupted, t, c = _pair(
        model, clean_ids, corrupted_ids, target, contrast, tokenizer, "attribution_patching"
    )
    index = {id(a): i for i, a in enumerate(layout.attentions)}
    L = len(layout.blocks)
    contexts: list[Any] = [None] * L

    def leaf(i: int, x: torch.Tensor) -> torch.Tensor:
        # a stream that needs a gradient, so the heads' outputs have one whatever the
        # parameters' requires_grad says
        return x.detach().requires_grad_(True) if i == 0 else x

    def keep(layer: Any, context: torch.Tensor) -> torch.Tensor:
        i = index.get(id(layer))
        if i is not None:
            contexts[i] = context  # (2, T, H*Dv): the clean row, then the corrupted one
        return context

    # Both prompts as one batch of two rows (each row attends only to itself): one
    # forward, and one backward from the corrupted row's metric.
    both = torch.cat([clean, corrupted])  # (2, T)
    with _eval_mode(model), torch.enable_grad(), edit_block_input(leaf), edit_heads(keep):
        logits = model(both, logits_to_keep=1)  # type: ignore[operator]
        metrics = _metric(logits, t, c)  # (2,)
        grads = torch.autograd.grad(metrics[1], contexts)
    m_good, m_bad = (float(v) for v in metrics.detach())
    if m_good == m_bad:
        raise ValueError(
            f"the clean and corrupted prompts give the same logit difference ({m_bad:.6g}): "
            "there is nothing to restore; pick prompts (or tokens) that differ"
        )
    width = [int(a.num_heads) for a in layout.attentions]
    out = torch.full((L, max(width)), float("nan"), dtype=torch.float64)
    for i in range(L):
        H = width[i]
        z = contexts[i].detach().double()
        delta = z[0] - z[1]  # (T, H*Dv)
        g = grads[i][1].double()  # (T, H*Dv)
        out[i, :H] = (g * delta).view(-1, H, delta.shape[-1] // H).sum((0, 2))  # (H,)
    return (out / (m_good - m_bad)).to(torch.float32)
