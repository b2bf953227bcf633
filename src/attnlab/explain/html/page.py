"""The interactive page of a model trace: its data (:func:`page_data`, the strongest
keys per query within :data:`EDGE_BUDGET`), its strings in each language, and the page itself
(:func:`render_html`, :func:`write_html`, :func:`render_iframe` for Jupyter, which this
module registers as ``ModelTrace``'s HTML view).
"""

from __future__ import annotations

import base64
import hashlib
import html as _html
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from attnlab.explain.model_trace import ModelTrace


# Total (query, key) weights embedded in one page: dense when it fits, else the
# strongest keys per query within this budget (about 5 bytes each in the file).
EDGE_BUDGET = 1_500_000
MIN_KEYS_PER_QUERY = 4
MAX_KEYS_PER_QUERY = 32

STRINGS: dict[str, dict[str, str]] = {
    "en": {
        "title": "attnlab: what attention looked at",
        "head_view": "Head view",
        "model_view": "Model view",
        "walkthrough": "Walkthrough",
        "layer": "Layer",
        "heads": "Heads",
        "head": "Head",
        "top_k": "Strongest keys per query (k)",
        "queries": "Queries",
        "keys": "Keys",
        "token": "Token",
        "head_hint": (
            "Each line joins a query token (left) to a key token (right) it attends to; "
            "thicker and darker means a larger weight. Hover or focus a token to isolate "
            "its row (arrow keys move, Esc clears)."
        ),
        "inspector_hint": "Hover or focus a token to list its weights.",
        "attends_to": "attends to",
        "attended_by": "is attended to by",
        "matrix_caption": "Head {head}: rows are queries, columns are keys.",
        "model_hint": (
            "Each tile is one head's attention weights (rows: queries, columns: keys; "
            "darker is larger). Click a tile to open it in the head view."
        ),
        "steps": "Steps",
        "noscript": "This page needs JavaScript to draw the attention views.",
        "experts": "Experts",
        "expert": "Expert",
        "experts_caption": (
            "{layer}: experts each token was routed to (top {k} of {n}); rows are tokens, "
            "columns experts, the number is the router weight."
        ),
        "experts_shared": "Every token also runs the shared expert (not shown).",
        "routed_to": "routed to",
        "no_experts": "This layer has no experts (a dense feed-forward).",
    },
    "zh-TW": {
        "title": "attnlab：注意力看向了哪裡",
        "head_view": "注意力頭視圖",
        "model_view": "模型視圖",
        "walkthrough": "逐步解說",
        "layer": "層",
        "heads": "注意力頭",
        "head": "頭",
        "top_k": "每個查詢顯示最強的鍵數（k）",
        "queries": "查詢",
        "keys": "鍵",
        "token": "詞元",
        "head_hint": (
            "每條線把一個查詢詞元（左）連到它所注意的鍵詞元（右）；線越粗越深，權重越大。"
            "將游標移到詞元上或以鍵盤聚焦，即可只看它那一列（方向鍵移動，Esc 取消）。"
        ),
        "inspector_hint": "將游標移到詞元上或以鍵盤聚焦，即可列出它的權重。",
        "attends_to": "注意到",
        "attended_by": "被以下查詢注意",
        "matrix_caption": "第 {head} 個頭：列是查詢，行是鍵。",
        "model_hint": (
            "每一格是一個注意力頭的注意力權重（列：查詢，行：鍵；顏色越深越大）。"
            "點一格即可在注意力頭視圖中打開它。"
        ),
        "steps": "步驟",
        "noscript": "此頁面需要 JavaScript 才能繪製注意力視圖。",
        "experts": "專家",
        "expert": "專家",
        "experts_caption": (
            "{layer}：每個詞元被路由到的專家（{n} 個中選 {k} 個）；列是詞元，行是專家，"
            "數字是路由器給的權重。"
        ),
        "experts_shared": "每個詞元也都會經過共享專家（未顯示）。",
        "routed_to": "路由到",
        "no_experts": "這一層沒有專家（密集前饋層）。",
    },
}
LANGS = tuple(STRINGS)


