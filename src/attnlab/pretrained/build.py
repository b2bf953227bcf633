"""From a family description and a file's config and tensors to a loaded attnlab model.

Shared by every source (Hugging Face directories, GGUF files, the packaged models):

- :func:`build_config` (:mod:`attnlab.pretrained.config`) reads the model config out of
  ``config.json`` or GGUF metadata through the family's key map;
- :func:`plan_weights` maps source tensor names to ours with the family's weight rules;
- :func:`build_model` checks that the weights on disk can hold what the config asks for
  (before allocating anything), builds the model without random initialisation and fills
  every parameter exactly once, shapes checked.

No math here: only names, shapes and checks.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from attnlab._meta import skip_random_init, structure_only
from attnlab.models.decoder import Decoder, DecoderConfig
from attnlab.models.encoder import Encoder
from attnlab.models.encoder_decoder import EncoderDecoder, EncoderDecoderConfig
from attnlab.models.families import Family, Source, WeightRule
from attnlab.pretrained.config import (
    LIMITS,
    AnyConfig,
    AnyModel,
    build_config,
    family_from,
)
from attnlab.pretrained.config import (
    lookup as lookup,
)
from attnlab.pretrained.errors import ModelFileError
from attnlab.quant import HeldEmbedding, WeightFormat, holding

__all__ = [
    "LIMITS",
    "build_config",
    "build_model",
    "check_weights",
    "family_from",
    "plan_weights",
    "skip_random_init",
]

_PIECES = {
    "{qkv}": ("W_query", "W_key", "W_value"),
    "{gate_up}": ("gate", "up"),
    "{kv_up}": ("k_up", "v_up"),
}
# Parameter names a target may end in (then it names the parameter, not its module).
_LEAVES = ("weight", "bias", "sinks")


def _rule_regex(pattern: str) -> re.Pattern[str]:
    body = re.escape(pattern).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{j\}", r"(?P<j>\d+)")
    # transformers keeps some stacked tensors as bare parameters (Llama 4's experts)
    return re.compile(rf"^{body}(?:\.(?P<leaf>weight|bias))?$")


def plan_weights(
    names: Iterable[str],
    rules: tuple[WeightRule, ...],
    *,
    prefixes: tuple[str, ...] = (),
    ignore: tuple[str, ...] = (),
    num_layers: int,
    where: str | Path,
) -> dict[str, tuple[tuple[str, ...], str]]:
    """Map source tensor names to ours.

    Returns:
        source name -> (our parameter name(s), transform). Names matching ``ignore`` are
        left out.

    Raises:
        ModelFileError: a tensor no rule knows, or a layer index beyond ``num_layers``.
    """
    compiled = [(_rule_regex(src), ours, t) for src, ours, t in rules]
    dropped = [re.compile(p) for p in ignore]
    plan: dict[str, tuple[tuple[str, ...], str]] = {}
    for name in names:
        key = name
        for prefix in prefixes:
            if key.startswith(prefix):
                key = key[len(prefix) :]
                break
        if any(p.match(key) for p in dropped):
            continue
        for regex, ours, transform in compiled:
            m = regex.match(key)
            if m is None:
                continue
            layer = m.groupdict().get("i")
            if layer is not None and int(layer) >= num_layers:
                raise ModelFileError(
                    where, f"tensor {name!r} is for layer {layer}, the config has {num_layers}"
                )
            target = ours.replace("{i}", layer or "")
            # a target naming its parameter (a bare source tensor) takes no leaf
            leaf = "" if target.rsplit(".", 1)[-1] in _LEAVES else f".{m['leaf'] or 'weight'}"
            pieces = next((v for k, v in _PIECES.items() if k in target), None)
            if pieces is None:
                targets: tuple[str, ...] = (f"{target}{leaf}",)
            else:
                key = next(k for k in _PIECES if k in target)
                targets = tuple(f"{target.replace(key, p)}{leaf}" for p in pieces)
            row = m.groupdict().get("j")
            if row is not None:  # one row of a target stacked from several tensors
                transform = f"row:{row}"
            plan[name] = (targets, transform)
            break
        else:
            raise ModelFileError(where, f"tensor {name!r} is not part of this model family")
    return plan


def apply_transform(
    tensor: torch.Tensor, transform: str, config: AnyConfig
) -> tuple[torch.Tensor, ...]:
    """One source tensor -> our tensor(s); see :mod:`attnlab.models.families`."""
    from attnlab.pretrained.gguf_file import unpermute_rotary

    parts = transform.split("+") if transform else []
    out: tuple[torch.Tensor, ...] = (tensor,)
    for part in parts:
        t = out[0]
        if part == "T":
            out = (t.T,) if t.ndim == 2 else (t,)
        elif part == "qkv":
            D = _head_dim(config)
            G = getattr(config, "num_kv_heads", config.num_heads)
            out = tuple(torch.split(t, [config.num_heads * D, G * D, G * D], dim=0))
        elif part == "qkv_heads":  # rows (H, 3, D): each head's q, k, v together
            H, D = config.num_heads, _head_dim(config)
            per_head = t.reshape(H, 3, D, *t.shape[1:])  # (H, 3, D, ...)
            # One copy into (3, H, D, ...): q, k, v are then row blocks of one tensor,
            # which the fused QKV product reuses (attnlab.quant.fuse_linears).
            grouped = per_head.transpose(0, 1).reshape(3 * H * D, *t.shape[1:])
            out = tuple(grouped.split(H * D, dim=0))
        elif part == "plus1":
            out = (t.float() + 1.0,)
        elif part == "gate_up":  # (2F, C), or stacked experts (E, 2F, C)
            out = tuple(torch.chunk(t, 2, dim=0 if t.ndim < 3 else -2))
        elif part == "kv_b":  # MLA's (H * (Dn + Dv), r): each head's key rows, then value rows
            mla = getattr(config, "mla", None)
            assert mla is not None  # only MLA pages name this transform
            H, Dn, Dv = config.num_heads, mla.qk_nope_head_dim, mla.v_head_dim
            k, v = t.reshape(H, Dn + Dv, -1).split([Dn, Dv], dim=1)  # (H, Dn, r), (H, Dv, r)
            out = (k.reshape(H * Dn, -1), v.reshape(H * Dv, -1))
        elif part == "k_b":  # llama.cpp's attn_k_b (H, r, Dn), stored for the absorbed product
            out = (t.transpose(1, 2).reshape(-1, t.shape[1]),)
        elif part == "v_b":  # llama.cpp's attn_v_b (H, Dv, r)
            out = (t.reshape(-1, t.shape[2]),)
        elif part == "gate_up_pairs":  # stacked (E, 2F, ...): gate, up, gate, up, ... rows
            out = (t[:, 0::2], t[:, 1::2])
        elif part == "Tx":  # stacked experts stored (E, in, out): ours are (E, out, in)
            out = (t.transpose(-1, -2),)
        elif part in ("rope_q", "rope_k") and t.ndim == 2:
            heads = config.num_heads if part == "rope_q" else config.num_kv_heads  # type: ignore[union-attr]
            out = (unpermute_rotary(t, heads),)
        elif part in ("rope_q", "rope_k"):  # a bias: (H*D,) rows, same permutation
            heads = config.num_heads if part == "rope_q" else config.num_kv_heads  # type: ignore[union-attr]
            out = (unpermute_rotary(t[:, None], heads)[:, 0],)
        else:  # pragma: no cover - the families are data checked by the tests
            raise AssertionError(f"unknown transform {part!r}")
    return out


def _head_dim(config: AnyConfig) -> int:
    if isinstance(config, DecoderConfig):
        return config.attention_head_dim
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_heads


# --------------------------------------------------------------------------- the model


def fill(
    model: nn.Module,
    weights: Mapping[str, torch.Tensor],
    where: str | Path,
    dtype: torch.dtype | None = None,
) -> None:
    """Put ``weights`` into ``model`` by name; every parameter exactly once, shapes checked.

    Raises:
        ModelFileError: a missing or unused tensor, or a shape that disagrees.
    """
    params = dict(model.named_parameters())  # tied weights appear once
    missing = sorted(set(params) - set(weights))
    unused = sorted(set(weights) - set(params))
    if missing or unused:
        raise ModelFileError(
            where, f"tensors do not match the model: missing {missing[:5]}, unused {unused[:5]}"
        )
    with torch.no_grad():
        for name, p in params.items():
            w = weights[name]
            if w.shape != p.shape:
                raise ModelFileError(
                    where,
                    f"{name} has shape {tuple(w.shape)}, the config (config.json / metadata) "
                    f"implies {tuple(p.shape)}",
                )
            # Take the loaded tensor itself (no copy when the dtype already fits), in the
            # layout it came in when a matrix product reads it as is: GPT-2's Conv1D
            # weights stay transposed views of the file (F.linear multiplies by the
            # stored (in, out) matrix), a fused tensor's pieces stay row slices of it.
            w = w.to(dtype=dtype or p.dtype)
            p.data = w if _matrix_layout(w) else w.contiguous()


def _matrix_layout(w: torch.Tensor) -> bool:
    """A 2-D tensor whose rows or columns are contiguous: a layout BLAS reads without a copy."""
    return w.ndim == 2 and (w.stride(1) == 1 or w.stride(0) == 1) and min(w.stride()) > 0


def model_class(
    config: AnyConfig,
) -> type[Decoder] | type[Encoder] | type[EncoderDecoder]:
    """:class:`Decoder`, :class:`Encoder` or :class:`EncoderDecoder`, by config type."""
    if isinstance(config, EncoderDecoderConfig):
        return EncoderDecoder
    return Decoder if isinstance(config, DecoderConfig) else Encoder


def parameter_count(config: AnyConfig) -> int:
    """Parameters the config implies (counted on the meta device: nothing is allocated)."""
    with structure_only():
        model = model_class(config)(config)  # type: ignore[arg-type]
    return sum(p.numel() for p in model.parameters())


@dataclass(frozen=True)
class HeldLinear:
    """How a source tensor's linear weights are stored as the model is built.

    Attributes:
        format: the weight format of each linear layer the tensor fills.
        codes: the format's codes read from the file (tensors whose first dimension is
            the weight's rows, :meth:`attnlab.quant.WeightFormat.from_stored`), which go
            through the weight plan's row transforms; None: the format is made from the
            tensor's float values (:meth:`attnlab.quant.WeightFormat.from_float`).
    """

    format: type[WeightFormat]
    codes: tuple[torch.Tensor, ...] | None = None


# Transforms that only rename, split or permute rows: they apply to codes as to values.
_ROW_TRANSFORMS = frozenset({"qkv", "qkv_heads", "gate_up", "rope_q", "rope_k"})


def _linear_targets(model: nn.Module, targets: tuple[str, ...], transform: str) -> bool:
    """True when every target is the weight of an ``nn.Linear`` and ``transform`` keeps rows."""
    if any(p not in _ROW_TRANSFORMS for p in transform.split("+") if p):
        return False
    for target in targets:
        module_name, _, leaf = target.rpartition(".")
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            return False
        if leaf != "weight" or not isinstance(module, nn.Linear):
            return False
    return True


def check_weights(
    config: AnyConfig,
    names: Mapping[str, int],
    *,
    family: Family,
    source: Source,
    where: str | Path,
    parameters: int | None = None,
) -> dict[str, tuple[tuple[str, ...], str]]:
    """The checks :func:`build_model` makes before it allocates or reads anything: the
    weights hold at least the parameters the config implies, and every tensor name is the
    family's (:func:`plan_weights`).

    Args:
        parameters: the parameter count of the model already built for ``config`` (on the
            meta device); None: counted here (:func:`parameter_count`).

    Returns:
        :func:`plan_weights`' plan.

    Raises:
        ModelFileError: too few values for the config, a tensor the family does not know,
            a layer index beyond the config's.
    """
    needed = parameter_count(config) if parameters is None else parameters
    held_names = sum(names.values())
    if needed > held_names:
        raise ModelFileError(
            where,
            f"the config (config.json / metadata) implies {needed:,} parameters but the "
            f"weights hold only {held_names:,} values; the config does not belong to these weights",
        )
    gguf = source == "gguf"
    return plan_weights(
        names,
        family.weight_rules(source),
        prefixes=() if gguf else family.prefixes,
        ignore=() if gguf else family.ignore,
        num_layers=max(config.num_layers, getattr(config, "num_decoder_layers", 0)),
        where=where,
    )


def build_model(
    config: AnyConfig,
    names: Mapping[str, int],
    get: Callable[[str], torch.Tensor],
    *,
    family: Family,
    source: Source,
    where: str | Path,
    dtype: torch.dtype,
    backend: str,
    held: Callable[[str], HeldLinear | None] | None = None,
) -> AnyModel:
    """Build the model for ``config`` and fill it from the source tensors.

    Args:
        config: from :func:`build_config`.
        names: every source tensor name -> its element count.
        get: loads one source tensor by name.
        family: its weight rules, prefixes and ignored names.
        source: ``"hf"`` or ``"gguf"`` (llama.cpp's names: no prefixes, nothing ignored).
        where: the file or directory, for messages.
        dtype: the model's parameter dtype.
        backend: attention backend of every layer.
        held: for a source tensor whose targets are all linear weights, how they are
            stored (codes taken as the file stores them, read once, never dequantised);
            None (or no callable): float parameters of ``dtype``. A layer whose codes the
            format cannot take (a shape its kernel cannot pack) gets float values.

    Raises:
        ModelFileError: the weights cannot hold what the config asks for (checked before
            any allocation), or tensors that do not match the model.
    """
    plan = check_weights(config, names, family=family, source=source, where=where)
    with skip_random_init():
        model = model_class(config)(config, backend=backend)  # type: ignore[arg-type]
    weights: dict[str, torch.Tensor] = {}
    rows: dict[str, dict[int, torch.Tensor]] = {}
    # target -> (its format, its codes or its float values, its float values on request)
    linears: dict[str, tuple[type[WeightFormat], Any, Callable[[], torch.Tensor]]] = {}

    def split(name: str, tensor: torch.Tensor, transform: str) -> tuple[torch.Tensor, ...]:
        try:
            return apply_transform(tensor, transform, config)
        except (ValueError, RuntimeError) as e:  # a shape the transform cannot split
            raise ModelFileError(
                where,
                f"tensor {name!r} of shape {tuple(tensor.shape)} does not fit the config "
                f"(transform {transform!r}): {e}",
            ) from None

    def piece_values(name: str, transform: str, i: int) -> torch.Tensor:
        return split(name, get(name), transform)[i]

    for name, (targets, transform) in plan.items():
        if transform.startswith("row:"):  # StableLM's per-head norms, one tensor per head
            rows.setdefault(targets[0], {})[int(transform[4:])] = get(name)
            continue
        if held is not None and not transform and _token_embedding(model, targets):
            how = held(name)
            stored = how is not None and how.codes is not None and how.format.gathers_rows
            if stored and _hold_embedding(model, how, where):  # type: ignore[arg-type]
                continue
        how = (
            held(name) if held is not None and _linear_targets(model, targets, transform) else None
        )
        if how is not None and how.codes is not None:
            pieces = [split(name, c, transform) for c in how.codes]
            parts: tuple[Any, ...] = tuple(zip(*pieces, strict=True))
        else:
            parts = split(name, get(name), transform)
        if len(parts) != len(targets):
            raise ModelFileError(where, f"tensor {name!r} cannot be split into {targets}")
        for i, (target, t) in enumerate(zip(targets, parts, strict=True)):
            if target in weights or target in linears:
                raise ModelFileError(where, f"two tensors map to {target!r}")
            if how is None:
                weights[target] = t
            else:
                # Codes the format cannot take are read again as values (rare).
                values = functools.partial(piece_values, name, transform, i)
                linears[target] = (how.format, t, values)
    for target, stacked in rows.items():
        if sorted(stacked) != list(range(len(stacked))) or target in weights:
            raise ModelFileError(
                where, f"{target!r} needs rows 0..n-1 once each, got rows {sorted(stacked)}"
            )
        try:
            weights[target] = torch.stack([stacked[j] for j in range(len(stacked))])
        except RuntimeError as e:  # rows of different shapes
            raise ModelFileError(where, f"the rows of {target!r} do not stack: {e}") from None
    if getattr(config, "tie_embeddings", False):
        # tied: the embedding serves both
        weights.pop(
            "decoder.lm_head.weight"
            if isinstance(config, EncoderDecoderConfig)
            else "lm_head.weight",
            None,
        )
    for target, (fmt, piece, again) in linears.items():
        _hold_linear(model, target, fmt, piece, again, weights, where)
    fill(model, weights, where, dtype)
    return model.eval()


def _token_embedding(model: nn.Module, targets: tuple[str, ...]) -> bool:
    """Whether ``targets`` is the one decoder's token embedding table alone."""
    embedding = getattr(model, "tok_embeddings", None)
    return (
        targets == ("tok_embeddings.weight",)
        and isinstance(embedding, nn.Embedding)
        and not isinstance(model, EncoderDecoder)
    )


def _hold_embedding(model: nn.Module, how: HeldLinear, where: str | Path) -> bool:
    """The token embedding as the file's codes (:class:`attnlab.quant.HeldEmbedding`),
    never dequantised as a whole: a lookup reads the rows it needs, to the values a float
    table would hold. A tied output head becomes the same format module. False (the table
    is then read as values) when the format cannot take the codes' shape.

    Raises:
        ModelFileError: codes whose shape is not the table's.
    """
    embedding = model.get_submodule("tok_embeddings")
    assert isinstance(embedding, nn.Embedding) and how.codes is not None
    shape = how.format.weight_shape(how.codes)
    if shape != tuple(embedding.weight.shape):
        raise ModelFileError(
            where,
            f"tok_embeddings.weight has shape {shape}, the config (config.json / metadata) "
            f"implies {tuple(embedding.weight.shape)}",
        )
    try:
        table = how.format.from_stored(how.codes, None)
    except ValueError:  # a shape the format cannot hold: a float table
        return False
    head = getattr(model, "lm_head", None)
    tied = isinstance(head, nn.Linear) and head.weight is embedding.weight
    model.tok_embeddings = HeldEmbedding(table, head=tied)
    if tied:
        model.lm_head = table
    return True


def _hold_linear(
    model: nn.Module,
    target: str,
    fmt: type[WeightFormat],
    piece: tuple[torch.Tensor, ...] | torch.Tensor,
    values: Callable[[], torch.Tensor],
    weights: dict[str, torch.Tensor],
    where: str | Path,
) -> None:
    """Replace the ``nn.Linear`` whose weight is ``target`` by ``fmt`` made from ``piece``
    (its codes, of the weight's shape by :meth:`~attnlab.quant.WeightFormat.weight_shape`,
    or its float values), its bias
    taken out of ``weights``. Codes ``fmt`` cannot take (a shape its kernel cannot pack)
    leave the linear to :func:`fill`, with ``values()``.

    Raises:
        ModelFileError: a shape that is not the layer's, or a bias missing.
    """
    module_name, _, _ = target.rpartition(".")
    parent_name, _, leaf = module_name.rpartition(".")
    linear = model.get_submodule(module_name)
    assert isinstance(linear, nn.Linear)
    shape = fmt.weight_shape(piece) if isinstance(piece, tuple) else tuple(piece.shape)
    if shape != tuple(linear.weight.shape):
        raise ModelFileError(
            where,
            f"{target} has shape {shape}, the config (config.json / metadata) implies "
            f"{tuple(linear.weight.shape)}",
        )
    bias_name = f"{module_name}.bias"
    if linear.bias is not None and bias_name not in weights:
        raise ModelFileError(where, f"tensors do not match the model: missing [{bias_name!r}]")
    bias = weights.get(bias_name) if linear.bias is not None else None
    if isinstance(piece, tuple):
        try:
            module = fmt.from_stored(piece, bias)
        except ValueError:  # a shape the format's kernel cannot pack: float, quantised later
            weights[target] = values()
            return
    else:
        N, K = shape
        module = holding(fmt, N, K).from_float(piece, bias)
    weights.pop(bias_name, None)
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, leaf, module)
