// DLPack arrays + keyword settings -> FwdParams / BwdParams: the one filler that fmha._C (CPU
// and CUDA kernels) and fmha._cuda_emu (the CUDA kernels run by the emulator) share, so that
// both modules read the same call in the same way and a test of one is a test of the other's
// input handling.
//
// The Python layer (python/fmha/_api.py) has already validated everything a user can pass and
// allocated the outputs. This checks what building params from DLPack tensors needs -- each
// tensor's dtype, device, rank, extents and strides, and the varlen offsets it reads -- and
// names the argument in every error; the rules on the params themselves (sizes, settings)
// are the validation contract's (fmha/validate.h), which each backend's entry applies.
// Header-only: the emulator module includes it too, and links only the validation library.
#pragma once

#include <pybind11/pybind11.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <cstdint>
#include <forward_list>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "bindings/dlpack_view.h"
#include "dlpack/dlpack.h"
#include "fmha/error.h"
#include "fmha/params.h"

namespace fmha {
namespace bind {

namespace py = pybind11;

// ------------------------------------------------------------------------------ devices

// Where the kernels would read an array: host memory (CPU kernels, the emulator) or the
// memory of one CUDA device. Pinned host memory is host memory; managed memory is reachable
// from its device, so it counts as that device's.
enum class Memory { kHost, kCuda };

struct Device {
  Memory mem = Memory::kHost;
  int id = 0;
  bool operator==(const Device& o) const { return mem == o.mem && (mem == Memory::kHost || id == o.id); }
};

inline std::string device_name(const Device& d) {
  return d.mem == Memory::kHost ? std::string("cpu") : concat("cuda:", d.id);
}

inline Device device_of(const std::string& name, const DLDevice& d) {
  switch (d.device_type) {
    case kDLCPU:
    case kDLCUDAHost: return {Memory::kHost, 0};
    case kDLCUDA:
    case kDLCUDAManaged: return {Memory::kCuda, d.device_id};
    default:
      throw Unsupported(concat(name, ": arrays on DLPack device type ", int(d.device_type),
                               " are not supported (expected host memory or a CUDA device)"));
  }
}

inline void expect_device(const View& v, const Device& dev) {
  const Device got = device_of(v.name, v.device);
  FMHA_CHECK_ARG(got == dev, v.name, ": on device ", device_name(got), ", expected q's device ",
                 device_name(dev), " (every array of a call must be on the same device)");
}

// ------------------------------------------------------------------------------ keywords

// The keyword settings of forward/backward. Unknown names are errors, so that a misspelt
// setting cannot silently fall back to its default. The keywords are matched once, against
// the allowed names (a call's cost is a few string compares, not a dictionary lookup per
// setting).
class Settings {
 public:
  static constexpr int kMax = 20;

  Settings(const char* fn, const py::kwargs& kw, std::initializer_list<const char*> allowed)
      : fn_(fn), n_(int(allowed.size())) {
    if (n_ > kMax) throw std::logic_error("Settings: too many keywords");
    std::copy(allowed.begin(), allowed.end(), names_.begin());
    for (int i = 0; i < n_; ++i) interned_[i] = interned(names_[i]);
    for (auto item : kw) {
      // Keyword names are interned strings: pointer equality finds them; the compare is
      // for a name built at run time.
      int i = 0;
      while (i < n_ && item.first.ptr() != interned_[i]) ++i;
      if (i == n_) {
        i = 0;
        while (i < n_ && PyUnicode_CompareWithASCIIString(item.first.ptr(), names_[i]) != 0) ++i;
      }
      if (i == n_) {
        std::string list;
        for (int j = 0; j < n_; ++j) list += concat(j ? ", " : "", names_[j]);
        throw py::type_error(concat(fn, ": unknown keyword argument '",
                                    std::string(py::str(item.first)), "' (expected ", list,
                                    ")"));
      }
      values_[i] = item.second;
    }
  }
  bool has(const char* name) const {
    const py::handle v = values_[index(name)];
    return v && !v.is_none();
  }
  template <typename T>
  T get(const char* name) const {
    const py::handle v = values_[index(name)];
    if (!v || v.is_none())
      throw py::type_error(concat(fn_, ": missing keyword argument '", name, "'"));
    try {
      return v.cast<T>();
    } catch (const py::cast_error&) {
      throw py::type_error(concat(fn_, ": keyword argument '", name, "' has the wrong type (",
                                  std::string(py::str(py::type::of(v).attr("__name__"))), ")"));
    }
  }
  template <typename T>
  T get(const char* name, T fallback) const {
    const py::handle v = values_[index(name)];
    return v && !v.is_none() ? get<T>(name) : fallback;
  }

 private:
  // The interned Python string of a keyword name, made once per name (held for the life of
  // the module; the names are string literals).
  static PyObject* interned(const char* name) {
    static std::array<std::pair<const char*, PyObject*>, 32> made{};
    for (auto& [n, s] : made) {
      if (n == name) return s;
      if (n == nullptr) {
        n = name;
        s = PyUnicode_InternFromString(name);
        return s;
      }
    }
    return nullptr;  // more names than slots: the string compare still finds them
  }

  int index(const char* name) const {
    for (int i = 0; i < n_; ++i)  // the same literal is one pointer: compare that first
      if (names_[i] == name) return i;
    for (int i = 0; i < n_; ++i)
      if (std::strcmp(names_[i], name) == 0) return i;
    throw std::logic_error(concat("Settings: '", name, "' is not an allowed keyword"));
  }

