"""The public functions: fmha.attention, fmha.attention_varlen, fmha.attention_backward.

Torch tensors go through the registered torch ops (fmha/_torch.py: autograd,
torch.compile); NumPy (and CuPy) arrays go straight to the core. Both share validation
(_validate.py) and the conversion into what the core's params struct needs
(:func:`core_args`). Host arrays run the CPU kernels, CUDA arrays the CUDA kernels, on the
caller's current stream.
"""

from __future__ import annotations

import contextlib
import os
from typing import Optional, Tuple

import numpy as np

from . import _C
from ._validate import Spec, kind_of, prepare

# ---------------------------------------------------------------- the kernel module

#: The module whose forward/backward every call runs: fmha._C. Tests swap in
#: fmha._cuda_emu (same signature; the CUDA kernels run by the CPU emulator on host arrays)
#: with :func:`_kernel_module`, so the whole Python API exercises the CUDA kernels without a GPU.
_kernels = _C


@contextlib.contextmanager
def _kernel_module(module):
    """Within the block, fmha's entry points call ``module.forward`` / ``module.backward``
    instead of fmha._C's (private; for tests)."""
    global _kernels
    before = _kernels
    _kernels = module
    try:
        yield module
    finally:
        _kernels = before

# ---------------------------------------------------------------- threads

_num_threads: Optional[int] = None


def set_num_threads(n: Optional[int]) -> None:
    """Threads for the CPU kernels; None restores the default (torch's setting if torch is
    imported, else OMP_NUM_THREADS, else every core). Results do not depend on it."""
    global _num_threads
    if n is not None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n: expected a positive int or None, got {n!r}")
    _num_threads = n


def get_num_threads() -> int:
    if _num_threads is not None:
        return _num_threads
    import sys
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch.get_num_threads()
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return _C.hardware_threads()


# ---------------------------------------------------------------- conversion for the core

def _xp(x):
    """The array module of a NumPy or CuPy array."""
    if isinstance(x, np.ndarray):
        return np
    import cupy
    return cupy


def _as_4d(x, full):
    """A stride-0 broadcast view of a bias/mask to (batch, heads, seqlen_q, seqlen_k)."""
    shape = (1,) * (4 - x.ndim) + tuple(x.shape)
    if kind_of(x) != "torch":
        return _xp(x).broadcast_to(x.reshape(shape), full)
    return x.reshape(shape).expand(*full)


def _last_contiguous(x):
    """The kernels need unit stride in the last dimension; copy only when it is not."""
    if kind_of(x) != "torch":
        ok = x.strides[-1] == x.itemsize or x.shape[-1] == 1
        return x if ok else _xp(x).ascontiguousarray(x)
    return x if x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous()


def stream_of(x) -> int:
    """The stream (a cudaStream_t as an int) a call on x's device is ordered on: the current
    torch / CuPy stream of a CUDA array, 0 for host arrays."""
    kind = kind_of(x)
    if kind == "torch" and x.is_cuda:
        import torch
        return torch.cuda.current_stream(x.device).cuda_stream
    if kind == "cupy":
        import cupy
        with x.device:
            return cupy.cuda.get_current_stream().ptr
    return 0


def core_args(full, bias=None, mask=None, alibi_slopes=None) -> dict:
    """bias / mask / alibi_slopes in the form fmha._C takes (views, no copies of size n²);
    full = (batch, heads_q, seqlen_q, seqlen_k)."""
    out = {}
    if bias is not None:
        out["bias"] = _as_4d(bias, full)
    if mask is not None:
        out["mask"] = _as_4d(mask, full)
    if alibi_slopes is not None:
        a = alibi_slopes
        if kind_of(a) != "torch":
            xp = _xp(a)
            a = xp.asarray(a, dtype=xp.float64)
            out["alibi_slopes"] = xp.broadcast_to(a if a.ndim == 2 else a[None], full[:2])
        else:
            import torch
            a = a.detach().to(dtype=torch.float64)
            out["alibi_slopes"] = (a if a.ndim == 2 else a.unsqueeze(0)).expand(*full[:2])
    return out


def dbias_shape(bias_shape, full) -> Tuple[int, int, int, int]:
    """Shape of the core's dbias: the bias padded to 4-D, broadcast dims kept at 1."""
    padded = (1,) * (4 - len(bias_shape)) + tuple(bias_shape)
    return tuple(1 if p == 1 else f for p, f in zip(padded, full))


# ---------------------------------------------------------------- NumPy / CuPy path

def _numpy_seed(seed) -> int:
    if seed is None:
        return int(np.random.default_rng().integers(0, 2**63))
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**64:
        raise ValueError(f"seed: expected an int in [0, 2**64), got {seed!r}")
    return int(seed)


