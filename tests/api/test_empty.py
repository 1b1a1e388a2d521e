"""Empty inputs: batch 0, seqlen_q 0, seqlen_k 0, heads 0 (issue #15).

A call with an empty dimension has no (query row, key row) pair, so what it returns is
fixed by the reference's definition alone (docs/errors.md, "Empty inputs"): outputs and
gradients of the inputs' shapes, out = 0 and lse = -inf on every query row (a row that sees
no key), dq = dk = dv = 0, dbias = 0 (it may have elements even then: a bias broadcast over
the empty dimension). These are exact values, so they are compared exactly, against
fmha.reference where it takes the shape (it refuses heads_kv = 0) and against that closed
form always.

Every public entry point: fmha.attention / attention_backward (NumPy) and autograd (torch),
attention_varlen / attention_varlen_backward, the torch ops (opcheck, torch.compile
fullgraph), fmha.scaled_dot_product_attention and fmha.nn.MultiheadAttention (against
torch's own), and fmha._C directly. The public-API cases run on the CPU kernels' entry and
on the CUDA launchers under the emulator (conftest's ``backend`` fixture), which answer
empty calls before any kernel tile exists. What stays an error (head_dim 0, query heads
without kv heads) is in tests/api/test_errors.py.
"""

from __future__ import annotations

import numpy as np
import pytest

import fmha
from conftest import fmha_results, make_array, make_inputs, reference_results, to_f64
from fmha import reference
from fmha._validate import dtype_name

# (batch, seqlen_q, seqlen_k, heads_q, heads_kv) with an empty dimension each.
SHAPES = {
    "batch_0": (0, 5, 6, 4, 2),
    "seqlen_q_0": (2, 0, 6, 4, 2),
    "seqlen_k_0": (2, 5, 0, 4, 2),
    "seqlens_0": (2, 0, 0, 4, 2),
    "heads_q_0": (2, 5, 6, 0, 2),   # kv heads that no query head reads: dk = dv = 0
    "heads_0": (2, 5, 6, 0, 0),
}
HEAD_DIM, HEAD_DIM_V = 8, 6

# Feature sets: each changes which stages an empty call must skip; bias shapes that
# broadcast over the empty dimension give a dbias with elements, which must be zeros.
FEATURES = {
    "plain": {},
    "causal_window_softcap_alibi": dict(causal=True, window=(3, -1), softcap=2.0, alibi=True),
    "bias_over_keys": dict(bias=lambda b, sq, sk, hq: (1, 1, 1, sk)),
    "bias_over_rows_mask_dropout": dict(bias=lambda b, sq, sk, hq: (1, 1, sq, 1),
                                        mask=True, dropout_p=0.3),
    "bias_full": dict(bias=lambda b, sq, sk, hq: (b, hq, sq, sk)),
}

#: (lib, dtype) pairs: the CPU kernels take every dtype, the CUDA ones 16-bit only. Each
#: test below comes twice, once per table, so that no pair is generated for a backend that
#: cannot take it.
CPU_LIB_DTYPES = ["numpy-float64", "numpy-float32", "torch-float32", "torch-bfloat16"]
CUDA_LIB_DTYPES = ["numpy-float16", "torch-bfloat16", "torch-float16"]
on_cpu = pytest.mark.backends("cpu")
on_cuda = pytest.mark.backends("emu", "gpu")


def _lib_dtype(lib_dtype):
    lib, dtype = lib_dtype.split("-")
    if lib == "torch" or dtype == "bfloat16":
        pytest.importorskip("torch")
    return lib, dtype


def _lse_dtype(dtype):
    return "float64" if dtype == "float64" else "float32"


def _no_pair_results(q, k, v, bias_shape):
    """The closed form of a call without any (query row, key row) pair (float64)."""
    b, sq, hq, _ = q.shape
    res = dict(out=np.zeros((b, sq, hq, v.shape[-1])), lse=np.full((b, hq, sq), -np.inf),
               dq=np.zeros(q.shape), dk=np.zeros(k.shape), dv=np.zeros(v.shape))
    if bias_shape is not None:
        res["dbias"] = np.zeros(bias_shape)
    return res


