"""Hugging Face transformers: ``attn_implementation="fmha"``.

Importing this module registers fmha with transformers' ``AttentionInterface`` (the
attention function) and ``AttentionMaskInterface`` (the mask builder, the same boolean
masks as ``"sdpa"``), so that a model that calls its attention through those interfaces
can select fmha::

    import fmha.integrations.transformers  # noqa: F401  (registers "fmha")
    model = AutoModelForCausalLM.from_config(config, attn_implementation="fmha")
    model.set_attn_implementation("fmha")  # or switch an existing model

Verified (transformers 5.24, CPU): tests/integrations/test_models.py runs BERT, RoBERTa, ViT, CLIP,
Whisper, T5, BART, GPT-2, Llama (GQA), Mistral (sliding window), Qwen2 and Gemma 2
(softcap) against ``"sdpa"`` and ``"eager"`` (forward, a training step's gradients, greedy
decoding); tests/integrations/test_transformers.py checks Llama in more depth and the attention function
alone with a float mask, a T5-style ``position_bias``, ``softcap`` and grouped heads.

Head importance (fmha.nn.head_importance) gates each head's output here: the function
reports the layers it computes (``_heads.observe``) and multiplies in their gates.

Attention sinks (``s_aux``, gpt-oss) go to :func:`fmha.attention`'s ``sinks``; a tiny
randomly initialised ``GptOssForCausalLM`` is checked against ``"eager"`` (its sinks are
in no other implementation). ``output_attentions=True`` gets ``None`` for the weights
(fmha never forms them); with the two serving paths below it is refused.

Serving (docs/guides/serving.md):

- ``model.generate_batch()`` / ``init_continuous_batching()`` (transformers' continuous
  batching, its ``PagedAttentionCache``): prefill and mixed batches arrive packed, with
  ``cu_seq_lens_q/k``, and run on :func:`fmha.attention_varlen`; decode-only batches, when
  transformers hands over its block table, run on :func:`fmha.kvcache.attention_with_kvcache`
  over transformers' own pages, read and appended in place. transformers only accepts an
  allow-list of implementations there; :func:`register` adds fmha to it (see
  ``_enable_continuous_batching``).
- ``model.generate(..., cache=PagedCache(model.config, ...))``: :class:`PagedCache`,
  a transformers ``Cache`` on :class:`fmha.kvcache.PagedKVCache` (16- or 8-bit pools); each
  layer appends its new rows in place and attends through ``attention_with_kvcache``.

tests/integrations/test_serving.py checks both against the reference's greedy tokens. On CUDA
tensors both run fmha's CUDA kernels, which take float16/bfloat16: a float32 model there is
refused (naming ``dtype``), as is a PagedCache off the model's device; the test file's
``cuda`` cases run on a GPU (tools/gpu_check.sh).

transformers is imported here and only here: ``import fmha`` does not need it.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .. import _heads, kvquant
from .._api import attention, attention_varlen
from .._kvcache import attention_with_kvcache
from .._paged import PagedKVCache
from .._validate import _BACKENDS, backend_of, check_head_dims, device_of, dtype_name

__all__ = ["NAME", "PagedCache", "fmha_attention_forward", "register"]

#: The name under which :func:`register` makes fmha available by default.
NAME = "fmha"

#: Every name registered by :func:`register` (continuous batching and PagedCache accept them).
_NAMES = {NAME}

#: The transformers version the serving paths were written against and are tested with.
TESTED_TRANSFORMERS = "5.24.0"

#: The key under which PagedCache.update hands a layer's new rows to the attention function.
_PAGED_KEY = "_fmha_paged_cache"


def _refuse_output_attentions(kwargs, path):
    if kwargs.get("output_attentions"):
        raise ValueError(f"output_attentions=True: not supported with {path} on fmha (the "
                         "attention weights are never formed)")


def _refuse_dtype_the_device_lacks(x: torch.Tensor, path: str) -> None:
    """A model whose activations the kernels of its device do not take (on CUDA: float16 and
    bfloat16 only, fmha's capability table) is refused here, naming the dtype, before
    anything is allocated or written; never computed on another device or dtype."""
    device = device_of(x)
    caps = _BACKENDS[backend_of(device)]
    if dtype_name(x) not in caps["dtypes"]:
        raise NotImplementedError(
            f"dtype: the model runs in {dtype_name(x)} on {device}, and fmha's {caps['label']} "
            f"kernels take {'/'.join(caps['dtypes'])} ({path}); load the model in one of "
            "those (e.g. dtype=torch.bfloat16) or serve it on the CPU")


def _window(sliding_window) -> Tuple[int, int]:
    """transformers' sliding_window W (a query sees the W most recent positions, itself
    included) as fmha's causal (left, right) window."""
    if sliding_window is None or int(sliding_window) <= 0:
        return (-1, 0)
    return (int(sliding_window) - 1, 0)


