"""Ring attention: exact attention over a sequence split across the ranks of a process group.

Every rank holds query, key and value for the same positions (its shard, see
:mod:`attnlab.distributed.sharding`). Key/value shards travel around the ring: at step
``i`` rank ``r`` attends its queries over the shard of rank ``r - i`` while the next shard
is already in flight (non-blocking sends/receives posted before the compute). Partial
outputs merge by log-sum-exp with the blockwise kernel's merge, so the result equals
single-process attention. The backward pass sends key/value around again, with their
gradient accumulators travelling one hop behind, and each shard's dK/dV arrives home
after ``N`` hops.

Faults never hang: every wait on a transfer has a deadline (the process group's timeout
unless ``timeout=`` is given); a rank that died or stalled makes the others raise
:class:`RingAttentionError`. Ranks first agree on shapes, dtype and options with one small
``all_gather``, so disagreements raise a clear ``ValueError`` before any key/value moves.

Shape legend: B batch, H query heads, G key/value heads (H % G == 0), R = H/G query heads
per key/value head, T local shard length, D head dim, Dv value head dim, N world size.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from attnlab.backends.blockwise import attend_chunk, attend_chunk_backward, merge_partials
from attnlab.backends.request import check_softcap
from attnlab.distributed.sharding import Segment, check_layout, local_segments
from attnlab.masks import CausalMask

__all__ = ["RingAttentionError", "RingStats", "ring_attention"]

_KV_TAG, _GRAD_TAG = 10, 20
# Elements of one transient partial output (query rows x B*H*Dv) in the forward: 2 MiB fp32.
_PIECE_ELEMENTS = 1 << 19
_CAUSAL = CausalMask(alignment="top_left")  # over global positions (T_total == S_total)
_LAYOUT_CODES = {"contiguous": 0, "zigzag": 1}
_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}


class RingAttentionError(RuntimeError):
    """A transfer between ranks failed or timed out (a rank died, stalled or left)."""


@dataclass
class RingStats:
    """Where a rank's time went, accumulated over calls (forward and backward).

    A mutable recorder, not a config: pass one as ``stats=`` to measure.
    """

    compute_s: float = 0.0  # wall time in block kernels
    compute_cpu_s: float = 0.0  # CPU time of the calling thread in block kernels (the work
    # itself, not stretched by other processes sharing the cores)
    wait_s: float = 0.0  # blocked on transfers: the communication the overlap did not hide
    bytes_sent: int = 0
    steps: int = 0
    step_compute_s: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class _RingConfig:
    group: dist.ProcessGroup | None
    rank: int
    world_size: int
    prev_peer: int  # global ranks, for point-to-point ops
    next_peer: int
    layout: str
    is_causal: bool
    scale: float
    softcap: float | None
    timeout: timedelta
    block_size: int | None
    overlap: bool
    stats: RingStats | None


# --- communication --------------------------------------------------------------------


class _Exchange:
    """Sends to the next rank and receives from the previous one, in flight."""

    def __init__(
        self, cfg: _RingConfig, tensors: list[torch.Tensor], what: str, step: int, tag: int
    ):
        self.cfg, self.what, self.step = cfg, what, step
        tensors = [t.contiguous() for t in tensors]  # point-to-point ops need contiguous buffers
        self.received = [torch.empty_like(t) for t in tensors]
        # Tags keep key/value and gradient messages apart (gloo); both sides post in one order.
        ops = [
            dist.P2POp(dist.isend, t, cfg.next_peer, cfg.group, tag + i)
            for i, t in enumerate(tensors)
        ]
        ops += [
            dist.P2POp(dist.irecv, b, cfg.prev_peer, cfg.group, tag + i)
            for i, b in enumerate(self.received)
        ]
        try:
            self.works = dist.batch_isend_irecv(ops)
        except RuntimeError as exc:
            raise _comm_error(cfg, what, step, exc) from exc
        if cfg.stats is not None:
            cfg.stats.bytes_sent += sum(t.numel() * t.element_size() for t in tensors)

    def wait(self) -> list[torch.Tensor]:
        t0 = time.perf_counter()
        for work in self.works:
            _wait(work, self.cfg, self.what, self.step)
        if self.cfg.stats is not None:
            self.cfg.stats.wait_s += time.perf_counter() - t0
        return self.received


def _wait(work: dist.Work, cfg: _RingConfig, what: str, step: int) -> None:
    try:
        work.wait(cfg.timeout)
    except RuntimeError as exc:
        raise _comm_error(cfg, what, step, exc) from exc


def _comm_error(cfg: _RingConfig, what: str, step: int, exc: Exception) -> RingAttentionError:
    prev_rank = (cfg.rank - 1) % cfg.world_size
    next_rank = (cfg.rank + 1) % cfg.world_size
    return RingAttentionError(
        f"ring attention on rank {cfg.rank} of {cfg.world_size}: {what} at step {step} "
        f"(receiving from rank {prev_rank}, sending to rank {next_rank}) did not complete "
        f"within the {cfg.timeout.total_seconds():g} s timeout: a rank died, stalled, or "
        f"skipped the call. The process group is unusable now; restart the job. "
        f"(transport said: {str(exc).splitlines()[0][:300]})"
    )


def _group_timeout(group: dist.ProcessGroup | None, device: torch.device) -> timedelta:
    pg = group if group is not None else dist.group.WORLD
    try:
        return pg._get_backend(device).options._timeout  # type: ignore[union-attr]
    except (AttributeError, RuntimeError):
        return dist.distributed_c10d.default_pg_timeout


# --- validation -----------------------------------------------------------------------


def _check_local(query: object, key: object, value: object) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _DTYPE_CODES:
            raise TypeError(
                f"`{name}` must be float16, bfloat16, float32 or float64, got {t.dtype}"
            )
        if t.ndim != 4:
            raise ValueError(f"`{name}` must be 4-D (B, heads, T, D), got shape {tuple(t.shape)}")
        if t.numel() == 0:
            raise ValueError(f"`{name}` must not be empty, got shape {tuple(t.shape)}")
    assert isinstance(query, torch.Tensor)
    assert isinstance(key, torch.Tensor)
    assert isinstance(value, torch.Tensor)
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise TypeError(
            f"`key` and `value` must have the dtype of `query` ({query.dtype}), "
            f"got {key.dtype} and {value.dtype}"
        )
    if key.device != query.device or value.device != query.device:
        raise ValueError(
            f"`query`, `key`, `value` must be on one device, got {query.device}, "
            f"{key.device}, {value.device}"
        )
    b, h, t, d = query.shape
    if key.shape[0] != b or value.shape[0] != b:
        raise ValueError(f"`key`/`value` must have batch size {b} like `query`")
    if key.shape[-1] != d:
        raise ValueError(
            f"`key` must have the same head dim as `query` (D={d}), got D={key.shape[-1]}"
        )
    if value.shape[:3] != key.shape[:3]:
        raise ValueError(
            f"`value` must match `key` in (B, G, S) = {tuple(key.shape[:3])}, "
            f"got {tuple(value.shape[:3])}"
        )
    g = key.shape[1]
    if h % g:
        raise ValueError(f"query heads H={h} must be a multiple of key/value heads G={g}")
    if key.shape[2] != t:
        raise ValueError(
            f"ring attention is self-attention over one sharded sequence: `key` must hold "
            f"the same positions as `query` (T={t}), got S={key.shape[2]}"
        )


def _agree(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cfg: _RingConfig,
) -> None:
    """One small all_gather so that every rank sees every rank's shapes and options."""
    mine = [
        *query.shape,
        *key.shape,
        value.shape[-1],
        _DTYPE_CODES[query.dtype],
        int(cfg.is_causal),
        _LAYOUT_CODES[cfg.layout],
        cfg.scale,
        cfg.softcap or 0.0,
    ]
    local = torch.tensor(mine, dtype=torch.float64, device=query.device)
    everyone = [torch.empty_like(local) for _ in range(cfg.world_size)]
    try:
        work = dist.all_gather(everyone, local, group=cfg.group, async_op=True)
    except RuntimeError as exc:
        raise _comm_error(cfg, "checking shapes (all_gather)", 0, exc) from exc
    assert work is not None
    _wait(work, cfg, "checking shapes (all_gather)", 0)
    rows = [e.tolist() for e in everyone]
    if all(r == rows[0] for r in rows):
        return
    names = {v: k for k, v in _DTYPE_CODES.items()}
    layouts = {v: k for k, v in _LAYOUT_CODES.items()}
    desc = "; ".join(
        f"rank {i}: query {tuple(int(x) for x in r[0:4])}, key {tuple(int(x) for x in r[4:8])}, "
        f"Dv={int(r[8])}, {names[int(r[9])]}, is_causal={bool(r[10])}, "
        f"layout={layouts[int(r[11])]!r}, scale={r[12]:g}, softcap={r[13]:g}"
        for i, r in enumerate(rows)
    )
    raise ValueError(
        "ring_attention: ranks disagree on shapes or options; every rank must pass an "
        "equal-sized shard (use attnlab.distributed.shard_sequence) and the same "
        f"is_causal/layout/scale/softcap. Got {desc}"
    )


