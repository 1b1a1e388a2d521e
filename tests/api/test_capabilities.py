"""The capability table (csrc/fmha/capabilities.h) against both validators.

The table reaches Python as fmha._C.capabilities(). Each test walks it: for each backend,
every dtype it lists and one it does not, head_dim and head_dim_v at the lower bound, the
upper bound and one past each, the 8-bit cache encodings and their head-dim limit, and every
feature. Each is put to

* the C++ validation contract (check_params), through fmha._C.check_forward /
  check_backward / check_forward_kvcache: the params filled from host arrays as fmha._C
  fills them (as the emulator does for 'cuda'), then checked for that backend; no kernel runs;
* the Python layer: for the CPU through the public API (the kernels run); for CUDA through
  _validate.prepare / fmha.kvcache with the arrays' device reported as cuda:0 and the
  driver query answered "usable" (the only part stubbed: this host has no GPU);
* the emulated CUDA kernels (fmha._cuda_emu, in testing builds): a real launch runs
  check_params before any kernel.

Each must accept exactly what the table lists and refuse the rest, at the same bound.
tools/capability_matrix.py --check keeps docs/features.md in step with the table.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import fmha
from fmha import _C, _core, _validate
from fmha import kvcache as fkv

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
CAPS = _C.capabilities()
BACKENDS = CAPS["backends"]
FEATURES = [f["key"] for f in CAPS["features"]]
REFUSED = (ValueError, TypeError, NotImplementedError)

#: Candidate dtypes: every float dtype fmha knows and two it never takes. The table decides
#: which a backend must accept.
CANDIDATE_DTYPES = ("float64", "float32", "bfloat16", "float16", "int32", "uint8")
TORCH_DTYPE = {n: getattr(torch, n) for n in CANDIDATE_DTYPES}


def _emu():
    try:
        from fmha import _cuda_emu
    except ImportError:
        return None
    return _cuda_emu


# ---------------------------------------------------------------- the table itself

def test_table_shape():
    """Plain data; every backend answers every feature; the ranges are sane; the Python
    constants other modules import are the table's values."""
    assert set(BACKENDS) == {"cpu", "cuda"}
    assert len(FEATURES) == len(set(FEATURES))
    for name, b in BACKENDS.items():
        lo, hi = b["head_dim"]
        assert lo >= 1 and hi >= lo
        assert b["kv8_head_dim_max"] >= 1 and hi >= b["kv8_head_dim_max"]
        assert set(b["dtypes"]) <= {"float64", "float32", "bfloat16", "float16"}
        assert set(b["kv_cache_dtypes"]) <= set(fmha.kvquant.FORMATS)
        assert set(b["features"]) == set(FEATURES)
        assert set(b["features"].values()) <= {"yes", "no", "ignored"}
    assert _validate.MAX_HEAD_DIM_CPU == BACKENDS["cpu"]["head_dim"][1]
    assert _validate.MAX_HEAD_DIM_CUDA == BACKENDS["cuda"]["head_dim"][1]
    assert _validate.CUDA_DTYPES == tuple(BACKENDS["cuda"]["dtypes"])
    # The codes the table's encodings travel as (kv_code of fmha._C.forward_kvcache).
    assert fmha.kvquant.CODES == {"int8": 1, "float8_e4m3fn": 2, "float8_e5m2": 3}


# ---------------------------------------------------------------- building calls

S = dict(scale=0.5, softcap=0.0, window_left=-1, window_right=-1, bottom_right=True,
         dropout_p=0.0)


def _t(shape, dtype="float16", seed=0):
    g = torch.Generator().manual_seed(seed)
    dt = TORCH_DTYPE[dtype]
    if dt.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dt)
    return torch.randint(0, 3, shape, generator=g, dtype=torch.int64).to(dt)


def _lse_dtype(dtype):
    return torch.float64 if dtype == "float64" else torch.float32


