"""Every backend against the one fp64 reference: outputs and gradients, every mask type,
odd shapes, grouped-query heads, fully masked rows; exact weights; dispatch; bad input."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from attnlab._memory import peak_allocated
from attnlab.backends import (
    WeightsRequest,
    available_backends,
    explain_dispatch,
    set_dispatch_table,
)
from attnlab.backends.blockwise import force_tile_path, fused_tiles_available
from attnlab.functional import exact_attention_weights, scaled_dot_product_attention
from attnlab.masks import (
    AdditiveMask,
    BooleanMask,
    CausalMask,
    ChunkedMask,
    PaddingMask,
    SlidingWindowMask,
)
from reference import reference_attention, t5_relative_bucket, tol

BACKENDS = [b for b in available_backends() if b not in ("auto", "ring")]
# blockwise once per tile path: PyTorch's fused op and the pure-PyTorch tiles.
TILE_PATHS = ["fused", "pure"] if fused_tiles_available() else ["pure"]
BACKEND_CASES = [
    f"{b}:{p}" if b == "blockwise" else b
    for b in BACKENDS
    for p in (TILE_PATHS if b == "blockwise" else [None])
]
DTYPES = [torch.float32, torch.bfloat16, torch.float64]
MASK_KINDS = [
    "none", "causal_top_left", "padding", "window", "chunked", "boolean", "additive", "combined",
]  # fmt: skip
B, H, G = 2, 4, 2


def make_mask(kind: str, T: int, S: int, gen: torch.Generator):
    """An attnlab mask of ``kind`` and, built here from the same draws without attnlab's
    ``Mask.dense()``, the reference's dense form: ``(mask, allowed, bias)``, ``allowed`` a
    boolean tensor (True = may attend) or None, ``bias`` an additive float64 tensor or None.

    Positions align bottom-right when T != S (the last query with the last key), as
    attnlab's masks document: query ``p`` sits at key position ``p + S - T``.
    """
    qpos = torch.arange(T)[:, None] + (S - T)  # (T, 1) query positions on the key axis
    kpos = torch.arange(S)[None, :]  # (1, S)
    if kind == "none":
        return None, None, None
    if kind == "causal_top_left":
        return CausalMask("top_left"), kpos <= torch.arange(T)[:, None], None
    if kind == "padding":  # batch item 1 is all padding: every one of its rows is empty
        lengths = [max(1, S - 2), 0]
        return PaddingMask.from_lengths(lengths, S), _keys_below(lengths, S), None
    if kind == "window":  # causal window of 4: the query's key position and the 3 before
        return SlidingWindowMask(4), (kpos <= qpos) & (kpos > qpos - 4), None
    if kind == "chunked":  # chunks of 5 key positions, causal inside a chunk
        return ChunkedMask(5), (kpos <= qpos) & (kpos // 5 == qpos // 5), None
    if kind == "boolean":
        allowed = torch.rand(B, H, T, S, generator=gen) > 0.3
        return BooleanMask(allowed), allowed, None
    if kind == "additive":
        bias = torch.randn(1, H, T, S, generator=gen)
        bias = bias.masked_fill(torch.rand(1, H, T, S, generator=gen) > 0.8, -math.inf)
        return AdditiveMask(bias), None, bias.double()
    if kind == "combined":  # padding and a two-sided window of 6: |query - key| < 6
        lengths = [S, max(1, S // 2)]
        mask = PaddingMask.from_lengths(lengths, S) & SlidingWindowMask(6, causal=False)
        return mask, _keys_below(lengths, S) & ((qpos - kpos).abs() < 6), None
    raise AssertionError(kind)


def _keys_below(lengths: list[int], S: int) -> torch.Tensor:
    """(B, 1, 1, S): key j of batch item b is real when j < lengths[b]."""
    return (torch.arange(S)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :]


def reference_for(allowed, bias, is_causal, T, S):
    """The dense (bool mask, float bias) for tests/reference.py, with ``is_causal``'s
    bottom-right causal mask added (key position at most the query's)."""
    if is_causal:
        causal = torch.arange(S)[None, :] <= torch.arange(T)[:, None] + (S - T)  # (T, S)
        allowed = causal if allowed is None else allowed & causal
    return allowed, bias


def grad_tol(dtype: torch.dtype) -> dict[str, float]:
    # Gradients pass through two more products than outputs; half precision rounds each.
    t = tol(dtype)
    if dtype == torch.bfloat16:
        return {"atol": 6e-2, "rtol": 6e-2}
    return {"atol": 4 * t["atol"], "rtol": 4 * t["rtol"]}


def split_case(case: str) -> tuple[str, str | None]:
    """``"blockwise:pure"`` -> ``("blockwise", "pure")``; a plain name -> ``(name, None)``."""
    name, _, path = case.partition(":")
    return name, path or None


def run_case(backend, dtype, is_causal, kind, T, S, D, seed=0):
    """``backend`` is a backend name, or ``blockwise:<tile path>``."""
    backend, path = split_case(backend)
    with force_tile_path(path):
        _run_case(backend, dtype, is_causal, kind, T, S, D, seed)


def _run_case(backend, dtype, is_causal, kind, T, S, D, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=gen).to(dtype).requires_grad_()
    k = torch.randn(B, G, S, D, generator=gen).to(dtype).requires_grad_()
    v = torch.randn(B, G, S, D, generator=gen).to(dtype).requires_grad_()
    dout = torch.randn(B, H, T, D, generator=gen).to(dtype)
    mask, allowed, bias = make_mask(kind, T, S, gen)
    out = scaled_dot_product_attention(q, k, v, mask, is_causal=is_causal, backend=backend)
    out.backward(dout)

    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    dmask, dbias = reference_for(allowed, bias, is_causal, T, S)
    ref, _ = reference_attention(qr, kr, vr, mask=dmask, bias=dbias)
    ref.backward(dout.double())

    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, **tol(dtype))
    for name, t, r in (("q", q, qr), ("k", k, kr), ("v", v, vr)):
        assert t.grad is not None and torch.isfinite(t.grad).all(), name
        torch.testing.assert_close(t.grad.double(), r.grad, **grad_tol(dtype), msg=name)


