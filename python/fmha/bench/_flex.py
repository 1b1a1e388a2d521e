"""PyTorch FlexAttention as fmha's benchmarks run it (python -m fmha.bench, --sparse): compiled
once per shape, dtype and mask, and never the eager fallback."""

from __future__ import annotations


def compiled_flex(torch):
    """(torch.compile(flex_attention, dynamic=False, fullgraph=True), create_block_mask, ""),
    or (None, None, why) where this torch has no FlexAttention. fullgraph means a Flex time
    is the compiled kernel's or an error, never the eager fallback's."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        return torch.compile(flex_attention, dynamic=False, fullgraph=True), create_block_mask, ""
    except Exception as e:  # noqa: BLE001 - recorded in the result file
        return None, None, f"{type(e).__name__}: {e}"


def dynamo_compiles_allowed(torch, n: int = 64):
    """A context in which dynamo may compile n variants (one per shape, dtype and mask) and
    fails rather than falling back to eager past that."""
    settings = {k: v for k, v in (("recompile_limit", n), ("fail_on_recompile_limit_hit", True))
                if hasattr(torch._dynamo.config, k)}
    return torch._dynamo.config.patch(**settings)
