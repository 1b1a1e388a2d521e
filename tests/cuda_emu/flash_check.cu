// The FlashAttention-2 forward kernel (csrc/cuda/flash_fwd.cuh) against a float64
// reference, built plainly, with AddressSanitizer and with the race checker: the kernel must
// be correct, in bounds (exactly sized buffers, tail tiles, padded head dims) and race-free
// (the cp.async double buffer and its barriers). The full numerical sweep against
// fmha.reference is tests/kernels/test_cuda_forward_emu.py; these cases cover the code paths.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda/emu/hopper_emu.h"
#include "cuda/emu/runtime.h"
#include "cuda/flash_bwd.h"
#include "cuda/flash_fwd.h"
#include "cuda/hopper.cuh"
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
  int num_splits = 1;
  // Varlen: per-sequence lengths (batch of them); sq / sk are then their maxima and the
  // buffers are packed (total, heads, dim), exactly sized.
  std::vector<int> seqlens_q = {}, seqlens_k = {};
  // Run in the Hopper kernel (cuda/flash_fwd_sm90.cuh: FMHA_CUDA_KERNEL=sm90), which must
  // claim the call.
  bool sm90 = false;
};

// e4m3 codes (float8_e4m3fn: bias 7, no infinities, S.1111.111 NaN): the emulator's
// conversion in, an exact decode out.
float e4m3_value(uint8_t bits) {
  const int e = (bits >> 3) & 15, m = bits & 7;
  const float mag = e == 0 ? std::ldexp(float(m), -9) : std::ldexp(1.0f + m / 8.0f, e - 7);
  return bits & 0x80 ? -mag : mag;
}
template <typename T>
T input_from_float(float x) {
  if constexpr (std::is_same<T, e4m3_t>::value) return e4m3_t{emu::f32_to_e4m3(x)};
  else return from_float<T>(x);
}
template <typename T>
float input_to_float(T x) {
  if constexpr (std::is_same<T, e4m3_t>::value) return e4m3_value(x.bits);
  else return to_float(x);
}