# --- block loops ----------------------------------------------------------------------


def _pairs(cfg: _RingConfig, t: int, src: int) -> list[tuple[Segment, Segment, bool]]:
    """(query segment, key segment, needs mask) pairs this rank computes for ``src``'s block.

    Pairs that the causal mask removes entirely are left out; a pair the mask allows
    entirely runs without a mask.
    """
    pairs = []
    for qs in local_segments(t, cfg.rank, cfg.world_size, cfg.layout):
        for ks in local_segments(t, src, cfg.world_size, cfg.layout):
            if not cfg.is_causal:
                pairs.append((qs, ks, False))
            elif ks.global_start <= qs.global_start + qs.length - 1:
                needs_mask = ks.global_start + ks.length - 1 > qs.global_start
                pairs.append((qs, ks, needs_mask))
    return pairs


def _kernel_args(cfg: _RingConfig, qs: Segment, ks: Segment, t_total: int, masked: bool) -> dict:
    return {
        "mask": _CAUSAL if masked else None,
        "scale": cfg.scale,
        "softcap": cfg.softcap,
        "q_offset": qs.global_start,
        "k_offset": ks.global_start,
        "T_total": t_total,
        "S_total": t_total,
        "block_q": cfg.block_size,
        "block_k": cfg.block_size,
    }


