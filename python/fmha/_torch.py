"""fmha as PyTorch operators: ``torch.ops.fmha.fwd`` and ``torch.ops.fmha.bwd``.

Registered with torch.library.custom_op + register_fake + register_autograd, so autograd
works and ``torch.compile(fullgraph=True)`` traces through them without graph breaks. The
implementations hand the tensors to the core through DLPack; nothing here is below the
bindings. One op serves every device: the implementation allocates on q's device and the
core picks the CPU or CUDA kernels from where the arrays live (CUDA: on the current stream).

Dropout: ``rng`` = [seed, offset] is drawn from torch's CPU generator for CPU and CUDA
tensors alike, so ``torch.manual_seed(s)`` fixes the mask on either device and the same
seed gives the same mask on CPU and GPU (it is a function of (seed, offset, b, h, i, j)).
"""

from __future__ import annotations

import os
from collections import namedtuple
from typing import Optional, Tuple

import torch
from torch import Tensor
from torch.utils.dlpack import to_dlpack

from . import _C, _core
from ._core import core_args, dbias_shape, get_num_threads
from ._validate import Spec


def _torch_openmp_runtime() -> Optional[str]:
    """The OpenMP runtime torch loaded into this process (its libgomp; Intel's libiomp5 also
    serves GOMP_parallel), found in /proc/self/maps: a path, or None (not Linux, or none)."""
    try:
        with open("/proc/self/maps") as maps:  # the path is the 6th field, spaces and all
            paths = {f[5].strip() for f in (line.split(None, 5) for line in maps)
                     if len(f) == 6 and ".so" in f[5] and not f[5].rstrip().endswith("(deleted)")}
    except OSError:
        return None
    found = sorted(p for p in paths
                   if os.path.basename(p).startswith(("libgomp", "libiomp5")))
    if not found:
        return None
    torch_dir = os.path.dirname(torch.__file__)  # torch's own copy first
    return next((p for p in found if p.startswith(torch_dir)), found[0])


def _share_torch_threads() -> None:
    """Run the CPU kernels' parallel regions on torch's OpenMP threads rather than on fmha's
    own pool. torch's threads spin for a while after each of torch's operators; on a
    machine with as many threads as cores they took the cores from the pool's helpers, and
    fmha's attention inside a model ran no faster than SDPA's (python -m fmha.bench --e2e
    times such a model both ways). FMHA_OWN_THREADS=1 keeps the pool."""
    if os.environ.get("FMHA_OWN_THREADS", "") not in ("", "0"):
        return
    path = _torch_openmp_runtime()
    if path is not None:
        _C.use_openmp_runtime(path)


_share_torch_threads()


def _full(q: Tensor, k: Tensor, cu_q: Optional[Tensor], max_q: int, max_k: int):
    """(batch, heads_q, seqlen_q, seqlen_k) of a call (maxima when varlen)."""
    if cu_q is not None:
        return (cu_q.shape[0] - 1, q.shape[1], max_q, max_k)
    return (q.shape[0], q.shape[2], q.shape[1], k.shape[1])


def _lse_shape(q: Tensor, full, varlen: bool):
    return (full[1], q.shape[0]) if varlen else full[:3]


def _ready(*xs):
    """The tensors as the kernels read them: a unit stride in the last dimension (copied
    only when missing; bool masks are read with any strides). Tensors that require grad are
    passed as they are: the DLPack export below does not check requires_grad, and the op's
    own autograd formula handles their gradients."""
    return [x if x is None or x.dtype == torch.bool or x.stride(-1) == 1 or x.shape[-1] == 1
            else x.contiguous() for x in xs]


def _offsets(cu_q: Optional[Tensor], cu_k: Optional[Tensor]):
    """The varlen offsets as the kernels read them (contiguous; None when dense)."""
    if cu_q is None:
        return None, None
    return cu_q.contiguous(), cu_k.contiguous()


def _rng_pair(rng: Optional[Tensor]):
    if rng is None:
        return 0, 0
    seed, offset = rng.tolist()
    return seed % 2**64, offset % 2**64


