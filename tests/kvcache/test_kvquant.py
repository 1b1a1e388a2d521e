"""8-bit KV caches (fmha/kvquant.py; docs/semantics.md, "8-bit KV caches"): the encodings
against torch's float8 dtypes and an exhaustive decode of all 256 codes by the kernels; the
append's quantisation (codes and dynamic scales) against fmha.kvquant.quantize, bit for bit;
attention over int8 / float8_e4m3fn / float8_e5m2 caches with static and dynamic scales,
contiguous and paged, against the float64 reference on the dequantised cache; calibration;
refusals that leave the cache untouched.
"""

from __future__ import annotations

import numpy as np
import pytest

from fmha import kvquant, reference
from fmha.kvcache import attention_with_kvcache

torch = pytest.importorskip("torch")

from conftest import probes  # noqa: E402
from kvquant_cases import TORCH_DTYPES, assert_appended, dense, make_cache  # noqa: E402


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
def test_encodings_match_torch_float8(fmt):
    """decode_table is torch's value of every byte; quantize rounds as torch's conversion
    does (to nearest even) everywhere torch does not overflow, midpoints included."""
    td = TORCH_DTYPES[fmt]
    table = kvquant.decode_table(fmt)
    ref = torch.arange(256, dtype=torch.uint8).view(td).double().numpy()
    np.testing.assert_array_equal(table, ref)  # NaN where NaN, inf where inf
    finite = np.sort(table[np.isfinite(table)])
    mids = ((finite[1:] + finite[:-1]) / 2).astype(np.float32)
    x = np.concatenate([finite.astype(np.float32), mids,
                        np.random.default_rng(0).standard_normal(2000).astype(np.float32) * 9])
    got = kvquant.quantize(x[:, None], fmt, np.float32(1))[:, 0]
    want = torch.from_numpy(x).to(td).view(torch.uint8).numpy()
    np.testing.assert_array_equal(got, want)
    big = np.array([1e9, -1e9, np.inf, np.nan], np.float32)  # saturating; NaN stays NaN
    back = kvquant.dequantize(kvquant.quantize(big, fmt, 1), fmt, 1)
    np.testing.assert_array_equal(back[:3], [finite[-1], -finite[-1], finite[-1]])
    assert np.isnan(back[3])


@pytest.mark.parametrize("fmt", kvquant.FORMATS)
def test_kernels_decode_every_code(fmt):
    """The CPU kernels' conversion (SIMD at this level, scalar tails) of all 256 codes, in
    several alignments, is the reference decoder's value exactly."""
    codes = np.concatenate([np.arange(256, dtype=np.uint8)] * 3)[5:]
    y = np.empty(codes.shape, np.float32)
    probes().cpu_decode_kv_codes(kvquant.CODES[fmt], codes, y)
    np.testing.assert_array_equal(y, kvquant.decode_table(fmt)[codes].astype(np.float32))


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("scales", ["static", "dynamic"])
@pytest.mark.parametrize("fmt", kvquant.FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_over_8bit_caches(fmt, scales, paged, dtype):
    """Decode (2 and 7 queries, GQA: the decode path) and 20 (the tiled path) with new rows
    appended: the appended codes and scales are fmha.kvquant's, and the output is the
    float64 reference's on the dequantised cache."""
    rng = np.random.default_rng(1)
    kc, vc, ks, vs, table = make_cache(rng, fmt, scales, paged=paged)
    lens = torch.tensor([17, 30], dtype=torch.int32)
    for sq in (2, 7, 20):  # 20 query rows x 2 per kv head: the tiled path
        q = torch.from_numpy(rng.standard_normal((2, sq, 4, 16)) * 0.3).to(dtype)
        kn, vn = (torch.from_numpy(rng.standard_normal((2, 3, 2, 16)) * 2).to(dtype)
                  for _ in range(2))
        kc0 = kc.clone()
        out, lse = attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens,
                                          block_table=table, k_scale=ks, v_scale=vs,
                                          causal=True, return_lse=True)
        assert_appended(kc, kc0, ks, kn, fmt, scales, lens, table)
        n = lens.numpy() + 3
        kf, vf = dense(kc, ks, fmt, table, scales), dense(vc, vs, fmt, table, scales)
        for bi in range(2):
            r_out, r_lse = reference.attention_forward(
                q[bi:bi + 1].double().numpy(), kf[bi:bi + 1, :n[bi]], vf[bi:bi + 1, :n[bi]],
                causal=True)
            # bfloat16: q, the dequantised rows and P V's P are rounded to bfloat16.
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            np.testing.assert_allclose(out[bi:bi + 1].double().numpy(), r_out, atol=tol * 3,
                                       rtol=tol)
            np.testing.assert_allclose(lse[bi:bi + 1].numpy(), r_lse, atol=tol, rtol=tol)
        lens = lens + 3


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("scales", ["static", "dynamic"])
@pytest.mark.parametrize("fmt", kvquant.FORMATS)
def test_codes_are_read_exactly(fmt, scales, paged):
    """With unit scales an 8-bit cache gives bitwise the out and lse of a cache in q's dtype
    holding decode(code) (every code is exact in every float dtype): the kernels
    widen the codes in registers as they widen 16-bit rows, in the decode path (up to 4 query
    rows per kv head; 8 widen them into a tile first) and the tiled one (20 rows x 2 heads). head_dim 44 leaves a tail after
    every vector width. On AVX512-BF16 CPUs both caches' scores under bfloat16 q are pair
    dot products, the codes widened to bfloat16 pairs."""
    rng = np.random.default_rng(2)
    kc, vc, ks, vs, table = make_cache(rng, fmt, scales, paged=paged, d=44)
    ks, vs = torch.ones_like(ks), torch.ones_like(vs)
    values = lambda c: torch.from_numpy(
        kvquant.decode_table(fmt)[c.view(torch.uint8).numpy()].astype(np.float32))
    lens = torch.tensor([30, 40], dtype=torch.int32)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        kt, vt = values(kc).to(dtype), values(vc).to(dtype)
        assert torch.equal(kt.float(), values(kc)), "a code not exact in this dtype"
        for sq in (1, 2, 4, 20):  # 2, 4, 8 rows per kv head read the codes in the products
            q = torch.from_numpy(rng.standard_normal((2, sq, 4, 44)) * 0.5).to(dtype)
            got = attention_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table,
                                         k_scale=ks, v_scale=vs, causal=True, return_lse=True)
            want = attention_with_kvcache(q, kt, vt, cache_seqlens=lens, block_table=table,
                                          causal=True, return_lse=True)
            for g, w in zip(got, want):
                assert torch.equal(g, w), (dtype, sq, (g.float() - w.float()).abs().max())


