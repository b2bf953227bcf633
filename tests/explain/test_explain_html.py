"""The page builder without a browser: the embedded data, its escaping, the budget."""

from __future__ import annotations

import base64
import json
import re

import numpy as np
import pytest
import torch

from attnlab.explain.html import (
    EDGE_BUDGET,
    PageWalkthrough,
    WalkthroughStep,
    keys_per_query,
    page_data,
    render_html,
    render_iframe,
)
from attnlab.explain.model_trace import ModelTrace
from explain_helpers import synthetic_trace


def _embedded(doc: str) -> dict:
    m = re.search(r'<script type="application/json" id="attnlab-data">(.*?)</script>', doc, re.S)
    assert m is not None
    return json.loads(m.group(1))


def _decode(raw: str, dtype: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(raw), dtype=dtype)


def test_dense_weights_are_embedded_exactly():
    trace = synthetic_trace(5, layers=2, heads=2, seed=1)
    data = _embedded(render_html(trace))["attention"]
    assert data["dense"] and data["k"] == 5
    for li in range(2):
        for h in range(2):
            got = _decode(data["data"][li][h]["v"], "<f4").reshape(5, 5)
            np.testing.assert_array_equal(got, trace.head_weights(li, h).numpy())


def test_long_input_embeds_top_keys_within_budget():
    trace = synthetic_trace(300, layers=2, heads=2, seed=2)
    budget = 40_000
    k = keys_per_query(trace, budget)
    assert k == max(4, min(32, budget // (4 * 300)))  # 33 -> capped at 32
    data = page_data(trace, edge_budget=budget)["attention"]
    assert not data["dense"] and data["k"] == k and data["index_bytes"] == 2
    idx = _decode(data["data"][1][0]["i"], "<u2").reshape(300, k)
    val = _decode(data["data"][1][0]["v"], "<u2").reshape(300, k) / 65535
    want_val, want_idx = torch.topk(trace.head_weights(1, 0), k, dim=-1)
    np.testing.assert_allclose(val, want_val.numpy(), atol=1 / 65535)
    # Indices agree wherever the weight is not tied with its neighbour.
    assert (idx == want_idx.numpy()).mean() > 0.99
    # A small trace is embedded whole (dense) under the default budget.
    assert keys_per_query(synthetic_trace(64, 1, 1), EDGE_BUDGET) == 64


def test_default_page_at_2048_tokens_stays_within_the_default_budget():
    """GPT-2's shape (12 layers x 12 heads) at 2,048 tokens: what the page embeds (keys per
    query x heads x queries) fits EDGE_BUDGET, and is what page_data writes."""
    T, L, H, K = 2048, 12, 12, 8
    g = torch.Generator().manual_seed(4)
    values = torch.rand(L, H, T, K, generator=g).sort(dim=-1, descending=True).values
    indices = torch.randint(0, T, (L, H, T, K), generator=g)
    toks = tuple(f"t{i}" for i in range(T))
    trace = ModelTrace(tokens=toks, key_tokens=toks, layers=tuple(range(L)),
                       heads=tuple(range(H)), num_layers=L, num_heads=H,
                       top_indices=indices, top_values=values)  # fmt: skip
    k = keys_per_query(trace)
    assert 1 <= k <= K
    assert k * L * H * T <= EDGE_BUDGET, k
    data = page_data(trace)["attention"]
    assert not data["dense"] and data["k"] == k
    embedded = sum(
        _decode(head["i"], "<u2").size for layer in data["data"] for head in layer
    )  # fmt: skip
    assert embedded == k * L * H * T <= EDGE_BUDGET


def test_topk_trace_never_embeds_more_than_it_has():
    trace = synthetic_trace(50, layers=1, heads=1, top_k=6)
    assert keys_per_query(trace) == 6
    data = page_data(trace)["attention"]
    assert data["k"] == 6 and not data["dense"]
    assert data["initial"]["k"] == 4  # 50 keys: draw the strongest 4 first


def test_script_breaking_text_is_escaped():
    evil = ["</script><script>alert(1)</script>", "<!--", "a&b", "\u2028"]
    trace = synthetic_trace(4, layers=1, heads=1, tokens=evil)
    doc = render_html(trace, title="</title><script>x</script>")
    body = doc.split('id="attnlab-data">', 1)[1].split("</script>", 1)[0]
    assert "<" not in body and ">" not in body and "&" not in body and "\u2028" not in body
    assert _embedded(doc)["attention"]["tokens"] == evil
    assert "<title>&lt;/title&gt;&lt;script&gt;x&lt;/script&gt;</title>" in doc
    assert doc.count("<script") == 2  # the data block and the page's own script


def test_page_is_self_contained_with_a_strict_policy():
    doc = render_html(synthetic_trace(3, 1, 1))
    assert "http://" not in doc and "https://" not in doc and "//cdn" not in doc
    csp = re.search(r'Content-Security-Policy" content="([^"]+)"', doc).group(1)
    assert "default-src 'none'" in csp and "'unsafe-inline'" not in csp
    assert re.search(r"script-src 'sha256-[A-Za-z0-9+/=]+'", csp)


def test_walkthrough_and_language():
    walk = PageWalkthrough(
        steps=(WalkthroughStep(id="s", title="T", tables=({"cells": [["1.0000"]]},)),)
    )
    data = page_data(None, walk, lang="zh-TW")
    assert data["attention"] is None and data["lang"] == "zh-TW"
    assert data["walkthrough"]["steps"][0]["tables"][0]["cells"] == [["1.0000"]]
    assert data["strings"]["walkthrough"] == "逐步解說"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lang": "fr"}, "`lang` must be one of en, zh-TW"),
        ({"layer": 5}, "`layer` must be one of the traced layers"),
        ({"heads": [7]}, "`heads` must be among the traced heads"),
        ({"view": "nope"}, "`view` must be"),
        ({"k": 0}, "`k` must be at least 1"),
    ],
)
def test_bad_options_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        page_data(synthetic_trace(3, 1, 1), **kwargs)


