from __future__ import annotations

import pytest
import torch

from attnlab.generation import generate, generate_stream, sample_next_token


class _ToyCache:
    def __init__(self) -> None:
        self.tokens: list[torch.Tensor] = []

    @property
    def seq_len(self) -> int:
        return sum(t.size(1) for t in self.tokens)


class ToyLM(torch.nn.Module):
    """A causal LM whose logits depend on every visible token and its position (from 0 at the
    window start), so a wrong crop, position or cache use changes the output."""

    def __init__(self, vocab: int = 11, context_length: int | None = 6) -> None:
        super().__init__()
        self.vocab, self.context_length = vocab, context_length
        self.calls: list[int] = []  # tokens fed per call

    def new_kv_cache(self) -> list[_ToyCache]:
        return [_ToyCache()]

    def forward(self, input_ids, *, kv_cache=None):
        self.calls.append(input_ids.size(1))
        past = torch.zeros(input_ids.size(0), 0, dtype=torch.long)
        if kv_cache is not None:
            if kv_cache[0].tokens:
                past = torch.cat(kv_cache[0].tokens, dim=1)
            kv_cache[0].tokens.append(input_ids)
        seq = torch.cat([past, input_ids], dim=1)  # (B, S)
        S = seq.size(1)
        if self.context_length is not None:
            assert self.context_length >= S
        pos = torch.arange(S) + 1
        mix = torch.cumsum(seq * pos * 7 + pos * pos, dim=1)[:, -input_ids.size(1) :]  # (B, T)
        v = torch.arange(self.vocab)
        return -(((mix[..., None] + v * 3) % self.vocab) - 0.5 * v).float()  # (B, T, V)


@pytest.mark.parametrize("context", [6, None])
def test_cache_and_no_cache_give_identical_greedy_tokens(context):
    prompt = torch.tensor([[1, 2, 3], [4, 5, 9]])
    a = generate(ToyLM(context_length=context), prompt, 12, use_cache=False)
    model = ToyLM(context_length=context)
    b = generate(model, prompt, 12, use_cache=True)
    assert torch.equal(a, b)
    assert a.shape == (2, 15)
    if context is None:
        assert model.calls == [3] + [1] * 11  # one step per new token over the cache
    else:
        # One prefill; one-token steps while the window fits; rebuilds once it slides.
        assert model.calls[:4] == [3, 1, 1, 1] and max(model.calls) <= 6


def test_context_size_crops_the_window():
    model = ToyLM(context_length=None)
    out = generate(model, torch.tensor([[1, 2, 3, 4, 5]]), 3, context_size=2, use_cache=False)
    assert model.calls == [2, 2, 2]
    model2 = ToyLM(context_length=None)
    assert torch.equal(
        generate(model2, torch.tensor([[4, 5]]), 1, use_cache=False)[0, -1:], out[0, 5:6]
    )


def test_greedy_picks_the_argmax_and_sampling_is_seeded():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 4.9]])
    assert sample_next_token(logits).tolist() == [[1], [0]]
    # top_k=1 and a tiny top_p leave only the argmax, whatever the temperature.
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        assert sample_next_token(logits, temperature=5.0, top_k=1, generator=g).tolist() == [
            [1],
            [0],
        ]
        assert sample_next_token(logits, temperature=5.0, top_p=0.01, generator=g).tolist() == [
            [1],
            [0],
        ]
    draws = [
        sample_next_token(logits, temperature=1.0, generator=torch.Generator().manual_seed(s))
        for s in range(40)
    ]
    assert {int(d[1, 0]) for d in draws} == {0, 2}  # close logits: both are drawn
    again = sample_next_token(logits, temperature=1.0, generator=torch.Generator().manual_seed(3))
    assert torch.equal(again, draws[3])


def test_top_p_keeps_the_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    seen = set()
    g = torch.Generator().manual_seed(1)
    for _ in range(300):
        seen.add(int(sample_next_token(logits, temperature=1.0, top_p=0.8, generator=g)))
    assert seen == {0, 1}  # 0.5 + 0.3 reaches 0.8; 2 and 3 are cut


