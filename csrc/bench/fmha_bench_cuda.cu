// fmha-bench --cuda: times fmha::cuda_forward / cuda_backward (the core's entry points, no
// Python) on device buffers with CUDA events, and reports TFLOP/s.
//
// Per case and pass: two warm-up calls (module load, L2, clocks), then `reps` calls, each
// between its own pair of events on one stream; the median is reported. Inputs are
// uniform(-√3, √3) (unit variance, like randn) written on the device. After timing, the
// outputs are scanned for non-finite values, so that a kernel that returns garbage quickly
// cannot post a number.
//
// FLOPs: forward 4·b·h·sq·sk·d (halved for causal), backward 2.5× that, fwd+bwd 3.5×.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench/bench_case.h"
#include "fmha/api.h"

namespace fmha_bench {
namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

// One cudaMalloc'd buffer, freed on scope exit (so an exception in a case leaks nothing).
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) { check(cudaMalloc(&ptr_, bytes), "cudaMalloc"); }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* get() const { return ptr_; }

 private:
  void* ptr_ = nullptr;
};

// A counter hash (lowbias32) of (seed, index): the same inputs on every run and GPU.
__device__ uint32_t hash32(uint32_t x) {
  x ^= x >> 16; x *= 0x7feb352dU;
  x ^= x >> 15; x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

template <typename T>
__device__ T from_float(float x);
template <>
__device__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

template <typename T>
__global__ void fill_uniform(T* x, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    const float u = hash32(uint32_t(i) ^ hash32(seed + uint32_t(i >> 32))) * 0x1p-32f;  // [0,1)
    x[i] = from_float<T>((2.0f * u - 1.0f) * 1.7320508f);
  }
}

template <typename T>
__device__ float to_float(T x);
template <>
__device__ float to_float<__half>(__half x) { return __half2float(x); }
template <>
__device__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__global__ void count_nonfinite(const T* x, size_t n, unsigned long long* count) {
  unsigned long long mine = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x)
    mine += !isfinite(to_float(x[i]));
  if (mine) atomicAdd(count, mine);
}

template <typename T>
void fill(void* ptr, size_t n, uint32_t seed, cudaStream_t s) {
  fill_uniform<T><<<1024, 256, 0, s>>>(static_cast<T*>(ptr), n, seed);
  check(cudaGetLastError(), "fill_uniform");
}

template <typename T>
unsigned long long nonfinite(const void* ptr, size_t n, cudaStream_t s) {
  DeviceBuffer count(sizeof(unsigned long long));
  check(cudaMemsetAsync(count.get(), 0, sizeof(unsigned long long), s), "cudaMemsetAsync");
  count_nonfinite<T><<<1024, 256, 0, s>>>(static_cast<const T*>(ptr), n,
                                          static_cast<unsigned long long*>(count.get()));
  check(cudaGetLastError(), "count_nonfinite");
  unsigned long long host = 0;
  check(cudaMemcpyAsync(&host, count.get(), sizeof(host), cudaMemcpyDeviceToHost, s),
        "cudaMemcpyAsync");
  check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
  return host;
}

// Median milliseconds of fn() on stream s, each call timed by its own pair of events.
double median_ms(const std::function<void()>& fn, cudaStream_t s, int reps) {
  for (int i = 0; i < 2; ++i) fn();
  std::vector<cudaEvent_t> ev(2 * reps);
  for (auto& e : ev) check(cudaEventCreate(&e), "cudaEventCreate");
  for (int i = 0; i < reps; ++i) {
    check(cudaEventRecord(ev[2 * i], s), "cudaEventRecord");
    fn();
    check(cudaEventRecord(ev[2 * i + 1], s), "cudaEventRecord");
  }
  check(cudaEventSynchronize(ev.back()), "cudaEventSynchronize");
  std::vector<float> ms(reps);
  for (int i = 0; i < reps; ++i)
    check(cudaEventElapsedTime(&ms[i], ev[2 * i], ev[2 * i + 1]), "cudaEventElapsedTime");
  for (auto& e : ev) cudaEventDestroy(e);
  std::sort(ms.begin(), ms.end());
  return ms[reps / 2];
}

