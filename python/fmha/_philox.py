"""Philox4x32-10 and the dropout mask it defines, in vectorised NumPy.

This module is the readable definition of fmha's dropout stream. The C++ and
CUDA kernels implement exactly the same function, so a mask depends only on
``(seed, offset)`` and the coordinates of an element, never on tiling, thread
count or device.

Philox4x32-10 is the counter-based generator of Salmon, Moraes, Dror and Shaw,
"Parallel Random Numbers: As Easy as 1, 2, 3" (SC'11), as distributed in
D. E. Shaw Research's Random123 library: a 128-bit counter and a 64-bit key are
mixed by ten rounds of a Feistel-like network built from 32x32->64-bit
multiplications, the key being advanced by a Weyl sequence between rounds.

Dropout contract
----------------
For element ``(b, h, i, j)`` of an attention probability matrix (``b`` the
batch index, ``h`` the *query* head, ``i`` the query row, ``j`` the key column,
all local to one sequence) with ``heads`` query heads::

    key     = (lo32(seed), (hi32(seed) + hi32(offset)) mod 2**32)
    counter = (j >> 2, i, b * heads + h, lo32(offset))        (each mod 2**32)
    r       = philox4x32_10(counter, key)[j & 3]
    kept    = r >= dropout_threshold(p)

so four neighbouring key columns share one Philox call.
"""

from __future__ import annotations

import numpy as np

__all__ = ["philox4x32_10", "dropout_threshold", "dropout_keep_mask"]

# Round multipliers and Weyl key increments of Philox4x32 (Random123).
PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9  # golden ratio
PHILOX_W1 = 0xBB67AE85  # sqrt(3) - 1
PHILOX_ROUNDS = 10

_MASK32 = np.uint64(0xFFFFFFFF)
_SHIFT32 = np.uint64(32)


def _lo32(x: int) -> int:
    return int(x) & 0xFFFFFFFF


def _hi32(x: int) -> int:
    return (int(x) >> 32) & 0xFFFFFFFF


def _philox_words(c0, c1, c2, c3, k0, k1):
    """Ten Philox4x32 rounds on four broadcastable counter words.

    All arguments are uint64 arrays (or scalars) holding values below 2**32;
    keeping them in uint64 lets each 32x32-bit product be formed exactly, its
    high half being ``prod >> 32`` and its low half ``prod & 0xFFFFFFFF``.
    Returns the four output words as uint64 arrays, broadcast together.
    """
    m0 = np.uint64(PHILOX_M0)
    m1 = np.uint64(PHILOX_M1)
    w0 = np.uint64(PHILOX_W0)
    w1 = np.uint64(PHILOX_W1)
    k0 = np.uint64(k0) if np.isscalar(k0) else np.asarray(k0, dtype=np.uint64)
    k1 = np.uint64(k1) if np.isscalar(k1) else np.asarray(k1, dtype=np.uint64)
    for rnd in range(PHILOX_ROUNDS):
        if rnd > 0:  # the key is bumped before every round but the first
            k0 = (k0 + w0) & _MASK32
            k1 = (k1 + w1) & _MASK32
        prod0 = m0 * c0  # mulhilo(M0, c0)
        prod1 = m1 * c2  # mulhilo(M1, c2)
        c0, c1, c2, c3 = (
            (prod1 >> _SHIFT32) ^ c1 ^ k0,
            prod1 & _MASK32,
            (prod0 >> _SHIFT32) ^ c3 ^ k1,
            prod0 & _MASK32,
        )
    return c0, c1, c2, c3


