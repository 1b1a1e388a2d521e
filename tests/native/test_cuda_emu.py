"""fmha's CUDA kernels without a GPU: the SIMT emulator (csrc/cuda/emu), its sanitizers and
the static checks of the kernels.

* Known-answer tests of every emulated primitive (tests/cuda_emu/kat_primitives.cu), each
  encoding the PTX ISA section named in KATS below; one pytest case per primitive.
* The emulator's own rules (barriers, warp collectives, shared memory, cp.async).
* The tensor-core GEMM (csrc/cuda/testing/gemm_tc.cuh: ldmatrix + mma.sync + cp.async double
  buffering) against NumPy for odd and even sizes -- through the Python module
  fmha._cuda_emu, and in the standalone programs under AddressSanitizer and the race checker.
* Planted bugs (tests/cuda_emu/planted_bugs.cu), each caught: (a) a wrong fragment index by
  the result check, (b) a missing __syncthreads by the race checker and by ThreadSanitizer,
  (c) out-of-bounds reads by AddressSanitizer.
* The Hopper model (tests/cuda_emu/hopper_*.cu): mbarrier, setmaxnreg, elect.sync, wgmma for
  every swizzle mode, TMA, and its planted bugs (a wrong swizzle, a missing wgmma.wait_group, a
  TMA destination read before its mbarrier phase, a missing fence.proxy.async or
  fence.mbarrier_init), its shared-memory traffic counters (wgmma operand reads, TMA tile
  copies: conflict-free through every swizzle; the core-matrix rule on a non-swizzled tile of
  128-byte rows: 8 wavefronts); the inline PTX
  of csrc/cuda/hopper.cuh assembled for sm_90a.
* Every kernel is built for sm_80 and sm_90 with no register spill and no stack frame: the
  shipped ones as the installed build's ptxas report says (fmha/_ptxas/), the test-only ones
  compiled here (tools/ptxas_check.py). Skipped only where nvcc is missing.

The standalone programs (tests/cuda_emu/CMakeLists.txt) are built once per session in a
temporary directory with cmake; FMHA_EMU_TEST_BUILD_DIR=<dir> reuses a build directory.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
EMU_TESTS = ROOT / "tests" / "cuda_emu"
sys.path.insert(0, str(ROOT / "tools"))
import ptxas_check  # noqa: E402

# Every known-answer test, and the PTX ISA 9.0 section (or rule) it encodes. The C++ cases
# print the same citations (`emu_selftest_plain list`); test_kat_list_is_complete checks
# the two agree, so a primitive cannot gain an emulation without a known-answer test here.
KATS = {
    "kat.mma_f16": "§9.7.14.5.8 Matrix Fragments for mma.m16n8k16 with floating point type; "
                   "§9.7.14.5.14 mma",
    "kat.mma_bf16": "§9.7.14.5.8 Matrix Fragments for mma.m16n8k16 with floating point type; "
                    "§9.7.14.5.14 mma",
    "kat.ldmatrix_x1": "§9.7.14.5.15 ldmatrix .x1",
    "kat.ldmatrix_x2": "§9.7.14.5.15 ldmatrix .x2",
    "kat.ldmatrix_x4": "§9.7.14.5.15 ldmatrix .x4",
    "kat.ldmatrix_x1_trans": "§9.7.14.5.15 ldmatrix .x1.trans",
    "kat.ldmatrix_x2_trans": "§9.7.14.5.15 ldmatrix .x2.trans",
    "kat.ldmatrix_x4_trans": "§9.7.14.5.15 ldmatrix .x4.trans",
    "kat.ldmatrix_mma_f16": "§9.7.14.5.15 ldmatrix feeding §9.7.14.5.14 mma",
    "kat.ldmatrix_mma_bf16": "§9.7.14.5.15 ldmatrix feeding §9.7.14.5.14 mma",
    "kat.shfl_idx": "§9.7.9.6 shfl.sync .idx",
    "kat.shfl_up": "§9.7.9.6 shfl.sync .up",
    "kat.shfl_down": "§9.7.9.6 shfl.sync .down",
    "kat.shfl_xor": "§9.7.9.6 shfl.sync .bfly",
    "kat.shfl_xor_reduce": "§9.7.9.6 shfl.sync .bfly on f32",
    "kat.ballot": "§9.7.13.9 vote.sync .ballot",
    "kat.syncthreads_or": "§9.7.13.1 bar.red.or.pred (__syncthreads_or)",
    "kat.cp_async": "§9.7.9.25.3.1-3 cp.async, commit_group, wait_group",
    "kat.cvt_f16": "§9.7.9.21 cvt .rn.f16.f32, .rn.f16x2.f32",
    "kat.cvt_bf16": "§9.7.9.21 cvt .rn.bf16.f32, .rn.bf16x2.f32",
    "kat.widen": "§9.7.9.21 cvt .f32.f16/.f32.bf16 (all 65536 encodings)",
    "kat.ex2": "§9.7.3.21 ex2.approx.ftz.f32",
    "kat.atomic_add": "§9.7.13.5 atom.add.f32",
}

SANITIZER_ENV = {
    # LeakSanitizer needs ptrace, which containers often forbid; leaks are not the point here.
    "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0",
    "TSAN_OPTIONS": "halt_on_error=0:second_deadlock_stack=1",
}


# ----------------------------------------------------------------------------- build


def _find_cmake() -> str | None:
    exe = shutil.which("cmake")
    if exe:
        return exe
    try:
        import cmake  # the PyPI distribution of cmake

        cand = Path(cmake.CMAKE_BIN_DIR) / "cmake"
        return str(cand) if cand.exists() else None
    except ImportError:
        return None


class Programs:
    """The four builds of emu_selftest: plain, asan, racecheck, tsan."""

    def __init__(self, build_dir: Path):
        self.dir = build_dir

    def run(self, variant: str, *patterns: str, timeout: float = 300) -> subprocess.CompletedProcess:
        exe = self.dir / f"emu_selftest_{variant}"
        env = dict(os.environ, **SANITIZER_ENV)
        cmd = [str(exe), "run", *patterns]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        if variant == "tsan" and "FATAL: ThreadSanitizer" in p.stderr and shutil.which("setarch"):
            # Older ThreadSanitizer runtimes cannot map their shadow under high-entropy ASLR
            # ("unexpected memory mapping"); without address randomisation they can.
            p = subprocess.run(["setarch", os.uname().machine, "-R", *cmd], capture_output=True,
                               text=True, timeout=timeout, env=env)
        return p

    def list(self) -> dict[str, str]:
        out = subprocess.run([str(self.dir / "emu_selftest_plain"), "list"], capture_output=True,
                             text=True, check=True).stdout
        return dict(line.split("\t", 1) for line in out.splitlines() if line)


@pytest.fixture(scope="session")
def programs(tmp_path_factory) -> Programs:
    cmake = _find_cmake()
    if cmake is None:
        pytest.skip("cmake not found: cannot build the emulator test programs")
    build = os.environ.get("FMHA_EMU_TEST_BUILD_DIR")
    build_dir = Path(build) if build else tmp_path_factory.mktemp("cuda_emu_build")
    for cmd in ([cmake, "-S", str(EMU_TESTS), "-B", str(build_dir)],
                [cmake, "--build", str(build_dir), "-j", str(max(2, os.cpu_count() or 2))]):
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            pytest.fail(f"{' '.join(cmd)} failed:\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}")
    return Programs(build_dir)


def _results(proc: subprocess.CompletedProcess) -> dict[str, tuple[bool, str]]:
    res = {}
    for line in proc.stdout.splitlines():
        m = re.match(r"(PASS|FAIL) (\S+?)(?:: (.*))?$", line)
        if m:
            res[m.group(2)] = (m.group(1) == "PASS", m.group(3) or "")
    return res


def _assert_all_pass(proc: subprocess.CompletedProcess, expect_at_least: int = 1):
    res = _results(proc)
    failed = {k: v[1] for k, v in res.items() if not v[0]}
    assert not failed, "failing cases:\n" + "\n".join(f"  {k}: {v}" for k, v in failed.items()) \
        + "\n" + proc.stderr[-3000:]
    assert len(res) >= expect_at_least, proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return res


# ----------------------------------------------------------------------------- known answers


def test_kat_list_is_complete(programs):
    listed = {k: v for k, v in programs.list().items() if k.startswith("kat.")}
    assert set(listed) == set(KATS)
    for name, cites in listed.items():
        assert "PTX ISA 9.0 §" in cites, f"{name} does not cite its PTX ISA section: {cites}"
        for section in re.findall(r"§[\d.]+", KATS[name]):
            assert section.rstrip(".") in cites, f"{name}: {section} not cited in the C++ case"


@pytest.mark.parametrize("name", sorted(KATS), ids=lambda n: n[4:])
def test_kat(programs, name):
    """The known answer for one primitive (the PTX ISA section: KATS[name])."""
    proc = programs.run("plain", name)
    _assert_all_pass(proc)


# ----------------------------------------------------------------------------- the emulator


def test_emulator_rules(programs):
    """Execution model, and CUDA rule violations reported as errors (not hangs)."""
    res = _assert_all_pass(programs.run("plain", "emu.*"), expect_at_least=17)
    assert {"emu.deadlock", "emu.divergent_syncthreads", "emu.exit_before_syncthreads",
            "emu.collective_inactive_lanes", "emu.cp_async_deferred", "emu.traffic_ldmatrix",
            "emu.traffic_cp_async", "emu.exit_completes_syncwarp",
            "emu.vote_reads_own_chunks"} <= set(res)


# ----------------------------------------------------------------------------- sanitizers


@pytest.mark.parametrize("variant", ["plain", "asan", "racecheck"])
def test_gemm_standalone(programs, variant):
    """The GEMM for even and odd sizes; in bounds (ASan) and race-free (racecheck)."""
    proc = programs.run(variant, "gemm.*")
    res = _assert_all_pass(proc, expect_at_least=10)
    assert "AddressSanitizer" not in proc.stderr
    assert any("cp.async path" in d for _, d in res.values())
    assert any("element path" in d for _, d in res.values())


@pytest.mark.parametrize("variant", ["asan", "racecheck"])
def test_sanitized_clean(programs, variant):
    """Every correct kernel (KATs, emulator checks, fixed planted kernels) is clean."""
    proc = programs.run(variant, "kat.*", "emu.*", "planted.*.fixed")
    _assert_all_pass(proc, expect_at_least=len(KATS) + 14 + 5)
    assert "ERROR: AddressSanitizer" not in proc.stderr


@pytest.mark.parametrize("variant", ["asan", "racecheck"])
def test_flash_forward_clean_under_sanitizers(programs, variant):
    """The FlashAttention-2 forward kernel (csrc/cuda/flash_fwd.cuh) against a float64
    reference, with no out-of-bounds access (ASan) and no shared-memory race (race checker)."""
    proc = programs.run(variant, "flash.*")
    _assert_all_pass(proc, expect_at_least=4)
    assert "ERROR: AddressSanitizer" not in proc.stderr


@pytest.mark.parametrize("variant", ["asan", "racecheck"])
def test_flash_backward_clean_under_sanitizers(programs, variant):
    """The FlashAttention-2 backward kernels (csrc/cuda/flash_bwd.cuh: atomic and deterministic
    dQ, varlen, d = 256 column splits) against a float64 reference, with no out-of-bounds
    access (ASan) and no shared-memory race (race checker)."""
    proc = programs.run(variant, "flash_bwd.*")
    _assert_all_pass(proc, expect_at_least=4)
    assert "ERROR: AddressSanitizer" not in proc.stderr


@pytest.mark.parametrize("variant", ["asan", "racecheck"])
def test_decode_clean_under_sanitizers(programs, variant):
    """The CUDA decode over KV caches (csrc/cuda/flash_decode.cuh: paged reads, splits and
    their merge, 12 rows in two row blocks, a refused call) against a float64 reference,
    with no out-of-bounds access on exactly sized pools (ASan) and no shared-memory race
    (race checker)."""
    proc = programs.run(variant, "decode.*")
    _assert_all_pass(proc, expect_at_least=4)
    assert "ERROR: AddressSanitizer" not in proc.stderr


def test_tsan_clean(programs):
    """ThreadSanitizer finds no race in the emulator runtime nor in correct kernels."""
    proc = programs.run("tsan", "kat.*", "gemm.f16.64x64x64", "gemm.bf16.17x33x29",
                        "planted.race.fixed", "planted.race_pipeline.fixed", "hopper.*")
    _assert_all_pass(proc, expect_at_least=len(KATS) + 4 + 37)
    assert "ThreadSanitizer" not in proc.stderr, proc.stderr[-4000:]


# ----------------------------------------------------------------------------- planted bugs


def test_planted_fragment_index_is_caught(programs):
    """(a) A-fragment registers a1/a2 swapped: the emulated mma gives a wrong product."""
    bad = programs.run("plain", "planted.fragment.buggy")
    assert bad.returncode == 1
    ok, detail = _results(bad)["planted.fragment.buggy"]
    assert not ok and "mismatch" in detail
    _assert_all_pass(programs.run("plain", "planted.fragment.fixed"))


def test_planted_missing_syncthreads_is_caught_by_racecheck(programs):
    """(b) No __syncthreads between a shared-memory write and another thread's read."""
    bad = programs.run("racecheck", "planted.race.buggy")
    assert bad.returncode == 1
    ok, detail = _results(bad)["planted.race.buggy"]
    assert not ok
    assert "racecheck: memory hazards" in bad.stdout
    assert re.search(r"(read-after-write|write-after-read) hazard", bad.stdout)
    # both accesses are located: the staging store and the neighbour's load
    assert re.search(r"planted_bugs\.cu:\d+ \(rotate_kernel<false>\)", bad.stdout)
    _assert_all_pass(programs.run("racecheck", "planted.race.fixed"))


