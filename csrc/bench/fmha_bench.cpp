// fmha-bench: times the kernels directly (no Python). CPU mode reports GFLOP/s and the
// fraction of the machine's FMA peak, which it measures first with the same ISA and thread
// count; --cuda times the CUDA kernels on device buffers (fmha_bench_cuda.cu) in TFLOP/s.
//
//   fmha-bench                         the standard CPU suite, forward and forward+backward,
//                                      float32 and bfloat16
//   fmha-bench --case 1,8,2048,64 --causal --dtype bf16 --pass fwd --threads 2
//   fmha-bench --cuda                  the CUDA suite (batch 4, 16 heads, seqlen 4096/8192,
//                                      head_dim 64/128, causal or not), f16 and bf16,
//                                      fwd, bwd and fwd+bwd
//   fmha-bench --cuda --case 4,16,8192,128 --causal --dtype bf16 --pass fwd --reps 50
//   fmha-bench --latency               per-call time of cpu_forward on the small shapes of
//                                      `python -m fmha.bench --latency` (the C++ floor under
//                                      the bindings), 1 thread and --threads
//   fmha-bench --decode                decode over full KV caches (contiguous, and paged with
//                                      block_size 16 and 256 in a shuffled block order): GB/s
//                                      of K+V read once and the fraction of the read bandwidth
//                                      it measures first (same threads, same byte count); then
//                                      8-bit caches (int8, float8 e4m3 / e5m2, dynamic scales)
//                                      under bfloat16 queries, with their tokens/s over the
//                                      bfloat16 cache's
//
// FLOPs: forward 4·b·h·sq·sk·d (halved for causal); backward 2.5× that; fwd+bwd 3.5×.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <new>
#include <random>
#include <string>
#include <vector>

#include "bench/bench_case.h"
#include "fmha/api.h"
#include "fmha/numeric.h"
#include "fmha/threads.h"

namespace {

using fmha_bench::Case;

const Case kSuite[] = {
    {1, 8, 8, 2048, 2048, 64, false},  {1, 8, 8, 2048, 2048, 64, true},
    {1, 8, 8, 4096, 4096, 128, false}, {4, 16, 16, 512, 512, 64, false},
    {1, 8, 8, 16384, 16384, 64, true}, {8, 32, 8, 1, 4096, 128, false},
};

// The GPU grid of the issue: batch 4, 16 heads, seqlen 4096 and 8192, head_dim 64 and 128,
// causal and not (python -m fmha.bench --cuda runs the same grid against torch SDPA).
const Case kCudaSuite[] = {
    {4, 16, 16, 4096, 4096, 64, false},  {4, 16, 16, 4096, 4096, 64, true},
    {4, 16, 16, 4096, 4096, 128, false}, {4, 16, 16, 4096, 4096, 128, true},
    {4, 16, 16, 8192, 8192, 64, false},  {4, 16, 16, 8192, 8192, 64, true},
    {4, 16, 16, 8192, 8192, 128, false}, {4, 16, 16, 8192, 8192, 128, true},
};

// 64-byte aligned storage, as torch and NumPy allocate it. std::vector's large buffers are
// 16-byte aligned, which splits vector loads of every row across cache lines: the float32
// forward ran 1.29x slower that way (docs/cpu_kernels.md, "Hosts and how to measure").
template <typename T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <typename U>
  Aligned64(const Aligned64<U>&) {}
  T* allocate(size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64)));
  }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const Aligned64<U>&) const { return true; }
  template <typename U>
  bool operator!=(const Aligned64<U>&) const { return false; }
};
template <typename T>
using AlignedVector = std::vector<T, Aligned64<T>>;

// Owns the bytes of one (batch, seqlen, heads, dim) tensor in the benchmark's dtype.
struct Tensor {
  AlignedVector<uint16_t> h16;
  AlignedVector<float> f32;
  void* data() { return f32.empty() ? static_cast<void*>(h16.data()) : f32.data(); }
};

