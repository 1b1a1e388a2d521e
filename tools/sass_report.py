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
non-HMMA instructions per HMMA, also without the local-memory traffic (LDL, STL: spill code).
A second table gives the passes a plain call runs (no mask, window, dropout or bias, not causal,
full blocks, finite inputs; see plain_passes): each branch of the loop is classed by where its
predicate comes from -- a row, key or column index against a sequence length or head dim, or
a test the plain call's parameters decide (bound: the side a full block takes, e.g. the
backward's lse and D row tests and its window key test), the thread index (warp: both sides
searched, giving the slowest and the fastest warp's pass, e.g. the backward's warps that load
lse or D), a warp vote of a float compare (vote: the forward's lazy rescale, counted as the
rescale pass of every slot, the rescale of one slot, and the no-rescale pass), loaded data or
call-wide values (the common side, as for `path`). `--decide ADDR=taken|fall` overrides the
side of one branch; `--branches` lists the loop's branches with their class and, for bound
tests, the side taken:

    python tools/sass_report.py --keep /tmp/sass --kernel 'flash_bwd_kernel.*Lb0ELb1EE' \
        --branches csrc/cuda/instantiations/flash_bwd_hdim128_fp16.cu
 Registers from the cubin's resource usage (cuobjdump -res-usage).
