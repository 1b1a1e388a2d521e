"""Argument validation and normalisation, shared by the NumPy and torch paths.

Every user-facing entry point funnels through :func:`prepare`, which checks each argument
and raises ``TypeError`` (wrong kind of thing) or ``ValueError`` (wrong value) naming the
argument, what was received and what was expected. What comes out (:class:`Spec`) is what
the core's params struct needs; nothing past this point has to think about user input.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import sys
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import numpy as np

from . import _C

#: The capability table of the compiled core (csrc/fmha/capabilities.h, through
#: fmha._C.capabilities()): per backend ("cpu", "cuda") its dtypes, head-dim range, 8-bit
#: cache encodings and their head-dim limit, and its features. Every backend limit below is
#: read from it, never spelled here; the reasons for each limit are in the table.
CAPABILITIES = _C.capabilities()
_BACKENDS = CAPABILITIES["backends"]

#: Largest head_dim / head_dim_v the CPU kernels accept.
MAX_HEAD_DIM_CPU = _BACKENDS["cpu"]["head_dim"][1]
#: Largest head_dim / head_dim_v the CUDA kernels accept (their widest tile).
MAX_HEAD_DIM_CUDA = _BACKENDS["cuda"]["head_dim"][1]
#: Dtypes the CUDA kernels take.
CUDA_DTYPES = tuple(_BACKENDS["cuda"]["dtypes"])
#: Sequence lengths and counts index int32 offsets in the kernels: a shape rule of every
#: backend, not a capability of one.
_MAX_SEQLEN = 2**31 - 1

_NUMPY_FLOATS = {np.dtype(np.float64): "float64", np.dtype(np.float32): "float32",
                 np.dtype(np.float16): "float16"}


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "dtype") and hasattr(x, "device")


def _is_cupy(x) -> bool:
    return type(x).__module__.startswith("cupy") and hasattr(x, "__cuda_array_interface__")


def _is_jax(x) -> bool:
    return type(x).__module__.startswith(("jax", "jaxlib")) and hasattr(x, "__dlpack__")


def kind_of(x) -> str:
    """'numpy', 'torch', 'cupy', or '' for anything else."""
    if isinstance(x, np.ndarray):
        return "numpy"
    if _is_torch(x):
        return "torch"
    if _is_cupy(x):
        return "cupy"
    return ""


def dtype_name(x) -> str:
    """'float64' | 'float32' | 'bfloat16' | 'float16' | '<other>' of an array."""
    if isinstance(x, np.ndarray) or _is_cupy(x):
        return _NUMPY_FLOATS.get(np.dtype(x.dtype), str(x.dtype))
    return str(x.dtype).replace("torch.", "")


def device_of(x) -> str:
    """'cpu' or 'cuda:N' of a NumPy / torch / CuPy array."""
    if isinstance(x, np.ndarray):
        return "cpu"
    if _is_cupy(x):
        return f"cuda:{x.device.id}"
    d = x.device
    return "cpu" if d.type == "cpu" else f"{d.type}:{d.index if d.index is not None else 0}"


def to_host(x) -> np.ndarray:
    """A NumPy copy (or view) of a small array on any device (used for cu_seqlens)."""
    if isinstance(x, np.ndarray):
        return x
    if _is_cupy(x):
        return x.get()
    return x.detach().cpu().numpy()


#: The floating-point dtypes some backend takes (a dtype outside every backend's list is the
#: wrong kind of thing, a TypeError; one the call's backend lacks is NotImplementedError).
_FLOAT_NAMES = tuple(dict.fromkeys(d for b in _BACKENDS.values() for d in b["dtypes"]))


def backend_of(device: str) -> str:
    """The capability table's backend for an array on `device` ('cpu' or 'cuda:N')."""
    return "cpu" if device == "cpu" else "cuda"


def check_head_dims(device: str, head_dims, kv8: bool = False) -> None:
    """Each (argument name, head dim) of `head_dims` within the range of `device`'s backend
    (with 8-bit KV caches also within their limit); ValueError naming the argument."""
    caps = _BACKENDS[backend_of(device)]
    lo, hi = caps["head_dim"]
    for name, d in head_dims:
        if d < lo:
            raise ValueError(f"{name}: head_dim must be >= {lo}, got {d}")
        if d > hi:
            others = [f"{b['label']} takes up to {b['head_dim'][1]}"
                      for b in _BACKENDS.values() if b is not caps and b["head_dim"][1] > hi]
            raise ValueError(f"{name}: head_dim {d} is over the limit of {hi} on {device}"
                             + (f" (the {', '.join(others)})" if others else ""))
        if kv8 and d > caps["kv8_head_dim_max"]:
            raise ValueError(f"{name}: 8-bit caches take head_dim up to "
                             f"{caps['kv8_head_dim_max']} on {device}, got {d}")


