"""Validation of a public attention call into an :class:`AttentionRequest`.

Shape legend: B batch, H query heads, G key/value heads, T query length, S key length,
D head dim, Dv value head dim.

Both :func:`attnlab.functional.scaled_dot_product_attention` and
:func:`attnlab.backends.explain_dispatch` go through :func:`prepare_call`, so they accept
and reject exactly the same input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attnlab.backends.base import AttentionRequest, WeightsRequest
from attnlab.backends.registry import available_backends
from attnlab.masks import AttentionMask, as_mask

__all__ = ["PreparedCall", "check_sinks", "check_softcap", "prepare_call"]


@dataclass(frozen=True)
class PreparedCall:
    """A validated call: the request, the normalised mask, the scale, the weights ask,
    the soft-cap and the sinks."""

    request: AttentionRequest
    mask: AttentionMask | None
    scale: float
    weights: WeightsRequest | None
    softcap: float | None = None
    sinks: torch.Tensor | None = None


def _check_4d(name: str, t: object, layout: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(
            f"`{name}` must be a floating-point tensor, got dtype {t.dtype}; "
            f"convert it with `{name}.float()`"
        )
    if t.ndim != 4:
        raise ValueError(
            f"`{name}` must be 4-D {layout}, got a {t.ndim}-D tensor of shape "
            f"{tuple(t.shape)}; for one sequence use `{name}[None]`, and move heads "
            "before the sequence dim with `.transpose(1, 2)`"
        )
    if t.numel() == 0:
        raise ValueError(f"`{name}` must not be empty, got shape {tuple(t.shape)}")
    return t


def prepare_call(
    query: object,
    key: object,
    value: object,
    attn_mask: object,
    dropout_p: object,
    is_causal: object,
    scale: object,
    backend: object,
    need_weights: object,
    *,
    softcap: object = None,
    sinks: object = None,
) -> PreparedCall:
    """Validate the public arguments of an attention call.

    Raises:
        TypeError: a non-tensor or non-floating tensor, mixed dtypes or devices, a mask
            of the wrong dtype, a non-bool ``is_causal``/``need_weights``.
        ValueError: wrong ranks, mismatched batch / head dim / key length, ``H`` not a
            multiple of ``G``, a mask that does not broadcast, ``dropout_p`` outside
            [0, 1), a non-positive ``scale``, an unknown backend, unknown heads/rows,
            ``softcap <= 0``, ``sinks`` not a float tensor ``(H,)``.
    """
    q = _check_4d("query", query, "(B, H, T, D)")
    k = _check_4d("key", key, "(B, G, S, D)")
    v = _check_4d("value", value, "(B, G, S, Dv)")
    B, H, T, D = q.shape
    G, S = k.shape[1], k.shape[2]
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            f"`query`, `key` and `value` must share one dtype, got {q.dtype}, {k.dtype}, "
            f"{v.dtype}; cast them with `.to({q.dtype})`"
        )
    if k.device != q.device or v.device != q.device:
        raise TypeError(
            f"`query`, `key` and `value` must be on one device, got {q.device}, {k.device}, "
            f"{v.device}"
        )
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(
            f"`key` and `value` must have the same batch size as `query` (B={B}), got "
            f"{k.shape[0]} and {v.shape[0]}"
        )
    if k.shape[3] != D:
        raise ValueError(
            f"`key` must have the same head dim as `query` (D={D}), got D={k.shape[3]}"
        )
    if v.shape[1] != G or v.shape[2] != S:
        raise ValueError(
            f"`value` must have the same heads and length as `key` (G={G}, S={S}), got "
            f"G={v.shape[1]}, S={v.shape[2]}"
        )
    if H % G != 0:
        raise ValueError(
            f"the query heads must be a multiple of the key/value heads for grouped-query "
            f"attention, got H={H} query heads and G={G} key/value heads; use G dividing H"
        )
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"`dropout_p` must be a float, got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"`dropout_p` must be in [0, 1), got {dropout_p}")
    if scale is None:
        scale_f = 1.0 / math.sqrt(D)
    else:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"`scale` must be a float or None, got {type(scale).__name__}")
        if not (scale > 0 and math.isfinite(scale)):
            raise ValueError(f"`scale` must be a positive finite number, got {scale!r}")
        scale_f = float(scale)
    if not isinstance(backend, str):
        raise TypeError(f"`backend` must be a str, got {type(backend).__name__}")
    if backend not in available_backends():
        raise ValueError(f"`backend` must be one of {available_backends()}, got {backend!r}")
    mask = as_mask(attn_mask, is_causal)  # type: ignore[arg-type]
    if mask is not None:
        mask.validate(B, H, T, S)
    softcap_f = check_softcap(softcap)
    sinks_t = check_sinks(sinks, H, q.device)
    weights = WeightsRequest.from_arg(need_weights)
    if weights is not None:
        weights.head_index(H)
        weights.row_index(T)
    request = AttentionRequest(
        B=B,
        H=H,
        G=G,
        T=T,
        S=S,
        D=D,
        Dv=v.shape[3],
        dtype=q.dtype,
        device_type=q.device.type,
        mask=mask,
        dropout_p=float(dropout_p),
        needs_grad=torch.is_grad_enabled()
        and (
            q.requires_grad
            or k.requires_grad
            or v.requires_grad
            or (sinks_t is not None and sinks_t.requires_grad)
            or (mask is not None and mask.bias_requires_grad)
        ),
        weights=weights,
        softcap=softcap_f,
        sinks=sinks_t is not None,
    )
    return PreparedCall(
        request=request,
        mask=mask,
        scale=scale_f,
        weights=weights,
        softcap=softcap_f,
        sinks=sinks_t,
    )


def check_softcap(softcap: object) -> float | None:
    """``softcap`` as a float (None stays None); ValueError unless positive and finite."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"`softcap` must be a float or None, got {type(softcap).__name__}")
    if not (softcap > 0 and math.isfinite(softcap)):
        raise ValueError(
            f"`softcap` must be a positive finite number (Gemma 2 uses 50.0), got {softcap!r}; "
            "pass None for no soft-capping"
        )
    return float(softcap)


def check_sinks(sinks: object, H: int, device: torch.device) -> torch.Tensor | None:
    """``sinks`` checked to be a finite float tensor ``(H,)`` on ``device`` (or None)."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"`sinks` must be a float torch.Tensor (H,), got {type(sinks).__name__}")
    if not sinks.is_floating_point():
        raise ValueError(
            f"`sinks` must be a float tensor (H,), got dtype {sinks.dtype}; use `sinks.float()`"
        )
    if sinks.shape != (H,):
        raise ValueError(
            f"`sinks` must have one logit per query head, shape (H,) = ({H},), got "
            f"{tuple(sinks.shape)}"
        )
    if sinks.device != device:
        raise ValueError(f"`sinks` must be on the query's device ({device}), got {sinks.device}")
    with torch.no_grad():
        if not bool(torch.isfinite(sinks).all()):
            raise ValueError("`sinks` must be finite (a learned logit per head)")
    return sinks
