"""The standard suite: fmha vs torch SDPA vs FlexAttention vs naive attention, in one process
(``python -m fmha.bench``: a short selection of it; ``--full``: all of it).

For every case it times the forward and the forward+backward of each implementation on the
same inputs and thread count: fmha, torch SDPA, PyTorch FlexAttention (``flex``:
torch.compile(flex_attention, dynamic=False, fullgraph=True), a causal BlockMask for the
causal cases; forward only, since FlexAttention has no CPU backward in torch 2.13 -- the
reason is printed and recorded in the JSON's meta) and the naive formula. It reports the
median GFLOP/s (forward 4·b·h·sq·sk·d, halved for causal; backward 2.5× forward), the ratios
to torch SDPA and to Flex, and the fraction of the hardware's peak: float32 rows against the
fp32 FMA peak, bfloat16 rows against the AMX tiles' peak (a TDPBF16PS loop) where this process
may use them, else the bf16 dot-product peak (vdpbf16ps) where the CPU has it, else the fp32
FMA peak (the JSON says which). The implementations are timed in
turn, ROUNDS times over, and each round opens with a probe of that peak; every ratio and
fraction is the median of its per-round values, so that a host whose speed drifts (a shared
VM) moves both sides of each ratio together (the peaks in the JSON's meta, probed once at
the start, are for reference: fraction_of_peak divides by each round's own probe). The
implementations' order rotates from round to round. The rows go to a JSON file (with each
row's per-round times and probes) and a CSV beside it (without them), or with --save into
the host's results file. Speed is only ever reported here, never asserted by tests.
"""

from __future__ import annotations

import csv
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import List, Optional

from ._flex import compiled_flex, dynamo_compiles_allowed
from ._host import PROBE_SPREAD_LIMIT, host_meta, probe_spread, timed_rounds, write_result

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
# The default run (python -m fmha.bench with no mode): cases of the standard suite that take
# seconds each on two cores, timed over SHORT_ROUNDS rounds.
SHORT_SUITE = [c for c in STANDARD_SUITE if c[0] in ("b1h8s2048d64-causal", "b4h16s512d64")]
SHORT_ROUNDS = 3
NAIVE_MAX_SCORES = 2**28  # skip the naive formula when b·h·sq·sk floats exceed 1 GiB
# Timing: each implementation gets at least ROUND_SECONDS (and one call) per round.
ROUNDS = 5
ROUND_SECONDS = 0.2


@dataclass
class Row:
    case: str
    dtype: str
    pass_: str  # "fwd" | "fwd+bwd"
    impl: str   # "fmha" | "torch_sdpa" | "flex" | "naive" | "fmha+keypad"
    median_s: float
    gflops: float
    ratio_vs_sdpa: Optional[float]  # for "fmha+keypad": time without mask / time with
    fraction_of_peak: Optional[float] = None  # this GFLOP/s / the round's peak probe
    ratio_vs_flex: Optional[float] = None     # flex time / this time (fmha rows)
    round_s: List[float] = field(default_factory=list)  # seconds per call, per round
    round_peak_gflops: List[float] = field(default_factory=list)  # the rounds' peak probes
    probe_spread: Optional[float] = None  # (max - min) / max of round_peak_gflops
    probes_moved: bool = False  # probe_spread > _host.PROBE_SPREAD_LIMIT: the host drifted


def flops(b, h, sq, sk, d, causal, with_bwd):
    f = 4.0 * b * h * sq * sk * d
    if causal:
        f /= 2
    return f * (3.5 if with_bwd else 1.0)


def _time(fn, min_reps=3, min_seconds=1.0, max_reps=20, warm_up=True):
    if warm_up:
        fn()  # thread pools, allocations, first-touch
    times = []
    start = time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - start < min_seconds and
                                    len(times) < max_reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# The peak probes by name: what a dtype's rows are judged against (peak_of_dtype).
PEAK_PROBES = {"fp32_fma": "cpu_fma_peak_gflops", "bf16_dot": "cpu_bf16_dot_peak_gflops",
               "amx_bf16": "cpu_amx_peak_gflops"}


def measured_peaks(fmha, nthreads: int) -> dict:
    """The fp32 FMA, bf16 dot-product and AMX bf16 tile peaks (GFLOP/s, best of three probes
    each; 0 -> None where the CPU, the OS or the build lacks the instructions), and the peak
    each dtype's rows are judged against: bfloat16 against the AMX tiles where this process may
    use them, else the dot product, else the fp32 FMA peak."""
    fp32 = max(fmha._C.cpu_fma_peak_gflops(nthreads) for _ in range(3))
    bf16 = max(fmha._C.cpu_bf16_dot_peak_gflops(nthreads) for _ in range(3))
    amx = max(fmha._C.cpu_amx_peak_gflops(nthreads) for _ in range(3))
    bf16_kind = "amx_bf16" if amx else "bf16_dot" if bf16 else "fp32_fma"
    return dict(fp32_fma_peak_gflops=fp32, bf16_dot_peak_gflops=bf16 or None,
                amx_bf16_peak_gflops=amx or None,
                peak_of_dtype=dict(float32="fp32_fma", bfloat16=bf16_kind),
                peak_gflops_of_dtype=dict(float32=fp32, bfloat16=amx or bf16 or fp32))


