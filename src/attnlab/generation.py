"""Text generation for any causal language model that follows attnlab's protocol.

The protocol is :class:`CausalLM`: a forward that takes ``kv_cache``, ``new_kv_cache()``
and ``context_length``; attnlab's ``GPTModel`` and ``Decoder`` also take ``max_len`` (a
static cache sized once for the whole call, which the model decodes into with its fast
one-token step; rebuilding it when the window slides reuses the same buffers, so memory
stays flat however many tokens are made) and ``logits_to_keep`` (encoding a prompt skips
the output head over all but its last token). A model whose rotary frequencies change at
a length (``model.rope.switch_length``, Phi-3's LongRoPE) has its cache rebuilt once from
the whole sequence when the sequence crosses it, as transformers' Phi-3
``prepare_inputs_for_generation`` drops its cache, so cached decoding gives the logits of
the full pass.

What a caller wants to see of each step besides the token (the server's bars of the
next-token distribution) it gets from ``on_logits``, called with the last position's
logits before the token is chosen; the model is never wrapped, so it keeps its static
cache and its fast step.

Encoder-decoder models (``model.is_encoder_decoder``, e.g. T5) take the encoder's input as
``idx`` (and its padding as ``valid``): ``model.decoder_lm(idx, valid)`` encodes it once and
returns a causal LM over the decoder's tokens that follows the protocol above, so the same
loop (sampling, cache) generates from ``model.decoder_start(idx)``; the result is the
decoder's sequence (start token + new tokens), as transformers returns it.

Greedy decoding (``temperature == 0``) with and without the cache gives identical tokens: with
the cache, the prompt is encoded once and each new token costs one step over the cache; when the
sequence outgrows the context the window slides, and the cache is rebuilt from the cropped
window so that the logits are exactly those the uncached model sees.

Shape legend: ``B`` batch, ``T`` sequence length, ``V`` vocabulary size.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast, runtime_checkable

import torch

__all__ = ["CausalLM", "TextStream", "generate", "generate_stream", "sample_next_token"]

LogitsCallback = Callable[[torch.Tensor], None]


@runtime_checkable
class CausalLM(Protocol):
    """What :func:`generate` and :func:`generate_stream` need from a model.

    Required:

    - ``model(input_ids, *, kv_cache=None)`` returns logits ``(B, T, V)`` for
      ``input_ids`` ``(B, T)`` long. With ``kv_cache`` (what ``new_kv_cache`` returned),
      the new keys and values are appended and the positions of ``input_ids`` continue
      after the ones the cache holds.
    - ``model.new_kv_cache()`` returns an empty cache: a list with one ``KVCache`` (or
      anything the model's forward accepts) per layer, each with a ``reset()``.
    - ``model.context_length``: the longest sequence the model accepts, or None.

    Optional, used when present (generation reads the signatures once per call):

    - ``new_kv_cache(max_len=N)``: a static cache of ``N`` positions allocated once;
      generation asks for ``prompt + max_new_tokens`` (at most the window) and keeps the
      buffers when it rebuilds, and one new token over it takes the model's fast step.
      Without it, generation uses the growing cache of ``new_kv_cache()``.
    - ``model(..., logits_to_keep=1)``: logits for the last position only ``(B, 1, V)``,
      so encoding a prompt skips the output head over the rest of it.
    - ``model.rope.switch_length`` (int or None): a length past which the rotary
      frequencies change (Phi-3's LongRoPE); crossing it rebuilds the cache once.
    - ``model.is_encoder_decoder`` True, with ``decoder_lm(idx, valid)`` (a causal LM over
      the decoder's tokens with ``start_ids``) and ``decoder_start(idx)``.

    attnlab's ``GPTModel`` and ``Decoder`` provide the required parts, ``max_len`` and
    ``logits_to_keep``; a ``Decoder`` with LongRoPE the switch length; ``EncoderDecoder``
    the last. ``isinstance(model, CausalLM)`` checks that the required names exist (not
    their signatures).
    """

    @property
    def context_length(self) -> int | None:
        """The longest sequence the model accepts, or None."""
        ...

    def new_kv_cache(self) -> list[Any]:
        """An empty cache, one entry per layer."""
        ...

    def __call__(
        self, input_ids: torch.Tensor, *, kv_cache: list[Any] | None = None
    ) -> torch.Tensor:
        """Logits ``(B, T, V)`` for ``input_ids`` ``(B, T)``, after the cached positions."""
        ...


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1, keepdim=True)`` (B, 1); CPU float32 rows through NumPy, whose
    argmax over a long row (a large vocabulary) is much faster than torch's, and a one-token
    step pays it once per token. Both give the first index of the largest value, a NaN
    counting as the largest."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.ndim == 2:
        import numpy as np

        found = np.argmax(logits.detach().numpy(), axis=-1)  # (B,)
        return torch.from_numpy(found).view(-1, 1).to(torch.long)
    return logits.argmax(dim=-1, keepdim=True)


def _check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError(f"`temperature` must be a number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"`top_k` must be an int >= 1 or None, got {top_k!r}")
    if top_p is not None and not (0.0 < float(top_p) <= 1.0):
        raise ValueError(f"`top_p` must be in (0, 1] or None, got {top_p!r}")


def sample_next_token(
    logits: torch.Tensor,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Choose the next token from the last position's logits.

    Args:
        logits: scores over the vocabulary.
        temperature: 0 picks the most likely token (greedy); > 0 samples from
            ``softmax(logits / temperature)``.
        top_k: when sampling, keep only the ``top_k`` most likely tokens.
        top_p: when sampling, keep the smallest set of most likely tokens whose probability
            reaches ``top_p`` (nucleus sampling); the most likely token is always kept.
        generator: the random generator for sampling (default: torch's global one).

    Returns:
        The chosen token ids.

    Raises:
        ValueError: on a negative temperature, ``top_k < 1`` or ``top_p`` outside (0, 1].

    Shape:
        logits ``(B, V)`` -> ``(B, 1)`` long.
    """
    _check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return _argmax(logits)  # (B, 1)
    logits = logits.float() / temperature  # (B, V)
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=True)  # (B, V)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens before it already reach top_p; the first always stays.
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p  # (B, V)
        drop = drop_sorted.scatter(-1, sorted_idx, drop_sorted)  # back to vocabulary order
        logits = logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # (B, V)
    return torch.multinomial(probs, num_samples=1, generator=generator)  # (B, 1)


def _check_inputs(model: Any, idx: Any, max_new_tokens: Any, context_size: Any) -> int | None:
    if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.dtype != torch.long:
        if isinstance(idx, torch.Tensor):
            got = f"{tuple(idx.shape)} {idx.dtype}"
        else:
            got = type(idx).__name__
        raise TypeError(
            f"`idx` must be a (B, T) torch.long tensor of token ids, got {got}; "
            "fix: torch.tensor([ids]) or ids.unsqueeze(0)"
        )
    if idx.size(1) < 1:
        raise ValueError("`idx` must hold at least one token per row (T >= 1), got T = 0")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise TypeError(f"`max_new_tokens` must be an int, got {type(max_new_tokens).__name__}")
    if max_new_tokens < 0:
        raise ValueError(f"`max_new_tokens` must be >= 0, got {max_new_tokens}")
    limit = getattr(model, "context_length", None)
    if context_size is None:
        return limit
    if isinstance(context_size, bool) or not isinstance(context_size, int) or context_size < 1:
        raise ValueError(f"`context_size` must be an int >= 1 or None, got {context_size!r}")
    if limit is not None and context_size > limit:
        raise ValueError(
            f"`context_size` ({context_size}) exceeds the model's context length ({limit}); "
            f"use context_size <= {limit}"
        )
    return context_size


def _causal_lm(
    model: Any, idx: torch.Tensor, valid: torch.Tensor | None
) -> tuple[Any, torch.Tensor]:
    """The causal LM to run and the sequence it starts from: ``(model, idx)`` itself, or
    for an encoder-decoder its decoder bound to the encoded ``idx`` and the start token."""
    if getattr(model, "is_encoder_decoder", False):
        lm = model.decoder_lm(idx, valid)
        return lm, lm.start_ids
    if valid is not None:
        raise ValueError(
            "`valid` is the source padding of an encoder-decoder model; this model is a "
            "causal LM: leave `valid` out"
        )
    return model, idx


def _takes(fn: Any, arg: str) -> bool:
    if fn is None:
        return False
    try:
        return arg in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins or C extensions without a signature
        return False


@dataclass(frozen=True)
class _Options:
    """The optional parts of :class:`CausalLM` that ``model`` provides (read once a call).

    Attributes:
        keep_last: its forward takes ``logits_to_keep``.
        static_cache: its ``new_kv_cache`` takes ``max_len``.
        switch_length: ``model.rope.switch_length`` when an int, else None.
    """

    keep_last: bool
    static_cache: bool
    switch_length: int | None

    @classmethod
    def of(cls, model: Any) -> _Options:
        switch = getattr(getattr(model, "rope", None), "switch_length", None)
        return cls(
            keep_last=_takes(getattr(model, "forward", None), "logits_to_keep"),
            static_cache=_takes(getattr(model, "new_kv_cache", None), "max_len"),
            switch_length=switch if isinstance(switch, int) else None,
        )


@torch.no_grad()
def generate_stream(
    model: CausalLM,
    idx: torch.Tensor,
    max_new_tokens: int,
    context_size: int | None = None,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
    valid: torch.Tensor | None = None,
    on_logits: LogitsCallback | None = None,
) -> Iterator[torch.Tensor]:
    """Yield new tokens one step at a time (see :func:`generate` for the arguments).

    The model's mode is left as it is: call ``model.eval()`` first to turn dropout off.

    Yields:
        The next token of every row, ``(B, 1)`` long. After a row emits ``eos_id`` it keeps
        emitting ``eos_id``; the stream stops when every row has emitted it.
    """
    window = _check_inputs(model, idx, max_new_tokens, context_size)
    _check_sampling(temperature, top_k, top_p)
    if max_new_tokens == 0:
        return
    # The optional parts are called on what the model really is (the protocol types the
    # required ones): Any here.
    lm, idx = _causal_lm(model, idx, valid)
    options = _Options.of(lm)
    keep = {"logits_to_keep": 1} if options.keep_last else {}
    static, switch = options.static_cache, options.switch_length
    seq = idx
    cache: list[Any] | None = None
    start = 0  # index in `seq` of the first token the cache holds
    n_cached = 0  # how many tokens, from `start` on, the cache holds
    finished = torch.zeros(idx.size(0), dtype=torch.bool, device=idx.device)  # (B,)
    for _ in range(max_new_tokens):
        if not use_cache:
            inp = seq if window is None else seq[:, -window:]  # (B, <=window)
            logits = lm(inp, **keep)
        else:
            if (
                cache is None
                or (window is not None and seq.size(1) - start > window)
                or (switch is not None and n_cached <= switch < seq.size(1) - start)
            ):
                # First step, the window slid past the cache's first position, or the sequence
                # crossed the RoPE switch length: (re)build the cache from the cropped window,
                # so positions and rotations match what the uncached model sees.
                start = 0 if window is None else max(0, seq.size(1) - window)
                if cache is not None and static:
                    for layer_cache in cache:
                        layer_cache.reset()  # same buffers: memory stays flat
                elif static:
                    total = idx.size(1) + max_new_tokens
                    cache = lm.new_kv_cache(max_len=total if window is None else min(total, window))
                else:
                    cache = lm.new_kv_cache()
                n_cached = 0
            inp = seq[:, start + n_cached :]  # (B, new tokens)
            logits = lm(inp, kv_cache=cache, **keep)
            n_cached += inp.size(1)
        last = logits[:, -1, :]  # (B, V)
        if on_logits is not None:
            on_logits(last)
        nxt = sample_next_token(
            last, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator
        )  # (B, 1)
        if eos_id is not None:
            nxt = nxt.masked_fill(finished[:, None], eos_id)
            finished |= nxt[:, 0] == eos_id
        seq = torch.cat([seq, nxt], dim=1)  # (B, T+1)
        yield nxt
        if eos_id is not None and bool(finished.all()):
            return


def generate(
    model: CausalLM,
    idx: torch.Tensor,
    max_new_tokens: int,
    context_size: int | None = None,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
    valid: torch.Tensor | None = None,
    on_logits: LogitsCallback | None = None,
) -> torch.Tensor:
    """Continue each row of ``idx`` by up to ``max_new_tokens`` tokens.

    Args:
        model: a causal language model following :class:`CausalLM`, or an
            encoder-decoder.
        idx: the prompt token ids.
        max_new_tokens: how many tokens to add (fewer if every row reaches ``eos_id``).
        context_size: the longest window the model is shown; defaults to
            ``model.context_length``; older tokens are cropped from the left.
        temperature: 0 is greedy decoding; > 0 samples.
        top_k: sample only among the ``top_k`` most likely tokens.
        top_p: nucleus sampling threshold in (0, 1].
        eos_id: stop a row when it emits this token (the token is kept in the output).
        use_cache: keep a KV cache, so each new token costs one step over the cache.
        generator: random generator used for sampling.
        valid: encoder-decoder models only: ``(B, T)`` bool, False = padding in ``idx``.
        on_logits: called at every step with the last position's logits ``(B, V)`` (the
            model's, before temperature and filtering), before the next token is chosen
            from them; the tensor is the model's output: copy what you keep.

    Returns:
        The prompt followed by the new tokens; for an encoder-decoder, the decoder start
        token followed by the new tokens ``(B, 1 + n)``.

    Raises:
        TypeError: if ``idx`` is not a (B, T) long tensor.
        ValueError: on an invalid count, window or sampling setting.

    Shape:
        idx ``(B, T)`` -> ``(B, T + n)`` with ``n <= max_new_tokens``.
    """
    new = list(
        generate_stream(
            model,
            idx,
            max_new_tokens,
            context_size,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            eos_id=eos_id,
            use_cache=use_cache,
            generator=generator,
            valid=valid,
            on_logits=on_logits,
        )
    )
    if getattr(model, "is_encoder_decoder", False):
        idx = cast(Any, model).decoder_start(idx)  # (B, 1): the decoder's sequence
    return torch.cat([idx, *new], dim=1) if new else idx.clone()


class TextStream:
    """Turn token ids, arriving one by one, into text pieces that are safe to show.

    Byte-level BPE tokens can end inside a multi-byte character; the decoded text then
    ends in U+FFFD, and that tail is held back until the next token completes it.
    SentencePiece decoders drop the space of the first token (``▁the`` alone decodes to
    ``the``); decoding after ``context`` (the prompt's last token) keeps it.

    Args:
        tokenizer: anything with ``decode(ids) -> str`` (tiktoken, attnlab's pretrained
            tokenizers).
        context: token ids the stream continues (decoded with it, never shown); ignored
            when they do not decode to whole characters.
    """

    def __init__(self, tokenizer: Any, context: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.context = [int(i) for i in context]
        head = tokenizer.decode(self.context) if self.context else ""
        if head.endswith("\ufffd"):
            self.context, head = [], ""
        self.skip = len(head)
        self.ids: list[int] = []
        self.shown = 0

    def _text(self) -> str:
        return str(self.tokenizer.decode(self.context + self.ids))[self.skip :]

    def push(self, token: int) -> str:
        """Add one token; return the new text that is complete (may be ``""``)."""
        self.ids.append(token)
        text = self._text()
        if text.endswith("\ufffd"):
            return ""
        piece, self.shown = text[self.shown :], len(text)
        self._rebase(token)
        return piece

    def _rebase(self, token: int) -> None:
        """Continue after ``token`` alone, so each push decodes a few tokens, not them all.

        Kept growing while ``token`` alone is not whole characters (it finished a character
        an earlier token began).
        """
        head = str(self.tokenizer.decode([token]))
        if "\ufffd" in head:
            return
        self.context, self.ids, self.skip, self.shown = [token], [], len(head), 0

    def flush(self) -> str:
        """The text still held back (at the end of the stream)."""
        text = self._text()
        piece, self.shown = text[self.shown :], len(text)
        return piece
