"""Correctness of fmha's CPU kernels against the float64 NumPy reference (fmha.reference).

Every case checks the forward (out, lse) and the backward (dq, dk, dv[, dbias]) with the
tolerance rule of design.md (see conftest.py: float64 1e-10, float32 2e-5 relative to
max|ref|; float16/bfloat16 within 2x (3x for gradients) of a naive low-precision torch
computation's error). NumPy arrays go through fmha.attention + fmha.attention_backward,
torch tensors through autograd.
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

# (lib, dtype) combinations. numpy has no bfloat16.
ALL_LIB_DTYPES = [("numpy", "float64"), ("numpy", "float32"), ("numpy", "float16"),
                  ("torch", "float64"), ("torch", "float32"), ("torch", "bfloat16"),
                  ("torch", "float16")]
MAIN_LIB_DTYPES = [("numpy", "float64"), ("torch", "float32"), ("torch", "bfloat16"),
                   ("torch", "float16")]
FULL_PREC = [("numpy", "float64"), ("torch", "float32")]


def _ids(pairs):
    return [f"{lib}-{dt}" for lib, dt in pairs]


def need_torch(lib, dtype):
    """torch is needed for torch inputs and for every low-precision naive baseline."""
    if lib == "torch" or dtype in LOW_PRECISION:
        return pytest.importorskip("torch")
    return None


def inputs(rng, lib, dtype, b, sq, sk, hq, hkv, d, dv=None):
    need_torch(lib, dtype)
    return make_inputs(rng, b, sq, sk, hq, hkv, d, dv, dtype=dtype, lib=lib)


def extra_array(rng, shape, lib, dtype="float32", scale=1.0):
    return make_array(rng, shape, dtype, lib, scale)


def bool_array(x: np.ndarray, lib):
    if lib == "torch":
        import torch
        return torch.from_numpy(np.ascontiguousarray(x))
    return np.ascontiguousarray(x)


# ============================================================================ dtypes

@pytest.mark.parametrize("lib,dtype", ALL_LIB_DTYPES, ids=_ids(ALL_LIB_DTYPES))
def test_dtypes(rng, lib, dtype):
    q, k, v, do = inputs(rng, lib, dtype, 2, 37, 45, 4, 2, 64)
    check_against_reference(q, k, v, do)


@pytest.mark.parametrize("scale", [0.37, -0.8, 2.0])
@pytest.mark.parametrize("lib,dtype", MAIN_LIB_DTYPES, ids=_ids(MAIN_LIB_DTYPES))
def test_explicit_scale(rng, lib, dtype, scale):
    q, k, v, do = inputs(rng, lib, dtype, 1, 19, 23, 2, 2, 32)
    check_against_reference(q, k, v, do, scale=scale)


# ============================================================================ online softmax

def _score_pattern_inputs(rng, lib, dtype, pattern, b=1, sq=70, sk=300, h=2, d=32):
    """Scores that force the online softmax to rescale: growing / shrinking along the keys
    (a new row maximum in every tile, or only in the first), or simply large (|s| ~ 100)."""
    q64 = rng.standard_normal((b, sq, h, d))
    k64 = rng.standard_normal((b, sk, h, d))
    v64 = rng.standard_normal((b, sk, h, d))
    do64 = rng.standard_normal((b, sq, h, d))
    if pattern in ("increasing", "decreasing"):
        ramp = np.linspace(0.0, 12.0, sk)
        if pattern == "decreasing":
            ramp = ramp[::-1]
        q64[..., 0] = np.abs(q64[..., 0]) + 1.0     # score_j ~ ramp_j * q_0 / sqrt(d) * 6
        k64[..., 0] = ramp[None, :, None] * 3.0
    elif pattern == "large":
        q64 *= 4.0
        k64 *= 4.0                                   # |s| up to ~100
    need_torch(lib, dtype)
    return tuple(from_f64(x, dtype, lib) for x in (q64, k64, v64, do64))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("pattern", ["increasing", "decreasing", "large"])
@pytest.mark.parametrize("lib,dtype", MAIN_LIB_DTYPES, ids=_ids(MAIN_LIB_DTYPES))
def test_online_softmax_rescaling(rng, lib, dtype, pattern, causal):
    q, k, v, do = _score_pattern_inputs(rng, lib, dtype, pattern)
    check_against_reference(q, k, v, do, causal=causal)


MASKED_TILES = {
    # a narrow band in the middle of a long key axis: whole tiles before and after it masked
    "band_window_bottom_right": dict(window=(10, 10)),
    "band_window_top_left": dict(window=(10, 10), alignment="top_left"),
    # key padding that masks whole leading / trailing tiles
    "leading_keys_masked": dict(mask="leading"),
    "trailing_keys_masked": dict(mask="trailing"),
    # -inf bias on the first 200 keys of some rows (first tiles give row max -inf)
    "neg_inf_bias_prefix": dict(bias="prefix"),
}


@pytest.mark.parametrize("case", list(MASKED_TILES))
@pytest.mark.parametrize("lib,dtype", MAIN_LIB_DTYPES, ids=_ids(MAIN_LIB_DTYPES))
def test_fully_masked_tiles(rng, lib, dtype, case):
    b, sq, sk, h = 2, 70, 300, 2
    q, k, v, do = inputs(rng, lib, dtype, b, sq, sk, h, 1, 32)
    cfg = dict(MASKED_TILES[case])
    kw = {kk: vv for kk, vv in cfg.items() if kk not in ("mask", "bias")}
    bias = None
    if cfg.get("mask") == "leading":
        m = np.ones((b, 1, 1, sk), bool)
        m[0, ..., :230] = False
        m[1, ..., :129] = False
        kw["mask"] = bool_array(m, lib)
    elif cfg.get("mask") == "trailing":
        m = np.ones((b, 1, 1, sk), bool)
        m[0, ..., 3:] = False
        m[1, ..., 65:] = False
        kw["mask"] = bool_array(m, lib)
    elif cfg.get("bias") == "prefix":
        bias64 = rng.standard_normal((b, h, sq, sk))
        bias64[0, :, ::3, :200] = -np.inf
        bias64[1, 1, 5:40, :299] = -np.inf
        bias = from_f64(bias64, dtype, lib)
    check_against_reference(q, k, v, do, bias=bias, bias_grad=bias is not None, **kw)


# ============================================================================ causal

CAUSAL_LENGTHS = [(33, 33), (17, 50), (50, 17), (1, 40), (40, 1)]


@pytest.mark.parametrize("alignment", ["bottom_right", "top_left"])
@pytest.mark.parametrize("sq,sk", CAUSAL_LENGTHS, ids=[f"sq{a}-sk{b}" for a, b in CAUSAL_LENGTHS])
@pytest.mark.parametrize("lib,dtype", MAIN_LIB_DTYPES, ids=_ids(MAIN_LIB_DTYPES))
def test_causal(rng, lib, dtype, sq, sk, alignment):
    q, k, v, do = inputs(rng, lib, dtype, 2, sq, sk, 2, 1, 32)
    check_against_reference(q, k, v, do, causal=True, alignment=alignment)


# ============================================================================ GQA / MQA

@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 2), (8, 1), (6, 3)],
                         ids=["MHA-8-8", "GQA-8-2", "MQA-8-1", "GQA-6-3"])
@pytest.mark.parametrize("lib,dtype", MAIN_LIB_DTYPES, ids=_ids(MAIN_LIB_DTYPES))
def test_gqa_mqa(rng, lib, dtype, hq, hkv):
    q, k, v, do = inputs(rng, lib, dtype, 2, 29, 31, hq, hkv, 32)
    check_against_reference(q, k, v, do)
    if hkv != hq:
        check_against_reference(q, k, v, do, causal=True)


# ============================================================================ cross lengths

CROSS = [(1, 113), (113, 1), (17, 113), (113, 17), (64, 65), (65, 64)]


@pytest.mark.parametrize("sq,sk", CROSS, ids=[f"sq{a}-sk{b}" for a, b in CROSS])
@pytest.mark.parametrize("lib,dtype", MAIN_LIB_DTYPES, ids=_ids(MAIN_LIB_DTYPES))
def test_cross_lengths(rng, lib, dtype, sq, sk):
    q, k, v, do = inputs(rng, lib, dtype, 2, sq, sk, 2, 2, 40)
    check_against_reference(q, k, v, do)


@pytest.mark.parametrize("lib,dtype", MAIN_LIB_DTYPES, ids=_ids(MAIN_LIB_DTYPES))
def test_causal_bottom_right_sq_gt_sk_empty_rows(rng, lib, dtype):
    """sq > sk, causal bottom-right: the first sq - sk rows see no key -> out 0, lse -inf,
    gradients 0, no NaN (reference check covers the -inf pattern and the values)."""
    sq, sk = 40, 13
    q, k, v, do = inputs(rng, lib, dtype, 2, sq, sk, 4, 2, 32)
    res, ref = check_against_reference(q, k, v, do, causal=True, alignment="bottom_right")
    empty = sq - sk
    out, lse, dq = to_f64(res["out"]), to_f64(res["lse"]), to_f64(res["dq"])
    assert np.all(out[:, :empty] == 0.0)
    assert np.all(np.isneginf(lse[:, :, :empty]))
    assert np.all(np.isfinite(lse[:, :, empty:]))
    assert np.all(dq[:, :empty] == 0.0)
    for g in ("dq", "dk", "dv"):
        assert not np.any(np.isnan(to_f64(res[g])))


# ============================================================================ odd sizes

@pytest.mark.parametrize("seqlen", [1, 17, 113, 1000])
@pytest.mark.parametrize("lib,dtype", MAIN_LIB_DTYPES, ids=_ids(MAIN_LIB_DTYPES))
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
@pytest.mark.parametrize("lib,dtype", MAIN_LIB_DTYPES, ids=_ids(MAIN_LIB_DTYPES))
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


DV = [(64, 32), (32, 64), (40, 111), (8, 256), (256, 8), (59, 1)]


@pytest.mark.parametrize("d,dv", DV, ids=[f"d{a}-dv{b}" for a, b in DV])
@pytest.mark.parametrize("lib,dtype", MAIN_LIB_DTYPES, ids=_ids(MAIN_LIB_DTYPES))
def test_head_dim_v(rng, lib, dtype, d, dv):
    q, k, v, do = inputs(rng, lib, dtype, 2, 21, 30, 4, 2, d, dv)
    check_against_reference(q, k, v, do)


# ============================================================================ non-contiguous

def _layouts_torch(x64, kind, dtype="float64"):
    """x64: float64 NumPy (b, s, h, d) -> a non-contiguous torch tensor of ``dtype`` with the
    same (rounded) values."""
    import torch
    t = torch.from_numpy(x64).to(getattr(torch, dtype))
    if kind == "transposed":      # made as (b, h, s, d), viewed as (b, s, h, d)
        return t.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    if kind == "sliced":          # every other seq row / an extra head, from a bigger buffer
        b, s, h, d = t.shape
        big = torch.zeros(b, 2 * s, h + 1, d + 3, dtype=t.dtype)
        big[:, ::2, 1:, 2:d + 2] = t
        return big[:, ::2, 1:, 2:d + 2]
    if kind == "lastdim":         # last-dim stride 2
        b, s, h, d = t.shape
        big = torch.zeros(b, s, h, 2 * d, dtype=t.dtype)
        big[..., ::2] = t
        return big[..., ::2]
    if kind == "dim_transposed":  # made as (b, s, d, h): last dim has stride h
        return t.transpose(2, 3).contiguous().transpose(2, 3)
    raise ValueError(kind)


def _layouts_numpy(x64, kind):
    if kind == "transposed":
        return np.ascontiguousarray(x64.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    if kind == "sliced":
        b, s, h, d = x64.shape
        big = np.zeros((b, 2 * s, h + 1, d + 3))
        big[:, ::2, 1:, 2:d + 2] = x64
        return big[:, ::2, 1:, 2:d + 2]
    if kind == "lastdim":
        b, s, h, d = x64.shape
        big = np.zeros((b, s, h, 2 * d))
        big[..., ::2] = x64
        return big[..., ::2]
    if kind == "dim_transposed":
        return np.ascontiguousarray(x64.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)
    if kind == "reversed":        # negative strides in seq
        return np.ascontiguousarray(x64[:, ::-1])[:, ::-1]
    raise ValueError(kind)


NONCONTIG = ["transposed", "sliced", "lastdim", "dim_transposed"]


@pytest.mark.parametrize("kind", NONCONTIG)
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
def test_noncontiguous_torch(rng, dtype, kind):
    torch = pytest.importorskip("torch")
    b, sq, sk, hq, hkv, d, dv = 2, 19, 26, 4, 2, 24, 40
    q64 = rng.standard_normal((b, sq, hq, d))
    k64 = rng.standard_normal((b, sk, hkv, d))
    v64 = rng.standard_normal((b, sk, hkv, dv))
    q, k, v = (_layouts_torch(x, kind, dtype) for x in (q64, k64, v64))
    assert not q.is_contiguous() and not k.is_contiguous() and not v.is_contiguous()
    do = _layouts_torch(rng.standard_normal((b, sq, hq, dv)), kind, dtype)
    res, _ = check_against_reference(q, k, v, do, causal=True)
    # and identical to the contiguous call
    cres = fmha_results(q.contiguous(), k.contiguous(), v.contiguous(), do.contiguous(),
                        causal=True)
    for key in ("out", "lse", "dq", "dk", "dv"):
        assert torch.equal(res[key], cres[key]), key


@pytest.mark.parametrize("kind", NONCONTIG + ["reversed"])
def test_noncontiguous_numpy(rng, kind):
    b, sq, sk, hq, hkv, d, dv = 2, 19, 26, 4, 1, 24, 40
    q, k, v = (_layouts_numpy(rng.standard_normal(s), kind)
               for s in ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, dv)))
    do = _layouts_numpy(rng.standard_normal((b, sq, hq, dv)), kind)
    assert not q.flags.c_contiguous
    res, _ = check_against_reference(q, k, v, do, causal=True, alignment="top_left")
    cres = fmha_results(*(np.ascontiguousarray(x) for x in (q, k, v, do)), causal=True,
                        alignment="top_left")
    for key in ("out", "lse", "dq", "dk", "dv"):
        assert np.array_equal(res[key], cres[key]), key


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
    torch = pytest.importorskip("torch")
    x = make_array(rng, (2, 17, 2, 16), dtype, "torch").requires_grad_(True)
    do = make_array(rng, (2, 17, 2, 16), dtype, "torch")
    out = fmha.attention(x, x, x, causal=True)
    out.backward(do)
    ref = reference_results(x, x, x, do, causal=True)
    assert_close("out", out, ref["out"], dtype)
    assert_close("dx", x.grad, ref["dq"] + ref["dk"] + ref["dv"], dtype)


# ============================================================================ bias

BIAS_SHAPES = {
    "sq_sk": lambda b, h, sq, sk: (sq, sk),
    "sk": lambda b, h, sq, sk: (sk,),
    "b_1_1_sk": lambda b, h, sq, sk: (b, 1, 1, sk),
    "1_h_sq_sk": lambda b, h, sq, sk: (1, h, sq, sk),
    "b_h_sq_sk": lambda b, h, sq, sk: (b, h, sq, sk),
    "h_1_1": lambda b, h, sq, sk: (h, 1, 1),
    "b_h_sq_1": lambda b, h, sq, sk: (b, h, sq, 1),
    "1_1_sq_sk": lambda b, h, sq, sk: (1, 1, sq, sk),
}


@pytest.mark.parametrize("shape_name", list(BIAS_SHAPES))
@pytest.mark.parametrize("lib,dtype", MAIN_LIB_DTYPES + [("numpy", "float32")],
                         ids=_ids(MAIN_LIB_DTYPES + [("numpy", "float32")]))
def test_bias_shapes(rng, lib, dtype, shape_name):
    b, sq, sk, hq, hkv = 2, 21, 27, 4, 2
    q, k, v, do = inputs(rng, lib, dtype, b, sq, sk, hq, hkv, 32)
    bias = extra_array(rng, BIAS_SHAPES[shape_name](b, hq, sq, sk), lib, dtype, scale=2.0)
    check_against_reference(q, k, v, do, bias=bias, bias_grad=True)


@pytest.mark.parametrize("shape_name", ["h_1_1", "b_h_sq_1"])
@pytest.mark.parametrize("lib,dtype", MAIN_LIB_DTYPES, ids=_ids(MAIN_LIB_DTYPES))
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


@pytest.mark.parametrize("lib,dtype", MAIN_LIB_DTYPES, ids=_ids(MAIN_LIB_DTYPES))
def test_bias_without_grad(rng, lib, dtype):
    """A bias that does not require grad still shifts the scores (and q/k/v grads)."""
    q, k, v, do = inputs(rng, lib, dtype, 2, 17, 19, 2, 2, 32)
    bias = extra_array(rng, (2, 2, 17, 19), lib, dtype, scale=2.0)
    check_against_reference(q, k, v, do, bias=bias, causal=True)


@pytest.mark.parametrize("bias_dtype", ["float32", "float64"])
def test_bias_dtype_differs_from_q(rng, bias_dtype):
    torch = pytest.importorskip("torch")
    q, k, v, do = inputs(rng, "torch", "float32", 2, 17, 19, 2, 2, 32)
    bias = extra_array(rng, (1, 2, 17, 19), "torch", bias_dtype)
    res, _ = check_against_reference(q, k, v, do, bias=bias, bias_grad=True)
    assert res["dbias"].dtype == getattr(torch, bias_dtype)


# ============================================================================ bool mask

MASK_SHAPES = {
    "key_padding_b_1_1_sk": lambda b, h, sq, sk: (b, 1, 1, sk),
    "sq_sk": lambda b, h, sq, sk: (sq, sk),
    "b_h_sq_sk": lambda b, h, sq, sk: (b, h, sq, sk),
    "1_h_1_sk": lambda b, h, sq, sk: (1, h, 1, sk),
    "b_1_sq_sk": lambda b, h, sq, sk: (b, 1, sq, sk),
}


@pytest.mark.parametrize("shape_name", list(MASK_SHAPES))
@pytest.mark.parametrize("lib,dtype", MAIN_LIB_DTYPES, ids=_ids(MAIN_LIB_DTYPES))
def test_mask_shapes(rng, lib, dtype, shape_name):
    b, sq, sk, hq, hkv = 2, 21, 27, 4, 1
    q, k, v, do = inputs(rng, lib, dtype, b, sq, sk, hq, hkv, 32)
    shape = MASK_SHAPES[shape_name](b, hq, sq, sk)
    m = rng.random(shape) < 0.7
    if shape_name.startswith("key_padding"):
        m = np.ones(shape, bool)
        m[0, ..., 20:] = False          # batch 0 has 20 valid keys, batch 1 all 27
    check_against_reference(q, k, v, do, mask=bool_array(m, lib))


@pytest.mark.parametrize("lib,dtype", MAIN_LIB_DTYPES, ids=_ids(MAIN_LIB_DTYPES))
def test_mask_with_fully_masked_rows(rng, lib, dtype):
    b, sq, sk, h = 2, 15, 22, 2
    q, k, v, do = inputs(rng, lib, dtype, b, sq, sk, h, h, 16)
    m = rng.random((b, h, sq, sk)) < 0.6
    m[0, 1, 3] = False
    m[1, :, 7:9] = False
    res, _ = check_against_reference(q, k, v, do, mask=bool_array(m, lib))
    out, lse, dq = to_f64(res["out"]), to_f64(res["lse"]), to_f64(res["dq"])
    assert np.all(out[0, 3, 1] == 0) and np.all(out[1, 7:9] == 0)
    assert np.isneginf(lse[0, 1, 3]) and np.all(np.isneginf(lse[1, :, 7:9]))
    assert np.all(dq[0, 3, 1] == 0) and np.all(dq[1, 7:9] == 0)


# ============================================================================ window

WINDOWS = [(4, 0), (0, 0), (3, 5), (-1, 2), (7, -1), (0, 3)]
WIN_LENGTHS = [(31, 31), (20, 45), (45, 20)]


@pytest.mark.parametrize("alignment", ["bottom_right", "top_left"])
@pytest.mark.parametrize("window", WINDOWS, ids=[f"w{l}_{r}" for l, r in WINDOWS])
@pytest.mark.parametrize("sq,sk", WIN_LENGTHS, ids=[f"sq{a}-sk{b}" for a, b in WIN_LENGTHS])
@pytest.mark.parametrize("lib,dtype", [("numpy", "float64"), ("torch", "bfloat16")],
                         ids=["numpy-float64", "torch-bfloat16"])
def test_window(rng, lib, dtype, sq, sk, window, alignment):
    q, k, v, do = inputs(rng, lib, dtype, 1, sq, sk, 2, 1, 16)
    check_against_reference(q, k, v, do, window=window, alignment=alignment)


@pytest.mark.parametrize("lib,dtype", [("torch", "float32"), ("torch", "float16")],
                         ids=["torch-float32", "torch-float16"])
@pytest.mark.parametrize("alignment", ["bottom_right", "top_left"])
def test_window_with_causal(rng, lib, dtype, alignment):
    """causal + a left window: a local causal band."""
    q, k, v, do = inputs(rng, lib, dtype, 2, 40, 53, 2, 2, 32)
    check_against_reference(q, k, v, do, causal=True, window=(6, -1), alignment=alignment)


# ============================================================================ alibi

@pytest.mark.parametrize("alignment", ["bottom_right", "top_left"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("slopes_shape", ["h", "b_h"])
@pytest.mark.parametrize("lib,dtype", MAIN_LIB_DTYPES, ids=_ids(MAIN_LIB_DTYPES))
def test_alibi(rng, lib, dtype, slopes_shape, causal, alignment):
    b, sq, sk, hq, hkv = 2, 24, 37, 4, 2
    q, k, v, do = inputs(rng, lib, dtype, b, sq, sk, hq, hkv, 32)
    base = np.array([2.0 ** (-8 * (i + 1) / hq) for i in range(hq)])
    slopes64 = base if slopes_shape == "h" else base[None] * rng.uniform(0.5, 2.0, (b, 1))
    slopes = from_f64(slopes64, "float32", lib)
    check_against_reference(q, k, v, do, alibi_slopes=slopes, causal=causal, alignment=alignment)


# ============================================================================ softcap

@pytest.mark.parametrize("softcap", [0.5, 5.0, 30.0])
@pytest.mark.parametrize("lib,dtype", MAIN_LIB_DTYPES, ids=_ids(MAIN_LIB_DTYPES))
def test_softcap(rng, lib, dtype, softcap):
    q, k, v, do = inputs(rng, lib, dtype, 2, 25, 33, 4, 2, 32)
    # large scale so the cap actually bends the scores
    check_against_reference(q, k, v, do, softcap=softcap, scale=1.5)


# ============================================================================ dropout (NumPy)

@pytest.mark.parametrize("p", [0.01, 0.1, 0.5, 0.9, 0.99])
@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
def test_dropout_numpy_matches_reference(rng, dtype, p):
    """NumPy: the mask is Philox(seed, offset=0): forward and backward equal the reference
    with the same seed."""
    need_torch("numpy", dtype)
    q, k, v, do = inputs(rng, "numpy", dtype, 2, 23, 37, 4, 2, 24)
    seed = 1234567 + int(p * 10)
    check_against_reference(q, k, v, do, dropout_p=p, seed=seed, ref_kw=dict(seed=seed))


@pytest.mark.parametrize("seed", [0, 1, 2**32 + 5, 2**63 + 12345, 2**64 - 1],
                         ids=["0", "1", "2^32+5", "2^63+12345", "2^64-1"])
def test_dropout_numpy_seeds(rng, seed):
    """Seeds with high 32-bit words (the Philox key's second word) follow the contract."""
    q, k, v, do = inputs(rng, "numpy", "float64", 1, 9, 14, 2, 1, 8)
    check_against_reference(q, k, v, do, dropout_p=0.3, seed=seed, causal=True,
                            ref_kw=dict(seed=seed))


def test_dropout_numpy_seed_changes_output(rng):
    q, k, v, _ = inputs(rng, "numpy", "float64", 1, 16, 16, 2, 2, 8)
    a = fmha.attention(q, k, v, dropout_p=0.5, seed=1)
    b = fmha.attention(q, k, v, dropout_p=0.5, seed=1)
    c = fmha.attention(q, k, v, dropout_p=0.5, seed=2)
    assert np.array_equal(a, b)
    assert not np.allclose(a, c)


# ============================================================================ dropout (torch)

def _recover_dropout_z(q, k, p, torch_seed, **kw):
    """The dropout multiplier a torch call with this torch seed uses, recovered from fmha
    itself: with v = identity over keys, out[b, i, h, j] = P_bhij * Z_bhij.

    Runs in float64 (the mask is a function of (seed, offset, b, h, i, j) only). Returns
    Z (b, hq, sq, sk) and the boolean "known" (P > 0) where Z could be read off.
    """
    import torch
    b, sq, hq, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    q64, k64 = q.detach().double(), k.detach().double()
    eye = torch.eye(sk, dtype=torch.float64)[None, :, None, :].expand(b, sk, hkv, sk).contiguous()
    torch.manual_seed(torch_seed)
    out = fmha.attention(q64, k64, eye, dropout_p=p, **kw).permute(0, 2, 1, 3).numpy()
    rkw = {kk: to_f64(vv) if kk in ("bias", "mask", "alibi_slopes") else vv
           for kk, vv in kw.items()}
    probs = reference.attention_probs(q64.numpy(), k64.numpy(), eye.numpy(), **rkw)
    known = probs > 1e-200
    z = np.where(known, out / np.where(known, probs, 1.0), 0.0)
    keep_val = 1.0 / (1.0 - p)
    # every recovered multiplier must be 0 or 1/(1-p)
    near0 = np.abs(z) <= 1e-9 * keep_val
    near1 = np.abs(z - keep_val) <= 1e-9 * keep_val
    assert np.all(near0 | near1 | ~known), "dropout multipliers other than 0 and 1/(1-p)"
    return np.where(near1 & known, keep_val, 0.0), known


def _torch_dropout_check(rng, dtype, p, b=2, sq=21, sk=34, hq=4, hkv=2, d=16, dv=24,
                         bias_shape=None, torch_seed=7, **kw):
    torch = pytest.importorskip("torch")
    q, k, v, do = inputs(rng, "torch", dtype, b, sq, sk, hq, hkv, d, dv)
    bias = None
    if bias_shape is not None:
        bias = extra_array(rng, bias_shape, "torch", dtype)
        kw["bias"] = bias
    z, known = _recover_dropout_z(q, k, p, torch_seed, **kw)
    torch.manual_seed(torch_seed)
    res = fmha_results(q, k, v, do, dropout_p=p, bias_grad=bias is not None, **kw)
    fkw = dict(kw)
    fkw.pop("bias", None)
    ref = naive_results(*(x.double() for x in (q, k, v, do)),
                        bias=None if bias is None else bias.double(),
                        bias_grad=bias is not None, dropout_z=torch.from_numpy(z), **fkw)
    ref = {kk: to_f64(vv) for kk, vv in ref.items()}
    naive = None
    if dtype in LOW_PRECISION:
        naive = naive_results(q, k, v, do, bias=bias, bias_grad=bias is not None,
                              dropout_z=torch.from_numpy(z), **fkw)
    for key in ref:
        rdt = ("float64" if dtype == "float64" else "float32") if key == "lse" else None
        assert_close(key, res[key], ref[key], dtype, naive=None if naive is None else naive[key],
                     grad=key.startswith("d"), result_dtype=rdt)
    return z, known


@pytest.mark.parametrize("p", [0.2, 0.6])
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16", "float16"])
def test_dropout_torch_matches_recovered_mask(rng, dtype, p):
    """torch: forward and backward use one and the same mask (recovered from an identity-V
    call with the same torch seed), and match a float64 formula with that mask."""
    _torch_dropout_check(rng, dtype, p, causal=True)


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
    z, known = _torch_dropout_check(rng, "float64", p, b=b, sq=sq, sk=sk, hq=hq, hkv=1, d=8,
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

COMBOS = {
    "gqa_causal_bias_softcap_dropout": dict(hq=8, hkv=2, causal=True, bias=(2, 8, 29, 41),
                                            softcap=4.0, dropout_p=0.25),
    "mqa_window_mask_alibi": dict(hq=4, hkv=1, window=(5, 3), mask=(2, 1, 29, 41),
                                  alibi="b_h"),
    "cross_topleft_causal_bias_alibi": dict(hq=4, hkv=2, causal=True, alignment="top_left",
                                            bias=(1, 4, 29, 41), alibi="h"),
    "window_topleft_softcap_mask_dropout": dict(hq=2, hkv=2, window=(6, 2),
                                                alignment="top_left", softcap=2.0,
                                                mask=(2, 2, 29, 41), dropout_p=0.3),
    "everything": dict(hq=6, hkv=3, causal=True, window=(9, -1), bias=(2, 1, 29, 41),
                       mask=(2, 1, 1, 41), alibi="h", softcap=3.0, dropout_p=0.15),
}


def _combo_args(rng, lib, dtype, cfg, b=2, sq=29, sk=41):
    kw = {}
    for key in ("causal", "window", "alignment", "softcap", "dropout_p"):
        if key in cfg:
            kw[key] = cfg[key]
    if "bias" in cfg:
        kw["bias"] = extra_array(rng, cfg["bias"], lib, dtype)
    if "mask" in cfg:
        m = rng.random(cfg["mask"]) < 0.75
        kw["mask"] = bool_array(m, lib)
    if "alibi" in cfg:
        hq = cfg["hq"]
        s = rng.uniform(0.01, 0.3, (hq,) if cfg["alibi"] == "h" else (b, hq))
        kw["alibi_slopes"] = from_f64(s, "float32", lib)
    return kw


@pytest.mark.parametrize("combo", list(COMBOS))
@pytest.mark.parametrize("lib,dtype", [("numpy", "float64"), ("numpy", "float32"),
                                       ("numpy", "float16")],
                         ids=["numpy-float64", "numpy-float32", "numpy-float16"])
def test_combinations_numpy(rng, lib, dtype, combo):
    need_torch(lib, dtype)
    cfg = COMBOS[combo]
    q, k, v, do = inputs(rng, lib, dtype, 2, 29, 41, cfg["hq"], cfg["hkv"], 40, 24)
    kw = _combo_args(rng, lib, dtype, cfg)
    seed = 4242
    bias_grad = "bias" in kw
    check_against_reference(q, k, v, do, seed=seed, ref_kw=dict(seed=seed),
                            bias_grad=bias_grad, **kw)


@pytest.mark.parametrize("combo", list(COMBOS))
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16", "float16"])
def test_combinations_torch(rng, dtype, combo):
    torch = pytest.importorskip("torch")
    cfg = COMBOS[combo]
    kw = _combo_args(rng, "torch", dtype, cfg)
    p = kw.pop("dropout_p", 0.0)
    bias = kw.pop("bias", None)
    if p > 0:
        bias_shape = None if bias is None else tuple(bias.shape)
        _torch_dropout_check(rng, dtype, p, b=2, sq=29, sk=41, hq=cfg["hq"], hkv=cfg["hkv"],
                             d=40, dv=24, bias_shape=bias_shape, **kw)
        return
    q, k, v, do = inputs(rng, "torch", dtype, 2, 29, 41, cfg["hq"], cfg["hkv"], 40, 24)
    check_against_reference(q, k, v, do, bias=bias, bias_grad=bias is not None, **kw)


@pytest.mark.parametrize("lib,dtype", [("numpy", "float64"), ("torch", "float32"),
                                       ("torch", "bfloat16")],
                         ids=["numpy-float64", "torch-float32", "torch-bfloat16"])
def test_combination_cross_odd_noncontiguous(rng, lib, dtype):
    """sq != sk, odd head dims, non-contiguous views, GQA, causal top-left, bias."""
    need_torch(lib, dtype)
    b, sq, sk, hq, hkv, d, dv = 2, 113, 17, 4, 2, 59, 111
    if lib == "torch":
        conv = lambda x: _layouts_torch(x, "sliced", dtype)  # noqa: E731
    else:
        conv = lambda x: _layouts_numpy(x, "transposed")  # noqa: E731
    q = conv(rng.standard_normal((b, sq, hq, d)))
    assert not (q.is_contiguous() if lib == "torch" else q.flags.c_contiguous)
    k = conv(rng.standard_normal((b, sk, hkv, d)))
    v = conv(rng.standard_normal((b, sk, hkv, dv)))
    do = conv(rng.standard_normal((b, sq, hq, dv)))
    bias = extra_array(rng, (b, 1, sq, sk), lib, dtype)
    check_against_reference(q, k, v, do, causal=True, alignment="top_left", bias=bias,
                            bias_grad=True)


# ============================================================================ -inf bias rows

@pytest.mark.parametrize("lib,dtype", MAIN_LIB_DTYPES + [("numpy", "float32")],
                         ids=_ids(MAIN_LIB_DTYPES + [("numpy", "float32")]))
def test_neg_inf_bias_rows(rng, lib, dtype):
    """Rows whose bias is -inf everywhere: output 0, lse -inf, zero gradients, no NaN."""
    b, sq, sk, h = 2, 19, 24, 2
    q, k, v, do = inputs(rng, lib, dtype, b, sq, sk, h, h, 32)
    bias64 = rng.standard_normal((b, h, sq, sk))
    bias64[0, 1, 4] = -np.inf
    bias64[1, :, 10:13] = -np.inf
    bias64[1, 0, 0, :5] = -np.inf        # partly -inf row: still fine
    bias = from_f64(bias64, dtype, lib)
    res, _ = check_against_reference(q, k, v, do, bias=bias, bias_grad=True)
    out, lse = to_f64(res["out"]), to_f64(res["lse"])
    dq, dbias = to_f64(res["dq"]), to_f64(res["dbias"])
    assert np.all(out[0, 4, 1] == 0) and np.all(out[1, 10:13] == 0)
    assert np.isneginf(lse[0, 1, 4]) and np.all(np.isneginf(lse[1, :, 10:13]))
    assert np.all(dq[0, 4, 1] == 0) and np.all(dq[1, 10:13] == 0)
    assert np.all(dbias[0, 1, 4] == 0) and np.all(dbias[1, :, 10:13] == 0)
    for key in ("out", "dq", "dk", "dv", "dbias"):
        assert not np.any(np.isnan(to_f64(res[key]))), key


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_everything_masked(rng, lib):
    """Every key masked for every row: all outputs and gradients are exactly 0."""
    need_torch(lib, "float32")
    q, k, v, do = inputs(rng, lib, "float32", 1, 7, 9, 2, 1, 16)
    m = bool_array(np.zeros((1, 1, 7, 9), bool), lib)
    bias = extra_array(rng, (7, 9), lib, "float32")
    res = fmha_results(q, k, v, do, mask=m, bias=bias, bias_grad=True)
    assert np.all(np.isneginf(to_f64(res["lse"])))
    for key in ("out", "dq", "dk", "dv", "dbias"):
        assert np.all(to_f64(res[key]) == 0), key


def test_window_with_no_visible_keys(rng):
    """window (0, 0) bottom-right with sq > sk: rows above the diagonal see nothing."""
    q, k, v, do = inputs(rng, "numpy", "float64", 1, 20, 8, 2, 2, 16)
    res, _ = check_against_reference(q, k, v, do, window=(0, 0))
    assert np.all(res["out"][:, :12] == 0) and np.all(np.isneginf(res["lse"][:, :, :12]))


# ============================================================================ varlen

VARLEN_CASES = {
    "mixed": ([5, 1, 17, 9], [7, 1, 3, 20]),
    "equal_q_k": ([13, 1, 30], [13, 1, 30]),
    "single_token_q": ([1, 1, 1], [9, 40, 2]),
}


def _varlen_inputs(rng, lib, dtype, lens_q, lens_k, hq, hkv, d, dv):
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = make_array(rng, (cu_q[-1], hq, d), dtype, lib)
    k = make_array(rng, (cu_k[-1], hkv, d), dtype, lib)
    v = make_array(rng, (cu_k[-1], hkv, dv), dtype, lib)
    do = make_array(rng, (cu_q[-1], hq, dv), dtype, lib)
    if lib == "torch":
        import torch
        cu_q, cu_k = torch.from_numpy(cu_q), torch.from_numpy(cu_k)
    return q, k, v, do, cu_q, cu_k


VARLEN_FEATURES = {
    "plain": {},
    "causal": dict(causal=True),
    "causal_topleft": dict(causal=True, alignment="top_left"),
    "window": dict(window=(3, 1)),
    "alibi_h": dict(alibi="h", causal=True),
    "alibi_b_h": dict(alibi="b_h"),
    "softcap": dict(softcap=2.0),
}


def _varlen_kw(rng, lib, feat, nseq, hq):
    kw = {kk: vv for kk, vv in feat.items() if kk != "alibi"}
    if "alibi" in feat:
        s = rng.uniform(0.05, 0.5, (hq,) if feat["alibi"] == "h" else (nseq, hq))
        kw["alibi_slopes"] = from_f64(s, "float32", lib)
    return kw


@pytest.mark.parametrize("feature", list(VARLEN_FEATURES))
@pytest.mark.parametrize("case", list(VARLEN_CASES))
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_varlen_numpy_forward(rng, dtype, case, feature):
    lens_q, lens_k = VARLEN_CASES[case]
    q, k, v, _, cu_q, cu_k = _varlen_inputs(rng, "numpy", dtype, lens_q, lens_k, 4, 2, 24, 16)
    kw = _varlen_kw(rng, "numpy", VARLEN_FEATURES[feature], len(lens_q), 4)
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
    torch = pytest.importorskip("torch")
    lens_q, lens_k = VARLEN_CASES[case]
    q, k, v, do, cu_q, cu_k = _varlen_inputs(rng, "torch", dtype, lens_q, lens_k, 4, 2, 24, 16)
    kw = _varlen_kw(rng, "torch", VARLEN_FEATURES[feature], len(lens_q), 4)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out, lse = fmha.attention_varlen(*leaves, cu_q, cu_k, max(lens_q), max(lens_k),
                                     return_lse=True, **kw)
    out.backward(do)
    rkw = {kk: to_f64(vv) if kk == "alibi_slopes" else vv for kk, vv in kw.items()}
    args64 = [to_f64(x) for x in (q, k, v)]
    ref_out, ref_lse = reference.attention_varlen_forward(*args64, cu_q.numpy(), cu_k.numpy(),
                                                          **rkw)
    ref_grads = reference.attention_varlen_backward(to_f64(do), *args64, cu_q.numpy(),
                                                    cu_k.numpy(), **rkw)
    naive = {}
    if dtype in LOW_PRECISION:
        naive = _naive_varlen(q, k, v, do, cu_q.numpy(), cu_k.numpy(), **kw)
    results = dict(out=out, lse=lse, dq=leaves[0].grad, dk=leaves[1].grad, dv=leaves[2].grad)
    refs = dict(out=ref_out, lse=ref_lse, dq=ref_grads[0], dk=ref_grads[1], dv=ref_grads[2])
    for key in refs:
        rdt = ("float64" if dtype == "float64" else "float32") if key == "lse" else None
        assert_close(key, results[key], refs[key], dtype, naive=naive.get(key),
                     grad=key.startswith("d"), result_dtype=rdt)


def _naive_varlen(q, k, v, do, cu_q, cu_k, alibi_slopes=None, dropout_z=None, **kw):
    """naive_attention_torch per sequence, in q's dtype; packed results like the reference."""
    import torch
    outs = dict(out=torch.zeros(q.shape[:2] + v.shape[2:], dtype=q.dtype),
                lse=torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=q.dtype),
                dq=torch.zeros_like(q), dk=torch.zeros_like(k), dv=torch.zeros_like(v))
    for bi in range(len(cu_q) - 1):
        sq = slice(int(cu_q[bi]), int(cu_q[bi + 1]))
        sk = slice(int(cu_k[bi]), int(cu_k[bi + 1]))
        if sq.stop == sq.start:
            continue
        sl = None
        if alibi_slopes is not None:
            sl = alibi_slopes if alibi_slopes.ndim == 1 else alibi_slopes[bi]
        z = None if dropout_z is None else dropout_z[bi]
        r = naive_results(q[None, sq], k[None, sk], v[None, sk], do[None, sq],
                          alibi_slopes=sl, dropout_z=z, **kw)
        outs["out"][sq] = r["out"][0]
        outs["lse"][:, sq] = r["lse"][0]
        outs["dq"][sq] = r["dq"][0]
        outs["dk"][sk] = r["dk"][0]
        outs["dv"][sk] = r["dv"][0]
    return outs


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_varlen_dropout_numpy(rng, dtype, causal):
    lens_q, lens_k = [5, 1, 17, 9], [7, 1, 3, 20]
    q, k, v, _, cu_q, cu_k = _varlen_inputs(rng, "numpy", dtype, lens_q, lens_k, 4, 1, 16, 16)
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
    q, k, v, do, cu_q, cu_k = _varlen_inputs(rng, "torch", dtype, lens_q, lens_k, 4, 2, 16, 8)
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
    ref = _naive_varlen(q.double(), k.double(), v.double(), do.double(), cu_q.numpy(),
                        cu_k.numpy(), dropout_z=zs, causal=True)
    naive = _naive_varlen(q, k, v, do, cu_q.numpy(), cu_k.numpy(), dropout_z=zs,
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
    q, k, v, do, cu_q, cu_k = _varlen_inputs(rng, "torch", "float64", lens, lens, 2, 2, 16, 16)
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
    q, k, v, do, cu_q, cu_k = _varlen_inputs(rng, lib, "float64", lens_q, lens_k, hq, 1, 8, 8)
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
    q, k, v, do, cu_q, cu_k = _varlen_inputs(rng, lib, "float64", lens_q, lens_k, 2, 2, 8, 8)
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
    q, k, v, do, cu_q, cu_k = _varlen_inputs(rng, "torch", "float32", lens_q, lens_k, 4, 2, 32, 32)
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
    torch = pytest.importorskip("torch")
    b, sq, sk, hq, hkv = 2, 45, 38, 4, 2
    qn, kn, vn, don = inputs(rng, "numpy", dtype, b, sq, sk, hq, hkv, 40, 24)
    biasn = make_array(rng, (b, 1, sq, sk), dtype, "numpy")
    maskn = rng.random((1, hq, 1, sk)) < 0.85
    slopes = rng.uniform(0.01, 0.2, (hq,)).astype(np.float32)
    kw = dict(causal=True, alignment="top_left", softcap=6.0, window=(20, -1))
    rn = fmha_results(qn, kn, vn, don, bias=biasn, bias_grad=True, mask=maskn,
                      alibi_slopes=slopes, **kw)
    t = torch.from_numpy
    rt = fmha_results(t(qn), t(kn), t(vn), t(don), bias=t(biasn), bias_grad=True,
                      mask=t(maskn), alibi_slopes=t(slopes), **kw)
    for key in ("out", "lse", "dq", "dk", "dv", "dbias"):
        a, b_ = rn[key], rt[key].numpy()
        assert a.dtype == b_.dtype, key
        assert np.array_equal(a, b_), f"{key}: torch and numpy paths differ"


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
