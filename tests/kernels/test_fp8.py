"""Float8 (e4m3) inputs (fmha/_fp8.py; docs/semantics.md, "FP8 inputs").

* The CPU forward of torch.float8_e4m3fn q, k, v with descale factors against the float64
  reference of the dequantised inputs (fmha.reference.attention_fp8_forward), under the fp8
  rule of tests/conftest.py's assert_close: shapes, GQA/MQA, causal and windows, softcap,
  bias, mask, ALiBi, block masks, varlen, every descale broadcast, float16 out, strided
  inputs, empty calls. tests/run_all_isas.py runs this file at every CPU level.
* The reference's model of P rounded to e4m3 against an independent per-row computation
  (plain loops, torch's own e4m3 conversion).
* Every refusal names its argument.
* The sm_90 kernel's e4m3 path (emulated: backend emu90), against the exact attention and
  against its own P model; what it does not take is refused by name.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import fmha
from fmha import _C, reference

torch = pytest.importorskip("torch")

from conftest import assert_close  # noqa: E402

F8 = torch.float8_e4m3fn


def codes(x):
    """The bytes of a float8 tensor, as the reference takes them."""
    return x.view(torch.uint8).numpy()


def fp8_inputs(rng, batch, sq, sk, hq, hkv, d, dv=None, amp=1.0):
    dv = d if dv is None else dv
    make = lambda shape: torch.from_numpy(  # noqa: E731
        (rng.standard_normal(shape) * amp).astype(np.float32)).to(F8)
    return make((batch, sq, hq, d)), make((batch, sk, hkv, d)), make((batch, sk, hkv, dv))


def descales(rng, batch, hkv):
    """Per-(batch, kv head) factors away from 1, so a factor applied to the wrong head or
    sequence shows."""
    return [torch.from_numpy(rng.uniform(0.3, 2.0, (batch, hkv)).astype(np.float32))
            for _ in range(3)]


def check(out, lse, ref, ref_lse, out_dtype="bfloat16"):
    assert out.dtype == getattr(torch, out_dtype) and lse.dtype == torch.float32
    assert_close("out", out, ref, "float8_e4m3fn", result_dtype=out_dtype)
    assert_close("lse", lse, ref_lse, "float32")


# ---------------------------------------------------------------- the CPU forward

@pytest.mark.parametrize("batch,sq,sk,hq,hkv,d,dv", [
    (1, 1, 1, 1, 1, 16, 16),
    (2, 17, 33, 4, 2, 64, 64),      # GQA
    (1, 40, 40, 6, 1, 128, 128),    # MQA
    (2, 9, 70, 2, 2, 32, 48),       # head_dim_v != head_dim
    (1, 130, 70, 2, 2, 256, 256),
])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_against_reference(rng, batch, sq, sk, hq, hkv, d, dv, causal):
    q, k, v = fp8_inputs(rng, batch, sq, sk, hq, hkv, d, dv)
    dq, dk, dv_ = descales(rng, batch, hkv)
    out, lse = fmha.attention(q, k, v, descale_q=dq, descale_k=dk, descale_v=dv_,
                              causal=causal, return_lse=True)
    ref, ref_lse = reference.attention_fp8_forward(
        codes(q), codes(k), codes(v), descale_q=dq.numpy(), descale_k=dk.numpy(),
        descale_v=dv_.numpy(), causal=causal)
    check(out, lse, ref, ref_lse)


@pytest.mark.parametrize("shape", ["none", "scalar", "one", "(1,1)", "(batch,1)",
                                   "(heads_kv,)", "(1,heads_kv)", "(batch,heads_kv)",
                                   "strided"])
def test_descale_broadcasting(rng, shape):
    """Each descale broadcasts to (batch, heads_kv) like a NumPy operand; the query heads of
    a kv head share its factor."""
    B, HKV = 3, 2
    q, k, v = fp8_inputs(rng, B, 6, 7, 4, HKV, 16)
    full = torch.from_numpy(rng.uniform(0.3, 2.0, (B, HKV)).astype(np.float32))
    arg = {"none": None, "scalar": torch.tensor(0.75), "one": torch.tensor([0.75]),
           "(1,1)": torch.tensor([[0.75]]), "(batch,1)": full[:, :1],
           "(heads_kv,)": full[0], "(1,heads_kv)": full[:1], "(batch,heads_kv)": full,
           "strided": torch.from_numpy(rng.uniform(0.3, 2.0, (HKV, B)).astype(np.float32)).t(),
           }[shape]
    want = None if arg is None else np.broadcast_to(
        arg.numpy().reshape(-1) if arg.numel() == 1 else arg.numpy(), (B, HKV))
    for which in ("descale_q", "descale_k", "descale_v"):
        out, lse = fmha.attention(q, k, v, return_lse=True, **{which: arg})
        ref, ref_lse = reference.attention_fp8_forward(codes(q), codes(k), codes(v),
                                                       **{which: want})
        check(out, lse, ref, ref_lse)


@pytest.mark.parametrize("feature", ["window", "top_left", "softcap", "bias", "mask",
                                     "alibi", "block_mask", "scale", "float16_out",
                                     "strided", "num_splits"])
def test_features(rng, feature):
    B, SQ, SK, HQ, HKV, D = 2, 19, 37, 4, 2, 32
    q, k, v = fp8_inputs(rng, B, SQ, SK, HQ, HKV, D)
    dq, dk, dv = descales(rng, B, HKV)
    kw, ref_kw, out_dtype = {}, {}, "bfloat16"
    if feature == "window":
        kw = ref_kw = dict(window=(5, 3))
    elif feature == "top_left":
        kw = ref_kw = dict(causal=True, alignment="top_left")
    elif feature == "softcap":
        kw = ref_kw = dict(softcap=2.0)
    elif feature == "bias":
        bias = torch.from_numpy(rng.standard_normal((B, 1, SQ, SK)).astype(np.float32))
        kw, ref_kw = dict(bias=bias), dict(bias=bias.numpy())
    elif feature == "mask":
        mask = torch.from_numpy(rng.random((1, HQ, SQ, SK)) < 0.6)
        kw, ref_kw = dict(mask=mask), dict(mask=mask.numpy())
    elif feature == "alibi":
        slopes = torch.from_numpy(rng.uniform(0.01, 0.3, HQ))
        kw, ref_kw = dict(alibi_slopes=slopes), dict(alibi_slopes=slopes.numpy())
    elif feature == "block_mask":
        allowed = rng.random((B, HQ, SQ, SK)) < 0.5
        bm = fmha.create_block_mask(lambda b, h, i, j: allowed[b, h, i, j], B, HQ, SQ, SK,
                                    block_size=(8, 16))
        kw, ref_kw = dict(block_mask=bm), dict(mask=allowed)
    elif feature == "scale":
        kw = ref_kw = dict(scale=0.37)
    elif feature == "float16_out":
        kw, out_dtype = dict(out_dtype=torch.float16), "float16"
    elif feature == "strided":  # heads-major storage, a strided last dimension for v
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
        v = torch.cat([v, v], dim=-1)[..., ::2]
    elif feature == "num_splits":  # a CUDA setting: validated, no effect on the CPU
        kw = dict(num_splits=3)
    out, lse = fmha.attention(q, k, v, descale_q=dq, descale_k=dk, descale_v=dv,
                              return_lse=True, **kw)
    ref, ref_lse = reference.attention_fp8_forward(
        codes(q.contiguous()), codes(k), codes(v.contiguous()), descale_q=dq.numpy(),
        descale_k=dk.numpy(), descale_v=dv.numpy(), **ref_kw)
    check(out, lse, ref, ref_lse, out_dtype)


def test_varlen_against_reference(rng):
    """Packed sequences (one empty): sequence b uses row b of each descale."""
    cu_q, cu_k = [0, 3, 3, 11], [0, 5, 9, 20]
    HQ, HKV, D = 4, 2, 32
    q, k, v = (t[0] for t in fp8_inputs(rng, 1, cu_q[-1], cu_k[-1], HQ, HKV, D))
    dq, dk, dv = descales(rng, 3, HKV)
    cq, ck = (torch.tensor(c, dtype=torch.int32) for c in (cu_q, cu_k))
    out, lse = fmha.attention_varlen(q, k, v, cq, ck, causal=True, descale_q=dq,
                                     descale_k=dk, descale_v=dv, return_lse=True)
    assert out.shape == (cu_q[-1], HQ, D) and lse.shape == (HQ, cu_q[-1])
    group = HQ // HKV
    qd = reference.fp8_dequantize(codes(q)[None], None)[0]
    kd = reference.fp8_dequantize(codes(k)[None], None)[0]
    vd = reference.fp8_dequantize(codes(v)[None], None)[0]
    for b in range(3):  # each sequence's factors, applied row by row
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        qd[rq] *= np.repeat(dq[b].numpy(), group)[None, :, None]
        kd[rk] *= dk[b].numpy()[None, :, None]
        vd[rk] *= dv[b].numpy()[None, :, None]
    ref, ref_lse = reference.attention_varlen_forward(qd, kd, vd, cu_q, cu_k, causal=True)
    check(out, lse, ref, ref_lse)


def test_empty_calls():
    """No key: out 0 (in out_dtype), lse -inf; no query: empty outputs."""
    q = torch.ones((2, 3, 2, 8), dtype=F8)
    k = torch.ones((2, 0, 1, 8), dtype=F8)
    out, lse = fmha.attention(q, k, k, return_lse=True, out_dtype=torch.float16)
    assert out.dtype == torch.float16 and (out == 0).all() and (lse == -math.inf).all()
    out = fmha.attention(q[:, :0], q, q)
    assert out.shape == (2, 0, 2, 8) and out.dtype == torch.bfloat16


def test_non_finite_codes_propagate(rng):
    """A NaN code in v reaches exactly the rows that give its key weight, as in the
    float dtypes; an excluded NaN reaches none."""
    q, k, v = fp8_inputs(rng, 1, 4, 4, 1, 1, 8)
    v = v.clone()
    v.view(torch.uint8)[0, 2, 0, 3] = 0x7F  # e4m3's NaN
    out = fmha.attention(q, k, v, causal=True).float()
    assert torch.isfinite(out[0, :2]).all() and torch.isnan(out[0, 2:, 0, 3]).all()


# ---------------------------------------------------------------- the reference's P model

def _p_model_by_rows(q, k, v, scale, block_k, causal):
    """The P-quantised kernel of fmha.reference.attention_fp8_forward(quantize_p=True),
    computed independently: one row at a time in plain loops, float64 dequantisation by
    torch, P rounded by torch's float32 -> float8_e4m3fn conversion."""
    qf, kf, vf = (x.double().numpy() for x in (q, k, v))
    B, SQ, HQ, _ = qf.shape
    SK, HKV, DV = kf.shape[1], kf.shape[2], vf.shape[3]
    out = np.zeros((B, SQ, HQ, DV))
    for b in range(B):
        for h in range(HQ):
            hk = h // (HQ // HKV)
            for i in range(SQ):
                keys = [j for j in range(SK) if not causal or j <= i + SK - SQ]
                m, l, o = -math.inf, 0.0, np.zeros(DV)
                for start in range(0, SK, block_k):
                    tile = [j for j in keys if start <= j < start + block_k]
                    if not tile:
                        continue
                    s = {j: scale * float(qf[b, i, h] @ kf[b, j, hk]) for j in tile}
                    m_new = max(m, max(s.values()))
                    o *= math.exp(m - m_new)
                    l *= math.exp(m - m_new)
                    for j in tile:
                        p = 256.0 * math.exp(s[j] - m_new)
                        pq = torch.tensor(p, dtype=torch.float32).to(F8).double().item()
                        l += p
                        o += pq * vf[b, j, hk]
                    m = m_new
                if l > 0:
                    out[b, i, h] = o / l
    return out


