"""attnlab.functional: the seed's steps as plain functions."""

from __future__ import annotations

import math

import pytest
import torch

from attnlab.examples import JOURNEY
from attnlab.functional import (
    attention_scores,
    attention_weights,
    check_tensor,
    context_vectors,
    default_scale,
    simplified_self_attention,
)
from reference import reference_attention, tol
from seed_values import SEED_CONTEXT, SEED_WEIGHTS


def test_simplified_reproduces_the_seeds_printed_tables():
    result = simplified_self_attention(JOURNEY.inputs_tensor())
    torch.testing.assert_close(result.weights.round(decimals=4), SEED_WEIGHTS, atol=0, rtol=0)
    torch.testing.assert_close(result.context.round(decimals=4), SEED_CONTEXT, atol=0, rtol=0)
    torch.testing.assert_close(result.weights.sum(dim=-1), torch.ones(6), **tol(torch.float32))


def test_simplified_matches_the_fp64_reference_unscaled():
    x = JOURNEY.inputs_tensor(torch.float64)
    result = simplified_self_attention(x)
    q = x[None, None]  # (B=1, H=1, T, D)
    out, weights = reference_attention(q, q, q, scale=1.0)
    torch.testing.assert_close(result.weights, weights[0, 0], **tol(torch.float64))
    torch.testing.assert_close(result.context, out[0, 0], **tol(torch.float64))


def test_simplified_batched_equals_per_sample():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(3, 5, 4, generator=g)
    batched = simplified_self_attention(x)
    for b in range(3):
        one = simplified_self_attention(x[b])
        torch.testing.assert_close(batched.context[b], one.context, **tol(torch.float32))
        torch.testing.assert_close(batched.weights[b], one.weights, **tol(torch.float32))


def test_attention_scores_single_query_is_a_row_of_the_matrix():
    x = JOURNEY.inputs_tensor()
    full = attention_scores(x, x)  # (T, T)
    torch.testing.assert_close(attention_scores(x[1], x), full[1])
    # the seed's attn_score for token 2 with token 2 is a plain dot product
    assert math.isclose(float(full[1, 1]), float(torch.dot(x[1], x[1])), rel_tol=1e-6)


def test_attention_scores_batched_uses_transpose_not_T():
    g = torch.Generator().manual_seed(1)
    q, k = torch.rand(2, 3, 4, generator=g), torch.rand(2, 5, 4, generator=g)
    scores = attention_scores(q, k)
    assert scores.shape == (2, 3, 5)
    torch.testing.assert_close(scores[1], q[1] @ k[1].T)


def test_attention_weights_scale_and_rows_sum_to_one():
    scores = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    w = attention_weights(scores, scale=0.5)
    torch.testing.assert_close(w, torch.softmax(scores * 0.5, dim=-1))
    torch.testing.assert_close(w.sum(-1), torch.ones(2))
    torch.testing.assert_close(w[1], torch.full((3,), 1 / 3))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_attention_weights_half_precision_softmax_in_fp32(dtype):
    scores = torch.randn(4, 50, generator=torch.Generator().manual_seed(2)) * 4
    half = scores.to(dtype)
    w = attention_weights(half, scale=0.25)
    assert w.dtype == dtype
    # Exactly PyTorch's fp32 softmax of the same scores, rounded once at the end.
    expected = torch.softmax(half.float() * 0.25, dim=-1).to(dtype)
    torch.testing.assert_close(w, expected, atol=0, rtol=0)
    # Positive control: a softmax computed entirely in half precision (every op rounds)
    # differs from it, so the exact comparison tells the two apart; the dtype's tolerance
    # would not (they differ by at most 4.9e-4 in bf16, 1.2e-4 in fp16).
    x = half * 0.25
    e = (x - x.amax(dim=-1, keepdim=True)).exp()
    in_half = e / e.sum(dim=-1, keepdim=True)
    assert in_half.dtype == dtype and not torch.equal(in_half, expected)


def test_context_vectors_are_weighted_sums():
    w = torch.tensor([0.25, 0.75])
    v = torch.tensor([[1.0, 0.0], [0.0, 4.0]])
    torch.testing.assert_close(context_vectors(w, v), torch.tensor([0.25, 3.0]))


def test_default_scale():
    assert default_scale(2) == pytest.approx(1 / math.sqrt(2))
    with pytest.raises(ValueError, match="head_dim"):
        default_scale(0)
    with pytest.raises(TypeError, match="head_dim"):
        default_scale(2.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("bad", "error", "pattern"),
    [
        (torch.ones(6), ValueError, r"`inputs` must be 2-D or 3-D"),
        (torch.ones(1, 2, 6, 3), ValueError, r"`inputs` must be 2-D or 3-D"),
        (torch.ones(6, 3, dtype=torch.long), TypeError, r"`inputs` must be a floating-point"),
        (torch.ones(0, 3), ValueError, r"`inputs` must not be empty"),
        (torch.tensor([[1.0, float("nan")]]), ValueError, r"`inputs` contains NaN or inf"),
        (torch.tensor([[1.0, float("inf")]]), ValueError, r"`inputs` contains NaN or inf"),
        ([[1.0, 2.0]], TypeError, r"`inputs` must be a torch.Tensor"),
    ],
)
def test_simplified_rejects_bad_input(bad, error, pattern):
    with pytest.raises(error, match=pattern):
        simplified_self_attention(bad)


def test_function_errors_name_the_argument():
    x = torch.ones(3, 4)
    with pytest.raises(ValueError, match=r"`keys` must have the same last dimension"):
        attention_scores(x, torch.ones(3, 5))
    with pytest.raises(ValueError, match=r"`keys` must be at least 2-D"):
        attention_scores(x, torch.ones(4))
    with pytest.raises(TypeError, match=r"`keys` must have the same dtype"):
        attention_scores(x, torch.ones(3, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"`scale` must be a positive"):
        attention_weights(x, scale=-1.0)
    with pytest.raises(ValueError, match=r"`scale` must be a positive"):
        attention_weights(x, scale=float("nan"))
    with pytest.raises(TypeError, match=r"`scale` must be a Python float"):
        attention_weights(x, scale=torch.tensor(0.5))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`weights` must have one weight per value"):
        context_vectors(torch.ones(3, 3), torch.ones(4, 2))
    with pytest.raises(TypeError, match=r"`values` must have the same dtype"):
        context_vectors(torch.ones(3, 3), torch.ones(3, 2, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"`name` must be a torch.Tensor"):
        check_tensor("name", 3)
