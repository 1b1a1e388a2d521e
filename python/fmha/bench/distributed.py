"""python -m fmha.bench --distributed: how attention split over processes scales on this host.

For P = 1, 2 (``--worlds``) processes of one thread each (a Gloo group over loopback TCP), each
case runs single-process fmha.attention on the whole sequence (P = 1) and ring attention
(zigzag and contiguous layouts) and Ulysses on P shards, forward and forward+backward. A
step's time is the slowest rank's (an all-reduce of each rank's time, max); the median over
``--reps`` steps is reported, and

    scaling efficiency = T(single process, whole sequence) / (P x T(P ranks))

so 1.0 is ideal: P ranks finish in 1/P of the time. Also recorded: the bytes each rank sends
per ring step and per call, the time of one ring transfer alone (Gloo over loopback) and of
one block's attention alone: the two sides of docs/cpu_kernels.md's model of when the ring's
communication hides behind compute.
"""

from __future__ import annotations

import datetime
import os
import statistics
import time

# name, batch, whole seqlen, heads_q, heads_kv, head_dim, causal
CASES = [
    ("causal-b1h8-n4096-d64", 1, 4096, 8, 8, 64, True),
    ("full-b1h8-n4096-d64", 1, 4096, 8, 8, 64, False),
    ("causal-gqa-b1h8kv2-n4096-d64", 1, 4096, 8, 2, 64, True),
]
QUICK_CASES = [("causal-b1h4-n512-d32", 1, 512, 4, 4, 32, True)]
SCHEMES = ("ring zigzag", "ring contiguous", "ulysses")


def _timed(fn, world, reps):
    """Median over reps of the slowest rank's seconds for fn (after one warm-up)."""
    import torch
    import torch.distributed as dist
    fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        if world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(t.item())
    return statistics.median(times)


def _rank_main(rank, world, port, cases, dtypes, reps, queue):
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        import fmha
        from fmha import distributed as fd
        fmha.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=600))
        rows = []
        for name, b, n, hq, hkv, d, causal in cases:
            for dtype_name in dtypes:
                dtype = getattr(torch, dtype_name)
                g = torch.Generator().manual_seed(0)
                whole = [torch.randn(b, n, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv)]
                dout_whole = torch.randn(b, n, hq, d, generator=g).to(dtype)
                for scheme in (("single",) if world == 1 else SCHEMES):
                    if scheme == "ulysses" and (hq % world or hkv % world):
                        continue
                    layout = "contiguous" if scheme != "ring zigzag" else "zigzag"
                    if scheme == "single":
                        q, k, v, dout = whole + [dout_whole]
                        call = lambda q, k, v: fmha.attention(q, k, v, causal=causal)  # noqa
                    else:
                        q, k, v, dout = (fd.shard_sequence(x, layout=layout).contiguous()
                                         for x in whole + [dout_whole])
                        fn = fd.ring_attention if scheme.startswith("ring") else \
                            fd.ulysses_attention
                        call = (lambda fn, layout: lambda q, k, v: fn(  # noqa: E731
                            q, k, v, causal=causal, layout=layout, check=False))(fn, layout)
                    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]

                    def fwd():
                        with torch.no_grad():
                            call(q, k, v)

                    def fwd_bwd():
                        call(*leaves).backward(dout)

                    for pass_name, fn_ in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
                        rows.append(dict(case=name, dtype=dtype_name, scheme=scheme,
                                         world=world, pass_=pass_name,
                                         seconds=_timed(fn_, world, reps)))
                if world > 1:
                    rows += _ring_parts(rank, world, name, b, n, hq, hkv, d, dtype, reps)
        dist.barrier()
        dist.destroy_process_group()
        queue.put((rank, rows if rank == 0 else None, None))
    except Exception:
        import traceback
        queue.put((rank, None, traceback.format_exc()))