def _assert_exact(res, expected, dtype, like):
    """Every result of fmha equals the expected float64 value exactly, with the contract's
    shape and dtype (out and gradients in the input dtype, lse float32/float64, dbias in
    the bias's dtype and shape)."""
    assert set(res) == set(expected), (sorted(res), sorted(expected))
    for key, want in expected.items():
        got = res[key]
        assert got is not None, f"{key}: no result"
        assert tuple(got.shape) == want.shape, f"{key}: shape {tuple(got.shape)} != {want.shape}"
        want_dtype = _lse_dtype(dtype) if key == "lse" else dtype_name(like[key])
        assert dtype_name(got) == want_dtype, f"{key}: dtype {dtype_name(got)} != {want_dtype}"
        assert np.array_equal(to_f64(got), want), f"{key}: {np.unique(to_f64(got))[:8]}"


def _build(rng, lib, dtype, shape, feature):
    b, sq, sk, hq, hkv = shape
    q, k, v, dout = make_inputs(rng, b, sq, sk, hq, hkv, HEAD_DIM, HEAD_DIM_V, dtype=dtype,
                                lib=lib)
    kw = {key: val for key, val in feature.items() if key not in ("bias", "mask", "alibi")}
    bias = None
    if "bias" in feature:
        bias = make_array(rng, feature["bias"](b, sq, sk, hq), "float32", lib)
    if feature.get("mask"):
        m = rng.random((b, 1, sq, sk)) < 0.7
        if lib == "torch":
            import torch
            m = torch.from_numpy(m)
        kw["mask"] = m
    if feature.get("alibi"):
        kw["alibi_slopes"] = make_array(rng, (hq,), "float32", lib)
    return q, k, v, dout, bias, kw


# ---------------------------------------------------------------- fmha.attention (+ backward)

def check_attention_empty(rng, shape, feature, lib_dtype):
    """fmha.attention and its backward (attention_backward for NumPy, autograd for torch)
    on an empty dimension: empty or zero outputs, lse -inf, zero gradients."""
    lib, dtype = _lib_dtype(lib_dtype)
    q, k, v, dout, bias, kw = _build(rng, lib, dtype, SHAPES[shape], FEATURES[feature])
    bias_grad = bias is not None
    res = fmha_results(q, k, v, dout, bias=bias, bias_grad=bias_grad, seed=7, **kw)
    expected = _no_pair_results(q, k, v, None if bias is None else tuple(bias.shape))
    if k.shape[2] > 0:  # the reference refuses heads_kv = 0
        ref = reference_results(q, k, v, dout, bias=bias, bias_grad=bias_grad, seed=7,
                                **kw)
        for key in expected:
            assert np.array_equal(ref[key], expected[key]), f"reference {key}"
    _assert_exact(res, expected, dtype, dict(out=q, dq=q, dk=k, dv=v, dbias=bias))


@on_cpu
@pytest.mark.parametrize("lib_dtype", CPU_LIB_DTYPES)
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_attention_empty_cpu(backend, rng, shape, feature, lib_dtype):
    check_attention_empty(rng, shape, feature, lib_dtype)


@on_cuda
@pytest.mark.parametrize("lib_dtype", CUDA_LIB_DTYPES)
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_attention_empty_cuda(backend, rng, shape, feature, lib_dtype):
    check_attention_empty(rng, shape, feature, lib_dtype)


# ---------------------------------------------------------------- varlen

# (cu_seqlens_q, cu_seqlens_k, heads_q, heads_kv): packed batches without any pair.
VARLEN = {
    "no_query_rows": ([0, 0, 0], [0, 3, 7], 4, 2),
    "no_key_rows": ([0, 2, 5], [0, 0, 0], 4, 2),
    "no_rows": ([0, 0, 0], [0, 0, 0], 4, 2),
    "batch_0": ([0], [0], 4, 2),
    "heads_q_0": ([0, 2, 5], [0, 3, 7], 0, 2),
}
VARLEN_FEATURES = {
    "plain": {},
    "causal_softcap_alibi_dropout": dict(causal=True, softcap=2.0, alibi=True, dropout_p=0.3),
}


