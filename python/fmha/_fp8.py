"""Float8 (e4m3) inputs: ``fmha.attention(q8, k8, v8, descale_q=..., ...)`` and its varlen
form, the forward of flash-attn 3's fp8 interface (docs/semantics.md, "FP8 inputs").

q, k and v are torch.float8_e4m3fn tensors; the attention is that of the dequantised
tensors q8 * descale_q, k8 * descale_k, v8 * descale_v, each factor float32 and per
(batch, kv head) as flash-attn 3's q_descale / k_descale / v_descale (a query head uses
the factor of its kv head). out is bfloat16 (flash-attn 3's choice) or float16
(``out_dtype``); lse float32. There is no backward: the inputs may not require grad.

The call goes straight to the core (fmha._C.forward with the descales), not through the
registered torch ops of fmha/_torch.py: it is eager, and torch.compile runs it outside the
graph.
"""

from __future__ import annotations

from . import _core
from ._core import core_args, get_num_threads, stream_of
from ._validate import FLOAT8, _broadcastable, _describe, device_of, dtype_name, kind_of, prepare

#: Float8 dtypes other than FLOAT8, refused by name.
_OTHER_FLOAT8 = ("float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")


def is_float8(x) -> bool:
    """Whether x is an array of a one-byte float dtype (the cheap test of fmha.attention's
    plain path: one attribute read for every other call)."""
    dt = getattr(x, "dtype", None)
    return getattr(dt, "itemsize", 0) == 1 and "float8" in str(dt)


def wanted(q, descale_q, descale_k, descale_v, out_dtype) -> bool:
    """Whether an attention call is a float8 one: float8 inputs, or an argument only float8
    calls take (which then explains itself)."""
    return (is_float8(q) or descale_q is not None or descale_k is not None
            or descale_v is not None or out_dtype is not None)


def _check_inputs(q, k, v, bias) -> None:
    """q, k, v: torch float8_e4m3fn tensors; neither they nor bias need a gradient."""
    name = dtype_name(q)
    if kind_of(q) != "torch":
        if "float8" in name:
            raise TypeError(f"q: float8 inputs are torch tensors (torch.{FLOAT8}); NumPy has "
                            f"no float8 dtype (ml_dtypes' {name} arrays are not taken)")
        raise ValueError(f"descale_q, descale_k, descale_v, out_dtype: only with {FLOAT8} "
                         f"inputs, got q of dtype {name}")
    if name in _OTHER_FLOAT8:
        raise NotImplementedError(f"q: dtype {name} is not supported; float8 attention takes "
                                  f"{FLOAT8} inputs (as flash-attn 3)")
    if name != FLOAT8:
        raise ValueError(f"descale_q, descale_k, descale_v, out_dtype: only with {FLOAT8} "
                         f"inputs, got q of dtype {name}")
    import torch
    if torch.is_grad_enabled():
        for n, x in (("q", q), ("k", k), ("v", v), ("bias", bias)):
            if kind_of(x) == "torch" and x.requires_grad:
                raise NotImplementedError(
                    f"{n}: requires grad, but {FLOAT8} attention has no backward (forward "
                    f"only, as flash-attn 3's fp8 kernels); detach the inputs or run under "
                    f"torch.no_grad()")


def _out_dtype(out_dtype):
    import torch
    if out_dtype is None:
        return torch.bfloat16
    if not isinstance(out_dtype, torch.dtype):
        raise TypeError(f"out_dtype: expected torch.bfloat16 or torch.float16, got "
                        f"{_describe(out_dtype)}")
    if out_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"out_dtype: {FLOAT8} inputs write out as torch.bfloat16 or "
                         f"torch.float16, got {out_dtype}")
    return out_dtype


