// Hopper's (sm_90a) asynchronous machinery, as small device functions -- one source, two
// backends, as cuda/primitives.cuh: inline PTX under __CUDA_ARCH__ (sm_90a: wgmma and
// setmaxnreg exist only in the arch-specific target), the SIMT emulator's model
// (cuda/emu/hopper_emu.h; semantics in cuda/emu/runtime.cpp, limits in cuda/emu/README.md)
// in host builds.
//
//   mbarrier      mbarrier_init / _arrive / _arrive_expect_tx / _expect_tx / _complete_tx /
//                 _test_wait_parity / _try_wait_parity / mbarrier_wait (loops on try_wait)
//   wgmma         make_smem_desc, wgmma_fence, wgmma_ss / wgmma_rs (m64nNk16 f16/bf16,
//                 m64nNk32 e4m3/e5m2), wgmma_commit_group, wgmma_wait_group<N>
//   TMA           encode_tensor_map (host), tma_load (2D..5D, completes on an mbarrier),
//                 tma_store, bulk_commit_group, bulk_wait_group_read<N>
//   FP8           pack_fp8x2<e4m3_t / e5m2_t> (cvt.rn.satfinite from two floats)
//   others        fence_proxy_async, fence_barrier_init, setmaxnreg_inc<N> / _dec<N>,
//                 elect_one, smem_u32
//
// Warpgroup-level functions (wgmma_*, setmaxnreg_*) are called by all 128 threads of a
// warpgroup together (.sync.aligned); elect_one by all 32 lanes of a warp.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "cuda/primitives.cuh"

#if defined(__CUDACC__)
#include <cuda.h>  // CUtensorMap and cuTensorMapEncodeTiled's types (the function: at run time)
#else
#include "cuda/emu/hopper_emu.h"
#define __grid_constant__
#endif

// Which device passes get the PTX: mbarrier, TMA, fences and elect.sync need sm_90;
// wgmma and setmaxnreg the arch-specific sm_90a (-gencode arch=compute_90a,code=sm_90a).
// Other device passes (sm_80, or the generic compute_90 PTX nvcc also embeds for
// -arch=sm_90a) get a trap: those kernels must never be launched there.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define FMHA_HOPPER_PTX 1
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FMHA_HOPPER_PTX_A 1
#endif
#endif
#if defined(__CUDA_ARCH__)
#define FMHA_HOPPER_UNSUPPORTED() __trap()
#else
#define FMHA_HOPPER_UNSUPPORTED() ((void)0)
#endif

#include "cuda/hopper_wgmma_asm.inc"

namespace fmha {
namespace gpu {

// ---------------------------------------------------------------------------- addresses

// The shared-window (32-bit) address of a pointer into shared memory (cvta.to.shared). In
// the emulator: dynamic shared memory only, as offsets from its 1024-byte aligned start.
FMHA_DEVICE uint32_t smem_u32(const void* p) {
#if defined(FMHA_GPU_DEVICE_PATH)
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
#elif defined(FMHA_GPU_EMU_PATH)
  return ::emu::smem_address(p);
#else
  (void)p;
  return 0;
#endif
}

// ---------------------------------------------------------------------------- mbarrier
// PTX ISA "Parallel Synchronization and Communication Instructions: mbarrier". A 64-bit
// object in shared memory: a phase, pending/expected arrival counts and a tx-count; a phase
// completes when its arrivals and its transaction bytes are all in.

FMHA_DEVICE void mbarrier_init(uint64_t* bar, uint32_t count) {
#if defined(FMHA_HOPPER_PTX)
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count)
               : "memory");
#elif defined(FMHA_GPU_EMU_PATH)
  ::emu::mbarrier_init(bar, count);
#else
  FMHA_HOPPER_UNSUPPORTED();
  (void)bar, (void)count;
#endif
}

FMHA_DEVICE void mbarrier_inval(uint64_t* bar) {
#if defined(FMHA_HOPPER_PTX)
  asm volatile("mbarrier.inval.shared::cta.b64 [%0];\n" ::"r"(smem_u32(bar)) : "memory");
#elif defined(FMHA_GPU_EMU_PATH)
  ::emu::mbarrier_inval(bar);
#else
  FMHA_HOPPER_UNSUPPORTED();
  (void)bar;
#endif
}

