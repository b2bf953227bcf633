"""Head roles, ablation, the logit lens and rollout against references attnlab did not
compute: transformers' own attention weights (eager), its hidden states through its own
final norm and head, a forward pre-hook on its output projection that zeroes a head's
slice; for attnlab's GPT, the book's GPT written out independently (tests/book_gpt.py)."""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

if not all(importlib.util.find_spec(m) for m in ("transformers", "tokenizers", "gguf")):
    pytest.skip("needs transformers, tokenizers and gguf", allow_module_level=True)

from attnlab.explain import ablate, ablation_effect, head_scores, logit_lens, rollout, trace_model
from attnlab.explain.heads import induction_input, parse_heads, strongest_heads, top_tokens
from attnlab.models.gpt import GPTConfig, GPTModel
from attnlab.pretrained import load_pretrained
from book_gpt import BookGPTModel
from model_files import CORPUS, save_hf, tiny_config, write_gguf

CONFIGS = {
    "llama": {
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "tie_word_embeddings": False,
    },
    "gpt2": tiny_config("gpt2", gguf=True),
    "gemma2": tiny_config("gemma2", gguf=True),
}
SOURCES = ["llama", "gpt2", "gemma2", "llama-gguf", "attnlab-gpt"]
ATOL = 1e-5


class HFReference:
    """A transformers causal LM (eager attention) and where its heads' outputs enter."""

    def __init__(self, model):
        self.model = model.eval()
        cfg = model.config
        self.softcap = getattr(cfg, "final_logit_softcapping", None)
        if hasattr(model, "transformer"):  # GPT-2
            self.o_projs = [blk.attn.c_proj for blk in model.transformer.h]
            self.final_norm = model.transformer.ln_f
            self.head_dim = cfg.n_embd // cfg.n_head
        else:
            self.o_projs = [layer.self_attn.o_proj for layer in model.model.layers]
            self.final_norm = model.model.norm
            self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // (
                cfg.num_attention_heads
            )

    def attentions(self, ids):  # (L, H, T, T)
        with torch.no_grad():
            out = self.model(ids, output_attentions=True)
        return torch.stack([a[0] for a in out.attentions])

    def logits(self, ids, heads=(), mode="zero"):
        D = self.head_dim

        def hook_for(hs):
            def pre(module, args):
                x = args[0].clone()  # (B, T, H*D)
                for h in hs:
                    part = x[..., h * D : (h + 1) * D]
                    x[..., h * D : (h + 1) * D] = 0 if mode == "zero" else part.mean(1, True)
                return (x,)

            return pre

        by_layer: dict[int, list[int]] = {}
        for layer, head in heads:
            by_layer.setdefault(layer, []).append(head)
        handles = [
            self.o_projs[layer].register_forward_pre_hook(hook_for(hs))
            for layer, hs in by_layer.items()
        ]
        try:
            with torch.no_grad():
                return self.model(ids).logits
        finally:
            for h in handles:
                h.remove()

    def lens(self, ids):  # (L, B, T, V)
        with torch.no_grad():
            out = self.model(ids, output_hidden_states=True)
            hs = out.hidden_states  # embeddings, after block 0 .. L-2, normed after L-1
            head = self.model.get_output_embeddings()
            rows = []
            for h in hs[1:-1]:
                logits = head(self.final_norm(h))
                if self.softcap is not None:
                    logits = torch.tanh(logits / self.softcap) * self.softcap
                rows.append(logits)
            rows.append(out.logits)
        return torch.stack(rows)


