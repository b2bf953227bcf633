"""`attnlab ring-demo`: ring attention on N local processes, checked against one."""

from __future__ import annotations

from typing import Annotated

import typer

from attnlab.cli.app import app
from attnlab.cli.output import UserError, output, user_input


@app.command("ring-demo")
def ring_demo(
    nproc: Annotated[int, typer.Option("--nproc", "-n", help="Local processes (ranks).")] = 2,
    seq_len: Annotated[
        int, typer.Option("--seq-len", "-t", help="Full sequence length T (split over ranks).")
    ] = 4096,
    heads: Annotated[int, typer.Option(help="Attention heads H.")] = 8,
    head_dim: Annotated[int, typer.Option("--head-dim", help="Head dim D.")] = 64,
    batch: Annotated[int, typer.Option(help="Batch size B.")] = 1,
    layout: Annotated[
        str, typer.Option(help="How the sequence is split: zigzag or contiguous.")
    ] = "zigzag",
    causal: Annotated[bool, typer.Option("--causal/--no-causal", help="Causal mask.")] = True,
    dtype: Annotated[str, typer.Option(help="float32, float64 or bfloat16.")] = "float32",
    backward: Annotated[
        bool, typer.Option("--backward", help="Also run (and time) the backward pass.")
    ] = False,
    seed: Annotated[int, typer.Option(help="Seed of the random query/key/value.")] = 0,
    timeout: Annotated[float, typer.Option(help="Seconds before the run is abandoned.")] = 600.0,
) -> None:
    """Run ring attention on N local processes (gloo, 127.0.0.1) and check it against one."""
    from rich.table import Table

    from attnlab.distributed.demo import run_ring_demo

    with user_input():
        try:
            result = run_ring_demo(
                nproc,
                seq_len,
                batch=batch,
                heads=heads,
                head_dim=head_dim,
                causal=causal,
                layout=layout,
                dtype=dtype,
                backward=backward,
                seed=seed,
                timeout=timeout,
            )
        except RuntimeError as e:
            raise UserError(str(e)) from e
    r = result
    mib = 2.0**20
    table = Table(
        title=f"ring attention: T={r.seq_len} over {r.nproc} ranks ({r.layout}), B={r.batch} "
        f"H={r.heads} D={r.head_dim}, {'causal' if r.causal else 'not causal'}, {r.dtype}"
        + (", forward + backward" if r.backward else ", forward")
    )
    for col in ("rank", "time s", "compute s (CPU)", "waiting s", "sent MiB", "peak MiB"):
        table.add_column(col, justify="right")
    for x in r.ranks:
        table.add_row(
            str(x.rank),
            f"{x.seconds:.3f}",
            f"{x.compute_cpu_s:.3f}",
            f"{x.wait_s:.3f}",
            f"{x.bytes_sent / mib:.1f}",
            f"{x.peak_bytes / mib:.1f}" if r.memory_supported else "n/a",
        )
    output.show(table)
    output.console.print(
        f"max |ring - single process| = {r.max_error:.3e}  (single process: {r.reference}, "
        f"{r.reference_s:.3f} s)\npeak MiB: the rank's peak memory counted from before its "
        "inputs existed (its shards + the call; resident set on CPU)",
        markup=False,
        soft_wrap=True,
    )
