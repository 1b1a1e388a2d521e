"""AMX: the software model of the tile instructions (csrc/cpu/amx_model.cpp) against a NumPy
reference written here from the ISA text, the hardware against the model where there is AMX,
and the detection / permission that decides whether the hardware may be used.

The reference follows the operation section of TDPBF16PS in Intel's SDM Vol. 2: per row m of C,
two fp32 partial sums per column (the even and the odd element of each bf16 pair) start at +0
and take one fused multiply-add per pair row k, rounded to nearest-even, denormal inputs read
as zero and denormal results flushed to zero; then C[m][n] + (even + odd), two rounded fp32
additions with the same flushing. Its fp32 FMA is computed independently of the model's: the
product of two bf16 values is exact in float64, the sum is rounded to odd in float64 (TwoSum)
and then to nearest-even fp32, which is the correctly rounded fp32 result."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import fmha
from fmha import _C

from conftest import probes

LDTILECFG, STTILECFG, TILERELEASE, TILELOADD, TILESTORED, TILEZERO, TDPBF16PS = range(1, 8)


# ----------------------------------------------------------------------------- the reference

def flush(x):
    """DAZ / FTZ: a denormal fp32 as a zero of its sign."""
    u = np.asarray(x, np.float32).view(np.uint32)
    return np.where((u & 0x7F800000) == 0, u & 0x80000000, u).astype(np.uint32).view(np.float32)


def bf16_to_f32(bits):
    return (np.asarray(bits, np.uint32) << 16).view(np.float32)


def fma_f32(a, b, c):
    """round_to_nearest_even_fp32(a * b + c) for fp32 a, b holding bf16 values and fp32 c."""
    a, b, c = (np.asarray(v, np.float64) for v in (a, b, c))
    with np.errstate(all="ignore"):
        p = a * b                               # exact: 8-bit x 8-bit significands
        s = p + c
        bb = s - p
        err = (p - (s - bb)) + (c - bb)         # TwoSum: s + err == p + c exactly
        odd = (s.view(np.uint64) & 1) == 1
        bump = np.isfinite(s) & (err != 0) & ~odd
        s = np.where(bump, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
        return s.astype(np.float32)


def tdpbf16ps_reference(c, a, b):
    """c: (M, N) fp32; a: (M, 2K) bf16 bits; b: (K, 2N) bf16 bits in the pair layout."""
    M, N = c.shape
    K = a.shape[1] // 2
    A, B = flush(bf16_to_f32(a)), flush(bf16_to_f32(b))
    temp = np.zeros((M, 2 * N), np.float32)  # every row m at once: the rows are independent
    for k in range(K):
        for j in (0, 1):
            temp[:, j::2] = flush(fma_f32(A[:, 2 * k + j, None], B[None, k, j::2], temp[:, j::2]))
    with np.errstate(all="ignore"):
        pair = flush(temp[:, 0::2] + temp[:, 1::2])
        out = flush(flush(c) + pair)
    return out


# ----------------------------------------------------------------------------- tile programs

class Program:
    """A tile program over one byte buffer (csrc/cpu/amx.h's encoding)."""

    def __init__(self, size=1 << 16):
        self.mem = np.zeros(size, np.uint8)
        self.code = []
        self.top = 0

    def alloc(self, nbytes, align=64):
        self.top = (self.top + align - 1) // align * align
        at = self.top
        self.top += nbytes
        assert self.top <= self.mem.size
        return at

    def put(self, rows_bytes, stride):
        """Rows (a 2-D uint8 array) at `stride` bytes apart; returns the offset."""
        r, w = rows_bytes.shape
        at = self.alloc((r - 1) * stride + w)
        for i in range(r):
            self.mem[at + i * stride: at + i * stride + w] = rows_bytes[i]
        return at

    def config(self, shapes, palette=1, start_row=0, raw=None):
        cfg = np.zeros(64, np.uint8) if raw is None else np.asarray(raw, np.uint8)
        if raw is None:
            cfg[0], cfg[1] = palette, start_row
            for t, (rows, colsb) in shapes.items():
                cfg[16 + 2 * t: 18 + 2 * t] = np.array([colsb], "<u2").view(np.uint8)
                cfg[48 + t] = rows
        at = self.alloc(64)
        self.mem[at: at + 64] = cfg
        self.op(LDTILECFG, offset=at)
        return at

    def op(self, code, t0=0, t1=0, t2=0, offset=0, stride=0):
        self.code.append([code, t0, t1, t2, offset, stride])

    def run(self, hardware=False, mxcsr=0):
        mem = self.mem.copy()
        probes().amx_run_tiles(np.array(self.code, np.int64).reshape(-1, 6), mem, hardware, mxcsr)
        return mem


def rows_of(mem, at, rows, width, stride):
    return np.stack([mem[at + i * stride: at + i * stride + width] for i in range(rows)])


def random_bf16(rng, shape, scale=1.0):
    return (rng.standard_normal(shape).astype(np.float32) * np.float32(scale)).view(np.uint32) >> 16


def gemm_program(M, K, N, a_list, b_list, c0, strides):
    """LDTILECFG; C (tmm0) loaded from c0; for each (A, B): load A into tmm1/tmm3 and B into
    tmm2/tmm4 (alternating) and TDPBF16PS; store C. Returns the program and where C lands."""
    p = Program()
    p.config({0: (M, 4 * N), 1: (M, 4 * K), 2: (K, 4 * N), 3: (M, 4 * K), 4: (K, 4 * N)})
    sa, sb, sc = strides
    p.op(TILELOADD, 0, offset=p.put(c0.view(np.uint8).reshape(M, 4 * N), sc), stride=sc)
    for i, (a, b) in enumerate(zip(a_list, b_list)):
        ta, tb = (1, 2) if i % 2 == 0 else (3, 4)
        p.op(TILELOADD, ta, offset=p.put(a.astype("<u2").view(np.uint8).reshape(M, 4 * K), sa), stride=sa)
        p.op(TILELOADD, tb, offset=p.put(b.astype("<u2").view(np.uint8).reshape(K, 4 * N), sb), stride=sb)
        p.op(TDPBF16PS, 0, ta, tb)
    out = p.alloc((M - 1) * sc + 4 * N)
    p.op(TILESTORED, 0, offset=out, stride=sc)
    return p, out


def run_gemm(M, K, N, a_list, b_list, c0, strides=None, hardware=False, mxcsr=0):
    strides = strides or (4 * K, 4 * N, 4 * N)
    p, out = gemm_program(M, K, N, a_list, b_list, c0, strides)
    mem = p.run(hardware, mxcsr)
    got = rows_of(mem, out, M, 4 * N, strides[2]).view(np.float32).reshape(M, N)
    return got


def expected_gemm(a_list, b_list, c0):
    c = c0.copy()
    for a, b in zip(a_list, b_list):
        c = tdpbf16ps_reference(c, a, b)
    return c


def assert_same_bits(got, want):
    """Bitwise, except that a NaN matches any NaN (the SDM does not define which NaN a
    TDPBF16PS with several NaN operands returns)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape
    nan_g, nan_w = np.isnan(got), np.isnan(want)
    assert np.array_equal(nan_g, nan_w), np.argwhere(nan_g != nan_w)[:5]
    g, w = got.view(np.uint32)[~nan_g], want.view(np.uint32)[~nan_w]
    bad = np.flatnonzero(g != w)
    assert bad.size == 0, (f"{bad.size} of {g.size} differ; first: got {got[~nan_g][bad[:4]]}, "
                           f"want {want[~nan_w][bad[:4]]}")


def random_case(rng, M, K, N, dots=3, scale=1.0):
    a_list = [random_bf16(rng, (M, 2 * K), scale) for _ in range(dots)]
    b_list = [random_bf16(rng, (K, 2 * N), scale) for _ in range(dots)]
    c0 = rng.standard_normal((M, N)).astype(np.float32)
    return a_list, b_list, c0


# ----------------------------------------------------------------------------- the model

def test_reference_fma_is_correctly_rounded():
    """The reference's FMA against exact rational arithmetic, on cases built to sit on and
    beside fp32 rounding boundaries, so that the reference is itself checked."""
    from fractions import Fraction
    rng = np.random.default_rng(5)
    a = bf16_to_f32(random_bf16(rng, 4000))
    b = bf16_to_f32(random_bf16(rng, 4000))
    c = (rng.standard_normal(4000) * np.exp2(rng.integers(-30, 30, 4000))).astype(np.float32)
    c[::3] = -(a[::3].astype(np.float64) * b[::3]).astype(np.float32)  # cancellation
    got = fma_f32(a, b, c)
    for i in range(0, 4000, 7):
        exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        lo = np.float32(float(exact))  # may be off by one ulp (double rounding): check the ties
        cands = [np.nextafter(lo, np.float32(-np.inf)), lo, np.nextafter(lo, np.float32(np.inf))]
        errs = [abs(Fraction(float(x)) - exact) for x in cands]
        best = min(errs)
        winners = [x for x, e in zip(cands, errs) if e == best]
        want = winners[0] if len(winners) == 1 else [x for x in winners if not (x.view(np.uint32) & 1)][0]
        assert got[i].view(np.uint32) == want.view(np.uint32), (a[i], b[i], c[i])


def test_tdpbf16ps_every_shape_edge():
    """M and K over every legal value (1..16 rows, 4..64 bytes per row of A), N cycling
    through 1..16, three accumulated products into a C loaded from memory."""
    rng = np.random.default_rng(1)
    for M in range(1, 17):
        for K in range(1, 17):
            N = (7 * M + 3 * K) % 16 + 1
            a, b, c0 = random_case(rng, M, K, N)
            assert_same_bits(run_gemm(M, K, N, a, b, c0), expected_gemm(a, b, c0))


def test_tdpbf16ps_strides_and_tiles():
    """Row strides wider than the rows (and a negative one), every tile as C."""
    rng = np.random.default_rng(2)
    M, K, N = 5, 7, 9
    a, b, c0 = random_case(rng, M, K, N, dots=4)
    got = run_gemm(M, K, N, a, b, c0, strides=(4 * K + 36, 4 * N + 4, 4 * N + 100))
    assert_same_bits(got, expected_gemm(a, b, c0))
    # a negative stride: rows stored bottom-up
    p = Program()
    p.config({0: (M, 4 * N), 1: (M, 4 * K), 2: (K, 4 * N)})
    flipped = a[0][::-1].astype("<u2").view(np.uint8).reshape(M, 4 * K)
    at = p.put(flipped, 4 * K)
    p.op(TILEZERO, 0)
    p.op(TILELOADD, 1, offset=at + (M - 1) * 4 * K, stride=-4 * K)
    p.op(TILELOADD, 2, offset=p.put(b[0].astype("<u2").view(np.uint8).reshape(K, 4 * N), 4 * N), stride=4 * N)
    p.op(TDPBF16PS, 0, 1, 2)
    out = p.alloc(M * 4 * N)
    p.op(TILESTORED, 0, offset=out, stride=4 * N)
    got = rows_of(p.run(), out, M, 4 * N, 4 * N).view(np.float32).reshape(M, N)
    assert_same_bits(got, tdpbf16ps_reference(np.zeros((M, N), np.float32), a[0], b[0]))
    for t in range(8):  # each tile as C, the next two as A and B
        ta, tb = (t + 1) % 8, (t + 2) % 8
        p = Program()
        p.config({t: (M, 4 * N), ta: (M, 4 * K), tb: (K, 4 * N)})
        p.op(TILELOADD, t, offset=p.put(c0.view(np.uint8).reshape(M, 4 * N), 4 * N), stride=4 * N)
        p.op(TILELOADD, ta, offset=p.put(a[1].astype("<u2").view(np.uint8).reshape(M, 4 * K), 4 * K), stride=4 * K)
        p.op(TILELOADD, tb, offset=p.put(b[1].astype("<u2").view(np.uint8).reshape(K, 4 * N), 4 * N), stride=4 * N)
        p.op(TDPBF16PS, t, ta, tb)
        out = p.alloc(M * 4 * N)
        p.op(TILESTORED, t, offset=out, stride=4 * N)
        got = rows_of(p.run(), out, M, 4 * N, 4 * N).view(np.float32).reshape(M, N)
        assert_same_bits(got, tdpbf16ps_reference(c0, a[1], b[1]))


def _bf16(x):
    return np.float32(x).view(np.uint32) >> 16


ROUNDING_CASES = {
    # C = 1; two products 3*2^-26 in one lane: the ISA sums them first (3*2^-25) and adds C
    # last: 1 + 1.5*2^-24 rounds up to 1 + 2^-23. C += each product would stay at 1.
    "c_added_last": ([[3 * 2.0**-13, 0, 3 * 2.0**-13, 0]], [[2.0**-13, 0], [2.0**-13, 0]], 1.0, 1 + 2.0**-23),
    # one lane: 1, then 2^-24 twice: each FMA rounds (1 + 2^-24 ties to 1, twice), where one
    # rounding of the exact sum would give 1 + 2^-23.
    "rounded_each_step": ([[1.0, 0, 2.0**-12, 0, 2.0**-12, 0]], [[1.0, 0], [2.0**-12, 0], [2.0**-12, 0]], 0.0, 1.0),
    # even lane 2^-24 twice (exactly 2^-23), odd lane 1: the lanes are summed apart and then
    # added: 1 + 2^-23. In pair order (even, odd, even) fp32 would round 1 + 2^-24 to 1 twice.
    "lanes_apart": ([[2.0**-12, 1.0, 2.0**-12, 0]], [[2.0**-12, 1.0], [2.0**-12, 0]], 0.0, 1 + 2.0**-23),
    # B's pair layout: A = (1, 2), B row 0 = (x, y): the result is 1*x + 2*y.
    "pair_order": ([[1.0, 2.0]], [[3.0, 5.0]], 0.0, 13.0),
}


@pytest.mark.parametrize("name", sorted(ROUNDING_CASES))
def test_tdpbf16ps_rounding_rule(name):
    """Cases where the ISA's order and rounding differ from a naive fp32 dot product; the
    expected value is worked out by hand (in the table) and the reference must agree."""
    a_vals, b_vals, c_val, want = ROUNDING_CASES[name]
    a = np.array([[_bf16(v) for v in row] for row in a_vals], np.uint32)
    b = np.array([[_bf16(v) for v in row] for row in b_vals], np.uint32)
    c0 = np.full((1, 1), c_val, np.float32)
    assert np.all(bf16_to_f32(a) == np.array(a_vals, np.float32))  # the values are exact bf16
    ref = tdpbf16ps_reference(c0, a, b)
    assert ref[0, 0] == np.float32(want)
    got = run_gemm(1, a.shape[1] // 2, 1, [a], [b], c0)
    assert_same_bits(got, [[np.float32(want)]])


def test_tdpbf16ps_denormals():
    """Denormal bf16 inputs and a denormal C read as zero; a denormal result is flushed to a
    zero of its sign (at every step: a lane whose FMA result is denormal restarts from 0)."""
    tiny = 2.0**-70
    den = np.uint32(0x0040)  # a denormal bf16 (exponent 0): 2^-127 * 0.5
    cases = [
        # A x B -> 2^-140: denormal fp32 -> flushed; C = 0 stays +0
        ([[tiny, 0]], [[tiny, 0]], 0.0, 0.0),
        # negative: the flushed lane is -0, then -0 + +0 (odd lane) = +0, C = -0: -0 + +0 = +0
        ([[-tiny, 0]], [[tiny, 0]], -0.0, 0.0),
        # denormal C is read as zero: 2^-140 + 1 * 1 = 1, and C alone is not kept
        ([[1.0, 0]], [[1.0, 0]], 2.0**-140, 1.0),
        # 2^-63 * 2^-63 = 2^-126 is the smallest normal: kept
        ([[2.0**-63, 0]], [[2.0**-63, 0]], 0.0, 2.0**-126),
        # C = 1.5 * 2^-126 plus a lane of -2^-126 (normal) = 2^-127: the sum is flushed
        ([[2.0**-63, 0]], [[-2.0**-63, 0]], 2.0**-126 * 1.5, 0.0),
    ]
    for a_vals, b_vals, c_val, want in cases:
        a = np.array([[_bf16(v) for v in r] for r in a_vals], np.uint32)
        b = np.array([[_bf16(v) for v in r] for r in b_vals], np.uint32)
        c0 = np.full((1, 1), c_val, np.float32)
        ref = tdpbf16ps_reference(c0, a, b)
        assert ref[0, 0].view(np.uint32) == np.float32(want).view(np.uint32), (a_vals, b_vals, c_val, ref)
        assert_same_bits(run_gemm(1, 1, 1, [a], [b], c0), ref)
    # denormal bf16 operands read as zero, among random ones
    rng = np.random.default_rng(3)
    M, K, N = 6, 8, 5
    a, b, c0 = random_case(rng, M, K, N, dots=2)
    a[0][rng.random(a[0].shape) < 0.3] = den
    b[1][rng.random(b[1].shape) < 0.3] = den | 0x8000
    c0[rng.random(c0.shape) < 0.3] = np.float32(-2.0**-130)
    a[1][:, :] = random_bf16(rng, a[1].shape, 2.0**-66)  # products near the fp32 underflow
    b[1][:, :] = random_bf16(rng, b[1].shape, 2.0**-62)
    assert_same_bits(run_gemm(M, K, N, a, b, c0), expected_gemm(a, b, c0))


def test_tdpbf16ps_infinities_nan_overflow():
    rng = np.random.default_rng(4)
    M, K, N = 4, 5, 6
    a, b, c0 = random_case(rng, M, K, N, dots=2)
    inf, nan = _bf16(np.inf), _bf16(np.nan)
    a[0][0, 0], a[0][1, 3] = inf, inf | 0x8000
    b[0][2, 4] = nan
    b[0][0, 0] = 0                      # inf * 0 -> NaN in row 0, column 0
    c0[3, 2] = np.inf
    c0[2, 1] = -np.inf
    a[1][3, :] = _bf16(2.0**100)        # 2^100 * 2^100 overflows fp32: inf
    b[1][:, :] = _bf16(2.0**100)
    want = expected_gemm(a, b, c0)
    assert np.isnan(want).any() and np.isinf(want).any()
    assert_same_bits(run_gemm(M, K, N, a, b, c0), want)


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.uname().machine != "x86_64",
                    reason="MXCSR is x86's")
def test_tdpbf16ps_ignores_mxcsr():
    """Round toward zero with FTZ and DAZ set by the caller changes nothing (TDPBF16PS:
    'MXCSR is not consulted nor updated')."""
    rng = np.random.default_rng(6)
    M, K, N = 8, 16, 8
    a, b, c0 = random_case(rng, M, K, N)
    plain = run_gemm(M, K, N, a, b, c0)
    rz_ftz_daz = 0x1F80 | (3 << 13) | (1 << 15) | (1 << 6)
    assert_same_bits(run_gemm(M, K, N, a, b, c0, mxcsr=rz_ftz_daz), plain)
    assert_same_bits(plain, expected_gemm(a, b, c0))


def test_tile_config_faults_and_round_trip():
    """LDTILECFG's #GP rules and the #UD of a tile instruction on unconfigured or
    mismatched tiles, as ValueErrors naming the rule; STTILECFG returns what was loaded."""
    def raises(build, what):
        p = Program()
        build(p)
        with pytest.raises(ValueError, match=what):
            p.run()

    raises(lambda p: p.config({}, palette=2), "#GP.*palette")
    raises(lambda p: p.config({0: (17, 64)}), "#GP.*rows")
    raises(lambda p: p.config({0: (16, 68)}), "#GP.*colsb")
    raises(lambda p: p.config({0: (0, 64)}), "#GP.*not both")
    raw = np.zeros(64, np.uint8)
    raw[0], raw[5] = 1, 1
    raises(lambda p: p.config({}, raw=raw), "#GP.*reserved")
    raw = np.zeros(64, np.uint8)
    raw[0], raw[32] = 1, 4  # tmm8's colsb
    raises(lambda p: p.config({}, raw=raw), "#GP.*reserved")
    raises(lambda p: p.op(TILEZERO, 0), "#UD.*not configured")
    raises(lambda p: (p.config({0: (2, 8)}), p.op(TILELOADD, 1, offset=0, stride=8)), "#UD.*tmm1")
    raises(lambda p: (p.config({0: (2, 8), 1: (2, 8), 2: (2, 8)}), p.op(TDPBF16PS, 0, 1, 1)), "#UD")
    raises(lambda p: (p.config({0: (2, 8), 1: (3, 8), 2: (2, 8)}), p.op(TDPBF16PS, 0, 1, 2)), "#UD.*rows")
    raises(lambda p: (p.config({0: (2, 8), 1: (2, 8), 2: (3, 8)}), p.op(TDPBF16PS, 0, 1, 2)), "#UD.*B has")
    raises(lambda p: (p.config({0: (2, 6), 1: (2, 8), 2: (2, 6)}), p.op(TDPBF16PS, 0, 1, 2)), "#UD.*multiple of 4")
    raises(lambda p: (p.config({0: (2, 8)}), p.op(TILELOADD, 0, offset=p.mem.size - 8, stride=8)), "bytes")
    raises(lambda p: (p.config({0: (2, 8)}), p.op(TILERELEASE), p.op(TILEZERO, 0)), "#UD.*not configured")
    p = Program()
    at = p.config({0: (16, 64), 3: (5, 12), 7: (1, 4)})
    out = p.alloc(64)
    p.op(STTILECFG, offset=out)
    mem = p.run()
    assert np.array_equal(mem[out: out + 64], mem[at: at + 64])
    p.op(TILERELEASE)
    p.op(STTILECFG, offset=out)
    assert not p.run()[out: out + 64].any()


def test_tileloadd_zero_fills_and_stores_only_colsb():
    """TILELOADD reads colsb bytes per row; TILESTORED writes colsb bytes per row and leaves
    the bytes between rows alone."""
    rng = np.random.default_rng(7)
    p = Program()
    p.config({0: (3, 12)})
    src = rng.integers(0, 256, (3, 12), dtype=np.uint8)
    p.op(TILELOADD, 0, offset=p.put(src, 20), stride=20)
    out = p.alloc(3 * 20)
    p.mem[out: out + 60] = 0xAB
    p.op(TILESTORED, 0, offset=out, stride=20)
    mem = p.run()
    assert np.array_equal(rows_of(mem, out, 3, 12, 20), src)
    assert (mem[out: out + 60].reshape(3, 20)[:, 12:] == 0xAB).all()


# ----------------------------------------------------------------------------- the hardware

def _amx_skip_reason():
    if not _C.amx_hardware_built():
        return "this build has no AMX instructions (the compiler did not take -mamx-tile -mamx-bf16)"
    if "amx_permitted" not in fmha.cpu_features():
        return f"AMX is not usable here: {_C.amx_note()}"
    return None


def test_model_matches_hardware():
    """Where the CPU has AMX: the hardware and the model give the same bits on the programs
    above (every shape edge sampled, strides, denormals, infinities, the rounding cases)."""
    reason = _amx_skip_reason()
    if reason:
        pytest.skip(reason)
    rng = np.random.default_rng(8)
    for M, K, N in [(1, 1, 1), (16, 16, 16), (3, 11, 7), (16, 1, 16), (1, 16, 1), (9, 5, 13)]:
        for scale in (1.0, 2.0**-62, 2.0**60):
            a, b, c0 = random_case(rng, M, K, N, scale=scale)
            strides = (4 * K + 8, 4 * N, 4 * N + 4)
            assert_same_bits(run_gemm(M, K, N, a, b, c0, strides, hardware=True),
                             run_gemm(M, K, N, a, b, c0, strides))
    for a_vals, b_vals, c_val, _ in ROUNDING_CASES.values():
        a = np.array([[_bf16(v) for v in r] for r in a_vals], np.uint32)
        b = np.array([[_bf16(v) for v in r] for r in b_vals], np.uint32)
        c0 = np.full((1, 1), c_val, np.float32)
        K = a.shape[1] // 2
        assert_same_bits(run_gemm(1, K, 1, [a], [b], c0, hardware=True), run_gemm(1, K, 1, [a], [b], c0))


# ----------------------------------------------------------------------------- the level

def _cpuinfo_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def test_detection_agrees_with_the_os():
    """fmha reports AMX only where Linux lists it; the amx level is the best one exactly where
    the tiles are the hardware's (usable and built: the model is never picked by default); a
    host without AMX says why."""
    feats = fmha.cpu_features()
    flags = _cpuinfo_flags()
    if flags is not None and "amx_tile" not in flags:
        assert not any(f.startswith("amx_") for f in feats), feats
        assert _C.amx_note()
        assert _C.cpu_amx_peak_gflops(1) == 0
    if flags is not None and "amx_bf16" in flags and "amx_tile" in flags:
        assert "amx_bf16" in feats and "amx_tile" in feats, feats
    on_hardware = "amx_permitted" in feats and _C.amx_hardware_built()
    assert (_C.best_cpu_isa() == "amx") == on_hardware, (_C.best_cpu_isa(), feats)


def test_decision_table():
    d = probes().amx_decide
    amx = (1 << 22) | (1 << 24)
    tiles = 3 << 17
    r = d(0, tiles, False, 0)
    assert not r["permitted"] and r["asked"] == 0 and "CPU" in r["note"]
    r = d(1 << 24, tiles, False, 0)                     # AMX-TILE without AMX-BF16
    assert not r["permitted"] and r["asked"] == 0 and not r["bf16"]
    r = d(amx, 1 << 17, False, 0)                       # XTILEDATA not enabled by the OS
    assert not r["permitted"] and r["asked"] == 0 and "XCR0" in r["note"]
    r = d(amx, tiles, True, 0)                          # FMHA_AMX_DENY=1
    assert not r["permitted"] and r["asked"] == 0 and "FMHA_AMX_DENY" in r["note"]
    r = d(amx, tiles, False, 1)                         # the kernel refuses (EPERM)
    assert not r["permitted"] and r["asked"] == 1 and "ARCH_REQ_XCOMP_PERM" in r["note"]
    r = d(amx, tiles, False, 0)
    assert r["permitted"] and r["asked"] == 1 and r["note"] == ""


def test_refused_permission_falls_back_cleanly():
    """FMHA_AMX_DENY=1 (the kernel's refusal, forced): no amx_permitted, the same level and
    results as without it, a zero AMX peak, and the hardware path refused with the reason."""
    code = textwrap.dedent("""
        import json, sys, numpy as np, fmha
        from fmha import _C
        rng = np.random.default_rng(0)
        q, k, v = (rng.standard_normal((1, 33, 2, 16)).astype(np.float32) for _ in range(3))
        out = np.asarray(fmha.attention(q, k, v))
        hw = "ran"
        if _C.testing_build:
            try:
                _C.amx_run_tiles(np.array([[3, 0, 0, 0, 0, 0]], np.int64), np.zeros(64, np.uint8), True)
            except NotImplementedError as e:
                hw = str(e)
        print(json.dumps(dict(features=fmha.cpu_features(), isa=fmha.cpu_isa(), note=_C.amx_note(),
                              peak=_C.cpu_amx_peak_gflops(1), out=out.ravel()[:64].tolist(), hw=hw)))
    """)
    runs = {}
    for deny in ("0", "1"):
        env = dict(os.environ, FMHA_AMX_DENY=deny)
        env.pop("FMHA_CPU_ISA", None)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
        import json
        runs[deny] = json.loads(r.stdout)
    denied = runs["1"]
    assert "amx_permitted" not in denied["features"]
    assert denied["isa"] == runs["0"]["isa"] == _C.best_cpu_isa()
    assert denied["out"] == runs["0"]["out"]
    assert denied["peak"] == 0
    assert denied["note"]
    if _C.testing_build:
        assert denied["hw"] != "ran" and ("AMX" in denied["hw"])
    if "amx_bf16" in denied["features"]:  # a CPU with AMX: the hook is what refused it
        assert "FMHA_AMX_DENY" in denied["note"]


def _amx_level_runs_here():
    """The amx level runs wherever the avx512bf16 level does (through the model without AMX)."""
    return _C.best_cpu_isa() in ("avx512bf16", "amx")


def test_forcing_the_amx_level():
    """FMHA_CPU_ISA=amx selects the amx level on any CPU with AVX512-BF16 (through the AMX model
    where the tiles are not the hardware's); elsewhere it is a clear error."""
    code = ("import numpy as np, fmha; print(fmha.cpu_isa()); "
            "fmha.attention(*(np.ones((1, 2, 1, 4), np.float32),) * 3)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ, FMHA_CPU_ISA="amx"))
    if _amx_level_runs_here():
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == ["amx"]
    else:
        assert r.returncode != 0
        assert "FMHA_CPU_ISA=amx" in r.stderr and "AVX512-BF16" in r.stderr, r.stderr


@pytest.fixture
def amx_level():
    """The amx level for one test (restored after); skips where it cannot run."""
    if not _amx_level_runs_here():
        pytest.skip(f"the amx level needs AVX512-BF16 (best level here: {_C.best_cpu_isa()})")
    before = fmha.cpu_isa()
    _C.set_cpu_isa("amx")
    try:
        yield
    finally:
        if _C.testing_build:
            _C.amx_plant_fault(0)
        _C.set_cpu_isa(before)


def _tiles_are_hardware():
    return "amx_permitted" in fmha.cpu_features() and _C.amx_hardware_built()


# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, d, dv, causal): whole and partial 16-row
# tiles, head_dim a multiple of 32 (K read in place) or not (K repacked), one and two steps of
# 16 pairs in P V (odd key counts), GQA, and dv != d.
AMX_SHAPES = [
    (1, 64, 64, 2, 2, 64, 64, False),
    (2, 100, 100, 3, 3, 64, 64, True),
    (1, 37, 45, 4, 2, 40, 40, False),
    (1, 130, 77, 2, 1, 128, 96, True),
    (1, 33, 129, 2, 2, 16, 16, False),
    (1, 65, 200, 1, 1, 256, 256, False),
    (1, 48, 31, 2, 2, 80, 24, False),
]


@pytest.mark.parametrize("shape", AMX_SHAPES, ids=[f"{s[1]}x{s[2]}-h{s[3]}/{s[4]}-d{s[5]}/{s[6]}{'-causal' if s[7] else ''}" for s in AMX_SHAPES])
def test_amx_forward_against_avx512bf16_and_the_reference(amx_level, shape):
    """The amx level's bfloat16 forward (S and P V on tiles; P rounded to bfloat16 as at the
    avx512bf16 level) is not bitwise the avx512bf16 level's: TDPBF16PS keeps two fp32 chains per
    column (even and odd elements of the pairs) and adds them to C once per 32-element step,
    where VDPBF16PS chains every product of a lane. The fp32 sums differ in their last bits, so
    a few outputs round to the neighbouring bfloat16: at least 99% of the outputs are bitwise
    equal, the rest differ by at most 2^-7 max|out| (one bfloat16 unit of the largest output),
    and each level's error against the float64 reference is within 1.5x the other's plus
    2^-9 max|out| (the same bound: the suite's tolerance rule holds both)."""
    import torch
    b, sq, sk, hq, hkv, d, dv, causal = shape
    g = torch.Generator().manual_seed(sq * 1000 + sk)
    q = torch.randn(b, sq, hq, d, generator=g).to(torch.bfloat16)
    k = torch.randn(b, sk, hkv, d, generator=g).to(torch.bfloat16)
    v = torch.randn(b, sk, hkv, dv, generator=g).to(torch.bfloat16)
    out_amx, lse_amx = fmha.attention(q, k, v, causal=causal, return_lse=True)
    _C.set_cpu_isa("avx512bf16")
    out_ref_level, lse_ref_level = fmha.attention(q, k, v, causal=causal, return_lse=True)
    _C.set_cpu_isa("amx")
    exact = reference_out(q, k, v, causal)
    top = float(exact.abs().max())
    diff = float((out_amx.double() - out_ref_level.double()).abs().max())
    assert diff <= 2.0**-7 * top, (diff, top)
    assert float((out_amx == out_ref_level).float().mean()) >= 0.99
    torch.testing.assert_close(lse_amx, lse_ref_level, rtol=0, atol=1e-4)  # -inf: no key
    err_amx = float((out_amx.double() - exact).abs().max())
    err_bf16 = float((out_ref_level.double() - exact).abs().max())
    assert err_amx <= 1.5 * err_bf16 + 2.0**-9 * top, (err_amx, err_bf16)
    assert err_bf16 <= 1.5 * err_amx + 2.0**-9 * top, (err_amx, err_bf16)
    # float32 at the amx level is the avx512bf16 level's code: bitwise the same
    qf, kf, vf = q.float(), k.float(), v.float()
    a = fmha.attention(qf, kf, vf, causal=causal)
    _C.set_cpu_isa("avx512bf16")
    bb = fmha.attention(qf, kf, vf, causal=causal)
    _C.set_cpu_isa("amx")
    assert torch.equal(a, bb)


def reference_out(q, k, v, causal):
    """softmax(q kᵀ / sqrt(d)) v in float64 (GQA: each kv head serves its group; causal aligned
    bottom-right)."""
    import torch
    qd, kd, vd = (x.double().transpose(1, 2) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    kd, vd = kd.repeat_interleave(group, 1), vd.repeat_interleave(group, 1)
    s = qd @ kd.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:  # bottom-right aligned, as fmha's causal
        sq, sk = q.shape[1], k.shape[1]
        i = torch.arange(sq)[:, None] + (sk - sq)
        s = s.masked_fill(torch.arange(sk)[None, :] > i, float("-inf"))
    # a row that sees no key (causal, seqlen_q > seqlen_k) is 0, as fmha's
    return torch.nan_to_num(torch.softmax(s, -1) @ vd, nan=0.0).transpose(1, 2)


@pytest.mark.parametrize("fault", [1, 2], ids=["model-drops-odd-elements", "kernel-swaps-P-pairs"])
def test_planted_faults_change_only_the_amx_forward(amx_level, fault):
    """A fault planted in the model (TDPBF16PS) or the kernel (P's repack into tile rows) makes
    the amx level's bfloat16 forward wrong -- and nothing else: the avx512bf16 level and the amx
    level's float32 are untouched. (The model's fault cannot reach hardware tiles: there
    test_planted_faults_fail_the_suite runs the model with FMHA_AMX_DENY=1.)"""
    import torch
    if fault == 1 and _tiles_are_hardware():
        pytest.skip("the tiles here are the hardware's; the model's fault is checked with "
                    "FMHA_AMX_DENY=1 in test_planted_faults_fail_the_suite")
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 70, 2, 64, generator=g).to(torch.bfloat16) for _ in range(3))
    clean = fmha.attention(q, k, v)
    f32 = fmha.attention(q.float(), k.float(), v.float())
    probes().amx_plant_fault(fault)
    wrong = fmha.attention(q, k, v)
    f32_planted = fmha.attention(q.float(), k.float(), v.float())
    _C.set_cpu_isa("avx512bf16")
    other_level = fmha.attention(q, k, v)
    _C.set_cpu_isa("amx")
    probes().amx_plant_fault(0)
    exact = reference_out(q, k, v, False)
    top = float(exact.abs().max())
    assert float((clean.double() - exact).abs().max()) < 0.02 * top
    assert float((wrong.double() - exact).abs().max()) > 0.1 * top
    assert torch.equal(f32, f32_planted)
    assert float((other_level.double() - exact).abs().max()) < 0.02 * top
    assert torch.equal(fmha.attention(q, k, v), clean)  # removed: the level is right again


# Slices of the AMX level's kernel suite: the forward's bfloat16 cases and the KV-cache decode's
# GQA cases (more than 4 rows per kv head: on tiles).
SUITE_SLICES = {
    "forward": ("kernels/test_cpu_attention.py",
                "bfloat16 and (test_dtypes or test_causal or test_gqa_mqa or test_odd_head_dim)"),
    "decode": ("kvcache/test_kvcache.py", "bfloat16 and gqa"),
}


def _run_suite_slice(name, fault):
    """Runs a slice at FMHA_CPU_ISA=amx through the model (FMHA_AMX_DENY=1: on an AMX host too)
    with fault `fault` planted (FMHA_TEST_AMX_PLANT, tests/conftest.py)."""
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path, select = SUITE_SLICES[name]
    env = dict(os.environ, FMHA_CPU_ISA="amx", FMHA_AMX_DENY="1", FMHA_TEST_AMX_PLANT=str(fault))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         os.path.join(tests, path), "-k", select],
        capture_output=True, text=True, env=env, cwd=tests)


@pytest.mark.parametrize("fault", [0, 1, 2], ids=["none", "model-drops-odd-elements", "kernel-swaps-P-pairs"])
@pytest.mark.parametrize("name", sorted(SUITE_SLICES))
def test_planted_faults_fail_the_suite(name, fault):
    """The AMX level's part of the kernel suite (tests/run_all_isas.py runs it at
    FMHA_CPU_ISA=amx) passes as it is and fails with either fault planted: the model's
    TDPBF16PS reading A's odd elements as zero, or the kernels' repack of P into tile rows
    swapping the halves of each pair word."""
    probes()
    if not _amx_level_runs_here():
        pytest.skip(f"the amx level needs AVX512-BF16 (best level here: {_C.best_cpu_isa()})")
    r = _run_suite_slice(name, fault)
    if fault == 0:
        assert r.returncode == 0, r.stdout[-3000:]
        assert " passed" in r.stdout and "failed" not in r.stdout
    else:
        assert r.returncode == 1, r.stdout[-3000:]
        assert " failed" in r.stdout


@pytest.mark.parametrize("sq,hq,hkv", [(1, 8, 1), (3, 12, 4), (16, 2, 2), (1, 4, 1), (2, 2, 1)])
def test_amx_decode(amx_level, sq, hq, hkv):
    """Decode-shaped calls (a few queries against many keys) take the tiles where a GQA group
    and the queries fill more than 4 rows per kv head, and the avx512bf16 level's dot products
    otherwise: a planted fault changes the output exactly in the first case. Either way the
    output is within the bound of the tiled forward's test of the avx512bf16 level's."""
    import torch
    g = torch.Generator().manual_seed(sq * 100 + hq)
    q = torch.randn(2, sq, hq, 80, generator=g).to(torch.bfloat16)
    k = torch.randn(2, 300, hkv, 80, generator=g).to(torch.bfloat16)
    v = torch.randn(2, 300, hkv, 48, generator=g).to(torch.bfloat16)
    out = fmha.attention(q, k, v)
    _C.set_cpu_isa("avx512bf16")
    other = fmha.attention(q, k, v)
    _C.set_cpu_isa("amx")
    top = float(reference_out(q, k, v, False).abs().max())
    assert float((out.double() - other.double()).abs().max()) <= 2.0**-7 * top
    assert float((out == other).float().mean()) >= 0.99
    if _C.testing_build and not _tiles_are_hardware():
        _C.amx_plant_fault(1)
        planted = fmha.attention(q, k, v)
        _C.amx_plant_fault(0)
        on_tiles = sq * hq // hkv > 4
        assert torch.equal(planted, out) != on_tiles


@pytest.mark.parametrize("shape", [(1, 64, 64, 2, 2, 64, 64, False), (2, 100, 90, 4, 2, 40, 40, True),
                                   (1, 7, 300, 8, 2, 80, 48, False), (1, 130, 33, 2, 2, 128, 96, True)],
                         ids=["64x64-d64", "100x90-gqa-d40-causal", "7x300-gqa-d80/48", "130x33-d128/96-causal"])
def test_amx_backward(amx_level, shape):
    """The bfloat16 backward at the amx level (its five pair products on tiles) against the
    avx512bf16 level's: at least 99% of each gradient's elements bitwise equal and the rest
    within 2^-7 max|grad|. With the model's fault planted for the backward alone (the forward
    run clean), every gradient changes: the products run on the tiles."""
    import torch
    b, sq, sk, hq, hkv, d, dv, causal = shape
    g = torch.Generator().manual_seed(sq + 10 * sk)
    q = torch.randn(b, sq, hq, d, generator=g).to(torch.bfloat16)
    k = torch.randn(b, sk, hkv, d, generator=g).to(torch.bfloat16)
    v = torch.randn(b, sk, hkv, dv, generator=g).to(torch.bfloat16)
    do = torch.randn(b, sq, hq, dv, generator=g).to(torch.bfloat16)

    def grads(isa, fault=0):
        _C.set_cpu_isa(isa)
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = fmha.attention(*leaves, causal=causal)
        if fault:
            probes().amx_plant_fault(fault)
        try:
            out.backward(do)
        finally:
            if fault:
                probes().amx_plant_fault(0)
            _C.set_cpu_isa("amx")
        return [x.grad for x in leaves]

    amx, other = grads("amx"), grads("avx512bf16")
    for name, a, o in zip(("dq", "dk", "dv"), amx, other):
        top = float(o.double().abs().max())
        assert float((a.double() - o.double()).abs().max()) <= 2.0**-7 * top, name
        assert float((a == o).float().mean()) >= 0.99, name
    if _C.testing_build and not _tiles_are_hardware():
        planted = grads("amx", fault=1)
        for name, a, w in zip(("dq", "dk", "dv"), amx, planted):
            assert float((a.double() - w.double()).abs().max()) > 0.05 * float(a.double().abs().max()), name


def test_amx_forward_model_matches_hardware():
    """Where the tiles are the hardware's: the amx level's forward (tiled and decode) and
    backward through the hardware and through the model (FMHA_AMX_DENY=1) give the same bits."""
    reason = _amx_skip_reason()
    if reason:
        pytest.skip(reason)
    code = textwrap.dedent("""
        import hashlib, torch, fmha
        g = torch.Generator().manual_seed(3)
        outs = []
        # (batch, seqlen_q, seqlen_k, heads_q, heads_kv, d): tiled forwards, and a GQA decode
        for (b, sq, sk, hq, hkv, d), causal in (((2, 100, 100, 3, 3, 64), True), ((1, 37, 37, 2, 2, 40), False),
                                                ((1, 65, 65, 1, 1, 256), False), ((2, 2, 300, 8, 2, 80), False)):
            q = torch.randn(b, sq, hq, d, generator=g).to(torch.bfloat16).requires_grad_()
            k, v = (torch.randn(b, sk, hkv, d, generator=g).to(torch.bfloat16).requires_grad_()
                    for _ in range(2))
            o, lse = fmha.attention(q, k, v, causal=causal, return_lse=True)
            o.backward(torch.randn(o.shape, generator=g).to(torch.bfloat16))
            outs += [x.detach().view(torch.int16).flatten().tolist() for x in (o, q.grad, k.grad, v.grad)]
            outs.append(lse.detach().flatten().tolist())
        print(fmha.cpu_isa(), hashlib.sha256(str(outs).encode()).hexdigest())
    """)
    runs = {}
    for deny in ("0", "1"):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env=dict(os.environ, FMHA_CPU_ISA="amx", FMHA_AMX_DENY=deny))
        runs[deny] = r.stdout.split()
    assert runs["0"][0] == runs["1"][0] == "amx"
    assert runs["0"][1] == runs["1"][1]


def test_amx_peak_probe():
    """The TDPBF16PS peak: measured where AMX is usable, 0 elsewhere."""
    peak = _C.cpu_amx_peak_gflops(1)
    if _amx_skip_reason():
        assert peak == 0
    else:
        assert peak > 0