class BookReference:
    """The book's GPT (independent code): weights from its dropout's input, ablation by a
    pre-hook on its out_proj, the lens from its blocks' outputs."""

    def __init__(self, model, cfg):
        self.model = model.eval()
        self.head_dim = cfg.emb_dim // cfg.n_heads

    def attentions(self, ids):
        seen = []
        handles = [
            blk.att.dropout.register_forward_hook(lambda m, a, o: seen.append(a[0][0]))
            for blk in self.model.trf_blocks
        ]
        with torch.no_grad():
            self.model(ids)
        for h in handles:
            h.remove()
        return torch.stack(seen)

    def logits(self, ids, heads=(), mode="zero"):
        D = self.head_dim
        handles = []
        for layer, head in heads:

            def pre(module, args, head=head):
                x = args[0].clone()
                part = x[..., head * D : (head + 1) * D]
                x[..., head * D : (head + 1) * D] = 0 if mode == "zero" else part.mean(1, True)
                return (x,)

            handles.append(self.model.trf_blocks[layer].att.out_proj.register_forward_pre_hook(pre))
        try:
            with torch.no_grad():
                return self.model(ids)
        finally:
            for h in handles:
                h.remove()

    def lens(self, ids):
        seen = []
        handles = [
            blk.register_forward_hook(lambda m, a, o: seen.append(o))
            for blk in self.model.trf_blocks
        ]
        with torch.no_grad():
            self.model(ids)
            out = torch.stack([self.model.out_head(self.model.final_norm(h)) for h in seen])
        for h in handles:
            h.remove()
        return out


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("heads")
    out = {}
    for family, cfg in CONFIGS.items():
        folder = save_hf(family, cfg, root / family, torch.float32)
        ref = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
        out[family] = (load_pretrained(folder)[0], HFReference(ref), 512)
    folder = root / "llama"
    gguf_path = root / "llama.gguf"
    state = write_gguf(folder, gguf_path, "llama", "F32")
    ref = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    ref.load_state_dict(state, strict=False)
    out["llama-gguf"] = (load_pretrained(gguf_path)[0], HFReference(ref), 512)
    cfg = GPTConfig(vocab_size=97, context_length=96, emb_dim=32, n_heads=4, n_layers=3)
    torch.manual_seed(5)
    ours = GPTModel(cfg).eval()
    torch.manual_seed(5)
    book = BookGPTModel(dataclasses.asdict(cfg))
    out["attnlab-gpt"] = (ours, BookReference(book, cfg), 97)
    return out


def assert_scores(ours: torch.Tensor, expected: np.ndarray) -> None:
    torch.testing.assert_close(ours.double(), torch.from_numpy(expected), atol=ATOL, rtol=0)


def _roles(A: torch.Tensor, n: int | None) -> dict[str, np.ndarray]:
    """The issue's definitions, written out per head with plain loops (float64)."""
    a = A.double().numpy()  # (L, H, T, T)
    L, H, T, _ = a.shape
    out = {r: np.zeros((L, H)) for r in ("previous_token", "first_token", "current_token")}
    if n is not None:
        out["induction"] = np.zeros((L, H))
    for layer in range(L):
        for h in range(H):
            w = a[layer, h]
            out["previous_token"][layer, h] = np.mean([w[i, i - 1] for i in range(1, T)])
            out["first_token"][layer, h] = np.mean([w[i, 0] for i in range(1, T)])
            out["current_token"][layer, h] = np.mean([w[i, i] for i in range(T)])
            if n is not None:
                out["induction"][layer, h] = np.mean([w[i, i - n + 1] for i in range(n, T)])
    return out


@pytest.mark.parametrize("source", SOURCES)
def test_head_scores_on_the_default_repeated_input_match_the_reference_weights(pairs, source):
    model, ref, vocab = pairs[source]
    # The documented default input: 32 tokens from a generator seeded 0, repeated twice.
    first = torch.randint(0, vocab, (32,), generator=torch.Generator().manual_seed(0))
    ids = torch.cat([first, first]).unsqueeze(0)  # (1, 64)
    assert induction_input(vocab).tolist() == ids[0].tolist()
    scores = head_scores(model)
    expected = _roles(ref.attentions(ids), 32)
    assert list(scores) == ["previous_token", "first_token", "current_token", "induction"]
    for role, values in expected.items():
        torch.testing.assert_close(
            scores[role].double(), torch.from_numpy(values), atol=ATOL, rtol=0
        )


@pytest.mark.parametrize("source", ["llama", "gemma2"])
def test_head_scores_on_given_ids_leave_out_induction_unless_repeated(pairs, source):
    model, ref, _ = pairs[source]
    ids = torch.tensor([[5, 9, 17, 3, 5, 30, 41, 7, 2]])
    scores = head_scores(model, ids)
    assert "induction" not in scores
    for role, values in _roles(ref.attentions(ids), None).items():
        torch.testing.assert_close(
            scores[role].double(), torch.from_numpy(values), atol=ATOL, rtol=0
        )
    repeated = torch.tensor([[11, 12, 13, 14, 15, 11, 12, 13, 14, 15]])
    scores = head_scores(model, repeated[0].tolist())
    torch.testing.assert_close(
        scores["induction"].double(),
        torch.from_numpy(_roles(ref.attentions(repeated), 5)["induction"]),
        atol=ATOL,
        rtol=0,
    )


