"""Per-call time of small calls in a plain loop (no harness, no per-call no_grad entry):
the tiny call through each entry point, torch's own SDPA on the same data, and one decode
step through the Hugging Face entries (fmha's and transformers' "sdpa"), and the tiny call
with inputs that require grad (fmha and SDPA). Prints a
Markdown table with the host; docs/cpu_kernels.md, "Small calls", quotes its results.
Then the tiny call's forward and backward (a training step's attention), and what the
first forward and backward of a fresh process cost (a subprocess each, fmha and SDPA).

    python tools/plain_call_loop.py
"""

import statistics
import subprocess
import sys
import time

import torch

import fmha
import fmha.integrations.transformers as hf_fmha
from transformers.integrations.sdpa_attention import sdpa_attention_forward


def per_call_us(fn, n=5000, batches=7):
    for _ in range(300):
        fn()
    means = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        means.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(means)


# A fresh interpreter: import, then one forward and backward of the tiny call, timed apart.
_FIRST_CALL = """
import time, torch
import fmha
F = torch.nn.functional
q, k, v = (torch.randn(1, 16, 8, 64, requires_grad=True) for _ in range(3))
call = {"fmha": lambda: fmha.attention(q, k, v),
        "sdpa": lambda: F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)))}
t0 = time.perf_counter(); out = call[WHICH](); t1 = time.perf_counter()
out.sum().backward(); t2 = time.perf_counter()
print((t1 - t0) * 1e3, (t2 - t1) * 1e3)
"""


def first_call_ms(which):
    """(forward, backward) milliseconds of the first tiny call in a new process."""
    code = _FIRST_CALL.replace("WHICH", repr(which))
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return tuple(float(x) for x in out.stdout.split())


class Layer(torch.nn.Module):  # what the Hugging Face entries read of the calling layer
    is_causal = True
    num_key_value_groups = 4


def main():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, s, 8, 64, generator=g) for s in (1, 16, 16))
    qn, kn, vn = (x.numpy() for x in (q, k, v))
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    # a decode step as transformers calls attention: (batch, heads, seq, dim), GQA 8/2
    hq, hk, hv = (torch.randn(1, h, s, 64, generator=g) for h, s in ((8, 1), (2, 80), (2, 80)))
    layer = Layer()
    F = torch.nn.functional
    rows = []
    with torch.no_grad():
        rows.append(("fmha.attention, torch, tiny call", per_call_us(lambda: fmha.attention(q, k, v))))
        rows.append(("fmha.attention, NumPy, tiny call", per_call_us(lambda: fmha.attention(qn, kn, vn))))
        rows.append(("torch SDPA, tiny call", per_call_us(lambda: F.scaled_dot_product_attention(qt, kt, vt))))
        rows.append(("fmha Hugging Face entry, decode step (1 query, 80 keys, GQA 8/2)",
                     per_call_us(lambda: hf_fmha.fmha_attention_forward(layer, hq, hk, hv, None,
                                                                        scaling=0.125))))
        rows.append(("transformers sdpa entry, same decode step",
                     per_call_us(lambda: sdpa_attention_forward(layer, hq, hk, hv, None,
                                                                scaling=0.125))))
    # The same tiny call recording a graph (forward only): what a training step pays per call.
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    qtg, ktg, vtg = (x.clone().requires_grad_() for x in (qt, kt, vt))
    rows.append(("fmha.attention, torch, tiny call, inputs requiring grad",
                 per_call_us(lambda: fmha.attention(qg, kg, vg), n=1000)))
    rows.append(("torch SDPA, same, inputs requiring grad",
                 per_call_us(lambda: F.scaled_dot_product_attention(qtg, ktg, vtg), n=1000)))
    # Forward and backward of the tiny call: what a training step pays per attention call.
    def fwd_bwd(fn, inputs):
        def step():
            fn(*inputs).sum().backward()
            for x in inputs:
                x.grad = None
        return step
    rows.append(("fmha.attention, torch, tiny call, forward and backward",
                 per_call_us(fwd_bwd(fmha.attention, (qg, kg, vg)), n=1000)))
    rows.append(("torch SDPA, same, forward and backward",
                 per_call_us(fwd_bwd(F.scaled_dot_product_attention, (qtg, ktg, vtg)), n=1000)))
    firsts = [(name, first_call_ms(which)) for name, which in
              (("fmha.attention", "fmha"), ("torch SDPA", "sdpa"))]
    print(f"host: {fmha._C.cpu_description()} | fmha threads {fmha.get_num_threads()} | CPU ISA "
          f"{fmha.cpu_isa()} | torch {torch.__version__}\n")
    print("| call | µs per call (median of 7 batches of 5000; 1000 with grad) |")
    print("|---|---:|")
    for name, us in rows:
        print(f"| {name} | {us:.1f} |")
    print("\n| first tiny call of a new process (inputs requiring grad) | forward ms | backward ms |")
    print("|---|---:|---:|")
    for name, (f, b) in firsts:
        print(f"| {name} | {f:.1f} | {b:.1f} |")


if __name__ == "__main__":
    main()