def test_planted_pipeline_race_is_caught_by_racecheck(programs):
    """(b) cp.async double buffering without the barrier guarding the stage being read."""
    bad = programs.run("racecheck", "planted.race_pipeline.buggy")
    assert bad.returncode == 1
    assert "racecheck: memory hazards" in bad.stdout and "dynamic shared memory" in bad.stdout
    assert "cp_async_16" in bad.stdout  # the hazard is the prefetch's write
    _assert_all_pass(programs.run("racecheck", "planted.race_pipeline.fixed"))


def test_planted_missing_syncthreads_is_caught_by_tsan(programs):
    """(b) The same bug under ThreadSanitizer (one OS thread per CUDA thread)."""
    bad = programs.run("tsan", "planted.race.buggy")
    assert "WARNING: ThreadSanitizer: data race" in bad.stderr, bad.stderr[-3000:]
    assert "rotate_kernel<false>" in bad.stderr
    assert bad.returncode != 0
    fixed = programs.run("tsan", "planted.race.fixed")
    assert "ThreadSanitizer" not in fixed.stderr and fixed.returncode == 0


@pytest.mark.parametrize("case,kernel", [("global", "stencil_kernel<true>"),
                                         ("shared", "smem_shift_kernel<true>")])
def test_planted_out_of_bounds_read_is_caught_by_asan(programs, case, kernel):
    """(c) A read one element past a global buffer / a dynamic shared-memory tile."""
    bad = programs.run("asan", f"planted.oob.{case}.buggy")
    assert "ERROR: AddressSanitizer: heap-buffer-overflow" in bad.stderr, bad.stderr[-3000:]
    assert "READ of size 4" in bad.stderr
    assert kernel in bad.stderr and "planted_bugs.cu" in bad.stderr
    assert bad.returncode != 0
    _assert_all_pass(programs.run("asan", f"planted.oob.{case}.fixed"))


