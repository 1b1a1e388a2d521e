"""Correctness of fmha's CPU kernels against the float64 NumPy reference (fmha.reference).

Every case checks the forward (out, lse) and the backward (dq, dk, dv[, dbias]) with the
tolerance rule of docs/testing.md (see conftest.py: float64 1e-10, float32 2e-5 relative to
max|ref|; float16/bfloat16 within 2x (3x for gradients) of a naive low-precision torch
computation's error). NumPy arrays go through fmha.attention + fmha.attention_backward,
torch tensors through autograd.

The cases the CUDA kernels share (tests/kernels/test_cuda_emu_cases.py) live in tests/cases.py;
this file runs them on the CPU kernels, in every dtype and at bigger shapes.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import fmha
from fmha import reference
from fmha._philox import dropout_keep_mask

from conftest import (LOW_PRECISION, assert_close, check_against_reference, fmha_results,
                      from_f64, make_array, make_inputs, naive_results, reference_results,
                      to_f64)
from cases import (ALL_LIB_DTYPES, BIAS_SHAPES, CAUSAL_LENGTHS, COMBOS, CROSS,
                   DROPOUT_SEED_IDS, DROPOUT_SEEDS, DV, MAIN_LIB_DTYPES, MASKED_TILES,
                   MASK_SHAPES, NONCONTIG, VARLEN_CASES,
                   VARLEN_FEATURES, WINDOWS, WIN_LENGTHS, bool_array, check_alibi,
                   check_bias_shapes, check_bias_without_grad, check_causal,
                   check_causal_bottom_right_sq_gt_sk_empty_rows, check_combination_numpy,
                   check_combination_torch, check_cross_lengths, check_cross_odd_noncontiguous,
                   check_dropout_numpy_matches_reference, check_dropout_numpy_seed,
                   check_everything_masked, check_explicit_scale, check_fully_masked_tiles,
                   check_mask_shapes, check_mask_with_fully_masked_rows, check_neg_inf_bias_rows,
                   check_noncontiguous_numpy, check_noncontiguous_torch, check_softcap,
                   check_torch_and_numpy_paths_identical, check_torch_dropout,
                   check_varlen_torch_autograd, check_window, check_window_with_causal,
                   extra_array, inputs, lib_dtype_ids, naive_varlen, need_torch,
                   score_pattern_inputs, varlen_inputs, varlen_kw)


#: The cpu backend (conftest's fixture: fmha._C behind the API, what a plain call gets anyway).
pytestmark = pytest.mark.usefixtures("backend")


# ============================================================================ dtypes

@pytest.mark.parametrize("lib,dtype", ALL_LIB_DTYPES, ids=lib_dtype_ids(ALL_LIB_DTYPES))
def test_dtypes(rng, lib, dtype):
    q, k, v, do = inputs(rng, lib, dtype, 2, 37, 45, 4, 2, 64)
    check_against_reference(q, k, v, do)


@pytest.mark.parametrize("scale", [0.37, -0.8, 2.0])
@pytest.mark.parametrize("lib,dtype", MAIN_LIB_DTYPES, ids=lib_dtype_ids(MAIN_LIB_DTYPES))
def test_explicit_scale(rng, lib, dtype, scale):
    check_explicit_scale(rng, lib, dtype, scale)


# ============================================================================ online softmax


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("pattern", ["increasing", "decreasing", "large"])
@pytest.mark.parametrize("lib,dtype", MAIN_LIB_DTYPES, ids=lib_dtype_ids(MAIN_LIB_DTYPES))
def test_online_softmax_rescaling(rng, lib, dtype, pattern, causal):
    q, k, v, do = score_pattern_inputs(rng, lib, dtype, pattern)
    check_against_reference(q, k, v, do, causal=causal)


@pytest.mark.parametrize("case", list(MASKED_TILES))
@pytest.mark.parametrize("lib,dtype", MAIN_LIB_DTYPES, ids=lib_dtype_ids(MAIN_LIB_DTYPES))
def test_fully_masked_tiles(rng, lib, dtype, case):
    check_fully_masked_tiles(rng, lib, dtype, case, b=2, sq=70, sk=300, h=2, leading=(230, 129),
                             prefix=200, band=(1, slice(5, 40), 299))


# ============================================================================ causal


@pytest.mark.parametrize("alignment", ["bottom_right", "top_left"])
@pytest.mark.parametrize("sq,sk", CAUSAL_LENGTHS, ids=[f"sq{a}-sk{b}" for a, b in CAUSAL_LENGTHS])
@pytest.mark.parametrize("lib,dtype", MAIN_LIB_DTYPES, ids=lib_dtype_ids(MAIN_LIB_DTYPES))
def test_causal(rng, lib, dtype, sq, sk, alignment):
    check_causal(rng, lib, dtype, sq, sk, alignment)


# ============================================================================ GQA / MQA

@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 2), (8, 1), (6, 3)],
                         ids=["MHA-8-8", "GQA-8-2", "MQA-8-1", "GQA-6-3"])
@pytest.mark.parametrize("lib,dtype", MAIN_LIB_DTYPES, ids=lib_dtype_ids(MAIN_LIB_DTYPES))
def test_gqa_mqa(rng, lib, dtype, hq, hkv):
    q, k, v, do = inputs(rng, lib, dtype, 2, 29, 31, hq, hkv, 32)
    check_against_reference(q, k, v, do)
    if hkv != hq:
        check_against_reference(q, k, v, do, causal=True)


# ============================================================================ cross lengths


@pytest.mark.parametrize("sq,sk", CROSS, ids=[f"sq{a}-sk{b}" for a, b in CROSS])
@pytest.mark.parametrize("lib,dtype", MAIN_LIB_DTYPES, ids=lib_dtype_ids(MAIN_LIB_DTYPES))
def test_cross_lengths(rng, lib, dtype, sq, sk):
    check_cross_lengths(rng, lib, dtype, sq, sk)


@pytest.mark.parametrize("lib,dtype", MAIN_LIB_DTYPES, ids=lib_dtype_ids(MAIN_LIB_DTYPES))
def test_causal_bottom_right_sq_gt_sk_empty_rows(rng, lib, dtype):
    """sq > sk, causal bottom-right: the first sq - sk rows see no key -> out 0, lse -inf,
    gradients 0, no NaN (reference check covers the -inf pattern and the values)."""
    check_causal_bottom_right_sq_gt_sk_empty_rows(rng, lib, dtype)


# ============================================================================ odd sizes

@pytest.mark.parametrize("seqlen", [1, 17, 113, 1000])
@pytest.mark.parametrize("lib,dtype", MAIN_LIB_DTYPES, ids=lib_dtype_ids(MAIN_LIB_DTYPES))
def test_odd_seqlen(rng, lib, dtype, seqlen):
    b, h = (1, 2) if seqlen == 1000 else (2, 2)
    q, k, v, do = inputs(rng, lib, dtype, b, seqlen, seqlen, h, 1, 32)
    check_against_reference(q, k, v, do)
    if seqlen > 1:
        check_against_reference(q, k, v, do, causal=True)


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1000, 17), (17, 1000)], ids=["1000x17", "17x1000"])
@pytest.mark.parametrize("lib,dtype", [("numpy", "float64"), ("torch", "float32"),
                                       ("torch", "bfloat16")],
                         ids=["numpy-float64", "torch-float32", "torch-bfloat16"])
def test_odd_seqlen_cross_causal(rng, lib, dtype, seqlen_q, seqlen_k):
    q, k, v, do = inputs(rng, lib, dtype, 1, seqlen_q, seqlen_k, 2, 1, 40)
    check_against_reference(q, k, v, do, causal=True)


@pytest.mark.parametrize("head_dim", [8, 40, 59, 111, 128, 256])
@pytest.mark.parametrize("lib,dtype", MAIN_LIB_DTYPES, ids=lib_dtype_ids(MAIN_LIB_DTYPES))
def test_odd_head_dim(rng, lib, dtype, head_dim):
    q, k, v, do = inputs(rng, lib, dtype, 2, 33, 47, 2, 1, head_dim)
    check_against_reference(q, k, v, do, causal=True)


LARGE = [("torch", "float32", 1000, 1000, 128, True), ("torch", "bfloat16", 113, 1000, 256, False),
         ("numpy", "float64", 1000, 113, 111, True)]


@pytest.mark.parametrize("lib,dtype,sq,sk,d,causal", LARGE,
                         ids=[f"{l}-{t}-sq{a}-sk{b}-d{d}-{'causal' if c else 'full'}"
                              for l, t, a, b, d, c in LARGE])
def test_larger_odd_sizes(rng, lib, dtype, sq, sk, d, causal):
    q, k, v, do = inputs(rng, lib, dtype, 1, sq, sk, 2, 1, d)
    check_against_reference(q, k, v, do, causal=causal)


@pytest.mark.parametrize("d,dv", DV, ids=[f"d{a}-dv{b}" for a, b in DV])
@pytest.mark.parametrize("lib,dtype", MAIN_LIB_DTYPES, ids=lib_dtype_ids(MAIN_LIB_DTYPES))
def test_head_dim_v(rng, lib, dtype, d, dv):
    q, k, v, do = inputs(rng, lib, dtype, 2, 21, 30, 4, 2, d, dv)
    check_against_reference(q, k, v, do)


# ============================================================================ non-contiguous


@pytest.mark.parametrize("kind", NONCONTIG)
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
def test_noncontiguous_torch(rng, dtype, kind):
    check_noncontiguous_torch(rng, dtype, kind, b=2, sq=19, sk=26, hq=4, hkv=2, d=24, dv=40)


@pytest.mark.parametrize("kind", NONCONTIG + ["reversed"])
def test_noncontiguous_numpy(rng, kind):
    check_noncontiguous_numpy(rng, "float64", kind, b=2, sq=19, sk=26, hq=4, hkv=1, d=24,
                              dv=40)


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_noncontiguous_bias_and_mask(rng, lib):
    """A transposed bias view and a sliced mask view give the reference result."""
    need_torch(lib, "float32")
    b, sq, sk, h = 2, 23, 31, 2
    q, k, v, do = inputs(rng, lib, "float64", b, sq, sk, h, h, 16)
    bias64 = rng.standard_normal((b, h, sk, sq)).transpose(0, 1, 3, 2)  # (b,h,sq,sk) view
    mask_big = rng.random((b, h, sq, 2 * sk)) < 0.8
    mask_big[..., ::2][..., 0] = True
    if lib == "torch":
        import torch
        bias = torch.from_numpy(np.ascontiguousarray(bias64.transpose(0, 1, 3, 2))).transpose(2, 3)
        mask = torch.from_numpy(mask_big)[..., ::2]
        assert not bias.is_contiguous() and not mask.is_contiguous()
    else:
        bias, mask = bias64, mask_big[..., ::2]
    check_against_reference(q, k, v, do, bias=bias, bias_grad=True, mask=mask)


def test_expanded_bias_view_grad(rng):
    """A stride-0 bias (a (1, h, 1, sk) leaf expanded to (b, h, sq, sk)): the leaf's grad is
    the reference dbias for the small shape (autograd sums the expanded dims)."""
    torch = pytest.importorskip("torch")
    b, sq, sk, h = 2, 13, 18, 4
    q, k, v, do = inputs(rng, "torch", "float64", b, sq, sk, h, 2, 16)
    small = torch.from_numpy(rng.standard_normal((1, h, 1, sk))).requires_grad_(True)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = fmha.attention(*leaves, bias=small.expand(b, h, sq, sk), causal=True)
    out.backward(do)
    ref = reference_results(q, k, v, do, bias=small, bias_grad=True, causal=True)
    assert_close("out", out, ref["out"], "float64")
    assert_close("dbias", small.grad, ref["dbias"], "float64")
    for name, x in zip(("dq", "dk", "dv"), leaves):
        assert_close(name, x.grad, ref[name], "float64")


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_self_attention_same_tensor(rng, dtype):
    """q, k and v the very same tensor: its grad is dq + dk + dv of the reference."""
    pytest.importorskip("torch")
    x = make_array(rng, (2, 17, 2, 16), dtype, "torch").requires_grad_(True)
    do = make_array(rng, (2, 17, 2, 16), dtype, "torch")
    out = fmha.attention(x, x, x, causal=True)
    out.backward(do)
    ref = reference_results(x, x, x, do, causal=True)
    assert_close("out", out, ref["out"], dtype)
    assert_close("dx", x.grad, ref["dq"] + ref["dk"] + ref["dv"], dtype)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(1, 300, 1, 64), (2, 300, 4, 64)])
def test_bfloat16_sees_v_changed_in_place_between_calls(rng, shape, causal):
    """The bfloat16 forward keeps V's pair tiles per thread across one call's query tiles
    (cpu/forward.h, PackedVTiles). A second call over the same V memory, changed in place
    (as a KV cache is), must read the new values: with V times -2 (exact in bfloat16), the
    output is exactly -2 times the first, where stale tiles would repeat the first. With one
    (batch, kv head), every thread's first task of the second call is the head its last task
    of the first call was: stale tiles would be hit whatever the thread count."""
    torch = pytest.importorskip("torch")
    q, k, v = (make_array(rng, shape, "bfloat16", "torch") for _ in range(3))
    first = fmha.attention(q, k, v, causal=causal)
    v.mul_(-2)
    second = fmha.attention(q, k, v, causal=causal)
    assert torch.equal(second, -2 * first)
    assert torch.equal(second, fmha.attention(q, k, v.clone(), causal=causal))


# ============================================================================ bias


@pytest.mark.parametrize("shape_name", list(BIAS_SHAPES))
@pytest.mark.parametrize("lib,dtype", MAIN_LIB_DTYPES + [("numpy", "float32")],
                         ids=lib_dtype_ids(MAIN_LIB_DTYPES + [("numpy", "float32")]))
def test_bias_shapes(rng, lib, dtype, shape_name):
    check_bias_shapes(rng, lib, dtype, shape_name, hq=4, hkv=2)


@pytest.mark.parametrize("shape_name", ["h_1_1", "b_h_sq_1"])
@pytest.mark.parametrize("lib,dtype", MAIN_LIB_DTYPES, ids=lib_dtype_ids(MAIN_LIB_DTYPES))
def test_dbias_constant_along_keys_is_zero(rng, lib, dtype, shape_name):
    """A bias constant along the keys shifts a row's scores, which softmax ignores: dbias is
    written as exact zeros (fmha/params.h, dbias_is_zero), and q, k, v gradients still match."""
    b, sq, sk, hq, hkv = 2, 21, 27, 4, 2
    q, k, v, do = inputs(rng, lib, dtype, b, sq, sk, hq, hkv, 32)
    bias = extra_array(rng, BIAS_SHAPES[shape_name](b, hq, sq, sk), lib, dtype, scale=2.0)
    res, _ = check_against_reference(q, k, v, do, bias=bias, bias_grad=True, causal=True)
    assert (np.asarray(to_f64(res["dbias"])) == 0).all()


def test_dbias_constant_along_keys_is_zero_in_the_reference(rng):
    """The identity behind dbias_is_zero holds with every feature on: the float64 reference's
    dbias for a (b, h, sq, 1) bias is zero to rounding under a mask, causal, softcap, ALiBi
    and dropout, and fmha's is exactly zero."""
    b, sq, sk, hq, hkv = 2, 19, 30, 4, 2
    q, k, v, do = inputs(rng, "numpy", "float64", b, sq, sk, hq, hkv, 16)
    bias = extra_array(rng, (b, hq, sq, 1), "numpy", "float64", scale=2.0)
    mask = rng.uniform(size=(b, 1, sq, sk)) > 0.3
    kw = dict(bias=bias, mask=mask, causal=True, softcap=5.0, dropout_p=0.2,
              alibi_slopes=np.array([2.0 ** -(i + 1) for i in range(hq)]))
    ref_dbias = reference.attention_backward(do, q, k, v, seed=3, **kw)[3]
    assert np.abs(ref_dbias).max() < 1e-12
    out, lse = fmha.attention(q, k, v, return_lse=True, seed=3, **kw)
    grads = fmha.attention_backward(do, q, k, v, out, lse, bias_grad=True, seed=3, **kw)
    assert (grads[3] == 0).all()


