"""fmha.attention_varlen_backward: the NumPy/CuPy backward of attention_varlen.

Ragged batches with an empty sequence (no queries, or no keys) run through
attention_varlen(return_lse=True) and attention_varlen_backward, against the float64
reference (fmha.reference.attention_varlen_backward, per sequence for bias/dbias) with the
dtype's tolerance rule (conftest.assert_close), and against the torch autograd path, which
calls the same kernels with the same params and so must give the same bits. Backends: the
CPU kernels, and the CUDA kernels under the emulator (float16, small shapes) or on a GPU.
"""

import numpy as np
import pytest

import fmha
from cases import naive_varlen, varlen_inputs
from conftest import LOW_PRECISION, assert_close, to_f64
from fmha import reference

pytestmark = [pytest.mark.backends("cpu", "emu", "gpu"), pytest.mark.usefixtures("backend")]

# (lens_q, lens_k): sequence 1 has no queries, sequence 3 has queries but no keys (its rows
# see nothing: out 0, lse -inf, zero gradients).
RAGGED = ([5, 0, 17, 6], [7, 3, 20, 0])
FEATURES = {
    "plain": {},
    "causal": dict(causal=True),
    "window_softcap": dict(window=(4, 2), softcap=3.0),
    "dropout": dict(dropout_p=0.25, causal=True),
}


def _run(q, k, v, do, cu_q, cu_k, deterministic=False, **kw):
    out, lse = fmha.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **kw)
    dq, dk, dv = fmha.attention_varlen_backward(do, q, k, v, out, lse, cu_q, cu_k,
                                                deterministic=deterministic, **kw)
    return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)


@pytest.mark.parametrize("feature", list(FEATURES))
def test_against_reference(rng, backend, feature):
    """float16 (NumPy has no bfloat16) on every backend."""
    check_against_reference(rng, "float16", feature)


@pytest.mark.backends("cpu")  # the CUDA kernels take 16-bit inputs only
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_against_reference_wide(rng, backend, dtype, feature):
    check_against_reference(rng, dtype, feature)


@pytest.mark.backends("emu", "gpu")
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_whole_query_blocks_across_heads(rng, backend, d, deterministic):
    """Sequences long enough for whole query blocks, 2 query heads per kv head, a partial last
    block and an empty sequence: the CUDA backward's plain kernels copy whole blocks of q and
    dout from pointers they move on block by block and head by head (docs/cuda_kernels.md,
    "The backward"), in both dQ modes."""
    check_against_reference(rng, "float16", "plain", lens=([70, 0, 100], [100, 9, 90]),
                            dims=(4, 2, d, d), deterministic=deterministic)


def check_against_reference(rng, dtype, feature, lens=RAGGED, dims=(4, 2, 32, 24), **call_kw):
    """call_kw: passed to the kernels only (the reference has no such options)."""
    lens_q, lens_k = lens
    hq = dims[0]
    q, k, v, do, cu_q, cu_k = varlen_inputs(rng, "numpy", dtype, lens_q, lens_k, *dims)
    kw = dict(FEATURES[feature])
    seed = 2**40 + 3
    if kw.get("dropout_p"):
        kw["seed"] = seed
    res = _run(q, k, v, do, cu_q, cu_k, **kw, **call_kw)
    rkw = {n: x for n, x in kw.items() if n != "seed"}
    if kw.get("dropout_p"):
        rkw.update(seed=seed, offset=0)
    args64 = [to_f64(x) for x in (q, k, v)]
    ref_out, ref_lse = reference.attention_varlen_forward(*args64, cu_q, cu_k, **rkw)
    ref_dq, ref_dk, ref_dv = reference.attention_varlen_backward(to_f64(do), *args64, cu_q,
                                                                 cu_k, **rkw)
    refs = dict(out=ref_out, lse=ref_lse, dq=ref_dq, dk=ref_dk, dv=ref_dv)
    naive = {}
    if dtype in LOW_PRECISION:
        torch = pytest.importorskip("torch")
        nkw = {n: x for n, x in kw.items() if n not in ("dropout_p", "seed")}
        if kw.get("dropout_p"):
            from fmha._philox import dropout_keep_mask
            p = kw["dropout_p"]
            nkw["dropout_z"] = [
                torch.from_numpy(dropout_keep_mask(seed, 0, 1, hq, lq, lk, p, batch_index_start=b)
                                 / (1 - p)) if lq and lk else None
                for b, (lq, lk) in enumerate(zip(lens_q, lens_k))]
        tq = [torch.from_numpy(x) for x in (q, k, v, do)]
        naive = {n: x.detach() for n, x in naive_varlen(*tq, cu_q, cu_k, **nkw).items()}
    for key in refs:
        rdt = ("float64" if dtype == "float64" else "float32") if key == "lse" else None
        assert_close(key, res[key], refs[key], dtype, naive=naive.get(key),
                     grad=key.startswith("d"), result_dtype=rdt)
    if lens is not RAGGED:
        return
    # the empty sequences: no query rows to write for sequence 1; sequence 3's keys are none,
    # so its queries get zero gradients, and sequence 1's keys get zero dk/dv
    rows3 = slice(int(cu_q[3]), int(cu_q[4]))
    keys1 = slice(int(cu_k[1]), int(cu_k[2]))
    assert not np.any(res["dq"][rows3]) and not np.any(res["out"][rows3])
    assert not np.any(res["dk"][keys1]) and not np.any(res["dv"][keys1])


