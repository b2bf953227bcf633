"""`attnlab serve`'s JSON API, in-process (Starlette's TestClient): every endpoint, every error."""

from __future__ import annotations

import base64
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

pytest.importorskip("starlette", reason="pip install 'attnlab[serve]'")
pytest.importorskip("httpx", reason="pip install 'attnlab[dev]'")
from starlette.testclient import TestClient

from attnlab.data import get_tokenizer
from attnlab.explain.model_trace import trace_model
from attnlab.models.gpt import GPTConfig, GPTModel
from attnlab.serve import (
    ModelRegistry,
    ModelSpec,
    ServeLimits,
    WorkerPool,
    create_app,
    example_spec,
    model_spec,
)

TEXT = "Every effort moves you forward"


def tiny_gpt(seed: int = 0) -> GPTModel:
    torch.manual_seed(seed)
    cfg = GPTConfig.preset("tiny", vocab_size=50257, context_length=64, emb_dim=32, n_heads=4,
                           n_layers=2)  # fmt: skip
    return GPTModel(cfg).eval()


@pytest.fixture(scope="module")
def gpt() -> GPTModel:
    return tiny_gpt()


def make_app(gpt, *, limits=None, pool=None, extra=()):
    specs = [model_spec(gpt, get_tokenizer(), "tiny"), example_spec("journey"), *extra]
    return create_app(ModelRegistry(specs, max_loaded=2), limits=limits, pool=pool)


@pytest.fixture(scope="module")
def client(gpt):
    with TestClient(make_app(gpt), raise_server_exceptions=False) as c:
        yield c


def head_row(attention: dict, layer: int, head: int, token: int) -> np.ndarray:
    """One query's weights from the page data (dense float32)."""
    S = len(attention["key_tokens"])
    raw = attention["data"][attention["layers"].index(layer)][attention["heads"].index(head)]
    return np.frombuffer(base64.b64decode(raw["v"]), "<f4").reshape(-1, S)[token]


def sse(text: str) -> list[tuple[str, dict]]:
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((lines["event"], json.loads(lines["data"])))
    return out


# ------------------------------------------------------------------------------ happy paths


def test_page_has_a_csp_and_no_other_host(client):
    r = client.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    assert "http://" not in r.text and "https://" not in r.text  # no CDN


def test_models_lists_the_fixed_models_and_limits(client):
    r = client.get("/api/models")
    assert r.status_code == 200
    body = r.json()
    assert [m["name"] for m in body["models"]] == ["tiny", "example:journey"]
    assert body["limits"]["max_chars"] == ServeLimits().max_chars
    assert {m["state"] for m in body["models"]} <= {"idle", "ready", "loading"}


def test_trace_is_the_models_attention(client, gpt):
    r = client.post("/api/trace", json={"model": "tiny", "text": TEXT})
    assert r.status_code == 200, r.text
    att = r.json()["attention"]
    assert "".join(att["tokens"]) == TEXT
    want = trace_model(gpt, TEXT, tokenizer=get_tokenizer())
    np.testing.assert_allclose(head_row(att, 1, 3, 4), want.head_weights(1, 3)[4].numpy())
    assert client.get("/api/models").json()["models"][0]["state"] == "ready"


def test_step_weights_equal_the_trace(client):
    att = client.post("/api/trace", json={"model": "tiny", "text": TEXT}).json()["attention"]
    r = client.post("/api/step", json={"model": "tiny", "text": TEXT, "layer": 1, "head": 2,
                                       "token": 3, "lang": "zh-TW"})  # fmt: skip
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["kind"] == "head" and "查詢詞元" in body["summary"]
    np.testing.assert_allclose(body["weights"], head_row(att, 1, 2, 3), atol=1e-6)
    ids = [s["id"] for s in body["sections"]]
    assert ids[:2] == ["input", "query"] and "weights" in ids and ids[-1] == "out"


def test_example_trace_and_step_are_the_walkthrough(client):
    r = client.post("/api/trace", json={"model": "example:journey"})
    assert r.status_code == 200, r.text
    assert r.json()["attention"]["tokens"][0] == "Your" and r.json()["walkthrough"]["steps"]
    s = client.post("/api/step", json={"model": "example:journey", "token": 1})
    assert s.status_code == 200 and s.json()["kind"] == "walkthrough"
    # The book's attn_weights_2 (seed 123), printed in the seed text.
    assert s.json()["weights"] == pytest.approx([0.1500, 0.2264, 0.2199, 0.1311, 0.0906,
                                                 0.1820], abs=1e-4)  # fmt: skip