# Fast grid: every backend x dtype x causal x mask kind, on three odd shapes (T, S, D)
# that cover T in {1, 7, 97}, D in {8, 59, 64} and S != T.
FAST_SHAPES = [(1, 5, 8), (7, 12, 59), (97, 70, 64)]


@pytest.mark.parametrize("shape", FAST_SHAPES, ids=lambda s: "T{}S{}D{}".format(*s))
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKEND_CASES)
def test_conformance(backend, dtype, is_causal, kind, shape):
    run_case(backend, dtype, is_causal, kind, *shape)


# The rest of T x D, each with one key length S != T (longer for D = 8 and 64, shorter
# for D = 59, so both directions of the bottom-right causal alignment are covered).
SLOW_SHAPES = [
    (T, T + 13 if D != 59 else max(1, T // 2 + 3), D)
    for T, D in itertools.product([1, 7, 97], [8, 59, 64])
    if (T, D) not in {(t, d) for t, _, d in FAST_SHAPES}
]


def covering(choices: list, *axes: list) -> list[tuple]:
    """One ``choice`` for every combination of ``axes`` instead of the full product, chosen
    so that each choice meets every value of every axis (pairwise coverage).

    Combinations are taken in product order; each gets the choice that meets the most
    (axis value, choice) pairs not met yet, the earliest in rotation on a tie; a case is
    added for each pair still not met. Same arguments, same cases.

    Returns:
        ``[(*values, choice), ...]``, one per combination of the axes.
    """
    met: set[tuple[int, int, int]] = set()  # (axis, value index, choice index)
    cases = []
    for k, index in enumerate(itertools.product(*(range(len(a)) for a in axes))):

        def gain(c: int, index: tuple[int, ...] = index) -> int:
            return sum((a, i, c) not in met for a, i in enumerate(index))

        order = [(k + j) % len(choices) for j in range(len(choices))]
        best = max(order, key=gain)  # max keeps the first of equal gains
        met.update((a, i, best) for a, i in enumerate(index))
        cases.append((*(axis[i] for i, axis in zip(index, axes, strict=True)), choices[best]))
    # pairs the greedy pass left out (few): one more case each, the other axes rotating
    for a, axis in enumerate(axes):
        for i in range(len(axis)):
            for c in range(len(choices)):
                if (a, i, c) in met:
                    continue
                k = len(cases)
                index = tuple(i if b == a else k % len(other) for b, other in enumerate(axes))
                met.update((b, j, c) for b, j in enumerate(index))
                cases.append((*(ax[j] for j, ax in zip(index, axes, strict=True)), choices[c]))
    return cases


# The full product of the fast grid's axes over six more shapes found nothing the fast
# grid and this covering did not (3,332 cases): every (shape, mask kind), (backend, mask
# kind), (dtype, mask kind) and (causal, mask kind) pair still runs, on every shape.
FULL_GRID = covering(MASK_KINDS, SLOW_SHAPES, [False, True], BACKEND_CASES, DTYPES)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("shape", "is_causal", "backend", "dtype", "kind"),
    FULL_GRID,
    ids=["T{}S{}D{}-{}-{}-{}-{}".format(*s, "causal" if c else "full", b, d, k)
         for s, c, b, d, k in FULL_GRID],
)  # fmt: skip
def test_conformance_full_grid(backend, dtype, is_causal, kind, shape):
    run_case(backend, dtype, is_causal, kind, *shape, seed=1)


@pytest.mark.parametrize("backend", BACKEND_CASES)
def test_fully_masked_rows_zero_output_finite_grads(backend):
    backend, path = split_case(backend)
    q = torch.randn(1, 2, 6, 16, requires_grad=True)
    k = torch.randn(1, 2, 6, 16, requires_grad=True)
    v = torch.randn(1, 2, 6, 16, requires_grad=True)
    allowed = torch.ones(1, 1, 6, 6, dtype=torch.bool)
    allowed[..., 2, :] = False
    allowed[..., 4, :] = False
    with force_tile_path(path):
        out, w = scaled_dot_product_attention(q, k, v, allowed, backend=backend, need_weights=True)
    assert not torch.isnan(out).any() and not torch.isnan(w).any()
    assert torch.equal(out[:, :, [2, 4]], torch.zeros_like(out[:, :, [2, 4]]))
    assert torch.equal(w[:, :, [2, 4]], torch.zeros_like(w[:, :, [2, 4]]))
    (out.square().sum()).backward()
    for t in (q, k, v):
        assert t.grad is not None and torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[:, :, [2, 4]], torch.zeros_like(q.grad[:, :, [2, 4]]))


