// fmha._C: arrays in through DLPack, a params struct out to the core, nothing else.
//
// Any object with __dlpack__ (torch, NumPy, CuPy, JAX) is accepted; nothing here links or
// knows torch. The Python layer (python/fmha/_api.py) owns validation and conventions and
// allocates the outputs; bindings/params_from_dlpack.h (shared with fmha._cuda_emu) fills the
// params and re-checks what a wrong call could turn into an out-of-bounds access. Host arrays
// run the CPU kernels, CUDA arrays the CUDA kernels on the caller's stream; the GIL is
// released while either runs.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <atomic>
#include <chrono>
#include <stdexcept>
#include <vector>
#include <string>
#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include "bindings/capabilities.h"
#include "bindings/dlpack_view.h"
#include "bindings/params_from_dlpack.h"
#include "dlpack/dlpack.h"
#include "fmha/api.h"
#include "fmha/error.h"
#include "fmha/philox.h"
#include "fmha/threads.h"

namespace py = pybind11;

namespace fmha {
namespace {

// The CUDA kernels' dtypes (capability table): say so here, in the user's words, rather than
// as a launcher's complaint.
void expect_cuda_dtype(const FwdParams& p, const bind::Device& dev) {
  if (takes_input_dtype(Backend::kCuda, p.dtype)) return;
  throw Unsupported(concat("q: dtype ", dtype_name(p.dtype), " on ", bind::device_name(dev),
                           ": CUDA kernels take ", dtype_list(caps(Backend::kCuda)),
                           "; cast, or use the CPU"));
}

// Host arrays run the CPU kernels, CUDA arrays the CUDA kernels on the call's stream; the
// GIL is released while either runs.
template <typename Call, typename Cpu, typename Cuda>
void run(const Call& c, Cpu&& cpu, Cuda&& cuda) {
  if (c.dev.mem == bind::Memory::kHost) {
    py::gil_scoped_release nogil;
    cpu(c.p);
    return;
  }
  expect_cuda_dtype(c.p, c.dev);
  py::gil_scoped_release nogil;
  cuda(c.p, c.dev.id, reinterpret_cast<void*>(c.stream));
}

void forward(py::object q, py::object k, py::object v, py::object out, py::object lse,
             py::object bias, py::object mask, py::object alibi, py::object cu_q,
             py::object cu_k, py::object block_index, py::object block_masks,
             py::object q_descale, py::object k_descale, py::object v_descale, py::kwargs kw) {
  auto c = bind::forward_call(q, k, v, out, lse, bias, mask, alibi, cu_q, cu_k, kw,
                              /*host_only=*/false);
  bind::fill_block_mask(c, block_index, block_masks);
  bind::fill_descales(c, q_descale, k_descale, v_descale);
  run(c, cpu_forward, cuda_forward);
}

void backward(py::object dout, py::object q, py::object k, py::object v, py::object out,
              py::object lse, py::object dq, py::object dk, py::object dv, py::object dbias,
              py::object bias, py::object mask, py::object alibi, py::object cu_q,
              py::object cu_k, py::object dlse, py::object block_index, py::object block_masks,
              py::kwargs kw) {
  auto c = bind::backward_call(dout, q, k, v, out, lse, dq, dk, dv, dbias, bias, mask, alibi,
                               cu_q, cu_k, dlse, kw, /*host_only=*/false);
  bind::fill_block_mask(c, block_index, block_masks);
  run(c, cpu_backward, cuda_backward);
}

void forward_kvcache(py::object q, py::object k_cache, py::object v_cache, py::object out,
                     py::object lse, py::object k, py::object v, py::object cache_seqlens,
                     py::object block_table, py::object alibi, py::object k_scale,
                     py::object v_scale, py::kwargs kw) {
  run(bind::kvcache_call(q, k_cache, v_cache, out, lse, k, v, cache_seqlens, block_table,
                         alibi, k_scale, v_scale, kw),
      cpu_forward, cuda_forward);
}


#if FMHA_TESTING_PROBES
// The test probes: pieces of the core exposed so that tests can hold them to their
// definitions (the thread pool's sizing rule, Philox against the published vectors, the
// kernels' exp and 8-bit code widening). Built only with FMHA_BUILD_TESTING=ON; a user's
// fmha._C has none of them.
void def_testing_probes(py::module_& m) {
  m.def("pool_helpers_for", &pool_helpers_for, py::arg("n_tasks"), py::arg("n_threads"),
        py::arg("work_ns"),
        "How many helper threads the CPU thread pool wakes for a region of n_tasks tasks and "
        "work_ns nanoseconds of estimated single-thread work (for tests and benchmarks).");
  m.def("pool_task_runs", [](int64_t n_tasks, int n_threads, int64_t throw_at, int64_t task_ns) {
          // How often each task of one region ran (each must run exactly once, or, after a
          // task threw, at most once), on whichever runtime parallel_for uses now.
          std::vector<std::atomic<int>> runs(size_t(std::max<int64_t>(n_tasks, 0)));
          parallel_for(n_tasks, n_threads, [&](int64_t t) {
            const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(task_ns);
            while (std::chrono::steady_clock::now() < until) {
            }
            runs[size_t(t)].fetch_add(1);
            if (t == throw_at) throw std::runtime_error("task " + std::to_string(t) + " threw");
          });
          std::vector<int> out;
          for (auto& r : runs) out.push_back(r.load());
          return out;
        }, py::arg("n_tasks"), py::arg("n_threads"), py::arg("throw_at") = -1,
        py::arg("task_ns") = 0, py::call_guard<py::gil_scoped_release>(),
        "Runs a region of n_tasks tasks (each busy for task_ns; task throw_at throws) on "
        "n_threads threads and returns how often each task ran.");
  m.def("philox4x32_10", [](std::array<uint32_t, 4> c, std::array<uint32_t, 2> k) {
    const Philox4 r = philox4x32_10(c[0], c[1], c[2], c[3], k[0], k[1]);
    return std::array<uint32_t, 4>{r.x[0], r.x[1], r.x[2], r.x[3]};
  }, py::arg("counter"), py::arg("key"));
  m.def("dropout_threshold", &dropout_threshold, py::arg("p"));
  m.def("cpu_exp", [](py::object x, py::object y, bool lean) {
    View vx = import("x", x, false), vy = import("y", y, true);
    FMHA_CHECK_ARG(vx.ndim == 1 && vy.ndim == 1 && vx.size(0) == vy.size(0) &&
                       vx.stride(0) == 1 && vy.stride(0) == 1 && vx.dtype.code == kDLFloat &&
                       vx.dtype.bits == 32 && vy.dtype.code == kDLFloat && vy.dtype.bits == 32 &&
                       vx.device.device_type == kDLCPU && vy.device.device_type == kDLCPU,
                   "x, y: expected contiguous 1-D float32 host arrays of one length");
    cpu_exp(static_cast<const float*>(vx.data), static_cast<float*>(vy.data), vx.size(0), lean);
  }, py::arg("x"), py::arg("y"), py::arg("lean") = false,
        "y = exp(x) as the CPU kernels' softmax computes it (lean: for 16-bit inputs, x <= 0)");
  m.def("cpu_decode_kv_codes", [](int code, py::object x, py::object y) {
    View vx = import("x", x, false), vy = import("y", y, true);
    FMHA_CHECK_ARG(code >= 1 && code <= 3, "code: expected 1 (int8), 2 (float8_e4m3fn) or 3 "
                   "(float8_e5m2), got ", code);
    FMHA_CHECK_ARG(vx.ndim == 1 && vy.ndim == 1 && vx.size(0) == vy.size(0) &&
                       vx.stride(0) == 1 && vy.stride(0) == 1 && vx.dtype.bits == 8 &&
                       vy.dtype.code == kDLFloat && vy.dtype.bits == 32 &&
                       vx.device.device_type == kDLCPU && vy.device.device_type == kDLCPU,
                   "x, y: expected contiguous 1-D host arrays of one length, bytes and float32");
    cpu_decode_kv_codes(code, static_cast<const uint8_t*>(vx.data), static_cast<float*>(vy.data),
                        vx.size(0));
  }, py::arg("code"), py::arg("x"), py::arg("y"),
        "y = the values of the 8-bit cache codes x, as the CPU kernels decode them");
  m.def("amx_run_tiles", [](py::object program, py::object mem, bool hardware, uint32_t mxcsr) {
    View vp = import("program", program, false), vm = import("mem", mem, true);
    FMHA_CHECK_ARG(vp.ndim == 2 && vp.size(1) == 6 &&
                       (vp.size(0) == 0 || (vp.stride(1) == 1 && vp.stride(0) == 6)) &&
                       vp.dtype.code == kDLInt && vp.dtype.bits == 64 &&
                       vp.device.device_type == kDLCPU,
                   "program: expected a contiguous (n, 6) int64 host array");
    FMHA_CHECK_ARG(vm.ndim == 1 && vm.stride(0) == 1 && vm.dtype.bits == 8 &&
                       vm.device.device_type == kDLCPU,
                   "mem: expected a contiguous 1-D byte host array");
#if defined(__x86_64__)
    // The caller's MXCSR for this run (0: leave it), restored afterwards: TDPBF16PS does not
    // consult it, and the model must not either.
    const unsigned saved = _mm_getcsr();
    if (mxcsr) _mm_setcsr(mxcsr);
    try {
      cpu_amx_run_tiles(static_cast<const int64_t*>(vp.data), vp.size(0),
                        static_cast<uint8_t*>(vm.data), vm.size(0), hardware);
    } catch (...) {
      _mm_setcsr(saved);
      throw;
    }
    _mm_setcsr(saved);
#else
    FMHA_CHECK_ARG(mxcsr == 0, "mxcsr: only on x86-64");
    cpu_amx_run_tiles(static_cast<const int64_t*>(vp.data), vp.size(0),
                      static_cast<uint8_t*>(vm.data), vm.size(0), hardware);
#endif
  }, py::arg("program"), py::arg("mem"), py::arg("hardware") = false, py::arg("mxcsr") = 0,
        "Runs a tile program (csrc/cpu/amx.h: rows of {op, t0, t1, t2, offset, stride}) over "
        "the bytes of mem, through the AMX model or (hardware) the AMX instructions; mxcsr: "
        "the MXCSR to run it under (0: unchanged)");
  m.def("amx_plant_fault", &cpu_amx_plant_fault, py::arg("fault"),
        "Plants a fault for the tests that show the AMX level's suite fails on it (0: none; 1: "
        "the model's TDPBF16PS drops the odd element of A's pairs; 2: the AMX forward swaps the "
        "halves of P's pair words): csrc/cpu/amx_model.h");
  m.def("amx_decide", [](uint32_t cpuid7_edx, uint64_t xcr0, bool deny, int request_errno) {
    static thread_local int answer = 0, asked = 0;
    answer = request_errno;
    asked = 0;
    const AmxStatus s = decide_amx(cpuid7_edx, xcr0, deny, [] { ++asked; return answer; });
    py::dict d;
    d["bf16"] = s.bf16;
    d["tile"] = s.tile;
    d["os_enabled"] = s.os_enabled;
    d["permitted"] = s.permitted;
    d["note"] = s.note;
    d["asked"] = asked;
    return d;
  }, py::arg("cpuid7_edx"), py::arg("xcr0"), py::arg("deny"), py::arg("request_errno"),
        "fmha's AMX decision from given CPUID leaf 7 EDX, XCR0, FMHA_AMX_DENY and the errno "
        "the permission request returns (0: granted); 'asked': how often it was requested");
}
#endif

}  // namespace
}  // namespace fmha

