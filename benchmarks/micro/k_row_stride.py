"""Does the forward lose time to K's row stride? The same work in two layouts, alternated
round by round in one process: (batch 1, 8 heads) -- K's rows of one head 8 x head_dim elements
apart, so a 64-row key tile at head_dim 64 maps onto 8 of the 48 KiB L1's 64 sets (bfloat16;
16 rows per set against its 12 ways) -- and (batch 8, 1 head), whose rows are dense.

    python benchmarks/micro/k_row_stride.py [bfloat16|float32]

Prints the median time and GFLOP/s of each over 12 rounds of 5 calls
(benchmarks/micro/k_row_stride_zen5_2026-12-03.txt).
"""

import sys
import time

import torch

import fmha

dtype = getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "bfloat16")
torch.manual_seed(0)
shapes = [(1, 2048, 8, 64), (8, 2048, 1, 64)]  # (batch, tokens, heads, head_dim)
inputs = [[torch.randn(*s, dtype=dtype) for _ in range(3)] for s in shapes]
for qkv in inputs:
    for _ in range(3):
        fmha.attention(*qkv)
times = [[] for _ in shapes]
for _ in range(12):
    for i, qkv in enumerate(inputs):
        start = time.perf_counter()
        for _ in range(5):
            fmha.attention(*qkv)
        times[i].append((time.perf_counter() - start) / 5)
flops = 4 * 8 * 2048 * 2048 * 64
for shape, ts in zip(shapes, times):
    med = sorted(ts)[len(ts) // 2]
    print(f"{dtype} {shape}: {med * 1e3:.2f} ms, {flops / med / 1e9:.0f} GFLOP/s")
