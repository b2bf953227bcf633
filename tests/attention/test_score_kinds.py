"""Score and mask kinds of today's open models: ALiBi, T5 relative position bias, document
masks, logit soft-capping, attention sinks. Their values against published numbers and
transformers' own functions; tiles against the dense mask; bad input.
(Backend conformance of every kind is in test_backends.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from attnlab import Attention, KVCache
from attnlab.backends import WeightsRequest, explain_dispatch
from attnlab.biases import AlibiBias, RelativePositionBias, alibi_slopes, relative_position_bucket
from attnlab.functional import exact_attention_weights, scaled_dot_product_attention
from attnlab.masks import AdditiveMask, CausalMask, DocumentMask
from reference import reference_attention, t5_relative_bucket, tol

SERVES_SOFTCAP_AND_SINKS = {"math", "blockwise"}


def test_alibi_slopes_published_values():
    # Press et al.: for 8 heads the slopes are 1/2, 1/4, ..., 1/256.
    torch.testing.assert_close(
        alibi_slopes(8), torch.tensor([2.0**-i for i in range(1, 9)]).double()
    )
    # 12 heads (not a power of two): the 8 slopes of 8 heads, then every other slope of
    # 16 heads (2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5).
    expect = [2.0**-i for i in range(1, 9)] + [2.0 ** -(i + 0.5) for i in range(4)]
    torch.testing.assert_close(alibi_slopes(12), torch.tensor(expect).double())


@pytest.mark.parametrize("H", [1, 3, 5, 8, 12, 16, 20, 32])
def test_alibi_slopes_match_bloom(H):
    pytest.importorskip("transformers")
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    alibi = build_alibi_tensor(torch.ones(1, 3), H, torch.float32)  # (H, 1, 3) = slope * j
    torch.testing.assert_close(alibi_slopes(H).float(), alibi[:, 0, 1])


@pytest.mark.parametrize("backend", ["math", "sdpa", "blockwise"])
@pytest.mark.parametrize(("T", "S"), [(9, 9), (3, 11)])
def test_alibi_equals_bloom_form_under_a_causal_mask(backend, T, S):
    """BLOOM adds +slope*j; ALiBi's -slope*(i - j) differs by slope*i, constant per row."""
    pytest.importorskip("transformers")
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    H = 6
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, H, T, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(2, H, S, 16, generator=gen, dtype=torch.float64)
    v = torch.randn(2, H, S, 16, generator=gen, dtype=torch.float64)
    bloom = build_alibi_tensor(torch.ones(2, S), H, torch.float64).view(2, H, 1, S)
    ours = scaled_dot_product_attention(q, k, v, AlibiBias(H), is_causal=True, backend=backend)
    theirs, _ = reference_attention(q, k, v, mask=CausalMask().dense(T, S), bias=bloom)
    torch.testing.assert_close(ours, theirs, **tol(torch.float64))
    # ... and the bias alone really moves the output (the test can fail).
    plain = scaled_dot_product_attention(q, k, v, is_causal=True, backend=backend)
    assert not torch.allclose(plain, ours, atol=1e-3)


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize(("num_buckets", "max_distance"), [(32, 128), (8, 20), (16, 50)])
def test_t5_buckets_match_transformers(bidirectional, num_buckets, max_distance):
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")

    rel = torch.arange(-400, 401)[None, :] - torch.arange(0, 3)[:, None]  # (3, 801)
    theirs = t5.T5Attention._relative_position_bucket(
        rel, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
    )
    ours = relative_position_bucket(
        rel, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
    )
    assert torch.equal(ours, theirs)
    # The conformance grid's own rule (tests/reference.py) agrees too.
    assert torch.equal(t5_relative_bucket(rel, bidirectional, num_buckets, max_distance), theirs)
    assert int(ours.max()) == num_buckets - 1  # the far buckets are reached


