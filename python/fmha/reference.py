"""Float64 NumPy reference of fmha's attention semantics, forward and backward.

This module is the executable definition of what every fmha backend computes.
It materialises the full ``(batch, heads, seqlen_q, seqlen_k)`` score and
probability matrices, so it is meant for testing and for small problems, not
for speed. Every input is cast to float64 and every result is float64.

Layout (flash-attn's convention)::

    q : (batch, seqlen_q, heads_q,  head_dim)
    k : (batch, seqlen_k, heads_kv, head_dim)
    v : (batch, seqlen_k, heads_kv, head_dim_v)

with ``heads_q % heads_kv == 0``; query head ``h`` reads kv head
``h // (heads_q // heads_kv)`` (grouped-query / multi-query attention).

For one (batch ``b``, query head ``h``), query row ``i`` and key column ``j``::

    S_ij = scale * q_i . k_j                       scale defaults to 1/sqrt(head_dim)
    S_ij = softcap * tanh(S_ij / softcap)          only if softcap > 0
    S_ij += bias[b, h, i, j]                       additive bias, NumPy-broadcast
    S_ij -= slope[b, h] * |i + off - j|            ALiBi, if alibi_slopes given
    S_ij = -inf unless j is visible                window / causal / boolean mask
                                                   (and where bias = -inf)
    P_ij = softmax_j(S_ij)                         rows with no finite S_ij give P = 0
    O_i  = sum_j P_ij Z_ij v_j                     Z: dropout keep-mask / (1 - p)

where ``off = seqlen_k - seqlen_q`` for ``alignment="bottom_right"`` (flash-attn)
and ``off = 0`` for ``"top_left"`` (torch SDPA), and key ``j`` is visible from
row ``i`` iff::

    (left  < 0 or j >= i + off - left) and
    (right < 0 or j <= i + off + right) and mask[b, h, i, j]

for ``window = (left, right)`` (``-1`` = unbounded); ``causal=True`` sets
``right = 0``. The log-sum-exp ``lse_i = log(sum_j exp(S_ij))`` is returned with
the output; it is ``-inf`` for a row with no visible key, whose output and
gradients are all zero.

The backward pass follows FlashAttention-2's formulation::

    dV = (P o Z)^T dO
    dP = (dO V^T) o Z
    D_i = rowsum(dO o O)              (= sum_j P_ij dP_ij)
    dS = P o (dP - D)                 (this is also d bias, element-wise)
    dS_raw = dS o (1 - tanh^2(S_raw / softcap))    only if softcap > 0
    dQ = scale * dS_raw K,   dK = scale * dS_raw^T Q

with dK and dV summed over the query heads that share a kv head.

Non-finite inputs (NaN, +-inf): IEEE arithmetic throughout, except that
  * an excluded pair (i, j) -- invisible, or given a -inf bias -- contributes
    nothing to O, dV, dQ or dK, and a dropped pair (Z_ij = 0) nothing to O, dV
    or dP, even against a non-finite q_i, k_j, v_j or dO_i (0 * NaN counts as
    0 there);
  * P_ij = 0 wherever S_ij = -inf (also in a row that is NaN elsewhere), and
    dS_ij = 0 wherever P_ij = 0.
  * a row whose lse is NaN has an all-NaN output (it is normalised by a NaN
    sum), even where every pair it sees is dropped.
So a NaN or Inf that reaches a score makes its row's output, lse and
gradients non-finite, a non-finite v_j does the same to every row that gives
it a nonzero weight, and nothing leaks through pairs that are masked out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

from ._philox import dropout_keep_mask
from .kvquant import as_codes, decode_table, quantize

__all__ = [
    "attention_forward",
    "attention_backward",
    "attention_probs",
    "attention_varlen_forward",
    "attention_varlen_backward",
    "attention_fp8_forward",
    "fp8_dequantize",
    "attention_with_kvcache",
    "kvcache_rows",
]

_ALIGNMENTS = ("bottom_right", "top_left")


@dataclass
class _Intermediates:
    """Everything the forward pass materialises, kept for the backward pass.

    Per-head tensors are laid out ``(batch, heads_q, seq, dim)``; K and V are
    gathered per query head (a copy, which is acceptable in a reference).
    """

    q: np.ndarray          # (B, Hq, Sq, D)
    k: np.ndarray          # (B, Hq, Sk, D), kv heads repeated per query head
    v: np.ndarray          # (B, Hq, Sk, Dv)
    heads_kv: int
    scale: float
    softcap: float
    s_raw: np.ndarray      # scale * Q K^T, before the softcap
    s: np.ndarray          # the scores the softmax reads: softcapped, biased, -inf if excluded
    p: np.ndarray          # softmax probabilities, before dropout
    lse: np.ndarray        # (B, Hq, Sq)
    z: Optional[np.ndarray]  # dropout multiplier (keep / (1 - p)), None without dropout
    # Attention sinks: each row's probability of its head's sink, exp(sink - lse), laid
    # out like lse (p and lse then include the sinks); None without sinks.
    p_sink: Optional[np.ndarray]
    excluded: np.ndarray   # (B, Hq, Sq, Sk) bool: invisible, or a -inf bias


def _check_qkv(q, k, v):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            "q, k, v must be 4-D (batch, seqlen, heads, head_dim); got shapes "
            f"{q.shape}, {k.shape}, {v.shape}"
        )
    batch, _, heads_q, head_dim = q.shape
    if k.shape[0] != batch or v.shape[0] != batch:
        raise ValueError(f"batch sizes differ: q {q.shape}, k {k.shape}, v {v.shape}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must agree in (batch, seqlen_k, heads_kv): k {k.shape}, v {v.shape}")
    if k.shape[3] != head_dim:
        raise ValueError(f"q and k head_dim differ: q {q.shape}, k {k.shape}")
    heads_kv = k.shape[2]
    if heads_q == 0 and heads_kv == 0:  # no head at all: an empty call
        return heads_kv
    if heads_kv == 0 or heads_q % heads_kv != 0:
        raise ValueError(
            f"heads_q ({heads_q}) must be a multiple of heads_kv ({heads_kv})"
        )
    return heads_kv


def _repeat_kv(x: np.ndarray, heads_q: int) -> np.ndarray:
    """(B, Sk, Hkv, D) -> (B, Hq, Sk, D), query head h reading kv head h // group."""
    heads_kv = x.shape[2]
    group = heads_q // heads_kv if heads_kv else 1  # no heads at all: any group
    kv_head_of = np.arange(heads_q) // group
    return np.transpose(x[:, :, kv_head_of, :], (0, 2, 1, 3))


