"""Training throughput: attnlab's GPTModel against a plain-PyTorch GPT of the same config.

The peer is the compact reference GPT style (nanoGPT): fused QKV projection and a direct call to
``torch.nn.functional.scaled_dot_product_attention(..., is_causal=True)``. Both models train on
the same random batches with AdamW; steps alternate between the two so that a change in machine
load hits both alike, and the median step time is compared.

    PYTHONPATH=src python benchmarks/bench_train.py [--preset tiny] [--steps 20] [--threads 2]

Prints tokens/s of each and the ratio attnlab / plain (target >= 0.95).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from _quiet import timed_pairs
from _records import Recorder
from torch import nn

from attnlab.models.gpt import GPTConfig, GPTModel


class PlainBlock(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        C = cfg.emb_dim
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(C)
        self.qkv = nn.Linear(C, 3 * C, bias=cfg.qkv_bias)
        self.proj = nn.Linear(C, C)
        self.ln2 = nn.LayerNorm(C)
        self.mlp = nn.Sequential(nn.Linear(C, 4 * C), nn.GELU("tanh"), nn.Linear(4 * C, C))
        self.drop = nn.Dropout(cfg.drop_rate)
        self.p = cfg.drop_rate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.p if self.training else 0.0
        )  # (B, H, T, D)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(B, T, C)))
        return x + self.drop(self.mlp(self.ln2(x)))


class PlainGPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.emb_dim)
        self.pos = nn.Embedding(cfg.context_length, cfg.emb_dim)
        self.drop = nn.Dropout(cfg.drop_rate)
        self.blocks = nn.ModuleList(PlainBlock(cfg) for _ in range(cfg.n_layers))
        self.ln = nn.LayerNorm(cfg.emb_dim)
        self.head = nn.Linear(cfg.emb_dim, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.tok(idx) + self.pos(torch.arange(idx.size(1))))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--context-length", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rec = Recorder(
        "bench_train",
        args.preset,
        f"training throughput of the {args.preset} GPT (AdamW, batch {args.batch_size}, "
        f"{args.steps} timed steps, alternating, median step): attnlab's GPTModel against a "
        "plain PyTorch GPT with fused QKV and F.scaled_dot_product_attention",
        args.threads,
    )
    over = {} if args.context_length is None else {"context_length": args.context_length}
    cfg = GPTConfig.preset(args.preset, **over)
    torch.manual_seed(0)
    models = {"attnlab GPTModel": GPTModel(cfg), "plain PyTorch GPT (F.sdpa)": PlainGPT(cfg)}
    n_params = {k: sum(p.numel() for p in m.parameters()) for k, m in models.items()}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    B, T = args.batch_size, cfg.context_length
    x = torch.randint(0, cfg.vocab_size, (B, T))
    y = torch.randint(0, cfg.vocab_size, (B, T))

    def step(name: str) -> None:
        model, opt = models[name], opts[name]
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    fns = {name: (lambda name=name: step(name)) for name in models}
    for _ in range(2):  # warm-up steps are not timed
        for fn in fns.values():
            fn()
    res = timed_pairs(fns, args.steps)  # type: ignore[arg-type]
    print(
        f"config: {args.preset} ({cfg.n_layers} layers, emb {cfg.emb_dim}, {cfg.n_heads} heads, "
        f"context {T}), batch {B}, {args.steps} timed steps, {args.threads} threads"
    )
    tps = {}
    for name in models:
        med = res.median(name)
        tps[name] = B * T / med
        print(f"  {name:<28} {n_params[name]:>12,} params  {tps[name]:>9,.0f} tokens/s")
    a, b = tps["attnlab GPTModel"], tps["plain PyTorch GPT (F.sdpa)"]
    print(f"ratio attnlab / plain: {a / b:.3f}x  (target >= 0.95x)")
    rec.add("attnlab GPTModel training", a, "tokens/s", peer="plain PyTorch GPT (F.sdpa)",
            peer_value=b)  # fmt: skip
    rec.write()


if __name__ == "__main__":
    main()
