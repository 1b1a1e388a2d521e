"""NaN and Inf inputs: fmha makes exactly the outputs and gradients non-finite that the
float64 reference does (docs/semantics.md, "Non-finite inputs").

The rule, in short: a pair (i, j) that is masked out (window, causal, boolean mask, a -inf
bias) contributes nothing, nor does a dropped pair to P V and dV, even against a NaN or Inf
in q_i, k_j, v_j or dout_i; everything else is IEEE arithmetic, so a NaN that reaches a
visible score makes its row NaN, and a non-finite v_j does the same to every row that sees
key j. Each scenario below plants non-finite values where one of those statements decides
the answer, and the check compares the non-finite pattern of every result exactly and its
finite entries with the usual tolerance.

The CPU kernels (every ISA level, through tests/run_all_isas.py) and the CUDA kernels
(emulated) both follow the rule; float16/bfloat16 entries are compared with a fixed
tolerance of a few 16-bit ulps, since the naive low-precision baseline of the tolerance
rule is not defined with NaN inputs.
"""

from __future__ import annotations

import numpy as np
import pytest

import fmha
from conftest import TOL_F32, TOL_F64, REL_SCALE_FLOOR, fmha_results, reference_results, to_f64

NAN, INF = float("nan"), float("inf")


def _inputs(rng, b=1, sq=40, sk=40, hq=2, hkv=2, d=16):
    return [rng.standard_normal(s) for s in
            [(b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d), (b, sq, hq, d)]]


# Each scenario: rng -> (q, k, v, dout, kwargs), float64 arrays with the non-finite values in.
def _nan_q_row(rng):
    q, k, v, do = _inputs(rng)
    q[0, 7, 1, 3] = NAN  # row 7 of head 1: every score NaN
    return q, k, v, do, {}


def _inf_q_causal(rng):
    q, k, v, do = _inputs(rng)
    q[0, 9, 0, 0] = INF  # +-inf scores: the row is NaN (inf - inf in the softmax)
    return q, k, v, do, dict(causal=True)


def _nan_k_causal(rng):
    q, k, v, do = _inputs(rng, sq=70, sk=70)
    k[0, 66, 1, 2] = NAN  # rows >= 66 see it: they go NaN, rows < 66 must not
    return q, k, v, do, dict(causal=True)


def _nan_v_masked_key(rng):
    q, k, v, do = _inputs(rng, sq=50, sk=50)
    v[0, 45, 0, 5] = NAN  # in the diagonal tile: a GEMM over it would give rows < 45 0 * NaN
    return q, k, v, do, dict(causal=True)


def _nan_token_causal(rng):
    q, k, v, do = _inputs(rng, sq=90, sk=90)
    for x in (q, k, v):
        x[0, 70, :, :] = NAN  # one diverged token: q, k and v of position 70
    return q, k, v, do, dict(causal=True)


def _inf_v_window(rng):
    q, k, v, do = _inputs(rng, sq=40, sk=80)
    v[0, 40, 1, 0] = -INF  # seen by rows 0-6 only (keys i+34 .. i+43)
    return q, k, v, do, dict(window=(6, 3))


def _nan_v_boolean_mask(rng):
    q, k, v, do = _inputs(rng, b=2, sq=30, sk=30)
    mask = rng.random((2, 1, 30, 30)) < 0.6
    mask[0, 0, :, 12] = False  # key 12 of batch 0 masked for every row...
    v[0, 12, 0, 1] = NAN       # ...so its NaN must reach nothing
    mask[1, 0, :5, 3] = False  # key 3 of batch 1: masked for rows 0-4 only
    v[1, 3, 1, 1] = INF
    return q, k, v, do, dict(mask=mask)


def _nan_v_neg_inf_bias(rng):
    q, k, v, do = _inputs(rng, sq=20, sk=33)
    bias = rng.standard_normal((1, 1, 20, 33))
    bias[..., 30] = -INF  # a -inf bias masks key 30 for every row
    v[0, 30, 0, 2] = NAN
    k[0, 30, 1, 0] = INF  # and its +-inf score, too
    return q, k, v, do, dict(bias=bias)


def _nan_bias_entry(rng):
    q, k, v, do = _inputs(rng, sq=20, sk=20)
    bias = rng.standard_normal((1, 2, 20, 20))
    bias[0, 1, 4, 9] = NAN
    return q, k, v, do, dict(bias=bias, bias_grad=True)


def _nan_dout_empty_row(rng):
    q, k, v, do = _inputs(rng, sq=40, sk=24)
    do[0, 3, 0, 0] = NAN  # row 3 sees no key (bottom-right causal, sq > sk): out = 0
    do[0, 30, 1, 2] = NAN  # row 30 sees keys: its gradients go NaN
    return q, k, v, do, dict(causal=True)


