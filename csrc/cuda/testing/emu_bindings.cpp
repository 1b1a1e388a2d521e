// fmha._cuda_emu: fmha's CUDA kernels compiled as host C++ and run by the SIMT emulator
// (cuda/emu/cuda_emu.h), on host arrays. For tests: the same cases that check the CPU
// backend run the CUDA kernels here, in CI, without a GPU.
//
// Arrays come in through DLPack (torch, NumPy, ...: anything with __dlpack__) and must be
// in host memory; results are returned as new NumPy arrays. This file knows the kernels only
// through their host interfaces (testing/gemm_tc.h, testing/probes.h, flash_fwd.h,
// flash_bwd.h). Test-only: fmha's installed CUDA library contains none of this folder.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <string>
#include <utility>

#include "bindings/dlpack_view.h"
#include "bindings/params_from_dlpack.h"
#include "fmha/validate.h"
#include "cuda/emu/runtime.h"
#include "cuda/flash_bwd.h"
#include "cuda/flash_decode.h"
#include "cuda/flash_fwd.h"
#include "cuda/testing/gemm_tc.h"
#include "cuda/testing/probes.h"
#include "dlpack/dlpack.h"
#include "fmha/error.h"
#include "fmha/params.h"

namespace py = pybind11;

namespace {

// A borrowed view of a DLPack tensor (bindings/dlpack_view.h), here required to be in host
// memory and to have at most max_ndim dimensions.
using HostArray = fmha::View;

HostArray import_host(const char* name, const py::handle& obj, int max_ndim = 2,
                      bool writable = false) {
  HostArray a = fmha::import(name, obj, writable);
  FMHA_CHECK_ARG(a.device.device_type == kDLCPU || a.device.device_type == kDLCUDAHost,
                 name, ": the emulator runs on host memory (device type ",
                 int(a.device.device_type), ")");
  FMHA_CHECK_ARG(a.ndim <= max_ndim, name, ": expected 1 to ", max_ndim, " dimensions, got ",
                 a.ndim);
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

// out, lse <- attention(q, k, v) by the FlashAttention-2 forward kernel (cuda/flash_fwd.cuh).
// Layout (batch, seqlen, heads, head_dim), any strides with a contiguous last dimension;
// lse (batch, heads_q, seqlen_q) float32. Fills the one FwdParams every backend takes.
// bias / mask: 4-D (batch|1, heads_q|1, seqlen_q|1, seqlen_k|1) (size-1 dimensions broadcast);
// alibi_slopes: float64 (heads_q,) or (batch, heads_q).
fmha::Broadcast4 import_broadcast(const char* name, const HostArray& a, const fmha::FwdParams& p) {
  FMHA_CHECK_ARG(a.ndim == 4, name, ": expected 4 dimensions (batch, heads_q, seqlen_q, seqlen_k)");
  const int64_t full[4] = {p.batch, p.heads_q, p.seqlen_q, p.seqlen_k};
  int64_t st[4];
  for (int i = 0; i < 4; ++i) {
    FMHA_CHECK_ARG(a.shape[size_t(i)] == full[i] || a.shape[size_t(i)] == 1, name,
                   ": dimension ", i, " is ", a.shape[size_t(i)], ", expected ", full[i], " or 1");
    st[i] = a.shape[size_t(i)] == 1 ? 0 : a.strides[size_t(i)];  // broadcast: stride 0
  }
  fmha::Broadcast4 b;
  b.ptr = a.data;
  b.batch_stride = st[0], b.head_stride = st[1], b.row_stride = st[2], b.col_stride = st[3];
  return b;
}

// The options every flash_forward variant shares: fills them into p and runs the kernel.
template <typename Launch>
int finish_and_launch_with(fmha::FwdParams& p, Launch&& launch, const py::object& scale, int window_left,
                       int window_right, bool bottom_right, double softcap,
                       const py::object& bias_obj, const py::object& mask_obj,
                       const py::object& alibi_obj, double dropout_p, uint64_t seed,
                       uint64_t offset) {
  p.scale = scale.is_none() ? 1.0 / std::sqrt(double(p.head_dim)) : scale.cast<double>();
  p.window_left = window_left;
  p.window_right = window_right;
  p.bottom_right = bottom_right;
  p.softcap = softcap;
  p.dropout_p = dropout_p;
  p.seed = seed;
  p.offset = offset;
  HostArray bias, mask, alibi;  // keep the producers' memory alive through the launch
  if (!bias_obj.is_none()) {
    bias = import_host("bias", bias_obj, 4);
    p.bias = import_broadcast("bias", bias, p);
    FMHA_CHECK_ARG(bias.dtype.lanes == 1 && (bias.dtype.code == kDLFloat || bias.dtype.code == kDLBfloat),
                   "bias: expected a float dtype");
    if (bias.dtype.code == kDLBfloat && bias.dtype.bits == 16) p.bias.dtype = fmha::DType::kBFloat16;
    else if (bias.dtype.code == kDLFloat && bias.dtype.bits == 16) p.bias.dtype = fmha::DType::kFloat16;
    else if (bias.dtype.code == kDLFloat && bias.dtype.bits == 32) p.bias.dtype = fmha::DType::kFloat32;
    else if (bias.dtype.code == kDLFloat && bias.dtype.bits == 64) p.bias.dtype = fmha::DType::kFloat64;
    else throw fmha::InvalidArgument("bias: expected float16, bfloat16, float32 or float64");
  }
  if (!mask_obj.is_none()) {
    mask = import_host("mask", mask_obj, 4);
    p.mask = import_broadcast("mask", mask, p);
    FMHA_CHECK_ARG((mask.dtype.code == kDLBool || mask.dtype.code == kDLUInt) &&
                       mask.dtype.bits == 8 && mask.dtype.lanes == 1,
                   "mask: expected bool (or uint8)");
  }
  if (!alibi_obj.is_none()) {
    alibi = import_host("alibi_slopes", alibi_obj, 2);
    FMHA_CHECK_ARG(alibi.dtype.code == kDLFloat && alibi.dtype.bits == 64,
                   "alibi_slopes: expected float64");
    if (alibi.ndim == 1) {
      FMHA_CHECK_ARG(alibi.shape[0] == p.heads_q, "alibi_slopes: expected (heads_q,) or (batch, heads_q)");
      p.alibi_batch_stride = 0, p.alibi_head_stride = alibi.strides[0];
    } else {
      FMHA_CHECK_ARG(alibi.shape[0] == p.batch && alibi.shape[1] == p.heads_q,
                     "alibi_slopes: expected (heads_q,) or (batch, heads_q)");
      p.alibi_batch_stride = alibi.strides[0], p.alibi_head_stride = alibi.strides[1];
    }
    p.alibi_slopes = static_cast<const double*>(alibi.data);
  }
  py::gil_scoped_release nogil;
  return launch();
}

template <typename... A>
int finish_and_launch(fmha::FwdParams& p, A&&... a) {
  return finish_and_launch_with(p, [&] { return fmha::gpu::launch_flash_fwd(p, nullptr); }, a...);
}

// Dense: q (b, sq, hq, d), k/v (b, sk, hkv, d), out like q, lse (b, hq, sq). Varlen (cu_seqlens
// given): q (total_q, hq, d), k/v (total_k, hkv, d), out like q, lse (hq, total_q), with
// max_seqlen_q/k (default: computed from cu_seqlens). Returns the number of key splits used.
int flash_forward(const py::object& q_obj, const py::object& k_obj, const py::object& v_obj,
                  const py::object& out_obj, const py::object& lse_obj, const py::object& scale,
                  int window_left, int window_right, bool bottom_right, double softcap,
                  const py::object& bias_obj, const py::object& mask_obj,
                  const py::object& alibi_obj, double dropout_p, uint64_t seed, uint64_t offset,
                  const py::object& cu_q_obj, const py::object& cu_k_obj, int max_seqlen_q,
                  int max_seqlen_k, int num_splits) {
  const bool varlen = !cu_q_obj.is_none() || !cu_k_obj.is_none();
  FMHA_CHECK_ARG(cu_q_obj.is_none() == cu_k_obj.is_none(),
                 "cu_seqlens_q, cu_seqlens_k: give both or neither");
  const int nd = varlen ? 3 : 4;
  const HostArray q = import_host("q", q_obj, nd), k = import_host("k", k_obj, nd),
                  v = import_host("v", v_obj, nd), o = import_host("out", out_obj, nd, true),
                  lse = import_host("lse", lse_obj, varlen ? 2 : 3, true);
  FMHA_CHECK_ARG(q.ndim == nd && k.ndim == nd && v.ndim == nd && o.ndim == nd, "q, k, v, out: expected ",
                 varlen ? "3-D (total, heads, head_dim) arrays (varlen)"
                        : "4-D (batch, seqlen, heads, head_dim) arrays");
  FMHA_CHECK_ARG(lse.ndim == (varlen ? 2 : 3), "lse: expected ",
                 varlen ? "a 2-D (heads_q, total_q) array" : "a 3-D (batch, heads_q, seqlen_q) array");
  const fmha::DType dtype = half_dtype(q, "q");
  FMHA_CHECK_ARG(half_dtype(k, "k") == dtype && half_dtype(v, "v") == dtype &&
                     half_dtype(o, "out") == dtype,
                 "k, v, out: dtype differs from q's");
  FMHA_CHECK_ARG(lse.dtype.code == kDLFloat && lse.dtype.bits == 32 && lse.dtype.lanes == 1,
                 "lse: expected float32");
  // Dense arrays are viewed as (batch, seqlen, heads, dim); varlen ones as (1, total, heads, dim).
  const int x = varlen ? 0 : 1;  // index of the seqlen dimension
  auto dim = [&](const HostArray& a, int i) { return a.shape[size_t(i - 1 + x)]; };
  auto stride = [&](const HostArray& a, int i) { return a.strides[size_t(i - 1 + x)]; };
  fmha::FwdParams p;
  p.batch = varlen ? 0 : int(q.shape[0]);
  p.seqlen_q = int(dim(q, 1));
  p.heads_q = int(dim(q, 2));
  p.head_dim = int(dim(q, 3));
  p.seqlen_k = int(dim(k, 1));
  p.heads_kv = int(dim(k, 2));
  p.head_dim_v = int(dim(v, 3));
  const int64_t total_q = p.seqlen_q, total_k = p.seqlen_k;
  auto same = [&](const HostArray& a, std::array<int64_t, 4> want) {
    for (int i = varlen ? 1 : 0; i < 4; ++i)
      if (dim(a, i) != want[size_t(i)]) return false;
    return true;
  };
  FMHA_CHECK_ARG(same(k, {p.batch, p.seqlen_k, p.heads_kv, p.head_dim}),
                 "k: expected shape (batch, seqlen_k, heads_kv, head_dim) matching q");
  FMHA_CHECK_ARG(same(v, {p.batch, p.seqlen_k, p.heads_kv, p.head_dim_v}),
                 "v: expected shape (batch, seqlen_k, heads_kv, head_dim_v) matching k");
  FMHA_CHECK_ARG(same(o, {p.batch, p.seqlen_q, p.heads_q, p.head_dim_v}),
                 "out: expected shape (batch, seqlen_q, heads_q, head_dim_v)");
  if (varlen) {
    FMHA_CHECK_ARG(lse.shape[0] == p.heads_q && lse.shape[1] == total_q,
                   "lse: expected shape (heads_q, total_q) = (", p.heads_q, ", ", total_q, ")");
  } else {
    FMHA_CHECK_ARG(lse.shape[0] == p.batch && lse.shape[1] == p.heads_q && lse.shape[2] == p.seqlen_q,
                   "lse: expected shape (batch, heads_q, seqlen_q)");
  }
  for (const HostArray* a : {&q, &k, &v, &o})
    FMHA_CHECK_ARG(a->strides[size_t(a->ndim - 1)] == 1 || a->shape[size_t(a->ndim - 1)] == 1,
                   "q, k, v, out: the last dimension must be contiguous");
  HostArray cu_q, cu_k;
  if (varlen) {
    cu_q = import_host("cu_seqlens_q", cu_q_obj, 1);
    cu_k = import_host("cu_seqlens_k", cu_k_obj, 1);
    for (const HostArray* c : {&cu_q, &cu_k})
      FMHA_CHECK_ARG(c->dtype.code == kDLInt && c->dtype.bits == 32 && c->ndim == 1 &&
                         c->strides[0] == 1,
                     "cu_seqlens: expected contiguous 1-D int32 arrays");
    FMHA_CHECK_ARG(cu_q.shape[0] == cu_k.shape[0] && cu_q.shape[0] >= 2,
                   "cu_seqlens_q, cu_seqlens_k: expected the same length batch + 1 >= 2, got ",
                   cu_q.shape[0], " and ", cu_k.shape[0]);
    const auto* cq = static_cast<const int32_t*>(cu_q.data);
    const auto* ck = static_cast<const int32_t*>(cu_k.data);
    p.batch = int(cu_q.shape[0] - 1);
    int longest_q = 0, longest_k = 0;
    for (int b = 0; b < p.batch; ++b) {
      FMHA_CHECK_ARG(cq[b + 1] >= cq[b] && ck[b + 1] >= ck[b],
                     "cu_seqlens: expected non-decreasing offsets (sequence ", b, ")");
      longest_q = std::max(longest_q, cq[b + 1] - cq[b]);
      longest_k = std::max(longest_k, ck[b + 1] - ck[b]);
    }
    FMHA_CHECK_ARG(cq[0] == 0 && ck[0] == 0 && cq[p.batch] == total_q && ck[p.batch] == total_k,
                   "cu_seqlens: expected 0 .. total rows (", total_q, " queries, ", total_k,
                   " keys), got ", cq[0], " .. ", cq[p.batch], " and ", ck[0], " .. ",
                   ck[p.batch]);
    p.seqlen_q = max_seqlen_q < 0 ? longest_q : max_seqlen_q;
    p.seqlen_k = max_seqlen_k < 0 ? longest_k : max_seqlen_k;
    FMHA_CHECK_ARG(p.seqlen_q >= longest_q && p.seqlen_k >= longest_k,
                   "max_seqlen_q, max_seqlen_k: got ", p.seqlen_q, ", ", p.seqlen_k,
                   ", below the longest sequences ", longest_q, ", ", longest_k);
    p.cu_seqlens_q = cq;
    p.cu_seqlens_k = ck;
    p.total_q = int(total_q);
    p.total_k = int(total_k);
  }
  p.num_splits = num_splits;
  p.dtype = dtype;
  p.q = q.data;
  p.k = k.data;
  p.v = v.data;
  p.o = const_cast<void*>(o.data);
  p.lse = const_cast<void*>(lse.data);
  if (!varlen) {
    p.q_batch_stride = q.strides[0], p.k_batch_stride = k.strides[0];
    p.v_batch_stride = v.strides[0], p.o_batch_stride = o.strides[0];
    p.lse_batch_stride = lse.strides[0];
  }
  p.q_row_stride = stride(q, 1), p.q_head_stride = stride(q, 2);
  p.k_row_stride = stride(k, 1), p.k_head_stride = stride(k, 2);
  p.v_row_stride = stride(v, 1), p.v_head_stride = stride(v, 2);
  p.o_row_stride = stride(o, 1), p.o_head_stride = stride(o, 2);
  p.lse_head_stride = lse.strides[size_t(lse.ndim - 2)];
  p.lse_row_stride = lse.strides[size_t(lse.ndim - 1)];
  return finish_and_launch(p, scale, window_left, window_right, bottom_right, softcap, bias_obj,
                           mask_obj, alibi_obj, dropout_p, seed, offset);
}

// dq, dk, dv (and dbias) <- the CUDA FlashAttention-2 backward (cuda/flash_bwd.cuh), emulated,
// from the forward's out and lse. Same layouts and options as flash_forward; dbias float32,
// shaped like the (broadcast) bias before expansion.
void flash_backward(const py::object& dout_obj, const py::object& q_obj, const py::object& k_obj,
                    const py::object& v_obj, const py::object& out_obj, const py::object& lse_obj,
                    const py::object& dq_obj, const py::object& dk_obj, const py::object& dv_obj,
                    const py::object& dbias_obj, bool deterministic, const py::object& scale,
                    int window_left, int window_right, bool bottom_right, double softcap,
                    const py::object& bias_obj, const py::object& mask_obj,
                    const py::object& alibi_obj, double dropout_p, uint64_t seed, uint64_t offset) {
  const HostArray q = import_host("q", q_obj, 4), k = import_host("k", k_obj, 4),
                  v = import_host("v", v_obj, 4), o = import_host("out", out_obj, 4),
                  lse = import_host("lse", lse_obj, 3), dO = import_host("dout", dout_obj, 4),
                  dq = import_host("dq", dq_obj, 4, true), dk = import_host("dk", dk_obj, 4, true),
                  dv = import_host("dv", dv_obj, 4, true);
  fmha::BwdParams p;
  p.dtype = half_dtype(q, "q");
  p.batch = int(q.shape[0]); p.seqlen_q = int(q.shape[1]); p.heads_q = int(q.shape[2]);
  p.head_dim = int(q.shape[3]); p.seqlen_k = int(k.shape[1]); p.heads_kv = int(k.shape[2]);
  p.head_dim_v = int(v.shape[3]);
  p.q = q.data; p.k = k.data; p.v = v.data; p.o = const_cast<void*>(o.data);
  p.lse = const_cast<void*>(lse.data); p.dout = dO.data;
  p.dq = const_cast<void*>(dq.data); p.dk = const_cast<void*>(dk.data); p.dv = const_cast<void*>(dv.data);
  p.q_batch_stride = q.strides[0], p.q_row_stride = q.strides[1], p.q_head_stride = q.strides[2];
  p.k_batch_stride = k.strides[0], p.k_row_stride = k.strides[1], p.k_head_stride = k.strides[2];
  p.v_batch_stride = v.strides[0], p.v_row_stride = v.strides[1], p.v_head_stride = v.strides[2];
  p.o_batch_stride = o.strides[0], p.o_row_stride = o.strides[1], p.o_head_stride = o.strides[2];
  p.do_batch_stride = dO.strides[0], p.do_row_stride = dO.strides[1], p.do_head_stride = dO.strides[2];
  p.dq_batch_stride = dq.strides[0], p.dq_row_stride = dq.strides[1], p.dq_head_stride = dq.strides[2];
  p.dk_batch_stride = dk.strides[0], p.dk_row_stride = dk.strides[1], p.dk_head_stride = dk.strides[2];
  p.dv_batch_stride = dv.strides[0], p.dv_row_stride = dv.strides[1], p.dv_head_stride = dv.strides[2];
  p.lse_batch_stride = lse.strides[0], p.lse_head_stride = lse.strides[1];
  p.lse_row_stride = lse.strides[2];
  p.deterministic = deterministic;
  HostArray db;
  if (!dbias_obj.is_none()) {
    db = import_host("dbias", dbias_obj, 4, true);
    p.dbias = const_cast<void*>(db.data);
    p.dbias_batch = int(db.shape[0]); p.dbias_heads = int(db.shape[1]);
    p.dbias_rows = int(db.shape[2]); p.dbias_cols = int(db.shape[3]);
  }
  finish_and_launch_with(p, [&] { fmha::gpu::launch_flash_bwd(p, nullptr); return 0; }, scale,
                         window_left, window_right, bottom_right, softcap, bias_obj, mask_obj,
                         alibi_obj, dropout_p, seed, offset);
}

}  // namespace

// ---- forward / backward: fmha._C's signature, run by the emulated CUDA kernels ----------
//
// The same filler as fmha._C (bindings/params_from_dlpack.h), so that swapping fmha._C for
// this module under the Python API (tests/kernels/test_cuda_emu_cases.py) runs the CUDA kernels on
// exactly the params the real launch would get; only the memory differs (host arrays here).
namespace {

void expect_half(const fmha::FwdParams& p) {
  if (fmha::takes_input_dtype(fmha::Backend::kCuda, p.dtype)) return;
  throw fmha::Unsupported(fmha::concat("q: dtype ", fmha::dtype_name(p.dtype), ": the CUDA kernels take ",
                                       fmha::dtype_list(fmha::caps(fmha::Backend::kCuda))));
}

// The launchers check the params against the validation contract (fmha/validate.h).
template <typename Params, typename Launch>
void launch_emulated(const Params& p, Launch&& launch) {
  expect_half(p);
  py::gil_scoped_release nogil;
  launch(p, nullptr);
}

void emu_forward(py::object q, py::object k, py::object v, py::object out, py::object lse,
                 py::object bias, py::object mask, py::object alibi, py::object cu_q,
                 py::object cu_k, py::object block_index, py::object block_masks,
                 py::object q_descale, py::object k_descale, py::object v_descale,
                 py::kwargs kw) {
  auto c = fmha::bind::forward_call(q, k, v, out, lse, bias, mask, alibi, cu_q, cu_k, kw,
                                    /*host_only=*/true);
  fmha::bind::fill_block_mask(c, block_index, block_masks);
  fmha::bind::fill_descales(c, q_descale, k_descale, v_descale);
  launch_emulated(c.p, [](const fmha::FwdParams& p, void* s) { fmha::gpu::launch_flash_fwd(p, s); });
}

// fmha._C.forward_kvcache's signature, run by the emulated CUDA decode (launch_flash_decode):
// the lengths and block table are not read on the host, as with CUDA arrays. Returns the
// number of key splits over the capacity.
int emu_forward_kvcache(py::object q, py::object k_cache, py::object v_cache, py::object out,
                        py::object lse, py::object k, py::object v, py::object cache_seqlens,
                        py::object block_table, py::object alibi, py::object k_scale,
                     py::object v_scale, py::kwargs kw) {
  const auto c = fmha::bind::kvcache_call(q, k_cache, v_cache, out, lse, k, v, cache_seqlens,
                                          block_table, alibi, k_scale, v_scale, kw);
  int splits = 0;
  launch_emulated(c.p, [&](const fmha::FwdParams& p, void* s) {
    splits = fmha::gpu::launch_flash_decode(p, s);
  });
  return splits;
}

void emu_backward(py::object dout, py::object q, py::object k, py::object v, py::object out,
                  py::object lse, py::object dq, py::object dk, py::object dv,
                  py::object dbias, py::object bias, py::object mask, py::object alibi,
                  py::object cu_q, py::object cu_k, py::object dlse, py::object block_index,
                  py::object block_masks, py::kwargs kw) {
  auto c = fmha::bind::backward_call(dout, q, k, v, out, lse, dq, dk, dv, dbias, bias, mask,
                                     alibi, cu_q, cu_k, dlse, kw, /*host_only=*/true);
  fmha::bind::fill_block_mask(c, block_index, block_masks);
  launch_emulated(c.p, [](const fmha::BwdParams& p, void* s) { fmha::gpu::launch_flash_bwd(p, s); });
}

}  // namespace

PYBIND11_MODULE(_cuda_emu, m) {
  m.doc() =
      "fmha's CUDA kernels run on the CPU by the SIMT emulator (for tests; see "
      "csrc/cuda/emu/cuda_emu.h)";
  fmha::bind::register_errors();  // InvalidArgument -> ValueError, Unsupported -> NotImplementedError
  m.def("gemm", &gemm, py::arg("a"), py::arg("b"),
        "C = A @ B by the tensor-core GEMM kernel (ldmatrix + mma.sync + cp.async), emulated. "
        "a: (M, K), b: (K, N), float16 or bfloat16, last dimension contiguous. Returns float32 "
        "(M, N).");
  struct Conversion {
    const char* name;
    fmha::DType to;
    const char* doc;
  };
  for (const Conversion& c :
       {Conversion{"float_to_half_bits", fmha::DType::kFloat16,
                   "Bits of the kernels' float->float16 conversion (cvt.rn.f16.f32) of x."},
        Conversion{"float_to_bfloat16_bits", fmha::DType::kBFloat16,
                   "Bits of the kernels' float->bfloat16 conversion (cvt.rn.bf16.f32) of x."}}) {
    m.def(c.name,
          [to = c.to](const py::array_t<float, py::array::c_style | py::array::forcecast>& x) {
            return convert(x, to);
          },
          py::arg("x"), c.doc);
  }
  m.def("flash_forward", &flash_forward, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("out"), py::arg("lse"), py::kw_only(), py::arg("scale") = py::none(),
        py::arg("window_left") = -1, py::arg("window_right") = -1,
        py::arg("bottom_right") = true, py::arg("softcap") = 0.0, py::arg("bias") = py::none(),
        py::arg("mask") = py::none(), py::arg("alibi_slopes") = py::none(),
        py::arg("dropout_p") = 0.0, py::arg("seed") = 0, py::arg("offset") = 0,
        py::arg("cu_seqlens_q") = py::none(), py::arg("cu_seqlens_k") = py::none(),
        py::arg("max_seqlen_q") = -1, py::arg("max_seqlen_k") = -1, py::arg("num_splits") = 0,
        "out, lse <- attention(q, k, v) by the FlashAttention-2 forward kernel (mma.sync + "
        "ldmatrix + cp.async), emulated. q (b, sq, hq, d), k/v (b, sk, hkv, d), out like q, "
        "lse (b, hq, sq) float32; float16 or bfloat16. Window (left, right): query i sees key "
        "j iff i + off - left <= j <= i + off + right (negative: unbounded), off = sk - sq if "
        "bottom_right else 0; causal is window_right = 0. softcap, bias / mask (4-D, size-1 "
        "dimensions broadcast; mask True = may attend), alibi_slopes (float64), dropout_p with "
        "(seed, offset): as fmha.reference.attention_forward. Varlen: cu_seqlens_q/k (int32, "
        "batch + 1), q (total_q, hq, d), k/v (total_k, hkv, d), lse (hq, total_q), max_seqlen_q/k "
        "(-1: the longest sequence). num_splits: key splits (0 = by occupancy, 1 = none). "
        "Returns the number of splits used.");
  m.def("forward_kernel", [] { return std::string(fmha::gpu::flash_fwd_take_last_kernel()); },
        "The forward kernel of this thread's last flash_forward since the previous ask: \"sm90\" "
        "(cuda/flash_fwd_sm90.cuh, run under FMHA_CUDA_KERNEL=sm90 for the calls it claims), "
        "\"sm80\", or \"\" (none).");
  m.def("flash_backward", &flash_backward, py::arg("dout"), py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("dq"), py::arg("dk"), py::arg("dv"),
        py::kw_only(), py::arg("dbias") = py::none(), py::arg("deterministic") = false,
        py::arg("scale") = py::none(), py::arg("window_left") = -1, py::arg("window_right") = -1,
        py::arg("bottom_right") = true, py::arg("softcap") = 0.0, py::arg("bias") = py::none(),
        py::arg("mask") = py::none(), py::arg("alibi_slopes") = py::none(),
        py::arg("dropout_p") = 0.0, py::arg("seed") = 0, py::arg("offset") = 0);
  m.def("stats", [] {
    // Python's name for each counter is its field name.
#define FMHA_EMU_STAT(field) {#field, &emu::Stats::field}
    static const std::pair<const char*, uint64_t emu::Stats::*> kCounters[] = {
        FMHA_EMU_STAT(launches), FMHA_EMU_STAT(blocks), FMHA_EMU_STAT(threads),
        FMHA_EMU_STAT(block_barriers), FMHA_EMU_STAT(warp_barriers), FMHA_EMU_STAT(mma),
        FMHA_EMU_STAT(ldmatrix), FMHA_EMU_STAT(shfl), FMHA_EMU_STAT(ballot),
        FMHA_EMU_STAT(cp_async), FMHA_EMU_STAT(cp_async_zero_filled),
        FMHA_EMU_STAT(max_cp_async_groups_pending), FMHA_EMU_STAT(scratch_peak_bytes)};
#undef FMHA_EMU_STAT
    const emu::Stats s = emu::stats();
    py::dict d;
    for (const auto& [name, field] : kCounters) d[name] = s.*field;
    return d;
  }, "Counters of emulated operations since the last reset_stats() (per thread / warp op).");
  m.def("reset_stats", &emu::reset_stats);
  m.def("traffic", [] {
    py::list rows;
    for (const emu::KernelTraffic& k : emu::traffic()) {
      py::dict d;
      d["kernel"] = k.kernel;
      d["launches"] = k.launches;
      d["ldmatrix_requests"] = k.ldmatrix_requests;
      d["ldmatrix_wavefronts"] = k.ldmatrix_wavefronts;
      d["ldmatrix_ideal_wavefronts"] = k.ldmatrix_ideal_wavefronts;
      d["cp_async_requests"] = k.cp_async_requests;
      d["cp_async_wavefronts"] = k.cp_async_wavefronts;
      d["cp_async_ideal_wavefronts"] = k.cp_async_ideal_wavefronts;
      d["cp_async_global_sectors"] = k.cp_async_global_sectors;
      d["cp_async_global_bytes"] = k.cp_async_global_bytes;
      d["wgmma_requests"] = k.wgmma_requests;
      d["wgmma_wavefronts"] = k.wgmma_wavefronts;
      d["wgmma_ideal_wavefronts"] = k.wgmma_ideal_wavefronts;
      d["tma_requests"] = k.tma_requests;
      d["tma_wavefronts"] = k.tma_wavefronts;
      d["tma_ideal_wavefronts"] = k.tma_ideal_wavefronts;
      rows.append(d);
    }
    return rows;
  }, "Memory traffic per kernel since the last reset_stats(): shared-memory wavefronts of "
     "ldmatrix, of cp.async stores, of wgmma operand reads and of TMA tile copies (and the "
     "conflict-free ideal), global sectors and bytes of cp.async reads (csrc/cuda/emu/runtime.h, KernelTraffic, says how each is counted).");
  fmha::bind::def_forward_kvcache(
      m, &emu_forward_kvcache,
      "fmha._C.forward_kvcache's signature and keyword settings, on host float16/bfloat16 "
      "arrays, run by the emulated CUDA decode (launch_flash_decode: device-side checks, "
      "append, split-KV attention, combine). The arrays stand for GPU memory: cache_seqlens "
      "and block_table are not read on the host. Returns the number of key splits.");
  m.def("kvcache_refusals", &fmha::gpu::kvcache_refusals, py::arg("clear") = true,
        "The KvCacheRefusal bits (1 length < 0, 2 over capacity, 4 block out of range, 8 block "
        "appended to and used through another entry, 16 static scale not finite and > 0) of "
        "refused forward_kvcache calls since the last clear.");
  fmha::bind::def_forward_backward(
      m, &emu_forward, &emu_backward,
      "fmha._C.forward's signature and keyword settings, on host float16/bfloat16 arrays, "
      "run by the emulated CUDA forward (launch_flash_fwd). num_threads and stream are "
      "accepted and ignored. The arrays stand for GPU memory: cu_seqlens are not read on the "
      "host (max_seqlen_q/k required), as with CUDA arrays in fmha._C.",
      "fmha._C.backward's signature and keyword settings (deterministic included), on host "
      "float16/bfloat16 arrays, run by the emulated CUDA backward (launch_flash_bwd); "
      "cu_seqlens as in forward.");
}
