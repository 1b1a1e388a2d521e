"""Decode over KV caches against the machine's read bandwidth: ``python -m fmha.bench --decode``.

Decoding reads every cached key and value once per step and does a few FMAs per byte, so its
limit is memory bandwidth, not the FMA peak. For each case (the shapes of serving: GQA with
8 kv heads, one long sequence, many short ones, MQA) and each seqlen_q (1: decode; 4:
speculative verification), this mode times in one run, on the same cache contents:

    kvcache             fmha.kvcache.attention_with_kvcache, contiguous cache
    kvcache-paged16     the same through a block table, block_size 16 (vLLM's default)
    kvcache-paged256    the same, block_size 256
    attention           fmha.attention on the contiguous cache (the path before KV caches)
    torch_sdpa          torch SDPA on the contiguous cache (enable_gqa=True), (b, h, s, d) views,
                        no mask (its causal mask is top-left: it would hide most of the cache)

Pages are assigned in a shuffled order, as a pool serving many sequences hands them out. The
reported bandwidth is the bytes of K and V read once (batch · seqlen_k · heads_kv ·
(head_dim + head_dim_v) · element size) divided by the median call time; the limit it is
judged against is fmha's read probe (``fmha._C.cpu_read_bandwidth_gbs``: the same threads
summing a buffer of the same size, best of five). On the CPU the entries of a (case,
seqlen_q) take turns ROUNDS (5) times over, each round opened by the probes (one at the
16-bit cache's size, one at the 8-bit cache's) and starting one entry further along, and
every fraction of the bandwidth and every ratio (to SDPA, to the 16-bit cache) is the median
of its per-round values, so not the ratio of the rows' ``ms`` (rows keep ``round_ms`` and
``round_bandwidth``): a shared VM's speed drifts within seconds, and both sides of a ratio
then drift together. No new rows are appended (the cache is full), so every call reads the
same bytes.

On a GPU (``python -m fmha.bench --cuda --decode``, float16/bfloat16) the same entries run on
CUDA tensors, timed by CUDA events, and the limit is the GPU's read bandwidth measured in the
same run: ``torch.sum`` over a float32 buffer of the same size as K+V, median of 20 (so a
cache that fits the L2 cache is judged against the L2-fed read, as it should be); one round,
the probe once per case (8-bit rows at their own size).

8-bit caches (``--kv-dtypes int8,float8_e4m3fn,float8_e5m2``; default: none): for
each listed encoding, one more entry per case and seqlen_q, ``kvcache-int8`` /
``kvcache-fp8e4m3`` / ``kvcache-fp8e5m2``: attention_with_kvcache over a contiguous 8-bit
cache with dynamic scales (per row and kv head, written by the kernel when the same K/V as
the 16-bit rows were appended), queries in the row's dtype. Its bytes read are the codes plus
the float32 scales (batch · seqlen_k · heads_kv · (head_dim + head_dim_v + 2 · 4)), judged
against the read probe at that size; ``speedup_vs_16bit_cache`` is the time of the
``kvcache`` entry (cache in the query's dtype) over the 8-bit entry's (= the ratio of
tokens/s), ``tokens_per_s`` = batch · seqlen_q / time. The other entries' rows are unchanged.
"""

from __future__ import annotations

import statistics
import time
from typing import List, Optional

# (name, batch, heads_q, heads_kv, seqlen_k, head_dim)
DECODE_CASES = [
    ("b8-hq32-hkv8-sk4096", 8, 32, 8, 4096, 128),
    ("b1-hq32-hkv8-sk32768", 1, 32, 8, 32768, 128),
    ("b32-hq32-hkv8-sk1024", 32, 32, 8, 1024, 128),
    ("b1-hq8-hkv1-sk65536", 1, 8, 1, 65536, 128),
]
QUICK_CASES = [("b2-hq8-hkv2-sk2048", 2, 8, 2, 2048, 64)]
SEQLEN_Q = (1, 4)
ENTRIES = ("kvcache", "kvcache-paged16", "kvcache-paged256", "attention", "torch_sdpa")
#: The entry name of each 8-bit cache encoding's rows.
KV8_ENTRIES = {"int8": "kvcache-int8", "float8_e4m3fn": "kvcache-fp8e4m3",
               "float8_e5m2": "kvcache-fp8e5m2"}


def _quantized_cache(kc, vc, fmt):
    """An 8-bit contiguous cache (dynamic scales) holding kc, vc (batch, sk, heads_kv, d),
    written by the kernel's append; returns (kc8, vc8, k_scale, v_scale)."""
    import torch

    from fmha.kvcache import attention_with_kvcache
    b, sk, hkv, d = kc.shape
    dt = getattr(torch, fmt)
    kw = dict(device=kc.device)
    kc8 = torch.zeros(b, sk, hkv, d, dtype=dt, **kw)
    vc8 = torch.zeros(b, sk, hkv, vc.shape[-1], dtype=dt, **kw)
    ks, vs = torch.zeros(b, sk, hkv, **kw), torch.zeros(b, sk, hkv, **kw)
    q = torch.zeros(b, 1, hkv, d, dtype=kc.dtype, **kw)
    with torch.no_grad():
        attention_with_kvcache(q, kc8, vc8, kc, vc, cache_seqlens=0, k_scale=ks, v_scale=vs)
    return kc8, vc8, ks, vs


