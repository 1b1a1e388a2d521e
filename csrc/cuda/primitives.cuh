// Every hardware-specific operation of fmha's CUDA kernels, as small device functions:
// inline PTX under __CUDA_ARCH__, the SIMT emulator (cuda/emu/cuda_emu.h) in host builds.
// Kernels use only these, plain CUDA C++, __syncthreads(_or), __syncwarp and __shared__ -- so
// the same source runs on an sm_80+ GPU and, in CI, on the CPU.
//
// Every warp-level function here is full-warp (.sync.aligned, membermask 0xffffffff): all
// 32 lanes of the warp must call it together. PTX ISA sections are cited by name and by
// their number in PTX ISA 9.0.
//
// Path selection:
//   __CUDA_ARCH__ defined        -> device code: inline PTX.
//   __CUDACC__ without the above -> nvcc's host pass over device functions; never runs.
//   neither                      -> host C++ against the emulator.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <new>
#include <stdexcept>
#include <string>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#else
#include "cuda/emu/cuda_emu.h"
#endif

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "fmha's CUDA kernels need sm_80 or newer (mma.sync m16n8k16 bf16, cp.async)"
#endif

#if defined(__CUDA_ARCH__)
#define FMHA_GPU_DEVICE_PATH 1
#elif !defined(__CUDACC__)
#define FMHA_GPU_EMU_PATH 1
#endif

#if defined(__CUDACC__)
#define FMHA_DEVICE __device__ __forceinline__
#else
#define FMHA_DEVICE inline
#endif

// Dynamic shared memory (`extern __shared__` has no C++ equivalent, hence a macro):
// declares `T* name` pointing at the block's dynamic shared memory, 128-byte aligned.
#if defined(__CUDACC__)
#define FMHA_DYNAMIC_SHARED(T, name)                                      \
  extern __shared__ __align__(128) unsigned char fmha_dynamic_smem_[];    \
  T* name = reinterpret_cast<T*>(fmha_dynamic_smem_)
