"""fmha.scaled_dot_product_attention against torch.nn.functional.scaled_dot_product_attention.

A battery of shapes (leading batch dims, 2-D/3-D inputs, broadcasting, cross lengths both
ways, head_dim_v != head_dim), masks (bool/float, every broadcast rank, differentiable),
causal, GQA and scales, forward and backward; the no-copy layout; dropout statistics and
reproducibility; errors; and torch.compile(fullgraph=True) of models that call
fmha.attention and the SDPA entry point.
"""

import math

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import fmha  # noqa: E402
import fmha.sdpa  # noqa: E402
from conftest import compile_and_compare

F64 = torch.float64


def randn(*shape, dtype=F64, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=dtype, generator=g).requires_grad_(grad)


def bool_mask(*shape, seed=0, p=0.3):
    """Random True = may attend, with key 0 always visible (no fully masked rows, where
    torch's backends disagree among themselves)."""
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(*shape, generator=g) >= p
    m[..., 0] = True
    return m


def both(q_shape, k_shape, v_shape, attn_mask=None, dtype=F64, values_of=None, **kw):
    """Outputs and input gradients (q, k, v[, float mask]) of fmha's and torch's SDPA.

    Inputs and dout are drawn in float64 and rounded to ``values_of`` (default ``dtype``),
    then computed in ``dtype``: values_of=bfloat16, dtype=float64 is the exact answer for
    the bfloat16 inputs."""
    values_of = values_of or dtype

    def draw(*shape, seed):
        return randn(*shape, seed=seed, grad=False).to(values_of).to(dtype)

    results = []
    for fn in (fmha.scaled_dot_product_attention, F.scaled_dot_product_attention):
        q, k, v = (draw(*s, seed=i).requires_grad_(True)
                   for i, s in enumerate((q_shape, k_shape, v_shape)))
        leaves = [q, k, v]
        m = attn_mask
        if m is not None and m.is_floating_point():
            m = m.detach().clone().requires_grad_(True)
            leaves.append(m)
        out = fn(q, k, v, attn_mask=m, **kw)
        dout = draw(*out.shape, seed=9)
        grads = torch.autograd.grad(out, leaves, dout)
        results.append((out.detach(), grads))
    return results


def assert_agree(results, atol=1e-12, rtol=1e-10):
    (out_f, grads_f), (out_t, grads_t) = results
    assert out_f.shape == out_t.shape
    assert out_f.dtype == out_t.dtype
    torch.testing.assert_close(out_f, out_t, atol=atol, rtol=rtol)
    for name, a, b in zip(("dq", "dk", "dv", "dmask"), grads_f, grads_t):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=name)


# ---------------------------------------------------------------- the battery

SHAPES = [
    # (q, k, v) shapes
    ((2, 4, 9, 16), (2, 4, 9, 16), (2, 4, 9, 16)),            # self-attention
    ((2, 3, 5, 8), (2, 3, 11, 8), (2, 3, 11, 8)),             # seqlen_q < seqlen_k
    ((1, 2, 13, 8), (1, 2, 4, 8), (1, 2, 4, 8)),              # seqlen_q > seqlen_k
    ((2, 2, 7, 24), (2, 2, 6, 24), (2, 2, 6, 40)),            # head_dim_v != head_dim
    ((2, 3, 2, 5, 8), (2, 3, 2, 6, 8), (2, 3, 2, 6, 8)),      # two leading batch dims
    ((3, 5, 8), (3, 6, 8), (3, 6, 8)),                        # (heads, L, E), no batch
    ((5, 8), (6, 8), (6, 8)),                                 # (L, E)
    ((1, 1, 1, 8), (1, 1, 1, 8), (1, 1, 1, 8)),               # one query, one key
    ((2, 4, 5, 8), (1, 4, 6, 8), (1, 4, 6, 8)),               # key/value batch broadcast
    ((2, 4, 5, 8), (2, 1, 6, 8), (2, 1, 6, 8)),               # one kv head, broadcast
    ((2, 1, 5, 8), (2, 3, 6, 8), (2, 3, 6, 8)),               # one query head, broadcast
]


@pytest.mark.parametrize("shapes", SHAPES, ids=lambda s: "q" + "x".join(map(str, s[0])) +
                         "-k" + "x".join(map(str, s[1])) + "-v" + "x".join(map(str, s[2])))
@pytest.mark.parametrize("causal", [False, True])
def test_shapes(shapes, causal):
    assert_agree(both(*shapes, is_causal=causal))


@pytest.mark.parametrize("scale", [None, 0.1, 1.0, 2.5])
def test_scales(scale):
    assert_agree(both((2, 2, 6, 12), (2, 2, 7, 12), (2, 2, 7, 12), scale=scale))


