"""Capture what a model built on :class:`attnlab.attention.Attention` attended to.

Shape legend:
    L layers captured, H heads captured, T query tokens, S key tokens,
    K keys kept per query (top-k mode), D head dim; for mixtures of experts
    M routed layers captured, E experts, k experts per token.

:func:`trace_model` runs a model once inside :func:`attnlab.attention.record_attention`
(a per-call recorder: nothing is set on the shared layers, so concurrent traces of one
model do not meet), and keeps what the layers themselves computed through the
attention core's exact-weights path. Nothing here recomputes attention: what the trace holds
is what the model computed.

Long inputs are captured without holding all ``layers x heads x T x S`` weights at
once: choose the layers (``layers=``), the heads (``heads=``), or keep only the
``top_k`` strongest keys of every query. Each layer's weights are reduced (or
dropped) as soon as that layer has run, so the peak is one layer's weights.

In a mixture-of-experts model the same pass also keeps where the router of every
captured layer sent each token (:class:`ExpertTrace`, through
:func:`attnlab.models.moe.record_routing`): the experts it chose and their weights, as the
layer used them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from attnlab.attention import Attention, AttentionCall

__all__ = [
    "ExpertTrace",
    "ModelTrace",
    "attention_layers",
    "auto_top_k",
    "trace_from_walkthrough",
    "trace_model",
]

# Above this many dense weights (all captured layers x heads x T x S) trace_model
# refuses dense mode and asks for top_k / layers / heads (4 bytes each: 256 MiB).
MAX_DENSE_ELEMENTS = 1 << 26

# Above this many dense weights (layers x heads x T x T) explainers (``attnlab explain``,
# ``attnlab serve``) keep only each query's strongest keys unless told otherwise.
AUTO_DENSE_LIMIT = 1 << 24
AUTO_TOP_K = 32


def auto_top_k(model: torch.nn.Module, n_tokens: int, top_k: int | None = None) -> int | None:
    """``top_k`` as asked, or :data:`AUTO_TOP_K` when a dense trace of ``model`` over
    ``n_tokens`` tokens would hold more than :data:`AUTO_DENSE_LIMIT` weights, else None."""
    if top_k is not None:
        return top_k
    blocks = attention_layers(model)
    dense = len(blocks) * int(blocks[0].num_heads) * n_tokens**2
    return AUTO_TOP_K if dense > AUTO_DENSE_LIMIT else None


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


# --------------------------------------------------------------------------- capture


def _encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` for tiktoken, Hugging Face and ``tokenizers`` tokenizers."""
    encoded = tokenizer.encode(text)
    ids = getattr(encoded, "ids", encoded)  # tokenizers.Encoding has .ids
    return [int(i) for i in ids]


def _token_texts(tokenizer: Any | None, ids: Sequence[int]) -> list[str]:
    """Each token's own text, as the tokenizer spells it (for display only)."""
    if tokenizer is None:
        return [str(i) for i in ids]
    if hasattr(tokenizer, "decode_single_token_bytes"):  # tiktoken: exact bytes per token
        return [
            tokenizer.decode_single_token_bytes(i).decode("utf-8", errors="replace") for i in ids
        ]
    if hasattr(tokenizer, "decode"):
        try:
            return [str(tokenizer.decode([i])) for i in ids]
        except Exception:  # some tokenizers refuse a lone special id
            pass
    if hasattr(tokenizer, "convert_ids_to_tokens"):
        return [str(t) for t in tokenizer.convert_ids_to_tokens(list(ids))]
    if hasattr(tokenizer, "id_to_token"):
        return [str(tokenizer.id_to_token(i)) for i in ids]
    return [str(i) for i in ids]