def _dense(dtype="float16", d=8, dv=None, b=1, sq=3, sk=5, hq=2, hkv=2):
    dv = d if dv is None else dv
    q, k, v = _t((b, sq, hq, d), dtype, 1), _t((b, sk, hkv, d), dtype, 2), _t((b, sk, hkv, dv), dtype, 3)
    out = torch.zeros((b, sq, hq, dv), dtype=TORCH_DTYPE[dtype])
    lse = torch.zeros((b, hq, sq), dtype=_lse_dtype(dtype))
    return q, k, v, out, lse


def cxx_forward(backend, dtype="float16", d=8, dv=None, **kw):
    q, k, v, out, lse = _dense(dtype, d, dv)
    _C.check_forward(q, k, v, out, lse, backend=backend, **dict(S, **kw))


def cxx_kvcache(backend, d=8, dv=None, code=0, paged=False, dtype="float16"):
    dv = d if dv is None else dv
    b, sq, hq, hkv, cap = 1, 1, 2, 1, 8
    q = _t((b, sq, hq, d), dtype)
    cache_dt = "uint8" if code else dtype
    slots, rows = (2, 4) if paged else (b, cap)
    kc, vc = _t((slots, rows, hkv, d), cache_dt), _t((slots, rows, hkv, dv), cache_dt)
    out = torch.zeros((b, sq, hq, dv), dtype=TORCH_DTYPE[dtype])
    lse = torch.zeros((b, hq, sq), dtype=torch.float32)
    extra = {}
    if paged:
        extra["block_table"] = torch.tensor([[0, 1]], dtype=torch.int32)
    if code:
        extra["k_scale"] = extra["v_scale"] = torch.ones(hkv, dtype=torch.float32)
    _C.check_forward_kvcache(q, kc, vc, out, lse, cache_seqlens=torch.tensor([3], dtype=torch.int32),
                             backend=backend, scale=0.5, softcap=0.0, window_left=-1,
                             window_right=-1, **({"kv_code": code} if code else {}), **extra)


# Each feature as a call of the C++ contract: (function, kwargs maker). "sinks" is a
# composition in the Python layer (fmha/_sinks.py) on the kernels' out and lse: no kernel
# argument stands for it, so it is checked through the Python layer only.
def _feature_call(backend, key):
    dt = "float16"
    q, k, v, out, lse = _dense(dt)
    B, SQ, SK, HQ = 1, 3, 5, 2
    if key == "forward":
        return lambda: _C.check_forward(q, k, v, out, lse, backend=backend, **S)
    if key in ("backward", "dbias", "lse_grad", "deterministic_backward"):
        extra, settings = {}, {}
        if key == "dbias":
            extra = dict(bias=_t((B, HQ, SQ, SK), dt), dbias=torch.zeros((B, HQ, SQ, SK)))
        if key == "lse_grad":
            extra = dict(dlse=torch.zeros_like(lse))
        if key == "deterministic_backward":
            settings = dict(deterministic=True)
        return lambda: _C.check_backward(out.clone(), q, k, v, out, lse, torch.zeros_like(q),
                                         torch.zeros_like(k), torch.zeros_like(v),
                                         backend=backend, **extra, **S, **settings)
    if key == "varlen":
        qv, kv_, vv = _t((3, HQ, 8), dt), _t((5, 2, 8), dt), _t((5, 2, 8), dt)
        cu_q = torch.tensor([0, 1, 3], dtype=torch.int32)
        cu_k = torch.tensor([0, 2, 5], dtype=torch.int32)
        return lambda: _C.check_forward(qv, kv_, vv, torch.zeros_like(qv),
                                        torch.zeros((HQ, 3)), cu_seqlens_q=cu_q,
                                        cu_seqlens_k=cu_k, max_seqlen_q=2, max_seqlen_k=3,
                                        backend=backend, **S)
    if key == "gqa":
        q2, k2, v2, out2, lse2 = _dense(dt, hq=2, hkv=1)
        return lambda: _C.check_forward(q2, k2, v2, out2, lse2, backend=backend, **S)
    if key == "lse_optional":
        return lambda: _C.check_forward(q, k, v, out, None, backend=backend, **S)
    if key == "fp8_forward":
        q8, k8, v8 = (x.to(torch.float8_e4m3fn) for x in (q, k, v))
        out8 = torch.zeros(out.shape, dtype=torch.bfloat16)
        return lambda: _C.check_forward(q8, k8, v8, out8, lse, backend=backend, **S)
    if key in ("kv_cache", "paged_kv_cache", "kv_cache_8bit"):
        return lambda: cxx_kvcache(backend, code=1 if key == "kv_cache_8bit" else 0,
                                   paged=key == "paged_kv_cache")
    arrays, settings = {}, {}
    if key == "causal_window":
        settings = dict(window_left=2, window_right=0)
    elif key == "bias":
        arrays = dict(bias=_t((B, HQ, SQ, SK), dt))
    elif key == "mask":
        arrays = dict(mask=torch.ones((B, HQ, SQ, SK), dtype=torch.bool))
    elif key == "alibi":
        arrays = dict(alibi_slopes=torch.ones((B, HQ), dtype=torch.float64))
    elif key == "softcap":
        settings = dict(softcap=5.0)
    elif key == "dropout":
        settings = dict(dropout_p=0.1, seed=3)
    elif key == "num_splits":
        settings = dict(num_splits=2)
    elif key == "block_mask":
        arrays = dict(block_index=torch.full((1, 1, 1, 1), -2, dtype=torch.int32),
                      block_masks=torch.ones((1, 4, 8), dtype=torch.bool))
    else:
        raise AssertionError(f"no C++ call for feature {key!r}: add one")
    return lambda: _C.check_forward(q, k, v, out, lse, backend=backend, **arrays,
                                    **dict(S, **settings))


