"""The compiled float32 readings of a GGUF file's Q5_0 blocks and Q4_K / Q6_K super-blocks
(``q5_0.h``, ``kquants.h``): equal bit for bit to ggml's formulas written out here weight by
weight in numpy's float32, with the count of blocks whose float16 scale is inf or NaN.
Run under every compiled branch (``tests/native_branches.py``); ``tests/files/test_gguf.py``
checks the loader's readings against gguf-py."""

from __future__ import annotations

import numpy as np
import pytest
import torch


def _f16(values: np.ndarray) -> np.ndarray:
    """float16 values as their bytes, (n, 2 * k) uint8."""
    return values.astype(np.float16).view(np.uint8).reshape(values.shape[0], -1)


def _blocks(n: int, nbytes: int, scale_at: tuple[int, ...], seed: int) -> np.ndarray:
    """Random blocks, every byte drawn, float16 scales of both signs and several sizes
    (a subnormal among them) at ``scale_at``."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n, nbytes), dtype=np.uint8)
    for at in scale_at:
        scales = rng.standard_normal((n, 1)) * 10.0 ** rng.integers(-6, 0, (n, 1))
        scales[0] = 3e-7  # a float16 subnormal
        blocks[:, at : at + 2] = _f16(scales)
    return blocks


def _scale(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 scale at byte ``at`` of every block, as float32 (n, 1)."""
    return blocks[:, at : at + 2].copy().view(np.float16).astype(np.float32)


def _read(ext, kernel: str, blocks: np.ndarray, width: int) -> tuple[np.ndarray, int]:
    out = torch.full((blocks.shape[0], width), float("nan"))
    bad = getattr(ext, kernel)(torch.from_numpy(blocks), out)
    return out.numpy(), bad


def _spoil(blocks: np.ndarray, where: list[tuple[int, int, float]]) -> np.ndarray:
    bad = blocks.copy()
    for row, at, value in where:
        bad[row, at : at + 2] = _f16(np.array([[value]]))
    return bad


def test_q5_0_blocks(ext):
    """Weight j < 16: low nibble of byte 6 + j, its fifth bit bit j of the little-endian
    uint32 in bytes 2-5; weight 16 + j: the high nibble, bit 16 + j; ``d (q - 16)``."""
    n = 333
    blocks = _blocks(n, 22, (0,), seed=1)
    qh = blocks[:, 2:6].copy().view("<u4")  # (n, 1)
    j = np.arange(32)
    nib = np.where(j < 16, blocks[:, 6 + j % 16] & 15, blocks[:, 6 + j % 16] >> 4)
    q = nib.astype(np.int64) | (((qh >> j) & 1).astype(np.int64) << 4)  # (n, 32)
    want = _scale(blocks, 0) * (q - 16).astype(np.float32)
    got, bad = _read(ext, "q5_0_blocks_float32", blocks, 32)
    assert bad == 0 and np.array_equal(got, want)
    spoiled = _spoil(blocks, [(2, 0, np.nan), (7, 0, np.inf)])
    assert _read(ext, "q5_0_blocks_float32", spoiled, 32)[1] == 2
    with pytest.raises(RuntimeError, match="q5_0_blocks_float32: blocks must be"):
        ext.q5_0_blocks_float32(torch.from_numpy(blocks[:, :21].copy()), torch.empty(n, 32))
    with pytest.raises(RuntimeError, match="q5_0_blocks_float32: out must be"):
        ext.q5_0_blocks_float32(torch.from_numpy(blocks), torch.empty(n, 31))