@pytest.mark.parametrize("hq,hkv", [(4, 2), (8, 2), (6, 3), (4, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa(hq, hkv, causal):
    assert_agree(both((2, hq, 5, 8), (2, hkv, 7, 8), (2, hkv, 7, 8), is_causal=causal,
                      enable_gqa=True))


def test_gqa_with_mask_and_scale():
    assert_agree(both((2, 6, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8), enable_gqa=True,
                      attn_mask=bool_mask(2, 6, 5, 7, seed=3), scale=0.7))


MASK_SHAPES = [(5, 7), (1, 7), (5, 1), (3, 5, 7), (2, 1, 5, 7), (2, 3, 5, 7), (1, 1, 1, 7)]


@pytest.mark.parametrize("shape", MASK_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_masks(shape, kind):
    if kind == "bool":
        m = bool_mask(*shape, seed=4)
    else:
        m = randn(*shape, seed=4, grad=False)
        m = m.masked_fill(~bool_mask(*shape, seed=5), -math.inf)   # -inf entries too
    assert_agree(both((2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 8), attn_mask=m))


def test_float_mask_gradient_is_returned():
    (_, grads_f), _ = both((2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 8),
                           attn_mask=randn(3, 1, 7, seed=2, grad=False))
    assert grads_f[3].shape == (3, 1, 7) and grads_f[3].abs().sum() > 0


def test_masks_with_leading_batch_dims():
    for m in (bool_mask(2, 1, 1, 5, 7, seed=1), bool_mask(3, 1, 5, 7, seed=2),
              randn(2, 3, 4, 5, 7, seed=3, grad=False)):
        assert_agree(both((2, 3, 4, 5, 8), (2, 3, 4, 7, 8), (2, 3, 4, 7, 8), attn_mask=m))


def test_float32_mask_with_float64_inputs():
    # torch accepts a float32 mask whatever the query dtype; so does fmha.
    m = randn(5, 7, seed=7, grad=False).float()
    assert_agree(both((1, 2, 5, 8), (1, 2, 7, 8), (1, 2, 7, 8), attn_mask=m))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_close_to_torch(dtype):
    # Both sides round differently; compare each to the exact (float64) answer for the same
    # low-precision inputs.
    shapes = ((2, 4, 33, 32), (2, 2, 40, 32), (2, 2, 40, 32))
    m = bool_mask(2, 1, 33, 40, seed=8)
    x, gx = both(*shapes, attn_mask=m, enable_gqa=True, values_of=dtype)[0]
    (a, ga), (b, gb) = both(*shapes, attn_mask=m, enable_gqa=True, dtype=dtype)
    err_f = (a.double() - x).abs().max()
    err_t = (b.double() - x).abs().max()
    # flash-attn's rule (docs/testing.md): within 2x torch's own low-precision error (3x for
    # gradients), plus one ulp of the result's scale.
    eps = torch.finfo(dtype).eps
    assert err_f <= 2 * err_t + eps * x.abs().max(), (err_f, err_t)
    for name, g1, g2, g0 in zip(("dq", "dk", "dv"), ga, gb, gx):
        e1, e2 = (g1.double() - g0).abs().max(), (g2.double() - g0).abs().max()
        assert e1 <= 3 * e2 + eps * g0.abs().max(), (name, e1, e2)


# ---------------------------------------------------------------- layout, no copies

def test_inputs_reach_fmha_as_views(monkeypatch):
    seen = {}

    def spy(q, k, v, **kw):
        seen.update(q=q, k=k, v=v, kw=kw)
        return fmha.attention(q, k, v, **kw)

    monkeypatch.setattr(fmha.sdpa, "attention", spy)
    q = randn(2, 4, 5, 8, grad=False)
    k = randn(2, 2, 7, 8, seed=1, grad=False)
    v = randn(2, 2, 7, 8, seed=2, grad=False)
    out = fmha.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    for name, x in (("q", q), ("k", k), ("v", v)):
        y = seen[name]
        assert y.data_ptr() == x.data_ptr(), f"{name} was copied"
        assert y.shape == (x.shape[0], x.shape[2], x.shape[1], x.shape[3])
        assert y.stride() == (x.stride(0), x.stride(2), x.stride(1), x.stride(3))
    assert seen["kw"]["alignment"] == "top_left" and seen["kw"]["causal"] is True
    assert out.shape == (2, 4, 5, 8)
    # The output is a view of fmha's (batch, seqlen, heads, head_dim) result.
    assert out.stride() == (5 * 4 * 8, 8, 4 * 8, 1)


# ---------------------------------------------------------------- rows that see nothing

def test_fully_masked_row_gives_zero_not_nan():
    q, k, v = randn(1, 2, 4, 8), randn(1, 2, 6, 8, seed=1), randn(1, 2, 6, 8, seed=2)
    m = torch.ones(4, 6, dtype=torch.bool)
    m[2] = False
    out = fmha.scaled_dot_product_attention(q, k, v, attn_mask=m)
    assert torch.equal(out[:, :, 2], torch.zeros(1, 2, 8, dtype=F64))
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.equal(q.grad[:, :, 2], torch.zeros(1, 2, 8,
                                                                                       dtype=F64))
    # The other rows are unaffected.
    ref = F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), attn_mask=m)
    keep = [0, 1, 3]
    torch.testing.assert_close(out.detach()[:, :, keep], ref[:, :, keep])


# ---------------------------------------------------------------- dropout

def test_dropout_reproducible_and_unbiased():
    # q = k = 0: every key gets probability 1/S; v = 1: each output element is
    # (kept keys / S) / (1 - p), whose mean over many rows is 1 and whose spread tells that
    # a fraction p of the weights was dropped.
    p, S = 0.25, 256
    q = torch.zeros(2, 4, 64, 8)
    k = torch.zeros(2, 4, S, 8)
    v = torch.ones(2, 4, S, 8)
    torch.manual_seed(1)
    a = fmha.scaled_dot_product_attention(q, k, v, dropout_p=p)
    torch.manual_seed(1)
    b = fmha.scaled_dot_product_attention(q, k, v, dropout_p=p)
    torch.manual_seed(2)
    c = fmha.scaled_dot_product_attention(q, k, v, dropout_p=p)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    kept = a[..., 0] * (1 - p)                       # fraction of keys kept, per row
    assert abs(kept.mean().item() - (1 - p)) < 0.01  # 32768 Bernoulli draws: sd 0.0024
    # The per-row spread of a binomial(S, 1-p) / S fraction: sqrt(p (1-p) / S) = 0.027.
    assert 0.02 < kept.std().item() < 0.035
    # dropout_p = 0 is exactly the deterministic result.
    torch.testing.assert_close(fmha.scaled_dot_product_attention(q, k, v, dropout_p=0.0),
                               torch.ones(2, 4, 64, 8))


# ---------------------------------------------------------------- errors

def test_causal_with_mask_raises():
    q = randn(1, 2, 4, 8, grad=False)
    with pytest.raises(ValueError, match="is_causal"):
        fmha.scaled_dot_product_attention(q, q, q, attn_mask=bool_mask(4, 4), is_causal=True)


@pytest.mark.parametrize("call,exc,match", [
    (lambda q: fmha.scaled_dot_product_attention(q, q[:, :2], q[:, :2]), ValueError,
     "enable_gqa"),
    (lambda q: fmha.scaled_dot_product_attention(q, q[:, :3], q[:, :3], enable_gqa=True),
     ValueError, "multiple"),
    (lambda q: fmha.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(5, 5,
                                                                               dtype=torch.int32)),
     TypeError, "attn_mask"),
    (lambda q: fmha.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(5, 5).half()),
     TypeError, "attn_mask"),
    (lambda q: fmha.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(5, 6,
                                                                               dtype=torch.bool)),
     ValueError, "attn_mask"),
    (lambda q: fmha.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(
        1, 1, 1, 5, 5, dtype=torch.bool)), ValueError, "attn_mask"),
    (lambda q: fmha.scaled_dot_product_attention(q, q[:1].expand(3, -1, -1, -1),
                                                 q[:1].expand(3, -1, -1, -1)),
     ValueError, "broadcast"),
    (lambda q: fmha.scaled_dot_product_attention(q, q, q, dropout_p=1.0), ValueError,
     "dropout_p"),
    (lambda q: fmha.scaled_dot_product_attention(q.numpy(), q, q), TypeError, "query"),
    (lambda q: fmha.scaled_dot_product_attention(q[0, 0, 0], q, q), ValueError, "query"),
])
def test_errors(call, exc, match):
    q = randn(2, 4, 5, 8, grad=False)
    with pytest.raises(exc, match=match):
        call(q)