// Returns the state token of the arrival's phase (for mbarrier_test_wait-style checks).
FMHA_DEVICE uint64_t mbarrier_arrive(uint64_t* bar, uint32_t count = 1) {
#if defined(FMHA_HOPPER_PTX)
  uint64_t state;
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 %0, [%1], %2;\n"
               : "=l"(state) : "r"(smem_u32(bar)), "r"(count) : "memory");
  return state;
#elif defined(FMHA_GPU_EMU_PATH)
  return ::emu::mbarrier_arrive(bar, count);
#else
  FMHA_HOPPER_UNSUPPORTED();
  (void)bar, (void)count;
  return 0;
#endif
}

FMHA_DEVICE uint64_t mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t tx_bytes) {
#if defined(FMHA_HOPPER_PTX)
  uint64_t state;
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 %0, [%1], %2;\n"
               : "=l"(state) : "r"(smem_u32(bar)), "r"(tx_bytes) : "memory");
  return state;
#elif defined(FMHA_GPU_EMU_PATH)
  return ::emu::mbarrier_arrive_expect_tx(bar, tx_bytes);
#else
  FMHA_HOPPER_UNSUPPORTED();
  (void)bar, (void)tx_bytes;
  return 0;
#endif
}

FMHA_DEVICE void mbarrier_expect_tx(uint64_t* bar, uint32_t tx_bytes) {
#if defined(FMHA_HOPPER_PTX)
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n"
               ::"r"(smem_u32(bar)), "r"(tx_bytes) : "memory");
#elif defined(FMHA_GPU_EMU_PATH)
  ::emu::mbarrier_expect_tx(bar, tx_bytes);
#else
  FMHA_HOPPER_UNSUPPORTED();
  (void)bar, (void)tx_bytes;
#endif
}

FMHA_DEVICE void mbarrier_complete_tx(uint64_t* bar, uint32_t tx_bytes) {
#if defined(FMHA_HOPPER_PTX)
  asm volatile("mbarrier.complete_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n"
               ::"r"(smem_u32(bar)), "r"(tx_bytes) : "memory");
#elif defined(FMHA_GPU_EMU_PATH)
  ::emu::mbarrier_complete_tx(bar, tx_bytes);
#else
  FMHA_HOPPER_UNSUPPORTED();
  (void)bar, (void)tx_bytes;
#endif
}

// Has the phase the state token (from mbarrier_arrive) names completed?
FMHA_DEVICE bool mbarrier_test_wait(uint64_t* bar, uint64_t state) {
#if defined(FMHA_HOPPER_PTX)
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\n"
      "mbarrier.test_wait.acquire.cta.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done) : "r"(smem_u32(bar)), "l"(state) : "memory");
  return done != 0;
#elif defined(FMHA_GPU_EMU_PATH)
  return ::emu::mbarrier_test_wait(bar, state);
#else
  FMHA_HOPPER_UNSUPPORTED();
  (void)bar, (void)state;
  return true;
#endif
}

// Has the phase of parity `parity` completed (the current phase's parity differs)?
FMHA_DEVICE bool mbarrier_test_wait_parity(uint64_t* bar, uint32_t parity) {
#if defined(FMHA_HOPPER_PTX)
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\n"
      "mbarrier.test_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
  return done != 0;
#elif defined(FMHA_GPU_EMU_PATH)
  return ::emu::mbarrier_test_wait_parity(bar, parity);
#else
  FMHA_HOPPER_UNSUPPORTED();
  (void)bar, (void)parity;
  return true;
#endif
}

// Potentially blocking (up to a system-dependent time limit on the GPU; until the phase
// completes in the emulator, which reports a wait that can never end as a deadlock).
FMHA_DEVICE bool mbarrier_try_wait_parity(uint64_t* bar, uint32_t parity) {
#if defined(FMHA_HOPPER_PTX)
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\n"
      "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
  return done != 0;
#elif defined(FMHA_GPU_EMU_PATH)
  return ::emu::mbarrier_try_wait_parity(bar, parity);
#else
  FMHA_HOPPER_UNSUPPORTED();
  (void)bar, (void)parity;
  return true;
#endif
}

// Waits until the phase of parity `parity` has completed. A parity names a phase only while the
// waiter is not behind: a thread that waits without arriving (the lanes of a producer warp
// beside its elected one) must be held by something else -- a __syncwarp between the wait and
// the elected lane's refill -- or, once the refill is consumed, it waits on the next phase.
FMHA_DEVICE void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  while (!mbarrier_try_wait_parity(bar, parity)) {
  }
}