@pytest.mark.parametrize("lib,dtype", MAIN_LIB_DTYPES, ids=lib_dtype_ids(MAIN_LIB_DTYPES))
def test_bias_without_grad(rng, lib, dtype):
    """A bias that does not require grad still shifts the scores (and q/k/v grads)."""
    check_bias_without_grad(rng, lib, dtype)


@pytest.mark.parametrize("bias_dtype", ["float32", "float64"])
def test_bias_dtype_differs_from_q(rng, bias_dtype):
    torch = pytest.importorskip("torch")
    q, k, v, do = inputs(rng, "torch", "float32", 2, 17, 19, 2, 2, 32)
    bias = extra_array(rng, (1, 2, 17, 19), "torch", bias_dtype)
    res, _ = check_against_reference(q, k, v, do, bias=bias, bias_grad=True)
    assert res["dbias"].dtype == getattr(torch, bias_dtype)


# ============================================================================ bool mask


@pytest.mark.parametrize("shape_name", list(MASK_SHAPES))
@pytest.mark.parametrize("lib,dtype", MAIN_LIB_DTYPES, ids=lib_dtype_ids(MAIN_LIB_DTYPES))
def test_mask_shapes(rng, lib, dtype, shape_name):
    check_mask_shapes(rng, lib, dtype, shape_name)


