"""Direct logit attribution: the metric at one position split exactly into the writes of
the embedding, each head (and each source position it read), each feed-forward block and
each expert, read through the final norm frozen at its value in the run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from attnlab.explain.why.layout import (
    TokenArg,
    _eval_mode,
    _Layout,
    _layout,
    _one_sequence,
    _pull_back,
    _vocab,
    token_id,
)


@dataclass(frozen=True)
class Attribution:
    """Direct logit attribution of ``m = logit(target) - logit(contrast)`` at one position.

    ``total == embedding + heads.sum() + mlp.sum() + bias + error``, with ``|error|`` at the
    level of float32 rounding: every part is a write into the residual stream read through
    the final norm (its scale frozen at its value in this run) and the unembedding.

    Attributes:
        total: the decomposed metric (the pre-cap one where the model soft-caps its logits,
            see ``frozen``).
        logit_difference: the model's own output metric (after any soft-cap).
        embedding: the token embedding plus learned position embeddings (embedding scale,
            multiplier and norm included).
        heads: ``(L, H)`` each head's write through its slice of the output projection
            (no bias; through the frozen post-block norm where the family has one).
        mlp: ``(L,)`` each feed-forward block's write (its own biases included).
        experts: ``(L, E)`` each routed expert's share of ``mlp`` (zero on dense layers and
            for experts the token did not choose), or None without experts.
        shared_experts: ``(L,)`` the shared expert's share, or None without one; on a
            routed layer ``experts[l].sum() + shared_experts[l] == mlp[l]``.
        bias: every constant term: output-projection biases, the norms' biases.
        error: ``total`` minus the sum of the parts.
        by_source: ``(L, H, S)`` each head split over the source positions it attended to
            (``A[p, j] * (v_j W_O^h) . u``, summing over S to ``heads``), or None.
        target: the target token id.
        contrast: the contrast token id, or None.
        position: the (non-negative) position whose next-token logits are explained.
        frozen: what was frozen or decomposed to make the parts exact, one line each.
    """

    total: float
    logit_difference: float
    embedding: float
    heads: torch.Tensor
    mlp: torch.Tensor
    experts: torch.Tensor | None
    shared_experts: torch.Tensor | None
    bias: float
    error: float
    by_source: torch.Tensor | None
    target: int
    contrast: int | None
    position: int
    frozen: tuple[str, ...]


class _Capture:
    """Everything one forward wrote at one position, read through the hook points."""

    def __init__(self, layout: _Layout, position: int, by_source: bool) -> None:
        from attnlab.backends.base import WeightsRequest

        self.index = {id(a): i for i, a in enumerate(layout.attentions)}
        self.block_index = {id(b): i for i, b in enumerate(layout.blocks)}
        self.p = position
        self.wanted: bool | WeightsRequest = (
            WeightsRequest(rows=(position,)) if by_source else False
        )
        L = len(layout.blocks)
        self.context: list[torch.Tensor | None] = [None] * L  # (H*Dv,)
        self.attn_out: list[torch.Tensor | None] = [None] * L  # (C,)
        self.weights: list[torch.Tensor | None] = [None] * L  # (H, S)
        self.values: list[torch.Tensor | None] = [None] * L  # (G, S, Dv)
        self.mlp: list[torch.Tensor | None] = [None] * L  # (C,)
        self.experts: dict[int, dict[int | None, torch.Tensor]] = {}
        self.embedding: torch.Tensor | None = None
        self.final: torch.Tensor | None = None
        self.moe_index: dict[int, int] = {}
        for i, b in enumerate(layout.blocks):
            mlp = getattr(b, "mlp", None)
            if mlp is not None:
                self.moe_index[id(mlp)] = i

    # record_attention's protocol
    def request(self, layer: Any) -> Any:
        return self.wanted if id(layer) in self.index else None

    def record(self, call: Any) -> None:
        i = self.index[id(call.layer)]
        p = self.p
        self.context[i] = call.context[0, p].detach()
        self.attn_out[i] = call.output[0, p].detach()
        if call.weights is not None:
            H = call.context.shape[-1] // call.values.shape[-1]
            w = call.weights[0, :, 0].detach()  # (H, S)
            assert w.shape[0] == H
            self.weights[i] = w
            self.values[i] = call.values[0].detach()  # (G, S, Dv)


def attribute(
    model: nn.Module,
    ids: Sequence[int] | torch.Tensor,
    target: TokenArg,
    contrast: TokenArg | None = None,
    position: int = -1,
    *,
    by_source: bool = False,
    tokenizer: Any = None,
) -> Attribution:
    """Which heads and MLPs write ``logit(target) - logit(contrast)``: direct logit
    attribution, exact to float32 rounding.

    One forward of ``ids`` records, at ``position``, the stream entering the first block
    (the embedding), every head's output before the output projection, every feed-forward
    write (every expert's, for a mixture of experts) and the stream the final norm reads.
    Each is projected onto ``u = W_U[target] - W_U[contrast]`` through the final norm with
    its scale frozen at its value in this run (RMSNorm: ``1/rms``; LayerNorm: ``1/std``
    with each part centred and the norm's bias going to ``bias``), the family's residual
    multiplier, head-input scale and logit scaling. Where the family normalises a block's
    output before adding it (Gemma 2 and 3's ``attn_post_norm`` / ``mlp_post_norm``, OLMo
    2's post-norm), that norm's scale is frozen too, so each head's write through it is
    linear; where the model soft-caps its logits, the pre-cap difference is decomposed
    (``Attribution.total``; the capped one is ``logit_difference``). ``frozen`` says which.

    Args:
        model: an attnlab causal LM (its GPT or a decoder of any family, GGUF files too).
        ids: token ids ``(T,)`` or ``(1, T)``.
        target: the token to explain: an id, or text that is exactly one token.
        contrast: the token to explain it against (id or one token's text), or None.
        position: the position whose next-token logits are explained (negative counts
            from the end).
        by_source: also split every head over the source positions, ``(L, H, S)``.
        tokenizer: turns a text ``target`` / ``contrast`` into its id.

    Returns:
        An :class:`Attribution`.

    Raises:
        TypeError: not attnlab's GPT or decoder; a text token without a tokenizer; a norm
            attribution cannot freeze.
        ValueError: bad ids, a position out of range, a token id out of range, a text that
            is not exactly one token, a stack with cross attention or without an LM head.

    Shape:
        ids ``(T,)`` -> heads ``(L, H)``, mlp ``(L,)``, experts ``(L, E)``,
        by_source ``(L, H, T)``.
    """
    from attnlab.attention import record_attention
    from attnlab.models._lm import edit_block_input, edit_mlp, watch_residual
    from attnlab.models.moe import record_experts

    layout = _layout(model, "attribute")
    input_ids = _one_sequence(model, ids, "ids")
    T = input_ids.shape[1]
    if isinstance(position, bool) or not isinstance(position, int) or not -T <= position < T:
        raise ValueError(f"`position` must be an int in [{-T}, {T}), got {position!r}")
    p = position % T
    V = _vocab(layout)
    t = token_id(target, "target", V, tokenizer)
    c = None if contrast is None else token_id(contrast, "contrast", V, tokenizer)
    cap = _Capture(layout, p, by_source)
    L = len(layout.blocks)

    def embedding(index: int, x: torch.Tensor) -> torch.Tensor:
        if index == 0:
            cap.embedding = x[0, p].detach()
        return x

    def mlp_write(block: nn.Module, m: torch.Tensor) -> torch.Tensor:
        i = cap.block_index.get(id(block))
        if i is not None:
            cap.mlp[i] = m[0, p].detach()
        return m

    def expert(layer: nn.Module, e: int | None, rows: torch.Tensor, y: torch.Tensor) -> None:
        i = cap.moe_index.get(id(layer))
        if i is None:
            return
        hit = (rows == p).nonzero()
        if hit.numel():
            cap.experts.setdefault(i, {})[e] = y[int(hit[0, 0])].detach()

    def final(index: int, x: torch.Tensor) -> None:
        if index == L - 1:
            cap.final = x[0, p].detach()

    with (
        _eval_mode(model),
        torch.no_grad(),
        record_attention(cap),
        edit_block_input(embedding),
        edit_mlp(mlp_write),
        record_experts(expert),
        watch_residual(final),
    ):
        logits = model(input_ids, logits_to_keep=T - p)  # type: ignore[operator]
    assert isinstance(logits, torch.Tensor)
    missing = [
        name
        for name, seen in (
            ("embedding", cap.embedding is not None),
            ("final stream", cap.final is not None),
            ("heads", all(x is not None for x in cap.context)),
            ("feed-forward writes", all(x is not None for x in cap.mlp)),
        )
        if not seen
    ]
    if missing:
        raise RuntimeError(f"attribute: the forward did not report {', '.join(missing)}")
    return _decompose(layout, cap, logits[0, 0], t, c, p, by_source)


def _decompose(
    layout: _Layout,
    cap: _Capture,
    logits: torch.Tensor,
    t: int,
    c: int | None,
    p: int,
    by_source: bool,
) -> Attribution:
    """The parts of the metric from what :func:`attribute` captured (float64 arithmetic)."""
    assert cap.final is not None and cap.embedding is not None
    with torch.no_grad():
        W_U = layout.unembedding.weight.detach()
        u = W_U[t].double() - (W_U[c].double() if c is not None else 0.0)  # (C,)
        scale = layout.head_input_scale / layout.logits_scaling
        u = u * scale
        bias = 0.0
        head_bias = getattr(layout.unembedding, "bias", None)
        if head_bias is not None:
            b = head_bias.detach().double()
            bias += float((b[t] - (b[c] if c is not None else 0.0)) / layout.logits_scaling)
        w_final, const = _pull_back(layout.final_norm, cap.final, u)  # (C,)
        bias += const
        hidden = layout.final_norm(cap.final[None]).double()[0] * scale  # (C,)
        total = float(hidden @ (W_U[t].double() - (W_U[c].double() if c is not None else 0.0)))
        total += bias - const  # the unembedding's bias, if any
        out = logits.double()
        model_m = float(out[t] - (out[c] if c is not None else 0.0))
        if layout.softcap is None:
            total = model_m  # the model's own number; the parts are checked against it
        r = layout.residual_multiplier
        L = len(layout.blocks)
        H = int(layout.attentions[0].num_heads)
        heads = torch.zeros(L, H, dtype=torch.float64)
        mlp = torch.zeros(L, dtype=torch.float64)
        moe = [i for i in range(L) if _is_moe(layout.blocks[i])]
        E = max((_num_experts(layout.blocks[i]) for i in moe), default=0)
        experts = torch.zeros(L, E, dtype=torch.float64) if moe else None
        shared = (
            torch.zeros(L, dtype=torch.float64)
            if any(getattr(layout.blocks[i].mlp, "shared", None) is not None for i in moe)
            else None
        )
        sources: torch.Tensor | None = None
        if by_source:
            S = int(cap.values[0].shape[1]) if cap.values[0] is not None else p + 1
            sources = torch.zeros(L, H, S, dtype=torch.float64)
        embedding = float(cap.embedding.double() @ w_final)
        for i in range(L):
            attn = layout.attentions[i]
            z = cap.context[i]
            assert z is not None
            w_attn = w_final * r
            post = layout.attn_post[i]
            written = cap.attn_out[i]
            if post is not None:
                assert written is not None
                w_attn, k = _pull_back(post, written, w_attn)
                bias += k * r
            W_O = attn.out_proj.weight.detach().float()  # (C, H*Dv), no copy for fp32
            Dv = W_O.shape[1] // attn.num_heads
            # one fp32 product (a float64 copy of every W_O would cost more than the
            # forward); its rounding is far below the parts' tolerance
            direction = (w_attn.float() @ W_O).double().view(attn.num_heads, Dv)  # (H, Dv)
            heads[i, : attn.num_heads] = (z.double().view(attn.num_heads, Dv) * direction).sum(-1)
            if attn.out_proj.bias is not None:
                bias += float(attn.out_proj.bias.detach().double() @ w_attn)
            if sources is not None:
                A, values = cap.weights[i], cap.values[i]
                assert A is not None and values is not None
                group = attn.num_heads // values.shape[0]
                v = values.double().repeat_interleave(group, dim=0)  # (H, S, Dv)
                per_source = (v * direction[:, None, :]).sum(-1)  # (H, S)
                sources[i, :, : per_source.shape[1]] = A.double() * per_source
            m = cap.mlp[i]
            assert m is not None
            w_mlp = w_final * r
            mlp[i] = float(m.double() @ w_mlp)
            post = layout.mlp_post[i]
            shift = _shift(post)
            if shift is not None:
                k = float(shift @ w_mlp)
                mlp[i] -= k
                bias += k
            if i in moe and experts is not None:
                parts = cap.experts.get(i, {})
                w_e = w_final * r
                if post is not None:
                    raw = torch.stack(list(parts.values())).sum(0)  # the block's raw output
                    w_e, _ = _pull_back(post, raw, w_e)
                for e, y in parts.items():
                    value = float(y.double() @ w_e)
                    if e is None:
                        assert shared is not None
                        shared[i] = value
                    else:
                        experts[i, e] = value
        parts_sum = embedding + float(heads.sum()) + float(mlp.sum()) + bias
    f32 = torch.float32
    return Attribution(
        total=total,
        logit_difference=model_m,
        embedding=embedding,
        heads=heads.to(f32),
        mlp=mlp.to(f32),
        experts=experts.to(f32) if experts is not None else None,
        shared_experts=shared.to(f32) if shared is not None else None,
        bias=bias,
        error=total - parts_sum,
        by_source=sources.to(f32) if sources is not None else None,
        target=t,
        contrast=c,
        position=p,
        frozen=layout.frozen,
    )


def _is_moe(block: nn.Module) -> bool:
    from attnlab.models.moe import MixtureOfExperts

    return isinstance(getattr(block, "mlp", None), MixtureOfExperts)


def _num_experts(block: Any) -> int:
    return int(block.mlp.config.num_experts)


def _shift(norm: nn.Module | None) -> torch.Tensor | None:
    """A norm's additive bias (float64), or None."""
    if norm is None:
        return None
    shift = getattr(norm, "bias", None)
    if shift is None:
        shift = getattr(norm, "shift", None)
    return shift.detach().double() if isinstance(shift, torch.Tensor) else None