def _resolve_input(
    text_or_token_ids: str | Sequence[int] | torch.Tensor, tokenizer: Any | None
) -> tuple[list[int], list[str]]:
    if isinstance(text_or_token_ids, str):
        if not text_or_token_ids.strip():
            raise ValueError("`text_or_token_ids` must not be empty; give some text to trace")
        if tokenizer is None:
            raise ValueError(
                "`tokenizer` is needed to trace text; pass tokenizer=... or token ids instead"
            )
        ids = _encode(tokenizer, text_or_token_ids)
    elif isinstance(text_or_token_ids, torch.Tensor):
        t = text_or_token_ids
        if t.ndim == 2 and t.shape[0] == 1:
            t = t[0]
        if t.ndim != 1 or t.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            raise ValueError(
                "`text_or_token_ids` as a tensor must be integer token ids of shape (T,) or "
                f"(1, T), got dtype {t.dtype} and shape {tuple(text_or_token_ids.shape)}"
            )
        ids = [int(i) for i in t.tolist()]
    else:
        ids = [int(i) for i in text_or_token_ids]
    if not ids:
        raise ValueError("`text_or_token_ids` gave no tokens; a trace needs at least one")
    return ids, _token_texts(tokenizer, ids)


def attention_layers(model: torch.nn.Module) -> list[Attention]:
    """The model's :class:`attnlab.attention.Attention` layers, in module order.

    Raises:
        TypeError: the model has none.
    """
    from attnlab.attention import Attention

    found = [m for m in model.modules() if isinstance(m, Attention)]
    if not found:
        raise TypeError(
            f"`model` ({type(model).__name__}) has no attnlab.attention.Attention layers; "
            "trace_model explains models built on attnlab's attention"
        )
    return found


def _check_selection(name: str, chosen: Sequence[int] | None, count: int) -> tuple[int, ...]:
    if chosen is None:
        return tuple(range(count))
    picked = sorted({int(i) for i in chosen})
    if not picked or picked[0] < 0 or picked[-1] >= count:
        raise ValueError(
            f"`{name}` must be indices in 0..{count - 1}, got {list(chosen)}; "
            f"the model has {count} {name}"
        )
    return tuple(picked)


def _weights_of(captured: Any, name: str) -> torch.Tensor:
    weights = getattr(captured, "weights", captured)
    if not isinstance(weights, torch.Tensor) or weights.ndim != 4 or weights.shape[0] != 1:
        got = tuple(weights.shape) if isinstance(weights, torch.Tensor) else type(weights)
        raise RuntimeError(
            f"{name}.captured must hold weights of shape (1, H, T, S) after a forward pass "
            f"with capture on, got {got}"
        )
    return weights[0]  # (H, T, S)


def run_recorded(
    model: Any,
    input_ids: torch.Tensor,
    recorder: Any,
    forward: Callable[[Any, torch.Tensor], Any] | None = None,
    routing: Callable[[Any, Any], None] | None = None,
) -> None:
    """One forward pass of ``model`` in eval mode, without gradients, under ``recorder``
    (and ``routing``, a :func:`attnlab.models.moe.record_routing` recorder, when given).

    Only switches to eval mode when needed (and back afterwards), so a shared model that
    is already in eval mode is never touched.
    """
    from contextlib import nullcontext

    from attnlab.attention import record_attention
    from attnlab.models.moe import record_routing

    was_training = model.training
    try:
        if was_training:
            model.eval()
        routed = nullcontext() if routing is None else record_routing(routing)
        with torch.no_grad(), record_attention(recorder), routed:
            if forward is None:
                model(input_ids)
            else:
                forward(model, input_ids)
    finally:
        if was_training:
            model.train(True)


