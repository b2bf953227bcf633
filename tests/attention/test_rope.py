"""attnlab.rope: RoPE variants against transformers' own rope functions, computed here."""

from __future__ import annotations

import pytest
import torch

from attnlab.attention import Attention, KVCache
from attnlab.rope import (
    DynamicNTKScaling,
    LinearScaling,
    Llama3Scaling,
    RopeConfig,
    RotaryEmbedding,
    YarnScaling,
    table_length,
)
from reference import tol

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.gpt_neox.modeling_gpt_neox import (  # noqa: E402
    apply_rotary_pos_emb as neox_apply_rotary,
)
from transformers.models.gptj.modeling_gptj import (  # noqa: E402
    apply_rotary_pos_emb as gptj_apply_rotary,
)
from transformers.models.gptj.modeling_gptj import create_sinusoidal_positions  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: E402

F64 = tol(torch.float64)
HEAD_DIM, MAX_POS, ORIG = 32, 256, 64  # trained for ORIG, extended to MAX_POS

# rope_parameters as Hugging Face writes them, one per scaling type.
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": ORIG,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG},
    "yarn-deepseek": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": ORIG,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
        "beta_fast": 16,
        "beta_slow": 2,
    },
    "yarn-attention-factor": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": ORIG,
        "attention_factor": 1.3,
        "truncate": False,
    },
}


def hf_config(params: dict, fraction: float = 1.0, base: float = 10000.0) -> LlamaConfig:
    rope = {**params, "rope_theta": base}
    if fraction != 1.0:
        rope["partial_rotary_factor"] = fraction
    # dynamic NTK grows past max_position_embeddings, so there it is the original length
    max_pos = ORIG if params["rope_type"] == "dynamic" else MAX_POS
    return LlamaConfig(
        hidden_size=4 * HEAD_DIM,
        num_attention_heads=4,
        head_dim=HEAD_DIM,
        max_position_embeddings=max_pos,
        rope_parameters=rope,
    )


def hf_rotate(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, factor: float):
    """transformers' rotate-half application (GPT-NeoX's, which handles partial rotary) with
    cos/sin built from transformers' inverse frequencies, in fp64."""
    freqs = pos.double()[:, None] * inv_freq.double()  # (T, R/2)
    emb = torch.cat((freqs, freqs), dim=-1)[None]  # (1, T, R)
    q, _ = neox_apply_rotary(x, x, emb.cos() * factor, emb.sin() * factor)
    return q


@pytest.mark.parametrize("fraction", [1.0, 0.5], ids=["full", "partial"])
@pytest.mark.parametrize("name", list(SCALINGS))
def test_scaled_frequencies_match_transformers(name, fraction):
    """inv_freq and the attention factor equal transformers' ROPE_INIT_FUNCTIONS for the same
    config values, and the rotation at positions past the original context equals
    transformers' application of them."""
    cfg = hf_config(SCALINGS[name], fraction)
    kind = cfg.rope_parameters["rope_type"]
    seq_len = 3 * ORIG + 5  # past the original context
    hf_inv, hf_factor = ROPE_INIT_FUNCTIONS[kind](cfg, None, seq_len=seq_len)
    rope = RotaryEmbedding.from_hf_config(cfg.to_dict())
    assert rope.rotary_dims == int(HEAD_DIM * fraction)
    assert rope.config.scaling is not None and rope.config.scaling.kind == kind
    pos = torch.arange(2 * ORIG, seq_len)
    x = torch.randn(2, 3, pos.numel(), HEAD_DIM, dtype=torch.float64)
    got = rope(x, pos)  # for dynamic this call grows the frequencies to seq_len
    torch.testing.assert_close(rope.inv_freq, hf_inv, rtol=1e-6, atol=0)
    assert rope.attention_factor == pytest.approx(hf_factor, rel=1e-12)
    torch.testing.assert_close(got, hf_rotate(x, pos, rope._inv, hf_factor), **F64)
    torch.testing.assert_close(got, hf_rotate(x, pos, hf_inv, hf_factor), rtol=0, atol=1e-4)
    if fraction != 1.0:  # the pass-through dims are untouched
        torch.testing.assert_close(got[..., rope.rotary_dims :], x[..., rope.rotary_dims :])


