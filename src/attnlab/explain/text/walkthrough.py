"""The walkthrough in the terminal: every step of one attention computation, as tables
and one or two sentences each (:func:`walkthrough_renderables`).
"""

from __future__ import annotations

import torch
from rich.console import RenderableType
from rich.text import Text

from attnlab.explain.i18n import DEFAULT_LANG, message, normalize_lang
from attnlab.explain.text.base import Paragraph, _part, _step, format_number, matrix_table
from attnlab.explain.trace import AttentionTrace


def walkthrough_renderables(
    trace: AttentionTrace, lang: str = DEFAULT_LANG
) -> list[RenderableType]:
    """The walkthrough of ``trace`` as renderables, in the seed text's order.

    Part 1 is the simplified form (scores, weights with row sums, context vectors),
    part 2 the trainable walk for token ``trace.index`` then all tokens at once, part
    3 the ``SelfAttentionV1`` / ``SelfAttentionV2`` outputs and the weight copy.

    Args:
        trace: the computed trace.
        lang: ``"en"`` or ``"zh-TW"``.

    Returns:
        Renderables to print in order.

    Raises:
        ValueError: an unsupported language.
    """
    lang = normalize_lang(lang)

    def msg(key: str, **values: object) -> str:
        return message(key, lang, **values)

    t = trace
    n, d_in, d = t.n_tokens, t.d_in, t.d_out
    tokens = list(t.tokens)
    pos = t.index + 1  # the book counts tokens from 1 (x_2 is inputs[1])
    token = t.tokens[t.index]
    tok_label = msg("label.token")
    row_sum = msg("label.row_sum")
    in_cols = [f"x[{j}]" for j in range(d_in)]
    out_cols = [f"[{j}]" for j in range(d)]
    s, tr, tt, proj = t.simplified, t.trainable, t.trainable_token, t.projection
    explicit = proj.convention == "x @ W.T"

    def op(w: str) -> str:
        return f"@ {w}.T" if explicit else f"@ {w}"

    out: list[RenderableType] = [
        Paragraph(msg("header", example=t.example, n=n, d_in=d_in), indent=0, style="bold"),
        Paragraph(
            msg(f"example.{t.example}" if t.example in ("journey", "toy") else "example.custom"),
            indent=0,
        ),
        Text(""),
        _part(msg("part.simplified")),
        _step(
            msg("inputs.title", n=n, d_in=d_in),
            msg("inputs.text"),
            matrix_table(
                "inputs", t.inputs, row_labels=tokens, col_labels=in_cols, corner=tok_label
            ),
        ),
        _step(
            msg("scores.title", n=n),
            msg("scores.text"),
            matrix_table("attn_scores", s.scores, row_labels=tokens, col_labels=tokens),
        ),
        _step(
            msg("weights.title", n=n),
            msg("weights.text"),
            matrix_table(
                "attn_weights",
                s.weights,
                row_labels=tokens,
                col_labels=tokens,
                extra=(row_sum, s.row_sums),
            ),
        ),
        _step(
            msg("context.title", n=n, d=d_in),
            msg("context.text"),
            matrix_table("all_context_vecs", s.context, row_labels=tokens, col_labels=in_cols),
        ),
        _part(msg("part.trainable", pos=pos, token=token)),
    ]

    shape = tuple(proj.W_query.shape)
    w_cols = [f"[{j}]" for j in range(shape[1])]
    matrices_text = msg("matrices.explicit") if explicit else msg("matrices.seeded", seed=proj.seed)
    out.append(
        _step(
            msg("matrices.title", rows=shape[0], cols=shape[1]),
            matrices_text,
            *(
                matrix_table(name, w, col_labels=w_cols)
                for name, w in (
                    ("W_query", proj.W_query),
                    ("W_key", proj.W_key),
                    ("W_value", proj.W_value),
                )
            ),
        )
    )
    qkv = torch.stack([tt.query, tt.key, tt.value])  # (3, d)
    out.append(
        _step(
            msg("token_qkv.title", pos=pos, token=token),
            msg("token_qkv.text"),
            matrix_table(f"x_{pos}", tt.x, col_labels=in_cols),
            matrix_table(
                f"x_{pos} projected",
                qkv,
                row_labels=[
                    f"query_{pos} = x_{pos} {op('W_query')}",
                    f"key_{pos} = x_{pos} {op('W_key')}",
                    f"value_{pos} = x_{pos} {op('W_value')}",
                ],
                col_labels=out_cols,
            ),
        )
    )
    out.append(
        _step(
            msg("keys_values.title", n=n, d=d),
            msg("keys_values.text", pos=pos, op_k=op("W_key"), op_v=op("W_value")),
            matrix_table("keys", tr.keys, row_labels=tokens, col_labels=out_cols),
            matrix_table("values", tr.values, row_labels=tokens, col_labels=out_cols),
        )
    )
    out.append(
        _step(
            msg("score_self.title", pos=pos),
            msg("score_self.text", pos=pos),
            Text(f"attn_score_{pos}{pos} = {format_number(tt.score_self)}", style="bold"),
        )
    )
    out.append(
        _step(
            msg("token_scores.title", pos=pos, n=n),
            msg("token_scores.text", pos=pos),
            matrix_table(f"attn_scores_{pos}", tt.scores, col_labels=tokens),
        )
    )
    scale = tr.scale if tr.scale is not None else 1.0
    out.append(
        _step(
            msg("token_weights.title", pos=pos, d_k=tr.d_k),
            msg("token_weights.text", sqrt_dk=1.0 / scale),
            matrix_table(f"attn_scores_{pos} / √d_k", tt.scaled_scores, col_labels=tokens),
            matrix_table(
                f"attn_weights_{pos}",
                tt.weights,
                col_labels=tokens,
                extra=(msg("label.row_sum"), torch.tensor([tt.weights_sum])),
            ),
        )
    )
    out.append(
        _step(
            msg("token_context.title", pos=pos, d=d),
            msg("token_context.text"),
            matrix_table(f"context_vec_{pos}", tt.context, col_labels=out_cols),
        )
    )
    out.append(
        _step(
            msg("all.title", n=n),
            msg("all.text", pos=pos, diff=t.checks.token_vs_all),
            matrix_table(
                "attn_weights",
                tr.weights,
                row_labels=tokens,
                col_labels=tokens,
                extra=(row_sum, tr.row_sums),
            ),
            matrix_table("context_vecs", tr.context, row_labels=tokens, col_labels=out_cols),
        )
    )

    out.append(_part(msg("part.modules")))
    for run in t.modules:
        if run.role == "v1":
            text = msg("v1.text.seeded", pos=pos, diff=t.checks.module_vs_walk)
        elif run.role == "v2":
            text = (
                msg("v2.text.explicit", diff=t.checks.module_vs_walk)
                if explicit
                else msg("v2.text.seeded")
            )
        else:
            text = msg("copy.text", diff=t.checks.v1_from_v2_vs_v2)
        out.append(
            _step(
                f"{run.name}: {run.built}",
                text,
                matrix_table(run.name, run.output, row_labels=tokens, col_labels=out_cols),
            )
        )
    return out
