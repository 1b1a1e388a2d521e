"""The CPU backend's correctness cases, run by the CUDA kernels under the SIMT emulator.

The `kernels` fixture swaps the module behind fmha's Python API (fmha._api._kernels, normally
fmha._C) for fmha._cuda_emu, whose forward/backward take the same arguments and run the CUDA
kernels (csrc/cuda, compiled as host C++) on host arrays. So the public entry points --
fmha.attention with NumPy arrays and torch CPU tensors, attention_varlen,
attention_backward and torch autograd -- drive the CUDA forward and backward here, and the
cases, helpers and tolerance rule of tests/test_cpu_attention.py (conftest.assert_close:
2x / 3x the error of a naive low-precision computation) judge them.

Restricted to what the CUDA kernels take (float16 / bfloat16, head_dim <= 256) and to small
shapes: the emulator runs one OS thread per CUDA thread, about 0.15 s per (query tile, key
tile, head, batch) step, so seqlens stay <= ~130 and most cases fit one 64-row tile.
Each feature runs in one of the low-precision (lib, dtype) pairs, rotating over the table,
so NumPy (attention_backward) and torch (autograd) paths both see every feature family.

tests/test_cuda_gpu.py re-runs this file's tests with the kernel module replaced by a shim
that runs them on a real GPU.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import fmha
import test_cpu_attention as cpu
from conftest import (assert_close, check_against_reference, fmha_results, from_f64,
                      make_array, to_f64)
from fmha import _philox, reference
from fmha._api import _kernel_module

torch = pytest.importorskip("torch")  # the naive low-precision baseline (and bfloat16)


def _emulator():
    try:
        from fmha import _cuda_emu
    except ImportError:
        pytest.skip("fmha._cuda_emu is not built (FMHA_BUILD_EMULATOR=OFF)")
    return _cuda_emu


@pytest.fixture(autouse=True)
def kernels():
    """Every fmha call of a test runs the emulated CUDA kernels."""
    emu = _emulator()
    with _kernel_module(emu):
        yield emu


@pytest.fixture
def host_recovery(monkeypatch):
    """The torch dropout tests recover the mask with a float64 identity-V call, which only the
    CPU kernels take: run that one call on the CPU path. The comparison then also proves that
    the CUDA kernels apply the very mask the CPU path applies for the same torch seed."""
    original = cpu._recover_dropout_z

    def recover_on_cpu(*args, **kw):
        with _kernel_module(fmha._C):
            return original(*args, **kw)

    monkeypatch.setattr(cpu, "_recover_dropout_z", recover_on_cpu)


# (lib, dtype) pairs the CUDA kernels take. numpy has no bfloat16.
LOW = [("numpy", "float16"), ("torch", "bfloat16"), ("torch", "float16")]


def rotate(values, pairs=LOW):
    """[(value, lib, dtype)]: each value with the next (lib, dtype) pair, cycling."""
    return [(v,) + p for v, p in zip(values, itertools.cycle(pairs))]


def _ids(rows):
    return ["-".join(str(x) for x in r) for r in rows]


# ============================================================================ dtypes, scale

@pytest.mark.parametrize("lib,dtype", LOW, ids=cpu._ids(LOW))
def test_dtypes(rng, lib, dtype):
    q, k, v, do = cpu.inputs(rng, lib, dtype, 1, 37, 45, 2, 1, 64)
    check_against_reference(q, k, v, do)


SCALES = rotate([0.37, -0.8, 2.0])


@pytest.mark.parametrize("scale,lib,dtype", SCALES, ids=_ids(SCALES))
def test_explicit_scale(rng, lib, dtype, scale):
    cpu.test_explicit_scale(rng, lib, dtype, scale)


# ============================================================================ online softmax

RESCALE = rotate(list(itertools.product(["increasing", "decreasing", "large"],
                                        [False, True])))


@pytest.mark.parametrize("case,lib,dtype", RESCALE, ids=_ids(RESCALE))
def test_online_softmax_rescaling(rng, lib, dtype, case):
    """Scores that force the running max to move across three key tiles (sk = 130)."""
    pattern, causal = case
    q, k, v, do = cpu._score_pattern_inputs(rng, lib, dtype, pattern, b=1, sq=40, sk=130, h=1)
    check_against_reference(q, k, v, do, causal=causal)


MASKED = rotate(list(cpu.MASKED_TILES))


@pytest.mark.parametrize("case,lib,dtype", MASKED, ids=_ids(MASKED))
def test_fully_masked_tiles(rng, lib, dtype, case):
    """cpu.MASKED_TILES on a 130-key axis: whole 64-key tiles masked before / after the keys
    a row sees (window bands, key padding, a -inf bias prefix)."""
    b, sq, sk, h = 2, 20, 130, 1
    q, k, v, do = cpu.inputs(rng, lib, dtype, b, sq, sk, h, 1, 32)
    cfg = dict(cpu.MASKED_TILES[case])
    kw = {kk: vv for kk, vv in cfg.items() if kk not in ("mask", "bias")}
    bias = None
    if cfg.get("mask") == "leading":
        m = np.ones((b, 1, 1, sk), bool)
        m[0, ..., :100] = False
        m[1, ..., :64] = False
        kw["mask"] = cpu.bool_array(m, lib)
    elif cfg.get("mask") == "trailing":
        m = np.ones((b, 1, 1, sk), bool)
        m[0, ..., 3:] = False
        m[1, ..., 65:] = False
        kw["mask"] = cpu.bool_array(m, lib)
    elif cfg.get("bias") == "prefix":
        bias64 = rng.standard_normal((b, h, sq, sk))
        bias64[0, :, ::3, :70] = -np.inf
        bias64[1, 0, 5:15, :129] = -np.inf
        bias = from_f64(bias64, dtype, lib)
    check_against_reference(q, k, v, do, bias=bias, bias_grad=bias is not None, **kw)


# ============================================================================ causal, GQA, lengths

CAUSAL = rotate(list(itertools.product(cpu.CAUSAL_LENGTHS, ["bottom_right", "top_left"])))


@pytest.mark.parametrize("case,lib,dtype", CAUSAL, ids=_ids(CAUSAL))
def test_causal(rng, lib, dtype, case):
    (sq, sk), alignment = case
    cpu.test_causal(rng, lib, dtype, sq, sk, alignment)


GQA = rotate([(4, 4), (4, 2), (4, 1), (3, 1)])


@pytest.mark.parametrize("heads,lib,dtype", GQA, ids=_ids(GQA))
def test_gqa_mqa(rng, lib, dtype, heads):
    hq, hkv = heads
    q, k, v, do = cpu.inputs(rng, lib, dtype, 1, 29, 31, hq, hkv, 32)
    check_against_reference(q, k, v, do)
    check_against_reference(q, k, v, do, causal=True)


CROSS = rotate(cpu.CROSS)


@pytest.mark.parametrize("lengths,lib,dtype", CROSS, ids=_ids(CROSS))
def test_cross_lengths(rng, lib, dtype, lengths):
    cpu.test_cross_lengths(rng, lib, dtype, *lengths)


@pytest.mark.parametrize("lib,dtype", LOW[:2], ids=cpu._ids(LOW[:2]))
def test_causal_bottom_right_sq_gt_sk_empty_rows(rng, lib, dtype):
    """Rows that see no key: out 0, lse -inf, gradients 0, no NaN."""
    cpu.test_causal_bottom_right_sq_gt_sk_empty_rows(rng, lib, dtype)


ODD_SEQ = rotate([1, 17, 64, 65, 113])


@pytest.mark.parametrize("seqlen,lib,dtype", ODD_SEQ, ids=_ids(ODD_SEQ))
def test_odd_seqlen(rng, lib, dtype, seqlen):
    q, k, v, do = cpu.inputs(rng, lib, dtype, 1, seqlen, seqlen, 2, 1, 32)
    check_against_reference(q, k, v, do)
    if seqlen > 1:
        check_against_reference(q, k, v, do, causal=True)


# ============================================================================ head dims

HEAD_DIMS = rotate([1, 3, 8, 17, 40, 59, 64, 96, 111, 128, 160, 200, 256])


@pytest.mark.parametrize("head_dim,lib,dtype", HEAD_DIMS, ids=_ids(HEAD_DIMS))
def test_head_dim(rng, lib, dtype, head_dim):
    q, k, v, do = cpu.inputs(rng, lib, dtype, 1, 33, 47, 2, 1, head_dim)
    check_against_reference(q, k, v, do, causal=True)


DV = rotate(cpu.DV)


@pytest.mark.parametrize("dims,lib,dtype", DV, ids=_ids(DV))
def test_head_dim_v(rng, lib, dtype, dims):
    d, dv = dims
    q, k, v, do = cpu.inputs(rng, lib, dtype, 1, 21, 30, 2, 1, d, dv)
    check_against_reference(q, k, v, do)


# ============================================================================ layouts

@pytest.mark.parametrize("kind", cpu.NONCONTIG)
def test_noncontiguous_torch(rng, kind):
    """Strided views give the reference result and exactly the contiguous call's result."""
    b, sq, sk, hq, hkv, d = 1, 19, 26, 4, 2, 24
    q, k, v, do = (cpu._layouts_torch(rng.standard_normal(s), kind, "bfloat16")
                   for s in ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d), (b, sq, hq, d)))
    assert not q.is_contiguous() and not k.is_contiguous() and not v.is_contiguous()
    res, _ = check_against_reference(q, k, v, do, causal=True)
    cres = fmha_results(q.contiguous(), k.contiguous(), v.contiguous(), do.contiguous(),
                        causal=True)
    for key in ("out", "lse", "dq", "dk", "dv"):
        assert torch.equal(res[key], cres[key]), key


