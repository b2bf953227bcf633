"""The mixture-of-experts feed-forward: one module for every family that routes tokens.

A router scores each token against every expert; the token runs through its ``top_k``
experts only, and their outputs are summed with the routing weights:

- ``router="softmax"``: weights ``softmax(logits)`` over all experts, then the top k
  (Mixtral, Qwen3-MoE); ``"sigmoid"``: ``sigmoid(logits)`` of each expert on its own
  (Llama 4, DeepSeek V3);
- ``renormalize``: the top-k weights are divided by their sum (Mixtral always; Qwen3-MoE's
  ``norm_topk_prob``);
- ``routed_scale``: every routed weight times this (DeepSeek's ``routed_scaling_factor``);
- ``weight_inputs``: the weight scales the expert's input instead of its output (Llama 4;
  with a gated expert the two differ);
- ``shared_size``: a dense gated MLP of that width that every token also runs (Llama 4,
  DeepSeek's shared experts), added to the routed sum.

Each expert is a gated MLP ``down(act(gate(x)) * up(x))``; the experts' weights are stacked,
``(E, F, C)`` for gate and up, ``(E, C, F)`` for down, as llama.cpp stores them. Tokens are
grouped by expert (one sort), and each expert multiplies only the rows routed to it: the
cost is that of ``top_k`` dense MLPs of width F per token, never all E.

Shape legend: N tokens (B*T), C width, E experts, k experts per token, F expert width.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

__all__ = [
    "ExpertWeights",
    "Experts",
    "MixtureOfExperts",
    "MoEConfig",
    "Routing",
    "record_routing",
]


@dataclass(frozen=True)
class MoEConfig:
    """What a mixture-of-experts layer is (see the module docstring).

    Attributes:
        num_experts: E.
        top_k: experts per token, 1 <= k <= E.
        expert_size: each expert's width F.
        router: ``"softmax"`` or ``"sigmoid"``.
        renormalize: divide the top-k weights by their sum.
        routed_scale: factor on every routed weight.
        weight_inputs: scale each expert's input (not output) by its weight.
        shared_size: width of the shared expert every token runs, or None.

    Raises:
        ValueError: a count or width that is not a positive int, ``top_k > num_experts``,
            an unknown router, a non-finite or non-positive ``routed_scale``.
    """

    num_experts: int
    top_k: int
    expert_size: int
    router: Literal["softmax", "sigmoid"] = "softmax"
    renormalize: bool = True
    routed_scale: float = 1.0
    weight_inputs: bool = False
    shared_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "expert_size", "shared_size"):
            value = getattr(self, name)
            if name == "shared_size" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive int, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"`top_k` ({self.top_k}) must be at most `num_experts` ({self.num_experts})"
            )
        if self.router not in ("softmax", "sigmoid"):
            raise ValueError(f"`router` must be 'softmax' or 'sigmoid', got {self.router!r}")
        s = self.routed_scale
        if (
            isinstance(s, bool)
            or not isinstance(s, (int, float))
            or not (math.isfinite(s) and s > 0)
        ):
            raise ValueError(f"`routed_scale` must be a finite number > 0, got {s!r}")


class ExpertWeights(nn.Module):
    """One projection of every expert, stacked: ``weight`` ``(E, out, in)``."""

    def __init__(self, experts: int, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, out_features, in_features))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def extra_repr(self) -> str:
        E, out, inp = self.weight.shape
        return f"experts={E}, in_features={inp}, out_features={out}"


class Experts(nn.Module):
    """Every expert's gated MLP, stacked: ``gate``/``up`` ``(E, F, C)``, ``down`` ``(E, C, F)``."""

    def __init__(self, experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate = ExpertWeights(experts, hidden, dim)
        self.up = ExpertWeights(experts, hidden, dim)
        self.down = ExpertWeights(experts, dim, hidden)


@dataclass(frozen=True)
class Routing:
    """Where a call sent its tokens: ``experts`` ``(N, k)`` long, ``weights`` ``(N, k)``
    fp32 (after renormalisation and scaling), N the call's B*T tokens in order."""

    experts: torch.Tensor
    weights: torch.Tensor


# Receives (layer, routing) from every MixtureOfExperts forward run inside record_routing.
RoutingRecorder = Callable[["MixtureOfExperts", Routing], None]
_ROUTING_RECORDER: ContextVar[RoutingRecorder | None] = ContextVar(
    "attnlab_routing_recorder", default=None
)


@contextmanager
def record_routing(recorder: RoutingRecorder) -> Iterator[None]:
    """Hand every :class:`MixtureOfExperts` forward run inside the block to ``recorder``.

    ``recorder(layer, routing)`` gets the layer and its :class:`Routing` (detached). Like
    :func:`attnlab.attention.record_attention` the recorder travels with the call (a
    context variable), so two threads tracing one shared model see only their own tokens
    (``last_routing`` is the layer's, shared by every caller).

    Args:
        recorder: ``(layer, routing) -> None``.
    """
    token = _ROUTING_RECORDER.set(recorder)
    try:
        yield
    finally:
        _ROUTING_RECORDER.reset(token)


class MixtureOfExperts(nn.Module):
    """A routed feed-forward of gated experts, with an optional shared expert.

    Args:
        dim: width C.
        config: the experts, the router and its rules.
        activation: the experts' activation, a name of
            :data:`attnlab.models.decoder.ACTIVATIONS`.

    Attributes:
        last_routing: the :class:`Routing` of the last forward (what the explainer shows),
            or None before the first.

    Shape:
        ``(B, T, C) -> (B, T, C)``.

    Raises:
        ValueError: an unknown activation.
    """

    def __init__(self, dim: int, config: MoEConfig, *, activation: str = "silu") -> None:
        super().__init__()
        # the activations and the shared expert are the dense MLP's (decoder imports us)
        from attnlab.models.decoder import ACTIVATIONS, MLP

        if activation not in ACTIVATIONS:
            raise ValueError(
                f"`activation` must be one of {sorted(ACTIVATIONS)}, got {activation!r}"
            )

        E, F = config.num_experts, config.expert_size
        self.config = config
        self.router = nn.Linear(dim, E, bias=False)
        self.experts = Experts(E, dim, F)
        self.act = ACTIVATIONS[activation]
        self.activation = activation
        self.shared = (
            MLP(dim, config.shared_size, gated=True, activation=activation, bias=False)
            if config.shared_size is not None
            else None
        )
        self.last_routing: Routing | None = None

    def route(self, x: torch.Tensor) -> Routing:
        """The experts and weights of each token of ``x`` ``(N, C)``."""
        cfg = self.config
        logits = self.router(x).float()  # (N, E): routing in fp32 whatever the model dtype
        scores = logits.softmax(-1) if cfg.router == "softmax" else logits.sigmoid()
        weights, experts = scores.topk(cfg.top_k, dim=-1)  # (N, k)
        if cfg.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        if cfg.routed_scale != 1.0:
            weights = weights * cfg.routed_scale
        return Routing(experts, weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) -> (B, T, C)."""
        C = x.shape[-1]
        flat = x.reshape(-1, C)  # (N, C)
        routing = self.route(flat)
        self.last_routing = Routing(routing.experts.detach(), routing.weights.detach())
        recorder = _ROUTING_RECORDER.get()
        if recorder is not None:
            recorder(self, self.last_routing)
        k = self.config.top_k
        slots = routing.experts.reshape(-1)  # (N*k,): token n's j-th choice at n*k + j
        order = slots.argsort(stable=True)  # slots grouped by expert
        counts = torch.bincount(slots, minlength=self.config.num_experts).tolist()
        weights = routing.weights.reshape(-1)[order].to(x.dtype)  # (N*k,)
        tokens = order // k  # the token of each grouped slot
        out = torch.zeros_like(flat)  # (N, C)
        gate, up, down = self.experts.gate.weight, self.experts.up.weight, self.experts.down.weight
        start = 0
        for e, n in enumerate(counts):
            if n == 0:  # no token chose this expert: it costs nothing
                continue
            rows = tokens[start : start + n]
            w = weights[start : start + n, None]  # (n, 1)
            start += n
            h = flat[rows]  # (n, C)
            if self.config.weight_inputs:
                h = h * w
            h = self.act(h @ gate[e].T) * (h @ up[e].T)  # type: ignore[operator]  # (n, F)
            y = h @ down[e].T  # (n, C)
            out.index_add_(0, rows, y if self.config.weight_inputs else y * w)
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.view_as(x)

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"experts={c.num_experts}, top_k={c.top_k}, router={c.router!r}, "
            f"renormalize={c.renormalize}, activation={self.activation!r}"
            + (f", shared_size={c.shared_size}" if c.shared_size else "")
        )
