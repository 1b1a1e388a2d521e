"""The correctness cases shared by the backends, and the helpers that build them.

Each ``check_*`` function is one case: it builds its inputs from ``rng`` and checks fmha's
forward and backward against fmha.reference (float64) with conftest's tolerance rule
(docs/testing.md). It calls the public API, so it runs on whatever kernel module is in
place: tests/kernels/test_cpu_attention.py runs the cases on the CPU kernels (every dtype, bigger
shapes); tests/kernels/test_cuda_emu_cases.py runs them on the CUDA kernels, under the emulator
(backend ``emu``) and on a real GPU (backend ``gpu``), with the low-precision dtypes and
the small shapes the emulator can afford (conftest's ``backend`` fixture).

Test modules share cases through this module and conftest, never through each other
(tests/api/test_imports.py checks it).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

import fmha
from conftest import (LOW_PRECISION, assert_close, check_against_reference, fmha_results,
                      from_f64, make_array, make_inputs, naive_results, to_f64)
from fmha import reference
from fmha._core import _kernel_module

# ============================================================================ lib / dtype tables

# (lib, dtype) combinations. numpy has no bfloat16.
ALL_LIB_DTYPES = [("numpy", "float64"), ("numpy", "float32"), ("numpy", "float16"),
                  ("torch", "float64"), ("torch", "float32"), ("torch", "bfloat16"),
                  ("torch", "float16")]
MAIN_LIB_DTYPES = [("numpy", "float64"), ("torch", "float32"), ("torch", "bfloat16"),
                   ("torch", "float16")]
#: The (lib, dtype) pairs the CUDA kernels take.
LOW_LIB_DTYPES = [("numpy", "float16"), ("torch", "bfloat16"), ("torch", "float16")]


def lib_dtype_ids(pairs):
    return [f"{lib}-{dt}" for lib, dt in pairs]


def rotate(values, pairs=LOW_LIB_DTYPES):
    """[(value, lib, dtype)]: each value with the next (lib, dtype) pair, cycling; so a long
    case list sees every pair without running every case on every pair."""
    return [(v,) + p for v, p in zip(values, itertools.cycle(pairs))]


def row_ids(rows):
    return ["-".join(str(x) for x in r) for r in rows]


# ============================================================================ inputs

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


# ============================================================================ dtypes, scale

def check_explicit_scale(rng, lib, dtype, scale):
    q, k, v, do = inputs(rng, lib, dtype, 1, 19, 23, 2, 2, 32)
    check_against_reference(q, k, v, do, scale=scale)


# ============================================================================ online softmax

def score_pattern_inputs(rng, lib, dtype, pattern, b=1, sq=70, sk=300, h=2, d=32):
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


MASKED_TILES = {
    # a narrow band in the middle of a long key axis: whole tiles before and after it masked
    "band_window_bottom_right": dict(window=(10, 10)),
    "band_window_top_left": dict(window=(10, 10), alignment="top_left"),
    # key padding that masks whole leading / trailing tiles
    "leading_keys_masked": dict(mask="leading"),
    "trailing_keys_masked": dict(mask="trailing"),
    # -inf bias on a prefix of the keys of some rows (first tiles give row max -inf)
    "neg_inf_bias_prefix": dict(bias="prefix"),
}


def check_fully_masked_tiles(rng, lib, dtype, case, *, b, sq, sk, h, leading, prefix, band):
    """MASKED_TILES[case] on a key axis of sk: ``leading`` = the masked leading keys of
    batch 0 and 1; ``prefix`` = the -inf bias prefix of every third row of batch 0;
    ``band`` = (head, row slice, keys): the -inf bias band of batch 1."""
    q, k, v, do = inputs(rng, lib, dtype, b, sq, sk, h, 1, 32)
    cfg = dict(MASKED_TILES[case])
    kw = {kk: vv for kk, vv in cfg.items() if kk not in ("mask", "bias")}
    bias = None
    if cfg.get("mask") == "leading":
        m = np.ones((b, 1, 1, sk), bool)
        m[0, ..., :leading[0]] = False
        m[1, ..., :leading[1]] = False
        kw["mask"] = bool_array(m, lib)
    elif cfg.get("mask") == "trailing":
        m = np.ones((b, 1, 1, sk), bool)
        m[0, ..., 3:] = False
        m[1, ..., 65:] = False
        kw["mask"] = bool_array(m, lib)
    elif cfg.get("bias") == "prefix":
        bias64 = rng.standard_normal((b, h, sq, sk))
        bias64[0, :, ::3, :prefix] = -np.inf
        head, rows, keys = band
        bias64[1, head, rows, :keys] = -np.inf
        bias = from_f64(bias64, dtype, lib)
    check_against_reference(q, k, v, do, bias=bias, bias_grad=bias is not None, **kw)


# ============================================================================ causal, lengths

CAUSAL_LENGTHS = [(33, 33), (17, 50), (50, 17), (1, 40), (40, 1)]
CROSS = [(1, 113), (113, 1), (17, 113), (113, 17), (64, 65), (65, 64)]
DV = [(64, 32), (32, 64), (40, 111), (8, 256), (256, 8), (59, 1)]


def check_causal(rng, lib, dtype, sq, sk, alignment):
    q, k, v, do = inputs(rng, lib, dtype, 2, sq, sk, 2, 1, 32)
    check_against_reference(q, k, v, do, causal=True, alignment=alignment)


def check_cross_lengths(rng, lib, dtype, sq, sk):
    q, k, v, do = inputs(rng, lib, dtype, 2, sq, sk, 2, 2, 40)
    check_against_reference(q, k, v, do)


def check_causal_bottom_right_sq_gt_sk_empty_rows(rng, lib, dtype):
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


# ============================================================================ layouts

def layouts_torch(x64, kind, dtype="float64"):
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


def layouts_numpy(x64, kind):
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


def _shapes(b, sq, sk, hq, hkv, d, dv):
    return ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, dv), (b, sq, hq, dv))


def check_noncontiguous_torch(rng, dtype, kind, *, b, sq, sk, hq, hkv, d, dv):
    """Strided views give the reference result and exactly the contiguous call's result."""
    torch = pytest.importorskip("torch")
    q, k, v, do = (layouts_torch(rng.standard_normal(s), kind, dtype)
                   for s in _shapes(b, sq, sk, hq, hkv, d, dv))
    assert not q.is_contiguous() and not k.is_contiguous() and not v.is_contiguous()
    res, _ = check_against_reference(q, k, v, do, causal=True)
    cres = fmha_results(q.contiguous(), k.contiguous(), v.contiguous(), do.contiguous(),
                        causal=True)
    for key in ("out", "lse", "dq", "dk", "dv"):
        assert torch.equal(res[key], cres[key]), key


