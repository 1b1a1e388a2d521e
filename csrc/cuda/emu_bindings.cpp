// fmha._cuda_emu: fmha's CUDA kernels compiled as host C++ and run by the SIMT emulator
// (cuda/emu/cuda_emu.h), on host arrays. For tests: the same cases that check the CPU
// backend run the CUDA kernels here, in CI, without a GPU.
//
// Arrays come in through DLPack (torch, NumPy, ...: anything with __dlpack__) and must be
// in host memory; results are returned as new NumPy arrays. This file knows the kernels only
// through their host interfaces (gemm_tc.h, probes.h).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <array>
#include <string>

#include "cuda/emu/runtime.h"
#include "cuda/gemm_tc.h"
#include "cuda/probes.h"
#include "dlpack/dlpack.h"
#include "fmha/error.h"
#include "fmha/params.h"

namespace py = pybind11;

namespace {

// A borrowed view of a DLPack tensor in host memory; `capsule` keeps the producer's memory.
struct HostArray {
  py::object capsule;
  const void* data = nullptr;
  int ndim = 0;
  std::array<int64_t, 2> shape{}, strides{};
  DLDataType dtype{};
};

HostArray import_host(const char* name, const py::handle& obj) {
  if (!py::hasattr(obj, "__dlpack__"))
    throw py::type_error(fmha::concat(name, ": expected an array with __dlpack__"));
  py::object cap;
  try {
    cap = obj.attr("__dlpack__")(py::arg("max_version") = py::make_tuple(1, 0));
  } catch (py::error_already_set& e) {
    if (!e.matches(PyExc_TypeError)) throw;
    cap = obj.attr("__dlpack__")();  // a producer from before DLPack 1.0
  }
  const DLTensor* t = nullptr;
  if (PyCapsule_IsValid(cap.ptr(), "dltensor_versioned"))
    t = &static_cast<DLManagedTensorVersioned*>(
             PyCapsule_GetPointer(cap.ptr(), "dltensor_versioned"))->dl_tensor;
  else if (PyCapsule_IsValid(cap.ptr(), "dltensor"))
    t = &static_cast<DLManagedTensor*>(PyCapsule_GetPointer(cap.ptr(), "dltensor"))->dl_tensor;
  else
    throw py::type_error(fmha::concat(name, ": __dlpack__ did not return a DLPack capsule"));
  FMHA_CHECK_ARG(t->device.device_type == kDLCPU || t->device.device_type == kDLCUDAHost,
                 name, ": the emulator runs on host memory (device type ",
                 int(t->device.device_type), ")");
  FMHA_CHECK_ARG(t->ndim >= 1 && t->ndim <= 2, name, ": expected 1 or 2 dimensions, got ",
                 t->ndim);
  HostArray a;
  a.capsule = cap;
  a.ndim = t->ndim;
  a.dtype = t->dtype;
  a.data = static_cast<const char*>(t->data) + t->byte_offset;
  int64_t compact = 1;
  for (int i = t->ndim - 1; i >= 0; --i) {
    a.shape[size_t(i)] = t->shape[i];
    a.strides[size_t(i)] = t->strides ? t->strides[i] : compact;
    compact *= t->shape[i];
  }
  return a;
}

fmha::DType half_dtype(const HostArray& a, const char* name) {
  if (a.dtype.lanes == 1 && a.dtype.bits == 16) {
    if (a.dtype.code == kDLFloat) return fmha::DType::kFloat16;
    if (a.dtype.code == kDLBfloat) return fmha::DType::kBFloat16;
  }
  throw fmha::InvalidArgument(fmha::concat(name, ": expected float16 or bfloat16 (DLPack code ",
                                           int(a.dtype.code), ", ", int(a.dtype.bits),
                                           " bits)"));
}

py::array_t<float> gemm(const py::object& a_obj, const py::object& b_obj) {
  const HostArray a = import_host("a", a_obj), b = import_host("b", b_obj);
  FMHA_CHECK_ARG(a.ndim == 2 && b.ndim == 2, "a, b: expected 2-D arrays");
  const fmha::DType dtype = half_dtype(a, "a");
  FMHA_CHECK_ARG(half_dtype(b, "b") == dtype, "b: dtype differs from a's");
  const int64_t m = a.shape[0], k = a.shape[1], n = b.shape[1];
  FMHA_CHECK_ARG(b.shape[0] == k, "b: has ", b.shape[0], " rows, expected a.shape[1] = ", k);
  FMHA_CHECK_ARG(m > 0 && n > 0 && k > 0, "a, b: empty");
  FMHA_CHECK_ARG(m < (int64_t(1) << 31) && n < (int64_t(1) << 31) && k < (int64_t(1) << 31),
                 "a, b: too large");
  FMHA_CHECK_ARG((a.strides[1] == 1 || k == 1) && (b.strides[1] == 1 || n == 1),
                 "a, b: the last dimension must be contiguous");
  FMHA_CHECK_ARG(a.strides[0] >= k && b.strides[0] >= n,
                 "a, b: rows must not overlap (row stride >= row length)");
  py::array_t<float> c({m, n});
  fmha::gpu::GemmTcParams p{a.data, b.data, c.mutable_data(), int(m), int(n), int(k),
                            a.strides[0], b.strides[0], n};
  {
    py::gil_scoped_release nogil;
    fmha::gpu::gemm_tc(p, dtype, nullptr);
  }
  return c;
}

py::array_t<uint16_t> convert(const py::array_t<float, py::array::c_style | py::array::forcecast>& x,
                              fmha::DType to) {
  py::array_t<uint16_t> out(x.request().shape);
  const float* in = x.data();
  uint16_t* o = out.mutable_data();
  const int64_t n = x.size();
  {
    py::gil_scoped_release nogil;
    fmha::gpu::probe_convert(in, o, n, to, nullptr);
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(_cuda_emu, m) {
  m.doc() =
      "fmha's CUDA kernels run on the CPU by the SIMT emulator (for tests; see "
      "csrc/cuda/emu/cuda_emu.h)";
  py::register_exception_translator([](std::exception_ptr e) {
    try {
      if (e) std::rethrow_exception(e);
    } catch (const fmha::InvalidArgument& err) {
      PyErr_SetString(PyExc_ValueError, err.what());
    }
  });
  m.def("gemm", &gemm, py::arg("a"), py::arg("b"),
        "C = A @ B by the tensor-core GEMM kernel (ldmatrix + mma.sync + cp.async), emulated. "
        "a: (M, K), b: (K, N), float16 or bfloat16, last dimension contiguous. Returns float32 "
        "(M, N).");
  m.def("float_to_half_bits",
        [](const py::array_t<float, py::array::c_style | py::array::forcecast>& x) {
          return convert(x, fmha::DType::kFloat16);
        },
        py::arg("x"), "Bits of the kernels' float->float16 conversion (cvt.rn.f16.f32) of x.");
  m.def("float_to_bfloat16_bits",
        [](const py::array_t<float, py::array::c_style | py::array::forcecast>& x) {
          return convert(x, fmha::DType::kBFloat16);
        },
        py::arg("x"), "Bits of the kernels' float->bfloat16 conversion (cvt.rn.bf16.f32) of x.");
  m.def("stats", [] {
    const emu::Stats s = emu::stats();
    py::dict d;
    d["launches"] = s.launches;
    d["blocks"] = s.blocks;
    d["threads"] = s.threads;
    d["block_barriers"] = s.block_barriers;
    d["warp_barriers"] = s.warp_barriers;
    d["mma"] = s.mma;
    d["ldmatrix"] = s.ldmatrix;
    d["shfl"] = s.shfl;
    d["ballot"] = s.ballot;
    d["cp_async"] = s.cp_async;
    d["cp_async_zero_filled"] = s.cp_async_zero_filled;
    d["max_cp_async_groups_pending"] = s.max_cp_async_groups_pending;
    return d;
  }, "Counters of emulated operations since the last reset_stats() (per thread / warp op).");
  m.def("reset_stats", &emu::reset_stats);
}
