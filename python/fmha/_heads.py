"""Head importance and pruning (Michel, Levy and Neubig, "Are Sixteen Heads Really Better
than One?", 2019), for models whose attention runs on fmha.

Each attention layer's heads get a gate ξ_h, multiplied into head h's output before the
output projection (fmha.nn.MultiheadAttention, and Hugging Face models on
``attn_implementation="fmha"`` through fmha's attention function: no model code changes).
At ξ = 1 the model is unchanged, and the importance of a head is

    I_h = E_x | ∂L(x) / ∂ξ_h |

over the batches given, normalised per layer by its L2 norm (as in the paper), so heads of
different layers compare. Removing head h changes the loss by about -∂L/∂ξ_h to first order:
the least important heads are the first to prune. Exposed as fmha.nn.head_importance,
fmha.nn.heads_to_prune and fmha.nn.prune_heads.
"""

from __future__ import annotations

import operator
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import Tensor

#: The attribute that carries a layer's gates: a (heads,) tensor, or absent.
GATE = "fmha_head_gate"


def gate_heads(module, out: Tensor, head_dim: int = 2) -> Tensor:
    """out with head h multiplied by the module's gate h, when it has gates (else out)."""
    # The instance's own attributes first: a module without gates would otherwise go through
    # nn.Module.__getattr__ and a caught AttributeError on every call. A gate registered as
    # a parameter or buffer lives in their dictionaries instead.
    attrs = getattr(module, "__dict__", {})
    gate = attrs.get(GATE)
    if gate is None and (GATE in attrs.get("_parameters", ())
                         or GATE in attrs.get("_buffers", ())):
        gate = getattr(module, GATE)
    if gate is None:
        return out
    shape = [1] * out.dim()
    shape[head_dim] = -1
    return out * gate.to(device=out.device, dtype=out.dtype).view(shape)


def attention_layers(model: torch.nn.Module, sample: Optional[Callable] = None
                     ) -> List[Tuple[str, torch.nn.Module, int]]:
    """(name, module, heads) of every attention layer of the model that fmha computes:
    each fmha.nn.MultiheadAttention, and each module that called fmha's Hugging Face
    attention function while ``sample()`` ran (one forward pass that finds them)."""
    names = {m: n for n, m in model.named_modules()}
    found = [(n, m, m.num_heads) for n, m in model.named_modules() if _gates_itself(m)]
    if sample is not None:
        seen: Dict[torch.nn.Module, int] = {}
        with _watching(seen), torch.no_grad():
            sample()
        found += [(names.get(m, type(m).__name__), m, h) for m, h in seen.items()
                  if not any(m is f[1] for f in found)]
    return found


def _gates_itself(m) -> bool:
    """A layer that applies its gates in its own forward (fmha.nn.MultiheadAttention marks
    itself so; this module does not import fmha.nn, which imports it)."""
    return getattr(type(m), "fmha_gates_heads", False)


class _watching:
    """Records (module, query heads) of every call of fmha's Hugging Face attention function."""

    def __init__(self, seen):
        self.seen = seen

    def __enter__(self):
        _WATCHERS.append(self.seen)

    def __exit__(self, *exc):
        _WATCHERS.remove(self.seen)


_WATCHERS: List[dict] = []


def observe(module, heads: int) -> None:
    """Called by fmha's Hugging Face attention function for every layer it computes."""
    for seen in _WATCHERS:
        seen.setdefault(module, heads)


