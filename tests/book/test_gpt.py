from __future__ import annotations

import dataclasses

import pytest
import torch

from attnlab.backends import available_backends
from attnlab.models.gpt import (
    PRESETS,
    GPTConfig,
    GPTModel,
    analytic_parameter_count,
    parameter_report,
)
from book_gpt import BookGPTModel
from reference import tol

SMALL = GPTConfig(vocab_size=97, context_length=12, emb_dim=16, n_heads=4, n_layers=2)
BOOK_BATCH = torch.tensor([[6109, 3626, 6100, 345], [6109, 1110, 6622, 257]])


def _both(cfg: GPTConfig, seed: int = 123, backend: str = "auto"):
    torch.manual_seed(seed)
    ours = GPTModel(cfg, backend=backend)
    torch.manual_seed(seed)
    book = BookGPTModel(dataclasses.asdict(cfg))
    return ours, book


# "ring" needs a process group: tests/distributed/test_distributed_ring.py trains the GPT with it.
@pytest.mark.parametrize("backend", [b for b in available_backends() if b != "ring"])
def test_same_seed_gives_the_books_weights_and_outputs(backend):
    ours, book = _both(SMALL, backend=backend)
    ours_sd = ours.state_dict()
    book_sd = {k: v for k, v in book.state_dict().items() if not k.endswith(".mask")}
    assert list(ours_sd) == list(book_sd)  # same names, same creation order
    for k in book_sd:
        torch.testing.assert_close(ours_sd[k], book_sd[k], rtol=0, atol=0)
    ours.eval()
    book.eval()
    x = torch.randint(0, SMALL.vocab_size, (3, 10))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), book(x), **tol(torch.float32))


def test_parameters_are_created_in_the_books_order():
    model = GPTModel(SMALL)
    names = [n for n, _ in model.named_parameters()]
    assert names[:2] == ["tok_emb.weight", "pos_emb.weight"]
    block = [n.split(".", 2)[2] for n in names if n.startswith("trf_blocks.0.")]
    assert block[:5] == [
        "att.W_query.weight",
        "att.W_key.weight",
        "att.W_value.weight",
        "att.out_proj.weight",
        "att.out_proj.bias",
    ]
    assert block[5].startswith("ff.layers.0")
    assert names[-3:] == ["final_norm.scale", "final_norm.shift", "out_head.weight"]


@pytest.mark.slow
def test_gpt2_124m_reproduces_the_books_printed_logits():
    # The book prints these right after construction, with dropout active (train mode).
    torch.manual_seed(123)
    model = GPTModel(GPTConfig.preset("gpt2-124m"))
    with torch.no_grad():
        out = model(BOOK_BATCH)
    assert out.shape == (2, 4, 50257)
    # The book's printout: first and last three logits of each of the 2 x 4 positions.
    book_head = torch.tensor(
        [
            [[0.3613, 0.4222, -0.0711], [-0.1792, -0.5660, -0.9485],
             [0.7120, 0.0332, 0.1085], [-1.0076, 0.3418, -0.1190]],
            [[-0.2564, 0.0900, 0.0335], [0.1230, 0.3653, -0.2074],
             [1.0558, 1.0318, -0.2800], [-0.1565, 0.3926, 0.3288]],
        ]
    )  # fmt: skip
    book_tail = torch.tensor(
        [
            [[0.3483, 0.4661, -0.2838], [0.0477, 0.5181, -0.3168],
             [0.1018, -0.4327, -0.2553], [0.7195, 0.4023, 0.0532]],
            [[0.2659, 0.4454, -0.6806], [0.7705, 0.2710, 0.2246],
             [0.6936, 0.3205, -0.3178], [1.2630, -0.1858, 0.0388]],
        ]
    )  # fmt: skip
    torch.testing.assert_close(out[..., :3], book_head, atol=1e-4, rtol=0)
    torch.testing.assert_close(out[..., -3:], book_tail, atol=1e-4, rtol=0)
    # In eval mode (no dropout) it equals the book's code seeded the same way.
    model.eval()
    torch.manual_seed(123)
    book = BookGPTModel(dataclasses.asdict(GPTConfig.preset("gpt2-124m"))).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(BOOK_BATCH), book(BOOK_BATCH), **tol(torch.float32))


BOOK_COUNTS = {  # (total, total without the output head, MB in fp32), the book's exercise 4.2
    "gpt2-124m": (163_009_536, 124_412_160, 621.83),
    "gpt2-medium": (406_212_608, 354_749_440, 1549.58),
    "gpt2-large": (838_220_800, 773_891_840, 3197.56),
    "gpt2-xl": (1_637_792_000, 1_557_380_800, 6247.68),
}


@pytest.mark.parametrize("name", list(BOOK_COUNTS))
def test_parameter_counts_of_the_gpt2_presets(name):
    report = parameter_report(name)  # meta device: nothing is allocated
    total, tied, mb = BOOK_COUNTS[name]
    assert report.total == total == analytic_parameter_count(GPTConfig.preset(name))
    assert report.total_tied == tied
    assert round(report.size_mb, 2) == mb
    per = dict(report.per_module)
    cfg = report.config
    assert per["tok_emb"] == per["out_head"] == cfg.vocab_size * cfg.emb_dim
    assert per[f"trf_blocks (x{cfg.n_layers})"] == cfg.n_layers * (
        per["block.att (each)"] + per["block.ff (each)"] + per["block.norm1+norm2 (each)"]
    )
    assert sum(v for k, v in per.items() if "(each)" not in k) == total


