"""What a loaded model is, as data: the rows of ``attnlab info --model``.

Shape legend: H query heads, G key/value heads, D head dim, T sequence length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["LayerSummary", "ModelSummary", "summarize_model"]


@dataclass(frozen=True)
class LayerSummary:
    """One attention layer: its heads, window, and the backend a call of length T runs on."""

    index: int
    heads: int
    kv_heads: int
    head_dim: int
    sliding_window: int | None
    backend: str


@dataclass(frozen=True)
class ModelSummary:
    """A loaded model (decoder or encoder) at a glance.

    Attributes:
        family: the family name (``model_type`` / GGUF architecture).
        kind: ``"decoder"`` or ``"encoder"``.
        layers: number of blocks.
        hidden_size: model width C.
        heads, kv_heads, head_dim: H, G, D of the first layer.
        positions: ``"rope"``, ``"learned"`` or ``"learned+types"`` (encoders).
        rope: base, rotated fraction, interleaving and scaling kind, or None.
        norm: e.g. ``"rms pre"``, ``"layer post"``.
        mlp: e.g. ``"gated silu"``.
        context_length: longest input.
        parameters: parameter count (tied weights once).
        dtype: parameter dtype.
        probe_length: T of the call the backends were chosen for.
        per_layer: one :class:`LayerSummary` per attention layer.
    """

    family: str
    kind: str
    layers: int
    hidden_size: int
    heads: int
    kv_heads: int
    head_dim: int
    positions: str
    rope: dict[str, Any] | None
    norm: str
    mlp: str
    context_length: int
    parameters: int
    dtype: str
    probe_length: int
    per_layer: tuple[LayerSummary, ...]


def summarize_model(model: Any, *, probe_length: int = 1024) -> ModelSummary:
    """Describe a model from :func:`attnlab.pretrained.load_pretrained`.

    Args:
        model: a :class:`~attnlab.models.decoder.Decoder` or
            :class:`~attnlab.models.encoder.Encoder`.
        probe_length: T of the (causal for decoders) call whose backend choice is reported,
            capped at the model's context length.

    Raises:
        TypeError: a model that is neither.
    """
    from attnlab.attention import Attention
    from attnlab.backends import explain_dispatch
    from attnlab.masks import CausalMask, SlidingWindowMask
    from attnlab.models.decoder import Decoder
    from attnlab.models.encoder import Encoder

    if not isinstance(model, (Decoder, Encoder)):
        raise TypeError(f"`model` must be a Decoder or Encoder, got {type(model).__name__}")
    config = model.config
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    first = layers[0]
    dtype = next(model.parameters()).dtype
    decoder = isinstance(model, Decoder)
    context = model.config.context_length if isinstance(model, Decoder) else model.config.max_tokens
    T = max(1, min(probe_length, context))
    per_layer = []
    for i, layer in enumerate(layers):
        H, G, D = layer.num_heads, layer.num_kv_heads, layer.head_dim

        def shaped(*shape: int) -> torch.Tensor:  # one element, expanded: no memory
            return torch.zeros((1,) * len(shape), dtype=dtype).expand(*shape)

        window = getattr(layer, "sliding_window", None)
        mask = (SlidingWindowMask(window) if window else CausalMask()) if decoder else None
        exp = explain_dispatch(
            shaped(1, H, T, D),
            shaped(1, G, T, D),
            shaped(1, G, T, D),
            mask,
            0.0,
            backend=layer.backend,
        )
        per_layer.append(LayerSummary(i, H, G, D, window, str(exp.chosen)))
    rope = None
    if isinstance(model, Decoder) and model.rope is not None:
        rc = model.rope.config
        rope = {
            "base": rc.base,
            "fraction": rc.fraction,
            "interleaved": rc.interleaved,
            "scaling": None if rc.scaling is None else type(rc.scaling).__name__,
        }
    if isinstance(model, Decoder):
        c = model.config
        positions: str = c.positions
        norm = f"{c.norm} {c.norm_placement}" + (" parallel" if c.parallel_residual else "")
        mlp = f"{c.mlp} {c.activation}"
    else:
        positions = "learned+types"
        norm = "layer post"
        mlp = f"plain {model.config.activation}"
    return ModelSummary(
        family=config.family,
        kind="decoder" if decoder else "encoder",
        layers=config.num_layers,
        hidden_size=config.hidden_size,
        heads=first.num_heads,
        kv_heads=first.num_kv_heads,
        head_dim=first.head_dim,
        positions=positions,
        rope=rope,
        norm=norm,
        mlp=mlp,
        context_length=context,
        parameters=sum(p.numel() for p in model.parameters()),
        dtype=str(dtype).removeprefix("torch."),
        probe_length=T,
        per_layer=tuple(per_layer),
    )