@pytest.mark.parametrize("backend", BACKEND_CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_large_logits_half_precision(backend, dtype):
    backend, path = split_case(backend)
    gen = torch.Generator().manual_seed(3)
    q = (torch.randn(1, 2, 9, 32, generator=gen) * 30).to(dtype)
    k = (torch.randn(1, 2, 9, 32, generator=gen) * 30).to(dtype)
    v = torch.randn(1, 2, 9, 32, generator=gen).to(dtype)
    with force_tile_path(path):
        out = scaled_dot_product_attention(q, k, v, is_causal=True, backend=backend)
    assert torch.isfinite(out).all()
    ref, _ = reference_attention(q, k, v, mask=CausalMask().dense(9, 9))
    torch.testing.assert_close(out.double(), ref, **tol(dtype))


@pytest.mark.parametrize("backend", BACKEND_CASES)
def test_exact_weights_for_chosen_heads_and_rows(backend):
    backend, path = split_case(backend)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 40, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 2, 50, 16, generator=gen, dtype=torch.float64)
    v = torch.randn(2, 2, 50, 16, generator=gen, dtype=torch.float64)
    mask = PaddingMask.from_lengths([50, 31], 50) & CausalMask()
    req = WeightsRequest(heads=(3, 0), rows=(39, 2, 17))
    with force_tile_path(path):
        out, w = scaled_dot_product_attention(q, k, v, mask, backend=backend, need_weights=req)
        full = scaled_dot_product_attention(q, k, v, mask, backend=backend)
    _, ref_w = reference_attention(q, k, v, mask=mask.dense(40, 50))
    assert w.shape == (2, 2, 3, 50)
    torch.testing.assert_close(w, ref_w[:, [3, 0]][:, :, [39, 2, 17]], **tol(torch.float64))
    torch.testing.assert_close(out, full, **tol(torch.float64))
    direct = exact_attention_weights(q, k, mask, heads=[3, 0], rows=[39, 2, 17])
    torch.testing.assert_close(direct, w, **tol(torch.float64))