def check_noncontiguous_numpy(rng, dtype, kind, *, b, sq, sk, hq, hkv, d, dv):
    """As check_noncontiguous_torch, NumPy views (astype keeps the strided layout)."""
    q, k, v, do = (layouts_numpy(rng.standard_normal(s), kind).astype(dtype, copy=False)
                   for s in _shapes(b, sq, sk, hq, hkv, d, dv))
    assert not q.flags.c_contiguous
    res, _ = check_against_reference(q, k, v, do, causal=True, alignment="top_left")
    cres = fmha_results(*(np.ascontiguousarray(x) for x in (q, k, v, do)), causal=True,
                        alignment="top_left")
    for key in ("out", "lse", "dq", "dk", "dv"):
        assert np.array_equal(res[key], cres[key]), key


def check_cross_odd_noncontiguous(rng, lib, dtype, *, b, hq, hkv, d, dv):
    """sq != sk, odd head dims, non-contiguous views, GQA, causal top-left, bias."""
    need_torch(lib, dtype)
    sq, sk = 113, 17
    if lib == "torch":
        conv = lambda x: layouts_torch(x, "sliced", dtype)  # noqa: E731
    else:
        conv = lambda x: layouts_numpy(x, "transposed")  # noqa: E731
    q = conv(rng.standard_normal((b, sq, hq, d)))
    assert not (q.is_contiguous() if lib == "torch" else q.flags.c_contiguous)
    k = conv(rng.standard_normal((b, sk, hkv, d)))
    v = conv(rng.standard_normal((b, sk, hkv, dv)))
    do = conv(rng.standard_normal((b, sq, hq, dv)))
    bias = extra_array(rng, (b, 1, sq, sk), lib, dtype)
    check_against_reference(q, k, v, do, causal=True, alignment="top_left", bias=bias,
                            bias_grad=True)