def _numpy_forward(spec: Spec, q, k, v, extra: dict, seed: int, cu=None):
    """NumPy or CuPy arrays (outputs allocated by the same module, on q's device)."""
    xp = _xp(q)
    q, k, v = (_last_contiguous(x) for x in (q, k, v))
    lse_dtype = xp.float64 if spec.dtype == "float64" else xp.float32
    with _device_of_array(q):
        out = xp.empty(q.shape[:-1] + (spec.head_dim_v,), dtype=q.dtype)
        if spec.varlen:
            lse = xp.empty((spec.heads_q, q.shape[0]), dtype=lse_dtype)
        else:
            lse = xp.empty((spec.batch, spec.heads_q, spec.seqlen_q), dtype=lse_dtype)
    _kernels.forward(q, k, v, out, lse, **extra, **(cu or {}), **spec.settings(), seed=seed,
                     offset=0, num_threads=get_num_threads(), stream=stream_of(q))
    return out, lse


def _device_of_array(x):
    """A context that makes x's CUDA device current (CuPy allocates on the current one)."""
    return x.device if kind_of(x) == "cupy" else contextlib.nullcontext()


def attention(q, k, v, *, causal: bool = False, window=(-1, -1), alignment: str = "bottom_right",
              scale: Optional[float] = None, bias=None, mask=None, dropout_p: float = 0.0,
              softcap: float = 0.0, alibi_slopes=None, return_lse: bool = False, seed=None,
              deterministic: bool = False):
    """Exact multi-head attention, softmax(scale·QKᵀ [softcap] + bias + ALiBi, masked) V.

    q: (batch, seqlen_q, heads_q, head_dim); k: (batch, seqlen_k, heads_kv, head_dim);
    v: (batch, seqlen_k, heads_kv, head_dim_v); heads_q a multiple of heads_kv (GQA/MQA).
    Torch tensors (differentiable, torch.compile-able) or NumPy arrays.

    causal / window=(left, right): query i sees key j iff
    i + off - left <= j <= i + off + right (-1 = unbounded; causal sets right = 0), with
    off = seqlen_k - seqlen_q for alignment="bottom_right" (flash-attn) or 0 for "top_left"
    (torch SDPA). bias: float, broadcastable to (batch, heads_q, seqlen_q, seqlen_k);
    mask: bool, same broadcasting, True = may attend. A row that sees no key gives 0.

    dropout_p: dropout on the probabilities (Philox; torch's generator supplies the seed,
    NumPy users may pass ``seed``). The mask is a function of (seed, offset, b, h, i, j)
    only, and torch draws (seed, offset) from its CPU generator for CPU and CUDA tensors
    alike, so after ``torch.manual_seed(s)`` a call gives the same mask on either device.

    deterministic: CUDA backward with bitwise-reproducible gradients (dQ summed in a fixed
    order instead of by atomics; a little slower). Also on when
    ``torch.use_deterministic_algorithms(True)``. The CPU backward always is.

    Torch CUDA tensors and CuPy arrays run the CUDA kernels (float16/bfloat16, head_dim up
    to 256, sm_80+) on the current stream. Returns out, or (out, lse) when return_lse.
    """
    spec = prepare(q, k, v, causal=causal, window=window, alignment=alignment, scale=scale,
                   bias=bias, mask=mask, dropout_p=dropout_p, softcap=softcap,
                   alibi_slopes=alibi_slopes)
    if spec.kind == "torch":
        from . import _torch
        return _torch.attention(spec, q, k, v, bias, mask, alibi_slopes, return_lse,
                                deterministic=deterministic)
    out, lse = _numpy_forward(spec, q, k, v, core_args(spec.full, bias, mask, alibi_slopes),
                              _numpy_seed(seed) if spec.dropout_p > 0 else 0)
    return (out, lse) if return_lse else out


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                     *, causal: bool = False, window=(-1, -1), alignment: str = "bottom_right",
                     scale: Optional[float] = None, bias=None, mask=None, dropout_p: float = 0.0,
                     softcap: float = 0.0, alibi_slopes=None, return_lse: bool = False,
                     seed=None, deterministic: bool = False):
    """:func:`attention` on packed variable-length batches.

    q: (total_q, heads_q, head_dim), k/v: (total_k, heads_kv, head_dim[_v]); sequence b owns
    rows cu_seqlens_q[b]:cu_seqlens_q[b+1] (int32, batch + 1 entries). bias and mask, if
    given, are indexed by (b, h, i, j) with i, j positions within the sequence, broadcastable
    to (batch, heads_q, max_seqlen_q, max_seqlen_k). lse is (heads_q, total_q).
    """
    spec = prepare(q, k, v, causal=causal, window=window, alignment=alignment, scale=scale,
                   bias=bias, mask=mask, dropout_p=dropout_p, softcap=softcap,
                   alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q,
                   cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                   max_seqlen_k=max_seqlen_k)
    if spec.kind == "torch":
        from . import _torch
        return _torch.attention(spec, q, k, v, bias, mask, alibi_slopes, return_lse,
                                cu_seqlens_q, cu_seqlens_k, deterministic=deterministic)
    xp = _xp(q)
    with _device_of_array(q):
        cu = dict(cu_seqlens_q=xp.ascontiguousarray(xp.asarray(cu_seqlens_q)),
                  cu_seqlens_k=xp.ascontiguousarray(xp.asarray(cu_seqlens_k)),
                  max_seqlen_q=spec.seqlen_q, max_seqlen_k=spec.seqlen_k)
    out, lse = _numpy_forward(spec, q, k, v, core_args(spec.full, bias, mask, alibi_slopes),
                              _numpy_seed(seed) if spec.dropout_p > 0 else 0, cu)
    return (out, lse) if return_lse else out


