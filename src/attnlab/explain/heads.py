"""What heads do: role scores, ablation, the logit lens and attention rollout, as data.

Shape legend:
    L layers, H heads per layer, B batch, T tokens, V vocabulary, K tokens kept (top-k).

Nothing here re-implements the model: the role scores read the weights the layers
computed (:func:`attnlab.explain.trace_model`), ablation edits the heads' outputs inside
the model's own forward (:func:`attnlab.attention.edit_heads`), and the logit lens reads
the residual stream the model's blocks produced (:func:`attnlab.models._lm.watch_residual`)
through the model's own final norm and output head (its ``readout``). Every attnlab
causal LM works: its GPT, every decoder family, GGUF files.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from attnlab.explain.model_trace import attention_layers, trace_model

__all__ = [
    "INDUCTION_LENGTH",
    "INDUCTION_SEED",
    "ROLES",
    "AblationEffect",
    "HeadScores",
    "ablate",
    "ablation_effect",
    "default_input",
    "head_scores",
    "induction_input",
    "logit_lens",
    "parse_heads",
    "rollout",
    "strongest_heads",
    "top_tokens",
]

ROLES = ("previous_token", "first_token", "current_token", "induction")
INDUCTION_LENGTH = 32
INDUCTION_SEED = 0

HeadScores = dict[str, torch.Tensor]


def _vocab_size(model: torch.nn.Module) -> int:
    """The size of the token embedding: every attnlab model creates it first."""
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            return int(module.num_embeddings)
    raise TypeError(f"`model` ({type(model).__name__}) has no token embedding (nn.Embedding)")


def induction_input(
    vocab_size: int, n: int = INDUCTION_LENGTH, seed: int = INDUCTION_SEED
) -> torch.Tensor:
    """A random token sequence of length ``n``, repeated twice: the induction test input.

    The tokens are drawn uniformly from ``[0, vocab_size)`` by a ``torch.Generator``
    seeded with ``seed``, so the same call gives the same ids on every machine.

    Returns:
        ``(2n,)`` long tensor ``x`` with ``x[n:] == x[:n]``.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise ValueError(f"`n` must be an int >= 2, got {n!r}")
    if vocab_size < 2:
        raise ValueError(f"`vocab_size` must be at least 2, got {vocab_size}")
    generator = torch.Generator().manual_seed(seed)
    first = torch.randint(0, vocab_size, (n,), generator=generator)  # (n,)
    return torch.cat([first, first])  # (2n,)


def default_input(
    model: torch.nn.Module, n: int = INDUCTION_LENGTH, seed: int = INDUCTION_SEED
) -> list[int]:
    """:func:`induction_input` for ``model``'s vocabulary (its token embedding's size).

    Raises:
        ValueError: ``2n`` longer than the model's context length.
    """
    ids = induction_input(_vocab_size(model), n, seed).tolist()
    context = getattr(model, "context_length", None)
    if isinstance(context, int) and len(ids) > context:
        raise ValueError(
            f"`n`={n} makes a {2 * n}-token input, longer than the model's context "
            f"length {context}; pass n <= {context // 2}"
        )
    return ids


def _repeat_length(ids: Sequence[int]) -> int | None:
    """``n`` when ``ids`` is a sequence of length ``n`` repeated twice, else None."""
    T = len(ids)
    if T < 4 or T % 2:
        return None
    n = T // 2
    return n if list(ids[:n]) == list(ids[n:]) else None