# ----------------------------------------------------------------------------- Hopper (sm_90a)
# The emulator's model of Hopper's asynchronous machinery (csrc/cuda/hopper.cuh on top of
# csrc/cuda/emu/hopper_emu.h; what it does not model: csrc/cuda/emu/README.md, "Hopper").

HOPPER_SWIZZLES = ("none", "sw32", "sw64", "sw128")


@pytest.mark.parametrize("variant", ["plain", "asan", "racecheck"])
def test_hopper_model(programs, variant):
    """tests/cuda_emu/hopper_*.cu: mbarrier phase logic (arrivals, tx-count, parity waits,
    over-arrival, deadlock), setmaxnreg budgets, elect.sync; wgmma GEMMs for every swizzle mode
    and both majors (f16/bf16/e4m3/e5m2, A from shared memory or registers) against host loops;
    TMA tiles with out-of-bounds edges, a store, and a pipelined TMA -> wgmma GEMM -- in bounds
    (ASan) and free of races, async-proxy and proxy-fence hazards (race checker)."""
    proc = programs.run(variant, "hopper.*")
    res = _assert_all_pass(proc, expect_at_least=37)
    assert "ERROR: AddressSanitizer" not in proc.stderr
    for swizzle in HOPPER_SWIZZLES:
        assert any(n.startswith("hopper.wgmma.") and n.endswith(swizzle) for n in res), swizzle
        assert f"hopper.tma.load2d.{swizzle}" in res
    assert {"hopper.mbarrier.phases", "hopper.mbarrier.over_arrival", "hopper.mbarrier.deadlock",
            "hopper.setmaxnreg.budget", "hopper.tma_wgmma.nmajor.sw128", "hopper.tma.load5d",
            "hopper.cvt.e4m3x2", "hopper.cvt.e5m2x2", "hopper.traffic.core_matrix"} <= set(res)


