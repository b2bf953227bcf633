"""float32 linears whose prompts run on this machine's faster float32 GEMM.

A float32 model's ``nn.Linear`` calls PyTorch's ``addmm``, which is MKL's sgemm; on AMD CPUs
MKL runs its AVX2 code whatever the CPU has, and oneDNN's float32 matmul is up to four times
as fast there (:mod:`attnlab.quant.crossover`, :func:`~attnlab.quant.crossover.float32_gemm`).
:class:`Float32Linear` is ``nn.Linear`` (same parameters, state dict, hooks and
``isinstance``) except that a product of 16 rows or more without autograd (a prompt, in
``torch.no_grad`` or ``torch.inference_mode``) runs on oneDNN where this machine measured it
faster. Training, a few rows (decoding) and every other case are ``nn.Linear``'s own.
:func:`use_float32_gemm` turns a loaded model's plain linears into it.
"""

from __future__ import annotations

import torch
from torch import nn

from attnlab.quant import crossover

__all__ = ["Float32Linear", "use_float32_gemm"]


class Float32Linear(nn.Linear):
    """``nn.Linear`` whose float32 prompts without autograd run on this machine's faster
    float32 GEMM (:func:`attnlab.quant.crossover.float32_gemm`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            x.dtype == torch.float32
            and self.weight.dtype == torch.float32
            and not torch.is_grad_enabled()
            and x.dim() >= 2
            and x.numel() >= crossover.FIRST_PROBE_ROWS * self.in_features
            and crossover.chosen_gemm() == "onednn"
        ):
            y = crossover.dense_mm(x.reshape(-1, self.in_features), self.weight)  # (M, N)
            if self.bias is not None:
                y = y.add_(self.bias)
            return y.view(*x.shape[:-1], self.out_features)
        return super().forward(x)


def use_float32_gemm(model: nn.Module) -> nn.Module:
    """Make every plain ``nn.Linear`` of ``model`` a :class:`Float32Linear` in place (the
    same module, its class changed: parameters, hooks and references stay); subclasses of
    ``nn.Linear`` are left as they are. Returns ``model``."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = Float32Linear
    return model
