"""Runs the test suite again at every CPU kernel level below the best one this CPU supports
(FMHA_CPU_ISA=avx2, scalar, ...), so each SIMD translation unit is tested, not only the one
dispatch picks. Exits non-zero if any level fails. Used by the README's test command."""

import os
import subprocess
import sys

from fmha import _C

LEVELS = ["scalar", "avx2", "avx512", "avx512bf16"]


def main() -> int:
    best = _C.best_cpu_isa()
    lower = LEVELS[: LEVELS.index(best)]
    tests = os.path.dirname(os.path.abspath(__file__))
    failed = []
    for isa in reversed(lower):
        print(f"== test suite at FMHA_CPU_ISA={isa} (best on this CPU: {best})", flush=True)
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", tests] + sys.argv[1:],
                           env=dict(os.environ, FMHA_CPU_ISA=isa))
        if r.returncode != 0:
            failed.append(isa)
    if failed:
        print(f"FAILED at FMHA_CPU_ISA={', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
