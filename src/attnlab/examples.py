"""The embedded examples: the seed text's six tokens and its 2-D toy.

Two projection conventions appear in the text and both are real:

- ``"x @ W"``: ``W`` has shape ``(d_in, d_out)``; the book's step-by-step walk and
  :class:`attnlab.ladder.SelfAttentionV1` (``nn.Parameter(torch.rand(d_in, d_out))``).
- ``"x @ W.T"``: ``W`` has shape ``(d_out, d_in)``; ``nn.Linear`` and
  :class:`attnlab.ladder.SelfAttentionV2`, and the seed's toy with its explicit
  ``W_q``, ``W_k``, ``W_v`` (``queries = inputs @ W_q.T``).

Examples hold plain tuples (immutable); :meth:`Example.inputs_tensor` and
:meth:`Example.projection_weights` build fresh tensors on every call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

__all__ = [
    "EXAMPLES",
    "JOURNEY",
    "TOY",
    "Example",
    "ProjectionConvention",
    "get_example",
]

ProjectionConvention = Literal["x @ W", "x @ W.T"]

Matrix = tuple[tuple[float, ...], ...]


@dataclass(frozen=True)
class Example:
    """One embedded example.

    Attributes:
        name: the name used on the command line (``--example``).
        description: one line saying where it comes from.
        tokens: one label per input row.
        inputs: the ``(T, d_in)`` embeddings.
        weights: explicit ``(W_query, W_key, W_value)`` in the ``nn.Linear``
            convention ``(d_out, d_in)``, or None when the trainable weights are drawn
            at random after ``torch.manual_seed`` as in the book.
        convention: how the trainable projection is written for this example.
    """

    name: str
    description: str
    tokens: tuple[str, ...]
    inputs: Matrix
    weights: tuple[Matrix, Matrix, Matrix] | None
    convention: ProjectionConvention

    def inputs_tensor(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The embeddings as a new ``(T, d_in)`` tensor."""
        return torch.tensor(self.inputs, dtype=dtype)

    def projection_weights(
        self, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The explicit ``(W_query, W_key, W_value)``, each ``(d_out, d_in)``, or None."""
        if self.weights is None:
            return None
        wq, wk, wv = (torch.tensor(w, dtype=dtype) for w in self.weights)
        return wq, wk, wv


JOURNEY = Example(
    name="journey",
    description=(
        'The book\'s six tokens "Your journey starts with one step", each a 3-d embedding; '
        "trainable weights drawn with torch.rand after torch.manual_seed (x @ W)."
    ),
    tokens=("Your", "journey", "starts", "with", "one", "step"),
    inputs=(
        (0.43, 0.15, 0.89),  # Your
        (0.55, 0.87, 0.66),  # journey
        (0.57, 0.85, 0.64),  # starts
        (0.22, 0.58, 0.33),  # with
        (0.77, 0.25, 0.10),  # one
        (0.05, 0.80, 0.55),  # step
    ),
    weights=None,
    convention="x @ W",
)

TOY = Example(
    name="toy",
    description=(
        "The seed text's 2-D toy: six 2-d inputs with explicit 2x2 W_q, W_k, W_v "
        "applied as inputs @ W.T (the nn.Linear convention)."
    ),
    tokens=("x1", "x2", "x3", "x4", "x5", "x6"),
    inputs=(
        (0.4, 0.1),
        (0.3, 0.7),
        (0.1, 0.8),
        (0.4, 1.1),
        (0.3, 1.0),
        (0.3, 0.9),
    ),
    weights=(
        ((1.1, 2.0), (3.0, 4.0)),  # W_q
        ((5.0, 6.0), (7.0, 8.0)),  # W_k
        ((9.0, 10.0), (11.0, 12.0)),  # W_v
    ),
    convention="x @ W.T",
)

EXAMPLES: dict[str, Example] = {e.name: e for e in (JOURNEY, TOY)}


def get_example(name: str) -> Example:
    """Look up an embedded example by name.

    Args:
        name: ``"journey"`` or ``"toy"``.

    Returns:
        The example.

    Raises:
        TypeError: ``name`` is not a string.
        ValueError: an unknown name.
    """
    if not isinstance(name, str):
        raise TypeError(f"`example` must be a name (str), got {type(name).__name__}")
    try:
        return EXAMPLES[name]
    except KeyError:
        choices = ", ".join(EXAMPLES)
        raise ValueError(f"`example` must be one of {choices}; got {name!r}") from None