def _sum_heads_to_kv(x: np.ndarray, heads_kv: int) -> np.ndarray:
    """(B, Hq, Sk, D) -> (B, Sk, Hkv, D), summing the query heads of each group."""
    batch, heads_q, seqlen, dim = x.shape
    group = heads_q // heads_kv if heads_kv else 1  # no heads at all: any group
    x = x.reshape(batch, heads_kv, group, seqlen, dim).sum(axis=2)
    return np.transpose(x, (0, 2, 1, 3))


def _sum_to_shape(x: np.ndarray, shape: Tuple[int, ...]) -> np.ndarray:
    """Reduce ``x`` to ``shape`` by summing over the axes NumPy broadcast."""
    extra = x.ndim - len(shape)
    if extra > 0:
        x = x.sum(axis=tuple(range(extra)))
    axes = tuple(ax for ax, n in enumerate(shape) if n == 1 and x.shape[ax] != 1)
    if axes:
        x = x.sum(axis=axes, keepdims=True)
    return x.reshape(shape)


def _key_offset(seqlen_q: int, seqlen_k: int, alignment: str) -> int:
    if alignment == "bottom_right":
        return seqlen_k - seqlen_q
    if alignment == "top_left":
        return 0
    raise ValueError(f"alignment must be one of {_ALIGNMENTS}, got {alignment!r}")


def _visibility(seqlen_q, seqlen_k, causal, window, offset) -> np.ndarray:
    """(Sq, Sk) boolean: may row i see column j under the causal/window rule."""
    left, right = (int(w) for w in window)
    if causal:
        right = 0
    i = np.arange(seqlen_q)[:, None] + offset  # the diagonal column of row i
    j = np.arange(seqlen_k)[None, :]
    visible = np.ones((seqlen_q, seqlen_k), dtype=bool)
    if left >= 0:
        visible &= j >= i - left
    if right >= 0:
        visible &= j <= i + right
    return visible


def _alibi_bias(alibi_slopes, batch, heads_q, seqlen_q, seqlen_k, offset) -> np.ndarray:
    """-slope * |i + offset - j|, broadcastable to (B, Hq, Sq, Sk)."""
    slopes = np.asarray(alibi_slopes, dtype=np.float64)
    if slopes.shape == (heads_q,):
        slopes = slopes[None, :]
    elif slopes.shape != (batch, heads_q):
        raise ValueError(
            f"alibi_slopes must have shape ({heads_q},) or ({batch}, {heads_q}), got {slopes.shape}"
        )
    distance = np.abs(
        np.arange(seqlen_q)[:, None] + offset - np.arange(seqlen_k)[None, :]
    ).astype(np.float64)
    return -slopes[:, :, None, None] * distance[None, None, :, :]