def _varlen_results(lib, q, k, v, dout, cu_q, cu_k, kw, max_seqlens=()):
    if lib == "numpy":
        out, lse = fmha.attention_varlen(q, k, v, cu_q, cu_k, *max_seqlens, return_lse=True,
                                         seed=3, **kw)
        dq, dk, dv = fmha.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k,
                                                    *max_seqlens, seed=3, **kw)
        return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    out, lse = fmha.attention_varlen(*leaves, cu_q, cu_k, *max_seqlens, return_lse=True, **kw)
    out.backward(dout)
    return dict(out=out.detach(), lse=lse.detach(), dq=leaves[0].grad, dk=leaves[1].grad,
                dv=leaves[2].grad)


def check_attention_varlen_empty(rng, case, feature, lib_dtype):
    """attention_varlen and its backward (attention_varlen_backward / autograd) on packed
    batches with no query row, no key row, no sequence or no query head."""
    lib, dtype = _lib_dtype(lib_dtype)
    cu_q, cu_k, hq, hkv = VARLEN[case]
    total_q, total_k, batch = cu_q[-1], cu_k[-1], len(cu_q) - 1
    q = make_array(rng, (total_q, hq, HEAD_DIM), dtype, lib)
    k = make_array(rng, (total_k, hkv, HEAD_DIM), dtype, lib)
    v = make_array(rng, (total_k, hkv, HEAD_DIM_V), dtype, lib)
    dout = make_array(rng, (total_q, hq, HEAD_DIM_V), dtype, lib)
    kw = {key: val for key, val in VARLEN_FEATURES[feature].items() if key != "alibi"}
    alibi = None
    if VARLEN_FEATURES[feature].get("alibi"):
        alibi = rng.uniform(0.1, 0.5, (batch, hq))
        kw["alibi_slopes"] = alibi
    cus = [np.array(c, np.int32) for c in (cu_q, cu_k)]
    if lib == "torch":
        import torch
        cus = [torch.from_numpy(c) for c in cus]
        if alibi is not None:
            kw["alibi_slopes"] = torch.from_numpy(alibi)
    res = _varlen_results(lib, q, k, v, dout, *cus, kw)

    expected = dict(out=np.zeros((total_q, hq, HEAD_DIM_V)),
                    lse=np.full((hq, total_q), -np.inf), dq=np.zeros(q.shape),
                    dk=np.zeros(k.shape), dv=np.zeros(v.shape))
    rkw = dict(kw, alibi_slopes=alibi, seed=3) if alibi is not None else dict(kw, seed=3)
    args = [to_f64(x) for x in (q, k, v)]
    out, lse = reference.attention_varlen_forward(*args, cu_q, cu_k, **rkw)
    dq, dk, dv = reference.attention_varlen_backward(to_f64(dout), *args, cu_q, cu_k, **rkw)
    for key, val in dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv).items():
        assert np.array_equal(val, expected[key]), f"reference {key}"
    _assert_exact(res, expected, dtype, dict(out=q, dq=q, dk=k, dv=v))


@on_cpu
@pytest.mark.parametrize("lib_dtype", CPU_LIB_DTYPES)
@pytest.mark.parametrize("feature", list(VARLEN_FEATURES))
@pytest.mark.parametrize("case", list(VARLEN))
def test_attention_varlen_empty_cpu(backend, rng, case, feature, lib_dtype):
    check_attention_varlen_empty(rng, case, feature, lib_dtype)


@on_cuda
@pytest.mark.parametrize("lib_dtype", CUDA_LIB_DTYPES)
@pytest.mark.parametrize("feature", list(VARLEN_FEATURES))
@pytest.mark.parametrize("case", list(VARLEN))
def test_attention_varlen_empty_cuda(backend, rng, case, feature, lib_dtype):
    check_attention_varlen_empty(rng, case, feature, lib_dtype)