def test_nothing_to_show_is_an_error():
    with pytest.raises(ValueError, match="needs a `trace`, a `walkthrough`"):
        page_data(None, None)


def test_iframe_escapes_the_document():
    html = render_iframe(synthetic_trace(3, 1, 1, tokens=['"', "<", "&"]))
    assert html.startswith('<iframe srcdoc="')
    srcdoc = html.split('srcdoc="', 1)[1].split('" style=', 1)[0]
    assert '"' not in srcdoc and "<" not in srcdoc


def test_repr_html_is_the_iframe():
    trace = synthetic_trace(3, 1, 1)
    assert trace._repr_html_().startswith("<iframe srcdoc=")


def test_model_trace_validates_shapes():
    good = synthetic_trace(4, 2, 2)
    with pytest.raises(ValueError, match=r"`weights` must have shape \(L, H, T, S\)"):
        ModelTrace(
            tokens=good.tokens,
            key_tokens=good.key_tokens,
            layers=(0,),
            heads=(0, 1),
            num_layers=2,
            num_heads=2,
            weights=good.weights,
        )
    with pytest.raises(ValueError, match="exactly one of the two"):
        ModelTrace(
            tokens=good.tokens,
            key_tokens=good.key_tokens,
            layers=(0, 1),
            heads=(0, 1),
            num_layers=2,
            num_heads=2,
        )
    with pytest.raises(ValueError, match="`heads` must be distinct ascending"):
        ModelTrace(
            tokens=good.tokens,
            key_tokens=good.key_tokens,
            layers=(0, 1),
            heads=(1, 0),
            num_layers=2,
            num_heads=2,
            weights=good.weights,
        )
    with pytest.raises(ValueError, match="`layer` must be one of the captured layers"):
        good.head_weights(2, 0)


def test_topk_trace_scatters_back_to_dense():
    dense = synthetic_trace(8, 1, 2, seed=4)
    sparse = synthetic_trace(8, 1, 2, seed=4, top_k=8)
    torch.testing.assert_close(sparse.head_weights(0, 1), dense.head_weights(0, 1))
    idx, val = sparse.head_top_keys(0, 1, 3)
    assert idx.shape == (8, 3)
    assert bool((val[:, :-1] >= val[:, 1:]).all())


@pytest.mark.parametrize("lang", ["en", "zh-TW"])
def test_walkthrough_view_has_the_terminal_tables(lang):
    from attnlab.explain.html import walkthrough_from_renderables
    from attnlab.explain.text import format_number, walkthrough_renderables
    from attnlab.explain.trace import trace_example

    trace = trace_example("journey")
    walk = walkthrough_from_renderables(walkthrough_renderables(trace, lang))
    parts = [s for s in walk.steps if s.kind == "part"]
    steps = [s for s in walk.steps if s.kind == "step"]
    assert len(parts) == 3 and len(steps) >= 12
    tables = {t["name"]: t for s in steps for t in s.tables}
    scores = tables["attn_scores"]
    assert scores["rows"] == list(trace.tokens) and scores["cols"] == list(trace.tokens)
    assert scores["cells"] == [
        [format_number(v) for v in row] for row in trace.simplified.scores.tolist()
    ]
    weights = next(t for s in steps for t in s.tables if t["name"] == "attn_weights")
    assert weights["shade"] and weights["cells"][0][:6] == [
        format_number(v) for v in trace.simplified.weights[0].tolist()
    ]
    assert weights["cells"][0][6] == "1.0000"  # the row-sum column
    assert any("attn_score_22 = " in s.code for s in steps)
    assert walk.intro
