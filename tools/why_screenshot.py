"""The Why this token panel of `attnlab serve` on SmolLM2-135M, as docs/img/serve-why.png.

Serves the packaged SmolLM2-135M-Instruct file on 127.0.0.1 (a free port), drives the
page in Debian's headless Chromium: types the indirect-object prompt, generates one token,
clicks it, picks " John" as the contrast, opens head 23.3's sources, and screenshots the
panel.

    PYTHONPATH=src python tools/why_screenshot.py [--out docs/img/serve-why.png]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

PROMPT = "When Mary and John went to the store, John gave a drink to"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "serve-why.png")
    args = p.parse_args()
    from playwright.sync_api import sync_playwright

    from attnlab.serve import ModelRegistry, create_app, pretrained_spec
    from serve_helpers import live_server

    app = create_app(ModelRegistry([pretrained_spec("smollm2-135m-instruct")]))
    with live_server(app) as url, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(url)
        page.wait_for_selector("body[data-traced='1']", timeout=300_000)
        page.fill("#text", PROMPT)
        page.click("#explain")
        page.wait_for_selector("body[data-traced='2']", timeout=300_000)
        page.fill("#gen-n", "1")
        page.click("#gen-stream")
        page.wait_for_selector("body[data-generated='1']", timeout=300_000)
        page.wait_for_selector("body[data-traced='3']", timeout=300_000)  # text + " Mary"
        page.click("#gen-out .gen-tok[data-index='0']")
        page.wait_for_selector("body[data-why='1']", timeout=300_000)
        john = str(page.evaluate("window.attnlabServe.why.ids[3]"))  # " John"
        page.select_option("#why-contrast-pick", john)
        page.wait_for_selector("body[data-why='2']", timeout=300_000)
        page.click("#why-heads .why-cell[data-layer='23'][data-head='3']")
        page.locator("#panel-why").screenshot(path=str(args.out))
        if errors:
            sys.exit(f"page errors: {errors}")
        browser.close()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