def test_noncontiguous_numpy(rng):
    b, sq, sk, hq, hkv, d = 1, 19, 26, 4, 1, 24
    q, k, v, do = (cpu._layouts_numpy(rng.standard_normal(s), "transposed").astype(np.float16)
                   for s in ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d), (b, sq, hq, d)))
    assert not q.flags.c_contiguous
    res, _ = check_against_reference(q, k, v, do, causal=True, alignment="top_left")
    cres = fmha_results(*(np.ascontiguousarray(x) for x in (q, k, v, do)), causal=True,
                        alignment="top_left")
    for key in ("out", "lse", "dq", "dk", "dv"):
        assert np.array_equal(res[key], cres[key]), key


def test_combination_cross_odd_noncontiguous(rng):
    """sq != sk, an odd head dim, sliced views, GQA, causal top-left, bias."""
    b, sq, sk, hq, hkv, d = 1, 113, 17, 2, 1, 59
    conv = lambda x: cpu._layouts_torch(x, "sliced", "bfloat16")  # noqa: E731
    q, k, v, do = (conv(rng.standard_normal(s))
                   for s in ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d), (b, sq, hq, d)))
    assert not q.is_contiguous()
    bias = cpu.extra_array(rng, (b, 1, sq, sk), "torch", "bfloat16")
    check_against_reference(q, k, v, do, causal=True, alignment="top_left", bias=bias,
                            bias_grad=True)


