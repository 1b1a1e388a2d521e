"""Where the error of a key-constant bias's dbias comes from (docs/cuda_kernels.md, "The backward").

The exact gradient of a bias constant along the keys is 0. FlashAttention-2 computes it as
sum_j dS_ij with D = rowsum(dO o O) from the stored float16 O, so what it returns is D's
rounding error. This feeds the emulated CUDA backward three different O's -- the emulated
CUDA forward's, the CPU forward's, and the float64 reference's rounded to float16 (the best
a stored O can be) -- and prints |sum of dS over the broadcast dims - reference| for each,
next to 3x the naive float16 autograd error (flash-attn's bound for gradients).

The bias is passed full-size (its values repeated over the keys) so that the backward
computes dS instead of writing the zeros of dbias_is_zero; the sum is taken here in float64.

    python tools/dbias_d_error.py      (needs the emulator: fmha._cuda_emu, and torch)
"""
import sys
from pathlib import Path

import numpy as np
import torch

import fmha
from fmha import _cuda_emu as emu

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import naive_results, reference_results  # noqa: E402


def dbias_sum(q, k, v, dout, out, lse, bias_full, shape):
    dq, dk, dv = (torch.full_like(x, float("nan")) for x in (q, k, v))
    ds = torch.full(bias_full.shape, float("nan"))
    emu.flash_backward(dout, q, k, v, out, lse, dq, dk, dv, dbias=ds, bias=bias_full)
    axes = tuple(i for i, n in enumerate(shape) if n == 1)
    return ds.double().numpy().sum(axis=axes, keepdims=True)


def main():
    b, sq, sk, h = 2, 33, 70, 2
    print("| bias shape | d | 3 x naive f16 | emulated CUDA fwd O | CPU fwd O | f64 O rounded to f16 |")
    print("|---|---|---|---|---|---|")
    for shape in [(1, 1, sq, 1), (1, h, 1, 1)]:
        for d in (64, 96):
            bias = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
            bias_full = bias.expand(b, h, sq, sk).contiguous()
            gen = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(b, n, h, d, generator=gen).half() for n in (sq, sk, sk))
            dout = torch.randn(b, sq, h, d, generator=gen).half()
            ref = reference_results(q, k, v, dout, bias=bias, bias_grad=True)
            naive = naive_results(q, k, v, dout, bias=bias.half(), bias_grad=True)
            bound = 3 * np.abs(naive["dbias"].double().numpy() - ref["dbias"]).max()
            outs = []
            out, lse = torch.empty_like(q), torch.empty(b, h, sq)
            emu.flash_forward(q, k, v, out, lse, bias=bias)
            outs.append((out, lse))
            out, lse = fmha.attention(q, k, v, bias=bias, return_lse=True)
            outs.append((out.contiguous(), lse.float().contiguous()))
            outs.append((torch.from_numpy(ref["out"]).half(), torch.from_numpy(ref["lse"]).float()))
            errs = [np.abs(dbias_sum(q, k, v, dout, o, l, bias_full, shape) - ref["dbias"]).max()
                    for o, l in outs]
            print(f"| {shape} | {d} | {bound:.5f} | " + " | ".join(f"{e:.5f}" for e in errs) + " |",
                  flush=True)


if __name__ == "__main__":
    main()
