"""`attnlab info`: the attention backends, the dispatch of one call, the GPT presets."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.console import RenderableType

import attnlab
from attnlab import native
from attnlab.backends import (
    AUTO_ORDER,
    available_backends,
    dispatch_table,
    explain_dispatch,
    get_backend,
    variant_support,
)
from attnlab.biases import AlibiBias, RelativePositionBias
from attnlab.cli.app import app
from attnlab.cli.output import UserError, output, user_input
from attnlab.masks import (
    BooleanMask,
    CausalMask,
    ChunkedMask,
    DocumentMask,
    PaddingMask,
    SlidingWindowMask,
)

_INFO_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "float64": "float64",
    "fp64": "float64",
}
_INFO_MASKS = (
    "none",
    "causal",
    "padding",
    "window",
    "chunked",
    "boolean",
    "alibi",
    "relbias",
    "document",
)


@app.command()
def info(
    seq_len: Annotated[int, typer.Option("--seq-len", "-t", help="Query length T.")] = 1024,
    key_len: Annotated[
        int | None, typer.Option("--key-len", "-s", help="Key length S (default T).")
    ] = None,
    batch: Annotated[int, typer.Option(help="Batch size B.")] = 1,
    heads: Annotated[int, typer.Option(help="Query heads H.")] = 12,
    kv_heads: Annotated[
        int | None, typer.Option("--kv-heads", help="Key/value heads G (default H).")
    ] = None,
    head_dim: Annotated[int, typer.Option("--head-dim", help="Head dim D.")] = 64,
    dtype: Annotated[
        str,
        typer.Option(
            help="float32, bfloat16, float16 or float64; with --model, the dtype of the "
            "model's parameters (float32, bfloat16 or float16)."
        ),
    ] = "float32",
    mask: Annotated[
        str,
        typer.Option(
            help="none, causal, padding, window, chunked (Llama 4 local chunks of 256), boolean, "
            "alibi (causal ALiBi), relbias "
            "(T5 relative position bias, learned table) or document (packed, causal)."
        ),
    ] = "causal",
    dropout: Annotated[float, typer.Option(help="Attention dropout probability.")] = 0.0,
    softcap: Annotated[
        float | None, typer.Option(help="Logit soft-capping value (Gemma 2: 50).")
    ] = None,
    sinks: Annotated[bool, typer.Option("--sinks", help="Learned attention sinks.")] = False,
    backend: Annotated[str, typer.Option(help="Backend to explain (default auto).")] = "auto",
    backward: Annotated[
        bool, typer.Option("--backward", help="Explain a training call (forward+backward).")
    ] = False,
    show_table: Annotated[
        bool, typer.Option("--table", help="Show every row of auto's crossover table.")
    ] = False,
    preset: Annotated[
        str | None,
        typer.Option(
            help="GPT preset whose parameter counts to report (tiny, gpt2-124m, gpt2-medium, "
            "gpt2-large, gpt2-xl), or 'all'; shows only that."
        ),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            "-m",
            help="A model directory, .gguf file or packaged name: summarise it (family, "
            "layers, heads, RoPE, window, parameters, dtype, each layer's backend for a "
            "call of --seq-len tokens) from its config and tensor headers, reading no "
            "weight; shows only that.",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="With --model: print JSON.")] = False,
    kv_cache: Annotated[
        str,
        typer.Option(
            "--kv-cache",
            help="With --model: what the key/value cache holds for its size per token "
            "(auto, float32 or float16, as `generate --kv-cache`; auto is the parameters' "
            "dtype here).",
        ),
    ] = "auto",
) -> None:
    """Report what attnlab has: the attention backends, the crossover table auto chooses
    by, which one a call of this shape would run (and why not the others), which backend
    serves which attention variant, and the GPT presets' parameter counts and sizes."""
    if preset is not None:
        output.show(*_info_presets(preset))
        return
    if model is not None:
        _info_model(model, seq_len, backend, as_json, dtype, kv_cache)
        return
    if as_json:
        raise UserError("--json needs --model (the summary of one model)")
    import torch
    from rich.table import Table

    if dtype not in _INFO_DTYPES:
        raise UserError(f"unknown --dtype {dtype!r}; choose one of {', '.join(_INFO_DTYPES)}")
    if mask not in _INFO_MASKS:
        raise UserError(f"unknown --mask {mask!r}; choose one of {', '.join(_INFO_MASKS)}")
    for name, value in (
        ("--seq-len", seq_len),
        ("--batch", batch),
        ("--heads", heads),
        ("--head-dim", head_dim),
        ("--key-len", key_len),
        ("--kv-heads", kv_heads),
    ):
        if value is not None and value < 1:
            raise UserError(f"`{name}` must be a positive int, got {value}")
    T, S, G = seq_len, key_len or seq_len, kv_heads or heads
    tdtype = getattr(torch, _INFO_DTYPES[dtype])

    def shaped(*shape: int) -> torch.Tensor:  # no memory: one element, expanded
        one = torch.zeros((1,) * len(shape), dtype=tdtype).requires_grad_(backward)
        return one.expand(*shape)

    attn_mask = {
        "none": None,
        "causal": CausalMask(),
        "padding": PaddingMask(torch.ones(1, 1, dtype=torch.bool).expand(batch, S)),
        "window": SlidingWindowMask(min(256, S)) if mask == "window" else None,
        "chunked": ChunkedMask(min(256, S)) if mask == "chunked" else None,
        "boolean": BooleanMask(torch.ones(1, 1, 1, 1, dtype=torch.bool).expand(1, 1, T, S)),
        "alibi": AlibiBias(heads) & CausalMask() if mask == "alibi" else None,
        "relbias": RelativePositionBias(torch.zeros(32, heads, requires_grad=True))
        if mask == "relbias"
        else None,
        "document": DocumentMask(torch.zeros(1, 1, dtype=torch.long).expand(batch, T))
        & CausalMask()
        if mask == "document" and T == S
        else None,
    }[mask]
    if mask == "document" and T != S:
        raise UserError("--mask document is self-attention over packed documents; omit --key-len")
    with user_input():
        exp = explain_dispatch(
            shaped(batch, heads, T, head_dim),
            shaped(batch, G, S, head_dim),
            shaped(batch, G, S, head_dim),
            attn_mask,
            dropout,
            backend=backend,
            softcap=softcap,
            sinks=torch.zeros(heads) if sinks else None,
        )

    table = Table(
        title=f"attnlab {attnlab.__version__} attention backends (torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads)"
    )
    table.add_column("backend")
    table.add_column("auto rank")
    table.add_column("what it is")
    for name in available_backends():
        if name == "auto":
            continue
        rank = str(AUTO_ORDER.index(name) + 1) if name in AUTO_ORDER else "-"
        table.add_row(name, rank, get_backend(name).summary)
    call = (
        f"B={batch} H={heads} G={G} T={T} S={S} D={head_dim} {_INFO_DTYPES[dtype]} "
        f"mask={mask} dropout={dropout}"
        + (f" softcap={softcap}" if softcap is not None else "")
        + (" sinks" if sinks else "")
    )
    pass_ = "forward+backward" if backward else "forward"
    verdict = Table(
        title=f"dispatch for {call} {pass_}: backend={backend!r} -> {exp.chosen}",
        caption=f"decided by {exp.decided_by}" if exp.decided_by else None,
    )
    verdict.add_column("backend")
    verdict.add_column("verdict")
    for name, why in exp.reasons:
        verdict.add_row(name, "chosen" if why is None else why)
    variants = Table(title="attention variants: which backend serves which (yes, or why not)")
    variants.add_column("variant")
    served_by = [n for n in available_backends() if n != "auto"]
    for name in served_by:
        variants.add_column(name)
    for label, reasons in variant_support():
        variants.add_row(label, *("yes" if reasons[n] is None else reasons[n] for n in served_by))
    output.show(
        table,
        _info_dispatch_table(show_table),
        verdict,
        variants,
        _info_native(),
        *_info_presets(None),
    )


