"""num_splits, the split-KV setting of the CUDA forward, through the public API.

fmha.attention and fmha.attention_varlen take ``num_splits`` (0 = by occupancy, 1 = no
split, n = n splits) for NumPy/CuPy arrays and torch tensors (through the fmha::fwd op) and
hand it to the kernel module's forward. The CPU kernels ignore it (same bits for any value);
the CUDA forward, run here by the emulator (or on a GPU), must give the reference's answer
for every split count. Bad values: tests/api/test_errors.py.
"""

import numpy as np
import pytest

import fmha
from cases import naive_varlen, varlen_inputs
from conftest import assert_close, make_array, naive_results, to_f64
from fmha import _C, reference
from fmha._core import _kernel_module

torch = pytest.importorskip("torch")


class _Spy:
    """fmha._C with its forward's keyword arguments recorded."""

    def __init__(self):
        self.calls = []

    def forward(self, *args, **kw):
        self.calls.append(kw)
        return _C.forward(*args, **kw)

    def backward(self, *args, **kw):
        return _C.backward(*args, **kw)


def _inputs(lib, dtype="float32", sq=3, sk=200, hq=2, hkv=1, d=32, seed=0):
    rng = np.random.default_rng(seed)
    return [make_array(rng, s, dtype, lib) for s in ((1, sq, hq, d), (1, sk, hkv, d),
                                                     (1, sk, hkv, d), (1, sq, hq, d))]


@pytest.mark.parametrize("lib", ["numpy", "torch"])
@pytest.mark.parametrize("n", [0, 1, 3])
def test_reaches_the_kernels(lib, n):
    q, k, v, _ = _inputs(lib)
    cu = np.array([0, 3], np.int32), np.array([0, 200], np.int32)
    if lib == "torch":
        cu = tuple(torch.from_numpy(c) for c in cu)
    spy = _Spy()
    with _kernel_module(spy):
        fmha.attention(q, k, v, num_splits=n)
        fmha.attention_varlen(q[0], k[0], v[0], *cu, num_splits=n)
        fmha.attention(q, k, v)
    # A setting left out is the core's default 0 (the Python layer passes only non-zero ones).
    assert [c.get("num_splits", 0) for c in spy.calls] == [n, n, 0]


def test_torch_compile_passes_it_through():
    q, k, v, _ = _inputs("torch")
    spy = _Spy()
    compiled = torch.compile(lambda q, k, v: fmha.attention(q, k, v, num_splits=2),
                             fullgraph=True, backend="aot_eager")
    with _kernel_module(spy):
        out = compiled(q, k, v)
    assert spy.calls and all(c["num_splits"] == 2 for c in spy.calls)
    np.testing.assert_array_equal(out.numpy(), fmha.attention(q, k, v).numpy())


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_cpu_ignores_it(lib):
    """Validated, then ignored by the CPU kernels: the same bits, forward and backward."""
    q, k, v, do = _inputs(lib)
    if lib == "numpy":
        results = []
        for n in (0, 1, 2, 7):
            out, lse = fmha.attention(q, k, v, causal=True, return_lse=True, num_splits=n)
            grads = fmha.attention_backward(do, q, k, v, out, lse, causal=True)
            results.append([out, lse, *grads])
    else:
        results = []
        for n in (0, 1, 2, 7):
            leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
            out = fmha.attention(*leaves, causal=True, num_splits=n)
            out.backward(do)
            results.append([x.detach().numpy() for x in (out, *(t.grad for t in leaves))])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------------- the CUDA forward

@pytest.mark.backends("emu", "gpu")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lib,dtype", [("numpy", "float16"), ("torch", "bfloat16")])
def test_cuda_forward_splits_match_reference(backend, lib, dtype, causal):
    """num_splits = 1, 2, 3 and 0 (automatic) through fmha.attention: each matches the
    reference with the dtype's tolerance (out and lse). 200 keys are 4 key
    blocks of 64, so 2 and 3 splits both leave every split at least one block."""
    q, k, v, do = _inputs(lib, dtype)
    ref_out, ref_lse = reference.attention_forward(*(to_f64(x) for x in (q, k, v)),
                                                   causal=causal)
    tq = (lambda x: x) if lib == "torch" else torch.from_numpy
    naive = naive_results(tq(q), tq(k), tq(v), tq(do), causal=causal)
    outs = {}
    for n in (1, 2, 3, 0):
        if backend == "emu":
            from fmha import _cuda_emu
            _cuda_emu.reset_stats()
        out, lse = fmha.attention(q, k, v, causal=causal, num_splits=n, return_lse=True)
        if backend == "emu":
            # one launch without a split; the forward and the merge of the partials with one
            stats = _cuda_emu.stats()
            assert stats["launches"] == (1 if n == 1 else 2), (n, stats)
            outs.setdefault("blocks", []).append(stats["blocks"])
        assert_close(f"out[num_splits={n}]", out, ref_out, dtype, naive=naive["out"])
        assert_close(f"lse[num_splits={n}]", lse, ref_lse, dtype, naive=naive["lse"],
                     result_dtype="float32")
    if backend == "emu":
        assert outs["blocks"][0] < outs["blocks"][1] < outs["blocks"][2], outs["blocks"]


@pytest.mark.backends("emu", "gpu")
def test_cuda_varlen_splits_match_reference(backend):
    """attention_varlen with num_splits: ragged keys (one sequence with none)."""
    rng = np.random.default_rng(7)
    lens_q, lens_k = [2, 5, 3], [150, 0, 70]
    q, k, v, do, cu_q, cu_k = varlen_inputs(rng, "numpy", "float16", lens_q, lens_k, 2, 1, 32,
                                            32)
    ref_out, _ = reference.attention_varlen_forward(*(to_f64(x) for x in (q, k, v)), cu_q, cu_k)
    naive = naive_varlen(*(torch.from_numpy(x) for x in (q, k, v, do)), cu_q, cu_k)
    for n in (1, 2, 3, 0):
        out = fmha.attention_varlen(q, k, v, cu_q, cu_k, num_splits=n)
        assert_close(f"out[num_splits={n}]", out, ref_out, "float16",
                     naive=naive["out"].detach())
