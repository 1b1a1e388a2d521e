// The SIMT emulator's model of Hopper's (sm_90a) asynchronous machinery: mbarrier objects
// with transaction counts, wgmma.mma_async (warpgroup MMA reading shared memory through
// matrix descriptors), TMA tensor copies (cp.async.bulk.tensor) completing through an
// mbarrier, fence.proxy.async, setmaxnreg and elect.sync. Kernels do not call these
// directly: they use cuda/hopper.cuh, whose wrappers are inline PTX under nvcc and these
// functions in host builds. The semantics, each citing its PTX ISA section, are in
// runtime.cpp ("Hopper" part); what is not modelled faithfully is listed in README.md.
//
// Kept out of cuda_emu.h so that kernels that do not use Hopper features (every sm_80 kernel)
// do not recompile when this model changes.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cuda/emu/cuda_emu.h"

namespace emu {

// ---- shared-memory addresses ----
// The shared-window address of p (what cvta.to.shared gives on a GPU): its offset from the
// start of the block's dynamic shared memory, which the emulator aligns to 1024 bytes so
// that the address bits the swizzle patterns read are those of the offset. Only dynamic
// shared memory has such an address here (static __shared__ arrays are host statics).
uint32_t smem_address(const void* p);
void* smem_pointer(uint32_t address);  // the inverse

// ---- mbarrier (PTX ISA, "Parallel Synchronization and Communication
// Instructions: mbarrier") ----
void mbarrier_init(uint64_t* bar, uint32_t count);
void mbarrier_inval(uint64_t* bar);
// Returns the state token (the phase the arrival belongs to) for mbarrier_test_wait.
uint64_t mbarrier_arrive(uint64_t* bar, uint32_t count);
uint64_t mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t tx_bytes);
void mbarrier_expect_tx(uint64_t* bar, uint32_t tx_bytes);
void mbarrier_complete_tx(uint64_t* bar, uint32_t tx_bytes);
bool mbarrier_test_wait(uint64_t* bar, uint64_t state);         // non-blocking
bool mbarrier_test_wait_parity(uint64_t* bar, uint32_t parity);  // non-blocking
// Potentially blocking: here it waits until the phase completes (a valid choice of the
// "system-dependent time limit": none), and a wait that can never end is reported as a
// deadlock instead of hanging.
bool mbarrier_try_wait_parity(uint64_t* bar, uint32_t parity);
bool mbarrier_try_wait(uint64_t* bar, uint64_t state);

// ---- wgmma (PTX ISA, "Asynchronous Warpgroup Level Matrix Multiply-Accumulate
// Instructions") ----
enum class WgmmaType : int { kF16 = 0, kBF16 = 1, kE4M3 = 2, kE5M2 = 3 };
struct WgmmaArgs {
  int n;                      // N: a multiple of 8 in [8, 256]
  WgmmaType type_a, type_b;   // f16/bf16 (k16, both the same) or e4m3/e5m2 (k32)
  float* d;                   // the thread's N/2 accumulator registers
  const uint32_t* a_regs;     // A from registers (4 per thread), or null: A from a_desc
  uint64_t a_desc, b_desc;    // matrix descriptors ("Matrix Descriptor Format")
  bool scale_d;               // false: D = A*B (the accumulator's input is ignored)
  int scale_a, scale_b;       // +1 or -1
  int trans_a, trans_b;       // 0: K-major; 1: M/N-major (16-bit types only)
};
void wgmma_fence();
void wgmma_mma_async(const WgmmaArgs& args);
void wgmma_commit_group();
void wgmma_wait_group(int n);

// ---- TMA (PTX ISA, "Data Movement and Conversion Instructions:
// cp.async.bulk.tensor"; the tensor map: "Tensors" / "Tensor-map") ----
// The emulator's tensor map: what cuTensorMapEncodeTiled records, in its own 128 bytes.
enum class TmaDtype : int { kU8 = 0, kF16 = 1, kBF16 = 2, kF32 = 3 };
enum class TmaSwizzle : int { kNone = 0, k32B = 1, k64B = 2, k128B = 3 };
struct alignas(64) TmaDescriptor {
  uint32_t magic;
  uint8_t element_bytes, rank, swizzle, dtype;
  const void* global;
  uint64_t dims[5];
  uint64_t strides[4];  // bytes, of dimensions 1..rank-1 (dimension 0 is dense)
  uint32_t box[5];
  uint32_t element_strides[5];
};
static_assert(sizeof(TmaDescriptor) == 128, "CUtensorMap is 128 bytes");
constexpr uint32_t kTmaMagic = 0x544D4150u;  // "TMAP"
// Validates as cuTensorMapEncodeTiled does and fills *out; throws std::invalid_argument.
void tma_encode(TmaDescriptor* out, TmaDtype dtype, int rank, const void* global,
                const uint64_t* dims, const uint64_t* strides_bytes, const uint32_t* box,
                const uint32_t* element_strides, TmaSwizzle swizzle);
// cp.async.bulk.tensor.Nd.shared::cluster.global.tile.mbarrier::complete_tx::bytes
void tma_load(void* smem_dst, const void* tensor_map, const int32_t* coords, uint64_t* bar);
// cp.async.bulk.tensor.Nd.global.shared::cta.tile.bulk_group, and its groups
void tma_store(const void* tensor_map, const int32_t* coords, const void* smem_src);
void bulk_commit_group();
void bulk_wait_group_read(int n);

// ---- FP8 conversion: cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32 (PTX ISA "cvt", and "Alternate
// Floating-Point Data Formats"): round to nearest even, NaN to NaN (0x7F), infinities and
// finite values beyond the format's largest (e4m3 448, e5m2 57344) to that largest, signed.
uint8_t f32_to_e4m3(float x);
uint8_t f32_to_e5m2(float x);

// ---- fences, registers, election ----
// fence.proxy.async (PTX ISA, "membar / fence"): orders this thread's generic-
// proxy shared-memory writes before later async-proxy accesses (wgmma, TMA store).
void fence_proxy_async();
// fence.mbarrier_init (PTX ISA, "membar / fence"): this thread's earlier mbarrier.init
// become visible to the async proxy (a TMA's complete_tx); the race checker reports a TMA on
// an mbarrier whose init was not so fenced and then published by a __syncthreads.
void fence_mbarrier_init();
// setmaxnreg.{inc,dec}.sync.aligned.u32 (PTX ISA, "setmaxnreg").
void setmaxnreg(bool inc, int count);
int setmaxnreg_current();  // this warpgroup's per-thread register count (tests)
// elect.sync _|p, 0xffffffff (PTX ISA, "elect.sync").
bool elect_one();

}  // namespace emu
