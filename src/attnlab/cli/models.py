"""Loading the models a command names (pretrained names, checkpoint folders, backends).

Shared by the commands: the library's errors become :class:`UserError`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attnlab.cli.output import UserError, output, user_input

__all__ = [
    "check_dtype",
    "check_local_backend",
    "load_checkpoint_model",
    "load_model_path",
    "load_pretrained_kind",
    "load_pretrained_model",
]


def check_dtype(dtype: str) -> None:
    """``--dtype`` must name a weight precision of :mod:`attnlab.quant`."""
    from attnlab.quant import WEIGHT_DTYPES

    if dtype not in WEIGHT_DTYPES:
        raise UserError(f"unknown --dtype {dtype!r}; choose one of {', '.join(WEIGHT_DTYPES)}")


def load_pretrained_kind(
    name: str, kind: str, backend: str, dtype: str = "float32"
) -> tuple[Any, Any]:
    """``load_pretrained`` with its errors as user errors; ``kind`` is encoder/causal-lm."""
    from attnlab.pretrained import PRETRAINED_MODELS, MissingPackageError, load_pretrained

    check_local_backend(backend)
    check_dtype(dtype)
    key = name.lower()
    fitting = sorted(n for n, (k, _) in PRETRAINED_MODELS.items() if k == kind)
    if key not in PRETRAINED_MODELS and Path(name).exists():
        return load_model_path(name, kind, backend, dtype)
    if key not in PRETRAINED_MODELS or PRETRAINED_MODELS[key][0] != kind:
        raise UserError(
            f"unknown --model {name!r} here; choose one of {', '.join(fitting)}, or give a "
            "model directory or .gguf file"
        )
    try:
        with user_input():
            return load_pretrained(key, backend=backend, dtype=dtype, announce=output.note)
    except MissingPackageError as e:
        raise UserError(str(e)) from e


def load_model_path(
    path: str, kind: str, backend: str = "auto", dtype: Any = "float32"
) -> tuple[Any, Any]:
    """A model directory or GGUF file; ``kind`` (encoder/causal-lm) must fit the command.

    ``dtype`` is ``load_pretrained``'s: a weight precision by name (``--dtype`` of
    ``generate``) or a ``torch.dtype`` (``--dtype`` of ``info``).
    """
    from attnlab.models.decoder import Decoder
    from attnlab.models.encoder_decoder import EncoderDecoder
    from attnlab.pretrained import load_pretrained

    with user_input():
        model, tok = load_pretrained(Path(path), backend=backend, dtype=dtype)
    is_lm = isinstance(model, (Decoder, EncoderDecoder))  # both generate
    if (kind == "causal-lm" and not is_lm) or (kind == "encoder" and is_lm):
        got = "a decoder (causal LM)" if is_lm else "an encoder"
        raise UserError(f"--model {path} is {got}; this command needs a {kind} model")
    return model, tok


def check_local_backend(backend: str) -> None:
    """``--backend`` must name a backend that runs in this one process."""
    from attnlab.backends import available_backends

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


def load_pretrained_model(name: str, dtype: Any = "float32") -> tuple[Any, Any, str]:
    """A packaged pretrained model, a model directory or a GGUF file, its tokenizer, and a
    label; ``dtype`` as in ``load_pretrained``."""
    try:
        from attnlab.pretrained import load_pretrained
    except ImportError as e:  # pragma: no cover - a partial install
        raise UserError(f"--model needs attnlab.pretrained, which is missing: {e}") from e
    try:
        with user_input():
            model, tokenizer = load_pretrained(name, dtype=dtype, announce=output.note)
    except ImportError as e:  # the weights' package is not installed
        raise UserError(str(e)) from e
    return model, tokenizer, name
