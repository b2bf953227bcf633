"""The compiled step's attention over the cache (``attnlab/native/attend.h``, bound as
``attend``) against the float64 reference, within the float32 bound derived below.

At depth each group's positions are cut into chunks of ``ATTEND_CHUNK`` whose partial
softmaxes are merged; the chunks, not the threads, decide the numbers, so a wrong merge
or a lost position shows at any thread count.
"""

from __future__ import annotations

import pytest
import torch

from reference import reference_attention

U = 2.0**-24  # float32's unit roundoff


def _gamma(n: int) -> float:
    """The classic bound on the relative error of a float32 sum or dot of n terms."""
    return n * U / (1 - n * U)


def _bound(q, k, v, s0: int, S: int, scale: float, chunk: int) -> torch.Tensor:
    """Per output value (B, H, D): how far attend's float32 result may be from the exact one.

    Scores: a dot of D float32 products in any order, then the scale: |error| <= gamma(D + 1)
    |scale| sum_d |q_d k_d|. The exponent's argument z - m rounds once (u R, R the score
    range), exp_fast is within 2 ulp (4u here), and the merge's factor exp(m_c - M) errs
    as much again: each weight's numerator is off by a factor within exp(+-delta), delta the
    sum, so each normalised weight by exp(+-2 delta), and the output by (exp(2 delta) - 1)
    sum_s w_s |v_s|. Sums: a chunk's n terms for the denominator and for each output value,
    the merge's C chunks twice and its division: (2 gamma(n) + 2 gamma(C + 2) + u) of the
    same sum_s w_s |v_s|.
    """
    _, H, D = q.shape
    G = k.shape[1]
    kk = k[:, :, s0:S].double().repeat_interleave(H // G, 1)  # (B, H, S', D)
    vv = v[:, :, s0:S].double().repeat_interleave(H // G, 1)
    z = torch.einsum("bhd,bhsd->bhs", q.double(), kk) * scale  # (B, H, S')
    mag = torch.einsum("bhd,bhsd->bhs", q.double().abs(), kk.abs()) * abs(scale)
    spread = z.amax(-1) - z.amin(-1)  # (B, H)
    delta = _gamma(D + 1) * mag.amax(-1) + 2 * (U * spread + 4 * U)  # (B, H)
    n, chunks = min(S - s0, chunk), -(-(S - s0) // chunk)
    sums = 2 * _gamma(n) + 2 * _gamma(chunks + 2) + U
    w_abs_v = torch.einsum("bhs,bhsd->bhd", z.softmax(-1), vv.abs())  # (B, H, D)
    rel = torch.expm1(2 * delta)[..., None] + sums
    return rel * w_abs_v * (1 + 1e-3) + 1e-30  # slack for the bound's second-order terms


def _check(ext, q, k, v, s0: int, S: int, scale: float) -> torch.Tensor:
    got = ext.attend(q, k, v, s0, S, scale)  # (B, H, D)
    want, _ = reference_attention(q[:, :, None], k[:, :, s0:S], v[:, :, s0:S], scale=scale)
    err = (got.double() - want[:, :, 0]).abs()
    bound = _bound(q, k, v, s0, S, scale, ext.ATTEND_CHUNK)
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"error {worst:.3g} x the float32 bound (s0={s0}, S={S})"
    return got


def _inputs(B: int, H: int, G: int, D: int, max_len: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, D, generator=g)
    k = torch.randn(B, G, max_len, D, generator=g)
    v = torch.randn(B, G, max_len, D, generator=g)
    return q, k, v


# (B, H, G, D, max_len, s0, S): SmolLM2's heads (H/G = 3, D 64) and Gemma 3's (one group of
# 4, D 256) at depth, in whole chunks and with a short last one; a sliding window whose
# start is not a chunk's; two rows; head dims that are not a multiple of the vector width
# (the plain loops); short caches of one chunk, a part of a vector and a single position.
SHAPES = [
    (1, 9, 3, 64, 2100, 0, 2048),
    (2, 9, 3, 64, 800, 0, 700),
    (1, 4, 1, 256, 1300, 0, 1300),
    (2, 4, 1, 256, 1200, 1200 - 512, 1200),
    (2, 8, 2, 32, 1000, 333, 999),
    (2, 6, 2, 40, 600, 17, 530),
    (1, 3, 1, 36, 300, 0, 290),
    (2, 4, 2, 64, 40, 0, 37),
    (1, 2, 1, 16, 8, 0, 5),
    (1, 1, 1, 8, 1, 0, 1),
]


@pytest.mark.parametrize(("B", "H", "G", "D", "max_len", "s0", "S"), SHAPES)
def test_attend_is_the_float64_attention_within_the_float32_bound(ext, B, H, G, D, max_len, s0, S):
    q, k, v = _inputs(B, H, G, D, max_len, seed=S + D)
    _check(ext, q, k, v, s0, S, D**-0.5)


def test_a_peaked_softmax_across_chunks_merges_to_the_right_weights(ext):
    """The largest scores of each head sit in different chunks (the first, a middle one,
    the last and short one, the chunk boundary on either side): every chunk's partial
    softmax must be rescaled to the common maximum, else whole chunks are weighted wrong."""
    chunk = ext.ATTEND_CHUNK
    B, H, G, D, S = 2, 8, 2, 64, 3 * chunk + 40
    q, k, v = _inputs(B, H, G, D, S, seed=11)
    spots = [3, chunk - 1, chunk, 2 * chunk + 5, S - 1]
    for b in range(B):
        for h in range(H):
            g = h // (H // G)
            spot = spots[(b + h) % len(spots)]
            k[b, g, spot] += 1.5 * q[b, h]  # a score larger by 1.5 |q|^2 / 8, about 12
    out = _check(ext, q, k, v, 0, S, D**-0.5)
    _, weights = reference_attention(q[:, :, None], k, v, scale=D**-0.5)
    assert weights.amax(-1).min() > 0.5  # the planted keys dominate: a peaked softmax
    assert out.isfinite().all()


def test_the_threads_share_the_chunks_without_changing_a_bit(ext):
    """One group and one row at depth (Gemma 3's shape): its chunks are the only work to
    share, and two threads take them; the numbers are the one thread's exactly."""
    q, k, v = _inputs(1, 4, 1, 256, 2048, seed=3)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _check(ext, q, k, v, 0, 2048, 0.0625)
        torch.set_num_threads(2)
        two = _check(ext, q, k, v, 0, 2048, 0.0625)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_attend_refuses_what_it_cannot_read(ext):
    q, k, v = _inputs(1, 4, 2, 32, 16, seed=0)
    with pytest.raises(RuntimeError, match="positions"):
        ext.attend(q, k, v, 0, 17, 1.0)
    with pytest.raises(RuntimeError, match="heads in"):
        ext.attend(q[:, :3], k, v, 0, 8, 1.0)
    with pytest.raises(RuntimeError, match="contiguous"):
        ext.attend(q, k.transpose(2, 3), v, 0, 8, 1.0)


@pytest.mark.parametrize(("B", "H", "G", "D", "max_len", "s0", "S"), SHAPES)
def test_a_float16_cache_is_read_as_the_float32_values_it_holds(ext, B, H, G, D, max_len, s0, S):
    """Each float16 value is widened exactly as it is loaded and the math after is the
    float32 one: within the float32 bound of the exact attention over the values held,
    and, on the vector loops (a build with AVX2 or AVX-512, D a multiple of the vector
    width), the same bits as float32 caches holding those values. The plain loops are
    compiled once for each element type, and the compiler may fuse their products and
    sums differently in the two."""
    q, k, v = _inputs(B, H, G, D, max_len, seed=S + D + 1)
    k16, v16 = k.half(), v.half()
    got = ext.attend(q, k16, v16, s0, S, D**-0.5)
    want = _check(ext, q, k16.float(), v16.float(), s0, S, D**-0.5)
    err = (
        got.double()
        - reference_attention(
            q[:, :, None], k16[:, :, s0:S].double(), v16[:, :, s0:S].double(), scale=D**-0.5
        )[0][:, :, 0]
    ).abs()
    bound = _bound(q, k16.float(), v16.float(), s0, S, D**-0.5, ext.ATTEND_CHUNK)
    assert (err / bound).max().item() <= 1.0
    if ext.SIMD != "scalar" and D % 16 == 0:
        assert torch.equal(got, want)


def test_attend_refuses_keys_and_values_of_two_dtypes(ext):
    q, k, v = _inputs(1, 4, 2, 32, 16, seed=0)
    with pytest.raises(RuntimeError, match="both float32 or both float16"):
        ext.attend(q, k.half(), v, 0, 8, 1.0)
    with pytest.raises(RuntimeError, match="both float32 or both float16"):
        ext.attend(q, k.bfloat16(), v.bfloat16(), 0, 8, 1.0)
