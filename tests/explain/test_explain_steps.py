"""Step into a head: the walk's numbers are the layer's own, checked against PyTorch."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attnlab.attention import Attention
from attnlab.explain.model_trace import trace_model
from attnlab.explain.steps import head_steps, step_sections, step_summary
from attnlab.explain.text import step_renderables


class TinyModel(nn.Module):
    def __init__(self, *, rope: bool, kv_heads: int | None = None) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 16)
        self.blocks = nn.ModuleList(
            Attention(16, 4, num_kv_heads=kv_heads, rope=rope, out_bias=True) for _ in range(3)
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(input_ids)
        for block in self.blocks:
            x = x + block(x, is_causal=True)
        return x

    def layer_input(self, input_ids: torch.Tensor, layer: int) -> torch.Tensor:
        x = self.emb(input_ids)
        for block in self.blocks[:layer]:
            x = x + block(x, is_causal=True)
        return x  # (1, T, C)


IDS = [3, 14, 15, 9, 2, 6, 5, 35]


@pytest.mark.parametrize(("rope", "kv_heads"), [(False, None), (True, 2)])
def test_the_walk_is_what_pytorch_computes(rope, kv_heads):
    torch.manual_seed(0)
    model = TinyModel(rope=rope, kv_heads=kv_heads).eval()
    layer, head, tok = 1, 3, 5
    s = head_steps(model, IDS, layer=layer, head=head, token=tok)
    block = model.blocks[layer]
    with torch.no_grad():
        x = model.layer_input(torch.tensor([IDS]), layer)  # (1, T, C)
        D, T = block.head_dim, len(IDS)
        q = block.W_query(x).view(1, T, 4, D).transpose(1, 2)  # (1, H, T, D)
        k = block.W_key(x).view(1, T, block.num_kv_heads, D).transpose(1, 2)
        v = block.W_value(x).view(1, T, block.num_kv_heads, D).transpose(1, 2)
        q_pre = q[0, head, tok].clone()
        if rope:
            pos = torch.arange(T)
            q, k = block.rope(q, pos), block.rope(k, pos)
        g = head // (4 // block.num_kv_heads)
        want_ctx = F.scaled_dot_product_attention(
            q[:, head : head + 1], k[:, g : g + 1], v[:, g : g + 1], is_causal=True
        )[0, 0, tok]  # PyTorch's kernel
        scores = q[0, head, tok] @ k[0, g].T / math.sqrt(D)
        want_w = torch.softmax(scores.masked_fill(torch.arange(T) > tok, -math.inf), -1)
        want_out = block(x, is_causal=True)[0, tok]
    assert s.kv_head == g and s.rope == rope
    torch.testing.assert_close(s.x, x[0, tok])
    torch.testing.assert_close(s.query_projected, q_pre)
    torch.testing.assert_close(s.query, q[0, head, tok])
    torch.testing.assert_close(s.weights, want_w)
    torch.testing.assert_close(s.context, want_ctx)
    torch.testing.assert_close(s.output, want_out)
    assert s.allowed.tolist() == [j <= tok for j in range(T)]
    assert s.masked[tok + 1 :].eq(-math.inf).all()
    assert max(s.checks.values()) < 1e-5
    # The head view's weights (trace_model, the layer's exact-weights path) are the same.
    trace = trace_model(model, IDS)
    torch.testing.assert_close(s.weights, trace.head_weights(layer, head)[tok])


def test_sections_have_every_step_in_both_languages():
    torch.manual_seed(1)
    model = TinyModel(rope=True, kv_heads=2).eval()
    s = head_steps(model, IDS, layer=0, head=1, token=3, source="tiny")
    en = step_sections(s, "en")
    ids = [x["id"] for x in en]
    assert ids == ["input", "query", "rope", "keys", "scores", "scale", "mask", "weights",
                   "values", "context", "out"]  # fmt: skip
    zh = step_sections(s, "zh-TW")
    assert [x["id"] for x in zh] == ids
    assert "鍵" in zh[3]["title"] and "softmax" in zh[7]["title"]
    weights = next(t for x in en if x["id"] == "weights" for t in x["tables"])
    assert weights["values"][0] == pytest.approx(s.weights.tolist())
    masked = next(t for x in en if x["id"] == "mask" for t in x["tables"])
    assert masked["values"][0][4:] == [None] * 4  # -inf travels as null
    assert "tiny" in step_summary(s, "en") and "查詢詞元" in step_summary(s, "zh-TW")
    assert len(step_renderables(step_summary(s), en)) == len(en) + 2


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"layer": 3}, ValueError, r"`layer` must be in 0\.\.2"),
        ({"head": -1}, ValueError, r"`head` must be in 0\.\.3"),
        ({"token": 8}, ValueError, r"`token` must be in 0\.\.7"),
        ({"token": "1"}, TypeError, "`token` must be an int"),
    ],
)
def test_bad_indices_name_the_argument(kwargs, error, match):
    model = TinyModel(rope=False).eval()
    args = {"layer": 0, "head": 0, "token": 0, **kwargs}
    with pytest.raises(error, match=match):
        head_steps(model, IDS, **args)


def test_softcap_and_sinks_are_steps_and_still_land_on_the_layer():
    torch.manual_seed(2)
    model = TinyModel(rope=False).eval()
    block = model.blocks[1]
    block.softcap = 0.5  # small, so that the cap matters
    block.sinks = nn.Parameter(torch.tensor([0.3, -1.0, 2.0, 0.0]))
    s = head_steps(model, IDS, layer=1, head=2, token=6)
    assert s.softcap == 0.5 and s.sink == pytest.approx(2.0)
    torch.testing.assert_close(s.capped, 0.5 * torch.tanh(s.scaled / 0.5))
    assert float(s.capped.abs().max()) < 0.5
    # PyTorch: softmax over [capped scores, sink], the sink's column dropped.
    logits = torch.cat([s.capped.masked_fill(~s.allowed, -math.inf), torch.tensor([2.0])])
    torch.testing.assert_close(s.weights, torch.softmax(logits, -1)[:-1])
    assert float(s.weights.sum()) < 0.9 and max(s.checks.values()) < 1e-5
    ids = [x["id"] for x in step_sections(s)]
    assert ids.index("scale") < ids.index("softcap") < ids.index("mask")
    assert "attention sink" in next(x for x in step_sections(s) if x["id"] == "weights")["body"]


def test_qk_norm_and_rope_show_the_query_as_used():
    from attnlab.norms import QKNorm

    torch.manual_seed(3)
    model = TinyModel(rope=True).eval()
    model.blocks[0] = Attention(16, 4, rope=True, qk_norm=QKNorm("rms", scope="head"))
    s = head_steps(model, IDS, layer=0, head=1, token=4)
    assert s.qk_norm and s.rope
    block = model.blocks[0]
    with torch.no_grad():
        x = model.emb(torch.tensor([IDS]))
        q = block.W_query(x).view(1, 8, 4, 4).transpose(1, 2)
        q = block.rope(block.q_norm(q), torch.arange(8))
    torch.testing.assert_close(s.query, q[0, 1, 4])
    ids = [x["id"] for x in step_sections(s)]
    assert ids[:4] == ["input", "query", "qk_norm", "keys"]
    assert max(s.checks.values()) < 1e-5


def test_alibi_bias_is_a_step_and_the_walk_still_lands_on_the_layer():
    from attnlab.biases import AlibiBias, alibi_slopes

    class Alibi(TinyModel):
        def forward(self, input_ids):
            x = self.emb(input_ids)
            for block in self.blocks:
                x = x + block(x, attn_mask=AlibiBias(4), is_causal=True)
            return x

    torch.manual_seed(4)
    model = Alibi(rope=False).eval()
    s = head_steps(model, IDS, layer=2, head=1, token=5)
    assert s.bias is not None
    slope = float(alibi_slopes(4)[1])
    # ALiBi: -slope * distance to the query, for the keys it may see.
    want = torch.tensor([-slope * (5 - j) for j in range(6)])
    torch.testing.assert_close(s.bias[:6], want.float())
    assert max(s.checks.values()) < 1e-5
    ids = [x["id"] for x in step_sections(s)]
    assert ids.index("scale") < ids.index("bias") < ids.index("mask") < ids.index("weights")