@dataclass(frozen=True)
class WalkthroughStep:
    """One step of the walkthrough as the page shows it.

    Attributes:
        id: a stable identifier (``"scores"``, ``"weights"``...).
        title: the step's heading.
        body: one or two sentences of explanation.
        code: the line of code the step runs, or ``""``.
        tables: the step's numbers; each a dict with ``name``, ``caption``, ``rows``
            and ``cols`` (labels), ``cells`` (rows of already formatted strings, the
            same text the terminal prints) and ``shade`` (True to tint cells in
            [0, 1] by value).
        kind: ``"step"``, or ``"part"`` for a heading that groups the steps after it.
    """

    id: str
    title: str
    body: str = ""
    code: str = ""
    tables: tuple[dict[str, Any], ...] = ()
    kind: str = "step"


@dataclass(frozen=True)
class PageWalkthrough:
    """The walkthrough view's content: an intro line and the steps."""

    steps: tuple[WalkthroughStep, ...]
    intro: str = ""


def _strings(lang: str) -> dict[str, str]:
    if lang not in STRINGS:
        raise ValueError(f"`lang` must be one of {', '.join(LANGS)}, got {lang!r}")
    return STRINGS[lang]


def _b64(array: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(array).tobytes()).decode("ascii")


def _quantize(values: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(values.astype(np.float64) * 65535.0), 0, 65535).astype("<u2")


def keys_per_query(trace: ModelTrace, edge_budget: int = EDGE_BUDGET) -> int:
    """How many keys per query the page embeds for this trace.

    All of them (dense) when the whole trace fits in ``edge_budget``; otherwise the
    strongest ``K`` with ``K`` between 4 and 32 chosen to fit the budget, and never
    more than the trace holds.
    """
    T, S = len(trace.tokens), len(trace.key_tokens)
    heads = len(trace.layers) * len(trace.heads)
    available = S if trace.mode == "dense" else int(trace.top_k or S)
    if trace.mode == "dense" and heads * T * S <= edge_budget:
        return S
    k = edge_budget // max(1, heads * T)
    k = max(MIN_KEYS_PER_QUERY, min(MAX_KEYS_PER_QUERY, k))
    return max(1, min(k, available))


def page_data(
    trace: ModelTrace | None = None,
    walkthrough: PageWalkthrough | None = None,
    *,
    lang: str = "en",
    title: str | None = None,
    layer: int | None = None,
    heads: tuple[int, ...] | list[int] | None = None,
    k: int | None = None,
    view: str | None = None,
    edge_budget: int = EDGE_BUDGET,
) -> dict[str, Any]:
    """The JSON document the page is drawn from.

    Args:
        trace: the captured attention, or None for a walkthrough-only page.
        walkthrough: the walkthrough view's steps, or None.
        lang: ``"en"`` or ``"zh-TW"`` for the page's own text.
        title: the page title (default: a generic one in ``lang``).
        layer: the layer shown first (model numbering; default the first captured).
        heads: the heads shown first (default the first captured head).
        k: keys per query drawn first (default all up to 32 keys, else 4).
        view: the view shown first: ``"head"``, ``"model"`` or ``"walk"``.
        edge_budget: total weights embedded before switching to top keys per query.

    Returns:
        A JSON-serialisable dict.

    Raises:
        ValueError: nothing to show, unknown ``lang``/``view``, or a layer/head not
            in the trace.
    """
    strings = _strings(lang)
    if trace is None and walkthrough is None:
        raise ValueError("`page_data` needs a `trace`, a `walkthrough`, or both; got neither")
    if view is not None and view not in ("head", "model", "walk"):
        raise ValueError(f"`view` must be 'head', 'model' or 'walk', got {view!r}")
    data: dict[str, Any] = {
        "version": 1,
        "lang": lang,
        "strings": strings,
        "title": title or strings["title"],
        "source": trace.source if trace is not None else "",
        "attention": None,
        "walkthrough": None,
        "initial_view": view,
    }
    if trace is not None:
        data["attention"] = _attention_data(trace, strings["layer"], layer, heads, k, edge_budget)
    if walkthrough is not None:
        data["walkthrough"] = {
            "intro": walkthrough.intro,
            "steps": [
                {
                    "id": s.id,
                    "kind": s.kind,
                    "title": s.title,
                    "body": s.body,
                    "code": s.code,
                    "tables": [dict(t) for t in s.tables],
                }
                for s in walkthrough.steps
            ],
        }
    return data


