"""attnlab.explain.trace and attnlab.examples: every intermediate, checked."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from attnlab.examples import EXAMPLES, JOURNEY, TOY, get_example
from attnlab.explain.trace import TRACE_SCHEMA, trace_attention, trace_example
from reference import tol
from seed_values import SEED_CONTEXT, SEED_WEIGHTS


def _r4(t: torch.Tensor) -> torch.Tensor:
    return t.round(decimals=4)


def _exact(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.fixture(scope="module")
def journey():
    return trace_example("journey")


@pytest.fixture(scope="module")
def toy():
    return trace_example("toy")


def test_simplified_form_reproduces_the_seeds_tables(journey):
    s = journey.simplified
    _exact(_r4(s.weights), SEED_WEIGHTS)
    _exact(_r4(s.context), SEED_CONTEXT)
    torch.testing.assert_close(s.row_sums, torch.ones(6), **tol(torch.float32))
    assert s.scale is None
    _exact(s.scaled_scores, s.scores)
    _exact(s.queries, journey.inputs)


def test_trainable_walk_matches_the_books_printed_values(journey):
    tt = journey.trainable_token
    assert (tt.index, tt.token) == (1, "journey")
    _exact(_r4(tt.query), torch.tensor([0.4306, 1.4551]))
    assert round(tt.score_self, 4) == 1.8524
    _exact(_r4(tt.scores), torch.tensor([1.2705, 1.8524, 1.8111, 1.0795, 0.5577, 1.5440]))
    _exact(_r4(tt.weights), torch.tensor([0.1500, 0.2264, 0.2199, 0.1311, 0.0906, 0.1820]))
    _exact(_r4(tt.context), torch.tensor([0.3061, 0.8210]))
    assert tt.weights_sum == pytest.approx(1.0, abs=1e-6)


def test_trainable_walk_equals_the_book_code_written_out(journey):
    """The book's section 3.4 code, with its errata fixed, run independently."""
    inputs = JOURNEY.inputs_tensor()
    x_2 = inputs[1]
    d_in, d_out = inputs.shape[1], 2
    torch.manual_seed(123)
    W_query = torch.nn.Parameter(torch.rand(d_in, d_out), requires_grad=False)
    W_key = torch.nn.Parameter(torch.rand(d_in, d_out), requires_grad=False)
    W_value = torch.nn.Parameter(torch.rand(d_in, d_out), requires_grad=False)
    query_2, key_2 = x_2 @ W_query, x_2 @ W_key
    keys, values = inputs @ W_key, inputs @ W_value
    attn_score_22 = query_2.dot(key_2)  # the seed writes keys_2: erratum
    attn_scores_2 = query_2 @ keys.T
    d_k = keys.shape[-1]
    attn_weights_2 = torch.softmax(attn_scores_2 / d_k**0.5, dim=-1)
    context_vec_2 = attn_weights_2 @ values  # the step the seed omits

    f32 = tol(torch.float32)
    tt, proj = journey.trainable_token, journey.projection
    assert (proj.convention, proj.seed) == ("x @ W", 123)
    _exact(proj.W_query, W_query.detach())
    _exact(proj.W_value, W_value.detach())
    torch.testing.assert_close(tt.query, query_2, **f32)
    assert tt.score_self == pytest.approx(float(attn_score_22), rel=1e-6)
    torch.testing.assert_close(tt.scores, attn_scores_2, **f32)
    torch.testing.assert_close(tt.scaled_scores, attn_scores_2 / d_k**0.5, **f32)
    torch.testing.assert_close(tt.weights, attn_weights_2, **f32)
    torch.testing.assert_close(tt.context, context_vec_2, **f32)
    torch.testing.assert_close(journey.trainable.keys, keys, **f32)
    assert journey.trainable.scale == pytest.approx(1 / d_k**0.5)


def test_single_token_walk_agrees_with_the_full_matrices(journey):
    tt, tr = journey.trainable_token, journey.trainable
    f32 = tol(torch.float32)
    torch.testing.assert_close(tt.query, tr.queries[1], **f32)
    torch.testing.assert_close(tt.key, tr.keys[1], **f32)
    torch.testing.assert_close(tt.value, tr.values[1], **f32)
    torch.testing.assert_close(tt.scores, tr.scores[1], **f32)
    torch.testing.assert_close(tt.weights, tr.weights[1], **f32)
    torch.testing.assert_close(tt.context, tr.context[1], **f32)
    torch.testing.assert_close(torch.softmax(tr.scaled_scores, -1), tr.weights, **f32)
    assert journey.checks.token_vs_all < 1e-6


def test_modules_as_the_book_builds_them(journey):
    v1, v2, copy = journey.module("v1"), journey.module("v2"), journey.module("v1_from_v2")
    assert (v1.seed, v2.seed) == (123, 789)
    _exact(_r4(v1.output[0]), torch.tensor([0.2996, 0.8053]))
    _exact(_r4(v2.output[0]), torch.tensor([-0.0739, 0.0713]))
    # V1 after seed 123 holds the walk's matrices: its row 2 is context_vec_2
    torch.testing.assert_close(v1.output, journey.trainable.context, **tol(torch.float32))
    torch.testing.assert_close(copy.output, v2.output, **tol(torch.float32))
    assert journey.checks.module_vs_walk < 1e-6
    assert journey.checks.v1_from_v2_vs_v2 < 1e-6