def head_importance(model: torch.nn.Module, batches: Iterable, loss_fn: Callable,
                    *, normalize: bool = True) -> Dict[str, Tensor]:
    """Importance of every head of every fmha attention layer of ``model``.

    Args:
        model: a torch module containing fmha.nn.MultiheadAttention layers, or a Hugging
            Face model running on ``attn_implementation="fmha"``.
        batches: an iterable of batches; each is passed to ``loss_fn``.
        loss_fn: ``loss_fn(model, batch) -> scalar tensor``, the loss L whose sensitivity
            to each head is measured (a task loss, or a label-free one).
        normalize: divide each layer's scores by their L2 norm (Michel et al.).

    Returns:
        ``{layer name: (heads,) float32 tensor}`` in the model's module order: E|∂L/∂ξ_h|.
    """
    batches = list(batches)
    if not batches:
        raise ValueError("batches: at least one batch is needed")
    layers = attention_layers(model, lambda: loss_fn(model, batches[0]))
    if not layers:
        raise ValueError("model: no attention layer runs on fmha (use fmha.nn."
                         "MultiheadAttention, or attn_implementation=\"fmha\" for a Hugging "
                         "Face model)")
    device = next(model.parameters()).device
    gates = []
    try:
        for _, m, heads in layers:
            g = torch.ones(heads, device=device, requires_grad=True)
            setattr(m, GATE, g)
            gates.append(g)
        totals = [torch.zeros(g.shape[0], device=device) for g in gates]
        for batch in batches:
            loss = loss_fn(model, batch)
            grads = torch.autograd.grad(loss, gates, allow_unused=True)
            for t, g in zip(totals, grads):
                if g is not None:
                    t += g.detach().abs().float()
    finally:
        for _, m, _ in layers:
            if hasattr(m, GATE):
                delattr(m, GATE)
    scores = {}
    for (name, _, _), t in zip(layers, totals):
        t = t / len(batches)
        if normalize:
            norm = t.norm()
            t = t / norm if norm > 0 else t
        scores[name] = t.cpu()
    return scores


def heads_to_prune(importance: Dict[str, Tensor], ratio: float, *, per_layer: bool = False,
                   order: Optional[Dict[str, Tensor]] = None) -> Dict[str, List[int]]:
    """The heads to remove: the ``ratio`` fraction of all heads with the lowest importance
    (``per_layer=True``: that fraction of every layer's heads). Every layer keeps at least
    one head. ``order``: rank by these scores instead (say, random ones, for a baseline).
    The choice does not know about grouped kv heads: for a GQA layer, :func:`prune_heads`
    refuses a choice that leaves its kv heads unequal query heads."""
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"ratio: expected a fraction in [0, 1), got {ratio!r}")
    scores = order if order is not None else importance
    if order is not None and (set(order) != set(importance) or
                              any(len(order[n]) != len(importance[n]) for n in importance)):
        raise ValueError("order: expected a score for every head of every layer of importance")
    if any(bool(torch.isnan(torch.as_tensor(s)).any()) for s in scores.values()):
        raise ValueError(f"{'order' if order is not None else 'importance'}: holds NaN scores")
    result = {name: [] for name in importance}
    if per_layer:
        for name, s in scores.items():
            n = min(int(round(ratio * len(s))), len(s) - 1)
            result[name] = sorted(torch.argsort(s, stable=True)[:n].tolist())
        return result
    ranked = sorted(((float(v), name, h) for name, s in scores.items()
                     for h, v in enumerate(s.tolist())))
    total = sum(len(s) for s in scores.values())
    left = {name: len(s) for name, s in scores.items()}
    want = int(round(ratio * total))
    for _, name, h in ranked:
        if want == 0:
            break
        if left[name] > 1:
            result[name].append(h)
            left[name] -= 1
            want -= 1
    return {name: sorted(hs) for name, hs in result.items()}