Tensor random_tensor(size_t n, fmha::DType dt, std::mt19937& gen) {
  std::normal_distribution<float> nd;
  Tensor t;
  if (dt == fmha::DType::kFloat32) {
    t.f32.resize(n);
    for (auto& x : t.f32) x = nd(gen);
  } else {
    t.h16.resize(n);
    for (auto& x : t.h16) x = fmha::float_to_bf16(nd(gen));
  }
  return t;
}

double seconds_of(const std::function<void()>& fn, int min_reps = 3, double min_secs = 1.0) {
  fn();  // warm-up
  std::vector<double> times;
  const auto start = std::chrono::steady_clock::now();
  while (int(times.size()) < min_reps ||
         (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() <
              min_secs &&
          times.size() < 20)) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// peak: the fp32 FMA peak, or for bfloat16 on the avx512bf16 level the vdpbf16ps peak (its
// GEMMs run on that instruction).
void run_case(const Case& c, fmha::DType dt, bool bwd, int threads, double peak,
              const char* peak_name) {
  std::mt19937 gen(0);
  const size_t nq = size_t(c.b) * c.sq * c.hq * c.d, nk = size_t(c.b) * c.sk * c.hkv * c.d;
  Tensor q = random_tensor(nq, dt, gen), k = random_tensor(nk, dt, gen),
         v = random_tensor(nk, dt, gen), o = random_tensor(nq, dt, gen),
         g = random_tensor(nq, dt, gen), dq = random_tensor(nq, dt, gen),
         dk = random_tensor(nk, dt, gen), dv = random_tensor(nk, dt, gen);
  std::vector<float> lse(size_t(c.b) * c.hq * c.sq);
  fmha::BwdParams p;
  fmha_bench::set_shape(p, c, dt);
  p.q = q.data(); p.k = k.data(); p.v = v.data(); p.o = o.data(); p.lse = lse.data();
  p.dout = g.data(); p.dq = dq.data(); p.dk = dk.data(); p.dv = dv.data();
  p.num_threads = threads;

  double flops = fmha_bench::forward_flops(c);
  double secs;
  if (bwd) {
    flops *= 3.5;
    secs = seconds_of([&] { fmha::cpu_forward(p); fmha::cpu_backward(p); });
  } else {
    secs = seconds_of([&] { fmha::cpu_forward(p); });
  }
  const double gf = flops / secs / 1e9;
  std::printf("%-5s %-8s b=%d hq=%d hkv=%d sq=%-5d sk=%-5d d=%-3d %-6s %9.3f ms %8.1f GFLOP/s "
              "%5.1f%% of the %s peak\n",
              dt == fmha::DType::kFloat32 ? "f32" : "bf16", bwd ? "fwd+bwd" : "fwd", c.b, c.hq,
              c.hkv, c.sq, c.sk, c.d, c.causal ? "causal" : "", secs * 1e3, gf,
              100.0 * gf / peak, peak_name);
  std::fflush(stdout);
}

// Random q, k, v and room for out and lse of a forward-only case.
struct ForwardBuffers {
  Tensor q, k, v, o;
  std::vector<float> lse;
  ForwardBuffers(const Case& c, fmha::DType dt) {
    std::mt19937 gen(0);
    const size_t nq = size_t(c.b) * c.sq * c.hq * c.d, nk = size_t(c.b) * c.sk * c.hkv * c.d;
    q = random_tensor(nq, dt, gen);
    k = random_tensor(nk, dt, gen);
    v = random_tensor(nk, dt, gen);
    o = random_tensor(nq, dt, gen);
    lse.resize(size_t(c.b) * c.hq * c.sq);
  }
  fmha::BwdParams params(const Case& c, fmha::DType dt, int threads) {
    fmha::BwdParams p;
    fmha_bench::set_shape(p, c, dt);
    p.q = q.data(); p.k = k.data(); p.v = v.data(); p.o = o.data(); p.lse = lse.data();
    p.num_threads = threads;
    return p;
  }
};

// The small shapes of python/fmha/bench/latency.py (LATENCY_SHAPES): decode against 16, 256
// and 4096 keys, a 16-token call, a ViT-B/16 batch and a 128-token batch.
const Case kLatencySuite[] = {
    {1, 8, 8, 1, 16, 64, false},   {1, 8, 8, 1, 256, 64, false},  {1, 8, 8, 1, 4096, 64, false},
    {1, 8, 8, 16, 16, 64, false},  {8, 12, 12, 197, 197, 64, false},
    {32, 12, 12, 128, 128, 64, false},
};

// Median per-call time of cpu_forward over batches of back-to-back calls (what a layer loop
// sees: the pool's helpers spin between calls).
void run_latency(const Case& c, fmha::DType dt, int threads) {
  ForwardBuffers buf(c, dt);
  fmha::BwdParams p = buf.params(c, dt, threads);
  const double one = seconds_of([&] { fmha::cpu_forward(p); }, 3, 0.05);
  const int per_batch = std::max(1, int(0.02 / one));
  std::vector<double> us;
  for (int batch = 0; batch < 7; ++batch) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < per_batch; ++i) fmha::cpu_forward(p);
    us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0)
                     .count() / per_batch);
  }
  std::sort(us.begin(), us.end());
  std::printf("%-5s b=%-2d hq=%-2d sq=%-3d sk=%-4d d=%-3d threads %d: %10.2f us per call "
              "(helpers used: %d)\n",
              dt == fmha::DType::kFloat32 ? "f32" : "bf16", c.b, c.hq, c.sq, c.sk, c.d, threads,
              us[us.size() / 2],
              fmha::pool_helpers_for(1 << 30, threads, fmha::cpu_work_estimate_ns(p)));
  std::fflush(stdout);
}

