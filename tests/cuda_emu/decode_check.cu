// The CUDA decode over KV caches (csrc/cuda/flash_decode.cuh) against a float64 reference,
// built plainly, with AddressSanitizer and with the race checker: in bounds on exactly sized
// pools and tables (pages, tails, a padded head dim), race-free (each warp's P in shared
// memory, the merge of the warps), and a refused call writes nothing. The numerical sweep
// against fmha.reference is tests/kvcache/test_kvcache_cuda.py; these cases cover the code paths.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda/emu/runtime.h"
#include "cuda/flash_decode.h"
#include "cuda/primitives.cuh"
#include "emu_test.h"

using namespace fmha::gpu;
using emu_test::fail;
using emu_test::pass;
using emu_test::Result;

namespace {

struct DecodeCase {
  int batch, sq, sn, hq, hkv, d, block_size, max_blocks;
  std::vector<int> lens;  // cached rows per sequence before the call
  int left = -1, right = 0;
  int num_splits = 0;
};

// Sequence b's table is blocks [b * max_blocks, (b + 1) * max_blocks) in reverse order, so
// consecutive rows never sit in consecutive blocks.
template <typename T>
Result decode_case(const DecodeCase& c) {
  std::mt19937 rng(unsigned(c.d * 7 + c.block_size));
  std::normal_distribution<float> normal;
  const int num_blocks = c.batch * c.max_blocks, cap = c.max_blocks * c.block_size;
  const size_t row = size_t(c.hkv) * c.d;
  std::vector<T> kp(size_t(num_blocks) * c.block_size * row), vp(kp.size());
  std::vector<T> q(size_t(c.batch) * c.sq * c.hq * c.d), o(q.size());
  std::vector<T> kn(size_t(c.batch) * c.sn * row), vn(kn.size());
  for (auto* x : {&kp, &vp, &q, &kn, &vn})
    for (T& e : *x) e = from_float<T>(normal(rng));
  std::vector<int32_t> table(static_cast<size_t>(num_blocks));
  std::vector<int32_t> lens(c.lens.begin(), c.lens.end());
  for (int b = 0; b < c.batch; ++b)
    for (int i = 0; i < c.max_blocks; ++i)
      table[size_t(b) * c.max_blocks + i] = b * c.max_blocks + (c.max_blocks - 1 - i);
  std::vector<float> lse(size_t(c.batch) * c.hq * c.sq);

  fmha::FwdParams p;
  p.q = q.data(), p.k = kp.data(), p.v = vp.data(), p.o = o.data(), p.lse = lse.data();
  p.q_batch_stride = int64_t(c.sq) * c.hq * c.d, p.q_row_stride = int64_t(c.hq) * c.d;
  p.q_head_stride = c.d;
  p.o_batch_stride = p.q_batch_stride, p.o_row_stride = p.q_row_stride, p.o_head_stride = c.d;
  p.k_batch_stride = p.v_batch_stride = int64_t(c.block_size) * row;
  p.k_row_stride = p.v_row_stride = int64_t(row), p.k_head_stride = p.v_head_stride = c.d;
  p.lse_batch_stride = int64_t(c.hq) * c.sq, p.lse_head_stride = c.sq, p.lse_row_stride = 1;
  p.batch = c.batch, p.heads_q = c.hq, p.heads_kv = c.hkv, p.seqlen_q = c.sq;
  p.seqlen_k = cap, p.head_dim = p.head_dim_v = c.d;
  p.dtype = std::is_same<T, half_t>::value ? fmha::DType::kFloat16 : fmha::DType::kBFloat16;
  p.scale = 1.0 / std::sqrt(double(c.d));
  p.window_left = c.left, p.window_right = c.right, p.bottom_right = true;
  p.cache_seqlens = lens.data();
  p.k_new = kn.data(), p.v_new = vn.data(), p.seqlen_new = c.sn;
  p.k_new_batch_stride = p.v_new_batch_stride = int64_t(c.sn) * row;
  p.k_new_row_stride = p.v_new_row_stride = int64_t(row);
  p.k_new_head_stride = p.v_new_head_stride = c.d;
  p.block_table = table.data(), p.block_table_stride = c.max_blocks;
  p.block_size = c.block_size, p.num_blocks = num_blocks, p.num_splits = c.num_splits;

  const std::vector<T> kp0 = kp, vp0 = vp;
  (void)kvcache_refusals(true);
  const int splits = launch_flash_decode(p, nullptr);
  if (kvcache_refusals(true) != 0) return fail("a valid call was refused");

  // The expected caches: the new rows at lens[b] .., nothing else.
  auto at = [&](int b, int j) {
    return (size_t(table[size_t(b) * c.max_blocks + j / c.block_size]) * c.block_size +
            j % c.block_size) * row;
  };
  std::vector<T> ek = kp0, ev = vp0;
  for (int b = 0; b < c.batch; ++b)
    for (int t = 0; t < c.sn; ++t)
      for (size_t e = 0; e < row; ++e) {
        ek[at(b, lens[size_t(b)] + t) + e] = kn[(size_t(b) * c.sn + t) * row + e];
        ev[at(b, lens[size_t(b)] + t) + e] = vn[(size_t(b) * c.sn + t) * row + e];
      }
  for (size_t e = 0; e < kp.size(); ++e)
    if (bits_of(kp[e]) != bits_of(ek[e]) || bits_of(vp[e]) != bits_of(ev[e]))
      return fail("cache element " + std::to_string(e) + " is not what the append leaves");

  const int group = c.hq / c.hkv;
  const double eps = std::is_same<T, half_t>::value ? 2e-3 : 1.6e-2;
  for (int b = 0; b < c.batch; ++b) {
    const int sk = lens[size_t(b)] + c.sn, off = sk - c.sq;
    for (int i = 0; i < c.sq; ++i)
      for (int h = 0; h < c.hq; ++h) {
        const int hk = h / group;
        std::vector<double> s(size_t(sk), -INFINITY);
        double mx = -INFINITY;
        for (int j = 0; j < sk; ++j) {
          if ((c.left >= 0 && j < i + off - c.left) || (c.right >= 0 && j > i + off + c.right))
            continue;
          double acc = 0;
          for (int x = 0; x < c.d; ++x)
            acc += double(to_float(q[((size_t(b) * c.sq + i) * c.hq + h) * c.d + x])) *
                   to_float(kp[at(b, j) + size_t(hk) * c.d + x]);
          s[size_t(j)] = acc * p.scale;
          mx = std::max(mx, s[size_t(j)]);
        }
        double sum = 0;
        for (int j = 0; j < sk; ++j) sum += mx == -INFINITY ? 0.0 : std::exp(s[size_t(j)] - mx);
        for (int x = 0; x < c.d; ++x) {
          double ref = 0, mag = 0;
          for (int j = 0; j < sk; ++j) {
            if (s[size_t(j)] == -INFINITY) continue;
            const double w = std::exp(s[size_t(j)] - mx) / sum;
            const double vj = to_float(vp[at(b, j) + size_t(hk) * c.d + x]);
            ref += w * vj;
            mag += w * std::fabs(vj);
          }
          const double got = to_float(o[((size_t(b) * c.sq + i) * c.hq + h) * c.d + x]);
          if (!(std::fabs(got - ref) <= eps * (mag + std::fabs(ref)) + 1e-6)) {
            char buf[160];
            std::snprintf(buf, sizeof buf, "out[%d][%d][%d][%d] = %.6g, expected %.6g", b, i,
                          h, x, got, ref);
            return fail(buf);
          }
        }
      }
  }
  return pass(std::to_string(splits) + " split(s)");
}

#define DECODE_CITE "flash_decode (split-KV decode over paged caches) vs float64"
// batch, sq, sn, hq, hkv, d, block_size, max_blocks, lens
EMU_TEST("decode.f16.d64.gqa.bs7.splits", DECODE_CITE) {
  return decode_case<half_t>({2, 1, 1, 4, 2, 64, 7, 45, {0, 290}});
}
EMU_TEST("decode.bf16.d40.rows12.window", DECODE_CITE) {
  return decode_case<bf16_t>({1, 2, 2, 12, 2, 40, 16, 3, {33}, 9, 0});
}
EMU_TEST("decode.f16.d256.mqa.bs1", DECODE_CITE) {
  return decode_case<half_t>({1, 1, 1, 2, 1, 256, 1, 20, {17}});
}

// A length past the capacity is refused on the device: nothing is written, out and lse are
// NaN, and the refusal bits record why.
EMU_TEST("decode.refused.over_capacity", "flash_decode: kvcache_check_kernel") {
  std::vector<half_t> pool(size_t(4) * 4 * 16, from_float<half_t>(1.0f)), q(16), o(16), kn(16);
  std::vector<float> lse(1);
  std::vector<int32_t> table = {0, 1}, lens = {8};  // capacity 8: one more row does not fit
  fmha::FwdParams p;
  p.q = q.data(), p.k = p.v = pool.data(), p.o = o.data(), p.lse = lse.data();
  p.k_batch_stride = p.v_batch_stride = 4 * 16, p.k_row_stride = p.v_row_stride = 16;
  p.q_row_stride = p.o_row_stride = 16;
  p.batch = p.heads_q = p.heads_kv = p.seqlen_q = 1, p.seqlen_k = 8;
  p.head_dim = p.head_dim_v = 16, p.dtype = fmha::DType::kFloat16;
  p.cache_seqlens = lens.data(), p.k_new = p.v_new = kn.data(), p.seqlen_new = 1;
  p.k_new_row_stride = p.v_new_row_stride = 16;
  p.block_table = table.data(), p.block_table_stride = 2, p.block_size = 4, p.num_blocks = 4;
  const std::vector<half_t> before = pool;
  (void)kvcache_refusals(true);
  launch_flash_decode(p, nullptr);
  const int bits = kvcache_refusals(true);
  if (bits != kRefusedCapacity) return fail("refusal bits " + std::to_string(bits));
  for (size_t e = 0; e < pool.size(); ++e)
    if (bits_of(pool[e]) != bits_of(before[e])) return fail("the pool was written");
  if (!std::isnan(lse[0]) || !std::isnan(to_float(o[0]))) return fail("out / lse not NaN");
  return pass();
}

}  // namespace