# ============================================================================ bias, mask

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

MASK_SHAPES = {
    "key_padding_b_1_1_sk": lambda b, h, sq, sk: (b, 1, 1, sk),
    "sq_sk": lambda b, h, sq, sk: (sq, sk),
    "b_h_sq_sk": lambda b, h, sq, sk: (b, h, sq, sk),
    "1_h_1_sk": lambda b, h, sq, sk: (1, h, 1, sk),
    "b_1_sq_sk": lambda b, h, sq, sk: (b, 1, sq, sk),
}


def check_bias_shapes(rng, lib, dtype, shape_name, *, hq, hkv):
    b, sq, sk = 2, 21, 27
    q, k, v, do = inputs(rng, lib, dtype, b, sq, sk, hq, hkv, 32)
    bias = extra_array(rng, BIAS_SHAPES[shape_name](b, hq, sq, sk), lib, dtype, scale=2.0)
    check_against_reference(q, k, v, do, bias=bias, bias_grad=True)


def check_bias_without_grad(rng, lib, dtype):
    """A bias that does not require grad still shifts the scores (and q/k/v grads)."""
    q, k, v, do = inputs(rng, lib, dtype, 2, 17, 19, 2, 2, 32)
    bias = extra_array(rng, (2, 2, 17, 19), lib, dtype, scale=2.0)
    check_against_reference(q, k, v, do, bias=bias, causal=True)


def check_mask_shapes(rng, lib, dtype, shape_name):
    b, sq, sk, hq, hkv = 2, 21, 27, 4, 1
    q, k, v, do = inputs(rng, lib, dtype, b, sq, sk, hq, hkv, 32)
    shape = MASK_SHAPES[shape_name](b, hq, sq, sk)
    m = rng.random(shape) < 0.7
    if shape_name.startswith("key_padding"):
        m = np.ones(shape, bool)
        m[0, ..., 20:] = False          # batch 0 has 20 valid keys, batch 1 all 27
    check_against_reference(q, k, v, do, mask=bool_array(m, lib))


def check_mask_with_fully_masked_rows(rng, lib, dtype):
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


def check_neg_inf_bias_rows(rng, lib, dtype):
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


def check_everything_masked(rng, lib, dtype):
    """Every key masked for every row: outputs and gradients exactly 0, lse -inf."""
    need_torch(lib, dtype)
    q, k, v, do = inputs(rng, lib, dtype, 1, 7, 9, 2, 1, 16)
    m = bool_array(np.zeros((1, 1, 7, 9), bool), lib)
    bias = extra_array(rng, (7, 9), lib, dtype)
    res = fmha_results(q, k, v, do, mask=m, bias=bias, bias_grad=True)
    assert np.all(np.isneginf(to_f64(res["lse"])))
    for key in ("out", "dq", "dk", "dv", "dbias"):
        assert np.all(to_f64(res[key]) == 0), key


# ============================================================================ window, ALiBi, softcap

WINDOWS = [(4, 0), (0, 0), (3, 5), (-1, 2), (7, -1), (0, 3)]
WIN_LENGTHS = [(31, 31), (20, 45), (45, 20)]


