"""AdamW for the trainer on CPU, without ``torch.optim``.

Building any ``torch.optim`` optimizer imports ``torch._dynamo`` (its methods are wrapped
by ``torch._disable_dynamo``, which imports it on the first call): 1.8-2.4 s of every
``attnlab train`` process on the machines this project is measured on, a third of a short
run. :class:`AdamW` is ``torch.optim.AdamW``'s update as PyTorch runs it on CPU (its
single-tensor path, which it picks for CPU tensors), operation for operation, so the
parameters and the state are equal to PyTorch's bit for bit; its ``state_dict`` has
PyTorch's layout, so a checkpoint written with either loads into the other
(``tests/train/test_optim.py`` checks both against PyTorch). On CUDA the trainer keeps
PyTorch's fused AdamW.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

__all__ = ["AdamW"]

# The keys of a torch.optim.AdamW param group besides "params", with the values AdamW's
# update here implements (the options it does not implement must keep these values).
_FIXED = {
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
    "decoupled_weight_decay": True,
}


class AdamW:
    """``torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=...)`` on
    CPU tensors: the same update, ``param_groups``, ``zero_grad``, ``step``,
    ``state_dict`` and ``load_state_dict``.

    Args:
        groups: dicts with ``"params"`` (a list of tensors) and optionally ``"lr"``,
            ``"betas"``, ``"eps"``, ``"weight_decay"`` overriding the defaults.
        lr: the default learning rate of every group.
        betas: the default ``(beta1, beta2)``.
        eps: the default term added to the denominator.
        weight_decay: the default decoupled weight decay.

    Raises:
        ValueError: a parameter in two groups, or a group without parameters.
    """

    def __init__(
        self,
        groups: Iterable[Mapping[str, Any]],
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ) -> None:
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        self.param_groups: list[dict[str, Any]] = []
        seen: set[int] = set()
        for group in groups:
            params = list(group["params"])
            if not params:
                raise ValueError("an AdamW parameter group has no parameters")
            if any(id(p) in seen for p in params):
                raise ValueError("a parameter appears in more than one AdamW group")
            seen.update(id(p) for p in params)
            merged = {**defaults, **_FIXED, **{k: v for k, v in group.items() if k != "params"}}
            merged["betas"] = tuple(merged["betas"])
            self.param_groups.append({**merged, "params": params})
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self._params():
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().zero_()

    @torch.no_grad()
    def step(self) -> None:
        """One update of every parameter that has a gradient (PyTorch's
        ``_single_tensor_adam`` with decoupled weight decay, no amsgrad)."""
        for group in self.param_groups:
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad
                state = self.state.get(param)
                if state is None:
                    state = self.state[param] = {
                        "step": torch.tensor(0.0, dtype=torch.float32),
                        "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
                    }
                step_t, exp_avg, exp_avg_sq = state["step"], state["exp_avg"], state["exp_avg_sq"]
                step_t += 1
                if wd != 0:
                    param.mul_(1 - lr * wd)
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                step = step_t.item()
                bias_correction1 = 1 - beta1**step
                bias_correction2 = 1 - beta2**step
                step_size = lr / bias_correction1
                denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
                param.addcdiv_(exp_avg, denom, value=-step_size)

    def state_dict(self) -> dict[str, Any]:
        """PyTorch's layout: parameters numbered across the groups in order, the state by
        number, each group's options with ``"params"`` as those numbers."""
        index = {id(p): i for i, p in enumerate(self._params())}
        groups = [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [index[id(p)] for p in g["params"]],
            }
            for g in self.param_groups
        ]
        state = {index[id(p)]: dict(s) for p, s in self.state.items()}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state written by :meth:`state_dict` or by ``torch.optim.AdamW`` for the
        same groups of parameters of the same shapes.

        Raises:
            ValueError: the groups or their sizes differ, an option this AdamW does not
                implement is set, or a state tensor's shape is not its parameter's.
        """
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"the optimizer state has {len(saved_groups)} parameter groups, "
                f"this optimizer {len(self.param_groups)}"
            )
        numbered: dict[int, torch.Tensor] = {}
        for saved, group in zip(saved_groups, self.param_groups, strict=True):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"a parameter group of the optimizer state has {len(saved['params'])} "
                    f"parameters, this optimizer's {len(group['params'])}"
                )
            for key, value in _FIXED.items():
                if saved.get(key, value) != value:
                    raise ValueError(f"the optimizer state sets `{key}` to {saved[key]!r}")
            numbered.update(zip(saved["params"], group["params"], strict=True))
        self.state = {}
        for i, saved_state in state_dict["state"].items():
            param = numbered[int(i)]
            loaded = {}
            for key, value in saved_state.items():
                if key == "step":
                    loaded[key] = torch.as_tensor(value, dtype=torch.float32).clone()
                    continue
                if value.shape != param.shape:
                    raise ValueError(
                        f"the optimizer state's `{key}` of parameter {i} has shape "
                        f"{tuple(value.shape)}, the parameter {tuple(param.shape)}"
                    )
                loaded[key] = value.to(dtype=param.dtype, device=param.device).clone()
            self.state[param] = loaded
        for saved, group in zip(saved_groups, self.param_groups, strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
            group["betas"] = tuple(group["betas"])