A second table gives each kernel's launch shape: threads and dynamic shared memory per CTA (the
Cfg::kThreads and Cfg::kSmemBytes its launcher passes, read by compiling and running a small
host program against the same sources), registers, and the CTAs per SM these allow (as for
flash-attn's kernels below).

    python tools/sass_report.py                                   # the default kernels, sm_80
    python tools/sass_report.py --arch 90 csrc/cuda/instantiations/flash_fwd_hdim128_fp16.cu
    python tools/sass_report.py --src-root /tmp/old-checkout ...  # another tree's sources

The decode kernel (csrc/cuda/flash_decode.cuh) runs its products on CUDA cores: `--decode`
compiles the flash_decode_kernel instantiations of DECODE_KERNELS and counts one warp's pass
over a 32-key chunk (decode_pass: the path that issues both products, q K^T and P V, in the
fewest instructions), with its FFMA, loads and bytes read, and what that means for reading the
cache: bytes of K and V per instruction, and the read rate an H200's issue slots would allow
(against its 4.8 TB/s). Run it with --src-root on an older tree to compare.

    python tools/sass_report.py --decode --arch 80 --arch 90

flash-attn 2's kernels, for comparison (its sources are pointed to, never copied here): give a
flash-attn source tree -- a git checkout with its csrc/cutlass submodule, or the PyPI sdist
(`pip download --no-deps --no-binary :all: flash-attn==2.8.3`), unpacked or as the .tar.gz --
and the tool compiles its fp16 sm80 instantiation files for head dims 64 and 128 (forward and
backward) with flash-attn's own nvcc flags (setup.py), and reports the variant comparable to
fmha's plain path (see FA_PLAIN) under names like `fa2 fwd d128 128x64 w4` (head dim, kBlockM x
kBlockN, warps), then a second table: tile, shared memory per CTA (from the traits' formulas),
registers and stack, local-memory traffic and integer/address instructions on the path, and the
CTAs per SM this allows.

    python tools/sass_report.py --flash-attn /tmp/fa --arch 80 --arch 90
    python tools/sass_report.py --flash-attn flash_attn-2.8.3.tar.gz --cutlass /tmp/cutlass

Its headers include PyTorch's (c10/cuda, ATen/cuda; found with --torch-include or the current
Python's torch); a CPU wheel lacks the one generated c10/cuda/impl/cuda_cmake_macros.h, which
the tool then writes to a temporary include directory (one line: C10_CUDA_BUILD_SHARED_LIBS).
Its loops are found as natural loops (dominator-based, not address ranges): nvcc places the
key-block loop's conditional K prefetch above the loop head, outside the address range.
`--loops` prints every loop holding HMMA, to check which one was taken; `--keep DIR` keeps
the cubins and SASS (fmha's too), and `--keep DIR --reuse` analyses them again without
compiling (the eight flash-attn compiles take ~30 min on 2 cores). On fmha's kernels the
natural-loop finder gives the same paths as the address-range one (only `body` differs), so the
two sets of counts are comparable.

Assumptions, checked where they can be: for fmha's files the loop is structured (its body is
the address range from the header to the back edge, as nvcc lays out loops); inner loops on
the path count one trip -- those with HMMA (the main backward's dQ work units at d = 128 and
256, where a warp runs several) `--inner-trips N` times; predicated-off instructions count as
issued (they are). cuobjdump and nvdisasm
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
# The Hopper kernels' (sm_90a) additions: wgmma (HGMMA; the column counts QGMMA, the 8-bit
# wgmma, too), mbarrier operations (SYNCS), TMA loads (UTMALDG). "MMA" below counts both
# tensor-core kinds: the main loop is the one with the most.
COUNTED_SM90 = ("HGMMA", "SYNCS", "UTMALDG")

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
        if base == "MMA":
            return sum(i.base in ("HMMA", "HGMMA", "QGMMA") for i in self.instrs)
        if base == "HGMMA":
            return sum(i.base in ("HGMMA", "QGMMA") for i in self.instrs)
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


def _conditional(ins: Instr) -> bool:
    """Whether a branch may fall through: a guard (`@P0 BRA`), a predicate operand (`BRA P0,
    target`, `BRA !P3, target`), or the convergence forms ptxas puts around warp-synchronous
    instructions (`BRA.DIV ~URZ, target`: to the slow path if the warp has diverged;
    `BRA.CONV`)."""
    if ins.pred and ins.pred.strip() != "@PT":
        return True
    operands = [a.strip() for a in ins.args.split(",")]
    return len(operands) > 1 and operands[0] not in ("PT", "")


def _loop_exit_call(ins: Instr) -> bool:
    """A guarded `CALL.REL.NOINC target`: how ptxas leaves a loop whose body holds
    warp-synchronous instructions (it pushes no return address; the code at target never
    returns). Unguarded CALLs are calls: to the convergence helpers (WARPSYNC ... RET) and the
    division's slow path, which return to the next instruction."""
    return (ins.base == "CALL" and "NOINC" in ins.op.split(".")
            and bool(ins.pred) and ins.pred.strip() != "@PT")


def blocks_of(instrs: list[Instr]) -> list[Block]:
    """Basic blocks with successor start addresses."""
    leaders = {instrs[0].addr}
    for k, ins in enumerate(instrs):
        if ins.base in ("BRA", "EXIT", "RET", "BRX", "JMP") or _loop_exit_call(ins):
            if k + 1 < len(instrs):
                leaders.add(instrs[k + 1].addr)
            if ins.base in ("BRA", "CALL"):
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
        if last.base == "BRA" or _loop_exit_call(last):
            t = _TARGET.search(last.args)
            if t:
                b.succ.append(int(t.group(1), 16))
            if _conditional(last) and nxt is not None:
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


def main_loop(blocks: list[Block], also: tuple = (), natural: bool = False) -> LoopStats | None:
    if natural:
        return natural_main_loop(blocks, also)
    by_start = {b.start: b for b in blocks}
    best = None
    for b in blocks:
        for s in b.succ:
            if s > b.start:
                continue
            body = [x for x in blocks if s <= x.start <= b.start]
            hmma = sum(x.count("MMA") for x in body)
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
        return _weight(x, also)

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


def _weight(x: Block, also: tuple) -> tuple:
    return (x.count("MMA"), x.count("LDGSTS"), x.count("UTMALDG"),
            *(sum(i.op == op for i in x.instrs) for op in also), -len(x.instrs))


def natural_loops(blocks: list[Block]) -> dict[int, tuple[set, set]]:
    """Natural loops: header -> (latches, body starts), from the back edges x -> h where h
    dominates x (Cooper-Harvey-Kennedy dominators over the blocks reachable from the entry). The
    body need not be an address range: nvcc may place a loop's conditional block above its head."""
    by_start = {b.start: b for b in blocks}
    entry = blocks[0].start
    order, seen, stack = [], {entry}, [(entry, iter(by_start[entry].succ))]
    while stack:  # iterative DFS, postorder
        node, it = stack[-1]
        for v in it:
            if v in by_start and v not in seen:
                seen.add(v)
                stack.append((v, iter(by_start[v].succ)))
                break
        else:
            order.append(node)
            stack.pop()
    rpo = order[::-1]
    index = {b: k for k, b in enumerate(rpo)}
    preds: dict[int, list] = {b: [] for b in rpo}
    for b in rpo:
        for v in by_start[b].succ:
            if v in preds:
                preds[v].append(b)
    idom = {entry: entry}
    changed = True
    while changed:
        changed = False
        for b in rpo[1:]:
            ps = [p for p in preds[b] if p in idom]
            new = ps[0]
            for p in ps[1:]:
                a, c = p, new
                while a != c:
                    while index[a] > index[c]:
                        a = idom[a]
                    while index[c] > index[a]:
                        c = idom[c]
                new = a
            if idom.get(b) != new:
                idom[b], changed = new, True

    def dominates(h: int, x: int) -> bool:
        while True:
            if x == h:
                return True
            if x == entry:
                return False
            x = idom[x]

    loops: dict[int, tuple[set, set]] = {}
    for x in rpo:
        for h in by_start[x].succ:
            if h in idom and dominates(h, x):
                latches, body = loops.setdefault(h, (set(), {h}))
                latches.add(x)
                work = [x]
                while work:
                    y = work.pop()
                    if y not in body:
                        body.add(y)
                        work += preds[y]
    return loops


def _forward_dag(by_start: dict, head: int, body: set) -> tuple[list, dict]:
    """The loop body's forward edges and a topological order of them: a DFS from the head, the
    edges to a block on the DFS stack (the header's or an inner loop's back edges) dropped."""
    topo, state, stack = [], {head: 1}, [(head, iter(by_start[head].succ))]
    fwd: dict[int, list] = {y: [] for y in body}
    while stack:
        node, it = stack[-1]
        for v in it:
            if v not in body or state.get(v) == 1:
                continue
            fwd[node].append(v)
            if v not in state:
                state[v] = 1
                stack.append((v, iter(by_start[v].succ)))
                break
        else:
            state[node] = 2
            topo.append(node)
            stack.pop()
    topo.reverse()
    return topo, fwd


def _best(by_start: dict, head: int, body: set, ends: set, weight) -> list:
    """The path over the body's forward edges from head to a block of ends with the largest
    summed weight(block) (tuples compare in order)."""
    topo, fwd = _forward_dag(by_start, head, body)
    score, prev = {head: weight(by_start[head])}, {}
    for x in topo:
        for v in fwd.get(x, ()) if x in score else ():
            cand = tuple(p + q for p, q in zip(score[x], weight(by_start[v])))
            if v not in score or cand > score[v]:
                score[v], prev[v] = cand, x
    reached = [x for x in ends if x in score]
    if not reached:
        raise RuntimeError(f"no forward path from {head:#x} to a latch in the loop body")
    tail = max(reached, key=lambda x: score[x])
    path = [tail]
    while path[-1] != head:
        path.append(prev[path[-1]])
    return [by_start[a] for a in reversed(path)]


def natural_main_loop(blocks: list[Block], also: tuple = (), verbose: str | None = None
                      ) -> LoopStats | None:
    """The natural loop with the most HMMA (ties: the fewest instructions -- the inner of two
    nested loops, e.g. the backward's query-step loop inside its key-block loop, or of two
    sibling copies the one without masking), and its common path: over the body's forward
    edges (edges to a block on the DFS stack -- the header or an inner loop's -- dropped, so
    inner loops count one trip), from the header to a latch, the most HMMA, then LDGSTS, then
    the fewest instructions, as main_loop."""
    by_start = {b.start: b for b in blocks}
    loops = natural_loops(blocks)
    ranked = sorted(((sum(by_start[y].count("MMA") for y in body),
                      -sum(len(by_start[y].instrs) for y in body), h)
                     for h, (_, body) in loops.items()), reverse=True)
    if verbose is not None:
        for hmma, _, h in sorted(ranked, key=lambda t: t[2]):
            if hmma:
                latches, body = loops[h]
                print(f"  {verbose}: loop head {h:#x} latches {[hex(x) for x in sorted(latches)]} "
                      f"{len(body)} blocks {sum(len(by_start[y].instrs) for y in body)} instrs "
                      f"{hmma} HMMA", file=sys.stderr)
    if not ranked or ranked[0][0] == 0:
        return None
    head = ranked[0][2]
    latches, body = loops[head]
    path = _best(by_start, head, body, latches, lambda x: _weight(x, also))
    return LoopStats(head, path[-1].instrs[-1].addr, sum(len(by_start[y].instrs) for y in body),
                     path)


# --- the plain call's passes ---------------------------------------------------------------------
#
# `path` above is the common case by a rule of thumb. The passes below follow instead the branch
# decisions of a plain call (no mask, window, dropout or bias, not causal, full blocks, finite
# inputs) where the SASS shows them, and keep apart what the call does not decide:
#   warp   a branch on a value derived from the thread index (S2R SR_TID / SR_LANEID) and
#          call-wide values only: which side runs depends on the warp (the backward's warp 0
#          loads lse and D for the step). Both sides are searched: the slowest warp's pass takes
#          the longer, the fastest warp's the shorter (each such branch on its own: the slowest
#          pass may combine sides no single warp takes, an upper bound).
#   vote   a branch on a warp vote of a float comparison (VOTE.ANY of an FSETP: the forward's
#          lazy rescale, `warp_ballot(rescale) != 0u` in cuda/flash_fwd.cuh): both sides are
#          reported, the longer as the rescale pass, the shorter as the no-rescale pass.
#   data   a branch on loaded data (a scan for non-finite values, a block barrier's OR of one,
#          a NaN lse): a plain call has finite inputs and takes the common side.
#   call   a branch on call-wide values only (the parameters, the block index, the loop's step):
#          the common side, unless --decide names the side a plain call takes.
#   bound  (before the others) a branch a plain full-block call decides: an index computed from
#          the thread index compared with a sequence length or head dim (BOUND_FIELDS: the
#          index inside), or a compare the intervals of a plain call's values settle (thread
#          and block indices >= 0, PLAIN_VALUES: the window -1). The side is taken as decided.
# The common side of a data or call branch is the side the rule of thumb takes: the one whose
# rest of the pass has the most HMMA, then LDGSTS, then the fewest instructions.

_REG = re.compile(r"!?-?\|?(U?R\d+|U?P\d+|U?PT|U?RZ|SR_\w+)(?:\.(64|128))?")
_NO_DEST = {"ST", "STS", "STG", "STL", "RED", "REDG", "REDUX", "BAR", "BRA", "EXIT", "CALL", "RET",
            "BSSY", "BSYNC", "WARPSYNC", "LDGSTS", "LDGDEPBAR", "DEPBAR", "NOP", "MEMBAR",
            "ERRBAR", "CCTL", "YIELD", "BPT", "BRX", "JMP", "WARPGROUP", "ARRIVES", "SYNCS",
            "FENCE", "UTMALDG", "UTMASTG", "UBLKCP"}
_TWO_DEST = {"ISETP", "FSETP", "HSETP2", "DSETP", "PSETP", "UISETP", "PLOP3", "UPLOP3", "VOTE",
             "SHFL", "FCHK"}
_LOADS = {"LD", "LDS", "LDG", "LDL", "LDSM", "LDC", "ATOM", "ATOMS", "ATOMG", "LDGDEPBAR",
          "S2R", "CS2R", "S2UR", "REDUX", "MATCH"}
TID, DATA, VOTE, FLOATVOTE, BOUND = 1, 2, 4, 8, 16
# A kernel parameter read from the constant bank: c[0x0][0x20c].
_CONST = re.compile(r"c\[0x0\]\[(0x[0-9a-f]+)\]")
_THREAD_SREGS = ("SR_TID", "SR_LANEID", "SR_VIRTID", "SR_LTMASK", "SR_LEMASK", "SR_GTMASK",
                 "SR_GEMASK", "SR_EQMASK")


def _regs(tok: str) -> list[str]:
    """The registers an operand names (R4.64: R4 and R5; [R2.64+0x10]: R2, R3; RZ/PT: none)."""
    out = []
    for m in _REG.finditer(tok):
        r, width = m.group(1), m.group(2)
        if r in ("RZ", "URZ", "PT", "UPT") or r.startswith("SR_"):
            continue
        n = {"64": 2, "128": 4}.get(width, 1)
        head = r.rstrip("0123456789")
        k = int(r[len(head):])
        out += [f"{head}{k + j}" for j in range(n)]
    return out


def _operands(args: str) -> list[str]:
    return [a.strip() for a in args.split(",")] if args.strip() else []


def dests_and_sources(ins: Instr) -> tuple[list[str], list[str]]:
    """The registers (R, UR, P, UP) an instruction writes and reads, roughly: the first operand
    (two for compares, PLOP3, VOTE, SHFL, and a predicate first operand) is written, widened by
    the opcode's .64 / .128 or a wide multiply's pair; the rest, the guard and address
    registers are read. Good enough to follow where a branch's predicate comes from."""
    ops = _operands(ins.args)
    guard = _regs(ins.pred.lstrip("@")) if ins.pred else []
    if ins.base in _NO_DEST or not ops:
        return [], guard + [r for o in ops for r in _regs(o)]
    n_dest = 2 if ins.base in _TWO_DEST or re.match(r"!?U?P(\d|T)", ops[0]) else 1
    if ins.base in ("IADD3", "LEA", "IMAD") and len(ops) > 1 and re.fullmatch(r"U?P\d|U?PT",
                                                                              ops[1]):
        n_dest = 2  # a carry out (IADD3 R1, P0, ...; LEA R1, P0, ...)
        if ins.base == "IADD3" and len(ops) > 2 and re.fullmatch(r"U?P\d|U?PT", ops[2]):
            n_dest = 3
    dests = []
    mods = ins.op.split(".")[1:]
    for o in ops[:n_dest]:
        rs = _regs(o)
        if rs and rs[0].lstrip("U").startswith("R") and len(rs) == 1:
            width = 4 if "128" in mods or ins.base == "HMMA" or mods[-1:] == ["4"] else (
                2 if "64" in mods or "WIDE" in mods or ins.base == "CS2R" or mods[-1:] == ["2"]
                else 1)
            head = rs[0].rstrip("0123456789")
            rs = [f"{head}{int(rs[0][len(head):]) + j}" for j in range(width)]
        dests += rs
    srcs = guard + [r for o in ops[n_dest:] for r in _regs(o)]
    return dests, srcs


def _const_taint(args: str, bounds: frozenset, width: int = 1) -> int:
    """BOUND if an operand reads one of the constant-bank words `bounds` names (a load of
    `width` words from c[0x0][X] reads X .. X + 4 (width - 1))."""
    for m in _CONST.finditer(args):
        a = int(m.group(1), 16)
        if any(a + 4 * k in bounds for k in range(width)):
            return BOUND
    return 0


_CMP_INSIDE = {  # ISETP's compare of index A with bound B, for an index inside the bound
    "LT": True, "LE": True, "NE": True, "GT": False, "GE": False, "EQ": False}
_CMP_SWAP = {"LT": "GT", "LE": "GE", "GT": "LT", "GE": "LE", "NE": "NE", "EQ": "EQ"}


def _pred_value(tok: str, state: dict) -> bool | None:
    """The value a plain call gives a predicate operand (PT, !P0, ...), None if unknown."""
    tok = tok.strip()
    neg = tok.startswith("!")
    name = tok.lstrip("!")
    v = True if name in ("PT", "UPT") else state.get("val:" + name)
    return None if v is None else v != neg


def _bound_compare(ins: Instr, state: dict, bounds: frozenset) -> tuple | None:
    """(value of the first, of the second destination) a plain full-block call gives an ISETP
    that compares an index (a value computed from the thread index, "idx:" in _transfer: a row,
    key or column; the block it is in may come from a bound, as the backward's query block
    from the blocks per head) with a bound (computed from a sequence length or head dim read
    from the parameters, not from the thread index): the index lies inside, as in every full
    block; None for any other instruction."""
    if ins.base != "ISETP" or (ins.pred and ins.pred.strip() != "@PT"):
        return None
    mods = ins.op.split(".")[1:]
    if "EX" in mods or len(mods) < 2:
        return None
    cmp, bop = mods[0], mods[-1]
    ops = _operands(ins.args)
    if cmp not in _CMP_INSIDE or bop not in ("AND", "OR", "XOR") or len(ops) != 5:
        return None

    def kind(o: str) -> str | None:
        if any(state.get("idx:" + r) for r in _regs(o)):
            return "index"
        t = _const_taint(o, bounds)
        for r in _regs(o):
            t |= state.get(r, 0)
        return "bound" if t & BOUND else None

    a, b = kind(ops[2]), kind(ops[3])
    if (a, b) == ("index", "bound"):
        value = _CMP_INSIDE[cmp]
    elif (a, b) == ("bound", "index"):
        value = _CMP_INSIDE[_CMP_SWAP[cmp]]
    else:
        return None
    c = _pred_value(ops[4], state)
    if c is None:
        return None
    op = {"AND": lambda x, y: x and y, "OR": lambda x, y: x or y, "XOR": lambda x, y: x != y}[bop]
    return op(value, c), op(not value, c)


INF = float("inf")
_IMM = re.compile(r"-?(0x[0-9a-f]+|\d+)")


def _known(bounds: frozenset) -> dict:
    """The (address, value) pairs of `bounds`: parameters a plain call fixes."""
    return {b[0]: b[1] for b in bounds if isinstance(b, tuple)}


def _interval(tok: str, state: dict, known: dict) -> tuple:
    """The values an integer operand may hold in a plain call: (lo, hi), INF-bounded."""
    tok = tok.strip().replace(".reuse", "")
    neg = tok.startswith("-")
    tok = tok.lstrip("-")
    if tok in ("RZ", "URZ"):
        v = (0, 0)
    elif _IMM.fullmatch(tok):
        x = int(tok, 0)
        v = (x, x)
    elif (m := _CONST.fullmatch(tok)) and int(m.group(1), 16) in known:
        x = known[int(m.group(1), 16)]
        v = (x, x)
    elif re.fullmatch(r"U?R\d+", tok):
        v = state.get("iv:" + tok, (-INF, INF))
    else:
        return (-INF, INF)
    return (-v[1], -v[0]) if neg else v


def _add(*ivs) -> tuple:
    return (sum(v[0] for v in ivs), sum(v[1] for v in ivs))


def _mul(a: tuple, b: tuple) -> tuple:
    if a[0] < 0 or b[0] < 0:  # keep to non-negative factors (no sign cases, no 0 * INF)
        return (-INF, INF)
    lo = a[0] * b[0]
    hi = INF if INF in (a[1], b[1]) and (a[1] and b[1]) else a[1] * b[1]
    return (lo, hi)


def _lop3(vals: list, lut: int) -> tuple:
    """LOP3 of three operands, bit by bit where the known ones decide it (a 32-bit constant)."""
    out = 0
    for bit in range(32):
        outs = set()
        for x in range(8):
            ok = True
            for k, v in enumerate(vals):
                want = (x >> (2 - k)) & 1
                if v[0] == v[1] and v[0] not in (-INF, INF):
                    ok &= ((int(v[0]) >> bit) & 1) == want
            if ok:
                outs.add((lut >> x) & 1)
        if len(outs) != 1:
            return (-INF, INF)
        out |= outs.pop() << bit
    out = out - (1 << 32) if out >> 31 else out
    return (out, out)


def _int_value(ins: Instr, state: dict, known: dict) -> tuple | None:
    """The interval an integer instruction writes to its first destination in a plain call
    (thread and block indices >= 0, the parameters `known` fixes), None where it is not
    followed."""
    ops = _operands(ins.args)
    mods = ins.op.split(".")[1:]
    iv = lambda o: _interval(o, state, known)  # noqa: E731
    b = ins.base
    if b in ("S2R", "CS2R") and re.search(r"SR_(TID|CTAID|LANEID)", ins.args):
        return (0, INF)
    if b == "MOV" and len(ops) >= 2:
        return iv(ops[1])
    if b == "IMAD" and "MOV" in mods and len(ops) == 4:
        return iv(ops[3])
    if b == "IMAD" and "SHL" in mods and len(ops) == 4:
        return _mul(iv(ops[1]), iv(ops[2]))
    if b == "IMAD" and len(ops) == 4 and not ({"WIDE", "HI", "X"} & set(mods)):
        return _add(_mul(iv(ops[1]), iv(ops[2])), iv(ops[3]))
    if b == "IADD3" and not ({"X"} & set(mods)):
        return _add(*(iv(o) for o in ops[-3:]))
    if b == "LEA" and not ({"HI", "X"} & set(mods)) and len(ops) == 4 and \
            _IMM.fullmatch(ops[3]):
        return _add(_mul(iv(ops[1]), (1 << int(ops[3], 0),) * 2), iv(ops[2]))
    if b == "IMNMX" and len(ops) == 4:
        x, y = iv(ops[1]), iv(ops[2])
        return ((min(x[0], y[0]), min(x[1], y[1])) if ops[3] == "PT"
                else (max(x[0], y[0]), max(x[1], y[1])))
    if b == "SEL" and len(ops) == 4:
        c = _pred_value(ops[3], state)
        x, y = iv(ops[1]), iv(ops[2])
        return x if c is True else y if c is False else (min(x[0], y[0]), max(x[1], y[1]))
    if b == "LOP3" and len(ops) == 6 and re.fullmatch(r"U?R\d+", ops[0]):
        return _lop3([iv(o) for o in ops[1:4]], int(ops[4], 0))
    return None


def _interval_compare(ins: Instr, state: dict, known: dict) -> tuple | None:
    """(first, second destination) of an ISETP whose operands' intervals decide it."""
    if ins.base != "ISETP" or (ins.pred and ins.pred.strip() != "@PT"):
        return None
    mods = ins.op.split(".")[1:]
    ops = _operands(ins.args)
    if "EX" in mods or len(mods) < 2 or len(ops) != 5 or mods[-1] not in ("AND", "OR", "XOR"):
        return None
    x, y = _interval(ops[2], state, known), _interval(ops[3], state, known)
    if "U32" in mods and (x[0] < 0 or y[0] < 0):
        return None
    cmp = mods[0]
    value = {"LT": (x[1] < y[0], x[0] >= y[1]), "LE": (x[1] <= y[0], x[0] > y[1]),
             "GT": (x[0] > y[1], x[1] <= y[0]), "GE": (x[0] >= y[1], x[1] < y[0]),
             "EQ": (False, x[1] < y[0] or x[0] > y[1]),
             "NE": (x[1] < y[0] or x[0] > y[1], False)}.get(cmp)
    if value is None or value == (False, False):
        if cmp == "EQ" and x[0] == x[1] == y[0] == y[1]:
            value = (True, False)
        elif cmp == "NE" and x[0] == x[1] == y[0] == y[1]:
            value = (False, True)
        else:
            return None
    v = value[0]  # decided: True if value[0], False if value[1]
    c = _pred_value(ops[4], state)
    if c is None:
        return None
    op = {"AND": lambda a, b: a and b, "OR": lambda a, b: a or b,
          "XOR": lambda a, b: a != b}[mods[-1]]
    return op(v, c), op(not v, c)


def _transfer(ins: Instr, state: dict, bounds: frozenset = frozenset()) -> None:
    """Taint flow through one instruction: TID from the thread-index special registers, DATA
    from loads (shared, global, local, constant by register), VOTE from votes (FLOATVOTE: of a
    float compare), block and warp reductions turning a thread's taint into data, BOUND from
    the parameters `bounds` names (constant-bank addresses); and the value ("val:P0") a plain
    full-block call gives a predicate set by an index-versus-bound compare (_bound_compare)."""
    dests, srcs = dests_and_sources(ins)
    if not dests:
        return
    known = _known(bounds) if bounds else {}
    decided = _bound_compare(ins, state, bounds) if bounds else None
    if decided is None and bounds:
        decided = _interval_compare(ins, state, known)
    value = _int_value(ins, state, known) if bounds else None
    if value is not None and ins.pred and ins.pred.strip() != "@PT":
        g = _pred_value(ins.pred.lstrip("@"), state)
        old = state.get("iv:" + dests[0], (-INF, INF))
        value = old if g is False else value if g is True else (
            min(old[0], value[0]), max(old[1], value[1]))
    for r in dests:
        state.pop("iv:" + r, None)
        if r.lstrip("U").startswith("P"):
            state.pop("val:" + r, None)
    if value is not None and value != (-INF, INF) and re.fullmatch(r"U?R\d+", dests[0]):
        state["iv:" + dests[0]] = value
    if ins.base in ("LDC", "ULDC") and known and not ins.pred:
        m = _CONST.search(ins.args)  # LDC.64 R22, c[0x0][0x3a8]: R22, R23 <- words X, X + 4
        for k, r in enumerate(dests if m else []):
            if int(m.group(1), 16) + 4 * k in known:
                x = known[int(m.group(1), 16) + 4 * k]
                state["iv:" + r] = (x, x)
    if decided is not None:
        for r, v in zip(dests[:2], decided):
            if r.lstrip("U").startswith("P") and r not in ("PT", "UPT"):
                state["val:" + r] = v
    t = _const_taint(ins.args, bounds, 2 if "64" in ins.op.split(".") else 1) if bounds else 0
    for r in srcs:
        t |= state.get(r, 0)
    # "idx:": computed from the thread index by the operands themselves (TID also flows
    # through a guard: a warp-uniform value written under a thread test is no index). A
    # guarded write counts as made: ptxas reuses registers whose old value is dead there.
    guard = set(_regs(ins.pred.lstrip("@"))) if ins.pred else set()
    idx = (ins.base in ("S2R", "CS2R") and any(x in ins.args for x in _THREAD_SREGS)) or (
        ins.base not in _LOADS and any(state.get("idx:" + r) for r in srcs if r not in guard))
    for r in dests:
        if idx:
            state["idx:" + r] = True
        else:
            state.pop("idx:" + r, None)
    if ins.base == "S2R" or ins.base == "CS2R":
        t = TID if any(s in ins.args for s in _THREAD_SREGS) else (
            DATA if "CLOCK" in ins.args else 0)
    elif ins.base in _LOADS and ins.base != "LDC":
        t |= DATA
    elif ins.base == "LDC" and _regs(ins.args.split(",", 1)[-1]):
        t |= DATA  # a constant indexed by a register
    elif ins.base == "VOTE":
        src = ins.args.split(",")[-1].strip().lstrip("!")
        t = VOTE | (state.get(src, 0) & ~TID) | (FLOATVOTE if state.get(
            "float:" + src) else 0)
    elif ins.base == "BAR":  # BAR.RED.OR 0x0, P0: the block's OR, the same for every thread
        t = (t & ~TID) | DATA
    if ins.pred and ins.pred.strip() not in ("@PT",):
        for r in dests:  # guarded: the old value may survive
            state[r] = state.get(r, 0) | t
    else:
        for r in dests:
            state[r] = t
    # A predicate of a float compare, also when an integer compare or predicate logic folds it
    # with others (the forward's `rescale && k != k_begin` is one ISETP over the FSETPs' OR).
    float_src = any(state.get("float:" + r) for r in srcs if r.lstrip("!U").startswith("P"))
    for r in dests:
        if r.lstrip("U").startswith("P"):
            state["float:" + r] = ins.base in ("FSETP", "HSETP2", "DSETP") or (
                ins.base in ("ISETP", "PLOP3") and float_src)


def taint(blocks: list[Block], bounds: frozenset = frozenset()) -> dict[int, dict]:
    """Each block's register taint at entry (TID / DATA / VOTE / BOUND bits), to a fixed point
    over the control flow (the union where paths meet; a predicate's plain-call value survives
    a meeting only where every path gives it the same)."""
    by_start = {b.start: b for b in blocks}
    entry: dict[int, dict] = {blocks[0].start: {}}
    work = [blocks[0].start]
    while work:
        x = work.pop()
        state = dict(entry[x])
        for ins in by_start[x].instrs:
            if ins.base == "BAR" and "RED" in ins.op:
                # BAR.RED.OR.DEFER_BLOCKING 0x0, P0 writes a predicate named after the barrier
                ops = _operands(ins.args)
                dest = _regs(ops[-1]) if ops else []
                t = 0
                for o in ops[1:-1]:
                    for r in _regs(o):
                        t |= state.get(r, 0)
                for r in dest:
                    state[r] = DATA | (t & ~TID)
                    state.pop("val:" + r, None)
                continue
            _transfer(ins, state, bounds)
        for v in by_start[x].succ:
            if v not in by_start:
                continue
            old = entry.get(v)
            if old is None:
                entry[v] = dict(state)
                work.append(v)
                continue
            changed = False
            for r in {k for k in list(old) + list(state) if k.startswith("val:")}:
                if r not in old or old[r] is None:
                    continue
                if state.get(r) != old[r]:
                    old[r], changed = None, True
            for r in [k for k in old if k.startswith("iv:")]:
                a, b = old[r], state.get(r, (-INF, INF))
                if b[0] < a[0] or b[1] > a[1]:  # widened at once: loop counters
                    w = (a[0] if b[0] >= a[0] else -INF, a[1] if b[1] <= a[1] else INF)
                    if w == (-INF, INF):
                        del old[r]
                    else:
                        old[r] = w
                    changed = True
            for r, t in state.items():
                if r.startswith(("val:", "iv:")):
                    continue
                if r.startswith(("float:", "idx:")):
                    if t and not old.get(r):
                        old[r], changed = True, True
                elif old.get(r, 0) | t != old.get(r, 0):
                    old[r] = old.get(r, 0) | t
                    changed = True
            if changed:
                work.append(v)
    return entry


def branch_decision(block: Block, entry_state: dict, bounds: frozenset) -> str | None:
    """The side ("taken" or "fall") a plain full-block call takes at the conditional branch
    ending block, where its guard is the value of an index-versus-bound compare
    (_bound_compare: a row, key or column test every full block passes); None elsewhere."""
    last = block.instrs[-1]
    if not bounds or last.base != "BRA" or not _conditional(last) or not last.pred:
        return None
    if len(_operands(last.args)) > 1:  # `@!P0 BRA P1, target`: two predicates
        return None
    state = dict(entry_state)
    for ins in block.instrs[:-1]:
        _transfer(ins, state, bounds)
    v = _pred_value(last.pred.lstrip("@"), state)
    return None if v is None else ("taken" if v else "fall")


def branch_class(block: Block, entry_state: dict, bounds: frozenset = frozenset()
                 ) -> str | None:
    """The class (warp, vote, data, call; bound: an index-versus-bound test, branch_decision)
    of the conditional branch ending block, None if it ends in none."""
    last = block.instrs[-1]
    if not ((last.base == "BRA" and _conditional(last)) or _loop_exit_call(last)):
        return None
    if branch_decision(block, entry_state, bounds):
        return "bound"
    state = dict(entry_state)
    for ins in block.instrs[:-1]:
        _transfer(ins, state)
    regs = _regs(last.pred.lstrip("@")) if last.pred else []
    ops = _operands(last.args)
    if len(ops) > 1:
        regs += _regs(ops[0])
    t = 0
    for r in regs:
        t |= state.get(r, 0)
    if t & FLOATVOTE:
        return "vote"
    if t & (DATA | VOTE):
        return "data"
    if t & TID:
        return "warp"
    return "call"


@dataclass
class PlainPass:
    name: str     # "slowest warp", "fastest warp, rescale", ...
    loop: LoopStats


def plain_passes(blocks: list[Block], head: int, body: set, ends: set, also: tuple = (),
                 decide: dict | None = None, bounds: frozenset = frozenset()
                 ) -> list[PlainPass]:
    """The main loop's passes as a plain call runs them (see the section's head): the slowest
    and the fastest warp's, and where the loop has a vote branch, each of them with and without
    the rescale, and with three or more votes (the forward's warp vote, then one per 8-row slot)
    the rescale of one slot: the first two votes on their rescale side, the others not.
    bounds: the constant-bank addresses of the sizes a full block lies inside (plain_bounds);
    the index-versus-bound tests on them are decided as a full block takes them
    (branch_decision). decide: {a conditional branch's address: "taken" or "fall"}, the side a
    plain call takes where neither decides it right; it overrides both."""
    by_start = {b.start: b for b in blocks}
    topo, fwd = _forward_dag(by_start, head, body)
    states = taint(blocks, bounds)
    weight = {x: _weight(by_start[x], also) for x in topo}
    # the rule of thumb's best rest of the pass from each block (to a latch)
    rest: dict[int, tuple] = {}
    for x in reversed(topo):
        cands = [rest[v] for v in fwd[x] if v in rest]
        best = max(cands) if cands else None
        if x in ends and (best is None or best < tuple(0 for _ in weight[x])):
            best = tuple(0 for _ in weight[x])
        if best is not None:
            rest[x] = tuple(p + q for p, q in zip(weight[x], best))
    classes = {x: branch_class(by_start[x], states.get(x, {}), bounds) for x in topo}
    auto = {by_start[x].instrs[-1].addr: branch_decision(by_start[x], states.get(x, {}), bounds)
            for x in topo if classes[x] == "bound"}
    decide = {**auto, **(decide or {})}
    passes = []
    votes = [x for x in topo if classes[x] == "vote"]
    sides = (True, False) if votes else (None,)
    if len(votes) >= 3:
        sides = (True, "one", False)
    for vote_side in sides:
        for slowest in (True, False):
            # allowed edges: both sides of warp branches, the chosen side of vote branches,
            # the plain side of the others
            score: dict[int, tuple] = {head: (len(by_start[head].instrs),)}
            prev: dict[int, int] = {}
            # blocks entered on a vote's rescale side: a data or call test there (the forward's
            # "not the first key block") guards the rescale, and the rescale pass passes it
            on_vote_side: set[int] = set()
            for x in topo:
                if x not in score:
                    continue
                succ = [v for v in fwd[x] if v in rest]
                cls = classes[x]
                last = by_start[x].instrs[-1]
                if last.addr in decide:
                    t = _TARGET.search(last.args)
                    target = int(t.group(1), 16) if t else None
                    side = [v for v in succ if (v == target) == (decide[last.addr] == "taken")]
                    succ = side[:1] or succ
                elif cls == "vote" and len(succ) > 1:
                    longest = max(succ, key=lambda v: -rest[v][-1])
                    fires = vote_side is True or (vote_side == "one" and x in votes[:2])
                    succ = [longest] if fires else [v for v in succ if v != longest][:1]
                    if fires:
                        on_vote_side.add(longest)
                elif x in on_vote_side and cls in ("data", "call") and len(succ) > 1:
                    succ = [max(succ, key=lambda v: -rest[v][-1])]
                elif cls != "warp" and len(succ) > 1:
                    succ = [max(succ, key=lambda v: rest[v])]
                for v in succ:
                    n = score[x][0] + len(by_start[v].instrs)
                    if v not in score or (n > score[v][0] if slowest else n < score[v][0]):
                        score[v], prev[v] = (n,), x
            reached = [x for x in ends if x in score]
            if not reached:
                continue
            pick = max if slowest else min
            tail = pick(reached, key=lambda x: score[x][0])
            path = [tail]
            while path[-1] != head:
                path.append(prev[path[-1]])
            stats = LoopStats(head, by_start[tail].instrs[-1].addr,
                              sum(len(by_start[y].instrs) for y in body),
                              [by_start[a] for a in reversed(path)])
            label = "slowest warp" if slowest else "fastest warp"
            if vote_side is not None:
                label += {True: ", rescale", "one": ", rescale one slot",
                          False: ", no rescale"}[vote_side]
            passes.append(PlainPass(label, stats))
    return passes


def loop_region(blocks: list[Block], loop: LoopStats, natural: bool) -> tuple[set, set]:
    """(body, latches) of a loop main_loop or natural_main_loop found: the natural loop of its
    header, or for the address-range finder the blocks from the header to the back edge."""
    if natural:
        latches, body = natural_loops(blocks)[loop.header]
        return body, latches
    body = {b.start for b in blocks if loop.header <= b.start <= loop.back_edge}
    tail = max(b.start for b in blocks if b.start <= loop.back_edge)
    return body, {tail}


def branch_listing(blocks: list[Block], head: int, body: set, on_path: set,
                   bounds: frozenset = frozenset()) -> list[str]:
    """One line per conditional branch of the loop body: address, class, the two successors
    and the instructions of each, whether the rule-of-thumb path passes it; for a bound test,
    the side a full block takes."""
    by_start = {b.start: b for b in blocks}
    states = taint(blocks, bounds)
    lines = []
    for x in sorted(body):
        b = by_start[x]
        cls = branch_class(b, states.get(x, {}), bounds)
        if cls is None:
            continue
        if cls == "bound":
            cls = "bound=" + branch_decision(b, states.get(x, {}), bounds)
        last = b.instrs[-1]
        succ = ", ".join(f"{v:#x} ({len(by_start[v].instrs)} instrs)" for v in b.succ
                         if v in by_start)
        # the instruction of the block that last wrote the branch's predicate, if any
        preds = set(_regs(last.pred.lstrip("@"))) if last.pred else set()
        ops = _operands(last.args)
        if len(ops) > 1:
            preds |= set(_regs(ops[0]))
        setter = next((i for i in reversed(b.instrs[:-1])
                       if preds & set(dests_and_sources(i)[0])), None)
        why = f"  [{setter.op} {setter.args}]" if setter else ""
        lines.append(f"{last.addr:#x} {cls:5s} {'path' if x in on_path else '    '} "
                     f"{last.pred} {last.op} {last.args} -> {succ}{why}")
    return lines


def registers(cubin: Path, cuobjdump: str, field: str = "REG") -> dict[str, int]:
    out = subprocess.run([cuobjdump, "-res-usage", str(cubin)], capture_output=True, text=True,
                         check=True).stdout
    regs, name = {}, None
    for line in out.splitlines():
        m = re.search(r"Function (\S+):", line)
        if m:
            name = m.group(1)
        m = re.search(field + r":(\d+)", line)
        if m and name:
            regs[name] = int(m.group(1))
    return regs


def short_name(mangled: str) -> str:
    kind = re.search(r"(flash_\w+?kernel|flash_\w+?_o|flash_bwd_convert_dq)", mangled)
    cfg = re.search(r"Config(?:I|ILi)(\d+)(?:ELb(\d))?", mangled)
    flags = re.findall(r"Lb(\d)", mangled)
    dtype = ("e4m3" if "e4m3_t" in mangled else "bf16" if "nv_bfloat16" in mangled
             else "fp16")
    label = kind.group(1) if kind else mangled[:40]
    if cfg:
        label += f" d{cfg.group(1)}"
    if flags:
        label += " [" + ",".join(flags) + "]"
    return f"{label} {dtype}"


# A kernel's config in its mangled name: fmha::gpu::FlashFwdConfig<128, false> is
# N4fmha3gpu14FlashFwdConfigILi128ELb0EEE.
_CFG = re.compile(r"\d+(Flash\w*Config)I((?:L[ib]\d+E)+)E")


def config_of(mangled: str) -> str | None:
    """The config a kernel is instantiated with, as C++ (`FlashFwdConfig<128, false>`)."""
    m = _CFG.search(mangled)
    if not m:
        return None
    args = [("true" if v == "1" else "false") if kind == "b" else v
            for kind, v in re.findall(r"L([ib])(\d+)E", m.group(2))]
    return f"{m.group(1)}<{', '.join(args)}>"


def launch_shapes(configs: set[str], src_root: Path, nvcc: str) -> dict[str, tuple[int, int]]:
    """(threads, dynamic shared-memory bytes) per CTA of each config, as its launcher passes
    them: a host program printing Cfg::kThreads and Cfg::kSmemBytes, compiled against src_root
    and run here (host code only: no GPU needed)."""
    order = sorted(configs)
    lines = ["#include <cstdio>", '#include "cuda/flash_fwd.cuh"', '#include "cuda/flash_bwd.cuh"']
    if any("Sm90" in c for c in order):
        lines.append('#include "cuda/flash_fwd_sm90.cuh"')
    lines.append("int main() {")
    for c in order:
        lines.append(f'  std::printf("%d %zu\\n", int(fmha::gpu::{c}::kThreads), '
                     f"size_t(fmha::gpu::{c}::kSmemBytes));")
    lines += ["  return 0;", "}"]
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "shapes.cu", Path(tmp) / "shapes"
        src.write_text("\n".join(lines) + "\n")
        subprocess.run([nvcc, "-std", "c++17", "-DNDEBUG", f"-I{src_root / 'csrc'}",
                        f"-I{src_root / 'third_party'}", "-gencode", "arch=compute_80,code=sm_80",
                        "-o", str(exe), str(src)],
                       check=True, capture_output=True, text=True)
        out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    shapes = [tuple(int(x) for x in line.split()) for line in out.splitlines()]
    return dict(zip(order, shapes))


# The sizes a plain full-block call's rows, keys and columns lie inside (FwdParams fields; the
# backward's BwdParams starts with them), and where the kernel's first parameter starts in the
# constant bank: 0x160 before sm_90, 0x210 from it.
BOUND_FIELDS = ("seqlen_q", "seqlen_k", "head_dim", "head_dim_v")
# Parameters a plain call fixes (no window, not causal: fmha/params.h), whose values decide
# tests on them (the backward's key range of a row block) by interval arithmetic.
PLAIN_VALUES = {"window_left": -1, "window_right": -1}


def param_base(arch: str) -> int:
    return 0x210 if int(re.match(r"\d+", arch).group(0)) >= 90 else 0x160


def plain_bounds(src_root: Path, nvcc: str) -> tuple[int, ...]:
    """Byte offsets of BOUND_FIELDS, then of PLAIN_VALUES' fields, in fmha::FwdParams: a host
    program printing them, compiled against src_root and run here (as launch_shapes)."""
    lines = ["#include <cstddef>", "#include <cstdio>", '#include "fmha/params.h"', "int main() {"]
    lines += [f'  std::printf("%zu\\n", offsetof(fmha::FwdParams, {f}));'
              for f in BOUND_FIELDS + tuple(PLAIN_VALUES)]
    lines += ["  return 0;", "}"]
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "bounds.cu", Path(tmp) / "bounds"
        src.write_text("\n".join(lines) + "\n")
        subprocess.run([nvcc, "-std", "c++17", f"-I{src_root / 'csrc'}",
                        f"-I{src_root / 'third_party'}", "-o", str(exe), str(src)],
                       check=True, capture_output=True, text=True)
        out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return tuple(int(x) for x in out.split())


def _disasm_env() -> dict:
    env = dict(os.environ)
    nvd = find_tool("nvdisasm")
    if nvd:
        env["NVDISASM_PATH"] = str(Path(nvd).parent)
        env["PATH"] = env.get("PATH", "") + os.pathsep + str(Path(nvd).parent)
    return env


def inner_trip(blocks: list[Block], loop: LoopStats) -> list:
    """The blocks of `loop`'s path that lie in an inner loop whose body holds HMMA (its one
    counted trip):
    e.g. the main backward's dQ work units where a warp takes several (FlashBwdConfig::kDqUnits
    / kWarps)."""
    by_start = {b.start: b for b in blocks}
    on_path = {b.start for b in loop.path}
    inner: set = set()
    for head, (_, body) in natural_loops(blocks).items():
        if head in on_path and head != loop.path[0].start and any(
                by_start[x].count("MMA") for x in body):
            inner |= body & on_path
    return [b for b in loop.path if b.start in inner]


# Bytes a warp moves through shared memory per instruction: ldmatrix by its matrix count (8 x 8
# 16-bit elements each), LDS/STS and cp.async by their width per lane.
_LDSM_MATRICES = {"1": 1, "2": 2, "4": 4}
_LANE_BYTES = {"U8": 1, "S8": 1, "U16": 2, "S16": 2, "64": 8, "128": 16}


def ldg_bytes(instr: Instr) -> int:
    """Bytes one lane reads with a global load (LDG.E.128: 16, LDG.E: 4, LDG.E.U16: 2; 0 for
    other instructions and `@!PT` placeholders)."""
    if instr.base != "LDG" or instr.pred.strip() == "@!PT":
        return 0
    width = [_LANE_BYTES[m] for m in instr.op.split(".")[1:] if m in _LANE_BYTES]
    return width[-1] if width else 4


def smem_bytes(instr: Instr) -> int:
    """Shared-memory bytes one warp reads or writes with instr (0 for other instructions and for
    `@!PT` ones, which never execute: ptxas's placeholders)."""
    if instr.pred.strip() == "@!PT":
        return 0
    mods = instr.op.split(".")[1:]
    if instr.base == "LDSM":
        return 128 * _LDSM_MATRICES.get(mods[-1] if mods else "1", 1)
    if instr.base in ("LDS", "STS", "LDGSTS"):
        # LDGSTS.E.BYPASS.LTC128B.128: the last width-like modifier is the copy's size.
        width = [_LANE_BYTES[m] for m in mods if m in _LANE_BYTES]
        return 32 * (width[-1] if width else 4)
    return 0


def pass_counts(blocks: list[Block], loop: LoopStats, inner_trips: int = 1) -> dict:
    """One pass's instructions ("path") and COUNTED opcodes, an inner loop with HMMA on the path
    counted inner_trips times; "smem_bytes": what the pass's warp moves through shared memory
    (ldmatrix, LDS, STS, cp.async stores); "int": its integer and address instructions
    (INT_OPS, register moves aside); "ex2": its MUFU.EX2, the exponentials."""
    extra = inner_trip(blocks, loop) * (inner_trips - 1)
    counts = {"path": loop.path_count() + sum(len(b.instrs) for b in extra)}
    for c in COUNTED + COUNTED_SM90:
        counts[c] = loop.path_count(c) + sum(b.count(c) for b in extra)
    for c in ("LDL", "STL"):
        counts[c] = loop.path_count(c) + sum(b.count(c) for b in extra)
    instrs = [i for b in loop.path + extra for i in b.instrs]
    counts["smem_bytes"] = sum(smem_bytes(i) for i in instrs)
    counts["int"] = sum(i.base in INT_OPS and not i.op.startswith("IMAD.MOV") for i in instrs)
    counts["ex2"] = sum(i.op.startswith("MUFU.EX2") for i in instrs)
    return counts


def report(files: list[str], arch: str, src_root: Path, nvcc: str, cuobjdump: str,
           kernel_re: str, also: tuple = (), inner_trips: int = 1, keep: Path | None = None,
           reuse: bool = False, decide: dict | None = None, show_branches: bool = False
           ) -> list[dict]:
    rows = []
    env = _disasm_env()
    offs = plain_bounds(src_root, nvcc)
    bounds = frozenset([param_base(arch) + off for off in offs[:len(BOUND_FIELDS)]] +
                       [(param_base(arch) + off, v) for off, v in
                        zip(offs[len(BOUND_FIELDS):], PLAIN_VALUES.values())])
    with tempfile.TemporaryDirectory() as tmp:
        for f in files:
            cubin = (keep or Path(tmp)) / (Path(f).stem + f".sm{arch}.cubin")
            if reuse and cubin.is_file():
                print(f"sass_report: reusing {cubin}", file=sys.stderr)
            else:
                subprocess.run([nvcc, "-std", "c++17", "-O3", "-DNDEBUG",
                                f"-I{src_root / 'csrc'}", f"-I{src_root / 'third_party'}",
                                "-cubin", "-o", str(cubin), str(src_root / f), "-gencode",
                                f"arch=compute_{arch},code=sm_{arch}"],
                               check=True, capture_output=True, text=True)
            sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True,
                                  text=True, check=True, env=env).stdout
            if keep:
                cubin.with_suffix(".sass").write_text(sass)
            regs = registers(cubin, cuobjdump)
            for name, instrs in parse(sass).items():
                if not re.search(kernel_re, name):
                    continue
                blocks = blocks_of(instrs)
                # The Hopper kernels' roles (producer, consumer; the rare product beside the
                # consumer's loop) need the natural-loop search.
                hopper = "sm90" in name
                loop = main_loop(blocks, also, natural=hopper)
                if loop is None:
                    continue
                row = dict(file=f, kernel=short_name(name), mangled=name, arch=f"sm_{arch}",
                           regs=regs.get(name, -1), body=loop.body, config=config_of(name))
                row.update(pass_counts(blocks, loop, inner_trips))
                body, ends = loop_region(blocks, loop, natural=hopper)
                row["plain"] = [] if hopper else [
                    dict(name=pp.name, **pass_counts(blocks, pp.loop, inner_trips))
                    for pp in plain_passes(blocks, loop.header, body, ends, also, decide,
                                           bounds)]
                if show_branches:
                    print(f"  {row['kernel']} {row['arch']}: branches of the loop "
                          f"{loop.header:#x}..{loop.back_edge:#x}", file=sys.stderr)
                    for line in branch_listing(blocks, loop.header, body,
                                               {b.start for b in loop.path}, bounds):
                        print("    " + line, file=sys.stderr)
                rows.append(row)
    configs = {r["config"] for r in rows if r["config"]}
    shapes = launch_shapes(configs, src_root, nvcc) if configs else {}
    for r in rows:
        r["threads"], r["smem"] = shapes.get(r["config"], (0, 0))
        r["ctas"], r["ctas_limit"] = (ctas_per_sm(arch, r["regs"], r["threads"], r["smem"])
                                      if r["threads"] else (0, "?"))
    return rows