def _sinks_of(kwargs):
    sinks = kwargs.get("s_aux")
    return kwargs.get("sinks") if sinks is None else sinks


def _continuous_batching_forward(module, query, key, value, scaling, softcap, dropout, causal,
                                  kwargs):
    """One layer of a continuous-batching step (transformers' PagedAttentionCache).

    Decode-only batch with a block table (``k_cache``/``v_cache`` are transformers' page
    views of this layer, ``(num_pages, page_size, heads_kv, head_dim)``): fmha's paged
    kernel reads the pages through the block table and appends the new row in place.
    Otherwise the cache has already gathered each request's rows into packed K/V
    (``cu_seq_lens_k``): a varlen call, causal and bottom-right aligned per request (the
    same call serves packed training batches that carry cu_seq_lens, as for flash).
    """
    _refuse_output_attentions(kwargs, "continuous batching")
    _refuse_dtype_the_device_lacks(query, "continuous batching")
    window = _window(kwargs.get("sliding_window"))
    sinks = _sinks_of(kwargs)
    softcap = 0.0 if softcap is None else softcap
    cu_k = kwargs["cu_seq_lens_k"]
    block_table = kwargs.get("block_table")
    if block_table is not None and kwargs.get("k_cache") is not None:
        # (1, heads, n, d) with one query per request -> (n, 1, heads, d)
        q, k, v = (x[0].transpose(0, 1).unsqueeze(1) for x in (query, key, value))
        n = q.shape[0]
        # Rows already cached per request (the new one is counted in cu_seq_lens_k).
        seqlens = (cu_k[1:n + 1] - cu_k[:n] - 1).to(torch.int32)
        # Unused slots hold -1; the kernel never reads them, but the table must be valid.
        table = block_table[:n].clamp(min=0).to(torch.int32)
        out = attention_with_kvcache(q, kwargs["k_cache"], kwargs["v_cache"], k, v,
                                     cache_seqlens=seqlens, block_table=table, causal=True,
                                     window=window, scale=scaling, softcap=softcap,
                                     sinks=sinks)
        return out.reshape(1, n, *out.shape[2:])
    cu_q = kwargs["cu_seq_lens_q"].to(torch.int32)
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))   # (total, heads, d)
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    out = attention_varlen(q, k, v, cu_q, cu_k.to(torch.int32),
                           None if max_q is None else int(max_q),
                           None if max_k is None else int(max_k), causal=causal,
                           window=window if causal else (-1, -1), alignment="bottom_right",
                           scale=scaling, softcap=softcap, dropout_p=dropout, sinks=sinks)
    return out.unsqueeze(0)


