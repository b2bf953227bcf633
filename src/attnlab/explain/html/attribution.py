"""A self-contained page of a direct logit attribution (:func:`attribution_html`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass


def attribution_html(
    attribution: Any, figure: Any, tokens: Sequence[str], source: str, what: str, k: int = 20
) -> str:
    """A self-contained page of a direct logit attribution: its figure and its parts.

    Args:
        attribution: an :class:`~attnlab.explain.Attribution`.
        figure: its :func:`~attnlab.explain.figures.plot_attribution` Figure (inlined as SVG).
        tokens: the prompt's tokens (for the source split of the strongest heads).
        source: the model's label.
        what: the explained quantity, e.g. ``"logit(' Mary') - logit(' John')"``.
        k: table rows (the largest parts first).

    Returns:
        The page: no script, no request beyond itself.
    """
    import io
    from html import escape

    from attnlab.explain.text import attribution_components

    buf = io.StringIO()
    figure.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
    svg = buf.getvalue()
    svg = svg[svg.find("<svg") :]  # drop the XML prologue and doctype: inline SVG
    total = float(attribution.total)
    parts = attribution_components(attribution)
    rows = "".join(
        f"<tr><td>{escape(name)}</td><td>{value:+.4f}</td>"
        f"<td>{(100 * value / total if total else 0):+.1f}%</td></tr>"
        for name, value in parts[:k]
    )
    sources = ""
    if getattr(attribution, "by_source", None) is not None:
        items = []
        for name in [n for n, _ in parts if "." in n][:5]:
            layer, head = (int(x) for x in name.split("."))
            row = attribution.by_source[layer, head].detach().float()  # (S,)
            order = row.abs().argsort(descending=True)[:5].tolist()
            cells = ", ".join(f"{j} {escape(repr(tokens[j]))} {float(row[j]):+.3f}" for j in order)
            items.append(f"<li><b>{escape(name)}</b>: {cells}</li>")
        sources = "<h2>Where the strongest heads read it</h2><ul>" + "".join(items) + "</ul>"
    title = f"{source}: {what}"
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{escape(title)}</title>\n<style>body {{ font-family: system-ui, sans-serif; "
        "margin: 1.5em; } table { border-collapse: collapse; font-variant-numeric: "
        "tabular-nums; } td, th { padding: 2px 10px; text-align: right; } "
        "td:first-child { text-align: left; } svg { max-width: 100%; height: auto; }"
        "</style>\n</head>\n<body>\n"
        f"<h1>{escape(title)}</h1>\n<p>total {total:+.4f}, error "
        f"{float(attribution.error):+.2e}</p>\n{svg}\n"
        "<h2>The largest parts</h2>\n<table><tr><th>component</th><th>value</th>"
        f"<th>share</th></tr>{rows}</table>\n{sources}\n</body>\n</html>\n"
    )
