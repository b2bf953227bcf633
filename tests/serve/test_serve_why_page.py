"""The Why this token panel of the served page in a real headless Chromium: click a
generated token, and the panel shows the numbers /api/attribute returns for it; a token of
the text and the patching form; no console error, no request to any other host."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("starlette", reason="pip install 'attnlab[serve]'")
pytest.importorskip("uvicorn", reason="pip install 'attnlab[serve]'")
sync_api = pytest.importorskip("playwright.sync_api", reason="needs playwright (dev extra)")

from attnlab.serve import ModelRegistry, create_app, model_spec  # noqa: E402
from explain_helpers import launch_browser  # noqa: E402
from serve_helpers import click_settled, live_server, tiny_gpt, tokenizer  # noqa: E402

pytestmark = pytest.mark.browser
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"


def test_click_a_generated_token_and_the_panel_shows_the_attribution():
    import httpx

    app = create_app(ModelRegistry([model_spec(tiny_gpt(7), tokenizer(), "tiny")]))
    with live_server(app) as url, sync_api.sync_playwright() as pw:
        browser = launch_browser(pw)
        page = browser.new_page(viewport={"width": 1280, "height": 1000})
        errors: list[str] = []
        hosts: set[str] = set()
        page.on("console", lambda m: errors.append(m.text)
                if m.type in ("error", "warning") else None)  # fmt: skip
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("request", lambda r: hosts.add(r.url.split("/")[2]))
        page.goto(url)
        page.wait_for_selector("body[data-traced='1']", timeout=60_000)
        # Every click waits for the page to settle: what an answer sets off (the heads panel
        # after a trace, a new trace after a generation) draws above the panels clicked in
        # here and moves them, and a click they move between mousedown and mouseup is lost.
        page.fill("#gen-n", "3")
        click_settled(page, "#gen-stream")
        page.wait_for_selector("body[data-generated='3']", timeout=60_000)
        assert page.locator("#gen-out .gen-tok").count() == 3
        click_settled(page, "#gen-out .gen-tok[data-index='1']")
        page.wait_for_selector("body[data-why='1']", timeout=60_000)
        generated = page.evaluate("window.attnlabServe.generated")
        body = page.evaluate("window.attnlabServe.whyBody")
        # The request is the prompt and the first generated token, explaining the second,
        # against the runner-up of that step.
        prompt = tokenizer().encode("Every effort moves you")
        assert body["ids"] == [*prompt, generated[0]["id"]]
        assert body["target"] == generated[1]["id"] and body["position"] == -1
        runner = next(t for t in generated[1]["top"] if t["id"] != generated[1]["id"])
        assert body["contrast"] == runner["id"]
        expected = httpx.post(url + "/api/attribute", json=body, timeout=60).json()
        cells = page.locator("#why-heads .why-cell").evaluate_all(
            "els => els.map(e => [+e.dataset.layer, +e.dataset.head, Number(e.dataset.v),"
            " e.textContent])"
        )
        assert len(cells) == 2 * 4
        for layer, head, value, text in cells:
            assert value == expected["heads"][layer][head]
            assert text == f"{value:.2f}"
        bars = page.locator("#why-mlp .why-bar").evaluate_all(
            "els => els.map(e => Number(e.dataset.v))"
        )
        assert bars == [expected["embedding"], *expected["mlp"], expected["bias"]]
        assert float(page.get_attribute("#why-total", "data-total")) == expected["total"]
        assert page.input_value("#why-contrast-pick") == str(runner["id"])
        # A click on a head: its value-weighted attention over the source tokens.
        click_settled(page, "#why-heads .why-cell[data-layer='1'][data-head='2']")
        src = page.locator("#why-src .bar").evaluate_all("els => els.map(e => Number(e.dataset.v))")
        assert src == expected["by_source"][1][2][: len(body["ids"])]
        ARTIFACTS.mkdir(exist_ok=True)
        page.locator("#panel-why").screenshot(path=str(ARTIFACTS / "serve-why.png"))
        # A token of the text: what the position before it predicted, against the runner-up.
        click_settled(page, "#why-strip .why-tok[data-index='2']")
        page.wait_for_selector("body[data-why='2']", timeout=60_000)
        why = page.evaluate("window.attnlabServe.why")
        assert why["position"] == 1 and why["target"]["id"] == why["ids"][2]
        runner = next(t for t in why["top"] if t["id"] != why["ids"][2])
        assert why["contrast"]["id"] == runner["id"]
        # The patching form.
        page.fill("#why-clean", "When Mary and John went to the store, John gave a drink to")
        page.fill("#why-corrupted", "When Mary and John went to the store, Mary gave a drink to")
        page.fill("#why-target", " Mary")
        page.fill("#why-contrast", " John")
        click_settled(page, "#why-patch")
        page.wait_for_selector("body[data-patched='1']", timeout=60_000)
        grid = page.evaluate("window.attnlabServe.patch.grid")
        shown = page.locator("#why-patch-grid td.why-pcell").evaluate_all(
            "els => els.map(e => Number(e.dataset.v))"
        )
        assert shown == [v for row in grid for v in row] and len(shown) == 2 * 4
        page.locator("#panel-why").screenshot(path=str(ARTIFACTS / "serve-why-patch.png"))
        assert errors == []
        assert hosts == {url.split("/")[2]}
        browser.close()