@pytest.mark.parametrize("mode", ["zero", "mean"])
@pytest.mark.parametrize("source", SOURCES)
def test_ablation_matches_a_pre_hook_on_the_reference_output_projection(pairs, source, mode):
    model, ref, vocab = pairs[source]
    ids = torch.tensor([[int(i) % vocab for i in (40, 7, 99, 3, 250, 18, 77, 5, 61, 12)]])
    heads = [(0, 1), (1, 3), (1, 0)]
    ours = ablate(model, ids, heads, mode=mode)
    torch.testing.assert_close(ours, ref.logits(ids, heads, mode), atol=1e-4, rtol=0)
    plain = ref.logits(ids)
    torch.testing.assert_close(ablate(model, ids, []), plain, atol=1e-4, rtol=0)
    assert (ours - plain).abs().max() > 1e-3  # the ablation does change something
    effect = ablation_effect(plain, ours, k=3)
    p, q = torch.softmax(plain.double(), -1), torch.softmax(ours.double(), -1)
    kl = (p * (p.log() - q.log())).sum(-1)
    torch.testing.assert_close(effect.kl.double(), kl, atol=1e-5, rtol=1e-4)
    delta = (q - p).abs()
    assert torch.equal(effect.moved_ids[..., 0], delta.argmax(-1))
    torch.testing.assert_close(effect.moved_after.double() - effect.moved_before.double(),
                               (q - p).gather(-1, effect.moved_ids), atol=1e-6, rtol=0)  # fmt: skip
    assert torch.equal(effect.before_top, plain.argmax(-1))


@pytest.mark.parametrize("source", SOURCES)
def test_logit_lens_matches_the_reference_hidden_states_through_its_norm_and_head(pairs, source):
    model, ref, vocab = pairs[source]
    ids = torch.tensor([[int(i) % vocab for i in (1, 40, 7, 99, 3, 250, 18)]] * 2)
    ids[1, 3] = 8
    lens = logit_lens(model, ids)
    expected = ref.lens(ids)
    assert lens.shape == expected.shape
    torch.testing.assert_close(lens, expected, atol=1e-4, rtol=0)
    probs, top = top_tokens(lens, k=3)
    assert top.shape == (*lens.shape[:3], 3)
    assert torch.equal(top[..., 0], expected.argmax(-1))
    torch.testing.assert_close(probs[..., 0], torch.softmax(expected, -1).amax(-1))


@pytest.mark.parametrize("source", ["gpt2", "gemma2"])
@pytest.mark.parametrize("residual", [0.5, 0.0, 0.9])
def test_rollout_is_the_formula_on_the_exact_weights(pairs, source, residual):
    model, ref, _ = pairs[source]
    ids = torch.tensor([[3, 17, 9, 40, 2, 11, 60, 5]])
    weights = trace_model(model, ids).weights
    theirs = ref.attentions(ids)
    torch.testing.assert_close(weights, theirs, atol=ATOL, rtol=0)
    T = ids.shape[1]
    expected = np.eye(T)
    for layer in theirs.double().numpy():  # first layer to last
        a = residual * np.eye(T) + (1 - residual) * layer.mean(0)
        a = a / a.sum(-1, keepdims=True)
        expected = a @ expected
    got = rollout(weights, residual)
    torch.testing.assert_close(got.double(), torch.from_numpy(expected), atol=1e-5, rtol=0)
    torch.testing.assert_close(got.sum(-1), torch.ones(T))


def test_helpers_and_errors(pairs):
    model = pairs["llama"][0]
    assert parse_heads("3.2, 5.0") == [(3, 2), (5, 0)]
    with pytest.raises(ValueError, match=r"LAYER\.HEAD"):
        parse_heads("3-2")
    with pytest.raises(ValueError, match="layer 7"):
        ablate(model, [1, 2, 3], [(7, 0)])
    with pytest.raises(ValueError, match=r"head 1\.9"):
        ablate(model, [1, 2, 3], [(1, 9)])
    with pytest.raises(ValueError, match="`mode`"):
        ablate(model, [1, 2, 3], [(1, 0)], mode="noise")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`residual`"):
        rollout(torch.ones(1, 1, 2, 2), residual=1.5)
    with pytest.raises(ValueError, match="context length"):
        head_scores(pairs["attnlab-gpt"][0], n=60)
    scores = torch.tensor([[0.1, 0.9], [0.5, 0.2]])
    assert strongest_heads(scores, 2) == [(0, 1, pytest.approx(0.9)), (1, 0, pytest.approx(0.5))]


def test_lens_and_ablation_refuse_an_encoder(tmp_path):
    bert = save_hf(
        "bert",
        {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
         "num_attention_heads": 2, "max_position_embeddings": 32},
        tmp_path / "bert", torch.float32, encoder=True,
    )  # fmt: skip
    model, tok = load_pretrained(bert)
    ids = tok.encode(CORPUS[0])[:6]
    with pytest.raises(TypeError, match="causal language model"):
        logit_lens(model, ids)
    with pytest.raises(TypeError, match="causal language model"):
        ablate(model, ids, [(0, 0)])
