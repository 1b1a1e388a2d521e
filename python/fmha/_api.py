"""The public functions: fmha.attention, fmha.attention_varlen, fmha.attention_backward,
fmha.attention_varlen_backward.

Torch tensors go through the registered torch ops (fmha/_torch.py: autograd,
torch.compile); NumPy and CuPy arrays (the "array" path below) go straight to the core. Both
share validation (_validate.py), and the kernel module, thread setting and conversion into
what the core's params struct needs (_core.py). Host arrays run the CPU kernels, CUDA arrays
the CUDA kernels, on the caller's current stream.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import numpy as np

from . import _core, _fp8, _sinks
from ._core import (_last_contiguous, _xp, core_args, dbias_shape, get_num_threads,
                    kernel_settings, stream_of)
from ._validate import Spec, device_of, kind_of, prepare

# ---------------------------------------------------------------- NumPy / CuPy arrays

def _array_seed(seed) -> int:
    if seed is None:
        return int(np.random.default_rng().integers(0, 2**63))
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**64:
        raise ValueError(f"seed: expected an int in [0, 2**64), got {seed!r}")
    return int(seed)


def _array_forward(spec: Spec, q, k, v, extra: tuple, seed: int, cu=None, block=None,
                   keep_lse=True):
    """NumPy or CuPy arrays (outputs allocated by the same module, on q's device); extra:
    core_args' (bias, mask, alibi_slopes); block: a block mask's (index, partial). A host
    call with keep_lse=False leaves lse to the kernels' own buffer and returns (out, None)."""
    xp = _xp(q)
    q, k, v = _last_contiguous(q), _last_contiguous(k), _last_contiguous(v)
    lse_dtype = xp.float64 if spec.dtype == "float64" else xp.float32
    lse_shape = (spec.heads_q, q.shape[0]) if spec.varlen else spec.full[:3]
    if xp is np:  # host memory: no device to make current
        out = np.empty(q.shape[:-1] + (spec.head_dim_v,), dtype=q.dtype)
        lse = np.empty(lse_shape, dtype=lse_dtype) if keep_lse or not _core.lse_optional() else None
        stream = 0
    else:
        with q.device:
            out = xp.empty(q.shape[:-1] + (spec.head_dim_v,), dtype=q.dtype)
            lse = xp.empty(lse_shape, dtype=lse_dtype)
        stream = stream_of(q)
    kw = dict(spec.kernel_settings, num_threads=get_num_threads())
    if seed:
        kw["seed"] = seed
    if stream:
        kw["stream"] = stream
    if block is not None:
        kw["block_index"], kw["block_masks"] = block
    if cu is None:
        _core._kernels.forward(q, k, v, out, lse, *extra, **kw)
    else:
        _core._kernels.forward(q, k, v, out, lse, *extra, cu["cu_seqlens_q"],
                               cu["cu_seqlens_k"], max_seqlen_q=cu["max_seqlen_q"],
                               max_seqlen_k=cu["max_seqlen_k"], **kw)
    return out, lse


def _plain_numpy(spec: Spec, q, k, v, return_lse: bool):
    """NumPy's plain call (as fmha._torch.plain_forward): the outputs allocated here, one
    kernel call, lse left to the kernels unless returned. None when an input's last dimension
    is strided (the general path copies it)."""
    if (q.strides[-1] != q.itemsize or k.strides[-1] != k.itemsize
            or v.strides[-1] != v.itemsize):
        return None
    out = np.empty(q.shape[:-1] + (spec.head_dim_v,), dtype=q.dtype)
    lse = None
    if return_lse or not _core.lse_optional():
        lse = np.empty(spec.full[:3], dtype=np.float64 if spec.dtype == "float64" else np.float32)
    _core._kernels.forward(q, k, v, out, lse,
                           **dict(spec.kernel_settings, num_threads=get_num_threads()))
    return (out, lse) if return_lse else out


_torch = None


def _torch_module():
    """fmha._torch, imported on the first torch call (NumPy users never import torch)."""
    global _torch
    if _torch is None:
        from . import _torch as module
        _torch = module
    return _torch


def _block_arrays(block_mask, q, spec: Spec):
    """A block_mask argument as the kernels take it: (index, partial) on q's device, or
    None."""
    if block_mask is None:
        return None
    from .block_mask import BlockMask
    if not isinstance(block_mask, BlockMask):
        raise TypeError("block_mask: expected an fmha.BlockMask (fmha.create_block_mask, "
                        f"fmha.document_mask, ...), got {type(block_mask).__name__}")
    return block_mask._arrays(q, spec.full)


def _device_of_array(x):
    """A context that makes x's CUDA device current (CuPy allocates on the current one)."""
    return x.device if kind_of(x) == "cupy" else contextlib.nullcontext()


def attention(q, k, v, *, causal: bool = False, window=(-1, -1), alignment: str = "bottom_right",
              scale: Optional[float] = None, bias=None, mask=None, dropout_p: float = 0.0,
              softcap: float = 0.0, alibi_slopes=None, return_lse: bool = False, seed=None,
              deterministic: bool = False, num_splits: int = 0, sinks=None, block_mask=None,
              descale_q=None, descale_k=None, descale_v=None, out_dtype=None):
    """Exact multi-head attention, softmax(scale·QKᵀ [softcap] + bias + ALiBi, masked) V.

    q: (batch, seqlen_q, heads_q, head_dim); k: (batch, seqlen_k, heads_kv, head_dim);
    v: (batch, seqlen_k, heads_kv, head_dim_v); heads_q a multiple of heads_kv (GQA/MQA).
    Torch tensors (differentiable, torch.compile-able) or NumPy arrays.

    causal / window=(left, right): query i sees key j iff
    i + off - left <= j <= i + off + right (-1 = unbounded; causal sets right = 0), with
    off = seqlen_k - seqlen_q for alignment="bottom_right" (flash-attn) or 0 for "top_left"
    (torch SDPA). bias: float, broadcastable to (batch, heads_q, seqlen_q, seqlen_k);
    mask: bool, same broadcasting, True = may attend. A row that sees no key gives 0.
    block_mask: an :class:`fmha.BlockMask` (fmha.create_block_mask, document_mask,
    longformer_mask, bigbird_mask), ANDed with the rest: the kernels skip the tiles it
    leaves empty, so the work is proportional to its non-empty blocks (fmha/block_mask.py).
    Any size but head_dim may be 0 (as in torch): an empty batch, sequence or head count
    gives outputs of that shape, seqlen_k = 0 out = 0 and lse = -inf, and zero gradients.

    dropout_p: dropout on the probabilities (Philox; torch's generator supplies the seed,
    NumPy users may pass ``seed``). The mask is a function of (seed, offset, b, h, i, j)
    only, and torch draws (seed, offset) from its CPU generator for CPU and CUDA tensors
    alike, so after ``torch.manual_seed(s)`` a call gives the same mask on either device.

    deterministic: CUDA backward with bitwise-reproducible gradients (dQ summed in a fixed
    order instead of by atomics; a little slower). Also on when
    ``torch.use_deterministic_algorithms(True)``. The CPU backward always is.

    num_splits: how many parts the CUDA forward splits the keys of each (query block, head,
    batch) into, merged afterwards by their lse (split-KV, as in FlashDecoding; it pays when
    batch x heads x query blocks cannot fill the GPU, e.g. decoding). 0 (default) =
    automatic, by occupancy; 1 = no split; n = n splits (the CUDA forward merges at most 128: larger n runs as 128). It changes only how
    the CUDA forward divides its work, not the result beyond float rounding; the CPU
    kernels and the backward validate it (an int >= 0) and ignore it.

    sinks: float (heads_q,) logits, one per query head, added to every softmax denominator
    (gpt-oss): softmax over [scores, sink], the sink carrying no value, so a row with no
    visible key gives 0 (all its mass on the sink); lse then includes the sink. Torch:
    differentiable (dsinks by autograd); arrays: attention_backward(..., sinks=).

    Torch CUDA tensors and CuPy arrays run the CUDA kernels (float16/bfloat16, head_dim up
    to 256, sm_80+) on the current stream. Returns out, or (out, lse) when return_lse.

    float8: torch.float8_e4m3fn q, k, v (forward only, no dropout or sinks) are the
    attention of q·descale_q, k·descale_k, v·descale_v; each descale is a float32 tensor
    broadcastable to (batch, heads_kv) (flash-attn 3's q_descale / k_descale / v_descale;
    None = 1). out is torch.bfloat16, or ``out_dtype`` (torch.bfloat16 / torch.float16);
    lse float32. CPU: dequantised into float32 (docs/semantics.md, "FP8 inputs").
    """
    if _fp8.wanted(q, descale_q, descale_k, descale_v, out_dtype):
        return _float8(q, k, v, locals())
    spec = prepare(q, k, v, causal=causal, window=window, alignment=alignment, scale=scale,
                   bias=bias, mask=mask, dropout_p=dropout_p, softcap=softcap,
                   alibi_slopes=alibi_slopes, num_splits=num_splits)
    plain = (bias is None and mask is None and alibi_slopes is None and sinks is None
             and block_mask is None and spec.dropout_p == 0)
    if plain:
        if spec.kind == "torch":
            res = _torch_module().plain_forward(spec, q, k, v, return_lse)
        else:
            res = _plain_numpy(spec, q, k, v, return_lse) if spec.kind == "numpy" else None
        if res is not None:
            return res
    if sinks is not None:
        _sinks.check(sinks, q, spec.heads_q)
    block = _block_arrays(block_mask, q, spec)
    if spec.kind == "torch":
        res = _torch_module().attention(spec, q, k, v, bias, mask, alibi_slopes,
                                        return_lse or sinks is not None,
                                        deterministic=deterministic, block=block)
        return res if sinks is None else _result(*res, sinks, return_lse)
    out, lse = _array_forward(spec, q, k, v, core_args(spec.full, bias, mask, alibi_slopes),
                              _array_seed(seed) if spec.dropout_p > 0 else 0, block=block,
                              keep_lse=return_lse or sinks is not None)
    return _result(out, lse, sinks, return_lse)


def _float8(q, k, v, args: dict):
    """attention / attention_varlen on float8 inputs; args: the call's arguments (its
    locals())."""
    return _fp8.attention(q, k, v, block_arrays=_block_arrays,
                          **{n: args[n] for n in _fp8.KEYWORDS if n in args})


def _result(out, lse, sinks, return_lse):
    """What attention / attention_varlen return from the kernels' out and lse: sinks
    applied when given (fmha/_sinks.py), lse when asked for."""
    if sinks is not None:
        apply = _sinks.apply_torch if kind_of(out) == "torch" else _sinks.apply_numpy
        out, lse = apply(out, lse, sinks)
    return (out, lse) if return_lse else out


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                     *, causal: bool = False, window=(-1, -1), alignment: str = "bottom_right",
                     scale: Optional[float] = None, bias=None, mask=None, dropout_p: float = 0.0,
                     softcap: float = 0.0, alibi_slopes=None, return_lse: bool = False,
                     seed=None, deterministic: bool = False, num_splits: int = 0, sinks=None,
                     descale_q=None, descale_k=None, descale_v=None, out_dtype=None):
    """:func:`attention` on packed variable-length batches.

    q: (total_q, heads_q, head_dim), k/v: (total_k, heads_kv, head_dim[_v]); sequence b owns
    rows cu_seqlens_q[b]:cu_seqlens_q[b+1] (int32, batch + 1 entries). bias and mask, if
    given, are indexed by (b, h, i, j) with i, j positions within the sequence, broadcastable
    to (batch, heads_q, max_seqlen_q, max_seqlen_k). lse is (heads_q, total_q).
    max_seqlen_q/k: the longest sequences; read from the offsets when omitted on the CPU,
    required on CUDA, where the offsets are never copied to the host (no synchronisation;
    CUDA-graph capturable) and so are not validated: the kernels clamp each sequence to the
    packed rows and the maxima (docs/semantics.md, "Variable-length batches").
    num_splits: as in :func:`attention` (CUDA forward only; validated and ignored on the CPU).
    sinks: as in :func:`attention`. NumPy/CuPy users get the gradients from
    :func:`attention_varlen_backward`. descale_q/k/v, out_dtype: float8 inputs as in
    :func:`attention`, the descales broadcastable to (batch, heads_kv) with batch =
    len(cu_seqlens_q) - 1.
    """
    if _fp8.wanted(q, descale_q, descale_k, descale_v, out_dtype):
        return _float8(q, k, v, locals())
    spec = prepare(q, k, v, causal=causal, window=window, alignment=alignment, scale=scale,
                   bias=bias, mask=mask, dropout_p=dropout_p, softcap=softcap,
                   alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q,
                   cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                   max_seqlen_k=max_seqlen_k, num_splits=num_splits)
    if sinks is not None:
        _sinks.check(sinks, q, spec.heads_q)
    if spec.kind == "torch":
        res = _torch_module().attention(spec, q, k, v, bias, mask, alibi_slopes,
                                        return_lse or sinks is not None, cu_seqlens_q,
                                        cu_seqlens_k, deterministic=deterministic)
        return res if sinks is None else _result(*res, sinks, return_lse)
    out, lse = _array_forward(spec, q, k, v, core_args(spec.full, bias, mask, alibi_slopes),
                              _array_seed(seed) if spec.dropout_p > 0 else 0,
                              _array_cu(spec, q, cu_seqlens_q, cu_seqlens_k))
    return _result(out, lse, sinks, return_lse)


