"""trace_model: what the model's own attention layers computed, captured, not recomputed."""

from __future__ import annotations

import gc
import math
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn

from attnlab.attention import Attention
from attnlab.explain.model_trace import ModelTrace, trace_model


class TinyModel(nn.Module):
    """Embedding + a stack of residual causal attention layers (enough to trace)."""

    def __init__(self, *, layers: int = 3, heads: int = 4, kv_heads: int | None = None,
                 width: int = 16, vocab: int = 40, rope: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(
            Attention(width, heads, num_kv_heads=kv_heads, rope=rope) for _ in range(layers)
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(input_ids)  # (B, T, C)
        for block in self.blocks:
            x = x + block(x, is_causal=True)
        return x

    def weights_by_hand(self, input_ids: torch.Tensor) -> list[torch.Tensor]:
        """Each layer's weights through the public need_weights path, layer by layer."""
        out = []
        with torch.no_grad():
            x = self.emb(input_ids)
            for block in self.blocks:
                y, w = block(x, is_causal=True, need_weights=True)
                out.append(w[0])  # (H, T, S)
                x = x + y
        return out


class CharTokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) % 40 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(97 + i % 26) for i in ids)


@pytest.fixture
def model() -> TinyModel:
    torch.manual_seed(0)
    return TinyModel().eval()


IDS = [3, 14, 15, 9, 2, 6, 5, 35, 8, 9]


def test_dense_trace_is_what_the_layers_computed(model):
    trace = trace_model(model, IDS)
    assert isinstance(trace, ModelTrace) and trace.mode == "dense"
    assert trace.layers == (0, 1, 2) and trace.heads == (0, 1, 2, 3)
    assert trace.weights is not None and trace.weights.shape == (3, 4, 10, 10)
    for layer, want in enumerate(model.weights_by_hand(torch.tensor([IDS]))):
        torch.testing.assert_close(trace.weights[layer], want)
    # Causal rows sum to 1 and nothing above the diagonal.
    torch.testing.assert_close(trace.weights.sum(-1), torch.ones(3, 4, 10))
    assert float(trace.weights.triu(1).abs().max()) == 0.0
    # The hooks are gone and the layers are as before.
    assert all(b.capture is None and b.captured is None for b in model.blocks)
    assert not model.blocks[0]._forward_hooks


def test_layer_and_head_selection(model):
    full = trace_model(model, IDS)
    some = trace_model(model, IDS, layers=[2, 0], heads=[3, 1])
    assert some.layers == (0, 2) and some.heads == (1, 3)
    assert some.weights is not None and some.weights.shape == (2, 2, 10, 10)
    torch.testing.assert_close(some.head_weights(2, 3), full.head_weights(2, 3))
    torch.testing.assert_close(some.head_weights(0, 1), full.head_weights(0, 1))


def test_top_k_keeps_the_strongest_keys(model):
    full = trace_model(model, IDS)
    top = trace_model(model, IDS, top_k=3)
    assert top.mode == "topk" and top.top_k == 3 and top.weights is None
    values, indices = torch.topk(full.weights, 3, dim=-1)
    torch.testing.assert_close(top.top_values, values)
    torch.testing.assert_close(top.head_weights(1, 2).gather(1, indices[1, 2]), values[1, 2])


def test_queries_and_keys_give_the_weights(model):
    trace = trace_model(model, IDS, queries_and_keys=True, heads=[0, 2])
    assert trace.queries is not None and trace.keys is not None
    D = model.blocks[0].head_dim
    causal = torch.ones(10, 10, dtype=torch.bool).tril()
    scores = trace.queries @ trace.keys.transpose(-2, -1) / math.sqrt(D)  # (L, H, T, S)
    want = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    torch.testing.assert_close(trace.weights, want)