// The decode shapes of python/fmha/bench/decode.py (DECODE_CASES): b, hq, hkv, sk, d.
const Case kDecodeSuite[] = {
    {8, 32, 8, 1, 4096, 128, true},  {1, 32, 8, 1, 32768, 128, true},
    {32, 32, 8, 1, 1024, 128, true}, {1, 8, 1, 1, 65536, 128, true},
};

// cpu_forward over full caches of c.sk rows per sequence (no rows appended), contiguous
// (block_size 0) or paged: the same rows in a pool whose blocks are handed out shuffled.
// With `code`, the caches hold 8-bit codes of that encoding (finite ones, drawn at random)
// with dynamic scales, one float32 per (row, kv head) for K and for V, counted in the bytes
// read; queries in dt. `base_ms` (the 16-bit cache's contiguous time of the same case, when
// known) gives the 8-bit rows their tokens/s ratio. Returns the contiguous time in ms.
double run_decode(const Case& c, fmha::DType dt, int threads,
                  fmha::KvCode code = fmha::KvCode::kNone, double base_ms = 0) {
  ForwardBuffers buf(c, dt);
  std::mt19937 gen(1);
  std::vector<int32_t> lens(size_t(c.b), c.sk);
  const bool quant = code != fmha::KvCode::kNone;
  const size_t rows = size_t(c.b) * c.sk * c.hkv;
  AlignedVector<uint8_t> k8, v8;
  std::vector<float> k_scale, v_scale;
  if (quant) {  // codes with finite values: int8 -127..127, float8 without NaN / Inf codes
    const uint8_t top = code == fmha::KvCode::kInt8 ? 0x7F : code == fmha::KvCode::kE4M3 ? 0x7E : 0x7B;
    std::uniform_int_distribution<int> mag(0, top), sign(0, 1);
    for (auto* x : {&k8, &v8}) {
      x->resize(rows * c.d);
      for (auto& e : *x) e = uint8_t(mag(gen) | (sign(gen) ? 0x80 : 0));
    }
    std::uniform_real_distribution<float> sc(0.001f, 0.01f);
    for (auto* x : {&k_scale, &v_scale}) {
      x->resize(rows);
      for (auto& e : *x) e = sc(gen);
    }
  }
  const double bytes = quant ? 2.0 * double(rows) * (c.d + 4)
                             : 2.0 * double(rows * c.d) * (dt == fmha::DType::kFloat32 ? 4 : 2);
  const double bandwidth = fmha::cpu_read_bandwidth_gbs(threads, int64_t(bytes));
  double contiguous_ms = 0;
  for (int bs : {0, 16, 256}) {
    fmha::BwdParams p = buf.params(c, dt, threads);
    p.cache_seqlens = lens.data();
    if (quant) {  // the same strides in bytes as the 16-bit caches' in elements
      p.k = k8.data();
      p.v = v8.data();
      p.kv_code = code;
      p.k_scale = k_scale.data();
      p.v_scale = v_scale.data();
      p.scale_head_stride = 1;
      p.scale_row_stride = c.hkv;
      p.scale_batch_stride = int64_t(bs ? bs : c.sk) * c.hkv;
    }
    std::vector<int32_t> table;
    if (bs > 0) {  // the pool is the same buffer: blocks of bs rows, handed out shuffled
      const int blocks = c.sk / bs;
      table.resize(size_t(c.b) * blocks);
      for (size_t i = 0; i < table.size(); ++i) table[i] = int32_t(i);
      std::shuffle(table.begin(), table.end(), gen);
      p.block_table = table.data();
      p.block_table_stride = blocks;
      p.block_size = bs;
      p.num_blocks = int(table.size());
      p.k_batch_stride = p.v_batch_stride = int64_t(bs) * c.hkv * c.d;
    }
    const double secs = seconds_of([&] { fmha::cpu_forward(p); }, 3, 0.5);
    if (bs == 0) contiguous_ms = secs * 1e3;
    const double gbs = bytes / secs / 1e9;
    const char* cache = code == fmha::KvCode::kInt8   ? "int8"
                        : code == fmha::KvCode::kE4M3 ? "fp8e4m3"
                        : code == fmha::KvCode::kE5M2 ? "fp8e5m2"
                                                      : "";
    std::printf("%-5s decode b=%-2d hq=%-2d hkv=%d sk=%-5d d=%-3d %-7s %-10s %8.3f ms %6.1f GB/s "
                "%5.1f%% of %.1f GB/s read",
                dt == fmha::DType::kFloat32 ? "f32" : "bf16", c.b, c.hq, c.hkv, c.sk, c.d, cache,
                bs ? ("paged" + std::to_string(bs)).c_str() : "contiguous", secs * 1e3, gbs,
                100.0 * gbs / bandwidth, bandwidth);
    if (quant && bs == 0 && base_ms > 0)
      std::printf("  %.2fx the 16-bit cache's tokens/s", base_ms / (secs * 1e3));
    std::printf("\n");
    std::fflush(stdout);
  }
  return contiguous_ms;
}

