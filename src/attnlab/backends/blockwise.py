"""The ``blockwise`` backend: online softmax over key blocks (the FlashAttention
algorithm) in plain PyTorch.

Shape legend: B batch, H query heads, G key/value heads, R = H // G query heads per
key/value head, T query length, S key length, D head dim, Dv value head dim;
tq/tk the rows/keys of one tile.

Forward, for each block of query rows, walking over blocks of keys::

    s     = (q * scale) @ k_blk^T  (+ bias, -inf where not allowed)   one (rows, tk) tile
    m'    = max(m, rowmax(s))                                         running row max
    p     = exp(s - m')
    l     = l * exp(m - m') + rowsum(p)                               running denominator
    acc   = acc * exp(m - m') + p @ v_blk
    out   = acc / l,   lse = m + log(l)

Nothing of size ``T x S`` is ever allocated: the scratch is one tile. Tiles that the mask
removes entirely (``MaskBlock.status == "empty"``, e.g. above a causal diagonal) are
skipped; tiles it allows entirely skip the masking work. The backward pass (a custom
autograd function) recomputes each tile's probabilities from the saved per-row
log-sum-exp instead of storing them, so training memory stays linear in the sequence
length::

    p  = exp(s - lse);  dv += p^T @ dout;  dp = dout @ v_blk^T
    ds = p * (dp - rowsum(dout * out));    dq += ds @ k_blk * scale;  dk += ds^T @ (q * scale)

:func:`attend_chunk`, :func:`attend_chunk_backward` and :func:`merge_partials` are the
reusable pieces: ring attention runs them on the key/value chunk each process holds and
merges partial results by their log-sum-exp (one copy of this logic).

A query row that may attend to nothing ends with ``l = 0``: its output is 0 and its
log-sum-exp is ``-inf`` (its probabilities in the backward are 0).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch

from attnlab.backends.base import AttentionRequest, Backend, BackendResult
from attnlab.masks import AttentionMask, MaskBlock

__all__ = [
    "BACKEND",
    "attend_chunk",
    "attend_chunk_backward",
    "blockwise_attention",
    "default_blocks",
    "merge_partials",
]

_NEG_INF = float("-inf")
# Elements per score tile: 2**20 fp32 = 4 MiB, large enough that the matmuls run
# efficiently and Python overhead is amortised, small enough to stay cache-friendly and far
# below the T x S matrix. 256 keys per tile: smaller tiles waste less work on the causal
# diagonal, larger ones amortise overhead; 256 measured best for B*H = 12, D = 64 on CPU.
_TILE_ELEMENTS = 1 << 20
_BLOCK_K = 256


def default_blocks(BH: int, T: int, S: int) -> tuple[int, int]:
    """Query rows and keys per tile for ``BH = B * H`` query heads in the batch.

    Keys per tile are fixed (256); rows per tile are the power of two (64 to 4096)
    that keeps a tile near ``_TILE_ELEMENTS`` elements.
    """
    block_k = max(1, min(S, _BLOCK_K))
    rows = _TILE_ELEMENTS // max(1, BH * _BLOCK_K)
    block_q = 1 << max(6, min(12, rows.bit_length() - 1))
    return max(1, min(T, block_q)), block_k


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _apply_tile_mask(s: torch.Tensor, blk: MaskBlock, B: int, G: int, R: int, h0: int) -> None:
    """Apply a partial tile in place to scores ``s`` (B*G, R*tq, tk) of query heads
    ``h0 .. h0 + G*R`` (a head group)."""
    tq = s.shape[1] // R
    s5 = s.view(B, G, R, tq, s.shape[2])  # (B, G, R, tq, tk)

    def heads5(t: torch.Tensor) -> torch.Tensor:
        while t.ndim < 4:
            t = t.unsqueeze(0)
        if t.shape[1] == 1:
            return t.unsqueeze(2)  # (b, 1, 1, tq, tk)
        t = t[:, h0 : h0 + G * R]  # this group's heads
        return t.reshape(t.shape[0], G, R, t.shape[2], t.shape[3])  # (b, G, R, tq, tk)

    if blk.bias is not None:
        s5.add_(heads5(blk.bias).to(s.dtype))
    if blk.allowed is not None:
        s5.masked_fill_(~heads5(blk.allowed), _NEG_INF)


def _tile(
    mask: AttentionMask | None,
    T_total: int,
    S_total: int,
    q0: int,
    q1: int,
    k0: int,
    k1: int,
    device: torch.device,
) -> MaskBlock | None:
    """The mask's tile, or None when nothing in it is masked."""
    if mask is None:
        return None
    blk = mask.block(T_total, S_total, slice(q0, q1), slice(k0, k1), device=device)
    return None if blk.status == "full" else blk