# ============================================================================ bias, mask

BIAS = rotate(list(cpu.BIAS_SHAPES))


@pytest.mark.parametrize("shape_name,lib,dtype", BIAS, ids=_ids(BIAS))
def test_bias_shapes(rng, lib, dtype, shape_name):
    b, sq, sk, hq, hkv = 2, 21, 27, 2, 1
    q, k, v, do = cpu.inputs(rng, lib, dtype, b, sq, sk, hq, hkv, 32)
    bias = cpu.extra_array(rng, cpu.BIAS_SHAPES[shape_name](b, hq, sq, sk), lib, dtype,
                           scale=2.0)
    check_against_reference(q, k, v, do, bias=bias, bias_grad=True)


@pytest.mark.parametrize("lib,dtype", LOW[:2], ids=cpu._ids(LOW[:2]))
def test_bias_without_grad(rng, lib, dtype):
    cpu.test_bias_without_grad(rng, lib, dtype)


MASKS = rotate(list(cpu.MASK_SHAPES))


@pytest.mark.parametrize("shape_name,lib,dtype", MASKS, ids=_ids(MASKS))
def test_mask_shapes(rng, lib, dtype, shape_name):
    cpu.test_mask_shapes(rng, lib, dtype, shape_name)


@pytest.mark.parametrize("lib,dtype", LOW[:2], ids=cpu._ids(LOW[:2]))
def test_mask_with_fully_masked_rows(rng, lib, dtype):
    cpu.test_mask_with_fully_masked_rows(rng, lib, dtype)


