"""`attnlab serve`'s head endpoints in-process: roles, ablation, the logit lens, rollout.

The numbers are checked against the GPT's own modules driven by plain PyTorch hooks (a
forward pre-hook on ``out_proj``, forward hooks on the blocks), not attnlab's hook points.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("starlette", reason="pip install 'attnlab[serve]'")
pytest.importorskip("httpx", reason="pip install 'attnlab[dev]'")
from starlette.testclient import TestClient

from attnlab.data import get_tokenizer
from attnlab.explain import head_scores, trace_model
from attnlab.serve import ModelRegistry, create_app, example_spec, model_spec
from serve_helpers import tiny_gpt

TEXT = "Every effort moves you forward, and every effort moves you"


@pytest.fixture(scope="module")
def gpt():
    return tiny_gpt(3)


@pytest.fixture(scope="module")
def client(gpt):
    specs = [model_spec(gpt, get_tokenizer(), "tiny"), example_spec("journey")]
    with TestClient(create_app(ModelRegistry(specs)), raise_server_exceptions=False) as c:
        yield c


def ids_of(text):
    return get_tokenizer().encode(text)


def test_heads_scores_every_role_on_the_repeated_input_or_the_text(client, gpt):
    r = client.post("/api/heads", json={"model": "tiny"})
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["roles"] == ["previous_token", "first_token", "current_token", "induction"]
    assert (data["layers"], data["heads"]) == (2, 4) and "repeated twice" in data["input"]
    first = torch.randint(0, 50257, (32,), generator=torch.Generator().manual_seed(0))
    weights = trace_model(gpt, torch.cat([first, first])).weights  # (L, H, 64, 64)
    i = torch.arange(32, 64)
    torch.testing.assert_close(torch.tensor(data["scores"]["induction"]),
                               weights[..., i, i - 31].mean(-1))  # fmt: skip
    r = client.post("/api/heads", json={"model": "tiny", "text": TEXT})
    assert r.status_code == 200 and "induction" not in r.json()["roles"]
    expected = head_scores(gpt, ids_of(TEXT))["previous_token"]
    torch.testing.assert_close(torch.tensor(r.json()["scores"]["previous_token"]), expected)


def test_ablate_matches_a_pre_hook_on_out_proj(client, gpt):
    r = client.post("/api/ablate", json={"model": "tiny", "text": TEXT, "heads": [[1, 2], [0, 0]],
                                         "k": 5})  # fmt: skip
    assert r.status_code == 200, r.text
    data = r.json()
    ids = torch.tensor([ids_of(TEXT)])
    D = 32 // 4

    def zero(head):
        def pre(module, args):
            x = args[0].clone()
            x[..., head * D : (head + 1) * D] = 0
            return (x,)

        return pre

    handles = [gpt.trf_blocks[1].att.out_proj.register_forward_pre_hook(zero(2)),
               gpt.trf_blocks[0].att.out_proj.register_forward_pre_hook(zero(0))]  # fmt: skip
    with torch.no_grad():
        after_logits = gpt(ids)[0, -1]
    for h in handles:
        h.remove()
    with torch.no_grad():
        before_logits = gpt(ids)[0, -1]
    before, after = before_logits.softmax(-1), after_logits.softmax(-1)
    for got, probs in ((data["before"], before), (data["after"], after)):
        values, top = probs.topk(5)
        assert [t["id"] for t in got] == top.tolist()
        torch.testing.assert_close(torch.tensor([t["p"] for t in got]), values)
    # the reference KL in float64 from the same float32 logits: summed in float32, the
    # differences of log-probabilities near log(1/V) alone carry a relative error of 1e-3
    # in a KL this small (the ablated run and the hooked run are the same operations)
    logp, logq = before_logits.double().log_softmax(-1), after_logits.double().log_softmax(-1)
    kl = float((logp.exp() * (logp - logq)).sum())
    assert data["kl"][-1] == pytest.approx(kl, rel=1e-4, abs=1e-7)
    assert data["position"] == ids.shape[1] - 1 and len(data["tokens"]) == ids.shape[1]


def test_lens_is_the_blocks_outputs_through_the_final_norm_and_head(client, gpt):
    r = client.post("/api/lens", json={"model": "tiny", "text": TEXT, "k": 2})
    assert r.status_code == 200, r.text
    data = r.json()
    seen = []
    handles = [b.register_forward_hook(lambda m, a, o: seen.append(o)) for b in gpt.trf_blocks]
    with torch.no_grad():
        gpt(torch.tensor([ids_of(TEXT)]))
        probs = torch.stack([gpt.out_head(gpt.final_norm(h))[0] for h in seen]).softmax(-1)
    for h in handles:
        h.remove()
    assert data["layers"] == 2 and len(data["top"][0]) == len(data["tokens"])
    values, top = probs.topk(2)  # (L, T, 2)
    assert [[[c["id"] for c in cell] for cell in row] for row in data["top"]] == top.tolist()
    got = torch.tensor([[[c["p"] for c in cell] for cell in row] for row in data["top"]])
    torch.testing.assert_close(got, values)


def test_rollout_is_the_formula(client, gpt):
    r = client.post("/api/rollout", json={"model": "tiny", "text": TEXT, "residual": 0.25})
    assert r.status_code == 200, r.text
    got = torch.tensor(r.json()["rollout"])
    w = trace_model(gpt, ids_of(TEXT)).weights.double()
    T = w.shape[-1]
    expected = torch.eye(T, dtype=torch.float64)
    for layer in w:
        a = 0.25 * torch.eye(T, dtype=torch.float64) + 0.75 * layer.mean(0)
        expected = (a / a.sum(-1, keepdim=True)) @ expected
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("path", "key"), [("/api/rollout", "rollout"), ("/api/heads", "scores")])
def test_a_text_too_long_for_dense_weights_names_the_text(path, key):
    # 16 layers x 16 heads: a dense trace holds at most 2**26 weights, 512 tokens.
    gpt = tiny_gpt(0, n_layers=16, n_heads=16, context_length=1024)
    specs = [model_spec(gpt, get_tokenizer(), "deep")]
    with TestClient(create_app(ModelRegistry(specs)), raise_server_exceptions=False) as c:
        text = " a" * 600
        assert len(ids_of(text)) == 600
        r = c.post(path, json={"model": "deep", "text": text})
        assert r.status_code == 413, r.text
        message = r.json()["error"]
        assert message.startswith("`text` has 600 tokens") and "at most 512 tokens" in message
        assert "top_k" not in message
        r = c.post(path, json={"model": "deep", "text": " a" * 20})
        assert r.status_code == 200, r.text
        assert key in r.json()


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        ("/api/ablate", {"model": "tiny", "text": "a b", "heads": [[2, 0]]}, 422, "layers 0..1"),
        ("/api/ablate", {"model": "tiny", "text": "a b", "heads": [[0, 4]]}, 422, "heads 0..3"),
        ("/api/ablate", {"model": "tiny", "text": "a b", "heads": [[0]]}, 422, "[layer, head]"),
        ("/api/ablate", {"model": "tiny", "text": "a b", "heads": "0.1"}, 422, "`heads`"),
        ("/api/ablate", {"model": "tiny", "text": "a", "heads": [], "mode": "x"}, 422, "`mode`"),
        ("/api/ablate", {"model": "tiny", "heads": []}, 422, "`text`"),
        ("/api/lens", {"model": "tiny", "text": "a", "k": 11}, 422, "`k`"),
        ("/api/lens", {"model": "nope", "text": "a"}, 404, "unknown model"),
        ("/api/rollout", {"model": "tiny", "text": "a", "residual": 2}, 422, "`residual`"),
        ("/api/heads", {"model": "example:journey"}, 422, "not a causal language model"),
        ("/api/lens", {"model": "tiny", "text": "a " * 70}, 413, "context length"),
    ],
)
def test_errors_name_the_field(client, path, body, status, needle):
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]
