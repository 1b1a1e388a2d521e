"""Tests of the float64 NumPy reference (fmha.reference) and its Philox dropout stream.

The reference is the yardstick for every backend, so it is checked here against
independent definitions: published Philox known answers, torch's SDPA (when
torch is installed) and central finite differences for every gradient.
"""

import itertools
import zlib

import numpy as np
import pytest

from cases import kat_rows
from fmha import _philox, reference

# ---------------------------------------------------------------------------
# Philox4x32-10
# ---------------------------------------------------------------------------

# Known-answer vectors of Random123: tests/cases.py (PHILOX4X32_10_KAT), shared with
# tests/kernels/test_core.py, which checks the compiled core against the same vectors.


@pytest.mark.parametrize("counter,key,expected", kat_rows())
def test_philox_known_answers(counter, key, expected):
    out = _philox.philox4x32_10(np.array(counter, np.uint32), np.array(key, np.uint32))
    assert out.dtype == np.uint32
    assert out.tolist() == expected


def test_philox_vectorised_matches_single_calls():
    rows = kat_rows()
    counters = np.array([r[0] for r in rows], np.uint32)
    keys = np.array([r[1] for r in rows], np.uint32)
    out = _philox.philox4x32_10(counters, keys)
    assert out.shape == (len(rows), 4)
    assert out.tolist() == [r[2] for r in rows]
    # A single key broadcasts over many counters.
    out_bcast = _philox.philox4x32_10(counters, keys[2])
    for n in range(len(rows)):
        assert out_bcast[n].tolist() == _philox.philox4x32_10(counters[n], keys[2]).tolist()


def test_dropout_threshold():
    assert _philox.dropout_threshold(0.0) == 0
    assert _philox.dropout_threshold(0.5) == 2**31
    assert _philox.dropout_threshold(0.1) == 429496729  # floor(429496729.6)
    assert _philox.dropout_threshold(1.0) == 2**32 - 1
    assert _philox.dropout_threshold(1.0 - 2.0**-53) == 2**32 - 1
    with pytest.raises(ValueError):
        _philox.dropout_threshold(-0.1)


def _keep_by_definition(seed, offset, heads, b, h, i, j, p):
    """One element of the keep-mask, straight from the written contract."""
    lo, hi = seed & 0xFFFFFFFF, seed >> 32
    key = [lo, (hi + (offset >> 32)) & 0xFFFFFFFF]
    counter = [j >> 2, i, (b * heads + h) & 0xFFFFFFFF, offset & 0xFFFFFFFF]
    r = int(_philox.philox4x32_10(np.array(counter, np.uint32), np.array(key, np.uint32))[j & 3])
    return r >= _philox.dropout_threshold(p)


@pytest.mark.parametrize(
    "seed,offset",
    [(0, 0), (1234, 5678), (0x0123456789ABCDEF, 0xFEDCBA9876543210), (2**64 - 1, 2**64 - 1)],
)
def test_dropout_mask_matches_contract(seed, offset):
    batch, heads, sq, sk, p = 2, 3, 6, 11, 0.4
    mask = _philox.dropout_keep_mask(seed, offset, batch, heads, sq, sk, p)
    assert mask.shape == (batch, heads, sq, sk) and mask.dtype == np.bool_
    for b, h, i, j in itertools.product(range(batch), range(heads), range(sq), range(sk)):
        assert mask[b, h, i, j] == _keep_by_definition(seed, offset, heads, b, h, i, j, p)
    # batch_index_start shifts the batch coordinate.
    shifted = _philox.dropout_keep_mask(seed, offset, 1, heads, 3, 5, p, batch_index_start=7)
    for h, i, j in itertools.product(range(heads), range(3), range(5)):
        assert shifted[0, h, i, j] == _keep_by_definition(seed, offset, heads, 7, h, i, j, p)