PYTHON_ONLY_FEATURES = {"sinks"}


# ---------------------------------------------------------------- the Python layer

class _Recorder:
    """A kernel module that records forward_kvcache calls and runs nothing."""

    def __init__(self):
        self.calls = []

    def forward_kvcache(self, *args, **kw):
        self.calls.append((args, kw))


@pytest.fixture
def as_cuda(monkeypatch):
    """The Python layer as it treats arrays on cuda:0 with a usable GPU: device_of reports
    cuda:0, the driver query says usable, the current stream is 0; everything else runs as
    is. A fresh Spec cache, so no Spec validated for the CPU answers."""
    from fmha import _kvcache
    for module in (_validate, _kvcache):
        monkeypatch.setattr(module, "device_of", lambda x: "cuda:0")
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: type("Stream", (), {"cuda_stream": 0})())
    monkeypatch.setattr(_validate, "_cuda_device_usable", lambda index: (True, ""))
    monkeypatch.setattr(_validate, "_SPEC_CACHE", {})


def py_dense(backend, dtype="float32", d=8, dv=None, **kw):
    """The Python layer's verdict on a dense call: on the CPU the public call itself."""
    dv = d if dv is None else dv
    q, k, v = _t((1, 3, 2, d), dtype, 1), _t((1, 5, 2, d), dtype, 2), _t((1, 5, 2, dv), dtype, 3)
    if backend == "cpu":
        out = fmha.attention(q, k, v, **kw)
        assert out.shape == (1, 3, 2, dv) and torch.isfinite(out.double()).all()
    else:
        _validate.prepare(q, k, v, **kw)


def _verdict(fn):
    """'accept', or the refusal (its exception)."""
    try:
        fn()
    except REFUSED as e:
        return e
    return "accept"


def _assert(verdict, accept, what):
    if accept:
        assert verdict == "accept", f"{what}: expected to be accepted, refused with {verdict!r}"
    else:
        assert verdict != "accept", f"{what}: expected a refusal, was accepted"


# ---------------------------------------------------------------- dtypes

@pytest.mark.parametrize("dtype", CANDIDATE_DTYPES)
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_dtypes_cxx(backend, dtype):
    accept = dtype in BACKENDS[backend]["dtypes"]
    _assert(_verdict(lambda: cxx_forward(backend, dtype)), accept, f"C++ {backend} {dtype}")