def test_counts_match_a_real_model():
    model = GPTModel(SMALL)
    assert (
        parameter_report(SMALL).total == model.num_parameters() == analytic_parameter_count(SMALL)
    )
    cfg = dataclasses.replace(SMALL, qkv_bias=True)
    assert parameter_report(cfg).total == GPTModel(cfg).num_parameters()
    assert analytic_parameter_count(cfg) == GPTModel(cfg).num_parameters()


def test_config_validation_and_presets():
    assert set(PRESETS) == {"gpt2-124m", "gpt2-medium", "gpt2-large", "gpt2-xl", "tiny"}
    assert GPTConfig.preset("gpt2-124m") == GPTConfig(50257, 1024, 768, 12, 12, 0.1, False)
    assert GPTConfig.preset("tiny", context_length=32).context_length == 32
    with pytest.raises(ValueError, match="unknown preset 'gpt3'"):
        GPTConfig.preset("gpt3")
    with pytest.raises(ValueError, match="divisible by `n_heads`"):
        GPTConfig(emb_dim=10, n_heads=3)
    with pytest.raises(ValueError, match="drop_rate"):
        GPTConfig(drop_rate=1.0)
    with pytest.raises(ValueError, match="n_layers"):
        GPTConfig(n_layers=0)
    with pytest.raises(ValueError, match="unknown GPTConfig field"):
        GPTConfig.preset("tiny", width=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        SMALL.emb_dim = 8  # type: ignore[misc]
    assert GPTConfig.from_dict(SMALL.to_dict()) == SMALL
    with pytest.raises(ValueError, match="lacks keys"):
        GPTConfig.from_dict({"vocab_size": 3})


def test_forward_with_cache_matches_full_forward():
    torch.manual_seed(0)
    model = GPTModel(SMALL).eval()
    x = torch.randint(0, SMALL.vocab_size, (2, 9))
    with torch.no_grad():
        full = model(x)
        cache = model.new_kv_cache()
        parts = [model(x[:, :5], kv_cache=cache)]
        parts += [model(x[:, t : t + 1], kv_cache=cache) for t in range(5, 9)]
    assert len(cache) == SMALL.n_layers and cache[0].seq_len == 9
    torch.testing.assert_close(torch.cat(parts, dim=1), full, **tol(torch.float32))


def test_logits_to_keep_gives_the_last_positions_of_the_full_logits():
    torch.manual_seed(0)
    model = GPTModel(SMALL).eval()
    x = torch.randint(0, SMALL.vocab_size, (2, 9))
    with torch.no_grad():
        full = model(x)  # (2, 9, V)
        last = model(x, logits_to_keep=1)  # (2, 1, V)
        three = model(x, logits_to_keep=3)
        more = model(x, logits_to_keep=50)  # more than T: all of them
    assert last.shape == (2, 1, SMALL.vocab_size)
    torch.testing.assert_close(last, full[:, -1:], **tol(torch.float32))
    torch.testing.assert_close(three, full[:, -3:], **tol(torch.float32))
    torch.testing.assert_close(more, full, **tol(torch.float32))
    with pytest.raises(ValueError, match="`logits_to_keep` must be >= 1"):
        model(x, logits_to_keep=0)
    with pytest.raises(TypeError, match="`logits_to_keep` must be an int"):
        model(x, logits_to_keep=1.5)  # type: ignore[arg-type]


def test_generation_asks_for_the_last_logits_only():
    from attnlab.generation import generate

    torch.manual_seed(0)
    model = GPTModel(SMALL).eval()
    widths: list[int] = []
    model.out_head.register_forward_hook(lambda m, i, o: widths.append(o.shape[1]))
    generate(model, torch.randint(0, SMALL.vocab_size, (1, 6)), 3)
    assert widths == [1, 1, 1]  # the 6-token prompt never runs the head on 6 positions


def test_forward_errors_are_clear():
    model = GPTModel(SMALL)
    with pytest.raises(ValueError, match="exceeds the context length 12"):
        model(torch.zeros(1, 13, dtype=torch.long))
    with pytest.raises(TypeError, match="integer tensor"):
        model(torch.zeros(1, 3))
    with pytest.raises(ValueError, match="one KVCache per block"):
        model(torch.zeros(1, 3, dtype=torch.long), kv_cache=[])
    with pytest.raises(ValueError, match="backend"):
        GPTModel(SMALL, backend="flash9")
    with pytest.raises(TypeError, match="GPTConfig"):
        GPTModel({"emb_dim": 4})  # type: ignore[arg-type]


def test_generate_is_reexported():
    from attnlab import generation
    from attnlab.models import gpt

    assert gpt.generate is generation.generate


def test_position_ids_pick_the_learned_position_embeddings():
    torch.manual_seed(0)
    model = GPTModel(dataclasses.replace(SMALL, drop_rate=0.0)).eval()
    x = torch.randint(0, SMALL.vocab_size, (2, 6))
    with torch.no_grad():
        full = model(x)
        torch.testing.assert_close(model(x, position_ids=torch.arange(6)), full, rtol=0, atol=0)
        batched = torch.arange(6).expand(2, 6)
        torch.testing.assert_close(model(x, position_ids=batched), full, rtol=0, atol=0)
        # Other positions, other embeddings, other logits.
        shifted = model(x[:, :2], position_ids=torch.tensor([4, 5]))
        assert not torch.allclose(shifted, model(x[:, :2]))
    with pytest.raises(ValueError, match="position_ids"):
        model(x, position_ids=torch.arange(5))
    with pytest.raises(ValueError, match=r"\[0, 12\)"):
        model(x, position_ids=torch.arange(7, 13))
    with pytest.raises(ValueError, match="position_ids"):
        model(x, position_ids=torch.arange(6.0))
