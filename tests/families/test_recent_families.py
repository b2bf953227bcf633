"""The newest open models' attention and feed-forward, each family a tiny random
checkpoint built with transformers here and compared with transformers computed here
(fp32, eager attention): logits and every layer's attention weights, greedy tokens with
the KV cache, cached decoding against the full pass; bad configs name the field."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import shutil

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

if not all(importlib.util.find_spec(m) for m in ("transformers", "tokenizers", "safetensors")):
    pytest.skip("needs transformers, tokenizers and safetensors", allow_module_level=True)

import itertools

from attnlab.generation import generate
from attnlab.models.decoder import Decoder
from attnlab.models.moe import MixtureOfExperts, MoEConfig, clamped_swiglu
from attnlab.pretrained import ModelFileError, load_pretrained
from attnlab.rope import RotaryEmbedding
from cli_runner import run_main
from model_files import (
    assert_matches_reference,
    gguf_reference,
    save_hf,
    score_correction,
    write_gguf,
)

_SMALL = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "pad_token_id": 1,
    "bos_token_id": 0,
    "eos_token_id": 2,
}
# DeepSeek's latent attention, small: 4 heads of nope 12 + rope 8 dims, values of 10, a
# latent of 16 (the cache: 16 + 8 numbers per token, against 4 * (20 + 10))
_MLA = {
    **_SMALL,
    "num_key_value_heads": 4,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 12,
    "qk_rope_head_dim": 8,
    "v_head_dim": 10,
    "moe_intermediate_size": 32,
    "max_position_embeddings": 256,
}
_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
}
FAMILIES: dict[str, dict] = {
    # NoPE on layers 3 and 7 (every 4th); untied head
    "smollm3": {
        **_SMALL,
        "num_hidden_layers": 8,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
    # NoPE layers given explicitly, with windows on them
    "smollm3-window": {
        **_SMALL,
        "num_hidden_layers": 3,
        "no_rope_layers": [0, 1, 0],
        "use_sliding_window": True,
        "sliding_window": 5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
    # NoPE on layers 1 and 3 (interval 2); chunks of 4 on the rotary layers (prompts of 12
    # to 24 tokens cross several); temperature floor 3 so that the scale changes within
    # a prompt; dense feed-forward only
    "llama4_text-dense": {
        **_SMALL,
        "num_hidden_layers": 4,
        "head_dim": 16,
        "intermediate_size_mlp": 80,
        "moe_layers": [],
        "no_rope_layer_interval": 2,
        "attention_chunk_size": 4,
        "floor_scale": 3,
        "attn_scale": 0.5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
    # layers 1 and 3 route to experts (top-2 of 4, sigmoid, a shared expert)
    "llama4_text": {
        **_SMALL,
        "num_hidden_layers": 4,
        "head_dim": 16,
        "intermediate_size": 32,
        "intermediate_size_mlp": 80,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "interleave_moe_layer_step": 2,
        "no_rope_layer_interval": 2,
        "attention_chunk_size": 4,
        "floor_scale": 3,
        "attn_scale": 0.5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
    # 4 experts, 2 per token (renormalised); a window shorter than the prompt
    "mixtral": {
        **_SMALL,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 9,
    },
    # layers 1 and 3 experts (0 in mlp_only_layers, 2 off decoder_sparse_step); top-3 of
    # 5 not renormalised
    "qwen3_moe": {
        **_SMALL,
        "num_hidden_layers": 4,
        "decoder_sparse_step": 2,
        "head_dim": 32,
        "moe_intermediate_size": 32,
        "num_experts": 5,
        "num_experts_per_tok": 3,
        "norm_topk_prob": False,
        "mlp_only_layers": [0],
    },
    # sinks, windows of 5 on the even layers, q/k/v/o biases, YaRN (x4 over 32 positions,
    # the ramp not rounded), top-3 of 5 experts with biases and the clamped SwiGLU
    "gpt_oss": {
        **_SMALL,
        "num_hidden_layers": 3,
        "head_dim": 16,
        "intermediate_size": 48,
        "num_local_experts": 5,
        "num_experts_per_tok": 3,
        "sliding_window": 5,
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 32,
            "rope_theta": 150000.0,
        },
    },
    # the clamps bite (limit 0.2: most gate/up values lie beyond it), layer types given,
    # no attention biases, transformers' default RoPE for gpt-oss (YaRN x32 over 4096)
    "gpt_oss-clamp": {
        **_SMALL,
        "num_hidden_layers": 2,
        "intermediate_size": 32,
        "head_dim": 16,
        "num_local_experts": 4,
        "num_experts_per_tok": 4,
        "swiglu_limit": 0.2,
        "swiglu_alpha": 3.0,
        "attention_bias": False,
        "layer_types": ["full_attention", "sliding_attention"],
        "sliding_window": 3,
    },
    # experts on every layer, renormalised: what llama.cpp's qwen3moe runs (and GGUF holds)
    "qwen3_moe-renorm": {
        **_SMALL,
        "num_hidden_layers": 2,
        "moe_intermediate_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
    },
    # latent attention with the low-rank query; YaRN whose mscale / mscale_all_dim differ
    # (both the cos/sin factor and the score scale bite); layer 0 dense, then 8 experts in
    # 4 groups, top-3 within the best 2 groups (softmax, best expert per group), 2 shared
    "deepseek_v2": {
        **_MLA,
        "num_hidden_layers": 3,
        "q_lora_rank": 24,
        "first_k_dense_replace": 1,
        "n_routed_experts": 8,
        "num_experts_per_tok": 3,
        "topk_method": "group_limited_greedy",
        "n_group": 4,
        "topk_group": 2,
        "n_shared_experts": 2,
        "routed_scaling_factor": 1.5,
        "rope_parameters": _YARN,
    },
    # DeepSeek-V2-Lite's shape: one query projection, greedy routing, plain RoPE
    "deepseek_v2-lite": {
        **_MLA,
        "num_hidden_layers": 2,
        "q_lora_rank": None,
        "first_k_dense_replace": 1,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
    # sigmoid router with a score correction (set below: the random one is 0), groups
    # scored by their best two, renormalised, scaled by 2.5; YaRN
    "deepseek_v3": {
        **_MLA,
        "num_hidden_layers": 3,
        "q_lora_rank": 24,
        "first_k_dense_replace": 1,
        "n_routed_experts": 8,
        "num_experts_per_tok": 3,
        "n_group": 4,
        "topk_group": 2,
        "rope_parameters": _YARN,
    },
    # rotate-half RoPE instead of interleaved pairs, no query low-rank pair
    "deepseek_v3-halfrope": {
        **_MLA,
        "num_hidden_layers": 2,
        "q_lora_rank": None,
        "rope_interleave": False,
        "first_k_dense_replace": 1,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
}


def _model_type(name: str) -> str:
    return name.split("-")[0]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("newest")
    folders = {
        name: save_hf(_model_type(name), overrides, root / name, torch.float32)
        for name, overrides in FAMILIES.items()
    }
    for name, folder in folders.items():
        if _model_type(name) == "deepseek_v3":
            score_correction(folder)
    return folders


def _reference(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="eager", dtype=torch.float32
    ).eval()


def _ids(n: int = 24, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (1, n), generator=g)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_logits_and_every_attention_match_transformers(checkpoints, name):
    model, _ = load_pretrained(checkpoints[name])
    assert isinstance(model, Decoder) and model.config.family == _model_type(name)
    ref = _reference(checkpoints[name])
    ids = _ids()
    assert_matches_reference(model, ref, ids)
    with torch.no_grad():
        assert ref(ids).logits.std() > 0.1  # not a degenerate model


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_greedy_tokens_with_the_kv_cache_match_transformers(checkpoints, name):
    model, _ = load_pretrained(checkpoints[name])
    ref = _reference(checkpoints[name])
    ids = _ids(12, seed=1)
    ours = generate(model, ids, 16)
    with torch.no_grad():
        theirs = ref.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=16,
            do_sample=False,
            pad_token_id=1,
            eos_token_id=None,
        )
    assert ours.tolist() == theirs.tolist()
    assert len(set(ours[0, ids.shape[1] :].tolist())) > 1


@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_cached_decoding_equals_the_full_pass(checkpoints, name, static):
    model, _ = load_pretrained(checkpoints[name], backend="math")
    ids = _ids(20, seed=2)
    with torch.no_grad():
        full = model(ids)
        cache = model.new_kv_cache(max_len=ids.shape[1]) if static else model.new_kv_cache()
        first = model(ids[:, :-4], kv_cache=cache)
        steps = [model(ids[:, i : i + 1], kv_cache=cache) for i in range(16, 20)]
    torch.testing.assert_close(torch.cat([first, *steps], dim=1), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_prompt_in_chunks_equals_the_full_pass(checkpoints, name, static):
    """A prompt fed through the cache a few positions at a time (chunks that cross
    llama4's attention chunks and the sliding windows) gives the logits of one pass."""
    model, _ = load_pretrained(checkpoints[name], backend="math")
    ids = _ids(20, seed=2)
    with torch.no_grad():
        full = model(ids)
        cache = model.new_kv_cache(max_len=ids.shape[1]) if static else model.new_kv_cache()
        cuts = [0, 3, 10, 11, 13, 20]
        parts = [model(ids[:, a:b], kv_cache=cache) for a, b in itertools.pairwise(cuts)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=0)


def test_llama4_layers(checkpoints):
    """Rotary layers: chunks and the L2 QK-norm; NoPE layers: global, temperature tuned."""
    model, _ = load_pretrained(checkpoints["llama4_text"])
    layers = [block.attention for block in model.blocks]
    assert [a.rope is not None for a in layers] == [True, False, True, False]
    assert [a.attention_chunk for a in layers] == [4, None, 4, None]
    assert [a.qk_norm is not None for a in layers] == [True, False, True, False]
    assert [a.temperature for a in layers] == [None, (3.0, 0.5), None, (3.0, 0.5)]
    # a query late in the prompt sees nothing before its chunk on a rotary layer
    with torch.no_grad():
        _, weights = model(_ids(10), need_weights=True)
    assert bool((weights[0][0, :, 9, :8] == 0).all()) and bool((weights[0][0, :, 9, 8:] > 0).all())
    assert bool((weights[1][0, :, 9] > 0).all())


def test_moe_layers_where_the_config_puts_them(checkpoints):
    kinds = {
        name: [type(block.mlp).__name__ for block in load_pretrained(checkpoints[name])[0].blocks]
        for name in ("mixtral", "qwen3_moe", "qwen3_moe-renorm", "llama4_text")
    }
    assert kinds == {
        "mixtral": ["MixtureOfExperts"] * 2,
        "llama4_text": ["MLP", "MixtureOfExperts"] * 2,
        "qwen3_moe": ["MLP", "MixtureOfExperts"] * 2,
        "qwen3_moe-renorm": ["MixtureOfExperts"] * 2,
    }
    model, _ = load_pretrained(checkpoints["qwen3_moe"])
    moe = model.blocks[1].mlp.config
    assert (moe.num_experts, moe.top_k, moe.expert_size, moe.renormalize) == (5, 3, 32, False)


def test_an_expert_no_token_chose_is_never_computed():
    """Poison the experts no token chose with NaN: a dense computation of every expert
    would spread the NaN (0 * NaN), routing only the chosen ones does not."""
    torch.manual_seed(0)
    moe = MixtureOfExperts(16, MoEConfig(8, 2, 12))
    x = torch.randn(1, 3, 16)  # 3 tokens x 2 choices: at least 2 of 8 experts idle
    with torch.no_grad():
        before = moe(x)
        chosen = set(moe.last_routing.experts.flatten().tolist())
        idle = sorted(set(range(8)) - chosen)
        assert len(idle) >= 2
        for e in idle:
            moe.experts.gate.weight[e] = float("nan")
            moe.experts.down.weight[e] = float("nan")
        after = moe(x)
    assert torch.equal(before, after)


@pytest.mark.parametrize("top_k", [1, 2])
def test_sigmoid_router_shared_expert_and_weighted_inputs_match_llama4_moe(top_k):
    """The module against transformers' Llama4TextMoe (sigmoid router on the top-k
    logits, the weight scaling each expert's input, a shared expert), weights copied."""
    from transformers import AutoConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    C, F, E = 16, 12, 4
    hf = AutoConfig.for_model(
        "llama4_text", hidden_size=C, intermediate_size=F, num_local_experts=E,
        num_experts_per_tok=top_k, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
    )  # fmt: skip
    torch.manual_seed(1)
    theirs = Llama4TextMoe(hf).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.3)
    config = MoEConfig(
        E, top_k, F, router="sigmoid", renormalize=False, weight_inputs=True, shared_size=F
    )
    ours = MixtureOfExperts(C, config, activation="silu")
    with torch.no_grad():
        ours.router.weight.copy_(theirs.router.weight)
        gate_up = theirs.experts.gate_up_proj  # (E, C, 2F): x @ it
        ours.experts.gate.weight.copy_(gate_up[..., :F].transpose(1, 2))
        ours.experts.up.weight.copy_(gate_up[..., F:].transpose(1, 2))
        ours.experts.down.weight.copy_(theirs.experts.down_proj.transpose(1, 2))
        for name in ("gate", "up", "down"):
            getattr(ours.shared, name).weight.copy_(
                getattr(theirs.shared_expert, f"{name}_proj").weight
            )
        x = torch.randn(2, 5, C)
        expected, _ = theirs(x)
        torch.testing.assert_close(ours(x), expected.view(2, 5, C), atol=1e-5, rtol=0)