def prune_heads(model: torch.nn.Module, heads: Dict[str, List[int]]) -> None:
    """Remove the given heads physically, so the model gets smaller and faster: each
    fmha.nn.MultiheadAttention by its own ``prune_heads``, and Hugging Face layers of the
    BERT family (separate query/key/value projections; the output projection in the parent
    module's ``output.dense``: BERT, RoBERTa, MiniLM, ...). Indices are those of the current
    model (as :func:`head_importance` reports them). Every layer's request is checked before
    any layer changes: an invalid one raises and leaves the model as it was. Other layers
    raise NotImplementedError. (A pruned Hugging Face model keeps its config's head count:
    save it with torch.save / state_dict and prune a fresh model the same way before loading,
    not with save_pretrained / from_pretrained.)"""
    modules = dict(model.named_modules())
    plan = []
    for name, hs in heads.items():
        try:
            hs = sorted({operator.index(h) for h in hs if not isinstance(h, bool)} |
                        ({-1} if any(isinstance(h, bool) for h in hs) else set()))
        except TypeError:
            raise TypeError(f"heads: {name}: expected head indices (ints), got {hs!r}") from None
        if not hs:
            continue
        m = modules.get(name)
        if m is None:
            raise ValueError(f"heads: the model has no module named {name!r}")
        if _gates_itself(m):
            n, groups = m.num_heads, m.num_heads // m.num_kv_heads
        elif all(hasattr(m, a) for a in ("query", "key", "value", "attention_head_size")):
            n, groups = m.num_attention_heads, 1
        else:
            raise NotImplementedError(f"{name}: pruning {type(m).__name__} is not supported "
                                      f"(fmha.nn.MultiheadAttention and BERT-family layers "
                                      f"are)")
        if any(not 0 <= h < n for h in hs):
            raise ValueError(f"heads: {name} has {n} heads; expected indices in [0, {n}), "
                             f"got {hs}")
        keep = [h for h in range(n) if h not in hs]
        if not keep:
            raise ValueError(f"heads: pruning every head of {name} is not supported")
        per_kv = {}
        for h in keep:
            per_kv[h // groups] = per_kv.get(h // groups, 0) + 1
        if len(set(per_kv.values())) != 1:
            raise ValueError(f"heads: {name} shares each kv head among {groups} query heads, "
                             f"and every kv head that remains must keep as many; pruning {hs} "
                             f"does not")
        dense = None
        if not _gates_itself(m):
            parent = modules.get(name.rsplit(".", 1)[0]) if "." in name else None
            dense = getattr(getattr(parent, "output", None), "dense", None)
            if dense is None:
                raise NotImplementedError(f"{name}: no output projection found at "
                                          f"<parent>.output.dense")
        plan.append((m, dense, hs))
    for m, dense, hs in plan:
        if dense is None:
            current = [h for h in range(m.num_heads + len(m.pruned_heads))
                       if h not in m.pruned_heads]
            m.prune_heads([current[h] for h in hs])
        else:
            _prune_bert_layer(m, dense, hs)


def _prune_bert_layer(m, dense: torch.nn.Linear, heads: List[int]) -> None:
    d, n = m.attention_head_size, m.num_attention_heads
    keep = [h for h in range(n) if h not in set(heads)]
    if not keep:
        raise ValueError("heads: pruning every head of a layer is not supported")
    rows = torch.cat([torch.arange(h * d, (h + 1) * d) for h in keep]).to(dense.weight.device)

    def cut(linear: torch.nn.Linear, dim: int) -> torch.nn.Linear:
        w = linear.weight.index_select(dim, rows).clone()
        b = linear.bias
        if dim == 0 and b is not None:
            b = b[rows].clone()
        new = torch.nn.Linear(w.shape[1], w.shape[0], bias=b is not None,
                              device=w.device, dtype=w.dtype)
        new.weight = torch.nn.Parameter(w, requires_grad=linear.weight.requires_grad)
        if b is not None:
            new.bias = torch.nn.Parameter(b.clone(), requires_grad=linear.bias.requires_grad)
        return new
    m.query, m.key, m.value = cut(m.query, 0), cut(m.key, 0), cut(m.value, 0)
    new_dense = cut(dense, 1)
    dense.weight, dense.in_features = new_dense.weight, new_dense.in_features
    m.num_attention_heads = len(keep)
    m.all_head_size = len(keep) * d
