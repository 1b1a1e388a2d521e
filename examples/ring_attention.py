"""Ring attention across processes: a sequence longer than one process may hold.

    torchrun --nproc-per-node 2 examples/ring_attention.py                  # CPU, Gloo
    torchrun --nproc-per-node 8 examples/ring_attention.py --backend nccl   # one GPU a rank

1. The long run. A causal sequence of --seqlen tokens (GQA: --heads query heads sharing
   --kv-heads key/value heads) would need at least W bytes in one process: its q, k, v, out,
   lse and the gradients dout, dq, dk, dv. The per-process budget --memory-cap-mib defaults to
   80% of W, so one process cannot run it. Each rank generates only its own shard (zigzag
   layout), runs fmha.distributed.ring_attention forward and backward, and measures its peak
   memory (CPU: the growth of the process's peak resident set over the run; GPU: torch's peak
   allocation), which must stay under the cap.
2. The check. On a short sequence every rank also computes the whole attention with
   fmha.attention; the ring's output, lse and gradients must match it within 1e-5 (float32).

Exits with 0 when both hold, 1 otherwise; rank 0 prints the numbers.
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import sys
import time

import torch
import torch.distributed as dist

import fmha
from fmha import distributed as fd


def _rss_bytes() -> int:
    """This process's resident set now (Linux), in bytes."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _return_freed_memory() -> None:
    """glibc: serve every allocation of 64 KiB or more by mmap and unmap it when freed, so
    the resident set follows the live tensors (by default glibc's threshold grows after large
    frees and keeps freed blocks mapped, and the peak would count them)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def _reset_peak_rss() -> bool:
    """Linux: start the resident set's high-water mark (VmHWM) anew from now, so that the
    peak measured below is the long run's and not an earlier one (an import's, the warm-up's)
    that the process has since freed. False where the kernel does not offer it."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _peak_rss_bytes(reset: bool) -> int:
    """The process's peak resident set since _reset_peak_rss (reset), or since it started."""
    if reset:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _shard_of(shape, seed, rank, world, device, dtype):
    """This rank's zigzag shard of a whole (batch, seqlen, heads, dim) tensor that is never
    built: each of the 2P chunks is drawn from its own seed."""
    b, n, h, d = shape
    c = n // (2 * world)
    parts = []
    for chunk in (rank, 2 * world - 1 - rank):
        g = torch.Generator().manual_seed(seed * 1000 + chunk)
        parts.append(torch.randn(b, c, h, d, generator=g).to(device=device, dtype=dtype))
    return torch.cat(parts, 1)


def long_run(a, rank, world, device, dtype):
    b, n, hq, hkv, d = 1, a.seqlen, a.heads, a.kv_heads, a.head_dim
    item = torch.empty(0, dtype=dtype).element_size()
    whole = b * n * d * item * (4 * hq + 4 * hkv) + b * hq * n * 4
    cap = (a.memory_cap_mib * 2**20 if a.memory_cap_mib else int(0.8 * whole))
    # Warm up on a short sequence first, called as the long run is (backward given a
    # gradient: torch.autograd imports sympy on that path's first use, ~30 MiB), so that
    # one-time set-up (imports, thread pools, buffers of the process group) is not counted.
    w = [torch.randn(1, 16 * world, h, d, device=device, dtype=dtype, requires_grad=True)
         for h in (hq, hkv, hkv)]
    w_out = fd.ring_attention(*w, causal=True)
    w_out.backward(torch.ones_like(w_out))
    del w, w_out
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    else:
        base = _rss_bytes()
        reset = _reset_peak_rss()
    t0 = time.perf_counter()
    q, k, v, dout = (_shard_of((b, n, h, d), seed, rank, world, device, dtype)
                     for seed, h in ((1, hq), (2, hkv), (3, hkv), (4, hq)))
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    out = fd.ring_attention(q, k, v, causal=True)
    out.backward(dout)
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(device) - base
    else:
        peak = _peak_rss_bytes(reset) - base
    seconds = time.perf_counter() - t0
    peaks = torch.tensor([peak], dtype=torch.int64, device=device)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    worst = int(peaks.item())
    if rank == 0:
        mib = lambda x: f"{x / 2**20:.1f} MiB"  # noqa: E731
        print(f"long run: causal, {n} tokens, {hq} query heads / {hkv} kv heads, head_dim {d}, "
              f"{str(dtype).replace('torch.', '')}, {world} ranks ({seconds:.1f} s)")
        print(f"  one process would need at least {mib(whole)} for the whole sequence's "
              f"tensors; the cap is {mib(cap)}")
        print(f"  largest per-rank peak (forward + backward): {mib(worst)} "
              f"({worst / whole:.0%} of the whole)")
    return whole > cap and worst <= cap


