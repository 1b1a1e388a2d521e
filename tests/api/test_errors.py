"""Bad inputs: every one is refused with a ValueError / TypeError naming the argument.

The error conventions (docs/errors.md): every bad input is caught in the Python layer (and
again in C++) and raised as ValueError/TypeError naming the argument; no bad input may
crash the process, hang, write out of bounds or return garbage.

Each case below is one bad call; it runs for NumPy arrays and torch tensors where the
distinction means something. After each failure the inputs must be untouched, and a valid
call afterwards must still give the right answer. The C++ layer is also called directly
(in a subprocess, so that a crash shows up as a failed test rather than a dead pytest).
"""

import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import fmha
from fmha import _validate, reference

try:
    import torch
    import fmha._torch  # noqa: F401  (registers the ops even if fmha was imported first)
except ImportError:  # pragma: no cover
    torch = None

LIBS = ["numpy", pytest.param("torch", marks=pytest.mark.skipif(torch is None,
                                                                 reason="torch not installed"))]

B, SQ, SK, HQ, HKV, D = 2, 5, 6, 4, 2, 8
TOTAL_Q, TOTAL_K = 7, 9
CU_Q, CU_K = [0, 3, 7], [0, 4, 9]


def arr(lib, shape, dtype="float32", seed=0):
    """Random array of the given shape (dtype is a NumPy dtype name, or "bool"/"int32")."""
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        x = rng.random(shape) < 0.7
    elif np.dtype(dtype).kind in "iu":
        x = rng.integers(0, 5, size=shape).astype(dtype)
    else:
        x = rng.standard_normal(shape).astype(dtype)
    return x if lib == "numpy" else torch.from_numpy(x)


def other(lib):
    return "torch" if lib == "numpy" else "numpy"


def qkv(lib, dtype="float32", q=None, k=None, v=None):
    return (arr(lib, (B, SQ, HQ, D), dtype, 1) if q is None else q,
            arr(lib, (B, SK, HKV, D), dtype, 2) if k is None else k,
            arr(lib, (B, SK, HKV, D), dtype, 3) if v is None else v)


def att(lib, q=None, k=None, v=None, **kw):
    """A call of fmha.attention on the standard shapes, with some arguments replaced."""
    return fmha.attention, qkv(lib, q=q, k=k, v=v), kw


def varlen(lib, q=None, k=None, v=None, cu_q="default", cu_k="default", **kw):
    q = arr(lib, (TOTAL_Q, HQ, D), seed=4) if q is None else q
    k = arr(lib, (TOTAL_K, HKV, D), seed=5) if k is None else k
    v = arr(lib, (TOTAL_K, HKV, D), seed=6) if v is None else v
    cu_q = cu(lib, CU_Q) if isinstance(cu_q, str) else cu_q
    cu_k = cu(lib, CU_K) if isinstance(cu_k, str) else cu_k
    return fmha.attention_varlen, (q, k, v, cu_q, cu_k), kw


def cu(lib, values, dtype="int32"):
    x = np.asarray(values, dtype=dtype)
    return x if lib == "numpy" else torch.from_numpy(x)


def bwd(**over):
    """A call of fmha.attention_backward (NumPy only) with some arguments replaced."""
    q, k, v = qkv("numpy")
    kw = {key: val for key, val in over.items()
          if key not in ("dout", "q", "k", "v", "out", "lse")}
    fwd_kw = {key: val for key, val in kw.items() if key not in ("seed", "bias_grad")}
    out, lse = fmha.attention(q, k, v, return_lse=True, seed=0, **fwd_kw)
    args = dict(dout=np.ones_like(out), q=q, k=k, v=v, out=out, lse=lse)
    for key in args:
        if key in over:
            args[key] = over[key]
    return fmha.attention_backward, tuple(args.values()), kw


def vbwd(cu_q="default", cu_k="default", **over):
    """A call of fmha.attention_varlen_backward (NumPy only) with some arguments replaced."""
    _, (q, k, v, good_q, good_k), _ = varlen("numpy")
    kw = {key: val for key, val in over.items() if key not in ("dout", "out", "lse")}
    fwd_kw = {key: val for key, val in kw.items() if key not in ("seed", "bias_grad")}
    out, lse = fmha.attention_varlen(q, k, v, good_q, good_k, return_lse=True, seed=0,
                                     **fwd_kw)
    args = dict(dout=np.ones_like(out), q=q, k=k, v=v, out=out, lse=lse,
                cu_q=good_q if isinstance(cu_q, str) else cu_q,
                cu_k=good_k if isinstance(cu_k, str) else cu_k)
    for key in ("dout", "out", "lse"):
        if key in over:
            args[key] = over[key]
    return fmha.attention_varlen_backward, tuple(args.values()), kw


# Each case: (id, builder(lib) -> (fn, args, kwargs), exception type(s), match, libs).
# `match` is searched in the message; it names the offending argument.
VE, TE = ValueError, TypeError
BOTH, NP, TORCH = ("numpy", "torch"), ("numpy",), ("torch",)

