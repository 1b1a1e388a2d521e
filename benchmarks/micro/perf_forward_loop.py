"""One fmha forward call repeated for 8 seconds, for `perf record` (a sampling profile of the
CPU kernels in situ; benchmarks/micro/perf_profile_zen5_2026-12-02.txt):

    perf record -F 2000 -o perf.data python benchmarks/micro/perf_forward_loop.py [float32]
    perf report -i perf.data --no-children --sort dso,symbol -g none

Shape (batch 1, 8 heads, 2048 tokens, head_dim 64), the suite's first case; bfloat16 unless
a dtype is given. Prints the calls made and the time per call.
"""

import sys
import time

import torch

import fmha

dtype = getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "bfloat16")
torch.manual_seed(0)
q, k, v = (torch.randn(1, 2048, 8, 64, dtype=dtype) for _ in range(3))
for _ in range(3):
    fmha.attention(q, k, v)
start, calls = time.time(), 0
while time.time() - start < 8:
    fmha.attention(q, k, v)
    calls += 1
print(calls, "calls,", f"{(time.time() - start) / calls * 1e3:.2f} ms per call")