@pytest.mark.parametrize("lib,dtype", MAIN_LIB_DTYPES, ids=lib_dtype_ids(MAIN_LIB_DTYPES))
def test_mask_with_fully_masked_rows(rng, lib, dtype):
    check_mask_with_fully_masked_rows(rng, lib, dtype)


# ============================================================================ window


@pytest.mark.parametrize("alignment", ["bottom_right", "top_left"])
@pytest.mark.parametrize("window", WINDOWS, ids=[f"w{l}_{r}" for l, r in WINDOWS])
@pytest.mark.parametrize("sq,sk", WIN_LENGTHS, ids=[f"sq{a}-sk{b}" for a, b in WIN_LENGTHS])
@pytest.mark.parametrize("lib,dtype", [("numpy", "float64"), ("torch", "bfloat16")],
                         ids=["numpy-float64", "torch-bfloat16"])
def test_window(rng, lib, dtype, sq, sk, window, alignment):
    check_window(rng, lib, dtype, sq, sk, window, alignment)


@pytest.mark.parametrize("lib,dtype", [("torch", "float32"), ("torch", "float16")],
                         ids=["torch-float32", "torch-float16"])
@pytest.mark.parametrize("alignment", ["bottom_right", "top_left"])
def test_window_with_causal(rng, lib, dtype, alignment):
    """causal + a left window: a local causal band."""
    check_window_with_causal(rng, lib, dtype, alignment)


