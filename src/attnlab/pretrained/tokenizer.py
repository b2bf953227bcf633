"""Tokenizers for the pretrained models, on the ``tokenizers`` library.

- MiniLM ships a ``tokenizer.json`` (WordPiece, lower-casing): loaded as it is, with its
  fixed 128-token padding replaced by pad-to-longest and truncation at the model's
  ``max_seq_length``, as sentence-transformers does.
- SmolLM2's tokenizer lives in the GGUF metadata (``tokenizer.ggml.*``): a byte-level BPE
  vocabulary and merge list, the pre-tokenizer named by ``tokenizer.ggml.pre``, control
  tokens marked by ``token_type == 3``, and a Jinja chat template. :func:`tokenizer_from_gguf`
  rebuilds it as a ``tokenizers`` BPE model. A SentencePiece vocabulary
  (``tokenizer.ggml.model == "llama"``: tokens, scores, token types, ``<0xXX>`` byte tokens,
  the ``▁`` space marker; Gemma, Phi-3, Llama 2, Mistral files) is tokenized from its
  scores by :class:`attnlab.pretrained.sentencepiece.SentencePieceVocab`, as llama.cpp
  does, with no merge table to build or load.

:class:`PretrainedTokenizer` is the one interface; what does the work is a
:class:`TokenizerEngine`: the ``tokenizers`` library (:class:`TokenizersEngine`) or
:class:`~attnlab.pretrained.sentencepiece.SentencePieceVocab`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from attnlab.pretrained.errors import ModelFileError
from attnlab.pretrained.json_file import read_json

if TYPE_CHECKING:
    from attnlab.pretrained.gguf_file import GGUFContents
    from attnlab.pretrained.sentencepiece import SentencePieceVocab

# llama.cpp token types (llama.h, LLAMA_TOKEN_TYPE_*).
_CONTROL, _USER_DEFINED = 3, 4


@contextmanager
def tokenizer_errors(path: str | Path, what: str) -> Iterator[None]:
    """The one place where an error building a tokenizer from a file becomes a
    ``ModelFileError`` naming the file: the ``tokenizers`` library's own exceptions (plain
    ``Exception``, and Rust panics, which pyo3 raises as a ``BaseException``) and any other
    error of the building code. Interrupts and exits pass through."""
    try:
        yield
    except ModelFileError:
        raise
    except BaseException as e:
        if not isinstance(e, Exception) and type(e).__name__ != "PanicException":
            raise  # KeyboardInterrupt, SystemExit, an alarm
        raise ModelFileError(path, f"{what}: {e}") from None


class TokenizerEngine(Protocol):
    """What does a :class:`PretrainedTokenizer`'s work."""

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str: ...

    def id_to_token(self, token_id: int) -> str | None: ...

    def vocab_size(self) -> int: ...


class TokenizersEngine:
    """A ``tokenizers.Tokenizer`` as a :class:`TokenizerEngine` (its own padding and
    truncation turned off: :meth:`PretrainedTokenizer.batch` pads and truncates)."""

    def __init__(self, tokenizer: Any) -> None:
        tokenizer.no_padding()
        tokenizer.no_truncation()
        self.tokenizer = tokenizer

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(e.ids) for e in self.tokenizer.encode_batch(list(texts))]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def id_to_token(self, token_id: int) -> str | None:
        token = self.tokenizer.id_to_token(int(token_id))
        return None if token is None else str(token)

    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))


