"""The torch integration: autograd (gradcheck), the registered ops (opcheck), torch.compile,
dropout reproducibility under torch.manual_seed, and the documented out/lse dtypes/shapes.

Everything runs on the CPU in float64 on tiny shapes so that gradcheck stays cheap.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fmha  # noqa: E402
import fmha._torch  # noqa: E402,F401  (registers torch.ops.fmha.* even if fmha came first)
from fmha import reference  # noqa: E402

F64 = torch.float64


def rand(*shape, dtype=F64, grad=True, seed=None):
    g = None if seed is None else torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, dtype=dtype, generator=g)
    return x.requires_grad_(grad)


def qkv(b=2, sq=5, sk=7, hq=4, hkv=2, d=4, dv=None, dtype=F64, grad=True, seed=0):
    return (rand(b, sq, hq, d, dtype=dtype, grad=grad, seed=seed),
            rand(b, sk, hkv, d, dtype=dtype, grad=grad, seed=seed + 1),
            rand(b, sk, hkv, d if dv is None else dv, dtype=dtype, grad=grad, seed=seed + 2))


def gradcheck(fn, inputs):
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-6, rtol=1e-4)


# ---------------------------------------------------------------- gradcheck

def test_gradcheck_plain():
    q, k, v = qkv(b=2, sq=5, sk=7, hq=2, hkv=2, d=4, dv=6)
    gradcheck(lambda q, k, v: fmha.attention(q, k, v), (q, k, v))


def test_gradcheck_plain_custom_scale_seqlen_1():
    q, k, v = qkv(b=1, sq=1, sk=3, hq=2, hkv=2, d=8)
    gradcheck(lambda q, k, v: fmha.attention(q, k, v, scale=0.9), (q, k, v))


@pytest.mark.parametrize("alignment", ["bottom_right", "top_left"])
@pytest.mark.parametrize("sq,sk", [(4, 7), (7, 4), (5, 5)])
def test_gradcheck_causal(alignment, sq, sk):
    # sq > sk with bottom_right leaves rows that see no key: output and gradient 0.
    q, k, v = qkv(b=1, sq=sq, sk=sk, hq=2, hkv=2, d=4)
    gradcheck(lambda q, k, v: fmha.attention(q, k, v, causal=True, alignment=alignment),
              (q, k, v))


@pytest.mark.parametrize("hq,hkv", [(4, 2), (4, 1), (3, 1)])
def test_gradcheck_gqa(hq, hkv):
    q, k, v = qkv(b=2, sq=4, sk=6, hq=hq, hkv=hkv, d=4)
    gradcheck(lambda q, k, v: fmha.attention(q, k, v, causal=True), (q, k, v))


@pytest.mark.parametrize("bias_shape", [(2, 4, 5, 7), (4, 5, 7), (1, 4, 1, 7), (2, 1, 5, 1),
                                        (5, 7), (7,)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gradcheck_bias(bias_shape):
    q, k, v = qkv(b=2, sq=5, sk=7, hq=4, hkv=2, d=4)
    bias = rand(*bias_shape, seed=5)
    gradcheck(lambda q, k, v, bias: fmha.attention(q, k, v, bias=bias), (q, k, v, bias))


def test_bias_grad_matches_reference_and_shape():
    q, k, v = qkv(b=2, sq=5, sk=7, hq=4, hkv=2, d=4)
    bias = rand(1, 4, 1, 7, seed=5)
    out = fmha.attention(q, k, v, bias=bias, causal=True)
    dout = rand(*out.shape, grad=False, seed=9)
    out.backward(dout)
    assert bias.grad.shape == bias.shape and bias.grad.dtype == bias.dtype
    _, _, _, dbias = reference.attention_backward(
        dout.numpy(), q.detach().numpy(), k.detach().numpy(), v.detach().numpy(),
        bias=bias.detach().numpy(), causal=True)
    np.testing.assert_allclose(bias.grad.numpy(), dbias, rtol=1e-9, atol=1e-11)


def test_bias_without_grad_gets_none():
    q, k, v = qkv(b=1, sq=3, sk=4, hq=2, hkv=2, d=4)
    bias = rand(2, 3, 4, grad=False, seed=5)
    fmha.attention(q, k, v, bias=bias).sum().backward()
    assert bias.grad is None
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_gradcheck_bias_only():
    """Only the bias requires grad (q, k, v are constants)."""
    q, k, v = qkv(b=1, sq=4, sk=5, hq=2, hkv=1, d=4, grad=False)
    bias = rand(2, 4, 5, seed=5)
    gradcheck(lambda bias: fmha.attention(q, k, v, bias=bias, softcap=1.5), (bias,))


@pytest.mark.parametrize("softcap", [0.5, 3.0])
def test_gradcheck_softcap(softcap):
    q, k, v = qkv(b=1, sq=5, sk=6, hq=2, hkv=2, d=4)
    # a large scale so the tanh is far from linear
    gradcheck(lambda q, k, v: fmha.attention(q, k, v, softcap=softcap, scale=2.0), (q, k, v))


@pytest.mark.parametrize("slopes_shape", [(4,), (2, 4)])
def test_gradcheck_alibi(slopes_shape):
    q, k, v = qkv(b=2, sq=5, sk=7, hq=4, hkv=2, d=4)
    slopes = torch.rand(*slopes_shape, dtype=F64, generator=torch.Generator().manual_seed(3))
    gradcheck(lambda q, k, v: fmha.attention(q, k, v, alibi_slopes=slopes, causal=True),
              (q, k, v))


@pytest.mark.parametrize("window,alignment", [((2, 1), "bottom_right"), ((2, 1), "top_left"),
                                              ((1, -1), "bottom_right"), ((0, 0), "top_left"),
                                              ((-1, 2), "bottom_right")])
def test_gradcheck_window(window, alignment):
    q, k, v = qkv(b=1, sq=6, sk=8, hq=2, hkv=2, d=4)
    gradcheck(lambda q, k, v: fmha.attention(q, k, v, window=window, alignment=alignment),
              (q, k, v))


def test_gradcheck_mask_with_empty_rows():
    q, k, v = qkv(b=2, sq=4, sk=5, hq=2, hkv=1, d=4)
    mask = torch.rand(2, 1, 4, 5, generator=torch.Generator().manual_seed(1)) < 0.6
    mask[0, :, 2] = False  # a row that sees nothing: output 0, gradient 0
    mask[1, :, :, 0] = True
    gradcheck(lambda q, k, v: fmha.attention(q, k, v, mask=mask), (q, k, v))
    out = fmha.attention(q, k, v, mask=mask)
    assert torch.equal(out[0, 2, :2], torch.zeros_like(out[0, 2, :2]))
    out.sum().backward()
    assert torch.equal(q.grad[0, 2, :2], torch.zeros_like(q.grad[0, 2, :2]))


@pytest.mark.parametrize("causal,hkv", [(False, 2), (True, 1)])
def test_gradcheck_dropout_fixed_seed(causal, hkv):
    q, k, v = qkv(b=2, sq=5, sk=6, hq=2, hkv=hkv, d=4)

    def f(q, k, v):
        torch.manual_seed(1234)  # every evaluation draws the same dropout mask
        return fmha.attention(q, k, v, dropout_p=0.3, causal=causal)

    # the mask really is the same on every evaluation, and really drops something
    assert torch.equal(f(q, k, v), f(q, k, v))
    assert not torch.allclose(f(q, k, v), fmha.attention(q, k, v, causal=causal))
    gradcheck(f, (q, k, v))


def test_gradcheck_dropout_with_bias_and_softcap():
    q, k, v = qkv(b=1, sq=4, sk=5, hq=2, hkv=2, d=4)
    bias = rand(2, 4, 5, seed=8)

    def f(q, k, v, bias):
        torch.manual_seed(7)
        return fmha.attention(q, k, v, bias=bias, softcap=2.0, dropout_p=0.25)

    gradcheck(f, (q, k, v, bias))


CU_Q, CU_K = [0, 3, 8, 9], [0, 4, 9, 12]


@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"causal": True, "alignment": "top_left"},
                                {"window": (1, 1)}, {"softcap": 1.0, "scale": 1.5}],
                         ids=["plain", "causal", "causal_top_left", "window", "softcap"])
def test_gradcheck_varlen(kw):
    q = rand(CU_Q[-1], 4, 4, seed=1)
    k = rand(CU_K[-1], 2, 4, seed=2)
    v = rand(CU_K[-1], 2, 3, seed=3)
    cu_q = torch.tensor(CU_Q, dtype=torch.int32)
    cu_k = torch.tensor(CU_K, dtype=torch.int32)
    gradcheck(lambda q, k, v: fmha.attention_varlen(q, k, v, cu_q, cu_k, **kw), (q, k, v))


def test_gradcheck_varlen_dropout_alibi():
    q = rand(CU_Q[-1], 2, 4, seed=1)
    k = rand(CU_K[-1], 2, 4, seed=2)
    v = rand(CU_K[-1], 2, 4, seed=3)
    cu_q = torch.tensor(CU_Q, dtype=torch.int32)
    cu_k = torch.tensor(CU_K, dtype=torch.int32)
    slopes = torch.tensor([[0.5, 0.25], [0.1, 0.2], [1.0, 0.0]], dtype=F64)

    def f(q, k, v):
        torch.manual_seed(99)
        return fmha.attention_varlen(q, k, v, cu_q, cu_k, dropout_p=0.2, alibi_slopes=slopes,
                                     causal=True)

    gradcheck(f, (q, k, v))


def test_gradcheck_non_contiguous_inputs():
    """Any strides are accepted: (b, h, s, d) tensors transposed to (b, s, h, d), and a
    head_dim that is not unit-stride."""
    q = rand(1, 2, 5, 4, seed=1).transpose(1, 2)
    k = rand(1, 2, 6, 8, seed=2).transpose(1, 2)[..., ::2]
    v = rand(1, 6, 4, 2, seed=3).transpose(2, 3)
    assert not q.is_contiguous() and k.stride(-1) == 2 and v.stride(-1) != 1
    gradcheck(lambda q, k, v: fmha.attention(q, k, v, causal=True), (q, k, v))


def test_autograd_matches_reference_grads():
    q, k, v = qkv(b=2, sq=5, sk=6, hq=4, hkv=2, d=8, dv=4)
    out = fmha.attention(q, k, v, causal=True, softcap=2.0)
    dout = rand(*out.shape, grad=False, seed=4)
    out.backward(dout)
    rdq, rdk, rdv, _ = reference.attention_backward(
        dout.numpy(), *(x.detach().numpy() for x in (q, k, v)), causal=True, softcap=2.0)
    for got, want in ((q.grad, rdq), (k.grad, rdk), (v.grad, rdv)):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-9, atol=1e-11)


# ---------------------------------------------------------------- opcheck

def test_autograd_context_names_match_the_op_schema():
    """_setup_context reads fmha::fwd's inputs by name (fmha._torch._FwdInputs): the names
    and their order are the registered op's, so a changed signature fails here."""
    schema = [a.name for a in torch.ops.fmha.fwd.default._schema.arguments]
    assert list(fmha._torch._FwdInputs._fields) == schema
    assert set(fmha._torch._SAVED_INPUTS) <= set(schema)


