"""DeepSeek-V3 / R1 and Kimi K2 checkpoints as the hub has them: FP8 (E4M3) weights with a
float32 scale per 128 x 128 block, and DeepSeek-V3's multi-token-prediction layer after
the model's own. Tiny random checkpoints saved by transformers, quantised here from the
format's definition, loaded by attnlab and compared with transformers (its own FP8
dequantisation where it applies, else its model of the checkpoint dequantised here)."""

from __future__ import annotations

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

from attnlab.pretrained import ModelFileError, load_pretrained
from attnlab.pretrained.hf import dequantize_fp8_blocks
from model_files import save_hf, score_correction

_FP8 = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}
# Every projection's dims a multiple of 128 or at most 128: the shapes transformers'
# dequantisation reads right (it derives the block from the scale grid's shape)
_WHOLE = {
    "hidden_size": 256,
    "intermediate_size": 384,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 128,
    "kv_lora_rank": 96,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 32,
    "v_head_dim": 32,
    "moe_intermediate_size": 64,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "n_group": 2,
    "topk_group": 1,
    "n_shared_experts": 1,
    "max_position_embeddings": 64,
}
# Partial blocks: widths 160, 200, 136 (128 + 8), 112 (kv_a: 96 + 16)
_PARTIAL = {
    **_WHOLE,
    "hidden_size": 160,
    "intermediate_size": 200,
    "q_lora_rank": 136,
    "qk_rope_head_dim": 16,
    "moe_intermediate_size": 72,
}
IDS = torch.tensor([[(37 * i + 11) % 500 + 3 for i in range(20)]])


def _quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's FP8 format, from its definition: per block, scale = amax / 448 (E4M3's
    largest value), codes = w / scale in E4M3; one block at a time."""
    R, C = w.shape
    br, bc = block
    scale = torch.empty(math.ceil(R / br), math.ceil(C / bc))
    codes = torch.empty(R, C, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = w[i * br : (i + 1) * br, j * bc : (j + 1) * bc]
            scale[i, j] = tile.abs().max() / 448.0
            codes[i * br : (i + 1) * br, j * bc : (j + 1) * bc] = (tile / scale[i, j]).to(
                torch.float8_e4m3fn
            )
    return codes, scale


def _dequantize(codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The definition, one element's block at a time (no tiling tricks)."""
    R, C = codes.shape
    rows = torch.arange(R)[:, None] // block[0]
    cols = torch.arange(C)[None, :] // block[1]
    return codes.float() * scale[rows, cols]


def _is_linear(name: str) -> bool:
    # what DeepSeek-V3's checkpoints hold in FP8: every projection of attention, dense
    # MLP, experts and shared experts; not the router, norms, embeddings or output head
    return name.endswith(("_proj.weight", "_proj_with_mqa.weight"))


def _fp8_checkpoint(folder, dims, *, quant=None, block=(128, 128)):
    """A DeepSeek-V3 checkpoint in ``folder``, then its FP8 twin in ``folder``-fp8 and the
    twin dequantised by the definition in ``folder``-dequantised (plain float32)."""
    from safetensors.torch import load_file, save_file

    save_hf("deepseek_v3", dims, folder, torch.float32)
    score_correction(folder)
    state = load_file(folder / "model.safetensors")
    fp8, dequantised = {}, {}
    for name, t in state.items():
        if _is_linear(name):
            codes, scale = _quantize(t, block)
            fp8[name], fp8[name.replace(".weight", ".weight_scale_inv")] = codes, scale
            dequantised[name] = _dequantize(codes, scale, block)
        else:
            fp8[name] = dequantised[name] = t
    config = json.loads((folder / "config.json").read_text())
    out = {}
    for kind, tensors, extra in (
        ("fp8", fp8, {"quantization_config": quant or _FP8}),
        ("dequantised", dequantised, {}),
    ):
        target = folder.with_name(f"{folder.name}-{kind}")
        shutil.copytree(folder, target)
        save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
        (target / "config.json").write_text(json.dumps({**config, **extra}, indent=2))
        out[kind] = target
    return out


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        out = model(IDS)
    return getattr(out, "logits", out).float()


def _transformers(folder, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager", **kwargs
    ).eval()


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek-fp8")
    return {
        "whole": _fp8_checkpoint(root / "whole", _WHOLE),
        "partial": _fp8_checkpoint(root / "partial", _PARTIAL),
    }


