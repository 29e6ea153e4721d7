"""Run inside the arm64 root filesystem before the tests: the interpreter is aarch64, the pinned
CPU model is the one in effect (numpy's runtime CPU dispatch sees its features, and no SVE), numba
compiles for no SVE and caches into the throwaway directory, no host-only package is there, and
the CLI (for `nicoffload profile --device dpu` on the DPU) starts without them.

    python tests/arm/probe.py [PYTEST ARGS...]

With arguments, pytest then runs with them in this interpreter: under emulation every start
(numpy, numba) costs seconds.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import subprocess
import sys

# Features that tell the models apart (Armv8.0 vs Armv8.2 with fp16 and dot product).
EXPECTED = {
    "cortex-a72": {"ASIMD": True, "ASIMDHP": False, "ASIMDDP": False, "SVE": False},
    "cortex-a76": {"ASIMD": True, "ASIMDHP": True, "ASIMDDP": True, "SVE": False},
}
HOST_ONLY = ("scipy", "huggingface_hub", "torch", "cupy")


def main() -> None:
    cpu = os.environ["QEMU_CPU"]
    assert platform.machine() == "aarch64", platform.machine()

    from numpy._core._multiarray_umath import __cpu_features__ as features

    seen = {k: bool(features.get(k)) for k in EXPECTED[cpu]}
    assert seen == EXPECTED[cpu], f"QEMU_CPU={cpu}: numpy sees {seen}, expected {EXPECTED[cpu]}"

    import llvmlite.binding as llvm
    import numba

    llvm_cpu = llvm.get_host_cpu_name()
    llvm_features = llvm.get_host_cpu_features().flatten()
    assert "+sve" not in llvm_features.split(","), f"numba would target SVE: {llvm_features}"
    cache = os.environ["NUMBA_CACHE_DIR"]
    assert cache.startswith("/tmp/") and cache == numba.config.CACHE_DIR, numba.config.CACHE_DIR
    assert cpu == numba.config.CPU_NAME, f"numba compiles for {numba.config.CPU_NAME}, not {cpu}"

    present = [m for m in HOST_ONLY if importlib.util.find_spec(m) is not None]
    assert not present, f"host-only packages in the DPU set: {present}"
    cli = subprocess.run(
        [sys.executable, "-m", "nicoffload", "profile", "--help"], capture_output=True, text=True
    )
    assert cli.returncode == 0 and "--device" in cli.stdout, cli.stderr

    print(
        json.dumps(
            {
                "qemu_cpu": cpu,
                "machine": platform.machine(),
                "python": platform.python_version(),
                "numpy_features": sorted(k for k, v in features.items() if v),
                "numba": numba.__version__,
                "llvm_host_cpu": llvm_cpu,
                "numba_cpu_name": numba.config.CPU_NAME,
                "numba_cache_dir": cache,
            }
        )
    )


if __name__ == "__main__":
    main()
    if len(sys.argv) > 1:
        import pytest

        sys.stdout.flush()
        sys.exit(pytest.main(sys.argv[1:]))
