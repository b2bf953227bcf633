"""The AVX-512 branch with bf16 dot products (``cooperlake``) of the native kernels, built
and tested on a machine that can run it where it is not the machine's own build (a Xeon
with AMX builds natively without bf16 dots: ``attnlab.native.INTEGER_ROWS_FLAGS``). Which
branches exist and why each is built is in ``tests/native_branches.py``."""

from __future__ import annotations

import pytest

from native_branches import check_branch


@pytest.mark.slow
def test_the_avx512_branch_with_bf16_dots(ext):
    check_branch(ext, "cooperlake")