def _inf_k_softcap(rng):
    q, k, v, do = _inputs(rng)
    k[0, 11, 0, 4] = INF  # tanh saturates: softcap * tanh(+-inf) = +-softcap, finite
    return q, k, v, do, dict(softcap=8.0)


def _nan_v_dropout(rng):
    q, k, v, do = _inputs(rng, sq=24, sk=24)
    v[0, 5, 0, 0] = NAN  # rows that dropped key 5 stay finite
    k[0, 17, 1, 1] = INF
    return q, k, v, do, dict(dropout_p=0.4, causal=True)


def _nan_v_decode_gqa(rng):
    q, k, v, do = _inputs(rng, sq=1, sk=200, hq=4, hkv=1)
    v[0, 150, 0, 7] = NAN  # outside the window of the one query row
    q[0, 0, 3, 0] = NAN    # head 3's row is NaN, heads 0-2 are not
    return q, k, v, do, dict(window=(40, -1))


def _nan_v_causal_d128(rng):
    # The d = 128 forward keeps K and V XOR-swizzled in shared memory (csrc/cuda/flash_fwd.cuh):
    # its strong zero reads V through that layout. Keys 91 and 70 are in the diagonal block of
    # rows 64-99; row 91's swizzle (chunk ^ 3) moves column 77's chunk (9) to 10, where adding
    # 3 instead would give 12.
    q, k, v, do = _inputs(rng, sq=100, sk=100, d=128)
    v[0, 91, 0, 77] = NAN  # head 0: rows >= 91 NaN, rows 64-90 (same tile) must not be
    v[0, 70, 1, 3] = INF   # head 1: rows >= 70 non-finite, rows 64-69 finite
    k[0, 97, 1, 120] = NAN  # and rows >= 97 NaN
    return q, k, v, do, dict(causal=True)


def _nan_v_causal_d64(rng):
    # The plain d = 64 forward gives each warp 32 query rows, two m16 tiles, and checks Vj after
    # S (csrc/cuda/flash_fwd.cuh, kMTiles = 2): warp 0 holds rows 0-15 and 16-31, warp 2 rows
    # 64-79 and 80-95. Keys 20 and 91 split the second tile of each.
    q, k, v, do = _inputs(rng, sq=100, sk=100, d=64)
    v[0, 20, 0, 33] = NAN  # head 0: rows >= 20 NaN, rows 16-19 (same m16 tile) must not be
    v[0, 91, 1, 2] = -INF  # head 1: rows >= 91 non-finite, rows 80-90 finite
    return q, k, v, do, dict(causal=True)


def _nan_causal_d32(rng):
    # The 32 tile's whole-block copies pair rows r and r + 4 of each 8 in a phase (tile_io.cuh,
    # FullBlock::kPairRows): a non-finite value in each tile the strong zero checks after them
    # (V and K in the forward, K, Q and dout in the backward), next to rows of the same block
    # that must stay finite. That each thread's check reads back only the chunks it copied is
    # the emulator self-test emu.vote_reads_own_chunks (tests/cuda_emu/emulator_checks.cu), run
    # under the race checker too.
    q, k, v, do = _inputs(rng, sq=100, sk=100, d=32)
    v[0, 41, 0, 5] = NAN   # head 0: rows >= 41 NaN, rows 32-40 must not be
    k[0, 75, 1, 9] = INF   # head 1: rows >= 75 non-finite
    q[0, 22, 1, 30] = NAN  # row 22 of head 1
    do[0, 60, 0, 17] = NAN  # the gradients of row 60 of head 0
    return q, k, v, do, dict(causal=True)


def _inf_q_nan_v(rng):
    # A row whose every score is -inf (an Inf in q against keys of one sign) gives all of its
    # keys weight 0, but they take part: a NaN in a visible v still reaches it (0 * NaN). Its
    # lse is -inf, as for a row without keys, which a split-KV merge must not read as "empty".
    q, k, v, do = _inputs(rng, sq=40, sk=140)
    k[0, :, 0, 3] = np.abs(k[0, :, 0, 3]) + 0.5
    q[0, 25, 0, 3] = -INF  # row 25 of head 0 (bottom-right causal: keys <= 125)
    v[0, 120, 0, 5] = NAN  # rows >= 20 of head 0 NaN in column 5, row 25 only there
    return q, k, v, do, dict(causal=True)


