"""Attention split over processes, on torch.distributed (Gloo on CPU, NCCL on GPU).

Three ways to cut one attention into pieces, each exact (the same result as one process
computing the whole, up to float32 rounding), forward and backward:

- :func:`ring_attention` cuts the **sequence**. Each rank keeps its queries; key/value blocks
  travel around a ring of ranks (``batch_isend_irecv``), each step's transfer overlapped with
  the attention over the block that arrived before it. The partial results are merged by their
  lse (:func:`fmha.merge_states`); the backward sends dK/dV back round the ring to their owners.
  Causal attention over the ``"zigzag"`` layout gives every rank the same work.
- :func:`ulysses_attention` (DeepSpeed-Ulysses) cuts the sequence too, but turns it into a cut
  of the **heads** with an all-to-all, runs whole-sequence attention on its heads, and turns
  the result back with a second all-to-all.
- :class:`TensorParallelMultiheadAttention` (Megatron) cuts the **heads** of a multi-head
  attention layer: each rank owns its heads' slice of the q/k/v projections (column-parallel)
  and of the output projection (row-parallel), and the output is all-reduced.

Each block is one fmha call told where it sits in the whole attention (q_position,
k_position, head_position, heads_total: csrc/fmha/params.h), so causal, window and ALiBi
see the whole sequence's positions and dropout draws the whole attention's mask: with every
rank seeded alike (``torch.manual_seed``), the mask is the one a single process would draw.

Sequence layouts (:func:`shard_sequence`, :func:`gather_sequence`): ``"contiguous"`` gives
rank r rows [r·n, (r+1)·n) of a sequence of P·n rows; ``"zigzag"`` cuts it into 2P chunks and
gives rank r chunks r and 2P-1-r, so under a causal mask every rank has as many visible keys
as every other. Tensors are (batch, seqlen, heads, head_dim) as in :func:`fmha.attention`.

Only the communication goes through torch.distributed; nothing here is a transport of its own.
See docs/semantics.md, "Distributed attention", and docs/cpu_kernels.md for the cost model.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from . import _torch
from .merge import merge_states

__all__ = ["ring_attention", "ulysses_attention", "shard_sequence", "gather_sequence",
           "TensorParallelMultiheadAttention"]

_LAYOUTS = ("zigzag", "contiguous")


# ---------------------------------------------------------------------------- the groups

def _world(group) -> Tuple[int, int]:
    """(rank in group, group size)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("fmha.distributed: torch.distributed is not initialised; call "
                           "torch.distributed.init_process_group first")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the process group")
    return rank, dist.get_world_size(group)