def test_dropout_keeps_word_equal_to_threshold():
    # Choose p so that the threshold equals the word drawn for element
    # (0, 0, 0, 1): the comparison is ">=", so that element is kept, and the
    # next representable threshold above it drops it.
    seed, offset = 31337, 11
    r = int(_philox.philox4x32_10(np.array([0, 0, 0, offset], np.uint32),
                                  np.array([seed, 0], np.uint32))[1])
    p = r / 2.0**32  # exact in float64
    assert _philox.dropout_threshold(p) == r
    assert _philox.dropout_keep_mask(seed, offset, 1, 1, 1, 2, p)[0, 0, 0, 1]
    p_above = (r + 1) / 2.0**32
    assert not _philox.dropout_keep_mask(seed, offset, 1, 1, 1, 2, p_above)[0, 0, 0, 1]


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_keep_rate(p):
    mask = _philox.dropout_keep_mask(42, 7, 2, 4, 250, 500, p)  # 1,000,000 samples
    assert mask.size == 1_000_000
    assert abs(mask.mean() - (1.0 - p)) < 0.01


def test_dropout_mask_is_pure_function_of_coordinates():
    seed, offset, heads, p = 987654321, 2**40 + 17, 3, 0.25
    big = _philox.dropout_keep_mask(seed, offset, 4, heads, 37, 53, p)
    small = _philox.dropout_keep_mask(seed, offset, 2, heads, 20, 30, p)
    np.testing.assert_array_equal(small, big[:2, :, :20, :30])
    # An odd seqlen_k cuts a Philox block in two; the kept half must not change.
    odd = _philox.dropout_keep_mask(seed, offset, 4, heads, 37, 5, p)
    np.testing.assert_array_equal(odd, big[:, :, :, :5])
    tail = _philox.dropout_keep_mask(seed, offset, 2, heads, 37, 53, p, batch_index_start=2)
    np.testing.assert_array_equal(tail, big[2:])


def test_dropout_mask_depends_on_seed_offset_and_p():
    base = _philox.dropout_keep_mask(1, 0, 1, 2, 16, 16, 0.5)
    assert not np.array_equal(base, _philox.dropout_keep_mask(2, 0, 1, 2, 16, 16, 0.5))
    assert not np.array_equal(base, _philox.dropout_keep_mask(1, 1, 1, 2, 16, 16, 0.5))
    assert not np.array_equal(base, _philox.dropout_keep_mask(1, 2**32, 1, 2, 16, 16, 0.5))
    assert _philox.dropout_keep_mask(1, 0, 1, 2, 16, 16, 0.0).all()
    # A higher p only removes elements: the masks are nested.
    more = _philox.dropout_keep_mask(1, 0, 1, 2, 16, 16, 0.7)
    assert not (more & ~base).any() and (base & ~more).any()


# ---------------------------------------------------------------------------
# Helpers for the attention reference
# ---------------------------------------------------------------------------


def _qkv(rng, batch, sq, sk, hq, hkv, d, dv):
    q = rng.standard_normal((batch, sq, hq, d))
    k = rng.standard_normal((batch, sk, hkv, d))
    v = rng.standard_normal((batch, sk, hkv, dv))
    return q, k, v


def _numerical_grad(f, x, eps=1e-6):
    """Central finite differences of the scalar function f at array x (in place)."""
    grad = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        saved = x[idx]
        x[idx] = saved + eps
        f_plus = f()
        x[idx] = saved - eps
        f_minus = f()
        x[idx] = saved
        grad[idx] = (f_plus - f_minus) / (2 * eps)
    return grad


def _assert_grads_match_fd(q, k, v, kwargs, rng):
    """Check dq, dk, dv (and dbias) of the reference against finite differences."""
    out, _ = reference.attention_forward(q, k, v, **kwargs)
    w = rng.standard_normal(out.shape)

    def loss():
        o, _ = reference.attention_forward(q, k, v, **kwargs)
        return float(np.sum(o * w))

    dq, dk, dv, dbias = reference.attention_backward(w, q, k, v, **kwargs)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    for name, x, g in (("dq", q, dq), ("dk", k, dk), ("dv", v, dv)):
        assert np.all(np.isfinite(g)), name
        np.testing.assert_allclose(g, _numerical_grad(loss, x), rtol=1e-6, atol=1e-8, err_msg=name)
    bias = kwargs.get("bias")
    if bias is None:
        assert dbias is None
    else:
        assert dbias.shape == bias.shape
        np.testing.assert_allclose(dbias, _numerical_grad(loss, bias), rtol=1e-6, atol=1e-8,
                                   err_msg="dbias")
    return out, dq, dk, dv, dbias