def test_exact_weights_memory_is_the_size_of_the_request():
    """One head, one row of a 4096-key sequence: peak memory is that head's keys plus the
    (1, 1, 1, S) result and one key block -- not B*H*T*S (512 MiB here)."""
    T = S = 4096
    D = 32
    q, k = torch.randn(1, 8, T, D), torch.randn(1, 8, S, D)
    w, peak = peak_allocated(
        lambda: exact_attention_weights(q, k, is_causal=True, heads=[5], rows=[T - 1])
    )
    assert w.shape == (1, 1, 1, S)
    one_head_keys = S * D * 4
    assert peak < one_head_keys + 8 * S * 4 + 64 * 1024, peak
    # Positive controls: the meter counts what the call allocates -- at least the result it
    # returns, and all of one head's (T, S) weights when every row is asked for.
    assert peak >= w.numel() * 4, peak
    full, full_peak = peak_allocated(
        lambda: exact_attention_weights(q, k, is_causal=True, heads=[5])
    )
    assert full.shape == (1, 1, T, S) and full_peak >= T * S * 4, full_peak


def test_explain_dispatch_names_every_backend():
    q = k = v = torch.randn(1, 2, 8, 16)
    exp = explain_dispatch(q, k, v, is_causal=True)
    assert exp.chosen in BACKENDS
    names = [n for n, _ in exp.reasons]
    assert sorted(names) == sorted(b for b in available_backends() if b != "auto")
    for name, why in exp.reasons:
        assert (why is None) == (name == exp.chosen)
    assert "chosen" in str(exp)
    exp_math = explain_dispatch(q, k, v, backend="math")
    assert exp_math.chosen == "math"


