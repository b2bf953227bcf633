"""The blockwise backend's tiles: many tiles per call, tile skipping, the reusable chunk
kernel and log-sum-exp merge, linear memory."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_backends import MASK_KINDS, TILE_PATHS, make_mask, reference_for

from attnlab import native
from attnlab._memory import peak_allocated
from attnlab.backends.blockwise import (
    ChunkOptions,
    attend_chunk,
    attend_chunk_backward,
    blockwise_attention,
    chunk,
    force_tile_path,
    merge_partials,
    tiles,
)
from attnlab.backends.blockwise.band import BandRun
from attnlab.functional import scaled_dot_product_attention
from attnlab.masks import (
    AdditiveMask,
    CausalMask,
    ChunkedMask,
    PaddingMask,
    SlidingWindowMask,
    as_mask,
)
from reference import reference_attention, tol

F64 = tol(torch.float64)


@pytest.mark.parametrize("path", TILE_PATHS)
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(("T", "S"), [(23, 31), (31, 17)])
def test_many_small_tiles_match_reference(kind, is_causal, T, S, path):
    gen = torch.Generator().manual_seed(11)
    Dv = 6 if path == "pure" else 9  # the fused op needs Dv == D
    q = torch.randn(2, 4, T, 9, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, S, 9, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, S, Dv, generator=gen, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(2, 4, T, Dv, generator=gen, dtype=torch.float64)
    user_mask, allowed, bias = make_mask(kind, T, S, gen)
    mask = as_mask(user_mask, is_causal)
    res = blockwise_attention(
        q, k, v, mask, dropout_p=0.0, scale=0.3, block_q=5, block_k=7, tile_path=path
    )
    res.output.backward(dout)
    grads = [t.grad.clone() for t in (q, k, v)]
    dmask, dbias = reference_for(allowed, bias, is_causal, T, S)
    ref, w = reference_attention(q, k, v, mask=dmask, bias=dbias, scale=0.3)
    for t in (q, k, v):
        t.grad = None
    ref.backward(dout)
    torch.testing.assert_close(res.output, ref, **F64)
    for g, t in zip(grads, (q, k, v), strict=True):
        torch.testing.assert_close(g, t.grad, **F64)
    # The saved log-sum-exp reproduces the weights: w = exp(s - lse), with s the scaled,
    # biased, masked scores computed here and w the reference's weights.
    assert res.lse is not None and res.lse.shape == (2, 4, T)
    s = (q.detach() @ k.detach().repeat_interleave(2, dim=1).transpose(-2, -1)) * 0.3
    if dbias is not None:
        s = s + dbias
    if dmask is not None:
        s = s.masked_fill(~dmask, -math.inf)  # (B, H, T, S)
    empty = w.sum(-1) == 0
    assert torch.equal(res.lse == -math.inf, empty)
    lse = res.lse.masked_fill(empty, 0.0)  # an empty row has no weight to reproduce: exp(-inf)
    torch.testing.assert_close(torch.exp(s - lse[..., None]), w.detach(), **F64)


@pytest.mark.parametrize("path", TILE_PATHS)
def test_very_negative_bias_is_not_flushed_to_zero(path):
    """A row whose scores are all around -1e4 (a soft mask) still gets a softmax."""
    q = torch.randn(1, 1, 12, 8, dtype=torch.float64)
    k = torch.randn(1, 1, 12, 8, dtype=torch.float64)
    v = torch.randn(1, 1, 12, 8, dtype=torch.float64)
    bias = torch.zeros(12, 12, dtype=torch.float64)
    bias[:, :4] = -math.inf
    bias[:, 4:] = -1e4
    mask = AdditiveMask(bias)
    res = blockwise_attention(
        q, k, v, mask, dropout_p=0.0, scale=1.0, block_q=4, block_k=4, tile_path=path
    )
    ref, _ = reference_attention(q, k, v, bias=bias, scale=1.0)
    torch.testing.assert_close(res.output, ref, **F64)


@pytest.mark.parametrize("path", TILE_PATHS)
def test_chunks_merged_by_lse_equal_the_whole(path):
    """What ring attention does: attend to key chunks separately, merge by log-sum-exp."""
    gen = torch.Generator().manual_seed(12)
    T, S = 20, 30
    q = torch.randn(1, 2, T, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 2, S, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(1, 2, S, 8, generator=gen, dtype=torch.float64)
    mask = CausalMask()
    full, full_lse = attend_chunk(q, k, v, mask, 0.5, tile_path=path)
    out, lse = None, None
    for k0 in range(0, S, 11):
        part = attend_chunk(
            q, k[:, :, k0 : k0 + 11], v[:, :, k0 : k0 + 11], mask, 0.5,
            k_offset=k0, S_total=S, block_q=6, block_k=4, tile_path=path,
        )  # fmt: skip
        out, lse = part if out is None else merge_partials(out, lse, *part)
    torch.testing.assert_close(out, full, **F64)
    torch.testing.assert_close(lse, full_lse, **F64)
    # In place, into row slices of accumulators (as ring attention merges): the same.
    acc = torch.zeros_like(full)
    acc_lse = torch.full_like(full_lse, float("-inf"))
    for k0 in range(0, S, 11):
        for q0 in (0, 7):  # two row pieces: the accumulator slices are views
            rows = slice(q0, 7 if q0 == 0 else T)
            part = attend_chunk(
                q[:, :, rows], k[:, :, k0 : k0 + 11], v[:, :, k0 : k0 + 11], mask, 0.5,
                q_offset=q0, k_offset=k0, T_total=T, S_total=S, tile_path=path,
            )  # fmt: skip
            got = merge_partials(acc[:, :, rows], acc_lse[:, :, rows], *part, inplace=True)
            assert got[0].data_ptr() == acc[:, :, rows].data_ptr()
    torch.testing.assert_close(acc, full, **F64)
    torch.testing.assert_close(acc_lse, full_lse, **F64)
    # And the backward pieces add up to the whole.
    dout = torch.randn_like(full)
    whole = attend_chunk_backward(q, k, v, dout, full, full_lse, mask, 0.5, tile_path=path)
    dk_parts, dq_sum = [], torch.zeros_like(q)
    for k0 in range(0, S, 11):
        dq, dk, _ = attend_chunk_backward(
            q, k[:, :, k0 : k0 + 11], v[:, :, k0 : k0 + 11], dout, full, full_lse, mask, 0.5,
            k_offset=k0, S_total=S, tile_path=path,
        )  # fmt: skip
        dq_sum += dq
        dk_parts.append(dk)
    torch.testing.assert_close(dq_sum, whole[0], **F64)
    torch.testing.assert_close(torch.cat(dk_parts, dim=2), whole[1], **F64)
    # ... and equal the reference's gradients.
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref, _ = reference_attention(qr, kr, vr, mask=mask.dense(T, S), scale=0.5)
    ref.backward(dout)
    torch.testing.assert_close(whole[0], qr.grad, **F64)
    torch.testing.assert_close(whole[1], kr.grad, **F64)
    torch.testing.assert_close(whole[2], vr.grad, **F64)


def _count_tiles(monkeypatch) -> list[tuple[str, str, tuple[int, ...]]]:
    """Record (path, tile kind, key shape) of every tile the forward computes."""
    calls = []
    real = tiles.tile_forward

    def counting(path, q, k, v, tile, scale, h0, softcap=None, ws=None):
        calls.append((path, tile.kind, tuple(k.shape)))
        return real(path, q, k, v, tile, scale, h0, softcap, ws)

    monkeypatch.setattr(tiles, "tile_forward", counting)
    return calls


@pytest.mark.parametrize("path", TILE_PATHS)
def test_causal_tiles_above_the_diagonal_are_skipped(monkeypatch, path):
    calls = _count_tiles(monkeypatch)
    q = k = v = torch.randn(1, 1, 64, 8)
    kw = {"dropout_p": 0.0, "scale": 1.0, "block_q": 16, "block_k": 16, "tile_path": path}
    blockwise_attention(q, k, v, CausalMask(), **kw)
    causal = list(calls)
    calls.clear()
    blockwise_attention(q, k, v, None, **kw)
    # 4 x 4 tiles without a mask, 4 + 3 + 2 + 1 = 10 on and below the diagonal.
    assert (len(causal), len(calls)) == (10, 16)
    assert all(c[0] == path for c in causal + calls)
    # Both paths compute a diagonal square as a causal tile (the fused path with the op's
    # is_causal, the pure one with a fixed triangle, no mask from the mask object) ...
    assert sorted(c[1] for c in causal) == sorted(["full"] * 6 + ["causal"] * 4)
    # ... and pure tiles with more rows than keys take the mask's partial tiles instead.
    calls.clear()
    blockwise_attention(q, k, v, CausalMask(), **{**kw, "block_q": 32})
    if path == "pure":
        assert sorted(c[1] for c in calls) == sorted(["full"] * 2 + ["partial"] * 4)


@pytest.mark.parametrize("path", TILE_PATHS)
def test_chunked_tiles_across_chunks_are_skipped(monkeypatch, path):
    calls = _count_tiles(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 1, 64, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    kw = {"dropout_p": 0.0, "scale": 0.5, "block_q": 16, "block_k": 16, "tile_path": path}
    res = blockwise_attention(q, k, v, ChunkedMask(16), **kw)
    # Whole chunks of a square call are batch rows of one causal call: one diagonal square
    # for the 4 chunks together; nothing across chunks is computed.
    assert [(c[1], c[2]) for c in calls] == [("causal", (4, 1, 16, 8))]
    ref, _ = reference_attention(q, k, v, mask=ChunkedMask(16).dense(64, 64), scale=0.5)
    torch.testing.assert_close(res.output, ref, **F64)


@pytest.mark.parametrize(
    ("path", "extras"),
    [(p, e) for p in TILE_PATHS for e in ("plain", "sinks", "softcap")]
    if "fused" not in TILE_PATHS
    else [(p, e) for p in TILE_PATHS for e in ("plain", "sinks")] + [("pure", "softcap")],
)
def test_whole_chunks_folded_into_batch_rows_equal_the_reference_with_gradients(path, extras):
    """A square call of whole chunks runs as one causal call over chunk-sized batch rows:
    output, LSE and gradients equal the fp64 reference on the dense mask, with grouped
    key/value heads, two batch rows, and sinks or a soft-cap."""
    gen = torch.Generator().manual_seed(11)
    B, H, G, T, D, chunk = 2, 4, 2, 96, 8, 32

    def leaf(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64, requires_grad=True)

    q, k, v = leaf(B, H, T, D), leaf(B, G, T, D), leaf(B, G, T, D)
    sinks = leaf(H) if extras == "sinks" else None
    softcap = 2.0 if extras == "softcap" else None
    mask = ChunkedMask(chunk)
    kw = {"dropout_p": 0.0, "scale": 0.3, "tile_path": path, "softcap": softcap}
    res = blockwise_attention(q, k, v, mask, sinks=sinks, **kw)
    dense = mask.dense(T, T)
    ref, _ = reference_attention(q, k, v, mask=dense, scale=0.3, softcap=softcap, sinks=sinks)
    torch.testing.assert_close(res.output, ref, **F64)
    scores = q @ k.repeat_interleave(H // G, dim=1).transpose(-1, -2) * 0.3  # (B, H, T, T)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~dense, float("-inf"))
    if sinks is not None:  # the sink joins every row's softmax
        scores = torch.cat([scores, sinks.view(1, H, 1, 1).expand(B, H, T, 1)], dim=-1)
    torch.testing.assert_close(res.lse, torch.logsumexp(scores, dim=-1), **F64)
    leaves = (q, k, v) if sinks is None else (q, k, v, sinks)
    dout = torch.randn(res.output.shape, generator=gen, dtype=torch.float64)
    ours = torch.autograd.grad(res.output, leaves, dout)
    for a, b in zip(ours, torch.autograd.grad(ref, leaves, dout), strict=True):
        torch.testing.assert_close(a, b, **F64)


@pytest.mark.skipif("fused" not in TILE_PATHS, reason="no fused tile op in this PyTorch")
@pytest.mark.parametrize(("T", "S", "chunk"), [(600, 600, 128), (300, 700, 100), (1, 700, 128)])
def test_fused_chunked_default_tiles_are_one_causal_square_per_chunk(monkeypatch, T, S, chunk):
    """Default sizes on the fused path: one row block per chunk, its keys one causal square
    on the diagonal (the op's is_causal), nothing across chunks; equal to the reference,
    gradients too (T != S: bottom-right aligned)."""
    calls = _count_tiles(monkeypatch)
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(1, 2, T, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, S, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, S, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    mask = ChunkedMask(chunk)
    res = blockwise_attention(q, k, v, mask, dropout_p=0.0, scale=0.25, tile_path="fused")
    if (S - T) % chunk == 0:
        assert {c[1] for c in calls} == {"causal"}
        # per chunk, and per range of the 2 heads the pool's threads take (one with one thread)
        parts = max(1, min(torch.get_num_threads(), 2))
        assert len(calls) == math.ceil(T / chunk) * parts
    dout = torch.randn(res.output.shape, generator=gen, dtype=torch.float64)
    ours = torch.autograd.grad(res.output, (q, k, v), dout)
    ref, _ = reference_attention(q, k, v, mask=mask.dense(T, S), scale=0.25)
    torch.testing.assert_close(res.output, ref, **F64)
    for a, b in zip(ours, torch.autograd.grad(ref, (q, k, v), dout), strict=True):
        torch.testing.assert_close(a, b, **F64)


@pytest.mark.skipif("fused" not in TILE_PATHS, reason="no fused tile op in this PyTorch")
def test_fused_unmasked_and_causal_are_one_op_call_equal_to_torch(monkeypatch):
    """Without a mask or with a plain causal one (T == S), the fused path is one call of
    PyTorch's own kernel: bit-identical to F.scaled_dot_product_attention, gradients too;
    bottom-right causal with T < S is two tiles (keys before the diagonal, the diagonal),
    one query row (decoding) one."""
    calls = _count_tiles(monkeypatch)
    gen = torch.Generator().manual_seed(4)
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(1, 4, 300, 64, generator=gen).to(dtype) for _ in range(3))
        for causal in (False, True):
            qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
            qb, kb, vb = (t.clone().requires_grad_() for t in (q, k, v))
            calls.clear()
            mask = CausalMask() if causal else None
            ours = blockwise_attention(qa, ka, va, mask, dropout_p=0.0, scale=0.125).output
            theirs = F.scaled_dot_product_attention(qb, kb, vb, is_causal=causal, scale=0.125)
            assert [c[1] for c in calls] == ["causal" if causal else "full"]
            assert torch.equal(ours, theirs)
            dout = torch.randn(ours.shape, generator=gen).to(dtype)
            ours.backward(dout)
            theirs.backward(dout)
            for a, b in ((qa, qb), (ka, kb), (va, vb)):
                assert torch.equal(a.grad, b.grad)
    calls.clear()
    q = torch.randn(1, 2, 40, 16, dtype=torch.float64)
    k = v = torch.randn(1, 1, 100, 16, dtype=torch.float64)  # one key/value head group
    res = blockwise_attention(q, k, v, CausalMask(), dropout_p=0.0, scale=0.25)
    assert [(c[1], c[2][2]) for c in calls] == [("full", 60), ("causal", 40)]
    ref, _ = reference_attention(q, k, v, mask=CausalMask().dense(40, 100), scale=0.25)
    torch.testing.assert_close(res.output, ref, **F64)
    # Decoding one token against a cache: it sees every key, one full tile.
    calls.clear()
    res = blockwise_attention(q[:, :, -1:], k, v, CausalMask(), dropout_p=0.0, scale=0.25)
    assert [c[1] for c in calls] == ["full"]
    torch.testing.assert_close(res.output, ref[:, :, -1:], **F64)


@pytest.mark.parametrize("path", TILE_PATHS)
@pytest.mark.parametrize("kind", ["window", "padding_causal"])
def test_default_tiles_with_structured_masks_match_reference(path, kind):
    """Default tile sizes (runs of full fused tiles coalesce), T != S, GQA, fp64."""
    gen = torch.Generator().manual_seed(8)
    T, S = 530, 600
    q = torch.randn(2, 4, T, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, S, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, S, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    if kind == "window":
        mask = SlidingWindowMask(300)
    else:
        mask = PaddingMask.from_lengths([S, 410], S) & CausalMask()
    res = blockwise_attention(q, k, v, mask, dropout_p=0.0, scale=0.25, tile_path=path)
    dout = torch.randn(res.output.shape, generator=gen, dtype=torch.float64)
    res.output.backward(dout)
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref, _ = reference_attention(qr, kr, vr, mask=mask.dense(T, S), scale=0.25)
    ref.backward(dout)
    torch.testing.assert_close(res.output, ref, **F64)
    for a, b in ((q, qr), (k, kr), (v, vr)):
        torch.testing.assert_close(a.grad, b.grad, **F64)


def test_tile_path_choice_and_refusal():
    q = torch.randn(1, 2, 8, 16)
    k = torch.randn(1, 2, 8, 16)
    v = torch.randn(1, 2, 8, 12)  # Dv != D: the op cannot take it
    with pytest.raises(ValueError, match=r"tile_path='fused' cannot serve.*Dv=12"):
        blockwise_attention(q, k, v, None, dropout_p=0.0, scale=0.25, tile_path="fused")
    with pytest.raises(ValueError, match=r"`path` must be 'fused', 'pure' or None"):
        force_tile_path("flash")  # type: ignore[arg-type]
    # Unforced, such a call falls back to the pure tiles (and is right).
    res = blockwise_attention(q, k, v, None, dropout_p=0.0, scale=0.25)
    ref, _ = reference_attention(q, k, v, scale=0.25)
    torch.testing.assert_close(res.output.double(), ref, **tol(torch.float32))


@pytest.mark.parametrize("path", TILE_PATHS)
@pytest.mark.parametrize("mask", [CausalMask(), SlidingWindowMask(200)], ids=["causal", "window"])
def test_training_memory_grows_linearly(path, mask):
    """Forward + backward peak memory: doubling T at most doubles it (no T x S)."""

    def peak(T: int, backend: str = "blockwise") -> int:
        q, k, v = (torch.randn(1, 2, T, 32, requires_grad=True) for _ in range(3))

        def step():
            if backend == "math":
                out = scaled_dot_product_attention(q, k, v, mask, backend="math")
            else:
                # Pure tiles grow with T up to 2048 rows for 2 heads: fix them at 512.
                out = blockwise_attention(q, k, v, mask, dropout_p=0.0, scale=0.2,
                                          tile_path=path, block_q=512 if path == "pure" else None
                                          ).output  # fmt: skip
            out.sum().backward()

        return peak_allocated(step)[1]

    p1, p2 = peak(1024), peak(2048)
    assert p2 <= 2.1 * p1, (p1, p2)
    one_score_matrix = 2 * 2048 * 2048 * 4  # one fp32 T x S matrix per head
    assert p2 < one_score_matrix / 2
    # Positive controls: the meter sees what the step allocates -- at least the output and
    # the three input gradients (4 x (1, 2, T, 32) fp32) -- and it sees a T x S matrix when
    # one is made: the materialising math backend on the same step passes the bound above.
    assert p2 >= 4 * 2 * 2048 * 32 * 4, p2
    assert peak(2048, "math") >= one_score_matrix, "math's T x S weights went unseen"


# -- Biases constant over a tile (T5 beyond max_distance): "shifted" tiles -----------------


def _t5_case(bidirectional: bool, causal: bool, sinks: bool, docs: bool, dtype, T=61, S=61):
    """Inputs, attnlab mask and fp64 reference pieces for a T5 bias with small blocks."""
    from attnlab.biases import RelativePositionBias
    from attnlab.masks import DocumentMask
    from reference import t5_relative_bucket

    gen = torch.Generator().manual_seed(7)
    Bt, Ht, Gt, D = 2, 4, 2, 16
    q = torch.randn(Bt, Ht, T, D, generator=gen).to(dtype).requires_grad_()
    k = torch.randn(Bt, Gt, S, D, generator=gen).to(dtype).requires_grad_()
    v = torch.randn(Bt, Gt, S, D, generator=gen).to(dtype).requires_grad_()
    dout = torch.randn(Bt, Ht, T, D, generator=gen).to(dtype)
    pdt = torch.float64 if dtype == torch.float64 else torch.float32
    table = torch.randn(8, Ht, generator=gen).to(pdt).requires_grad_()
    sink = torch.randn(Ht, generator=gen).to(pdt).requires_grad_() if sinks else None
    mask = RelativePositionBias(table, bidirectional=bidirectional, num_buckets=8, max_distance=12)
    qpos, kpos = (torch.arange(T) + S - T)[:, None], torch.arange(S)[None, :]
    allowed = torch.ones(Bt, 1, T, S, dtype=torch.bool)
    if causal:
        mask = mask & CausalMask()
        allowed &= kpos <= qpos
    if docs:
        ids = torch.tensor([0] * 20 + [1] * (T - 20))[None].expand(Bt, T)
        mask = mask & DocumentMask(ids)
        allowed &= (ids[:, :, None] == ids[:, None, :])[:, None]
    bucket = t5_relative_bucket(kpos - qpos, bidirectional, 8, 12)  # (T, S)
    return q, k, v, dout, table, sink, mask, allowed, bucket


@pytest.mark.parametrize("path", TILE_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize(
    "case", ["bidirectional", "causal", "causal+sinks", "bidirectional+docs+sinks"]
)
def test_t5_bias_far_tiles_are_shifted_tiles_matching_reference(monkeypatch, case, dtype, path):
    """Beyond max_distance T5's bias is one number per head: those tiles run unmasked (on the
    fused path: the op without a dense bias) with the number added to their log-sum-exp,
    and the table's gradient for that bucket comes from the row sums of dS. Output and
    every gradient (q, k, v, table, sinks) against the fp64 reference."""
    from test_backends import grad_tol

    calls = _count_tiles(monkeypatch)
    parts = set(case.split("+"))
    q, k, v, dout, table, sink, mask, allowed, bucket = _t5_case(
        "bidirectional" in parts, "causal" in parts, "sinks" in parts, "docs" in parts, dtype
    )
    out = blockwise_attention(
        q, k, v, mask, dropout_p=0.0, scale=0.25, sinks=sink, block_q=8, block_k=8, tile_path=path
    ).output
    out.backward(dout)
    assert "shifted" in {c[1] for c in calls}  # the far tiles took the shifted form
    assert all(c[0] == path for c in calls)

    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    tr = table.detach().double().requires_grad_()
    sr = None if sink is None else sink.detach().double().requires_grad_()
    bias = tr[bucket].permute(2, 0, 1)[None]  # (1, H, T, S)
    ref, _ = reference_attention(qr, kr, vr, mask=allowed, bias=bias, scale=0.25, sinks=sr)
    ref.backward(dout.double())
    torch.testing.assert_close(out.double(), ref, **tol(dtype))
    pairs = [("q", q, qr), ("k", k, kr), ("v", v, vr), ("table", table, tr)]
    if sink is not None:
        pairs.append(("sinks", sink, sr))
    for name, t, r in pairs:
        assert t.grad is not None and torch.isfinite(t.grad).all(), name
        torch.testing.assert_close(t.grad.double(), r.grad, **grad_tol(dtype), msg=name)


# -- ALiBi on the fused path as one more head dim -------------------------------------------


@pytest.mark.parametrize("path", TILE_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize(("T", "S", "causal"), [(61, 61, True), (29, 75, True), (40, 33, False)])
def test_alibi_in_row_blocks_matches_reference(monkeypatch, T, S, causal, dtype, path):
    """ALiBi (& causal) in many row blocks: on fused fp32/fp64 tiles it runs as one more head
    dim (the op sees D + 1), centred on each row block; output, log-sum-exp and gradients
    against the fp64 reference (the bias written from the published slopes)."""
    from test_backends import grad_tol

    from attnlab.biases import AlibiBias

    calls = _count_tiles(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    Bt, Ht, Gt, D = 2, 4, 2, 16
    q = (torch.randn(Bt, Ht, T, D, generator=gen) * 2).to(dtype).requires_grad_()
    k = (torch.randn(Bt, Gt, S, D, generator=gen) * 2).to(dtype).requires_grad_()
    v = torch.randn(Bt, Gt, S, D, generator=gen).to(dtype).requires_grad_()
    dout = torch.randn(Bt, Ht, T, D, generator=gen).to(dtype)
    mask = AlibiBias(Ht) & CausalMask() if causal else AlibiBias(Ht)
    res = blockwise_attention(q, k, v, mask, dropout_p=0.0, scale=0.25, block_q=8, block_k=8,
                              tile_path=path)  # fmt: skip
    res.output.backward(dout)
    widened = path == "fused" and dtype != torch.bfloat16
    assert {c[2][-1] for c in calls} == {D + 1 if widened else D}
    assert res.output.shape == (Bt, Ht, T, D)

    slopes = torch.tensor([2.0 ** (-8 * (h + 1) / Ht) for h in range(Ht)], dtype=torch.float64)
    qpos, kpos = (torch.arange(T) + S - T)[:, None], torch.arange(S)[None, :]
    bias = (-slopes[:, None, None] * (qpos - kpos))[None]  # (1, H, T, S)
    allowed = (kpos <= qpos)[None, None] if causal else None
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = reference_attention(qr, kr, vr, mask=allowed, bias=bias, scale=0.25)
    ref.backward(dout.double())
    torch.testing.assert_close(res.output.double(), ref, **tol(dtype))
    scores = (qr.detach() @ kr.detach().repeat_interleave(2, 1).transpose(-2, -1)) * 0.25 + bias
    if allowed is not None:
        scores = scores.masked_fill(~allowed, -math.inf)
    ref_lse = torch.logsumexp(scores, dim=-1)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(res.lse), seen)
    torch.testing.assert_close(res.lse.double()[seen], ref_lse[seen], **tol(dtype))
    for name, t, r in (("q", q, qr), ("k", k, kr), ("v", v, vr)):
        assert t.grad is not None and torch.isfinite(t.grad).all(), name
        torch.testing.assert_close(t.grad.double(), r.grad, **grad_tol(dtype), msg=name)


@pytest.mark.skipif("fused" not in TILE_PATHS, reason="no fused tile op in this PyTorch")
def test_alibi_exact_weights_across_default_row_blocks_with_sinks():
    """Default blocks (1024-row blocks for ALiBi as one more head dim), T = 2100 so that rows
    fall in three blocks: exact weights of rows in each block, with sinks, read from the
    saved log-sum-exp, against the fp64 reference computed for those rows."""
    from attnlab.backends import WeightsRequest
    from attnlab.biases import AlibiBias
    from attnlab.functional import scaled_dot_product_attention

    gen = torch.Generator().manual_seed(5)
    T, Hn, D = 2100, 2, 16
    q, k, v = (torch.randn(1, Hn, T, D, generator=gen) for _ in range(3))
    sinks = torch.randn(Hn, generator=gen)
    rows = [0, 1023, 1024, 1500, 2099]
    req = WeightsRequest(heads=(1, 0), rows=tuple(rows))
    out, w = scaled_dot_product_attention(q, k, v, AlibiBias(Hn) & CausalMask(), sinks=sinks,
                                          backend="blockwise", need_weights=req)  # fmt: skip
    slopes = torch.tensor([2.0**-4, 2.0**-8], dtype=torch.float64)  # published, H = 2
    qpos, kpos = torch.tensor(rows)[:, None], torch.arange(T)[None, :]
    bias = (-slopes[:, None, None] * (qpos - kpos))[None]  # (1, H, rows, T)
    ref_out, ref_w = reference_attention(q[:, :, rows], k, v, mask=(kpos <= qpos)[None, None],
                                         bias=bias, sinks=sinks)  # fmt: skip
    torch.testing.assert_close(w, ref_w[:, [1, 0]].float(), **tol(torch.float32))
    torch.testing.assert_close(out[:, :, rows].double(), ref_out, **tol(torch.float32))


def _record_capped(monkeypatch) -> list[bool]:
    """Record what each soft-capped row block without a maximum returned (False: it fell
    back to the general tiles)."""
    results = []
    real = tiles.capped_row_block

    def recording(*args, **kwargs):
        results.append(real(*args, **kwargs))
        return results[-1]

    monkeypatch.setattr(tiles, "capped_row_block", recording)
    return results


@pytest.mark.parametrize("compiled", [False, True], ids=["torch-passes", "compiled-pass"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("softcap", [1.5, 60.0])
@pytest.mark.parametrize("kind", ["causal", "window", "padding"])
def test_softcap_row_blocks_without_a_maximum_match_reference(
    request, monkeypatch, kind, softcap, dtype, compiled
):
    """Soft-capped pure tiles share one reference (the cap) instead of a row maximum, and
    add up instead of merging: outputs, lse and gradients against the fp64 reference over
    many tiles, GQA, a padded-out row (0 and -inf), T != S. Both ways of computing a
    tile's probabilities: PyTorch's passes, and the compiled module's one pass (float32
    compute only; native/capped.h)."""
    if compiled:
        request.getfixturevalue("ext")  # loaded, or the test skips naming why
    else:
        monkeypatch.setattr(native, "loaded", lambda: None)
    T, S, H, G = 37, 45, 4, 2
    gen = torch.Generator().manual_seed(7)
    q = (torch.randn(2, H, T, 8, generator=gen, dtype=torch.float64) * 3).to(dtype)
    k = (torch.randn(2, G, S, 8, generator=gen, dtype=torch.float64) * 3).to(dtype)
    v = torch.randn(2, G, S, 8, generator=gen, dtype=torch.float64).to(dtype)
    valid = torch.ones(2, S, dtype=torch.bool)
    valid[1, 30:] = False
    mask = {
        "causal": CausalMask(),
        "window": SlidingWindowMask(11),
        "padding": PaddingMask(valid) & CausalMask(),
    }[kind]
    if kind == "padding":  # batch 1's first rows see only padded keys: nothing at all
        valid[1, :12] = False
        mask = PaddingMask(valid) & CausalMask()
    results = _record_capped(monkeypatch)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    res = blockwise_attention(qg, kg, vg, mask, dropout_p=0.0, scale=0.5, softcap=softcap,
                              block_q=8, block_k=8, tile_path="pure")  # fmt: skip
    dout = torch.randn(res.output.shape, generator=gen, dtype=torch.float64).to(dtype)
    res.output.backward(dout)
    # No fallback, except where a cap above 43 (fp32) meets rows that see nothing: their
    # sum is 0, as an underflowed row's would be.
    assert results
    assert all(results) or (kind == "padding" and softcap == 60.0 and dtype != torch.float64)
    r = [t.double().clone().requires_grad_() for t in (q, k, v)]
    rk, rv = (t.repeat_interleave(H // G, dim=1) for t in r[1:])
    dense = mask.dense(T, S).expand(2, 1, T, S)
    ref, _ = reference_attention(r[0], rk, rv, mask=dense, scale=0.5, softcap=softcap)
    ref.backward(dout.double())
    t = tol(dtype)
    torch.testing.assert_close(res.output.double(), ref, **t)
    for got, want in zip((qg, kg, vg), r, strict=True):
        # Gradients round at their own size (here up to ~13): scale the tolerance.
        size = float(want.grad.abs().max())
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=t["rtol"],
                                   atol=t["atol"] * max(1.0, size))  # fmt: skip
    if kind == "padding":
        empty = ~dense[1, 0].any(dim=-1)  # (T,) rows that see nothing
        assert bool(empty.any())
        assert bool((res.output[1][:, empty] == 0).all())
        assert bool((res.lse[1][:, empty] == -math.inf).all())


def test_softcap_rows_that_would_underflow_take_the_general_tiles(monkeypatch):
    """With a cap above ~43, fp32 probabilities measured against the cap can underflow:
    a row whose scores all sit near -c. Those row blocks run through the general tiles."""
    q = torch.full((1, 1, 8, 16), 10.0)
    k = torch.full((1, 1, 8, 16), -10.0)  # every score -1600 * 0.25 = -400: -c tanh(4)
    v = torch.randn(1, 1, 8, 16, generator=torch.Generator().manual_seed(0))
    results = _record_capped(monkeypatch)
    res = blockwise_attention(
        q, k, v, CausalMask(), dropout_p=0.0, scale=0.25, softcap=100.0, tile_path="pure"
    )
    assert results == [False]
    # Equal scores: each row averages the values it sees.
    want = v.cumsum(dim=2) / torch.arange(1, 9).view(1, 1, 8, 1)
    torch.testing.assert_close(res.output, want)
    dense = CausalMask().dense(8, 8)
    ref, _ = reference_attention(
        q.double(), k.double(), v.double(), mask=dense, scale=0.25, softcap=100.0
    )
    torch.testing.assert_close(res.output.double(), ref, **tol(torch.float32))


@pytest.mark.skipif("fused" not in TILE_PATHS, reason="no fused tile op in this PyTorch")
def test_narrow_masks_take_smaller_row_blocks():
    """A mask whose rows see a narrow band of keys (a window) plans row blocks of 128;
    masks with wide rows, and biases, keep 256 (both measured faster so)."""
    q = k = v = torch.randn(1, 2, 2048, 8)
    valid = torch.ones(1, 2048, dtype=torch.bool)
    valid[:, 1900:] = False

    def rows(mask):
        plan = chunk.prepare(q, k, v, mask, ChunkOptions()).plan
        return {rb.r1 - rb.r0 for rb in plan}

    assert rows(SlidingWindowMask(512)) == {128}
    assert rows(PaddingMask(valid) & CausalMask()) == {256}
    from attnlab.biases import RelativePositionBias

    table = torch.randn(32, 2)
    assert rows(RelativePositionBias(table, bidirectional=False) & CausalMask()) == {256}


def _count_band_calls(monkeypatch) -> list[tuple[int, ...]]:
    """Record the query shape of every band call (the op's batch dim holds the blocks)."""
    from attnlab.backends.blockwise import band

    calls = []
    real = band.FUSED_OPS

    def counting(q, *args, **kw):
        calls.append(tuple(q.shape))
        return real[0](q, *args, **kw)

    monkeypatch.setattr(band, "FUSED_OPS", (counting, real[1]))
    return calls


@pytest.mark.skipif("fused" not in TILE_PATHS, reason="no fused tile op in this PyTorch")
@pytest.mark.parametrize(
    ("T", "S", "mask"),
    [
        (700, 700, SlidingWindowMask(100)),
        (500, 900, SlidingWindowMask(64)),  # bottom-right: rows start 400 keys in
        (900, 500, SlidingWindowMask(64, alignment="top_left")),  # rows past the keys
        (900, 500, SlidingWindowMask(64)),  # the first 400 rows see nothing
        (600, 600, SlidingWindowMask(50, causal=False)),
        (800, 800, SlidingWindowMask(600) & CausalMask()),  # blocks of 64
        (300, 1000, SlidingWindowMask(40, alignment="top_left") & CausalMask("top_left")),
    ],
    ids=["square", "T<S", "top-left T>S", "T>S empty rows", "two-sided", "and causal", "top-left"],
)
def test_band_interior_is_one_op_call_matching_reference(monkeypatch, T, S, mask):
    """A narrow window's interior rows run as one op call with the row blocks in its batch
    dim; the rows above and below as tiles. Output, lse (-inf for rows that see nothing)
    and gradients (the tiles' backward from that lse) equal the reference, fp64, GQA."""
    calls = _count_band_calls(monkeypatch)
    gen = torch.Generator().manual_seed(12)
    q = torch.randn(2, 4, T, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, S, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, S, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    res = blockwise_attention(q, k, v, mask, dropout_p=0.0, scale=0.25, tile_path="fused")
    run = BandRun.of(mask, ChunkOptions(), T, S)
    assert run is not None and run.n >= 2
    assert calls == [(run.n, 4, run.bq, 16)] * 2  # one call per batch row
    dense = mask.dense(T, S)
    ref, _ = reference_attention(q, k, v, mask=dense, scale=0.25)
    torch.testing.assert_close(res.output, ref, **F64)
    s = (q.detach() @ k.detach().repeat_interleave(2, dim=1).transpose(-2, -1)) * 0.25
    want = torch.logsumexp(s.masked_fill(~dense, -math.inf), dim=-1)
    torch.testing.assert_close(res.lse, want, **F64)
    dout = torch.randn(res.output.shape, generator=gen, dtype=torch.float64)
    ours = torch.autograd.grad(res.output, (q, k, v), dout)
    for a, b in zip(ours, torch.autograd.grad(ref, (q, k, v), dout), strict=True):
        torch.testing.assert_close(a, b, **F64)


@pytest.mark.skipif("fused" not in TILE_PATHS, reason="no fused tile op in this PyTorch")
def test_band_run_only_for_narrow_unbiased_bands_with_default_tiles():
    T = S = 4096
    assert BandRun.of(SlidingWindowMask(512), ChunkOptions(), T, S) == BandRun(511, 56, 64, 0, 512)
    assert BandRun.of(SlidingWindowMask(128), ChunkOptions(), T, S).bq == 32
    assert BandRun.of(SlidingWindowMask(2048), ChunkOptions(), T, S) is None  # tiles as fast
    assert BandRun.of(CausalMask(), ChunkOptions(), T, S) is None
    assert BandRun.of(SlidingWindowMask(64), ChunkOptions(block_q=64), T, S) is None
    assert BandRun.of(SlidingWindowMask(64), ChunkOptions(), 90, 90) is None  # < 2 blocks
    from attnlab.biases import AlibiBias

    assert BandRun.of(AlibiBias(2) & SlidingWindowMask(64), ChunkOptions(), T, S) is None
    # A chunk in the middle of the problem (ring attention): its own offsets.
    mid = ChunkOptions(q_offset=1024, k_offset=512, T_total=T, S_total=S)
    assert BandRun.of(SlidingWindowMask(512), mid, 1024, 1024) == BandRun(0, 8, 64, 1, 512)


@pytest.mark.skipif(not torch.set_flush_denormal(False), reason="no subnormal flushing here")
def test_tiles_run_with_subnormals_flushed_and_the_caller_keeps_its_setting(monkeypatch):
    """ALiBi's far keys underflow; on Intel cores subnormals are slow, so the tile workers
    flush them (a weight below 2^-126 of the row's largest); the caller's thread is as
    it was."""
    from attnlab._threads import _flushing
    from attnlab.biases import AlibiBias

    seen = []
    real = tiles.tile_forward

    def recording(*args, **kw):
        seen.append(_flushing())
        return real(*args, **kw)

    monkeypatch.setattr(tiles, "tile_forward", recording)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 4, 300, 16, generator=gen) for _ in range(3))
    mask = AlibiBias(4) & CausalMask()
    res = blockwise_attention(q, k, v, mask, dropout_p=0.0, scale=0.25)
    assert seen and all(seen)
    assert not _flushing()
    # Steep heads: most weights of a row are far below 2^-126 (slope 1/4: e^-70 at 280)
    slopes = torch.tensor([2.0 ** (-8 * (h + 1) / 4) for h in range(4)], dtype=torch.float64)
    pos = torch.arange(300)
    bias = (-slopes[:, None, None] * (pos[:, None] - pos[None, :]))[None]
    allowed = (pos[None, :] <= pos[:, None])[None, None]
    ref, _ = reference_attention(
        q.double(), k.double(), v.double(), mask=allowed, bias=bias, scale=0.25
    )
    torch.testing.assert_close(res.output.double(), ref, **tol(torch.float32))


