"""fmha.kvcache.attention_with_kvcache (docs/semantics.md, "KV caches"): contiguous and paged
caches against fmha.reference.attention_with_kvcache; the appended rows and only they are
written; paged == contiguous and 1 thread == 2 threads bitwise (also past the kernel's
2048-key chunks); token-by-token decode == one causal prefill; and refused calls that leave
both caches byte for byte unchanged.

Unused cache rows (past a sequence's rows, and the pool's unassigned blocks) hold NaN, and
block-table entries past a sequence's rows hold out-of-range block ids: the call must read
neither (docs: "table entries past L_b are never read").
"""

from __future__ import annotations

import numpy as np
import pytest

import fmha
from conftest import TOL_F32, TOL_F64, to_f64
from kvcache_cases import (CASES, CONTIGUOUS, LAYOUTS, LIB_DTYPES, TOL_LSE, TOL_OUT, Caches, Call,
                           assert_near, convert, copy, int32, ints, need_lib, raw)
from fmha import reference
from fmha.kvcache import attention_with_kvcache

@pytest.mark.parametrize("lib,dtype", LIB_DTYPES, ids=[f"{a}-{b}" for a, b in LIB_DTYPES])
@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"bs{x}" if x != CONTIGUOUS else x
                                                 for x in LAYOUTS])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference_and_writes_only_the_appended_rows(rng, case, layout, lib, dtype):
    c = Call(rng, CASES[case], layout, lib, dtype)
    seqlens = int32(c.lens, lib)
    ref_out, ref_lse = c.reference()

    out, lse = attention_with_kvcache(c.q, c.k_cache, c.v_cache, c.k, c.v, cache_seqlens=seqlens,
                                      block_table=c.table, alibi_slopes=c.alibi, return_lse=True,
                                      **c.kw)

    assert tuple(out.shape) == (c.batch, c.sq, c.hq, c.dv)
    assert tuple(lse.shape) == (c.batch, c.hq, c.sq)
    assert str(out.dtype).endswith(dtype)
    assert str(lse.dtype).endswith("float64" if dtype == "float64" else "float32")
    assert_near("out", out, ref_out, TOL_OUT[dtype])
    assert_near("lse", lse, ref_lse, TOL_LSE[dtype])
    # Sequence 0 with no rows at all sees no key: out 0, lse -inf.
    if c.k is None:
        assert np.all(to_f64(out)[0] == 0) and np.all(np.isneginf(to_f64(lse)[0]))
    # The caches: the appended rows, nothing else; cache_seqlens is not advanced.
    c.assert_only_appended()
    assert np.array_equal(to_f64(seqlens), c.lens)


def test_shared_prefix_block_read_by_two_sequences_is_accepted(rng):
    """A full block read by two sequences (a forked prefix), each appending into its own
    block: allowed, and each sequence sees the shared rows."""
    bs, hkv, d = 4, 2, 16
    pool_k = rng.standard_normal((8, bs, hkv, d))
    pool_v = rng.standard_normal((8, bs, hkv, d))
    table = np.array([[0, 1, 2], [0, 4, 5]], np.int32)
    lens = np.array([5, 6], np.int32)
    q = rng.standard_normal((2, 2, 4, d))
    k, v = rng.standard_normal((2, 2, hkv, d)), rng.standard_normal((2, 2, hkv, d))
    ref_out, ref_lse = reference.attention_with_kvcache(
        q, pool_k, pool_v, k, v, cache_seqlens=lens, block_table=table, causal=True)
    kc, vc = pool_k.copy(), pool_v.copy()
    out, lse = attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, block_table=table,
                                      causal=True, return_lse=True)
    assert_near("out", out, ref_out, TOL_F64)
    assert_near("lse", lse, ref_lse, TOL_F64)
    assert np.array_equal(kc[0], pool_k[0]) and np.array_equal(vc[0], pool_v[0])
    assert np.array_equal(kc[1, 1:3], k[0]) and np.array_equal(kc[4, 2:4], k[1])
    assert np.array_equal(vc[1, 1:3], v[0]) and np.array_equal(vc[4, 2:4], v[1])


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_heads_major_caches_are_read_and_written_through_their_strides(rng, lib):
    """Caches stored (batch, heads, capacity, d) and passed as a transposed view
    (batch, capacity, heads, d): the appended rows land in the storage, in place."""
    need_lib(lib)
    lens = [0, 6, 11]
    caches = Caches(rng, lens, 13, 2, 16, 16, reserve=2)
    store_k = convert(caches.k64.transpose(0, 2, 1, 3), "float32", lib)
    store_v = convert(caches.v64.transpose(0, 2, 1, 3), "float32", lib)
    k_cache, v_cache = (x.swapaxes(1, 2) if lib == "numpy" else x.transpose(1, 2)
                        for x in (store_k, store_v))
    q = convert(rng.standard_normal((3, 2, 4, 16)), "float32", lib)
    k = convert(rng.standard_normal((3, 2, 2, 16)), "float32", lib)
    v = convert(rng.standard_normal((3, 2, 2, 16)), "float32", lib)
    want_k, want_v = caches.expected_after_append(copy(k_cache), copy(v_cache), k, v)
    ref_out, ref_lse = reference.attention_with_kvcache(
        to_f64(q), to_f64(k_cache), to_f64(v_cache), to_f64(k), to_f64(v), cache_seqlens=lens,
        causal=True)
    out, lse = attention_with_kvcache(q, k_cache, v_cache, k, v, causal=True,
                                      cache_seqlens=int32(lens, lib), return_lse=True)
    assert_near("out", out, ref_out, TOL_F32)
    assert_near("lse", lse, ref_lse, TOL_F32)
    assert raw(k_cache) == raw(want_k) and raw(v_cache) == raw(want_v)