@pytest.mark.parametrize("dtype", CANDIDATE_DTYPES)
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_dtypes_python(backend, dtype, request):
    if backend == "cuda":
        request.getfixturevalue("as_cuda")
    accept = dtype in BACKENDS[backend]["dtypes"]
    verdict = _verdict(lambda: py_dense(backend, dtype))
    _assert(verdict, accept, f"Python {backend} {dtype}")
    if not accept and dtype in _validate._FLOAT_NAMES:
        # A float dtype another backend takes: this backend's own wording, from the table.
        assert isinstance(verdict, NotImplementedError), verdict
        assert "/".join(BACKENDS[backend]["dtypes"]) in str(verdict), verdict


@pytest.mark.parametrize("dtype", CANDIDATE_DTYPES)
def test_dtypes_emulated_cuda(dtype):
    emu = _emu()
    if emu is None:
        pytest.skip("fmha._cuda_emu is not built (FMHA_BUILD_TESTING=ON builds it)")
    q, k, v, out, lse = _dense(dtype, d=8)
    accept = dtype in BACKENDS["cuda"]["dtypes"]
    _assert(_verdict(lambda: emu.forward(q, k, v, out, lse, **S)), accept, f"emulator {dtype}")


# ---------------------------------------------------------------- head dims

def _head_dim_cases():
    for backend, b in BACKENDS.items():
        lo, hi = b["head_dim"]
        for which in ("head_dim", "head_dim_v"):
            for d, accept in ((lo, True), (lo - 1, False), (hi, True), (hi + 1, False)):
                yield pytest.param(backend, which, d, accept, id=f"{backend}-{which}-{d}")


def _dims(which, d):
    return (d, 8) if which == "head_dim" else (8, d)


@pytest.mark.parametrize("backend,which,d,accept", list(_head_dim_cases()))
def test_head_dims_cxx(backend, which, d, accept):
    hd, hdv = _dims(which, d)
    verdict = _verdict(lambda: cxx_forward(backend, "float16", hd, hdv))
    _assert(verdict, accept, f"C++ {backend} {which}={d}")
    if not accept and d > 0:  # the range in the message is the table's
        lo, hi = BACKENDS[backend]["head_dim"]
        assert f"expected {lo}..{hi} on {BACKENDS[backend]['label']}" in str(verdict), verdict


@pytest.mark.parametrize("backend,which,d,accept", list(_head_dim_cases()))
def test_head_dims_python(backend, which, d, accept, request):
    if backend == "cuda":
        request.getfixturevalue("as_cuda")
    hd, hdv = _dims(which, d)
    verdict = _verdict(lambda: py_dense(backend, "float16", hd, hdv))
    _assert(verdict, accept, f"Python {backend} {which}={d}")
    if not accept:
        assert str(verdict).startswith("q:" if which == "head_dim" else "v:"), verdict


@pytest.mark.parametrize("backend,which,d,accept",
                         [p for p in _head_dim_cases() if p.values[0] == "cuda"])
def test_head_dims_emulated_cuda(backend, which, d, accept):
    emu = _emu()
    if emu is None:
        pytest.skip("fmha._cuda_emu is not built (FMHA_BUILD_TESTING=ON builds it)")
    hd, hdv = _dims(which, d)
    q, k, v, out, lse = _dense("float16", hd, hdv, sq=1, sk=2, hq=1, hkv=1)
    verdict = _verdict(lambda: emu.forward(q, k, v, out, lse, **S))
    if accept and isinstance(verdict, ValueError) and "no head-dim tile" in str(verdict):
        # The contract accepted it; this testing build compiled fewer tiles (FMHA_EMU_HEAD_DIMS).
        pytest.skip(f"the emulator build lacks the tile for head_dim {max(hd, hdv)}: {verdict}")
    _assert(verdict, accept, f"emulator {which}={d}")


