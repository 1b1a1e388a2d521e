"""Adapters that plug fmha into other libraries' attention hooks.

Each adapter lives in its own submodule and imports its library only when that submodule is
imported, so none of them is a dependency of fmha:

* :mod:`fmha.integrations.transformers`: ``attn_implementation="fmha"`` for Hugging Face
  transformers models.
"""

__all__ = []  # the adapters are the submodules; importing one loads its library