@pytest.mark.parametrize("fmt,scales", [
    ("float8_e4m3fn", "unit"), ("float8_e4m3fn", "static"), ("float8_e4m3fn", "dynamic"),
    ("float8_e5m2", "unit"), ("float8_e5m2", "dynamic"), ("int8", "dynamic")])
def test_nonfinite_value_next_to_excluded_pairs(fmt, scales):
    """A value of V that is not finite -- a float8 NaN code, or (int8) a row whose v_scale,
    1e37, overflows its values -- reaches only the rows that see its key: the rows that the
    causal mask keeps from it stay finite (the strong zero, docs/semantics.md), as with a
    float32 cache holding the values decode(code) * scale, NaN and Inf included: bitwise with
    unit scales, to float32 rounding otherwise -- in the decode path (4 query rows) and the
    tiled one (20 rows)."""
    rng = np.random.default_rng(3)
    kc, vc, ks, vs, table = make_cache(rng, fmt, "dynamic" if scales == "dynamic" else "static",
                                       d=32)
    if scales == "unit":
        ks, vs = torch.ones_like(ks), torch.ones_like(vs)
    if fmt == "int8":
        vs[1, 38, 0] = 1e37
    else:
        vc.view(torch.uint8)[1, 38, 0, 5] = 0x7F  # NaN in both float8 encodings
    def values(c, s):
        with np.errstate(over="ignore"):  # the int8 row scaled by 1e37
            return torch.from_numpy(kvquant.decode_table(fmt)[c.view(torch.uint8).numpy()]
                                    .astype(np.float32) * s.numpy()[..., None])
    kt, vt = values(kc, ks), values(vc, vs)
    assert not torch.isfinite(vt[1, 38, 0]).all()
    lens = torch.tensor([30, 40], dtype=torch.int32)
    for sq in (4, 20):
        q = torch.from_numpy(rng.standard_normal((2, sq, 4, 32)) * 0.5).float()
        got = attention_with_kvcache(q, kc, vc, cache_seqlens=lens, k_scale=ks, v_scale=vs,
                                     causal=True)
        want = attention_with_kvcache(q, kt, vt, cache_seqlens=lens, causal=True)
        # query i of sequence 1 sees keys <= 40 - sq + i: key 38 from i = sq - 2 on
        assert torch.isfinite(got[1, :sq - 2]).all()
        assert not torch.isfinite(got[1, sq - 2:, :2]).all()
        tol = 0 if scales == "unit" else 1e-5
        torch.testing.assert_close(got, want, rtol=tol, atol=tol, equal_nan=True)


