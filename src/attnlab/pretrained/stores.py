"""Models where people keep them: the Hugging Face cache, Ollama's store, LM Studio's folder.

:func:`locate` turns a ``--model`` name that is not a packaged name or a path into the
directory or GGUF file it stands for, offline:

- ``org/name[@revision]``: a Hugging Face repo in the local cache, resolved by
  huggingface_hub itself (``snapshot_download(..., local_files_only=True)``) in the cache
  ``HF_HUB_CACHE`` / ``HF_HOME`` name (read when called, as huggingface_hub reads them
  when imported); a repo of GGUF files only takes ``org/name/FILE.gguf`` when it holds
  several;
- ``ollama:NAME[:TAG]`` (tag ``latest``): the model layer of the manifest in Ollama's store
  (``$OLLAMA_MODELS`` or ``~/.ollama/models``), a blob named by its sha256 (the template
  and params layers are not read: Ollama's templates are Go templates, and the GGUF file's
  own chat template serves ``--chat``);
- ``lmstudio:PUBLISHER/REPO[/FILE]``: a GGUF file in LM Studio's folder
  (``~/.lmstudio/models``, or the older ``~/.cache/lm-studio/models``).

Nothing here touches the network. Every file found is as untrusted as a path the user
typed: a link that leads out of its store is refused, an Ollama blob whose sha256 is not
its name is refused (:meth:`Located.verify`, before loading), and the loaders check the
files as they check any other.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnlab.pretrained.errors import ModelFileError

__all__ = [
    "HF_PLACE",
    "LMSTUDIO_PLACE",
    "OLLAMA_PLACE",
    "Located",
    "ModelNotFoundError",
    "check_blob",
    "hf_cache_dir",
    "is_store_name",
    "lmstudio_dir",
    "lmstudio_models",
    "locate",
    "ollama_dir",
    "ollama_models",
]

HF_PLACE = "Hugging Face cache"
OLLAMA_PLACE = "Ollama"
LMSTUDIO_PLACE = "LM Studio"

OLLAMA_MODEL = "application/vnd.ollama.image.model"
OLLAMA_HOST = "registry.ollama.ai"
MAX_MANIFEST_BYTES = 1 << 20

_HF_ID = re.compile(
    r"^[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}(?:/[\w.-]+\.gguf)?(?:@[\w.-]+(?:/[\w.-]+)*)?$"
)
_OLLAMA_PART = re.compile(r"^[A-Za-z0-9][\w.-]{0,127}$")
_LMSTUDIO_PART = re.compile(r"^[\w.-][\w. ()+-]{0,254}$")


class ModelNotFoundError(ValueError):
    """A store name (``org/name``, ``ollama:...``, ``lmstudio:...``) that is not on this
    machine; the message says where it looked and the command that would fetch it."""


@dataclass(frozen=True)
class Located:
    """Where a store name lives.

    Attributes:
        name: the name as given.
        path: the model directory or GGUF file to load.
        root: the store folder every file of the model must stay inside.
        place: ``"Hugging Face cache"``, ``"Ollama"`` or ``"LM Studio"``.
        digest: an Ollama blob's expected sha256 (hex), checked by :meth:`verify`.
        size: the size the Ollama manifest gives the blob, or None.
    """

    name: str
    path: Path
    root: Path
    place: str
    digest: str | None = None
    size: int | None = None

    def verify(self, announce: Callable[[str], None] | None = None) -> None:
        """Check what cannot be checked by reading a header: an Ollama blob's sha256
        against the digest it is named by (reads the whole blob once).

        Raises:
            ModelFileError: the blob's size or sha256 is not the manifest's (the blob named).
        """
        if self.digest is None:
            return
        check_blob(self.path, self.digest, self.size, self.name, announce=announce)


def _no_hidden_sep(value: str) -> bool:
    return ".." not in value.split("/") and "\x00" not in value and "\\" not in value


def is_store_name(name: str) -> bool:
    """Whether ``name`` has the shape of a store name (not whether the model is here)."""
    if name.startswith(("ollama:", "lmstudio:")):
        return True
    return bool(_HF_ID.match(name)) and _no_hidden_sep(name)


def locate(name: str) -> Located | None:
    """The directory or GGUF file a store name stands for, found offline.

    Args:
        name: ``org/name[@revision]`` (or ``org/name/FILE.gguf``), ``ollama:NAME[:TAG]``
            or ``lmstudio:PUBLISHER/REPO[/FILE]``.

    Returns:
        A :class:`Located`, or None when ``name`` is none of these forms.

    Raises:
        ModelNotFoundError: the model is not in its store (what was looked for, where, and
            the command that fetches it).
        ModelFileError: it is there but cannot be used: weights missing from a Hugging Face
            snapshot (with the ``hf download`` line), a link leading out of the store, a
            broken manifest, several GGUF files to choose from (listed).
    """
    if not isinstance(name, str):
        return None
    if name.startswith("ollama:"):
        return _locate_ollama(name)
    if name.startswith("lmstudio:"):
        return _locate_lmstudio(name)
    if is_store_name(name):
        return _locate_hf(name)
    return None


def _inside_store(path: Path, root: Path, what: str) -> Path:
    """``path`` resolved (links followed), refused unless it stays inside ``root``."""
    real = path.resolve()
    if not real.is_relative_to(root.resolve()):
        raise ModelFileError(
            path,
            f"leads to {real}, outside {what} ({root}); a link out of the store is refused",
        )
    return real


# ---------------------------------------------------------------------- Hugging Face


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache: ``$HF_HUB_CACHE`` (or the older
    ``$HUGGINGFACE_HUB_CACHE``), else ``$HF_HOME/hub``, else
    ``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``: huggingface_hub's
    own order, read now (huggingface_hub reads it once, when imported)."""
    env = os.environ
    home = env.get("HF_HOME") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "huggingface",
    )
    home = os.path.expandvars(os.path.expanduser(home))
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return Path(os.path.expandvars(os.path.expanduser(cache)))


