"""Bring your own model: tiny random checkpoints of every family, built and saved with
transformers in this test session, loaded with attnlab, compared with transformers.

Each family's awkward options are on: one kv head (llama, qwen2), a sliding window shorter
than the prompt (mistral), q/k/v biases (llama's attention_bias, qwen2), untied and tied
heads, GPT-2's fused Conv1D projections, RoBERTa's padding-aware positions.
References: transformers in fp32 with eager attention, computed here.
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

import itertools

from attnlab.explain import trace_model
from attnlab.generation import generate
from attnlab.models.decoder import Decoder
from attnlab.models.encoder import Encoder
from attnlab.pretrained import load_pretrained
from model_files import (
    CORPUS,
    TINY_CONFIGS,
    TINY_ENCODERS,
    assert_matches_reference,
    save_hf,
    tiny_config,
    tokenizer_json,
)

# family -> config overrides (small but not trivial; the awkward options on): the one table
DECODERS = {f: tiny_config(f) for f in TINY_CONFIGS if f not in TINY_ENCODERS}
ENCODERS = {f: tiny_config(f) for f in TINY_ENCODERS}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (fp32 dir, bf16 dir), built once per module."""
    root = tmp_path_factory.mktemp("families")
    out = {}
    for family, overrides in {**DECODERS, **ENCODERS}.items():
        enc = family in ENCODERS
        out[family] = (
            save_hf(family, overrides, root / f"{family}-fp32", torch.float32, encoder=enc),
            save_hf(family, overrides, root / f"{family}-bf16", torch.bfloat16, encoder=enc),
        )
    return out


