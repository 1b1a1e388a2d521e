"""fmha.kvcache.attention_with_kvcache: the forward over KV caches (contiguous or paged),
new rows appended in place. Public through fmha.kvcache; PagedKVCache (_paged.py) calls it.

The semantics (which rows a query sees, what is written) are in docs/semantics.md,
"KV caches"; ``fmha.reference.attention_with_kvcache`` is their executable form.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from . import _core, _sinks, kvquant
from ._core import get_num_threads
from ._validate import (_FLOAT_NAMES, _check_array, _check_float, _check_int, _check_number, _describe,
                        check_dtype, check_head_dims, check_kv_cache_dtype, device_of, dtype_name, kind_of)


def _int32_array(name, x, kind, ndim, batch=None, device="cpu"):
    """cache_seqlens / block_table: an int32 array of q's kind (an int for cache_seqlens is
    the same length for every sequence)."""
    if name == "cache_seqlens" and isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        if kind == "torch":
            import torch
            return torch.full((batch,), int(x), dtype=torch.int32, device=device)
        return np.full((batch,), int(x), dtype=np.int32)
    _check_array(name, x, kind, (ndim,))
    if dtype_name(x) != "int32":
        raise TypeError(f"{name}: expected int32, got {dtype_name(x)}")
    # Read only, and small: a strided view is copied rather than refused.
    return x.contiguous() if kind == "torch" else np.ascontiguousarray(x)


_NO_WINDOW = (-1, -1)


def _last_dim_contiguous(x):
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.detach().contiguous()


#: Cache dtypes that hold 8-bit codes (fmha/kvquant.py), by dtype name.
_QUANT_DTYPES = {"int8": "int8", "float8_e4m3fn": "float8_e4m3fn",
                 "float8_e5m2": "float8_e5m2"}


def _cache_format(k_cache, v_cache, cache_dtype):
    """The 8-bit encoding of the caches (None for caches in q's dtype). NumPy float8 caches
    are uint8 bytes with cache_dtype naming the encoding (or ml_dtypes' float8 arrays)."""
    formats = []
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        dt = dtype_name(x)
        fmt = _QUANT_DTYPES.get(dt)
        if dt == "uint8":
            if cache_dtype not in ("float8_e4m3fn", "float8_e5m2"):
                raise TypeError(f"{name}: uint8 bytes need cache_dtype='float8_e4m3fn' or "
                                f"'float8_e5m2' to say their encoding, got {cache_dtype!r}")
            fmt = cache_dtype
        elif cache_dtype is not None and fmt != cache_dtype:
            raise TypeError(f"{name}: dtype {dt} does not hold cache_dtype={cache_dtype!r}")
        formats.append(fmt)
    if formats[0] != formats[1]:
        raise TypeError(f"v_cache: encoding {formats[1] or dtype_name(v_cache)} differs from "
                        f"k_cache's {formats[0] or dtype_name(k_cache)}")
    return formats[0]


def _check_scales(fmt, k_scale, v_scale, k_cache, kind, device, appending):
    """k_scale / v_scale of a quantized cache: float32 of q's kind and device, (heads_kv,)
    (static; positive and finite, which the kernels check) or k_cache.shape[:-1] (dynamic,
    written at append time);
    both of one granularity. Returns (k_scale, v_scale, dynamic)."""
    if fmt is None:
        for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
            if x is not None:
                raise ValueError(f"{name}: given for a {dtype_name(k_cache)} cache; scales "
                                 "belong to 8-bit caches (int8, float8_e4m3fn, float8_e5m2)")
        return None, None, False
    heads = k_cache.shape[-2]
    static, dynamic = (heads,), tuple(k_cache.shape[:-1])
    shapes = []
    for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
        if x is None:
            raise ValueError(f"{name}: required with a {fmt} cache (float32 ({heads},) per "
                             f"kv head, or {dynamic} per row and kv head)")
        _check_array(name, x, kind, (1, 3))
        if dtype_name(x) != "float32":
            raise TypeError(f"{name}: expected float32, got {dtype_name(x)}")
        if device_of(x) != device:
            raise ValueError(f"{name}: on device {device_of(x)}, expected q's device {device}")
        if tuple(x.shape) not in (static, dynamic):
            raise ValueError(f"{name}: expected shape {static} (per kv head) or {dynamic} (per "
                             f"row and kv head), got {tuple(x.shape)}")
        shapes.append(tuple(x.shape))
        # Static scales must be finite and > 0: the CPU kernels check them before they run,
        # the CUDA kernels on the device (a refusal, as for cache_seqlens).
        if tuple(x.shape) == dynamic:
            contiguous = (x.is_contiguous() if kind == "torch" else x.flags.c_contiguous)
            if not contiguous:
                raise ValueError(f"{name}: dynamic scales must be contiguous (they are written "
                                 "in place)")
            if appending and (x.requires_grad if kind == "torch" else not x.flags.writeable):
                raise ValueError(f"{name}: dynamic scales are written at append time; pass a "
                                 "writable array without grad")
    if shapes[0] != shapes[1]:
        raise ValueError(f"v_scale: shape {shapes[1]} differs from k_scale's {shapes[0]} (give "
                         "both per kv head or both per row)")
    if shapes[0] == dynamic and v_scale is k_scale:
        raise ValueError("v_scale: the same array as k_scale; per-row scales need one array "
                         "each")
    return k_scale, v_scale, shapes[0] == dynamic


def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens,
                           block_table=None, causal: bool = False, window=_NO_WINDOW,
                           scale: Optional[float] = None, softcap: float = 0.0,
                           alibi_slopes=None, return_lse: bool = False, num_splits: int = 0,
                           sinks=None, k_scale=None, v_scale=None, cache_dtype=None):
    """Attention of new queries over a KV cache, appending new keys and values in place.

    q: (batch, seqlen_q, heads_q, head_dim), seqlen_q >= 1 (decode, speculative
    verification and chunked prefill alike). Caches, one of:
      - contiguous: k_cache (batch, capacity, heads_kv, head_dim), v_cache likewise with
        head_dim_v;
      - paged (``block_table`` given, int32 (batch, max_blocks)): k_cache, v_cache are pools
        (num_blocks, block_size, heads_kv, head_dim[_v]), any block_size >= 1; row j of
        sequence b is row j % block_size of block block_table[b, j // block_size].
    cache_seqlens: int32 (batch,) (or an int): rows each sequence's cache holds before the
    call. k, v (batch, seqlen_new, heads_kv, head_dim[_v]), if given, are written into rows
    cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 of each cache, in place. Sequence
    b's queries then attend to its rows 0 .. cache_seqlens[b] + seqlen_new - 1, aligned
    bottom-right (the last query is the last row): causal, window, softcap, ALiBi and the
    scale (default 1/sqrt(head_dim)) mean what they mean in :func:`fmha.attention`.

    What the call updates: the caches' appended rows, nothing else. ``cache_seqlens`` stays
    the caller's to advance (by seqlen_new), as in flash-attn. Every argument, including the
    values of cache_seqlens and block_table, is checked before the first write: a refused
    call leaves the caches unchanged. On the CPU a refused call raises. On CUDA the values
    of cache_seqlens, block_table and static 8-bit scales are checked by the kernels, on
    the device (no host
    synchronisation; the call can be captured in a CUDA graph): a refused call writes
    nothing into the caches, returns NaN in out and lse, and is reported by
    :func:`check_refused`.

    Forward only (inference; no gradient flows). Returns out (batch, seqlen_q, heads_q,
    head_dim_v), or (out, lse) with lse (batch, heads_q, seqlen_q) float32 (float64 for
    float64 inputs) when return_lse, for :func:`fmha.merge_states`. num_splits (CUDA): 0
    splits each sequence's keys into 256-key ranges (FlashDecoding), n > 0 cuts the capacity
    into n ranges; the CPU ignores it. sinks: attention-sink logits (heads_q,), as in
    :func:`fmha.attention` (lse then includes them). Torch tensors and NumPy arrays on the CPU
    (float64/float32/bfloat16/float16), torch tensors on CUDA (float16/bfloat16, head_dim
    <= 256).

    8-bit caches (fmha/kvquant.py; docs/semantics.md, "8-bit KV caches"): k_cache and
    v_cache of one encoding -- torch.int8 / torch.float8_e4m3fn / torch.float8_e5m2; NumPy
    int8, or uint8 bytes with ``cache_dtype="float8_e4m3fn"`` / ``"float8_e5m2"`` -- with
    float32 scales ``k_scale``, ``v_scale``: (heads_kv,) per kv head (static, e.g. from
    :func:`fmha.kvquant.calibrate_scales`) or k_cache.shape[:-1] per row and kv head
    (dynamic: the append writes each new row's scale). New rows k, v come in q's dtype and
    are quantised as they are appended; the kernels read the codes as they read 16-bit rows
    and apply the scales per key (float32 softmax and accumulation).
    """
    kind = kind_of(q)
    if not kind:
        raise TypeError(f"q: expected a torch.Tensor or numpy.ndarray, got {_describe(q)}")
    arrays = (("q", q), ("k_cache", k_cache), ("v_cache", v_cache))
    if (k is None) != (v is None):
        raise ValueError("k, v: give both new rows or neither")
    if k is not None:
        arrays += (("k", k), ("v", v))
    # The common call (every array of q's type, rank and dtype) costs a few attribute reads;
    # anything else takes the checks that word the error.
    qt, qd = type(q), q.dtype
    fmt = None
    if not all(type(x) is qt and x.ndim == 4 and x.dtype == qd for _, x in arrays):
        dt = dtype_name(q)
        for name, x in arrays:
            _check_array(name, x, kind, (4,))
        fmt = _cache_format(k_cache, v_cache, cache_dtype)
        for name, x in arrays:
            if fmt is None or name not in ("k_cache", "v_cache"):
                _check_float(name, x, None if name == "q" else dt)
    elif cache_dtype is not None:
        raise TypeError(f"k_cache: dtype {dtype_name(k_cache)} does not hold "
                        f"cache_dtype={cache_dtype!r}")
    dt = dtype_name(q)
    if dt not in _FLOAT_NAMES:
        _check_float("q", q)
    device = device_of(q)
    check_dtype(device, dt)
    if fmt is not None:
        check_kv_cache_dtype(device, fmt)
    batch, seqlen_q, heads_q, head_dim = q.shape
    if seqlen_q < 1:
        raise ValueError(f"q: seqlen_q must be >= 1, got shape {tuple(q.shape)}")
    head_dim_v = v_cache.shape[-1]
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if kind == "torch" and x.numel() and x.stride(-1) != 1:
            raise ValueError(f"{name}: the last dimension must be contiguous (the cache is "
                             "written in place, so it cannot be copied)")
        if kind != "torch" and x.size and x.strides[-1] != x.itemsize:
            raise ValueError(f"{name}: the last dimension must be contiguous (the cache is "
                             "written in place, so it cannot be copied)")
        if kind != "torch" and not x.flags.writeable:
            raise ValueError(f"{name}: read-only array; the cache must be writable")
        if kind == "torch" and x.requires_grad:
            raise ValueError(f"{name}: requires grad; attention_with_kvcache writes the cache "
                             "in place and is forward-only (pass a tensor without grad)")
    k_scale, v_scale, dynamic = _check_scales(fmt, k_scale, v_scale, k_cache, kind, device,
                                              k is not None)
    check_head_dims(device, (("q", head_dim), ("v_cache", head_dim_v)), kv8=fmt is not None)
    cache_seqlens = _int32_array("cache_seqlens", cache_seqlens, kind, 1, batch,
                                 q.device if kind == "torch" else "cpu")
    if block_table is not None:
        block_table = _int32_array("block_table", block_table, kind, 2)
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal: expected a bool, got {_describe(causal)}")
    if window is _NO_WINDOW:
        left, right = -1, 0 if causal else -1
    else:
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            raise TypeError(f"window: expected a (left, right) pair of ints, got "
                            f"{_describe(window)}")
        left = _check_int("window[0]", window[0], -1)
        right = 0 if causal else _check_int("window[1]", window[1], -1)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else _check_number("scale", scale)
    softcap = _check_number("softcap", softcap, lo=0.0)
    num_splits = _check_int("num_splits", num_splits, 0)
    if sinks is not None:
        _sinks.check(sinks, q, heads_q)

    if alibi_slopes is not None:
        _check_array("alibi_slopes", alibi_slopes, kind, (1, 2))
        _check_float("alibi_slopes", alibi_slopes)
        if tuple(alibi_slopes.shape) not in ((heads_q,), (batch, heads_q)):
            raise ValueError(f"alibi_slopes: expected shape ({heads_q},) or ({batch}, "
                             f"{heads_q}), got {tuple(alibi_slopes.shape)}")
    lse_shape = (batch, heads_q, seqlen_q)
    out_shape = (batch, seqlen_q, heads_q, head_dim_v)
    if kind == "torch":
        import torch
        from torch.utils.dlpack import to_dlpack
        q, k, v = (None if x is None else _last_dim_contiguous(x) for x in (q, k, v))
        out = torch.empty(out_shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(lse_shape, dtype=torch.float64 if dt == "float64" else torch.float32,
                          device=q.device)
        if alibi_slopes is not None:
            a = alibi_slopes.detach().to(device=q.device, dtype=torch.float64)
            alibi_slopes = (a if a.ndim == 2 else a.unsqueeze(0)).expand(batch, heads_q)
        # DLPack capsules: torch.utils.dlpack.to_dlpack costs a tenth of Tensor.__dlpack__
        # (the checks it skips are made above; the caches are written through theirs).
        if fmt is not None:  # the codes as bytes (DLPack need not know float8)
            k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        args = [None if x is None else to_dlpack(x) for x in
                (q, k_cache, v_cache, out, lse, k, v, cache_seqlens, block_table)]
        scales = [None if x is None else to_dlpack(x) for x in (k_scale, v_scale)]
    else:
        q, k, v = (None if x is None else np.ascontiguousarray(x) for x in (q, k, v))
        out = np.empty(out_shape, dtype=q.dtype)
        lse = np.empty(lse_shape, dtype=np.float64 if dt == "float64" else np.float32)
        if alibi_slopes is not None:
            a = np.asarray(alibi_slopes, dtype=np.float64)
            alibi_slopes = np.broadcast_to(a if a.ndim == 2 else a[None], (batch, heads_q))
        if fmt is not None:
            k_cache, v_cache = kvquant.as_codes(k_cache), kvquant.as_codes(v_cache)
        args = [q, k_cache, v_cache, out, lse, k, v, cache_seqlens, block_table]
        scales = [k_scale, v_scale]
    kw = dict(scale=scale, softcap=softcap, window_left=left, window_right=right,
              num_threads=get_num_threads())
    if num_splits:
        kw["num_splits"] = num_splits
    if fmt is not None:
        kw["kv_code"] = kvquant.CODES[fmt]
    if device != "cpu":
        import torch
        kw["stream"] = torch.cuda.current_stream(q.device).cuda_stream
    _core._kernels.forward_kvcache(*args, alibi_slopes, *scales, **kw)
    if sinks is not None:  # applied to the kernels' out and lse (fmha/_sinks.py)
        out, lse = (_sinks.apply_torch if kind == "torch" else _sinks.apply_numpy)(
            out, lse, sinks)
    return (out, lse) if return_lse else out


#: The bits of the CUDA kernels' refusal flag (csrc/cuda/flash_decode.h, KvCacheRefusal).
_REFUSALS = (
    (1, "cache_seqlens: an entry was negative"),
    (2, "cache_seqlens: an entry plus the new rows exceeded the cache's capacity"),
    (4, "block_table: a sequence read or wrote a block outside [0, num_blocks)"),
    (8, "block_table: a block appended to through one table entry was read or written "
        "through another in the same call"),
    (16, "k_scale / v_scale: a static scale (per kv head) was not finite and > 0"),
)


def check_refused(device=None):
    """Raises ValueError if a CUDA call of :func:`attention_with_kvcache` on ``device``
    (default: the current one) was refused since the last check, and resets the record.

    On CUDA, ``cache_seqlens`` and ``block_table`` stay on the device: reading them on the
    host would synchronise every decode step. The kernels check them instead, and a call
    they refuse writes nothing into the caches and returns NaN in every row of ``out`` and
    ``lse`` (docs/semantics.md, "KV caches"). This function synchronises with the device, so
    call it where a synchronisation is cheap (after a generation step, in tests). On the
    CPU every call is checked before it runs and raises at once: nothing is recorded.
    """
    from ._validate import _describe
    index = getattr(device, "index", device)
    if index is None:  # the current device; without one, 0 (the core says there is none)
        try:
            import torch
            index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        except ImportError:
            index = 0
    if not isinstance(index, int):
        raise TypeError(f"device: expected a CUDA device or its index, got {_describe(device)}")
    module = _core._kernels
    bits = (module.cuda_kvcache_refusals(index, True) if hasattr(module, "cuda_kvcache_refusals")
            else module.kvcache_refusals(True))
    if bits:
        raise ValueError("attention_with_kvcache refused a call on the device (its caches are "
                         "unchanged, its out and lse NaN): " +
                         "; ".join(text for bit, text in _REFUSALS if bits & bit))