@pytest.mark.parametrize("lib,dtype", LOW[:2], ids=cpu._ids(LOW[:2]))
def test_neg_inf_bias_rows(rng, lib, dtype):
    cpu.test_neg_inf_bias_rows(rng, lib, dtype)


@pytest.mark.parametrize("lib,dtype", LOW[:2], ids=cpu._ids(LOW[:2]))
def test_everything_masked(rng, lib, dtype):
    """Every key masked for every row: outputs and gradients exactly 0, lse -inf."""
    q, k, v, do = cpu.inputs(rng, lib, dtype, 1, 7, 9, 2, 1, 16)
    m = cpu.bool_array(np.zeros((1, 1, 7, 9), bool), lib)
    bias = cpu.extra_array(rng, (7, 9), lib, dtype)
    res = fmha_results(q, k, v, do, mask=m, bias=bias, bias_grad=True)
    assert np.all(np.isneginf(to_f64(res["lse"])))
    for key in ("out", "dq", "dk", "dv", "dbias"):
        assert np.all(to_f64(res[key]) == 0), key


# ============================================================================ window, ALiBi, softcap

WINDOW = rotate(list(itertools.product(cpu.WIN_LENGTHS, cpu.WINDOWS,
                                       ["bottom_right", "top_left"])))


@pytest.mark.parametrize("case,lib,dtype", WINDOW, ids=_ids(WINDOW))
def test_window(rng, lib, dtype, case):
    (sq, sk), window, alignment = case
    cpu.test_window(rng, lib, dtype, sq, sk, window, alignment)


@pytest.mark.parametrize("alignment", ["bottom_right", "top_left"])
def test_window_with_causal(rng, alignment):
    cpu.test_window_with_causal(rng, "torch", "float16", alignment)


ALIBI = rotate(list(itertools.product(["h", "b_h"], [False, True],
                                      ["bottom_right", "top_left"])))


@pytest.mark.parametrize("case,lib,dtype", ALIBI, ids=_ids(ALIBI))
def test_alibi(rng, lib, dtype, case):
    slopes_shape, causal, alignment = case
    cpu.test_alibi(rng, lib, dtype, slopes_shape, causal, alignment)


SOFTCAP = rotate([0.5, 5.0, 30.0])


@pytest.mark.parametrize("softcap,lib,dtype", SOFTCAP, ids=_ids(SOFTCAP))
def test_softcap(rng, lib, dtype, softcap):
    cpu.test_softcap(rng, lib, dtype, softcap)


# ============================================================================ dropout

@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_numpy_matches_reference(rng, p):
    """NumPy: the mask is Philox(seed, offset 0), forward and backward equal the reference."""
    cpu.test_dropout_numpy_matches_reference(rng, "float16", p)


