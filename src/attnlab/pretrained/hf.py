"""Load a local Hugging Face model directory onto attnlab's one decoder or encoder.

The directory holds ``config.json`` (its ``model_type`` picks the family), the weights as
``model.safetensors`` or as shards listed in ``model.safetensors.index.json``, and
``tokenizer.json`` (+ ``tokenizer_config.json`` for the special tokens and chat template,
or ``chat_template.jinja``). Every file is untrusted: JSON files are size-capped, shard
names must stay inside the directory, safetensors headers are checked against the file
size (:mod:`attnlab.pretrained.safetensors_file`), and ``pytorch_model.bin`` (a pickle) is
never opened.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from attnlab.models.decoder import Decoder
from attnlab.models.encoder import Encoder
from attnlab.models.encoder_decoder import NO_LIMIT, EncoderDecoder
from attnlab.models.families import Family
from attnlab.pretrained.build import build_config, build_model, family_from
from attnlab.pretrained.errors import ModelFileError, check_finite
from attnlab.pretrained.gguf_file import mxfp4_values
from attnlab.pretrained.json_file import MAX_JSON_BYTES as MAX_JSON_BYTES  # re-exported
from attnlab.pretrained.json_file import read_json
from attnlab.pretrained.safetensors_file import SafetensorsFile, read_safetensors
from attnlab.pretrained.tokenizer import PretrainedTokenizer, tokenizer_from_hf_dir

__all__ = [
    "HFPlan",
    "dequantize_fp8_blocks",
    "load_hf_directory",
    "plan_hf_directory",
    "read_json",
    "weight_files",
]


def _inside(folder: Path, name: object, where: Path, root: Path | None = None) -> Path:
    """``folder / name``, refused unless it is a plain relative name that stays inside
    ``root`` (default ``folder``; a Hugging Face cache snapshot's files are links into its
    repo folder's ``blobs/``: the repo folder is the root)."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise ModelFileError(where, f"shard name {name!r} is not a file name")
    candidate = Path(name)
    if candidate.is_absolute() or ".." in candidate.parts:
        raise ModelFileError(where, f"shard {name!r} points outside the model directory")
    path = folder / candidate
    if not path.resolve().is_relative_to((root or folder).resolve()):
        raise ModelFileError(where, f"shard {name!r} resolves outside the model directory")
    return path


def weight_files(folder: Path, root: Path | None = None) -> tuple[dict[str, SafetensorsFile], Path]:
    """Every weight tensor name -> the checked safetensors file that holds it.

    Args:
        folder: the model directory.
        root: the folder no file may resolve outside (default ``folder``).

    Returns:
        ``(by_name, where)``: the mapping and the file to name in messages.

    Raises:
        ModelFileError: no safetensors weights, a bad index, a shard outside the
            directory or missing, a tensor the index names but its shard lacks.
    """
    index = folder / "model.safetensors.index.json"
    single = folder / "model.safetensors"
    if index.is_file():
        data = read_json(index, what="the shard index")
        weight_map = data.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelFileError(index, "`weight_map` must be a non-empty object")
        shards: dict[str, SafetensorsFile] = {}
        by_name: dict[str, SafetensorsFile] = {}
        for tensor, shard in weight_map.items():
            path = _inside(folder, shard, index, root)
            if shard not in shards:
                if not path.is_file():
                    raise ModelFileError(index, f"names shard {shard!r}, which is missing")
                shards[shard] = read_safetensors(path)
            if tensor not in shards[shard].tensors:
                raise ModelFileError(index, f"says {tensor!r} is in {shard!r}, but it is not")
            by_name[tensor] = shards[shard]
        return by_name, index
    if single.is_file():
        st = read_safetensors(single)
        return {name: st for name in st.tensors}, single
    if (folder / "pytorch_model.bin").exists():
        raise ModelFileError(
            folder,
            "holds only pytorch_model.bin (a pickle, which attnlab never opens); save it "
            "with save_pretrained(..., safe_serialization=True)",
        )
    raise ModelFileError(folder, "has no model.safetensors or model.safetensors.index.json")


@dataclass(frozen=True)
class HFPlan:
    """What a Hugging Face directory holds, read from its config and weight headers without
    reading a weight: what loading it would build, and how each weight would be read.

    Attributes:
        family: the family (``config.json``'s ``model_type``).
        config: the model config.
        config_json: ``config.json`` as read.
        names: every source tensor the model takes -> its element count.
        get: reads one source tensor (dequantising FP8 / MXFP4 pairs).
        files: tensor name -> its safetensors file.
        where: the file to name in messages (the index, or ``model.safetensors``).
        notes: what loading leaves out (multi-token-prediction layers).
    """

    family: Family
    config: Any
    config_json: dict[str, Any]
    names: dict[str, int]
    get: Callable[[str], torch.Tensor]
    files: dict[str, SafetensorsFile]
    where: Path
    notes: tuple[str, ...]


def plan_hf_directory(folder: Path, *, root: Path | None = None) -> HFPlan:
    """Read a Hugging Face directory's config and weight headers (:class:`HFPlan`): every
    check :func:`load_hf_directory` makes before it reads a weight.

    Raises:
        ModelFileError: anything wrong with the files (named, with the field).
    """
    if not folder.is_dir():
        raise ModelFileError(folder, "is not a directory")
    config_path = folder / "config.json"
    hf = read_json(config_path, what="the model config")
    family = family_from(hf.get("model_type"), config_path)
    config = build_config(family, hf, where=config_path, source="hf")
    files, where = weight_files(folder, root)
    names = {name: f.tensors[name].numel for name, f in files.items()}
    notes = _leave_out_mtp_layers(family, hf, config.num_layers, names, config_path)
    get = (
        _mxfp4_pairs(files, names, hf)
        or _fp8_blocks(files, names, hf, config_path)
        or (lambda name: files[name].tensor(name))
    )
    return HFPlan(family, config, hf, names, get, files, where, notes)


def load_hf_directory(
    path: str | Path,
    *,
    backend: str = "auto",
    dtype: torch.dtype = torch.float32,
    root: str | Path | None = None,
) -> tuple[Decoder | Encoder | EncoderDecoder, PretrainedTokenizer]:
    """A Hugging Face directory as an attnlab model and tokenizer.

    Args:
        path: the directory.
        backend: attention backend for every layer.
        dtype: parameter dtype (fp16/bf16/fp32 weights are converted).
        root: the folder no weight file may resolve outside (default: the directory; a
            Hugging Face cache snapshot's files link into its repo folder, the root then).

    Returns:
        ``(model, tokenizer)``, the model in eval mode.

    Raises:
        ModelFileError: anything wrong with the files (named, with the field).
    """
    folder = Path(path)
    plan = plan_hf_directory(folder, root=None if root is None else Path(root))
    model = build_model(
        plan.config,
        plan.names,
        plan.get,
        family=plan.family,
        source="hf",
        where=plan.where,
        dtype=dtype,
        backend=backend,
    )
    if isinstance(model, Decoder):
        model.load_notes = plan.notes
    tokenizer = tokenizer_from_hf_dir(folder, max_length=_max_tokens(model))
    return model, tokenizer


def _leave_out_mtp_layers(
    family: Family, hf: dict[str, Any], num_layers: int, names: dict[str, int], config_path: Path
) -> tuple[str, ...]:
    """Take the tensors of the multi-token-prediction layers out of ``names`` (in place):
    the layers ``num_layers`` .. ``num_layers + n - 1``, ``n`` read at the family's
    ``mtp_layers`` key (DeepSeek-V3's ``num_nextn_predict_layers``). The model's
    next-token forward does not use them (nor does transformers'); every other tensor is
    still matched against the family's names, and one beyond the layers is refused.

    Returns:
        One note per layer left out, e.g. ``"multi-token-prediction layer 61 (19 tensors)
        not used"``.

    Raises:
        ModelFileError: the count is not an integer >= 0 (named).
    """
    if family.mtp_layers is None:
        return ()
    count = hf.get(family.mtp_layers, 0)
    if count is None:
        count = 0
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ModelFileError(
            config_path, f"`{family.mtp_layers}` must be an integer >= 0, got {count!r}"
        )
    pattern = re.compile(rf"^(?:{'|'.join(map(re.escape, family.prefixes))})?layers\.(\d+)\.")
    held: dict[int, list[str]] = {}
    for name in names:
        m = pattern.match(name)
        if m is not None and num_layers <= int(m[1]) < num_layers + count:
            held.setdefault(int(m[1]), []).append(name)
    for layer_names in held.values():
        for name in layer_names:
            names.pop(name)
    return tuple(
        f"multi-token-prediction layer {layer} ({len(held[layer])} tensors) not used: "
        "attnlab runs the next-token forward only"
        for layer in sorted(held)
    )


def _mxfp4_pairs(
    files: dict[str, SafetensorsFile], names: dict[str, int], hf: dict[str, Any]
) -> Callable[[str], torch.Tensor] | None:
    """The MXFP4 tensors of a checkpoint whose ``quantization_config`` says ``mxfp4`` (the
    hub's gpt-oss experts), as one float tensor each; None for any other checkpoint.

    Each ``X_blocks`` (E, R, G, 16) uint8 (two E2M1 codes per byte, the low nibble first)
    with its ``X_scales`` (E, R, G) uint8 (one E8M0 exponent per 32 values) becomes ``X``
    in ``names`` (in place) and is dequantised on ``get(X)`` to (E, G * 32, R): the layout
    of transformers' unquantised parameter (``gate_up_proj`` (E, C, 2F)), as transformers'
    ``convert_moe_packed_tensors`` returns it.

    Raises:
        ModelFileError: a ``_blocks`` tensor without its ``_scales`` (or the reverse), a
            dtype or shape that is not MXFP4's (named), values beyond float32.
    """
    quant = hf.get("quantization_config")
    if not isinstance(quant, dict) or quant.get("quant_method") != "mxfp4":
        return None
    pairs: dict[str, tuple[str, str]] = {}
    for name in [n for n in names if n.endswith(("_blocks", "_scales"))]:
        base = name.rsplit("_", 1)[0]
        blocks, scales = f"{base}_blocks", f"{base}_scales"
        if blocks not in names or scales not in names:
            raise ModelFileError(files[name].path, f"has {name!r} without its MXFP4 partner")
        b, sc = files[blocks].tensors[blocks], files[scales].tensors[scales]
        if (
            b.dtype != torch.uint8
            or sc.dtype != torch.uint8
            or len(b.shape) != 4
            or b.shape[-1] != 16
            or b.shape[:-1] != sc.shape
        ):
            raise ModelFileError(
                files[name].path,
                f"MXFP4 tensors {blocks!r} {b.dtype} {b.shape} and {scales!r} {sc.dtype} "
                f"{sc.shape} must be uint8 (E, R, G, 16) and (E, R, G)",
            )
        pairs[base] = (blocks, scales)
    for base, (blocks, scales) in pairs.items():
        names[base] = 2 * names.pop(blocks)
        names.pop(scales)

    def get(name: str) -> torch.Tensor:
        if name not in pairs:
            return files[name].tensor(name)
        blocks, scales = pairs[name]
        packed = files[blocks].tensor(blocks).numpy()  # (E, R, G, 16)
        codes = np.empty((*packed.shape[:-1], 32), dtype=np.uint8)  # (E, R, G, 32)
        np.bitwise_and(packed, 0x0F, out=codes[..., 0::2])
        np.right_shift(packed, 4, out=codes[..., 1::2])
        exponents = files[scales].tensor(scales).numpy()[..., None]  # (E, R, G, 1)
        values = torch.from_numpy(mxfp4_values(codes, exponents))
        check_finite(values, blocks, files[blocks].path)
        E, R, G, _ = packed.shape
        return values.reshape(E, R, G * 32).transpose(1, 2)  # (E, G * 32, R)

    return get


# quantization_config of an FP8 checkpoint (DeepSeek-V3/R1, Kimi K2) -> what attnlab reads
_FP8_KEYS = ("quant_method", "fmt", "activation_scheme", "weight_block_size")
# keys that change nothing attnlab reads: which tensors are FP8 is read from the file
# (every FP8 weight comes with its scales)
_FP8_NOOP_KEYS = ("modules_to_not_convert",)


def dequantize_fp8_blocks(
    codes: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """Block-wise FP8 weights as float32: ``codes[r, c] * scale_inv[r // br, c // bc]``.

    The definition of DeepSeek-V3's FP8 checkpoints (its ``weight_dequant``): one float
    scale per ``block = (br, bc)`` tile of the (R, C) weight, the last row and column of
    tiles partial when R or C is not a multiple of the block.

    Args:
        codes: (R, C) ``torch.float8_e4m3fn``.
        scale_inv: (ceil(R / br), ceil(C / bc)) floats.
        block: ``(br, bc)``, the config's ``weight_block_size``.

    Returns:
        (R, C) float32.

    Raises:
        ValueError: ``scale_inv``'s shape is not the tile grid of ``codes``.

    Shape:
        codes (R, C), scale_inv (ceil(R/br), ceil(C/bc)) -> (R, C).
    """
    R, C = codes.shape
    br, bc = block
    grid = (-(-R // br), -(-C // bc))
    if tuple(scale_inv.shape) != grid:
        raise ValueError(
            f"scales of shape {tuple(scale_inv.shape)} do not tile a ({R}, {C}) weight in "
            f"blocks of {list(block)}: expected {grid}"
        )
    scales = scale_inv.float().repeat_interleave(br, 0)[:R].repeat_interleave(bc, 1)[:, :C]
    return codes.float() * scales  # (R, C)


def _fp8_blocks(
    files: dict[str, SafetensorsFile], names: dict[str, int], hf: dict[str, Any], config_path: Path
) -> Callable[[str], torch.Tensor] | None:
    """The FP8 weights of a checkpoint whose ``quantization_config`` says ``fp8`` (the hub's
    DeepSeek-V3/R1 and Kimi K2), dequantised on ``get`` into float32; None for a
    checkpoint without that config (and without FP8 tensors).

    Read as DeepSeek's and transformers' FP8 format: ``fmt`` ``e4m3`` (or absent),
    ``activation_scheme`` ``dynamic`` (or absent: activations are not quantised, as in
    transformers' ``dequantize=True``), and ``weight_block_size`` ``[br, bc]``. Each 2-D
    ``X.weight`` of dtype F8_E4M3 comes with ``X.weight_scale_inv`` (one float32, bfloat16
    or float16 scale per block, :func:`dequantize_fp8_blocks`), which leaves ``names``
    (in place).

    Raises:
        ModelFileError: another ``quant_method``, ``fmt``, ``activation_scheme`` or an
            unknown ``quantization_config`` key (named); a bad ``weight_block_size``;
            FP8 tensors without an ``fp8`` config; an FP8 weight without its scales (or
            the reverse), of another rank, or with scales of the wrong dtype or shape.
    """
    quant = hf.get("quantization_config")
    fp8 = [n for n in names if files[n].tensors[n].dtype == torch.float8_e4m3fn]
    if not isinstance(quant, dict) or quant.get("quant_method") != "fp8":
        if fp8:
            raise ModelFileError(
                files[fp8[0]].path,
                f"holds FP8 tensor {fp8[0]!r}, but config.json has no `quantization_config` "
                "with quant_method 'fp8' (block scales) to read it with",
            )
        return None
    for key in quant:
        if key not in _FP8_KEYS + _FP8_NOOP_KEYS:
            raise ModelFileError(
                config_path,
                f"`quantization_config.{key}` is not supported for FP8 checkpoints "
                f"(supported: {', '.join(_FP8_KEYS + _FP8_NOOP_KEYS)})",
            )
    for key, supported in (("fmt", "e4m3"), ("activation_scheme", "dynamic")):
        if quant.get(key, supported) != supported:
            raise ModelFileError(
                config_path,
                f"`quantization_config.{key}` = {quant[key]!r} is not supported "
                f"(supported: {supported!r})",
            )
    block = quant.get("weight_block_size")
    if (
        not isinstance(block, list)
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ModelFileError(
            config_path,
            f"`quantization_config.weight_block_size` must be two integers > 0 (rows, "
            f"columns of a block), got {block!r}",
        )
    br, bc = block
    suffix = ".weight_scale_inv"
    scales = {n[: -len(suffix)] + ".weight": n for n in names if n.endswith(suffix)}
    for name in fp8:
        info = files[name].tensors[name]
        scale = scales.get(name)
        if scale is None or len(info.shape) != 2:
            raise ModelFileError(
                files[name].path,
                f"FP8 tensor {name!r} of shape {list(info.shape)} must be 2-D and come with "
                f"{name[: -len('.weight')] + suffix!r} (its block scales)",
            )
        s = files[scale].tensors[scale]
        R, C = info.shape
        grid = [-(-R // br), -(-C // bc)]
        if s.dtype not in (torch.float32, torch.bfloat16, torch.float16) or list(s.shape) != grid:
            raise ModelFileError(
                files[scale].path,
                f"tensor {scale!r} {s.dtype} {list(s.shape)} must be float {grid}: one scale "
                f"per [{br}, {bc}] block of {name!r} {list(info.shape)}",
            )
    for weight, scale in scales.items():
        if weight not in fp8:
            raise ModelFileError(
                files[scale].path, f"has {scale!r} without its FP8 weight {weight!r}"
            )
        names.pop(scale)
    pairs = {weight: scales[weight] for weight in fp8}

    def get(name: str) -> torch.Tensor:
        if name not in pairs:
            return files[name].tensor(name)
        scale = pairs[name]
        scale_inv = files[scale].tensor(scale)
        check_finite(scale_inv, scale, files[scale].path, what="quantisation scale")
        return dequantize_fp8_blocks(files[name].tensor(name), scale_inv, (br, bc))

    return get


def _max_tokens(model: Decoder | Encoder | EncoderDecoder) -> int:
    if isinstance(model, EncoderDecoder):
        return NO_LIMIT  # relative positions
    if isinstance(model, Encoder):
        return model.config.max_tokens
    return model.config.context_length
