"""The compiled core itself: its Philox against the published vectors, the dropout mask the
kernels apply against the Python contract, the build/backends report, ISA selection, and the
padding-mask memory bound."""

import os
import platform
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import fmha
from fmha import _C, _philox, reference

from cases import kat_rows, keep_mask_read_back
from conftest import probes


@pytest.mark.parametrize("counter,key,expected", kat_rows())
def test_kernel_philox_known_answers(counter, key, expected):
    assert list(probes().philox4x32_10(list(counter), list(key))) == list(expected)


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.999])
def test_kernel_dropout_threshold_matches_python(p):
    assert probes().dropout_threshold(p) == _philox.dropout_threshold(p)


def test_kernel_dropout_mask_is_the_contract_and_keeps_1_minus_p():
    seed, p = 1234567890123, 0.3
    z = keep_mask_read_back(seed, 2, 4, 128, 1024, p)  # 1M samples
    assert np.array_equal(z, _philox.dropout_keep_mask(seed, 0, 2, 4, 128, 1024, p))
    assert abs(z.mean() - (1 - p)) < 0.01 * (1 - p)


def test_kernel_dropout_mask_independent_of_threads_and_isa():
    seed, p = 99, 0.5
    masks = []
    for n in (1, 2):
        fmha.set_num_threads(n)
        try:
            masks.append(keep_mask_read_back(seed, 1, 2, 70, 130, p))
        finally:
            fmha.set_num_threads(None)
    assert np.array_equal(masks[0], masks[1])
    code = textwrap.dedent("""
        import numpy as np, fmha, sys
        sys.path.insert(0, sys.argv[1])
        from cases import keep_mask_read_back
        np.save(sys.argv[2], keep_mask_read_back(99, 1, 2, 70, 130, 0.5))
    """)
    for isa in _supported_isas():
        path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"fmha_mask_{isa}_{os.getpid()}.npy")
        env = dict(os.environ, FMHA_CPU_ISA=isa)
        tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        subprocess.run([sys.executable, "-c", code, tests, path], check=True, env=env)
        assert np.array_equal(np.load(path), masks[0]), isa
        os.remove(path)


def _supported_isas():
    """The levels a call may run at: up to the best, and amx wherever avx512bf16 runs (its
    tiles through the AMX model where they are not the hardware's)."""
    order = ["scalar", "avx2", "avx512", "avx512bf16", "amx"]
    best = _C.best_cpu_isa()
    return order[: order.index(best) + 1] + (["amx"] if best == "avx512bf16" else [])


def test_backends_report_no_gpu_cleanly():
    assert "cpu" in fmha.backends()
    status = fmha.cuda_status()
    if _C.cuda_device_count() == 0:
        assert "cuda" not in fmha.backends()
        assert status.startswith("no GPU"), status
    else:
        assert "cuda:0" in status


def test_cpu_isa_is_supported_and_reported():
    assert fmha.cpu_isa() in _supported_isas()
    if "FMHA_CPU_ISA" not in os.environ:
        assert fmha.cpu_isa() == _C.best_cpu_isa()


def test_host_description_and_peak_probes():
    """What result files record: the host (family/model from /proc/cpuinfo on Linux), and
    the two peaks -- the vdpbf16ps one only on the level that has the instruction."""
    d = _C.cpu_description()
    if sys.platform == "linux" and platform.machine() == "x86_64":
        assert " family " in d and " model " in d, d
    assert _C.cpu_fma_peak_gflops(1) > 0
    bf16 = _C.cpu_bf16_dot_peak_gflops(1)
    assert (bf16 > 0) == (fmha.cpu_isa() in ("avx512bf16", "amx")), (fmha.cpu_isa(), bf16)


def test_forcing_an_unknown_isa_is_a_clear_error():
    code = "import numpy as np, fmha; fmha.attention(*(np.ones((1, 2, 1, 4)),) * 3)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ, FMHA_CPU_ISA="sse9"))
    assert r.returncode != 0
    assert "FMHA_CPU_ISA" in r.stderr and "sse9" in r.stderr


