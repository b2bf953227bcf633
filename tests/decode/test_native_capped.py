"""The one-pass soft-capped probabilities (``attnlab/native/capped.h``) against the float64
formula ``exp(c tanh(s / c) - c)``, and the blockwise soft-cap that runs them against the
float64 reference attention. Run under every compiled branch (``tests/native_branches.py``)."""

from __future__ import annotations

import math

import pytest
import torch

from attnlab import native
from attnlab.backends.blockwise import blockwise_attention
from attnlab.masks import CausalMask, SlidingWindowMask
from reference import reference_attention, tol

LOG2E = 1.0 / math.log(2.0)


def _probs(s: torch.Tensor, c: float) -> torch.Tensor:
    """The float64 probability of scaled scores ``s`` against the cap's bound."""
    return torch.exp(c * torch.tanh(s.double() / c) - c)


def _as_kernel_input(s: torch.Tensor, c: float) -> torch.Tensor:
    """What the kernel reads: ``t = -2 log2(e) s / c`` in float32."""
    return (s.double() * (-2.0 * LOG2E / c)).float()


@pytest.mark.parametrize("c", [1.5, 30.0, 43.0])
@pytest.mark.parametrize("cols", [1, 15, 16, 37, 512])
def test_probabilities_and_row_sums_match_the_formula(ext, c, cols):
    """Every lane and every tail length: p within float32's rounding of the formula's
    error amplification (2c times the sigmoid's), the row sums added to what was there."""
    g = torch.Generator().manual_seed(cols)
    s = torch.randn(3, 5, cols, generator=g, dtype=torch.float64) * 4 * c
    s[0, 0, :1] = 1e6  # far beyond the clamp both ways: the sigmoid's 0 and 1
    s[0, 1, :1] = -1e6
    t = _as_kernel_input(s, c)
    sums = torch.full((3, 5, 1), 0.25)
    ext.capped_probs(t, sums, c, 5, False)
    want = _probs(s, c)
    # t's own rounding moves the score by 2c u relatively; the passes add a few ulps of p
    rel = (t.double() / (-2.0 * LOG2E / c) - s).abs() / c * 2.0  # |d s| / c, scaled
    bound = want * (8 * 2.0**-24 * (2 * c * LOG2E + 8) + rel * 2 * c) + 1e-44
    assert bool(((t.double() - want).abs() <= bound).all())
    # the sums: of the kernel's own p, in float32 lanes
    torch.testing.assert_close(sums.double(), t.double().sum(-1, keepdim=True) + 0.25,
                               rtol=4e-7 * math.log2(cols + 2), atol=0.0)  # fmt: skip


def test_a_causal_tile_zeroes_its_upper_triangle_and_sums_the_rest(ext):
    """Rows are stacks of tq rows (a key head's query heads): row r sees columns up to
    r % tq; the hidden part is 0 and out of the sum."""
    tq, stacks, cols = 20, 3, 20
    g = torch.Generator().manual_seed(0)
    s = torch.randn(2, stacks * tq, cols, generator=g, dtype=torch.float64) * 10
    t = _as_kernel_input(s, 30.0)
    sums = torch.zeros(2, stacks * tq)
    ext.capped_probs(t, sums, 30.0, tq, True)
    rows = torch.arange(stacks * tq) % tq
    hidden = torch.arange(cols)[None, :] > rows[:, None]  # (rows, cols)
    want = _probs(s, 30.0).masked_fill(hidden, 0.0)
    assert bool((t[:, hidden] == 0).all())
    torch.testing.assert_close(t.double(), want, rtol=2e-5, atol=0.0)
    torch.testing.assert_close(sums.double(), t.double().sum(-1), rtol=4e-6, atol=0.0)