def check_window(rng, lib, dtype, sq, sk, window, alignment):
    q, k, v, do = inputs(rng, lib, dtype, 1, sq, sk, 2, 1, 16)
    check_against_reference(q, k, v, do, window=window, alignment=alignment)


def check_window_with_causal(rng, lib, dtype, alignment):
    """causal + a left window: a local causal band."""
    q, k, v, do = inputs(rng, lib, dtype, 2, 40, 53, 2, 2, 32)
    check_against_reference(q, k, v, do, causal=True, window=(6, -1), alignment=alignment)


def check_alibi(rng, lib, dtype, slopes_shape, causal, alignment):
    b, sq, sk, hq, hkv = 2, 24, 37, 4, 2
    q, k, v, do = inputs(rng, lib, dtype, b, sq, sk, hq, hkv, 32)
    base = np.array([2.0 ** (-8 * (i + 1) / hq) for i in range(hq)])
    slopes64 = base if slopes_shape == "h" else base[None] * rng.uniform(0.5, 2.0, (b, 1))
    slopes = from_f64(slopes64, "float32", lib)
    check_against_reference(q, k, v, do, alibi_slopes=slopes, causal=causal, alignment=alignment)


def check_softcap(rng, lib, dtype, softcap):
    q, k, v, do = inputs(rng, lib, dtype, 2, 25, 33, 4, 2, 32)
    # large scale so the cap actually bends the scores
    check_against_reference(q, k, v, do, softcap=softcap, scale=1.5)


# ============================================================================ dropout

def check_dropout_numpy_matches_reference(rng, dtype, p):
    """NumPy: the mask is Philox(seed, offset=0): forward and backward equal the reference
    with the same seed."""
    need_torch("numpy", dtype)
    q, k, v, do = inputs(rng, "numpy", dtype, 2, 23, 37, 4, 2, 24)
    seed = 1234567 + int(p * 10)
    check_against_reference(q, k, v, do, dropout_p=p, seed=seed, ref_kw=dict(seed=seed))


def check_dropout_numpy_seed(rng, dtype, seed):
    """Seeds with high 32-bit words (the Philox key's second word) follow the contract."""
    q, k, v, do = inputs(rng, "numpy", dtype, 1, 9, 14, 2, 1, 8)
    check_against_reference(q, k, v, do, dropout_p=0.3, seed=seed, causal=True,
                            ref_kw=dict(seed=seed))


DROPOUT_SEEDS = [0, 1, 2**32 + 5, 2**63 + 12345, 2**64 - 1]
DROPOUT_SEED_IDS = ["0", "1", "2^32+5", "2^63+12345", "2^64-1"]


def keep_mask_read_back(seed, batch, heads, sq, sk, p, dtype=np.float64, head_dim=4):
    """The dropout mask a NumPy call applies, read back through its output: with q = k = 0
    every probability is 1/sk, and with v = identity over the keys
    out[b, i, h, j] = P[b, h, i, j] * Z[b, h, i, j]. Returns keep (b, h, sq, sk)."""
    q = np.zeros((batch, sq, heads, head_dim), dtype)
    k = np.zeros((batch, sk, heads, head_dim), dtype)
    v = np.broadcast_to(np.eye(sk, dtype=dtype)[None, :, None, :],
                        (batch, sk, heads, sk)).copy()
    out = fmha.attention(q, k, v, dropout_p=p, seed=seed)
    return out.transpose(0, 2, 1, 3) > 0


