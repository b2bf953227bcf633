"""One self-contained, offline HTML page that shows a trace interactively.

The page has three views:

- **head view**: the tokens in two columns (queries left, keys right) and a line
  from every query to each of its ``k`` strongest keys, thickness and opacity by
  weight, one colour per head; hover or focus a token to isolate its row;
- **model view**: one small heatmap per layer and head; click one to open it in the
  head view;
- **walkthrough**: the seed example's steps with their numbers (when given).

For a mixture-of-experts model (a trace with ``experts``) the head view's panel also holds
the layer's token x expert grid (the router weight of each expert a token went to), and
the model view a small routing heatmap beside each routed layer's heads.

Everything is in the one file: the CSS and JS (``page.css``, ``page.js`` in
``attnlab/explain/``) are inlined, and the data is embedded as JSON in a non-executed
``<script type="application/json">`` block, escaped so that no token text can
close it. A Content-Security-Policy forbids every network request and every
script but the page's own (by hash). Token text is only ever set with
``textContent`` in the page, so it shows as text and never runs.

Short inputs embed every weight exactly (float32). Long ones embed each query's
strongest keys, with the weights in 16-bit fixed point (``round(w * 65535)``, error
below 1e-5), within an edge budget so that a 2,048-token page stays a few megabytes.

The package's modules: ``page`` (the head and model views, the page and its data),
``walkthrough`` (the walkthrough view's data) and ``attribution`` (the attribution page).
"""

from __future__ import annotations

from attnlab.explain.html.attribution import (
    attribution_html,
)
from attnlab.explain.html.page import (  # noqa: F401  (old import paths)
    EDGE_BUDGET,
    LANGS,
    MAX_KEYS_PER_QUERY,
    MIN_KEYS_PER_QUERY,
    STRINGS,
    PageWalkthrough,
    WalkthroughStep,
    _asset,
    _sha256,
    keys_per_query,
    page_data,
    render_html,
    render_iframe,
    write_html,
)
from attnlab.explain.html.walkthrough import (
    walkthrough_from_renderables,
)

__all__ = [
    "PageWalkthrough",
    "WalkthroughStep",
    "attribution_html",
    "page_data",
    "render_html",
    "render_iframe",
    "walkthrough_from_renderables",
    "write_html",
]
