// The SIMT emulator: with this header, g++ compiles fmha's CUDA kernel sources (.cu/.cuh)
// as host C++, and a launch runs them on the CPU. It exists so that CI, which has no GPU,
// runs the real kernels -- and so that the usual kernel bugs (indexing, fragment layouts,
// masking, missing barriers, out-of-bounds accesses) fail a test instead of shipping.
//
// Execution model (see runtime.cpp for the implementation):
//  * A launch runs its blocks one after another, in a random order (CUDA promises none;
//    its errors name the seed, and FMHA_EMU_SCHEDULE_SEED=<n> replays it: runtime.cpp). Each CUDA thread of a block is
//    a fiber (a user-space context with its own stack, all of the block's on the launching
//    OS thread, switched in a random order whenever one waits at a barrier) or, in builds
//    instrumented by AddressSanitizer or ThreadSanitizer, a real OS thread (FMHA_EMU_FIBERS
//    in runtime.cpp). threadIdx / blockIdx / blockDim / gridDim are per CUDA thread. Warp w
//    of a block is linear threads 32w..32w+31.
//  * __syncthreads (and __syncthreads_or) and __syncwarp are barriers (mutex + condition
//    variables, which ThreadSanitizer understands, with OS threads; a yield to the block's
//    other fibers with fibers). Every barrier checks CUDA's rules instead of hanging:
//    all threads of a block must reach the same __syncthreads (same file:line), no thread
//    may exit while others wait at, or will later reach, a __syncthreads, and a deadlock
//    (every live thread waiting on a barrier that cannot complete) is reported as an error.
//    So: like CUDA, kernels must reach every barrier from every thread.
//  * Warp-collective operations (shuffles, ballot, mma.sync, ldmatrix) are full-warp
//    (.sync.aligned, membermask 0xffffffff): each lane deposits its operand in a per-warp
//    buffer, the warp meets at a barrier, and each lane computes its own result from the
//    buffer. All 32 lanes must be live and at the same operation; otherwise it is an error
//    (the PTX ISA makes it undefined behaviour).
//  * __shared__ memory: a static `__shared__ T x[N];` is function-static storage; blocks run
//    one at a time, so it is per block. Dynamic shared memory (FMHA_DYNAMIC_SHARED in
//    cuda/primitives.cuh; `extern __shared__` cannot be expressed in C++) is allocated for
//    each block with its exact size (1024-byte aligned) -- AddressSanitizer sees any access
//    past its end -- and filled with 0xFF bytes (NaN in f16/bf16/f32), so reading shared
//    memory that no thread wrote shows up in the results. More than 48 KiB needs the
//    opt-in, as on the GPU.
//  * cp.async copies are deferred to the cp.async.wait_group that retires their group, so a
//    kernel that reads its tile before waiting sees stale data here too.
//  * Hopper's asynchronous machinery (mbarrier, wgmma, TMA, setmaxnreg, elect.sync) is in
//    hopper_emu.h, used through cuda/hopper.cuh; its model and limits: README.md, "Hopper".
//  * Errors (barrier misuse, misaligned ldmatrix/cp.async, __trap) abort the launch; the
//    launch then throws emu::LaunchError naming the kernel, block and thread.
//
// Race checking (racecheck.cpp, linked into test builds only): kernel translation units
// compiled with -fsanitize=thread call __tsan_read/__tsan_write for each memory access; the
// emulator's own implementation of those hooks keeps a shadow of every byte a block touches
// (last writer, readers, barrier epochs) and reports two accesses by different threads, at
// least one a write, with no __syncthreads (or, within a warp, __syncwarp / warp
// collective) between them. It is deterministic: it does not depend on how the OS happened
// to schedule the threads.
//
// Numerics: float->half/bf16 conversions round to nearest even, NaN -> 0x7FFF (cvt.rn);
// mma.sync multiplies exactly and adds in double, rounding once to float (the hardware's
// internal accumulation order is unspecified; results agree to float rounding).
#pragma once

#if defined(__CUDACC__)
#error "cuda_emu.h is the host emulation of CUDA; nvcc builds use the CUDA headers"
#endif

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "cuda/emu/runtime.h"

// ---- CUDA keywords: execution spaces vanish, __shared__ is per-block static storage ----
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static

struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
};
constexpr int warpSize = 32;

