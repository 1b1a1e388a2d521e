// fmha._C: arrays in through DLPack, a params struct out to the core, nothing else.
//
// Any object with __dlpack__ (torch, NumPy, CuPy, JAX) is accepted; nothing here links or
// knows torch. The Python layer (python/fmha/_api.py) owns validation and conventions and
// allocates the outputs; this file re-checks what a wrong call could turn into an
// out-of-bounds access, then releases the GIL and runs the kernel.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <cstring>
#include <optional>
#include <string>

#include "bindings/dlpack_view.h"
#include "dlpack/dlpack.h"
#include "fmha/api.h"
#include "fmha/error.h"
#include "fmha/philox.h"
#include "fmha/threads.h"

namespace py = pybind11;

namespace fmha {
namespace {

std::optional<View> import_opt(const std::string& name, const py::object& obj, bool writable) {
  if (obj.is_none()) return std::nullopt;
  return import(name, obj, writable);
}

DType float_dtype(const View& v) {
  if (v.dtype.lanes == 1) {
    if (v.dtype.code == kDLFloat && v.dtype.bits == 64) return DType::kFloat64;
    if (v.dtype.code == kDLFloat && v.dtype.bits == 32) return DType::kFloat32;
    if (v.dtype.code == kDLFloat && v.dtype.bits == 16) return DType::kFloat16;
    if (v.dtype.code == kDLBfloat && v.dtype.bits == 16) return DType::kBFloat16;
  }
  throw InvalidArgument(concat(v.name, ": expected float64, float32, bfloat16 or float16 (code ",
                               int(v.dtype.code), ", ", int(v.dtype.bits), " bits)"));
}

void expect_dtype(const View& v, DType want) {
  FMHA_CHECK_ARG(float_dtype(v) == want, v.name, ": dtype ", dtype_name(float_dtype(v)),
                 " differs from q's ", dtype_name(want));
}

void expect_shape(const View& v, std::initializer_list<int64_t> shape) {
  FMHA_CHECK_ARG(v.ndim == int(shape.size()), v.name, ": expected ", shape.size(),
                 " dimensions, got ", v.ndim);
  int i = 0;
  for (int64_t s : shape) {
    FMHA_CHECK_ARG(v.size(i) == s, v.name, ": dimension ", i, " is ", v.size(i), ", expected ",
                   s);
    ++i;
  }
  FMHA_CHECK_ARG(v.stride(v.ndim - 1) == 1 || v.size(v.ndim - 1) == 1, v.name,
                 ": the last dimension must be contiguous");
}

struct Device {
  DLDeviceType type = kDLCPU;
  int id = 0;
};

void expect_device(const View& v, const Device& dev) {
  FMHA_CHECK_ARG(v.device.device_type == dev.type && v.device.device_id == dev.id, v.name,
                 ": on device (", int(v.device.device_type), ", ", v.device.device_id,
                 "), expected q's (", int(dev.type), ", ", dev.id, ")");
}

// Everything of a call except the gradient tensors. Filled from views; the views stay alive.
struct Call {
  View q, k, v, o, lse;
  std::optional<View> bias, mask, alibi, cu_q, cu_k;
  Device dev;
};

// (batch, seqlen, heads, dim) or, varlen, (total, heads, dim): element strides.
struct Bshd {
  int64_t batch = 0, row = 0, head = 0;
};
Bshd bshd(const View& t, bool varlen) {
  if (varlen) return {0, t.stride(0), t.stride(1)};
  return {t.stride(0), t.stride(1), t.stride(2)};
}

void fill_fwd(FwdParams& p, Call& c, const py::kwargs& kw, const py::object& bias,
              const py::object& mask, const py::object& alibi, const py::object& cu_q,
              const py::object& cu_k) {
  const bool varlen = !cu_q.is_none();
  c.dev = {static_cast<DLDeviceType>(c.q.device.device_type), c.q.device.device_id};
  p.dtype = float_dtype(c.q);
  const int nd = varlen ? 3 : 4;
  FMHA_CHECK_ARG(c.q.ndim == nd, "q: expected ", nd, " dimensions, got ", c.q.ndim);
  FMHA_CHECK_ARG(c.k.ndim == nd, "k: expected ", nd, " dimensions, got ", c.k.ndim);
  const int o_ = varlen ? 0 : 1;  // index of the seqlen dimension
  p.batch = varlen ? 0 : int(c.q.size(0));  // varlen: from cu_seqlens below
  p.heads_q = int(c.q.size(o_ + 1));
  p.heads_kv = int(c.k.size(o_ + 1));
  p.head_dim = int(c.q.size(o_ + 2));
  p.head_dim_v = int(c.v.size(o_ + 2));
  FMHA_CHECK_ARG(p.heads_q > 0 && p.heads_kv > 0 && p.head_dim > 0 && p.head_dim_v > 0,
                 "q, k, v: heads and head_dim must be > 0");
  const int64_t total_q = varlen ? c.q.size(0) : 0, total_k = varlen ? c.k.size(0) : 0;
  if (varlen) {
    c.cu_q = import("cu_seqlens_q", cu_q, false);
    c.cu_k = import("cu_seqlens_k", cu_k, false);
    for (View* cu : {&*c.cu_q, &*c.cu_k}) {
      FMHA_CHECK_ARG(cu->ndim == 1 && cu->dtype.code == kDLInt && cu->dtype.bits == 32 &&
                         cu->stride(0) == 1 && cu->device.device_type == kDLCPU,
                     cu->name, ": expected a contiguous 1-D int32 array in host memory");
    }
    FMHA_CHECK_ARG(c.cu_q->size(0) == c.cu_k->size(0) && c.cu_q->size(0) >= 2,
                   "cu_seqlens_q and cu_seqlens_k must have the same length batch + 1 >= 2");
    p.batch = int(c.cu_q->size(0) - 1);
    p.cu_seqlens_q = static_cast<const int32_t*>(c.cu_q->data);
    p.cu_seqlens_k = static_cast<const int32_t*>(c.cu_k->data);
    int max_q = 0, max_k = 0;
    for (int b = 0; b < p.batch; ++b) {
      const int lq = p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b];
      const int lk = p.cu_seqlens_k[b + 1] - p.cu_seqlens_k[b];
      FMHA_CHECK_ARG(lq >= 0 && lk >= 0 && p.cu_seqlens_q[0] == 0 && p.cu_seqlens_k[0] == 0,
                     "cu_seqlens must start at 0 and be non-decreasing");
      max_q = std::max(max_q, lq);
      max_k = std::max(max_k, lk);
    }
    FMHA_CHECK_ARG(p.cu_seqlens_q[p.batch] == total_q && p.cu_seqlens_k[p.batch] == total_k,
                   "cu_seqlens must end at the packed lengths ", total_q, " and ", total_k);
    p.seqlen_q = kw.contains("max_seqlen_q") ? kw["max_seqlen_q"].cast<int>() : max_q;
    p.seqlen_k = kw.contains("max_seqlen_k") ? kw["max_seqlen_k"].cast<int>() : max_k;
    FMHA_CHECK_ARG(p.seqlen_q >= max_q && p.seqlen_k >= max_k,
                   "max_seqlen_q/k are smaller than the longest sequence (", max_q, ", ",
                   max_k, ")");
    p.seqlen_q = std::max(p.seqlen_q, 1);
    p.seqlen_k = std::max(p.seqlen_k, 1);
    expect_shape(c.q, {total_q, p.heads_q, p.head_dim});
    expect_shape(c.k, {total_k, p.heads_kv, p.head_dim});
    expect_shape(c.v, {total_k, p.heads_kv, p.head_dim_v});
    expect_shape(c.o, {total_q, p.heads_q, p.head_dim_v});
    expect_shape(c.lse, {p.heads_q, total_q});
    p.lse_head_stride = c.lse.stride(0);
    p.lse_row_stride = c.lse.stride(1);
  } else {
    p.seqlen_q = int(c.q.size(1));
    p.seqlen_k = int(c.k.size(1));
    expect_shape(c.q, {p.batch, p.seqlen_q, p.heads_q, p.head_dim});
    expect_shape(c.k, {p.batch, p.seqlen_k, p.heads_kv, p.head_dim});
    expect_shape(c.v, {p.batch, p.seqlen_k, p.heads_kv, p.head_dim_v});
    expect_shape(c.o, {p.batch, p.seqlen_q, p.heads_q, p.head_dim_v});
    expect_shape(c.lse, {p.batch, p.heads_q, p.seqlen_q});
    p.lse_batch_stride = c.lse.stride(0);
    p.lse_head_stride = c.lse.stride(1);
    p.lse_row_stride = c.lse.stride(2);
  }
  for (View* t : {&c.k, &c.v, &c.o}) expect_dtype(*t, p.dtype);
  for (View* t : {&c.k, &c.v, &c.o, &c.lse}) expect_device(*t, c.dev);
  const bool f64 = p.dtype == DType::kFloat64;
  FMHA_CHECK_ARG(c.lse.dtype.code == kDLFloat && c.lse.dtype.bits == (f64 ? 64 : 32),
                 "lse: expected ", f64 ? "float64" : "float32");
  FMHA_CHECK_ARG(p.heads_q % p.heads_kv == 0, "heads_q (", p.heads_q,
                 ") must be a multiple of heads_kv (", p.heads_kv, ")");

