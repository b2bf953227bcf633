"""GGUF files of the decoder families, written here with gguf.GGUFWriter under llama.cpp's
tensor names (q/k rows permuted for llama, GPT-2's Conv1D weights transposed), in F32, F16
and Q8_0. The reference is transformers on the same checkpoint with every weight replaced
by what the GGUF file holds after ``gguf.quants.dequantize``: attnlab's GGUF load must give
its logits within 1e-5, so the dequantisation, the un-permutation and the name map are all
exact."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

if not all(importlib.util.find_spec(m) for m in ("transformers", "tokenizers", "gguf")):
    pytest.skip("needs transformers, tokenizers and gguf", allow_module_level=True)

from attnlab.generation import generate
from attnlab.models.decoder import Decoder
from attnlab.pretrained import ModelFileError, load_pretrained
from attnlab.pretrained.gguf_file import read_gguf
from attnlab.pretrained.tokenizer import tokenizer_from_gguf
from model_files import (
    CORPUS,
    TINY_CONFIGS,
    TINY_ENCODERS,
    assert_matches_reference,
    save_hf,
    tiny_config,
    write_gguf,
)

# Every decoder family of the one table, as a GGUF file can hold it.
CONFIGS = {f: tiny_config(f, gguf=True) for f in TINY_CONFIGS if f not in TINY_ENCODERS}
QTYPES = ["F32", "F16", "Q8_0", "Q4_0", "Q4_1"]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-families")
    return {f: save_hf(f, c, root / f, torch.float32) for f, c in CONFIGS.items()}


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_gguf_logits_equal_transformers_on_the_dequantised_weights(
    hf_dirs, tmp_path, family, qtype
):
    from transformers import AutoModelForCausalLM

    path = tmp_path / f"{family}.{qtype}.gguf"
    reference_state = write_gguf(hf_dirs[family], path, family, qtype)
    ref = AutoModelForCausalLM.from_pretrained(hf_dirs[family], attn_implementation="eager")
    if "embed_out.weight" in reference_state:  # transformers 5 loads GPT-NeoX's as lm_head
        reference_state["lm_head.weight"] = reference_state.pop("embed_out.weight")
    missing, unexpected = ref.load_state_dict(reference_state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    ref.eval()
    model, tok = load_pretrained(path)
    family_read = "llama" if family == "mistral" else family  # the file says "llama"
    assert isinstance(model, Decoder) and model.config.family == family_read
    ids = torch.tensor([tok.encode(CORPUS[1])])
    assert_matches_reference(model, ref, ids)
    if qtype == "F32":
        st_model, _ = load_pretrained(hf_dirs[family])
        with torch.no_grad():
            torch.testing.assert_close(model(ids), st_model(ids), atol=1e-5, rtol=0)
        ours = generate(model, ids, 8)
        assert ours.tolist() == generate(st_model, ids, 8).tolist()


@pytest.mark.parametrize("family", ["gpt2", "llama", "mistral", "qwen2", "qwen3"])
def test_gguf_tokenizer_with_llama_cpp_pre_tokenizer_names(hf_dirs, tmp_path, family):
    path = tmp_path / f"{family}.gguf"
    write_gguf(hf_dirs[family], path, family, "F32")
    _, tok = load_pretrained(path)
    _, hf_tok = load_pretrained(hf_dirs[family])
    for text in CORPUS:  # the regexes agree on plain text
        assert tok.encode(text) == hf_tok.encode(text)
        assert tok.decode(tok.encode(text)) == text
    # The split llama.cpp's name stands for: llama3 runs of <= 3 digits, qwen2 single digits.
    pieces = [p for p, _ in tok.backend.tokenizer.pre_tokenizer.pre_tokenize_str("12345 abc")]
    expected = {
        "llama": ["123", "45", "Ġabc"],
        "mistral": ["123", "45", "Ġabc"],
        "qwen2": ["1", "2", "3", "4", "5", "Ġabc"],
        "qwen3": ["1", "2", "3", "4", "5", "Ġabc"],
        "gpt2": ["12345", "Ġabc"],
    }[family]
    assert pieces == expected
    assert tok.eos_id == hf_tok.eos_id


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        ("stablelm2", ["1", "2", "3", "4", "5", "Ġabc", "'S"]),  # llama.cpp: qwen2's split
        ("olmo", ["12345", "Ġabc", "'", "S"]),  # GPT-2's ('s lower-case only)
        ("mpt", ["12345", "Ġabc", "'", "S"]),
        ("command-r", ["1", "2", "3", "4", "5", "Ġabc", "'", "S"]),  # digits, then GPT-2
    ],
)
def test_more_llama_cpp_pre_tokenizer_names_split_as_llama_cpp_does(pre, pieces):
    from attnlab.pretrained.tokenizer import _pre_tokenizer

    assert [p for p, _ in _pre_tokenizer(pre).pre_tokenize_str("12345 abc'S")] == pieces


def _refused(path, *words):
    with pytest.raises(ModelFileError) as info:
        load_pretrained(path)
    message = str(info.value)
    assert str(path) in message and all(w in message for w in words), message


def test_gguf_rope_variants_held_in_tensors_or_unknown_scalings_are_refused(hf_dirs, tmp_path):
    import numpy as np

    def longrope(w, n=4):  # llama.cpp's Phi3MiniModel's tensors, without the metadata keys
        w.add_tensor("rope_factors_long.weight", np.ones(n, dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.ones(n, dtype=np.float32))

    write_gguf(hf_dirs["phi3"], tmp_path / "long.gguf", "phi3", "F32", extra=longrope)
    _refused(tmp_path / "long.gguf", "phi3.rope.scaling.original_context_length")

    def half_longrope(w):  # one of the pair only
        w.add_tensor("rope_factors_long.weight", np.ones(4, dtype=np.float32))

    write_gguf(hf_dirs["phi3"], tmp_path / "half.gguf", "phi3", "F32", extra=half_longrope)
    _refused(tmp_path / "half.gguf", "rope_factors_long.weight", "rope_factors_short.weight")

    def wrong_length(w):
        longrope(w, 8)  # partial rotary 0.5 of head dim 16: 4 pairs
        w.add_uint32("phi3.rope.scaling.original_context_length", 16)

    write_gguf(hf_dirs["phi3"], tmp_path / "wrong.gguf", "phi3", "F32", extra=wrong_length)
    _refused(tmp_path / "wrong.gguf", "rope_factors_long.weight", "4 factors")

    def yarn(w):
        w.add_string("qwen2.rope.scaling.type", "yarn")

    write_gguf(hf_dirs["qwen2"], tmp_path / "yarn.gguf", "qwen2", "F32", extra=yarn)
    _refused(tmp_path / "yarn.gguf", "qwen2.rope.scaling.factor", "finite number > 0")

    def dynamic(w):
        w.add_string("qwen2.rope.scaling.type", "dynamic")

    write_gguf(hf_dirs["qwen2"], tmp_path / "dynamic.gguf", "qwen2", "F32", extra=dynamic)
    _refused(tmp_path / "dynamic.gguf", "qwen2.rope.scaling.type", "'dynamic'")

    def short_freqs(w):  # llama.cpp's Llama 3 divisors, one per rotating pair: 8 here
        w.add_tensor("rope_freqs.weight", np.ones(3, dtype=np.float32))

    write_gguf(hf_dirs["qwen2"], tmp_path / "freqs.gguf", "qwen2", "F32", extra=short_freqs)
    _refused(tmp_path / "freqs.gguf", "rope_freqs.weight", "must hold 8 factors")

    def odd_rotary(w):
        w.add_uint32("qwen3.rope.dimension_count", 7)

    write_gguf(hf_dirs["qwen3"], tmp_path / "odd.gguf", "qwen3", "F32", extra=odd_rotary)
    _refused(tmp_path / "odd.gguf", "qwen3.rope.dimension_count", "even number")


def test_gguf_architecture_mistral_is_refused_with_the_llama_hint(hf_dirs, tmp_path):
    from gguf import GGUFWriter

    path = tmp_path / "m.gguf"
    w = GGUFWriter(path, "mistral")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _refused(path, "'mistral'", "as 'llama'")


SPM_TEXTS = [
    *CORPUS,
    "  two leading spaces and  two inside",
    "tabs\tand\nnewlines",
    "日本語 and ünïcödé ✓",  # not in the vocabulary: UTF-8 byte tokens
    "hello<|end|>world <|end|>",  # a control token, matched whole
    "a",
    "",
]


@pytest.mark.parametrize("family", ["gemma2", "phi3"])
def test_gguf_sentencepiece_tokenizer_equals_transformers_on_the_same_file(
    hf_dirs, tmp_path, family
):
    """gemma2 (no space prefix) and phi3 (a space prefix) files hold a SentencePiece
    vocabulary (tokens, scores, types, byte tokens): ids and text equal to the tokenizer
    transformers builds from the same GGUF file."""
    from transformers import AutoTokenizer

    path = tmp_path / f"{family}.gguf"
    write_gguf(hf_dirs[family], path, family, "F32")
    _, tok = load_pretrained(path)
    ref = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in SPM_TEXTS:
        ids = tok.encode(text)
        assert ids == ref(text)["input_ids"], text
        assert ids[0] == tok.bos_id == 1  # add_bos_token defaults to true
        shown = tok.decode(ids, skip_special_tokens=True)
        assert shown == ref.decode(ids, skip_special_tokens=True)
        if "<|end|>" not in text:
            assert shown == text
    # 日 and 本 are not in the vocabulary: their UTF-8 bytes; phi3 puts the space prefix
    # (a lone ▁ here) first, gemma2 none; spaces inside become ▁ either way.
    pieces = [tok.id_to_token(i) for i in tok.encode("日本 the cat")]
    utf8 = ["<0xE6>", "<0x97>", "<0xA5>", "<0xE6>", "<0x9C>", "<0xAC>"]
    prefix = ["\u2581"] if family == "phi3" else []
    assert pieces == ["<s>", *prefix, *utf8, "\u2581the", "\u2581cat"]


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("family", ["gemma2", "phi3"])
def test_gguf_q4_codes_kept_as_int4_through_the_fused_splits(hf_dirs, tmp_path, family, qtype):
    """dtype="int4" keeps the file's 4-bit codes (split like the values: phi3's fused
    attn_qkv and ffn_up): every projection an Int4Linear, logits within the bf16 rounding
    of the block scales of the dequantised load (a wrong split would be off by O(1))."""
    from attnlab.quant import Int4Linear

    path = tmp_path / f"{family}.{qtype}.gguf"
    write_gguf(hf_dirs[family], path, family, qtype)
    model, tok = load_pretrained(path)
    packed, _ = load_pretrained(path, dtype="int4")
    layers = CONFIGS[family]["num_hidden_layers"]
    assert sum(isinstance(m, Int4Linear) for m in packed.modules()) >= 7 * layers
    ids = torch.tensor([tok.encode(CORPUS[1])])
    with torch.no_grad():
        torch.testing.assert_close(packed(ids), model(ids), atol=0.1, rtol=0)


def test_gguf_q8_0_linears_keep_their_values_under_int4_not_requantised(hf_dirs, tmp_path):
    """dtype="int4" on 8-bit blocks: every projection, and the head tied to the Q8_0
    embedding, is held as q8_0: the file's codes and float16 scales, so every weight is
    the file's value (int4 would quantise them again; int8 keeps one scale per row)."""
    from attnlab.quant import Q8Linear

    path = tmp_path / "gemma2.Q8_0.gguf"
    write_gguf(hf_dirs["gemma2"], path, "gemma2", "Q8_0")
    model, _ = load_pretrained(path)
    held, _ = load_pretrained(path, dtype="int4")
    layers = {n: m for n, m in held.named_modules() if hasattr(m, "in_features")}
    assert "lm_head" in layers and len(layers) >= 7 * CONFIGS["gemma2"]["num_hidden_layers"]
    for name, layer in layers.items():
        assert isinstance(layer, Q8Linear), name
        assert layer.scales.dtype == torch.float16, name
        values = model.get_submodule(name).weight  # the file dequantised: d * q
        assert torch.equal(layer.weight, values), name


