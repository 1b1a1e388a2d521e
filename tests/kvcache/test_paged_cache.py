"""fmha.kvcache.PagedKVCache: block accounting, fork with copy-on-write, reference counts,
refused reservations that change nothing, and decoding through the cache against the
reference (float64, float32) and against contiguous caches (bitwise)."""

import subprocess
import sys

import numpy as np
import pytest

from fmha import reference
from fmha.kvcache import PagedKVCache, attention_with_kvcache

BS, HKV, HQ, D = 4, 2, 4, 8      # block_size, heads_kv, heads_q (GQA), head_dim


def rows(cache, layer, seq, which="k"):
    """The committed rows of a sequence, gathered from the pool through its blocks."""
    pool = cache.k_pool(layer) if which == "k" else cache.v_pool(layer)
    pool = pool.numpy() if cache.kind == "torch" else pool
    return reference.kvcache_rows(pool, 0, cache.length(seq), np.array([cache.blocks(seq)]))


def step(cache, ids, q, k, v):
    """One reserve -> attention (every layer) -> commit step; the outputs per layer."""
    n = k.shape[1]
    cache.reserve(ids, n)
    outs = [cache.attention(layer, q, k, v, ids, causal=True)
            for layer in range(cache.num_layers)]
    cache.commit(ids, n)
    return outs


def state(cache):
    """Everything reserve may change, to check that a refused call changed nothing."""
    ids = list(cache._length)
    return (cache.num_free_blocks, [cache.blocks(s) for s in ids],
            [cache.length(s) for s in ids], list(cache._refs))


def draw(rng, batch, n, heads=HKV):
    return rng.standard_normal((batch, n, heads, D))


def test_accounting():
    cache = PagedKVCache(8, BS, 2, HKV, D, head_dim_v=6, dtype=np.float64)
    per_token = 2 * HKV * (D + 6) * 8
    assert cache.bytes_per_token() == per_token
    assert cache.k_pool(1).shape == (8, BS, HKV, D) and cache.v_pool(1).shape == (8, BS, HKV, 6)
    assert cache.num_free_blocks == 8 and cache.bytes_used() == 0
    assert cache.bytes_free() == 8 * BS * per_token
    a, b = cache.add_sequence(), cache.add_sequence()
    assert a != b and cache.length(a) == 0 and cache.blocks(a) == []
    cache.reserve([a, b], 5)                       # 2 blocks each
    assert cache.num_free_blocks == 4 and len(cache.blocks(a)) == 2
    assert cache.bytes_used() == 4 * BS * per_token
    assert cache.bytes_used() + cache.bytes_free() == 8 * BS * per_token
    cache.reserve([a, b], 5)                       # again: already there
    assert cache.num_free_blocks == 4
    cache.commit([a, b], 5)
    assert cache.length(a) == cache.length(b) == 5
    cache.reserve([a], 3)                          # rows 5..7 fit in block 2 of 2
    assert cache.num_free_blocks == 4
    cache.reserve([a], 4)                          # row 8 needs a third block
    assert cache.num_free_blocks == 3


def test_fork_copy_on_write(rng):
    cache = PagedKVCache(6, BS, 2, HKV, D, dtype=np.float64)
    parent = cache.add_sequence()
    step(cache, [parent], draw(rng, 1, 6, HQ), draw(rng, 1, 6), draw(rng, 1, 6))
    before = [rows(cache, layer, parent, w) for layer in range(2) for w in "kv"]
    child = cache.fork(parent)
    assert cache.blocks(child) == cache.blocks(parent) and cache.length(child) == 6
    assert cache.num_free_blocks == 4              # shared, not copied

    k_child, v_child = draw(rng, 1, 1), draw(rng, 1, 1)
    step(cache, [child], draw(rng, 1, 1, HQ), k_child, v_child)
    # The full block stays shared; the partial one was copied before the child wrote to it.
    assert cache.blocks(child)[0] == cache.blocks(parent)[0]
    assert cache.blocks(child)[1] != cache.blocks(parent)[1]
    assert cache.num_free_blocks == 3
    assert all(np.array_equal(a, b) for a, b in zip(
        before, [rows(cache, layer, parent, w) for layer in range(2) for w in "kv"]))
    for layer in range(2):
        assert np.array_equal(rows(cache, layer, child)[:6], before[2 * layer])
        assert np.array_equal(rows(cache, layer, child)[6], k_child[0, 0])
        assert np.array_equal(rows(cache, layer, child, "v")[6], v_child[0, 0])

    # The parent's own continuation lands in its (now unshared) block, in place.
    k_parent = draw(rng, 1, 1)
    step(cache, [parent], draw(rng, 1, 1, HQ), k_parent, draw(rng, 1, 1))
    assert cache.num_free_blocks == 3
    assert np.array_equal(rows(cache, 1, parent)[6], k_parent[0, 0])
    assert np.array_equal(rows(cache, 1, child)[6], k_child[0, 0])


