"""A training worker for the distributed tests (run under torch's elastic launcher).

Usage: ddp_worker.py OUT_DIR STEPS [FAIL_RANK FAIL_STEP]
"""

from __future__ import annotations

import os
import sys

import torch

from attnlab.models.gpt import GPTConfig
from attnlab.train import TrainConfig, Trainer

# dropout 0: with dropout each process draws its own masks and the curves differ by design.
CONFIG = TrainConfig(
    model=GPTConfig(
        vocab_size=50257, context_length=16, emb_dim=16, n_heads=2, n_layers=2, drop_rate=0.0
    ),
    batch_size=4,
    lr=2e-2,
    eval_interval=4,
    eval_batches=2,
    sample_tokens=3,
)


class FailingTrainer(Trainer):
    def __init__(self, *args, fail_rank: int, fail_step: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.fail_rank, self.fail_step = fail_rank, fail_step

    def _forward_loss(self, x, y):
        if self._dist.rank == self.fail_rank and self.state.step == self.fail_step:
            raise RuntimeError(f"injected failure on rank {self.fail_rank}")
        return super()._forward_loss(x, y)


def main() -> None:
    torch.set_num_threads(1)
    out, steps = sys.argv[1], int(sys.argv[2])
    cfg = TrainConfig(**{**CONFIG.__dict__, "steps": steps})
    if len(sys.argv) > 3:
        trainer = FailingTrainer(
            cfg, out_dir=out, fail_rank=int(sys.argv[3]), fail_step=int(sys.argv[4])
        )
    else:
        trainer = Trainer(cfg, out_dir=out)
    from torch.distributed.elastic.multiprocessing.errors import record

    record(trainer.run)()
    assert int(os.environ["WORLD_SIZE"]) == 2


if __name__ == "__main__":
    main()
