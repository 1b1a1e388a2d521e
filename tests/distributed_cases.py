"""Multi-process checks of fmha.distributed (used by tests/distributed/test_distributed.py).

``launch(world, scenarios)`` starts ``world`` processes (spawned, one thread each, a Gloo group
over TCP on this host), runs the named scenarios on every rank and returns, per scenario,
every rank's outcome: "ok" or the error text. It never hangs: when a rank fails outside a
scenario or the deadline passes, the others are terminated and reported as such.

Each scenario builds the whole inputs on every rank from one seed, computes the
single-process result with fmha.attention (or fmha.nn.MultiheadAttention), runs the
distributed scheme on this rank's shard and compares outputs, lse and gradients (float32,
within 1e-5 of the largest entry).
"""

from __future__ import annotations

import datetime
import os
import socket
import time
import traceback

TOL = 1e-5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, scenarios, deadline_s: float = 240.0) -> dict:
    """{scenario: {rank: "ok" | error text}} after running the scenarios on world ranks."""
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, list(scenarios), queue))
             for r in range(world)]
    for p in procs:
        p.start()
    results = {name: {} for name in scenarios}
    finished, end = set(), time.monotonic() + deadline_s
    failed_at = None
    while len(finished) < world:
        now = time.monotonic()
        # A rank that died outside a scenario leaves the others waiting in a collective:
        # give them a moment to report, then stop them.
        if now > end or (failed_at is not None and now > failed_at + 5.0):
            break
        try:
            rank, name, outcome = queue.get(timeout=0.5)
        except Exception:  # queue.Empty; a dead process is noticed below
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = time.monotonic()
            continue
        if name is None:
            finished.add(rank)
            if outcome != "ok" and failed_at is None:
                failed_at = time.monotonic()
                results.setdefault("<worker>", {})[rank] = outcome
        else:
            results[name][rank] = outcome
    for r, p in enumerate(procs):
        if r in finished:
            p.join(30)  # it is tearing down and exiting
        if p.is_alive():
            p.terminate()
        p.join(10)
        if r not in finished:
            results.setdefault("<worker>", {})[r] = (
                f"terminated (exit code {p.exitcode}) after another rank failed or the "
                f"{deadline_s:.0f} s deadline passed")
        elif p.exitcode != 0:  # finished its scenarios, then crashed on the way out
            results.setdefault("<worker>", {})[r] = f"exit code {p.exitcode} after finishing"
    return results


def _worker(rank, world, port, scenarios, queue):
    outcome = "ok"
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                          OMP_NUM_THREADS="1")
        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        import fmha
        fmha.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        for name in scenarios:
            try:
                {**SCENARIOS, **EXTRA}[name](rank, world)
            except Exception:
                queue.put((rank, name, traceback.format_exc(limit=6)))
                # The other ranks may be waiting for this one in a collective: stop here, and
                # the launcher stops them.
                outcome = f"stopped after scenario {name!r} failed"
                break
            queue.put((rank, name, "ok"))
            dist.barrier()
        else:
            dist.destroy_process_group()
    except Exception:
        outcome = traceback.format_exc(limit=6)
    queue.put((rank, None, outcome))


# ---------------------------------------------------------------------------- checks

def _close(name, actual, expected):
    import torch
    actual, expected = actual.detach().double(), expected.detach().double()
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    finite = torch.isfinite(expected)
    assert torch.equal(torch.isinf(actual), torch.isinf(expected)), f"{name}: -inf pattern"
    err = (actual[finite] - expected[finite]).abs().max().item() if finite.any() else 0.0
    bound = TOL * max(expected[finite].abs().max().item() if finite.any() else 0.0, 1.0)
    assert err <= bound, f"{name}: max error {err:.3g} > {bound:.3g}"


def _inputs(batch=2, n=32, hq=4, hkv=2, d=16, seed=0):
    import torch
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, n, hq, d, generator=g)
    k = torch.randn(batch, n, hkv, d, generator=g)
    v = torch.randn(batch, n, hkv, d, generator=g)
    dout = torch.randn(batch, n, hq, d, generator=g)
    dlse = torch.randn(batch, hq, n, generator=g)
    return q, k, v, dout, dlse