// ---------------------------------------------------------------------------- wgmma
// PTX ISA "Asynchronous Warpgroup Level Matrix Multiply-Accumulate Instructions".

// Element-type tags for the 8-bit wgmma (the operands are raw bytes).
struct e4m3_t {
  uint8_t bits;
};
struct e5m2_t {
  uint8_t bits;
};

enum class SmemSwizzle : int { kNone = 0, k32B = 1, k64B = 2, k128B = 3 };

// The 64-bit matrix descriptor (PTX ISA "Matrix Descriptor Format"): start address,
// leading-dimension and stride-dimension byte offsets (each >> 4 in 14 bits), base offset
// 0, swizzle mode in bits 62-63 (1 = 128B, 2 = 64B, 3 = 32B). The layouts the offsets
// describe: cuda/emu/runtime.cpp, operand_address.
FMHA_DEVICE uint64_t make_smem_desc(const void* smem, uint32_t lbo_bytes, uint32_t sbo_bytes,
                                    SmemSwizzle swizzle) {
  const uint64_t mode = swizzle == SmemSwizzle::k128B ? 1 : swizzle == SmemSwizzle::k64B ? 2
                        : swizzle == SmemSwizzle::k32B ? 3 : 0;
  return uint64_t((smem_u32(smem) >> 4) & 0x3FFF) | (uint64_t((lbo_bytes >> 4) & 0x3FFF) << 16) |
         (uint64_t((sbo_bytes >> 4) & 0x3FFF) << 32) | (mode << 62);
}

FMHA_DEVICE void wgmma_fence() {
#if defined(FMHA_HOPPER_PTX_A)
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#elif defined(FMHA_GPU_EMU_PATH)
  ::emu::wgmma_fence();
#else
  FMHA_HOPPER_UNSUPPORTED();
#endif
}

FMHA_DEVICE void wgmma_commit_group() {
#if defined(FMHA_HOPPER_PTX_A)
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#elif defined(FMHA_GPU_EMU_PATH)
  ::emu::wgmma_commit_group();
#else
  FMHA_HOPPER_UNSUPPORTED();
#endif
}

template <int kPending>
FMHA_DEVICE void wgmma_wait_group() {
  static_assert(kPending >= 0 && kPending <= 7, "wgmma.wait_group N: 0..7");
#if defined(FMHA_HOPPER_PTX_A)
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
#elif defined(FMHA_GPU_EMU_PATH)
  ::emu::wgmma_wait_group(kPending);
#else
  FMHA_HOPPER_UNSUPPORTED();
#endif
}

namespace hopper_detail {

template <typename T>
struct WgmmaType;
template <> struct WgmmaType<half_t> { static constexpr int kind = 0; };
template <> struct WgmmaType<bf16_t> { static constexpr int kind = 1; };
template <> struct WgmmaType<e4m3_t> { static constexpr int kind = 2; };
template <> struct WgmmaType<e5m2_t> { static constexpr int kind = 3; };

#if defined(FMHA_HOPPER_PTX_A)
// One asm statement per (N, types, operand source); the operand lists: hopper_wgmma_asm.inc.
// scale-d is a predicate built from a register; the scales and transposes are immediates.
#define FMHA_WGMMA_SS16(N, TY)                                                                \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " FMHA_WGMMA_P2_##N ", 0;\n"                 \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " "                \
               FMHA_WGMMA_REGS_##N ", " FMHA_WGMMA_P0_##N ", " FMHA_WGMMA_P1_##N ", p, "      \
               FMHA_WGMMA_P3_##N ", " FMHA_WGMMA_P4_##N ", " FMHA_WGMMA_P5_##N ", "           \
               FMHA_WGMMA_P6_##N ";\n}\n"                                                     \
               : FMHA_WGMMA_ACC_##N(d)                                                        \
               : "l"(a_desc), "l"(b_desc), "r"(int(scale_d)), "n"(kScaleA), "n"(kScaleB),     \
                 "n"(kTransA), "n"(kTransB))