  const char* fn_;
  int n_;
  std::array<const char*, kMax> names_{};
  std::array<PyObject*, kMax> interned_{};
  std::array<py::handle, kMax> values_{};  // borrowed from the call's kwargs
};

#define FMHA_FORWARD_KEYWORDS                                                                  \
  "scale", "softcap", "window_left", "window_right", "bottom_right", "dropout_p", "seed",     \
      "offset", "num_threads", "max_seqlen_q", "max_seqlen_k", "stream", "num_splits",       \
      "q_position", "k_position", "head_position", "heads_total"

// ------------------------------------------------------------------------------ the call

// One call: the params plus the views that keep the producers' memory alive while the
// kernels read it.
template <typename Params>
struct Call {
  Params p;
  Device dev;
  intptr_t stream = 0;  // cudaStream_t of the launch (CUDA arrays only; 0 = legacy default)
  // What import() takes after q: the launch stream when q is a CUDA array, -1 when it is a
  // host array (no CUDA producer to order: the other arrays' devices are not queried, and
  // one on another device is refused by expect_device after its export).
  intptr_t import_stream = -1;
  View q, k, v, o, lse;
  std::optional<View> bias, mask, alibi, cu_q, cu_k;
  std::optional<View> block_index, block_masks;  // a block-sparse mask
  std::optional<View> q_descale, k_descale, v_descale;  // float8 inputs' factors
  std::optional<View> dout, dq, dk, dv, dbias, dlse;  // backward only
};

inline std::optional<View> import_opt(const std::string& name, const py::object& obj,
                                      bool writable, intptr_t stream) {
  if (obj.is_none()) return std::nullopt;
  return import(name, obj, writable, stream);
}

inline DType float_dtype(const View& v) {
  if (v.dtype.lanes == 1) {
    if (v.dtype.code == kDLFloat && v.dtype.bits == 64) return DType::kFloat64;
    if (v.dtype.code == kDLFloat && v.dtype.bits == 32) return DType::kFloat32;
    if (v.dtype.code == kDLFloat && v.dtype.bits == 16) return DType::kFloat16;
    if (v.dtype.code == kDLBfloat && v.dtype.bits == 16) return DType::kBFloat16;
  }
  throw InvalidArgument(concat(v.name, ": expected float64, float32, bfloat16 or float16 (code ",
                               int(v.dtype.code), ", ", int(v.dtype.bits), " bits)"));
}

// The dtype of q, k, v: a float dtype, or float8_e4m3fn (forward only; FwdParams, "FP8
// inputs"). Other float8 encodings are refused by name.
inline DType input_dtype(const View& v) {
  if (v.dtype.lanes == 1 && v.dtype.bits == 8) {
    if (v.dtype.code == kDLFloat8_e4m3fn) return DType::kFloat8E4M3;
    FMHA_CHECK_ARG(v.dtype.code < kDLFloat8_e3m4 || v.dtype.code > kDLFloat8_e8m0fnu, v.name,
                   ": of the float8 dtypes only float8_e4m3fn is supported (DLPack code ",
                   int(v.dtype.code), ")");
  }
  return float_dtype(v);
}

inline void expect_dtype(const View& v, DType want) {
  FMHA_CHECK_ARG(input_dtype(v) == want, v.name, ": dtype ", dtype_name(input_dtype(v)),
                 " differs from q's ", dtype_name(want));
}

inline void expect_shape(const View& v, std::initializer_list<int64_t> shape) {
  FMHA_CHECK_ARG(v.ndim == int(shape.size()), v.name, ": expected ", shape.size(),
                 " dimensions, got ", v.ndim);
  int i = 0;
  for (int64_t s : shape) {
    FMHA_CHECK_ARG(v.size(i) == s, v.name, ": dimension ", i, " is ", v.size(i), ", expected ",
                   s);
    ++i;
  }
  FMHA_CHECK_ARG(v.stride(v.ndim - 1) == 1 || v.size(v.ndim - 1) == 1 || v.empty(), v.name,
                 ": the last dimension must be contiguous");
}

// (batch, seqlen, heads, dim) or, varlen, (total, heads, dim): element strides.
struct Bshd {
  int64_t batch = 0, row = 0, head = 0;
};
inline Bshd bshd(const View& t, bool varlen) {
  if (varlen) return {0, t.stride(0), t.stride(1)};
  return {t.stride(0), t.stride(1), t.stride(2)};
}

// cu_seqlens in host memory: read and check them, and take the maxima from them.
inline void host_cu_seqlens(FwdParams& p, const View& cu_q, const View& cu_k, int64_t total_q,
                            int64_t total_k, const Settings& s) {
  p.cu_seqlens_q = static_cast<const int32_t*>(cu_q.data);
  p.cu_seqlens_k = static_cast<const int32_t*>(cu_k.data);
  int max_q = 0, max_k = 0;
  FMHA_CHECK_ARG(p.cu_seqlens_q[0] == 0 && p.cu_seqlens_k[0] == 0,
                 "cu_seqlens_q, cu_seqlens_k: must start at 0");
  for (int b = 0; b < p.batch; ++b) {
    const int lq = p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b];
    const int lk = p.cu_seqlens_k[b + 1] - p.cu_seqlens_k[b];
    FMHA_CHECK_ARG(lq >= 0 && lk >= 0, "cu_seqlens_q, cu_seqlens_k: must be non-decreasing");
    max_q = std::max(max_q, lq);
    max_k = std::max(max_k, lk);
  }
  FMHA_CHECK_ARG(p.cu_seqlens_q[p.batch] == total_q && p.cu_seqlens_k[p.batch] == total_k,
                 "cu_seqlens_q, cu_seqlens_k: must end at the packed lengths ", total_q, " and ",
                 total_k, ", got ", p.cu_seqlens_q[p.batch], " and ", p.cu_seqlens_k[p.batch]);
  p.seqlen_q = s.get<int>("max_seqlen_q", max_q);
  p.seqlen_k = s.get<int>("max_seqlen_k", max_k);
  FMHA_CHECK_ARG(p.seqlen_q >= max_q && p.seqlen_k >= max_k,
                 "max_seqlen_q, max_seqlen_k: smaller than the longest sequence (", max_q, ", ",
                 max_k, ")");
}

// The launch stream, then q: its device decides where every other array must be.
template <typename Params>
void import_q(Call<Params>& c, const Settings& s, const py::object& q) {
  c.stream = s.get<intptr_t>("stream", 0);
  FMHA_CHECK_ARG(c.stream >= 0, "stream: expected a cudaStream_t as a non-negative int, got ",
                 c.stream);
  c.q = import("q", q, false, c.stream);
  c.dev = device_of("q", c.q.device);
  c.import_stream = c.dev.mem == Memory::kCuda ? c.stream : -1;
}

// ALiBi slopes: a float64 (batch, heads_q) view, on q's device.
template <typename Params>
void import_alibi(Call<Params>& c, const py::object& alibi) {
  Params& p = c.p;
  c.alibi = import_opt("alibi_slopes", alibi, false, c.import_stream);
  if (c.alibi) {
    View& a = *c.alibi;
    FMHA_CHECK_ARG(a.ndim == 2 && a.size(0) == p.batch && a.size(1) == p.heads_q &&
                       a.dtype.code == kDLFloat && a.dtype.bits == 64 && a.dtype.lanes == 1,
                   "alibi_slopes: expected a float64 (batch, heads_q) = (", p.batch, ", ",
                   p.heads_q, ") view");
    expect_device(a, c.dev);
    p.alibi_slopes = static_cast<const double*>(a.data);
    p.alibi_batch_stride = a.stride(0);
    p.alibi_head_stride = a.stride(1);
  }
}

// A forward on host arrays may leave lse out (None): the CPU kernels then neither compute nor
// store it (FwdParams::lse = nullptr). The view keeps lse's shape, dense (batch, heads_q,
// seqlen_q) or, varlen, (heads_q, total_q), for the checks that read it. A small call saves
// the caller an allocation (fmha's plain torch and NumPy calls that do not return lse).
template <typename Params>
void scratch_lse(Call<Params>& c, bool varlen) {
  const bool f64 = c.p.dtype == DType::kFloat64;
  View& t = c.lse;
  t.name = "lse";
  t.device = {kDLCPU, 0};
  t.dtype = {kDLFloat, uint8_t(f64 ? 64 : 32), 1};
  t.ndim = varlen ? 2 : 3;
  if (varlen)
    t.shape = {c.q.size(1), c.q.size(0), 0, 0};
  else
    t.shape = {c.q.size(0), c.q.size(2), c.q.size(1), 0};
  int64_t n = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    t.strides[size_t(i)] = n;
    n *= t.shape[size_t(i)];
  }
  t.data = nullptr;
}