def _settings(q, scale, softcap, window_left, window_right, bottom_right, dropout_p, rng,
              max_q=None, max_k=None, num_splits=0, block=(0, 0, 0, 0),
              block_mask=(None, None)) -> dict:
    """fmha._C's keyword settings (see _core.kernel_settings: zeros are left out). block:
    (q_position, k_position, head_position, heads_total) of a block of a larger attention
    (csrc/fmha/params.h; fmha.distributed), all zero for an ordinary call; block_mask: a
    block-sparse mask's (index, partial) tensors, or Nones."""
    kw = dict(scale=scale, softcap=softcap, window_left=window_left, window_right=window_right,
              bottom_right=bottom_right, dropout_p=dropout_p, num_threads=get_num_threads())
    if rng is not None:
        kw["seed"], kw["offset"] = _rng_pair(rng)
    if num_splits:
        kw["num_splits"] = num_splits
    if any(block):
        kw.update(zip(_BLOCK_FIELDS, block))
    if block_mask[0] is not None:
        kw["block_index"], kw["block_masks"] = _exported(*block_mask)
    if q.is_cuda:
        kw["stream"] = torch.cuda.current_stream(q.device).cuda_stream
    if max_q is not None:
        kw.update(max_seqlen_q=max_q, max_seqlen_k=max_k)
    return kw


#: Where a block sits in a larger attention: the ops' last four arguments.
_BLOCK_FIELDS = ("q_position", "k_position", "head_position", "heads_total")


def _exported(*xs):
    """The arrays as DLPack capsules (None stays None): torch.utils.dlpack.to_dlpack costs a
    tenth of Tensor.__dlpack__, whose checks (requires_grad, conjugate bit, stream) the
    caller has already made. The kernels run on torch's current stream, the stream the
    tensors are ready on, so no stream handshake is needed."""
    return [None if x is None else to_dlpack(x) for x in xs]


