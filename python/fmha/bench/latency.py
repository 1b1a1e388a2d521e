"""Per-call latency of fmha's entry points on small shapes: ``python -m fmha.bench --latency``.

Small calls are dominated by what surrounds the kernel (validation, the torch custom-op
dispatch, DLPack exports, waking the thread pool), not by the arithmetic. This mode times,
in one run and on the same inputs, every way of calling attention on small shapes:

    fmha            fmha.attention, torch tensors, under torch.no_grad()
    fmha+grad       the same with inputs that require grad (forward only, graph recorded)
    fmha_numpy      fmha.attention on NumPy arrays (float32/float16 only: NumPy has no bfloat16)
    fmha_sdpa       fmha.scaled_dot_product_attention, torch layout (b, h, s, d), no_grad
    torch_sdpa      torch.nn.functional.scaled_dot_product_attention, (b, h, s, d), no_grad
    torch_sdpa+grad the same with inputs that require grad (forward only)

each fmha entry twice: with the default thread count and with ``fmha.set_num_threads(1)``
(the difference is the cost of waking fmha's thread pool, plus whatever the second thread
saves on the work itself). Per-call time is the median over >= 5 batches of the mean time
of a batch of back-to-back calls; each entry runs at least --min-seconds in all and at
least --min-calls calls (unless those calls would take over a second). The ratio to torch
SDPA is SDPA's time / the entry's time (> 1: faster than SDPA), against torch_sdpa+grad
for the +grad entries and torch_sdpa for the others.

Breakdown (torch no_grad path, the smallest shape, first dtype): each layer of one
``fmha.attention`` call is timed on its own, from the outside in, and the cost of a layer
is reported either as MEASURED (the layer called alone) or as a DIFFERENCE of two measured
times (what one layer adds around the next). Differences of medians are estimates: they can
come out slightly negative on a noisy machine.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, List, Optional

# (name, batch, seqlen_q, seqlen_k, heads, head_dim)
LATENCY_SHAPES = [
    ("decode-sk16", 1, 1, 16, 8, 64),
    ("decode-sk256", 1, 1, 256, 8, 64),
    ("decode-sk4096", 1, 1, 4096, 8, 64),
    ("b1s16h8d64", 1, 16, 16, 8, 64),
    ("vit-b8s197h12d64", 8, 197, 197, 12, 64),
    ("b32s128h12d64", 32, 128, 128, 12, 64),
]

ENTRIES = ("fmha", "fmha+grad", "fmha_numpy", "fmha_sdpa", "torch_sdpa", "torch_sdpa+grad")
_MAX_SECONDS_FOR_MIN_CALLS = 1.0  # min_calls is not enforced past this much time per entry


@dataclass
class LatencyRow:
    case: str
    dtype: str
    entry: str           # one of ENTRIES
    threads: int         # fmha's thread count for the call (torch's for torch_sdpa)
    us_per_call: float   # median over batches of the per-batch mean
    calls: int           # calls timed in all (warm-up excluded)
    batches: int
    ratio_vs_sdpa: Optional[float]  # SDPA's time / this time (> 1: faster than SDPA)


def time_per_call(fn: Callable[[], object], min_seconds: float = 0.2, min_calls: int = 200,
                  batches: int = 5) -> tuple:
    """(median seconds per call, calls, batches): the median over `batches` (>= 5) batches
    of each batch's mean, with batch sizes chosen from a first estimate so that all batches
    together take about min_seconds and hold at least min_calls calls (the latter only while
    they take at most a second)."""
    batches = max(5, batches)
    for _ in range(3):  # warm-up: first-touch, allocator, thread pool
        fn()
    n, t = 0, 0.0
    start = time.perf_counter()
    while n < 3 or (t < min(0.02, min_seconds / 4) and n < 1000):  # the estimate
        fn()
        n += 1
        t = time.perf_counter() - start
    est = t / n
    total = max(batches, math.ceil(min_seconds / est),
                min(min_calls, math.ceil(_MAX_SECONDS_FOR_MIN_CALLS / est)))
    per_batch = max(1, math.ceil(total / batches))
    means = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(per_batch):
            fn()
        means.append((time.perf_counter() - t0) / per_batch)
    return statistics.median(means), per_batch * batches, batches


def _inputs(torch, b, sq, sk, h, d, dtype):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, sq, h, d, generator=g).to(dtype)
    k = torch.randn(b, sk, h, d, generator=g).to(dtype)
    v = torch.randn(b, sk, h, d, generator=g).to(dtype)
    return q, k, v


def _entries(torch, F, fmha, q, k, v, dtype_name):
    """{entry: zero-argument callable}: each entry's call on the same data."""
    # SDPA's layout (b, h, s, d), contiguous, so neither SDPA pays for a layout change.
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    qg, kg, vg = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    qtg, ktg, vtg = (x.detach().clone().requires_grad_(True) for x in (qt, kt, vt))

    def no_grad(f):
        def call():
            with torch.no_grad():
                return f()
        return call

    out = {
        "fmha": no_grad(lambda: fmha.attention(q, k, v)),
        "fmha+grad": lambda: fmha.attention(qg, kg, vg),
        "fmha_sdpa": no_grad(lambda: fmha.scaled_dot_product_attention(qt, kt, vt)),
        "torch_sdpa": no_grad(lambda: F.scaled_dot_product_attention(qt, kt, vt)),
        "torch_sdpa+grad": lambda: F.scaled_dot_product_attention(qtg, ktg, vtg),
    }
    if dtype_name in ("float32", "float16", "float64"):
        qn, kn, vn = (x.numpy() for x in (q, k, v))
        out["fmha_numpy"] = lambda: fmha.attention(qn, kn, vn)
    return {e: out[e] for e in ENTRIES if e in out}


