"""Block-sparse masks in the kernels (fmha.BlockMask; docs/semantics.md, "Block-sparse
masks"): a call with a BlockMask is the call with its dense bool mask, bit for bit on the CPU
(skipping a tile that the mask leaves empty adds exact zeros nowhere), forward and backward,
for every builder and composed with causal / window / bias / ALiBi / softcap / dropout /
GQA; the float64 reference agrees; bad block masks are refused by name; the CUDA kernels
under the emulator give the dense mask's bits too. (The builders themselves:
tests/kernels/test_block_mask_build.py.)
"""

from __future__ import annotations

import numpy as np
import pytest

import fmha
from fmha import block_mask as bm_module
from fmha import reference

torch = pytest.importorskip("torch")

B, N, HQ, HKV, D = 2, 200, 4, 2, 32


def masks(n=N, block_size=64):
    """One BlockMask of each builder for an (n, n) attention: name -> BlockMask."""
    doc = np.repeat(np.arange(5), -(-n // 5))[:n]
    per_head = bm_module.create_block_mask(
        lambda b, h, q, k: ((q + 3 * h + b) % 7 < 4) | (k < q - 50), B, HQ, n, n, block_size)
    return {
        "document": fmha.document_mask(doc, block_size=block_size),
        "document-causal": fmha.document_mask(doc, block_size=block_size, causal=True),
        "longformer": fmha.longformer_mask(n, 60, [0, 101], block_size=block_size),
        "bigbird": fmha.bigbird_mask(n, 40, [7], random_blocks=1, seed=3,
                                     block_size=block_size),
        "causal": bm_module.causal_mask(n, block_size=block_size),
        "per-batch-head": per_head,
    }


COMPOSED = {
    "plain": {},
    "causal": dict(causal=True),
    "window": dict(window=(30, 10)),
    "softcap-alibi": dict(softcap=3.0, alibi=True),
    "bias": dict(bias=True),
    "dropout": dict(dropout_p=0.2),
}


def run(q, k, v, mask_kw, kw, seed=1):
    """(out, lse, dq, dk, dv[, dbias]) of fmha.attention with torch autograd."""
    kw = dict(kw)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = torch.linspace(0.1, 0.8, q.shape[2], dtype=torch.float64)
    if kw.pop("bias", False):
        g = torch.Generator().manual_seed(5)
        kw["bias"] = torch.randn(1, q.shape[2], q.shape[1], k.shape[1], generator=g,
                                 dtype=q.dtype).requires_grad_()
        leaves.append(kw["bias"])
    torch.manual_seed(seed)  # the dropout mask
    out, lse = fmha.attention(*leaves[:3], return_lse=True, **mask_kw, **kw)
    g = torch.Generator().manual_seed(6)
    (out.float() * torch.randn(out.shape, generator=g)).sum().backward()
    return [out, lse] + [x.grad for x in leaves]


def inputs(dtype, n=N, seed=0, b=B, hq=HQ, hkv=HKV, d=D, sk=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, n, hq, d, generator=g).to(dtype)
    k, v = (torch.randn(b, sk or n, hkv, d, generator=g).to(dtype) for _ in range(2))
    return q, k, v


def assert_same_bits(got, want):
    for i, (x, y) in enumerate(zip(got, want)):
        assert x.dtype == y.dtype and torch.equal(x, y), f"result {i}"


@pytest.mark.parametrize("composed", list(COMPOSED))
@pytest.mark.parametrize("family", list(masks()))
def test_cpu_equals_the_dense_mask_bitwise(family, composed):
    bm = masks()[family]
    dense = torch.from_numpy(bm.to_dense())
    q, k, v = inputs(torch.float32)
    kw = COMPOSED[composed]
    assert_same_bits(run(q, k, v, dict(block_mask=bm), kw), run(q, k, v, dict(mask=dense), kw))


@pytest.mark.parametrize("block_size", [(32, 48), 16, (128, 256)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_bitwise_for_other_block_sizes_and_dtypes(block_size, dtype):
    """Blocks smaller than, unaligned with or larger than the kernels' tiles; 16-bit inputs
    (the bfloat16 pair path)."""
    for family in ("bigbird", "per-batch-head"):
        bm = masks(block_size=block_size)[family]
        q, k, v = inputs(dtype)
        kw = dict(causal=True)
        assert_same_bits(run(q, k, v, dict(block_mask=bm), kw),
                         run(q, k, v, dict(mask=torch.from_numpy(bm.to_dense())), kw))


@pytest.mark.parametrize("sq,sk", [(70, 150), (3, 300), (150, 40)])
def test_cross_attention_and_decode_shapes(sq, sk):
    """seqlen_q != seqlen_k, including a few query rows (the CPU's decode-shaped path, which
    tests every pair of the mask instead of skipping tiles) and a bool mask beside it."""
    bm = bm_module.create_block_mask(lambda b, h, q, k: (k // 5 + q) % 3 != 0, None, HQ, sq, sk,
                                     (16, 32))
    q, k, v = inputs(torch.float32, n=sq, sk=sk)
    pad = torch.ones(B, 1, 1, sk, dtype=torch.bool)
    pad[1, ..., sk // 2:] = False
    want = run(q, k, v, dict(mask=torch.from_numpy(bm.to_dense()) & pad), {})
    assert_same_bits(run(q, k, v, dict(block_mask=bm, mask=pad), {}), want)


def test_float64_reference_and_numpy_backward():
    """The NumPy path (attention, attention_backward with block_mask) against the float64
    reference with the dense mask; rows that see no key get out 0 and lse -inf."""
    rng = np.random.default_rng(0)
    n = 90
    doc = np.repeat([0, 1, 2], 30)
    bm = bm_module.create_block_mask(lambda b, h, q, k: (doc[q] == doc[k]) & (q >= 30), None,
                                     None, n, n, 32)
    q, k, v = (rng.standard_normal((1, n, 2, 8)) for _ in range(3))
    out, lse = fmha.attention(q, k, v, block_mask=bm, return_lse=True, softcap=2.0)
    dense = bm.to_dense()
    r_out, r_lse = reference.attention_forward(q, k, v, mask=dense, softcap=2.0)
    np.testing.assert_allclose(out, r_out, rtol=1e-10, atol=1e-10)
    np.testing.assert_array_equal(lse[:, :, :30], -np.inf)
    np.testing.assert_array_equal(out[:, :30], 0.0)
    np.testing.assert_allclose(lse[:, :, 30:], r_lse[:, :, 30:], rtol=1e-10, atol=1e-10)
    dout, dlse = rng.standard_normal(out.shape), rng.standard_normal(lse.shape)
    got = fmha.attention_backward(dout, q, k, v, out, lse, block_mask=bm, softcap=2.0, dlse=dlse)
    want = reference.attention_backward(dout, q, k, v, mask=dense, softcap=2.0, dlse=dlse)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-10)


def test_bad_block_masks_are_refused():
    q, k, v = inputs(torch.float32, n=64)
    with pytest.raises(TypeError, match="block_mask: expected an fmha.BlockMask"):
        fmha.attention(q, k, v, block_mask=torch.ones(64, 64, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"block_mask: shape \(1, 1, 64, 65\) does not fit"):
        fmha.attention(q, k, v, block_mask=bm_module.causal_mask(64, 65))
    with pytest.raises(ValueError, match="block_mask: shape"):  # 3 heads for 4
        fmha.attention(q, k, v, block_mask=bm_module.create_block_mask(
            lambda b, h, i, j: i >= j, None, 3, 64, 64))
    # The core's own checks, for callers below the Python layer.
    x, y, z = (t.numpy() for t in (q, k, v))
    out, lse = np.empty_like(x), np.empty((B, HQ, 64), np.float32)
    index = np.full((1, 1, 2, 2), 5, np.int32)
    partial = np.zeros((1, 32, 32), np.uint8)
    settings = dict(scale=0.1, softcap=0.0, window_left=-1, window_right=-1, bottom_right=True,
                    dropout_p=0.0)
    with pytest.raises(ValueError, match="block_index: entry 5 is neither"):
        fmha._C.forward(x, y, z, out, lse, block_index=index, block_masks=partial, **settings)
    with pytest.raises(ValueError, match="block_index, block_masks: give both"):
        fmha._C.forward(x, y, z, out, lse, block_index=index, **settings)
    with pytest.raises(ValueError, match="block_mask: 2 x 2 blocks of 16 x 32 do not tile"):
        fmha._C.forward(x, y, z, out, lse, block_index=np.full((1, 1, 2, 2), -2, np.int32),
                        block_masks=np.zeros((0, 16, 32), np.uint8), **settings)
    with pytest.raises(ValueError, match="block_index: expected int32"):
        fmha._C.forward(x, y, z, out, lse, block_index=index.astype(np.int64),
                        block_masks=partial, **settings)


@pytest.mark.backends("emu", "gpu")
@pytest.mark.parametrize("family,kw", [("document-causal", dict(deterministic=True)),
                                       ("bigbird", dict(dropout_p=0.25, softcap=4.0))])
def test_cuda_kernels_equal_the_dense_mask(backend, family, kw):
    """The CUDA forward, backward (atomic and deterministic dQ) skip the empty tiles: same
    bits as with the dense mask, at block sizes across the kernels' 64-row tiles."""
    n = 130
    bm = masks(n, block_size=(32, 48))[family]
    q, k, v = inputs(torch.float16, n=n, b=1, hq=2, hkv=1, d=16)
    assert_same_bits(run(q, k, v, dict(block_mask=bm), kw),
                     run(q, k, v, dict(mask=torch.from_numpy(bm.to_dense())), kw))