def _fwd_args(dtype, *, bias=None, mask=None, alibi=None, varlen=False, rng=None, causal=False,
              dropout_p=0.0, softcap=0.0, window=(-1, -1), grad=True):
    """Arguments of torch.ops.fmha.fwd (see fmha/_torch.py)."""
    if varlen:
        q = rand(CU_Q[-1], 4, 8, dtype=dtype, grad=grad, seed=1)
        k = rand(CU_K[-1], 2, 8, dtype=dtype, grad=grad, seed=2)
        v = rand(CU_K[-1], 2, 8, dtype=dtype, grad=grad, seed=3)
        cu_q = torch.tensor(CU_Q, dtype=torch.int32)
        cu_k = torch.tensor(CU_K, dtype=torch.int32)
        max_q = int(np.diff(CU_Q).max())
        max_k = int(np.diff(CU_K).max())
    else:
        q, k, v = qkv(b=2, sq=5, sk=7, hq=4, hkv=2, d=8, dtype=dtype, grad=grad)
        cu_q = cu_k = None
        max_q, max_k = 5, 7
    wl, wr = window
    if causal:
        wr = 0
    return (q, k, v, bias, mask, alibi, cu_q, cu_k, max_q, max_k, rng, 8 ** -0.5, softcap,
            wl, wr, True, dropout_p)