@pytest.mark.parametrize("top_k", [1, 3])
def test_router_bias_expert_biases_and_clamped_swiglu_match_gpt_oss_mlp(top_k):
    """The module against transformers' GptOssMLP (router with a bias, softmax over the
    top-k logits, interleaved gate/up with biases, ``(up + 1) * glu`` with both clamps),
    weights copied and large enough that the clamps at 7 bite."""
    from transformers import AutoConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    C, F, E = 16, 12, 5
    hf = AutoConfig.for_model(
        "gpt_oss", hidden_size=C, intermediate_size=F, num_local_experts=E,
        num_experts_per_tok=top_k, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
    )  # fmt: skip
    torch.manual_seed(2)
    theirs = GptOssMLP(hf).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 1.0)
    config = MoEConfig(E, top_k, F, router_bias=True, expert_bias=True, clamped_swiglu=(7.0, 1.702))
    ours = MixtureOfExperts(C, config)
    ex = theirs.experts
    with torch.no_grad():
        ours.router.weight.copy_(theirs.router.weight)
        ours.router.bias.copy_(theirs.router.bias)
        ours.experts.gate.weight.copy_(ex.gate_up_proj[..., 0::2].transpose(1, 2))
        ours.experts.up.weight.copy_(ex.gate_up_proj[..., 1::2].transpose(1, 2))
        ours.experts.gate.bias.copy_(ex.gate_up_proj_bias[:, 0::2])
        ours.experts.up.bias.copy_(ex.gate_up_proj_bias[:, 1::2])
        ours.experts.down.weight.copy_(ex.down_proj.transpose(1, 2))
        ours.experts.down.bias.copy_(ex.down_proj_bias)
        x = torch.randn(2, 7, C)
        expected, _ = theirs(x)
        h = x.reshape(-1, C) @ ex.gate_up_proj[0]
        assert bool((h.abs() > 7).any())  # the clamps change something
        torch.testing.assert_close(ours(x), expected, atol=1e-4, rtol=1e-5)


