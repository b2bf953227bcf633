"""A real attnlab server (uvicorn on 127.0.0.1, a free port) inside the test process, and
clicks on its page that wait for the page to settle first."""

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


def settle(page: Any, timeout_ms: int = 60_000) -> None:
    """Wait until the served page has no request of its own in flight.

    An answer the page draws can set off more work that draws later, above the panels a
    test clicks in next: a trace draws the heads panel (its roles, then the ablation), a
    finished generation traces the longer text again and redraws the head view. A
    ``body[data-...]`` marker says that one answer is drawn, not that this follow-up work
    is. The page counts its requests in flight (``window.attnlabServe.busy``) and starts
    a follow-up request in the promise callbacks of the answer that sets it off, before
    that task ends, so the count reads zero only once everything set off is drawn.
    """
    page.wait_for_function("() => window.attnlabServe.busy === 0", timeout=timeout_ms)


def click_settled(page: Any, selector: str, timeout_ms: int = 60_000) -> None:
    """Click ``selector`` once the served page has settled (:func:`settle`).

    A click is two input events, mousedown and mouseup, and Playwright checks that the
    element is under the pointer at the first one only. When an answer drawn between the
    two moves the element (the heads panel growing above the generate panel moves it by
    hundreds of pixels), the mouseup lands on whatever is there now and the browser sends
    the click to an ancestor of both: the element's handler never runs, and the test waits
    for a marker that never comes.
    """
    settle(page, timeout_ms)
    page.click(selector, timeout=timeout_ms)
