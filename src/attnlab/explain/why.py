"""Why this token: direct logit attribution, activation patching and attribution patching.

Shape legend:
    L layers, H heads per layer, Dv a head's value dim, C model width, T tokens,
    S source (key) positions, E experts, B a batch of patched runs.

The metric is ``m = logit(target) - logit(contrast)`` (just ``logit(target)`` without a
contrast). Nothing here re-implements the model: every number is read from the model's
own forward through attnlab's named hook points (:func:`attnlab.attention.record_attention`
and :func:`attnlab.attention.edit_heads` for the heads' outputs before the output
projection, :func:`attnlab.models._lm.edit_block_input` for the stream entering each block,
:func:`attnlab.models._lm.edit_mlp` for each block's feed-forward write,
:func:`attnlab.models.moe.record_experts` for each expert's share,
:func:`attnlab.models._lm.watch_residual` for the stream the final norm reads), then
projected onto the logit difference through the weights (each head's slice of the output
projection, the unembedding rows) with the norms' scales frozen at their values in the run.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from attnlab.explain.heads import _causal_lm, _ids_batch

__all__ = [
    "Attribution",
    "Patching",
    "attribute",
    "attribution_patching",
    "patch",
    "patching",
    "token_id",
]

TokenArg = int | str
Over = Literal["heads", "residual", "mlp"]
_PATCH_BATCH = 64  # patched variants per batch (memory: B x T x C per layer)


# --------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class _Layout:
    """Where a causal LM keeps what attribution reads (attnlab's decoder or its GPT)."""

    blocks: list[nn.Module]
    attentions: list[Any]  # attnlab.attention.Attention per block
    attn_post: list[nn.Module | None]  # norm of the attention output before the residual add
    mlp_post: list[nn.Module | None]  # same for the feed-forward output
    residual_multiplier: float
    final_norm: nn.Module
    unembedding: Any  # nn.Linear or a weight format: rows of ``.weight`` (V, C)
    head_input_scale: float
    logits_scaling: float
    softcap: float | None
    frozen: tuple[str, ...]


def _layout(model: nn.Module, what: str) -> _Layout:
    from attnlab.models.decoder import Decoder
    from attnlab.models.gpt import GPTModel

    _causal_lm(model, what)
    if isinstance(model, GPTModel):
        blocks = list(model.trf_blocks)
        return _Layout(
            blocks=blocks,
            attentions=[b.att for b in blocks],
            attn_post=[None] * len(blocks),
            mlp_post=[None] * len(blocks),
            residual_multiplier=1.0,
            final_norm=model.final_norm,
            unembedding=model.out_head,
            head_input_scale=1.0,
            logits_scaling=1.0,
            softcap=None,
            frozen=("final norm scale (1/std, LayerNorm: each part centred)",),
        )
    if not isinstance(model, Decoder):
        raise TypeError(
            f"{what} needs attnlab's GPT or a decoder (attnlab.models.decoder.Decoder), got "
            f"{type(model).__name__}"
        )
    cfg = model.config
    if not cfg.causal or cfg.cross_attention or model.lm_head is None:
        raise ValueError(
            f"{what} needs a decoder-only causal LM; this {cfg.family!r} stack has "
            f"causal={cfg.causal}, cross_attention={cfg.cross_attention}, "
            f"output_head={cfg.output_head}: a cross-attention write has no per-head "
            "decomposition here"
        )
    decoder_blocks: list[Any] = list(model.blocks)
    kind = "1/rms" if cfg.norm == "rms" else "1/std, each part centred"
    frozen = [f"final norm scale ({kind})"]
    attn_post: list[nn.Module | None]
    mlp_post: list[nn.Module | None]
    if cfg.norm_placement == "sandwich":
        attn_post = [b.attn_post_norm for b in decoder_blocks]
        mlp_post = [b.mlp_post_norm for b in decoder_blocks]
        frozen.append(f"post-block norm scales (attn_post_norm, mlp_post_norm: {kind})")
    elif cfg.norm_placement == "post":
        attn_post = [b.attn_norm for b in decoder_blocks]
        mlp_post = [b.mlp_norm for b in decoder_blocks]
        frozen.append(f"post-block norm scales (attn_norm, mlp_norm: {kind})")
    else:
        attn_post = [None] * len(decoder_blocks)
        mlp_post = [None] * len(decoder_blocks)
    if cfg.final_softcap is not None:
        frozen.append(
            f"final logit soft-cap {cfg.final_softcap:g}: the pre-cap logit difference is "
            "decomposed"
        )
    return _Layout(
        blocks=decoder_blocks,
        attentions=[b.attention for b in decoder_blocks],
        attn_post=attn_post,
        mlp_post=mlp_post,
        residual_multiplier=float(cfg.residual_multiplier),
        final_norm=model.norm,
        unembedding=model.lm_head,
        head_input_scale=float(cfg.head_input_scale),
        logits_scaling=float(cfg.logits_scaling),
        softcap=cfg.final_softcap,
        frozen=tuple(frozen),
    )


def _pull_back(
    norm: nn.Module, x: torch.Tensor, direction: torch.Tensor
) -> tuple[torch.Tensor, float]:
    """``norm`` frozen at its input ``x`` ``(C,)``: ``norm(v) . direction == v . d + c``
    for ``v = x`` (and linear in ``v`` for the parts of ``x``); returns ``(d (C,), c)``.

    RMSNorm: ``1/rms(x)`` frozen. LayerNorm: ``1/std(x)`` frozen and the mean subtracted
    from each part (so ``d`` sums to 0); its bias is the constant ``c``.
    """
    from attnlab.models.gpt import LayerNorm as BookLayerNorm
    from attnlab.norms import RMSNorm

    xd = x.double()
    C = xd.shape[-1]
    if isinstance(norm, RMSNorm):
        inv = torch.rsqrt(xd.square().mean() + norm.eps)
        return norm.weight.detach().double() * direction * inv, 0.0
    if isinstance(norm, (nn.LayerNorm, BookLayerNorm)):
        if isinstance(norm, nn.LayerNorm):
            gain, shift = norm.weight, norm.bias
        else:
            gain, shift = norm.scale, norm.shift
        inv = torch.rsqrt(xd.var(unbiased=False) + norm.eps)
        g = gain.detach().double() if gain is not None else torch.ones(C, dtype=torch.float64)
        d = g * direction * inv
        d = d - d.mean()  # centring each part is the same as centring the direction
        c = float(shift.detach().double() @ direction) if shift is not None else 0.0
        return d, c
    raise TypeError(
        f"cannot freeze a {type(norm).__name__}: attribution knows RMSNorm and LayerNorm "
        "only, so it cannot decompose this model exactly"
    )


# --------------------------------------------------------------------------- arguments


def token_id(token: object, name: str, vocab_size: int, tokenizer: Any = None) -> int:
    """A token id from ``token``: an int id, or a string that is exactly one token.

    Args:
        token: the id or the text.
        name: the argument's name, for messages.
        vocab_size: ids must lie in ``[0, vocab_size)``.
        tokenizer: anything with ``encode(text) -> list[int]``; needed for a string.

    Returns:
        The id.

    Raises:
        TypeError: neither an int nor a str; a string without a tokenizer.
        ValueError: an id out of range, a string that is not exactly one token.
    """
    if isinstance(token, bool):
        raise TypeError(f"`{name}` must be a token id (int) or one token's text, got {token!r}")
    if isinstance(token, int):
        if not 0 <= token < vocab_size:
            raise ValueError(f"`{name}` must be a token id in [0, {vocab_size}), got {token}")
        return token
    if isinstance(token, str):
        if tokenizer is None:
            raise TypeError(
                f"`{name}` is text ({token!r}): pass `tokenizer=` to turn it into an id, or "
                "pass the id"
            )
        try:
            ids = list(tokenizer.encode(token, add_special_tokens=False))
        except TypeError:
            ids = list(tokenizer.encode(token))
        if len(ids) != 1:
            raise ValueError(
                f"`{name}` must be exactly one token, but {token!r} is {len(ids)} tokens "
                f"({ids}); pick one token (e.g. with a leading space) or pass its id"
            )
        return token_id(int(ids[0]), name, vocab_size)
    raise TypeError(
        f"`{name}` must be a token id (int) or one token's text (str), got {type(token).__name__}"
    )


def _vocab(layout: _Layout) -> int:
    rows = getattr(layout.unembedding, "out_features", None)
    return int(rows) if isinstance(rows, int) else int(layout.unembedding.weight.shape[0])


def _one_sequence(model: nn.Module, ids: Sequence[int] | torch.Tensor, name: str) -> torch.Tensor:
    try:
        batch = _ids_batch(model, ids)
    except ValueError as e:
        raise ValueError(str(e).replace("`ids`", f"`{name}`")) from None
    if batch.shape[0] != 1:
        raise ValueError(f"`{name}` must be one sequence (T,) or (1, T), got {tuple(batch.shape)}")
    return batch  # (1, T)


@contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    was_training = model.training
    if was_training:
        model.eval()
    try:
        yield
    finally:
        if was_training:
            model.train(True)


def _metric(logits: torch.Tensor, target: int, contrast: int | None) -> torch.Tensor:
    """``logit(target) - logit(contrast)`` at the last position of each row ``(B,)``."""
    last = logits[:, -1].double()  # (B, V)
    m = last[:, target]
    return m - last[:, contrast] if contrast is not None else m


# --------------------------------------------------------------------------- attribute


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


# --------------------------------------------------------------------------- patching


@dataclass(frozen=True)
class Patching:
    """Activation patching of ``m = logit(target) - logit(contrast)`` at the last position.

    Attributes:
        grid: ``(m - corrupted) / (clean - corrupted)`` per patched component: ``(L, H)``
            for heads, ``(L, T)`` for the residual stream and the MLPs.
        raw: the patched runs' ``m``, same shape as ``grid``.
        clean: ``m`` on the clean prompt.
        corrupted: ``m`` on the corrupted prompt.
        over: ``"heads"``, ``"residual"`` or ``"mlp"``.
        target: the target id.
        contrast: the contrast id.
    """

    grid: torch.Tensor
    raw: torch.Tensor
    clean: float
    corrupted: float
    over: str
    target: int
    contrast: int | None


@dataclass
class _Run:
    """One prompt's forward, as the patching needs it."""

    m: float
    streams: list[torch.Tensor]  # (1, T, C) entering each block
    contexts: list[torch.Tensor]  # (1, T, H*Dv) heads' outputs before the out-projection
    mlps: list[torch.Tensor]  # (1, T, C) feed-forward writes


def _pair(
    model: nn.Module,
    clean_ids: Sequence[int] | torch.Tensor,
    corrupted_ids: Sequence[int] | torch.Tensor,
    target: TokenArg,
    contrast: TokenArg | None,
    tokenizer: Any,
    what: str,
) -> tuple[_Layout, torch.Tensor, torch.Tensor, int, int | None]:
    layout = _layout(model, what)
    clean = _one_sequence(model, clean_ids, "clean_ids")
    corrupted = _one_sequence(model, corrupted_ids, "corrupted_ids")
    if clean.shape[1] != corrupted.shape[1]:
        raise ValueError(
            f"`clean_ids` ({clean.shape[1]} tokens) and `corrupted_ids` "
            f"({corrupted.shape[1]} tokens) must have the same length: patching swaps "
            "activations position by position"
        )
    V = _vocab(layout)
    t = token_id(target, "target", V, tokenizer)
    c = None if contrast is None else token_id(contrast, "contrast", V, tokenizer)
    return layout, clean, corrupted, t, c


def _record_run(
    model: nn.Module, layout: _Layout, input_ids: torch.Tensor, t: int, c: int | None
) -> _Run:
    from attnlab.attention import edit_heads
    from attnlab.models._lm import edit_block_input, edit_mlp

    L = len(layout.blocks)
    index = {id(a): i for i, a in enumerate(layout.attentions)}
    blocks = {id(b): i for i, b in enumerate(layout.blocks)}
    streams: list[Any] = [None] * L
    contexts: list[Any] = [None] * L
    mlps: list[Any] = [None] * L

    def stream(i: int, x: torch.Tensor) -> torch.Tensor:
        streams[i] = x.detach()
        return x

    def heads(layer: Any, context: torch.Tensor) -> torch.Tensor:
        i = index.get(id(layer))
        if i is not None:
            contexts[i] = context.detach()
        return context

    def mlp(block: nn.Module, m: torch.Tensor) -> torch.Tensor:
        i = blocks.get(id(block))
        if i is not None:
            mlps[i] = m.detach()
        return m

    with (
        _eval_mode(model),
        torch.no_grad(),
        edit_block_input(stream),
        edit_heads(heads),
        edit_mlp(mlp),
    ):
        logits = model(input_ids, logits_to_keep=1)  # type: ignore[operator]
    return _Run(float(_metric(logits, t, c)[0]), streams, contexts, mlps)


def _patched(
    model: nn.Module,
    layout: _Layout,
    corrupted: torch.Tensor,
    layer: int,
    chosen: torch.Tensor,
    over: str,
    good: _Run,
    bad: _Run,
    t: int,
    c: int | None,
) -> torch.Tensor:
    """``m`` of the corrupted run with component ``chosen[b]`` of ``layer`` taken from the
    clean run in batch row ``b`` ``(B,)``: one batch, run from ``layer`` up."""
    from attnlab.attention import edit_heads
    from attnlab.models._lm import edit_block_input, edit_mlp

    B = chosen.numel()
    rows = torch.arange(B)
    x_in = bad.streams[layer].expand(B, -1, -1)  # (B, T, C)
    if over == "residual":
        x_in = x_in.clone()
        x_in[rows, chosen] = good.streams[layer][0, chosen]  # (B, C)
    attention, block = layout.attentions[layer], layout.blocks[layer]

    def start(i: int, x: torch.Tensor) -> torch.Tensor:
        return x_in if i == layer else x

    def heads(a: Any, context: torch.Tensor) -> torch.Tensor:
        if over != "heads" or a is not attention:
            return context
        _, T, HD = context.shape
        H = a.num_heads
        out = context.clone().view(B, T, H, HD // H)  # (B, T, H, Dv)
        clean = good.contexts[layer].view(T, H, HD // H)  # (T, H, Dv)
        out[rows, :, chosen] = clean[:, chosen].transpose(0, 1)  # (B, T, Dv)
        return out.view(B, T, HD)

    def mlp(b: nn.Module, m: torch.Tensor) -> torch.Tensor:
        if over != "mlp" or b is not block:
            return m
        out = m.clone()
        out[rows, chosen] = good.mlps[layer][0, chosen]  # (B, C)
        return out

    with (
        _eval_mode(model),
        torch.no_grad(),
        edit_block_input(start, start=layer),
        edit_heads(heads),
        edit_mlp(mlp),
    ):
        logits = model(corrupted, logits_to_keep=1)  # type: ignore[operator]
    return _metric(logits, t, c)


def patching(
    model: nn.Module,
    clean_ids: Sequence[int] | torch.Tensor,
    corrupted_ids: Sequence[int] | torch.Tensor,
    target: TokenArg,
    contrast: TokenArg | None,
    over: Over = "heads",
    *,
    tokenizer: Any = None,
) -> Patching:
    """:func:`patch` with the raw metric of every patched run and of both prompts.

    Args, Raises: as :func:`patch`.

    Returns:
        A :class:`Patching`.
    """

    if over not in ("heads", "residual", "mlp"):
        raise ValueError(f"`over` must be 'heads', 'residual' or 'mlp', got {over!r}")
    layout, clean, corrupted, t, c = _pair(
        model, clean_ids, corrupted_ids, target, contrast, tokenizer, "patch"
    )
    good = _record_run(model, layout, clean, t, c)
    bad = _record_run(model, layout, corrupted, t, c)
    if good.m == bad.m:
        raise ValueError(
            f"the clean and corrupted prompts give the same logit difference ({good.m:.6g}): "
            "there is nothing to restore; pick prompts (or tokens) that differ"
        )
    L, T = len(layout.blocks), clean.shape[1]
    width = [int(a.num_heads) for a in layout.attentions]
    columns = max(width) if over == "heads" else T
    raw = torch.full((L, columns), float("nan"), dtype=torch.float64)
    for layer in range(L):
        n = width[layer] if over == "heads" else T
        for lo in range(0, n, _PATCH_BATCH):
            chosen = torch.arange(lo, min(n, lo + _PATCH_BATCH))  # (B,)
            raw[layer, lo : lo + chosen.numel()] = _patched(
                model, layout, corrupted, layer, chosen, over, good, bad, t, c
            )
    grid = (raw - bad.m) / (good.m - bad.m)
    return Patching(
        grid=grid.to(torch.float32),
        raw=raw.to(torch.float32),
        clean=good.m,
        corrupted=bad.m,
        over=over,
        target=t,
        contrast=c,
    )


def patch(
    model: nn.Module,
    clean_ids: Sequence[int] | torch.Tensor,
    corrupted_ids: Sequence[int] | torch.Tensor,
    target: TokenArg,
    contrast: TokenArg | None,
    over: Over = "heads",
    *,
    tokenizer: Any = None,
) -> torch.Tensor:
    """Activation patching: how much of ``m`` each clean component restores in the
    corrupted run.

    ``m = logit(target) - logit(contrast)`` at the last position. The corrupted prompt
    runs with one component taken from the clean run, and the grid holds
    ``(m - m_corrupted) / (m_clean - m_corrupted)``: 1 = that component alone restores the
    clean answer, 0 = it changes nothing.

    - ``over="heads"``: ``(L, H)``, a head's output (its slice of the output projection's
      input) at every position;
    - ``over="residual"``: ``(L, T)``, the residual stream entering block ``l`` at
      position ``t``;
    - ``over="mlp"``: ``(L, T)``, block ``l``'s feed-forward write at position ``t``.

    The patched variants of one layer run as one batch, from that layer up: the
    corrupted stream entering it is cached once, the layers below are never recomputed.
    Layers with fewer heads than the widest leave their extra cells NaN.

    Args:
        model: an attnlab causal LM.
        clean_ids: the clean prompt's ids ``(T,)`` or ``(1, T)``.
        corrupted_ids: the corrupted prompt's ids, the same length.
        target: the token the clean prompt should produce: id or one token's text.
        contrast: the token to compare with (id or text), or None for ``logit(target)``.
        over: ``"heads"``, ``"residual"`` or ``"mlp"``.
        tokenizer: turns a text ``target`` / ``contrast`` into its id.

    Returns:
        The normalised grid, float32.

    Raises:
        TypeError: not attnlab's GPT or decoder; a text token without a tokenizer.
        ValueError: prompts of different lengths (naming both), bad ids or tokens, an
            unknown ``over``, prompts with the same ``m``.

    Shape:
        ``(L, H)`` for heads, ``(L, T)`` for residual and mlp.
    """
    return patching(
        model, clean_ids, corrupted_ids, target, contrast, over, tokenizer=tokenizer
    ).grid


def attribution_patching(
    model: nn.Module,
    clean_ids: Sequence[int] | torch.Tensor,
    corrupted_ids: Sequence[int] | torch.Tensor,
    target: TokenArg,
    contrast: TokenArg | None,
    *,
    tokenizer: Any = None,
) -> torch.Tensor:
    """Attribution patching: the first-order estimate of :func:`patch` over heads.

    One forward of both prompts (as a batch of two) records every head's output ``z`` (its
    slice of the output projection's input) on each, and one backward from the corrupted
    run's ``m`` gives ``dm/dz`` there. Each head's cell is ``sum over positions and its dims of
    dm/dz * (z_clean - z_corrupted)``, divided by ``m_clean - m_corrupted`` as
    :func:`patch` normalises. No parameter gradient is computed, and the fast one-token
    decode step is never taken with gradients on.

    Args, Raises: as :func:`patch`.

    Returns:
        ``(L, H)`` float32.

    Shape:
        ``(L, H)``.
    """
    from attnlab.attention import edit_heads
    from attnlab.models._lm import edit_block_input

    layout, clean, corrupted, t, c = _pair(
        model, clean_ids, corrupted_ids, target, contrast, tokenizer, "attribution_patching"
    )
    index = {id(a): i for i, a in enumerate(layout.attentions)}
    L = len(layout.blocks)
    contexts: list[Any] = [None] * L

    def leaf(i: int, x: torch.Tensor) -> torch.Tensor:
        # a stream that needs a gradient, so the heads' outputs have one whatever the
        # parameters' requires_grad says
        return x.detach().requires_grad_(True) if i == 0 else x

    def keep(layer: Any, context: torch.Tensor) -> torch.Tensor:
        i = index.get(id(layer))
        if i is not None:
            contexts[i] = context  # (2, T, H*Dv): the clean row, then the corrupted one
        return context

    # Both prompts as one batch of two rows (each row attends only to itself): one
    # forward, and one backward from the corrupted row's metric.
    both = torch.cat([clean, corrupted])  # (2, T)
    with _eval_mode(model), torch.enable_grad(), edit_block_input(leaf), edit_heads(keep):
        logits = model(both, logits_to_keep=1)  # type: ignore[operator]
        metrics = _metric(logits, t, c)  # (2,)
        grads = torch.autograd.grad(metrics[1], contexts)
    m_good, m_bad = (float(v) for v in metrics.detach())
    if m_good == m_bad:
        raise ValueError(
            f"the clean and corrupted prompts give the same logit difference ({m_bad:.6g}): "
            "there is nothing to restore; pick prompts (or tokens) that differ"
        )
    width = [int(a.num_heads) for a in layout.attentions]
    out = torch.full((L, max(width)), float("nan"), dtype=torch.float64)
    for i in range(L):
        H = width[i]
        z = contexts[i].detach().double()
        delta = z[0] - z[1]  # (T, H*Dv)
        g = grads[i][1].double()  # (T, H*Dv)
        out[i, :H] = (g * delta).view(-1, H, delta.shape[-1] // H).sum((0, 2))  # (H,)
    return (out / (m_good - m_bad)).to(torch.float32)