def _ids_list(ids: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(ids, torch.Tensor):
        t = ids[0] if ids.ndim == 2 and ids.shape[0] == 1 else ids
        if t.ndim != 1 or t.is_floating_point():
            raise ValueError(
                "`ids` must be integer token ids of shape (T,) or (1, T), got "
                f"{t.dtype} {tuple(ids.shape)}"
            )
        return [int(i) for i in t.tolist()]
    return [int(i) for i in ids]


def head_scores(
    model: torch.nn.Module,
    ids: Sequence[int] | torch.Tensor | None = None,
    *,
    n: int = INDUCTION_LENGTH,
    seed: int = INDUCTION_SEED,
) -> HeadScores:
    """How strongly every head plays each role, from the weights the model computed.

    With ``A`` one head's attention weights ``(T, T)`` on the input:

    - ``previous_token``: mean over queries ``i >= 1`` of ``A[i, i-1]``;
    - ``first_token``: mean over ``i >= 1`` of ``A[i, 0]``;
    - ``current_token``: mean over ``i`` of ``A[i, i]``;
    - ``induction``: on a sequence of length ``n`` repeated twice, mean over ``i >= n``
      of ``A[i, i-n+1]``: the query sits on the second copy and looks at the token that
      followed its earlier copy.

    With ``ids=None`` the input is :func:`induction_input` (``n`` = 32 random tokens of
    the model's vocabulary, seed 0, repeated: 64 tokens) and all four roles are scored on
    it. With ``ids``, the first three roles are scored on those ids, and ``induction``
    only when the ids have the repeated form (an even length ``2m`` with
    ``ids[:m] == ids[m:]``, then with ``n = m``); otherwise the result has no
    ``"induction"`` key.

    Args:
        model: any attnlab model (built on :class:`attnlab.attention.Attention`).
        ids: token ids ``(T,)`` or ``(1, T)``, or None for the repeated random input.
        n: the length of the repeated sequence when ``ids`` is None.
        seed: its seed.

    Returns:
        A dict from role (:data:`ROLES` order) to a float32 ``(L, H)`` tensor in ``[0, 1]``.

    Raises:
        TypeError: the model has no attnlab attention layers.
        ValueError: fewer than 2 ids, ``n`` out of range.
    """
    token_ids = default_input(model, n, seed) if ids is None else _ids_list(ids)
    if len(token_ids) < 2:
        raise ValueError(f"`ids` must hold at least 2 tokens, got {len(token_ids)}")
    trace = trace_model(model, token_ids, source="head_scores")
    assert trace.weights is not None
    A = trace.weights  # (L, H, T, T)
    T = A.shape[-1]
    i = torch.arange(1, T)
    scores: HeadScores = {
        "previous_token": A[..., i, i - 1].mean(-1),  # (L, H)
        "first_token": A[..., 1:, 0].mean(-1),  # (L, H)
        "current_token": A.diagonal(dim1=-2, dim2=-1).mean(-1),  # (L, H)
    }
    m = _repeat_length(token_ids)
    if m is not None:
        q = torch.arange(m, T)  # queries on the second copy
        scores["induction"] = A[..., q, q - m + 1].mean(-1)  # (L, H)
    return scores


def strongest_heads(scores: torch.Tensor, k: int = 5) -> list[tuple[int, int, float]]:
    """The ``k`` highest-scoring heads of one role, strongest first.

    Args:
        scores: ``(L, H)`` scores of one role.
        k: how many.

    Returns:
        ``[(layer, head, score), ...]``.
    """
    if scores.ndim != 2:
        raise ValueError(f"`scores` must be (L, H), got shape {tuple(scores.shape)}")
    flat = scores.flatten()
    values, order = torch.topk(flat, min(k, flat.numel()))
    H = scores.shape[1]
    return [(int(o) // H, int(o) % H, float(v)) for v, o in zip(values, order, strict=True)]


# --------------------------------------------------------------------------- ablation


def parse_heads(text: str) -> list[tuple[int, int]]:
    """``"3.2,5.0"`` -> ``[(3, 2), (5, 0)]`` (layer.head pairs, comma separated).

    Raises:
        ValueError: an item that is not ``LAYER.HEAD`` with non-negative integers.
    """
    pairs: list[tuple[int, int]] = []
    for item in text.split(","):
        parts = item.strip().split(".")
        if len(parts) != 2 or not all(p.isdigit() for p in parts):
            raise ValueError(
                f"heads must be LAYER.HEAD pairs separated by commas, e.g. 3.2,5.0; "
                f"got {item.strip()!r}"
            )
        pairs.append((int(parts[0]), int(parts[1])))
    return pairs


def _check_heads(model: torch.nn.Module, heads: Iterable[tuple[int, int]]) -> dict[int, list[int]]:
    """The heads by layer position, checked against the model."""
    layers = attention_layers(model)
    by_layer: dict[int, list[int]] = {}
    for pair in heads:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(f"`heads` must hold (layer, head) pairs, got {pair!r}")
        layer, head = int(pair[0]), int(pair[1])
        if not 0 <= layer < len(layers):
            raise ValueError(
                f"`heads` names layer {layer}, but the model has layers 0..{len(layers) - 1}"
            )
        H = int(layers[layer].num_heads)
        if not 0 <= head < H:
            raise ValueError(
                f"`heads` names head {layer}.{head}, but layer {layer} has heads 0..{H - 1}"
            )
        by_layer.setdefault(layer, []).append(head)
    return by_layer


def _causal_lm(model: torch.nn.Module, what: str) -> None:
    if not callable(getattr(model, "readout", None)):
        raise TypeError(
            f"{what} needs a causal language model (attnlab's GPT or a decoder with an "
            f"output head), got {type(model).__name__}"
        )


def _ids_batch(model: torch.nn.Module, ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if isinstance(ids, torch.Tensor):
        t = ids.unsqueeze(0) if ids.ndim == 1 else ids
        if t.ndim != 2 or t.is_floating_point() or t.shape[1] == 0:
            raise ValueError(
                f"`ids` must be integer token ids (T,) or (B, T), got {ids.dtype} "
                f"{tuple(ids.shape)}"
            )
        return t.to(device=device, dtype=torch.long)
    listed = [int(i) for i in ids]
    if not listed:
        raise ValueError("`ids` must hold at least one token")
    return torch.tensor([listed], dtype=torch.long, device=device)  # (1, T)


def _forward(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """The model's logits in eval mode without gradients (mode restored)."""
    was_training = model.training
    try:
        if was_training:
            model.eval()
        with torch.no_grad():
            logits = model(input_ids)
    finally:
        if was_training:
            model.train(True)
    assert isinstance(logits, torch.Tensor)
    return logits


def ablate(
    model: torch.nn.Module,
    ids: Sequence[int] | torch.Tensor,
    heads: Iterable[tuple[int, int]],
    mode: Literal["zero", "mean"] = "zero",
) -> torch.Tensor:
    """The model's logits with the listed heads' outputs removed.

    Each listed head's output (its slice of the layer's per-head outputs, right before
    the output projection) is set to zero (``mode="zero"``) or replaced by its mean over
    the positions of its own sequence (``mode="mean"``), inside the model's own forward
    (:func:`attnlab.attention.edit_heads`); everything else runs as usual.

    Args:
        model: an attnlab causal LM.
        ids: token ids ``(T,)`` or ``(B, T)``.
        heads: ``(layer, head)`` pairs (layers numbered as :func:`trace_model` numbers
            them); an empty list gives the model's own logits.
        mode: ``"zero"`` or ``"mean"``.

    Returns:
        Logits ``(B, T, V)``.

    Raises:
        TypeError: not a causal LM.
        ValueError: a layer or head out of range, a bad ``mode`` or bad ids.

    Shape:
        ids ``(B, T)`` -> ``(B, T, V)``.
    """
    from attnlab.attention import Attention, edit_heads

    _causal_lm(model, "ablate")
    if mode not in ("zero", "mean"):
        raise ValueError(f"`mode` must be 'zero' or 'mean', got {mode!r}")
    chosen = _check_heads(model, heads)
    input_ids = _ids_batch(model, ids)
    by_layer = {id(attention_layers(model)[p]): hs for p, hs in chosen.items()}

    def edit(layer: Attention, context: torch.Tensor) -> torch.Tensor:
        hs = by_layer.get(id(layer))
        if not hs:
            return context
        B, T, HD = context.shape
        H = layer.num_heads
        per_head = context.reshape(B, T, H, HD // H).clone()  # (B, T, H, Dv)
        for h in hs:
            if mode == "zero":
                per_head[:, :, h] = 0
            else:
                per_head[:, :, h] = per_head[:, :, h].mean(dim=1, keepdim=True)
        return per_head.reshape(B, T, HD)  # (B, T, H*Dv)

    with edit_heads(edit):
        return _forward(model, input_ids)


@dataclass(frozen=True)
class AblationEffect:
    """How much the prediction moved at every position when heads were switched off.

    Attributes:
        kl: ``KL(p_before || p_after)`` per position ``(B, T)``, in nats.
        before_top: the most likely next token before ``(B, T)``.
        after_top: the most likely next token after ``(B, T)``.
        moved_ids: the ``k`` tokens whose probability changed most ``(B, T, K)``,
            largest change first.
        moved_before: their probability before ``(B, T, K)``.
        moved_after: their probability after ``(B, T, K)``.
    """

    kl: torch.Tensor
    before_top: torch.Tensor
    after_top: torch.Tensor
    moved_ids: torch.Tensor
    moved_before: torch.Tensor
    moved_after: torch.Tensor


# positions whose float64 log-probabilities are held at once by _kl (rows x vocabulary)
_KL_CHUNK = 1 << 22


def _kl(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """``KL(softmax(before) || softmax(after))`` over the last dim, in float64.

    A small KL is a sum of differences of log-probabilities near ``log(1/V)``: in float32
    each difference carries an absolute error of about ``eps32 * |log p|`` (1e-6 for a
    50k vocabulary), which is a relative error of 1e-3 in a KL of 1e-3. float64 makes it
    1e-12. Rows are taken a few million values at a time, so a long sequence over a large
    vocabulary never holds its whole float64 copy.

    Shape:
        before, after ``(B, T, V)`` -> ``(B, T)``, float32.
    """
    V = before.shape[-1]
    flat_p, flat_q = before.reshape(-1, V), after.reshape(-1, V)  # (B*T, V)
    rows = max(1, _KL_CHUNK // max(V, 1))
    parts = []
    for start in range(0, flat_p.shape[0], rows):
        logp = F.log_softmax(flat_p[start : start + rows].double(), dim=-1)  # (r, V)
        logq = F.log_softmax(flat_q[start : start + rows].double(), dim=-1)  # (r, V)
        parts.append((logp.exp() * (logp - logq)).sum(-1).clamp_min(0))  # (r,)
    kl = torch.cat(parts) if parts else flat_p.new_zeros(0, dtype=torch.float64)
    return kl.reshape(before.shape[:-1]).float()  # (B, T)


def ablation_effect(before: torch.Tensor, after: torch.Tensor, k: int = 5) -> AblationEffect:
    """Compare two logits tensors (the model's own and :func:`ablate`'s).

    Args:
        before: logits ``(B, T, V)`` (or ``(T, V)``) of the unchanged model.
        after: logits of the same shape with heads ablated.
        k: how many moved tokens to keep per position.

    Returns:
        An :class:`AblationEffect` (probabilities in fp32, the KL summed in fp64).

    Shape:
        before, after ``(B, T, V)`` -> kl ``(B, T)``, moved_* ``(B, T, K)``.
    """
    if before.shape != after.shape or before.ndim not in (2, 3):
        raise ValueError(
            "`before` and `after` must be logits of one shape (B, T, V), got "
            f"{tuple(before.shape)} and {tuple(after.shape)}"
        )
    if before.ndim == 2:
        before, after = before.unsqueeze(0), after.unsqueeze(0)  # (1, T, V)
    logp = F.log_softmax(before.float(), dim=-1)  # (B, T, V)
    logq = F.log_softmax(after.float(), dim=-1)  # (B, T, V)
    p, q = logp.exp(), logq.exp()
    kl = _kl(before, after)  # (B, T)
    kk = min(k, before.shape[-1])
    moved = (q - p).abs().topk(kk, dim=-1).indices  # (B, T, K)
    return AblationEffect(
        kl=kl,
        before_top=p.argmax(-1),
        after_top=q.argmax(-1),
        moved_ids=moved,
        moved_before=p.gather(-1, moved),
        moved_after=q.gather(-1, moved),
    )


# --------------------------------------------------------------------------- logit lens


def logit_lens(model: torch.nn.Module, ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """What the model would predict after each block: the logit lens.

    The residual stream after every block (as the model computed it) goes through the
    model's own final norm and output head (its ``readout``: Gemma's final softcap
    included). The last layer's entry is the model's logits.

    Args:
        model: an attnlab causal LM.
        ids: token ids ``(T,)`` or ``(B, T)``.

    Returns:
        float ``(L, B, T, V)``, L = the model's blocks.

    Raises:
        TypeError: not a causal LM.
        ValueError: bad ids.

    Shape:
        ids ``(B, T)`` -> ``(L, B, T, V)``.
    """
    from attnlab.models._lm import watch_residual

    _causal_lm(model, "logit_lens")
    input_ids = _ids_batch(model, ids)
    streams: dict[int, torch.Tensor] = {}

    def keep(index: int, x: torch.Tensor) -> None:
        streams[index] = x.detach()

    with watch_residual(keep):
        _forward(model, input_ids)
    if not streams or sorted(streams) != list(range(len(streams))):
        raise RuntimeError(f"blocks {sorted(streams)} reported; expected 0..L-1 in order")
    readout: Any = model.readout
    with torch.no_grad():
        return torch.stack([readout(streams[i]) for i in range(len(streams))])  # (L, B, T, V)


def top_tokens(logits: torch.Tensor, k: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most likely tokens of every row of logits, with their probabilities.

    Args:
        logits: ``(..., V)``, e.g. :func:`logit_lens`'s ``(L, B, T, V)``.
        k: tokens per row.

    Returns:
        ``(probabilities, ids)``, each ``(..., k)``, most likely first (softmax in fp32).
    """
    if k < 1:
        raise ValueError(f"`k` must be at least 1, got {k}")
    probs = torch.softmax(logits.float(), dim=-1)
    values, indices = probs.topk(min(k, probs.shape[-1]), dim=-1)
    return values, indices


# --------------------------------------------------------------------------- rollout


def rollout(weights: torch.Tensor, residual: float = 0.5) -> torch.Tensor:
    """Attention rollout (Abnar & Zuidema, 2020): how much each input token reaches each
    position through all the layers.

    Per layer ``A_l = residual * I + (1 - residual) * mean over heads``, each row
    renormalised to sum to 1; the rollout is ``A_L @ ... @ A_2 @ A_1`` (multiplied from the
    first layer to the last).

    Args:
        weights: one sequence's weights ``(L, H, T, T)`` (e.g. ``trace.weights``).
        residual: the weight of the residual connection, in ``[0, 1]``.

    Returns:
        float32 ``(T, T)``: row ``i`` is how position ``i``'s output draws on each input.

    Shape:
        weights ``(L, H, T, T)`` -> ``(T, T)``.
    """
    if not isinstance(weights, torch.Tensor) or weights.ndim != 4:
        got = tuple(weights.shape) if isinstance(weights, torch.Tensor) else type(weights)
        raise ValueError(f"`weights` must be (L, H, T, T), got {got}")
    if weights.shape[-1] != weights.shape[-2]:
        raise ValueError(f"`weights` must be self-attention (T == S), got {tuple(weights.shape)}")
    if not 0.0 <= residual <= 1.0:
        raise ValueError(f"`residual` must be in [0, 1], got {residual}")
    T = weights.shape[-1]
    eye = torch.eye(T, dtype=torch.float32, device=weights.device)
    result = eye
    for layer in weights.float():
        a = residual * eye + (1.0 - residual) * layer.mean(0)  # (T, T)
        a = a / a.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        result = a @ result  # (T, T)
    return result