def run(cases, dtypes, passes, out_path: Optional[str], threads: Optional[int],
        flex: bool = True, rounds: Optional[int] = None, save=None):
    """Times the cases (see the module's docstring); rounds: ROUNDS unless given; out_path: a
    JSON file (a CSV beside it); save: a _host.Save (the host's results file)."""
    import torch
    import torch.nn.functional as F

    import fmha

    if threads:
        torch.set_num_threads(threads)
    nthreads = torch.get_num_threads()
    fmha.set_num_threads(nthreads)
    rows: List[Row] = []
    total = len(cases) * len(dtypes) * len(passes)
    peaks = measured_peaks(fmha, nthreads)
    bf16_peak, amx_peak = peaks["bf16_dot_peak_gflops"], peaks["amx_bf16_peak_gflops"]
    print(f"fmha {fmha.__version__} | CPU ISA {fmha.cpu_isa()} | threads {nthreads} | torch "
          f"{torch.__version__}\nhost {fmha._C.cpu_description()}\nmeasured peaks: fp32 FMA "
          f"{peaks['fp32_fma_peak_gflops']:.1f} GFLOP/s, bf16 dot "
          + (f"{bf16_peak:.1f} GFLOP/s" if bf16_peak else "none")
          + (f", AMX bf16 tiles {amx_peak:.1f} GFLOP/s" if amx_peak else "")
          + f"; bfloat16 judged against {peaks['peak_of_dtype'].get('bfloat16', 'none')}",
          flush=True)
    flex_fn, flex_block_mask, flex_error = compiled_flex(torch) if flex else (None, None,
                                                                             "not requested")
    flex_errors = {}
    rounds = rounds or ROUNDS
    with dynamo_compiles_allowed(torch):
        _run_cases(torch, F, fmha, cases, dtypes, passes, rows, total, peaks, flex_fn,
                   flex_block_mask, flex_error, flex_errors, rounds)
    _print_table(rows)
    moved = []
    for r in rows:
        if r.probes_moved and f"{r.case} {r.dtype} {r.pass_}" not in moved:
            moved.append(f"{r.case} {r.dtype} {r.pass_}")
    if moved:
        print(f"WARNING: the peak probes moved by more than {100 * PROBE_SPREAD_LIMIT:.0f}% "
              f"within: {', '.join(moved)} (the host's speed changed during those rows)")
    if out_path or save is not None:
        meta = host_meta(torch, fmha)
        meta.update(peaks, rounds=rounds, probes_moved=moved,
                    flex=dict(compile="torch.compile(flex_attention, dynamic=False, "
                                      "fullgraph=True)", errors=flex_errors))
        write_result(dict(meta=meta, rows=[asdict(r) for r in rows]), out_path, save)
    if out_path:
        with open(os.path.splitext(out_path)[0] + ".csv", "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["case", "dtype", "pass", "impl", "median_s", "gflops", "ratio_vs_sdpa",
                        "fraction_of_peak", "ratio_vs_flex"])
            opt = lambda x: "" if x is None else f"{x:.3f}"  # noqa: E731
            for r in rows:
                w.writerow([r.case, r.dtype, r.pass_, r.impl, f"{r.median_s:.6f}",
                            f"{r.gflops:.2f}", opt(r.ratio_vs_sdpa), opt(r.fraction_of_peak),
                            opt(r.ratio_vs_flex)])
        print(f"wrote {os.path.splitext(out_path)[0]}.csv beside it")
    return rows


