"""Checkpoints that survive being killed mid-save and refuse to load when damaged.

A checkpoint is a directory::

    config.json                   manifest: model type and config, step, and the name, size and
                                  SHA-256 of each data file below (written last)
    model-000120.safetensors      the weights (safetensors)
    training-000120.pt            optional training state: optimizer, RNG states, step, data
                                  position, loss history (``torch.load(weights_only=True)``-safe)

Every file is written to a temporary name in the same directory, flushed, fsync'ed and renamed
over its final name; the data files carry the step in their names and the manifest is replaced
only after they are on disk, and old data files are deleted only after that. Killing the process
at any moment therefore leaves either the previous checkpoint or the new one, both complete.

Loading checks the manifest, each file's size and SHA-256 (a truncated or altered file is an
error naming the file), and, through :func:`check_state_dict`, that the weights have the
names and shapes the config implies.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "FORMAT",
    "Checkpoint",
    "CheckpointError",
    "atomic_write_bytes",
    "check_state_dict",
    "load_checkpoint",
    "save_checkpoint",
]

FORMAT = "attnlab-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "config.json"
_DATA_FILE = re.compile(r"^(model-\d+\.safetensors|training-\d+\.pt)$")


class CheckpointError(ValueError):
    """A checkpoint is missing, damaged, or does not match its config."""


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never a part.

    Writes a temporary file in the same directory, fsyncs it, renames it over ``path`` and
    fsyncs the directory.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some platforms cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _describe(data: bytes) -> dict[str, Any]:
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def save_checkpoint(
    directory: str | os.PathLike[str],
    state_dict: Mapping[str, torch.Tensor],
    *,
    model_type: str,
    model_config: Mapping[str, Any],
    step: int = 0,
    training_state: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Save weights, config and (optionally) training state atomically.

    Args:
        directory: the checkpoint directory (created if needed).
        state_dict: the model's weights.
        model_type: the model family, e.g. "gpt"; checked on load.
        model_config: the model's config as a JSON-serialisable mapping.
        step: the optimizer step these weights are from (names the data files).
        training_state: optimizer state, RNG states, step, data position...; saved with
            ``torch.save`` and loadable with ``weights_only=True``.
        extra: more JSON-serialisable facts to keep in the manifest (e.g. the train config).

    Returns:
        The manifest's path.
    """
    from safetensors.torch import save as st_save

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
    weights = st_save(tensors, metadata={"format": "pt", "model_type": model_type})
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "model_type": model_type,
        "model_config": dict(model_config),
        "step": int(step),
        "weights": {"file": f"model-{step:06d}.safetensors", **_describe(weights)},
        "training_state": None,
        "extra": dict(extra or {}),
    }
    atomic_write_bytes(out / manifest["weights"]["file"], weights)
    if training_state is not None:
        buf = io.BytesIO()
        torch.save(dict(training_state), buf)
        data = buf.getvalue()
        manifest["training_state"] = {"file": f"training-{step:06d}.pt", **_describe(data)}
        atomic_write_bytes(out / manifest["training_state"]["file"], data)
    text = json.dumps(manifest, indent=2, sort_keys=False) + "\n"
    atomic_write_bytes(out / MANIFEST, text.encode("utf-8"))
    # Only now that the manifest points at the new files may the older ones go.
    keep = {manifest["weights"]["file"]}
    if manifest["training_state"] is not None:
        keep.add(manifest["training_state"]["file"])
    for p in out.iterdir():
        if (_DATA_FILE.match(p.name) and p.name not in keep) or ".tmp-" in p.name:
            with contextlib.suppress(OSError):
                p.unlink()
    return out / MANIFEST


@dataclass(frozen=True)
class Checkpoint:
    """A loaded, verified checkpoint.

    Attributes:
        directory: where it was loaded from.
        model_type: the model family ("gpt").
        model_config: the model config as saved.
        step: the optimizer step of the weights.
        state_dict: the weights.
        training_state: the training state, or None when none was saved.
        extra: the manifest's extra facts (e.g. the train config).
    """

    directory: Path
    model_type: str
    model_config: dict[str, Any]
    step: int
    state_dict: dict[str, torch.Tensor]
    training_state: dict[str, Any] | None
    extra: dict[str, Any]