  const Bshd sq = bshd(c.q, varlen), sk = bshd(c.k, varlen), sv = bshd(c.v, varlen),
             so = bshd(c.o, varlen);
  p.q = c.q.data; p.k = c.k.data; p.v = c.v.data; p.o = c.o.data; p.lse = c.lse.data;
  p.q_batch_stride = sq.batch; p.q_row_stride = sq.row; p.q_head_stride = sq.head;
  p.k_batch_stride = sk.batch; p.k_row_stride = sk.row; p.k_head_stride = sk.head;
  p.v_batch_stride = sv.batch; p.v_row_stride = sv.row; p.v_head_stride = sv.head;
  p.o_batch_stride = so.batch; p.o_row_stride = so.row; p.o_head_stride = so.head;

  // bias / mask: 4-D views broadcast (stride 0) to (batch, heads_q, seqlen_q, seqlen_k);
  // the Python layer expands them as views, so only the shape is checked here.
  auto broadcast4 = [&](std::optional<View>& slot, const char* name, const py::object& obj,
                        Broadcast4& out, bool is_mask) {
    slot = import_opt(name, obj, false);
    if (!slot) return;
    View& t = *slot;
    expect_device(t, c.dev);
    FMHA_CHECK_ARG(t.ndim == 4 && t.size(0) == p.batch && t.size(1) == p.heads_q &&
                       t.size(2) >= p.seqlen_q && t.size(3) >= p.seqlen_k,
                   name, ": expected a view of shape (", p.batch, ", ", p.heads_q, ", ",
                   p.seqlen_q, ", ", p.seqlen_k, ")");
    if (is_mask) {
      FMHA_CHECK_ARG((t.dtype.code == kDLBool || t.dtype.code == kDLUInt) && t.dtype.bits == 8,
                     name, ": expected a bool array");
    } else {
      out.dtype = float_dtype(t);
    }
    out.ptr = t.data;
    out.batch_stride = t.stride(0);
    out.head_stride = t.stride(1);
    out.row_stride = t.stride(2);
    out.col_stride = t.stride(3);
  };
  broadcast4(c.bias, "bias", bias, p.bias, false);
  broadcast4(c.mask, "mask", mask, p.mask, true);