# ---------------------------------------------------------------- torch.compile

class SDPABlock(torch.nn.Module):
    """Self-attention on (batch, heads, seq, dim) through the SDPA entry point (GQA + mask)
    or fmha.attention on (batch, seq, heads, dim) views."""

    def __init__(self, entry, dim=16, heads=4, kv_heads=2):
        super().__init__()
        self.entry, self.heads, self.kv_heads, self.hd = entry, heads, kv_heads, dim // heads
        self.q = torch.nn.Linear(dim, dim)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.hd)
        self.o = torch.nn.Linear(dim, dim)

    def forward(self, x, pad):
        b, n, dim = x.shape
        q = self.q(x).view(b, n, self.heads, self.hd)
        k, v = self.kv(x).view(b, n, 2, self.kv_heads, self.hd).unbind(2)
        if self.entry == "sdpa":
            out = fmha.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                attn_mask=pad[:, None, None, :], enable_gqa=True, scale=0.3).transpose(1, 2)
        else:
            out = fmha.attention(q, k, v, causal=True, mask=pad[:, None, None, :])
        return self.o(out.reshape(b, n, dim))


@pytest.mark.parametrize("entry", ["sdpa", "attention"])
def test_compile_fullgraph(entry):
    torch.manual_seed(0)
    model = SDPABlock(entry)
    x = torch.randn(2, 9, 16, requires_grad=True)
    pad = torch.ones(2, 9, dtype=torch.bool)
    pad[1, 6:] = False
    compile_and_compare(model, x, pad, require_grads=False)