# ============================================================================ alibi

@pytest.mark.parametrize("alignment", ["bottom_right", "top_left"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("slopes_shape", ["h", "b_h"])
@pytest.mark.parametrize("lib,dtype", MAIN_LIB_DTYPES, ids=lib_dtype_ids(MAIN_LIB_DTYPES))
def test_alibi(rng, lib, dtype, slopes_shape, causal, alignment):
    check_alibi(rng, lib, dtype, slopes_shape, causal, alignment)


# ============================================================================ softcap

@pytest.mark.parametrize("softcap", [0.5, 5.0, 30.0])
@pytest.mark.parametrize("lib,dtype", MAIN_LIB_DTYPES, ids=lib_dtype_ids(MAIN_LIB_DTYPES))
def test_softcap(rng, lib, dtype, softcap):
    check_softcap(rng, lib, dtype, softcap)


# ============================================================================ dropout (NumPy)

@pytest.mark.parametrize("p", [0.01, 0.1, 0.5, 0.9, 0.99])
@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
def test_dropout_numpy_matches_reference(rng, dtype, p):
    """NumPy: the mask is Philox(seed, offset=0): forward and backward equal the reference
    with the same seed."""
    check_dropout_numpy_matches_reference(rng, dtype, p)


@pytest.mark.parametrize("seed", DROPOUT_SEEDS, ids=DROPOUT_SEED_IDS)
def test_dropout_numpy_seeds(rng, seed):
    """Seeds with high 32-bit words (the Philox key's second word) follow the contract."""
    check_dropout_numpy_seed(rng, "float64", seed)


def test_dropout_numpy_seed_changes_output(rng):
    q, k, v, _ = inputs(rng, "numpy", "float64", 1, 16, 16, 2, 2, 8)
    a = fmha.attention(q, k, v, dropout_p=0.5, seed=1)
    b = fmha.attention(q, k, v, dropout_p=0.5, seed=1)
    c = fmha.attention(q, k, v, dropout_p=0.5, seed=2)
    assert np.array_equal(a, b)
    assert not np.allclose(a, c)


# ============================================================================ dropout (torch)


@pytest.mark.parametrize("p", [0.2, 0.6])
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16", "float16"])
def test_dropout_torch_matches_recovered_mask(rng, dtype, p):
    """torch: forward and backward use one and the same mask (recovered from an identity-V
    call with the same torch seed), and match a float64 formula with that mask."""
    check_torch_dropout(rng, dtype, p, causal=True)


def test_dropout_torch_reproducible_and_seed_dependent(rng):
    torch = pytest.importorskip("torch")
    q, k, v, do = inputs(rng, "torch", "float32", 2, 20, 30, 4, 2, 16)
    runs = []
    for s in (11, 11, 12):
        torch.manual_seed(s)
        runs.append(fmha_results(q, k, v, do, dropout_p=0.4))
    for key in ("out", "lse", "dq", "dk", "dv"):
        assert torch.equal(runs[0][key], runs[1][key]), key
    assert not torch.allclose(runs[0]["out"], runs[2]["out"])
    # lse does not depend on dropout (it is the softmax normaliser)
    assert torch.equal(runs[0]["lse"], runs[2]["lse"])
    # consecutive calls without reseeding draw different masks
    torch.manual_seed(11)
    a = fmha.attention(q, k, v, dropout_p=0.4)
    b = fmha.attention(q, k, v, dropout_p=0.4)
    assert not torch.allclose(a, b)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.8])
