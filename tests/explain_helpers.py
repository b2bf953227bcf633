"""Shared helpers for the explainer's tests: synthetic traces and the headless browser."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from attnlab.explain.model_trace import ModelTrace

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def synthetic_trace(
    T: int,
    layers: int = 2,
    heads: int = 3,
    *,
    seed: int = 0,
    tokens: list[str] | None = None,
    causal: bool = True,
    top_k: int | None = None,
) -> ModelTrace:
    """A trace of random, properly normalised (optionally causal) attention weights."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(layers, heads, T, T, generator=g) * 2.0  # (L, H, T, S)
    if causal:
        allowed = torch.ones(T, T, dtype=torch.bool).tril()
        scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    toks = tuple(tokens) if tokens is not None else tuple(f"t{i}" for i in range(T))
    common = {
        "tokens": toks,
        "key_tokens": toks,
        "layers": tuple(range(layers)),
        "heads": tuple(range(heads)),
        "num_layers": layers,
        "num_heads": heads,
        "source": "synthetic test trace",
    }
    if top_k is None:
        return ModelTrace(weights=weights, **common)
    values, indices = torch.topk(weights, top_k, dim=-1)  # (L, H, T, K)
    return ModelTrace(top_indices=indices, top_values=values, **common)


def launch_browser(playwright_module):  # pragma: no cover - used by browser tests only
    """Launch Debian's chromium through Playwright, or skip with the reason."""
    if not Path(CHROMIUM).exists() and shutil.which("chromium") is None:
        pytest.skip(f"browser test needs Debian's chromium at {CHROMIUM}")
    return playwright_module.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