# (batch, sq, sk, heads_q, heads_kv, d, dv), kwargs builder(rng, batch, sq, sk, hq)
FD_CASES = {
    "plain": ((2, 4, 5, 2, 2, 3, 4), lambda r, b, sq, sk, h: {}),
    "scale": ((1, 3, 4, 2, 2, 4, 3), lambda r, b, sq, sk, h: {"scale": 0.7}),
    "causal_br_sq_lt_sk": ((2, 3, 5, 2, 2, 3, 3), lambda r, b, sq, sk, h: {"causal": True}),
    "causal_br_sq_gt_sk": ((2, 5, 3, 2, 2, 3, 4), lambda r, b, sq, sk, h: {"causal": True}),
    "causal_top_left": ((1, 5, 3, 2, 2, 3, 3),
                        lambda r, b, sq, sk, h: {"causal": True, "alignment": "top_left"}),
    "window": ((1, 5, 5, 2, 2, 3, 3), lambda r, b, sq, sk, h: {"window": (1, 1)}),
    "window_left_causal": ((2, 4, 5, 2, 2, 4, 3),
                           lambda r, b, sq, sk, h: {"window": (2, -1), "causal": True}),
    "bias_full": ((2, 4, 5, 2, 2, 3, 3),
                  lambda r, b, sq, sk, h: {"bias": r.standard_normal((b, h, sq, sk))}),
    "bias_2d": ((2, 4, 5, 2, 2, 3, 3), lambda r, b, sq, sk, h: {"bias": r.standard_normal((sq, sk))}),
    "bias_b11k": ((2, 3, 4, 2, 2, 3, 3),
                  lambda r, b, sq, sk, h: {"bias": r.standard_normal((b, 1, 1, sk))}),
    "bias_1hq1_causal": ((2, 4, 4, 2, 2, 3, 3),
                         lambda r, b, sq, sk, h: {"bias": r.standard_normal((1, h, sq, 1)),
                                                  "causal": True}),
    "mask": ((2, 4, 5, 2, 2, 3, 3),
             lambda r, b, sq, sk, h: {"mask": r.random((b, h, sq, sk)) < 0.6}),
    "mask_2d": ((1, 4, 5, 2, 2, 3, 3), lambda r, b, sq, sk, h: {"mask": r.random((sq, sk)) < 0.6}),
    "alibi_heads": ((2, 4, 5, 2, 2, 3, 3),
                    lambda r, b, sq, sk, h: {"alibi_slopes": r.random(h)}),
    "alibi_batch_heads_causal": ((2, 5, 4, 2, 2, 3, 3),
                                 lambda r, b, sq, sk, h: {"alibi_slopes": r.random((b, h)),
                                                          "causal": True}),
    "softcap": ((2, 4, 5, 2, 2, 3, 3), lambda r, b, sq, sk, h: {"softcap": 0.8, "scale": 1.5}),
    "gqa_2_to_1": ((2, 4, 5, 2, 1, 3, 4), lambda r, b, sq, sk, h: {}),
    "gqa_4_to_2_causal": ((1, 4, 3, 4, 2, 3, 3), lambda r, b, sq, sk, h: {"causal": True}),
    "dropout": ((2, 4, 5, 2, 2, 3, 3),
                lambda r, b, sq, sk, h: {"dropout_p": 0.3, "seed": 1234, "offset": 8}),
    "everything": ((2, 5, 4, 4, 2, 3, 4),
                   lambda r, b, sq, sk, h: {"causal": True, "window": (2, -1),
                                            "bias": r.standard_normal((1, h, sq, sk)),
                                            "alibi_slopes": r.random(h), "softcap": 1.0,
                                            "dropout_p": 0.25, "seed": 99, "offset": 3,
                                            "mask": r.random((sq, sk)) < 0.8}),
}


