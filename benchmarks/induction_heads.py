"""Does `attnlab train --repeated-words` grow an induction head? Train, score, draw.

For each seed, runs the real command

    attnlab train --repeated-words LOW-HIGH --layers 2 --context-length C ...

then scores every head of the model before training (the same seeded initial weights the
trainer builds) and after, with :func:`attnlab.explain.head_scores`, on a sequence of the
training words repeated twice whose length ``--n`` lies outside LOW..HIGH (a held-out
length, so that a head that looks a fixed distance back cannot pass for an induction
head). Writes one JSON record (benchmarks/results/) and a figure of the per-head
induction score before and after.

    PYTHONPATH=src python benchmarks/induction_heads.py --steps 500 --seeds 1 2 3 \\
        --png docs/img/induction-heads.png
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import torch
from _records import ROOT, Recorder

from attnlab.checkpoint import load_checkpoint
from attnlab.data import checkpoint_tokenizer, repeated_random_text
from attnlab.explain import head_scores
from attnlab.models.gpt import GPTConfig, GPTModel


def _scores(model: GPTModel, ids: list[int]) -> dict[str, torch.Tensor]:
    return head_scores(model.eval(), ids)


def draw(before: torch.Tensor, after: torch.Tensor, title: str):
    """Two heatmaps (layers x heads) of the induction score, before and after training."""
    from matplotlib.figure import Figure

    L, H = before.shape
    fig = Figure(figsize=(7.5, 2.6 + 0.5 * L), dpi=110, layout="constrained")
    axes = fig.subplots(1, 2)
    for ax, scores, name in ((axes[0], before, "before training"), (axes[1], after, "after")):
        im = ax.imshow(scores.numpy(), vmin=0.0, vmax=1.0, cmap="viridis")
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("head")
        ax.set_xticks(range(H))
        ax.set_yticks(range(L))
        for layer in range(L):
            for head in range(H):
                v = float(scores[layer, head])
                ax.text(
                    head,
                    layer,
                    f"{v:.2f}",
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="black" if v > 0.6 else "white",
                )
    axes[0].set_ylabel("layer")
    fig.colorbar(im, ax=list(axes), label="induction score")
    fig.suptitle(textwrap.fill(title, 90), fontsize=9)
    return fig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--words", default="5-20", help="--repeated-words of the training data")
    p.add_argument("--n", type=int, default=25, help="held-out repeat length of the scoring")
    p.add_argument("--context-length", type=int, default=64)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--warmup-steps", type=int, default=None)
    p.add_argument("--emb-dim", type=int, default=None)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--dropout", type=float, default=None)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--png", type=Path, default=None, help="write the figure of the first seed")
    args = p.parse_args()
    low, high = (int(x) for x in args.words.split("-"))
    extra = " ".join(
        f"--{flag.replace('_', '-')} {getattr(args, flag)}"
        for flag in ("batch_size", "lr", "warmup_steps", "emb_dim", "heads", "dropout")
        if getattr(args, flag) is not None
    )
    if low <= args.n <= high:
        sys.exit(f"--n {args.n} must lie outside the trained lengths {args.words}")

    rec = Recorder(
        benchmark="induction_heads",
        config=f"words-{args.words}-steps-{args.steps}",
        measured=(
            f"attnlab train --repeated-words {args.words} --layers 2 --context-length "
            f"{args.context_length} {extra} for {args.steps} steps; the strongest layer-1 "
            f"induction score and layer-0 previous-token score on a held-out length n={args.n}, "
            "before and after, one figure per seed"
        ),
        threads=torch.get_num_threads(),
    )
    first: tuple[torch.Tensor, torch.Tensor] | None = None
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [
                sys.executable,
                "-m",
                "attnlab",
                "train",
                "--repeated-words",
                args.words,
                "--layers",
                "2",
                "--context-length",
                str(args.context_length),
                "--steps",
                str(args.steps),
                "--batch-size",
                str(args.batch_size),
                "--eval-interval",
                str(args.steps),
                "--seed",
                str(seed),
                "--out",
                tmp,
            ]
            for flag in ("lr", "warmup_steps", "emb_dim", "heads", "dropout"):
                if getattr(args, flag) is not None:
                    cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
            subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
            ckpt = load_checkpoint(tmp, with_training_state=False)
            after_model = GPTModel.from_checkpoint(ckpt)
            tok = checkpoint_tokenizer(ckpt)  # the words of the run (or GPT-2's)
            history = json.loads((Path(tmp) / "history.json").read_text())
        cfg: GPTConfig = after_model.cfg
        # The trainer's own construction of the initial weights (seeded, in the book's order).
        torch.manual_seed(seed)
        random.seed(seed)
        before_model = GPTModel(cfg)
        # A held-out length, in a draw (seed < 0) that no training text uses.
        ids = tok.encode(repeated_random_text(1, args.n, seed=-1 - seed))
        before, after = _scores(before_model, ids), _scores(after_model, ids)
        if first is None:
            first = (before["induction"], after["induction"])
        final = history["evals"][-1]
        for when, s in (("before", before), ("after", after)):
            rec.add(
                f"seed {seed} {when}: best layer-1 induction score",
                float(s["induction"][1].max()),
                "mean weight",
            )
            rec.add(
                f"seed {seed} {when}: best layer-0 previous-token score",
                float(s["previous_token"][0].max()),
                "mean weight",
            )
        rec.add(
            f"seed {seed}: best induction score of any head before",
            float(before["induction"].max()),
            "mean weight",
        )
        rec.add(
            f"seed {seed}: final train / val loss",
            final["train_loss"],
            "nats",
            note=f"val {final['val_loss']:.3f}",
        )
        print(
            f"seed {seed}: induction before\n{before['induction']}\nafter\n{after['induction']}"
            f"\nprevious-token after\n{after['previous_token']}\nloss {final}"
        )
    rec.write()
    if args.png is not None and first is not None:
        title = (
            f"attnlab train --repeated-words {args.words} --layers 2 --steps {args.steps}"
            f" {extra}\n(seed {args.seeds[0]}); scored on n={args.n} words repeated twice"
        )
        draw(*first, title).savefig(args.png)
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