def _info_native() -> RenderableType:
    """The compiled decode step's state, and how to retry a failed build; never builds."""
    import torch
    from rich.text import Text

    from attnlab.quant.arith import prompt_arithmetic
    from attnlab.quant.base import native_rows_dtype
    from attnlab.quant.int4 import native_q4

    dtype, why = prompt_arithmetic()
    capability = torch.backends.cpu.get_cpu_capability()
    ext = native.loaded()
    if ext is not None and native_q4(ext):
        how = (
            "integer products of 16-bit activation codes, as q8_0's"
            if ext.Q4_INTEGER
            else "its plain loop"
        )
        int4 = f"attnlab's q4 kernel ({how}; PyTorch's are its {capability} ones)"
    elif ext is not None:
        int4 = f"PyTorch's (its {capability} kernels: this build has no integer q4)"
    else:
        int4 = (
            "attnlab's q4 kernel once the compiled step is loaded, where the CPU has AVX2 "
            f"(integer products of 16-bit activation codes); PyTorch's {capability} ones without it"
        )
    rows = native_rows_dtype(ext)
    if ext is None:
        rows_why = (
            "PyTorch's int4 kernel takes no other; float32 on the compiled step's avx2 and "
            "avx512 builds"
        )
    elif rows == torch.float32:
        rows_why = (
            f"this {ext.SIMD} build's kernels code float32 rows as they are: no bf16 rounding"
        )
    else:
        rows_why = f"this {getattr(ext, 'SIMD', '?')} build's q5_0 reads bf16 rows fastest"
    return Text(
        f"compiled decode step (attnlab.native): {native.status()}\n"
        f"prompt products of the int and bf16 weights: {str(dtype).removeprefix('torch.')} "
        f"({why})\n"
        f"int4 decode products: {int4}\n"
        f"rows of the int4, q8_0 and q5_0 decode products: "
        f"{str(rows).removeprefix('torch.')} ({rows_why})\n"
        f"{_info_crossovers()}"
    )