def check(a, rank, world, device):
    g = torch.Generator().manual_seed(7)
    n = 64 * world
    q = torch.randn(2, n, 4, 16, generator=g).to(device)
    k = torch.randn(2, n, 2, 16, generator=g).to(device)
    v = torch.randn(2, n, 2, 16, generator=g).to(device)
    dout = torch.randn(2, n, 4, 16, generator=g).to(device)
    errors = {}

    def grads(fn, *xs):
        xs = [x.detach().clone().requires_grad_() for x in xs]
        out, lse = fn(*xs)
        (out * dout_of(out)).sum().backward()
        return [out.detach(), lse.detach()] + [x.grad for x in xs]

    dout_of = lambda out: dout  # noqa: E731
    want = grads(lambda *x: fmha.attention(*x, causal=True, return_lse=True), q, k, v)
    shard = lambda x, dim=1: fd.shard_sequence(x, dim=dim)  # noqa: E731
    dout_of = lambda out: shard(dout)  # noqa: E731
    got = grads(lambda *x: fd.ring_attention(*x, causal=True, return_lse=True),
                shard(q), shard(k), shard(v))
    for name, g_, w, dim in zip(("out", "lse", "dq", "dk", "dv"), got, want, (1, 2, 1, 1, 1)):
        w = shard(w, dim)
        errors[name] = ((g_ - w).abs().max() / w.abs().max().clamp(min=1.0)).item()
    worst = torch.tensor([max(errors.values())], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"check: {n} tokens, ring vs single-process fmha.attention, largest relative "
              f"error over out, lse, dq, dk, dv and ranks: {worst.item():.2e}")
    return worst.item() <= 1e-5


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--memory-cap-mib", type=float, default=None,
                    help="per-process budget (default: 80%% of the whole sequence's tensors)")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per rank")
    a = ap.parse_args(argv)
    dist.init_process_group(a.backend, timeout=datetime.timedelta(minutes=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    if a.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        _return_freed_memory()
        torch.set_num_threads(a.threads)
        fmha.set_num_threads(a.threads)
    if a.seqlen % (2 * world):
        ap.error(f"--seqlen must split into {2 * world} equal chunks")
    if rank == 0:
        from fmha.bench import cpu_model
        where = (torch.cuda.get_device_name(device) if device.type == "cuda" else
                 f"{cpu_model()}, {a.threads} thread(s) a rank")
        print(f"host: {where}; {a.backend}, {world} ranks; torch {torch.__version__}, "
              f"fmha {fmha.__version__}")
    ok_long = long_run(a, rank, world, device, getattr(torch, a.dtype))
    ok_check = check(a, rank, world, device)
    dist.barrier()  # nobody tears the group down while another rank still uses it
    dist.destroy_process_group()
    if rank == 0:
        print("PASS" if ok_long and ok_check else
              f"FAIL (long run under the cap: {ok_long}, check: {ok_check})")
    return 0 if ok_long and ok_check else 1


if __name__ == "__main__":
    sys.exit(main())