def test_fp8_checkpoint_loads_as_transformers_dequantises_it(fp8):
    """transformers' own FP8 reading (``FineGrainedFP8Config(dequantize=True)``, CPU) of
    the same files: the same weights, the same logits."""
    from transformers import FineGrainedFP8Config

    folder = fp8["whole"]["fp8"]
    model, _ = load_pretrained(folder)
    theirs = _transformers(folder, quantization_config=FineGrainedFP8Config(dequantize=True))
    q_b = theirs.model.layers[0].self_attn.q_b_proj.weight
    torch.testing.assert_close(model.blocks[0].attention.W_query.up.weight, q_b, atol=0, rtol=0)
    expected = _logits(theirs)
    torch.testing.assert_close(_logits(model), expected, atol=1e-4, rtol=0)
    # not the unquantised checkpoint: the FP8 rounding is in both
    original, _ = load_pretrained(folder.with_name("whole"))
    assert (_logits(original) - expected).abs().max() > 1e-3


def test_fp8_partial_blocks_load_as_the_definition_dequantises_them(fp8):
    """Widths that are not multiples of 128 (the last block of a row or column partial,
    as DeepSeek-V3's kv_a_proj_with_mqa, 576 rows): transformers' model of the checkpoint
    dequantised by the definition here."""
    model, _ = load_pretrained(fp8["partial"]["fp8"])
    assert model.blocks[0].attention.W_query.up.weight.shape == (4 * 48, 136)
    expected = _logits(_transformers(fp8["partial"]["dequantised"]))
    torch.testing.assert_close(_logits(model), expected, atol=1e-4, rtol=0)
    # in bfloat16: the float32 product rounded once
    model16, _ = load_pretrained(fp8["partial"]["fp8"], dtype=torch.bfloat16)
    w = model.blocks[1].attention.kv_down.weight
    assert model16.blocks[1].attention.kv_down.weight.dtype == torch.bfloat16
    torch.testing.assert_close(
        model16.blocks[1].attention.kv_down.weight, w.to(torch.bfloat16), atol=0, rtol=0
    )


@pytest.mark.parametrize("block", [(128, 128), (64, 96), (1, 128)])
def test_dequantize_fp8_blocks_is_the_definition(block):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 260, generator=g)
    codes, scale = _quantize(w, block)
    out = dequantize_fp8_blocks(codes, scale, block)
    torch.testing.assert_close(out, _dequantize(codes, scale, block), atol=0, rtol=0)
    assert (out - w).abs().max() <= w.abs().max() / 8  # E4M3: 3 mantissa bits
    with pytest.raises(ValueError, match=r"expected \(3, 3\)"):
        dequantize_fp8_blocks(codes, scale[:, :2], (128, 128))


def _edited(folder, tmp_path, *, config=None, tensors=None):
    """A copy of ``folder`` with config keys changed (None removes) and tensors replaced
    (None removes)."""
    from safetensors.torch import load_file, save_file

    target = tmp_path / f"edited-{len(list(tmp_path.iterdir()))}"
    shutil.copytree(folder, target)
    cfg = json.loads((target / "config.json").read_text())
    for key, value in (config or {}).items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (target / "config.json").write_text(json.dumps(cfg))
    if tensors:
        state = load_file(target / "model.safetensors")
        for name, t in tensors.items():
            if t is None:
                state.pop(name)
            else:
                state[name] = t
        save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


_Q_B = "model.layers.0.self_attn.q_b_proj.weight"


@pytest.mark.parametrize(
    ("config", "tensors", "match"),
    [
        (
            {"quantization_config": {**_FP8, "fmt": "e5m2"}},
            {},
            r"`quantization_config.fmt` = 'e5m2",
        ),
        (
            {"quantization_config": {**_FP8, "activation_scheme": "static"}},
            {},
            r"`quantization_config.activation_scheme` = 'static'",
        ),
        (
            {"quantization_config": {**_FP8, "weight_block_size": [128]}},
            {},
            r"`quantization_config.weight_block_size` must be two integers",
        ),
        (
            {"quantization_config": {**_FP8, "scale_fmt": "ue8m0"}},
            {},
            r"`quantization_config.scale_fmt` is not supported",
        ),
        ({"quantization_config": None}, {}, r"holds FP8 tensor .* no `quantization_config`"),
        (
            {"quantization_config": {**_FP8, "quant_method": "bitsandbytes"}},
            {},
            r"holds FP8 tensor",
        ),
        ({}, {_Q_B.replace("weight", "weight_scale_inv"): None}, r"must be 2-D and come with"),
        (
            {},
            {_Q_B.replace("weight", "weight_scale_inv"): torch.ones(1, 1)},
            r"must be float \[2, 2\]: one scale per \[128, 128\] block",
        ),
        ({}, {_Q_B: torch.zeros(192, 136)}, r"without its FP8 weight"),
        (
            {},
            {_Q_B: torch.full((192, 136), float("nan")).to(torch.float8_e4m3fn)},
            r"non-finite value",
        ),
    ],
)
def test_fp8_files_it_does_not_understand_are_refused(fp8, tmp_path, config, tensors, match):
    folder = _edited(fp8["partial"]["fp8"], tmp_path, config=config, tensors=tensors)
    with pytest.raises(ModelFileError, match=match):
        load_pretrained(folder)


