"""fmha.scaled_dot_product_attention: torch.nn.functional.scaled_dot_product_attention on fmha.

A drop-in replacement: the same signature, defaults, layout ``(..., heads, seqlen, head_dim)``
and semantics, computed by the fmha kernels through :func:`fmha.attention`. The inputs are
handed over as transposed views (fmha's layout is ``(batch, seqlen, heads, head_dim)`` and it
accepts any strides), so nothing is copied on the way in or out.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from ._api import attention

__all__ = ["scaled_dot_product_attention"]


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor,
                                 attn_mask: Optional[Tensor] = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, *, scale: Optional[float] = None,
                                 enable_gqa: bool = False,
                                 sinks: Optional[Tensor] = None) -> Tensor:
    """``softmax(query @ key.T * scale + mask) @ value``, as torch's SDPA computes it.

    Args:
        query: ``(N, ..., Hq, L, E)``; any number of leading batch dimensions (flattened into
            fmha's batch, broadcast against key/value like torch does), or ``(L, E)``.
        key: ``(N, ..., H, S, E)``.
        value: ``(N, ..., H, S, Ev)``.
        attn_mask: broadcastable to ``(N, ..., Hq, L, S)``. Bool: ``True`` = the query may
            attend to that key (fmha's ``mask=``). Float (float32 or query's dtype): added to
            the scores (fmha's ``bias=``; differentiable when it requires grad).
        dropout_p: probability of dropping an attention weight. Applied whenever > 0, as in
            torch's functional form (pass 0.0 in eval). The seed comes from torch's default
            generator, so ``torch.manual_seed`` reproduces the mask, but the mask is not the
            one torch's own kernel would draw.
        is_causal: query i sees keys 0..i (top-left aligned, as torch). Like torch's documented
            behaviour, it may not be combined with ``attn_mask`` (ValueError).
        scale: the score scale; ``None`` means ``1/sqrt(E)``.
        enable_gqa: allow ``Hq`` to be a multiple of ``H`` (grouped-query attention). fmha
            reads the shared key/value heads in place; nothing is repeated.
        sinks: fmha's extension, not torch's: ``(Hq,)`` attention-sink logits (gpt-oss), one
            per query head, in every softmax denominator (:func:`fmha.attention`).

    Returns:
        ``(N, ..., Hq, L, Ev)`` in query's dtype, as a transposed view of fmha's
        ``(batch, L, Hq, Ev)`` output.

    One deliberate difference: a query row that may attend to no key at all returns 0 (and
    gradient 0), never NaN, on every backend (torch's result there depends on its backend
    and version).
    """
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.ndim < 2:
            raise ValueError(f"{name}: expected at least 2 dimensions (..., seqlen, head_dim), "
                             f"got shape {tuple(x.shape)}")
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"enable_gqa: expected a bool, got {enable_gqa!r}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal: expected a bool, got {is_causal!r}")
    if is_causal and attn_mask is not None:
        # torch documents this as an error (some of its kernels accept it, others raise);
        # fmha raises always so that code written against fmha runs on every torch backend.
        raise ValueError("attn_mask, is_causal: an explicit attn_mask may not be combined "
                         "with is_causal=True (as in torch); fold the causal mask into "
                         "attn_mask, or call fmha.attention(causal=True, mask=...)")

    # (..., H, S, E) with no head dimension (2-D inputs) is one head.
    q4, k4, v4 = (x if x.ndim >= 3 else x.unsqueeze(0) for x in (query, key, value))
    lead, heads = _batch_and_heads(q4, k4, v4, enable_gqa)
    q, k, v = (_to_fmha_layout(x, lead, h) for x, h in zip((q4, k4, v4), heads))

    batch, seqlen_q, heads_q, _ = q.shape
    bias = mask = None
    if attn_mask is not None:
        m = _flatten_mask(attn_mask, lead, (heads_q, seqlen_q, k.shape[1]), query.dtype)
        if m.dtype == torch.bool:
            mask = m
        else:
            bias = m

    out = attention(q, k, v, causal=is_causal, alignment="top_left", scale=scale, bias=bias,
                    mask=mask, dropout_p=dropout_p, sinks=sinks)
    # (B, L, Hq, Ev) -> (..., Hq, L, Ev): a transpose and a split of the batch dimension,
    # both views of fmha's contiguous output.
    out = out.transpose(1, 2)
    if len(lead) != 1:
        out = out.reshape(*lead, heads_q, seqlen_q, out.shape[-1])
    if max(query.ndim, key.ndim, value.ndim) == 2:
        out = out.squeeze(0)
    return out


def _batch_and_heads(q: Tensor, k: Tensor, v: Tensor, enable_gqa: bool):
    """The broadcast leading batch shape and the head counts (q's, k's, v's) fmha will see."""
    lead = q.shape[:-3]
    if k.shape[:-3] != lead or v.shape[:-3] != lead:  # equal: no broadcast_shapes to pay
        try:
            lead = torch.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
        except RuntimeError:
            raise ValueError(f"query, key, value: batch dimensions {tuple(q.shape[:-3])}, "
                             f"{tuple(k.shape[:-3])} and {tuple(v.shape[:-3])} do not "
                             f"broadcast") from None
    hq, hk, hv = q.shape[-3], k.shape[-3], v.shape[-3]
    if hk != hv:
        raise ValueError(f"key, value: {hk} and {hv} heads differ")
    if hq == hk or (enable_gqa and hq % hk == 0):
        return lead, (hq, hk, hv)
    # Without enable_gqa torch broadcasts a single head against many. A single key/value head
    # is what fmha calls multi-query attention (read in place); a single query head is
    # expanded as a stride-0 view.
    if not enable_gqa and hk == 1:
        return lead, (hq, 1, 1)
    if not enable_gqa and hq == 1:
        return lead, (hk, hk, hv)
    if enable_gqa:
        raise ValueError(f"query, key: with enable_gqa the query heads ({hq}) must be a "
                         f"multiple of the key/value heads ({hk})")
    raise ValueError(f"query, key: {hq} query heads and {hk} key/value heads differ; pass "
                     f"enable_gqa=True for grouped-query attention")


def _to_fmha_layout(x: Tensor, lead: Tuple[int, ...], heads: int) -> Tensor:
    """(..., H, S, E) -> (B, S, H, E), B = prod(lead): views unless batch dims must merge."""
    if len(lead) == 1 and x.ndim == 4 and x.shape[0] == lead[0] and x.shape[1] == heads:
        return x.transpose(1, 2)  # the common case: (B, H, S, E) as it is
    if x.shape[:-2] != (*lead, heads):
        x = x.expand(*lead, heads, *x.shape[-2:])
    if len(lead) != 1:
        # Merging several batch dimensions (or adding one) is a view for contiguous inputs;
        # reshape copies only when their strides cannot be merged. (The batch is spelt out:
        # -1 is ambiguous for an empty tensor.)
        x = x.reshape(math.prod(lead), *x.shape[-3:])
    return x.transpose(1, 2)


def _flatten_mask(attn_mask: Tensor, lead: Tuple[int, ...], weights: Tuple[int, int, int],
                  query_dtype: torch.dtype) -> Tensor:
    """attn_mask, broadcastable to (*lead, *weights) = (..., Hq, L, S), as a 4-D
    (B|1, Hq|1, L|1, S|1) tensor."""
    if not isinstance(attn_mask, Tensor):
        raise TypeError(f"attn_mask: expected a torch.Tensor or None, got "
                        f"{type(attn_mask).__name__}")
    dt = attn_mask.dtype
    # torch accepts bool, float32 and the query's own dtype (and nothing else) for the mask.
    if dt != torch.bool and dt != torch.float32 and dt != query_dtype:
        raise TypeError(f"attn_mask: expected dtype bool, float32 or query's {query_dtype}, "
                        f"got {dt}")
    full = tuple(lead) + tuple(weights)
    if attn_mask.ndim > len(full) or any(
            s != 1 and s != f for s, f in zip(reversed(attn_mask.shape), reversed(full))):
        raise ValueError(f"attn_mask: shape {tuple(attn_mask.shape)} does not broadcast to the "
                         f"attention weights' shape {full}")
    nlead = len(lead)
    m = attn_mask.reshape((1,) * (len(full) - attn_mask.ndim) + tuple(attn_mask.shape))
    if nlead == 1:
        return m
    if all(s == 1 for s in m.shape[:nlead]):
        return m.reshape(1, *m.shape[nlead:])
    # Several batch dimensions that the mask does not all broadcast over: merging them needs
    # the expanded mask, which reshape materialises (as large as the mask broadcast to them).
    return m.expand(*lead, *m.shape[nlead:]).reshape(math.prod(lead), *m.shape[nlead:])
