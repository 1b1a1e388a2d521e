"""fmha: fused multi-head attention.

Exact scaled-dot-product attention, forward and backward, computed FlashAttention-2 style
(tiled, online softmax, O(n) memory) by hand-written C++ kernels, for torch tensors (with
autograd and torch.compile) and NumPy arrays.

    import fmha
    out = fmha.attention(q, k, v, causal=True)      # q: (batch, seqlen, heads, head_dim)

Every public name is in ``fmha.__all__`` and in exactly one public module, its home; docs/api.md
lists them. The feature modules load on first use (``_LAZY`` below), so ``import fmha`` needs
neither torch nor anything else beyond NumPy. See ``fmha.attention`` for the arguments and
``fmha.reference`` for the exact semantics.
"""

import importlib as _importlib
import sys as _sys
from importlib.util import find_spec as _find_spec

from . import _C
from ._api import attention, attention_backward, attention_varlen, attention_varlen_backward
from ._core import get_num_threads, set_num_threads

__version__ = "0.1.0"

#: The names defined outside this file, each mapped to its home module (relative to fmha).
#: A name equal to its module's last part is that module itself (``fmha.nn``). Nothing here is
#: imported until first looked up, which keeps ``import fmha`` light and torch-free.
_LAZY = {
    # KV caches (NumPy and torch)
    "attention_with_kvcache": ".kvcache",
    "PagedKVCache": ".kvcache",
    "check_refused": ".kvcache",
    # merging partial attentions (NumPy and torch)
    "merge_states": ".merge",
    "merge_states_n": ".merge",
    # block-sparse masks (NumPy)
    "BlockMask": ".block_mask",
    "create_block_mask": ".block_mask",
    "causal_mask": ".block_mask",
    "document_mask": ".block_mask",
    "longformer_mask": ".block_mask",
    "bigbird_mask": ".block_mask",
    # torch only
    "scaled_dot_product_attention": ".sdpa",
    "MultiheadAttention": ".nn",
    "head_importance": ".nn",
    "heads_to_prune": ".nn",
    "prune_heads": ".nn",
    "ring_attention": ".distributed",
    "ulysses_attention": ".distributed",
    "shard_sequence": ".distributed",
    "gather_sequence": ".distributed",
    "TensorParallelMultiheadAttention": ".distributed",
    # public submodules
    "kvcache": ".kvcache",
    "merge": ".merge",
    "block_mask": ".block_mask",
    "kvquant": ".kvquant",
    "reference": ".reference",
    "sdpa": ".sdpa",
    "nn": ".nn",
    "distributed": ".distributed",
    "integrations": ".integrations",
}

#: The modules whose names need torch.
_NEEDS_TORCH = (".sdpa", ".nn", ".distributed")

__all__ = [
    # attention (home: fmha)
    "attention", "attention_varlen", "attention_backward", "attention_varlen_backward",
    # the machine (home: fmha)
    "set_num_threads", "get_num_threads", "backends", "cpu_isa", "cpu_features", "cuda_status",
] + [name for name, module in _LAZY.items()
     if module != "." + name and module not in _NEEDS_TORCH]
# The torch-only names are public where torch is installed (asked of the import system, which
# does not import torch), so that `from fmha import *` works for NumPy users too.
if _find_spec("torch") is not None:
    __all__ += [name for name, module in _LAZY.items()
                if module != "." + name and module in _NEEDS_TORCH]


def backends() -> list:
    """Backends usable in this process: always "cpu"; "cuda" when built with CUDA and a GPU
    is present."""
    out = ["cpu"]
    if _C.cuda_built() and _C.cuda_device_count() > 0:
        out.append("cuda")
    return out


def cpu_isa() -> str:
    """Instruction set of the CPU kernels in use: "amx" (AVX512-BF16 plus AMX bfloat16 tiles),
    "avx512bf16" (AVX-512 with bfloat16 dot products), "avx512", "avx2" or "scalar" (set
    FMHA_CPU_ISA to force a lower one, or "amx" on any AVX512-BF16 CPU: its tiles then run
    through a software model)."""
    return _C.cpu_isa()


def cpu_features() -> list:
    """CPU features the kernels care about, as detected at run time."""
    return list(_C.cpu_features())


def cuda_status() -> str:
    """Why there is no GPU, or which GPUs were found."""
    return _C.cuda_status()


# The torch operators are registered as soon as torch is around, so that a first call inside
# torch.compile finds them already defined.
if _sys.modules.get("torch") is not None:
    from . import _torch  # noqa: F401


def __getattr__(name):
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        module = _importlib.import_module(module_name, __name__)
    except ModuleNotFoundError as e:
        if e.name in ("torch", "transformers"):
            raise ImportError(f"fmha.{name} needs {e.name}, which is not installed") from e
        raise
    value = module if module_name == "." + name else getattr(module, name)
    # Kept as a module attribute: later lookups are plain ones, not this call (a layer loop
    # looks fmha.scaled_dot_product_attention up once per call).
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