# ---------------------------------------------------------------- 8-bit KV caches

def _kv8_cases():
    for backend, b in BACKENDS.items():
        top = b["kv8_head_dim_max"]
        for fmt in fmha.kvquant.FORMATS:
            yield pytest.param(backend, fmt, 8, fmt in b["kv_cache_dtypes"],
                               id=f"{backend}-{fmt}-8")
        fmt = b["kv_cache_dtypes"][0]
        yield pytest.param(backend, fmt, top, True, id=f"{backend}-{fmt}-{top}")
        yield pytest.param(backend, fmt, top + 1, False, id=f"{backend}-{fmt}-{top + 1}")


@pytest.mark.parametrize("backend,fmt,d,accept", list(_kv8_cases()))
def test_kv8_cxx(backend, fmt, d, accept):
    verdict = _verdict(lambda: cxx_kvcache(backend, d=d, code=fmha.kvquant.CODES[fmt]))
    _assert(verdict, accept, f"C++ {backend} {fmt} head_dim {d}")


@pytest.mark.parametrize("backend,fmt,d,accept", list(_kv8_cases()))
def test_kv8_python(backend, fmt, d, accept, request):
    """fmha.kvcache.attention_with_kvcache on an 8-bit cache (torch float8 / int8 tensors).
    CPU: the call runs; CUDA: the Python checks run and an accepted call reaches the kernel
    module (a recorder here)."""
    if backend == "cuda":
        request.getfixturevalue("as_cuda")
    hkv, cap = 1, 8
    q = _t((1, 1, 2, d), "float16")
    kc = torch.zeros((1, cap, hkv, d), dtype=getattr(torch, fmt))
    vc = torch.zeros((1, cap, hkv, d), dtype=getattr(torch, fmt))
    scale = torch.ones(hkv, dtype=torch.float32)
    lens = torch.tensor([2], dtype=torch.int32)

    def call():
        fkv.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, k_scale=scale, v_scale=scale)

    if backend == "cuda":  # the checks only: the call reaches a kernel module that records it
        with _core._kernel_module(_Recorder()) as rec:
            verdict = _verdict(call)
        assert (verdict == "accept") == bool(rec.calls)
    else:
        verdict = _verdict(call)
    _assert(verdict, accept, f"Python {backend} {fmt} head_dim {d}")


# ---------------------------------------------------------------- features

@pytest.mark.parametrize("key", [k for k in FEATURES if k not in PYTHON_ONLY_FEATURES])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_features_cxx(backend, key):
    accept = BACKENDS[backend]["features"][key] != "no"
    _assert(_verdict(_feature_call(backend, key)), accept, f"C++ {backend} {key}")


#: The features the Python layer's prepare() sees, as keyword arguments of fmha.attention.
def _py_feature_kwargs(key):
    B, SQ, SK, HQ = 1, 3, 5, 2
    return {
        "forward": {},
        "causal_window": dict(causal=True, window=(2, -1)),
        "bias": dict(bias=_t((B, HQ, SQ, SK), "float16")),
        "mask": dict(mask=torch.ones((B, HQ, SQ, SK), dtype=torch.bool)),
        "alibi": dict(alibi_slopes=torch.ones(HQ, dtype=torch.float16)),
        "softcap": dict(softcap=5.0),
        "dropout": dict(dropout_p=0.1),
        "num_splits": dict(num_splits=2),
    }.get(key)


@pytest.mark.parametrize("key", [k for k in FEATURES if _py_feature_kwargs(k) is not None])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_features_python(backend, key, request):
    if backend == "cuda":
        request.getfixturevalue("as_cuda")
    accept = BACKENDS[backend]["features"][key] != "no"
    verdict = _verdict(lambda: py_dense(backend, "float16", **_py_feature_kwargs(key)))
    _assert(verdict, accept, f"Python {backend} {key}")


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_fp8_forward_python(backend, request):
    """float8_e4m3fn inputs through the Python layer: the CPU runs them (the public call),
    CUDA as the table says."""
    if backend == "cuda":
        request.getfixturevalue("as_cuda")
    q, k, v = (x.to(torch.float8_e4m3fn) for x in _dense("float32")[:3])
    if backend == "cpu":
        call = lambda: fmha.attention(q, k, v, descale_q=torch.tensor(0.5))  # noqa: E731
    else:
        call = lambda: _validate.prepare(q, k, v, float8=True)  # noqa: E731
    accept = BACKENDS[backend]["features"]["fp8_forward"] != "no"
    _assert(_verdict(call), accept, f"Python {backend} fp8_forward")


