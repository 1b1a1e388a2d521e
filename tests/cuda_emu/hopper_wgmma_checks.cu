// wgmma.mma_async through the emulator: GEMMs D = A * B (+ C) of a warpgroup for every
// swizzle mode, both majors, A from shared memory and from registers, f16, bf16 and the
// 8-bit types, against plain host loops; the asynchrony rules; and planted bugs.
//
// The shared-memory tiles are built on the host from the canonical layouts as the PTX ISA
// ("Shared Memory Matrix Layout") and CuTe's GMMA atoms describe them -- swizzle atoms of
// 8 rows by the swizzle span, the 16-byte chunk c of atom row r stored at chunk
// c ^ ((r * span / 128) mod (span / 16)), core matrices of 8 rows by 16 bytes without a
// swizzle -- written here independently of the emulator's address arithmetic; the
// accumulator and A-fragment layouts are the ISA figures' formulas, also written out here.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/emu/runtime_internal.h"
#include "cuda/hopper.cuh"
#include "emu_test.h"

using namespace fmha::gpu;
using emu_test::fail;
using emu_test::launch_error;
using emu_test::pass;
using emu_test::Result;

namespace {

enum class Ty { kF16, kBF16, kE4M3, kE5M2 };
int bytes_of(Ty t) { return t == Ty::kF16 || t == Ty::kBF16 ? 2 : 1; }

// Encodings of small integers (|v| <= 7), written from the formats' definitions.
uint16_t encode(Ty t, int v) {
  if (t == Ty::kF16) return bits_of(from_float<half_t>(float(v)));
  if (t == Ty::kBF16) return bits_of(from_float<bf16_t>(float(v)));
  if (v == 0) return 0;
  const unsigned s = v < 0 ? 1u : 0u;
  const int a = v < 0 ? -v : v;
  int e = 0;
  while ((2 << e) <= a) ++e;                 // a = (1 + m / 8) * 2^e
  const int eighths = (a << 3 >> e) - 8;     // m in eighths (exact for |v| <= 7)
  if (t == Ty::kE4M3) return uint16_t(s << 7 | unsigned(e + 7) << 3 | unsigned(eighths));
  return uint16_t(s << 7 | unsigned(e + 15) << 2 | unsigned(eighths / 2));  // e5m2
}

// Where element (mn, k) of an operand of `rows` M/N-rows lives, in bytes from the operand's
// start, and the descriptor fields for the k-step starting at k0.
struct Layout {
  bool mn_major;
  int span;  // 0 (no swizzle), 32, 64, 128
  int rows, eb;
  size_t place(int mn, int k) const {
    if (!mn_major) {
      if (span == 0) {  // core matrices (8 rows x 16 B), M first then K
        const int T = 16 / eb;
        return size_t((k / T) * (rows / 8) + mn / 8) * 128 + size_t(mn % 8) * 16 + size_t(k % T) * eb;
      }
      const int W = span / eb, r = mn % 8;  // atoms of 8 rows x span bytes, M first
      const size_t atom = size_t((k / W) * (rows / 8) + mn / 8);
      const int byte = (k % W) * eb, chunk = (byte / 16) ^ ((r * span / 128) % (span / 16));
      return atom * 8 * size_t(span) + size_t(r) * span + size_t(chunk) * 16 + size_t(byte % 16);
    }
    if (span == 0) {  // core matrices of 8 K-rows x 8 M/N elements, M/N first
      const int T = 16 / eb;
      return size_t((k / 8) * (rows / T) + mn / T) * 128 + size_t(k % 8) * 16 + size_t(mn % T) * eb;
    }
    const int W = span / eb, r = k % 8;  // atoms of 8 K-rows x span bytes of M/N, M/N first
    const size_t atom = size_t((k / 8) * (rows / W) + mn / W);
    const int byte = (mn % W) * eb, chunk = (byte / 16) ^ ((r * span / 128) % (span / 16));
    return atom * 8 * size_t(span) + size_t(r) * span + size_t(chunk) * 16 + size_t(byte % 16);
  }
  size_t bytes(int K) const {  // one past the last byte any element occupies
    size_t end = 0;
    for (int mn = 0; mn < rows; ++mn)
      for (int k = 0; k < K; ++k) end = std::max(end, place(mn, k) + size_t(eb));
    return (end + 127) / 128 * 128;
  }
  // leading / stride byte offsets and the start of the k-step at k0
  uint32_t lbo() const {
    if (!mn_major) return span == 0 ? uint32_t(rows / 8 * 128) : 16;
    return span == 0 ? uint32_t(rows / (16 / eb) * 128) : uint32_t(8 * span);
  }
  uint32_t sbo() const {
    if (!mn_major) return span == 0 ? 128 : uint32_t(8 * span);
    return span == 0 ? 128 : uint32_t(rows / (span / eb) * 8 * span);
  }
  size_t step_start(int k0) const {
    if (!mn_major) {
      if (span == 0) return size_t(k0 / (16 / eb)) * lbo();
      const int W = span / eb;
      return size_t(k0 / W) * size_t(rows / 8) * 8 * size_t(span) + size_t(k0 % W) * eb;
    }
    return size_t(k0 / 8) * (span == 0 ? lbo() : sbo());
  }
};

SmemSwizzle swizzle_of(int span) {
  return span == 128 ? SmemSwizzle::k128B : span == 64 ? SmemSwizzle::k64B
         : span == 32 ? SmemSwizzle::k32B : SmemSwizzle::kNone;
}

constexpr int kMaxSteps = 4;
struct Params {
  const uint8_t* image;  // the shared-memory image (A then B)
  int image_bytes;
  uint32_t a_start[kMaxSteps], b_start[kMaxSteps];
  uint32_t a_lbo, a_sbo, b_lbo, b_sbo;
  SmemSwizzle a_swz, b_swz, b_swz_desc;  // b_swz_desc: what the descriptor claims
  int steps;
  bool use_c;
  const uint16_t* a_bits;  // A (64 x K, row-major encodings) for the register path
  int K;
  const float* c;  // C (64 x N) for use_c
  float* d;        // D (64 x N) out
  int bug;         // planted bugs: 1 read before wait, 2 overwrite B before wait, 3 no fence.proxy.async
};

// One warpgroup: stage the image, then the K-steps of wgmma, then the accumulators out.
template <int N, typename T, typename TB, bool kARegs, int kTransA, int kTransB, int kScaleA,
          bool kGroupPerStep>
__global__ void wgmma_gemm_kernel(Params p) {
  FMHA_DYNAMIC_SHARED(uint8_t, smem);
  const int tid = threadIdx.x, w = tid / 32, lane = tid % 32, g = lane / 4, q = lane % 4;
  for (int i = tid; i < p.image_bytes; i += 128) smem[i] = p.image[i];
  if (p.bug != 3) fence_proxy_async();  // generic writes, read next by the async proxy
  __syncthreads();

  float d[N / 2];
  for (int r = 0; r < N / 2; ++r) {  // accumulator fragment (ISA figure for m64nNk16 D)
    const int row = 16 * w + g + 8 * ((r % 4) / 2), col = 8 * (r / 4) + 2 * q + r % 2;
    d[r] = p.use_c ? p.c[row * N + col] : 1e30f;  // 1e30: must be ignored (scale-d false)
  }
  constexpr bool k8 = sizeof(T) == 1;
  // A fragments of every k-step (register path): they must stay unchanged until the wait.
  uint32_t a[kMaxSteps][4] = {};
  if constexpr (kARegs)
    for (int s = 0; s < p.steps; ++s)
      for (int r = 0; r < 4; ++r) {  // mma.m16n8k16's A layout per warp (k32: four bytes each)
        const int row = 16 * w + g + 8 * (r % 2);
        uint32_t v = 0;
        if (!k8) {
          const int col = s * 16 + 2 * q + 8 * (r / 2);
          v = uint32_t(p.a_bits[row * p.K + col]) | uint32_t(p.a_bits[row * p.K + col + 1]) << 16;
        } else {
          for (int b = 0; b < 4; ++b)
            v |= uint32_t(p.a_bits[row * p.K + s * 32 + 4 * q + 16 * (r / 2) + b]) << (8 * b);
        }
        a[s][r] = v;
      }
  wgmma_fence();
  for (int s = 0; s < p.steps; ++s) {
    const uint64_t bdesc = make_smem_desc(smem + p.b_start[s], p.b_lbo, p.b_sbo, p.b_swz_desc);
    const bool scale_d = s > 0 || p.use_c;
    if constexpr (kARegs) {
      wgmma_rs<N, T, TB, kTransB, kScaleA>(d, a[s], bdesc, scale_d);
    } else {
      const uint64_t adesc = make_smem_desc(smem + p.a_start[s], p.a_lbo, p.a_sbo, p.a_swz);
      wgmma_ss<N, T, TB, kTransA, kTransB, kScaleA>(d, adesc, bdesc, scale_d);
    }
    if constexpr (kGroupPerStep) wgmma_commit_group();
  }
  if constexpr (!kGroupPerStep) wgmma_commit_group();
  if (p.bug == 2 && tid == 64)  // the operand is rewritten while the wgmma may still read it
    for (int i = 0; i < 64; ++i) smem[p.b_start[0] + uint32_t(i)] = 0;
  if (p.bug == 1)  // the accumulators are read before the wait
    for (int r = 0; r < N / 2; ++r) {
      const int row = 16 * w + g + 8 * ((r % 4) / 2), col = 8 * (r / 4) + 2 * q + r % 2;
      p.d[row * N + col] = d[r];
    }
  if constexpr (kGroupPerStep) wgmma_wait_group<1>();  // all but the last group, then the rest
  wgmma_wait_group<0>();
  if (p.bug != 1)
    for (int r = 0; r < N / 2; ++r) {
      const int row = 16 * w + g + 8 * ((r % 4) / 2), col = 8 * (r / 4) + 2 * q + r % 2;
      p.d[row * N + col] = d[r];
    }
}

struct Case {
  Ty ta, tb;
  bool a_regs;
  int a_span, b_span;
  bool a_mn, b_mn;  // M-major A (trans-a), N-major B (trans-b)
  int scale_a = 1;
  bool group_per_step = false, use_c = true;
  int b_span_desc = -1;  // planted: the descriptor's swizzle (default: b_span)
  int bug = 0;
};

template <int N, typename T, typename TB, bool kARegs, int kTransA, int kTransB, int kScaleA,
          bool kGroupPerStep>
Result run_gemm(const Case& c) {
  const int K = 64, eb = bytes_of(c.ta), kstep = 32 / eb, steps = K / kstep;
  const Layout la{c.a_mn, c.a_span, 64, eb}, lb{c.b_mn, c.b_span, N, eb};
  std::vector<int> A(size_t(64 * K)), B(size_t(K * N));
  std::vector<float> C(size_t(64 * N)), D(size_t(64 * N), -7.0f);
  uint32_t seed = 12345u + uint32_t(N);
  auto rnd = [&](int lo, int hi) {
    seed = seed * 1664525u + 1013904223u;
    return lo + int((seed >> 8) % uint32_t(hi - lo + 1));
  };
  for (int& v : A) v = rnd(-3, 3);
  for (int& v : B) v = rnd(-3, 3);
  for (float& v : C) v = float(rnd(-50, 50));
  const size_t b_base = (la.bytes(K) + 1023) / 1024 * 1024;
  std::vector<uint8_t> image(b_base + lb.bytes(K), 0xEE);
  std::vector<uint16_t> a_bits(size_t(64 * K));
  auto put = [&](size_t at, uint16_t bits) { std::memcpy(&image[at], &bits, size_t(eb)); };
  for (int m = 0; m < 64; ++m)
    for (int k = 0; k < K; ++k) {
      a_bits[size_t(m * K + k)] = encode(c.ta, A[size_t(m * K + k)]);
      if (!c.a_regs) put(la.place(m, k), a_bits[size_t(m * K + k)]);
    }
  for (int k = 0; k < K; ++k)
    for (int n = 0; n < N; ++n) put(b_base + lb.place(n, k), encode(c.tb, B[size_t(k * N + n)]));
  Params p{};
  p.image = image.data();
  p.image_bytes = int(image.size());
  for (int s = 0; s < steps; ++s) {
    p.a_start[s] = uint32_t(la.step_start(s * kstep));
    p.b_start[s] = uint32_t(b_base + lb.step_start(s * kstep));
  }
  p.a_lbo = la.lbo(), p.a_sbo = la.sbo(), p.b_lbo = lb.lbo(), p.b_sbo = lb.sbo();
  p.a_swz = swizzle_of(c.a_span), p.b_swz = swizzle_of(c.b_span);
  p.b_swz_desc = swizzle_of(c.b_span_desc >= 0 ? c.b_span_desc : c.b_span);
  p.steps = steps;
  p.use_c = c.use_c;
  p.a_bits = a_bits.data();
  p.K = K;
  p.c = C.data();
  p.d = D.data();
  p.bug = c.bug;
  auto kernel = &wgmma_gemm_kernel<N, T, TB, kARegs, kTransA, kTransB, kScaleA, kGroupPerStep>;
  emu::reset_stats();
  FMHA_LAUNCH(kernel, dim3(1), dim3(128), image.size(), nullptr, p);
  int wrong = 0;
  char first[200] = "";
  for (int m = 0; m < 64; ++m)
    for (int n = 0; n < N; ++n) {
      double want = c.use_c ? double(C[size_t(m * N + n)]) : 0.0;
      for (int k = 0; k < K; ++k)
        want += double(c.scale_a) * double(A[size_t(m * K + k)]) * double(B[size_t(k * N + n)]);
      const float got = D[size_t(m * N + n)];
      if (!(double(got) == want) && wrong++ == 0)
        std::snprintf(first, sizeof first, "D[%d][%d] = %g, expected %g", m, n, double(got), want);
    }
  if (wrong)
    return fail("mismatch in " + std::to_string(wrong) + " of " + std::to_string(64 * N) +
                " elements; first: " + first);
  // Shared-memory traffic (runtime.h, KernelTraffic): each k-step reads A's 64 rows x 32
  // bytes (16 core matrices, unless A is in registers) and B's N x 32 bytes (N / 4), and
  // every canonical layout puts a core matrix's 8 rows in distinct banks: one wavefront each.
  const std::vector<emu::KernelTraffic> traffic = emu::traffic();
  const uint64_t cores = uint64_t(steps) * uint64_t((c.a_regs ? 0 : 16) + N / 4);
  if (traffic.size() != 1 || traffic[0].wgmma_requests != uint64_t(steps) ||
      traffic[0].wgmma_ideal_wavefronts != cores || traffic[0].wgmma_wavefronts != cores)
    return fail("wgmma traffic: expected " + std::to_string(steps) + " requests, " +
                std::to_string(cores) + " wavefronts (the ideal)" +
                (traffic.size() == 1 ? ", got " + std::to_string(traffic[0].wgmma_requests) + ", " +
                                           std::to_string(traffic[0].wgmma_wavefronts) + "/" +
                                           std::to_string(traffic[0].wgmma_ideal_wavefronts)
                                     : std::string(", got no single kernel")));
  return pass(std::to_string(steps) + " wgmma k-steps, N = " + std::to_string(N) +
              ", conflict-free operand reads");
}

#define CITE_WGMMA                                                                            \
  "PTX ISA wgmma.mma_async: Matrix Descriptor Format, Shared Memory Matrix Layout (swizzle "  \
  "modes), register fragments of A and of the accumulator D"

// ---- f16 / bf16, both operands in shared memory, K-major: every swizzle mode
EMU_TEST("hopper.wgmma.f16.ss.kmajor.none", CITE_WGMMA) {
  return run_gemm<64, half_t, half_t, false, 0, 0, 1, false>({Ty::kF16, Ty::kF16, false, 0, 0, false, false});
}
EMU_TEST("hopper.wgmma.f16.ss.kmajor.sw32", CITE_WGMMA) {
  return run_gemm<64, half_t, half_t, false, 0, 0, 1, true>({Ty::kF16, Ty::kF16, false, 32, 32, false, false, 1, true});
}
EMU_TEST("hopper.wgmma.bf16.ss.kmajor.sw64", CITE_WGMMA) {
  return run_gemm<64, bf16_t, bf16_t, false, 0, 0, 1, false>({Ty::kBF16, Ty::kBF16, false, 64, 64, false, false});
}
EMU_TEST("hopper.wgmma.f16.ss.kmajor.sw128.n256", CITE_WGMMA) {
  return run_gemm<256, half_t, half_t, false, 0, 0, 1, false>({Ty::kF16, Ty::kF16, false, 128, 128, false, false});
}
// ---- transposed (M/N-major) operands, every swizzle mode
EMU_TEST("hopper.wgmma.bf16.ss.mnmajor.none", CITE_WGMMA) {
  return run_gemm<64, bf16_t, bf16_t, false, 1, 1, 1, false>({Ty::kBF16, Ty::kBF16, false, 0, 0, true, true});
}
EMU_TEST("hopper.wgmma.f16.ss.mnmajor.sw32", CITE_WGMMA) {
  return run_gemm<64, half_t, half_t, false, 1, 1, 1, false>({Ty::kF16, Ty::kF16, false, 32, 32, true, true});
}
EMU_TEST("hopper.wgmma.f16.ss.mnmajor.sw64", CITE_WGMMA) {
  return run_gemm<128, half_t, half_t, false, 1, 1, -1, true>({Ty::kF16, Ty::kF16, false, 64, 64, true, true, -1, true});
}
EMU_TEST("hopper.wgmma.bf16.ss.mnmajor.sw128", CITE_WGMMA) {
  return run_gemm<128, bf16_t, bf16_t, false, 1, 1, 1, false>({Ty::kBF16, Ty::kBF16, false, 128, 128, true, true, 1, false, false});
}
// ---- A from registers (B K-major and N-major), odd and extreme N
EMU_TEST("hopper.wgmma.f16.rs.kmajor.none.n8", CITE_WGMMA) {
  return run_gemm<8, half_t, half_t, true, 0, 0, 1, true>({Ty::kF16, Ty::kF16, true, 0, 0, false, false, 1, true});
}
EMU_TEST("hopper.wgmma.bf16.rs.nmajor.sw128.n192", CITE_WGMMA) {
  return run_gemm<192, bf16_t, bf16_t, true, 0, 1, 1, false>({Ty::kBF16, Ty::kBF16, true, 0, 128, false, true});
}
EMU_TEST("hopper.wgmma.f16.rs.kmajor.sw64.n72", CITE_WGMMA) {
  return run_gemm<72, half_t, half_t, true, 0, 0, 1, false>({Ty::kF16, Ty::kF16, true, 0, 64, false, false, 1, false, false});
}
// ---- 8-bit (k32): e4m3 x e5m2 in shared memory, e4m3 from registers
EMU_TEST("hopper.wgmma.e4m3_e5m2.ss.kmajor.sw128", CITE_WGMMA "; e4m3/e5m2 encodings") {
  return run_gemm<32, e4m3_t, e5m2_t, false, 0, 0, 1, true>({Ty::kE4M3, Ty::kE5M2, false, 128, 128, false, false, 1, true});
}
EMU_TEST("hopper.wgmma.e4m3.rs.kmajor.sw32", CITE_WGMMA "; e4m3 encoding") {
  return run_gemm<16, e4m3_t, e4m3_t, true, 0, 0, 1, false>({Ty::kE4M3, Ty::kE4M3, true, 0, 32, false, false});
}

// ---- the rules of asynchrony
__global__ void wgmma_nofence_kernel(Params p) {
  FMHA_DYNAMIC_SHARED(uint8_t, smem);
  float d[4] = {0, 0, 0, 0};
  const uint64_t desc = make_smem_desc(smem, 128, 128, SmemSwizzle::kNone);
  if (p.bug != 3) wgmma_fence();  // 3: no fence before the first wgmma
  wgmma_ss<8, half_t>(d, desc, desc, false);
  wgmma_commit_group();
  wgmma_wait_group<0>();
  if (p.bug == 1) {  // a second batch without the fence the ISA asks for after accessing d
    d[0] += 1.0f;
    wgmma_ss<8, half_t>(d, desc, desc, true);
  }
  if (p.bug == 2) {  // the accumulator written while the wgmma is in flight
    wgmma_fence();
    wgmma_ss<8, half_t>(d, desc, desc, true);
    wgmma_commit_group();
    d[1] = 0.0f;
    wgmma_wait_group<0>();
  }
  if (p.bug == 4) {  // the kernel ends with a wgmma nobody waits for
    wgmma_fence();
    wgmma_ss<8, half_t>(d, desc, desc, true);
    wgmma_commit_group();
  }
}

EMU_TEST("hopper.wgmma.rules", "PTX ISA wgmma.fence (required before a wgmma whose registers were "
                               "accessed), accumulator registers are undefined until wgmma.wait_group "
                               "(and a wgmma never waited for is an error here)") {
  Params p{};
  for (int bug = 0; bug < 5; ++bug) {
    p.bug = bug;
    const std::string err = launch_error(
        [&] { FMHA_LAUNCH(wgmma_nofence_kernel, dim3(1), dim3(128), 2048, nullptr, p); });
    const char* want = bug == 0 ? "" : bug == 2 ? "were written before the wgmma.wait_group"
                                     : bug == 4 ? "in flight (no wgmma.wait_group"
                                                : "no wgmma.fence";
    if (bug == 0 && !err.empty()) return fail("the fenced kernel failed: " + err);
    if (bug > 0 && err.find(want) == std::string::npos)
      return fail("case " + std::to_string(bug) + ": expected \"" + want + "\", got: " + err);
  }
  return pass();
}

// ---- planted bugs: each must fail (the result check; or the race checker, where noted)
// The traffic model's rule for one core-matrix read (runtime.cpp, count_operand_reads):
// eight 16-byte rows read in one phase. A tile of 128-byte rows without a swizzle (the plain
// row-major tile of 64 f16 columns) puts all eight rows of a core matrix in banks 0-3: eight
// wavefronts; the 128-byte swizzle moves row r's chunk to chunk (c ^ r), one wavefront, as
// does the no-swizzle canonical layout (rows 16 bytes apart); 64-byte rows unswizzled pair up
// in two bank groups (four).
EMU_TEST("hopper.traffic.core_matrix", "PTX ISA Shared Memory Matrix Layout (core matrices "
                                       "of 8 x 16 bytes, swizzle modes); 32 banks of 4 bytes") {
  struct Want {
    const char* layout;
    uint32_t pitch;
    bool swizzle128;
    uint64_t wavefronts;
  };
  for (const Want& w : {Want{"128-byte rows, no swizzle", 128, false, 8},
                        Want{"128-byte rows, 128B swizzle", 128, true, 1},
                        Want{"canonical no-swizzle core matrix", 16, false, 1},
                        Want{"64-byte rows, no swizzle", 64, false, 4}})
    for (uint32_t chunk = 0; chunk < 8 && 16 * chunk < w.pitch; ++chunk) {
      uint32_t rows[8];
      for (uint32_t r = 0; r < 8; ++r)
        rows[r] = 2048 + r * w.pitch + 16 * (w.swizzle128 ? chunk ^ r : chunk);
      const auto got = emu::detail::core_matrix_wavefronts(rows);
      if (got.first != w.wavefronts || got.second != 1)
        return fail(std::string(w.layout) + ", chunk " + std::to_string(chunk) + ": " +
                    std::to_string(got.first) + " wavefronts (ideal " +
                    std::to_string(got.second) + "), expected " + std::to_string(w.wavefronts));
    }
  return pass();
}

EMU_TEST("planted.wgmma_swizzle.buggy", "a 128B-swizzled B tile described as 64B-swizzled") {
  Case c{Ty::kF16, Ty::kF16, false, 128, 128, false, false};
  c.b_span_desc = 64;
  return run_gemm<64, half_t, half_t, false, 0, 0, 1, false>(c);
}
EMU_TEST("planted.wgmma_swizzle.fixed", "the same tile with its descriptor's swizzle right") {
  return run_gemm<64, half_t, half_t, false, 0, 0, 1, false>({Ty::kF16, Ty::kF16, false, 128, 128, false, false});
}
EMU_TEST("planted.wgmma_wait.buggy", "accumulators read before wgmma.wait_group") {
  Case c{Ty::kBF16, Ty::kBF16, false, 64, 64, false, false};
  c.bug = 1;
  return run_gemm<64, bf16_t, bf16_t, false, 0, 0, 1, false>(c);
}
EMU_TEST("planted.wgmma_wait.fixed", "accumulators read after wgmma.wait_group") {
  return run_gemm<64, bf16_t, bf16_t, false, 0, 0, 1, false>({Ty::kBF16, Ty::kBF16, false, 64, 64, false, false});
}
EMU_TEST("planted.wgmma_operand.buggy", "a B operand overwritten before the wgmma.wait_group") {
  Case c{Ty::kF16, Ty::kF16, false, 32, 32, false, false};
  c.bug = 2;
  return run_gemm<32, half_t, half_t, false, 0, 0, 1, false>(c);
}
EMU_TEST("planted.wgmma_operand.fixed", "the same GEMM, B untouched until the wait") {
  return run_gemm<32, half_t, half_t, false, 0, 0, 1, false>({Ty::kF16, Ty::kF16, false, 32, 32, false, false});
}
EMU_TEST("planted.proxy_fence.buggy", "(racecheck) shared memory written by threads and read by "
                                      "wgmma with no fence.proxy.async") {
  Case c{Ty::kF16, Ty::kF16, false, 128, 0, false, false};
  c.bug = 3;
  return run_gemm<16, half_t, half_t, false, 0, 0, 1, false>(c);
}
EMU_TEST("planted.proxy_fence.fixed", "the same with fence.proxy.async before the barrier") {
  return run_gemm<16, half_t, half_t, false, 0, 0, 1, false>({Ty::kF16, Ty::kF16, false, 128, 0, false, false});
}

}  // namespace
