"""Attention sinks (docs/semantics.md, "Attention sinks"): a per-head logit in every softmax
denominator, carrying no value. The reference against torch autograd through a plain
float64 attention that appends the sink column (as transformers' gpt-oss eager attention
does); fmha (torch autograd, NumPy attention_backward) against the reference, with fully
masked rows (out 0, all mass on the sink), GQA, causal, softcap, a row-constant bias (which
sinks stop from cancelling) and a gradient through lse; the CUDA kernels under the
emulator.
"""

from __future__ import annotations

import numpy as np
import pytest

import fmha
from conftest import to_f64
from fmha import reference

torch = pytest.importorskip("torch")


def naive(q, k, v, sinks, *, causal=False, bias=None, softcap=0.0):
    """(out, lse) with sinks, float64 torch, (b, s, h, d) layout, bottom-right causal."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    kk, vv = (x.repeat_interleave(hq // hkv, dim=2) for x in (k, v))
    s = torch.einsum("bihd,bjhd->bhij", q, kk) * d ** -0.5
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    if causal:
        s = s.masked_fill(torch.arange(sk)[None, :] > torch.arange(sq)[:, None] + (sk - sq),
                          float("-inf"))
    full = torch.cat([s, sinks.reshape(1, -1, 1, 1).expand(b, -1, sq, 1)], dim=-1)
    lse = torch.logsumexp(full, dim=-1)
    p = torch.exp(full - lse[..., None])[..., :-1]
    return torch.einsum("bhij,bjhd->bihd", p, vv), lse


CASES = {
    "plain": dict(),
    "causal-gqa-rows-without-keys": dict(causal=True, hkv=2, sq=9, sk=5),
    "softcap-row-bias": dict(softcap=2.0, bias=(2, 4, 6, 1)),
    "full-bias": dict(bias=(1, 4, 6, 7)),
}


def inputs(rng, *, b=2, sq=6, sk=7, hq=4, hkv=4, d=8, bias=None, **kw):
    x = dict(q=rng.standard_normal((b, sq, hq, d)), k=rng.standard_normal((b, sk, hkv, d)),
             v=rng.standard_normal((b, sk, hkv, d)), sinks=rng.uniform(-1.0, 2.0, hq),
             bias=None if bias is None else rng.standard_normal(bias))
    return x, kw


@pytest.mark.parametrize("case", list(CASES))
def test_reference_matches_autograd(rng, case):
    x, kw = inputs(rng, **CASES[case])
    t = {n: None if a is None else torch.tensor(a, requires_grad=True) for n, a in x.items()}
    out, lse = naive(t["q"], t["k"], t["v"], t["sinks"], bias=t["bias"], **kw)
    dout, dlse = rng.standard_normal(out.shape), rng.standard_normal(lse.shape)
    torch.autograd.backward([out, lse], [torch.tensor(dout), torch.tensor(dlse)])
    r_out, r_lse = reference.attention_forward(x["q"], x["k"], x["v"], sinks=x["sinks"],
                                               bias=x["bias"], **kw)
    np.testing.assert_allclose(r_out, out.detach().numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(r_lse, lse.detach().numpy(), rtol=1e-12, atol=1e-12)
    grads = reference.attention_backward(dout, x["q"], x["k"], x["v"], sinks=x["sinks"],
                                         bias=x["bias"], dlse=dlse, **kw)
    names = ["q", "k", "v", "bias", "sinks"]
    for name, g in zip(names, grads):
        if name == "bias" and g is None:
            continue
        np.testing.assert_allclose(g, t[name].grad.numpy(), rtol=1e-10, atol=1e-10,
                                   err_msg=name)


@pytest.mark.parametrize("case", list(CASES))
def test_torch_autograd_matches_the_reference(rng, case):
    x, kw = inputs(rng, **CASES[case])
    t = {n: None if a is None else torch.tensor(a, requires_grad=True) for n, a in x.items()}
    out, lse = fmha.attention(t["q"], t["k"], t["v"], sinks=t["sinks"], bias=t["bias"],
                              return_lse=True, **kw)
    r_out, r_lse = reference.attention_forward(x["q"], x["k"], x["v"], sinks=x["sinks"],
                                               bias=x["bias"], **kw)
    np.testing.assert_allclose(out.detach().numpy(), r_out, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(lse.detach().numpy(), r_lse, rtol=1e-10, atol=1e-10)
    if kw.get("causal"):  # queries 0-3 see no key: all their mass is on the sink
        assert np.all(out.detach().numpy()[:, :4] == 0)
        np.testing.assert_array_equal(lse.detach().numpy()[:, :, :4],
                                      np.broadcast_to(x["sinks"][None, :, None], (2, 4, 4)))
    dout, dlse = rng.standard_normal(out.shape), rng.standard_normal(lse.shape)
    torch.autograd.backward([out, lse], [torch.tensor(dout), torch.tensor(dlse)])
    grads = reference.attention_backward(dout, x["q"], x["k"], x["v"], sinks=x["sinks"],
                                         bias=x["bias"], dlse=dlse, **kw)
    for name, g in zip(["q", "k", "v", "bias", "sinks"], grads):
        if g is not None:
            np.testing.assert_allclose(t[name].grad.numpy(), g, rtol=1e-9, atol=1e-9,
                                       err_msg=name)


def test_gradcheck_with_sinks(rng):
    x, kw = inputs(rng, b=1, sq=4, sk=5, hq=4, hkv=2, d=4, causal=True)
    leaves = tuple(torch.tensor(x[n], requires_grad=True) for n in ("q", "k", "v", "sinks"))

    def f(q, k, v, sinks):
        return fmha.attention(q, k, v, sinks=sinks, return_lse=True, **kw)

    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("case", list(CASES))
def test_numpy_backward_matches_the_reference(rng, case, dtype):
    x, kw = inputs(rng, **CASES[case])
    q, k, v = (x[n].astype(dtype) for n in "qkv")
    bias = None if x["bias"] is None else x["bias"].astype(dtype)
    sinks = x["sinks"].astype(dtype)
    out, lse = fmha.attention(q, k, v, sinks=sinks, bias=bias, return_lse=True, **kw)
    dout = rng.standard_normal(out.shape).astype(dtype)
    dlse = rng.standard_normal(lse.shape).astype(lse.dtype)
    got = fmha.attention_backward(dout, q, k, v, out, lse, sinks=sinks, bias=bias,
                                  bias_grad=bias is not None, dlse=dlse, **kw)
    want = reference.attention_backward(dout, q, k, v, sinks=sinks, bias=bias, out=out,
                                        dlse=dlse, **kw)
    want = [w for w in want if w is not None]
    assert len(got) == len(want)
    tol = 1e-10 if dtype == "float64" else 3e-5
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol)


def test_bad_sinks_are_refused(rng):
    x, _ = inputs(rng)
    with pytest.raises(ValueError, match=r"sinks: expected shape \(4,\)"):
        fmha.attention(x["q"], x["k"], x["v"], sinks=np.zeros(3))
    with pytest.raises(TypeError, match="sinks: expected a floating-point dtype"):
        fmha.attention(x["q"], x["k"], x["v"], sinks=np.zeros(4, np.int32))
    with pytest.raises(TypeError, match="sinks"):
        fmha.attention(torch.tensor(x["q"]), torch.tensor(x["k"]), torch.tensor(x["v"]),
                       sinks=np.zeros(4))


@pytest.mark.backends("emu", "gpu")
def test_cuda_kernels_with_sinks(rng, backend):
    """torch bfloat16 autograd with sinks (and a gradient through lse) on the CUDA kernels,
    against the reference from the same rounded inputs."""
    x, kw = inputs(rng, sq=9, sk=13, hkv=2, d=32, causal=True)
    tq, tk, tv = (torch.tensor(x[n]).to(torch.bfloat16).requires_grad_(True) for n in "qkv")
    sinks = torch.tensor(x["sinks"], dtype=torch.float32, requires_grad=True)
    out, lse = fmha.attention(tq, tk, tv, sinks=sinks, return_lse=True, **kw)
    r_out, r_lse = reference.attention_forward(*(to_f64(a) for a in (tq, tk, tv)),
                                               sinks=x["sinks"], **kw)
    assert np.abs(to_f64(out) - r_out).max() <= 2e-2 * max(np.abs(r_out).max(), 1.0)
    assert np.abs(to_f64(lse) - r_lse).max() <= 1e-4 * max(np.abs(r_lse).max(), 1.0)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    torch.autograd.backward([out, lse], [dout, dlse])
    want = reference.attention_backward(*(to_f64(a) for a in (dout, tq, tk, tv)),
                                        sinks=x["sinks"], out=to_f64(out), dlse=to_f64(dlse),
                                        **kw)
    for name, g, w in zip(("dq", "dk", "dv", "dbias", "dsinks"),
                          (tq.grad, tk.grad, tv.grad, None, sinks.grad), want):
        if g is None:
            continue
        err = np.abs(to_f64(g) - w).max()
        assert err <= 4e-2 * max(np.abs(w).max(), 1.0), (name, err)


def test_varlen_kvcache_and_sdpa_entries_take_sinks(rng):
    """attention_varlen (torch autograd and NumPy backward), attention_with_kvcache and the
    SDPA entry give what fmha.attention gives with the same sinks."""
    from fmha.kvcache import attention_with_kvcache
    x, _ = inputs(rng, b=1, sq=5, sk=7, hq=4, hkv=2)
    sinks = x["sinks"]
    want, want_lse = fmha.attention(x["q"], x["k"], x["v"], causal=True, sinks=sinks,
                                    return_lse=True)
    cu_q, cu_k = np.array([0, 5], np.int32), np.array([0, 7], np.int32)
    out, lse = fmha.attention_varlen(x["q"][0], x["k"][0], x["v"][0], cu_q, cu_k, causal=True,
                                     sinks=sinks, return_lse=True)
    np.testing.assert_allclose(out, want[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse[0], rtol=1e-12, atol=1e-12)
    dout = rng.standard_normal(out.shape)
    got = fmha.attention_varlen_backward(dout, x["q"][0], x["k"][0], x["v"][0], out, lse, cu_q,
                                         cu_k, causal=True, sinks=sinks)
    ref = reference.attention_backward(dout[None], x["q"], x["k"], x["v"], causal=True,
                                       sinks=sinks, out=want)
    for g, w in zip(got, [r[0] for r in ref[:3]] + [ref[4]]):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-10)
    # torch varlen autograd: dsinks equal to the dense call's.
    grads = []
    for varlen in (False, True):
        s = torch.tensor(sinks, requires_grad=True)
        t = [torch.tensor(a[0] if varlen else a) for a in (x["q"], x["k"], x["v"])]
        o = (fmha.attention_varlen(*t, torch.tensor(cu_q), torch.tensor(cu_k), causal=True,
                                   sinks=s) if varlen else
             fmha.attention(*t, causal=True, sinks=s)[0])
        (o * torch.tensor(dout)).sum().backward()
        grads.append(s.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-10, atol=1e-10)
    # The KV cache: the same rows as the last 7 keys, 5 queries, bottom-right.
    kc, vc = (np.concatenate([a, np.zeros((1, 3, 2, 8))], axis=1) for a in (x["k"], x["v"]))
    out = attention_with_kvcache(x["q"], kc, vc, cache_seqlens=np.array([7], np.int32),
                                 causal=True, sinks=sinks)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
    # The SDPA entry (top-left causal = bottom-right here: seqlen_q = seqlen_k).
    q, k, v = (torch.tensor(a).transpose(1, 2) for a in (x["q"], x["k"][:, :5], x["v"][:, :5]))
    got = fmha.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True,
                                            sinks=torch.tensor(sinks))
    want = fmha.attention(x["q"], x["k"][:, :5], x["v"][:, :5], causal=True, sinks=sinks)
    np.testing.assert_allclose(got.transpose(1, 2).numpy(), want, rtol=1e-12, atol=1e-12)