def test_fork_appending_together_copies_once(rng):
    cache = PagedKVCache(6, BS, 1, HKV, D, dtype=np.float64)
    a = cache.add_sequence()
    step(cache, [a], draw(rng, 1, 2, HQ), draw(rng, 1, 2), draw(rng, 1, 2))
    b = cache.fork(a)
    free = cache.num_free_blocks
    # Both append into the shared block: one of them gets a copy, the other keeps it.
    step(cache, [a, b], draw(rng, 2, 1, HQ), draw(rng, 2, 1), draw(rng, 2, 1))
    assert cache.num_free_blocks == free - 1
    assert cache.blocks(a) != cache.blocks(b)


def test_free_returns_blocks_with_refcounts(rng):
    cache = PagedKVCache(6, BS, 1, HKV, D, dtype=np.float64)
    a = cache.add_sequence()
    step(cache, [a], draw(rng, 1, 6, HQ), draw(rng, 1, 6), draw(rng, 1, 6))
    b = cache.fork(a)
    c = cache.fork(b)
    assert cache.num_free_blocks == 4
    cache.free(a)
    assert cache.num_free_blocks == 4              # b and c still hold both blocks
    step(cache, [c], draw(rng, 1, 1, HQ), draw(rng, 1, 1), draw(rng, 1, 1))
    assert cache.num_free_blocks == 3              # c copied the partial block
    cache.free(b)
    assert cache.num_free_blocks == 4              # b's partial block had no other user
    cache.free(c)
    assert cache.num_free_blocks == 6 and cache.bytes_used() == 0
    with pytest.raises(ValueError, match=f"seq_id: unknown sequence {c}"):
        cache.length(c)


def test_refused_reserve_changes_nothing(rng):
    cache = PagedKVCache(3, BS, 1, HKV, D, dtype=np.float64, max_blocks_per_seq=2)
    a, b = cache.add_sequence(), cache.add_sequence()
    step(cache, [a], draw(rng, 1, 3, HQ), draw(rng, 1, 3), draw(rng, 1, 3))
    c = cache.fork(a)
    snapshot = state(cache)
    with pytest.raises(RuntimeError, match="out of KV-cache blocks: .* need 4 new blocks, "
                                           "2 of 3 are free"):
        cache.reserve([b, a, c], 2)                # b: 1; a: a copy of block 0 + 1; c: 1
    assert state(cache) == snapshot
    with pytest.raises(ValueError, match="max_blocks_per_seq=2"):
        cache.reserve([b, a], 6)                   # a: 9 rows
    assert state(cache) == snapshot
    with pytest.raises(ValueError, match="seq_ids: unknown sequence 7"):
        cache.reserve([a, 7], 1)
    with pytest.raises(ValueError, match=f"seq_ids: sequence {a} is listed twice"):
        cache.reserve([a, a], 1)
    assert state(cache) == snapshot
    cache.reserve([b, a, c], 1)                    # b: 1; a: a copy (c keeps block 0)
    assert cache.num_free_blocks == 0


def test_attention_needs_a_reservation(rng):
    cache = PagedKVCache(4, BS, 1, HKV, D, dtype=np.float64)
    a = cache.add_sequence()
    step(cache, [a], draw(rng, 1, 2, HQ), draw(rng, 1, 2), draw(rng, 1, 2))
    b = cache.fork(a)
    q, k, v = draw(rng, 1, 1, HQ), draw(rng, 1, 1), draw(rng, 1, 1)
    # b's next row would land in the block it shares with a: reserve must copy it first.
    with pytest.raises(RuntimeError, match="call reserve"):
        cache.attention(0, q, k, v, [b])
    with pytest.raises(RuntimeError, match="call reserve"):
        cache.commit([b], 3)
    with pytest.raises(ValueError, match="layer: expected < num_layers=1"):
        cache.attention(1, q, k, v, [a])
    with pytest.raises(ValueError, match="q: expected shape"):
        cache.attention(0, q, k, v, [a, b])


