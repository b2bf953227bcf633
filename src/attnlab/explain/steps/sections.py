"""The steps as data for every view: titled sections of labelled tables
(:func:`step_sections`) and a one-line summary (:func:`step_summary`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from attnlab.explain.steps.compute import HeadSteps

if TYPE_CHECKING:
    pass


def _table(
    name: str,
    values: torch.Tensor,
    *,
    rows: Sequence[str] | None = None,
    cols: Sequence[str] | None = None,
    shade: bool = False,
    corner: str | None = None,
) -> dict[str, Any]:
    m = values.detach().float().reshape(1, -1) if values.ndim == 1 else values.detach().float()
    cells = [[v if v == v and abs(v) != float("inf") else None for v in r] for r in m.tolist()]
    return {
        "name": name,
        "rows": list(rows) if rows is not None else None,
        "cols": list(cols) if cols is not None else [str(j) for j in range(m.shape[1])],
        "values": cells,  # None where -inf (masked) or not a number
        "shade": shade,
        "corner": corner,  # header of the row labels; None: "token"
    }


def step_sections(steps: HeadSteps, lang: str = "en") -> list[dict[str, Any]]:
    """The walk as titled sections with full numbers: what the terminal and the page show.

    Each section is ``{"id", "title", "body", "tables"}``; a table is ``{"name",
    "rows" (labels or None), "cols", "values" (rows of floats, None for -inf),
    "shade"}``. The words are the walkthrough's (``attnlab.explain.i18n``), in ``lang``.

    Raises:
        ValueError: an unsupported language.
    """
    from attnlab.explain.i18n import message, normalize_lang

    lang = normalize_lang(lang)

    def msg(key: str, **values: object) -> str:
        return message(key, lang, **values)

    s = steps
    pos, n, d = s.token, len(s.tokens), s.head_dim
    c = int(s.x.shape[-1])
    dv = int(s.values.shape[-1])
    labels = [f"{j} {t!r}" for j, t in enumerate(s.tokens)]
    dims = [str(j) for j in range(d)]
    out: list[dict[str, Any]] = []

    def add(id_: str, title: str, body: str, *tables: dict[str, Any]) -> None:
        out.append({"id": id_, "title": title, "body": body, "tables": list(tables)})

    add(
        "input",
        msg("step.input.title", pos=pos, c=c),
        msg("step.input.text"),
        _table(f"x_{pos}", s.x),
    )
    values_title = msg("step.values.title", n=n, d=dv)
    values_text = msg("step.values.text")
    if s.latent is not None:
        _latent_sections(s, msg, add, labels)
        values_title = msg("step.values.latent_title", n=n, head=s.head, d=dv)
        values_text = msg("step.values.latent")
    else:
        add(
            "query",
            msg("step.query.title", pos=pos, head=s.head, d=d),
            msg("step.query.text", pos=pos),
            _table(f"query_{pos}", s.query_projected),
        )
        if s.qk_norm:
            key = "step.qknorm_rope" if s.rope else "step.qknorm"
            add(
                "qk_norm",
                msg(f"{key}.title", pos=pos),
                msg("step.qknorm.text") + (" " + msg("step.rope.text") if s.rope else ""),
                _table(f"query_{pos}", s.query),
            )
        elif s.rope:
            add(
                "rope",
                msg("step.rope.title", pos=pos),
                msg("step.rope.text"),
                _table(f"query_{pos} ({msg('label.after_rope')})", s.query),
            )
        keys_text = msg("step.keys.rope" if s.rope else "step.keys.text")
        if s.num_kv_heads != s.num_heads:
            keys_text += " " + msg("step.keys.gqa", share=s.num_heads // s.num_kv_heads)
        add(
            "keys",
            msg("step.keys.title", n=n, kv=s.kv_head, d=d),
            keys_text,
            _table("keys", s.keys, rows=labels, cols=dims),
        )
    add(
        "scores",
        msg("step.scores.title", pos=pos, n=n),
        msg("step.scores.text"),
        _table(f"attn_scores_{pos}", s.scores, cols=labels),
    )
    add(
        "scale",
        *(
            (
                msg("step.scale.title", pos=pos, scale=s.scale, d=d),
                msg("step.scale.text", sqrt_dk=1.0 / s.scale),
            )
            if math.isclose(s.scale, d**-0.5, rel_tol=1e-6)
            else (
                msg("step.scale.other_title", pos=pos, scale=s.scale),
                msg("step.scale.other", d=d, usual=d**-0.5),
            )
        ),
        _table("scaled", s.scaled, cols=labels),
    )
    if s.capped is not None:
        add(
            "softcap",
            msg("step.softcap.title", c=s.softcap, n=n),
            msg("step.softcap.text"),
            _table("capped", s.capped, cols=labels),
        )
    if s.bias is not None:
        add(
            "bias",
            msg("step.bias.title", n=n),
            msg("step.bias.text"),
            _table("bias", s.bias, cols=labels),
        )
    hidden = int((~s.allowed).sum())
    if hidden:
        add(
            "mask",
            msg("step.mask.title", hidden=hidden, n=n),
            msg("step.mask.text"),
            _table("masked", s.masked, cols=labels),
        )
    weights_text = msg("step.weights.text", diff=s.checks["weights"])
    if s.sink is not None:
        weights_text += " " + msg("step.sink", sink=s.sink, mass=1.0 - float(s.weights.sum()))
    add(
        "weights",
        msg("step.weights.title", pos=pos, n=n, total=float(s.weights.sum())),
        weights_text,
        _table(f"attn_weights_{pos}", s.weights, cols=labels, shade=True),
    )
    add(
        "values",
        values_title,
        values_text,
        _table("values", s.values, rows=labels, cols=[str(j) for j in range(dv)]),
    )
    add(
        "context",
        msg("step.context.title", pos=pos, d=dv),
        msg("step.context.text", pos=pos, diff=s.checks["context"]),
        _table(f"context_vec_{pos}", s.context),
    )
    add(
        "out",
        msg("step.out.title", pos=pos, h=s.num_heads, c=c),
        msg("step.out.text", pos=pos, head=s.head, diff=s.checks["output"]),
        _table(
            f"output_{pos}",
            torch.stack([s.out_proj_part, s.output]),
            rows=[msg("label.head_share"), msg("label.output")],
            corner="",
        ),
    )
    return out


def _latent_sections(
    s: HeadSteps,
    msg: Callable[..., str],
    add: Callable[..., None],
    labels: list[str],
) -> None:
    """The steps from the input to the keys of a latent attention head: the query (through
    its low-rank pair when the layer has one), the latent, the shared rotary key, the
    head's keys."""
    w = s.latent
    assert w is not None  # the caller's branch
    pos, n, d, r, dr = s.token, len(s.tokens), s.head_dim, w.rank, w.rope_dim
    dn = d - dr
    after_rope = msg("label.after_rope")
    source, w_up = f"x_{pos}", "W_query"
    if w.query_down is not None and w.query_latent is not None:
        q = int(w.query_down.shape[-1])
        add(
            "q_down",
            msg("step.mla.q_down.title", pos=pos, q=q),
            msg("step.mla.q_down.text", pos=pos, q=q),
            _table(f"x_{pos} @ W_dq.T", w.query_down),
            _table(f"q_a_{pos}", w.query_latent),
        )
        source, w_up = f"q_a_{pos}", "W_uq"
    add(
        "query",
        msg("step.mla.query.title", pos=pos, src=source, w=w_up, head=s.head, dn=dn, dr=dr),
        msg("step.mla.query.text", dn=dn, dr=dr),
        _table(f"q_nope_{pos}", w.q_nope),
        _table(f"q_rope_{pos}", w.q_rope),
    )
    add(
        "rope",
        msg("step.mla.rope.title", pos=pos, d=d),
        msg("step.mla.rope.text", dn=dn, dr=dr),
        _table(f"q_rope_{pos} ({after_rope})", s.query[dn:]),
        _table(f"query_{pos}", s.query),
    )
    add(
        "latent",
        msg("step.mla.latent.title", n=n, r=r),
        msg("step.mla.latent.text", r=r, dr=dr),
        _table(f"(x @ W_dkv.T)[:, :{r}]", w.latent_raw, rows=labels),
        _table("c_kv", w.latent, rows=labels),
    )
    add(
        "k_rope",
        msg("step.mla.k_rope.title", n=n, dr=dr),
        msg("step.mla.k_rope.text", dr=dr),
        _table(f"(x @ W_dkv.T)[:, {r}:]", w.k_rope, rows=labels),
        _table(f"k_rope ({after_rope})", w.k_rope_rotated, rows=labels),
    )
    add(
        "k_nope",
        msg("step.mla.k_nope.title", n=n, head=s.head, dn=dn),
        msg("step.mla.k_nope.text"),
        _table("k_nope", w.k_nope, rows=labels),
    )
    add(
        "keys",
        msg("step.mla.keys.title", n=n, head=s.head, d=d),
        msg("step.mla.keys.text", dn=dn, dr=dr, diff=s.checks["latent"]),
        _table("keys", s.keys, rows=labels),
    )


def step_summary(steps: HeadSteps, lang: str = "en") -> str:
    """The walk's one-line header (model, layer, head, token)."""
    from attnlab.explain.i18n import message

    return message(
        "step.header",
        lang,
        source=steps.source,
        layer=steps.layer,
        head=steps.head,
        pos=steps.token,
        token=steps.tokens[steps.token],
        n=len(steps.tokens),
    )
