"""fmha called from several Python threads at once.

The CPU kernels release the GIL and share one thread pool (csrc/fmha/threads.cpp: one
parallel region at a time, concurrent callers queue), and the thread count is a process-wide
setting read at each call (fmha.set_num_threads). Results do not depend on the thread count,
so calls made concurrently -- NumPy and torch, forward and backward, different shapes and
dtypes, dense and varlen, while another thread keeps changing set_num_threads -- must give
exactly the bits of the same calls made one after another.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import fmha
from conftest import make_array

torch = pytest.importorskip("torch")

WORKERS = 6
ROUNDS = 2


def _bits(x):
    """The bytes of an array or tensor (bitwise comparison: -0.0 != 0.0, NaN payloads)."""
    if isinstance(x, torch.Tensor):
        return x.detach().contiguous().view(torch.uint8).numpy().tobytes()
    return np.ascontiguousarray(x).tobytes()


def _numpy_job(rng, dtype, shape, **kw):
    b, sq, sk, hq, hkv, d, dv = shape
    q = make_array(rng, (b, sq, hq, d), dtype)
    k = make_array(rng, (b, sk, hkv, d), dtype)
    v = make_array(rng, (b, sk, hkv, dv), dtype)
    do = make_array(rng, (b, sq, hq, dv), dtype)
    if kw.pop("with_bias", False):
        kw["bias"] = make_array(rng, (b, 1, sq, sk), dtype)

    def run():
        out, lse = fmha.attention(q, k, v, return_lse=True, **kw)
        grads = fmha.attention_backward(do, q, k, v, out, lse, bias_grad="bias" in kw, **kw)
        return (out, lse) + tuple(grads)
    return run


def _torch_job(rng, dtype, shape, **kw):
    b, sq, sk, hq, hkv, d, dv = shape
    q, k, v, do = (make_array(rng, s, dtype, "torch") for s in
                   ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, dv), (b, sq, hq, dv)))
    if kw.get("alibi_slopes") == "h":
        kw["alibi_slopes"] = torch.from_numpy(rng.uniform(0.01, 0.3, hq).astype(np.float32))

    def run():
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        out, lse = fmha.attention(*leaves, return_lse=True, **kw)
        out.backward(do)
        return (out, lse) + tuple(x.grad for x in leaves)
    return run


def _varlen_job(rng, dtype, lens_q, lens_k, hq, hkv, d, **kw):
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = make_array(rng, (cu_q[-1], hq, d), dtype)
    k = make_array(rng, (cu_k[-1], hkv, d), dtype)
    v = make_array(rng, (cu_k[-1], hkv, d), dtype)
    do = make_array(rng, (cu_q[-1], hq, d), dtype)

    def run():
        out, lse = fmha.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **kw)
        return (out, lse) + tuple(fmha.attention_varlen_backward(do, q, k, v, out, lse, cu_q,
                                                                 cu_k, **kw))
    return run


def _jobs(rng):
    """Shapes (b, sq, sk, hq, hkv, d, dv) large enough to use several tasks of the pool."""
    return [
        _numpy_job(rng, "float32", (2, 97, 130, 4, 2, 64, 64), causal=True),
        _numpy_job(rng, "float64", (1, 70, 33, 2, 1, 40, 24), window=(5, 3), softcap=5.0),
        _numpy_job(rng, "float16", (2, 65, 129, 3, 3, 32, 48), dropout_p=0.3, seed=77,
                   with_bias=True),
        _numpy_job(rng, "float32", (1, 1, 700, 8, 2, 128, 128)),          # decode path
        _torch_job(rng, "bfloat16", (1, 129, 129, 2, 2, 64, 64), causal=True),
        _torch_job(rng, "float32", (3, 9, 200, 4, 1, 16, 16), alibi_slopes="h"),
        _torch_job(rng, "float16", (2, 40, 17, 2, 2, 111, 111), alignment="top_left",
                   causal=True),
        _varlen_job(rng, "float32", [30, 0, 90, 5], [40, 7, 90, 0], 4, 2, 32, causal=True),
    ]


def test_concurrent_calls_match_sequential(rng, restore_threads):
    jobs = _jobs(rng)
    expected = [[_bits(x) for x in job()] for job in jobs]

    stop = threading.Event()
    start = threading.Barrier(WORKERS + 1)
    errors = []
    mismatches = []
    changes = [0]

    def worker(w):
        try:
            start.wait()
            for r in range(ROUNDS):
                for j in range(len(jobs)):
                    j = (j + w + r) % len(jobs)     # different jobs run side by side
                    got = [_bits(x) for x in jobs[j]()]
                    if got != expected[j]:
                        mismatches.append((w, r, j))
        except Exception as e:  # noqa: BLE001 -- reported by the main thread
            errors.append(e)

    def toggler():
        settings = [1, 2, 3, None, 4, 2]
        start.wait()
        while not stop.is_set():
            fmha.set_num_threads(settings[changes[0] % len(settings)])
            changes[0] += 1
            stop.wait(0.001)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(WORKERS)]
    flip = threading.Thread(target=toggler)
    for t in threads + [flip]:
        t.start()
    for t in threads:
        t.join(timeout=300)
    stop.set()
    flip.join(timeout=10)
    assert not any(t.is_alive() for t in threads + [flip]), "a thread did not finish"
    assert not errors, errors
    assert not mismatches, f"(worker, round, job) whose bits differ from sequential: {mismatches}"
    assert changes[0] > 1  # the thread count really changed while the calls ran