def test_gguf_q8_0_embedding_is_held_as_the_files_codes_and_looks_up_its_values(hf_dirs, tmp_path):
    """dtype="int4" on a Q8_0 embedding tied to the head: the table stays the file's codes
    (no float32 copy: Gemma 3's would be 670 MB), one module serves the lookup and the
    head, every row looked up is the file's value, and the greedy text is the same as with
    a float table."""
    from attnlab.quant import HeldEmbedding, Q8Linear

    path = tmp_path / "gemma2.Q8_0.gguf"
    write_gguf(hf_dirs["gemma2"], path, "gemma2", "Q8_0")
    model, tok = load_pretrained(path)
    held, _ = load_pretrained(path, dtype="int4")
    table = held.tok_embeddings
    assert isinstance(table, HeldEmbedding) and isinstance(held.lm_head, Q8Linear)
    assert table.table is held.lm_head
    assert "tok_embeddings.weight" not in dict(held.named_parameters())
    assert [n for n, m in held.named_modules() if m is held.lm_head] == ["lm_head"]
    values = model.tok_embeddings.weight
    ids = torch.arange(values.shape[0]).view(2, -1)
    assert torch.equal(table(ids), values[ids])
    assert torch.equal(table.weight, values)
    prompt = torch.tensor([tok.encode(CORPUS[1])])
    with torch.no_grad():
        assert torch.equal(
            generate(held, prompt, 12), generate(_float_table(held, values), prompt, 12)
        )


