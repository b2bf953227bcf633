"""What attribution and patching read from a causal LM: where its blocks, norms and
unembedding are (:class:`_Layout`), a norm frozen at its input, and the arguments they share
(a token given as an id or as one token's text, one sequence of ids, the metric).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from attnlab.explain.heads import _causal_lm, _ids_batch

TokenArg = int | str
Over = Literal["heads", "residual", "mlp"]


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
