"""Measured error of fmha against float64, per dtype, as a Markdown report.

For one representative shape (b=1, h=4, s=512, d=64, causal and not) it draws float64
inputs, rounds them to each dtype, and compares fmha's forward (out) and backward (dq, dk,
dv; dout = fixed random) with fmha.reference run in float64 on the *rounded* inputs, so
the numbers are the error of the computation, not of the input rounding. Next to fmha it
reports a naive attention written in torch and computed entirely in the same dtype (the
baseline of the tests' tolerance rule, docs/testing.md). Each error is
max|x - ref| / max|ref| over the tensor (relative to the tensor's largest entry).

The CPU kernels run once per CPU kernel level (FMHA_CPU_ISA, each in a subprocess, since
the level is fixed at import), because the bfloat16 rounding of P and dS depends on it
(docs/semantics.md, "Precision"). With --emu the CUDA kernels also run, under the CPU
emulator (fmha._cuda_emu; float16/bfloat16 only; slow, a few minutes).

    python tools/precision_report.py --out precision.md [--emu]

docs/cpu_kernels.md, "Precision", summarises a run.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np

B, H, S, D = 1, 4, 512, 64
DTYPES = ("float64", "float32", "bfloat16", "float16")
LEVELS = ("avx512bf16", "avx512", "avx2", "scalar")
KEYS = ("out", "dq", "dk", "dv")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def inputs(causal: bool):
    """float64 q, k, v, dout (b, s, h, d); the same for every dtype and level."""
    rng = np.random.default_rng(2026 + int(causal))
    return [rng.standard_normal((B, S, H, D)) for _ in range(4)]


def rounded(x64, dtype):
    """torch tensor of x64 rounded to dtype."""
    import torch
    return torch.from_numpy(x64).to(getattr(torch, dtype))


def rel_err(x, ref) -> float:
    x = x.detach().double().numpy() if hasattr(x, "detach") else np.asarray(x, np.float64)
    return float(np.max(np.abs(x - ref)) / np.max(np.abs(ref)))


def run_fmha(dtype, causal, module=None):
    """{key: relative error} of fmha (torch autograd path) in dtype against float64."""
    import torch
    import fmha
    from fmha import reference
    from fmha._core import _kernel_module
    q, k, v, do = (rounded(x, dtype) for x in inputs(causal))
    ref_in = [x.double().numpy() for x in (q, k, v, do)]
    ref_out, _ = reference.attention_forward(*ref_in[:3], causal=causal)
    ref_grads = reference.attention_backward(ref_in[3], *ref_in[:3], causal=causal)[:3]
    refs = dict(out=ref_out, dq=ref_grads[0], dk=ref_grads[1], dv=ref_grads[2])
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    with _kernel_module(module or fmha._C):
        out = fmha.attention(*leaves, causal=causal)
        out.backward(do)
    got = dict(out=out, dq=leaves[0].grad, dk=leaves[1].grad, dv=leaves[2].grad)
    errs = {key: rel_err(got[key], refs[key]) for key in KEYS}
    # naive attention in the same dtype (every op in dtype), the tests' baseline
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from conftest import naive_results
    naive = naive_results(q, k, v, do, causal=causal)
    errs.update({f"naive_{key}": rel_err(naive[key], refs[key]) for key in KEYS})
    # the floor: the exact result rounded to dtype (the best a stored result can be)
    errs.update({f"floor_{key}": rel_err(rounded(refs[key], dtype), refs[key]) for key in KEYS})
    return errs


def child(level: str, emu: bool) -> dict:
    """Runs in a subprocess with FMHA_CPU_ISA=level (or the emulator): all dtypes, both masks."""
    import torch
    import fmha
    module, dtypes = None, DTYPES
    if emu:
        from fmha import _cuda_emu as module
        dtypes = ("bfloat16", "float16")
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    rows = []
    for dtype in dtypes:
        for causal in (False, True):
            rows.append(dict(dtype=dtype, causal=causal, **run_fmha(dtype, causal, module)))
    return dict(level="emulated CUDA" if emu else fmha.cpu_isa(), rows=rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="precision.md")
    ap.add_argument("--emu", action="store_true", help="also the CUDA kernels, emulated")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.child == "emu")))
        return
    import torch
    import fmha
    best = fmha.cpu_isa()
    levels = list(LEVELS[LEVELS.index(best):]) if best in LEVELS else [best]
    runs = []
    for level in levels + (["emu"] if args.emu else []):
        env = dict(os.environ)
        if level != "emu":
            env["FMHA_CPU_ISA"] = level
        res = subprocess.run([sys.executable, __file__, "--child", level], env=env, check=True,
                             capture_output=True, text=True)
        runs.append(json.loads(res.stdout.strip().splitlines()[-1]))
        print(f"{runs[-1]['level']}: done", file=sys.stderr)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        commit = ""
    cmd = "python tools/precision_report.py" + (" --emu" if args.emu else "") + \
        (f" --out {args.out}" if args.out != "precision.md" else "")
    lines = [
        f"# fmha's error against float64, per dtype ({datetime.date.today().isoformat()})",
        "",
        "Written by:",
        "",
        "```bash",
        cmd,
        "```",
        "",
        f"Host: {cpu_model()} ({platform.machine()}, {os.cpu_count()} logical CPUs; fmha "
        f"CPU features {', '.join(fmha.cpu_features())}); best CPU kernel level "
        f"`{best}`; fmha {fmha.__version__}, torch {torch.__version__}, NumPy "
        f"{np.__version__}" + (f", commit {commit}" if commit else "") + ".",
        "",
        f"Shape: batch {B}, {H} heads, seqlen_q = seqlen_k = {S}, head_dim {D}; q, k, v and "
        f"dout standard normal, drawn in float64 and rounded to the dtype; the reference is "
        f"`fmha.reference` in float64 on the rounded inputs. Each cell is "
        f"max|x - ref| / max|ref| over the tensor. fmha runs through `fmha.attention` and "
        f"torch autograd; \"naive\" is attention written in torch with every operation in the "
        f"dtype (the baseline of the tests' tolerance rule, `docs/testing.md`). Where the "
        f"16-bit paths round P and dS: `docs/semantics.md`, \"Precision\".",
        "",
    ]
    lines += ["## The floor: the float64 result rounded to the dtype", "",
              "The best any kernel can store; the tables below are to be read against it.",
              "", "| dtype | mask | out | dq | dk | dv |", "|---|---|---:|---:|---:|---:|"]
    for r in runs[0]["rows"]:
        lines.append(f"| {r['dtype']} | {'causal' if r['causal'] else 'none'} | "
                     + " | ".join(f"{r['floor_' + key]:.2e}" for key in KEYS) + " |")
    lines.append("")
    for run in runs:
        level = run["level"]
        title = (f"## CUDA kernels under the CPU emulator (`fmha._cuda_emu`, not a GPU)"
                 if level == "emulated CUDA" else f"## CPU kernels, level `{level}`")
        lines += [title, "",
                  "| dtype | mask | out | dq | dk | dv | naive out | naive dq | naive dk | naive dv |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in run["rows"]:
            cells = [f"{r[key]:.2e}" for key in KEYS] + [f"{r['naive_' + key]:.2e}"
                                                         for key in KEYS]
            lines.append(f"| {r['dtype']} | {'causal' if r['causal'] else 'none'} | "
                         + " | ".join(cells) + " |")
        lines.append("")
    Path(args.out).write_text("\n".join(lines))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