def test_clamped_swiglu_by_hand():
    gate = torch.tensor([-9.0, -1.0, 0.5, 9.0])
    up = torch.tensor([-9.0, 2.0, 0.0, 9.0])
    got = clamped_swiglu(gate, up, 7.0, 1.702)
    g = torch.tensor([-9.0, -1.0, 0.5, 7.0])  # the gate clamped above only
    u = torch.tensor([-7.0, 2.0, 0.0, 7.0])  # up clamped both sides
    torch.testing.assert_close(got, (u + 1) * g * torch.sigmoid(1.702 * g))


def test_gpt_oss_layers(checkpoints):
    """Windows on the layers transformers makes local, a sink per head loaded, biases."""
    from transformers import AutoModelForCausalLM

    model, _ = load_pretrained(checkpoints["gpt_oss"])
    assert [b.attention.sliding_window for b in model.blocks] == [5, None, 5]
    ref = AutoModelForCausalLM.from_pretrained(checkpoints["gpt_oss"], dtype=torch.float32)
    for ours, theirs in zip(model.blocks, ref.model.layers, strict=True):
        assert torch.equal(ours.attention.sinks.detach(), theirs.self_attn.sinks.detach())
    assert model.blocks[0].attention.W_query.bias is not None
    clamp, _ = load_pretrained(checkpoints["gpt_oss-clamp"])
    assert [b.attention.sliding_window for b in clamp.blocks] == [None, 3]
    assert clamp.blocks[0].attention.W_query.bias is None
    moe = clamp.blocks[0].mlp.config
    assert (moe.top_k, moe.clamped_swiglu, moe.router_bias) == (4, (0.2, 3.0), True)
    scaling = clamp.config.rope.scaling  # transformers' gpt-oss default
    assert (clamp.config.rope.base, scaling.factor, scaling.truncate) == (150000.0, 32.0, False)


