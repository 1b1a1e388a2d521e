#!/usr/bin/env python3
"""A/B timing of a change to the CPU kernels, in one process.

On a shared VM one build's speed drifts by +-20% between runs (docs/cpu_kernels.md), so timing
the old and the new build one after the other cannot resolve a 5% change. This tool compiles
the CPU kernels (csrc/cpu/forward.h, backward.h) twice -- from a git revision (A, default HEAD)
and from the working tree (B) -- into two namespaces of one program (tools/cpu_ab/), which
calls them alternately on the same buffers, round after round, and prints both speeds and the
median of the per-round B/A speed ratios. Both calls see the same drift, so the ratio holds
still where the GFLOP/s do not. It also checks that A and B give the same bits.

    python tools/cpu_ab.py --case 1,8,2048,64 --mode fwd
    python tools/cpu_ab.py --base HEAD~3 --case 1,8,1024,64,1 --mode fwdbwd --threads 2
    python tools/cpu_ab.py --case 8,32,4096,128,0,1,8 --mode fwd   # one query, GQA 32/8

The rest of the library (thread pool, dispatch) is linked from an existing build
(--build-dir, default build/full: `pip install --no-build-isolation -e .
-Cbuild-dir=build/full`, docs/guides/building.md). Only code under csrc/cpu
and the headers it includes may differ between A and B.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from concurrent.futures import ThreadPoolExecutor
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def isa_flags(isa: str) -> list[str]:
    """The compile flags of one ISA level, read from cmake/cpu_core.cmake (one place)."""
    text = (ROOT / "cmake" / "cpu_core.cmake").read_text()
    flags: dict[str, list[str]] = {}
    for name, body in re.findall(r"set\(FMHA_CPU_FLAGS_(\w+)\s+([^)]*)\)", text):
        words = []
        for w in body.split():
            ref = re.fullmatch(r"\$\{FMHA_CPU_FLAGS_(\w+)\}", w)
            words += flags[ref.group(1)] if ref else [w]
        flags[name] = words
    common = re.search(r"set\(FMHA_CPU_COMMON_FLAGS \$\{FMHA_CPU_OPT_FLAGS\}([^)]*)\)", text)
    if isa not in flags or not common:
        sys.exit(f"cpu_ab: no flags for ISA level {isa!r} in cmake/cpu_core.cmake")
    return ["-O3", *common.group(1).split(), *flags[isa]]


def best_isa() -> str:
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags = set(re.search(r"^flags\s*:(.*)$", cpuinfo, re.M).group(1).split()) if cpuinfo else set()
    if "avx512_bf16" in flags:
        return "avx512bf16"
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    sys.exit("cpu_ab: this CPU has no AVX2+FMA; the scalar kernels are not worth A/B timing")


def export_tree(rev: str, dest: Path) -> Path:
    """csrc and third_party of git revision `rev`, unpacked under dest."""
    data = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev, "csrc",
                           "third_party"], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        try:
            tar.extractall(dest, filter="data")
        except TypeError:  # Python without extraction filters; the archive is our own
            tar.extractall(dest)
    return dest


def build(base_rev: str, isa: str, build_dir: Path, work: Path) -> Path:
    libs = [build_dir / f"lib{n}.a" for n in ("fmha_core", "fmha_validate")]
    missing = [str(p) for p in libs if not p.exists()]
    if missing:
        sys.exit(f"cpu_ab: {', '.join(missing)} not found: build the library first "
                 "(an editable install, docs/guides/building.md) or pass --build-dir")
    cxx = shutil.which("c++") or shutil.which("g++") or sys.exit("cpu_ab: no C++ compiler")
    base = export_tree(base_rev, work / "base")
    flags = isa_flags(isa)
    jobs = []
    for ns, tree in (("abA", base), ("abB", ROOT)):
        jobs.append([cxx, "-std=gnu++17", "-fPIC", *flags, f"-DFMHA_CPU_ISA_NS={ns}",
                     f"-I{tree / 'csrc'}", f"-I{tree / 'third_party'}", "-c",
                     str(ROOT / "tools" / "cpu_ab" / "kernels.cpp"), "-o", str(work / f"{ns}.o")])
    jobs.append([cxx, "-std=gnu++17", "-O2", f"-I{ROOT / 'csrc'}", "-c",
                 str(ROOT / "tools" / "cpu_ab" / "main.cpp"), "-o", str(work / "main.o")])
    with ThreadPoolExecutor(max_workers=3) as pool:
        for r in pool.map(lambda cmd: subprocess.run(cmd, capture_output=True, text=True), jobs):
            if r.returncode:
                sys.exit(f"cpu_ab: compile failed:\n{' '.join(r.args)}\n{r.stderr}")
    exe = work / "cpu_ab"
    # core twice: validate and core refer to each other.
    subprocess.run([cxx, str(work / "main.o"), str(work / "abA.o"), str(work / "abB.o"),
                    str(libs[0]), str(libs[1]), str(libs[0]), "-lpthread", "-o", str(exe)],
                   check=True)
    return exe


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD", help="git revision of build A (default HEAD)")
    ap.add_argument("--case", action="append", default=[],
                    help="b,heads,seqlen,head_dim[,causal[,seqlen_q[,heads_kv[,keypad]]]]: "
                         "seqlen is the keys'; keypad 1 masks the last eighth of the keys "
                         "(repeatable; default 1,8,2048,64; a decode: 8,32,4096,128,0,1,8)")
    ap.add_argument("--mode", default="fwd", choices=["fwd", "bwd", "fwdbwd"])
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--isa", default=None, help="avx2|avx512|avx512bf16 (default: the best here)")
    ap.add_argument("--build-dir", type=Path, default=ROOT / "build" / "full")
    args = ap.parse_args()
    isa = args.isa or best_isa()
    with tempfile.TemporaryDirectory(prefix="fmha-cpu-ab-") as tmp:
        exe = build(args.base, isa, args.build_dir.resolve(), Path(tmp))
        print(f"A = {args.base}, B = the working tree; ISA level {isa}", flush=True)
        status = 0
        for case in args.case or ["1,8,2048,64"]:
            r = subprocess.run([str(exe), case, args.mode, args.dtype, str(args.threads),
                                str(args.rounds)])
            status |= r.returncode
    return status


if __name__ == "__main__":
    sys.exit(main())