def test_generate_streams_tokens_with_bars_and_attention(client, gpt):
    body = {"model": "tiny", "text": TEXT, "max_new_tokens": 5, "layer": 1, "head": 0,
            "bars": 4}  # fmt: skip
    r = client.post("/api/generate", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse(r.text)
    tokens = [d for e, d in events if e == "token"]
    assert events[-1][0] == "done" and events[-1][1]["reason"] == "length"
    assert len(tokens) == 5
    # Greedy: each token is the top bar, and the same as attnlab's generate.
    from attnlab.generation import generate

    ids = get_tokenizer().encode(TEXT)
    want = generate(gpt, torch.tensor([ids]), 5)[0, len(ids) :].tolist()
    assert [t["id"] for t in tokens] == want
    assert all(t["top"][0]["id"] == t["id"] and len(t["top"]) == 4 for t in tokens)
    first = tokens[0]["attention"]
    assert first["query"] == len(ids) - 1 and len(first["weights"]) == len(ids)
    assert sum(first["weights"]) == pytest.approx(1.0, abs=1e-5)
    assert len(tokens[-1]["attention"]["weights"]) == len(ids) + 4


def test_generate_decodes_into_a_static_cache_sized_for_the_call(gpt, monkeypatch):
    """The server generates from the model itself (no wrapper), so, as attnlab's
    `generate`, it asks the model for a static cache of prompt + new tokens."""
    import attnlab.models.gpt as gpt_module

    asked: list[int | None] = []
    real = gpt_module.new_caches

    def recording(n_layers, max_len, **options):
        asked.append(max_len)
        return real(n_layers, max_len, **options)

    monkeypatch.setattr(gpt_module, "new_caches", recording)
    with TestClient(make_app(gpt)) as c:
        r = c.post("/api/generate", json={"model": "tiny", "text": TEXT, "max_new_tokens": 3})
    assert sse(r.text)[-1][0] == "done"
    assert asked == [len(get_tokenizer().encode(TEXT)) + 3]


def test_concurrent_traces_on_one_model(gpt):
    app = make_app(gpt, pool=WorkerPool(workers=4, queue=64))
    texts = [f"{w} " * (3 + i % 7) for i, w in enumerate(["a", "cat", "sat", "on", "mat"] * 8)]
    with TestClient(app) as c:
        want = {t: c.post("/api/trace", json={"model": "tiny", "text": t}).json() for t in texts}
        with ThreadPoolExecutor(8) as ex:
            got = list(ex.map(lambda t: c.post("/api/trace", json={"model": "tiny", "text": t}),
                              texts))  # fmt: skip
    for t, r in zip(texts, got, strict=True):
        assert r.status_code == 200
        assert r.json()["attention"]["data"] == want[t]["attention"]["data"]


def test_a_model_loads_once_and_lru_keeps_max_loaded(gpt):
    loads: list[str] = []

    def spec(name):
        inner = model_spec(gpt, get_tokenizer(), name)

        def load():
            loads.append(name)
            time.sleep(0.05)
            return inner.load()

        return ModelSpec(name, "counted", load)

    registry = ModelRegistry([spec("a"), spec("b"), spec("c")], max_loaded=2)
    with TestClient(create_app(registry, pool=WorkerPool(4, 16))) as c:
        with ThreadPoolExecutor(4) as ex:
            rs = list(ex.map(lambda _: c.post("/api/trace", json={"model": "a", "text": "hi"}),
                             range(4)))  # fmt: skip
        assert all(r.status_code == 200 for r in rs) and loads == ["a"]
        for name in ("b", "c"):
            assert c.post("/api/trace", json={"model": name, "text": "hi"}).status_code == 200
    assert registry.loaded_names() == ["b", "c"]  # "a" left


# ---------------------------------------------------------------------------- error paths


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        ("/api/trace", {"model": "nope", "text": "x"}, 404, "unknown model 'nope'"),
        ("/api/trace", {"model": "/etc/passwd", "text": "x"}, 404, "unknown model"),
        ("/api/trace", {"model": "runs/gpt", "text": "x"}, 404, "choose one of tiny"),
        ("/api/trace", {"model": 3, "text": "x"}, 422, "`model` must be a string"),
        ("/api/trace", {"model": "tiny", "text": ["x"]}, 422, "`text` must be a string"),
        ("/api/trace", {"model": "tiny"}, 422, "`text` must be a string"),
        ("/api/trace", {"model": "tiny", "text": "   "}, 422, "must not be empty"),
        ("/api/trace", {"model": "tiny", "text": "x", "top_k": "3"}, 422, "`top_k` must be an"),
        ("/api/trace", {"model": "tiny", "text": "x", "top_k": 0}, 422, "`top_k` must be >= 1"),
        ("/api/trace", {"model": "tiny", "text": "x", "top_k": 10**6}, 413, "--max-top-k"),
        ("/api/trace", {"model": "tiny", "text": "x", "lang": "fr"}, 422, "`lang` must be one"),
        ("/api/trace", {"model": "tiny", "text": "x " * 200}, 413, "the model's context length"),
        ("/api/step", {"model": "tiny", "text": "x"}, 422, "`token` is required"),
        ("/api/step", {"model": "tiny", "text": "a b", "token": 5}, 422, "`token` must be in 0"),
        ("/api/step", {"model": "tiny", "text": "a", "token": 0, "layer": 9}, 422, "`layer`"),
        ("/api/step", {"model": "tiny", "text": "a", "token": 0, "head": True}, 422, "`head`"),
        ("/api/step", {"model": "example:journey", "token": 6}, 422, "0..5 for this example"),
        ("/api/generate", {"model": "tiny", "text": "a", "max_new_tokens": 10**5}, 413,
         "--max-new-tokens"),
        ("/api/generate", {"model": "tiny", "text": "a", "temperature": -1}, 422, "temperature"),
        ("/api/generate", {"model": "tiny", "text": "a", "top_p": 0}, 422, "`top_p` must be in"),
        ("/api/generate", {"model": "tiny", "text": "a", "temperature": "hot"}, 422, "finite"),
        ("/api/generate", {"model": "example:journey", "text": "a"}, 422, "cannot generate"),
        ("/api/nothing", None, 404, "not found"),
    ],
)  # fmt: skip
def test_errors_are_json_and_name_the_field(client, path, body, status, needle):
    r = client.post(path, json=body) if body is not None else client.get(path)
    if path == "/api/generate" and r.status_code == 200:  # errors found in the worker
        event, data = sse(r.text)[0]
        assert event == "error" and data["status"] == status and needle in data["error"]
    else:
        assert r.status_code == status, r.text
        assert needle in r.json()["error"], r.json()
    assert client.get("/api/models").status_code == 200  # still serving


