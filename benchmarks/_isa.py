"""Making this machine behave like a CPU with fewer instructions, for the benchmarks.

Each setting caps what PyTorch's vectorised kernels (``ATEN_CPU_CAPABILITY``), oneDNN
(``ONEDNN_MAX_CPU_ISA``) and MKL (``MKL_ENABLE_INSTRUCTIONS``) may use, and builds
attnlab's compiled step for the matching ``-march`` (``ATTNLAB_NATIVE_MARCH``). They are
read when a process starts, so a benchmark runs each setting in a child process.

- ``native``: the machine as it is.
- ``avx512-core``: AVX-512 without VNNI, BF16 or AMX (Skylake-SP).
- ``avx2``: AVX2 and FMA alone (x86-64-v3: most laptops, Zen 2 and 3).
"""

from __future__ import annotations

import os

ISAS: dict[str, dict[str, str]] = {
    "native": {},
    "avx512-core": {
        "ATEN_CPU_CAPABILITY": "avx512",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
        "ATTNLAB_NATIVE_MARCH": "skylake-avx512",
    },
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "ATTNLAB_NATIVE_MARCH": "x86-64-v3",
    },
}


def isa_env(isa: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a child process that runs as CPU class ``isa`` would.

    Raises:
        SystemExit: an unknown ``isa``.
    """
    if isa not in ISAS:
        raise SystemExit(f"unknown --isa {isa!r}; choose from {', '.join(ISAS)}")
    env = dict(os.environ if base is None else base)
    for name in {k for v in ISAS.values() for k in v}:
        env.pop(name, None)
    env.update(ISAS[isa])
    if isa != "native":
        env["ATTNLAB_NATIVE"] = "1"  # build the branch now if it is not built yet
    return env
