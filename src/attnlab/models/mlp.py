"""The dense feed-forward block and the activations every feed-forward kind chooses from.

Below the decoder, the mixture of experts and the fast decode step, which all use them.

Shape legend: B batch, T tokens, C width, F feed-forward width.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

__all__ = ["ACTIVATIONS", "MLP", "Activation"]

Activation = Literal["silu", "gelu", "gelu_tanh", "relu"]
ACTIVATIONS: dict[str, object] = {
    "silu": nn.functional.silu,
    "gelu": nn.functional.gelu,  # exact (erf)
    "gelu_tanh": lambda x: nn.functional.gelu(x, approximate="tanh"),
    "relu": nn.functional.relu,
}


class MLP(nn.Module):
    """The feed-forward block: ``down(act(gate(x)) * up(x))`` (gated) or ``down(act(up(x)))``.

    Args:
        dim: width C.
        hidden: width F.
        gated: SwiGLU-style gate.
        activation: a key of :data:`ACTIVATIONS`.
        bias: biases on the projections.
    """

    def __init__(self, dim: int, hidden: int, *, gated: bool, activation: str, bias: bool) -> None:
        super().__init__()
        if gated:
            self.gate: nn.Linear | None = nn.Linear(dim, hidden, bias=bias)
        else:
            self.gate = None
        self.up = nn.Linear(dim, hidden, bias=bias)
        self.down = nn.Linear(hidden, dim, bias=bias)
        self.act = ACTIVATIONS[activation]
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) -> (B, T, C)."""
        if self.gate is not None:
            return self.down(self.act(self.gate(x)) * self.up(x))  # type: ignore[operator]
        return self.down(self.act(self.up(x)))  # type: ignore[operator]

    def extra_repr(self) -> str:
        return f"gated={self.gate is not None}, activation={self.activation!r}"