def test_t5_bias_against_transformers_compute_bias():
    """The whole bias (bucket + table lookup) against T5Attention.compute_bias."""
    pytest.importorskip("transformers")
    from transformers import T5Config
    from transformers.models.t5.modeling_t5 import T5Attention

    cfg = T5Config(d_model=32, d_kv=8, num_heads=4, relative_attention_num_buckets=32,
                   relative_attention_max_distance=128, is_decoder=False)  # fmt: skip
    torch.manual_seed(0)
    t5 = T5Attention(cfg, has_relative_attention_bias=True)
    T = S = 200
    theirs = t5.compute_bias(T, S)  # (1, H, T, S)
    table = t5.relative_attention_bias.weight  # (num_buckets, H)
    ours = RelativePositionBias(table, bidirectional=True).dense(T, S)
    torch.testing.assert_close(ours, theirs)


def _tiles_agree_with_dense(mask, T, S, H=4, tq=5, tk=7):
    dense = mask.dense(T, S, dtype=torch.float64)  # (b, h, T, S)
    if dense.dtype == torch.bool:  # a mask without bias: as 0 / -inf
        dense = torch.zeros(dense.shape, dtype=torch.float64).masked_fill(~dense, -math.inf)
    dense = dense.expand(dense.shape[0], H, T, S)
    for q0 in range(0, T, tq):
        lo, hi = mask.col_range(T, S, q0, min(T, q0 + tq))
        rows = dense[..., q0 : q0 + tq, :]
        outside = torch.cat([rows[..., :lo], rows[..., hi:]], dim=-1)
        assert bool((outside == -math.inf).all()), (q0, lo, hi)  # col_range is safe
        for k0 in range(0, S, tk):
            blk = mask.block(T, S, slice(q0, q0 + tq), slice(k0, k0 + tk))
            want = dense[..., q0 : q0 + tq, k0 : k0 + tk]
            if blk.status == "empty":
                assert bool((want == -math.inf).all())
                continue
            got = torch.zeros_like(want)
            if blk.bias is not None:
                got = got + blk.bias.double()
            if blk.allowed is not None:
                got = got.masked_fill(~blk.allowed, -math.inf)
            torch.testing.assert_close(got.expand_as(want), want)
            if blk.status == "full":
                assert bool((want == 0).all())


def test_tiles_agree_with_dense():
    ids = torch.tensor([[0] * 6 + [1] * 9 + [2] * 4, [0] * 2 + [5] * 17])  # (2, 19)
    table = torch.randn(32, 4)
    cases = [
        (AlibiBias(4), 19, 19),
        (AlibiBias(4) & CausalMask(), 10, 19),
        (RelativePositionBias(table, bidirectional=False) & CausalMask(), 19, 19),
        (DocumentMask(ids) & CausalMask() & AlibiBias(4), 19, 19),
        (DocumentMask(ids[:, 9:], ids) & RelativePositionBias(table), 10, 19),
        (DocumentMask(ids.flip(1)), 19, 19),  # unsorted ids: no narrowing, still right
    ]
    for mask, T, S in cases:
        mask.validate(2, 4, T, S)
        _tiles_agree_with_dense(mask, T, S)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_constant_bias_exactly_where_the_dense_bias_is_one_number_per_head(bidirectional):
    """``constant_bias`` of every tile of a grid (T != S, bottom-right) against the dense
    bias: where it answers, each head's number equals every entry of the tile; where the
    dense tile is constant per head beyond a whole bucket run, it answers."""
    table = torch.randn(8, 3)
    T, S, n = 40, 64, 8
    bias = RelativePositionBias(table, bidirectional=bidirectional, num_buckets=8,
                                max_distance=12)  # fmt: skip
    masks = [
        bias,
        bias & CausalMask(),
        bias
        & DocumentMask(torch.zeros(1, T, dtype=torch.long), torch.ones(1, S, dtype=torch.long)),
    ]
    answered = 0
    for mask in masks:
        dense = mask.dense(T, S, dtype=torch.float64)  # (1, H, T, S)
        for r0 in range(0, T, n):
            for c0 in range(0, S, n):
                rows, cols = slice(r0, r0 + n), slice(c0, c0 + n)
                got = mask.constant_bias(T, S, rows, cols)
                tile = dense[:, :, rows, cols].expand(1, 3, n, n)
                if got is None:
                    continue
                answered += 1
                assert got.shape == (1, 3, 1, 1)
                torch.testing.assert_close(got.double().expand_as(tile), tile)
        if mask is masks[-1]:  # documents never meet: no tile is "unmasked"
            assert mask.constant_bias(T, S, slice(0, n), slice(0, n)) is None
    assert answered > 0
    # A tile that spans two buckets is not constant.
    near = slice(T - n, T)
    assert bias.constant_bias(T, S, near, slice(S - n, S)) is None


