"""The one-token decode step for gpt-oss's layout: attention sinks (one more softmax
column with no value) and mixtures of experts, against the model's own modules and
against transformers' gpt-oss."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attnlab.generation import generate
from attnlab.models.decoder import Decoder, DecoderConfig
from attnlab.models.fast_decode import decode_plan, why_not_fast_decode
from attnlab.models.moe import MoEConfig
from attnlab.pretrained import load_pretrained
from model_files import save_hf

GPT_OSS_LIKE = DecoderConfig(
    vocab_size=96,
    hidden_size=64,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=64,
    context_length=48,
    qkv_bias=True,
    out_bias=True,
    attn_sinks=True,
    layer_windows=(4, None, 4),
    moe=MoEConfig(
        num_experts=4,
        top_k=2,
        expert_size=32,
        router_bias=True,
        expert_bias=True,
        clamped_swiglu=(7.0, 1.702),
    ),
    layer_moe=(True, False, True),
)


def _model(seed: int = 0, **options: object) -> Decoder:
    torch.manual_seed(seed)
    model = Decoder(dataclasses.replace(GPT_OSS_LIKE, **options)).eval()
    with torch.no_grad():  # larger weights than the default init: logits far from ties
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.2)
        for block in model.blocks:  # sinks that matter: some large, some below the scores
            block.attention.sinks.normal_(0, 2.0)
    return model


@pytest.mark.parametrize("batch", [1, 2])
def test_sinks_and_experts_decode_with_the_module_paths_logits(batch):
    model = _model()
    assert why_not_fast_decode(model) is None
    ids = torch.randint(0, 96, (batch, 6), generator=torch.Generator().manual_seed(4))
    slow, fast = model.new_kv_cache(), model.new_kv_cache(max_len=20)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, kv_cache=fast), model(ids, kv_cache=slow))
        nxt = ids[:, -1:]
        for _ in range(10):  # 16 positions: past the window of 4
            a, b = model(nxt, kv_cache=slow), model(nxt, kv_cache=fast)
            torch.testing.assert_close(b, a, atol=3e-5, rtol=1e-5)
            nxt = a[:, -1].argmax(-1, keepdim=True)
    plan = model._decode_plan
    assert plan is not None and plan.rows is None  # the general loop ran
    assert [layer.sinks is not None for layer in plan.layers] == [True] * 3
    assert [layer.down is None for layer in plan.layers] == [True, False, True]  # experts


def test_the_sink_changes_the_step():
    """The sinks are read by the step: other sinks, other logits (so the test above would
    see a step that ignored them)."""
    model = _model()
    ids = torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(2))
    logits = []
    for shift in (0.0, 3.0):
        with torch.no_grad():
            for block in model.blocks:
                block.attention.sinks += shift
            cache = model.new_kv_cache(max_len=8)
            model(ids[:, :4], kv_cache=cache)
            logits.append(model(ids[:, 4:], kv_cache=cache))
    assert (logits[0] - logits[1]).abs().max() > 1e-3


def test_greedy_tokens_through_the_step_match_transformers_gpt_oss(tmp_path):
    """A random gpt-oss checkpoint (sinks, alternating windows, clamped experts, YaRN):
    greedy tokens through the decode step are transformers' own."""
    pytest.importorskip("transformers", reason="pip install 'attnlab[test-ref]'")
    folder = save_hf(
        "gpt_oss",
        {
            "hidden_size": 64,
            "intermediate_size": 48,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_hidden_layers": 3,
            "head_dim": 16,
            "num_local_experts": 5,
            "num_experts_per_tok": 3,
            "sliding_window": 5,
            "max_position_embeddings": 128,
            "pad_token_id": 1,
            "bos_token_id": 0,
            "eos_token_id": 2,
        },
        tmp_path / "gpt_oss",
        torch.float32,
    )
    from transformers import AutoModelForCausalLM

    model, _ = load_pretrained(folder)
    assert why_not_fast_decode(model) is None
    ref = AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="eager", dtype=torch.float32
    ).eval()
    with torch.no_grad():  # sinks away from transformers' init of 0: the sink matters more
        for ours, theirs in zip(model.blocks, ref.model.layers, strict=True):
            sinks = torch.randn(4, generator=torch.Generator().manual_seed(7)) * 2
            ours.attention.sinks.copy_(sinks)
            theirs.self_attn.sinks.copy_(sinks)
    ids = torch.randint(3, 512, (1, 12), generator=torch.Generator().manual_seed(1))
    plan = decode_plan(model)
    calls = []
    step = plan.step
    plan.step = lambda *a: calls.append(1) or step(*a)  # type: ignore[method-assign]
    # a static cache (max_len): the one-token steps take the plan
    cache = model.new_kv_cache(max_len=28)
    out = [ids]
    with torch.no_grad():
        logits = model(ids, kv_cache=cache)
        for _ in range(16):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            out.append(nxt)
            logits = model(nxt, kv_cache=cache)
        theirs = ref.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=16,
            do_sample=False,
            pad_token_id=1,
            eos_token_id=None,
        )
    assert len(calls) == 16
    assert torch.cat(out, dim=1).tolist() == theirs.tolist()
    assert generate(model, ids, 16).tolist() == theirs.tolist()
