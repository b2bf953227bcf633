"""Family options beyond the defaults, each against transformers computed here: Phi-3's
LongRoPE (short and long factors, the attention factor, the switch during generation) and
GPT-2's ``scale_attn_by_inverse_layer_idx`` / ``reorder_and_upcast_attn``.

Tiny random checkpoints built with ``AutoConfig.for_model`` / ``from_config`` and saved with
``save_pretrained(safe_serialization=True)``; nothing is downloaded. References: transformers
in fp32 with eager attention.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

if not all(importlib.util.find_spec(m) for m in ("transformers", "tokenizers", "safetensors")):
    pytest.skip("needs transformers, tokenizers and safetensors", allow_module_level=True)

from attnlab.generation import generate
from attnlab.pretrained import load_pretrained
from attnlab.rope import LongRopeScaling, RopeConfig, RotaryEmbedding
from model_files import save_hf

ORIGINAL = 16  # Phi-3's original context here: prompts of 12 and 30 tokens fall either side
PHI3_LONGROPE = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "original_max_position_embeddings": ORIGINAL,
    "rope_parameters": {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,  # R = 8 of D = 16: 4 factors each
        "short_factor": [1.0, 1.3, 2.1, 3.7],
        "long_factor": [1.5, 4.0, 9.0, 23.0],
    },
    "pad_token_id": 1,
    "eos_token_id": 2,
}


def _reference(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="eager", dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def phi3_longrope(tmp_path_factory):
    return save_hf("phi3", PHI3_LONGROPE, tmp_path_factory.mktemp("phi3") / "m", torch.float32)


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (2, n), generator=g)


def test_longrope_frequencies_match_transformers():
    """inv_freq and the attention factor of transformers' _compute_longrope_parameters, for
    a sequence inside the original context and one past it; the default attention factor
    from max/original, and an explicit one."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for extra in ({}, {"attention_factor": 0.7}, {"factor": 3.0}):
        params = {**PHI3_LONGROPE["rope_parameters"], **extra}
        hf = AutoConfig.for_model("phi3", **{**PHI3_LONGROPE, "rope_parameters": params})
        rope = RopeConfig.from_hf_config(hf.to_dict())
        assert isinstance(rope.scaling, LongRopeScaling)
        assert rope.scaling.original_max_position_embeddings == ORIGINAL
        for seq_len in (None, ORIGINAL, ORIGINAL + 1, 50):
            inv, factor = ROPE_INIT_FUNCTIONS["longrope"](hf, None, seq_len=seq_len)
            ours, our_factor = rope.scaling.frequencies(rope.base, 8, seq_len)
            torch.testing.assert_close(ours.float(), inv, rtol=1e-6, atol=0)
            assert our_factor == pytest.approx(factor, rel=1e-12)
        assert factor != 1.0  # the factor bites (max 64 / original 16, or the explicit one)


