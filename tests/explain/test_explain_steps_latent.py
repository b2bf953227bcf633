"""Step into a multi-head latent attention head (DeepSeek-V3): the walk from the input
through the latent to keys and values, checked table by table against transformers'
DeepseekV3Attention (its own modules, read by hooks) and its eager attention weights."""

from __future__ import annotations

import importlib.util

import pytest
import torch

if not all(importlib.util.find_spec(m) for m in ("transformers", "tokenizers", "safetensors")):
    pytest.skip("needs transformers, tokenizers and safetensors", allow_module_level=True)

from attnlab.explain.model_trace import trace_model
from attnlab.explain.steps import head_steps, step_sections, step_summary
from attnlab.explain.text import step_renderables
from attnlab.pretrained import load_pretrained
from model_files import save_hf

_MLA = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 12,
    "qk_rope_head_dim": 8,
    "v_head_dim": 10,
    "moe_intermediate_size": 32,
    "max_position_embeddings": 256,
    "first_k_dense_replace": 1,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "pad_token_id": 1,
    "bos_token_id": 0,
    "eos_token_id": 2,
}
CASES = {
    # the query's low-rank pair; YaRN with mscale_all_dim: the score scale is not 1/sqrt(D)
    "q_lora": {
        "q_lora_rank": 24,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
        },
    },
    # one query projection, rotate-half RoPE
    "one_query": {
        "q_lora_rank": None,
        "rope_interleave": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
}
IDS = [5, 77, 301, 12, 480, 9, 66, 150, 33, 7, 250]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("mla_steps")
    return {
        name: save_hf("deepseek_v3", {**_MLA, **edits}, root / name, torch.float32)
        for name, edits in CASES.items()
    }


def _hf_run(folder, layer: int) -> dict[str, torch.Tensor]:
    """transformers' eager run over IDS: what one attention layer's modules computed."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="eager", dtype=torch.float32
    ).eval()
    attn = ref.model.layers[layer].self_attn
    seen: dict[str, torch.Tensor] = {}

    def keep(name: str):
        return lambda _m, _i, out: seen.__setitem__(name, out.detach())

    hooks = [
        getattr(attn, module).register_forward_hook(keep(module))
        for module in ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj")
        + (("q_a_proj", "q_a_layernorm") if attn.q_lora_rank is not None else ())
    ]
    hooks.append(
        attn.o_proj.register_forward_pre_hook(
            lambda _m, args: seen.__setitem__("context", args[0].detach())
        )
    )
    with torch.no_grad():
        out = ref(torch.tensor([IDS]), output_attentions=True)
    for h in hooks:
        h.remove()
    seen["weights"] = out.attentions[layer]  # (1, H, T, T)
    seen["scaling"] = torch.tensor(attn.scaling)
    return seen


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(("head", "token"), [(2, 10), (1, 4)])
def test_latent_walk_is_transformers_attention(checkpoints, case, head, token):
    """Every table of the walk is what transformers' DeepseekV3Attention computed, the
    final weights are its eager attention weights and the context its head's slice."""
    model, _ = load_pretrained(checkpoints[case])
    layer = 1
    s = head_steps(model, IDS, layer=layer, head=head, token=token)
    hf = _hf_run(checkpoints[case], layer)
    w = s.latent
    assert w is not None and w.rank == 16 and w.rope_dim == 8 and s.head_dim == 20
    r, Dn, Dv, H = 16, 12, 10, 4
    close = {"atol": 1e-5, "rtol": 1e-4}
    if case == "q_lora":
        torch.testing.assert_close(w.query_down, hf["q_a_proj"][0, token], **close)
        torch.testing.assert_close(w.query_latent, hf["q_a_layernorm"][0, token], **close)
    else:
        assert w.query_down is None and w.query_latent is None
    torch.testing.assert_close(w.latent_raw, hf["kv_a_proj_with_mqa"][0, :, :r], **close)
    torch.testing.assert_close(w.k_rope, hf["kv_a_proj_with_mqa"][0, :, r:], **close)
    torch.testing.assert_close(w.latent, hf["kv_a_layernorm"][0], **close)
    kv = hf["kv_b_proj"][0].view(len(IDS), H, Dn + Dv)  # (T, H, Dn+Dv)
    torch.testing.assert_close(w.k_nope, kv[:, head, :Dn], **close)
    torch.testing.assert_close(s.values, kv[:, head, Dn:], **close)
    torch.testing.assert_close(s.keys[:, :Dn], w.k_nope)
    torch.testing.assert_close(s.keys[:, Dn:], w.k_rope_rotated)
    torch.testing.assert_close(s.query[:Dn], w.q_nope)
    assert s.scale == pytest.approx(float(hf["scaling"]), rel=1e-6)
    # the step view's final weights: transformers' eager weights for this head and row
    torch.testing.assert_close(s.weights, hf["weights"][0, head, token], atol=1e-6, rtol=0)
    assert s.weights[token + 1 :].eq(0).all() and s.weights.sum() == pytest.approx(1.0)
    # the context: the head's slice of what enters transformers' output projection
    want = hf["context"][0, token, head * Dv : (head + 1) * Dv]
    torch.testing.assert_close(s.context, want, **close)
    # and the head view's weights (the model trace) are the same numbers
    trace = trace_model(model, IDS)
    torch.testing.assert_close(s.weights, trace.head_weights(layer, head)[token])
    assert max(s.checks.values()) < 1e-5, s.checks


