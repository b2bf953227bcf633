"""benchmarks/bench_llama_cpp.py's decode at a depth (``--depth``) without a llama.cpp build
or a timed run: llama-bench's command lines and JSON at a depth (a fake llama-bench script
that answers as the real one's JSON printer writes), the choice of the better flash
attention setting, the record's config, the peak RSS of a child process, llama.cpp's cache
size for a config with and without sliding-window layers, and the bytes of the cache that
attnlab's generation allocates."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

import bench_llama_cpp as bench  # noqa: E402

from attnlab.attention import StaticKVCache, StaticWindowKVCache  # noqa: E402
from attnlab.generation import generate_stream  # noqa: E402
from attnlab.models.decoder import Decoder, DecoderConfig  # noqa: E402

PEERS = bench.peers
MIB = 2**20


def _row(**fields: object) -> dict[str, object]:
    """One test as llama-bench's JSON printer writes it (tools/llama-bench/llama-bench.cpp:
    ``test::get_fields()`` in order, then ``samples_ns`` and ``samples_ts``); the numbers
    are made up, the names and kinds are the printer's (``flash_attn`` an int, ``type_k`` a
    string, ``repack`` a bool)."""
    row: dict[str, object] = {
        "build_commit": "0c1e57098", "build_number": 0, "cpu_info": "AMD EPYC",
        "gpu_info": "", "backends": "CPU", "model_filename": "/m/SmolLM2.Q4_1.gguf",
        "model_type": "llama 256M Q4_1", "model_size": 96576768, "model_n_params": 134515008,
        "n_batch": 2048, "n_ubatch": 512, "n_threads": 2, "cpu_mask": "0x0",
        "cpu_strict": False, "poll": 50, "type_k": "f16", "type_v": "f16",
        "n_gpu_layers": -1, "n_cpu_moe": 0, "split_mode": "layer", "main_gpu": 0,
        "no_kv_offload": False, "flash_attn": 0, "devices": "auto", "tensor_split": "0.00",
        "tensor_buft_overrides": "none", "load_mode": "auto", "lazy_mode": "auto",
        "embeddings": False, "no_op_offload": 0, "no_host": False, "repack": True,
        "fit_target": 0, "fit_min_ctx": 0, "n_prompt": 0, "n_gen": 32, "n_depth": 4096,
        "test_time": "2026-01-01T00:00:00Z", "avg_ns": 400000000, "stddev_ns": 0,
        "avg_ts": 80.0, "stddev_ts": 0.0, "samples_ns": [400000000], "samples_ts": [80.0],
    }  # fmt: skip
    row.update(fields)
    return row


def test_depth_command_lines_ask_for_the_depth_and_each_flash_attention_setting():
    path = Path("/m/model.gguf")
    off = bench.depth_args(path, threads=2, depth=4096, new=32, reps=3, flash_attn=False)
    on = bench.depth_args(path, threads=2, depth=4096, new=32, reps=3, flash_attn=True)
    common = ["-m", "/m/model.gguf", "-t", "2", "-d", "4096", "-p", "0", "-n", "32", "-r", "3"]
    assert off == [*common, "-fa", "0", "-o", "json"]
    assert on == [*common, "-fa", "1", "-o", "json"]


def test_a_test_at_a_depth_is_named_and_read_with_its_settings():
    text = json.dumps([
        _row(flash_attn=1, samples_ts=[79.5, 81.25], avg_ts=80.375, type_v="q8_0"),
        _row(n_prompt=512, n_gen=0, n_depth=0, samples_ts=[900.0], avg_ts=900.0),
        _row(n_gen=128, n_depth=0),
    ])  # fmt: skip
    figures = bench.parse_llama_bench(text)
    assert sorted(figures) == ["pp512", "tg128", "tg32@d4096"]
    fig = figures["tg32@d4096"]
    assert (fig.depth, fig.flash_attn, fig.type_k, fig.type_v) == (4096, 1, "f16", "q8_0")
    assert fig.samples_ts == (79.5, 81.25) and fig.avg_ts == 80.375
    assert figures["tg128"].depth == 0 and figures["pp512"].test == "pp512"
    # The output of a build before n_depth existed reads as depth 0, its fa unknown.
    old = {k: v for k, v in _row(n_depth=0).items() if k not in ("n_depth", "flash_attn")}
    assert bench.parse_llama_bench(json.dumps([old]))["tg32"].flash_attn is None


def test_the_better_flash_attention_setting_is_the_peer():
    assert bench.best_flash_attn({False: [70.0, 75.5], True: [74.0, 75.0]}) == (False, 75.5)
    assert bench.best_flash_attn({False: [70.0], True: [90.0, 60.0]}) == (True, 90.0)
    assert bench.best_flash_attn({True: [80.0], False: [80.0]}) == (True, 80.0)  # tie: first
    with pytest.raises(ValueError, match="no llama-bench samples"):
        bench.best_flash_attn({False: [], True: []})


def test_depth_records_have_their_own_config():
    assert bench.config_name("smollm2-135m-instruct", "native", False) == (
        "smollm2-135m-instruct"  # depth 0: the name of the records before
    )
    assert bench.config_name("smollm2-135m-instruct", "native", False, depth=4096) == (
        "smollm2-135m-instruct-depth4096"
    )
    assert bench.config_name("gemma3-270m", "avx2", True, quick=True, depth=256) == (
        "gemma3-270m-avx2-repack-depth256-quick"
    )


def test_main_refuses_a_depth_with_the_agreement_alone_or_below_zero(capsys):
    for argv, message in (
        (["--depth", "256", "--agreement-only"], "--agreement-only is depth 0's"),
        (["--depth", "-1"], "--depth must be >= 0"),
        (["--depth", "256", "--new", "0"], "--new must be >= 1"),
    ):
        with pytest.raises(SystemExit):
            bench.main(argv)
        assert message in capsys.readouterr().err


def _fake_build(root: Path, script: str) -> PEERS.LlamaCpp:
    """A folder that find() counts as a variant build, its llama-bench a shell script."""
    tool = root / "build" / "bin" / "llama-bench"
    tool.parent.mkdir(parents=True)
    tool.write_text("#!/bin/sh\n" + script)
    os.chmod(tool, 0o755)
    info = {"llama_cpp_python": "0.3.36", "isa": "avx2", "repack": False,
            "tools": ["llama-bench"]}  # fmt: skip
    (root / PEERS.RECORD).write_text(json.dumps(info))
    found = PEERS.find(root)
    assert found is not None
    return found


def test_a_depth_run_reads_its_test_and_the_process_peak(tmp_path):
    calls = tmp_path / "calls"
    # Answers with the flash attention setting it was given, as llama-bench's JSON does.
    row = json.dumps([_row(flash_attn="FA")]).replace('"FA"', "$fa")
    script = (
        f'echo "$@" >> {calls}\n'
        'case "$*" in *"-fa 1"*) fa=1 ;; *) fa=0 ;; esac\n'
        f"cat <<JSON\n{row}\nJSON\n"
    )
    builds = bench.Builds(plain=_fake_build(tmp_path / "llama.cpp", script))
    kw = {"threads": 2, "depth": 4096, "new": 32, "reps": 1}
    runs = {fa: bench.run_llama_bench_depth(builds, tmp_path / "m.gguf", **kw, flash_attn=fa)
            for fa in (False, True)}  # fmt: skip
    for fa, run in runs.items():
        assert run.figure.test == "tg32@d4096" and run.figure.flash_attn == int(fa)
        assert 0 < run.peak_rss < 32 * MIB  # a shell and cat
    lines = calls.read_text().splitlines()
    assert [line.split()[-3] for line in lines] == ["0", "1"]  # -fa 0, then -fa 1
    with pytest.raises(ValueError, match="not tg16@d4096"):
        bench.run_llama_bench_depth(
            builds, tmp_path / "m.gguf", threads=2, depth=4096, new=16, reps=1, flash_attn=True
        )


def test_a_depth_run_refuses_output_with_the_other_setting(tmp_path):
    ok = f"cat <<'JSON'\n{json.dumps([_row(flash_attn=0)])}\nJSON\n"
    builds = bench.Builds(plain=_fake_build(tmp_path / "llama.cpp", ok))
    with pytest.raises(ValueError, match="ran with flash_attn 0, asked 1"):
        bench.run_llama_bench_depth(
            builds, tmp_path / "m.gguf", threads=2, depth=4096, new=32, reps=1, flash_attn=True
        )


def test_the_peak_rss_is_the_childs_own():
    # This process is the larger one (torch, and this buffer, every page written); a
    # child's ru_maxrss taken straight from wait4 would read at least this process's peak.
    held = b"x" * (256 * MIB)
    size = 96 * MIB
    fill = f"import sys; b = b'x' * {size}; sys.stdout.write('done')"
    proc, peak = bench.run_measured([sys.executable, "-c", fill])
    assert proc.returncode == 0 and proc.stdout == "done"
    assert size <= peak < size + 64 * MIB  # the buffer and an interpreter
    small, small_peak = bench.run_measured(["sh", "-c", "echo err >&2; exit 3"])
    assert small.returncode == 3 and small.stderr == "err\n"
    assert small_peak < 32 * MIB < len(held)
    killed, _ = bench.run_measured(["sh", "-c", "kill -SEGV $$"])
    assert killed.returncode == -11  # a signal reads as subprocess gives it


SMOLLM2 = bench.KvLayout(widths=(3 * 64,) * 30, windows=(None,) * 30)
# Gemma 3 270M: 18 layers, one key/value head of 256, every sixth layer global, the others
# a window of 512 (llama.cpp's SWA pattern 6).
GEMMA3 = bench.KvLayout(
    widths=(256,) * 18, windows=tuple(None if i % 6 == 5 else 512 for i in range(18))
)


def test_llama_cpp_cache_without_sliding_windows():
    # llama-bench -v -d 256 -n 16 -p 0 on SmolLM2-135M-Instruct printed
    # "llama_kv_cache: size = 11.25 MiB (512 cells, 30 layers, 1/1 seqs),
    #  K (f16): 5.62 MiB, V (f16): 5.62 MiB"
    kv = bench.llama_cpp_kv(SMOLLM2, depth=256, new=16, flash_attn=False)
    assert (kv.cells, kv.layers, kv.swa_cells, kv.swa_layers) == (512, 30, None, 0)
    assert kv.nbytes == 2 * 30 * 512 * 192 * 2 == int(11.25 * MIB)
    # 4096 + 32 tokens pad to 4352 cells, the same with flash attention on.
    big = bench.llama_cpp_kv(SMOLLM2, depth=4096, new=32, flash_attn=True)
    assert big.cells == 4352 and big.nbytes == 2 * 30 * 4352 * 192 * 2
    assert bench.llama_cpp_kv(SMOLLM2, depth=4096, new=32, flash_attn=False) == big
    assert bench.llama_cpp_kv(SMOLLM2, depth=4064, new=32, flash_attn=True).cells == 4096
    f32 = bench.llama_cpp_kv(SMOLLM2, depth=256, new=16, flash_attn=True, type_k="f32")
    assert f32.nbytes == 30 * 512 * 192 * (4 + 2)


def test_llama_cpp_cache_with_sliding_windows():
    # llama-bench -v -d 1200 -n 1 -p 0 on Gemma 3 270M Q4_K_M printed "creating non-SWA KV
    # cache, size = 1280 cells", "size = 3.75 MiB (1280 cells, 3 layers ...)", "creating
    # SWA KV cache, size = 1024 cells", "size = 15.00 MiB (1024 cells, 15 layers ...)"
    kv = bench.llama_cpp_kv(GEMMA3, depth=1200, new=1, flash_attn=True)
    assert (kv.cells, kv.layers, kv.swa_cells, kv.swa_layers) == (1280, 3, 1024, 15)
    assert kv.nbytes == int(3.75 * MIB) + int(15.00 * MIB)
    # At 4096 + 32 the global layers hold 4352 cells; the windowed ones stay at
    # pad256(512 + 512) = 1024, a quarter of what every layer at full length would hold.
    deep = bench.llama_cpp_kv(GEMMA3, depth=4096, new=32, flash_attn=False)
    assert (deep.cells, deep.swa_cells) == (4352, 1024)
    assert deep.nbytes == 2 * 256 * 2 * (3 * 4352 + 15 * 1024)
    assert "4352 cells x 3 layers + 1024 cells x 15 sliding-window layers" in deep.describe(
        "f16", "f16"
    )
    # A context shorter than a ubatch: the ubatch shrinks to it and the window cache is
    # the whole (padded) context.
    short = bench.llama_cpp_kv(GEMMA3, depth=100, new=10, flash_attn=True)
    assert short.cells == short.swa_cells == 256


def test_llama_cpp_cache_widths_types_and_windows_it_does_not_cover():
    mixed = bench.KvLayout(widths=(64, 128), windows=(None, None))
    on = bench.llama_cpp_kv(mixed, depth=200, new=56, flash_attn=True)
    off = bench.llama_cpp_kv(mixed, depth=200, new=56, flash_attn=False)
    assert on.nbytes == 256 * 2 * (64 + 64 + 128 + 128)
    assert off.nbytes == 256 * 2 * (64 + 128 + 128 + 128)  # V transposed: the widest width
    with pytest.raises(ValueError, match="'q8_0'"):
        bench.llama_cpp_kv(SMOLLM2, depth=1, new=1, flash_attn=True, type_v="q8_0")
    two = bench.KvLayout(widths=(64, 64), windows=(128, 256))
    with pytest.raises(ValueError, match="one n_swa"):
        bench.llama_cpp_kv(two, depth=1, new=1, flash_attn=True)


CONFIG = DecoderConfig(  # a small Gemma-like layout: windows on all but every third layer
    vocab_size=96,
    hidden_size=64,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=64,
    context_length=64,
    layer_windows=(8, 8, None),
)


def test_the_layout_of_a_decoder_config():
    layout = bench.kv_layout(CONFIG)
    assert layout == bench.KvLayout(widths=(32, 32, 32), windows=(8, 8, None))
    with pytest.raises(ValueError, match="chunked"):
        bench.kv_layout(dataclasses.replace(CONFIG, layer_windows=None,
                                            layer_chunks=(None, 4, None)))  # fmt: skip


def _model() -> Decoder:
    torch.manual_seed(0)
    return Decoder(CONFIG).eval()


def test_watching_caches_sees_the_cache_generation_makes_and_leaves_the_model_as_it_was():
    model = _model()
    prompt = torch.tensor([list(range(1, 21))])  # (1, 20)
    with bench.watching_caches(model) as made:
        tokens = list(generate_stream(model, prompt, 5))
    assert "new_kv_cache" not in vars(model)  # the method again
    (cache,) = made
    assert len(tokens) == 5 and all(isinstance(c, StaticKVCache) for c in cache)
    assert [c.seq_len for c in cache] == [24] * 3  # the prompt and four fed tokens
    # generation asks for prompt + new positions: the global layer keeps all 25, each
    # windowed one its window's 8 slots (a ring); B x G x slots x D float32, for K and V.
    assert [type(c) for c in cache] == [StaticWindowKVCache, StaticWindowKVCache, StaticKVCache]
    assert bench.cache_nbytes(cache) == 2 * (1 * 2 * (8 + 8 + 25) * 16 * 4)
    with pytest.raises(TypeError, match="layer 1's cache"):
        bench.cache_nbytes([cache[0], object()])


def test_decode_at_depth_times_new_steps_and_keeps_the_cache_bytes():
    model = _model()
    depth, new = 20, 6
    side = bench.AttnlabSide(model, torch.tensor([list(range(1, depth + 1))]), None, new)
    steps: list[int] = []
    forward = model.forward

    @functools.wraps(forward)  # the same signature: generation reads logits_to_keep from it
    def counting(input_ids: torch.Tensor, *args: object, **kw: object) -> torch.Tensor:
        steps.append(input_ids.shape[1])
        return forward(input_ids, *args, **kw)

    model.forward = counting  # type: ignore[method-assign]
    side.decode_at_depth()
    # One forward of the depth, then `new` one-token steps (the ones timed).
    assert steps == [depth] + [1] * new
    assert len(side.decode_tps) == 1 and side.decode_tps[0] > 0
    # two windowed layers of 8 slots, one global layer of every position
    assert side.cache_bytes == 2 * (2 * (8 + 8 + depth + new + 1) * 16 * 4)
    assert side.cache_dtype == torch.float32
    # a float16 cache (an integer precision's default): its buffers' dtype and bytes
    model.kv_cache_dtype = torch.float16
    side.decode_at_depth()
    assert side.cache_dtype == torch.float16
    assert side.cache_bytes == 2 * (2 * (8 + 8 + depth + new + 1) * 16 * 2)
