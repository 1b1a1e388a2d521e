#if __has_include(<sys/mman.h>)
#include <sys/mman.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <cerrno>
#include <cstring>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <mutex>

#include "cpu/amx.h"
#include "cpu/kernels.h"
#include "fmha/api.h"
#include "fmha/error.h"
#include "fmha/fp8.h"
#include "fmha/kvcache.h"
#include "fmha/threads.h"
#include "fmha/validate.h"

namespace fmha {

const char* isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kScalar: return "scalar";
    case CpuIsa::kAvx2: return "avx2";
    case CpuIsa::kAvx512: return "avx512";
    case CpuIsa::kAvx512Bf16: return "avx512bf16";
    case CpuIsa::kAmx: return "amx";
  }
  return "?";
}

namespace {
// Every CpuIsa, lowest first; isa_name spells each.
constexpr CpuIsa kCpuIsas[] = {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512,
                               CpuIsa::kAvx512Bf16, CpuIsa::kAmx};

// The entry points of one compiled level.
struct IsaKernels {
  void (*forward)(const FwdParams&);
  void (*backward)(const BwdParams&);
  double (*fma_peak_gflops)(int);
  double (*bf16_dot_peak_gflops)(int);
  double (*read_bandwidth_gbs)(int, int64_t);
  void (*exp_array)(const float*, float*, int64_t, bool);
  void (*decode_kv_codes)(int, const uint8_t*, float*, int64_t);
};
#define FMHA_ISA_KERNELS(ns) \
  IsaKernels { cpu::ns::forward, cpu::ns::backward, cpu::ns::fma_peak_gflops, \
               cpu::ns::bf16_dot_peak_gflops, \
               cpu::ns::read_bandwidth_gbs, cpu::ns::exp_array, cpu::ns::decode_kv_codes }

// The levels this build compiled (CMake defines FMHA_CPU_HAVE_<LEVEL>, cmake/cpu_core.cmake:
// the x86 levels exist only on x86-64, and always as a prefix of kCpuIsas); nullptr for the
// others, whose symbols do not exist in this build. The amx level has its own forward and
// backward (instantiate_amx.cpp) and the avx512bf16 level's probes.
const IsaKernels* compiled_kernels(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kScalar: {
      static constexpr IsaKernels k = FMHA_ISA_KERNELS(scalar);
      return &k;
    }
#if defined(FMHA_CPU_HAVE_AVX2)
    case CpuIsa::kAvx2: {
      static constexpr IsaKernels k = FMHA_ISA_KERNELS(avx2);
      return &k;
    }
#endif
#if defined(FMHA_CPU_HAVE_AVX512)
    case CpuIsa::kAvx512: {
      static constexpr IsaKernels k = FMHA_ISA_KERNELS(avx512);
      return &k;
    }
#endif
#if defined(FMHA_CPU_HAVE_AVX512BF16)
    case CpuIsa::kAvx512Bf16: {
      static constexpr IsaKernels k = FMHA_ISA_KERNELS(avx512bf16);
      return &k;
    }
#endif
#if defined(FMHA_CPU_HAVE_AMX)
    case CpuIsa::kAmx: {
      static constexpr IsaKernels k{cpu::amx_tiles::forward, cpu::amx_tiles::backward,
                                    cpu::avx512bf16::fma_peak_gflops,
                                    cpu::avx512bf16::bf16_dot_peak_gflops,
                                    cpu::avx512bf16::read_bandwidth_gbs,
                                    cpu::avx512bf16::exp_array,
                                    cpu::avx512bf16::decode_kv_codes};
      return &k;
    }
#endif
    default: return nullptr;
  }
}
#undef FMHA_ISA_KERNELS
}  // namespace

CpuIsa parse_cpu_isa(const std::string& name, const char* source) {
  std::string names;
  for (CpuIsa isa : kCpuIsas) {
    if (name == isa_name(isa)) return isa;
    names += concat(names.empty() ? "" : ", ", isa_name(isa));
  }
  throw InvalidArgument(concat(source, ": got '", name, "', expected one of ", names));
}