def _float_table(model, values):
    """``model`` with its held table swapped for a float ``nn.Embedding`` of ``values``."""
    import copy

    other = copy.deepcopy(model)
    other.tok_embeddings = torch.nn.Embedding.from_pretrained(values.clone())
    other.invalidate_decode_plan()
    return other


@pytest.mark.parametrize("family", ["llama", "phi3", "gemma2"])
def test_gguf_q5_0_linears_kept_as_stored_under_int4(hf_dirs, tmp_path, family):
    """dtype="int4" on Q5_0 blocks: every projection (llama's q/k rows permuted back,
    phi3's fused attn_qkv and ffn_up split, as the values are) and the head (gemma2's tied
    to the Q5_0 embedding) is held as q5_0: the file's blocks, every weight the value the
    float32 load dequantised (gguf-py); the logits within the bf16 rounding of the rows
    and, without the native build, of the q8_0 path's scales (a wrong bit order or split
    would be off by O(1))."""
    from attnlab.quant import Q5Linear

    path = tmp_path / f"{family}.Q5_0.gguf"
    write_gguf(hf_dirs[family], path, family, "Q5_0")
    model, tok = load_pretrained(path)
    held, _ = load_pretrained(path, dtype="int4")
    layers = {n: m for n, m in held.named_modules() if hasattr(m, "in_features")}
    assert "lm_head" in layers and len(layers) >= 7 * CONFIGS[family]["num_hidden_layers"]
    for name, layer in layers.items():
        assert isinstance(layer, Q5Linear), name
        assert torch.equal(layer.weight, model.get_submodule(name).weight), name
    ids = torch.tensor([tok.encode(CORPUS[1])])
    with torch.no_grad():
        ours, reference = held(ids), model(ids)
    torch.testing.assert_close(ours, reference, atol=0.1, rtol=0)
    # bf16 rows through a few layers (1e-2 and below); without the native build the q8_0
    # path's bf16 scales add 2^-8 of each weight (2e-2 and below)
    assert ((ours - reference).norm() / reference.norm()).item() < 3e-2


