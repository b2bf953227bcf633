"""Weight-only bf16 / int8 / int4 linear layers against products computed here in fp64."""

from __future__ import annotations

from types import MappingProxyType

import numpy as np
import pytest
import torch
from torch import nn

from attnlab.pretrained.gguf_file import dequantize, int4_codes
from attnlab.quant import (
    WEIGHT_DTYPES,
    WEIGHT_FORMATS,
    BF16Linear,
    GGUFBlock,
    Int4Linear,
    Int8Linear,
    Q5Linear,
    Q8Linear,
    WeightFormat,
    column_major,
    decode_product,
    dtype_help,
    fuse_linears,
    fuse_rows,
    gguf_blocks,
    gguf_format,
    gguf_holding,
    quantize_linear,
    quantize_model,
    register_format,
)
from attnlab.quant import base as quant_base
from attnlab.quant.int4 import pack_nibbles, unpack_nibbles


def _ref(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """The product in fp64 of bf16-rounded inputs (what the kernels are given)."""
    y = x.to(torch.bfloat16).double() @ w.double().T
    return y if b is None else y + b.double()


def _close_bf16_out(y: torch.Tensor, ref: torch.Tensor) -> None:
    # The kernels return bf16: one rounding of the fp32 sum (relative 2^-8) plus sum order.
    scale = ref.abs().max().item()
    torch.testing.assert_close(y.double(), ref, atol=scale * 2**-7, rtol=2**-7)


def test_int4_from_codes_follows_q_minus_8_times_scale_plus_zero():
    g = torch.Generator().manual_seed(0)
    N, K, gs = 64, 96, 32
    codes = torch.randint(0, 16, (N, K), generator=g)
    # Scales and zeros exactly representable in bf16, so the reference is exact.
    scales = torch.randint(1, 64, (N, K // gs), generator=g).float() / 256
    zeros = torch.randint(-64, 64, (N, K // gs), generator=g).float() / 128
    lin = Int4Linear.from_codes(codes, scales, zeros)
    w = (codes - 8) * scales.repeat_interleave(gs, 1) + zeros.repeat_interleave(gs, 1)
    x = torch.randn(3, 5, K, generator=g)
    y = lin(x)
    assert y.shape == (3, 5, N) and y.dtype == torch.float32
    _close_bf16_out(y, _ref(x, w))
    torch.testing.assert_close(lin.weight, w)  # these weights are exact in bf16


def _step(cls: type, w: torch.Tensor) -> torch.Tensor:
    """One quantisation step of each weight (the scale itself rounded to bf16)."""
    if cls is Int8Linear:
        return (w.abs().amax(1, keepdim=True) / 127).expand_as(w) * (1 + 2**-7)
    if cls is Int4Linear:
        g = w.view(w.shape[0], -1, 32)
        return ((g.amax(-1) - g.amin(-1)) / 15).repeat_interleave(32, 1) * (1 + 2**-7)
    return w.abs() * 2**-7  # bf16: relative half-ulp 2^-8, times two


@pytest.mark.parametrize("cls", [Int8Linear, Int4Linear, BF16Linear])
def test_from_float_is_within_half_a_step_and_computes_with_it(cls):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 64, generator=g) * 0.1
    b = torch.randn(48, generator=g)
    q = cls(w, b) if cls is BF16Linear else cls.from_float(w, b)
    err = (q.weight - w).abs()
    assert bool((err <= _step(cls, w) / 2 + 1e-7).all()), err.max()
    x = torch.randn(7, 64, generator=g)
    _close_bf16_out(q(x), _ref(x, q.weight, b))


@pytest.mark.parametrize("N", [16, 48, 64, 80, 144])  # whole 64-row tiles, tails, both
def test_int4_codes_are_held_two_a_byte_and_packed_for_pytorchs_kernel(N):
    """Weight ``j`` of each 32-block in the low nibble of byte ``j``, ``j + 16`` in its high
    one (GGUF's Q4_0 layout); PyTorch's kernel, on the packing made from them, multiplies
    by the same codes (its product with the identity, scale 1 and zero 0, is ``q - 8``)."""
    g = torch.Generator().manual_seed(N)
    codes = torch.randint(0, 16, (N, 96), generator=g, dtype=torch.int32)
    held = pack_nibbles(codes)
    assert held.shape == (N, 48) and held.dtype == torch.uint8
    blocks = held.view(N, 3, 16).int()
    assert torch.equal(blocks & 15, codes.view(N, 3, 32)[..., :16])
    assert torch.equal(blocks >> 4, codes.view(N, 3, 32)[..., 16:])
    assert torch.equal(unpack_nibbles(held).int(), codes)
    unit = torch.zeros(N, 96 // 32)
    lin = Int4Linear.from_codes(codes, unit + 1, unit)
    assert torch.equal(lin.codes, held) and torch.equal(lin.codes_t().t().int(), codes)
    eye = torch.eye(96, dtype=torch.bfloat16)
    q8 = torch.ops.aten._weight_int4pack_mm_for_cpu(
        eye, lin.torch_packed(), 32, lin.scales_and_zeros
    )  # (K, N): q - 8
    assert torch.equal(q8.float(), codes.t().float() - 8)
    assert lin.torch_packed() is lin.torch_packed()  # made once
    with pytest.raises(ValueError, match=r"in 0\.\.15"):
        Int4Linear.from_codes(codes + 1, unit + 1, unit)
    with pytest.raises(ValueError, match="scales and zeros of one shape"):
        Int4Linear.from_stored((held, unit + 1, unit[:, :1]))
    with pytest.raises(ValueError, match="two codes a byte"):
        Int4Linear.from_stored((held.view(torch.int8), unit + 1, unit))


@pytest.mark.parametrize("cls", [Int8Linear, Int4Linear])
def test_many_rows_dequantise_and_give_the_kernels_product(cls):
    """From ``dense_from_tokens`` rows on (a prompt) the layer dequantises and runs bf16 mm."""
    g = torch.Generator().manual_seed(4)
    w, b = torch.randn(80, 64, generator=g) * 0.1, torch.randn(80, generator=g)
    q = cls.from_float(w, b)
    q.dense_from_tokens = 16  # decided here, not measured
    x = torch.randn(19, 64, generator=g)
    dense = q(x)
    _close_bf16_out(dense, _ref(x, q.weight, b))  # fp64 product of the layer's own weights
    q.dense_from_tokens = 1 << 30  # the one-row kernel for every row count
    kernel = q(x)
    scale = kernel.abs().max().item()
    torch.testing.assert_close(dense, kernel, atol=scale * 2**-7, rtol=2**-7)
    assert 16 <= cls.default_dense_from <= 256  # decode (one row) keeps the kernel


def test_int4_rejects_shapes_the_kernel_cannot_pack_and_quantize_linear_falls_back():
    with pytest.raises(ValueError, match="multiple of 16"):
        Int4Linear.from_float(torch.randn(40, 64))
    with pytest.raises(ValueError, match="group_size=32"):
        Int4Linear.from_float(torch.randn(64, 48))
    assert isinstance(quantize_linear(nn.Linear(48, 64), "int4"), Int8Linear)
    assert isinstance(quantize_linear(nn.Linear(64, 64), "int4"), Int4Linear)
    with pytest.raises(ValueError, match="`dtype` must be one of"):
        quantize_linear(nn.Linear(4, 4), "fp8")


def test_quantize_model_unties_the_head_and_keeps_it_int8_under_int4():
    model = nn.Module()
    model.tok_embeddings = nn.Embedding(32, 64)
    model.body = nn.Linear(64, 64)
    model.lm_head = nn.Linear(64, 32, bias=False)
    model.lm_head.weight = model.tok_embeddings.weight
    quantize_model(model, "int4")
    assert isinstance(model.body, Int4Linear)
    assert isinstance(model.lm_head, Int8Linear)
    assert model.tok_embeddings.weight.dtype == torch.float32  # the lookup stays exact


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8", "int4"])
def test_fused_rows_equal_the_separate_products(kind):
    g = torch.Generator().manual_seed(2)
    parts = [nn.Linear(64, n, bias=kind != "int4") for n in (128, 64, 64)]
    with torch.no_grad():
        for p in parts:
            p.weight.copy_(torch.randn(p.weight.shape, generator=g))
    parts = [quantize_linear(p, kind) for p in parts]
    x = torch.randn(2, 3, 64, generator=g)
    separate = torch.cat([p(x) for p in parts], dim=-1)
    if kind == "float32":
        assert fuse_rows(parts) is None  # float parameters are fused only when shared
    fused = fuse_rows(parts, share_float=True)
    assert fused is not None
    torch.testing.assert_close(fused(x), separate, atol=1e-5, rtol=1e-5)
    # After fusing, the parts still compute what they did (views of the fused rows).
    torch.testing.assert_close(torch.cat([p(x) for p in parts], dim=-1), separate)


def test_fused_float_rows_share_storage_with_the_parts():
    parts = [nn.Linear(8, 4, bias=False), nn.Linear(8, 4, bias=False)]
    params = [p.weight for p in parts]
    fused = fuse_rows(parts, share_float=True)
    assert fused is not None
    assert [p.weight for p in parts] == params  # the same Parameter objects
    with torch.no_grad():
        parts[1].weight.add_(1.0)  # an in-place update (an optimizer step) ...
    torch.testing.assert_close(fused.weight[4:], parts[1].weight)  # ... reaches the fused


def test_column_major_keeps_the_parameter_its_values_and_a_tied_embedding():
    g = torch.Generator().manual_seed(6)
    emb, head = nn.Embedding(40, 16), nn.Linear(16, 40, bias=False)
    head.weight = emb.weight  # tied, as SmolLM2's head
    with torch.no_grad():
        emb.weight.copy_(torch.randn(40, 16, generator=g))
    param, before = head.weight, head.weight.detach().clone()
    x, ids = torch.randn(3, 16, generator=g), torch.tensor([[3, 39, 0]])
    y, e = head(x), emb(ids)
    column_major(head)
    assert head.weight is param and emb.weight is param and param.shape == (40, 16)
    assert param.stride() == (1, 40)  # (K, N) memory
    assert torch.equal(param, before)
    torch.testing.assert_close(head(x), y)  # a different kernel: sum order may differ
    assert torch.equal(emb(ids), e)  # lookups read the strided rows
    column_major(head)  # already column-major: unchanged
    assert param.stride() == (1, 40)
    narrow = nn.Linear(40, 16)  # N <= K: row-major is as fast, left as it is
    column_major(narrow)
    assert narrow.weight.stride() == (40, 1)


@pytest.mark.parametrize("layout", ["rows", "transposed"])
def test_parts_of_one_fused_tensor_fuse_back_into_it_without_a_copy(layout):
    # As loaded: Phi-3's qkv_proj split into row blocks ("rows"), GPT-2's Conv1D c_attn
    # (stored (in, out)) a transposed view split the same way ("transposed").
    g = torch.Generator().manual_seed(0)
    whole = torch.randn(24, 8, generator=g) if layout == "rows" else torch.randn(8, 24).T
    bias = torch.randn(24, generator=g)
    parts = [nn.Linear(8, n) for n in (8, 12, 4)]
    x = torch.randn(3, 8, generator=g)
    with torch.no_grad():
        pieces = zip(whole.split([8, 12, 4]), bias.split([8, 12, 4]), strict=True)
        for lin, (w, b) in zip(parts, pieces, strict=True):
            lin.weight.data, lin.bias.data = w, b
    separate = torch.cat([p(x) for p in parts], dim=-1)
    fused = fuse_rows(parts, share_float=True)
    assert fused is not None
    if layout == "transposed":  # already column-major, the fast one-row layout: kept
        assert fused.weight.data_ptr() == whole.data_ptr()
        assert fused.weight.stride() == whole.stride()
    else:  # row-major: copied once into column-major (quant.column_major explains why)
        assert fused.weight.stride() == (1, 24) and torch.equal(fused.weight, whole)
    assert fused.bias.data_ptr() == bias.data_ptr()
    torch.testing.assert_close(fused(x), separate)
    # Rows out of order are not one tensor: copied, same products.
    swapped = [parts[1], parts[0]]
    fused = fuse_rows(swapped, share_float=True)
    assert fused is not None and fused.weight.data_ptr() != whole.data_ptr()
    torch.testing.assert_close(fused(x), torch.cat([p(x) for p in swapped], dim=-1))


def test_int4_parts_of_any_row_count_fuse_and_of_other_group_sizes_do_not():
    """The codes are held per row, so parts of 32 and 48 rows (off PyTorch's 64-row
    packing tile) stack; the fused product is each part's, bit for bit."""
    g = torch.Generator().manual_seed(7)
    parts = [Int4Linear.from_float(torch.randn(n, 64, generator=g)) for n in (32, 48)]
    fused = fuse_rows(parts)
    assert isinstance(fused, Int4Linear) and fused.out_features == 80
    x = torch.randn(3, 64, generator=g).bfloat16()
    torch.testing.assert_close(
        fused.product(x), torch.cat([m.product(x) for m in parts], dim=1), atol=0, rtol=0
    )
    torch.testing.assert_close(fused.weight, torch.cat([m.weight for m in parts]))
    other = Int4Linear.from_float(torch.randn(32, 64, generator=g), group_size=64)
    assert fuse_rows([parts[0], other]) is None
    assert fuse_rows([nn.Linear(8, 4), Int8Linear.from_float(torch.randn(4, 8))]) is None


def _q4_1_blocks(rng: np.random.Generator, n_blocks: int) -> np.ndarray:
    d = (rng.integers(1, 64, n_blocks) / 512).astype(np.float16)  # exact in bf16 too
    m = (rng.integers(-64, 64, n_blocks) / 64).astype(np.float16)
    qs = rng.integers(0, 256, (n_blocks, 16), dtype=np.uint8)
    head = np.stack([d, m], axis=1).view(np.uint8)  # (N, 4)
    return np.concatenate([head, qs], axis=1)  # (N, 20)


def test_gguf_q4_1_codes_pack_to_the_same_weights_as_ggml_dequantises():
    gquants = pytest.importorskip("gguf.quants", reason="pip install 'attnlab[pretrained]'")
    rng = np.random.default_rng(3)
    R, K = 64, 64
    blocks = _q4_1_blocks(rng, R * K // 32)
    # gguf-py's own Q4_1 dequantisation (llama.cpp's Python package), on the file's bytes.
    raw = blocks.reshape(R, K // 32 * 20)  # one row of blocks per weight row, as stored
    expected = torch.from_numpy(gquants.dequantize(raw, gquants.GGMLQuantizationType.Q4_1))
    assert expected.shape == (R, K)
    codes, scales, zeros = int4_codes(blocks, "Q4_1", (R, K))
    # The file's bytes as they are: the format holds Q4_1's codes in their own layout.
    assert torch.equal(codes, torch.from_numpy(blocks[:, 4:].copy()).reshape(R, K // 2))
    lin = Int4Linear.from_stored((codes, scales, zeros))
    torch.testing.assert_close(lin.weight, expected, atol=0, rtol=0)
    torch.testing.assert_close(dequantize(blocks, "Q4_1", (R, K)), expected, atol=0, rtol=0)
    with pytest.raises(ValueError, match="Q4_0/Q4_1"):
        int4_codes(blocks, "Q8_0", (R, K))


@pytest.mark.parametrize("K", [24, 40])
def test_int8_takes_the_dense_product_where_the_kernel_cannot(K):
    """torch's int8 kernel gives wrong numbers (one row) or crashes (several) for a K that
    is not a multiple of 16: such calls multiply the dequantised weight instead."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(K, 80)
    q = Int8Linear.from_float(linear.weight, linear.bias)
    for rows in (1, 3):
        x = torch.randn(rows, K)
        with torch.no_grad():
            expected = x @ q.weight.T + linear.bias
            torch.testing.assert_close(q(x), expected, atol=0.05, rtol=0.02)
            # the decode step's bare kernel takes the same guard
            dtype, bare = decode_product(q)
            got = bare(x.to(dtype))  # bias added by decode_product
            torch.testing.assert_close(got.float(), expected, atol=0.05, rtol=0.02)


def _q4_k_blocks(rng: np.random.Generator, n_blocks: int) -> np.ndarray:
    """Q4_K super-blocks (144 bytes): fp16 d and dmin, 12 bytes of 6-bit scales and mins,
    128 bytes of nibbles; every bit pattern is a valid block."""
    d = (rng.random((n_blocks, 2)) * 0.02).astype(np.float16).view(np.uint8)  # d, dmin
    rest = rng.integers(0, 256, (n_blocks, 140), dtype=np.uint8)
    return np.concatenate([d, rest], axis=1)  # (N, 144)


def test_gguf_q4_k_codes_pack_to_ggml_dequantisation_up_to_bf16_scales():
    gquants = pytest.importorskip("gguf.quants", reason="pip install 'attnlab[pretrained]'")
    rng = np.random.default_rng(5)
    R, K = 64, 512
    blocks = _q4_k_blocks(rng, R * K // 256)
    raw = blocks.reshape(R, K // 256 * 144)  # one row of super-blocks per weight row
    expected = torch.from_numpy(gquants.dequantize(raw, gquants.GGMLQuantizationType.Q4_K))
    assert expected.shape == (R, K)
    held, scales, zeros = int4_codes(blocks, "Q4_K", (R, K))
    assert held.shape == (R, K // 2) and scales.shape == zeros.shape == (R, K // 32)
    codes = unpack_nibbles(held)  # (R, K)
    # In float32 the sub-blocks' scale and zero give gguf-py's values exactly (but for
    # the one rounding of zero = 8 d sc - dmin m) ...
    rebuilt = (codes.float() - 8) * scales.repeat_interleave(32, 1) + zeros.repeat_interleave(32, 1)
    torch.testing.assert_close(rebuilt, expected, atol=1e-6, rtol=1e-6)
    # ... and the kernel's bf16 scale and zero move a weight by at most their rounding
    # (relative 2^-8 each).
    lin = Int4Linear.from_stored((held, scales, zeros))
    s, z = scales.repeat_interleave(32, 1), zeros.repeat_interleave(32, 1)
    bound = 2**-8 * ((codes.float() - 8).abs() * s.abs() + z.abs()) + 1e-6  # unit roundoff
    err = (lin.weight - expected).abs()
    assert bool((err <= bound).all()), (err / bound).max()
    torch.testing.assert_close(dequantize(blocks, "Q4_K", (R, K)), expected, atol=0, rtol=0)
    with pytest.raises(ValueError, match="whole blocks"):
        int4_codes(blocks, "Q4_K", (4 * R, K // 4))  # rows of half a super-block


def test_q8_0_holds_gguf_q8_0_values_as_stored():
    """llama.cpp's Q8_0 (gguf-py's quantiser) read back as q8_0: the file's codes and
    float16 scales as stored (the code reader, and again from the dequantised values), each
    weight the file's value exactly; the product, the bare one-row kernel, a prompt and a
    fused pair agree with it."""
    gquants = pytest.importorskip("gguf.quants", reason="pip install 'attnlab[pretrained]'")
    from attnlab.pretrained.gguf_file import q8_0_codes

    T = gquants.GGMLQuantizationType.Q8_0
    rng = np.random.default_rng(3)
    N, K = 48, 96
    raw = gquants.quantize(rng.standard_normal((N, K)).astype(np.float32), T)
    values = torch.from_numpy(np.ascontiguousarray(gquants.dequantize(raw, T)))  # d * q
    blocks = raw.reshape(N, K // 32, 34)
    d = torch.from_numpy(blocks[..., :2].copy().view(np.float16)).reshape(N, K // 32)
    q = torch.from_numpy(blocks[..., 2:].copy().view(np.int8)).reshape(N, K)
    stored = Q8Linear.from_rows(q8_0_codes(raw, "Q8_0", (N, K)))
    layer = Q8Linear.from_float(values)
    for held in (stored, layer):
        assert torch.equal(held.codes, q) and torch.equal(held.scales, d)
        assert held.scales.dtype == torch.float16
        assert torch.equal(held.weight, values)
    x = torch.randn(3, K)
    reference = (x.double() @ values.double().T).float()
    torch.testing.assert_close(layer(x), reference, atol=0.05, rtol=0.02)
    dtype, bare = decode_product(layer)
    torch.testing.assert_close(bare(x.to(dtype)).float(), reference, atol=0.05, rtol=0.02)
    # a prompt (the dense path: each weight rounded once to bf16) agrees too
    layer.dense_from_tokens = 16  # decided here, not measured
    prompt = torch.randn(21, K).bfloat16().float()  # as run
    torch.testing.assert_close(
        layer(prompt), (prompt.double() @ values.double().T).float(), atol=0.05, rtol=0.02
    )
    fused = fuse_rows([layer, Q8Linear.from_float(values[:16])])
    assert isinstance(fused, Q8Linear)
    assert torch.equal(fused.weight, torch.cat([values, values[:16]]))
    assert layer.codes.data_ptr() == fused.codes.data_ptr()  # a view, not a copy
    # a shape the int4 halves (the path without the native build) cannot pack: int8
    assert Q8Linear.why_not(N + 4, K) is not None and Q8Linear.fallback == "int8"
    with pytest.raises(ValueError, match="whole blocks"):
        q8_0_codes(raw, "Q8_0", (2 * N, K // 2))  # 48 columns: not whole blocks


def test_q8_0_prompt_dequantises_a_few_million_weights_at_a_time(monkeypatch):
    """The dense path in row chunks (a 262144-row head is 670 MB in float32) gives the
    product of the whole bf16 weight: each column is the same rows' sum."""
    layer = Q8Linear.from_float(torch.randn(200, 64))
    layer.dense_from_tokens = 16  # decided here, not measured
    x = torch.randn(17, 64).bfloat16()
    whole = torch.mm(x, layer.weight.to(torch.bfloat16).t())  # (M, N)
    monkeypatch.setattr(Q8Linear, "_dense_chunk", 48 * 64)  # 48 rows a chunk: 5 chunks
    chunked = layer.product(x)
    assert chunked.shape == whole.shape and chunked.dtype == torch.bfloat16
    torch.testing.assert_close(chunked, whole, atol=1e-2, rtol=1e-2)
    reference = x.double() @ layer.weight.double().t()
    torch.testing.assert_close(chunked.double(), reference, atol=0.05, rtol=0.02)


# gguf-py quantises no K type; Q5_0 goes to q5_0 as stored (test_native_q5.py)
@pytest.mark.parametrize("type_name", ["Q5_1"])
def test_q8_0_holds_gguf_5_and_6_bit_values_to_8_bits_a_block(type_name):
    """int4 sends llama.cpp's 5- and 6-bit types but Q5_0 to q8_0: gguf-py's values (its own
    quantiser and dequantiser) quantised once more to 8-bit codes with a scale per 32
    weights, each weight at most half a step from the file's value: 1/254 of its block's
    largest value, the step rounded up to float16 (by at most 2^-10 of it)."""
    gquants = pytest.importorskip("gguf.quants", reason="pip install 'attnlab[pretrained]'")
    assert Int4Linear.gguf_instead[type_name] == "q8_0"
    T = gquants.GGMLQuantizationType[type_name]
    rng = np.random.default_rng(4)
    N, K = 32, 256  # Q6_K's super-blocks are 256 weights
    raw = gquants.quantize(rng.standard_normal((N, K)).astype(np.float32), T)
    values = torch.from_numpy(np.ascontiguousarray(gquants.dequantize(raw, T)))  # (N, K)
    layer = Q8Linear.from_float(values)
    block_max = values.view(N, K // 32, 32).abs().amax(-1, keepdim=True)  # (N, K/32, 1)
    error = (layer.weight - values).view(N, K // 32, 32).abs()
    assert (error <= block_max / 254 * (1 + 2**-10)).all()
    assert error.amax() > 0  # not the file's values exactly: a second quantisation


def test_each_format_owns_its_gguf_blocks_reader_and_help_line():
    """A format's GGUF block layout agrees with gguf-py's table of sizes, each GGUF type is
    held as stored by one format at most, and the CLI's help names every precision."""
    gconst = pytest.importorskip("gguf.constants", reason="pip install 'attnlab[pretrained]'")
    blocks = gguf_blocks()
    assert {"Q4_0", "Q4_1", "Q4_K", "Q8_0", "Q5_0"} <= set(blocks)
    for type_name, block in blocks.items():
        qtype = gconst.GGMLQuantizationType[type_name]
        assert gconst.GGML_QUANT_SIZES[qtype] == (block.values, block.nbytes), type_name
        fmt = gguf_format(type_name)
        assert fmt is not None and fmt.gguf_types == frozenset(fmt.gguf_blocks)
        assert type_name in fmt.gguf_types
        assert fmt.gguf_codes.__func__ is not WeightFormat.gguf_codes.__func__, fmt.name
    assert gguf_format("Q6_K") is None  # dequantised by gguf-py, then held as q8_0
    text = dtype_help()
    for name in WEIGHT_DTYPES:
        assert name in text, name
    for fmt in WEIGHT_FORMATS.values():
        assert fmt.cli_help and fmt.cli_help in text, fmt.name


def test_a_gguf_type_is_held_as_stored_by_one_format(monkeypatch):
    class Other(WeightFormat):
        name = "other-q8"
        gguf_blocks = MappingProxyType({"Q8_0": GGUFBlock(32, 34, 1)})

    monkeypatch.setattr(quant_base, "WEIGHT_FORMATS", dict(WEIGHT_FORMATS))
    with pytest.raises(ValueError, match="'q8_0' holds"):
        register_format(Other)


@pytest.mark.parametrize(
    ("dtype", "type_name", "expected"),
    [
        ("int4", "Q4_K", ("int4", True)),
        ("int4", "Q5_0", ("q5_0", True)),
        ("int4", "Q8_0", ("q8_0", True)),
        ("int4", "Q6_K", ("q8_0", False)),  # the values, quantised again to 8 bits
        ("int4", "F32", None),
        ("q8_0", "Q4_0", None),
        ("float32", "Q4_0", None),
    ],
)
def test_gguf_holding_names_the_format_and_whether_the_codes_are_kept(dtype, type_name, expected):
    held = gguf_holding(dtype, type_name)
    assert (None if held is None else (held.format.name, held.stored)) == expected


def test_the_former_names_still_work():
    w = torch.randn(64, 64)
    a, b = Q8Linear.from_float(w), Q8Linear.from_float(w)
    assert fuse_rows is fuse_linears
    stored = (a.codes, a.scales)
    assert Q8Linear.rows_shape(stored) == Q8Linear.weight_shape(stored) == (64, 64)
    assert torch.equal(Q8Linear.from_rows(stored).weight, b.weight)


# PyTorch packs int4 weights in the layout of the CPU kernels it chose (ATEN_CPU_CAPABILITY):
# a CPU without AVX-512 packs otherwise than the machine these tests usually run on. The
# layer's packing for PyTorch's kernel, made from its codes, must multiply by them under each.
_INT4_UNDER = """
import os, sys, torch
from attnlab.quant import Int4Linear
got = torch.backends.cpu.get_cpu_capability()
assert got == sys.argv[1], got
g = torch.Generator().manual_seed(0)
N, K, gs = 208, 64, 32  # three tiles of 64 (six of 32) and a tail of 16
codes = torch.randint(0, 16, (N, K), generator=g)
scales = torch.randint(1, 64, (N, K // gs), generator=g).float() / 256
zeros = torch.randint(-64, 64, (N, K // gs), generator=g).float() / 128
lin = Int4Linear.from_codes(codes, scales, zeros)
assert torch.equal(lin.codes_t(), codes.t().to(torch.uint8)), "codes read back wrong"
w = (codes - 8) * scales.repeat_interleave(gs, 1) + zeros.repeat_interleave(gs, 1)
torch.testing.assert_close(lin.weight, w)
lin.dense_from_tokens = 16  # decided here, not measured
x = torch.randn(19, K, generator=g).bfloat16()
dense = lin.product(x).float()  # the prompt's path: dequantised from the codes read back
kernel = lin.decode_kernel()(x).float()  # PyTorch's own kernel on its own packing
torch.testing.assert_close(dense, kernel, atol=0.05 * kernel.abs().max().item(), rtol=0.02)
"""


@pytest.mark.parametrize(
    ("capability", "needs"), [("DEFAULT", ""), ("AVX2", "avx2"), ("AVX512", "avx512bw")]
)
def test_int4_codes_read_back_under_every_set_of_pytorch_cpu_kernels(capability, needs):
    import os
    import subprocess
    import sys
    from pathlib import Path

    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if needs and f" {needs}" not in flags:
        pytest.skip(f"this CPU has no {needs}")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability.lower()}
    run = subprocess.run(
        [sys.executable, "-c", _INT4_UNDER, capability],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.fixture
def prompt_arith(monkeypatch):
    """Set the prompt arithmetic's inputs (environment, CPU flags) and read the choice
    afresh; the process's own choice is restored afterwards."""
    from attnlab import native
    from attnlab.quant import arith

    def choose(flags: str, **env: str) -> tuple[torch.dtype, str]:
        for name in (arith.PROMPT_DTYPE_ENV, "ONEDNN_MAX_CPU_ISA"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setattr(native, "cpu_flags", lambda: f"flags\t\t: {flags}")
        arith.prompt_arithmetic.cache_clear()
        return arith.prompt_arithmetic()

    yield choose
    arith.prompt_arithmetic.cache_clear()


def test_prompt_products_run_in_bf16_only_where_the_cpu_has_bf16_dot_products(prompt_arith):
    """bf16 for a CPU with AVX512-BF16 or AMX (oneDNN's fast kernels), float32 for
    AVX-512 without BF16 (Skylake) and AVX2 alone (PyTorch's bf16 mm converts or loops
    there); ONEDNN_MAX_CPU_ISA below bf16 counts as a CPU without it; the environment
    variable decides outright and a wrong value is refused."""
    skylake = "fpu sse4_2 avx avx2 fma avx512f avx512bw avx512vl avx512dq"
    assert prompt_arith("fpu avx2 fma")[0] == torch.float32
    dtype, why = prompt_arith(skylake)
    assert dtype == torch.float32 and "no bf16 dot products" in why
    assert prompt_arith(f"{skylake} avx512_bf16")[0] == torch.bfloat16
    assert prompt_arith(f"{skylake} amx_bf16 amx_tile")[0] == torch.bfloat16
    dtype, why = prompt_arith(f"{skylake} avx512_bf16", ONEDNN_MAX_CPU_ISA="AVX512_CORE")
    assert dtype == torch.float32 and "ONEDNN_MAX_CPU_ISA=AVX512_CORE" in why
    bf16_cap = {"ONEDNN_MAX_CPU_ISA": "avx512_core_bf16"}
    assert prompt_arith(f"{skylake} avx512_bf16", **bf16_cap)[0] == torch.bfloat16
    assert prompt_arith("fpu avx2", ATTNLAB_PROMPT_DTYPE="bfloat16")[0] == torch.bfloat16
    assert prompt_arith(f"{skylake} avx512_bf16", ATTNLAB_PROMPT_DTYPE="float32")[0] == (
        torch.float32
    )
    with pytest.raises(ValueError, match="ATTNLAB_PROMPT_DTYPE must be one of"):
        prompt_arith("fpu", ATTNLAB_PROMPT_DTYPE="fp16")


@pytest.mark.parametrize("cls", [Int8Linear, Int4Linear, Q8Linear, BF16Linear])
def test_a_float32_prompt_product_is_the_float32_product_of_the_stored_weight(cls, prompt_arith):
    """Where the prompt arithmetic is float32, a prompt's product is that of the float32
    rows (not rounded to bf16) and the stored weight's exact values: within float32's
    summation error of the fp64 product, far inside the bf16 bound; a few rows still go
    to the bf16 kernel."""
    g = torch.Generator().manual_seed(5)
    w, b = torch.randn(96, 64, generator=g) * 0.1, torch.randn(96, generator=g)
    q = cls.from_float(w, b)
    q.dense_from_tokens = 16  # decided here, not measured
    x = torch.randn(21, 64, generator=g)
    prompt_arith("fpu avx2 fma")
    y = q(x)
    exact = x.double() @ q.weight.double().T + b.double()
    bound = 64 * torch.finfo(torch.float32).eps * (x.abs().double() @ q.weight.abs().double().T)
    assert ((y.double() - exact).abs() <= bound + 1e-6).all()
    prompt_arith("fpu avx512_bf16")
    rounded = q(x)
    assert (rounded.double() - exact).abs().max() > 50 * (y.double() - exact).abs().max()
    prompt_arith("fpu avx2 fma")
    few = x[:2] if cls is not BF16Linear else x[:1]
    q.dense_from_tokens = 1 << 30
    _close_bf16_out(q(few), _ref(few, q.weight, b))


@pytest.mark.parametrize(
    ("simd", "want"),
    [
        ("avx2", torch.float32),
        ("avx512", torch.float32),
        ("avx512-bf16", torch.bfloat16),
        ("scalar", torch.bfloat16),
        (None, torch.bfloat16),
    ],
)
def test_decode_rows_are_float32_where_the_native_kernels_quantise_them(simd, want, monkeypatch):
    """On the builds whose q4, q5_0 and q8_0 kernels all quantise rows to 16-bit codes (AVX2,
    AVX-512 without bf16 dots) the decode rows stay float32: nothing is rounded to bf16 on
    the way. Every format takes the same dtype, so a layer's products share their rows."""
    import types

    from attnlab.quant import int4 as int4_mod
    from attnlab.quant import q5_0 as q5_mod
    from attnlab.quant import q8_0 as q8_mod
    from native_branches import INTEGER  # what each branch's kernels code as integers

    q4, q5 = INTEGER.get(simd or "", (False, False))
    ext = None if simd is None else types.SimpleNamespace(SIMD=simd, Q4_INTEGER=q4, Q5_INTEGER=q5)
    assert quant_base.native_rows_dtype(ext) == want
    for module in (int4_mod, q5_mod, q8_mod):
        monkeypatch.setattr(module, "native_kernels", lambda: ext)
    w = torch.randn(32, 64)
    layers = [Int4Linear.from_float(w), Q8Linear.from_float(w), Q5Linear.from_float(w)]
    assert [m.decode_dtype() for m in layers] == [want] * 3
    assert Int8Linear.from_float(w).decode_dtype() == torch.bfloat16  # PyTorch's kernel