def _key_range(
    mask: AttentionMask | None, T_total: int, S_total: int, q0: int, q1: int, k_offset: int, S: int
) -> tuple[int, int]:
    """Local key range ``[lo, hi)`` of this chunk that global rows ``q0:q1`` may see."""
    if mask is None:
        return 0, S
    lo, hi = mask.col_range(T_total, S_total, q0, q1)
    lo, hi = min(max(lo - k_offset, 0), S), min(max(hi - k_offset, 0), S)
    return lo, max(lo, hi)


# -- Parallelism --------------------------------------------------------------------------
# A tile is a handful of PyTorch ops. Run with intra-op threads, every op is a parallel
# region ending in a barrier: hundreds per call, and on a shared, oversubscribed CPU each
# barrier waits for the slowest descheduled thread (measured: 4-20x slower than PyTorch's
# fused kernel, which forks once). So, like that kernel, attnlab forks once: the key/value
# head groups are split over N Python threads (N = torch.get_num_threads()) and each runs
# its ops single-threaded (the ops release the GIL). PyTorch's thread count is global, so
# it is set to 1 for the duration (reference-counted, restored afterwards).
_POOL_LOCK = threading.Lock()
_POOL_STATE = {"users": 0, "saved": 1}
_POOL: ThreadPoolExecutor | None = None


@contextmanager
def _one_thread_per_op() -> Iterator[int]:
    """Set intra-op threads to 1; yield how many worker threads to use instead."""
    global _POOL
    with _POOL_LOCK:
        if _POOL_STATE["users"] == 0:
            _POOL_STATE["saved"] = torch.get_num_threads()
            torch.set_num_threads(1)
        _POOL_STATE["users"] += 1
        workers = _POOL_STATE["saved"]
        if _POOL is None or _POOL._max_workers < workers:
            _POOL = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="attnlab")
    try:
        yield workers
    finally:
        with _POOL_LOCK:
            _POOL_STATE["users"] -= 1
            if _POOL_STATE["users"] == 0:
                torch.set_num_threads(_POOL_STATE["saved"])


def _profiler_enabled() -> bool:
    check = getattr(getattr(torch._C, "_autograd", None), "_profiler_enabled", None)
    return bool(check()) if check is not None else False


