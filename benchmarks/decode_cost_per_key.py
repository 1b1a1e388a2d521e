"""What one key costs the CPU decode, with its cache in L2 and streamed from memory: whether
the decode is bound by memory or by its arithmetic on this host.

    python benchmarks/decode_cost_per_key.py

One thread, one query, 32 query heads over 8 kv heads, head_dim 128, bfloat16 q; a bfloat16
cache and an int8 cache (unit static scales). Printed: the median ns per (key, kv head) of
attention_with_kvcache over 5 rounds, for b = 1 with 256 and 512 keys (the int8 cache's
1 MiB, or less, stays in L2 between calls) and b = 8 with 4096 keys (67 MB of int8 codes,
134 MB of bfloat16: read from memory on every call). A cost that does not grow from the
first shapes to the last is arithmetic, not memory. Not a benchmark with a peer: `python -m
fmha.bench --decode` is.
"""

import statistics
import time

import torch

import fmha
from fmha.kvcache import attention_with_kvcache


def main() -> None:
    fmha.set_num_threads(1)
    hq, hkv, d = 32, 8, 128
    cost: dict[tuple, list[float]] = {}
    for b, sk in [(1, 256), (1, 512), (8, 4096)]:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(b, 1, hq, d, generator=g).bfloat16()
        lens = torch.full((b,), sk, dtype=torch.int32)
        kc = torch.randn(b, sk, hkv, d, generator=g).bfloat16()
        vc = kc.clone()
        k8 = torch.randint(-100, 100, (b, sk, hkv, d), dtype=torch.int8, generator=g)
        v8 = k8.clone()
        unit = torch.ones(hkv)
        calls = {"bfloat16": lambda: attention_with_kvcache(q, kc, vc, cache_seqlens=lens),
                 "int8": lambda: attention_with_kvcache(q, k8, v8, cache_seqlens=lens,
                                                       k_scale=unit, v_scale=unit)}
        n = max(4, int(2e5 // (b * sk)))
        for _ in range(5):
            for name, f in calls.items():
                f()
                t = time.perf_counter()
                for _ in range(n):
                    f()
                per_key = (time.perf_counter() - t) / n / (b * sk * hkv) * 1e9
                cost.setdefault((b, sk, name), []).append(per_key)
    print(f"{fmha._C.cpu_description()} | 1 thread | ns per (key, kv head), median of 5")
    for (b, sk, name), v in cost.items():
        print(f"b {b:2d}  keys {sk:5d}  {name:9s} {statistics.median(v):6.1f}")


if __name__ == "__main__":
    main()
