// The FlashAttention-2 backward kernels (csrc/cuda/flash_bwd.cuh) against a float64
// reference, built plainly, with AddressSanitizer and with the race checker: exactly sized
// buffers (tails, padded head dims, varlen packing), the cp.async double buffer of Q/dO, the
// dS^T tile shared between warps for dQ, float32 atomics, the deterministic dQ kernel and the
// dbias kernel (its one-row reduction through shared memory).
// The numerical sweep against fmha.reference is tests/kernels/test_cuda_backward_emu.py and
// tests/kernels/test_cuda_emu_cases.py; these cases cover the code paths under the sanitizers.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda/emu/runtime.h"
#include "cuda/flash_bwd.h"
#include "cuda/flash_fwd.h"
#include "cuda/primitives.cuh"
#include "emu_test.h"

using namespace fmha::gpu;
using emu_test::fail;
using emu_test::pass;
using emu_test::Result;

namespace {

struct BwdCase {
  int batch, sq, sk, hq, hkv, d;
  int left, right;
  bool deterministic;
  std::vector<int> seqlens_q = {}, seqlens_k = {};  // varlen (packed, exactly sized)
  // An additive float32 bias with dbias: 0 none, 1 shaped (1, 1, 1, sk) (every batch, head
  // and row sums onto one row), 2 shaped (batch, 1, sq, sk).
  int bias = 0;
};

template <typename T>
Result flash_bwd_case(const BwdCase& c) {
  std::mt19937 rng(unsigned(c.sq * 7 + c.sk * 3 + c.d));
  std::normal_distribution<float> normal;
  const bool varlen = !c.seqlens_q.empty();
  std::vector<int> lq(size_t(c.batch), c.sq), lk(size_t(c.batch), c.sk);
  if (varlen) lq = c.seqlens_q, lk = c.seqlens_k;
  std::vector<int> q0(size_t(c.batch) + 1, 0), k0(size_t(c.batch) + 1, 0);
  for (int b = 0; b < c.batch; ++b) {
    q0[size_t(b) + 1] = q0[size_t(b)] + lq[size_t(b)];
    k0[size_t(b) + 1] = k0[size_t(b)] + lk[size_t(b)];
  }
  const int tq = q0[size_t(c.batch)], tk = k0[size_t(c.batch)];
  const size_t nq = size_t(tq) * c.hq * c.d, nk = size_t(tk) * c.hkv * c.d;
  std::vector<T> q(nq), k(nk), v(nk), o(nq), dout(nq), dq(nq), dk(nk), dv(nk);
  auto fill = [&](std::vector<T>& x) {
    for (T& e : x) e = from_float<T>(normal(rng));
  };
  fill(q), fill(k), fill(v), fill(dout);
  std::vector<float> lse(size_t(tq) * c.hq);
  const int bias_b = c.bias == 2 ? c.batch : 1, bias_r = c.bias == 2 ? c.sq : 1;
  std::vector<float> bias(c.bias ? size_t(bias_b) * bias_r * c.sk : 0), dbias(bias.size(), NAN);
  for (float& e : bias) e = normal(rng);

  fmha::BwdParams p;
  p.q = q.data(), p.k = k.data(), p.v = v.data(), p.o = o.data(), p.lse = lse.data();
  p.dout = dout.data(), p.dq = dq.data(), p.dk = dk.data(), p.dv = dv.data();
  p.q_row_stride = p.o_row_stride = p.do_row_stride = p.dq_row_stride = int64_t(c.hq) * c.d;
  p.k_row_stride = p.v_row_stride = p.dk_row_stride = p.dv_row_stride = int64_t(c.hkv) * c.d;
  p.q_head_stride = p.o_head_stride = p.do_head_stride = p.dq_head_stride = c.d;
  p.k_head_stride = p.v_head_stride = p.dk_head_stride = p.dv_head_stride = c.d;
  if (varlen) {
    p.cu_seqlens_q = q0.data(), p.cu_seqlens_k = k0.data();
    p.total_q = tq, p.total_k = tk;
    p.lse_head_stride = tq, p.lse_row_stride = 1;
  } else {
    p.q_batch_stride = p.o_batch_stride = p.do_batch_stride = p.dq_batch_stride =
        int64_t(c.sq) * c.hq * c.d;
    p.k_batch_stride = p.v_batch_stride = p.dk_batch_stride = p.dv_batch_stride =
        int64_t(c.sk) * c.hkv * c.d;
    p.lse_batch_stride = int64_t(c.hq) * c.sq, p.lse_head_stride = c.sq, p.lse_row_stride = 1;
  }
  p.batch = c.batch, p.heads_q = c.hq, p.heads_kv = c.hkv;
  p.seqlen_q = c.sq, p.seqlen_k = c.sk, p.head_dim = p.head_dim_v = c.d;
  p.dtype = std::is_same<T, half_t>::value ? fmha::DType::kFloat16 : fmha::DType::kBFloat16;
  p.scale = 1.0 / std::sqrt(double(c.d));
  p.window_left = c.left, p.window_right = c.right, p.bottom_right = true;
  p.num_splits = 1;
  p.deterministic = c.deterministic;
  if (c.bias) {
    p.bias.ptr = bias.data(), p.bias.dtype = fmha::DType::kFloat32;
    p.bias.batch_stride = bias_b == 1 ? 0 : int64_t(bias_r) * c.sk;
    p.bias.row_stride = bias_r == 1 ? 0 : c.sk, p.bias.col_stride = 1;
    p.dbias = dbias.data();
    p.dbias_batch = bias_b, p.dbias_heads = 1, p.dbias_rows = bias_r, p.dbias_cols = c.sk;
  }
  launch_flash_fwd(p, nullptr);
  emu::reset_stats();
  launch_flash_bwd(p, nullptr);
  const emu::Stats s = emu::stats();

  // float64 reference from the rounded inputs (and the kernel's own O: D = rowsum(dO o O)).
  auto f = [](const std::vector<T>& x) {
    std::vector<double> y(x.size());
    for (size_t i = 0; i < x.size(); ++i) y[i] = to_float(x[i]);
    return y;
  };
  const std::vector<double> fq = f(q), fk = f(k), fv = f(v), fo = f(o), fdo = f(dout);
  std::vector<double> rdq(nq, 0.0), rdk(nk, 0.0), rdv(nk, 0.0), rdbias(bias.size(), 0.0);
  auto bias_at = [&](int b, int i, int j) {
    return (size_t(bias_b == 1 ? 0 : b) * bias_r + (bias_r == 1 ? 0 : i)) * c.sk + j;
  };
  for (int b = 0; b < c.batch; ++b)
    for (int h = 0; h < c.hq; ++h) {
      const int hk = h / (c.hq / c.hkv), sq = lq[size_t(b)], sk = lk[size_t(b)], off = sk - sq;
      auto qi = [&](int i, int x) { return ((size_t(q0[size_t(b)]) + i) * c.hq + h) * c.d + x; };
      auto kj = [&](int j, int x) { return ((size_t(k0[size_t(b)]) + j) * c.hkv + hk) * c.d + x; };
      for (int i = 0; i < sq; ++i) {
        std::vector<double> srow(size_t(sk), -INFINITY);
        double mx = -INFINITY;
        for (int j = 0; j < sk; ++j) {
          if ((c.left >= 0 && j < i + off - c.left) || (c.right >= 0 && j > i + off + c.right))
            continue;
          double dot = 0;
          for (int x = 0; x < c.d; ++x) dot += fq[qi(i, x)] * fk[kj(j, x)];
          srow[size_t(j)] = dot * p.scale + (c.bias ? bias[bias_at(b, i, j)] : 0.0);
          mx = std::max(mx, srow[size_t(j)]);
        }
        double sum = 0;
        for (int j = 0; j < sk; ++j) sum += mx == -INFINITY ? 0.0 : std::exp(srow[size_t(j)] - mx);
        double dd = 0;
        for (int x = 0; x < c.d; ++x) dd += fdo[qi(i, x)] * fo[qi(i, x)];
        for (int j = 0; j < sk; ++j) {
          const double pj = sum > 0 ? std::exp(srow[size_t(j)] - mx) / sum : 0.0;
          if (pj == 0.0) continue;
          double dp = 0;
          for (int x = 0; x < c.d; ++x) dp += fdo[qi(i, x)] * fv[kj(j, x)];
          if (c.bias) rdbias[bias_at(b, i, j)] += pj * (dp - dd);
          const double ds = pj * (dp - dd) * p.scale;
          for (int x = 0; x < c.d; ++x) {
            rdq[qi(i, x)] += ds * fk[kj(j, x)];
            rdk[kj(j, x)] += ds * fq[qi(i, x)];
            rdv[kj(j, x)] += pj * fdo[qi(i, x)];
          }
        }
      }
    }
  // Inputs are N(0, 1); gradients are sums of O(sk) such terms rounded to T once, with P
  // and dS rounded to T inside the products (as FlashAttention-2 does).
  const double eps = std::is_same<T, half_t>::value ? 2e-2 : 6e-2;
  auto check = [&](const char* name, const std::vector<T>& got, const std::vector<double>& ref) {
    double scale = 1e-3;
    for (double r : ref) scale = std::max(scale, std::fabs(r));
    for (size_t i = 0; i < ref.size(); ++i) {
      const double g = to_float(got[i]);
      if (!(std::fabs(g - ref[i]) <= eps * scale)) {
        char buf[160];
        std::snprintf(buf, sizeof buf, "%s[%zu] = %.6g, expected %.6g (scale %.3g)", name, i, g,
                      ref[i], scale);
        return std::string(buf);
      }
    }
    return std::string();
  };
  for (auto [name, got, ref] : {std::make_tuple("dq", &dq, &rdq), std::make_tuple("dk", &dk, &rdk),
                                std::make_tuple("dv", &dv, &rdv)}) {
    const std::string err = check(name, *got, *ref);
    if (!err.empty()) return fail(err);
  }
  if (c.bias) {
    std::vector<T> got(dbias.size());  // through T, so that check() reads it as the others
    for (size_t i = 0; i < got.size(); ++i) got[i] = from_float<T>(dbias[i]);
    const std::string err = check("dbias", got, rdbias);
    if (!err.empty()) return fail(err);
  }
  char buf[160];
  std::snprintf(buf, sizeof buf, "%llu launches, %llu blocks, %llu mma.sync, %llu cp.async",
                (unsigned long long)s.launches, (unsigned long long)s.blocks,
                (unsigned long long)s.mma / 32, (unsigned long long)s.cp_async);
  return pass(buf);
}

#define FLASH_BWD_CITE "flash_bwd (FlashAttention-2 backward: dK/dV key-stationary, dQ) vs float64"
// batch, sq, sk, hq, hkv, d, left, right, deterministic
EMU_TEST("flash_bwd.f16.d64.causal.tail.atomic", FLASH_BWD_CITE) {
  return flash_bwd_case<half_t>({1, 70, 70, 2, 1, 64, -1, 0, false});
}
// d = 64 and 128 plain: the 8-warp kernels (FlashBwdConfig), over several key blocks of 128
// and a GQA group of 2, in both dQ modes, with partial query and key blocks.
EMU_TEST("flash_bwd.f16.d64.gqa.blocks.atomic", FLASH_BWD_CITE) {
  return flash_bwd_case<half_t>({1, 130, 260, 4, 2, 64, -1, -1, false});
}
EMU_TEST("flash_bwd.bf16.d64.gqa.blocks.deterministic", FLASH_BWD_CITE) {
  return flash_bwd_case<bf16_t>({1, 130, 260, 4, 2, 64, -1, -1, true});
}
// d = 64 plain in whole blocks: the tiled pass's inner steps (its fast score path, Qi and dOi
// copied from pointers held in registers, moved on block by block and head by head).
EMU_TEST("flash_bwd.f16.d64.whole.gqa.atomic", FLASH_BWD_CITE) {
  return flash_bwd_case<half_t>({1, 256, 256, 4, 2, 64, -1, -1, false});
}
EMU_TEST("flash_bwd.f16.d128.gqa.blocks.atomic", FLASH_BWD_CITE) {
  return flash_bwd_case<half_t>({1, 70, 200, 4, 2, 128, -1, -1, false});
}
EMU_TEST("flash_bwd.bf16.d128.causal.blocks.deterministic", FLASH_BWD_CITE) {
  return flash_bwd_case<bf16_t>({1, 150, 150, 2, 1, 128, -1, 0, true});
}
EMU_TEST("flash_bwd.bf16.d128.window.deterministic", FLASH_BWD_CITE) {
  return flash_bwd_case<bf16_t>({1, 40, 75, 1, 1, 128, 20, 3, true});
}
EMU_TEST("flash_bwd.f16.d59.varlen", FLASH_BWD_CITE) {
  return flash_bwd_case<half_t>({3, 40, 70, 2, 2, 59, -1, -1, false, {17, 0, 40}, {70, 5, 9}});
}
EMU_TEST("flash_bwd.f16.d256.gqa", FLASH_BWD_CITE) {
  return flash_bwd_case<half_t>({1, 20, 33, 2, 1, 256, -1, -1, false});
}
EMU_TEST("flash_bwd.f16.d64.varlen.dbias_full", FLASH_BWD_CITE) {
  return flash_bwd_case<half_t>({3, 70, 70, 1, 1, 64, -1, -1, false, {17, 0, 70}, {70, 5, 9}, 2});
}
EMU_TEST("flash_bwd.bf16.d160.causal.dbias_one_row", FLASH_BWD_CITE) {
  return flash_bwd_case<bf16_t>({2, 20, 40, 1, 1, 160, -1, 0, false, {}, {}, 1});
}

// The NaN rule's strong zero (cuda/strong_zero.cuh) under the sanitizers: causal, sq = sk, so
// row i sees keys 0..i. A NaN in q row 0, dout row 1 and v row sk - 1: in the forward only row
// sk - 1 (the one row that sees key sk - 1) is non-finite; in the backward, q_0 and dout_1 reach
// the gradients of rows and keys 0 and 1 only (row 0's NaN score makes dS_00 NaN; D_1 is NaN;
// dP of row sk - 1 is NaN and reaches dq_{sk-1} and, through dS, every dk row -- so dk is left
// out of the pattern check). Every other pair that sees a NaN is masked: a 0 * NaN there would
// make more rows non-finite.
template <typename T>
Result strong_zero_case(int d, bool deterministic) {
  const int n = 70;
  std::mt19937 rng{unsigned(d)};
  std::normal_distribution<float> normal;
  const size_t nx = size_t(n) * d;
  std::vector<T> q(nx), k(nx), v(nx), o(nx), dout(nx), dq(nx), dk(nx), dv(nx);
  for (auto* x : {&q, &k, &v, &dout})
    for (T& e : *x) e = from_float<T>(normal(rng));
  const T nan = from_float<T>(NAN);
  q[3] = nan, dout[size_t(d) + 5] = nan, v[size_t(n - 1) * d + 7] = nan;
  std::vector<float> lse(n);
  fmha::BwdParams p;
  p.q = q.data(), p.k = k.data(), p.v = v.data(), p.o = o.data(), p.lse = lse.data();
  p.dout = dout.data(), p.dq = dq.data(), p.dk = dk.data(), p.dv = dv.data();
  p.q_row_stride = p.o_row_stride = p.do_row_stride = p.dq_row_stride = d;
  p.k_row_stride = p.v_row_stride = p.dk_row_stride = p.dv_row_stride = d;
  p.q_head_stride = p.o_head_stride = p.do_head_stride = p.dq_head_stride = d;
  p.k_head_stride = p.v_head_stride = p.dk_head_stride = p.dv_head_stride = d;
  p.q_batch_stride = p.o_batch_stride = p.do_batch_stride = p.dq_batch_stride = int64_t(n) * d;
  p.k_batch_stride = p.v_batch_stride = p.dk_batch_stride = p.dv_batch_stride = int64_t(n) * d;
  p.lse_batch_stride = n, p.lse_head_stride = n, p.lse_row_stride = 1;
  p.batch = p.heads_q = p.heads_kv = 1;
  p.seqlen_q = p.seqlen_k = n, p.head_dim = p.head_dim_v = d;
  p.dtype = std::is_same<T, half_t>::value ? fmha::DType::kFloat16 : fmha::DType::kBFloat16;
  p.scale = 1.0 / std::sqrt(double(d));
  p.window_left = -1, p.window_right = 0, p.bottom_right = true;
  p.num_splits = 1;
  p.deterministic = deterministic;
  launch_flash_fwd(p, nullptr);
  launch_flash_bwd(p, nullptr);
  // Row r of x has a non-finite entry iff r is in `rows`.
  auto pattern = [&](const char* name, const std::vector<T>& x, std::vector<int> rows) {
    for (int r = 0; r < n; ++r) {
      bool bad = false;
      for (int c = 0; c < d; ++c) bad |= !std::isfinite(to_float(x[size_t(r) * d + c]));
      const bool want = std::find(rows.begin(), rows.end(), r) != rows.end();
      if (bad != want)
        return std::string(name) + " row " + std::to_string(r) +
               (bad ? " is non-finite" : " is finite") + ", expected the opposite";
    }
    return std::string();
  };
  for (const std::string& err : {pattern("out", o, {0, n - 1}), pattern("dq", dq, {0, 1, n - 1}),
                                 pattern("dv", dv, {0, 1})})
    if (!err.empty()) return fail(err);
  return pass();
}

EMU_TEST("flash_bwd.f16.d64.strong_zero.atomic", "docs/semantics.md, Non-finite inputs: " FLASH_BWD_CITE) {
  return strong_zero_case<half_t>(64, false);
}
EMU_TEST("flash_bwd.f16.d128.strong_zero.atomic",
         "docs/semantics.md, Non-finite inputs: " FLASH_BWD_CITE) {
  return strong_zero_case<half_t>(128, false);
}
EMU_TEST("flash_bwd.bf16.d128.strong_zero.deterministic",
         "docs/semantics.md, Non-finite inputs: " FLASH_BWD_CITE) {
  return strong_zero_case<bf16_t>(128, true);
}

}  // namespace