def _attention_data(
    trace: ModelTrace,
    strings_layer: str,
    layer: int | None,
    heads: tuple[int, ...] | list[int] | None,
    k: int | None,
    edge_budget: int,
) -> dict[str, Any]:
    S = len(trace.key_tokens)
    K = keys_per_query(trace, edge_budget)
    dense = K == S and trace.mode == "dense"
    index_bytes = 2 if S <= 65535 else 4
    per_layer: list[list[dict[str, str]]] = []
    for li in trace.layers:
        row: list[dict[str, str]] = []
        for h in trace.heads:
            if dense:
                w = trace.head_weights(li, h).detach().float().cpu().numpy()  # (T, S)
                row.append({"v": _b64(w.astype("<f4"))})
            else:
                idx, val = trace.head_top_keys(li, h, K)  # (T, K) each
                idx_np = idx.detach().cpu().numpy().astype("<u2" if index_bytes == 2 else "<u4")
                val_np = val.detach().float().cpu().numpy()
                row.append({"i": _b64(idx_np), "v": _b64(_quantize(val_np))})
        per_layer.append(row)

    if layer is None:
        layer_pos = 0
    elif layer in trace.layers:
        layer_pos = trace.layers.index(layer)
    else:
        raise ValueError(
            f"`layer` must be one of the traced layers {list(trace.layers)}, got {layer}"
        )
    head_list = [trace.heads[0]] if not heads else list(heads)
    for h in head_list:
        if h not in trace.heads:
            raise ValueError(f"`heads` must be among the traced heads {list(trace.heads)}, got {h}")
    if k is None:
        k = K if len(trace.key_tokens) <= 32 else min(K, 4)
    if k < 1:
        raise ValueError(f"`k` must be at least 1, got {k}")
    return {
        "tokens": list(trace.tokens),
        "key_tokens": list(trace.key_tokens),
        "layers": list(trace.layers),
        "layer_names": list(trace.layer_names)
        if trace.layer_names is not None
        else [f"{strings_layer} {i}" for i in trace.layers],
        "heads": list(trace.heads),
        "num_layers": trace.num_layers,
        "num_heads": trace.num_heads,
        "k": K,
        "dense": dense,
        "index_bytes": index_bytes,
        "data": per_layer,
        "experts": _experts_data(trace),
        "initial": {
            "layer": layer_pos,
            "heads": [trace.heads.index(h) for h in head_list],
            "k": min(k, K),
        },
    }


def _experts_data(trace: ModelTrace) -> dict[str, Any] | None:
    """The routing of the trace's expert layers: per layer the chosen experts ``(T, k)``
    (uint16, or uint32 past 65,536 experts) and their weights (float32, exact), row-major,
    base64."""
    experts = trace.experts
    if experts is None:
        return None
    index_bytes = 2 if experts.num_experts <= 65536 else 4
    chosen = experts.chosen.cpu().numpy().astype("<u2" if index_bytes == 2 else "<u4")
    weights = experts.weights.float().cpu().numpy().astype("<f4")
    return {
        "layers": list(experts.layers),
        "num_experts": experts.num_experts,
        "top_k": experts.top_k,
        "shared": experts.shared,
        "index_bytes": index_bytes,
        "chosen": [_b64(chosen[i]) for i in range(len(experts.layers))],
        "weights": [_b64(weights[i]) for i in range(len(experts.layers))],
    }