def _masked_softmax(s: np.ndarray):
    """Row softmax of ``s`` (with -inf entries) and its log-sum-exp.

    A row whose entries are all -inf (or that is empty) gets P = 0 and
    lse = -inf instead of NaN. Any other row follows IEEE arithmetic: a NaN
    entry, or a +inf one, makes the whole row (and its lse) NaN.
    """
    row_max = np.max(s, axis=-1, initial=-np.inf)
    has_any = row_max != -np.inf  # NaN counts as something seen
    safe_max = np.where(has_any, row_max, 0.0)
    with np.errstate(invalid="ignore"):
        e = np.exp(s - safe_max[..., None])  # exp(-inf) = 0 for invisible keys
    row_sum = e.sum(axis=-1)
    safe_sum = np.where(has_any, row_sum, 1.0)
    p = np.where(has_any[..., None], e / safe_sum[..., None], 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.where(has_any, safe_max + np.log(safe_sum), -np.inf)
    return p, lse


def _weighted_sum(w: np.ndarray, x: np.ndarray, zero: np.ndarray) -> np.ndarray:
    """``w @ x`` over the last two axes, where a pair with ``zero[..., i, j]`` true
    contributes nothing even against a non-finite ``x[..., j, :]`` (0 * NaN = 0
    there); every other product follows IEEE arithmetic. ``w`` is 0 wherever
    ``zero`` is true."""
    finite = np.isfinite(x)
    with np.errstate(invalid="ignore", over="ignore"):
        if finite.all():
            return w @ x
        out = w @ np.where(finite, x, 0.0)
        bad = np.where(finite, 0.0, x)[..., None, :, :]  # the non-finite entries only
        take = ~zero[..., :, :, None] & ~finite[..., None, :, :]
        return out + np.where(take, w[..., :, :, None] * bad, 0.0).sum(axis=-2)


def _forward(
    q, k, v, *, scale, causal, window, alignment, bias, mask, alibi_slopes,
    softcap, dropout_p, seed, offset, batch_index_start=0, sinks=None,
) -> _Intermediates:
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    heads_kv = _check_qkv(q, k, v)
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k = k.shape[1]
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    scale = float(scale)
    softcap = float(softcap)
    dropout_p = float(dropout_p)
    if not (0.0 <= dropout_p <= 1.0):
        raise ValueError(f"dropout_p must lie in [0, 1], got {dropout_p!r}")
    key_offset = _key_offset(seqlen_q, seqlen_k, alignment)
    full_shape = (batch, heads_q, seqlen_q, seqlen_k)

    qh = np.transpose(q, (0, 2, 1, 3))       # (B, Hq, Sq, D)
    kh = _repeat_kv(k, heads_q)              # (B, Hq, Sk, D)
    vh = _repeat_kv(v, heads_q)              # (B, Hq, Sk, Dv)

    s_raw = scale * np.einsum("bhid,bhjd->bhij", qh, kh)
    s = softcap * np.tanh(s_raw / softcap) if softcap > 0 else s_raw
    if bias is not None:
        with np.errstate(invalid="ignore"):  # -inf bias + inf score: masked just below
            s = s + np.broadcast_to(np.asarray(bias, dtype=np.float64), full_shape)
    if alibi_slopes is not None:
        s = s + _alibi_bias(alibi_slopes, batch, heads_q, seqlen_q, seqlen_k, key_offset)

    visible = _visibility(seqlen_q, seqlen_k, causal, window, key_offset)[None, None]
    if mask is not None:
        visible = visible & np.broadcast_to(np.asarray(mask, dtype=bool), full_shape)
    excluded = np.broadcast_to(~visible, full_shape)
    if bias is not None:
        excluded = excluded | np.broadcast_to(np.asarray(bias, dtype=np.float64) == -np.inf, full_shape)
    s = np.where(excluded, -np.inf, s)  # a -inf bias masks its pair, whatever q.k is

    p, lse = _masked_softmax(s)
    p = np.where(s == -np.inf, 0.0, p)  # also in a NaN row
    p_sink = None
    if sinks is not None:
        # softmax over [s_i1 .. s_in, sink_h]: the sink joins the denominator, not the sum.
        sink = np.asarray(sinks, dtype=np.float64)[None, :, None]
        lse_with = np.logaddexp(lse, sink)
        with np.errstate(invalid="ignore"):
            p = p * np.exp(lse - lse_with)[..., None]  # 0 for a row with no visible key
        p_sink = np.exp(sink - lse_with)
        lse = lse_with

    z = None
    if dropout_p > 0.0:
        keep = dropout_keep_mask(
            seed, offset, batch, heads_q, seqlen_q, seqlen_k, dropout_p,
            batch_index_start=batch_index_start,
        )
        # p == 1 drops everything; the 1/(1-p) rescale is then moot.
        rescale = 0.0 if dropout_p >= 1.0 else 1.0 / (1.0 - dropout_p)
        z = keep * rescale

    return _Intermediates(
        q=qh, k=kh, v=vh, heads_kv=heads_kv, scale=scale, softcap=softcap,
        s_raw=s_raw, s=s, p=p, lse=lse, z=z, excluded=excluded, p_sink=p_sink,
    )


def _output(it: _Intermediates) -> np.ndarray:
    """O = (P o Z) V in (B, Sq, Hq, Dv) layout."""
    out = _weighted_sum(_pz(it), it.v, _skipped(it))
    out = np.where(np.isnan(it.lse)[..., None], np.nan, out)  # normalised by a NaN sum
    return np.transpose(out, (0, 2, 1, 3))


def _pz(it: _Intermediates) -> np.ndarray:
    """P o Z, exactly 0 where dropped (also in a NaN row)."""
    if it.z is None:
        return it.p
    with np.errstate(invalid="ignore"):
        return np.where(it.z != 0, it.p * it.z, 0.0)


def _skipped(it: _Intermediates) -> np.ndarray:
    """The pairs that contribute nothing to (P o Z) V and dV: excluded or dropped."""
    return it.excluded if it.z is None else it.excluded | (it.z == 0)


def _backward(dout, it: _Intermediates, bias_shape, out=None, dlse=None):
    """Gradients (dq, dk, dv, dbias) from the forward intermediates; D from ``out`` when
    given (batch, seqlen_q, heads_q, head_dim_v), else from the exact output; ``dlse``
    (batch, heads_q, seqlen_q), the gradient reaching lse, when given."""
    batch, heads_q, seqlen_q, _ = it.q.shape
    expected = (batch, seqlen_q, heads_q, it.v.shape[-1])
    if np.shape(dout) != expected:
        raise ValueError(f"dout must have shape {expected} (like out), got {np.shape(dout)}")
    do = np.transpose(np.asarray(dout, dtype=np.float64), (0, 2, 1, 3))  # (B, Hq, Sq, Dv)
    p, z = it.p, it.z
    pz = _pz(it)
    none = p == 0  # dS = P o (dP - D) is 0 there, whatever dP and D are
    excluded = it.excluded

    dv = _weighted_sum(np.swapaxes(pz, -1, -2), do, np.swapaxes(_skipped(it), -1, -2))
    with np.errstate(invalid="ignore"):
        dp = np.einsum("bhid,bhjd->bhij", do, it.v)
        if z is not None:
            dp = np.where(z != 0, dp * z, 0.0)  # a dropped pair passes nothing back
        # D_i = rowsum(dO o O) (= sum_j P_ij dP_ij for finite inputs), from O itself as the
        # kernels do: a non-finite dO_i makes D_i non-finite even where O_i is 0.
        if out is None:
            out = _output(it)
        elif np.shape(out) != expected:
            raise ValueError(f"out must have shape {expected}, got {np.shape(out)}")
        out = np.transpose(np.asarray(out, dtype=np.float64), (0, 2, 1, 3))
        d = np.sum(do * out, axis=-1, keepdims=True)
        if dlse is not None:
            # lse_i = log sum_j exp(s_ij): d lse_i / d s_ij = P_ij, so dS_ij gains P_ij dlse_i.
            d = d - np.asarray(dlse, dtype=np.float64)[..., None]
        ds = np.where(none, 0.0, p * (dp - d))

    dbias = None if bias_shape is None else _sum_to_shape(ds, bias_shape)
    # A sink's logit enters as s does but carries no value (dP = 0): dsink = -sum P_sink D.
    dsinks = None if it.p_sink is None else -np.sum(it.p_sink * d[..., 0], axis=(0, 2))

    if it.softcap > 0:
        with np.errstate(invalid="ignore"):
            t = np.tanh(it.s_raw / it.softcap)
            ds = np.where(ds == 0, 0.0, ds * (1.0 - t * t))

    dq = it.scale * _weighted_sum(ds, it.k, excluded)
    dk = it.scale * _weighted_sum(np.swapaxes(ds, -1, -2), it.q, np.swapaxes(excluded, -1, -2))

    dq = np.transpose(dq, (0, 2, 1, 3))
    dk = _sum_heads_to_kv(dk, it.heads_kv)
    dv = _sum_heads_to_kv(dv, it.heads_kv)
    if dsinks is not None:
        return dq, dk, dv, dbias, dsinks
    return dq, dk, dv, dbias


def attention_forward(
    q, k, v, *, scale=None, causal=False, window=(-1, -1), alignment="bottom_right",
    bias=None, mask=None, alibi_slopes=None, softcap=0.0, dropout_p=0.0, seed=0, offset=0,
    sinks=None,
):
    """Reference attention forward pass.

    Parameters
    ----------
    q, k, v : array_like
        ``(batch, seqlen_q, heads_q, head_dim)``, ``(batch, seqlen_k, heads_kv,
        head_dim)`` and ``(batch, seqlen_k, heads_kv, head_dim_v)``.
    scale : float, optional
        Score scale; ``1/sqrt(head_dim)`` when None.
    causal : bool
        Shorthand for a right window of 0 (the left window is kept).
    window : (int, int)
        ``(left, right)`` sliding window around the diagonal; -1 is unbounded.
    alignment : {"bottom_right", "top_left"}
        Where the diagonal sits when seqlen_q != seqlen_k.
    bias : array_like, optional
        Additive float bias, broadcastable to ``(batch, heads_q, seqlen_q, seqlen_k)``.
    mask : array_like of bool, optional
        True = may attend; broadcastable like ``bias``.
    alibi_slopes : array_like, optional
        ``(heads_q,)`` or ``(batch, heads_q)`` ALiBi slopes.
    softcap : float
        Tanh soft-capping of the scaled scores when > 0.
    dropout_p, seed, offset :
        Dropout probability and Philox state (see :mod:`fmha._philox`).
    sinks : array_like, optional
        ``(heads_q,)`` attention-sink logits: each row's softmax runs over its scores and
        its head's sink, which carries no value (lse then includes it).

    Returns
    -------
    out : ndarray, (batch, seqlen_q, heads_q, head_dim_v), float64
    lse : ndarray, (batch, heads_q, seqlen_q), float64 (natural log; -inf for
        rows with no visible key)
    """
    it = _forward(
        q, k, v, scale=scale, causal=causal, window=window, alignment=alignment,
        bias=bias, mask=mask, alibi_slopes=alibi_slopes, softcap=softcap,
        dropout_p=dropout_p, seed=seed, offset=offset, sinks=sinks,
    )
    return _output(it), it.lse


def attention_backward(
    dout, q, k, v, *, scale=None, causal=False, window=(-1, -1), alignment="bottom_right",
    bias=None, mask=None, alibi_slopes=None, softcap=0.0, dropout_p=0.0, seed=0, offset=0,
    out=None, dlse=None, sinks=None,
):
    """Reference attention backward pass.

    Recomputes the forward pass with the same arguments as
    :func:`attention_forward` and returns the gradients of ``sum(out * dout)``, plus
    ``sum(lse * dlse)`` when ``dlse`` ((batch, heads_q, seqlen_q)) is given.
    ``out``, when given, is the forward output that ``D = rowsum(dout o out)`` is taken
    from (say, the rounded one a 16-bit kernel stored: the kernels take D from their stored
    out); by default the exact one.

    Returns
    -------
    dq : ndarray, shaped like q
    dk, dv : ndarrays, shaped like k and v (summed over the query heads of
        each kv head)
    dbias : ndarray shaped like ``bias`` (summed over its broadcast axes), or
        None when ``bias`` is None
    dsinks : ndarray (heads_q,), only when ``sinks`` is given
    """
    it = _forward(
        q, k, v, scale=scale, causal=causal, window=window, alignment=alignment,
        bias=bias, mask=mask, alibi_slopes=alibi_slopes, softcap=softcap,
        dropout_p=dropout_p, seed=seed, offset=offset, sinks=sinks,
    )
    bias_shape = None if bias is None else np.shape(bias)
    return _backward(dout, it, bias_shape, out, dlse)


def attention_probs(
    q, k, v, *, scale=None, causal=False, window=(-1, -1), alignment="bottom_right",
    bias=None, mask=None, alibi_slopes=None, softcap=0.0, dropout_p=0.0, seed=0, offset=0,
):
    """Softmax probabilities after masking and before dropout.

    Takes the arguments of :func:`attention_forward` (the dropout arguments are
    accepted and ignored) and returns ``P`` of shape
    ``(batch, heads_q, seqlen_q, seqlen_k)``; a row with no visible key is 0.
    """
    it = _forward(
        q, k, v, scale=scale, causal=causal, window=window, alignment=alignment,
        bias=bias, mask=mask, alibi_slopes=alibi_slopes, softcap=softcap,
        dropout_p=0.0, seed=seed, offset=offset,
    )
    return it.p


def _check_cu_seqlens(cu_seqlens, total, name):
    cu = np.asarray(cu_seqlens).astype(np.int64).reshape(-1)
    if cu.size < 1 or cu[0] != 0 or np.any(np.diff(cu) < 0) or cu[-1] != total:
        raise ValueError(
            f"{name} must start at 0, be non-decreasing and end at {total}; got {cu.tolist()}"
        )
    return cu


def _varlen_sequences(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes):
    """Yield (b, slice_q, slice_k, per-sequence alibi slopes) for each sequence."""
    q = np.asarray(q)
    k = np.asarray(k)
    v = np.asarray(v)
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        raise ValueError(
            "varlen q, k, v must be 3-D (total_tokens, heads, head_dim); got shapes "
            f"{q.shape}, {k.shape}, {v.shape}"
        )
    cu_q = _check_cu_seqlens(cu_seqlens_q, q.shape[0], "cu_seqlens_q")
    cu_k = _check_cu_seqlens(cu_seqlens_k, k.shape[0], "cu_seqlens_k")
    if cu_q.size != cu_k.size:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must have the same length, got {cu_q.size} and {cu_k.size}"
        )
    slopes = None if alibi_slopes is None else np.asarray(alibi_slopes, dtype=np.float64)
    if slopes is not None and slopes.ndim == 2 and slopes.shape[0] != cu_q.size - 1:
        raise ValueError(
            f"alibi_slopes of shape {slopes.shape} must have one row per sequence ({cu_q.size - 1})"
        )
    for b in range(cu_q.size - 1):
        sq = slice(int(cu_q[b]), int(cu_q[b + 1]))
        sk = slice(int(cu_k[b]), int(cu_k[b + 1]))
        seq_slopes = slopes
        if slopes is not None and slopes.ndim == 2:
            seq_slopes = slopes[b]
        yield b, sq, sk, seq_slopes