def test_key_padding_mask_allocates_nothing_quadratic():
    """A (batch, seqlen_k) padding mask reaches the kernel as a stride-0 view: peak memory
    grows by about the output, not by b·h·sq·sk."""
    code = textwrap.dedent("""
        import os, resource, numpy as np, fmha
        if os.fork() == 0:  # a fresh peak-RSS counter (fork inherits the parent's)
            b, h, s, d = 2, 8, 4096, 32
            rng = np.random.default_rng(0)
            q, k, v = (rng.standard_normal((b, s, h, d), dtype=np.float32) for _ in range(3))
            pad = np.ones((b, s), dtype=bool); pad[1, 3000:] = False
            fmha.attention(q[:, :64], k[:, :64], v[:, :64])  # warm-up: pool, workspaces
            before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            out = fmha.attention(q, k, v, mask=pad[:, None, None, :])
            grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
            quadratic = b * h * s * s  # one byte per (b, h, i, j): 256 MiB
            print(grown, out.nbytes, quadratic)
            os._exit(0 if grown < out.nbytes + quadratic // 16 else 1)
        _, status = os.wait()
        raise SystemExit(os.waitstatus_to_exitcode(status))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
@pytest.mark.parametrize("kw", [
    dict(),
    dict(causal=True),
    dict(causal=True, alignment="top_left", window=(37, -1)),
    dict(window=(20, 70), softcap=4.0),
    dict(dropout_p=0.3, seed=11, alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625])),
    dict(mask_kind="keypad", causal=True),
], ids=["plain", "causal", "window-tl", "window-softcap", "dropout-alibi", "keypad"])
def test_backward_structures_agree_to_the_bit(dtype, kw, monkeypatch):
    """The key-tile passes and the single pass (chosen by problem size and thread count) must
    give identical bits, or results would depend on the thread count."""
    kw = dict(kw)
    rng = np.random.default_rng(3)
    b, sq, sk, hq, hk, d = 2, 150, 131, 4, 2, 40
    q = rng.standard_normal((b, sq, hq, d)).astype(dtype)
    k = rng.standard_normal((b, sk, hk, d)).astype(dtype)
    v = rng.standard_normal((b, sk, hk, d + 8)).astype(dtype)
    if kw.pop("mask_kind", None) == "keypad":
        pad = np.ones((b, sk), bool)
        pad[1, 100:] = False
        kw["mask"] = pad[:, None, None, :]
    out, lse = fmha.attention(q, k, v, return_lse=True, **kw)
    dout = rng.standard_normal(out.shape).astype(dtype)
    grads = {}
    for structure in ("passes", "single"):
        monkeypatch.setenv("FMHA_CPU_BACKWARD", structure)
        grads[structure] = fmha.attention_backward(dout, q, k, v, out, lse, **kw)
    for a, c in zip(grads["passes"], grads["single"]):
        assert np.array_equal(a.view(np.uint8), c.view(np.uint8))
    ref = reference.attention_backward(dout, q, k, v, **{x: y for x, y in kw.items()})
    tol = {np.float64: 1e-10, np.float32: 2e-5, np.float16: 2e-2}[dtype]
    for a, r in zip(grads["single"], ref):
        assert np.abs(a - r).max() <= tol * max(1.0, np.abs(r).max())


@pytest.mark.parametrize("sq,hq,hk", [(1, 8, 2), (2, 8, 1), (4, 4, 1), (3, 6, 3), (16, 2, 2)])
@pytest.mark.parametrize("kw", [
    dict(),
    dict(causal=True, softcap=5.0),
    dict(window=(40, 3), alignment="top_left", dropout_p=0.25, seed=8),
    dict(mask_kind="keypad", alibi=True, bias_kind="row"),
], ids=["plain", "causal-softcap", "window-dropout", "keypad-alibi-bias"])
def test_decode_shapes_grouped_path(sq, hq, hk, kw):
    """seqlen_q · group <= 16 takes the grouped decode path: one task per (batch, kv head)."""
    kw = dict(kw)
    rng = np.random.default_rng(5)
    b, sk, d = 3, 200, 24
    q = rng.standard_normal((b, sq, hq, d)).astype(np.float32)
    k = rng.standard_normal((b, sk, hk, d)).astype(np.float32)
    v = rng.standard_normal((b, sk, hk, d)).astype(np.float32)
    if kw.pop("mask_kind", None):
        pad = np.ones((b, sk), bool)
        pad[0, 150:] = False
        kw["mask"] = pad[:, None, None, :]
    if kw.pop("alibi", None):
        kw["alibi_slopes"] = np.linspace(0.05, 0.5, hq)
    if kw.pop("bias_kind", None):
        kw["bias"] = rng.standard_normal((b, 1, 1, sk)).astype(np.float32)
    out, lse = fmha.attention(q, k, v, return_lse=True, **kw)
    ref_out, ref_lse = reference.attention_forward(q, k, v, **kw)
    assert np.abs(out - ref_out).max() <= 2e-5 * max(1.0, np.abs(ref_out).max())
    finite = np.isfinite(ref_lse)
    assert np.array_equal(finite, np.isfinite(lse))
    assert np.abs(lse[finite] - ref_lse[finite]).max() <= 2e-5 * max(1.0, np.abs(ref_lse).max())
    # The backward of these shapes works on Sᵀ with K, V in place (few rows per key tile).
    dout = rng.standard_normal(out.shape).astype(np.float32)
    grads = fmha.attention_backward(dout, q, k, v, out, lse, bias_grad="bias" in kw, **kw)
    ref = reference.attention_backward(dout, q, k, v, **kw)
    for name, g, r in zip(["dq", "dk", "dv", "dbias"], grads, ref):
        assert np.abs(g - r).max() <= 2e-5 * max(1.0, np.abs(r).max()), name


@pytest.mark.parametrize("shape,causal", [((1, 512, 4, 64), False), ((2, 256, 4, 128), True),
                                          ((1, 1024, 2, 64), True)])
def test_bfloat16_gradients_closer_to_reference_than_torch_sdpa(shape, causal):
    """fmha's bfloat16 backward accumulates dK/dV in float across the whole sequence (torch
    re-rounds per block): its gradients are measurably closer to the float64 truth."""
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    gen = torch.Generator().manual_seed(0)
    q, k, v, g = (torch.randn(*shape, generator=gen) for _ in range(4))
    ref = reference.attention_backward(*(x.double().numpy() for x in (g, q, k, v)),
                                       causal=causal, alignment="top_left")[:3]

    def grads(attend):
        xs = [x.bfloat16().requires_grad_() for x in (q, k, v)]
        attend(*xs).backward(g.bfloat16())
        return [x.grad.double().numpy() for x in xs]

    ours = grads(lambda a, b, c: fmha.attention(a, b, c, causal=causal))
    theirs = grads(lambda a, b, c: F.scaled_dot_product_attention(
        *(x.transpose(1, 2) for x in (a, b, c)), is_causal=causal).transpose(1, 2))
    sq_err = lambda gs: [float(((x - r) ** 2).sum()) for x, r in zip(gs, ref)]
    e_ours, e_theirs = sq_err(ours), sq_err(theirs)
    assert sum(e_ours) < sum(e_theirs), (e_ours, e_theirs)
    for a, b in zip(e_ours, e_theirs):  # and no single gradient notably worse
        assert a <= 1.05 * b, (e_ours, e_theirs)


def test_kernel_exp_accuracy():
    """The softmax's exp (vexp.h: range reduction + degree-5 fitted polynomial) against float64."""
    x = np.concatenate([np.linspace(-87.0, 0.0, 2_000_003, dtype=np.float32),
                        np.float32([-1e-30, -0.5, -np.log(2.0), -20.0])])
    y = np.empty_like(x)
    probes().cpu_exp(x, y)
    exact = np.exp(x.astype(np.float64))
    rel = np.abs(y - exact) / exact
    assert rel.max() < 4e-7, float(rel.max())
    assert y[np.argmin(np.abs(x))] == 1.0  # exp(0) exactly
    below = np.float32([-87.5, -100.0, -1e30, -np.inf])
    out = np.empty_like(below)
    probes().cpu_exp(below, out)
    assert np.array_equal(out, np.zeros_like(out))  # flushed: never a denormal, never NaN


