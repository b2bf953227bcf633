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
    "keep_last",
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
