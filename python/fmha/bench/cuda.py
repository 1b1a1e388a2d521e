"""GPU benchmark: fmha vs torch SDPA (forced to its FlashAttention backend), in one process.

    python -m fmha.bench --cuda                   # the grid below, float16 and bfloat16
    python -m fmha.bench --cuda --quick           # two small shapes, for a smoke run
    python -m fmha.bench --cuda --save            # into benchmarks/results/<gpu>.json (h200, ...)
    python -m fmha.bench --cuda --decode --save   # KV-cache decode vs the GPU's read bandwidth

Grid: batch 4, 16 heads, seqlen 4096 and 8192, head_dim 64 and 128, causal and not; and head_dim
256 at seqlen 4096. --peers adds fmha's sm_80 kernel forced (sm80: on an H100/H200 fmha runs its
Hopper forward) and SDPA's cuDNN backend (cudnn). For
every case it times the forward and the forward+backward of both implementations on the
same CUDA tensors ((batch, seqlen, heads, head_dim) for fmha, transposed views of them for
SDPA) with CUDA events: warm-up calls, then the median of --reps calls, each between its own
pair of events. It reports TFLOP/s (forward 4·b·h·sq·sk·d, halved for causal; backward 2.5×
forward, so forward+backward 3.5×), the ratio fmha / SDPA (> 1: fmha is faster) and the
largest difference between the two outputs. --save puts the rows into the GPU's results file
(section "cuda"); --out writes them to a JSON file with a CSV and a Markdown table beside it
(the same row format as python -m fmha.bench; "gflops" there is GFLOP/s). Speed is only ever
reported here, never asserted by tests.

--decode runs fmha/bench/decode.py's cases on the GPU instead: attention_with_kvcache
(contiguous, paged 16 and 256), fmha.attention and torch SDPA (enable_gqa) on the same cache,
as GB/s of K+V read and % of the read bandwidth measured in the same run.

Exit status: 0 when every fmha measurement ran, 1 when one failed (recorded in its row's
"error"), 2 when there is no usable GPU.
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from typing import List, Optional

from ._host import Save, add_output_arguments, command_line, commit, save_of, set_command
from ._host import median_seconds_on as _median_s
from ._host import write_result

# (name, batch, heads, seqlen, head_dim, causal): heads_q == heads_kv, seqlen_q == seqlen_k,
# so SDPA's top-left causal mask and fmha's bottom-right one are the same mask.
GRID = [(f"b4h16s{s}d{d}{'-causal' if c else ''}", 4, 16, s, d, c)
        for s in (4096, 8192) for d in (64, 128) for c in (False, True)]
# Head dim 256 (the Hopper forward's third tile), at one length.
GRID += [(f"b4h16s4096d256{'-causal' if c else ''}", 4, 16, 4096, 256, c) for c in (False, True)]
QUICK = [("b2h8s1024d64", 2, 8, 1024, 64, False), ("b2h8s1024d128-causal", 2, 8, 1024, 128, True)]
# --peers: implementations timed beside fmha (default kernel choice) and SDPA's flash backend.
# sm80: fmha with FMHA_CUDA_KERNEL=sm80 (the sm_80 kernel where the Hopper one would run);
# cudnn: torch SDPA forced to its cuDNN backend.
PEERS = {"sm80": "fmha_sm80", "cudnn": "torch_sdpa_cudnn"}


@dataclass
class Row:
    case: str
    dtype: str
    pass_: str  # "fwd" | "fwd+bwd"
    impl: str   # "fmha" | "torch_sdpa_flash"
    median_s: Optional[float]
    gflops: Optional[float]
    ratio_vs_sdpa: Optional[float]  # SDPA time / fmha time, on fmha's rows
    max_abs_diff: Optional[float] = None  # fmha vs SDPA output (fwd) or dq/dk/dv (fwd+bwd)
    error: Optional[str] = None


def flops(b, h, sq, sk, d, causal, with_bwd):
    f = 4.0 * b * h * sq * sk * d
    if causal:
        f /= 2
    return f * (3.5 if with_bwd else 1.0)


def _short(e: BaseException) -> str:
    msg = f"{type(e).__name__}: {e}".strip()
    return msg.splitlines()[0][:300] if msg else type(e).__name__


def run(cases, dtypes, passes, reps: int, out_path: Optional[str],
        device: str = "cuda", save: Optional[Save] = None, peers=()) -> List[Row]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import fmha

    if device == "cuda":
        dev = torch.device("cuda", torch.cuda.current_device())
        props = torch.cuda.get_device_properties(dev)
        gpu, capability, sms = props.name, f"{props.major}.{props.minor}", props.multi_processor_count
    else:
        dev = torch.device(device)
        gpu, capability, sms = f"{device} (smoke run, wall-clock timing)", None, None
    where = f"{gpu} (sm_{capability.replace('.', '')}, {sms} SMs)" if capability else gpu
    print(f"fmha {fmha.__version__} | {where} | torch {torch.__version__} (CUDA "
          f"{torch.version.cuda}) | median of {reps}", flush=True)

    def sdpa(q, k, v, causal):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                is_causal=causal).transpose(1, 2)

    def fmha_sm80(q, k, v, causal):
        old = os.environ.get("FMHA_CUDA_KERNEL")
        os.environ["FMHA_CUDA_KERNEL"] = "sm80"  # read by the dispatcher per call
        try:
            return fmha.attention(q, k, v, causal=causal)
        finally:
            if old is None:
                del os.environ["FMHA_CUDA_KERNEL"]
            else:
                os.environ["FMHA_CUDA_KERNEL"] = old

    def sdpa_cudnn(q, k, v, causal):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                is_causal=causal).transpose(1, 2)

    # float8_e4m3fn rows: fmha on e4m3 codes of q, k, v with per-(batch, head) descales
    # (amax / 448, flash-attn 3's recipe), its peers on the bfloat16 tensors they came from.
    f8 = {}

    def quantise(x):
        amax = x.float().abs().amax(dim=(1, 3)).clamp(min=1e-12)  # (batch, heads)
        scale = amax / 448.0
        return (x.float() / scale[:, None, :, None]).to(torch.float8_e4m3fn), scale.contiguous()

    def fmha_fp8(q, k, v, causal):
        return fmha.attention(f8["q"], f8["k"], f8["v"], descale_q=f8["dq"],
                              descale_k=f8["dk"], descale_v=f8["dv"], causal=causal)

    impls = {"fmha": lambda q, k, v, causal: fmha.attention(q, k, v, causal=causal),
             "torch_sdpa_flash": sdpa}
    if "sm80" in peers:
        impls["fmha_sm80"] = fmha_sm80
    if "cudnn" in peers:
        impls["torch_sdpa_cudnn"] = sdpa_cudnn
    rows: List[Row] = []
    fp8_name = "float8_e4m3fn"
    total = len(cases) * sum(1 if dt == fp8_name else len(passes) for dt in dtypes)
    done = 0
    all_impls = impls
    for (name, b, h, s, d, causal) in cases:
        for dtype_name in dtypes:
            fp8 = dtype_name == fp8_name
            dtype = torch.bfloat16 if fp8 else getattr(torch, dtype_name)
            g = torch.Generator(device=dev).manual_seed(0)
            q, k, v, dout = (torch.randn(b, s, h, d, generator=g, device=dev, dtype=dtype)
                             for _ in range(4))
            impls = all_impls
            if fp8:  # forward only; fmha's sm_80 kernel has no float8 path
                (f8["q"], f8["dq"]), (f8["k"], f8["dk"]), (f8["v"], f8["dv"]) = (
                    quantise(x) for x in (q, k, v))
                impls = {i: (fmha_fp8 if i == "fmha" else fn) for i, fn in all_impls.items()
                         if i != "fmha_sm80"}
            for pass_ in passes:
                if fp8 and pass_ != "fwd":
                    continue
                done += 1
                print(f"[{done}/{total}] {name} {dtype_name} {pass_}", end="", flush=True)
                with_bwd = pass_ == "fwd+bwd"
                f = flops(b, h, s, s, d, causal, with_bwd)
                secs, results, errors = {}, {}, {}
                for impl, fn in impls.items():
                    for x in (q, k, v):
                        x.requires_grad_(with_bwd)
                        x.grad = None
                    if with_bwd:
                        def step(fn=fn):
                            for x in (q, k, v):
                                x.grad = None
                            fn(q, k, v, causal).backward(dout)
                    else:
                        def step(fn=fn):
                            with torch.no_grad():
                                fn(q, k, v, causal)
                    try:
                        # The values to compare: one call outside the timing.
                        if with_bwd:
                            step()
                            results[impl] = [x.grad.clone() for x in (q, k, v)]
                        else:
                            with torch.no_grad():
                                results[impl] = [fn(q, k, v, causal).clone()]
                        secs[impl] = _median_s(step, reps, dev)
                    except Exception as e:  # recorded in the row; the run goes on
                        errors[impl] = _short(e)
                    finally:
                        for x in (q, k, v):
                            x.requires_grad_(False)
                            x.grad = None
                diff = None
                if "fmha" in results and "torch_sdpa_flash" in results:
                    diff = max((a.float() - r.float()).abs().max().item()
                               for a, r in zip(results["fmha"], results["torch_sdpa_flash"]))
                results.clear()
                for impl in impls:
                    t = secs.get(impl)
                    ratio = (secs["torch_sdpa_flash"] / t if impl.startswith("fmha") and t and
                             "torch_sdpa_flash" in secs else None)
                    rows.append(Row(name, dtype_name, pass_, impl, t,
                                    f / t / 1e9 if t else None, ratio,
                                    diff if impl == "fmha" else None, errors.get(impl)))
                print("  " + "  ".join(
                    f"{i} {f / secs[i] / 1e12:6.1f} TFLOP/s" if i in secs else f"{i} FAILED"
                    for i in impls) + (f"  | fmha/sdpa {secs['torch_sdpa_flash'] / secs['fmha']:.2f}x"
                                       if "fmha" in secs and "torch_sdpa_flash" in secs else "") +
                      (f"  | max |diff| {diff:.2e}" if diff is not None else ""), flush=True)
                for impl, err in errors.items():
                    print(f"    {impl}: {err}", flush=True)
            del q, k, v, dout
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    table = _table(rows)
    print("\n" + table)
    if out_path or save is not None:
        meta = dict(command=command_line(), commit=commit(), fmha=fmha.__version__, torch=torch.__version__, torch_cuda=torch.version.cuda,
                    gpu=gpu, capability=capability, sms=sms,
                    fmha_cuda_status=fmha.cuda_status(),
                    reps=reps, peer="torch SDPA, SDPBackend.FLASH_ATTENTION",
                    flops="forward 4*b*h*sq*sk*d (halved when causal); fwd+bwd 3.5x forward",
                    host=platform.node(), date=time.strftime("%Y-%m-%d %H:%M:%S"))
        if device != "cuda":  # a smoke run names no GPU, and saves under the CPU's class
            meta["device"] = meta.pop("gpu")
        write_result(dict(meta=meta, rows=[asdict(r) for r in rows]), out_path, save)
    if out_path:
        stem = os.path.splitext(out_path)[0]
        with open(stem + ".csv", "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["case", "dtype", "pass", "impl", "median_s", "tflops", "ratio_vs_sdpa",
                        "max_abs_diff", "error"])
            for r in rows:
                w.writerow([r.case, r.dtype, r.pass_, r.impl,
                            "" if r.median_s is None else f"{r.median_s:.6f}",
                            "" if r.gflops is None else f"{r.gflops / 1e3:.2f}",
                            "" if r.ratio_vs_sdpa is None else f"{r.ratio_vs_sdpa:.3f}",
                            "" if r.max_abs_diff is None else f"{r.max_abs_diff:.3e}",
                            r.error or ""])
        with open(stem + ".md", "w") as fh:
            fh.write(f"`{meta['command']}` on {gpu}, {meta['date']}\n\n{table}\n")
        print(f"wrote {stem}.csv and {stem}.md beside it")
    return rows


def _table(rows: List[Row]) -> str:
    lines = ["| case | dtype | pass | fmha TFLOP/s | SDPA flash TFLOP/s | fmha / SDPA | "
             "max abs diff |", "|---|---|---|---:|---:|---:|---:|"]
    keys = []
    for r in rows:
        if (r.case, r.dtype, r.pass_) not in keys:
            keys.append((r.case, r.dtype, r.pass_))

    def tf(r):
        return "failed" if r is None or r.gflops is None else f"{r.gflops / 1e3:.1f}"

    for key in keys:
        by = {r.impl: r for r in rows if (r.case, r.dtype, r.pass_) == key}
        fm, sd = by.get("fmha"), by.get("torch_sdpa_flash")
        ratio = f"{fm.ratio_vs_sdpa:.2f}×" if fm and fm.ratio_vs_sdpa else "—"
        diff = f"{fm.max_abs_diff:.1e}" if fm and fm.max_abs_diff is not None else "—"
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {tf(fm)} | {tf(sd)} | {ratio} | "
                     f"{diff} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fmha.bench --cuda", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="two small shapes only")
    ap.add_argument("--decode", action="store_true",
                    help="KV-cache decode against the measured read bandwidth")
    ap.add_argument("--dtypes", default="float16,bfloat16")
    ap.add_argument("--kv-dtypes", default="",
                    help="--decode: 8-bit cache encodings to add rows for (int8, "
                         "float8_e4m3fn, float8_e5m2)")
    ap.add_argument("--passes", default="fwd,fwd+bwd")
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--reps", type=int, default=20, help="timed calls per measurement")
    ap.add_argument("--peers", default="",
                    help="also time: sm80 (fmha's sm_80 kernel, FMHA_CUDA_KERNEL=sm80), cudnn "
                         "(SDPA's cuDNN backend); comma-separated")
    add_output_arguments(ap)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: a smoke run of this script (its tests), not a benchmark")
    argv = list(sys.argv[1:] if argv is None else argv)
    a = ap.parse_args(argv)
    set_command(["--cuda"] + argv)
    for dt in a.dtypes.split(","):
        if dt not in ("float16", "bfloat16", "float8_e4m3fn"):
            ap.error(f"--dtypes: {dt!r}; expected float16, bfloat16 and/or float8_e4m3fn "
                     f"(forward only: fmha on e4m3 codes with descales, the peers on the "
                     f"bfloat16 tensors they came from)")
    for p in a.passes.split(","):
        if p not in ("fwd", "fwd+bwd"):
            ap.error(f"--passes: {p!r}; expected fwd and/or fwd+bwd")
    if a.reps < 1:
        ap.error(f"--reps: {a.reps}; expected >= 1")
    cases = QUICK if a.quick else GRID
    if a.cases:
        wanted = a.cases.split(",")
        cases = [c for c in GRID + QUICK if c[0] in wanted]
        unknown = sorted(set(wanted) - {c[0] for c in cases})
        if unknown:
            ap.error(f"--cases: unknown {unknown}; known: {[c[0] for c in GRID + QUICK]}")
    peers = [p for p in a.peers.split(",") if p]
    for p in peers:
        if p not in PEERS:
            ap.error(f"--peers: {p!r}; expected any of {sorted(PEERS)}")

    import torch

    import fmha

    mode = ("decode" if a.decode else "cuda") + ("-quick" if a.quick else "")
    save = save_of(a, mode)
    if a.device == "cpu":
        rows = run(cases, a.dtypes.split(","), a.passes.split(","), a.reps, a.out, "cpu", save)
        return 1 if any(r.impl == "fmha" and r.error for r in rows) else 0
    if not torch.cuda.is_available():
        print(f"python -m fmha.bench --cuda: no GPU: torch.cuda.is_available() is False (torch "
              f"{torch.__version__}, built for CUDA {torch.version.cuda}); fmha.cuda_status(): "
              f"{fmha.cuda_status()}", file=sys.stderr)
        return 2
    if "cuda" not in fmha.backends():
        print(f"python -m fmha.bench --cuda: fmha has no usable CUDA backend: "
              f"fmha.cuda_status(): {fmha.cuda_status()}", file=sys.stderr)
        return 2
    if a.decode:
        from . import decode as bench_decode
        bench_decode.run(a.dtypes.split(","), a.out, None,
                         bench_decode.QUICK_CASES if a.quick else None, device="cuda",
                         kv_dtypes=[x for x in a.kv_dtypes.split(",") if x], save=save)
        return 0
    rows = run(cases, a.dtypes.split(","), a.passes.split(","), a.reps, a.out, save=save,
               peers=peers)
    failed = [r for r in rows if r.impl.startswith("fmha") and r.error]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
