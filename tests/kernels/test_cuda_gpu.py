"""The CUDA kernels on a real GPU, through torch CUDA tensors (and CuPy, when installed).

The public API with CUDA tensors end to end (device allocation, streams, autograd, varlen
with device offsets, torch.compile) at sizes the emulator cannot reach, against the float64
reference and the CPU path. The emulator's cases run on the GPU as the ``gpu`` backend of
tests/kernels/test_cuda_emu_cases.py (conftest's ``backend`` fixture).

Skipped as a whole, with one reason, where there is no usable GPU or fmha has no CUDA build.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fmha  # noqa: E402
from fmha import _C  # noqa: E402

from conftest import _why_no_gpu  # noqa: E402

if _why_no_gpu():
    pytest.skip(_why_no_gpu() + "; the gpu backend of tests/kernels/test_cuda_emu_cases.py is not "
                "generated either", allow_module_level=True)

from conftest import (LOW_PRECISION, assert_close, fmha_results, make_inputs,  # noqa: E402
                      naive_results, reference_results, to_f64)
from fmha._core import _kernel_module  # noqa: E402

DEV = "cuda"


def _check_on_gpu(rng, b, sq, sk, hq, hkv, d, dtype="bfloat16", bias_shape=None, **kw):
    """fmha with CUDA tensors (autograd) vs the float64 reference, within 2x / 3x of the
    naive low-precision error (computed on the CPU)."""
    q, k, v, do = make_inputs(rng, b, sq, sk, hq, hkv, d, dtype=dtype, lib="torch")
    bias = None
    if bias_shape is not None:
        bias = torch.from_numpy(rng.standard_normal(bias_shape)).to(getattr(torch, dtype))
    with _kernel_module(_C):
        res = fmha_results(*(x.to(DEV) for x in (q, k, v, do)),
                           bias=None if bias is None else bias.to(DEV),
                           bias_grad=bias is not None, **kw)
    for key, val in res.items():
        assert val.device.type == "cuda", key
    ref = reference_results(q, k, v, do, bias=bias, bias_grad=bias is not None, **kw)
    naive = naive_results(q, k, v, do, bias=bias, bias_grad=bias is not None, **kw)
    for key in ref:
        assert_close(key, res[key].cpu(), ref[key], dtype, naive=naive[key],
                     grad=key.startswith("d"),
                     result_dtype="float32" if key == "lse" else None)


BIG = [(2, 1000, 1000, 8, 2, 128, True), (1, 113, 1000, 4, 4, 256, False),
       (1, 1000, 113, 4, 1, 59, True), (4, 1, 4096, 8, 1, 128, False),
       (1, 777, 777, 2, 2, 64, False)]


@pytest.mark.parametrize("b,sq,sk,hq,hkv,d,causal", BIG,
                         ids=[f"b{b}-sq{a}-sk{c}-h{h}/{g}-d{d}-{'causal' if z else 'full'}"
                              for b, a, c, h, g, d, z in BIG])
@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_big_shapes(rng, dtype, b, sq, sk, hq, hkv, d, causal):
    with _kernel_module(_C):
        _check_on_gpu(rng, b, sq, sk, hq, hkv, d, dtype, causal=causal)


def test_big_shape_every_feature(rng):
    with _kernel_module(_C):
        _check_on_gpu(rng, 2, 300, 517, 8, 2, 96, "bfloat16", bias_shape=(2, 1, 300, 517),
                      causal=True, window=(200, -1), softcap=20.0,
                      alibi_slopes=torch.linspace(0.01, 0.1, 8).to(DEV))


def test_dropout_same_mask_on_cpu_and_gpu():
    """After torch.manual_seed(s), a GPU call drops exactly the elements a CPU call drops."""
    def keep(device, sq=100, sk=200, h=2):
        q = torch.zeros(1, sq, h, sk, dtype=torch.bfloat16, device=device)
        k = torch.zeros(1, sk, h, sk, dtype=torch.bfloat16, device=device)
        v = torch.eye(sk, dtype=torch.bfloat16, device=device)[None, :, None, :]
        torch.manual_seed(123)
        out = fmha.attention(q, k, v.expand(1, sk, h, sk).contiguous(), dropout_p=0.4)
        return (out > 0).cpu()

    with _kernel_module(_C):
        assert torch.equal(keep(DEV), keep("cpu"))


def _varlen_inputs(lens_q, lens_k, hq=4, hkv=2, d=64):
    """Packed bfloat16 q, k, v, dout and int32 offsets, on the CPU."""
    cu_q = torch.tensor(np.r_[0, np.cumsum(lens_q)], dtype=torch.int32)
    cu_k = torch.tensor(np.r_[0, np.cumsum(lens_k)], dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), hq, d, dtype=torch.bfloat16)
    k = torch.randn(int(cu_k[-1]), hkv, d, dtype=torch.bfloat16)
    v = torch.randn(int(cu_k[-1]), hkv, d, dtype=torch.bfloat16)
    do = torch.randn(int(cu_q[-1]), hq, d, dtype=torch.bfloat16)
    return q, k, v, do, cu_q, cu_k


def test_varlen_device_offsets(rng):
    lens_q, lens_k = [300, 1, 77, 513], [250, 40, 77, 1]
    q, k, v, _, cu_q, cu_k = _varlen_inputs(lens_q, lens_k)
    with _kernel_module(_C):
        # Offsets on the GPU are not read on the host: the maxima are required.
        with pytest.raises(ValueError, match="max_seqlen_q, max_seqlen_k: required when q is "
                                             "on a CUDA device"):
            fmha.attention_varlen(q.to(DEV), k.to(DEV), v.to(DEV), cu_q.to(DEV), cu_k.to(DEV))
        out_gpu = fmha.attention_varlen(q.to(DEV), k.to(DEV), v.to(DEV), cu_q.to(DEV),
                                        cu_k.to(DEV), max(lens_q), max(lens_k), causal=True)
        out_cpu = fmha.attention_varlen(q, k, v, cu_q, cu_k, causal=True)
    from fmha import reference
    ref, _ = reference.attention_varlen_forward(to_f64(q), to_f64(k), to_f64(v), cu_q.numpy(),
                                                cu_k.numpy(), causal=True)
    err_gpu = np.abs(to_f64(out_gpu) - ref).max()
    err_cpu = np.abs(to_f64(out_cpu) - ref).max()
    assert err_gpu <= 2 * err_cpu + 1e-3, (err_gpu, err_cpu)


@pytest.mark.parametrize("deterministic", [False, True])
def test_empty_inputs_cuda_tensors(deterministic):
    """Empty calls with CUDA tensors (null data pointers, device offsets): no kernel is
    launched with an empty grid; out 0 / lse -inf on rows without keys, zero gradients
    (tests/api/test_empty.py has the same cases through the gpu backend)."""
    cases = [((0, 5, 6, 4, 2), None), ((2, 0, 6, 4, 2), (1, 1, 1, 6)),
             ((2, 5, 0, 4, 2), (1, 4, 5, 1)), ((2, 5, 6, 0, 2), None),
             ((2, 5, 6, 0, 0), (1, 1, 5, 6))]
    with _kernel_module(_C):
        for (b, sq, sk, hq, hkv), bias_shape in cases:
            q = torch.randn(b, sq, hq, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True)
            k = torch.randn(b, sk, hkv, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True)
            v = torch.randn(b, sk, hkv, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True)
            bias = None if bias_shape is None else torch.randn(
                *bias_shape, device=DEV, dtype=torch.bfloat16, requires_grad=True)
            out, lse = fmha.attention(q, k, v, causal=True, bias=bias, return_lse=True,
                                      deterministic=deterministic)
            out.backward(torch.ones_like(out))
            torch.cuda.synchronize()
            assert out.shape == (b, sq, hq, 64) and lse.shape == (b, hq, sq)
            assert torch.all(out == 0) and torch.all(lse == -torch.inf)
            for x in (q, k, v) + (() if bias is None else (bias,)):
                assert x.grad.shape == x.shape and torch.count_nonzero(x.grad) == 0
        for lens_q, lens_k in (([0, 0], [3, 4]), ([2, 3], [0, 0]), ([], [])):
            cu_q = torch.tensor(np.r_[0, np.cumsum(lens_q)], dtype=torch.int32, device=DEV)
            cu_k = torch.tensor(np.r_[0, np.cumsum(lens_k)], dtype=torch.int32, device=DEV)
            q = torch.randn(sum(lens_q), 4, 64, device=DEV, dtype=torch.float16,
                            requires_grad=True)
            k = torch.randn(sum(lens_k), 2, 64, device=DEV, dtype=torch.float16,
                            requires_grad=True)
            out, lse = fmha.attention_varlen(q, k, k, cu_q, cu_k, max(lens_q, default=0),
                                             max(lens_k, default=0), return_lse=True,
                                             deterministic=deterministic)
            out.backward(torch.ones_like(out))
            torch.cuda.synchronize()
            assert torch.all(out == 0) and torch.all(lse == -torch.inf)
            assert torch.count_nonzero(q.grad) == 0 and torch.count_nonzero(k.grad) == 0


def test_varlen_offsets_never_copied_to_host(monkeypatch):
    """With the offsets on the GPU, a varlen forward and backward neither copy them to the
    host (fmha._validate.to_host would) nor run any synchronising CUDA operation (torch's
    sync debug mode raises on one); the results match the CPU path's, which reads them."""
    import fmha._validate as validate

    def refuse(x):
        raise AssertionError("cu_seqlens copied to the host")

    lens_q, lens_k = [130, 1, 64, 0, 77], [100, 40, 64, 3, 77]
    q, k, v, do, cu_q, cu_k = _varlen_inputs(lens_q, lens_k)
    leaves = [x.to(DEV).requires_grad_(True) for x in (q, k, v)]
    cu_q_d, cu_k_d, do_d = cu_q.to(DEV), cu_k.to(DEV), do.to(DEV)
    torch.cuda.synchronize()
    with _kernel_module(_C):
        monkeypatch.setattr(validate, "to_host", refuse)
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = fmha.attention_varlen(*leaves, cu_q_d, cu_k_d, max(lens_q), max(lens_k),
                                        causal=True, deterministic=True)
            out.backward(do_d)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            monkeypatch.undo()
        cpu = [x.clone().requires_grad_(True) for x in (q, k, v)]
        out_cpu = fmha.attention_varlen(*cpu, cu_q, cu_k, causal=True)
        out_cpu.backward(do)
    from fmha import reference
    args = [to_f64(x) for x in (q, k, v)]
    refs = [reference.attention_varlen_forward(*args, cu_q.numpy(), cu_k.numpy(), causal=True)[0],
            *reference.attention_varlen_backward(to_f64(do), *args, cu_q.numpy(), cu_k.numpy(),
                                                 causal=True)]
    for name, got, want, ref in zip(("out", "dq", "dk", "dv"), [out] + [x.grad for x in leaves],
                                    [out_cpu] + [x.grad for x in cpu], refs):
        err_gpu = np.abs(to_f64(got) - ref).max()
        err_cpu = np.abs(to_f64(want) - ref).max()
        assert err_gpu <= 3 * err_cpu + 1e-3, (name, err_gpu, err_cpu)


