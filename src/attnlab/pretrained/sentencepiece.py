"""SentencePiece vocabularies tokenized from their scores, with no merge table.

A GGUF file with ``tokenizer.ggml.model == "llama"`` (Llama 1/2, Mistral, Gemma, Phi-3)
holds a SentencePiece vocabulary: tokens, one score each, token types, ``<0xXX>`` byte
tokens, and ``▁`` (U+2581) for a space. llama.cpp tokenizes text with it by joining, again
and again, the adjacent pair of pieces whose joined text is the vocabulary entry with the
highest score. As a merge table that is every split of every entry into two entries,
ranked by the joined entry's score: half a million merges for Gemma's 262,144 tokens. Built
as a ``tokenizers`` BPE model and read back from a cache, that table alone took ~0.4 s of
every start, and the whole tokenizer ~0.8 s, more than any other part of a first token
after importing torch.

:class:`SentencePieceVocab` needs no table: a pair's rank is computed when the pair is
met, from the vocabulary (a dict) and the scores, so building it is one pass over the
tokens (0.11-0.19 s for Gemma's, most of it hashing the 262,144 strings). It gives the
ids and text of the ``tokenizers`` BPE model that the ranked merge table builds
(``tests/spm_reference.py`` keeps that build, and the tests compare the two, and both
with transformers, on the same files):

- pairs are ranked by the joined entry's score (higher first), then the longer left
  piece, then the pieces' ids; among equal ranks the leftmost pair joins first;
- a character not in the vocabulary becomes the ``<0xXX>`` tokens of its UTF-8 bytes, or
  the unknown token (consecutive ones fused) when some byte token is missing;
- control tokens (special) and user-defined ones are matched whole in the raw text
  before anything else, the longest at the leftmost place;
- each stretch of text between them: ``▁`` first when ``add_space_prefix``, spaces
  as ``▁``, then the joins;
- decoding: ``▁`` as a space, runs of byte tokens as their UTF-8 text (every byte of a
  run that is not valid UTF-8 shown as U+FFFD), one leading space dropped when the
  prefix is added.

Encoding is pure Python, a heap of the candidate pairs: about 2 µs a character of
running text (The Verdict's 20,479 characters in 0.04 s on the EPYC), enough for prompts
and evaluation texts. :class:`~attnlab.pretrained.tokenizer.PretrainedTokenizer` is the
interface users see.
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Sequence
from typing import Any

_SPACE = "\u2581"
_HEX = frozenset("0123456789abcdefABCDEF")
# a candidate join in the heap: (-score, -left length, left id, right id, place, joined id)
_Entry = tuple[float, int, int, int, int, int]


class SentencePieceVocab:
    """Text <-> ids for one SentencePiece vocabulary.

    Args:
        tokens: the vocabulary in id order (a string may repeat: the first id is its id).
        scores: one score per token.
        special: token ids matched whole in the raw text and dropped by
            ``decode(skip_special_tokens=True)`` (llama.cpp's control tokens).
        added: token ids matched whole in the raw text and kept when decoding
            (llama.cpp's user-defined tokens).
        unk_id: the unknown token's id, or None (a character with neither a token nor
            every byte token is then dropped).
        add_space_prefix: put ``▁`` before each stretch of text between matched tokens.
        bos_id: id put first by ``encode(add_special_tokens=True)``, or None.
        eos_id: id put last by ``encode(add_special_tokens=True)``, or None.
    """

    def __init__(
        self,
        tokens: Sequence[str],
        scores: Sequence[float],
        *,
        special: Sequence[int] = (),
        added: Sequence[int] = (),
        unk_id: int | None = None,
        add_space_prefix: bool = True,
        bos_id: int | None = None,
        eos_id: int | None = None,
    ) -> None:
        if len(scores) != len(tokens):
            raise ValueError(f"{len(scores)} scores for {len(tokens)} tokens")
        self.tokens = list(tokens)
        # the first id of a repeated string wins: reversed, the smallest id is set last
        self.vocab: dict[str, int] = dict(
            zip(reversed(self.tokens), range(len(self.tokens) - 1, -1, -1), strict=True)
        )
        self.scores = scores
        self.add_space_prefix = add_space_prefix
        self.bos_id, self.eos_id = bos_id, eos_id
        self.unk_id = self.vocab.get(self.tokens[unk_id]) if unk_id is not None else None
        self._bytes = [self.vocab.get(f"<0x{b:02X}>") for b in range(256)]
        # matched whole, by their text; an id of a repeated string stands for its first id
        self._matched: dict[str, int] = {}
        self.special_ids: set[int] = set()
        for ids, is_special in ((special, True), (added, False)):
            for i in ids:
                text = self.tokens[i]
                if text:
                    self._matched.setdefault(text, self.vocab[text])
                    if is_special:
                        self.special_ids.add(self.vocab[text])
        self._trie: dict[str, Any] = {}  # character -> node; "" -> the id ending here
        for text, i in self._matched.items():
            node = self._trie
            for ch in text:
                node = node.setdefault(ch, {})
            node[""] = i  # "" is never a character: the id of the text ending here

    # ------------------------------------------------------------------ encode
    def vocab_size(self) -> int:
        """Number of distinct token strings (as ``tokenizers`` counts a vocabulary)."""
        return len(self.vocab)

    def id_to_token(self, token_id: int) -> str | None:
        """The piece of ``token_id``; None for an id out of range or a repeated string's
        later id (its string is its first id's)."""
        if 0 <= token_id < len(self.tokens):
            text = self.tokens[token_id]
            if self.vocab.get(text) == token_id:
                return text
        return None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """The ids of ``text``, with BOS / EOS when ``add_special_tokens``."""
        ids: list[int] = []
        if add_special_tokens and self.bos_id is not None:
            ids.append(self.bos_id)
        for piece, matched in self._split(text):
            if matched is not None:
                ids.append(matched)
            else:
                ids.extend(self._join(piece))
        if add_special_tokens and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """:meth:`encode` of each text, with BOS / EOS."""
        return [self.encode(text) for text in texts]

    def _split(self, text: str) -> list[tuple[str, int | None]]:
        """``text`` cut around the matched tokens: (stretch, None) and (token text, id),
        each match the longest one starting at the leftmost place left."""
        trie, start, i, n = self._trie, 0, 0, len(text)
        out: list[tuple[str, int | None]] = []
        if not trie:
            return [(text, None)] if text else []
        while i < n:
            node = trie.get(text[i])
            if node is None:
                i += 1
                continue
            found, end, j = node.get(""), i + 1, i + 1
            while j < n:
                node = node.get(text[j])
                if node is None:
                    break
                j += 1
                if "" in node:
                    found, end = node[""], j
            if found is None:
                i += 1
                continue
            if start < i:
                out.append((text[start:i], None))
            out.append((text[i:end], found))
            start = i = end
        if start < n:
            out.append((text[start:], None))
        return out

    def _symbols(self, text: str) -> list[int]:
        """The first pieces of a stretch: its characters' ids, byte tokens for a character
        the vocabulary lacks, else the unknown token (consecutive ones fused)."""
        vocab, byte_ids, out = self.vocab, self._bytes, []
        unk_open = False
        for ch in text:
            i = vocab.get(ch)
            if i is not None:
                out.append(i)
                unk_open = False
                continue
            codes = [byte_ids[b] for b in ch.encode("utf-8", "surrogatepass")]
            if None not in codes:
                out.extend(codes)  # type: ignore[arg-type]
                unk_open = False
            elif self.unk_id is not None and not unk_open:
                out.append(self.unk_id)
                unk_open = True
        return out

    def _join(self, text: str) -> list[int]:
        """Ids of one stretch of text (no matched tokens in it)."""
        if self.add_space_prefix and text:
            text = _SPACE + text
        ids = self._symbols(text.replace(" ", _SPACE))
        n = len(ids)
        if n < 2:
            return ids
        tokens, vocab, scores = self.tokens, self.vocab, self.scores
        nxt = [*range(1, n), -1]
        prv = [*range(-1, n - 1)]
        alive = [True] * n
        heap: list[_Entry] = []

        def candidate(pos: int, left: int, right: int) -> _Entry | None:
            ltext = tokens[left]
            joined = vocab.get(ltext + tokens[right])
            if joined is None:
                return None
            # rank: the joined entry's score (higher first), the longer left piece, the
            # ids; then the place (leftmost first)
            return (-scores[joined], -len(ltext), left, right, pos, joined)

        for pos in range(n - 1):
            entry = candidate(pos, ids[pos], ids[pos + 1])
            if entry is not None:
                heap.append(entry)
        heapq.heapify(heap)
        push, pop = heapq.heappush, heapq.heappop
        while heap:
            pos, joined = pop(heap)[4:]
            right = nxt[pos]
            if not alive[pos] or right == -1:
                continue
            # a stale entry: the pair at this place has changed since. As the tokenizers
            # library does, it still joins if the pair there now makes the same token.
            if vocab.get(tokens[ids[pos]] + tokens[ids[right]]) != joined:
                continue
            ids[pos] = joined
            alive[right] = False
            after = nxt[right]
            nxt[pos] = after
            if after != -1:
                prv[after] = pos
            before = prv[pos]
            if before != -1 and (entry := candidate(before, ids[before], joined)) is not None:
                push(heap, entry)
            if after != -1 and (entry := candidate(pos, joined, ids[after])) is not None:
                push(heap, entry)
        return [ids[k] for k in range(n) if alive[k]]

    # ------------------------------------------------------------------ decode
    @functools.cached_property
    def _byte_of(self) -> dict[int, int]:
        """id -> byte, for the ids whose piece is a byte token ``<0xXX>``: each of the
        about 500 texts :func:`_byte_value` reads looked up in the vocabulary, not the
        vocabulary scanned (262,144 pieces in Gemma 3's: 25 ms of the first decode)."""
        out = {}
        for text in _BYTE_TEXTS:
            i = self.vocab.get(text)
            if i is not None:
                out[i] = _BYTE_TEXTS[text]
        return out

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """The text of ``ids``: ``▁`` as spaces, byte-token runs as UTF-8."""
        parts: list[str] = []
        run = bytearray()
        byte_of, skip = self._byte_of, self.special_ids if skip_special_tokens else ()
        for token_id in ids:
            token_id = int(token_id)
            byte = byte_of.get(token_id)
            if byte is not None:
                run.append(byte)
                continue
            text = self.id_to_token(token_id)
            if text is None or token_id in skip:
                continue
            if run:
                parts.append(_run_text(run))
                run = bytearray()
            parts.append(text.replace(_SPACE, " "))
        if run:
            parts.append(_run_text(run))
        out = "".join(parts)
        if self.add_space_prefix and out.startswith(" "):
            out = out[1:]
        return out


def _byte_value(text: str) -> int | None:
    """The byte of a ``<0xXX>`` token, else None."""
    if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        digits = text[3:5].removeprefix("+")  # as Rust's u8::from_str_radix reads it
        if digits and all(c in _HEX for c in digits):
            return int(digits, 16)
    return None


#: Every text :func:`_byte_value` reads as a byte, with its byte.
_BYTE_TEXTS = {
    text: byte
    for text in [f"<0x{a}{b}>" for a in _HEX for b in _HEX] + [f"<0x+{a}>" for a in _HEX]
    if (byte := _byte_value(text)) is not None
}


def _run_text(run: bytearray) -> str:
    """A run of byte tokens: its UTF-8 text, or one U+FFFD per byte when it is not valid."""
    try:
        return run.decode("utf-8")
    except UnicodeDecodeError:
        return "\ufffd" * len(run)
