"""Shared helpers for the fmha correctness tests.

* ``rng``: a NumPy generator seeded from the test's node id (reproducible per test; the
  same case draws the same inputs on every backend).
* ``backend``: the kernel module behind fmha's Python API for a test: ``cpu`` (fmha._C),
  ``emu`` (fmha._cuda_emu: the CUDA kernels under the SIMT emulator, on host arrays) or
  ``emu90`` (the same, with FMHA_CUDA_KERNEL=sm90: the Hopper forward for the calls it claims)
  or ``gpu`` (fmha._C's CUDA kernels on a real GPU, host arrays copied in and out). A module
  marked ``pytest.mark.backends("emu", "gpu")`` runs each of its tests once per backend;
  a backend that is not there skips with the reason.
* ``make_inputs`` / ``make_array``: random inputs in (batch, seqlen, heads, dim) layout,
  drawn in float64 and rounded to the requested dtype, as NumPy arrays or torch tensors.
* ``to_f64``: anything (NumPy / torch, any dtype) -> float64 NumPy array.
* ``assert_close``: the tolerance rule of the tests (docs/testing.md):

  - float64: max|x - ref| <= 1e-10 * max(max|ref|, 1)
  - float32: max|x - ref| <= 2e-5  * max(max|ref|, 1)
  - float16 / bfloat16 (flash-attn's rule): max|x - ref| <= mult * max|naive - ref| + floor,
    mult = 2 for outputs / lse, 3 for gradients, where ``naive`` is the same computation
    done naively in that low precision (``naive_attention_torch``) and ``floor`` is
    max|round(ref) - ref| (the error of merely rounding the exact answer to the stored
    dtype, at most half an ulp of max|ref|) + 2e-5 * max(max|ref|, 1) (float32-level
    accumulation error). The floor only matters in degenerate cases where the naive
    computation happens to be exact (e.g. seqlen_k = 1); see assert_close.
  (The "max(., 1)": see REL_SCALE_FLOOR.) -inf must appear exactly where the reference
  has -inf (lse of rows with no visible key) and NaN nowhere.

* ``naive_attention_torch``: a plain torch formula of the fmha semantics (materialised
  scores, torch.softmax) computed entirely in the dtype of its inputs; used as the naive
  low-precision baseline and, in float64 with an explicit dropout multiplier, as the
  reference for torch dropout (whose seed is drawn inside fmha from torch's generator).
"""

from __future__ import annotations

import functools
import math
import zlib

import numpy as np
import pytest

# ----------------------------------------------------------------------------- constants

#: float64: the kernels accumulate in float64; after O(seqlen * head_dim) fused
#: multiply-adds the rounding error is ~1e-14 relative, so 1e-10 leaves a wide margin
#: while still catching any real error (a wrong mask/scale is O(1)).
TOL_F64 = 1e-10
#: float32: float32 accumulation over at most ~1000 keys / 256 dims gives ~3e-7 relative
#: error typically; the measured worst case over this file's cases is 7.3e-6 (dq with
#: scores |s| ~ 100 in test_online_softmax_rescaling), so 2e-5 keeps a ~3x margin.
TOL_F32 = 2e-5

#: The relative bounds above are taken against max(max|ref|, 1). The tests' inputs (q, k,
#: v, dout, bias) are unit-normal, so every result has a natural scale of O(1). A result
#: that is exactly zero in exact arithmetic is still computed with rounding error of that
#: natural scale: dq/dk when a row sees a single key (dS = P(dP - D) = 0 by cancellation;
#: measured 3.4e-16 in float64, 5.6e-6 in float32 for dk summed over 113 such rows) and a
#: bias broadcast over seqlen_k (sum_j dS_ij = 0 exactly; measured 4.7e-6 in float32 summed
#: over ~1100 elements), so a pure relative bound (0 there) would be wrong.
REL_SCALE_FLOOR = 1.0

#: float8_e4m3fn inputs with a kernel that rounds P to e4m3 for P V (flash-attn 3's fp8
#: forward; fmha.reference.attention_fp8_forward(quantize_p=True) models it): out's error
#: against the exact attention of the dequantised inputs, relative to max(max|ref|, 1).
#: Measured with that model on unit-normal inputs: worst 0.027 over 407 draws (seqlen
#: 1..2048, head_dim 32..256, causal or not, scores up to 9x sharper, key tiles of 64..224;
#: tools/fp8_p_error.py). 2**-4, e4m3's largest relative rounding error of one
#: probability, keeps a 2.3x margin; a wrong descale or mask is an O(1) error.
FP8_P_TOL = 2.0**-4