def test_document_mask_skips_tiles_where_documents_never_meet():
    ids = torch.arange(8).repeat_interleave(16)[None]  # 8 documents of 16 tokens
    m = DocumentMask(ids) & CausalMask()
    T = 128
    statuses = [
        m.block(T, T, slice(q0, q0 + 16), slice(k0, k0 + 16)).status
        for q0 in range(0, T, 16)
        for k0 in range(0, T, 16)
    ]
    # Only the 8 diagonal tiles are computed: the cost is the sum of the squares.
    assert statuses.count("empty") == 64 - 8
    assert DocumentMask(ids).col_range(T, T, 32, 48) == (32, 48)
    assert m.col_range(T, T, 40, 56) == (32, 56)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: AlibiBias(), r"exactly one of `num_heads`"),
        (lambda: AlibiBias(0), r"`num_heads` must be a positive int"),
        (lambda: AlibiBias(slopes=torch.ones(2, 2)), r"`slopes` must be 1-D"),
        (lambda: AlibiBias(slopes=torch.ones(3, dtype=torch.long)), r"`slopes` must be a float"),
        (lambda: RelativePositionBias(torch.zeros(16, 4)), r"`table` must have shape \(num_b"),
        (lambda: RelativePositionBias(torch.zeros(32)), r"`table` must have shape"),
        (lambda: RelativePositionBias(torch.zeros(2, 4), num_buckets=2), r"`num_buckets` must"),
        (
            lambda: RelativePositionBias(torch.zeros(32, 4), max_distance=8),
            r"`max_distance` must be an int above",
        ),
        (lambda: DocumentMask(torch.zeros(2, 5)), r"`segment_ids` must be an integer tensor"),
        (lambda: DocumentMask(torch.zeros(5, dtype=torch.long)), r"`segment_ids` must be a non"),
        (
            lambda: DocumentMask(torch.zeros(2, 5, dtype=torch.long), torch.zeros(3, 5).long()),
            r"`key_segment_ids` must have the batch size",
        ),
    ],
)
def test_bad_construction_raises_naming_the_argument(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"attn_mask": AlibiBias(slopes=torch.ones(3))}, r"`slopes` must have one slope .*H=4"),
        ({"attn_mask": RelativePositionBias(torch.zeros(32, 3))}, r"`table` must have one col"),
        ({"attn_mask": DocumentMask(torch.zeros(1, 4).long())}, r"`segment_ids` must have shape"),
        ({"attn_mask": DocumentMask(torch.zeros(1, 5).long())}, r"pass `key_segment_ids`"),
        (
            {"attn_mask": DocumentMask(torch.zeros(1, 5).long(), torch.zeros(1, 7).long())},
            r"`key_segment_ids` must have shape \(B, S\) = \(1, 6\)",
        ),
        ({"softcap": 0.0}, r"`softcap` must be a positive finite number"),
        ({"softcap": -3.0}, r"`softcap` must be a positive"),
        ({"sinks": torch.zeros(3)}, r"`sinks` must have one logit per query head.*\(4,\)"),
        ({"sinks": torch.zeros(4, dtype=torch.long)}, r"`sinks` must be a float tensor"),
    ],
)
def test_bad_call_raises_naming_the_argument(kwargs, match):
    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    for fn in (scaled_dot_product_attention, explain_dispatch):
        with pytest.raises(ValueError, match=match):
            fn(q, k, v, **kwargs)