def _info_crossovers() -> str:
    """The int formats' crossovers to dense prompt products measured on this machine, and
    where they are kept; never measures."""
    import os

    from attnlab.quant import WEIGHT_FORMATS, crossover

    defaults = ", ".join(
        f"{name} {cls.default_dense_from}"
        for name, cls in WEIGHT_FORMATS.items()
        if cls.dense_from_tokens is None
    )
    if os.environ.get(crossover.CROSSOVER_ENV, "").strip() == "defaults":
        return (
            f"prompt crossovers: the defaults, dense from {defaults} rows "
            f"({crossover.CROSSOVER_ENV}=defaults)"
        )
    gemm = crossover.float32_gemm(measure_now=False)
    gemm_line = (
        f"float32 dense products: {gemm[0]} ({gemm[1]})"
        if gemm is not None
        else "float32 dense products: PyTorch's mm or oneDNN's, the faster, measured at the "
        "first float32 prompt"
    )
    path, found = crossover.measured_here()
    if not found:
        return (
            "prompt crossovers: none measured on this machine yet; each format and weight "
            f"shape is measured at its first product of {crossover.FIRST_PROBE_ROWS} rows or "
            f"more (defaults: {defaults}), and kept in {path}\n{gemm_line}"
        )
    lines = [f"prompt crossovers (a format's kernel below, one dense mm from), kept in {path}:"]
    lines += [f"  {entry}: {c.describe()}" for entry, c in found.items()]
    return "\n".join([*lines, gemm_line])


