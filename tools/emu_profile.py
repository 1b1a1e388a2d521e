#!/usr/bin/env python3
"""Memory traffic of fmha's CUDA kernels, counted by the SIMT emulator (fmha._cuda_emu).

Runs each kernel family once at a small representative shape on the emulated kernels, with
256-byte-aligned inputs (cudaMalloc's alignment), and prints per kernel what Nsight Compute
would report for the accesses the emulator sees (csrc/cuda/emu/runtime.h, KernelTraffic):

  ldmatrix     shared-memory wavefronts / the conflict-free ideal (1.00 = no bank conflict)
  cp.async st  the same for cp.async's shared-memory stores
  cp.async ld  global load efficiency: bytes asked for / (32 x 32-byte sectors touched)

Ordinary loads and stores (the decode kernel's, the epilogues') are plain C++ in the emulator
and are not counted. No GPU is needed; the numbers are exact for the model, not timed.

    python tools/emu_profile.py                      # Markdown table on stdout
    python tools/emu_profile.py --out emu_traffic.md   # with a header
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

import numpy as np


def aligned(rng, shape, dtype=np.float16, align=256):
    """Random normal values in a C-contiguous array whose data starts on an `align`-byte
    boundary."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(n + align, np.uint8)
    off = (-raw.ctypes.data) % align
    out = raw[off:off + n].view(dtype).reshape(shape)
    out[...] = rng.standard_normal(shape).astype(dtype)
    return out


#: (label, batch, seqlen_q, seqlen_k, heads, head_dim, keywords): 128 queries and keys per
#: head -- one 128-row query tile of the plain forwards (two 64-row ones of the extras, and of
#: the backward's steps), two or more key blocks, so the steady-state loop runs; bias adds the
#: "extras" kernels.
CASES = [
    ("d32", 1, 128, 128, 2, 32, {}),
    ("d64", 1, 128, 128, 2, 64, {}),
    ("d96", 1, 128, 128, 2, 96, {}),
    ("d128", 1, 128, 128, 2, 128, {}),
    ("d256", 1, 128, 128, 2, 256, {}),
    ("d64 causal+bias", 1, 128, 128, 2, 64, {"causal": True, "bias": True}),
    # the backward's two other kernels: dQ without atomics, and dbias
    ("d128 deterministic", 1, 128, 128, 2, 128, {"deterministic": True}),
    ("d32 deterministic", 1, 128, 128, 2, 32, {"deterministic": True}),
    ("d64 bias grad", 1, 128, 128, 2, 64, {"bias": True, "bias_grad": True}),
]
#: Keywords only the backward takes.
_BACKWARD_ONLY = ("deterministic", "bias_grad")


def profile(cases=CASES):
    import fmha
    from fmha import _cuda_emu
    from fmha._core import _kernel_module

    rng = np.random.default_rng(0)
    rows = []
    for label, b, sq, sk, h, d, kw in cases:
        q, do = (aligned(rng, (b, sq, h, d)) for _ in range(2))
        k, v = (aligned(rng, (b, sk, h, d)) for _ in range(2))
        kw = dict(kw)
        bwd_kw = {name: kw.pop(name) for name in _BACKWARD_ONLY if name in kw}
        if kw.pop("bias", False):
            kw["bias"] = aligned(rng, (b, h, sq, sk))
        with _kernel_module(_cuda_emu):
            for pass_ in ("forward", "backward"):
                if pass_ == "forward":
                    _cuda_emu.reset_stats()
                    out, lse = fmha.attention(q, k, v, return_lse=True, **kw)
                else:
                    _cuda_emu.reset_stats()
                    fmha.attention_backward(do, q, k, v, out, lse, **kw, **bwd_kw)
                for t in _cuda_emu.traffic():
                    if t["ldmatrix_requests"] or t["cp_async_requests"]:
                        rows.append(dict(case=label, pass_=pass_, **t))
    return rows


def _ratio(a, b):
    return f"{a / b:.2f}" if b else "—"


def table(rows) -> str:
    lines = ["| case | kernel | ldmatrix requests | ldmatrix wavefronts / ideal | cp.async "
             "requests | cp.async store wavefronts / ideal | cp.async global efficiency |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        eff = (f"{r['cp_async_global_bytes'] / (32 * r['cp_async_global_sectors']):.1%}"
               if r["cp_async_global_sectors"] else "—")
        lines.append(
            f"| {r['case']} ({r['pass_']}) | `{r['kernel']}` | {r['ldmatrix_requests']} | "
            f"{_ratio(r['ldmatrix_wavefronts'], r['ldmatrix_ideal_wavefronts'])} | "
            f"{r['cp_async_requests']} | "
            f"{_ratio(r['cp_async_wavefronts'], r['cp_async_ideal_wavefronts'])} | {eff} |")
    return "\n".join(lines)


HEADER = """# Memory traffic of the CUDA kernels, counted by the emulator ({date})

Command (no GPU; exact counts for the model in `csrc/cuda/emu/runtime.h`, `KernelTraffic`):

```bash
python tools/emu_profile.py --out {out}
```

Shapes: batch 1, 2 heads, 128 queries and 128 keys (one or two query tiles: 128 or 64 rows), float16,
256-byte-aligned inputs; "d64 causal+bias" takes the kernels with extras, "d128 deterministic"
the backward's dQ kernel without atomics, "d64 bias grad" the dbias kernel. Columns: ldmatrix
and cp.async-store shared-memory wavefronts over the conflict-free ideal (1.00 = no bank
conflict); global load efficiency = bytes asked for / (32 x sectors touched). Reading:
`docs/cuda_kernels.md`, "Shared-memory traffic".

"""


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None,
                    help="also write the table, under a header naming the command, to this file")
    a = ap.parse_args(argv)
    if importlib.util.find_spec("fmha._cuda_emu") is None:
        sys.exit("fmha._cuda_emu is not built (FMHA_BUILD_TESTING=ON builds it)")
    text = table(profile())
    print(text)
    if a.out:
        import time
        with open(a.out, "w") as fh:
            fh.write(HEADER.format(date=time.strftime("%Y-%m-%d"), out=a.out) + text + "\n")


if __name__ == "__main__":
    main()