def test_features_python_cpu_calls():
    """The CPU features outside fmha.attention's keywords, through the public API: varlen,
    GQA, sinks, the backward with dbias and dlse, KV caches contiguous and paged."""
    caps = BACKENDS["cpu"]["features"]
    assert all(caps[k] == "yes" for k in ("varlen", "gqa", "sinks", "backward", "dbias",
                                          "lse_grad", "kv_cache", "paged_kv_cache"))
    q, k, v = _t((4, 2, 8), "float32"), _t((6, 1, 8), "float32"), _t((6, 1, 8), "float32")
    cu_q, cu_k = (torch.tensor(x, dtype=torch.int32) for x in ([0, 1, 4], [0, 2, 6]))
    assert fmha.attention_varlen(q, k, v, cu_q, cu_k).shape == (4, 2, 8)
    q, k, v = (_t(s, "float32").requires_grad_(True) for s in ((1, 3, 2, 8), (1, 5, 1, 8),
                                                               (1, 5, 1, 8)))
    bias = _t((1, 2, 3, 5), "float32").requires_grad_(True)
    out, lse = fmha.attention(q, k, v, bias=bias, return_lse=True)
    (out.sum() + lse.sum()).backward()
    assert all(x.grad is not None for x in (q, k, v, bias))
    sinks = torch.zeros(2)
    assert fmha.attention(q.detach(), k.detach(), v.detach(), sinks=sinks).shape == (1, 3, 2, 8)
    qd = _t((1, 1, 2, 8), "float32")
    kc, vc = torch.zeros((1, 8, 1, 8)), torch.zeros((1, 8, 1, 8))
    lens = torch.tensor([3], dtype=torch.int32)
    assert fkv.attention_with_kvcache(qd, kc, vc, cache_seqlens=lens).shape == (1, 1, 2, 8)
    kp, vp = torch.zeros((2, 4, 1, 8)), torch.zeros((2, 4, 1, 8))
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    assert fkv.attention_with_kvcache(qd, kp, vp, cache_seqlens=lens, block_table=table).shape == (1, 1, 2, 8)


# ---------------------------------------------------------------- the generated docs

def test_feature_matrix_is_current():
    """docs/features.md (and README.md's block, when it has the markers) are what
    tools/capability_matrix.py writes from this build's table."""
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "capability_matrix.py"),
                          "--check"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


def test_feature_matrix_check_fails_when_stale(tmp_path, monkeypatch):
    """--check exits 1 on a page that differs from the table's rendering."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("capability_matrix",
                                                  ROOT / "tools" / "capability_matrix.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    page = tmp_path / "features.md"
    page.write_text(tool.features_md(CAPS).replace("| yes", "| no", 1))
    monkeypatch.setattr(tool, "FEATURES_MD", page)
    monkeypatch.setattr(tool, "README", tmp_path / "README.md")
    assert tool.main(["--check"]) == 1
    page.write_text(tool.features_md(CAPS))
    assert tool.main(["--check"]) == 0
    readme = tmp_path / "README.md"
    readme.write_text(f"top\n{tool.BEGIN}\nold\n{tool.END}\nbottom\n")
    assert tool.main(["--check"]) == 1
    assert tool.main([]) == 0 and tool.main(["--check"]) == 0
    text = readme.read_text()
    assert text.startswith("top\n") and text.endswith(f"{tool.END}\nbottom\n")
    assert "| head_dim |" in text
