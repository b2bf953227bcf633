"""Seeded mutation fuzzing of model files (tests/fuzz_files.py): every mutated GGUF file and
Hugging Face directory either loads with finite logits or raises ModelFileError naming the
file; no other exception, no hang, no over-allocation."""

from __future__ import annotations

import importlib.util

import pytest

if not all(importlib.util.find_spec(m) for m in ("transformers", "tokenizers", "gguf")):
    pytest.skip("needs transformers, tokenizers and gguf", allow_module_level=True)

import math
import shutil

from fuzz_files import (
    GEMMA2_CONFIG_KEYS,
    LLAMA_CONFIG_KEYS,
    REFUSED,
    Outcome,
    edit_config,
    edit_f32,
    edit_int,
    edit_last_type,
    edit_q8_scale,
    edit_safetensors,
    edit_string,
    gguf_layout,
    load_and_check,
    make_base_files,
    make_gemma2_base_files,
    run_gguf_case,
    run_hf_case,
    sweep,
)

# Bounded for CI: each case is a ~10-30 ms in-process load of a 2- or 3-layer model.
GGUF_SEEDS = range(0, 250)
HF_SEEDS = range(0, 250)
GEMMA2_SEEDS = range(0, 100)  # a SentencePiece GGUF file, and Gemma 2's own config keys
# Seeds 0..2999 found 22 distinct kinds of bug (each replayed below as an explicit edit): 12
# below 250, 5 in 250..1249, the other 5 spread over 1250..2999. The slow sweep runs the
# seeds where the findings were dense, and the five later seeds that each found a kind of
# bug of its own; the rest of 1250..2999 found no kind of bug the others missed and is left
# out (64% of the sweep's time).
SLOW_SEEDS = [*range(250, 1250), 1309, 1931, 2024, 2839, 2870]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz-base")
    folder, blob = make_base_files(root)
    return folder, blob, gguf_layout(blob)