def test_grouped_query_attention_with_rope():
    torch.manual_seed(1)
    m = TinyModel(layers=2, heads=4, kv_heads=2, rope=True).eval()
    trace = trace_model(m, IDS, queries_and_keys=True)
    for layer, want in enumerate(m.weights_by_hand(torch.tensor([IDS]))):
        torch.testing.assert_close(trace.weights[layer], want)
    # Keys are shared by pairs of query heads (G = 2) and include the rotation.
    torch.testing.assert_close(trace.keys[:, 0], trace.keys[:, 1])
    causal = torch.ones(10, 10, dtype=torch.bool).tril()
    scores = trace.queries @ trace.keys.transpose(-2, -1) / math.sqrt(m.blocks[0].head_dim)
    want = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    torch.testing.assert_close(trace.weights, want)


def test_text_with_a_tokenizer_and_training_mode_restored(model):
    model.train()
    trace = trace_model(model, "hello", tokenizer=CharTokenizer())
    assert trace.token_ids == tuple(ord(c) % 40 for c in "hello")
    assert len(trace.tokens) == 5 and all(isinstance(t, str) for t in trace.tokens)
    assert model.training


def test_long_input_in_top_k_mode_never_holds_all_layers(model):
    T = 2048
    ids = torch.randint(0, 40, (T,))
    peak: list[int] = []

    def live_weights() -> int:
        """(1, H, T, T) or (H, T, T) weight tensors alive right now, anywhere."""
        with warnings.catch_warnings():  # isinstance on deprecated module attributes
            warnings.simplefilter("ignore")
            tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
        return sum(1 for o in tensors if tuple(o.shape[-3:]) == (4, T, T))

    def spy(module, args, output):
        peak.append(live_weights())

    handles = [b.register_forward_hook(spy) for b in model.blocks]
    try:
        trace = trace_model(model, ids, top_k=8)
    finally:
        for h in handles:
            h.remove()
    assert trace.top_indices is not None and trace.top_indices.shape == (3, 4, T, 8)
    assert len(peak) == 3 and max(peak) <= 1  # one layer's weights alive at a time
    dense = trace_model(model, ids[:1000])  # the spy would count these: (3, 4, T, T) kept
    assert dense.weights is not None and dense.weights.shape == (3, 4, 1000, 1000)
    with pytest.raises(ValueError, match="exceeds max_dense_elements"):
        trace_model(model, ids, max_dense_elements=1_000_000)


def test_concurrent_traces_of_one_model_do_not_meet(model):
    """Traces of different texts on one shared model, from many threads at once."""
    texts = [[(i * 7 + j) % 40 for j in range(5 + i % 9)] for i in range(24)]
    want = [trace_model(model, ids, queries_and_keys=True) for ids in texts]
    barrier = threading.Barrier(8)

    def run(i: int) -> ModelTrace:
        if i < 8:
            barrier.wait()
        return trace_model(model, texts[i], queries_and_keys=True)

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(run, range(len(texts))))
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        torch.testing.assert_close(g.weights, w.weights)
        torch.testing.assert_close(g.queries, w.queries)
    assert all(b.capture is None and b.captured is None for b in model.blocks)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"text_or_token_ids": ""}, ValueError, "must not be empty"),
        ({"text_or_token_ids": "hi"}, ValueError, "`tokenizer` is needed"),
        ({"text_or_token_ids": [], "tokenizer": None}, ValueError, "gave no tokens"),
        ({"layers": [3]}, ValueError, r"`layers` must be indices in 0\.\.2"),
        ({"heads": [-1]}, ValueError, r"`heads` must be indices in 0\.\.3"),
        ({"top_k": 0}, ValueError, "`top_k` must be a positive int"),
    ],
)
def test_bad_input_names_the_argument(model, kwargs, error, match):
    args = {"text_or_token_ids": IDS, **kwargs}
    with pytest.raises(error, match=match):
        trace_model(model, args.pop("text_or_token_ids"), **args)


def test_a_model_without_attnlab_attention_is_refused():
    with pytest.raises(TypeError, match=r"has no attnlab\.attention\.Attention layers"):
        trace_model(nn.Linear(2, 2), [1, 2])