def _describe(x) -> str:
    if kind_of(x):
        return f"{kind_of(x)} array of shape {tuple(x.shape)} and dtype {dtype_name(x)}"
    return f"{type(x).__name__} {x!r}"[:120]


def _check_array(name: str, x, kind: str, ndims: Tuple[int, ...]):
    k = kind_of(x)
    if not k:
        raise TypeError(f"{name}: expected a torch.Tensor, numpy.ndarray or cupy.ndarray, got "
                        f"{_describe(x)}")
    if k != kind:
        raise TypeError(f"{name}: expected a {kind} array like q, got a {k} array")
    if x.ndim not in ndims:
        want = " or ".join(str(n) for n in ndims)
        raise ValueError(f"{name}: expected {want} dimensions, got shape {tuple(x.shape)}")


def _check_float(name: str, x, like_dtype: Optional[str] = None):
    dt = dtype_name(x)
    if dt not in _FLOAT_NAMES:
        raise TypeError(f"{name}: expected a floating-point dtype ({', '.join(_FLOAT_NAMES)}), "
                        f"got {dt}")
    if like_dtype is not None and dt != like_dtype:
        raise TypeError(f"{name}: dtype {dt} differs from q's {like_dtype}")


def _check_number(name: str, x, *, lo=None, hi=None, lo_open=False, hi_open=False) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name}: expected a real number, got {_describe(x)}")
    x = float(x)
    if not math.isfinite(x):
        raise ValueError(f"{name}: expected a finite number, got {x}")
    if lo is not None and (x < lo or (lo_open and x == lo)):
        raise ValueError(f"{name}: expected {'>' if lo_open else '>='} {lo}, got {x}")
    if hi is not None and (x > hi or (hi_open and x == hi)):
        raise ValueError(f"{name}: expected {'<' if hi_open else '<='} {hi}, got {x}")
    return x


def _check_int(name: str, x, lo: int) -> int:
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {_describe(x)}")
    if int(x) < lo:
        raise ValueError(f"{name}: expected an int >= {lo}, got {int(x)}")
    return int(x)


def _broadcastable(shape, target) -> bool:
    if len(shape) > len(target):
        return False
    for s, t in zip(reversed(shape), reversed(target)):
        if s != 1 and s != t:
            return False
    return True


@dataclass(frozen=True)
class Spec:
    """Normalised arguments of one call (what the params struct needs)."""

    kind: str            # "numpy" | "cupy" | "torch" (kind_of(q))
    dtype: str           # q's dtype name
    varlen: bool
    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int        # max over sequences when varlen
    seqlen_k: int
    head_dim: int
    head_dim_v: int
    scale: float
    softcap: float
    window_left: int
    window_right: int
    bottom_right: bool
    dropout_p: float
    bias_shape: Optional[Tuple[int, ...]]  # the user's bias shape (for dbias)
    num_splits: int = 0  # CUDA forward key splits (0 = by occupancy); not in settings()

    @property
    def full(self) -> Tuple[int, int, int, int]:
        """(batch, heads_q, seqlen_q, seqlen_k): what bias and mask broadcast to."""
        return (self.batch, self.heads_q, self.seqlen_q, self.seqlen_k)

    def settings(self) -> dict:
        """The keyword settings of fmha._C.forward / backward (seed/offset/threads apart)."""
        return dict(scale=self.scale, softcap=self.softcap, window_left=self.window_left,
                    window_right=self.window_right, bottom_right=self.bottom_right,
                    dropout_p=self.dropout_p)

    @functools.cached_property
    def kernel_settings(self) -> dict:
        """settings() plus num_splits when it is not 0, built once per Spec (a repeated call
        finds its Spec in the cache): callers add num_threads, seed and stream to a copy."""
        kw = self.settings()
        if self.num_splits:
            kw["num_splits"] = self.num_splits
        return kw


