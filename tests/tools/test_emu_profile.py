"""tools/emu_profile.py and the emulator's memory-traffic counters on the shipped kernels
(fmha._cuda_emu.traffic(); the counters themselves are checked on planted patterns by the
emu.traffic_* cases of tests/cuda_emu/emulator_checks.cu, run by tests/native/test_cuda_emu.py).

What the shipped FlashAttention-2 kernels guarantee today in these cases (whole-block copies
of 256-byte-aligned inputs), as regressions to catch: no bank conflict in any ldmatrix, none
in the cp.async stores at head-dim tiles 32, 64, 128 and 256
(the 32 tile's copies pair rows r and r + 4 in each phase: tile::FullBlock::kPairRows), every
global byte a cp.async fetches used (256-byte-aligned inputs). The 96 tile's cp.async stores
take 4 wavefronts where 3 would do (its 12 chunks per row make every second 8-lane phase
straddle two padded rows: docs/cuda_kernels.md, "Shared-memory traffic"), and the d = 32 dQ
kernel's take 2 where 1 would do (its rows copied in order: the paired order spills it); the
test pins those ratios so a change either way is seen.

The sm_90 forward (FMHA_CUDA_KERNEL=sm90 under the emulator) reads its wgmma operands and
copies its tiles by TMA through the 128-byte swizzle (fp16, bf16 and e4m3): no bank conflict
in either (the model:
csrc/cuda/emu/runtime.h, KernelTraffic)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import emu_profile  # noqa: E402

pytest.importorskip("fmha._cuda_emu")


@pytest.fixture(scope="module")
def rows():
    return emu_profile.profile()


def test_every_case_and_pass_has_its_main_kernel(rows):
    seen = {(r["case"], r["pass_"]) for r in rows}
    assert seen == {(c[0], p) for c in emu_profile.CASES for p in ("forward", "backward")}
    for r in rows:
        assert r["launches"] == 1 and r["ldmatrix_requests"] > 0 and r["cp_async_requests"] > 0


def test_no_bank_conflicts_but_the_96_tiles_cp_async_stores(rows):
    for r in rows:
        where = f"{r['case']} {r['pass_']} {r['kernel']}"
        assert r["ldmatrix_wavefronts"] == r["ldmatrix_ideal_wavefronts"], where
        if r["case"] == "d96":
            assert 3 * r["cp_async_wavefronts"] == 4 * r["cp_async_ideal_wavefronts"], where
        elif r["case"] == "d32 deterministic" and "flash_bwd_dq_kernel" in r["kernel"]:
            assert r["cp_async_wavefronts"] == 2 * r["cp_async_ideal_wavefronts"], where
        else:
            assert r["cp_async_wavefronts"] == r["cp_async_ideal_wavefronts"], where


def test_every_fetched_global_byte_is_used(rows):
    for r in rows:
        assert r["cp_async_global_bytes"] == 32 * r["cp_async_global_sectors"], r


def test_table_names_each_kernel(rows):
    text = emu_profile.table(rows)
    assert text.count("\n") == len(rows) + 1
    assert "FlashFwdConfig<96" in text and "100.0%" in text and "| 1.33 |" in text


@pytest.fixture(scope="module")
def sm90_rows():
    return emu_profile.profile_sm90()


def test_sm90_forward_has_no_bank_conflict_in_wgmma_or_tma(sm90_rows):
    assert {r["case"] for r in sm90_rows} == {c[0] for c in emu_profile.SM90_CASES}
    for r in sm90_rows:
        where = f"{r['case']} {r['kernel']}"
        assert "flash_fwd_sm90" in r["kernel"] and r["launches"] == 1, where
        # Q, K and V arrive by TMA and every block runs its GEMMs through wgmma: the counters
        # saw them (at least Q's, K's and V's bytes).
        _, b, sq, sk, h, d, kw = next(c for c in emu_profile.SM90_CASES if c[0] == r["case"])
        elem = 1 if kw.get("dtype") == "float8_e4m3fn" else 2
        assert 128 * r["tma_ideal_wavefronts"] >= elem * b * h * (sq + 2 * sk) * d, where
        assert r["wgmma_requests"] > 0 and r["wgmma_ideal_wavefronts"] > 0, where
        assert r["wgmma_wavefronts"] == r["wgmma_ideal_wavefronts"], where
        assert r["tma_wavefronts"] == r["tma_ideal_wavefronts"], where


def test_sm90_table_names_each_kernel(sm90_rows):
    text = emu_profile.table_sm90(sm90_rows)
    assert text.count("\n") == len(sm90_rows) + 1
    assert "flash_fwd_sm90" in text and "| 1.00 |" in text