def _full_mask():
    m = torch.rand(2, 1, 5, 7, generator=torch.Generator().manual_seed(3)) < 0.7
    m[..., 0] = True
    return m.expand(2, 4, 5, 7)


FWD_CASES = {
    "f32_plain": lambda: _fwd_args(torch.float32),
    "f64_plain": lambda: _fwd_args(F64),
    "f32_bias_mask_causal": lambda: _fwd_args(
        torch.float32, bias=rand(2, 4, 5, 7, dtype=torch.float32, seed=4), mask=_full_mask(),
        causal=True),
    "f64_bias_broadcast_view": lambda: _fwd_args(
        F64, bias=rand(1, 4, 1, 7, seed=4).expand(2, 4, 5, 7)),
    "f64_alibi_window_softcap": lambda: _fwd_args(
        F64, alibi=torch.rand(2, 4, dtype=F64), window=(2, 1), softcap=2.0),
    "f32_dropout_rng": lambda: _fwd_args(
        torch.float32, rng=torch.tensor([123, 456], dtype=torch.int64), dropout_p=0.2),
    "f32_varlen": lambda: _fwd_args(torch.float32, varlen=True, causal=True),
    "f64_no_grad": lambda: _fwd_args(F64, grad=False),
    # the trailing (deterministic, num_splits) inputs given explicitly
    "f32_num_splits": lambda: _fwd_args(torch.float32, causal=True) + (True, 3),
}