#: Specs of dense calls without bias, mask or ALiBi (the calls a model's layer loop repeats)
#: by everything :func:`prepare` reads of them but k's and v's sequence length: validating
#: such a call again gives the same Spec (with that length), so a repeated call -- or the
#: next step of a decode loop -- costs a dictionary lookup. Bounded; cleared when full.
_SPEC_CACHE: dict = {}
_SPEC_CACHE_SIZE = 256


def _cache_key(q, k, v, causal, window, alignment, scale, dropout_p, softcap, num_splits,
               float8):
    """The cache key of a plain dense call, or None when the call is not one whose every
    argument has its plain type (anything else takes the full validation, which also names
    what is wrong). Types are part of the key: True == 1 must not find a Spec made for 1."""
    tq = type(q)
    if type(k) is not tq or type(v) is not tq:
        return None
    if tq is np.ndarray:
        devices = ()
    elif tq.__module__ == "torch" and tq.__name__ == "Tensor":
        devices = (q.device, k.device, v.device)
    else:
        return None
    if (type(causal) is not bool
            or type(window) is not tuple or len(window) != 2 or type(window[0]) is not int
            or type(window[1]) is not int or type(alignment) is not str
            or not (scale is None or type(scale) is float) or type(dropout_p) is not float
            or type(softcap) is not float or type(num_splits) is not int):
        return None
    # k's and v's sequence length is left out of the key: a decode loop calls with one more
    # cached token each step, and nothing validation checks depends on it beyond its
    # bound, which prepare() checks on every hit.
    ks, vs = k.shape, v.shape
    if len(ks) != 4 or len(vs) != 4 or ks[1] != vs[1]:
        return None
    return (tq, q.dtype, k.dtype, v.dtype, tuple(q.shape), ks[0], ks[2], ks[3], vs[0], vs[2],
            vs[3], devices, causal, window, alignment, scale, dropout_p, softcap, num_splits,
            float8)


def prepare(q, k, v, *, causal=False, window=(-1, -1), alignment="bottom_right", scale=None,
            bias=None, mask=None, dropout_p=0.0, softcap=0.0, alibi_slopes=None,
            cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
            num_splits=0, float8=False) -> Spec:
    """Validates every argument of an attention call; returns the normalised :class:`Spec`
    (shared between equal calls: treat it as read-only). float8: q, k, v are
    float8_e4m3fn (the float8 forward, fmha/_fp8.py) instead of a float dtype."""
    key = None
    if (bias is None and mask is None and alibi_slopes is None and cu_seqlens_q is None
            and cu_seqlens_k is None and max_seqlen_q is None and max_seqlen_k is None
            and (type(q) is np.ndarray or not _compiling())):
        key = _cache_key(q, k, v, causal, window, alignment, scale, dropout_p, softcap,
                         num_splits, float8)
        spec = _SPEC_CACHE.get(key) if key is not None else None
        if spec is not None:
            seqlen_k = k.shape[1]
            if spec.seqlen_k == seqlen_k:
                return spec
            if seqlen_k <= _MAX_SEQLEN:  # the one check that depends on it
                spec = _SPEC_CACHE[key] = dataclasses.replace(spec, seqlen_k=seqlen_k)
                return spec
    spec = _prepare(q, k, v, causal=causal, window=window, alignment=alignment, scale=scale,
                    bias=bias, mask=mask, dropout_p=dropout_p, softcap=softcap,
                    alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q,
                    cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                    max_seqlen_k=max_seqlen_k, num_splits=num_splits, float8=float8)
    if key is not None:
        if len(_SPEC_CACHE) >= _SPEC_CACHE_SIZE:
            _SPEC_CACHE.clear()
        _SPEC_CACHE[key] = spec
    return spec


