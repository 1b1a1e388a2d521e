"""8-bit KV caches on the CUDA decode kernels (csrc/cuda/flash_decode.cuh), under the SIMT
emulator (backend ``emu``) and on a GPU (``gpu``), through fmha.kvcache.attention_with_kvcache:
int8 / float8_e4m3fn / float8_e5m2 caches with static and dynamic scales, contiguous and
paged, float16 and bfloat16 queries --

* the append quantises as the CPU does (codes and dynamic scales bit for bit those of
  fmha.kvquant), and attention matches the float64 reference on the dequantised cache,
  across key splits;
* with unit scales an 8-bit cache gives bitwise the out and lse of a 16-bit cache holding
  the codes' values (the kernels widen codes exactly), for each head-dim tile the 8-bit
  kernels have (64, 128, 256: kCols 2, 4, 8 codes per lane) and both row blocks (4, 8);
* a NaN code next to pairs the mask excludes reaches only the rows that see its key;
* sequences of whole 32-key chunks (the steady P V loop) match the reference too.

The emulator runs every CUDA thread of a block in turn: shapes stay small.
"""

from __future__ import annotations

import numpy as np
import pytest

from fmha import kvquant, reference
from fmha.kvcache import attention_with_kvcache, check_refused

torch = pytest.importorskip("torch")

from kvquant_cases import assert_appended, dense, make_cache  # noqa: E402

pytestmark = [pytest.mark.backends("emu", "gpu"), pytest.mark.usefixtures("backend")]

#: bfloat16 keeps 8 bits of mantissa in q and out (test_kvcache_cuda's rule); float16 11.
TOL = {torch.float16: 4e-3, torch.bfloat16: 2e-2}


def values(codes):
    """The codes' values as float32 (every code is exact in float16 and bfloat16 too)."""
    fmt = {torch.int8: "int8", torch.float8_e4m3fn: "float8_e4m3fn",
           torch.float8_e5m2: "float8_e5m2"}[codes.dtype]
    return torch.from_numpy(
        kvquant.decode_table(fmt)[codes.view(torch.uint8).numpy()].astype(np.float32))


CASES = [(fmt, scales, paged) for fmt in kvquant.FORMATS for scales in ("static", "dynamic")
         for paged in (False, True)]


@pytest.mark.parametrize("i", range(len(CASES)),
                         ids=[f"{f}-{s}-{'paged' if p else 'contiguous'}" for f, s, p in CASES])
def test_append_and_attention_match_the_reference(i):
    """Two decode steps (1 query: 2 rows per kv head; 3 queries: 6, the 8-row block) with
    new rows appended, GQA 4:2, head_dim 40, past 256 keys (two splits)."""
    fmt, scales, paged = CASES[i]
    dtype = (torch.float16, torch.bfloat16)[i % 2]
    rng = np.random.default_rng(10 + i)
    kc, vc, ks, vs, table = make_cache(rng, fmt, scales, paged=paged, cap=288, d=40, block=16)
    lens = torch.tensor([250, 270], dtype=torch.int32)
    for sq, new in ((1, 2), (3, 3)):
        q = torch.from_numpy(rng.standard_normal((2, sq, 4, 40)) * 0.3).to(dtype)
        kn, vn = (torch.from_numpy(rng.standard_normal((2, new, 2, 40)) * 2).to(dtype)
                  for _ in range(2))
        kc0, vc0 = kc.clone(), vc.clone()
        out, lse = attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens,
                                          block_table=table, k_scale=ks, v_scale=vs,
                                          causal=True, return_lse=True)
        check_refused(0)
        assert_appended(kc, kc0, ks, kn, fmt, scales, lens, table, block=16)
        assert_appended(vc, vc0, vs, vn, fmt, scales, lens, table, block=16)
        n = lens.numpy() + new
        kf, vf = dense(kc, ks, fmt, table, scales), dense(vc, vs, fmt, table, scales)
        tol = TOL[dtype]
        for bi in range(2):
            r_out, r_lse = reference.attention_forward(
                q[bi:bi + 1].double().numpy(), kf[bi:bi + 1, :n[bi]], vf[bi:bi + 1, :n[bi]],
                causal=True)
            np.testing.assert_allclose(out[bi:bi + 1].double().numpy(), r_out, atol=tol * 3,
                                       rtol=tol)
            np.testing.assert_allclose(lse[bi:bi + 1].numpy(), r_lse, atol=1e-4, rtol=1e-5)
        lens = lens + new


@pytest.mark.parametrize("fmt,d,group", [(f, 128, 8) for f in kvquant.FORMATS] +
                         [("int8", 64, 4), ("float8_e5m2", 256, 8)])