  c.alibi = import_opt("alibi_slopes", alibi, false);
  if (c.alibi) {
    View& a = *c.alibi;
    FMHA_CHECK_ARG(a.ndim == 2 && a.size(0) == p.batch && a.size(1) == p.heads_q &&
                       a.dtype.code == kDLFloat && a.dtype.bits == 64 &&
                       a.device.device_type == kDLCPU,
                   "alibi_slopes: expected a float64 (batch, heads_q) view in host memory");
    p.alibi_slopes = static_cast<const double*>(a.data);
    p.alibi_batch_stride = a.stride(0);
    p.alibi_head_stride = a.stride(1);
  }

  p.scale = kw["scale"].cast<double>();
  p.softcap = kw["softcap"].cast<double>();
  p.window_left = kw["window_left"].cast<int>();
  p.window_right = kw["window_right"].cast<int>();
  p.bottom_right = kw["bottom_right"].cast<bool>();
  p.dropout_p = kw["dropout_p"].cast<double>();
  p.seed = kw["seed"].cast<uint64_t>();
  p.offset = kw["offset"].cast<uint64_t>();
  p.num_threads = kw["num_threads"].cast<int>();
}

void run_forward(const FwdParams& p, const Call& c) {
  if (c.dev.type == kDLCPU) {
    py::gil_scoped_release nogil;
    cpu_forward(p);
    return;
  }
  throw Unsupported(concat("q: device type ", int(c.dev.type),
                           " has no kernels in this build (CPU arrays are supported)"));
}

void forward(py::object q, py::object k, py::object v, py::object out, py::object lse,
             py::object bias, py::object mask, py::object alibi, py::object cu_q,
             py::object cu_k, py::kwargs kw) {
  Call c{import("q", q, false), import("k", k, false), import("v", v, false),
         import("out", out, true), import("lse", lse, true)};
  FwdParams p;
  fill_fwd(p, c, kw, bias, mask, alibi, cu_q, cu_k);
  run_forward(p, c);
}

void backward(py::object dout, py::object q, py::object k, py::object v, py::object out,
              py::object lse, py::object dq, py::object dk, py::object dv, py::object dbias,
              py::object bias, py::object mask, py::object alibi, py::object cu_q,
              py::object cu_k, py::kwargs kw) {
  Call c{import("q", q, false), import("k", k, false), import("v", v, false),
         import("out", out, false), import("lse", lse, false)};
  BwdParams p;
  fill_fwd(p, c, kw, bias, mask, alibi, cu_q, cu_k);
  const bool varlen = !cu_q.is_none();
  View vdo = import("dout", dout, false), vdq = import("dq", dq, true),
       vdk = import("dk", dk, true), vdv = import("dv", dv, true);
  for (View* t : {&vdo, &vdq, &vdk, &vdv}) {
    expect_dtype(*t, p.dtype);
    expect_device(*t, c.dev);
    FMHA_CHECK_ARG(t->ndim == c.q.ndim, t->name, ": wrong number of dimensions");
  }
  for (int i = 0; i < c.q.ndim; ++i) {
    FMHA_CHECK_ARG(vdo.size(i) == c.o.size(i), "dout: shape differs from out's");
    FMHA_CHECK_ARG(vdq.size(i) == c.q.size(i), "dq: shape differs from q's");
    FMHA_CHECK_ARG(vdk.size(i) == c.k.size(i), "dk: shape differs from k's");
    FMHA_CHECK_ARG(vdv.size(i) == c.v.size(i), "dv: shape differs from v's");
  }
  for (View* t : {&vdo, &vdq, &vdk, &vdv})
    FMHA_CHECK_ARG(t->stride(t->ndim - 1) == 1, t->name, ": last dimension must be contiguous");
  const Bshd sdo = bshd(vdo, varlen), sdq = bshd(vdq, varlen), sdk = bshd(vdk, varlen),
             sdv = bshd(vdv, varlen);
  p.dout = vdo.data; p.dq = vdq.data; p.dk = vdk.data; p.dv = vdv.data;
  p.do_batch_stride = sdo.batch; p.do_row_stride = sdo.row; p.do_head_stride = sdo.head;
  p.dq_batch_stride = sdq.batch; p.dq_row_stride = sdq.row; p.dq_head_stride = sdq.head;
  p.dk_batch_stride = sdk.batch; p.dk_row_stride = sdk.row; p.dk_head_stride = sdk.head;
  p.dv_batch_stride = sdv.batch; p.dv_row_stride = sdv.row; p.dv_head_stride = sdv.head;

  std::optional<View> vdb = import_opt("dbias", dbias, true);
  if (vdb) {
    FMHA_CHECK_ARG(p.bias.ptr != nullptr, "dbias: given without bias");
    const bool f64 = p.dtype == DType::kFloat64;
    FMHA_CHECK_ARG(vdb->ndim == 4 && vdb->dtype.code == kDLFloat &&
                       vdb->dtype.bits == (f64 ? 64 : 32),
                   "dbias: expected a 4-D ", f64 ? "float64" : "float32", " array");
    const int64_t full[4] = {p.batch, p.heads_q, p.seqlen_q, p.seqlen_k};
    int64_t compact = 1;
    for (int i = 3; i >= 0; --i) {
      FMHA_CHECK_ARG(vdb->size(i) == 1 || vdb->size(i) == full[i], "dbias: dimension ", i,
                     " is ", vdb->size(i), ", expected 1 or ", full[i]);
      FMHA_CHECK_ARG(vdb->size(i) == 1 || vdb->stride(i) == compact, "dbias: must be contiguous");
      compact *= vdb->size(i);
    }
    expect_device(*vdb, c.dev);
    p.dbias = vdb->data;
    p.dbias_batch = int(vdb->size(0));
    p.dbias_heads = int(vdb->size(1));
    p.dbias_rows = int(vdb->size(2));
    p.dbias_cols = int(vdb->size(3));
  }
  if (c.dev.type == kDLCPU) {
    py::gil_scoped_release nogil;
    cpu_backward(p);
    return;
  }
  throw Unsupported(concat("q: device type ", int(c.dev.type),
                           " has no kernels in this build (CPU arrays are supported)"));
}

}  // namespace
}  // namespace fmha

