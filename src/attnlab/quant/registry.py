"""Weight precisions by name: the registered formats, the choice of one for a weight or a
GGUF type, the CLI's help for them, and a whole model's linears put into one.

Shape legend: N output features, K input features.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol, runtime_checkable

from torch import nn

# The formats register themselves on import, in this order (the order of WEIGHT_DTYPES).
# isort: off
from attnlab import native
from attnlab.quant.base import WEIGHT_FORMATS, GGUFBlock, WeightFormat
from attnlab.quant import bf16, int8, int4, q8_0, q5_0  # noqa: F401
# isort: on

__all__ = [
    "WEIGHT_DTYPES",
    "BuildsFromLinears",
    "GGUFHolding",
    "dtype_help",
    "gguf_blocks",
    "gguf_format",
    "gguf_holding",
    "holding",
    "quantize_linear",
    "quantize_model",
    "weight_format",
]

#: Every weight precision by name: ``"float32"`` (the ``nn.Linear`` as it is) and the
#: registered formats.
WEIGHT_DTYPES: tuple[str, ...] = ("float32", *WEIGHT_FORMATS)


def dtype_help() -> str:
    """The CLI's ``--dtype`` help: every precision with its format's
    :attr:`~WeightFormat.cli_help`."""
    entries = ["float32 (exact)"]
    entries += [f"{n} ({f.cli_help})" if f.cli_help else n for n, f in WEIGHT_FORMATS.items()]
    return (
        f"Weight precision: {', '.join(entries)}. Weight-only: faster decoding; "
        "docs/guides/generation.md gives each one's accuracy."
    )


def gguf_blocks() -> dict[str, GGUFBlock]:
    """The block layout of every GGUF type a format holds as stored, by type name."""
    return {t: b for f in WEIGHT_FORMATS.values() for t, b in f.gguf_blocks.items()}


def gguf_format(type_name: str) -> type[WeightFormat] | None:
    """The format that holds GGUF type ``type_name`` as stored (its
    :meth:`~WeightFormat.gguf_codes` reads it), or None."""
    for f in WEIGHT_FORMATS.values():
        if type_name in f.gguf_types:
            return f
    return None


class GGUFHolding(NamedTuple):
    """Where a GGUF tensor's linear weight goes under a weight precision: ``format``, from
    the file's codes (``stored``) or from its float values."""

    format: type[WeightFormat]
    stored: bool


def gguf_holding(dtype: str, type_name: str) -> GGUFHolding | None:
    """How precision ``dtype`` holds a linear weight of GGUF type ``type_name``: in its own
    format when that takes the type as stored; in the format it sends the type to
    (:attr:`WeightFormat.gguf_instead`), as stored or from the values; None when the values
    are to be converted as any float weight (or ``dtype`` is ``"float32"``).

    Raises:
        ValueError: an unknown ``dtype``.
    """
    fmt = weight_format(dtype)
    if fmt is None:
        return None
    if type_name in fmt.gguf_types:
        return GGUFHolding(fmt, True)
    if type_name not in fmt.gguf_instead:
        return None
    instead = WEIGHT_FORMATS[fmt.gguf_instead[type_name]]
    return GGUFHolding(instead, type_name in instead.gguf_types)


def weight_format(dtype: str) -> type[WeightFormat] | None:
    """The registered format named ``dtype``; None for ``"float32"`` (``nn.Linear``).

    Raises:
        ValueError: an unknown name, listing the choices.
    """
    if dtype == "float32":
        return None
    if dtype not in WEIGHT_FORMATS:
        raise ValueError(f"`dtype` must be one of {WEIGHT_DTYPES}, got {dtype!r}")
    return WEIGHT_FORMATS[dtype]


def holding(
    cls: type[WeightFormat], out_features: int, in_features: int, group_size: int = 32
) -> type[WeightFormat]:
    """``cls``, or the first of its fallbacks (:attr:`WeightFormat.fallback`) that can
    hold an (N, K) weight."""
    while cls.why_not(out_features, in_features, group_size) is not None:
        assert cls.fallback is not None, f"{cls.name} holds some shapes and names no fallback"
        cls = WEIGHT_FORMATS[cls.fallback]
    return cls


def quantize_linear(linear: nn.Module, dtype: str, *, group_size: int = 32) -> nn.Module:
    """``linear`` (an ``nn.Linear``) in weight precision ``dtype``.

    ``"float32"`` and modules that are not ``nn.Linear`` are returned unchanged. A shape
    the format cannot hold gets its fallback (int4: int8; see :meth:`WeightFormat.why_not`).

    Raises:
        ValueError: unknown ``dtype``.
    """
    cls = weight_format(dtype)
    if cls is None or not isinstance(linear, nn.Linear):
        return linear
    w, b = linear.weight, linear.bias
    cls = holding(cls, w.shape[0], w.shape[1], group_size)
    return cls.from_float(w, b, group_size=group_size)


@runtime_checkable
class BuildsFromLinears(Protocol):
    """A model that keeps structures built from its linear layers (the fused products of
    :mod:`attnlab.models.fast_decode`), to be rebuilt when those layers are replaced."""

    def invalidate_decode_plan(self) -> None:
        """Forget what was built from the linear layers."""


def quantize_model(
    model: nn.Module,
    dtype: str,
    *,
    group_size: int = 32,
    int8_names: Sequence[str] = ("lm_head",),
) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` by its ``dtype`` version, in place.

    A tied output head (``lm_head.weight is tok_embeddings.weight``) is untied: the
    embedding stays float32 for the lookup and the head gets its own quantised copy (a
    GGUF file's Q8_0 table is instead held once for both, as the loader reads it:
    :class:`attnlab.quant.HeldEmbedding`).
    Layers already in a :class:`WeightFormat` (e.g. taken from a GGUF file's codes) stay as
    they are. What the model built from its old layers is dropped
    (:class:`BuildsFromLinears`).

    Args:
        model: any module.
        dtype: one of :data:`WEIGHT_DTYPES`.
        group_size: int4 group size.
        int8_names: with ``dtype="int4"``, linears of these names get int8 instead (the
            output head: int4 there costs most of the logit error, see
            ``benchmarks/bench_pretrained.py``).

    Returns:
        ``model``, with the compiled kernels built (once per machine) or loaded when its
        formats use them (``q8_0``, ``q5_0``).

    Raises:
        ValueError: unknown ``dtype``.
    """
    if weight_format(dtype) is None:
        return model
    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, linear in targets:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        this = "int8" if dtype == "int4" and name in int8_names else dtype
        setattr(parent, leaf, quantize_linear(linear, this, group_size=group_size))
    if targets and isinstance(model, BuildsFromLinears):
        model.invalidate_decode_plan()
    if any(isinstance(m, (q8_0.Q8Linear, q5_0.Q5Linear)) for m in model.modules()):
        # Their kernels are attnlab's compiled ones, built or loaded here as a model's load
        # does: a forward never starts a build, so without this the first forwards would
        # take the fallback kernels and later ones (once anything loaded the build) these.
        native.extension()
    return model
