"""The models a server offers: fixed when it starts, loaded once on first use, LRU-bounded.

A client names a model from the list the server was started with; nothing a client
sends can make the server open another path. Loading runs in the caller's thread (a
worker of the pool), once per model even when many requests ask at the same time,
and reports its progress (for the page and the terminal).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnlab.checkpoint import FORMAT, load_checkpoint
from attnlab.data import checkpoint_tokenizer
from attnlab.examples import EXAMPLES, get_example
from attnlab.models.decoder import Decoder
from attnlab.models.gpt import GPTModel
from attnlab.pretrained import (
    PRETRAINED_MODELS,
    load_pretrained,
    model_family,
    packaged_installed,
    require_packages,
)
from attnlab.pretrained.catalog import ModelEntry, check_model, find_models
from attnlab.pretrained.json_file import read_json
from attnlab.pretrained.stores import is_store_name, locate

__all__ = [
    "LoadedModel",
    "ModelRegistry",
    "ModelSpec",
    "UnknownModelError",
    "default_specs",
    "example_spec",
    "path_spec",
    "spec_for",
    "store_spec",
]


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to serve.

    Attributes:
        model: the module (eval mode), or None for the seed's example.
        tokenizer: its tokenizer (spells tokens, decodes generated text), or None.
        encode: text -> token ids, treating special-token text as plain text.
        source: a description for titles.
        causal: whether it can generate (a causal language model).
        eos_id: end-of-sequence id for generation, or None.
        context_length: the longest input it accepts, or None.
        example: the seed example's name when this is the example (no model).
    """

    model: Any
    tokenizer: Any
    encode: Callable[[str], list[int]]
    source: str
    causal: bool = False
    eos_id: int | None = None
    context_length: int | None = None
    example: str | None = None


@dataclass(frozen=True)
class ModelSpec:
    """One entry of the server's fixed model list.

    Attributes:
        name: what clients send (``"model": name``).
        description: one line for the model picker.
        load: builds the :class:`LoadedModel` (called in a worker thread, once).
        kind: ``"example"``, ``"causal-lm"``, ``"encoder"`` or ``"checkpoint"``.
    """

    name: str
    description: str
    load: Callable[[], LoadedModel]
    kind: str = "causal-lm"


class UnknownModelError(LookupError):
    """A model name that is not in the server's list."""


@dataclass
class _Entry:
    spec: ModelSpec
    lock: threading.Lock = field(default_factory=threading.Lock)
    state: str = "idle"  # idle | loading | ready | error
    started: float = 0.0
    seconds: float | None = None
    error: str | None = None
    loads: int = 0


class ModelRegistry:
    """The server's models: loaded lazily, shared, at most ``max_loaded`` kept (LRU).

    Args:
        specs: the fixed list (names must be distinct).
        max_loaded: how many loaded models to keep; the least recently used leaves.
        on_event: called with ``(event, name, detail)`` for "loading", "ready" (detail:
            seconds) and "error" (detail: the message), e.g. to print progress.

    Raises:
        ValueError: an empty list, duplicate names, ``max_loaded < 1``.
    """

    def __init__(
        self,
        specs: list[ModelSpec],
        *,
        max_loaded: int = 2,
        on_event: Callable[[str, str, Any], None] | None = None,
    ) -> None:
        if not specs:
            raise ValueError("`specs` must name at least one model to serve")
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"`specs` must have distinct names, got {names}")
        if isinstance(max_loaded, bool) or not isinstance(max_loaded, int) or max_loaded < 1:
            raise ValueError(f"`max_loaded` must be an int >= 1, got {max_loaded!r}")
        self._entries = {s.name: _Entry(s) for s in specs}
        self._loaded: OrderedDict[str, LoadedModel] = OrderedDict()
        self._lock = threading.Lock()
        self.max_loaded = max_loaded
        self.on_event = on_event

    @property
    def names(self) -> list[str]:
        """The model names, in the order given."""
        return list(self._entries)

    def spec(self, name: str) -> ModelSpec:
        """The spec of ``name``.

        Raises:
            UnknownModelError: ``name`` is not one of :attr:`names`.
        """
        entry = self._entries.get(name) if isinstance(name, str) else None
        if entry is None:
            raise UnknownModelError(
                f"unknown model {str(name)[:80]!r}; choose one of {', '.join(self.names)} "
                "(GET /api/models)"
            )
        return entry.spec

    def status(self) -> list[dict[str, Any]]:
        """One dict per model: name, kind, description, state, seconds, error, loaded."""
        out = []
        with self._lock:
            loaded = set(self._loaded)
        now = time.monotonic()
        for name, e in self._entries.items():
            out.append(
                {
                    "name": name,
                    "kind": e.spec.kind,
                    "description": e.spec.description,
                    "state": "ready"
                    if name in loaded
                    else ("idle" if e.state == "ready" else e.state),
                    "seconds": round(now - e.started, 1) if e.state == "loading" else e.seconds,
                    "error": e.error,
                    "loaded": name in loaded,
                }
            )
        return out

    def get(self, name: str) -> LoadedModel:
        """The loaded model ``name``, loading it first if needed (blocks while loading).

        Raises:
            UnknownModelError: not one of :attr:`names`.
            RuntimeError: the model failed to load (the message says why).
        """
        self.spec(name)
        entry = self._entries[name]
        with self._lock:
            if name in self._loaded:
                self._loaded.move_to_end(name)
                return self._loaded[name]
        with entry.lock:  # one load per model; others wait here and then share it
            with self._lock:
                if name in self._loaded:
                    self._loaded.move_to_end(name)
                    return self._loaded[name]
            entry.state, entry.started, entry.error = "loading", time.monotonic(), None
            self._event("loading", name, None)
            try:
                loaded = entry.spec.load()
            except Exception as e:  # a model that cannot load: report, keep serving
                entry.state, entry.error = "error", f"{type(e).__name__}: {e}"
                self._event("error", name, entry.error)
                raise RuntimeError(f"model {name!r} failed to load: {entry.error}") from e
            entry.state, entry.seconds = "ready", round(time.monotonic() - entry.started, 2)
            entry.loads += 1
            self._event("ready", name, entry.seconds)
            with self._lock:
                self._loaded[name] = loaded
                while len(self._loaded) > self.max_loaded:
                    self._loaded.popitem(last=False)  # users holding it keep their reference
            return loaded

    def loaded_names(self) -> list[str]:
        """Names of the models in memory, least recently used first."""
        with self._lock:
            return list(self._loaded)

    def _event(self, event: str, name: str, detail: Any) -> None:
        if self.on_event is not None:
            self.on_event(event, name, detail)