@pytest.mark.parametrize("block_k,causal", [(4, False), (4, True), (64, False)])
def test_p_model_against_rows(rng, block_k, causal):
    q, k, v = fp8_inputs(rng, 1, 5, 11, 2, 1, 8, amp=2.0)
    got, _ = reference.attention_fp8_forward(codes(q), codes(k), codes(v), scale=0.5,
                                             causal=causal, quantize_p=True, block_k=block_k)
    want = _p_model_by_rows(q, k, v, 0.5, block_k, causal)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_p_model_within_the_rule(rng):
    """The modelled kernel passes the fp8 rule with p_quantised (it is what the constant was
    measured on) and fails the rule without it: the P rounding is visible."""
    q, k, v = fp8_inputs(rng, 2, 64, 64, 2, 2, 64)
    args = (codes(q), codes(k), codes(v))
    ref, _ = reference.attention_fp8_forward(*args)
    model, _ = reference.attention_fp8_forward(*args, quantize_p=True, block_k=32)
    assert_close("out", model, ref, "float8_e4m3fn", result_dtype="bfloat16",
                 p_quantised=True)
    with pytest.raises(AssertionError):
        assert_close("out", model, ref, "float8_e4m3fn", result_dtype="bfloat16")


def test_reference_dequantises_like_torch(rng):
    """fp8_dequantize is torch's float8 -> float64 conversion times the factors."""
    q, _, _ = fp8_inputs(rng, 2, 3, 3, 4, 2, 8, amp=50.0)
    f = rng.uniform(0.1, 3.0, (2, 2))
    want = q.double().numpy() * np.repeat(f, 2, axis=1)[:, None, :, None]
    np.testing.assert_array_equal(reference.fp8_dequantize(codes(q), f, 2), want)