@pytest.mark.parametrize("seed", [0, 1, 2**32 + 5, 2**63 + 12345, 2**64 - 1],
                         ids=["0", "1", "2^32+5", "2^63+12345", "2^64-1"])
def test_dropout_numpy_seeds(rng, seed):
    """Seeds with high 32-bit words (the Philox key's second word) follow the contract."""
    q, k, v, do = cpu.inputs(rng, "numpy", "float16", 1, 9, 14, 2, 1, 8)
    check_against_reference(q, k, v, do, dropout_p=0.3, seed=seed, causal=True,
                            ref_kw=dict(seed=seed))


def _keep_mask(seed, batch, heads, sq, sk, p):
    """The mask a call applies, read back through its output: q = k = 0 makes every
    probability 1/sk, and v = identity over the keys puts P*Z of key j in column j."""
    q = np.zeros((batch, sq, heads, sk), np.float16)  # head_dim = sk, so that v can be I
    k = np.zeros((batch, sk, heads, sk), np.float16)
    v = np.broadcast_to(np.eye(sk, dtype=np.float16)[None, :, None, :],
                        (batch, sk, heads, sk)).copy()
    out = fmha.attention(q, k, v, dropout_p=p, seed=seed)
    return out.transpose(0, 2, 1, 3) > 0


@pytest.mark.parametrize("p", [0.3, 0.7])
def test_dropout_mask_same_as_cpu_and_contract(p):
    """The same seed gives the same mask from the CUDA kernels as from the CPU kernels, and
    both are fmha._philox's contract."""
    seed = 2**40 + 99
    cuda_mask = _keep_mask(seed, 1, 2, 33, 70, p)
    with _kernel_module(fmha._C):
        cpu_mask = _keep_mask(seed, 1, 2, 33, 70, p)
    assert np.array_equal(cuda_mask, cpu_mask)
    assert np.array_equal(cuda_mask, _philox.dropout_keep_mask(seed, 0, 1, 2, 33, 70, p))


def test_dropout_torch_seed_same_mask_as_cpu():
    """torch: after torch.manual_seed(s) the CUDA kernels and the CPU path drop the same
    elements (the rng pair comes from torch's CPU generator for every device)."""
    def keep(batch=1, heads=2, sq=21, sk=34):
        q = torch.zeros(batch, sq, heads, sk, dtype=torch.bfloat16)
        k = torch.zeros(batch, sk, heads, sk, dtype=torch.bfloat16)
        v = torch.eye(sk, dtype=torch.bfloat16)[None, :, None, :].expand(batch, sk, heads, sk)
        torch.manual_seed(77)
        return (fmha.attention(q, k, v.contiguous(), dropout_p=0.5) > 0).permute(0, 2, 1, 3)

    cuda_mask = keep()
    with _kernel_module(fmha._C):
        cpu_mask = keep()
    assert torch.equal(cuda_mask, cpu_mask)
    assert 0.3 < cuda_mask.float().mean() < 0.7


DROPOUT_TORCH = rotate([0.2, 0.6], LOW[1:])


@pytest.mark.parametrize("p,lib,dtype", DROPOUT_TORCH, ids=_ids(DROPOUT_TORCH))
def test_dropout_torch_matches_recovered_mask(rng, host_recovery, lib, dtype, p):
    cpu._torch_dropout_check(rng, dtype, p, hq=2, hkv=1, d=16, dv=16, causal=True)


# ============================================================================ combinations

# cpu.COMBOS with head_dim_v = head_dim = 40 (the CPU tests use 40 / 24; head_dim_v has its
# own test above).

@pytest.mark.parametrize("combo", list(cpu.COMBOS))
def test_combinations_numpy(rng, combo):
    cfg = cpu.COMBOS[combo]
    q, k, v, do = cpu.inputs(rng, "numpy", "float16", 2, 29, 41, cfg["hq"], cfg["hkv"], 40)
    kw = cpu._combo_args(rng, "numpy", "float16", cfg)
    check_against_reference(q, k, v, do, seed=4242, ref_kw=dict(seed=4242),
                            bias_grad="bias" in kw, **kw)


