"""A block manager for paged KV caches: :class:`PagedKVCache` (public in fmha.kvcache)."""

from __future__ import annotations

import sys
from collections import Counter
from typing import Dict, Iterable, List, Optional

import numpy as np

from . import kvquant
from ._kvcache import attention_with_kvcache


def _int_at_least(name: str, x, lo: int = 1) -> int:
    """x as an int, refused (naming the argument) unless it is an int >= lo."""
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(x).__name__}")
    if int(x) < lo:
        raise ValueError(f"{name}: expected an int >= {lo}, got {int(x)}")
    return int(x)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class PagedKVCache:
    """Per-layer K and V pools of fixed-size blocks shared by many sequences (PagedAttention).

    Each layer has a K pool ``(num_blocks, block_size, heads_kv, head_dim)`` and a V pool
    ``(..., head_dim_v)``, torch tensors when ``dtype`` is a torch dtype, NumPy arrays when it
    is a NumPy one. A sequence owns a list of blocks (the same block ids in every layer); row
    j of a sequence lives in row ``j % block_size`` of its block ``j // block_size``. Blocks
    are reference-counted: :meth:`fork` shares the parent's blocks, and a shared block that
    receives new rows is first copied (copy-on-write, all layers), so that forks never see
    each other's continuations.

    One step (prefill or decode) of a batch of sequences is::

        ids = [cache.add_sequence() for _ in range(batch)]
        cache.reserve(ids, n)                    # room for n new rows per sequence
        for layer in range(num_layers):          # q (batch, n, heads_q, head_dim), k/v new rows
            out = cache.attention(layer, q, k, v, ids, causal=True)
        cache.commit(ids, n)                     # the n rows now count as cached

    ``reserve`` is the only call that allocates; it either succeeds for every listed
    sequence or raises and changes nothing. ``attention`` writes the new rows into the
    reserved space and attends to them (``fmha.kvcache.attention_with_kvcache``); the
    lengths only move at ``commit``, after the last layer. Fork and free between steps.

    ``kind`` is "torch" or "numpy"; ``dtype``, ``num_blocks``, ``block_size``, ``num_layers``,
    ``heads_kv``, ``head_dim``, ``head_dim_v`` and ``max_blocks_per_seq`` are as given
    (max_blocks_per_seq defaults to num_blocks). ``device`` (torch dtypes only; default the
    CPU) is where the pools live: on a CUDA device the kernels are the CUDA ones, and the
    block tables and lengths are copied there at each step (host to device, no sync back).

    8-bit pools (fmha.kvquant; docs/semantics.md, "8-bit KV caches"): ``dtype`` torch.int8,
    torch.float8_e4m3fn or torch.float8_e5m2, or for NumPy pools np.int8 or the name
    "float8_e4m3fn" / "float8_e5m2" (uint8 bytes). New rows come in q's dtype and are
    quantised as they are written. Scales: ``k_scale`` and ``v_scale`` of shape
    (num_layers, heads_kv) (static, e.g. ``fmha.kvquant.calibrate_scales`` per layer), or
    neither: dynamic scales, one per (row, kv head), kept in scale pools
    (:meth:`k_scale_pool`) that follow the blocks, copy-on-write included. ``format`` is
    the encoding's name (None for pools in a float dtype).
    """

    def __init__(self, num_blocks: int, block_size: int, num_layers: int, heads_kv: int,
                 head_dim: int, head_dim_v: Optional[int] = None, *, dtype=np.float32,
                 max_blocks_per_seq: Optional[int] = None, device=None, k_scale=None,
                 v_scale=None):
        self.num_blocks = _int_at_least("num_blocks", num_blocks)
        self.block_size = _int_at_least("block_size", block_size)
        self.num_layers = _int_at_least("num_layers", num_layers)
        self.heads_kv = _int_at_least("heads_kv", heads_kv)
        self.head_dim = _int_at_least("head_dim", head_dim)
        self.head_dim_v = self.head_dim if head_dim_v is None else _int_at_least(
            "head_dim_v", head_dim_v)
        self.max_blocks_per_seq = (self.num_blocks if max_blocks_per_seq is None else
                                   _int_at_least("max_blocks_per_seq", max_blocks_per_seq))
        k_shape = (self.num_blocks, self.block_size, self.heads_kv, self.head_dim)
        v_shape = k_shape[:3] + (self.head_dim_v,)
        # A torch dtype can only exist once torch is imported: NumPy users never import it.
        torch = sys.modules.get("torch")
        self.format = None  # the 8-bit encoding of the pools, if any
        if torch is not None and isinstance(dtype, torch.dtype):
            self.format = next((f for f in kvquant.FORMATS if getattr(torch, f) == dtype),
                               None)
            if not dtype.is_floating_point and self.format is None:
                raise TypeError(f"dtype: expected a floating-point dtype or an 8-bit cache "
                                f"dtype ({', '.join(kvquant.FORMATS)}), got {dtype}")
            self.kind = "torch"
            self.dtype = dtype
            self.device = torch.device("cpu" if device is None else device)
            self.itemsize = torch.empty((), dtype=dtype).element_size()
            zeros = lambda shape, dt=dtype: torch.zeros(shape, dtype=dt,  # noqa: E731
                                                        device=self.device)
        else:
            if device not in (None, "cpu"):
                raise ValueError(f"device: {device!r}; NumPy pools live on the CPU (pass a "
                                 "torch dtype for pools on another device)")
            self.device = "cpu"
            if isinstance(dtype, str) and dtype in kvquant.FORMATS:
                self.format = dtype
                np_dtype = np.dtype(np.int8 if dtype == "int8" else np.uint8)
            else:
                try:
                    np_dtype = np.dtype(dtype)
                except TypeError:
                    raise TypeError(f"dtype: expected a torch or NumPy floating-point dtype, "
                                    f"got {dtype!r}") from None
                if np_dtype == np.int8:
                    self.format = "int8"
                elif np_dtype.kind != "f":
                    raise TypeError(f"dtype: expected a floating-point dtype, np.int8 or the "
                                    f"name of a float8 encoding, got {np_dtype}")
            self.kind = "numpy"
            self.dtype = dtype if self.format and self.format != "int8" else np_dtype
            self.itemsize = np_dtype.itemsize
            zeros = lambda shape, dt=np_dtype: np.zeros(shape, dtype=dt)  # noqa: E731
        self._k = [zeros(k_shape) for _ in range(self.num_layers)]
        self._v = [zeros(v_shape) for _ in range(self.num_layers)]
        # 8-bit pools: static scales (num_layers, heads_kv), or dynamic ones in pools shaped
        # like the K pool without head_dim (None without 8-bit pools).
        self._k_scale = self._v_scale = None
        self.dynamic_scales = False
        if self.format is None:
            if k_scale is not None or v_scale is not None:
                raise ValueError("k_scale, v_scale: only with an 8-bit dtype "
                                 f"({', '.join(kvquant.FORMATS)}); dtype is {self.dtype}")
        elif (k_scale is None) != (v_scale is None):
            raise ValueError("k_scale, v_scale: give both (static scales) or neither "
                             "(dynamic, per row)")
        elif k_scale is None:
            self.dynamic_scales = True
            f32 = torch.float32 if self.kind == "torch" else np.float32
            self._k_scale = [zeros(k_shape[:3], f32) for _ in range(self.num_layers)]
            self._v_scale = [zeros(k_shape[:3], f32) for _ in range(self.num_layers)]
        else:
            self._k_scale = self._static_scales("k_scale", k_scale)
            self._v_scale = self._static_scales("v_scale", v_scale)
        self._refs = [0] * self.num_blocks
        self._free: List[int] = list(range(self.num_blocks - 1, -1, -1))  # pop() gives 0 first
        self._blocks: Dict[int, List[int]] = {}
        self._length: Dict[int, int] = {}
        self._next_id = 0
        self._version = 0        # bumped by every change of blocks or lengths
        self._inputs = None      # (key, cache_seqlens, block_table) of the last attention

    def __repr__(self) -> str:
        scales = ("" if self.format is None else
                  ", dynamic scales" if self.dynamic_scales else ", static scales")
        return (f"PagedKVCache({self.num_blocks} blocks of {self.block_size} rows, "
                f"{self.num_layers} layers, heads_kv={self.heads_kv}, head_dim={self.head_dim},"
                f" head_dim_v={self.head_dim_v}, dtype={self.dtype}{scales}, "
                f"{len(self._blocks)} sequences, {self.num_free_blocks} blocks free)")

    # ---------------------------------------------------------------- pools and accounting

    def k_pool(self, layer: int):
        """Layer ``layer``'s K pool, (num_blocks, block_size, heads_kv, head_dim)."""
        return self._k[self._layer(layer)]

    def v_pool(self, layer: int):
        """Layer ``layer``'s V pool, (num_blocks, block_size, heads_kv, head_dim_v)."""
        return self._v[self._layer(layer)]

    def k_scale(self, layer: int):
        """Layer ``layer``'s K scales (8-bit pools): (heads_kv,) static ones, or the dynamic
        scale pool (num_blocks, block_size, heads_kv); None for float pools."""
        return None if self._k_scale is None else self._k_scale[self._layer(layer)]

    def v_scale(self, layer: int):
        """Layer ``layer``'s V scales, as :meth:`k_scale`."""
        return None if self._v_scale is None else self._v_scale[self._layer(layer)]

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def bytes_per_token(self) -> int:
        """Bytes of K and V one row takes across all layers (dynamic scales included)."""
        per_head = (self.head_dim + self.head_dim_v) * self.itemsize
        if self.dynamic_scales:
            per_head += 2 * 4  # a float32 K and V scale per (row, kv head)
        return self.num_layers * self.heads_kv * per_head

    def bytes_used(self) -> int:
        """Bytes of the blocks held by sequences (a block shared by forks counts once)."""
        return (self.num_blocks - self.num_free_blocks) * self.block_size * self.bytes_per_token()

    def bytes_free(self) -> int:
        """Bytes of the free blocks."""
        return self.num_free_blocks * self.block_size * self.bytes_per_token()

    # ---------------------------------------------------------------- sequences

    def add_sequence(self) -> int:
        """A new empty sequence's id (it holds no block until :meth:`reserve`)."""
        seq = self._next_id
        self._next_id += 1
        self._blocks[seq] = []
        self._length[seq] = 0
        return seq

    def length(self, seq_id: int) -> int:
        """Rows committed for the sequence."""
        return self._length[self._seq("seq_id", seq_id)]

    def blocks(self, seq_id: int) -> List[int]:
        """The sequence's block ids, in row order (a copy)."""
        return list(self._blocks[self._seq("seq_id", seq_id)])

    def fork(self, seq_id: int) -> int:
        """A new sequence sharing the parent's committed rows (no copy until one appends)."""
        parent = self._seq("seq_id", seq_id)
        n = self._length[parent]
        # Only the blocks holding committed rows are shared; reserved ones stay the parent's.
        shared = self._blocks[parent][:_ceil_div(n, self.block_size)]
        for block in shared:
            self._refs[block] += 1
        self._version += 1
        child = self.add_sequence()
        self._blocks[child] = list(shared)
        self._length[child] = n
        return child

    def free(self, seq_id: int) -> None:
        """Forgets the sequence; its blocks no other sequence holds return to the pool."""
        seq = self._seq("seq_id", seq_id)
        for block in reversed(self._blocks.pop(seq)):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free.append(block)
        del self._length[seq]
        self._version += 1

    # ---------------------------------------------------------------- one step

    def reserve(self, seq_ids: Iterable[int], n: int) -> None:
        """Makes room for ``n`` new rows after the committed ones of every listed sequence:
        allocates blocks, and copies a shared block that the rows would land in. Raises
        ValueError past max_blocks_per_seq and RuntimeError when the pool is short of blocks,
        changing nothing in either case. Reserving again before :meth:`commit` only adds
        what is missing."""
        ids = self._seq_list(seq_ids)
        n = _int_at_least("n", n, 0)
        # Plan first (how many fresh blocks, checked against the limits), then apply.
        plan = []                                  # (seq, block indices to copy, blocks to add)
        released = Counter()                       # references the planned copies drop
        fresh = 0
        for seq in ids:
            blocks, length = self._blocks[seq], self._length[seq]
            need = _ceil_div(length + n, self.block_size)
            if need > self.max_blocks_per_seq:
                raise ValueError(
                    f"n: sequence {seq} would need {need} blocks for {length} + {n} rows, "
                    f"more than max_blocks_per_seq={self.max_blocks_per_seq}")
            # The blocks the n rows land in that exist already: copy those still shared.
            first = length // self.block_size
            copies = []
            for i in range(first, min(need, len(blocks)) if n else first):
                block = blocks[i]
                if self._refs[block] - released[block] > 1:
                    copies.append(i)
                    released[block] += 1
            add = max(0, need - len(blocks))
            fresh += len(copies) + add
            plan.append((seq, copies, add))
        if fresh > self.num_free_blocks:
            raise RuntimeError(
                f"reserve: out of KV-cache blocks: {n} rows for {len(ids)} sequences need "
                f"{fresh} new blocks, {self.num_free_blocks} of {self.num_blocks} are free")
        for seq, copies, add in plan:
            blocks = self._blocks[seq]
            copied = (self._k, self._v) + ((self._k_scale, self._v_scale)
                                            if self.dynamic_scales else ())
            for i in copies:
                old, new = blocks[i], self._allocate()
                for pools in copied:
                    for pool in pools:
                        pool[new] = pool[old]
                self._refs[old] -= 1
                blocks[i] = new
            blocks.extend(self._allocate() for _ in range(add))
        self._version += 1

    def attention(self, layer: int, q, k, v, seq_ids: Iterable[int], *, causal: bool = True,
                  **kwargs):
        """``attention_with_kvcache`` over layer ``layer``'s pools for the listed sequences (in
        q's batch order): writes k, v (batch, n, heads_kv, head_dim[_v]) after each
        sequence's committed rows, which :meth:`reserve` (..., n) must have made room for,
        and returns what it returns (``kwargs``: scale, window, softcap, alibi_slopes,
        return_lse, num_splits)."""

        layer = self._layer(layer)
        ids = self._seq_list(seq_ids)
        if len(q.shape) != 4 or q.shape[0] != len(ids):
            raise ValueError(f"q: expected shape ({len(ids)}, seqlen_q, heads_q, head_dim) for "
                             f"{len(ids)} sequences, got {tuple(q.shape)}")
        n = 0 if k is None or len(k.shape) != 4 else int(k.shape[1])
        lengths, table = self._step_inputs(ids, n)
        if self.format is not None:
            given = sorted({"k_scale", "v_scale", "cache_dtype"} & set(kwargs))
            if given:
                raise TypeError(f"{', '.join(given)}: the cache passes its own scales and "
                                f"encoding; set static scales when constructing it")
            kwargs.update(k_scale=self._k_scale[layer], v_scale=self._v_scale[layer])
            if self.kind == "numpy" and self.format != "int8":
                kwargs["cache_dtype"] = self.format
        return attention_with_kvcache(q, self._k[layer], self._v[layer], k, v,
                                      cache_seqlens=lengths, block_table=table, causal=causal,
                                      **kwargs)

    def commit(self, seq_ids: Iterable[int], n: int) -> None:
        """Counts the ``n`` rows that :meth:`attention` wrote (in every layer) as cached."""
        ids = self._seq_list(seq_ids)
        n = _int_at_least("n", n, 0)
        for seq in ids:
            if self._length[seq] + n > len(self._blocks[seq]) * self.block_size:
                raise RuntimeError(f"seq_ids: sequence {seq} has no room reserved for {n} new "
                                   f"rows; call reserve(seq_ids, {n}) before attention")
        for seq in ids:
            self._length[seq] += n
        self._version += 1

    # ---------------------------------------------------------------- helpers

    def _allocate(self) -> int:
        block = self._free.pop()
        self._refs[block] = 1
        return block

    def _step_inputs(self, ids: List[int], n: int):
        """cache_seqlens and block_table of the sequences for n new rows, checked; kept for
        the next call (the next layer) until the state changes."""
        key = (tuple(ids), n, self._version)
        if self._inputs is not None and self._inputs[0] == key:
            return self._inputs[1:]
        for seq in ids:
            # The rows written must lie in blocks this sequence holds alone: a shared block
            # would leak them into its forks (the kernel only sees this call's sequences).
            blocks, length = self._blocks[seq], self._length[seq]
            first, stop = length // self.block_size, _ceil_div(length + n, self.block_size)
            if stop > len(blocks) or any(self._refs[blocks[i]] > 1
                                         for i in range(first, stop if n else first)):
                raise RuntimeError(f"seq_ids: sequence {seq} has no room reserved for {n} new "
                                   f"rows; call reserve(seq_ids, {n}) first")
        width = max(1, max((len(self._blocks[s]) for s in ids), default=1))
        # Unused slots hold block 0: the kernel reads only the slots a sequence's rows use.
        table = np.zeros((len(ids), width), dtype=np.int32)
        for row, seq in enumerate(ids):
            table[row, :len(self._blocks[seq])] = self._blocks[seq]
        lengths = np.array([self._length[s] for s in ids], dtype=np.int32)
        if self.kind == "torch":
            import torch
            table, lengths = (torch.from_numpy(x).to(self.device) for x in (table, lengths))
        self._inputs = (key, lengths, table)
        return lengths, table

    def _static_scales(self, name, x):
        """Static scales given for every layer: (num_layers, heads_kv) positive and finite,
        as one float32 array or tensor per layer (on the pools' device)."""
        a = np.asarray(x.detach().cpu().double() if hasattr(x, "detach") else x, np.float64)
        if a.shape != (self.num_layers, self.heads_kv):
            raise ValueError(f"{name}: expected shape ({self.num_layers}, {self.heads_kv}) "
                             f"(num_layers, heads_kv), got {a.shape}")
        if not (np.isfinite(a).all() and (a > 0).all()):
            raise ValueError(f"{name}: expected positive finite scales")
        a = a.astype(np.float32)
        if self.kind == "torch":
            import torch
            return [torch.from_numpy(row.copy()).to(self.device) for row in a]
        return [row.copy() for row in a]

    def _layer(self, layer) -> int:
        layer = _int_at_least("layer", layer, 0)
        if layer >= self.num_layers:
            raise ValueError(f"layer: expected < num_layers={self.num_layers}, got {layer}")
        return layer

    def _seq(self, name: str, seq_id) -> int:
        if isinstance(seq_id, bool) or not isinstance(seq_id, (int, np.integer)):
            raise TypeError(f"{name}: expected a sequence id (int), got {type(seq_id).__name__}")
        if int(seq_id) not in self._blocks:
            raise ValueError(f"{name}: unknown sequence {int(seq_id)}")
        return int(seq_id)

    def _seq_list(self, seq_ids) -> List[int]:
        if isinstance(seq_ids, (int, np.integer)):
            raise TypeError("seq_ids: expected a list of sequence ids, got an int")
        ids = [self._seq("seq_ids", s) for s in seq_ids]
        if len(set(ids)) != len(ids):
            dup = next(s for s in ids if ids.count(s) > 1)
            raise ValueError(f"seq_ids: sequence {dup} is listed twice")
        return ids