def _fetch_line(repo_id: str, revision: str | None) -> str:
    return f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")


def _locate_hf(name: str) -> Located:
    repo_id, _, revision = name.partition("@")
    parts = repo_id.split("/")
    repo_id, file = "/".join(parts[:2]), (parts[2] if len(parts) == 3 else None)
    rev = revision or None
    cache = hf_cache_dir()
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - transformers users have it
        raise ModelNotFoundError(
            f"--model {name!r} looks like a Hugging Face repo id, and reading the cache "
            "needs huggingface_hub: pip install 'attnlab[pretrained]'"
        ) from None
    try:
        snapshot = Path(
            snapshot_download(repo_id, revision=rev, cache_dir=cache, local_files_only=True)
        )
    except Exception as e:  # huggingface_hub's not-in-cache / incomplete / bad-id errors
        kind = type(e).__name__
        raise ModelNotFoundError(
            f"{repo_id}{'@' + rev if rev else ''} is not in the Hugging Face cache ({cache}"
            f"{'' if kind.startswith('LocalEntryNotFound') else f'; {kind}'}), nor a file or "
            f"directory of that name here; fetch it with: {_fetch_line(repo_id, rev)}"
        ) from None
    root = cache / f"models--{repo_id.replace('/', '--')}"
    _inside_store(snapshot, root, "its Hugging Face cache folder")
    for entry in snapshot.rglob("*"):
        _inside_store(entry, root, "its Hugging Face cache folder")
    fetch = _fetch_line(repo_id, rev)
    if file is not None:
        path = snapshot / file
        if not path.is_file():
            raise ModelFileError(
                path, f"is missing from the cached snapshot; fetch it with: {fetch} {file}"
            )
        return Located(name, path, root, HF_PLACE)
    if (snapshot / "config.json").is_file():
        _check_hf_weights(snapshot, fetch)
        return Located(name, snapshot, root, HF_PLACE)
    ggufs = sorted(p.name for p in snapshot.glob("*.gguf") if not p.name.startswith("mmproj"))
    if len(ggufs) == 1:
        return Located(name, snapshot / ggufs[0], root, HF_PLACE)
    if ggufs:
        raise ModelFileError(
            snapshot,
            f"holds {len(ggufs)} GGUF files; choose one: "
            + ", ".join(f"{repo_id}/{g}{'@' + rev if rev else ''}" for g in ggufs),
        )
    raise ModelFileError(
        snapshot, f"has no config.json (the model config) in the cache; fetch it with: {fetch}"
    )


def _check_hf_weights(snapshot: Path, fetch: str) -> None:
    """A snapshot whose weights are not all there: one error naming what is missing."""
    index = snapshot / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_bytes()).get("weight_map", {})
        except (ValueError, AttributeError):
            return  # the loader names what is wrong with the index
        if isinstance(weight_map, dict):
            missing = sorted(
                {
                    s
                    for s in weight_map.values()
                    if isinstance(s, str) and not (snapshot / s).is_file()
                }
            )
            if missing:
                raise ModelFileError(
                    snapshot,
                    f"lacks the weight file(s) {', '.join(missing)} named by "
                    f"model.safetensors.index.json; fetch them with: {fetch}",
                )
        return
    if (snapshot / "model.safetensors").is_file():
        return
    if (snapshot / "pytorch_model.bin").exists():
        return  # the loader explains why it never opens a pickle
    raise ModelFileError(
        snapshot,
        f"lacks the weights (model.safetensors or model.safetensors.index.json); fetch them "
        f"with: {fetch}",
    )


