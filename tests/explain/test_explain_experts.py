"""The explainer's expert routing: which experts each token went to in a mixture-of-experts
model, checked against the router transformers runs on the same checkpoint (its chosen
experts and weights, taken from its router modules by forward hooks), and the page data and
the terminal summary that show it."""

from __future__ import annotations

import importlib.util
import json
import os
import re

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

if not all(importlib.util.find_spec(m) for m in ("transformers", "tokenizers", "safetensors")):
    pytest.skip("needs transformers, tokenizers and safetensors", allow_module_level=True)

from attnlab.explain.html import page_data
from attnlab.explain.model_trace import ExpertTrace, ModelTrace, trace_model
from attnlab.pretrained import load_pretrained
from cli_runner import run_main
from model_files import save_hf

_SMALL = {
    "hidden_size": 64,
    "intermediate_size": 48,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "pad_token_id": 1,
    "bos_token_id": 0,
    "eos_token_id": 2,
}
CHECKPOINTS = {
    # every layer routes: top-2 of 4, renormalised
    "mixtral": {
        **_SMALL,
        "num_hidden_layers": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    },
    # layers 1 and 3 route (0 dense by mlp_only_layers, 2 by decoder_sparse_step): top-3 of
    # 5, not renormalised
    "qwen3_moe": {
        **_SMALL,
        "num_hidden_layers": 4,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [0],
        "head_dim": 32,
        "moe_intermediate_size": 32,
        "num_experts": 5,
        "num_experts_per_tok": 3,
        "norm_topk_prob": False,
    },
}
ROUTED = {"mixtral": (0, 1), "qwen3_moe": (1, 3)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("experts")
    return {
        name: save_hf(name, config, root / name, torch.float32)
        for name, config in CHECKPOINTS.items()
    }


def _ids(n: int = 20) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, 512, (n,), generator=g)


