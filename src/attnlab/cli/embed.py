"""`attnlab embed`: sentence embeddings and their cosine similarities."""

from __future__ import annotations

from typing import Annotated

import typer

from attnlab.cli.app import app
from attnlab.cli.models import load_pretrained_model
from attnlab.cli.output import UserError, output, user_input


@app.command()
def embed(
    sentences: Annotated[list[str], typer.Argument(help="Two or more sentences to compare.")],
    model: Annotated[
        str,
        typer.Option(
            "--model", "-m", help="A pretrained encoder: all-minilm-l6-v2, or a model directory."
        ),
    ] = "all-minilm-l6-v2",
    backend: Annotated[
        str, typer.Option(help="Attention backend: auto, math, sdpa, blockwise, ...")
    ] = "auto",
    json_out: Annotated[
        bool,
        typer.Option("--json", help="Print sentences and similarities as JSON on stdout."),
    ] = False,
) -> None:
    """Embed sentences (mean pooling, L2 norm) and print their cosine similarities."""
    import json

    from rich.table import Table

    from attnlab.pretrained import cosine_similarity_matrix, sentence_embeddings

    if len(sentences) < 2:
        raise UserError(f"give at least two sentences to compare, got {len(sentences)}")
    encoder, tok, source = load_pretrained_model(model, kind="encoder", backend=backend)
    with user_input():
        sim = cosine_similarity_matrix(sentence_embeddings(encoder, tok, sentences))
    if json_out:
        output.raw(json.dumps({"model": source, "sentences": sentences, "cosine": sim.tolist()}))
        return
    table = Table(title=f"cosine similarity, {source}", title_justify="left")
    table.add_column("#", justify="right", no_wrap=True)
    table.add_column("sentence")
    for j in range(len(sentences)):
        table.add_column(str(j + 1), justify="right", no_wrap=True)
    for i, s in enumerate(sentences):
        table.add_row(str(i + 1), s, *(f"{float(v):.3f}" for v in sim[i]))
    output.show(table)