def breakdown(torch, fmha, q, k, v, budget: dict) -> List[dict]:
    """The layers of one fmha.attention call (torch, no_grad), each timed on its own."""
    from .. import _C, _torch
    from .._validate import prepare

    spec = prepare(q, k, v)
    out = q.new_empty(q.shape[:-1] + (v.shape[-1],))
    op_args = (q, k, v, None, None, None, None, None, spec.seqlen_q, spec.seqlen_k, None,
               spec.scale, spec.softcap, spec.window_left, spec.window_right,
               spec.bottom_right, spec.dropout_p, False, spec.num_splits)
    default_threads = fmha.get_num_threads()

    from torch.utils.dlpack import to_dlpack

    def c_forward(threads):
        # As the plain call makes it: four to_dlpack capsules, lse left to the kernels.
        return lambda: _C.forward(to_dlpack(q), to_dlpack(k), to_dlpack(v), to_dlpack(out),
                                  None, **spec.kernel_settings, num_threads=threads)

    measured = {}

    def measure(key, fn):
        def call():
            with torch.no_grad():
                return fn()
        measured[key] = time_per_call(call, **budget)[0] * 1e6

    measure("total", lambda: fmha.attention(q, k, v))
    measure("prepare", lambda: prepare(q, k, v))
    measure("plain", lambda: _torch.plain_forward(spec, q, k, v, False))
    measure("op_call", lambda: _torch.fwd(*op_args))
    measure("impl_body", lambda: _torch._fwd(*op_args))
    measure("c_forward", c_forward(default_threads))
    measure("c_forward_1t", c_forward(1))
    for name, x in (("q", q), ("k", k), ("v", v), ("out", out)):
        # What the plain call does for each array: one DLPack export.
        measure(f"dlpack_{name}", lambda x=x: to_dlpack(x))
    dlpack = sum(measured[f"dlpack_{n}"] for n in ("q", "k", "v", "out"))

    rows = []

    def add(part, us, how, what):
        rows.append(dict(part=part, us=us, how=how, what=what))

    m = measured
    add("total", m["total"], "measured", "fmha.attention(q, k, v) under torch.no_grad()")
    add("_validate.prepare", m["prepare"], "measured", "argument validation -> Spec")
    add("_api glue", m["total"] - m["prepare"] - m["plain"], "difference",
        "total - prepare - plain call (argument checks, kind dispatch)")
    add("plain call (_torch.plain_forward)", m["plain"], "measured",
        "what a plain eager call runs after validation: the direct-call checks, out "
        "allocated, _C.forward")
    add("plain-call glue (checks, allocation, kwargs)", m["plain"] - m["c_forward"],
        "difference", "plain call - _C.forward")
    add("op call (torch.ops.fmha.fwd)", m["op_call"], "measured",
        "the custom op called with validated arguments: what a call that records autograd "
        "pays instead of the plain call")
    add("custom-op dispatch", m["op_call"] - m["impl_body"], "difference",
        "op call - implementation body (custom_op -> autograd -> redispatch -> impl); "
        "skipped by eager calls without autograd")
    add(f"_C.forward, {default_threads} threads", m["c_forward"], "measured",
        "the binding with a preallocated out and no lse (includes the 4 DLPack exports)")
    add("_C.forward, 1 thread", m["c_forward_1t"], "measured",
        "the same with num_threads=1")
    add("thread-pool wake", m["c_forward"] - m["c_forward_1t"], "difference",
        f"_C.forward {default_threads} threads - 1 thread (wake-up net of any work shared)")
    for n in ("q", "k", "v", "out"):
        add(f"to_dlpack {n}", m[f"dlpack_{n}"], "measured",
            f"torch.utils.dlpack.to_dlpack({n}) alone")
    add("to_dlpack x4", dlpack, "sum", "sum of the four exports above (part of _C.forward)")
    add("C++ floor, 1 thread", m["c_forward_1t"] - dlpack, "difference",
        "_C.forward 1 thread - DLPack exports (argument parsing, params, kernel)")
    return rows