# --- the decode kernel -----------------------------------------------------------------------

# flash_decode_kernel<T, C, kHeadDim, kRows> (cuda/flash_decode.cuh) instantiations that --decode
# compiles and counts: (T, C, head dim, rows per CTA). 16-bit caches at the common head dims,
# and both row counts the launcher picks at d = 128 for them and for two 8-bit formats.
DECODE_KERNELS = [
    ("half_t", "half_t", 64, 8),
    ("half_t", "half_t", 128, 4),
    ("half_t", "half_t", 128, 8),
    ("half_t", "Code8<KvCode::kInt8>", 128, 4),
    ("half_t", "Code8<KvCode::kInt8>", 128, 8),
    ("half_t", "Code8<KvCode::kE4M3>", 128, 4),
    ("half_t", "Code8<KvCode::kE4M3>", 128, 8),
]
DECODE_CHUNK = 32  # keys per warp pass: one per lane (kDecodeChunk)
# The issue limit the decode report converts instructions into: an H200 (as an H100 SXM, 132
# SMs of 4 warp schedulers, one instruction per scheduler per cycle) at its 1.98 GHz boost
# clock, against its 4.8 TB/s of HBM3e. A ceiling: stalls only lower what issue allows.
H200_SMS, H200_SCHEDULERS, H200_GHZ, H200_TBPS = 132, 4, 1.98, 4.8


