"""fmha.block_mask: building BlockMasks (create_block_mask and the pattern helpers), checked
against dense NumPy evaluations of the same definitions (python/fmha/block_mask.py)."""

from __future__ import annotations

import numpy as np
import pytest

from fmha.block_mask import (EMPTY, FULL, BlockMask, bigbird_mask, causal_mask,
                             create_block_mask, document_mask, longformer_mask)

# name -> (mask_mod, B, H). The expressions work on NumPy arrays and torch tensors alike.
MODS = {
    "causal": (lambda b, h, q, k: k <= q, None, None),
    "window": (lambda b, h, q, k: abs(q - k) <= 5, 2, None),
    "batch_head": (lambda b, h, q, k: (k <= q + 5 * b - 3 * h) | ((q + k) % (h + 3) == 0), 2, 3),
    "nothing": (lambda b, h, q, k: k < 0, None, None),
    "everything": (lambda b, h, q, k: True, None, 2),
}


def dense_of(mask_mod, B, H, sq, sk):
    """mask_mod at every (b, h, i, j), evaluated in one go: the reference."""
    q, k = np.arange(sq).reshape(-1, 1), np.arange(sk).reshape(1, -1)
    planes = [[np.broadcast_to(mask_mod(b, h, q, k), (sq, sk)) for h in range(H or 1)]
              for b in range(B or 1)]
    return np.array(planes, dtype=bool).reshape(B or 1, H or 1, sq, sk)


def check(bm, dense):
    """bm represents dense exactly: per-block classes, zero padding, numbering, counts."""
    assert bm.index.dtype == np.int32 and bm.partial.dtype == np.uint8
    assert bm.partial.flags.c_contiguous and bm.shape == dense.shape
    np.testing.assert_array_equal(bm.to_dense(), dense)
    (bq, bk), expected = bm.block_size, {"empty": 0, "full": 0, "partial": 0}
    for b, h, qb, kb in np.ndindex(bm.index.shape):
        block = dense[b, h, qb * bq:(qb + 1) * bq, kb * bk:(kb + 1) * bk]
        entry = bm.index[b, h, qb, kb]
        if not block.any():
            assert entry == EMPTY
            expected["empty"] += 1
        elif block.all():
            assert entry == FULL
            expected["full"] += 1
        else:
            tile, (r, c) = bm.partial[entry], block.shape
            np.testing.assert_array_equal(tile[:r, :c], block)
            assert not tile[r:].any() and not tile[:, c:].any()
            expected["partial"] += 1
    assert bm.counts() == dict(expected, total=bm.index.size)
    # Stored masks are distinct and numbered by first use in C order.
    first_uses = list(dict.fromkeys(int(e) for e in bm.index.ravel() if e >= 0))
    assert first_uses == list(range(len(bm.partial)))
    assert len({p.tobytes() for p in bm.partial}) == len(bm.partial)


@pytest.mark.parametrize("sq, sk, block", [(37, 29, (16, 8)), (13, 11, (1, 1)), (5, 7, 64),
                                           (64, 48, 16), (0, 9, 4), (9, 0, 4)])
@pytest.mark.parametrize("name", MODS)
def test_create_block_mask_matches_dense(name, sq, sk, block):
    mod, B, H = MODS[name]
    check(create_block_mask(mod, B, H, sq, sk, block), dense_of(mod, B, H, sq, sk))


def test_classes_and_dedupe_of_causal_blocks():
    bm = causal_mask(256, block_size=64)
    assert bm.counts() == {"empty": 6, "full": 6, "partial": 4, "total": 16}
    assert len(bm.partial) == 1 and bm.sparsity() == 6 / 16  # the 4 diagonal blocks share
    assert "BlockMask(" in repr(bm)


def test_chunking_gives_the_same_mask_and_bounds_the_rows_per_call():
    mod, B, H = MODS["batch_head"]
    rows = []

    def recording(b, h, q, k):
        rows.append(q.shape[0])
        assert k.shape == (1, 70)
        return mod(b, h, q, k)

    small = create_block_mask(recording, B, H, 100, 70, (8, 16), chunk_rows=16)
    assert max(rows) <= 16 and sum(rows) == 100 * B * H
    rows.clear()
    large = create_block_mask(recording, B, H, 100, 70, (8, 16), chunk_rows=800)
    assert rows == [100] * (B * H)
    np.testing.assert_array_equal(small.index, large.index)
    np.testing.assert_array_equal(small.partial, large.partial)


def test_default_chunk_stays_under_16m_elements():
    rows = []

    def recording(b, h, q, k):
        rows.append(q.shape[0])
        return q >= 0

    bm = create_block_mask(recording, None, None, 20000, 2000, 16)
    assert len(rows) > 1 and max(rows) * 2000 <= 16 * 2**20 and sum(rows) == 20000
    assert all(r % 16 == 0 for r in rows[:-1])
    assert bm.counts()["full"] == bm.counts()["total"]


def test_torch_backend_matches_numpy():
    torch = pytest.importorskip("torch")
    mod, B, H = MODS["batch_head"]
    kinds = set()

    def recording(b, h, q, k):
        kinds.update((type(x), x.dtype) for x in (b, h, q, k))
        return mod(b, h, q, k)

    got = create_block_mask(recording, B, H, 37, 29, (16, 8), backend="torch", device="cpu")
    assert kinds == {(torch.Tensor, torch.int64)}
    want = create_block_mask(mod, B, H, 37, 29, (16, 8))
    np.testing.assert_array_equal(got.index, want.index)
    np.testing.assert_array_equal(got.partial, want.partial)