def _grads(fn, q, k, v, dout, dlse):
    """fn(q, k, v) -> (out, lse); returns out, lse and the gradients of
    sum(out * dout) + sum(lse * dlse)."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out, lse = fn(*leaves)
    ((out * dout).sum() + (lse * dlse).sum()).backward()
    return [out, lse] + [x.grad for x in leaves]


def _sequence_scheme(scheme, layout, settings, shape=None):
    """A check of ring_attention / ulysses_attention against fmha.attention."""
    def run(rank, world):
        import torch
        import fmha
        from fmha import distributed as fd
        q, k, v, dout, dlse = _inputs(**(shape or {}))
        seed = 1234
        kw = dict(settings)
        if "alibi_slopes" in kw:
            kw["alibi_slopes"] = torch.tensor(kw["alibi_slopes"], dtype=torch.float32)

        def whole(q, k, v):
            torch.manual_seed(seed)
            return fmha.attention(q, k, v, return_lse=True, **kw)

        def split(q, k, v):
            torch.manual_seed(seed)
            fn = fd.ring_attention if scheme == "ring" else fd.ulysses_attention
            return fn(q, k, v, layout=layout, return_lse=True, **kw)

        want = _grads(whole, q, k, v, dout, dlse)
        shard = lambda x, dim=1: fd.shard_sequence(x, layout=layout, dim=dim)  # noqa: E731
        got = _grads(split, shard(q), shard(k), shard(v), shard(dout), shard(dlse, 2))
        for name, g, w, dim in zip(("out", "lse", "dq", "dk", "dv"), got, want,
                                   (1, 2, 1, 1, 1)):
            _close(name, g, shard(w, dim))
            # and gathered back, the whole result
            _close(name + " gathered", fd.gather_sequence(g.detach(), layout=layout, dim=dim),
                   w)
    return run


def _tensor_parallel(num_kv_heads, dropout=0.0, padding=False, causal=False):
    def run(rank, world):
        import torch
        import fmha.nn
        from fmha.distributed import TensorParallelMultiheadAttention
        torch.manual_seed(0)
        e, h = 64, 8
        full = fmha.nn.MultiheadAttention(e, h, dropout=dropout, batch_first=True,
                                          num_kv_heads=num_kv_heads)
        tp = TensorParallelMultiheadAttention(e, h, num_kv_heads=num_kv_heads, dropout=dropout)
        tp.load_state_dict(full.state_dict())
        x = torch.randn(2, 12, e)
        kpm = None
        if padding:
            kpm = torch.zeros(2, 12, dtype=torch.bool)
            kpm[1, 9:] = True
        dy = torch.randn(2, 12, e)
        xs = [x.clone().requires_grad_() for _ in range(2)]
        torch.manual_seed(5)
        mask = torch.nn.Transformer.generate_square_subsequent_mask(12) if causal else None
        want, _ = full(xs[0], xs[0], xs[0], key_padding_mask=kpm, need_weights=False,
                       is_causal=causal, attn_mask=mask)
        torch.manual_seed(5)
        got = tp(xs[1], key_padding_mask=kpm, causal=causal)
        (want * dy).sum().backward()
        (got * dy).sum().backward()
        _close("out", got, want)
        _close("dx", xs[1].grad, xs[0].grad)
        rows = tp._rows()
        _close("d in_proj_weight", tp.in_proj_weight.grad, full.in_proj_weight.grad[rows])
        _close("d in_proj_bias", tp.in_proj_bias.grad, full.in_proj_bias.grad[rows])
        cols = tp.local_heads * tp.head_dim
        _close("d out_proj.weight", tp.out_proj.weight.grad,
               full.out_proj.weight.grad[:, rank * cols:(rank + 1) * cols])
        _close("d out_proj.bias", tp.out_proj.bias.grad, full.out_proj.bias.grad)
    return run


def _tp_initialisation(rank, world):
    """A new tensor-parallel layer holds its rank's slices of the unsplit layer that the same
    seed gives (not copies of one slice, nor random replicated biases)."""
    import torch
    import fmha.nn
    from fmha.distributed import TensorParallelMultiheadAttention
    torch.manual_seed(11)
    full = fmha.nn.MultiheadAttention(64, 8, batch_first=True, num_kv_heads=4)
    torch.manual_seed(11)
    tp = TensorParallelMultiheadAttention(64, 8, num_kv_heads=4)
    assert torch.equal(tp.in_proj_weight, full.in_proj_weight[tp._rows()])
    assert torch.equal(tp.in_proj_bias, full.in_proj_bias[tp._rows()])
    cols = tp.local_heads * tp.head_dim
    assert torch.equal(tp.out_proj.weight, full.out_proj.weight[:, rank * cols:(rank + 1) * cols])
    assert torch.equal(tp.out_proj.bias, full.out_proj.bias)
    x = torch.randn(2, 5, 64)
    _close("out", tp(x), full(x, x, x, need_weights=False)[0])
    _expect_error(lambda: tp(x, key_padding_mask=torch.zeros(2, 5)), "key_padding_mask")
    _expect_error(lambda: tp(x, torch.randn(2, 3, 64), causal=True), "causal")


def _expect_error(fn, match):
    import re
    try:
        fn()
    except (ValueError, TypeError) as e:
        assert re.search(match, str(e)), f"error {e!r} does not match {match!r}"
        return
    raise AssertionError(f"no error (expected one matching {match!r})")


def _unequal_shards(rank, world):
    import torch
    from fmha.distributed import ring_attention
    q = torch.randn(1, 8 + 2 * rank, 2, 8)  # every rank a different length
    if world > 1:
        _expect_error(lambda: ring_attention(q, q, q), "differ between ranks .*seqlen: rank 0 8")


def _indivisible_heads(rank, world):
    import torch
    from fmha.distributed import ulysses_attention
    q = torch.randn(1, 8, 3 * world + 1, 8)
    if world > 1:  # everything divides into one share
        _expect_error(lambda: ulysses_attention(q, q, q), "multiples of")


def _unequal_settings(rank, world):
    import torch
    from fmha.distributed import ring_attention
    q = torch.randn(1, 8, 2, 8)
    if world > 1:
        _expect_error(lambda: ring_attention(q, q, q, softcap=float(rank)), "softcap: rank 0 0")


def _ring_create_graph(rank, world):
    """A gradient taken with create_graph=True is recorded, and differentiating it again fails
    loudly (the backward has no formula of its own): never a second-order gradient that is
    silently missing."""
    import torch
    from fmha.distributed import ring_attention
    q, k, v = (torch.randn(1, 8, 2, 8, requires_grad=True) for _ in range(3))
    out = ring_attention(q, k, v, causal=True)
    dq, = torch.autograd.grad(out.sum(), (q,), create_graph=True)
    assert dq.requires_grad, "dq taken with create_graph=True does not require grad"
    try:
        dq.sum().backward()
    except RuntimeError as e:
        assert "autograd" in str(e), str(e)
        return
    raise AssertionError("a second backward through fmha.bwd ran (it has no formula)")


def _rank_1_raises(rank, world):
    import torch
    from fmha.distributed import ring_attention
    if rank == 1:
        raise RuntimeError("boom on rank 1")
    q = torch.randn(1, 8, 2, 8)
    ring_attention(q, q, q)  # waits for rank 1 in the shape check


def _tp_indivisible_heads(rank, world):
    from fmha.distributed import TensorParallelMultiheadAttention
    if world > 1:  # everything divides into one share
        _expect_error(lambda: TensorParallelMultiheadAttention(48, 6, num_kv_heads=3),
                      "multiples of the process group's size")


SCENARIOS = {
    "ring zigzag causal": _sequence_scheme("ring", "zigzag", dict(causal=True)),
    "ring zigzag": _sequence_scheme("ring", "zigzag", {}),
    "ring contiguous causal": _sequence_scheme("ring", "contiguous", dict(causal=True)),
    "ring contiguous": _sequence_scheme("ring", "contiguous", {}),
    "ring window alibi softcap": _sequence_scheme(
        "ring", "zigzag", dict(window=(5, 2), alibi_slopes=[0.5, 0.25, 0.125, 0.0625],
                               softcap=4.0)),
    "ring dropout causal": _sequence_scheme("ring", "zigzag", dict(causal=True, dropout_p=0.25)),
    "ring MQA contiguous window": _sequence_scheme(
        "ring", "contiguous", dict(window=(7, 7)), dict(hq=4, hkv=1)),
    "ulysses causal": _sequence_scheme("ulysses", "contiguous", dict(causal=True),
                                       dict(hq=4, hkv=4)),
    "ulysses zigzag GQA dropout": _sequence_scheme(
        "ulysses", "zigzag", dict(causal=True, dropout_p=0.25), dict(hq=8, hkv=4)),
    "tensor parallel": _tensor_parallel(None, padding=True),
    "tensor parallel GQA causal dropout": _tensor_parallel(4, dropout=0.2, causal=True),
    "ring create_graph: recorded, not differentiable again": _ring_create_graph,
    "unequal shards refused on every rank": _unequal_shards,
    "indivisible heads refused on every rank": _indivisible_heads,
    "unequal settings refused on every rank": _unequal_settings,
    "tensor parallel: indivisible heads refused": _tp_indivisible_heads,
    "tensor parallel: initialised as the unsplit layer, bad masks refused": _tp_initialisation,
}

#: Run only by the launcher's own test.
EXTRA = {"rank 1 raises": _rank_1_raises}