@pytest.mark.backends("cpu", "emu", "gpu")
@pytest.mark.parametrize("max_seqlens", [(0, 0), (4, 9)], ids=["max_0", "max_given"])
def test_attention_varlen_no_rows_explicit_max_seqlen(backend, rng, max_seqlens):
    """Packed batches without rows accept max_seqlen 0 (their longest sequence) and any
    larger maximum, in both the NumPy and the torch path."""
    dtype = "float32" if backend == "cpu" else "float16"
    cu = np.array([0, 0, 0], np.int32)
    q, k, v, dout = (make_array(rng, (0, 2, HEAD_DIM), dtype, "numpy") for _ in range(4))
    res = _varlen_results("numpy", q, k, v, dout, cu, cu, {}, max_seqlens)
    for key in ("out", "dq", "dk", "dv"):
        assert res[key].shape == (0, 2, HEAD_DIM)
    assert res["lse"].shape == (2, 0)


@on_cuda
@pytest.mark.parametrize("num_splits", [0, 1, 3])
def test_no_key_rows_split_kv(backend, rng, num_splits):
    """The CUDA forward with its keys split over several CTAs (partials merged by their
    lse) on rows without a key, dense and varlen: out 0, lse -inf."""
    q = make_array(rng, (1, 70, 2, 32), "float16")
    k = make_array(rng, (1, 0, 2, 32), "float16")
    out, lse = fmha.attention(q, k, k, return_lse=True, num_splits=num_splits)
    assert np.all(out == 0) and np.all(lse == -np.inf)
    cu_q, cu_k = np.array([0, 40, 70], np.int32), np.array([0, 0, 0], np.int32)
    out, lse = fmha.attention_varlen(q[0], k[0], k[0], cu_q, cu_k, return_lse=True,
                                     num_splits=num_splits)
    assert out.shape == (70, 2, 32) and lse.shape == (2, 70)
    assert np.all(out == 0) and np.all(lse == -np.inf)


# ---------------------------------------------------------------- the torch ops

def _torch():
    return pytest.importorskip("torch")


def _op_args(shape, bias_shape=None, varlen=None):
    """Arguments of torch.ops.fmha.fwd for an empty call (see fmha/_torch.py)."""
    torch = _torch()
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, dtype=torch.float32, generator=g).requires_grad_(True)
    if varlen is not None:
        cu_q, cu_k, hq, hkv = varlen
        q, k, v = r(cu_q[-1], hq, 8), r(cu_k[-1], hkv, 8), r(cu_k[-1], hkv, 8)
        cu_q, cu_k = (torch.tensor(c, dtype=torch.int32) for c in (cu_q, cu_k))
        max_q = int(np.diff(cu_q.numpy()).max(initial=0))
        max_k = int(np.diff(cu_k.numpy()).max(initial=0))
    else:
        b, sq, sk, hq, hkv = shape
        q, k, v = r(b, sq, hq, 8), r(b, sk, hkv, 8), r(b, sk, hkv, 8)
        cu_q = cu_k = None
        max_q, max_k = sq, sk
    bias = None if bias_shape is None else r(*bias_shape)
    return (q, k, v, bias, None, None, cu_q, cu_k, max_q, max_k, None, 8 ** -0.5, 0.0, -1, 0,
            True, 0.0)


OP_CASES = {
    "batch_0": lambda: _op_args(SHAPES["batch_0"]),
    "seqlen_q_0_bias": lambda: _op_args(SHAPES["seqlen_q_0"], bias_shape=(1, 4, 1, 6)),
    "seqlen_k_0_bias": lambda: _op_args(SHAPES["seqlen_k_0"], bias_shape=(2, 1, 5, 1)),
    "heads_0": lambda: _op_args(SHAPES["heads_0"]),
    "varlen_no_key_rows": lambda: _op_args(None, varlen=VARLEN["no_key_rows"]),
    "varlen_batch_0": lambda: _op_args(None, varlen=VARLEN["batch_0"]),
}