def trace_model(
    model: torch.nn.Module,
    text_or_token_ids: str | Sequence[int] | torch.Tensor,
    *,
    tokenizer: Any | None = None,
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
    top_k: int | None = None,
    queries_and_keys: bool = False,
    forward: Callable[[torch.nn.Module, torch.Tensor], Any] | None = None,
    source: str = "",
    max_dense_elements: int = MAX_DENSE_ELEMENTS,
) -> ModelTrace:
    """Run ``model`` once on one sequence and keep what its attention layers computed.

    The pass runs under a per-call recorder (:func:`attnlab.attention.record_attention`):
    each traced layer computes its exact weights through the attention core's
    exact-weights path and hands them to the recorder, which keeps the chosen heads
    (dense) or each query's ``top_k`` strongest keys at once, so the peak memory is one
    layer's weights ``(H, T, S)``, not all layers'. Nothing is set on the model's
    layers: concurrent traces of one shared model (threads of a server) are safe.

    Args:
        model: a module built on :class:`attnlab.attention.Attention` layers.
        text_or_token_ids: text (needs ``tokenizer``) or token ids ``(T,)``/``(1, T)``.
        tokenizer: encodes text and spells tokens (tiktoken or Hugging Face style).
        layers: the layers to keep (indices in module order; default all).
        heads: the query heads to keep (default all).
        top_k: keep only each query's ``top_k`` strongest keys (long inputs).
        queries_and_keys: also keep each layer's queries and keys as the layer used
            them (after RoPE).
        forward: how to call the model, ``forward(model, input_ids (1, T))``; default
            ``model(input_ids)``.
        source: a description for titles (default: the model's class name).
        max_dense_elements: refuse dense capture above this many weights in total.

    Returns:
        A frozen :class:`ModelTrace`.

    Raises:
        TypeError: the model has no attnlab attention layers.
        ValueError: empty input, text without a tokenizer, a layer or head out of
            range, a bad ``top_k``, or a dense capture too large for memory.
    """
    blocks = attention_layers(model)
    ids, tokens = _resolve_input(text_or_token_ids, tokenizer)
    T = len(ids)
    num_heads = int(blocks[0].num_heads)
    layer_sel = _check_selection("layers", layers, len(blocks))
    head_sel = _check_selection("heads", heads, num_heads)
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"`top_k` must be a positive int or None, got {top_k!r}")
    dense_elements = len(layer_sel) * len(head_sel) * T * T
    if top_k is None and dense_elements > max_dense_elements:
        raise ValueError(
            f"dense capture of {len(layer_sel)} layers x {len(head_sel)} heads x {T} x {T} "
            f"weights ({dense_elements:,}) exceeds max_dense_elements={max_dense_elements:,}; "
            "pass top_k=..., or fewer layers=/heads="
        )

    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)  # (1, T)
    all_heads = head_sel == tuple(range(num_heads))
    head_index = torch.tensor(head_sel, dtype=torch.long)
    request: Any = True
    if not all_heads:
        from attnlab.backends import WeightsRequest

        # Only the chosen heads' weights are computed: (1, H', T, S), not (1, H, T, S).
        request = WeightsRequest(heads=head_sel)
    position_of = {id(blocks[p]): p for p in layer_sel}
    kept: dict[int, dict[str, torch.Tensor]] = {}

    class Keep:
        """Per-call recorder: reduces each traced layer's weights as soon as it has run."""

        def request(self, layer: Attention) -> Any:
            return request if id(layer) in position_of else None

        def record(self, call: AttentionCall) -> None:
            position = position_of[id(call.layer)]
            weights = _weights_of(call.weights, f"layer {position}")  # (H', T, S)
            weights = weights.detach().float().cpu()
            if all_heads and weights.shape[0] != len(head_sel):
                raise RuntimeError(
                    f"layer {position} captured {weights.shape[0]} heads, expected {num_heads}"
                )
            entry: dict[str, torch.Tensor] = {}
            if top_k is None:
                entry["weights"] = weights
            else:
                k = min(top_k, weights.shape[-1])
                values, indices = torch.topk(weights, k, dim=-1)  # (H', K)
                entry["top_values"], entry["top_indices"] = values, indices
            if queries_and_keys:
                q = call.queries[0].detach().float().cpu()  # (H, T, D)
                kk = call.keys[0].detach().float().cpu()  # (G, S, D)
                kk = kk.repeat_interleave(num_heads // kk.shape[0], dim=0)  # (H, S, D)
                entry["queries"] = q.index_select(0, head_index)
                entry["keys"] = kk.index_select(0, head_index)
            kept[position] = entry

    expert_layers = _expert_layers(model, blocks, layer_sel)
    routed: dict[int, Any] = {}

    def keep_routing(layer: Any, routing: Any) -> None:
        position = expert_layers.get(id(layer))
        if position is not None:
            routed[position] = routing

    run_recorded(model, input_ids, Keep(), forward, keep_routing if expert_layers else None)

    missing = [p for p in layer_sel if p not in kept]
    if missing:
        raise RuntimeError(f"attention layers {missing} did not run during the forward pass")
    S = next(iter(kept.values()))["weights" if top_k is None else "top_indices"].shape[-2]
    if S != T:
        raise RuntimeError(f"expected self-attention over {T} tokens, got {S} query rows")

    def stack(name: str) -> torch.Tensor | None:
        if name not in kept[layer_sel[0]]:
            return None
        return torch.stack([kept[p][name] for p in layer_sel])  # (L, H, ...)

    return ModelTrace(
        tokens=tuple(tokens),
        key_tokens=tuple(tokens),
        layers=layer_sel,
        heads=head_sel,
        num_layers=len(blocks),
        num_heads=num_heads,
        weights=stack("weights"),
        top_indices=stack("top_indices"),
        top_values=stack("top_values"),
        queries=stack("queries"),
        keys=stack("keys"),
        token_ids=tuple(ids),
        source=source or type(model).__name__,
        experts=_expert_trace(model, expert_layers, routed, T),
        meta={"top_k": top_k},
    )


def _expert_layers(
    model: torch.nn.Module, blocks: Sequence[Attention], layer_sel: Sequence[int]
) -> dict[int, int]:
    """``id(moe) -> layer`` for the mixture-of-experts layers of the captured layers: a
    feed-forward belongs to the first attention layer of the block (module) holding both."""
    from attnlab.models.moe import MixtureOfExperts

    names = {id(m): name for name, m in model.named_modules()}
    prefixes = [names[id(b)].rpartition(".")[0] for b in blocks]
    found: dict[int, int] = {}
    for name, module in model.named_modules():
        if not isinstance(module, MixtureOfExperts):
            continue
        parent = name.rpartition(".")[0]
        layer = next((i for i, p in enumerate(prefixes) if p == parent), None)
        if layer is None:
            raise RuntimeError(f"the experts {name!r} share a block with no attention layer")
        if layer in layer_sel:
            found[id(module)] = layer
    return found


def _expert_trace(
    model: torch.nn.Module, expert_layers: dict[int, int], routed: dict[int, Any], T: int
) -> ExpertTrace | None:
    if not expert_layers:
        return None
    from attnlab.models.moe import MixtureOfExperts

    missing = sorted(set(expert_layers.values()) - set(routed))
    if missing:
        raise RuntimeError(f"the experts of layers {missing} did not run during the forward pass")
    layers = tuple(sorted(routed))
    for p in layers:
        if routed[p].experts.shape[0] != T:
            raise RuntimeError(
                f"the experts of layer {p} routed {routed[p].experts.shape[0]} tokens, expected {T}"
            )
    moes = [m for m in model.modules() if isinstance(m, MixtureOfExperts)]
    return ExpertTrace(
        layers=layers,
        num_experts=moes[0].config.num_experts,
        chosen=torch.stack([routed[p].experts.cpu() for p in layers]),  # (M, T, k)
        weights=torch.stack([routed[p].weights.float().cpu() for p in layers]),  # (M, T, k)
        shared=moes[0].shared is not None,
    )


def trace_from_walkthrough(trace: Any) -> ModelTrace:
    """The seed example's two forms of attention as a two-"layer", one-head trace.

    "Layer" 0 is the simplified form (``softmax(X·Xᵀ)``), "layer" 1 the trainable
    form (``softmax(Q·Kᵀ/√d_k)``), so the page's head and model views show the
    walkthrough's own weights side by side.

    Args:
        trace: an :class:`attnlab.explain.trace.AttentionTrace`.

    Returns:
        A :class:`ModelTrace` holding the trace's weights (not recomputed).
    """
    weights = torch.stack([trace.simplified.weights, trace.trainable.weights])  # (2, T, T)
    return ModelTrace(
        tokens=tuple(trace.tokens),
        key_tokens=tuple(trace.tokens),
        layers=(0, 1),
        heads=(0,),
        num_layers=2,
        num_heads=1,
        weights=weights.detach().float().unsqueeze(1),  # (2, 1, T, T)
        source=f"example {trace.example!r}",
        layer_names=("simplified: softmax(X·Xᵀ)", "trainable: softmax(Q·Kᵀ/√d_k)"),
    )