def _ring_parts(rank, world, name, b, n, hq, hkv, d, dtype, reps):
    """One ring transfer alone and one block's attention alone, at this case's shard size."""
    import torch
    import torch.distributed as dist
    import fmha
    nl = n // world
    k = torch.randn(b, nl, hkv, d).to(dtype)
    v = torch.randn(b, nl, hkv, d).to(dtype)
    q = torch.randn(b, nl, hq, d).to(dtype)
    nxt, prv = (rank + 1) % world, (rank - 1) % world

    def transfer():
        bufs = [torch.empty_like(k), torch.empty_like(v)]
        ops = [dist.P2POp(dist.isend, k, nxt), dist.P2POp(dist.isend, v, nxt),
               dist.P2POp(dist.irecv, bufs[0], prv), dist.P2POp(dist.irecv, bufs[1], prv)]
        for r in dist.batch_isend_irecv(ops):
            r.wait()

    def block():
        with torch.no_grad():
            fmha.attention(q, k, v)

    sent = 2 * k.numel() * k.element_size()
    return [dict(case=name, dtype=str(dtype).replace("torch.", ""), scheme="ring parts",
                 world=world, pass_="transfer", seconds=_timed(transfer, world, reps),
                 bytes=sent),
            dict(case=name, dtype=str(dtype).replace("torch.", ""), scheme="ring parts",
                 world=world, pass_="block fwd (full, n/P x n/P)",
                 seconds=_timed(block, world, reps))]


def _launch(world, cases, dtypes, reps):
    import multiprocessing as mp
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, cases, dtypes, reps, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    rows, errors = None, []
    for _ in range(world):
        rank, r, err = queue.get(timeout=3600)
        if err:
            errors.append(f"rank {rank}: {err}")
        if r is not None:
            rows = r
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.terminate()
    if errors:
        raise RuntimeError("\n".join(errors))
    return rows


def _comm_bytes(b, n, hkv, d, itemsize, world):
    """Bytes one rank sends per ring step (K and V shards) and per call, forward and
    backward (the backward sends K, V again and float32 dK, dV once more per step)."""
    step = 2 * b * (n // world) * hkv * d * itemsize
    dkv = 2 * b * (n // world) * hkv * d * 4
    return dict(step_fwd=step, fwd=(world - 1) * step,
                fwd_bwd=2 * (world - 1) * step + world * dkv)


def run(dtypes, out=None, worlds=(1, 2), reps=5, quick=False, save=None):
    import torch
    import fmha
    from ._host import host_meta, write_result
    cases = QUICK_CASES if quick else CASES
    rows = []
    for world in worlds:
        print(f"P = {world}: {world} process(es), 1 thread each ...", flush=True)
        rows += _launch(world, cases, dtypes, reps)
    single = {(r["case"], r["dtype"], r["pass_"]): r["seconds"] for r in rows
              if r["scheme"] == "single"}
    for r in rows:
        t1 = single.get((r["case"], r["dtype"], r["pass_"]))
        if t1 and r["scheme"] not in ("single", "ring parts"):
            r["efficiency"] = t1 / (r["world"] * r["seconds"])
    itemsize = {name: torch.empty(0, dtype=getattr(torch, name)).element_size()
                for name in dtypes}
    comm = {f"{c[0]} {dt} P={w}": _comm_bytes(c[1], c[2], c[4], c[5], itemsize[dt], w)
            for c in cases for dt in dtypes for w in worlds if w > 1}
    print(f"\n{'case':32} {'dtype':9} {'scheme':16} {'P':>2} {'pass':8} {'ms':>9} "
          f"{'efficiency':>10}")
    for r in rows:
        if r["scheme"] == "ring parts":
            continue
        eff = f"{r['efficiency']:.2f}" if "efficiency" in r else ""
        print(f"{r['case']:32} {r['dtype']:9} {r['scheme']:16} {r['world']:>2} {r['pass_']:8} "
              f"{r['seconds'] * 1e3:9.2f} {eff:>10}")
    print("\nring parts (one step of the ring, alone):")
    for r in rows:
        if r["scheme"] == "ring parts":
            extra = (f", {r['bytes'] / 2**20:.2f} MiB -> {r['bytes'] / r['seconds'] / 1e9:.2f} "
                     f"GB/s" if "bytes" in r else "")
            print(f"  {r['case']} {r['dtype']} P={r['world']} {r['pass_']}: "
                  f"{r['seconds'] * 1e3:.2f} ms{extra}")
    print("\nbytes sent per rank:", comm)
    result = dict(meta=host_meta(torch, fmha), threads_per_rank=1, reps=reps,
                  efficiency="T(single process, whole) / (P x T(P ranks, slowest rank))",
                  rows=[{("pass" if k == "pass_" else k): v for k, v in r.items()}
                        for r in rows],
                  comm_bytes_per_rank=comm)
    write_result(result, out, save)
    return result
