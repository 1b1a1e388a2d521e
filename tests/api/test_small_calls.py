"""What keeps a small call cheap, held to its contract (docs/cpu_kernels.md, "Small calls",
has the timings; a test here never times anything):

- the thread pool wakes no helper for a call too small to pay for one, and the result does
  not depend on how many it wakes (csrc/fmha/threads.cpp);
- an eager torch call that records no autograd runs the op's body directly, but every
  layer that must see the op (torch.compile, a dispatch mode, FakeTensors, autograd) still
  does (fmha/_torch.py, _direct);
- a repeated call's validation is a cache lookup that can never let through what the full
  validation refuses (fmha/_validate.py, _SPEC_CACHE);
- an eager call that records autograd runs the op's formula as an autograd.Function, not
  through torch's custom-op wrapper, with the op's outputs and gradients (fmha/_torch.py,
  _Attention);
- its backward likewise runs the op's body directly when nothing records or traces it: the
  op's implementation is wrapped by torch in torch._disable_dynamo, whose first call imports
  torch._dynamo (over a second, once per process);
- the plain call (no bias, mask, ALiBi, dropout, sinks or block mask) allocates its outputs
  and calls the kernels once, lse left to the kernels when not returned
  (fmha/_torch.py plain_forward, fmha/_api.py _plain_numpy), with the op's bits.
"""

from __future__ import annotations

import numpy as np
import pytest

import fmha
from fmha._validate import _SPEC_CACHE, prepare

torch = pytest.importorskip("torch")

from conftest import probes  # noqa: E402

MIN_WORK_PER_THREAD_NS = 20000  # kMinWorkPerThreadNs in csrc/fmha/threads.cpp


@pytest.mark.parametrize("n_tasks,threads,work,helpers", [
    (8, 2, 1000, 0),                              # a decode step on a short cache
    (8, 2, 2 * MIN_WORK_PER_THREAD_NS - 1, 0),    # not enough for two threads
    (8, 2, 2 * MIN_WORK_PER_THREAD_NS, 1),
    (8, 4, 3 * MIN_WORK_PER_THREAD_NS, 2),        # as many as the work pays for
    (2, 8, 10**12, 1),                            # never more than the tasks
    (100, 3, 2**63 - 1, 2),                       # unknown work: every thread
    (5, 1, 10**12, 0),
])
def test_pool_helpers_for(n_tasks, threads, work, helpers):
    assert probes().pool_helpers_for(n_tasks, threads, work) == helpers


@pytest.mark.parametrize("sk", [16, 256, 700, 4096])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_same_bits_whatever_helpers_join(sk, dtype):
    """Around the threshold the pool may use one thread or several, and a helper may join a
    region late or not at all: the bits stay those of one thread."""
    g = torch.Generator().manual_seed(sk)
    dt = getattr(torch, dtype)
    q, k, v = (torch.randn(2, s, 8, 64, generator=g).to(dt) for s in (3, sk, sk))
    outs = []
    for threads in (1, 2, 4, 1):
        fmha.set_num_threads(threads)
        try:
            outs.append([fmha.attention(q, k, v, causal=c) for c in (False, True)
                         for _ in range(3)])
        finally:
            fmha.set_num_threads(None)
    for got in outs[1:]:
        for a, b in zip(outs[0], got):
            assert torch.equal(a.view(torch.int16 if dtype == "bfloat16" else torch.int32),
                               b.view(torch.int16 if dtype == "bfloat16" else torch.int32))


def _qkv(requires_grad=False):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, s, 4, 16, generator=g).requires_grad_(requires_grad)
            for s in (2, 5, 5)]


def test_direct_call_equals_the_op():
    q, k, v = _qkv()
    with torch.no_grad():
        direct = fmha.attention(q, k, v, return_lse=True)
    via_op = torch.ops.fmha.fwd(q, k, v, None, None, None, None, None, 2, 5, None, 0.25, 0.0,
                                -1, -1, True, 0.0, False, 0)
    for a, b in zip(direct, via_op):
        assert torch.equal(a, b)


def test_grad_still_recorded():
    q, k, v = _qkv(requires_grad=True)
    out = fmha.attention(q, k, v)
    assert out.grad_fn is not None
    out.sum().backward()
    assert q.grad is not None and k.grad is not None and v.grad is not None
    with torch.no_grad():
        assert fmha.attention(q, k, v).grad_fn is None