@pytest.mark.parametrize("name", list(OP_CASES))
def test_opcheck_fwd_bwd_empty(name):
    """torch.library.opcheck (schema, autograd registration, fake tensors, AOT dispatch) of
    both ops on empty calls: the fake implementations agree with the real ones."""
    torch = _torch()
    args = OP_CASES[name]()
    result = torch.library.opcheck(torch.ops.fmha.fwd.default, args)
    assert all(v == "SUCCESS" for v in result.values()), result
    detached = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    out, lse = torch.ops.fmha.fwd(*detached)
    bias = detached[3]
    bias_grad = bias is not None
    bwd_args = (torch.randn(out.shape), *detached[:3], out, lse, *detached[3:], bias_grad)
    result = torch.library.opcheck(torch.ops.fmha.bwd.default, bwd_args)
    assert all(v == "SUCCESS" for v in result.values()), result
    dq, dk, dv, dbias = torch.ops.fmha.bwd(*bwd_args)
    for g in (dq, dk, dv) + ((dbias,) if bias_grad else ()):
        assert torch.count_nonzero(g) == 0
    assert torch.all(out == 0) and torch.all(lse == -torch.inf)
    if bias_grad:
        assert dbias.shape == bias.shape and dbias.numel() > 0


@pytest.mark.parametrize("shape", ["batch_0", "seqlen_q_0", "seqlen_k_0"])
def test_compile_fullgraph_empty(shape):
    """torch.compile(fullgraph=True) traces empty calls without a graph break and returns
    what eager returns (forward and gradients)."""
    torch = _torch()
    b, sq, sk, hq, hkv = SHAPES[shape]
    g = torch.Generator().manual_seed(1)
    q = torch.randn(b, sq, hq, 8, generator=g, requires_grad=True)
    k = torch.randn(b, sk, hkv, 8, generator=g, requires_grad=True)
    v = torch.randn(b, sk, hkv, 8, generator=g, requires_grad=True)
    bias = torch.randn(1, hq, 1, 1, generator=g, requires_grad=True)

    def f(q, k, v, bias):
        return fmha.attention(q, k, v, causal=True, bias=bias, return_lse=True)

    explanation = torch._dynamo.explain(f)(q, k, v, bias)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (compiled, f):
        for x in (q, k, v, bias):
            x.grad = None
        out, lse = fn(q, k, v, bias)
        out.backward(torch.ones_like(out))
        results.append([out.detach(), lse.detach()] + [x.grad for x in (q, k, v, bias)])
    for c, e in zip(*results):
        torch.testing.assert_close(c, e, rtol=0, atol=0)
    out, lse, dq, dk, dv, dbias = results[0]
    assert torch.all(out == 0) and torch.all(lse == -torch.inf)
    assert all(torch.count_nonzero(x) == 0 for x in (dq, dk, dv, dbias))


def test_compile_fullgraph_varlen_no_key_rows():
    """The varlen op under torch.compile with every key sequence empty (max_seqlen_k 0)."""
    torch = _torch()
    cu_q = torch.tensor([0, 2, 5], dtype=torch.int32)
    cu_k = torch.tensor([0, 0, 0], dtype=torch.int32)
    q = torch.randn(5, 4, 8, requires_grad=True)
    k = torch.randn(0, 2, 8, requires_grad=True)
    v = torch.randn(0, 2, 8, requires_grad=True)

    def f(q, k, v):
        return fmha.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=3, max_seqlen_k=0,
                                     return_lse=True)

    torch._dynamo.reset()
    out, lse = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    out.sum().backward()
    assert out.shape == (5, 4, 8) and torch.all(out == 0)
    assert lse.shape == (4, 5) and torch.all(lse == -torch.inf)
    assert torch.count_nonzero(q.grad) == 0 and k.grad.shape == (0, 2, 8)


# ---------------------------------------------------------------- SDPA and nn.MultiheadAttention