def _paged(cache, block_size, generator):
    """The rows of a contiguous (batch, sk, h, d) cache as a pool of blocks in a shuffled
    order; returns (pool, block_table)."""
    import torch
    b, sk, h, d = cache.shape
    blocks = sk // block_size
    pool = torch.empty(b * blocks, block_size, h, d, dtype=cache.dtype)
    table = torch.randperm(b * blocks, generator=generator).reshape(b, blocks).to(torch.int32)
    pool[table.reshape(-1).long()] = cache.reshape(b * blocks, block_size, h, d)
    return pool, table


def cuda_read_bandwidth_gbs(nbytes: int, device) -> float:
    """GB/s of torch.sum over a float32 buffer of nbytes on the GPU: the read limit."""
    import torch

    from ._host import median_seconds_on
    x = torch.ones(max(nbytes // 4, 1), dtype=torch.float32, device=device)
    secs = median_seconds_on(lambda: torch.sum(x), 20, x.device)
    return x.numel() * 4 / secs / 1e9


def _time(fn, min_seconds: float, min_reps: int = 3, max_reps: int = 50) -> float:
    """Median seconds per call over at least min_reps calls and min_seconds (one warm-up)."""
    fn()
    times: List[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - start < min_seconds
                                    and len(times) < max_reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


#: CPU timing: the entries take turns ROUNDS times over, each round opened by the read
#: probes (the host's speed drifts on shared VMs); a GPU run times each entry once.
ROUNDS = 5


def run(dtypes, out_path: Optional[str], threads: Optional[int], cases=None,
        min_seconds: float = 0.5, device: str = "cpu", kv_dtypes=(), save=None) -> list:
    import torch

    import fmha
    from fmha.kvcache import attention_with_kvcache

    from ._host import (PROBE_SPREAD_LIMIT, host_meta, probe_spread, timed_rounds,
                        write_result)

    on_gpu = device != "cpu"
    if threads:
        torch.set_num_threads(threads)
    nthreads = torch.get_num_threads()
    cases = cases or DECODE_CASES
    kv8 = [x for x in (kv_dtypes or ()) if x in KV8_ENTRIES]
    unknown = [x for x in (kv_dtypes or ()) if x not in KV8_ENTRIES]
    if unknown:
        raise ValueError(f"kv_dtypes: expected 8-bit encodings among {', '.join(KV8_ENTRIES)}"
                         f" (16-bit cache rows come from dtypes), got {', '.join(unknown)}")
    rows = []
    where = (f"GPU {torch.cuda.get_device_name(device)}" if on_gpu else
             f"CPU ISA {fmha.cpu_isa()} | threads {nthreads}")
    print(f"decode | {where} | GB/s of K+V read once, % of the measured read bandwidth")
    if on_gpu:
        from ._host import median_seconds_on
        timer = lambda fn: median_seconds_on(fn, 20, torch.device(device))  # noqa: E731
        rounds = 1
    else:
        timer = lambda fn: _time(fn, min_seconds / ROUNDS, min_reps=2)  # noqa: E731
        rounds = ROUNDS
    med = statistics.median
    print(f"{'case':24s} {'dtype':9s} {'sq':>2s} {'entry':17s} {'ms':>9s} {'GB/s':>7s} "
          f"{'% bw':>6s} {'x sdpa':>7s}")
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        for name, b, hq, hkv, sk, d in cases:
            g = torch.Generator().manual_seed(0)
            kc = torch.randn(b, sk, hkv, d, generator=g).to(dtype)
            vc = torch.randn(b, sk, hkv, d, generator=g).to(dtype)
            nbytes = 2 * kc.numel() * kc.element_size()
            lens = torch.full((b,), sk, dtype=torch.int32, device=device)
            pools = {}
            for bs in (16, 256):
                if sk % bs == 0:
                    (kp, table), (vp, _) = (_paged(kc, bs, torch.Generator().manual_seed(bs)),
                                            _paged(vc, bs, torch.Generator().manual_seed(bs)))
                    kp, vp, table = kp.to(device), vp.to(device), table.to(device)
                    pools[bs] = ((kp, table), (vp, table))
            kc, vc = kc.to(device), vc.to(device)
            # The read probes: on the CPU once per round, on the GPU once per case.
            probes = {"bw": (lambda bw=cuda_read_bandwidth_gbs(nbytes, device): bw) if on_gpu
                      else (lambda: fmha._C.cpu_read_bandwidth_gbs(nthreads, nbytes))}
            quantized = {fmt: _quantized_cache(kc, vc, fmt) for fmt in kv8}
            if kv8:
                kc8, _, ks8, _ = quantized[kv8[0]]
                nbytes8 = 2 * kc8.numel() + 2 * ks8.numel() * 4
                probes["bw8"] = ((lambda bw=cuda_read_bandwidth_gbs(nbytes8, device): bw)
                                 if on_gpu else
                                 (lambda: fmha._C.cpu_read_bandwidth_gbs(nthreads, nbytes8)))
            case_bw = {k: [] for k in probes}
            for sq in SEQLEN_Q:
                q = torch.randn(b, sq, hq, d, generator=g).to(dtype).to(device)
                calls = {
                    "kvcache": lambda: attention_with_kvcache(q, kc, vc, cache_seqlens=lens,
                                                              causal=True),
                    "attention": lambda: fmha.attention(q, kc, vc, causal=True),
                    "torch_sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(
                        q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2),
                        enable_gqa=True),
                }
                for bs, ((kp, table), (vp, _)) in pools.items():
                    calls[f"kvcache-paged{bs}"] = (
                        lambda kp=kp, vp=vp, table=table: attention_with_kvcache(
                            q, kp, vp, cache_seqlens=lens, block_table=table, causal=True))
                for fmt in kv8:
                    kc8, vc8, ks8, vs8 = quantized[fmt]
                    calls[KV8_ENTRIES[fmt]] = (
                        lambda kc8=kc8, vc8=vc8, ks8=ks8, vs8=vs8: attention_with_kvcache(
                            q, kc8, vc8, cache_seqlens=lens, causal=True, k_scale=ks8,
                            v_scale=vs8))
                with torch.no_grad():
                    rt, _, bw = timed_rounds(
                        {e: calls[e] for e in ENTRIES if e in calls} |
                        {KV8_ENTRIES[f]: calls[KV8_ENTRIES[f]] for f in kv8}, timer, probes,
                        rounds)
                for k, v in bw.items():
                    case_bw[k] += v
                # Every ratio and fraction: the median of its per-round values.
                per = lambda a, e: med([x / y for x, y in zip(rt[a], rt[e])])  # noqa: E731
                for entry, ts in rt.items():
                    fmt = next((f for f in kv8 if KV8_ENTRIES[f] == entry), None)
                    nb, probe = (nbytes, "bw") if fmt is None else (nbytes8, "bw8")
                    secs = med(ts)
                    gbs = nb / secs / 1e9
                    frac = med([nb / t / 1e9 / x for t, x in zip(ts, bw[probe])])
                    row = dict(case=name, dtype=dtype_name, batch=b, heads_q=hq, heads_kv=hkv,
                               seqlen_k=sk, head_dim=d, seqlen_q=sq, entry=entry,
                               ms=secs * 1e3, gb_per_s=gbs, kv_bytes=nb,
                               read_bandwidth_gb_per_s=med(bw[probe]),
                               fraction_of_bandwidth=frac,
                               ratio_vs_sdpa=per("torch_sdpa", entry),
                               round_ms=[t * 1e3 for t in ts],
                               round_bandwidth=list(bw[probe]))
                    spread = probe_spread(bw[probe])
                    row.update(probe_spread=spread, probes_moved=bool(
                        spread is not None and spread > PROBE_SPREAD_LIMIT))
                    line = (f"{name:24s} {dtype_name:9s} {sq:2d} {entry:17s} {secs * 1e3:9.2f} "
                            f"{gbs:7.1f} {100 * frac:5.0f}% {per('torch_sdpa', entry):7.2f}")
                    if row["probes_moved"]:
                        line += f"  PROBES MOVED {100 * spread:.0f}%"
                    if fmt is not None:
                        row.update(cache_dtype=fmt, scales="dynamic",
                                   speedup_vs_16bit_cache=per("kvcache", entry),
                                   tokens_per_s=b * sq / secs)
                        line += f"  {per('kvcache', entry):.2f}x the {dtype_name} cache"
                    rows.append(row)
                    print(line, flush=True)
            for k, label, nb in (("bw", dtype_name, nbytes), ("bw8", "8-bit", kv8 and nbytes8)):
                if k in case_bw:
                    lo, hi = min(case_bw[k]), max(case_bw[k])
                    span = f"{lo:.1f}" if lo == hi else f"{lo:.1f}-{hi:.1f}"
                    print(f"{'':24s} {label:9s}    read bandwidth {span} GB/s "
                          f"({nb / 1e6:.0f} MB)")
    moved = sorted({f"{r['case']} {r['dtype']}" for r in rows if r["probes_moved"]})
    if moved:
        print(f"WARNING: the read-bandwidth probes moved by more than "
              f"{100 * PROBE_SPREAD_LIMIT:.0f}% within: {', '.join(moved)} (the host's speed "
              f"changed during those rows)")
    if out_path or save is not None:
        meta = host_meta(torch, fmha, gpu=torch.cuda.get_device_name(device) if on_gpu else None)
        meta.update(probes_moved=moved)
        write_result(dict(meta=meta, rows=rows), out_path, save)
    return rows
