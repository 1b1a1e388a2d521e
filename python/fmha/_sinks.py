"""Attention sinks (gpt-oss): a learned logit per query head in every softmax denominator,
softmax over [s_i1 .. s_in, sink_h], the sink carrying no value (docs/semantics.md,
"Attention sinks").

A sink changes a row only through its normaliser: with (out, lse) of attention without
it, lse' = logaddexp(lse, sink) and out' = out · exp(lse - lse'). So sinks compose on the
kernels' out and lse, and their gradients follow from a differentiable lse: torch's
autograd differentiates the composition (the kernels fold the lse gradient, D - dlse);
for arrays, the kernels' backward run on (out', lse') recomputes P' = exp(S - lse') and is
exact for q, k, v and bias, and dsink_h = -sum over the head's rows of
exp(sink_h - lse'_i) (rowsum(dout ∘ out')_i - dlse_i).
"""

from __future__ import annotations

import numpy as np

from ._validate import _check_array, _check_float


def check(sinks, q, heads_q: int):
    """sinks: a float (heads_q,) array of q's kind (and, for torch, device)."""
    from ._validate import device_of, kind_of
    kind = kind_of(q)
    _check_array("sinks", sinks, kind, (1,))
    _check_float("sinks", sinks)
    if tuple(sinks.shape) != (heads_q,):
        raise ValueError(f"sinks: expected shape ({heads_q},) (one logit per query head), got "
                         f"{tuple(sinks.shape)}")
    if device_of(sinks) != device_of(q):
        raise ValueError(f"sinks: on device {device_of(sinks)}, expected q's device "
                         f"{device_of(q)}")


def _row_layout(sinks, lse_ndim):
    """The sinks broadcast against lse: (batch, heads, seqlen) or varlen (heads, total)."""
    return sinks[None, :, None] if lse_ndim == 3 else sinks[:, None]


def _rows_to_out(w, out_ndim):
    """A per-row factor laid out like lse, made to scale out ((b, s, h, d) or (t, h, d))."""
    return w.transpose(1, 2)[..., None] if out_ndim == 4 else w.transpose(0, 1)[..., None]


def apply_torch(out, lse, sinks):
    """(out', lse') from attention's (out, lse): differentiable in all three."""
    import torch
    s = _row_layout(sinks.to(lse.dtype), lse.ndim)
    lse2 = torch.logaddexp(lse, s)
    w = torch.exp(lse - lse2)  # 0 for a row with no visible key: all its mass is the sink's
    out2 = (out.to(w.dtype) * _rows_to_out(w, out.ndim)).to(out.dtype)
    return out2, lse2


def apply_numpy(out, lse, sinks):
    s = _row_layout(np.asarray(sinks, dtype=lse.dtype), lse.ndim)
    lse2 = np.logaddexp(lse, s)
    with np.errstate(invalid="ignore"):
        w = np.exp(lse - lse2)
    w_out = np.swapaxes(w, 1, 2)[..., None] if out.ndim == 4 else np.swapaxes(w, 0, 1)[..., None]
    return (out.astype(w.dtype) * w_out).astype(out.dtype), lse2


def _sink_rows(dout, out, lse, sinks, dlse):
    """Per row, laid out like lse: -exp(sink - lse') (rowsum(dout ∘ out') - dlse), float64."""
    d = np.sum(np.asarray(dout, np.float64) * np.asarray(out, np.float64), axis=-1)
    d = np.swapaxes(d, 1, 2) if d.ndim == 3 else np.swapaxes(d, 0, 1)  # laid out like lse
    if dlse is not None:
        d = d - np.asarray(dlse, np.float64)
    lse = np.asarray(lse, np.float64)
    return -np.exp(_row_layout(np.asarray(sinks, np.float64), lse.ndim) - lse) * d


def dsinks_numpy(dout, out, lse, sinks, dlse=None):
    """d loss / d sinks for arrays: out and lse are the call's (with sinks), dout (and dlse)
    their gradients. Float64 sums, returned in sinks' dtype."""
    rows = _sink_rows(dout, out, lse, sinks, dlse)
    return rows.sum(axis=(0, 2) if rows.ndim == 3 else (1,)).astype(np.asarray(sinks).dtype)


def constant_bias_correction(dout, out, lse, sinks, dlse, bias_shape):
    """What a bias constant along the keys gains with sinks, which do not move with it: the
    kernels' dbias for it is sum dlse over rows that see a key (no sink shift), the true one
    sum_j dS_ij = exp(sink - lse') (rowsum(dout ∘ out') - dlse) + dlse for every row. The
    difference, summed over the bias's broadcast dimensions into bias_shape (dense calls)."""
    rows = -_sink_rows(dout, out, lse, sinks, dlse)[..., None]  # (batch, heads, seqlen_q, 1)
    shape = (1,) * (4 - len(bias_shape)) + tuple(bias_shape)   # the bias as 4-D
    axes = tuple(i for i in range(4) if shape[i] == 1 and rows.shape[i] > 1)
    return rows.sum(axis=axes, keepdims=True).reshape(bias_shape)
