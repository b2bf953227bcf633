"""Loading the models a command names (pretrained names, checkpoint folders, backends).

Shared by the commands: the library's errors become :class:`UserError`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attnlab.backends import available_backends
from attnlab.cli.output import UserError, output, user_input
from attnlab.explain.model_trace import _encode, _token_texts

__all__ = [
    "check_dtype",
    "check_local_backend",
    "load_checkpoint_model",
    "load_model_arg",
    "load_pretrained_model",
    "token_arg",
]


def check_dtype(dtype: str) -> None:
    """``--dtype`` must name a weight precision of :mod:`attnlab.quant`."""
    from attnlab.quant import WEIGHT_DTYPES

    if dtype not in WEIGHT_DTYPES:
        raise UserError(f"unknown --dtype {dtype!r}; choose one of {', '.join(WEIGHT_DTYPES)}")


#: ``--kv-cache``'s choices (``load_pretrained``'s ``kv_cache_dtype`` by name).
KV_CACHE_CHOICES = ("auto", "float32", "float16")
KV_CACHE_HELP = (
    "What the key/value cache holds: auto (float16 for the integer --dtype precisions, "
    "float32 otherwise), float32 or float16 (half the memory; what llama.cpp holds)."
)


def check_kv_cache(kv_cache: str) -> None:
    """``--kv-cache`` must be one of :data:`KV_CACHE_CHOICES`."""
    if kv_cache not in KV_CACHE_CHOICES:
        raise UserError(
            f"unknown --kv-cache {kv_cache!r}; choose one of {', '.join(KV_CACHE_CHOICES)}"
        )


def check_local_backend(backend: str) -> None:
    """``--backend`` must name a backend that runs in this one process."""
    local = [b for b in available_backends() if b != "ring"]
    if backend == "ring":
        raise UserError(
            "--backend ring needs a torch.distributed process group (see `attnlab ring-demo`); "
            f"choose one of {', '.join(local)}"
        )
    if backend not in local:
        raise UserError(f"unknown --backend {backend!r}; choose one of {', '.join(local)}")


def load_checkpoint_model(directory: Path, backend: str = "auto") -> tuple[Any, Any, str]:
    """A GPT trained with ``attnlab train`` (through ``GPTModel.from_checkpoint``, which
    checks its config against its weights) in eval mode, its tokenizer, and a label."""
    check_local_backend(backend)
    try:
        from attnlab.checkpoint import load_checkpoint
        from attnlab.data import checkpoint_tokenizer
        from attnlab.models.gpt import GPTModel
    except ImportError as e:  # pragma: no cover - a partial install
        raise UserError(f"--checkpoint needs attnlab's GPT model, which is missing: {e}") from e
    with user_input():  # a CheckpointError is a ValueError: one line, the file named
        ckpt = load_checkpoint(directory, model_type="gpt", with_training_state=False)
        model = GPTModel.from_checkpoint(ckpt, backend=backend)
        tokenizer = checkpoint_tokenizer(ckpt)
    return model.eval(), tokenizer, f"GPT checkpoint {directory} (step {ckpt.step})"


def load_pretrained_model(
    name: str,
    *,
    kind: str | None = None,
    backend: str = "auto",
    dtype: Any = "float32",
    weights: bool = True,
    kv_cache: str = "auto",
) -> tuple[Any, Any, str]:
    """The model ``--model NAME`` gives (a packaged name, a model directory, a GGUF file or
    a store name: ``org/name[@revision]`` in the Hugging Face cache, ``ollama:NAME[:TAG]``,
    ``lmstudio:PUBLISHER/REPO[/FILE]``), its tokenizer, and a label: the one way every
    command loads one.

    Args:
        name: the ``--model`` value.
        kind: ``"encoder"`` or ``"causal-lm"`` when the command needs that kind (an
            encoder-decoder generates: it counts as ``"causal-lm"``); None takes any.
        backend: ``--backend`` (one that runs in this process).
        dtype: ``load_pretrained``'s: a weight precision by name (``--dtype`` of
            ``generate``, checked here) or a ``torch.dtype`` (``--dtype`` of ``info``).
        weights: False: the model's structure alone, on the meta device, and no tokenizer
            (:func:`attnlab.pretrained.load_structure`: no weight is read).
        kv_cache: ``--kv-cache`` (:data:`KV_CACHE_CHOICES`), ``load_pretrained``'s
            ``kv_cache_dtype``.

    Raises:
        UserError: an unknown name (the packaged names that fit are listed), a model of
            another kind, a broken model file (its ``ModelFileError``: the file and field),
            a package that is missing (its ``pip install`` line), a bad backend, dtype or
            cache dtype (or a float16 cache for a model whose caches cannot hold one).
    """
    from attnlab.pretrained import (
        PRETRAINED_MODELS,
        MissingPackageError,
        load_pretrained,
        load_structure,
        model_family,
    )
    from attnlab.pretrained.stores import is_store_name

    check_local_backend(backend)
    if isinstance(dtype, str):
        check_dtype(dtype)
    check_kv_cache(kv_cache)
    key = name.lower()
    packaged = key in PRETRAINED_MODELS
    fitting = sorted(n for n, (k, _) in PRETRAINED_MODELS.items() if kind in (None, k))
    if not packaged and not Path(name).exists() and not is_store_name(name):
        raise UserError(
            f"unknown --model {name!r}; choose one of {', '.join(fitting)}, or give a model "
            "directory, a .gguf file, a Hugging Face repo id in the local cache "
            "(org/name[@revision]), ollama:NAME[:TAG] or lmstudio:PUBLISHER/REPO[/FILE] "
            "(`attnlab models` lists what this machine has)"
        )
    try:
        # The kind is known before loading (the packaged table, config.json or the GGUF
        # header): a model of the wrong kind is refused before its weights are read.
        with user_input():  # a ModelFileError is a ValueError: one line, the file named
            if packaged:
                _check_kind(name, PRETRAINED_MODELS[key][0], kind, fitting)
            elif kind is not None:
                family_kind = model_family(name).kind  # an encoder-decoder generates
                _check_kind(
                    name, "encoder" if family_kind == "encoder" else "causal-lm", kind, fitting
                )
            if weights:
                model, tok = load_pretrained(
                    key if packaged else name,
                    backend=backend,
                    dtype=dtype,
                    kv_cache_dtype=kv_cache,
                    announce=output.note,
                )
            else:
                model, tok = (
                    load_structure(
                        key if packaged else name,
                        backend=backend,
                        dtype=dtype,
                        announce=output.note,
                    ),
                    None,
                )
    except MissingPackageError as e:
        raise UserError(str(e)) from e
    for note in getattr(model, "load_notes", ()):  # what the file holds that is not used
        output.note(f"{name}: {note}")
    return model, tok, key if packaged else name


def _check_kind(name: str, got: str, kind: str | None, fitting: list[str]) -> None:
    if kind is not None and got != kind:
        what = {"encoder": "an encoder", "causal-lm": "a causal LM"}
        raise UserError(
            f"--model {name} is {what[got]}; this command needs {what[kind]}: one of "
            f"{', '.join(fitting)}, or a model directory or .gguf file of one"
        )


def load_model_arg(
    checkpoint: Path | None, model: str | None, *, backend: str = "auto", dtype: Any = "float32"
) -> tuple[Any, Any, str]:
    """The model of ``--checkpoint DIR`` or ``--model NAME`` (exactly one of them), its
    tokenizer and a label, for the commands that take any model (``explain``, ``heads``)."""
    if (checkpoint is None) == (model is None):
        raise UserError("give a model: --model NAME (or a directory / .gguf) or --checkpoint DIR")
    if checkpoint is not None:
        return load_checkpoint_model(checkpoint, backend)
    assert model is not None
    return load_pretrained_model(model, backend=backend, dtype=dtype)


def token_arg(tokenizer: Any, text: str | None, token_id: int | None, flag: str) -> int | None:
    """The token id of ``--FLAG TEXT`` (text that is exactly one token) or ``--FLAG-id N``.

    Raises:
        UserError: both or (for a required flag, checked by the caller) neither given, or
            text that is not exactly one token (how many it is, and what they are).
    """
    if text is not None and token_id is not None:
        raise UserError(f"give either --{flag} TEXT or --{flag}-id N, not both")
    if token_id is not None:
        if token_id < 0:
            raise UserError(f"`--{flag}-id` must be >= 0, got {token_id}")
        return token_id
    if text is None:
        return None
    ids = _encode(tokenizer, text)
    if len(ids) != 1:
        spelled = ", ".join(repr(t) for t in _token_texts(tokenizer, ids[:8]))
        raise UserError(
            f"--{flag} {text!r} is {len(ids)} tokens ({spelled or 'none'}); it must be exactly "
            f"one token: try a leading space (' Mary'), or give --{flag}-id N"
        )
    return ids[0]
