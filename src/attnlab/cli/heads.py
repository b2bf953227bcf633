"""`attnlab heads`: what every head of a model does (previous token, first token, current
token, induction), scored from the weights the model computed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from attnlab.cli.app import app
from attnlab.cli.models import load_model_arg
from attnlab.cli.output import UserError, output, user_input
from attnlab.explain.heads import default_input, head_scores
from attnlab.explain.model_trace import _encode


@app.command()
def heads(
    text: Annotated[
        str | None,
        typer.Argument(
            help="Score the heads on this text (induction only if it is a sequence repeated "
            "twice); default: 32 random tokens (seed 0) repeated twice."
        ),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            "--model", "-m", help="A pretrained model name, a model directory or a .gguf file."
        ),
    ] = None,
    checkpoint: Annotated[
        Path | None, typer.Option(help="A GPT checkpoint folder written by `attnlab train`.")
    ] = None,
    top: Annotated[int, typer.Option("--top", help="Heads shown per role.")] = 5,
    n: Annotated[
        int, typer.Option("--n", help="Length of the random sequence that is repeated.")
    ] = 32,
    seed: Annotated[int, typer.Option(help="Seed of the random sequence.")] = 0,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print every head's score of every role as JSON.")
    ] = False,
) -> None:
    """Score every head's role: previous token, first token, current token, induction.

    Each score is a mean of the head's own attention weights: on the token before the
    query, on the first token, on the query itself, and (on a random sequence repeated
    twice) on the token that followed the query's earlier copy.
    """
    from attnlab.explain.text import roles_table

    if top < 1:
        raise UserError(f"`--top` must be at least 1, got {top}")
    net, tokenizer, source = load_model_arg(checkpoint, model)
    if text is not None:
        if not text.strip():
            raise UserError("TEXT must not be empty (leave it out for the repeated random input)")
        ids = _encode(tokenizer, text)
        about = f"{len(ids)} tokens of the given text"
    else:
        with user_input():
            ids = default_input(net, n, seed)
        about = f"{n} random tokens (seed {seed}) repeated twice: {2 * n} tokens"
    with user_input():
        scores = head_scores(net, ids)
    if as_json:
        data = {
            "model": source,
            "input": about,
            "ids": ids,
            "roles": list(scores),
            "scores": {role: values.tolist() for role, values in scores.items()},
        }
        output.raw(json.dumps(data))
        return
    L, H = next(iter(scores.values())).shape
    for line in (
        f"{source}: {L} layers x {H} heads, on {about}",
        "Strongest heads per role (layer.head score; a mean attention weight, 0..1):",
    ):
        output.console.print(line, markup=False, soft_wrap=True)
    output.show(roles_table(scores, min(top, L * H)))
    if "induction" not in scores:
        output.note("induction is scored only on a sequence repeated twice (leave TEXT out)")
