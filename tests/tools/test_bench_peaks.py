"""Which peak the standard suite judges each dtype's rows against (fmha.bench.suite.
measured_peaks), on CPUs with and without the bf16 dot product and the AMX tiles: the probes
are stand-ins here, so every kind of host is covered on any host."""

import types

import pytest

from fmha.bench import suite


def _fmha(fma, dot, amx):
    c = types.SimpleNamespace(cpu_fma_peak_gflops=lambda n: fma,
                              cpu_bf16_dot_peak_gflops=lambda n: dot,
                              cpu_amx_peak_gflops=lambda n: amx)
    return types.SimpleNamespace(_C=c)


@pytest.mark.parametrize("fma, dot, amx, kind, gflops", [
    (100.0, 200.0, 1600.0, "amx_bf16", 1600.0),  # an AMX Xeon whose process may use the tiles
    (100.0, 200.0, 0.0, "bf16_dot", 200.0),      # AVX512-BF16 (Zen 4/5, AMX refused or absent)
    (100.0, 0.0, 0.0, "fp32_fma", 100.0),        # AVX-512 without BF16, AVX2
])
def test_bfloat16_rows_are_judged_against_the_best_usable_peak(fma, dot, amx, kind, gflops):
    peaks = suite.measured_peaks(_fmha(fma, dot, amx), 2)
    assert peaks["peak_of_dtype"] == dict(float32="fp32_fma", bfloat16=kind)
    assert peaks["peak_gflops_of_dtype"] == dict(float32=fma, bfloat16=gflops)
    assert peaks["amx_bf16_peak_gflops"] == (amx or None)
    # the per-round probe of each kind is a function of fmha._C
    for name in peaks["peak_of_dtype"].values():
        assert callable(getattr(_fmha(fma, dot, amx)._C, suite.PEAK_PROBES[name]))


def test_this_hosts_peaks_are_consistent():
    """On the real probes: the AMX peak is reported exactly where fmha says this process may
    use the tiles in this build."""
    import fmha
    peaks = suite.measured_peaks(fmha, 1)
    usable = "amx_permitted" in fmha.cpu_features() and fmha._C.amx_hardware_built()
    assert (peaks["amx_bf16_peak_gflops"] is not None) == usable
    assert peaks["peak_of_dtype"]["bfloat16"] == ("amx_bf16" if usable else
                                                  "bf16_dot" if peaks["bf16_dot_peak_gflops"]
                                                  else "fp32_fma")