def _decode_shape(mangled: str) -> tuple[int, int, str]:
    """(head dim, rows, cache format) from flash_decode_kernel's mangled name."""
    m = re.findall(r"Li(\d+)ELi(\d+)EE", mangled)
    if not m:
        raise ValueError(f"not a flash_decode_kernel instantiation: {mangled}")
    d, rows = (int(x) for x in m[-1])
    code = re.search(r"Code8ILNS_6KvCodeE(\d)E", mangled)
    fmt = {"1": "int8", "2": "e4m3", "3": "e5m2"}[code.group(1)] if code else (
        "bf16" if "nv_bfloat16" in mangled else "fp16")
    return d, rows, fmt


def decode_pass(blocks: list[Block], d: int, rows: int, also: tuple = ()) -> dict:
    """One warp's pass over a chunk of 32 keys of flash_decode_kernel, in its steady state.

    The key loop is the natural loop with the most FFMA. Each product of a pass, q K^T and P V,
    is rows x d FFMA per lane; either may run in a loop nested in the key loop (P V always: the
    steady loop, the paged one, the general one for partial chunks and masked pairs; q K^T for
    8-bit caches). One trip of such a loop is its path with the most FFMA, then the most bytes
    read by unguarded loads (a row's load, not its zero fill; a guarded vector load and its
    scalar fallback, which no trip runs both of, count nothing), then the most `also` opcodes,
    then the fewest instructions, and the loop runs rows x d / (its FFMA per trip) trips. The pass is then the
    path from the key loop's head to its back edge, nested loops standing for all their trips,
    that issues both products (at least 2 x rows x d FFMA: the count is capped there, so the
    FFMA of a rare region count too) in the fewest instructions: a rare path (a
    soft cap's division, a bias, a paged table, a partial chunk) adds instructions and is left
    out, and so are the scalar fallbacks of the vector loads. A lower bound of what a pass
    issues, as `path` is for the other kernels; "ldg_bytes" (what the path's loads read, per
    warp) shows when it is too low: a loop whose row loads are all guarded and may be skipped
    (a zero fill past the chunk's end) is counted without them, and then reads less than the
    chunk's K and V -- name their opcode in `also` to count them."""
    by_start = {b.start: b for b in blocks}
    loops = natural_loops(blocks)
    ffma = lambda bs: sum(by_start[y].count("FFMA") for y in bs)  # noqa: E731
    head = max(loops, key=lambda h: ffma(loops[h][1]))
    latches, body = loops[head]
    nested = {h: loops[h] for h in loops if h != head and h in body and ffma(loops[h][1])}
    # the outermost of them (a loop nested in one of these counts within its trip)
    nested = {h: lb for h, lb in nested.items()
              if not any(h in bd for g, (_, bd) in nested.items() if g != h)}
    need = rows * d
    trips = {}
    for h, (lat, bd) in nested.items():
        trip = _best(by_start, h, bd, lat, lambda x: (
            x.count("FFMA"), sum(ldg_bytes(i) for i in x.instrs if not i.pred),
            *(sum(i.op == op for i in x.instrs) for op in also), -len(x.instrs)))
        f = sum(b.count("FFMA") for b in trip)
        if f == 0 or need % f:
            raise RuntimeError(f"decode: the loop at {h:#x} has {f} FFMA a trip, which does not "
                               f"divide {rows} x {d}")
        trips[h] = (trip, need // f)
    # The key loop with each nested loop standing as its head alone: its instructions are all
    # its trips', its FFMA a product's, its successors the loop's exits.
    inside = set().union(*(bd for _, bd in nested.values())) if nested else set()
    nodes = (body - inside) | set(nested)
    succ, cost, products = {}, {}, {}
    for x in nodes:
        if x in nested:
            trip, n = trips[x]
            bd = nested[x][1]
            succ[x] = sorted({v for y in bd for v in by_start[y].succ if v not in bd} & nodes)
            cost[x], products[x] = n * sum(len(b.instrs) for b in trip), need
        else:
            succ[x] = [v for v in by_start[x].succ if v in nodes]
            cost[x], products[x] = len(by_start[x].instrs), by_start[x].count("FFMA")
    view = {x: Block(x, [], succ[x]) for x in nodes}
    topo, fwd = _forward_dag(view, head, nodes)
    # per block: FFMA so far (capped at both products') -> (fewest instructions, previous block)
    goal = 2 * need
    best: dict = {head: {min(goal, products[head]): (cost[head], None, None)}}
    for x in topo:
        for f, (n, _, _) in list(best.get(x, {}).items()):
            for v in fwd[x]:
                g, cand = min(goal, f + products[v]), n + cost[v]
                slot = best.setdefault(v, {})
                if g not in slot or cand < slot[g][0]:
                    slot[g] = (cand, x, f)
    ends = [(best[x][goal][0], x) for x in latches if goal in best.get(x, {})]
    if not ends:
        raise RuntimeError(f"decode: no path of the key loop at {head:#x} issues {goal} FFMA")
    _, x = min(ends)
    f, path = goal, []
    while x is not None:
        path.append(x)
        _, px, pf = best[x][f]
        x, f = px, pf
    counted = []
    for x in reversed(path):
        counted += trips[x][0] * trips[x][1] if x in nested else [by_start[x]]
    out = {"path": sum(len(b.instrs) for b in counted),
           "ldg_bytes": 32 * sum(ldg_bytes(i) for b in counted for i in b.instrs),
           "loops": [(trips[x][1], sum(len(b.instrs) for b in trips[x][0]))
                     for x in reversed(path) if x in nested]}
    for c in ("FFMA", "LDG", "LDS", "SHFL", "MUFU"):
        out[c] = sum(b.count(c) for b in counted)
    return out


def decode_report(arch: str, src_root: Path, nvcc: str, cuobjdump: str, also: tuple = ()
                  ) -> list[dict]:
    lines = ['#include "cuda/flash_decode.cuh"', "namespace fmha {", "namespace gpu {"]
    for t, c, d, r in DECODE_KERNELS:
        lines.append(f"template __global__ void flash_decode_kernel<{t}, {c}, {d}, {r}>("
                     "FwdParams, DecodeLaunch);")
    lines += ["}  // namespace gpu", "}  // namespace fmha"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = Path(tmp) / "decode.cu", Path(tmp) / f"decode.sm{arch}.cubin"
        src.write_text("\n".join(lines) + "\n")
        subprocess.run([nvcc, "-std", "c++17", "-O3", "-DNDEBUG", f"-I{src_root / 'csrc'}",
                        f"-I{src_root / 'third_party'}", "-cubin", "-o", str(cubin), str(src),
                        "-gencode", f"arch=compute_{arch},code=sm_{arch}"],
                       check=True, capture_output=True, text=True)
        sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True,
                              check=True, env=_disasm_env()).stdout
        regs = registers(cubin, cuobjdump)
        for name, instrs in parse(sass).items():
            if "flash_decode_kernel" not in name:
                continue
            d, r, fmt = _decode_shape(name)
            elem = 2 if fmt in ("fp16", "bf16") else 1
            row = dict(kernel=f"decode d{d} rows {r} {fmt} cache", arch=f"sm_{arch}",
                       regs=regs.get(name, -1), d=d, rows=r,
                       cache_bytes=DECODE_CHUNK * 2 * d * elem)
            row.update(decode_pass(blocks_of(instrs), d, r, also))
            rows.append(row)
    return sorted(rows, key=lambda x: (x["kernel"], x["arch"]))


def print_decode_table(rows: list[dict]) -> None:
    head = ["kernel", "arch", "regs", "pass", "nested loops (trips x instrs)", "FFMA", "LDG",
            "LDS", "SHFL", "MUFU", "non-FFMA/FFMA", "K+V bytes", "loaded", "bytes/instr",
            "issue-bound TB/s (of 4.8)"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        per = r["cache_bytes"] / r["path"]
        tbps = H200_SMS * H200_SCHEDULERS * H200_GHZ * 1e9 * per / 1e12
        cells = [r["kernel"], r["arch"], r["regs"], r["path"],
                 ", ".join(f"{n} x {k}" for n, k in r["loops"]),
                 r["FFMA"], r["LDG"], r["LDS"], r["SHFL"], r["MUFU"],
                 f"{(r['path'] - r['FFMA']) / r['FFMA']:.2f}", r["cache_bytes"], r["ldg_bytes"],
                 f"{per:.2f}", f"{tbps:.2f} ({tbps / H200_TBPS:.0%})"]
        print("| " + " | ".join(str(c) for c in cells) + " |")


# --- flash-attn 2 -------------------------------------------------------------------------

# The instantiation files (csrc/flash_attn/src/), and per file the kernel comparable to fmha's
# plain path. flash-attn's launchers (flash_fwd_launch_template.h, flash_bwd_launch_template.h)
# pick the tile at run time and instantiate every bool variant; these are what an A100 or H100
# (sm80/sm90: >= 144 KiB shared memory per block, not sm86/sm89) runs for fp16, no dropout, not
# causal, no window, no ALiBi, no softcap, seqlens multiples of the tile (Is_even_MN) and
# d == head dim (Is_even_K), no returned softmax:
#   forward: run_mha_fwd_hdim64  -> Flash_fwd_kernel_traits<64, 128, 128, 4, false, false>
#            run_mha_fwd_hdim128 -> Flash_fwd_kernel_traits<128, 128, 64, 4, false, false>
#            flash_fwd_kernel<traits, Is_dropout=0, Is_causal=0, Is_local=0, Has_alibi=0,
#                             Is_even_MN=1, Is_even_K=1, Is_softcap=0, Return_softmax=0>
#   backward: run_mha_bwd_hdim64  -> Flash_bwd_kernel_traits<64, 128, 128, 8, 4, 4, 4, false, false>
#             run_mha_bwd_hdim128 -> Flash_bwd_kernel_traits<128, 64, 128, 8, 2, 4, 2, false, false>
#             flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<traits, Is_dropout=0, Is_causal=0,
#                 Is_local=0, Has_alibi=0, Is_even_MN=1, Is_even_K=1, Is_softcap=0>
#             (run_flash_bwd -> run_flash_bwd_seqk_parallel; its dot(dO, O) and dQ-convert
#             kernels have no HMMA loop and are not reported)
FA_FILES = [
    "csrc/flash_attn/src/flash_fwd_hdim64_fp16_sm80.cu",
    "csrc/flash_attn/src/flash_fwd_hdim128_fp16_sm80.cu",
    "csrc/flash_attn/src/flash_bwd_hdim64_fp16_sm80.cu",
    "csrc/flash_attn/src/flash_bwd_hdim128_fp16_sm80.cu",
]
FA_PLAIN = {
    ("flash_fwd_kernel", 64): ((64, 128, 128, 4, 0, 0), (0, 0, 0, 0, 1, 1, 0, 0)),
    ("flash_fwd_kernel", 128): ((128, 128, 64, 4, 0, 0), (0, 0, 0, 0, 1, 1, 0, 0)),
    ("flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel", 64):
        ((64, 128, 128, 8, 4, 4, 4, 0, 0), (0, 0, 0, 0, 1, 1, 0)),
    ("flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel", 128):
        ((128, 64, 128, 8, 2, 4, 2, 0, 0), (0, 0, 0, 0, 1, 1, 0)),
}
# flash-attn's setup.py nvcc flags (its CUDAExtension; torch adds -D__CUDA_NO_HALF*__, which
# these -U undo, and host-only defines). No -DNDEBUG: torch's build does not pass it to nvcc.
FA_NVCC_FLAGS = ["-O3", "-std=c++17", "-U__CUDA_NO_HALF_OPERATORS__",
                 "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__",
                 "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "--expt-relaxed-constexpr",
                 "--expt-extended-lambda", "--use_fast_math"]
# Integer / address arithmetic, counted on the path (moves, IMAD.MOV, excluded).
INT_OPS = {"IMAD", "IADD3", "IADD", "VIADD", "LEA", "SHF", "LOP3", "ISETP", "SEL", "IMNMX",
           "VIMNMX", "IABS", "PRMT", "UIMAD", "UIADD3", "ULEA", "USHF", "ULOP3", "UISETP", "USEL",
           "UIMNMX", "UPRMT"}
# Per SM: shared memory a CTA can get (bytes; 1 KiB more is reserved per CTA), registers,
# threads, CTAs.
SM_LIMITS = {"80": (164 * 1024, 65536, 2048, 32), "90": (228 * 1024, 65536, 2048, 32)}


def _fa_parse(mangled: str):
    """(kernel, traits ints/bools, variant bools) of a flash-attn kernel's mangled name."""
    kind = re.search(r"flash\d*(flash_\w+?kernel)I", mangled)
    traits = re.search(r"Flash_(?:fwd|bwd)_kernel_traitsI((?:L[ib]\d+E)+)", mangled)
    flags = re.search(r"((?:Lb\dE)+)EEvNS_", mangled)
    if not (kind and traits):
        return None
    t = tuple(int(x) for x in re.findall(r"L[ib](\d+)E", traits.group(1)))
    f = tuple(int(x) for x in re.findall(r"Lb(\d)E", flags.group(1))) if flags else ()
    return kind.group(1), t, f


def fa_short_name(mangled: str) -> str:
    p = _fa_parse(mangled)
    if p is None:
        return mangled[:60]
    kind, t, f = p
    dtype = "bf16" if "bfloat16" in mangled else "fp16"
    d, bm, bn, w = t[:4]
    label = f"fa2 {'fwd' if kind == 'flash_fwd_kernel' else 'bwd'} d{d} {bm}x{bn} w{w}"
    if FA_PLAIN.get((kind, d)) != (t, f):
        label += f" <{kind} {','.join(map(str, t))} | {','.join(map(str, f))}>"
    return f"{label} {dtype}"


def fa_smem(mangled: str) -> int:
    """Dynamic shared memory per CTA, bytes: kernel_traits.h's kSmemSize (forward) and
    kSmemSize1colblock (backward, the size run_flash_bwd_seqk_parallel launches with), 2-byte
    elements."""
    kind, t, _ = _fa_parse(mangled)
    if kind == "flash_fwd_kernel":
        d, bm, bn, _, _, share_qk = t
        q, kv = bm * d * 2, bn * d * 2 * 2
        return max(q, kv) if share_qk else q + kv
    d, bm, bn, _, _, _, _, v_in_regs, no_double = t
    qdo = bm * d * (2 if no_double else 3) * 2
    kv = bn * d * 2 * 2
    ds = p = bm * bn * 2
    return qdo + (kv + ds + p if not v_in_regs else max(kv, kv // 2 + ds + p))


def ctas_per_sm(arch: str, regs: int, threads: int, smem: int) -> tuple[int, str]:
    """Resident CTAs per SM and the limiting resource (registers allocated per warp in units of
    256, rounded from regs per thread to a multiple of 8; 1 KiB of shared memory reserved per
    CTA)."""
    smem_sm, regs_sm, threads_sm, ctas_sm = SM_LIMITS.get(arch, SM_LIMITS["90"])
    warps = -(-threads // 32)
    per_warp = -(-(-(-regs // 8) * 8 * 32) // 256) * 256
    lim = {"regs": (regs_sm // per_warp) // warps if regs > 0 else ctas_sm,
           "smem": smem_sm // (smem + 1024) if smem else ctas_sm,
           "threads": threads_sm // threads, "CTAs": ctas_sm}
    n = min(lim.values())
    return n, "+".join(k for k, v in lim.items() if v == n)


def _unpack_fa(src: Path, tmp: Path) -> Path:
    """A flash-attn source tree from a directory or an sdist tarball."""
    if src.is_dir():
        return src
    import tarfile
    with tarfile.open(src) as tf:
        if hasattr(tarfile, "data_filter"):
            tf.extractall(tmp / "fa-src", filter="data")
        else:
            tf.extractall(tmp / "fa-src")
    tops = [p for p in (tmp / "fa-src").iterdir() if p.is_dir()]
    return tops[0] if len(tops) == 1 else tmp / "fa-src"


def find_torch_include(given: Path | None) -> Path | None:
    if given:
        return given
    site = Path(sysconfig.get_paths()["purelib"]) / "torch" / "include"
    if (site / "ATen").is_dir():
        return site
    try:
        out = subprocess.run([sys.executable, "-c", "import torch.utils.cpp_extension as c; "
                              "print(c.include_paths()[0])"], capture_output=True, text=True,
                             check=True).stdout.strip()
        return Path(out) if out else None
    except (subprocess.CalledProcessError, OSError):
        return None


def fa_report(fa_src: Path, cutlass: Path | None, torch_inc: Path, archs: list[str], nvcc: str,
              cuobjdump: str, kernel_re: str | None, also: tuple = (), keep: Path | None = None,
              show_loops: bool = False, reuse: bool = False) -> list[dict]:
    rows = []
    env = _disasm_env()
    with tempfile.TemporaryDirectory() as tmpname:
        tmp = Path(tmpname)
        root = _unpack_fa(fa_src, tmp)
        cutlass_inc = (cutlass or root / "csrc" / "cutlass") / "include"
        if not (cutlass_inc / "cute").is_dir():
            raise SystemExit(f"sass_report: no CUTLASS/CuTe headers at {cutlass_inc} "
                             f"(give --cutlass)")
        incs = [root / "csrc" / "flash_attn", root / "csrc" / "flash_attn" / "src", cutlass_inc]
        if not (torch_inc / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").is_file():
            stub = tmp / "stub" / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
            stub.parent.mkdir(parents=True)
            stub.write_text("#pragma once\n// stand-in: generated in CUDA builds of PyTorch only\n"
                            "#define C10_CUDA_BUILD_SHARED_LIBS\n")
            incs.append(tmp / "stub")
        incs += [torch_inc, torch_inc / "torch" / "csrc" / "api" / "include"]
        for arch in archs:
            for f in FA_FILES:
                out_dir = keep or tmp
                cubin = out_dir / (Path(f).stem + f".sm{arch}.cubin")
                cmd = [nvcc, *FA_NVCC_FLAGS, *(f"-I{i}" for i in incs), "-cubin", "-o", str(cubin),
                       str(root / f), "-gencode", f"arch=compute_{arch},code=sm_{arch}"]
                if reuse and cubin.is_file():
                    print(f"sass_report: reusing {cubin}", file=sys.stderr)
                else:
                    print("sass_report: " + " ".join(cmd), file=sys.stderr)
                    r = subprocess.run(cmd, capture_output=True, text=True)
                    if r.returncode:
                        raise SystemExit(f"sass_report: nvcc failed on {f}:\n{r.stderr[-4000:]}")
                sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True,
                                      text=True, check=True, env=env).stdout
                if keep:
                    cubin.with_suffix(".sass").write_text(sass)
                regs = registers(cubin, cuobjdump)
                stack = registers(cubin, cuobjdump, "STACK")
                for name, instrs in parse(sass).items():
                    p = _fa_parse(name)
                    if p is None:
                        continue
                    kind, t, fl = p
                    if kernel_re is not None:
                        if not re.search(kernel_re, name):
                            continue
                    elif FA_PLAIN.get((kind, t[0])) != (t, fl):
                        continue
                    label = fa_short_name(name)
                    loop = natural_main_loop(blocks_of(instrs), also,
                                             f"{label} sm_{arch}" if show_loops else None)
                    if loop is None:
                        continue
                    threads = t[3] * 32
                    smem = fa_smem(name)
                    n, lim = ctas_per_sm(arch, regs.get(name, -1), threads, smem)
                    row = dict(file=f, kernel=label, mangled=name, arch=f"sm_{arch}",
                               regs=regs.get(name, -1), stack=stack.get(name, -1), body=loop.body,
                               path=loop.path_count(), tile=f"{t[1]}x{t[2]}", warps=t[3],
                               smem=smem, ctas=n, ctas_limit=lim, head=loop.header,
                               back=loop.back_edge)
                    for c in COUNTED + ("LDL", "STL", "RED", "REDG", "LDG"):
                        row[c] = loop.path_count(c)
                    fa_blocks = blocks_of(instrs)
                    body, ends = loop_region(fa_blocks, loop, natural=True)
                    row["plain"] = [dict(name=pp.name, **pass_counts(fa_blocks, pp.loop))
                                    for pp in plain_passes(fa_blocks, loop.header, body, ends,
                                                           also)]
                    row["RED"] += row.pop("REDG")  # sm_90 spells the global reduction REDG
                    row["smem_bytes"] = sum(smem_bytes(i) for b in loop.path for i in b.instrs)
                    row["int"] = sum(i.base in INT_OPS and not i.op.startswith("IMAD.MOV")
                                     for b in loop.path for i in b.instrs)
                    row["ex2"] = sum(i.op.startswith("MUFU.EX2") for b in loop.path
                                     for i in b.instrs)
                    rows.append(row)
    return rows


def print_fa_details(rows: list[dict]) -> None:
    head = ["kernel", "arch", "tile (M x N)", "warps", "smem/CTA", "regs", "stack", "CTAs/SM",
            "LDL+STL", "LDG", "RED", "int/addr", "path/HMMA", "loop (head..back edge)"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        cells = [r["kernel"], r["arch"], r["tile"], r["warps"],
                 f"{r['smem']} ({r['smem'] / 1024:g} KiB)", r["regs"], r["stack"],
                 f"{r['ctas']} ({r['ctas_limit']})", f"{r['LDL']}+{r['STL']}", r["LDG"], r["RED"],
                 r["int"],
                 f"{r['path'] / r['HMMA']:.2f}" if r["HMMA"] else "nan",
                 f"{r['head']:#x}..{r['back']:#x}"]
        print("| " + " | ".join(str(c) for c in cells) + " |")


def print_table(rows: list[dict]) -> None:
    head = ["kernel", "arch", "regs", "body", "path", *COUNTED, "of which MUFU.EX2",
            "int/addr", "LDL+STL", "non-HMMA/HMMA", "without spills", "smem bytes/HMMA"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        ratio = (r["path"] - r["HMMA"]) / r["HMMA"] if r["HMMA"] else float("nan")
        per = r["smem_bytes"] / r["HMMA"] if r["HMMA"] else float("nan")
        cells = [r["kernel"], r["arch"], r["regs"], r["body"], r["path"], *(r[c] for c in COUNTED),
                 r.get("ex2", "-"), r.get("int", "-"), f"{r.get('LDL', 0)}+{r.get('STL', 0)}",
                 f"{ratio:.2f}", f"{without_spills(r):.2f}", f"{per:.0f}"]
        print("| " + " | ".join(str(c) for c in cells) + " |")


def without_spills(counts: dict) -> float:
    """Non-HMMA instructions per HMMA with the local-memory traffic (LDL, STL: ptxas's spill
    code) left out: what the kernel would issue had it not spilled (the spills' address
    arithmetic, where there is any, stays in)."""
    if not counts["HMMA"]:
        return float("nan")
    return (counts["path"] - counts["HMMA"] - counts.get("LDL", 0) - counts.get("STL", 0)
            ) / counts["HMMA"]


def print_plain_table(rows: list[dict]) -> None:
    """The plain call's passes (plain_passes) of each kernel, beside the rule of thumb's path."""
    head = ["kernel", "arch", "pass", "path", "HMMA", "LDSM", "LDS", "STS", "LDL+STL",
            "non-HMMA/HMMA", "without spills", "smem bytes/HMMA"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        for p in [dict(r, name="path (rule of thumb)")] + r.get("plain", []):
            h = p["HMMA"]
            cells = [r["kernel"], r["arch"], p["name"], p["path"], h, p["LDSM"], p["LDS"],
                     p["STS"], f"{p.get('LDL', 0)}+{p.get('STL', 0)}",
                     f"{(p['path'] - h) / h:.2f}" if h else "nan",
                     f"{without_spills(p):.2f}", f"{p['smem_bytes'] / h:.0f}" if h else "nan"]
            print("| " + " | ".join(str(c) for c in cells) + " |")


def print_hopper_table(rows: list[dict]) -> None:
    """The wgmma kernels (sm_90a): one pass of the key-block loop of one warpgroup -- for the
    forward, a consumer's (the producer's loop holds no wgmma). HGMMA per pass is the wgmma
    count of the pass (S = Q K^T: d / 16; P V: kBlockN / 16), HMMA must be 0; SYNCS are the
    mbarrier waits and arrivals; instructions per HGMMA are what the warp issues besides its
    wgmma. `regs` is the launch count (setmaxnreg moves registers between the roles)."""
    head = ["kernel", "arch", "regs", "body", "path", "HGMMA", "HMMA", "SYNCS", "UTMALDG", "BAR",
            "MUFU", "of which MUFU.EX2", "SHFL", "LDS", "STS", "LDL+STL", "non-HGMMA/HGMMA"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        g = r["HGMMA"]
        cells = [r["kernel"], r["arch"], r["regs"], r["body"], r["path"], g, r["HMMA"],
                 r["SYNCS"], r["UTMALDG"], r["BAR"], r["MUFU"], r.get("ex2", "-"), r["SHFL"],
                 r["LDS"], r["STS"], f"{r.get('LDL', 0)}+{r.get('STL', 0)}",
                 f"{(r['path'] - g) / g:.2f}"]
        print("| " + " | ".join(str(c) for c in cells) + " |")


def print_launch_table(rows: list[dict]) -> None:
    head = ["kernel", "arch", "config", "threads", "smem/CTA", "regs", "CTAs/SM"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        cells = [r["kernel"], r["arch"], f"`{r['config']}`", r["threads"],
                 f"{r['smem']} ({r['smem'] / 1024:g} KiB)", r["regs"],
                 f"{r['ctas']} ({r['ctas_limit']})"]
        print("| " + " | ".join(str(c) for c in cells) + " |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", help="instantiation files, relative to --src-root")
    ap.add_argument("--arch", action="append", help="sm number, repeatable (default 80)")
    ap.add_argument("--src-root", type=Path, default=ROOT, help="the source tree (default: this one)")
    ap.add_argument("--kernel", default=None,
                    help="regex on the mangled kernel name (default: "
                         "flash_(fwd|bwd|bwd_dq)_kernel; with --flash-attn, the plain variants "
                         "of FA_PLAIN)")
    ap.add_argument("--also", action="append", default=[], metavar="OPCODE",
                    help="prefer paths through this exact opcode too (repeatable), after HMMA "
                         "and LDGSTS: e.g. LDS.128 takes the strong zero's vote scan, which "
                         "calls with a mask, bias, dropout or window run; with --decode, in the "
                         "nested loops' trips: e.g. LDG.E.U16 takes guarded row loads")
    ap.add_argument("--inner-trips", type=int, default=1, metavar="N",
                    help="count an inner loop with HMMA on the path N times per pass (default 1): "
                         "the main backward's dQ work units where a warp runs several "
                         "(FlashBwdConfig::kDqUnits / kWarps: 2 at d = 128 with extras and at "
                         "d = 256; one at d = 128 plain). N applies to every kernel counted: give "
                         "one file (and --kernel) per trip count")
    ap.add_argument("--flash-attn", type=Path, metavar="SRC",
                    help="report flash-attn 2's kernels instead: its source tree or sdist tarball")
    ap.add_argument("--cutlass", type=Path, metavar="DIR",
                    help="CUTLASS checkout for --flash-attn (default SRC/csrc/cutlass)")
    ap.add_argument("--torch-include", type=Path, metavar="DIR",
                    help="PyTorch's include directory for --flash-attn (default: the current "
                         "Python's torch)")
    ap.add_argument("--keep", type=Path, metavar="DIR",
                    help="keep the cubins and their SASS in DIR")
    ap.add_argument("--reuse", action="store_true",
                    help="with --keep: analyse the cubins an earlier run left in DIR instead of "
                         "compiling them again (compile flags are not checked)")
    ap.add_argument("--decode", action="store_true",
                    help="report the decode kernel instead (DECODE_KERNELS): one warp's pass "
                         "over 32 keys, and the read rate the issue slots allow on an H200")
    ap.add_argument("--decide", action="append", default=[], metavar="ADDR=SIDE",
                    help="the side (taken or fall) a plain call takes at the conditional branch "
                         "at ADDR (hex, as --branches lists it) of the main loop, overriding "
                         "the rule of thumb and the bound decisions (e.g. a test no plain call "
                         "decides). Repeatable; addresses are one build's, so give one file and "
                         "--kernel")
    ap.add_argument("--branches", action="store_true",
                    help="list the main loop's conditional branches on stderr: address, class "
                         "(bound=taken|fall, warp, vote, data, call), the two sides, whether the "
                         "path takes them")
    ap.add_argument("--loops", action="store_true",
                    help="with --flash-attn: list every loop holding HMMA on stderr")
    a = ap.parse_args()
    if a.inner_trips < 1:
        ap.error("--inner-trips takes a count of 1 or more")
    decide = {}
    for d in a.decide:
        addr, _, side = d.partition("=")
        if side not in ("taken", "fall"):
            ap.error(f"--decide {d}: give ADDR=taken or ADDR=fall")
        decide[int(addr, 16)] = side
    nvcc = find_tool("nvcc")
    cuobjdump = find_tool("cuobjdump")
    if not nvcc or not cuobjdump or not find_tool("nvdisasm"):
        print("sass_report: needs nvcc, cuobjdump and nvdisasm (pip install nvidia-cuda-cuobjdump "
              "nvidia-cuda-nvdisasm)", file=sys.stderr)
        return 2
    if a.decode:
        rows = []
        for arch in a.arch or ["80"]:
            rows += decode_report(arch, a.src_root.resolve(), nvcc, cuobjdump, tuple(a.also))
        print_decode_table(rows)
        return 0
    if a.keep:
        a.keep.mkdir(parents=True, exist_ok=True)
    if a.flash_attn:
        torch_inc = find_torch_include(a.torch_include)
        if torch_inc is None or not (torch_inc / "ATen").is_dir():
            print("sass_report: flash-attn needs PyTorch's headers (--torch-include DIR)",
                  file=sys.stderr)
            return 2
        rows = fa_report(a.flash_attn.resolve(), a.cutlass.resolve() if a.cutlass else None,
                         torch_inc.resolve(), a.arch or ["80"], nvcc, cuobjdump, a.kernel,
                         tuple(a.also), a.keep.resolve() if a.keep else None, a.loops,
                         a.reuse and a.keep is not None)
        print_table(rows)
        print()
        print_plain_table(rows)
        print()
        print_fa_details(rows)
        return 0
    rows = []
    for arch in a.arch or ["80"]:
        rows += report(a.files or DEFAULT_FILES, arch, a.src_root.resolve(), nvcc, cuobjdump,
                       a.kernel or r"flash_(fwd|bwd|bwd_dq|fwd_sm90)_kernel", tuple(a.also),
                       a.inner_trips,
                       a.keep.resolve() if a.keep else None, a.reuse and a.keep is not None,
                       decide, a.branches)
    hopper = [r for r in rows if r["HGMMA"]]
    rows = [r for r in rows if not r["HGMMA"]]
    if rows:
        print_table(rows)
        print()
        print_plain_table(rows)
        print()
        print_launch_table(rows)
    if hopper:
        print()
        print_hopper_table(hopper)
    return 0


if __name__ == "__main__":
    sys.exit(main())