# ------------------------------------------------------------------------------ Ollama


def ollama_dir() -> Path:
    """Ollama's store: ``$OLLAMA_MODELS``, else ``~/.ollama/models``."""
    env = os.environ.get("OLLAMA_MODELS")
    return Path(env).expanduser() if env else Path.home() / ".ollama" / "models"


def _ollama_parts(name: str) -> tuple[str, str, str]:
    """``NAME[:TAG]`` -> (host, namespace/model path, tag), Ollama's defaults filled in."""
    body = name[len("ollama:") :]
    ref, _, tag = body.rpartition(":") if ":" in body.split("/")[-1] else (body, "", "")
    tag = tag or "latest"
    parts = ref.split("/") if ref else []
    if not 1 <= len(parts) <= 3 or not all(_OLLAMA_PART.match(p) for p in [*parts, tag]):
        raise ModelNotFoundError(
            f"--model {name!r} is not an Ollama name: expected ollama:NAME[:TAG] "
            "(e.g. ollama:llama3.2, ollama:qwen2.5:0.5b)"
        )
    if any(p in ("..", ".") for p in parts):
        raise ModelNotFoundError(f"--model {name!r}: an Ollama name has no '..' or '.' parts")
    if len(parts) == 1:
        parts = [OLLAMA_HOST, "library", parts[0]]
    elif len(parts) == 2:
        parts = [OLLAMA_HOST, *parts]
    return parts[0], "/".join(parts[1:]), tag