def run(dtypes, out_path: Optional[str], threads: Optional[int], shapes=None,
        min_seconds: float = 0.2, min_calls: int = 200, batches: int = 5, save=None):
    import torch
    import torch.nn.functional as F

    import fmha

    from ._host import host_meta, write_result

    if threads:
        torch.set_num_threads(threads)
    fmha.set_num_threads(None)
    default_threads = fmha.get_num_threads()
    budget = dict(min_seconds=min_seconds, min_calls=min_calls, batches=batches)
    shapes = shapes or LATENCY_SHAPES
    print(f"fmha {fmha.__version__} | CPU ISA {fmha.cpu_isa()} | threads {default_threads} | "
          f"torch {torch.__version__}", flush=True)
    rows: List[LatencyRow] = []
    for (name, b, sq, sk, h, d) in shapes:
        for dtype_name in dtypes:
            q, k, v = _inputs(torch, b, sq, sk, h, d, getattr(torch, dtype_name))
            entries = _entries(torch, F, fmha, q, k, v, dtype_name)
            print(f"{name} {dtype_name}:", end="", flush=True)
            got = {}
            for entry, fn in entries.items():
                for n in ((default_threads,) if entry.startswith("torch") or
                          default_threads == 1 else (default_threads, 1)):
                    fmha.set_num_threads(n if n != default_threads else None)
                    try:
                        s, calls, nb = time_per_call(fn, **budget)
                    finally:
                        fmha.set_num_threads(None)
                    got[(entry, n)] = (s, calls, nb)
                    print(f" {entry}@{n}t {s * 1e6:.1f}us", end="", flush=True)
            print(flush=True)
            for (entry, n), (s, calls, nb) in got.items():
                ref = "torch_sdpa+grad" if entry.endswith("+grad") else "torch_sdpa"
                ratio = None if entry == ref else got[(ref, default_threads)][0] / s
                rows.append(LatencyRow(name, dtype_name, entry, n, s * 1e6, calls, nb, ratio))
    smallest = min(shapes, key=lambda c: c[1] * c[2] * c[3] * c[4] * c[5])
    q, k, v = _inputs(torch, *smallest[1:], getattr(torch, dtypes[0]))
    parts = breakdown(torch, fmha, q, k, v, budget)
    _print_tables(rows, parts, smallest[0], dtypes[0], default_threads)
    meta = dict(host_meta(torch, fmha), fmha_threads=default_threads)
    result = dict(meta=meta, rows=[asdict(r) for r in rows],
                  breakdown=dict(case=smallest[0], dtype=dtypes[0], parts=parts),
                  budget=budget)
    write_result(result, out_path, save)
    return result


def _print_tables(rows: List[LatencyRow], parts: List[dict], case, dtype, default_threads):
    print(f"\nPer-call time in µs (× = torch SDPA's time / this one; > 1 is faster than "
          f"SDPA). fmha at {default_threads} threads / at 1 thread.\n")
    cols = [e for e in ENTRIES if any(r.entry == e for r in rows)]
    print("| case | dtype | " + " | ".join(cols) + " |")
    print("|---|---|" + "---:|" * len(cols))
    keys = []
    for r in rows:
        if (r.case, r.dtype) not in keys:
            keys.append((r.case, r.dtype))
    for key in keys:
        cells = []
        for e in cols:
            by = {r.threads: r for r in rows if (r.case, r.dtype, r.entry) == key + (e,)}
            if not by:
                cells.append("—")
                continue
            cell = " / ".join(f"{r.us_per_call:.1f}" + (f" ({r.ratio_vs_sdpa:.2f}×)"
                                                         if r.ratio_vs_sdpa is not None else "")
                              for _, r in sorted(by.items(), key=lambda kv: -kv[0]))
            cells.append(cell)
        print(f"| {key[0]} | {key[1]} | " + " | ".join(cells) + " |")
    print(f"\nBreakdown of one fmha.attention call (torch, no_grad), {case} {dtype}: "
          f"'measured' = that layer timed alone; 'difference' = one measured time minus "
          f"another (an estimate).\n")
    print("| part | µs | how | what |")
    print("|---|---:|---|---|")
    for p in parts:
        print(f"| {p['part']} | {p['us']:.1f} | {p['how']} | {p['what']} |")