// Everything but the gradients: q, k, v, out, lse, bias, mask, ALiBi, varlen offsets and the
// settings. `host_only`: the caller can run host arrays only (the emulator), which stand for
// the GPU's memory: varlen offsets are then handled as device offsets (not read here).
template <typename Params>
void fill_forward(Call<Params>& c, const Settings& s, const py::object& q, const py::object& k,
                  const py::object& v, const py::object& out, const py::object& lse,
                  bool outputs_writable, const py::object& bias, const py::object& mask,
                  const py::object& alibi, const py::object& cu_q, const py::object& cu_k,
                  bool host_only) {
  Params& p = c.p;
  import_q(c, s, q);
  if (host_only)
    FMHA_CHECK_ARG(c.dev.mem == Memory::kHost, "q: on device ", device_name(c.dev),
                   "; the emulator runs the CUDA kernels on host arrays only");
  c.k = import("k", k, false, c.import_stream);
  c.v = import("v", v, false, c.import_stream);
  c.o = import("out", out, outputs_writable, c.import_stream);
  for (View* t : {&c.k, &c.v, &c.o}) expect_device(*t, c.dev);
  if (!lse.is_none()) {
    c.lse = import("lse", lse, outputs_writable, c.import_stream);
    expect_device(c.lse, c.dev);
  } else {
    FMHA_CHECK_ARG(outputs_writable, "lse: required (the backward reads the forward's lse)");
    FMHA_CHECK_ARG(c.dev.mem == Memory::kHost && !host_only, "lse: required for arrays on ",
                   device_name(c.dev), host_only ? " run by the emulated CUDA kernels" : "",
                   " (only a call of the CPU kernels may leave it out)");
  }

  const bool varlen = !cu_q.is_none() || !cu_k.is_none();
  p.dtype = input_dtype(c.q);
  const int nd = varlen ? 3 : 4;
  FMHA_CHECK_ARG(c.q.ndim == nd, "q: expected ", nd, " dimensions, got ", c.q.ndim);
  if (lse.is_none()) scratch_lse(c, varlen);
  FMHA_CHECK_ARG(c.k.ndim == nd, "k: expected ", nd, " dimensions, got ", c.k.ndim);
  FMHA_CHECK_ARG(c.v.ndim == nd, "v: expected ", nd, " dimensions, got ", c.v.ndim);
  const int o_ = varlen ? 0 : 1;  // index of the seqlen dimension
  p.batch = varlen ? 0 : int(c.q.size(0));  // varlen: from cu_seqlens below
  p.heads_q = int(c.q.size(o_ + 1));
  p.heads_kv = int(c.k.size(o_ + 1));
  p.head_dim = int(c.q.size(o_ + 2));
  p.head_dim_v = int(c.v.size(o_ + 2));
  if (varlen) {
    FMHA_CHECK_ARG(!cu_q.is_none() && !cu_k.is_none(),
                   "cu_seqlens_q, cu_seqlens_k: give both or neither");
    c.cu_q = import("cu_seqlens_q", cu_q, false, c.import_stream);
    c.cu_k = import("cu_seqlens_k", cu_k, false, c.import_stream);
    for (View* cu : {&*c.cu_q, &*c.cu_k}) {
      FMHA_CHECK_ARG(cu->ndim == 1 && cu->dtype.code == kDLInt && cu->dtype.bits == 32 &&
                         cu->dtype.lanes == 1 && (cu->stride(0) == 1 || cu->size(0) == 1),
                     cu->name, ": expected a contiguous 1-D int32 array");
      expect_device(*cu, c.dev);
    }
    FMHA_CHECK_ARG(c.cu_q->size(0) == c.cu_k->size(0) && c.cu_q->size(0) >= 1,
                   "cu_seqlens_q, cu_seqlens_k: must have the same length batch + 1 >= 1, got ",
                   c.cu_q->size(0), " and ", c.cu_k->size(0));
    p.batch = int(c.cu_q->size(0) - 1);
    const int64_t total_q = c.q.size(0), total_k = c.k.size(0);
    // The kernels clamp every sequence to these rows (fmha/params.h); no int32 offset
    // reaches past INT32_MAX.
    p.total_q = int(std::min<int64_t>(total_q, INT32_MAX));
    p.total_k = int(std::min<int64_t>(total_k, INT32_MAX));
    if (c.dev.mem == Memory::kHost && !host_only) {
      host_cu_seqlens(p, *c.cu_q, *c.cu_k, total_q, total_k, s);
    } else {
      // Offsets in device memory are not read: that would synchronise with the GPU (and
      // could not be captured in a CUDA graph). The kernels clamp each sequence to the
      // packed rows and to these maxima instead, so inconsistent offsets cannot make them
      // access memory out of bounds (docs/semantics.md, "Variable-length batches"). The
      // emulator (host_only) treats its host arrays as the GPU's memory: it runs exactly
      // this path.
      FMHA_CHECK_ARG(s.has("max_seqlen_q") && s.has("max_seqlen_k"),
                     "max_seqlen_q, max_seqlen_k: required with cu_seqlens in device memory "
                     "(the offsets are not read on the host)");
      p.cu_seqlens_q = static_cast<const int32_t*>(c.cu_q->data);
      p.cu_seqlens_k = static_cast<const int32_t*>(c.cu_k->data);
      p.seqlen_q = s.get<int>("max_seqlen_q");
      p.seqlen_k = s.get<int>("max_seqlen_k");
      FMHA_CHECK_ARG(p.seqlen_q >= 0 && p.seqlen_k >= 0,
                     "max_seqlen_q, max_seqlen_k: expected >= 0, got ", p.seqlen_q, " and ",
                     p.seqlen_k);
    }
    // No row at all (every sequence empty, or no sequence): seqlen 0, so that the backends
    // take the empty call's path and never touch the (possibly null) data pointer. Rows in
    // some sequence: at least one row per tile, whatever max_seqlen said.
    p.seqlen_q = total_q == 0 ? 0 : std::max(p.seqlen_q, 1);
    p.seqlen_k = total_k == 0 ? 0 : std::max(p.seqlen_k, 1);
    expect_shape(c.q, {total_q, p.heads_q, p.head_dim});
    expect_shape(c.k, {total_k, p.heads_kv, p.head_dim});
    expect_shape(c.v, {total_k, p.heads_kv, p.head_dim_v});
    expect_shape(c.o, {total_q, p.heads_q, p.head_dim_v});
    expect_shape(c.lse, {p.heads_q, total_q});
    p.lse_batch_stride = 0;
    p.lse_head_stride = c.lse.stride(0);
    p.lse_row_stride = c.lse.stride(1);
  } else {
    FMHA_CHECK_ARG(!s.has("max_seqlen_q") && !s.has("max_seqlen_k"),
                   "max_seqlen_q, max_seqlen_k: only meaningful with cu_seqlens");
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
  for (View* t : {&c.k, &c.v}) expect_dtype(*t, p.dtype);
  if (p.dtype == DType::kFloat8E4M3)
    p.o_dtype = float_dtype(c.o);  // check_params takes bfloat16 or float16
  else
    expect_dtype(c.o, p.dtype);
  const bool f64 = p.dtype == DType::kFloat64;
  FMHA_CHECK_ARG(c.lse.dtype.code == kDLFloat && c.lse.dtype.bits == (f64 ? 64 : 32) &&
                     c.lse.dtype.lanes == 1,
                 "lse: expected ", f64 ? "float64" : "float32");

  const Bshd sq = bshd(c.q, varlen), sk = bshd(c.k, varlen), sv = bshd(c.v, varlen),
             so = bshd(c.o, varlen);
  p.q = c.q.data; p.k = c.k.data; p.v = c.v.data; p.o = c.o.data; p.lse = c.lse.data;
  p.q_batch_stride = sq.batch; p.q_row_stride = sq.row; p.q_head_stride = sq.head;
  p.k_batch_stride = sk.batch; p.k_row_stride = sk.row; p.k_head_stride = sk.head;
  p.v_batch_stride = sv.batch; p.v_row_stride = sv.row; p.v_head_stride = sv.head;
  p.o_batch_stride = so.batch; p.o_row_stride = so.row; p.o_head_stride = so.head;

  // bias / mask: 4-D views broadcast (stride 0) to (batch, heads_q, seqlen_q, seqlen_k);
  // the Python layer expands them as views, so only the extents are checked here.
  auto broadcast4 = [&](std::optional<View>& slot, const char* name, const py::object& obj,
                        Broadcast4& b, bool is_mask) {
    slot = import_opt(name, obj, false, c.import_stream);
    if (!slot) return;
    View& t = *slot;
    expect_device(t, c.dev);
    FMHA_CHECK_ARG(t.ndim == 4 && t.size(0) == p.batch && t.size(1) == p.heads_q &&
                       t.size(2) >= p.seqlen_q && t.size(3) >= p.seqlen_k,
                   name, ": expected a view of shape (", p.batch, ", ", p.heads_q, ", ",
                   p.seqlen_q, ", ", p.seqlen_k, ")");
    if (is_mask) {
      FMHA_CHECK_ARG((t.dtype.code == kDLBool || t.dtype.code == kDLUInt) &&
                         t.dtype.bits == 8 && t.dtype.lanes == 1,
                     name, ": expected a bool array");
    } else {
      b.dtype = float_dtype(t);
    }
    b.ptr = t.data;
    b.batch_stride = t.stride(0);
    b.head_stride = t.stride(1);
    b.row_stride = t.stride(2);
    b.col_stride = t.stride(3);
  };
  broadcast4(c.bias, "bias", bias, p.bias, false);
  broadcast4(c.mask, "mask", mask, p.mask, true);

  import_alibi(c, alibi);

  p.scale = s.get<double>("scale");
  p.softcap = s.get<double>("softcap");
  p.window_left = s.get<int>("window_left");
  p.window_right = s.get<int>("window_right");
  p.bottom_right = s.get<bool>("bottom_right");
  p.dropout_p = s.get<double>("dropout_p");
  p.seed = s.get<uint64_t>("seed", 0);
  p.offset = s.get<uint64_t>("offset", 0);
  p.num_threads = s.get<int>("num_threads", 0);
  p.num_splits = s.get<int>("num_splits", 0);
  p.q_position = s.get<int>("q_position", 0);
  p.k_position = s.get<int>("k_position", 0);
  p.head_position = s.get<int>("head_position", 0);
  p.heads_total = s.get<int>("heads_total", 0);
}

// A block-sparse mask (params.h, BlockSparse; built by python/fmha/block_mask.py): index
// (B, H, q_blocks, k_blocks) int32, B in {1, batch}, H in {1, heads_q}, and the partial
// blocks' element masks (num_partial, block_q, block_k) bytes, whose shape gives the block
// size. Host entries are checked here; device entries are clamped by the kernels.
template <typename Params>
void fill_block_mask(Call<Params>& c, const py::object& index, const py::object& masks) {
  if (index.is_none() && masks.is_none()) return;
  FMHA_CHECK_ARG(!index.is_none() && !masks.is_none(),
                 "block_index, block_masks: give both or neither");
  Params& p = c.p;
  c.block_index = import("block_index", index, false, c.import_stream);
  c.block_masks = import("block_masks", masks, false, c.import_stream);
  const View& x = *c.block_index;
  const View& m = *c.block_masks;
  expect_device(x, c.dev);
  expect_device(m, c.dev);
  FMHA_CHECK_ARG(x.ndim == 4 && x.dtype.code == kDLInt && x.dtype.bits == 32 &&
                     x.dtype.lanes == 1 && (x.size(0) == 1 || x.size(0) == p.batch) &&
                     (x.size(1) == 1 || x.size(1) == p.heads_q),
                 "block_index: expected int32 (1 or batch, 1 or heads_q, q_blocks, k_blocks)");
  FMHA_CHECK_ARG(x.empty() || ((x.stride(3) == 1 || x.size(3) == 1) &&
                               (x.stride(2) == x.size(3) || x.size(2) == 1)),
                 "block_index: the last two dimensions must be contiguous");
  FMHA_CHECK_ARG(m.ndim == 3 && (m.dtype.code == kDLBool || m.dtype.code == kDLUInt) &&
                     m.dtype.bits == 8 && m.dtype.lanes == 1 && m.size(1) >= 1 && m.size(2) >= 1,
                 "block_masks: expected bool (num_partial, block_q, block_k)");
  FMHA_CHECK_ARG(m.empty() || (m.stride(2) == 1 && m.stride(1) == m.size(2) &&
                               (m.stride(0) == m.size(1) * m.size(2) || m.size(0) == 1)),
                 "block_masks: expected a contiguous array");
  FMHA_CHECK_ARG(x.size(0) * x.stride(0) + x.size(1) * x.stride(1) < (int64_t(1) << 31) &&
                     m.size(0) * m.size(1) * m.size(2) < (int64_t(1) << 31),
                 "block_index, block_masks: more than 2**31 - 1 elements");
  BlockSparse& b = p.block_mask;
  b.block_q = int(m.size(1));
  b.block_k = int(m.size(2));
  b.num_partial = int(m.size(0));
  b.q_blocks = int(x.size(2));
  b.k_blocks = int(x.size(3));
  b.batch_stride = x.size(0) == 1 ? 0 : x.stride(0);
  b.head_stride = x.size(1) == 1 ? 0 : x.stride(1);
  b.partial = static_cast<const uint8_t*>(m.data);
  // A call with no block at all still marks the mask present (check_params sizes it).
  static const int32_t kNoBlocks = kBlockEmpty;
  b.index = x.empty() ? &kNoBlocks : static_cast<const int32_t*>(x.data);
  if (c.dev.mem == Memory::kHost && !x.empty()) {
    for (int64_t i = 0; i < x.size(0); ++i)
      for (int64_t h = 0; h < x.size(1); ++h)
        for (int64_t e = 0; e < int64_t(b.q_blocks) * b.k_blocks; ++e) {
          const int32_t v = b.index[i * x.stride(0) + h * x.stride(1) + e];
          FMHA_CHECK_ARG(v == kBlockEmpty || v == kBlockFull || (v >= 0 && v < b.num_partial),
                         "block_index: entry ", v, " is neither -1 (empty), -2 (full) nor a "
                         "partial block below ", b.num_partial);
        }
  }
}

// The descale factors of float8 inputs (FwdParams, "FP8 inputs"): float32 (batch, heads_kv)
// views, any strides (0 broadcasts), on q's device; None = 1. check_params refuses them
// with other dtypes.
template <typename Params>
void fill_descales(Call<Params>& c, const py::object& q_descale, const py::object& k_descale,
                   const py::object& v_descale) {
  Params& p = c.p;
  const struct {
    std::optional<View>& slot;
    const char* name;
    const py::object& obj;
    const float*& ptr;
    int64_t &batch_stride, &head_stride;
  } descales[] = {
      {c.q_descale, "q_descale", q_descale, p.q_descale, p.q_descale_batch_stride,
       p.q_descale_head_stride},
      {c.k_descale, "k_descale", k_descale, p.k_descale, p.k_descale_batch_stride,
       p.k_descale_head_stride},
      {c.v_descale, "v_descale", v_descale, p.v_descale, p.v_descale_batch_stride,
       p.v_descale_head_stride},
  };
  for (const auto& d : descales) {
    d.slot = import_opt(d.name, d.obj, false, c.import_stream);
    if (!d.slot) continue;
    const View& t = *d.slot;
    expect_device(t, c.dev);
    FMHA_CHECK_ARG(t.ndim == 2 && t.size(0) == p.batch && t.size(1) == p.heads_kv &&
                       t.dtype.code == kDLFloat && t.dtype.bits == 32 && t.dtype.lanes == 1,
                   d.name, ": expected a float32 (batch, heads_kv) = (", p.batch, ", ",
                   p.heads_kv, ") view");
    d.ptr = static_cast<const float*>(t.data);
    d.batch_stride = t.stride(0);
    d.head_stride = t.stride(1);
  }
}

inline Call<FwdParams> forward_call(const py::object& q, const py::object& k,
                                    const py::object& v, const py::object& out,
                                    const py::object& lse, const py::object& bias,
                                    const py::object& mask, const py::object& alibi,
                                    const py::object& cu_q, const py::object& cu_k,
                                    const py::kwargs& kw, bool host_only) {
  const Settings s("forward", kw, {FMHA_FORWARD_KEYWORDS});
  Call<FwdParams> c;
  fill_forward(c, s, q, k, v, out, lse, true, bias, mask, alibi, cu_q, cu_k, host_only);
  return c;
}

inline Call<BwdParams> backward_call(const py::object& dout, const py::object& q,
                                     const py::object& k, const py::object& v,
                                     const py::object& out, const py::object& lse,
                                     const py::object& dq, const py::object& dk,
                                     const py::object& dv, const py::object& dbias,
                                     const py::object& bias, const py::object& mask,
                                     const py::object& alibi, const py::object& cu_q,
                                     const py::object& cu_k, const py::object& dlse,
                                     const py::kwargs& kw, bool host_only) {
  const Settings s("backward", kw, {FMHA_FORWARD_KEYWORDS, "deterministic"});
  Call<BwdParams> c;
  fill_forward(c, s, q, k, v, out, lse, false, bias, mask, alibi, cu_q, cu_k, host_only);
  BwdParams& p = c.p;
  p.deterministic = s.get<bool>("deterministic", false);
  const bool varlen = c.cu_q.has_value();
  c.dout = import("dout", dout, false, c.import_stream);
  c.dq = import("dq", dq, true, c.import_stream);
  c.dk = import("dk", dk, true, c.import_stream);
  c.dv = import("dv", dv, true, c.import_stream);
  const View* like[4] = {&c.o, &c.q, &c.k, &c.v};
  View* grads[4] = {&*c.dout, &*c.dq, &*c.dk, &*c.dv};
  for (int t = 0; t < 4; ++t) {
    View& g = *grads[t];
    expect_dtype(g, p.dtype);
    expect_device(g, c.dev);
    FMHA_CHECK_ARG(g.ndim == like[t]->ndim, g.name, ": expected ", like[t]->ndim,
                   " dimensions like ", like[t]->name, ", got ", g.ndim);
    for (int i = 0; i < g.ndim; ++i)
      FMHA_CHECK_ARG(g.size(i) == like[t]->size(i), g.name, ": dimension ", i, " is ",
                     g.size(i), ", expected ", like[t]->size(i), " (", like[t]->name,
                     "'s shape)");
    FMHA_CHECK_ARG(g.stride(g.ndim - 1) == 1 || g.size(g.ndim - 1) == 1 || g.empty(), g.name,
                   ": the last dimension must be contiguous");
  }
  const Bshd sdo = bshd(*c.dout, varlen), sdq = bshd(*c.dq, varlen), sdk = bshd(*c.dk, varlen),
             sdv = bshd(*c.dv, varlen);
  p.dout = c.dout->data; p.dq = c.dq->data; p.dk = c.dk->data; p.dv = c.dv->data;
  p.do_batch_stride = sdo.batch; p.do_row_stride = sdo.row; p.do_head_stride = sdo.head;
  p.dq_batch_stride = sdq.batch; p.dq_row_stride = sdq.row; p.dq_head_stride = sdq.head;
  p.dk_batch_stride = sdk.batch; p.dk_row_stride = sdk.row; p.dk_head_stride = sdk.head;
  p.dv_batch_stride = sdv.batch; p.dv_row_stride = sdv.row; p.dv_head_stride = sdv.head;

  c.dbias = import_opt("dbias", dbias, true, c.import_stream);
  if (c.dbias) {
    View& db = *c.dbias;
    const bool f64 = p.dtype == DType::kFloat64;
    FMHA_CHECK_ARG(db.ndim == 4 && db.dtype.code == kDLFloat && db.dtype.bits == (f64 ? 64 : 32),
                   "dbias: expected a 4-D ", f64 ? "float64" : "float32", " array");
    expect_device(db, c.dev);
    const int64_t full[4] = {p.batch, p.heads_q, p.seqlen_q, p.seqlen_k};
    int64_t compact = 1;
    for (int i = 3; i >= 0; --i) {
      FMHA_CHECK_ARG(db.size(i) == 1 || db.size(i) == full[i], "dbias: dimension ", i, " is ",
                     db.size(i), ", expected 1 or ", full[i]);
      FMHA_CHECK_ARG(db.size(i) == 1 || db.stride(i) == compact || db.empty(),
                     "dbias: must be contiguous");
      compact *= db.size(i);
    }
    p.dbias = db.data;
    p.dbias_batch = int(db.size(0));
    p.dbias_heads = int(db.size(1));
    p.dbias_rows = int(db.size(2));
    p.dbias_cols = int(db.size(3));
  }
  // The gradient through lse: lse's shape, dtype and strides (the kernels index both alike).
  c.dlse = import_opt("dlse", dlse, false, c.import_stream);
  if (c.dlse) {
    const View& g = *c.dlse;
    expect_device(g, c.dev);
    FMHA_CHECK_ARG(g.dtype.code == c.lse.dtype.code && g.dtype.bits == c.lse.dtype.bits &&
                       g.dtype.lanes == 1 && g.ndim == c.lse.ndim,
                   "dlse: expected lse's dtype and ", c.lse.ndim, " dimensions");
    for (int i = 0; i < g.ndim; ++i)
      FMHA_CHECK_ARG(g.size(i) == c.lse.size(i) && (g.stride(i) == c.lse.stride(i) ||
                                                    g.size(i) == 1 || g.empty()),
                     "dlse: expected lse's shape and strides (dimension ", i, ": size ",
                     g.size(i), ", stride ", g.stride(i), "; lse: ", c.lse.size(i), ", ",
                     c.lse.stride(i), ")");
    p.dlse = g.data;
  }
  return c;
}

// ------------------------------------------------------------------------------ KV caches

#define FMHA_KVCACHE_KEYWORDS                                                                \
  "scale", "softcap", "window_left", "window_right", "num_threads", "stream", "num_splits", \
      "kv_code"

// One call of attention over KV caches (fmha.attention_with_kvcache): the caches, the new
// rows appended to them, and the lengths / block table that say where each sequence lives.
struct KvCacheCall : Call<FwdParams> {
  std::optional<View> k_new, v_new, cache_seqlens, block_table, k_scale, v_scale;
};

inline void expect_int32(const View& v, int ndim) {
  FMHA_CHECK_ARG(v.ndim == ndim && v.dtype.code == kDLInt && v.dtype.bits == 32 &&
                     v.dtype.lanes == 1 && (v.empty() || v.stride(ndim - 1) == 1),
                 v.name, ": expected an int32 array of ", ndim,
                 " dimension(s), contiguous in the last");
}

// The scales of 8-bit caches (fmha/kvquant.h): float32, both (heads_kv,) -- static, per kv
// head -- or both (slots, rows, heads_kv) like the caches' rows -- dynamic, per row and kv
// head, written by the append. Host static scales must be finite and positive.
inline void import_kv_scales(KvCacheCall& c, const py::object& k_scale, const py::object& v_scale,
                             int64_t slots, int64_t rows) {
  FwdParams& p = c.p;
  // Imported read-only: they are written only as per-row scales of appended rows (checked
  // below), and read-only arrays serve every other call.
  c.k_scale = import_opt("k_scale", k_scale, false, c.import_stream);
  c.v_scale = import_opt("v_scale", v_scale, false, c.import_stream);
  if (p.kv_code == KvCode::kNone) {
    FMHA_CHECK_ARG(!c.k_scale && !c.v_scale, "k_scale, v_scale: only with 8-bit caches (kv_code)");
    return;
  }
  FMHA_CHECK_ARG(c.k_scale, "k_scale: required with 8-bit caches");
  FMHA_CHECK_ARG(c.v_scale, "v_scale: required with 8-bit caches");
  const View &ks = *c.k_scale, &vs = *c.v_scale;
  for (const View* t : {&ks, &vs}) {
    expect_device(*t, c.dev);
    FMHA_CHECK_ARG(t->dtype.code == kDLFloat && t->dtype.bits == 32 && t->dtype.lanes == 1,
                   t->name, ": expected float32");
  }
  const bool dynamic = ks.ndim == 3;
  for (const View* t : {&ks, &vs}) {
    if (dynamic) {
      FMHA_CHECK_ARG(t->ndim == 3 && t->size(0) == slots && t->size(1) == rows &&
                         t->size(2) == p.heads_kv,
                     t->name, ": expected (", slots, ", ", rows, ", ", p.heads_kv,
                     ") per row and kv head, like k_scale");
      FMHA_CHECK_ARG(t->stride(0) == ks.stride(0) && t->stride(1) == ks.stride(1) &&
                         t->stride(2) == ks.stride(2),
                     t->name, ": expected k_scale's strides");
      for (int d = 0; d < 3; ++d)
        FMHA_CHECK_ARG(t->stride(d) != 0 || t->size(d) == 1, t->name,
                       ": per-row scales are written in place; a broadcast view cannot hold them");
      FMHA_CHECK_ARG(!(p.seqlen_new > 0 && t->read_only), t->name,
                     ": the array is read-only; the append writes the new rows' scales");
    } else {
      // Their values (finite, > 0) are checked where they can be read: by the CPU core
      // before it runs (fmha/kvcache.cpp), by the CUDA kernels on the device.
      FMHA_CHECK_ARG(t->ndim == 1 && t->size(0) == p.heads_kv, t->name, ": expected (",
                     p.heads_kv, ") per kv head, like k_scale");
    }
  }
  p.k_scale = static_cast<float*>(ks.data);
  p.v_scale = static_cast<float*>(vs.data);
  FMHA_CHECK_ARG(!dynamic || ks.data != vs.data,
                 "v_scale: the same array as k_scale; per-row scales need one array each");
  if (dynamic) {
    // A zero row stride marks static scales (kvq::scale_offset): a one-row cache's, which
    // only ever indexes row 0, gets 1.
    p.scale_batch_stride = ks.stride(0);
    p.scale_row_stride = ks.stride(1) != 0 ? ks.stride(1) : 1;
    p.scale_head_stride = ks.stride(2);
  } else {
    p.scale_batch_stride = p.scale_row_stride = 0;
    p.scale_head_stride = ks.stride(0);
  }
}

// q (b, sq, hq, d); caches (b, capacity, hkv, d|dv) or, with block_table (b, max_blocks),
// pools (num_blocks, block_size, hkv, d|dv); k_new, v_new (b, seqlen_new, hkv, d|dv) or
// None; cache_seqlens (b,) int32. The values of cache_seqlens and block_table are checked by
// the backend (host arrays: before anything is written, fmha/kvcache.h).
inline KvCacheCall kvcache_call(const py::object& q, const py::object& k_cache,
                                const py::object& v_cache, const py::object& out,
                                const py::object& lse, const py::object& k_new,
                                const py::object& v_new, const py::object& cache_seqlens,
                                const py::object& block_table, const py::object& alibi,
                                const py::object& k_scale, const py::object& v_scale,
                                const py::kwargs& kw) {
  const Settings s("forward_kvcache", kw, {FMHA_KVCACHE_KEYWORDS});
  KvCacheCall c;
  FwdParams& p = c.p;
  import_q(c, s, q);
  const int code = s.get<int>("kv_code", 0);
  FMHA_CHECK_ARG(code >= 0 && code <= 3, "kv_code: expected 0 (caches in q's dtype), 1 (int8), "
                 "2 (float8_e4m3fn) or 3 (float8_e5m2), got ", code);
  p.kv_code = KvCode(code);
  c.k = import("k_cache", k_cache, true, c.import_stream);
  c.v = import("v_cache", v_cache, true, c.import_stream);
  c.o = import("out", out, true, c.import_stream);
  c.lse = import("lse", lse, true, c.import_stream);
  c.cache_seqlens = import("cache_seqlens", cache_seqlens, false, c.import_stream);
  c.block_table = import_opt("block_table", block_table, false, c.import_stream);
  c.k_new = import_opt("k", k_new, false, c.import_stream);
  c.v_new = import_opt("v", v_new, false, c.import_stream);
  FMHA_CHECK_ARG(!c.k_new == !c.v_new, "k, v: give both new rows or neither");
  for (View* t : {&c.k, &c.v, &c.o, &c.lse, &*c.cache_seqlens}) expect_device(*t, c.dev);
  for (auto* t : {&c.block_table, &c.k_new, &c.v_new})
    if (*t) expect_device(**t, c.dev);

  p.dtype = float_dtype(c.q);
  FMHA_CHECK_ARG(c.q.ndim == 4, "q: expected 4 dimensions (batch, seqlen_q, heads_q, head_dim), got ",
                 c.q.ndim);
  FMHA_CHECK_ARG(c.k.ndim == 4 && c.v.ndim == 4, "k_cache, v_cache: expected 4 dimensions, got ",
                 c.k.ndim, " and ", c.v.ndim);
  p.batch = int(c.q.size(0));
  p.seqlen_q = int(c.q.size(1));
  p.heads_q = int(c.q.size(2));
  p.head_dim = int(c.q.size(3));
  p.heads_kv = int(c.k.size(2));
  p.head_dim_v = int(c.v.size(3));
  const int64_t slots = c.k.size(0), rows = c.k.size(1);  // sequences/blocks, rows of each
  expect_shape(c.q, {p.batch, p.seqlen_q, p.heads_q, p.head_dim});
  expect_shape(c.k, {slots, rows, p.heads_kv, p.head_dim});
  expect_shape(c.v, {slots, rows, p.heads_kv, p.head_dim_v});
  expect_shape(c.o, {p.batch, p.seqlen_q, p.heads_q, p.head_dim_v});
  expect_shape(c.lse, {p.batch, p.heads_q, p.seqlen_q});
  expect_dtype(c.o, p.dtype);
  if (p.kv_code == KvCode::kNone) {
    for (View* t : {&c.k, &c.v}) expect_dtype(*t, p.dtype);
  } else {
    // One-byte codes (fmha/kvquant.h): element strides count bytes.
    for (View* t : {&c.k, &c.v})
      FMHA_CHECK_ARG((t->dtype.code == kDLInt || t->dtype.code == kDLUInt) && t->dtype.bits == 8 &&
                         t->dtype.lanes == 1,
                     t->name, ": expected one-byte codes with kv_code ", code);
  }
  const bool f64 = p.dtype == DType::kFloat64;
  FMHA_CHECK_ARG(c.lse.dtype.code == kDLFloat && c.lse.dtype.bits == (f64 ? 64 : 32) &&
                     c.lse.dtype.lanes == 1,
                 "lse: expected ", f64 ? "float64" : "float32");
  expect_int32(*c.cache_seqlens, 1);
  FMHA_CHECK_ARG(c.cache_seqlens->size(0) == p.batch, "cache_seqlens: expected ", p.batch,
                 " entries (one per sequence), got ", c.cache_seqlens->size(0));
  if (c.block_table) {
    View& t = *c.block_table;
    expect_int32(t, 2);
    FMHA_CHECK_ARG(t.size(0) == p.batch, "block_table: expected ", p.batch,
                   " rows (one per sequence), got ", t.size(0));
    FMHA_CHECK_ARG(rows >= 1, "k_cache: block_size (dimension 1) must be >= 1 with a block_table");
    FMHA_CHECK_ARG(int64_t(t.size(1)) * rows <= INT32_MAX, "block_table: max_blocks * block_size (",
                   t.size(1), " * ", rows, ") exceeds 2**31 - 1 rows");
    p.block_table = static_cast<const int32_t*>(t.data);
    p.block_table_stride = t.stride(0);
    p.block_size = int(rows);
    FMHA_CHECK_ARG(slots <= INT32_MAX, "k_cache: more than 2**31 - 1 blocks");
    p.num_blocks = int(slots);
    p.seqlen_k = int(t.size(1) * rows);
  } else {
    FMHA_CHECK_ARG(slots == p.batch, "k_cache: dimension 0 is ", slots, ", expected batch = ",
                   p.batch, " (or pass block_table for a paged cache)");
    FMHA_CHECK_ARG(rows <= INT32_MAX, "k_cache: capacity exceeds 2**31 - 1 rows");
    p.seqlen_k = int(rows);
  }
  p.cache_seqlens = static_cast<const int32_t*>(c.cache_seqlens->data);
  if (c.k_new) {
    View &kn = *c.k_new, &vn = *c.v_new;
    FMHA_CHECK_ARG(kn.ndim == 4, "k: expected 4 dimensions (batch, seqlen_new, heads_kv, head_dim), got ", kn.ndim);
    p.seqlen_new = int(kn.size(1));
    expect_shape(kn, {p.batch, p.seqlen_new, p.heads_kv, p.head_dim});
    expect_shape(vn, {p.batch, p.seqlen_new, p.heads_kv, p.head_dim_v});
    expect_dtype(kn, p.dtype);
    expect_dtype(vn, p.dtype);
    p.k_new = kn.data;
    p.v_new = vn.data;
    p.k_new_batch_stride = kn.stride(0); p.k_new_row_stride = kn.stride(1); p.k_new_head_stride = kn.stride(2);
    p.v_new_batch_stride = vn.stride(0); p.v_new_row_stride = vn.stride(1); p.v_new_head_stride = vn.stride(2);
    FMHA_CHECK_ARG(p.seqlen_new <= p.seqlen_k, "k: ", p.seqlen_new,
                   " new rows do not fit a cache of capacity ", p.seqlen_k);
  }

  p.q = c.q.data; p.k = c.k.data; p.v = c.v.data; p.o = c.o.data; p.lse = c.lse.data;
  p.q_batch_stride = c.q.stride(0); p.q_row_stride = c.q.stride(1); p.q_head_stride = c.q.stride(2);
  p.k_batch_stride = c.k.stride(0); p.k_row_stride = c.k.stride(1); p.k_head_stride = c.k.stride(2);
  p.v_batch_stride = c.v.stride(0); p.v_row_stride = c.v.stride(1); p.v_head_stride = c.v.stride(2);
  p.o_batch_stride = c.o.stride(0); p.o_row_stride = c.o.stride(1); p.o_head_stride = c.o.stride(2);
  p.lse_batch_stride = c.lse.stride(0);
  p.lse_head_stride = c.lse.stride(1);
  p.lse_row_stride = c.lse.stride(2);

  import_alibi(c, alibi);
  import_kv_scales(c, k_scale, v_scale, slots, rows);
  p.scale = s.get<double>("scale");
  p.softcap = s.get<double>("softcap");
  p.window_left = s.get<int>("window_left");
  p.window_right = s.get<int>("window_right");
  p.bottom_right = true;
  p.num_threads = s.get<int>("num_threads", 0);
  p.num_splits = s.get<int>("num_splits", 0);
  return c;
}

// ------------------------------------------------------------------------ the signatures

// The arrays of one call, by position or by name; the other keywords are its settings.
// pybind11's own named parameters cost ~2-4 µs per call here: for every parameter it makes and
// compares a Python string (docs/cpu_kernels.md, "Small calls"). So forward, backward
// and forward_kvcache are registered as (*args, **kwargs) and bound here, with pointer
// compares on interned names (the names at a call site are interned): a call passing its
// arrays by position and its settings by name does no string work at all.
template <size_t N>
struct Signature {
  const char* fn;
  std::array<const char*, N> names;  // the arrays, in positional order
  size_t required;                   // the first `required` arrays must be given
  std::array<PyObject*, N> interned;  // the names as interned strings (held by the module)
};

template <size_t N>
Signature<N> make_signature(const char* fn, const std::array<const char*, N>& names,
                            size_t required) {
  Signature<N> sig{fn, names, required, {}};
  for (size_t i = 0; i < N; ++i) {
    sig.interned[i] = PyUnicode_InternFromString(names[i]);
    if (!sig.interned[i]) throw py::error_already_set();
  }
  return sig;
}

template <size_t N>
class ArrayArgs {
 public:
  ArrayArgs(const Signature<N>& sig, const py::args& args, const py::kwargs& kw)
      : settings_(kw) {
    if (args.size() > N)
      throw py::type_error(concat(sig.fn, ": takes at most ", N, " positional arguments (",
                                  args.size(), " given)"));
    for (size_t i = 0; i < args.size(); ++i) arrays_[i] = args[i];
    bool copied = false;
    for (auto item : kw) {
      PyObject* key = item.first.ptr();
      size_t i = 0;
      while (i < N && key != sig.interned[i]) ++i;
      if (i == N && !PyUnicode_CHECK_INTERNED(key)) {  // a name built at run time
        i = 0;
        while (i < N && PyUnicode_CompareWithASCIIString(key, sig.names[i]) != 0) ++i;
      }
      if (i == N) continue;  // a setting
      if (arrays_[i])
        throw py::type_error(concat(sig.fn, ": got multiple values for argument '",
                                    sig.names[i], "'"));
      arrays_[i] = py::reinterpret_borrow<py::object>(item.second);
      if (!copied) {  // the settings without the arrays given by name
        PyObject* copy = PyDict_Copy(kw.ptr());
        if (!copy) throw py::error_already_set();
        settings_ = py::reinterpret_steal<py::kwargs>(copy);
        copied = true;
      }
      if (PyDict_DelItem(settings_.ptr(), key) != 0) throw py::error_already_set();
    }
    for (size_t i = 0; i < N; ++i) {
      if (!arrays_[i] && i < sig.required)
        throw py::type_error(concat(sig.fn, ": missing required argument '", sig.names[i],
                                    "'"));
      if (!arrays_[i]) arrays_[i] = py::none();
    }
  }
  const py::object& operator[](size_t i) const { return arrays_[i]; }
  const py::kwargs& settings() const { return settings_; }

 private:
  std::array<py::object, N> arrays_{};
  py::kwargs settings_;
};

template <size_t N, typename Fn, size_t... I>
decltype(auto) call_with_arrays(const Fn& fn, const ArrayArgs<N>& a, std::index_sequence<I...>) {
  return fn(a[I]..., a.settings());
}

// Registers fn(array_0, ..., array_{N-1}, settings) as `name`: the first `required` arrays
// are required, the rest default to None. The docstring starts with that signature. Each
// function binds against its own names (the lambda holds its Signature).
template <size_t N, typename Fn>
void def_with_arrays(py::module_& m, const char* name, const std::array<const char*, N>& names,
                     size_t required, Fn fn, const char* doc) {
  static std::forward_list<std::string> docs;  // docstrings live as long as the module
  std::string text = concat(name, "(");
  for (size_t i = 0; i < N; ++i)
    text += concat(i ? ", " : "", names[i], i < required ? "" : "=None");
  docs.push_front(concat(text, ", **settings)\n\n", doc));
  m.def(
      name,
      [sig = make_signature(name, names, required), fn](const py::args& args,
                                                         const py::kwargs& kw) {
        return call_with_arrays(fn, ArrayArgs<N>(sig, args, kw), std::make_index_sequence<N>{});
      },
      docs.front().c_str());
}

inline constexpr std::array<const char*, 15> kForwardArrays = {
    "q", "k", "v", "out", "lse", "bias", "mask", "alibi_slopes", "cu_seqlens_q", "cu_seqlens_k",
    "block_index", "block_masks", "q_descale", "k_descale", "v_descale"};
inline constexpr std::array<const char*, 18> kBackwardArrays = {
    "dout", "q", "k", "v", "out", "lse", "dq", "dk", "dv", "dbias", "bias", "mask",
    "alibi_slopes", "cu_seqlens_q", "cu_seqlens_k", "dlse", "block_index", "block_masks"};
inline constexpr std::array<const char*, 12> kKvcacheArrays = {
    "q", "k_cache", "v_cache", "out", "lse", "k", "v", "cache_seqlens", "block_table",
    "alibi_slopes", "k_scale", "v_scale"};

// forward and backward with fmha._C's signature: the arrays by position or name, the
// settings as keywords (FMHA_FORWARD_KEYWORDS). Both modules define them through this.
template <typename Forward, typename Backward>
void def_forward_backward(py::module_& m, Forward forward, Backward backward,
                          const char* forward_doc, const char* backward_doc) {
  def_with_arrays(m, "forward", kForwardArrays, 4, forward, forward_doc);
  def_with_arrays(m, "backward", kBackwardArrays, 9, backward, backward_doc);
}

// forward_kvcache with fmha._C's signature (the arrays by position or name, the settings as
// keywords: FMHA_KVCACHE_KEYWORDS). Both modules define it through this.
template <typename ForwardKvcache>
void def_forward_kvcache(py::module_& m, ForwardKvcache fn, const char* doc) {
  def_with_arrays(m, "forward_kvcache", kKvcacheArrays, 5, fn, doc);
}

// The exception translation both modules install: the core's error types become the Python
// exceptions the Python layer documents.
inline void register_errors() {
  py::register_exception_translator([](std::exception_ptr e) {
    try {
      if (e) std::rethrow_exception(e);
    } catch (const InvalidArgument& err) {
      PyErr_SetString(PyExc_ValueError, err.what());
    } catch (const Unsupported& err) {
      PyErr_SetString(PyExc_NotImplementedError, err.what());
    }
  });
}

}  // namespace bind
}  // namespace fmha