def _read_manifest(path: Path) -> dict[str, Any]:
    size = path.stat().st_size
    if size > MAX_MANIFEST_BYTES:
        raise ModelFileError(path, f"is {size} bytes, more than a manifest's {MAX_MANIFEST_BYTES}")
    try:
        data = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ModelFileError(path, f"is not valid JSON ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("layers"), list):
        raise ModelFileError(path, "is not an Ollama manifest (a JSON object with `layers`)")
    return data


def _blob(store: Path, layer: object, manifest: Path) -> tuple[Path, str, int | None]:
    """A manifest layer's blob path, its sha256 and size; the digest must name a blob."""
    digest = layer.get("digest") if isinstance(layer, dict) else None
    if not isinstance(digest, str) or not re.fullmatch(r"sha256[:-][0-9a-f]{64}", digest):
        raise ModelFileError(manifest, f"layer digest {str(digest)[:80]!r} is not sha256:<64 hex>")
    size = layer.get("size") if isinstance(layer, dict) else None
    hexdigest = digest[7:]
    blobs = store / "blobs"
    path = blobs / f"sha256-{hexdigest}"
    if not path.exists() and not path.is_symlink():
        raise ModelFileError(path, f"is missing (the blob {manifest} names)")
    _inside_store(path, store, "Ollama's store")
    ok_size = size if isinstance(size, int) and not isinstance(size, bool) and size >= 0 else None
    return path, hexdigest, ok_size


def _locate_ollama(name: str) -> Located:
    host, model, tag = _ollama_parts(name)
    store = ollama_dir()
    folder = store / "manifests" / host / model
    manifest = folder / tag
    if not manifest.is_file():
        tags = sorted(p.name for p in folder.iterdir() if p.is_file()) if folder.is_dir() else []
        where = f"tags here: {', '.join(tags)}" if tags else f"not in {store}"
        short = model.removeprefix("library/")
        raise ModelNotFoundError(
            f"{name}: Ollama has no {short}:{tag} ({where}); fetch it with: "
            f"ollama pull {short}:{tag}"
        )
    _inside_store(manifest, store, "Ollama's store")
    data = _read_manifest(manifest)
    models = [
        layer
        for layer in data["layers"]
        if isinstance(layer, dict) and layer.get("mediaType") == OLLAMA_MODEL
    ]
    if len(models) != 1:
        raise ModelFileError(
            manifest,
            f"has {len(models)} layers of type {OLLAMA_MODEL}, expected one (the GGUF file)",
        )
    path, digest, size = _blob(store, models[0], manifest)
    return Located(name, path, store, OLLAMA_PLACE, digest=digest, size=size)


def check_blob(
    path: Path,
    digest: str,
    size: int | None,
    name: str,
    *,
    announce: Callable[[str], None] | None = None,
) -> None:
    """An Ollama blob's size and sha256 against its manifest (the whole blob read once).

    Raises:
        ModelFileError: a size or sha256 that is not the manifest's, naming the blob.
    """
    actual = path.stat().st_size
    fix = f"the blob is damaged: fetch it again with: ollama pull {name.removeprefix('ollama:')}"
    if size is not None and actual != size:
        raise ModelFileError(path, f"is {actual} bytes, the manifest says {size}; {fix}")
    if announce is not None and actual > 1 << 30:
        announce(f"checking the sha256 of {path.name} ({actual / 1e9:.1f} GB)")
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    if h.hexdigest() != digest:
        raise ModelFileError(
            path,
            f"has sha256 {h.hexdigest()[:16]}..., not the {digest[:16]}... it is named by; {fix}",
        )


def ollama_models() -> list[tuple[str, Located | Exception]]:
    """Every manifest in Ollama's store: ``(ollama:NAME:TAG, where or why not)``."""
    store = ollama_dir()
    root = store / "manifests"
    out: list[tuple[str, Located | Exception]] = []
    if not root.is_dir():
        return out
    for manifest in sorted(p for p in root.rglob("*") if p.is_file()):
        parts = manifest.relative_to(root).parts
        if len(parts) != 4:
            continue
        host, namespace, model, tag = parts
        short = (
            model
            if (host, namespace) == (OLLAMA_HOST, "library")
            else (f"{namespace}/{model}" if host == OLLAMA_HOST else f"{host}/{namespace}/{model}")
        )
        name = f"ollama:{short}:{tag}"
        try:
            found: Located | Exception = _locate_ollama(name)
        except (ValueError, OSError) as e:
            found = e
        out.append((name, found))
    return out


# ---------------------------------------------------------------------------- LM Studio


def lmstudio_dir() -> Path:
    """LM Studio's models folder: ``~/.lmstudio/models``, else the older
    ``~/.cache/lm-studio/models`` where only that one exists."""
    new = Path.home() / ".lmstudio" / "models"
    old = Path.home() / ".cache" / "lm-studio" / "models"
    return old if not new.is_dir() and old.is_dir() else new


def _ggufs(folder: Path) -> list[str]:
    """The model GGUF files of an LM Studio repo folder (vision projectors left out)."""
    return sorted(
        p.name
        for p in folder.iterdir()
        if p.name.lower().endswith(".gguf") and not p.name.lower().startswith("mmproj")
    )


def _locate_lmstudio(name: str) -> Located:
    body = name[len("lmstudio:") :]
    parts = body.split("/")
    if not 2 <= len(parts) <= 3 or not all(
        _LMSTUDIO_PART.match(p) and p not in (".", "..") for p in parts
    ):
        raise ModelNotFoundError(
            f"--model {name!r} is not an LM Studio name: expected lmstudio:PUBLISHER/REPO[/FILE]"
        )
    store = lmstudio_dir()
    folder = store / parts[0] / parts[1]
    if not folder.is_dir():
        raise ModelNotFoundError(
            f"{name}: LM Studio has no {parts[0]}/{parts[1]} (looked in {store}); fetch it "
            f"with: lms get {parts[0]}/{parts[1]}"
        )
    _inside_store(folder, store, "LM Studio's folder")
    if len(parts) == 3:
        path = folder / parts[2]
        if not path.is_file():
            have = _ggufs(folder)
            raise ModelNotFoundError(
                f"{name}: no file {parts[2]} in LM Studio's {parts[0]}/{parts[1]}"
                + (f"; it has: {', '.join(have)}" if have else "")
            )
    else:
        files = _ggufs(folder)
        if not files:
            raise ModelFileError(folder, "holds no .gguf file")
        if len(files) > 1:
            raise ModelFileError(
                folder,
                f"holds {len(files)} GGUF files (quantisations); choose one: "
                + ", ".join(f"lmstudio:{parts[0]}/{parts[1]}/{f}" for f in files),
            )
        path = folder / files[0]
    _inside_store(path, store, "LM Studio's folder")
    return Located(name, path, store, LMSTUDIO_PLACE)


def lmstudio_models() -> list[tuple[str, Located | Exception]]:
    """Every GGUF file in LM Studio's folder: ``(lmstudio:PUB/REPO/FILE, where or why not)``."""
    store = lmstudio_dir()
    out: list[tuple[str, Located | Exception]] = []
    if not store.is_dir():
        return out
    for pub in sorted(p for p in store.iterdir() if p.is_dir()):
        for repo in sorted(p for p in pub.iterdir() if p.is_dir()):
            for file in _ggufs(repo):
                name = f"lmstudio:{pub.name}/{repo.name}/{file}"
                try:
                    found: Located | Exception = _locate_lmstudio(name)
                except (ValueError, OSError) as e:
                    found = e
                out.append((name, found))
    return out
