#!/usr/bin/env python3
"""Compile fmha's CUDA sources with nvcc for each target architecture and read ptxas's
resource report (-Xptxas -v): every kernel must compile, and no kernel may spill registers
or use a local-memory stack frame (both turn register tiles into slow memory traffic), nor have
its wgmma serialised by ptxas (a "wgmma.mma_async instructions are serialized" warning,
C7514, C7515, C7520, ...: the asynchronous GEMMs then overlap nothing).

    python tools/ptxas_check.py                 # every CUDA source (default_sources), sm_80 + sm_90
    python tools/ptxas_check.py --arch 90 csrc/cuda/testing/gemm_tc.cu
    python tools/ptxas_check.py -j 4            # compile 4 files at once (default 2)

It prints one row per (kernel, arch) and then a register table: one row per kernel, one
column per arch.

Exit status: 0 clean, 1 a kernel spills / has a stack frame / has serialised wgmma / a file
does not compile,
2 nvcc not found. tests/native/test_cuda_emu.py runs it (and skips it where there is no nvcc).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ARCHS = ("80", "90")

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\d+a?)'")
_PROPS = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
# ptxas serialises a kernel's wgmma when it cannot prove the asynchronous pipeline safe: the
# accumulators other instructions read not retired by a wgmma.wait_group (C7514), other
# instructions defining them inside a pipeline stage (C7515), a warpgroup.arrive it had to put
# on a divergent path (C7520), ... -- each a "Potential Performance Loss: wgmma.mma_async
# instructions are serialized" with its own code. (C7519, a warpgroup.arrive inserted without
# serialising, is not one.) The report names the function ahead of its entry line: the flag
# goes to that function's next entry, i.e. the arch it was said for.
_SERIALIZED = re.compile(r"\((C7\d+)\) Potential Performance Loss: wgmma\.mma_async instructions "
                         r"are serialized.*in the function '([^']+)'")


@dataclass
class Kernel:
    file: str
    arch: str
    name: str  # mangled
    registers: int = -1
    stack: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    wgmma_serialized: bool = False
    serialized_by: str = ""  # ptxas's warning code(s), e.g. "C7514"

    @property
    def clean(self) -> bool:
        return (self.stack == 0 and self.spill_stores == 0 and self.spill_loads == 0
                and not self.wgmma_serialized)


def find_nvcc() -> str | None:
    for cand in (os.environ.get("CUDACXX"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return cand
    return None


def parse(report: str, file: str) -> list[Kernel]:
    """Kernels (entry functions) of one ptxas -v report, in order."""
    kernels: list[Kernel] = []
    current: Kernel | None = None
    props_for: str | None = None
    serialized: dict[str, list[str]] = {}  # named by a serialisation warning, entry not yet seen
    for line in report.splitlines():
        m = _SERIALIZED.search(line)
        if m:
            serialized.setdefault(m.group(2), []).append(m.group(1))
            continue
        m = _ENTRY.search(line)
        if m:
            codes = serialized.pop(m.group(1), [])
            current = Kernel(file, m.group(2), m.group(1), wgmma_serialized=bool(codes),
                             serialized_by=", ".join(codes))
            kernels.append(current)
            props_for = None
            continue
        m = _PROPS.search(line)
        if m:
            props_for = m.group(1)
            continue
        m = _FRAME.search(line)
        if m and current is not None and props_for == current.name:
            current.stack, current.spill_stores, current.spill_loads = map(int, m.groups())
            continue
        m = _USED.search(line)
        if m and current is not None and current.registers < 0:
            current.registers = int(m.group(1))
    return kernels


def source_archs(source: Path, archs: list[str]) -> list[str]:
    """The archs a source is compiled for: the Hopper forward's files (flash_fwd_sm90*) also
    for the arch-specific sm_90a where 90 is asked for, as the build does (CMakeLists.txt)."""
    if "flash_fwd_sm90" in source.name and "90" in archs and "90a" not in archs:
        return archs + ["90a"]
    return archs


# The Hopper forward's warpgroup register budgets (setmaxnreg in flash_fwd_sm90.cuh: 24 for the
# producer, 240 for each consumer, 384 threads): the kernel's launch count must fit the
# register file at one CTA per SM (65536 / 384, rounded down to 8), and setmaxnreg must be
# able to hand out what the consumers ask for.
SM90_FWD_THREADS = 384
SM90_FWD_LAUNCH_REGS = 65536 // SM90_FWD_THREADS // 8 * 8


def compile_report(nvcc: str, source: Path, archs: list[str]) -> tuple[int, str]:
    cmd = [nvcc, "-std=c++17", "-O3", "-DNDEBUG", f"-I{ROOT / 'csrc'}", f"-I{ROOT / 'third_party'}",
           "-Xptxas", "-v", "-c", str(source), "-o", os.devnull]
    for a in source_archs(source, archs):
        cmd += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    return p.returncode, p.stdout + p.stderr


def demangle(names: list[str]) -> dict[str, str]:
    tool = shutil.which("c++filt")
    if not tool or not names:
        return {n: n for n in names}
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True).stdout
    return dict(zip(names, out.splitlines())) if out else {n: n for n in names}


def check(sources: list[Path], archs: list[str], nvcc: str,
          jobs: int = 2) -> tuple[list[Kernel], list[str]]:
    """Compiles every source, `jobs` files at a time; returns (kernels, errors)."""
    errors: list[str] = []
    kernels: list[Kernel] = []
    with ThreadPoolExecutor(max_workers=max(1, min(len(sources), jobs))) as ex:
        results = list(ex.map(lambda s: (s, *compile_report(nvcc, s, archs)), sources))
    for source, rc, report in results:
        rel = str(source.relative_to(ROOT)) if source.is_relative_to(ROOT) else str(source)
        if rc != 0:
            errors.append(f"{rel}: nvcc failed (exit {rc}):\n{report}")
            continue
        kernels += parse(report, rel)
    return kernels, errors


def short_name(demangled: str) -> str:
    """fmha::gpu::flash_fwd_kernel<__half, fmha::gpu::FlashFwdConfig<128>, true>(...) ->
    flash_fwd_kernel<__half, FlashFwdConfig<128>, true>"""
    name = demangled.split("(")[0]
    return re.sub(r"\bfmha::gpu::", "", name).removeprefix("void ")


def print_register_table(kernels: list[Kernel], names: dict[str, str], archs: list[str]) -> None:
    """Registers per kernel and arch ('*' marks a spill or stack frame)."""
    table: dict[str, dict[str, str]] = {}
    for k in kernels:
        cell = f"{k.registers}{'' if k.clean else '*'}"
        if k.arch not in [f"sm_{a}" for a in archs]:
            archs = archs + [k.arch.removeprefix("sm_")]
        table.setdefault(short_name(names.get(k.name, k.name)), {})[k.arch] = cell
    if not table:
        return
    width = max(len(n) for n in table)
    cols = [f"sm_{a}" for a in archs]
    print()
    print(f"{'registers':{width}}  " + " ".join(f"{c:>6}" for c in cols))
    for name in sorted(table):
        print(f"{name:{width}}  " + " ".join(f"{table[name].get(c, '-'):>6}" for c in cols))


def default_sources() -> list[Path]:
    """The shipped kernels (csrc/cuda/*.cu and the generated instantiations) and the
    test-only kernels of csrc/cuda/testing/, which the emulator module runs."""
    cuda = ROOT / "csrc" / "cuda"
    return (sorted(cuda.glob("*.cu")) + sorted((cuda / "instantiations").glob("*.cu"))
            + sorted((cuda / "testing").glob("*.cu")))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sources", nargs="*", type=Path, help="default: default_sources()")
    ap.add_argument("--arch", action="append", help="sm number, repeatable (default 80, 90)")
    ap.add_argument("--nvcc", default=None)
    ap.add_argument("-j", "--jobs", type=int, default=2, help="files compiled at once (default 2)")
    args = ap.parse_args(argv)
    nvcc = args.nvcc or find_nvcc()
    if not nvcc:
        print("ptxas_check: nvcc not found", file=sys.stderr)
        return 2
    sources = [s.resolve() for s in args.sources] or default_sources()
    archs = args.arch or list(DEFAULT_ARCHS)
    kernels, errors = check(sources, archs, nvcc, args.jobs)
    names = demangle(sorted({k.name for k in kernels}))
    print(f"{'arch':6} {'regs':>4} {'stack':>5} {'spill st/ld':>11}  kernel")
    for k in kernels:
        flag = "" if k.clean else (f"   <-- FAIL (wgmma serialised, {k.serialized_by})"
                                   if k.wgmma_serialized else "   <-- FAIL")
        print(f"{k.arch:6} {k.registers:4d} {k.stack:5d} {k.spill_stores:5d}/{k.spill_loads:<5d}  "
              f"{names.get(k.name, k.name)} ({k.file}){flag}")
    print_register_table(kernels, names, archs)
    for e in errors:
        print(e, file=sys.stderr)
    bad = [k for k in kernels if not k.clean]
    # The Hopper forward on sm_90a: within its launch budget (setmaxnreg's starting point).
    over = [k for k in kernels if k.arch == "sm_90a" and "flash_fwd_sm90_kernel" in k.name
            and k.registers > SM90_FWD_LAUNCH_REGS]
    for k in over:
        print(f"ptxas_check: {names.get(k.name, k.name)}: {k.registers} registers > "
              f"{SM90_FWD_LAUNCH_REGS} (384 threads, one CTA per SM)", file=sys.stderr)
    bad += over
    if bad or errors:
        print(f"ptxas_check: {len(bad)} kernel(s) spill, use a stack frame or serialise wgmma, "
              f"{len(errors)} file(s) failed to compile", file=sys.stderr)
        return 1
    built = sorted({k.arch for k in kernels}, key=lambda a: (len(a), a))
    print(f"ptxas_check: {len(kernels)} kernel builds clean for {', '.join(built)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
