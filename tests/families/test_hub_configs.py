"""``config.json`` as the published checkpoints have it, not as transformers 5 re-saves it.

Each family's config is written in the shape of a real hub checkpoint (its keys and its
omissions: Llama 3.2's ``rope_scaling`` of type ``llama3``, Mistral Nemo's ``head_dim`` with
``sliding_window: null``, Qwen2.5's ``use_sliding_window: false`` with
``max_window_layers``, Phi-3's ``longrope``, Gemma 2 without ``layer_types``, Gemma 3's
``sliding_window_pattern`` and ``rope_local_base_freq``, Pythia's ``rotary_pct`` /
``rotary_emb_base``, BLOOM's ``n_head``, T5's ``feed_forward_proj``, ...), tiny sizes, random
weights; the reference is transformers reading the same directory. Then GGUF files of
the layouts llama.cpp writes that the tests elsewhere do not (a Llama-layout head dim that
is not C / H, Gemma 3).
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

if not all(importlib.util.find_spec(m) for m in ("transformers", "tokenizers", "gguf")):
    pytest.skip("needs transformers, tokenizers and gguf", allow_module_level=True)

from attnlab.models.decoder import Decoder
from attnlab.models.encoder import Encoder
from attnlab.models.encoder_decoder import EncoderDecoder
from attnlab.pretrained import load_pretrained
from model_files import assert_matches_reference, gguf_reference, tokenizer_json, write_gguf

_SMALL = {"initializer_range": 0.1}  # weights big enough that every option shows in logits

# The hub's shapes, at tiny sizes (comments: the checkpoint each one copies).
HUB: dict[str, dict] = {
    # meta-llama/Llama-3.2-1B
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": 64,
        "intermediate_size": 96,
        "max_position_embeddings": 128,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 8.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 16,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.45.0.dev0",
        "use_cache": True,
        "vocab_size": 512,
    },
    # mistralai/Mistral-Nemo-Base-2407: head_dim 128 with 5120 / 32 heads, no window
    "mistral": {
        "architectures": ["MistralForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "hidden_size": 64,
        "intermediate_size": 96,
        "max_position_embeddings": 128,
        "model_type": "mistral",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "vocab_size": 512,
    },
    # Qwen/Qwen2.5-0.5B: a window written but switched off
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 64,
        "intermediate_size": 96,
        "max_position_embeddings": 128,
        "max_window_layers": 1,
        "model_type": "qwen2",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 1,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 4,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 512,
    },
    # Qwen/Qwen3-0.6B
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "hidden_size": 64,
        "intermediate_size": 96,
        "max_position_embeddings": 128,
        "max_window_layers": 2,
        "model_type": "qwen3",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "vocab_size": 512,
    },
    # allenai/OLMo-2-0425-1B
    "olmo2": {
        "architectures": ["Olmo2ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 64,
        "intermediate_size": 96,
        "max_position_embeddings": 128,
        "model_type": "olmo2",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 4,
        "pad_token_id": 1,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 500000,
        "tie_word_embeddings": False,
        "vocab_size": 512,
    },
    # microsoft/Phi-3-mini-128k-instruct: LongRoPE in `rope_scaling` with `type`
    "phi3": {
        "architectures": ["Phi3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "embd_pdrop": 0.0,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 64,
        "intermediate_size": 96,
        "max_position_embeddings": 128,
        "model_type": "phi3",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 4,
        "original_max_position_embeddings": 16,
        "pad_token_id": 1,
        "resid_pdrop": 0.0,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "long_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 5.0, 8.0, 13.0],
            "short_factor": [1.0, 1.0, 1.1, 1.2, 1.4, 1.7, 2.1, 2.6],
            "type": "longrope",
        },
        "rope_theta": 10000.0,
        "sliding_window": 262144,
        "tie_word_embeddings": False,
        "vocab_size": 512,
    },
    # google/gemma-2-2b: no layer_types (transformers derives the alternation)
    "gemma2": {
        "architectures": ["Gemma2ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_logit_softcapping": 5.0,
        "bos_token_id": 2,
        "cache_implementation": "hybrid",
        "eos_token_id": 1,
        "final_logit_softcapping": 10.0,
        "head_dim": 16,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 64,
        "intermediate_size": 96,
        "max_position_embeddings": 128,
        "model_type": "gemma2",
        "num_attention_heads": 4,
        "num_hidden_layers": 3,
        "num_key_value_heads": 2,
        "pad_token_id": 0,
        "query_pre_attn_scalar": 24,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0,
        "sliding_window": 5,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": 512,
    },
    # google/gemma-3-1b-pt: sliding_window_pattern, no layer_types; the global layers'
    # rope_scaling (linear, as gemma-3-4b's) and the local layers' own base
    "gemma3": {
        "architectures": ["Gemma3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_logit_softcapping": None,
        "bos_token_id": 2,
        "cache_implementation": "hybrid",
        "eos_token_id": 1,
        "final_logit_softcapping": None,
        "head_dim": 32,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 64,
        "intermediate_size": 96,
        "max_position_embeddings": 128,
        "model_type": "gemma3_text",
        "num_attention_heads": 4,
        "num_hidden_layers": 4,
        "num_key_value_heads": 1,
        "pad_token_id": 0,
        "query_pre_attn_scalar": 24,
        "rms_norm_eps": 1e-06,
        "rope_local_base_freq": 100.0,
        "rope_scaling": {"factor": 2.0, "rope_type": "linear"},
        "rope_theta": 1000000.0,
        "sliding_window": 5,
        "sliding_window_pattern": 3,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 512,
    },
    # ibm-granite/granite-3.0-2b-instruct: the four multipliers
    "granite": {
        "architectures": ["GraniteForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.1,
        "attention_multiplier": 0.05,
        "bos_token_id": 0,
        "embedding_multiplier": 12.0,
        "eos_token_id": 0,
        "hidden_act": "silu",
        "hidden_size": 64,
        "intermediate_size": 96,
        "logits_scaling": 8.0,
        "max_position_embeddings": 128,
        "mlp_bias": False,
        "model_type": "granite",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "pad_token_id": 0,
        "residual_multiplier": 0.22,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "vocab_size": 512,
    },
    # bigcode/starcoder2-3b: LayerNorm with biases, a window on every layer
    "starcoder2": {
        "architectures": ["Starcoder2ForCausalLM"],
        "attention_dropout": 0.1,
        "bos_token_id": 0,
        "embedding_dropout": 0.1,
        "eos_token_id": 0,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 64,
        "initializer_range": 0.018042,
        "intermediate_size": 96,
        "max_position_embeddings": 128,
        "mlp_type": "default",
        "model_type": "starcoder2",
        "norm_epsilon": 1e-05,
        "norm_type": "layer_norm",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "residual_dropout": 0.1,
        "rope_theta": 999999.4420358813,
        "sliding_window": 6,
        "use_bias": True,
        "use_cache": True,
        "vocab_size": 512,
    },
    # stabilityai/stablelm-2-1_6b: partial rotary, LayerNorm, q/k/v biases
    "stablelm": {
        "architectures": ["StableLmForCausalLM"],
        "bos_token_id": 0,
        "eos_token_id": 0,
        "hidden_act": "silu",
        "hidden_dropout": 0.0,
        "hidden_size": 64,
        "intermediate_size": 96,
        "layer_norm_eps": 1e-05,
        "max_position_embeddings": 128,
        "model_type": "stablelm",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 4,
        "partial_rotary_factor": 0.25,
        "qk_layernorm": False,
        "rope_scaling": None,
        "rope_theta": 10000,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_parallel_residual": False,
        "use_qkv_bias": True,
        "vocab_size": 512,
    },
    # stabilityai/stablelm-2-12b: parallel residual through one norm, a LayerNorm per head
    # on queries and keys (each head its own weight)
    "stablelm-12b": {
        "architectures": ["StableLmForCausalLM"],
        "bos_token_id": 0,
        "eos_token_id": 0,
        "hidden_act": "silu",
        "hidden_size": 64,
        "intermediate_size": 96,
        "layer_norm_eps": 1e-05,
        "max_position_embeddings": 128,
        "model_type": "stablelm",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "partial_rotary_factor": 0.25,
        "qk_layernorm": True,
        "rope_theta": 10000,
        "tie_word_embeddings": False,
        "use_parallel_residual": True,
        "use_qkv_bias": False,
        "vocab_size": 512,
    },
    # EleutherAI/pythia-70m: RoPE as rotary_pct / rotary_emb_base
    "gpt_neox": {
        "architectures": ["GPTNeoXForCausalLM"],
        "bos_token_id": 0,
        "eos_token_id": 0,
        "hidden_act": "gelu",
        "hidden_size": 64,
        "intermediate_size": 96,
        "layer_norm_eps": 1e-05,
        "max_position_embeddings": 128,
        "model_type": "gpt_neox",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "rotary_emb_base": 50,
        "rotary_pct": 0.5,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "transformers_version": "4.24.0",
        "use_cache": True,
        "use_parallel_residual": True,
        "vocab_size": 512,
    },
    # bigscience/bloom-560m
    "bloom": {
        "apply_residual_connection_post_layernorm": False,
        "architectures": ["BloomForCausalLM"],
        "attention_dropout": 0.0,
        "attention_softmax_in_fp32": True,
        "bias_dropout_fusion": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_dropout": 0.0,
        "hidden_size": 64,
        "layer_norm_epsilon": 1e-05,
        "masked_softmax_fusion": True,
        "model_type": "bloom",
        "n_head": 4,
        "n_inner": None,
        "n_layer": 2,
        "offset_alibi": 100,
        "pad_token_id": 3,
        "pretraining_tp": 1,
        "skip_bias_add": True,
        "skip_bias_add_qkv": False,
        "slow_but_exact": False,
        "unk_token_id": 0,
        "use_cache": True,
        "vocab_size": 512,
    },
    # openai-community/gpt2
    "gpt2": {
        "activation_function": "gelu_new",
        "architectures": ["GPT2LMHeadModel"],
        "attn_pdrop": 0.1,
        "bos_token_id": 0,
        "embd_pdrop": 0.1,
        "eos_token_id": 2,
        "layer_norm_epsilon": 1e-05,
        "model_type": "gpt2",
        "n_ctx": 128,
        "n_embd": 64,
        "n_head": 4,
        "n_layer": 2,
        "n_positions": 128,
        "resid_pdrop": 0.1,
        "summary_activation": None,
        "summary_first_dropout": 0.1,
        "summary_proj_to_labels": True,
        "summary_type": "cls_index",
        "summary_use_proj": True,
        "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}},
        "vocab_size": 512,
    },
    # google-bert/bert-base-uncased
    "bert": {
        "architectures": ["BertForMaskedLM"],
        "attention_probs_dropout_prob": 0.1,
        "gradient_checkpointing": False,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1,
        "hidden_size": 64,
        "intermediate_size": 96,
        "layer_norm_eps": 1e-12,
        "max_position_embeddings": 128,
        "model_type": "bert",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "pad_token_id": 0,
        "position_embedding_type": "absolute",
        "transformers_version": "4.6.0.dev0",
        "type_vocab_size": 2,
        "use_cache": True,
        "vocab_size": 512,
    },
    # FacebookAI/roberta-base
    "roberta": {
        "architectures": ["RobertaForMaskedLM"],
        "attention_probs_dropout_prob": 0.1,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1,
        "hidden_size": 64,
        "intermediate_size": 96,
        "layer_norm_eps": 1e-05,
        "max_position_embeddings": 130,
        "model_type": "roberta",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "pad_token_id": 1,
        "type_vocab_size": 1,
        "vocab_size": 512,
    },
    # google-t5/t5-small: no feed_forward_proj (ReLU), no tie_word_embeddings (tied)
    "t5": {
        "architectures": ["T5ForConditionalGeneration"],
        "d_ff": 96,
        "d_kv": 16,
        "d_model": 64,
        "decoder_start_token_id": 0,
        "dropout_rate": 0.1,
        "eos_token_id": 1,
        "initializer_factor": 1.0,
        "is_encoder_decoder": True,
        "layer_norm_epsilon": 1e-06,
        "model_type": "t5",
        "n_positions": 512,
        "num_heads": 4,
        "num_layers": 2,
        "output_past": True,
        "pad_token_id": 0,
        "relative_attention_num_buckets": 32,
        "vocab_size": 512,
    },
    # google/t5-v1_1-small: feed_forward_proj "gated-gelu", no dense_act_fn / is_gated_act
    "t5-v1_1": {
        "architectures": ["T5ForConditionalGeneration"],
        "d_ff": 96,
        "d_kv": 16,
        "d_model": 64,
        "decoder_start_token_id": 0,
        "dropout_rate": 0.1,
        "eos_token_id": 1,
        "feed_forward_proj": "gated-gelu",
        "initializer_factor": 1.0,
        "is_encoder_decoder": True,
        "layer_norm_epsilon": 1e-06,
        "model_type": "t5",
        "n_positions": 512,
        "num_decoder_layers": 3,
        "num_heads": 4,
        "num_layers": 2,
        "output_past": True,
        "pad_token_id": 0,
        "relative_attention_num_buckets": 32,
        "vocab_size": 512,
    },
}
ENCODERS = ("bert", "roberta")
ENCODER_DECODERS = ("t5", "t5-v1_1")
DECODERS = tuple(f for f in HUB if f not in ENCODERS + ENCODER_DECODERS)


def _auto(name: str):
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    if name in ENCODERS:
        return AutoModel
    return AutoModelForSeq2SeqLM if name in ENCODER_DECODERS else AutoModelForCausalLM


def save_hub_dir(name: str, config: dict, folder):
    """Random weights for ``config`` saved by transformers, then ``config.json`` written back
    in the hub's shape (transformers 5 would re-save it in its own)."""
    from transformers import AutoConfig

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**config, **_SMALL}))
    torch.manual_seed(0)
    model = _auto(name).from_config(AutoConfig.from_pretrained(folder))
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "config.json").write_text(json.dumps(config))
    tokenizer_json(folder)
    return folder


