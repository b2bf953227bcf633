"""attnlab's int4 product (``attnlab/native/q4.h``) against a float64 product of
:class:`attnlab.quant.Int4Linear`'s weight and against PyTorch's int4 kernel, the layout
it reads (the layer's own codes), and the choice between the two kernels by
the CPU kernels PyTorch reports."""

from __future__ import annotations

import pytest
import torch

from attnlab import native
from attnlab.quant import NATIVE_INT4, NATIVE_Q4, Int4Linear, decode_product
from attnlab.quant.int4 import native_q4


def _layer(N: int, K: int, group_size: int, seed: int) -> Int4Linear:
    """Random codes over the whole range (0 and 15 in every row), bf16 scales of several
    magnitudes and zeros anywhere from -2 to 2 scales' worth of 8 (offsets far from the
    weights: ``zero - 8 scale`` then rounds in float32)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    codes[:, :2] = torch.tensor([0, 15], dtype=torch.uint8)
    G = K // group_size
    powers = torch.randint(-6, 1, (N, G), generator=g)
    scales = torch.rand(N, G, generator=g) * 10.0**powers + 1e-8  # (N, G)
    zeros = (torch.rand(N, G, generator=g) * 4 - 2) * 8 * scales  # (N, G)
    return Int4Linear.from_codes(codes, scales, zeros)


def _magnitude(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.double().abs() @ w.double().abs().t()  # (M, N)


def _integer(ext) -> bool:
    """Whether this build's q4.h branch is the integer one (any build with AVX2: 16-bit
    activation codes), as the module says."""
    return bool(getattr(ext, "Q4_INTEGER", False))


def _bound(x: torch.Tensor, layer: Int4Linear, reference: torch.Tensor, out: torch.dtype, ext):
    """The float32 sum's error bound over K terms (K * 2^-24 of sum |x w|, doubled for the
    order), plus the output's rounding (bf16: half a unit in the last of 8 bits, 2^-8 of the
    value; float32: 2^-24). The integer branch (q4.h's header) sums ``s * e * S`` and
    ``o * X`` apart, so its float32 sums are over ``|s q|`` and ``|o|`` rather than ``|w|``,
    and each x is within 0.506 e of its code's value, e = 2^-15 of the largest |x| of its
    32-block: 0.506 * sum e |s q| more."""
    K = x.shape[1]
    rounding = 2**-8 if out == torch.bfloat16 else 2**-24
    tail = rounding * reference.abs() + 1e-30
    if not _integer(ext):
        return K * 2**-23 * _magnitude(x, layer.weight) + tail
    codes, scale_offset = layer._native_layout()
    N, M = codes.shape[0], x.shape[0]
    blocks = codes.view(N, K // 32, 16)
    q = torch.cat([blocks & 15, blocks >> 4], dim=-1).double()  # (N, K/32, 32)
    s, o = scale_offset.double().abs().unbind(-1)  # (N, K/32) each
    sq = (q * s.unsqueeze(-1)).view(N, K)
    offsets = o.repeat_interleave(32, dim=1)  # (N, K)
    e = x.double().abs().view(M, K // 32, 32).amax(-1).repeat_interleave(32, dim=1) / 32767
    floats = K * 2**-23 * (_magnitude(x, sq) + _magnitude(x, offsets))
    return floats + 0.506 * e @ sq.t() + tail


def _torch_int4(layer: Int4Linear, x: torch.Tensor) -> torch.Tensor:
    op = torch.ops.aten._weight_int4pack_mm_for_cpu
    return op(x, layer.torch_packed(), layer.group_size, layer.scales_and_zeros)


@pytest.mark.parametrize(("N", "K", "group_size"), [(16, 32, 32), (48, 96, 32), (32, 160, 32),
                                                    (64, 576, 64), (80, 1536, 128)])  # fmt: skip
def test_the_layout_holds_the_layers_weight_exactly(N, K, group_size):
    """Decoded as the kernel reads it (``q * s + o``, one float32 rounding), the native layout
    gives :attr:`Int4Linear.weight` to the bit; K = 96 and 160 are multiples of 32, not 64."""
    layer = _layer(N, K, group_size, seed=N + K)
    codes, scale_offset = layer._native_layout()
    assert codes is layer.codes  # held as the kernel reads them: no copy
    assert codes.shape == (N, K // 2) and codes.dtype == torch.uint8
    assert scale_offset.shape == (N, K // 32, 2) and scale_offset.dtype == torch.float32
    blocks = codes.view(N, K // 32, 16)
    q = torch.cat([blocks & 15, blocks >> 4], dim=-1).float()  # (N, K/32, 32): weight order
    s, o = scale_offset[..., :1], scale_offset[..., 1:]  # (N, K/32, 1) each
    assert torch.equal((q * s + o).view(N, K), layer.weight)  # q * s exact: one rounding
    assert torch.equal(q.view(N, K).to(torch.uint8), layer.codes_t().t())


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize(("N", "K", "group_size"), [(16, 32, 32), (48, 96, 32), (32, 160, 32),
                                                    (64, 576, 64), (1536, 576, 32),
                                                    (80, 1536, 128)])  # fmt: skip
def test_kernel_is_the_float64_product_of_the_weight(ext, N, K, group_size, M, x_dtype):
    """Every output within the float32 sum's bound of ``x @ W^T`` in float64, W the layer's
    ``weight``; one to five rows and nine (two passes over each weight row)."""
    layer = _layer(N, K, group_size, seed=N * K + M)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(x_dtype)
    reference = x.double() @ layer.weight.double().t()  # (M, N)
    y = ext.q4_mm(x, *layer._native_layout())
    assert y.dtype == x_dtype and y.shape == (M, N)
    err = (y.double() - reference).abs()
    bound = _bound(x, layer, reference, x_dtype, ext)
    assert bool((err <= bound).all()), (err / bound).max().item()


@pytest.mark.parametrize("M", [1, 3, 5])
@pytest.mark.parametrize(("N", "K", "group_size"), [(48, 96, 32), (64, 576, 64), (80, 1536, 128)])
def test_kernel_is_pytorchs_within_both_bounds(ext, N, K, group_size, M):
    """PyTorch's int4 kernel on the same layer and bf16 rows: both within their bound of the
    float64 product, so within the sum of the two of each other. Its AVX-512 kernel rounds
    ``(q - 8) s + zero`` once where the layer's weight (and its AVX2 kernel) round
    ``zero - 8 s`` first: each weight off by at most 2^-24 of ``|w| + |zero - 8 s|`` more."""
    layer = _layer(N, K, group_size, seed=N + K + M)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).bfloat16()
    reference = x.double() @ layer.weight.double().t()
    ours, theirs = ext.q4_mm(x, *layer._native_layout()), _torch_int4(layer, x)
    offsets = layer._native_layout()[1][..., 1].repeat_interleave(32, dim=1)  # (N, K)
    bound = _bound(x, layer, reference, torch.bfloat16, ext)
    theirs_bound = _bound(x, layer, reference, torch.bfloat16, None) + 2**-23 * (
        _magnitude(x, layer.weight) + _magnitude(x, offsets))  # fmt: skip
    assert bool(((ours.double() - reference).abs() <= bound).all())
    assert bool(((theirs.double() - reference).abs() <= theirs_bound).all())
    assert bool(((ours.double() - theirs.double()).abs() <= bound + theirs_bound).all())


def test_kernel_refuses_what_it_cannot_read(ext):
    codes, scale_offset = _layer(16, 64, 32, seed=0)._native_layout()
    with pytest.raises(RuntimeError, match=r"scale_offset must be a contiguous \(16, 2, 2\)"):
        ext.q4_mm(torch.randn(1, 64), codes, scale_offset[:, :1])
    with pytest.raises(RuntimeError, match="codes must be a contiguous 2-D uint8"):
        ext.q4_mm(torch.randn(1, 64), codes.view(torch.int8), scale_offset)
    with pytest.raises(RuntimeError, match="not a multiple of 32"):
        ext.q4_mm(torch.randn(1, 48), codes[:, :24].contiguous(), scale_offset)
    with pytest.raises(RuntimeError, match=r"x must be \(M, 64\) bfloat16 or float32"):
        ext.q4_mm(torch.randn(1, 64).half(), codes, scale_offset)
    with pytest.raises(RuntimeError, match=r"x must be \(M, 64\)"):
        ext.q4_mm(torch.randn(1, 32), codes, scale_offset)


@pytest.mark.parametrize("capability", ["AVX2", "DEFAULT", "AVX512"])
def test_the_kernel_is_attnlabs_where_it_sums_integers_or_pytorchs_are_slow(
    ext, capability, monkeypatch
):
    """attnlab's kernel where the build sums integer products (any build with AVX2) or
    PyTorch's int4 kernels are not its AVX-512 ones, in the product, the bare decode kernel
    and the compiled step's call; PyTorch's otherwise (a plain build beside PyTorch's
    AVX-512 kernels) and without the native build."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    layer = _layer(64, 576, 32, seed=1)
    x = torch.randn(3, 576).bfloat16()
    ours, theirs = ext.q4_mm(x, *layer._native_layout()), _torch_int4(layer, x)
    pytorchs = capability == "AVX512" and not _integer(ext)
    assert native_q4(ext) == (not pytorchs)
    want = theirs if pytorchs else ours
    _, bare = decode_product(layer)
    for got in (layer.product(x), bare(x), layer.decode_kernel()(x)):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    spec = layer.native_product()
    assert spec is not None and spec.n == 64
    if pytorchs:
        assert spec.kind == NATIVE_INT4 and spec.a is layer.torch_packed()
    else:
        codes, scale_offset = layer._native_layout()
        assert spec.kind == NATIVE_Q4 and spec.a is codes and spec.b is scale_offset
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    torch.testing.assert_close(layer.product(x), theirs, atol=0, rtol=0)
    assert layer.native_product().kind == NATIVE_INT4  # type: ignore[union-attr]


def test_a_group_size_below_32_is_left_to_pytorchs_kernel(ext, monkeypatch):
    """Groups of 16 do not fill the native layout's 32-weight groups: PyTorch's kernel is
    called, and refuses them, rather than attnlab's reading them wrongly."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    layer = Int4Linear.from_float(torch.randn(16, 64), group_size=16)
    assert layer.native_product().kind == NATIVE_INT4  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="qGroupSize"):
        layer.product(torch.randn(2, 64).bfloat16())


def test_the_layout_is_built_once_beside_the_module(ext, monkeypatch):
    """Built on first use, kept out of the state dict and the module tree, built again when
    the scales change in place; a prompt (the dense path) gives the same as before."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    layer = _layer(32, 128, 32, seed=2)
    first = layer._native_layout()
    assert layer._native_layout() is first
    assert set(layer.state_dict()) == {"codes", "scales_and_zeros"}
    assert not list(layer.children())
    with torch.no_grad():
        layer.scales_and_zeros[..., 0] *= 2
    again = layer._native_layout()
    assert again is not first and torch.equal(again[1][..., 0], 2 * first[1][..., 0])
    x = torch.randn(2, 128).bfloat16()
    reference = x.double() @ layer.weight.double().t()
    assert bool(((layer.product(x).double() - reference).abs() <= _bound(
        x, layer, reference, torch.bfloat16, ext)).all())  # fmt: skip


def test_a_non_finite_x_spoils_only_its_own_row(ext):
    """A row of x holding inf or NaN gives no finite output (the integer branch's block scale is
    NaN); the other rows are within their bound; a row of zeros gives exact zeros."""
    layer = _layer(48, 96, 32, seed=3)
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(3))
    x[1, 40] = float("inf")
    x[2, 5] = float("nan")
    x[3] = 0.0
    y = ext.q4_mm(x, *layer._native_layout())
    assert not bool(torch.isfinite(y[1:3]).any())
    assert torch.equal(y[3], torch.zeros(48))
    reference = x[:1].double() @ layer.weight.double().t()
    bound = _bound(x[:1], layer, reference, torch.float32, ext)
    assert bool(((y[:1].double() - reference).abs() <= bound).all())