@pytest.mark.parametrize("bug", ["wgmma_swizzle", "wgmma_wait", "wgmma_operand"])
def test_planted_hopper_bug_gives_a_wrong_result(programs, bug):
    """A wrong swizzle in a wgmma descriptor, accumulators read before wgmma.wait_group (the
    emulator leaves NaN in in-flight accumulators), a wgmma operand rewritten before the wait
    (the product is computed at the wait): each gives a wrong GEMM; the fixed kernel passes."""
    bad = programs.run("plain", f"planted.{bug}.buggy")
    assert bad.returncode == 1
    ok, detail = _results(bad)[f"planted.{bug}.buggy"]
    assert not ok and "mismatch" in detail
    if bug == "wgmma_wait":
        assert "nan" in detail
    _assert_all_pass(programs.run("plain", f"planted.{bug}.fixed"))


@pytest.mark.parametrize("bug,words", [
    ("tma_wait", ["async-proxy hazard", "a TMA destination", "before it has seen phase 0"]),
    ("proxy_fence", ["proxy hazard", "wgmma.mma_async operand", "no fence.proxy.async"]),
    ("tma_store_fence", ["proxy hazard", "cp.async.bulk.tensor store", "no fence.proxy.async"]),
    ("wgmma_operand", ["racecheck: memory hazards", "wgmma_ss"]),
    ("mbarrier_init_fence", ["async-proxy hazard", "cp.async.bulk.tensor", "no fence.mbarrier_init"]),
    ("mbarrier_init_sync", ["async-proxy hazard", "cp.async.bulk.tensor", "fence.mbarrier_init",
                            "no __syncthreads"]),
])
def test_planted_hopper_hazard_is_caught_by_racecheck(programs, bug, words):
    """Reading a TMA destination before its mbarrier phase completes, generic shared-memory
    writes read by the async proxy (wgmma, TMA store) without fence.proxy.async, a wgmma
    operand rewritten while the wgmma is in flight, and mbarriers completed by TMA without
    fence.mbarrier_init after their init (or without a __syncthreads after that fence): the
    race checker reports each."""
    bad = programs.run("racecheck", f"planted.{bug}.buggy")
    assert bad.returncode == 1
    for w in words:
        assert w in bad.stdout, (w, bad.stdout[-3000:])
    _assert_all_pass(programs.run("racecheck", f"planted.{bug}.fixed"))


