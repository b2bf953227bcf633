"""One head's computation for one query, step by step, as the model's own layer does it
(:func:`head_steps`, :class:`HeadSteps`; :class:`LatentWalk` for latent attention).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from attnlab.backends.base import softcap_scores
from attnlab.functional import attention_scores, attention_weights, context_vectors

if TYPE_CHECKING:
    from attnlab.attention import Attention, AttentionCall


@dataclass(frozen=True)
class LatentWalk:
    """How a multi-head latent attention head (:class:`attnlab.latent.LatentAttention`)
    gets its query, keys and values: through the per-token latent (float32, on the CPU).

    Every tensor is what the layer's own methods (``project``, ``rotate``, ``expand``,
    the ones its forward pass runs) give for the layer's input.

    Attributes:
        rank: r, the latent's width (``kv_lora_rank``).
        query_down: ``x_t @ W_dq.T`` ``(q_lora_rank,)`` before its norm, or None (one
            query projection).
        query_latent: ``RMSNorm(query_down)`` ``(q_lora_rank,)``, or None.
        q_nope: the head's query dims without position ``(Dn,)``.
        q_rope: the head's rotary query dims ``(Dr,)``, before RoPE.
        latent_raw: every token's ``x @ W_dkv.T`` latent dims ``(S, r)``, before the norm.
        latent: ``RMSNorm(latent_raw)`` ``(S, r)``: what the cache holds.
        k_rope: the shared rotary key ``(S, Dr)``, before RoPE.
        k_rope_rotated: the same after RoPE ``(S, Dr)`` (cached like this).
        k_nope: ``latent @ W_uk_h.T`` ``(S, Dn)``: the head's keys without position.
    """

    rank: int
    query_down: torch.Tensor | None
    query_latent: torch.Tensor | None
    q_nope: torch.Tensor
    q_rope: torch.Tensor
    latent_raw: torch.Tensor
    latent: torch.Tensor
    k_rope: torch.Tensor
    k_rope_rotated: torch.Tensor
    k_nope: torch.Tensor

    @property
    def rope_dim(self) -> int:
        """Dr, the rotary dims of a query/key."""
        return int(self.k_rope.shape[-1])


@dataclass(frozen=True)
class HeadSteps:
    """One query of one head, walked step by step (all tensors float32, on the CPU).

    Attributes:
        tokens: every token's text (queries and keys).
        token_ids: the token ids.
        layer: the attention layer (model numbering, from 0).
        head: the query head.
        kv_head: the key/value head it reads (grouped-query attention shares them).
        token: the query position.
        num_layers: attention layers in the model.
        num_heads: query heads per layer.
        num_kv_heads: key/value heads per layer.
        x: the layer's input for the query token ``(C,)``.
        query_projected: ``W_query(x)`` for this head ``(D,)``, before RoPE.
        query: the query the attention used ``(D,)`` (after RoPE; equal without RoPE).
        rope: whether the layer rotates queries and keys (RoPE).
        qk_norm: whether the layer normalises queries and keys (QK-norm) before RoPE.
        keys: the keys of every token for this head ``(S, D)``, as used.
        values: the values ``(S, Dv)``.
        scores: ``query · keys`` ``(S,)``.
        scale: the score scale (``1/√D`` unless the family sets another).
        scaled: ``scores * scale`` ``(S,)``.
        softcap: the layer's logit soft-cap ``c`` (Gemma 2), or None.
        capped: ``c * tanh(scaled / c)`` ``(S,)`` when the layer soft-caps, else None.
        sink: this head's sink logit (gpt-oss), or None: one more softmax column
            with no value, which takes some weight away from the keys.
        bias: the additive bias on the scaled scores (ALiBi, relative position) ``(S,)``,
            or None.
        allowed: which keys the mask lets the query see ``(S,)`` (True = may attend).
        masked: the scaled (and biased) scores with ``-inf`` where not allowed ``(S,)``.
        weights: ``softmax(masked)`` ``(S,)``.
        context: ``weights @ values`` ``(Dv,)``: this head's output for the token.
        out_proj_part: this head's share of the output projection ``(C,)``:
            ``context @ W_o[:, head].T``.
        output: the layer's output for the token ``(C,)`` (all heads, plus bias).
        layer_weights: the weights the layer itself computed for this row ``(S,)``.
        checks: max |difference| between the walk and the layer: ``weights``,
            ``context`` (this head's slice of the layer's context), ``output``
            (the heads' shares plus the bias against the layer's output), and for a
            latent attention layer ``latent`` (the query, keys and values rebuilt from
            the latent against those the layer attended with).
        source: a description of the model.
        latent: for a multi-head latent attention layer, how the query, keys and values
            come out of the per-token latent (:class:`LatentWalk`); else None.
    """

    tokens: tuple[str, ...]
    token_ids: tuple[int, ...]
    layer: int
    head: int
    kv_head: int
    token: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    x: torch.Tensor
    query_projected: torch.Tensor
    query: torch.Tensor
    rope: bool
    qk_norm: bool
    keys: torch.Tensor
    values: torch.Tensor
    scores: torch.Tensor
    scale: float
    scaled: torch.Tensor
    softcap: float | None
    capped: torch.Tensor | None
    sink: float | None
    bias: torch.Tensor | None
    allowed: torch.Tensor
    masked: torch.Tensor
    weights: torch.Tensor
    context: torch.Tensor
    out_proj_part: torch.Tensor
    output: torch.Tensor
    layer_weights: torch.Tensor
    checks: dict[str, float] = field(default_factory=dict)
    source: str = ""
    latent: LatentWalk | None = None

    @property
    def head_dim(self) -> int:
        """D, the width of a query/key."""
        return int(self.query.shape[-1])


def _check_index(name: str, value: object, count: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be an int, got {type(value).__name__}")
    if not 0 <= value < count:
        raise ValueError(
            f"`{name}` must be in 0..{count - 1} (the model has {count} {what}), got {value}"
        )
    return value


def head_steps(
    model: torch.nn.Module,
    text_or_token_ids: str | Sequence[int] | torch.Tensor,
    *,
    layer: int,
    head: int,
    token: int,
    tokenizer: Any | None = None,
    forward: Callable[[torch.nn.Module, torch.Tensor], Any] | None = None,
    source: str = "",
) -> HeadSteps:
    """Walk one query token through one head of ``model``, on the layer's real numbers.

    Args:
        model: a module built on :class:`attnlab.attention.Attention` layers.
        text_or_token_ids: text (needs ``tokenizer``) or token ids ``(T,)``/``(1, T)``.
        layer: the attention layer (module order, from 0).
        head: the query head (from 0).
        token: the query position (from 0).
        tokenizer: encodes text and spells tokens.
        forward: how to call the model, ``forward(model, input_ids (1, T))``.
        source: a description for titles (default: the model's class name).

    Returns:
        A frozen :class:`HeadSteps`.

    Raises:
        TypeError: the model has no attnlab attention layers; a non-int index.
        ValueError: empty input, text without a tokenizer, an index out of range.
    """
    from attnlab.backends import WeightsRequest
    from attnlab.explain.model_trace import _resolve_input, attention_layers, run_recorded

    blocks = attention_layers(model)
    _check_index("layer", layer, len(blocks), "attention layers")
    block = blocks[layer]
    _check_index("head", head, int(block.num_heads), "heads in this layer")
    ids, tokens = _resolve_input(text_or_token_ids, tokenizer)
    _check_index("token", token, len(ids), "tokens in this text")
    calls: list[AttentionCall] = []

    class One:
        def request(self, layer_: Attention) -> Any:
            return WeightsRequest(heads=(head,), rows=(token,)) if layer_ is block else None

        def record(self, call: AttentionCall) -> None:
            calls.append(call)

    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)  # (1, T)
    run_recorded(model, input_ids, One(), forward)
    if len(calls) != 1:
        raise RuntimeError(f"attention layer {layer} ran {len(calls)} times in one forward pass")
    return _walk(
        calls[0], tokens, ids, layer, head, token, len(blocks), source or type(model).__name__
    )


def _walk(
    call: AttentionCall,
    tokens: list[str],
    ids: list[int],
    layer: int,
    head: int,
    token: int,
    num_layers: int,
    source: str,
) -> HeadSteps:
    block = call.layer
    H, G = int(block.num_heads), int(block.num_kv_heads)
    g = head // (H // G)  # the key/value head this query head reads
    T, S = call.queries.shape[2], call.keys.shape[2]

    def cpu(t: torch.Tensor) -> torch.Tensor:
        return t.detach().float().cpu()

    q = cpu(call.queries[0, head, token])  # (D,)
    keys = cpu(call.keys[0, g])  # (S, D)
    values = cpu(call.values[0, g])  # (S, Dv)
    from attnlab.latent import LatentAttention

    latent: LatentWalk | None = None
    checks: dict[str, float] = {}
    if isinstance(block, LatentAttention):
        # Rebuild the head's query, keys and values from the latent with the layer's own
        # methods, and walk those: the check below says they are what the layer used.
        latent, q_l, keys_l, values_l = _latent_walk(block, call.x, head, token)
        checks["latent"] = max(
            float((a - b).abs().max()) for a, b in ((q_l, q), (keys_l, keys), (values_l, values))
        )
        q, keys, values = q_l, keys_l, values_l
    # The seed's steps, with the library's functions, on the layer's own tensors.
    scores = attention_scores(q, keys)  # (S,)
    scaled = scores * call.scale  # (S,)
    softcap = getattr(block, "softcap", None)
    capped = softcap_scores(scaled, softcap) if softcap is not None else None  # (S,)
    sinks = getattr(block, "sinks", None)
    sink = float(sinks[head].detach()) if sinks is not None else None
    bias: torch.Tensor | None = None
    allowed = torch.ones(S, dtype=torch.bool)
    masked = (capped if capped is not None else scaled).clone()
    if call.mask is not None:
        blk = call.mask.block(T, S, torch.tensor([token]), None, device=call.queries.device)
        if blk.status == "empty":
            allowed[:] = False
        if blk.bias is not None:
            b = cpu(blk.bias)
            b = b[0, head if b.shape[1] > 1 else 0] if b.ndim == 4 else b
            bias = b.reshape(-1, S)[-1].expand(S).clone()  # (S,)
            masked = masked + bias
        if blk.allowed is not None:
            a = blk.allowed.detach().cpu()
            a = a[0, head if a.shape[1] > 1 else 0] if a.ndim == 4 else a
            allowed = a.reshape(-1, S)[-1].expand(S).clone()
    masked = masked.masked_fill(~allowed, float("-inf"))
    if sink is None:
        weights = attention_weights(masked)  # (S,)
    else:  # the sink is one more softmax column with no value: dropped after the softmax
        weights = attention_weights(torch.cat([masked, masked.new_tensor([sink])]))[:S]
    if not bool(allowed.any()):
        weights = torch.zeros_like(weights)  # a row with nothing to attend to: zeros
    context = context_vectors(weights, values)  # (Dv,)
    Dv = context.shape[-1]
    w_o = cpu(block.out_proj.weight)  # (C, H*Dv)
    out_part = context @ w_o[:, head * Dv : (head + 1) * Dv].T  # (C,)

    layer_weights = cpu(call.weights[0, 0, 0]) if call.weights is not None else weights
    layer_context = cpu(call.context[0, token, head * Dv : (head + 1) * Dv])  # (Dv,)
    output = cpu(call.output[0, token])  # (C,)
    heads_ctx = cpu(call.context[0, token]).view(H, Dv)  # (H, Dv)
    shares = torch.einsum("hd,chd->c", heads_ctx, w_o.view(-1, H, Dv))  # (C,)
    if block.out_proj.bias is not None:
        shares = shares + cpu(block.out_proj.bias)
    checks.update(
        weights=float((weights - layer_weights).abs().max()),
        context=float((context - layer_context).abs().max()),
        output=float((shares - output).abs().max()),
    )
    return HeadSteps(
        latent=latent,
        tokens=tuple(tokens),
        token_ids=tuple(ids),
        layer=layer,
        head=head,
        kv_head=g,
        token=token,
        num_layers=num_layers,
        num_heads=H,
        num_kv_heads=G,
        x=cpu(call.x[0, token]),
        query_projected=cpu(call.queries_projected[0, head, token]),
        query=q,
        rope=block.rope is not None,
        qk_norm=getattr(block, "q_norm", None) is not None,
        keys=keys,
        values=values,
        scores=scores,
        scale=float(call.scale),
        scaled=scaled,
        softcap=softcap,
        capped=capped,
        sink=sink,
        bias=bias,
        allowed=allowed,
        masked=masked,
        weights=weights,
        context=context,
        out_proj_part=out_part,
        output=output,
        layer_weights=layer_weights,
        checks=checks,
        source=source,
    )


def _latent_walk(
    block: Any, x: torch.Tensor, head: int, token: int
) -> tuple[LatentWalk, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The latent walk of ``head`` for query ``token`` from the layer's input ``x``
    ``(1, T, C)`` (no cache: keys at positions ``0..T-1``), with the head's query ``(D,)``,
    keys ``(S, D)`` and values ``(S, Dv)`` it gives."""

    def cpu(t: torch.Tensor) -> torch.Tensor:
        return t.detach().float().cpu()

    T, Dn = x.shape[1], block.mla.qk_nope_head_dim
    with torch.no_grad():
        p = block.project(x)
        queries, entry = block.rotate(p, torch.arange(T, device=x.device))
        keys, values = block.expand(entry)  # (1, H, S, D), (1, H, S, Dv)
    walk = LatentWalk(
        rank=int(block.mla.kv_lora_rank),
        query_down=None if p.query_down is None else cpu(p.query_down[0, token]),
        query_latent=None if p.query_latent is None else cpu(p.query_latent[0, token]),
        q_nope=cpu(p.q_nope[0, head, token]),
        q_rope=cpu(p.q_rope[0, head, token]),
        latent_raw=cpu(p.latent_raw[0]),
        latent=cpu(p.latent[0]),
        k_rope=cpu(p.k_rope[0]),
        k_rope_rotated=cpu(entry[0, 0, :, p.latent.shape[-1] :]),
        k_nope=cpu(keys[0, head, :, :Dn]),
    )
    return walk, cpu(queries[0, head, token]), cpu(keys[0, head]), cpu(values[0, head])
