"""Ring attention on real spawned gloo processes (127.0.0.1) against the fp64 reference.

Each world size is spawned once for the whole numeric grid (causal x layout x dtype);
the parametrised tests then compare each configuration's gathered output and gradients.
"""

from __future__ import annotations

import itertools
import os
import time

import pytest
import torch

from attnlab.distributed import (
    RingAttentionError,
    gather_sequence,
    ring_attention,
    shard_positions,
    shard_sequence,
)
from attnlab.distributed.launch import spawn_local
from reference import reference_attention, tol

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

B, H, G, D, DV = 2, 4, 2, 8, 6
BLOCK = 4  # small tiles so partial and skipped tiles both occur
SOFTCAP = 1.5
CONFIGS = list(
    itertools.product([False, True], ["contiguous", "zigzag"], [torch.float32, torch.float64])
)


def _inputs(n: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    t = 2 * n * 3 + 2 * n  # divisible by 2N, several tiles per chunk
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, t, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, G, t, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, G, t, DV, generator=g, dtype=torch.float64)
    dout = torch.randn(B, H, t, DV, generator=g, dtype=torch.float64)
    return tuple(x.to(dtype) for x in (q, k, v, dout))


def _grid_worker(rank: int, n: int) -> dict[tuple[bool, str, str], dict[str, torch.Tensor]]:
    from attnlab.distributed import ring

    # Forward merges query pieces of 3 rows (across tile and chunk edges) into the output.
    ring._PIECE_ELEMENTS = 3 * B * H * DV
    results = {}
    for causal, layout, dtype in CONFIGS:
        q, k, v, dout = _inputs(n, dtype)
        shards = [shard_sequence(x, layout=layout).requires_grad_() for x in (q, k, v)]
        out = ring_attention(*shards, is_causal=causal, layout=layout, block_size=BLOCK)
        (out * shard_sequence(dout, layout=layout)).sum().backward()
        got = {"out": out.detach()}
        got.update({name: s.grad for name, s in zip(("dq", "dk", "dv"), shards, strict=True)})
        gathered = {name: gather_sequence(x, layout=layout) for name, x in got.items()}
        if rank == 0:
            results[(causal, layout, str(dtype))] = gathered
    # Logit soft-capping rides along in every tile (forward and backward).
    q, k, v, dout = _inputs(n, torch.float64)
    shards = [shard_sequence(x, layout="zigzag").requires_grad_() for x in (q, k, v)]
    out = ring_attention(
        *shards, is_causal=True, layout="zigzag", block_size=BLOCK, softcap=SOFTCAP
    )
    (out * shard_sequence(dout, layout="zigzag")).sum().backward()
    got = {"out": out.detach()}
    got.update({name: s.grad for name, s in zip(("dq", "dk", "dv"), shards, strict=True)})
    gathered = {name: gather_sequence(x, layout="zigzag") for name, x in got.items()}
    if rank == 0:  # (the gather is a collective: every rank takes part)
        results["softcap"] = gathered
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def grid(request: pytest.FixtureRequest) -> tuple[int, dict]:
    n = request.param
    outcomes = spawn_local(_grid_worker, n, timeout=180, pg_timeout=60)
    for o in outcomes:
        assert o.ok, f"rank {o.rank}: {o.error_type}: {o.error}\n{o.traceback}"
    return n, outcomes[0].value