def _qkv(Bq=1, Hq=4, T=5, D=8, Gk=2, S=6, Dv=8):
    return torch.randn(Bq, Hq, T, D), torch.randn(Bq, Gk, S, D), torch.randn(Bq, Gk, S, Dv)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"query": torch.randn(4, 5, 8)}, ValueError, r"`query` must be 4-D .* got a 3-D"),
        ({"key": torch.randn(2, 2, 6, 8)}, ValueError, r"batch size as `query` \(B=1\)"),
        (
            {"key": torch.randn(1, 2, 6, 7)},
            ValueError,
            r"same head dim as `query` \(D=8\), got D=7",
        ),
        (
            {"key": torch.randn(1, 3, 6, 8), "value": torch.randn(1, 3, 6, 8)},
            ValueError,
            r"H=4 query heads and G=3",
        ),
        ({"value": torch.randn(1, 2, 5, 8)}, ValueError, r"same heads and length as `key`"),
        ({"attn_mask": torch.ones(5, 7, dtype=torch.bool)}, ValueError, r"attn_mask.*broadcast"),
        ({"attn_mask": torch.ones(5, 6, dtype=torch.int64)}, TypeError, r"attn_mask.*dtype"),
        ({"backend": "flash9"}, ValueError, r"`backend` must be one of .* got 'flash9'"),
        ({"dropout_p": -0.1}, ValueError, r"`dropout_p` must be in \[0, 1\), got -0.1"),
        ({"need_weights": WeightsRequest(heads=(4,))}, ValueError, r"head\(s\) \[4\].*H=4"),
        ({"need_weights": WeightsRequest(rows=(9,))}, ValueError, r"row\(s\) \[9\].*T=5"),
        ({"query": torch.randn(1, 4, 5, 8).long()}, TypeError, r"`query` must be a floating"),
        ({"key": torch.randn(1, 2, 6, 8).double()}, TypeError, r"share one dtype"),
        ({"scale": 0.0}, ValueError, r"`scale` must be a positive"),
        ({"need_weights": "yes"}, TypeError, r"`need_weights` must be a bool"),
    ],
)
def test_bad_input_raises_naming_the_argument(kwargs, exc, match):
    q, k, v = _qkv()
    args = {"query": q, "key": k, "value": v, **kwargs}
    with pytest.raises(exc, match=match):
        scaled_dot_product_attention(**args)
    with pytest.raises(exc, match=match):
        explain_dispatch(**args)


@pytest.fixture
def fixed_order():
    """auto by the fixed order (no crossover table: its measured ranking may differ)."""
    set_dispatch_table(None)
    yield
    set_dispatch_table()


def test_auto_dispatch_choices_and_refusals(fixed_order):
    small = torch.randn(1, 2, 8, 16)
    assert explain_dispatch(small, small, small, is_causal=True).chosen == "sdpa"
    # A big padding mask has no PyTorch fast path: auto applies it tile by tile instead.
    big = torch.zeros(1, 1, 1, 1).expand(1, 2, 8192, 16)
    pad = PaddingMask(torch.ones(1, 8192, dtype=torch.bool))
    exp = explain_dispatch(big, big, big, pad)
    assert exp.chosen == "blockwise"
    assert "materialised" in dict(exp.reasons)["sdpa"]
    # ... unless blockwise cannot serve it (dropout): then sdpa, never the O(T*S) reference.
    assert explain_dispatch(big, big, big, pad, dropout_p=0.1).chosen == "sdpa"
    with pytest.raises(ValueError, match="blockwise does not implement attention dropout"):
        scaled_dot_product_attention(small, small, small, dropout_p=0.1, backend="blockwise")
    # A bias that needs gradients is served by blockwise too (on its pure tiles).
    bias = AdditiveMask(torch.zeros(8, 8, requires_grad=True))
    assert explain_dispatch(small, small, small, bias, backend="blockwise").chosen == "blockwise"


@pytest.mark.parametrize("backend", ["sdpa", "math"])
def test_dropout_backends_drop_in_training(backend):
    torch.manual_seed(0)
    q = k = v = torch.randn(1, 2, 16, 8)
    a = scaled_dot_product_attention(q, k, v, dropout_p=0.5, backend=backend)
    b = scaled_dot_product_attention(q, k, v, backend=backend)
    assert a.shape == b.shape and not torch.allclose(a, b)


# -- Score and mask kinds of today's open models (issue 10) --------------------------------
# Each variant's reference numbers come from outside attnlab: ALiBi slopes from the
# published formula, T5 buckets from tests/reference.py's rule (checked against transformers in
# test_score_kinds.py), document masks from id
# equality, softcap and sinks from tests/reference.py.


def _t5_bucket(rel: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int):
    return t5_relative_bucket(rel, bidirectional, num_buckets, max_distance)