def attention_varlen_forward(
    q, k, v, cu_seqlens_q, cu_seqlens_k, *, scale=None, causal=False, window=(-1, -1),
    alignment="bottom_right", alibi_slopes=None, softcap=0.0, dropout_p=0.0, seed=0, offset=0,
):
    """Reference forward pass over a packed variable-length batch.

    ``q`` is ``(total_q, heads_q, head_dim)``, ``k``/``v`` are ``(total_k,
    heads_kv, dim)``; sequence ``b`` occupies rows ``cu_seqlens_q[b] :
    cu_seqlens_q[b+1]`` of ``q`` (likewise for ``k``/``v``). Each sequence is
    attended independently, with ``b`` as its dropout batch index and, when
    ``alibi_slopes`` is ``(batch, heads_q)``, its own row of slopes.

    Returns ``out`` ``(total_q, heads_q, head_dim_v)`` and ``lse``
    ``(heads_q, total_q)``.
    """
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    out = np.zeros(q.shape[:2] + v.shape[2:], dtype=np.float64)
    lse = np.full((q.shape[1], q.shape[0]), -np.inf, dtype=np.float64)
    for b, sq, sk, slopes in _varlen_sequences(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes):
        it = _forward(
            q[None, sq], k[None, sk], v[None, sk], scale=scale, causal=causal, window=window,
            alignment=alignment, bias=None, mask=None, alibi_slopes=slopes, softcap=softcap,
            dropout_p=dropout_p, seed=seed, offset=offset, batch_index_start=b,
        )
        out[sq] = _output(it)[0]
        lse[:, sq] = it.lse[0]
    return out, lse


