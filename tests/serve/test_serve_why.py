"""`attnlab serve`'s why-this-token endpoints in-process: /api/attribute and /api/patch
answer exactly what :func:`attnlab.explain.attribute`, :func:`~attnlab.explain.patch` and
:func:`~attnlab.explain.attribution_patching` return, and are bounded like the others."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("starlette", reason="pip install 'attnlab[serve]'")
pytest.importorskip("httpx", reason="pip install 'attnlab[dev]'")
from starlette.testclient import TestClient

from attnlab.data import get_tokenizer
from attnlab.explain import attribute, attribution_patching, patch
from attnlab.serve import (
    ModelRegistry,
    ModelSpec,
    ServeLimits,
    WorkerPool,
    create_app,
    example_spec,
    model_spec,
)
from serve_helpers import tiny_gpt

TEXT = "When Mary and John went to the store, John gave a drink to"
CORRUPTED = "When Mary and John went to the store, Mary gave a drink to"


@pytest.fixture(scope="module")
def gpt():
    return tiny_gpt(5)


@pytest.fixture(scope="module")
def client(gpt):
    specs = [model_spec(gpt, get_tokenizer(), "tiny"), example_spec("journey")]
    limits = ServeLimits(max_chars=200)
    with TestClient(create_app(ModelRegistry(specs), limits=limits),
                    raise_server_exceptions=False) as c:  # fmt: skip
        yield c


def ids_of(text):
    return get_tokenizer().encode(text)


def assert_is(data, expected):
    """The route's JSON is the library's Attribution, number for number."""
    for name in ("total", "logit_difference", "embedding", "bias", "error"):
        assert data[name] == pytest.approx(getattr(expected, name), abs=1e-6), name
    for name in ("heads", "mlp", "by_source"):
        want = getattr(expected, name)
        if want is None:
            assert data[name] is None
        else:
            torch.testing.assert_close(torch.tensor(data[name]), want.float())
    assert data["target"]["id"] == expected.target and data["position"] == expected.position
    assert data["frozen"] == list(expected.frozen)


def test_attribute_is_the_library_attribution_by_text_and_by_ids(client, gpt):
    mary, john = ids_of(" Mary")[0], ids_of(" John")[0]
    body = {"model": "tiny", "text": TEXT, "target": " Mary", "contrast": " John",
            "by_source": True}  # fmt: skip
    r = client.post("/api/attribute", json=body)
    assert r.status_code == 200, r.text
    data = r.json()
    ids = ids_of(TEXT)
    expected = attribute(gpt, ids, mary, john, by_source=True)
    assert_is(data, expected)
    assert data["contrast"] == {"id": john, "token": " John"}
    assert data["ids"] == ids and len(data["tokens"]) == len(ids)
    assert len(data["by_source"][0][0]) == len(ids)
    # The same by ids, at an earlier position, without a contrast.
    r = client.post("/api/attribute", json={"model": "tiny", "ids": ids, "target": mary,
                                            "position": 5})  # fmt: skip
    assert r.status_code == 200, r.text
    assert_is(r.json(), attribute(gpt, ids, mary, None, 5))
    assert r.json()["contrast"] is None and r.json()["by_source"] is None


def test_attribute_without_a_target_explains_the_top_prediction(client, gpt):
    r = client.post("/api/attribute", json={"model": "tiny", "text": TEXT, "k": 4})
    assert r.status_code == 200, r.text
    data = r.json()
    with torch.no_grad():
        probs = gpt(torch.tensor([ids_of(TEXT)]))[0, -1].softmax(-1)
    values, top = probs.topk(4)
    assert [t["id"] for t in data["top"]] == top.tolist()
    torch.testing.assert_close(torch.tensor([t["p"] for t in data["top"]]), values)
    assert data["target"]["id"] == top[0].item()
    assert_is(data, attribute(gpt, ids_of(TEXT), int(top[0])))


@pytest.mark.parametrize(("over", "method"), [("heads", "activation"), ("residual", "activation"),
                                              ("heads", "attribution")])  # fmt: skip
def test_patch_is_the_library_grid(client, gpt, over, method):
    body = {"model": "tiny", "clean": TEXT, "corrupted": CORRUPTED, "target": " Mary",
            "contrast": " John", "over": over, "method": method}  # fmt: skip
    r = client.post("/api/patch", json=body)
    assert r.status_code == 200, r.text
    data = r.json()
    mary, john = ids_of(" Mary")[0], ids_of(" John")[0]
    clean, corrupted = ids_of(TEXT), ids_of(CORRUPTED)
    if method == "attribution":
        expected = attribution_patching(gpt, clean, corrupted, mary, john)
    else:
        expected = patch(gpt, clean, corrupted, mary, john, over=over)
    torch.testing.assert_close(torch.tensor(data["grid"]), expected.float())
    assert (data["over"], data["method"]) == (over, method)
    assert data["tokens"] == [get_tokenizer().decode([i]) for i in clean]
    with torch.no_grad():
        logits = gpt(torch.tensor([clean, corrupted]))[:, -1]
    m = logits[:, mary] - logits[:, john]
    assert data["clean"] == pytest.approx(float(m[0]), abs=1e-4)
    assert data["corrupted"] == pytest.approx(float(m[1]), abs=1e-4)


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        ("/api/attribute", {"model": "tiny", "text": TEXT, "target": " Mary is"}, 422,
         "`target` ' Mary is' is 2 tokens"),
        ("/api/attribute", {"model": "tiny", "text": TEXT, "contrast": 10**6}, 422,
         "`contrast` = 1000000 is not a token id"),
        ("/api/attribute", {"model": "tiny", "text": TEXT, "target": True}, 422, "`target`"),
        ("/api/attribute", {"model": "tiny", "text": "a b", "position": 2}, 422,
         "`position` must be in -2..1"),
        ("/api/attribute", {"model": "tiny", "ids": [1, 10**6]}, 422, "`ids` holds 1000000"),
        ("/api/attribute", {"model": "tiny", "ids": [1, 2], "text": "a"}, 422, "not both"),
        ("/api/attribute", {"model": "tiny", "ids": list(range(70))}, 413,
         "the model's context length"),
        ("/api/attribute", {"model": "tiny", "text": "x" * 201}, 413, "(--max-chars)"),
        ("/api/attribute", {"model": "tiny", "text": "a", "by_source": 1}, 422, "`by_source`"),
        ("/api/attribute", {"model": "example:journey", "text": "a"}, 422,
         "not a causal language model"),
        ("/api/patch", {"model": "tiny", "clean": TEXT, "corrupted": "When John went to",
                        "target": " Mary", "contrast": " John"}, 422,
         "`clean` is 14 tokens and `corrupted` is 4"),
        ("/api/patch", {"model": "tiny", "clean": "x" * 201, "corrupted": "a", "target": 1,
                        "contrast": 2}, 413, "`clean` has 201 characters"),
        ("/api/patch", {"model": "tiny", "clean": "a", "corrupted": "b", "target": 1,
                        "contrast": 2, "over": "mlp", "method": "attribution"}, 422,
         "heads only"),
        ("/api/patch", {"model": "tiny", "clean": "a", "corrupted": "b", "target": 1}, 422,
         "`contrast` is required"),
        ("/api/patch", {"model": "tiny", "clean": "a", "corrupted": "b", "target": 1,
                        "contrast": 2, "over": "layers"}, 422, "`over` must be"),
        ("/api/patch", {"model": "tiny", "corrupted": "b", "target": 1, "contrast": 2}, 422,
         "`clean` must be a string"),
    ],
)  # fmt: skip
def test_errors_name_the_field(client, path, body, status, needle):
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"], r.json()
    assert client.get("/api/models").status_code == 200  # still serving


def test_a_full_queue_answers_429(gpt):
    gate = threading.Event()

    def slow_load():
        gate.wait(10)
        return model_spec(gpt, get_tokenizer(), "slow").load()

    registry = ModelRegistry([ModelSpec("slow", "waits", slow_load)])
    pool = WorkerPool(workers=1, queue=1)
    body = {"model": "slow", "clean": "a b", "corrupted": "a c", "target": 1, "contrast": 2}
    with TestClient(create_app(registry, pool=pool)) as c, ThreadPoolExecutor(2) as ex:
        held = [ex.submit(c.post, "/api/attribute", json={"model": "slow", "text": "hi"})
                for _ in range(2)]  # fmt: skip
        while pool.busy < 2:
            time.sleep(0.01)
        for path, data in (("/api/attribute", {"model": "slow", "text": "hi"}),
                           ("/api/patch", body)):  # fmt: skip
            r = c.post(path, json=data)
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert "--workers 1, --queue 1" in r.json()["error"]
        gate.set()
        assert [f.result().status_code for f in held] == [200, 200]


def test_the_generate_stream_starts_with_the_prompt_ids(client):
    r = client.post("/api/generate", json={"model": "tiny", "text": TEXT, "max_new_tokens": 2})
    assert r.status_code == 200, r.text
    blocks = [b for b in r.text.split("\n\n") if b.strip()]
    assert blocks[0].startswith("event: prompt\n")
    assert f'"ids": {ids_of(TEXT)}'.replace(" ", "") in blocks[0].replace(" ", "")
    assert [b.split("\n")[0] for b in blocks[1:]] == ["event: token"] * 2 + ["event: done"]


def test_a_patch_longer_than_256_tokens_is_refused(gpt):
    app = create_app(ModelRegistry([model_spec(tiny_gpt(5, context_length=512), get_tokenizer(),
                                               "long")]))  # fmt: skip
    with TestClient(app) as c:
        body = {"model": "long", "clean": " a" * 257, "corrupted": " b" * 257, "target": 1,
                "contrast": 2}  # fmt: skip
        r = c.post("/api/patch", json=body)
        assert r.status_code == 413 and r.json()["error"].startswith("`clean` has 257 tokens")