def test_dropout_torch_keep_rate(rng, p):
    pytest.importorskip("torch")
    b, sq, sk, hq = 2, 48, 64, 4
    z, known = check_torch_dropout(rng, "float64", p, b=b, sq=sq, sk=sk, hq=hq, hkv=1, d=8,
                                    dv=8, torch_seed=int(p * 100))
    n = known.sum()
    rate = (z[known] != 0).mean()
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(rate - (1 - p)) < 5 * sigma, (rate, 1 - p)
    # the mask is indexed by (batch, query head, i, j): query heads sharing one kv head and
    # different batch entries get different masks
    assert not np.array_equal(z[0, 0], z[0, 1])
    assert not np.array_equal(z[0, 0], z[1, 0])


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_numpy_keep_rate(rng, p):
    """Keep rate read off the NumPy forward (identity V) matches 1 - p."""
    b, sq, sk, h = 2, 40, 64, 4
    q = rng.standard_normal((b, sq, h, 8))
    k = rng.standard_normal((b, sk, h, 8))
    eye = np.broadcast_to(np.eye(sk)[None, :, None, :], (b, sk, h, sk)).copy()
    out = fmha.attention(q, k, eye, dropout_p=p, seed=99)
    kept = (out != 0).mean()
    sigma = math.sqrt(p * (1 - p) / out.size)
    assert abs(kept - (1 - p)) < 5 * sigma


# ============================================================================ combinations


@pytest.mark.parametrize("combo", list(COMBOS))
@pytest.mark.parametrize("lib,dtype", [("numpy", "float64"), ("numpy", "float32"),
                                       ("numpy", "float16")],
                         ids=["numpy-float64", "numpy-float32", "numpy-float16"])
def test_combinations_numpy(rng, lib, dtype, combo):
    check_combination_numpy(rng, dtype, combo, dv=24)


@pytest.mark.parametrize("combo", list(COMBOS))
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16", "float16"])
def test_combinations_torch(rng, dtype, combo):
    check_combination_torch(rng, dtype, combo, dv=24)


@pytest.mark.parametrize("lib,dtype", [("numpy", "float64"), ("torch", "float32"),
                                       ("torch", "bfloat16")],
                         ids=["numpy-float64", "torch-float32", "torch-bfloat16"])
def test_combination_cross_odd_noncontiguous(rng, lib, dtype):
    """sq != sk, odd head dims, non-contiguous views, GQA, causal top-left, bias."""
    check_cross_odd_noncontiguous(rng, lib, dtype, b=2, hq=4, hkv=2, d=59, dv=111)


# ============================================================================ -inf bias rows

@pytest.mark.parametrize("lib,dtype", MAIN_LIB_DTYPES + [("numpy", "float32")],
                         ids=lib_dtype_ids(MAIN_LIB_DTYPES + [("numpy", "float32")]))
def test_neg_inf_bias_rows(rng, lib, dtype):
    """Rows whose bias is -inf everywhere: output 0, lse -inf, zero gradients, no NaN."""
    check_neg_inf_bias_rows(rng, lib, dtype)


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_everything_masked(rng, lib):
    """Every key masked for every row: all outputs and gradients are exactly 0."""
    check_everything_masked(rng, lib, "float32")


def test_window_with_no_visible_keys(rng):
    """window (0, 0) bottom-right with sq > sk: rows above the diagonal see nothing."""
    q, k, v, do = inputs(rng, "numpy", "float64", 1, 20, 8, 2, 2, 16)
    res, _ = check_against_reference(q, k, v, do, window=(0, 0))
    assert np.all(res["out"][:, :12] == 0) and np.all(np.isneginf(res["lse"][:, :, :12]))


# ============================================================================ varlen