def _fwd(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], mask: Optional[Tensor],
         alibi_slopes: Optional[Tensor], cu_seqlens_q: Optional[Tensor],
         cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int,
         rng: Optional[Tensor], scale: float, softcap: float, window_left: int,
         window_right: int, bottom_right: bool, dropout_p: float,
         deterministic: bool = False, num_splits: int = 0, q_position: int = 0,
         k_position: int = 0, head_position: int = 0, heads_total: int = 0,
         block_index: Optional[Tensor] = None,
         block_masks: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Attention forward: returns (out, lse). rng = [seed, offset] (int64) for dropout.
    deterministic only travels to the backward (see _setup_context); num_splits: key splits
    of the CUDA forward (0 = by occupancy), ignored by the CPU kernels; the positions: a
    block of a larger attention (_settings); block_index, block_masks: a block-sparse mask
    (fmha/block_mask.py: index and partial). The body of the fmha::fwd op, and what eager
    calls that need no op (see _direct) run."""
    varlen = cu_seqlens_q is not None
    full = _full(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    return _run_forward(q, k, v, bias, mask, alibi_slopes, cu_seqlens_q, cu_seqlens_k, full,
                        _lse_shape(q, full, varlen),
                        _settings(q, scale, softcap, window_left, window_right, bottom_right,
                                  dropout_p, rng, max_seqlen_q if varlen else None,
                                  max_seqlen_k, num_splits,
                                  (q_position, k_position, head_position, heads_total),
                                  (block_index, block_masks)))


def _run_forward(q, k, v, bias, mask, alibi_slopes, cu_q, cu_k, full, lse_shape, kw):
    """Allocates out and lse on q's device and runs the kernels' forward with the keyword
    settings kw: what the op body and an eager call without the op (_forward_eager) share."""
    q, k, v, bias = _ready(q, k, v, bias)
    if v.shape[-1] == q.shape[-1] and q.is_contiguous():
        out = torch.empty_like(q)  # the cheapest allocation torch has (~1 us here)
    else:
        out = torch.empty(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype, device=q.device)
    lse = q.new_empty(lse_shape,
                      dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
    _core._kernels.forward(*_exported(q, k, v, out, lse, *core_args(full, bias, mask, alibi_slopes),
                                      *_offsets(cu_q, cu_k)), **kw)
    return out, lse


def _forward_eager(spec: Spec, q, k, v, bias, mask, alibi_slopes, block=None):
    """A dense eager call without dropout that needs no op (see _direct): the op body with the
    shapes and settings the (cached) Spec already holds, and no layer in between."""
    kw = dict(spec.kernel_settings, num_threads=get_num_threads())
    if block is not None:
        kw["block_index"], kw["block_masks"] = _exported(*block)
    if q.is_cuda:
        kw["stream"] = torch.cuda.current_stream(q.device).cuda_stream
    return _run_forward(q, k, v, bias, mask, alibi_slopes, None, None, spec.full,
                        spec.full[:3], kw)


# device_types: the CPU and CUDA kernels behind one device-generic implementation.
fwd = torch.library.custom_op("fmha::fwd", _fwd, mutates_args=(), device_types=("cpu", "cuda"))


@fwd.register_fake
def _(q, k, v, bias, mask, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
      max_seqlen_k, rng, scale, softcap, window_left, window_right, bottom_right, dropout_p,
      deterministic=False, num_splits=0, q_position=0, k_position=0, head_position=0,
      heads_total=0, block_index=None, block_masks=None):
    full = _full(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    out = q.new_empty(q.shape[:-1] + (v.shape[-1],))
    lse = q.new_empty(_lse_shape(q, full, cu_seqlens_q is not None),
                      dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
    return out, lse


def _bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
         bias: Optional[Tensor], mask: Optional[Tensor], alibi_slopes: Optional[Tensor],
         cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], max_seqlen_q: int,
         max_seqlen_k: int, rng: Optional[Tensor], scale: float, softcap: float,
         window_left: int, window_right: int, bottom_right: bool, dropout_p: float,
         bias_grad: bool, deterministic: bool = False, dlse: Optional[Tensor] = None,
         q_position: int = 0, k_position: int = 0, head_position: int = 0,
         heads_total: int = 0, block_index: Optional[Tensor] = None,
         block_masks: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Attention backward: returns (dq, dk, dv, dbias); dbias is empty unless bias_grad.
    deterministic (or torch.use_deterministic_algorithms(True), read when the op runs):
    bitwise-reproducible CUDA gradients. dlse: the gradient reaching lse, or None."""
    dout, q, k, v, out, lse, bias = _ready(dout, q, k, v, out, lse, bias)
    if dlse is not None:  # the kernels read it with lse's strides
        lse, dlse = lse.contiguous(), dlse.to(lse.dtype).contiguous()
    full = _full(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dbias = None
    if bias_grad:
        dbias = torch.empty(dbias_shape(bias.shape, full), dtype=lse.dtype, device=q.device)
    varlen = cu_seqlens_q is not None
    _core._kernels.backward(
        *_exported(dout, q, k, v, out, lse, dq, dk, dv, dbias,
                   *core_args(full, bias, mask, alibi_slopes),
                   *_offsets(cu_seqlens_q, cu_seqlens_k)),
        **_settings(q, scale, softcap, window_left, window_right, bottom_right, dropout_p, rng,
                    max_seqlen_q if varlen else None, max_seqlen_k, 0,
                    (q_position, k_position, head_position, heads_total),
                    (block_index, block_masks)),
        dlse=None if dlse is None else _exported(dlse)[0],
        deterministic=bool(deterministic or torch.are_deterministic_algorithms_enabled()))
    if dbias is None:
        dbias = q.new_empty((0,))
    else:
        dbias = dbias.reshape(bias.shape).to(bias.dtype)
    return dq, dk, dv, dbias


bwd = torch.library.custom_op("fmha::bwd", _bwd, mutates_args=(), device_types=("cpu", "cuda"))


@bwd.register_fake
def _(dout, q, k, v, out, lse, bias, mask, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
      max_seqlen_q, max_seqlen_k, rng, scale, softcap, window_left, window_right, bottom_right,
      dropout_p, bias_grad, deterministic=False, dlse=None, q_position=0, k_position=0,
      head_position=0, heads_total=0, block_index=None, block_masks=None):
    dbias = bias.new_empty(bias.shape) if bias_grad else q.new_empty((0,))
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dbias


#: The inputs of fmha::fwd by name, in the op's order (their types are in fwd's signature;
#: tests/api/test_torch_ops.py checks the names against the registered schema). Built from
#: setup_context's ``inputs``, so a changed argument count fails there instead of shifting
#: every field by one.
_FwdInputs = namedtuple(
    "_FwdInputs", "q k v bias mask alibi_slopes cu_seqlens_q cu_seqlens_k max_seqlen_q "
    "max_seqlen_k rng scale softcap window_left window_right bottom_right dropout_p "
    "deterministic num_splits q_position k_position head_position heads_total block_index "
    "block_masks", defaults=(False, 0, 0, 0, 0, 0, None, None))


#: The tensor inputs the backward needs; they travel through ctx.save_for_backward.
_SAVED_INPUTS = ("q", "k", "v", "bias", "mask", "alibi_slopes", "cu_seqlens_q", "cu_seqlens_k",
                 "rng", "block_index", "block_masks")


def _setup_context(ctx, inputs, output):
    args = _FwdInputs(*inputs)
    out, lse = output
    ctx.save_for_backward(out, lse, *(getattr(args, name) for name in _SAVED_INPUTS))
    # The non-tensor settings, by name; the tensors are only in saved_tensors.
    ctx.settings = args._replace(**dict.fromkeys(_SAVED_INPUTS))
    # An output nobody differentiates arrives as None, not as zeros: lse's gradient is
    # folded in only when lse was used (docs/semantics.md, "The backward").
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse):
    out, lse, *saved = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    args = ctx.settings._replace(**dict(zip(_SAVED_INPUTS, saved)))
    bias_grad = args.bias is not None and ctx.needs_input_grad[_FwdInputs._fields.index("bias")]
    # An eager backward that records nothing runs the op's body itself, as the forward does
    # (_direct): the op's CPU/CUDA implementation is wrapped in torch._disable_dynamo, whose
    # first call imports torch._dynamo (1.6 s on the Zen 5 VM, once per process) -- a cost
    # of the wrapper, not of the kernels. Traces, modes and double backward get the op.
    run = _bwd if _direct(dout, args.q, args.k, args.v, out, lse, args.bias, args.mask,
                          args.alibi_slopes, dlse) else bwd
    dq, dk, dv, dbias = run(dout, args.q, args.k, args.v, out, lse, args.bias, args.mask,
                            args.alibi_slopes, args.cu_seqlens_q, args.cu_seqlens_k,
                            args.max_seqlen_q, args.max_seqlen_k, args.rng, args.scale,
                            args.softcap, args.window_left, args.window_right,
                            args.bottom_right, args.dropout_p, bias_grad, args.deterministic,
                            dlse, args.q_position, args.k_position, args.head_position,
                            args.heads_total, args.block_index, args.block_masks)
    return (dq, dk, dv, dbias if bias_grad else None) + (None,) * (len(ctx.needs_input_grad) - 4)