def test_hostile_input_gets_4xx_json_and_the_server_stays_up(client):
    big = "a" * 1_000_000  # 1 MB of text, and a million-character "token"
    for text in (big, "word " * 200_000):
        r = client.post("/api/trace", json={"model": "tiny", "text": text})
        assert r.status_code == 413 and "--max-chars" in r.json()["error"]
    r = client.post("/api/trace", content=b'{"model": "tiny", "text": "\\ud800x"}',
                    headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code == 422 and "surrogate" in r.json()["error"]
    for bad in (b"{not json", b"[1, 2]", b"\xff\xfe", b"null"):
        r = client.post("/api/trace", content=bad, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "JSON object" in r.json()["error"]
    r = client.get("/api/trace")
    assert r.status_code == 405 and "not allowed" in r.json()["error"]
    script = "<script>alert(1)</script> \x00\x01\x1b[31m \u202e"
    r = client.post("/api/trace", json={"model": "tiny", "text": script})
    assert r.status_code == 200  # text is data: returned as JSON strings, never as markup
    # (U+202E is two byte-level tokens: each alone spells as U+FFFD)
    assert "".join(r.json()["attention"]["tokens"]).startswith(script[:-1])
    r = client.post("/api/trace", json={"model": "tiny", "text": "<|endoftext|> hi"})
    assert r.status_code == 200  # special-token text from a client is plain text
    assert client.post("/api/trace", json={"model": "tiny", "text": "ok"}).status_code == 200


def test_a_body_over_the_byte_limit_is_refused_before_reading(gpt):
    limits = ServeLimits(max_chars=10)
    with TestClient(make_app(gpt, limits=limits)) as c:
        r = c.post("/api/trace", content=b"x" * (limits.max_body + 1),
                   headers={"content-type": "application/json"})  # fmt: skip
        assert r.status_code == 413 and "--max-chars 10" in r.json()["error"]
        r = c.post("/api/trace", json={"model": "tiny", "text": "x" * 11})
        assert r.status_code == 413 and "limit is 10 (--max-chars)" in r.json()["error"]


def test_a_full_queue_answers_429_json(gpt):
    gate = threading.Event()

    def slow_load():
        gate.wait(10)
        return model_spec(gpt, get_tokenizer(), "slow").load()

    registry = ModelRegistry([ModelSpec("slow", "waits", slow_load)])
    pool = WorkerPool(workers=1, queue=1)
    with TestClient(create_app(registry, pool=pool)) as c, ThreadPoolExecutor(2) as ex:
        held = [ex.submit(c.post, "/api/trace", json={"model": "slow", "text": "hi"})
                for _ in range(2)]  # fmt: skip
        while pool.busy < 2:
            time.sleep(0.01)
        r = c.post("/api/trace", json={"model": "slow", "text": "hi"})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert "--workers 1, --queue 1" in r.json()["error"]
        gate.set()
        assert [f.result().status_code for f in held] == [200, 200]
        assert c.post("/api/trace", json={"model": "slow", "text": "hi"}).status_code == 200


def test_a_model_that_fails_to_load_is_a_500_json_and_others_still_work(gpt):
    def broken():
        raise OSError("weights file is truncated")

    registry = ModelRegistry([ModelSpec("broken", "x", broken),
                              model_spec(gpt, get_tokenizer(), "tiny")])  # fmt: skip
    with TestClient(create_app(registry)) as c:
        r = c.post("/api/trace", json={"model": "broken", "text": "hi"})
        assert r.status_code == 500 and "weights file is truncated" in r.json()["error"]
        m = {x["name"]: x for x in c.get("/api/models").json()["models"]}
        assert m["broken"]["state"] == "error" and "truncated" in m["broken"]["error"]
        assert c.post("/api/trace", json={"model": "tiny", "text": "hi"}).status_code == 200


def test_models_report_loading_progress(gpt):
    gate = threading.Event()

    def slow_load():
        gate.wait(10)
        return model_spec(gpt, get_tokenizer(), "slow").load()

    events: list[tuple[str, str]] = []
    registry = ModelRegistry([ModelSpec("slow", "waits", slow_load)],
                             on_event=lambda e, name, detail: events.append((e, name)))  # fmt: skip
    with TestClient(create_app(registry)) as c, ThreadPoolExecutor(1) as ex:
        pending = ex.submit(c.post, "/api/trace", json={"model": "slow", "text": "hi"})
        while events != [("loading", "slow")]:
            time.sleep(0.01)
        time.sleep(0.15)
        m = c.get("/api/models").json()["models"][0]
        assert m["state"] == "loading" and m["seconds"] >= 0.1
        gate.set()
        assert pending.result().status_code == 200
        m = c.get("/api/models").json()["models"][0]
        assert m["state"] == "ready" and m["loaded"] and m["seconds"] >= 0.1
    assert events == [("loading", "slow"), ("ready", "slow")]


def test_default_models_are_the_example_runs_gpt_and_installed_packages(tmp_path):
    from attnlab.checkpoint import save_checkpoint
    from attnlab.serve import default_specs, spec_for

    assert default_specs(tmp_path / "runs" / "gpt")[0].name == "example:journey"
    assert str(tmp_path / "runs" / "gpt") not in [s.name for s in default_specs(tmp_path / "x")]
    g = tiny_gpt()
    save_checkpoint(tmp_path / "gpt", g.state_dict(), model_type="gpt",
                    model_config=g.cfg.to_dict(), step=3)  # fmt: skip
    specs = default_specs(tmp_path / "gpt")
    assert specs[1].name == str(tmp_path / "gpt") and specs[1].kind == "checkpoint"
    loaded = specs[1].load()
    assert loaded.causal and "step 3" in loaded.source
    with pytest.raises(ValueError, match=r"unknown --model .*; choose one of example:journey"):
        spec_for(str(tmp_path / "nothing-here"))
    assert spec_for("example:toy").name == "example:toy"


def test_traces_during_a_generation_on_one_model_do_not_meet(gpt):
    from attnlab.generation import generate

    app = make_app(gpt, pool=WorkerPool(workers=4, queue=32))
    texts = [f"the {w} sat" * (1 + i % 3) for i, w in enumerate(["cat", "dog", "owl", "fox"] * 3)]
    body = {"model": "tiny", "text": TEXT, "max_new_tokens": 30, "layer": 1, "head": 1}
    with TestClient(app) as c:
        want = {t: c.post("/api/trace", json={"model": "tiny", "text": t}).json() for t in texts}
        with ThreadPoolExecutor(6) as ex:
            stream = ex.submit(c.post, "/api/generate", json=body)
            got = list(ex.map(lambda t: c.post("/api/trace", json={"model": "tiny", "text": t}),
                              texts))  # fmt: skip
            events = sse(stream.result().text)
    for t, r in zip(texts, got, strict=True):
        assert r.json()["attention"]["data"] == want[t]["attention"]["data"]
    ids = get_tokenizer().encode(TEXT)
    expect = generate(gpt, torch.tensor([ids]), 30)[0, len(ids) :].tolist()
    tokens = [d for e, d in events if e == "token"]
    assert [d["id"] for d in tokens] == expect
    assert all(len(d["attention"]["weights"]) == len(ids) + i for i, d in enumerate(tokens))


def test_the_page_in_traditional_chinese(gpt):
    specs = [model_spec(gpt, get_tokenizer(), "tiny")]
    with TestClient(create_app(ModelRegistry(specs), lang="zh-TW")) as c:
        r = c.get("/")
    assert r.status_code == 200 and '<html lang="zh-TW">' in r.text
    assert "注意力看向了哪裡" in r.text


def test_the_zh_tw_page_brings_its_own_cjk_font(gpt):
    from attnlab.explain.fonts import cjk_font_file

    if cjk_font_file() is None:
        pytest.skip("pip install 'attnlab[zh-tw]'")
    specs = [model_spec(gpt, get_tokenizer(), "tiny")]
    with TestClient(create_app(ModelRegistry(specs), lang="zh-TW")) as c:
        page = c.get("/")
        font = c.get("/font/cjk.otf")
    assert "font-src 'self'" in page.headers["content-security-policy"]
    assert 'url("/font/cjk.otf")' in page.text
    assert font.status_code == 200 and font.content[:4] == b"OTTO"  # an OpenType (CFF) font
    with TestClient(make_app(gpt)) as c:  # English: no font route needed
        assert c.get("/font/cjk.otf").status_code == 404


def test_serves_a_users_hf_directory_gguf_file_and_encoder(tmp_path):
    """`--model PATH` serves what `load_pretrained` loads; the kind comes from config.json."""
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    from attnlab.generation import generate
    from attnlab.pretrained import load_pretrained
    from attnlab.serve import spec_for
    from model_files import save_hf, write_gguf

    small = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
             "num_attention_heads": 4, "max_position_embeddings": 128}  # fmt: skip
    llama = save_hf("llama", {**small, "num_key_value_heads": 2}, tmp_path / "llama",
                    torch.float32)  # fmt: skip
    gguf_path = tmp_path / "llama.Q8_0.gguf"
    write_gguf(llama, gguf_path, "llama", "Q8_0")
    bert = save_hf("bert", {**small, "max_position_embeddings": 64}, tmp_path / "bert",
                   torch.float32, encoder=True)  # fmt: skip
    specs = [spec_for(str(llama)), spec_for(str(gguf_path)), spec_for(str(bert))]
    assert [s.kind for s in specs] == ["causal-lm", "causal-lm", "encoder"]
    app = create_app(ModelRegistry(specs, max_loaded=3))
    model, tok = load_pretrained(llama)
    ids = tok.encode("the cat sat")
    want = generate(model, torch.tensor([ids]), 4)[0, len(ids) :].tolist()
    with TestClient(app) as c:
        for name in (str(llama), str(gguf_path), str(bert)):
            r = c.post("/api/trace", json={"model": name, "text": "the cat sat"})
            assert r.status_code == 200, r.text
            assert r.json()["attention"]["layers"] == [0, 1]
        body = {"model": str(llama), "text": "the cat sat", "max_new_tokens": 4}
        tokens = [d for e, d in sse(c.post("/api/generate", json=body).text) if e == "token"]
        assert [t["id"] for t in tokens] == want
        r = c.post("/api/generate", json={**body, "model": str(bert)})
        event, data = sse(r.text)[0]  # found in the worker, after the stream began
        assert event == "error" and data["status"] == 422 and "cannot generate" in data["error"]
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text('{"model_type": "no-such-family"}')
    with pytest.raises(ValueError, match="no-such-family"):
        spec_for(str(tmp_path / "odd"))