def _global_rank(group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _check_layout(layout: str) -> None:
    if layout not in _LAYOUTS:
        raise ValueError(f"layout: expected 'zigzag' or 'contiguous', got {layout!r}")


def _pieces(rank: int, world: int, n_local: int, layout: str) -> List[Tuple[int, int, int]]:
    """A rank's shard as (first local row, rows, first position in the whole sequence)."""
    if layout == "contiguous":
        return [(0, n_local, rank * n_local)]
    c = n_local // 2
    return [(0, c, rank * c), (c, c, (2 * world - 1 - rank) * c)]


def _chunk_order(world: int, layout: str) -> List[int]:
    """The whole sequence's chunks in the order the ranks hold them (rank 0's first)."""
    if layout == "contiguous":
        return list(range(world))
    order = []
    for r in range(world):
        order += [r, 2 * world - 1 - r]
    return order


def shard_sequence(x: Tensor, group=None, *, layout: str = "zigzag", dim: int = 1) -> Tensor:
    """This rank's shard of a whole sequence ``x`` (every rank passes the same ``x``): a view
    for ``"contiguous"``, a copy of its two chunks for ``"zigzag"``."""
    _check_layout(layout)
    rank, world = _world(group)
    chunks = 2 * world if layout == "zigzag" else world
    if x.shape[dim] % chunks:
        raise ValueError(f"x: its length along dim {dim} ({x.shape[dim]}) must divide into "
                         f"{chunks} equal chunks for the {layout!r} layout over {world} ranks")
    parts = x.chunk(chunks, dim)
    if layout == "contiguous":
        return parts[rank]
    return torch.cat([parts[rank], parts[2 * world - 1 - rank]], dim)


def gather_sequence(x: Tensor, group=None, *, layout: str = "zigzag", dim: int = 1) -> Tensor:
    """The whole sequence from every rank's shard (an all-gather; the inverse of
    :func:`shard_sequence`). Not differentiable."""
    _check_layout(layout)
    rank, world = _world(group)
    x = x.contiguous()
    shards = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(shards, x, group=group)
    if layout == "contiguous":
        return torch.cat(shards, dim)
    chunks = [None] * (2 * world)
    for r, s in enumerate(shards):
        chunks[r], chunks[2 * world - 1 - r] = s.chunk(2, dim)
    return torch.cat(chunks, dim)


# ---------------------------------------------------------------------------- arguments

def _window(causal: bool, window) -> Tuple[int, int]:
    try:
        left, right = (int(w) for w in window)
    except (TypeError, ValueError):
        raise TypeError(f"window: expected (left, right) with -1 = unbounded, got {window!r}")
    if left < -1 or right < -1:
        raise ValueError(f"window: expected sides >= -1 (-1 = unbounded), got {window!r}")
    if causal:
        right = 0 if right < 0 else min(right, 0)
    return left, right


def _check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor) or x.dim() != 4:
            raise ValueError(f"{name}: expected a 4-D tensor (batch, seqlen, heads, head_dim), "
                             f"got {getattr(x, 'shape', type(x).__name__)}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k, v: shapes {tuple(k.shape)} and {tuple(v.shape)} differ before "
                         f"head_dim")
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1]:
        raise ValueError(f"q, k: this rank's shards must have one batch and one length (the "
                         f"same positions of one sequence), got {tuple(q.shape)} and "
                         f"{tuple(k.shape)}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"q, k: heads_q ({q.shape[2]}) must be a multiple of heads_kv "
                         f"({k.shape[2]})")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError("q, k, v: expected one dtype and one device, got "
                         f"{q.dtype}/{q.device}, {k.dtype}/{k.device}, {v.dtype}/{v.device}")