def test_longrope_embedding_switches_factors_by_the_calls_longest_position():
    scaling = LongRopeScaling((1.0, 2.0), (4.0, 8.0), original_max_position_embeddings=6)
    rope = RotaryEmbedding(4, scaling=scaling)
    assert rope.switch_length == 6 and rope.length_dependent
    short_cos, _ = rope.cos_sin(torch.arange(6))
    long_cos, _ = rope.cos_sin(torch.arange(7))
    a = scaling.resolved_attention_factor()
    inv_short = 1.0 / (10000.0 ** (torch.arange(0, 4, 2, dtype=torch.float64) / 4)) / 1.0
    torch.testing.assert_close(short_cos[1, :2], (inv_short / torch.tensor([1.0, 2.0])).cos() * a)
    torch.testing.assert_close(long_cos[1, :2], (inv_short / torch.tensor([4.0, 8.0])).cos() * a)
    again, _ = rope.cos_sin(torch.arange(3))  # back inside: the short factors again
    torch.testing.assert_close(again, short_cos[:3])


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: LongRopeScaling((1.0,), (1.0, 2.0), 8), "same length"),
        (lambda: LongRopeScaling((1.0, -1.0), (1.0, 2.0), 8), "short_factor"),
        (lambda: LongRopeScaling([1.0], [1.0], 8), "short_factor"),  # type: ignore[arg-type]
        (lambda: LongRopeScaling((1.0,), (1.0,), 0), "original_max_position_embeddings"),
        (lambda: RotaryEmbedding(8, scaling=LongRopeScaling((1.0,), (1.0,), 8)), "R/2"),
        (
            lambda: RopeConfig.from_hf_config(
                {
                    "original_max_position_embeddings": 8,
                    "rope_scaling": {"type": "longrope", "short_factor": [1.0]},
                }
            ),
            "long_factor",
        ),
    ],
)
def test_longrope_bad_input_names_the_argument(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


@pytest.mark.parametrize("length", [12, 30], ids=["short prompt", "long prompt"])
def test_phi3_longrope_logits_match_transformers(phi3_longrope, length):
    model, _ = load_pretrained(phi3_longrope)
    assert isinstance(model.config.rope.scaling, LongRopeScaling)
    ref = _reference(phi3_longrope)
    ids = _ids(length)
    with torch.no_grad():
        expected = ref(ids, output_attentions=True)
        logits, weights = model(ids, need_weights=True)
        # the other length first: the factors follow each call, not the history
        model(_ids(42 - length, seed=1))
        again = model(ids)
    torch.testing.assert_close(logits, expected.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(again, expected.logits, atol=1e-5, rtol=0)
    for ours, theirs in zip(weights, expected.attentions, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


def test_phi3_longrope_short_and_long_factors_give_different_logits(phi3_longrope):
    """The test above can fail: the first 12 positions of a 30-token prompt are rotated with
    the long factors, so their logits differ from the 12-token prompt's."""
    model, _ = load_pretrained(phi3_longrope)
    ids = _ids(30)
    with torch.no_grad():
        head = model(ids[:, :12])
        within_long = model(ids)[:, :12]
    assert (head - within_long).abs().max() > 1e-3


def test_phi3_longrope_generation_crosses_the_switch_like_transformers(phi3_longrope):
    """A 12-token prompt and 20 new tokens cross the original 16: attnlab rebuilds its cache
    once at the switch (as transformers' Phi-3 drops its own), so the cached tokens equal
    the uncached ones and transformers' generate."""
    model, _ = load_pretrained(phi3_longrope)
    ref = _reference(phi3_longrope)
    ids = _ids(12)
    ours = generate(model, ids, 20)
    uncached = generate(model, ids, 20, use_cache=False)
    with torch.no_grad():
        theirs = ref.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=20,
            do_sample=False,
            pad_token_id=1,
            eos_token_id=None,
        )
    assert ours.tolist() == uncached.tolist() == theirs.tolist()
    assert model._decode_plan is not None  # the one-token steps took the fast path
    # the server's generation (the model itself, on_logits for its bars) crosses it too
    seen: list[torch.Tensor] = []
    assert generate(model, ids, 20, on_logits=seen.append).tolist() == theirs.tolist()
    assert len(seen) == 20


@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
def test_phi3_longrope_cached_decoding_equals_the_full_pass_on_each_side(phi3_longrope, static):
    """Past the switch (prefill 26 of 30, then 4 steps) and before it (prefill 8 of 12)."""
    model, _ = load_pretrained(phi3_longrope, backend="math")
    for n in (12, 30):
        ids = _ids(n)
        with torch.no_grad():
            full = model(ids)
            cache = model.new_kv_cache(max_len=n) if static else model.new_kv_cache()
            first = model(ids[:, :-4], kv_cache=cache)
            steps = [model(ids[:, i : i + 1], kv_cache=cache) for i in range(n - 4, n)]
        torch.testing.assert_close(torch.cat([first, *steps], dim=1), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_phi3_longrope_gguf_equals_the_safetensors_load(phi3_longrope, tmp_path, qtype):
    """The checkpoint written as llama.cpp's Phi3MiniModel writes a longrope model
    (``rope_factors_long`` / ``_short`` tensors, ``rope.scaling.original_context_length``,
    ``rope.scaling.attn_factor``): the same LongRoPE config, and logits on both sides of
    the switch within 1e-5 of transformers on the weights the file holds (F32: of the
    safetensors load)."""
    from model_files import write_gguf

    reference = write_gguf(phi3_longrope, tmp_path / "m.gguf", "phi3", qtype)
    model, _ = load_pretrained(tmp_path / "m.gguf")
    hf_model, _ = load_pretrained(phi3_longrope)
    ours, theirs = model.config.rope.scaling, hf_model.config.rope.scaling
    assert isinstance(ours, LongRopeScaling) and isinstance(theirs, LongRopeScaling)
    assert ours.short_factor == pytest.approx(theirs.short_factor)
    assert ours.long_factor == pytest.approx(theirs.long_factor)
    assert ours.original_max_position_embeddings == ORIGINAL
    assert ours.resolved_attention_factor() == pytest.approx(
        theirs.resolved_attention_factor(), rel=1e-6
    )
    ref = _reference(phi3_longrope)
    ref.load_state_dict(reference, strict=False)
    for n in (12, 30):
        ids = _ids(n)
        with torch.no_grad():
            torch.testing.assert_close(model(ids), ref(ids).logits, atol=1e-5, rtol=0)
            if qtype == "F32":
                torch.testing.assert_close(model(ids), hf_model(ids), atol=1e-5, rtol=0)


# --------------------------------------------------------------------------- GPT-2 options

GPT2 = {"n_embd": 64, "n_layer": 3, "n_head": 4, "n_positions": 64}
GPT2_OPTIONS = {
    "inverse layer idx": {"scale_attn_by_inverse_layer_idx": True},
    "upcast": {"reorder_and_upcast_attn": True},
    "both": {"scale_attn_by_inverse_layer_idx": True, "reorder_and_upcast_attn": True},
    "unscaled": {"scale_attn_weights": False, "scale_attn_by_inverse_layer_idx": True},
}


@pytest.fixture(scope="module")
def gpt2_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt2")
    return {
        name: save_hf("gpt2", {**GPT2, **extra}, root / name.replace(" ", "-"), torch.float32)
        for name, extra in GPT2_OPTIONS.items()
    }


@pytest.mark.parametrize("option", sorted(GPT2_OPTIONS))
def test_gpt2_score_options_match_transformers(gpt2_dirs, option):
    """Logits and every layer's weights within 1e-5 of GPT2LMHeadModel (eager, which takes
    its `_upcast_and_reordered_attn` path for reorder_and_upcast_attn), 12 greedy tokens
    equal to its generate (through attnlab's fast step), and cached decoding equal to the
    full pass."""
    folder = gpt2_dirs[option]
    model, _ = load_pretrained(folder)
    ref = _reference(folder)
    ids = _ids(20)
    scaled = GPT2_OPTIONS[option].get("scale_attn_weights", True)
    inverse = GPT2_OPTIONS[option].get("scale_attn_by_inverse_layer_idx", False)
    base = 16**-0.5 if scaled else 1.0
    scales = [block.attention.scale for block in model.blocks]
    assert scales == ([base / (i + 1) for i in range(3)] if inverse else [None] * 3)
    with torch.no_grad():
        expected = ref(ids, output_attentions=True)
        logits, weights = model(ids, need_weights=True)
        cache = model.new_kv_cache(max_len=20)
        first = model(ids[:, :-3], kv_cache=cache)
        steps = [model(ids[:, i : i + 1], kv_cache=cache) for i in range(17, 20)]
        theirs = ref.generate(
            ids[:1, :8],
            attention_mask=torch.ones_like(ids[:1, :8]),
            max_new_tokens=12,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    torch.testing.assert_close(logits, expected.logits, atol=1e-5, rtol=0)
    for ours, their in zip(weights, expected.attentions, strict=True):
        torch.testing.assert_close(ours, their, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.cat([first, *steps], dim=1), logits, atol=1e-5, rtol=0)
    assert generate(model, ids[:1, :8], 12).tolist() == theirs.tolist()
    assert model._decode_plan is not None


def test_gpt2_inverse_layer_scale_changes_the_logits(gpt2_dirs):
    """The test above can fail: the same weights with every layer at 1/sqrt(D) differ."""
    import dataclasses

    from attnlab.models.decoder import Decoder

    model, _ = load_pretrained(gpt2_dirs["inverse layer idx"])
    plain = Decoder(dataclasses.replace(model.config, layer_scales=None))
    plain.load_state_dict(model.state_dict())
    ids = _ids(20)
    with torch.no_grad():
        assert (model(ids) - plain.eval()(ids)).abs().max() > 1e-3


def test_gpt2_score_switch_of_the_wrong_type_is_named(gpt2_dirs, tmp_path):
    import json
    import shutil

    from attnlab.pretrained import ModelFileError

    folder = tmp_path / "bad"
    shutil.copytree(gpt2_dirs["upcast"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["scale_attn_by_inverse_layer_idx"] = "yes"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFileError, match="scale_attn_by_inverse_layer_idx"):
        load_pretrained(folder)