# ----------------------------------------------------------------------------- nvcc / ptxas


@pytest.fixture(scope="module")
def nvcc():
    exe = ptxas_check.find_nvcc()
    if exe is None:
        pytest.skip("nvcc not found: the sm_80/sm_90 compile and ptxas checks need the CUDA toolkit")
    return exe


def _built_kernel_reports() -> dict[str, str]:
    """ptxas's report of every object of the installed CUDA build (CMakeLists.txt keeps them
    through cmake/ptxas_report.sh and installs them as fmha/_ptxas/<object>.txt), by source
    file name; empty when fmha was built without CUDA."""
    from fmha import _C
    reports = Path(_C.__file__).parent / "_ptxas"
    if not _C.cuda_built() or not reports.is_dir():
        return {}
    return {f.name[: -len(".o.txt")]: f.read_text() for f in sorted(reports.glob("*.o.txt"))}


def _assert_clean(kernels):
    bad = [k for k in kernels if not k.clean]
    assert not bad, "\n".join(f"{k.arch} {k.name}: stack {k.stack}, spills {k.spill_stores}/"
                              f"{k.spill_loads}, wgmma serialised {k.wgmma_serialized}"
                              for k in bad)


def test_ptxas_no_spills_or_stack(nvcc):
    """Every shipped kernel -- csrc/cuda/*.cu and every generated instantiation of the
    FlashAttention-2 forward and backward -- is built for sm_80 and sm_90 without spills or a
    stack frame. Checked on the installed build's own ptxas report (each instantiation file of
    the built head-dim tiles must have one), so the kernels are not compiled twice; a build
    without CUDA compiles them here instead (tools/ptxas_check.py)."""
    cuda = ROOT / "csrc" / "cuda"
    shipped = sorted(cuda.glob("*.cu")) + sorted((cuda / "instantiations").glob("*.cu"))
    assert sum("instantiations" in str(f) for f in shipped) >= 40, \
        "the forward and backward instantiation files"
    reports = _built_kernel_reports()
    if reports:
        # The built tiles: every instantiation file of a head dim that has one report.
        tile = lambda name: re.search(r"_hdim(\d+)_", name)  # noqa: E731
        built = {tile(n).group(1) for n in reports if tile(n)}
        missing = [f.name for f in shipped if f.name not in reports
                   and (not tile(f.name) or tile(f.name).group(1) in built)]
        assert not missing, f"no ptxas report in the build for {missing}"
        kernels = [k for name, text in reports.items() for k in ptxas_check.parse(text, name)]
    else:
        kernels, errors = ptxas_check.check(shipped, ["80", "90"], nvcc)
        assert not errors, "\n".join(errors)
    names = " ".join(k.name for k in kernels)
    for kernel in ("flash_fwd_kernel", "flash_fwd_combine", "flash_decode_kernel",
                   "kvcache_check_kernel", "kvcache_append_kernel", "flash_bwd_kernel",
                   "flash_bwd_dq_kernel", "flash_bwd_dot_do_o", "flash_bwd_convert_dq",
                   "flash_bwd_dbias_kernel"):
        assert kernel in names, kernel
    for arch in ("sm_80", "sm_90"):
        assert sum(k.arch == arch for k in kernels) >= 10
    _assert_clean(kernels)