# (query shape, key/value shape) in torch's (..., heads, seqlen, head_dim) layout.
SDPA_SHAPES = {
    "batch_0": ((0, 4, 5, 8), (0, 4, 6, 8)),
    "seqlen_q_0": ((2, 4, 0, 8), (2, 4, 6, 8)),
    "seqlen_k_0": ((2, 4, 5, 8), (2, 4, 0, 8)),
    "heads_0": ((2, 0, 5, 8), (2, 0, 6, 8)),
    "3d_seqlen_q_0": ((4, 0, 8), (4, 6, 8)),
    "2d_seqlen_k_0": ((5, 8), (0, 8)),
    "5d_lead_0": ((2, 0, 4, 5, 8), (2, 0, 4, 6, 8)),
    "5d_seqlens_0": ((2, 3, 4, 0, 8), (2, 3, 4, 0, 8)),
}


@pytest.mark.parametrize("with_mask", [False, True], ids=["no_mask", "bool_mask"])
@pytest.mark.parametrize("shape", list(SDPA_SHAPES))
def test_sdpa_empty_matches_torch(shape, with_mask):
    """fmha.scaled_dot_product_attention equals torch's SDPA, output and gradients, on
    empty batches, sequences and heads (including several batch dimensions)."""
    torch = _torch()
    F = torch.nn.functional
    qs, ks = SDPA_SHAPES[shape]
    g = torch.Generator().manual_seed(2)
    base = [torch.randn(*s, dtype=torch.float64, generator=g) for s in (qs, ks, ks)]
    mask = None
    if with_mask:
        mask = torch.rand(*qs[:-1], ks[-2], generator=g) < 0.7
    results = []
    for fn in (fmha.scaled_dot_product_attention, F.scaled_dot_product_attention):
        leaves = [x.clone().requires_grad_(True) for x in base]
        out = fn(*leaves, attn_mask=mask)
        out.backward(torch.ones_like(out))
        results.append([out.detach()] + [x.grad for x in leaves])
    for name, got, want in zip(("out", "dq", "dk", "dv"), *results):
        assert got.shape == want.shape, name
        assert torch.count_nonzero(got) == 0, name
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("sizes", [(0, 5, 6), (2, 0, 6), (2, 5, 0)],
                         ids=["batch_0", "tgt_len_0", "src_len_0"])
def test_multihead_attention_empty_matches_torch(sizes, batch_first):
    """fmha.nn.MultiheadAttention equals torch.nn.MultiheadAttention (same weights) on an
    empty batch, target or source, with a key padding mask and the weights returned:
    outputs, weights and every gradient."""
    torch = _torch()
    import fmha.nn
    n, tgt, src = sizes
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(16, 4, batch_first=batch_first, dtype=torch.float64)
    torch.manual_seed(0)
    mod = fmha.nn.MultiheadAttention(16, 4, batch_first=batch_first, dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    shape = (lambda L: (n, L, 16)) if batch_first else (lambda L: (L, n, 16))
    q0 = torch.randn(*shape(tgt), dtype=torch.float64, generator=g)
    kv0 = torch.randn(*shape(src), dtype=torch.float64, generator=g)
    kpm = torch.zeros(n, src, dtype=torch.bool)
    results = []
    for m in (mod, ref):
        m.zero_grad()
        q, kv = q0.clone().requires_grad_(True), kv0.clone().requires_grad_(True)
        out, w = m(q, kv, kv, key_padding_mask=kpm)
        (out.sum() + w.sum()).backward()
        results.append([out.detach(), w.detach(), q.grad, kv.grad]
                       + [p.grad for _, p in m.named_parameters()])
    for i, (got, want) in enumerate(zip(*results)):
        assert got.shape == want.shape, i
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=str(i))


# ---------------------------------------------------------------- fmha._C directly

def _empty_dense(shape, dtype=np.float32):
    """A zero-size array with C-contiguous strides (NumPy gives size-0 arrays 0 strides)."""
    strides, acc = [], np.dtype(dtype).itemsize
    for n in reversed(shape):
        strides.insert(0, acc)
        acc *= max(n, 1)
    return np.lib.stride_tricks.as_strided(np.zeros(1, dtype), shape=shape, strides=strides)


_S = dict(scale=0.35, softcap=0.0, window_left=-1, window_right=-1, bottom_right=True,
          dropout_p=0.0, seed=0, offset=0, num_threads=2)