def test_numpy_caches_and_ml_dtypes_names():
    """NumPy: int8 caches, and float8 caches as uint8 bytes named by cache_dtype."""
    rng = np.random.default_rng(2)
    for fmt in kvquant.FORMATS:
        kc, vc, ks, vs, _ = make_cache(rng, fmt, "static", b=1, cap=24)
        q = rng.standard_normal((1, 1, 4, 16)).astype(np.float32)
        kn = vn = None
        codes = [c.view(torch.int8 if fmt == "int8" else torch.uint8).numpy().copy()
                 for c in (kc, vc)]
        kw = {} if fmt == "int8" else dict(cache_dtype=fmt)
        out = attention_with_kvcache(q, codes[0], codes[1], kn, vn, cache_seqlens=24,
                                     k_scale=ks.numpy(), v_scale=vs.numpy(), **kw)
        want = attention_with_kvcache(torch.from_numpy(q), kc, vc, cache_seqlens=24,
                                      k_scale=ks, v_scale=vs)
        np.testing.assert_array_equal(out, want.numpy())


def test_calibration():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 100, 3, 8)).astype(np.float32)
    x[0, 0, 1, 0] = 50.0  # an outlier in head 1
    s = kvquant.calibrate_scales(x, "int8")
    np.testing.assert_allclose(s, np.abs(x).max(axis=(0, 1, 3)) / 127, rtol=1e-6)
    p = kvquant.calibrate_scales(torch.from_numpy(x), "float8_e4m3fn", method="percentile",
                                 percentile=99.0)
    assert p.dtype == np.float32 and p.shape == (3,) and p[1] < 50.0 / 448
    with pytest.raises(ValueError, match="method"):
        kvquant.calibrate_scales(x, "int8", method="mse")
    with pytest.raises(ValueError, match="format"):
        kvquant.calibrate_scales(x, "int4")


def test_bad_scales_and_caches_are_refused_untouched():
    rng = np.random.default_rng(4)
    kc, vc, ks, vs, _ = make_cache(rng, "float8_e4m3fn", "static", b=1, cap=16)
    q = torch.randn(1, 1, 4, 16)
    kn, vn = torch.randn(1, 1, 2, 16), torch.randn(1, 1, 2, 16)
    before = kc.view(torch.uint8).clone()
    cases = [
        (dict(k_scale=None, v_scale=vs), ValueError, "k_scale: required"),
        (dict(k_scale=ks[:1], v_scale=vs), ValueError, r"k_scale: expected shape \(2,\)"),
        (dict(k_scale=ks.double(), v_scale=vs), TypeError, "k_scale: expected float32"),
        (dict(k_scale=-ks, v_scale=vs), ValueError, "k_scale: static scales must be finite"),
        (dict(k_scale=ks, v_scale=vs * float("nan")), ValueError,
         "v_scale: static scales must be finite and > 0, got nan for kv head 0"),
        (dict(k_scale=ks, v_scale=vs * float("inf")), ValueError, "v_scale: static scales"),
        (dict(k_scale=ks, v_scale=torch.ones(1, 16, 2)), ValueError, "v_scale: shape"),
    ]
    for kw, err, match in cases:
        with pytest.raises(err, match=match):
            attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=3, **kw)
    with pytest.raises(TypeError, match="v_cache: encoding"):
        attention_with_kvcache(q, kc, vc.view(torch.uint8).view(torch.float8_e5m2), kn, vn,
                               cache_seqlens=3, k_scale=ks, v_scale=vs)
    with pytest.raises(ValueError, match="k_scale: given for a float32 cache"):
        attention_with_kvcache(q, torch.zeros(1, 16, 2, 16), torch.zeros(1, 16, 2, 16),
                               cache_seqlens=3, k_scale=ks, v_scale=vs)
    with pytest.raises(ValueError, match="cache_seqlens"):  # the kernels' own check
        attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=16, k_scale=ks, v_scale=vs)
    assert torch.equal(kc.view(torch.uint8), before)
    with pytest.raises(TypeError, match="cache_dtype"):
        attention_with_kvcache(q.numpy(), before.numpy(), before.numpy(), cache_seqlens=3,
                               k_scale=ks.numpy(), v_scale=vs.numpy())
