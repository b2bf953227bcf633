"""Pieces shared by attnlab's causal language models (GPT, Llama).

Shape legend: B batch, T sequence length, C model width.
"""

from __future__ import annotations

import torch

__all__ = ["keep_last"]


def keep_last(x: torch.Tensor, logits_to_keep: int | None) -> torch.Tensor:
    """The last ``logits_to_keep`` positions of ``x`` (B, T, C); all of them for None."""
    if logits_to_keep is None:
        return x
    if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int):
        raise TypeError(f"`logits_to_keep` must be an int or None, got {logits_to_keep!r}")
    if logits_to_keep < 1:
        raise ValueError(f"`logits_to_keep` must be >= 1 or None, got {logits_to_keep}")
    return x[:, -logits_to_keep:]  # (B, min(T, logits_to_keep), C)
