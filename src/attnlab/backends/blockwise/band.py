"""Rows that see a narrow band of keys (a sliding window) as one call of the fused op.

Shape legend: B batch, H query heads, G key/value heads, T query length, S key length, D
head dim, Dv value head dim; W the band's width, bq the rows of one block, L = bq + W - 1
the keys of one block, n the blocks.

Under a band mask local row i sees the keys ``i + a .. i + a + W - 1``. The rows whose
band lies wholly inside the keys (the interior) are cut into blocks of bq rows, and row i
of a block sees key j of the block's L keys exactly when ``0 <= j - i < W``: the same
``(bq, L)`` mask for every block. Strided views put the blocks in the op's batch
dimension (no copy: the blocks' key windows overlap in memory), so the whole interior is
one call of PyTorch's flash op instead of an edge tile, a full tile and a diagonal square
per row block, each a call of its own, merged by log-sum-exp.

Measured on a Xeon with AMX, fp32, H = 12, D = 64, T = 8,192, against one causal call
(``bench_attention.py --variants``; an experiment over bq for the widths): a window of 512
at 0.22x with blocks of 64 rows (0.31x as tiles), of 128 at 0.08x with 32 (0.17x); at
2,048 both ways are 0.6x, so wider bands stay with the tiles.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnlab.backends.blockwise.paths import FUSED_OPS
from attnlab.backends.blockwise.plan import ChunkOptions
from attnlab.backends.blockwise.tiles import NEG_INF
from attnlab.masks import AttentionMask

_MAX_WIDTH = 1024  # wider bands run as fast as tiles (see above)


@dataclass(frozen=True)
class BandRun:
    """The interior rows ``r0 .. r0 + n bq`` (local), in ``n`` blocks of ``bq`` rows;
    block m's keys are ``c0 + m bq .. c0 + m bq + L`` (local), and each row sees ``width``
    of them."""

    r0: int
    n: int
    bq: int
    c0: int
    width: int

    @property
    def r1(self) -> int:
        """One past the last interior row."""
        return self.r0 + self.n * self.bq

    @property
    def keys(self) -> int:
        """Keys of one block (L)."""
        return self.bq + self.width - 1

    @staticmethod
    def of(mask: AttentionMask | None, opts: ChunkOptions, T: int, S: int) -> BandRun | None:
        """The band run of a fused-path chunk of T rows and S keys, or None when the
        mask is no narrow band, the interior has fewer than two blocks, or a block would
        see as many keys as the tiles (explicit block sizes keep the tiles: tests ask
        for them)."""
        if mask is None or opts.block_q is not None or opts.block_k is not None:
            return None
        T_total = T if opts.T_total is None else opts.T_total
        S_total = S if opts.S_total is None else opts.S_total
        band = mask.key_band(T_total, S_total)
        first, last = band if band is not None else (None, 0)
        if first is None:  # no band, or no first key (causal)
            return None
        width = last - first + 1
        if not 1 <= width <= _MAX_WIDTH:
            return None
        bq = 32 if width < 512 else 64
        a = opts.q_offset + first - opts.k_offset  # local row i sees keys i + a ..
        r0 = max(0, -a)  # rows before see keys before 0
        r_end = min(T, S - (a + width - 1))  # rows from here on see keys past S - 1
        n = max(0, r_end - r0) // bq
        if n < 2 or bq + width - 1 >= S:
            return None
        return BandRun(r0, n, bq, r0 + a, width)

    def mask(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The additive ``(1, 1, bq, L)`` mask every block shares."""
        i = torch.arange(self.bq, device=device)[:, None]
        j = torch.arange(self.keys, device=device)[None, :]
        hidden = (j < i) | (j >= i + self.width)
        zeros = torch.zeros(self.bq, self.keys, dtype=dtype, device=device)
        return zeros.masked_fill_(hidden, NEG_INF)[None, None]


def _blocks(t: torch.Tensor, start: int, n: int, step: int, length: int) -> torch.Tensor:
    """``(n, heads, length, D)``: rows ``start + m step ..`` of ``t`` ``(heads, rows, D)``
    for m < n, as a strided view (overlapping where ``length > step``)."""
    sh, st, sd = t.stride()
    return t.as_strided(
        (n, t.shape[0], length, t.shape[2]),
        (step * st, sh, st, sd),
        t.storage_offset() + start * st,
    )


def band_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    run: BandRun,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """Write the interior rows' ``out`` ``(B, H, T, Dv)`` and ``lse`` ``(B, H, T)``.

    query ``(B, H, T, D)``, key ``(B, G, S, D)``, value ``(B, G, S, Dv)``; one op call
    per batch row, its threads over blocks and heads. Every interior row sees at least
    one key, so the op's lse needs no fix for empty rows.
    """
    assert FUSED_OPS is not None
    B, H = query.shape[:2]
    dense = run.mask(out.dtype, query.device)
    n, bq, L = run.n, run.bq, run.keys
    for b in range(B):
        q = _blocks(query[b], run.r0, n, bq, bq)  # (n, H, bq, D)
        k = _blocks(key[b], run.c0, n, bq, L)  # (n, G, L, D)
        v = _blocks(value[b], run.c0, n, bq, L)
        o, l = FUSED_OPS[0](q, k, v, 0.0, False, attn_mask=dense, scale=scale)
        rows = slice(run.r0, run.r1)
        out[b, :, rows].view(H, n, bq, -1).copy_(o.transpose(0, 1))
        lse[b, :, rows].view(H, n, bq).copy_(l.transpose(0, 1))
