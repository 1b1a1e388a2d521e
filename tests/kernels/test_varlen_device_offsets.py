"""Varlen offsets the host never reads: the CUDA kernels' own guards.

On CUDA, fmha does not copy cu_seqlens to the host (that would synchronise with the GPU), so
nothing validates their values before the kernels run; score::seq_of (csrc/fmha/score.h)
clamps every sequence instead: first row into [0, total], end into [first, total], length
capped at max_seqlen_q / max_seqlen_k (docs/semantics.md, "Variable-length batches").

The emulated kernels are called here directly (fmha._cuda_emu.forward / backward, fmha._C's
signature; the emulator treats its host arrays as GPU memory, so it does not read the offsets
either) -- as a CUDA caller under torch.compile, or one that passes wrong maxima, would reach
them -- with offsets past the packed rows, below 0, decreasing, at the int32 limit, and
sequences longer than the maxima. Every array lives in the middle of a larger buffer whose
margins hold a sentinel (NaN bit patterns): the outputs' margins must keep their bits, an
input read out of bounds would turn a result NaN, and the emulator's scratch guards
(csrc/cuda/primitives.cuh, Scratch) raise RuntimeError when a kernel wrote past its scratch
(split-KV partials, the backward's D and dQ accumulator, dS for dbias). Then:
  * rows that a clamped sequence covers are written and hold no NaN (the inputs are finite:
    a NaN could only come from a sentinel), the other rows keep the sentinel (not written);
  * sequences left whole by the clamp and sharing no row with another give the same bits as
    in a call where they are the only non-empty sequences.
"""

from __future__ import annotations

import numpy as np
import pytest

emu = pytest.importorskip("fmha._cuda_emu")

INT32_MAX = 2**31 - 1
HQ, HKV, D = 2, 1, 32
MARGIN = 8192  # elements of sentinel on each side of every array
SENTINEL = {np.dtype(np.float16): np.uint16(0x7E5A), np.dtype(np.float32): np.uint32(0x7FA5A5A5)}
UINT = {np.dtype(np.float16): np.uint16, np.dtype(np.float32): np.uint32}

# name: (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k); the packed q and k hold 48
# rows each. Sequences 0 and 1 of the first cases are well formed.
TOTAL = 48
CASES = {
    # the last sequence has 24 queries (keys), the maximum says 16: split-KV partials, D,
    # the dQ accumulator (and dS, bias) are sized by the maxima
    "longer_than_max_q": ([0, 10, 24, 48], [0, 10, 24, 48], 16, 24),
    "longer_than_max_k": ([0, 10, 24, 48], [0, 10, 24, 48], 24, 16),
    # the last sequence runs past the packed rows (to 90 queries, 70 keys)
    "past_packed_end": ([0, 10, 24, 90], [0, 10, 24, 70], 64, 64),
    # the first sequence starts before row 0
    "negative_start": ([-20, 10, 24, 48], [-6, 10, 24, 48], 32, 24),
    # sequence 1 runs backwards (empty after the clamp); sequence 2 overlaps sequence 0,
    # whose rows it shares hold either's results
    "decreasing": ([0, 30, 10, 48], [0, 20, 6, 48], 40, 44),
    # the int32 limits: sequence 1 ends at INT32_MAX, sequence 2 starts there
    "int32_limits": ([0, 10, INT32_MAX, 48], [0, 12, INT32_MAX, INT32_MAX], 40, 40),
}
# Features per case, rotating: plain attention, or the score pipeline's extras (bias read by
# position within the sequence, causal, dropout) with the dbias path.
EXTRAS = {"longer_than_max_q": True, "longer_than_max_k": True, "past_packed_end": False,
          "negative_start": True, "decreasing": False, "int32_limits": True}


def clamped(cu, total, most):
    """The ranges score::seq_of makes of the offsets: [first, first + length) per sequence."""
    out = []
    for a, b in zip(cu[:-1], cu[1:]):
        first = min(max(a, 0), total)
        end = min(max(b, first), total)
        out.append((first, first + min(end - first, most)))
    return out