def decode(rng, cache, prompts, steps, fork_at=None):
    """Prefills each sequence alone (the prompts differ in length), then decodes them
    together one row at a time, forking sequence 0 after step ``fork_at``. Every layer's
    output is checked against the reference on rows kept apart from the cache, and the
    cache's rows against those at the end. Returns the largest difference."""
    if cache.kind == "torch":
        import torch
        cast = lambda x: torch.from_numpy(x.astype(np.float32))  # noqa: E731
    else:
        cast = lambda x: x.astype(cache.dtype)  # noqa: E731
    layers = range(cache.num_layers)
    ids, hist_k, hist_v = [], [], []               # hist_*[i][layer]: rows of sequence i
    worst = 0.0

    def run(idx, n):
        """One step of the sequences ids[idx], checked, then recorded in the history."""
        nonlocal worst
        batch = len(idx)
        q, k, v = (cast(draw(rng, batch, n, h)) for h in (HQ, HKV, HKV))
        outs = step(cache, [ids[i] for i in idx], q, k, v)
        q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
        lens = [len(hist_k[i][0]) for i in idx]
        for layer in layers:
            kc = np.zeros((batch, max(lens) + 1, HKV, D))
            vc = np.zeros_like(kc)
            for row, i in enumerate(idx):
                kc[row, :lens[row]] = hist_k[i][layer]
                vc[row, :lens[row]] = hist_v[i][layer]
            ref, _ = reference.attention_with_kvcache(
                q, kc, vc, k, v, cache_seqlens=np.array(lens, np.int32), causal=True)
            worst = max(worst, float(np.abs(np.asarray(outs[layer], np.float64) - ref).max()))
        for row, i in enumerate(idx):
            hist_k[i] = [np.concatenate([h, k[row]]) for h in hist_k[i]]
            hist_v[i] = [np.concatenate([h, v[row]]) for h in hist_v[i]]

    for n in prompts:
        ids.append(cache.add_sequence())
        hist_k.append([np.zeros((0, HKV, D))] * len(layers))
        hist_v.append([np.zeros((0, HKV, D))] * len(layers))
        run([len(ids) - 1], n)
    for t in range(steps):
        run(list(range(len(ids))), 1)
        if t == fork_at:
            ids.append(cache.fork(ids[0]))
            hist_k.append(list(hist_k[0]))
            hist_v.append(list(hist_v[0]))
    for i, seq in enumerate(ids):
        for layer in layers:
            assert np.array_equal(rows(cache, layer, seq), hist_k[i][layer])
            assert np.array_equal(rows(cache, layer, seq, "v"), hist_v[i][layer])
    return worst


def test_decode_matches_reference_float64(rng):
    cache = PagedKVCache(16, BS, 2, HKV, D, dtype=np.float64)
    assert decode(rng, cache, prompts=[5, 1, 8], steps=6, fork_at=1) < 1e-10


def test_decode_matches_reference_torch_float32(rng):
    torch = pytest.importorskip("torch")
    cache = PagedKVCache(16, BS, 2, HKV, D, dtype=torch.float32)
    assert isinstance(cache.k_pool(0), torch.Tensor)
    assert decode(rng, cache, prompts=[5, 1, 8], steps=6, fork_at=1) < 1e-5


