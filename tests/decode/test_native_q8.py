"""attnlab's Q8_0 product (``attnlab/native/q8_0.h``) against a float64 product of the
weight it holds and against the same product of x quantised as the kernel quantises it,
and :class:`attnlab.quant.Q8Linear`'s two paths (the native kernel, and PyTorch's int4
kernel on the codes' 4-bit halves where the native build is unavailable)."""

from __future__ import annotations

import pytest
import torch

from attnlab import native
from attnlab.quant import NATIVE_Q8, Q8Linear, decode_product


def _layer(N: int, K: int, scale_dtype: torch.dtype, seed: int) -> Q8Linear:
    """Random codes over the whole range (-127 and 127 included) and scales of several
    magnitudes, float16 ones down to the subnormal."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    codes[0, :2] = torch.tensor([-127, 127], dtype=torch.int8)
    powers = torch.randint(-6, 0, (N, K // 32), generator=g)
    scales = torch.rand(N, K // 32, generator=g) * 10.0**powers
    return Q8Linear(codes, scales.to(scale_dtype))


#: The kernel's activation codes: each 32-block of x as round(x / max|x| * LEVELS).
LEVELS = 32767
#: Float32's unit roundoff.
U = 2.0**-24


def _quantise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) as ``q8_0.h`` quantises it, in the same float32 operations: codes p (M, K)
    (integers in float64) and scales e (M, K/32) float32; an all-zero block has codes 0 and
    e = 0."""
    M, K = x.shape
    xb = x.float().view(M, K // 32, 32)  # (M, G, 32)
    a = xb.abs().amax(-1, keepdim=True)  # (M, G, 1)
    safe = torch.where(a > 0, a, torch.ones_like(a))
    p = torch.round((xb / safe) * LEVELS)  # float32 division and product; half to even
    p = torch.where(a > 0, p, torch.zeros_like(p))
    return p.view(M, K).double(), (a / LEVELS).squeeze(-1)


def _bound(
    x: torch.Tensor, layer: Q8Linear, reference: torch.Tensor, out: torch.dtype
) -> torch.Tensor:
    """The kernel's error bound against ``x @ W^T`` in float64 (``q8_0.h``'s header):

    - x's quantisation: per value at most 0.506 e (e = max|x| / 32767 of its block: half a
      step, and three float32 roundings of at most 2^-24 * 32767 e each), so per output
      0.506 / 32767 * sum over blocks of max|x| * sum |w|;
    - the float32 sums of the blocks' scaled integer sums: K * 2^-23 of sum |x w| covers
      any order (the terms are the quantised x's, within the term above of |x|'s);
    - the output's rounding (bf16: 2^-8 of the value)."""
    M, K = x.shape
    N = layer.codes.shape[0]
    magnitude = x.double().abs() @ layer.weight.double().abs().t()  # (M, N)
    block_max = x.double().abs().view(M, K // 32, 32).amax(-1)  # (M, G)
    block_w = layer.weight.double().abs().view(N, K // 32, 32).sum(-1)  # (N, G)
    quantised = (0.5 + 3 * U * LEVELS) * (1 + U) / LEVELS * (block_max @ block_w.t())
    sums = K * 2**-23 * (magnitude + quantised)
    rounding = 2**-8 if out == torch.bfloat16 else 2**-24
    return quantised + sums + rounding * reference.abs() + 1e-30


def _quantised_product_bound(
    p: torch.Tensor, e: torch.Tensor, layer: Q8Linear, reference: torch.Tensor, out: torch.dtype
) -> torch.Tensor:
    """The kernel's error bound against the float64 product of x's codes (``_quantise``):
    each integer block sum is exact (the SIMD branches' partial sums are below 2^24, exact
    in float32), so what is left is float32's: the block scale d * e rounded once, and at
    most G + 4 roundings of the sums (AVX-512: G multiply-adds in a chain, then 4 adds of
    the 16 lanes; AVX2 3 of 8; the plain loop the sum's conversion, its product and G
    adds), so gamma(G + 5) of the sum of the terms' magnitudes. Where a result is
    subnormal (the tiny block's: e itself is) a rounding errs by up to 2^-150 absolute
    instead: the block scale's times its |S|, and one for each of the at most 16 (G + 5)
    roundings of sums. Plus the output's rounding (bf16: 2^-8 of the value)."""
    M, K = p.shape
    N, G = layer.codes.shape[0], K // 32
    n = G + 5
    gamma = n * U / (1 - n * U)
    q = layer.codes.double().view(N, G, 32)
    s_abs = torch.einsum("mgk,ngk->mng", p.abs().view(M, G, 32), q.abs())  # (M, N, G)
    scale = e.double()[:, None, :] * layer.scales.double()[None, :, :]  # (M, N, G)
    subnormal = 2.0**-150 * (s_abs.sum(-1) + 16 * n)
    rounding = 2**-8 if out == torch.bfloat16 else 0.0
    return gamma * (scale * s_abs).sum(-1) + subnormal + rounding * reference.abs()


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("K", [32, 64, 640, 2048])
@pytest.mark.parametrize("M", [1, 3, 9, 15])
def test_kernel_is_the_float64_product_of_the_weight(ext, M, K, x_dtype):
    """Every output within the kernel's bound (x's quantisation and the float32 sums) of
    ``x @ W^T`` in float64, W the layer's ``weight`` (``d * q``): fp16 and bf16 scales, N
    an odd multiple of 8 (a 262144-wide head's shape scaled down: 8 * 257), one to 15
    rows (9: two passes over each weight row)."""
    g = torch.Generator().manual_seed(M * K)
    x = torch.randn(M, K, generator=g).to(x_dtype)
    for N in (24, 104, 8 * 257):
        for scale_dtype in (torch.float16, torch.bfloat16):
            layer = _layer(N, K, scale_dtype, seed=N + K)
            reference = x.double() @ layer.weight.double().t()  # (M, N)
            y = ext.q8_0_mm(x, layer.codes, layer.scales)
            assert y.dtype == x_dtype and y.shape == (M, N)
            err = (y.double() - reference).abs()
            bound = _bound(x, layer, reference, x_dtype)
            assert bool((err <= bound).all()), (N, scale_dtype, (err / bound).max().item())


def _blocks_that_test_the_quantisation(K: int, seed: int) -> torch.Tensor:
    """Rows of x (6, K) whose first block is a case the quantisation must get right; the
    other blocks random."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, K, generator=g)
    x[0, :32] = torch.randn(32, generator=g) * 0.05  # one large value, small ones: codes ~16
    x[0, 7] = 100.0
    x[1, :32] = 0.0  # all zero: codes 0, e = 0 (not 0 / 0)
    x[2, 11] = -10.0  # the largest |x| is negative: its code -32767
    x[3, :32] = -torch.rand(32, generator=g) - 0.5  # every value negative
    # tiny: 32767 / max|x| would pass float32's range, e = max|x| / 32767 is subnormal
    x[4, :32] = 1e-36 * torch.randn(32, generator=g)
    x[5, :32] = 1e30 * torch.rand(32, generator=g)  # huge
    return x


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("K", [32, 96, 640])
def test_kernel_is_the_float64_product_of_x_quantised_per_block(ext, K, x_dtype):
    """The kernel against the float64 product of x's codes and scales as ``_quantise``
    makes them (per 32-block: e = max|x| / 32767, codes round(x / max|x| * 32767)), within
    the float32 sums' bound alone (about G 2^-24 of the terms, where a wrong code, scale or
    rounding costs 2^-16 of a block's largest |x|): K of one block and more, a block with
    one large value and small ones, an all-zero block, a negative maximum, every value
    negative, tiny and huge values, and random rows; 1 to 9 rows at a time."""
    special = _blocks_that_test_the_quantisation(K, seed=K).to(x_dtype)
    g = torch.Generator().manual_seed(K + 1)
    rows = torch.cat([special, torch.randn(3, K, generator=g).to(x_dtype)])  # (9, K)
    for scale_dtype in (torch.float16, torch.bfloat16):
        layer = _layer(40, K, scale_dtype, seed=K + 2)
        layer.codes[:, 7] = 127  # the large value's weight at its largest
        for x in (rows, rows[:1], rows[:4]):
            p, e = _quantise(x)
            w = layer.codes.double().view(40, K // 32, 32)
            block_sums = torch.einsum("mgk,ngk->mng", p.view(-1, K // 32, 32), w)  # exact
            scale = e.double()[:, None, :] * layer.scales.double()[None, :, :]
            reference = (scale * block_sums).sum(-1)  # (M, N)
            y = ext.q8_0_mm(x, layer.codes, layer.scales)
            assert y.dtype == x_dtype and torch.isfinite(y).all()
            err = (y.double() - reference).abs()
            bound = _quantised_product_bound(p, e, layer, reference, x_dtype)
            assert bool((err <= bound).all()), (scale_dtype, (err / bound).max().item())
            true = x.double() @ layer.weight.double().t()
            assert bool(((y.double() - true).abs() <= _bound(x, layer, true, x_dtype)).all())
    # the first row tells a product of x's codes from a product of x itself and of codes
    # made otherwise (truncated, or 8-bit as llama.cpp's): each differs from it by more
    # than the bound on some output, so such a kernel would fail above
    layer = _layer(40, K, torch.float16, seed=K + 2)
    layer.codes[:, 7] = 127
    x = rows[:1].float()
    p, e = _quantise(x)

    def product(codes: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        return (codes * steps.double().repeat_interleave(32, 1)) @ layer.weight.double().t()

    quantised = product(p, e)
    bound = _quantised_product_bound(p, e, layer, quantised, torch.float32)
    a = x.abs().view(1, -1, 32).amax(-1)  # (1, G)
    wrong = {
        "not quantised": x.double() @ layer.weight.double().t(),
        "truncated": product(
            torch.trunc((x.view(1, -1, 32) / a[..., None]) * LEVELS).view(1, K), e
        ),
        "8-bit codes": product(
            torch.round((x.view(1, -1, 32) / a[..., None]) * 127).view(1, K), a / 127
        ),
    }
    for name, y in wrong.items():
        assert bool(((y - quantised).abs() > bound).any()), name


def test_a_block_with_inf_or_nan_makes_its_rows_outputs_nan(ext):
    """A non-finite value has no code: its block's scale is NaN, so every output of that
    row is NaN (as a float product's would be, or inf); the other rows are untouched."""
    layer = _layer(24, 64, torch.float16, seed=5)
    x = torch.randn(3, 64)
    x[0, 40] = float("nan")
    x[1, 3] = float("-inf")
    y = ext.q8_0_mm(x, layer.codes, layer.scales)
    assert bool(torch.isnan(y[:2]).all())
    alone = ext.q8_0_mm(x[2:], layer.codes, layer.scales)
    reference = x[2:].double() @ layer.weight.double().t()
    assert bool(
        ((y[2:].double() - reference).abs() <= _bound(x[2:], layer, reference, y.dtype)).all()
    )
    assert bool(
        ((alone.double() - reference).abs() <= _bound(x[2:], layer, reference, y.dtype)).all()
    )


def test_kernel_refuses_what_it_cannot_read(ext):
    layer = _layer(16, 64, torch.float16, seed=0)
    x = torch.randn(1, 64)
    with pytest.raises(RuntimeError, match="codes must be a contiguous 2-D int8"):
        ext.q8_0_mm(x, layer.codes.t(), layer.scales)
    with pytest.raises(RuntimeError, match=r"scales must be a contiguous \(16, 2\)"):
        ext.q8_0_mm(x, layer.codes, layer.scales.float())
    with pytest.raises(RuntimeError, match=r"x must be \(M, 64\)"):
        ext.q8_0_mm(torch.randn(1, 32), layer.codes, layer.scales)


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16])
def test_the_int4_halves_path_gives_the_native_products_within_bf16(ext, scale_dtype, monkeypatch):
    """Without the native build (ATTNLAB_NATIVE=0) the layer runs PyTorch's int4 kernel on
    its codes' halves, built once and kept out of its state: its scales are bf16 (each
    weight within 2^-8 of the native one's) and its two halves are summed in bf16."""
    layer = _layer(104, 640, scale_dtype, seed=1)
    x = torch.randn(3, 640).bfloat16()
    native_y = layer.product(x)
    torch.testing.assert_close(native_y, ext.q8_0_mm(x, layer.codes, layer.scales), atol=0, rtol=0)
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    halves_y = layer.product(x)
    _, bare = decode_product(layer)
    torch.testing.assert_close(bare(x), halves_y, atol=0, rtol=0)
    magnitude = x.double().abs() @ layer.weight.double().abs().t()
    err = (halves_y.double() - native_y.double()).abs()
    bound = 2**-7 * magnitude + 2**-7 * native_y.double().abs()
    assert bool((err <= bound).all()), (err / bound).max().item()
    assert err.max() > 0  # another kernel indeed
    assert set(layer.state_dict()) == {"codes", "scales"}
    assert not list(layer.children())
    first = layer._halves()
    assert layer._halves() is first  # built once
    with torch.no_grad():
        layer.codes.neg_()  # codes changed in place: built again
    assert layer._halves() is not first
    fresh = Q8Linear(layer.codes.clone(), layer.scales)
    torch.testing.assert_close(layer.product(x), fresh.product(x), atol=0, rtol=0)


def test_native_product_names_the_codes_and_scales():
    layer = _layer(24, 64, torch.float16, seed=2)
    spec = layer.native_product()
    assert spec is not None and spec.kind == NATIVE_Q8
    assert spec.a is layer.codes and spec.b is layer.scales and spec.n == 24


def test_from_float_rounds_scales_up_to_float16_or_takes_bf16_past_its_range():
    """Scales rounded up, never down: a block whose float16 scale is subnormal keeps its
    largest code within 127 and every weight within half a step; a block past float16's
    range gives the layer bfloat16 scales."""
    w = torch.randn(8, 64) * 1e-5  # scales near 1e-7: subnormal in float16
    layer = Q8Linear.from_float(w)
    assert layer.scales.dtype == torch.float16
    step = layer.scales.float().repeat_interleave(32, dim=1)  # (N, K)
    assert bool(((layer.weight - w).abs() <= step / 2).all())
    assert bool((layer.scales.float() * 127 >= w.abs().view(8, 2, 32).amax(-1)).all())
    big = Q8Linear.from_float(torch.cat([w, torch.full((8, 64), 1e7)]))
    assert big.scales.dtype == torch.bfloat16
    torch.testing.assert_close(big.weight[8:], torch.full((8, 64), 1e7), atol=0, rtol=2**-8)


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16])
def test_native_dequantisation_is_the_weight_rounded_once_to_bf16(ext, scale_dtype):
    layer = _layer(104, 640, scale_dtype, seed=3)
    got = ext.q8_0_dequant(layer.codes, layer.scales)
    assert got.dtype == torch.bfloat16 and got.shape == (104, 640)
    assert torch.equal(got, layer.weight.to(torch.bfloat16))
    layer.dense_from_tokens = 16  # decided here, not measured
    x = torch.randn(19, 640).bfloat16()  # a prompt: the dense path
    assert torch.equal(layer.product(x), torch.mm(x, layer.weight.to(torch.bfloat16).t()))
    with pytest.raises(RuntimeError, match="q8_0_dequant: scales must be"):
        ext.q8_0_dequant(layer.codes, layer.scales[:, :3])