def _reference(folder, family: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModel, AutoModelForCausalLM

    auto = AutoModel if family in ENCODERS else AutoModelForCausalLM
    return auto.from_pretrained(folder, attn_implementation="eager", dtype=dtype).eval()


def _prompt(tok) -> torch.Tensor:
    ids = tok.encode(CORPUS[1] + " " + CORPUS[2])
    assert len(ids) > 12  # longer than mistral's window of 5
    return torch.tensor([ids])


# --------------------------------------------------------------------------- decoders


@pytest.mark.parametrize("family", sorted(DECODERS))
def test_decoder_logits_and_every_attention_match_transformers(checkpoints, family):
    model, tok = load_pretrained(checkpoints[family][0])
    assert isinstance(model, Decoder) and model.config.family == family
    ref = _reference(checkpoints[family][0], family)
    ids = _prompt(tok)
    with torch.no_grad():
        expected = ref(ids, output_attentions=True)
        logits, weights = model(ids, need_weights=True)
        logits_fast = model(ids)
    torch.testing.assert_close(logits, expected.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(logits_fast, expected.logits, atol=1e-5, rtol=0)
    assert expected.logits.std() > 0.1  # not a degenerate model
    assert len(weights) == len(expected.attentions) == model.config.num_layers
    for ours, theirs in zip(weights, expected.attentions, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    if family == "mistral":  # the window is in force: early keys get no weight
        assert bool((weights[0][0, :, -1, : ids.shape[1] - 5] == 0).all())
    if family in ("qwen2", "qwen3"):  # layer 0 global, the layers after it windowed
        assert model.config.layer_windows[0] is None
        assert set(model.config.layer_windows[1:]) == {5}
        assert bool((weights[0][0, :, -1, : ids.shape[1] - 5] > 0).all())
        assert bool((weights[1][0, :, -1, : ids.shape[1] - 5] == 0).all())


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
@pytest.mark.parametrize(
    "edit", ["no layer_types", "use_sliding_window off", "max_window_layers 0"]
)
def test_qwen_window_rule_from_older_configs_matches_transformers(
    checkpoints, tmp_path, family, edit
):
    """transformers-4-style config.json (no `layer_types`): the windowed layers follow from
    `use_sliding_window` and `max_window_layers`, as transformers derives them."""
    import json
    import shutil

    folder = tmp_path / family
    shutil.copytree(checkpoints[family][0], folder)
    config = json.loads((folder / "config.json").read_text())
    del config["layer_types"]
    if edit == "use_sliding_window off":
        config["use_sliding_window"] = False  # the 5 stays in the file, unused
    elif edit == "max_window_layers 0":
        config["max_window_layers"] = 0
    (folder / "config.json").write_text(json.dumps(config))
    model, tok = load_pretrained(folder)
    ref = _reference(folder, family)
    expected_windows = {
        "no layer_types": (None, *[5] * (model.config.num_layers - 1)),
        "use_sliding_window off": None,
        "max_window_layers 0": (5,) * model.config.num_layers,
    }[edit]
    assert model.config.layer_windows == expected_windows or (
        expected_windows is None and model.config.sliding_window is None
    )
    ids = _prompt(tok)
    assert_matches_reference(model, ref, ids)


@pytest.mark.parametrize("family", sorted(DECODERS))
def test_decoder_greedy_tokens_match_transformers_generate(checkpoints, family):
    model, tok = load_pretrained(checkpoints[family][0])
    ref = _reference(checkpoints[family][0], family)
    ids = _prompt(tok)
    ours = generate(model, ids, 20)
    with torch.no_grad():
        theirs = ref.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=20,
            do_sample=False,
            pad_token_id=tok.pad_id,
            eos_token_id=None,
        )
    assert ours.tolist() == theirs.tolist()
    assert len(set(ours[0, ids.shape[1] :].tolist())) > 1
    # ... decoded by the fast one-token step (every layout but ALiBi's)
    assert (model._decode_plan is not None) == (family != "bloom")


@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
@pytest.mark.parametrize("family", sorted(DECODERS))
def test_decoder_cached_decoding_equals_the_full_pass(checkpoints, family, static):
    # static: the one-token steps take the fast decode step (not bloom's ALiBi)
    model, tok = load_pretrained(checkpoints[family][0], backend="math")
    ids = _prompt(tok)
    with torch.no_grad():
        full = model(ids)
        cache = model.new_kv_cache(max_len=ids.shape[1]) if static else model.new_kv_cache()
        first = model(ids[:, :-4], kv_cache=cache)
        steps = [
            model(ids[:, i : i + 1], kv_cache=cache) for i in range(ids.shape[1] - 4, ids.shape[1])
        ]
    torch.testing.assert_close(torch.cat([first, *steps], dim=1), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
@pytest.mark.parametrize("family", sorted(DECODERS))
def test_decoder_prompt_in_chunks_equals_the_full_pass(checkpoints, family, static):
    """A prompt fed through the cache a few positions at a time (chunks longer and shorter
    than mistral's window of 5) gives the logits of one pass over it."""
    model, tok = load_pretrained(checkpoints[family][0], backend="math")
    ids = _prompt(tok)
    T = ids.shape[1]
    with torch.no_grad():
        full = model(ids)
        cache = model.new_kv_cache(max_len=T) if static else model.new_kv_cache()
        cuts = [0, 3, 10, 11, 13, T]
        parts = [model(ids[:, a:b], kv_cache=cache) for a, b in itertools.pairwise(cuts)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", sorted(DECODERS))
def test_decoder_trace_model_gives_the_model_attention(checkpoints, family):
    model, tok = load_pretrained(checkpoints[family][0])
    ids = _prompt(tok)
    trace = trace_model(model, ids, tokenizer=tok)
    with torch.no_grad():
        _, weights = model(ids, need_weights=True)
    assert trace.num_layers == model.config.num_layers
    for layer, w in enumerate(weights):
        torch.testing.assert_close(trace.weights[layer], w[0], atol=1e-6, rtol=0)


@pytest.mark.parametrize("family", sorted(DECODERS))
def test_decoder_bf16_checkpoint(checkpoints, family):
    """bf16 weights read into fp32 equal transformers' fp32 on the same weights; run in
    bf16, attnlab is no further from fp32 than transformers' own bf16 run (x1.5)."""
    folder = checkpoints[family][1]
    ref = _reference(folder, family, torch.float32)
    model, tok = load_pretrained(folder)
    ids = _prompt(tok)
    with torch.no_grad():
        expected = ref(ids).logits
        torch.testing.assert_close(model(ids), expected, atol=1e-5, rtol=0)
        model16, _ = load_pretrained(folder, dtype=torch.bfloat16)
        assert next(model16.parameters()).dtype == torch.bfloat16
        logits16 = model16(ids)
        theirs16 = _reference(folder, family, torch.bfloat16)(ids).logits
    assert logits16.dtype == theirs16.dtype == torch.bfloat16
    ours_err = (logits16.float() - expected).abs().max()
    their_err = (theirs16.float() - expected).abs().max()
    assert 0 < ours_err <= 1.5 * their_err, (ours_err, their_err)


@pytest.mark.parametrize("dtype_dir", [0, 1], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["gpt2", "phi3", "qwen2"])
def test_loading_copies_no_weight_and_the_step_fuses_what_the_file_stored_fused(
    checkpoints, family, dtype_dir
):
    """Read in the file's dtype, every parameter is a view of the file (GPT-2's Conv1D
    weights transposed views, Phi-3's qkv_proj / gate_up_proj and GPT-2's c_attn split
    into row blocks); the fast step is built at the first decode. Then GPT-2's c_attn
    (column-major as stored) is its fused QKV product as it is, and in bf16 so are Phi-3's
    fused tensors and Qwen2's gate_proj + up_proj (side by side in the file); fp32 ones
    are copied once into column-major memory (attnlab.quant.column_major)."""
    dtype = (torch.float32, torch.bfloat16)[dtype_dir]
    model, _ = load_pretrained(checkpoints[family][dtype_dir], dtype=dtype)
    assert model._decode_plan is None  # built at the first one-token step
    file_storage = model.tok_embeddings.weight.untyped_storage().data_ptr()
    for name, p in model.named_parameters():
        assert p.untyped_storage().data_ptr() == file_storage, name
    plan = model.prepare_decode()
    assert plan.share_float  # what the loader asked for
    for layer in plan.layers:
        fused = [layer.qkv] + ([layer.gate_up] if family != "gpt2" else [])
        for product in fused:
            in_file = product.weight.untyped_storage().data_ptr() == file_storage
            column_major = product.weight.stride(0) == 1
            if dtype == torch.bfloat16:
                # Qwen2's q, k, v are not adjacent in the file (k_proj, o_proj, q_proj,
                # v_proj): copied into one
                assert in_file == (product is layer.gate_up or family != "qwen2")
            else:
                assert column_major and in_file == (family == "gpt2")


# --------------------------------------------------------------------------- encoders


@pytest.mark.parametrize("family", sorted(ENCODERS))
@pytest.mark.parametrize("dtype_dir", [0, 1], ids=["fp32", "bf16"])
def test_encoder_hidden_states_and_weights_on_a_padded_batch(checkpoints, family, dtype_dir):
    folder = checkpoints[family][dtype_dir]
    model, tok = load_pretrained(folder)
    assert isinstance(model, Encoder)
    ref = _reference(folder, family)
    ids, valid = tok.batch(CORPUS)
    assert not bool(valid.all())
    with torch.no_grad():
        expected = ref(input_ids=ids, attention_mask=valid.long(), output_attentions=True)
        hidden, weights = model(ids, valid, need_weights=True)
    torch.testing.assert_close(hidden, expected.last_hidden_state, atol=1e-5, rtol=0)
    for ours, theirs in zip(weights, expected.attentions, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


# --------------------------------------------------------------------------- tokenizer


def test_tokenizer_json_matches_transformers_fast_tokenizer(checkpoints):
    from transformers import PreTrainedTokenizerFast

    folder = checkpoints["llama"][0]
    _, tok = load_pretrained(folder)
    ref = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    for text in [*CORPUS, "  spaces\tand\nnew lines", "Ünïcödé 🙂"]:
        assert tok.encode(text) == ref.encode(text)
        assert tok.decode(tok.encode(text)) == text
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 2, 1)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<s>hi</s>"


def test_sharded_checkpoint_loads_like_the_single_file(checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(checkpoints["llama"][0])
    ref.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
    tokenizer_json(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    sharded, tok = load_pretrained(tmp_path)
    single, _ = load_pretrained(checkpoints["llama"][0])
    ids = _prompt(tok)
    with torch.no_grad():
        assert torch.equal(sharded(ids), single(ids))
