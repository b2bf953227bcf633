"""Model families as data: one page each, read by the one decoder and the one encoder.

A :class:`Family` says, for one ``model_type`` (Hugging Face ``config.json``) or
``general.architecture`` (GGUF), everything attnlab needs to load it (llama.cpp's split:
tables for the names and hyperparameters, a little code per architecture):

- ``fixed``: the architecture options that never vary in this family (norm kind and
  placement, MLP kind, residual style, position scheme, biases), as fields of
  :class:`attnlab.models.decoder.DecoderConfig` / :class:`attnlab.models.encoder.EncoderConfig`;
- ``keys``: where each remaining field is read in ``config.json`` (the first key present
  wins; ``a.b`` reads a nested dict) and ``defaults`` when none is (a callable default gets
  the fields read so far); a name that is not a config field is an *option* that only the
  family's ``hook`` reads (and removes);
- ``required``: the fields a file must give (every other field has a default);
- ``refuse``: config keys whose value this family cannot express unless it is one of the
  given values (the loader then names the field);
- ``weights``: our module (``{i}`` for the layer index) -> ``(source module, transform)``;
  ``.weight``/``.bias`` follow the module name, ``a|b`` accepts either source name. Keyed
  by target, so a family that differs from another overrides or drops named entries.
  Transforms: ``""`` as is, ``"T"`` transpose (GPT-2's ``Conv1D``), ``"qkv"`` split a fused
  query/key/value projection into ours, ``"T+qkv"`` both, ``"qkv_heads"`` split one
  interleaved per head (GPT-NeoX's ``(H, 3, D)`` rows), ``"gate_up"`` split a fused
  gate/up projection (Phi-3), ``"plus1"`` add 1 (Gemma's RMSNorm multiplies by
  ``1 + weight``), ``"rope_q"``/``"rope_k"`` undo llama.cpp's q/k row permutation,
  ``"Tx"`` swap the last two dims of stacked experts, ``"gate_up_pairs"`` split stacked
  experts' gate/up rows that alternate (gpt-oss: gate the even ones); the targets ``{qkv}``
  and ``{gate_up}`` stand for the pieces; a target ending in ``.weight``, ``.bias`` or
  ``.sinks`` names the parameter itself (a bare tensor such as gpt-oss's
  ``down_proj_bias``);
- ``prefixes`` stripped from source names and ``ignore`` (regexes) for tensors that carry
  nothing the model uses (a pooler, a masked-LM head, buffers);
- the same for GGUF: ``gguf_keys`` (``{arch}`` is the architecture), ``gguf_defaults``
  (what llama.cpp's loader assumes for this architecture where the file says nothing, over
  ``defaults``) and ``gguf_weights`` under llama.cpp's tensor names (empty: no GGUF);
- ``hook``: the family's own code, ``hook(fields, config, source)``: it turns the options
  into config fields (Qwen's window rule, Gemma's local/global layers, GPT-2's score
  switches), in place, and raises ``ValueError`` naming the key it cannot accept;
- ``gguf_arch``: llama.cpp's ``general.architecture`` when it is not ``name``
  (``qwen3moe``, GPT-NeoX's ``gptneox``);
- ``model_types``: more ``model_type`` names for the same page (``gemma3_text``), and
  ``text_config``: the ``config.json`` key that holds the text model's settings in a
  multimodal checkpoint;
- ``mtp_layers``: the ``config.json`` key counting the multi-token-prediction layers a
  checkpoint stores after the model's own (DeepSeek-V3's ``num_nextn_predict_layers``):
  the next-token forward does not use them, so their tensors are left out, and the load
  says so (:attr:`attnlab.models.decoder.Decoder.load_notes`);
- the rest of a family's GGUF rules: ``gguf_rope``, its own reading of a file's RoPE
  scaling (``gguf_rope(fields, metadata, found)`` gets the generic reading in ``found``
  and may pass its own YaRN to it: DeepSeek's score scale, Phi-3's LongRoPE);
  ``gguf_tensors``, options llama.cpp stores as small 1-D tensors (option -> tensor name:
  read for the hooks, left out of the weights); ``gguf_variant_key``, the metadata key
  that makes a file of another family's architecture this one (Mixtral's
  ``llama.expert_count``); ``gguf_note``, said when a family's GGUF files are refused.

Each page is a module of this package (a family, or a few close relatives): the shared
type and readers are in :mod:`~attnlab.models.families.base`, the tables several pages
share in :mod:`~attnlab.models.families.layouts`. Adding a family is adding a page:
a module that builds its :class:`Family`, imported here and listed in :data:`FAMILIES`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from attnlab.latent import MLAConfig as MLAConfig
from attnlab.models.decoder import DecoderConfig as DecoderConfig
from attnlab.models.encoder import EncoderConfig as EncoderConfig
from attnlab.models.encoder_decoder import EncoderDecoderConfig as EncoderDecoderConfig
from attnlab.models.families.base import (
    ACTIVATION_NAMES,
    MAX_EXPERTS,
    Family,
    Hook,
    Source,
    WeightRule,
    WeightTable,
)
from attnlab.models.families.deepseek import DEEPSEEK_V2, DEEPSEEK_V3
from attnlab.models.families.encoders import BERT, ROBERTA
from attnlab.models.families.gemma import (
    GEMMA2,
    GEMMA2_27B_LAYERS,
    GEMMA3,
    GEMMA3_27B_LAYERS,
    GEMMA3_GGUF_LOCAL_BASE,
)
from attnlab.models.families.gpt2 import BLOOM, GPT2, GPT_NEOX
from attnlab.models.families.gpt_oss import GPT_OSS, GPT_OSS_ROPE_THETA, GPT_OSS_SWIGLU
from attnlab.models.families.llama import GRANITE, LLAMA, MISTRAL, MIXTRAL, OLMO2, SMOLLM3
from attnlab.models.families.llama4 import LLAMA4_TEXT
from attnlab.models.families.phi3 import PHI3
from attnlab.models.families.qwen import QWEN2, QWEN3, QWEN3_MOE
from attnlab.models.families.stablelm import STABLELM
from attnlab.models.families.starcoder2 import STARCODER2
from attnlab.models.families.t5 import T5
from attnlab.models.moe import MoEConfig as MoEConfig
from attnlab.rope import RopeConfig as RopeConfig

__all__ = [
    "ACTIVATION_NAMES",
    "BERT",
    "BLOOM",
    "DEEPSEEK_V2",
    "DEEPSEEK_V3",
    "FAMILIES",
    "GEMMA2",
    "GEMMA2_27B_LAYERS",
    "GEMMA3",
    "GEMMA3_27B_LAYERS",
    "GEMMA3_GGUF_LOCAL_BASE",
    "GGUF_VARIANTS",
    "GPT2",
    "GPT_NEOX",
    "GPT_OSS",
    "GPT_OSS_ROPE_THETA",
    "GPT_OSS_SWIGLU",
    "GRANITE",
    "LLAMA",
    "LLAMA4_TEXT",
    "MAX_EXPERTS",
    "MISTRAL",
    "MIXTRAL",
    "OLMO2",
    "PHI3",
    "QWEN2",
    "QWEN3",
    "QWEN3_MOE",
    "ROBERTA",
    "SMOLLM3",
    "STABLELM",
    "STARCODER2",
    "T5",
    "Family",
    "Hook",
    "Source",
    "WeightRule",
    "WeightTable",
    "family_for",
    "gguf_family",
]

# Every page (a new page is listed here).
FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        LLAMA,
        MISTRAL,
        QWEN2,
        QWEN3,
        OLMO2,
        PHI3,
        SMOLLM3,
        LLAMA4_TEXT,
        MIXTRAL,
        QWEN3_MOE,
        DEEPSEEK_V2,
        DEEPSEEK_V3,
        GPT_OSS,
        GEMMA2,
        GEMMA3,
        GRANITE,
        STARCODER2,
        STABLELM,
        GPT_NEOX,
        BLOOM,
        GPT2,
        BERT,
        ROBERTA,
        T5,
    )
}
# config.json `model_type` -> family (a page may answer to several names)
_BY_MODEL_TYPE = {t: f for f in FAMILIES.values() for t in (f.name, *f.model_types)}
# GGUF `general.architecture` -> family: the first page of an architecture answers for it
_BY_GGUF_ARCH: dict[str, Family] = {}
for _family in FAMILIES.values():
    if _family.gguf_variant_key is None:
        _BY_GGUF_ARCH.setdefault(_family.arch, _family)
# Families llama.cpp writes under another's architecture, told apart by a metadata key
# that is present and not 0 (a page's `gguf_variant_key`): Mixtral is "llama" with experts.
GGUF_VARIANTS: dict[str, tuple[tuple[str, str], ...]] = {}
for _family in FAMILIES.values():
    if _family.gguf_variant_key is not None:
        GGUF_VARIANTS.setdefault(_family.arch, ())
        GGUF_VARIANTS[_family.arch] += ((_family.gguf_variant_key, _family.name),)


def gguf_family(architecture: object, metadata: Mapping[str, Any]) -> Family:
    """The family of a GGUF file: its ``general.architecture``'s (:func:`family_for`), or
    the variant its metadata names (:data:`GGUF_VARIANTS`).

    Raises:
        ValueError: as :func:`family_for`.
    """
    for key, name in GGUF_VARIANTS.get(architecture, ()) if isinstance(architecture, str) else ():
        if metadata.get(key) not in (None, 0):
            return FAMILIES[name]
    return family_for(architecture, "gguf")


def family_for(name: object, source: Source = "hf") -> Family:
    """The family for a ``config.json`` ``model_type`` or a GGUF ``general.architecture``.

    Raises:
        ValueError: a missing or unknown name (the message lists the supported ones), or a
            family that attnlab does not read from GGUF files.
    """
    if not isinstance(name, str):
        raise ValueError(f"lacks the model type (which family this is), got {name!r}")
    table = _BY_MODEL_TYPE if source == "hf" else _BY_GGUF_ARCH
    if name not in table:
        raise ValueError(
            f"model type {name!r} is not supported; supported: {', '.join(sorted(table))}"
        )
    family = table[name]
    if source == "gguf" and not family.gguf_weights:
        hint = f"; {family.gguf_note}" if family.gguf_note else ""
        raise ValueError(f"GGUF files of architecture {name!r} are not supported yet{hint}")
    return family