def _op_log():
    """A TorchDispatchMode that records the ops it sees (as profilers, FLOP counters and
    tracers do)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Log(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    return Log()


def test_dispatch_mode_sees_the_op():
    """A TorchDispatchMode (profilers, FLOP counters, tracers) must see fmha::fwd even when
    no autograd is recorded."""
    q, k, v = _qkv()
    with torch.no_grad(), _op_log() as log:
        fmha.attention(q, k, v)
    assert any("fmha.fwd" in op for op in log.ops), log.ops


def test_fake_tensors_take_the_op():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode, torch.no_grad():
        q, k, v = (mode.from_tensor(x) for x in _qkv())
        out = fmha.attention(q, k, v)
    assert out.shape == (1, 2, 4, 16)


def test_compiled_call_is_unchanged():
    q, k, v = _qkv()
    compiled = torch.compile(lambda q, k, v: fmha.attention(q, k, v, causal=True),
                             fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        assert torch.equal(compiled(q, k, v), fmha.attention(q, k, v, causal=True))


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_spec_cache_never_admits_what_validation_refuses(lib):
    q, k, v = (x.detach() for x in _qkv())
    if lib == "numpy":
        q, k, v = (x.numpy() for x in (q, k, v))
    a = prepare(q, k, v, causal=True)
    assert prepare(q, k, v, causal=True) is a  # the repeated call is a lookup
    with pytest.raises(TypeError, match="causal"):
        prepare(q, k, v, causal=1)  # 1 == True, but not a bool
    with pytest.raises(TypeError, match="scale"):
        prepare(q, k, v, scale=True)
    with pytest.raises(ValueError, match="window"):
        prepare(q, k, v, window=(-2, -1))
    assert prepare(q, k, v, scale=0.5).scale == 0.5
    assert prepare(q, k, v).scale == 0.25
    with pytest.raises(ValueError, match="k"):
        prepare(q, k[:, :4], v)  # a different shape is validated afresh
    assert len(_SPEC_CACHE) <= 256


def test_spec_cache_follows_a_growing_cache():
    """A decode loop: one more key each step, the same Spec otherwise."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 1, 4, 16, generator=g)
    for sk in (5, 6, 7, 6):
        k, v = torch.randn(2, 1, sk, 4, 16, generator=g)
        spec = prepare(q, k, v)
        assert (spec.seqlen_k, spec.full) == (sk, (1, 4, 1, sk))
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
        torch.testing.assert_close(fmha.attention(q, k, v), ref)
    with pytest.raises(ValueError, match="v"):
        prepare(q, k, v[:, :5])  # k and v lengths differ: validated afresh


def _layouts(g, dtype):
    """q, k, v in the layouts a caller hands over: contiguous, transposed views of
    (b, h, s, d) tensors (unit last stride, not contiguous), and a strided last dimension
    (the general path's copy)."""
    def make(s, d=16):
        return torch.randn(2, s, 4, d, generator=g).to(dtype)
    yield "contiguous", make(3), make(7), make(7)
    yield "bhsd_views", *(torch.randn(2, 4, s, 16, generator=g).to(dtype).transpose(1, 2)
                          for s in (3, 7, 7))
    yield "strided_last", make(3, 32)[..., ::2], make(7), make(7)
    yield "head_dim_v", make(3), make(7), make(7, 8)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_plain_call_equals_the_op(dtype):
    """Every layout and both results (out; out and lse) give the op's bits, and the same
    values as a copy of the inputs made contiguous."""
    g = torch.Generator().manual_seed(3)
    dt = getattr(torch, dtype)
    for name, q, k, v in _layouts(g, dt):
        for causal in (False, True):
            with torch.no_grad():
                out, lse = fmha.attention(q, k, v, causal=causal, return_lse=True)
                only = fmha.attention(q, k, v, causal=causal)
            qc, kc, vc = (x.contiguous() for x in (q, k, v))
            via_op = torch.ops.fmha.fwd(qc, kc, vc, None, None, None, None, None, 3, 7, None,
                                        q.shape[-1] ** -0.5, 0.0, -1, 0 if causal else -1,
                                        True, 0.0, False, 0)
            assert out.shape == only.shape == via_op[0].shape, name
            assert torch.equal(out, via_op[0]) and torch.equal(only, via_op[0]), name
            assert torch.equal(lse, via_op[1]), name


