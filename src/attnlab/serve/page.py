"""The page ``attnlab serve`` answers ``GET /`` with, and its Content-Security-Policy."""

from __future__ import annotations

import base64
import hashlib
import json
from html import escape
from importlib import resources

from attnlab.explain.fonts import cjk_font_file
from attnlab.explain.html import STRINGS

__all__ = ["render_page"]


def _asset(package: str, name: str) -> str:
    return resources.files(package).joinpath(name).read_text(encoding="utf-8")


def _sha256(text: str) -> str:
    return base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode("ascii")


def render_page(lang: str = "en") -> tuple[str, str]:
    """The server's page and its Content-Security-Policy."""
    css = _asset("attnlab.explain", "page.css") + _asset("attnlab.serve", "serve.css")
    if lang != "en" and cjk_font_file() is not None:
        # The zh-tw extra's Noto Sans TC, from this server: Chinese shows on machines
        # without a CJK system font.
        css += (
            '\n@font-face { font-family: "attnlab CJK"; src: url("/font/cjk.otf") '
            'format("opentype"); }\n:root { font-family: system-ui, -apple-system, '
            '"Segoe UI", "Noto Sans", "Noto Sans CJK TC", "attnlab CJK", sans-serif; }\n'
        )
    page_js = _asset("attnlab.explain", "page.js")
    serve_js = _asset("attnlab.serve", "serve.js")
    for text in (css, page_js, serve_js):
        if "</" in text:  # pragma: no cover - guards the package files
            raise RuntimeError("page assets must not contain '</'")
    csp = (
        "default-src 'none'; "
        f"script-src 'sha256-{_sha256(page_js)}' 'sha256-{_sha256(serve_js)}'; "
        f"style-src 'sha256-{_sha256(css)}'; "
        "connect-src 'self'; img-src data:; font-src 'self'; base-uri 'none'; "
        "form-action 'none'; "
        "frame-ancestors 'none'"
    )
    strings = json.dumps({"lang": lang, "strings": STRINGS[lang]}, ensure_ascii=True)
    strings = strings.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    page = (
        "<!DOCTYPE html>\n"
        f'<html lang="{lang}">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        '<link rel="icon" href="data:,">\n'
        f"<title>{escape(STRINGS[lang]['title'])}</title>\n"
        f"<style>{css}</style>\n</head>\n<body>\n"
        '<header><h1 id="title"></h1><p class="sub" id="source"></p></header>\n'
        '<section id="serve-controls" aria-label="input"></section>\n'
        '<nav role="tablist" id="tabs"></nav>\n'
        '<section role="tabpanel" id="panel-head" aria-labelledby="tab-head" hidden></section>\n'
        '<section role="tabpanel" id="panel-model" aria-labelledby="tab-model" hidden></section>\n'
        '<section role="tabpanel" id="panel-walk" aria-labelledby="tab-walk" hidden></section>\n'
        '<section id="panel-step" aria-live="polite" hidden></section>\n'
        '<section id="panel-heads" aria-label="heads" hidden></section>\n'
        '<section id="panel-generate" aria-label="generate"></section>\n'
        '<section id="panel-why" aria-label="why this token" hidden></section>\n'
        f'<script type="application/json" id="attnlab-serve">{strings}</script>\n'
        f"<script>{page_js}</script>\n<script>{serve_js}</script>\n</body>\n</html>\n"
    )
    return page, csp