def _info_dispatch_table(full: bool) -> RenderableType:
    """``attnlab info``'s crossover table: where it was timed, how quiet, its rows."""
    from rich.table import Table
    from rich.text import Text

    with user_input():
        table = dispatch_table()
    if table is None:
        return Text("auto's crossover table: none; auto uses the fixed order")
    m = table.machine
    busy = m.get("others_busy_during", m.get("others_busy_before"))
    quiet = (
        f"other processes used {busy:.0%} of the machine"
        if isinstance(busy, (int, float))
        else "quietness not recorded"
    )
    title = (
        f"auto's crossover table ({len(table.rows)} rows, {table.path}): timed "
        f"{m.get('date', '?')} on {m.get('cpu', '?')}, torch {m.get('torch', '?')}, "
        f"{m.get('threads', '?')} threads; {quiet}"
        + ("" if m.get("quiet", True) else " (NOT QUIET: provisional)")
    )
    if not full:
        return Text(title + "; `attnlab info --table` lists the rows")
    out = Table(title=title)
    for col in ("row", "dtype", "pass", "mask", "sqrt(T*S)", "fastest first", "ms (T: times)"):
        out.add_column(col)
    for r in table.rows:
        hi = "inf" if r.t_below is None else f"{r.t_below:g}"
        ms = "; ".join(
            f"{t}: " + " ".join(f"{per[n]:.3g}" for n in r.order if n in per)
            for t, per in sorted(r.ms.items())
        )
        out.add_row(
            str(r.index), r.dtype, r.pass_, r.mask, f"{r.t_from:g}..{hi}", " < ".join(r.order), ms
        )
    return out


def _preset_table(name: str) -> Any:
    from rich.table import Table

    from attnlab.models.gpt import parameter_report

    r = parameter_report(name)
    c = r.config
    table = Table(
        title=f"{name}: {c.n_layers} layers, emb_dim {c.emb_dim}, {c.n_heads} heads, "
        f"context {c.context_length}, vocab {c.vocab_size}",
        title_justify="left",
    )
    table.add_column("module", no_wrap=True)
    table.add_column("parameters", justify="right", no_wrap=True)
    for module, count in r.per_module:
        table.add_row(module, f"{count:,}")
    table.add_section()
    table.add_row("total", f"{r.total:,}")
    table.add_row("total with weight tying (head = tok_emb)", f"{r.total_tied:,}")
    table.add_row("size in float32", f"{r.size_mb:,.2f} MB")
    return table


def _info_presets(preset: str | None) -> list[RenderableType]:
    """``attnlab info``'s model part: GPT presets' parameter counts and model sizes."""
    from attnlab.models.gpt import PRESETS

    if preset is not None:
        if preset == "all":
            names = list(PRESETS)
        elif preset in PRESETS:
            names = [preset]
        else:
            raise UserError(
                f"unknown --preset {preset!r}; choose one of: {', '.join(PRESETS)}, all"
            )
        return [_preset_table(n) for n in names]
    from rich.table import Table

    from attnlab.models.gpt import parameter_report

    table = Table(title="GPT presets (attnlab info --preset NAME for the details)")
    for col in ("preset", "layers", "emb_dim", "heads", "context", "parameters", "fp32 size"):
        table.add_column(col, justify="left" if col == "preset" else "right", no_wrap=True)
    for name in PRESETS:
        r = parameter_report(name)
        c = r.config
        table.add_row(
            name,
            str(c.n_layers),
            str(c.emb_dim),
            str(c.n_heads),
            str(c.context_length),
            f"{r.total:,}",
            f"{r.size_mb:,.1f} MB",
        )
    return [table]