#define FMHA_WGMMA_RS16(N, TY)                                                                \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " FMHA_WGMMA_P5_##N ", 0;\n"                 \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " "                \
               FMHA_WGMMA_REGS_##N ", {" FMHA_WGMMA_P0_##N ", " FMHA_WGMMA_P1_##N ", "        \
               FMHA_WGMMA_P2_##N ", " FMHA_WGMMA_P3_##N "}, " FMHA_WGMMA_P4_##N ", p, "       \
               FMHA_WGMMA_P6_##N ", " FMHA_WGMMA_P7_##N ", " FMHA_WGMMA_P8_##N ";\n}\n"       \
               : FMHA_WGMMA_ACC_##N(d)                                                        \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(int(scale_d)),  \
                 "n"(kScaleA), "n"(kScaleB), "n"(kTransB))
#define FMHA_WGMMA_SS8(N, TA, TB)                                                             \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " FMHA_WGMMA_P2_##N ", 0;\n"                 \
               "wgmma.mma_async.sync.aligned.m64n" #N "k32.f32." TA "." TB " "                \
               FMHA_WGMMA_REGS_##N ", " FMHA_WGMMA_P0_##N ", " FMHA_WGMMA_P1_##N ", p, "      \
               FMHA_WGMMA_P3_##N ", " FMHA_WGMMA_P4_##N ";\n}\n"                              \
               : FMHA_WGMMA_ACC_##N(d)                                                        \
               : "l"(a_desc), "l"(b_desc), "r"(int(scale_d)), "n"(kScaleA), "n"(kScaleB))
#define FMHA_WGMMA_RS8(N, TA, TB)                                                             \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " FMHA_WGMMA_P5_##N ", 0;\n"                 \
               "wgmma.mma_async.sync.aligned.m64n" #N "k32.f32." TA "." TB " "                \
               FMHA_WGMMA_REGS_##N ", {" FMHA_WGMMA_P0_##N ", " FMHA_WGMMA_P1_##N ", "        \
               FMHA_WGMMA_P2_##N ", " FMHA_WGMMA_P3_##N "}, " FMHA_WGMMA_P4_##N ", p, "       \
               FMHA_WGMMA_P6_##N ", " FMHA_WGMMA_P7_##N ";\n}\n"                              \
               : FMHA_WGMMA_ACC_##N(d)                                                        \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(int(scale_d)),  \
                 "n"(kScaleA), "n"(kScaleB))

template <int N>
struct WgmmaAsm;
#define FMHA_WGMMA_SPECIALIZE(N)                                                              \
  template <>                                                                                 \
  struct WgmmaAsm<N> {                                                                        \
    template <int kA, int kB, int kScaleA, int kScaleB, int kTransA, int kTransB>             \
    static __device__ __forceinline__ void ss(float* d, uint64_t a_desc, uint64_t b_desc,     \
                                              bool scale_d) {                                 \
      if constexpr (kA == 0) FMHA_WGMMA_SS16(N, "f16");                                       \
      else if constexpr (kA == 1) FMHA_WGMMA_SS16(N, "bf16");                                 \
      else if constexpr (kA == 2 && kB == 2) FMHA_WGMMA_SS8(N, "e4m3", "e4m3");               \
      else if constexpr (kA == 2 && kB == 3) FMHA_WGMMA_SS8(N, "e4m3", "e5m2");               \
      else if constexpr (kA == 3 && kB == 2) FMHA_WGMMA_SS8(N, "e5m2", "e4m3");               \
      else FMHA_WGMMA_SS8(N, "e5m2", "e5m2");                                                 \
    }                                                                                         \
    template <int kA, int kB, int kScaleA, int kScaleB, int kTransB>                          \
    static __device__ __forceinline__ void rs(float* d, const uint32_t* a, uint64_t b_desc,   \
                                              bool scale_d) {                                 \
      if constexpr (kA == 0) FMHA_WGMMA_RS16(N, "f16");                                       \
      else if constexpr (kA == 1) FMHA_WGMMA_RS16(N, "bf16");                                 \
      else if constexpr (kA == 2 && kB == 2) FMHA_WGMMA_RS8(N, "e4m3", "e4m3");               \
      else if constexpr (kA == 2 && kB == 3) FMHA_WGMMA_RS8(N, "e4m3", "e5m2");               \
      else if constexpr (kA == 3 && kB == 2) FMHA_WGMMA_RS8(N, "e5m2", "e4m3");               \
      else FMHA_WGMMA_RS8(N, "e5m2", "e5m2");                                                 \
    }                                                                                         \
  };