@pytest.mark.skipif("fused" not in TILE_PATHS, reason="no fused tile op in this PyTorch")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize(("T", "S", "G"), [(3000, 3000, 4), (2500, 3100, 2)])
def test_alibi_steep_heads_leave_out_keys_of_no_weight(monkeypatch, T, S, G, dtype):
    """A steep ALiBi head's keys far before a row block weigh under e^-110 of each row's own
    key: they are left out of its op calls (fewer keys than the rows' diagonal), shallow
    heads keep every key; output and lse equal the fp64 reference (which has them all)."""
    from attnlab.biases import AlibiBias

    calls = _count_tiles(monkeypatch)
    gen = torch.Generator().manual_seed(9)
    H, D = 4, 16
    q = torch.randn(1, H, T, D, generator=gen, dtype=dtype)
    k = torch.randn(1, G, S, D, generator=gen, dtype=dtype)
    v = torch.randn(1, G, S, D, generator=gen, dtype=dtype)
    mask = AlibiBias(H) & CausalMask()
    res = blockwise_attention(q, k, v, mask, dropout_p=0.0, scale=0.25)
    full = [c for c in calls if c[1] == "full"]
    last_rows = S - (T - T // 1024 * 1024)  # keys before the last row block's diagonal
    assert min(c[2][2] for c in full) < max(c[2][2] for c in full) == last_rows
    slopes = torch.tensor([2.0 ** (-8 * (h + 1) / H) for h in range(H)], dtype=torch.float64)
    qpos, kpos = (torch.arange(T) + S - T)[:, None], torch.arange(S)[None, :]
    bias = (-slopes[:, None, None] * (qpos - kpos))[None]  # (1, H, T, S)
    allowed = (kpos <= qpos)[None, None]
    ref, _ = reference_attention(q.double(), k.double(), v.double(), mask=allowed, bias=bias,
                                 scale=0.25)  # fmt: skip
    torch.testing.assert_close(res.output.double(), ref, **tol(dtype))
    s = q.double() @ k.double().repeat_interleave(H // G, dim=1).transpose(-2, -1) * 0.25
    want = torch.logsumexp((s + bias).masked_fill(~allowed, -math.inf), dim=-1)
    torch.testing.assert_close(res.lse.double(), want, **tol(dtype))