def _array_cu(spec: Spec, q, cu_seqlens_q, cu_seqlens_k) -> dict:
    """The varlen keywords of the core for NumPy/CuPy arrays (offsets on q's device)."""
    xp = _xp(q)
    with _device_of_array(q):
        return dict(cu_seqlens_q=xp.ascontiguousarray(xp.asarray(cu_seqlens_q)),
                    cu_seqlens_k=xp.ascontiguousarray(xp.asarray(cu_seqlens_k)),
                    max_seqlen_q=spec.seqlen_q, max_seqlen_k=spec.seqlen_k)


def attention_backward(dout, q, k, v, out, lse, *, causal: bool = False, window=(-1, -1),
                       alignment: str = "bottom_right", scale: Optional[float] = None,
                       bias=None, mask=None, dropout_p: float = 0.0, softcap: float = 0.0,
                       alibi_slopes=None, seed=None, bias_grad: bool = False,
                       deterministic: bool = False, dlse=None, sinks=None, block_mask=None):
    """The backward of :func:`attention` for NumPy / CuPy arrays (torch users: autograd).

    Takes the forward's out and lse (``return_lse=True``) and the same keyword arguments
    (with the same ``seed`` when dropout was on). Returns (dq, dk, dv), plus dbias shaped
    like bias when ``bias_grad`` (exact zeros for a bias constant along the keys, whose
    shift softmax cancels, unless dlse is given). deterministic: as in :func:`attention`.
    dlse: the gradient of the loss with respect to lse (shaped like lse), when lse was used
    (merging partial attentions, a loss on lse); None: out only. sinks: the forward's (out
    and lse are then the ones it returned with them); dsinks (shaped like sinks) is returned
    last.
    """
    spec = prepare(q, k, v, causal=causal, window=window, alignment=alignment, scale=scale,
                   bias=bias, mask=mask, dropout_p=dropout_p, softcap=softcap,
                   alibi_slopes=alibi_slopes)
    if sinks is not None:
        _sinks.check(sinks, q, spec.heads_q)
    # With sinks, the kernels' P = exp(S - lse) from the lse that includes them is the sinks'
    # softmax: every gradient but dsinks (and a row-constant bias's) is exact as it comes.
    grads = _array_backward(spec, "attention_backward", dout, q, k, v, out, lse, bias, mask,
                            alibi_slopes, seed, bias_grad, deterministic, dlse=dlse,
                            block=_block_arrays(block_mask, q, spec))
    if sinks is None:
        return grads
    if bias_grad and spec.bias_shape[-1] == 1:
        fix = _sinks.constant_bias_correction(dout, out, lse, sinks, dlse, spec.bias_shape)
        grads = grads[:3] + ((grads[3] + fix.reshape(grads[3].shape)).astype(grads[3].dtype),)
    return grads + (_sinks.dsinks_numpy(dout, out, lse, sinks, dlse),)