def _positions(T: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Absolute query and key positions, bottom-right aligned: (T, 1) and (1, S)."""
    return (torch.arange(T) + S - T)[:, None], torch.arange(S)[None, :]


def _doc_ids(n: int, gen: torch.Generator) -> torch.Tensor:
    """(B, n) sorted document ids: random document lengths, packed one after another."""
    return torch.stack(
        [torch.sort(torch.randint(0, 3, (n,), generator=gen)).values for _ in range(B)]
    )


class Variant:
    """One row of the grid: the attnlab arguments and the dense reference inputs."""

    def __init__(self, name: str, T: int, S: int, gen: torch.Generator, dtype: torch.dtype) -> None:
        from attnlab.biases import AlibiBias, RelativePositionBias
        from attnlab.masks import DocumentMask

        self.mask = None
        self.softcap = None
        self.sinks = None
        self.params: dict[str, torch.Tensor] = {}  # extra leaves whose gradients we check
        qpos, kpos = _positions(T, S)
        pdt = torch.float64 if dtype == torch.float64 else torch.float32  # learned params
        allowed = torch.ones(B, H, T, S, dtype=torch.bool)
        bias = torch.zeros(1, H, T, S, dtype=torch.float64)
        parts = set(name.split("+"))
        if "causal" in parts:
            self.add(CausalMask())
            allowed &= kpos <= qpos
        if "alibi" in parts:
            # Published slopes for a power-of-two head count: 2^(-8 h / H), h = 1..H.
            slopes = torch.tensor([2.0 ** (-8 * (h + 1) / H) for h in range(H)])
            self.add(AlibiBias(H))
            bias = bias - slopes.double()[:, None, None] * (qpos - kpos)
        if "relbias" in parts or "relbias_dec" in parts:
            bidir = "relbias" in parts
            table = torch.randn(8, H, generator=gen).to(pdt).requires_grad_()
            self.params["table"] = table
            self.add(
                RelativePositionBias(table, bidirectional=bidir, num_buckets=8, max_distance=20)
            )
            self.bucket = _t5_bucket(kpos - qpos, bidir, 8, 20)  # (T, S)
        if "doc" in parts:
            qid = _doc_ids(T, gen)
            kid = _doc_ids(S, gen) if S != T else None
            self.add(DocumentMask(qid, kid))
            kk = qid if kid is None else kid
            allowed &= (qid[:, :, None] == kk[:, None, :])[:, None]
        if "window" in parts:
            self.add(SlidingWindowMask(4))
            allowed &= (kpos <= qpos) & (kpos > qpos - 4)
        if "padding" in parts:  # batch item 1 is all padding: every one of its rows is empty
            self.add(PaddingMask.from_lengths([max(1, S - 2), 0], S))
            allowed &= (kpos < torch.tensor([max(1, S - 2), 0])[:, None, None])[:, None]
        if "softcap" in parts:
            self.softcap = 1.5
        if "sinks" in parts:
            self.sinks = torch.randn(H, generator=gen).to(pdt).requires_grad_()
            self.params["sinks"] = self.sinks
        self.ref_mask, self._bias = allowed, bias

    def ref_bias(self, leaves: dict[str, torch.Tensor]) -> torch.Tensor:
        """The dense fp64 bias, differentiable in the fp64 ``leaves`` (e.g. the table)."""
        if "table" not in leaves:
            return self._bias
        return self._bias + leaves["table"][self.bucket].permute(2, 0, 1)  # (1, H, T, S)

    def add(self, m):
        self.mask = m if self.mask is None else self.mask & m

    @property
    def features(self) -> set[str]:
        f = set()
        if self.softcap is not None:
            f.add("softcap")
        if self.sinks is not None:
            f.add("sinks")
        if self.mask is not None and self.mask.bias_requires_grad:
            f.add("bias_grad")
        return f


VARIANTS = [
    "alibi+causal",
    "relbias",
    "relbias_dec+causal",
    "doc",
    "doc+causal",
    "doc+causal+alibi",
    "softcap",
    "softcap+window",
    "sinks+causal",
    "sinks+padding",
    "softcap+sinks+relbias+causal",
    "doc+causal+softcap+sinks",
]
# What each backend refuses (and a word its reason must contain). Everything else it serves.
REFUSES = {
    "math": {},
    "sdpa": {"softcap": "soft-capping", "sinks": "sinks"},
    "blockwise": {},
}


def run_variant(backend, dtype, name, T, S, D, seed=0):
    """``backend`` is a backend name, or ``blockwise:<tile path>`` (soft-capping and bias
    gradients take the pure tiles whatever path is forced)."""
    backend, path = split_case(backend)
    with force_tile_path(path):
        _run_variant(backend, dtype, name, T, S, D, seed)


def _run_variant(backend, dtype, name, T, S, D, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=gen).to(dtype).requires_grad_()
    k = torch.randn(B, G, S, D, generator=gen).to(dtype).requires_grad_()
    v = torch.randn(B, G, S, D, generator=gen).to(dtype).requires_grad_()
    dout = torch.randn(B, H, T, D, generator=gen).to(dtype)
    var = Variant(name, T, S, gen, dtype)
    kw = {"softcap": var.softcap, "sinks": var.sinks, "backend": backend}
    refused = [REFUSES[backend][f] for f in var.features if f in REFUSES[backend]]
    if refused:
        exp = explain_dispatch(q, k, v, var.mask, **{**kw, "backend": "auto"})
        reason = dict(exp.reasons)[backend]
        assert reason is not None and any(word in reason for word in refused), reason
        with pytest.raises(ValueError, match="cannot serve"):
            scaled_dot_product_attention(q, k, v, var.mask, **kw)
        return
    out = scaled_dot_product_attention(q, k, v, var.mask, **kw)
    out.backward(dout)

    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    pr = {n: t.detach().double().requires_grad_() for n, t in var.params.items()}
    ref, _ = reference_attention(
        qr, kr, vr, mask=var.ref_mask, bias=var.ref_bias(pr), softcap=var.softcap,
        sinks=pr.get("sinks"),
    )  # fmt: skip
    ref.backward(dout.double())

    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, **tol(dtype))
    if "padding" in name:  # batch item 1 attends to nothing: exactly 0
        assert torch.equal(out[1], torch.zeros_like(out[1]))
    for n, t, r in (("q", q, qr), ("k", k, kr), ("v", v, vr)):
        assert t.grad is not None and torch.isfinite(t.grad).all(), n
        torch.testing.assert_close(t.grad.double(), r.grad, **grad_tol(dtype), msg=n)
    for n, t in var.params.items():
        assert t.grad is not None and torch.isfinite(t.grad).all(), n
        torch.testing.assert_close(t.grad.double(), pr[n].grad, **grad_tol(dtype), msg=n)


@pytest.mark.parametrize("shape", FAST_SHAPES, ids=lambda s: "T{}S{}D{}".format(*s))
@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKEND_CASES)
def test_conformance_variants(backend, dtype, name, shape):
    run_variant(backend, dtype, name, *shape)


# Every variant on every slow shape, with every backend and every dtype (pairwise).
VARIANTS_GRID = covering(VARIANTS, SLOW_SHAPES, BACKEND_CASES, DTYPES)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("shape", "backend", "dtype", "name"),
    VARIANTS_GRID,
    ids=["T{}S{}D{}-{}-{}-{}".format(*s, b, d, n) for s, b, d, n in VARIANTS_GRID],
)
def test_conformance_variants_full_grid(backend, dtype, name, shape):
    run_variant(backend, dtype, name, *shape, seed=1)


def test_the_covering_grids_meet_every_pair():
    for grid, axes in ((FULL_GRID, 4), (VARIANTS_GRID, 3)):
        choices = {case[-1] for case in grid}
        assert choices == set(MASK_KINDS if axes == 4 else VARIANTS)
        for a in range(axes):
            values = {str(case[a]) for case in grid}
            pairs = {(str(case[a]), case[-1]) for case in grid}
            assert len(pairs) == len(values) * len(choices), (a, len(pairs))
