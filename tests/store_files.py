"""Model stores written in their real layouts, for the tests and the benchmark:

- the Hugging Face hub cache (``models--org--name/{blobs,refs,snapshots}``, the snapshot's
  files links into ``blobs/``), as huggingface_hub writes it;
- Ollama's store (``manifests/registry.ollama.ai/library/NAME/TAG``: a JSON manifest whose
  layers name ``blobs/sha256-<hex>``; the model layer is the GGUF file);
- LM Studio's folder (``models/PUBLISHER/REPO/*.gguf``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

OLLAMA_MODEL = "application/vnd.ollama.image.model"
OLLAMA_TEMPLATE = "application/vnd.ollama.image.template"
OLLAMA_PARAMS = "application/vnd.ollama.image.params"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def hf_cache_repo(
    cache: Path,
    repo_id: str,
    folder: Path,
    *,
    commit: str = "a" * 40,
    refs: tuple[str, ...] = ("main",),
    leave_out: tuple[str, ...] = (),
) -> Path:
    """Put the files of ``folder`` into the hub cache ``cache`` as revision ``commit`` of
    ``repo_id`` (each file a blob named by its sha256, the snapshot's entries relative
    links to them, ``refs/REF`` holding ``commit``); ``leave_out`` files are not put in
    (an interrupted download). Returns the snapshot folder."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    blobs = repo / "blobs"
    snapshot = repo / "snapshots" / commit
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for src in sorted(folder.rglob("*")):
        rel = src.relative_to(folder)
        if src.is_dir() or str(rel) in leave_out:
            continue
        data = src.read_bytes()
        blob = blobs / _sha256(data)
        if not blob.exists():
            blob.write_bytes(data)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def ollama_model(
    store: Path,
    name: str,
    gguf: Path,
    *,
    tag: str = "latest",
    template: str = "{{ .Prompt }}",
    params: dict | None = None,
    link: bool = False,
) -> Path:
    """Put ``gguf`` into Ollama's store ``store`` as ``name:tag`` (the model blob, a template
    and a params layer, a config blob, the manifest). ``link``: the model blob is a link to
    ``gguf`` instead of a copy. Returns the manifest."""
    blobs = store / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)

    def put(data: bytes | None, media: str, source: Path | None = None) -> dict:
        if source is not None:
            h = hashlib.sha256()
            with source.open("rb") as f:
                while block := f.read(1 << 22):
                    h.update(block)
            digest, size = h.hexdigest(), source.stat().st_size
            blob = blobs / f"sha256-{digest}"
            if not blob.exists() and not blob.is_symlink():
                if link:
                    blob.symlink_to(source.resolve())
                else:
                    shutil.copyfile(source, blob)
        else:
            assert data is not None
            digest, size = _sha256(data), len(data)
            (blobs / f"sha256-{digest}").write_bytes(data)
        return {"mediaType": media, "digest": f"sha256:{digest}", "size": size}

    config = put(
        b'{"model_format":"gguf","model_family":"llama"}',
        "application/vnd.docker.container.image.v1+json",
    )
    layers = [
        put(None, OLLAMA_MODEL, gguf),
        put(template.encode(), OLLAMA_TEMPLATE),
        put(json.dumps(params or {"stop": ["<|im_end|>"]}).encode(), OLLAMA_PARAMS),
    ]
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": config,
        "layers": layers,
    }
    namespace, model = name.split("/", 1) if "/" in name else ("library", name)
    path = store / "manifests" / "registry.ollama.ai" / namespace / model / tag
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest))
    return path


def lmstudio_model(home: Path, publisher: str, repo: str, *ggufs: tuple[str, Path]) -> Path:
    """Put GGUF files into LM Studio's folder under ``home`` (``.lmstudio/models``) as
    ``publisher/repo/NAME`` for each ``(NAME, source)``. Returns the repo folder."""
    folder = home / ".lmstudio" / "models" / publisher / repo
    folder.mkdir(parents=True, exist_ok=True)
    for name, source in ggufs:
        shutil.copyfile(source, folder / name)
    return folder