[[noreturn]] void usage() {
  std::fprintf(stderr,
               "usage: fmha-bench [--case b,hq,sq,d[,hkv,sk]] [--causal] [--dtype f32|bf16|all]\n"
               "                  [--pass fwd|fwd+bwd|all] [--threads N]\n"
               "       fmha-bench --latency [--dtype f32|bf16|all] [--threads N]\n"
               "       fmha-bench --decode [--dtype f32|bf16|all] [--threads N]\n"
               "       fmha-bench --cuda [--case b,hq,sq,d[,hkv,sk]] [--causal]\n"
               "                  [--dtype f16|bf16|all] [--pass fwd|bwd|fwd+bwd|all]\n"
               "                  [--device N] [--reps N]\n");
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<Case> cases(std::begin(kSuite), std::end(kSuite));
  std::string dtype = "all", pass = "all";
  int threads = fmha::hardware_threads();
  int device = 0, reps = 20;
  bool causal = false, custom = false, cuda = false, latency = false, decode = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string { if (i + 1 >= argc) usage(); return argv[++i]; };
    if (a == "--case") {
      int v[6] = {0, 0, 0, 0, 0, 0};
      const int n = std::sscanf(next().c_str(), "%d,%d,%d,%d,%d,%d", &v[0], &v[1], &v[2], &v[3],
                                &v[4], &v[5]);
      if (n < 4) usage();
      cases = {Case{v[0], v[1], n >= 5 ? v[4] : v[1], v[2], n >= 6 ? v[5] : v[2], v[3], false}};
      custom = true;
    } else if (a == "--causal") {
      causal = true;
    } else if (a == "--dtype") {
      dtype = next();
    } else if (a == "--pass") {
      pass = next();
    } else if (a == "--threads") {
      threads = std::atoi(next().c_str());
    } else if (a == "--cuda") {
      cuda = true;
    } else if (a == "--latency") {
      latency = true;
    } else if (a == "--decode") {
      decode = true;
    } else if (a == "--device") {
      device = std::atoi(next().c_str());
    } else if (a == "--reps") {
      reps = std::atoi(next().c_str());
      if (reps < 1) usage();
    } else {
      usage();
    }
  }
  if (cuda) {
    if (!custom) cases.assign(std::begin(kCudaSuite), std::end(kCudaSuite));
    else cases[0].causal = causal;
#ifdef FMHA_BENCH_CUDA
    return fmha_bench::run_cuda(cases, dtype, pass, device, reps);
#else
    std::fprintf(stderr, "fmha-bench --cuda: this build has no CUDA (nvcc was not found, or "
                         "FMHA_DISABLE_CUDA=1 / FMHA_ENABLE_CUDA=OFF)\n");
    return 1;
#endif
  }
  if (custom) cases[0].causal = causal;
  try {
    if (latency) {
      if (!custom) cases.assign(std::begin(kLatencySuite), std::end(kLatencySuite));
      std::printf("fmha-bench --latency | CPU ISA %s | threads 1 and %d\n",
                  fmha::isa_name(fmha::active_cpu_isa()), threads);
      for (const Case& c : cases)
        for (fmha::DType dt : {fmha::DType::kFloat32, fmha::DType::kBFloat16}) {
          if (dtype != "all" && (dtype == "f32") != (dt == fmha::DType::kFloat32)) continue;
          for (int t : {1, threads})
            if (t == 1 || threads > 1) run_latency(c, dt, t);
        }
      return 0;
    }
    if (decode) {
      if (!custom) cases.assign(std::begin(kDecodeSuite), std::end(kDecodeSuite));
      std::printf("fmha-bench --decode | CPU ISA %s | threads %d\nhost: %s\n",
                  fmha::isa_name(fmha::active_cpu_isa()), threads,
                  fmha::cpu_description().c_str());
      std::vector<double> bf16_ms;
      for (fmha::DType dt : {fmha::DType::kFloat32, fmha::DType::kBFloat16}) {
        if (dtype != "all" && (dtype == "f32") != (dt == fmha::DType::kFloat32)) continue;
        for (const Case& c : cases) {
          const double ms = run_decode(c, dt, threads);
          if (dt == fmha::DType::kBFloat16) bf16_ms.push_back(ms);
        }
      }
      // 8-bit caches under bfloat16 queries, against the bfloat16 cache of the same case.
      if (dtype != "f32")
        for (fmha::KvCode code : {fmha::KvCode::kInt8, fmha::KvCode::kE4M3, fmha::KvCode::kE5M2})
          for (size_t i = 0; i < cases.size(); ++i)
            run_decode(cases[i], fmha::DType::kBFloat16, threads, code, bf16_ms[i]);
      return 0;
    }
    const double peak = fmha::cpu_fma_peak_gflops(threads);
    const double bf16_peak = fmha::cpu_bf16_dot_peak_gflops(threads);
    std::printf("fmha-bench | CPU ISA %s | threads %d | measured FMA peak %.1f GFLOP/s (fp32)",
                fmha::isa_name(fmha::active_cpu_isa()), threads, peak);
    if (bf16_peak > 0) std::printf(" | vdpbf16ps peak %.1f GFLOP/s", bf16_peak);
    std::printf("\nhost: %s\n", fmha::cpu_description().c_str());
    for (const Case& c : cases)
      for (fmha::DType dt : {fmha::DType::kFloat32, fmha::DType::kBFloat16}) {
        if (dtype != "all" && (dtype == "f32") != (dt == fmha::DType::kFloat32)) continue;
        for (bool bwd : {false, true}) {
          if (pass != "all" && (pass == "fwd+bwd") != bwd) continue;
          const bool pairs = dt == fmha::DType::kBFloat16 && bf16_peak > 0;
          run_case(c, dt, bwd, threads, pairs ? bf16_peak : peak,
                   pairs ? "vdpbf16ps" : "fp32 FMA");
        }
      }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fmha-bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
