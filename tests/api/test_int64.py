"""int64 indexing: K and V with more than 2**31 elements (CPU, bfloat16, forward).

An element offset of K or V (row * row_stride, batch * batch_stride) past 2**31 overflows
32-bit arithmetic; the answers here depend on the last rows, so a wrapped offset reads the
wrong memory (or faults) and the check fails.

Memory: K and V are 4 GiB each of virtual memory, mapped anonymously with huge pages off
(MADV_NOHUGEPAGE) and written only in the rows that carry the signal: every other page is
read through the kernel's shared zero page, so the resident memory stays small (asserted:
the peak grows by less than 1 GiB; ~0.1 GiB measured). The backward is not run: its dK and
dV would be 8 GiB of written memory.
Time: ~5 s on a 2-core VM (the decode-path case reads all 2**24 keys).
"""

from __future__ import annotations

import math
import mmap

import numpy as np
import pytest

import fmha
from fmha import reference

torch = pytest.importorskip("torch")  # bfloat16

D = 128


def _zero_mapped(shape):
    """A bfloat16 zero tensor in fresh anonymous memory that is never written (page reads
    hit the zero page), except where the caller writes."""
    nbytes = 2 * math.prod(shape)
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.from_numpy(np.frombuffer(mm, np.uint16).reshape(shape)).view(torch.bfloat16)


def _peak_rss_reset():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size


def _peak_rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/self/status")


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE


@pytest.fixture
def rss_guard():
    """The test's peak resident memory must grow by less than 1 GiB."""
    _peak_rss_reset()
    before = _rss_bytes()
    yield
    grown = _peak_rss_bytes() - before
    assert grown < 2**30, f"peak resident memory grew by {grown / 2**30:.2f} GiB"


def test_decode_reads_every_key_past_2_31(rss_guard):
    """seqlen_k = 2**24 + 64 rows of 128: element offsets up to 2**31 + 8192. Two query rows
    per head (GQA 2:1, the decode path), causal bottom-right: row 1 sees every key, row 0
    all but the last. Every key but the last two scores 0; keys N-2 and N-1 score 16 and 17
    (head 0; half that for head 1), comparable with log N = 16.6, so out and lse depend on
    both the count of keys read and the last two rows."""
    n = 2**24 + 64
    assert n * D > 2**31
    k = _zero_mapped((1, n, 1, D))
    v = _zero_mapped((1, n, 1, D))
    k[0, n - 2, 0, 0] = 16.0
    k[0, n - 1, 0, 0] = 17.0
    v_last = (torch.arange(D) % 7 - 3).to(torch.bfloat16)
    v[0, n - 2, 0] = 2.0
    v[0, n - 1, 0] = v_last
    q = torch.zeros(1, 2, 2, D, dtype=torch.bfloat16)
    q[0, :, 0, 0] = 1.0
    q[0, :, 1, 0] = 0.5

    out, lse = fmha.attention(q, k, v, causal=True, scale=1.0, return_lse=True)

    exp_out = np.zeros((2, 2, D))
    exp_lse = np.zeros((2, 2))
    for h, qh in enumerate((1.0, 0.5)):
        w2, w1 = math.exp(16.0 * qh), math.exp(17.0 * qh)
        rest = n - 2                            # the zero-score keys: weight exp(0) = 1
        exp_out[0, h] = w2 * 2.0 / (rest + w2)  # row 0 does not see key n-1
        exp_lse[0, h] = math.log(rest + w2)
        exp_out[1, h] = (w2 * 2.0 + w1 * v_last.double().numpy()) / (rest + w2 + w1)
        exp_lse[1, h] = math.log(rest + w2 + w1)
    got = out[0].double().numpy()
    # bfloat16 output: half an ulp (2**-9 relative) plus float32 accumulation over 2**24 keys
    np.testing.assert_allclose(got, exp_out, rtol=2**-8, atol=1e-4)
    np.testing.assert_allclose(lse[0].double().numpy().T, exp_lse, rtol=1e-5)


def test_tiled_batch_offsets_past_2_31(rss_guard):
    """Two batches of 2**23 + 32 keys: batch 1's rows lie at element offsets 2**30 to
    2**31 + 8192 (batch * batch_stride + row * row_stride). 20 query rows per head (the
    tiled path) with a causal window of 3: each row sees four of the last 24 keys, random
    in both batches; the answer is the reference on those last rows."""
    m, sq, tail = 2**23 + 32, 20, 24
    assert 2 * m * D > 2**31
    k = _zero_mapped((2, m, 1, D))
    v = _zero_mapped((2, m, 1, D))
    rng = np.random.default_rng(64)
    k_tail = torch.from_numpy(rng.standard_normal((2, tail, 1, D))).to(torch.bfloat16)
    v_tail = torch.from_numpy(rng.standard_normal((2, tail, 1, D))).to(torch.bfloat16)
    k[:, m - tail:] = k_tail
    v[:, m - tail:] = v_tail
    q = torch.from_numpy(rng.standard_normal((2, sq, 1, D))).to(torch.bfloat16)

    out, lse = fmha.attention(q, k, v, causal=True, window=(3, 0), return_lse=True)

    # bottom-right alignment: the tail keeps the diagonal (off = tail - sq as m - sq did)
    ref_out, ref_lse = reference.attention_forward(
        *(x.double().numpy() for x in (q, k_tail, v_tail)), causal=True, window=(3, 0))
    np.testing.assert_allclose(out.double().numpy(), ref_out, rtol=2**-8, atol=2**-8)
    np.testing.assert_allclose(lse.double().numpy(), ref_lse, rtol=1e-5, atol=1e-5)