@pytest.mark.backends("cpu", "emu")
@pytest.mark.parametrize("make_empty", [_empty_dense, np.zeros], ids=["dense_strides",
                                                                     "zero_strides"])
def test_core_empty_calls(backend, make_empty):
    """The kernel module itself (fmha._C's CPU entry, the emulated CUDA launchers) takes
    empty calls, whatever strides the empty arrays have: a batch of 0 writes nothing, no key
    row writes out 0 / lse -inf, a backward without query rows zeros dk, dv (into strided
    views) and dbias."""
    from fmha._core import _kernels
    dt = np.float32 if backend == "cpu" else np.float16
    r = np.random.default_rng(0)
    q = r.standard_normal((2, 5, 4, 8)).astype(dt)
    kv = r.standard_normal((2, 6, 2, 8)).astype(dt)
    # batch 0
    _kernels.forward(make_empty((0, 5, 4, 8), dtype=dt), make_empty((0, 6, 2, 8), dtype=dt),
                     make_empty((0, 6, 2, 8), dtype=dt), make_empty((0, 5, 4, 8), dtype=dt),
                     make_empty((0, 4, 5), dtype=np.float32), **_S)
    # no key row: out 0, lse -inf, through strided outputs
    out_buf, lse_buf = np.full((2, 5, 4, 16), 7, dt), np.full((2, 4, 10), 7, np.float32)
    out, lse = out_buf[..., :8], lse_buf[..., :5]
    _kernels.forward(q, make_empty((2, 0, 2, 8), dtype=dt), make_empty((2, 0, 2, 8), dtype=dt),
                     out, lse, **_S)
    assert np.all(out == 0) and np.all(lse == -np.inf)
    assert np.all(out_buf[..., 8:] == 7) and np.all(lse_buf[..., 5:] == 7), "wrote outside"
    # no query row: dk = dv = 0 (written into views with a row stride), dbias = 0
    dk_buf, dv_buf = np.full((2, 6, 3, 8), 7, dt), np.full((2, 6, 3, 8), 7, dt)
    dk, dv = dk_buf[:, :, :2], dv_buf[:, :, 1:]
    dbias = np.full((1, 1, 1, 6), 7, np.float32)
    e = make_empty((2, 0, 4, 8), dtype=dt)
    _kernels.backward(e, e, kv, kv, e, make_empty((2, 4, 0), dtype=np.float32), e, dk, dv,
                      dbias=dbias, bias=np.broadcast_to(np.ones((1, 1, 1, 6), np.float32),
                                                        (2, 4, 0, 6)), **_S)
    assert np.all(dk == 0) and np.all(dv == 0) and np.all(dbias == 0)
    assert np.all(dk_buf[:, :, 2] == 7) and np.all(dv_buf[:, :, 0] == 7), "wrote outside"
    # no key row: dq = 0 (into a view)
    dq_buf = np.full((2, 5, 4, 16), 7, dt)
    dq = dq_buf[..., :8]
    ek = make_empty((2, 0, 2, 8), dtype=dt)
    lse = np.full((2, 4, 5), -np.inf, np.float32)
    _kernels.backward(q, q, ek, ek, q, lse, dq, ek, ek, **_S)
    assert np.all(dq == 0) and np.all(dq_buf[..., 8:] == 7)
    # varlen: every sequence of q empty, max_seqlen_q larger than 0
    cu_q, cu_k = np.array([0, 0, 0], np.int32), np.array([0, 3, 6], np.int32)
    kp = r.standard_normal((6, 2, 8)).astype(dt)
    dkp, dvp = np.full((6, 2, 8), 7, dt), np.full((6, 2, 8), 7, dt)
    eq = make_empty((0, 4, 8), dtype=dt)
    _kernels.backward(eq, eq, kp, kp, eq, make_empty((4, 0), dtype=np.float32), eq, dkp, dvp,
                      cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=4, max_seqlen_k=3,
                      **_S)
    assert np.all(dkp == 0) and np.all(dvp == 0)
