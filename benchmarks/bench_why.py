"""Why this token: attribution, patching and attribution patching against one forward.

On SmolLM2-135M-Instruct (the packaged file, float32), a 16-token indirect-object pair
("Then, when Mary and John went to the store, John gave a drink to" → " Mary" against
" John"; the corrupted prompt swaps the second name), three ratios measured in one process
(order reversed every round, best over the quiet rounds):

- ``attribute`` (direct logit attribution at the last position) against one forward of the
  same prompt (all positions' logits, no gradients);
- ``patch(over="heads")`` over all 270 heads against the naive loop: one full forward of
  the corrupted prompt per head, a forward pre-hook on that layer's output projection
  swapping the head's slice for the clean run's (as the tests' reference does);
- ``attribution_patching`` (one forward of both prompts as a batch of two, one backward)
  against one forward.

    PYTHONPATH=src python benchmarks/bench_why.py                 # 2 threads
    PYTHONPATH=src python benchmarks/bench_why.py --rounds 20 --patch-rounds 3
"""

from __future__ import annotations

import argparse

import torch
from _quiet import timed_pairs
from _records import Recorder

from attnlab.explain import attribute, attribution_patching, patch
from attnlab.pretrained import load_pretrained

CLEAN = "Then, when Mary and John went to the store, John gave a drink to"
CORRUPTED = "Then, when Mary and John went to the store, Mary gave a drink to"
TOKENS = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=20, help="rounds of the one-pass sides")
    parser.add_argument("--patch-rounds", type=int, default=3, help="rounds of the 270 heads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_pretrained("smollm2-135m-instruct")
    clean = torch.tensor([tok.encode(CLEAN)])
    corrupted = torch.tensor([tok.encode(CORRUPTED)])
    if clean.shape != (1, TOKENS) or corrupted.shape != (1, TOKENS):
        raise SystemExit(f"bench_why: the prompts must be {TOKENS} tokens, got {clean.shape}")
    mary, john = (tok.encode(t, add_special_tokens=False)[0] for t in (" Mary", " John"))
    rec = Recorder(
        "bench_why",
        f"smollm2-float32-t{args.threads}",
        f"SmolLM2-135M-Instruct (float32) at {args.threads} threads on a {TOKENS}-token "
        "indirect-object pair: attribute and attribution_patching against one forward of "
        f"the same prompt ({args.rounds} interleaved rounds), patch over all 270 heads "
        f"against the naive loop of one hooked forward per head ({args.patch_rounds} rounds)",
        args.threads,
    )
    D = model.config.attention_head_dim
    H = model.config.num_heads
    o_projs = [b.attention.out_proj for b in model.blocks]

    def forward() -> None:
        with torch.no_grad():
            model(corrupted)

    def clean_heads() -> list[torch.Tensor]:
        seen: list[torch.Tensor] = []
        hooks = [o.register_forward_pre_hook(lambda m, a: seen.append(a[0])) for o in o_projs]
        with torch.no_grad():
            model(clean)
        for h in hooks:
            h.remove()
        return seen

    def naive() -> None:
        z_clean = clean_heads()
        for layer, o in enumerate(o_projs):
            for head in range(H):

                def swap(m, a, layer=layer, head=head):  # type: ignore[no-untyped-def]
                    z = a[0].clone()
                    z[..., head * D : (head + 1) * D] = z_clean[layer][
                        ..., head * D : (head + 1) * D
                    ]
                    return (z,)

                hook = o.register_forward_pre_hook(swap)
                with torch.no_grad():
                    model(corrupted)
                hook.remove()

    one = timed_pairs(
        {
            "forward": forward,
            "attribute": lambda: attribute(model, clean, mary, john),
            "attribution_patching": lambda: attribution_patching(
                model, clean, corrupted, mary, john
            ),
        },
        args.rounds,
    )
    grid = timed_pairs(
        {
            "naive loop": naive,
            "patch": lambda: patch(model, clean, corrupted, mary, john),
        },
        args.patch_rounds,
    )
    fwd = one.best["forward"]
    rec.add("one forward (16 tokens)", fwd * 1e3, "ms", better="lower")
    rec.add("attribute", one.best["attribute"] * 1e3, "ms", peer="one forward",
            peer_value=fwd * 1e3, better="lower", note="target: at most 1.5x")  # fmt: skip
    rec.add("attribution_patching", one.best["attribution_patching"] * 1e3, "ms",
            peer="one forward", peer_value=fwd * 1e3, better="lower",
            note="target: at most 4x")  # fmt: skip
    rec.add('patch(over="heads"), 270 heads', grid.best["patch"] * 1e3, "ms",
            peer="naive loop (270 hooked forwards)", peer_value=grid.best["naive loop"] * 1e3,
            better="lower", note="target: at most 0.5x")  # fmt: skip
    rec.note(
        f"quiet rounds: {one.quiet_pairs}/{one.pairs} (one-pass sides), "
        f"{grid.quiet_pairs}/{grid.pairs} (patching); best wall time per side"
    )
    rec.note(
        "patch runs each layer's 9 patched variants as one batch from that layer up (the "
        "corrupted stream entering it cached once) and computes the last position's logits "
        "only; the naive loop runs all 30 layers and every position's logits per head"
    )
    for f in rec.figures:
        print(
            f"{f.name}: {f.value:.1f} {f.unit}" + (f" ({f.ratio:.3f}x {f.peer})" if f.ratio else "")
        )
    rec.write()


if __name__ == "__main__":
    main()
