"""The served page in a real headless Chromium (Debian's, through Playwright), on a real
server: type text, see the views update, step into a head, generate; no console error, no
request to any other host."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("starlette", reason="pip install 'attnlab[serve]'")
pytest.importorskip("uvicorn", reason="pip install 'attnlab[serve]'")
sync_api = pytest.importorskip("playwright.sync_api", reason="needs playwright (dev extra)")

from attnlab.serve import ModelRegistry, create_app, example_spec, model_spec  # noqa: E402
from explain_helpers import launch_browser  # noqa: E402
from serve_helpers import click_settled, live_server, tiny_gpt, tokenizer  # noqa: E402

pytestmark = pytest.mark.browser
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"


@pytest.fixture(scope="module")
def server():
    app = create_app(ModelRegistry([model_spec(tiny_gpt(), tokenizer(), "tiny"),
                                    example_spec("journey")]))  # fmt: skip
    with live_server(app) as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = launch_browser(p)
        yield b
        b.close()


class Opened:
    def __init__(self, browser, url: str) -> None:
        self.page = browser.new_page(viewport={"width": 1280, "height": 900})
        self.errors: list[str] = []
        self.hosts: set[str] = set()
        self.dialogs: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text)
                     if m.type in ("error", "warning") else None)  # fmt: skip
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("request", lambda r: self.hosts.add(r.url.split("/")[2]))
        self.page.on("dialog", lambda d: (self.dialogs.append(d.message), d.dismiss()))
        self.page.goto(url)
        self.page.wait_for_selector("body[data-traced='1']", timeout=30_000)

    def traced(self) -> int:
        return int(self.page.get_attribute("body", "data-traced") or 0)


def head_row(attention: dict, layer: int, head: int, token: int) -> np.ndarray:
    S = len(attention["key_tokens"])
    raw = attention["data"][attention["layers"].index(layer)][attention["heads"].index(head)]
    return np.frombuffer(base64.b64decode(raw["v"]), "<f4").reshape(-1, S)[token]


def test_type_step_into_a_head_and_generate(browser, server):
    import httpx

    o = Opened(browser, server)
    p = o.page
    text = "The cat sat on the mat <img src=x onerror=alert(1)>"
    p.fill("#text", text)
    click_settled(p, "#explain")
    p.wait_for_function("(t) => window.attnlabServe.trace.attention.tokens.join('') === t",
                        arg=text, timeout=30_000)  # fmt: skip
    tokens = p.locator(".hv-col.queries .tok").all_text_contents()
    assert "".join(tokens).replace("\u21b5", "\n") == text  # tokens shown as text
    # The heatmap is labelled on both axes, thinned to at most 16 labels.
    assert 1 <= int(p.get_attribute(".mx-cols", "data-labels")) <= 16
    assert p.locator(".mx-rows .mx-lab").first.text_content() == "The"
    p.hover("#matrix", position={"x": 5, "y": 5})
    assert p.text_content("#matrix-hover").startswith("#0 The \u2192 #0 The: 1.0000")
    # Step into layer 1, head 2, query token 4.
    p.select_option("#layer", "1")
    click_settled(p, "#heads input[data-head='2']")  # add head 2 ...
    click_settled(p, "#heads input[data-head='0']")  # ... and drop head 0: head 2 first
    click_settled(p, ".hv-col.queries .tok[data-i='4']")
    p.wait_for_selector("body[data-stepped='1']", timeout=30_000)
    ARTIFACTS.mkdir(exist_ok=True)
    p.locator("#panel-step").screenshot(path=str(ARTIFACTS / "serve-step.png"))
    click_settled(p, "#panel-step .st-sec[data-step='weights'] button.more")  # 19 keys: expand
    cells = p.locator("table[data-name='attn_weights_4'] td").all_text_contents()
    shown = [float(c) for c in cells]
    trace = httpx.post(f"{server}/api/trace", json={"model": "tiny", "text": text}).json()
    want = head_row(trace["attention"], 1, 2, 4)
    np.testing.assert_allclose(shown, want[: len(shown)], atol=6e-5)
    assert len(shown) == len(want)
    steps = p.locator("#panel-step .st-sec").evaluate_all("e => e.map(x => x.dataset.step)")
    assert steps == ["input", "query", "keys", "scores", "scale", "mask", "weights", "values",
                     "context", "out"]  # fmt: skip
    # A long vector is truncated, and expands.
    x_cells = "#panel-step .st-sec[data-step='input'] td"
    assert p.locator(x_cells).count() == 13  # 12 numbers and "…"
    click_settled(p, "#panel-step .st-sec[data-step='input'] button.more")
    assert p.locator(x_cells).count() == 32
    # Generate 3 tokens, streaming: bars, text, and the text box grows and is traced again.
    before = o.traced()
    p.fill("#gen-n", "3")
    click_settled(p, "#gen-stream")
    p.wait_for_selector("body[data-generated='3']", timeout=30_000)
    assert p.locator("#gen-bars .bar").count() == 10
    assert p.locator("#gen-bars .bar.chosen").count() == 1
    p.wait_for_function("(n) => Number(document.body.dataset.traced) > n", arg=before,
                        timeout=30_000)  # fmt: skip
    assert len(p.input_value("#text")) > len(text)
    assert o.errors == [] and o.dialogs == []
    assert o.hosts == {server.split("/")[2]}  # no request to any other host
    p.close()


def test_the_example_and_a_bad_request(browser, server):
    o = Opened(browser, server)
    p = o.page
    p.select_option("#model", "example:journey")
    p.wait_for_function("() => window.attnlabServe.trace.model === 'example:journey'")
    assert p.is_disabled("#text") and p.is_hidden("#panel-generate")
    assert p.locator("#tab-walk").is_visible()
    click_settled(p, ".hv-col.queries .tok[data-i='1']")
    p.wait_for_selector("body[data-stepped='1']", timeout=30_000)
    assert "0.2264" in p.text_content("#panel-step")  # the book's attn_weights_2
    p.select_option("#model", "tiny")
    p.fill("#text", "x" * 5000)  # over the model's context: the API's 413, shown
    click_settled(p, "#explain")
    p.wait_for_selector("#status.err", timeout=30_000)
    assert "the limit is 64" in p.text_content("#status")
    p.close()