def fmha_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                           value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                           dropout: float = 0.0, scaling: Optional[float] = None,
                           is_causal: Optional[bool] = None, softcap: Optional[float] = None,
                           position_bias: Optional[torch.Tensor] = None,
                           **kwargs) -> Tuple[torch.Tensor, None]:
    """transformers' attention-function contract, computed by :func:`fmha.attention`.

    Args:
        module: the calling attention layer (its ``is_causal`` is the default for
            ``is_causal``).
        query: ``(batch, heads_q, seqlen_q, head_dim)``.
        key: ``(batch, heads_kv, seqlen_k, head_dim)``; ``heads_q`` a multiple of
            ``heads_kv``: grouped heads are read in place, never repeated.
        value: ``(batch, heads_kv, seqlen_k, head_dim_v)``.
        attention_mask: ``None``, a bool mask (``True`` = may attend, what the registered
            mask builder makes) or an additive float mask, broadcastable to
            ``(batch, heads_q, seqlen_q, seqlen_k)``; a longer last dimension is cut to
            ``seqlen_k``.
        dropout: attention dropout probability (the caller passes 0 in eval mode).
        scaling: score scale; ``None`` means ``1/sqrt(head_dim)``.
        is_causal: causal masking when ``attention_mask`` is None (top-left aligned, as
            the ``"sdpa"`` implementation); ``None`` reads ``module.is_causal``.
        softcap: ``softcap * tanh(scores / softcap)`` before masking (Gemma 2 style).
        position_bias: an additive bias (T5-style relative positions), applied together
            with ``attention_mask``.
        **kwargs: ``s_aux`` (or ``sinks``), ``(heads_q,)`` attention-sink logits (gpt-oss),
            become fmha's ``sinks``. Continuous batching passes ``cu_seq_lens_q/k``,
            ``max_length_q/k`` and, for decode-only batches, ``block_table``, ``k_cache``,
            ``v_cache`` (packed or paged attention, below); a :class:`PagedCache` passes its
            own entry. Everything else models pass (``position_ids``, ``cache``,
            ``read_index``, ...) is ignored, as by ``"sdpa"``; ``sliding_window`` only
            matters on the two serving paths (elsewhere the window is in the mask).

    Returns:
        ``(attn_output, None)``: ``(batch, seqlen_q, heads_q, head_dim_v)``, contiguous
        (the layout transformers expects), and no attention weights.
    """
    paged = kwargs.get(_PAGED_KEY)
    if paged is not None:                       # generate() on a PagedCache
        cache, layer_idx = paged
        out = cache._attend(module, layer_idx, query, key, value, attention_mask, scaling,
                            softcap, kwargs)
        _heads.observe(module, query.shape[1])
        return _heads.gate_heads(module, out), None
    if kwargs.get("cu_seq_lens_k") is not None and not isinstance(kwargs["cu_seq_lens_k"], dict):
        # Continuous batching: the packed layout is described by the offsets, not a mask.
        causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
        out = _continuous_batching_forward(module, query, key, value, scaling, softcap, dropout,
                                           causal, kwargs)
        _heads.observe(module, query.shape[1])
        return _heads.gate_heads(module, out), None
    sinks = _sinks_of(kwargs)
    seqlen_q, seqlen_k = query.shape[2], key.shape[2]
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    # As "sdpa": causal only when no mask carries the pattern, and never for a single query
    # (decoding), which sees the whole cache.
    causal = bool(is_causal) and attention_mask is None and seqlen_q > 1
    mask = bias = None
    if attention_mask is not None:
        attention_mask = attention_mask[..., :seqlen_k]
        if attention_mask.dtype == torch.bool:
            mask = attention_mask
        else:
            bias = attention_mask
    if position_bias is not None:
        bias = position_bias if bias is None else bias + position_bias
    out = attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                    causal=causal, alignment="top_left", scale=scaling, bias=bias, mask=mask,
                    dropout_p=dropout, softcap=0.0 if softcap is None else softcap, sinks=sinks)
    # Head importance (fmha.nn.head_importance): find the layers, gate their heads.
    _heads.observe(module, query.shape[1])
    return _heads.gate_heads(module, out), None


def register(name: str = NAME) -> None:
    """Make ``attn_implementation=name`` select fmha in transformers (done on import with
    ``name="fmha"``; call again to add another name), for models, continuous batching and
    :class:`PagedCache`. Idempotent."""
    AttentionInterface.register(name, fmha_attention_forward)
    # The boolean "True = may attend" masks built for "sdpa" are fmha's convention, and
    # sdpa_mask returns None for plain causal batches, letting fmha skip the mask.
    AttentionMaskInterface.register(name, sdpa_mask)
    _NAMES.add(name)
    _enable_continuous_batching()