def test_transformers_4_config_form_reads_the_same():
    """The old form (rope_theta + rope_scaling with "type") gives the same RopeConfig."""
    old = {
        "hidden_size": 128,
        "num_attention_heads": 4,
        "max_position_embeddings": MAX_POS,
        "rope_theta": 5e5,
        "partial_rotary_factor": 0.5,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    }
    new = hf_config(SCALINGS["yarn"], 0.5, base=5e5).to_dict()
    assert RopeConfig.from_hf_config(old) == RopeConfig.from_hf_config(new)
    assert RopeConfig.from_hf_config(old) == RopeConfig(
        base=5e5, fraction=0.5, scaling=YarnScaling(factor=4.0, original_max_position_embeddings=64)
    )
    # GPT-NeoX's rotary_pct and GPT-J's rotary_dim are fractions too
    assert RopeConfig.from_hf_config({"rotary_pct": 0.25}).fraction == 0.25
    gptj = {"hidden_size": 256, "num_attention_heads": 4, "rotary_dim": 16}
    assert RopeConfig.from_hf_config(gptj, interleaved=True) == RopeConfig(
        fraction=0.25, interleaved=True
    )


def test_per_layer_type_rope_parameters():
    cfg = {
        "head_dim": 16,
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    }
    full = RopeConfig.from_hf_config(cfg, layer_type="full_attention")
    assert full == RopeConfig(base=1e6, scaling=LinearScaling(8.0))
    assert RotaryEmbedding.from_hf_config(cfg, layer_type="sliding_attention").base == 1e4
    with pytest.raises(ValueError, match="layer_type"):
        RopeConfig.from_hf_config(cfg)


def test_dynamic_ntk_follows_transformers_dynamic_update():
    """A sequence of calls (prefill past the original context, decode steps, a short call
    that resets) gives transformers' LlamaRotaryEmbedding cos/sin at every call."""
    cfg = hf_config(SCALINGS["dynamic"])
    hf = LlamaRotaryEmbedding(cfg)
    rope = RotaryEmbedding.from_hf_config(cfg.to_dict())
    x = torch.zeros(1, 1, 1, HEAD_DIM)
    calls = [
        torch.arange(0, 10),  # inside the original context
        torch.arange(0, 3 * ORIG),  # grows
        torch.tensor([3 * ORIG]),  # decode: grows again
        torch.tensor([3 * ORIG + 1]),
        torch.arange(ORIG, 2 * ORIG),  # shorter but past the original: keeps the grown base
        torch.arange(0, 5),  # inside: resets
    ]
    for pos in calls:
        hf_cos, hf_sin = hf(x, pos[None])
        cos, sin = rope.cos_sin(pos)
        torch.testing.assert_close(cos.float(), hf_cos[0], rtol=0, atol=2e-5)
        torch.testing.assert_close(sin.float(), hf_sin[0], rtol=0, atol=2e-5)
        torch.testing.assert_close(rope.inv_freq, hf.inv_freq, rtol=1e-6, atol=0)


