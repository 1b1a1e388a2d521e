"""One block of a larger attention, as fmha.distributed runs them: the kernels told where the
block's queries, keys and heads sit in the whole attention (q_position, k_position,
head_position, heads_total: csrc/fmha/params.h) must give the whole attention's result
restricted to the block's keys — causal, window and ALiBi at the whole sequence's positions,
dropout with the whole attention's mask. Judged against the float64 reference of the whole
attention with the other keys masked out, forward and backward (with a gradient through lse),
on the CPU kernels and the CUDA kernels (emulated, or on a GPU)."""

import numpy as np
import pytest
import torch

from fmha import _torch, reference

pytestmark = [pytest.mark.backends("cpu", "emu", "gpu"), pytest.mark.usefixtures("backend")]

# Whole attention: (seqlen, heads_q, heads_kv, head_dim); block: query rows (first, count),
# key rows (first, count), query heads (first, count).
CASES = {
    "below the diagonal, causal": dict(whole=(48, 2, 2, 16), rows=(32, 16), keys=(8, 12),
                                       heads=(0, 2), causal=True),
    "on the diagonal, causal": dict(whole=(40, 2, 1, 16), rows=(20, 12), keys=(20, 12),
                                    heads=(0, 2), causal=True),
    "window crossing the block": dict(whole=(64, 2, 2, 32), rows=(36, 20), keys=(16, 24),
                                      heads=(0, 2), window=(10, 3)),
    "alibi at whole positions": dict(whole=(40, 4, 2, 16), rows=(4, 16), keys=(24, 16),
                                     heads=(2, 2), alibi=True, softcap=5.0),
    "dropout at whole coordinates": dict(whole=(48, 4, 2, 16), rows=(12, 20), keys=(8, 28),
                                         heads=(2, 2), dropout_p=0.3, causal=True),
    "head shard, dropout, window": dict(whole=(32, 4, 4, 8), rows=(0, 32), keys=(0, 32),
                                        heads=(1, 2), dropout_p=0.2, window=(6, 6)),
}


def _block_call(backend, case, dtype):
    n, hq, hkv, d = case["whole"]
    g = hq // hkv
    torch.manual_seed(sum(map(ord, backend)) + n)
    q = torch.randn(1, n, hq, d, dtype=torch.float64)
    k = torch.randn(1, n, hkv, d, dtype=torch.float64)
    v = torch.randn(1, n, hkv, d, dtype=torch.float64)
    q, k, v = (x.to(dtype).to(torch.float64) for x in (q, k, v))  # exact in dtype
    (q0, nq), (k0, nk), (h0, nh) = case["rows"], case["keys"], case["heads"]
    left, right = case.get("window", (-1, -1))
    if case.get("causal"):
        right = 0
    slopes = (torch.linspace(0.1, 0.8, hq, dtype=torch.float64) if case.get("alibi") else None)
    p = case.get("dropout_p", 0.0)
    rng = torch.tensor([1234567, 89], dtype=torch.int64) if p else None
    rows, keys, heads = slice(q0, q0 + nq), slice(k0, k0 + nk), slice(h0, h0 + nh)
    kv_heads = slice(h0 // g, (h0 + nh) // g)
    settings = dict(scale=d ** -0.5, softcap=case.get("softcap", 0.0))
    qb, kb, vb = (x.to(dtype).contiguous() for x in (q[:, rows, heads], k[:, keys, kv_heads],
                                                     v[:, keys, kv_heads]))
    sl = None if slopes is None else slopes[heads].contiguous()
    block = (q0, k0, h0, hq)
    out, lse = _torch._fwd(qb, kb, vb, None, None, sl, None, None, 0, 0, rng,
                           settings["scale"], settings["softcap"], left, right, False, p,
                           False, 0, *block)
    dout = torch.randn(out.shape, dtype=torch.float64).to(dtype)
    dlse = torch.randn(lse.shape, dtype=torch.float32)
    dq, dk, dv, _ = _torch.bwd(dout, qb, kb, vb, out, lse, None, None, sl, None, None, 0, 0,
                               rng, settings["scale"], settings["softcap"], left, right, False,
                               p, False, False, dlse, *block)

    # The whole attention, its keys outside the block masked out.
    mask = np.zeros((1, 1, 1, n), dtype=bool)
    mask[..., keys] = True
    ref_kw = dict(scale=settings["scale"], softcap=settings["softcap"], window=(left, right),
                  alignment="top_left", mask=mask,
                  alibi_slopes=None if slopes is None else slopes.numpy(), dropout_p=p,
                  seed=0 if rng is None else int(rng[0]), offset=0 if rng is None else int(rng[1]))
    q64, k64, v64 = q.numpy(), k.numpy(), v.numpy()
    ref_out, ref_lse = reference.attention_forward(q64, k64, v64, **ref_kw)
    whole_dout = np.zeros(ref_out.shape)
    whole_dout[:, rows, heads] = dout.double().numpy()
    whole_dlse = np.zeros(ref_lse.shape)
    whole_dlse[:, heads, rows] = dlse.double().numpy()
    ref_dq, ref_dk, ref_dv = reference.attention_backward(whole_dout, q64, k64, v64,
                                                          dlse=whole_dlse, **ref_kw)[:3]
    got = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
    want = dict(out=ref_out[:, rows, heads], lse=ref_lse[:, heads, rows],
                dq=ref_dq[:, rows, heads], dk=ref_dk[:, keys, kv_heads],
                dv=ref_dv[:, keys, kv_heads])
    return got, want


@pytest.mark.parametrize("name", list(CASES))
def test_block_of_a_larger_attention(backend, name):
    # The CUDA kernels take 16-bit inputs; the CPU kernels are judged in float32.
    dtype = torch.float32 if backend == "cpu" else torch.float16
    got, want = _block_call(backend, CASES[name], dtype)
    # float32: the usual 1e-5 of the largest entry; float16: a few units of its rounding
    # (2^-11 relative), far below the O(1) error of a misplaced block.
    rel = 2e-5 if dtype == torch.float32 else 8e-3
    for key, ref in want.items():
        actual = got[key].double().numpy()
        assert actual.shape == ref.shape, key
        assert np.array_equal(np.isinf(actual), np.isinf(ref)), key
        finite = np.isfinite(ref)
        err = np.abs(actual[finite] - ref[finite]).max(initial=0.0)
        bound = rel * max(np.abs(ref[finite]).max(initial=0.0), 1.0)
        assert err <= bound, f"{name}, {key}: max error {err:.3g} > {bound:.3g}"


@pytest.mark.backends("cpu")  # refused before any kernel: one backend suffices
def test_dropout_block_must_start_on_a_group_of_four_keys():
    q = torch.randn(1, 8, 1, 8)
    rng = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="k_position: expected a multiple of 4 with dropout"):
        _torch._fwd(q, q, q, None, None, None, None, None, 0, 0, rng, 1.0, 0.0, -1, -1, False,
                    0.5, False, 0, 0, 6, 0, 0)


@pytest.mark.backends("cpu")
def test_heads_total_covers_the_block():
    q = torch.randn(1, 8, 2, 8)
    with pytest.raises(ValueError, match="heads_total"):
        _torch._fwd(q, q, q, None, None, None, None, None, 0, 0, None, 1.0, 0.0, -1, -1, False,
                    0.0, False, 0, 0, 0, 3, 4)
