"""fmha's CPU kernels on torch's OpenMP threads (fmha/_torch.py, _share_torch_threads): with
torch loaded, the parallel regions run on the OpenMP runtime torch uses, not on fmha's own
pool, so the two do not compete for the cores. Results must not depend on which runs them."""

import multiprocessing
import os

import numpy as np
import pytest
import torch

import fmha
from fmha import _C
from fmha import _torch as fmha_torch

RUNTIME = fmha_torch._torch_openmp_runtime()
needs_runtime = pytest.mark.skipif(RUNTIME is None, reason="torch loaded no OpenMP runtime")


@pytest.fixture
def own_pool_after():
    threads = fmha.get_num_threads()
    yield
    fmha.set_num_threads(threads)
    if RUNTIME is not None and os.environ.get("FMHA_OWN_THREADS", "") in ("", "0"):
        assert _C.use_openmp_runtime(RUNTIME)


@needs_runtime
def test_torch_runtime_is_used():
    assert os.path.basename(RUNTIME).startswith(("libgomp", "libiomp5"))
    assert _C.using_openmp_runtime() == (os.environ.get("FMHA_OWN_THREADS", "") in ("", "0"))
    assert not _C.use_openmp_runtime("/nonexistent/libgomp.so.1")  # never loads a second one


def _forward_backward(seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(3, 150, 4, 48, generator=g, requires_grad=True)
    k = torch.randn(3, 170, 2, 48, generator=g, requires_grad=True)
    v = torch.randn(3, 170, 2, 48, generator=g, requires_grad=True)
    out = fmha.attention(q, k, v, causal=True)
    out.backward(torch.randn(out.shape, generator=g))
    return [out.detach(), q.grad, k.grad, v.grad]


@needs_runtime
def test_same_bits_on_either_runtime(own_pool_after):
    """Forward and backward, 1 to 3 threads, on torch's OpenMP threads and on the pool."""
    want = None
    for runtime in (RUNTIME, ""):
        assert _C.use_openmp_runtime(runtime)
        for threads in (1, 2, 3):
            fmha.set_num_threads(threads)
            got = _forward_backward(0)
            if want is None:
                want = got
            for g, w in zip(got, want):
                assert torch.equal(g, w), (runtime, threads)


def _child(queue, q, k):
    # fmha only: no torch operator runs here (they would wait, see below)
    out = fmha.attention(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(k))
    want = fmha.attention(q, k, k)
    refused = not _C.use_openmp_runtime(RUNTIME) and not _C.using_openmp_runtime()
    queue.put(bool(np.array_equal(out.numpy(), want) and np.isfinite(want).all() and refused))


@needs_runtime
def test_forked_child_runs_on_the_pool(own_pool_after):
    """A child forked after the parent ran regions on the OpenMP runtime has none of its
    threads: fmha runs on a new pool there instead of waiting for them, and the runtime
    cannot be turned on again there. (torch's own
    parallel operators do wait in such a child, fmha or not: libgomp is not fork-safe, so
    the child here calls fmha only.)"""
    assert _C.use_openmp_runtime(RUNTIME)
    fmha.set_num_threads(2)
    _forward_backward(2)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    rng = np.random.default_rng(1)
    q, k = (rng.standard_normal(s, dtype=np.float32) for s in ((3, 150, 4, 48), (3, 170, 2, 48)))
    child = ctx.Process(target=_child, args=(queue, q, k))
    child.start()
    child.join(120)
    alive = child.is_alive()
    if alive:
        child.kill()
    assert not alive and child.exitcode == 0 and queue.get(timeout=5)