@pytest.mark.parametrize(
    ("edits", "match"),
    [
        ({"num_experts_per_tok": 6}, "`num_experts_per_tok` = 6 chooses more experts than exist"),
        ({"num_local_experts": 0}, "`num_local_experts` must be an integer >= 1"),
        ({"swiglu_limit": 0}, "`swiglu_limit` must be a finite number > 0"),
        ({"swiglu_alpha": "x"}, "`swiglu_alpha` must be a finite number > 0"),
        ({"layer_types": ["sliding_attention"]}, "`layer_types` must list one type per layer"),
        ({"quantization_config": {"quant_method": "awq"}}, "`quantization_config` with quant"),
        ({"rope_parameters": {"rope_type": "ntk"}}, "rope settings: `rope_type`"),
    ],
)
def test_gpt_oss_bad_configs_name_the_field(checkpoints, tmp_path, edits, match):
    folder = _edited(checkpoints, tmp_path, "gpt_oss", **edits)
    with pytest.raises(ModelFileError, match=match):
        load_pretrained(folder)


def test_gpt_oss_hub_mxfp4_experts_match_transformers_dequantisation(checkpoints, tmp_path):
    """The hub's gpt-oss layout: each expert tensor as ``_blocks`` (two E2M1 codes per
    byte) and ``_scales`` (E8M0 exponents), ``quantization_config`` mxfp4. attnlab reads
    them; the reference is transformers' model with transformers' own dequantisation
    (``convert_moe_packed_tensors``) of the same bytes."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    folder = _edited(
        checkpoints, tmp_path, "gpt_oss-clamp", quantization_config={"quant_method": "mxfp4"}
    )
    state = load_file(folder / "model.safetensors")
    g = torch.Generator().manual_seed(3)
    dequantised = {}
    for name in [n for n in state if n.endswith(("gate_up_proj", "down_proj"))]:
        E, K, N = state.pop(name).shape  # x @ (E, K, N): stored as N rows of K
        blocks = torch.randint(0, 256, (E, N, K // 32, 16), dtype=torch.uint8, generator=g)
        scales = torch.randint(118, 123, (E, N, K // 32), dtype=torch.uint8, generator=g)
        state[f"{name}_blocks"], state[f"{name}_scales"] = blocks, scales
        dequantised[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        assert dequantised[name].shape == (E, K, N)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    model, _ = load_pretrained(folder)
    ref = _reference(checkpoints["gpt_oss-clamp"])
    missing, unexpected = ref.load_state_dict(dequantised, strict=False)
    assert not unexpected and len(missing) == sum(1 for _ in ref.state_dict()) - len(dequantised)
    assert_matches_reference(model, ref, _ids())
    # a _blocks tensor without its _scales is refused, naming it
    del state["model.layers.0.mlp.experts.down_proj_scales"]
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelFileError, match="down_proj_blocks' without its MXFP4 partner"):
        load_pretrained(folder)


# gpt-oss metadata as llama.cpp's converter writes it (tests/llama_cpp/test_llama_cpp.py converts a
# checkpoint with it); the loader reads it through the family page.
_GPT_OSS_GGUF = {
    "general.architecture": "gpt-oss",
    "gpt-oss.block_count": 4,
    "gpt-oss.context_length": 256,
    "gpt-oss.embedding_length": 64,
    "gpt-oss.feed_forward_length": 32,
    "gpt-oss.expert_feed_forward_length": 32,
    "gpt-oss.attention.head_count": 4,
    "gpt-oss.attention.head_count_kv": 2,
    "gpt-oss.attention.key_length": 32,
    "gpt-oss.attention.value_length": 32,
    "gpt-oss.attention.layer_norm_rms_epsilon": 1e-5,
    "gpt-oss.attention.sliding_window": 128,
    "gpt-oss.rope.freq_base": 150000.0,
    "gpt-oss.rope.scaling.type": "yarn",
    "gpt-oss.rope.scaling.factor": 32.0,
    "gpt-oss.rope.scaling.original_context_length": 4096,
    "gpt-oss.rope.scaling.yarn_beta_fast": 32.0,
    "gpt-oss.rope.scaling.yarn_beta_slow": 1.0,
    "gpt-oss.expert_count": 8,
    "gpt-oss.expert_used_count": 4,
}


def _gpt_oss_gguf_config(**edits):
    from attnlab.models.families import family_for
    from attnlab.pretrained.build import build_config

    metadata = {k: v for k, v in {**_GPT_OSS_GGUF, **edits}.items() if v is not None}
    return build_config(
        family_for("gpt-oss", "gguf"), metadata, where="m.gguf", source="gguf",
        extra={"vocab_size": 100},
    )  # fmt: skip


def test_gpt_oss_gguf_metadata_as_llama_cpp_reads_it():
    """llama.cpp's reading: SWA pattern 2 (even layers local), YaRN with the ramp rounded
    and the attention factor 0.1 ln(32) + 1, the swiglu constants it hard-codes."""
    config = _gpt_oss_gguf_config()
    assert config.layer_windows == (128, None, 128, None)
    assert config.head_dim == 32 and config.attn_sinks and config.qkv_bias
    scaling = config.rope.scaling
    assert (scaling.factor, scaling.original_max_position_embeddings, scaling.truncate) == (
        32.0, 4096, True
    )  # fmt: skip
    assert scaling.attention_factor == pytest.approx(0.1 * math.log(32.0) + 1)
    moe = config.moe
    assert (moe.num_experts, moe.top_k, moe.expert_size) == (8, 4, 32)
    assert moe.clamped_swiglu == (7.0, 1.702) and moe.router_bias and moe.expert_bias


@pytest.mark.parametrize(
    ("edits", "match"),
    [
        ({"gpt-oss.attention.sliding_window": None}, "`gpt-oss.attention.sliding_window`"),
        ({"gpt-oss.expert_used_count": 9}, "`num_experts_per_tok` = 9 chooses more experts"),
        ({"gpt-oss.rope.scaling.yarn_ext_factor": 0.5}, "`gpt-oss.rope.scaling.yarn_ext_factor`"),
        ({"gpt-oss.rope.scaling.factor": None}, "`gpt-oss.rope.scaling.factor` must be a finite"),
        ({"gpt-oss.rope.scaling.type": "longrope"}, "'longrope' is not supported"),
        ({"gpt-oss.attention.sliding_window_pattern": [1, 0, 1, 0]}, "sliding_window_pattern"),
    ],
)
def test_gpt_oss_gguf_bad_metadata_names_the_key(edits, match):
    with pytest.raises(ModelFileError, match=match):
        _gpt_oss_gguf_config(**edits)


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_qwen3_moe_gguf_matches_transformers_on_the_dequantised_weights(
    checkpoints, tmp_path, qtype
):
    """A qwen3moe GGUF file as llama.cpp's converter writes it (experts stacked (E, ...),
    expert_count / expert_used_count / expert_feed_forward_length) against transformers
    with the file's weights; llama.cpp always renormalises the top-k weights."""
    path = tmp_path / "m.gguf"
    reference_state = write_gguf(checkpoints["qwen3_moe-renorm"], path, "qwen3_moe", qtype)
    model, _ = load_pretrained(path)
    assert [type(b.mlp).__name__ for b in model.blocks] == ["MixtureOfExperts"] * 2
    assert model.blocks[0].mlp.config.renormalize
    ref = gguf_reference(checkpoints["qwen3_moe-renorm"], reference_state)
    assert_matches_reference(model, ref, _ids())


