"""The mixture-of-experts feed-forward: one module for every family that routes tokens.

A router scores each token against every expert; the token runs through its ``top_k``
experts only, and their outputs are summed with the routing weights:

- ``router="softmax"``: weights ``softmax(logits)`` over all experts, then the top k
  (Mixtral, Qwen3-MoE); ``"sigmoid"``: ``sigmoid(logits)`` of each expert on its own
  (Llama 4, DeepSeek V3);
- ``groups`` / ``top_groups``: grouped routing (DeepSeek's ``n_group`` / ``topk_group``):
  the experts form ``groups`` equal groups, each scored by its best expert
  (``group_score="max"``, DeepSeek-V2) or its two best summed (``"top2"``, DeepSeek-V3), and a
  token chooses its ``top_k`` experts inside its ``top_groups`` best groups only;
- ``score_bias``: a learned bias per expert added to the scores for *choosing* the experts,
  not to their weights (DeepSeek-V3's ``e_score_correction_bias``, which balances the load);
- ``renormalize``: the top-k weights are divided by their sum (Mixtral always; Qwen3-MoE's
  ``norm_topk_prob``);
- ``routed_scale``: every routed weight times this (DeepSeek's ``routed_scaling_factor``);
- ``weight_inputs``: the weight scales the expert's input instead of its output (Llama 4;
  with a gated expert the two differ);
- ``shared_size``: a dense gated MLP of that width that every token also runs (Llama 4,
  DeepSeek's shared experts), added to the routed sum;
- ``router_bias`` / ``expert_bias``: a bias on the router's logits and on every expert's
  three projections (gpt-oss);
- ``clamped_swiglu``: ``(limit, alpha)`` of gpt-oss's clamped SwiGLU in place of
  ``act(gate) * up``: :func:`clamped_swiglu`.

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

from attnlab.models.mlp import ACTIVATIONS, MLP

__all__ = [
    "ExpertWeights",
    "Experts",
    "MixtureOfExperts",
    "MoEConfig",
    "Routing",
    "ScoreCorrection",
    "clamped_swiglu",
    "record_experts",
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
        groups: expert groups (E divisible by it); 1 = no grouping.
        top_groups: the groups a token may choose from, 1 <= it <= ``groups``.
        group_score: a group's score, ``"max"`` (its best expert) or ``"top2"`` (its two
            best, summed).
        score_bias: a per-expert bias (:attr:`MixtureOfExperts.score_correction`) shifts
            the choice, not the weights.
        weight_inputs: scale each expert's input (not output) by its weight.
        shared_size: width of the shared expert every token runs, or None.
        router_bias: the router has a bias (gpt-oss).
        expert_bias: every expert's gate, up and down projections have biases (gpt-oss).
        clamped_swiglu: ``(limit, alpha)``: the experts compute :func:`clamped_swiglu`
            instead of ``act(gate) * up`` (gpt-oss: ``(7.0, 1.702)``), or None.

    Raises:
        ValueError: a count or width that is not a positive int, ``top_k > num_experts``,
            an unknown router, a non-finite or non-positive ``routed_scale``, groups that
            do not divide the experts or hold fewer than ``top_k`` experts in
            ``top_groups`` groups,
            a ``clamped_swiglu`` that is not two finite numbers > 0.
    """

    num_experts: int
    top_k: int
    expert_size: int
    router: Literal["softmax", "sigmoid"] = "softmax"
    renormalize: bool = True
    routed_scale: float = 1.0
    weight_inputs: bool = False
    shared_size: int | None = None
    groups: int = 1
    top_groups: int = 1
    group_score: Literal["max", "top2"] = "max"
    score_bias: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    clamped_swiglu: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "expert_size", "shared_size", "groups", "top_groups"):
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
        E, G = self.num_experts, self.groups
        if E % G:
            raise ValueError(f"`groups` ({G}) must divide `num_experts` ({E})")
        if self.top_groups > G:
            raise ValueError(f"`top_groups` ({self.top_groups}) must be at most `groups` ({G})")
        if self.top_k > self.top_groups * (E // G):
            raise ValueError(
                f"`top_k` ({self.top_k}) is more than the {self.top_groups * (E // G)} experts "
                f"in `top_groups` ({self.top_groups}) groups of {E // G}"
            )
        if self.group_score not in ("max", "top2"):
            raise ValueError(f"`group_score` must be 'max' or 'top2', got {self.group_score!r}")
        if self.group_score == "top2" and G > 1 and E // G < 2:
            raise ValueError(
                f"`group_score` 'top2' needs at least 2 experts per group, got {E // G}"
            )
        clamp = self.clamped_swiglu
        if clamp is not None and (
            not isinstance(clamp, tuple)
            or len(clamp) != 2
            or any(
                isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf
                for v in clamp
            )
        ):
            raise ValueError(
                f"`clamped_swiglu` must be (limit, alpha), two finite numbers > 0, got {clamp!r}"
            )


def clamped_swiglu(
    gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float
) -> torch.Tensor:
    """gpt-oss's expert activation: ``(up' + 1) * gate' * sigmoid(alpha * gate')`` with
    ``gate' = min(gate, limit)`` and ``up' = clamp(up, -limit, limit)`` (transformers'
    ``GptOssExperts``, llama.cpp's ``swiglu_oai``).

    Shape:
        gate ``(n, F)``, up ``(n, F)`` -> ``(n, F)``.
    """
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class ExpertWeights(nn.Module):
    """One projection of every expert, stacked: ``weight`` ``(E, out, in)``, and with
    ``bias`` a ``bias`` ``(E, out)`` (zeros until loaded)."""

    def __init__(
        self, experts: int, out_features: int, in_features: int, *, bias: bool = False
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, out_features, in_features))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        self.bias = nn.Parameter(torch.zeros(experts, out_features)) if bias else None

    def project(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e``'s projection of ``x`` ``(n, in)`` -> ``(n, out)``."""
        y = x @ self.weight[e].T
        return y if self.bias is None else y + self.bias[e]

    def extra_repr(self) -> str:
        E, out, inp = self.weight.shape
        return f"experts={E}, in_features={inp}, out_features={out}"


class ScoreCorrection(nn.Module):
    """The per-expert bias added to the routing scores for the choice: ``bias`` ``(E,)``."""

    def __init__(self, experts: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(experts), requires_grad=False)


class Experts(nn.Module):
    """Every expert's gated MLP, stacked: ``gate``/``up`` ``(E, F, C)``, ``down`` ``(E, C, F)``."""

    def __init__(self, experts: int, dim: int, hidden: int, *, bias: bool = False) -> None:
        super().__init__()
        self.gate = ExpertWeights(experts, hidden, dim, bias=bias)
        self.up = ExpertWeights(experts, hidden, dim, bias=bias)
        self.down = ExpertWeights(experts, dim, hidden, bias=bias)


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


# Receives (layer, expert or None for the shared one, token rows (n,), their outputs (n, C)).
ExpertRecorder = Callable[["MixtureOfExperts", "int | None", torch.Tensor, torch.Tensor], None]
_EXPERT_RECORDER: ContextVar[ExpertRecorder | None] = ContextVar(
    "attnlab_expert_recorder", default=None
)


@contextmanager
def record_experts(recorder: ExpertRecorder) -> Iterator[None]:
    """Hand every expert's weighted output to ``recorder``, in this call only.

    Each :class:`MixtureOfExperts` forward calls ``recorder(layer, e, rows, y)`` once per
    expert ``e`` that ran: ``rows`` ``(n,)`` the tokens (of the call's ``B*T``, in order)
    routed to it and ``y`` ``(n, C)`` what it added to their outputs (its routing weight
    applied); then once with ``e=None`` for the shared expert (every row), when the layer
    has one. The layer's output is the sum of these. The tensors are the layer's own:
    keep what you need, detached.

    Args:
        recorder: ``(layer, e, rows, y) -> None``.
    """
    token = _EXPERT_RECORDER.set(recorder)
    try:
        yield
    finally:
        _EXPERT_RECORDER.reset(token)


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
            :data:`attnlab.models.mlp.ACTIVATIONS`.

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
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"`activation` must be one of {sorted(ACTIVATIONS)}, got {activation!r}"
            )

        E, F = config.num_experts, config.expert_size
        self.config = config
        self.router = nn.Linear(dim, E, bias=config.router_bias)
        self.score_correction = ScoreCorrection(E) if config.score_bias else None
        self.experts = Experts(E, dim, F, bias=config.expert_bias)
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
        choice = scores
        if self.score_correction is not None:  # shifts the choice, not the weights
            choice = scores + self.score_correction.bias.float()
        if cfg.top_groups < cfg.groups:
            N, E, G = choice.shape[0], cfg.num_experts, cfg.groups
            per_group = choice.view(N, G, E // G)  # (N, G, E/G)
            if cfg.group_score == "max":
                group = per_group.amax(-1)  # (N, G)
            else:
                group = per_group.topk(2, dim=-1).values.sum(-1)  # (N, G)
            best = group.topk(cfg.top_groups, dim=-1).indices  # (N, top_groups)
            allowed = torch.zeros_like(group, dtype=torch.bool).scatter_(1, best, True)
            choice = choice.masked_fill(~allowed.repeat_interleave(E // G, dim=1), -math.inf)
        experts = choice.topk(cfg.top_k, dim=-1).indices  # (N, k)
        weights = scores.gather(1, experts)  # (N, k)
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
        experts_seen = _EXPERT_RECORDER.get()
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
            y = self._expert(e, h)  # (n, C)
            y = y if self.config.weight_inputs else y * w
            if experts_seen is not None:
                experts_seen(self, e, rows, y)
            out.index_add_(0, rows, y)
        if self.shared is not None:
            shared = self.shared(flat)  # (N, C)
            if experts_seen is not None:
                experts_seen(self, None, torch.arange(flat.shape[0], device=x.device), shared)
            out = out + shared
        return out.view_as(x)

    def _expert(self, e: int, h: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` on its rows ``h`` ``(n, C)`` -> ``(n, C)``."""
        ex, clamp = self.experts, self.config.clamped_swiglu
        gate, up = ex.gate.project(e, h), ex.up.project(e, h)  # (n, F) each
        h = self.act(gate) * up if clamp is None else clamped_swiglu(gate, up, *clamp)  # type: ignore[operator]
        return ex.down.project(e, h)  # (n, C)

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"experts={c.num_experts}, top_k={c.top_k}, router={c.router!r}, "
            f"renormalize={c.renormalize}, activation={self.activation!r}"
            + (f", shared_size={c.shared_size}" if c.shared_size else "")
            + (f", groups={c.top_groups}/{c.groups} by {c.group_score}" if c.groups > 1 else "")
            + (", score_bias=True" if c.score_bias else "")
            + (f", routed_scale={c.routed_scale}" if c.routed_scale != 1.0 else "")
            + (f", clamped_swiglu={c.clamped_swiglu}" if c.clamped_swiglu else "")
        )
