"""A differentiable lse (docs/semantics.md, "The backward"): the gradient reaching lse folds
into the backward's per-row term, D - dlse. Checked in layers:

- fmha.reference's fold against torch autograd through a plain float64 attention that
  returns logsumexp (so the reference is right on its own terms);
- the CPU kernels (fmha.attention_backward on NumPy arrays, dense and varlen) against the
  reference, including a bias constant along the keys, whose gradient is then sum dlse
  instead of 0, and rows that see no key;
- torch autograd: gradcheck through out and lse together, lse alone, and out alone (which
  must not change: no dlse reaches the kernels);
- the CUDA kernels under the emulator (NumPy float16 and torch bfloat16).
"""

from __future__ import annotations

import numpy as np
import pytest

import fmha
from conftest import to_f64
from fmha import reference

torch = pytest.importorskip("torch")


def naive(q, k, v, *, causal=False, bias=None, softcap=0.0, scale=None):
    """(out, lse) of float64 torch tensors (b, s, h, d), GQA by repetition, bottom-right."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    kk = k.repeat_interleave(hq // hkv, dim=2)
    vv = v.repeat_interleave(hq // hkv, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, kk) * (d ** -0.5 if scale is None else scale)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    if causal:
        i = torch.arange(sq)[:, None] + (sk - sq)
        s = s.masked_fill(torch.arange(sk)[None, :] > i, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    return torch.einsum("bhij,bjhd->bihd", p, vv), lse


CASES = {
    "plain": dict(),
    "causal-gqa": dict(causal=True, hq=4, hkv=2),
    "softcap-row-bias": dict(softcap=3.0, bias=(2, 4, 5, 1)),
    "full-bias-causal": dict(causal=True, bias=(1, 4, 5, 7)),
}


def inputs(rng, *, hq=4, hkv=4, b=2, sq=5, sk=7, d=8, bias=None, **kw):
    q = rng.standard_normal((b, sq, hq, d))
    k = rng.standard_normal((b, sk, hkv, d))
    v = rng.standard_normal((b, sk, hkv, d))
    bias = None if bias is None else rng.standard_normal(bias)
    return q, k, v, bias, kw


@pytest.mark.parametrize("case", list(CASES))
def test_reference_fold_matches_autograd(rng, case):
    q, k, v, bias, kw = inputs(rng, **CASES[case])
    dout = rng.standard_normal(q.shape)
    dlse = rng.standard_normal((q.shape[0], q.shape[2], q.shape[1]))
    t = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    tb = None if bias is None else torch.tensor(bias, requires_grad=True)
    out, lse = naive(*t, bias=tb, **kw)
    torch.autograd.backward([out, lse], [torch.tensor(dout), torch.tensor(dlse)])
    want = [x.grad.numpy() for x in t] + ([] if tb is None else [tb.grad.numpy()])
    got = reference.attention_backward(dout, q, k, v, bias=bias, dlse=dlse, **kw)
    for name, g, w in zip(("dq", "dk", "dv", "dbias"), got, want):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-10, err_msg=name)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("case", list(CASES))
def test_cpu_kernels_match_the_reference(rng, case, dtype):
    q, k, v, bias, kw = inputs(rng, **CASES[case])
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    bias = None if bias is None else bias.astype(dtype)
    out, lse = fmha.attention(q, k, v, bias=bias, return_lse=True, **kw)
    dout = rng.standard_normal(out.shape).astype(dtype)
    dlse = rng.standard_normal(lse.shape).astype(lse.dtype)
    got = fmha.attention_backward(dout, q, k, v, out, lse, bias=bias, bias_grad=bias is not None,
                                  dlse=dlse, **kw)
    want = reference.attention_backward(dout, q, k, v, bias=bias, out=out, dlse=dlse, **kw)
    tol = 1e-10 if dtype == "float64" else 2e-5
    for name, g, w in zip(("dq", "dk", "dv", "dbias"), got, want):
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol, err_msg=name)
    if bias is not None and bias.shape[-1] == 1:
        # A bias constant along the keys moves lse one for one: its gradient is dlse.
        np.testing.assert_allclose(got[3][..., 0], dlse, rtol=tol, atol=tol)


def test_rows_without_keys_and_varlen(rng):
    """A causal top-left call with seqlen_q > seqlen_k (its late rows see keys, its early ones
    none: dlse there changes nothing) and a varlen batch with an empty sequence."""
    q, k, v = (rng.standard_normal(s) for s in ((1, 6, 2, 8), (1, 3, 2, 8), (1, 3, 2, 8)))
    kw = dict(causal=True, alignment="bottom_right")
    out, lse = fmha.attention(q, k, v, return_lse=True, **kw)
    assert np.isneginf(lse[0, :, :3]).all()
    dout, dlse = rng.standard_normal(out.shape), rng.standard_normal(lse.shape)
    got = fmha.attention_backward(dout, q, k, v, out, lse, dlse=dlse, **kw)
    want = reference.attention_backward(dout, q, k, v, dlse=dlse, **kw)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-10)

    lens_q, lens_k = [3, 0, 4], [5, 2, 4]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lens_q, lens_k))
    q, k, v = (rng.standard_normal((n, 2, 8)) for n in (7, 11, 11))
    out, lse = fmha.attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True)
    dout, dlse = rng.standard_normal(out.shape), rng.standard_normal(lse.shape)
    got = fmha.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal=True,
                                         dlse=dlse)
    want = reference.attention_varlen_backward(dout, q, k, v, cu_q, cu_k, causal=True,
                                               dlse=dlse)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("case", ["causal-gqa", "softcap-row-bias", "full-bias-causal"])
def test_gradcheck_through_out_and_lse(rng, case):
    q, k, v, bias, kw = inputs(rng, d=4, **CASES[case])
    leaves = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    if bias is not None:
        leaves.append(torch.tensor(bias, requires_grad=True))

    def f(q, k, v, bias=None):
        return fmha.attention(q, k, v, bias=bias, return_lse=True, **kw)

    assert torch.autograd.gradcheck(f, tuple(leaves), eps=1e-6, atol=1e-7)


def test_lse_alone_and_out_alone(rng):
    q, k, v = (torch.tensor(rng.standard_normal(s), requires_grad=True)
               for s in ((2, 5, 4, 8), (2, 7, 2, 8), (2, 7, 2, 8)))
    out, lse = fmha.attention(q, k, v, causal=True, return_lse=True)
    lse.sum().backward()  # no gradient reaches out
    t = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    _, want = naive(*t, causal=True)
    want.sum().backward()
    for a, b in zip((q, k, v), t):  # lse does not depend on v: zeros, None in the naive
        want_grad = torch.zeros_like(a) if b.grad is None else b.grad
        torch.testing.assert_close(a.grad, want_grad, rtol=1e-10, atol=1e-10)
    # out alone: the same gradients, bit for bit, as a call that never returned lse.
    grads = []
    for return_lse in (True, False):
        t = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
        res = fmha.attention(*t, causal=True, return_lse=return_lse)
        (res[0] if return_lse else res).square().sum().backward()
        grads.append([x.grad for x in t])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.backends("emu", "gpu")
def test_cuda_kernels_fold_dlse(rng, backend):
    """NumPy float16 (attention_backward) and torch bfloat16 (autograd through out and lse)
    on the CUDA kernels, against the reference computed from the same rounded inputs; with a
    row bias (its gradient is dlse) and a full one."""
    q, k, v, _, kw = inputs(rng, hq=4, hkv=2, sq=9, sk=13, d=32, causal=True)
    for bias_shape in ((2, 4, 9, 1), (1, 4, 9, 13)):
        bias = rng.standard_normal(bias_shape).astype(np.float16)
        q16, k16, v16 = (x.astype(np.float16) for x in (q, k, v))
        out, lse = fmha.attention(q16, k16, v16, bias=bias, return_lse=True, **kw)
        dout = rng.standard_normal(out.shape).astype(np.float16)
        dlse = rng.standard_normal(lse.shape).astype(np.float32)
        got = fmha.attention_backward(dout, q16, k16, v16, out, lse, bias=bias, bias_grad=True,
                                      dlse=dlse, **kw)
        want = reference.attention_backward(*(to_f64(x) for x in (dout, q16, k16, v16)),
                                            bias=to_f64(bias), out=to_f64(out), dlse=dlse, **kw)
        for name, g, w in zip(("dq", "dk", "dv", "dbias"), got, want):
            err = np.abs(to_f64(g) - w).max()
            assert err <= 2e-2 * max(np.abs(w).max(), 1.0), (name, err)
    tq, tk, tv = (torch.tensor(x).to(torch.bfloat16).requires_grad_(True) for x in (q, k, v))
    out, lse = fmha.attention(tq, tk, tv, return_lse=True, **kw)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    torch.autograd.backward([out, lse], [dout, dlse])
    want = reference.attention_backward(*(to_f64(x) for x in (dout, tq, tk, tv)),
                                        out=to_f64(out), dlse=to_f64(dlse), **kw)
    for name, g, w in zip(("dq", "dk", "dv"), (tq.grad, tk.grad, tv.grad), want):
        err = np.abs(to_f64(g) - w).max()
        assert err <= 4e-2 * max(np.abs(w).max(), 1.0), (name, err)