# ============================================================================ 2, 3: bitwise

# (block_size, contiguous capacity, paged capacity, lens, heads_q, heads_kv, seqlen_q,
#  seqlen_new, call keywords)
BITWISE = {
    "bs7-capacities-differ": (7, 50, 42, [0, 13, 40], 4, 2, 2, 2, dict(causal=True)),
    "bs1": (1, 30, 40, [5, 0, 28], 4, 1, 1, 1, dict(softcap=3.0)),
    "bs16-alibi": (16, 64, 48, [47, 20, 1], 4, 2, 3, 1, dict(causal=True, alibi=True)),
    "bs256-no-append": (256, 40, 256, [39, 3, 17], 2, 2, 2, 0, dict(window=(4, 1))),
    # Past 2048 keys: split into 2048-key chunks merged by lse.
    "long-bs16": (16, 4200, 4208, [4100], 1, 1, 1, 3, {}),
    "long-bs16-causal-q4": (16, 4200, 4208, [4190], 1, 1, 4, 3, dict(causal=True)),
    "long-bs16-batch2-chunk-edges": (16, 4300, 4224, [2046, 4093], 2, 1, 2, 3,
                                     dict(causal=True, alibi=True, softcap=5.0)),
}


def _bitwise_setup(rng, case):
    bs, cap_c, cap_p, lens, hq, hkv, sq, sn, kw = BITWISE[case]
    kw = dict(kw)
    d = 16
    batch = len(lens)
    paged = Caches(rng, lens, cap_p, hkv, d, d, bs, reserve=sn)
    assert paged.capacity == cap_p
    # The same rows in a contiguous cache of another capacity (NaN past the rows).
    k_c = np.full((batch, cap_c, hkv, d), np.nan)
    v_c = np.full((batch, cap_c, hkv, d), np.nan)
    for b, n in enumerate(lens):
        k_c[b, :n], v_c[b, :n] = paged.k_rows[b, :n], paged.v_rows[b, :n]
    f32 = np.float32
    q = rng.standard_normal((batch, sq, hq, d)).astype(f32)
    k = v = None
    if sn:
        k = rng.standard_normal((batch, sn, hkv, d)).astype(f32)
        v = rng.standard_normal((batch, sn, hkv, d)).astype(f32)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = rng.uniform(0.01, 0.5, (hq,)).astype(f32)
    args = dict(q=q, k=k, v=v, cache_seqlens=np.asarray(lens, np.int32), return_lse=True, **kw)
    contiguous = (k_c.astype(f32), v_c.astype(f32), None)
    pool = (paged.k64.astype(f32), paged.v64.astype(f32), paged.table)
    return args, contiguous, pool, paged


def _run(args, k_cache, v_cache, table):
    """One call on copies of the caches: (out, lse, k_cache after, v_cache after)."""
    kc, vc = k_cache.copy(), v_cache.copy()
    a = dict(args)
    out, lse = attention_with_kvcache(a.pop("q"), kc, vc, a.pop("k"), a.pop("v"),
                                      block_table=table, **a)
    return out, lse, kc, vc