def _enable_continuous_batching() -> None:
    """Admit fmha's names to transformers' continuous batching.

    transformers (5.24) accepts only "paged|eager", "sdpa" and names containing "flash"
    (ContinuousBatchingManager.switch_to_cb_friendly_attn), and turns its block-table decode
    path on only for flash-attn 2/3 on CUDA or XPU (initialization.
    ensure_decode_fast_path_is_available). A "flash" name would be taken for a flash-attn
    kernel to import (from the Hub), and the Hub's kernels interface downloads code, so
    fmha wraps those two functions instead, changing nothing for any other name: the
    manager keeps an fmha model on fmha, with no attention mask (as for flash: the packed
    layout comes as cu_seq_lens), and keeps the decode path that reads transformers'
    pages through a block table. Both are private to transformers and may move; without
    them this does nothing and generate_batch() raises transformers' own error.
    """
    try:
        from transformers.generation.continuous_batching import continuous_api, initialization
    except ImportError:
        return
    manager = getattr(continuous_api, "ContinuousBatchingManager", None)
    switch = getattr(manager, "switch_to_cb_friendly_attn", None)
    if switch is not None and not getattr(switch, "_fmha", False):
        def switch_to_cb_friendly_attn(self, model, *args, **kwargs):
            if model.config._attn_implementation in _NAMES:
                return None                  # fmha serves continuous batching itself
            return switch(self, model, *args, **kwargs)
        switch_to_cb_friendly_attn._fmha = True
        manager.switch_to_cb_friendly_attn = switch_to_cb_friendly_attn
    ensure = getattr(initialization, "ensure_decode_fast_path_is_available", None)
    if ensure is not None and not getattr(ensure, "_fmha", False):
        def ensure_decode_fast_path_is_available(config, cb_config, *args, **kwargs):
            wanted = cb_config.max_blocks_per_request
            ensure(config, cb_config, *args, **kwargs)
            if config._attn_implementation in _NAMES and wanted:
                allocators = initialization.ATTN_TYPE_TO_ALLOCATOR
                types = initialization.group_layers_by_attn_type(config)
                # fmha's paged kernel takes any page size, on the CPU and on CUDA.
                if all(allocators[t].supports_block_table for t in types):
                    cb_config.max_blocks_per_request = wanted
        ensure_decode_fast_path_is_available._fmha = True
        initialization.ensure_decode_fast_path_is_available = ensure_decode_fast_path_is_available


# ------------------------------------------------------------------ generate() on fmha pools


def _same_device(a, b) -> bool:
    """Whether two devices are one (``cuda`` without an index is the current CUDA device)."""
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.type == "cuda":
        a, b = (x.index if x.index is not None else torch.cuda.current_device() for x in (a, b))
        return a == b
    return a.index is None or b.index is None or a.index == b.index


class _PagedLayer(CacheLayerMixin):
    """One model layer's view of a :class:`PagedCache` (transformers asks layers for their
    lengths and kinds; the rows live in the shared fmha pool)."""

    is_compileable = False
    is_croppable = False

    def __init__(self, owner: "PagedCache", sliding_window: Optional[int]):
        super().__init__()
        self.owner = owner
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        raise RuntimeError("PagedCache: rows are appended by the fmha attention function; "
                           "call PagedCache.update (the model does)")

    def get_mask_sizes(self, query_length: int) -> Tuple[int, int]:
        return self.owner._seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner._seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.owner.reset()

    def reorder_cache(self, beam_idx) -> None:
        raise RuntimeError("PagedCache reorders all layers at once (PagedCache.reorder_cache)")