// Times the passes of one case; false when a pass failed (reported on stdout).
template <typename T>
bool run_case(const Case& c, fmha::DType dt, const std::string& pass, int device, int reps,
              cudaStream_t s) {
  const size_t nq = size_t(c.b) * c.sq * c.hq * c.d, nk = size_t(c.b) * c.sk * c.hkv * c.d;
  const size_t bytes_q = nq * sizeof(T), bytes_k = nk * sizeof(T);
  DeviceBuffer q(bytes_q), k(bytes_k), v(bytes_k), o(bytes_q), dout(bytes_q), dq(bytes_q),
      dk(bytes_k), dv(bytes_k), lse(size_t(c.b) * c.hq * c.sq * sizeof(float));
  fill<T>(q.get(), nq, 1, s);
  fill<T>(k.get(), nk, 2, s);
  fill<T>(v.get(), nk, 3, s);
  fill<T>(dout.get(), nq, 4, s);
  fmha::BwdParams p;
  set_shape(p, c, dt);
  p.q = q.get(); p.k = k.get(); p.v = v.get(); p.o = o.get(); p.lse = lse.get();
  p.dout = dout.get(); p.dq = dq.get(); p.dk = dk.get(); p.dv = dv.get();

  const double fwd_flops = forward_flops(c);
  auto forward = [&] { fmha::cuda_forward(p, device, s); };
  auto backward = [&] { fmha::cuda_backward(p, device, s); };
  struct Pass {
    const char* name;
    double flops;
    std::function<void()> fn;
    bool reads_forward;  // the backward alone reads o and lse: one forward first, untimed
  };
  const Pass passes[] = {
      {"fwd", fwd_flops, forward, false},
      {"bwd", 2.5 * fwd_flops, backward, true},
      {"fwd+bwd", 3.5 * fwd_flops, [&] { forward(); backward(); }, false},
  };
  bool ok = true;
  for (const Pass& ps : passes) {
    if (pass != "all" && pass != ps.name) continue;
    std::printf("%-5s %-8s b=%d hq=%d hkv=%d sq=%-5d sk=%-5d d=%-3d %-6s ",
                dt == fmha::DType::kFloat16 ? "f16" : "bf16", ps.name, c.b, c.hq, c.hkv, c.sq,
                c.sk, c.d, c.causal ? "causal" : "");
    try {
      if (ps.reads_forward) forward();
      const double ms = median_ms(ps.fn, s, reps);
      check(cudaStreamSynchronize(s), ps.name);
      size_t bad = nonfinite<T>(o.get(), nq, s);
      if (std::string(ps.name) != "fwd")
        bad += nonfinite<T>(dq.get(), nq, s) + nonfinite<T>(dk.get(), nk, s) +
               nonfinite<T>(dv.get(), nk, s);
      std::printf("%9.3f ms %8.1f TFLOP/s", ms, ps.flops / (ms * 1e-3) / 1e12);
      if (bad) {
        std::printf("   FAILED: %zu non-finite output values", bad);
        ok = false;
      }
      std::printf("\n");
    } catch (const std::exception& e) {
      std::printf("FAILED: %s\n", e.what());
      cudaGetLastError();  // a launch error must not poison the next case
      ok = false;
    }
    std::fflush(stdout);
  }
  return ok;
}

}  // namespace

int run_cuda(const std::vector<Case>& cases, const std::string& dtype, const std::string& pass,
             int device, int reps) {
  if (dtype != "all" && dtype != "f16" && dtype != "bf16") {
    std::fprintf(stderr, "fmha-bench --cuda: --dtype %s; expected f16, bf16 or all (the CUDA "
                         "kernels take float16 and bfloat16)\n", dtype.c_str());
    return 2;
  }
  if (pass != "all" && pass != "fwd" && pass != "bwd" && pass != "fwd+bwd") {
    std::fprintf(stderr, "fmha-bench --cuda: --pass %s; expected fwd, bwd, fwd+bwd or all\n",
                 pass.c_str());
    return 2;
  }
  if (fmha::cuda_device_count() == 0) {
    // cuda_status() says why: "no GPU (<the runtime's error>)".
    std::fprintf(stderr, "fmha-bench --cuda: %s\n", fmha::cuda_status().c_str());
    return 1;
  }
  if (device < 0 || device >= fmha::cuda_device_count()) {
    std::fprintf(stderr, "fmha-bench --cuda: --device %d; expected 0..%d (%s)\n", device,
                 fmha::cuda_device_count() - 1, fmha::cuda_status().c_str());
    return 2;
  }
  bool ok = true;
  try {
    check(cudaSetDevice(device), "cudaSetDevice");
    cudaDeviceProp prop{};
    check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
    int runtime = 0;
    cudaRuntimeGetVersion(&runtime);
    std::printf("fmha-bench --cuda | cuda:%d %s (sm_%d%d, %d SMs) | CUDA runtime %d.%d | "
                "median of %d\n", device, prop.name, prop.major, prop.minor,
                prop.multiProcessorCount, runtime / 1000, runtime % 1000 / 10, reps);
    cudaStream_t s;
    check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    for (const Case& c : cases)
      for (fmha::DType dt : {fmha::DType::kFloat16, fmha::DType::kBFloat16}) {
        if (dtype != "all" && (dtype == "f16") != (dt == fmha::DType::kFloat16)) continue;
        try {
          ok &= dt == fmha::DType::kFloat16 ? run_case<__half>(c, dt, pass, device, reps, s)
                                            : run_case<__nv_bfloat16>(c, dt, pass, device, reps, s);
        } catch (const std::exception& e) {  // e.g. out of memory for the buffers
          std::printf("FAILED: b=%d hq=%d sq=%d sk=%d d=%d: %s\n", c.b, c.hq, c.sq, c.sk, c.d,
                      e.what());
          cudaGetLastError();
          ok = false;
        }
      }
    cudaStreamDestroy(s);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fmha-bench --cuda: %s\n", e.what());
    return 1;
  }
  return ok ? 0 : 1;
}

}  // namespace fmha_bench
