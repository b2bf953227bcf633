"""llama.cpp's own converter and quantizer as fixtures: GGUF files nobody here wrote.

Tiny random checkpoints of every family attnlab reads from GGUF are saved by transformers,
converted by llama.cpp's ``convert_hf_to_gguf.py`` (``--outtype f32, f16, bf16, q8_0``) and
quantised by ``llama-quantize`` from the f32 file (F16 ... IQ4_XS). Each file is loaded by
attnlab and by a reference that attnlab did not produce:

- transformers reading the same GGUF file (``from_pretrained(dir, gguf_file=...)``), where
  transformers can read the architecture;
- otherwise (OLMo 2, GPT-NeoX, Granite, gpt-oss) transformers' model of the Hugging Face
  directory the file came from, with every weight replaced by gguf-py's dequantisation of
  the file's tensor (the converter's q/k/v reordering, q/k row permutation and gpt-oss's
  expert split undone): the same numbers, so the same tolerance.

Both references dequantise with gguf-py's numpy code, attnlab with its own; the logits
agree to float32 rounding, which a wrong block layout, scale or name map would break by
O(1). The widths are multiples of 256 so that every K-quant and IQ4_XS applies as named
(``llama-quantize`` falls back to other types for rows that are not).

The tools are built by ``python benchmarks/peers/llama_cpp.py`` (CI does); without them
these tests skip.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[2]

if not all(
    importlib.util.find_spec(m) for m in ("transformers", "tokenizers", "gguf", "sentencepiece")
):
    pytest.skip("needs transformers, tokenizers, gguf and sentencepiece", allow_module_level=True)


def _peer_module():
    spec = importlib.util.spec_from_file_location(
        "peer_llama_cpp", ROOT / "benchmarks" / "peers" / "llama_cpp.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


PEER_TOOLS = _peer_module()
PEER = PEER_TOOLS.find()
if PEER is None:
    pytest.skip(
        "llama.cpp is not built: run `python benchmarks/peers/llama_cpp.py` (builds it into "
        "$ATTNLAB_PEERS/llama.cpp or ~/.cache/attnlab/peers/llama.cpp)",
        allow_module_level=True,
    )

from attnlab.models.families import FAMILIES, family_for  # noqa: E402
from attnlab.pretrained import load_pretrained  # noqa: E402
from model_files import (  # noqa: E402
    gguf_read_once,
    gpt2_tokenizer,
    save_hf,
    score_correction,
    spm_tokenizer,
)

# converting and quantising every family takes minutes: slow, like the long grids
pytestmark = [pytest.mark.llamacpp, pytest.mark.slow]

# Every width a 2-D weight's rows run over (hidden, intermediate, heads x head dim) is a
# multiple of 256, the K-quants' block. Two layers, four heads, two KV heads where the
# family has them. SentencePiece families get a 320-token vocabulary; GPT-2 BPE needs its
# 50257 (the converter recognises the tokenizer by its ids).
_DIMS = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 256,
}
_GQA = {**_DIMS, "num_key_value_heads": 2}
_SPM = {"vocab_size": 320, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
_BPE = {"vocab_size": 50257, "bos_token_id": 50256, "eos_token_id": 50256}
_GPT_OSS = {
    "head_dim": 64,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": 8,
    "rope_parameters": {
        "rope_type": "yarn",
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": True,
        "original_max_position_embeddings": 64,
        "rope_theta": 150000.0,
    },
}
_NEOX_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}


@dataclass(frozen=True)
class Case:
    """One checkpoint of the corpus.

    Attributes:
        model_type: transformers' ``model_type``.
        config: the config's fields (transformers' names).
        tokenizer: ``"spm"`` (a SentencePiece ``tokenizer.model``) or ``"gpt2"`` (GPT-2's
            BPE as ``tokenizer.json``), whichever llama.cpp's converter reads for the family.
        hub: keys added to the saved ``config.json`` as the hub's checkpoints have them
            (transformers 5 no longer writes them; llama.cpp's converter reads them).
        mxfp4_experts: the experts saved as the hub's gpt-oss checkpoints hold them,
            MXFP4 ``_blocks`` / ``_scales`` pairs (random codes), which the converter
            repacks into GGUF's MXFP4 whatever the outtype.
    """

    model_type: str
    config: dict
    tokenizer: str = "spm"
    hub: dict = field(default_factory=dict)
    mxfp4_experts: bool = False


# The case name is the family's, plus a suffix for a second layout of the same family.
CORPUS: dict[str, Case] = {
    "llama": Case("llama", {**_GQA, **_SPM, "tie_word_embeddings": False}),
    # Mistral Nemo's layout: head_dim 128 with hidden 256 / 4 heads (64): the file says
    # attention.key_length / value_length = 128 and rope.dimension_count = 128.
    "llama-head-dim": Case("llama", {**_GQA, **_SPM, "head_dim": 128}),
    # one KV head for four query heads, Mistral's RoPE base
    "mistral": Case(
        "mistral",
        {**_DIMS, **_SPM, "num_key_value_heads": 1, "rope_theta": 1e6, "sliding_window": None},
    ),
    # transformers 5 tokenizes a Qwen2 directory with its own pre-tokenizer whatever
    # tokenizer_config.json names, which llama.cpp does not recognise: SentencePiece then.
    "qwen2": Case("qwen2", {**_GQA, **_SPM, "tie_word_embeddings": True}),
    # transformers' GGUF reader takes Qwen3's head_dim from its config default (128)
    "qwen3": Case("qwen3", {**_GQA, **_SPM, "head_dim": 128}),
    # transformers' GGUF reader takes query_pre_attn_scalar and the softcaps from Gemma 2's
    # config defaults (256, 50, 30): the checkpoint uses those; the window (8) bites on
    # the 24-token input, on the even layers.
    "gemma2": Case(
        "gemma2",
        {**_GQA, **_SPM, "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 8},
    ),
    # Gemma 3: six layers, five local (window 8) then one global, QK-norm, the local
    # layers' own RoPE base; query_pre_attn_scalar and the bases at transformers' defaults,
    # which its GGUF reader assumes
    "gemma3": Case(
        "gemma3_text",
        {**_GQA, **_SPM, "num_hidden_layers": 6, "head_dim": 256, "sliding_window": 8},
    ),
    # Granite's four multipliers (llama.cpp: attention/embedding/residual/logit scale)
    "granite": Case(
        "granite",
        {
            **_GQA,
            **_SPM,
            "embedding_multiplier": 2.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.1,
            "logits_scaling": 4.0,
        },
    ),
    "phi3": Case("phi3", {**_GQA, **_SPM, "tie_word_embeddings": False}),
    "olmo2": Case("olmo2", {**_GQA, **_BPE, "tie_word_embeddings": True}, "gpt2"),
    "gpt_neox": Case(
        "gpt_neox",
        {**_DIMS, **_BPE, "rope_parameters": _NEOX_ROPE, "tie_word_embeddings": True},
        "gpt2",
        hub={"rotary_pct": 0.25, "rotary_emb_base": 10000},
    ),
    # StarCoder 2: LayerNorm and every projection with biases
    "starcoder2": Case("starcoder2", {**_GQA, **_BPE}, "gpt2"),
    # StableLM: partial rotary (0.25), LayerNorm, q/k/v biases
    "stablelm": Case("stablelm", {**_GQA, **_BPE, "use_qkv_bias": True}, "gpt2"),
    "bloom": Case("bloom", {"hidden_size": 256, "n_layer": 2, "n_head": 4, **_BPE}, "gpt2"),
    # gpt-oss: sinks, windows of 8 on the even layers (they bite on the 24-token input),
    # biases, YaRN x4 over 64 positions (the ramp's ends rounded, as llama.cpp does), top-2
    # of 4 experts with biases and the clamped SwiGLU; llama-quantize's MXFP4_MOE makes
    # the MXFP4 experts (test_gpt_oss_mxfp4_moe_file_loads_with_the_files_weights)
    "gpt_oss": Case("gpt_oss", {**_GQA, **_BPE, **_GPT_OSS}, "gpt2"),
    # the same with the hub's MXFP4 experts: llama.cpp's converter repacks them
    "gpt_oss-mxfp4": Case(
        "gpt_oss",
        {**_GQA, **_BPE, **_GPT_OSS},
        "gpt2",
        hub={"quantization_config": {"quant_method": "mxfp4"}},
        mxfp4_experts=True,
    ),
    # transformers' GGUF reader sizes the position table by GPT-2's default (1024)
    "gpt2": Case(
        "gpt2",
        {"n_embd": 256, "n_layer": 2, "n_head": 4, "n_positions": 1024, **_BPE},
        "gpt2",
        hub={"n_ctx": 1024},
    ),
    # The newest families, each as llama.cpp runs its files (what the file cannot say is
    # what llama.cpp assumes, and the checkpoint does the same). The experts' width (512)
    # differs from the hidden size (256) so that a transposed expert tensor cannot fit.
    # Mixtral: written as architecture "llama" with expert_count; no window
    "mixtral": Case(
        "mixtral",
        {**_GQA, **_SPM, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
    ),
    # Qwen3-MoE: experts on every layer, renormalised (llama.cpp's qwen3moe always does);
    # the converter needs a BPE tokenizer for it
    "qwen3_moe": Case(
        "qwen3_moe",
        {
            **_GQA,
            **_BPE,
            "head_dim": 128,
            "moe_intermediate_size": 512,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
        },
        "gpt2",
    ),
    # SmolLM3: four layers, the 4th NoPE (llama.cpp's fixed rule), no window
    "smollm3": Case("smollm3", {**_GQA, **_SPM, "num_hidden_layers": 4}),
    # Llama 4: layers 1 and 3 route (top 2 of 4, a shared expert), 3 NoPE; chunks of 8192
    # and temperature tuning at llama.cpp's fixed values (transformers' defaults); dense
    # layers 768 wide
    "llama4_text": Case(
        "llama4_text",
        {
            **_GQA,
            **_BPE,
            "num_hidden_layers": 4,
            "head_dim": 64,
            "intermediate_size_mlp": 768,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "interleave_moe_layer_step": 2,
        },
        "gpt2",
    ),
}

# llama.cpp's converter writes these itself (--outtype); llama-quantize makes the rest
# from the converter's f32 file.
CONVERTER_TYPES = ("f32", "f16", "bf16", "q8_0")


def converter_types(case: str) -> tuple[str, ...]:
    """The outtypes ``case`` is converted to. f16 and bf16 hold each tensor's values in
    another float type, read alike whatever the family: the SentencePiece cases check them.
    A GPT-2 BPE case (50,257 tokens and 50,000 merges: seconds more per file to convert and
    read) is converted to f32 (the family's names and transforms, and the checkpoint's own
    logits) and q8_0 (the converter's own codes, through the family's row transforms)."""
    return CONVERTER_TYPES if CORPUS[case].tokenizer == "spm" else ("f32", "q8_0")


QUANT_TYPES = (
    "F16", "BF16", "Q8_0", "Q5_0", "Q5_1", "Q4_K_M", "Q5_K_M", "Q6_K", "Q3_K_M", "Q2_K",
    "IQ4_NL", "IQ4_XS",
)  # fmt: skip
# The types attnlab keeps as codes (q8_0, q5_0, int4 from Q4_K): their blocks go through
# each family's row transforms (QKV splits, RoPE permutations, experts), so every family
# is quantised in each. The others are dequantised by gguf-py, whatever the family (the
# family's transforms of float values are checked on its converter files): each is
# quantised for the SentencePiece families in turn (three a family, every type at least
# three times), which catches a reader's error as surely as all of them. Not for the
# GPT-2 BPE families: their 50,257 tokens and 50,000 merges make every file seconds
# slower to convert, quantise and read, for nothing a read type checks.
CODE_TYPES = ("Q8_0", "Q5_0", "Q4_K_M")
READ_TYPES = tuple(t for t in QUANT_TYPES if t not in CODE_TYPES)
# Architectures transformers' GGUF reader does not know, or reads otherwise than llama.cpp
# runs them: the reference is transformers' model of the source directory with the file's
# dequantised weights put in. transformers reads a Mixtral file ("llama" with experts) as a
# dense Llama, and a qwen3moe file without the experts' width (its default, 768) and with
# norm_topk_prob false (llama.cpp always renormalises); smollm3 and llama4 it does not read.
# transformers 5.24 has a gpt-oss GGUF reader, but it fails on the rope.scaling keys of
# llama.cpp's own files (a TypeError reading yarn_beta_fast).
NOT_IN_TRANSFORMERS_GGUF = (
    "olmo2",
    "gpt_neox",
    "granite",
    "gpt_oss",
    "mixtral",
    "qwen3_moe",
    "smollm3",
    "llama4_text",
)
# Both sides multiply the same float32 weights (dequantised from the same codes) in float32;
# what is left is the order of float32 sums, ~1e-6 of the logits' scale (about 10 here).
# A wrong block layout, scale, sign or tensor name moves logits by O(1).
ATOL = 1e-4
IDS = torch.tensor([[(37 * i + 11) % 300 + 3 for i in range(24)]])  # ids < 320: every vocab


@dataclass
class Corpus:
    """The converted and quantised files of one test session (built on first use)."""

    root: Path
    dirs: dict[str, Path] = field(default_factory=dict)
    converted: dict[tuple[str, str], Path | str] = field(default_factory=dict)
    quantised: dict[str, dict[str, tuple[Path, set[str]] | str]] = field(default_factory=dict)

    def hf_dir(self, case: str) -> Path:
        return self.dirs[case]

    def converter_file(self, case: str, outtype: str) -> Path:
        found = self.converted[case, outtype]
        if isinstance(found, str):
            pytest.fail(f"convert_hf_to_gguf.py --outtype {outtype} on {case}:\n{found}")
        return found

    def quantised_file(self, case: str, qtype: str) -> tuple[Path, set[str]]:
        """The file llama-quantize made of ``case`` in ``qtype``, and the tensor types it
        says it wrote."""
        if case not in self.quantised:  # every planned type of one case, two at a time
            source = self.converter_file(case, "f32")

            def one(qtype: str) -> tuple[Path, set[str]] | str:
                target = source.with_name(f"{qtype}.gguf")
                try:
                    log = PEER_TOOLS.quantize(PEER, source, target, qtype)
                except RuntimeError as exc:
                    return str(exc)
                if "fallback" in log or "falling back" in log:
                    return f"llama-quantize fell back to another type:\n{log[-2000:]}"
                return target, set(re.findall(r"converting to (\w+)", log))

            qtypes = QUANT_PLAN[case]
            with ThreadPoolExecutor(2) as pool:
                made = pool.map(one, qtypes)
                self.quantised[case] = dict(zip(qtypes, made, strict=True))
        found = self.quantised[case][qtype]
        if isinstance(found, str):
            pytest.fail(f"llama-quantize {case} {qtype}: {found}")
        return found


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Corpus:
    """Every checkpoint saved, then converted in every outtype by one converter process."""
    corpus = Corpus(tmp_path_factory.mktemp("llama-cpp-corpus"))
    jobs = []
    for case, spec in CORPUS.items():
        folder = corpus.root / case
        tokenizer = gpt2_tokenizer if spec.tokenizer == "gpt2" else spm_tokenizer
        save_hf(spec.model_type, spec.config, folder, torch.float32, tokenizer=tokenizer)
        if spec.hub:
            config = json.loads((folder / "config.json").read_text())
            (folder / "config.json").write_text(json.dumps({**config, **spec.hub}, indent=2))
        if spec.mxfp4_experts:
            _pack_experts_mxfp4(folder)
        corpus.dirs[case] = folder
        jobs += [(folder, t, folder / f"{t}.gguf") for t in converter_types(case)]
    errors = PEER_TOOLS.convert(PEER, jobs)
    for folder, outtype, out in jobs:
        corpus.converted[folder.name, outtype] = errors.get(out, out)
    return corpus


def _pack_experts_mxfp4(folder: Path) -> None:
    """Replace each stacked expert tensor (E, K, N) of ``folder`` by the hub's MXFP4 pair:
    ``_blocks`` (E, N, K/32, 16) of random codes and ``_scales`` (E, N, K/32) of exponents
    near 2**-7 (weights of the init's size)."""
    from safetensors.torch import load_file, save_file

    state = load_file(folder / "model.safetensors")
    g = torch.Generator().manual_seed(4)
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        E, K, N = state.pop(name).shape
        state[f"{name}_blocks"] = torch.randint(
            0, 256, (E, N, K // 32, 16), dtype=torch.uint8, generator=g
        )
        state[f"{name}_scales"] = torch.randint(
            118, 123, (E, N, K // 32), dtype=torch.uint8, generator=g
        )
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        out = model(IDS)
    return (out[0] if isinstance(out, tuple) else getattr(out, "logits", out)).float()


def _transformers_on_the_file(path: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    with gguf_read_once():  # transformers parses the file for its config, then its tensors
        ref = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
        )
    return _logits(ref.eval())


def _transformers_with_the_files_weights(hf_dir: Path, path: Path) -> torch.Tensor:
    """transformers' model of ``hf_dir`` with every weight replaced by gguf-py's
    dequantisation of the same tensor in ``path`` (the converter's transforms undone)."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(hf_dir)
    if getattr(config, "quantization_config", None) is not None:
        # every weight is replaced below: the model of the config, unquantised, will do
        del config.quantization_config
        ref = AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, attn_implementation="eager"
        ).eval()
    else:
        ref = AutoModelForCausalLM.from_pretrained(
            hf_dir, dtype=torch.float32, attn_implementation="eager"
        ).eval()
    cfg = ref.config
    reader = gguf.GGUFReader(path)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    names = gguf.get_tensor_name_map(
        gguf.MODEL_ARCH[arch.upper().replace("_", "").replace("-", "_")], cfg.num_hidden_layers
    )
    tensors = {t.name: t for t in reader.tensors}

    def get(gname: str) -> torch.Tensor:
        t = tensors[gname]
        values = dequantize(t.data, gguf.GGMLQuantizationType(t.tensor_type))
        return torch.from_numpy(np.array(values, dtype=np.float32))

    state = {}
    for name, param in ref.state_dict().items():
        if arch == "gpt-oss" and (experts := _gpt_oss_experts(name, get)) is not None:
            state[name] = experts.reshape(param.shape)
            continue
        layer = re.search(r"layers\.(\d+)\.", name)
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            # transformers' stacked experts, one tensor of gate and up side by side: llama.cpp
            # stores (E, F, C) gate and up and (E, C, F) down; Llama 4's are transposed
            assert layer is not None, name
            blk = f"blk.{layer.group(1)}"
            if name.endswith("gate_up_proj"):
                gate, up = (get(f"{blk}.ffn_{w}_exps.weight") for w in ("gate", "up"))
                x = torch.cat([gate, up], 1)
            else:
                x = get(f"{blk}.ffn_down_exps.weight")
            state[name] = x.transpose(1, 2) if arch == "llama4" else x
            assert state[name].shape == param.shape, (name, x.shape, param.shape)
            continue
        # the converter names gpt-oss's bare `sinks` tensors `sinks.weight`
        gname = names.get_name(
            name + ".weight" if name.endswith(".sinks") else name,
            try_suffixes=(".weight", ".bias"),
        )
        assert gname is not None, name
        if gname not in tensors:
            assert name == "lm_head.weight" and cfg.tie_word_embeddings, (name, gname)
            continue
        x = get(gname)
        assert x.numel() == param.numel(), (name, x.shape, param.shape)
        x = x.reshape(param.shape)
        if arch == "gptneox" and "query_key_value" in name:  # llama.cpp stores q, k, v
            H = cfg.num_attention_heads
            x = x.reshape(3, H, -1, *x.shape[1:]).transpose(0, 1).reshape(param.shape)
        if arch in ("granite", "llama", "smollm3") and (".q_proj." in name or ".k_proj." in name):
            # llama.cpp's LlamaModel permutes q/k rows per head: (H, 2, D/2) -> (H, D/2, 2)
            H = cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads
            x = x.reshape(H, -1, 2, *x.shape[1:]).swapaxes(1, 2).reshape(param.shape)
        state[name] = x
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return _logits(ref)


def _gpt_oss_experts(name: str, get) -> torch.Tensor | None:
    """transformers' gpt-oss expert tensor ``name`` from llama.cpp's split ones: gate and
    up (E, F, C) interleaved row by row into ``gate_up_proj`` (E, C, 2F), ``down_proj``
    (E, F, C) from ``ffn_down_exps`` (E, C, F); the biases likewise. None: not an expert."""
    m = re.match(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?$", name)
    if m is None:
        return None
    i, proj, bias = m.groups()
    leaf = "bias" if bias else "weight"
    if proj == "down_proj":
        down = get(f"blk.{i}.ffn_down_exps.{leaf}")
        return down if bias else down.transpose(1, 2)
    gate, up = get(f"blk.{i}.ffn_gate_exps.{leaf}"), get(f"blk.{i}.ffn_up_exps.{leaf}")
    pairs = torch.stack([gate, up], dim=2).flatten(1, 2)  # (E, 2F, ...): gate, up, gate, ...
    return pairs if bias else pairs.transpose(1, 2)


def _check(corpus: Corpus, case: str, path: Path, record_property) -> None:
    ours = _logits(load_pretrained(path)[0])
    spec = CORPUS[case]
    if spec.model_type in NOT_IN_TRANSFORMERS_GGUF:
        reference = _transformers_with_the_files_weights(corpus.hf_dir(case), path)
    else:
        reference = _transformers_on_the_file(path)
    diff = (ours - reference).abs().max().item()
    record_property("max_abs_logit_diff", diff)
    record_property("logit_scale", reference.abs().max().item())
    torch.testing.assert_close(ours, reference, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    ("case", "outtype"), [(case, t) for case in CORPUS for t in converter_types(case)]
)
def test_converter_files_load_as_transformers_reads_them(corpus, case, outtype, record_property):
    path = corpus.converter_file(case, outtype)
    _check(corpus, case, path, record_property)
    if CORPUS[case].mxfp4_experts:  # the converter kept the experts' MXFP4 codes
        from attnlab.pretrained.gguf_file import read_gguf

        types = {n: i.type_name for n, i in read_gguf(path).tensor_infos.items()}
        assert {t for n, t in types.items() if n.endswith("_exps.weight")} == {"MXFP4"}
    if outtype == "f32" and CORPUS[case].mxfp4_experts:
        # the same codes read from the hub's layout by attnlab (whose reading is checked
        # against transformers' in test_recent_families.py): equal to the bit
        source = _logits(load_pretrained(corpus.hf_dir(case))[0])
        assert torch.equal(_logits(load_pretrained(path)[0]), source)
    elif outtype == "f32":  # and the file holds the checkpoint: the source model's logits
        from transformers import AutoModelForCausalLM

        source = AutoModelForCausalLM.from_pretrained(
            corpus.hf_dir(case), dtype=torch.float32, attn_implementation="eager"
        )
        ours = _logits(load_pretrained(path)[0])
        torch.testing.assert_close(ours, _logits(source.eval()), atol=ATOL, rtol=0)


# its experts are MXFP4 already: gpt_oss covers the types
_QUANT_FAMILIES = [case for case, spec in CORPUS.items() if not spec.mxfp4_experts]


_READ_PER_CASE = 3


def quant_plan() -> dict[str, tuple[str, ...]]:
    """The types each case is quantised in: every code type, and for the SentencePiece
    cases three of the read types in turn."""
    n = len(READ_TYPES)
    spm = [case for case in _QUANT_FAMILIES if CORPUS[case].tokenizer == "spm"]
    plan = {case: CODE_TYPES for case in _QUANT_FAMILIES}
    for i, case in enumerate(spm):
        first = _READ_PER_CASE * i
        plan[case] += tuple(READ_TYPES[(first + j) % n] for j in range(_READ_PER_CASE))
    return plan


QUANT_PLAN = quant_plan()
# GPT-2's 50257 tokens and 50000 merges take gguf-py's reader (which transformers runs
# twice per file) seconds per file: those families' types are the slow part.
_QUANT_CASES = [
    pytest.param(case, qtype, marks=pytest.mark.slow)
    if CORPUS[case].tokenizer == "gpt2"
    else (case, qtype)
    for case, qtypes in QUANT_PLAN.items()
    for qtype in qtypes
]


def test_every_converter_type_is_read_for_several_families():
    by_type = {t: [c for c in CORPUS if t in converter_types(c)] for t in CONVERTER_TYPES}
    assert all(len(cases) >= 3 for cases in by_type.values()), by_type
    assert all({"f32", "q8_0"} <= set(converter_types(c)) for c in CORPUS)


def test_the_quantised_cases_cover_every_type_and_family():
    by_type = {t: [c for c, ts in QUANT_PLAN.items() if t in ts] for t in QUANT_TYPES}
    assert set(QUANT_PLAN) == set(_QUANT_FAMILIES)
    assert all(
        len(cases) == len(_QUANT_FAMILIES) for t, cases in by_type.items() if t in CODE_TYPES
    )
    assert all(len(cases) >= 3 for cases in by_type.values()), by_type
    assert all(
        len(set(ts)) == len(CODE_TYPES) + (_READ_PER_CASE if CORPUS[c].tokenizer == "spm" else 0)
        for c, ts in QUANT_PLAN.items()
    )


@pytest.mark.parametrize(("case", "qtype"), _QUANT_CASES)
def test_llama_quantize_files_load_as_transformers_reads_them(corpus, case, qtype, record_property):
    path, written = corpus.quantised_file(case, qtype)
    # the type itself, as ggml names it (Q4_K_M: q4_K, with q6_K for some tensors)
    assert qtype.removesuffix("_M").lower().replace("_k", "_K") in written, written
    record_property("tensor_types", ",".join(sorted(written)))
    _check(corpus, case, path, record_property)


def test_gpt_oss_mxfp4_moe_file_loads_with_the_files_weights(corpus, record_property):
    """llama-quantize's MXFP4_MOE of gpt-oss: the experts' three tensors in MXFP4 (the rest
    Q8_0), read by attnlab's own MXFP4 kernel; the reference dequantises with gguf-py."""
    source = corpus.converter_file("gpt_oss", "f32")
    target = source.with_name("MXFP4_MOE.gguf")
    log = PEER_TOOLS.quantize(PEER, source, target, "MXFP4_MOE")
    assert "fallback" not in log and "falling back" not in log, log[-2000:]
    from attnlab.pretrained.gguf_file import read_gguf

    types = {n: i.type_name for n, i in read_gguf(target).tensor_infos.items()}
    experts = {n: t for n, t in types.items() if "_exps." in n and n.endswith(".weight")}
    assert len(experts) == 3 * 2 and set(experts.values()) == {"MXFP4"}, experts
    _check(corpus, "gpt_oss", target, record_property)


# Families with a GGUF path that this corpus cannot check yet, and why.
NOT_YET: dict[str, str] = {}


def test_every_family_with_a_gguf_path_is_in_the_corpus():
    """A family page that reads GGUF files gets llama.cpp's files in this corpus too
    (or is named in NOT_YET with the reason)."""
    with_gguf = {f.name for f in FAMILIES.values() if f.gguf_weights}
    covered = {family_for(spec.model_type).name for spec in (*CORPUS.values(), *MLA.values())}
    assert with_gguf <= covered | set(NOT_YET), sorted(with_gguf - covered - set(NOT_YET))
    assert not covered & set(NOT_YET), "covered now: take it out of NOT_YET"


# DeepSeek's latent attention (llama.cpp's deepseek2): transformers cannot read these files;
# the f32 file holds the checkpoint, so the reference is transformers' model of the source
# directory, and attnlab's load of that directory. The converter splits kv_b_proj into
# attn_k_b (transposed) and attn_v_b for its absorbed product, and describes the layer as
# multi-query attention over the latent. Widths as above; experts after one dense layer.
_MLA_DIMS = {
    **_DIMS,
    **_BPE,
    "num_key_value_heads": 4,
    "kv_lora_rank": 256,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 32,
    "v_head_dim": 64,
    "moe_intermediate_size": 256,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}
MLA: dict[str, Case] = {
    # DeepSeek-V2-Lite's shape: one query projection, softmax router, greedy
    "deepseek_v2": Case(
        "deepseek_v2", {**_MLA_DIMS, "q_lora_rank": None, "n_shared_experts": 2}, "gpt2"
    ),
    # the low-rank query, sigmoid router with its score correction (the hub's config says
    # scoring_func, which the converter writes as expert_gating_func), 4 groups of 2, top 2
    "deepseek_v3": Case(
        "deepseek_v3",
        {**_MLA_DIMS, "q_lora_rank": 128, "n_group": 4, "topk_group": 2, "n_shared_experts": 1},
        "gpt2",
        hub={"scoring_func": "sigmoid", "topk_method": "noaux_tc"},
    ),
    # YaRN as every DeepSeek-V2/V3/R1 and Kimi K2 checkpoint has it, x4 over 8 positions
    # (the 24-token input runs past them, so the ramp and the interpolation bite), with
    # DeepSeek-V2's mscale and mscale_all_dim (0.707: llama.cpp's deepseek2 special case)
    # and DeepSeek-V3's (1.0). The converter writes yarn_log_multiplier = 0.1 * mscale_all_dim
    # and the config's beta_fast / beta_slow.
    **{
        f"deepseek_v3-yarn-{mscale}": Case(
            "deepseek_v3",
            {
                **_MLA_DIMS,
                "q_lora_rank": 128,
                "n_group": 4,
                "topk_group": 2,
                "n_shared_experts": 1,
                "rope_parameters": {
                    "rope_type": "yarn",
                    "rope_theta": 10000.0,
                    "factor": 4.0,
                    "original_max_position_embeddings": 8,
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                    "mscale": mscale,
                    "mscale_all_dim": mscale,
                },
            },
            "gpt2",
            hub={"scoring_func": "sigmoid", "topk_method": "noaux_tc"},
        )
        for mscale in (0.707, 1.0)
    },
}


@pytest.fixture(scope="session")
def mla_files(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("llama-cpp-mla")
    jobs, folders = [], {}
    for case, spec in MLA.items():
        folder = root / case
        save_hf(spec.model_type, spec.config, folder, torch.float32, tokenizer=gpt2_tokenizer)
        if spec.model_type == "deepseek_v3":
            score_correction(folder)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **spec.hub}, indent=2))
        folders[case] = folder
        jobs.append((folder, "f32", folder / "f32.gguf"))
    errors = PEER_TOOLS.convert(PEER, jobs)
    assert not errors, errors
    return {case: (folder, folder / "f32.gguf") for case, folder in folders.items()}


@pytest.mark.parametrize("case", list(MLA))
def test_deepseek2_converter_files_load_as_their_source(mla_files, case):
    import gguf
    from transformers import AutoModelForCausalLM

    folder, path = mla_files[case]
    names = {t.name for t in gguf.GGUFReader(path).tensors}
    assert {"blk.0.attn_k_b.weight", "blk.0.attn_v_b.weight"} <= names  # the split form
    assert "blk.0.attn_kv_b.weight" not in names
    model, _ = load_pretrained(path, backend="math")
    assert model.config.family == "deepseek2" and model.config.mla is not None
    moe = model.blocks[1].mlp.config
    assert (moe.router, moe.score_bias, moe.groups) == (
        ("sigmoid", True, 4) if case.startswith("deepseek_v3") else ("softmax", False, 1)
    )
    yarn = MLA[case].config["rope_parameters"]["rope_type"] == "yarn"
    assert (model.config.rope.scaling is not None) == yarn
    if yarn:
        metadata = gguf.GGUFReader(path).fields
        assert "deepseek2.rope.scaling.yarn_log_multiplier" in metadata
        assert "deepseek2.rope.scaling.yarn_beta_fast" in metadata
    source = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    expected = _logits(source)
    torch.testing.assert_close(_logits(model), expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(_logits(load_pretrained(folder)[0]), expected, atol=ATOL, rtol=0)
    # and llama.cpp's absorbed layout decodes as the expanded form does
    for block in model.blocks:
        block.attention.absorbed = True
    torch.testing.assert_close(_logits(model), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", [c for c in MLA if "yarn" in c])
def test_deepseek2_yarn_files_give_llama_cpps_log_probs(mla_files, case, tmp_path):
    """llama.cpp itself on the converter's YaRN file (llama-perplexity's saved
    log-probabilities, 32 positions, the ones from 16 on: past the original context of 8,
    where the ramp, the interpolation and the score scale all bite): attnlab's log-probs of
    the same tokens agree to the half step llama.cpp stores them with (~1e-4 here); a
    score scale without YaRN's mscale is off by O(1)."""
    from attnlab.data import default_corpus
    from attnlab.pretrained.gguf_file import read_gguf

    _, path = mla_files[case]
    theirs = PEER_TOOLS.log_probs(PEER, path, default_corpus()[:2000], 32, tmp_path)
    ids = torch.from_numpy(theirs.tokens)
    meta = read_gguf(path).metadata
    if meta.get("tokenizer.ggml.add_bos_token", False):
        ids[:, 0] = meta["tokenizer.ggml.bos_token_id"]
    model, _ = load_pretrained(path, backend="math")

    def gap() -> float:
        with torch.no_grad():
            ours = torch.log_softmax(model(ids).double(), -1)[:, theirs.first : -1]
        expected = torch.from_numpy(theirs.values)
        kept = ~expected.isnan()
        return (ours - expected)[kept].abs().max().item()

    assert gap() <= theirs.step.max() / 2 + 5e-5  # + float32 sums in either order
    for block in model.blocks:
        block.attention.scale = 64**-0.5  # 1/sqrt(Dn + Dr): no mscale
    assert gap() > 0.1


def _config_with(corpus: Corpus, case: str, **metadata):
    """The family and config attnlab reads from ``case``'s converter file with some
    metadata changed (a key set to None is removed)."""
    import dataclasses

    from attnlab.pretrained.gguf_file import read_gguf
    from attnlab.pretrained.loaders import gguf_config

    contents = read_gguf(corpus.converter_file(case, "f32"))
    meta = {**contents.metadata, **metadata}
    meta = {k: v for k, v in meta.items() if v is not None}
    return gguf_config(dataclasses.replace(contents, metadata=meta))


def test_families_told_apart_as_llama_cpp_does(corpus):
    """Mixtral's file says architecture "llama": its experts make it Mixtral; Llama 4's
    fixed rules (chunks of 8192, NoPE every 4th layer, QK-norm unless 128 experts)."""
    family, config = _config_with(corpus, "mixtral")
    assert family.name == "mixtral" and config.moe is not None
    assert (config.moe.num_experts, config.moe.top_k, config.moe.renormalize) == (4, 2, True)
    family, config = _config_with(corpus, "mixtral", **{"llama.expert_count": None})
    assert family.name == "llama" and config.moe is None
    family, config = _config_with(corpus, "llama4_text")
    assert family.name == "llama4_text"
    assert config.layer_chunks == (8192, 8192, 8192, None)
    assert config.layer_rotary == (True, True, True, False)
    assert config.attn_temperature == (8192.0, 0.1) and config.qk_norm is not None
    assert config.layer_moe == (False, True, False, True) and config.rope.interleaved
    _, config = _config_with(corpus, "llama4_text", **{"llama4.expert_count": 128})
    assert config.qk_norm is None  # llama.cpp: no QK-norm with 128 experts (Maverick)
    family, config = _config_with(corpus, "smollm3")
    assert family.name == "smollm3" and config.layer_rotary == (True, True, True, False)


@pytest.mark.parametrize(
    ("case", "metadata", "match"),
    [
        ("llama4_text", {"llama4.attention.sliding_window": 0}, "`llama4.attention.sliding_win"),
        ("llama4_text", {"llama4.attention.sliding_window_pattern": 2}, "window_pattern` = 2"),
        ("llama4_text", {"llama4.rope.freq_base_swa": 1.0}, "`llama4.rope.freq_base_swa`"),
        ("mixtral", {"llama.expert_count": 1 << 20}, "`num_local_experts` = 1048576 is more"),
        ("mixtral", {"llama.expert_used_count": 5}, "`num_experts_per_tok` = 5 chooses more"),
        ("qwen3_moe", {"qwen3moe.expert_feed_forward_length": 1 << 30}, "experts' width"),
    ],
)
def test_files_the_loader_does_not_understand_are_refused(corpus, case, metadata, match):
    from attnlab.pretrained import ModelFileError

    with pytest.raises(ModelFileError, match=match):
        _config_with(corpus, case, **metadata)


@pytest.mark.parametrize(
    ("metadata", "match"),
    [
        # llama.cpp's deepseek2 reads none of these: it runs with 32, 1 and 1, whatever the
        # file says, and derives the rotation's factor itself
        ({"yarn_beta_fast": 16.0}, "`deepseek2.rope.scaling.yarn_beta_fast` = 16.0"),
        ({"yarn_beta_slow": 2.0}, "`deepseek2.rope.scaling.yarn_beta_slow` = 2.0"),
        ({"yarn_ext_factor": 0.5}, "`deepseek2.rope.scaling.yarn_ext_factor` = 0.5"),
        ({"yarn_attn_factor": 1.0}, "`deepseek2.rope.scaling.yarn_attn_factor` is not"),
        ({"yarn_log_multiplier": -1.0}, "`deepseek2.rope.scaling.yarn_log_multiplier` must"),
        ({"type": "linear"}, "`deepseek2.rope.scaling.type` = 'linear'"),
    ],
)
def test_deepseek2_yarn_keys_llama_cpp_does_not_read_are_refused(mla_files, metadata, match):
    import dataclasses

    from attnlab.pretrained import ModelFileError
    from attnlab.pretrained.gguf_file import read_gguf
    from attnlab.pretrained.loaders import gguf_config

    contents = read_gguf(mla_files["deepseek_v3-yarn-1.0"][1])
    meta = {**contents.metadata}
    # the values llama.cpp runs with are accepted
    for key, value in {
        "yarn_beta_fast": 32.0,
        "yarn_beta_slow": 1.0,
        "yarn_ext_factor": 1.0,
    }.items():
        meta[f"deepseek2.rope.scaling.{key}"] = value
    _, config = gguf_config(dataclasses.replace(contents, metadata=meta))
    assert config.rope.scaling.factor == 4.0
    meta.update({f"deepseek2.rope.scaling.{k}": v for k, v in metadata.items()})
    with pytest.raises(ModelFileError, match=match):
        gguf_config(dataclasses.replace(contents, metadata=meta))