fwd.register_autograd(_backward, setup_context=_setup_context)


_Parameter = torch.nn.Parameter  # a Tensor to every layer of the op (no torch function of its own)


def _plain_eager(tensors) -> bool:
    """Whether nothing but autograd needs to see the op: the inputs are plain tensors or
    nn.Parameters (not FakeTensors or other subclasses) on a device the kernels run on (CPU or
    CUDA; "meta" tensors need the op's fake implementation), and no torch.compile trace,
    functorch transform (vmap, grad) or dispatch/function mode is active. tensors[0] is q (the
    backward's: dout), whose device validation has made every other input's."""
    if torch.compiler.is_compiling():
        return False
    for x in tensors:
        if x is not None and type(x) is not Tensor and type(x) is not _Parameter:
            return False
    if not (tensors[0].is_cpu or tensors[0].is_cuda):
        return False
    return not (torch._C._is_torch_function_mode_enabled()
                or torch._C._len_torch_dispatch_stack()
                or torch._C._functorch.peek_interpreter_stack() is not None)


def _direct(*tensors) -> bool:
    """Can an eager call run the op's body directly? It can when no layer of the op has
    anything to do: :func:`_plain_eager`, and no gradient can flow (grad mode off, or no
    input requires grad). The outputs are the same tensors the op would return; the
    dispatcher, autograd wrapper and custom-op layers are what is skipped: tens of
    microseconds per call (docs/cpu_kernels.md, "Small calls")."""
    if torch.is_grad_enabled():
        for x in tensors:
            if x is not None and x.requires_grad:
                return False
    return _plain_eager(tensors)