CASES = [
    # --- ranks
    ("q_ndim_3", lambda L: att(L, q=arr(L, (B, SQ, HQ))), VE, r"^q:", BOTH),
    ("q_ndim_5", lambda L: att(L, q=arr(L, (1, B, SQ, HQ, D))), VE, r"^q:", BOTH),
    ("k_ndim_3", lambda L: att(L, k=arr(L, (B, SK, HKV * D))), VE, r"^k:", BOTH),
    ("v_ndim_2", lambda L: att(L, v=arr(L, (B * SK, HKV * D))), VE, r"^v:", BOTH),
    # --- shapes that do not agree
    ("batch_mismatch_k", lambda L: att(L, k=arr(L, (B + 1, SK, HKV, D))), VE, r"^k, v: batch",
     BOTH),
    ("batch_mismatch_v", lambda L: att(L, v=arr(L, (B + 1, SK, HKV, D))), VE, r"^k, v: batch",
     BOTH),
    ("head_dim_q_vs_k", lambda L: att(L, k=arr(L, (B, SK, HKV, D + 1))), VE, r"^k: head_dim",
     BOTH),
    ("v_seqlen_vs_k", lambda L: att(L, v=arr(L, (B, SK + 1, HKV, D))), VE, r"^v: seqlen", BOTH),
    ("v_heads_vs_k", lambda L: att(L, v=arr(L, (B, SK, HKV + 1, D))), VE, r"^v: .*heads", BOTH),
    ("heads_not_multiple", lambda L: att(L, q=arr(L, (B, SQ, 3, D))), VE, r"^q, k: heads_q",
     BOTH),
    # --- dtypes
    ("dtype_mismatch_k", lambda L: att(L, k=arr(L, (B, SK, HKV, D), "float64")), TE, r"^k: dtype",
     BOTH),
    ("dtype_mismatch_v", lambda L: att(L, v=arr(L, (B, SK, HKV, D), "float16")), TE, r"^v: dtype",
     BOTH),
    ("int_q", lambda L: (fmha.attention, qkv(L, "int32"), {}), TE, r"^q: .*int32", BOTH),
    ("int64_k", lambda L: att(L, k=arr(L, (B, SK, HKV, D), "int64")), TE, r"^k:", BOTH),
    ("bool_q", lambda L: att(L, q=arr(L, (B, SQ, HQ, D), "bool")), TE, r"^q: .*bool", BOTH),
    # --- empty dimensions: batch, seqlen and heads may be 0 (tests/api/test_empty.py); an empty
    # head dimension may not, nor query heads without kv heads
    ("head_dim_0", lambda L: (fmha.attention, (arr(L, (B, SQ, HQ, 0)), arr(L, (B, SK, HKV, 0)),
                                             arr(L, (B, SK, HKV, 0))), {}), VE,
     r"^q: head_dim must be >= 1", BOTH),
    ("head_dim_v_0", lambda L: att(L, v=arr(L, (B, SK, HKV, 0))), VE,
     r"^v: head_dim must be >= 1", BOTH),
    ("heads_kv_0", lambda L: att(L, k=arr(L, (B, SK, 0, D)), v=arr(L, (B, SK, 0, D))), VE,
     r"^q, k: heads_q \(4\) must be a multiple of heads_kv \(0\)", BOTH),
    # --- head_dim over the CPU limit
    ("head_dim_over_limit", lambda L: (fmha.attention, (
        arr(L, (1, 2, 1, _validate.MAX_HEAD_DIM_CPU + 1)),
        arr(L, (1, 2, 1, _validate.MAX_HEAD_DIM_CPU + 1)),
        arr(L, (1, 2, 1, 8))), {}), VE, r"^q: head_dim", BOTH),
    ("head_dim_v_over_limit", lambda L: (fmha.attention, (
        arr(L, (1, 2, 1, 8)), arr(L, (1, 2, 1, 8)),
        arr(L, (1, 2, 1, _validate.MAX_HEAD_DIM_CPU + 1))), {}), VE, r"^v: head_dim", BOTH),
    # --- not arrays
    ("q_list", lambda L: att(L, q=np.zeros((B, SQ, HQ, D), np.float32).tolist()), TE, r"^q:",
     BOTH),
    ("q_none", lambda L: (fmha.attention, (None,) + qkv(L)[1:], {}),
     TE, r"^q:", BOTH),
    ("k_none", lambda L: (fmha.attention, (qkv(L)[0], None, qkv(L)[2]), {}), TE, r"^k:", BOTH),
    ("v_scalar", lambda L: (fmha.attention, qkv(L)[:2] + (3.0,), {}), TE, r"^v:", BOTH),
    ("q_scalar", lambda L: (fmha.attention, (1.5,) + qkv(L)[1:], {}), TE, r"^q:", BOTH),
    ("k_string", lambda L: (fmha.attention, (qkv(L)[0], "k", qkv(L)[2]), {}), TE, r"^k:", BOTH),
    # --- NumPy and torch mixed
    ("mix_k_other_lib", lambda L: att(L, k=arr(other(L), (B, SK, HKV, D))), TE, r"^k:", BOTH),
    ("mix_v_other_lib", lambda L: att(L, v=arr(other(L), (B, SK, HKV, D))), TE, r"^v:", BOTH),
    ("mix_bias_other_lib", lambda L: att(L, bias=arr(other(L), (SQ, SK))), TE, r"^bias:", BOTH),
    ("mix_mask_other_lib", lambda L: att(L, mask=arr(other(L), (SQ, SK), "bool")), TE, r"^mask:",
     BOTH),
    # --- scale
    ("scale_nan", lambda L: att(L, scale=float("nan")), VE, r"^scale:", BOTH),
    ("scale_inf", lambda L: att(L, scale=math.inf), VE, r"^scale:", BOTH),
    ("scale_neg_inf", lambda L: att(L, scale=-math.inf), VE, r"^scale:", BOTH),
    ("scale_string", lambda L: att(L, scale="0.5"), TE, r"^scale:", BOTH),
    ("scale_bool", lambda L: att(L, scale=True), TE, r"^scale:", BOTH),
    # --- softcap
    ("softcap_negative", lambda L: att(L, softcap=-1.0), VE, r"^softcap:", BOTH),
    ("softcap_nan", lambda L: att(L, softcap=float("nan")), VE, r"^softcap:", BOTH),
    ("softcap_inf", lambda L: att(L, softcap=math.inf), VE, r"^softcap:", BOTH),
    # --- dropout_p
    ("dropout_negative", lambda L: att(L, dropout_p=-0.1), VE, r"^dropout_p:", BOTH),
    ("dropout_one", lambda L: att(L, dropout_p=1.0), VE, r"^dropout_p:", BOTH),
    ("dropout_above_one", lambda L: att(L, dropout_p=1.5), VE, r"^dropout_p:", BOTH),
    ("dropout_nan", lambda L: att(L, dropout_p=float("nan")), VE, r"^dropout_p:", BOTH),
    ("dropout_string", lambda L: att(L, dropout_p="0.1"), TE, r"^dropout_p:", BOTH),
    # --- num_splits (CUDA forward key splits; validated on every device)
    ("num_splits_negative", lambda L: att(L, num_splits=-1), VE, r"^num_splits:", BOTH),
    ("num_splits_too_big", lambda L: att(L, num_splits=2**31), VE, r"^num_splits:", BOTH),
    ("num_splits_float", lambda L: att(L, num_splits=2.0), TE, r"^num_splits:", BOTH),
    ("num_splits_bool", lambda L: att(L, num_splits=True), TE, r"^num_splits:", BOTH),
    ("num_splits_string", lambda L: att(L, num_splits="2"), TE, r"^num_splits:", BOTH),
    ("num_splits_none", lambda L: att(L, num_splits=None), TE, r"^num_splits:", BOTH),
    ("varlen_num_splits_negative", lambda L: varlen(L, num_splits=-2), VE, r"^num_splits:",
     BOTH),
    ("varlen_num_splits_bool", lambda L: varlen(L, num_splits=False), TE, r"^num_splits:",
     BOTH),
    # --- window / causal / alignment
    ("window_left_below_minus_1", lambda L: att(L, window=(-2, 0)), VE, r"^window\[0\]:", BOTH),
    ("window_right_below_minus_1", lambda L: att(L, window=(0, -5)), VE, r"^window\[1\]:", BOTH),
    ("window_three_entries", lambda L: att(L, window=(1, 2, 3)), TE, r"^window:", BOTH),
    ("window_one_entry", lambda L: att(L, window=(1,)), TE, r"^window:", BOTH),
    ("window_int", lambda L: att(L, window=3), TE, r"^window:", BOTH),
    ("window_float_left", lambda L: att(L, window=(1.0, 2)), TE, r"^window\[0\]:", BOTH),
    ("window_float_right", lambda L: att(L, window=(1, 2.5)), TE, r"^window\[1\]:", BOTH),
    ("window_none_entry", lambda L: att(L, window=(None, 0)), TE, r"^window\[0\]:", BOTH),
    ("causal_string", lambda L: att(L, causal="yes"), TE, r"^causal:", BOTH),
    ("causal_none", lambda L: att(L, causal=None), TE, r"^causal:", BOTH),
    ("alignment_typo", lambda L: att(L, alignment="bottom-right"), VE, r"^alignment:", BOTH),
    ("alignment_none", lambda L: att(L, alignment=None), VE, r"^alignment:", BOTH),
    # --- bias
    ("bias_not_broadcast", lambda L: att(L, bias=arr(L, (B, HQ, SQ, SK + 1))), VE,
     r"^bias: .*broadcast", BOTH),
    ("bias_heads_not_broadcast", lambda L: att(L, bias=arr(L, (HKV, SQ, SK))), VE, r"^bias:",
     BOTH),
    ("bias_int", lambda L: att(L, bias=arr(L, (SQ, SK), "int32")), TE, r"^bias:", BOTH),
    ("bias_bool", lambda L: att(L, bias=arr(L, (SQ, SK), "bool")), TE, r"^bias:", BOTH),
    ("bias_5d", lambda L: att(L, bias=arr(L, (1, B, HQ, SQ, SK))), VE, r"^bias:", BOTH),
    ("bias_list", lambda L: att(L, bias=[[0.0] * SK] * SQ), TE, r"^bias:", BOTH),
    # --- mask
    ("mask_float", lambda L: att(L, mask=arr(L, (SQ, SK))), TE, r"^mask:", BOTH),
    ("mask_uint8", lambda L: att(L, mask=arr(L, (SQ, SK), "uint8")), TE, r"^mask:", BOTH),
    ("mask_not_broadcast", lambda L: att(L, mask=arr(L, (SQ + 1, SK), "bool")), VE,
     r"^mask: .*broadcast", BOTH),
    ("mask_5d", lambda L: att(L, mask=arr(L, (1, B, HQ, SQ, SK), "bool")), VE, r"^mask:", BOTH),
    # --- alibi_slopes
    ("alibi_wrong_heads", lambda L: att(L, alibi_slopes=arr(L, (HQ + 1,))), VE,
     r"^alibi_slopes:", BOTH),
    ("alibi_kv_heads", lambda L: att(L, alibi_slopes=arr(L, (HKV,))), VE, r"^alibi_slopes:",
     BOTH),
    ("alibi_wrong_batch", lambda L: att(L, alibi_slopes=arr(L, (B + 1, HQ))), VE,
     r"^alibi_slopes:", BOTH),
    ("alibi_3d", lambda L: att(L, alibi_slopes=arr(L, (B, HQ, 1))), VE, r"^alibi_slopes:", BOTH),
    ("alibi_int", lambda L: att(L, alibi_slopes=arr(L, (HQ,), "int32")), TE, r"^alibi_slopes:",
     BOTH),
    # --- varlen
    ("varlen_q_4d", lambda L: varlen(L, q=arr(L, (1, TOTAL_Q, HQ, D))), VE, r"^q:", BOTH),
    ("varlen_cu_int64", lambda L: varlen(L, cu_q=cu(L, CU_Q, "int64")), TE, r"^cu_seqlens_q:",
     BOTH),
    ("varlen_cu_float", lambda L: varlen(L, cu_k=cu(L, CU_K, "float32")), TE, r"^cu_seqlens_k:",
     BOTH),
    ("varlen_cu_not_monotone", lambda L: varlen(L, cu_q=cu(L, [0, 5, 3, 7]),
                                                cu_k=cu(L, [0, 3, 4, 9])), VE,
     r"^cu_seqlens_q: .*non-decreasing", BOTH),
    ("varlen_cu_not_zero_start", lambda L: varlen(L, cu_k=cu(L, [1, 4, 9])), VE,
     r"^cu_seqlens_k: .*start at 0", BOTH),
    ("varlen_cu_wrong_end", lambda L: varlen(L, cu_q=cu(L, [0, 3, 6])), VE,
     r"^cu_seqlens_q: .*packed length", BOTH),
    ("varlen_cu_past_end", lambda L: varlen(L, cu_k=cu(L, [0, 4, 10])), VE,
     r"^cu_seqlens_k: .*packed length", BOTH),
    ("varlen_cu_lengths_differ", lambda L: varlen(L, cu_k=cu(L, [0, 2, 4, 9])), VE,
     r"cu_seqlens_q, cu_seqlens_k", BOTH),
    ("varlen_cu_no_entry", lambda L: varlen(L, cu_q=cu(L, [])), VE,
     r"^cu_seqlens_q: expected batch \+ 1 >= 1 entries", BOTH),
    ("varlen_cu_2d", lambda L: varlen(L, cu_q=cu(L, [[0, 3, 7]])), VE, r"^cu_seqlens_q:", BOTH),
    ("varlen_max_seqlen_q_small", lambda L: varlen(L, max_seqlen_q=3), VE,
     r"^max_seqlen_q: .*longest", BOTH),
    ("varlen_max_seqlen_k_small", lambda L: varlen(L, max_seqlen_k=4), VE,
     r"^max_seqlen_k: .*longest", BOTH),
    ("varlen_max_seqlen_float", lambda L: varlen(L, max_seqlen_q=4.0), TE, r"^max_seqlen_q:",
     BOTH),
    ("varlen_missing_cu_k", lambda L: varlen(L, cu_k=None), VE, r"^cu_seqlens_k:", BOTH),
    ("varlen_missing_cu_q", lambda L: varlen(L, cu_q=None), VE, r"^cu_seqlens_q:", BOTH),
    ("varlen_v_tokens", lambda L: varlen(L, v=arr(L, (TOTAL_K + 1, HKV, D))), VE, r"^v:", BOTH),
    ("varlen_cu_list", lambda L: varlen(L, cu_q=CU_Q), TE, r"^cu_seqlens_q:", BOTH),
    # --- attention_backward (NumPy)
    ("bwd_dout_shape", lambda L: bwd(dout=np.ones((B, SQ, HQ, D + 1), np.float32)), VE,
     r"^dout:", NP),
    ("bwd_dout_dtype", lambda L: bwd(dout=np.ones((B, SQ, HQ, D), np.float64)), VE, r"^dout:",
     NP),
    ("bwd_dout_list", lambda L: bwd(dout=[1.0]), TE, r"^dout:", NP),
    ("bwd_out_shape", lambda L: bwd(out=np.ones((B, SQ, HQ, D - 1), np.float32),
                                    dout=np.ones((B, SQ, HQ, D - 1), np.float32)), VE,
     r"^out:", NP),
    ("bwd_lse_dtype", lambda L: bwd(lse=np.zeros((B, HQ, SQ), np.float64)), VE, r"^lse:", NP),
    ("bwd_lse_shape", lambda L: bwd(lse=np.zeros((B, SQ, HQ), np.float32)), VE, r"^lse:", NP),
    ("bwd_dropout_no_seed", lambda L: bwd(dropout_p=0.2), VE, r"^seed:", NP),
    ("bwd_bias_grad_no_bias", lambda L: bwd(bias_grad=True), VE, r"^bias_grad:", NP),
    ("bwd_bad_window", lambda L: (
        fmha.attention_backward, bwd()[1], dict(window=(-3, 0))), VE, r"^window\[0\]:", NP),
    ("bwd_torch_tensors", lambda L: (fmha.attention_backward,
                                     tuple(torch.from_numpy(np.ascontiguousarray(a))
                                           for a in bwd()[1]), {}), TE, r"^q:", TORCH),
    # --- attention_varlen_backward (NumPy)
    ("vbwd_lse_dense_shape", lambda L: vbwd(lse=np.zeros((2, HQ, 5), np.float32)), VE,
     r"^lse:", NP),
    ("vbwd_dout_shape", lambda L: vbwd(dout=np.ones((TOTAL_Q, HQ, D + 1), np.float32)), VE,
     r"^dout:", NP),
    ("vbwd_out_dtype", lambda L: vbwd(out=np.ones((TOTAL_Q, HQ, D), np.float64)), VE,
     r"^out:", NP),
    ("vbwd_cu_not_monotone", lambda L: vbwd(cu_q=cu(L, [0, 5, 3, 7]),
                                            cu_k=cu(L, [0, 3, 4, 9])), VE,
     r"^cu_seqlens_q: .*non-decreasing", NP),
    ("vbwd_missing_cu_k", lambda L: vbwd(cu_k=None), VE, r"^cu_seqlens_k:", NP),
    ("vbwd_dropout_no_seed", lambda L: vbwd(dropout_p=0.2), VE, r"^seed:", NP),
    ("vbwd_bias_grad_no_bias", lambda L: vbwd(bias_grad=True), VE, r"^bias_grad:", NP),
    ("vbwd_torch_tensors", lambda L: (fmha.attention_varlen_backward,
                                      tuple(torch.from_numpy(np.ascontiguousarray(a))
                                            for a in vbwd()[1]), {}), TE, r"^q:", TORCH),
    # --- seed (NumPy dropout)
    ("seed_negative", lambda L: att(L, dropout_p=0.1, seed=-1), VE, r"^seed:", NP),
    ("seed_string", lambda L: att(L, dropout_p=0.1, seed="42"), VE, r"^seed:", NP),
    ("seed_too_big", lambda L: att(L, dropout_p=0.1, seed=2**64), VE, r"^seed:", NP),
    # --- devices (torch)
    ("k_on_meta", lambda L: att(L, k=torch.empty((B, SK, HKV, D), device="meta")), VE,
     r"^k: .*device", TORCH),
    ("q_on_meta_unsupported", lambda L: (fmha.attention, tuple(
        torch.empty(s, device="meta") for s in ((B, SQ, HQ, D), (B, SK, HKV, D),
                                                 (B, SK, HKV, D))), {}),
     NotImplementedError, r"^q: .*device", TORCH),
    # --- set_num_threads
    ("threads_zero", lambda L: (fmha.set_num_threads, (0,), {}), VE, r"^n:", NP),
    ("threads_negative", lambda L: (fmha.set_num_threads, (-2,), {}), VE, r"^n:", NP),
    ("threads_float", lambda L: (fmha.set_num_threads, (2.0,), {}), VE, r"^n:", NP),
    ("threads_bool", lambda L: (fmha.set_num_threads, (True,), {}), VE, r"^n:", NP),
]


