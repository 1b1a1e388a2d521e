// Times two builds of the CPU kernels (abA: the base tree, abB: the changed tree) on one shape,
// alternately in one process, and checks that they give the same bits. Driven by
// tools/cpu_ab.py, which explains why: on a shared VM the speed of one build drifts by ±20%
// between runs, so two separate runs cannot resolve a 5% change; interleaved calls see the
// same drift.
//
//   cpu_ab b,heads,seqlen,head_dim[,causal[,seqlen_q[,heads_kv[,keypad]]]] fwd|bwd|fwdbwd
//          f32|bf16 threads rounds
// seqlen is the keys'; seqlen_q (default seqlen) and heads_kv (default heads) give decode and
// GQA shapes, e.g. 8,32,4096,128,0,1,8: one query of 32 heads against 4096 keys of 8; keypad 1
// adds a key-padding mask (batch, 1, 1, seqlen) with the last eighth of the keys padded, as
// python -m fmha.bench's fmha+keypad column.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "bench/bench_case.h"
#include "fmha/params.h"

namespace fmha::cpu {
namespace abA {
void forward(const FwdParams& p);
void backward(const BwdParams& p);
}  // namespace abA
namespace abB {
void forward(const FwdParams& p);
void backward(const BwdParams& p);
}  // namespace abB
}  // namespace fmha::cpu

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// 64-byte aligned, as torch allocates (a row split across two cache lines would time
// something users of torch never see).
struct Buffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  explicit Buffer(size_t n) : bytes((n + 63) / 64 * 64) {
    ptr = std::aligned_alloc(64, bytes);
    std::memset(ptr, 0, bytes);
  }
  ~Buffer() { std::free(ptr); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
};

void fill_normal(Buffer& b, size_t n, bool bf16, std::mt19937& gen) {
  std::normal_distribution<float> nd;
  for (size_t i = 0; i < n; ++i) {
    const float x = nd(gen);
    if (bf16) {
      uint32_t u;
      std::memcpy(&u, &x, 4);
      static_cast<uint16_t*>(b.ptr)[i] = uint16_t((u + 0x7fff + ((u >> 16) & 1)) >> 16);
    } else {
      static_cast<float*>(b.ptr)[i] = x;
    }
  }
}

double median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  return x[x.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: cpu_ab b,heads,seqlen,head_dim[,causal[,seqlen_q[,heads_kv"
                         "[,keypad]]]] fwd|bwd|fwdbwd f32|bf16 threads rounds\n");
    return 2;
  }
  fmha_bench::Case c{};
  int causal = 0, sq = 0, hkv = 0, keypad = 0;
  if (std::sscanf(argv[1], "%d,%d,%d,%d,%d,%d,%d,%d", &c.b, &c.hq, &c.sk, &c.d, &causal, &sq, &hkv,
                  &keypad) < 4)
    return 2;
  c.sq = sq > 0 ? sq : c.sk;
  c.hkv = hkv > 0 ? hkv : c.hq;
  if (c.hq % c.hkv != 0) return 2;
  c.causal = causal != 0;
  const std::string mode = argv[2];
  const bool bf16 = std::string(argv[3]) == "bf16";
  const int threads = std::atoi(argv[4]), rounds = std::max(1, std::atoi(argv[5]));
  const bool fwd = mode != "bwd", bwd = mode != "fwd";

  // n: the query side's elements (q, o, dout, dq), nk: the key side's (k, v, dk, dv).
  const size_t n = size_t(c.b) * c.sq * c.hq * c.d, nk = size_t(c.b) * c.sk * c.hkv * c.d;
  const size_t elt = bf16 ? 2 : 4;
  Buffer q(n * elt), k(nk * elt), v(nk * elt), o(n * elt), g(n * elt), dq(n * elt), dk(nk * elt),
      dv(nk * elt), lse(size_t(c.b) * c.hq * c.sq * 4);
  std::mt19937 gen(0);
  for (Buffer* b : {&q, &g}) fill_normal(*b, n, bf16, gen);
  for (Buffer* b : {&k, &v}) fill_normal(*b, nk, bf16, gen);
  fmha::BwdParams p;
  fmha_bench::set_shape(p, c, bf16 ? fmha::DType::kBFloat16 : fmha::DType::kFloat32);
  p.q = q.ptr; p.k = k.ptr; p.v = v.ptr; p.o = o.ptr; p.lse = lse.ptr;
  p.dout = g.ptr; p.dq = dq.ptr; p.dk = dk.ptr; p.dv = dv.ptr;
  p.num_threads = threads;
  std::vector<uint8_t> pad;
  if (keypad) {
    pad.assign(size_t(c.b) * c.sk, 1);
    for (int b = 0; b < c.b; ++b)
      for (int j = c.sk - c.sk / 8; j < c.sk; ++j) pad[size_t(b) * c.sk + j] = 0;
    p.mask.ptr = pad.data();
    p.mask.batch_stride = c.sk;
    p.mask.col_stride = 1;
  }

  auto run = [&](bool b_tree) {
    if (fwd) (b_tree ? fmha::cpu::abB::forward : fmha::cpu::abA::forward)(p);
    if (bwd) (b_tree ? fmha::cpu::abB::backward : fmha::cpu::abA::backward)(p);
  };
  // Same bits: each tree's outputs from the same inputs (the backward from A's forward).
  if (!fwd) fmha::cpu::abA::forward(p);
  run(false);
  const std::vector<char> outA(static_cast<char*>(fwd ? o.ptr : dq.ptr),
                               static_cast<char*>(fwd ? o.ptr : dq.ptr) + n * elt);
  const std::vector<char> dkA(static_cast<char*>(dk.ptr), static_cast<char*>(dk.ptr) + nk * elt);
  run(true);
  const bool same = std::memcmp(outA.data(), fwd ? o.ptr : dq.ptr, n * elt) == 0 &&
                    (!bwd || std::memcmp(dkA.data(), dk.ptr, nk * elt) == 0);

  // Rounds of (A, B) and (B, A) in turn, so neither build always runs first.
  std::vector<double> ta, tb, speedup;
  for (int r = 0; r < rounds; ++r) {
    const bool a_first = r % 2 == 0;
    double t[2];
    for (int x = 0; x < 2; ++x) {
      const bool b_tree = (x == 0) != a_first;
      const double t0 = now();
      run(b_tree);
      t[b_tree] = now() - t0;
    }
    ta.push_back(t[0]);
    tb.push_back(t[1]);
    speedup.push_back(t[0] / t[1]);
  }
  const double flops = fmha_bench::forward_flops(c) * ((fwd ? 1.0 : 0.0) + (bwd ? 2.5 : 0.0));
  const double best_a = *std::min_element(ta.begin(), ta.end());
  const double best_b = *std::min_element(tb.begin(), tb.end());
  std::printf("%s %s %s threads %d rounds %d | A %.1f GFLOP/s (best %.1f) | B %.1f (best %.1f) "
              "| B/A speed, median of rounds %.3f | same bits: %s\n",
              argv[1], mode.c_str(), bf16 ? "bf16" : "f32", threads, rounds,
              flops / median(ta) / 1e9, flops / best_a / 1e9, flops / median(tb) / 1e9,
              flops / best_b / 1e9, median(speedup), same ? "yes" : "NO");
  return same ? 0 : 1;
}
