"""The CUDA FlashAttention-2 backward kernels (csrc/cuda/flash_bwd.cuh) under the SIMT emulator.

fmha._cuda_emu.flash_forward then flash_backward run the real kernel sources (mma.sync,
ldmatrix, cp.async, float32 atomics, emulated) on the CPU; dq, dk, dv (and dbias) are compared
with fmha.reference (float64) by the 3x rule of docs/testing.md (3x the error of the same backward
done naively in the input precision, by torch autograd). Deterministic mode must give bitwise
identical gradients run to run.

Shapes stay tiny (the emulator runs every CUDA thread of a block in turn): seqlens 1-80, batch and
heads 1-2; they cross the 64-key and 16/32/64-query blocks of every head-dim tile.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import assert_close, naive_results, reference_results
from fmha._philox import dropout_keep_mask

emu = pytest.importorskip("fmha._cuda_emu")
if not hasattr(emu, "flash_backward"):
    pytest.skip("fmha._cuda_emu was built without flash_backward", allow_module_level=True)

torch = pytest.importorskip("torch")


def emu_grads(q, k, v, dout, *, bias=None, bias_grad=False, deterministic=False, **kw):
    """Forward and backward by the emulated CUDA kernels; a dict like naive_results, plus
    the most device scratch the backward held at once (scratch_peak_bytes)."""
    b, sq, hq, d = q.shape
    out = torch.full_like(q, float("nan"))
    lse = torch.full((b, hq, sq), float("nan"), dtype=torch.float32)
    emu.flash_forward(q, k, v, out, lse, bias=bias, **kw)
    dq = torch.full_like(q, float("nan"))
    dk = torch.full_like(k, float("nan"))
    dv = torch.full_like(v, float("nan"))
    dbias = None
    if bias_grad:
        dbias = torch.full(bias.shape, float("nan"), dtype=torch.float32)
    emu.reset_stats()
    emu.flash_backward(dout, q, k, v, out, lse, dq, dk, dv, dbias=dbias,
                       deterministic=deterministic, bias=bias, **kw)
    stats = emu.stats()
    res = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv,
               scratch_peak_bytes=stats["scratch_peak_bytes"], cp_async=stats["cp_async"],
               cp_async_zero_filled=stats["cp_async_zero_filled"])
    if bias_grad:
        res["dbias"] = dbias
    return res


def window_args(causal, window, alignment):
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    return dict(window_left=left, window_right=right, bottom_right=alignment == "bottom_right")


def run_case(*, batch=1, sq, sk, hq=1, hkv=1, d=64, dtype=torch.float16, causal=False,
             window=(-1, -1), alignment="bottom_right", scale=None, softcap=0.0, bias=None,
             bias_grad=False, mask=None, alibi_slopes=None, dropout_p=0.0, seed=0,
             deterministic=False, seed_data=0, runs=1, unaligned=False):
    """The emulated gradients against the reference; runs > 1 repeats the backward, which
    must then give the same bits (deterministic=True). unaligned: q, k, v and dout are views
    whose rows start 2 bytes past a 16-byte boundary."""
    gen = torch.Generator().manual_seed(seed_data)
    pad = 1 if unaligned else 0

    def tensor(rows, heads):
        return torch.randn(batch, rows, heads, d + pad, generator=gen).to(dtype)[..., pad:]

    q, k, v, dout = tensor(sq, hq), tensor(sk, hkv), tensor(sk, hkv), tensor(sq, hq)
    emu_kw = dict(bias=bias, bias_grad=bias_grad, scale=scale, softcap=softcap, mask=mask,
                  alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed,
                  deterministic=deterministic, **window_args(causal, window, alignment))
    got = emu_grads(q, k, v, dout, **emu_kw)
    for _ in range(runs - 1):  # the backward again, from the same out and lse
        again = [torch.empty_like(got[key]) for key in ("dq", "dk", "dv")]
        dbias = torch.empty_like(got["dbias"]) if bias_grad else None
        kw = {n: x for n, x in emu_kw.items() if n != "bias_grad"}
        emu.flash_backward(dout, q, k, v, got["out"], got["lse"], *again, dbias=dbias, **kw)
        for key, x in zip(("dq", "dk", "dv", "dbias"), again + [dbias]):
            assert x is None or torch.equal(x, got[key]), f"{key}: differs between runs"
    sem = dict(scale=scale, causal=causal, window=window, alignment=alignment, softcap=softcap)
    ref = reference_results(q, k, v, dout, bias=bias, bias_grad=bias_grad, mask=mask,
                            alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed, **sem)
    z = None
    if dropout_p > 0:
        z = dropout_keep_mask(seed, 0, batch, hq, sq, sk, dropout_p) / (1.0 - dropout_p)
    naive = naive_results(q, k, v, dout, bias=None if bias is None else bias.to(dtype),
                          bias_grad=bias_grad,
                          mask=None if mask is None else torch.as_tensor(mask),
                          alibi_slopes=alibi_slopes, dropout_z=z, **sem)
    name = "float16" if dtype == torch.float16 else "bfloat16"
    for key in ("dq", "dk", "dv") + (("dbias",) if bias_grad else ()):
        assert not torch.isnan(got[key]).any(), f"{key}: NaN (unwritten or 0 * inf)"
        assert_close(key, got[key].double().numpy(), ref[key], name,
                     naive=naive[key].double().numpy(), grad=True,
                     result_dtype="float32" if key == "dbias" else None)
    return got


@pytest.mark.parametrize("d", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("sq,sk", [(1, 1), (17, 70), (70, 17), (80, 80)])
def test_plain(d, sq, sk):
    run_case(sq=sq, sk=sk, d=d)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("alignment", ["bottom_right", "top_left"])
@pytest.mark.parametrize("sq,sk", [(70, 70), (17, 80), (80, 17)])
def test_causal(d, sq, sk, alignment):
    run_case(sq=sq, sk=sk, d=d, causal=True, alignment=alignment)


@pytest.mark.parametrize("window,sq,sk", [((8, 0), 70, 70), ((5, 3), 17, 80), ((3, 2), 80, 17)])
def test_window(window, sq, sk):
    run_case(sq=sq, sk=sk, window=window)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("window,causal", [((-1, -1), False), ((-1, -1), True), ((100, 0), False)])
def test_inner_and_edge_steps(d, window, causal):
    # Tiles inside both sequences and every row's window skip the per-pair test
    # (bwd_detail::inner_step) beside edge and partial tiles; both backward kernels.
    run_case(sq=200, sk=330, d=d, window=window, causal=causal)
    run_case(sq=200, sk=330, d=d, window=window, causal=causal, deterministic=True)


@pytest.mark.parametrize("hq,hkv", [(2, 1), (4, 2)])
def test_gqa_batch(hq, hkv):
    run_case(batch=2, sq=17, sk=70, hq=hq, hkv=hkv, causal=True)


@pytest.mark.parametrize("deterministic", [False, True])
def test_gqa_several_query_blocks(deterministic):
    # Each CTA sweeps several query blocks of each query head of its group: the copies move
    # from block to block and from one head's last block to the next head's first, whole
    # blocks and the sequence's partial last one (d = 128: the plain kernel's tiled pass).
    run_case(batch=2, sq=150, sk=140, hq=4, hkv=2, d=128, deterministic=deterministic)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("unaligned", [False, True])
def test_copies_of_a_partial_block(d, unaligned):
    # The tiled pass's Qi and dOi copies (each by its warp half) of a partial last query
    # block: by cp.async, the rows past the sequence zero-filled; with rows not 16-byte
    # aligned, element by element (no cp.async at all). sk = 128 is one whole key block, so
    # every zero-filled chunk is one of Qi's or dOi's.
    sq, hq = 150, 2
    got = run_case(sq=sq, sk=128, hq=hq, d=d, unaligned=unaligned)
    if unaligned:
        assert got["cp_async"] == 0
    else:
        block_m = 128 if d == 64 else 64  # queries a step (FlashBwdConfig::kBlockM)
        rows_past = -sq % block_m
        assert got["cp_async_zero_filled"] == rows_past * (2 * d // 16) * 2 * hq


@pytest.mark.parametrize("sq", [50, 150])
def test_checked_copies_of_the_128_tile(sq):
    # d = 112 with aligned rows runs the 128 tile's tiled pass with its checked row copies
    # (the columns past d zero-filled); at sq = 50 the one partial block's rows past the
    # sequence are read by no earlier step, so a row not zero-filled would be NaN.
    run_case(sq=sq, sk=140, hq=2, d=112)
    run_case(sq=sq, sk=140, hq=2, d=112, deterministic=True)


@pytest.mark.parametrize("d", [8, 40, 59, 111, 200])
def test_odd_head_dims(d):
    run_case(sq=17, sk=70, d=d, causal=True, alignment="top_left")


@pytest.mark.parametrize("d", [64, 128])
def test_bfloat16(d):
    run_case(sq=70, sk=17, d=d, dtype=torch.bfloat16, causal=True, alignment="top_left")


@pytest.mark.parametrize("d", [64, 128, 256])
def test_softcap_alibi(d):
    slopes = np.array([[0.25, 0.5]])
    run_case(sq=33, sk=70, hq=2, d=d, softcap=5.0, alibi_slopes=slopes, causal=True)


@pytest.mark.parametrize("shape", [(2, 2, 33, 70), (1, 2, 33, 70), (2, 1, 1, 70), (1, 1, 33, 70)])
@pytest.mark.parametrize("d", [64, 96])
def test_bias_and_dbias(shape, d):
    # dbias has the bias's own (broadcast) shape: summed over its size-1 dimensions.
    # (Shapes broadcast over the keys: test_dbias_broadcast_over_keys.)
    gen = torch.Generator().manual_seed(1)
    bias = torch.randn(*shape, generator=gen, dtype=torch.float32)
    got = run_case(batch=2, sq=33, sk=70, hq=2, d=d, bias=bias, bias_grad=True)
    assert got["dbias"].shape == bias.shape


# The broadcast shapes test_bias_and_dbias leaves out, so that together they cover every
# (b or 1, h or 1, sq or 1, sk): in deterministic mode, run twice for the same bits, with the
# whole score pipeline the dbias kernel recomputes (causal, softcap: dbias is dS before its
# factor, dropout, GQA). (A single-row bias summing several query blocks:
# test_dbias_scratch_is_o_of_bias.)
@pytest.mark.parametrize("shape,d", [((2, 2, 1, 70), 32), ((1, 2, 1, 70), 32),
                                     ((2, 1, 33, 70), 32), ((1, 1, 1, 70), 32)])
def test_dbias_broadcast_shapes_deterministic(shape, d):
    gen = torch.Generator().manual_seed(4)
    bias = torch.randn(*shape, generator=gen, dtype=torch.float32)
    got = run_case(batch=2, sq=33, sk=70, hq=2, hkv=1, d=d, bias=bias, bias_grad=True,
                   causal=True, softcap=5.0, dropout_p=0.2, seed=7, deterministic=True, runs=2)
    assert got["dbias"].shape == bias.shape


@pytest.mark.parametrize("deterministic", [False, True])
def test_dbias_scratch_is_o_of_bias(deterministic):
    # A key-padding bias (1, 1, 1, sk) reduces b * h * sq * sk scores; the backward's device
    # scratch must not grow with that product: D and lse in the log2 domain (and, with
    # atomics, the float32 dQ accumulator) are all it may hold, O(b * h * sq * d), whatever the
    # bias's shape.
    b, h, sq, sk, d = 2, 2, 80, 64, 32  # two query blocks sum into the one row
    gen = torch.Generator().manual_seed(5)
    bias = torch.randn(1, 1, 1, sk, generator=gen, dtype=torch.float32)
    got = run_case(batch=b, sq=sq, sk=sk, hq=h, d=d, bias=bias, bias_grad=True,
                   deterministic=deterministic)
    rows = b * h * sq
    assert got["scratch_peak_bytes"] == 4 * rows * (2 if deterministic else 2 + d), (
        f"{got['scratch_peak_bytes']} bytes of scratch; dS in full would be {4 * rows * sk}")


@pytest.mark.parametrize("shape", [(1, 1, 33, 1), (1, 2, 1, 1)])
@pytest.mark.parametrize("d", [64, 96])
def test_dbias_broadcast_over_keys(shape, d):
    # A bias constant along the keys has dbias = sum_j dS_ij = D_i - D_i = 0 exactly: the
    # kernels write those zeros (fmha/params.h), over the NaN that emu_grads starts from,
    # and q, k, v still get the bias's effect (the reference check in run_case).
    gen = torch.Generator().manual_seed(1)
    bias = torch.randn(*shape, generator=gen, dtype=torch.float32)
    got = run_case(batch=2, sq=33, sk=70, hq=2, d=d, bias=bias, bias_grad=True)
    assert torch.all(got["dbias"] == 0)


def test_mask_with_dead_rows():
    gen = torch.Generator().manual_seed(2)
    mask = torch.rand(1, 1, 40, 70, generator=gen) > 0.5
    mask[:, :, 3] = False  # a row that sees no key: gradients 0, no NaN
    got = run_case(sq=40, sk=70, mask=mask)
    assert torch.all(got["dq"][0, 3] == 0)


@pytest.mark.parametrize("d", [64, 128])
def test_dropout(d):
    run_case(batch=2, sq=33, sk=70, hq=2, d=d, dropout_p=0.3, seed=1234, causal=True)


# d = 256 with one sequence: its tiles are the slowest to emulate, and the batch index of the
# deterministic dQ accumulation is covered at 64 and 128.
@pytest.mark.parametrize("d,batch", [(64, 2), (128, 2), (256, 1)])
def test_deterministic_matches_reference(d, batch):
    run_case(batch=batch, sq=70, sk=80, hq=2, hkv=1, d=d, deterministic=True, causal=True)


def test_deterministic_bitwise_stable_over_8_runs():
    # One forward, then the deterministic backward 8 times over the same inputs: every
    # gradient bit for bit the same (dropout on, GQA: dk, dv summed over two query heads).
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 40, 2, 32, generator=gen).half()
    k = torch.randn(1, 70, 1, 32, generator=gen).half()
    v = torch.randn(1, 70, 1, 32, generator=gen).half()
    dout = torch.randn(1, 40, 2, 32, generator=gen).half()
    kw = dict(dropout_p=0.1, seed=7)
    out = torch.empty_like(q)
    lse = torch.empty(1, 2, 40, dtype=torch.float32)
    emu.flash_forward(q, k, v, out, lse, **kw)
    runs = []
    for _ in range(8):
        dq, dk, dv = torch.full_like(q, float("nan")), torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
        emu.flash_backward(dout, q, k, v, out, lse, dq, dk, dv, deterministic=True, **kw)
        runs.append((dq, dk, dv))
    assert not any(torch.isnan(x).any() for x in runs[0])
    for r in runs[1:]:
        for name, a, b in zip(("dq", "dk", "dv"), r, runs[0]):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), name