namespace cpu {

// Measured with tools/cpu_ab.py, fp32 (docs/cpu_kernels.md, "The forward"): in the
// forward (V) the copy gains 3-6% on Ice Lake-SP (its rows at a 2 KiB stride evict each other
// from L1) and loses 3-6% on Zen 4 (AMD family 25) and 1-4% on Zen 5 (family 26), where
// reading them in place is faster. In the backward (Q and dO) copying them with K gained
// 5-10% on Ice Lake and was neutral on Zen 4; on Zen 5 reading Q and dO in place is 0.9-4.8%
// faster (0.986-0.990 on one long causal d 64 case). The families' other members are taken
// as measured with them. Other cores keep the copy, the choice measured first.
bool copies_b_rows_dense() {
  static const bool copy = [] {
#if defined(__x86_64__) || defined(__i386__)
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return true;
    const bool amd = b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u;  // AuthenticAMD
    if (!__get_cpuid(1, &a, &b, &c, &d)) return true;
    const unsigned base = (a >> 8) & 0xfu;
    const unsigned family = base == 0xfu ? base + ((a >> 20) & 0xffu) : base;
    return !(amd && (family == 25 || family == 26));
#else
    return true;
#endif
  }();
  return copy;
}

}  // namespace cpu

std::vector<std::string> cpu_features() {
  std::vector<std::string> f;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  // libgcc checks XCR0 too, so a feature the OS does not save is reported absent.
  if (__builtin_cpu_supports("avx2")) f.push_back("avx2");
  if (__builtin_cpu_supports("fma")) f.push_back("fma");
  if (__builtin_cpu_supports("f16c")) f.push_back("f16c");
  if (__builtin_cpu_supports("avx512f")) f.push_back("avx512f");
  if (__builtin_cpu_supports("avx512bw")) f.push_back("avx512bw");
  if (__builtin_cpu_supports("avx512vl")) f.push_back("avx512vl");
  if (__builtin_cpu_supports("avx512dq")) f.push_back("avx512dq");
  if (__builtin_cpu_supports("avx512bf16")) f.push_back("avx512bf16");
#endif
  const AmxStatus& amx = amx_status();
  if (amx.bf16 && amx.os_enabled) f.push_back("amx_bf16");
  if (amx.tile && amx.os_enabled) f.push_back("amx_tile");
  if (amx_usable()) f.push_back("amx_permitted");
  return f;
}

// ---- AMX: detection and permission ----

AmxStatus decide_amx(uint32_t cpuid7_edx, uint64_t xcr0, bool deny, int (*request)()) {
  AmxStatus s;
  // CPUID.(EAX=07H, ECX=0):EDX bit 22 AMX-BF16, bit 24 AMX-TILE (SDM Vol. 2, CPUID, Table
  // "Structured Extended Feature Flags Enumeration Leaf").
  s.bf16 = (cpuid7_edx >> 22) & 1;
  s.tile = (cpuid7_edx >> 24) & 1;
  // XCR0 bit 17 XTILECFG, bit 18 XTILEDATA: the OS saves and restores the tile state (SDM
  // Vol. 1, 13.1, "XSAVE-Supported Features and State-Component Bitmaps").
  s.os_enabled = ((xcr0 >> 17) & 3) == 3;
  if (!s.bf16 || !s.tile) {
    s.note = "the CPU has no AMX-BF16 / AMX-TILE";
    return s;
  }
  if (!s.os_enabled) {
    s.note = "the OS does not enable the AMX tile state (XCR0 bits 17, 18)";
    return s;
  }
  if (deny) {
    s.note = "FMHA_AMX_DENY=1: the tile data permission was not requested (a test hook)";
    return s;
  }
  const int err = request();
  s.permitted = err == 0;
  if (!s.permitted)
    s.note = concat("the kernel refused the AMX tile data (arch_prctl ARCH_REQ_XCOMP_PERM: ",
                    std::strerror(err), ")");
  return s;
}