@pytest.mark.parametrize(
    ("causal", "layout", "dtype"), CONFIGS, ids=[f"{c}-{lay}-{d}" for c, lay, d in CONFIGS]
)
def test_ring_matches_single_process(
    grid: tuple[int, dict], causal: bool, layout: str, dtype: torch.dtype
) -> None:
    n, results = grid
    got = results[(causal, layout, str(dtype))]
    q, k, v, dout = (x.double().requires_grad_() for x in _inputs(n, dtype))
    mask = None
    if causal:
        t = q.shape[-2]
        mask = torch.ones(t, t, dtype=torch.bool).tril()
    ref, _ = reference_attention(q, k, v, mask=mask)
    ref.backward(dout)
    expected = {"out": ref.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    for name, want in expected.items():
        assert got[name].dtype == dtype
        torch.testing.assert_close(got[name].double(), want, **tol(dtype), msg=name)


def test_ring_softcap_matches_single_process(grid: tuple[int, dict]) -> None:
    n, results = grid
    got = results["softcap"]
    q, k, v, dout = (x.requires_grad_() for x in _inputs(n, torch.float64))
    t = q.shape[-2]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    ref, _ = reference_attention(q, k, v, mask=causal, softcap=SOFTCAP)
    ref.backward(dout)
    expected = {"out": ref.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    for name, want in expected.items():
        torch.testing.assert_close(got[name], want, **tol(torch.float64), msg=name)
    plain, _ = reference_attention(q.detach(), k.detach(), v.detach(), mask=causal)
    assert not torch.allclose(plain, ref.detach())  # the cap really bites


# --- errors before any communication --------------------------------------------------


def test_missing_process_group_is_a_clear_error() -> None:
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match=r"needs a torch\.distributed process group"):
        ring_attention(q, q, q)


def test_shard_length_not_divisible() -> None:
    x = torch.randn(1, 2, 10, 8)
    with pytest.raises(ValueError, match=r"multiple of 8; pad it to 16"):
        shard_sequence(x, layout="zigzag", rank=0, world_size=4)
    with pytest.raises(ValueError, match=r"multiple of 4; pad it to 12"):
        shard_sequence(x, layout="contiguous", rank=1, world_size=4)


def test_shard_positions_zigzag() -> None:
    assert shard_positions(8, 0, 2, "zigzag").tolist() == [0, 1, 6, 7]
    assert shard_positions(8, 1, 2, "zigzag").tolist() == [2, 3, 4, 5]
    assert shard_positions(8, 1, 2, "contiguous").tolist() == [4, 5, 6, 7]


def _bad_input_worker(rank: int, n: int) -> list[tuple[str, str]]:
    seen = []
    # Rank 1 holds a shorter shard than rank 0.
    t = 6 if rank == 0 else 4
    q = torch.randn(1, 2, t, 8)
    for case in ("shape", "odd-zigzag"):
        if case == "odd-zigzag":
            q = torch.randn(1, 2, 3, 8)
        try:
            ring_attention(q, q, q, layout="zigzag", timeout=20)
            seen.append(("none", ""))
        except Exception as exc:
            seen.append((type(exc).__name__, str(exc)))
    return seen


def test_mismatched_shapes_and_odd_zigzag_raise_on_every_rank() -> None:
    outcomes = spawn_local(_bad_input_worker, 2, timeout=60)
    for o in outcomes:
        assert o.ok, o.traceback
        (shape_type, shape_msg), (odd_type, odd_msg) = o.value
        assert shape_type == "ValueError"
        assert "ranks disagree" in shape_msg
        assert "rank 0: query (1, 2, 6, 8)" in shape_msg
        assert "rank 1: query (1, 2, 4, 8)" in shape_msg
        assert odd_type == "ValueError"
        assert "even shard length" in odd_msg


# --- faults: a rank dies or stalls -----------------------------------------------------

FAULT_TIMEOUT = 1.5


def _fault_worker(rank: int, n: int, fault: str) -> tuple[str, str, float]:
    import attnlab.distributed.ring as ring

    if rank == n - 1:
        # Pass the shape check like a healthy rank, then fail before the first transfer.
        if fault == "die":
            ring._ring_forward = lambda *a: os._exit(1)  # type: ignore[assignment]
        else:

            def stall(*a: object) -> None:
                time.sleep(3 * FAULT_TIMEOUT)
                raise SystemExit("stalled rank woke up")

            ring._ring_forward = stall  # type: ignore[assignment]
    q = torch.randn(1, 2, 8, 8)
    t0 = time.monotonic()
    try:
        ring_attention(q, q, q, timeout=FAULT_TIMEOUT)
    except RingAttentionError as exc:
        return ("RingAttentionError", str(exc), time.monotonic() - t0)
    return ("none", "", time.monotonic() - t0)


@pytest.mark.parametrize("fault", ["die", "stall"])
def test_dead_or_stalled_rank_raises_within_timeout(fault: str) -> None:
    n = 3
    outcomes = spawn_local(_fault_worker, n, (fault,), timeout=60, pg_timeout=30)
    for o in outcomes[: n - 1]:
        assert o.ok, o.traceback
        etype, msg, elapsed = o.value
        assert etype == "RingAttentionError", (o.rank, etype, msg)
        assert f"ring attention on rank {o.rank} of 3" in msg
        assert "a rank died, stalled" in msg
        assert elapsed < FAULT_TIMEOUT + 3.0, elapsed
        if fault == "stall":
            assert "within the 1.5 s timeout" in msg
            assert "Timed out" in msg  # the transport's own words: a deadline, not a crash
            assert elapsed >= 0.9 * FAULT_TIMEOUT, elapsed
    last = outcomes[n - 1]
    assert not last.ok
    assert last.error_type == ("died" if fault == "die" else "SystemExit")


# --- Attention(backend="ring"): context parallelism for a layer ------------------------


def _attention_layer(backend: str) -> torch.nn.Module:
    from attnlab.attention import Attention

    torch.manual_seed(7)
    return Attention(16, 4, num_kv_heads=2, rope=True, backend=backend).double()


def _attention_worker(rank: int, n: int, layout: str) -> dict[str, torch.Tensor] | None:
    import torch.distributed as dist

    from attnlab.distributed import all_reduce_gradients, context_parallel

    layer = _attention_layer("ring")
    x = torch.randn(2, 8 * n, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    x_local = shard_sequence(x, dim=1, layout=layout)
    pos = shard_positions(x.shape[1], rank, n, layout)  # RoPE needs the global positions
    with context_parallel(layout=layout):
        out = layer(x_local, is_causal=True, position_ids=pos)
    (out**2).mean().backward()
    all_reduce_gradients(layer)
    full = gather_sequence(out.detach(), dim=1, layout=layout)
    grads = {name: p.grad for name, p in layer.named_parameters()}
    dist.barrier()
    return {"out": full, **grads} if rank == 0 else None


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_attention_layer_with_ring_backend_matches_one_process(layout: str) -> None:
    outcomes = spawn_local(_attention_worker, 2, (layout,), timeout=120)
    assert all(o.ok for o in outcomes), [o.traceback for o in outcomes]
    got = outcomes[0].value
    layer = _attention_layer("math")
    x = torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out = layer(x, is_causal=True)
    (out**2).mean().backward()
    torch.testing.assert_close(got["out"], out.detach(), **tol(torch.float64))
    for name, p in layer.named_parameters():
        torch.testing.assert_close(got[name], p.grad, **tol(torch.float64), msg=name)


def test_ring_backend_outside_a_process_group_says_why() -> None:
    from attnlab.backends import explain_dispatch
    from attnlab.functional import scaled_dot_product_attention

    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"ring needs a torch\.distributed process group"):
        scaled_dot_product_attention(q, q, q, is_causal=True, backend="ring")
    assert "ring: not chosen" in str(explain_dispatch(q, q, q))


# --- the ring-demo computation ----------------------------------------------------------


def test_ring_demo_measures_and_matches_one_process() -> None:
    from attnlab.distributed.demo import run_ring_demo

    r = run_ring_demo(2, 64, heads=2, head_dim=8, dtype="float64", backward=True, timeout=120)
    assert r.max_error < 1e-10
    assert [x.rank for x in r.ranks] == [0, 1]
    # K and V of one shard (32 positions x 2 heads x 8 dims x 8 bytes) travel one hop
    # forward; backward sends K, V once more and dK, dV twice (2 ranks).
    shard_bytes = 32 * 2 * 8 * 8
    assert all(x.bytes_sent == shard_bytes * (2 + 2 + 4) for x in r.ranks)
    assert all(x.seconds > 0 and x.compute_cpu_s > 0 for x in r.ranks)


def test_ring_demo_rejects_a_length_the_layout_cannot_split() -> None:
    from attnlab.distributed.demo import run_ring_demo

    with pytest.raises(ValueError, match="multiple of 8; pad it to 16"):
        run_ring_demo(4, 10, layout="zigzag")