PYBIND11_MODULE(_C, m) {
  using namespace fmha;
  m.doc() = "fmha core: fused multi-head attention kernels (use the fmha package, not this)";
  py::register_exception_translator([](std::exception_ptr e) {
    try {
      if (e) std::rethrow_exception(e);
    } catch (const InvalidArgument& err) {
      PyErr_SetString(PyExc_ValueError, err.what());
    } catch (const Unsupported& err) {
      PyErr_SetString(PyExc_NotImplementedError, err.what());
    }
  });
  m.def("forward", &forward, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"),
        py::arg("lse"), py::arg("bias") = py::none(), py::arg("mask") = py::none(),
        py::arg("alibi_slopes") = py::none(), py::arg("cu_seqlens_q") = py::none(),
        py::arg("cu_seqlens_k") = py::none(),
        "Writes out and lse. Keyword settings: scale, softcap, window_left, window_right, "
        "bottom_right, dropout_p, seed, offset, num_threads[, max_seqlen_q, max_seqlen_k].");
  m.def("backward", &backward, py::arg("dout"), py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("out"), py::arg("lse"), py::arg("dq"), py::arg("dk"), py::arg("dv"),
        py::arg("dbias") = py::none(), py::arg("bias") = py::none(),
        py::arg("mask") = py::none(), py::arg("alibi_slopes") = py::none(),
        py::arg("cu_seqlens_q") = py::none(), py::arg("cu_seqlens_k") = py::none(),
        "Writes dq, dk, dv (and dbias). Same keyword settings as forward.");
  m.def("cpu_features", &cpu_features, "CPU features relevant to the kernels");
  m.def("cpu_isa", [] { return std::string(isa_name(active_cpu_isa())); },
        "The instruction set the CPU kernels use");
  m.def("best_cpu_isa", [] { return std::string(isa_name(best_cpu_isa())); });
  m.def("set_cpu_isa", [](const std::string& name) {
    if (name == "scalar") set_cpu_isa(CpuIsa::kScalar);
    else if (name == "avx2") set_cpu_isa(CpuIsa::kAvx2);
    else if (name == "avx512") set_cpu_isa(CpuIsa::kAvx512);
    else if (name == "avx512bf16") set_cpu_isa(CpuIsa::kAvx512Bf16);
    else throw InvalidArgument(concat("isa: got '", name,
                                      "', expected scalar, avx2, avx512 or avx512bf16"));
  });
  m.def("hardware_threads", &hardware_threads);
  // The kernels' own Philox, exposed so tests can hold it to the published vectors.
  m.def("philox4x32_10", [](std::array<uint32_t, 4> c, std::array<uint32_t, 2> k) {
    const Philox4 r = philox4x32_10(c[0], c[1], c[2], c[3], k[0], k[1]);
    return std::array<uint32_t, 4>{r.x[0], r.x[1], r.x[2], r.x[3]};
  }, py::arg("counter"), py::arg("key"));
  m.def("dropout_threshold", &dropout_threshold, py::arg("p"));
  m.def("cpu_exp", [](py::object x, py::object y) {
    View vx = import("x", x, false), vy = import("y", y, true);
    FMHA_CHECK_ARG(vx.ndim == 1 && vy.ndim == 1 && vx.size(0) == vy.size(0) &&
                       vx.stride(0) == 1 && vy.stride(0) == 1 && vx.dtype.code == kDLFloat &&
                       vx.dtype.bits == 32 && vy.dtype.code == kDLFloat && vy.dtype.bits == 32 &&
                       vx.device.device_type == kDLCPU && vy.device.device_type == kDLCPU,
                   "x, y: expected contiguous 1-D float32 host arrays of one length");
    cpu_exp(static_cast<const float*>(vx.data), static_cast<float*>(vy.data), vx.size(0));
  }, py::arg("x"), py::arg("y"), "y = exp(x) as the CPU kernels' softmax computes it");
  m.def("cpu_fma_peak_gflops", &cpu_fma_peak_gflops, py::arg("threads"),
        py::call_guard<py::gil_scoped_release>());
  m.def("cuda_built", &cuda_built);
  m.def("cuda_device_count", &cuda_device_count);
  m.def("cuda_status", &cuda_status);
}
