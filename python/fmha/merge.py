"""Merging partial attentions: the exact combination of attention results over disjoint key sets.

If ``(out_a, lse_a)`` is attention over keys A and ``(out_b, lse_b)`` over keys B (disjoint, same
queries), attention over A ∪ B is

    lse = log(exp(lse_a) + exp(lse_b))
    out = exp(lse_a - lse) · out_a + exp(lse_b - lse) · out_b

which is how split-KV (FlashDecoding), shared-prefix (cascade) serving and ring attention put
their pieces together. ``fmha.attention(..., return_lse=True)`` returns exactly the pair this
takes. The rules of docs/semantics.md carry over: a part that saw no key (lse = -inf) contributes
nothing, even if its out holds garbage; when no part saw a key the result is out = 0,
lse = -inf; a NaN lse makes its row NaN in every column.

Works on NumPy arrays and torch tensors (any device; with torch, differentiable through torch's
own operations). Arithmetic is in float32 (float64 for float64 outs); out keeps its dtype.
"""

from __future__ import annotations

from typing import Sequence, Tuple

__all__ = ["merge_states", "merge_states_n"]


def merge_states(out_a, lse_a, out_b, lse_b) -> Tuple[object, object]:
    """Attention over the union of two disjoint key sets from the attention over each.

    out_*: (batch, seqlen_q, heads, head_dim_v) with lse_* (batch, heads, seqlen_q), as
    ``fmha.attention(..., return_lse=True)`` returns them; or varlen-packed
    (total_q, heads, head_dim_v) with lse (heads, total_q). Returns (out, lse).
    """
    return merge_states_n([out_a, out_b], [lse_a, lse_b])


def merge_states_n(outs: Sequence, lses: Sequence) -> Tuple[object, object]:
    """The n-way form of :func:`merge_states`: ``outs[i]``, ``lses[i]`` over key set i."""
    xp, outs, lses = _checked(outs, lses)
    acc = xp["float64"] if _dtype_name(outs[0]) == "float64" else xp["float32"]
    lse = xp["stack"]([xp["astype"](x, acc) for x in lses])  # (n, ...)
    m = xp["amax"](lse)  # NaN if any part's is
    # Every part empty: m = -inf, and lse - m would be NaN; subtract 0 instead.
    m_safe = xp["where"](m == -float("inf"), 0.0, m)
    e = xp["exp"](lse - m_safe[None])
    total = e.sum(0)
    empty = total == 0
    lse_out = xp["where"](empty, -float("inf"), m_safe + xp["log"](xp["where"](empty, 1.0, total)))
    weight = xp["where"](empty[None], 0.0, e / xp["where"](empty, 1.0, total)[None])
    out = None
    for i, o in enumerate(outs):
        w = _per_row(weight[i], o.ndim, xp)
        # A zero weight contributes 0 whatever out holds (a part with no key); NaN stays NaN.
        term = xp["where"](w == 0, 0.0, w * xp["astype"](o, acc))
        out = term if out is None else out + term
    return xp["astype"](out, _dtype_of(outs[0])), xp["astype"](lse_out, _dtype_of(lses[0]))


# ---- helpers: one code path for NumPy and torch


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def _dtype_name(x) -> str:
    return str(x.dtype).replace("torch.", "")


def _dtype_of(x):
    return x.dtype


def _namespace(torch_inputs: bool) -> dict:
    if torch_inputs:
        import torch
        return dict(
            stack=lambda xs: torch.stack(list(xs)), amax=lambda x: torch.amax(x, dim=0),
            where=torch.where, exp=torch.exp, log=torch.log,
            astype=lambda x, dt: x.to(dt), float32=torch.float32, float64=torch.float64,
            movedim=torch.movedim)
    import numpy as np
    return dict(
        stack=np.stack, amax=lambda x: np.max(x, axis=0), where=np.where, exp=np.exp, log=np.log,
        astype=lambda x, dt: np.asarray(x).astype(dt, copy=False), float32=np.float32,
        float64=np.float64, movedim=np.moveaxis)


def _per_row(w, out_ndim: int, xp: dict):
    # lse's layout (batch, heads, seqlen_q) / (heads, total_q) against out's (batch, seqlen_q,
    # heads, d) / (total_q, heads, d): move the heads axis behind the rows, add the column axis.
    w = xp["movedim"](w, -2, -1)
    return w[..., None]


def _checked(outs, lses):
    outs, lses = list(outs), list(lses)
    if len(outs) != len(lses):
        raise ValueError(f"merge_states: outs and lses differ in length ({len(outs)} vs "
                         f"{len(lses)})")
    if not outs:
        raise ValueError("merge_states: outs is empty: at least one partial result is needed")
    torch_inputs = _is_torch(outs[0])
    import numpy as np
    for name, group in (("out", outs), ("lse", lses)):
        for i, x in enumerate(group):
            if _is_torch(x) != torch_inputs or not (torch_inputs or isinstance(x, np.ndarray)):
                raise TypeError(f"merge_states: {name} {i} is a {type(x).__name__}; every out "
                                f"and lse must be a NumPy array, or every one a torch tensor")
    o0 = outs[0]
    if o0.ndim not in (3, 4):
        raise ValueError(f"merge_states: out 0 has shape {tuple(o0.shape)}; expected (batch, "
                         f"seqlen_q, heads, head_dim_v) or packed (total_q, heads, head_dim_v)")
    want_lse = (tuple(o0.shape[:1]) + (o0.shape[2], o0.shape[1]) if o0.ndim == 4
                else (o0.shape[1], o0.shape[0]))
    for i, (o, l) in enumerate(zip(outs, lses)):
        if tuple(o.shape) != tuple(o0.shape):
            raise ValueError(f"merge_states: out {i} has shape {tuple(o.shape)}, out 0 "
                             f"{tuple(o0.shape)}: the parts must be over the same queries")
        if tuple(l.shape) != want_lse:
            raise ValueError(f"merge_states: lse {i} has shape {tuple(l.shape)}; for out of "
                             f"shape {tuple(o0.shape)} it must be {want_lse}")
        if _dtype_name(o) not in ("float64", "float32", "float16", "bfloat16"):
            raise TypeError(f"merge_states: out {i} has dtype {_dtype_name(o)}; expected a "
                            f"floating dtype")
        if _dtype_name(l) not in ("float64", "float32"):
            raise TypeError(f"merge_states: lse {i} has dtype {_dtype_name(l)}; expected float32 "
                            f"(or float64), as fmha.attention returns it")
        if _dtype_name(o) != _dtype_name(o0):
            raise TypeError(f"merge_states: out {i} is {_dtype_name(o)}, out 0 "
                            f"{_dtype_name(o0)}: one dtype for every part")
        if torch_inputs and (o.device != o0.device or l.device != o0.device):
            raise ValueError(f"merge_states: out {i} / lse {i} are on {o.device} / {l.device}, "
                             f"out 0 on {o0.device}: one device for every part")
    return _namespace(torch_inputs), outs, lses
