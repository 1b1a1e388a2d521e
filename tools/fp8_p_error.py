"""The error of rounding P to e4m3 in a float8 attention forward, measured with the
reference's model of such a kernel (fmha.reference.attention_fp8_forward(quantize_p=True))
against the exact attention of the same dequantised inputs.

Inputs are unit-normal float32 values cast to float8_e4m3fn (descale 1; "sharpness" scales
q and k, so scores are up to that factor squared sharper). The error is max|out - ref| /
max(max|ref|, 1), the measure of tests/conftest.py's FP8_P_TOL. Prints one line per shape
and the worst case; docs/semantics.md ("FP8 inputs") quotes it.

    python tools/fp8_p_error.py [--seeds 3]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from fmha import reference


def _codes(rng, shape, sharpness=1.0):
    x = torch.from_numpy(rng.standard_normal(shape).astype(np.float32) * sharpness)
    return x.to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def error(rng, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal, block_k,
          sharpness):
    """(max, rms) error of one draw, relative to max(max|ref|, 1)."""
    q = _codes(rng, (batch, seqlen_q, heads_q, head_dim), sharpness)
    k = _codes(rng, (batch, seqlen_k, heads_kv, head_dim), sharpness)
    v = _codes(rng, (batch, seqlen_k, heads_kv, head_dim))
    ref, _ = reference.attention_fp8_forward(q, k, v, causal=causal)
    model, _ = reference.attention_fp8_forward(q, k, v, causal=causal, quantize_p=True,
                                               block_k=block_k)
    scale = max(float(np.abs(ref).max()), 1.0)
    err = np.abs(model - ref)
    return float(err.max()) / scale, float(np.sqrt((err ** 2).mean())) / scale


#: (seqlen, head_dim, causal, block_k, sharpness): long rows, the kernel's tile widths
#: (flash-attn 3's fp8 tiles are 128..224 keys), sharper scores.
LONG = [(128, 64, False, 128, 1), (128, 64, True, 128, 1), (512, 64, False, 64, 1),
        (512, 128, True, 128, 1), (512, 128, False, 176, 1), (512, 128, False, 224, 1),
        (1024, 256, False, 128, 1), (2048, 128, False, 128, 1), (2048, 128, True, 128, 1),
        (512, 128, False, 128, 2), (512, 128, True, 128, 3)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3, help="draws per short shape")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    worst, draws = 0.0, 0
    print("seqlen head_dim causal block_k sharpness  max_err  rms_err")
    for s, d, causal, bk, sharp in LONG:
        e, r = error(rng, 1, s, s, 4, 2, d, causal, bk, sharp)
        worst, draws = max(worst, e), draws + 1
        print(f"{s:6d} {d:8d} {causal!s:6} {bk:7d} {sharp:9g}  {e:7.4f}  {r:7.5f}")
    # Short rows, where one probability weighs most: several draws each, k 3 rows longer.
    for s in (1, 2, 3, 5, 8, 16, 32, 64, 96, 200, 300):
        short_worst = 0.0
        for d in (32, 64, 128):
            for causal in (False, True):
                for sharp in (1.0, 2.0):
                    for _ in range(a.seeds):
                        e, _ = error(rng, 2, s, s + 3, 4, 2, d, causal, 64, sharp)
                        short_worst, draws = max(short_worst, e), draws + 1
        worst = max(worst, short_worst)
        print(f"{s:6d}  head_dim 32/64/128, causal or not, sharpness 1/2, block_k 64: "
              f"worst {short_worst:.4f}")
    print(f"worst over {draws} draws: {worst:.4f}")


if __name__ == "__main__":
    main()
