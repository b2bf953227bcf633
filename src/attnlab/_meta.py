"""Modules built for their structure alone: on the meta device, without initialisation.

Counting a model's parameters or describing its layers needs the modules, not their
values. Built on the meta device, a module allocates nothing; its constructor's random
initialisation (``nn.init.normal_`` and kin) would still run, and under the meta device
those functions dispatch through ``torch._refs``, which imports ``torch._dynamo`` (over a
second, once a process). :func:`skip_random_init` skips them: for a model whose weights
are loaded next, or that holds none.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

_INIT_FUNCTIONS = ("uniform_", "normal_", "kaiming_uniform_", "trunc_normal_", "zeros_", "ones_")


@contextmanager
def skip_random_init() -> Iterator[None]:
    """Build modules without their random initialisation (every weight is overwritten next,
    or the module is on the meta device and holds no values).

    ``nn.Linear``/``nn.Embedding``/``nn.LayerNorm`` call ``torch.nn.init`` functions in
    their constructors; for 135M parameters that costs seconds.
    :func:`attnlab.pretrained.build.fill` then checks that every parameter is loaded, so no
    uninitialised value can survive.
    """
    saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}

    def keep(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        return tensor

    try:
        for name in _INIT_FUNCTIONS:
            setattr(nn.init, name, keep)
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


@contextmanager
def structure_only() -> Iterator[None]:
    """Modules built inside hold no values: the meta device, no initialisation."""
    with skip_random_init(), torch.device("meta"):
        yield