# ---------------------------------------------------------------- refusals

def _call(**kw):
    q = torch.ones((2, 3, 4, 8), dtype=F8)
    k = torch.ones((2, 5, 2, 8), dtype=F8)
    args = dict(q=q, k=k, v=k)
    args.update({n: kw.pop(n) for n in ("q", "k", "v") if n in kw})
    return fmha.attention(args["q"], args["k"], args["v"], **kw)


@pytest.mark.parametrize("kw,error,match", [
    (dict(descale_q=torch.ones((2, 2), dtype=torch.float64)), TypeError,
     "descale_q: expected dtype float32, got float64"),
    (dict(descale_k=np.ones((2, 2), np.float32)), TypeError, "descale_k: expected a float32 torch"),
    (dict(descale_v=torch.ones((3, 2))), ValueError,
     r"descale_v: shape \(3, 2\) does not broadcast to \(batch, heads_kv\) = \(2, 2\)"),
    (dict(descale_q=torch.ones((4,))), ValueError, "descale_q: shape"),
    (dict(descale_q=torch.ones((1, 2, 2))), ValueError, "descale_q: shape"),
    (dict(descale_k=torch.ones((2, 2), device="meta")), ValueError,
     "descale_k: on device meta:0, expected q.s device cpu"),
    (dict(descale_q=torch.ones((2, 2), requires_grad=True)), NotImplementedError,
     "descale_q: requires grad"),
    (dict(out_dtype=torch.float32), ValueError, "out_dtype: float8_e4m3fn inputs write out"),
    (dict(out_dtype="bfloat16"), TypeError, "out_dtype: expected torch.bfloat16"),
    (dict(dropout_p=0.1), ValueError, "dropout_p: float8_e4m3fn attention is forward only"),
    (dict(sinks=torch.zeros(4)), NotImplementedError, "sinks: not supported"),
    (dict(k=torch.ones((2, 5, 2, 8), dtype=torch.bfloat16)), TypeError,
     "k: expected float8_e4m3fn"),
    (dict(q=torch.ones((2, 3, 4, 8), dtype=torch.float8_e5m2)), NotImplementedError,
     "q: dtype float8_e5m2 is not supported"),
    (dict(v=torch.ones((2, 5, 3, 8), dtype=F8)), ValueError, "v: 3 heads"),
    (dict(bias=torch.ones((2, 4, 3, 5), requires_grad=True)), NotImplementedError,
     "bias: requires grad"),
])
def test_refusals_name_the_argument(kw, error, match):
    with pytest.raises(error, match=match):
        _call(**kw)


