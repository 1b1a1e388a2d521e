"""What the NumPy/CuPy path (_api.py) and the torch operators (_torch.py) share on their way
to the compiled core: the kernel module they call, the CPU thread setting, and the
conversion of arrays and extras into what the core's params struct takes.

Nothing here imports _api or _torch: both import this module (and _validate), so the
package's import graph has no cycle (tests/api/test_imports.py checks it).
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Optional, Tuple

import numpy as np

from . import _C
from ._validate import kind_of

# ---------------------------------------------------------------- the kernel module

#: The module whose forward/backward every call runs: fmha._C. Tests swap in
#: fmha._cuda_emu (same signature; the CUDA kernels run by the CPU emulator on host arrays)
#: with :func:`_kernel_module`, so the whole Python API exercises the CUDA kernels without a
#: GPU. Callers read it as ``_core._kernels`` at call time, never bind it at import.
_kernels = _C


def lse_optional() -> bool:
    """Whether a host forward may pass lse=None (the CPU kernels then do not compute it):
    only fmha._C's CPU kernels may; the emulated CUDA kernels, like CUDA, need it."""
    return _kernels is _C


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


def kernel_settings(settings: dict, seed: int = 0, offset: int = 0, num_splits: int = 0,
                    stream: int = 0) -> dict:
    """The keyword settings of one fmha._C.forward/backward call: `settings` (scale, softcap,
    window, alignment, dropout_p), the thread count, and seed, offset, num_splits and stream
    only where they differ from the core's default 0 (a small call pays for every keyword
    the binding reads)."""
    kw = dict(settings, num_threads=get_num_threads())
    for name, value in (("seed", seed), ("offset", offset), ("num_splits", num_splits),
                        ("stream", stream)):
        if value:
            kw[name] = value
    return kw


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


def core_args(full, bias=None, mask=None, alibi_slopes=None) -> tuple:
    """(bias, mask, alibi_slopes) in the form fmha._C takes them (views, no copies of size
    n²; None where absent), in the binding's positional order after lse;
    full = (batch, heads_q, seqlen_q, seqlen_k)."""
    if bias is not None:
        bias = _as_4d(bias, full)
    if mask is not None:
        mask = _as_4d(mask, full)
    if alibi_slopes is not None:
        a = alibi_slopes
        if kind_of(a) != "torch":
            xp = _xp(a)
            a = xp.asarray(a, dtype=xp.float64)
            alibi_slopes = xp.broadcast_to(a if a.ndim == 2 else a[None], full[:2])
        else:
            import torch
            a = a.detach().to(dtype=torch.float64)
            alibi_slopes = (a if a.ndim == 2 else a.unsqueeze(0)).expand(*full[:2])
    return bias, mask, alibi_slopes


def dbias_shape(bias_shape, full) -> Tuple[int, int, int, int]:
    """Shape of the core's dbias: the bias padded to 4-D, broadcast dims kept at 1."""
    padded = (1,) * (4 - len(bias_shape)) + tuple(bias_shape)
    return tuple(1 if p == 1 else f for p, f in zip(padded, full))