def test_gguf_gemma2_summary_shows_softcaps_and_the_window_pattern(hf_dirs, tmp_path, capsys):
    from cli_runner import run_main

    path = tmp_path / "gemma2.gguf"
    write_gguf(hf_dirs["gemma2"], path, "gemma2", "Q8_0")
    code, out, err = run_main(capsys, "info", "--model", str(path), "--json", "-t", "16")
    assert code == 0, err
    data = json.loads(out)
    assert (data["attn_softcap"], data["final_softcap"]) == (5.0, 10.0)
    assert [lay["sliding_window"] for lay in data["per_layer"]] == [5, None, 5]
    assert data["head_dim"] == 32 and data["kv_heads"] == 2
    code, out, err = run_main(capsys, "info", "--model", str(path))
    assert code == 0, err
    assert "attention 5, final 10" in out


def test_streamed_sentencepiece_text_keeps_the_space_of_the_first_new_token(
    hf_dirs, tmp_path, capsys
):
    """A SentencePiece decoder drops the leading space of a sequence; a stream continuing a
    prompt decodes after the prompt's last token, so "time" + "▁there" shows " there"."""
    from attnlab.generation import TextStream

    path = tmp_path / "phi3.gguf"
    write_gguf(hf_dirs["phi3"], path, "phi3", "F32")
    _, tok = load_pretrained(path)
    prompt, rest = (
        tok.encode("Once upon a time"),
        tok.encode("there was a cat", add_special_tokens=False),
    )
    assert tok.id_to_token(rest[0]).startswith("\u2581")
    stream = TextStream(tok, prompt[-1:])
    shown = "".join(stream.push(t) for t in rest) + stream.flush()
    assert shown == " there was a cat"
    bare = TextStream(tok)
    assert "".join(bare.push(t) for t in rest) + bare.flush() == "there was a cat"
    # the command line streams the same text as decoding the whole sequence at once
    from attnlab.generation import generate
    from cli_runner import run_main

    model, _ = load_pretrained(path)
    ids = generate(model, torch.tensor([prompt]), 6)[0].tolist()
    code, out, err = run_main(
        capsys, "generate", "--model", str(path), "Once upon a time", "-n", "6"
    )
    assert code == 0, err
    assert out.rstrip("\n") == tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("key", ["add_space_prefix", "add_bos_token"])
