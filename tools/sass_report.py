#!/usr/bin/env python3
"""The machine code of fmha's CUDA kernels, counted where the time goes: the steady-state loop.

Compiles instantiation files (csrc/cuda/instantiations/*.cu) to cubins with nvcc, disassembles
them (cuobjdump -sass, which calls nvdisasm), and for each kernel finds its main loop -- the
loop whose body holds the most tensor-core instructions (HMMA): the key-block loop of the
forward and of the dQ kernel, the query-step loop of the main backward -- and counts, on one
pass of it:

  path   the instructions of one path from the loop head to its back edge: the one with the
         most HMMA, then the most cp.async copies (LDGSTS: the next tile's prefetch), then the
         fewest instructions -- the common case, where optional regions (the strong zero's vote
         scan and rare block, dropout when off) are skipped. A lower bound of what one
         iteration issues; comparing two versions of one kernel is what it is for.
  body   every instruction inside the loop (static size, rare paths included).
and the path's HMMA, LDSM (ldmatrix), LDS/STS, LDGSTS (cp.async), BAR, MUFU, SHFL counts, and
non-HMMA instructions per HMMA. Registers from the cubin's resource usage (cuobjdump -res-usage).

    python tools/sass_report.py                                   # the default kernels, sm_80
    python tools/sass_report.py --arch 90 csrc/cuda/instantiations/flash_fwd_hdim128_fp16.cu
    python tools/sass_report.py --src-root /tmp/old-checkout ...  # another tree's sources

Assumptions, checked where they can be: the loop is structured (its body is the address range
from the header to the back edge, as nvcc lays out loops); inner loops without HMMA on the path
count one trip; predicated-off instructions count as issued (they are). cuobjdump and nvdisasm
come from the CUDA toolkit or from the pip wheels nvidia-cuda-cuobjdump / nvidia-cuda-nvdisasm
(found on PATH, in CUDA_HOME/bin, or in the current Python's site-packages).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_FILES = [
    "csrc/cuda/instantiations/flash_fwd_hdim64_fp16.cu",
    "csrc/cuda/instantiations/flash_fwd_hdim128_fp16.cu",
    "csrc/cuda/instantiations/flash_fwd_hdim128_fp16_extras.cu",
    "csrc/cuda/instantiations/flash_bwd_hdim64_fp16.cu",
    "csrc/cuda/instantiations/flash_bwd_hdim128_fp16.cu",
]
COUNTED = ("HMMA", "LDSM", "LDS", "STS", "LDGSTS", "BAR", "MUFU", "SHFL")

_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
_FUNC = re.compile(r"Function : (\S+)")
_TARGET = re.compile(r"0x([0-9a-f]+)")


@dataclass
class Instr:
    addr: int
    pred: str
    op: str
    args: str

    @property
    def base(self) -> str:
        return self.op.split(".")[0]


@dataclass
class Block:
    start: int
    instrs: list = field(default_factory=list)
    succ: list = field(default_factory=list)

    def count(self, base: str) -> int:
        return sum(i.base == base for i in self.instrs)


def find_tool(name: str) -> str | None:
    cands = [shutil.which(name)]
    cuda = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    cands.append(str(Path(cuda) / "bin" / name))
    site = Path(sysconfig.get_paths()["purelib"])
    cands += [str(p) for p in site.glob(f"nvidia/cu*/bin/{name}")]
    for c in cands:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return c
    return None


def parse(sass: str) -> dict[str, list[Instr]]:
    funcs: dict[str, list[Instr]] = {}
    cur = None
    for line in sass.splitlines():
        m = _FUNC.search(line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
            continue
        m = _INSTR.search(line)
        if m and cur is not None:
            cur.append(Instr(int(m.group(1), 16), (m.group(2) or "").strip(), m.group(3),
                             m.group(4).strip()))
    return funcs


def blocks_of(instrs: list[Instr]) -> list[Block]:
    """Basic blocks with successor start addresses."""
    leaders = {instrs[0].addr}
    for k, ins in enumerate(instrs):
        if ins.base in ("BRA", "EXIT", "RET", "BRX", "JMP"):
            if k + 1 < len(instrs):
                leaders.add(instrs[k + 1].addr)
            if ins.base == "BRA":
                t = _TARGET.search(ins.args)
                if t:
                    leaders.add(int(t.group(1), 16))
    blocks: list[Block] = []
    for ins in instrs:
        if ins.addr in leaders or not blocks:
            blocks.append(Block(ins.addr))
        blocks[-1].instrs.append(ins)
    for k, b in enumerate(blocks):
        last = b.instrs[-1]
        nxt = blocks[k + 1].start if k + 1 < len(blocks) else None
        if last.base == "BRA":
            t = _TARGET.search(last.args)
            if t:
                b.succ.append(int(t.group(1), 16))
            if last.pred and nxt is not None:
                b.succ.append(nxt)
        elif last.base in ("EXIT", "RET"):
            if last.pred and nxt is not None:
                b.succ.append(nxt)
        elif nxt is not None:
            b.succ.append(nxt)
    return blocks


@dataclass
class LoopStats:
    header: int
    back_edge: int
    body: int
    path: list  # blocks on the common path

    def path_count(self, base: str | None = None) -> int:
        return sum(len(b.instrs) if base is None else b.count(base) for b in self.path)


def main_loop(blocks: list[Block], also: tuple = ()) -> LoopStats | None:
    by_start = {b.start: b for b in blocks}
    best = None
    for b in blocks:
        for s in b.succ:
            if s > b.start:
                continue
            body = [x for x in blocks if s <= x.start <= b.start]
            hmma = sum(x.count("HMMA") for x in body)
            if hmma and (best is None or hmma > best[0]):
                best = (hmma, s, b, body)
    if best is None:
        return None
    _, head, tail, body = best
    inside = {x.start for x in body}
    # The path from the head to the back edge's block over forward edges (a DAG): the most
    # HMMA, then the most cp.async copies (the steady state runs the products and the next
    # tile's prefetch), then the fewest instructions. Where two copies of a product exist (a
    # rare variant beside the common one) the shorter, common one wins.
    def weight(x: Block):
        return (x.count("HMMA"), x.count("LDGSTS"),
                *(sum(i.op == op for i in x.instrs) for op in also), -len(x.instrs))

    score = {head: weight(by_start[head])}
    prev: dict[int, int] = {}
    for x in sorted(body, key=lambda x: x.start):
        if x.start not in score:
            continue
        for v in x.succ:
            if v not in inside or v <= x.start:
                continue
            w = weight(by_start[v])
            cand = tuple(p + q for p, q in zip(score[x.start], w))
            if v not in score or cand > score[v]:
                score[v], prev[v] = cand, x.start
    if tail.start not in score:
        raise RuntimeError(f"no forward path from {head:#x} to {tail.start:#x} in the loop body")
    path = [tail.start]
    while path[-1] != head:
        path.append(prev[path[-1]])
    return LoopStats(head, tail.instrs[-1].addr, sum(len(x.instrs) for x in body),
                     [by_start[a] for a in reversed(path)])


def registers(cubin: Path, cuobjdump: str) -> dict[str, int]:
    out = subprocess.run([cuobjdump, "-res-usage", str(cubin)], capture_output=True, text=True,
                         check=True).stdout
    regs, name = {}, None
    for line in out.splitlines():
        m = re.search(r"Function (\S+):", line)
        if m:
            name = m.group(1)
        m = re.search(r"REG:(\d+)", line)
        if m and name:
            regs[name] = int(m.group(1))
    return regs


def short_name(mangled: str) -> str:
    kind = re.search(r"(flash_\w+?kernel|flash_\w+?_o|flash_bwd_convert_dq)", mangled)
    cfg = re.search(r"Config(?:I|ILi)(\d+)(?:ELb(\d))?", mangled)
    flags = re.findall(r"Lb(\d)", mangled)
    dtype = "bf16" if "nv_bfloat16" in mangled else "fp16"
    label = kind.group(1) if kind else mangled[:40]
    if cfg:
        label += f" d{cfg.group(1)}"
    if flags:
        label += " [" + ",".join(flags) + "]"
    return f"{label} {dtype}"


def report(files: list[str], arch: str, src_root: Path, nvcc: str, cuobjdump: str,
           kernel_re: str, also: tuple = ()) -> list[dict]:
    rows = []
    env = dict(os.environ)
    nvd = find_tool("nvdisasm")
    if nvd:
        env["NVDISASM_PATH"] = str(Path(nvd).parent)
        env["PATH"] = env.get("PATH", "") + os.pathsep + str(Path(nvd).parent)
    with tempfile.TemporaryDirectory() as tmp:
        for f in files:
            cubin = Path(tmp) / (Path(f).stem + f".sm{arch}.cubin")
            subprocess.run([nvcc, "-std", "c++17", "-O3", "-DNDEBUG", f"-I{src_root / 'csrc'}",
                            f"-I{src_root / 'third_party'}", "-cubin", "-o", str(cubin),
                            str(src_root / f), "-gencode", f"arch=compute_{arch},code=sm_{arch}"],
                           check=True, capture_output=True, text=True)
            sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True,
                                  text=True, check=True, env=env).stdout
            regs = registers(cubin, cuobjdump)
            for name, instrs in parse(sass).items():
                if not re.search(kernel_re, name):
                    continue
                loop = main_loop(blocks_of(instrs), also)
                if loop is None:
                    continue
                row = dict(file=f, kernel=short_name(name), mangled=name, arch=f"sm_{arch}",
                           regs=regs.get(name, -1), body=loop.body, path=loop.path_count())
                for c in COUNTED:
                    row[c] = loop.path_count(c)
                rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    head = ["kernel", "arch", "regs", "body", "path", *COUNTED, "non-HMMA/HMMA"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        ratio = (r["path"] - r["HMMA"]) / r["HMMA"] if r["HMMA"] else float("nan")
        cells = [r["kernel"], r["arch"], r["regs"], r["body"], r["path"], *(r[c] for c in COUNTED),
                 f"{ratio:.2f}"]
        print("| " + " | ".join(str(c) for c in cells) + " |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", help="instantiation files, relative to --src-root")
    ap.add_argument("--arch", action="append", help="sm number, repeatable (default 80)")
    ap.add_argument("--src-root", type=Path, default=ROOT, help="the source tree (default: this one)")
    ap.add_argument("--kernel", default=r"flash_(fwd|bwd|bwd_dq)_kernel",
                    help="regex on the mangled kernel name")
    ap.add_argument("--also", action="append", default=[], metavar="OPCODE",
                    help="prefer paths through this exact opcode too (repeatable), after HMMA "
                         "and LDGSTS: e.g. LDS.128 takes the strong zero's vote scan, which "
                         "calls with a mask, bias, dropout or window run")
    a = ap.parse_args()
    nvcc = find_tool("nvcc")
    cuobjdump = find_tool("cuobjdump")
    if not nvcc or not cuobjdump or not find_tool("nvdisasm"):
        print("sass_report: needs nvcc, cuobjdump and nvdisasm (pip install nvidia-cuda-cuobjdump "
              "nvidia-cuda-nvdisasm)", file=sys.stderr)
        return 2
    rows = []
    for arch in a.arch or ["80"]:
        rows += report(a.files or DEFAULT_FILES, arch, a.src_root.resolve(), nvcc, cuobjdump,
                       a.kernel, tuple(a.also))
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
