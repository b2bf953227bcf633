"""The AVX-512 branch without bf16 (``skylake-avx512``) of the native kernels, built and
tested on this machine, and the check of ``ATTNLAB_NATIVE_MARCH``: which branches exist and
why each is built is in ``tests/native_branches.py``."""

from __future__ import annotations

import pytest

from attnlab import native
from native_branches import built_line, check_branch, expected_line


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


def test_this_builds_integer_kernels_are_its_branchs(ext):
    """The build in use says which kernels sum integer products of activation codes, and it
    is what its branch should have (the tests' error bounds follow it)."""
    assert built_line(ext) == expected_line(ext.SIMD)


def test_a_native_build_leaves_out_bf16_dots_on_a_cpu_with_amx(monkeypatch):
    """On a Xeon with AMX the native build is the integer-rows branch (``avx512``): there
    q5_0's integer path on float32 rows decoded faster than its bf16 dots. Elsewhere, and
    for a named -march, the flags are -march's alone."""
    monkeypatch.delenv(native.MARCH_ENV, raising=False)
    monkeypatch.setattr(native, "cpu_flags", lambda: "flags : avx512f avx512_bf16 amx_bf16")
    assert native._flags()[-2:] == ("-march=native", "-mno-avx512bf16")
    amx = native.build_dir()
    monkeypatch.setattr(native, "cpu_flags", lambda: "flags : avx512f avx512_bf16")
    assert native._flags()[-1] == "-march=native"
    monkeypatch.setattr(native, "cpu_flags", lambda: "flags : avx512f avx512_bf16 amx_bf16")
    monkeypatch.setenv(native.MARCH_ENV, "cooperlake")
    assert native._flags()[-1] == "-march=cooperlake"
    assert native.build_dir() != amx