def _check_same_everywhere(group, fields: Sequence[str], values: Sequence[float],
                           device) -> None:
    """Raises on every rank, naming the ranks and fields that differ, unless every rank
    passed the same values (one small all-gather)."""
    rank, world = _world(group)
    mine = torch.tensor([float(x) for x in values], dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    every = [tuple(t.tolist()) for t in every]
    differ = [i for i, f in enumerate(fields) if len({e[i] for e in every}) > 1]
    if differ:
        listing = "; ".join(f"{fields[i]}: " + ", ".join(f"rank {r} {e[i]:g}"
                                                         for r, e in enumerate(every))
                            for i in differ)
        raise ValueError(f"shards or settings differ between ranks ({listing}); every rank "
                         f"must pass the same")


_CHECKED = ("batch", "seqlen", "heads_q", "head_dim", "heads_kv", "k head_dim",
            "v head_dim", "causal", "window left", "window right", "zigzag", "dropout_p",
            "scale", "softcap", "alibi_slopes given", "deterministic")


def _settings_everywhere(group, q, k, v, causal, left, right, layout, dropout_p, scale,
                         softcap, alibi_slopes, deterministic) -> None:
    _check_same_everywhere(
        group, _CHECKED,
        list(q.shape) + [k.shape[2], k.shape[3], v.shape[3], causal, left, right,
                         layout == "zigzag", dropout_p, -1.0 if scale is None else scale,
                         softcap, alibi_slopes is not None, deterministic],
        _comm_device(group, q))


def _prepared(q, k, v, group, causal, window, layout, dropout_p, scale, softcap, alibi_slopes,
              deterministic, check) -> Tuple[int, int, float]:
    """The checks ring_attention and ulysses_attention share; returns the window's sides and
    the scale."""
    _world(group)
    left, right = _window(causal, window)
    n = q.shape[1]
    if layout == "zigzag" and n % 2:
        raise ValueError(f"q: the zigzag layout holds two equal chunks per rank, so the shard "
                         f"length must be even, got {n}")
    if check:
        _settings_everywhere(group, q, k, v, causal, left, right, layout, dropout_p, scale,
                             softcap, alibi_slopes, deterministic)
    return left, right, 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


def _comm_device(group, x: Tensor):
    """Where the small check tensors live: the GPU for NCCL, the CPU otherwise."""
    backend = dist.get_backend(group)
    return x.device if backend == "nccl" else torch.device("cpu")


def _slopes(alibi_slopes, q: Tensor, heads: Optional[slice]) -> Optional[Tensor]:
    """ALiBi slopes as the kernels read them (float64, (heads,) or (batch, heads)): all of
    them, or the heads this rank computes."""
    if alibi_slopes is None:
        return None
    s = torch.as_tensor(alibi_slopes, dtype=torch.float64, device=q.device)
    if s.dim() not in (1, 2) or s.shape[-1] != q.shape[2] or (s.dim() == 2 and
                                                              s.shape[0] != q.shape[0]):
        raise ValueError(f"alibi_slopes: expected (heads_q,) or (batch, heads_q) = "
                         f"({q.shape[0]}, {q.shape[2]}), got {tuple(s.shape)}")
    return (s if heads is None else s[..., heads]).contiguous()


# ---------------------------------------------------------------------------- ring attention

def _visible(q0: int, nq: int, k0: int, nk: int, left: int, right: int) -> Tuple[bool, bool]:
    """(does any query of positions [q0, q0+nq) see a key of [k0, k0+nk), does every one see
    every one) under the window (left, right)."""
    some = ((right < 0 or k0 <= q0 + nq - 1 + right) and
            (left < 0 or k0 + nk - 1 >= q0 - left))
    every = ((right < 0 or k0 + nk - 1 <= q0 + right) and
             (left < 0 or k0 >= q0 + nq - 1 - left))
    return some, every


class _Ring:
    """The settings of one ring_attention call, and its blocks."""

    def __init__(self, group, layout, n_local, scale, softcap, left, right, alibi, dropout_p,
                 rng, deterministic):
        self.group, self.layout = group, layout
        self.rank, self.world = _world(group)
        self.n_local = n_local
        self.scale, self.softcap, self.left, self.right = scale, softcap, left, right
        self.alibi, self.dropout_p, self.rng = alibi, dropout_p, rng
        self.deterministic = deterministic
        self.next = _global_rank(group, (self.rank + 1) % self.world)
        self.prev = _global_rank(group, (self.rank - 1) % self.world)

    def blocks(self, src: int):
        """The (query piece, key piece, window) pairs of this rank's queries against rank
        src's keys that have a visible key; the window is unbounded where every key is."""
        mine = _pieces(self.rank, self.world, self.n_local, self.layout)
        theirs = _pieces(src, self.world, self.n_local, self.layout)
        for qp in mine:
            for kp in theirs:
                some, every = _visible(qp[2], qp[1], kp[2], kp[1], self.left, self.right)
                if some:
                    yield qp, kp, ((-1, -1) if every else (self.left, self.right))

    def exchange(self, tensors: Sequence[Tensor]):
        """Sends the tensors to the next rank and receives the previous rank's into new
        buffers; returns (requests, buffers)."""
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in received]
        return dist.batch_isend_irecv(ops), received

    def forward_block(self, q, k, v, qp, kp, window):
        rows, cols = slice(qp[0], qp[0] + qp[1]), slice(kp[0], kp[0] + kp[1])
        return _torch._fwd(q[:, rows], k[:, cols], v[:, cols], None, None, self.alibi, None,
                           None, 0, 0, self.rng, self.scale, self.softcap, window[0], window[1],
                           False, self.dropout_p, False, 0, qp[2], kp[2], 0, 0)

    def backward_block(self, dout, q, k, v, out, lse, dlse, qp, kp, window):
        rows, cols = slice(qp[0], qp[0] + qp[1]), slice(kp[0], kp[0] + kp[1])
        lse_rows = lse[:, :, rows]
        # The op's body, as forward_block runs _fwd's; the op itself where a graph is being
        # recorded (create_graph=True), so that differentiating further fails loudly (the
        # op has no formula) instead of returning gradients that do not require grad.
        run = _torch.bwd if torch.is_grad_enabled() else _torch._bwd
        return run(dout[:, rows], q[:, rows], k[:, cols], v[:, cols], out[:, rows],
                   lse_rows, None, None, self.alibi, None, None, 0, 0, self.rng,
                   self.scale, self.softcap, window[0], window[1], False,
                   self.dropout_p, False, self.deterministic,
                   None if dlse is None else dlse[:, :, rows], qp[2], kp[2], 0, 0)[:3]