namespace {

// Linux enables the AMX tile data per process, on request: arch_prctl(ARCH_REQ_XCOMP_PERM,
// XFEATURE_XTILEDATA) (the Linux kernel's x86 "dynamically enabled XSTATE features"
// interface); until granted, the first tile instruction kills the process. 0 or an errno.
int request_tile_permission() {
#if defined(__linux__) && defined(__x86_64__)
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0 ? 0 : errno;
#else
  return ENOSYS;  // no known way to ask elsewhere: not permitted
#endif
}

AmxStatus detect_amx() {
  uint32_t edx7 = 0;
  uint64_t xcr0 = 0;
#if defined(__x86_64__) || defined(__i386__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) edx7 = d;
  // XGETBV is allowed only when CPUID.1:ECX.OSXSAVE[bit 27] is set.
  if (__get_cpuid(1, &a, &b, &c, &d) && ((c >> 27) & 1)) {
    uint32_t lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    xcr0 = (uint64_t(hi) << 32) | lo;
  }
#endif
  const char* deny = std::getenv("FMHA_AMX_DENY");
  AmxStatus s = decide_amx(edx7, xcr0, deny != nullptr && std::strcmp(deny, "1") == 0,
                           &request_tile_permission);
#if !(defined(__x86_64__) || defined(__i386__))
  s.note = "not an x86 CPU";
#endif
  return s;
}

}  // namespace

const AmxStatus& amx_status() {
  static const AmxStatus s = detect_amx();
  return s;
}

bool amx_usable() {
  const AmxStatus& s = amx_status();
  return s.bf16 && s.tile && s.os_enabled && s.permitted;
}

bool amx_hardware_built() {
#if defined(FMHA_CPU_HAVE_AMX_HW)
  return true;
#else
  return false;
#endif
}

double cpu_amx_peak_gflops([[maybe_unused]] int threads) {
#if defined(FMHA_CPU_HAVE_AMX_HW)
  if (amx_usable()) return cpu::amx_hw::amx_bf16_peak_gflops(threads);
#endif
  return 0.0;
}

void cpu_amx_run_tiles(const int64_t* program, int64_t n, uint8_t* mem, int64_t bytes,
                       bool hardware) {
  FMHA_CHECK_ARG(n >= 0 && bytes >= 0, "n, bytes: expected >= 0, got ", n, " and ", bytes);
  if (!hardware) return cpu::amx::run_tile_program_model(program, n, mem, bytes);
  if (!amx_hardware_built() || !amx_usable())
    throw Unsupported(amx_hardware_built()
                          ? concat("AMX is not usable here: ", amx_status().note)
                          : std::string("this build has no AMX instructions (the compiler did "
                                        "not take -mamx-tile -mamx-bf16)"));
#if defined(FMHA_CPU_HAVE_AMX_HW)
  // The model checks the program (its faults, and every byte in the buffer) on a copy first:
  // the hardware would kill the process where the model throws.
  std::vector<uint8_t> scratch(mem, mem + bytes);
  cpu::amx::run_tile_program_model(program, n, scratch.data(), bytes);
  cpu::amx_hw::run_tile_program(program, n, mem);
#endif
}

void cpu_amx_plant_fault(int fault) {
  FMHA_CHECK_ARG(fault >= cpu::amx::kPlantedNone && fault <= cpu::amx::kPlantedRepackFault,
                 "fault: expected 0, 1 or 2, got ", fault);
  cpu::amx::set_planted_fault(fault);
}