def _with_mtp_layer(folder, target, *, count=1):
    """A copy of ``folder`` with DeepSeek-V3's multi-token-prediction module after its
    layers, as the hub's checkpoints hold it (model.layers.61 there): a full decoder layer
    (layer 1's tensors, FP8 ones with their scales) plus enorm, hnorm, eh_proj,
    shared_head and embed_tokens; ``num_nextn_predict_layers`` = ``count``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, target)
    config = json.loads((target / "config.json").read_text())
    L, C, V = config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]
    state = load_file(target / "model.safetensors")
    g = torch.Generator().manual_seed(5)
    prefix = f"model.layers.{L - 1}."
    mtp = {
        f"model.layers.{L}." + n[len(prefix) :]: t.clone()
        for n, t in state.items()
        if n.startswith(prefix)
    }
    for name, shape in (
        ("enorm.weight", (C,)),
        ("hnorm.weight", (C,)),
        ("eh_proj.weight", (C, 2 * C)),
        ("shared_head.norm.weight", (C,)),
        ("shared_head.head.weight", (V, C)),
        ("embed_tokens.weight", (V, C)),
    ):
        mtp[f"model.layers.{L}.{name}"] = torch.randn(shape, generator=g)
    save_file({**state, **mtp}, str(target / "model.safetensors"), metadata={"format": "pt"})
    (target / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": count}))
    return target, len(mtp)


def test_mtp_layer_is_left_out_and_said(fp8, tmp_path, capsys):
    """The multi-token-prediction layer is not part of the next-token forward: the model
    loads without it, its logits are transformers' (which ignores those tensors too), and
    the load and ``attnlab info`` say what was left out."""
    from cli_runner import run_main

    folder, n = _with_mtp_layer(fp8["whole"]["dequantised"], tmp_path / "mtp")
    model, _ = load_pretrained(folder)
    assert len(model.blocks) == 2
    note = f"multi-token-prediction layer 2 ({n} tensors) not used"
    assert model.load_notes[0].startswith(note) and len(model.load_notes) == 1
    expected = _logits(_transformers(folder))
    torch.testing.assert_close(_logits(model), expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(
        expected, _logits(_transformers(fp8["whole"]["dequantised"])), atol=0, rtol=0
    )
    code, out, err = run_main(capsys, "info", "--model", str(folder), "--json")
    assert code == 0, err
    assert json.loads(out)["notes"] == list(model.load_notes) and note in err
    code, out, err = run_main(capsys, "info", "--model", str(folder))
    assert code == 0, err
    assert "left out" in out and "multi-token-prediction" in out
    # the hub's FP8 checkpoints hold the layer in FP8 too
    folder8, n8 = _with_mtp_layer(fp8["partial"]["fp8"], tmp_path / "mtp-fp8")
    model8, _ = load_pretrained(folder8)
    assert model8.load_notes[0].startswith(f"multi-token-prediction layer 2 ({n8} tensors)")
    plain, _ = load_pretrained(fp8["partial"]["fp8"])
    assert plain.load_notes == ()
    torch.testing.assert_close(_logits(model8), _logits(plain), atol=0, rtol=0)


_BEYOND = r"tensor 'model\.layers\.2\.[\w.]+' (is for layer 2|is not part of this model)"


@pytest.mark.parametrize(
    ("count", "match"),
    [
        # as before: a tensor no rule names, or a layer beyond the config's
        (0, _BEYOND),
        (None, _BEYOND),
        (-1, r"`num_nextn_predict_layers` must be an integer >= 0, got -1"),
        (True, r"`num_nextn_predict_layers` must be an integer >= 0, got True"),
    ],
)
def test_layers_beyond_the_mtp_count_are_still_refused(fp8, tmp_path, count, match):
    folder, _ = _with_mtp_layer(fp8["whole"]["dequantised"], tmp_path / "mtp")
    config = json.loads((folder / "config.json").read_text())
    if count is None:
        config.pop("num_nextn_predict_layers")
    else:
        config["num_nextn_predict_layers"] = count
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFileError, match=match):
        load_pretrained(folder)
