// Self-tests of the emulator's Hopper model (cuda/hopper.cuh, cuda/emu/hopper_emu.h):
// mbarrier phases, setmaxnreg, elect.sync here; wgmma and TMA in hopper_wgmma_checks.cu and
// hopper_tma_checks.cu. Expected values come from the PTX ISA's rules as the cases state
// them, never from the emulator.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "cuda/hopper.cuh"
#include "emu_test.h"

using namespace fmha::gpu;
using emu_test::fail;
using emu_test::launch_error;
using emu_test::pass;
using emu_test::Result;
using emu_test::expect_error;

namespace {

// ---------------------------------------------------------------- mbarrier phase logic
// One thread walks an mbarrier (expected count 2) through its phases and records what the
// waits answer at each step. The ISA's rules ("mbarrier": phase completion, tx-count,
// test_wait.parity):
//  - a phase completes when its pending arrivals AND its tx-count are both zero;
//  - test_wait.parity(P) is true once the phase of parity P has completed: at the start
//    (phase 0 in progress) P = 1 counts as the completed preceding phase;
//  - test_wait(state) is true once the phase the arrival's state names has completed.
__global__ void mbar_walk_kernel(int* out) {
  FMHA_DYNAMIC_SHARED(uint64_t, bar);
  int n = 0;
  auto rec = [&](bool v) { out[n++] = v ? 1 : 0; };
  mbarrier_init(bar, 2);
  rec(mbarrier_test_wait_parity(bar, 0));  // 0: phase 0 in progress
  rec(mbarrier_test_wait_parity(bar, 1));  // 1: the "preceding" phase of parity 1
  const uint64_t s0 = mbarrier_arrive(bar);  // one of two arrivals
  rec(mbarrier_test_wait_parity(bar, 0));  // 0
  mbarrier_expect_tx(bar, 64);
  const uint64_t s1 = mbarrier_arrive(bar);  // arrivals done, 64 bytes pending
  rec(s0 == s1);                           // 1: both arrivals belong to phase 0
  rec(mbarrier_test_wait_parity(bar, 0));  // 0: tx-count is 64
  rec(mbarrier_test_wait(bar, s0));        // 0
  mbarrier_complete_tx(bar, 48);
  rec(mbarrier_test_wait_parity(bar, 0));  // 0: 16 bytes pending
  mbarrier_complete_tx(bar, 16);
  rec(mbarrier_test_wait_parity(bar, 0));  // 1: phase 0 completed
  rec(mbarrier_test_wait(bar, s0));        // 1
  rec(mbarrier_test_wait_parity(bar, 1));  // 0: phase 1 in progress
  // complete_tx before expect_tx in one phase: the tx-count goes negative, then back to 0.
  mbarrier_complete_tx(bar, 32);
  const uint64_t s2 = mbarrier_arrive_expect_tx(bar, 32);
  rec(s2 != s0);                           // 1: phase 1's token
  rec(mbarrier_test_wait_parity(bar, 1));  // 0: one arrival pending
  mbarrier_arrive(bar);
  rec(mbarrier_test_wait_parity(bar, 1));  // 1: phase 1 completed
  rec(mbarrier_test_wait_parity(bar, 0));  // 0: phase 2 (parity 0) in progress
  // arrive with a count: both arrivals at once.
  mbarrier_arrive(bar, 2);
  rec(mbarrier_test_wait_parity(bar, 0));  // 1
  rec(mbarrier_try_wait_parity(bar, 0));   // 1: try_wait on a completed phase returns
  out[n] = -1;
}

EMU_TEST("hopper.mbarrier.phases",
         "PTX ISA mbarrier: phase completion (pending arrivals and tx-count both zero), "
         "expect-tx/complete-tx, arrive count, test_wait/try_wait .parity") {
  std::vector<int> out(32, 7);
  FMHA_LAUNCH(mbar_walk_kernel, dim3(1), dim3(1), 8, nullptr, out.data());
  const std::vector<int> want = {0, 1, 0, 1, 0, 0, 0, 1, 1, 0, 1, 0, 1, 0, 1, 1, -1};
  for (size_t i = 0; i < want.size(); ++i)
    if (out[i] != want[i])
      return fail("step " + std::to_string(i) + ": got " + std::to_string(out[i]) + ", the ISA says " +
                  std::to_string(want[i]));
  return pass();
}

// Over-arrival: two arrivals of count 1 then one of count 2 on a barrier expecting 2 per
// phase is fine (phase 1 gets both); one more than a phase expects is an error.
template <int kLastCount>
__global__ void mbar_over_kernel(int*) {
  FMHA_DYNAMIC_SHARED(uint64_t, bar);
  mbarrier_init(bar, 2);
  mbarrier_arrive(bar);
  mbarrier_arrive(bar, kLastCount);  // 1: completes phase 0; 2: one too many
}

EMU_TEST("hopper.mbarrier.over_arrival", "PTX ISA mbarrier: arrivals beyond the pending count are "
                                         "undefined behaviour (an error here)") {
  auto ok = &mbar_over_kernel<1>;
  auto bad = &mbar_over_kernel<2>;
  const std::string good = launch_error([&] { FMHA_LAUNCH(ok, dim3(1), dim3(1), 8, nullptr, nullptr); });
  if (!good.empty()) return fail("a legal arrival sequence failed: " + good);
  return expect_error(launch_error([&] { FMHA_LAUNCH(bad, dim3(1), dim3(1), 8, nullptr, nullptr); }),
                      {"over-arrival", "expects only 1"});
}

__global__ void mbar_uninit_kernel(int*) {
  FMHA_DYNAMIC_SHARED(uint64_t, bar);
  mbarrier_arrive(bar);
}

EMU_TEST("hopper.mbarrier.uninitialized", "PTX ISA mbarrier: operations need mbarrier.init first") {
  return expect_error(
      launch_error([&] { FMHA_LAUNCH(mbar_uninit_kernel, dim3(1), dim3(1), 8, nullptr, nullptr); }),
      {"not an initialized mbarrier"});
}

// A producer thread and 96 consumers hand off eight rounds through two barriers ("full":
// count 1, "empty": count 96), the waits blocking: in round i every consumer must see the
// producer's i+1 increments (atomics: the race checker does not track them).
__global__ void mbar_pingpong_kernel(float* counter, int* seen) {
  FMHA_DYNAMIC_SHARED(uint64_t, bars);  // [0] full, [1] empty
  const int t = threadIdx.x;
  if (t == 0) {
    mbarrier_init(&bars[0], 1);
    mbarrier_init(&bars[1], 96);
    fence_barrier_init();
  }
  __syncthreads();
  for (int i = 0; i < 8; ++i) {
    const uint32_t parity = uint32_t(i & 1);
    if (t == 0) {
      mbarrier_wait(&bars[1], parity ^ 1u);  // round 0: the preceding phase counts as done
      atomic_add(counter, 1.0f);
      mbarrier_arrive(&bars[0]);
    } else if (t >= 32) {
      mbarrier_wait(&bars[0], parity);
      const float c = atomic_add(counter, 0.0f);
      if (c != float(i + 1)) seen[t] = i;  // saw the wrong round
      mbarrier_arrive(&bars[1]);
    }
  }
}

EMU_TEST("hopper.mbarrier.pingpong", "PTX ISA mbarrier: try_wait.parity blocks until the phase "
                                     "of that parity completes; phases alternate parity") {
  float counter = 0;
  std::vector<int> seen(128, -1);
  FMHA_LAUNCH(mbar_pingpong_kernel, dim3(1), dim3(128), 16, nullptr, &counter, seen.data());
  for (int t = 32; t < 128; ++t)
    if (seen[size_t(t)] != -1)
      return fail("consumer " + std::to_string(t) + " passed round " + std::to_string(seen[size_t(t)]) +
                  " before the producer's arrival");
  if (counter != 8.0f) return fail("the producer ran " + std::to_string(counter) + " rounds");
  return pass();
}

// Waiting for a phase nobody completes is a deadlock, reported instead of hanging.
__global__ void mbar_deadlock_kernel(int*) {
  FMHA_DYNAMIC_SHARED(uint64_t, bar);
  if (threadIdx.x == 0) {
    mbarrier_init(bar, 2);
    fence_barrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) mbarrier_arrive(bar);  // one of the two arrivals
  mbarrier_wait(bar, 0);
}

EMU_TEST("hopper.mbarrier.deadlock", "a wait that can never complete is reported (the emulator's "
                                     "deadlock check covers mbarrier waits)") {
  return expect_error(
      launch_error([&] { FMHA_LAUNCH(mbar_deadlock_kernel, dim3(1), dim3(64), 8, nullptr, nullptr); }),
      {"deadlock", "mbarrier", "1 arrivals"});
}

// ---------------------------------------------------------------- setmaxnreg
// 384 threads: the launch gives each 65536 / 384 -> 168 registers (a multiple of 8). The
// producer warpgroup releases down to 40 (128 * 128 registers to the pool), then each
// consumer warpgroup takes 64 more per thread (232): exactly what the pool holds.
template <int kConsumerRegs>
__global__ void setmaxnreg_kernel(int* regs) {
  const int wg = threadIdx.x / 128;
  if (threadIdx.x % 128 == 0) regs[wg] = ::emu::setmaxnreg_current();
  __syncthreads();
  if (wg == 0) {
    setmaxnreg_dec<40>();
  } else {
    setmaxnreg_inc<kConsumerRegs>();
  }
  if (threadIdx.x % 128 == 0) regs[3 + wg] = ::emu::setmaxnreg_current();
}

EMU_TEST("hopper.setmaxnreg.budget", "PTX ISA setmaxnreg: .dec releases registers to the CTA's "
                                     "pool, .inc takes them from it and blocks until enough") {
  std::vector<int> regs(6, 0);
  auto k = &setmaxnreg_kernel<232>;
  FMHA_LAUNCH(k, dim3(1), dim3(384), 0, nullptr, regs.data());
  const std::vector<int> want = {168, 168, 168, 40, 232, 232};
  if (regs != want)
    return fail("register counts " + std::to_string(regs[0]) + "," + std::to_string(regs[3]) + "," +
                std::to_string(regs[4]) + "," + std::to_string(regs[5]));
  // 240 each needs 2 * 72 * 128 registers, more than the 128 * 128 the producer released:
  // the second .inc can never proceed.
  auto greedy = &setmaxnreg_kernel<240>;
  return expect_error(launch_error([&] {
                        FMHA_LAUNCH(greedy, dim3(1), dim3(384), 0, nullptr, regs.data());
                      }),
                      {"deadlock", "setmaxnreg"});
}

template <int kCase>
__global__ void setmaxnreg_bad_kernel(int*) {
  if (kCase == 0) ::emu::setmaxnreg(true, 100);  // not a multiple of 8
  if (kCase == 1) ::emu::setmaxnreg(true, 64);   // .inc below the current 128 (128 threads: 248)
  if (kCase == 2) ::emu::setmaxnreg(false, 16);  // below 24
}

EMU_TEST("hopper.setmaxnreg.rules", "PTX ISA setmaxnreg: the count is a multiple of 8 in [24, 256]; "
                                    ".inc may not lower it, .dec may not raise it") {
  auto k0 = &setmaxnreg_bad_kernel<0>;
  auto k1 = &setmaxnreg_bad_kernel<1>;
  auto k2 = &setmaxnreg_bad_kernel<2>;
  Result r = expect_error(launch_error([&] { FMHA_LAUNCH(k0, dim3(1), dim3(128), 0, nullptr, nullptr); }),
                          {"multiple of 8"});
  if (!r.ok) return r;
  r = expect_error(launch_error([&] { FMHA_LAUNCH(k1, dim3(1), dim3(128), 0, nullptr, nullptr); }),
                   {".inc may not lower it"});
  if (!r.ok) return r;
  return expect_error(launch_error([&] { FMHA_LAUNCH(k2, dim3(1), dim3(128), 0, nullptr, nullptr); }),
                      {"multiple of 8 in [24, 256]"});
}

// ---------------------------------------------------------------- elect.sync
__global__ void elect_kernel(float* leaders, int* lanes) {
  const bool me = elect_one();
  if (me) {
    atomic_add(&leaders[threadIdx.x / 32], 1.0f);
    lanes[threadIdx.x / 32] = int(threadIdx.x % 32);
  }
  // the same leader every time, for the same membermask
  if (elect_one() != me) lanes[threadIdx.x / 32] = -100;
}

EMU_TEST("hopper.elect_one", "PTX ISA elect.sync: exactly one leader among the lanes, the same "
                             "for the same membermask") {
  std::vector<float> leaders(4, 0.0f);
  std::vector<int> lanes(4, -1);
  FMHA_LAUNCH(elect_kernel, dim3(1), dim3(128), 0, nullptr, leaders.data(), lanes.data());
  for (int w = 0; w < 4; ++w) {
    if (leaders[size_t(w)] != 1.0f) return fail("warp " + std::to_string(w) + " elected " +
                                                std::to_string(leaders[size_t(w)]) + " leaders");
    if (lanes[size_t(w)] < 0) return fail("the leader changed between two elections");
  }
  return pass();
}

// ---------------------------------------------------------------- FP8 conversion
namespace fp8 {

// The formats, from their definition (PTX ISA "Alternate Floating-Point Data Formats"):
// e4m3: bias 7, no infinities, S.1111.111 NaN, largest 448; e5m2: bias 15, IEEE-like.
double value(bool e4m3, int code) {
  const double s = (code & 0x80) ? -1.0 : 1.0;
  if (e4m3) {
    const int e = code >> 3 & 15, m = code & 7;
    if (e == 15 && m == 7) return NAN;
    return s * (e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7));
  }
  const int e = code >> 2 & 31, m = code & 3;
  if (e == 31) return m ? NAN : s * INFINITY;
  return s * (e == 0 ? std::ldexp(m / 4.0, -14) : std::ldexp(1.0 + m / 4.0, e - 15));
}
bool is_nan_code(bool e4m3, int code) { return std::isnan(value(e4m3, code)); }

}  // namespace fp8