def attention_backward(dout, q, k, v, out, lse, *, causal: bool = False, window=(-1, -1),
                       alignment: str = "bottom_right", scale: Optional[float] = None,
                       bias=None, mask=None, dropout_p: float = 0.0, softcap: float = 0.0,
                       alibi_slopes=None, seed=None, bias_grad: bool = False,
                       deterministic: bool = False):
    """The backward of :func:`attention` for NumPy / CuPy arrays (torch users: autograd).

    Takes the forward's out and lse (``return_lse=True``) and the same keyword arguments
    (with the same ``seed`` when dropout was on). Returns (dq, dk, dv), plus dbias shaped
    like bias when ``bias_grad`` (exact zeros for a bias constant along the keys, whose
    shift softmax cancels). deterministic: as in :func:`attention`.
    """
    spec = prepare(q, k, v, causal=causal, window=window, alignment=alignment, scale=scale,
                   bias=bias, mask=mask, dropout_p=dropout_p, softcap=softcap,
                   alibi_slopes=alibi_slopes)
    if spec.kind == "torch":
        raise TypeError("q: attention_backward takes NumPy or CuPy arrays; torch tensors use "
                        "autograd")
    _check_like("out", out, q, q.shape[:-1] + (spec.head_dim_v,), q.dtype)
    _check_like("dout", dout, q, out.shape, out.dtype)
    lse_dtype = np.float64 if spec.dtype == "float64" else np.float32
    _check_like("lse", lse, q, (spec.batch, spec.heads_q, spec.seqlen_q), lse_dtype)
    if spec.dropout_p > 0 and seed is None:
        raise ValueError("seed: required when dropout_p > 0 (the forward's seed)")
    if bias_grad and bias is None:
        raise ValueError("bias_grad: True but no bias was given")
    xp = _xp(q)
    q, k, v, out, dout = (_last_contiguous(x) for x in (q, k, v, out, dout))
    with _device_of_array(q):
        dq, dk, dv = xp.empty_like(q), xp.empty_like(k), xp.empty_like(v)
        dbias = (xp.empty(dbias_shape(spec.bias_shape, spec.full), dtype=lse_dtype)
                 if bias_grad else None)
    _kernels.backward(dout, q, k, v, out, lse, dq, dk, dv, dbias=dbias,
                      **core_args(spec.full, bias, mask, alibi_slopes), **spec.settings(),
                      seed=_numpy_seed(seed) if spec.dropout_p > 0 else 0, offset=0,
                      num_threads=get_num_threads(), stream=stream_of(q),
                      deterministic=bool(deterministic))
    if bias_grad:
        return dq, dk, dv, dbias.reshape(spec.bias_shape).astype(bias.dtype, copy=False)
    return dq, dk, dv


def _check_like(name, x, q, shape, dtype):
    """x: an array of q's kind and device with this shape and dtype."""
    from ._validate import device_of
    if kind_of(x) != kind_of(q):
        raise TypeError(f"{name}: expected a {kind_of(q)} array like q, got {type(x).__name__}")
    if tuple(x.shape) != tuple(shape) or np.dtype(x.dtype) != np.dtype(dtype):
        raise ValueError(f"{name}: expected shape {tuple(shape)} and dtype {np.dtype(dtype)}, "
                         f"got {tuple(x.shape)} and {x.dtype}")
    if device_of(x) != device_of(q):
        raise ValueError(f"{name}: on device {device_of(x)}, expected q's device "
                         f"{device_of(q)}")
