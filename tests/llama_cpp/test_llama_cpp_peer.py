"""benchmarks/peers/llama_cpp.py without building anything: where the cache is, when a
folder counts as built, and which llama.cpp commit a llama-cpp-python release vendors."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _peer():
    spec = importlib.util.spec_from_file_location(
        "peer_llama_cpp", ROOT / "benchmarks" / "peers" / "llama_cpp.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


peer = _peer()

CHANGELOG = """# Changelog

## [Unreleased]

## [0.3.36]

- feat: update llama.cpp to ggml-org/llama.cpp@0c1e57098

## [0.3.35]

- feat: update llama.cpp to ggml-org/llama.cpp@4df29be4f
- fix(example): retain recurrent state
- feat: update llama.cpp to ggml-org/llama.cpp@adb55e514

## [0.3.34]

- fix: something without a llama.cpp update
"""


def test_the_vendored_commit_is_the_newest_of_the_release_section():
    assert peer._vendored_commit(CHANGELOG, "0.3.36") == "0c1e57098"
    assert peer._vendored_commit(CHANGELOG, "0.3.35") == "4df29be4f"
    assert peer._vendored_commit(CHANGELOG, "0.3.34") is None
    assert peer._vendored_commit(CHANGELOG, "0.3.3") is None  # not a prefix match


def test_the_cache_folder_follows_attnlab_peers(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNLAB_PEERS", str(tmp_path))
    assert peer.cache_dir() == tmp_path / "llama.cpp"
    monkeypatch.delenv("ATTNLAB_PEERS")
    assert peer.cache_dir() == Path.home() / ".cache" / "attnlab" / "peers" / "llama.cpp"


def test_a_folder_counts_as_built_only_with_its_record_tools_and_converter(tmp_path):
    root = tmp_path / "llama.cpp"
    assert peer.find(root) is None
    (root / "src").mkdir(parents=True)
    (root / "src" / "convert_hf_to_gguf.py").write_text("")
    (root / "converter-packages" / "transformers").mkdir(parents=True)
    (root / peer.RECORD).write_text(json.dumps({"llama_cpp_python": "0.3.36"}))
    assert peer.find(root) is None  # no tools
    (root / "build" / "bin").mkdir(parents=True)
    for tool in peer.TOOLS:
        path = root / "build" / "bin" / tool
        path.write_text("")
        os.chmod(path, 0o755)
    found = peer.find(root)
    assert found is not None and found.tool("llama-quantize") == path.parent / "llama-quantize"
    assert found.info["llama_cpp_python"] == "0.3.36"
    (root / peer.RECORD).unlink()  # written last: without it the build did not finish
    assert peer.find(root) is None
