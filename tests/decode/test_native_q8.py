"""attnlab's Q8_0 product (``attnlab/native/q8_0.h``) against a float64 product of the
weight it holds, and :class:`attnlab.quant.Q8Linear`'s two paths (the native kernel, and
PyTorch's int4 kernel on the codes' 4-bit halves where the native build is unavailable)."""

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


def _bound(
    x: torch.Tensor, layer: Q8Linear, reference: torch.Tensor, out: torch.dtype
) -> torch.Tensor:
    """The float32 sum's error bound over K terms (K * 2^-24 of sum |x w|, with slack for
    the order), plus the output's rounding (bf16: 2^-8 of the value)."""
    K = x.shape[1]
    magnitude = x.double().abs() @ layer.weight.double().abs().t()  # (M, N)
    rounding = 2**-8 if out == torch.bfloat16 else 2**-24
    return K * 2**-23 * magnitude + rounding * reference.abs() + 1e-30


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("K", [32, 64, 640, 2048])
@pytest.mark.parametrize("M", [1, 3, 9, 15])
def test_kernel_is_the_float64_product_of_the_weight(ext, M, K, x_dtype):
    """Every output within the float32 sum's bound of ``x @ W^T`` in float64, W the
    layer's ``weight`` (``d * q``): fp16 and bf16 scales, N an odd multiple of 8 (a
    262144-wide head's shape scaled down: 8 * 257), one to 15 rows (9: two passes over
    each weight row)."""
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
    x = torch.randn(layer.dense_from_tokens + 3, 640).bfloat16()  # a prompt: the dense path
    assert torch.equal(layer.product(x), torch.mm(x, layer.weight.to(torch.bfloat16).t()))
    with pytest.raises(RuntimeError, match="q8_0_dequant: scales must be"):
        ext.q8_0_dequant(layer.codes, layer.scales[:, :3])