@pytest.mark.parametrize("causal", [False, True])
def test_document_mask(causal):
    ids = np.repeat([0, 1, 2, 5], [7, 20, 1, 12])
    ids2 = np.stack([ids, np.repeat([3, 4], [25, 15])])
    i, j = np.arange(40)[:, None], np.arange(40)[None, :]
    for doc in (ids, ids2):
        dense = (doc[..., :, None] == doc[..., None, :]) & ((j <= i) | (not causal))
        check(document_mask(doc, block_size=8, causal=causal), dense.reshape(-1, 1, 40, 40))
    if not causal:  # keys with their own ids and length
        keys = np.repeat([0, 5, 9], [3, 4, 9])
        check(document_mask(ids, keys, block_size=(8, 4)),
              (ids[:, None] == keys[None, :])[None, None])


def test_longformer_mask():
    i, j = np.arange(50)[:, None], np.arange(50)[None, :]
    glob = np.isin(np.arange(50), [0, 33])
    dense = (abs(i - j) <= 3) | glob[:, None] | glob[None, :]
    check(longformer_mask(50, 7, global_tokens=[0, 33], block_size=(8, 16)), dense[None, None])
    check(longformer_mask(50, 1, block_size=8), (i == j)[None, None])


@pytest.mark.parametrize("global_tokens", [(), (5, 60)])
def test_bigbird_mask(global_tokens):
    seqlen, bs, r = 96, 8, 3
    bm = bigbird_mask(seqlen, 3, global_tokens, random_blocks=r, seed=0, block_size=bs)
    dense = bm.to_dense()[0, 0]
    check(bm, dense[None, None])
    base = longformer_mask(seqlen, 3, global_tokens, block_size=bs).to_dense()[0, 0]
    assert (dense >= base).all()
    blocks = dense.reshape(12, bs, 12, bs).transpose(0, 2, 1, 3)
    whole = blocks.all(axis=(2, 3))
    # Whatever the random part adds is whole blocks, at least r per query block.
    extra = (dense & ~base).reshape(12, bs, 12, bs).transpose(0, 2, 1, 3).any(axis=(2, 3))
    assert not (extra & ~whole).any() and (whole.sum(axis=1) >= r).all()
    if not global_tokens:  # a 3-wide band fills no 8 x 8 block: exactly r random ones
        assert (whole.sum(axis=1) == r).all()
    again = bigbird_mask(seqlen, 3, global_tokens, random_blocks=r, seed=0, block_size=bs)
    other = bigbird_mask(seqlen, 3, global_tokens, random_blocks=r, seed=1, block_size=bs)
    np.testing.assert_array_equal(again.index, bm.index)
    assert not np.array_equal(other.to_dense(), dense)


@pytest.mark.parametrize("sq, sk", [(40, 40), (30, 50), (50, 30)])
def test_causal_mask_is_bottom_right_aligned(sq, sk):
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    check(causal_mask(sq, sk, block_size=(8, 16)), (j <= i + sk - sq)[None, None])


def _mask(index, partial, sq=8, sk=8, block=4):
    return lambda: BlockMask(np.asarray(index, dtype=np.int32), np.asarray(partial, np.uint8),
                             sq, sk, block)


CAUSAL = MODS["causal"][0]


@pytest.mark.parametrize("call, name", [
    (lambda: create_block_mask(CAUSAL, None, None, 8, 8, 0), "block_size"),
    (lambda: create_block_mask(CAUSAL, None, None, 8, 8, (4,)), "block_size"),
    (lambda: create_block_mask(CAUSAL, None, None, 8, 8, (4, 2.0)), "block_size"),
    (lambda: create_block_mask(CAUSAL, None, None, -1, 8), "Q_LEN"),
    (lambda: create_block_mask(CAUSAL, 0, None, 8, 8), "B"),
    (lambda: create_block_mask(CAUSAL, None, None, 8, 8, 4, chunk_rows=6), "chunk_rows"),
    (lambda: create_block_mask(CAUSAL, None, None, 8, 8, backend="jax"), "backend"),
    (lambda: create_block_mask(lambda b, h, q, k: q + k, None, None, 8, 8), "mask_mod"),
    (lambda: create_block_mask(lambda b, h, q, k: np.ones((3, 3), bool), None, None, 8, 8),
     "mask_mod"),
    (lambda: longformer_mask(16, 4, global_tokens=(16,)), "global_tokens"),
    (lambda: longformer_mask(16, 4, global_tokens=(-1,)), "global_tokens"),
    (lambda: document_mask(np.zeros((2, 8), int), np.zeros((3, 8), int)), "doc_ids_k"),
    (lambda: document_mask(np.zeros(8, int), np.zeros(6, int), causal=True), "causal"),
    (_mask(np.full((1, 1, 2, 2), 3), np.zeros((3, 4, 4))), "index"),
    (_mask(np.full((1, 1, 2, 2), -3), np.zeros((3, 4, 4))), "index"),
    (_mask(np.full((1, 1, 3, 2), -1), np.zeros((0, 4, 4))), "index"),
    (_mask(np.full((1, 1, 2, 2), -1), np.zeros((1, 4, 2))), "partial"),
    (_mask(np.full((1, 1, 2, 2), 0), np.full((1, 4, 4), 2)), "partial"),
    (_mask(np.full((1, 1, 2, 2), 0), np.ones((1, 4, 4)), sq=7), "partial"),  # 1 past the end
])
def test_bad_arguments_name_the_argument(call, name):
    with pytest.raises(ValueError, match=f"^{name}:"):
        call()
