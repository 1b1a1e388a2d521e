"""fmha.merge_states / merge_states_n: attention over disjoint key sets, merged by lse, equals
attention over their union (python/fmha/merge.py; docs/semantics.md, "Merging partial
attentions")."""

from __future__ import annotations

import numpy as np
import pytest

import fmha
from fmha import reference

NAN, INF = float("nan"), float("inf")


def _qkv(rng, b=2, sq=5, sk=37, hq=4, hkv=2, d=16, dv=24, dtype="float32"):
    q = rng.standard_normal((b, sq, hq, d)).astype(dtype)
    k = rng.standard_normal((b, sk, hkv, d)).astype(dtype)
    v = rng.standard_normal((b, sk, hkv, dv)).astype(dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
@pytest.mark.parametrize("cuts", [(16,), (1, 30), (10, 11, 25)])
def test_merge_of_key_splits_is_attention_over_all_keys(rng, dtype, cuts):
    q, k, v = _qkv(rng, dtype=dtype)
    bounds = (0,) + cuts + (k.shape[1],)
    parts = [fmha.attention(q, k[:, a:z], v[:, a:z], return_lse=True)
             for a, z in zip(bounds[:-1], bounds[1:])]
    out, lse = fmha.merge_states_n([o for o, _ in parts], [l for _, l in parts])
    ref_out, ref_lse = reference.attention_forward(q, k, v)
    tol = {"float64": 1e-12, "float32": 2e-6, "float16": 2e-3}[dtype]
    assert out.dtype == q.dtype and lse.dtype == parts[0][1].dtype
    np.testing.assert_allclose(lse.astype(np.float64), ref_lse, rtol=0, atol=tol * 10)
    np.testing.assert_allclose(out.astype(np.float64), ref_out, rtol=0, atol=tol * 4)
    if len(parts) == 2:
        out2, lse2 = fmha.merge_states(*parts[0], *parts[1])
        assert np.array_equal(out2, out) and np.array_equal(lse2, lse)


def test_merge_with_causal_split_and_a_part_without_keys(rng):
    # The second part holds only keys that every query row is masked from: lse -inf, out 0.
    q, k, v = _qkv(rng, sq=6, sk=20, dtype="float64")
    a = fmha.attention(q, k[:, :14], v[:, :14], return_lse=True, causal=True,
                       alignment="top_left")
    b_out = np.full_like(a[0], NAN)  # garbage that a zero weight must not pass on
    b_lse = np.full_like(a[1], -INF)
    out, lse = fmha.merge_states(*a, b_out, b_lse)
    assert np.array_equal(out, a[0]) and np.array_equal(lse, a[1])


def test_merge_of_nothing_is_zero_and_nan_rows_stay_nan(rng):
    q, k, v = _qkv(rng, b=1, sq=3, hq=2, hkv=2, d=8, dv=8, dtype="float32")
    out, lse = fmha.attention(q, k, v, return_lse=True)
    empty_lse = np.full_like(lse, -INF)
    merged, mlse = fmha.merge_states(np.zeros_like(out), empty_lse, np.zeros_like(out), empty_lse)
    assert np.all(merged == 0) and np.all(mlse == -INF)
    bad = lse.copy()
    bad[0, 1, 2] = NAN  # head 1, query row 2
    merged, mlse = fmha.merge_states(out, bad, out, lse)
    assert np.isnan(mlse[0, 1, 2]) and np.all(np.isnan(merged[0, 2, 1]))
    mask = np.ones(mlse.shape, bool)
    mask[0, 1, 2] = False
    assert np.all(np.isfinite(mlse[mask]))
    assert np.isfinite(merged).sum() == merged.size - merged.shape[-1]


def test_merge_varlen_layout(rng):
    q, k, v = _qkv(rng, b=1, sq=7, sk=30, hq=2, hkv=2, d=8, dv=8, dtype="float64")
    cu_q = np.array([0, 7], np.int32)
    parts = [fmha.attention_varlen(q[0], k[0, a:z], v[0, a:z], cu_q, np.array([0, z - a], np.int32),
                                   return_lse=True) for a, z in ((0, 12), (12, 30))]
    out, lse = fmha.merge_states(*parts[0], *parts[1])
    ref_out, ref_lse = reference.attention_forward(q, k, v)
    np.testing.assert_allclose(out, ref_out[0], rtol=0, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse[0], rtol=0, atol=1e-12)


def test_merge_torch_matches_numpy_and_is_differentiable(rng):
    torch = pytest.importorskip("torch")
    q, k, v = _qkv(rng, b=1, sq=3, sk=12, hq=2, hkv=1, d=8, dv=8, dtype="float64")
    parts = [fmha.attention(q, k[:, a:z], v[:, a:z], return_lse=True) for a, z in ((0, 5), (5, 12))]
    np_out, np_lse = fmha.merge_states(*parts[0], *parts[1])
    t = [torch.from_numpy(x).requires_grad_() for p in parts for x in p]
    out, lse = fmha.merge_states(*t)
    # The same arithmetic in both; exp and log come from two libraries (torch's and NumPy's),
    # which may differ in the last bit (seen on an AMD Zen 4 host): a few units in the last
    # place of float64, not bitwise.
    np.testing.assert_allclose(out.detach().numpy(), np_out, rtol=1e-14, atol=1e-15)
    np.testing.assert_allclose(lse.detach().numpy(), np_lse, rtol=1e-14, atol=1e-15)
    assert torch.autograd.gradcheck(lambda *x: fmha.merge_states(*x), t)


def test_merge_bf16_torch(rng):
    torch = pytest.importorskip("torch")
    q, k, v = (torch.from_numpy(x).to(torch.bfloat16) for x in _qkv(rng, dtype="float32"))
    parts = [fmha.attention(q, k[:, a:z], v[:, a:z], return_lse=True) for a, z in ((0, 9), (9, 37))]
    out, lse = fmha.merge_states(*parts[0], *parts[1])
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    whole = fmha.attention(q, k, v)
    assert torch.allclose(out.float(), whole.float(), rtol=0, atol=2e-2)


@pytest.mark.parametrize("case,err,match", [
    ("length", ValueError, "differ in length"),
    ("empty", ValueError, "outs is empty"),
    ("lse_shape", ValueError, "lse 1 has shape"),
    ("out_shape", ValueError, "out 1 has shape"),
    ("lse_dtype", TypeError, "lse 0 has dtype"),
    ("mixed", TypeError, "out 1 is a"),
    ("out_dtype", TypeError, "out 1 is float64"),
])
def test_merge_bad_input_names_the_argument(rng, case, err, match):
    out = rng.standard_normal((1, 3, 2, 4)).astype(np.float32)
    lse = rng.standard_normal((1, 2, 3)).astype(np.float32)
    outs, lses = [out, out.copy()], [lse, lse.copy()]
    if case == "length":
        lses = lses[:1]
    elif case == "empty":
        outs, lses = [], []
    elif case == "lse_shape":
        lses[1] = lse.transpose(0, 2, 1).copy()
    elif case == "out_shape":
        outs[1] = out[:, :2]
    elif case == "lse_dtype":
        lses[0] = lse.astype(np.float16)
    elif case == "mixed":
        outs[1] = out.tolist()
    elif case == "out_dtype":
        outs[1] = out.astype(np.float64)
    with pytest.raises(err, match=match):
        fmha.merge_states_n(outs, lses)