def philox4x32_10(counter, key) -> np.ndarray:
    """Philox4x32-10 block function, vectorised over leading dimensions.

    Parameters
    ----------
    counter : array_like of uint32, shape (..., 4)
        The 128-bit counters, word 0 first.
    key : array_like of uint32, shape (..., 2)
        The 64-bit keys, word 0 first; broadcastable against ``counter``'s
        leading dimensions.

    Returns
    -------
    numpy.ndarray of uint32, shape (broadcast(...), 4)
        The four 32-bit output words of each block.
    """
    counter = np.asarray(counter, dtype=np.uint64)
    key = np.asarray(key, dtype=np.uint64)
    if counter.shape[-1:] != (4,):
        raise ValueError(f"counter must have a last dimension of 4, got shape {counter.shape}")
    if key.shape[-1:] != (2,):
        raise ValueError(f"key must have a last dimension of 2, got shape {key.shape}")
    counter = counter & _MASK32
    key = key & _MASK32
    words = _philox_words(
        counter[..., 0], counter[..., 1], counter[..., 2], counter[..., 3],
        key[..., 0], key[..., 1],
    )
    words = np.broadcast_arrays(*words)
    return np.stack(words, axis=-1).astype(np.uint32)


def dropout_threshold(p: float) -> int:
    """The uint32 threshold below which a Philox word means "dropped".

    Equal to ``min(floor(p * 2**32), 2**32 - 1)`` evaluated in float64, i.e.
    C++'s ``(uint32_t)std::min(p * 4294967296.0, 4294967295.0)``. An element is
    kept when its random word is ``>=`` this value, so ``p == 0`` keeps all.
    """
    p = float(p)
    if not (0.0 <= p <= 1.0):
        raise ValueError(f"dropout probability p must lie in [0, 1], got {p!r}")
    return int(min(p * 4294967296.0, 4294967295.0))


def dropout_keep_mask(
    seed: int,
    offset: int,
    batch: int,
    heads: int,
    seqlen_q: int,
    seqlen_k: int,
    p: float,
    batch_index_start: int = 0,
) -> np.ndarray:
    """The dropout keep-mask of fmha, as a boolean array.

    Parameters
    ----------
    seed, offset : int
        The generator state, each in ``[0, 2**64)`` (torch's Philox seed and
        offset when driven by a torch generator).
    batch, heads, seqlen_q, seqlen_k : int
        Shape of the probability matrix; ``heads`` counts *query* heads and
        enters the counter, so masks for different ``heads`` differ.
    p : float
        Dropout probability.
    batch_index_start : int
        Batch index of the first returned batch entry (for variable-length
        batches the batch index is the sequence index).

    Returns
    -------
    numpy.ndarray of bool, shape (batch, heads, seqlen_q, seqlen_k)
        True where the element is kept. See the module docstring for the
        exact definition.
    """
    seed = int(seed)
    offset = int(offset)
    if not (0 <= seed < 2**64):
        raise ValueError(f"seed must lie in [0, 2**64), got {seed}")
    if not (0 <= offset < 2**64):
        raise ValueError(f"offset must lie in [0, 2**64), got {offset}")
    threshold = np.uint64(dropout_threshold(p))

    key0 = _lo32(seed)
    key1 = (_hi32(seed) + _hi32(offset)) & 0xFFFFFFFF
    n_blocks = (seqlen_k + 3) // 4  # four key columns per Philox call

    b = np.arange(batch_index_start, batch_index_start + batch, dtype=np.uint64)
    h = np.arange(heads, dtype=np.uint64)
    c0 = np.arange(n_blocks, dtype=np.uint64)[None, None, None, :]
    c1 = np.arange(seqlen_q, dtype=np.uint64)[None, None, :, None]
    c2 = ((b[:, None] * np.uint64(heads) + h[None, :]) & _MASK32)[:, :, None, None]
    c3 = np.uint64(_lo32(offset))

    words = _philox_words(c0, c1, c2, c3, key0, key1)
    words = np.stack(np.broadcast_arrays(*words), axis=-1)  # (B, H, Sq, n_blocks, 4)
    words = words.reshape(batch, heads, seqlen_q, 4 * n_blocks)[..., :seqlen_k]
    return words >= threshold
