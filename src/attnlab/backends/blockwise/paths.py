"""Which tile path a blockwise call takes: PyTorch's fused CPU op or plain PyTorch.

``tile_path=`` on a call wins; else the path :func:`force_tile_path` set (a context
manager, for tests and benchmarks); else ``"fused"`` whenever the op can serve the call.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Literal

import torch

TilePath = Literal["fused", "pure"]
PATHS: tuple[TilePath, ...] = ("fused", "pure")


def _find_fused_ops() -> tuple[Any, Any] | None:
    """PyTorch's CPU flash-attention forward/backward ops, or None if this build lacks them."""
    try:
        aten = torch.ops.aten
        return (
            aten._scaled_dot_product_flash_attention_for_cpu.default,
            aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        )
    except (AttributeError, RuntimeError):
        return None


#: The fused forward and backward ops, looked up once at import (None: this build has none).
FUSED_OPS = _find_fused_ops()


def fused_tiles_available() -> bool:
    """Whether this PyTorch build has the fused CPU tile ops."""
    return FUSED_OPS is not None


def why_not_fused(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> str | None:
    """Why the fused tile op cannot serve these inputs, or None when it can."""
    if FUSED_OPS is None:
        return "this PyTorch build has no aten._scaled_dot_product_flash_attention_for_cpu"
    if query.device.type != "cpu":
        return f"the fused tile op runs on CPU, the tensors are on {query.device.type}"
    if value.shape[-1] != query.shape[-1]:
        return (
            f"the fused tile op needs the value head dim equal to the query head dim "
            f"(D={query.shape[-1]}), got Dv={value.shape[-1]}"
        )
    if query.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        return f"the fused tile op does not take dtype {query.dtype}"
    return None


def pure_because(softcap: float | None) -> str | None:
    """Why a call with this soft-cap needs the pure tiles, or None."""
    if softcap is not None:
        return "the fused tile op has no logit soft-capping"
    return None


class TilePathChoice:
    """The process-wide tile path choice: the path :func:`force_tile_path` forces inside
    its ``with`` block (None: none forced), and the choice every call makes from it.

    One instance, :data:`TILE_PATHS`, serves every call; the forced path is global (not
    per thread) so that a benchmark's worker threads see it too.
    """

    def __init__(self) -> None:
        self.forced: TilePath | None = None

    @contextmanager
    def forcing(self, path: TilePath | None) -> Iterator[None]:
        """Force ``path`` until the ``with`` block ends (then the previous one again)."""
        saved = self.forced
        self.forced = path
        try:
            yield
        finally:
            self.forced = saved

    def choose(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        tile_path: TilePath | None,
        pure_because: str | None = None,
    ) -> TilePath:
        """The tile path; ``pure_because`` says why the call needs the pure tiles (softcap,
        bias gradients), or None: then a forced path yields to it, an explicit
        ``tile_path="fused"`` is an error.

        Raises:
            ValueError: an unknown ``tile_path``, or ``"fused"`` for a call it cannot serve.
        """
        path = tile_path if tile_path is not None else self.forced
        if pure_because is not None and tile_path is None:
            path = "pure"
        if path is not None and path not in PATHS:
            raise ValueError(f"`tile_path` must be 'fused', 'pure' or None, got {path!r}")
        why = pure_because or why_not_fused(query, key, value)
        if path == "fused" and why is not None:
            raise ValueError(f"tile_path='fused' cannot serve this call: {why}; use 'pure'")
        if path is not None:
            return path
        return "pure" if why is not None else "fused"


#: The one :class:`TilePathChoice` of this process.
TILE_PATHS = TilePathChoice()


def force_tile_path(path: TilePath | None) -> AbstractContextManager[None]:
    """Run every blockwise tile with ``path`` (``"fused"`` or ``"pure"``; None = choose)
    inside the ``with`` block, e.g. to test or benchmark one path through the public API.

    Raises:
        ValueError: an unknown path.
    """
    if path is not None and path not in PATHS:
        raise ValueError(f"`path` must be 'fused', 'pure' or None, got {path!r}")
    return TILE_PATHS.forcing(path)