class PretrainedTokenizer:
    """Text <-> token ids for one pretrained model.

    Args:
        backend: what does the work (:class:`TokenizerEngine`).
        pad_id: id used to pad :meth:`batch`.
        eos_id: end-of-sequence id, or None.
        bos_id: beginning-of-sequence id, or None.
        max_length: longest sequence :meth:`batch` returns (longer inputs are truncated),
            or None for no limit.
        chat_template: a Jinja chat template, or None.
    """

    def __init__(
        self,
        backend: TokenizerEngine,
        *,
        pad_id: int,
        eos_id: int | None = None,
        bos_id: int | None = None,
        max_length: int | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.pad_id = pad_id
        self.eos_id = eos_id
        self.bos_id = bos_id
        self.max_length = max_length
        self.chat_template = chat_template

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included."""
        return self.backend.vocab_size()

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (special-token strings such as ``<|im_start|>`` included)."""
        if not isinstance(text, str):
            raise TypeError(f"`text` must be a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ``ids``."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary string of one id (byte-level or WordPiece form)."""
        return str(self.backend.id_to_token(int(token_id)))

    def batch(self, texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode several texts, right-padded to the longest.

        Args:
            texts: the texts.

        Returns:
            ``(input_ids, valid)``: (B, S) long ids and (B, S) bool, True = real token.

        Raises:
            ValueError: if ``texts`` is empty.
        """
        if isinstance(texts, str) or len(texts) == 0:
            raise ValueError(
                f"`texts` must be a non-empty list of strings, got {texts!r}; "
                "wrap a single text in a list"
            )
        rows = self.backend.encode_batch(list(texts))
        if self.max_length is not None:
            # Keep the final special token ([SEP]) the way tokenizers' truncation does.
            rows = [
                r if len(r) <= self.max_length else [*r[: self.max_length - 1], r[-1]] for r in rows
            ]
        longest = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), longest), self.pad_id, dtype=torch.long)
        valid = torch.zeros((len(rows), longest), dtype=torch.bool)
        for i, r in enumerate(rows):
            input_ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            valid[i, : len(r)] = True
        return input_ids, valid

    def apply_chat_template(
        self, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        """Render ``messages`` (``{"role": ..., "content": ...}``) with the model's chat template.

        Raises:
            ValueError: if this tokenizer has no chat template.
        """
        if self.chat_template is None:
            raise ValueError("this model has no chat template; drop --chat / apply_chat_template")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        template = env.from_string(self.chat_template)
        eos = self.backend.id_to_token(self.eos_id) if self.eos_id is not None else ""
        bos = self.backend.id_to_token(self.bos_id) if self.bos_id is not None else ""
        eos, bos = eos or "", bos or ""
        return str(
            template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                eos_token=eos,
                bos_token=bos,
            )
        )


