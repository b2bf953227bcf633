"""Pieces shared by attnlab's models (GPT, BERT, Llama).

Shape legend: B batch, T sequence length, C model width.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import nn

from attnlab.attention import Attention
from attnlab.backends import available_backends

__all__ = [
    "block_input",
    "edit_block_input",
    "edit_mlp",
    "editing_blocks",
    "embed_scaled",
    "first_block",
    "keep_last",
    "mlp_output",
    "residual_after_block",
    "set_attention_backend",
    "watch_residual",
    "watching_residual",
]

# Receives (block index, residual stream (B, T, C)) after every block; set per call.
ResidualWatcher = Callable[[int, torch.Tensor], None]
_WATCHER: ContextVar[ResidualWatcher | None] = ContextVar("attnlab_residual", default=None)


@contextmanager
def watch_residual(watcher: ResidualWatcher) -> Iterator[None]:
    """Show ``watcher`` the residual stream after every block of a causal LM, in this call only.

    Every attnlab language model (:class:`attnlab.models.gpt.GPTModel`,
    :class:`attnlab.models.decoder.Decoder`) calls :func:`residual_after_block` after
    each of its blocks, so ``watcher(index, x)`` sees ``x`` ``(B, T, C)``, the stream
    the next block reads (before the final norm). The logit lens
    (:func:`attnlab.explain.logit_lens`) reads it. Like
    :func:`attnlab.attention.record_attention` it travels with the call (a context
    variable); the fast decode step steps aside while it is set.

    Args:
        watcher: ``(block index, x)``; keep what you need, detached.
    """
    token = _WATCHER.set(watcher)
    try:
        yield
    finally:
        _WATCHER.reset(token)


def watching_residual() -> bool:
    """True inside :func:`watch_residual`."""
    return _WATCHER.get() is not None


def residual_after_block(index: int, x: torch.Tensor) -> None:
    """Hand block ``index``'s output ``x`` ``(B, T, C)`` to the watcher, if one is set."""
    watcher = _WATCHER.get()
    if watcher is not None:
        watcher(index, x)


# Replaces the residual stream entering a block: (block index, x (B, T, C)) -> x' (B', T, C).
BlockInputEditor = Callable[[int, torch.Tensor], torch.Tensor]
_BLOCK_INPUT: ContextVar[tuple[BlockInputEditor, int] | None] = ContextVar(
    "attnlab_block_input", default=None
)
# Replaces a block's feed-forward write: (block, m (B, T, C)) -> m' of the same shape.
MLPEditor = Callable[[nn.Module, torch.Tensor], torch.Tensor]
_MLP_EDITOR: ContextVar[MLPEditor | None] = ContextVar("attnlab_mlp_editor", default=None)


@contextmanager
def edit_block_input(editor: BlockInputEditor, *, start: int = 0) -> Iterator[None]:
    """Let ``editor`` see (and replace) the residual stream entering every block, in this
    call only; with ``start``, the model skips the blocks below ``start``.

    Every attnlab causal LM calls :func:`block_input` before each block it runs, so
    ``editor(index, x)`` sees ``x`` ``(B, T, C)``, the stream block ``index`` reads, and
    the block reads what the editor returns instead (return ``x`` to leave it). The
    returned stream may have another batch size (``B'`` patched variants of one prompt):
    the blocks after it run on that batch. With ``start = l > 0`` blocks ``0 .. l-1`` are
    not run at all (what enters block ``l`` is whatever the editor returns for it: a
    stream cached from an earlier run), so an experiment that changes block ``l`` never
    recomputes the layers below it (:func:`attnlab.explain.patch`). Like
    :func:`watch_residual` it travels with the call (a context variable); the fast decode
    step steps aside while it is set.

    Args:
        editor: ``(index, x) -> x'``.
        start: the first block the model runs.
    """
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"`start` must be an int >= 0, got {start!r}")
    token = _BLOCK_INPUT.set((editor, start))
    try:
        yield
    finally:
        _BLOCK_INPUT.reset(token)


