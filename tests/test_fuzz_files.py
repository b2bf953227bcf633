"""Seeded mutation fuzzing of model files (tests/fuzz_files.py): every mutated GGUF file and
Hugging Face directory either loads with finite logits or raises ModelFileError naming the
file; no other exception, no hang, no over-allocation."""

from __future__ import annotations

import importlib.util

import pytest

if not all(importlib.util.find_spec(m) for m in ("transformers", "tokenizers", "gguf")):
    pytest.skip("needs transformers, tokenizers and gguf", allow_module_level=True)

from fuzz_files import Outcome, gguf_layout, make_base_files, run_gguf_case, run_hf_case, sweep

# Bounded for CI: each case is a ~10-30 ms in-process load of a 2-layer model.
GGUF_SEEDS = range(0, 250)
HF_SEEDS = range(0, 250)
SLOW_SEEDS = range(250, 3000)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz-base")
    folder, blob = make_base_files(root)
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


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gguf", "hf"])
def test_fuzz_sweep_larger(base, tmp_path, kind):
    folder, blob, layout = base
    if kind == "gguf":
        counts, failures = sweep(lambda s: run_gguf_case(blob, layout, s, tmp_path), SLOW_SEEDS)
    else:
        counts, failures = sweep(lambda s: run_hf_case(folder, s, tmp_path), SLOW_SEEDS)
    assert not failures, _report(failures)
    assert sum(counts.values()) == len(SLOW_SEEDS)