@pytest.mark.parametrize("case", list(BITWISE))
def test_paged_equals_contiguous_bitwise(rng, case):
    args, contiguous, pool, paged = _bitwise_setup(rng, case)
    out_c, lse_c, kc, vc = _run(args, *contiguous)
    out_p, lse_p, kp, vp = _run(args, *pool)
    assert np.array_equal(out_c, out_p) and np.array_equal(lse_c, lse_p)
    # The same rows were appended to both.
    lens, sn = args["cache_seqlens"], 0 if args["k"] is None else args["k"].shape[1]
    for b, n in enumerate(lens):
        rows = int(n) + sn
        assert np.array_equal(reference.kvcache_rows(kc, b, rows),
                              reference.kvcache_rows(kp, b, rows, paged.table))
        assert np.array_equal(reference.kvcache_rows(vc, b, rows),
                              reference.kvcache_rows(vp, b, rows, paged.table))
    if case.startswith("long"):  # the chunked path is also right, not merely consistent
        ref_out, ref_lse = reference.attention_with_kvcache(
            args["q"], contiguous[0], contiguous[1], args["k"], args["v"],
            cache_seqlens=lens, alibi_slopes=args.get("alibi_slopes"),
            causal=args.get("causal", False), softcap=args.get("softcap", 0.0))
        assert_near("out", out_c, ref_out, TOL_F32)
        assert_near("lse", lse_c, ref_lse, TOL_F32)


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("case", ["bs7-capacities-differ", "long-bs16-batch2-chunk-edges",
                                  "long-bs16-causal-q4"])
def test_results_do_not_depend_on_thread_count(rng, restore_threads, case, layout):
    args, contiguous, pool, _ = _bitwise_setup(rng, case)
    caches = contiguous if layout == "contiguous" else pool
    results = []
    for n in (1, 2):
        fmha.set_num_threads(n)
        results.append(_run(args, *caches))
    fmha.set_num_threads(None)
    results.append(_run(args, *caches))  # the default
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert raw(a) == raw(b)


# ============================================================================ 4. decode

@pytest.mark.parametrize("layout", [CONTIGUOUS, 4])
def test_token_by_token_decode_equals_one_causal_prefill(rng, layout):
    batch, n, prefill, hq, hkv, d = 2, 20, 5, 4, 2, 16
    f32 = np.float32
    q_all = rng.standard_normal((batch, n, hq, d)).astype(f32)
    k_all = rng.standard_normal((batch, n, hkv, d)).astype(f32)
    v_all = rng.standard_normal((batch, n, hkv, d)).astype(f32)
    caches = Caches(rng, [0] * batch, 24, hkv, d, d, None if layout == CONTIGUOUS else layout,
                    reserve=24)
    k_cache, v_cache = caches.k64.astype(f32), caches.v64.astype(f32)
    seqlens = np.zeros(batch, np.int32)
    outs = []
    for a, z in [(0, prefill)] + [(t, t + 1) for t in range(prefill, n)]:
        outs.append(attention_with_kvcache(q_all[:, a:z], k_cache, v_cache, k_all[:, a:z],
                                           v_all[:, a:z], cache_seqlens=seqlens,
                                           block_table=caches.table, causal=True))
        assert np.all(seqlens == a)  # not advanced by the call
        seqlens += z - a
    want = fmha.attention(q_all, k_all, v_all, causal=True)
    assert_near("out", np.concatenate(outs, axis=1), want.astype(np.float64), TOL_F32)
    for b in range(batch):
        assert np.array_equal(reference.kvcache_rows(k_cache, b, n, caches.table), k_all[b])
        assert np.array_equal(reference.kvcache_rows(v_cache, b, n, caches.table), v_all[b])


# ============================================================================ 5. bad input

def _bad_base(lib, paged=True):
    """A valid call: batch 2, heads 4 / 2, head_dim 8, seqlen_new 2; paged: 8 blocks of 4
    rows, tables [[0, 1, 2], [3, 4, 5]] (capacity 12), lens [5, 6]; contiguous: capacity 10."""
    rng = np.random.default_rng(11)
    shape = (8, 4, 2, 8) if paged else (2, 10, 2, 8)
    a = dict(q=rng.standard_normal((2, 1, 4, 8)), k_cache=rng.standard_normal(shape),
             v_cache=rng.standard_normal(shape), k=rng.standard_normal((2, 2, 2, 8)),
             v=rng.standard_normal((2, 2, 2, 8)))
    a = {name: convert(x, "float32", lib) for name, x in a.items()}
    a["cache_seqlens"] = np.array([5, 6], np.int32)
    a["block_table"] = np.array([[0, 1, 2], [3, 4, 5]], np.int32) if paged else None
    return a


