// The FlashAttention-2 forward kernel (csrc/cuda/flash_fwd.cuh) against a float64
// reference, built plainly, with AddressSanitizer and with the race checker: the kernel must
// be correct, in bounds (exactly sized buffers, tail tiles, padded head dims) and race-free
// (the cp.async double buffer and its barriers). The full numerical sweep against
// fmha.reference is tests/test_cuda_forward_emu.py; these cases cover the code paths.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda/emu/runtime.h"
#include "cuda/flash_fwd.h"
#include "cuda/primitives.cuh"
#include "emu_test.h"

using namespace fmha::gpu;
using emu_test::fail;
using emu_test::pass;
using emu_test::Result;

namespace {

struct Case {
  int batch, sq, sk, hq, hkv, d;
  int left, right;
  bool bottom_right;
};

template <typename T>
Result flash_case(const Case& c) {
  std::mt19937 rng(unsigned(c.sq * 131 + c.sk * 17 + c.d));
  std::normal_distribution<float> normal;
  // Exactly sized, contiguous (b, s, h, d) buffers: AddressSanitizer flags any read past an edge.
  const size_t nq = size_t(c.batch) * c.sq * c.hq * c.d, nk = size_t(c.batch) * c.sk * c.hkv * c.d;
  std::vector<T> q(nq), k(nk), v(nk), o(nq);
  std::vector<double> fq(nq), fk(nk), fv(nk);
  for (size_t i = 0; i < nq; ++i) fq[i] = to_float(q[i] = from_float<T>(normal(rng)));
  for (size_t i = 0; i < nk; ++i) fk[i] = to_float(k[i] = from_float<T>(normal(rng)));
  for (size_t i = 0; i < nk; ++i) fv[i] = to_float(v[i] = from_float<T>(normal(rng)));
  std::vector<float> lse(size_t(c.batch) * c.hq * c.sq);

  fmha::FwdParams p;
  p.q = q.data(), p.k = k.data(), p.v = v.data(), p.o = o.data(), p.lse = lse.data();
  p.q_row_stride = p.o_row_stride = int64_t(c.hq) * c.d;
  p.q_head_stride = p.o_head_stride = p.k_head_stride = p.v_head_stride = c.d;
  p.q_batch_stride = p.o_batch_stride = int64_t(c.sq) * c.hq * c.d;
  p.k_row_stride = p.v_row_stride = int64_t(c.hkv) * c.d;
  p.k_batch_stride = p.v_batch_stride = int64_t(c.sk) * c.hkv * c.d;
  p.lse_batch_stride = int64_t(c.hq) * c.sq, p.lse_head_stride = c.sq, p.lse_row_stride = 1;
  p.batch = c.batch, p.heads_q = c.hq, p.heads_kv = c.hkv;
  p.seqlen_q = c.sq, p.seqlen_k = c.sk, p.head_dim = p.head_dim_v = c.d;
  p.dtype = std::is_same<T, half_t>::value ? fmha::DType::kFloat16 : fmha::DType::kBFloat16;
  p.scale = 1.0 / std::sqrt(double(c.d));
  p.window_left = c.left, p.window_right = c.right, p.bottom_right = c.bottom_right;
  emu::reset_stats();
  launch_flash_fwd(p, nullptr);
  const emu::Stats s = emu::stats();

  // P is rounded to T before P V (as on the GPU): allow a few units of T's precision.
  const double eps = std::is_same<T, half_t>::value ? 1e-3 : 8e-3;
  const int off = c.bottom_right ? c.sk - c.sq : 0;
  for (int b = 0; b < c.batch; ++b)
    for (int h = 0; h < c.hq; ++h) {
      const int hk = h / (c.hq / c.hkv);
      for (int i = 0; i < c.sq; ++i) {
        std::vector<double> srow(size_t(c.sk), -INFINITY);
        double mx = -INFINITY;
        for (int j = 0; j < c.sk; ++j) {
          if ((c.left >= 0 && j < i + off - c.left) || (c.right >= 0 && j > i + off + c.right))
            continue;
          double dot = 0;
          for (int x = 0; x < c.d; ++x)
            dot += fq[((size_t(b) * c.sq + i) * c.hq + h) * c.d + x] *
                   fk[((size_t(b) * c.sk + j) * c.hkv + hk) * c.d + x];
          srow[size_t(j)] = dot * p.scale;
          mx = std::max(mx, srow[size_t(j)]);
        }
        double sum = 0;
        for (int j = 0; j < c.sk; ++j) sum += mx == -INFINITY ? 0.0 : std::exp(srow[size_t(j)] - mx);
        const double ref_lse = sum > 0 ? mx + std::log(sum) : -INFINITY;
        const float got_lse = lse[(size_t(b) * c.hq + h) * c.sq + i];
        if (!(got_lse == ref_lse || std::fabs(got_lse - ref_lse) <= 1e-4 * (1 + std::fabs(ref_lse)))) {
          char buf[160];
          std::snprintf(buf, sizeof buf, "lse[%d][%d][%d] = %.7g, expected %.7g", b, h, i, got_lse,
                        ref_lse);
          return fail(buf);
        }
        for (int x = 0; x < c.d; ++x) {
          double ref = 0, mag = 0;
          for (int j = 0; j < c.sk; ++j) {
            const double pj = sum > 0 ? std::exp(srow[size_t(j)] - mx) / sum : 0.0;
            const double vj = fv[((size_t(b) * c.sk + j) * c.hkv + hk) * c.d + x];
            ref += pj * vj;
            mag += pj * std::fabs(vj);
          }
          const double got = to_float(o[((size_t(b) * c.sq + i) * c.hq + h) * c.d + x]);
          if (!(std::fabs(got - ref) <= eps * (mag + std::fabs(ref)) + 1e-6)) {
            char buf[160];
            std::snprintf(buf, sizeof buf, "out[%d][%d][%d][%d] = %.6g, expected %.6g", b, i, h,
                          x, got, ref);
            return fail(buf);
          }
        }
      }
    }
  // Aligned rows (d % 8 == 0) move by cp.async, two groups deep when there are two or
  // more key blocks; odd head dims fall back to element loads.
  const bool aligned = c.d % 8 == 0;
  if (aligned && s.cp_async == 0) return fail("aligned rows but no cp.async");
  if (!aligned && s.cp_async != 0) return fail("cp.async used on unaligned rows");
  if (aligned && c.sk > 64 && s.max_cp_async_groups_pending != 2)
    return fail("no double buffering (max groups in flight " +
                std::to_string(s.max_cp_async_groups_pending) + ")");
  char buf[160];
  std::snprintf(buf, sizeof buf, "%llu blocks, %llu mma.sync, %llu cp.async (%llu zero-filled)",
                (unsigned long long)s.blocks, (unsigned long long)s.mma / 32,
                (unsigned long long)s.cp_async, (unsigned long long)s.cp_async_zero_filled);
  return pass(buf);
}

#define FLASH_CITE "flash_fwd (FlashAttention-2 forward: mma.sync + ldmatrix + cp.async) vs float64"
// batch, sq, sk, hq, hkv, d, left, right, bottom_right
EMU_TEST("flash.f16.d64.causal.tail", FLASH_CITE) { return flash_case<half_t>({1, 70, 70, 1, 1, 64, -1, 0, true}); }
EMU_TEST("flash.bf16.d128.full.tail", FLASH_CITE) { return flash_case<bf16_t>({1, 17, 130, 1, 1, 128, -1, -1, true}); }
EMU_TEST("flash.f16.d64.gqa.sq_gt_sk", FLASH_CITE) { return flash_case<half_t>({2, 80, 17, 2, 1, 64, -1, 0, true}); }
EMU_TEST("flash.f16.d59.window.topleft", FLASH_CITE) { return flash_case<half_t>({1, 33, 70, 1, 1, 59, 5, 3, false}); }

}  // namespace