def test_inputs_that_require_grad_are_refused():
    q = torch.ones((1, 2, 1, 8)).to(F8).requires_grad_(True)
    k = torch.ones((1, 2, 1, 8), dtype=F8)
    with pytest.raises(NotImplementedError, match="q: requires grad, but float8_e4m3fn "
                                                  "attention has no backward"):
        fmha.attention(q, k, k)
    with torch.no_grad():  # no graph is built: the forward runs
        assert fmha.attention(q, k, k).shape == (1, 2, 1, 8)


def test_descales_need_float8_inputs():
    x = torch.ones((1, 2, 1, 8))
    for kw in (dict(descale_q=torch.tensor(1.0)), dict(out_dtype=torch.bfloat16)):
        with pytest.raises(ValueError, match="only with float8_e4m3fn inputs, got q of "
                                             "dtype float32"):
            fmha.attention(x, x, x, **kw)
        with pytest.raises(ValueError, match="only with float8_e4m3fn inputs, got q of "
                                             "dtype float32"):
            fmha.attention(x.numpy(), x.numpy(), x.numpy(), **kw)


def test_numpy_has_no_float8():
    """NumPy arrays cannot be float8 inputs (NumPy has no float8 dtype); their one-byte
    stand-ins are not floats at all."""
    x = np.ones((1, 2, 1, 8), np.uint8)
    with pytest.raises(TypeError, match="q: expected a floating-point dtype"):
        fmha.attention(x, x, x)


