"""Every compiled branch of the native kernels, built and tested on this machine.

``-march=native`` compiles only the branch of ``q4.h``, ``q8_0.h``, ``q5_0.h``,
``attend.h`` and ``simd.h`` that this CPU selects. Each other branch this CPU can run is
built here with ``ATTNLAB_NATIVE_MARCH`` (``x86-64-v3``: AVX2; ``alderlake``: AVX2 with
AVX-VNNI; ``x86-64``: the plain loops; ``skylake-avx512``: AVX-512 without BF16) and the
kernel and step tests run against it, in a process of its own, so that a CI machine of any
class tests them all.
"""

from __future__ import annotations

import pytest

from attnlab import native
from native_branches import check_branch


def test_march_must_be_an_architecture_name(monkeypatch):
    monkeypatch.setenv(native.MARCH_ENV, "native; rm -rf /")
    with pytest.raises(ValueError, match="ATTNLAB_NATIVE_MARCH"):
        native.march()
    monkeypatch.setenv(native.MARCH_ENV, "x86-64-v3")
    assert native.march() == "x86-64-v3"
    other = native.build_dir()
    monkeypatch.delenv(native.MARCH_ENV)
    assert native.march() == "native" and native.build_dir() != other  # one build each


@pytest.mark.slow
def test_the_avx512_branch_without_bf16(ext):
    check_branch(ext, "skylake-avx512")