#else
#define FMHA_DYNAMIC_SHARED(T, name) T* name = static_cast<T*>(::emu::dynamic_smem())
#endif
// The same, `align`-byte aligned (a literal power of two, at most 1024: TMA's 128-byte swizzle
// and wgmma's descriptors want 1024). Only the declaration: the kernel checks the address,
// as the alignment the hardware gives dynamic shared memory is not documented. The emulator's
// window is 1024-byte aligned.
#if defined(__CUDACC__)
#define FMHA_DYNAMIC_SHARED_ALIGNED(T, name, align)                                   \
  extern __shared__ __align__(align) unsigned char fmha_dynamic_smem_##align##_[];    \
  T* name = reinterpret_cast<T*>(fmha_dynamic_smem_##align##_)
#else
#define FMHA_DYNAMIC_SHARED_ALIGNED(T, name, align)                                    \
  static_assert((align) <= 1024 && ((align) & ((align) - 1)) == 0, "alignment");      \
  T* name = static_cast<T*>(::emu::dynamic_smem())
#endif

// kernel<<<grid, block, smem, stream>>>(args...), then a launch-error check naming the
// kernel. `kernel` is a name or a pointer variable (wrap template-ids in a variable).
#if defined(__CUDACC__)
#define FMHA_LAUNCH(kernel, grid, block, smem, stream, ...)         \
  do {                                                              \
    kernel<<<(grid), (block), (smem), (stream)>>>(__VA_ARGS__);     \
    ::fmha::gpu::check_launch(#kernel);                             \
  } while (0)
#else
#define FMHA_LAUNCH(kernel, grid, block, smem, stream, ...) \
  ((void)(stream), ::emu::launch(#kernel, kernel, (grid), (block), (smem), __VA_ARGS__))
#endif

namespace fmha {
namespace gpu {

using half_t = __half;
using bf16_t = __nv_bfloat16;

// ---------------------------------------------------------------------------- host side

#if defined(__CUDACC__)
using Stream = cudaStream_t;
inline void check_launch(const char* kernel) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    throw std::runtime_error(std::string(kernel) + ": " + cudaGetErrorString(err));
}
// Kernels that use more than 48 KiB of dynamic shared memory must opt in first. They also
// ask for the SM's whole shared memory as the L1/shared carveout (a hint; the driver's own
// choice may already be that): the CTAs per SM the configs are sized for need the full 164
// KiB of an sm_80 SM (two forward CTAs of up to 66 KiB, two backward ones of 73.5 at d = 128).
template <typename Kernel>
void set_max_dynamic_smem(Kernel kernel, size_t bytes) {
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(bytes));
  if (err == cudaSuccess)
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                               cudaSharedmemCarveoutMaxShared);
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("cudaFuncSetAttribute: ") + cudaGetErrorString(err));
}
#else
using Stream = void*;
template <typename Kernel>
void set_max_dynamic_smem(Kernel kernel, size_t bytes) {
  ::emu::set_max_dynamic_smem(reinterpret_cast<const void*>(kernel), bytes);
}
#endif

// Scratch memory for one launch (split-KV partials, the backward's float32 dQ and D):
// stream-ordered on the GPU (cudaMallocAsync / cudaFreeAsync on the caller's stream, served
// from the device's memory pool, so no device-wide synchronisation), plain host memory
// under the emulator. Zero-filled on request, also stream-ordered.
//
// Under the emulator (without AddressSanitizer, whose redzones do this job) the block sits
// between two guard regions of a known byte, checked when it is freed: a kernel that wrote
// past its scratch fails the call (std::runtime_error naming the size) instead of silently
// corrupting the heap. The launches are synchronous there, so the check comes after the
// last kernel that used the block.
class Scratch {
 public:
  Scratch(size_t bytes, Stream stream, bool zero = false) : stream_(stream), bytes_(bytes) {
    if (bytes == 0) return;
#if defined(__CUDACC__)
    cudaError_t err = cudaMallocAsync(&ptr_, bytes, stream);
    if (err == cudaSuccess && zero) err = cudaMemsetAsync(ptr_, 0, bytes, stream);
    if (err != cudaSuccess)
      throw std::runtime_error(std::string("fmha scratch (") + std::to_string(bytes) +
                               " bytes): " + cudaGetErrorString(err));
#else
    base_ = static_cast<unsigned char*>(std::malloc(bytes + 2 * kGuard));
    if (!base_) throw std::bad_alloc();
    ptr_ = base_ + kGuard;
    std::memset(base_, kGuardByte, kGuard);
    std::memset(base_ + kGuard + bytes, kGuardByte, kGuard);
    if (zero) std::memset(ptr_, 0, bytes);
    ::emu::scratch_taken(bytes);
#endif
  }
  // May throw under the emulator (a damaged guard), never while another exception unwinds.
  ~Scratch() noexcept(false) {
    if (!ptr_) return;
#if defined(__CUDACC__)
    cudaFreeAsync(ptr_, stream_);
#else
    bool intact = true;
    for (size_t i = 0; i < kGuard; ++i)
      intact = intact && base_[i] == kGuardByte && base_[kGuard + bytes_ + i] == kGuardByte;
    std::free(base_);
    ::emu::scratch_returned(bytes_);
    if (!intact && std::uncaught_exceptions() == 0)
      throw std::runtime_error("fmha scratch (" + std::to_string(bytes_) +
                               " bytes): a kernel wrote outside it");
#endif
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  template <typename U>
  U* as() const { return static_cast<U*>(ptr_); }
  size_t bytes() const { return bytes_; }

 private:
#if !defined(__CUDACC__)
#if defined(__SANITIZE_ADDRESS__)
  static constexpr size_t kGuard = 0;
#else
  static constexpr size_t kGuard = 64 * 1024;  // bytes on each side; a multiple of 16
#endif
  static constexpr unsigned char kGuardByte = 0xA5;
  unsigned char* base_ = nullptr;
#endif
  void* ptr_ = nullptr;
  Stream stream_;
  size_t bytes_;
};

// Zero `bytes` of an output in stream order (cudaMemsetAsync; a plain memset under the
// emulator, whose launches are synchronous).
inline void zero_fill(void* ptr, size_t bytes, Stream stream) {
  if (bytes == 0) return;
#if defined(__CUDACC__)
  const cudaError_t err = cudaMemsetAsync(ptr, 0, bytes, stream);
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("fmha zero fill: ") + cudaGetErrorString(err));
#else
  (void)stream;
  std::memset(ptr, 0, bytes);
#endif
}

// ---------------------------------------------------------------------------- conversions
// PTX ISA 9.0 §9.7.9.21 "cvt": .rn rounds to nearest even; a NaN becomes 0x7FFF.

template <typename T>
FMHA_DEVICE uint16_t bits_of(T x);
template <>
FMHA_DEVICE uint16_t bits_of<half_t>(half_t x) {
#if defined(__CUDACC__)
  return __half_as_ushort(x);
#else
  return x.__x;
#endif
}
template <>
FMHA_DEVICE uint16_t bits_of<bf16_t>(bf16_t x) {
#if defined(__CUDACC__)
  return __bfloat16_as_ushort(x);
#else
  return x.__x;
#endif
}

template <typename T>
FMHA_DEVICE T from_bits(uint16_t bits);
template <>
FMHA_DEVICE half_t from_bits<half_t>(uint16_t bits) {
#if defined(__CUDACC__)
  return __ushort_as_half(bits);
#else
  return half_t{bits};
#endif
}
template <>
FMHA_DEVICE bf16_t from_bits<bf16_t>(uint16_t bits) {
#if defined(__CUDACC__)
  return __ushort_as_bfloat16(bits);
#else
  return bf16_t{bits};
#endif
}

FMHA_DEVICE float to_float(half_t x) {
#if defined(__CUDACC__)
  return __half2float(x);
#else
  return ::emu::f16_bits_to_f32(x.__x);
#endif
}
FMHA_DEVICE float to_float(bf16_t x) {
#if defined(__CUDACC__)
  return __bfloat162float(x);
#else
  return ::emu::bf16_bits_to_f32(x.__x);
#endif
}

// cvt.rn.f16.f32 / cvt.rn.bf16.f32
template <typename T>
FMHA_DEVICE T from_float(float x);
template <>
FMHA_DEVICE half_t from_float<half_t>(float x) {
#if defined(__CUDACC__)
  return __float2half_rn(x);
#else
  return half_t{::emu::f32_to_f16_bits(x)};
#endif
}
template <>
FMHA_DEVICE bf16_t from_float<bf16_t>(float x) {
#if defined(__CUDACC__)
  return __float2bfloat16_rn(x);
#else
  return bf16_t{::emu::f32_to_bf16_bits(x)};
#endif
}

// Two floats as one .b32 register of 16-bit values, `lo` in bits 0..15: the element order of
// mma fragments (a0 low, a1 high). cvt.rn.{f16x2,bf16x2}.f32 d, a, b puts a in the upper half.
template <typename T>
FMHA_DEVICE uint32_t pack2(float lo, float hi);
template <>
FMHA_DEVICE uint32_t pack2<half_t>(float lo, float hi) {
#if defined(FMHA_GPU_DEVICE_PATH)
  uint32_t d;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
#elif defined(FMHA_GPU_EMU_PATH)
  return uint32_t(::emu::f32_to_f16_bits(lo)) | (uint32_t(::emu::f32_to_f16_bits(hi)) << 16);
#else
  return 0;
#endif
}
template <>
FMHA_DEVICE uint32_t pack2<bf16_t>(float lo, float hi) {
#if defined(FMHA_GPU_DEVICE_PATH)
  uint32_t d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
#elif defined(FMHA_GPU_EMU_PATH)
  return uint32_t(::emu::f32_to_bf16_bits(lo)) | (uint32_t(::emu::f32_to_bf16_bits(hi)) << 16);
#else
  return 0;
#endif
}

// threadIdx.x read anew: a value the compiler cannot take from an earlier read, so that what a
// kernel derives from it here is computed here rather than held in registers from its start.
FMHA_DEVICE unsigned thread_index_reread() {
#if defined(FMHA_GPU_DEVICE_PATH)
  unsigned x;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(x));
  return x;
#else
  return unsigned(threadIdx.x);
#endif
}

// ---------------------------------------------------------------------------- math

// Two adjacent floats read or written as one 8-byte access (LDS.64 / STS.64 on the device).
struct alignas(8) FloatPair {
  float x, y;
};

// Two such pairs as one 16-byte access (LDS.128).
struct alignas(16) FloatPairs {
  FloatPair lo, hi;
};

// The two 16-bit values of x (as pack2 makes them) as floats, exactly: x = lo in bits 0..15.
// bf16: each half moved into a float's upper bits, one instruction each (converting the
// upper half as a 16-bit value first took two).
template <typename T>
FMHA_DEVICE FloatPair unpack2(uint32_t x);
template <>
FMHA_DEVICE FloatPair unpack2<half_t>(uint32_t x) {
  return {to_float(from_bits<half_t>(uint16_t(x & 0xFFFFu))),
          to_float(from_bits<half_t>(uint16_t(x >> 16)))};
}
template <>
FMHA_DEVICE FloatPair unpack2<bf16_t>(uint32_t x) {
#if defined(FMHA_GPU_DEVICE_PATH)
  return {__uint_as_float(x << 16), __uint_as_float(x & 0xFFFF0000u)};
#elif defined(FMHA_GPU_EMU_PATH)
  return {::emu::f32_from_bits(x << 16), ::emu::f32_from_bits(x & 0xFFFF0000u)};
#else
  return {0.0f, 0.0f};
#endif
}

// 2^x: ex2.approx.ftz.f32 (PTX ISA 9.0 §9.7.3.21): subnormal inputs and results flush to
// zero; maximum relative error about 2^-22. The emulator computes exp2f and flushes the same.
FMHA_DEVICE float exp2_approx(float x) {
#if defined(FMHA_GPU_DEVICE_PATH)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
#elif defined(FMHA_GPU_EMU_PATH)
  const float y = std::exp2(x);
  return (y != 0.0f && std::fabs(y) < 1.17549435e-38f) ? 0.0f : y;
#else
  return x;
#endif
}

// atomicAdd on a float in global or shared memory; returns the old value
// (atom.add.f32, PTX ISA 9.0 §9.7.13.5).
FMHA_DEVICE float atomic_add(float* address, float value) {
#if defined(FMHA_GPU_DEVICE_PATH)
  return atomicAdd(address, value);
#elif defined(FMHA_GPU_EMU_PATH)
  return ::emu::atomic_add(address, value);
#else
  return *address + value;
#endif
}

// ---------------------------------------------------------------------------- warp shuffles
// shfl.sync (PTX ISA 9.0 §9.7.9.6) with CUDA's __shfl_*_sync semantics: `width` (a power of
// two <= 32) splits the warp into segments that shuffle independently. T: any 4-byte type.

namespace detail {
template <typename T>
FMHA_DEVICE uint32_t to_b32(T v) {
  static_assert(sizeof(T) == 4, "warp shuffles move 4-byte values");
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return u;
}
template <typename T>
FMHA_DEVICE T from_b32(uint32_t u) {
  T v;
  std::memcpy(&v, &u, 4);
  return v;
}
}  // namespace detail

// The value of lane (lane ^ lane_mask), within the lane's segment or an earlier one.
template <typename T>
FMHA_DEVICE T shfl_xor(T v, int lane_mask, int width = 32) {
#if defined(__CUDACC__)
  return detail::from_b32<T>(__shfl_xor_sync(0xFFFFFFFFu, detail::to_b32(v), lane_mask, width));
#else
  return detail::from_b32<T>(::emu::shfl(::emu::ShflMode::kBfly, detail::to_b32(v),
                                         uint32_t(lane_mask), uint32_t(((32 - width) << 8) | 0x1F)));
#endif
}
// The value of lane src_lane (modulo width) of the lane's segment.
template <typename T>
FMHA_DEVICE T shfl_idx(T v, int src_lane, int width = 32) {
#if defined(__CUDACC__)
  return detail::from_b32<T>(__shfl_sync(0xFFFFFFFFu, detail::to_b32(v), src_lane, width));
#else
  return detail::from_b32<T>(::emu::shfl(::emu::ShflMode::kIdx, detail::to_b32(v),
                                         uint32_t(src_lane), uint32_t(((32 - width) << 8) | 0x1F)));
#endif
}
// The value of lane - delta; lanes whose source lies before their segment keep their own.
template <typename T>
FMHA_DEVICE T shfl_up(T v, int delta, int width = 32) {
#if defined(__CUDACC__)
  return detail::from_b32<T>(__shfl_up_sync(0xFFFFFFFFu, detail::to_b32(v), unsigned(delta), width));
#else
  return detail::from_b32<T>(::emu::shfl(::emu::ShflMode::kUp, detail::to_b32(v),
                                         uint32_t(delta), uint32_t((32 - width) << 8)));
#endif
}
// The value of lane + delta; lanes whose source lies past their segment keep their own.
template <typename T>
FMHA_DEVICE T shfl_down(T v, int delta, int width = 32) {
#if defined(__CUDACC__)
  return detail::from_b32<T>(__shfl_down_sync(0xFFFFFFFFu, detail::to_b32(v), unsigned(delta), width));
#else
  return detail::from_b32<T>(::emu::shfl(::emu::ShflMode::kDown, detail::to_b32(v),
                                         uint32_t(delta), uint32_t(((32 - width) << 8) | 0x1F)));
#endif
}

// Bit L set iff lane L's predicate is true (vote.sync.ballot.b32, PTX ISA 9.0 §9.7.13.9).
FMHA_DEVICE uint32_t warp_ballot(bool p) {
#if defined(__CUDACC__)
  return __ballot_sync(0xFFFFFFFFu, p);
#else
  return ::emu::ballot(p);
#endif
}

// Whether any lane's predicate is true (vote.sync.any.pred): a branch on it reads the vote's
// predicate directly, where `warp_ballot(p) != 0u` takes a compare of the mask as well.
FMHA_DEVICE bool warp_any(bool p) {
#if defined(__CUDACC__)
  return __any_sync(0xFFFFFFFFu, p);
#else
  return ::emu::ballot(p) != 0u;
#endif
}

// ---------------------------------------------------------------------------- tensor cores

// D = A*B + C for one 16x8x16 tile per warp, f32 accumulation:
// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32 (PTX ISA 9.0
// §9.7.14.5.14); fragments as in §9.7.14.5.8 "Matrix Fragments for mma.m16n8k16 with
// floating point type". With g = lane/4, t = lane%4 and registers holding element pairs
// (lower column / row in the low half):
//   a[0]: A[g][2t..2t+1]   a[1]: A[g+8][2t..]   a[2]: A[g][2t+8..]   a[3]: A[g+8][2t+8..]
//   b[0]: B[2t..2t+1][g]   b[1]: B[2t+8..2t+9][g]
//   c[0..1]: C[g][2t..2t+1]   c[2..3]: C[g+8][2t..2t+1]
// d may alias c.
template <typename T>
FMHA_DEVICE void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                              const float (&c)[4]);
template <>
FMHA_DEVICE void mma_m16n8k16<half_t>(float (&d)[4], const uint32_t (&a)[4],
                                      const uint32_t (&b)[2], const float (&c)[4]) {
#if defined(FMHA_GPU_DEVICE_PATH)
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]),
        "f"(c[1]), "f"(c[2]), "f"(c[3]));