def _reference(name: str, folder):
    ref = _auto(name).from_pretrained(folder, attn_implementation="eager", dtype=torch.float32)
    return ref.eval()


@pytest.fixture(scope="module")
def hub_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub-configs")
    return {name: save_hub_dir(name, config, root / name) for name, config in HUB.items()}


def _ids(batch: int = 2, length: int = 24) -> torch.Tensor:
    """Random ids of the tiny vocabulary, longer than every window and original context."""
    return torch.randint(4, 160, (batch, length), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", DECODERS)
def test_hub_config_decoder_matches_transformers_reading_the_same_directory(hub_dirs, family):
    model, _ = load_pretrained(hub_dirs[family])
    assert isinstance(model, Decoder)
    ref = _reference(family, hub_dirs[family])
    ids = _ids()
    assert_matches_reference(model, ref, ids)
    with torch.no_grad():
        assert ref(ids).logits.std() > 0.1  # not a degenerate model


@pytest.mark.parametrize("family", ENCODERS)
def test_hub_config_encoder_matches_transformers_reading_the_same_directory(hub_dirs, family):
    model, _ = load_pretrained(hub_dirs[family])
    assert isinstance(model, Encoder)
    ref = _reference(family, hub_dirs[family])
    ids = _ids()
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[1, -5:] = False  # a padded row
    with torch.no_grad():
        expected = ref(input_ids=ids, attention_mask=valid.long(), output_attentions=True)
        hidden, weights = model(ids, valid, need_weights=True)
    torch.testing.assert_close(hidden, expected.last_hidden_state, atol=1e-5, rtol=0)
    for ours, theirs in zip(weights, expected.attentions, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ENCODER_DECODERS)
def test_hub_config_t5_matches_transformers_reading_the_same_directory(hub_dirs, name):
    model, _ = load_pretrained(hub_dirs[name])
    assert isinstance(model, EncoderDecoder)
    assert model.config.gated_mlp == (name == "t5-v1_1")
    ref = _reference(name, hub_dirs[name])
    ids, dec = _ids(), _ids(2, 7)
    valid = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        out = ref(input_ids=ids, decoder_input_ids=dec, output_hidden_states=True)
        logits = model(ids, dec, valid=valid)
        hidden = model.encode(ids, valid)
    torch.testing.assert_close(hidden, out.encoder_last_hidden_state, atol=1e-5, rtol=0)
    torch.testing.assert_close(logits, out.logits, atol=1e-5, rtol=0)


# --------------------------------------------------------------------------- the three bugs


def test_gemma2_without_layer_types_alternates_local_and_global_layers(hub_dirs):
    """The hub's Gemma 2 configs have no layer_types: the even layers are local (windowed),
    the odd ones global, as transformers derives it (not a window on every layer)."""
    model, _ = load_pretrained(hub_dirs["gemma2"])
    assert model.config.layer_windows == (5, None, 5)
    assert [b.attention.sliding_window for b in model.blocks] == [5, None, 5]


def test_pythia_rotary_names_are_read(hub_dirs):
    """Pythia's rotary_emb_base and rotary_pct, not the defaults 10000 and all dims."""
    model, _ = load_pretrained(hub_dirs["gpt_neox"])
    assert model.config.rope.base == 50.0 and model.config.rope.fraction == 0.5


def test_gemma3_hub_layout_has_five_to_one_style_pattern_and_local_rope(hub_dirs):
    model, _ = load_pretrained(hub_dirs["gemma3"])
    assert model.config.layer_windows == (5, 5, None, 5)  # sliding_window_pattern 3
    ropes = [b.attention.rope for b in model.blocks]
    assert ropes[0] is ropes[1] is ropes[3] and ropes[2] is not ropes[0]
    assert ropes[0].config.base == 100.0 and ropes[0].config.scaling is None
    assert ropes[2].config.base == 1e6 and ropes[2].config.scaling is not None


# --------------------------------------------------------------------------- GGUF


def _overrides(family: str) -> dict:
    """A hub config as overrides for :func:`model_files.save_hf`."""
    drop = ("architectures", "model_type", "vocab_size", "initializer_range")
    return {k: v for k, v in HUB[family].items() if k not in drop}


GGUF_CONFIGS: dict[str, tuple[str, dict]] = {
    # A Llama-layout model whose head dim is not C / H (Mistral Nemo and its fine-tunes):
    # llama.cpp writes llama.attention.key_length / value_length and a rope dimension
    # count of the head dim.
    "llama-head-dim": (
        "llama",
        {
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "max_position_embeddings": 128,
            "tie_word_embeddings": False,
        },
    ),
    # the newer families as llama.cpp's converters write them (Granite: q/k permuted and
    # its four multipliers as keys; StarCoder2: LayerNorm biases, no window; StableLM:
    # partial rotary as rope.dimension_count)
    "granite": ("granite", _overrides("granite")),
    "starcoder2": ("starcoder2", {**_overrides("starcoder2"), "sliding_window": None}),
    "stablelm": ("stablelm", _overrides("stablelm")),
    "stablelm-12b": ("stablelm", _overrides("stablelm-12b")),
    # Gemma 3 as transformers' Gemma3TextConfig (the 270M's shape: H * D = 4 * 256 > 640)
    "gemma3": (
        "gemma3_text",
        {
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 7,  # 5 local, 1 global, 1 local
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "query_pre_attn_scalar": 32,  # llama.cpp assumes the head dim
            "sliding_window": 5,
            "max_position_embeddings": 128,
            "pad_token_id": 0,
            "eos_token_id": 1,
            "bos_token_id": 2,
        },
    ),
}


@pytest.fixture(scope="module")
def gguf_dirs(tmp_path_factory):
    from model_files import save_hf

    root = tmp_path_factory.mktemp("gguf-layouts")
    return {
        name: save_hf(model_type, config, root / name, torch.float32)
        for name, (model_type, config) in GGUF_CONFIGS.items()
    }


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
@pytest.mark.parametrize("name", sorted(GGUF_CONFIGS))
def test_gguf_layouts_match_transformers_on_the_dequantised_weights(
    gguf_dirs, tmp_path, name, qtype
):
    family = {"llama-head-dim": "llama", "stablelm-12b": "stablelm"}.get(name, name)
    path = tmp_path / f"{name}.{qtype}.gguf"
    ref = gguf_reference(gguf_dirs[name], write_gguf(gguf_dirs[name], path, family, qtype))
    model, _ = load_pretrained(path)
    assert isinstance(model, Decoder) and model.config.family == family
    if name in ("llama-head-dim", "gemma3"):
        assert model.config.head_dim == 32
    ids = _ids(2, 20)  # past the window (5) of the local layers
    assert_matches_reference(model, ref, ids)
    if qtype == "F32":  # and the same model as the Hugging Face directory
        st_model, _ = load_pretrained(gguf_dirs[name])
        with torch.no_grad():
            torch.testing.assert_close(model(ids), st_model(ids), atol=1e-5, rtol=0)


def test_gguf_gemma3_layers_follow_llama_cpp(gguf_dirs, tmp_path):
    """llama.cpp's rule for gemma3 files: 5 local layers then 1 global, the local ones
    rotating with base 10000, the global ones with the file's base."""
    path = tmp_path / "gemma3.gguf"
    write_gguf(gguf_dirs["gemma3"], path, "gemma3", "F32")
    model, _ = load_pretrained(path)
    assert model.config.layer_windows == (5, 5, 5, 5, 5, None, 5)
    assert model.config.family == "gemma3" and model.config.qk_norm is not None
    bases = [b.attention.rope.config.base for b in model.blocks]
    assert bases == [10000.0] * 5 + [1e6, 10000.0]


# --------------------------------------------------------------------------- extras


def test_loading_needs_none_of_the_test_references(hub_dirs, gguf_dirs, tmp_path):
    """`attnlab[pretrained]` leaves transformers and sentence-transformers out (they are the
    `test-ref` extra): loading files and embedding sentences must not import them."""
    import subprocess
    import sys

    write_gguf(gguf_dirs["llama-head-dim"], tmp_path / "m.gguf", "llama", "Q8_0")
    code = f"""
import sys
for name in ("transformers", "sentence_transformers"):
    sys.modules[name] = None  # any import of them raises ImportError
from attnlab.pretrained import load_pretrained
for path in {[str(hub_dirs[f]) for f in ("llama", "gemma3", "bert", "t5")]!r}:
    load_pretrained(path)
model, tok = load_pretrained({str(tmp_path / "m.gguf")!r})
print("ok", type(model).__name__)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok Decoder"


def test_gguf_gemma3_info_shows_both_rope_bases_and_the_window_pattern(gguf_dirs, tmp_path, capsys):
    import json as json_

    from cli_runner import run_main

    path = tmp_path / "gemma3.gguf"
    write_gguf(gguf_dirs["gemma3"], path, "gemma3", "Q8_0")
    code, out, err = run_main(capsys, "info", "--model", str(path), "--json", "-t", "16")
    assert code == 0, err
    data = json_.loads(out)
    assert [lay["sliding_window"] for lay in data["per_layer"]] == [5] * 5 + [None, 5]
    assert data["rope"]["base"] == 1e6 and data["rope"]["layer_bases"] == [10000.0]
    code, out, err = run_main(capsys, "info", "--model", str(path))
    assert code == 0, err
    assert "base 1e+06" in out and "some layers base" in out


def test_gemma3_multimodal_checkpoint_loads_its_text_model(tmp_path):
    """A `gemma3` (image-text) checkpoint: the text model's settings under `text_config`
    (in the hub's shape: a few keys, transformers' defaults for the rest), its weights
    beside the vision tower's, which a text model leaves out."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = {
        "hidden_size": 64,
        "intermediate_size": 96,
        "model_type": "gemma3_text",
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "query_pre_attn_scalar": 24,
        "rope_scaling": {"factor": 2.0, "rope_type": "linear"},
        "sliding_window": 5,
        "sliding_window_pattern": 3,
        "vocab_size": 512,
    }
    vision = {
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": 28,
        "patch_size": 14,
        "model_type": "siglip_vision_model",
    }
    tokens = {"image_token_index": 500, "boi_token_index": 498, "eoi_token_index": 499}
    config = Gemma3Config(
        text_config={**text, **_SMALL}, vision_config=vision, mm_tokens_per_image=4, **tokens
    )
    torch.manual_seed(0)
    Gemma3ForConditionalGeneration(config).save_pretrained(tmp_path, safe_serialization=True)
    hub = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "mm_tokens_per_image": 4,
        "text_config": text,
        "vision_config": vision,
        **tokens,
    }
    (tmp_path / "config.json").write_text(json.dumps(hub))
    tokenizer_json(tmp_path)
    model, _ = load_pretrained(tmp_path)
    assert isinstance(model, Decoder) and model.config.family == "gemma3"
    assert model.config.layer_windows == (5, 5, None, 5)
    ref = Gemma3ForConditionalGeneration.from_pretrained(
        tmp_path, attn_implementation="eager", dtype=torch.float32
    ).eval()
    assert_matches_reference(model, ref, _ids(2, 20))
