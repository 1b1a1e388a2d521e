"""A bfloat16 cache and 8-bit caches timed alternately in one process: the ratio of their
decode times per round, which a drifting host leaves in place where single timings do not
(benchmarks/NOTES.md, "8-bit KV caches on the CPU"). Not a benchmark with a peer:
`python -m fmha.bench --decode` is.

    python benchmarks/decode_kvquant_alternate.py [rounds] [queries] [sk] [b]

b = 8, 32 query heads over 8 kv heads, 4096 keys, head_dim 128, bfloat16 q by default, all
caches full; per round each cache takes 5 calls (the median of them is its time). Prints
the median over rounds of (bfloat16 time / 8-bit time) per 8-bit format: the issue's
tokens/s ratio.
"""

import statistics
import sys
import time

import torch

from fmha.kvcache import attention_with_kvcache


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    sq = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    sk = int(sys.argv[3]) if len(sys.argv) > 3 else 4096
    b = int(sys.argv[4]) if len(sys.argv) > 4 else 8
    hq, hkv, d = 32, 8, 128
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, sq, hq, d, generator=g).bfloat16()
    lens = torch.full((b,), sk, dtype=torch.int32)
    caches = {"bf16": (torch.randn(b, sk, hkv, d, generator=g).bfloat16(), {})}
    for name, dtype in (("int8", torch.int8), ("e4m3", torch.float8_e4m3fn),
                        ("e5m2", torch.float8_e5m2)):
        codes = torch.randint(-100, 100, (b, sk, hkv, d), dtype=torch.int8, generator=g)
        if name != "int8":  # keep float8 codes finite: no all-ones exponent
            codes = (codes.view(torch.uint8) & 0x77).view(torch.int8)
        caches[name] = (codes.view(dtype), dict(k_scale=torch.ones(hkv), v_scale=torch.ones(hkv)))
    vcaches = {k: c.clone() for k, (c, _) in caches.items()}

    def timed(name):
        kc, kw = caches[name]
        ts = []
        for _ in range(5):
            t = time.perf_counter()
            attention_with_kvcache(q, kc, vcaches[name], cache_seqlens=lens, causal=sq > 1, **kw)
            ts.append(time.perf_counter() - t)
        return statistics.median(ts)

    for name in caches:
        timed(name)  # warm-up
    ratios = {k: [] for k in caches if k != "bf16"}
    times = {k: [] for k in caches}
    for _ in range(rounds):
        for name in caches:
            times[name].append(timed(name))
        for k in ratios:
            ratios[k].append(times["bf16"][-1] / times[k][-1])
    print(f"b {b}, heads {hq}/{hkv}, {sk} keys, d {d}, {sq} queries, {rounds} rounds; "
          f"torch threads {torch.get_num_threads()}")
    for name in caches:
        print(f"  {name:5s} median {statistics.median(times[name]) * 1e3:6.2f} ms per call")
    for k, r in ratios.items():
        print(f"  {k:5s} bfloat16 time / {k} time: median {statistics.median(r):.2f} "
              f"(rounds {min(r):.2f}-{max(r):.2f})")


if __name__ == "__main__":
    main()
