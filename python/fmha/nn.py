"""fmha.nn: torch.nn modules whose attention runs on the fmha kernels.

:class:`MultiheadAttention` is a drop-in replacement for ``torch.nn.MultiheadAttention``:
the same constructor, forward, parameter names, shapes and initialisation, so a checkpoint
of either loads into the other and gives the same outputs and gradients.
"""

from __future__ import annotations

import operator
from typing import Iterable, Optional, Tuple

import torch
from torch import Tensor
from torch.nn import Module, Parameter
from torch.nn.init import constant_, xavier_normal_, xavier_uniform_
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from ._api import attention
from ._heads import gate_heads, head_importance, heads_to_prune, prune_heads

__all__ = ["MultiheadAttention", "head_importance", "heads_to_prune", "prune_heads"]


class MultiheadAttention(Module):
    r"""``torch.nn.MultiheadAttention`` with its attention computed by :func:`fmha.attention`.

    Same constructor, ``forward`` and ``state_dict`` (keys, shapes, initialisation order) as
    ``torch.nn.MultiheadAttention``: load a checkpoint of one into the other and they agree
    on outputs, attention weights and gradients. Masks follow torch's conventions (bool:
    ``True`` = *not* allowed to attend; float: added to the scores); they are converted to
    fmha's (``True`` = may attend) at the boundary, and the query/key/value projections
    reach the kernels as strided views, without copies.

    Args:
        embed_dim: model dimension (query features and output features).
        num_heads: number of (query) heads; ``embed_dim`` must be a multiple of it.
        dropout: dropout probability on the attention weights, in training mode only.
        bias: add biases to the input and output projections.
        add_bias_kv: append learned key/value vectors (``bias_k``, ``bias_v``) as one extra
            key position.
        add_zero_attn: append a key/value position of zeros.
        kdim: key features (default ``embed_dim``).
        vdim: value features (default ``embed_dim``). When ``kdim`` or ``vdim`` differ from
            ``embed_dim`` the projections are separate parameters (``q_proj_weight``,
            ``k_proj_weight``, ``v_proj_weight``) instead of one ``in_proj_weight``.
        batch_first: inputs and output are ``(batch, seq, feature)`` instead of
            ``(seq, batch, feature)``.
        device: device of the parameters.
        dtype: dtype of the parameters.
        num_kv_heads: (fmha extra, keyword-only) key/value heads for grouped-query attention;
            ``num_heads`` must be a multiple of it. ``None`` means ``num_heads``. The key and
            value projections then have ``num_kv_heads * head_dim`` outputs: such checkpoints
            have different shapes from torch's and do not load into
            ``torch.nn.MultiheadAttention``.

    Differences from torch, all deliberate:

    * ``need_weights=True`` (torch's default) computes the weights explicitly, an O(L·S)
      tensor per head, in addition to fmha's O(L) attention. Pass ``need_weights=False``
      unless you use them. In training with ``dropout > 0`` the returned weights are the
      probabilities before dropout (the output does use dropout), and the dropout mask is
      fmha's, not the one torch would draw.
    * A query that may attend to no key at all gets output 0 (before ``out_proj``) and zero
      weights, where torch produces NaN.
    * Inside ``torch.nn.TransformerEncoderLayer`` in inference mode, torch's fused fast path
      reads ``self_attn``'s weights and bypasses this module's ``forward``;
      ``torch.backends.mha.set_fastpath_enabled(False)`` keeps fmha in the loop.
    """

    #: Applies head-importance gates in forward (fmha.nn.head_importance; see fmha._heads).
    fmha_gates_heads = True

    __constants__ = ["batch_first"]
    bias_k: Optional[Tensor]
    bias_v: Optional[Tensor]

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False,
                 kdim: Optional[int] = None, vdim: Optional[int] = None,
                 batch_first: bool = False, device=None, dtype=None, *,
                 num_kv_heads: Optional[int] = None) -> None:
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(f"embed_dim and num_heads must be greater than 0, got "
                             f"embed_dim={embed_dim} and num_heads={num_heads} instead")
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim: {embed_dim} is not a multiple of num_heads "
                             f"({num_heads})")
        if num_kv_heads is None:
            num_kv_heads = num_heads
        if num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads: expected a positive divisor of num_heads "
                             f"({num_heads}), got {num_kv_heads}")
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.head_dim = embed_dim // num_heads
        #: Original indices of the heads removed by :meth:`prune_heads`.
        self.pruned_heads: set = set()
        q_dim, kv_dim = self._proj_dims()

        # The parameters are created in torch's order, and initialised below in torch's order,
        # so that the same seed gives bit-identical parameters to torch.nn.MultiheadAttention.
        if not self._qkv_same_embed_dim:
            self.q_proj_weight = Parameter(torch.empty((q_dim, embed_dim), **factory_kwargs))
            self.k_proj_weight = Parameter(torch.empty((kv_dim, self.kdim), **factory_kwargs))
            self.v_proj_weight = Parameter(torch.empty((kv_dim, self.vdim), **factory_kwargs))
            self.register_parameter("in_proj_weight", None)
        else:
            self.in_proj_weight = Parameter(
                torch.empty((q_dim + 2 * kv_dim, embed_dim), **factory_kwargs))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        if bias:
            self.in_proj_bias = Parameter(torch.empty(q_dim + 2 * kv_dim, **factory_kwargs))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = NonDynamicallyQuantizableLinear(q_dim, embed_dim, bias=bias,
                                                        **factory_kwargs)
        if add_bias_kv:
            self.bias_k = Parameter(torch.empty((1, 1, kv_dim), **factory_kwargs))
            self.bias_v = Parameter(torch.empty((1, 1, kv_dim), **factory_kwargs))
        else:
            self.bias_k = self.bias_v = None
        self.add_zero_attn = add_zero_attn
        self._reset_parameters()

    def _proj_dims(self) -> Tuple[int, int]:
        return self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim

    def _reset_parameters(self) -> None:
        if self._qkv_same_embed_dim:
            xavier_uniform_(self.in_proj_weight)
        else:
            xavier_uniform_(self.q_proj_weight)
            xavier_uniform_(self.k_proj_weight)
            xavier_uniform_(self.v_proj_weight)
        if self.in_proj_bias is not None:
            constant_(self.in_proj_bias, 0.0)
            constant_(self.out_proj.bias, 0.0)
        if self.bias_k is not None:
            xavier_normal_(self.bias_k)
        if self.bias_v is not None:
            xavier_normal_(self.bias_v)

    def extra_repr(self) -> str:
        s = f"embed_dim={self.embed_dim}, num_heads={self.num_heads}"
        if self.num_kv_heads != self.num_heads:
            s += f", num_kv_heads={self.num_kv_heads}"
        if self.kdim != self.embed_dim or self.vdim != self.embed_dim:
            s += f", kdim={self.kdim}, vdim={self.vdim}"
        if self.dropout:
            s += f", dropout={self.dropout}"
        if self.batch_first:
            s += ", batch_first=True"
        if self.pruned_heads:
            s += f", pruned_heads={sorted(self.pruned_heads)}"
        return s

    # ------------------------------------------------------------------------- forward

    def forward(self, query: Tensor, key: Tensor, value: Tensor,
                key_padding_mask: Optional[Tensor] = None, need_weights: bool = True,
                attn_mask: Optional[Tensor] = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
        r"""Attention of ``query`` over ``key``/``value``, as ``torch.nn.MultiheadAttention``.

        Args:
            query: ``(L, N, E)``, ``(N, L, E)`` when ``batch_first``, or unbatched ``(L, E)``.
            key: ``(S, N, kdim)``, ``(N, S, kdim)`` when ``batch_first``, or ``(S, kdim)``.
            value: ``(S, N, vdim)``, ``(N, S, vdim)`` when ``batch_first``, or ``(S, vdim)``.
            key_padding_mask: ``(N, S)`` (``(S,)`` unbatched). Bool: ``True`` = this key is
                padding, ignore it. Float: added to every query's scores for that key.
            need_weights: also return the attention weights (computed explicitly: O(L·S)
                memory; see the class notes).
            attn_mask: ``(L, S)`` or ``(N·num_heads, L, S)`` (``(num_heads, L, S)``
                unbatched). Bool: ``True`` = not allowed to attend. Float: added to the
                scores.
            average_attn_weights: return the weights averaged over heads ``(N, L, S)``
                rather than per head ``(N, num_heads, L, S)``.
            is_causal: a hint that ``attn_mask`` is the causal mask, as in torch: it requires
                ``attn_mask``; when there is no ``key_padding_mask`` and ``need_weights`` is
                False the mask is not read and fmha's causal (top-left) attention runs
                instead, otherwise the mask is applied as given.

        Returns:
            ``(attn_output, attn_weights)``: ``attn_output`` shaped like ``query`` with
            ``embed_dim`` features; ``attn_weights`` (``None`` unless ``need_weights``)
            ``(N, L, S)`` or ``(N, num_heads, L, S)``, batch dimension dropped when unbatched.
            S counts the extra positions of ``add_bias_kv`` / ``add_zero_attn``.
        """
        is_batched = self._check_shapes(query, key, value, key_padding_mask, attn_mask)
        self_attention = query is key and key is value
        kv_shared = key is value
        if not is_batched:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        # From here on 3-D, in the caller's layout: (N, seq, feat) when batch_first (and
        # batched), else (seq, N, feat).
        seq_first = not (self.batch_first and is_batched)
        seq_dim, batch_dim = (0, 1) if seq_first else (1, 0)
        bsz, tgt_len, src_len = query.shape[batch_dim], query.shape[seq_dim], key.shape[seq_dim]
        for name, m in (("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask)):
            if m is not None and m.dtype != torch.bool and not torch.is_floating_point(m):
                raise TypeError(f"{name}: only bool and floating-point masks are supported, "
                                f"got {m.dtype}")
        if is_causal and attn_mask is None:
            raise ValueError("is_causal: needs attn_mask (it is a hint that attn_mask is "
                             "causal, as in torch); use "
                             "torch.nn.Transformer.generate_square_subsequent_mask to make one")
        # torch trusts the hint only when nothing else must be merged into the mask.
        causal = is_causal and key_padding_mask is None and not need_weights
        if causal:
            attn_mask = None

        q, k, v = self._project(query, key, value, self_attention, kv_shared)
        # (seq, N, H·d) or (N, seq, H·d) -> (N, seq, H, d): views, no copies.
        q, k, v = (x.unflatten(-1, (-1, self.head_dim)) for x in (q, k, v))
        if seq_first:
            q, k, v = (x.transpose(0, 1) for x in (q, k, v))

        if attn_mask is not None:
            attn_mask = self._check_attn_mask(attn_mask, bsz, tgt_len, src_len)
        extra_keys = 0
        if self.bias_k is not None and self.bias_v is not None:
            k = torch.cat([k, self.bias_k.view(1, 1, self.num_kv_heads, self.head_dim)
                           .expand(bsz, 1, -1, -1)], dim=1)
            v = torch.cat([v, self.bias_v.view(1, 1, self.num_kv_heads, self.head_dim)
                           .expand(bsz, 1, -1, -1)], dim=1)
            extra_keys += 1
        elif self.bias_k is not None or self.bias_v is not None:
            raise ValueError("bias_k, bias_v: both or neither must be set")
        if self.add_zero_attn:
            zeros = k.new_zeros((bsz, 1, self.num_kv_heads, self.head_dim))
            k = torch.cat([k, zeros], dim=1)
            v = torch.cat([v, zeros], dim=1)
            extra_keys += 1
        mask, bias = self._fmha_masks(attn_mask, key_padding_mask, bsz, extra_keys)

        out = attention(q, k, v, causal=causal, alignment="top_left", bias=bias, mask=mask,
                        dropout_p=self.dropout if self.training else 0.0)
        out = gate_heads(self, out)  # head-importance gates, when fmha.nn.head_importance set them
        out = out.flatten(2)                                 # (N, L, H·d)
        if seq_first:
            # The projection writes a contiguous (L, N, E) result, the layout torch returns.
            out = out.transpose(0, 1)
        out = self.out_proj(out)
        if not is_batched:
            out = out.squeeze(1)

        weights = None
        if need_weights:
            weights = self._weights(q, k, mask, bias, average_attn_weights)
            if not is_batched:
                weights = weights.squeeze(0)
        return out, weights

    def _check_shapes(self, query, key, value, key_padding_mask, attn_mask) -> bool:
        """torch's _mha_shape_check, plus the feature sizes; returns whether batched."""
        for name, x in (("query", query), ("key", key), ("value", value)):
            if not isinstance(x, Tensor):
                raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        if query.dim() not in (2, 3):
            raise ValueError(f"query: expected an unbatched 2-D or batched 3-D tensor, got "
                             f"shape {tuple(query.shape)}")
        is_batched = query.dim() == 3
        kind = "batched (3-D)" if is_batched else "unbatched (2-D)"
        if key.dim() != query.dim() or value.dim() != query.dim():
            raise ValueError(f"key, value: for {kind} query expected {query.dim()}-D key and "
                             f"value, got {key.dim()}-D and {value.dim()}-D")
        if key_padding_mask is not None and key_padding_mask.dim() != query.dim() - 1:
            raise ValueError(f"key_padding_mask: for {kind} query expected None or "
                             f"{query.dim() - 1}-D, got shape {tuple(key_padding_mask.shape)}")
        if attn_mask is not None and attn_mask.dim() not in (2, 3):
            raise ValueError(f"attn_mask: expected None, 2-D or 3-D, got shape "
                             f"{tuple(attn_mask.shape)}")
        for name, x, feat in (("query", query, self.embed_dim), ("key", key, self.kdim),
                              ("value", value, self.vdim)):
            if x.shape[-1] != feat:
                raise ValueError(f"{name}: expected {feat} features (last dimension), got "
                                 f"shape {tuple(x.shape)}")
        if key.shape[:-1] != value.shape[:-1]:
            raise ValueError(f"key, value: sequence and batch dimensions "
                             f"{tuple(key.shape[:-1])} and {tuple(value.shape[:-1])} differ")
        batch_dim = 0 if self.batch_first else 1
        if is_batched and key.shape[batch_dim] != query.shape[batch_dim]:
            raise ValueError(f"key: batch size {key.shape[batch_dim]} differs from query's "
                             f"{query.shape[batch_dim]}")
        if key_padding_mask is not None:
            want = tuple(key.shape[:-1]) if not is_batched else (
                (key.shape[0], key.shape[1]) if self.batch_first else (key.shape[1], key.shape[0]))
            if tuple(key_padding_mask.shape) != want:
                raise ValueError(f"key_padding_mask: expected shape {want} (batch, source "
                                 f"length), got {tuple(key_padding_mask.shape)}")
        return is_batched

    def _check_attn_mask(self, attn_mask: Tensor, bsz: int, tgt_len: int,
                         src_len: int) -> Tensor:
        """attn_mask as (1 | N, 1 | H, L, S), torch's 2-D / 3-D shapes checked."""
        if attn_mask.dim() == 2:
            if tuple(attn_mask.shape) != (tgt_len, src_len):
                raise ValueError(f"attn_mask: 2-D shape {tuple(attn_mask.shape)}, expected "
                                 f"{(tgt_len, src_len)}")
            return attn_mask.view(1, 1, tgt_len, src_len)
        want = (bsz * self.num_heads, tgt_len, src_len)
        if tuple(attn_mask.shape) != want:
            raise ValueError(f"attn_mask: 3-D shape {tuple(attn_mask.shape)}, expected {want} "
                             f"(batch * num_heads, target length, source length)")
        # torch's 3-D layout is batch-major: row b * num_heads + h.
        return attn_mask.view(bsz, self.num_heads, tgt_len, src_len)

    def _project(self, query: Tensor, key: Tensor, value: Tensor, self_attention: bool,
                 kv_shared: bool) -> Tuple[Tensor, Tensor, Tensor]:
        """The input projections, in the inputs' layout; one GEMM where torch does one."""
        F = torch.nn.functional
        q_dim, kv_dim = self._proj_dims()
        sizes = [q_dim, kv_dim, kv_dim]
        b = self.in_proj_bias
        bq, bk, bv = (None,) * 3 if b is None else b.split(sizes)
        if not self._qkv_same_embed_dim:
            return (F.linear(query, self.q_proj_weight, bq),
                    F.linear(key, self.k_proj_weight, bk),
                    F.linear(value, self.v_proj_weight, bv))
        w = self.in_proj_weight
        if self_attention:
            return F.linear(query, w, b).split(sizes, dim=-1)
        wq, wk, wv = w.split(sizes)
        if kv_shared:
            k, v = F.linear(key, w[q_dim:], None if b is None else b[q_dim:]).split(
                sizes[1:], dim=-1)
            return F.linear(query, wq, bq), k, v
        return F.linear(query, wq, bq), F.linear(key, wk, bk), F.linear(value, wv, bv)

    def _fmha_masks(self, attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor],
                    bsz: int, extra_keys: int) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        """torch's masks (True = blocked / additive) as fmha's (mask: True = may attend,
        bias: additive), padded for the extra key positions, broadcastable to (N, H, L, S)."""
        parts = []
        if attn_mask is not None:
            parts.append(attn_mask)                             # (1|N, 1|H, L, S)
        if key_padding_mask is not None:
            parts.append(key_padding_mask[:, None, None, :])    # (N, 1, 1, S)
        mask = bias = None
        for m in parts:
            if extra_keys:
                # The appended bias_kv / zero positions are visible to every query.
                m = torch.nn.functional.pad(m, (0, extra_keys), value=False if
                                            m.dtype == torch.bool else 0.0)
            if m.dtype == torch.bool:
                allowed = ~m
                mask = allowed if mask is None else mask & allowed
            else:
                bias = m if bias is None else bias + m
        return mask, bias

    def _weights(self, q: Tensor, k: Tensor, mask: Optional[Tensor], bias: Optional[Tensor],
                 average: bool) -> Tensor:
        """softmax(q kᵀ · scale + bias, masked) per head, explicitly: (N, H, L, S)."""
        bsz, tgt_len, _, head_dim = q.shape
        group = self.num_heads // self.num_kv_heads
        # Grouped heads: query head h reads kv head h // group, without repeating k.
        qg = q.unflatten(2, (self.num_kv_heads, group)) * head_dim ** -0.5
        scores = torch.einsum("blhgd,bshd->bhgls", qg, k).flatten(1, 2)
        if bias is not None:
            scores = scores + bias.to(scores.dtype)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        # A row with no visible key gets zero weights (as fmha's output), not NaN: scoring it
        # 0 before the softmax keeps NaN out of the backward too.
        dead = (scores == float("-inf")).all(dim=-1, keepdim=True)
        weights = torch.softmax(scores.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
        return weights.mean(dim=1) if average else weights

    # ------------------------------------------------------------------------- pruning

    @torch.no_grad()
    def prune_heads(self, heads: Iterable[int]) -> None:
        """Remove attention heads physically from the projections (Michel et al., "Are
        Sixteen Heads Really Better than One?", 2019).

        Args:
            heads: indices of heads to remove, numbered as at construction (so repeated calls
                compose; indices pruned before are ignored).

        The rows of the query (and, per removed kv head, key/value) projections, their
        biases, ``bias_k``/``bias_v`` and the matching columns of ``out_proj.weight`` are
        deleted: the module gets smaller and faster, and computes exactly what it computed
        with those heads' outputs zeroed. ``num_heads`` (and ``num_kv_heads``) shrink;
        ``embed_dim`` does not. With grouped kv heads, a kv head goes when all its query
        heads go, and every kv head that remains must keep the same number of query heads.
        At least one head must remain. New Parameter objects replace the old ones (rebuild
        the optimizer), and the state_dict shapes change: to load a pruned checkpoint, prune
        a fresh module the same way first.
        """
        orig = self.num_heads + len(self.pruned_heads)
        wanted = set()
        for h in heads:
            try:
                i = operator.index(h)
            except TypeError:
                raise TypeError(f"heads: expected ints, got {h!r}") from None
            if isinstance(h, bool) or not 0 <= i < orig:
                raise ValueError(f"heads: expected head indices in [0, {orig}), got {h!r}")
            wanted.add(i)
        heads = wanted
        heads -= self.pruned_heads
        if not heads:
            return
        current = [h for h in range(orig) if h not in self.pruned_heads]
        keep_q = [i for i, h in enumerate(current) if h not in heads]
        if not keep_q:
            raise ValueError("heads: pruning every head is not supported; at least one must "
                             "remain")
        group = self.num_heads // self.num_kv_heads
        per_kv = {}
        for i in keep_q:
            per_kv.setdefault(i // group, []).append(i)
        counts = {len(v) for v in per_kv.values()}
        if len(counts) != 1:
            raise ValueError(f"heads: with {self.num_kv_heads} kv heads of {group} query heads "
                             f"each, every kv head that remains must keep the same number of "
                             f"query heads; pruning {sorted(heads)} leaves "
                             f"{[len(per_kv.get(j, [])) for j in range(self.num_kv_heads)]}")
        keep_kv = sorted(per_kv)

        d = self.head_dim
        rows = lambda idx: torch.cat([torch.arange(i * d, (i + 1) * d) for i in idx])
        dev = self.out_proj.weight.device
        q_rows, kv_rows = rows(keep_q).to(dev), rows(keep_kv).to(dev)
        q_dim, kv_dim = self._proj_dims()
        packed = torch.cat([q_rows, q_dim + kv_rows, q_dim + kv_dim + kv_rows])
        param = lambda old, t: Parameter(t.clone(), requires_grad=old.requires_grad)

        if self._qkv_same_embed_dim:
            self.in_proj_weight = param(self.in_proj_weight, self.in_proj_weight[packed])
        else:
            self.q_proj_weight = param(self.q_proj_weight, self.q_proj_weight[q_rows])
            self.k_proj_weight = param(self.k_proj_weight, self.k_proj_weight[kv_rows])
            self.v_proj_weight = param(self.v_proj_weight, self.v_proj_weight[kv_rows])
        if self.in_proj_bias is not None:
            self.in_proj_bias = param(self.in_proj_bias, self.in_proj_bias[packed])
        if self.bias_k is not None:
            self.bias_k = param(self.bias_k, self.bias_k[..., kv_rows])
            self.bias_v = param(self.bias_v, self.bias_v[..., kv_rows])
        self.out_proj.weight = param(self.out_proj.weight, self.out_proj.weight[:, q_rows])
        self.out_proj.in_features = len(keep_q) * d
        self.num_heads = len(keep_q)
        self.num_kv_heads = len(keep_kv)
        self.pruned_heads |= heads
