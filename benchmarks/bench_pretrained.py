"""Benchmark the real pretrained models against the reference libraries, same weights.

1. SmolLM2-135M-Instruct greedy generation, tokens/s: a 64-token prompt, 128 new tokens,
   fp32, KV cache on both sides. attnlab: ``attnlab.generation.generate`` on
   ``load_pretrained("smollm2-135m-instruct")``; peer: ``transformers``
   ``LlamaForCausalLM.generate`` (its default ``sdpa`` attention) with the weights that
   transformers' GGUF loader dequantises from the same file.
2. all-MiniLM-L6-v2 sentence encoding, sentences/s: the same sentences, batch size 32,
   attnlab's ``sentence_embeddings`` against ``SentenceTransformer.encode``.

Both sides run in one process, alternating within each repetition so that load from
other processes hits them alike; the time reported is the best repetition. Also
printed: SmolLM2 load time (``load_pretrained``), and whether both sides produced the
same tokens / embeddings (within 1e-5).

Usage::

    HF_HUB_OFFLINE=1 python benchmarks/bench_pretrained.py --reps 3 --threads 2
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

from attnlab.generation import generate
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


def best_of(reps: int, fns: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Run every function ``reps`` times, interleaved (order alternating); best wall time."""
    best = {name: float("inf") for name in fns}
    for rep in range(reps):
        items = list(fns.items())
        for name, fn in items if rep % 2 == 0 else reversed(items):
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


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


def bench_smollm2(reps: int, prompt_len: int, new_tokens: int) -> None:
    t0 = time.perf_counter()
    model, tok = load_pretrained("smollm2-135m-instruct")
    load_s = time.perf_counter() - t0
    ref = smollm2_reference()
    ids = torch.tensor([tok.encode(PASSAGE * 4)[:prompt_len]])
    mask = torch.ones_like(ids)
    out: dict[str, torch.Tensor] = {}

    def ours() -> None:
        out["attnlab"] = generate(model, ids, new_tokens, use_cache=True)

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

    ours(), theirs()  # warm-up
    best = best_of(reps, {"attnlab": ours, "transformers": theirs})
    rate = {k: new_tokens / v for k, v in best.items()}
    same = out["attnlab"].tolist() == out["transformers"].tolist()
    print(f"SmolLM2-135M greedy, prompt {ids.shape[1]} + {new_tokens} new tokens, fp32, KV cache:")
    print(f"  attnlab       {rate['attnlab']:7.1f} tokens/s")
    attn = ref.config._attn_implementation
    print(f"  transformers  {rate['transformers']:7.1f} tokens/s   (attention: {attn})")
    print(f"  ratio         {rate['attnlab'] / rate['transformers']:7.2f}x   same tokens: {same}")
    print(f"  load_pretrained('smollm2-135m-instruct'): {load_s:.2f} s")


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
    best = best_of(reps, {"attnlab": ours, "st": theirs})
    rate = {k: n_sentences / v for k, v in best.items()}
    diff = (out["attnlab"] - out["st"]).abs().max().item()
    print(f"all-MiniLM-L6-v2, {n_sentences} sentences, batch {batch_size}:")
    print(f"  attnlab               {rate['attnlab']:7.1f} sentences/s")
    print(f"  sentence-transformers {rate['st']:7.1f} sentences/s")
    print(f"  ratio                 {rate['attnlab'] / rate['st']:7.2f}x   max |diff| {diff:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (both sides)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--sentences", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--only", choices=["smollm2", "minilm"], default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if args.only in (None, "smollm2"):
        bench_smollm2(args.reps, args.prompt_len, args.new_tokens)
    if args.only in (None, "minilm"):
        bench_minilm(args.reps, args.sentences, args.batch_size)


if __name__ == "__main__":
    main()
