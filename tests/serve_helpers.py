"""A real attnlab server (uvicorn on 127.0.0.1, a free port) inside the test process."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from attnlab.data import get_tokenizer
from attnlab.models.gpt import GPTConfig, GPTModel


def tiny_gpt(seed: int = 0, **overrides: Any) -> GPTModel:
    """A 2-layer, 4-head, 32-wide GPT with the GPT-2 tokenizer's vocabulary (random weights)."""
    torch.manual_seed(seed)
    cfg = dict(vocab_size=50257, context_length=64, emb_dim=32, n_heads=4, n_layers=2)
    cfg.update(overrides)
    return GPTModel(GPTConfig.preset("tiny", **cfg)).eval()


@contextmanager
def live_server(app: Any) -> Iterator[str]:
    """Serve ``app`` with uvicorn on 127.0.0.1 (a free port) in a thread; yield its URL."""
    import uvicorn

    from attnlab.serve.server import bind

    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def tokenizer() -> Any:
    return get_tokenizer()
