"""What a model trace holds: :class:`ModelTrace` (each captured layer's attention, as
the model computed it) and :class:`ExpertTrace` (where a mixture-of-experts router sent each
token), and the Jupyter view the page module registers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    pass


@dataclass(frozen=True)
class ExpertTrace:
    """Where the routers of a mixture-of-experts model sent each token, as data.

    Attributes:
        layers: the model's indices (attention-layer numbering, as in
            :attr:`ModelTrace.layers`) of the captured layers that route to experts.
        num_experts: E, experts per layer.
        chosen: the chosen experts ``(M, T, k)`` (long), in the router's order
            (strongest first).
        weights: their routing weights ``(M, T, k)`` float32, as the layer used them
            (after renormalisation and scaling).
        shared: True when every token also runs a shared expert (not routed, not shown).
    """

    layers: tuple[int, ...]
    num_experts: int
    chosen: torch.Tensor
    weights: torch.Tensor
    shared: bool = False

    def __post_init__(self) -> None:
        M = len(self.layers)
        if M == 0 or list(self.layers) != sorted(set(self.layers)):
            raise ValueError(
                f"`layers` must be distinct ascending layer indices, at least one, got "
                f"{self.layers}"
            )
        if self.chosen.ndim != 3 or self.chosen.shape[0] != M:
            raise ValueError(
                f"`chosen` must have shape (M, T, k) with M={M}, got {tuple(self.chosen.shape)}"
            )
        if tuple(self.weights.shape) != tuple(self.chosen.shape):
            raise ValueError(
                f"`weights` must have the shape of `chosen` {tuple(self.chosen.shape)}, got "
                f"{tuple(self.weights.shape)}"
            )
        if self.chosen.numel() and not (
            int(self.chosen.min()) >= 0 and int(self.chosen.max()) < self.num_experts
        ):
            raise ValueError(f"`chosen` must be expert indices in 0..{self.num_experts - 1}")

    @property
    def top_k(self) -> int:
        """k, experts per token."""
        return int(self.chosen.shape[-1])

    def layer_routing(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's ``(experts, weights)``, each ``(T, k)``.

        Raises:
            ValueError: the layer routes no tokens in this trace.
        """
        if layer not in self.layers:
            raise ValueError(
                f"`layer` must be one of the layers with experts {list(self.layers)}, got {layer}"
            )
        i = self.layers.index(layer)
        return self.chosen[i], self.weights[i]

    def grid(self, layer: int) -> torch.Tensor:
        """One layer as a token x expert grid ``(T, E)``: each token's routing weight on
        the experts it went to, 0 elsewhere."""
        experts, weights = self.layer_routing(layer)
        out = torch.zeros(experts.shape[0], self.num_experts, dtype=torch.float32)
        return out.scatter_(1, experts, weights.float())


