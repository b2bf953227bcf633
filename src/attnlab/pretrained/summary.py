"""What a loaded model is, as data: the rows of ``attnlab info --model``.

Shape legend: H query heads, G key/value heads, D head dim, T sequence length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from attnlab.attention import Attention
from attnlab.backends import explain_dispatch
from attnlab.masks import AttentionMask, CausalMask, ChunkedMask, SlidingWindowMask
from attnlab.models.decoder import Decoder
from attnlab.models.encoder import Encoder
from attnlab.models.encoder_decoder import EncoderDecoder
from attnlab.rope import RotaryEmbedding

__all__ = ["LayerSummary", "ModelSummary", "summarize_model"]


@dataclass(frozen=True)
class LayerSummary:
    """One attention layer: its heads, window, and the backend a call of length T runs on.

    ``role`` says which attention it is: ``"self"`` (a decoder's or an encoder's), or in an
    encoder-decoder ``"encoder"``, ``"decoder self"`` and ``"decoder cross"``;
    ``attention_chunk`` the chunk length of chunked local attention (Llama 4), or None.
    """

    index: int
    heads: int
    kv_heads: int
    head_dim: int
    sliding_window: int | None
    backend: str
    role: str = "self"
    attention_chunk: int | None = None


@dataclass(frozen=True)
class ModelSummary:
    """A loaded model (decoder, encoder or encoder-decoder) at a glance.

    Attributes:
        family: the family name (``model_type`` / GGUF architecture).
        kind: ``"decoder"``, ``"encoder"`` or ``"encoder-decoder"``.
        layers: number of blocks (an encoder-decoder's encoder blocks).
        hidden_size: model width C.
        heads, kv_heads, head_dim: H, G, D of the first layer.
        positions: ``"rope"``, ``"learned"``, ``"alibi"``, ``"relative"`` (T5) or
            ``"learned+types"`` (encoders).
        rope: base, rotated fraction, interleaving and scaling kind (and `layer_bases`:
            the other bases some layers rotate with, Gemma 3's local ones; `nope_layers`:
            the layers that do not rotate, SmolLM3's), or None.
        norm: e.g. ``"rms pre"``, ``"layer post"``.
        mlp: e.g. ``"gated silu"``, or with experts ``"8 experts, top 2, silu"``.
        context_length: longest input, or None (no limit: T5's relative positions).
        parameters: parameter count (tied weights once).
        dtype: parameter dtype.
        probe_length: T of the call the backends were chosen for.
        per_layer: one :class:`LayerSummary` per attention layer (an encoder-decoder: the
            encoder's, then per decoder block its self- and cross-attention).
        decoder_layers: an encoder-decoder's decoder blocks, else None.
        attn_softcap: attention logit soft-capping (Gemma 2), or None.
        final_softcap: output logit soft-capping (Gemma 2), or None.
        kv_cache: a decoder's KV cache per token, in what its static caches hold
            (``model.kv_cache_dtype``, else the model's dtype), or None:
            ``bytes_per_token`` (every layer), ``mha_bytes_per_token`` (what plain
            multi-head attention with the same query heads and head dims would cache:
            a key and a value per head), and for latent attention (MLA) ``latent``
            (``kv_lora_rank``) and ``rotary`` (``qk_rope_head_dim``), the numbers one
            token caches per layer.
        notes: what the load left out of the file, one line each (DeepSeek-V3's
            multi-token-prediction layer: :attr:`~attnlab.models.decoder.Decoder.load_notes`).
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
    context_length: int | None
    parameters: int
    dtype: str
    probe_length: int
    per_layer: tuple[LayerSummary, ...]
    decoder_layers: int | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    kv_cache: dict[str, Any] | None = None
    notes: tuple[str, ...] = ()


def _attention_layers(model: Any) -> list[tuple[str, Any, bool]]:
    """``(role, Attention, causal)`` for every attention layer, in the order they run."""
    if isinstance(model, EncoderDecoder):
        rows = [("encoder", b.attention, False) for b in model.encoder.blocks]
        for b in model.decoder.blocks:
            rows.append(("decoder self", b.attention, True))
            if b.cross_attention is not None:
                rows.append(("decoder cross", b.cross_attention, False))
        return rows
    causal = isinstance(model, Decoder) and model.config.causal
    return [("self", m, causal) for m in model.modules() if isinstance(m, Attention)]


def summarize_model(model: Any, *, probe_length: int = 1024) -> ModelSummary:
    """Describe a model from :func:`attnlab.pretrained.load_pretrained`.

    Args:
        model: a :class:`~attnlab.models.decoder.Decoder`,
            :class:`~attnlab.models.encoder.Encoder` or
            :class:`~attnlab.models.encoder_decoder.EncoderDecoder`.
        probe_length: T of the call whose backend choice is reported (causal for decoder
            self-attention, bidirectional for encoders; cross attention with S = T), capped
            at the model's context length.

    Raises:
        TypeError: a model that is none of these.
    """
    if not isinstance(model, (Decoder, Encoder, EncoderDecoder)):
        raise TypeError(
            f"`model` must be a Decoder, Encoder or EncoderDecoder, got {type(model).__name__}"
        )
    config = model.config
    dtype = next(model.parameters()).dtype
    context: int | None
    if isinstance(model, EncoderDecoder):
        context = None  # relative positions: no table bounds the length
    elif isinstance(model, Decoder):
        context = model.config.context_length
    else:
        context = model.config.max_tokens
    T = max(1, min(probe_length, context or probe_length))
    per_layer = []
    layers = _attention_layers(model)
    for i, (role, layer, causal) in enumerate(layers):
        H, G, D = layer.num_heads, layer.num_kv_heads, layer.head_dim

        def shaped(*shape: int) -> torch.Tensor:  # one element, expanded: no memory
            return torch.zeros((1,) * len(shape), dtype=dtype).expand(*shape)

        window = getattr(layer, "sliding_window", None)
        chunk = getattr(layer, "attention_chunk", None)
        mask: AttentionMask | None = None
        if causal:
            mask = (
                SlidingWindowMask(window)
                if window
                else ChunkedMask(chunk)
                if chunk and chunk < T
                else CausalMask()
            )
        exp = explain_dispatch(
            shaped(1, H, T, D),
            shaped(1, G, T, D),
            shaped(1, G, T, D),
            mask,
            0.0,
            backend=layer.backend,
            # options that rule backends out (PyTorch's kernel has neither)
            softcap=getattr(layer, "softcap", None),
            # their shape decides, not their values (a model on the meta device has none)
            sinks=None if getattr(layer, "sinks", None) is None else shaped(*layer.sinks.shape),
        )
        per_layer.append(LayerSummary(i, H, G, D, window, str(exp.chosen), role, chunk))
    first = layers[0][1]
    rope: dict[str, Any] | None = None
    if isinstance(model, Decoder) and model.rope is not None:
        rc = model.rope.config
        rope = {
            "base": rc.base,
            "fraction": rc.fraction,
            "interleaved": rc.interleaved,
            "scaling": None if rc.scaling is None else type(rc.scaling).__name__,
        }
        # layers with a RoPE of their own (Gemma 3's local layers): their bases
        own = {float(m.config.base) for m in model.modules() if isinstance(m, RotaryEmbedding)} - {
            rc.base
        }
        if own:
            rope["layer_bases"] = sorted(own)
        # NoPE layers (SmolLM3, Llama 4): no rotary at all
        nope = [i for i, b in enumerate(model.blocks) if getattr(b.attention, "rope", 0) is None]
        if nope:
            rope["nope_layers"] = nope
    attn_softcap = final_softcap = None
    if isinstance(model, Decoder):
        c = model.config
        positions: str = c.positions
        norm = f"{c.norm} {c.norm_placement}" + (" parallel" if c.parallel_residual else "")
        mlp = f"{c.mlp} {c.activation}"
        if c.moe is not None:  # the routed layers' experts
            e = c.moe
            act = f"clamped SwiGLU {e.clamped_swiglu}" if e.clamped_swiglu else c.activation
            mlp = f"{e.num_experts} experts, top {e.top_k}, {act}"
        attn_softcap, final_softcap = c.attn_softcap, c.final_softcap
    elif isinstance(model, EncoderDecoder):
        positions = "relative"
        norm = "rms pre"
        mlp = f"{'gated' if model.config.gated_mlp else 'plain'} {model.config.activation}"
    else:
        positions = "learned+types"
        norm = "layer post"
        mlp = f"plain {model.config.activation}"
    kv_cache = _kv_cache(model, dtype) if isinstance(model, Decoder) else None
    kind = {Decoder: "decoder", Encoder: "encoder", EncoderDecoder: "encoder-decoder"}
    return ModelSummary(
        family=config.family,
        kind=kind[type(model)],
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
        decoder_layers=getattr(config, "num_decoder_layers", None),
        attn_softcap=attn_softcap,
        final_softcap=final_softcap,
        kv_cache=kv_cache,
        notes=model.load_notes if isinstance(model, Decoder) else (),
    )


def _kv_cache(model: Any, dtype: torch.dtype) -> dict[str, Any]:
    """A decoder's cache bytes per token, against plain multi-head attention's, in what its
    static caches hold (``model.kv_cache_dtype``, else ``dtype``)."""
    held_dtype = getattr(model, "kv_cache_dtype", None) or dtype
    size = torch.empty((), dtype=held_dtype).element_size()
    mla = model.config.mla
    layers = len(model.blocks)
    if mla is not None:
        return {
            "bytes_per_token": mla.cache_bytes_per_token(layers, size),
            "mha_bytes_per_token": mla.mha_bytes_per_token(model.config.num_heads, layers, size),
            "latent": mla.kv_lora_rank,
            "rotary": mla.qk_rope_head_dim,
        }
    held = mha = 0
    for block in model.blocks:
        a = block.attention
        held += a.num_kv_heads * 2 * a.head_dim * size
        mha += a.num_heads * 2 * a.head_dim * size
    return {"bytes_per_token": held, "mha_bytes_per_token": mha}
