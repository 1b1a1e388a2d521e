"""Spot check of one decode call over an 8-bit or a bfloat16 cache: the quick loop behind
the step-by-step table in benchmarks/NOTES.md ("8-bit KV caches on the CPU", "After").
Not a benchmark (no peer, no bandwidth fraction): `python -m fmha.bench --decode` is.

    python benchmarks/decode_kvquant_spot.py {bf16,int8,e4m3,e5m2} [calls] [queries]

b = 8, 32 query heads over 8 kv heads, 4096 keys, head_dim 128, bfloat16 q; prints the mean
ms per call of attention_with_kvcache (causal when queries > 1).
"""

import sys
import time

import torch

from fmha.kvcache import attention_with_kvcache


def main() -> None:
    fmt = sys.argv[1]
    calls = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    sq = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    b, hq, hkv, sk, d = 8, 32, 8, 4096, 128
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, sq, hq, d, generator=g).bfloat16()
    if fmt == "bf16":
        kc = torch.randn(b, sk, hkv, d, generator=g).bfloat16()
        kw = {}
    else:
        dtype = {"int8": torch.int8, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt]
        codes = torch.randint(-100, 100, (b, sk, hkv, d), dtype=torch.int8, generator=g)
        if fmt != "int8":  # keep float8 codes finite: no all-ones exponent
            codes = (codes.view(torch.uint8) & 0x77).view(torch.int8)
        kc = codes.view(dtype)
        kw = dict(k_scale=torch.ones(hkv), v_scale=torch.ones(hkv))
    vc = kc.clone()
    lens = torch.full((b,), sk, dtype=torch.int32)
    call = lambda: attention_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=sq > 1, **kw)
    for _ in range(3):
        call()
    t = time.perf_counter()
    for _ in range(calls):
        call()
    print(f"{fmt} {sq} queries: {(time.perf_counter() - t) / calls * 1e3:.2f} ms per call")


if __name__ == "__main__":
    main()