def recover_dropout_z(q, k, p, torch_seed, **kw):
    """The dropout multiplier a torch call with this torch seed uses, recovered from fmha
    itself: with v = identity over keys, out[b, i, h, j] = P_bhij * Z_bhij.

    Runs in float64 (the mask is a function of (seed, offset, b, h, i, j) only), so on the
    CPU kernels whatever the backend under test (only they take float64); comparing then also
    proves that another backend applies the very mask the CPU path applies for the same torch
    seed. Returns Z (b, hq, sq, sk) and the boolean "known" (P > 0) where Z could be read off.
    """
    import torch
    b, sq, hq, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    q64, k64 = q.detach().double(), k.detach().double()
    eye = torch.eye(sk, dtype=torch.float64)[None, :, None, :].expand(b, sk, hkv, sk).contiguous()
    torch.manual_seed(torch_seed)
    with _kernel_module(fmha._C):
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


def check_torch_dropout(rng, dtype, p, b=2, sq=21, sk=34, hq=4, hkv=2, d=16, dv=24,
                        bias_shape=None, torch_seed=7, **kw):
    """torch: forward and backward use one and the same mask (recovered from an identity-V
    call with the same torch seed), and match a float64 formula with that mask."""
    torch = pytest.importorskip("torch")
    q, k, v, do = inputs(rng, "torch", dtype, b, sq, sk, hq, hkv, d, dv)
    bias = None
    if bias_shape is not None:
        bias = extra_array(rng, bias_shape, "torch", dtype)
        kw["bias"] = bias
    z, known = recover_dropout_z(q, k, p, torch_seed, **kw)
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


def combo_args(rng, lib, dtype, cfg, b=2, sq=29, sk=41):
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


def check_combination_numpy(rng, dtype, combo, dv):
    """COMBOS[combo] through attention + attention_backward (q/k head_dim 40)."""
    need_torch("numpy", dtype)
    cfg = COMBOS[combo]
    q, k, v, do = inputs(rng, "numpy", dtype, 2, 29, 41, cfg["hq"], cfg["hkv"], 40, dv)
    kw = combo_args(rng, "numpy", dtype, cfg)
    seed = 4242
    check_against_reference(q, k, v, do, seed=seed, ref_kw=dict(seed=seed),
                            bias_grad="bias" in kw, **kw)


def check_combination_torch(rng, dtype, combo, dv):
    """COMBOS[combo] through autograd (q/k head_dim 40); with dropout, against the mask
    recovered for the same torch seed."""
    pytest.importorskip("torch")
    cfg = COMBOS[combo]
    kw = combo_args(rng, "torch", dtype, cfg)
    p = kw.pop("dropout_p", 0.0)
    bias = kw.pop("bias", None)
    if p > 0:
        bias_shape = None if bias is None else tuple(bias.shape)
        check_torch_dropout(rng, dtype, p, b=2, sq=29, sk=41, hq=cfg["hq"], hkv=cfg["hkv"],
                            d=40, dv=dv, bias_shape=bias_shape, **kw)
        return
    q, k, v, do = inputs(rng, "torch", dtype, 2, 29, 41, cfg["hq"], cfg["hkv"], 40, dv)
    check_against_reference(q, k, v, do, bias=bias, bias_grad=bias is not None, **kw)


# ============================================================================ varlen

VARLEN_CASES = {
    "mixed": ([5, 1, 17, 9], [7, 1, 3, 20]),
    "equal_q_k": ([13, 1, 30], [13, 1, 30]),
    "single_token_q": ([1, 1, 1], [9, 40, 2]),
}

VARLEN_FEATURES = {
    "plain": {},
    "causal": dict(causal=True),
    "causal_topleft": dict(causal=True, alignment="top_left"),
    "window": dict(window=(3, 1)),
    "alibi_h": dict(alibi="h", causal=True),
    "alibi_b_h": dict(alibi="b_h"),
    "softcap": dict(softcap=2.0),
}


def varlen_inputs(rng, lib, dtype, lens_q, lens_k, hq, hkv, d, dv):
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


def varlen_kw(rng, lib, feat, nseq, hq):
    kw = {kk: vv for kk, vv in feat.items() if kk != "alibi"}
    if "alibi" in feat:
        s = rng.uniform(0.05, 0.5, (hq,) if feat["alibi"] == "h" else (nseq, hq))
        kw["alibi_slopes"] = from_f64(s, "float32", lib)
    return kw