def test_fully_masked_rows_with_sinks_and_documents_give_zero_and_finite_grads():
    q = torch.randn(1, 2, 6, 8, requires_grad=True)
    k = torch.randn(1, 2, 4, 8, requires_grad=True)
    v = torch.randn(1, 2, 4, 8, requires_grad=True)
    sinks = torch.randn(2, requires_grad=True)
    # queries of document 9 find no key of their document
    m = DocumentMask(torch.tensor([[0, 0, 9, 1, 9, 1]]), torch.tensor([[0, 0, 1, 1]]))
    for backend in ("math", "blockwise"):
        for t in (q, k, v, sinks):
            t.grad = None
        out, w = scaled_dot_product_attention(
            q, k, v, m, sinks=sinks, softcap=5.0, backend=backend, need_weights=True
        )
        assert torch.equal(out[:, :, [2, 4]], torch.zeros_like(out[:, :, [2, 4]]))
        assert torch.equal(w[:, :, [2, 4]], torch.zeros_like(w[:, :, [2, 4]]))
        out.square().sum().backward()
        for t in (q, k, v, sinks):
            assert t.grad is not None and torch.isfinite(t.grad).all()


@pytest.mark.parametrize("backend", ["math", "sdpa", "blockwise"])
def test_exact_weights_include_softcap_bias_and_sinks(backend):
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 30, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 4, 30, 16, generator=gen, dtype=torch.float64)
    v = torch.randn(2, 4, 30, 16, generator=gen, dtype=torch.float64)
    table = torch.randn(32, 4, generator=gen, dtype=torch.float64)
    sinks = torch.randn(4, generator=gen, dtype=torch.float64)
    mask = RelativePositionBias(table) & CausalMask()
    extra = {"softcap": 2.0, "sinks": sinks} if backend in SERVES_SOFTCAP_AND_SINKS else {}
    req = WeightsRequest(heads=(3, 1), rows=(29, 0, 11))
    _, w = scaled_dot_product_attention(q, k, v, mask, backend=backend, need_weights=req, **extra)
    bias = mask.dense(30, 30, dtype=torch.float64)
    _, ref_w = reference_attention(
        q, k, v, bias=bias, softcap=extra.get("softcap"), sinks=extra.get("sinks")
    )
    torch.testing.assert_close(w, ref_w[:, [3, 1]][:, :, [29, 0, 11]], **tol(torch.float64))
    direct = exact_attention_weights(q, k, mask, heads=[3, 1], rows=[29, 0, 11], **extra)
    torch.testing.assert_close(direct, w, **tol(torch.float64))
    if "sinks" in extra:  # the sinks took their share: rows sum to less than 1
        assert bool((w.sum(-1) < 1 - 1e-6).all())


def test_attention_layer_softcap_and_sinks_with_kv_cache_and_capture():
    torch.manual_seed(0)
    layer = Attention(32, 4, num_kv_heads=2, rope=True, softcap=3.0, sinks=True).double()
    assert isinstance(layer.sinks, torch.nn.Parameter) and layer.sinks.shape == (4,)
    with torch.no_grad():
        layer.sinks.copy_(torch.randn(4))
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    full = layer(x, is_causal=True)
    # The same layer decoding token by token through a KV cache gives the same outputs.
    cache = KVCache()
    steps = [layer(x[:, :4], is_causal=True, kv_cache=cache)]
    steps += [layer(x[:, t : t + 1], is_causal=True, kv_cache=cache) for t in range(4, 9)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, **tol(torch.float64))
    # The capture hook records the exact weights, sink share included.
    layer.capture = WeightsRequest(heads=(2,))
    layer(x, is_causal=True)
    assert layer.captured is not None and layer.captured.shape == (2, 1, 9, 9)
    _, w = layer(x, is_causal=True, need_weights=True)
    torch.testing.assert_close(layer.captured, w[:, [2]], **tol(torch.float64))
    assert bool((w.sum(-1) < 1).all())
    # Gradients reach the sinks.
    layer.capture = None
    layer(x, is_causal=True).sum().backward()
    assert layer.sinks.grad is not None and bool(layer.sinks.grad.abs().sum() > 0)
    # softcap really changes the result (the test can fail).
    plain = Attention(32, 4, num_kv_heads=2, rope=True, sinks=True).double()
    plain.load_state_dict(layer.state_dict())
    assert not torch.allclose(plain(x, is_causal=True), full)


