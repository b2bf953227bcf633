"""attnlab's SentencePiece tokenizer (joins ranked from the scores, no merge table) against
the ``tokenizers`` BPE model built from the ranked merge table (tests/spm_reference.py, the
build attnlab used before and checked against transformers): the same ids and text for
hand-made vocabularies that reach every rule, for the tiny gemma2 and phi3 GGUF files on
thousands of generated texts, and (test_gemma3_file.py) for Gemma 3's own file."""

from __future__ import annotations

import importlib.util
import random
from types import SimpleNamespace

import pytest

if not all(importlib.util.find_spec(m) for m in ("transformers", "tokenizers", "gguf")):
    pytest.skip("needs transformers, tokenizers and gguf", allow_module_level=True)

import torch

from attnlab.pretrained import load_pretrained
from attnlab.pretrained.gguf_file import read_gguf
from attnlab.pretrained.sentencepiece import SentencePieceVocab
from attnlab.pretrained.tokenizer import _sentencepiece_vocab
from model_files import CORPUS, save_hf, tiny_config, write_gguf
from spm_reference import merge_table_tokenizer

BYTES = [f"<0x{b:02X}>" for b in range(256)]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("spm-families")
    return {
        f: save_hf(f, tiny_config(f, gguf=True), root / f, torch.float32)
        for f in ("gemma2", "phi3")
    }


def _contents(tokens, scores, types, **meta):
    """What the two builds read of a GGUF file, for a hand-made vocabulary."""
    metadata = {f"tokenizer.ggml.{k}": v for k, v in meta.items()}
    return SimpleNamespace(
        path="vocab.gguf", metadata=metadata, tokens=tokens, scores=scores, token_types=types
    )


def assert_same(contents, texts, *, ids_to_decode=()):
    """Both builds give the same ids (with and without BOS / EOS) and the same text (with
    and without special tokens) for every text, and decode ``ids_to_decode`` alike."""
    ours, ref = _sentencepiece_vocab(contents), merge_table_tokenizer(contents)
    decoded = list(ids_to_decode)
    for text in texts:
        for special in (True, False):
            expected = ref.encode(text, add_special_tokens=special).ids
            assert ours.encode(text, add_special_tokens=special) == expected, (text, special)
        decoded.append(expected)
    for ids in decoded:
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(
                ids, skip_special_tokens=skip
            ), (ids, skip)
    assert ours.vocab_size() == ref.get_vocab_size(with_added_tokens=True)
    return ours


def test_joins_follow_the_score_then_the_longer_left_piece_then_the_place():
    # "abc": "ab"+"c" and "a"+"bc" both make "abc"; which first depends on the scores of
    # "ab" and "bc"; equal scores ("aa", "aaa" runs) go to the longer left piece and then
    # to the leftmost place
    tokens = ["<unk>", "<s>", "</s>", *BYTES, "a", "b", "c", "ab", "bc", "abc", "aa", "aaa"]
    for ab, bc in ((-1.0, -2.0), (-2.0, -1.0), (-1.0, -1.0)):
        scores = [0.0] * (3 + 256) + [-9.0, -9.0, -9.0, ab, bc, -5.0, -3.0, -3.0]
        types = [2, 3, 3, *[6] * 256, *[1] * 8]
        assert_same(
            _contents(tokens, scores, types, add_space_prefix=False, bos_token_id=1),
            ["abc", "abcabc", "aaaa", "aaaaa", "aabcaaab", "cba", "", "a"],
        )


def test_characters_outside_the_vocabulary_become_bytes_or_one_fused_unknown():
    tokens = ["<unk>", "<s>", "</s>", *BYTES, "\u2581", "a", "\u2581a", "日"]
    scores = [0.0] * len(tokens)
    types = [2, 3, 3, *[6] * 256, 1, 1, 1, 1]
    texts = ["a 本 a", "日本語", "😀", "a\u0301", " ", "  a  "]
    assert_same(_contents(tokens, scores, types, unknown_token_id=0), texts)
    # without byte tokens: the unknown token, one for a run of unknown characters
    few = [t for t in tokens if not t.startswith("<0x")]
    contents = _contents(few, [0.0] * len(few), [2, 3, 3, 1, 1, 1, 1], unknown_token_id=0)
    ours = assert_same(contents, [*texts, "a本本a"])
    assert ours.encode("a本本a", add_special_tokens=False) == [5, 0, 4]


def test_matched_tokens_are_the_longest_at_the_leftmost_place_and_decode_as_typed():
    tokens = ["<unk>", "<s>", "</s>", *BYTES, "<a>", "<a><b>", "\n\n", "\u2581", "x", "<", ">"]
    types = [2, 3, 3, *[6] * 256, 3, 4, 4, 1, 1, 1, 1]
    contents = _contents(tokens, [0.0] * len(tokens), types, add_eos_token=True, eos_token_id=2)
    texts = ["x<a><b>x", "<a><a>\n\n\nx", "<a x>", " <a> x ", "<<a>>"]
    ours = assert_same(contents, texts, ids_to_decode=[[259, 5, 1, 2], [1, 260, 261]])
    # <a> is a control token: dropped with skip_special_tokens; <a><b> is user-defined: kept
    assert ours.decode([259, 260], skip_special_tokens=True) == "<a><b>"