def _run_groups(G: int, work: Callable[[int, int], None]) -> None:
    """Run ``work(g0, g1)`` over contiguous ranges of the G key/value heads."""
    threads = torch.get_num_threads()
    if (
        threads <= 1
        or G < 2
        or threading.current_thread().name.startswith("attnlab")
        # torch.profiler records allocations of the profiled thread only: run the groups
        # there so that it sees them all. The scratch is the same either way: each
        # group's tiles scale with its heads, so concurrent groups add up to one tile.
        or _profiler_enabled()
    ):
        work(0, G)
        return
    grad_mode = torch.is_grad_enabled()  # thread-local: carry the caller's into workers

    def run(g0: int, g1: int) -> None:
        with torch.set_grad_enabled(grad_mode):
            work(g0, g1)

    with _one_thread_per_op() as workers:
        n = min(workers, G)
        cuts = [G * i // n for i in range(n + 1)]
        assert _POOL is not None
        futures = [_POOL.submit(run, cuts[i], cuts[i + 1]) for i in range(n)]
        for f in futures:
            f.result()  # re-raises a worker's exception


def attend_chunk(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: AttentionMask | None,
    scale: float,
    *,
    q_offset: int = 0,
    k_offset: int = 0,
    T_total: int | None = None,
    S_total: int | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a chunk of queries to a chunk of keys/values, tile by tile.

    The chunks sit at rows ``q_offset..`` and columns ``k_offset..`` of the full
    ``(T_total, S_total)`` problem the mask is defined on (defaults: the chunks are the
    whole problem).

    Args:
        query: ``(B, H, T, D)``.
        key: ``(B, G, S, D)``.
        value: ``(B, G, S, Dv)``.
        mask: attnlab mask of the full problem, or None.
        scale: score scale.
        q_offset, k_offset: absolute position of the chunks' first row/column.
        T_total, S_total: size of the full problem.
        block_q, block_k: tile size (default :func:`default_blocks`).

    Returns:
        ``(out, lse)``: the output normalised within this chunk ``(B, H, T, Dv)`` and the
        per-row log-sum-exp ``(B, H, T)`` (``-inf`` where a row saw nothing), both in the
        compute dtype (fp32 for fp16/bf16). Merge chunks with :func:`merge_partials`.
    """
    B, H, T, D = query.shape
    G, S, Dv = key.shape[1], key.shape[2], value.shape[3]
    R = H // G
    T_total = T if T_total is None else T_total
    S_total = S if S_total is None else S_total
    bq, bk = default_blocks(B * H, T, S)
    bq = block_q or bq
    bk = block_k or bk
    cd = _compute_dtype(query.dtype)
    dev = query.device
    q5 = query.reshape(B, G, R, T, D)  # (B, G, R, T, D)
    out = torch.empty(B, G, R, T, Dv, dtype=cd, device=dev)
    lse = torch.empty(B, G, R, T, dtype=cd, device=dev)

    def work(g0: int, g1: int) -> None:
        Gs = g1 - g0
        BG = B * Gs
        k3 = key[:, g0:g1].reshape(BG, S, D).to(cd)  # (B*Gs, S, D), a view when B == 1
        v3 = value[:, g0:g1].reshape(BG, S, Dv).to(cd)  # (B*Gs, S, Dv)
        for q0 in range(0, T, bq):
            q1 = min(T, q0 + bq)
            tq = q1 - q0
            qb = q5[:, g0:g1, :, q0:q1].reshape(BG, R * tq, D).to(cd) * scale  # (BG, R*tq, D)
            m: torch.Tensor | None = None  # running row max (BG, R*tq)
            l: torch.Tensor | None = None  # running denominator (BG, R*tq)
            acc: torch.Tensor | None = None  # running numerator (BG, R*tq, Dv)
            lo, hi = _key_range(mask, T_total, S_total, q_offset + q0, q_offset + q1, k_offset, S)
            for k0 in range(lo, hi, bk):
                k1 = min(hi, k0 + bk)
                blk = _tile(mask, T_total, S_total, q_offset + q0, q_offset + q1,
                            k_offset + k0, k_offset + k1, dev)  # fmt: skip
                if blk is not None and blk.status == "empty":
                    continue
                s = torch.bmm(qb, k3[:, k0:k1].transpose(1, 2))  # (BG, R*tq, tk)
                if blk is not None:
                    _apply_tile_mask(s, blk, B, Gs, R, g0 * R)
                m_blk = s.amax(dim=-1)  # (BG, R*tq)
                m_new = m_blk if m is None else torch.maximum(m, m_blk)
                # A masked tile can leave a row at max -inf; subtract 0 there, not -inf.
                m_use = m_new if blk is None else m_new.masked_fill(m_new == _NEG_INF, 0.0)
                s.sub_(m_use.unsqueeze(-1)).exp_()  # p, in place
                if m is None or acc is None or l is None:
                    l = s.sum(dim=-1)
                    acc = torch.bmm(s, v3[:, k0:k1])  # (BG, R*tq, Dv)
                else:
                    alpha = torch.exp_(m.sub_(m_use))  # rescales the old sums (in place on m)
                    l.mul_(alpha).add_(s.sum(dim=-1))
                    acc.mul_(alpha.unsqueeze(-1)).baddbmm_(s, v3[:, k0:k1])
                m = m_new
            if m is None or acc is None or l is None:  # every tile of these rows was empty
                out[:, g0:g1, :, q0:q1] = 0
                lse[:, g0:g1, :, q0:q1] = _NEG_INF
                continue
            empty = l == 0
            acc.div_(l.masked_fill(empty, 1.0).unsqueeze(-1))
            out[:, g0:g1, :, q0:q1] = acc.view(B, Gs, R, tq, Dv)
            row_lse = m.add_(torch.log(l)).masked_fill_(empty, _NEG_INF)
            lse[:, g0:g1, :, q0:q1] = row_lse.view(B, Gs, R, tq)

    _run_groups(G, work)
    return out.view(B, H, T, Dv), lse.view(B, H, T)


def attend_chunk_backward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    grad_out: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    mask: AttentionMask | None,
    scale: float,
    *,
    q_offset: int = 0,
    k_offset: int = 0,
    T_total: int | None = None,
    S_total: int | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of a chunk pair, recomputing each tile from the row log-sum-exp.

    Args:
        query, key, value: as :func:`attend_chunk`.
        grad_out: gradient of the (final, merged) output ``(B, H, T, Dv)``.
        lse: the final per-row log-sum-exp ``(B, H, T)`` over *all* keys.
        delta: ``rowsum(grad_out * out)`` of the final output, ``(B, H, T)``.
        mask, scale, q_offset, k_offset, T_total, S_total, block_q, block_k: as
            :func:`attend_chunk`.

    Returns:
        ``(dq, dk, dv)`` contributions of this chunk pair in the compute dtype, shaped as
        query, key and value.
    """
    B, H, T, D = query.shape
    G, S, Dv = key.shape[1], key.shape[2], value.shape[3]
    R = H // G
    T_total = T if T_total is None else T_total
    S_total = S if S_total is None else S_total
    bq, bk = default_blocks(B * H, T, S)
    bq = block_q or bq
    bk = block_k or bk
    cd = _compute_dtype(query.dtype)
    dev = query.device
    q5 = query.reshape(B, G, R, T, D)  # (B, G, R, T, D)
    do5 = grad_out.reshape(B, G, R, T, Dv)  # (B, G, R, T, Dv)
    # A row that saw nothing has lse = -inf; +inf makes its probabilities exp(s - inf) = 0.
    lse4 = lse.to(cd).masked_fill(lse == _NEG_INF, float("inf")).reshape(B, G, R, T)
    delta4 = delta.to(cd).reshape(B, G, R, T)
    dq = torch.zeros(B, G, R, T, D, dtype=cd, device=dev)
    dk = torch.zeros(B, G, S, D, dtype=cd, device=dev)
    dv = torch.zeros(B, G, S, Dv, dtype=cd, device=dev)

    def work(g0: int, g1: int) -> None:
        Gs = g1 - g0
        BG = B * Gs
        k3 = key[:, g0:g1].reshape(BG, S, D).to(cd)  # (B*Gs, S, D)
        v3 = value[:, g0:g1].reshape(BG, S, Dv).to(cd)  # (B*Gs, S, Dv)
        # Accumulate straight into dk/dv when the group's slice is contiguous (B == 1).
        dk3 = dk[:, g0:g1].reshape(BG, S, D)  # (B*Gs, S, D)
        dv3 = dv[:, g0:g1].reshape(BG, S, Dv)  # (B*Gs, S, Dv)
        for q0 in range(0, T, bq):
            q1 = min(T, q0 + bq)
            tq = q1 - q0
            qb = q5[:, g0:g1, :, q0:q1].reshape(BG, R * tq, D).to(cd) * scale  # (BG, R*tq, D)
            dob = do5[:, g0:g1, :, q0:q1].reshape(BG, R * tq, Dv).to(cd)  # (BG, R*tq, Dv)
            lse_b = lse4[:, g0:g1, :, q0:q1].reshape(BG, R * tq, 1)
            delta_b = delta4[:, g0:g1, :, q0:q1].reshape(BG, R * tq, 1)
            dqb: torch.Tensor | None = None  # (BG, R*tq, D)
            lo, hi = _key_range(mask, T_total, S_total, q_offset + q0, q_offset + q1, k_offset, S)
            for k0 in range(lo, hi, bk):
                k1 = min(hi, k0 + bk)
                blk = _tile(mask, T_total, S_total, q_offset + q0, q_offset + q1,
                            k_offset + k0, k_offset + k1, dev)  # fmt: skip
                if blk is not None and blk.status == "empty":
                    continue
                kb, vb = k3[:, k0:k1], v3[:, k0:k1]
                s = torch.bmm(qb, kb.transpose(1, 2))  # (BG, R*tq, tk)
                if blk is not None:
                    _apply_tile_mask(s, blk, B, Gs, R, g0 * R)
                p = s.sub_(lse_b).exp_()  # probabilities, in place
                # Accumulating into a strided slice with baddbmm_ falls back to one addmm
                # per batch item (slow); a contiguous product plus add_ is much faster.
                dv3[:, k0:k1].add_(torch.bmm(p.transpose(1, 2), dob))  # dv += p^T dout
                dp = torch.bmm(dob, vb.transpose(1, 2))  # (BG, R*tq, tk)
                ds = p.mul_(dp.sub_(delta_b))  # dS = p * (dp - delta), in place on p
                dqb = torch.bmm(ds, kb) if dqb is None else dqb.baddbmm_(ds, kb)
                dk3[:, k0:k1].add_(torch.bmm(ds.transpose(1, 2), qb))  # qb carries the scale
            if dqb is not None:
                dq[:, g0:g1, :, q0:q1] = dqb.mul_(scale).view(B, Gs, R, tq, D)
        if dk3.data_ptr() != dk[:, g0:g1].data_ptr() or B > 1:  # reshape had to copy
            dk[:, g0:g1] = dk3.view(B, Gs, S, D)
            dv[:, g0:g1] = dv3.view(B, Gs, S, Dv)

    _run_groups(G, work)
    return dq.view(B, H, T, D), dk, dv


def merge_partials(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    *,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial attentions over disjoint key sets by their log-sum-exp.

    ``out = (exp(lse_a) * out_a + exp(lse_b) * out_b) / (exp(lse_a) + exp(lse_b))``,
    computed stably; a side with ``lse = -inf`` (saw nothing) contributes nothing.

    Args:
        out_a, lse_a: the first partial (with ``inplace``, the accumulator: may be views,
            e.g. row slices of a larger output).
        out_b, lse_b: the second partial.
        inplace: write the result into ``out_a`` and ``lse_a`` and use ``out_b`` as
            scratch (it is overwritten), so that merging allocates nothing of ``out``'s
            size; ring attention merges each chunk into its accumulators this way.

    Returns:
        ``(out, lse)``; with ``inplace``, ``out_a`` and ``lse_a`` themselves.

    Shape:
        - out_a, out_b: ``(..., T, Dv)``; lse_a, lse_b: ``(..., T)``; returns the same.
    """
    lse = torch.logaddexp(lse_a, lse_b)  # (..., T); -inf only if both are -inf
    safe = lse.masked_fill(lse == _NEG_INF, 0.0)
    wa = torch.exp(lse_a - safe).unsqueeze(-1)  # exp(-inf) = 0 for an empty side
    wb = torch.exp(lse_b - safe).unsqueeze(-1)
    if not inplace:
        return out_a * wa + out_b * wb, lse
    out_a.mul_(wa).add_(out_b.mul_(wb))
    lse_a.copy_(lse)
    return out_a, lse_a


class _BlockwiseAttention(torch.autograd.Function):
    """Blockwise forward; backward recomputes tiles from the saved log-sum-exp."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: AttentionMask | None,
        scale: float,
        block_q: int | None,
        block_k: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = attend_chunk(query, key, value, mask, scale, block_q=block_q, block_k=block_k)
        out = out.to(query.dtype)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.mask, ctx.scale, ctx.blocks = mask, scale, (block_q, block_k)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor, grad_lse: torch.Tensor | None):  # type: ignore[override]
        query, key, value, out, lse = ctx.saved_tensors
        # e.g. the gradient of .sum() is an expanded (stride 0) tensor: BLAS needs real
        # strides, else bmm falls back to a slow per-batch loop.
        grad_out = grad_out.contiguous()
        cd = _compute_dtype(query.dtype)
        delta = (grad_out.to(cd) * out.to(cd)).sum(dim=-1)  # (B, H, T)
        dq, dk, dv = attend_chunk_backward(
            query, key, value, grad_out, lse, delta, ctx.mask, ctx.scale,
            block_q=ctx.blocks[0], block_k=ctx.blocks[1],
        )  # fmt: skip
        return (
            dq.to(query.dtype),
            dk.to(key.dtype),
            dv.to(value.dtype),
            None,
            None,
            None,
            None,
        )


def blockwise_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: AttentionMask | None,
    *,
    dropout_p: float,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> BackendResult:
    """Online-softmax attention with linear memory; returns the output and the row LSE.

    Shape:
        - query ``(B, H, T, D)``, key ``(B, G, S, D)``, value ``(B, G, S, Dv)``
        - output ``(B, H, T, Dv)``, lse ``(B, H, T)``
    """
    if dropout_p > 0:
        raise ValueError(_why_not_dropout(dropout_p))
    if softcap is not None or sinks is not None:
        raise ValueError("blockwise does not implement softcap or sinks yet; use 'math'")
    out, lse = _BlockwiseAttention.apply(query, key, value, mask, scale, block_q, block_k)
    return BackendResult(output=out, lse=lse)


def _why_not_dropout(p: float) -> str:
    return (
        f"blockwise does not implement attention dropout (dropout_p={p}); use 'sdpa' or "
        "'math', or dropout_p=0 (evaluation)"
    )


def _why_not(request: AttentionRequest) -> str | None:
    if request.dropout_p > 0:
        return _why_not_dropout(request.dropout_p)
    if request.mask is not None and request.mask.bias_requires_grad:
        return (
            "blockwise does not compute gradients for an additive mask (the attn_mask "
            "tensor requires grad); use 'math' or 'sdpa'"
        )
    if request.softcap is not None:
        return "blockwise does not implement logit soft-capping yet; use 'math'"
    if request.sinks:
        return "blockwise does not implement attention sinks yet; use 'math'"
    return None


BACKEND = Backend(
    name="blockwise",
    run=blockwise_attention,
    why_not=_why_not,
    summary=(
        "online softmax over key tiles (FlashAttention in plain PyTorch); O(T) memory, "
        "skips masked tiles, returns log-sum-exp, recomputing backward"
    ),
)