def test_smollm3_nope_layers_have_no_rotary(checkpoints):
    model, _ = load_pretrained(checkpoints["smollm3"])
    rotary = [block.attention.rope is not None for block in model.blocks]
    assert rotary == [True, True, True, False, True, True, True, False]
    model, _ = load_pretrained(checkpoints["smollm3-window"])
    assert [block.attention.rope is not None for block in model.blocks] == [False, True, False]
    assert model.config.layer_windows == (5, None, 5)  # windows on the NoPE layers


def _edited(checkpoints, tmp_path, name: str, **edits) -> object:
    folder = tmp_path / name
    shutil.copytree(checkpoints[name], folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(edits)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    ("edits", "match"),
    [
        ({"attention_chunk_size": 0}, "`attention_chunk_size` must be an integer >= 1"),
        ({"moe_layers": [9]}, "`moe_layers` must list layer indices 0..3"),
        ({"num_experts_per_tok": 5}, "`num_experts_per_tok` = 5 chooses more experts"),
        ({"floor_scale": 0}, "`floor_scale` must be > 0"),
        ({"layer_types": ["sliding_attention"] * 4}, "`layer_types` holds an unsupported"),
    ],
)
def test_llama4_bad_configs_name_the_field(checkpoints, tmp_path, edits, match):
    folder = _edited(checkpoints, tmp_path, "llama4_text", **edits)
    with pytest.raises(ModelFileError, match=match):
        load_pretrained(folder)


@pytest.mark.parametrize(
    ("name", "edits", "match"),
    [
        ("smollm3", {"no_rope_layers": [1, 0]}, "`no_rope_layers` must list one 0 or 1 per"),
        ("smollm3", {"no_rope_layers": [2] * 8}, "`no_rope_layers` must list one 0 or 1 per"),
        (
            "mixtral",
            {"num_experts_per_tok": 5},
            "`num_experts_per_tok` = 5 chooses more experts than exist",
        ),
        ("qwen3_moe", {"num_local_experts": -1}, "`num_local_experts` must be an integer >= 1"),
        (
            "qwen3_moe",
            {"num_experts_per_tok": 6},
            "`num_experts_per_tok` = 6 chooses more experts than exist",
        ),
        ("qwen3_moe", {"mlp_only_layers": [9]}, "`mlp_only_layers` must list layer indices"),
        ("qwen3_moe", {"decoder_sparse_step": 0}, "`decoder_sparse_step` must be an integer"),
        (
            "smollm3",
            {"no_rope_layers": None, "no_rope_layer_interval": 0},
            "`no_rope_layer_interval` must be an integer >= 1",
        ),
    ],
)
def test_bad_configs_name_the_field(checkpoints, tmp_path, name, edits, match):
    folder = _edited(checkpoints, tmp_path, name, **edits)
    with pytest.raises(ModelFileError, match=match):
        load_pretrained(folder)