class PagedCache(Cache):
    """A transformers ``Cache`` whose rows live in an fmha :class:`~fmha.kvcache.PagedKVCache`.

    ``model.generate(..., cache=PagedCache(model.config, dtype=...))`` on a model
    with ``attn_implementation="fmha"``: each layer's new keys and values are appended in
    place into the pool and attended through :func:`fmha.kvcache.attention_with_kvcache`
    (causal, the layer's sliding window, softcap, sinks), with no concatenation.

    Args:
        config: the model's config (its text config is used).
        dtype: the pools' dtype: None (the model's, at the first step), the model's float
            dtype, or an 8-bit encoding (``torch.int8``, ``torch.float8_e4m3fn``,
            ``torch.float8_e5m2``) with dynamic scales (one per row and kv head, written as
            rows are appended; docs/guides/kvquant.md).
        block_size: rows per block (any size >= 1).
        max_cache_len: rows per sequence the pool is sized for (prompt, padding included,
            plus new tokens); ``num_blocks`` overrides the sizing.
        num_blocks: the pool's blocks (default: enough for every sequence of the first
            batch to reach ``max_cache_len``, plus one per sequence for copy-on-write).
        device: where the pools live (default: the first keys' device); one other than the
            model's is refused.

    Layout: every layer keeps all of its rows; a sliding-window layer reads only its window
    (the kernel skips the rest) but does not free the rows behind it. Left-padded batches
    (``generate`` with an attention mask) are stored without their padding: the first step
    reads the padding from the mask and writes each sequence from its first real token.
    Beam search reorders by forking sequences (blocks shared, copied on write); ``crop``
    (assisted decoding) is refused. ``bytes_allocated()`` is the pools' size.
    """

    def __init__(self, config, dtype=None, block_size: int = 16, max_cache_len: int = 4096,
                 num_blocks: Optional[int] = None, device=None):
        text = config.get_text_config(decoder=True)
        layer_types, layer_kwargs = get_layer_types_and_kwargs(text)
        for i, t in enumerate(layer_types):
            if t not in ("full_attention", "sliding_attention"):
                raise ValueError(f"config: layer {i} is {t!r}; PagedCache holds full and "
                                 "sliding-window attention layers only")
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype: expected a torch dtype or None, got {dtype!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size: expected an int >= 1, got {block_size!r}")
        if (isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int)
                or max_cache_len < 1):
            raise ValueError(f"max_cache_len: expected an int >= 1, got {max_cache_len!r}")
        if num_blocks is not None and (isinstance(num_blocks, bool)
                                       or not isinstance(num_blocks, int) or num_blocks < 1):
            raise ValueError(f"num_blocks: expected an int >= 1 or None, got {num_blocks!r}")
        layers = [_PagedLayer(self, kw.get("sliding_window")) for kw in layer_kwargs]
        super().__init__(layers=layers)
        self.config = text
        self.dtype = dtype
        self.block_size = block_size
        self.max_cache_len = max_cache_len
        self.num_blocks = num_blocks
        self.device = None if device is None else torch.device(device)
        self.heads_kv = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        self.pool: Optional[PagedKVCache] = None
        self.reset()

    # -------------------------------------------------------------- transformers' Cache API

    def update(self, key_states, value_states, layer_idx: int, *args, kwargs=None, **more):
        """Hands the layer's new rows to the fmha attention function (through the keyword
        arguments the model passes on to it), which appends them in place; returns them
        unchanged (the attention function ignores the K/V it is given on this path)."""
        impl = getattr(self.config, "_attn_implementation", None)
        if impl not in _NAMES:
            raise ValueError(f"attn_implementation: PagedCache needs the model on "
                             f"{sorted(_NAMES)}, got {impl!r}")
        if kwargs is None:
            raise RuntimeError("PagedCache: the model did not pass its attention kwargs to "
                               "Cache.update, so its attention cannot reach the cache")
        kwargs[_PAGED_KEY] = (self, layer_idx)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._seen

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> Tuple[int, int]:
        return self._seen + query_length, 0

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        return -1

    @property
    def is_initialized(self) -> bool:
        return self.pool is not None

    @property
    def batch_size(self) -> int:
        return -1 if self._ids is None else len(self._ids)

    def reset(self) -> None:
        """Forgets every sequence (the pool is kept for the next generation)."""
        if self.pool is not None and self._ids is not None:
            for seq in self._ids:
                self.pool.free(seq)
        self._ids: Optional[List[int]] = None
        self._seen = 0            # positions processed, padding included (the same for all)
        self._open = None         # rows each sequence takes in the step under way
        self._layers_done = 0

    def reorder_cache(self, beam_idx) -> None:
        """Beam search: sequence i continues sequence beam_idx[i] (forks share blocks)."""
        self._reselect([int(i) for i in beam_idx.tolist()], "beam_idx")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self._ids is not None:
            self._reselect([i for i in range(len(self._ids)) for _ in range(int(repeats))],
                           "repeats")

    def batch_select_indices(self, indices) -> None:
        if self._ids is not None:
            self._reselect([int(i) for i in torch.as_tensor(indices).tolist()], "indices")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("crop: PagedCache cannot drop rows (assisted and prompt-"
                                  "lookup decoding need it); use DynamicCache for those")

    def bytes_allocated(self) -> int:
        """Bytes of the K/V pools (and 8-bit scales), 0 before the first step."""
        if self.pool is None:
            return 0
        return self.pool.num_blocks * self.pool.block_size * self.pool.bytes_per_token()

    # -------------------------------------------------------------- the attention step

    def _reselect(self, rows: List[int], name: str) -> None:
        if self._ids is None:
            return
        if self._open is not None:
            raise RuntimeError(f"{name}: PagedCache cannot reorder in the middle of a step")
        n = len(self._ids)
        if any(r < 0 or r >= n for r in rows):
            raise ValueError(f"{name}: expected indices in [0, {n}), got {rows}")
        new = [self.pool.fork(self._ids[r]) for r in rows]
        for seq in self._ids:
            self.pool.free(seq)
        self._ids = new

    def _start(self, key: torch.Tensor, mask) -> None:
        """The first step: the pool, the sequences, and each one's left padding."""
        batch, heads_kv, seqlen, head_dim = key.shape
        model_dtype = key.dtype
        dtype = model_dtype if self.dtype is None else self.dtype
        if dtype.is_floating_point and dtype.itemsize > 1 and dtype != model_dtype:
            raise TypeError(f"dtype: a 16/32-bit PagedCache holds the model's dtype "
                            f"({model_dtype}), got {dtype}; 8-bit pools take torch.int8, "
                            "torch.float8_e4m3fn or torch.float8_e5m2")
        _refuse_dtype_the_device_lacks(key, "PagedCache")
        # The pools live on the model's device: a pool elsewhere would move every step's
        # rows (or fail in the kernel), so a device that differs is refused, naming it.
        device = (self.pool.device if self.pool is not None else
                  key.device if self.device is None else self.device)
        if not _same_device(device, key.device):
            raise ValueError(f"device: PagedCache's pools are on {device}, the model's keys on "
                             f"{key.device}; create the cache on the model's device "
                             "(device=None follows the model)")
        fmt = next((f for f in kvquant.FORMATS if getattr(torch, f) == dtype), None)
        caps = _BACKENDS[backend_of(device_of(key))]
        if fmt is not None and fmt not in caps["kv_cache_dtypes"]:
            raise NotImplementedError(f"dtype: {fmt} pools on {key.device}: fmha's "
                                      f"{caps['label']} kernels take "
                                      f"{', '.join(caps['kv_cache_dtypes'])}")
        check_head_dims(device_of(key), (("head_dim", head_dim),), kv8=fmt is not None)
        per_seq = -(-self.max_cache_len // self.block_size)
        if self.pool is None:
            self.pool = PagedKVCache(
                self.num_blocks or batch * (per_seq + 1), self.block_size, len(self.layers),
                heads_kv, head_dim, dtype=dtype, device=device, max_blocks_per_seq=per_seq + 1)
        self._ids = [self.pool.add_sequence() for _ in range(batch)]
        self._pads = [0] * batch
        if mask is not None:
            if mask.dtype != torch.bool:
                mask = mask == 0   # additive float masks: 0 where attending
            # A key no query may see is padding; padding must come first (left padding).
            # One copy to the host (on CUDA, one synchronisation) for the whole batch.
            seen = mask[..., :seqlen].reshape(batch, -1, seqlen).any(dim=1).tolist()
            for b in range(batch):
                row = seen[b]
                pads = row.index(True) if True in row else seqlen
                if not all(row[pads:]):
                    raise ValueError("attention_mask: PagedCache supports left padding only "
                                     f"(sequence {b} has masked positions after its first token)")
                self._pads[b] = pads

    def _attend(self, module, layer_idx, query, key, value, mask, scaling, softcap, kwargs):
        """The layer's step: reserve (first layer of a step), append + attend, commit (last
        layer). query (batch, heads_q, n, d), key/value the new rows (batch, heads_kv, n, d)."""
        _refuse_output_attentions(kwargs, "PagedCache")
        if kwargs.get("dropout", 0.0):
            raise ValueError("dropout: PagedCache serves inference only (model.eval())")
        batch, _, n, _ = query.shape
        if self._ids is None:
            self._start(key, mask)
        if len(self._ids) != batch:
            raise ValueError(f"PagedCache: holds {len(self._ids)} sequences, the step has "
                             f"{batch} (pass a fresh cache for a new batch)")
        first = self._seen == 0
        if self._open is None:
            rows = [n - p for p in self._pads] if first else [n] * batch
            if first:
                for seq, r in zip(self._ids, rows):
                    self.pool.reserve([seq], r)
            else:
                self.pool.reserve(self._ids, n)
            self._open = rows
        layer = self.layers[layer_idx]
        window = _window(kwargs.get("sliding_window", layer.sliding_window))
        opts = dict(causal=True, window=window, scale=scaling,
                    softcap=0.0 if softcap is None else softcap, sinks=_sinks_of(kwargs))
        q, k, v = (x.transpose(1, 2) for x in (query, key, value))
        if first and any(self._pads):
            out = q.new_zeros(q.shape[:3] + (v.shape[-1],))
            for b, (seq, p) in enumerate(zip(self._ids, self._pads)):
                if p < n:
                    out[b, p:] = self.pool.attention(layer_idx, q[b:b + 1, p:], k[b:b + 1, p:],
                                                     v[b:b + 1, p:], [seq], **opts)[0]
        else:
            out = self.pool.attention(layer_idx, q, k, v, self._ids, **opts)
        self._layers_done += 1
        if self._layers_done == len(self.layers):
            for seq, r in zip(self._ids, self._open):
                self.pool.commit([seq], r)
            self._seen += n
            self._open, self._layers_done = None, 0
        return out


register()