def test_kvcache_and_backward_are_refused():
    q = torch.ones((1, 1, 2, 8), dtype=F8)
    cache = torch.zeros((1, 4, 1, 8), dtype=F8)
    with pytest.raises(TypeError, match="q: expected a floating-point dtype"):
        fmha.kvcache.attention_with_kvcache(q, cache, cache,
                                            cache_seqlens=torch.tensor([2], dtype=torch.int32))
    # The C++ contract, past the Python layer: no float8 backward, no float8 with caches.
    k = torch.ones((1, 3, 2, 8), dtype=F8)
    out, lse = torch.zeros((1, 1, 2, 8), dtype=torch.bfloat16), torch.zeros((1, 2, 1))
    S = dict(scale=1.0, softcap=0.0, window_left=-1, window_right=-1, bottom_right=True,
             dropout_p=0.0)
    with pytest.raises(ValueError, match="differs from q's float8_e4m3fn|no backward"):
        _C.check_backward(out, q, k, k, out, lse, torch.zeros_like(q), torch.zeros_like(k),
                          torch.zeros_like(k), backend="cpu", **S)
    with pytest.raises(ValueError, match="dropout_p: float8_e4m3fn inputs are forward-only"):
        _C.check_forward(q, k, k, out, lse, backend="cpu", **dict(S, dropout_p=0.5))
    with pytest.raises(ValueError, match="out dtype: float8_e4m3fn inputs write out as "
                                         "bfloat16 or float16, got float32"):
        _C.check_forward(q, k, k, out.float(), lse, backend="cpu", **S)
    with pytest.raises(ValueError, match="q_descale, k_descale, v_descale: only with "
                                         "float8_e4m3fn inputs, got dtype bfloat16"):
        _C.check_forward(q.bfloat16(), k.bfloat16(), k.bfloat16(), out, lse, backend="cpu",
                         q_descale=torch.ones((1, 2)), **S)
    with pytest.raises(ValueError, match=r"k_descale: expected a float32 \(batch, heads_kv\)"):
        _C.check_forward(q, k, k, out, lse, backend="cpu", k_descale=torch.ones((2, 2)), **S)
    e5 = torch.ones((1, 1, 2, 8), dtype=torch.float8_e5m2)
    with pytest.raises(ValueError, match="q: of the float8 dtypes only float8_e4m3fn"):
        _C.check_forward(e5, k, k, out, lse, backend="cpu", **S)


# ---------------------------------------------------------------- the sm_90 kernel
# The Hopper forward's e4m3 path (csrc/cuda/flash_fwd_sm90.cuh), emulated (emu90) or on an
# sm_90 GPU: P rounded to e4m3 as FlashAttention-3 does, so each result is held to the fp8
# rule with p_quantised against the exact attention, and to the rule without it against the
# kernel's own model (reference.attention_fp8_forward(quantize_p=True), key tiles of 128). The
# model has one running max from the first key, so those calls take num_splits=1: key splits
# round each split's P against that split's max (a different, equally accurate rounding).

def check_sm90(out, lse, q, k, v, out_dtype="bfloat16", model=True, **kw):
    out, lse = out.cpu(), lse.cpu()
    args = (codes(q.cpu().contiguous()), codes(k.cpu().contiguous()),
            codes(v.cpu().contiguous()))
    ref, ref_lse = reference.attention_fp8_forward(*args, **kw)
    assert out.dtype == getattr(torch, out_dtype) and lse.dtype == torch.float32
    assert_close("out", out, ref, "float8_e4m3fn", result_dtype=out_dtype, p_quantised=True)
    assert_close("lse", lse, ref_lse, "float32")
    if model:
        p_model, _ = reference.attention_fp8_forward(*args, quantize_p=True, block_k=128, **kw)
        assert_close("out (the P model)", out, p_model, "float8_e4m3fn", result_dtype=out_dtype)


