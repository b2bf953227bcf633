"""benchmarks/bench_llama_cpp.py reads llama-bench's JSON as llama-bench writes it: a real
run of the built peer on a tiny GGUF file made here (skipped when llama.cpp is not built:
``python benchmarks/peers/llama_cpp.py``)."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest
import torch

if not all(importlib.util.find_spec(m) for m in ("transformers", "tokenizers", "gguf")):
    pytest.skip("needs transformers, tokenizers and gguf", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]

import bench_llama_cpp as bench  # noqa: E402

from model_files import save_hf, write_gguf  # noqa: E402

PEERS = bench.peers
PEER = PEERS.find()
if PEER is None:
    pytest.skip(f"llama.cpp is not built: run `{bench.BUILD_COMMAND}`", allow_module_level=True)

pytestmark = pytest.mark.llamacpp

LLAMA = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}


@pytest.fixture(scope="module")
def bench_output(tmp_path_factory) -> str:
    """llama-bench -t 2 -p 8 -n 4 -r 1 -o json on a tiny Llama Q8_0 file."""

    root = tmp_path_factory.mktemp("bench-llama-cpp")
    folder = save_hf("llama", LLAMA, root / "llama", torch.float32)
    path = root / "tiny.Q8_0.gguf"
    # The tiny tokenizer's vocabulary is the byte alphabet alone, so it has no merges and
    # write_gguf writes no merges key; llama.cpp's BPE vocabulary refuses a file without
    # one. One merge of two byte tokens makes the file loadable.
    write_gguf(folder, path, "llama", "Q8_0", extra=lambda w: w.add_token_merges(["Ġ t"]))
    args = ["-m", str(path), "-t", "2", "-p", "8", "-n", "4", "-r", "1", "-o", "json"]
    proc, _ = PEERS.run_bench(PEER, args)  # --repack 0 where the extra buffers crash
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_parse_real_llama_bench_json(bench_output):
    figures = bench.parse_llama_bench(bench_output)
    assert sorted(figures) == ["pp8", "tg4"]
    rows = {(r["n_prompt"], r["n_gen"]): r for r in json.loads(bench_output)}
    for test, tokens, key in (("pp8", 8, (8, 0)), ("tg4", 4, (0, 4))):
        fig, row = figures[test], rows[key]
        assert fig.threads == 2 and len(fig.samples_ts) == 1
        # tokens/s from llama-bench's own nanoseconds, not from the field parsed
        assert fig.avg_ts == pytest.approx(tokens / (row["avg_ns"] * 1e-9), rel=1e-4)
        assert fig.samples_ts[0] == pytest.approx(tokens / (row["samples_ns"][0] * 1e-9), rel=1e-4)
        assert fig.build_commit == PEER.info["llama_cpp_commit"][: len(fig.build_commit)]
        assert "Q8_0" in fig.model_type


def test_parse_refuses_what_it_does_not_understand(bench_output):
    rows = json.loads(bench_output)
    with pytest.raises(ValueError, match="not JSON"):
        bench.parse_llama_bench("| model | size |")  # the default markdown table
    missing = copy.deepcopy(rows)
    del missing[1]["samples_ts"]
    with pytest.raises(ValueError, match="test 1 has no field 'samples_ts'"):
        bench.parse_llama_bench(json.dumps(missing))
    both = copy.deepcopy(rows)
    both[0]["n_gen"] = 4  # a -pg test (prompt then generation): not what the bench asks for
    with pytest.raises(ValueError, match="n_prompt"):
        bench.parse_llama_bench(json.dumps(both))
    with pytest.raises(ValueError, match="non-empty JSON list"):
        bench.parse_llama_bench("[]")
