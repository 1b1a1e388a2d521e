"""Attention on a shared CPU: ``python -m fmha.bench --contention``.

Servers are shared: other processes take cores while a call runs. This mode times the same
forward call (float32, no_grad) of

    fmha        fmha.attention on the default runtime (torch's OpenMP threads when torch
                loaded one, else fmha's own pool)
    fmha-own    fmha.attention on fmha's own thread pool (what FMHA_OWN_THREADS=1 selects)
    torch_sdpa  torch.nn.functional.scaled_dot_product_attention

at a small, a medium and a long shape (CASES), first on a quiet host and then with 1 and 2
competing busy processes (``while True: pass``), each set at nice 0 and at nice 10. The
benchmark starts the competitors itself and always stops them: at the end of each setting,
on an exception or Ctrl-C (a finally), and should this process die they exit on their own
(the kernel kills them with their parent, and they check that their parent is alive and
stop after a bounded time in any case).

Every entry reports its median time per call and that time relative to the same entry on
the quiet host, next to the fair slowdown: what a perfectly divisible job of `threads`
threads would take if the scheduler shared the allowed cores among all runnable threads in
proportion to their weights (nice 0: 1024, nice 10: 110, the kernel's table), no thread
using more than one core. Two threads and one competitor at nice 0 on two cores: 1.5x.

Entries take turns within each setting, starting one further along the order per case, and
each is timed for at least --min-seconds (default 0.5 s) and MIN_CALLS calls after two
untimed ones. --quick: the small shape only. --threads sets the thread count (default
torch's). A setting's competitors are started, given SETTLE_S to be scheduled, and stopped
before the next setting starts.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import List, Optional

# (name, batch, heads, seqlen, head_dim, causal): about 1 ms, 20 ms and 100-200 ms on two
# Zen 4 cores.
CASES = [
    ("small-b1h4s512d64", 1, 4, 512, 64, False),
    ("medium-b1h8s1024d64", 1, 8, 1024, 64, False),
    ("long-b1h8s4096d64-causal", 1, 8, 4096, 64, True),
]
QUICK_CASES = CASES[:1]
# (competing busy processes, their nice value)
SETTINGS = [(0, 0), (1, 0), (1, 10), (2, 0), (2, 10)]
QUICK_SETTINGS = [(0, 0), (1, 0), (1, 10)]
IMPLS = ("fmha", "fmha-own", "torch_sdpa")
MIN_CALLS = 10
SETTLE_S = 0.3
# A competitor stops by itself after this long even if nobody stops it.
COMPETITOR_MAX_S = 900

NICE_WEIGHT = {0: 1024, 10: 110}  # the kernel's sched_prio_to_weight for these nice values

# A busy process: niced, killed with its parent (PR_SET_PDEATHSIG), and stopping on its own
# when its parent is gone or after a bounded time.
_COMPETITOR = """
import ctypes, os, signal, sys, time
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
except Exception:
    pass
parent, nice, limit = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
os.nice(nice)
end = time.monotonic() + limit
while os.getppid() == parent and time.monotonic() < end:
    for _ in range(100000):
        pass
"""


@dataclass
class Row:
    case: str
    impl: str
    competitors: int
    nice: int
    median_s: float
    calls: int
    ratio_vs_quiet: Optional[float]  # this time / the same entry's quiet time
    fair_ratio: float                # the fair slowdown of the setting (module docstring)


def fair_slowdown(threads: int, competitor_nices, cores: int) -> float:
    """Time relative to a quiet host of a perfectly divisible job on `threads` threads while
    busy processes at the given nice values run, when `cores` cores are shared in proportion
    to the threads' weights and no thread gets more than one core (water-filling)."""
    threads = max(1, min(threads, cores))
    weights = [NICE_WEIGHT[0]] * threads + [NICE_WEIGHT.get(n, 1024 * 1.25 ** -n)
                                            for n in competitor_nices]
    share = [0.0] * len(weights)
    free, left = float(cores), list(range(len(weights)))
    while left and free > 1e-12:
        total = sum(weights[i] for i in left)
        capped = [i for i in left if free * weights[i] / total >= 1.0]
        if not capped:
            for i in left:
                share[i] = free * weights[i] / total
            break
        for i in capped:
            share[i] = 1.0
            free -= 1.0
            left.remove(i)
    ours = sum(share[:threads])
    return threads / ours if ours > 0 else float("inf")


