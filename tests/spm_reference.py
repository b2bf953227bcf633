"""The SentencePiece tokenizer attnlab built before it tokenized from the scores alone: the
ranked merge table a SentencePiece vocabulary implies, as a ``tokenizers`` BPE model.

It was checked against transformers on the same files (Gemma 3's, and the tiny gemma2 and
phi3 ones) and now stands as a second, independent reference for
:class:`attnlab.pretrained.sentencepiece.SentencePieceVocab`: the ``tokenizers`` library
does the joins here, attnlab's Python does them there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from attnlab.pretrained.gguf_file import GGUFContents
from attnlab.pretrained.tokenizer import _add_special_tokens, _flag


def sentencepiece_merges(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies, best first.

    llama.cpp's SentencePiece tokenizer repeatedly joins the adjacent pair whose joined text
    is the vocabulary entry with the highest score. As a BPE merge list: every split of every
    entry into two entries, ranked by the joined entry's score (higher first), then by the
    longer left piece, then by the pieces' ids. The ranking is one ``numpy.lexsort`` (a
    262k-token vocabulary such as Gemma's has half a million merges, and sorting them as
    Python tuples took as long as finding them).
    """
    import numpy as np

    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    joined: list[int] = []
    lefts: list[str] = []
    rights: list[str] = []
    for token, i in vocab.items():
        for k in range(1, len(token)):
            left = token[:k]
            if left in vocab:
                right = token[k:]
                if right in vocab:
                    joined.append(i)
                    lefts.append(left)
                    rights.append(right)
    n = len(joined)
    score = np.asarray(scores, dtype=np.float64)[np.asarray(joined, dtype=np.int64)]
    left_len = np.fromiter(map(len, lefts), dtype=np.int64, count=n)
    right_len = np.fromiter(map(len, rights), dtype=np.int64, count=n)
    left_id = np.fromiter(map(vocab.__getitem__, lefts), dtype=np.int64, count=n)
    right_id = np.fromiter(map(vocab.__getitem__, rights), dtype=np.int64, count=n)
    order = np.lexsort((right_id, left_id, -right_len, -left_len, -score))  # last key first
    return [(lefts[j], rights[j]) for j in order.tolist()]


def merge_table_tokenizer(contents: GGUFContents) -> Any:
    """A SentencePiece vocabulary (tokens, scores, types) as a ``tokenizers`` BPE model.

    As llama.cpp: spaces become ``▁`` (U+2581) and, when ``tokenizer.ggml.add_space_prefix``
    is true (its default), one ``▁`` goes before the text (and after every special token);
    characters not in the vocabulary fall back to their UTF-8 bytes ``<0xXX>``; BOS is added
    when ``tokenizer.ggml.add_bos_token`` is true (the default), EOS when
    ``tokenizer.ggml.add_eos_token`` is.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, processors

    meta, tokens, scores = contents.metadata, contents.tokens, contents.scores
    if len(scores) != len(tokens) or not all(
        isinstance(x, (int, float)) and not isinstance(x, bool) for x in scores
    ):
        raise ValueError("tokenizer.ggml.scores must hold one number per token")
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
    model = models.BPE(
        vocab=vocab,
        merges=sentencepiece_merges(tokens, scores),
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,
    )
    backend = Tokenizer(model)
    prefix = _flag(contents, "tokenizer.ggml.add_space_prefix", True)
    steps: list[Any] = [normalizers.Prepend("\u2581")] if prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "\u2581")])
    decode: list[Any] = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        decode.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(decode)
    _add_special_tokens(backend, contents)
    special: list[tuple[str, int]] = []
    template = ["$A"]
    for key, default in (("bos", True), ("eos", False)):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if not _flag(contents, f"tokenizer.ggml.add_{key}_token", default) or token_id is None:
            continue
        special.append((tokens[token_id], token_id))
        template = [tokens[token_id], *template] if key == "bos" else [*template, tokens[token_id]]
    if special:
        backend.post_processor = processors.TemplateProcessing(
            single=template,
            pair=[*template, *(t.replace("$A", "$B") for t in template)],
            special_tokens=special,
        )
    return backend