@pytest.mark.parametrize("feature", list(VARLEN_FEATURES))
@pytest.mark.parametrize("case", list(VARLEN_CASES))
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_varlen_numpy_forward(rng, dtype, case, feature):
    lens_q, lens_k = VARLEN_CASES[case]
    q, k, v, _, cu_q, cu_k = varlen_inputs(rng, "numpy", dtype, lens_q, lens_k, 4, 2, 24, 16)
    kw = varlen_kw(rng, "numpy", VARLEN_FEATURES[feature], len(lens_q), 4)
    out, lse = fmha.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **kw)
    rkw = {kk: to_f64(vv) if kk == "alibi_slopes" else vv for kk, vv in kw.items()}
    ref_out, ref_lse = reference.attention_varlen_forward(to_f64(q), to_f64(k), to_f64(v),
                                                          cu_q, cu_k, **rkw)
    assert lse.shape == (4, q.shape[0])
    assert_close("out", out, ref_out, dtype)
    assert_close("lse", lse, ref_lse, dtype)


@pytest.mark.parametrize("feature", list(VARLEN_FEATURES))
@pytest.mark.parametrize("case", list(VARLEN_CASES))
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
def test_varlen_torch_autograd(rng, dtype, case, feature):
    check_varlen_torch_autograd(rng, dtype, case, feature, hq=4, hkv=2, d=24, dv=16)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_varlen_dropout_numpy(rng, dtype, causal):
    lens_q, lens_k = [5, 1, 17, 9], [7, 1, 3, 20]
    q, k, v, _, cu_q, cu_k = varlen_inputs(rng, "numpy", dtype, lens_q, lens_k, 4, 1, 16, 16)
    seed = 2**40 + 77
    out, lse = fmha.attention_varlen(q, k, v, cu_q, cu_k, dropout_p=0.3, seed=seed,
                                     causal=causal, return_lse=True)
    ref_out, ref_lse = reference.attention_varlen_forward(
        to_f64(q), to_f64(k), to_f64(v), cu_q, cu_k, dropout_p=0.3, seed=seed, causal=causal)
    assert_close("out", out, ref_out, dtype)
    assert_close("lse", lse, ref_lse, dtype)


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
def test_varlen_dropout_torch(rng, dtype):
    """torch varlen + dropout: the mask (recovered with identity V, batch index = sequence
    index) is used consistently in forward and backward."""
    torch = pytest.importorskip("torch")
    lens_q, lens_k = [6, 1, 11], [9, 1, 14]
    p = 0.35
    q, k, v, do, cu_q, cu_k = varlen_inputs(rng, "torch", dtype, lens_q, lens_k, 4, 2, 16, 8)
    total_k = int(cu_k[-1])
    eye = torch.eye(total_k, dtype=torch.float64)[:, None, :].expand(total_k, 2, total_k)
    torch.manual_seed(5)
    pz = fmha.attention_varlen(q.double(), k.double(), eye.contiguous(), cu_q, cu_k,
                               dropout_p=p, causal=True).numpy()
    zs = []
    for bi in range(len(lens_q)):
        sq = slice(int(cu_q[bi]), int(cu_q[bi + 1]))
        sk = slice(int(cu_k[bi]), int(cu_k[bi + 1]))
        probs = reference.attention_probs(to_f64(q)[None, sq], to_f64(k)[None, sk],
                                          to_f64(k)[None, sk], causal=True)
        part = pz[sq][:, :, sk].transpose(1, 0, 2)[None]       # (1, hq, sq, sk)
        known = probs > 0
        z = np.where(known, part / np.where(known, probs, 1), 0)
        ok = (np.abs(z) < 1e-9) | (np.abs(z - 1 / (1 - p)) < 1e-9) | ~known
        assert ok.all(), "dropout multipliers other than 0 and 1/(1-p)"
        zs.append(torch.from_numpy(np.where(np.abs(z) < 1e-9, 0.0, 1 / (1 - p))))
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    torch.manual_seed(5)
    out, lse = fmha.attention_varlen(*leaves, cu_q, cu_k, dropout_p=p, causal=True,
                                     return_lse=True)
    out.backward(do)
    ref = naive_varlen(q.double(), k.double(), v.double(), do.double(), cu_q.numpy(),
                        cu_k.numpy(), dropout_z=zs, causal=True)
    naive = naive_varlen(q, k, v, do, cu_q.numpy(), cu_k.numpy(), dropout_z=zs,
                          causal=True) if dtype in LOW_PRECISION else {}
    results = dict(out=out, lse=lse, dq=leaves[0].grad, dk=leaves[1].grad, dv=leaves[2].grad)
    for key in ref:
        rdt = ("float64" if dtype == "float64" else "float32") if key == "lse" else None
        assert_close(key, results[key], to_f64(ref[key]), dtype, naive=naive.get(key),
                     grad=key.startswith("d"), result_dtype=rdt)


