"""DeepSeek-V2, DeepSeek-V3/R1 and Kimi K2: latent attention (MLA) and grouped experts."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from attnlab.latent import MLAConfig
from attnlab.models.families.base import (
    SIZES,
    Family,
    GgufRope,
    Source,
    WeightTable,
    gguf_positive,
    gguf_yarn_context,
    moe_config,
    pop_count,
    pop_flag,
    pop_option,
    without,
)
from attnlab.models.families.layouts import (
    ATTENTION_BIAS_KEYS,
    GGUF_KEYS_NO_WINDOW,
    LLAMA_DEFAULTS,
    LLAMA_GGUF,
    LLAMA_KEYS,
    LLAMA_WEIGHTS,
    NO_BIAS,
    Q_K_V,
)
from attnlab.rope import RopeConfig, RopeScaling, YarnScaling, yarn_mscale


def _mla(fields: dict[str, Any], config: Mapping[str, Any], source: Source) -> MLAConfig:
    """Latent attention's sizes; the heads' key/value dims come from it, not from
    ``head_dim`` (DeepSeek's ``config.json`` gives the rotary dims there)."""
    q_rank = pop_option(fields, config, "q_lora_rank", source)
    mla = {
        "kv_lora_rank": pop_count(fields, "kv_lora_rank"),
        "qk_nope_head_dim": pop_count(fields, "qk_nope_head_dim"),
        "qk_rope_head_dim": pop_count(fields, "qk_rope_head_dim"),
        "v_head_dim": pop_count(fields, "v_head_dim"),
    }
    if q_rank is not None and (
        isinstance(q_rank, bool) or not isinstance(q_rank, int) or q_rank < 1
    ):
        raise ValueError(f"`q_lora_rank` must be an integer >= 1 or null, got {q_rank!r}")
    width = fields["hidden_size"]
    for key in ("kv_lora_rank", "q_lora_rank"):
        rank = mla.get(key, q_rank)
        if rank is not None and rank > width:
            raise ValueError(
                f"`{key}` = {rank} does not fit: a low-rank projection of width "
                f"{width} (`hidden_size`) has rank at most {width}"
            )
    if mla["qk_rope_head_dim"] % 2:
        raise ValueError(
            f"`qk_rope_head_dim` must be even (RoPE turns pairs), got {mla['qk_rope_head_dim']}"
        )
    heads = fields["num_heads"]
    if fields.get("num_kv_heads", heads) != heads:
        raise ValueError(
            f"`num_key_value_heads` = {fields['num_kv_heads']} must equal `num_attention_heads` "
            f"({heads}): latent attention gives every head its own key and value"
        )
    fields["num_kv_heads"] = heads
    fields["head_dim"] = mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]
    # transformers and DeepSeek's code: the latent norms' epsilon is 1e-6; llama.cpp: the
    # model's RMSNorm epsilon
    eps = fields.get("norm_eps", 1e-6) if source == "gguf" else 1e-6
    return MLAConfig(q_lora_rank=q_rank, latent_eps=eps, **mla)


def yarn_score_scale(head_dim: int, factor: float, m: float, rotation: float = 1.0) -> float:
    """DeepSeek's score scale with YaRN: ``(rotation * mscale)**2 / sqrt(head_dim)``,
    ``mscale`` :func:`~attnlab.rope.yarn_mscale` of ``factor`` and ``m``
    (``mscale_all_dim``); ``rotation`` is the factor cos and sin already carry."""
    return (rotation * yarn_mscale(factor, m)) ** 2 / math.sqrt(head_dim)


def _deepseek_rope(fields: dict[str, Any], config: Mapping[str, Any], interleaved: bool) -> None:
    """RoPE over the ``qk_rope_head_dim`` dims, and DeepSeek's YaRN score scale: the scale
    ``1/sqrt(Dn + Dr)`` times ``mscale**2``, ``mscale = 0.1 * mscale_all_dim * ln(factor) + 1``,
    whenever the RoPE is scaled (transformers' ``yarn_apply_mscale``)."""
    try:
        fields["rope"] = RopeConfig.from_hf_config(config, interleaved=interleaved)
    except (ValueError, TypeError) as e:
        raise ValueError(f"rope settings: {e}") from None
    params = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    kind = params.get("rope_type", params.get("type", "default"))
    all_dim, factor = params.get("mscale_all_dim"), params.get("factor")
    if kind == "default" or not all_dim:
        fields["attn_scale"] = float(fields["head_dim"]) ** -0.5
        return
    for key, value in (("mscale_all_dim", all_dim), ("factor", factor)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"rope `{key}` must be a number > 0, got {value!r}")
    fields["attn_scale"] = yarn_score_scale(fields["head_dim"], float(factor), float(all_dim))  # type: ignore[arg-type]