COMBOS_TORCH = rotate(list(cpu.COMBOS), LOW[1:])


@pytest.mark.parametrize("combo,lib,dtype", COMBOS_TORCH, ids=_ids(COMBOS_TORCH))
def test_combinations_torch(rng, host_recovery, lib, dtype, combo):
    cfg = cpu.COMBOS[combo]
    kw = cpu._combo_args(rng, "torch", dtype, cfg)
    p = kw.pop("dropout_p", 0.0)
    bias = kw.pop("bias", None)
    if p > 0:
        cpu._torch_dropout_check(rng, dtype, p, b=2, sq=29, sk=41, hq=cfg["hq"], hkv=cfg["hkv"],
                                 d=40, dv=40, bias_shape=None if bias is None else
                                 tuple(bias.shape), **kw)
        return
    q, k, v, do = cpu.inputs(rng, "torch", dtype, 2, 29, 41, cfg["hq"], cfg["hkv"], 40)
    check_against_reference(q, k, v, do, bias=bias, bias_grad=bias is not None, **kw)


# ============================================================================ varlen

VARLEN = ([(case, "plain") for case in cpu.VARLEN_CASES]
          + [("mixed", feature) for feature in cpu.VARLEN_FEATURES if feature != "plain"])


@pytest.mark.parametrize("case,feature", VARLEN, ids=_ids(VARLEN))
def test_varlen_torch_autograd(rng, case, feature):
    """cpu.VARLEN_CASES x cpu.VARLEN_FEATURES (head_dim_v = head_dim), torch autograd."""
    lens_q, lens_k = cpu.VARLEN_CASES[case]
    q, k, v, do, cu_q, cu_k = cpu._varlen_inputs(rng, "torch", "bfloat16", lens_q, lens_k, 2,
                                                 1, 24, 24)
    kw = cpu._varlen_kw(rng, "torch", cpu.VARLEN_FEATURES[feature], len(lens_q), 2)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out, lse = fmha.attention_varlen(*leaves, cu_q, cu_k, max(lens_q), max(lens_k),
                                     return_lse=True, **kw)
    out.backward(do)
    rkw = {kk: to_f64(vv) if kk == "alibi_slopes" else vv for kk, vv in kw.items()}
    args64 = [to_f64(x) for x in (q, k, v)]
    ref_out, ref_lse = reference.attention_varlen_forward(*args64, cu_q.numpy(), cu_k.numpy(),
                                                          **rkw)
    ref_grads = reference.attention_varlen_backward(to_f64(do), *args64, cu_q.numpy(),
                                                    cu_k.numpy(), **rkw)
    naive = cpu._naive_varlen(q, k, v, do, cu_q.numpy(), cu_k.numpy(), **kw)
    results = dict(out=out, lse=lse, dq=leaves[0].grad, dk=leaves[1].grad, dv=leaves[2].grad)
    refs = dict(out=ref_out, lse=ref_lse, dq=ref_grads[0], dk=ref_grads[1], dv=ref_grads[2])
    for key in refs:
        assert_close(key, results[key], refs[key], "bfloat16", naive=to_f64(naive[key]),
                     grad=key.startswith("d"), result_dtype="float32" if key == "lse" else None)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_numpy_dropout(rng, causal):
    """Varlen with dropout: sequence b's mask is the batch-index-b mask (NumPy, float16)."""
    lens_q, lens_k = [5, 1, 17, 9], [7, 1, 3, 20]
    q, k, v, _, cu_q, cu_k = cpu._varlen_inputs(rng, "numpy", "float16", lens_q, lens_k, 2,
                                                1, 16, 16)
    seed, p = 2**40 + 77, 0.3
    out, lse = fmha.attention_varlen(q, k, v, cu_q, cu_k, dropout_p=p, seed=seed,
                                     causal=causal, return_lse=True)
    ref_out, ref_lse = reference.attention_varlen_forward(
        to_f64(q), to_f64(k), to_f64(v), cu_q, cu_k, dropout_p=p, seed=seed, causal=causal)
    zs = [torch.from_numpy(_philox.dropout_keep_mask(seed, 0, 1, 2, lq, lk, p,
                                                     batch_index_start=b)[0] / (1 - p))
          for b, (lq, lk) in enumerate(zip(lens_q, lens_k))]
    tq = [torch.from_numpy(x) for x in (q, k, v, np.zeros_like(q))]
    naive = cpu._naive_varlen(*tq, cu_q, cu_k, dropout_z=zs, causal=causal)
    assert_close("out", out, ref_out, "float16", naive=to_f64(naive["out"]))
    assert_close("lse", lse, ref_lse, "float16", naive=to_f64(naive["lse"]),
                 result_dtype="float32")