# ------------------------------------------------------------------------ the specs


def example_spec(name: str = "journey") -> ModelSpec:
    """The seed text's example as a "model": its fixed six tokens, its walkthrough."""
    if name not in EXAMPLES:
        raise ValueError(f"unknown example {name!r}; choose one of {', '.join(EXAMPLES)}")

    def load() -> LoadedModel:
        ex = get_example(name)
        return LoadedModel(
            model=None,
            tokenizer=None,
            encode=lambda text: list(range(len(ex.tokens))),
            source=f"example {name!r}",
            example=name,
        )

    return ModelSpec(
        f"example:{name}", f"the seed text's example {name!r} (fixed tokens)", load, "example"
    )


def _tiktoken_encode(tok: Any) -> Callable[[str], list[int]]:
    # Text from a client is text: "<|endoftext|>" in it is not the special token.
    return lambda text: list(tok.encode(text, disallowed_special=()))


def checkpoint_spec(directory: Path, name: str | None = None) -> ModelSpec:
    """A GPT checkpoint folder written by ``attnlab train``."""
    directory = Path(directory)

    def load() -> LoadedModel:
        ckpt = load_checkpoint(directory, model_type="gpt", with_training_state=False)
        model = GPTModel.from_checkpoint(ckpt)  # checks the config against the weights
        tok = checkpoint_tokenizer(ckpt)  # GPT-2's, or the words it was trained on
        return LoadedModel(
            model=model.eval(),
            tokenizer=tok,
            encode=_tiktoken_encode(tok),
            source=f"GPT checkpoint {directory} (step {ckpt.step})",
            causal=True,
            eos_id=getattr(tok, "eot_token", None),
            context_length=model.context_length,
        )

    return ModelSpec(name or str(directory), f"GPT checkpoint {directory}", load, "checkpoint")


def pretrained_spec(name: str) -> ModelSpec:
    """A packaged pretrained model (``attnlab.pretrained.PRETRAINED_MODELS``).

    Raises:
        MissingPackageError: a package loading it needs is not installed (checked now, so
            that the server does not start offering a model it cannot load).
    """
    require_packages(name)
    kind, what = PRETRAINED_MODELS[name]
    return ModelSpec(name, what, _pretrained_loader(name, name), kind)


def path_spec(path: Path) -> ModelSpec:
    """A model the user brings: a Hugging Face directory or a ``.gguf`` file.

    Only its ``config.json`` (size-capped) or its GGUF header is read now, to know whether
    it can generate; the weights load on first use, through
    :func:`attnlab.pretrained.load_pretrained`.

    Raises:
        ModelFileError: an unreadable ``config.json`` or GGUF header, or an unknown family.
        MissingPackageError: a package loading it needs is not installed.
    """
    family = model_family(path)
    what = f"GGUF file {path.name}" if path.is_file() else f"{family.name} model in {path.name}/"
    kind = {"decoder": "causal-lm"}.get(family.kind, family.kind)
    return ModelSpec(str(path), what, _pretrained_loader(path, str(path)), kind)


def _pretrained_loader(name_or_path: str | Path, source: str) -> Callable[[], LoadedModel]:
    def load() -> LoadedModel:
        model, tok = load_pretrained(name_or_path)
        causal = isinstance(model, Decoder)
        return LoadedModel(
            model=model.eval(),
            tokenizer=tok,
            encode=lambda text: list(tok.encode(text)),
            source=source,
            causal=causal,
            eos_id=tok.eos_id if causal else None,
            context_length=getattr(model, "context_length", None),
        )

    return load