def _set(**changes):
    def change(a, lib):
        for name, value in changes.items():
            if isinstance(value, np.ndarray) and value.dtype.kind in "iu":
                value = ints(value, lib)
            a[name] = value
    return change


def _retype(name, dtype):
    def change(a, lib):
        a[name] = convert(to_f64(a[name]), dtype, lib)
    return change


def _reshape(name, shape):
    def change(a, lib):
        a[name] = convert(np.zeros(shape), "float32", lib)
    return change


def _read_only(a, lib):
    a["k_cache"].flags.writeable = False


# id: (paged base?, change, exception, message fragment, numpy only?)
BAD = {
    "capacity-exceeded-paged": (True, _set(cache_seqlens=np.array([5, 11], np.int32)),
                                ValueError, r"cache_seqlens: entry 1 is 11; .* capacity of 12",
                                False),
    "capacity-exceeded-contiguous": (False, _set(cache_seqlens=np.array([5, 9], np.int32)),
                                     ValueError, r"cache_seqlens: entry 1 is 9; .* capacity of 10",
                                     False),
    "negative-cache-seqlens": (True, _set(cache_seqlens=np.array([5, -1], np.int32)),
                               ValueError, r"cache_seqlens: entry 1 is -1, expected >= 0",
                               False),
    "block-out-of-range": (True, _set(block_table=np.array([[0, 1, 2], [3, 8, 5]], np.int32)),
                           ValueError, r"block_table: entry \[1, 1\] is 8, .*\[0, 8\)", False),
    "block-negative": (True, _set(block_table=np.array([[0, 1, 2], [-1, 4, 5]], np.int32)),
                       ValueError, r"block_table: entry \[1, 0\] is -1", False),
    # rows 5, 6 of sequence 0 and 6, 7 of sequence 1 both land in block 1
    "block-appended-by-two-sequences": (
        True, _set(block_table=np.array([[0, 1, 2], [3, 1, 5]], np.int32)), ValueError,
        r"block_table: block 1 is appended to through entries \[0, 1\] and \[1, 1\]", False),
    # sequence 1 reads block 1 (its rows 0..3) while sequence 0 appends to it
    "block-read-by-another-while-appended": (
        True, _set(block_table=np.array([[0, 1, 2], [1, 4, 5]], np.int32)), ValueError,
        r"block_table: block 1 is read through entry \[1, 0\] and appended to through entry "
        r"\[0, 1\]", False),
    # the same, the reader first
    "block-read-before-appended-by-another": (
        True, _set(block_table=np.array([[4, 1, 2], [3, 4, 5]], np.int32)), ValueError,
        r"block_table: block 4 is read through entry \[0, 0\] and appended to through entry "
        r"\[1, 1\]", False),
    # one sequence's table names block 1 twice: the append would overwrite its own row 0
    "block-twice-in-one-table": (
        True, _set(block_table=np.array([[1, 1, 2], [3, 4, 5]], np.int32)), ValueError,
        r"block_table: block 1 is read through entry \[0, 0\] and appended to through entry "
        r"\[0, 1\]", False),
    "dtype-mismatch-q-vs-caches": (True, _retype("q", "float64"), TypeError,
                                   r"k_cache: dtype float32 differs from q's float64", False),
    "dtype-mismatch-new-v": (True, _retype("v", "float64"), TypeError,
                             r"v: dtype float64 differs from q's float32", False),
    "heads-mismatch-new-k": (True, _reshape("k", (2, 2, 1, 8)), ValueError,
                             r"k: dimension 2 is 1, expected 2", False),
    "head-dim-mismatch-q-vs-caches": (True, _reshape("q", (2, 1, 4, 16)), ValueError,
                                      r"k_cache: dimension 3 is 8, expected 16", False),
    "cache-seqlens-int64": (True, _set(cache_seqlens=np.array([5, 6], np.int64)), TypeError,
                            r"cache_seqlens: expected int32, got int64", False),
    "cache-seqlens-wrong-length": (True, _set(cache_seqlens=np.array([5, 6, 0], np.int32)),
                                   ValueError, r"cache_seqlens: expected 2 entries", False),
    "k-without-v": (True, _set(v=None), ValueError, r"k, v: give both", False),
    "block-table-wrong-rows": (True, _set(block_table=np.zeros((3, 3), np.int32)), ValueError,
                               r"block_table: expected 2 rows", False),
    "q-not-an-array": (True, _set(q=[[[[0.0] * 8] * 4]] * 2), TypeError,
                       r"q: expected a torch.Tensor or numpy.ndarray", False),
    "read-only-numpy-cache": (True, _read_only, ValueError,
                              r"k_cache: read-only array; the cache must be writable", True),
}