# ============================================================================ determinism

def test_deterministic_backward_bitwise_over_20_runs(rng):
    """deterministic=True: twenty backward passes give bit-identical dq, dk, dv, dbias."""
    q, k, v, do = cpu.inputs(rng, "numpy", "float16", 1, 70, 90, 2, 1, 32)
    bias = make_array(rng, (1, 2, 70, 90), "float16", "numpy")
    kw = dict(causal=True, softcap=5.0, dropout_p=0.2, seed=5, bias=bias)
    out, lse = fmha.attention(q, k, v, return_lse=True, **kw)
    first = None
    for run in range(20):
        grads = fmha.attention_backward(do, q, k, v, out, lse, bias_grad=True,
                                        deterministic=True, **kw)
        if first is None:
            first = [g.copy() for g in grads]
            continue
        for name, a, b in zip(("dq", "dk", "dv", "dbias"), first, grads):
            assert np.array_equal(a, b, equal_nan=True), f"{name} differs in run {run}"


def test_deterministic_torch_flag_reaches_backward(rng):
    """torch.use_deterministic_algorithms(True) and deterministic=True give the same bits."""
    q, k, v, do = cpu.inputs(rng, "torch", "bfloat16", 1, 40, 50, 2, 2, 32)
    results = []
    for flag, algos in ((True, False), (False, True)):
        before = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(algos)
        try:
            leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
            fmha.attention(*leaves, causal=True, deterministic=flag).backward(do)
            results.append([x.grad for x in leaves])
        finally:
            torch.use_deterministic_algorithms(before)
    for a, b in zip(*results):
        assert torch.equal(a, b)


# ============================================================================ torch vs NumPy

def test_torch_and_numpy_paths_identical(rng):
    """The NumPy and torch entry points hand the kernels the same call: identical bits."""
    b, sq, sk, hq, hkv, d = 1, 45, 38, 4, 2, 40
    qn, kn, vn, don = cpu.inputs(rng, "numpy", "float16", b, sq, sk, hq, hkv, d)
    biasn = make_array(rng, (b, 1, sq, sk), "float16", "numpy")
    maskn = rng.random((1, hq, 1, sk)) < 0.85
    slopes = rng.uniform(0.01, 0.2, (hq,)).astype(np.float32)
    kw = dict(causal=True, alignment="top_left", softcap=6.0, window=(20, -1))
    rn = fmha_results(qn, kn, vn, don, bias=biasn, bias_grad=True, mask=maskn,
                      alibi_slopes=slopes, **kw)
    t = torch.from_numpy
    rt = fmha_results(t(qn), t(kn), t(vn), t(don), bias=t(biasn), bias_grad=True,
                      mask=t(maskn), alibi_slopes=t(slopes), **kw)
    for key in ("out", "lse", "dq", "dk", "dv", "dbias"):
        assert np.array_equal(rn[key], rt[key].numpy()), f"{key}: torch and numpy paths differ"
