"""The CUDA FlashAttention-2 forward kernel (csrc/cuda/flash_fwd.cuh) under the SIMT emulator.

fmha._cuda_emu.flash_forward runs the real kernel source (mma.sync, ldmatrix, cp.async,
shuffles, emulated) on the CPU and is compared with fmha.reference (float64): out within
2x the error of a naive torch computation in the same low precision (design.md), lse the
same, with -inf (and out 0) exactly on the rows that see no key.

The emulator runs one OS thread per CUDA thread, so shapes stay tiny: seqlens 1, 17, 64
(one whole tile), 70 (a whole tile plus a tail), 80; batch and heads 1-2.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import assert_close, from_f64, naive_attention_torch
from fmha import reference
from fmha._philox import dropout_keep_mask

emu = pytest.importorskip("fmha._cuda_emu")
if not hasattr(emu, "flash_forward"):
    pytest.skip("fmha._cuda_emu was built without flash_forward", allow_module_level=True)

torch = pytest.importorskip("torch")  # the naive low-precision baseline (and bfloat16)


def run_case(rng, *, batch=1, sq, sk, hq=1, hkv=1, d=64, dtype="float16", causal=False,
             window=(-1, -1), alignment="bottom_right", scale=None, lib="numpy", softcap=0.0,
             bias=None, mask=None, alibi_slopes=None, dropout_p=0.0, seed=0, offset=0):
    q64 = rng.standard_normal((batch, sq, hq, d))
    k64 = rng.standard_normal((batch, sk, hkv, d))
    v64 = rng.standard_normal((batch, sk, hkv, d))
    q, k, v = (from_f64(x, dtype, lib) for x in (q64, k64, v64))
    if lib == "numpy":
        out = np.full((batch, sq, hq, d), np.nan, dtype=dtype)
        lse = np.full((batch, hq, sq), np.nan, dtype=np.float32)
    else:
        out = torch.full((batch, sq, hq, d), float("nan"), dtype=q.dtype)
        lse = torch.full((batch, hq, sq), float("nan"), dtype=torch.float32)
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    emu.flash_forward(q, k, v, out, lse, scale=scale, window_left=left, window_right=right,
                      bottom_right=alignment == "bottom_right", softcap=softcap, bias=bias,
                      mask=mask, alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed,
                      offset=offset)

    def f64(x):
        return x.double().numpy() if lib == "torch" else np.asarray(x, dtype=np.float64)

    extras = dict(softcap=softcap, alibi_slopes=alibi_slopes)
    ref_out, ref_lse = reference.attention_forward(
        f64(q), f64(k), f64(v), scale=scale, causal=causal, window=window, alignment=alignment,
        bias=None if bias is None else np.asarray(bias, np.float64), mask=mask,
        dropout_p=dropout_p, seed=seed, offset=offset, **extras)
    tq, tk, tv = (torch.as_tensor(x) for x in (q, k, v))
    z = None
    if dropout_p > 0:
        z = dropout_keep_mask(seed, offset, batch, hq, sq, sk, dropout_p) / (1.0 - dropout_p)
    naive_out, naive_lse = naive_attention_torch(
        tq, tk, tv, scale=scale, causal=causal, window=window, alignment=alignment,
        bias=None if bias is None else torch.as_tensor(np.asarray(bias, np.float64)),
        mask=None if mask is None else torch.as_tensor(np.asarray(mask)), dropout_z=z, **extras)
    assert_close("out", f64(out), ref_out, dtype, naive=naive_out.double().numpy())
    assert_close("lse", f64(lse), ref_lse, dtype, naive=naive_lse.double().numpy(),
                 result_dtype="float32")
    # A row that sees no key: out exactly 0 (not NaN, not the NaN the buffer was filled with).
    dead = np.isneginf(ref_lse)  # (b, hq, sq)
    if dead.any():
        o = f64(out).transpose(0, 2, 1, 3)
        assert np.all(o[dead] == 0.0)
    return dead


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("sq,sk", [(1, 1), (17, 17), (64, 64), (70, 70), (17, 80), (80, 17)])
def test_noncausal(rng, d, sq, sk):
    run_case(rng, sq=sq, sk=sk, d=d)


@pytest.mark.parametrize("alignment", ["bottom_right", "top_left"])
@pytest.mark.parametrize("sq,sk", [(70, 70), (17, 80), (80, 17)])
@pytest.mark.parametrize("d", [64, 128])
def test_causal(rng, d, sq, sk, alignment):
    dead = run_case(rng, sq=sq, sk=sk, d=d, causal=True, alignment=alignment)
    if sq > sk and alignment == "bottom_right":
        assert dead.sum() == sq - sk  # the first sq - sk rows see no key


@pytest.mark.parametrize("alignment", ["bottom_right", "top_left"])
@pytest.mark.parametrize("window,sq,sk", [((8, 0), 70, 70), ((5, 3), 17, 80), ((0, 0), 80, 64),
                                          ((20, -1), 70, 70), ((3, 2), 80, 17)])
def test_window(rng, window, sq, sk, alignment):
    run_case(rng, sq=sq, sk=sk, window=window, alignment=alignment)


@pytest.mark.parametrize("hq,hkv", [(2, 1), (2, 2)])
def test_gqa_batch(rng, hq, hkv):
    run_case(rng, batch=2, sq=17, sk=70, hq=hq, hkv=hkv, causal=True)


@pytest.mark.parametrize("d", [8, 40, 59, 111])
def test_odd_head_dims(rng, d):
    # Padded to the 64- or 128-wide tile with zero columns; odd dims are not 16-byte rows,
    # so these also take the element-wise (non-cp.async) load path.
    run_case(rng, sq=17, sk=70, d=d, causal=True, alignment="top_left")


def test_explicit_scale(rng):
    run_case(rng, sq=17, sk=17, scale=0.3)


@pytest.mark.parametrize("d", [64, 128])
def test_bfloat16(rng, d):
    run_case(rng, sq=70, sk=17, d=d, dtype="bfloat16", lib="torch", causal=True,
             alignment="top_left")
    run_case(rng, batch=2, sq=17, sk=70, hq=2, hkv=1, d=d, dtype="bfloat16", lib="torch")


def test_strided_views(rng):
    # q, k, v as views of one packed (b, s, 3, h, d) tensor (a fused qkv projection).
    b, s, h, d = 1, 33, 2, 64
    qkv = rng.standard_normal((b, s, 3, h, d)).astype(np.float16)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    out = np.zeros((b, s, h, d), np.float16)
    lse = np.zeros((b, h, s), np.float32)
    emu.flash_forward(q, k, v, out, lse, window_right=0)
    ref_out, ref_lse = reference.attention_forward(q, k, v, causal=True)
    naive_out, naive_lse = naive_attention_torch(*(torch.from_numpy(np.ascontiguousarray(x))
                                                   for x in (q, k, v)), causal=True)
    assert_close("out", out, ref_out, "float16", naive=naive_out.double().numpy())
    assert_close("lse", lse, ref_lse, "float16", naive=naive_lse.double().numpy(),
                 result_dtype="float32")


def test_rejects_bad_inputs():
    q = np.zeros((1, 4, 2, 64), np.float16)
    out = np.zeros_like(q)
    lse = np.zeros((1, 2, 4), np.float32)
    with pytest.raises(ValueError, match="head_dim"):
        big = np.zeros((1, 4, 1, 256), np.float16)
        emu.flash_forward(big, big, big, np.zeros_like(big), np.zeros((1, 1, 4), np.float32))
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        f = q.astype(np.float32)
        emu.flash_forward(f, f, f, f, lse)
    with pytest.raises(ValueError, match="multiple of heads_kv"):
        kv = np.zeros((1, 4, 3, 64), np.float16)
        emu.flash_forward(q, kv, kv, out, lse)
    with pytest.raises(ValueError, match="lse"):
        emu.flash_forward(q, q, q, out, np.zeros((1, 2, 5), np.float32))


# ----------------------------------------------------------------------------- score pipeline

@pytest.mark.parametrize("d", [64, 128])
def test_softcap(rng, d):
    run_case(rng, sq=70, sk=70, d=d, causal=True, softcap=0.5, scale=1.0)


@pytest.mark.parametrize("bias_dtype", ["float32", "float64", "float16"])
def test_bias_full(rng, bias_dtype):
    b, hq, sq, sk = 2, 2, 17, 70
    bias = (rng.standard_normal((b, hq, sq, sk)) * 2).astype(bias_dtype)
    run_case(rng, batch=b, sq=sq, sk=sk, hq=hq, hkv=1, bias=bias)


def test_bias_broadcast_with_neg_inf(rng):
    # (1, hq, 1, sk): a per-head key bias, broadcast over batch and rows by zero strides;
    # -inf on some keys acts as a mask, and on all keys of head 0 empties its rows.
    b, hq, sq, sk = 2, 2, 17, 70
    bias = rng.standard_normal((1, hq, 1, sk)).astype(np.float32)
    bias[:, 1, :, ::3] = -np.inf
    bias[:, 0] = -np.inf
    dead = run_case(rng, batch=b, sq=sq, sk=sk, hq=hq, hkv=2, bias=bias)
    assert dead[:, 0].all() and not dead[:, 1].any()


def test_mask_key_padding_and_full(rng):
    b, hq, sq, sk = 2, 1, 70, 17
    pad = np.ones((b, 1, 1, sk), bool)
    pad[1, ..., 9:] = False  # sequence 1 has 9 valid keys
    run_case(rng, batch=b, sq=sq, sk=sk, hq=hq, mask=pad)
    full = rng.random((b, hq, sq, sk)) < 0.7
    full[0, 0, 3] = False  # a row with no key
    dead = run_case(rng, batch=b, sq=sq, sk=sk, hq=hq, mask=full, causal=True,
                    alignment="top_left")
    assert dead[0, 0, 3]


@pytest.mark.parametrize("slopes_shape", [(2,), (2, 2)])
def test_alibi(rng, slopes_shape):
    slopes = rng.uniform(0.05, 0.5, slopes_shape)
    run_case(rng, batch=2, sq=17, sk=70, hq=2, hkv=1, alibi_slopes=slopes, causal=True)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout(rng, p):
    run_case(rng, batch=2, sq=70, sk=70, hq=2, hkv=1, dropout_p=p, seed=1234, offset=7)
    run_case(rng, sq=17, sk=80, d=128, dropout_p=p, seed=(1 << 40) + 5, offset=(3 << 33) + 1,
             causal=True)


def test_everything_at_once(rng):
    b, hq, sq, sk = 1, 2, 33, 70
    run_case(rng, batch=b, sq=sq, sk=sk, hq=hq, hkv=1, d=40, softcap=2.0,
             bias=rng.standard_normal((b, hq, sq, sk)).astype(np.float32),
             mask=rng.random((1, 1, sq, sk)) < 0.8, alibi_slopes=rng.uniform(0.1, 0.3, hq),
             dropout_p=0.2, seed=99, window=(20, 5), alignment="top_left")