LOW_PRECISION = ("bfloat16", "float16")
ALL_DTYPES = ("float64", "float32", "bfloat16", "float16")


# ----------------------------------------------------------------------------- fixtures

@pytest.fixture
def rng(request):
    """A generator whose seed is a hash of the test id: reproducible, different per case.
    The backend's part of the id is left out, so every backend gets the same inputs."""
    return np.random.default_rng(zlib.crc32(_nodeid_without_backend(request.node).encode()))


def _nodeid_without_backend(node) -> str:
    callspec = getattr(node, "callspec", None)
    if callspec is None or "backend" not in callspec.params:
        return node.nodeid
    parts = callspec.id.split("-")
    name = callspec.params["backend"]
    index = 0 if parts[0] == name else len(parts) - 1
    assert parts[index] == name, (node.nodeid, name)
    rest = "-".join(parts[:index] + parts[index + 1:])
    base = node.nodeid[:-len(f"[{callspec.id}]")]
    return f"{base}[{rest}]" if rest else base


@pytest.fixture
def restore_threads():
    """Restores fmha's thread setting (set_num_threads(None)) after the test."""
    import fmha
    yield
    fmha.set_num_threads(None)


# ----------------------------------------------------------------------------- torch threads

@pytest.fixture(autouse=True)
def restore_torch_threads():
    """Benchmarks and examples set torch's thread count for their run; the next test must not
    inherit it. Only where a test has loaded torch (this never imports it)."""
    import sys
    torch = sys.modules.get("torch")
    n = torch.get_num_threads() if torch is not None else None
    yield
    if n is not None:
        torch.set_num_threads(n)


# ----------------------------------------------------------------------------- testing build

def _testing_build() -> bool:
    from fmha import _C
    return bool(getattr(_C, "testing_build", False))


def pytest_sessionstart(session):
    # The suite is meant to run on a testing build (FMHA_BUILD_TESTING=ON: fmha._cuda_emu and
    # the test probes of fmha._C). On a plain install the tests that need them skip with that
    # reason; under CI they would be skips presented as a pass, so CI stops here instead.
    import os
    if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
        import importlib.util
        missing = [what for what, ok in (
            ("the test probes of fmha._C", _testing_build()),
            ("fmha._cuda_emu", importlib.util.find_spec("fmha._cuda_emu") is not None)) if not ok]
        if missing:
            pytest.exit(f"CI needs a testing build (FMHA_BUILD_TESTING=ON pip install ...): "
                        f"{' and '.join(missing)} missing", returncode=1)


def probes():
    """fmha._C with its test probes (philox4x32_10, cpu_exp, ...): present only in a testing
    build (FMHA_BUILD_TESTING=ON); elsewhere the calling test skips, saying so."""
    from fmha import _C
    if not _testing_build():
        pytest.skip("fmha._C was built without its test probes (FMHA_BUILD_TESTING=ON adds them)")
    return _C


# ----------------------------------------------------------------------------- backends

BACKENDS = ("cpu", "emu", "emu90", "gpu")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "backends(*names): run each test of the module once per kernel backend "
        "(cpu, emu, gpu), through the `backend` fixture")
    # FMHA_TEST_AMX_PLANT=<n>: plant fault n of csrc/cpu/amx_model.h (the AMX model's or the amx
    # level's forward) for the whole run: tests/kernels/test_amx.py runs part of the suite so,
    # to show that the AMX level's suite fails on it. Needs the testing build's probe.
    import os
    plant = os.environ.get("FMHA_TEST_AMX_PLANT", "")
    if plant not in ("", "0"):
        from fmha import _C
        _C.amx_plant_fault(int(plant))


def pytest_generate_tests(metafunc):
    marker = metafunc.definition.get_closest_marker("backends")
    if marker is not None and "backend" in metafunc.fixturenames:
        assert set(marker.args) <= set(BACKENDS), marker.args
        # The gpu backend is generated only where a GPU can run the kernels: elsewhere
        # tests/kernels/test_cuda_gpu.py's module skip says once why, instead of one skip per case.
        names = [n for n in marker.args if n != "gpu" or not _why_no_gpu()]
        metafunc.parametrize("backend", names, indirect=True)


