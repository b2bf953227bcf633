"""GPT training with its sequence split across 2 ranks (context parallelism) on real
spawned gloo processes (127.0.0.1) matches training in one process.

Each rank holds its shard of every sequence (contiguous or zigzag), embeds it at its
global positions, runs every attention layer with ``backend="ring"``, and averages the
gradients over the ranks; the losses and the weights after a few AdamW steps must equal
one process training on the whole sequences.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnlab.distributed import (
    all_reduce_gradients,
    context_parallel,
    shard_positions,
    shard_sequence,
)
from attnlab.distributed.launch import spawn_local
from attnlab.models.gpt import GPTConfig, GPTModel
from reference import tol

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]

CFG = GPTConfig(vocab_size=61, context_length=32, emb_dim=16, n_heads=4, n_layers=2, drop_rate=0.0)
B, T, STEPS, LR = 2, 24, 3, 1e-2  # T: the full sequence, a multiple of 2 * 2 ranks


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, CFG.vocab_size, (B, T + 1), generator=g)
    # One batch every step, so that the loss must fall: (B, T) inputs, next-token targets.
    return [(data[:, :-1], data[:, 1:])] * STEPS


def _model(backend: str) -> tuple[GPTModel, torch.optim.Optimizer]:
    torch.manual_seed(123)
    model = GPTModel(CFG, backend=backend).double()
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def _cp_worker(rank: int, n: int, layout: str) -> dict | None:
    import torch.distributed as dist

    model, opt = _model("ring")
    pos = shard_positions(T, rank, n, layout)  # (T/N,) global positions, zigzag included
    losses = []
    for inputs, targets in _batches():
        x = shard_sequence(inputs, dim=1, layout=layout)  # (B, T/N)
        y = shard_sequence(targets, dim=1, layout=layout)  # (B, T/N)
        opt.zero_grad()
        with context_parallel(layout=layout):
            logits = model(x, position_ids=pos)  # (B, T/N, V)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())  # mean over local tokens
        loss.backward()
        all_reduce_gradients(model)  # equal shards: mean of the ranks' means = global mean
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / n)
    if rank:
        return None
    return {"losses": losses, "state": {k: v.clone() for k, v in model.state_dict().items()}}


def _single_process() -> tuple[list[float], dict[str, torch.Tensor]]:
    model, opt = _model("math")
    losses = []
    for inputs, targets in _batches():
        opt.zero_grad()
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, model.state_dict()


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_gpt_training_split_across_two_ranks_matches_one_process(layout: str) -> None:
    outcomes = spawn_local(_cp_worker, 2, (layout,), timeout=90, pg_timeout=30)
    assert all(o.ok for o in outcomes), [
        f"{o.error_type}: {o.error}\n{o.traceback}" for o in outcomes
    ]
    got = outcomes[0].value
    losses, state = _single_process()
    assert losses[-1] < losses[0]  # it trains
    torch.testing.assert_close(
        torch.tensor(got["losses"]), torch.tensor(losses), **tol(torch.float64)
    )
    assert list(got["state"]) == list(state)
    for name, w in state.items():
        torch.testing.assert_close(got["state"][name], w, **tol(torch.float64), msg=name)