def _descale(name: str, x, q, batch: int, heads_kv: int):
    """A descale argument as the core takes it: a float32 (batch, heads_kv) view (stride 0
    where broadcast), or None (every factor 1)."""
    if x is None:
        return None
    import torch
    if kind_of(x) != "torch":
        raise TypeError(f"{name}: expected a float32 torch.Tensor broadcastable to (batch, "
                        f"heads_kv), got {_describe(x)}")
    if x.dtype != torch.float32:
        raise TypeError(f"{name}: expected dtype float32, got {dtype_name(x)}")
    if device_of(x) != device_of(q):
        raise ValueError(f"{name}: on device {device_of(x)}, expected q's device "
                         f"{device_of(q)}")
    if x.requires_grad and torch.is_grad_enabled():
        raise NotImplementedError(f"{name}: requires grad, but descale factors are not "
                                  f"differentiable ({FLOAT8} attention has no backward)")
    full = (batch, heads_kv)
    if x.numel() == 1:
        return x.detach().reshape(1, 1).expand(*full)
    if x.ndim > 2 or not _broadcastable(tuple(x.shape), full):
        raise ValueError(f"{name}: shape {tuple(x.shape)} does not broadcast to (batch, "
                         f"heads_kv) = {full}")
    return x.detach().reshape((1,) * (2 - x.ndim) + tuple(x.shape)).expand(*full)


#: The arguments of fmha.attention / attention_varlen that attention() below takes.
KEYWORDS = ("causal", "window", "alignment", "scale", "bias", "mask", "dropout_p", "softcap",
            "alibi_slopes", "return_lse", "num_splits", "sinks", "block_mask", "descale_q",
            "descale_k", "descale_v", "out_dtype", "cu_seqlens_q", "cu_seqlens_k",
            "max_seqlen_q", "max_seqlen_k")


def attention(q, k, v, *, causal, window, alignment, scale, bias, mask, dropout_p, softcap,
              alibi_slopes, return_lse, num_splits, sinks, descale_q, descale_k, descale_v,
              out_dtype, block_arrays, block_mask=None, cu_seqlens_q=None, cu_seqlens_k=None,
              max_seqlen_q=None, max_seqlen_k=None):
    """fmha.attention / attention_varlen for float8 inputs (their arguments, checked here);
    block_arrays: _api._block_arrays, which turns a block_mask into the kernels' arrays."""
    _check_inputs(q, k, v, bias)
    if dropout_p != 0.0:
        raise ValueError(f"dropout_p: {FLOAT8} attention is forward only (inference) and "
                         f"takes no dropout, got {dropout_p!r}")
    if sinks is not None:
        raise NotImplementedError(f"sinks: not supported with {FLOAT8} inputs")
    dtype = _out_dtype(out_dtype)
    spec = prepare(q, k, v, causal=causal, window=window, alignment=alignment, scale=scale,
                   bias=bias, mask=mask, softcap=softcap, alibi_slopes=alibi_slopes,
                   cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                   max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                   num_splits=num_splits, float8=True)
    descales = [_descale(n, x, q, spec.batch, spec.heads_kv)
                for n, x in (("descale_q", descale_q), ("descale_k", descale_k),
                             ("descale_v", descale_v))]
    block = block_arrays(block_mask, q, spec)
    import torch
    q, k, v = (x.detach() if x.stride(-1) == 1 or x.shape[-1] == 1 else x.detach().contiguous()
               for x in (q, k, v))
    out = torch.empty(q.shape[:-1] + (spec.head_dim_v,), dtype=dtype, device=q.device)
    lse = torch.empty((spec.heads_q, q.shape[0]) if spec.varlen else spec.full[:3],
                      dtype=torch.float32, device=q.device)
    kw = dict(spec.kernel_settings, num_threads=get_num_threads())
    stream = stream_of(q)
    if stream:
        kw["stream"] = stream
    if block is not None:
        kw["block_index"], kw["block_masks"] = block
    cu = (None, None)
    if spec.varlen:
        cu = (cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous())
        kw.update(max_seqlen_q=spec.seqlen_q, max_seqlen_k=spec.seqlen_k)
    if bias is not None:
        bias = bias.detach()
    _core._kernels.forward(q, k, v, out, lse, *core_args(spec.full, bias, mask, alibi_slopes),
                           *cu, q_descale=descales[0], k_descale=descales[1],
                           v_descale=descales[2], **kw)
    return (out, lse) if return_lse else out