@pytest.fixture
def backend(request):
    """Runs the test with fmha's entry points calling the named backend's kernel module
    (default "cpu"); yields the name."""
    from fmha._core import _kernel_module
    name = getattr(request, "param", "cpu")
    module = _backend_module(name)
    if name != "emu90":
        with _kernel_module(module):
            yield name
        return
    # emu90: the emulator with the Hopper forward (csrc/cuda/flash_fwd_sm90.cuh) for every call
    # it claims. A test marked for it must reach that kernel: its last forward is checked.
    mp = pytest.MonkeyPatch()
    mp.setenv("FMHA_CUDA_KERNEL", "sm90")
    module.forward_kernel()  # clear
    try:
        with _kernel_module(module):
            yield name
        used = module.forward_kernel()
        assert used in ("", "sm90"), (
            f"the case's forward ran in the {used} kernel: the sm_90 kernel does not claim it "
            "(list it for the emu backend only)")
    finally:
        mp.undo()


def _backend_module(name):
    import fmha
    if name == "cpu":
        return fmha._C
    if name in ("emu", "emu90"):
        try:
            from fmha import _cuda_emu
        except ImportError:
            pytest.skip("fmha._cuda_emu is not built (FMHA_BUILD_TESTING=ON builds it)")
        return _cuda_emu
    why = _why_no_gpu()
    if why:
        pytest.skip(why)
    return _OnGpu


@functools.lru_cache(maxsize=None)
def _why_no_gpu() -> str:
    """'' when fmha's CUDA kernels can run on a GPU here, else why not."""
    from fmha import _C
    try:
        import torch
    except ImportError:
        return "no usable GPU for fmha's CUDA kernels (torch, which moves the arrays, is absent)"
    if torch.cuda.is_available() and _C.cuda_built() and _C.cuda_device_count() > 0:
        return ""
    return (f"no usable GPU for fmha's CUDA kernels (torch.cuda.is_available() = "
            f"{torch.cuda.is_available()}; fmha: {_C.cuda_status()})")


def _to_gpu(x):
    import torch
    if x is None:
        return None
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(np.ascontiguousarray(x))
    return x.to("cuda")


class _OnGpu:
    """fmha._C.forward / backward for host arrays, run on the GPU: copies the arrays to the
    GPU, runs fmha._C on the copies (so the real CUDA kernels, on the current stream) and
    copies the results back. The ``gpu`` backend: the very cases the emulator checks, on
    the hardware."""

    _EXTRAS = ("bias", "mask", "alibi_slopes", "cu_seqlens_q", "cu_seqlens_k")

    @staticmethod
    def _copy_back(host, dev):
        if host is None:
            return
        if isinstance(host, np.ndarray):
            np.copyto(host, dev.cpu().numpy())
        else:
            host.copy_(dev.cpu())

    @classmethod
    def forward(cls, q, k, v, out, lse, **kw):
        import torch
        from fmha import _C
        arrays = {n: _to_gpu(kw.pop(n, None)) for n in cls._EXTRAS}
        d_out, d_lse = _to_gpu(out), _to_gpu(lse)
        kw["stream"] = torch.cuda.current_stream().cuda_stream
        _C.forward(_to_gpu(q), _to_gpu(k), _to_gpu(v), d_out, d_lse, **arrays, **kw)
        torch.cuda.synchronize()
        cls._copy_back(out, d_out)
        cls._copy_back(lse, d_lse)

    @classmethod
    def forward_kvcache(cls, q, k_cache, v_cache, out, lse, k=None, v=None, cache_seqlens=None,
                        block_table=None, alibi_slopes=None, **kw):
        import torch
        from fmha import _C

        def tensor(x):  # torch callers pass DLPack capsules (fmha/_kvcache.py)
            return torch.utils.dlpack.from_dlpack(x) if type(x).__name__ == "PyCapsule" else x
        q, k_cache, v_cache, out, lse, k, v, cache_seqlens, block_table = (
            tensor(x) for x in (q, k_cache, v_cache, out, lse, k, v, cache_seqlens, block_table))
        caches, results = [_to_gpu(x) for x in (k_cache, v_cache)], [_to_gpu(out), _to_gpu(lse)]
        kw["stream"] = torch.cuda.current_stream().cuda_stream
        _C.forward_kvcache(_to_gpu(q), *caches, *results, _to_gpu(k), _to_gpu(v),
                           _to_gpu(cache_seqlens), _to_gpu(block_table), _to_gpu(alibi_slopes),
                           **kw)
        torch.cuda.synchronize()
        for host, dev in zip((k_cache, v_cache, out, lse), caches + results):
            cls._copy_back(host, dev)

    @staticmethod
    def kvcache_refusals(clear=True):
        import torch
        from fmha import _C
        return _C.cuda_kvcache_refusals(torch.cuda.current_device(), clear)

    @classmethod
    def backward(cls, dout, q, k, v, out, lse, dq, dk, dv, dbias=None, **kw):
        import torch
        from fmha import _C
        arrays = {n: _to_gpu(kw.pop(n, None)) for n in cls._EXTRAS + ("dlse",)}
        grads = [_to_gpu(g) for g in (dq, dk, dv, dbias)]
        kw["stream"] = torch.cuda.current_stream().cuda_stream
        _C.backward(_to_gpu(dout), _to_gpu(q), _to_gpu(k), _to_gpu(v), _to_gpu(out),
                    _to_gpu(lse), *grads[:3], dbias=grads[3], **arrays, **kw)
        torch.cuda.synchronize()
        for host, dev in zip((dq, dk, dv, dbias), grads):
            cls._copy_back(host, dev)