def test_ptxas_test_kernels(nvcc):
    """The test-only kernels, which only the emulator module runs -- the tensor-core GEMM of
    csrc/cuda/testing/ and the known-answer kernels, so that every inline-PTX wrapper is
    assembled by ptxas -- compile for sm_80 and sm_90 without spills or a stack frame."""
    sources = sorted((ROOT / "csrc" / "cuda" / "testing").glob("*.cu")) + [
        EMU_TESTS / "kat_primitives.cu"]
    kernels, errors = ptxas_check.check(sources, ["80", "90"], nvcc)
    assert not errors, "\n".join(errors)
    names = " ".join(k.name for k in kernels)
    assert "gemm_tc_kernel" in names and "mma_kat_kernel" in names
    _assert_clean(kernels)


def test_wgmma_asm_operand_lists_are_generated():
    """csrc/cuda/hopper_wgmma_asm.inc is what tools/generate_wgmma_asm.py writes."""
    import generate_wgmma_asm
    assert generate_wgmma_asm.main(["--check"]) == 0, "run python tools/generate_wgmma_asm.py"


def test_hopper_wrappers_assemble_for_sm90a(nvcc):
    """Every inline-PTX form of csrc/cuda/hopper.cuh (mbarrier, wgmma for f16/bf16/e4m3/e5m2
    from shared memory and registers, TMA loads and stores of rank 1-5, setmaxnreg, elect.sync,
    fence.proxy.async, cvt to e4m3x2/e5m2x2) is assembled by ptxas for sm_90a (tests/cuda_emu/hopper_compile_check.cu),
    without spills or a stack frame."""
    kernels, errors = ptxas_check.check([EMU_TESTS / "hopper_compile_check.cu"], ["90a"], nvcc)
    assert not errors, "\n".join(errors)
    names = " ".join(k.name for k in kernels)
    for kernel in ("mbarrier_kernel", "tma_kernel", "setmaxnreg_kernel", "fp8_kernel"):
        assert kernel in names, kernel
    assert sum("wgmma_kernel" in k.name for k in kernels) == 8
    assert all(k.arch == "sm_90a" for k in kernels)
    _assert_clean(kernels)