def test_attention_layer_rejects_bad_softcap_and_sinks():
    with pytest.raises(ValueError, match="`softcap` must be a positive"):
        Attention(32, 4, softcap=0.0)
    with pytest.raises(
        ValueError, match=r"`sinks` must have one logit per query head, shape \(H,\) = \(4,\)"
    ):
        Attention(32, 4, sinks=torch.zeros(3))


def test_additive_mask_gradient_on_every_backend_that_serves_it():
    # A plain AdditiveMask that requires grad: the same route as the tables.
    q = torch.randn(1, 2, 7, 8, dtype=torch.float64)
    bias0 = torch.randn(1, 2, 7, 7, dtype=torch.float64)
    grads = {}
    for backend in ("math", "sdpa", "blockwise"):
        b = bias0.clone().requires_grad_()
        scaled_dot_product_attention(q, q, q, AdditiveMask(b), backend=backend).sum().backward()
        grads[backend] = b.grad
    torch.testing.assert_close(grads["math"], grads["sdpa"], **tol(torch.float64))
    torch.testing.assert_close(grads["math"], grads["blockwise"], **tol(torch.float64))


@pytest.mark.parametrize("backend", ["math", "sdpa", "blockwise"])
def test_biases_and_documents_decode_through_the_kv_cache(backend):
    """Bottom-right alignment: decoding token by token with a cache gives the full pass."""
    torch.manual_seed(1)
    layer = Attention(32, 4, backend=backend).double()
    table = torch.randn(32, 4, dtype=torch.float64)
    x = torch.randn(1, 12, 32, dtype=torch.float64)
    ids = torch.tensor([[0] * 5 + [1] * 7])

    def mask(t0: int, t1: int):
        # queries t0..t1-1 against keys 0..t1-1 (the cache so far)
        return (
            AlibiBias(4)
            & RelativePositionBias(table, bidirectional=False)
            & DocumentMask(ids[:, t0:t1], ids[:, :t1])
        )

    full = layer(x, attn_mask=mask(0, 12), is_causal=True)
    cache = KVCache()
    steps = [layer(x[:, :3], attn_mask=mask(0, 3), is_causal=True, kv_cache=cache)]
    for t in range(3, 12):
        steps.append(
            layer(x[:, t : t + 1], attn_mask=mask(t, t + 1), is_causal=True, kv_cache=cache)
        )
    torch.testing.assert_close(torch.cat(steps, dim=1), full, **tol(torch.float64))


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize(("num_buckets", "max_distance"), [(32, 128), (8, 20)])
def test_t5_bucket_of_one_distance_equals_the_tensor_rule(bidirectional, num_buckets, max_distance):
    """The planner's per-distance lookup equals relative_position_bucket, beyond
    max_distance too."""
    mask = RelativePositionBias(
        torch.zeros(num_buckets, 2), bidirectional=bidirectional, num_buckets=num_buckets,
        max_distance=max_distance,
    )  # fmt: skip
    rel = torch.arange(-3 * max_distance, 3 * max_distance + 1)
    want = relative_position_bucket(
        rel, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
    )
    assert [mask._bucket_of(int(d)) for d in rel] == want.tolist()
