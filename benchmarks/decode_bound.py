"""How far an 8-bit cache's decode can beat a bfloat16 cache's on this host: the cost of one
(key, kv head) split into arithmetic and memory, per cache, and what the issue's 1.7x would
need of each (benchmarks/NOTES.md, "8-bit KV caches on the CPU").

    python benchmarks/decode_bound.py [threads ...]        (default: 1 2; each a divisor of 16)

One query, 32 query heads over 8 kv heads, head_dim 128, bfloat16 q; a bfloat16 cache and an
int8 cache (unit static scales), timed alternately, 7 rounds, medians. Per thread count:
- C, the arithmetic: the slope of the per-call time from 32 to 192 keys with b = threads
  (one sequence per thread; each thread's caches, at most 768 KiB, stay in its L2; the slope
  drops the per-call cost), ns per (key, kv head) per thread;
- T, the streamed cost: b = 8, 4096 keys (134 MB of bfloat16, 67 MB of int8; 16 tasks of 8
  kv heads x 2048 keys, shared evenly by a thread count that divides 16), same unit;
- M = T - C, what reading the cache from memory adds;
- the products' floor: the scores' 4 x 128 multiply-adds per (key, kv head) at the measured
  bfloat16 dot-product peak (the fp32 FMA peak below the avx512bf16 level) and P V's 4 x 128
  at the fp32 FMA peak, per thread.
Then the ratio T(bfloat16) / T(int8) if the int8 cache's reads were wholly hidden behind its
arithmetic (T = C) while the bfloat16 cache's time stayed, and the int8 time 1.7x needs.
Not a benchmark with a peer: `python -m fmha.bench --decode` is.
"""

import statistics
import sys
import time

import torch

import fmha
from fmha.kvcache import attention_with_kvcache

HQ, HKV, D = 32, 8, 128
GROUP = HQ // HKV


def calls(b: int, sk: int) -> dict:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, 1, HQ, D, generator=g).bfloat16()
    lens = torch.full((b,), sk, dtype=torch.int32)
    kc = torch.randn(b, sk, HKV, D, generator=g).bfloat16()
    vc = torch.randn(b, sk, HKV, D, generator=g).bfloat16()
    k8 = torch.randint(-127, 128, (b, sk, HKV, D), dtype=torch.int8, generator=g)
    v8 = torch.randint(-127, 128, (b, sk, HKV, D), dtype=torch.int8, generator=g)
    unit = torch.ones(HKV)
    return {"bfloat16": lambda: attention_with_kvcache(q, kc, vc, cache_seqlens=lens),
            "int8": lambda: attention_with_kvcache(q, k8, v8, cache_seqlens=lens,
                                                  k_scale=unit, v_scale=unit)}


def per_call_us(f, n: int) -> float:
    f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n * 1e6


def measure(threads: int) -> None:
    fmha.set_num_threads(threads)
    lo, hi = (threads, 32), (threads, 192)
    shapes = {lo: calls(*lo), hi: calls(*hi), (8, 4096): calls(8, 4096)}
    times: dict[tuple, list[float]] = {}
    for _ in range(7):
        for (b, sk), fs in shapes.items():
            for name, f in fs.items():
                n = max(4, int(4e5 // (b * sk)))
                times.setdefault((b, sk, name), []).append(per_call_us(f, n))
    t = {k: statistics.median(v) for k, v in times.items()}
    fma = fmha._C.cpu_fma_peak_gflops(threads)
    dot = fmha._C.cpu_bf16_dot_peak_gflops(threads) or fma
    bw = fmha._C.cpu_read_bandwidth_gbs(threads)
    floor = threads * (2 * GROUP * D / dot + 2 * GROUP * D / fma)  # ns per (key, kv head)
    print(f"\n{threads} thread(s): fp32 FMA peak {fma:.0f} GFLOP/s, bf16 dot peak {dot:.0f} "
          f"GFLOP/s, read bandwidth {bw:.1f} GB/s")
    print("ns per (key, kv head) per thread   C (in L2)   T (streamed)   M = T - C   "
          "bytes / M")
    cost = {}
    for name, nbytes in (("bfloat16", 4 * D), ("int8", 2 * D)):
        c = (t[(*hi, name)] - t[(*lo, name)]) * 1e3 / ((hi[1] - lo[1]) * HKV)
        tt = t[(8, 4096, name)] * 1e3 / (8 * 4096 * HKV) * threads
        cost[name] = (c, tt, tt - c)
        rate = f"{nbytes / (tt - c) * threads:6.1f} GB/s (all threads)" if tt > c else "--"
        print(f"  {name:9s}{c:32.1f}{tt:15.1f}{tt - c:12.1f}   {rate}")
    (_, tb, _), (ci, ti, _) = cost["bfloat16"], cost["int8"]
    print(f"  measured T(bfloat16) / T(int8): {tb / ti:.2f}x")
    print(f"  the products at the measured peaks: {floor:.1f} ns per (key, kv head) per thread")
    print(f"  int8's reads wholly hidden (T = C), bfloat16 as now: {tb / ci:.2f}x; 1.7x needs "
          f"T(int8) <= {tb / 1.7:.1f} ns (now {ti:.1f}, its arithmetic {ci:.1f})")


def main() -> None:
    threads = [int(x) for x in sys.argv[1:]] or [1, 2]
    print(f"{fmha._C.cpu_description()} | CPU ISA {fmha.cpu_isa()} | heads {HQ}/{HKV}, "
          f"d {D}, 1 query, bfloat16 q")
    for th in threads:
        measure(th)


if __name__ == "__main__":
    main()
