"""Runs the test suite again at every CPU kernel level below the best one this CPU supports
(FMHA_CPU_ISA=avx2, scalar, ...), so each SIMD translation unit is tested, not only the one
dispatch picks. Exits non-zero if any level fails. Used by the README's test command.

The amx level runs too where the best level is avx512bf16: its tiles then go through the AMX
model (csrc/cpu/amx_model.h), so the level's kernels are tested on every host with AVX512-BF16.
On an AMX host the best level is amx, on the hardware tiles: the main pass.

Lower levels run the suites that exercise the CPU kernels directly (KERNEL_SUITES: every
feature, dtype, shape class and gradient of the kernels, and the CPU fuzz); the integration
suites above them (nn, sdpa, transformers, the example, errors, the reference itself), the
CUDA-emulator suites and the build checks do not depend on the CPU level and run once, in the
main pass."""

import os
import subprocess
import sys
import tempfile

from fmha import _C

LEVELS = ["scalar", "avx2", "avx512", "avx512bf16", "amx"]
# (api/test_memory.py runs once, in the main pass: the O(n) memory it checks is the shared
# driver's tiling, the same at every level, and at the scalar level it took 90 s of CI.)
KERNEL_SUITES = ["kernels/test_cpu_attention.py", "kernels/test_core.py", "api/test_torch_ops.py",
                 # the CPU half of the differential fuzz (the CUDA half does not depend on the
                 # CPU level); ~10 s per level at 40 examples each
                 "kernels/test_fuzz.py::test_fuzz_cpu", "kernels/test_fuzz.py::test_fuzz_cpu_varlen",
                 "kernels/test_fuzz.py::test_fuzz_cpu_nonfinite", "kernels/test_nonfinite.py::test_nonfinite_cpu",
                 # the decode kernel (KV caches): each level has its own products; ~4 s
                 "kvcache/test_kvcache.py",
                 # 8-bit caches: each level has its own conversion of the codes; ~2 s
                 "kvcache/test_kvquant.py",
                 # float8 inputs: widened by the same conversion, then the float32 kernels
                 "kernels/test_fp8.py"]


def main() -> int:
    best = _C.best_cpu_isa()
    lower = LEVELS[: LEVELS.index(best)]
    if best == "avx512bf16":  # the amx level is built wherever avx512bf16 is: through the model
        lower.append("amx")
    tests = os.path.dirname(os.path.abspath(__file__))
    # The levels run at the same time, each in its own process with its output in a file,
    # printed in order when all have finished: each pass is partly Python on one core, so
    # together they take about two thirds of the time one after the other (2-core VM).
    runs = []
    for isa in reversed(lower):
        suites = [os.path.join(tests, name) for name in KERNEL_SUITES]
        # The fuzz draws fewer examples per lower level (the main pass draws the full count):
        # the levels share every line above the SIMD mapping, so a few dozen configurations
        # per level catch a level-specific fault; FMHA_FUZZ_EXAMPLES, if set, still rules.
        env = dict(os.environ, FMHA_CPU_ISA=isa)
        env.setdefault("FMHA_FUZZ_EXAMPLES", "40")
        # torch.compile's tests check the op registration, which no level changes: the
        # main pass runs them (~5 s a level). No cache plugin: the processes would share it.
        log = tempfile.TemporaryFile(mode="w+")
        proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
                                + suites + ["-k", "not compile"] + sys.argv[1:], env=env,
                                stdout=log, stderr=subprocess.STDOUT, text=True)
        runs.append((isa, proc, log))
    failed = []
    for isa, proc, log in runs:
        code = proc.wait()
        log.seek(0)
        how = " (AMX tiles through the software model)" if isa == "amx" and isa != best else ""
        print(f"== test suite at FMHA_CPU_ISA={isa}{how} (best on this CPU: {best})", flush=True)
        print(log.read(), end="", flush=True)
        if code != 0:
            failed.append(isa)
    if failed:
        print(f"FAILED at FMHA_CPU_ISA={', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