def _params():
    out = []
    for cid, build, exc, match, libs in CASES:
        for lib in libs:
            needs_torch = lib == "torch" or cid.startswith("mix_")
            marks = [pytest.mark.skipif(torch is None, reason="torch not installed")] \
                if needs_torch else []
            out.append(pytest.param(build, lib, exc, match, id=f"{cid}-{lib}", marks=marks))
    return out


def _build(build, lib):
    """(args, kwargs) of the bad call, and a thunk that makes it."""
    fn, args, kwargs = build(lib)
    return (args, kwargs), (lambda: fn(*args, **kwargs))


def _snapshot(obj):
    """A deep copy of every array reachable from args/kwargs."""
    if isinstance(obj, np.ndarray):
        return ("np", obj.copy(), obj.flags.writeable)
    if torch is not None and isinstance(obj, torch.Tensor):
        return ("torch", obj if obj.device.type == "meta" else obj.detach().clone(),
                obj.requires_grad)
    if isinstance(obj, (tuple, list)):
        return ("seq", [_snapshot(x) for x in obj])
    if isinstance(obj, dict):
        return ("dict", {k: _snapshot(x) for k, x in obj.items()})
    return ("other", obj)


def _assert_unchanged(obj, snap):
    tag = snap[0]
    if tag == "np":
        assert obj.flags.writeable == snap[2]
        np.testing.assert_array_equal(obj, snap[1])
    elif tag == "torch":
        if obj.device.type != "meta":
            assert obj.requires_grad == snap[2]
            assert torch.equal(obj, snap[1])
    elif tag == "seq":
        for x, s in zip(obj, snap[1]):
            _assert_unchanged(x, s)
    elif tag == "dict":
        for k, s in snap[1].items():
            _assert_unchanged(obj[k], s)