def _prepare(q, k, v, *, causal, window, alignment, scale, bias, mask, dropout_p, softcap,
             alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
             num_splits, float8=False) -> Spec:
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    kind = kind_of(q)
    if not kind and _is_jax(q):
        raise NotImplementedError(
            "q: JAX arrays are immutable, so fmha cannot write its outputs into them through "
            "DLPack; pass torch tensors, NumPy or CuPy arrays (e.g. torch.from_dlpack(x))")
    if not kind:
        raise TypeError(f"q: expected a torch.Tensor, numpy.ndarray or cupy.ndarray, got "
                        f"{_describe(q)}")
    nd = (3,) if varlen else (4,)
    layout = "(total_tokens, heads, head_dim)" if varlen else "(batch, seqlen, heads, head_dim)"
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_array(name, x, kind, nd)
    if float8:
        for name, x in (("q", q), ("k", k), ("v", v)):
            if dtype_name(x) != FLOAT8:
                raise TypeError(f"{name}: expected {FLOAT8} like the other inputs of a float8 "
                                f"call, got {dtype_name(x)}")
    else:
        _check_float("q", q)
        _check_float("k", k, dtype_name(q))
        _check_float("v", v, dtype_name(q))
    dt = dtype_name(q)
    device = device_of(q)
    for name, x in (("k", k), ("v", v)):
        if device_of(x) != device:
            raise ValueError(f"{name}: on device {device_of(x)}, expected q's device {device}")
    if device != "cpu":
        _check_cuda(device, dt)
    else:
        check_dtype(device, dt)
    # Empty batches, sequences and heads are valid (empty outputs; no visible key gives out 0,
    # lse -inf); an empty head dimension is not (there is no dot product to scale).
    lo = _BACKENDS[backend_of(device)]["head_dim"][0]
    for name, x in (("q", q), ("v", v)):
        if x.shape[-1] < lo:
            raise ValueError(f"{name}: head_dim must be >= {lo}, got shape {tuple(x.shape)} "
                             f"(layout {layout})")
    if varlen:
        total_q, heads_q, head_dim = q.shape
        total_k, heads_kv, head_dim_k = k.shape
        if v.shape[0] != total_k:
            raise ValueError(f"v: {v.shape[0]} tokens, expected k's {total_k}")
        batch = None
    else:
        batch, seqlen_q, heads_q, head_dim = q.shape
        b_k, seqlen_k, heads_kv, head_dim_k = k.shape
        if b_k != batch or v.shape[0] != batch:
            raise ValueError(f"k, v: batch sizes {b_k} and {v.shape[0]} differ from q's {batch}")
        if v.shape[1] != seqlen_k:
            raise ValueError(f"v: seqlen {v.shape[1]} differs from k's {seqlen_k}")
    if head_dim_k != head_dim:
        raise ValueError(f"k: head_dim {head_dim_k} differs from q's {head_dim}")
    if v.shape[-2] != heads_kv:
        raise ValueError(f"v: {v.shape[-2]} heads, expected k's {heads_kv}")
    head_dim_v = v.shape[-1]
    if (heads_q % heads_kv) if heads_kv else heads_q:  # heads_q = heads_kv = 0 is empty
        raise ValueError(f"q, k: heads_q ({heads_q}) must be a multiple of heads_kv ({heads_kv}) "
                         f"for grouped-query attention")
    check_head_dims(device, (("q", head_dim), ("v", head_dim_v)))

    if varlen:
        batch, seqlen_q, seqlen_k = _check_cu_seqlens(
            kind, q, cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q, max_seqlen_k)
    elif max_seqlen_q is not None or max_seqlen_k is not None:
        raise ValueError("max_seqlen_q/max_seqlen_k: only meaningful with cu_seqlens")
    for name, n in (("q", seqlen_q), ("k", seqlen_k)):
        if n > _MAX_SEQLEN:
            raise ValueError(f"{name}: seqlen {n} is over the limit of {_MAX_SEQLEN}")

    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal: expected a bool, got {_describe(causal)}")
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window: expected a (left, right) pair of ints, got {_describe(window)}")
    left = _check_int("window[0]", window[0], -1)
    right = _check_int("window[1]", window[1], -1)
    if causal:
        right = 0  # causal: no key after the diagonal, whatever window[1] said
    if alignment not in ("bottom_right", "top_left"):
        raise ValueError(f"alignment: expected 'bottom_right' or 'top_left', got {alignment!r}")
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    else:
        scale = _check_number("scale", scale)
    softcap = _check_number("softcap", softcap, lo=0.0)
    dropout_p = _check_number("dropout_p", dropout_p, lo=0.0, hi=1.0, hi_open=True)
    num_splits = _check_int("num_splits", num_splits, 0)
    if num_splits > _MAX_SEQLEN:
        raise ValueError(f"num_splits: expected at most {_MAX_SEQLEN}, got {num_splits}")

    full = (batch, heads_q, seqlen_q, seqlen_k)
    bias_shape = None
    if bias is not None:
        _check_array("bias", bias, kind, (1, 2, 3, 4))
        _check_float("bias", bias)
        if not _broadcastable(tuple(bias.shape), full):
            raise ValueError(f"bias: shape {tuple(bias.shape)} does not broadcast to "
                             f"(batch, heads_q, seqlen_q, seqlen_k) = {full}")
        if device_of(bias) != device:
            raise ValueError(f"bias: on device {device_of(bias)}, expected q's device {device}")
        bias_shape = tuple(bias.shape)
    if mask is not None:
        _check_array("mask", mask, kind, (1, 2, 3, 4))
        if dtype_name(mask) != "bool":
            raise TypeError(f"mask: expected a bool array (True = may attend), got dtype "
                            f"{dtype_name(mask)}; pass an additive float mask as bias=")
        if not _broadcastable(tuple(mask.shape), full):
            raise ValueError(f"mask: shape {tuple(mask.shape)} does not broadcast to "
                             f"(batch, heads_q, seqlen_q, seqlen_k) = {full}")
        if device_of(mask) != device:
            raise ValueError(f"mask: on device {device_of(mask)}, expected q's device {device}")
    if alibi_slopes is not None:
        _check_array("alibi_slopes", alibi_slopes, kind, (1, 2))
        _check_float("alibi_slopes", alibi_slopes)
        if tuple(alibi_slopes.shape) not in ((heads_q,), (batch, heads_q)):
            raise ValueError(f"alibi_slopes: expected shape ({heads_q},) or ({batch}, {heads_q}), "
                             f"got {tuple(alibi_slopes.shape)}")
        if device_of(alibi_slopes) != device:
            raise ValueError(f"alibi_slopes: on device {device_of(alibi_slopes)}, expected q's "
                             f"device {device}")
    return Spec(kind=kind, dtype=dt, varlen=varlen, batch=batch, heads_q=heads_q,
                heads_kv=heads_kv, seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=head_dim,
                head_dim_v=head_dim_v, scale=scale, softcap=softcap, window_left=left,
                window_right=right, bottom_right=(alignment == "bottom_right"),
                dropout_p=dropout_p, bias_shape=bias_shape, num_splits=num_splits)


