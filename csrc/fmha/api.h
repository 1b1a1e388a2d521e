// The core's entry points: what the bindings call. Backends are selected here; kernels
// live in csrc/cpu (one translation unit per instruction set) and csrc/cuda.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "fmha/params.h"

namespace fmha {

// ---- CPU ----
// kAvx512Bf16: AVX-512 plus the AVX512-BF16 dot products, used for bfloat16 inputs.
// kAmx: kAvx512Bf16 plus the AMX bfloat16 tiles for the bfloat16 forward (docs/cpu_kernels.md,
// "The AMX kernels"): the best level where amx_usable() and amx_hardware_built(); FMHA_CPU_ISA
// or set_cpu_isa may also choose it on any CPU with AVX512-BF16, where the tiles are the
// software model's (cpu/amx_model.h).
enum class CpuIsa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3, kAmx = 4 };
const char* isa_name(CpuIsa isa);
// The best level this CPU (and OS) supports among those this build has: scalar always; the
// x86 levels only in a build for x86-64 (cmake/cpu_core.cmake).
CpuIsa best_cpu_isa();
// e.g. {"avx2", "fma", "avx512f", "avx512bf16"}; with AMX also "amx_bf16" and "amx_tile" (the
// CPU has them and the OS saves the tile state) and "amx_permitted" (Linux granted this process
// the tile data: amx_usable()).
std::vector<std::string> cpu_features();
// The host a benchmark ran on, for its result file: vendor, family and model, the
// microarchitecture when the pair is a known one, the model name, the clock and the SIMD
// flags that matter here, from /proc/cpuinfo ("unknown CPU" where it cannot be read).
std::string cpu_description();
// The level used by the CPU kernels: FMHA_CPU_ISA (scalar|avx2|avx512|avx512bf16|amx) if set,
// else the best supported. Forcing a level the CPU (or the build) lacks is an error; amx is
// allowed wherever avx512bf16 runs (through the model without AMX).
CpuIsa active_cpu_isa();
// The CpuIsa that isa_name spells `name`; otherwise InvalidArgument "<source>: got '...',
// expected one of scalar, avx2, avx512, avx512bf16, amx". FMHA_CPU_ISA and fmha._C.set_cpu_isa
// both read names through it.
CpuIsa parse_cpu_isa(const std::string& name, const char* source);
void set_cpu_isa(CpuIsa isa);  // throws Unsupported if the CPU lacks it (amx: as FMHA_CPU_ISA)

void cpu_forward(const FwdParams& p);
// The FMA peak of the active ISA on `threads` threads, measured (takes ~0.1-1 s).
double cpu_fma_peak_gflops(int threads);
// The bfloat16 pair dot-product peak (AVX512-BF16's vdpbf16ps, counted as 2 FLOPs per
// product) of the active ISA on `threads` threads, measured; 0 when the level has no such
// instruction (the bfloat16 kernels then run on float FMAs: judge them by the FMA peak).
double cpu_bf16_dot_peak_gflops(int threads);