def whole_and_alone(cu, ranges, b):
    """Sequence b is what its offsets say, and no other clamped sequence shares its rows."""
    lo, hi = ranges[b]
    if (lo, hi) != (cu[b], cu[b + 1]):
        return False
    return all(o_hi <= lo or o_lo >= hi or o_hi == o_lo
               for i, (o_lo, o_hi) in enumerate(ranges) if i != b)


def guarded(shape, dtype, fill=None):
    """(buffer, view): a contiguous view of `shape` in the middle of a flat buffer whose
    MARGIN elements on either side hold the sentinel; the view holds `fill` (default: the
    sentinel too)."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape))
    buf = np.full(n + 2 * MARGIN, SENTINEL[dtype], UINT[dtype]).view(dtype)
    view = buf[MARGIN:MARGIN + n].reshape(shape)
    if fill is not None:
        view[...] = fill
    return buf, view


def margins_intact(name, buf):
    bits = buf.view(UINT[buf.dtype])
    want = SENTINEL[buf.dtype]
    assert np.all(bits[:MARGIN] == want), f"{name}: written before its start"
    assert np.all(bits[-MARGIN:] == want), f"{name}: written past its end"


def unwritten(x):
    """Per row (first axis, or the last for lse): still the sentinel everywhere?"""
    bits = x.view(UINT[x.dtype])
    return np.all(bits == SENTINEL[x.dtype], axis=tuple(range(1, x.ndim)))


def check_rows(name, x, ranges, total):
    """Rows of some clamped range: written and finite; every other row: untouched."""
    covered = np.zeros(total, bool)
    for lo, hi in ranges:
        covered[lo:hi] = True
    rows = x if name != "lse" else x.T
    untouched = unwritten(rows)
    assert not np.any(untouched[covered]), f"{name}: rows {np.flatnonzero(untouched & covered)} of a sequence were not written"
    assert np.all(untouched[~covered]), f"{name}: rows {np.flatnonzero(~untouched & ~covered)} outside every sequence were written"
    # (lse is -inf, out 0, for a row that sees no key; NaN would come from a sentinel read)
    assert not np.any(np.isnan(rows[covered])), f"{name}: NaN (an out-of-bounds read?)"


def make_inputs(rng, extras, nseq, max_q, max_k):
    arrays = {}
    for name, rows, heads in (("q", TOTAL, HQ), ("k", TOTAL, HKV), ("v", TOTAL, HKV),
                              ("dout", TOTAL, HQ)):
        buf, view = guarded((rows, heads, D), np.float16,
                            rng.standard_normal((rows, heads, D)).astype(np.float16))
        arrays[name] = view
    kw = dict(scale=D ** -0.5, softcap=0.0, window_left=-1, window_right=-1, bottom_right=True,
              dropout_p=0.0, max_seqlen_q=max_q, max_seqlen_k=max_k)
    if extras:
        # (nseq, 1, max_q, max_k) in the middle of NaN margins, broadcast over the heads
        _, bias = guarded((nseq, 1, max_q, max_k), np.float16,
                          rng.standard_normal((nseq, 1, max_q, max_k)).astype(np.float16))
        kw.update(bias=np.broadcast_to(bias, (nseq, HQ, max_q, max_k)), window_right=0,
                  dropout_p=0.2, seed=12345)
    return arrays, kw


def forward(a, cu_q, cu_k, kw, num_splits):
    out_buf, out = guarded((TOTAL, HQ, D), np.float16)
    lse_buf, lse = guarded((HQ, TOTAL), np.float32)
    emu.forward(a["q"], a["k"], a["v"], out, lse, cu_seqlens_q=np.array(cu_q, np.int32),
                cu_seqlens_k=np.array(cu_k, np.int32), num_splits=num_splits, **kw)
    return dict(out=out, lse=lse), dict(out=out_buf, lse=lse_buf)


def backward(a, fwd, cu_q, cu_k, kw, deterministic):
    grads, bufs = {}, {}
    for name, like in (("dq", a["q"]), ("dk", a["k"]), ("dv", a["v"])):
        bufs[name], grads[name] = guarded(like.shape, np.float16)
    extra = {}
    if "bias" in kw:
        bufs["dbias"], grads["dbias"] = guarded((len(cu_q) - 1, 1, kw["max_seqlen_q"],
                                                 kw["max_seqlen_k"]), np.float32)
        extra["dbias"] = grads["dbias"]
    emu.backward(a["dout"], a["q"], a["k"], a["v"], fwd["out"], fwd["lse"], grads["dq"],
                 grads["dk"], grads["dv"], cu_seqlens_q=np.array(cu_q, np.int32),
                 cu_seqlens_k=np.array(cu_k, np.int32), deterministic=deterministic, **extra,
                 **kw)
    return grads, bufs


def cleaned(cu, good):
    """The offsets with every sequence but those in `good` (a contiguous run of the batch)
    made empty, the others unchanged."""
    cu, first, last = list(cu), min(good), max(good)
    assert good == list(range(first, last + 1)), "the malformed sequences must be a prefix or suffix"
    cu[:first] = [cu[first]] * first
    cu[last + 2:] = [cu[last + 1]] * (len(cu) - last - 2)
    return cu


@pytest.mark.parametrize("case", list(CASES))
def test_inconsistent_offsets_stay_in_bounds(rng, case):
    """Forward (without and with key splits) and backward (atomic and deterministic dQ) on
    inconsistent offsets: nothing outside the arrays is touched, the clamped sequences'
    rows are written and finite, the rest is not written, well-formed sequences are exact."""
    cu_q, cu_k, max_q, max_k = CASES[case]
    nseq = len(cu_q) - 1
    a, kw = make_inputs(rng, EXTRAS[case], nseq, max_q, max_k)
    rq, rk = clamped(cu_q, TOTAL, max_q), clamped(cu_k, TOTAL, max_k)
    good = [b for b in range(nseq)
            if whole_and_alone(cu_q, rq, b) and whole_and_alone(cu_k, rk, b)]
    if good:  # the same call with only the well-formed sequences non-empty
        clean_q, clean_k = cleaned(cu_q, good), cleaned(cu_k, good)
        for b in range(nseq):
            for clean, ranges, most in ((clean_q, rq, max_q), (clean_k, rk, max_k)):
                lo, hi = clamped(clean, TOTAL, most)[b]
                assert (lo, hi) == ranges[b] if b in good else lo == hi

    fwd = {}
    for splits in (1, 3):
        res, bufs = forward(a, cu_q, cu_k, kw, splits)
        for name, buf in bufs.items():
            margins_intact(name, buf)
        check_rows("out", res["out"], rq, TOTAL)
        check_rows("lse", res["lse"], rq, TOTAL)
        fwd = fwd or res
        if not good:
            continue
        want, _ = forward(a, clean_q, clean_k, kw, splits)
        for b in good:
            rows = slice(*rq[b])
            np.testing.assert_array_equal(res["out"][rows], want["out"][rows],
                                          err_msg=f"out of sequence {b}, {splits} splits")
            np.testing.assert_array_equal(res["lse"][:, rows], want["lse"][:, rows],
                                          err_msg=f"lse of sequence {b}, {splits} splits")

    # The backward from that forward's out and lse, unwritten (sentinel) rows included, as a
    # caller would pass them.
    for deterministic in (False, True):
        grads, bufs = backward(a, fwd, cu_q, cu_k, kw, deterministic)
        for name, buf in bufs.items():
            margins_intact(name, buf)
        check_rows("dq", grads["dq"], rq, TOTAL)
        check_rows("dk", grads["dk"], rk, TOTAL)
        check_rows("dv", grads["dv"], rk, TOTAL)
        if "dbias" in grads:
            assert not np.any(np.isnan(grads["dbias"])), "dbias: NaN (an out-of-bounds read?)"
        if not good:
            continue
        want, _ = backward(a, fwd, clean_q, clean_k, kw, deterministic)
        for b in good:
            for name, r in (("dq", rq[b]), ("dk", rk[b]), ("dv", rk[b])):
                np.testing.assert_array_equal(
                    grads[name][slice(*r)], want[name][slice(*r)],
                    err_msg=f"{name} of sequence {b}, deterministic={deterministic}")
            if "dbias" in grads:
                np.testing.assert_array_equal(grads["dbias"][b], want["dbias"][b],
                                              err_msg=f"dbias of sequence {b}")