def naive_varlen(q, k, v, do, cu_q, cu_k, alibi_slopes=None, dropout_z=None, **kw):
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


def check_varlen_torch_autograd(rng, dtype, case, feature, *, hq, hkv, d, dv):
    """VARLEN_CASES[case] x VARLEN_FEATURES[feature] through attention_varlen and autograd,
    against the reference (low precision: against naive_varlen's error)."""
    pytest.importorskip("torch")
    lens_q, lens_k = VARLEN_CASES[case]
    q, k, v, do, cu_q, cu_k = varlen_inputs(rng, "torch", dtype, lens_q, lens_k, hq, hkv, d, dv)
    kw = varlen_kw(rng, "torch", VARLEN_FEATURES[feature], len(lens_q), hq)
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
        naive = naive_varlen(q, k, v, do, cu_q.numpy(), cu_k.numpy(), **kw)
    results = dict(out=out, lse=lse, dq=leaves[0].grad, dk=leaves[1].grad, dv=leaves[2].grad)
    refs = dict(out=ref_out, lse=ref_lse, dq=ref_grads[0], dk=ref_grads[1], dv=ref_grads[2])
    for key in refs:
        rdt = ("float64" if dtype == "float64" else "float32") if key == "lse" else None
        assert_close(key, results[key], refs[key], dtype, naive=naive.get(key),
                     grad=key.startswith("d"), result_dtype=rdt)


# ============================================================================ torch vs NumPy

def check_torch_and_numpy_paths_identical(rng, dtype, *, b, d, dv):
    """The NumPy and torch entry points hand the kernels the same call: identical bits."""
    torch = pytest.importorskip("torch")
    sq, sk, hq, hkv = 45, 38, 4, 2
    qn, kn, vn, don = inputs(rng, "numpy", dtype, b, sq, sk, hq, hkv, d, dv)
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


# ============================================================================ Philox vectors

# Known-answer vectors of Random123 (D. E. Shaw Research).
# Columns: counter (4 words), key (2 words), expected output (4 words), hex.
#
# The first three are the "philox4x32 10" lines of Random123's tests/kat_vectors
# (https://github.com/DEShawResearch/random123, tests/kat_vectors; the same three
# lines are quoted in many ports of the generator).
# The others are "philox4x32 10" lines of examples/kat_vectors in
# https://github.com/girving/random123-manual (commit 61e8479252c42f0f8c0490dec55237d7c01bf509),
# generated by Random123's gentests.py.
PHILOX4X32_10_KAT = """
00000000 00000000 00000000 00000000   00000000 00000000   6627e8d5 e169c58d bc57ac4c 9b00dbd8
ffffffff ffffffff ffffffff ffffffff   ffffffff ffffffff   408f276d 41c83b0e a20bc7c6 6d5451fd
243f6a88 85a308d3 13198a2e 03707344   a4093822 299f31d0   d16cfe09 94fdcceb 5001e420 24126ea1
00000001 00000000 00000000 00000000   00000001 00000000   ac08141b dfc5ccbe 79c07a47 a7f66093
243f6a88 85a308d3 13198a2e 03707344   00000001 00000000   38527b8f fad9a48c 20e675c0 f2fea26a
00000000 00000000 00000000 80000000   00000000 ffffffff   2a460458 0a2709e5 47bc9115 0f96d8af
452821e6 38d01377 be5466cf 34e90c6c   00000000 80000000   94ca5566 14924b2f 28214292 59faeaee
"""


def kat_rows():
    """[(counter, key, expected)] of PHILOX4X32_10_KAT, as lists of ints."""
    rows = []
    for line in PHILOX4X32_10_KAT.strip().splitlines():
        words = [int(w, 16) for w in line.split()]
        rows.append((words[0:4], words[4:6], words[6:10]))
    return rows
