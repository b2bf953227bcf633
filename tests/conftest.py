from __future__ import annotations

from types import ModuleType

import pytest
import torch

# Tests are deterministic and small; two threads match the CI machine.
torch.set_num_threads(2)


@pytest.fixture(scope="session")
def ext() -> ModuleType:
    """attnlab's compiled module; the test skips, naming why, where it is not built."""
    from attnlab import native

    module = native.extension()
    if module is None:
        pytest.skip(f"the native build is unavailable: {native.why_not_native()}")
    return module