def attention_varlen_backward(
    dout, q, k, v, cu_seqlens_q, cu_seqlens_k, *, scale=None, causal=False, window=(-1, -1),
    alignment="bottom_right", alibi_slopes=None, softcap=0.0, dropout_p=0.0, seed=0, offset=0,
    dlse=None,
):
    """Reference backward pass over a packed variable-length batch.

    Arguments as :func:`attention_varlen_forward`, plus ``dout`` shaped like
    its ``out`` and, optionally, ``dlse`` shaped like its lse ``(heads_q, total_q)``.
    Returns ``(dq, dk, dv)`` shaped like ``q``, ``k``, ``v``.
    """
    dout = np.asarray(dout, dtype=np.float64)
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    dq = np.zeros_like(q)
    dk = np.zeros_like(k)
    dv = np.zeros_like(v)
    for b, sq, sk, slopes in _varlen_sequences(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes):
        it = _forward(
            q[None, sq], k[None, sk], v[None, sk], scale=scale, causal=causal, window=window,
            alignment=alignment, bias=None, mask=None, alibi_slopes=slopes, softcap=softcap,
            dropout_p=dropout_p, seed=seed, offset=offset, batch_index_start=b,
        )
        dlse_b = None if dlse is None else np.asarray(dlse, dtype=np.float64)[None, :, sq]
        dq_b, dk_b, dv_b, _ = _backward(dout[None, sq], it, None, dlse=dlse_b)
        dq[sq] = dq_b[0]
        dk[sk] = dk_b[0]
        dv[sk] = dv_b[0]
    return dq, dk, dv