@pytest.fixture
def keep_thread_setting():
    before = fmha._core._num_threads
    yield
    fmha._core._num_threads = before


@pytest.mark.parametrize("build,lib,exc,match", _params())
def test_bad_input_raises_naming_argument(build, lib, exc, match, keep_thread_setting):
    threads_before = fmha.get_num_threads()
    inputs, thunk = _build(build, lib)
    snap = _snapshot(inputs)
    with pytest.raises(exc, match=match) as info:
        thunk()
    # Only the documented kinds of error (NotImplementedError is reserved for devices).
    assert type(info.value) in (ValueError, TypeError, NotImplementedError)
    if type(info.value) is NotImplementedError:
        assert "device" in str(info.value)
    # A failed call must not touch its inputs.
    _assert_unchanged(inputs, snap)
    # A failed set_num_threads leaves the setting alone.
    assert fmha.get_num_threads() == threads_before


def test_at_least_30_distinct_bad_inputs():
    assert len({c[0] for c in CASES}) >= 30


def _valid_call(lib, dtype="float32"):
    q, k, v = qkv(lib, dtype)
    bias = arr(lib, (HQ, SQ, SK), dtype, 7)
    mask = arr(lib, (B, 1, SQ, SK), "bool", 8)
    mask[..., 0] = True
    out, lse = fmha.attention(q, k, v, causal=True, bias=bias, mask=mask, return_lse=True)
    if lib == "torch":
        out, lse = out.numpy(), lse.numpy()
    return out, lse, (q, k, v, bias, mask)