def _info_model(
    name: str, seq_len: int, backend: str, as_json: bool, dtype: str, kv_cache: str = "auto"
) -> None:
    """``attnlab info --model``: the model's summary table (or JSON), its parameters in
    ``dtype`` and its cache in ``kv_cache`` (``--kv-cache``); built from the config and
    tensor headers, no weight read."""
    import dataclasses
    import json

    import torch
    from rich.table import Table

    from attnlab.cli.models import check_kv_cache, load_pretrained_model
    from attnlab.pretrained.loaders import set_kv_cache_dtype
    from attnlab.pretrained.summary import summarize_model

    if seq_len < 1:
        raise UserError(f"`--seq-len` must be a positive int, got {seq_len}")
    check_kv_cache(kv_cache)
    model_dtypes = ("float32", "bfloat16", "float16")
    if _INFO_DTYPES.get(dtype) not in model_dtypes:
        raise UserError(
            f"--dtype {dtype!r} with --model: a model loads in one of {', '.join(model_dtypes)}"
        )
    # The structure alone: the config and the tensor headers, no weight read.
    net, _, source = load_pretrained_model(
        name, backend=backend, dtype=getattr(torch, _INFO_DTYPES[dtype]), weights=False
    )
    with user_input():
        set_kv_cache_dtype(net, kv_cache, None)  # a ValueError: a model without such caches
        summary = summarize_model(net, probe_length=seq_len)
    if as_json:
        output.raw(json.dumps({"model": source, **dataclasses.asdict(summary)}, indent=2) + "\n")
        return
    table = Table(title=f"{source}: {summary.family} {summary.kind}")
    table.add_column("field")
    table.add_column("value")
    rope = summary.rope
    rope_text = (
        "none"
        if rope is None
        else f"base {rope['base']:g}, fraction {rope['fraction']:g}"
        + (", interleaved" if rope["interleaved"] else "")
        + f", scaling {rope['scaling'] or 'none'}"
        + "".join(f"; some layers base {b:g}" for b in rope.get("layer_bases", ()))
        + (
            "; no rotary (NoPE) on layers " + ", ".join(map(str, rope["nope_layers"]))
            if rope.get("nope_layers")
            else ""
        )
    )
    windows = sorted({str(lay.sliding_window) for lay in summary.per_layer})
    caps = {"attention": summary.attn_softcap, "final": summary.final_softcap}
    softcap = ", ".join(f"{k} {v:g}" for k, v in caps.items() if v is not None) or "none"
    layer_count = str(summary.layers)
    if summary.decoder_layers is not None:
        layer_count = f"{summary.layers} encoder + {summary.decoder_layers} decoder"
    context = summary.context_length
    rows = []
    cache = summary.kv_cache
    if cache is not None:
        per_token = f"{cache['bytes_per_token']:,} B"
        if "latent" in cache:
            per_token += f" (latent {cache['latent']} + rotary key {cache['rotary']} per layer)"
        if cache["mha_bytes_per_token"] != cache["bytes_per_token"]:
            ratio = cache["mha_bytes_per_token"] / cache["bytes_per_token"]
            per_token += (
                f"; plain multi-head attention: {cache['mha_bytes_per_token']:,} B ({ratio:.1f}x)"
            )
        rows.append(("KV cache per token", per_token))
    for field, value in (
        ("family", summary.family),
        ("layers", layer_count),
        ("width", str(summary.hidden_size)),
        ("heads / kv heads", f"{summary.heads} / {summary.kv_heads}"),
        ("head dim", str(summary.head_dim)),
        ("positions", summary.positions),
        ("RoPE", rope_text),
        ("sliding window", ", ".join(windows)),
        ("softcap", softcap),
        ("norm", summary.norm),
        ("MLP", summary.mlp),
        ("context", "no limit (relative positions)" if context is None else str(context)),
        ("parameters", f"{summary.parameters:,}"),
        ("dtype", summary.dtype),
        *rows,
        *(("left out", note) for note in summary.notes),
    ):
        table.add_row(field, value)
    layers = Table(title=f"attention layers: backend for a call of T={summary.probe_length}")
    # Columns that say nothing for this model (no windows, no chunks) are left out, so the
    # table fits a terminal.
    cells = {
        "layer": lambda lay: str(lay.index),
        "attention": lambda lay: lay.role,
        "heads": lambda lay: str(lay.heads),
        "kv heads": lambda lay: str(lay.kv_heads),
        "head dim": lambda lay: str(lay.head_dim),
        "window": lambda lay: str(lay.sliding_window or "-"),
        "chunk": lambda lay: str(lay.attention_chunk or "-"),
        "backend": lambda lay: lay.backend,
    }
    if not any(lay.sliding_window for lay in summary.per_layer):
        del cells["window"]
    if not any(lay.attention_chunk for lay in summary.per_layer):
        del cells["chunk"]
    for col in cells:
        layers.add_column(col)
    for lay in summary.per_layer:
        layers.add_row(*(cell(lay) for cell in cells.values()))
    output.show(table, layers)