def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                              max_seqlen_q=None, max_seqlen_k=None, *, causal: bool = False,
                              window=(-1, -1), alignment: str = "bottom_right",
                              scale: Optional[float] = None, bias=None, mask=None,
                              dropout_p: float = 0.0, softcap: float = 0.0, alibi_slopes=None,
                              seed=None, bias_grad: bool = False, deterministic: bool = False,
                              dlse=None, sinks=None):
    """The backward of :func:`attention_varlen` for NumPy / CuPy arrays (torch: autograd).

    dout and out: (total_q, heads_q, head_dim_v); lse: (heads_q, total_q), as
    :func:`attention_varlen` returned it with ``return_lse=True``. The offsets, maxima and
    keyword arguments are the forward's (the same ``seed`` when dropout was on). Returns
    (dq, dk, dv) shaped like q, k, v, plus dbias shaped like bias when ``bias_grad``.
    Rows of an empty sequence get zero gradients. dlse and sinks as in
    :func:`attention_backward` (dsinks returned last; with sinks, a bias constant along the
    keys cannot take bias_grad here).
    """
    spec = prepare(q, k, v, causal=causal, window=window, alignment=alignment, scale=scale,
                   bias=bias, mask=mask, dropout_p=dropout_p, softcap=softcap,
                   alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q,
                   cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                   max_seqlen_k=max_seqlen_k)
    if sinks is not None:
        _sinks.check(sinks, q, spec.heads_q)
        if bias_grad and spec.bias_shape[-1] == 1:
            raise NotImplementedError("bias_grad: a bias constant along the keys with sinks "
                                      "is not supported by attention_varlen_backward (use "
                                      "attention_backward, or torch autograd)")
    grads = _array_backward(spec, "attention_varlen_backward", dout, q, k, v, out, lse, bias,
                            mask, alibi_slopes, seed, bias_grad, deterministic,
                            cu=(cu_seqlens_q, cu_seqlens_k), dlse=dlse)
    if sinks is None:
        return grads
    return grads + (_sinks.dsinks_numpy(dout, out, lse, sinks, dlse),)


