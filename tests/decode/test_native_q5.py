"""attnlab's Q5_0 product (``attnlab/native/q5_0.h``) against a float64 product of the
weight it holds, :class:`attnlab.quant.Q5Linear`'s blocks against gguf-py's Q5_0 (its
quantiser and dequantiser), and the layer's two paths (the native kernel, and the codes run
as a :class:`attnlab.quant.Q8Linear` where the native build is unavailable)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnlab import native
from attnlab.quant import (
    NATIVE_Q5,
    Int4Linear,
    Int8Linear,
    Q5Linear,
    Q8Linear,
    decode_product,
    fuse_rows,
    quantize_linear,
)


def _layer(N: int, K: int, seed: int) -> Q5Linear:
    """Random codes over the whole range (0 and 31 included: both fifth bits in every
    block position) and float16 scales of several magnitudes, down to the subnormal."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 32, (N, K), generator=g, dtype=torch.uint8)
    codes[0, :2] = torch.tensor([0, 31], dtype=torch.uint8)
    powers = torch.randint(-7, 1, (N, K // 32), generator=g)
    scales = (torch.rand(N, K // 32, generator=g) * 10.0**powers).to(torch.float16)
    return Q5Linear.from_codes(codes, scales)


def _integer(ext) -> bool:
    """Whether this build's q5_0.h branch is the integer one (16-bit activation codes: AVX2,
    and AVX-512 without BF16), as the module says."""
    return bool(getattr(ext, "Q5_INTEGER", False))


def _bound(x: torch.Tensor, w: torch.Tensor, reference: torch.Tensor, out: torch.dtype, ext):
    """The float32 sum's error bound over K terms (K * 2^-24 of sum |x w|, with slack for
    the order), plus the output's rounding (bf16: 2^-8 of the value). The integer branch
    (q5_0.h's header) reads each x as its code's value, within 0.506 e of it, e = 2^-15 of
    the largest |x| of its 32-block: 0.506 * sum e |w| more, and its float32 sums run over
    values up to e larger than |x|."""
    K, M = x.shape[1], x.shape[0]
    ax, aw = x.double().abs(), w.double().abs()
    rounding = 2**-8 if out == torch.bfloat16 else 2**-24
    tail = rounding * reference.abs() + 1e-30
    if not _integer(ext):
        return K * 2**-23 * (ax @ aw.t()) + tail
    e = ax.view(M, K // 32, 32).amax(-1).repeat_interleave(32, dim=1) / 32767
    return K * 2**-23 * ((ax + e) @ aw.t()) + 0.506 * (e @ aw.t()) + tail


def _gguf_q5_0(N: int, K: int, seed: int):
    """gguf-py's Q5_0 blocks of a random (N, K) weight, and their values dequantised."""
    gquants = pytest.importorskip("gguf.quants", reason="pip install 'attnlab[pretrained]'")
    T = gquants.GGMLQuantizationType.Q5_0
    w = np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32)
    w[0, :32] = 0.0  # an all-zero block: d = 0
    raw = gquants.quantize(w, T)
    values = torch.from_numpy(np.ascontiguousarray(gquants.dequantize(raw, T)))  # d * (q - 16)
    return w, raw, values


def test_codes_and_values_are_gguf_pys_q5_0():
    """gguf-py's Q5_0 read as stored (the code reader), and quantised here from the same
    float weight (ggml's rounding): the same bytes, each weight the file's value exactly,
    codes and scales as gguf-py's block layout holds them."""
    from attnlab.pretrained.gguf_file import q5_0_codes

    N, K = 24, 640
    w, raw, values = _gguf_q5_0(N, K, seed=0)
    stored = Q5Linear.from_rows(q5_0_codes(raw, "Q5_0", (N, K)))
    assert stored.blocks.shape == (N, K // 32 * 22) and stored.blocks.dtype == torch.uint8
    assert torch.equal(stored.blocks, torch.from_numpy(raw.reshape(N, -1)))
    assert torch.equal(stored.weight, values)
    ours = Q5Linear.from_float(torch.from_numpy(w))
    assert torch.equal(ours.blocks, stored.blocks)  # ggml's quantiser, byte for byte
    # the codes and scales: d from bytes 0-1, q = nibble + 16 * fifth bit
    blocks = raw.reshape(N, K // 32, 22)
    d = torch.from_numpy(blocks[..., :2].copy().view(np.float16)).reshape(N, K // 32)
    q, scales = stored.codes()
    assert torch.equal(scales, d)
    assert int(q.min()) == 0 and int(q.max()) == 31
    expected = (q.view(N, K // 32, 32).double() - 16) * d.double()[..., None]
    assert torch.equal(expected.view(N, K).float(), values)
    assert torch.equal(Q5Linear.from_codes(q, scales).blocks, stored.blocks)
    with pytest.raises(ValueError, match="whole blocks"):
        q5_0_codes(raw, "Q5_0", (2 * N, K // 2 + 16))  # 336 columns: not whole blocks
    with pytest.raises(ValueError, match="whole blocks"):
        q5_0_codes(raw, "Q8_0", (N, K))


def test_the_layer_runs_and_fuses_as_its_weight():
    """The product (a few rows and a prompt), the bare one-row kernel and a fused pair all
    agree with the weight; the fused parts' blocks are views of the fused ones."""
    N, K = 48, 96
    _, _, values = _gguf_q5_0(N, K, seed=1)
    layer = Q5Linear.from_float(values)
    assert torch.equal(layer.weight, values)  # Q5_0 values quantise to themselves
    g = torch.Generator().manual_seed(1)

    def assert_bf16_product(y: torch.Tensor, x: torch.Tensor) -> None:
        """Within bf16's rounding of x, of each weight (the dense path) and of the output."""
        reference = x.double() @ values.double().T
        magnitude = x.double().abs() @ values.double().abs().T
        err = (y.double() - reference).abs()
        assert bool((err <= 2**-7 * magnitude + 2**-8 * reference.abs()).all())

    x = torch.randn(3, K, generator=g)
    assert_bf16_product(layer(x), x)
    dtype, bare = decode_product(layer)
    assert_bf16_product(bare(x.to(dtype)), x)
    layer.dense_from_tokens = 16  # decided here, not measured
    assert_bf16_product(layer(prompt := torch.randn(21, K, generator=g)), prompt)
    other = Q5Linear.from_float(values[:16])
    fused = fuse_rows([layer, other])
    assert isinstance(fused, Q5Linear) and fused.out_features == N + 16
    assert torch.equal(fused.weight, torch.cat([values, values[:16]]))
    assert layer.blocks.data_ptr() == fused.blocks.data_ptr()  # a view, not a copy
    assert torch.equal(layer.weight, values)
    assert set(layer.state_dict()) == {"blocks"}
    assert Q5Linear.why_not(N + 4, K) is not None and Q5Linear.fallback == "int8"
    assert Q5Linear.why_not(N, K + 16) is not None
    assert isinstance(quantize_linear(torch.nn.Linear(K, N + 4), "q5_0"), Int8Linear)
    assert isinstance(quantize_linear(torch.nn.Linear(K, N), "q5_0"), Q5Linear)
    assert Int4Linear.gguf_instead["Q5_0"] == "q5_0"
    assert Int4Linear.gguf_instead["Q5_1"] == "q8_0"


def test_from_float_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="float16"):
        Q5Linear.from_float(torch.full((8, 32), 2e6))  # d = 1.25e5: past float16
    with pytest.raises(ValueError, match="multiple of 32"):
        Q5Linear.from_float(torch.randn(8, 48))
    with pytest.raises(ValueError, match=r"0\.\.31"):
        Q5Linear.from_codes(torch.full((8, 32), 32), torch.ones(8, 1))
    with pytest.raises(ValueError, match="whole 22-byte blocks"):
        Q5Linear(torch.zeros(8, 23, dtype=torch.uint8))


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("K", [32, 640, 2048])
@pytest.mark.parametrize("M", [1, 3, 9, 15])
def test_kernel_is_the_float64_product_of_the_weight(ext, M, K, x_dtype):
    """Every output within the float32 sum's bound of ``x @ W^T`` in float64, W the
    layer's ``weight`` (``d * (q - 16)``): N from 8 to an odd multiple of 8 (8 * 257) and an
    odd 13, one to 15 rows (9 and 15: two passes over each weight row)."""
    g = torch.Generator().manual_seed(M * K)
    x = torch.randn(M, K, generator=g).to(x_dtype)
    for N in (8, 13, 104, 8 * 257):  # 13: an odd weight row after the pairs of one x row
        layer = _layer(N, K, seed=N + K)
        reference = x.double() @ layer.weight.double().t()  # (M, N)
        y = ext.q5_0_mm(x, layer.blocks)
        assert y.dtype == x_dtype and y.shape == (M, N)
        err = (y.double() - reference).abs()
        bound = _bound(x, layer.weight, reference, x_dtype, ext)
        assert bool((err <= bound).all()), (N, (err / bound).max().item())


def test_kernel_on_gguf_pys_blocks(ext):
    """gguf-py's own bytes through the kernel: llama.cpp's bit order, read as it wrote it."""
    from attnlab.pretrained.gguf_file import q5_0_codes

    N, K = 40, 2048
    _, raw, values = _gguf_q5_0(N, K, seed=2)
    (blocks,) = q5_0_codes(raw, "Q5_0", (N, K))
    x = torch.randn(2, K)
    reference = x.double() @ values.double().t()
    err = (ext.q5_0_mm(x, blocks).double() - reference).abs()
    assert bool((err <= _bound(x, values, reference, torch.float32, ext)).all())


def test_the_integer_branchs_error_term_is_needed_and_bounds_it(ext):
    """Where the build sums integer products (no bf16 dots), its error exceeds the float32
    bound alone on rows with a large spread (one outlier a block), and stays within the bound
    with the activation codes' term; elsewhere the float branches meet the float32 bound
    alone."""
    g = torch.Generator().manual_seed(7)
    layer = _layer(256, 640, seed=7)
    x = torch.randn(3, 640, generator=g)
    x[:, ::32] *= 1000.0  # one outlier a block: every other x is coded coarsely
    reference = x.double() @ layer.weight.double().t()
    err = (ext.q5_0_mm(x, layer.blocks).double() - reference).abs()
    bound = _bound(x, layer.weight, reference, torch.float32, ext)
    assert bool((err <= bound).all()), (err / bound).max().item()
    floats_only = 640 * 2**-23 * (x.double().abs() @ layer.weight.double().abs().t())
    assert bool((err > floats_only).any()) == _integer(ext)


def test_a_non_finite_x_spoils_only_its_own_row(ext):
    """A row of x holding inf or NaN gives no finite output; the other rows are within their
    bound; a row of zeros gives exact zeros."""
    layer = _layer(48, 96, seed=3)
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(3))
    x[1, 40] = float("inf")
    x[2, 5] = float("nan")
    x[3] = 0.0
    y = ext.q5_0_mm(x, layer.blocks)
    assert not bool(torch.isfinite(y[1:3]).any())
    assert torch.equal(y[3], torch.zeros(48))
    reference = x[:1].double() @ layer.weight.double().t()
    bound = _bound(x[:1], layer.weight, reference, torch.float32, ext)
    assert bool(((y[:1].double() - reference).abs() <= bound).all())


def test_kernel_refuses_what_it_cannot_read(ext):
    layer = _layer(16, 64, seed=0)
    with pytest.raises(RuntimeError, match=r"blocks must be a contiguous \(N, 44\) uint8"):
        ext.q5_0_mm(torch.randn(1, 64), layer.blocks[:, :22])
    with pytest.raises(RuntimeError, match=r"blocks must be a contiguous \(N, 44\) uint8"):
        ext.q5_0_mm(torch.randn(1, 64), layer.blocks.view(torch.int8))
    with pytest.raises(RuntimeError, match="not a multiple of 32"):
        ext.q5_0_mm(torch.randn(1, 48), layer.blocks)
    with pytest.raises(RuntimeError, match=r"x must be \(M, K\) bfloat16 or float32"):
        ext.q5_0_mm(torch.randn(1, 64).half(), layer.blocks)


def test_the_q8_0_path_gives_the_native_products_within_bf16(ext, monkeypatch):
    """Without the native build (ATTNLAB_NATIVE=0) the layer runs its codes as a q8_0 layer
    (``q - 16``, the same scales: the same weight), built once and kept out of its state;
    that one's int4 halves round the scales to bf16 (each weight within 2^-8 of the native
    one's) and sum the two halves in bf16."""
    layer = _layer(104, 640, seed=1)
    x = torch.randn(3, 640).bfloat16()
    native_y = layer.product(x)
    torch.testing.assert_close(native_y, ext.q5_0_mm(x, layer.blocks), atol=0, rtol=0)
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    fallback_y = layer.product(x)
    _, bare = decode_product(layer)
    torch.testing.assert_close(bare(x), fallback_y, atol=0, rtol=0)
    as_q8 = layer._as_q8()
    assert isinstance(as_q8, Q8Linear) and torch.equal(as_q8.weight, layer.weight)
    magnitude = x.double().abs() @ layer.weight.double().abs().t()
    err = (fallback_y.double() - native_y.double()).abs()
    bound = 2**-7 * magnitude + 2**-7 * native_y.double().abs()
    assert bool((err <= bound).all()), (err / bound).max().item()
    assert set(layer.state_dict()) == {"blocks"}
    assert not list(layer.children())
    assert layer._as_q8() is as_q8  # built once
    with torch.no_grad():
        layer.blocks[:, 6:22] ^= 0x11  # codes changed in place: built again
    assert layer._as_q8() is not as_q8
    fresh = Q5Linear(layer.blocks.clone())
    torch.testing.assert_close(layer.product(x), fresh.product(x), atol=0, rtol=0)


def test_native_product_names_the_blocks():
    layer = _layer(24, 64, seed=2)
    spec = layer.native_product()
    assert spec is not None and spec.kind == NATIVE_Q5
    assert spec.a is layer.blocks and spec.b is None and spec.n == 24


def test_a_q5_0_file_with_a_non_finite_scale_is_refused(tmp_path):
    """A GGUF Q5_0 tensor whose block scale is NaN is refused, named, whether read as codes
    (the int4 load) or dequantised; the intact tensor's codes are its blocks as written."""
    gguf = pytest.importorskip("gguf", reason="pip install 'attnlab[pretrained]'")
    from attnlab.pretrained import ModelFileError
    from attnlab.pretrained.gguf_file import read_gguf

    _, raw, values = _gguf_q5_0(16, 64, seed=3)
    broken = raw.copy()
    broken.reshape(-1, 22)[5, :2] = np.frombuffer(b"\x00\x7e", dtype=np.uint8)  # f16 NaN
    path = tmp_path / "q5.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    T = gguf.GGMLQuantizationType.Q5_0
    writer.add_tensor("good.weight", raw, raw_dtype=T)
    writer.add_tensor("bad.weight", broken, raw_dtype=T)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    contents = read_gguf(path)
    (blocks,) = contents.codes("good.weight")
    assert torch.equal(Q5Linear(blocks).weight, values)
    assert torch.equal(contents.tensor("good.weight"), values)
    for read in (contents.codes, contents.tensor):
        with pytest.raises(ModelFileError, match=r"'bad\.weight' holds 1 non-finite quantisation"):
            read("bad.weight")


def test_without_the_native_build_any_rows_run(monkeypatch):
    """A file's Q5_0 weight of 13 rows (q8_0's int4 halves need a multiple of 8) still runs
    without the native build: dequantised for the product, within bf16's rounding."""
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    layer = _layer(13, 64, seed=4)
    x = torch.randn(2, 64).bfloat16()
    y = layer.product(x)
    reference = x.double() @ layer.weight.double().t()
    magnitude = x.double().abs() @ layer.weight.double().abs().t()
    assert y.shape == (2, 13)
    assert bool(((y.double() - reference).abs() <= 2**-7 * magnitude + 1e-30).all())


@pytest.mark.parametrize(("N", "K"), [(8, 32), (13, 640), (104, 2048)])
def test_native_dequantisation_is_the_weight_rounded_once_to_bf16(ext, N, K):
    layer = _layer(N, K, seed=N + K)
    got = ext.q5_0_dequant(layer.blocks)
    assert got.dtype == torch.bfloat16 and got.shape == (N, K)
    assert torch.equal(got, layer.weight.to(torch.bfloat16))
    layer.dense_from_tokens = 16  # decided here, not measured
    x = torch.randn(19, K).bfloat16()  # a prompt: the dense path
    assert torch.equal(layer.product(x), torch.mm(x, layer.weight.to(torch.bfloat16).t()))
    # float32 (the prompts of a CPU without bf16 arithmetic): every weight exact
    exact = ext.q5_0_dequant(layer.blocks, True)
    assert exact.dtype == torch.float32 and torch.equal(exact, layer.weight)
    xf = x.float()
    assert torch.equal(layer.product(xf), torch.mm(xf, layer.weight.t()))
    with pytest.raises(RuntimeError, match="q5_0_dequant: blocks must be"):
        ext.q5_0_dequant(layer.blocks[:, :21])
