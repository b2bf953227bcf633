"""The heads panel of the served page in a real headless Chromium: click a head in the
roles grid, the next-token distribution beside the original changes; the logit lens and
rollout views; no console error, no request to any other host."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("starlette", reason="pip install 'attnlab[serve]'")
pytest.importorskip("uvicorn", reason="pip install 'attnlab[serve]'")
sync_api = pytest.importorskip("playwright.sync_api", reason="needs playwright (dev extra)")

from attnlab.serve import ModelRegistry, create_app, model_spec  # noqa: E402
from explain_helpers import launch_browser  # noqa: E402
from serve_helpers import live_server, tiny_gpt, tokenizer  # noqa: E402

pytestmark = pytest.mark.browser
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"


def test_click_a_head_and_the_distribution_changes_then_lens_and_rollout():
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
        page.wait_for_selector("body[data-ablated='1']", timeout=60_000)
        roles = page.locator(".hd-role").evaluate_all("els => els.map(e => e.dataset.role)")
        assert roles == ["previous_token", "first_token", "current_token", "induction"]
        assert page.locator(".hd-role[data-role='induction'] .hd-cell").count() == 2 * 4
        before = page.locator("#hd-before .bar").evaluate_all(
            "els => els.map(e => Number(e.dataset.p))"
        )
        after0 = page.locator("#hd-after .bar").evaluate_all(
            "els => els.map(e => Number(e.dataset.p))"
        )
        assert before == after0  # nothing switched off yet
        page.click(".hd-role[data-role='previous_token'] .hd-cell[data-layer='1'][data-head='2']")
        page.wait_for_selector("body[data-ablated='2']", timeout=60_000)
        # The head is marked off in every role's grid, and the distribution moved.
        assert page.locator(".hd-cell.off").count() == 4
        after = page.locator("#hd-after .bar").evaluate_all(
            "els => els.map(e => Number(e.dataset.p))"
        )
        assert after != before
        assert "1.2" in page.text_content("#hd-after h4")
        assert page.evaluate("window.attnlabServe.ablation.heads") == [[1, 2]]
        title = page.get_attribute(".hd-role[data-role='induction'] .hd-cell", "title")
        assert title is not None and "layer 0, head 0:" in title  # the value on hover
        ARTIFACTS.mkdir(exist_ok=True)
        page.locator("#panel-heads").screenshot(path=str(ARTIFACTS / "serve-heads-roles.png"))
        page.click("#hd-tab-lens")
        page.wait_for_selector("body[data-lens='1']", timeout=60_000)
        assert page.locator("table.lens tr").count() == 1 + 2  # header + one row per layer
        page.click("#hd-tab-rollout")
        page.wait_for_selector("body[data-rollout='1']", timeout=60_000)
        n = len(page.evaluate("window.attnlabServe.trace.attention.tokens"))
        assert page.locator("table.rollout td.hd-roll").count() == n * n
        page.locator("#panel-heads").screenshot(path=str(ARTIFACTS / "serve-heads-rollout.png"))
        assert errors == []
        assert hosts == {url.split("/")[2]}
        browser.close()