def _transformers_routing(folder, ids: torch.Tensor) -> dict[int, tuple[torch.Tensor, ...]]:
    """Layer -> (experts (T, k), weights (T, k)) as transformers' routers chose them."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="eager", dtype=torch.float32
    ).eval()
    found: dict[int, tuple[torch.Tensor, ...]] = {}
    hooks = []
    for i, layer in enumerate(ref.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is None or not hasattr(gate, "top_k"):  # a dense layer
            continue

        def keep(module, args, out, i=i):
            _, weights, experts = out  # transformers' routers: (logits, weights, experts)
            found[i] = (experts.detach(), weights.detach().float())

        hooks.append(gate.register_forward_hook(keep))
    with torch.no_grad():
        ref(ids[None])
    for h in hooks:
        h.remove()
    return found


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_the_trace_routes_every_token_as_transformers_does(checkpoints, name):
    model, _ = load_pretrained(checkpoints[name])
    ids = _ids()
    trace = trace_model(model, ids)
    reference = _transformers_routing(checkpoints[name], ids)
    experts = trace.experts
    assert experts is not None
    assert experts.layers == ROUTED[name] == tuple(sorted(reference))
    k = CHECKPOINTS[name]["num_experts_per_tok"]
    E = CHECKPOINTS[name].get("num_experts") or CHECKPOINTS[name]["num_local_experts"]
    assert (experts.num_experts, experts.top_k) == (E, k)
    assert experts.chosen.shape == (len(ROUTED[name]), len(ids), k)
    for layer, (ref_experts, ref_weights) in reference.items():
        chosen, weights = experts.layer_routing(layer)
        assert torch.equal(chosen, ref_experts), layer
        torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-5)
        # the grid puts each weight at its expert, and each row sums to the routed mass
        grid = experts.grid(layer)
        assert grid.shape == (len(ids), E)
        torch.testing.assert_close(grid.gather(1, chosen), weights)
        assert int((grid > 0).sum()) == len(ids) * k
    if name == "mixtral":  # renormalised: every token's weights sum to 1
        torch.testing.assert_close(experts.weights.sum(-1), torch.ones(2, len(ids)))


def test_only_the_captured_layers_routing_is_kept(checkpoints):
    model, _ = load_pretrained(checkpoints["qwen3_moe"])
    trace = trace_model(model, _ids(), layers=[0, 3], top_k=4)
    assert trace.experts is not None and trace.experts.layers == (3,)
    assert trace_model(model, _ids(), layers=[0, 2]).experts is None
    with pytest.raises(ValueError, match=r"layers with experts \[3\], got 1"):
        trace.experts.layer_routing(1)


def test_a_dense_model_has_no_expert_trace(tmp_path):
    folder = save_hf("llama", {**_SMALL, "num_hidden_layers": 1}, tmp_path / "llama", torch.float32)
    model, _ = load_pretrained(folder)
    trace = trace_model(model, _ids(6))
    assert trace.experts is None
    assert page_data(trace)["attention"]["experts"] is None


def _expert_trace(**changes) -> ExpertTrace:
    fields = {
        "layers": (0,),
        "num_experts": 4,
        "chosen": torch.tensor([[[1, 2], [0, 3], [3, 1]]]),
        "weights": torch.tensor([[[0.6, 0.4], [0.7, 0.3], [0.5, 0.5]]]),
    }
    return ExpertTrace(**{**fields, **changes})


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"layers": ()}, "`layers` must be distinct ascending"),
        ({"chosen": torch.zeros(2, 3, 2, dtype=torch.long)}, "`chosen` must have shape"),
        ({"weights": torch.zeros(1, 3, 3)}, "`weights` must have the shape of `chosen`"),
        ({"chosen": torch.tensor([[[1, 4], [0, 3], [3, 1]]])}, r"expert indices in 0\.\.3"),
    ],
)
def test_a_bad_expert_trace_names_the_field(changes, match):
    with pytest.raises(ValueError, match=match):
        _expert_trace(**changes)


def test_a_trace_refuses_routing_of_other_tokens_or_layers():
    base = {
        "tokens": ("a", "b", "c"),
        "key_tokens": ("a", "b", "c"),
        "layers": (0,),
        "heads": (0,),
        "num_layers": 2,
        "num_heads": 1,
        "weights": torch.zeros(1, 1, 3, 3),
    }
    ModelTrace(**base, experts=_expert_trace())
    with pytest.raises(ValueError, match="must route the trace's 2 tokens, got 3"):
        ModelTrace(
            **{**base, "tokens": ("a", "b"), "weights": torch.zeros(1, 1, 2, 3)},
            experts=_expert_trace(),
        )
    with pytest.raises(ValueError, match=r"`experts.layers` \[1\] must be among"):
        ModelTrace(**base, experts=_expert_trace(layers=(1,)))


def test_the_page_data_holds_the_routing_exactly(checkpoints):
    import base64

    import numpy as np

    model, _ = load_pretrained(checkpoints["qwen3_moe"])
    trace = trace_model(model, _ids())
    data = page_data(trace, lang="zh-TW")["attention"]["experts"]
    assert (data["num_experts"], data["top_k"], data["layers"]) == (5, 3, [1, 3])
    assert data["shared"] is False
    for i, layer in enumerate((1, 3)):
        chosen, weights = trace.experts.layer_routing(layer)
        got_e = np.frombuffer(base64.b64decode(data["chosen"][i]), "<u2").reshape(chosen.shape)
        got_w = np.frombuffer(base64.b64decode(data["weights"][i]), "<f4").reshape(chosen.shape)
        assert (got_e == chosen.numpy()).all()
        assert (got_w == weights.numpy()).all()  # float32, exact


def test_explain_prints_and_pages_the_experts(checkpoints, tmp_path, capsys):
    out = tmp_path / "out"
    code, stdout, stderr = run_main(
        capsys,
        "explain",
        "--model",
        str(checkpoints["mixtral"]),
        "hello world again",
        "--layer",
        "1",
        "--out",
        str(out),
    )
    assert code == 0, stderr
    assert "Experts of layer 1 (top 2 of 4)" in stdout, stdout
    page = (out / "attention.html").read_text(encoding="utf-8")
    blob = re.search(r'id="attnlab-data">(.*?)</script>', page, re.S)
    assert blob is not None
    experts = json.loads(blob.group(1))["attention"]["experts"]
    assert experts["layers"] == [0, 1] and experts["top_k"] == 2