class _Attention(torch.autograd.Function):
    """fmha::fwd with its registered autograd formula (the same _setup_context and
    _backward), as an autograd.Function: what an eager call that records a graph runs when
    :func:`_plain_eager` holds. torch's custom-op autograd wrapper (torch 2.13,
    torch._library.utils.fill_defaults) rebuilds the op's 25-argument schema list once per
    argument on every call, ~280 µs for a tiny call here; this costs what a Function costs.
    torch.compile, transforms, modes and subclasses still get the op."""

    @staticmethod
    def forward(ctx, *inputs):
        out, lse = _fwd(*inputs)
        _setup_context(ctx, inputs, (out, lse))
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        return _backward(ctx, dout, dlse)


def plain_forward(spec: Spec, q, k, v, return_lse: bool):
    """The plain call -- dense; no bias, mask, ALiBi, dropout, sinks or block mask; arguments
    already validated -- when :func:`_direct` lets it skip the op: the outputs allocated
    here, the three inputs exported, one kernel call. A host call that does not return lse
    leaves it to the kernels' own buffer (one allocation less). None when the call needs the
    general path (the op, or a copy of an input whose last dimension is strided). The same
    kernels with the same settings as the op, so the same bits (tests/api/test_small_calls.py);
    a layer loop's call costs what is left: docs/cpu_kernels.md, "Small calls"."""
    if not _direct(q, k, v):
        return None
    q_dense = q.is_contiguous()
    if not ((q_dense or q.stride(-1) == 1) and (k.is_contiguous() or k.stride(-1) == 1)
            and (v.is_contiguous() or v.stride(-1) == 1)):
        return None
    if q_dense and spec.head_dim_v == spec.head_dim:
        out = torch.empty_like(q)
    else:
        out = torch.empty(q.shape[:-1] + (spec.head_dim_v,), dtype=q.dtype, device=q.device)
    kw = dict(spec.kernel_settings, num_threads=get_num_threads())
    lse = None
    if q.is_cuda:
        kw["stream"] = torch.cuda.current_stream(q.device).cuda_stream
    if return_lse or q.is_cuda or not _core.lse_optional():
        lse = torch.empty(spec.full[:3], device=q.device,
                          dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
    _core._kernels.forward(to_dlpack(q), to_dlpack(k), to_dlpack(v), to_dlpack(out),
                           None if lse is None else to_dlpack(lse), **kw)
    return (out, lse) if return_lse else out


def attention(spec: Spec, q, k, v, bias, mask, alibi_slopes, return_lse, cu_q=None, cu_k=None,
              deterministic=False, block=None):
    """fmha.attention / attention_varlen for torch tensors (arguments already validated);
    block: a block-sparse mask's (index, partial) tensors on q's device, or None."""
    if spec.dropout_p == 0 and cu_q is None and _direct(q, k, v, bias, mask, alibi_slopes):
        out, lse = _forward_eager(spec, q, k, v, bias, mask, alibi_slopes, block)
        return (out, lse) if return_lse else out
    rng = None
    if spec.dropout_p > 0:
        # Drawn from torch's default (CPU) generator whatever q's device, so torch.manual_seed
        # reproduces the mask, and reproduces the same one on CPU and GPU.
        rng = torch.randint(0, 2**62, (2,), dtype=torch.int64)
    if cu_q is not None:
        # The kernels read the offsets where they read q. (Host offsets were validated on the
        # host; device offsets are never read there: the kernels clamp each sequence.)
        cu_q, cu_k = cu_q.to(q.device), cu_k.to(q.device)
    args = (q, k, v, bias, mask, alibi_slopes, cu_q, cu_k, spec.seqlen_q, spec.seqlen_k, rng,
            spec.scale, spec.softcap, spec.window_left, spec.window_right, spec.bottom_right,
            spec.dropout_p, bool(deterministic), spec.num_splits,
            *((0, 0, 0, 0) + tuple(block) if block is not None else ()))
    tensors = (q, k, v, bias, mask, alibi_slopes)
    if _direct(*tensors):
        out, lse = _fwd(*args)
    elif _plain_eager(tensors):  # a graph is recorded: the formula without the op's wrapper
        out, lse = _Attention.apply(*args)
    else:
        out, lse = fwd(*args)
    return (out, lse) if return_lse else out