def _q4_k_scale_min(sm: np.ndarray, s: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml's get_scale_min_k4 for sub-block ``s`` of the 12 packed bytes ``sm`` (n, 12)."""
    sm = sm.astype(np.int64)
    if s < 4:
        return sm[:, s] & 63, sm[:, s + 4] & 63
    return (sm[:, s + 4] & 15) | ((sm[:, s - 4] >> 6) << 4), (sm[:, s + 4] >> 4) | (
        (sm[:, s] >> 6) << 4
    )


def test_q4_k_super_blocks(ext):
    """Sub-block s of 32: codes the low (s even) or high (s odd) nibbles of bytes
    16 + 32 (s // 2) ...; ``(d sc) q - (dmin m)``, the product and the difference rounded
    apart (a fused multiply-add would differ)."""
    n = 211
    blocks = _blocks(n, 144, (0, 2), seed=2)
    d, dmin = _scale(blocks, 0), _scale(blocks, 2)
    want = np.empty((n, 256), dtype=np.float32)
    for s in range(8):
        sc, m = _q4_k_scale_min(blocks[:, 4:16], s)
        pair = blocks[:, 16 + 32 * (s // 2) : 16 + 32 * (s // 2) + 32]
        q = (pair >> (4 * (s % 2))) & 15  # (n, 32)
        product = q.astype(np.float32) * (d * sc[:, None].astype(np.float32))
        want[:, 32 * s : 32 * s + 32] = product - dmin * m[:, None].astype(np.float32)
    got, bad = _read(ext, "q4_k_blocks_float32", blocks, 256)
    assert bad == 0 and np.array_equal(got.view(np.uint32), want.view(np.uint32))
    spoiled = _spoil(blocks, [(0, 2, -np.inf), (4, 0, np.nan), (4, 2, np.nan)])
    assert _read(ext, "q4_k_blocks_float32", spoiled, 256)[1] == 2  # a block counts once
    with pytest.raises(RuntimeError, match="q4_k_blocks_float32: blocks must be"):
        ext.q4_k_blocks_float32(torch.from_numpy(blocks[:, :143].copy()), torch.empty(n, 256))
    with pytest.raises(RuntimeError, match="q4_k_blocks_float32: out must be"):
        ext.q4_k_blocks_float32(torch.from_numpy(blocks), torch.empty(n, 256).t())


def test_q6_k_super_blocks(ext):
    """Weight i of half h (i < 128): low bits the low nibble of ql[64 h + i] (i < 64) or
    the high one of ql[64 h + i - 64]; top bits ``qh[32 h + i % 32] >> 2 (i // 32)``;
    ``(d sc[i // 16]) (q - 32)``, with d the block's last two bytes."""
    n = 97
    blocks = _blocks(n, 210, (208,), seed=3)
    d = _scale(blocks, 208)
    sc = blocks[:, 192:208].view(np.int8).astype(np.float32)  # (n, 16)
    w = np.arange(256)
    h, i = w // 128, w % 128
    ql = blocks[:, 64 * h + i % 64].astype(np.int64)
    low = np.where(i < 64, ql & 15, ql >> 4)
    top = (blocks[:, 128 + 32 * h + i % 32].astype(np.int64) >> (2 * (i // 32))) & 3
    q = low | (top << 4)  # (n, 256)
    want = (q - 32).astype(np.float32) * (d * sc[:, w // 16])
    got, bad = _read(ext, "q6_k_blocks_float32", blocks, 256)
    assert bad == 0 and np.array_equal(got.view(np.uint32), want.view(np.uint32))
    spoiled = _spoil(blocks, [(5, 208, np.inf)])
    assert _read(ext, "q6_k_blocks_float32", spoiled, 256)[1] == 1
    with pytest.raises(RuntimeError, match="q6_k_blocks_float32: blocks must be"):
        ext.q6_k_blocks_float32(torch.from_numpy(blocks[:, :209].copy()), torch.empty(n, 256))


def test_a_run_of_strings_is_walked_for_its_lengths(ext):
    """string_run: the lengths and the end of a run of GGUF strings (u64 length, bytes),
    as a walk in Python finds them; -1 where a length field or a string passes the end."""
    import struct

    rng = np.random.default_rng(4)
    texts = [
        bytes(rng.integers(0, 256, int(rng.integers(0, 40)), dtype=np.uint8)) for _ in range(500)
    ]
    head = b"\x07" * 5  # the run starts inside the buffer
    raw = head + b"".join(struct.pack("<Q", len(t)) + t for t in texts) + b"rest"
    buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    end, lengths = ext.string_run(buf, len(head), len(texts))
    assert end == len(raw) - 4 and lengths.tolist() == [len(t) for t in texts]
    assert ext.string_run(buf, len(head), 0)[0] == len(head)
    cut = torch.frombuffer(bytearray(raw[:-8]), dtype=torch.uint8)  # the last string cut short
    assert ext.string_run(cut, len(head), len(texts))[0] == -1
    huge = bytearray(raw)
    huge[len(head) : len(head) + 8] = struct.pack("<Q", (1 << 64) - 1)  # past any end
    assert ext.string_run(torch.frombuffer(huge, dtype=torch.uint8), len(head), 3)[0] == -1
    assert ext.string_run(buf, len(raw) - 7, 1)[0] == -1  # not even a length field
    with pytest.raises(RuntimeError, match="cannot start at"):
        ext.string_run(buf, len(raw) + 1, 1)
    with pytest.raises(RuntimeError, match="contiguous 1-D uint8"):
        ext.string_run(buf.view(-1, 1), 0, 1)