# ----------------------------------------------------------------------------- conversion

def torch_dtype(name):
    import torch
    return getattr(torch, name)


def is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def to_f64(x):
    """float64 NumPy copy of a NumPy array or torch tensor (None passes through)."""
    if x is None:
        return None
    if is_torch(x):
        x = x.detach()
        if x.dtype == torch_dtype("bool"):
            return x.cpu().numpy()
        return x.to(torch_dtype("float64")).cpu().numpy()
    x = np.asarray(x)
    return x if x.dtype == bool else x.astype(np.float64)


def round_to(x64: np.ndarray, dtype: str) -> np.ndarray:
    """float64 values rounded to ``dtype`` (any of ALL_DTYPES), returned as float64."""
    if dtype == "float64":
        return x64
    if dtype in ("float32", "float16"):
        return x64.astype(dtype).astype(np.float64)
    import torch
    return torch.from_numpy(x64).to(torch.bfloat16).to(torch.float64).numpy()


def from_f64(x64: np.ndarray, dtype: str, lib: str):
    """A float64 NumPy array converted to ``dtype`` in ``lib`` ("numpy" or "torch")."""
    if lib == "numpy":
        if dtype == "bfloat16":
            raise ValueError("numpy has no bfloat16")
        return np.ascontiguousarray(x64.astype(dtype))
    import torch
    return torch.from_numpy(np.ascontiguousarray(x64)).to(torch_dtype(dtype))


def make_array(rng, shape, dtype="float32", lib="numpy", scale=1.0):
    return from_f64(rng.standard_normal(shape) * scale, dtype, lib)


def make_inputs(rng, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, head_dim_v=None,
                dtype="float32", lib="numpy"):
    """q, k, v, dout in (batch, seqlen, heads, dim) layout."""
    dv = head_dim if head_dim_v is None else head_dim_v
    q = make_array(rng, (batch, seqlen_q, heads_q, head_dim), dtype, lib)
    k = make_array(rng, (batch, seqlen_k, heads_kv, head_dim), dtype, lib)
    v = make_array(rng, (batch, seqlen_k, heads_kv, dv), dtype, lib)
    dout = make_array(rng, (batch, seqlen_q, heads_q, dv), dtype, lib)
    return q, k, v, dout


# ----------------------------------------------------------------------------- tolerance

def max_abs(x) -> float:
    x = np.asarray(x, dtype=np.float64)
    finite = x[np.isfinite(x)]
    return float(np.max(np.abs(finite))) if finite.size else 0.0


def _check_inf_pattern(name, actual, ref):
    """-inf exactly where the reference has -inf; no NaN; everything else finite."""
    assert not np.any(np.isnan(actual)), f"{name}: NaN in result"
    ref_inf = np.isneginf(ref)
    assert np.array_equal(np.isneginf(actual), ref_inf), (
        f"{name}: -inf pattern differs: {int(np.isneginf(actual).sum())} -inf entries vs "
        f"{int(ref_inf.sum())} in the reference")
    assert np.all(np.isfinite(actual[~ref_inf])), f"{name}: non-finite value where ref is finite"