def test_rotation_turns_only_the_rotary_dims(checkpoints):
    """Plain RoPE at position 0 is the identity, at later positions it turns the rotary
    dims and keeps their norms (YaRN would also scale them); the nope dims stay."""
    model, _ = load_pretrained(checkpoints["one_query"])
    s = head_steps(model, IDS, layer=1, head=0, token=6)
    w = s.latent
    assert w is not None
    torch.testing.assert_close(w.k_rope_rotated[0], w.k_rope[0])
    assert not torch.allclose(w.k_rope_rotated[6], w.k_rope[6])
    torch.testing.assert_close(w.k_rope_rotated.norm(dim=-1), w.k_rope.norm(dim=-1))
    torch.testing.assert_close(s.query[12:].norm(), w.q_rope.norm())
    assert not torch.allclose(s.query[12:], w.q_rope)


@pytest.mark.parametrize("case", sorted(CASES))
def test_latent_sections_in_both_languages(checkpoints, case):
    """The walk's sections: the latent steps in order, each with the right tables, in
    English and Traditional Chinese; the terminal renders them truncated."""
    model, _ = load_pretrained(checkpoints[case])
    s = head_steps(model, IDS, layer=1, head=3, token=8, source="tiny-v3")
    want = ["input", "query", "rope", "latent", "k_rope", "k_nope", "keys", "scores", "scale"]
    want += ["mask", "weights", "values", "context", "out"]
    if case == "q_lora":
        want.insert(1, "q_down")
    en, zh = step_sections(s, "en"), step_sections(s, "zh-TW")
    assert [x["id"] for x in en] == want == [x["id"] for x in zh]
    by_id = {x["id"]: x for x in en}
    assert [len(t["values"][0]) for t in by_id["latent"]["tables"]] == [16, 16]
    assert [len(t["values"]) for t in by_id["latent"]["tables"]] == [len(IDS)] * 2
    assert [len(t["values"][0]) for t in by_id["k_rope"]["tables"]] == [8, 8]
    assert by_id["latent"]["tables"][1]["values"] == s.latent.latent.tolist()
    assert by_id["k_nope"]["tables"][0]["values"] == s.latent.k_nope.tolist()
    assert by_id["weights"]["tables"][0]["values"] == [s.weights.tolist()]
    assert "W_uv" in by_id["values"]["title"] and "W_uk" in by_id["k_nope"]["title"]
    assert ("W_uq" in by_id["query"]["title"]) == (case == "q_lora")
    assert ("√d_k" in by_id["scale"]["title"]) == (case == "one_query")  # YaRN: mscale
    for a, b in zip(en, zh, strict=True):
        assert a["title"] != b["title"] and a["body"] != b["body"], a["id"]
        assert [t["values"] for t in a["tables"]] == [t["values"] for t in b["tables"]]
    from rich.console import Console

    console = Console(width=120, record=True)
    for lang, sections in (("en", en), ("zh-TW", zh)):
        console.print(*step_renderables(step_summary(s, lang), sections, lang))
    printed = console.export_text()
    assert "c_kv" in printed and "k_nope" in printed and "8 of 11×16 shown" in printed
    assert "潛在向量" in printed


@pytest.mark.browser
def test_the_served_step_view_walks_the_latent(checkpoints):
    """In a real headless Chromium: stepping into an MLA head on the served page shows the
    latent steps, with the walk's own numbers."""
    pytest.importorskip("starlette", reason="pip install 'attnlab[serve]'")
    pytest.importorskip("uvicorn", reason="pip install 'attnlab[serve]'")
    sync_api = pytest.importorskip("playwright.sync_api", reason="needs playwright (dev extra)")
    from attnlab.serve import ModelRegistry, create_app
    from attnlab.serve.models import spec_for
    from explain_helpers import launch_browser
    from serve_helpers import live_server

    folder = checkpoints["q_lora"]
    app = create_app(ModelRegistry([spec_for(str(folder))]), lang="zh-TW")
    with live_server(app) as url, sync_api.sync_playwright() as pw:
        browser = launch_browser(pw)
        p = browser.new_page(viewport={"width": 1280, "height": 900})
        errors: list[str] = []
        p.on("pageerror", lambda e: errors.append(str(e)))
        p.goto(url)
        p.wait_for_selector("body[data-traced='1']", timeout=60_000)
        p.fill("#text", "the cat sat")
        p.click("#explain")
        p.wait_for_function(
            "() => window.attnlabServe.trace.attention.tokens.join('') === 'the cat sat'",
            timeout=60_000,
        )
        p.select_option("#layer", "1")
        p.click(".hv-col.queries .tok[data-i='6']")
        p.wait_for_selector("body[data-stepped='1']", timeout=60_000)
        ids = p.locator("#panel-step .st-sec").evaluate_all("e => e.map(x => x.dataset.step)")
        latent = p.locator("table[data-name='c_kv'] tr").nth(1).locator("td").all_text_contents()
        title = p.text_content("#panel-step .st-sec[data-step='latent'] h3")
        browser.close()
    assert ids[:8] == ["input", "q_down", "query", "rope", "latent", "k_rope", "k_nope", "keys"]
    assert "潛在向量" in title and errors == []
    model, tok = load_pretrained(folder)
    s = head_steps(model, "the cat sat", layer=1, head=0, token=6, tokenizer=tok)
    assert s.latent is not None
    shown = [float(c) for c in latent[:12]]
    torch.testing.assert_close(torch.tensor(shown), s.latent.latent[0, :12], atol=6e-5, rtol=0)
