"""fmha.kvcache.attention_with_kvcache on the CUDA decode kernels (csrc/cuda/flash_decode.cuh):
under the SIMT emulator (backend ``emu``) and on a real GPU (``gpu``), through the public
function (conftest's ``backend`` fixture swaps the kernel module behind it).

The same checks as tests/kvcache/test_kvcache.py for the CPU, in float16 / bfloat16: the reference
with contiguous and paged caches (block sizes 1, 7, 16), ragged lengths including 0, GQA
and MQA, causal, windows, ALiBi, softcap, appends; key splits (FlashDecoding) and their
merge; paged == contiguous bitwise; token-by-token decode == one causal prefill. And what
is CUDA's own: cache_seqlens and block_table are checked on the device (lengths, block
ranges, and blocks appended to through one entry but used through another), so a bad value is
refused there -- caches byte for byte unchanged, out and lse NaN, and the refusal reported
by fmha.kvcache.check_refused -- and a NaN in a V row no query sees stays out.

Unused cache rows are NaN and table entries past a sequence's rows are out-of-range block
ids (kvcache_cases.Caches): the kernels must read neither. The emulator runs every CUDA
thread of a block in turn: shapes stay small.
"""

from __future__ import annotations

import numpy as np
import pytest

import fmha
from fmha import reference
from fmha._core import _kernel_module
from fmha.kvcache import attention_with_kvcache, check_refused
from kvcache_cases import CASES, CONTIGUOUS, Caches, Call, assert_near, convert, int32, raw

pytestmark = [pytest.mark.backends("emu", "gpu"), pytest.mark.usefixtures("backend")]

#: bfloat16 stores out with 8 bits of mantissa (test_kvcache's rule); float16 with 11.
TOL = {"float16": 4e-3, "bfloat16": 2e-2}
LIB_DTYPES = [("numpy", "float16"), ("torch", "bfloat16")]


def lib_dtype(i):
    """The (lib, dtype) pairs in turn, so each case runs in one of them."""
    return LIB_DTYPES[i % len(LIB_DTYPES)]


def call(q, k_cache, v_cache, k, v, lens, table, **kw):
    return attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens,
                                  block_table=table, return_lse=True, **kw)


def check_case(rng, spec, layout, lib, dtype, capacity=37, lens=None, **extra):
    """kvcache_cases.Call's case, with extra keywords, against the reference."""
    c = Call(rng, spec, layout, lib, dtype, capacity, lens)
    c.kw.update(extra)
    ref_out, ref_lse = c.reference()
    out, lse = call(c.q, c.k_cache, c.v_cache, c.k, c.v, int32(c.lens, lib), c.table,
                    alibi_slopes=c.alibi, **c.kw)
    assert_near("out", out, ref_out, TOL[dtype])
    assert_near("lse", lse, ref_lse, 1e-5)
    c.assert_only_appended()
    check_refused(0)  # nothing was refused


# ============================================================================ 1. reference

GRID = [(case, layout) for case in CASES for layout in (CONTIGUOUS, 1, 7, 16)]


@pytest.mark.parametrize("i", range(len(GRID)), ids=[f"{c}-{'bs%s' % l if l != CONTIGUOUS else l}"
                                                     for c, l in GRID])
def test_matches_reference_and_writes_only_the_appended_rows(rng, i):
    case, layout = GRID[i]
    check_case(rng, CASES[case], layout, *lib_dtype(i))


# Key splits: capacities past 256 keys split each sequence at 256-key positions (or into
# num_splits ranges of the capacity); sequences of 0, < 256, = 256 and > 512 rows.
SPLITS = {
    "decode-gqa-default-splits": ("chunked-prefill-gqa-causal", CONTIGUOUS, {}),
    "paged-bs16-window-mqa": ("mqa-causal-window-3-0", 16, {}),
    "alibi-softcap-num-splits-5": ("alibi-heads-softcap-scale", 7, dict(num_splits=5)),
}


@pytest.mark.parametrize("case", list(SPLITS))
def test_key_splits_match_reference(rng, case):
    name, layout, extra = SPLITS[case]
    lib, dtype = lib_dtype(list(SPLITS).index(case))
    sn = CASES[name][3]
    check_case(rng, CASES[name], layout, lib, dtype, capacity=600, lens=[0, 256 - sn, 589],
               **extra)