@dataclass(frozen=True)
class ModelTrace:
    """The attention weights one forward pass of a model computed, as data.

    Either ``weights`` (dense mode) or ``top_indices`` + ``top_values`` (top-k mode)
    is set. Layers and heads are numbered as in the model; ``layers`` and ``heads``
    say which of them the trace holds.

    Attributes:
        tokens: the query tokens, as text (one per row).
        key_tokens: the key tokens (one per column); the same as ``tokens`` for
            self-attention.
        layers: the model's indices of the captured layers, ascending.
        heads: the captured query heads, ascending (the same for every layer).
        num_layers: attention layers in the model.
        num_heads: query heads per layer in the model.
        weights: dense weights ``(L, H, T, S)``, float32, or None.
        top_indices: top-k key indices ``(L, H, T, K)``, strongest first, or None.
        top_values: the weights at ``top_indices`` ``(L, H, T, K)``, or None.
        queries: queries ``(L, H, T, D)`` when captured, else None.
        keys: keys ``(L, H, S, D)`` (shared key heads repeated per query head) when
            captured, else None.
        token_ids: the token ids, when the input was tokenized.
        source: a short description of the model / example, for titles.
        layer_names: a label per captured layer (e.g. the seed example's
            "simplified" and "trainable" forms), or None for "Layer i".
        experts: where the captured mixture-of-experts layers routed each token, or None
            (a model without experts).
        meta: free-form facts about the capture (not compared).
    """

    tokens: tuple[str, ...]
    key_tokens: tuple[str, ...]
    layers: tuple[int, ...]
    heads: tuple[int, ...]
    num_layers: int
    num_heads: int
    weights: torch.Tensor | None = None
    top_indices: torch.Tensor | None = None
    top_values: torch.Tensor | None = None
    queries: torch.Tensor | None = None
    keys: torch.Tensor | None = None
    token_ids: tuple[int, ...] | None = None
    source: str = ""
    layer_names: tuple[str, ...] | None = None
    experts: ExpertTrace | None = None
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        T, S = len(self.tokens), len(self.key_tokens)
        L, H = len(self.layers), len(self.heads)
        if T == 0 or S == 0:
            raise ValueError("`tokens` must not be empty; a trace needs at least one token")
        if L == 0 or H == 0:
            raise ValueError(
                f"a trace needs at least one layer and one head, got layers={self.layers}, "
                f"heads={self.heads}"
            )
        if list(self.layers) != sorted(set(self.layers)) or not all(
            0 <= i < self.num_layers for i in self.layers
        ):
            raise ValueError(
                f"`layers` must be distinct ascending indices below num_layers="
                f"{self.num_layers}, got {self.layers}"
            )
        if list(self.heads) != sorted(set(self.heads)) or not all(
            0 <= h < self.num_heads for h in self.heads
        ):
            raise ValueError(
                f"`heads` must be distinct ascending indices below num_heads="
                f"{self.num_heads}, got {self.heads}"
            )
        dense = self.weights is not None
        sparse = self.top_indices is not None or self.top_values is not None
        if dense == sparse:
            raise ValueError(
                "a ModelTrace holds either `weights` (dense) or `top_indices` and "
                "`top_values` (top-k), exactly one of the two"
            )
        if dense:
            assert self.weights is not None
            if tuple(self.weights.shape) != (L, H, T, S):
                raise ValueError(
                    f"`weights` must have shape (L, H, T, S) = {(L, H, T, S)}, "
                    f"got {tuple(self.weights.shape)}"
                )
        else:
            if self.top_indices is None or self.top_values is None:
                raise ValueError("top-k mode needs both `top_indices` and `top_values`")
            shape = tuple(self.top_indices.shape)
            if (
                len(shape) != 4
                or shape[:3] != (L, H, T)
                or not 1 <= shape[3] <= S
                or tuple(self.top_values.shape) != shape
            ):
                raise ValueError(
                    f"`top_indices` and `top_values` must both have shape (L, H, T, K) with "
                    f"(L, H, T) = {(L, H, T)} and 1 <= K <= S={S}, got "
                    f"{shape} and {tuple(self.top_values.shape)}"
                )
        if self.layer_names is not None and len(self.layer_names) != L:
            raise ValueError(
                f"`layer_names` must have one name per captured layer ({L}), "
                f"got {len(self.layer_names)}"
            )
        if self.queries is not None and tuple(self.queries.shape[:3]) != (L, H, T):
            raise ValueError(
                f"`queries` must have shape (L, H, T, D) with (L, H, T) = {(L, H, T)}, "
                f"got {tuple(self.queries.shape)}"
            )
        if self.keys is not None and tuple(self.keys.shape[:3]) != (L, H, S):
            raise ValueError(
                f"`keys` must have shape (L, H, S, D) with (L, H, S) = {(L, H, S)}, "
                f"got {tuple(self.keys.shape)}"
            )
        if self.experts is not None:
            if self.experts.chosen.shape[1] != T:
                raise ValueError(
                    f"`experts` must route the trace's {T} tokens, got "
                    f"{self.experts.chosen.shape[1]}"
                )
            if not set(self.experts.layers) <= set(self.layers):
                raise ValueError(
                    f"`experts.layers` {list(self.experts.layers)} must be among the captured "
                    f"layers {list(self.layers)}"
                )

    # ------------------------------------------------------------------ access
    @property
    def mode(self) -> str:
        """``"dense"`` or ``"topk"``."""
        return "dense" if self.weights is not None else "topk"

    @property
    def top_k(self) -> int | None:
        """Keys kept per query in top-k mode, else None."""
        return None if self.top_indices is None else int(self.top_indices.shape[-1])

    def _position(self, layer: int, head: int) -> tuple[int, int]:
        if layer not in self.layers:
            raise ValueError(
                f"`layer` must be one of the captured layers {list(self.layers)}, got {layer}; "
                f"the model has layers 0..{self.num_layers - 1}"
            )
        if head not in self.heads:
            raise ValueError(
                f"`head` must be one of the captured heads {list(self.heads)}, got {head}; "
                f"the model has heads 0..{self.num_heads - 1}"
            )
        return self.layers.index(layer), self.heads.index(head)

    def head_weights(self, layer: int, head: int) -> torch.Tensor:
        """One head's weights as a dense ``(T, S)`` matrix.

        In top-k mode the keys not kept are 0.

        Args:
            layer: a captured layer (model numbering).
            head: a captured head (model numbering).

        Returns:
            float32 tensor ``(T, S)``.

        Raises:
            ValueError: the layer or head is not in the trace.
        """
        li, hi = self._position(layer, head)
        if self.weights is not None:
            return self.weights[li, hi]
        assert self.top_indices is not None and self.top_values is not None
        dense = torch.zeros(len(self.tokens), len(self.key_tokens), dtype=torch.float32)
        dense.scatter_(1, self.top_indices[li, hi], self.top_values[li, hi].float())
        return dense

    def head_top_keys(self, layer: int, head: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` strongest keys of every query of one head, strongest first.

        Returns:
            ``(indices, values)``, each ``(T, k')`` with ``k' = min(k, available)``.
        """
        li, hi = self._position(layer, head)
        if k < 1:
            raise ValueError(f"`k` must be at least 1, got {k}")
        if self.weights is not None:
            w = self.weights[li, hi]
            values, indices = torch.topk(w, min(k, w.shape[-1]), dim=-1)
            return indices, values
        assert self.top_indices is not None and self.top_values is not None
        kk = min(k, self.top_indices.shape[-1])
        return self.top_indices[li, hi, :, :kk], self.top_values[li, hi, :, :kk]

    def _repr_html_(self) -> str | None:
        """Jupyter: the interactive page inline (an isolated iframe), drawn by the renderer
        the page module registers (:func:`set_html_renderer`); None (plain repr) without."""
        return None if _HTML_RENDERER is None else _HTML_RENDERER(self)


# The page module (attnlab.explain.html) registers its renderer here when it is imported
# (attnlab.explain imports it), so this data module does not import its own renderer.
_HTML_RENDERER: Callable[[ModelTrace], str] | None = None


def set_html_renderer(renderer: Callable[[ModelTrace], str] | None) -> None:
    """Use ``renderer(trace) -> html`` for :meth:`ModelTrace._repr_html_` (Jupyter)."""
    global _HTML_RENDERER
    _HTML_RENDERER = renderer
