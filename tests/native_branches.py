"""The compiled branches of the native kernels and how each is built and tested; the
tests are ``tests/decode/test_native_branch*.py``, split so that the branches' builds
(tens of seconds each) run on different pytest workers.

``-march=native`` compiles only the branch of ``q4.h``, ``q8_0.h``, ``q5_0.h``,
``attend.h`` and ``simd.h`` that this CPU selects. Each other branch this CPU can run is
built here with ``ATTNLAB_NATIVE_MARCH`` (``x86-64-v3``: AVX2; ``alderlake``: AVX2 with
AVX-VNNI; ``x86-64``: the plain loops; ``skylake-avx512``: AVX-512 without BF16) and the
kernel and step tests run against it, in a process of its own, so that a CI machine of any
class tests them all.

Each build takes tens of seconds of one core (most of a ``[dev]`` run's compile time), so
they run in CI (``CI`` set, as ``.ci/run`` and hosted CI services set it) or with
``ATTNLAB_TEST_BRANCHES=1``; elsewhere they skip saying so, and this CPU's own build is
tested by the kernel tests themselves.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from attnlab import native

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests" / "decode"
KERNEL_TESTS = (
    "test_native_attend.py",
    "test_native_capped.py",
    "test_native_q4.py",
    "test_native_q8.py",
    "test_native_q5.py",
    "test_native_readers.py",
    "test_native_step.py",
)

# (-march, the branch it compiles (the module's SIMD), the CPU flags it needs to run, the
# kernel tests that run against it)
BRANCHES = [
    (
        "skylake-avx512",
        "avx512",
        {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"},
        KERNEL_TESTS,
    ),
    # AVX-512 with bf16 dot products (q5_0's bf16 path): the native build of a Zen 4; a
    # Xeon with AMX builds natively without them (attnlab.native.INTEGER_ROWS_FLAGS)
    (
        "cooperlake",
        "avx512-bf16",
        {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_bf16"},
        KERNEL_TESTS,
    ),
    ("x86-64-v3", "avx2", {"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"}, KERNEL_TESTS),
    # AVX2 with AVX-VNNI: only simd.h's block product reads __AVXVNNI__ (its vpdpwssd), in
    # q8_0.h and q5_0.h; the rest of this build is x86-64-v3's source, tested above
    (
        "alderlake",
        "avx2",
        {"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "avx_vnni"},
        ("test_native_q8.py", "test_native_q5.py"),
    ),
    ("x86-64", "scalar", set(), KERNEL_TESTS),
]

#: Which kernels of each branch sum integer products of 16-bit activation codes (the module's
#: Q4_INTEGER, Q5_INTEGER): q4 wherever there is AVX2, q5_0 where there are no bf16 dot
#: products as well.
INTEGER = {
    "avx512-bf16": (True, False),
    "avx512": (True, True),
    "avx2": (True, True),
    "scalar": (False, False),
}


def built_line(ext) -> str:
    """What a build says of itself: its branch and its integer kernels."""
    return f"SIMD={ext.SIMD} Q4_INTEGER={ext.Q4_INTEGER} Q5_INTEGER={ext.Q5_INTEGER}"


def expected_line(branch: str) -> str:
    q4, q5 = INTEGER[branch]
    return f"SIMD={branch} Q4_INTEGER={q4} Q5_INTEGER={q5}"


#: Set to 1 to build and test every branch outside CI too.
ALL_BRANCHES_ENV = "ATTNLAB_TEST_BRANCHES"


def branches_wanted() -> bool:
    """Whether this run builds the other branches: in CI, or when asked for."""
    ci = os.environ.get("CI", "").strip().lower()
    return ci not in ("", "0", "false", "no") or os.environ.get(ALL_BRANCHES_ENV) == "1"


def _cpu_flags() -> set[str]:
    line = native.cpu_flags()
    return set(line.split(":", 1)[-1].split())


def _env(march: str) -> dict[str, str]:
    env = dict(os.environ)
    env[native.MARCH_ENV] = march
    env[native.NATIVE_ENV] = "1"  # a build that fails is an error here, never a skip
    paths = [str(ROOT / "src"), str(ROOT / "tests"), *filter(None, [env.get("PYTHONPATH")])]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def check_branch(ext, march: str) -> None:
    """Build the ``march`` branch of :data:`BRANCHES` (unless this CPU cannot run it or it is
    the CPU's own build) and run its kernel tests against it, in a process of their own."""
    _, branch, needs, tests = next(b for b in BRANCHES if b[0] == march)
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the branches are x86's")
    missing = needs - _cpu_flags()
    if missing:
        pytest.skip(f"this CPU cannot run the {branch} branch (no {', '.join(sorted(missing))})")
    if getattr(ext, "SIMD", None) == branch:
        pytest.skip(f"the {branch} branch is this CPU's own build, tested by {KERNEL_TESTS}")
    if not branches_wanted():
        pytest.skip(
            f"the {branch} branch (-march={march}) is built and tested in CI, or with "
            f"{ALL_BRANCHES_ENV}=1 (tens of seconds a build)"
        )
    env = _env(march)
    # one process builds the branch, says which it built, then runs the kernel tests on it
    script = (
        "import sys, pytest\n"
        "from attnlab import native\n"
        "from native_branches import built_line\n"
        "print(built_line(native.extension()), flush=True)\n"
        "sys.exit(pytest.main(sys.argv[1:]))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script, "-q", "-n", "0", "-p", "no:cacheprovider",
         *(str(TESTS / name) for name in tests)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )  # fmt: skip
    built = run.stdout.splitlines()[:1]
    assert built == [expected_line(branch)], (march, run.stdout[-2000:], run.stderr[-2000:])
    tail = "\n".join(run.stdout.splitlines()[-30:])
    assert run.returncode == 0, f"-march={march} ({branch}):\n{tail}\n{run.stderr[-2000:]}"
    # the kernel tests ran on this build: none skipped for want of it (extras may be missing)
    assert " passed" in tail and "native build is unavailable" not in run.stdout, tail