def test_kernel_lean_exp_accuracy():
    """The forward's exp for 16-bit inputs (vexp.h, exp_lean: degree 4, x <= 0) against
    float64: 4e-6 relative at most with fused multiply-adds, 1e-5 without (the scalar build
    measures 6.9e-6), exp(0) exactly 1 (an unchanged max must not rescale O), 0 below -87 and
    for -inf, NaN for NaN."""
    x = np.concatenate([np.linspace(-87.0, 0.0, 2_000_003, dtype=np.float32),
                        -np.logspace(-30, 0, 10_001).astype(np.float32),
                        np.float32([-0.5, -np.log(2.0), -20.0, -0.34657359, -0.34657362])])
    y = np.empty_like(x)
    probes().cpu_exp(x, y, lean=True)
    exact = np.exp(x.astype(np.float64))
    rel = np.abs(y - exact) / exact
    fused = _C.cpu_isa() != "scalar"
    assert rel.max() < (4e-6 if fused else 1e-5), float(rel.max())
    assert rel.max() > 4e-7  # the lean exp, not the default one
    # The edge values, in 40-element arrays at two offsets: through the vector path
    # (vexp_lean) and the scalar tail (exp_lean) both. x > 0 (only a NaN row's softmax passes
    # one) is clamped to 0: a defined 1, never an overflowing conversion.
    edges = np.float32([0.0, -0.0, -87.5, -1e30, -np.inf, np.nan, 1.0, 300.0, 1e30, np.inf])
    want = np.float32([1, 1, 0, 0, 0, np.nan, 1, 1, 1, 1])
    for shift in (0, 30):
        x = np.full(40, -1.0, np.float32)
        x[shift:shift + len(edges)] = edges
        out = np.empty_like(x)
        probes().cpu_exp(x, out, lean=True)
        np.testing.assert_array_equal(out[shift:shift + len(edges)], want)