def _finite_err(actual, ref):
    fin = np.isfinite(ref)
    if not fin.any():
        return 0.0
    return float(np.max(np.abs(actual[fin] - ref[fin])))


def _check_nonfinite_pattern(name, actual, ref):
    """Inputs holding NaN/Inf (docs/semantics.md): non-finite exactly where the reference is;
    which non-finite value (NaN, +inf, -inf) is not asserted."""
    fin_a, fin_r = np.isfinite(actual), np.isfinite(ref)
    if not np.array_equal(fin_a, fin_r):
        extra = np.argwhere(~fin_a & fin_r)
        missing = np.argwhere(fin_a & ~fin_r)
        raise AssertionError(
            f"{name}: non-finite pattern differs from the reference: {len(extra)} entries "
            f"non-finite only in the result (first {extra[:3].tolist()}), {len(missing)} "
            f"non-finite only in the reference (first {missing[:3].tolist()})")


def assert_close(name, actual, ref, dtype, naive=None, grad=False, result_dtype=None,
                 nonfinite=False, naive_ref=None, d_rounded=None, p_quantised=False):
    """Assert ``actual`` (fmha's result) matches ``ref`` (float64 reference).

    dtype: the input dtype of the computation. For low precision, ``naive`` (the naive
    low-precision result) is required. result_dtype: dtype ``actual`` is stored in (for the
    rounding floor; lse is float32 even for 16-bit inputs); defaults to ``dtype``.
    nonfinite: the inputs held NaN/Inf on purpose: the non-finite pattern must equal the
    reference's (instead of "-inf where the reference has it, NaN nowhere") and the finite
    entries follow the rule. naive_ref: the float64 result ``naive`` is measured against
    (default ``ref``), for a naive baseline computed on other inputs than ``ref``.
    d_rounded: for a 16-bit gradient, the float64 reference with D taken from the output
    rounded to ``dtype`` (reference_results(d_from=dtype)): twice its distance from ``ref``
    joins the floor.
    dtype "float8_e4m3fn": out of float8 inputs (result_dtype: its bfloat16 / float16), ref
    the exact attention of the dequantised inputs; twice the rounding of ref to
    result_dtype (the kernel's float32 out may round to the neighbour) plus float32-level
    error, plus FP8_P_TOL * max(max|ref|, 1) when the kernel rounds P to e4m3
    (p_quantised). lse of float8 inputs takes the float32 rule.
    """
    actual = to_f64(actual)
    ref = to_f64(ref)
    assert actual.shape == ref.shape, f"{name}: shape {actual.shape} != reference {ref.shape}"
    if nonfinite:
        _check_nonfinite_pattern(name, actual, ref)
    else:
        _check_inf_pattern(name, actual, ref)
    err = _finite_err(actual, ref)
    ref_max = max_abs(ref)
    if dtype in ("float64", "float32"):
        tol = TOL_F64 if dtype == "float64" else TOL_F32
        bound = tol * max(ref_max, REL_SCALE_FLOOR)
        rule = f"{tol:g}*max(max|ref|, {REL_SCALE_FLOOR:g})"
    elif dtype == "float8_e4m3fn":
        scale = max(ref_max, REL_SCALE_FLOOR)
        rounding = _finite_err(round_to(ref, result_dtype), ref)
        p_tol = FP8_P_TOL if p_quantised else 0.0
        bound = p_tol * scale + 2.0 * rounding + TOL_F32 * scale
        rule = (f"{p_tol:g}*max(max|ref|, 1) + 2*rounding({rounding:.3g}) + "
                f"{TOL_F32:g}*max(max|ref|, 1)")
    else:
        assert naive is not None, f"{name}: low-precision check needs the naive result"
        naive = to_f64(naive)
        mult = 3.0 if grad else 2.0
        naive_err = _finite_err(naive, ref if naive_ref is None else to_f64(naive_ref))
        # floor: rounding the exact answer to the stored dtype, plus float32-level error
        # (fmha accumulates in float32, so it carries that error even where the naive
        # low-precision result is exact, e.g. dS = P(dP - D) = 0 for a row with one key,
        # where naive softmax backward gives exactly 0 and fmha ~1e-6). TOL_F32 (2e-5) is
        # ~400x below a bfloat16 ulp and ~50x below a float16 ulp, so the floor never hides
        # a real low-precision error.
        # With d_rounded, also the error of taking D = rowsum(dO o O) from the stored, rounded
        # O (FlashAttention-2's backward, every backend): an error of the formulation that
        # the naive baseline, which never reads O, does not make -- largest where the exact
        # gradient is 0 (a row that sees one key: dS = P(dP - D) = 0). Twice: the kernel's
        # own O, computed in float32, may round to the neighbour of round(exact O).
        floor = (_finite_err(round_to(ref, result_dtype or dtype), ref)
                 + TOL_F32 * max(ref_max, REL_SCALE_FLOOR))
        if d_rounded is not None:
            floor += 2.0 * _finite_err(to_f64(d_rounded), ref)
        bound = mult * naive_err + floor
        rule = f"{mult:g}*naive_err({naive_err:.3g}) + floor({floor:.3g})"
    assert err <= bound, (f"{name} [{dtype}]: max abs error {err:.3g} > bound {bound:.3g} "
                          f"({rule}; max|ref| = {ref_max:.3g})")
    return err