@pytest.fixture(scope="module")
def gemma2_base(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz-gemma2")
    folder, blob = make_gemma2_base_files(root)
    return folder, blob, gguf_layout(blob)


def _report(failures: list[tuple[int, str, Outcome]]) -> str:
    return "\n".join(f"seed {s}: {what} -> {o.kind}: {o.detail}" for s, what, o in failures)


def test_fuzzed_gguf_files_load_or_raise_model_file_error(base, tmp_path):
    _, blob, layout = base
    counts, failures = sweep(lambda s: run_gguf_case(blob, layout, s, tmp_path), GGUF_SEEDS)
    assert not failures, _report(failures)
    # The mutations reach both outcomes: the fuzzer is not trivially refused or ignored.
    assert counts.get("loaded", 0) > 20 and counts.get("ModelFileError", 0) > 50, counts


def test_fuzzed_hf_directories_load_or_raise_model_file_error(base, tmp_path):
    folder, _, _ = base
    counts, failures = sweep(lambda s: run_hf_case(folder, s, tmp_path), HF_SEEDS)
    assert not failures, _report(failures)
    assert counts.get("loaded", 0) > 20 and counts.get("ModelFileError", 0) > 50, counts


def test_fuzzed_gemma2_files_load_or_raise_model_file_error(gemma2_base, tmp_path):
    folder, blob, layout = gemma2_base
    for run in (
        lambda s: run_gguf_case(blob, layout, s, tmp_path),
        lambda s: run_hf_case(folder, s, tmp_path, GEMMA2_CONFIG_KEYS),
    ):
        counts, failures = sweep(run, GEMMA2_SEEDS)
        assert not failures, _report(failures)
        assert counts.get("loaded", 0) > 10 and counts.get("ModelFileError", 0) > 10, counts


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gguf", "hf", "gemma2-gguf", "gemma2-hf"])
def test_fuzz_sweep_larger(base, gemma2_base, tmp_path, kind):
    folder, blob, layout = gemma2_base if kind.startswith("gemma2") else base
    if kind.endswith("gguf"):
        counts, failures = sweep(lambda s: run_gguf_case(blob, layout, s, tmp_path), SLOW_SEEDS)
    else:
        keys = GEMMA2_CONFIG_KEYS if kind.startswith("gemma2") else LLAMA_CONFIG_KEYS
        counts, failures = sweep(lambda s: run_hf_case(folder, s, tmp_path, keys), SLOW_SEEDS)
    assert not failures, _report(failures)
    assert sum(counts.values()) == len(SLOW_SEEDS)


# ------------------------------------------------------------------ regressions
# What the fuzzer found, one case per kind of finding, named by the seed that found it
# (seeds 0..2999 of tests/fuzz_files.py before the fixes), replayed as an explicit edit.
# Each must be refused with a ModelFileError naming the file and this text.

NAN16, INF16, NEG_INF16 = b"\x00\x7e", b"\x00\x7c", b"\x00\xfc"
GGUF_REGRESSIONS = {
    # tokenizers' "Error while initializing BPE: Token `Êt` out of vocabulary"
    "seed 15: a merge names a token the vocabulary lacks": (
        lambda b, L: edit_string(b, L, "tokenizer.ggml.merges", "Ġ t", "Ê t"),
        "tokenizer.ggml.merges[0] = 'Ê t' needs the token 'Êt'",
    ),
    "seed 140: a token a merge needs is renamed": (
        lambda b, L: edit_string(b, L, "tokenizer.ggml.tokens", "m", " "),
        "needs the token 'm', which tokenizer.ggml.tokens lacks",
    ),
    # NotImplementedError before
    "seed 1931: an unknown tokenizer model": (
        lambda b, L: edit_string(b, L, "tokenizer.ggml.model", "gpt2", "gat2"),
        "`tokenizer.ggml.model` = 'gat2' is not supported",
    ),
    # numpy's "cannot reshape array of size 2112 into shape (2,8,2,64)" before
    "seed 2024: k rows that do not split into heads": (
        lambda b, L: edit_int(b, L, "dim", "blk.0.attn_k.weight", 33, nth=1),
        "blk.0.attn_k.weight",
    ),
    # gguf's "Dequantization for Q8_1 is not yet implemented" (NotImplementedError) before
    "seed 2870: a type that cannot be dequantised": (
        lambda b, L: edit_last_type(b, L, 9, b"\x00"),
        "Dequantization for Q8_1",
    ),
    # the next five loaded with NaN / inf logits before
    "seed 0: a Q8_0 scale of -inf": (
        lambda b, L: edit_q8_scale(b, L, "blk.1.attn_output.weight", 10, NEG_INF16),
        "tensor 'blk.1.attn_output.weight' holds 1 non-finite quantisation scale(s)",
    ),
    "seed 93: a Q8_0 scale of NaN": (
        lambda b, L: edit_q8_scale(b, L, "blk.1.attn_v.weight", 45, NAN16),
        "tensor 'blk.1.attn_v.weight' holds 1 non-finite quantisation scale(s)",
    ),
    "seed 455: a Q8_0 scale of inf in the output head": (
        lambda b, L: edit_q8_scale(b, L, "output.weight", 300, INF16),
        "tensor 'output.weight' holds 1 non-finite quantisation scale(s)",
    ),
    "seed 2: NaN in an F32 norm": (
        lambda b, L: edit_f32(b, L, "blk.0.attn_norm.weight", 11, math.nan),
        "tensor 'blk.0.attn_norm.weight' holds 1 non-finite value(s)",
    ),
    "seed 29: Q8_0 blocks read as BF16": (
        lambda b, L: edit_last_type(b, L, 30, b"\xff"),  # 0xffff: a bfloat16 NaN
        "non-finite value(s)",
    ),
    # found by the Gemma 2 GGUF sweep: an F32 norm read from another tensor's Q8_0 bytes
    # (finite garbage, NaN logits)
    "gemma2 seed 2093: a tensor's data offset moved onto another tensor": (
        lambda b, L: edit_int(b, L, "data_offset", "blk.0.ffn_norm.weight", 0),
        "overlap in the data",
    ),
}

HF_REGRESSIONS = {
    # AttributeError: 'float' object has no attribute 'values' before (also list, str, bool)
    "seed 16: rope_parameters a number": (
        {"rope_parameters": -0.5},
        "`rope_parameters` must be an object (dict), got float",
    ),
    "seed 236: rope_parameters a list": (
        {"rope_parameters": ["silu"]},
        "`rope_parameters` must be an object (dict), got list",
    ),
    "seed 1144: rope_parameters a string": (
        {"rope_parameters": "silu"},
        "`rope_parameters` must be an object (dict), got str",
    ),
    # OverflowError: int too large to convert to float before
    "seed 182: rms_norm_eps 10^400": ({"rms_norm_eps": 10**400}, "`rms_norm_eps` = 1000"),
    # TypeError: unhashable type before
    "seed 853: hidden_act a list": ({"hidden_act": ["silu"]}, "activation ['silu']"),
    "seed 2839: hidden_act a dict": ({"hidden_act": {"a": 1}}, "activation {'a': 1}"),
    # RotaryEmbedding's ValueError, naming neither file nor key, before
    "seed 599: head_dim 3": ({"head_dim": 3}, "refuses head dim 3 (from `head_dim`"),
    # the next three loaded with NaN / inf logits before
    "seed 60: NaN in a weight": (
        ("model.layers.0.mlp.gate_proj.weight", 42, math.nan),
        "tensor 'model.layers.0.mlp.gate_proj.weight' holds 1 non-finite value(s)",
    ),
    "seed 73: inf in a weight": (
        ("model.layers.0.mlp.down_proj.weight", 24, math.inf),
        "tensor 'model.layers.0.mlp.down_proj.weight' holds 1 non-finite value(s)",
    ),
    "seed 59: safetensors header length one short": ((None, -1, 0.0), "non-finite value(s)"),
}


# Found by the Gemma 2 directory sweep (seeds of --hf-gemma2): a soft-cap of 1e308 is inf
# in float32, and cap * tanh(x / cap) then NaN.
GEMMA2_REGRESSIONS = {
    "seed 328: final_logit_softcapping 1e308": (
        {"final_logit_softcapping": 1e308},
        "`final_logit_softcapping` = 1e+308 is beyond float32's range",
    ),
    "seed 1309: attn_logit_softcapping 1e308": (
        {"attn_logit_softcapping": 1e308},
        "`attn_logit_softcapping` = 1e+308 is beyond float32's range",
    ),
}


@pytest.mark.parametrize("case", sorted(GEMMA2_REGRESSIONS))
def test_fuzz_regression_gemma2_hf(gemma2_base, tmp_path, case):
    folder = shutil.copytree(gemma2_base[0], tmp_path / "found")
    edit, expected = GEMMA2_REGRESSIONS[case]
    edit_config(folder, **edit)
    outcome = load_and_check(folder)
    assert outcome.kind == REFUSED, outcome
    assert expected in outcome.detail and "config.json" in outcome.detail, outcome.detail


@pytest.mark.parametrize("case", sorted(GGUF_REGRESSIONS))
def test_fuzz_regression_gguf(base, tmp_path, case):
    _, blob, layout = base
    edit, expected = GGUF_REGRESSIONS[case]
    path = tmp_path / "found.gguf"
    path.write_bytes(edit(blob, layout))
    outcome = load_and_check(path)
    assert outcome.kind == REFUSED, outcome
    assert expected in outcome.detail and "found.gguf" in outcome.detail, outcome.detail


@pytest.mark.parametrize("case", sorted(HF_REGRESSIONS))
def test_fuzz_regression_hf(base, tmp_path, case):
    folder = shutil.copytree(base[0], tmp_path / "found")
    edit, expected = HF_REGRESSIONS[case]
    if isinstance(edit, dict):
        edit_config(folder, **edit)
        named = "config.json"
    else:
        edit_safetensors(folder, *edit)
        named = "model.safetensors"
    outcome = load_and_check(folder)
    assert outcome.kind == REFUSED, outcome
    assert expected in outcome.detail and named in outcome.detail, outcome.detail