def test_a_files_q8_0_blocks_read_as_float32_as_ggml_reads_them(ext):
    """q8_0_blocks_float32 (a float32 model's load of a GGUF file): every code of both
    signs and scales of both signs, each ``d * q`` exact, equal to that product computed
    here in numpy's float32; the output of a slice of rows written in place; bad shapes
    refused, named. (tests/files/test_gguf.py checks the loader's reading against
    gguf-py.)"""
    import numpy as np

    rng = np.random.default_rng(8)
    n = 777
    blocks = rng.integers(0, 256, size=(n, 34), dtype=np.uint8)
    scales = (rng.standard_normal((n, 1)) * 0.02).astype(np.float16)
    blocks[:, :2] = scales.view(np.uint8)
    blocks[0, 2:] = np.arange(-128, 128, 8, dtype=np.int8).view(np.uint8)
    want = blocks[:, 2:].view(np.int8).astype(np.float32) * scales.astype(np.float32)
    out = torch.full((n, 32), float("nan"))
    assert ext.q8_0_blocks_float32(torch.from_numpy(blocks), out) == 0  # no bad scale
    assert np.array_equal(out.numpy(), want)
    bad = blocks.copy()  # the count of blocks whose scale is inf or NaN
    for row, value in ((3, np.nan), (9, np.inf), (n - 1, -np.inf)):
        bad[row, :2] = np.array([value], dtype=np.float16).view(np.uint8)
    assert ext.q8_0_blocks_float32(torch.from_numpy(bad), torch.empty(n, 32)) == 3
    part = torch.full((n, 32), float("nan"))
    ext.q8_0_blocks_float32(torch.from_numpy(blocks)[100:200], part[100:200])
    assert torch.equal(part[100:200], out[100:200]) and bool(part[:100].isnan().all())
    with pytest.raises(RuntimeError, match=r"q8_0_blocks_float32: blocks must be"):
        ext.q8_0_blocks_float32(torch.from_numpy(blocks[:, :33].copy()), out)
    with pytest.raises(RuntimeError, match=r"q8_0_blocks_float32: out must be"):
        ext.q8_0_blocks_float32(torch.from_numpy(blocks), out[:10])