def _check_cuda(device: str, dtype: str) -> None:
    """Can fmha's CUDA kernels run on `device` ('cuda:N') for `dtype`? NotImplementedError
    naming q and saying why not."""
    if not device.startswith("cuda:"):
        raise NotImplementedError(f"q: device {device} is not supported (fmha runs on the CPU "
                                  f"and on CUDA GPUs)")
    check_dtype(device, dtype)
    if _compiling():
        return  # the GPU checks below query the driver; the core repeats them at run time
    ok, why = _cuda_device_usable(int(device.split(":")[1]))
    if not ok:
        raise NotImplementedError(f"q: on {device}, but {why}")


#: The float8 input dtype (forward only; fmha/_fp8.py).
FLOAT8 = "float8_e4m3fn"


def check_dtype(device: str, dtype: str) -> None:
    """NotImplementedError naming q when `device`'s backend does not take `dtype`."""
    caps = _BACKENDS[backend_of(device)]
    if dtype == FLOAT8:
        if caps["features"]["fp8_forward"] != "yes":
            note = next(f["notes"][backend_of(device)] for f in CAPABILITIES["features"]
                        if f["key"] == "fp8_forward")
            raise NotImplementedError(f"q: {FLOAT8} inputs on {device}: the {caps['label']} "
                                      f"kernels do not take them ({note}); run the call on "
                                      f"the CPU, or dequantise")
        return
    if dtype not in caps["dtypes"]:
        hint = "; cast, or use the CPU" if backend_of(device) != "cpu" else ""
        raise NotImplementedError(f"q: dtype {dtype} on {device}: {caps['label']} kernels take "
                                  f"{'/'.join(caps['dtypes'])}{hint}")


def check_kv_cache_dtype(device: str, fmt: str) -> None:
    """NotImplementedError naming k_cache when `device`'s backend has no kernels for 8-bit
    caches of encoding `fmt`."""
    caps = _BACKENDS[backend_of(device)]
    if fmt not in caps["kv_cache_dtypes"]:
        raise NotImplementedError(f"k_cache: {fmt} caches on {device}: {caps['label']} kernels "
                                  f"take {', '.join(caps['kv_cache_dtypes'])}")


_CUDA_USABLE: dict = {}


