"""Block-sparse attention masks: which (query, key) pairs may attend, stored per block.

Representation (the contract with the kernels). The (seqlen_q, seqlen_k) mask plane of each
(batch, head) is cut into blocks of block_q query rows x block_k keys; the last row and column
of blocks are cut short by the sequence ends. The batch and head extents are each 1 (the mask
is broadcast over that dimension) or the full size (batch; query heads).

* ``index``: int32, (B, H, ceil(seqlen_q / block_q), ceil(seqlen_k / block_k)). Each entry
  classifies one block: ``EMPTY`` (-1) no pair in it may attend; ``FULL`` (-2) every in-range
  pair may attend; n >= 0 the block is partial and ``partial[n]`` is its element mask.
* ``partial``: uint8, (num_partial, block_q, block_k), C-contiguous; 1 = may attend,
  0 = may not. Positions past a sequence end (in a cut-short edge block) are 0. Partial
  blocks are numbered in C order of (b, h, q_block, k_block) of their first occurrence;
  blocks with identical element masks share one entry.

Classification looks only at in-range pairs: an edge block whose in-range pairs all may
attend is FULL, one whose in-range pairs all may not is EMPTY.

Block size: any (block_q, block_k) >= 1 is valid; it need not match the kernels' tiles. A
kernel tile is skipped when every block it meets is EMPTY, and tests no element mask when
every block it meets is FULL; otherwise it tests each pair. Blocks that are multiples of the
kernel's tile therefore skip the most work for a given
pattern; smaller blocks describe the pattern more finely but cost more index entries.

Cost model: kernel work is proportional to the number of non-empty blocks. Partial blocks also
read their element mask (block_q * block_k bytes each); full blocks read none. Larger blocks
mean a smaller index but coarser classification: wherever the pattern's edges cut through a
block, that block is partial.
"""

from __future__ import annotations

import numbers

import numpy as np

__all__ = ["BlockMask", "create_block_mask", "causal_mask", "document_mask",
           "longformer_mask", "bigbird_mask"]

#: The two block classes of ``index`` (also BlockMask.EMPTY and BlockMask.FULL).
EMPTY = -1
FULL = -2
#: Elements of one chunk of the mask that create_block_mask evaluates at a time (by default).
_CHUNK_ELEMENTS = 16 * 2**20


def _int(value, name, minimum=0) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")
    return int(value)


def _block_pair(block_size):
    pair = (block_size, block_size) if isinstance(block_size, numbers.Integral) else block_size
    try:
        bq, bk = pair
    except (TypeError, ValueError):
        bq = bk = None
    if not all(isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= 1
               for x in (bq, bk)):
        raise ValueError("block_size: expected a positive int or a pair of them, "
                         f"got {block_size!r}")
    return int(bq), int(bk)


