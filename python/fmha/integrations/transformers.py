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
in no other implementation). Not supported: ``output_attentions=True`` gets ``None`` for
the weights (fmha never forms them); there is no paged-attention / paged KV-cache path
(only the models' own dense caches, passed as K/V).

transformers is imported here and only here: ``import fmha`` does not need it.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .. import _heads
from .._api import attention

__all__ = ["NAME", "fmha_attention_forward", "register"]

#: The name under which :func:`register` makes fmha available by default.
NAME = "fmha"


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
            become fmha's ``sinks``; everything else models pass (``position_ids``,
            ``sliding_window``, ...) is ignored, as by ``"sdpa"``: sliding windows are
            already in the mask.

    Returns:
        ``(attn_output, None)``: ``(batch, seqlen_q, heads_q, head_dim_v)``, contiguous
        (the layout transformers expects), and no attention weights.
    """
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = kwargs.get("sinks")
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
    ``name="fmha"``; call again to add another name). Idempotent."""
    AttentionInterface.register(name, fmha_attention_forward)
    # The boolean "True = may attend" masks built for "sdpa" are fmha's convention, and
    # sdpa_mask returns None for plain causal batches, letting fmha skip the mask.
    AttentionMaskInterface.register(name, sdpa_mask)


register()