def first_block() -> int:
    """The first block a model runs in this call (:func:`edit_block_input`'s ``start``)."""
    entry = _BLOCK_INPUT.get()
    return 0 if entry is None else entry[1]


def block_input(index: int, x: torch.Tensor) -> torch.Tensor:
    """The stream block ``index`` reads: ``x`` ``(B, T, C)``, or the editor's replacement.

    Raises:
        RuntimeError: an editor that returned something else than a ``(B', T, C)`` tensor.
    """
    entry = _BLOCK_INPUT.get()
    if entry is None:
        return x
    out = entry[0](index, x)
    if not isinstance(out, torch.Tensor) or out.ndim != 3 or out.shape[1:] != x.shape[1:]:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise RuntimeError(
            f"a block-input editor must return a (B, {x.shape[1]}, {x.shape[2]}) tensor, got {got}"
        )
    return out


@contextmanager
def edit_mlp(editor: MLPEditor) -> Iterator[None]:
    """Let ``editor`` see (and replace) every block's feed-forward write, in this call only.

    Each block calls :func:`mlp_output` with its feed-forward output as it is added to the
    residual stream (after a post-block norm where the family has one, before a residual
    multiplier), ``m`` ``(B, T, C)``, and adds what the editor returns (same shape).

    Args:
        editor: ``(block, m) -> m'``; return ``m`` itself to leave a block as it is.
    """
    token = _MLP_EDITOR.set(editor)
    try:
        yield
    finally:
        _MLP_EDITOR.reset(token)


def mlp_output(block: nn.Module, m: torch.Tensor) -> torch.Tensor:
    """``block``'s feed-forward write ``m`` ``(B, T, C)``, or the editor's replacement."""
    editor = _MLP_EDITOR.get()
    if editor is None:
        return m
    out = editor(block, m)
    if not isinstance(out, torch.Tensor) or out.shape != m.shape:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise RuntimeError(
            f"an MLP editor must return a tensor of shape {tuple(m.shape)}, got {got}"
        )
    return out


def editing_blocks() -> bool:
    """True inside :func:`watch_residual`, :func:`edit_block_input` or :func:`edit_mlp`
    (fast paths that skip the blocks step aside)."""
    return (
        _WATCHER.get() is not None
        or _BLOCK_INPUT.get() is not None
        or _MLP_EDITOR.get() is not None
    )


def set_attention_backend(model: nn.Module, backend: str) -> None:
    """Make every :class:`~attnlab.attention.Attention` layer of ``model`` use ``backend``.

    Raises:
        ValueError: an unknown backend name.
    """
    if backend not in available_backends():
        raise ValueError(f"`backend` must be one of {available_backends()}, got {backend!r}")
    for module in model.modules():
        if isinstance(module, Attention):
            module.backend = backend


def keep_last(x: torch.Tensor, logits_to_keep: int | None) -> torch.Tensor:
    """The last ``logits_to_keep`` positions of ``x`` (B, T, C); all of them for None."""
    if logits_to_keep is None:
        return x
    if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int):
        raise TypeError(f"`logits_to_keep` must be an int or None, got {logits_to_keep!r}")
    if logits_to_keep < 1:
        raise ValueError(f"`logits_to_keep` must be >= 1 or None, got {logits_to_keep}")
    return x[:, -logits_to_keep:]  # (B, min(T, logits_to_keep), C)


def embed_scaled(x: torch.Tensor) -> torch.Tensor:
    """Token embeddings times ``sqrt(C)`` (Gemma), the factor rounded to the embeddings'
    dtype first as the reference implementation does; the decoder's and the decode step's.

    Shape:
        x ``(..., C)`` -> ``(..., C)``.
    """
    return x * torch.tensor(x.shape[-1] ** 0.5, dtype=x.dtype)