@pytest.mark.parametrize("lib", ["numpy", "torch"])
@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_refused_and_changes_nothing(case, lib):
    paged, change, exc, match, numpy_only = BAD[case]
    if numpy_only and lib != "numpy":
        pytest.skip("NumPy arrays only")
    need_lib(lib)
    a = _bad_base(lib, paged)
    a["cache_seqlens"] = int32(a["cache_seqlens"], lib)
    if a["block_table"] is not None:
        a["block_table"] = int32(a["block_table"], lib)
    change(a, lib)
    k_cache, v_cache = a.pop("k_cache"), a.pop("v_cache")
    before = raw(k_cache), raw(v_cache)
    with pytest.raises(exc, match=match):
        attention_with_kvcache(a.pop("q"), k_cache, v_cache, a.pop("k"), a.pop("v"), **a)
    assert (raw(k_cache), raw(v_cache)) == before


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_bad_base_call_is_valid(lib):
    """The base of the bad-input cases is itself accepted (so each case fails for its one
    change), contiguous and paged."""
    need_lib(lib)
    for paged in (True, False):
        a = _bad_base(lib, paged)
        a["cache_seqlens"] = int32(a["cache_seqlens"], lib)
        if paged:
            a["block_table"] = int32(a["block_table"], lib)
        out = attention_with_kvcache(a.pop("q"), a.pop("k_cache"), a.pop("v_cache"),
                                     a.pop("k"), a.pop("v"), **a)
        assert tuple(out.shape) == (2, 1, 4, 8)


# ============================================================================ 6. int lengths

@pytest.mark.parametrize("lib", ["numpy", "torch"])
@pytest.mark.parametrize("layout", [CONTIGUOUS, 5])
def test_cache_seqlens_int_is_the_filled_array(rng, lib, layout):
    need_lib(lib)
    batch, n = 3, 9
    caches = Caches(rng, [n] * batch, 20, 2, 16, 16, None if layout == CONTIGUOUS else layout,
                    reserve=2)
    q = convert(rng.standard_normal((batch, 2, 4, 16)), "float32", lib)
    k = convert(rng.standard_normal((batch, 2, 2, 16)), "float32", lib)
    v = convert(rng.standard_normal((batch, 2, 2, 16)), "float32", lib)
    results = []
    for lens in (n, np.full(batch, n, np.int32)):
        k_cache, v_cache, table = caches.arrays("float32", lib)
        if not isinstance(lens, int):
            lens = int32(lens, lib)
        out, lse = attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens,
                                          block_table=table, causal=True, return_lse=True)
        results.append([raw(x) for x in (out, lse, k_cache, v_cache)])
    assert results[0] == results[1]


def test_strided_lengths_and_table_are_read_like_contiguous_ones(rng):
    """cache_seqlens and block_table are read only: a strided view gives the same call."""
    caches = Caches(rng, [3, 7], 16, 2, 8, 8, 4, reserve=1)
    q = rng.standard_normal((2, 1, 2, 8)).astype(np.float32)
    k_cache, v_cache, table = caches.arrays("float32", "numpy")
    lens = np.array([3, 3, 7, 7], np.int32)[::2]
    wide = np.repeat(table, 2, axis=1)[:, ::2]
    out = attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=wide)
    ref = attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=np.ascontiguousarray(lens),
                                 block_table=table)
    assert raw(out) == raw(ref)


def test_cache_that_requires_grad_is_refused():
    torch = pytest.importorskip("torch")
    k_cache = torch.zeros(1, 4, 1, 8, requires_grad=True)
    v_cache = torch.zeros(1, 4, 1, 8)
    with pytest.raises(ValueError, match="k_cache: requires grad"):
        attention_with_kvcache(torch.zeros(1, 1, 1, 8), k_cache, v_cache,
                               cache_seqlens=torch.zeros(1, dtype=torch.int32))


def test_check_refused_without_a_gpu_says_so():
    """fmha.kvcache.check_refused reads a CUDA device's record: without a usable GPU it
    raises NotImplementedError saying why, for the default device and an explicit one."""
    from fmha import _C
    from fmha.kvcache import check_refused
    if _C.cuda_built() and _C.cuda_device_count() > 0:
        pytest.skip("a GPU is present: the record is readable")
    for device in (None, 0):
        with pytest.raises(NotImplementedError, match="CUDA"):
            check_refused(device)
