"""ALiBi on fused tiles as one more head dimension: no dense bias at all.

Shape legend: B batch, H query heads, N heads of a tensor, L its length, D head dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attnlab.backends.blockwise.paths import TilePath
from attnlab.backends.blockwise.plan import Geometry, RowBlock
from attnlab.biases import AlibiBias
from attnlab.masks import AndMask, AttentionMask, CausalMask

# A key whose score is this far below the row's own key's has a weight under e^-110 of
# it: 0 in float32 (its smallest subnormal is 2^-149 = e^-103.3), and far below float64's
# rounding of the row's sum.
_ZERO_GAP = 110.0
# The first key a head needs, rounded down to this many keys: heads of one worker whose
# first keys agree run as one op call.
_FIRST_KEY_STEP = 256

# Rows per block: the key column is centred on each row block, so its rounding error grows
# with the block (fp32: ~6e-8 * slope * rows / 2 on a score); 1024 rows cost little more
# than one call (benchmarks/bench_attention.py --variants).
LINEAR_BLOCK_Q = 1024


@dataclass(frozen=True)
class LinearBias:
    """ALiBi on the fused path, as one more head dimension: no dense bias at all.

    For query position ``P_i`` and key ``j``, ``-slope_h (P_i - j) = slope_h (j - c) -
    slope_h (P_i - c)`` for any ``c``. The first term is a product of a per-head and a
    per-key number: query column ``D`` holds ``slope_h``, key column ``D`` holds
    ``(j - c) / scale`` (value column ``D`` is 0), so the op's ``scale * q'.k'`` adds it.
    The second term is constant along a row: it leaves the softmax unchanged and only moves
    the row's log-sum-exp, subtracted after the row block. ``c`` is the row block's middle
    row, so the added numbers stay small where the weights are (near the diagonal: at most
    ``slope * rows / 2``, whose fp32 rounding is ~1.5e-5 for slope 1/2 and 1024 rows; far
    keys, where they are large, have vanishing weights); half precision is not taken (its
    key column would round). The rest of the mask (causal or nothing) is planned
    as usual, so plain causal's op calls serve ALiBi.
    """

    slopes: torch.Tensor  # (H,), in the query dtype
    rest: AttentionMask | None

    @staticmethod
    def of(mask: AttentionMask | None, path: TilePath, query: torch.Tensor) -> LinearBias | None:
        """The helper when the call is ALiBi (& causal) on fused fp32/fp64 tiles, else None."""
        if path != "fused" or query.dtype not in (torch.float32, torch.float64):
            return None
        parts = mask.parts if isinstance(mask, AndMask) else (mask,)
        alibi = [p for p in parts if isinstance(p, AlibiBias)]
        rest = [p for p in parts if not isinstance(p, AlibiBias)]
        if len(alibi) != 1 or alibi[0].slopes.requires_grad or len(rest) > 1:
            return None
        if rest and not isinstance(rest[0], CausalMask):
            return None
        slopes = alibi[0].slopes.to(device=query.device, dtype=query.dtype)
        return LinearBias(slopes, rest[0] if rest else None)

    @staticmethod
    def widen(t: torch.Tensor, column: torch.Tensor | None = None) -> torch.Tensor:
        """``t`` ``(B, N, L, D)`` with a column ``D`` appended: ``column`` or zeros."""
        out = t.new_zeros(*t.shape[:-1], t.shape[-1] + 1)  # (B, N, L, D + 1)
        out[..., :-1] = t
        if column is not None:
            out[..., -1] = column
        return out

    def widen_query(self, query: torch.Tensor) -> torch.Tensor:
        return self.widen(query, self.slopes[None, :, None])  # slope_h in every row

    @staticmethod
    def _center(rb: RowBlock, geo: Geometry) -> int:
        return geo.q_offset + (rb.r0 + rb.r1) // 2 + geo.S_total - geo.T_total

    def enter(
        self, key: torch.Tensor, g0: int, g1: int, rb: RowBlock, geo: Geometry, scale: float
    ) -> None:
        """Write key column ``D`` of heads ``g0:g1`` for row block ``rb``: ``(j - c) / scale``."""
        j = torch.arange(key.shape[2], device=key.device, dtype=torch.float64) + geo.k_offset
        key[:, g0:g1, :, -1] = ((j - self._center(rb, geo)) / scale).to(key.dtype)

    def row_shift(self, rb: RowBlock, geo: Geometry, h0: int, h1: int) -> torch.Tensor:
        """``slope_h (P_i - c)`` for the rows of ``rb``, ``(1, Hs, tq)``: op lse - true lse."""
        first = geo.q_offset + geo.S_total - geo.T_total
        pos = torch.arange(rb.r0, rb.r1, device=self.slopes.device, dtype=torch.float64) + first
        rel = (pos - self._center(rb, geo)).to(self.slopes.dtype)
        return (self.slopes[h0:h1, None] * rel[None])[None]

    def first_keys(
        self,
        query: torch.Tensor,
        key_norms: list[float],
        rb: RowBlock,
        geo: Geometry,
        S: int,
        g0: int,
        g1: int,
        scale: float,
    ) -> list[tuple[int, int, int]]:
        """Runs ``(ga, gb, first)`` of key heads ``g0:g1``: the rows of ``rb`` need only
        the keys from ``first`` (local) on for those heads.

        A steep head's far keys have weights far below float32's range: for query ``i``
        at position ``P``, key ``j < P`` and the row's own key ``P`` (which the op's
        running maximum is at least), ``w_j / w_P = exp(scale q.(k_j - k_P) - slope (P -
        j)) <= exp(2 scale |q| max|k| - slope (P - j))``, under ``e^-110`` from ``P - j >=
        (2 scale |q| max|k| + 110) / slope`` on. Those keys are left out of the row block
        (their weights would be 0; computing them, Intel cores would take their slow path
        for every subnormal). Only where every row's own key is among the chunk's keys;
        else, and for a slope that is not positive, a head needs every key.

        query ``(B, H, T, D + 1)`` (widened); ``key_norms`` the largest ``|k|`` of each
        key head (G,); S the chunk's keys.
        """
        H, G = query.shape[1], len(key_norms)
        R = H // G
        own = geo.q_offset + rb.r0 + geo.S_total - geo.T_total - geo.k_offset  # row r0's key
        if own <= 0 or own + (rb.r1 - rb.r0) > S:
            return [(g0, g1, 0)]
        rows = query[:, g0 * R : g1 * R, rb.r0 : rb.r1, :-1]  # (B, Hs, tq, D)
        q_norms = torch.linalg.vector_norm(rows.double(), dim=-1).amax(dim=(0, 2)).tolist()
        slopes = self.slopes[g0 * R : g1 * R].double().tolist()
        runs: list[tuple[int, int, int]] = []
        for g in range(g0, g1):
            first = own
            for r in range(R):
                h = (g - g0) * R + r
                gap = 2.0 * scale * q_norms[h] * key_norms[g] + _ZERO_GAP
                reach = gap / slopes[h] if slopes[h] > 0 else math.inf
                first = min(first, own - math.ceil(reach) if math.isfinite(reach) else 0)
            first = max(0, first // _FIRST_KEY_STEP * _FIRST_KEY_STEP)
            if runs and runs[-1][2] == first:
                runs[-1] = (runs[-1][0], g + 1, first)
            else:
                runs.append((g, g + 1, first))
        return runs