def test_head_dims_and_wide_groups(rng):
    """head_dim 128 (16-byte loads), 40 (a tail in the 64 tile), a head_dim_v of 96, a GQA
    group of 12 rows (two row blocks of 8), and head_dim 12 (rows not 16-byte aligned:
    element loads)."""
    for hq, hkv, d, dv, sq in ((4, 2, 128, 128, 1), (2, 1, 40, 96, 1), (12, 2, 32, 32, 2),
                               (2, 1, 12, 12, 1)):
        check_case(rng, (hq, hkv, sq, 1, d, dv, dict(causal=True)), 5, "numpy", "float16",
                   capacity=23)


# Whole 32-key chunks whose pairs all count run the decode kernel's steady P V loop
# (flash_decode.cuh): sequences of several chunks and key splits, GQA groups that fill 4- and
# 8-row CTAs or part of one, lanes that load V by 2, 3, 4 and 8 columns, contiguous and paged.
# A window moves where the keys start (its first chunk may fall short). A head_dim_v short of
# its tile takes the general loop for every chunk, and three causal queries for the last chunk
# of each split, whose pairs the mask splits (lengths of whole chunks: 96 and 288).
WHOLE_CHUNKS = {  # name: (heads_q, heads_kv, seqlen_q, head_dim, head_dim_v, layout, keywords)
    "d64-group8": (8, 1, 1, 64, 64, CONTIGUOUS, {}),
    "d128-group4-paged16": (8, 2, 1, 128, 128, 16, {}),
    "d96-group2": (2, 1, 1, 96, 96, CONTIGUOUS, {}),
    "d256-group4-paged7": (4, 1, 1, 256, 256, 7, {}),
    "d128-dv100-paged16": (4, 2, 1, 128, 100, 16, {}),
    "d64-group8-window": (8, 1, 1, 64, 64, CONTIGUOUS, dict(window=(70, 0))),
    "d64-group2-causal-3-queries": (2, 1, 3, 64, 64, CONTIGUOUS, dict(causal=True)),
}
#: Sequence lengths (the new row appended): a partial last chunk, or whole chunks only.
WHOLE_CHUNK_LENS = {"d64-group2-causal-3-queries": [0, 95, 287]}


@pytest.mark.parametrize("name", list(WHOLE_CHUNKS))
def test_whole_chunks_match_the_reference(rng, name):
    hq, hkv, sq, d, dv, layout, kw = WHOLE_CHUNKS[name]
    lib, dtype = lib_dtype(list(WHOLE_CHUNKS).index(name))
    check_case(rng, (hq, hkv, sq, 1, d, dv, kw), layout, lib, dtype, capacity=300,
               lens=WHOLE_CHUNK_LENS.get(name, [0, 75, 299]))


# ============================================================================ 2. bitwise

def _misaligned(x):
    """x's values in an array whose data starts one element past a 16-byte boundary: a call
    with it takes the element-wise loads and the general P V loop (launch.vec is false)."""
    n = int(np.prod(x.shape))
    if isinstance(x, np.ndarray):
        flat = np.empty(n + 16, x.dtype)
        off = (-flat.ctypes.data) % 16 // x.itemsize + 1
        out = flat[off:off + n].reshape(x.shape)
        out[...] = x
    else:
        import torch
        flat = torch.empty(n + 16, dtype=x.dtype)
        off = (-flat.data_ptr()) % 16 // x.element_size() + 1
        out = flat[off:off + n].view(x.shape)
        out.copy_(x)
    return out


@pytest.mark.parametrize("name", ["d64-group8", "d128-group4-paged16", "d96-group2",
                                  "d256-group4-paged7"])