def test_without_sums_only_the_probabilities_are_written(ext):
    s = torch.randn(4, 33, dtype=torch.float64)
    t = _as_kernel_input(s, 5.0)
    ext.capped_probs(t, None, 5.0, 4, False)
    torch.testing.assert_close(t.double(), _probs(s, 5.0), rtol=2e-6, atol=0.0)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_the_backward_passes_match_the_formulas(ext, causal):
    """capped_grad_parts: p = exp(c tanh(s / c) - lse) against the row's lse and g = u (1 -
    u) with u = sigmoid(2 s / c) (a quarter of 1 - tanh^2), a causal tile's hidden keys 0
    in both, a row that saw nothing (lse = +inf) all 0; capped_grad_scores: ds = p (dp -
    delta) g."""
    c, tq = 30.0, 8
    g0 = torch.Generator().manual_seed(5)
    s = torch.randn(2, 2 * tq, 40, generator=g0, dtype=torch.float64) * 40
    # a row's final lse: this tile's keys and (the random part) the row's other tiles
    other = torch.rand(2, 2 * tq, 1, generator=g0, dtype=torch.float64) * 5
    lse = torch.logaddexp((c * torch.tanh(s / c)).logsumexp(-1, keepdim=True), other)
    lse[1, 3] = math.inf
    t = _as_kernel_input(s, c)
    l2 = ((lse + c) * LOG2E).float()
    g = torch.full_like(t, float("nan"))
    ext.capped_grad_parts(t, l2, g, c, tq, causal)
    want_p = torch.exp(c * torch.tanh(s / c) - lse)
    u = torch.sigmoid(2 * s / c)
    want_g = u * (1 - u)
    if causal:
        hidden = torch.arange(40)[None, :] > (torch.arange(2 * tq) % tq)[:, None]
        want_p, want_g = want_p.masked_fill(hidden, 0.0), want_g.masked_fill(hidden, 0.0)
    torch.testing.assert_close(t.double(), want_p, rtol=2e-5, atol=1e-30)
    torch.testing.assert_close(g.double(), want_g, rtol=2e-5, atol=1e-12)
    assert bool((t[1, 3] == 0).all())
    dp = torch.randn(t.shape, generator=g0)
    delta = torch.randn(2, 2 * tq, generator=g0)
    want_ds = t.double() * (dp.double() - delta.double()[..., None]) * g.double()
    ext.capped_grad_scores(t, dp, delta, g)
    torch.testing.assert_close(t.double(), want_ds, rtol=1e-6, atol=1e-30)
    with pytest.raises(RuntimeError, match="g must have the scores' shape"):
        ext.capped_grad_parts(t, l2, g[:, :, :5].contiguous(), c, tq, causal)
    with pytest.raises(RuntimeError, match="l must be a contiguous float32 tensor of 32"):
        ext.capped_grad_parts(t, l2[:1], g, c, tq, causal)
    with pytest.raises(RuntimeError, match="delta must be"):
        ext.capped_grad_scores(t, dp, delta[:1], g)


def test_bad_inputs_are_refused_naming_what_is_wrong(ext):
    t = torch.zeros(4, 16)
    with pytest.raises(RuntimeError, match="tensor of rows"):
        ext.capped_probs(torch.zeros(16), None, 1.0, 4, False)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        ext.capped_probs(t.double(), None, 1.0, 4, False)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        ext.capped_probs(t.t(), None, 1.0, 4, False)
    with pytest.raises(RuntimeError, match="cap must be positive"):
        ext.capped_probs(t, None, 0.0, 4, False)
    with pytest.raises(RuntimeError, match="one a row"):
        ext.capped_probs(t, torch.zeros(3), 1.0, 4, False)
    with pytest.raises(RuntimeError, match="whole stacks of tq = 3"):
        ext.capped_probs(t, None, 1.0, 3, True)


@pytest.mark.parametrize("mask", ["causal", "window"])
def test_blockwise_soft_cap_takes_the_pass_and_matches_the_reference(ext, monkeypatch, mask):
    """Full, causal and partial (window) tiles of soft-capped blockwise attention through
    the compiled pass (every tile: partial ones without sums, then masked), and back
    through the compiled backward passes, against the float64 reference: outputs, lse and
    gradients."""
    calls: list[bool] = []
    real = ext.capped_probs

    def counting(p, sums, cap, tq, causal):
        calls.append(sums is not None)
        return real(p, sums, cap, tq, causal)

    monkeypatch.setattr(ext, "capped_probs", counting)
    assert native.loaded() is ext
    T, H, G = 77, 4, 2
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, H, T, 16, generator=g) * 2
    k = torch.randn(1, G, T, 16, generator=g) * 2
    v = torch.randn(1, G, T, 16, generator=g)
    m = CausalMask() if mask == "causal" else SlidingWindowMask(20)
    for t in (q, k, v):
        t.requires_grad_()
    res = blockwise_attention(q, k, v, m, dropout_p=0.0, scale=0.5, softcap=30.0,
                              block_q=16, block_k=16, tile_path="pure")  # fmt: skip
    assert calls and (all(calls) if mask == "causal" else not all(calls))
    dout = torch.randn(res.output.shape, generator=g)
    parts: list[bool] = []
    real_parts = ext.capped_grad_parts
    monkeypatch.setattr(ext, "capped_grad_parts", lambda *a: parts.append(True) or real_parts(*a))
    res.output.backward(dout)
    assert parts  # the backward took the compiled passes too
    grads = [t.grad for t in (q, k, v)]
    refs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = reference_attention(*refs, mask=m.dense(T, T), scale=0.5, softcap=30.0)
    ref_out.backward(dout.double())
    for got, want in zip(grads, refs, strict=True):
        torch.testing.assert_close(got.double(), want.grad, **tol(torch.float32))
    torch.testing.assert_close(res.output.double(), ref_out.detach(), **tol(torch.float32))
    kq = k.detach().double().repeat_interleave(H // G, dim=1)
    capped = 30.0 * torch.tanh(q.detach().double() @ kq.transpose(-2, -1) * 0.5 / 30.0)
    lse = capped.masked_fill(~m.dense(T, T), -math.inf).logsumexp(-1)  # (1, H, T)
    torch.testing.assert_close(res.lse.detach().double(), lse, **tol(torch.float32))
