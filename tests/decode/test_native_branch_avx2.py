"""The AVX2 branches of the native kernels (``x86-64-v3``; ``alderlake``: with AVX-VNNI),
built and tested on this machine: see ``tests/native_branches.py``."""

from __future__ import annotations

import pytest

from native_branches import check_branch


@pytest.mark.slow
@pytest.mark.parametrize("march", ["x86-64-v3", "alderlake"])
def test_the_avx2_branches(ext, march):
    check_branch(ext, march)