def _run_cases(torch, F, fmha, cases, dtypes, passes, rows, total, peaks, flex_fn,
               flex_block_mask, flex_error, flex_errors, rounds=ROUNDS):
    done = 0
    nthreads = fmha.get_num_threads()

    def probe_of(dtype_name):
        """The probe of the peak this dtype's rows are judged against (best of two); None for
        a dtype without one (its rows then have no fraction of peak)."""
        if dtype_name not in peaks["peak_of_dtype"]:
            return None
        f = getattr(fmha._C, PEAK_PROBES[peaks["peak_of_dtype"][dtype_name]])
        return lambda: max(f(nthreads), f(nthreads))

    for (name, b, hq, hkv, sq, sk, d, causal) in cases:
        flex_mask = None
        if flex_fn is not None and causal:
            flex_mask = flex_block_mask(lambda b_, h_, i, j: j <= i, None, None, sq, sk,
                                        device="cpu")
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
            if flex_fn is not None:
                impls["flex"] = lambda q=q, k=k, v=v, m=flex_mask: flex_fn(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                    block_mask=m, enable_gqa=gqa).transpose(1, 2)
            else:
                flex_errors[name] = flex_error
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
                steps = {}
                for impl, fn in impls.items():
                    if impl == "fmha+keypad" and pass_ != "fwd":
                        continue
                    if impl == "flex" and pass_ != "fwd":
                        flex_errors.setdefault(f"{name} {pass_}", "not timed: FlexAttention "
                                               "has no CPU backward in torch 2.13")
                        continue
                    if pass_ == "fwd":
                        def step(fn=fn):
                            with torch.no_grad():
                                fn()
                    else:
                        def step(fn=fn):
                            for x in (q, k, v):
                                x.grad = None
                            fn().sum().backward()
                    steps[impl] = step
                try:
                    for x in (q, k, v):
                        x.requires_grad_(pass_ != "fwd")
                    probe = probe_of(dtype_name)
                    times, errors, measured = timed_rounds(
                        steps, lambda fn: _time(fn, min_reps=1, min_seconds=ROUND_SECONDS,
                                                max_reps=50, warm_up=False),
                        {"peak": probe} if probe else {}, rounds, may_fail=("flex",))
                    probes = measured.get("peak", [])
                finally:
                    for x in (q, k, v):
                        x.requires_grad_(False)
                for impl, e in errors.items():  # only flex may fail
                    flex_errors[f"{name} {dtype_name} {pass_}"] = f"{type(e).__name__}: {e}"
                med = lambda xs: statistics.median(xs)  # noqa: E731
                # Per-round ratios: a ratio's two sides come from the same round.
                per = lambda a, b: med([x / y for x, y in zip(times[a], times[b])])  # noqa: E731
                secs = {impl: med(ts) for impl, ts in times.items()}
                spread = probe_spread(probes)
                moved = spread is not None and spread > PROBE_SPREAD_LIMIT
                for impl, s in secs.items():
                    ts = times[impl]
                    if impl == "fmha+keypad":  # ratio to the unmasked fmha call
                        rows.append(Row(name, dtype_name, pass_, impl, s, f / s / 1e9,
                                        per("fmha", impl), round_s=ts,
                                        round_peak_gflops=probes, probe_spread=spread,
                                        probes_moved=moved))
                        continue
                    rows.append(Row(
                        name, dtype_name, pass_, impl, s, f / s / 1e9,
                        per("torch_sdpa", impl) if impl != "torch_sdpa" else None,
                        med([f / t / 1e9 / pk for t, pk in zip(ts, probes)]) if probes
                        else None,
                        per("flex", impl) if impl == "fmha" and "flex" in secs else None,
                        round_s=ts, round_peak_gflops=probes, probe_spread=spread,
                        probes_moved=moved))
                fm = rows[-len(secs):][list(secs).index("fmha")]
                print("  " + "  ".join(f"{i} {f / s / 1e9:7.1f} GFLOP/s" for i, s in
                                       secs.items()) +
                      f"  | fmha/sdpa {fm.ratio_vs_sdpa:.2f}x" +
                      (f"  fmha/flex {fm.ratio_vs_flex:.2f}x" if fm.ratio_vs_flex else "") +
                      (f"  fmha {100 * fm.fraction_of_peak:.0f}% of peak (probes "
                       f"{min(probes):.0f}-{max(probes):.0f} GFLOP/s)" if probes else "") +
                      (f"  PROBES MOVED {100 * spread:.0f}%" if moved else ""),
                      flush=True)


def _print_table(rows: List[Row]):
    print("\n| case | dtype | pass | fmha GFLOP/s | fmha % of peak | torch SDPA GFLOP/s | "
          "Flex GFLOP/s | naive GFLOP/s | fmha / SDPA | fmha / Flex | "
          "time with key-padding mask / without |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    keys = []
    for r in rows:
        if (r.case, r.dtype, r.pass_) not in keys:
            keys.append((r.case, r.dtype, r.pass_))
    for key in keys:
        by = {r.impl: r for r in rows if (r.case, r.dtype, r.pass_) == key}
        naive = f"{by['naive'].gflops:.1f}" if "naive" in by else "—"
        flex = f"{by['flex'].gflops:.1f}" if "flex" in by else "—"
        keypad = "—"
        if "fmha+keypad" in by:  # per round: time with the mask / without
            pairs = zip(by["fmha+keypad"].round_s, by["fmha"].round_s)
            keypad = f"{statistics.median(x / y for x, y in pairs):.2f}"
        fm = by["fmha"]
        pct = f"{100 * fm.fraction_of_peak:.0f}%" if fm.fraction_of_peak else "—"
        vs_flex = f"{fm.ratio_vs_flex:.2f}×" if fm.ratio_vs_flex else "—"
        print(f"| {key[0]} | {key[1]} | {key[2]} | {fm.gflops:.1f} | {pct} | "
              f"{by['torch_sdpa'].gflops:.1f} | {flex} | {naive} | {fm.ratio_vs_sdpa:.2f}× | "
              f"{vs_flex} | {keypad} |")