def test_info_shows_gpt_oss_experts_and_a_backend_that_adds_sinks(checkpoints, capsys):
    code, out, err = run_main(capsys, "info", "--model", str(checkpoints["gpt_oss"]), "--json")
    assert code == 0, err
    info = json.loads(out)
    assert info["mlp"] == "5 experts, top 3, clamped SwiGLU (7.0, 1.702)"
    # PyTorch's fused kernel has no sinks: the layers run elsewhere
    assert {lay["backend"] for lay in info["per_layer"]} <= {"blockwise", "math"}
    assert [lay["sliding_window"] for lay in info["per_layer"]] == [5, None, 5]


def test_info_names_the_nope_layers(checkpoints, capsys):
    code, out, err = run_main(capsys, "info", "--model", str(checkpoints["smollm3"]), "--json")
    assert code == 0, err
    assert json.loads(out)["rope"]["nope_layers"] == [3, 7]
    code, out, err = run_main(capsys, "info", "--model", str(checkpoints["smollm3"]))
    assert code == 0, err
    assert "(NoPE)" in out
    code, out, err = run_main(capsys, "info", "--model", str(checkpoints["llama4_text"]), "--json")
    assert code == 0, err
    info = json.loads(out)
    assert [lay["attention_chunk"] for lay in info["per_layer"]] == [4, None, 4, None]
    assert info["rope"]["interleaved"] and info["rope"]["nope_layers"] == [1, 3]


_DEEPSEEK = ("deepseek_v2", "deepseek_v2-lite", "deepseek_v3", "deepseek_v3-halfrope")


def _force_path(model, absorbed: bool | None) -> None:
    for block in model.blocks:
        block.attention.absorbed = absorbed


@pytest.mark.parametrize("name", _DEEPSEEK)
def test_mla_absorbed_decode_equals_the_expanded_form(checkpoints, name):
    """The same latent cache, two computations: the per-head keys/values expanded, and the
    up-projections absorbed into the query and the output (every step, prefill too)."""
    model, _ = load_pretrained(checkpoints[name], backend="math")
    ids = _ids(20, seed=4)
    runs = {}
    for absorbed in (False, True):
        _force_path(model, absorbed)
        with torch.no_grad():
            cache = model.new_kv_cache()
            first = model(ids[:, :12], kv_cache=cache)
            steps = [model(ids[:, i : i + 1], kv_cache=cache) for i in range(12, 20)]
        assert {b.attention.last_path for b in model.blocks} == {
            "absorbed" if absorbed else "expanded"
        }
        runs[absorbed] = torch.cat([first, *steps], dim=1)
    torch.testing.assert_close(runs[True], runs[False], atol=1e-5, rtol=0)
    _force_path(model, None)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), runs[False], atol=1e-5, rtol=0)


def test_mla_caches_only_the_latent_and_the_rotary_key(checkpoints):
    from attnlab.latent import LatentKVCache

    model, _ = load_pretrained(checkpoints["deepseek_v3"])
    mla = model.config.mla
    assert (mla.kv_lora_rank, mla.qk_rope_head_dim, mla.q_lora_rank) == (16, 8, 24)
    for max_len in (None, 40):
        cache = model.new_kv_cache(max_len=max_len)
        assert all(isinstance(c, LatentKVCache) for c in cache)
        with torch.no_grad():
            model(_ids(32), kv_cache=cache)
        per_token = (16 + 8) * 4  # r + Dr fp32 numbers per layer
        held = 40 if max_len else 32  # growing: doubled from 16 to exactly 32
        assert [c.nbytes for c in cache] == [per_token * held] * 3
    assert mla.cache_bytes_per_token(3, 4) == 24 * 3 * 4
    assert mla.mha_bytes_per_token(4, 3, 4) == 4 * (20 + 10) * 3 * 4


def test_mla_explainer_sees_per_head_weights(checkpoints):
    """Tracing records the expanded form: per-head queries and keys of Dn + Dr dims and
    each head's weights, transformers' own; capture on one layer does the same."""
    from attnlab.explain import trace_model

    model, _ = load_pretrained(checkpoints["deepseek_v2"])
    ids = _ids(10, seed=5)
    trace = trace_model(model, ids[0].tolist(), queries_and_keys=True)
    with torch.no_grad():
        expected = _reference(checkpoints["deepseek_v2"])(ids, output_attentions=True)
    assert trace.weights.shape == (3, 4, 10, 10)
    assert trace.queries.shape == (3, 4, 10, 20) and trace.keys.shape == (3, 4, 10, 20)
    torch.testing.assert_close(trace.weights, torch.cat(expected.attentions), atol=1e-5, rtol=0)
    layer = model.blocks[0].attention
    layer.capture = True
    with torch.no_grad():
        model(ids[:, :6])
    assert layer.captured.shape == (1, 4, 6, 6) and layer.last_path == "expanded"
    # causal: the first 6 rows over the first 6 keys are the 6-token pass's
    torch.testing.assert_close(
        layer.captured, expected.attentions[0][:, :, :6, :6], atol=1e-5, rtol=0
    )


