"""Decode over 8-bit caches against a bfloat16 cache, alternated in one process: the ratio
the issue's target is stated in, robust to a host whose speed drifts between runs.

    python benchmarks/decode_kvquant_ab.py [queries] [rounds]

b = 8, 32 query heads over 8 kv heads, 4096 keys, head_dim 128, bfloat16 q, 2 threads, unit
static scales (causal when queries > 1). Each round times 4 calls of each cache in turn;
printed: the median ms per call and the median of the per-round ratios (bfloat16 time / this
cache's time, > 1 is faster than bfloat16). Not a benchmark with a peer: `python -m
fmha.bench --decode` is.

To compare two builds, run it against a copy of the other build's package: a directory
holding `fmha/` (python/fmha plus that build's `_C*.so`) named by FMHA_AB_PACKAGE, which is
then imported instead of the installed one (the editable install's finder is set aside).
"""

import os
import statistics
import sys

if os.environ.get("FMHA_AB_PACKAGE"):
    sys.meta_path = [f for f in sys.meta_path if "editable" not in type(f).__module__]
    sys.path.insert(0, os.environ["FMHA_AB_PACKAGE"])

import time  # noqa: E402

import torch  # noqa: E402

import fmha  # noqa: E402
from fmha.kvcache import attention_with_kvcache  # noqa: E402


def main() -> None:
    sq = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    fmha.set_num_threads(2)
    b, hq, hkv, sk, d = 8, 32, 8, 4096, 128
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, sq, hq, d, generator=g).bfloat16()
    lens = torch.full((b,), sk, dtype=torch.int32)
    kc = torch.randn(b, sk, hkv, d, generator=g).bfloat16()
    vc = kc.clone()
    calls = {"bfloat16": lambda: attention_with_kvcache(q, kc, vc, cache_seqlens=lens,
                                                        causal=sq > 1)}
    unit = torch.ones(hkv)
    for name, dtype in [("int8", torch.int8), ("float8_e4m3fn", torch.float8_e4m3fn),
                        ("float8_e5m2", torch.float8_e5m2)]:
        codes = torch.randint(-100, 100, (b, sk, hkv, d), dtype=torch.int8, generator=g)
        if name != "int8":  # finite float8 codes: no all-ones exponent
            codes = (codes.view(torch.uint8) & 0x77).view(torch.int8)
        k8, v8 = codes.view(dtype), codes.clone().view(dtype)
        calls[name] = (lambda k8=k8, v8=v8: attention_with_kvcache(
            q, k8, v8, cache_seqlens=lens, causal=sq > 1, k_scale=unit, v_scale=unit))
    times: dict[str, list[float]] = {name: [] for name in calls}
    for f in calls.values():
        f()
    for _ in range(rounds):
        for name, f in calls.items():
            t = time.perf_counter()
            for _ in range(4):
                f()
            times[name].append((time.perf_counter() - t) / 4 * 1e3)
    print(f"{fmha.__file__} | {fmha._C.cpu_description()} | {sq} queries, {rounds} rounds")
    for name in calls:
        ratio = statistics.median(a / b for a, b in zip(times["bfloat16"], times[name]))
        print(f"{name:14s} {statistics.median(times[name]):7.2f} ms   x bfloat16 {ratio:.2f}")


if __name__ == "__main__":
    main()
