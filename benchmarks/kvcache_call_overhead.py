# Per-call time of one decode-sized call (batch 4, 8/2 heads, head_dim 32, 65 cached rows,
# one new row appended), torch CPU tensors under no_grad, 2 threads; mean of 3000 calls.
import platform, time, torch, fmha
from fmha.kvcache import attention_with_kvcache as awk
from fmha._host import cpu_model
torch.set_num_threads(2)
b, hq, hkv, d, cap = 4, 8, 2, 32, 128
q = torch.randn(b, 1, hq, d); kc = torch.zeros(b, cap, hkv, d); vc = torch.zeros(b, cap, hkv, d)
k = torch.randn(b, 1, hkv, d); v = torch.randn(b, 1, hkv, d)
lens = torch.full((b,), 64, dtype=torch.int32)
def us(f, n=3000):
    for _ in range(200): f()
    t0 = time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter() - t0) / n * 1e6
print("host:", cpu_model(), "| torch", torch.__version__, "| fmha", fmha.cpu_isa())
with torch.no_grad():
    print(f"attention_with_kvcache  {us(lambda: awk(q, kc, vc, k, v, cache_seqlens=lens, causal=True)):6.1f} us")
    print(f"fmha.attention          {us(lambda: fmha.attention(q, kc[:, :65], vc[:, :65], causal=True)):6.1f} us")
    print(f"torch SDPA              {us(lambda: torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), kc[:, :65].transpose(1, 2), vc[:, :65].transpose(1, 2), enable_gqa=True)):6.1f} us")