# All of opcheck's default test_utils are run (test_schema, test_autograd_registration,
# test_faketensor, test_aot_dispatch_dynamic); none had to be excluded.
@pytest.mark.parametrize("name", list(FWD_CASES))
def test_opcheck_fwd(name):
    args = FWD_CASES[name]()
    result = torch.library.opcheck(torch.ops.fmha.fwd.default, args)
    assert all(v == "SUCCESS" for v in result.values()), result


def _bwd_args(name, bias_grad):
    args = FWD_CASES[name]()
    detached = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    out, lse = torch.ops.fmha.fwd(*detached)
    q, k, v, bias, mask, alibi, cu_q, cu_k, max_q, max_k, rng, scale, softcap, wl, wr, br, p = \
        detached
    if bias is not None and bias.stride(0) == 0:
        bias = bias.contiguous()
    dout = rand(*out.shape, dtype=out.dtype, grad=False, seed=11)
    # bwd has no autograd formula of its own (no double backward), so its inputs are passed
    # without requires_grad; test_autograd_registration then checks exactly that.
    return (dout, q, k, v, out, lse, bias, mask, alibi, cu_q, cu_k, max_q, max_k, rng, scale,
            softcap, wl, wr, br, p, bias_grad)


@pytest.mark.parametrize("name,bias_grad", [("f32_plain", False), ("f64_plain", False),
                                            ("f32_bias_mask_causal", True),
                                            ("f32_bias_mask_causal", False),
                                            ("f64_alibi_window_softcap", False),
                                            ("f32_dropout_rng", False), ("f32_varlen", False)])
def test_opcheck_bwd(name, bias_grad):
    args = _bwd_args(name, bias_grad)
    result = torch.library.opcheck(torch.ops.fmha.bwd.default, args)
    assert all(v == "SUCCESS" for v in result.values()), result
    dq, dk, dv, dbias = torch.ops.fmha.bwd(*args)
    assert dq.shape == args[1].shape and dk.shape == args[2].shape and dv.shape == args[3].shape
    if bias_grad:
        assert dbias.shape == args[6].shape and dbias.dtype == args[6].dtype
        assert torch.isfinite(dbias).all() and dbias.abs().sum() > 0
    else:
        assert dbias.numel() == 0