class Competitors:
    """`count` busy processes at `nice`, running while the with-block runs and killed (and
    reaped) when it ends, however it ends."""

    def __init__(self, count: int, nice: int):
        self.count, self.nice, self.procs = count, nice, []

    def __enter__(self):
        try:
            for _ in range(self.count):
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-c", _COMPETITOR, str(os.getpid()), str(self.nice),
                     str(COMPETITOR_MAX_S)], stdin=subprocess.DEVNULL))
            if self.procs:
                time.sleep(SETTLE_S)
        except BaseException:
            self.stop()
            raise
        return self

    def cpu_seconds(self) -> float:
        """The CPU time the running competitors have taken so far."""
        total = 0.0
        tick = os.sysconf("SC_CLK_TCK")
        for p in self.procs:
            try:
                with open(f"/proc/{p.pid}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / tick
            except (OSError, IndexError, ValueError):
                pass
        return total

    def stop(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.procs = []

    def __exit__(self, *exc):
        self.stop()
        return False


def _median_per_call(fn, min_seconds: float) -> tuple:
    for _ in range(2):
        fn()
    times = []
    start = time.perf_counter()
    while len(times) < MIN_CALLS or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), len(times)


def run(out_path: Optional[str], threads: Optional[int], quick: bool = False,
        min_seconds: float = 0.5, save=None) -> List[Row]:
    import torch
    import torch.nn.functional as F

    import fmha
    from .. import _C, _torch
    from ._host import host_meta, write_result

    if threads:
        torch.set_num_threads(threads)
    nthreads = torch.get_num_threads()
    fmha.set_num_threads(nthreads)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    omp = None if os.environ.get("FMHA_OWN_THREADS", "") not in ("", "0") \
        else _torch._torch_openmp_runtime()
    default_runtime = f"torch's OpenMP runtime ({omp})" if omp else "fmha's own pool"
    cases = QUICK_CASES if quick else CASES
    settings = QUICK_SETTINGS if quick else SETTINGS
    print(f"fmha {fmha.__version__} | threads {nthreads} | allowed cores {cores} | torch "
          f"{torch.__version__}\nfmha's default runtime: {default_runtime}", flush=True)

    state = {"own": False}

    def runtime(own: bool):
        if omp and state["own"] != own:
            _C.use_openmp_runtime("" if own else omp)
            state["own"] = own

    calls = {}
    for name, b, h, s, d, causal in cases:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(b, s, h, d, generator=g) for _ in range(3))
        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))

        def fm(own, q=q, k=k, v=v, causal=causal):
            def call():
                runtime(own)
                with torch.no_grad():
                    fmha.attention(q, k, v, causal=causal)
            return call

        def sdpa(qt=qt, kt=kt, vt=vt, causal=causal):
            with torch.no_grad():
                F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

        calls[name] = {"fmha": fm(False), "fmha-own": fm(True), "torch_sdpa": sdpa}

    rows: List[Row] = []
    quiet = {}
    competitor_cpu = 0.0
    try:
        for count, nice in settings:
            if count == 0 and nice != 0:
                continue
            fair = fair_slowdown(nthreads, [nice] * count, cores)
            label = f"{count} busy process{'es' if count != 1 else ''}" + \
                (f" at nice {nice}" if count else " (quiet)")
            print(f"\n{label}: fair slowdown {fair:.2f}x", flush=True)
            with Competitors(count, nice) as comp:
                for i, (name, *_rest) in enumerate(cases):
                    order = list(IMPLS[i % len(IMPLS):] + IMPLS[:i % len(IMPLS)])
                    line = []
                    for impl in order:
                        med, n = _median_per_call(calls[name][impl], min_seconds)
                        if count == 0:
                            quiet[(name, impl)] = med
                        base = quiet.get((name, impl))
                        ratio = med / base if base else None
                        rows.append(Row(name, impl, count, nice, med, n, ratio, fair))
                        line.append(f"{impl} {med * 1e3:8.2f} ms" +
                                    (f" {ratio:5.2f}x" if count else ""))
                    print(f"  {name:26s} " + "  ".join(line), flush=True)
                competitor_cpu += comp.cpu_seconds()
    finally:
        runtime(False)
    _print_table(rows, settings)
    if out_path or save is not None:
        meta = dict(host_meta(torch, fmha), threads=nthreads, cores=cores,
                    default_runtime=default_runtime, min_seconds=min_seconds,
                    min_calls=MIN_CALLS, settle_s=SETTLE_S, competitors_cpu_s=competitor_cpu,
                    cases=[dict(name=c[0], batch=c[1], heads=c[2], seqlen=c[3], head_dim=c[4],
                                causal=c[5], dtype="float32", pass_="fwd") for c in cases])
        write_result(dict(meta=meta, rows=[asdict(r) for r in rows]), out_path, save)
    return rows


def _print_table(rows: List[Row], settings) -> None:
    busy = [(c, n) for c, n in settings if c]
    print("\n| case | impl | quiet ms | " +
          " | ".join(f"{c}@nice{n} / quiet (fair)" for c, n in busy) + " |")
    print("|---|---|---:|" + "---:|" * len(busy))
    keys = []
    for r in rows:
        if (r.case, r.impl) not in keys:
            keys.append((r.case, r.impl))
    for case, impl in keys:
        by = {(r.competitors, r.nice): r for r in rows if (r.case, r.impl) == (case, impl)}
        cells = []
        for c, n in busy:
            r = by.get((c, n))
            cells.append("—" if r is None or r.ratio_vs_quiet is None
                         else f"{r.ratio_vs_quiet:.2f}× ({r.fair_ratio:.2f}×)")
        q = by.get((0, 0))
        quiet = f"{q.median_s * 1e3:.2f}" if q else "—"
        print(f"| {case} | {impl} | {quiet} | " + " | ".join(cells) + " |")