def test_eos_stops_each_row():
    """Two rows reach EOS at different steps: the first keeps emitting EOS while the other
    goes on, and generation stops when the last row has emitted it."""
    prompt = torch.tensor([[1, 2], [1, 7]])
    eos = 10
    free = generate(ToyLM(context_length=None), prompt, 10)[:, 2:]  # no EOS handling
    firsts = [int((row == eos).nonzero()[0]) for row in free]  # first EOS of each row
    assert firsts[1] < firsts[0]  # row 1 finishes first ...
    assert bool((free[1, firsts[1] + 1 : firsts[0] + 1] != eos).any())  # ... then goes on
    out = generate(ToyLM(context_length=None), prompt, 10, eos_id=eos)
    assert out.shape == (2, 2 + firsts[0] + 1)  # stops at the last row's EOS
    for r, first in enumerate(firsts):
        new = out[r, 2:]
        assert torch.equal(new[: first + 1], free[r, : first + 1])  # its own tokens up to EOS
        assert bool((new[first:] == eos).all())  # then EOS
    # One row alone stops at its own EOS.
    alone = generate(ToyLM(context_length=None), prompt[1:], 10, eos_id=eos)
    assert torch.equal(alone[0], out[1, : 2 + firsts[1] + 1])


def test_stream_yields_the_same_tokens_as_generate():
    prompt = torch.tensor([[3, 1, 4]])
    streamed = list(generate_stream(ToyLM(), prompt, 5))
    assert all(t.shape == (1, 1) for t in streamed)
    assert torch.cat([prompt, *streamed], dim=1).tolist() == generate(ToyLM(), prompt, 5).tolist()


def test_bad_arguments_are_named():
    model = ToyLM()
    with pytest.raises(TypeError, match=r"`idx` must be a \(B, T\) torch\.long"):
        generate(model, torch.tensor([1, 2]), 3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, torch.tensor([[1]]), -1)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, torch.tensor([[1]]), 2, temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, torch.tensor([[1]]), 2, temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        generate(model, torch.tensor([[1]]), 2, temperature=1.0, top_k=0)
    with pytest.raises(ValueError, match="exceeds the model's context length"):
        generate(model, torch.tensor([[1]]), 2, context_size=7)
    assert torch.equal(generate(model, torch.tensor([[1]]), 0), torch.tensor([[1]]))


def test_gpt_greedy_with_and_without_cache_identical():
    from attnlab.models.gpt import GPTConfig, GPTModel

    cfg = GPTConfig(vocab_size=101, context_length=10, emb_dim=16, n_heads=4, n_layers=2)
    torch.manual_seed(5)
    model = GPTModel(cfg).eval()
    prompt = torch.randint(0, 101, (2, 4))
    # 14 new tokens: past the 10-token context, so the window slides too.
    a = generate(model, prompt, 14, use_cache=False)
    b = generate(model, prompt, 14, use_cache=True)
    assert torch.equal(a, b)
    torch.manual_seed(0)
    s1 = generate(
        model,
        prompt,
        8,
        temperature=0.8,
        top_k=20,
        top_p=0.9,
        generator=torch.Generator().manual_seed(9),
    )
    s2 = generate(
        model,
        prompt,
        8,
        temperature=0.8,
        top_k=20,
        top_p=0.9,
        use_cache=False,
        generator=torch.Generator().manual_seed(9),
    )
    assert torch.equal(s1, s2)


def test_on_logits_sees_every_steps_last_logits_before_the_choice():
    """`on_logits` gets the last position's logits of each step, the very ones the token is
    chosen from: greedy picks their argmax, and they equal the uncached full pass."""
    prompt = torch.tensor([[3, 1, 4], [2, 7, 1]])
    seen: list[torch.Tensor] = []
    out = generate(ToyLM(context_length=None), prompt, 6, on_logits=lambda x: seen.append(x))
    assert len(seen) == 6 and all(x.shape == (2, 11) for x in seen)
    for i, logits in enumerate(seen):
        assert logits.argmax(dim=-1).tolist() == out[:, 3 + i].tolist()
        full = ToyLM(context_length=None)(out[:, : 3 + i])[:, -1]  # (B, V)
        torch.testing.assert_close(logits, full, atol=0, rtol=0)