namespace {

// The microarchitecture of an x86 (vendor, family, model), for the hosts this project has
// met and their close kin; "" otherwise.
const char* microarchitecture(const std::string& vendor, int family, int model) {
  if (vendor == "GenuineIntel" && family == 6) {
    switch (model) {
      case 85: return "Skylake-SP / Cascade Lake";
      case 106: case 108: return "Ice Lake-SP";
      case 143: return "Sapphire Rapids";
      case 207: return "Emerald Rapids";
      case 173: case 174: return "Granite Rapids";
    }
  }
  if (vendor == "AuthenticAMD") {
    if (family == 23 && model == 49) return "Zen 2 (Rome)";
    if (family == 25 && model == 1) return "Zen 3 (Milan)";
    if (family == 25 && model == 17) return "Zen 4 (Genoa)";
    if (family == 25 && model == 160) return "Zen 4c (Bergamo)";
    if (family == 26) return "Zen 5";
  }
  return "";
}

}  // namespace

std::string cpu_description() {
  std::FILE* f = std::fopen("/proc/cpuinfo", "r");
  if (!f) return "unknown CPU";
  std::string vendor, name, mhz, flags;
  int family = -1, model = -1;
  char line[8192];
  while (std::fgets(line, sizeof line, f)) {  // the first processor's block is enough
    std::string l(line);
    if (l == "\n") break;
    const size_t colon = l.find(':');
    if (colon == std::string::npos) continue;
    std::string key = l.substr(0, colon), value = l.substr(colon + 1);
    while (!key.empty() && (key.back() == ' ' || key.back() == '\t')) key.pop_back();
    while (!value.empty() && (value.front() == ' ')) value.erase(0, 1);
    while (!value.empty() && (value.back() == '\n')) value.pop_back();
    if (key == "vendor_id") vendor = value;
    else if (key == "cpu family") family = std::atoi(value.c_str());
    else if (key == "model") model = std::atoi(value.c_str());
    else if (key == "model name") name = value;
    else if (key == "cpu MHz") mhz = value.substr(0, value.find('.'));
    else if (key == "flags") flags = " " + value + " ";
  }
  std::fclose(f);
  if (vendor.empty() && name.empty()) return "unknown CPU";
  std::string d = vendor.empty() ? name : vendor;
  if (family >= 0) d += concat(" family ", family, " model ", model);
  const std::string uarch = microarchitecture(vendor, family, model);
  if (!uarch.empty()) d += " (" + uarch + ")";
  if (!vendor.empty() && !name.empty()) d += " | " + name;
  if (!mhz.empty()) d += " | " + mhz + " MHz";
  std::string simd;
  for (const char* flag : {"avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16"})
    if (flags.find(std::string(" ") + flag + " ") != std::string::npos) simd += std::string(" ") + flag;
  if (!simd.empty()) d += " | flags" + simd;
  return d;
}

static bool has(const std::vector<std::string>& f, const char* name) {
  for (const auto& s : f) if (s == name) return true;
  return false;
}

// The best level is amx only where the tiles are the hardware's; FMHA_CPU_ISA=amx (or
// set_cpu_isa) may also choose it on any CPU that runs the avx512bf16 level, where its kernels
// run the tiles through the software model (cpu/amx_model.h): a level for testing, never
// picked by default.
CpuIsa best_cpu_isa() {
  const auto f = cpu_features();
  CpuIsa cpu = CpuIsa::kScalar;
  if (has(f, "avx512f") && has(f, "avx512bw") && has(f, "avx512vl") && has(f, "avx512dq") &&
      has(f, "fma") && has(f, "f16c"))
    cpu = !has(f, "avx512bf16")                    ? CpuIsa::kAvx512
          : amx_usable() && amx_hardware_built() ? CpuIsa::kAmx
                                                 : CpuIsa::kAvx512Bf16;
  else if (has(f, "avx2") && has(f, "fma") && has(f, "f16c"))
    cpu = CpuIsa::kAvx2;
  // The compiled levels are a prefix of kCpuIsas: step down to the highest one built.
  while (compiled_kernels(cpu) == nullptr) cpu = CpuIsa(int(cpu) - 1);
  return cpu;
}