def test_varlen_matches_padded_batch_with_key_padding_mask(rng):
    """A varlen call equals a padded batched call with a key-padding mask (rows beyond each
    sequence's length ignored)."""
    torch = pytest.importorskip("torch")
    lens = [5, 1, 12]
    q, k, v, do, cu_q, cu_k = varlen_inputs(rng, "torch", "float64", lens, lens, 2, 2, 16, 16)
    out = fmha.attention_varlen(q, k, v, cu_q, cu_k)
    L = max(lens)
    qp = torch.zeros(len(lens), L, 2, 16, dtype=torch.float64)
    kp, vp = qp.clone(), qp.clone()
    m = torch.zeros(len(lens), 1, 1, L, dtype=torch.bool)
    for bi, n in enumerate(lens):
        s = slice(int(cu_q[bi]), int(cu_q[bi + 1]))
        qp[bi, :n], kp[bi, :n], vp[bi, :n] = q[s], k[s], v[s]
        m[bi, ..., :n] = True
    outp = fmha.attention(qp, kp, vp, mask=m)
    for bi, n in enumerate(lens):
        s = slice(int(cu_q[bi]), int(cu_q[bi + 1]))
        assert torch.allclose(out[s], outp[bi, :n], rtol=0, atol=1e-12)


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_varlen_with_bias_and_mask(rng, lib):
    """bias / mask in varlen are indexed (b, h, i, j) with positions local to each sequence,
    broadcast to (batch, heads, max_seqlen_q, max_seqlen_k)."""
    need_torch(lib, "float64")
    lens_q, lens_k = [4, 1, 9], [6, 3, 11]
    nb, hq = 3, 2
    q, k, v, do, cu_q, cu_k = varlen_inputs(rng, lib, "float64", lens_q, lens_k, hq, 1, 8, 8)
    mq, mk = max(lens_q), max(lens_k)
    bias64 = rng.standard_normal((nb, hq, mq, mk))
    mask64 = rng.random((nb, 1, mq, mk)) < 0.8
    bias, mask = from_f64(bias64, "float64", lib), bool_array(mask64, lib)
    cq, ck = to_f64(cu_q).astype(int), to_f64(cu_k).astype(int)
    ref_out = np.zeros(q.shape[:2] + (8,))
    ref_dq, ref_dk, ref_dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    ref_db = np.zeros(bias64.shape)
    for bi in range(nb):
        sq, sk = slice(cq[bi], cq[bi + 1]), slice(ck[bi], ck[bi + 1])
        lq, lk = lens_q[bi], lens_k[bi]
        a = [to_f64(x)[None, s] for x, s in ((q, sq), (k, sk), (v, sk))]
        kw = dict(bias=bias64[bi:bi + 1, :, :lq, :lk], mask=mask64[bi:bi + 1, :, :lq, :lk])
        o, _ = reference.attention_forward(*a, **kw)
        dq, dk, dv, db = reference.attention_backward(to_f64(do)[None, sq], *a, **kw)
        ref_out[sq], ref_dq[sq], ref_dk[sk], ref_dv[sk] = o[0], dq[0], dk[0], dv[0]
        ref_db[bi, :, :lq, :lk] = db[0]
    if lib == "numpy":
        out = fmha.attention_varlen(q, k, v, cu_q, cu_k, bias=bias, mask=mask)
        assert_close("out", out, ref_out, "float64")
        return
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    b = bias.clone().requires_grad_(True)
    out = fmha.attention_varlen(*leaves, cu_q, cu_k, bias=b, mask=mask)
    out.backward(do)
    assert_close("out", out, ref_out, "float64")
    for name, g, r in (("dq", leaves[0].grad, ref_dq), ("dk", leaves[1].grad, ref_dk),
                       ("dv", leaves[2].grad, ref_dv), ("dbias", b.grad, ref_db)):
        assert_close(name, g, r, "float64")


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_varlen_empty_sequences(rng, lib):
    """A sequence with no keys (its queries see nothing: out 0, lse -inf) and a sequence with
    no queries, in the middle of a batch."""
    need_torch(lib, "float64")
    lens_q, lens_k = [3, 4, 0, 5], [6, 0, 4, 2]
    q, k, v, do, cu_q, cu_k = varlen_inputs(rng, lib, "float64", lens_q, lens_k, 2, 2, 8, 8)
    ref_out, ref_lse = reference.attention_varlen_forward(
        to_f64(q), to_f64(k), to_f64(v), to_f64(cu_q).astype(int), to_f64(cu_k).astype(int))
    if lib == "numpy":
        out, lse = fmha.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True)
    else:
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        out, lse = fmha.attention_varlen(*leaves, cu_q, cu_k, return_lse=True)
        out.backward(do)
        ref_g = reference.attention_varlen_backward(
            to_f64(do), to_f64(q), to_f64(k), to_f64(v), cu_q.numpy(), cu_k.numpy())
        for name, g, r in zip(("dq", "dk", "dv"), (x.grad for x in leaves), ref_g):
            assert_close(name, g, r, "float64")
    assert_close("out", out, ref_out, "float64")
    assert_close("lse", lse, ref_lse, "float64")


# ============================================================================ determinism

def _det_case(rng, lib, dtype):
    q, k, v, do = inputs(rng, lib, dtype, 2, 150, 137, 4, 2, 40)
    bias = extra_array(rng, (2, 1, 150, 137), lib, dtype)
    return q, k, v, do, dict(bias=bias, bias_grad=True, causal=True, window=(60, 7),
                             softcap=5.0, dropout_p=0.2)


def _run_det(lib, q, k, v, do, kw, seed):
    if lib == "torch":
        import torch
        torch.manual_seed(seed)
        return fmha_results(q, k, v, do, **kw)
    return fmha_results(q, k, v, do, seed=seed, **kw)


@pytest.mark.parametrize("lib,dtype", [("numpy", "float64"), ("numpy", "float32"),
                                       ("torch", "float32"), ("torch", "bfloat16")],
                         ids=["numpy-float64", "numpy-float32", "torch-float32",
                              "torch-bfloat16"])
