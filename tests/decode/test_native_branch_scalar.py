"""The plain loops of the native kernels (``x86-64``), built and tested on this machine:
see ``tests/native_branches.py``."""

from __future__ import annotations

import pytest

from native_branches import check_branch


@pytest.mark.slow
def test_the_plain_branch(ext):
    check_branch(ext, "x86-64")
