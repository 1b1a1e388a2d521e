#!/usr/bin/env python3
"""Memory traffic of fmha's CUDA kernels, counted by the SIMT emulator (fmha._cuda_emu).

Runs each kernel family once at a small representative shape on the emulated kernels, with
256-byte-aligned inputs (cudaMalloc's alignment), and prints per kernel what Nsight Compute
would report for the accesses the emulator sees (csrc/cuda/emu/runtime.h, KernelTraffic):

  ldmatrix     shared-memory wavefronts / the conflict-free ideal (1.00 = no bank conflict)
  cp.async st  the same for cp.async's shared-memory stores
  cp.async ld  global load efficiency: bytes asked for / (32 x 32-byte sectors touched)
  wgmma        (the sm_90 forward) shared-memory wavefronts of the operand reads through the
               matrix descriptors, one 8 x 16-byte core matrix per phase after the swizzle,
               / the ideal
  TMA          (the sm_90 forward) the same for the tile copies, 128 bytes of a box per phase

The sm_90 forward (csrc/cuda/flash_fwd_sm90.cuh) runs as the emulator runs it everywhere,
FMHA_CUDA_KERNEL=sm90 (SM90_CASES; forward only: the backward has no sm_90 kernel).
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
#: The sm_90 forward, fp16, bf16 and e4m3 (unit descales), at each head dim it takes and
#: with a causal mask (the edge blocks' path): (label, batch, seqlen_q, seqlen_k, heads,
#: head_dim, keywords); dtype is a keyword here.
SM90_CASES = [
    ("sm90 d64", 1, 128, 256, 2, 64, {}),
    ("sm90 d64 causal", 1, 128, 256, 2, 64, {"causal": True}),
    ("sm90 d128", 1, 128, 256, 2, 128, {}),
    ("sm90 d128 bf16", 1, 128, 256, 2, 128, {"dtype": "bfloat16"}),
    ("sm90 d256", 1, 128, 256, 2, 256, {}),
    ("sm90 d128 e4m3", 1, 128, 256, 2, 128, {"dtype": "float8_e4m3fn"}),
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


def profile_sm90(cases=SM90_CASES):
    """The sm_90 forward's counters per case (FMHA_CUDA_KERNEL=sm90 under the emulator); fails
    if a case's forward did not run in that kernel."""
    import os

    import fmha
    from fmha import _cuda_emu
    from fmha._core import _kernel_module

    rng = np.random.default_rng(0)
    rows = []
    saved = os.environ.get("FMHA_CUDA_KERNEL")
    os.environ["FMHA_CUDA_KERNEL"] = "sm90"
    try:
        for label, b, sq, sk, h, d, kw in cases:
            kw = dict(kw)
            dtype = kw.pop("dtype", "float16")
            if dtype in ("bfloat16", "float8_e4m3fn"):
                import torch  # NumPy has neither
                q, k, v = (torch.from_numpy(aligned(rng, (b, n, h, d), np.float32))
                           .to(getattr(torch, dtype)) for n in (sq, sk, sk))
                if dtype == "float8_e4m3fn":
                    ones = torch.ones((b, h), dtype=torch.float32)
                    kw.update(descale_q=ones, descale_k=ones, descale_v=ones)
            else:
                q = aligned(rng, (b, sq, h, d))
                k, v = (aligned(rng, (b, sk, h, d)) for _ in range(2))
            with _kernel_module(_cuda_emu):
                _cuda_emu.forward_kernel()  # clear
                _cuda_emu.reset_stats()
                fmha.attention(q, k, v, **kw)
                used = _cuda_emu.forward_kernel()
            if used != "sm90":
                raise RuntimeError(f"{label}: the forward ran in the {used or 'no'} kernel, not sm90")
            for t in _cuda_emu.traffic():
                if t["wgmma_requests"] or t["tma_requests"]:
                    rows.append(dict(case=label, pass_="forward", **t))
    finally:
        if saved is None:
            del os.environ["FMHA_CUDA_KERNEL"]
        else:
            os.environ["FMHA_CUDA_KERNEL"] = saved
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


def table_sm90(rows) -> str:
    lines = ["| case | kernel | wgmma requests | wgmma operand wavefronts / ideal | TMA requests "
             "| TMA wavefronts / ideal |",
             "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['case']} ({r['pass_']}) | `{r['kernel']}` | {r['wgmma_requests']} | "
            f"{_ratio(r['wgmma_wavefronts'], r['wgmma_ideal_wavefronts'])} | "
            f"{r['tma_requests']} | {_ratio(r['tma_wavefronts'], r['tma_ideal_wavefronts'])} |")
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
`docs/cuda_kernels.md`, "Shared-memory traffic". The second table: the sm_90 forward
(FMHA_CUDA_KERNEL=sm90, 128 queries, 256 keys), its wgmma operand reads (one 8 x 16-byte
core matrix per phase) and TMA tile copies (128 bytes per phase), after the 128-byte swizzle.

"""


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None,
                    help="also write the table, under a header naming the command, to this file")
    a = ap.parse_args(argv)
    if importlib.util.find_spec("fmha._cuda_emu") is None:
        sys.exit("fmha._cuda_emu is not built (FMHA_BUILD_TESTING=ON builds it)")
    text = table(profile()) + "\n\n" + table_sm90(profile_sm90())
    print(text)
    if a.out:
        import time
        with open(a.out, "w") as fh:
            fh.write(HEADER.format(date=time.strftime("%Y-%m-%d"), out=a.out) + text + "\n")


if __name__ == "__main__":
    main()