// T: q, k, v's type; e4m3 inputs write out as bfloat16 and run in the Hopper kernel, whose P
// is rounded to e4m3 for P V.
template <typename T>
Result flash_case(const Case& c) {
  constexpr bool kFp8 = std::is_same<T, e4m3_t>::value;
  using TO = std::conditional_t<kFp8, bf16_t, T>;
  std::mt19937 rng(unsigned(c.sq * 131 + c.sk * 17 + c.d));
  std::normal_distribution<float> normal;
  const bool varlen = !c.seqlens_q.empty();
  // Sequence b: rows [q0[b], q0[b] + lq[b]) of a packed (total, h, d) buffer, or the b-th
  // (sq, h, d) slab of a (batch, sq, h, d) one -- the same thing with fixed lengths.
  std::vector<int> lq(size_t(c.batch), c.sq), lk(size_t(c.batch), c.sk), q0(size_t(c.batch) + 1, 0),
      k0(size_t(c.batch) + 1, 0);
  if (varlen) lq = c.seqlens_q, lk = c.seqlens_k;
  for (int b = 0; b < c.batch; ++b) q0[size_t(b) + 1] = q0[size_t(b)] + lq[size_t(b)];
  for (int b = 0; b < c.batch; ++b) k0[size_t(b) + 1] = k0[size_t(b)] + lk[size_t(b)];
  const int tq = q0[size_t(c.batch)], tk = k0[size_t(c.batch)];
  // Exactly sized, contiguous buffers: AddressSanitizer flags any read past an edge.
  const size_t nq = size_t(tq) * c.hq * c.d, nk = size_t(tk) * c.hkv * c.d;
  std::vector<T> q(nq), k(nk), v(nk);
  std::vector<TO> o(nq);
  std::vector<double> fq(nq), fk(nk), fv(nk);
  for (size_t i = 0; i < nq; ++i) fq[i] = input_to_float(q[i] = input_from_float<T>(normal(rng)));
  for (size_t i = 0; i < nk; ++i) fk[i] = input_to_float(k[i] = input_from_float<T>(normal(rng)));
  for (size_t i = 0; i < nk; ++i) fv[i] = input_to_float(v[i] = input_from_float<T>(normal(rng)));
  std::vector<float> lse(size_t(tq) * c.hq);

  fmha::FwdParams p;
  p.q = q.data(), p.k = k.data(), p.v = v.data(), p.o = o.data(), p.lse = lse.data();
  p.q_row_stride = p.o_row_stride = int64_t(c.hq) * c.d;
  p.q_head_stride = p.o_head_stride = p.k_head_stride = p.v_head_stride = c.d;
  p.k_row_stride = p.v_row_stride = int64_t(c.hkv) * c.d;
  if (varlen) {
    p.cu_seqlens_q = q0.data(), p.cu_seqlens_k = k0.data();
    p.total_q = tq, p.total_k = tk;
    p.lse_head_stride = tq, p.lse_row_stride = 1;  // (heads, total_q)
  } else {
    p.q_batch_stride = p.o_batch_stride = int64_t(c.sq) * c.hq * c.d;
    p.k_batch_stride = p.v_batch_stride = int64_t(c.sk) * c.hkv * c.d;
    p.lse_batch_stride = int64_t(c.hq) * c.sq, p.lse_head_stride = c.sq, p.lse_row_stride = 1;
  }
  p.batch = c.batch, p.heads_q = c.hq, p.heads_kv = c.hkv;
  p.seqlen_q = c.sq, p.seqlen_k = c.sk, p.head_dim = p.head_dim_v = c.d;
  p.dtype = kFp8 ? fmha::DType::kFloat8E4M3
                 : std::is_same<T, half_t>::value ? fmha::DType::kFloat16 : fmha::DType::kBFloat16;
  p.o_dtype = fmha::DType::kBFloat16;
  p.scale = 1.0 / std::sqrt(double(c.d));
  p.window_left = c.left, p.window_right = c.right, p.bottom_right = c.bottom_right;
  p.num_splits = c.num_splits;
  emu::reset_stats();
  if (c.sm90) setenv("FMHA_CUDA_KERNEL", "sm90", 1);
  const int splits = launch_flash_fwd(p, nullptr);
  if (c.sm90) unsetenv("FMHA_CUDA_KERNEL");
  const std::string kernel = flash_fwd_take_last_kernel();
  if (kernel != (c.sm90 ? "sm90" : "sm80")) return fail("ran in the " + kernel + " kernel");
  const emu::Stats s = emu::stats();
  if (splits != c.num_splits)
    return fail("used " + std::to_string(splits) + " splits, asked for " + std::to_string(c.num_splits));

  // P is rounded to T before P V (as on the GPU): allow a few units of T's precision (e4m3:
  // 2^-4 of each product, then bfloat16's rounding of out).
  const double eps = kFp8 ? 0.0625 + 8e-3 : std::is_same<T, half_t>::value ? 1e-3 : 8e-3;
  for (int b = 0; b < c.batch; ++b)
    for (int h = 0; h < c.hq; ++h) {
      const int hk = h / (c.hq / c.hkv);
      const int sq = lq[size_t(b)], sk = lk[size_t(b)];
      const int off = c.bottom_right ? sk - sq : 0;
      for (int i = 0; i < sq; ++i) {
        const size_t qrow = size_t(q0[size_t(b)] + i);
        std::vector<double> srow(size_t(sk), -INFINITY);
        double mx = -INFINITY;
        for (int j = 0; j < sk; ++j) {
          if ((c.left >= 0 && j < i + off - c.left) || (c.right >= 0 && j > i + off + c.right))
            continue;
          double dot = 0;
          for (int x = 0; x < c.d; ++x)
            dot += fq[(qrow * c.hq + h) * c.d + x] *
                   fk[((size_t(k0[size_t(b)]) + j) * c.hkv + hk) * c.d + x];
          srow[size_t(j)] = dot * p.scale;
          mx = std::max(mx, srow[size_t(j)]);
        }
        double sum = 0;
        for (int j = 0; j < sk; ++j) sum += mx == -INFINITY ? 0.0 : std::exp(srow[size_t(j)] - mx);
        const double ref_lse = sum > 0 ? mx + std::log(sum) : -INFINITY;
        // lse: (heads, total_q) when varlen, else (batch, heads, seqlen_q).
        const size_t lse_at = varlen ? size_t(h) * tq + qrow : (size_t(b) * c.hq + h) * c.sq + i;
        const float got_lse = lse[lse_at];
        if (!(got_lse == ref_lse || std::fabs(got_lse - ref_lse) <= 1e-4 * (1 + std::fabs(ref_lse)))) {
          char buf[160];
          std::snprintf(buf, sizeof buf, "lse[%d][%d][%d] = %.7g, expected %.7g", b, h, i, got_lse,
                        ref_lse);
          return fail(buf);
        }
        for (int x = 0; x < c.d; ++x) {
          double ref = 0, mag = 0;
          for (int j = 0; j < sk; ++j) {
            const double pj = sum > 0 ? std::exp(srow[size_t(j)] - mx) / sum : 0.0;
            const double vj = fv[((size_t(k0[size_t(b)]) + j) * c.hkv + hk) * c.d + x];
            ref += pj * vj;
            mag += pj * std::fabs(vj);
          }
          const double got = to_float(o[(qrow * c.hq + h) * c.d + x]);  // (TO)
          if (!(std::fabs(got - ref) <= eps * (mag + std::fabs(ref)) + 1e-6)) {
            char buf[160];
            std::snprintf(buf, sizeof buf, "out[%d][%d][%d][%d] = %.6g, expected %.6g", b, i, h,
                          x, got, ref);
            return fail(buf);
          }
        }
      }
    }
  if (c.sm90) return pass(std::to_string(s.blocks) + " blocks (TMA, wgmma)");
  // Aligned rows (d % 8 == 0) move by cp.async, two groups deep when there are two or
  // more key blocks; odd head dims fall back to element loads.
  const bool aligned = c.d % 8 == 0;
  if (aligned && s.cp_async == 0) return fail("aligned rows but no cp.async");
  if (!aligned && s.cp_async != 0) return fail("cp.async used on unaligned rows");
  if (aligned && c.sk > 64 && c.num_splits == 1 && s.max_cp_async_groups_pending != 2)
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
// Varlen: packed, exactly sized buffers; an empty sequence, one past the tile, sq != sk.
EMU_TEST("flash.f16.d64.varlen.causal", FLASH_CITE) {
  return flash_case<half_t>({3, 70, 80, 2, 1, 64, -1, 0, true, 1, {17, 0, 70}, {80, 5, 33}});
}
// Split-KV: 3 splits of 3 key blocks of a 96-wide tile, then the combine kernel; a window
// leaves some splits of each row without keys.
EMU_TEST("flash.bf16.d96.split3.window", FLASH_CITE) {
  return flash_case<bf16_t>({1, 20, 150, 2, 2, 96, 40, 0, true, 3});
}
EMU_TEST("flash.f16.d256.varlen.split2", FLASH_CITE) {
  return flash_case<half_t>({2, 9, 40, 1, 1, 256, -1, -1, true, 2, {9, 3}, {40, 0}});
}

// The Hopper kernel (TMA ring, producer warp, wgmma consumers): the same code paths --
// causal tails, GQA, varlen (a box reading the next sequence's rows), split-KV, d = 256 --
// under AddressSanitizer and the race checker's async proxy (TMA data read only after its
// mbarrier phase, the stages refilled only after the consumers' "empty" arrivals).
#define FLASH90_CITE "flash_fwd_sm90 (FlashAttention-3 forward: TMA + mbarrier ring + wgmma) vs float64"
EMU_TEST("flash90.f16.d64.causal.tail", FLASH90_CITE) {
  return flash_case<half_t>({1, 140, 300, 1, 1, 64, -1, 0, true, 1, {}, {}, true});
}
EMU_TEST("flash90.bf16.d128.gqa.window", FLASH90_CITE) {
  return flash_case<bf16_t>({2, 30, 200, 2, 1, 128, 40, 0, false, 1, {}, {}, true});
}
EMU_TEST("flash90.f16.d128.varlen.causal", FLASH90_CITE) {
  return flash_case<half_t>({3, 70, 150, 2, 1, 128, -1, 0, true, 1, {17, 0, 70}, {150, 5, 33}, true});
}
// No window: the softmax overlapped with the next QK^T, the consumers in ping-pong.
EMU_TEST("flash90.f16.d128.overlap.pingpong", FLASH90_CITE) {
  return flash_case<half_t>({2, 130, 300, 2, 2, 128, -1, -1, true, 1, {}, {}, true});
}
// e4m3 inputs: the V^T pre-pass, k32 wgmma from 64-byte (d = 64) and 128-byte rows, P rounded
// to e4m3 in registers; causal tails, GQA, varlen, split-KV.
EMU_TEST("flash90.e4m3.d64.causal.gqa", FLASH90_CITE) {
  return flash_case<e4m3_t>({2, 70, 150, 2, 1, 64, -1, 0, true, 1, {}, {}, true});
}
EMU_TEST("flash90.e4m3.d128.varlen.split2", FLASH90_CITE) {
  return flash_case<e4m3_t>({3, 70, 150, 2, 1, 128, -1, 0, true, 2, {17, 0, 70}, {150, 5, 33}, true});
}
EMU_TEST("flash90.e4m3.d256.window", FLASH90_CITE) {
  return flash_case<e4m3_t>({1, 40, 200, 1, 1, 256, 60, 10, true, 1, {}, {}, true});
}
EMU_TEST("flash90.bf16.d256.split2", FLASH90_CITE) {
  return flash_case<bf16_t>({1, 9, 170, 1, 1, 256, -1, -1, true, 2, {}, {}, true});
}

// The launchers check their params against the validation contract (fmha/validate.h) before
// they touch memory: a direct caller's null lse, or a head_dim no tile holds, is an error
// (std::invalid_argument), not a fault.
EMU_TEST("flash.contract.rejects_bad_params", "fmha/validate.h: check_params(p, Backend::kCuda)") {
  std::vector<half_t> x(size_t(4) * 64);
  fmha::FwdParams p;
  p.q = p.k = p.v = x.data(), p.o = x.data(), p.lse = nullptr;
  p.q_row_stride = p.k_row_stride = p.v_row_stride = p.o_row_stride = 64;
  p.batch = p.heads_q = p.heads_kv = 1, p.seqlen_q = p.seqlen_k = 4;
  p.head_dim = p.head_dim_v = 64, p.dtype = fmha::DType::kFloat16;
  auto rejects = [](auto&& launch) {
    try {
      launch();
    } catch (const std::invalid_argument&) {
      return true;
    }
    return false;
  };
  if (!rejects([&] { launch_flash_fwd(p, nullptr); })) return fail("forward took a null lse");
  fmha::BwdParams b;
  static_cast<fmha::FwdParams&>(b) = p;
  std::vector<float> lse(4);
  b.lse = lse.data(), b.dout = b.dq = b.dk = x.data(), b.dv = nullptr;
  if (!rejects([&] { launch_flash_bwd(b, nullptr); })) return fail("backward took a null dv");
  // Without query rows the backward still loads K, V and writes dK, dV (zeros).
  b.dv = x.data(), b.seqlen_q = 0, b.k = nullptr;
  if (!rejects([&] { launch_flash_bwd(b, nullptr); }))
    return fail("backward without query rows took a null k");
  p.lse = lse.data(), p.head_dim = 300;
  if (!rejects([&] { launch_flash_fwd(p, nullptr); })) return fail("forward took head_dim 300");
  // An empty call touches nothing: null pointers of the untouched side are fine.
  p.head_dim = 64, p.seqlen_k = 0, p.k = p.v = nullptr;
  if (rejects([&] { launch_flash_fwd(p, nullptr); }))
    return fail("forward without keys refused null k, v");
  return pass();
}

}  // namespace