def test_steady_loop_equals_the_general_loop_bitwise(rng, name):
    """The steady P V loop takes each O element's keys in the order the general loop does:
    the same caches read through aligned rows (steady loop) and through a V cache one element
    off 16 bytes (element-wise loads, general loop) give equal out and lse, bit for bit. Twice:
    random values, and values whose sum shows the order within each group of four keys --
    q = 0 (every P exactly 1) and V rows cycling B, s, -B, s with B = 2^15, s = 2^-10, where
    float32 drops s added to +-B."""
    hq, hkv, sq, d, dv, layout, kw = WHOLE_CHUNKS[name]
    lib, dtype = lib_dtype(list(WHOLE_CHUNKS).index(name))
    c = Call(rng, (hq, hkv, sq, 0, d, dv, kw), layout, lib, dtype, capacity=300,
             lens=[0, 75, 300])
    v64, table = c.caches.v64.copy(), c.caches.table
    cycle = (2.0 ** 15, 2.0 ** -10, -2.0 ** 15, 2.0 ** -10)
    for b, n in enumerate(c.lens):
        for j in range(n):
            at = (b, j) if table is None else (table[b, j // layout], j % layout)
            v64[at] = cycle[j % 4]
    lens = int32(c.lens, lib)
    for q, v_cache in ((c.q, c.v_cache),
                       (convert(np.zeros(c.q.shape), dtype, lib), convert(v64, dtype, lib))):
        got = call(q, c.k_cache, v_cache, None, None, lens, c.table, **c.kw)
        want = call(q, c.k_cache, _misaligned(v_cache), None, None, lens, c.table, **c.kw)
        for g, w in zip(got, want):
            assert raw(g) == raw(w)
    check_refused(0)


def _pool(rows, lens, block_size, max_blocks, rng):
    """rows (batch, n, heads, d) as a pool of scattered blocks of block_size rows (2 spare)
    and its table; rows past lens[b] (+ room for the append) are left NaN."""
    batch = rows.shape[0]
    num_blocks = batch * max_blocks + 2
    table = rng.permutation(num_blocks)[:batch * max_blocks].reshape(batch, max_blocks)
    pool = np.full((num_blocks, block_size) + rows.shape[2:], np.nan, rows.dtype)
    for b in range(batch):
        for j in range(lens[b]):
            pool[table[b, j // block_size], j % block_size] = rows[b, j]
    return pool, table.astype(np.int32)


@pytest.mark.parametrize("sq,causal", [(1, False), (3, True)])
def test_paged_equals_contiguous_bitwise(rng, sq, causal):
    """The same rows, contiguous (capacity 560) and paged (block sizes 16 and 7, other
    capacities): equal out and lse, also across key splits."""
    lens, hq, hkv, d = [300, 5], 4, 2, 32
    q, k, v = (convert(rng.standard_normal((2, sq, h, d)), "float16", "numpy")
               for h in (hq, hkv, hkv))
    k_rows, v_rows = (convert(rng.standard_normal((2, 560, hkv, d)), "float16", "numpy")
                      for _ in range(2))
    for b, n in enumerate(lens):
        k_rows[b, n:] = v_rows[b, n:] = np.nan
    results = [call(q, k_rows.copy(), v_rows.copy(), k, v, int32(lens, "numpy"), None,
                    causal=causal)]
    for block_size, max_blocks in ((16, 25), (7, 46)):
        (kp, table), (vp, _) = (_pool(x, lens, block_size, max_blocks,
                                      np.random.default_rng(3)) for x in (k_rows, v_rows))
        results.append(call(q, kp, vp, k, v, int32(lens, "numpy"), table, causal=causal))
    for out, lse in results[1:]:
        assert raw(out) == raw(results[0][0]) and raw(lse) == raw(results[0][1])


def test_token_by_token_decode_equals_one_causal_prefill(rng):
    batch, n, prefill, hq, hkv, d = 2, 9, 4, 4, 2, 32
    q_all = convert(rng.standard_normal((batch, n, hq, d)), "float16", "numpy")
    k_all = convert(rng.standard_normal((batch, n, hkv, d)), "float16", "numpy")
    v_all = convert(rng.standard_normal((batch, n, hkv, d)), "float16", "numpy")
    caches = Caches(rng, [0] * batch, 12, hkv, d, d, 4, reserve=12)
    k_cache, v_cache, table = caches.arrays("float16", "numpy")
    seqlens = np.zeros(batch, np.int32)
    outs = []
    for a, z in [(0, prefill)] + [(t, t + 1) for t in range(prefill, n)]:
        out, _ = call(q_all[:, a:z], k_cache, v_cache, k_all[:, a:z], v_all[:, a:z], seqlens,
                      table, causal=True)
        outs.append(out)
        seqlens += z - a
    want = reference.attention_forward(q_all.astype(np.float64), k_all.astype(np.float64),
                                       v_all.astype(np.float64), causal=True)[0]
    assert_near("out", np.concatenate(outs, axis=1), want, TOL["float16"])
    for b in range(batch):
        assert raw(reference.kvcache_rows(k_cache, b, n, table)) == raw(k_all[b])


# ============================================================================ 3. refusals

def _refusal_base(rng):
    """Batch 2, heads 4 / 2, head_dim 16, 2 new rows; pool of 8 blocks of 4 rows, tables
    [[0, 1, 2], [3, 4, 5]] (capacity 12), lens [5, 6]."""
    f16 = lambda *s: rng.standard_normal(s).astype(np.float16)  # noqa: E731
    return dict(q=f16(2, 1, 4, 16), k_cache=f16(8, 4, 2, 16), v_cache=f16(8, 4, 2, 16),
                k=f16(2, 2, 2, 16), v=f16(2, 2, 2, 16), lens=np.array([5, 6], np.int32),
                table=np.array([[0, 1, 2], [3, 4, 5]], np.int32))


REFUSED = {
    "negative-length": (dict(lens=[5, -1]), "an entry was negative"),
    "over-capacity": (dict(lens=[5, 11]), "exceeded the cache's capacity"),
    "block-out-of-range": (dict(table=[[0, 1, 2], [3, 8, 5]]), r"outside \[0, num_blocks\)"),
    "block-negative-read": (dict(table=[[-1, 1, 2], [3, 4, 5]]), r"outside \[0, num_blocks\)"),
    # rows 5, 6 of sequence 0 and 6, 7 of sequence 1 would both land in block 1
    "block-appended-by-two-sequences": (dict(table=[[0, 1, 2], [3, 1, 5]]),
                                        "appended to through one table entry"),
    # sequence 1 reads block 1 (its rows 0..3) while sequence 0 appends to it
    "block-read-while-appended": (dict(table=[[0, 1, 2], [1, 4, 5]]),
                                  "appended to through one table entry"),
    # one table names block 1 twice: the append would overwrite the sequence's own row 0
    "block-twice-in-one-table": (dict(table=[[1, 1, 2], [3, 4, 5]]),
                                 "appended to through one table entry"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_device_refusal_writes_nothing_and_is_reported(rng, case):
    change, message = REFUSED[case]
    a = _refusal_base(rng)
    for name, value in change.items():
        a[name] = np.array(value, np.int32)
    before = raw(a["k_cache"]), raw(a["v_cache"])
    check_refused(0)  # a clean record to start from
    out, lse = call(a["q"], a["k_cache"], a["v_cache"], a["k"], a["v"], a["lens"], a["table"])
    assert (raw(a["k_cache"]), raw(a["v_cache"])) == before
    assert np.isnan(out.astype(np.float32)).all() and np.isnan(lse).all()
    with pytest.raises(ValueError, match=message):
        check_refused(0)
    check_refused(0)  # reported once, then cleared
    # The same call with good values goes through.
    good = _refusal_base(rng)
    out, _ = call(good["q"], good["k_cache"], good["v_cache"], good["k"], good["v"],
                  good["lens"], good["table"])
    assert np.isfinite(out.astype(np.float32)).all()
    check_refused(0)


def test_nan_in_rows_outside_the_window_stays_out(rng):
    """Three queries with a causal window of 10 keys: V rows 61 and 62 hold NaN and Inf.
    Queries 0 and 1 see them (their out is NaN, as the reference says); query 2's window
    starts at row 63, so its out is finite though those rows sit in the chunk it reads."""
    lens, hq, hkv, d, sq = [70], 4, 2, 32, 3
    caches = Caches(rng, lens, 96, hkv, d, d, 8, reserve=sq)
    k_cache, v_cache, table = caches.arrays("float16", "numpy")
    for j in list(range(0, 40)) + [61, 62]:
        blk, r = table[0, j // 8], j % 8
        v_cache[blk, r, :, ::3] = np.nan
        v_cache[blk, r, :, 1::3] = np.inf
    q, k, v = (convert(rng.standard_normal((1, sq, h, d)), "float16", "numpy")
               for h in (hq, hkv, hkv))
    f64 = lambda x: x.astype(np.float64)  # noqa: E731
    ref_out, ref_lse = reference.attention_with_kvcache(
        f64(q), f64(k_cache), f64(v_cache), f64(k), f64(v), cache_seqlens=lens,
        block_table=table, window=(9, 0))
    out, lse = call(q, k_cache, v_cache, k, v, int32(lens, "numpy"), table, window=(9, 0))
    # Column by column, as IEEE arithmetic says (a NaN may stand for an Inf: semantics.md).
    bad = ~np.isfinite(ref_out)
    assert bad[:, :2, :, ::3].all() and bad[:, :2, :, 1::3].all() and not bad[:, 2].any()
    out = out.astype(np.float64)
    assert np.array_equal(~np.isfinite(out), bad)
    assert np.abs(out[~bad] - ref_out[~bad]).max() <= TOL["float16"] * np.abs(ref_out[~bad]).max()
    assert_near("lse", lse, ref_lse, 1e-5)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_a_query_of_nan_makes_its_rows_nan(rng, num_splits):
    """A NaN in one query makes every score of its rows NaN: out and lse NaN there, as on
    the CPU, with and without key splits (fmaxf drops NaN from the running max, so a row
    whose every score is NaN must not read as a row with no visible key). The other rows,
    the same group's included, stay finite and equal the reference."""
    lens, hq, hkv, d = [70, 90], 4, 2, 32
    caches = Caches(rng, lens, 96, hkv, d, d)
    k_cache, v_cache, _ = caches.arrays("float16", "numpy")
    q = convert(rng.standard_normal((2, 1, hq, d)), "float16", "numpy")
    q[1, 0, 2, 5] = np.nan  # batch 1, head 2 (kv head 1, the group's first row)
    lens32 = int32(lens, "numpy")
    out, lse = call(q, k_cache, v_cache, None, None, lens32, None, num_splits=num_splits)
    with _kernel_module(fmha._C):
        cpu_out, cpu_lse = call(*(x.astype(np.float32) for x in (q, k_cache, v_cache)),
                                None, None, lens32, None)
    nan = np.zeros((2, 1, hq), bool)
    nan[1, 0, 2] = True
    out = out.astype(np.float64)
    for got_out, got_lse, who in ((out, lse, "cuda"), (cpu_out, cpu_lse, "cpu")):
        assert np.isnan(got_out[nan]).all() and np.isnan(got_lse.transpose(0, 2, 1)[nan]).all(), who
        assert np.isfinite(got_out[~nan]).all(), who
    assert np.abs(out[~nan] - cpu_out[~nan]).max() <= TOL["float16"] * np.abs(cpu_out[~nan]).max()
    check_refused(0)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_a_row_of_weight_zero_keys_still_meets_a_nan_in_v(rng, num_splits):
    """An -inf in one query against keys whose entry there is positive makes every score of
    its row -inf: weight 0 for every key, lse -inf, but the keys take part, so a NaN in a
    visible V row reaches that column of out (0 * NaN), as on the CPU and in the reference --
    with and without key splits, whose merge must not read the row as one without keys."""
    lens, hq, hkv, d = [70, 90], 4, 2, 32
    caches = Caches(rng, lens, 96, hkv, d, d)
    k_cache, v_cache, _ = caches.arrays("float16", "numpy")
    q = convert(rng.standard_normal((2, 1, hq, d)), "float16", "numpy")
    k_cache[1, :, 1, 5] = np.abs(k_cache[1, :, 1, 5]) + np.float16(0.5)
    q[1, 0, 2, 5] = -np.inf     # batch 1, head 2 (kv head 1): every score -inf
    v_cache[1, 40, 1, 7] = np.nan  # a key both rows of kv head 1 see
    lens32 = int32(lens, "numpy")
    out, lse = call(q, k_cache, v_cache, None, None, lens32, None, num_splits=num_splits)
    with _kernel_module(fmha._C):
        cpu_out, cpu_lse = call(*(x.astype(np.float32) for x in (q, k_cache, v_cache)),
                                None, None, lens32, None)
    out = out.astype(np.float64)
    bad = ~np.isfinite(cpu_out)
    assert bad[1, 0, 2, 7] and bad[1, 0, 3, 7] and bad.sum() == 2
    assert np.isneginf(cpu_lse[1, 2, 0]) and np.isneginf(lse[1, 2, 0])
    assert np.array_equal(~np.isfinite(out), bad)
    assert np.abs(out[~bad] - cpu_out[~bad]).max() <= TOL["float16"] * np.abs(cpu_out[~bad]).max()
    check_refused(0)


def test_float32_is_refused_on_the_cuda_kernels(rng):
    a = _refusal_base(rng)
    q32 = a["q"].astype(np.float32)
    with pytest.raises(NotImplementedError, match="float16/bfloat16"):
        call(q32, a["k_cache"].astype(np.float32), a["v_cache"].astype(np.float32), None, None,
             a["lens"], a["table"])


def test_fmha_attention_on_the_same_rows_agrees(rng):
    """A cache call and fmha.attention on the gathered rows (both the CUDA kernels): close."""
    lens, hq, hkv, d = [40], 4, 1, 64
    caches = Caches(rng, lens, 48, hkv, d, d, None, reserve=0)
    k_cache, v_cache, _ = caches.arrays("float16", "numpy")
    q = convert(rng.standard_normal((1, 1, hq, d)), "float16", "numpy")
    out, _ = call(q, k_cache, v_cache, None, None, int32(lens, "numpy"), None)
    want = fmha.attention(q, k_cache[:, :40], v_cache[:, :40])
    assert_near("out", out, want.astype(np.float64), TOL["float16"])


def test_paged_kv_cache_with_a_fork_decodes_on_the_cuda_kernels(rng, backend):
    """PagedKVCache (block size 4, a fork sharing a prefix) driven through four steps: the
    CUDA kernels give, step by step, what the CPU kernels give on a second cache fed the same
    rows (within float16's tolerance), and both pools end with the same rows."""
    from fmha.kvcache import PagedKVCache
    f16 = lambda *s: rng.standard_normal(s).astype(np.float16)  # noqa: E731
    caches = [PagedKVCache(16, 4, 1, 2, 32, dtype=np.float16) for _ in range(2)]
    ids = [[c.add_sequence() for _ in range(2)] for c in caches]
    outs = [[], []]
    for t, n in enumerate((5, 1, 1, 2)):
        q, k, v = f16(2, n, 4, 32), f16(2, n, 2, 32), f16(2, n, 2, 32)
        for which, (cache, seqs) in enumerate(zip(caches, ids)):
            if t == 2:  # sequence 1 becomes a fork of sequence 0 (copy-on-write of its tail)
                cache.free(seqs[1])
                seqs[1] = cache.fork(seqs[0])
            cache.reserve(seqs, n)
            if which == 0:
                outs[0].append(cache.attention(0, q, k, v, seqs, causal=True))
            else:
                with _kernel_module(fmha._C):
                    outs[1].append(cache.attention(0, q, k, v, seqs, causal=True))
            cache.commit(seqs, n)
    for got, want in zip(*outs):
        assert_near("out", got, want.astype(np.float64), TOL["float16"])
    for s0, s1 in zip(*ids):
        assert caches[0].blocks(s0) == caches[1].blocks(s1)
    assert raw(caches[0].k_pool(0)) == raw(caches[1].k_pool(0))
    check_refused(0)


def test_shared_prefix_block_read_by_two_sequences_is_accepted(rng):
    """A full block read by two sequences (a forked prefix), each appending into a block of
    its own: the device check lets it through, and the result is the reference's."""
    a = _refusal_base(rng)
    table = np.array([[0, 1, 2], [0, 4, 5]], np.int32)
    f64 = lambda x: x.astype(np.float64)  # noqa: E731
    ref_out, _ = reference.attention_with_kvcache(
        f64(a["q"]), f64(a["k_cache"]), f64(a["v_cache"]), f64(a["k"]), f64(a["v"]),
        cache_seqlens=a["lens"], block_table=table, causal=True)
    out, _ = call(a["q"], a["k_cache"], a["v_cache"], a["k"], a["v"], a["lens"], table,
                  causal=True)
    check_refused(0)
    assert_near("out", out, ref_out, TOL["float16"])