def test_mla_step_view_says_where_keys_and_values_come_from(checkpoints):
    """The step walk of an MLA head: its numbers are the layer's own (checked inside), its
    keys and values are said to come from the latent, and the score scale (YaRN's mscale
    here) is not called 1/sqrt(d_k)."""
    from attnlab.explain.steps import head_steps, step_sections

    model, _ = load_pretrained(checkpoints["deepseek_v2"])
    steps = head_steps(model, _ids(10, seed=5)[0].tolist(), layer=1, head=2, token=9)
    assert steps.latent is not None and steps.head_dim == 20
    assert (steps.latent.rank, steps.latent.rope_dim) == (16, 8)
    assert max(steps.checks.values()) < 1e-4, steps.checks
    for lang in ("en", "zh-TW"):
        titles = {s["id"]: s["title"] for s in step_sections(steps, lang)}
        assert "16" in titles["latent"] and "W_key" not in titles["keys"]
        assert "W_uv" in titles["values"] and "W_uk" in titles["k_nope"]
        assert "√d_k" not in titles["scale"] and f"{steps.scale:.4f}" in titles["scale"]
    assert abs(steps.scale - 20**-0.5) > 1e-3  # the mscale bites


def test_kimi_k2_is_deepseek_v3s_architecture(checkpoints, tmp_path):
    folder = _edited(checkpoints, tmp_path, "deepseek_v3", model_type="kimi_k2")
    model, _ = load_pretrained(folder)
    assert model.config.family == "deepseek_v3"
    ref = _reference(checkpoints["deepseek_v3"])
    assert_matches_reference(model, ref, _ids())


@pytest.mark.parametrize("v3", [False, True], ids=["deepseek_v2", "deepseek_v3"])
def test_grouped_routing_matches_transformers_moe(v3):
    """The module against transformers' DeepseekV2Moe / DeepseekV3MoE (grouped routing,
    V3's score correction, shared experts, routed scaling), weights copied; the score
    correction and the group limit each change which experts are chosen."""
    from transformers import AutoConfig

    family = "deepseek_v3" if v3 else "deepseek_v2"
    C, F, E = 16, 12, 8
    hf = AutoConfig.for_model(
        family,
        hidden_size=C,
        moe_intermediate_size=F,
        n_routed_experts=E,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        n_shared_experts=2,
        routed_scaling_factor=1.7,
        topk_method="noaux_tc" if v3 else "group_limited_greedy",
        norm_topk_prob=v3,
        num_attention_heads=2,
    )
    if v3:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE as Moe
    else:
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe as Moe
    torch.manual_seed(2)
    theirs = Moe(hf).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.3)
        if v3:
            theirs.gate.e_score_correction_bias.normal_(0, 0.3)
    config = MoEConfig(
        E, 3, F, router="sigmoid" if v3 else "softmax", renormalize=v3, routed_scale=1.7,
        shared_size=2 * F, groups=4, top_groups=2, group_score="top2" if v3 else "max",
        score_bias=v3,
    )  # fmt: skip
    ours = MixtureOfExperts(C, config)
    with torch.no_grad():
        ours.router.weight.copy_(theirs.gate.weight)
        if v3:
            ours.score_correction.bias.copy_(theirs.gate.e_score_correction_bias)
        F2 = theirs.experts.gate_up_proj.shape[1] // 2
        ours.experts.gate.weight.copy_(theirs.experts.gate_up_proj[:, :F2])
        ours.experts.up.weight.copy_(theirs.experts.gate_up_proj[:, F2:])
        ours.experts.down.weight.copy_(theirs.experts.down_proj)
        for name in ("gate", "up", "down"):
            getattr(ours.shared, name).weight.copy_(
                getattr(theirs.shared_experts, f"{name}_proj").weight
            )
        x = torch.randn(2, 9, C)
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=0)
        chosen = ours.last_routing.experts.sort(-1).values
        free = MixtureOfExperts(C, dataclasses.replace(config, top_groups=4, score_bias=False))
        free.load_state_dict(ours.state_dict(), strict=False)
        free(x)
        assert not torch.equal(free.last_routing.experts.sort(-1).values, chosen)


@pytest.mark.parametrize(
    ("name", "edits", "match"),
    [
        ("deepseek_v3", {"kv_lora_rank": 100}, "`kv_lora_rank` = 100 does not fit"),
        ("deepseek_v3", {"q_lora_rank": 0}, "`q_lora_rank` must be an integer >= 1"),
        ("deepseek_v2", {"kv_lora_rank": 0}, "`kv_lora_rank` must be an integer >= 1"),
        ("deepseek_v3", {"qk_rope_head_dim": 7}, "`qk_rope_head_dim` must be even"),
        ("deepseek_v3", {"num_experts_per_tok": 9}, "`num_experts_per_tok` = 9 chooses more"),
        ("deepseek_v3", {"n_group": 3}, "`n_group` \\(3\\) must divide `n_routed_experts`"),
        ("deepseek_v3", {"topk_group": 1}, "`num_experts_per_tok` \\(3\\) is more than the 2"),
        ("deepseek_v3", {"topk_group": 5}, "`topk_group` \\(5\\) must be at most `n_group`"),
        ("deepseek_v2", {"num_key_value_heads": 2}, "`num_key_value_heads` = 2 must equal"),
        ("deepseek_v2", {"norm_topk_prob": True}, "`norm_topk_prob` = True is not supported"),
        ("deepseek_v3", {"scoring_func": "softmax"}, "`scoring_func` = 'softmax' is not"),
        ("deepseek_v3", {"first_k_dense_replace": -1}, "`first_k_dense_replace` must be an"),
        ("deepseek_v3", {"routed_scaling_factor": 0}, "`routed_scaling_factor` must be"),
    ],
)
def test_deepseek_bad_configs_name_the_field(checkpoints, tmp_path, name, edits, match):
    folder = _edited(checkpoints, tmp_path, name, **edits)
    with pytest.raises(ModelFileError, match=match):
        load_pretrained(folder)