def _inf_q_row_inner(rng):
    # An Inf in q against keys of both signs: the row's scores are +-inf, the forward row NaN,
    # its lse NaN. The keys it scores -inf still get P = 0 from it, so their dV stays finite
    # (their dK's column 3 is 0 * inf: NaN). 128 queries and 128 keys without a mask: every
    # backward step is an inner one (no pair to test), where the CUDA backward takes its fast
    # path unless the step's lse holds a NaN; the Inf in each of the two query blocks, so that
    # both stages' marks are read.
    q, k, v, do = _inputs(rng, sq=128, sk=128)
    k[0, :, 0, 3] = (np.abs(k[0, :, 0, 3]) + 0.5) * np.where(np.arange(128) % 3 == 0, -1, 1)
    q[0, 20, 0, 3] = INF
    q[0, 90, 1, 3] = INF
    return q, k, v, do, {}


def _inf_dout_row_inner(rng, d=64):
    # dS = P (dP - D) is 0 where P is, also where dP - D is not finite: an Inf in dout makes
    # its row's dP - D non-finite, and the keys that row scores 1500 below its others get
    # P = 0 exactly, in float64 as in float32, so their dK stays finite (two score levels:
    # no key of the row underflows in one precision only). 128 queries and keys without a
    # mask: inner backward steps, the CUDA fast path, which applies the P = 0 rule only in a
    # thread whose dS holds a NaN (d = 64: P in float32; d = 128: P packed to 16 bits).
    q, k, v, do = _inputs(rng, sq=128, sk=128, d=d)
    k[0, :, 0, 3] = np.where(np.arange(128) % 3 == 0, -1.0, 1.0)
    q[0, 70, 0, :] = 0.0
    q[0, 70, 0, 3] = 750.0 * np.sqrt(d)  # scores +-750 (+-752 in bfloat16 at d = 64)
    do[0, 70, 0, 5] = INF
    return q, k, v, do, {}


SCENARIOS = {
    "nan_q_row": _nan_q_row,
    "inf_q_causal": _inf_q_causal,
    "nan_k_causal": _nan_k_causal,
    "nan_v_masked_key": _nan_v_masked_key,
    "nan_token_causal": _nan_token_causal,
    "inf_v_window": _inf_v_window,
    "nan_v_boolean_mask": _nan_v_boolean_mask,
    "nan_v_neg_inf_bias": _nan_v_neg_inf_bias,
    "nan_bias_entry": _nan_bias_entry,
    "nan_dout_empty_row": _nan_dout_empty_row,
    "inf_k_softcap": _inf_k_softcap,
    "nan_v_dropout": _nan_v_dropout,
    "nan_v_decode_gqa": _nan_v_decode_gqa,
    "nan_v_causal_d128": _nan_v_causal_d128,
    "nan_v_causal_d64": _nan_v_causal_d64,
    "nan_causal_d32": _nan_causal_d32,
    "inf_q_nan_v": _inf_q_nan_v,
    "inf_q_row_inner": _inf_q_row_inner,
    "inf_dout_row_inner": _inf_dout_row_inner,
    "inf_dout_row_inner_d128": lambda rng: _inf_dout_row_inner(rng, d=128),
}


def check_nonfinite(name, actual, ref, dtype):
    actual, ref = to_f64(actual), to_f64(ref)
    assert actual.shape == ref.shape, name
    fa, fr = np.isfinite(actual), np.isfinite(ref)
    where = np.argwhere(fa != fr)
    assert where.size == 0, (
        f"{name}: non-finite pattern differs from the reference at {len(where)} entries, "
        f"first {where[:4].tolist()} (fmha {actual[tuple(where[0])]}, "
        f"reference {ref[tuple(where[0])]})")
    if not fr.any():
        return
    scale = max(float(np.max(np.abs(ref[fr]))), REL_SCALE_FLOOR)
    tol = {"float64": TOL_F64, "float32": TOL_F32}.get(dtype, 3e-2)
    err = float(np.max(np.abs(actual[fr] - ref[fr])))
    assert err <= tol * scale, f"{name}: finite entries off by {err:.3g} > {tol:g}*{scale:.3g}"


def run_scenario(rng, scenario, lib, dtype, **fmha_kw):
    q, k, v, do, kw = SCENARIOS[scenario](rng)
    bias_grad = kw.pop("bias_grad", False)
    seed = None
    ref_kw = {}
    if kw.get("dropout_p", 0) > 0:
        seed, ref_kw = 1234, dict(seed=1234)
    if lib == "torch":
        import torch
        tdt = getattr(torch, dtype)
        conv = lambda x: torch.from_numpy(x).to(tdt)
        q, k, v, do = map(conv, (q, k, v, do))
        if "bias" in kw:
            kw["bias"] = torch.from_numpy(kw["bias"]).to(torch.float32)
        if "mask" in kw:
            kw["mask"] = torch.from_numpy(kw["mask"])
        assert seed is None, "torch draws the dropout seed inside fmha: NumPy only"
    else:
        q, k, v, do = (x.astype(dtype) for x in (q, k, v, do))
    res = fmha_results(q, k, v, do, bias_grad=bias_grad, seed=seed, **kw, **fmha_kw)
    ref = reference_results(q, k, v, do, bias_grad=bias_grad, **kw, **ref_kw)
    for key in ref:
        check_nonfinite(key, res[key], ref[key], dtype)