def kvcache_rows(cache, b, n, block_table=None):
    """Rows 0..n-1 of sequence b of a KV cache, ``(n, heads_kv, dim)``: contiguous
    ``(batch, capacity, heads_kv, dim)``, or a paged pool ``(num_blocks, block_size,
    heads_kv, dim)`` read through ``block_table[b]``."""
    cache = np.asarray(cache)
    if block_table is None:
        return cache[b, :n]
    bs = cache.shape[1]
    table = np.asarray(block_table)[b]
    return np.stack([cache[table[j // bs], j % bs] for j in range(n)]) if n else cache[0, :0]


def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens,
                           block_table=None, scale=None, causal=False, window=(-1, -1),
                           alibi_slopes=None, softcap=0.0):
    """Reference of :func:`fmha.attention_with_kvcache`, without touching the caches.

    Sequence ``b`` attends to its cached rows ``0 .. cache_seqlens[b] - 1`` followed by its
    new rows ``k[b], v[b]`` (if given), aligned bottom-right; each sequence is attended
    independently, with its own row of ``(batch, heads_q)`` ALiBi slopes. Returns ``out``
    ``(batch, seqlen_q, heads_q, head_dim_v)`` and ``lse`` ``(batch, heads_q, seqlen_q)``.
    """
    q = np.asarray(q, dtype=np.float64)
    batch = q.shape[0]
    lens = np.broadcast_to(np.asarray(cache_seqlens), (batch,))
    outs, lses = [], []
    for b in range(batch):
        kb = kvcache_rows(k_cache, b, int(lens[b]), block_table).astype(np.float64)
        vb = kvcache_rows(v_cache, b, int(lens[b]), block_table).astype(np.float64)
        if k is not None:
            kb = np.concatenate([kb, np.asarray(k, dtype=np.float64)[b]])
            vb = np.concatenate([vb, np.asarray(v, dtype=np.float64)[b]])
        slopes = None
        if alibi_slopes is not None:
            a = np.asarray(alibi_slopes, dtype=np.float64)
            slopes = a[b] if a.ndim == 2 else a
        out, lse = attention_forward(q[b:b + 1], kb[None], vb[None], scale=scale,
                                     causal=causal, window=window, alibi_slopes=slopes,
                                     softcap=softcap)
        outs.append(out[0])
        lses.append(lse[0])
    return np.stack(outs), np.stack(lses)


# ---------------------------------------------------------------- float8 (e4m3) inputs

#: The offset of the float8 forward's exponent (docs/semantics.md, "FP8 inputs"): P is
#: computed as 2**8 * exp(S - m) against the running row maximum m, so that its largest
#: entries use e4m3's range up to 256 (of 448) instead of [0, 1], where the values below
#: 2**-6 would lose bits as subnormals and those below 2**-10 would flush to zero.
FP8_P_OFFSET = 8


def fp8_dequantize(codes, descale=None, heads_per_factor=1):
    """float64 values of float8_e4m3fn codes (uint8 bytes, or ml_dtypes float8 arrays)
    ``(batch, seqlen, heads, dim)`` times their factor: ``descale`` broadcastable to
    ``(batch, heads // heads_per_factor)`` (flash-attn 3's per (batch, kv head) layout;
    query heads pass heads_per_factor = heads_q // heads_kv), None = 1."""
    x = decode_table("float8_e4m3fn")[as_codes(codes)]
    if descale is None:
        return x
    batch, heads = x.shape[0], x.shape[2]
    d = np.broadcast_to(np.asarray(descale, dtype=np.float64),
                        (batch, heads // heads_per_factor))
    return x * np.repeat(d, heads_per_factor, axis=1)[:, None, :, None]


def _e4m3(x: np.ndarray) -> np.ndarray:
    """x rounded as float32, then to the nearest e4m3 value (ties to even)."""
    return decode_table("float8_e4m3fn")[quantize(x, "float8_e4m3fn", np.float32(1.0))]


def _p_quantised_output(s: np.ndarray, v: np.ndarray, block_k: int):
    """O and lse of the float8 kernel's online softmax: for each tile of block_k keys, in
    order, the row maximum m is updated, P = 2**FP8_P_OFFSET * exp(S - m) is rounded to
    e4m3 for P V, the row sum l takes P unrounded, and earlier O and l are rescaled by
    exp(m_old - m_new); O / l at the end. s: (..., Sq, Sk) scores, -inf where excluded;
    v: (..., Sk, Dv). A row with no visible key gives 0 and -inf."""
    m = np.full(s.shape[:-1], -np.inf)
    l = np.zeros(s.shape[:-1])
    o = np.zeros(s.shape[:-1] + v.shape[-1:])
    for j in range(0, s.shape[-1], block_k):
        tile = s[..., j:j + block_k]
        m_new = np.maximum(m, tile.max(axis=-1, initial=-np.inf))
        ref = np.where(m_new == -np.inf, 0.0, m_new)
        alpha = np.exp(m - ref)  # 0 while m is -inf: o and l are still 0
        p = np.exp(tile - ref[..., None] + FP8_P_OFFSET * math.log(2.0))
        l = l * alpha + p.sum(axis=-1)
        o = o * alpha[..., None] + _e4m3(p) @ v[..., j:j + block_k, :]
        m = m_new
    seen = l > 0
    out = np.where(seen[..., None], o / np.where(seen, l, 1.0)[..., None], 0.0)
    with np.errstate(divide="ignore"):
        lse = np.where(seen, m + np.log(np.where(seen, l, 1.0)) - FP8_P_OFFSET * math.log(2.0),
                       -np.inf)
    return out, lse


def attention_fp8_forward(
    q, k, v, *, descale_q=None, descale_k=None, descale_v=None, quantize_p=False,
    block_k=128, scale=None, causal=False, window=(-1, -1), alignment="bottom_right",
    bias=None, mask=None, alibi_slopes=None, softcap=0.0,
):
    """Reference forward of float8_e4m3fn inputs (docs/semantics.md, "FP8 inputs").

    q, k, v: e4m3 codes as uint8 bytes (``t.view(torch.uint8).numpy()`` of a
    torch.float8_e4m3fn tensor) in the layout of :func:`attention_forward`; descale_q,
    descale_k, descale_v: factors broadcastable to ``(batch, heads_kv)``, None = 1 (a query
    head uses its kv head's factor). The other keywords as in :func:`attention_forward`.

    quantize_p=False: what the float8 forward computes, exact attention of the dequantised
    inputs (:func:`fp8_dequantize`), the yardstick every backend is measured against.
    quantize_p=True: a model of a kernel that rounds P to e4m3 for P V as flash-attn 3's
    fp8 kernel does (see :func:`_p_quantised_output`), key tiles of ``block_k`` from the
    first key on; finite inputs only.

    Returns out (batch, seqlen_q, heads_q, head_dim_v) and lse (batch, heads_q,
    seqlen_q), float64.
    """
    heads_q, heads_kv = np.shape(q)[2], np.shape(k)[2]
    group = heads_q // heads_kv if heads_kv else 1
    qd = fp8_dequantize(q, descale_q, group)
    kd = fp8_dequantize(k, descale_k)
    vd = fp8_dequantize(v, descale_v)
    kw = dict(scale=scale, causal=causal, window=window, alignment=alignment, bias=bias,
              mask=mask, alibi_slopes=alibi_slopes, softcap=softcap)
    if not quantize_p:
        return attention_forward(qd, kd, vd, **kw)
    if not (isinstance(block_k, int) and block_k >= 1):
        raise ValueError(f"block_k: expected an int >= 1, got {block_k!r}")
    it = _forward(qd, kd, vd, dropout_p=0.0, seed=0, offset=0, **kw)
    out, lse = _p_quantised_output(it.s, it.v, block_k)
    return np.transpose(out, (0, 2, 1, 3)), lse