def test_toy_uses_the_nn_linear_convention(toy):
    inputs = TOY.inputs_tensor()
    W_q, W_k, W_v = TOY.projection_weights()  # type: ignore[misc]
    f32 = tol(torch.float32)
    assert toy.projection.convention == "x @ W.T"
    assert toy.projection.seed is None
    torch.testing.assert_close(toy.trainable.queries, inputs @ W_q.T, **f32)
    torch.testing.assert_close(toy.trainable.keys, inputs @ W_k.T, **f32)
    torch.testing.assert_close(toy.trainable.values, inputs @ W_v.T, **f32)
    # the seed's first printed-by-code query row: [0.4, 0.1] @ W_q.T = [0.64, 1.6]
    torch.testing.assert_close(toy.trainable.queries[0], torch.tensor([0.64, 1.6]))
    w = torch.softmax(inputs @ W_q.T @ (inputs @ W_k.T).T / 2**0.5, dim=-1)
    torch.testing.assert_close(toy.trainable.weights, w, **f32)
    torch.testing.assert_close(toy.module("v2").output, toy.trainable.context, **f32)
    torch.testing.assert_close(toy.module("v1_from_v2").output, toy.trainable.context, **f32)
    with pytest.raises(KeyError):
        toy.module("v1")


def test_other_seed_and_index():
    t = trace_example("journey", index=4, seed=7)
    assert t.trainable_token.token == "one"
    assert t.projection.seed == 7
    assert t.module("v2").seed == 7
    torch.testing.assert_close(t.trainable_token.context, t.trainable.context[4])
    torch.manual_seed(7)
    _exact(t.projection.W_query, torch.rand(3, 2))


def test_trace_restores_the_global_rng():
    torch.manual_seed(42)
    expected = torch.rand(3)
    torch.manual_seed(42)
    trace_example("journey")
    _exact(torch.rand(3), expected)


def test_trace_is_frozen_and_json_round_trips(journey):
    with pytest.raises(dataclasses.FrozenInstanceError):
        journey.index = 3  # type: ignore[misc]
    d = json.loads(journey.to_json())
    assert d["schema"] == TRACE_SCHEMA
    assert d["tokens"] == list(JOURNEY.tokens)
    assert (d["n_tokens"], d["d_in"], d["d_out"]) == (6, 3, 2)
    torch.testing.assert_close(torch.tensor(d["simplified"]["weights"]), journey.simplified.weights)
    assert d["trainable_token"]["index"] == 1
    assert [m["role"] for m in d["modules"]] == ["v1", "v2", "v1_from_v2"]
    assert d["projection"]["convention"] == "x @ W"


def test_custom_inputs_and_batch_free_float64():
    x = torch.rand(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    t = trace_attention(x, d_out=3)
    assert t.tokens == ("1", "2", "3", "4")
    assert t.trainable.context.dtype == torch.float64
    assert t.trainable.context.shape == (4, 3)


def test_examples_registry():
    assert set(EXAMPLES) == {"journey", "toy"}
    assert get_example("toy") is TOY
    assert JOURNEY.projection_weights() is None
    assert JOURNEY.inputs_tensor().shape == (6, 3)
    with pytest.raises(ValueError, match="`example` must be one of journey, toy"):
        get_example("nope")


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"inputs": torch.ones(2, 3, 4)}, ValueError, r"`inputs` must be 2-D"),
        ({"inputs": torch.ones(3, 3, dtype=torch.int32)}, TypeError, r"`inputs` must be a floa"),
        ({"inputs": torch.ones(0, 3)}, ValueError, r"`inputs` must not be empty"),
        ({"inputs": torch.tensor([[float("nan"), 1.0]])}, ValueError, r"`inputs` contains NaN"),
        ({"tokens": ("a", "b")}, ValueError, r"`tokens` must have one label per input row"),
        ({"index": 3}, ValueError, r"`index` must be in \[0, 2\]"),
        ({"index": -1}, ValueError, r"`index` must be in"),
        ({"seed": -5}, ValueError, r"`seed` must be in"),
        ({"d_out": 0}, ValueError, r"`d_out` must be in"),
        ({"weights": (torch.ones(2, 4),) * 3}, ValueError, r"`weights` must be \(d_out, d_in=3\)"),
    ],
)
def test_trace_rejects_bad_arguments(kwargs, error, pattern):
    args = {"inputs": torch.rand(3, 3)} | kwargs
    inputs = args.pop("inputs")
    with pytest.raises(error, match=pattern):
        trace_attention(inputs, **args)


def test_seed_is_refused_for_explicit_weights():
    with pytest.raises(ValueError, match="`seed` does not apply to example 'toy'"):
        trace_example("toy", seed=1)