SM90_SHAPES = [
    # batch, sq, sk, hq, hkv, d, dv, causal
    (1, 70, 150, 2, 1, 64, 64, False),      # d = 64: Q and K rows of 64 bytes; GQA
    (1, 130, 200, 2, 2, 128, 128, True),    # two query blocks, a partial key block
    (2, 33, 129, 1, 1, 256, 256, False),    # d = 256: two 128-byte boxes a row
    (1, 40, 90, 2, 1, 128, 96, True),       # head_dim_v < head_dim
    (1, 20, 140, 1, 1, 64, 40, False),      # V rows not in 16-byte chunks: read by bytes
]


@pytest.mark.backends("emu90", "gpu")
@pytest.mark.parametrize("batch,sq,sk,hq,hkv,d,dv,causal", SM90_SHAPES)
def test_sm90_against_reference(backend, rng, batch, sq, sk, hq, hkv, d, dv, causal):
    q, k, v = fp8_inputs(rng, batch, sq, sk, hq, hkv, d, dv)
    dq, dk, dv_ = descales(rng, batch, hkv)
    out, lse = fmha.attention(q, k, v, descale_q=dq, descale_k=dk, descale_v=dv_,
                              causal=causal, return_lse=True, num_splits=1)
    check_sm90(out, lse, q, k, v, descale_q=dq.numpy(), descale_k=dk.numpy(),
               descale_v=dv_.numpy(), causal=causal)


@pytest.mark.backends("emu90", "gpu")
@pytest.mark.parametrize("feature", ["window", "top_left", "num_splits", "float16_out",
                                     "negative_descale", "zero_descale", "sharp", "scale"])
def test_sm90_features(backend, rng, feature):
    B, SQ, SK, HQ, HKV, D = 1, 50, 300, 2, 1, 64
    amp = 3.0 if feature == "sharp" else 1.0  # scores that move the running max often
    q, k, v = fp8_inputs(rng, B, SQ, SK, HQ, HKV, D, amp=amp)
    dq, dk, dv = descales(rng, B, HKV)
    kw, ref_kw, out_dtype = {}, {}, "bfloat16"
    if feature == "window":
        kw = ref_kw = dict(window=(70, 20))
    elif feature == "top_left":
        kw = ref_kw = dict(causal=True, alignment="top_left")
    elif feature == "num_splits":
        kw = dict(num_splits=3)
    elif feature == "float16_out":
        kw, out_dtype = dict(out_dtype=torch.float16), "float16"
    elif feature == "negative_descale":  # descale_q * descale_k < 0: the largest score flips
        dq = -dq
    elif feature == "zero_descale":  # every score 0: uniform weights over the visible keys
        dk = torch.zeros_like(dk)
        kw = ref_kw = dict(causal=True)
    elif feature == "scale":
        kw = ref_kw = dict(scale=0.37)
    out, lse = fmha.attention(q, k, v, descale_q=dq, descale_k=dk, descale_v=dv,
                              return_lse=True, **{"num_splits": 1, **kw})
    check_sm90(out, lse, q, k, v, out_dtype, model="num_splits" not in kw,
               descale_q=dq.numpy(), descale_k=dk.numpy(), descale_v=dv.numpy(), **ref_kw)


@pytest.mark.backends("emu90", "gpu")
def test_sm90_varlen(backend, rng):
    """Packed sequences (one empty, one longer than a key block): sequence b's V^T and
    descales are its own."""
    cu_q, cu_k = [0, 3, 3, 140], [0, 5, 9, 180]
    HQ, HKV, D = 2, 1, 64
    q, k, v = (t[0] for t in fp8_inputs(rng, 1, cu_q[-1], cu_k[-1], HQ, HKV, D))
    dq, dk, dv = descales(rng, 3, HKV)
    cq, ck = (torch.tensor(c, dtype=torch.int32) for c in (cu_q, cu_k))
    out, lse = fmha.attention_varlen(q, k, v, cq, ck, causal=True, descale_q=dq,
                                     descale_k=dk, descale_v=dv, return_lse=True,
                                     num_splits=1)
    out, lse = out.cpu(), lse.cpu()
    for b in range(3):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rq.start == rq.stop:
            continue
        check_sm90(out[None, rq], lse[None, :, rq], q[None, rq], k[None, rk], v[None, rk],
                   descale_q=dq[b:b + 1].numpy(), descale_k=dk[b:b + 1].numpy(),
                   descale_v=dv[b:b + 1].numpy(), causal=True)


