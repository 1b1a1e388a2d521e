"""Compatibility module: :class:`PagedKVCache` is documented in fmha.kvcache (docs/api.md)."""

from ._paged import PagedKVCache

__all__ = ["PagedKVCache"]