namespace {
// Whether `isa` may be chosen here: at most the best level, or the amx level (through the model
// where the hardware is not usable) wherever the avx512bf16 level runs and the build has it.
bool isa_allowed(CpuIsa isa) {
  const CpuIsa best = best_cpu_isa();
  if (int(isa) <= int(best)) return true;
  return isa == CpuIsa::kAmx && best == CpuIsa::kAvx512Bf16 && compiled_kernels(isa) != nullptr;
}

// Why `isa` (above the best level) may not be chosen.
std::string isa_refusal(CpuIsa isa) {
  const CpuIsa best = best_cpu_isa();
  if (!compiled_kernels(isa))
    return concat("this build has no ", isa_name(isa), " kernels (the best level here is ",
                  isa_name(best), ")");
  if (isa == CpuIsa::kAmx)
    return concat("this CPU supports at most ", isa_name(best),
                  "; the amx level runs on CPUs with AVX512-BF16 (through the AMX model where "
                  "there is no AMX: ", amx_status().note, ")");
  return concat("this CPU supports at most ", isa_name(best));
}

std::once_flag isa_once;
CpuIsa isa_value = CpuIsa::kScalar;
std::string isa_error;

void init_isa() {
  isa_value = best_cpu_isa();
  const char* env = std::getenv("FMHA_CPU_ISA");
  if (env == nullptr || *env == '\0') return;
  CpuIsa wanted;
  try {
    wanted = parse_cpu_isa(env, "FMHA_CPU_ISA");
  } catch (const InvalidArgument& e) {
    isa_error = e.what();
    return;
  }
  if (!isa_allowed(wanted)) {
    isa_error = concat("FMHA_CPU_ISA=", env, ": ", isa_refusal(wanted));
    return;
  }
  isa_value = wanted;
}
}  // namespace

CpuIsa active_cpu_isa() {
  std::call_once(isa_once, init_isa);
  if (!isa_error.empty()) throw Unsupported(isa_error);
  return isa_value;
}

void set_cpu_isa(CpuIsa isa) {
  std::call_once(isa_once, init_isa);
  if (!isa_allowed(isa))
    throw Unsupported(concat("CPU ISA ", isa_name(isa), ": ", isa_refusal(isa)));
  isa_value = isa;
  isa_error.clear();
}

namespace {

size_t element_size(DType t) {
  switch (t) {
    case DType::kFloat64: return 8;
    case DType::kFloat32: return 4;
    case DType::kFloat8E4M3: return 1;
    default: return 2;
  }
}

// Outputs are usually fresh allocations that the kernels touch first: with transparent huge
// pages in "madvise" mode (the common default) every 4 KiB page then faults and is zeroed on
// its own. Asking for huge pages on the aligned middle of large outputs cuts that cost (for
// a decode-shaped backward writing 256 MB of dK/dV, the faults were half the time). Only a
// hint: the memory stays the caller's, and a kernel without THP ignores it.
void hint_huge_pages(const void* ptr, int64_t batch, int64_t rows, int64_t heads, int64_t dim,
                     int64_t bs, int64_t rs, int64_t hs, DType t) {
  const int64_t last = (batch - 1) * bs + (rows - 1) * rs + (heads - 1) * hs + dim;
  const size_t bytes = size_t(last) * element_size(t);
  constexpr size_t kHuge = size_t(2) << 20;
  if (bytes < 4 * kHuge) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(ptr) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(ptr) + bytes) & ~(kHuge - 1);
#ifdef MADV_HUGEPAGE
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#endif
}

// The kernels of the active level (active_cpu_isa never returns a level that was not built).
const IsaKernels& active_kernels() { return *compiled_kernels(active_cpu_isa()); }

int64_t rows_of(const FwdParams& p, bool q_side) {
  if (!p.cu_seqlens_q) return q_side ? p.seqlen_q : p.seqlen_k;
  return q_side ? p.total_q : p.total_k;  // packed rows
}

// ---- empty calls: the kernels' tiles assume at least one query row and one key row, so a
// call without either is answered here, before any kernel (docs/errors.md, "Empty inputs").

