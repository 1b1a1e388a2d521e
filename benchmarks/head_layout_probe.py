"""The causal float32 forward with q, k, v in the usual (batch, seq, heads, dim) layout against
head-major tensors of the same shape passed as transposed views, where one head's rows are
contiguous: how much a head's rows lying a page apart cost (benchmarks/NOTES.md, "Long
sequences"). Three rounds, best of the repeats, GFLOP/s (causal: half of 4·h·s²·d).

    python benchmarks/head_layout_probe.py
"""

import time

import torch

import fmha


def gflops(s: int, head_major: bool, reps: int) -> float:
    shape = (1, 8, s, 64) if head_major else (1, s, 8, 64)
    q, k, v = [torch.randn(*shape) for _ in range(3)]
    if head_major:
        q, k, v = [x.transpose(1, 2) for x in (q, k, v)]
    fmha.attention(q, k, v, causal=True)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fmha.attention(q, k, v, causal=True)
        best = min(best, time.perf_counter() - t)
    return 4 * 8 * s * s * 64 / 2 / best / 1e9


def main() -> None:
    torch.manual_seed(0)
    print(fmha._C.cpu_description(), "| threads", fmha.get_num_threads())
    for r in range(3):
        print(f"round {r}: 16384 keys: (b,s,h,d) {gflops(16384, False, 2):.0f}, head-major "
              f"{gflops(16384, True, 2):.0f} | 2048 keys: (b,s,h,d) {gflops(2048, False, 8):.0f}, "
              f"head-major {gflops(2048, True, 8):.0f}", flush=True)


if __name__ == "__main__":
    main()