def test_attnlab_models_follow_the_protocol_and_decode_into_a_static_cache():
    """GPTModel is a CausalLM with both optional parts, so `generate` hands it a static cache
    (one new token then takes the fast step) and asks for the last position's logits only;
    the minimal toy model gets the growing cache and full logits."""
    from attnlab.attention import StaticKVCache
    from attnlab.generation import CausalLM, _Options
    from attnlab.models.gpt import GPTConfig, GPTModel

    cfg = GPTConfig(vocab_size=101, context_length=10, emb_dim=16, n_heads=4, n_layers=2)
    model = GPTModel(cfg).eval()
    assert isinstance(model, CausalLM) and isinstance(ToyLM(), CausalLM)
    assert not isinstance(object(), CausalLM)
    assert _Options.of(model) == _Options(keep_last=True, static_cache=True, switch_length=None)
    assert _Options.of(ToyLM()) == _Options(keep_last=False, static_cache=False, switch_length=None)
    caches, shapes = [], []
    real_forward = model.forward

    def forward(input_ids, *, kv_cache=None, logits_to_keep=None):
        caches.append(kv_cache)
        out = real_forward(input_ids, kv_cache=kv_cache, logits_to_keep=logits_to_keep)
        shapes.append(tuple(out.shape))
        return out

    model.forward = forward  # type: ignore[method-assign]
    generate(model, torch.tensor([[1, 2, 3]]), 4)
    assert all(isinstance(c, StaticKVCache) and c.max_len == 7 for c in caches[0])
    assert shapes == [(1, 1, 101)] * 4  # the prompt's logits: the last position only
    assert model._decode_plan is not None  # the one-token steps took the fast step


def test_text_stream_pieces_are_the_whole_decode_and_each_push_decodes_a_few_tokens():
    from attnlab.data import get_tokenizer
    from attnlab.generation import TextStream

    tok = get_tokenizer()
    text = " naïve café, 東京の猫 🐈‍⬛ and ß. " * 20
    ids = tok.encode(text)
    lengths: list[int] = []

    class Counting:
        def decode(self, ids):
            lengths.append(len(ids))
            return tok.decode(ids)

    stream = TextStream(Counting(), tok.encode("Say"))
    pieces = [stream.push(i) for i in ids]
    pieces.append(stream.flush())
    assert "".join(pieces) == text
    # Each push decodes from the last token that is whole characters on its own: a few
    # tokens (the emoji's bytes span many), not the whole sequence (quadratic).
    assert len(ids) > 400 and max(lengths) <= 24
    # Cut inside the cat emoji: what is held back comes out as the decoder writes it.
    cut = next(n for n in range(len(ids)) if tok.decode(ids[:n]).endswith("\ufffd"))
    stream = TextStream(tok)
    head = "".join(stream.push(i) for i in ids[:cut]) + stream.flush()
    assert head == tok.decode(ids[:cut])


def test_greedy_choice_is_torchs_argmax_ties_and_nans_included():
    from attnlab.generation import _argmax

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 262144, generator=g)
    logits[1, 7] = logits[1, 9] = logits[1].max() + 1  # a tie: the first index
    logits[2, 5] = float("nan")  # NaN counts as the largest, as in torch
    sliced = torch.randn(2, 4, 50, generator=g)[:, -1]  # a strided view of the last position
    for x in (logits, sliced, logits.double(), logits.bfloat16()):
        got = _argmax(x)
        assert got.dtype == torch.long and got.shape == (x.shape[0], 1)
        assert torch.equal(got, x.argmax(dim=-1, keepdim=True))