// Does the call have a query row (q_side) or a key row? (Varlen: in some sequence.)
bool has_rows(const FwdParams& p, bool q_side) {
  return p.batch > 0 && (q_side ? p.heads_q : p.heads_kv) > 0 && rows_of(p, q_side) > 0;
}

// One dimension of an array to fill: its extent and its element stride.
struct Dim {
  int64_t n, stride;
};

// Sets every element of the 4-D strided array at `base` to `value`.
template <typename T>
void fill(void* base, Dim d0, Dim d1, Dim d2, Dim d3, T value) {
  for (int64_t a = 0; a < d0.n; ++a)
    for (int64_t b = 0; b < d1.n; ++b)
      for (int64_t c = 0; c < d2.n; ++c) {
        T* row = static_cast<T*>(base) + a * d0.stride + b * d1.stride + c * d2.stride;
        for (int64_t e = 0; e < d3.n; ++e) row[e * d3.stride] = value;
      }
}

// Zeros of the input dtype: +0 has every bit clear in each float format, so the element
// size is all that matters.
void fill_zero(void* base, DType t, Dim d0, Dim d1, Dim d2, Dim d3) {
  switch (element_size(t)) {
    case 8: return fill<uint64_t>(base, d0, d1, d2, d3, 0);
    case 4: return fill<uint32_t>(base, d0, d1, d2, d3, 0);
    default: return fill<uint16_t>(base, d0, d1, d2, d3, 0);
  }
}

// Zeros in a (batch, rows, heads, dim) tensor of the call (varlen: one packed batch) of
// dtype t (the inputs' dtype, or out_dtype for out).
void zero_rows(const FwdParams& p, void* base, DType t, bool q_side, int heads, int dim,
               int64_t bs, int64_t rs, int64_t hs) {
  const bool varlen = p.cu_seqlens_q != nullptr;
  fill_zero(base, t, {varlen ? 1 : p.batch, bs}, {rows_of(p, q_side), rs}, {heads, hs},
            {dim, 1});
}

// Query rows without a key row: each row sees no key, so out = 0 and lse = -inf.
void forward_without_keys(const FwdParams& p) {
  zero_rows(p, p.o, out_dtype(p), true, p.heads_q, p.head_dim_v, p.o_batch_stride,
            p.o_row_stride, p.o_head_stride);
  const Dim b{p.cu_seqlens_q ? 1 : p.batch, p.lse_batch_stride}, h{p.heads_q, p.lse_head_stride},
      r{rows_of(p, true), p.lse_row_stride}, one{1, 1};
  if (!p.lse) return;
  if (p.dtype == DType::kFloat64)
    fill<double>(p.lse, b, h, r, one, -std::numeric_limits<double>::infinity());
  else
    fill<float>(p.lse, b, h, r, one, -std::numeric_limits<float>::infinity());
}

// No (query row, key row) pair: every gradient is zero -- dq where there are query rows,
// dk and dv where there are key rows, and dbias (which may be non-empty even so: a bias
// broadcast over an empty dimension).
void backward_without_pairs(const BwdParams& p) {
  if (has_rows(p, true))
    zero_rows(p, p.dq, p.dtype, true, p.heads_q, p.head_dim, p.dq_batch_stride,
              p.dq_row_stride, p.dq_head_stride);
  if (has_rows(p, false)) {
    zero_rows(p, p.dk, p.dtype, false, p.heads_kv, p.head_dim, p.dk_batch_stride,
              p.dk_row_stride, p.dk_head_stride);
    zero_rows(p, p.dv, p.dtype, false, p.heads_kv, p.head_dim_v, p.dv_batch_stride,
              p.dv_row_stride, p.dv_head_stride);
  }
  if (p.dbias) {  // contiguous, float32 (float64 for float64 inputs)
    const int64_t n = int64_t(p.dbias_batch) * p.dbias_heads * p.dbias_rows * p.dbias_cols;
    const DType t = p.dtype == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
    fill_zero(p.dbias, t, {1, 0}, {1, 0}, {1, 0}, {n, 1});
  }
}

}  // namespace

