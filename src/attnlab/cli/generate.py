"""`attnlab generate`: continue a prompt with a trained GPT or a pretrained model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from attnlab.cli.app import app
from attnlab.cli.models import (
    KV_CACHE_HELP,
    check_dtype,
    check_kv_cache,
    load_checkpoint_model,
    load_pretrained_model,
)
from attnlab.cli.output import UserError, output, user_input
from attnlab.quant import dtype_help


def _stream(
    model: Any,
    tok: Any,
    ids: list[int],
    echo: str | None,
    *,
    eos_id: int | None,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    seed: int,
    use_cache: bool,
) -> None:
    """Stream the continuation of ``ids`` as text, after ``echo`` (the prompt) when given.

    The tokens come from the library's one loop (``generate_stream``) and become text
    through its one decoder (``TextStream``), which holds back a character's first bytes
    until its last token arrives.
    """
    import torch

    from attnlab.generation import TextStream, generate_stream

    stream = TextStream(tok, ids[-1:] if echo is not None else ())  # the first token's space
    started = False
    with user_input():
        for nxt in generate_stream(
            model,
            torch.tensor([ids]),
            max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            eos_id=eos_id,
            use_cache=use_cache,
            generator=torch.Generator().manual_seed(seed),
        ):
            if not started and echo is not None:
                output.stream(echo)  # after the first step: the arguments are valid
            started = True
            token = int(nxt[0, 0])
            if token == eos_id:
                break
            output.stream(stream.push(token))
    output.stream(("" if started or echo is None else echo) + stream.flush() + "\n")


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
        typer.Option(help=dtype_help()),
    ] = "float32",
    kv_cache: Annotated[str, typer.Option("--kv-cache", help=KV_CACHE_HELP)] = "auto",
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
    if (checkpoint is None) == (model is None):
        raise UserError(
            "give the model to use: --checkpoint DIR (a folder from `attnlab train`) or "
            "--model smollm2-135m-instruct (one of the two)"
        )
    if not prompt:
        raise UserError("the prompt is empty; give some text to continue")
    check_dtype(dtype)
    check_kv_cache(kv_cache)
    echo: str | None = prompt
    if model is not None:
        lm, tok, _ = load_pretrained_model(
            model, kind="causal-lm", backend=backend, dtype=dtype, kv_cache=kv_cache
        )
        text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
        ids = tok.encode(text)
        eos_id = tok.eos_id
        # An encoder-decoder answers in a new sequence: the prompt is its input, not echoed.
        if chat or getattr(lm, "is_encoder_decoder", False):
            echo = None
    else:
        if chat:
            raise UserError("--chat needs --model (a chat model); a GPT checkpoint has no template")
        assert checkpoint is not None  # exactly one of the two was given
        from attnlab.pretrained.loaders import prepare_native, set_kv_cache_dtype
        from attnlab.quant import quantize_model

        lm, tok, _ = load_checkpoint_model(checkpoint, backend)
        quantize_model(lm, dtype)
        set_kv_cache_dtype(lm, kv_cache, dtype)
        prepare_native(lm)
        ids = tok.encode(prompt, allowed_special="all")
        eos_id = getattr(tok, "eot_token", None)  # GPT-2's <|endoftext|>; words have none
    if lm.context_length is not None:  # an encoder-decoder has none (relative positions)
        ids = ids[-lm.context_length :]
    _stream(
        lm,
        tok,
        ids,
        echo,
        eos_id=eos_id,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        use_cache=not no_cache,
    )