// ---- AMX (the tiles of AMX-TILE and AMX-BF16; docs/cpu_kernels.md, "AMX: the model and the
// level") ----
// What this process may use, decided once: the CPU's CPUID bits (leaf 7: AMX-BF16 EDX bit 22,
// AMX-TILE EDX bit 24), the OS's XCR0 (bits 17 XTILECFG and 18 XTILEDATA) and, on Linux, the
// permission for the tile data (arch_prctl ARCH_REQ_XCOMP_PERM), which FMHA_AMX_DENY=1 refuses
// without asking the kernel (a test hook). `note` says why AMX is not usable, when it is not.
struct AmxStatus {
  bool bf16 = false, tile = false, os_enabled = false, permitted = false;
  std::string note;
};
const AmxStatus& amx_status();
bool amx_usable();  // bf16 && tile && os_enabled && permitted
// The decision of amx_status from its inputs (for the tests, on any host): request() is asked
// for the permission only when the CPU and the OS offer AMX and deny is false; it returns 0 when
// granted, else the errno of the refusal.
AmxStatus decide_amx(uint32_t cpuid7_edx, uint64_t xcr0, bool deny, int (*request)());
// Whether this build has the AMX instructions (the compiler took -mamx-tile -mamx-bf16).
bool amx_hardware_built();
// The AMX bfloat16 tile peak (TDPBF16PS, 2 FLOPs per product) on `threads` threads, measured;
// 0 unless amx_usable() and amx_hardware_built().
double cpu_amx_peak_gflops(int threads);
// Runs a tile program (cpu/amx.h: kWordsPerInstr words an instruction) over mem[0, bytes)
// through the AMX model, or, with `hardware`, through the model on a copy (which checks it)
// and then the hardware (Unsupported unless amx_usable() and amx_hardware_built()).
void cpu_amx_run_tiles(const int64_t* program, int64_t n, uint8_t* mem, int64_t bytes,
                       bool hardware);
// Plants one of the faults of cpu/amx_model.h (kPlanted*; 0 removes it) in the AMX model or the
// amx level's forward, process-wide: a hook for the tests that show the level's suite catches
// them, bound only in the testing build's fmha._C.
void cpu_amx_plant_fault(int fault);
// The read bandwidth of `threads` threads summing a `bytes` buffer, measured (GB/s, 1e9 B/s):
// the limit decode is judged against.
double cpu_read_bandwidth_gbs(int threads, int64_t bytes);
// y = exp(x) as the active ISA's softmax computes it (for accuracy tests); lean: the forward's
// exp for 16-bit inputs (x <= 0).
void cpu_exp(const float* x, float* y, int64_t n, bool lean = false);
// y = the values of the one-byte codes x of an 8-bit cache (code: fmha::KvCode 1..3), as the
// CPU kernels' dequantisation computes them (for the exhaustive test of the conversions).
void cpu_decode_kv_codes(int code, const uint8_t* x, float* y, int64_t n);
void cpu_backward(const BwdParams& p);
// What a CPU call would take on one thread, in nanoseconds (`passes` times the forward's
// work; the backward is about 2): an estimate for the thread pool, which uses it to decide
// how many helpers are worth waking (fmha/threads.h), never which task runs where.
int64_t cpu_work_estimate_ns(const FwdParams& p, double passes = 1.0);

// cpu_forward, cpu_backward, cuda_forward and cuda_backward check their params against the
// validation contract first (fmha/validate.h).

// ---- CUDA (present when built with nvcc; reports no device when none is usable) ----
bool cuda_built();
int cuda_device_count();  // 0 when there is no driver or no GPU
std::string cuda_status();  // why there is no GPU, or the devices found
// (major, minor) compute capability of device `device`; throws Unsupported when there is
// no such device (or no CUDA in this build).
std::pair<int, int> cuda_capability(int device);
// The CUDA kernels on device memory, enqueued on `stream` (a cudaStream_t; nullptr = the
// legacy default stream) of device `device`, which they make current for the launch.
// Throw Unsupported when fmha was built without CUDA, InvalidArgument for inputs the kernels
// do not support (float32, head_dim > 256, ...: check_params(p, Backend::kCuda)). Every
// pointer of p, cu_seqlens included, is device memory; alibi_slopes are float64 on the device.
void cuda_forward(const FwdParams& p, int device, void* stream);
void cuda_backward(const BwdParams& p, int device, void* stream);
// KV-cache calls on CUDA check cache_seqlens and block_table on the device (no host sync);
// a refused call writes NaN and ORs gpu::KvCacheRefusal bits (cuda/flash_decode.h) into a
// per-device flag. This reads it (synchronising) and, when `clear`, resets it.
int cuda_kvcache_refusals(int device, bool clear);

// The version of libfmha (the package's version, set by the build).
const char* library_version();

}  // namespace fmha