void cpu_forward(const FwdParams& p) {
  check_params(p, Backend::kCpu);
  if (p.cache_seqlens) {  // every check before the first write into the cache
    check_kvcache_host(p);
    append_kv(p);
  }
  if (!has_rows(p, true)) return;  // no query row: nothing to write
  if (!has_rows(p, false)) return forward_without_keys(p);
  const int64_t b = p.cu_seqlens_q ? 1 : p.batch;
  hint_huge_pages(p.o, b, rows_of(p, true), p.heads_q, p.head_dim_v, p.o_batch_stride,
                  p.o_row_stride, p.o_head_stride, out_dtype(p));
  if (p.dtype == DType::kFloat8E4M3)
    return cpu_forward_fp8(p, active_kernels().forward, active_kernels().decode_kv_codes);
  active_kernels().forward(p);
}

// Every (query, key) pair costs 2·(d + dv) flops at ~50 GFLOP/s per thread (small tiles are
// far from peak), and each K/V byte ~0.1 ns (decode reads far more than it computes).
// Causal and window masks, and varlen sequences shorter than the longest, are ignored: the
// estimate errs towards more helpers.
int64_t cpu_work_estimate_ns(const FwdParams& p, double passes) {
  const double rows = p.cu_seqlens_q ? double(p.total_q) : double(p.batch) * p.seqlen_q;
  const double keys = p.cu_seqlens_q ? double(p.total_k) : double(p.batch) * p.seqlen_k;
  const double pairs = rows * p.heads_q * p.seqlen_k;  // varlen: seqlen_k is the longest
  const double flops = 2.0 * pairs * (p.head_dim + p.head_dim_v);
  const double bytes = keys * p.heads_kv * (p.head_dim + p.head_dim_v) * element_size(p.dtype);
  const double ns = passes * (flops / 50.0 + bytes / 10.0);
  return ns >= 9e18 ? kUnknownWork : int64_t(ns);
}

double cpu_fma_peak_gflops(int threads) { return active_kernels().fma_peak_gflops(threads); }

double cpu_bf16_dot_peak_gflops(int threads) {
  return active_kernels().bf16_dot_peak_gflops(threads);
}

double cpu_read_bandwidth_gbs(int threads, int64_t bytes) {
  FMHA_CHECK_ARG(threads >= 1 && bytes >= 1, "threads, bytes: expected >= 1, got ", threads,
                 " and ", bytes);
  return active_kernels().read_bandwidth_gbs(threads, bytes);
}

void cpu_exp(const float* x, float* y, int64_t n, bool lean) {
  active_kernels().exp_array(x, y, n, lean);
}
void cpu_decode_kv_codes(int code, const uint8_t* x, float* y, int64_t n) {
  active_kernels().decode_kv_codes(code, x, y, n);
}

void cpu_backward(const BwdParams& p) {
  check_params(p, Backend::kCpu);
  if (!has_rows(p, true) || !has_rows(p, false)) return backward_without_pairs(p);
  const int64_t b = p.cu_seqlens_q ? 1 : p.batch, sq = rows_of(p, true), sk = rows_of(p, false);
  hint_huge_pages(p.dq, b, sq, p.heads_q, p.head_dim, p.dq_batch_stride, p.dq_row_stride,
                  p.dq_head_stride, p.dtype);
  hint_huge_pages(p.dk, b, sk, p.heads_kv, p.head_dim, p.dk_batch_stride, p.dk_row_stride,
                  p.dk_head_stride, p.dtype);
  hint_huge_pages(p.dv, b, sk, p.heads_kv, p.head_dim_v, p.dv_batch_stride, p.dv_row_stride,
                  p.dv_head_stride, p.dtype);
  active_kernels().backward(p);
}

}  // namespace fmha
