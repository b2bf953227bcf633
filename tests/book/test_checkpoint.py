from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from attnlab import checkpoint as ckpt_mod
from attnlab.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from attnlab.models.gpt import GPTConfig, GPTModel

CFG = GPTConfig(vocab_size=53, context_length=8, emb_dim=8, n_heads=2, n_layers=1)


RNG = torch.Generator().manual_seed(42).get_state()


def _save(tmp_path, model, step=3, state=True):
    return save_checkpoint(
        tmp_path,
        model.state_dict(),
        model_type="gpt",
        model_config=CFG.to_dict(),
        step=step,
        training_state={"step": step, "rng": RNG} if state else None,
        extra={"note": "x"},
    )


def test_round_trip(tmp_path):
    torch.manual_seed(0)
    model = GPTModel(CFG)
    _save(tmp_path, model)
    loaded = GPTModel.from_checkpoint(tmp_path)
    assert loaded.cfg == CFG
    for k, v in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[k], v, rtol=0, atol=0)
    ck = load_checkpoint(tmp_path)
    assert ck.step == 3 and ck.training_state["step"] == 3 and ck.extra == {"note": "x"}
    assert torch.equal(ck.training_state["rng"], RNG)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["config.json", "model-000003.safetensors", "training-000003.pt"]


def test_newer_save_replaces_the_older_files(tmp_path):
    model = GPTModel(CFG)
    _save(tmp_path, model, step=3)
    _save(tmp_path, model, step=7)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["config.json", "model-000007.safetensors", "training-000007.pt"]
    assert load_checkpoint(tmp_path).step == 7


def test_truncated_weights_are_refused(tmp_path):
    _save(tmp_path, GPTModel(CFG))
    weights = tmp_path / "model-000003.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="truncated or damaged"):
        GPTModel.from_checkpoint(tmp_path)


def test_altered_bytes_are_refused(tmp_path):
    _save(tmp_path, GPTModel(CFG))
    state = tmp_path / "training-000003.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="SHA-256 does not match"):
        load_checkpoint(tmp_path)
    # The weights alone are still fine.
    assert GPTModel.from_checkpoint(tmp_path).cfg == CFG


def test_mismatched_config_is_refused(tmp_path):
    _save(tmp_path, GPTModel(CFG))
    manifest = json.loads((tmp_path / "config.json").read_text())
    manifest["model_config"]["emb_dim"] = 16
    (tmp_path / "config.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"does not match its weights.*tok_emb\.weight"):
        GPTModel.from_checkpoint(tmp_path)
    manifest["model_config"]["emb_dim"] = 8
    manifest["model_config"]["n_layers"] = 2
    (tmp_path / "config.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"missing \['trf_blocks\.1"):
        GPTModel.from_checkpoint(tmp_path)


def test_missing_or_damaged_manifest(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")
    with pytest.raises(CheckpointError, match=r"config\.json is missing"):
        load_checkpoint(tmp_path)
    _save(tmp_path, GPTModel(CFG))
    (tmp_path / "config.json").write_text('{"format": "attnlab-checkpoint", ')
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_checkpoint(tmp_path)


def test_a_save_killed_midway_leaves_the_last_good_checkpoint(tmp_path, monkeypatch):
    model = GPTModel(CFG)
    _save(tmp_path, model, step=3)
    real_replace = ckpt_mod.os.replace

    def dies_on_manifest(src, dst):
        if str(dst).endswith("config.json"):
            raise KeyboardInterrupt  # killed after the data files, before the manifest
        real_replace(src, dst)

    monkeypatch.setattr(ckpt_mod.os, "replace", dies_on_manifest)
    with torch.no_grad():
        model.out_head.weight.add_(1.0)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, model, step=9)
    monkeypatch.undo()
    ck = load_checkpoint(tmp_path)
    assert ck.step == 3  # the previous checkpoint, complete and verified
    assert not any(".tmp-" in p.name for p in tmp_path.iterdir())


def test_every_gpt_checkpoint_loader_checks_the_config_against_the_weights(tmp_path):
    """The library, the commands (`explain`, `heads`, `generate`) and the server load GPT
    checkpoints through `GPTModel.from_checkpoint`: a config that does not fit the weights
    is refused naming the tensor, never loaded approximately (or failing deep in torch)."""
    pytest.importorskip("starlette")
    from attnlab.cli.models import load_checkpoint_model
    from attnlab.cli.output import UserError
    from attnlab.serve.models import checkpoint_spec

    torch.manual_seed(0)
    good = tmp_path / "good"
    _save(good, GPTModel(CFG))
    model, _, label = load_checkpoint_model(good, "math")
    want = GPTModel.from_checkpoint(good)
    assert label == f"GPT checkpoint {good} (step 3)" and not model.training
    assert all(b.att.backend == "math" for b in model.trf_blocks)
    for loaded in (model, checkpoint_spec(good).load().model):
        for k, v in want.state_dict().items():
            assert torch.equal(loaded.state_dict()[k], v), k

    bad = tmp_path / "bad"
    _save(bad, GPTModel(CFG))
    manifest = json.loads((bad / "config.json").read_text())
    manifest["model_config"]["emb_dim"] = 16
    (bad / "config.json").write_text(json.dumps(manifest))
    match = r"does not match its weights.*tok_emb\.weight"
    with pytest.raises(CheckpointError, match=match):
        GPTModel.from_checkpoint(load_checkpoint(bad))
    with pytest.raises(UserError, match=match):
        load_checkpoint_model(bad)
    with pytest.raises(CheckpointError, match=match):
        checkpoint_spec(bad).load()
    with pytest.raises(CheckpointError, match="holds a 'bert' model, expected 'gpt'"):
        GPTModel.from_checkpoint(dataclasses.replace(load_checkpoint(good), model_type="bert"))