@pytest.mark.parametrize("feature", ["plain", "causal", "window_softcap"])
def test_same_bits_as_torch_autograd(rng, backend, feature):
    """The array path and torch autograd hand the kernels the same params."""
    torch = pytest.importorskip("torch")
    dtype = "float32" if backend == "cpu" else "float16"
    lens_q, lens_k = RAGGED
    q, k, v, do, cu_q, cu_k = varlen_inputs(rng, "numpy", dtype, lens_q, lens_k, 4, 2, 32, 24)
    kw = FEATURES[feature]
    res = _run(q, k, v, do, cu_q, cu_k, **kw)
    leaves = [torch.from_numpy(x).requires_grad_(True) for x in (q, k, v)]
    out = fmha.attention_varlen(*leaves, torch.from_numpy(cu_q), torch.from_numpy(cu_k), **kw)
    out.backward(torch.from_numpy(do))
    for name, got, want in (("out", res["out"], out), ("dq", res["dq"], leaves[0].grad),
                            ("dk", res["dk"], leaves[1].grad), ("dv", res["dv"], leaves[2].grad)):
        np.testing.assert_array_equal(got, want.detach().numpy(), err_msg=name)


def test_bias_grad(rng, backend):
    """bias (indexed by the position within each sequence) and its gradient."""
    dtype = "float64" if backend == "cpu" else "float16"
    lens_q, lens_k = [4, 0, 9], [6, 3, 11]
    nb, hq = 3, 2
    q, k, v, do, cu_q, cu_k = varlen_inputs(rng, "numpy", dtype, lens_q, lens_k, hq, 1, 32, 32)
    mq, mk = max(lens_q), max(lens_k)
    bias = rng.standard_normal((nb, 1, mq, mk)).astype(dtype)
    out, lse = fmha.attention_varlen(q, k, v, cu_q, cu_k, bias=bias, return_lse=True)
    dq, dk, dv, db = fmha.attention_varlen_backward(do, q, k, v, out, lse, cu_q, cu_k,
                                                    bias=bias, bias_grad=True)
    assert db.shape == bias.shape and db.dtype == bias.dtype
    ref = dict(dq=np.zeros(q.shape), dk=np.zeros(k.shape), dv=np.zeros(v.shape),
               dbias=np.zeros(bias.shape))
    naive = {}
    if dtype in LOW_PRECISION:
        torch = pytest.importorskip("torch")
        naive = dict(dq=torch.zeros(q.shape, dtype=torch.float16),
                     dk=torch.zeros(k.shape, dtype=torch.float16),
                     dv=torch.zeros(v.shape, dtype=torch.float16),
                     dbias=torch.zeros(bias.shape, dtype=torch.float16))
    for bi in range(nb):
        sq, sk = slice(cu_q[bi], cu_q[bi + 1]), slice(cu_k[bi], cu_k[bi + 1])
        lq, lk = lens_q[bi], lens_k[bi]
        if lq == 0:
            continue
        a = [to_f64(x)[None, s] for x, s in ((q, sq), (k, sk), (v, sk))]
        b64 = to_f64(bias)[bi:bi + 1, :, :lq, :lk]
        g = reference.attention_backward(to_f64(do)[None, sq], *a, bias=b64)
        ref["dq"][sq], ref["dk"][sk], ref["dv"][sk] = g[0][0], g[1][0], g[2][0]
        ref["dbias"][bi, :, :lq, :lk] = g[3][0]
        if naive:
            from conftest import naive_results
            t = lambda x: torch.from_numpy(np.ascontiguousarray(x))
            r = naive_results(t(q[None, sq]), t(k[None, sk]), t(v[None, sk]), t(do[None, sq]),
                              bias=t(bias[bi:bi + 1, :, :lq, :lk]), bias_grad=True)
            naive["dq"][sq], naive["dk"][sk], naive["dv"][sk] = r["dq"][0], r["dk"][0], r["dv"][0]
            naive["dbias"][bi, :, :lq, :lk] = r["dbias"][0]
    for name, got in (("dq", dq), ("dk", dk), ("dv", dv), ("dbias", db)):
        assert_close(name, got, ref[name], dtype, naive=naive.get(name), grad=True)
