"""`attnlab generate`: continue a prompt with a trained GPT or a pretrained model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from attnlab.cli.app import app
from attnlab.cli.models import check_dtype, load_pretrained_kind, use_backend
from attnlab.cli.output import UserError, output, user_input


def _generate_pretrained(
    name: str,
    prompt: str,
    *,
    chat: bool,
    backend: str,
    dtype: str,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    seed: int,
    use_cache: bool,
) -> None:
    """Stream a pretrained causal LM's continuation of ``prompt`` (or its chat reply)."""
    model, tok = load_pretrained_kind(name, "causal-lm", backend, dtype)
    import torch

    from attnlab.generation import TextStream, generate_stream

    text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
    ids = tok.encode(text)
    if model.context_length is not None:  # an encoder-decoder has none (relative positions)
        ids = ids[-model.context_length :]
    # An encoder-decoder answers in a new sequence: the prompt is its input, not echoed.
    echo = not chat and not getattr(model, "is_encoder_decoder", False)
    gen = torch.Generator().manual_seed(seed)
    stream = TextStream(tok, ids[-1:] if echo else ())  # keeps the first token's space
    started = False
    with user_input():
        for nxt in generate_stream(
            model,
            torch.tensor([ids]),
            max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            eos_id=tok.eos_id,
            use_cache=use_cache,
            generator=gen,
        ):
            if not started and echo:
                output.stream(prompt)  # after the first step: the arguments are valid
            started = True
            token = int(nxt[0, 0])
            if token == tok.eos_id:
                break
            output.stream(stream.push(token))
    output.stream(("" if started or not echo else prompt) + stream.flush() + "\n")


@app.command()
def generate(
    prompt: Annotated[str, typer.Argument(help="Text to continue (with --chat: the question).")],
    checkpoint: Annotated[
        Path | None, typer.Option(help="A checkpoint folder written by `attnlab train`.")
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            "-m",
            help="A pretrained model instead: smollm2-135m-instruct, gemma3-270m, a model "
            "directory or a .gguf file.",
        ),
    ] = None,
    chat: Annotated[
        bool,
        typer.Option("--chat", help="With --model: apply its chat template (a user turn)."),
    ] = False,
    backend: Annotated[
        str, typer.Option(help="Attention backend: auto, math, sdpa, blockwise, ...")
    ] = "auto",
    dtype: Annotated[
        str,
        typer.Option(
            help="Weight precision: float32 (exact), bfloat16, int8, int4 (weight-only; "
            "faster decoding, see README for each one's accuracy)."
        ),
    ] = "float32",
    max_new_tokens: Annotated[
        int, typer.Option("--max-new-tokens", "-n", help="Tokens to generate.")
    ] = 50,
    temperature: Annotated[float, typer.Option(help="0 = greedy; > 0 samples.")] = 0.0,
    top_k: Annotated[int | None, typer.Option("--top-k", help="Sample among the top k.")] = None,
    top_p: Annotated[
        float | None, typer.Option("--top-p", help="Nucleus sampling threshold.")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed for sampling.")] = 123,
    no_cache: Annotated[
        bool, typer.Option("--no-cache", help="Recompute the whole window for every token.")
    ] = False,
) -> None:
    """Continue a prompt with a trained GPT or a pretrained model, streaming the text."""
    import codecs

    import torch

    from attnlab.checkpoint import CheckpointError
    from attnlab.data import EOT_TOKEN_ID, get_tokenizer
    from attnlab.generation import generate_stream

    if (checkpoint is None) == (model is None):
        raise UserError(
            "give the model to use: --checkpoint DIR (a folder from `attnlab train`) or "
            "--model smollm2-135m-instruct (one of the two)"
        )
    if not prompt:
        raise UserError("the prompt is empty; give some text to continue")
    check_dtype(dtype)
    if model is not None:
        _generate_pretrained(
            model,
            prompt,
            chat=chat,
            backend=backend,
            dtype=dtype,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            use_cache=not no_cache,
        )
        return
    if chat:
        raise UserError("--chat needs --model (a chat model); a GPT checkpoint has no template")
    assert checkpoint is not None  # exactly one of the two was given
    try:
        from attnlab.models.gpt import GPTModel

        gpt = GPTModel.from_checkpoint(checkpoint)
    except CheckpointError as e:
        raise UserError(str(e)) from e
    use_backend(gpt, backend)
    from attnlab.quant import quantize_model

    quantize_model(gpt.eval(), dtype)
    tok = get_tokenizer()
    ids = tok.encode(prompt, allowed_special="all")[-gpt.context_length :]
    gen = torch.Generator().manual_seed(seed)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    output.stream(prompt)
    with user_input():
        stream = generate_stream(
            gpt,
            torch.tensor([ids]),
            max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            eos_id=EOT_TOKEN_ID,
            use_cache=not no_cache,
            generator=gen,
        )
        for nxt in stream:
            token = int(nxt[0, 0])
            if token == EOT_TOKEN_ID:
                break
            output.stream(decoder.decode(tok.decode_single_token_bytes(token)))
    output.stream(decoder.decode(b"", final=True) + "\n")