def test_ptxas_check_catches_a_stack_frame(nvcc):
    """The check fails on a kernel that needs local memory (planted_stack_frame.cu)."""
    kernels, errors = ptxas_check.check([EMU_TESTS / "planted_stack_frame.cu"], ["80", "90"], nvcc)
    assert not errors
    assert len(kernels) == 2 and all(k.stack > 0 for k in kernels)
    assert ptxas_check.main([str(EMU_TESTS / "planted_stack_frame.cu")]) == 1


# ptxas's serialisation warnings (nvcc 13.0), each ahead of the kernel's entry line: a runtime
# wait depth (C7514), the rare block's plain product writing O between wgmma (C7515), a
# warpgroup.arrive on a divergent path (C7520). C7519 (a warpgroup.arrive inserted, nothing
# serialised) must not fail the check.
SERIALISED = {
    "C7514": "non wgmma instructions reading accumulator registers of  a wgmma between start and "
             "end of the pipeline stage",
    "C7515": "non wgmma instructions defining accumulator registers of a wgmma between start and "
             "end of the pipeline stage",
    "C7520": "program dependence on compiler-inserted WG.AR in divergent path",
}


@pytest.mark.parametrize("code", sorted(SERIALISED))
def test_ptxas_check_catches_serialised_wgmma(code):
    """A kernel whose wgmma ptxas serialised (printed ahead of the kernel's entry line: its
    overlap never happens on the GPU) fails the check; only that kernel, only for the arch the
    warning was printed for."""
    name = "_ZN4fmha3gpu21flash_fwd_sm90_kernelI6__halfNS0_18FlashFwdSm90ConfigILi64EEELb0EEEv"
    other = "_ZN4fmha3gpu24flash_fwd_combine_kernelI6__halfLi64EEEvNS_9FwdParamsE"

    def entry(kernel, arch, regs):
        return (f"ptxas info    : Compiling entry function '{kernel}' for '{arch}'\n"
                f"ptxas info    : Function properties for {kernel}\n"
                "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
                f"ptxas info    : Used {regs} registers, used 1 barriers\n")

    injected = (f"ptxas info    : (C7519) warpgroup.arrive is injected in around line 2972 by "
                f"compiler to allow use of registers in GMMA in function '{name}'\n")
    report = (entry(name, "sm_90", 40)
              + injected
              + f"ptxas info    : ({code}) Potential Performance Loss: wgmma.mma_async instructions "
                f"are serialized due to {SERIALISED[code]} in the function '{name}'\n"
              + entry(other, "sm_90a", 32) + entry(name, "sm_90a", 168))
    kernels = ptxas_check.parse(report, "planted.cu")
    assert [(k.arch, k.name == name, k.wgmma_serialized) for k in kernels] == [
        ("sm_90", True, False), ("sm_90a", False, False), ("sm_90a", True, True)]
    assert [k.clean for k in kernels] == [True, True, False]
    assert kernels[2].serialized_by == code
    # Without the warning (C7519 alone), the same report is clean.
    clean = ptxas_check.parse(injected + entry(name, "sm_90a", 168), "planted.cu")
    assert len(clean) == 1 and clean[0].clean


# ----------------------------------------------------------------------------- fmha._cuda_emu


@pytest.fixture(scope="module")
def emu():
    try:
        from fmha import _cuda_emu
    except ImportError as e:
        pytest.skip(f"fmha._cuda_emu not built (FMHA_BUILD_TESTING=ON builds it): {e}")
    return _cuda_emu


def _inputs(rng, m, n, k, dtype):
    import torch

    a = torch.from_numpy(rng.standard_normal((m, k))).to(getattr(torch, dtype))
    b = torch.from_numpy(rng.standard_normal((k, n))).to(getattr(torch, dtype))
    return a, b


