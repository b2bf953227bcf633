"""Capturing a trace: :func:`trace_model` runs a model once inside
:func:`attnlab.attention.record_attention` and keeps what each chosen layer computed;
:func:`trace_from_walkthrough` turns the walkthrough's trace into the same form; the limits on dense
capture and the explainers' automatic ``top_k``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from attnlab.explain.model_trace.traces import ExpertTrace, ModelTrace

if TYPE_CHECKING:
    from attnlab.attention import Attention, AttentionCall


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