@pytest.mark.parametrize("case", sorted(FD_CASES))
def test_backward_matches_finite_differences(case):
    shape, make_kwargs = FD_CASES[case]
    batch, sq, sk, hq, hkv, d, dv = shape
    rng = np.random.default_rng(zlib.crc32(case.encode()))
    q, k, v = _qkv(rng, batch, sq, sk, hq, hkv, d, dv)
    kwargs = make_kwargs(rng, batch, sq, sk, hq)
    out, *_ = _assert_grads_match_fd(q, k, v, kwargs, rng)
    assert out.shape == (batch, sq, hq, dv)
    assert np.all(np.isfinite(out))


def test_causal_sq_gt_sk_has_empty_rows():
    # Bottom-right causal with seqlen_q > seqlen_k: the first sq - sk rows see nothing.
    rng = np.random.default_rng(0)
    q, k, v = _qkv(rng, 1, 5, 3, 2, 2, 3, 3)
    out, lse = reference.attention_forward(q, k, v, causal=True)
    assert np.all(out[:, :2] == 0) and np.all(np.isneginf(lse[:, :, :2]))
    assert np.all(np.isfinite(lse[:, :, 2:]))


# ---------------------------------------------------------------------------
# Forward semantics
# ---------------------------------------------------------------------------


def test_probs_and_lse_are_consistent():
    rng = np.random.default_rng(1)
    q, k, v = _qkv(rng, 2, 6, 7, 4, 2, 5, 3)
    kw = {"causal": True, "bias": rng.standard_normal((6, 7)), "alibi_slopes": rng.random(4)}
    p = reference.attention_probs(q, k, v, **kw)
    out, lse = reference.attention_forward(q, k, v, **kw)
    assert p.shape == (2, 4, 6, 7) and lse.shape == (2, 4, 6)
    np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-12)
    # Bottom-right causal with sq=6, sk=7: row i sees j <= i + 1.
    i, j = np.meshgrid(np.arange(6), np.arange(7), indexing="ij")
    assert np.all(p[..., j > i + 1] == 0) and np.all(p[..., j <= i + 1] > 0)
    # P = exp(S - lse) on visible entries, S rebuilt by hand.
    kv_head = np.arange(4) // 2
    s = np.einsum("bihd,bjhd->bhij", q, k[:, :, kv_head]) / np.sqrt(5)
    s = s + kw["bias"] - kw["alibi_slopes"][None, :, None, None] * np.abs(i + 1 - j)
    np.testing.assert_allclose(np.where(j <= i + 1, np.exp(s - lse[..., None]), 0.0), p,
                               rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(out, np.einsum("bhij,bjhd->bihd", p, v[:, :, kv_head]), rtol=1e-12)


def test_window_visibility_both_alignments():
    rng = np.random.default_rng(2)
    q, k, v = _qkv(rng, 1, 4, 9, 1, 1, 2, 2)
    for alignment, off in (("bottom_right", 5), ("top_left", 0)):
        p = reference.attention_probs(q, k, v, window=(2, 1), alignment=alignment)[0, 0]
        for i, j in itertools.product(range(4), range(9)):
            visible = i + off - 2 <= j <= i + off + 1
            assert (p[i, j] > 0) == visible, (alignment, i, j)


def test_dropout_forward_uses_query_head_coordinates():
    rng = np.random.default_rng(3)
    q, k, v = _qkv(rng, 2, 5, 6, 4, 2, 3, 3)
    kw = {"dropout_p": 0.4, "seed": 2**63 + 5, "offset": 2**33 + 1}
    out, _ = reference.attention_forward(q, k, v, **kw)
    p = reference.attention_probs(q, k, v)
    keep = _philox.dropout_keep_mask(kw["seed"], kw["offset"], 2, 4, 5, 6, 0.4)
    expected = np.einsum("bhij,bjhd->bihd", p * keep / 0.6, v[:, :, np.arange(4) // 2])
    np.testing.assert_allclose(out, expected, rtol=1e-12)
    # Same seed, same output; a different offset gives a different one.
    np.testing.assert_array_equal(out, reference.attention_forward(q, k, v, **kw)[0])
    other, _ = reference.attention_forward(q, k, v, **{**kw, "offset": 0})
    assert not np.allclose(out, other)


def test_dropout_p_one_gives_zeros():
    rng = np.random.default_rng(4)
    q, k, v = _qkv(rng, 1, 3, 4, 2, 2, 3, 3)
    out, _ = reference.attention_forward(q, k, v, dropout_p=1.0, seed=1)
    assert np.all(out == 0)
    grads = reference.attention_backward(np.ones_like(out), q, k, v, dropout_p=1.0, seed=1)
    assert all(np.all(g == 0) for g in grads[:3])


@pytest.mark.parametrize("kind", ["mask", "bias_neg_inf", "causal", "window"])
def test_fully_masked_rows(kind):
    rng = np.random.default_rng(5)
    batch, sq, sk, h = 2, 4, 5, 2
    q, k, v = _qkv(rng, batch, sq, sk, h, h, 3, 3)
    kw = {"bias": rng.standard_normal((batch, h, sq, sk))}
    empty = np.zeros((batch, h, sq), dtype=bool)
    if kind == "mask":
        mask = rng.random((batch, h, sq, sk)) < 0.7
        mask[0, 1, 2] = False
        mask[1, :, 0] = False
        kw["mask"] = mask
        empty = ~mask.any(-1)
    elif kind == "bias_neg_inf":
        kw["bias"][0, 0, 3] = -np.inf
        kw["bias"][1, 1, 1, :3] = -np.inf
        kw["causal"] = True  # row 1 of sq=4, sk=5 sees j <= 2, all -inf
        empty[0, 0, 3] = empty[1, 1, 1] = True
    elif kind == "causal":
        q, k, v = _qkv(rng, batch, sq + 3, sk - 2, h, h, 3, 3)  # sq=7 > sk=3
        kw = {"causal": True, "bias": rng.standard_normal((1, 1, sq + 3, sk - 2))}
        empty = np.zeros((batch, h, sq + 3), dtype=bool)
        empty[:, :, :4] = True
    elif kind == "window":
        kw["window"] = (0, 0)
        kw["alignment"] = "top_left"
        q, k, v = _qkv(rng, batch, sk + 2, sk, h, h, 3, 3)  # rows past sk see nothing
        kw["bias"] = rng.standard_normal((sk + 2, sk))
        empty = np.zeros((batch, h, sk + 2), dtype=bool)
        empty[:, :, sk:] = True
    assert empty.any()

    with np.errstate(all="raise"):
        out, lse = reference.attention_forward(q, k, v, **kw)
        p = reference.attention_probs(q, k, v, **kw)
    emp_out = np.transpose(empty, (0, 2, 1))  # (batch, sq, heads) like out's first axes
    assert np.all(out[emp_out] == 0)
    assert np.all(np.isneginf(lse[empty])) and np.all(np.isfinite(lse[~empty]))
    assert np.all(p[empty] == 0)
    np.testing.assert_allclose(p[~empty].sum(-1), 1.0, rtol=1e-12)

    # Upstream gradient only on the empty rows: every gradient must be exactly 0.
    dout = np.where(emp_out[..., None], rng.standard_normal(out.shape), 0.0)
    with np.errstate(invalid="raise"):
        dq, dk, dv, dbias = reference.attention_backward(dout, q, k, v, **kw)
    for g in (dq, dk, dv, dbias):
        assert not np.any(np.isnan(g))
        assert np.all(g == 0)

    # A generic upstream gradient: finite everywhere, dq zero on the empty rows.
    dq, dk, dv, dbias = reference.attention_backward(rng.standard_normal(out.shape), q, k, v, **kw)
    for g in (dq, dk, dv, dbias):
        assert np.all(np.isfinite(g))
    assert np.all(dq[emp_out] == 0)


def test_heads_mismatch_raises():
    rng = np.random.default_rng(6)
    q, k, v = _qkv(rng, 1, 3, 3, 3, 2, 4, 4)
    with pytest.raises(ValueError, match="heads"):
        reference.attention_forward(q, k, v)
    with pytest.raises(ValueError):
        reference.attention_forward(q[..., :2, :], k, v[..., :3], alignment="middle")


def test_inputs_are_cast_to_float64():
    rng = np.random.default_rng(7)
    q, k, v = (x.astype(np.float32) for x in _qkv(rng, 1, 3, 4, 2, 2, 3, 3))
    out, lse = reference.attention_forward(q, k, v)
    assert out.dtype == np.float64 and lse.dtype == np.float64
    grads = reference.attention_backward(out.astype(np.float16), q, k, v)
    assert all(g.dtype == np.float64 for g in grads[:3])


# ---------------------------------------------------------------------------
# Variable-length batches
# ---------------------------------------------------------------------------


def test_varlen_equal_lengths_matches_batched():
    # With equal lengths the packed batch is the padded one: same dropout mask
    # (batch index = sequence index), same per-batch ALiBi slopes.
    rng = np.random.default_rng(8)
    batch, s, hq, hkv = 3, 4, 4, 2
    q, k, v = _qkv(rng, batch, s, s, hq, hkv, 3, 5)
    kw = {"causal": True, "alibi_slopes": rng.random((batch, hq)), "softcap": 2.0,
          "dropout_p": 0.3, "seed": 77, "offset": 5}
    cu = np.arange(batch + 1, dtype=np.int32) * s
    pack = lambda x: x.reshape((-1,) + x.shape[2:])  # noqa: E731
    out, lse = reference.attention_forward(q, k, v, **kw)
    out_v, lse_v = reference.attention_varlen_forward(pack(q), pack(k), pack(v), cu, cu, **kw)
    np.testing.assert_allclose(out_v, pack(out), rtol=1e-13)
    np.testing.assert_allclose(lse_v, np.transpose(lse, (1, 0, 2)).reshape(hq, -1), rtol=1e-13)

    dout = rng.standard_normal(out.shape)
    dq, dk, dv, _ = reference.attention_backward(dout, q, k, v, **kw)
    dq_v, dk_v, dv_v = reference.attention_varlen_backward(pack(dout), pack(q), pack(k), pack(v),
                                                           cu, cu, **kw)
    np.testing.assert_allclose(dq_v, pack(dq), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(dk_v, pack(dk), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(dv_v, pack(dv), rtol=1e-12, atol=1e-14)


def test_varlen_unequal_lengths():
    rng = np.random.default_rng(9)
    lens_q, lens_k = [3, 0, 5, 2], [4, 2, 3, 0]
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    h, d = 2, 3
    q = rng.standard_normal((cu_q[-1], h, d))
    k = rng.standard_normal((cu_k[-1], 1, d))
    v = rng.standard_normal((cu_k[-1], 1, 4))
    kw = {"causal": True, "alibi_slopes": rng.random(h), "dropout_p": 0.2, "seed": 3}
    out, lse = reference.attention_varlen_forward(q, k, v, cu_q, cu_k, **kw)
    assert out.shape == (cu_q[-1], h, 4) and lse.shape == (h, cu_q[-1])
    for b in range(4):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if lens_q[b] == 0:
            continue
        keep = _philox.dropout_keep_mask(3, 0, 1, h, lens_q[b], lens_k[b], 0.2, batch_index_start=b)
        p = reference.attention_probs(q[None, sq], k[None, sk], v[None, sk], causal=True,
                                      alibi_slopes=kw["alibi_slopes"])
        expected = np.einsum("bhij,bjd->bihd", p * keep / 0.8, v[None, sk, 0])
        np.testing.assert_allclose(out[sq], expected[0], rtol=1e-12, atol=1e-15)
    # The last sequence has no keys: its rows are empty.
    assert np.all(out[cu_q[3]:] == 0) and np.all(np.isneginf(lse[:, cu_q[3]:]))

    dout = rng.standard_normal(out.shape)
    dq, dk, dv = reference.attention_varlen_backward(dout, q, k, v, cu_q, cu_k, **kw)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert all(np.all(np.isfinite(g)) for g in (dq, dk, dv))
    # Finite differences through the whole packed batch.
    def loss():
        return float(np.sum(reference.attention_varlen_forward(q, k, v, cu_q, cu_k, **kw)[0] * dout))
    for x, g in ((q, dq), (k, dk), (v, dv)):
        np.testing.assert_allclose(g, _numerical_grad(loss, x), rtol=1e-6, atol=1e-8)


# ---------------------------------------------------------------------------
# Against torch.nn.functional.scaled_dot_product_attention (optional)
# ---------------------------------------------------------------------------

TORCH_CASES = {
    "plain": ((2, 5, 7, 3, 3, 8, 6), {}, {}),
    "scale": ((1, 4, 4, 2, 2, 5, 5), {"scale": 0.3}, {"scale": 0.3}),
    "causal_square": ((2, 6, 6, 2, 2, 4, 4), {"causal": True}, {"is_causal": True}),
    "causal_top_left": ((1, 4, 7, 2, 2, 4, 4), {"causal": True, "alignment": "top_left"},
                        {"is_causal": True}),
    "bool_mask": ((2, 5, 6, 2, 2, 4, 3), {"mask": "bool"}, {"attn_mask": "bool"}),
    "float_bias": ((2, 5, 6, 2, 2, 4, 3), {"bias": "float"}, {"attn_mask": "float"}),
    "gqa": ((2, 5, 6, 6, 2, 4, 3), {}, {}),
}


@pytest.mark.parametrize("case", sorted(TORCH_CASES))
def test_against_torch_sdpa(case):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    (batch, sq, sk, hq, hkv, d, dv), ref_kw, torch_kw = TORCH_CASES[case]
    rng = np.random.default_rng(10)
    q, k, v = _qkv(rng, batch, sq, sk, hq, hkv, d, dv)
    ref_kw, torch_kw = dict(ref_kw), dict(torch_kw)
    if ref_kw.get("mask") == "bool":
        mask = rng.random((batch, hq, sq, sk)) < 0.6
        mask[..., 0] = True  # torch's math path gives NaN for a fully masked row
        ref_kw["mask"] = mask
        torch_kw["attn_mask"] = torch.from_numpy(mask)
    if ref_kw.get("bias") == "float":
        bias = rng.standard_normal((batch, hq, sq, sk))
        ref_kw["bias"] = bias
        torch_kw["attn_mask"] = torch.from_numpy(bias).requires_grad_(True)

    # torch wants (batch, heads, seq, dim); GQA by repeating kv heads h // group.
    group = hq // hkv
    to_t = lambda x: torch.from_numpy(np.ascontiguousarray(np.transpose(x, (0, 2, 1, 3))))  # noqa: E731
    qt = to_t(q).requires_grad_(True)
    kt = to_t(k).requires_grad_(True)
    vt = to_t(v).requires_grad_(True)
    out_t = F.scaled_dot_product_attention(
        qt, kt.repeat_interleave(group, dim=1), vt.repeat_interleave(group, dim=1), **torch_kw
    )
    out, _ = reference.attention_forward(q, k, v, **ref_kw)
    np.testing.assert_allclose(out, np.transpose(out_t.detach().numpy(), (0, 2, 1, 3)),
                               rtol=1e-10, atol=1e-12)

    dout = rng.standard_normal(out.shape)
    out_t.backward(torch.from_numpy(np.ascontiguousarray(np.transpose(dout, (0, 2, 1, 3)))))
    dq, dk, dv, dbias = reference.attention_backward(dout, q, k, v, **ref_kw)
    back = lambda t: np.transpose(t.grad.numpy(), (0, 2, 1, 3))  # noqa: E731
    np.testing.assert_allclose(dq, back(qt), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(dk, back(kt), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(dv, back(vt), rtol=1e-9, atol=1e-12)
    if "bias" in ref_kw:
        np.testing.assert_allclose(dbias, torch_kw["attn_mask"].grad.numpy(), rtol=1e-9, atol=1e-12)