FMHA_WGMMA_FOR_EACH_N(FMHA_WGMMA_SPECIALIZE)
#undef FMHA_WGMMA_SPECIALIZE
#endif  // FMHA_HOPPER_PTX_A

}  // namespace hopper_detail

// wgmma.mma_async.sync.aligned.m64nNk{16,32}.f32.TA.TB with A and B in shared memory:
// d (N/2 floats per thread, the accumulator fragment) = A * B + (scale_d ? d : 0), A
// 64 x K, B K x N (K = 16 for f16/bf16, 32 for e4m3/e5m2). kTransA/kTransB = 1: the operand
// is M/N-major in shared memory (16-bit types only). Issue only after wgmma_fence(); read d
// only after the wgmma_wait_group that retires it.
template <int N, typename TA, typename TB = TA, int kTransA = 0, int kTransB = 0,
          int kScaleA = 1, int kScaleB = 1>
FMHA_DEVICE void wgmma_ss(float (&d)[N / 2], uint64_t a_desc, uint64_t b_desc, bool scale_d) {
  static_assert(N % 8 == 0 && N >= 8 && N <= 256, "wgmma: N is a multiple of 8 in [8, 256]");
  constexpr int kA = hopper_detail::WgmmaType<TA>::kind, kB = hopper_detail::WgmmaType<TB>::kind;
  static_assert((kA < 2) == (kB < 2) && (kA >= 2 || kA == kB), "wgmma: mismatched types");
  static_assert(kA < 2 || (kTransA == 0 && kTransB == 0), "wgmma: 8-bit operands are K-major");
#if defined(FMHA_HOPPER_PTX_A)
  hopper_detail::WgmmaAsm<N>::template ss<kA, kB, kScaleA, kScaleB, kTransA, kTransB>(
      d, a_desc, b_desc, scale_d);
#elif defined(FMHA_GPU_EMU_PATH)
  ::emu::WgmmaArgs args{N, ::emu::WgmmaType(kA), ::emu::WgmmaType(kB), d, nullptr, a_desc,
                        b_desc, scale_d, kScaleA, kScaleB, kTransA, kTransB};
  ::emu::wgmma_mma_async(args);
#else
  FMHA_HOPPER_UNSUPPORTED();
  (void)d, (void)a_desc, (void)b_desc, (void)scale_d;
#endif
}

// The same with A from registers: a (4 x b32 per thread) is the A fragment of a warpgroup --
// warp w holds rows 16w..16w+15 in mma.m16n8k16's A layout (k32 for 8-bit types: four
// bytes per register). The registers must not change until the wait that retires it.
template <int N, typename TA, typename TB = TA, int kTransB = 0, int kScaleA = 1,
          int kScaleB = 1>
FMHA_DEVICE void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b_desc,
                          bool scale_d) {
  static_assert(N % 8 == 0 && N >= 8 && N <= 256, "wgmma: N is a multiple of 8 in [8, 256]");
  constexpr int kA = hopper_detail::WgmmaType<TA>::kind, kB = hopper_detail::WgmmaType<TB>::kind;
  static_assert((kA < 2) == (kB < 2) && (kA >= 2 || kA == kB), "wgmma: mismatched types");
  static_assert(kA < 2 || kTransB == 0, "wgmma: 8-bit operands are K-major");
#if defined(FMHA_HOPPER_PTX_A)
  hopper_detail::WgmmaAsm<N>::template rs<kA, kB, kScaleA, kScaleB, kTransB>(d, a, b_desc,
                                                                              scale_d);
#elif defined(FMHA_GPU_EMU_PATH)
  ::emu::WgmmaArgs args{N, ::emu::WgmmaType(kA), ::emu::WgmmaType(kB), d, a, 0, b_desc,
                        scale_d, kScaleA, kScaleB, 0, kTransB};
  ::emu::wgmma_mma_async(args);
#else
  FMHA_HOPPER_UNSUPPORTED();
  (void)d, (void)a, (void)b_desc, (void)scale_d;
#endif
}