class BlockMask:
    """A block-sparse mask of shape (B, H, seqlen_q, seqlen_k); see the module docstring.

    ``index`` (int32, 4-D) and ``partial`` (uint8, 3-D) follow the representation above;
    ``block_size`` is an int or a (block_q, block_k) pair and is stored as the pair. Raises
    ValueError, naming the argument, when a shape, dtype or value breaks the representation.
    """

    #: The ``index`` values of a block where no pair may attend and where every in-range one may.
    EMPTY = EMPTY
    FULL = FULL

    def __init__(self, index, partial, seqlen_q, seqlen_k, block_size):
        self.block_size = bq, bk = _block_pair(block_size)
        self.seqlen_q = _int(seqlen_q, "seqlen_q")
        self.seqlen_k = _int(seqlen_k, "seqlen_k")
        nq, nk = -(-self.seqlen_q // bq), -(-self.seqlen_k // bk)
        if (not isinstance(index, np.ndarray) or index.dtype != np.int32 or index.ndim != 4
                or index.shape[2:] != (nq, nk) or min(index.shape[:2]) < 1):
            raise ValueError(f"index: expected an int32 array of shape (B, H, {nq}, {nk}) with "
                             f"B, H >= 1, got {getattr(index, 'dtype', type(index).__name__)} "
                             f"{getattr(index, 'shape', '')}")
        if (not isinstance(partial, np.ndarray) or partial.dtype != np.uint8
                or partial.ndim != 3 or partial.shape[1:] != (bq, bk)):
            raise ValueError(f"partial: expected a uint8 array of shape (num_partial, {bq}, {bk}), "
                             f"got {getattr(partial, 'dtype', type(partial).__name__)} "
                             f"{getattr(partial, 'shape', '')}")
        n = len(partial)
        bad = (index != EMPTY) & (index != FULL) & ((index < 0) | (index >= n))
        if bad.any():
            raise ValueError(f"index: entries must be {EMPTY} (empty), {FULL} (full) or in "
                             f"[0, {n}) (partial), got {index[bad][0]}")
        if partial.max(initial=0) > 1:
            raise ValueError("partial: entries must be 0 or 1")
        # Partial masks used by a cut-short edge block must be 0 past the sequence end.
        rq, rk = self.seqlen_q - (nq - 1) * bq, self.seqlen_k - (nk - 1) * bk
        last_row, last_col = index[:, :, -1:, :], index[:, :, :, -1:]
        if ((nq and rq < bq and partial[last_row[last_row >= 0]][:, rq:, :].any())
                or (nk and rk < bk and partial[last_col[last_col >= 0]][:, :, rk:].any())):
            raise ValueError("partial: an edge block's mask is nonzero past the sequence end")
        self.index = np.ascontiguousarray(index)
        self.partial = np.ascontiguousarray(partial)

    @property
    def shape(self):
        """(B, H, seqlen_q, seqlen_k), with B and H the stored extents (1 = broadcast)."""
        return self.index.shape[:2] + (self.seqlen_q, self.seqlen_k)

    def to_dense(self) -> np.ndarray:
        """The element mask as a bool array of ``shape`` (for tests and small problems)."""
        (bq, bk), (b, h, nq, nk) = self.block_size, self.index.shape
        tiles = np.zeros((b, h, nq, nk, bq, bk), dtype=bool)
        tiles[self.index == FULL] = True
        is_partial = self.index >= 0
        tiles[is_partial] = self.partial[self.index[is_partial]].astype(bool)
        dense = tiles.transpose(0, 1, 2, 4, 3, 5).reshape(b, h, nq * bq, nk * bk)
        return np.ascontiguousarray(dense[:, :, :self.seqlen_q, :self.seqlen_k])

    def counts(self) -> dict:
        """Numbers of empty, full and partial blocks over all (b, h, q_block, k_block), and
        their total."""
        return {"empty": int((self.index == EMPTY).sum()), "full": int((self.index == FULL).sum()),
                "partial": int((self.index >= 0).sum()), "total": int(self.index.size)}

    def sparsity(self) -> float:
        """Fraction of blocks that are empty (0.0 when there are no blocks)."""
        return int((self.index == EMPTY).sum()) / max(self.index.size, 1)

    def _arrays(self, like, full):
        """(index, partial) as the kernels take them: arrays of ``like``'s kind on its device
        (torch tensors and CuPy arrays made once per device, then cached), after checking
        that the mask fits a call of full = (batch, heads_q, seqlen_q, seqlen_k)."""
        b, h = self.index.shape[:2]
        if (b not in (1, full[0]) or h not in (1, full[1])
                or (self.seqlen_q, self.seqlen_k) != tuple(full[2:])):
            raise ValueError(f"block_mask: shape {self.shape} does not fit the call's (batch, "
                             f"heads_q, seqlen_q, seqlen_k) = {tuple(full)} (batch and heads "
                             "may be 1)")
        module = type(like).__module__.split(".")[0]
        if module == "numpy":
            return self.index, self.partial
        cache = self.__dict__.setdefault("_device_arrays", {})
        key = (module, str(like.device))
        if key not in cache:
            if module == "torch":
                import torch
                cache[key] = tuple(torch.from_numpy(x).to(like.device)
                                   for x in (self.index, self.partial))
            else:  # CuPy: on like's device
                import cupy
                with like.device:
                    cache[key] = (cupy.asarray(self.index), cupy.asarray(self.partial))
        return cache[key]

    def __repr__(self):
        c = self.counts()
        return (f"BlockMask(shape={self.shape}, block_size={self.block_size}, "
                f"blocks: {c['empty']} empty / {c['full']} full / {c['partial']} partial "
                f"({len(self.partial)} stored), sparsity={self.sparsity():.3f})")


def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, block_size=128, *, chunk_rows=None,
                      backend="numpy", device=None) -> BlockMask:
    """The BlockMask of ``mask_mod`` evaluated exactly at every (b, h, q_idx, kv_idx).

    ``mask_mod(b, h, q_idx, kv_idx)`` follows FlexAttention's convention: it receives integer
    indices that broadcast against each other (b, h 0-d; q_idx shaped (rows, 1); kv_idx shaped
    (1, KV_LEN)) and returns booleans broadcastable to (rows, KV_LEN), True = may attend. With
    ``backend="numpy"`` the indices are NumPy int64; with ``backend="torch"`` they are torch
    int64 tensors on ``device`` (torch's default device when None). B=None / H=None declare
    that the mask does not depend on that dimension: extent 1, evaluated at b=0 / h=0.

    The mask is evaluated in chunks of ``chunk_rows`` query rows (a multiple of block_q) by
    KV_LEN keys, so the whole Q_LEN x KV_LEN mask is never held at once; by default a chunk
    has about 16 M elements (at least one block of rows). ``block_size`` is an int (both
    sides) or a (block_q, block_k) pair. Bad arguments raise ValueError naming the argument,
    including a mask_mod whose result is not boolean or does not broadcast.
    """
    if not callable(mask_mod):
        raise ValueError(f"mask_mod: expected a callable, got {type(mask_mod).__name__}")
    bq, bk = _block_pair(block_size)
    nb = 1 if B is None else _int(B, "B", 1)
    nh = 1 if H is None else _int(H, "H", 1)
    Q_LEN, KV_LEN = _int(Q_LEN, "Q_LEN"), _int(KV_LEN, "KV_LEN")
    if chunk_rows is None:
        chunk_rows = max(1, _CHUNK_ELEMENTS // (bq * max(KV_LEN, 1))) * bq
    elif (isinstance(chunk_rows, bool) or not isinstance(chunk_rows, numbers.Integral)
          or chunk_rows < 1 or chunk_rows % bq):
        raise ValueError(f"chunk_rows: expected a positive multiple of block_q={bq}, "
                         f"got {chunk_rows!r}")
    if backend == "numpy":
        if device is not None:
            raise ValueError(f"device: only used with backend='torch', got {device!r}")
        indices, to_numpy = (lambda a, z: np.arange(a, z, dtype=np.int64)), np.asarray
    elif backend == "torch":
        import torch

        def indices(a, z):
            return torch.arange(a, z, dtype=torch.int64, device=device)

        def to_numpy(x):
            return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    else:
        raise ValueError(f"backend: expected 'numpy' or 'torch', got {backend!r}")

    nq, nk = -(-Q_LEN // bq), -(-KV_LEN // bk)
    index = np.empty((nb, nh, nq, nk), dtype=np.int32)
    # Element mask bytes -> partial id. The dict hashes the bytes and compares them exactly on
    # a hash collision; insertion order is id order, so the keys are also the partial list.
    partial_ids = {}
    kv_idx = indices(0, KV_LEN).reshape(1, -1)
    for b in range(nb):
        for h in range(nh):
            b_idx, h_idx = indices(b, b + 1).reshape(()), indices(h, h + 1).reshape(())
            for r0 in range(0, Q_LEN if KV_LEN else 0, chunk_rows):
                rows = min(chunk_rows, Q_LEN - r0)
                q_idx = indices(r0, r0 + rows).reshape(-1, 1)
                chunk = to_numpy(mask_mod(b_idx, h_idx, q_idx, kv_idx))
                if chunk.dtype != np.bool_:
                    raise ValueError("mask_mod: expected a boolean result, "
                                     f"got dtype {chunk.dtype}")
                try:
                    chunk = np.broadcast_to(chunk, (rows, KV_LEN))
                except ValueError:
                    raise ValueError(f"mask_mod: result of shape {chunk.shape} does not broadcast "
                                     f"to (rows, KV_LEN) = ({rows}, {KV_LEN})") from None
                # Pad with False to whole blocks: padding never counts as allowed, so a block is
                # FULL when its count of allowed pairs equals its count of in-range pairs.
                qbs = -(-rows // bq)
                padded = np.zeros((qbs * bq, nk * bk), dtype=bool)
                padded[:rows, :KV_LEN] = chunk
                tiles = padded.reshape(qbs, bq, nk, bk).transpose(0, 2, 1, 3)
                allowed = tiles.sum(axis=(2, 3))
                in_rows = np.minimum(bq, rows - bq * np.arange(qbs))
                in_cols = np.minimum(bk, KV_LEN - bk * np.arange(nk))
                blocks = index[b, h, r0 // bq:r0 // bq + qbs]
                blocks[...] = np.where(allowed == 0, EMPTY, FULL)
                pq, pk = np.nonzero((allowed > 0) & (allowed < np.outer(in_rows, in_cols)))
                for i, j, tile in zip(pq, pk, tiles[pq, pk].astype(np.uint8)):
                    blocks[i, j] = partial_ids.setdefault(tile.tobytes(), len(partial_ids))
    partial = np.frombuffer(b"".join(partial_ids), dtype=np.uint8).reshape(-1, bq, bk).copy()
    return BlockMask(index, partial, Q_LEN, KV_LEN, (bq, bk))


def _doc_ids(ids, name) -> np.ndarray:
    if hasattr(ids, "detach"):
        ids = ids.detach().cpu().numpy()
    ids = np.asarray(ids)
    if ids.ndim not in (1, 2) or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{name}: expected a 1-D (seqlen) or 2-D (batch, seqlen) integer array, "
                         f"got {ids.dtype} {ids.shape}")
    return ids.reshape(-1, ids.shape[-1])


def document_mask(doc_ids_q, doc_ids_k=None, block_size=128, *, causal=False) -> BlockMask:
    """Attention within documents: query i may see key j iff doc_ids_q[i] == doc_ids_k[j].

    The ids (NumPy or torch, integer) are 1-D (seqlen), the same for every batch entry (B = 1),
    or 2-D (batch, seqlen), per batch entry (B = batch; a batch of 1 broadcasts against the
    other side's batch). ``doc_ids_k`` defaults to ``doc_ids_q``. ``causal=True`` also
    requires j <= i (positions are global indices, so within each document this is causal
    attention aligned at the top left); it needs seqlen_q == seqlen_k. H = 1.
    """
    ids_q = _doc_ids(doc_ids_q, "doc_ids_q")
    ids_k = ids_q if doc_ids_k is None else _doc_ids(doc_ids_k, "doc_ids_k")
    if len(ids_q) != len(ids_k) and 1 not in (len(ids_q), len(ids_k)):
        raise ValueError(f"doc_ids_k: batch {len(ids_k)} does not match doc_ids_q's batch "
                         f"{len(ids_q)}")
    if causal and ids_q.shape[1] != ids_k.shape[1]:
        raise ValueError(f"causal: needs seqlen_q == seqlen_k, got {ids_q.shape[1]} and "
                         f"{ids_k.shape[1]}")

    def mask_mod(b, h, q, k):
        same = ids_q[b if len(ids_q) > 1 else 0][q] == ids_k[b if len(ids_k) > 1 else 0][k]
        return same & (k <= q) if causal else same

    batch = max(len(ids_q), len(ids_k))
    return create_block_mask(mask_mod, batch if batch > 1 else None, None, ids_q.shape[1],
                             ids_k.shape[1], block_size)


def _longformer_mod(seqlen, window, global_tokens):
    window = _int(window, "window", 1)
    tokens = np.asarray(global_tokens)
    if tokens.size and (tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer)
                        or tokens.min() < 0 or tokens.max() >= seqlen):
        raise ValueError(f"global_tokens: expected indices in [0, {seqlen}), got {global_tokens!r}")
    is_global = np.zeros(seqlen, dtype=bool)
    is_global[tokens.astype(np.int64).ravel()] = True
    half = window // 2
    # Bounds on k rather than |q - k|: compares without an int64 (rows, keys) temporary.
    return lambda q, k: ((k >= q - half) & (k <= q + half)) | is_global[q] | is_global[k]


def longformer_mask(seqlen, window, global_tokens=(), block_size=128) -> BlockMask:
    """Sliding window plus global tokens (Longformer), B = H = 1.

    Query i may see key j iff |i - j| <= window // 2 (a window of ``window`` tokens centred on
    the query), or i is a global token (it sees everything), or j is one (everything sees
    it). ``global_tokens``: indices in [0, seqlen).
    """
    seqlen = _int(seqlen, "seqlen")
    allowed = _longformer_mod(seqlen, window, global_tokens)
    return create_block_mask(lambda b, h, q, k: allowed(q, k), None, None, seqlen, seqlen,
                             block_size)


def bigbird_mask(seqlen, window, global_tokens=(), random_blocks=3, seed=0,
                 block_size=128) -> BlockMask:
    """Longformer's pattern plus random blocks (BigBird), B = H = 1.

    The random part is in units of this mask's blocks: for each query block (block_q rows),
    ``random_blocks`` key blocks (block_k keys; all of them when there are fewer) are drawn
    uniformly without replacement from all key blocks with ``np.random.default_rng(seed)``,
    and every pair in a drawn block may attend. The same arguments give the same mask.
    """
    seqlen = _int(seqlen, "seqlen")
    random_blocks = _int(random_blocks, "random_blocks")
    bq, bk = _block_pair(block_size)
    allowed = _longformer_mod(seqlen, window, global_tokens)
    nq, nk = -(-seqlen // bq), -(-seqlen // bk)
    rng = np.random.default_rng(seed)
    drawn = np.zeros((nq, nk), dtype=bool)
    for qb in range(nq):
        drawn[qb, rng.choice(nk, min(random_blocks, nk), replace=False)] = True
    return create_block_mask(lambda b, h, q, k: allowed(q, k) | drawn[q // bq, k // bk],
                             None, None, seqlen, seqlen, (bq, bk))


def causal_mask(seqlen_q, seqlen_k=None, block_size=128) -> BlockMask:
    """Causal attention as fmha's causal=True with its default bottom-right alignment, B = H = 1.

    Key j is visible to query i iff j <= i + seqlen_k - seqlen_q: plain j <= i when
    seqlen_k == seqlen_q (``seqlen_k`` defaults to ``seqlen_q``).
    """
    seqlen_q = _int(seqlen_q, "seqlen_q")
    seqlen_k = seqlen_q if seqlen_k is None else _int(seqlen_k, "seqlen_k")
    shift = seqlen_k - seqlen_q
    return create_block_mask(lambda b, h, q, k: k <= q + shift, None, None, seqlen_q, seqlen_k,
                             block_size)