def test_thread_count_bitwise_determinism(rng, restore_threads, lib, dtype):
    need_torch(lib, dtype)
    q, k, v, do, kw = _det_case(rng, lib, dtype)
    results = {}
    for n in (1, 2, 3):
        fmha.set_num_threads(n)
        assert fmha.get_num_threads() == n
        results[n] = _run_det(lib, q, k, v, do, kw, seed=31337)
    for n in (2, 3):
        for key in ("out", "lse", "dq", "dk", "dv", "dbias"):
            a, b = to_f64(results[1][key]), to_f64(results[n][key])
            assert np.array_equal(a, b, equal_nan=True), f"{key}: threads 1 vs {n} differ"
    fmha.set_num_threads(None)
    assert fmha.get_num_threads() >= 1


def test_thread_count_determinism_varlen(rng, restore_threads):
    torch = pytest.importorskip("torch")
    lens_q, lens_k = [40, 1, 77, 13], [50, 9, 77, 2]
    q, k, v, do, cu_q, cu_k = varlen_inputs(rng, "torch", "float32", lens_q, lens_k, 4, 2, 32, 32)
    res = []
    for n in (1, 2):
        fmha.set_num_threads(n)
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        torch.manual_seed(3)
        out, lse = fmha.attention_varlen(*leaves, cu_q, cu_k, causal=True, dropout_p=0.1,
                                         return_lse=True)
        out.backward(do)
        res.append([out, lse] + [x.grad for x in leaves])
    for a, b, name in zip(res[0], res[1], ("out", "lse", "dq", "dk", "dv")):
        assert torch.equal(a, b), name


# ============================================================================ torch vs NumPy

@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
def test_torch_and_numpy_paths_identical(rng, dtype):
    check_torch_and_numpy_paths_identical(rng, dtype, b=2, d=40, dv=24)


# ============================================================================ gradcheck

GRADCHECK_CASES = {
    "plain": dict(),
    "gqa_causal_bottom_right": dict(hq=4, hkv=2, causal=True, sq=5, sk=7),
    "mqa_topleft_sq_gt_sk": dict(hq=2, hkv=1, causal=True, alignment="top_left", sq=7, sk=4),
    "bias_softcap_alibi": dict(bias=True, softcap=1.5, alibi=True),
    "window_mask": dict(window=(2, 1), mask=True),
    "dropout": dict(dropout_p=0.3, bias=True),
    "dv_ne_d": dict(d=3, dv=5),
}


@pytest.mark.parametrize("case", list(GRADCHECK_CASES))
def test_gradcheck_float64(rng, case):
    torch = pytest.importorskip("torch")
    cfg = dict(GRADCHECK_CASES[case])
    b, hq, hkv = 2, cfg.pop("hq", 2), cfg.pop("hkv", 2)
    sq, sk, d, dv = cfg.pop("sq", 6), cfg.pop("sk", 6), cfg.pop("d", 4), cfg.pop("dv", 4)
    q, k, v, _ = make_inputs(rng, b, sq, sk, hq, hkv, d, dv, dtype="float64", lib="torch")
    leaves = [q.requires_grad_(), k.requires_grad_(), v.requires_grad_()]
    kw = {}
    for key in ("causal", "alignment", "window", "softcap", "dropout_p"):
        if key in cfg:
            kw[key] = cfg[key]
    if cfg.get("bias"):
        leaves.append(torch.from_numpy(rng.standard_normal((1, hq, sq, sk))).requires_grad_())
    if cfg.get("mask"):
        m = torch.from_numpy(rng.random((b, 1, sq, sk)) < 0.7)
        m[..., 0] = True
        kw["mask"] = m
    if cfg.get("alibi"):
        kw["alibi_slopes"] = torch.tensor([0.3, 0.7], dtype=torch.float64)

    def f(q, k, v, *bias):
        torch.manual_seed(0)            # dropout: the same mask on every evaluation
        return fmha.attention(q, k, v, bias=bias[0] if bias else None, **kw)

    assert torch.autograd.gradcheck(f, tuple(leaves), eps=1e-6, atol=1e-7, rtol=1e-5)


# ============================================================================ helper sanity

def test_naive_torch_formula_matches_reference(rng):
    """The naive torch formula (the low-precision baseline, and the float64 reference for
    torch dropout) agrees with fmha.reference in float64, dropout included."""
    torch = pytest.importorskip("torch")
    q, k, v, do = make_inputs(rng, 2, 11, 17, 4, 2, 8, 6, dtype="float64", lib="torch")
    bias = torch.from_numpy(rng.standard_normal((2, 1, 11, 17)))
    mask = torch.from_numpy(rng.random((2, 4, 11, 17)) < 0.8)
    slopes = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    kw = dict(causal=True, window=(5, -1), alignment="top_left", softcap=2.0, mask=mask,
              alibi_slopes=slopes)
    keep = dropout_keep_mask(17, 0, 2, 4, 11, 17, 0.4)
    n = naive_results(q, k, v, do, bias=bias, bias_grad=True,
                      dropout_z=torch.from_numpy(keep / 0.6), **kw)
    r = reference_results(q, k, v, do, bias=bias, bias_grad=True, dropout_p=0.4, seed=17, **kw)
    for key in r:
        assert_close(key, n[key], r[key], "float64")