def _deepseek2_gguf_rope(
    fields: dict[str, Any], metadata: Mapping[str, Any], found: GgufRope
) -> RopeScaling | None:
    """A ``deepseek2`` file's RoPE: the generic reading, with llama.cpp's own YaRN for
    deepseek2 (:func:`_deepseek2_gguf_yarn`), which sets the score scale too."""
    return found.read(lambda: _deepseek2_gguf_yarn(fields, metadata, found.arch))


def _deepseek2_gguf_yarn(
    fields: dict[str, Any], metadata: Mapping[str, Any], arch: str
) -> YarnScaling:
    """YaRN as llama.cpp runs a ``deepseek2`` file: the rotation's scaling, and the score
    scale that goes with it (``fields["attn_scale"]``).

    llama.cpp's deepseek2 reads ``rope.scaling.factor`` f, ``original_context_length``,
    ``rope.scaling.attn_factor`` a (1 when absent) and ``yarn_log_multiplier``, which its
    converter writes as ``0.1 * mscale_all_dim`` and its loader divides by 0.1 (m). cos
    and sin are multiplied by g = a (with m; without it ``a * (0.1 ln f + 1)`` when
    f > 1), and the scores by ``(g * (0.1 m ln f + 1))**2 / sqrt(Dn + Dr)``: transformers'
    DeepSeek YaRN wherever ``mscale`` equals ``mscale_all_dim`` (DeepSeek-V2, V3, R1, Kimi
    K2). The ramp's ends are llama.cpp's fixed 32 and 1 rotations and its extrapolation
    factor 1: deepseek2 does not read ``yarn_beta_fast`` / ``yarn_beta_slow`` /
    ``yarn_ext_factor`` (its converter writes the config's), so a file whose value
    differs would run otherwise than it says and is refused naming the key, as is any
    ``yarn_attn_factor`` (written from a config's ``attention_factor``, never read)."""
    prefix = f"{arch}.rope.scaling."
    for name, used in (("yarn_beta_fast", 32.0), ("yarn_beta_slow", 1.0), ("yarn_ext_factor", 1.0)):
        found = metadata.get(prefix + name)
        if found is not None and found != used:
            raise ValueError(
                f"`{prefix}{name}` = {found!r} is not supported: llama.cpp's deepseek2 does "
                f"not read it and runs with {used:g} (supported: absent or {used:g})"
            )
    if metadata.get(prefix + "yarn_attn_factor") is not None:
        raise ValueError(
            f"`{prefix}yarn_attn_factor` is not supported: llama.cpp's deepseek2 does not "
            "read it (it derives the factor from `yarn_log_multiplier`)"
        )
    factor = gguf_positive(metadata, prefix + "factor", None)
    attn_factor = gguf_positive(metadata, prefix + "attn_factor", 1.0)
    if metadata.get(prefix + "yarn_log_multiplier") is None:
        multiplier = 0.0
        rotation = attn_factor * yarn_mscale(factor)
    else:
        multiplier = gguf_positive(metadata, prefix + "yarn_log_multiplier", None) / 0.1
        rotation = attn_factor
    mla = fields["mla"]
    head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    fields["attn_scale"] = yarn_score_scale(head_dim, factor, multiplier, rotation)
    return YarnScaling(
        factor=factor,
        original_max_position_embeddings=gguf_yarn_context(fields, metadata, prefix),
        attention_factor=rotation,
        truncate=True,
    )


# the MoEConfig's names in its messages -> DeepSeek's config.json keys
_DEEPSEEK_MOE_NAMES = {
    "`groups`": "`n_group`",
    "`top_groups`": "`topk_group`",
    "`top_k`": "`num_experts_per_tok`",
    "`num_experts`": "`n_routed_experts`",
}
_DEEPSEEK_MOE_KEYS = (
    "num_experts_per_tok",
    "moe_intermediate_size",
    "n_shared_experts",
    "routed_scaling_factor",
    "n_group",
    "topk_group",
    "topk_method",
    "norm_topk_prob",
)