#elif defined(FMHA_GPU_EMU_PATH)
  ::emu::mma_m16n8k16(::emu::MmaType::kF16, d, a, b, c);
#endif
}
template <>
FMHA_DEVICE void mma_m16n8k16<bf16_t>(float (&d)[4], const uint32_t (&a)[4],
                                      const uint32_t (&b)[2], const float (&c)[4]) {
#if defined(FMHA_GPU_DEVICE_PATH)
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]),
        "f"(c[1]), "f"(c[2]), "f"(c[3]));
#elif defined(FMHA_GPU_EMU_PATH)
  ::emu::mma_m16n8k16(::emu::MmaType::kBF16, d, a, b, c);
#endif
}

// The accumulators of two adjacent n-tiles (columns 0..7 in lo, 8..15 in hi) are, converted
// to 16-bit pairs, exactly the A fragment of a 16 x 16 k-step (c[0..1] -> a[0] / a[2], c[2..3]
// -> a[1] / a[3]): how FlashAttention-2 feeds P (and dS) to the next GEMM without shared memory.
template <typename T>
FMHA_DEVICE void a_frag_from_acc(uint32_t (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
  a[0] = pack2<T>(lo[0], lo[1]);
  a[1] = pack2<T>(lo[2], lo[3]);
  a[2] = pack2<T>(hi[0], hi[1]);
  a[3] = pack2<T>(hi[2], hi[3]);
}

// Two n-tiles of one k-step: d0 += A B0, d1 += A B1, with B0 = b4[0..1] and B1 = b4[2..3] as
// one ldmatrix x4 delivers them.
template <typename T>
FMHA_DEVICE void mma_pair(float (&d0)[4], float (&d1)[4], const uint32_t (&a)[4],
                          const uint32_t (&b4)[4]) {
  const uint32_t b0[2] = {b4[0], b4[1]}, b1[2] = {b4[2], b4[3]};
  mma_m16n8k16<T>(d0, a, b0, d0);
  mma_m16n8k16<T>(d1, a, b1, d1);
}

// Loads kNum 8x8 matrices of 16-bit elements from shared memory, one per register:
// ldmatrix.sync.aligned.m8n8.{x1,x2,x4}{.trans}.shared.b16 (PTX ISA 9.0 §9.7.14.5.15).
// Lanes 8i..8i+7 pass the (16-byte aligned) addresses of rows 0..7 of matrix i; lane L
// receives row L/4, columns 2(L%4), 2(L%4)+1 of each matrix -- or with kTrans, rows
// 2(L%4), 2(L%4)+1 of column L/4 (the layout of an mma B fragment from a row-major K x N
// tile).
template <int kNum, bool kTrans = false>
FMHA_DEVICE void ldmatrix(uint32_t (&r)[kNum], const void* smem_row) {
  static_assert(kNum == 1 || kNum == 2 || kNum == 4, "ldmatrix loads 1, 2 or 4 matrices");
#if defined(FMHA_GPU_DEVICE_PATH)
  const uint32_t p = static_cast<uint32_t>(__cvta_generic_to_shared(smem_row));
  if constexpr (kNum == 1 && !kTrans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(p));
  else if constexpr (kNum == 1 && kTrans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n"
                 : "=r"(r[0]) : "r"(p));
  else if constexpr (kNum == 2 && !kTrans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(p));
  else if constexpr (kNum == 2 && kTrans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(p));
  else if constexpr (kNum == 4 && !kTrans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(p));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(p));
#elif defined(FMHA_GPU_EMU_PATH)
  ::emu::ldmatrix(kNum, kTrans, r, smem_row);
#endif
}