# ---------------------------------------------------------------- torch.compile

class TinyAttention(torch.nn.Module):
    def __init__(self, dim=16, heads=4, kv_heads=2, **attn_kw):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.q = torch.nn.Linear(dim, dim)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.hd)
        self.o = torch.nn.Linear(dim, dim)
        self.bias = torch.nn.Parameter(0.1 * torch.randn(heads, 1, 1))
        self.attn_kw = attn_kw

    def forward(self, x):
        b, n, dim = x.shape
        q = self.q(x).view(b, n, self.heads, self.hd)
        k, v = self.kv(x).view(b, n, 2, self.kv_heads, self.hd).unbind(2)
        pos = torch.arange(n, dtype=x.dtype)
        bias = self.bias * (pos[None, :] - pos[:, None]).abs().neg()  # (heads, n, n)
        out = fmha.attention(q, k, v, bias=bias, **self.attn_kw)
        return self.o(out.reshape(b, n, dim))


def _grads(m):
    return {n: p.grad.clone() for n, p in m.named_parameters()}


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_matches_eager(backend):
    torch.manual_seed(0)
    m = TinyAttention(causal=True, softcap=5.0)
    x = torch.randn(2, 9, 16, requires_grad=True)

    explanation = torch._dynamo.explain(m)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(m, fullgraph=True, backend=backend)
    y_c = compiled(x)
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0

    g = torch.randn_like(y_c)
    y_c.backward(g)
    grads_c, xgrad_c = _grads(m), x.grad.clone()
    m.zero_grad()
    x.grad = None
    y_e = m(x)
    y_e.backward(g)
    torch.testing.assert_close(y_c, y_e, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(xgrad_c, x.grad, rtol=1e-5, atol=1e-6)
    for n, gr in _grads(m).items():
        torch.testing.assert_close(grads_c[n], gr, rtol=1e-5, atol=1e-6, msg=n)
    assert grads_c["bias"].abs().sum() > 0


def test_compile_dropout_fullgraph_reproducible():
    torch.manual_seed(0)
    m = TinyAttention(dropout_p=0.3)
    x = torch.randn(2, 9, 16)
    explanation = torch._dynamo.explain(m)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    torch.manual_seed(5)
    a = compiled(x)
    torch.manual_seed(5)
    b = compiled(x)
    torch.manual_seed(6)
    c = compiled(x)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.allclose(a, c)


def test_compile_varlen_fullgraph():
    q = rand(CU_Q[-1], 4, 8, dtype=torch.float32, seed=1)
    k = rand(CU_K[-1], 2, 8, dtype=torch.float32, seed=2)
    v = rand(CU_K[-1], 2, 8, dtype=torch.float32, seed=3)
    cu_q = torch.tensor(CU_Q, dtype=torch.int32)
    cu_k = torch.tensor(CU_K, dtype=torch.int32)

    def f(q, k, v):
        return fmha.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=5, max_seqlen_k=5,
                                     causal=True)

    explanation = torch._dynamo.explain(f)(q, k, v)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch._dynamo.reset()
    y_c = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    y_c.sum().backward()
    gq = q.grad.clone()
    q.grad = None
    y_e = f(q, k, v)
    y_e.sum().backward()
    torch.testing.assert_close(y_c, y_e, rtol=0, atol=0)
    torch.testing.assert_close(gq, q.grad, rtol=0, atol=0)


# ---------------------------------------------------------------- dropout reproducibility

def test_dropout_manual_seed_reproducible():
    q, k, v = qkv(b=2, sq=6, sk=7, hq=4, hkv=2, d=8, dtype=torch.float32)
    res = []
    for seed in (11, 11, 12):
        for x in (q, k, v):
            x.grad = None
        torch.manual_seed(seed)
        out = fmha.attention(q, k, v, dropout_p=0.4)
        out.sum().backward()
        res.append((out.detach().clone(), q.grad.clone(), k.grad.clone(), v.grad.clone()))
    for a, b in zip(res[0], res[1]):
        assert torch.equal(a, b)
    assert not torch.equal(res[0][0], res[2][0])
    no_drop = fmha.attention(q, k, v)
    assert not torch.allclose(res[0][0], no_drop)