def _wait(requests) -> None:
    for r in requests:
        r.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring):
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        pieces = _pieces(ring.rank, ring.world, ring.n_local, ring.layout)
        state = {qp: None for qp in pieces}  # (out, lse) over the keys seen so far
        cur = [k.contiguous(), v.contiguous()]
        for step in range(ring.world):
            pending = ring.exchange(cur) if step < ring.world - 1 else None
            for qp, kp, window in ring.blocks((ring.rank - step) % ring.world):
                o, l = ring.forward_block(q, cur[0], cur[1], qp, kp, window)
                o = o.to(acc)
                state[qp] = (o, l) if state[qp] is None else merge_states(*state[qp], o, l)
            if pending is not None:
                _wait(pending[0])
                cur = pending[1]
        b, _, h, _ = q.shape
        out = q.new_zeros(q.shape[:3] + (v.shape[-1],))
        lse = torch.full((b, h, ring.n_local), -math.inf, dtype=acc, device=q.device)
        for (first, rows, _), s in state.items():
            if s is not None:  # a piece whose every row sees no key keeps 0 and -inf
                out[:, first:first + rows] = s[0].to(q.dtype)
                lse[:, :, first:first + rows] = s[1]
        ctx.ring = ring
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        ring = ctx.ring
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        cur = [k.contiguous(), v.contiguous()]
        # (requests, [dK, dV]) of the keys held at the last step, summed over the ranks they
        # visited, on their way to the next rank
        dkv_pending = None
        for step in range(ring.world):
            pending = ring.exchange(cur) if step < ring.world - 1 else None
            here = [torch.zeros(k.shape, dtype=acc, device=k.device),
                    torch.zeros(v.shape, dtype=acc, device=v.device)]
            for qp, kp, window in ring.blocks((ring.rank - step) % ring.world):
                dq_b, dk_b, dv_b = ring.backward_block(dout, q, cur[0], cur[1], out, lse, dlse,
                                                       qp, kp, window)
                dq[:, qp[0]:qp[0] + qp[1]] += dq_b
                here[0][:, kp[0]:kp[0] + kp[1]] += dk_b
                here[1][:, kp[0]:kp[0] + kp[1]] += dv_b
            if dkv_pending is not None:  # the previous rank's sums for these keys
                _wait(dkv_pending[0])
                here = [a + b for a, b in zip(here, dkv_pending[1])]
            # Pass the sums on to the rank that holds these keys next; after the last step
            # that is their owner (with one rank: this one, nothing to send).
            dkv_pending = ring.exchange(here) if ring.world > 1 else ([], here)
            if pending is not None:
                _wait(pending[0])
                cur = pending[1]
        _wait(dkv_pending[0])
        dk, dv = dkv_pending[1]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, group=None, *, causal: bool = False,
                   layout: str = "zigzag", window=(-1, -1), scale: Optional[float] = None,
                   softcap: float = 0.0, alibi_slopes=None, dropout_p: float = 0.0,
                   return_lse: bool = False, deterministic: bool = False,
                   check: bool = True):
    """Self-attention over a sequence split across the ranks of ``group``, by Ring Attention.

    q: (batch, n, heads_q, head_dim), k and v: (batch, n, heads_kv, head_dim[_v]) — this
    rank's shard of the sequence in ``layout`` (see :func:`shard_sequence`); heads_kv may
    divide heads_q (GQA: only heads_kv heads travel). Returns this rank's rows of the output
    (and lse, (batch, heads_q, n), float32 or float64 for float64 inputs, when
    ``return_lse``), exactly what
    :func:`fmha.attention` over the whole sequence gives for those rows. ``causal``,
    ``window``, ``scale``, ``softcap``, ``alibi_slopes`` and ``dropout_p`` are fmha.attention's,
    over the whole sequence's positions; dropout needs every rank seeded alike and, so that
    each block starts on a Philox group, a chunk length (n, or n/2 for zigzag) that is a
    multiple of 4. Differentiable in q, k, v (and through lse).

    ``check``: first compare the shards' shapes and the settings (not the slopes' values)
    across the ranks (one small all-gather), so that a mismatch is an error on every rank
    instead of a hang or a wrong result.
    """
    _check_layout(layout)
    _check_qkv(q, k, v)
    left, right, scale = _prepared(q, k, v, group, causal, window, layout, dropout_p, scale,
                                   softcap, alibi_slopes, deterministic, check)
    n = q.shape[1]
    chunk = n // 2 if layout == "zigzag" else n
    if dropout_p and chunk % 4:  # the same on every rank (checked above)
        raise ValueError(f"dropout_p: ring attention with dropout needs a chunk length that is "
                         f"a multiple of 4 (each block starts on a group of four keys of the "
                         f"dropout mask), got {chunk}")
    rng = None
    if dropout_p > 0:  # as fmha.attention draws it: the same on ranks seeded alike
        rng = torch.randint(0, 2**62, (2,), dtype=torch.int64)
    ring = _Ring(group, layout, n, float(scale), float(softcap), left, right,
                 _slopes(alibi_slopes, q, None), float(dropout_p), rng, bool(deterministic))
    out, lse = _RingAttention.apply(q, k, v, ring)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------- Ulysses