@pytest.mark.parametrize("nbytes", [18, 20], ids=["Q4_0", "Q4_1"])
def test_a_files_q4_blocks_read_as_float32_as_ggml_reads_them(ext, nbytes):
    """q4_blocks_float32 (a float32 model's load of a GGUF file): every nibble, scales and
    Q4_1 minimums of both signs, equal bit for bit to ggml's formulas computed here in
    numpy's float32 (Q4_0 ``(q - 8) d``; Q4_1 ``q d + m``, the product and the sum rounded
    apart: a fused multiply-add would differ); rows written in place; bad shapes refused,
    named. (tests/files/test_gguf.py checks the loader's reading against gguf-py.)"""
    import numpy as np

    rng = np.random.default_rng(nbytes)
    n = 999
    blocks = rng.integers(0, 256, size=(n, nbytes), dtype=np.uint8)
    halves = 2 if nbytes == 20 else 1
    scales = (rng.standard_normal((n, halves)) * 0.03).astype(np.float16)
    blocks[:, : 2 * halves] = scales.view(np.uint8)
    qs = blocks[:, 2 * halves :]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)  # (n, 32)
    d = scales[:, :1].astype(np.float32)
    if halves == 2:
        product = q * d  # rounded here, then the sum rounded: two roundings
        want = product + scales[:, 1:].astype(np.float32)
    else:
        want = (q - np.float32(8)) * d
    out = torch.full((n, 32), float("nan"))
    assert ext.q4_blocks_float32(torch.from_numpy(blocks), out) == 0  # no bad scale
    assert np.array_equal(out.numpy(), want)
    part = torch.full((n, 32), float("nan"))
    ext.q4_blocks_float32(torch.from_numpy(blocks)[7:300], part[7:300])
    # the count of blocks with an inf or NaN scale (d, or m): each counted once
    bad = blocks.copy()
    for row, at, value in ((3, 0, np.nan), (5, 0, -np.inf), (5, 2 * halves - 2, np.inf)):
        bad[row, at : at + 2] = np.array([value], dtype=np.float16).view(np.uint8)
    assert ext.q4_blocks_float32(torch.from_numpy(bad), torch.empty(n, 32)) == 2
    assert torch.equal(part[7:300], out[7:300]) and bool(part[:7].isnan().all())
    with pytest.raises(RuntimeError, match=r"q4_blocks_float32: blocks must be"):
        ext.q4_blocks_float32(torch.from_numpy(blocks[:, :17].copy()), out)
    with pytest.raises(RuntimeError, match=r"q4_blocks_float32: out must be"):
        ext.q4_blocks_float32(torch.from_numpy(blocks), out[:, :16].contiguous())