def _deepseek_experts(
    fields: dict[str, Any],
    config: Mapping[str, Any],
    source: Source,
    *,
    v3: bool,
    router: str | None = None,
) -> None:
    """DeepSeek's feed-forward: the first ``first_k_dense_replace`` layers dense (width
    ``intermediate_size``), the others ``n_routed_experts`` experts of
    ``moe_intermediate_size`` with ``n_shared_experts`` shared ones (one gated MLP of that
    many times the width), the weights times ``routed_scaling_factor``.

    DeepSeek-V2 routes by softmax, greedily or (``topk_method`` ``group_limited_greedy``)
    within the ``topk_group`` of ``n_group`` groups with the best expert; DeepSeek-V3 (and
    Kimi K2) by sigmoid plus ``e_score_correction_bias`` for the choice, within the groups
    with the best two experts summed, the top-k weights renormalised by ``norm_topk_prob``.
    """
    layers = fields["num_layers"]
    first = pop_count(fields, "first_k_dense_replace", least=0)
    experts = fields.pop("num_local_experts", None)
    if experts is None or experts == 0:
        for key in _DEEPSEEK_MOE_KEYS:
            fields.pop(key, None)
        return
    fields["num_local_experts"] = experts
    size = pop_count(fields, "moe_intermediate_size")
    shared = pop_count(fields, "n_shared_experts", least=0)
    scale = fields.pop("routed_scaling_factor")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"`routed_scaling_factor` must be a number > 0, got {scale!r}")
    groups = pop_option(fields, config, "n_group", source)
    top_groups = pop_option(fields, config, "topk_group", source)
    method = fields.pop("topk_method")
    renormalize = pop_flag(fields, "norm_topk_prob", v3)
    router = router or ("sigmoid" if v3 else "softmax")
    if (not v3 and method == "greedy") or groups in (None, 1):
        groups = top_groups = 1
    else:
        for key, value in (("n_group", groups), ("topk_group", top_groups)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{key}` must be an integer >= 1, got {value!r}")
    moe = moe_config(
        fields,
        size=size,
        renormalize=renormalize,
        router=router,
        shared_size=size * shared if shared else None,
    )
    try:
        fields["moe"] = dataclasses.replace(
            moe,
            routed_scale=float(scale),
            groups=groups,
            top_groups=top_groups,
            group_score="top2" if v3 else "max",
            score_bias=router == "sigmoid",
        )
    except ValueError as e:
        message = str(e)
        for ours, theirs in _DEEPSEEK_MOE_NAMES.items():
            message = message.replace(ours, theirs)
        raise ValueError(message) from None
    fields["layer_moe"] = tuple(i >= first for i in range(layers))


def _deepseek_v2(fields: dict[str, Any], config: Mapping[str, Any], source: Source) -> None:
    """DeepSeek-V2: multi-head latent attention (`kv_lora_rank`, optional `q_lora_rank`,
    `qk_nope_head_dim` + `qk_rope_head_dim`, `v_head_dim`), RoPE on interleaved pairs with
    YaRN's `mscale_all_dim` in the score scale; dense layers before `first_k_dense_replace`,
    then experts with a softmax router (`group_limited_greedy`: within the best `topk_group`
    of `n_group` groups) and `n_shared_experts` shared ones.

    (Details: :func:`_mla`, :func:`_deepseek_rope`, :func:`_deepseek_experts`.)"""
    fields["mla"] = _mla(fields, config, source)
    if source == "hf":
        _deepseek_rope(fields, config, interleaved=True)
    _deepseek_experts(fields, config, source, v3=False)


def _deepseek_v3(fields: dict[str, Any], config: Mapping[str, Any], source: Source) -> None:
    """DeepSeek-V3/R1 and Kimi K2: DeepSeek-V2's latent attention (RoPE on interleaved
    pairs unless `rope_interleave` is false); experts with a sigmoid router, the
    `e_score_correction_bias` shifting the choice, groups scored by their best two experts,
    `norm_topk_prob` and `routed_scaling_factor`.

    GGUF files (llama.cpp's `deepseek2`): :func:`_deepseek2_gguf`."""
    if source == "gguf":
        _deepseek2_gguf(fields, config, source)
        return
    fields["mla"] = _mla(fields, config, source)
    interleaved = pop_flag(fields, "rope_interleave", True)
    if source == "hf":
        _deepseek_rope(fields, config, interleaved=interleaved)
    _deepseek_experts(fields, config, source, v3=True)


# llama.cpp's expert_gating_func: 1 softmax, 2 sigmoid (absent: softmax, as llama.cpp)
_GATING = {1: "softmax", 2: "sigmoid"}


def _deepseek2_gguf(fields: dict[str, Any], config: Mapping[str, Any], source: Source) -> None:
    """A ``deepseek2`` GGUF file as llama.cpp's converter writes it and llama.cpp runs it.

    The file describes the attention as multi-query attention over the latent
    (``attention.key_length`` = r + Dr, ``head_count_kv`` = 1) and gives the expanded
    heads' dims in ``attention.key_length_mla`` / ``value_length_mla``; ``attn_k_b`` /
    ``attn_v_b`` hold the up-projections split for the absorbed product. The router is
    ``expert_gating_func``'s (sigmoid with the ``exp_probs_b`` correction: DeepSeek-V3);
    groups (``expert_group_count`` / ``expert_group_used_count``) are scored by their best
    two experts, as llama.cpp does for every gating function. RoPE turns adjacent pairs,
    with llama.cpp's YaRN and score scale when ``rope.scaling.type`` is ``yarn``.
    """
    fields["family"] = "deepseek2"
    k_mla = fields.pop("key_length_mla")
    if k_mla is None:
        raise ValueError(
            "lacks `deepseek2.attention.key_length_mla`: a file with the unsplit kv_b "
            "tensor (older llama.cpp converters) is not supported; convert it again"
        )
    rope = fields.get("qk_rope_head_dim")
    for key, value in (("key_length_mla", k_mla), ("rope.dimension_count", rope)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`deepseek2.{key}` must be an integer >= 1, got {value!r}")
    fields["qk_nope_head_dim"] = k_mla - rope
    scaling = config.get("deepseek2.rope.scaling.type", "none")
    if scaling not in ("none", "yarn"):  # YaRN: _deepseek2_gguf_yarn
        raise ValueError(
            f"`deepseek2.rope.scaling.type` = {scaling!r} is not supported for deepseek2 "
            "files (supported: 'none', 'yarn')"
        )
    fields["num_kv_heads"] = fields["num_heads"]  # the file's 1 is the MQA view
    # llama.cpp's deepseek2 turns adjacent pairs (its "norm" RoPE) of weights its converter
    # does not permute
    fields["rope_interleaved"] = True
    fields["mla"] = _mla(fields, config, source)
    gating = fields.pop("expert_gating_func")
    if gating not in _GATING:
        raise ValueError(
            f"`deepseek2.expert_gating_func` = {gating!r} is not supported (1: softmax, 2: sigmoid)"
        )
    _deepseek_experts(fields, config, source, v3=True, router=_GATING[gating])


# GGUF keys that describe deepseek2's attention as multi-query over the latent: not the heads
_GGUF_MQA_VIEW = ("num_kv_heads", "head_dim", "value_head_dim", "rope_dims")
_DEEPSEEK_ATTENTION: WeightTable = {
    **{
        f"blocks.{{i}}.attention.{ours}": (f"layers.{{i}}.self_attn.{theirs}", "")
        for ours, theirs in (
            ("W_query", "q_proj"),
            ("W_query.down", "q_a_proj"),
            ("W_query.norm", "q_a_layernorm"),
            ("W_query.up", "q_b_proj"),
            ("kv_down", "kv_a_proj_with_mqa"),
            ("kv_norm", "kv_a_layernorm"),
            ("out_proj", "o_proj"),
        )
    },
}
_DEEPSEEK_WEIGHTS: WeightTable = {
    **without(LLAMA_WEIGHTS, *Q_K_V, "blocks.{i}.attention.out_proj"),
    **_DEEPSEEK_ATTENTION,
    "blocks.{i}.attention.{kv_up}": ("layers.{i}.self_attn.kv_b_proj", "kv_b"),
    "blocks.{i}.mlp.router": ("layers.{i}.mlp.gate", ""),
    # one tensor per expert (transformers' save), or stacked (E, 2F, C) and (E, C, F)
    "blocks.{i}.mlp.experts.gate": ("layers.{i}.mlp.experts.{j}.gate_proj", ""),
    "blocks.{i}.mlp.experts.up": ("layers.{i}.mlp.experts.{j}.up_proj", ""),
    "blocks.{i}.mlp.experts.{gate_up}": ("layers.{i}.mlp.experts.gate_up_proj", "gate_up"),
    "blocks.{i}.mlp.experts.down": (
        "layers.{i}.mlp.experts.{j}.down_proj|layers.{i}.mlp.experts.down_proj",
        "",
    ),
    **{
        f"blocks.{{i}}.mlp.shared.{w}": (f"layers.{{i}}.mlp.shared_experts.{w}_proj", "")
        for w in ("gate", "up", "down")
    },
}
_DEEPSEEK_KEYS: dict[str, tuple[str, ...]] = {
    **{k: v for k, v in LLAMA_KEYS.items() if k not in ("head_dim", "sliding_window")},
    **ATTENTION_BIAS_KEYS,
    "q_lora_rank": ("q_lora_rank",),
    "kv_lora_rank": ("kv_lora_rank",),
    "qk_nope_head_dim": ("qk_nope_head_dim",),
    "qk_rope_head_dim": ("qk_rope_head_dim",),
    "v_head_dim": ("v_head_dim",),
    "num_local_experts": ("n_routed_experts",),
    "num_experts_per_tok": ("num_experts_per_tok",),
    "moe_intermediate_size": ("moe_intermediate_size",),
    "n_shared_experts": ("n_shared_experts",),
    "routed_scaling_factor": ("routed_scaling_factor",),
    "n_group": ("n_group",),
    "topk_group": ("topk_group",),
    "topk_method": ("topk_method",),
    "norm_topk_prob": ("norm_topk_prob",),
    "first_k_dense_replace": ("first_k_dense_replace",),
}
# transformers' DeepseekV2Config defaults
_DEEPSEEK_V2_DEFAULTS: dict[str, Any] = {
    **LLAMA_DEFAULTS,
    **NO_BIAS,
    "norm_eps": 1e-6,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "num_local_experts": 64,
    "moe_intermediate_size": 1407,
    "n_shared_experts": 2,
    "routed_scaling_factor": 1.0,
    "topk_method": "greedy",
    "norm_topk_prob": False,
    "first_k_dense_replace": 0,
}

DEEPSEEK_V2 = Family(
    name="deepseek_v2",
    kind="decoder",
    fixed={"norm": "rms", "mlp": "gated", "positions": "rope", "family": "deepseek_v2"},
    keys=_DEEPSEEK_KEYS,
    defaults=_DEEPSEEK_V2_DEFAULTS,
    required=(*SIZES, "num_experts_per_tok"),
    # transformers' DeepseekV2 router never renormalises, and its MoE layers are every
    # layer from first_k_dense_replace on; biases only where attention_bias says
    refuse={
        "norm_topk_prob": (None, False),
        "moe_layer_freq": (None, 1),
        "mlp_bias": (None, False),
        "topk_method": (None, "greedy", "group_limited_greedy"),
        "scoring_func": (None, "softmax"),
        "pretraining_tp": (None, 1),
    },
    weights=_DEEPSEEK_WEIGHTS,
    prefixes=("model.",),
    ignore=(r".*rotary_emb\.inv_freq$",),
    hook=_deepseek_v2,
)

DEEPSEEK_V3 = dataclasses.replace(
    DEEPSEEK_V2,
    name="deepseek_v3",
    fixed={**DEEPSEEK_V2.fixed, "family": "deepseek_v3"},
    keys={**_DEEPSEEK_KEYS, "rope_interleave": ("rope_interleave",)},
    # transformers' DeepseekV3Config defaults
    defaults={
        **_DEEPSEEK_V2_DEFAULTS,
        "num_local_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 2048,
        "n_shared_experts": 1,
        "routed_scaling_factor": 2.5,
        "n_group": 8,
        "topk_group": 4,
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "first_k_dense_replace": 3,
    },
    required=SIZES,
    refuse={
        "moe_layer_freq": (None, 1),
        "topk_method": (None, "noaux_tc"),
        "scoring_func": (None, "sigmoid"),
        "pretraining_tp": (None, 1),
    },
    weights={
        **_DEEPSEEK_WEIGHTS,
        "blocks.{i}.mlp.score_correction.bias": ("layers.{i}.mlp.gate.e_score_correction_bias", ""),
    },
    hook=_deepseek_v3,
    gguf_rope=_deepseek2_gguf_rope,
    # Kimi K2 is DeepSeek-V3's architecture under its own name
    model_types=("kimi_k2",),
    # DeepSeek-V3's checkpoints carry one (model.layers.61: enorm, hnorm, eh_proj,
    # shared_head, embed_tokens and a decoder layer); transformers ignores it too
    mtp_layers="num_nextn_predict_layers",
    # llama.cpp's deepseek2 (DeepSeek-V2, V3, R1, Kimi K2): see _deepseek2_gguf
    gguf_arch="deepseek2",
    gguf_keys={
        **{k: v for k, v in GGUF_KEYS_NO_WINDOW.items() if k not in _GGUF_MQA_VIEW},
        "q_lora_rank": ("{arch}.attention.q_lora_rank",),
        "kv_lora_rank": ("{arch}.attention.kv_lora_rank",),
        "key_length_mla": ("{arch}.attention.key_length_mla",),
        "v_head_dim": ("{arch}.attention.value_length_mla",),
        "qk_rope_head_dim": ("{arch}.rope.dimension_count",),
        "first_k_dense_replace": ("{arch}.leading_dense_block_count",),
        "num_local_experts": ("{arch}.expert_count",),
        "num_experts_per_tok": ("{arch}.expert_used_count",),
        "moe_intermediate_size": ("{arch}.expert_feed_forward_length",),
        "n_shared_experts": ("{arch}.expert_shared_count",),
        "routed_scaling_factor": ("{arch}.expert_weights_scale",),
        "norm_topk_prob": ("{arch}.expert_weights_norm",),
        "n_group": ("{arch}.expert_group_count",),
        "topk_group": ("{arch}.expert_group_used_count",),
        "expert_gating_func": ("{arch}.expert_gating_func",),
    },
    # what llama.cpp assumes when the file says nothing
    gguf_defaults={
        "q_lora_rank": None,
        "key_length_mla": None,
        "first_k_dense_replace": 0,
        "n_shared_experts": 0,
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": False,
        "n_group": 1,
        "topk_group": 1,
        "expert_gating_func": 1,
    },
    gguf_weights={
        **without(LLAMA_GGUF, *Q_K_V, "blocks.{i}.attention.out_proj"),
        "blocks.{i}.attention.W_query": ("blk.{i}.attn_q", ""),
        "blocks.{i}.attention.W_query.down": ("blk.{i}.attn_q_a", ""),
        "blocks.{i}.attention.W_query.norm": ("blk.{i}.attn_q_a_norm", ""),
        "blocks.{i}.attention.W_query.up": ("blk.{i}.attn_q_b", ""),
        "blocks.{i}.attention.kv_down": ("blk.{i}.attn_kv_a_mqa", ""),
        "blocks.{i}.attention.kv_norm": ("blk.{i}.attn_kv_a_norm", ""),
        "blocks.{i}.attention.k_up": ("blk.{i}.attn_k_b", "k_b"),
        "blocks.{i}.attention.v_up": ("blk.{i}.attn_v_b", "v_b"),
        "blocks.{i}.attention.out_proj": ("blk.{i}.attn_output", ""),
        "blocks.{i}.mlp.router": ("blk.{i}.ffn_gate_inp", ""),
        "blocks.{i}.mlp.score_correction.bias": ("blk.{i}.exp_probs_b", ""),
        **{
            f"blocks.{{i}}.mlp.experts.{w}": (f"blk.{{i}}.ffn_{w}_exps", "")
            for w in ("gate", "up", "down")
        },
        **{
            f"blocks.{{i}}.mlp.shared.{w}": (f"blk.{{i}}.ffn_{w}_shexp", "")
            for w in ("gate", "up", "down")
        },
    },
)
