"""attnlab.ladder: SelfAttentionV1 and SelfAttentionV2 as the book builds them."""

from __future__ import annotations

import pytest
import torch

from attnlab.examples import JOURNEY
from attnlab.ladder import SelfAttentionV1, SelfAttentionV2, copy_v2_weights_to_v1
from reference import reference_attention, tol


def _book_v1(x: torch.Tensor, d_out: int = 2) -> torch.Tensor:
    """The book's SelfAttention_v1 written out (its `.T` is fine for 2-D input)."""
    d_in = x.shape[-1]
    W_query = torch.nn.Parameter(torch.rand(d_in, d_out))
    W_key = torch.nn.Parameter(torch.rand(d_in, d_out))
    W_value = torch.nn.Parameter(torch.rand(d_in, d_out))
    keys, queries, values = x @ W_key, x @ W_query, x @ W_value
    weights = torch.softmax((queries @ keys.T) / keys.shape[-1] ** 0.5, dim=-1)
    return weights @ values


def test_v1_seed_123_matches_the_book():
    x = JOURNEY.inputs_tensor()
    torch.manual_seed(123)
    out = SelfAttentionV1(3, 2)(x)
    torch.testing.assert_close(out[0].round(decimals=4), torch.tensor([0.2996, 0.8053]))
    torch.manual_seed(123)
    torch.testing.assert_close(out, _book_v1(x), **tol(torch.float32))


def test_v2_seed_789_matches_the_book():
    torch.manual_seed(789)
    out = SelfAttentionV2(3, 2)(JOURNEY.inputs_tensor())
    torch.testing.assert_close(out[0].round(decimals=4), torch.tensor([-0.0739, 0.0713]))


def test_parameters_are_created_in_the_books_order():
    torch.manual_seed(123)
    v1 = SelfAttentionV1(3, 2)
    torch.manual_seed(123)
    expected = [torch.rand(3, 2) for _ in range(3)]
    for got, want in zip((v1.W_query, v1.W_key, v1.W_value), expected, strict=True):
        torch.testing.assert_close(got.detach(), want, atol=0, rtol=0)
    assert [n for n, _ in SelfAttentionV2(3, 2).named_parameters()] == [
        "W_query.weight",
        "W_key.weight",
        "W_value.weight",
    ]


def test_v1_equals_v2_after_weight_copy():
    torch.manual_seed(789)
    v2 = SelfAttentionV2(3, 2)
    v1 = copy_v2_weights_to_v1(v2, SelfAttentionV1(3, 2))
    x = JOURNEY.inputs_tensor()
    torch.testing.assert_close(v1(x), v2(x), **tol(torch.float32))
    torch.testing.assert_close(v1.W_query.detach(), v2.W_query.weight.detach().T)


def test_v2_equals_the_fp64_reference():
    torch.manual_seed(0)
    v2 = SelfAttentionV2(4, 3, qkv_bias=True).double()
    x = torch.rand(7, 4, dtype=torch.float64)
    q, k, v = v2.project(x)
    out, _ = reference_attention(q[None, None], k[None, None], v[None, None])
    torch.testing.assert_close(v2(x), out[0, 0], **tol(torch.float64))


@pytest.mark.parametrize("cls", [SelfAttentionV1, SelfAttentionV2])
def test_batched_equals_per_sample(cls):
    torch.manual_seed(5)
    module = cls(3, 4)
    x = torch.rand(2, 6, 3)
    batched = module(x)
    assert batched.shape == (2, 6, 4)
    for b in range(2):
        torch.testing.assert_close(batched[b], module(x[b]), **tol(torch.float32))


def test_v1_and_v2_backpropagate():
    torch.manual_seed(1)
    for module in (SelfAttentionV1(3, 2), SelfAttentionV2(3, 2)):
        module(JOURNEY.inputs_tensor()).sum().backward()
        grads = [p.grad for p in module.parameters()]
        assert all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("cls", [SelfAttentionV1, SelfAttentionV2])
@pytest.mark.parametrize(
    ("bad", "error", "pattern"),
    [
        (torch.ones(3), ValueError, r"`x` must be 2-D or 3-D"),
        (torch.ones(1, 1, 6, 3), ValueError, r"`x` must be 2-D or 3-D"),
        (torch.ones(6, 4), ValueError, r"`x` must have d_in=3 features"),
        (torch.ones(6, 3, dtype=torch.int64), TypeError, r"`x` must be a floating-point"),
        (torch.ones(0, 3), ValueError, r"`x` must not be empty"),
        (torch.ones(2, 0, 3), ValueError, r"`x` must not be empty"),
        (torch.tensor([[0.1, float("nan"), 0.2]]), ValueError, r"`x` contains NaN or inf"),
        (torch.tensor([[0.1, float("-inf"), 0.2]]), ValueError, r"`x` contains NaN or inf"),
        (torch.ones(6, 3, dtype=torch.float64), TypeError, r"`x` must have the module's dtype"),
    ],
)
def test_bad_input_names_the_argument(cls, bad, error, pattern):
    module = cls(3, 2)
    with pytest.raises(error, match=pattern):
        module(bad)


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="`d_out` must be a positive int"):
        SelfAttentionV1(3, 0)
    with pytest.raises(TypeError, match="`d_in` must be an int"):
        SelfAttentionV2(3.0, 2)  # type: ignore[arg-type]


def test_copy_rejects_mismatches():
    with pytest.raises(ValueError, match="`v1` must have the sizes of `v2`"):
        copy_v2_weights_to_v1(SelfAttentionV2(3, 2), SelfAttentionV1(3, 4))
    with pytest.raises(ValueError, match="qkv_bias=False"):
        copy_v2_weights_to_v1(SelfAttentionV2(3, 2, qkv_bias=True), SelfAttentionV1(3, 2))
    with pytest.raises(TypeError, match="`v2` must be a SelfAttentionV2"):
        copy_v2_weights_to_v1(SelfAttentionV1(3, 2), SelfAttentionV1(3, 2))  # type: ignore[arg-type]


def test_from_weights_uses_the_nn_linear_convention():
    wq = torch.tensor([[1.1, 2.0], [3.0, 4.0]])
    v2 = SelfAttentionV2.from_weights(wq, wq * 2, wq * 3)
    x = torch.tensor([[0.4, 0.1], [0.3, 0.7]])
    q, _, _ = v2.project(x)
    torch.testing.assert_close(q, x @ wq.T)
    with pytest.raises(ValueError, match="`W_key` must have the shape of `W_query`"):
        SelfAttentionV2.from_weights(wq, torch.ones(3, 2), wq)