# ----------------------------------------------------------------------------- naive torch

def visibility(seqlen_q, seqlen_k, causal=False, window=(-1, -1), alignment="bottom_right"):
    """(sq, sk) bool: the causal/window rule of docs/semantics.md."""
    left, right = window
    if causal:
        right = 0  # causal: no key after the diagonal, whatever window[1] said
    off = seqlen_k - seqlen_q if alignment == "bottom_right" else 0
    i = np.arange(seqlen_q)[:, None] + off
    j = np.arange(seqlen_k)[None, :]
    vis = np.ones((seqlen_q, seqlen_k), bool)
    if left >= 0:
        vis &= j >= i - left
    if right >= 0:
        vis &= j <= i + right
    return vis


def naive_attention_torch(q, k, v, *, scale=None, causal=False, window=(-1, -1),
                          alignment="bottom_right", bias=None, mask=None, alibi_slopes=None,
                          softcap=0.0, dropout_z=None):
    """Attention written plainly in torch, every step in q's dtype (differentiable).

    q (b, sq, hq, d), k (b, sk, hkv, d), v (b, sk, hkv, dv); dropout_z: the dropout
    multiplier (keep / (1 - p)), broadcastable to (b, hq, sq, sk), or None.
    Returns (out (b, sq, hq, dv), lse (b, hq, sq)).
    """
    import torch
    dt = q.dtype
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    qh = q.transpose(1, 2)
    kh = k.transpose(1, 2).repeat_interleave(g, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(g, dim=1)
    s = (qh @ kh.transpose(-1, -2)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias.to(dt)
    off = sk - sq if alignment == "bottom_right" else 0
    if alibi_slopes is not None:
        sl = to_f64(alibi_slopes)
        sl = sl[None] if sl.ndim == 1 else sl
        dist = np.abs(np.arange(sq)[:, None] + off - np.arange(sk)[None, :])
        s = s + torch.from_numpy(-sl[:, :, None, None] * dist[None, None]).to(dt)
    vis = torch.from_numpy(visibility(sq, sk, causal, window, alignment))[None, None]
    if mask is not None:
        vis = vis & mask
    with torch.no_grad():
        vis = vis & (s > -math.inf)
    s = s.masked_fill(~vis, -math.inf)
    any_row = vis.any(dim=-1, keepdim=True)
    p = torch.softmax(s, dim=-1).masked_fill(~any_row, 0.0)
    if dt == torch.float64:
        # The float64 reference lse by NumPy: torch.logsumexp in float64 was seen 1.6e-10
        # (relative) off in some states of a test process (tests/kernels/test_cpu_attention.py at
        # FMHA_CPU_ISA=avx2, one run in five), where NumPy and fmha agreed to 1e-15.
        s64 = s.detach().cpu().numpy()
        m = np.max(s64, axis=-1, keepdims=True)
        m = np.where(np.isfinite(m), m, 0.0)
        with np.errstate(divide="ignore"):
            lse = torch.from_numpy((m + np.log(np.exp(s64 - m).sum(-1, keepdims=True)))[..., 0])
    else:
        lse = torch.logsumexp(s, dim=-1)
    if dropout_z is not None:
        p = p * torch.as_tensor(dropout_z).to(dt)
    out = (p @ vh).transpose(1, 2)
    return out, lse


def leaf_copy(x, requires_grad=True):
    """A leaf copy of tensor ``x`` with ``x``'s strides. Tensor.clone() keeps the strides of a
    dense tensor only: a strided view (every other row, a slice of the heads) would come back
    contiguous, and the kernels would never see the layout a test builds."""
    import torch
    y = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
    with torch.no_grad():
        y.copy_(x)
    return y.requires_grad_(requires_grad)


def _autograd_results(attend, q, k, v, dout, bias, bias_grad):
    """attend(q, k, v, bias) -> (out, lse) on fresh leaf copies (same strides), backward with
    dout; a dict of out, lse and the gradients (dbias when bias_grad)."""
    leaves = [leaf_copy(x) for x in (q, k, v)]
    b = None
    if bias is not None:
        b = leaf_copy(bias, bias_grad)
    out, lse = attend(*leaves, b)
    out.backward(dout)
    res = dict(out=out.detach(), lse=lse.detach(), dq=leaves[0].grad, dk=leaves[1].grad,
               dv=leaves[2].grad)
    if bias_grad:
        res["dbias"] = b.grad
    return res


def naive_results(q, k, v, dout, *, bias=None, bias_grad=False, **kw):
    """Run naive_attention_torch with autograd on torch copies of (q, k, v, bias)."""
    return _autograd_results(lambda q_, k_, v_, b: naive_attention_torch(q_, k_, v_, bias=b, **kw),
                             q, k, v, dout, bias, bias_grad)


def reference_results(q, k, v, dout, *, bias=None, bias_grad=False, mask=None,
                      alibi_slopes=None, d_from=None, **kw):
    """fmha.reference forward and backward on float64 copies; dict like naive_results.
    d_from: a dtype name -- the backward takes D = rowsum(dout o out) from out rounded to it
    (what a kernel of that dtype does), for the tolerance rule's rounding floor."""
    from fmha import reference
    args = [to_f64(x) for x in (q, k, v)]
    extra = dict(bias=to_f64(bias), mask=to_f64(mask), alibi_slopes=to_f64(alibi_slopes))
    out, lse = reference.attention_forward(*args, **extra, **kw)
    d_out = None if d_from is None else round_to(out, d_from)
    dq, dk, dv, dbias = reference.attention_backward(to_f64(dout), *args, **extra, **kw,
                                                     out=d_out)
    res = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
    if bias_grad:
        res["dbias"] = dbias
    return res


def fmha_results(q, k, v, dout, *, bias=None, bias_grad=False, seed=None, **kw):
    """fmha forward and backward (NumPy: attention_backward; torch: autograd)."""
    import fmha
    if is_torch(q):
        return _autograd_results(
            lambda q_, k_, v_, b: fmha.attention(q_, k_, v_, bias=b, return_lse=True, **kw),
            q, k, v, dout, bias, bias_grad)
    out, lse = fmha.attention(q, k, v, bias=bias, return_lse=True, seed=seed, **kw)
    grads = fmha.attention_backward(dout, q, k, v, out, lse, bias=bias, bias_grad=bias_grad,
                                    seed=seed, **kw)
    res = dict(out=out, lse=lse, dq=grads[0], dk=grads[1], dv=grads[2])
    if bias_grad:
        res["dbias"] = grads[3]
    return res


def naive_baseline(q, k, v, dout, *, bias=None, bias_grad=False, ref_kw=None, **kw):
    """naive_results for the arguments of a check_against_reference call (NumPy arrays become
    torch tensors; dropout becomes the explicit multiplier of ref_kw's seed and offset)."""
    import torch
    tq = lambda x: None if x is None else (  # noqa: E731
        x if is_torch(x) else torch.from_numpy(np.ascontiguousarray(x)))
    nkw = {kk: vv for kk, vv in kw.items() if kk not in ("dropout_p",)}
    if kw.get("mask") is not None:
        nkw["mask"] = tq(kw["mask"])
    if kw.get("dropout_p", 0.0) > 0:
        from fmha._philox import dropout_keep_mask
        p = kw["dropout_p"]
        rk = ref_kw or {}
        keep = dropout_keep_mask(rk.get("seed", 0), rk.get("offset", 0), q.shape[0],
                                 q.shape[2], q.shape[1], k.shape[1], p)
        nkw["dropout_z"] = torch.from_numpy(keep / (1.0 - p))
    return naive_results(tq(q), tq(k), tq(v), tq(dout), bias=tq(bias), bias_grad=bias_grad,
                         **nkw)


def check_against_reference(q, k, v, dout, *, bias=None, bias_grad=False, seed=None,
                            ref_kw=None, nonfinite=False, **kw):
    """fmha vs fmha.reference, forward and backward, with the dtype's tolerance rule.

    Low-precision inputs must be torch tensors (or NumPy float16, which is converted to
    torch for the naive baseline). ref_kw: extra keywords for the reference only
    (e.g. seed/offset for dropout). nonfinite: the inputs hold NaN/Inf on purpose
    (assert_close's nonfinite; float32/float64 only: the naive 16-bit baseline is not defined
    there). Returns (fmha results, reference results).
    """
    from fmha._validate import dtype_name
    dtype = dtype_name(q)
    res = fmha_results(q, k, v, dout, bias=bias, bias_grad=bias_grad, seed=seed, **kw)
    ref = reference_results(q, k, v, dout, bias=bias, bias_grad=bias_grad,
                            **kw, **(ref_kw or {}))
    # output dtypes / shapes / dbias shape must follow the contract
    assert tuple(res["out"].shape) == tuple(q.shape[:-1]) + (v.shape[-1],)
    assert tuple(res["lse"].shape) == (q.shape[0], q.shape[2], q.shape[1])
    assert dtype_name(res["out"]) == dtype
    assert dtype_name(res["lse"]) == ("float64" if dtype == "float64" else "float32")
    for g, x in (("dq", q), ("dk", k), ("dv", v)):
        assert tuple(res[g].shape) == tuple(x.shape), g
        assert dtype_name(res[g]) == dtype, g
    if bias_grad:
        assert tuple(res["dbias"].shape) == tuple(bias.shape)
    assert not (nonfinite and dtype in LOW_PRECISION), "nonfinite: float32/float64 inputs only"
    naive = d_rounded = None
    if dtype in LOW_PRECISION:
        naive = naive_baseline(q, k, v, dout, bias=bias, bias_grad=bias_grad, ref_kw=ref_kw,
                               **kw)
        d_rounded = reference_results(q, k, v, dout, bias=bias, bias_grad=bias_grad,
                                      d_from=dtype, **kw, **(ref_kw or {}))
    for key in ("out", "lse", "dq", "dk", "dv", "dbias"):
        if key not in ref:
            continue
        rdt = None
        if key == "lse":
            rdt = "float64" if dtype == "float64" else "float32"
        assert_close(key, res[key], ref[key], dtype,
                     naive=None if naive is None else naive[key],
                     grad=key.startswith("d"), result_dtype=rdt, nonfinite=nonfinite,
                     d_rounded=None if d_rounded is None or key in ("out", "lse")
                     else d_rounded[key])
    return res, ref


def compile_and_compare(model, *inputs, require_grads=True):
    """torch.compile(fullgraph=True, backend="aot_eager") of `model`: explain() sees one graph
    and no break, and the compiled forward and gradients (input and parameters) equal eager's.
    With require_grads, every parameter must also receive a nonzero gradient."""
    import torch

    explanation = torch._dynamo.explain(model)(*inputs)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = inputs[0]
    results = []
    for fn in (compiled, model):
        model.zero_grad()
        x.grad = None
        y = fn(*inputs)
        y.backward(torch.linspace(-1, 1, y.numel()).view_as(y))
        results.append((y.detach(), x.grad.clone(),
                        {n: p.grad.clone() for n, p in model.named_parameters()}))
    (y_c, gx_c, gp_c), (y_e, gx_e, gp_e) = results
    torch.testing.assert_close(y_c, y_e, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gx_c, gx_e, rtol=1e-6, atol=1e-6)
    for n in gp_e:
        if require_grads:
            assert gp_e[n].abs().sum() > 0, f"{n}: no gradient"
        torch.testing.assert_close(gp_c[n], gp_e[n], rtol=1e-6, atol=1e-6, msg=n)
