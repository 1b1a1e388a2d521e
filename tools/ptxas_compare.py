#!/usr/bin/env python3
"""Compare two reports of tools/ptxas_check.py kernel by kernel: registers per thread on each
architecture, spills / stack frames (a `*` in the report), and what the registers allow of
occupancy -- the CTAs one SM can hold by registers alone, for 128-thread CTAs (4 warps, the
shape of every fmha kernel except the d = 256 forward with extras, which has 8 warps).

    python tools/ptxas_check.py > before.txt   # at the old commit
    python tools/ptxas_check.py > after.txt    # at the new one
    python tools/ptxas_compare.py before.txt after.txt

A register count moving inside one occupancy class changes nothing the SM schedules; the
last column says whether the class moved. Exit status 1 when a kernel gained a spill or
stack frame or lost occupancy by registers, else 0.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

_ROW = re.compile(r"^(\S.*?)\s+(\d+)(\*?)\s+(\d+)(\*?)\s*$")


def read_table(path: Path) -> dict[str, list[tuple[int, bool]]]:
    """kernel -> [(registers, spills) per architecture column] from the report's table."""
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("registers"))
    table = {}
    for line in lines[start + 1:]:
        m = _ROW.match(line)
        if m:
            table[m.group(1)] = [(int(m.group(2)), m.group(3) == "*"),
                                 (int(m.group(4)), m.group(5) == "*")]
    return table


def ctas_by_registers(registers: int, threads: int = 128) -> int:
    """CTAs per SM that 64K registers allow (allocation in units of 8 per thread)."""
    per_thread = (registers + 7) // 8 * 8
    return 65536 // (per_thread * threads)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    a = ap.parse_args(argv)
    before, after = read_table(a.before), read_table(a.after)
    archs = ("sm_80", "sm_90")
    worse = 0
    counts = {"up": 0, "down": 0, "same": 0}
    print(f"{'kernel':<72} {'arch':<6} {'before':>7} {'after':>7}  CTAs/SM by registers")
    for name in sorted(set(before) | set(after)):
        if name not in before or name not in after:
            print(f"{name:<72} only in {'after' if name in after else 'before'}")
            continue
        for arch, (rb, sb), (ra, sa) in zip(archs, before[name], after[name]):
            cb, ca = ctas_by_registers(rb), ctas_by_registers(ra)
            key = "up" if ra > rb else "down" if ra < rb else "same"
            counts[key] += 1
            if sa and not sb or ca < cb:
                worse += 1
            if key == "same" and sa == sb:
                continue
            occupancy = f"{cb} -> {ca}" if ca != cb else f"{cb} (same)"
            print(f"{name:<72} {arch:<6} {rb:>6}{'*' if sb else ' '} {ra:>6}{'*' if sa else ' '}"
                  f"  {occupancy}")
    print(f"\n{counts['same']} unchanged, {counts['down']} fewer registers, {counts['up']} more; "
          f"{worse} with a new spill or fewer CTAs per SM by registers")
    return 1 if worse else 0


if __name__ == "__main__":
    sys.exit(main())
