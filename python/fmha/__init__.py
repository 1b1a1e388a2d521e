"""fmha: fused multi-head attention.

Exact scaled-dot-product attention, forward and backward, computed FlashAttention-2 style
(tiled, online softmax, O(n) memory) by hand-written C++ kernels, for torch tensors (with
autograd and torch.compile) and NumPy arrays.

    import fmha
    out = fmha.attention(q, k, v, causal=True)      # q: (batch, seqlen, heads, head_dim)

See ``fmha.attention`` for the arguments and ``fmha.reference`` for the exact semantics.
"""

import sys as _sys

from . import _C
from ._api import attention, attention_backward, attention_varlen, attention_varlen_backward
from ._core import get_num_threads, set_num_threads
from .block_mask import (BlockMask, bigbird_mask, create_block_mask, document_mask,
                         longformer_mask)
from .merge import merge_states, merge_states_n

__version__ = "0.1.0"

__all__ = ["attention", "attention_varlen", "attention_backward", "attention_varlen_backward",
           "merge_states", "merge_states_n", "set_num_threads", "BlockMask",
           "create_block_mask", "document_mask", "longformer_mask", "bigbird_mask",
           "get_num_threads", "backends", "cpu_isa", "cpu_features", "cuda_status"]


def backends() -> list:
    """Backends usable in this process: always "cpu"; "cuda" when built with CUDA and a GPU
    is present."""
    out = ["cpu"]
    if _C.cuda_built() and _C.cuda_device_count() > 0:
        out.append("cuda")
    return out


def cpu_isa() -> str:
    """Instruction set of the CPU kernels in use: "avx512bf16" (AVX-512 with bfloat16 dot
    products), "avx512", "avx2" or "scalar" (set FMHA_CPU_ISA to force a lower one)."""
    return _C.cpu_isa()


def cpu_features() -> list:
    """CPU features the kernels care about, as detected at run time."""
    return list(_C.cpu_features())


def cuda_status() -> str:
    """Why there is no GPU, or which GPUs were found."""
    return _C.cuda_status()


# The torch operators are registered as soon as torch is around, so that a first call inside
# torch.compile finds them already defined.
if "torch" in _sys.modules:
    from . import _torch  # noqa: F401


def __getattr__(name):
    # torch is an optional dependency: the torch-only parts load on first use, so that
    # `import fmha` works (and stays light) for NumPy users.
    if name == "scaled_dot_product_attention":
        from .sdpa import scaled_dot_product_attention
        # Kept as a module attribute: later lookups are plain ones, not this call (a layer
        # loop looks it up once per call).
        globals()[name] = scaled_dot_product_attention
        return scaled_dot_product_attention
    if name in ("nn", "integrations", "distributed"):
        import importlib
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