def _read_verified(directory: Path, entry: Any, what: str) -> bytes:
    if not isinstance(entry, dict) or not {"file", "bytes", "sha256"} <= set(entry):
        raise CheckpointError(f"{directory / MANIFEST} is damaged: its `{what}` entry is invalid")
    path = directory / str(entry["file"])
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing; the checkpoint is incomplete")
    data = path.read_bytes()
    if len(data) != entry["bytes"]:
        raise CheckpointError(
            f"checkpoint file {path} is truncated or damaged: {len(data)} bytes, the manifest "
            f"says {entry['bytes']}; use another checkpoint"
        )
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise CheckpointError(
            f"checkpoint file {path} is damaged: its SHA-256 does not match the manifest; "
            "use another checkpoint"
        )
    return data


def load_checkpoint(
    directory: str | os.PathLike[str],
    *,
    model_type: str | None = None,
    with_training_state: bool = True,
    map_location: str | torch.device = "cpu",
) -> Checkpoint:
    """Load and verify a checkpoint directory.

    Args:
        directory: the checkpoint directory (holding ``config.json``).
        model_type: when given, the checkpoint must be of this model family.
        with_training_state: also load the training state (when present).
        map_location: device for the tensors.

    Returns:
        The :class:`Checkpoint`.

    Raises:
        CheckpointError: if the directory holds no checkpoint, or a file is missing, truncated,
            altered, or of another format or model type.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load as st_load

    d = Path(directory)
    manifest_path = d / MANIFEST
    if not d.is_dir():
        raise CheckpointError(f"checkpoint directory {str(d)!r} does not exist")
    if not manifest_path.is_file():
        raise CheckpointError(f"{str(d)!r} holds no checkpoint ({MANIFEST} is missing)")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{manifest_path} is damaged (not valid JSON: {exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{manifest_path} is not an attnlab checkpoint manifest")
    if manifest.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{manifest_path} has format version {manifest.get('version')!r}; this attnlab "
            f"reads version {FORMAT_VERSION}"
        )
    if model_type is not None and manifest.get("model_type") != model_type:
        raise CheckpointError(
            f"{d} holds a {manifest.get('model_type')!r} model, expected {model_type!r}"
        )
    if not isinstance(manifest.get("model_config"), dict):
        raise CheckpointError(f"{manifest_path} is damaged: `model_config` is missing")
    weights = _read_verified(d, manifest.get("weights"), "weights")
    try:
        state = st_load(weights)
    except (SafetensorError, ValueError) as exc:
        raise CheckpointError(f"weights in {d} cannot be read: {exc}") from exc
    state = {k: v.to(map_location) for k, v in state.items()}
    training_state = None
    if with_training_state and manifest.get("training_state") is not None:
        data = _read_verified(d, manifest["training_state"], "training_state")
        try:
            training_state = torch.load(
                io.BytesIO(data), map_location=map_location, weights_only=True
            )
        except Exception as exc:  # torch raises several types for a bad pickle
            raise CheckpointError(f"training state in {d} cannot be read: {exc}") from exc
    return Checkpoint(
        directory=d,
        model_type=str(manifest.get("model_type")),
        model_config=dict(manifest["model_config"]),
        step=int(manifest.get("step", 0)),
        state_dict=state,
        training_state=training_state,
        extra=dict(manifest.get("extra") or {}),
    )


def check_state_dict(
    model: nn.Module, state_dict: Mapping[str, torch.Tensor], *, source: str = "checkpoint"
) -> None:
    """Check that ``state_dict`` has exactly the model's parameter names and shapes.

    Raises:
        CheckpointError: naming the first missing, unexpected or mis-shaped tensors, so a
            config that does not match the weights is never loaded silently.
    """
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state_dict.items()}
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    wrong = [
        f"{k}: config gives {expected[k]}, weights have {got[k]}"
        for k in expected
        if k in got and expected[k] != got[k]
    ]
    problems = []
    if wrong:
        more = " ..." if len(wrong) > 3 else ""
        problems.append("shape mismatch " + "; ".join(wrong[:3]) + more)
    if missing:
        problems.append(f"missing {missing[:3]}" + (" ..." if len(missing) > 3 else ""))
    if unexpected:
        problems.append(f"unexpected {unexpected[:3]}" + (" ..." if len(unexpected) > 3 else ""))
    if problems:
        raise CheckpointError(
            f"the config in {source} does not match its weights ({'; '.join(problems)}); "
            "the checkpoint's config.json was changed or belongs to other weights"
        )