@pytest.mark.backends("emu90", "gpu")
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_nan_codes(backend, rng, causal):
    """A NaN code of v (stored as 0 in V^T, put back by the kernel) reaches exactly the
    rows and columns whose included pairs meet it: a causal row that does not see the key
    stays finite (the strong zero), one that does is NaN in that column only; the other
    entries are those of the same inputs with the codes 0."""
    q, k, v = fp8_inputs(rng, 1, 140, 140, 1, 1, 64)
    v = v.clone()
    nans = ((70, 5, 0x7F), (131, 9, 0xFF))  # (key, column, code): -NaN in the second block
    for key, col, code in nans:
        v.view(torch.uint8)[0, key, 0, col] = code
    out = fmha.attention(q, k, v, causal=causal, num_splits=1).cpu()
    zeroed = v.clone()
    for key, col, _ in nans:
        zeroed.view(torch.uint8)[0, key, 0, col] = 0
    ref, _ = reference.attention_fp8_forward(codes(q), codes(k), codes(zeroed), causal=causal)
    for key, col, _ in nans:
        ref[0, key if causal else 0:, 0, col] = np.nan
    assert_close("out", out, ref, "float8_e4m3fn", result_dtype="bfloat16", p_quantised=True,
                 nonfinite=True)


@pytest.mark.backends("emu90", "gpu")
def test_sm90_without_keys(backend):
    """No key at all: out 0 (bfloat16), lse -inf, as on the CPU (the kernel visits no key
    block; its K and V^T maps are stand-ins no load reads)."""
    q = torch.ones((2, 3, 2, 64), dtype=F8)
    k = torch.ones((2, 0, 1, 64), dtype=F8)
    out, lse = fmha.attention(q, k, k, return_lse=True)
    out, lse = out.cpu(), lse.cpu()
    assert out.dtype == torch.bfloat16 and (out == 0).all() and (lse == -math.inf).all()


@pytest.mark.backends("emu90", "gpu")
@pytest.mark.parametrize("kw,match", [
    (dict(softcap=2.0), "softcap: not supported with float8_e4m3fn inputs on CUDA"),
    (dict(alibi_slopes=torch.ones(4, dtype=torch.float64)), "alibi_slopes: not supported"),
    (dict(bias=torch.zeros((2, 4, 3, 5))), "bias: not supported"),
    (dict(mask=torch.ones((2, 4, 3, 5), dtype=torch.bool)), "mask: not supported"),
])
def test_sm90_refusals_name_the_argument(backend, kw, match):
    """What the sm_90 kernel's e4m3 path does not take is refused by name (no other CUDA
    kernel runs float8 inputs, and none dequantises behind the caller's back)."""
    with pytest.raises(NotImplementedError, match=match):
        _call(**kw)


@pytest.mark.backends("emu", "gpu")
def test_sm80_kernel_refuses_float8(backend, monkeypatch):
    """FMHA_CUDA_KERNEL=sm80 forces the sm_80 kernel, which has no float8 path: refused,
    naming q; and a head dim whose rows TMA cannot address, naming q."""
    monkeypatch.setenv("FMHA_CUDA_KERNEL", "sm80")
    with pytest.raises(NotImplementedError, match="q: float8_e4m3fn inputs run only in the "
                                                  "sm_90 kernel"):
        _call()
    monkeypatch.delenv("FMHA_CUDA_KERNEL")
    q = torch.ones((1, 3, 2, 24), dtype=F8)  # 24-byte rows
    with pytest.raises(NotImplementedError, match="q: TMA needs"):
        fmha.attention(q, q, q)


def test_guide_example_runs(capsys):
    """docs/guides/fp8.md's example runs as written and prints a bfloat16 result within
    the inputs' e4m3 rounding of the float attention."""
    from pathlib import Path
    text = (Path(__file__).resolve().parents[2] / "docs/guides/fp8.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(code, "docs/guides/fp8.md", "exec"), {})
    dtype, err = capsys.readouterr().out.split(" ", 1)
    assert dtype == "torch.bfloat16" and 0 < float(err.strip()[len("tensor("):-1]) < 0.5
