"""Attention over KV caches, for inference: :func:`attention_with_kvcache` (contiguous or
paged caches, new rows appended in place) and :class:`PagedKVCache` (a block manager for
serving several sequences from one pool, vLLM's PagedAttention).

The semantics (which rows a query sees, what is written) are in docs/semantics.md,
"KV caches"; ``fmha.reference.attention_with_kvcache`` is their executable form.
"""

from ._kvcache import attention_with_kvcache, check_refused
from ._paged import PagedKVCache

__all__ = ["attention_with_kvcache", "check_refused", "PagedKVCache"]