def _check_gemm(c, a64, b64):
    """f32 accumulation of exact products: |c - ref| <= 4 (k + 2) 2^-24 (|a| @ |b|)."""
    ref = a64 @ b64
    bound = 4.0 * (a64.shape[1] + 2) * 2.0 ** -24 * (np.abs(a64) @ np.abs(b64))
    assert c.dtype == np.float32 and c.shape == ref.shape
    err = np.abs(c - ref)
    assert np.all(err <= bound + 1e-30), f"max error {err.max():.3g}, bound {bound.max():.3g}"


@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (17, 33, 29), (64, 64, 64), (70, 72, 40),
                                   (113, 59, 111), (128, 128, 96)])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_module_gemm_matches_numpy(emu, rng, m, n, k, dtype):
    a, b = _inputs(rng, m, n, k, dtype)
    c = emu.gemm(a, b)
    _check_gemm(c, a.double().numpy(), b.double().numpy())


def test_module_gemm_numpy_float16_and_strides(emu, rng):
    """NumPy arrays in, and row strides that are not the row length (misaligned rows)."""
    a = rng.standard_normal((40, 70)).astype(np.float16)
    b = rng.standard_normal((50, 33)).astype(np.float16)
    c = emu.gemm(a[:, 3:53], b[:, :30])  # views: row strides 70 and 33 elements
    _check_gemm(c, a[:, 3:53].astype(np.float64), b[:, :30].astype(np.float64))


def test_module_gemm_uses_the_pipeline(emu, rng):
    """The GEMM really runs ldmatrix + mma.sync + double-buffered cp.async (counted)."""
    a, b = _inputs(rng, 64, 64, 96, "float16")
    emu.reset_stats()
    emu.gemm(a, b)
    s = emu.stats()
    assert s["blocks"] == 1 and s["threads"] == 128
    assert s["mma"] == 4 * 3 * 2 * 8 * 32  # warps x k tiles x k16 steps x tiles x lanes
    assert s["ldmatrix"] == 4 * 3 * 2 * 4 * 32
    assert s["cp_async"] == 3 * 512 and s["max_cp_async_groups_pending"] == 2


def test_module_gemm_errors(emu):
    import torch

    with pytest.raises(ValueError, match="float16 or bfloat16"):
        emu.gemm(np.zeros((4, 4), np.float32), np.zeros((4, 4), np.float32))
    with pytest.raises(ValueError, match="rows"):
        emu.gemm(torch.zeros(4, 5, dtype=torch.float16), torch.zeros(4, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="differs"):
        emu.gemm(torch.zeros(4, 4, dtype=torch.float16), torch.zeros(4, 4, dtype=torch.bfloat16))
    with pytest.raises(TypeError):
        emu.gemm([[1.0]], [[1.0]])


def _float_sample() -> np.ndarray:
    """~4.2M float32 bit patterns spread over all 2^32, plus every boundary neighbourhood."""
    bits = np.arange(0, 2**32, 1021, dtype=np.uint64).astype(np.uint32)
    edges = np.array([0x00000000, 0x33000000, 0x33800000, 0x387FE000, 0x38800000, 0x3F801000,
                      0x477FE000, 0x477FF000, 0x7F7F8000, 0x7F7FFFFF, 0x7F800000, 0x3F808000],
                     np.int64)
    near = (edges[:, None] + np.arange(-300, 301)[None, :]).ravel()
    near = near[(near >= 0) & (near < 2**31)].astype(np.uint32)
    bits = np.concatenate([bits, near, near | np.uint32(0x80000000)])
    return bits.view(np.float32)


def test_module_float_to_half_matches_numpy(emu):
    """cvt.rn.f16.f32 as the kernels do it == NumPy's float16 cast (IEEE round to nearest
    even) on a sample of all floats; NaN -> 0x7FFF (PTX ISA 9.0 §9.7.9.21)."""
    x = _float_sample()
    got = emu.float_to_half_bits(x)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    nan = np.isnan(x)
    assert np.array_equal(got[~nan], want[~nan])
    assert np.all(got[nan] == 0x7FFF)


def test_module_float_to_bfloat16_matches_torch(emu):
    """cvt.rn.bf16.f32 as the kernels do it == torch's bfloat16 cast (round to nearest even)."""
    import torch

    x = _float_sample()
    got = emu.float_to_bfloat16_bits(x)
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(x)
    assert np.array_equal(got[~nan], want[~nan])
    assert np.all(got[nan] == 0x7FFF)