def test_dropout_independent_of_thread_count():
    q, k, v = qkv(b=2, sq=33, sk=40, hq=4, hkv=2, d=8, dtype=torch.float32, grad=False)
    before = fmha._core._num_threads
    outs = []
    try:
        for n in (1, 2, 3):
            fmha.set_num_threads(n)
            torch.manual_seed(3)
            outs.append(fmha.attention(q, k, v, dropout_p=0.3, causal=True))
    finally:
        fmha._core._num_threads = before
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_dropout_op_matches_reference_philox():
    """torch.ops.fmha.fwd with rng = [seed, offset] is the reference's Philox dropout."""
    q, k, v = qkv(b=2, sq=5, sk=7, hq=4, hkv=2, d=8, grad=False)
    seed, offset = 2024, 77
    rng = torch.tensor([seed, offset], dtype=torch.int64)
    out, lse = torch.ops.fmha.fwd(q, k, v, None, None, None, None, None, 5, 7, rng, 0.3, 0.0,
                                  -1, -1, True, 0.25)
    ref_out, ref_lse = reference.attention_forward(q.numpy(), k.numpy(), v.numpy(), scale=0.3,
                                                   dropout_p=0.25, seed=seed, offset=offset)
    np.testing.assert_allclose(out.numpy(), ref_out, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse.numpy(), ref_lse, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- out / lse dtypes and shapes

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_out_lse_dtype_and_shape_torch(dtype):
    q, k, v = qkv(b=2, sq=5, sk=7, hq=4, hkv=2, d=8, dv=6, dtype=dtype, grad=False)
    out, lse = fmha.attention(q, k, v, return_lse=True)
    assert out.dtype == dtype and out.shape == (2, 5, 4, 6)
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert lse.shape == (2, 4, 5)
    assert out.device == q.device and lse.device == q.device
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    only_out = fmha.attention(q, k, v)
    assert isinstance(only_out, torch.Tensor) and torch.equal(only_out, out)

    qv, kv_, vv = (x.reshape(-1, *x.shape[2:]) for x in (q, k, v))
    cu_q = torch.tensor([0, 5, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 14], dtype=torch.int32)
    outv, lsev = fmha.attention_varlen(qv, kv_, vv, cu_q, cu_k, return_lse=True)
    assert outv.dtype == dtype and outv.shape == (10, 4, 6)
    assert lsev.dtype == lse.dtype and lsev.shape == (4, 10)
    # the varlen lse is the batched lse with (batch, seqlen) packed: (heads, total)
    torch.testing.assert_close(lsev, lse.permute(1, 0, 2).reshape(4, 10))


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_out_lse_dtype_and_shape_numpy(dtype):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 5, 4, 8)).astype(dtype)
    k = rng.standard_normal((2, 7, 2, 8)).astype(dtype)
    v = rng.standard_normal((2, 7, 2, 6)).astype(dtype)
    out, lse = fmha.attention(q, k, v, return_lse=True)
    assert isinstance(out, np.ndarray) and out.dtype == dtype and out.shape == (2, 5, 4, 6)
    assert lse.dtype == (np.float64 if dtype == np.float64 else np.float32)
    assert lse.shape == (2, 4, 5)


def test_lse_is_minus_inf_for_empty_rows():
    q, k, v = qkv(b=1, sq=5, sk=3, hq=2, hkv=2, d=4, grad=False)
    out, lse = fmha.attention(q, k, v, causal=True, return_lse=True)  # bottom-right: 2 rows empty
    assert torch.isneginf(lse[:, :, :2]).all() and torch.isfinite(lse[:, :, 2:]).all()
    assert torch.equal(out[:, :2], torch.zeros_like(out[:, :2]))