// ---------------------------------------------------------------------------- FP8
// cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32 (PTX ISA "cvt"; the formats: "Alternate
// Floating-Point Data Formats"): two floats to two 8-bit values, `lo` in the low byte;
// round to nearest even; NaN gives NaN (0x7F), infinities and values beyond the largest
// finite one (e4m3: 448, e5m2: 57344) give that largest value, with the sign.
template <typename T>
FMHA_DEVICE uint16_t pack_fp8x2(float lo, float hi) {
  constexpr bool k4 = hopper_detail::WgmmaType<T>::kind == 2;
  static_assert(hopper_detail::WgmmaType<T>::kind >= 2, "pack_fp8x2: e4m3_t or e5m2_t");
#if defined(FMHA_HOPPER_PTX)
  uint16_t d;
  if constexpr (k4)
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(d) : "f"(hi), "f"(lo));
  else
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;\n" : "=h"(d) : "f"(hi), "f"(lo));
  return d;
#elif defined(FMHA_GPU_EMU_PATH)
  const uint8_t l = k4 ? ::emu::f32_to_e4m3(lo) : ::emu::f32_to_e5m2(lo);
  const uint8_t h = k4 ? ::emu::f32_to_e4m3(hi) : ::emu::f32_to_e5m2(hi);
  return uint16_t(l | (h << 8));
#else
  FMHA_HOPPER_UNSUPPORTED();
  (void)lo, (void)hi;
  return 0;
#endif
}

// ---------------------------------------------------------------------------- TMA
// PTX ISA "cp.async.bulk.tensor" (tile mode) and "Tensor-map"; host side: the CUDA driver's
// cuTensorMapEncodeTiled, which encode_tensor_map calls on a GPU build (through the
// runtime's driver entry point: no link against libcuda) and the emulator implements.

enum class TmaDtype : int { kU8 = 0, kF16 = 1, kBF16 = 2, kF32 = 3 };

#if defined(__CUDACC__)
using TensorMap = CUtensorMap;
#else
using TensorMap = ::emu::TmaDescriptor;
#endif

// A tiled tensor map of `rank` (1..5) dimensions, dimension 0 contiguous: dims[i] elements,
// strides_bytes[i] between consecutive indices of dimension i + 1 (rank - 1 of them,
// multiples of 16), a box of box[i] elements copied per tma_load (box[0] * element size a
// multiple of 16 bytes; at most the swizzle span when swizzled), every element_strides[i]-th
// element; out-of-bounds elements read as zero. Throws std::runtime_error / invalid_argument.
inline TensorMap encode_tensor_map(TmaDtype dtype, int rank, const void* global,
                                   const uint64_t* dims, const uint64_t* strides_bytes,
                                   const uint32_t* box, const uint32_t* element_strides,
                                   SmemSwizzle swizzle) {
  TensorMap map;
#if defined(__CUDACC__)
  using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                              const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                              const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                              CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  static Encode encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                                             cudaEnableDefault, &found);
    if (err != cudaSuccess || found != cudaDriverEntryPointSuccess || !fn)
      throw std::runtime_error("encode_tensor_map: cuTensorMapEncodeTiled is not available");
    return reinterpret_cast<Encode>(fn);
  }();
  const CUtensorMapDataType types[4] = {CU_TENSOR_MAP_DATA_TYPE_UINT8,
                                        CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                                        CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                                        CU_TENSOR_MAP_DATA_TYPE_FLOAT32};
  const CUtensorMapSwizzle swizzles[4] = {CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_SWIZZLE_32B,
                                          CU_TENSOR_MAP_SWIZZLE_64B, CU_TENSOR_MAP_SWIZZLE_128B};
  const CUresult r = encode(&map, types[int(dtype)], cuuint32_t(rank), const_cast<void*>(global),
                            dims, strides_bytes, box, element_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, swizzles[int(swizzle)],
                            CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw std::runtime_error("encode_tensor_map: cuTensorMapEncodeTiled failed (" +
                             std::to_string(int(r)) + ")");
#else
  ::emu::tma_encode(&map, ::emu::TmaDtype(int(dtype)), rank, global, dims, strides_bytes, box,
                    element_strides, ::emu::TmaSwizzle(int(swizzle)));
#endif
  return map;
}