class _AllToAll(torch.autograd.Function):
    """Scatters dim ``scatter`` over the ranks and gathers dim ``gather`` from them; the
    backward is the all-to-all the other way."""

    @staticmethod
    def forward(ctx, x, group, scatter: int, gather: int):
        ctx.group, ctx.scatter, ctx.gather = group, scatter, gather
        return _all_to_all(x, group, scatter, gather)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group, ctx.gather, ctx.scatter), None, None, None


def _all_to_all(x: Tensor, group, scatter: int, gather: int) -> Tensor:
    _, world = _world(group)
    send = torch.stack(x.chunk(world, scatter)).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), gather)


def _sequence_order(world: int, layout: str, device) -> Optional[Tuple[Tensor, Tensor]]:
    """For zigzag: (positions of the gathered rows in sequence order, and back), else None."""
    if layout == "contiguous":
        return None
    order = torch.tensor(_chunk_order(world, layout), device=device)
    return torch.argsort(order), order


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, group=None, *, causal: bool = False,
                      layout: str = "contiguous", window=(-1, -1),
                      scale: Optional[float] = None, softcap: float = 0.0, alibi_slopes=None,
                      dropout_p: float = 0.0, return_lse: bool = False,
                      deterministic: bool = False, check: bool = True):
    """Self-attention over a sequence split across the ranks of ``group``, by
    DeepSpeed-Ulysses: an all-to-all gives each rank the whole sequence for heads_q / P query
    heads (and heads_kv / P key/value heads), fmha runs there, and a second all-to-all returns
    this rank's rows of every head. Arguments and result as :func:`ring_attention`; both
    heads_q and heads_kv must be multiples of the group size P."""
    _check_layout(layout)
    _check_qkv(q, k, v)
    rank, world = _world(group)
    hq, hkv = q.shape[2], k.shape[2]
    if hq % world or hkv % world:
        raise ValueError(f"q, k: Ulysses gives each of the {world} ranks an equal share of the "
                         f"heads; heads_q ({hq}) and heads_kv ({hkv}) must both be multiples "
                         f"of {world}")
    left, right, scale = _prepared(q, k, v, group, causal, window, layout, dropout_p, scale,
                                   softcap, alibi_slopes, deterministic, check)
    order = _sequence_order(world, layout, q.device)

    def to_heads(x):  # (b, n, h, d) -> (b, P n, h / P, d), rows in sequence order
        x = _AllToAll.apply(x, group, 2, 1)
        if order is not None:
            b, total = x.shape[:2]
            x = x.unflatten(1, (2 * world, total // (2 * world)))[:, order[0]].flatten(1, 2)
        return x

    def to_rows(x, seq_dim, head_dim):  # the inverse, for out (b, P n, h/P, d), lse (b, h/P, P n)
        if order is not None:
            total = x.shape[seq_dim]
            x = x.unflatten(seq_dim, (2 * world, total // (2 * world)))
            x = x.index_select(seq_dim, order[1]).flatten(seq_dim, seq_dim + 1)
        return _AllToAll.apply(x, group, seq_dim, head_dim)

    share = hq // world
    heads = slice(rank * share, (rank + 1) * share)
    rng = None
    if dropout_p > 0:
        rng = torch.randint(0, 2**62, (2,), dtype=torch.int64)
    out, lse = _torch.fwd(to_heads(q), to_heads(k), to_heads(v), None, None,
                          _slopes(alibi_slopes, q, heads), None, None, 0, 0, rng, float(scale),
                          float(softcap), left, right, False, float(dropout_p),
                          bool(deterministic), 0, 0, 0, rank * share, hq)
    out = to_rows(out, 1, 2)
    if not return_lse:
        return out
    return out, to_rows(lse, 2, 1)


# ---------------------------------------------------------------------------- tensor parallel

class _CopyToGroup(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over the group (every rank's heads
    used the same input)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) forward; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone(memory_format=torch.contiguous_format)  # the caller's x stays as it was
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class TensorParallelMultiheadAttention(torch.nn.Module):
    """A multi-head attention layer whose heads are split over the ranks of
    ``process_group`` (Megatron-style tensor parallelism), batch-first.

    Rank r owns query heads [r·H/P, (r+1)·H/P) and key/value heads [r·Hkv/P, (r+1)·Hkv/P):
    its rows of the packed q/k/v projection (``in_proj_weight``, ``in_proj_bias``: column
    parallel) and its columns of the output projection (``out_proj.weight``: row parallel;
    ``out_proj.bias`` is whole on every rank and added once, after the sum over ranks). The
    forward computes this rank's heads with fmha and all-reduces the projected output; the
    result, and every gradient, equals :class:`fmha.nn.MultiheadAttention`'s with the same
    weights. ``load_state_dict`` takes this rank's slice or a whole (unsplit)
    fmha.nn.MultiheadAttention state dict, which it slices. A new layer is initialised as
    the unsplit layer would be, sliced (ranks seeded alike hold one layer's slices; the
    unsplit layer is built once on each rank to do so).
    """

    def __init__(self, embed_dim: int, num_heads: int, *, num_kv_heads: Optional[int] = None,
                 bias: bool = True, dropout: float = 0.0, process_group=None, device=None,
                 dtype=None):
        super().__init__()
        rank, world = _world(process_group)
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be a multiple of num_heads "
                             f"({num_heads})")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                             f"({num_kv_heads})")
        if num_heads % world or num_kv_heads % world:
            raise ValueError(f"num_heads ({num_heads}) and num_kv_heads ({num_kv_heads}) must "
                             f"both be multiples of the process group's size ({world})")
        self.process_group, self.rank, self.world = process_group, rank, world
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.local_heads, self.local_kv_heads = num_heads // world, num_kv_heads // world
        self.dropout = dropout
        kw = dict(device=device, dtype=dtype)
        # The unsplit layer's initialisation, sliced below: with every rank seeded alike (as
        # dropout needs too) the ranks hold the slices of one fmha.nn.MultiheadAttention, not
        # copies of one slice. It is built whole once, first, so that it draws what the
        # unsplit layer would.
        from .nn import MultiheadAttention
        whole = MultiheadAttention(embed_dim, num_heads, bias=bias, batch_first=True,
                                   num_kv_heads=num_kv_heads, **kw)
        q_dim, kv_dim = self.local_heads * self.head_dim, self.local_kv_heads * self.head_dim
        self.in_proj_weight = torch.nn.Parameter(torch.empty(q_dim + 2 * kv_dim, embed_dim, **kw))
        self.in_proj_bias = (torch.nn.Parameter(torch.zeros(q_dim + 2 * kv_dim, **kw))
                             if bias else None)
        self.out_proj = torch.nn.Linear(q_dim, embed_dim, bias=bias, **kw)
        self.load_state_dict(whole.state_dict())

    def _rows(self) -> Tensor:
        """The rows of a whole packed projection (q; k; v) that this rank owns."""
        d, hq, hkv = self.head_dim, self.num_heads, self.num_kv_heads
        lq, lkv = self.local_heads * d, self.local_kv_heads * d
        q = torch.arange(self.rank * lq, (self.rank + 1) * lq)
        k = hq * d + torch.arange(self.rank * lkv, (self.rank + 1) * lkv)
        return torch.cat([q, k, k + hkv * d])

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        whole_rows = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        w = state_dict.get(prefix + "in_proj_weight")
        if w is not None and w.shape[0] == whole_rows and self.world > 1:
            rows = self._rows().to(w.device)
            state_dict[prefix + "in_proj_weight"] = w[rows]
            b = state_dict.get(prefix + "in_proj_bias")
            if b is not None:
                state_dict[prefix + "in_proj_bias"] = b[rows.to(b.device)]
            ow = state_dict.get(prefix + "out_proj.weight")
            if ow is not None and ow.shape[1] == self.num_heads * self.head_dim:
                cols = self.local_heads * self.head_dim
                state_dict[prefix + "out_proj.weight"] = ow[:, self.rank * cols:
                                                            (self.rank + 1) * cols]
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, query: Tensor, key: Optional[Tensor] = None,
                value: Optional[Tensor] = None, *, key_padding_mask: Optional[Tensor] = None,
                causal: bool = False) -> Tensor:
        """query (batch, L, embed_dim), key/value (batch, S, embed_dim) (default: query);
        key_padding_mask (batch, S), True = ignore (torch's convention); causal: each query
        sees the keys up to its own position (self-attention). Returns
        (batch, L, embed_dim), the same on every rank."""
        key = query if key is None else key
        value = key if value is None else value
        if key_padding_mask is not None and key_padding_mask.dtype != torch.bool:
            raise TypeError(f"key_padding_mask: expected a bool mask (True = ignore the key), "
                            f"got {key_padding_mask.dtype}")
        if causal and key is not query:
            raise ValueError("causal: only for self-attention (key is query); pass a mask "
                             "for cross-attention")
        group = self.process_group
        d = self.head_dim
        lq, lkv = self.local_heads * d, self.local_kv_heads * d
        w, b = self.in_proj_weight, self.in_proj_bias
        split = lambda t, lo, hi: None if t is None else t[lo:hi]  # noqa: E731
        xq = _CopyToGroup.apply(query, group)
        xk = xq if key is query else _CopyToGroup.apply(key, group)
        xv = xk if value is key else _CopyToGroup.apply(value, group)
        q = torch.nn.functional.linear(xq, w[:lq], split(b, 0, lq))
        k = torch.nn.functional.linear(xk, w[lq:lq + lkv], split(b, lq, lq + lkv))
        v = torch.nn.functional.linear(xv, w[lq + lkv:], split(b, lq + lkv, None))
        q = q.unflatten(-1, (self.local_heads, d))
        k = k.unflatten(-1, (self.local_kv_heads, d))
        v = v.unflatten(-1, (self.local_kv_heads, d))
        mask = None
        if key_padding_mask is not None:
            mask = (~key_padding_mask.to(torch.bool))[:, None, None, :]
        p = self.dropout if self.training else 0.0
        rng = torch.randint(0, 2**62, (2,), dtype=torch.int64) if p > 0 else None
        out, _ = _torch.fwd(q, k, v, None, mask, None, None, None, 0, 0, rng,
                            1.0 / math.sqrt(d), 0.0, -1, 0 if causal else -1, True, float(p),
                            False, 0, 0, 0, self.rank * self.local_heads, self.num_heads)
        y = torch.nn.functional.linear(out.flatten(-2), self.out_proj.weight)
        y = _SumOverGroup.apply(y, group)
        return y if self.out_proj.bias is None else y + self.out_proj.bias
