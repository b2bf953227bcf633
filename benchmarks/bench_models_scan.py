"""How long `attnlab models` takes on a machine with 30 models: the whole command (a fresh
process: Python, imports, every store read), best of N runs.

The 30 entries are spread over the three stores and a folder, each in its real layout
(``tests/store_files.py``): 8 tiny Hugging Face checkpoints in a hub cache (one without
its weights), 8 Ollama models (tiny GGUF files, and the real SmolLM2 Q4_1 file copied in as
a blob), 6 LM Studio files, and 8 entries in a ``--dir`` folder (4 tiny GGUF files, a broken
one, a model directory, and the real SmolLM2 and Gemma 3 files linked in where installed).
Every entry is read as `attnlab models` reads it: config and headers, never weights.

    PYTHONPATH=src python benchmarks/bench_models_scan.py --runs 5

Writes one record into ``benchmarks/results/`` (``_records.Recorder``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT / "tests")]
from _records import Recorder  # noqa: E402

LLAMA = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}


def _gemma3_file() -> Path | None:
    """The packaged Gemma 3 file (assembled into attnlab's cache once), or None."""
    from attnlab.pretrained.loaders import MissingPackageError, gemma3_path

    try:
        return gemma3_path(announce=lambda line: print(line, file=sys.stderr))
    except MissingPackageError:
        return None


def build(root: Path) -> tuple[dict[str, str], Path, int]:
    """The stores and the folder under ``root``; returns (environment, --dir, entries)."""
    import torch

    from attnlab.pretrained.loaders import smollm2_path
    from model_files import save_hf, write_gguf
    from store_files import hf_cache_repo, lmstudio_model, ollama_model

    src = root / "src"
    llama = save_hf("llama", LLAMA, src / "llama", torch.float32)
    q8, q4 = src / "tiny.Q8_0.gguf", src / "tiny.Q4_0.gguf"
    write_gguf(llama, q8, "llama", "Q8_0")
    write_gguf(llama, q4, "llama", "Q4_0")
    home = root / "home"
    cache = home / ".cache" / "huggingface" / "hub"
    store = home / ".ollama" / "models"
    entries = 0
    for i in range(8):  # the Hugging Face cache; the last one interrupted
        left = ("model.safetensors",) if i == 7 else ()
        hf_cache_repo(cache, f"tiny-org/llama-{i}", llama, commit=f"{i:x}" * 40, leave_out=left)
        entries += 1
    try:
        real: Path | None = smollm2_path()
    except ImportError:
        real = None
    for i in range(7):  # Ollama: the same blob under several tags, as `ollama cp` leaves it
        ollama_model(store, f"tiny{i % 3}", q8 if i % 2 else q4, tag=f"t{i}")
        entries += 1
    ollama_model(store, "smollm2", real or q8, tag="135m")
    entries += 1
    for i in range(6):  # LM Studio
        lmstudio_model(home, "tiny-pub", f"llama-{i}-GGUF", (f"llama-{i}.Q8_0.gguf", q8))
        entries += 1
    folder = root / "mine"
    folder.mkdir()
    for i in range(4):
        shutil.copyfile(q4, folder / f"tiny-{i}.gguf")
    (folder / "broken.gguf").write_bytes(q8.read_bytes()[:4000])
    shutil.copytree(llama, folder / "llama-dir")
    entries += 6
    gemma = _gemma3_file()
    for name, path in (("smollm2.gguf", real), ("gemma3.gguf", gemma)):
        if path is not None and path.is_file():
            os.symlink(path, folder / name)
        else:
            shutil.copyfile(q8, folder / name)
        entries += 1
    env = {
        "HOME": str(home),
        "HF_HOME": str(home / ".cache" / "huggingface"),
        "OLLAMA_MODELS": str(store),
        "HF_HUB_OFFLINE": "1",
    }
    return env, folder, entries


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=5, help="runs of the command (best of)")
    args = parser.parse_args()
    rec = Recorder(
        benchmark="bench_models_scan",
        config="30-entries",
        measured="`attnlab models --json --no-packaged` as a fresh process over a Hugging "
        "Face cache, an Ollama store, an LM Studio folder and a --dir folder holding 30 "
        "models in all (the real SmolLM2 and Gemma 3 files among them), best of the runs; "
        "beside it the process startup alone and the same scan in an already started "
        "process",
        threads=torch.get_num_threads(),
    )
    with tempfile.TemporaryDirectory() as tmp:
        env, folder, entries = build(Path(tmp))
        full = {
            **os.environ,
            **env,
            "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
        }
        command = [sys.executable, "-m", "attnlab", "models", "--json", "--no-packaged"]
        command += ["--dir", str(folder)]
        times, found = [], []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            out = subprocess.run(command, env=full, capture_output=True, text=True, check=True)
            times.append(time.perf_counter() - t0)
            found = json.loads(out.stdout)
        startup = []
        for _ in range(args.runs):  # the same process doing nothing: Python and attnlab's CLI
            t0 = time.perf_counter()
            subprocess.run(
                [sys.executable, "-m", "attnlab", "--version"], env=full, capture_output=True
            )
            startup.append(time.perf_counter() - t0)
        os.environ.update(env)  # the same scan in this process: the reading alone
        from attnlab.pretrained.catalog import find_models

        inside = []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            find_models((folder,), packaged=False)
            inside.append(time.perf_counter() - t0)
    assert len(found) == entries == 30, (len(found), entries)
    loadable = sum(e["loadable"] for e in found)
    rec.add("attnlab models, 30 entries", min(times), "s", better="lower")
    rec.add("per entry", min(times) / len(found) * 1e3, "ms", better="lower")
    rec.add("attnlab --version (startup alone)", min(startup), "s", better="lower")
    rec.add("the scan in process (find_models)", min(inside), "s", better="lower")
    rec.note(
        f"{len(found)} entries found, {loadable} loadable; runs: "
        + ", ".join(f"{t:.2f}" for t in times)
        + " s"
    )
    rec.write()
    print(json.dumps({f.name: round(f.value, 3) for f in rec.figures}))


if __name__ == "__main__":
    main()
