"""The forward never materialises the (seqlen_q, seqlen_k) score matrix.

The requirement: a forward at batch 1, 8 heads, seqlen 16384, head_dim 64, float32 raises
the process's peak memory by less than 2x the bytes of q, k, v and out together (naive
attention would need 8 GiB).

Each measurement runs in a fresh interpreter so that the peak RSS (getrusage ru_maxrss,
KiB on Linux) is not polluted by other tests. The inputs are generated directly in float32
(no float64 temporaries), so that just before the call the current RSS and the peak agree;
the increase is measured from the *current* RSS before the call to the peak after it, which
is the stricter of the two possible baselines.
"""

import json
import subprocess
import sys
import textwrap

import pytest

if not sys.platform.startswith("linux"):  # pragma: no cover
    pytest.skip("ru_maxrss in KiB and /proc/self/statm are Linux's", allow_module_level=True)

BATCH, HEADS, SEQLEN, HEAD_DIM = 1, 8, 16384, 64

_SCRIPT = textwrap.dedent("""
    import json, os, resource, sys, time, traceback
    # On Linux a process inherits its parent's ru_maxrss across fork and exec (the pytest
    # process with torch loaded is ~400 MiB, which would hide the call under that old peak).
    # A process forked from a small process starts afresh: so fork once more, first thing,
    # and measure in the grandchild.
    pid = os.fork()
    if pid:
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        if code < 0:
            print(f"the measuring process died of signal {-code}", file=sys.stderr)
        sys.exit(1 if code else 0)
    try:
        exec(compile(sys.argv[7], "<measure>", "exec"))
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)
""")

_MEASURE = textwrap.dedent("""
    import json, os, resource, sys, time
    LIB, CAUSAL = sys.argv[1], sys.argv[2] == "causal"
    B, H, S, D = (int(x) for x in sys.argv[3:7])
    import numpy as np
    if LIB == "torch":
        import torch
    import fmha
    fmha.set_num_threads(os.cpu_count())

    def peak_kib():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def current_kib():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024

    # No warm-up call: whatever the first call sets up (thread pool, workspaces) counts.
    rng = np.random.default_rng(0)
    if LIB == "torch":
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(B, S, H, D, generator=g) for _ in range(3))
        nbytes = lambda x: x.numel() * x.element_size()
    else:
        q, k, v = (rng.standard_normal((B, S, H, D), dtype=np.float32) for _ in range(3))
        nbytes = lambda x: x.nbytes
    for x in (q, k, v):  # every page touched (randn already wrote them; read them back too)
        assert float(x.sum()) == float(x.sum())

    cur_before, peak_before = current_kib(), peak_kib()
    t0 = time.perf_counter()
    out = fmha.attention(q, k, v, causal=CAUSAL)
    seconds = time.perf_counter() - t0
    peak_after = peak_kib()
    finite = bool(np.isfinite(np.asarray(out[0, :: S // 7])).all())
    # a few rows recomputed directly in float64: the big call computed attention, not junk
    qn, kn, vn, on = (np.asarray(x) for x in (q, k, v, out))
    err = 0.0
    for i, h in ((0, 0), (S // 3, 5), (S - 1, H - 1)):
        s = (kn[0, :, h].astype(np.float64) @ qn[0, i, h].astype(np.float64)) / np.sqrt(D)
        if CAUSAL:
            s[i + 1:] = -np.inf
        p = np.exp(s - s.max())
        want = (p / p.sum()) @ vn[0, :, h].astype(np.float64)
        err = max(err, float(np.abs(on[0, i, h] - want).max()))
    print(json.dumps(dict(
        cur_before_kib=cur_before, peak_before_kib=peak_before, peak_after_kib=peak_after,
        qkvo_bytes=sum(nbytes(x) for x in (q, k, v, out)),
        out_shape=list(out.shape), out_dtype=str(out.dtype), seconds=seconds, finite=finite,
        row_err=err,
        threads=fmha.get_num_threads())))
""")


def _measure(lib, causal):
    res = subprocess.run(
        [sys.executable, "-c", _SCRIPT, lib, "causal" if causal else "full",
         str(BATCH), str(HEADS), str(SEQLEN), str(HEAD_DIM), _MEASURE],
        capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"rc={res.returncode}\n{res.stdout}\n{res.stderr[-3000:]}"
    return json.loads(res.stdout.strip().splitlines()[-1])


def _check(m):
    qkvo = m["qkvo_bytes"]
    assert qkvo == 4 * BATCH * SEQLEN * HEADS * HEAD_DIM * 4  # 128 MiB
    assert m["out_shape"] == [BATCH, SEQLEN, HEADS, HEAD_DIM]
    assert "float32" in m["out_dtype"]
    assert m["finite"]
    assert m["row_err"] < 1e-4, m
    # The baseline is meaningful only if nothing before the call had pushed the peak far
    # above the current usage (otherwise the call could hide under that slack).
    slack_kib = m["peak_before_kib"] - m["cur_before_kib"]
    increase = (m["peak_after_kib"] - m["cur_before_kib"]) * 1024
    print(f"\n{m['threads']} threads, {m['seconds']:.1f} s: RSS before {m['cur_before_kib']} KiB "
          f"(peak {m['peak_before_kib']} KiB, slack {slack_kib} KiB), peak after "
          f"{m['peak_after_kib']} KiB; increase {increase / 2**20:.1f} MiB, "
          f"bound 2 x (q+k+v+out) = {2 * qkvo / 2**20:.0f} MiB "
          f"(naive scores: {BATCH * HEADS * SEQLEN * SEQLEN * 4 / 2**30:.0f} GiB); "
          f"max error of 3 rows vs float64: {m['row_err']:.2e}")
    assert slack_kib * 1024 < qkvo // 4, m
    assert increase < 2 * qkvo, m


def test_forward_peak_memory_numpy():
    """Non-causal, NumPy inputs: the full ~550 GFLOP forward (10-30 s on two cores)."""
    _check(_measure("numpy", causal=False))


def test_forward_peak_memory_torch_causal():
    pytest.importorskip("torch")
    _check(_measure("torch", causal=True))