// ---------------------------------------------------------------------------- cp.async
// PTX ISA 9.0 §9.7.9.25.3 "Non-bulk copy" (cp.async, cp.async.commit_group,
// cp.async.wait_group / wait_all). The copies of a thread become visible to that thread
// only after the wait that retires their group; other threads need a __syncthreads after it.

// Starts copying 16 bytes global -> shared, reading the first src_bytes (0..16) and
// zero-filling the rest (src-size). Both addresses 16-byte aligned; with src_bytes == 0
// nothing is read, but gmem must still be a valid address. kCacheL1: .ca instead of .cg.
template <bool kCacheL1 = false>
FMHA_DEVICE void cp_async_16(void* smem, const void* gmem, int src_bytes = 16) {
#if defined(FMHA_GPU_DEVICE_PATH)
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const size_t g = __cvta_generic_to_global(gmem);
  if constexpr (kCacheL1)
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(g),
                 "r"(src_bytes) : "memory");
  else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(g),
                 "r"(src_bytes) : "memory");
#elif defined(FMHA_GPU_EMU_PATH)
  ::emu::cp_async(smem, gmem, 16, src_bytes);
#endif
}

// Closes the thread's group of not-yet-committed copies (an empty group is fine).
FMHA_DEVICE void cp_async_commit() {
#if defined(FMHA_GPU_DEVICE_PATH)
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#elif defined(FMHA_GPU_EMU_PATH)
  ::emu::cp_async_commit();
#endif
}

// Waits until at most kPending of the thread's most recent groups are still in flight.
template <int kPending>
FMHA_DEVICE void cp_async_wait() {
#if defined(FMHA_GPU_DEVICE_PATH)
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
#elif defined(FMHA_GPU_EMU_PATH)
  ::emu::cp_async_wait(kPending);
#endif
}

}  // namespace gpu
}  // namespace fmha