@pytest.mark.parametrize("rotary_dim", [32, 8])
def test_interleaved_matches_gptj(rotary_dim):
    """Interleaved pairs with partial rotary, as GPT-J's own functions apply them."""
    D, T = 32, 11
    x = torch.randn(2, T, 3, D, dtype=torch.float64)  # GPT-J's (B, T, H, D)
    pos = torch.arange(100, 100 + T)
    sincos = create_sinusoidal_positions(200, rotary_dim).double()[pos][None]  # (1, T, R)
    sin, cos = torch.split(sincos, rotary_dim // 2, dim=-1)
    rot = gptj_apply_rotary(x[..., :rotary_dim], sin, cos)
    expected = torch.cat([rot, x[..., rotary_dim:]], dim=-1).transpose(1, 2)  # (B, H, T, D)
    rope = RotaryEmbedding(D, fraction=rotary_dim / D, interleaved=True)
    got = rope(x.transpose(1, 2), pos)
    # GPT-J's table is fp32; ours is fp64
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    if rotary_dim != D:
        with pytest.raises(AssertionError):  # the convention matters
            torch.testing.assert_close(RotaryEmbedding(D)(x.transpose(1, 2), pos), expected)


@pytest.mark.parametrize(
    "config",
    [
        RopeConfig(fraction=0.5, interleaved=True),
        RopeConfig(scaling=YarnScaling(factor=4.0, original_max_position_embeddings=16)),
        RopeConfig(
            base=5e5,
            scaling=Llama3Scaling(
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
    ],
    ids=["partial-interleaved", "yarn", "llama3"],
)
def test_layer_with_rope_config_cache_equals_full_pass(config):
    """Every variant keeps scores relative (cache == full pass) inside the layer."""
    torch.manual_seed(0)
    layer = Attention(64, 4, num_kv_heads=2, rope=config).double()
    assert layer.rope is not None and layer.rope.config == config
    x = torch.randn(2, 40, 64, dtype=torch.float64)
    full = layer(x, is_causal=True)
    cache = KVCache()
    parts = [layer(x[:, :25], is_causal=True, kv_cache=cache)]
    parts += [layer(x[:, t : t + 1], is_causal=True, kv_cache=cache) for t in range(25, 40)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, **F64)


def test_scores_depend_only_on_relative_position_for_each_convention():
    q, k = torch.randn(2, 1, 1, 1, 16, dtype=torch.float64)
    for rope in (
        RotaryEmbedding(16, interleaved=True, fraction=0.5),
        RotaryEmbedding(16, scaling=LinearScaling(2.0)),
    ):

        def score(pq: int, pk: int, rope: RotaryEmbedding = rope) -> float:
            a = rope(q, torch.tensor([pq]))
            b = rope(k, torch.tensor([pk]))
            return float((a * b).sum())

        assert score(7, 3) == pytest.approx(score(107, 103), abs=1e-9)
        assert score(7, 3) != pytest.approx(score(7, 4), abs=1e-6)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: RotaryEmbedding(10, fraction=0.3), "fraction"),  # 3 rotated dims
        (lambda: RotaryEmbedding(16, fraction=0.0), "fraction"),
        (lambda: RotaryEmbedding(16, fraction=1.5), "fraction"),
        (lambda: RotaryEmbedding(16, scaling="yarn"), "scaling"),  # type: ignore[arg-type]
        (lambda: RopeConfig(base=-1.0), "base"),
        (lambda: LinearScaling(factor=0.0), "factor"),
        (lambda: Llama3Scaling(8.0, 4.0, 1.0, 8192), "high_freq_factor"),
        (lambda: YarnScaling(4.0, original_max_position_embeddings=-1), "original_max"),
        (lambda: DynamicNTKScaling(2.0, max_position_embeddings=0), "max_position_embeddings"),
        (lambda: RopeConfig.from_hf_config({"rope_scaling": {"type": "longrope"}}), "rope_type"),
        (lambda: RopeConfig.from_hf_config({"rope_scaling": {"type": "linear"}}), "factor"),
        (
            lambda: RotaryEmbedding.from_hf_config({"rope_theta": 1e4}),
            "hidden_size",
        ),
    ],
)
def test_bad_rope_input_names_the_argument(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_fraction_leaving_two_dims_is_fine_and_odd_is_not():
    assert Attention(32, 4, rope=RopeConfig(fraction=0.25)).rope.rotary_dims == 2  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="fraction"):
        Attention(24, 4, rope=RopeConfig(fraction=0.5))  # D=6 -> 3 rotated dims


def test_frequency_factors_divide_each_frequency_and_check_their_count():
    """FrequencyFactors (llama.cpp's rope_freqs) with the divisors Llama 3 scaling implies
    gives Llama3Scaling's frequencies; a wrong count or a non-positive factor is refused."""
    from attnlab.rope import FrequencyFactors, Llama3Scaling

    llama3 = Llama3Scaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32
    )
    inv, _ = llama3.frequencies(10000.0, 16)
    plain = 1.0 / 10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    factors = FrequencyFactors(tuple((plain / inv).tolist()))
    got, attention_factor = factors.frequencies(10000.0, 16)
    torch.testing.assert_close(got, inv, atol=0, rtol=1e-12)
    assert attention_factor == 1.0 and factors.factors[0] == 1.0 and factors.factors[-1] == 8.0
    with pytest.raises(ValueError, match="R/2 = 4"):
        factors.frequencies(10000.0, 8)
    with pytest.raises(ValueError, match="factors"):
        FrequencyFactors((1.0, 0.0))
    with pytest.raises(TypeError, match="tuple"):
        FrequencyFactors([1.0, 2.0])  # type: ignore[arg-type]


def test_the_tables_grow_by_a_quarter_and_give_the_same_values():
    """A prompt's tables, then one position more (the first decode step after it): the
    tables grow to 1.25x, not 2x, and hold what tables built at that length hold."""
    assert table_length(0, 10) == 1024 and table_length(0, 4096) == 4096
    assert table_length(4096, 4097) == 5120 and table_length(8192, 8193) == 10240
    assert table_length(4096, 9000) == 9000
    rope = RotaryEmbedding(32, base=1e4)
    rope.cos_sin(torch.arange(4096))
    assert rope._cos is not None and rope._cos.shape[0] == 4096
    cos, sin = rope.cos_sin(torch.arange(4097))
    assert rope._cos.shape[0] == 5120
    fresh = RotaryEmbedding(32, base=1e4)
    want_cos, want_sin = fresh.cos_sin(torch.arange(4097))
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