template <typename T>
__global__ void fp8_convert_kernel(const float* in, uint16_t* out, int pairs) {
  for (int i = threadIdx.x; i < pairs; i += blockDim.x) out[i] = pack_fp8x2<T>(in[2 * i], in[2 * i + 1]);
}

template <typename T>
Result fp8_case(bool e4m3) {
  const int max_code = e4m3 ? 0x7E : 0x7B;
  std::vector<float> in;
  std::vector<int> want;  // the expected code, or -1: a NaN code
  auto add = [&](double x, int code) {
    in.push_back(float(x));
    want.push_back(code);
  };
  for (int c = 0; c <= max_code; ++c) {  // every finite value, both signs, converts to itself
    add(fp8::value(e4m3, c), c);
    add(-fp8::value(e4m3, c), c | 0x80);
  }
  for (int c = 0; c < max_code; ++c) {  // between neighbours: nearest, ties to the even code
    const double lo = fp8::value(e4m3, c), hi = fp8::value(e4m3, c + 1), mid = (lo + hi) / 2;
    add(mid, c % 2 == 0 ? c : c + 1);
    add(-mid, (c % 2 == 0 ? c : c + 1) | 0x80);
    add(mid + (hi - lo) / 8, c + 1);
    add(mid - (hi - lo) / 8, c);
  }
  const double top = fp8::value(e4m3, max_code);
  add(top * 1.03, max_code);  // beyond the largest finite value: saturates (.satfinite)
  add(1e30, max_code);
  add(INFINITY, max_code);
  add(-INFINITY, max_code | 0x80);
  add(NAN, -1);
  add(fp8::value(e4m3, 1) / 4, 0);  // below half the smallest subnormal: zero
  if (in.size() % 2) add(0.0, 0);
  const int pairs = int(in.size() / 2);
  std::vector<uint16_t> out(static_cast<size_t>(pairs));
  auto kernel = &fp8_convert_kernel<T>;
  FMHA_LAUNCH(kernel, dim3(1), dim3(32), 0, nullptr, in.data(), out.data(), pairs);
  for (size_t i = 0; i < in.size(); ++i) {
    const int got = (out[i / 2] >> (8 * (i % 2))) & 0xFF;  // the first of a pair: low byte
    const bool ok = want[i] < 0 ? fp8::is_nan_code(e4m3, got) : got == want[i];
    if (!ok) {
      char msg[160];
      std::snprintf(msg, sizeof msg, "%.9g -> 0x%02x, expected 0x%02x", double(in[i]), got, want[i]);
      return fail(msg);
    }
  }
  return pass(std::to_string(in.size()) + " conversions");
}

EMU_TEST("hopper.cvt.e4m3x2", "PTX ISA cvt.rn.satfinite.e4m3x2.f32; Alternate Floating-Point Data "
                              "Formats (e4m3)") {
  return fp8_case<e4m3_t>(true);
}
EMU_TEST("hopper.cvt.e5m2x2", "PTX ISA cvt.rn.satfinite.e5m2x2.f32; Alternate Floating-Point Data "
                              "Formats (e5m2)") {
  return fp8_case<e5m2_t>(false);
}

}  // namespace