def test_byte_runs_decode_as_utf8_or_one_replacement_per_byte():
    tokens = ["<unk>", "<s>", "</s>", *BYTES, "\u2581", "a"]
    contents = _contents(tokens, [0.0] * len(tokens), [2, 3, 3, *[6] * 256, 1, 1])
    e6, x97, xa5 = 3 + 0xE6, 3 + 0x97, 3 + 0xA5
    ours = assert_same(
        contents, ["日"], ids_to_decode=[[e6, x97, xa5], [e6, x97], [e6, 260, x97, xa5]]
    )
    assert ours.decode([e6, x97, xa5]) == "日"
    assert ours.decode([e6, x97]) == "\ufffd\ufffd"


def test_a_repeated_string_keeps_its_first_id():
    tokens = ["<unk>", "<s>", "</s>", *BYTES, "\u2581", "a", "b", "ab", "ab"]
    contents = _contents(tokens, [0.0] * len(tokens), [2, 3, 3, *[6] * 256, 1, 1, 1, 1, 1])
    ours = assert_same(contents, ["ab", "abab"], ids_to_decode=[[263, 262]])
    assert ours.encode("ab", add_special_tokens=False) == [259, 262]
    assert ours.id_to_token(263) is None and ours.id_to_token(262) == "ab"


def _texts(tokens, n, seed):
    """Text made of the vocabulary's own pieces (so the joins are long), the control
    tokens, characters it lacks, and runs of spaces and newlines."""
    rng = random.Random(seed)
    extra = [" ", "  ", "\n", "\t", "日本", "ünï", "😀", "<|end|>", "<|end", "<s>", "\u2581"]
    pieces = [t.replace("\u2581", " ") for t in tokens if not t.startswith(("<0x", "[PAD"))]
    return [
        "".join(rng.choice(pieces if rng.random() < 0.7 else extra) for _ in range(k))
        for k in (rng.randint(0, 24) for _ in range(n))
    ]


@pytest.mark.parametrize("family", ["gemma2", "phi3"])
def test_tiny_files_tokenize_as_the_merge_table_does(hf_dirs, tmp_path, family):
    """gemma2 (no space prefix) and phi3 (a space prefix): 1,500 generated texts and the
    corpus give the same ids and text; random id runs (byte tokens among them) decode
    alike."""
    path = tmp_path / f"{family}.gguf"
    write_gguf(hf_dirs[family], path, family, "F32")
    contents = read_gguf(path)
    rng = random.Random(1)
    n = len(contents.tokens)
    runs = [[rng.randrange(n) for _ in range(rng.randint(1, 8))] for _ in range(300)]
    texts = [*CORPUS, *_texts(contents.tokens, 1500, seed=2)]
    assert_same(contents, texts, ids_to_decode=runs)
    _, tok = load_pretrained(path)
    assert isinstance(tok.backend, SentencePieceVocab)


def test_a_long_text_tokenizes_in_one_pass(hf_dirs, tmp_path):
    """A 40,000-character text: the same ids as the merge table, in one call."""
    path = tmp_path / "phi3.gguf"
    write_gguf(hf_dirs["phi3"], path, "phi3", "F32")
    contents = read_gguf(path)
    text = " ".join(CORPUS) * (40_000 // len(" ".join(CORPUS)) + 1)
    assert_same(contents, [text])


def test_byte_tokens_are_found_as_a_scan_of_the_vocabulary_finds_them():
    """The ids of byte tokens (looked up: every text that reads as a byte) are those a scan
    of every piece finds: lower and mixed case, Rust's "+" digit, a repeated byte token
    (its first id), and look-alikes that are no byte."""
    from attnlab.pretrained.sentencepiece import _byte_value

    odd = ["<0x0a>", "<0xaB>", "<0x+F>", "<0x41>", "<0xG1>", "<0x411>", "<0x4>", "<0x++>"]
    tokens = ["<unk>", "<s>", "</s>", *BYTES, *odd, "\u2581", "a"]
    contents = _contents(tokens, [0.0] * len(tokens), [2, 3, 3, *[6] * 256, *[1] * 10])
    ours = _sentencepiece_vocab(contents)
    scan = {}
    for i, text in enumerate(tokens):
        byte = _byte_value(text)
        if byte is not None and ours.vocab[text] == i:
            scan[i] = byte
    assert ours._byte_of == scan
    assert scan[3 + 256] == 0x0A and scan[3 + 256 + 2] == 0x0F and 3 + 256 + 3 not in scan