def _forward_step(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    acc_out: torch.Tensor,
    acc_lse: torch.Tensor,
    src: int,
    cfg: _RingConfig,
) -> None:
    """Merge the attention of local queries over rank ``src``'s key/value into the accumulators.

    query ``(B, H, T, D)``; key ``(B, G, T, D)``; value ``(B, G, T, Dv)``;
    acc_out ``(B, H, T, Dv)``; acc_lse ``(B, H, T)`` (compute dtype).
    """
    t = query.shape[-2]
    b, h, _, dv = acc_out.shape
    rows = max(1, _PIECE_ELEMENTS // max(1, b * h * dv))  # query rows per piece
    for qs, ks, masked in _pairs(cfg, t, src):
        ka, kb = ks.local_start, ks.local_start + ks.length
        # Query rows in pieces, each merged in place into the accumulators: the transient
        # partial output is one piece, not a shard.
        for p0 in range(0, qs.length, rows):
            piece = Segment(qs.local_start + p0, qs.global_start + p0, min(rows, qs.length - p0))
            qa, qb = piece.local_start, piece.local_start + piece.length
            masked_piece = masked and ks.global_start + ks.length - 1 > piece.global_start
            out, lse = attend_chunk(
                query[:, :, qa:qb],
                key[:, :, ka:kb],
                value[:, :, ka:kb],
                **_kernel_args(cfg, piece, ks, t * cfg.world_size, masked_piece),
            )
            merge_partials(acc_out[:, :, qa:qb], acc_lse[:, :, qa:qb], out, lse, inplace=True)
            del out, lse


def _backward_step(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    src: int,
    cfg: _RingConfig,
) -> None:
    """Add this rank's gradient contributions for rank ``src``'s key/value block."""
    t = query.shape[-2]
    for qs, ks, masked in _pairs(cfg, t, src):
        qa, qb = qs.local_start, qs.local_start + qs.length
        ka, kb = ks.local_start, ks.local_start + ks.length
        dq_c, dk_c, dv_c = attend_chunk_backward(
            query[:, :, qa:qb],
            key[:, :, ka:kb],
            value[:, :, ka:kb],
            grad_out[:, :, qa:qb],
            out[:, :, qa:qb],
            lse[:, :, qa:qb],
            **_kernel_args(cfg, qs, ks, t * cfg.world_size, masked),
        )
        dq[:, :, qa:qb] += dq_c
        dk[:, :, ka:kb] += dk_c
        dv[:, :, ka:kb] += dv_c


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _timed(cfg: _RingConfig, fn, *args) -> None:  # type: ignore[no-untyped-def]
    t0, c0 = time.perf_counter(), time.thread_time()
    fn(*args)
    if cfg.stats is not None:
        if args[1].is_cuda:  # kernels run asynchronously: time them, not their launch
            torch.cuda.synchronize(args[1].device)
        dt = time.perf_counter() - t0
        cfg.stats.compute_cpu_s += time.thread_time() - c0
        cfg.stats.compute_s += dt
        cfg.stats.step_compute_s.append(dt)
        cfg.stats.steps += 1


def _ring_forward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cfg: _RingConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    b, h, t, _ = query.shape
    cdt = _compute_dtype(query.dtype)
    acc_out = query.new_zeros(b, h, t, value.shape[-1], dtype=cdt)  # (B, H, T, Dv)
    acc_lse = query.new_full((b, h, t), float("-inf"), dtype=cdt)  # (B, H, T)
    kv = [key.contiguous(), value.contiguous()]
    n = cfg.world_size
    for step in range(n):
        src = (cfg.rank - step) % n
        pending: _Exchange | None = None
        nxt: list[torch.Tensor] | None = None
        if step < n - 1:
            pending = _Exchange(cfg, kv, "forward key/value transfer", step, _KV_TAG)
            if not cfg.overlap:
                nxt = pending.wait()
        _timed(cfg, _forward_step, query, kv[0], kv[1], acc_out, acc_lse, src, cfg)
        if pending is not None:
            kv = nxt if nxt is not None else pending.wait()
            # Drop the exchange (it references the block just sent) before the next one
            # allocates its receive buffers: live K/V stay at the inputs, the block being
            # computed and the one in flight.
            pending = nxt = None
    return acc_out.to(query.dtype), acc_lse


def _ring_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cfg: _RingConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cdt = _compute_dtype(query.dtype)
    dq = query.new_zeros(query.shape, dtype=cdt)  # (B, H, T, D)
    kv = [key.contiguous(), value.contiguous()]
    n = cfg.world_size
    grad_pending: _Exchange | None = None
    for step in range(n):
        src = (cfg.rank - step) % n
        kv_pending = None
        if step < n - 1:
            kv_pending = _Exchange(cfg, kv, "backward key/value transfer", step, _KV_TAG)
        dk = key.new_zeros(key.shape, dtype=cdt)  # (B, G, T, D)
        dv = value.new_zeros(value.shape, dtype=cdt)  # (B, G, T, Dv)
        args = (grad_out, query, kv[0], kv[1], out, lse, dq, dk, dv, src, cfg)
        _timed(cfg, _backward_step, *args)
        if grad_pending is not None:
            upstream = grad_pending.wait()  # this block's dK/dV from the ranks before us
            dk += upstream[0]
            dv += upstream[1]
        # Pass the block's accumulated dK/dV one hop on; after N hops they are home.
        grad_pending = _Exchange(cfg, [dk, dv], "backward dK/dV transfer", step, _GRAD_TAG)
        if kv_pending is not None:
            kv = kv_pending.wait()
    assert grad_pending is not None
    dk_home, dv_home = grad_pending.wait()
    return dq.to(query.dtype), dk_home.to(key.dtype), dv_home.to(value.dtype)


class _RingAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cfg: _RingConfig,
    ) -> torch.Tensor:
        out, lse = _ring_forward(query, key, value, cfg)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.cfg = cfg  # type: ignore[attr-defined]
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[no-untyped-def, override]
        query, key, value, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(grad_out, query, key, value, out, lse, ctx.cfg)
        return dq, dk, dv, None