def _cases(lib_dtypes):
    # dropout scenarios through NumPy only: there the test chooses the seed
    return [pytest.param(s, lib, dt, id=f"{s}-{lib}-{dt}") for s in SCENARIOS
            for lib, dt in lib_dtypes if lib == "numpy" or s != "nan_v_dropout"]


@pytest.mark.parametrize("scenario,lib,dtype", _cases(
    [("numpy", "float64"), ("numpy", "float32"), ("torch", "bfloat16")]))
def test_nonfinite_cpu(rng, scenario, lib, dtype):
    run_scenario(rng, scenario, lib, dtype)


# The CUDA kernels, emulated (and on a GPU where one is): every scenario in both 16-bit
# dtypes -- bfloat16 through torch, float16 through NumPy (where the dropout scenario can
# choose its seed).
@pytest.mark.backends("emu", "gpu")
@pytest.mark.parametrize("scenario,lib,dtype", _cases([("torch", "bfloat16"), ("numpy", "float16")]))
def test_nonfinite_cuda(backend, rng, scenario, lib, dtype):
    run_scenario(rng, scenario, lib, dtype)


# The Hopper forward (csrc/cuda/flash_fwd_sm90.cuh, backend emu90: FMHA_CUDA_KERNEL=sm90) on the
# scenarios it claims (no mask, bias, softcap, dropout or KV cache): its strong zero is the
# plain product of a rare block, in place of the wgmma (the backward stays the sm_80 one).
SM90_SCENARIOS = ["nan_q_row", "inf_q_causal", "nan_k_causal", "nan_token_causal", "inf_v_window",
                  "nan_v_causal_d128", "nan_v_causal_d64", "nan_causal_d32", "inf_q_nan_v",
                  "inf_q_row_inner", "nan_dout_empty_row"]


@pytest.mark.backends("emu90")
@pytest.mark.parametrize("scenario,lib,dtype", [
    c for c in _cases([("torch", "bfloat16"), ("numpy", "float16")])
    if c.values[0] in SM90_SCENARIOS])
def test_nonfinite_cuda_sm90(backend, rng, scenario, lib, dtype):
    run_scenario(rng, scenario, lib, dtype)


@pytest.mark.backends("emu90")
@pytest.mark.parametrize("scenario,lib,dtype", [
    c for c in _cases([("torch", "bfloat16")]) if c.values[0] in ("inf_v_window", "nan_v_causal_d64")])
def test_nonfinite_cuda_sm90_split_kv(backend, rng, scenario, lib, dtype):
    run_scenario(rng, scenario, lib, dtype, num_splits=3)


# Split-KV (flash_fwd_combine_kernel merges the splits by lse): forced 3 splits, on the
# scenarios where a NaN or Inf in v meets rows that see it with and without weight.
SPLIT_KV_SCENARIOS = ["inf_q_nan_v", "nan_v_masked_key", "inf_v_window", "nan_v_causal_d64"]


@pytest.mark.backends("emu", "gpu")
@pytest.mark.parametrize("scenario,lib,dtype", [
    c for c in _cases([("torch", "bfloat16")]) if c.values[0] in SPLIT_KV_SCENARIOS])
def test_nonfinite_cuda_split_kv(backend, rng, scenario, lib, dtype):
    run_scenario(rng, scenario, lib, dtype, num_splits=3)


# The deterministic backward computes dQ in a kernel of its own (csrc/cuda/flash_bwd.cuh,
# flash_bwd_dq_kernel), with its own strong zero for K: the scenarios where a NaN or Inf meets
# masked or dropped pairs (the others add nothing over test_nonfinite_cuda, and CI time is short).
DQ_KERNEL_SCENARIOS = ["inf_q_causal", "nan_k_causal", "nan_token_causal", "nan_v_masked_key",
                       "nan_v_neg_inf_bias", "nan_v_dropout"]


@pytest.mark.backends("emu", "gpu")
@pytest.mark.parametrize("scenario,lib,dtype", [
    c for c in _cases([("numpy", "float16")]) if c.values[0] in DQ_KERNEL_SCENARIOS])
def test_nonfinite_cuda_deterministic(backend, rng, scenario, lib, dtype):
    run_scenario(rng, scenario, lib, dtype, deterministic=True)