def test_plain_numpy_call_equals_torch():
    g = torch.Generator().manual_seed(4)
    for name, q, k, v in _layouts(g, torch.float32):
        want, want_lse = fmha.attention(*(x.contiguous() for x in (q, k, v)), return_lse=True)
        arrays = [x.numpy() for x in (q, k, v)]
        out, lse = fmha.attention(*arrays, return_lse=True)
        assert np.array_equal(out, want.numpy()), name
        assert np.array_equal(lse, want_lse.numpy()), name
        assert np.array_equal(fmha.attention(*arrays), want.numpy()), name


@pytest.mark.parametrize("use_lse", [False, True])
def test_recorded_call_equals_the_op(use_lse):
    """A call that records a graph (the autograd.Function) and the op give the same outputs
    and the same gradients, dbias included, with lse used or not."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, s, 4, 16, generator=g, dtype=torch.float64).requires_grad_()
               for s in (5, 9, 9))
    bias = torch.randn(2, 4, 5, 9, generator=g, dtype=torch.float64, requires_grad=True)
    spec = prepare(q, k, v, causal=True, bias=bias)
    args = (q, k, v, bias, None, None, None, None, 5, 9, None, spec.scale, 0.0,
            spec.window_left, spec.window_right, True, 0.0, False, 0)
    grads = []
    for run in (lambda: fmha.attention(q, k, v, causal=True, bias=bias, return_lse=True),
                lambda: torch.ops.fmha.fwd(*args)):
        out, lse = run()
        assert out.grad_fn is not None
        (out.sum() + (lse.sum() if use_lse else 0)).backward()
        grads.append([out.detach(), lse.detach()] + [x.grad for x in (q, k, v, bias)])
        for x in (q, k, v, bias):
            x.grad = None
    assert type(fmha.attention(q, k, v).grad_fn).__name__ == "_AttentionBackward"
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("leaf", ["torch.randn(*s, requires_grad=True)",
                                  "torch.nn.Parameter(torch.randn(*s))"])
def test_eager_backward_does_not_import_dynamo(leaf):
    """A training step's first backward costs what the kernels cost: nothing on the eager path
    imports torch._dynamo (a fresh interpreter, so that no other test has imported it), with
    inputs that are plain tensors or a model's nn.Parameters (q, k, v and a learned bias)."""
    import subprocess
    import sys
    code = ("import sys, torch, fmha\n"
            f"leaf = lambda *s: {leaf}\n"
            "q, k, v = (leaf(1, 16, 4, 32) for _ in range(3))\n"
            "bias = leaf(4, 16, 16)\n"
            "assert 'torch._dynamo' not in sys.modules, 'imported before the call'\n"
            "fmha.attention(q, k, v, causal=True, bias=bias).sum().backward()\n"
            "assert all(x.grad is not None for x in (q, k, v, bias))\n"
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_dispatch_mode_sees_the_op_with_grad():
    q, k, v = _qkv(requires_grad=True)
    with _op_log() as log:
        fmha.attention(q, k, v).sum().backward()
    assert any("fmha.fwd" in op for op in log.ops), log.ops
    assert any("fmha.bwd" in op for op in log.ops), log.ops


@pytest.mark.parametrize("sq,sk,heads", [(100, 150, (4, 4)),   # the tiled forward
                                         (1, 5000, (8, 2)),    # decode rows, split into chunks
                                         (2, 40, (4, 1)),      # decode rows, one chunk
                                         (5, 0, (2, 2))])      # no key: out 0
def test_out_without_lse_on_every_path(sq, sk, heads):
    """A call that does not return lse leaves it to no one (the kernels skip it): the same
    out, bit for bit, on each forward path, torch and NumPy."""
    g = torch.Generator().manual_seed(5)
    hq, hkv = heads
    q = torch.randn(2, sq, hq, 32, generator=g)
    k, v = (torch.randn(2, sk, hkv, 32, generator=g) for _ in range(2))
    for causal in (False, True):
        with torch.no_grad():
            want, lse = fmha.attention(q, k, v, causal=causal, return_lse=True)
            assert torch.equal(fmha.attention(q, k, v, causal=causal), want)
        got = fmha.attention(q.numpy(), k.numpy(), v.numpy(), causal=causal)
        assert np.array_equal(got, want.numpy())
        assert (sk > 0) == bool(torch.isfinite(lse).all())