def _resolve_group(group: dist.ProcessGroup | None) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "ring_attention needs a torch.distributed process group, and none is "
            "initialised: call torch.distributed.init_process_group('gloo' or 'nccl', ...) "
            "on every rank first (or run under torchrun / `attnlab ring-demo`)"
        )
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"`group` must be a torch.distributed.ProcessGroup or None, got {group!r}")
    if group is not None and dist.get_rank(group) < 0:
        raise ValueError("`group` does not contain this rank; call ring_attention only on members")


def _global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    softcap: float | None = None,
    layout: str = "contiguous",
    timeout: float | timedelta | None = None,
    block_size: int | None = None,
    overlap: bool = True,
    check: bool = True,
    stats: RingStats | None = None,
) -> torch.Tensor:
    """Exact scaled dot-product attention over a sequence sharded across a process group.

    Every rank of ``group`` calls it with its own shard: query, key and value for the
    same positions, laid out as ``layout`` says (see :func:`shard_sequence`). The result
    is this rank's shard of ``softmax(Q K^T * scale + causal mask) V`` over the *whole*
    sequence; gradients flow to every rank's query/key/value shard. Every rank must call
    backward too when one does.

    Args:
        query: local queries ``(B, H, T, D)``.
        key: local keys ``(B, G, T, D)``, ``H % G == 0`` (grouped-query attention).
        value: local values ``(B, G, T, Dv)``.
        group: the ring's process group (default: the default group).
        is_causal: causal mask over global positions (position i sees j <= i).
        scale: score scale, default ``1/sqrt(D)``.
        softcap: logit soft-capping ``softcap * tanh(s / softcap)`` of the scaled scores
            (before the causal mask), or None.
        layout: ``"contiguous"`` or ``"zigzag"`` (balances causal work across ranks).
        timeout: seconds (or timedelta) to wait for any one transfer before raising
            :class:`RingAttentionError`; default: the process group's timeout.
        block_size: tile size of the block kernel (default: the blockwise backend's).
        overlap: post the next transfer before computing (False waits first; for
            measuring what overlap hides).
        check: agree on shapes/options across ranks with one small all_gather first.
        stats: a :class:`RingStats` to accumulate compute/wait time and bytes sent.

    Returns:
        This rank's output shard ``(B, H, T, Dv)``.

    Shape:
        - query: ``(B, H, T, D)``; key: ``(B, G, T, D)``; value: ``(B, G, T, Dv)``
        - output: ``(B, H, T, Dv)``

    Raises:
        RuntimeError: no process group is initialised.
        TypeError: non-tensor or non-floating input, mixed dtypes.
        ValueError: bad shapes, ranks that disagree on shapes/options, a shard length the
            layout cannot use, bad scale/timeout/block_size.
        RingAttentionError: a transfer failed or timed out (a rank died or stalled).
    """
    _resolve_group(group)
    _check_local(query, key, value)
    check_layout(layout)
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    if not isinstance(scale, (int, float)) or not (0 < scale < float("inf")):
        raise ValueError(f"`scale` must be a positive finite number, got {scale!r}")
    softcap = check_softcap(softcap)
    if block_size is not None and (not isinstance(block_size, int) or block_size < 1):
        raise ValueError(f"`block_size` must be a positive int, got {block_size!r}")
    if timeout is None:
        wait_for = _group_timeout(group, query.device)
    elif isinstance(timeout, timedelta):
        wait_for = timeout
    elif isinstance(timeout, (int, float)) and timeout > 0:
        wait_for = timedelta(seconds=float(timeout))
    else:
        raise ValueError(f"`timeout` must be positive seconds or a timedelta, got {timeout!r}")
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    cfg = _RingConfig(
        group=group,
        rank=rank,
        world_size=n,
        prev_peer=_global_rank(group, (rank - 1) % n),
        next_peer=_global_rank(group, (rank + 1) % n),
        layout=layout,
        is_causal=bool(is_causal),
        scale=float(scale),
        softcap=softcap,
        timeout=wait_for,
        block_size=block_size,
        overlap=overlap,
        stats=stats,
    )
    if check:
        _agree(query, key, value, cfg)
    t = query.shape[-2]
    if layout == "zigzag" and t % 2:
        raise ValueError(
            f"layout='zigzag' needs an even shard length (two equal chunks per rank), got "
            f"T={t} on every rank; the full sequence length must be a multiple of 2*{n}"
        )
    return _RingAttentionFunction.apply(query, key, value, cfg)
