"""Benchmark the real pretrained models against the reference libraries, same weights.

1. SmolLM2-135M-Instruct greedy generation, tokens/s: a 64-token prompt, 128 new tokens,
   KV cache on both sides. attnlab: ``attnlab.generation.generate`` on
   ``load_pretrained("smollm2-135m-instruct", dtype=...)`` for each ``--dtypes``; peer:
   ``transformers`` ``LlamaForCausalLM.generate`` (its default ``sdpa`` attention, fp32)
   with the weights that transformers' GGUF loader dequantises from the same file.
   Printed per precision: end-to-end tokens/s, decode tokens/s (the 128 steps without
   the prompt's encoding), the ratio to transformers, and its accuracy against attnlab
   fp32 (greedy tokens equal, first differing token, teacher-forced argmax agreement and
   relative logit error over the 192 positions). Then the prefill of ``--prefill-len``
   tokens (one forward, last position's logits) against transformers' forward.
2. all-MiniLM-L6-v2 sentence encoding, sentences/s: the same sentences, batch size 32,
   attnlab's ``sentence_embeddings`` against ``SentenceTransformer.encode``.

3. Your own model (``--only families``): for a mid-size random config of each decoder
   family (8 layers, width 512, 8 heads, 2 kv heads where the family has them), saved by
   transformers into a temporary directory: load time (``load_pretrained(dir)`` against
   ``AutoModelForCausalLM.from_pretrained(dir)``) and greedy tokens/s (64-token prompt + 64
   new, KV cache on both sides), in fp32 and bf16. Loads are short (10-60 ms), so they
   run ``--load-reps`` interleaved pairs (page cache warm, the previous model freed
   outside the timing) and print the median of the per-pair ratios with their spread,
   and the time attnlab's deferred decode plan takes to build.

Both sides run in one process, alternating within each repetition so that load from
other processes hits them alike; the time reported (1, 2) is the best *quiet* repetition:
``benchmarks/_quiet.py`` reads ``/proc/stat`` around each pair and keeps it only when
other processes used under a quarter of a core meanwhile; how quiet the run was is
printed beside the ratios. Also
printed: SmolLM2 load time (``load_pretrained``), and whether both sides produced the
same tokens / embeddings (within 1e-5).

Usage::

    HF_HUB_OFFLINE=1 python benchmarks/bench_pretrained.py --reps 3 --threads 2
    python benchmarks/bench_pretrained.py --only smollm2 --dtypes float32,bfloat16,int8,int4
    HF_HUB_OFFLINE=1 python benchmarks/bench_pretrained.py --only families --reps 3 \
        --load-reps 15 --threads 1 --families llama,qwen2,gpt2
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from _quiet import timed_pairs
from _records import Recorder

from attnlab.generation import generate
from attnlab.models.fast_decode import why_not_fast_decode
from attnlab.pretrained import load_pretrained, sentence_embeddings
from attnlab.pretrained.loaders import minilm_dir, smollm2_path

PASSAGE = (
    "Attention lets every token look at every other token and decide how much each one "
    "matters. The query of a token is compared with the keys of all tokens; the scores are "
    "scaled, masked and turned into weights by a softmax, and the weights average the "
    "values. Stacking many such layers, with feed-forward blocks in between, gives the "
    "transformer. In a decoder, a causal mask keeps each token from seeing the future, and "
    "a cache of keys and values makes generation fast. "
)


def smollm2_reference() -> torch.nn.Module:
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = smollm2_path()
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    model = LlamaForCausalLM(config).eval()
    state = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    return model


def bench_smollm2(
    reps: int, prompt_len: int, new_tokens: int, dtypes: list[str], prefill_len: int
) -> None:
    t0 = time.perf_counter()
    models = {}
    for dtype in dtypes:
        models[dtype], tok = load_pretrained("smollm2-135m-instruct", dtype=dtype)
        if dtype == dtypes[0]:
            load_s = time.perf_counter() - t0
    ref = smollm2_reference()
    ids = torch.tensor([tok.encode(PASSAGE * 4)[:prompt_len]])
    mask = torch.ones_like(ids)
    out: dict[str, torch.Tensor] = {}

    def ours(dtype: str) -> Callable[[], None]:
        def run() -> None:
            out[dtype] = generate(models[dtype], ids, new_tokens, use_cache=True)

        return run

    def ours_prefill(dtype: str) -> Callable[[], None]:
        def run() -> None:
            generate(models[dtype], ids, 1, use_cache=True)  # the prompt + one step

        return run

    def theirs() -> None:
        with torch.no_grad():
            out["transformers"] = ref.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                use_cache=True,
                pad_token_id=tok.pad_id,
            )

    def theirs_prefill() -> None:
        with torch.no_grad():
            ref.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False)

    rec = Recorder(
        "bench_pretrained",
        "smollm2",
        f"SmolLM2-135M-Instruct greedy generation, {ids.shape[1]}-token prompt + {new_tokens} "
        "new tokens with a KV cache, attnlab in each weight precision against transformers "
        "(fp32, sdpa) on the same weights, interleaved pairs; then the prefill of "
        f"{prefill_len} tokens",
        torch.get_num_threads(),
    )
    fns: dict[str, Callable[[], object]] = {"transformers": theirs}
    fns["transformers/1"] = theirs_prefill
    for dtype in dtypes:
        fns[dtype] = ours(dtype)
        fns[f"{dtype}/1"] = ours_prefill(dtype)
    for fn in fns.values():
        fn()  # warm-up
    res = timed_pairs(fns, reps)
    best = res.best

    def decode_rate(name: str) -> float:
        return (new_tokens - 1) / max(best[name] - best[f"{name}/1"], 1e-9)

    peer, peer_dec = new_tokens / best["transformers"], decode_rate("transformers")
    print(
        f"SmolLM2-135M greedy, prompt {ids.shape[1]} + {new_tokens} new tokens, KV cache, "
        f"{torch.get_num_threads()} threads; {res.quietness()}"
    )
    attn = ref.config._attn_implementation
    print(
        f"  {'transformers fp32':22s} {peer:6.1f} tokens/s  decode {peer_dec:6.1f} tokens/s   "
        f"(attention: {attn})"
    )
    with torch.no_grad():
        full = out.get("float32", out[dtypes[0]])  # teacher-forced on the fp32 tokens
        logits = {d: models[d](full)[0, ids.shape[1] - 1 : -1] for d in dtypes}  # (N, V)
    base = logits.get("float32")
    for dtype in dtypes:
        rate = new_tokens / best[dtype]
        line = (
            f"  {'attnlab ' + dtype:22s} {rate:6.1f} tokens/s  decode {decode_rate(dtype):6.1f} "
            f"tokens/s   {rate / peer:5.2f}x transformers"
        )
        same = out[dtype].tolist() == out["transformers"].tolist()
        line += f", same tokens as transformers: {same}"
        if base is not None and dtype != "float32":
            ours_new, fp32_new = out[dtype][0, ids.shape[1] :], out["float32"][0, ids.shape[1] :]
            diff = (ours_new != fp32_new).nonzero()
            first = int(diff[0]) if len(diff) else None
            agree = (logits[dtype].argmax(-1) == base.argmax(-1)).float().mean().item()
            rel = ((logits[dtype] - base).norm() / base.norm()).item()
            line += (
                f"\n  {'':22s} vs fp32: first different token {first}, teacher-forced argmax "
                f"agreement {agree:.3f}, relative logit error {rel:.4f}"
            )
        print(line)
        rec.add(
            f"generate, {dtype} weights",
            rate,
            "tokens/s",
            peer="transformers fp32",
            peer_value=peer,
            note=f"same tokens as transformers: {same}",
        )
        rec.add(
            f"decode only, {dtype} weights",
            decode_rate(dtype),
            "tokens/s",
            peer="transformers fp32",
            peer_value=peer_dec,
        )
    rec.note(f"generation pairs: {res.quietness()}")
    print("  llama.cpp (same Q4_1 file, llama-bench, 2 threads, issue 14): 83 tokens/s decode")
    print(f"  load_pretrained('smollm2-135m-instruct'): {load_s:.2f} s")

    long_ids = torch.tensor([tok.encode(PASSAGE * 40)[:prefill_len]])

    def prefill(dtype: str) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad():
                models[dtype](long_ids, logits_to_keep=1)

        return run

    def ref_prefill() -> None:
        with torch.no_grad():
            ref(long_ids, logits_to_keep=1)

    pf: dict[str, Callable[[], object]] = {"transformers": ref_prefill}
    pf.update({d: prefill(d) for d in dtypes})
    for fn in pf.values():
        fn()
    res = timed_pairs(pf, reps)
    peer_pf = long_ids.shape[1] / res.best["transformers"]
    print(f"Prefill of {long_ids.shape[1]} tokens (one forward); {res.quietness()}")
    print(f"  {'transformers fp32':22s} {peer_pf:7.1f} tokens/s")
    for dtype in dtypes:
        rate = long_ids.shape[1] / res.best[dtype]
        print(f"  {'attnlab ' + dtype:22s} {rate:7.1f} tokens/s   {rate / peer_pf:5.2f}x")
        rec.add(
            f"prefill {long_ids.shape[1]} tokens, {dtype} weights",
            rate,
            "tokens/s",
            peer="transformers fp32",
            peer_value=peer_pf,
        )
    rec.note(f"prefill pairs: {res.quietness()}")
    rec.note(f"load_pretrained('smollm2-135m-instruct'): {load_s:.2f} s")
    rec.write()


def bench_minilm(reps: int, n_sentences: int, batch_size: int) -> None:
    from sentence_transformers import SentenceTransformer

    model, tok = load_pretrained("all-minilm-l6-v2")
    st = SentenceTransformer(str(minilm_dir()), device="cpu")
    words = PASSAGE.split()
    sentences = [" ".join(words[i % 40 : i % 40 + 4 + (7 * i) % 29]) for i in range(n_sentences)]
    out: dict[str, torch.Tensor] = {}

    def ours() -> None:
        out["attnlab"] = sentence_embeddings(model, tok, sentences, batch_size=batch_size)

    def theirs() -> None:
        out["st"] = torch.from_numpy(st.encode(sentences, batch_size=batch_size))

    ours(), theirs()
    res = timed_pairs({"attnlab": ours, "st": theirs}, reps)
    best = res.best
    print(f"  ({res.quietness()})")
    rate = {k: n_sentences / v for k, v in best.items()}
    diff = (out["attnlab"] - out["st"]).abs().max().item()
    print(f"all-MiniLM-L6-v2, {n_sentences} sentences, batch {batch_size}:")
    print(f"  attnlab               {rate['attnlab']:7.1f} sentences/s")
    print(f"  sentence-transformers {rate['st']:7.1f} sentences/s")
    print(f"  ratio                 {rate['attnlab'] / rate['st']:7.2f}x   max |diff| {diff:.1e}")
    rec = Recorder(
        "bench_pretrained",
        "minilm",
        f"all-MiniLM-L6-v2 sentence embeddings, {n_sentences} sentences, batch {batch_size}, "
        "against sentence-transformers on the same weights, interleaved pairs",
        torch.get_num_threads(),
    )
    rec.add(
        "sentence embeddings",
        rate["attnlab"],
        "sentences/s",
        peer="sentence-transformers",
        peer_value=rate["st"],
        note=f"max |difference| {diff:.1e}",
    )
    rec.note(res.quietness())
    rec.write()


# family -> transformers config overrides for the mid-size benchmark model
MID_SIZE: dict[str, dict[str, object]] = {
    "llama": {"num_key_value_heads": 2},
    "mistral": {"num_key_value_heads": 2, "sliding_window": 4096},
    "qwen2": {"num_key_value_heads": 2},
    "qwen3": {"num_key_value_heads": 2, "head_dim": 64},
    "olmo2": {"num_key_value_heads": 2},
    "phi3": {"num_key_value_heads": 2, "pad_token_id": 0},
    "gemma2": {"num_key_value_heads": 2, "head_dim": 64, "pad_token_id": 0},
    "gpt_neox": {},
    "bloom": {},
    "gpt2": {},
}


def _mid_size_dir(family: str, folder: str, dtype: torch.dtype) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes: dict[str, object] = (
        {"n_embd": 512, "n_layer": 8, "n_head": 8, "n_positions": 1024}
        if family == "gpt2"
        else {
            "hidden_size": 512,
            "intermediate_size": 1376,
            "num_hidden_layers": 8,
            "num_attention_heads": 8,
            "max_position_embeddings": 1024,
        }
    )
    config = AutoConfig.for_model(family, vocab_size=8192, **sizes, **MID_SIZE[family])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    model.save_pretrained(folder, safe_serialization=True)


def _write_tokenizer(folder: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"])
    tok.train_from_iterator([PASSAGE], trainer)
    tok.save(os.path.join(folder, "tokenizer.json"))


def bench_families(
    reps: int, load_reps: int, families: list[str], prompt_len: int, new_tokens: int
) -> None:
    import gc
    import tempfile

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # no progress bars or config warnings between rows
    hf_logging.disable_progress_bar()
    rec = Recorder(
        "bench_pretrained",
        "families",
        f"your own model: a random 8-layer, 512-wide checkpoint of {', '.join(families)} saved "
        "by transformers; load time (load_pretrained against from_pretrained, median of "
        f"{load_reps} interleaved pairs) and greedy tokens/s ({prompt_len}-token prompt + "
        f"{new_tokens} new, KV cache, median of {reps} pairs) against transformers",
        torch.get_num_threads(),
    )
    print(
        f"Your own model: 8 layers, width 512, prompt {prompt_len} + {new_tokens} new tokens, "
        f"greedy, KV cache, {torch.get_num_threads()} threads (ratios > 1: attnlab faster)"
    )
    print(
        f"  load: {load_reps} interleaved pairs after a warm-up load of each side (page cache "
        "warm), the previous model freed untimed; generation: "
        f"{reps} interleaved pairs. Times are medians; a ratio is the median of the "
        "per-pair ratios [lowest-highest]. 'plan ms': building attnlab's fused one-token "
        "step (fused and column-major fp32 copies), which load_pretrained defers to the "
        "first decode (inside the generation time of the first, untimed, run)."
    )
    print(f"  {'family':9} {'dtype':8} {'load ms attnlab/hf':>19} {'load ratio':>18} "
          f"{'tok/s attnlab/hf':>17} {'speed ratio':>18} same  plan ms  quiet pairs")  # fmt: skip
    for family in families:
        for dtype in (torch.float32, torch.bfloat16):
            with tempfile.TemporaryDirectory() as folder:
                _mid_size_dir(family, folder, dtype)
                _write_tokenizer(folder)
                loaded: dict[str, object] = {}

                def load_ours(
                    folder: str = folder, dtype: torch.dtype = dtype, loaded: dict = loaded
                ) -> None:
                    loaded["attnlab"] = load_pretrained(folder, dtype=dtype)[0]

                def load_theirs(
                    folder: str = folder, dtype: torch.dtype = dtype, loaded: dict = loaded
                ) -> None:
                    loaded["hf"] = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()

                def drop(name: str, loaded: dict = loaded) -> None:
                    loaded.pop(name, None)
                    gc.collect()

                load_ours(), load_theirs()  # warm-up (file cache, imports, first-call costs)
                load = timed_pairs(
                    {"attnlab": load_ours, "hf": load_theirs}, load_reps, before=drop
                )
                load_ours(), load_theirs()  # the models to generate with
                ours_model, ref = loaded["attnlab"], loaded["hf"]
                t0 = time.perf_counter()  # deferred to the first one-token step: shown
                if why_not_fast_decode(ours_model) is None:  # (not ALiBi)
                    ours_model.prepare_decode()  # type: ignore[attr-defined]
                plan_ms = 1e3 * (time.perf_counter() - t0)
                g = torch.Generator().manual_seed(1)
                ids = torch.randint(10, 8000, (1, prompt_len), generator=g)
                out: dict[str, torch.Tensor] = {}

                def ours(
                    ids: torch.Tensor = ids, model: object = ours_model, out: dict = out
                ) -> None:
                    out["attnlab"] = generate(model, ids, new_tokens)

                def theirs(ids: torch.Tensor = ids, ref: object = ref, out: dict = out) -> None:
                    with torch.no_grad():
                        out["hf"] = ref.generate(  # type: ignore[attr-defined]
                            ids,
                            attention_mask=torch.ones_like(ids),
                            max_new_tokens=new_tokens,
                            min_new_tokens=new_tokens,
                            do_sample=False,
                            pad_token_id=0,
                        )

                ours(), theirs()
                gen = timed_pairs({"attnlab": ours, "hf": theirs}, reps)
                same = out["attnlab"].tolist() == out["hf"].tolist()
                lr, lr_lo, lr_hi = load.ratio("hf", "attnlab")
                gr, gr_lo, gr_hi = gen.ratio("hf", "attnlab")
                print(
                    f"  {family:9} {str(dtype)[6:]:8} "
                    f"{1e3 * load.median('attnlab'):9.1f}/{1e3 * load.median('hf'):<9.1f} "
                    f"{lr:5.2f}x [{lr_lo:4.2f}-{lr_hi:4.2f}] "
                    f"{new_tokens / gen.median('attnlab'):8.1f}/"
                    f"{new_tokens / gen.median('hf'):<8.1f} "
                    f"{gr:5.2f}x [{gr_lo:4.2f}-{gr_hi:4.2f}] {same!s:5} {plan_ms:7.1f}  "
                    f"{load.quiet_pairs}/{load.pairs}, {gen.quiet_pairs}/{gen.pairs}",
                    flush=True,
                )
                dt = str(dtype)[6:]
                rec.add(
                    f"{family} {dt}: load",
                    1e3 * load.median("attnlab"),
                    "ms",
                    peer="transformers from_pretrained",
                    peer_value=1e3 * load.median("hf"),
                    better="lower",
                    note=f"quiet pairs {load.quiet_pairs}/{load.pairs}",
                )
                rec.add(
                    f"{family} {dt}: generate",
                    new_tokens / gen.median("attnlab"),
                    "tokens/s",
                    peer="transformers generate",
                    peer_value=new_tokens / gen.median("hf"),
                    note=f"same tokens: {same}; quiet pairs {gen.quiet_pairs}/{gen.pairs}",
                )
    with open("/proc/loadavg") as f:
        print(f"  /proc/loadavg at the end: {f.read().strip()}")
    rec.write()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--load-reps", type=int, default=15, help="interleaved load pairs (--only families)"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (both sides)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--sentences", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--only", choices=["smollm2", "minilm", "families"], default=None)
    parser.add_argument(
        "--families", default=",".join(MID_SIZE), help="comma-separated, for --only families"
    )
    parser.add_argument("--dtypes", default="float32,int4", help="comma-separated precisions")
    parser.add_argument("--prefill-len", type=int, default=512)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with open("/proc/loadavg") as f:
        loadavg = f.read().strip()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, /proc/loadavg {loadavg}")
    if args.only in (None, "smollm2"):
        dtypes = args.dtypes.split(",")
        bench_smollm2(args.reps, args.prompt_len, args.new_tokens, dtypes, args.prefill_len)
    if args.only in (None, "minilm"):
        bench_minilm(args.reps, args.sentences, args.batch_size)
    if args.only in (None, "families"):
        families = [f for f in args.families.split(",") if f]
        unknown = sorted(set(families) - set(MID_SIZE))
        if unknown:
            parser.error(f"unknown --families {unknown}; choose from {sorted(MID_SIZE)}")
        bench_families(
            args.reps, args.load_reps, families, args.prompt_len, min(args.new_tokens, 64)
        )


if __name__ == "__main__":
    main()