def test_info_prints_the_latent_cache_against_multi_head(checkpoints, capsys):
    """r + Dr = 24 numbers per layer (3 layers, fp32) against 4 heads x (20 + 10)."""
    folder = str(checkpoints["deepseek_v3"])
    code, out, err = run_main(capsys, "info", "--model", folder, "--json")
    assert code == 0, err
    cache = json.loads(out)["kv_cache"]
    assert cache == {
        "bytes_per_token": 24 * 3 * 4,
        "mha_bytes_per_token": 4 * 30 * 3 * 4,
        "latent": 16,
        "rotary": 8,
    }
    code, out, err = run_main(capsys, "info", "--model", folder)
    assert code == 0, err
    assert "288 B (latent 16 + rotary key 8 per layer)" in out and "1,440 B (5.0x)" in out
    code, out, err = run_main(capsys, "info", "--model", str(checkpoints["mixtral"]), "--json")
    assert code == 0, err  # grouped-query attention: 2 of 4 heads' keys and values
    assert json.loads(out)["kv_cache"] == {
        "bytes_per_token": 2 * 2 * 16 * 2 * 4,
        "mha_bytes_per_token": 4 * 2 * 16 * 2 * 4,
    }


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"groups": 3}, "`groups` \\(3\\) must divide `num_experts` \\(8\\)"),
        ({"groups": 4, "top_groups": 5}, "`top_groups` \\(5\\) must be at most `groups`"),
        ({"groups": 4, "top_groups": 1, "top_k": 3}, "`top_k` \\(3\\) is more than the 2"),
        ({"groups": 8, "top_groups": 2, "group_score": "top2"}, "needs at least 2 experts"),
        ({"group_score": "mean"}, "`group_score` must be 'max' or 'top2'"),
        ({"groups": 0}, "`groups` must be a positive int"),
    ],
)
def test_grouped_routing_config_names_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MoEConfig(**{"num_experts": 8, "top_k": 2, "expert_size": 4, **kwargs})


def test_latent_cache_and_layer_refuse_what_they_cannot_hold():
    from attnlab.attention import KVCache
    from attnlab.latent import LatentAttention, LatentKVCache, MLAConfig
    from attnlab.rope import RopeConfig

    with pytest.raises(ValueError, match="`qk_rope_head_dim` must be even"):
        MLAConfig(kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=3, v_head_dim=4)
    with pytest.raises(ValueError, match="`kv_lora_rank` must be a positive int"):
        MLAConfig(kv_lora_rank=0, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)
    mla = MLAConfig(kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)
    layer = LatentAttention(16, 2, mla, rope=RopeConfig())
    x = torch.randn(1, 5, 16)
    with pytest.raises(ValueError, match="must be a LatentKVCache"):
        layer(x, kv_cache=KVCache())
    with pytest.raises(ValueError, match="self-attention only"):
        layer(x, x)
    cache = LatentKVCache(max_len=4)
    with torch.no_grad(), pytest.raises(ValueError, match="holds 4 positions, 5 needed"):
        layer(x, is_causal=True, kv_cache=cache)
    with pytest.raises(TypeError, match="holds MLA latents"):
        LatentKVCache().update(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4))
    with pytest.raises(ValueError, match="`rope` has head_dim=8"):
        LatentAttention(16, 2, mla, rope=RotaryEmbedding(8))


def test_latent_attention_trains_through_its_cache():
    """Gradients flow through the cached latent (a growing cache concatenates)."""
    from attnlab.latent import LatentAttention, MLAConfig
    from attnlab.rope import RopeConfig

    mla = MLAConfig(kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)
    layer = LatentAttention(16, 2, mla, rope=RopeConfig(), backend="math")
    x = torch.randn(1, 6, 16, requires_grad=True)
    cache = layer.new_kv_cache()
    out = torch.cat(
        [layer(x[:, :4], is_causal=True, kv_cache=cache), layer(x[:, 4:5], kv_cache=cache)], 1
    )
    out.sum().backward()
    assert x.grad is not None and bool(x.grad[:, :5].abs().sum() > 0)
    assert layer.k_up.weight.grad is not None and layer.v_up.weight.grad is not None


def test_mla_loads_with_int8_weights_and_keeps_its_up_projections_float(checkpoints):
    """Weight quantisation replaces the linears; the per-head up-projections, multiplied
    in einsums by both forms, stay float. Cached decoding equals the full pass."""
    model, _ = load_pretrained(checkpoints["deepseek_v3"], dtype="int8")
    attention = model.blocks[0].attention
    assert type(attention.kv_down).__name__ == "Int8Linear"
    assert attention.k_up.weight.dtype == torch.float32
    ids = _ids(12, seed=6)
    with torch.no_grad():
        full = model(ids)
        cache = model.new_kv_cache(max_len=12)
        steps = [model(ids[:, :8], kv_cache=cache)]
        steps += [model(ids[:, i : i + 1], kv_cache=cache) for i in range(8, 12)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=2e-2, rtol=0)
