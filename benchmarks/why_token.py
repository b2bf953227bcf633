"""Why this token: direct attribution, activation patching and attribution patching on one
prompt pair, side by side, and how well the one-backward estimate matches the real grid.

Two configurations:

- ``--config smollm2-ioi`` (default): SmolLM2-135M-Instruct (the packaged Q4_1 GGUF file,
  float32) on the indirect-object sentence "When Mary and John went to the store, John
  gave a drink to" (answer " Mary", contrast " John"), corrupted by swapping the second
  name ("... Mary gave a drink to"). Records the metric on both prompts, the heads that
  carry the answer by each method, and the Pearson correlation over all 270 heads between
  activation patching (:func:`attnlab.explain.patch`) and attribution patching
  (:func:`attnlab.explain.attribution_patching`).
- ``--config book-gpt``: the book's chapter-4 GPT (``gpt2-124m`` preset, seed 123,
  untrained, where the walkthrough leaves it) on "Every effort moves you": what its top
  next token owes to each part, against the runner-up.

Writes one JSON record (benchmarks/results/) and, with ``--png-dir``, the guide's figures.

    PYTHONPATH=src python benchmarks/why_token.py --png-dir docs/img
    PYTHONPATH=src python benchmarks/why_token.py --config book-gpt --png-dir docs/img
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from _records import Recorder

from attnlab.explain import attribute, attribution_patching, patching

CLEAN = "When Mary and John went to the store, John gave a drink to"
CORRUPTED = "When Mary and John went to the store, Mary gave a drink to"
BOOK_PROMPT = "Every effort moves you"


def _top(grid: torch.Tensor, k: int) -> list[tuple[str, float]]:
    """The ``k`` cells of an ``(L, H)`` grid with the largest ``|value|``, as ``"L.H"``."""
    flat = grid.flatten()
    H = grid.shape[1]
    order = flat.abs().argsort(descending=True)[:k].tolist()
    return [(f"{i // H}.{i % H}", float(flat[i])) for i in order]


def _pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.corrcoef(torch.stack([a.flatten().double(), b.flatten().double()]))[0, 1])


def smollm2_ioi(rec: Recorder, png_dir: Path | None) -> dict:
    from attnlab.pretrained import load_pretrained

    model, tok = load_pretrained("smollm2-135m-instruct")
    clean, corrupted = tok.encode(CLEAN), tok.encode(CORRUPTED)
    mary, john = tok.encode(" Mary")[0], tok.encode(" John")[0]
    dla = attribute(model, clean, mary, john, by_source=True)
    heads = patching(model, clean, corrupted, mary, john, over="heads")
    residual = patching(model, clean, corrupted, mary, john, over="residual")
    estimate = attribution_patching(model, clean, corrupted, mary, john)
    r_ap = _pearson(heads.grid, estimate)
    r_dla = _pearson(heads.grid, dla.heads)
    rec.add("logit(' Mary') - logit(' John'), clean prompt", heads.clean, "logits")
    rec.add("logit(' Mary') - logit(' John'), corrupted prompt", heads.corrupted, "logits")
    rec.add("direct attribution: |error| of the parts", abs(dla.error), "logits", better="lower")
    top_dla = _top(dla.heads, 8)
    top_patch = _top(heads.grid, 8)
    top_ap = _top(estimate, 5)
    for name, value in top_dla:
        rec.add(f"direct attribution of head {name}", value, "logits")
    rec.add("direct attribution of all heads", float(dla.heads.sum()), "logits")
    rec.add("direct attribution of all MLPs", float(dla.mlp.sum()), "logits")
    for name, value in top_patch:
        rec.add(f"activation patching of head {name}", value, "share restored")
    for name, value in top_ap:
        rec.add(f"attribution patching of head {name}", value, "share restored")
    H = dla.heads.shape[1]
    for name, value in top_patch:
        layer, head = (int(x) for x in name.split("."))
        rec.add(
            f"head {name}: attribution patching", float(estimate[layer, head]), "share restored",
            note=f"activation patching {value:.4f}",
        )  # fmt: skip
    rec.add(
        "Pearson r, attribution patching vs activation patching (270 heads)", r_ap, "r",
        note="the first-order estimate against the real patched runs",
    )  # fmt: skip
    rec.add("Pearson r, direct attribution vs activation patching (270 heads)", r_dla, "r")
    overlap = len({n for n, _ in top_patch[:5]} & {n for n, _ in top_ap})
    rec.add("heads shared by the top 5 of both patchings", overlap, "heads")
    best = divmod(int(dla.heads.flatten().abs().argmax()), H)
    src = dla.by_source[best]  # (S,)
    tokens = [tok.decode([i]) for i in clean]
    j = int(src.argmax())
    rec.note(
        f"head {best[0]}.{best[1]} reads most of its write from position {j} {tokens[j]!r} "
        f"({float(src[j]):+.3f} of {float(dla.heads[best]):+.3f})"
    )
    rec.note(f"frozen: {'; '.join(dla.frozen)}")
    if png_dir is not None:
        _ioi_figures(dla, heads.grid, estimate, residual.grid, tokens, r_ap, png_dir)
    return {
        "clean": heads.clean,
        "corrupted": heads.corrupted,
        "total": dla.total,
        "error": dla.error,
        "top_dla": top_dla,
        "top_patch": top_patch,
        "top_ap": top_ap,
        "r_ap": r_ap,
        "r_dla": r_dla,
        "mlp": [round(float(v), 3) for v in dla.mlp],
        "source": [round(float(v), 3) for v in src],
        "tokens": tokens,
    }


def _ioi_figures(dla, grid, estimate, residual, tokens, r_ap, png_dir: Path) -> None:
    from matplotlib.figure import Figure

    from attnlab.explain.figures import plot_attribution, plot_patch

    png_dir.mkdir(parents=True, exist_ok=True)
    meta = {"Software": None}
    fig = plot_attribution(
        dla,
        title=f"direct attribution of logit(' Mary') - logit(' John') = {dla.total:+.2f}",
        source="SmolLM2-135M",
    )
    fig.savefig(png_dir / "why-ioi-attribution.png", dpi=110, metadata=meta)
    fig = Figure(figsize=(13, 6.2), layout="constrained")
    a, b, c = fig.subplots(1, 3, width_ratios=[9, 9, 8])
    plot_patch(grid, title="activation patching (270 patched runs)", ax=a)
    plot_patch(estimate, title="attribution patching (one backward)", ax=b)
    c.scatter(grid.flatten().numpy(), estimate.flatten().numpy(), s=10, color="#2b6cb0")
    low = float(min(grid.min(), estimate.min()))
    high = float(max(grid.max(), estimate.max()))
    c.plot([low, high], [low, high], color="#a0aec0", linewidth=0.8)
    c.set_xlabel("activation patching")
    c.set_ylabel("attribution patching")
    c.set_title(f"each head, Pearson r = {r_ap:.3f}", fontsize=10)
    for name, value in _top(grid, 4):
        layer, head = (int(x) for x in name.split("."))
        c.annotate(name, (value, float(estimate[layer, head])), fontsize=8,
                   xytext=(4, -10), textcoords="offset points")  # fmt: skip
    fig.suptitle("SmolLM2-135M: ' Mary' vs ' John', second name swapped", fontsize=11)
    fig.savefig(png_dir / "why-ioi-patching.png", dpi=110, metadata=meta)
    title = "SmolLM2-135M: patching the residual stream entering each block"
    fig = plot_patch(residual, over="residual", tokens=tokens, title=title)
    fig.savefig(png_dir / "why-ioi-residual.png", dpi=110, metadata=meta)


def book_gpt(rec: Recorder, png_dir: Path | None) -> dict:
    from attnlab.data import get_tokenizer
    from attnlab.models.gpt import GPTConfig, GPTModel

    torch.manual_seed(123)  # the book's chapter-4 GPT: untrained, as the chapter ends
    model = GPTModel(GPTConfig.preset("gpt2-124m")).eval()
    tok = get_tokenizer()
    ids = tok.encode(BOOK_PROMPT)
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0, -1]
    first, second = logits.topk(2).indices.tolist()
    dla = attribute(model, ids, first, second, by_source=True)
    H = dla.heads.shape[1]
    rec.add("logit(top) - logit(runner-up)", dla.total, "logits")
    rec.add("direct attribution: |error| of the parts", abs(dla.error), "logits", better="lower")
    rec.add("embedding (token + position)", dla.embedding, "logits")
    rec.add("direct attribution of all heads", float(dla.heads.sum()), "logits")
    rec.add("direct attribution of all MLPs", float(dla.mlp.sum()), "logits")
    rec.add("bias (final LayerNorm shift)", dla.bias, "logits")
    for name, value in _top(dla.heads, 3):
        rec.add(f"direct attribution of head {name}", value, "logits")
    best_mlp = int(dla.mlp.abs().argmax())
    rec.add(f"direct attribution of mlp {best_mlp}", float(dla.mlp[best_mlp]), "logits")
    rec.note(f"top {tok.decode([first])!r}, runner-up {tok.decode([second])!r}")
    rec.note(f"frozen: {'; '.join(dla.frozen)}")
    if png_dir is not None:
        from attnlab.explain.figures import plot_attribution

        fig = plot_attribution(
            dla,
            title=f"{tok.decode([first])!r} rather than {tok.decode([second])!r}"
            f" = {dla.total:+.3f}",
            source="the book's GPT (seed 123, untrained)",
        )
        fig.savefig(png_dir / "why-book-gpt.png", dpi=110, metadata={"Software": None})
    return {
        "top": tok.decode([first]),
        "runner_up": tok.decode([second]),
        "total": dla.total,
        "error": dla.error,
        "embedding": dla.embedding,
        "heads_sum": float(dla.heads.sum()),
        "mlp_sum": float(dla.mlp.sum()),
        "bias": dla.bias,
        "heads": _top(dla.heads, 4),
        "mlp": [round(float(v), 4) for v in dla.mlp],
        "frozen": dla.frozen,
        "h": H,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", choices=["smollm2-ioi", "book-gpt"], default="smollm2-ioi")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--png-dir", type=Path, default=None, help="write the guide's figures here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    measured = {
        "smollm2-ioi": "SmolLM2-135M-Instruct (Q4_1 GGUF, float32) on the indirect-object "
        f"prompt {CLEAN!r} (' Mary' vs ' John') and its corruption {CORRUPTED!r}: direct "
        "attribution, activation patching over heads and the residual stream, attribution "
        "patching, and their agreement",
        "book-gpt": "the book's chapter-4 GPT (gpt2-124m preset, torch.manual_seed(123), "
        f"untrained) on {BOOK_PROMPT!r}: direct attribution of its top next token against "
        "the runner-up",
    }[args.config]
    rec = Recorder("why_token", args.config, measured, threads=args.threads)
    if args.config == "smollm2-ioi":
        summary = smollm2_ioi(rec, args.png_dir)
    else:
        summary = book_gpt(rec, args.png_dir)
    rec.write()
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
