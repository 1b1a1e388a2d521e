"""fmha on a shared CPU: calls made while other processes keep the cores busy.

The thread pool's helpers (csrc/fmha/threads.cpp) may be descheduled in the middle of a task
or between joining a region and claiming one (and with FMHA_POOL_PARK_WHEN_BUSY=1 they park
instead of spinning on an oversubscribed machine); none of that may change a bit of a result,
on fmha's own pool or on torch's OpenMP threads. The busy processes are
the ones python -m fmha.bench --contention starts (fmha.bench.contention.Competitors).
"""

import os

import pytest
import torch

import fmha
from conftest import probes
from fmha import _C
from fmha import _torch as fmha_torch
from fmha.bench.contention import Competitors

RUNTIME = fmha_torch._torch_openmp_runtime()
DEFAULT_ON_RUNTIME = RUNTIME is not None and os.environ.get("FMHA_OWN_THREADS", "") in ("", "0")
RUNTIMES = ["pool"] + (["openmp"] if RUNTIME is not None else [])


@pytest.fixture
def restore_runtime():
    threads = fmha.get_num_threads()
    yield
    fmha.set_num_threads(threads)
    if DEFAULT_ON_RUNTIME:
        assert _C.use_openmp_runtime(RUNTIME)
    else:
        assert _C.use_openmp_runtime("")


def _use(runtime):
    assert _C.use_openmp_runtime(RUNTIME if runtime == "openmp" else "")


def _calls(seed):
    """Forward and backward at three shapes (one task per thread, many small tasks, a split
    key range with its merge region), causal and not."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for b, sq, sk, hq, hkv, d, causal in ((1, 512, 512, 4, 4, 64, False),
                                          (2, 130, 300, 6, 2, 32, True),
                                          (1, 1, 4096, 8, 8, 64, False)):
        q = torch.randn(b, sq, hq, d, generator=g, requires_grad=True)
        k = torch.randn(b, sk, hkv, d, generator=g, requires_grad=True)
        v = torch.randn(b, sk, hkv, d, generator=g, requires_grad=True)
        o = fmha.attention(q, k, v, causal=causal)
        o.backward(torch.randn(o.shape, generator=g))
        out += [o.detach(), q.grad, k.grad, v.grad]
    return out


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_same_bits_with_busy_processes(runtime, restore_runtime):
    """Calls on 1-3 threads while 0, 1 and 2 busy processes (nice 0 and 10) run: bitwise
    the quiet single-thread result."""
    _use(runtime)
    fmha.set_num_threads(1)
    want = _calls(0)
    for count, nice in ((1, 0), (2, 0), (2, 10)):
        with Competitors(count, nice) as comp:
            for threads in (1, 2, 3):
                fmha.set_num_threads(threads)
                for _ in range(3):
                    got = _calls(0)
                    for i, (g, w) in enumerate(zip(got, want)):
                        assert torch.equal(g, w), (runtime, count, nice, threads, i)
            # The results above were computed with the competitors running.
            assert all(p.poll() is None for p in comp.procs)
        assert comp.procs == []


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_every_task_runs_once(runtime, restore_runtime):
    """Each task of a region runs exactly once for any thread count, with and without busy
    processes, many regions in a row (helpers that were descheduled across regions must not
    take tasks of a later one)."""
    c = probes()
    _use(runtime)
    for count in (0, 2):
        with Competitors(count, 0):
            for threads in (1, 2, 3, 8):
                for n_tasks, task_ns in ((1, 0), (3, 0), (64, 0), (200, 20000), (1000, 0)):
                    for _ in range(20 if task_ns == 0 else 2):
                        runs = c.pool_task_runs(n_tasks, threads, task_ns=task_ns)
                        assert runs == [1] * n_tasks, (runtime, count, threads, n_tasks)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_exception_of_a_task_stops_the_region(runtime, restore_runtime):
    """A task's exception reaches the caller, and the next region runs every task once."""
    c = probes()
    _use(runtime)
    for threads in (1, 2, 4):
        for throw_at in (0, 7, 199):
            with pytest.raises(RuntimeError, match=f"task {throw_at} threw"):
                c.pool_task_runs(200, threads, throw_at=throw_at, task_ns=2000)
            assert c.pool_task_runs(200, threads, task_ns=2000) == [1] * 200


_MOVE_OFF_SCRIPT = r"""
import os, sys
if sys.argv[1] == "pool":
    os.environ["FMHA_OWN_THREADS"] = "1"
import torch, fmha
from fmha import _C
assert _C.using_openmp_runtime() == (sys.argv[1] == "openmp")
fmha.set_num_threads(2)
q = torch.randn(1, 1024, 8, 64)
before = set(os.listdir("/proc/self/task"))
fmha.attention(q, q, q)  # starts the helper (or torch's OpenMP team), with the process's CPUs
if sys.argv[1] == "pool":
    helpers = [t for t in os.listdir("/proc/self/task")
               if open(f"/proc/self/task/{t}/comm").read().strip() == "fmha-pool"]
else:
    helpers = sorted(set(os.listdir("/proc/self/task")) - before)
assert len(helpers) == 1, helpers
cpu = min(os.sched_getaffinity(0))
os.sched_setaffinity(0, {cpu})               # the caller (this thread) on one CPU
os.sched_setaffinity(int(helpers[0]), {cpu})  # and the helper beside it
for _ in range(20):
    fmha.attention(q, q, q)
print(cpu, sorted(os.sched_getaffinity(int(helpers[0]))))
"""


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and at least 2 CPUs this process may use")
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_helper_moves_off_the_callers_cpu(runtime):
    """A thread working for a region (a helper of the own pool, or torch's OpenMP worker) that
    finds itself on the CPU its caller runs on moves to the process's other CPUs
    (csrc/fmha/threads.cpp, keep_off_cpu): with one busy process on two cores, caller and
    helper sharing one core cost a 2-thread call 2x where the fair share is 1.5x. Forced here
    by pinning both to one CPU; the helper then holds every CPU it started with but that one."""
    import subprocess
    import sys
    allowed = sorted(os.sched_getaffinity(0))
    env = {k: v for k, v in os.environ.items() if k != "FMHA_OWN_THREADS"}
    out = subprocess.run([sys.executable, "-c", _MOVE_OFF_SCRIPT, runtime], capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    cpu, helper_cpus = out.stdout.split(" ", 1)
    assert eval(helper_cpus) == [c for c in allowed if c != int(cpu)]