namespace emu {

// What a running CUDA thread knows about itself. `impl` is the runtime's private state.
struct ThreadState {
  uint3 thread_idx, block_idx;
  dim3 block_dim, grid_dim;
  void* impl;
};

// The calling CUDA thread; null on any other thread (the host, the launcher).
extern __thread const ThreadState* g_thread;
[[noreturn]] void not_in_kernel(const char* what);
inline const ThreadState& self() {
  if (__builtin_expect(g_thread == nullptr, 0)) not_in_kernel("threadIdx/blockIdx");
  return *g_thread;
}

// ---- barriers ----
void syncthreads(const char* file, int line);
int syncthreads_or(int predicate, const char* file, int line);
void syncwarp(unsigned mask, const char* file, int line);

// ---- warp collectives (full warp); each follows the PTX ISA section cited in runtime.cpp ----
enum class MmaType : int { kF16 = 0, kBF16 = 1 };
// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32: d = a*b + c.
void mma_m16n8k16(MmaType type, float d[4], const uint32_t a[4], const uint32_t b[2],
                  const float c[4]);
// ldmatrix.sync.aligned.m8n8.{x1,x2,x4}{.trans}.shared.b16: `num` registers into r.
void ldmatrix(int num, bool trans, uint32_t* r, const void* row_address);
enum class ShflMode : int { kUp = 0, kDown = 1, kBfly = 2, kIdx = 3 };
// shfl.sync.{up,down,bfly,idx}.b32 d, a, b, c, 0xffffffff.
uint32_t shfl(ShflMode mode, uint32_t a, uint32_t b, uint32_t c);
// vote.sync.ballot.b32 d, p, 0xffffffff.
uint32_t ballot(bool p);

// ---- asynchronous copies (cp.async.{ca,cg}.shared.global, commit_group, wait_group) ----
void cp_async(void* smem_dst, const void* gmem_src, int cp_size, int src_size);
void cp_async_commit();
void cp_async_wait(int n);

// ---- memory ----
float atomic_add(float* address, float value);
void* dynamic_smem();
size_t dynamic_smem_bytes();
// cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes).
void set_max_dynamic_smem(const void* kernel, size_t bytes);
// The same for a kernel built for sm_90 only (the Hopper kernels): its 227 KiB per CTA.
void set_max_dynamic_smem_sm90(const void* kernel, size_t bytes);
// Device scratch (cuda/primitives.cuh, Scratch) taken and given back, for the live and peak
// byte counts of emu::stats().
void scratch_taken(size_t bytes);
void scratch_returned(size_t bytes);

[[noreturn]] void trap(const char* message, const char* file, int line);

// ---- conversions: cvt.rn.{f16,bf16}.f32 (round to nearest even, NaN -> 0x7FFF) and back ----
inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float f32_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t f32_to_f16_bits(float f) {
  const uint32_t u = f32_bits(f), sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return 0x7FFFu;                 // NaN: the canonical NaN
  if (a >= 0x477FF000u) return uint16_t(sign | 0x7C00u);  // >= 65520 rounds to infinity
  if (a <= 0x33000000u) return uint16_t(sign);            // <= 2^-25 rounds (ties even) to 0
  const int e = int(a >> 23) - 127;
  uint32_t h, rem, half;
  if (e >= -14) {  // normal half: keep 10 of the 23 fraction bits
    h = (uint32_t(e + 15) << 10) | ((a >> 13) & 0x3FFu);
    rem = a & 0x1FFFu;
    half = 0x1000u;
  } else {  // subnormal half: value / 2^-24 = significand * 2^(e + 1)
    const uint32_t sig = (a & 0x7FFFFFu) | 0x800000u;
    const int shift = -(e + 1);  // 14..24
    h = sig >> shift;
    rem = sig & ((1u << shift) - 1u);
    half = 1u << (shift - 1);
  }
  if (rem > half || (rem == half && (h & 1u))) ++h;  // a carry may step into the exponent
  return uint16_t(sign | h);
}
inline uint16_t f32_to_bf16_bits(float f) {
  const uint32_t u = f32_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFFu;
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
inline float f16_bits_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  if (e == 0x1F) return f32_from_bits(sign | 0x7F800000u | (m << 13));
  if (e != 0) return f32_from_bits(sign | ((e + 112u) << 23) | (m << 13));
  const float v = float(m) * 5.9604644775390625e-8f;  // m * 2^-24, exact
  return sign ? -v : v;
}
inline float bf16_bits_to_f32(uint16_t h) { return f32_from_bits(uint32_t(h) << 16); }

// ---- launch ----
using Thunk = void (*)(void*);
void launch_impl(const char* name, const void* kernel, dim3 grid, dim3 block,
                 size_t dynamic_smem_bytes, Thunk thunk, void* closure);

// Runs kernel<<<grid, block, smem>>>(args...) to completion; throws LaunchError on failure.
// Arguments convert to the parameter types, as in a CUDA launch.
template <typename... Params, typename... Args>
void launch(const char* name, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
            Args&&... args) {
  static_assert(sizeof...(Params) == sizeof...(Args), "wrong number of kernel arguments");
  struct Closure {
    void (*kernel)(Params...);
    std::tuple<std::decay_t<Params>...> args;
  };
  Closure closure{kernel, std::tuple<std::decay_t<Params>...>(std::forward<Args>(args)...)};
  launch_impl(
      name, reinterpret_cast<const void*>(kernel), grid, block, smem,
      [](void* p) {
        auto* c = static_cast<Closure*>(p);
        std::apply(c->kernel, c->args);  // each thread gets its own copy of the parameters
      },
      &closure);
}

}  // namespace emu

// ---- the built-in variables and functions kernels use ----
#define threadIdx (::emu::self().thread_idx)
#define blockIdx (::emu::self().block_idx)
#define blockDim (::emu::self().block_dim)
#define gridDim (::emu::self().grid_dim)

inline void __syncthreads(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  ::emu::syncthreads(file, line);
}
inline int __syncthreads_or(int predicate, const char* file = __builtin_FILE(),
                            int line = __builtin_LINE()) {
  return ::emu::syncthreads_or(predicate, file, line);
}
inline void __syncwarp(unsigned mask = 0xFFFFFFFFu, const char* file = __builtin_FILE(),
                       int line = __builtin_LINE()) {
  ::emu::syncwarp(mask, file, line);
}
[[noreturn]] inline void __trap(const char* file = __builtin_FILE(),
                                int line = __builtin_LINE()) {
  ::emu::trap("__trap()", file, line);
}

// CUDA's device-side min/max overloads.
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline int64_t min(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t max(int64_t a, int64_t b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }

// The 16-bit float storage types of cuda_fp16.h / cuda_bf16.h, reduced to their bits:
// kernels convert through cuda/primitives.cuh, never through these types' operators.
struct __half {
  unsigned short __x;
};
struct __nv_bfloat16 {
  unsigned short __x;
};
