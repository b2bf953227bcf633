"""Pieces shared by attnlab's models (GPT, BERT, Llama).

Shape legend: B batch, T sequence length, C model width.
"""

from __future__ import annotations

import torch
from torch import nn

from attnlab.attention import Attention
from attnlab.backends import available_backends

__all__ = ["keep_last", "set_attention_backend"]


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