// One thread copies the box at `coords` (rank of them) of the tensor map into shared memory
// (128-byte aligned), and the copy's bytes complete_tx on `bar` (whose phase must expect
// them: mbarrier_arrive_expect_tx). The map must be a __grid_constant__ kernel parameter
// (or otherwise in const/global memory).
template <int kRank>
FMHA_DEVICE void tma_load(void* smem_dst, const TensorMap* map, const int32_t (&coords)[kRank],
                          uint64_t* bar) {
  static_assert(kRank >= 1 && kRank <= 5, "tma_load: rank 1..5");
#if defined(FMHA_HOPPER_PTX)
  const uint32_t dst = smem_u32(smem_dst), mbar = smem_u32(bar);
  const uint64_t m = reinterpret_cast<uint64_t>(map);
  if constexpr (kRank == 1)
    asm volatile("cp.async.bulk.tensor.1d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%3}], [%2];\n"
                 ::"r"(dst), "l"(m), "r"(mbar), "r"(coords[0]) : "memory");
  else if constexpr (kRank == 2)
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%3, %4}], [%2];\n"
                 ::"r"(dst), "l"(m), "r"(mbar), "r"(coords[0]), "r"(coords[1]) : "memory");
  else if constexpr (kRank == 3)
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%3, %4, %5}], [%2];\n"
                 ::"r"(dst), "l"(m), "r"(mbar), "r"(coords[0]), "r"(coords[1]), "r"(coords[2])
                 : "memory");
  else if constexpr (kRank == 4)
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%3, %4, %5, %6}], [%2];\n"
                 ::"r"(dst), "l"(m), "r"(mbar), "r"(coords[0]), "r"(coords[1]), "r"(coords[2]),
                 "r"(coords[3]) : "memory");
  else
    asm volatile("cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%3, %4, %5, %6, %7}], [%2];\n"
                 ::"r"(dst), "l"(m), "r"(mbar), "r"(coords[0]), "r"(coords[1]), "r"(coords[2]),
                 "r"(coords[3]), "r"(coords[4]) : "memory");
#elif defined(FMHA_GPU_EMU_PATH)
  ::emu::tma_load(smem_dst, map, coords, bar);
#else
  FMHA_HOPPER_UNSUPPORTED();
  (void)smem_dst, (void)map, (void)coords, (void)bar;
#endif
}

// One thread stores a shared-memory box (laid out as tma_load writes it) to the tensor at
// `coords`; out-of-bounds elements are not written. Its reads of shared memory are done by
// the bulk_wait_group_read that retires its group. Generic writes of the source need
// fence_proxy_async() (by each writer) and a barrier before it.
template <int kRank>
FMHA_DEVICE void tma_store(const TensorMap* map, const int32_t (&coords)[kRank],
                           const void* smem_src) {
  static_assert(kRank >= 1 && kRank <= 5, "tma_store: rank 1..5");
#if defined(FMHA_HOPPER_PTX)
  const uint32_t src = smem_u32(smem_src);
  const uint64_t m = reinterpret_cast<uint64_t>(map);
  if constexpr (kRank == 1)
    asm volatile("cp.async.bulk.tensor.1d.global.shared::cta.tile.bulk_group [%0, {%2}], [%1];\n"
                 ::"l"(m), "r"(src), "r"(coords[0]) : "memory");
  else if constexpr (kRank == 2)
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group [%0, {%2, %3}], [%1];\n"
                 ::"l"(m), "r"(src), "r"(coords[0]), "r"(coords[1]) : "memory");
  else if constexpr (kRank == 3)
    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4}], [%1];\n"
                 ::"l"(m), "r"(src), "r"(coords[0]), "r"(coords[1]), "r"(coords[2]) : "memory");
  else if constexpr (kRank == 4)
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group"
                 " [%0, {%2, %3, %4, %5}], [%1];\n"
                 ::"l"(m), "r"(src), "r"(coords[0]), "r"(coords[1]), "r"(coords[2]), "r"(coords[3])
                 : "memory");
  else
    asm volatile("cp.async.bulk.tensor.5d.global.shared::cta.tile.bulk_group"
                 " [%0, {%2, %3, %4, %5, %6}], [%1];\n"
                 ::"l"(m), "r"(src), "r"(coords[0]), "r"(coords[1]), "r"(coords[2]), "r"(coords[3]),
                 "r"(coords[4]) : "memory");
#elif defined(FMHA_GPU_EMU_PATH)
  ::emu::tma_store(map, coords, smem_src);
#else
  FMHA_HOPPER_UNSUPPORTED();
  (void)map, (void)coords, (void)smem_src;
#endif
}

