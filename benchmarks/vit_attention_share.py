"""How much of a ViT-B/16 forward (batch 8, 224x224, random weights) is spent inside its
attention calls, through transformers' "sdpa" and fmha's entry, alternated in one process
(median of 4): what an end-to-end speed-up can be at most, and whether the attention runs
as fast inside the model as alone.

    python benchmarks/vit_attention_share.py
    OMP_WAIT_POLICY=PASSIVE python benchmarks/vit_attention_share.py
"""
import statistics
import time

import torch
from transformers import ViTConfig, ViTModel, AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
import fmha.integrations.transformers as hf
spent = [0.0]
def timed(impl):
    def f(*a, **k):
        t = time.perf_counter(); r = impl(*a, **k); spent[0] += time.perf_counter() - t; return r
    return f
AttentionInterface.register("timed_sdpa", timed(sdpa_attention_forward))
AttentionInterface.register("timed_fmha", timed(hf.fmha_attention_forward))
torch.manual_seed(0)
model = ViTModel(ViTConfig(), add_pooling_layer=False).eval()
px = torch.randn(8, 3, 224, 224)
with torch.no_grad():
    for impl in ("timed_sdpa", "timed_fmha"):
        model.set_attn_implementation(impl); model(pixel_values=px)
    res = {}
    for _ in range(4):
        for impl in ("timed_sdpa", "timed_fmha"):
            model.set_attn_implementation(impl)
            spent[0] = 0.0; t = time.perf_counter(); model(pixel_values=px); tot = time.perf_counter() - t
            res.setdefault(impl, []).append((tot, spent[0]))
for impl, v in res.items():
    tot = statistics.median(x[0] for x in v); att = statistics.median(x[1] for x in v)
    print(f"{impl}: forward {tot*1e3:.0f} ms, attention calls {att*1e3:.1f} ms ({att/tot*100:.1f}%)")