def _token_text(value: Any) -> str | None:
    """A special token from ``tokenizer_config.json``: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def tokenizer_from_json(
    path: str | Path,
    *,
    max_length: int | None,
    special: dict[str, Any] | None = None,
    chat_template: str | None = None,
) -> PretrainedTokenizer:
    """Load a ``tokenizer.json`` as a :class:`PretrainedTokenizer`.

    Args:
        path: the ``tokenizer.json``.
        max_length: longest sequence :meth:`PretrainedTokenizer.batch` returns.
        special: ``tokenizer_config.json``'s contents (``bos_token``, ``eos_token``,
            ``pad_token``); without them BERT's ``[CLS]``/``[SEP]``/``[PAD]`` are used.
        chat_template: a Jinja chat template, or None.

    Raises:
        ModelFileError: a file the ``tokenizers`` library cannot read.
    """
    from tokenizers import Tokenizer

    path = Path(path)
    if not path.is_file():
        raise ModelFileError(path, "is missing (the tokenizer)")
    with tokenizer_errors(path, "is not a tokenizers file"):
        backend = Tokenizer.from_file(str(path))
    special = special or {}

    def find(key: str, *fallbacks: str) -> int | None:
        for text in (_token_text(special.get(key)), *fallbacks):
            found = backend.token_to_id(text) if text is not None else None
            if found is not None:
                return int(found)
        return None

    bos = find("bos_token", "[CLS]", "<s>")
    eos = find("eos_token", "[SEP]", "</s>")
    pad = find("pad_token", "[PAD]", "<pad>")
    return PretrainedTokenizer(
        TokenizersEngine(backend),
        pad_id=pad if pad is not None else (eos if eos is not None else 0),
        eos_id=eos,
        bos_id=bos,
        max_length=max_length,
        chat_template=chat_template,
    )


def tokenizer_from_hf_dir(folder: str | Path, *, max_length: int | None) -> PretrainedTokenizer:
    """A Hugging Face directory's ``tokenizer.json``, special tokens and chat template.

    The chat template is ``tokenizer_config.json``'s ``chat_template`` (a string, or the
    ``"default"`` entry of a list) or the file ``chat_template.jinja``.

    Raises:
        ModelFileError: a missing ``tokenizer.json`` or a broken ``tokenizer_config.json``.
    """
    folder = Path(folder)
    config_path = folder / "tokenizer_config.json"
    config = read_json(config_path, what="the tokenizer config") if config_path.is_file() else {}
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    jinja = folder / "chat_template.jinja"
    if template is None and jinja.is_file() and jinja.stat().st_size < 1 << 20:
        template = jinja.read_text(encoding="utf-8", errors="replace")
    limit = config.get("model_max_length")
    if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
        max_length = min(limit, max_length) if max_length is not None else limit
    return tokenizer_from_json(
        folder / "tokenizer.json",
        max_length=max_length,
        special=config,
        chat_template=template if isinstance(template, str) else None,
    )


# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp), applied before byte-level BPE.
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = _LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")
# llama.cpp's `tokenizer.ggml.pre` names -> the split they stand for.
PRE_TOKENIZERS = {
    "default": "gpt2",
    "gpt2": "gpt2",
    "gpt-2": "gpt2",
    "phi-2": "gpt2",
    "roberta-bpe": "gpt2",
    "jais": "gpt2",
    "smollm": "digits+gpt2",
    "starcoder": "digits+gpt2",
    "refact": "digits+gpt2",
    "codeshell": "digits+gpt2",
    "llama3": "llama3",
    "llama-bpe": "llama3",
    "falcon3": "llama3",
    "pixtral": "llama3",
    "dbrx": "llama3",
    "smaug-bpe": "llama3",
    "qwen2": "qwen2",
    "deepseek-r1-qwen": "qwen2",
    "megrez": "qwen2",
    "stablelm2": "qwen2",
    "olmo": "gpt2",
    "mpt": "gpt2",
    "command-r": "digits+gpt2",
}


def _pre_tokenizer(pre: str) -> Any:
    """The ``tokenizers`` pre-tokenizer for llama.cpp's ``tokenizer.ggml.pre`` name.

    llama.cpp's "smollm" pre-tokenizer splits every digit on its own (``\\p{N}``) and then
    applies the GPT-2 regex; that is ``Digits(individual_digits=True)`` followed by
    byte-level splitting, as in SmolLM2's original ``tokenizer.json``. "llama-bpe" (Llama 3)
    and "qwen2" split with their own regexes (numbers in runs of up to 3 digits, or single
    digits), then map bytes without the GPT-2 regex.
    """
    from tokenizers import Regex, pre_tokenizers

    kind = PRE_TOKENIZERS.get(pre)
    if kind is None:
        raise NotImplementedError(
            f"GGUF pre-tokenizer {pre!r} is not supported; supported: "
            f"{', '.join(sorted(PRE_TOKENIZERS))}"
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if kind == "gpt2":
        return byte_level
    if kind == "digits+gpt2":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    regex = _LLAMA3_REGEX if kind == "llama3" else _QWEN2_REGEX
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def tokenizer_from_gguf(contents: GGUFContents) -> PretrainedTokenizer:
    """Rebuild a GGUF file's tokenizer: byte-level BPE (``tokenizer.ggml.model == "gpt2"``)
    or SentencePiece (``"llama"``: Llama 1/2, Mistral, Gemma, Phi-3).

    Args:
        contents: the file, from :func:`attnlab.pretrained.gguf_file.read_gguf`.

    Returns:
        The tokenizer, with the file's control tokens as special tokens and its chat template.

    Raises:
        ModelFileError: a tokenizer model or pre-tokenizer not handled here, token tables
            of different lengths or the wrong types, a merge naming a token the vocabulary
            lacks, a special token id out of range, or anything the ``tokenizers`` library
            refuses (:func:`tokenizer_errors`).
    """
    meta = contents.metadata
    kind = meta.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise ModelFileError(
            contents.path,
            f"`tokenizer.ggml.model` = {kind!r} is not supported; supported: byte-level BPE "
            "('gpt2') and SentencePiece ('llama')",
        )
    tokens, types = contents.tokens, contents.token_types
    if not set(map(type, tokens)) <= {str} or len(types) != len(tokens):  # one C pass
        raise ModelFileError(
            contents.path,
            f"tokenizer.ggml.tokens ({len(tokens)}) and token_type ({len(types)}) must be "
            "equally long lists of strings and ints",
        )
    eos, bos = _token_id(contents, "eos"), _token_id(contents, "bos")
    pad = _token_id(contents, "padding")
    pad = pad if pad is not None else (eos if eos is not None else 0)
    template = meta.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise ModelFileError(contents.path, "`tokenizer.chat_template` must be a string")
    context = meta.get(f"{meta.get('general.architecture', '')}.context_length")
    with tokenizer_errors(contents.path, "the tokenizer (tokenizer.ggml.*) cannot be built"):
        if kind == "gpt2":
            backend: TokenizerEngine = TokenizersEngine(_cached_backend(contents, _bpe_backend))
        else:
            backend = _sentencepiece_vocab(contents)
        return PretrainedTokenizer(
            backend,
            pad_id=pad,
            eos_id=eos,
            bos_id=bos,
            max_length=context if isinstance(context, int) and context > 0 else None,
            chat_template=template,
        )


# Bump when the rebuild below changes what it makes from the same metadata: the cached
# tokenizers are keyed by it, so every old entry is then rebuilt once.
_BUILD_VERSION = 1


def tokenizer_cache_key(contents: GGUFContents) -> str:
    """A digest of everything a GGUF tokenizer is rebuilt from.

    It covers the vocabulary, token types, scores and merges, every other
    ``tokenizer.ggml.*`` key, the ``tokenizers`` library's version and this module's
    :data:`_BUILD_VERSION`. Two files with the same tokenizer share one cached entry, and a
    change to any of these makes a new one.
    """
    import hashlib

    import numpy as np
    import tokenizers

    digest = hashlib.sha256()

    def add(label: str, data: bytes) -> None:
        digest.update(f"{label}:{len(data)}:".encode())
        digest.update(data)

    add("build", f"{_BUILD_VERSION} tokenizers {tokenizers.__version__}".encode())
    add("tokens", "\0".join(contents.tokens).encode("utf-8", "surrogatepass"))
    add("types", np.asarray(contents.token_types, dtype=np.int64).tobytes())
    add("scores", np.asarray(contents.scores, dtype=np.float64).tobytes())
    add("merges", "\n".join(contents.merges).encode("utf-8", "surrogatepass"))
    meta = sorted(
        (k, repr(v)) for k, v in contents.metadata.items() if k.startswith("tokenizer.ggml.")
    )
    add("metadata", repr(meta).encode("utf-8", "surrogatepass"))
    return digest.hexdigest()


def _cached_backend(contents: GGUFContents, build: Any) -> Any:
    """``build(contents)``, or the same ``tokenizers`` tokenizer read back from attnlab's
    cache (a byte-level BPE vocabulary: checking and building its merges costs more than
    reading the built tokenizer's JSON back). Entries live in
    ``<cache>/tokenizers/<key>.json`` (:func:`tokenizer_cache_key`), written atomically. An
    entry the ``tokenizers`` library cannot read is rebuilt and replaced; a cache folder
    that cannot be written only costs the rebuild. ``ATTNLAB_TOKENIZER_CACHE=0`` turns the
    cache off.
    """
    import os

    from tokenizers import Tokenizer

    from attnlab.paths import cache_dir

    if os.environ.get("ATTNLAB_TOKENIZER_CACHE", "1") == "0":
        return build(contents)
    try:
        path = cache_dir() / "tokenizers" / f"{tokenizer_cache_key(contents)}.json"
    except (TypeError, ValueError):  # a table of the wrong types: let the build name it
        return build(contents)
    if path.is_file():
        try:
            return Tokenizer.from_file(str(path))
        except Exception:  # a damaged entry: rebuilt below
            pass
    backend = build(contents)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(backend.to_str(), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass
    return backend


def _token_id(contents: GGUFContents, key: str) -> int | None:
    """``tokenizer.ggml.{key}_token_id``: None when absent, else an id in the vocabulary."""
    name = f"tokenizer.ggml.{key}_token_id"
    value = contents.metadata.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelFileError(contents.path, f"`{name}` must be an integer, got {value!r}")
    if not 0 <= value < len(contents.tokens):
        raise ModelFileError(
            contents.path, f"`{name}` = {value} is not a token id (0..{len(contents.tokens) - 1})"
        )
    return value


def _add_special_tokens(backend: Any, contents: GGUFContents) -> None:
    """llama.cpp's control tokens as special tokens, user-defined ones as added tokens: both
    matched whole in the raw text, before any splitting."""
    from tokenizers import AddedToken

    pairs = list(zip(contents.tokens, contents.token_types, strict=True))
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in pairs if k == _CONTROL]
    )
    backend.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in pairs if k == _USER_DEFINED]
    )


def _bpe_backend(contents: GGUFContents) -> Any:
    """Byte-level BPE from the vocabulary and merge list, split as ``tokenizer.ggml.pre``."""
    from tokenizers import Tokenizer, decoders, models

    raw_merges = contents.merges
    if not all(isinstance(m, str) and " " in m for m in raw_merges):
        raise ModelFileError(contents.path, "tokenizer.ggml.merges must be 'left right' strings")
    vocab = {token: i for i, token in enumerate(contents.tokens)}
    merges = [(left, right) for left, right in (m.split(" ", 1) for m in raw_merges)]
    for i, (left, right) in enumerate(merges):
        for token in (left, right, left + right):
            if token not in vocab:  # the tokenizers library refuses it (or panics)
                raise ModelFileError(
                    contents.path,
                    f"tokenizer.ggml.merges[{i}] = {raw_merges[i]!r} needs the token "
                    f"{token!r}, which tokenizer.ggml.tokens lacks",
                )
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _pre_tokenizer(
        str(contents.metadata.get("tokenizer.ggml.pre", "default"))
    )
    backend.decoder = decoders.ByteLevel()
    _add_special_tokens(backend, contents)
    return backend


def _flag(contents: GGUFContents, key: str, default: bool) -> bool:
    """A true/false metadata key, refused (named) when the file stores anything else.

    ``bool("false")`` is true: a string or a number here would silently flip the tokenizer.
    """
    value = contents.metadata.get(key, default)
    if not isinstance(value, bool):
        raise ModelFileError(contents.path, f"{key} must be a bool, got {value!r}")
    return value


def _sentencepiece_vocab(contents: GGUFContents) -> SentencePieceVocab:
    """A SentencePiece vocabulary (tokens, scores, types) as llama.cpp tokenizes it.

    Spaces become ``▁`` (U+2581) and, when ``tokenizer.ggml.add_space_prefix`` is true (its
    default), one ``▁`` goes before the text (and after every special token); characters
    not in the vocabulary fall back to their UTF-8 bytes ``<0xXX>``; control tokens
    (type 3) and user-defined ones (type 4) are matched whole first; BOS is added when
    ``tokenizer.ggml.add_bos_token`` is true (the default), EOS when
    ``tokenizer.ggml.add_eos_token`` is.
    """
    from attnlab.pretrained.sentencepiece import SentencePieceVocab

    meta, tokens, scores = contents.metadata, contents.tokens, contents.scores
    if len(scores) != len(tokens) or not set(map(type, scores)) <= {int, float}:
        raise ModelFileError(
            contents.path,
            f"tokenizer.ggml.scores ({len(scores)}) must hold one number per token "
            f"({len(tokens)}) for a SentencePiece ('llama') tokenizer",
        )
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    if not (isinstance(unk_id, int) and not isinstance(unk_id, bool) and 0 <= unk_id < len(tokens)):
        unk_id = None
    prefix = _flag(contents, "tokenizer.ggml.add_space_prefix", True)
    added: dict[str, int | None] = {}
    for key, default in (("bos", True), ("eos", False)):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if not _flag(contents, f"tokenizer.ggml.add_{key}_token", default) or token_id is None:
            added[key] = None
            continue
        if isinstance(token_id, bool) or not isinstance(token_id, int):
            raise ModelFileError(contents.path, f"tokenizer.ggml.{key}_token_id must be an int")
        if not 0 <= token_id < len(tokens):
            raise ModelFileError(
                contents.path, f"tokenizer.ggml.{key}_token_id = {token_id} is not a token id"
            )
        added[key] = token_id
    special: list[int] = []
    added_ids: list[int] = []
    for i, k in enumerate(contents.token_types):
        if k == _CONTROL:
            special.append(i)
        elif k == _USER_DEFINED:
            added_ids.append(i)
    return SentencePieceVocab(
        tokens,
        scores,
        special=special,
        added=added_ids,
        unk_id=unk_id,
        add_space_prefix=prefix,
        bos_id=added["bos"],
        eos_id=added["eos"],
    )
