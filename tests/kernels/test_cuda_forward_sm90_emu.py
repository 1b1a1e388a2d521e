"""The Hopper forward kernel (csrc/cuda/flash_fwd_sm90.cuh: TMA, wgmma, a producer warp and
two consumer warpgroups) under the SIMT emulator, and the routing between it and the sm_80
kernel (csrc/cuda/flash_fwd.cu).

FMHA_CUDA_KERNEL=sm90 makes the emulated forward run the Hopper kernel for every call it
claims; each case here asserts which kernel ran (fmha._cuda_emu.forward_kernel). The cases
are those of test_cuda_forward_emu.py (its run_case / run_varlen, the same tolerance rule),
for what the kernel claims -- fp16 and bf16, head-dim tiles 64/128/256 (smaller dims in the
next tile), causal and sliding windows, GQA, varlen, split-KV -- and one per route to the
sm_80 kernel: softcap, bias, mask, ALiBi, dropout, a non-positive scale, rows TMA cannot
address (a row stride that is not a multiple of 16 bytes), and FMHA_CUDA_KERNEL=sm80.
"""

from __future__ import annotations

import numpy as np
import pytest

from test_cuda_forward_emu import emu, run_case as _run_case, run_varlen  # (skips as it does)


def run_case(rng, **kw):
    """test_cuda_forward_emu.run_case; bfloat16 through torch (NumPy has none)."""
    if kw.get("dtype") == "bfloat16":
        kw["lib"] = "torch"
    return _run_case(rng, **kw)


@pytest.fixture
def kernel(monkeypatch):
    """Sets FMHA_CUDA_KERNEL; yields a checker of the kernel the last forward ran."""
    def use(name):
        monkeypatch.setenv("FMHA_CUDA_KERNEL", name)
        emu.forward_kernel()  # clear

    def ran(expected):
        assert emu.forward_kernel() == expected

    use("sm90")
    return type("K", (), {"use": staticmethod(use), "ran": staticmethod(ran)})


# ---------------------------------------------------------------- what the kernel claims

@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("sq,sk", [(1, 1), (17, 80), (130, 70), (64, 200)])
def test_plain(rng, kernel, dtype, d, sq, sk):
    run_case(rng, sq=sq, sk=sk, d=d, dtype=dtype)
    kernel.ran("sm90")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_head_dim_256(rng, kernel, dtype):
    # 80-key blocks: 170 keys are two whole blocks and a tail.
    run_case(rng, sq=70, sk=170, d=256, dtype=dtype)
    kernel.ran("sm90")


@pytest.mark.parametrize("d", [8, 40, 96, 200])
def test_head_dims_in_larger_tiles(rng, kernel, d):
    # Columns past the head dim are the TMA's zero fill; rows 16-byte aligned (d % 8 == 0).
    run_case(rng, sq=17, sk=33, d=d)
    kernel.ran("sm90")


@pytest.mark.parametrize("alignment", ["bottom_right", "top_left"])
@pytest.mark.parametrize("sq,sk", [(130, 130), (17, 200), (200, 17)])
def test_causal(rng, kernel, sq, sk, alignment):
    run_case(rng, sq=sq, sk=sk, causal=True, alignment=alignment, dtype="bfloat16")
    kernel.ran("sm90")


@pytest.mark.parametrize("window,sq,sk", [((8, 0), 140, 140), ((5, 3), 17, 300), ((130, 0), 200, 260)])
def test_window(rng, kernel, window, sq, sk):
    run_case(rng, sq=sq, sk=sk, window=window, d=128)
    kernel.ran("sm90")


@pytest.mark.parametrize("hq,hkv", [(4, 1), (4, 2)])
def test_gqa_batch(rng, kernel, hq, hkv):
    run_case(rng, batch=2, sq=20, sk=150, hq=hq, hkv=hkv, causal=True)
    kernel.ran("sm90")


@pytest.mark.parametrize("splits", [2, 3])
def test_split_kv(rng, kernel, splits):
    run_case(rng, sq=17, sk=300, d=128, num_splits=splits, expect_splits=splits, causal=True)
    kernel.ran("sm90")


def test_lazy_rescale_with_rising_scores(rng, kernel):
    # Scores that grow along the keys: the row max moves in every block.
    d, sk = 64, 400
    q = np.ones((1, 9, 1, d))
    k = np.linspace(0.0, 12.0, sk)[None, :, None, None] * np.ones((1, sk, 1, d)) / np.sqrt(d)
    run_case(rng, sq=9, sk=sk, d=d, qk64=(q, k))
    kernel.ran("sm90")


def test_varlen(rng, kernel):
    # An empty sequence on each side, sq != sk both ways, a tail past a 128-key block whose
    # TMA box reads the next sequence's rows.
    run_varlen(rng, [17, 0, 70, 1, 5], [40, 9, 140, 0, 130])
    kernel.ran("sm90")


@pytest.mark.parametrize("alignment", ["bottom_right", "top_left"])
def test_varlen_causal_bf16(rng, kernel, alignment):
    run_varlen(rng, [30, 140, 3], [10, 150, 0], causal=True, alignment=alignment,
               dtype="bfloat16", d=128)
    kernel.ran("sm90")


# ------------------------------------------------------------ routes to the sm_80 kernel

@pytest.mark.parametrize("extra", [
    dict(softcap=2.0),
    dict(bias="full"),
    dict(mask="full"),
    dict(alibi_slopes=True),
    dict(dropout_p=0.25, seed=3),
    dict(scale=-0.5),
])
def test_routes_extras_to_sm80(rng, kernel, extra):
    extra = dict(extra)
    if extra.get("bias") == "full":
        extra["bias"] = rng.standard_normal((1, 1, 17, 33)).astype(np.float32)
    if extra.get("mask") == "full":
        extra["mask"] = rng.random((1, 1, 17, 33)) > 0.3
    if extra.get("alibi_slopes") is True:
        extra["alibi_slopes"] = np.array([0.25])
    run_case(rng, sq=17, sk=33, **extra)
    kernel.ran("sm80")


def test_routes_windows_at_head_dim_256_to_sm80(rng, kernel):
    # The strong zero's watch is built up to d = 128 (FlashFwdSm90ConfigBase::kEdges).
    run_case(rng, sq=70, sk=170, d=256, causal=True)
    kernel.ran("sm80")


def test_routes_unaligned_rows_to_sm80(rng, kernel):
    # d = 59: 118-byte rows, which a tensor map cannot stride.
    run_case(rng, sq=17, sk=33, d=59)
    kernel.ran("sm80")


def test_forced_sm80(rng, kernel):
    kernel.use("sm80")
    run_case(rng, sq=17, sk=33)
    kernel.ran("sm80")


def test_default_is_sm80_under_the_emulator(rng, kernel, monkeypatch):
    monkeypatch.delenv("FMHA_CUDA_KERNEL")
    run_case(rng, sq=17, sk=33)
    kernel.ran("sm80")


def test_rejects_unknown_kernel_name(rng, kernel):
    kernel.use("sm100")
    with pytest.raises(ValueError, match="FMHA_CUDA_KERNEL"):
        run_case(rng, sq=1, sk=1)
