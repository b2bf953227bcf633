"""attnlab.optim.AdamW against torch.optim.AdamW: the same parameters and state bit for bit,
state dicts that load into each other, and a training process that never imports
torch._dynamo."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch

from attnlab.models.gpt import GPTConfig, GPTModel
from attnlab.optim import AdamW
from cli_runner import SRC

CFG = GPTConfig(vocab_size=97, context_length=16, emb_dim=32, n_heads=2, n_layers=2, drop_rate=0.0)


def _model(seed: int = 0) -> GPTModel:
    torch.manual_seed(seed)
    return GPTModel(CFG)


def _groups(model: GPTModel) -> list[dict]:
    """The trainer's groups: weight decay on matrices and embeddings only."""
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def _train(model: GPTModel, opt, steps: range, *, clip: bool = True) -> None:
    """Steps of the trainer's loop: a learning rate set per step, clipping, then step."""
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        x = torch.randint(0, CFG.vocab_size, (4, 16), generator=gen)
        for group in opt.param_groups:
            group["lr"] = 3e-3 * (1 + step) / (2 + step)
        opt.zero_grad(set_to_none=True)
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()


def _assert_same(a: GPTModel, b: GPTModel, sa: dict, sb: dict) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for i in sa["state"]:
        assert sa["state"][i].keys() == sb["state"][i].keys()
        for key in sa["state"][i]:
            ta, tb = sa["state"][i][key], sb["state"][i][key]
            assert ta.dtype == tb.dtype and torch.equal(ta, tb), (i, key)


def test_adamw_equals_pytorch_bit_for_bit_with_its_state_dict():
    ours, ref = _model(), _model()
    opt = AdamW(_groups(ours), lr=3e-3, betas=(0.9, 0.95))
    ref_opt = torch.optim.AdamW(_groups(ref), lr=3e-3, betas=(0.9, 0.95))
    _train(ours, opt, range(25))
    _train(ref, ref_opt, range(25))
    _assert_same(ours, ref, opt.state_dict(), ref_opt.state_dict())


@pytest.mark.parametrize("direction", ["pytorch-to-attnlab", "attnlab-to-pytorch"])
def test_a_state_from_either_optimizer_resumes_in_the_other(direction):
    """A checkpoint's optimizer state written by torch.optim.AdamW (runs before this
    optimizer existed) continues here exactly as in PyTorch, and the other way round."""
    first, second = _model(), _model()
    a_cls, b_cls = (torch.optim.AdamW, AdamW)
    if direction == "attnlab-to-pytorch":
        a_cls, b_cls = b_cls, a_cls
    a = a_cls(_groups(first), lr=3e-3, betas=(0.9, 0.95))
    _train(first, a, range(6))
    second.load_state_dict(first.state_dict())
    b = b_cls(_groups(second), lr=1.0, betas=(0.5, 0.5))  # options come from the state
    b.load_state_dict(copy.deepcopy(a.state_dict()))  # as through torch.save and load
    _train(first, a, range(6, 12))
    _train(second, b, range(6, 12))
    _assert_same(first, second, a.state_dict(), b.state_dict())


def test_parameters_without_a_gradient_are_left_alone_and_bad_states_are_named():
    model = _model()
    frozen = model.pos_emb.weight
    frozen.requires_grad_(False)
    opt = AdamW(_groups(model), lr=1e-2, betas=(0.9, 0.95))
    before = frozen.clone()
    _train(model, opt, range(2))
    assert torch.equal(frozen, before) and frozen not in opt.state
    with pytest.raises(ValueError, match="more than one"):
        AdamW([{"params": [frozen]}, {"params": [frozen]}])
    state = opt.state_dict()
    state["param_groups"][0]["amsgrad"] = True
    with pytest.raises(ValueError, match="`amsgrad`"):
        AdamW(_groups(model)).load_state_dict(state)
    with pytest.raises(ValueError, match="2 parameter groups"):
        AdamW(_groups(model)[:1]).load_state_dict(opt.state_dict())


@pytest.mark.slow
def test_a_training_process_never_imports_dynamo(tmp_path):
    """`attnlab train` on CPU: building any torch.optim optimizer imports torch._dynamo
    (about 2 s); the trainer's own AdamW does not."""
    code = (
        "import sys\n"
        "from attnlab.cli import main\n"
        "try:\n"
        f"    main(['train', '--steps', '2', '--batch-size', '2', '--eval-interval', '1',"
        f" '--layers', '1', '--emb-dim', '16', '--heads', '2', '--context-length', '8',"
        f" '--repeated-words', '2-3', '--out', {str(tmp_path / 'run')!r}])\n"
        "except SystemExit as e:\n"
        "    assert not e.code, e.code\n"
        "print('dynamo' if 'torch._dynamo' in sys.modules else 'no dynamo')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC), "MPLBACKEND": "Agg"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "no dynamo"
