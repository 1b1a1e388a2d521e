"""The `fmha-bench` command: runs the C++ benchmark binary installed in the package (fmha/_bin),
next to the shared library it links (docs/guides/cpp.md)."""

import os
import sys


def fmha_bench() -> None:
    exe = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bin", "fmha-bench")
    if not os.path.exists(exe):
        sys.exit(f"fmha-bench: {exe} is missing; reinstall fmha")
    os.execv(exe, [exe] + sys.argv[1:])