FMHA_DEVICE void bulk_commit_group() {
#if defined(FMHA_HOPPER_PTX)
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#elif defined(FMHA_GPU_EMU_PATH)
  ::emu::bulk_commit_group();
#else
  FMHA_HOPPER_UNSUPPORTED();
#endif
}

template <int kPending>
FMHA_DEVICE void bulk_wait_group_read() {
#if defined(FMHA_HOPPER_PTX)
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
#elif defined(FMHA_GPU_EMU_PATH)
  ::emu::bulk_wait_group_read(kPending);
#else
  FMHA_HOPPER_UNSUPPORTED();
#endif
}

// ---------------------------------------------------------------------------- the rest

// Opt a kernel built for sm_90a only into `bytes` of dynamic shared memory (up to sm_90's
// 227 KiB per CTA; set_max_dynamic_smem of primitives.cuh holds the emulator to sm_80's 163).
template <typename Kernel>
void set_max_dynamic_smem_sm90(Kernel kernel, size_t bytes) {
#if defined(__CUDACC__)
  set_max_dynamic_smem(kernel, bytes);
#else
  ::emu::set_max_dynamic_smem_sm90(reinterpret_cast<const void*>(kernel), bytes);
#endif
}

// fence.proxy.async.shared::cta: this thread's generic-proxy writes of shared memory become
// visible to later async-proxy reads (wgmma operands, TMA stores) -- PTX ISA "membar /
// fence", and "Memory Consistency Model: proxies".
FMHA_DEVICE void fence_proxy_async() {
#if defined(FMHA_HOPPER_PTX)
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#elif defined(FMHA_GPU_EMU_PATH)
  ::emu::fence_proxy_async();
#else
  FMHA_HOPPER_UNSUPPORTED();
#endif
}

// fence.mbarrier_init.release.cluster: this thread's mbarrier.init writes (generic-proxy
// writes) become visible to the arrivals that follow, TMA's complete_tx included, which come
// through the async proxy -- PTX ISA "membar / fence" (fence.mbarrier_init) and "mbarrier.init".
// The initialising thread calls it after its inits, before the barrier that publishes them.
FMHA_DEVICE void fence_barrier_init() {
#if defined(FMHA_HOPPER_PTX)
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#elif defined(FMHA_GPU_EMU_PATH)
  ::emu::fence_mbarrier_init();  // checked by the race checker before a TMA's complete_tx
#else
  FMHA_HOPPER_UNSUPPORTED();
#endif
}

// setmaxnreg (PTX ISA "setmaxnreg"), by a whole warpgroup: the per-thread register maximum
// becomes kCount (a multiple of 8 in [24, 256]), released to (dec) or taken from (inc, which
// waits for them) the CTA's pool.
template <int kCount>
FMHA_DEVICE void setmaxnreg_inc() {
  static_assert(kCount >= 24 && kCount <= 256 && kCount % 8 == 0, "setmaxnreg: 24..256, by 8");
#if defined(FMHA_HOPPER_PTX_A)
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kCount));
#elif defined(FMHA_GPU_EMU_PATH)
  ::emu::setmaxnreg(true, kCount);
#else
  FMHA_HOPPER_UNSUPPORTED();
#endif
}
template <int kCount>
FMHA_DEVICE void setmaxnreg_dec() {
  static_assert(kCount >= 24 && kCount <= 256 && kCount % 8 == 0, "setmaxnreg: 24..256, by 8");
#if defined(FMHA_HOPPER_PTX_A)
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kCount));
#elif defined(FMHA_GPU_EMU_PATH)
  ::emu::setmaxnreg(false, kCount);
#else
  FMHA_HOPPER_UNSUPPORTED();
#endif
}

// elect.sync _|p, 0xffffffff (PTX ISA "elect.sync"), by all 32 lanes: true in one of them.
FMHA_DEVICE bool elect_one() {
#if defined(FMHA_HOPPER_PTX)
  uint32_t leader;
  asm volatile(
      "{\n.reg .pred p;\n"
      "elect.sync _|p, 0xffffffff;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(leader));
  return leader != 0;
#elif defined(FMHA_GPU_EMU_PATH)
  return ::emu::elect_one();
#else
  FMHA_HOPPER_UNSUPPORTED();
  return true;
#endif
}

}  // namespace gpu
}  // namespace fmha