def test_gguf_sentencepiece_flag_that_is_not_a_bool_is_refused(hf_dirs, tmp_path, key):
    # bool("false") is True: a flag stored as a string must not silently flip the tokenizer
    path = tmp_path / "flag.gguf"
    write_gguf(
        hf_dirs["phi3"],
        path,
        "phi3",
        "F32",
        extra=lambda w: w.add_string(f"tokenizer.ggml.{key}", "false"),
    )
    _refused(path, f"tokenizer.ggml.{key}", "must be a bool", "'false'")


def test_gguf_sentencepiece_tables_that_disagree_are_refused(hf_dirs, tmp_path, monkeypatch):
    import model_files

    real = model_files.spm_vocab

    def short_scores(n_vocab):
        tokens, scores, types = real(n_vocab)
        return tokens, scores[:-3], types

    monkeypatch.setattr(model_files, "spm_vocab", short_scores)
    path = tmp_path / "short.gguf"
    write_gguf(hf_dirs["phi3"], path, "phi3", "F32")
    _refused(path, "tokenizer.ggml.scores", "one number per token")


def test_gguf_tokenizer_read_back_from_the_cache_equals_the_one_built(
    hf_dirs, tmp_path, monkeypatch
):
    """A byte-level BPE tokenizer rebuilt from a file is kept in attnlab's cache: the entry
    read back encodes and decodes as the build it came from; a change to any tokenizer key
    makes another entry; a damaged entry is rebuilt, not trusted. A SentencePiece one
    (tokenized from its scores, nothing built) writes no entry."""
    from attnlab.pretrained.tokenizer import tokenizer_cache_key

    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "qwen2.gguf"
    write_gguf(hf_dirs["qwen2"], path, "qwen2", "F32")
    contents = read_gguf(path)
    built = tokenizer_from_gguf(contents)
    entry = tmp_path / "cache" / "tokenizers" / f"{tokenizer_cache_key(contents)}.json"
    assert entry.is_file()
    cached = tokenizer_from_gguf(read_gguf(path))
    texts = [*CORPUS, "  two spaces\tand\nnewlines", "日本語 ✓", ""]
    for text in texts:
        ids = built.encode(text)
        assert cached.encode(text) == ids, text
        assert cached.decode(ids) == built.decode(ids)
    other = dataclasses.replace(
        contents, metadata=dict(contents.metadata, **{"tokenizer.ggml.pre": "gpt2"})
    )
    assert tokenizer_cache_key(other) != tokenizer_cache_key(contents)
    split = tokenizer_from_gguf(other).backend.tokenizer.pre_tokenizer.pre_tokenize_str
    assert [p for p, _ in split("12345")] == ["12345"]  # GPT-2's split, not qwen2's digits
    entry.write_text("{not json")
    assert tokenizer_from_gguf(read_gguf(path)).encode("the cat") == built.encode("the cat")
    assert entry.read_text().startswith("{") and "not json" not in entry.read_text()
    spm = tmp_path / "phi3.gguf"
    write_gguf(hf_dirs["phi3"], spm, "phi3", "F32")
    before = set((tmp_path / "cache" / "tokenizers").iterdir())
    assert tokenizer_from_gguf(read_gguf(spm)).encode("the cat")
    assert set((tmp_path / "cache" / "tokenizers").iterdir()) == before