@pytest.mark.parametrize("deterministic", [True, False])
def test_varlen_cuda_graph_capture(deterministic):
    """A varlen forward + backward captured in a CUDA graph (which refuses any host
    synchronisation while capturing), then replayed on new values and new offsets of the
    same maxima, gives what an eager call gives: the bits, except dQ summed by atomics in
    an unspecified order."""
    lens_q, lens_k = [130, 1, 64, 0, 77], [100, 40, 64, 3, 77]
    q, k, v, do, cu_q, cu_k = _varlen_inputs(lens_q, lens_k)
    mq, mk = max(lens_q), max(lens_k)
    static = [x.to(DEV).requires_grad_(True) for x in (q, k, v)]
    s_do, s_cu_q, s_cu_k = do.to(DEV), cu_q.to(DEV), cu_k.to(DEV)

    def step():
        out = fmha.attention_varlen(*static, s_cu_q, s_cu_k, mq, mk, causal=True,
                                    deterministic=deterministic)
        out.backward(s_do)
        return out

    with _kernel_module(_C):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the default stream, as torch advises
            for _ in range(2):
                for x in static:
                    x.grad = None
                step()
        torch.cuda.current_stream().wait_stream(side)
        for x in static:
            x.grad = None  # allocated from the graph's pool when captured
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            g_out = step()

        # New values, and offsets that regroup the same rows (same maxima).
        new_q, new_k = [0, 77, 130, 1, 64, 0], [0, 77, 100, 40, 64, 3]
        with torch.no_grad():
            for x in static + [s_do]:
                x.copy_(torch.randn_like(x))
            s_cu_q.copy_(torch.tensor(np.cumsum(new_q), dtype=torch.int32))
            s_cu_k.copy_(torch.tensor(np.cumsum(new_k), dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        got = [g_out.clone()] + [x.grad.clone() for x in static]

        eager = [x.detach().clone().requires_grad_(True) for x in static]
        out = fmha.attention_varlen(*eager, s_cu_q.clone(), s_cu_k.clone(), mq, mk, causal=True,
                                    deterministic=deterministic)
        out.backward(s_do)
        want = [out] + [x.grad for x in eager]
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        if name == "dq" and not deterministic:
            torch.testing.assert_close(a, b)
        else:
            assert torch.equal(a, b), name


def _decode_inputs(b=3, hq=8, hkv=2, d=128, block_size=16, max_blocks=40, seed=0):
    """A paged bfloat16 cache on the GPU (blocks in a shuffled order) with ragged lengths."""
    g = torch.Generator().manual_seed(seed)
    pool = lambda: torch.randn(b * max_blocks, block_size, hkv, d, generator=g)  # noqa: E731
    k_pool, v_pool = (pool().to(torch.bfloat16).to(DEV) for _ in range(2))
    table = torch.randperm(b * max_blocks, generator=g).reshape(b, max_blocks).to(torch.int32)
    lens = torch.tensor([0, 300, 600][:b], dtype=torch.int32)
    q = torch.randn(b, 1, hq, d, generator=g).to(torch.bfloat16).to(DEV)
    k, v = (torch.randn(b, 1, hkv, d, generator=g).to(torch.bfloat16).to(DEV) for _ in range(2))
    return q, k_pool, v_pool, k, v, lens.to(DEV), table.to(DEV)


def test_kvcache_decode_matches_the_cpu_without_host_sync():
    """A paged decode step with append on CUDA tensors runs without any synchronising CUDA
    operation and gives what the CPU kernels give on the same rows (both near float64)."""
    from fmha.kvcache import attention_with_kvcache, check_refused
    from fmha import reference
    q, kp, vp, k, v, lens, table = _decode_inputs()
    cpu = [x.cpu().clone() for x in (q, kp, vp, k, v, lens, table)]
    torch.cuda.synchronize()
    with _kernel_module(_C):
        torch.cuda.set_sync_debug_mode("error")
        try:
            out, lse = attention_with_kvcache(q, kp, vp, k, v, cache_seqlens=lens,
                                              block_table=table, causal=True, return_lse=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        out_cpu, lse_cpu = attention_with_kvcache(*cpu[:5], cache_seqlens=cpu[5],
                                                  block_table=cpu[6], causal=True,
                                                  return_lse=True)
        check_refused()
    ref_out, _ = reference.attention_with_kvcache(
        *(to_f64(x) for x in cpu[:5]), cache_seqlens=cpu[5].numpy(), block_table=cpu[6].numpy(),
        causal=True)
    assert torch.equal(kp.cpu(), cpu[1]) and torch.equal(vp.cpu(), cpu[2])  # both appended
    err_gpu, err_cpu = (np.abs(to_f64(o) - ref_out).max() for o in (out, out_cpu))
    assert err_gpu <= 2 * err_cpu + 1e-3, (err_gpu, err_cpu)
    torch.testing.assert_close(lse.cpu(), lse_cpu, rtol=1e-5, atol=1e-5)


def test_kvcache_decode_cuda_graph_capture():
    """A decode step (append + attend) captured in a CUDA graph, replayed with new lengths
    and new rows, gives the bits of an eager call on the same inputs."""
    from fmha.kvcache import attention_with_kvcache
    q, kp, vp, k, v, lens, table = _decode_inputs()
    with _kernel_module(_C):
        def step():
            return attention_with_kvcache(q, kp, vp, k, v, cache_seqlens=lens,
                                          block_table=table, causal=True)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            g_out = step()
        lens.copy_(torch.tensor([5, 301, 599], dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        k.copy_(torch.randn_like(k))
        kp_before, vp_before = kp.clone(), vp.clone()
        graph.replay()
        torch.cuda.synchronize()
        got, kp_graph = g_out.clone(), kp.clone()
        kp.copy_(kp_before)
        vp.copy_(vp_before)
        want = step()
    assert torch.equal(got, want) and torch.equal(kp_graph, kp)


def test_kvcache_refused_on_the_device():
    """A length past the capacity, on the device: nothing written, NaN out, reported once."""
    from fmha.kvcache import attention_with_kvcache, check_refused
    q, kp, vp, k, v, lens, table = _decode_inputs()
    lens[1] = 40 * 16  # + 1 new row > capacity
    before = kp.clone(), vp.clone()
    with _kernel_module(_C):
        check_refused()
        out = attention_with_kvcache(q, kp, vp, k, v, cache_seqlens=lens, block_table=table)
        assert torch.isnan(out).all()
        assert torch.equal(kp, before[0]) and torch.equal(vp, before[1])
        with pytest.raises(ValueError, match="exceeded the cache's capacity"):
            check_refused()
        check_refused()


def test_deterministic_backward_bitwise_on_gpu(rng):
    q, k, v, do = (x.to(DEV) for x in make_inputs(rng, 2, 500, 700, 8, 2, 128, dtype="bfloat16",
                                                  lib="torch"))
    grads = []
    with _kernel_module(_C):
        for _ in range(20):
            leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
            fmha.attention(*leaves, causal=True, deterministic=True).backward(do)
            grads.append([x.grad for x in leaves])
    for run in grads[1:]:
        for a, b in zip(grads[0], run):
            assert torch.equal(a, b)


def test_side_stream(rng):
    """Calls on a non-default stream run on that stream and give the default stream's bits."""
    q, k, v, _ = (x.to(DEV) for x in make_inputs(rng, 2, 333, 444, 4, 4, 64, dtype="float16",
                                                 lib="torch"))
    with _kernel_module(_C):
        ref = fmha.attention(q, k, v, causal=True)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            out = fmha.attention(q, k, v, causal=True)
        torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    assert torch.equal(out, ref)


def test_torch_compile_fullgraph_on_gpu(rng):
    q, k, v, do = (x.to(DEV) for x in make_inputs(rng, 2, 100, 120, 4, 2, 64, dtype="bfloat16",
                                                  lib="torch"))

    def f(q, k, v):
        return fmha.attention(q, k, v, causal=True)

    with _kernel_module(_C):
        compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
        outs = []
        for fn in (compiled, f):
            leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
            y = fn(*leaves)
            y.backward(do)
            outs.append([y] + [x.grad for x in leaves])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_cuda_errors():
    q = torch.randn(1, 8, 2, 64, device=DEV)
    with pytest.raises(NotImplementedError, match="float16/bfloat16; cast, or use the CPU"):
        fmha.attention(q, q, q)
    h = q.half()
    with pytest.raises(ValueError, match="k: on device cpu, expected q's device cuda:0"):
        fmha.attention(h, h.cpu(), h)
    big = torch.randn(1, 8, 2, 300, device=DEV, dtype=torch.float16)
    with pytest.raises(ValueError, match="head_dim 300 is over the limit of 256"):
        fmha.attention(big, big, big)
    with pytest.raises(ValueError, match="alibi_slopes: on device cpu"):
        fmha.attention(h, h, h, alibi_slopes=torch.ones(2))


def test_cupy_arrays(rng):
    cupy = pytest.importorskip("cupy")
    q, k, v, _ = make_inputs(rng, 2, 65, 130, 4, 2, 64, dtype="float16", lib="numpy")
    with _kernel_module(_C):
        out = fmha.attention(*(cupy.asarray(x) for x in (q, k, v)), causal=True)
        assert isinstance(out, cupy.ndarray)
        want = fmha.attention(*(torch.from_numpy(x).to(DEV) for x in (q, k, v)), causal=True)
    assert np.array_equal(cupy.asnumpy(out), want.cpu().numpy())