def model_spec(model: Any, tokenizer: Any, name: str, *, causal: bool = True) -> ModelSpec:
    """A model already in memory (tests, notebooks): served as it is."""

    def load() -> LoadedModel:
        encode = (
            _tiktoken_encode(tokenizer)
            if hasattr(tokenizer, "decode_single_token_bytes")
            else (lambda text: list(tokenizer.encode(text)))
        )
        return LoadedModel(
            model=model.eval(),
            tokenizer=tokenizer,
            encode=encode,
            source=name,
            causal=causal,
            eos_id=getattr(tokenizer, "eot_token", None),
            context_length=getattr(model, "context_length", None),
        )

    kind = "causal-lm" if causal else "encoder"
    return ModelSpec(name, f"{type(model).__name__} (in memory)", load, kind)


def store_spec(name: str, entry: Any = None) -> ModelSpec:
    """A model in the Hugging Face cache, Ollama's store or LM Studio's folder, offered
    under its store name (``org/name``, ``ollama:NAME:TAG``, ``lmstudio:PUB/REPO/FILE``);
    its description (family, parameters, file type, size, place) names no path.

    Only the config or GGUF header is read now (:func:`attnlab.pretrained.catalog.check_model`);
    the weights load on first use, through :func:`attnlab.pretrained.load_pretrained`
    (which checks an Ollama blob's sha256 then).

    Args:
        name: the store name.
        entry: its :class:`attnlab.pretrained.catalog.ModelEntry` when already checked.

    Raises:
        ModelNotFoundError: the model is not here.
        ModelFileError: it cannot be loaded (the loader's own error).
        MissingPackageError: a package loading it needs is missing.
    """
    if entry is None:
        located = locate(name)
        if located is None:
            raise ValueError(f"`name` must be a store name, got {name!r}")
        c = check_model(located.path, root=located.root)
        entry = ModelEntry(
            name,
            located.place,
            None,
            c.family,
            c.kind,
            c.parameters,
            c.file_type,
            c.size,
        )
    kind = {"decoder": "causal-lm"}.get(entry.kind or "", entry.kind or "causal-lm")
    return ModelSpec(name, entry.summary(), _pretrained_loader(name, name), kind)


def spec_for(value: str) -> ModelSpec:
    """The spec for one ``--model`` value: an example, a packaged name, a checkpoint
    folder, a model directory, a GGUF file or a store name (:func:`store_spec`).

    Raises:
        ValueError: none of these (the message lists what is accepted).
        ModelFileError: a model directory or GGUF file that cannot be read.
        MissingPackageError: a package loading the model needs is not installed.
    """
    key = value.strip()
    if key.startswith("example:") and key.split(":", 1)[1] in EXAMPLES:
        return example_spec(key.split(":", 1)[1])
    if key.lower() in PRETRAINED_MODELS:
        return pretrained_spec(key.lower())
    path = Path(key)
    config = path / "config.json"
    if path.is_dir() and config.is_file() and _is_training_checkpoint(config):
        return checkpoint_spec(path)
    if path.exists():  # what `load_pretrained` would load: refused here, with its file named
        return path_spec(path)
    if is_store_name(key):  # the Hugging Face cache, Ollama, LM Studio
        return store_spec(key)
    choices = [f"example:{e}" for e in EXAMPLES] + list(PRETRAINED_MODELS)
    raise ValueError(
        f"unknown --model {value!r}; choose one of {', '.join(choices)}, or give a model "
        "directory, a .gguf file, a checkpoint folder written by `attnlab train`, a Hugging "
        "Face repo id in the local cache (org/name[@revision]), ollama:NAME[:TAG] or "
        "lmstudio:PUBLISHER/REPO[/FILE] (`attnlab models` lists them)"
    )


def _is_training_checkpoint(config: Path) -> bool:
    """Whether ``config.json`` is the manifest ``attnlab train`` writes (not a HF config)."""
    return read_json(config, what="the model's configuration").get("format") == FORMAT


def default_specs(runs: Path = Path("runs/gpt"), *, stores: bool = True) -> list[ModelSpec]:
    """The seed's example, the tiny GPT if ``runs/gpt`` holds one, the packaged models
    whose weights are installed, and (``stores``) every loadable model ``attnlab models``
    finds in the Hugging Face cache, Ollama's store and LM Studio's folder, offered under
    its store name (headers read now, weights on first use)."""
    specs = [example_spec("journey")]
    if runs.is_dir():
        with contextlib.suppress(ValueError):
            specs.append(spec_for(str(runs)))
    specs += [pretrained_spec(n) for n in PRETRAINED_MODELS if packaged_installed(n)]
    if stores:
        names = {s.name for s in specs}
        for entry in find_models(stores=True, packaged=False):
            if entry.loadable and entry.name not in names:
                specs.append(store_spec(entry.name, entry))
                names.add(entry.name)
    return specs
