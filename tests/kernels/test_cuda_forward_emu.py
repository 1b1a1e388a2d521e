"""The CUDA FlashAttention-2 forward kernel (csrc/cuda/flash_fwd.cuh) under the SIMT emulator.

fmha._cuda_emu.flash_forward runs the real kernel source (mma.sync, ldmatrix, cp.async,
shuffles, emulated) on the CPU and is compared with fmha.reference (float64): out within
2x the error of a naive torch computation in the same low precision (docs/testing.md), lse
the same, with -inf (and out 0) exactly on the rows that see no key.

Also: every head-dim tile (32, 64, 96, 128, 256, odd dims in the next tile), varlen
batches (cu_seqlens, against fmha.reference.attention_varlen_forward), split-KV (forced
splits, empty splits, fully masked rows) and the generated instantiation files; and, at the
end (test_sm90_*), the Hopper forward (csrc/cuda/flash_fwd_sm90.cuh) and its routing.

The emulator runs every CUDA thread of a block in turn, so shapes stay tiny: seqlens 1, 17, 64
(one whole tile), 70 (a whole tile plus a tail), 80, 130; batch and heads 1-2.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
             bias=None, mask=None, alibi_slopes=None, dropout_p=0.0, seed=0, offset=0,
             num_splits=1, expect_splits=None, qk64=None):
    q64 = rng.standard_normal((batch, sq, hq, d))
    k64 = rng.standard_normal((batch, sk, hkv, d))
    v64 = rng.standard_normal((batch, sk, hkv, d))
    if qk64 is not None:  # scores of a chosen shape
        q64, k64 = qk64
    q, k, v = (from_f64(x, dtype, lib) for x in (q64, k64, v64))
    if lib == "numpy":
        out = np.full((batch, sq, hq, d), np.nan, dtype=dtype)
        lse = np.full((batch, hq, sq), np.nan, dtype=np.float32)
    else:
        out = torch.full((batch, sq, hq, d), float("nan"), dtype=q.dtype)
        lse = torch.full((batch, hq, sq), float("nan"), dtype=torch.float32)
    left, right = window
    if causal:
        right = 0  # causal: no key after the diagonal, whatever window[1] said
    used = emu.flash_forward(q, k, v, out, lse, scale=scale, window_left=left,
                             window_right=right, bottom_right=alignment == "bottom_right",
                             softcap=softcap, bias=bias, mask=mask, alibi_slopes=alibi_slopes,
                             dropout_p=dropout_p, seed=seed, offset=offset,
                             num_splits=num_splits)
    if expect_splits is not None:
        assert used == expect_splits

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


@pytest.mark.parametrize("d", [8, 32, 40, 59, 96, 111, 200, 256])
def test_head_dims(rng, d):
    # Every tile (32, 64, 96, 128, 256); odd dims run in the next tile with zero columns and,
    # not being 16-byte rows, take the element-wise (non-cp.async) load path.
    run_case(rng, sq=17, sk=70, d=d, causal=True, alignment="top_left")


@pytest.mark.parametrize("d", [32, 96, 256])
def test_head_dims_extras_bf16(rng, d):
    # The extras configs (narrower key blocks) of the new tiles, in bfloat16.
    run_case(rng, batch=1, sq=33, sk=40, hq=2, hkv=1, d=d, dtype="bfloat16", lib="torch",
             softcap=3.0, alibi_slopes=rng.uniform(0.1, 0.3, 2), causal=True)


def test_explicit_scale(rng):
    run_case(rng, sq=17, sk=17, scale=0.3)


@pytest.mark.parametrize("scale", [-0.3, 0.0])
def test_scale_not_positive(rng, scale):
    # The plain kernel folds the scale into exp2, which needs scale > 0: such calls run in
    # the extras kernel (flash_fwd.cu), and must still mask and normalise the same way.
    run_case(rng, sq=70, sk=130, scale=scale, causal=True)


def test_scale_rounding_to_zero_as_float(rng):
    # 1e-50 is positive as a double and 0 as a float: folded into exp2 it would have turned the
    # masked keys of the partial last block into NaN; the extras kernel scales, then masks.
    run_case(rng, sq=100, sk=100, scale=1e-50)


def test_scaled_scores_overflowing_float_make_rows_nan():
    # q.k = 64 times 1e37 overflows float32: the CPU kernels give NaN rows (an Inf logit), and
    # so must the plain CUDA forward, whose folded exp2 would otherwise give every key P = 0.
    import fmha

    q = np.ones((1, 64, 1, 64), np.float16)
    out = np.zeros_like(q)
    lse = np.zeros((1, 1, 64), np.float32)
    emu.flash_forward(q, q, q, out, lse, scale=1e37)
    cpu_out, cpu_lse = fmha.attention(q, q, q, scale=1e37, return_lse=True)
    assert np.isnan(np.asarray(cpu_out, np.float32)).all() and np.isnan(cpu_lse).all()
    assert np.isnan(out.astype(np.float32)).all() and np.isnan(lse).all()


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("window,causal", [((-1, -1), False), ((-1, -1), True),
                                           ((100, 0), False), ((70, 30), False)])
def test_inner_and_edge_blocks(rng, d, window, causal):
    # Long enough for key blocks inside every row's window (copied without bounds tests and
    # scored without a mask: the plain kernel's steady state) beside the window's edge blocks
    # and the sequence's partial last block, in 4 query blocks.
    run_case(rng, sq=200, sk=330, d=d, window=window, causal=causal)


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
        big = np.zeros((1, 4, 1, 257), np.float16)
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


# ----------------------------------------------------------------------------- split-KV

@pytest.mark.parametrize("splits", [2, 3, 7])
@pytest.mark.parametrize("d", [64, 128])
def test_split_kv_forced(rng, splits, d):
    # 130 keys = 3 key blocks of 64 (5 of 32 for extras and plain d = 128): 7 splits leave
    # some empty.
    run_case(rng, sq=17, sk=130, d=d, num_splits=splits, expect_splits=splits)
    run_case(rng, sq=70, sk=130, d=d, causal=True, alignment="top_left", num_splits=splits,
             expect_splits=splits)


@pytest.mark.parametrize("d", [32, 64, 128])
def test_whole_blocks_from_a_later_first_block(rng, d):
    # The 32-row kernels keep their pointers into the next whole K/V block in shared memory,
    # moved on by a block per copy from the CTA's first block: a window (row 0 sees keys
    # 169-319: blocks 2-4 of 64, 5-9 of 32) or a split (the second of two takes blocks 3-4 of
    # 64, 5-9 of 32) that starts past block 0 must copy the right blocks, several in a row.
    run_case(rng, sq=1, sk=320, d=d, window=(150, 0))
    run_case(rng, sq=17, sk=320, d=d, num_splits=2, expect_splits=2)


def _rising_scores(rng, sq, sk, d, growth, every=3, heads=1, rows=None):
    """q, k whose scores rise along the keys by `growth` log2 units per 64 keys on rows 0,
    every, 2 every, ... (or the rows `rows` selects) and stay flat on the others (their
    column 0 is 0)."""
    q64 = rng.standard_normal((1, sq, heads, d)) * 0.3
    k64 = rng.standard_normal((1, sk, heads, d)) * 0.3
    q64[0, :, :, 0] = 0.0
    q64[0, slice(None, None, every) if rows is None else rows, :, 0] = 1.0
    k64[0, :, :, 0] = (np.arange(sk) * (growth / 64 * np.log(2) * np.sqrt(d)))[:, None]
    return q64, k64


@pytest.mark.parametrize("d", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("growth", [3.0, 12.0])
@pytest.mark.parametrize("extras", [False, True])
def test_lazy_rescale_with_rising_scores(rng, d, growth, extras):
    # The running max moves only when a block's max passes it by more than 8 (log2 units); in
    # between P grows up to 2^8 and O and l keep their scale. Scores rising by `growth` log2
    # units per 64 keys (3: the max stays for a few blocks, then moves; 12: it moves every
    # 64 keys, every block or every other one at 16-64 keys per block) on every third row
    # only, so that a warp's vote mixes rows that move with rows that do not. A rescale
    # skipped or applied to the wrong rows, or a max that never moves (P = 2^120 overflows
    # float16), fails here.
    qk64 = _rising_scores(rng, 70, 320, d, growth)
    kw = dict(softcap=30.0) if extras else {}
    run_case(rng, sq=70, sk=320, d=d, qk64=qk64, **kw)
    run_case(rng, sq=70, sk=320, d=d, qk64=qk64, causal=True, alignment="top_left", **kw)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("slot", [0, 1, 2, 3])
def test_lazy_rescale_of_one_row_slot(rng, d, slot):
    # A warp rescales O only in the 8-row slots (rows g + 8 r + 16 mt of its 16 or 32) where a
    # row's max moved. Here only the rows i with (i mod 32) div 8 = slot rise, so each warp's
    # vote fires with one slot moving: O multiplied in another slot than the one that moved,
    # or not at all, fails here.
    rows = (np.arange(100) % 32) // 8 == slot
    qk64 = _rising_scores(rng, 100, 320, d, 12.0, rows=rows)
    run_case(rng, sq=100, sk=320, d=d, qk64=qk64)


@pytest.mark.parametrize("p", [0.5, 0.998])
def test_lazy_rescale_with_dropout_near_one(rng, p):
    # With the lazy rescale P reaches 2^8; dropout's 1 / (1 - p) (500 at p = 0.998) must not
    # multiply it before P is rounded to float16 for P V (65504 at most): it is applied to O
    # at the end. Multiplied in first, the rows whose scores rise came out Inf / NaN.
    qk64 = _rising_scores(rng, 70, 320, 64, 8.0, every=1, heads=2)
    run_case(rng, sq=70, sk=320, d=64, hq=2, hkv=2, qk64=qk64, dropout_p=p, seed=1)


def test_split_kv_empty_splits_and_dead_rows(rng):
    # A sliding window of 5 keys: most splits of each row see nothing; the bias kills every
    # key of head 0 (all splits empty there) and the bottom-right causal diagonal leaves the
    # first rows without keys.
    b, hq, sq, sk = 1, 2, 40, 30
    bias = np.zeros((1, hq, 1, sk), np.float32)
    bias[:, 0] = -np.inf
    dead = run_case(rng, batch=b, sq=sq, sk=sk, hq=hq, hkv=1, window=(4, 0), bias=bias,
                    num_splits=7, expect_splits=7)
    assert dead[:, 0].all() and dead[0, 1, : sq - sk].all() and not dead[0, 1, sq - sk:].any()


def test_split_kv_dropout_mask_unchanged(rng):
    # The Philox mask is a function of (b, h, i, j): splitting must not move it. Same inputs
    # with 1 and 3 splits, against the reference that applies the same mask.
    for splits in (1, 3):
        run_case(np.random.default_rng(5), batch=1, sq=17, sk=130, hq=2, hkv=1, dropout_p=0.3,
                 seed=77, offset=3, num_splits=splits, expect_splits=splits)


@pytest.mark.parametrize("d", [32, 96, 256])
def test_split_kv_head_dims(rng, d):
    run_case(rng, sq=5, sk=100, d=d, dtype="bfloat16", lib="torch", num_splits=3,
             expect_splits=3)


def test_split_kv_heuristic(rng):
    # One query block, one head: 1 CTA for a 108-SM GPU (the emulator's), so the heuristic
    # splits the keys; one split when forced, or when there is one key block only.
    q = np.zeros((1, 1, 1, 64), np.float16)
    k = np.zeros((1, 130, 1, 64), np.float16)
    out, lse = np.zeros_like(q), np.zeros((1, 1, 1), np.float32)
    assert emu.flash_forward(q, k, k, out, lse, num_splits=0) > 1
    assert emu.flash_forward(q, k, k, out, lse, num_splits=1) == 1
    assert emu.flash_forward(q, k[:, :64], k[:, :64], out, lse, num_splits=0) == 1
    # A full GPU: 88 query blocks at d = 256 (one CTA per SM: >= 80% of 108). Varlen with a
    # long max_seqlen_q sizes the grid while all but one CTA exit at once (cheap to emulate).
    q = np.zeros((1, 1, 256), np.float16)
    k = np.zeros((130, 1, 256), np.float16)
    cu_q, cu_k = np.array([0, 1], np.int32), np.array([0, 130], np.int32)
    out, lse = np.zeros_like(q), np.zeros((1, 1), np.float32)
    assert emu.flash_forward(q, k, k, out, lse, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                             max_seqlen_q=64 * 88, num_splits=0) == 1
    assert emu.flash_forward(q, k, k, out, lse, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                             max_seqlen_q=64, num_splits=0) > 1
    run_case(rng, sq=1, sk=130, num_splits=0)  # the heuristic's choice is still correct


# ----------------------------------------------------------------------------- varlen

def run_varlen(rng, seqlens_q, seqlens_k, *, hq=2, hkv=1, d=64, dtype="float16",
               causal=False, window=(-1, -1), alignment="bottom_right", alibi_slopes=None,
               softcap=0.0, dropout_p=0.0, seed=0, offset=0, num_splits=1, bias=None,
               mask=None):
    """Packed sequences through the kernel vs reference.attention_varlen_forward (and, for
    bias/mask, per-sequence attention_forward with positions inside the sequence)."""
    lib = "torch" if dtype == "bfloat16" else "numpy"
    cu_q = np.concatenate([[0], np.cumsum(seqlens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(seqlens_k)]).astype(np.int32)
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    q64 = rng.standard_normal((tq, hq, d))
    k64 = rng.standard_normal((tk, hkv, d))
    v64 = rng.standard_normal((tk, hkv, d))
    q, k, v = (from_f64(x, dtype, lib) for x in (q64, k64, v64))
    if lib == "numpy":
        out = np.full((tq, hq, d), np.nan, dtype=dtype)
        lse = np.full((hq, tq), np.nan, dtype=np.float32)
    else:
        out = torch.full((tq, hq, d), float("nan"), dtype=q.dtype)
        lse = torch.full((hq, tq), float("nan"), dtype=torch.float32)
    left, right = window
    if causal:
        right = 0  # causal: no key after the diagonal, whatever window[1] said
    emu.flash_forward(q, k, v, out, lse, window_left=left, window_right=right,
                      bottom_right=alignment == "bottom_right", softcap=softcap,
                      alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed, offset=offset,
                      cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, num_splits=num_splits, bias=bias,
                      mask=mask)

    def f64(x):
        return x.double().numpy() if lib == "torch" else np.asarray(x, dtype=np.float64)

    qf, kf, vf = f64(q), f64(k), f64(v)
    ref_out = np.zeros((tq, hq, d))
    ref_lse = np.full((hq, tq), -np.inf)
    naive_out = np.zeros((tq, hq, d))
    naive_lse = np.full((hq, tq), -np.inf)
    tq_, tk_, tv_ = (torch.as_tensor(x) for x in (q, k, v))
    for b in range(len(seqlens_q)):
        sq_, sk_ = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        nq, nk = seqlens_q[b], seqlens_k[b]
        if nq == 0:
            continue
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes[b] if np.ndim(alibi_slopes) == 2 else alibi_slopes
        # Bias / mask: (b, h, i, j) with positions inside the sequence, as the CPU path.
        bb = None if bias is None else np.asarray(bias, np.float64)[
            min(b, bias.shape[0] - 1):][:1, :, :nq, :nk]
        mb = None if mask is None else np.asarray(mask)[min(b, mask.shape[0] - 1):][:1, :, :nq, :nk]
        if bias is not None or mask is not None:
            assert dropout_p == 0  # attention_forward would number this sequence batch 0
            o_b, l_b = reference.attention_forward(
                qf[None, sq_], kf[None, sk_], vf[None, sk_], causal=causal, window=window,
                alignment=alignment, alibi_slopes=slopes, softcap=softcap, bias=bb, mask=mb)
            ref_out[sq_], ref_lse[:, sq_] = o_b[0], l_b[0]
        if nk == 0:
            continue  # no key: out 0, lse -inf (naive softmax of nothing is NaN)
        z = None
        if dropout_p > 0:
            z = dropout_keep_mask(seed, offset, b + 1, hq, nq, nk, dropout_p)[b:] / (1 - dropout_p)
        no, nl = naive_attention_torch(
            tq_[None, sq_], tk_[None, sk_], tv_[None, sk_], causal=causal, window=window,
            alignment=alignment, alibi_slopes=None if slopes is None else np.asarray(slopes),
            softcap=softcap, dropout_z=z,
            bias=None if bb is None else torch.as_tensor(bb),
            mask=None if mb is None else torch.as_tensor(mb))
        naive_out[sq_], naive_lse[:, sq_] = no[0].double().numpy(), nl[0].double().numpy()
    if bias is None and mask is None:
        ref_out, ref_lse = reference.attention_varlen_forward(
            qf, kf, vf, cu_q, cu_k, causal=causal, window=window, alignment=alignment,
            alibi_slopes=alibi_slopes, softcap=softcap, dropout_p=dropout_p, seed=seed,
            offset=offset)
    assert_close("out", f64(out), ref_out, dtype, naive=naive_out)
    assert_close("lse", f64(lse), ref_lse, dtype, naive=naive_lse, result_dtype="float32")
    dead = np.isneginf(ref_lse)  # (hq, tq)
    assert np.all(f64(out).transpose(1, 0, 2)[dead] == 0.0)
    return dead


def test_varlen_plain(rng):
    # Lengths around the 64-row tile, an empty sequence on each side, sq != sk both ways.
    run_varlen(rng, [17, 0, 70, 1, 5], [40, 9, 70, 0, 130])


@pytest.mark.parametrize("alignment", ["bottom_right", "top_left"])
def test_varlen_causal(rng, alignment):
    dead = run_varlen(rng, [30, 70, 3], [10, 65, 0], causal=True, alignment=alignment)
    if alignment == "bottom_right":
        assert dead[:, :20].all()  # sequence 0: its first 20 rows sit above the diagonal


def test_varlen_window_alibi_softcap(rng):
    run_varlen(rng, [33, 0, 17], [20, 5, 66], window=(6, 2), alibi_slopes=rng.uniform(0.1, 0.4, (3, 2)),
               softcap=2.0)


@pytest.mark.parametrize("d", [32, 128, 256])
def test_varlen_head_dims_bf16(rng, d):
    run_varlen(rng, [9, 20], [30, 7], d=d, dtype="bfloat16", causal=True)


def test_varlen_dropout(rng):
    run_varlen(rng, [17, 40], [70, 12], dropout_p=0.25, seed=11, offset=2)


def test_varlen_bias_mask(rng):
    # Indexed by position inside each sequence, broadcast to (batch, hq, max_sq, max_sk).
    bias = rng.standard_normal((2, 1, 20, 33)).astype(np.float32)
    mask = rng.random((1, 2, 1, 33)) < 0.8
    run_varlen(rng, [20, 7], [33, 11], bias=bias, mask=mask)


@pytest.mark.parametrize("splits", [2, 7])
def test_varlen_split_kv(rng, splits):
    run_varlen(rng, [5, 0, 66], [130, 3, 70], causal=True, num_splits=splits)
    run_varlen(rng, [3, 12], [0, 100], window=(10, 3), dropout_p=0.2, seed=5, num_splits=splits)


def test_varlen_rejects_bad_inputs():
    q = np.zeros((10, 2, 64), np.float16)
    out, lse = np.zeros_like(q), np.zeros((2, 10), np.float32)
    good = np.array([0, 4, 10], np.int32)
    with pytest.raises(ValueError, match="both or neither"):
        emu.flash_forward(q, q, q, out, lse, cu_seqlens_q=good)
    with pytest.raises(ValueError, match="non-decreasing"):
        emu.flash_forward(q, q, q, out, lse, cu_seqlens_q=np.array([0, 6, 4, 10], np.int32),
                          cu_seqlens_k=np.array([0, 4, 6, 10], np.int32))
    with pytest.raises(ValueError, match="total rows"):
        emu.flash_forward(q, q, q, out, lse, cu_seqlens_q=np.array([0, 4, 9], np.int32),
                          cu_seqlens_k=good)
    with pytest.raises(ValueError, match="lse"):
        emu.flash_forward(q, q, q, out, np.zeros((2, 9), np.float32), cu_seqlens_q=good,
                          cu_seqlens_k=good)
    with pytest.raises(ValueError, match="max_seqlen"):
        emu.flash_forward(q, q, q, out, lse, cu_seqlens_q=good, cu_seqlens_k=good,
                          max_seqlen_q=3)
    with pytest.raises(ValueError, match="num_splits"):
        emu.flash_forward(q[None], q[None], q[None], out[None], np.zeros((1, 2, 10), np.float32),
                          num_splits=-1)


# ----------------------------------------------------------------------------- generated files

def test_generated_instantiations_up_to_date():
    # csrc/cuda/instantiations/ must be exactly what tools/generate_instantiations.py writes.
    root = Path(__file__).resolve().parents[2]
    tool = root / "tools" / "generate_instantiations.py"
    if not tool.is_file():
        pytest.skip("no source tree (installed package)")
    r = subprocess.run([sys.executable, str(tool), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr

# ============================================================================ the Hopper forward
# csrc/cuda/flash_fwd_sm90.cuh (TMA, wgmma, a producer warp and two consumer warpgroups) and the
# routing between it and the sm_80 kernel (csrc/cuda/flash_fwd.cu). FMHA_CUDA_KERNEL=sm90 makes
# the emulated forward run it for every call it claims; each case asserts which kernel ran
# (emu.forward_kernel): what it claims -- fp16 and bf16, head-dim tiles 64/128/256 (smaller dims
# in the next tile), causal and sliding windows and varlen up to d = 128, GQA, split-KV -- and
# one case per route to the sm_80 kernel: softcap, bias, mask, ALiBi, dropout, a non-positive
# scale, rows TMA cannot address, windows at d = 256, and FMHA_CUDA_KERNEL=sm80.

def run_case_16(rng, **kw):
    """run_case; bfloat16 through torch (NumPy has none)."""
    if kw.get("dtype") == "bfloat16":
        kw["lib"] = "torch"
    return run_case(rng, **kw)


@pytest.fixture
def sm90(monkeypatch):
    """Sets FMHA_CUDA_KERNEL; yields a checker of the kernel the last forward ran."""
    def use(name):
        monkeypatch.setenv("FMHA_CUDA_KERNEL", name)
        emu.forward_kernel()  # clear

    def ran(expected):
        assert emu.forward_kernel() == expected

    use("sm90")
    return type("K", (), {"use": staticmethod(use), "ran": staticmethod(ran)})


# ---------------------------------------------------------------- what the kernel claims

@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("sq,sk", [(1, 1), (17, 80), (130, 70), (64, 200)])
def test_sm90_plain(rng, sm90, dtype, d, sq, sk):
    run_case_16(rng, sq=sq, sk=sk, d=d, dtype=dtype)
    sm90.ran("sm90")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_sm90_head_dim_256(rng, sm90, dtype):
    # 80-key blocks: 170 keys are two whole blocks and a tail.
    run_case_16(rng, sq=70, sk=170, d=256, dtype=dtype)
    sm90.ran("sm90")


@pytest.mark.parametrize("d", [8, 40, 96, 200])
def test_sm90_head_dims_in_larger_tiles(rng, sm90, d):
    # Columns past the head dim are the TMA's zero fill; rows 16-byte aligned (d % 8 == 0).
    run_case_16(rng, sq=17, sk=33, d=d)
    sm90.ran("sm90")


@pytest.mark.parametrize("alignment", ["bottom_right", "top_left"])
@pytest.mark.parametrize("sq,sk", [(130, 130), (17, 200), (200, 17)])
def test_sm90_causal(rng, sm90, sq, sk, alignment):
    run_case_16(rng, sq=sq, sk=sk, causal=True, alignment=alignment, dtype="bfloat16")
    sm90.ran("sm90")


@pytest.mark.parametrize("window,sq,sk", [((8, 0), 140, 140), ((5, 3), 17, 300), ((130, 0), 200, 260)])
def test_sm90_window(rng, sm90, window, sq, sk):
    run_case_16(rng, sq=sq, sk=sk, window=window, d=128)
    sm90.ran("sm90")


@pytest.mark.parametrize("hq,hkv", [(4, 1), (4, 2)])
def test_sm90_gqa_batch(rng, sm90, hq, hkv):
    run_case_16(rng, batch=2, sq=20, sk=150, hq=hq, hkv=hkv, causal=True)
    sm90.ran("sm90")


@pytest.mark.parametrize("splits", [2, 3])
def test_sm90_split_kv(rng, sm90, splits):
    run_case_16(rng, sq=17, sk=300, d=128, num_splits=splits, expect_splits=splits, causal=True)
    sm90.ran("sm90")


def test_sm90_lazy_rescale_with_rising_scores(rng, sm90):
    # Scores that grow along the keys: the row max moves in every block.
    d, sk = 64, 400
    q = np.ones((1, 9, 1, d))
    k = np.linspace(0.0, 12.0, sk)[None, :, None, None] * np.ones((1, sk, 1, d)) / np.sqrt(d)
    run_case_16(rng, sq=9, sk=sk, d=d, qk64=(q, k))
    sm90.ran("sm90")


def test_sm90_varlen(rng, sm90):
    # An empty sequence on each side, sq != sk both ways, a tail past a 128-key block whose
    # TMA box reads the next sequence's rows.
    run_varlen(rng, [17, 0, 70, 1, 5], [40, 9, 140, 0, 130])
    sm90.ran("sm90")


@pytest.mark.parametrize("alignment", ["bottom_right", "top_left"])
def test_sm90_varlen_causal_bf16(rng, sm90, alignment):
    run_varlen(rng, [30, 140, 3], [10, 150, 0], causal=True, alignment=alignment,
               dtype="bfloat16", d=128)
    sm90.ran("sm90")


# ------------------------------------------------------------ routes to the sm_80 kernel

@pytest.mark.parametrize("extra", [
    dict(softcap=2.0),
    dict(bias="full"),
    dict(mask="full"),
    dict(alibi_slopes=True),
    dict(dropout_p=0.25, seed=3),
    dict(scale=-0.5),
])
def test_sm90_routes_extras_to_sm80(rng, sm90, extra):
    extra = dict(extra)
    if extra.get("bias") == "full":
        extra["bias"] = rng.standard_normal((1, 1, 17, 33)).astype(np.float32)
    if extra.get("mask") == "full":
        extra["mask"] = rng.random((1, 1, 17, 33)) > 0.3
    if extra.get("alibi_slopes") is True:
        extra["alibi_slopes"] = np.array([0.25])
    run_case_16(rng, sq=17, sk=33, **extra)
    sm90.ran("sm80")


def test_sm90_routes_windows_at_head_dim_256_to_sm80(rng, sm90):
    # The strong zero's watch is built up to d = 128 (FlashFwdSm90ConfigBase::kEdges).
    run_case_16(rng, sq=70, sk=170, d=256, causal=True)
    sm90.ran("sm80")


def test_sm90_routes_unaligned_rows_to_sm80(rng, sm90):
    # d = 59: 118-byte rows, which a tensor map cannot stride.
    run_case_16(rng, sq=17, sk=33, d=59)
    sm90.ran("sm80")


def test_sm90_forced_sm80(rng, sm90):
    sm90.use("sm80")
    run_case_16(rng, sq=17, sk=33)
    sm90.ran("sm80")


def test_sm90_default_is_sm80_under_the_emulator(rng, sm90, monkeypatch):
    monkeypatch.delenv("FMHA_CUDA_KERNEL")
    run_case_16(rng, sq=17, sk=33)
    sm90.ran("sm80")


def test_sm90_rejects_unknown_kernel_name(rng, sm90):
    sm90.use("sm100")
    with pytest.raises(ValueError, match="FMHA_CUDA_KERNEL"):
        run_case_16(rng, sq=1, sk=1)