PYBIND11_MODULE(_C, m) {
  using namespace fmha;
  m.doc() = "fmha core: fused multi-head attention kernels (use the fmha package, not this)";
  bind::register_errors();
  bind::register_capabilities(m);
  bind::def_forward_backward(
      m, &forward, &backward,
      "Writes out and lse, on the arrays' device (host: CPU kernels; CUDA: CUDA kernels); a "
      "host call may pass lse=None (not kept). float8_e4m3fn q, k, v (forward only): out "
      "bfloat16 or float16, q_descale, k_descale, v_descale float32 (batch, heads_kv) "
      "factors or None (1). "
      "Keyword settings: scale, softcap, window_left, window_right, bottom_right, dropout_p "
      "(required); seed, offset, num_threads, num_splits, stream (a cudaStream_t as an int, "
      "0 = the legacy default stream), max_seqlen_q, max_seqlen_k (varlen; required with "
      "device cu_seqlens); q_position, k_position, head_position, heads_total (a block of "
      "a larger attention, params.h).",
      "Writes dq, dk, dv (and dbias). dlse: the gradient reaching lse (lse's layout), or "
      "None. Keyword settings as forward, plus deterministic (CUDA: bitwise-reproducible dQ; "
      "the CPU backward always is).");
  bind::def_forward_kvcache(
      m, &forward_kvcache,
      "Appends k, v (if given) to the caches in place at cache_seqlens, then writes out and "
      "lse of q over each sequence's cache_seqlens + seqlen_new cached rows (bottom-right "
      "aligned). Keyword settings: scale, softcap, window_left, window_right (required); "
      "num_threads, num_splits, stream.");
  m.def("cpu_features", &cpu_features, "CPU features relevant to the kernels");
  m.def("cpu_description", &cpu_description,
        "The host for a result file: vendor, family/model (microarchitecture), model name, "
        "MHz, SIMD flags");
  m.def("cpu_isa", [] { return std::string(isa_name(active_cpu_isa())); },
        "The instruction set the CPU kernels use");
  m.def("best_cpu_isa", [] { return std::string(isa_name(best_cpu_isa())); });
  m.def("set_cpu_isa", [](const std::string& name) { set_cpu_isa(parse_cpu_isa(name, "isa")); },
        py::arg("isa"), "Forces the CPU kernels' instruction set (scalar, avx2, avx512, "
        "avx512bf16, amx); NotImplementedError when this CPU or this build lacks it.");
  m.def("hardware_threads", &hardware_threads);
  m.def("use_openmp_runtime", &use_openmp_runtime, py::arg("path"),
        "Runs the CPU kernels' parallel regions on the OpenMP runtime the process loaded from "
        "`path` (torch's libgomp); \"\" returns to fmha's own pool. False if none is loaded.");
  m.def("using_openmp_runtime", &using_openmp_runtime);
  m.def("cpu_fma_peak_gflops", &cpu_fma_peak_gflops, py::arg("threads"),
        py::call_guard<py::gil_scoped_release>());
  m.def("cpu_bf16_dot_peak_gflops", &cpu_bf16_dot_peak_gflops, py::arg("threads"),
        py::call_guard<py::gil_scoped_release>(),
        "GFLOP/s of vdpbf16ps chains on `threads` threads (0 below the avx512bf16 level)");
  m.def("cpu_amx_peak_gflops", &cpu_amx_peak_gflops, py::arg("threads"),
        py::call_guard<py::gil_scoped_release>(),
        "GFLOP/s of AMX TDPBF16PS chains on `threads` threads (0 where AMX is not usable: "
        "no AMX, the OS or the kernel refused it, or a build without the AMX instructions)");
  m.def("amx_hardware_built", &amx_hardware_built,
        "Whether this build has the AMX instructions (-mamx-tile -mamx-bf16)");
  m.def("amx_note", [] { return amx_status().note; },
        "Why AMX is not usable here (\"\" when it is)");
  m.def("cpu_read_bandwidth_gbs", &cpu_read_bandwidth_gbs, py::arg("threads"),
        py::arg("bytes") = int64_t(512) << 20, py::call_guard<py::gil_scoped_release>(),
        "Read bandwidth (GB/s) of `threads` threads summing a `bytes` buffer, best of five");
  m.def("library_version", [] { return std::string(library_version()); },
        "The version of the libfmha this module loaded (the package's, when installed whole)");
  m.def("cuda_built", &cuda_built);
#if FMHA_TESTING_PROBES
  def_testing_probes(m);
  m.attr("testing_build") = true;
#else
  m.attr("testing_build") = false;
#endif
  m.def("cuda_device_count", &cuda_device_count);
  m.def("cuda_status", &cuda_status);
  m.def("cuda_capability", &cuda_capability, py::arg("device"),
        "(major, minor) compute capability of CUDA device `device`; NotImplementedError when "
        "there is no such device or no CUDA in this build.");
  m.def("cuda_kvcache_refusals", &cuda_kvcache_refusals, py::arg("device"),
        py::arg("clear") = true, py::call_guard<py::gil_scoped_release>(),
        "Bits of the KV-cache calls on CUDA device `device` refused since the last clear (1: a "
        "cache_seqlens entry < 0, 2: cache_seqlens + new rows over the capacity, 4: a "
        "block_table entry out of range, 8: a block appended to through one table entry and "
        "read or written through another); synchronises with the device.");
}
