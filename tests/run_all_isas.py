"""Runs the test suite again at every CPU kernel level below the best one this CPU supports
(FMHA_CPU_ISA=avx2, scalar, ...), so each SIMD translation unit is tested, not only the one
dispatch picks. Exits non-zero if any level fails. Used by the README's test command.

The CUDA-emulator suites are left out here: they run the CUDA kernels, not the CPU ones, so
the CPU level cannot change them (they run once, in the main pass)."""

import os
import subprocess
import sys

from fmha import _C

LEVELS = ["scalar", "avx2", "avx512", "avx512bf16"]
CUDA_EMULATOR_SUITES = ["test_cuda_emu.py", "test_cuda_forward_emu.py", "test_cuda_emu_cases.py"]


def main() -> int:
    best = _C.best_cpu_isa()
    lower = LEVELS[: LEVELS.index(best)]
    tests = os.path.dirname(os.path.abspath(__file__))
    failed = []
    for isa in reversed(lower):
        print(f"== test suite at FMHA_CPU_ISA={isa} (best on this CPU: {best})", flush=True)
        skip = [f"--ignore={os.path.join(tests, name)}" for name in CUDA_EMULATOR_SUITES]
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", tests] + skip + sys.argv[1:],
                           env=dict(os.environ, FMHA_CPU_ISA=isa))
        if r.returncode != 0:
            failed.append(isa)
    if failed:
        print(f"FAILED at FMHA_CPU_ISA={', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