def _json_for_script(obj: Any) -> str:
    """JSON that is safe inside ``<script type="application/json">``.

    ``<``, ``>`` and ``&`` are written as ``\\u003c`` etc., so no string in the data
    can end the script element (``</script>``) or open a comment; U+2028/2029 are
    escaped for old parsers. ``JSON.parse`` restores them exactly.
    """
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return (
        text.replace("<", "\\u003c")
        .replace(">", "\\u003e")
        .replace("&", "\\u0026")
        .replace("\u2028", "\\u2028")
        .replace("\u2029", "\\u2029")
    )


def _asset(name: str) -> str:
    return resources.files("attnlab.explain").joinpath(name).read_text(encoding="utf-8")


def _sha256(text: str) -> str:
    return base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode("ascii")


def render_html(
    trace: ModelTrace | None = None,
    walkthrough: PageWalkthrough | None = None,
    **options: Any,
) -> str:
    """The page as one HTML string (see :func:`page_data` for the options)."""
    data = page_data(trace, walkthrough, **options)
    css = _asset("page.css")
    js = _asset("page.js")
    if "</" in js or "</" in css:  # pragma: no cover - guards the package files
        raise RuntimeError("page.js/page.css must not contain '</'")
    csp = (
        "default-src 'none'; "
        f"script-src 'sha256-{_sha256(js)}'; "
        f"style-src 'sha256-{_sha256(css)}'; "
        "img-src data:; base-uri 'none'; form-action 'none'"
    )
    lang_attr = data["lang"]
    title = _html.escape(data["title"])
    return (
        "<!DOCTYPE html>\n"
        f'<html lang="{lang_attr}">\n<head>\n<meta charset="utf-8">\n'
        f'<meta http-equiv="Content-Security-Policy" content="{csp}">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        '<link rel="icon" href="data:,">\n'
        f"<title>{title}</title>\n"
        f"<style>{css}</style>\n</head>\n<body>\n"
        '<header><h1 id="title"></h1><p class="sub" id="source"></p></header>\n'
        f"<noscript><p>{_html.escape(data['strings']['noscript'])}</p></noscript>\n"
        '<nav role="tablist" id="tabs"></nav>\n'
        '<section role="tabpanel" id="panel-head" aria-labelledby="tab-head" hidden></section>\n'
        '<section role="tabpanel" id="panel-model" aria-labelledby="tab-model" hidden></section>\n'
        '<section role="tabpanel" id="panel-walk" aria-labelledby="tab-walk" hidden></section>\n'
        '<script type="application/json" id="attnlab-data">'
        f"{_json_for_script(data)}</script>\n"
        f"<script>{js}</script>\n</body>\n</html>\n"
    )


def write_html(
    path: str | Path,
    trace: ModelTrace | None = None,
    walkthrough: PageWalkthrough | None = None,
    **options: Any,
) -> Path:
    """Write the page to ``path`` (UTF-8) and return the path.

    Args:
        path: the output file; its folder must exist.
        trace: the captured attention, or None.
        walkthrough: the walkthrough steps, or None.
        **options: see :func:`page_data`.

    Raises:
        ValueError: see :func:`page_data`.
    """
    out = Path(path)
    out.write_text(render_html(trace, walkthrough, **options), encoding="utf-8")
    return out


def render_iframe(
    trace: ModelTrace | None = None,
    walkthrough: PageWalkthrough | None = None,
    *,
    height: int = 640,
    **options: Any,
) -> str:
    """The page in an ``<iframe srcdoc>``, for Jupyter's ``_repr_html_``.

    The iframe keeps the page's ids, styles and script apart from the notebook's and
    from other outputs.
    """
    doc = render_html(trace, walkthrough, **options)
    return (
        f'<iframe srcdoc="{_html.escape(doc, quote=True)}" '
        f'style="width:100%;height:{int(height)}px;border:1px solid #ddd" '
        'title="attnlab attention explainer"></iframe>'
    )


def _register() -> None:
    """Make ``ModelTrace._repr_html_`` (Jupyter) draw with :func:`render_iframe`."""
    from attnlab.explain.model_trace import set_html_renderer

    set_html_renderer(render_iframe)


_register()
