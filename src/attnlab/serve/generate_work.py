"""The generation stream's work: tokens one at a time, each with its next-token
distribution and the attention of the query that predicted it (run in a worker thread,
handed to the event loop by ``emit``)."""

from __future__ import annotations

import threading
from typing import Any

import torch

from attnlab.attention import record_attention
from attnlab.backends import WeightsRequest
from attnlab.explain.model_trace import _token_texts, attention_layers
from attnlab.generation import TextStream, generate_stream
from attnlab.serve.fields import ApiError, ServeLimits, user_errors
from attnlab.serve.models import ModelRegistry
from attnlab.serve.work import encode_text, load_model

__all__ = ["generate_work"]


def generate_work(
    registry: ModelRegistry,
    name: str,
    text: str,
    params: dict[str, Any],
    limits: ServeLimits,
    emit: Any,
    cancel: threading.Event,
) -> None:
    loaded = load_model(registry, name)
    if not loaded.causal:
        raise ApiError(422, f"model {name!r} cannot generate (not a causal language model)")
    ids = encode_text(loaded, text, limits)
    blocks = attention_layers(loaded.model)
    layer, head = params["layer"], params["head"]
    if not 0 <= layer < len(blocks) or not 0 <= head < int(blocks[layer].num_heads):
        raise ApiError(
            422,
            f"`layer`/`head` must be in 0..{len(blocks) - 1} / "
            f"0..{int(blocks[0].num_heads) - 1}, got {layer}/{head}",
        )
    block = blocks[layer]
    rows: list[list[float]] = []

    class LastRow:
        def request(self, layer_: Any) -> Any:
            return WeightsRequest(heads=(head,), rows=(-1,)) if layer_ is block else None

        def record(self, call: Any) -> None:
            rows.append(call.weights[0, 0, 0].float().cpu().tolist())

    last: list[torch.Tensor] = []  # this step's next-token logits (V,), for the bars

    def keep_logits(logits: torch.Tensor) -> None:
        last[:] = [logits[0].float().clone()]

    stream = TextStream(loaded.tokenizer, ids[-1:])
    temperature, top_k, top_p = params["temperature"], params["top_k"], params["top_p"]
    gen = torch.Generator().manual_seed(params["seed"])
    reason = "length"
    all_ids = list(ids)
    emit("prompt", {"ids": list(ids)})  # what a generated token's attribution runs on
    with torch.no_grad(), record_attention(LastRow()), user_errors():
        for i, nxt in enumerate(
            generate_stream(
                loaded.model,
                torch.tensor([ids]),
                params["max_new_tokens"],
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                eos_id=loaded.eos_id,
                generator=gen,
                on_logits=keep_logits,
            )
        ):
            token = int(nxt[0, 0])
            logits = last[0] / (temperature if temperature > 0 else 1.0)
            probs = torch.softmax(logits, dim=-1)
            p, idx = torch.topk(probs, min(params["bars"], probs.shape[-1]))
            spelled = _token_texts(loaded.tokenizer, idx.tolist())
            query_pos = len(all_ids) - 1  # the query whose attention predicted this token
            all_ids.append(token)
            eos = loaded.eos_id is not None and token == loaded.eos_id
            emit(
                "token",
                {
                    "index": i,
                    "id": token,
                    "text": "" if eos else stream.push(token),
                    "token": _token_texts(loaded.tokenizer, [token])[0],
                    "p": float(probs[token]),
                    "top": [
                        {"id": int(j), "token": t, "p": float(q)}
                        for j, q, t in zip(idx.tolist(), p.tolist(), spelled, strict=True)
                    ],
                    "attention": {
                        "layer": layer,
                        "head": head,
                        "query": query_pos,
                        "weights": rows[-1] if rows else None,
                    },
                },
            )
            if eos:
                reason = "eos"
                break
            if cancel.is_set():
                reason = "cancelled"
                break
    emit("done", {"reason": reason, "text": stream.flush(), "tokens": len(all_ids) - len(ids)})