def _array_backward(spec: Spec, fn: str, dout, q, k, v, out, lse, bias, mask, alibi_slopes,
                    seed, bias_grad, deterministic, cu=None, dlse=None, block=None):
    """attention_backward / attention_varlen_backward once prepare() has checked q, k, v and
    the keywords: checks the forward's outputs and dout, then runs the core's backward."""
    if spec.kind == "torch":
        raise TypeError(f"q: {fn} takes NumPy or CuPy arrays; torch tensors use autograd")
    _check_like("out", out, q, q.shape[:-1] + (spec.head_dim_v,), q.dtype)
    _check_like("dout", dout, q, out.shape, out.dtype)
    lse_dtype = np.float64 if spec.dtype == "float64" else np.float32
    lse_shape = ((spec.heads_q, q.shape[0]) if spec.varlen
                 else (spec.batch, spec.heads_q, spec.seqlen_q))
    _check_like("lse", lse, q, lse_shape, lse_dtype)
    if dlse is not None:
        _check_like("dlse", dlse, q, lse_shape, lse_dtype)
        # The kernels read dlse with lse's strides.
        lse, dlse = (_xp(q).ascontiguousarray(x) for x in (lse, dlse))
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
    varlen = _array_cu(spec, q, *cu) if cu is not None else {}
    offsets = (varlen.pop("cu_seqlens_q", None), varlen.pop("cu_seqlens_k", None))
    _core._kernels.backward(dout, q, k, v, out, lse, dq, dk, dv, dbias,
                            *core_args(spec.full, bias, mask, alibi_slopes), *offsets, **varlen,
                            **kernel_settings(spec.settings(),
                                              _array_seed(seed) if spec.dropout_p > 0 else 0,
                                              stream=stream_of(q)),
                            dlse=dlse, deterministic=bool(deterministic),
                            **({} if block is None else
                               dict(block_index=block[0], block_masks=block[1])))
    if bias_grad:
        return dq, dk, dv, dbias.reshape(spec.bias_shape).astype(bias.dtype, copy=False)
    return dq, dk, dv


def _check_like(name, x, q, shape, dtype):
    """x: an array of q's kind and device with this shape and dtype."""
    if kind_of(x) != kind_of(q):
        raise TypeError(f"{name}: expected a {kind_of(q)} array like q, got {type(x).__name__}")
    if tuple(x.shape) != tuple(shape) or np.dtype(x.dtype) != np.dtype(dtype):
        raise ValueError(f"{name}: expected shape {tuple(shape)} and dtype {np.dtype(dtype)}, "
                         f"got {tuple(x.shape)} and {x.dtype}")
    if device_of(x) != device_of(q):
        raise ValueError(f"{name}: on device {device_of(x)}, expected q's device "
                         f"{device_of(q)}")