def test_whole_chunks_match_the_reference(fmt, d, group):
    """Sequences of several whole 32-key chunks, which run the decode kernel's steady P V loop
    (not e4m3's: it keeps the general one): head dims in their tiles (64, 128, 256: 2, 4, 8
    codes a lane), GQA groups of 4 and 8 (4- and 8-row CTAs; d = 256 takes 4 rows a CTA), 75
    and 300 keys (two splits), dynamic scales, contiguous and paged, float16 queries."""
    rng = np.random.default_rng(23 + d + group)
    for paged in (False, True):
        kc, vc, ks, vs, table = make_cache(rng, fmt, "dynamic", paged=paged, cap=304, hkv=1,
                                           d=d, block=16)
        lens = torch.tensor([75, 300], dtype=torch.int32)
        q = torch.from_numpy(rng.standard_normal((2, 1, group, d)) * 0.3).half()
        out, lse = attention_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table,
                                          k_scale=ks, v_scale=vs, return_lse=True)
        check_refused(0)
        kf, vf = dense(kc, ks, fmt, table, "dynamic"), dense(vc, vs, fmt, table, "dynamic")
        for bi, n in enumerate(lens.tolist()):
            r_out, r_lse = reference.attention_forward(
                q[bi:bi + 1].double().numpy(), kf[bi:bi + 1, :n], vf[bi:bi + 1, :n])
            np.testing.assert_allclose(out[bi:bi + 1].double().numpy(), r_out,
                                       atol=TOL[torch.float16] * 3, rtol=TOL[torch.float16])
            np.testing.assert_allclose(lse[bi:bi + 1].numpy(), r_lse, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("bad", ["negative-k", "nan-v", "zero-v"])
def test_bad_static_scale_is_refused_on_the_device(bad):
    """Static scales stay on the device: the kernels check them (finite, > 0) before the
    append, and a refused call writes nothing, returns NaN and is reported by check_refused,
    as for cache_seqlens (tests/kvcache/test_kvcache_cuda.py)."""
    rng = np.random.default_rng(7)
    kc, vc, ks, vs, _ = make_cache(rng, "int8", "static", b=1, cap=16)
    which, value = {"negative-k": ("k", -1.0), "nan-v": ("v", float("nan")),
                    "zero-v": ("v", 0.0)}[bad]
    (ks if which == "k" else vs)[1] = value
    q = torch.randn(1, 1, 4, 16).half()
    kn, vn = torch.randn(1, 1, 2, 16).half(), torch.randn(1, 1, 2, 16).half()
    before = kc.clone(), vc.clone()
    check_refused(0)
    out, lse = attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=3, k_scale=ks,
                                      v_scale=vs, return_lse=True)
    assert torch.equal(kc.view(torch.uint8), before[0].view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), before[1].view(torch.uint8))
    assert torch.isnan(out.float()).all() and torch.isnan(lse).all()
    with pytest.raises(ValueError, match="k_scale / v_scale: a static scale"):
        check_refused(0)
    check_refused(0)  # reported once, then cleared


@pytest.mark.parametrize("d", [44, 128, 200])
@pytest.mark.parametrize("fmt", kvquant.FORMATS)
def test_codes_are_read_exactly(fmt, d):
    """Unit scales: bitwise the result of a 16-bit cache holding decode(code), in the tiles
    of 64 (head_dim 44: a tail in every 8-code load), 128 and 256 columns, with 2 and 6
    rows per kv head, contiguous and paged; float16 and bfloat16 queries in turn."""
    rng = np.random.default_rng(d)
    for paged in (False, True):
        kc, vc, ks, vs, table = make_cache(rng, fmt, "dynamic", paged=paged, cap=48, d=d)
        ks, vs = torch.ones_like(ks), torch.ones_like(vs)
        lens = torch.tensor([30, 48], dtype=torch.int32)
        for dtype in ((torch.float16, torch.bfloat16)[(d + paged) % 2],):
            kt, vt = values(kc).to(dtype), values(vc).to(dtype)
            for sq in (1, 3):
                q = torch.from_numpy(rng.standard_normal((2, sq, 4, d)) * 0.5).to(dtype)
                got = attention_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table,
                                             k_scale=ks, v_scale=vs, causal=True,
                                             return_lse=True)
                want = attention_with_kvcache(q, kt, vt, cache_seqlens=lens,
                                              block_table=table, causal=True, return_lse=True)
                for g, w in zip(got, want):
                    assert torch.equal(g, w), (paged, dtype, sq,
                                               (g.float() - w.float()).abs().max())
    check_refused(0)


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
def test_nan_code_next_to_excluded_pairs(fmt):
    """A NaN code in V at key 38 of sequence 1 (causal, 4 queries): the two queries that
    see it are NaN, the two before it finite, and everything equals a 16-bit cache holding
    the same values, NaN included (unit scales)."""
    rng = np.random.default_rng(5)
    kc, vc, ks, vs, _ = make_cache(rng, fmt, "static", d=32)
    ks, vs = torch.ones_like(ks), torch.ones_like(vs)
    vc.view(torch.uint8)[1, 38, 0, 5] = 0x7F  # NaN in both float8 encodings
    lens = torch.tensor([30, 40], dtype=torch.int32)
    q = torch.from_numpy(rng.standard_normal((2, 4, 4, 32)) * 0.5).to(torch.float16)
    got = attention_with_kvcache(q, kc, vc, cache_seqlens=lens, k_scale=ks, v_scale=vs,
                                 causal=True)
    want = attention_with_kvcache(q, values(kc).half(), values(vc).half(), cache_seqlens=lens,
                                  causal=True)
    assert torch.isfinite(got[1, :2]).all()
    assert not torch.isfinite(got[1, 2:, :2]).all()
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    check_refused(0)