def _cuda_device_usable(index: int):
    """(True, '') or (False, reason), cached per device."""
    if index not in _CUDA_USABLE:
        if not _C.cuda_built() or _C.cuda_device_count() <= index:
            _CUDA_USABLE[index] = (False, f"fmha's CUDA backend cannot run there: "
                                          f"{_C.cuda_status()}")
        else:
            major, minor = _C.cuda_capability(index)
            if major < 8:
                _CUDA_USABLE[index] = (False, f"its compute capability is {major}.{minor}; "
                                              f"fmha's CUDA kernels need sm_80 or newer")
            else:
                _CUDA_USABLE[index] = (True, "")
    return _CUDA_USABLE[index]


_is_compiling = None  # torch.compiler.is_compiling, once torch is imported


def _compiling() -> bool:
    global _is_compiling
    if _is_compiling is None:
        torch = sys.modules.get("torch")
        if torch is None:
            return False
        _is_compiling = torch.compiler.is_compiling
    return _is_compiling()


def _check_cu_seqlens(kind, q, cu_q, cu_k, total_q, total_k, max_q, max_k):
    """(batch, max_seqlen_q, max_seqlen_k) of a varlen call.

    The offsets' kind, dtype and shape are metadata, checked always. Their values are read
    (start 0, non-decreasing, end at the packed length, maxima) only where that is free: host
    offsets outside torch.compile. With q on a CUDA device nothing is copied to the host -- a
    copy would synchronise with the GPU and cannot be captured in a CUDA graph -- so the
    maxima must be given, and the kernels clamp every sequence to the packed rows and the
    maxima instead (docs/semantics.md, "Variable-length batches"). Under torch.compile the
    values cannot be read while tracing; the bindings check host offsets when the op runs.
    """
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if cu is None:
            raise ValueError(f"{name}: required with varlen inputs (got None)")
        _check_array(name, cu, kind, (1,))
        if dtype_name(cu) != "int32":
            raise TypeError(f"{name}: expected int32, got {dtype_name(cu)}")
        if cu.shape[0] < 1:
            raise ValueError(f"{name}: expected batch + 1 >= 1 entries, got {cu.shape[0]}")
    if cu_q.shape[0] != cu_k.shape[0]:
        raise ValueError(f"cu_seqlens_q, cu_seqlens_k: lengths {cu_q.shape[0]} and "
                         f"{cu_k.shape[0]} differ")
    batch = cu_q.shape[0] - 1
    on_gpu = device_of(q) != "cpu"
    tracing = kind == "torch" and _compiling()
    if (on_gpu or tracing) and (max_q is None or max_k is None):
        why = ("q is on a CUDA device and fmha does not read cu_seqlens on the host (that "
               "would synchronise with the GPU)" if on_gpu else
               "under torch.compile (the sequence lengths cannot be read while tracing)")
        raise ValueError(f"max_seqlen_q, max_seqlen_k: required when {why}; pass the longest "
                         f"sequence lengths, got {max_q} and {max_k}")
    if tracing or (on_gpu and any(device_of(cu) != "cpu" for cu in (cu_q, cu_k))):
        return (batch, _check_int("max_seqlen_q", max_q, 0),
                _check_int("max_seqlen_k", max_k, 0))
    lengths = []
    for name, cu, total in (("cu_seqlens_q", cu_q, total_q), ("cu_seqlens_k", cu_k, total_k)):
        host = to_host(cu)
        if host[0] != 0:
            raise ValueError(f"{name}: must start at 0, got {int(host[0])}")
        if np.any(np.diff(host.astype(np.int64)) < 0):
            raise ValueError(f"{name}: must be non-decreasing, got {host.tolist()[:16]}")
        if int(host[-1]) != total:
            raise ValueError(f"{name}: must end at the packed length {total}, got {int(host[-1])}")
        lengths.append(np.diff(host.astype(np.int64)))
    longest = [int(x.max()) if x.size else 0 for x in lengths]
    out = []
    for name, given, need in (("max_seqlen_q", max_q, longest[0]),
                              ("max_seqlen_k", max_k, longest[1])):
        if given is None:
            out.append(need)
            continue
        given = _check_int(name, given, 0)
        if given < need:
            raise ValueError(f"{name}: {given} is smaller than the longest sequence ({need})")
        out.append(given)
    return batch, out[0], out[1]