def test_paged_equals_contiguous_bitwise(rng):
    prompts, steps, layers = [6, 3, 9], 7, 2
    cache = PagedKVCache(24, BS, layers, HKV, D, dtype=np.float32)
    cap = max(prompts) + steps
    kc = np.zeros((layers, len(prompts), cap, HKV, D), np.float32)
    vc = np.zeros_like(kc)

    def f32(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    ids = [cache.add_sequence() for _ in prompts]
    for b, (seq, n) in enumerate(zip(ids, prompts)):
        q, k, v = f32(1, n, HQ, D), f32(1, n, HKV, D), f32(1, n, HKV, D)
        paged = step(cache, [seq], q, k, v)
        for layer in range(layers):
            flat = attention_with_kvcache(q, kc[layer, b:b + 1], vc[layer, b:b + 1], k, v,
                                          cache_seqlens=0, causal=True)
            assert np.array_equal(paged[layer], flat)
    lens = np.array(prompts, np.int32)
    for _ in range(steps):
        q, k, v = f32(3, 1, HQ, D), f32(3, 1, HKV, D), f32(3, 1, HKV, D)
        paged = step(cache, ids, q, k, v)
        for layer in range(layers):
            flat = attention_with_kvcache(q, kc[layer], vc[layer], k, v, cache_seqlens=lens,
                                          causal=True)
            assert np.array_equal(paged[layer], flat)
        lens += 1
    # The sequences' blocks are interleaved in the pool, so the paged reads were scattered.
    assert any(np.diff(cache.blocks(s)).max() > 1 for s in ids)


def test_numpy_cache_does_not_import_torch():
    code = ("import sys, numpy as np; from fmha.kvcache import PagedKVCache; "
            "c = PagedKVCache(2, 4, 1, 1, 8, dtype=np.float32); s = c.add_sequence(); "
            "c.reserve([s], 1); q = np.zeros((1, 1, 1, 8), np.float32); "
            "c.attention(0, q, q, q, [s]); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ---------------------------------------------------------------- 8-bit pools

def eightbit_pools_match_contiguous(rng, dtype, code_dtype, static):
    """Prompts, decode steps, a fork whose child appends into a copied block: every output
    of the 8-bit paged cache equals attention_with_kvcache's over contiguous 8-bit caches
    holding the same rows (bitwise), and the parent's codes and scales survive the fork."""
    prompts, steps, layers = [6, 3], 4, 2
    kw = {}
    if static:
        kw = dict(k_scale=np.full((layers, HKV), 0.05, np.float32),
                  v_scale=np.full((layers, HKV), 0.04, np.float32))
    cache = PagedKVCache(24, BS, layers, HKV, D, dtype=dtype, **kw)
    lib = cache.kind
    cap = max(prompts) + steps + 1
    code_np = np.int8 if cache.format == "int8" else np.uint8
    flat_k = np.zeros((layers, 3, cap, HKV, D), code_np)
    flat_v = np.zeros_like(flat_k)
    flat_ks = np.zeros((layers, 3, cap, HKV), np.float32)
    flat_vs = np.zeros_like(flat_ks)
    if lib == "torch":
        import torch
        to = lambda x: torch.from_numpy(x).view(code_dtype) if x.dtype == code_np else \
            torch.from_numpy(x)  # noqa: E731
        qdt = torch.bfloat16
    else:
        to = lambda x: x  # noqa: E731
        qdt = np.float32
    fk, fv, fks, fvs = (to(x) for x in (flat_k, flat_v, flat_ks, flat_vs))

    def draw_rows(*shape):
        x = rng.standard_normal(shape).astype(np.float32)
        return torch.from_numpy(x).to(qdt) if lib == "torch" else x

    def flat_call(layer, rows_b, q, k, v, lens):
        extra = {} if lib == "torch" or cache.format == "int8" else dict(cache_dtype=cache.format)
        if static:
            extra.update(k_scale=cache.k_scale(layer), v_scale=cache.v_scale(layer))
        else:
            extra.update(k_scale=fks[layer, rows_b], v_scale=fvs[layer, rows_b])
        if lib == "torch" and isinstance(lens, np.ndarray):
            lens = torch.from_numpy(lens.copy())
        return attention_with_kvcache(q, fk[layer, rows_b], fv[layer, rows_b], k, v,
                                      cache_seqlens=lens, causal=True, **extra)

    def same(a, b):
        a, b = (x.float().numpy() if lib == "torch" else x for x in (a, b))
        assert np.array_equal(a, b)

    ids = [cache.add_sequence() for _ in prompts]
    for b, (seq, n) in enumerate(zip(ids, prompts)):
        q, k, v = draw_rows(1, n, HQ, D), draw_rows(1, n, HKV, D), draw_rows(1, n, HKV, D)
        paged = step(cache, [seq], q, k, v)
        for layer in range(layers):
            same(paged[layer], flat_call(layer, slice(b, b + 1), q, k, v, 0))
    lens = np.array(prompts, np.int32)
    for _ in range(steps):
        q, k, v = draw_rows(2, 1, HQ, D), draw_rows(2, 1, HKV, D), draw_rows(2, 1, HKV, D)
        paged = step(cache, ids, q, k, v)
        for layer in range(layers):
            same(paged[layer], flat_call(layer, slice(0, 2), q, k, v, lens))
        lens += 1
    # Fork sequence 0 (10 rows: its third block is partial) and append to the child: the
    # block is copied with its scales; the parent's rows and scales are unchanged.
    parent = ids[0]
    as_np = lambda x: (x.view(torch.uint8) if x.dtype == code_dtype else x).numpy() \
        if lib == "torch" else x  # noqa: E731
    before = [as_np(x).copy() for x in (cache.k_pool(0), cache.k_scale(0))]
    child = cache.fork(parent)
    for layer in range(layers):  # the child's rows so far, as a third contiguous sequence
        for src, dst in ((fk, fk), (fv, fv)) + (() if static else ((fks, fks), (fvs, fvs))):
            dst[layer, 2] = src[layer, 0]
    q, k, v = draw_rows(1, 1, HQ, D), draw_rows(1, 1, HKV, D), draw_rows(1, 1, HKV, D)
    paged = step(cache, [child], q, k, v)
    for layer in range(layers):
        same(paged[layer], flat_call(layer, slice(2, 3), q, k, v, lens[:1]))
    after = [as_np(x) for x in (cache.k_pool(0), cache.k_scale(0))]
    held = cache.blocks(parent)
    for x, y in zip(before, after):
        if x.ndim >= 3:  # the parent's blocks (static scales: (heads_kv,), unchanged)
            assert np.array_equal(x[held], y[held])
    assert cache.blocks(child)[-1] != held[len(cache.blocks(child)) - 1]


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("name", ["int8", "float8_e4m3fn", "float8_e5m2"])
def test_8bit_pools_torch(rng, name, static):
    torch = pytest.importorskip("torch")
    dt = getattr(torch, name)
    eightbit_pools_match_contiguous(rng, dt, dt, static)


@pytest.mark.parametrize("name", ["int8", "float8_e5m2"])
def test_8bit_pools_numpy(rng, name):
    eightbit_pools_match_contiguous(rng, np.int8 if name == "int8" else name, None, False)


def test_8bit_pools_accounting_and_refusals():
    c = PagedKVCache(4, BS, 2, HKV, D, dtype="float8_e4m3fn")
    assert c.format == "float8_e4m3fn" and c.dynamic_scales
    assert c.k_pool(0).dtype == np.uint8 and c.k_scale(1).shape == (4, BS, HKV)
    assert c.bytes_per_token() == 2 * HKV * (2 * D + 8)
    s = PagedKVCache(4, BS, 2, HKV, D, dtype=np.int8, k_scale=np.ones((2, HKV)),
                     v_scale=np.ones((2, HKV)))
    assert not s.dynamic_scales and s.k_scale(0).shape == (HKV,)
    assert s.bytes_per_token() == 2 * HKV * 2 * D
    with pytest.raises(ValueError, match="k_scale, v_scale: only with an 8-bit dtype"):
        PagedKVCache(4, BS, 1, HKV, D, dtype=np.float32, k_scale=np.ones((1, HKV)),
                     v_scale=np.ones((1, HKV)))
    with pytest.raises(ValueError, match="give both"):
        PagedKVCache(4, BS, 1, HKV, D, dtype=np.int8, k_scale=np.ones((1, HKV)))
    with pytest.raises(ValueError, match=r"k_scale: expected shape \(1, 2\)"):
        PagedKVCache(4, BS, 1, HKV, D, dtype=np.int8, k_scale=np.ones(HKV),
                     v_scale=np.ones(HKV))
    with pytest.raises(ValueError, match="v_scale: expected positive"):
        PagedKVCache(4, BS, 1, HKV, D, dtype=np.int8, k_scale=np.ones((1, HKV)),
                     v_scale=np.zeros((1, HKV)))
    with pytest.raises(TypeError, match="dtype"):
        PagedKVCache(4, BS, 1, HKV, D, dtype=np.int16)