@pytest.mark.parametrize("fmt", kvquant.FORMATS)
def test_every_code_is_widened_exactly(fmt):
    """All 256 codes of the encoding, as one V row and one K row (head_dim 256, unit scales,
    one cached key): out is the V row's values exactly (NaN where NaN, Inf where Inf), and
    query i, one-hot at dimension i, gets lse = scale * decode(k_i) for every finite code
    (the K row holds 0 in place of the others: a NaN would make every score NaN)."""
    table = kvquant.decode_table(fmt)
    codes = np.arange(256, dtype=np.uint8)
    finite = np.isfinite(table)
    td = {"int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn,
          "float8_e5m2": torch.float8_e5m2}[fmt]
    kc = torch.from_numpy(np.where(finite, codes, 0).astype(np.uint8).reshape(1, 1, 1, 256))
    kc = kc.view(td)
    vc = torch.from_numpy(codes.reshape(1, 1, 1, 256).copy()).view(td)
    ones = torch.ones(1)
    for dtype in (torch.float16, torch.bfloat16):
        q = torch.eye(256, dtype=dtype).reshape(1, 256, 1, 256)
        out, lse = attention_with_kvcache(q, kc, vc, cache_seqlens=1, k_scale=ones,
                                          v_scale=ones, scale=1.0, return_lse=True)
        want_v = torch.from_numpy(table.astype(np.float32))
        torch.testing.assert_close(out[0, 0, 0].float(), want_v, rtol=0, atol=0,
                                   equal_nan=True)
        np.testing.assert_allclose(lse[0, 0].numpy()[finite], table[finite], rtol=1e-6,
                                   atol=0)
    check_refused(0)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_paged_kv_cache_pools(static):
    """fmha.kvcache.PagedKVCache's 8-bit pools on the CUDA kernels: two prompts, decode
    steps, then a fork whose child appends into a copied block (codes and scales copied
    on write): every output equals the call over contiguous 8-bit caches holding the same
    rows, bitwise, and the parent's rows and scales are untouched by the child."""
    from fmha.kvcache import PagedKVCache
    rng = np.random.default_rng(7 + static)
    layers, hkv, hq, d, bs = 2, 2, 4, 40, 4
    kw = {}
    if static:
        kw = dict(k_scale=torch.full((layers, hkv), 0.05), v_scale=torch.full((layers, hkv), 0.04))
    cache = PagedKVCache(16, bs, layers, hkv, d, dtype=torch.float8_e4m3fn, **kw)
    cap = 16
    flat = {n: torch.zeros(layers, 3, cap, hkv, d, dtype=torch.float8_e4m3fn) for n in "kv"}
    fs = {n: torch.zeros(layers, 3, cap, hkv) for n in "kv"}
    rows = lambda *s: torch.from_numpy(rng.standard_normal(s)).to(torch.bfloat16)  # noqa: E731

    def flat_call(layer, sl, q, k, v, lens):
        scales = ((cache.k_scale(layer), cache.v_scale(layer)) if static
                  else (fs["k"][layer, sl], fs["v"][layer, sl]))
        return attention_with_kvcache(q, flat["k"][layer, sl], flat["v"][layer, sl], k, v,
                                      cache_seqlens=lens, k_scale=scales[0],
                                      v_scale=scales[1], causal=True)

    def step(ids, sl, lens, n_new):
        q, k, v = rows(len(ids), n_new, hq, d), rows(len(ids), n_new, hkv, d), rows(
            len(ids), n_new, hkv, d)
        cache.reserve(ids, n_new)
        for layer in range(layers):
            got = cache.attention(layer, q, k, v, ids, causal=True)
            assert torch.equal(got, flat_call(layer, sl, q, k, v, lens))
        cache.commit(ids, n_new)

    ids = [cache.add_sequence() for _ in range(2)]
    step(ids[:1], slice(0, 1), torch.tensor([0], dtype=torch.int32), 6)
    step(ids[1:], slice(1, 2), torch.tensor([0], dtype=torch.int32), 3)
    for i in range(3):
        step(ids, slice(0, 2), torch.tensor([6 + i, 3 + i], dtype=torch.int32), 1)
    before = (cache.k_pool(0).view(torch.uint8).clone(), cache.k_scale(0).clone())
    held = cache.blocks(ids[0])
    child = cache.fork(ids[0])  # 9 rows: the third block is partial, copied on write
    for t in (flat["k"], flat["v"]) + (() if static else (fs["k"], fs["v"])):
        t[:, 2] = t[:, 0]
    step([child], slice(2, 3), torch.tensor([9], dtype=torch.int32), 1)
    assert torch.equal(cache.k_pool(0).view(torch.uint8)[held], before[0][held])
    if not static:
        assert torch.equal(cache.k_scale(0)[held], before[1][held])
    check_refused(0)