@pytest.mark.parametrize("lib", LIBS)
def test_valid_call_after_every_failure(lib):
    """Run every bad call in a row, then a valid call: same bits as before, and right."""
    out0, lse0, _ = _valid_call(lib)
    before = fmha._core._num_threads
    failures = 0
    try:
        for cid, build, exc, match, libs in CASES:
            for L in libs:
                if (L == "torch" or cid.startswith("mix_")) and torch is None:
                    continue
                with pytest.raises((ValueError, TypeError, NotImplementedError)):
                    _build(build, L)[1]()
                failures += 1
    finally:
        fmha._core._num_threads = before
    assert failures >= 30
    out1, lse1, (q, k, v, bias, mask) = _valid_call(lib)
    np.testing.assert_array_equal(out1, out0)
    np.testing.assert_array_equal(lse1, lse0)
    if lib == "torch":
        q, k, v, bias, mask = (x.numpy() for x in (q, k, v, bias, mask))
    ref_out, ref_lse = reference.attention_forward(q, k, v, causal=True, bias=bias, mask=mask)
    np.testing.assert_allclose(out1, ref_out, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(lse1, ref_lse, rtol=1e-4, atol=1e-5)


def test_read_only_numpy_inputs():
    """NumPy arrays with writeable=False (and read-only broadcast views) are valid inputs."""
    q, k, v = qkv("numpy", "float64")
    bias = np.broadcast_to(arr("numpy", (SQ, SK), "float64", 9), (B, HQ, SQ, SK))
    mask = arr("numpy", (SQ, SK), "bool", 10)
    mask[:, -1] = True
    slopes = np.array([0.5, 0.25, 0.125, 0.0625])
    for x in (q, k, v, mask, slopes):
        x.flags.writeable = False
    assert not bias.flags.writeable
    kw = dict(bias=bias, mask=mask, alibi_slopes=slopes, softcap=3.0)
    out, lse = fmha.attention(q, k, v, return_lse=True, **kw)
    ref_out, ref_lse = reference.attention_forward(q, k, v, **kw)
    np.testing.assert_allclose(out, ref_out, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-10, atol=1e-12)

    dout = arr("numpy", out.shape, "float64", 11)
    out.flags.writeable = False
    lse.flags.writeable = False
    dout.flags.writeable = False
    dq, dk, dv, dbias = fmha.attention_backward(dout, q, k, v, out, lse, bias_grad=True, **kw)
    rdq, rdk, rdv, rdbias = reference.attention_backward(dout, q, k, v, **kw)
    for got, want in ((dq, rdq), (dk, rdk), (dv, rdv), (dbias, rdbias)):
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-11)

    qv = arr("numpy", (TOTAL_Q, HQ, D), "float64", 4)
    kv_ = arr("numpy", (TOTAL_K, HKV, D), "float64", 5)
    vv = arr("numpy", (TOTAL_K, HKV, D), "float64", 6)
    cq, ck = np.array(CU_Q, np.int32), np.array(CU_K, np.int32)
    for x in (qv, kv_, vv, cq, ck):
        x.flags.writeable = False
    outv = fmha.attention_varlen(qv, kv_, vv, cq, ck, causal=True)
    refv, _ = reference.attention_varlen_forward(qv, kv_, vv, cq, ck, causal=True)
    np.testing.assert_allclose(outv, refv, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- the C++ layer directly

_CORE_PRELUDE = textwrap.dedent("""
    import numpy as np
    from numpy.lib.stride_tricks import as_strided
    from fmha import _C
    S = dict(scale=0.35, softcap=0.0, window_left=-1, window_right=-1, bottom_right=True,
             dropout_p=0.0, seed=0, offset=0, num_threads=2)
    rng = np.random.default_rng(0)
    def r(*s, dt=np.float32):
        return rng.standard_normal(s).astype(dt)
    def z(*s, dt=np.float32):
        return np.zeros(s, dt)
    def empty_dense(*s, dt=np.float32):
        # a zero-size array with C-contiguous strides (NumPy gives size-0 arrays 0 strides)
        st, acc = [], np.dtype(dt).itemsize
        for n in reversed(s):
            st.insert(0, acc); acc *= max(n, 1)
        return as_strided(np.zeros(1, dt), shape=s, strides=st)
    q, k, v = r(2, 5, 4, 8), r(2, 6, 2, 8), r(2, 6, 2, 8)
    out, lse = z(2, 5, 4, 8), z(2, 4, 5)
""")

# (id, statement, expected message fragment). Each statement must raise ValueError (or
# TypeError for things that are not arrays); nothing may crash.
CORE_CASES = [
    ("out_too_small", "_C.forward(q, k, v, z(2, 4, 4, 8), lse, **S)", "out"),
    ("out_too_small_head_dim", "_C.forward(q, k, v, z(2, 5, 4, 4), lse, **S)", "out"),
    ("lse_wrong_shape", "_C.forward(q, k, v, out, z(2, 5, 4), **S)", "lse"),
    ("lse_too_small", "_C.forward(q, k, v, out, z(2, 4, 4), **S)", "lse"),
    ("lse_wrong_dtype", "_C.forward(q, k, v, out, z(2, 4, 5, dt=np.float64), **S)", "lse"),
    ("out_wrong_dtype", "_C.forward(q, k, v, z(2, 5, 4, 8, dt=np.float64), lse, **S)", "out"),
    ("heads_not_multiple", "_C.forward(r(2, 5, 3, 8), k, v, z(2, 5, 3, 8), z(2, 3, 5), **S)",
     "heads"),
    ("heads_kv_zero", "_C.forward(q, empty_dense(2, 6, 0, 8), empty_dense(2, 6, 0, 8), out, "
                      "lse, **S)", "heads"),
    ("k_batch_mismatch", "_C.forward(q, r(3, 6, 2, 8), r(3, 6, 2, 8), out, lse, **S)", "k"),
    ("v_seqlen_mismatch", "_C.forward(q, k, r(2, 7, 2, 8), out, lse, **S)", "v"),
    ("k_head_dim_mismatch", "_C.forward(q, r(2, 6, 2, 9), v, out, lse, **S)", "k"),
    ("k_dtype_mismatch", "_C.forward(q, k.astype(np.float64), v, out, lse, **S)", "k"),
    ("q_int", "_C.forward(q.astype(np.int32), k, v, out, lse, **S)", "q"),
    ("q_ndim_3", "_C.forward(q[0], k, v, out, lse, **S)", "q"),
    ("q_0d", "_C.forward(np.float32(1.0), k, v, out, lse, **S)", "q"),
    ("q_not_array", "_C.forward([1.0], k, v, out, lse, **S)", "q"),
    ("out_read_only", "o = z(2, 5, 4, 8); o.flags.writeable = False; "
                      "_C.forward(q, k, v, o, lse, **S)", "out"),
    ("out_last_dim_strided", "_C.forward(q, k, v, z(2, 5, 4, 16)[..., ::2], lse, **S)", "out"),
    ("bias_view_too_small", "_C.forward(q, k, v, out, lse, bias=z(2, 4, 5, 5), **S)", "bias"),
    ("bias_not_4d", "_C.forward(q, k, v, out, lse, bias=z(5, 6), **S)", "bias"),
    ("mask_float", "_C.forward(q, k, v, out, lse, mask=z(2, 4, 5, 6), **S)", "mask"),
    ("alibi_wrong_shape", "_C.forward(q, k, v, out, lse, alibi_slopes=z(4, dt=np.float64), **S)",
     "alibi_slopes"),
    ("alibi_wrong_dtype", "_C.forward(q, k, v, out, lse, alibi_slopes=z(2, 4), **S)",
     "alibi_slopes"),
    ("dropout_one", "_C.forward(q, k, v, out, lse, **dict(S, dropout_p=1.0))", "dropout_p"),
    ("window_below_minus_1", "_C.forward(q, k, v, out, lse, **dict(S, window_left=-7))",
     "window"),
    ("softcap_negative", "_C.forward(q, k, v, out, lse, **dict(S, softcap=-1.0))", "softcap"),
    ("varlen_cu_past_end", "_C.forward(r(7, 4, 8), r(9, 2, 8), r(9, 2, 8), z(7, 4, 8), z(4, 7), "
                           "cu_seqlens_q=np.array([0, 3, 70], np.int32), "
                           "cu_seqlens_k=np.array([0, 4, 9], np.int32), **S)", "cu_seqlens"),
    ("varlen_cu_not_monotone", "_C.forward(r(7, 4, 8), r(9, 2, 8), r(9, 2, 8), z(7, 4, 8), "
                               "z(4, 7), cu_seqlens_q=np.array([0, 9, 7], np.int32), "
                               "cu_seqlens_k=np.array([0, 4, 9], np.int32), **S)", "cu_seqlens"),
    ("varlen_cu_int64", "_C.forward(r(7, 4, 8), r(9, 2, 8), r(9, 2, 8), z(7, 4, 8), z(4, 7), "
                        "cu_seqlens_q=np.array([0, 3, 7]), "
                        "cu_seqlens_k=np.array([0, 4, 9], np.int32), **S)", "cu_seqlens_q"),
    ("varlen_cu_lengths_differ", "_C.forward(r(7, 4, 8), r(9, 2, 8), r(9, 2, 8), z(7, 4, 8), "
                                 "z(4, 7), cu_seqlens_q=np.array([0, 3, 7], np.int32), "
                                 "cu_seqlens_k=np.array([0, 4, 6, 9], np.int32), **S)",
     "cu_seqlens"),
    ("varlen_max_seqlen_small", "_C.forward(r(7, 4, 8), r(9, 2, 8), r(9, 2, 8), z(7, 4, 8), "
                                "z(4, 7), cu_seqlens_q=np.array([0, 3, 7], np.int32), "
                                "cu_seqlens_k=np.array([0, 4, 9], np.int32), max_seqlen_q=2, "
                                "max_seqlen_k=5, **S)", "max_seqlen"),
    ("varlen_lse_wrong_shape", "_C.forward(r(7, 4, 8), r(9, 2, 8), r(9, 2, 8), z(7, 4, 8), "
                               "z(7, 4), cu_seqlens_q=np.array([0, 3, 7], np.int32), "
                               "cu_seqlens_k=np.array([0, 4, 9], np.int32), **S)", "lse"),
    ("bwd_dq_too_small", "_C.backward(out, q, k, v, out, lse, z(2, 4, 4, 8), z(2, 6, 2, 8), "
                         "z(2, 6, 2, 8), **S)", "dq"),
    ("bwd_dk_wrong_heads", "_C.backward(out, q, k, v, out, lse, z(2, 5, 4, 8), z(2, 6, 4, 8), "
                           "z(2, 6, 2, 8), **S)", "dk"),
    ("bwd_dout_wrong_shape", "_C.backward(z(2, 5, 4, 7), q, k, v, out, lse, z(2, 5, 4, 8), "
                             "z(2, 6, 2, 8), z(2, 6, 2, 8), **S)", "dout"),
    ("bwd_dv_wrong_dtype", "_C.backward(out, q, k, v, out, lse, z(2, 5, 4, 8), z(2, 6, 2, 8), "
                           "z(2, 6, 2, 8, dt=np.float64), **S)", "dv"),
    ("bwd_dbias_without_bias", "_C.backward(out, q, k, v, out, lse, z(2, 5, 4, 8), "
                               "z(2, 6, 2, 8), z(2, 6, 2, 8), dbias=z(1, 1, 5, 6), **S)",
     "dbias"),
    ("bwd_dbias_wrong_shape", "_C.backward(out, q, k, v, out, lse, z(2, 5, 4, 8), "
                              "z(2, 6, 2, 8), z(2, 6, 2, 8), dbias=z(1, 1, 5, 5), "
                              "bias=np.broadcast_to(z(5, 6), (2, 4, 5, 6)), **S)", "dbias"),
    ("bwd_heads_kv_zero", "_C.backward(out, q, empty_dense(2, 6, 0, 8), empty_dense(2, 6, 0, 8), "
                          "out, lse, z(2, 5, 4, 8), empty_dense(2, 6, 0, 8), "
                          "empty_dense(2, 6, 0, 8), **S)", "heads"),
    # the signature itself (bound in params_from_dlpack.h, ArrayArgs)
    ("missing_out", "_C.forward(q, k, v, **S)", "missing required argument 'out'"),
    ("missing_q_by_name", "_C.forward(k=k, v=v, out=out, lse=lse, **S)",
     "missing required argument 'q'"),
    ("array_twice", "_C.forward(q, k, v, out, lse, q=q, **S)", "multiple values for argument 'q'"),
    ("too_many_positional", "_C.forward(q, k, v, out, lse, *[None] * 11, **S)",
     "at most 15 positional"),
    ("unknown_setting", "_C.forward(q, k, v, out, lse, scael=0.3, **S)", "'scael'"),
    ("unknown_runtime_name",
     "_C.forward(q, k, v, out, lse, **{''.join(['sca', 'el']): 0.3}, **S)", "'scael'"),
    ("bwd_lse_none", "_C.backward(out, q, k, v, out, None, z(2, 5, 4, 8), z(2, 6, 2, 8), "
                     "z(2, 6, 2, 8), **S)", "lse"),
    ("bwd_missing_dv", "_C.backward(out, q, k, v, out, lse, z(2, 5, 4, 8), z(2, 6, 2, 8), **S)",
     "missing required argument 'dv'"),
    ("kvcache_missing_cache", "_C.forward_kvcache(q, k, v, out, **S)",
     "missing required argument 'lse'"),
]


def _run_core_case(stmt):
    code = _CORE_PRELUDE + textwrap.dedent(f"""
        try:
            {stmt}
        except (ValueError, TypeError) as e:
            print("RAISED", type(e).__name__, "|", e)
        else:
            print("NO ERROR")
        # the process is still usable: a valid call right after
        _C.forward(q, k, v, out, lse, **S)
        assert np.isfinite(out).all() and np.isfinite(lse).all()
        print("ALIVE")
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("stmt,fragment", [pytest.param(s, f, id=i) for i, s, f in CORE_CASES])
def test_core_rejects_inconsistent_arguments(stmt, fragment):
    """fmha._C re-checks what a wrong call could turn into an out-of-bounds access."""
    res = _run_core_case(stmt)
    detail = f"rc={res.returncode}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr[-2000:]}"
    assert res.returncode == 0, "the process died:\n" + detail
    assert "RAISED" in res.stdout, "no error was raised:\n" + detail
    message = res.stdout.split("|", 1)[1]
    assert fragment in message, detail
    assert "ALIVE" in res.stdout, detail


def test_core_arrays_by_position_or_name_agree():
    """The arrays may come by position or by name, in any mix, and keyword names built at run
    time (not interned) are found too: every spelling gives the same bits."""
    from fmha import _C
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, n, 2, 8)).astype(np.float32) for n in (5, 6, 6))
    settings = dict(scale=0.35, softcap=0.0, window_left=-1, window_right=-1, bottom_right=True,
                    dropout_p=0.0)
    results = []
    for call in (lambda o, l: _C.forward(q, k, v, o, l, **settings),
                 lambda o, l: _C.forward(q=q, k=k, v=v, out=o, lse=l, **settings),
                 lambda o, l: _C.forward(q, k, v=v, lse=l, out=o, bias=None, **settings),
                 lambda o, l: _C.forward(q, k, **{"".join(["v"]): v, "".join("out"): o},
                                         **{"".join(["ls", "e"]): l}, **settings)):
        out, lse = np.zeros((2, 5, 2, 8), np.float32), np.zeros((2, 2, 5), np.float32)
        call(out, lse)
        results.append((out, lse))
    for out, lse in results[1:]:
        assert np.array_equal(out, results[0][0]) and np.array_equal(lse, results[0][1])
    assert np.isfinite(results[0][0]).all()


def test_core_each_function_binds_its_own_argument_names():
    """forward and forward_kvcache both take 12 arrays: each must match keywords against
    its own names, whichever is called first in a process (a fresh one per order)."""
    code = textwrap.dedent("""
        import sys
        import numpy as np
        from fmha import _C
        rng = np.random.default_rng(0)
        S = dict(scale=0.35, softcap=0.0, window_left=-1, window_right=-1)
        q = rng.standard_normal((1, 1, 2, 8)).astype(np.float32)
        kc, vc = (rng.standard_normal((1, 6, 2, 8)).astype(np.float32) for _ in range(2))
        def kvcache():
            out, lse = np.zeros((1, 1, 2, 8), np.float32), np.zeros((1, 2, 1), np.float32)
            _C.forward_kvcache(q=q, k_cache=kc, v_cache=vc, out=out, lse=lse,
                               cache_seqlens=np.array([6], np.int32), **S)
            return out
        def forward():
            out, lse = np.zeros((1, 1, 2, 8), np.float32), np.zeros((1, 2, 1), np.float32)
            _C.forward(q=q, k=kc, v=vc, out=out, lse=lse, alibi_slopes=None,
                       block_index=None, bottom_right=True, dropout_p=0.0, **S)
            return out
        first, second = (kvcache, forward) if sys.argv[1] == "kvcache" else (forward, kvcache)
        a, b = first(), second()
        assert np.array_equal(a, b), (a, b)  # the same attention over the same 6 rows
        print("OK")
    """)
    for first in ("kvcache", "forward"):
        res = subprocess.run([sys.executable, "-c", code, first], capture_output=True,
                             text=True, timeout=120)
        assert res.returncode == 0 and "OK" in res.stdout, (first, res.stderr[-2000:])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("varlen", [False, True])
def test_core_host_forward_may_leave_lse_out(dtype, varlen):
    """lse=None on a host forward: the same out as with lse, from a buffer of the call."""
    from fmha import _C
    rng = np.random.default_rng(2)
    settings = dict(scale=0.35, softcap=0.0, window_left=-1, window_right=-1, bottom_right=True,
                    dropout_p=0.0)
    if varlen:
        q, k, v = (rng.standard_normal((n, 4, 8)).astype(dtype) for n in (7, 9, 9))
        extra = dict(cu_seqlens_q=np.array([0, 3, 7], np.int32),
                     cu_seqlens_k=np.array([0, 4, 9], np.int32))
        lse = np.zeros((4, 7), np.float64 if dtype == np.float64 else np.float32)
    else:
        q, k, v = (rng.standard_normal((2, n, 4, 8)).astype(dtype) for n in (5, 6, 6))
        extra = {}
        lse = np.zeros((2, 4, 5), np.float64 if dtype == np.float64 else np.float32)
    with_lse, without = np.zeros_like(q), np.zeros_like(q)
    _C.forward(q, k, v, with_lse, lse, **extra, **settings)
    _C.forward(q, k, v, without, **extra, **settings)
    assert np.array_equal(with_lse, without) and np.isfinite(lse).all()


# ---------------------------------------------------------------- CUDA arrays, without a GPU
#
# Arrays that say they live on a CUDA device, made from host memory: a DLPack capsule built by
# hand (ctypes) whose device is (kDLCUDA, id). Every case below is refused before anything
# could read the memory, so it is safe on any machine; the one that reaches the launch (all
# arrays on one device) runs only where there is no usable GPU, which it must then report.

_FAKE_CUDA_PRELUDE = _CORE_PRELUDE + textwrap.dedent("""
    import ctypes
    class DLDevice(ctypes.Structure):
        _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]
    class DLDataType(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]
    class DLTensor(ctypes.Structure):
        _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                    ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                    ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]
    class DLManagedTensor(ctypes.Structure):
        _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p),
                    ("deleter", ctypes.c_void_p)]
    ctypes.pythonapi.PyCapsule_New.restype = ctypes.py_object
    ctypes.pythonapi.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    CODES = {"f": 2, "i": 0, "u": 1, "b": 1}
    class FakeCuda:
        '''A host array that claims, through DLPack, to be on CUDA device `device`.'''
        def __init__(self, host, device=0):
            self.host, self.device = np.ascontiguousarray(host), device
            n = self.host.ndim
            self.shape_c = (ctypes.c_int64 * n)(*self.host.shape)
            self.strides_c = (ctypes.c_int64 * n)(*(s // self.host.itemsize for s in self.host.strides))
            t = DLTensor(self.host.ctypes.data, DLDevice(2, device), n,
                         DLDataType(CODES[self.host.dtype.kind], self.host.dtype.itemsize * 8, 1),
                         self.shape_c, self.strides_c, 0)
            self.managed = DLManagedTensor(t, None, None)
        def __dlpack_device__(self):
            return (2, self.device)
        def __dlpack__(self, stream=None, max_version=None, **kw):
            self.stream_seen = stream
            return ctypes.pythonapi.PyCapsule_New(ctypes.addressof(self.managed), b"dltensor", None)
    h = lambda x: x.astype(np.float16)
    C = lambda x, d=0: FakeCuda(h(x), d)
    qc, kc, vc, oc, lc = C(q), C(k), C(v), C(out), FakeCuda(lse)
""")

FAKE_CUDA_CASES = [
    ("lse_left_out_on_cuda", "_C.forward(qc, kc, vc, oc, None, **S)",
     "lse: required for arrays on cuda:0"),
    ("k_on_host", "_C.forward(qc, h(k), vc, oc, lc, **S)", "k: on device cpu, expected q's device cuda:0"),
    ("out_on_other_gpu", "_C.forward(qc, kc, vc, C(out, 1), lc, **S)",
     "out: on device cuda:1, expected q's device cuda:0"),
    ("bias_on_host", "_C.forward(qc, kc, vc, oc, lc, bias=np.zeros((2, 4, 5, 6), np.float16), **S)",
     "bias: on device cpu"),
    ("alibi_on_host", "_C.forward(qc, kc, vc, oc, lc, alibi_slopes=np.zeros((2, 4)), **S)",
     "alibi_slopes: on device cpu"),
    ("float32_on_cuda", "_C.forward(FakeCuda(q), FakeCuda(k), FakeCuda(v), FakeCuda(out), lc, **S)",
     "CUDA kernels take float16/bfloat16"),
    ("device_cu_seqlens_need_max_seqlen",
     "_C.forward(C(r(7, 4, 8)), C(r(9, 2, 8)), C(r(9, 2, 8)), C(z(7, 4, 8)), FakeCuda(z(4, 7)), "
     "cu_seqlens_q=FakeCuda(np.array([0, 3, 7], np.int32)), "
     "cu_seqlens_k=FakeCuda(np.array([0, 4, 9], np.int32)), **S)", "max_seqlen"),
    ("host_cu_seqlens_with_device_q",
     "_C.forward(C(r(7, 4, 8)), C(r(9, 2, 8)), C(r(9, 2, 8)), C(z(7, 4, 8)), FakeCuda(z(4, 7)), "
     "cu_seqlens_q=np.array([0, 3, 7], np.int32), cu_seqlens_k=np.array([0, 4, 9], np.int32), "
     "max_seqlen_q=4, max_seqlen_k=5, **S)", "cu_seqlens_q: on device cpu"),
    ("bwd_dq_on_host", "_C.backward(oc, qc, kc, vc, oc, lc, h(z(2, 5, 4, 8)), C(z(2, 6, 2, 8)), "
                       "C(z(2, 6, 2, 8)), **S)", "dq: on device cpu"),
    ("negative_stream", "_C.forward(qc, kc, vc, oc, lc, stream=-5, **S)", "stream"),
    ("unknown_keyword", "_C.forward(qc, kc, vc, oc, lc, strem=0, **S)", "strem"),
]


def _run_fake_cuda(stmt):
    code = _FAKE_CUDA_PRELUDE + textwrap.dedent(f"""
        try:
            {stmt}
        except (ValueError, TypeError, NotImplementedError) as e:
            print("RAISED", type(e).__name__, "|", e)
        else:
            print("NO ERROR")
        _C.forward(q, k, v, out, lse, **S)
        assert np.isfinite(out).all()
        print("ALIVE")
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("stmt,fragment", [pytest.param(s, f, id=i) for i, s, f in FAKE_CUDA_CASES])
def test_core_cuda_arrays_refused_before_launch(stmt, fragment):
    """Mixed devices, dtypes the CUDA kernels lack, device offsets without maxima: refused
    with the argument (and both devices) named, before any memory is read."""
    res = _run_fake_cuda(stmt)
    detail = f"rc={res.returncode}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr[-2000:]}"
    assert res.returncode == 0, "the process died:\n" + detail
    assert "RAISED" in res.stdout, "no error was raised:\n" + detail
    assert fragment in res.stdout.split("|", 1)[1], detail
    assert "ALIVE" in res.stdout, detail


def test_core_cuda_arrays_without_gpu_report_why():
    """All arrays on one CUDA device and no usable GPU (or no CUDA build): NotImplementedError
    with fmha.cuda_status()'s reason, and the producer was asked for the launch stream."""
    from fmha import _C
    if _C.cuda_device_count() > 0:
        pytest.skip("a GPU is present: the fake device arrays would reach a real launch")
    res = _run_fake_cuda("_C.forward(qc, kc, vc, oc, lc, stream=1234, **S)")
    detail = f"rc={res.returncode}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr[-2000:]}"
    assert res.returncode == 0 and "RAISED NotImplementedError" in res.stdout, detail
    message = res.stdout.split("|", 1)[1]
    assert ("no GPU" in message or "without CUDA" in message), detail
    assert "ALIVE" in res.stdout, detail


def test_core_cuda_stream_passed_to_producer():
    """A CUDA producer is asked to order its work before our stream (DLPack `stream`), with
    stream 0 (legacy default) sent as 1, since DLPack reserves 0."""
    stmt = ("try:\n"
            "            _C.forward(qc, kc, vc, oc, lc, stream=STREAM, **S)\n"
            "        except NotImplementedError:\n"
            "            pass\n"
            "        print('SEEN', qc.stream_seen, kc.stream_seen)\n"
            "        print('HOST', fake_host.stream_seen)")
    from fmha import _C
    if _C.cuda_device_count() > 0:
        pytest.skip("a GPU is present: the fake device arrays would reach a real launch")
    for given, expected in ((0, 1), (4096, 4096)):
        code = _FAKE_CUDA_PRELUDE + textwrap.dedent(f"""
            STREAM = {given}
            class HostArray:
                def __init__(self, a): self.a = a; self.stream_seen = 'unset'
                def __dlpack_device__(self): return (1, 0)
                def __dlpack__(self, stream=None, **kw):
                    self.stream_seen = stream
                    return self.a.__dlpack__()
            fake_host = HostArray(q)
            _C.forward(fake_host, k, v, out, lse, **S)
        """) + textwrap.indent(textwrap.dedent(stmt.replace("\n        ", "\n")), "")
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120)
        assert res.returncode == 0, res.stderr[-2000:]
        assert f"SEEN {expected} {expected}" in res.stdout, res.stdout
        assert "HOST None" in res.stdout, res.stdout  # host arrays: no stream argument


def test_emulator_refuses_device_arrays():
    pytest.importorskip("fmha._cuda_emu")
    res = _run_fake_cuda("from fmha import _cuda_emu; _cuda_emu.forward(qc, kc, vc, oc, lc, **S)")
    assert "RAISED ValueError" in res.stdout and "host arrays only" in res.stdout, res.stdout


def test_python_layer_cuda_checks_without_gpu():
    """The Python layer's CUDA checks, driven directly (torch here has no CUDA tensors)."""
    from fmha import _C
    with pytest.raises(NotImplementedError, match="float16/bfloat16; cast, or use the CPU"):
        _validate._check_cuda("cuda:0", "float32")
    with pytest.raises(NotImplementedError, match="not supported"):
        _validate._check_cuda("mps:0", "float16")
    if _C.cuda_device_count() == 0:
        _validate._CUDA_USABLE.clear()
        with pytest.raises(NotImplementedError, match="q: on cuda:0, but .*no GPU"):
            _validate._check_cuda("cuda:0", "float16")


@pytest.mark.skipif(torch is None, reason="torch not installed")
def test_cuda_varlen_offsets_never_read_without_gpu(monkeypatch):
    """With q on a CUDA device, cu_seqlens are never copied to the host (a copy would
    synchronise with the GPU): max_seqlen_q/k are required, and with them the whole torch
    path, forward and backward, runs without reading the offsets. Faked without a GPU: torch
    'meta' tensors (shapes, no data: reading a value raises) stand for CUDA tensors once the
    device check lets them through, and the torch ops run their fake implementations."""
    monkeypatch.setattr(_validate, "_check_cuda", lambda device, dtype: None)

    def refuse(x):
        raise AssertionError("cu_seqlens copied to the host")

    monkeypatch.setattr(_validate, "to_host", refuse)
    meta = dict(dtype=torch.float16, device="meta")
    q, k, v = (torch.empty(n, h, D, **meta) for n, h in ((TOTAL_Q, HQ), (TOTAL_K, HKV),
                                                        (TOTAL_K, HKV)))
    cu_q, cu_k = (torch.empty(len(CU_Q), dtype=torch.int32, device="meta") for _ in range(2))
    for maxima in ({}, dict(max_seqlen_q=4), dict(max_seqlen_k=5)):
        with pytest.raises(ValueError, match=r"^max_seqlen_q, max_seqlen_k: required when q is "
                                             r"on a CUDA device .*synchronise with the GPU"):
            fmha.attention_varlen(q, k, v, cu_q, cu_k, **maxima)
    # Metadata is still checked.
    with pytest.raises(TypeError, match=r"^cu_seqlens_k: expected int32"):
        fmha.attention_varlen(q, k, v, cu_q, cu_k.to(torch.int64), 4, 5)
    with pytest.raises(ValueError, match=r"^cu_seqlens_q, cu_seqlens_k: lengths 3 and 4"):
        fmha.attention_varlen(q, k, v, cu_q, torch.empty(4, dtype=torch.int32, device="meta"),
                              4, 5)
    spec = _validate.prepare(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=4,
                             max_seqlen_k=5)
    assert (spec.batch, spec.seqlen_q, spec.seqlen_k) == (2, 4, 5)
    leaves = [x.requires_grad_(True) for x in (q, k, v)]
    out, lse = fmha.attention_varlen(*leaves, cu_q, cu_k, 4, 5, causal=True, return_lse=True)
    assert out.device.type == "meta" and out.shape == (TOTAL_Q, HQ, D)
    assert lse.shape == (HQ, TOTAL_Q)
    out.backward(torch.empty_like(out))
    assert all(x.grad.shape == x.shape for x in leaves)
