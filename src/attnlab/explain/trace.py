"""Every intermediate of the seed's self-attention, as data.

Shape legend: T tokens, ``d_in`` input width, ``d_out`` width of queries/keys/values.

:func:`trace_attention` runs the computation once -- through
:mod:`attnlab.functional` and :mod:`attnlab.ladder`, never a second copy of the
math -- and returns an :class:`AttentionTrace`: a frozen record of the simplified
form (section 3.3: the embeddings are their own queries, keys and values, no
scaling) and the trainable form (section 3.4: ``W_query``, ``W_key``, ``W_value``,
scaled by ``1/sqrt(d_k)``), each over all tokens and for one token (the seed's
``x_2``), plus the outputs of ``SelfAttentionV1`` and ``SelfAttentionV2``. It
computes; it never renders (see :mod:`attnlab.explain.text` and
:mod:`attnlab.explain.figures`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Literal

import torch

from attnlab import functional as F
from attnlab.examples import Example, ProjectionConvention, get_example
from attnlab.ladder import SelfAttentionV1, SelfAttentionV2, copy_v2_weights_to_v1

__all__ = [
    "BOOK_SEED",
    "BOOK_V2_SEED",
    "TRACE_SCHEMA",
    "AttentionForm",
    "AttentionTrace",
    "Checks",
    "ModuleRun",
    "Projection",
    "TokenStep",
    "trace_attention",
    "trace_example",
]

TRACE_SCHEMA = "attnlab.trace/1"
BOOK_SEED = 123  # the seed of the book's step-by-step walk and SelfAttention_v1
BOOK_V2_SEED = 789  # the seed the book uses for SelfAttention_v2

_MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class AttentionForm:
    """One form of self-attention over all tokens.

    Attributes:
        form: ``"simplified"`` (no weights, no scaling) or ``"trainable"``.
        queries: ``(T, d)``; the inputs themselves in the simplified form.
        keys: ``(T, d)``.
        values: ``(T, d)``.
        scores: ``queries @ keys.transpose(-2, -1)``, ``(T, T)``.
        scale: the factor applied before the softmax (``1/sqrt(d_k)``), or None.
        scaled_scores: ``scores * scale`` (``scores`` when ``scale`` is None), ``(T, T)``.
        weights: ``softmax(scaled_scores, dim=-1)``, ``(T, T)``.
        row_sums: ``weights.sum(dim=-1)``, ``(T,)``; all 1.
        context: ``weights @ values``, ``(T, d)``.
    """

    form: Literal["simplified", "trainable"]
    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    scores: torch.Tensor
    scale: float | None
    scaled_scores: torch.Tensor
    weights: torch.Tensor
    row_sums: torch.Tensor
    context: torch.Tensor

    @property
    def d_k(self) -> int:
        """Width of the keys."""
        return int(self.keys.shape[-1])


@dataclass(frozen=True)
class TokenStep:
    """The single-token walk for query token ``index`` (the seed's ``x_2``: index 1).

    The token's query, key and value are projected from its own embedding alone, so
    that comparing them with the all-token matrices checks the matrix form.

    Attributes:
        index: 0-based position of the query token.
        token: its label.
        x: its embedding, ``(d_in,)``.
        query: ``(d,)``.
        key: its own key, ``(d,)``.
        value: its own value, ``(d,)``.
        score_self: ``query · key`` (the seed's ``attn_score_22``).
        scores: ``query @ keys.T`` against all keys, ``(T,)``.
        scaled_scores: ``scores * scale``, ``(T,)``.
        weights: ``softmax(scaled_scores, dim=-1)``, ``(T,)``.
        weights_sum: ``weights.sum()``.
        context: ``weights @ values``, ``(d,)`` (the step the seed's text omits).
    """

    index: int
    token: str
    x: torch.Tensor
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    score_self: float
    scores: torch.Tensor
    scaled_scores: torch.Tensor
    weights: torch.Tensor
    weights_sum: float
    context: torch.Tensor


@dataclass(frozen=True)
class Projection:
    """The trainable projection matrices and how they are applied.

    Attributes:
        convention: ``"x @ W"`` (``W`` is ``(d_in, d_out)``, the book's walk and V1) or
            ``"x @ W.T"`` (``W`` is ``(d_out, d_in)``, ``nn.Linear``, the seed's toy).
        seed: the ``torch.manual_seed`` the matrices were drawn after, or None when
            they are explicit.
        built: the code that made them.
        W_query: as stored in that convention.
        W_key: as stored in that convention.
        W_value: as stored in that convention.
    """

    convention: ProjectionConvention
    seed: int | None
    built: str
    W_query: torch.Tensor
    W_key: torch.Tensor
    W_value: torch.Tensor


@dataclass(frozen=True)
class ModuleRun:
    """One ladder module run on all tokens.

    Attributes:
        name: the class name.
        role: ``"v1"`` / ``"v2"`` (built as the book builds them, or from explicit
            weights) or ``"v1_from_v2"`` (a V1 holding the V2's weights).
        built: the code that made it (seed, constructor, weight copy).
        seed: the ``torch.manual_seed`` it was built after, or None.
        output: its context vectors, ``(T, d_out)``.
    """

    name: str
    role: Literal["v1", "v2", "v1_from_v2"]
    built: str
    seed: int | None
    output: torch.Tensor


@dataclass(frozen=True)
class Checks:
    """Agreement between the forms, as max absolute differences (0 means identical).

    Attributes:
        token_vs_all: the single-token walk's weights and context vector against row
            ``index`` of the all-token matrices.
        module_vs_walk: the module that holds the walk's matrices against the walk: row
            ``index`` of V1 (seeded weights) or all rows of V2 (explicit weights).
        v1_from_v2_vs_v2: V1 after ``copy_v2_weights_to_v1`` against V2.
    """

    token_vs_all: float
    module_vs_walk: float
    v1_from_v2_vs_v2: float


@dataclass(frozen=True)
class AttentionTrace:
    """Everything the walkthrough shows, computed once.

    Attributes:
        example: the example's name (``"custom"`` for user inputs).
        tokens: one label per token.
        inputs: the embeddings ``(T, d_in)``.
        index: 0-based query token of the single-token walks.
        simplified: the simplified form over all tokens.
        simplified_token: the simplified form for token ``index``.
        projection: the trainable matrices.
        trainable: the trainable form over all tokens.
        trainable_token: the trainable form for token ``index``.
        modules: ``SelfAttentionV1`` / ``SelfAttentionV2`` runs on the inputs.
        checks: how closely the forms agree.
    """

    example: str
    tokens: tuple[str, ...]
    inputs: torch.Tensor
    index: int
    simplified: AttentionForm
    simplified_token: TokenStep
    projection: Projection
    trainable: AttentionForm
    trainable_token: TokenStep
    modules: tuple[ModuleRun, ...]
    checks: Checks

    @property
    def n_tokens(self) -> int:
        """``T``."""
        return int(self.inputs.shape[0])

    @property
    def d_in(self) -> int:
        """Width of the input embeddings."""
        return int(self.inputs.shape[1])

    @property
    def d_out(self) -> int:
        """Width of the trainable queries, keys and values."""
        return int(self.trainable.queries.shape[1])

    def module(self, role: str) -> ModuleRun:
        """The module run with this ``role`` (``"v1"``, ``"v2"`` or ``"v1_from_v2"``).

        Raises:
            KeyError: no run with that role (an explicit-weights trace has no ``"v1"``).
        """
        for run in self.modules:
            if run.role == role:
                return run
        raise KeyError(role)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: tensors become nested lists of floats."""
        out: dict[str, Any] = {"schema": TRACE_SCHEMA}
        out.update(_to_plain(self))
        out["d_in"], out["d_out"], out["n_tokens"] = self.d_in, self.d_out, self.n_tokens
        return out

    def to_json(self, indent: int | None = 2) -> str:
        """The trace as a JSON string (see :meth:`to_dict`)."""
        return json.dumps(self.to_dict(), indent=indent, ensure_ascii=False)


def _to_plain(obj: object) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, (AttentionForm, TokenStep, Projection, ModuleRun, Checks, AttentionTrace)):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, (tuple, list)):
        return [_to_plain(o) for o in obj]
    return obj


def _form(
    kind: Literal["simplified", "trainable"],
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float | None,
) -> AttentionForm:
    scores = F.attention_scores(queries, keys)  # (T, T)
    scaled = scores if scale is None else scores * scale  # the displayed "÷ sqrt(d_k)" step
    weights = F.attention_weights(scores, scale=scale)  # (T, T), the modules' own path
    return AttentionForm(
        form=kind,
        queries=queries,
        keys=keys,
        values=values,
        scores=scores,
        scale=scale,
        scaled_scores=scaled,
        weights=weights,
        row_sums=weights.sum(dim=-1),  # (T,)
        context=F.context_vectors(weights, values),  # (T, d)
    )


def _token(
    index: int,
    token: str,
    x: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    form: AttentionForm,
) -> TokenStep:
    # The seed's attn_score_22 = query_2.dot(key_2) (its text says keys_2, an erratum).
    score_self = F.attention_scores(query, key.unsqueeze(0))  # (1,)
    scores = F.attention_scores(query, form.keys)  # (T,)
    weights = F.attention_weights(scores, scale=form.scale)  # (T,)
    return TokenStep(
        index=index,
        token=token,
        x=x,
        query=query,
        key=key,
        value=value,
        score_self=float(score_self[0]),
        scores=scores,
        scaled_scores=scores if form.scale is None else scores * form.scale,
        weights=weights,
        weights_sum=float(weights.sum()),
        # The step the seed's text leaves out: attn_weights_2 @ values.
        context=F.context_vectors(weights, form.values),  # (d,)
    )


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def _check_int(name: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be an int, got {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"`{name}` must be in [{low}, {high}], got {value}")
    return value


def trace_attention(
    inputs: torch.Tensor,
    *,
    tokens: tuple[str, ...] | list[str] | None = None,
    index: int = 1,
    d_out: int = 2,
    seed: int = BOOK_SEED,
    v2_seed: int = BOOK_V2_SEED,
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    example: str = "custom",
) -> AttentionTrace:
    """Compute every intermediate of simplified and trainable self-attention.

    Trainable weights come either from ``seed`` -- ``torch.manual_seed(seed)`` then
    ``SelfAttentionV1(d_in, d_out)``, whose three ``torch.rand(d_in, d_out)`` draws are
    the book's ``W_query``, ``W_key``, ``W_value`` (``x @ W``) -- or from explicit
    ``weights`` in the ``nn.Linear`` convention, loaded into a ``SelfAttentionV2``
    (``x @ W.T``). The global RNG state is restored afterwards.

    Args:
        inputs: token embeddings ``(T, d_in)``.
        tokens: one label per token; default ``"1"``, ``"2"``, ...
        index: 0-based query token of the single-token walks (the seed's ``x_2`` is 1).
        d_out: width of queries, keys and values when drawn from ``seed``.
        seed: seed for the walk's matrices and ``SelfAttentionV1``.
        v2_seed: seed for ``SelfAttentionV2`` (the book uses 789).
        weights: explicit ``(W_query, W_key, W_value)``, each ``(d_out, d_in)``; when
            given, ``seed``, ``v2_seed`` and ``d_out`` are not used.
        example: a name recorded in the trace.

    Returns:
        The trace.

    Raises:
        TypeError: non-tensor or integer ``inputs``; ``tokens`` not strings; a
            non-int ``index``, ``d_out`` or seed.
        ValueError: ``inputs`` not 2-D, empty, NaN or inf; wrong number of tokens;
            ``index`` out of range; bad ``weights`` shapes.

    Shape:
        - inputs: ``(T, d_in)``
        - weights: three ``(d_out, d_in)``
    """
    inputs = F.check_tensor("inputs", inputs, ndims=(2,))
    n_tokens, d_in = inputs.shape
    if tokens is None:
        tokens = tuple(str(i + 1) for i in range(n_tokens))
    if not isinstance(tokens, (tuple, list)) or not all(isinstance(t, str) for t in tokens):
        raise TypeError("`tokens` must be a tuple or list of str, one label per input row")
    tokens = tuple(tokens)
    if len(tokens) != n_tokens:
        raise ValueError(
            f"`tokens` must have one label per input row ({n_tokens}), got {len(tokens)}"
        )
    _check_int("index", index, 0, n_tokens - 1)
    inputs = inputs.detach()
    x = inputs[index]  # (d_in,)

    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        simplified = _form("simplified", inputs, inputs, inputs, scale=None)
        simplified_token = _token(index, tokens[index], x, x, x, x, simplified)

        runs: list[ModuleRun] = []
        module: SelfAttentionV1 | SelfAttentionV2
        if weights is None:
            _check_int("d_out", d_out, 1, 2**31 - 1)
            _check_int("seed", seed, 0, _MAX_SEED)
            _check_int("v2_seed", v2_seed, 0, _MAX_SEED)
            torch.manual_seed(seed)
            v1 = SelfAttentionV1(d_in, d_out).to(inputs.dtype)
            module = v1
            projection = Projection(
                convention="x @ W",
                seed=seed,
                built=(
                    f"torch.manual_seed({seed}); W_query, W_key, W_value = "
                    f"(nn.Parameter(torch.rand({d_in}, {d_out})) for _ in range(3))"
                ),
                W_query=v1.W_query.detach().clone(),
                W_key=v1.W_key.detach().clone(),
                W_value=v1.W_value.detach().clone(),
            )
            runs.append(
                ModuleRun(
                    "SelfAttentionV1",
                    "v1",
                    f"torch.manual_seed({seed}); SelfAttentionV1({d_in}, {d_out})",
                    seed,
                    v1(inputs),
                )
            )
            torch.manual_seed(v2_seed)
            v2 = SelfAttentionV2(d_in, d_out).to(inputs.dtype)
            runs.append(
                ModuleRun(
                    "SelfAttentionV2",
                    "v2",
                    f"torch.manual_seed({v2_seed}); SelfAttentionV2({d_in}, {d_out})",
                    v2_seed,
                    v2(inputs),
                )
            )
        else:
            if not isinstance(weights, (tuple, list)) or len(weights) != 3:
                raise TypeError("`weights` must be a tuple (W_query, W_key, W_value)")
            v2 = SelfAttentionV2.from_weights(*weights).to(inputs.dtype)
            if v2.d_in != d_in:
                raise ValueError(
                    f"`weights` must be (d_out, d_in={d_in}) matrices (nn.Linear convention), "
                    f"got W_query of shape {tuple(weights[0].shape)}"
                )
            module = v2
            projection = Projection(
                convention="x @ W.T",
                seed=None,
                built="explicit W_query, W_key, W_value (nn.Linear weights, (d_out, d_in))",
                W_query=v2.W_query.weight.detach().clone(),
                W_key=v2.W_key.weight.detach().clone(),
                W_value=v2.W_value.weight.detach().clone(),
            )
            runs.append(
                ModuleRun(
                    "SelfAttentionV2",
                    "v2",
                    "SelfAttentionV2.from_weights(W_q, W_k, W_v)",
                    None,
                    v2(inputs),
                )
            )
        # The book's exercise: V1 holding V2's weights (transposed) computes the same.
        v1_copy = SelfAttentionV1(v2.d_in, v2.d_out).to(inputs.dtype)
        copy_v2_weights_to_v1(v2, v1_copy)
        runs.append(
            ModuleRun(
                "SelfAttentionV1",
                "v1_from_v2",
                f"copy_v2_weights_to_v1(v2, SelfAttentionV1({v2.d_in}, {v2.d_out}))",
                None,
                v1_copy(inputs),
            )
        )

        queries, keys, values = module.project(inputs)  # each (T, d_out)
        trainable = _form("trainable", queries, keys, values, F.default_scale(keys.shape[-1]))
        # The single-token walk projects x alone: query_2 = x_2 @ W_query, and so on.
        q_i, k_i, v_i = (t[0] for t in module.project(x.unsqueeze(0)))  # each (d_out,)
        trainable_token = _token(index, tokens[index], x, q_i, k_i, v_i, trainable)

        by_role = {run.role: run.output for run in runs}
        if "v1" in by_role:  # seeded: V1 holds the walk's matrices
            module_vs_walk = _max_diff(by_role["v1"][index], trainable_token.context)
        else:  # explicit: V2 holds them
            module_vs_walk = _max_diff(by_role["v2"], trainable.context)
        checks = Checks(
            token_vs_all=max(
                _max_diff(trainable_token.weights, trainable.weights[index]),
                _max_diff(trainable_token.context, trainable.context[index]),
            ),
            module_vs_walk=module_vs_walk,
            v1_from_v2_vs_v2=_max_diff(by_role["v1_from_v2"], by_role["v2"]),
        )

    return AttentionTrace(
        example=example,
        tokens=tokens,
        inputs=inputs,
        index=index,
        simplified=simplified,
        simplified_token=simplified_token,
        projection=projection,
        trainable=trainable,
        trainable_token=trainable_token,
        modules=tuple(runs),
        checks=checks,
    )


def trace_example(
    example: str | Example = "journey", *, index: int = 1, seed: int | None = None
) -> AttentionTrace:
    """Trace an embedded example (see :mod:`attnlab.examples`).

    Args:
        example: ``"journey"`` (default), ``"toy"``, or an :class:`Example`.
        index: 0-based query token of the single-token walks (default 1, the seed's x_2).
        seed: for examples with random weights, the seed of the walk, V1 and V2; default
            the book's (123 for the walk and V1, 789 for V2). Not allowed for examples
            with explicit weights.

    Returns:
        The trace.

    Raises:
        TypeError: a non-str, non-Example ``example``; a non-int ``seed``.
        ValueError: an unknown example, a ``seed`` for an example with explicit weights,
            or an out-of-range ``index``.
    """
    ex = example if isinstance(example, Example) else get_example(example)
    explicit = ex.projection_weights()
    if explicit is not None:
        if seed is not None:
            raise ValueError(
                f"`seed` does not apply to example {ex.name!r}: its W_query, W_key, W_value "
                "are explicit; drop the seed or use the 'journey' example"
            )
        return trace_attention(
            ex.inputs_tensor(), tokens=ex.tokens, index=index, weights=explicit, example=ex.name
        )
    return trace_attention(
        ex.inputs_tensor(),
        tokens=ex.tokens,
        index=index,
        seed=BOOK_SEED if seed is None else seed,
        v2_seed=BOOK_V2_SEED if seed is None else seed,
        example=ex.name,
    )
