// Known-answer tests of every emulated primitive of csrc/cuda/primitives.cuh.
//
// The expected values are written here directly from the PTX ISA (version 9.0 numbering;
// https://docs.nvidia.com/cuda/parallel-thread-execution/) and the CUDA Programming Guide:
// per-lane formulas ("lane L holds element (row, col)"), not the emulator's code, which
// implements the same layouts in the inverse direction ("element (row, col) is held by
// lane L"). A layout error on either side makes these fail. Each case launches a one-warp
// kernel that applies the primitive to known inputs and writes every lane's registers out.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <vector>

#include "cuda/primitives.cuh"
#include "emu_test.h"

using namespace fmha::gpu;
using emu_test::fail;
using emu_test::pass;
using emu_test::Result;

namespace {

// Small integers are exact in f16 and bf16, and so are their products and short sums in f32:
// expected results are exact.
template <typename T>
uint16_t bits16(float x) {
  return bits_of(from_float<T>(x));
}
uint32_t pack(uint16_t lo, uint16_t hi) { return uint32_t(lo) | (uint32_t(hi) << 16); }

std::string fmt(const char* f, double a, double b) {
  char buf[256];
  std::snprintf(buf, sizeof buf, f, a, b);
  return buf;
}

// ------------------------------------------------------------------------------ mma.sync
// PTX ISA 9.0 §9.7.14.5.8 "Matrix Fragments for mma.m16n8k16 with floating point type":
//   groupID = %laneid >> 2, threadID_in_group = %laneid % 4
//   A (.f16/.bf16, elements a0..a7, two per .f16x2 register, low to high):
//     row = groupID for ai with 0 <= i < 2 || 4 <= i < 6, groupID + 8 otherwise
//     col = threadID_in_group * 2 + (i & 1), plus 8 for i >= 4
//   B (b0..b3): row = threadID_in_group * 2 + (i & 1), plus 8 for i >= 2; col = groupID
//   C, D (.f32 c0..c3): row = groupID for i < 2, groupID + 8 otherwise;
//     col = threadID_in_group * 2 + (i & 1)
#define HD __host__ __device__
HD int group_id(int lane) { return lane >> 2; }
HD int thread_in_group(int lane) { return lane % 4; }
HD int a_row(int lane, int i) { return (i < 2 || (i >= 4 && i < 6)) ? group_id(lane) : group_id(lane) + 8; }
HD int a_col(int lane, int i) { return thread_in_group(lane) * 2 + (i & 1) + (i >= 4 ? 8 : 0); }
HD int b_row(int lane, int i) { return thread_in_group(lane) * 2 + (i & 1) + (i >= 2 ? 8 : 0); }
HD int b_col(int lane, int) { return group_id(lane); }
HD int c_row(int lane, int i) { return i < 2 ? group_id(lane) : group_id(lane) + 8; }
HD int c_col(int lane, int i) { return thread_in_group(lane) * 2 + (i & 1); }

struct MmaIo {
  uint32_t a[32][4], b[32][2];
  float c[32][4], d[32][4];
};

template <typename T>
__global__ void mma_kat_kernel(MmaIo* io) {
  const int lane = threadIdx.x;
  uint32_t a[4], b[2];
  float c[4], d[4];
  for (int i = 0; i < 4; ++i) a[i] = io->a[lane][i], c[i] = io->c[lane][i];
  for (int i = 0; i < 2; ++i) b[i] = io->b[lane][i];
  mma_m16n8k16<T>(d, a, b, c);
  for (int i = 0; i < 4; ++i) io->d[lane][i] = d[i];
}

// D = A*B + C for A (16x16), B (16x8), C (16x8) given as float arrays of exact values.
template <typename T>
Result check_mma(const char* what, const float (&A)[16][16], const float (&B)[16][8],
                 const float (&C)[16][8]) {
  MmaIo io{};
  for (int lane = 0; lane < 32; ++lane) {
    for (int r = 0; r < 4; ++r)  // register r holds elements 2r (low) and 2r+1 (high)
      io.a[lane][r] = pack(bits16<T>(A[a_row(lane, 2 * r)][a_col(lane, 2 * r)]),
                           bits16<T>(A[a_row(lane, 2 * r + 1)][a_col(lane, 2 * r + 1)]));
    for (int r = 0; r < 2; ++r)
      io.b[lane][r] = pack(bits16<T>(B[b_row(lane, 2 * r)][b_col(lane, 2 * r)]),
                           bits16<T>(B[b_row(lane, 2 * r + 1)][b_col(lane, 2 * r + 1)]));
    for (int i = 0; i < 4; ++i) io.c[lane][i] = C[c_row(lane, i)][c_col(lane, i)];
  }
  auto kernel = &mma_kat_kernel<T>;
  FMHA_LAUNCH(kernel, dim3(1), dim3(32), 0, nullptr, &io);
  for (int lane = 0; lane < 32; ++lane)
    for (int i = 0; i < 4; ++i) {
      const int r = c_row(lane, i), n = c_col(lane, i);
      double want = C[r][n];
      for (int k = 0; k < 16; ++k) want += double(A[r][k]) * B[k][n];
      if (io.d[lane][i] != float(want)) {
        char buf[256];
        std::snprintf(buf, sizeof buf, "%s: lane %d d%d (D[%d][%d]) = %g, expected %g", what,
                      lane, i, r, n, double(io.d[lane][i]), want);
        return fail(buf);
      }
    }
  return pass();
}

template <typename T>
Result mma_kat() {
  float A[16][16], B[16][8], C[16][8], I1[16][8], I2[16][8], Aid[16][16];
  for (int r = 0; r < 16; ++r)
    for (int k = 0; k < 16; ++k) {
      A[r][k] = float(r * 16 + k);  // every element distinct: D reveals where each landed
      Aid[r][k] = r == k ? 1.0f : 0.0f;
    }
  for (int k = 0; k < 16; ++k)
    for (int n = 0; n < 8; ++n) {
      B[k][n] = float(k * 8 + n + 1);
      I1[k][n] = k == n ? 1.0f : 0.0f;      // D = A[:, 0:8]
      I2[k][n] = k == n + 8 ? 1.0f : 0.0f;  // D = A[:, 8:16]
    }
  for (int r = 0; r < 16; ++r)
    for (int n = 0; n < 8; ++n) C[r][n] = float(1000 + r * 8 + n);
  float Z[16][8] = {};
  if (Result r = check_mma<T>("A columns 0-7 (B = [I; 0])", A, I1, Z); !r.ok) return r;
  if (Result r = check_mma<T>("A columns 8-15 (B = [0; I])", A, I2, Z); !r.ok) return r;
  if (Result r = check_mma<T>("B (A = I)", Aid, B, Z); !r.ok) return r;
  if (Result r = check_mma<T>("C (B = 0)", A, Z, C); !r.ok) return r;
  // A full product of small signed integers (exact).
  uint32_t s = 12345;
  auto next = [&] { s = s * 1664525u + 1013904223u; return int((s >> 24) % 17) - 8; };
  float Ar[16][16], Br[16][8], Cr[16][8];
  for (auto& row : Ar) for (float& v : row) v = float(next());
  for (auto& row : Br) for (float& v : row) v = float(next());
  for (auto& row : Cr) for (float& v : row) v = float(next() * 8);
  return check_mma<T>("random integers", Ar, Br, Cr);
}

EMU_TEST("kat.mma_f16",
         "PTX ISA 9.0 §9.7.14.5.8 Matrix Fragments for mma.m16n8k16 with floating point type; "
         "§9.7.14.5.14 mma (.row.col.f32.f16.f16.f32)") {
  return mma_kat<half_t>();
}
EMU_TEST("kat.mma_bf16",
         "PTX ISA 9.0 §9.7.14.5.8 Matrix Fragments for mma.m16n8k16 with floating point type; "
         "§9.7.14.5.14 mma (.row.col.f32.bf16.bf16.f32)") {
  return mma_kat<bf16_t>();
}

// ------------------------------------------------------------------------------ ldmatrix
// PTX ISA 9.0 §9.7.14.5.15 "Warp-level matrix load instruction: ldmatrix" (.m8n8, .b16):
//   * threads 0-7 give the row addresses of matrix 0, 8-15 of matrix 1, 16-23 of matrix 2,
//     24-31 of matrix 3; .x1 uses threads 0-7 only, .x2 threads 0-15 (sm_80: the other
//     threads' addresses are ignored). Rows need not be contiguous; each is 16 bytes,
//     16-byte aligned.
//   * Figure "ldmatrix fragment layout for one 8x8 Matrix with 16-bit elements": thread L
//     receives row L/4, elements 2*(L%4) and 2*(L%4)+1 (the first in the low half);
//     matrix i goes to destination register i.
//   * .trans: the matrix is read in column-major order, so thread L receives elements
//     (2*(L%4), L/4) and (2*(L%4)+1, L/4).

// Where row r of matrix m lives: rows of the four matrices interleaved, in reverse matrix
// order, 48 bytes apart -- deliberately not one contiguous 8x8 block.
constexpr int kRowSlot = 48;
HD int row_offset(int m, int r) { return (r * 4 + (3 - m)) * kRowSlot; }
constexpr int kImageBytes = 32 * kRowSlot;
uint16_t element(int m, int r, int c) { return uint16_t(0x1000 * (m + 1) + r * 16 + c); }

struct LdmatrixIo {
  unsigned char image[kImageBytes];
  uint32_t out[32][4];
};

template <int kNum, bool kTrans>
__global__ void ldmatrix_kat_kernel(LdmatrixIo* io) {
  FMHA_DYNAMIC_SHARED(unsigned char, smem);
  const int lane = threadIdx.x;
  for (int i = lane; i < kImageBytes; i += 32) smem[i] = io->image[i];
  __syncthreads();  // the image is complete before any lane's ldmatrix reads it
  const int m = lane / 8, r = lane % 8;
  const void* row = m < kNum ? static_cast<const void*>(smem + row_offset(m, r)) : nullptr;
  uint32_t regs[kNum];
  ldmatrix<kNum, kTrans>(regs, row);
  for (int i = 0; i < kNum; ++i) io->out[lane][i] = regs[i];
}

template <int kNum, bool kTrans>
Result ldmatrix_kat() {
  LdmatrixIo io{};
  for (int m = 0; m < 4; ++m)
    for (int r = 0; r < 8; ++r)
      for (int c = 0; c < 8; ++c) {
        const uint16_t v = element(m, r, c);
        std::memcpy(io.image + row_offset(m, r) + 2 * c, &v, 2);
      }
  auto kernel = &ldmatrix_kat_kernel<kNum, kTrans>;
  FMHA_LAUNCH(kernel, dim3(1), dim3(32), kImageBytes, nullptr, &io);
  for (int lane = 0; lane < 32; ++lane)
    for (int m = 0; m < kNum; ++m) {
      const int r0 = kTrans ? 2 * (lane % 4) : lane / 4, c0 = kTrans ? lane / 4 : 2 * (lane % 4);
      const int r1 = kTrans ? r0 + 1 : r0, c1 = kTrans ? c0 : c0 + 1;
      const uint32_t want = pack(element(m, r0, c0), element(m, r1, c1));
      if (io.out[lane][m] != want) {
        char buf[256];
        std::snprintf(buf, sizeof buf,
                      "lane %d register %d = 0x%08x, expected 0x%08x (matrix %d, elements "
                      "(%d,%d) low, (%d,%d) high)",
                      lane, m, io.out[lane][m], want, m, r0, c0, r1, c1);
        return fail(buf);
      }
    }
  return pass();
}

#define LDMATRIX_CITE "PTX ISA 9.0 §9.7.14.5.15 Warp-level matrix load instruction: ldmatrix"
EMU_TEST("kat.ldmatrix_x1", LDMATRIX_CITE " (.m8n8.x1.b16)") { return ldmatrix_kat<1, false>(); }
EMU_TEST("kat.ldmatrix_x2", LDMATRIX_CITE " (.m8n8.x2.b16)") { return ldmatrix_kat<2, false>(); }
EMU_TEST("kat.ldmatrix_x4", LDMATRIX_CITE " (.m8n8.x4.b16)") { return ldmatrix_kat<4, false>(); }
EMU_TEST("kat.ldmatrix_x1_trans", LDMATRIX_CITE " (.m8n8.x1.trans.b16)") {
  return ldmatrix_kat<1, true>();
}
EMU_TEST("kat.ldmatrix_x2_trans", LDMATRIX_CITE " (.m8n8.x2.trans.b16)") {
  return ldmatrix_kat<2, true>();
}
EMU_TEST("kat.ldmatrix_x4_trans", LDMATRIX_CITE " (.m8n8.x4.trans.b16)") {
  return ldmatrix_kat<4, true>();
}

// ldmatrix feeding mma, the recipe of the GEMM and attention kernels: A (16x16 row-major)
// by ldmatrix.x4 with lane L addressing row L%16, column 8*(L/16) -- matrices (rows 0-7 |
// 8-15) x (cols 0-7 | 8-15) in the order of registers a0..a3 -- and B (16x8, stored
// row-major k x n) by ldmatrix.x2.trans with lane L addressing row k = L%16: the transposed
// 8x8 blocks are exactly the B fragment (row = 2*(L%4) + {0,1}, col = L/4).
struct LdmatrixMmaIo {
  uint16_t a[16][16], b[16][8];
  float d[16][8];
};

template <typename T>
__global__ void ldmatrix_mma_kernel(LdmatrixMmaIo* io) {
  __shared__ __align__(16) uint16_t sa[16][16];
  __shared__ __align__(16) uint16_t sb[16][8];
  const int lane = threadIdx.x;
  for (int i = lane; i < 256; i += 32) sa[i / 16][i % 16] = io->a[i / 16][i % 16];
  for (int i = lane; i < 128; i += 32) sb[i / 8][i % 8] = io->b[i / 8][i % 8];
  __syncthreads();  // both tiles are complete before the warp loads fragments
  uint32_t a[4], b[2];
  ldmatrix<4>(a, &sa[lane % 16][(lane / 16) * 8]);
  ldmatrix<2, true>(b, &sb[lane % 16][0]);
  float d[4], c[4] = {0, 0, 0, 0};
  mma_m16n8k16<T>(d, a, b, c);
  for (int i = 0; i < 4; ++i) io->d[c_row(lane, i)][c_col(lane, i)] = d[i];
}

template <typename T>
Result ldmatrix_mma_kat() {
  LdmatrixMmaIo io{};
  float A[16][16], B[16][8];
  uint32_t s = 777;
  auto next = [&] { s = s * 1664525u + 1013904223u; return float(int((s >> 24) % 15) - 7); };
  for (int r = 0; r < 16; ++r)
    for (int k = 0; k < 16; ++k) io.a[r][k] = bits16<T>(A[r][k] = next());
  for (int k = 0; k < 16; ++k)
    for (int n = 0; n < 8; ++n) io.b[k][n] = bits16<T>(B[k][n] = next());
  auto kernel = &ldmatrix_mma_kernel<T>;
  FMHA_LAUNCH(kernel, dim3(1), dim3(32), 0, nullptr, &io);
  for (int r = 0; r < 16; ++r)
    for (int n = 0; n < 8; ++n) {
      double want = 0;
      for (int k = 0; k < 16; ++k) want += double(A[r][k]) * B[k][n];
      if (io.d[r][n] != float(want))
        return fail(fmt(("D[" + std::to_string(r) + "][" + std::to_string(n) + "] = %g, expected %g")
                            .c_str(),
                        io.d[r][n], want));
    }
  return pass();
}
EMU_TEST("kat.ldmatrix_mma_f16", LDMATRIX_CITE " (.x4, .x2.trans) feeding §9.7.14.5.14 mma "
                                               "with §9.7.14.5.8 fragments (f16)") {
  return ldmatrix_mma_kat<half_t>();
}
EMU_TEST("kat.ldmatrix_mma_bf16", LDMATRIX_CITE " (.x4, .x2.trans) feeding §9.7.14.5.14 mma "
                                                "with §9.7.14.5.8 fragments (bf16)") {
  return ldmatrix_mma_kat<bf16_t>();
}

// ------------------------------------------------------------------------------ shuffles
// CUDA Programming Guide, "Warp Shuffle Functions" (__shfl_sync, __shfl_up_sync,
// __shfl_down_sync, __shfl_xor_sync), implemented by PTX ISA 9.0 §9.7.9.6 shfl.sync:
//   idx:  the value of lane srcLane modulo width, within the caller's segment of `width`
//   up:   lane - delta, unless that leaves the segment (the lower delta lanes keep theirs)
//   down: lane + delta, unless that leaves the segment (the upper delta lanes keep theirs)
//   xor:  lane ^ laneMask; a lane may read an earlier segment, reading a later one returns
//         its own value
enum Mode { kIdx, kUp, kDown, kXor };
struct ShflCase {
  Mode mode;
  int b, width;
};
int expected_source(const ShflCase& s, int lane) {
  const int w = s.width, seg = lane / w;
  switch (s.mode) {
    case kIdx: return seg * w + s.b % w;
    case kUp: return lane % w >= s.b ? lane - s.b : lane;
    case kDown: return lane % w + s.b < w ? lane + s.b : lane;
    case kXor: return (lane ^ s.b) / w <= seg ? lane ^ s.b : lane;
  }
  return -1;
}

constexpr int kMaxShflCases = 128;
struct ShflIo {
  ShflCase cases[kMaxShflCases];
  int n;
  uint32_t out[kMaxShflCases][32];
};

__global__ void shfl_kat_kernel(ShflIo* io) {
  const int lane = threadIdx.x;
  const uint32_t v = 0xA000u + lane;
  for (int i = 0; i < io->n; ++i) {
    const ShflCase s = io->cases[i];
    uint32_t r = 0;
    switch (s.mode) {
      case kIdx: r = shfl_idx(v, s.b, s.width); break;
      case kUp: r = shfl_up(v, s.b, s.width); break;
      case kDown: r = shfl_down(v, s.b, s.width); break;
      case kXor: r = shfl_xor(v, s.b, s.width); break;
    }
    io->out[i][lane] = r;
  }
}

Result shfl_kat(Mode mode, std::initializer_list<int> bs) {
  static ShflIo io;
  io = ShflIo{};
  for (int w : {32, 16, 8, 4, 2, 1})
    for (int b : bs) io.cases[io.n++] = {mode, b, w};
  FMHA_LAUNCH(shfl_kat_kernel, dim3(1), dim3(32), 0, nullptr, &io);
  for (int i = 0; i < io.n; ++i)
    for (int lane = 0; lane < 32; ++lane) {
      const uint32_t want = 0xA000u + expected_source(io.cases[i], lane);
      if (io.out[i][lane] != want) {
        char buf[200];
        std::snprintf(buf, sizeof buf, "b=%d width=%d lane %d: got lane %d's value, expected lane %d's",
                      io.cases[i].b, io.cases[i].width, lane, int(io.out[i][lane]) - 0xA000,
                      int(want) - 0xA000);
        return fail(buf);
      }
    }
  return pass();
}

#define SHFL_CITE "CUDA Programming Guide, Warp Shuffle Functions; PTX ISA 9.0 §9.7.9.6 shfl.sync"
EMU_TEST("kat.shfl_idx", SHFL_CITE " (.idx)") { return shfl_kat(kIdx, {0, 1, 5, 15, 31, 37}); }
EMU_TEST("kat.shfl_up", SHFL_CITE " (.up)") { return shfl_kat(kUp, {0, 1, 3, 8, 16, 31}); }
EMU_TEST("kat.shfl_down", SHFL_CITE " (.down)") { return shfl_kat(kDown, {0, 1, 3, 8, 16, 31}); }
EMU_TEST("kat.shfl_xor", SHFL_CITE " (.bfly)") { return shfl_kat(kXor, {0, 1, 2, 5, 16, 31}); }

// Floats go through shuffles bit-exactly (the butterfly reduction of a row maximum).
__global__ void shfl_reduce_kernel(float* out) {
  const int lane = threadIdx.x;
  float v = float((lane * 13) % 32) - 7.5f;
  for (int m = 16; m >= 1; m /= 2) v = fmaxf(v, shfl_xor(v, m));
  out[lane] = v;
}
EMU_TEST("kat.shfl_xor_reduce", SHFL_CITE " (.bfly on f32: butterfly max reduction)") {
  float out[32];
  FMHA_LAUNCH(shfl_reduce_kernel, dim3(1), dim3(32), 0, nullptr, out);
  for (int lane = 0; lane < 32; ++lane)
    if (out[lane] != 31.0f - 7.5f) return fail(fmt("lane max %g, expected %g", out[lane], 23.5));
  return pass();
}

// ------------------------------------------------------------------------------ ballot
// PTX ISA 9.0 §9.7.13.9 vote.sync: .ballot.b32 -- bit L of the result is lane L's predicate.
__global__ void ballot_kernel(uint32_t* out) {
  const int lane = threadIdx.x;
  out[3 * lane + 0] = warp_ballot((lane * 7) % 5 < 2);
  out[3 * lane + 1] = warp_ballot(true);
  out[3 * lane + 2] = warp_ballot(lane == 31);
}
EMU_TEST("kat.ballot", "PTX ISA 9.0 §9.7.13.9 vote.sync (.ballot.b32)") {
  uint32_t out[96];
  FMHA_LAUNCH(ballot_kernel, dim3(1), dim3(32), 0, nullptr, out);
  uint32_t want = 0;
  for (int l = 0; l < 32; ++l) want |= uint32_t((l * 7) % 5 < 2) << l;
  for (int lane = 0; lane < 32; ++lane)
    if (out[3 * lane] != want || out[3 * lane + 1] != 0xFFFFFFFFu || out[3 * lane + 2] != 0x80000000u)
      return fail("lane " + std::to_string(lane) + ": wrong ballot mask");
  return pass();
}

// ------------------------------------------------------------------------- __syncthreads_or
// PTX ISA 9.0 §9.7.13.1 bar.red.or.pred (CUDA's __syncthreads_or): a block barrier that
// returns nonzero to every thread iff some thread's predicate was nonzero. Rounds back to
// back, so a result must not leak into the next round.
__global__ void syncthreads_or_kernel(int* out) {
  const int tid = threadIdx.x;
  out[4 * tid + 0] = __syncthreads_or(tid == 95);  // only the last thread: true
  out[4 * tid + 1] = __syncthreads_or(0);          // nobody: false right after a true
  out[4 * tid + 2] = __syncthreads_or(tid % 7 == 3 ? 5 : 0);
  out[4 * tid + 3] = __syncthreads_or(0);
}
EMU_TEST("kat.syncthreads_or", "PTX ISA 9.0 §9.7.13.1 bar.red.or.pred (__syncthreads_or)") {
  int out[4 * 96];
  FMHA_LAUNCH(syncthreads_or_kernel, dim3(1), dim3(96), 0, nullptr, out);
  for (int tid = 0; tid < 96; ++tid)
    if (!out[4 * tid] || out[4 * tid + 1] || !out[4 * tid + 2] || out[4 * tid + 3])
      return fail("thread " + std::to_string(tid) + ": wrong __syncthreads_or result");
  return pass();
}

// ------------------------------------------------------------------------------ cp.async
// PTX ISA 9.0 §9.7.9.25.3.1 cp.async: cp-size bytes to shared memory, of which src-size are
// read from global memory and the rest zero-filled. §9.7.9.25.3.2 cp.async.commit_group: the
// thread's uncommitted copies form a group. §9.7.9.25.3.3 cp.async.wait_group N: waits
// until at most N of the most recent groups are pending (groups complete in commit order);
// the copies' writes are then visible to the thread.
struct alignas(16) CpAsyncIo {
  unsigned char src[32][48];
  unsigned char out[32][48];
  int early_ok[32];
};

__global__ void cp_async_kernel(CpAsyncIo* io) {
  FMHA_DYNAMIC_SHARED(unsigned char, smem);
  const int lane = threadIdx.x;
  unsigned char* dst = smem + lane * 48;
  cp_async_16(dst, io->src[lane]);  // group 1: 16 bytes
  cp_async_commit();
  cp_async_16(dst + 16, io->src[lane] + 16, 8);  // group 2: 8 bytes read, 8 zero-filled
  cp_async_16<true>(dst + 32, io->src[lane], 0);  // ... and nothing read, 16 zero-filled
  cp_async_commit();
  cp_async_wait<1>();  // group 1 complete (group 2 may still be in flight)
  int same = 1;
  for (int i = 0; i < 16; ++i) same &= dst[i] == io->src[lane][i];
  io->early_ok[lane] = same;
  cp_async_wait<0>();
  for (int i = 0; i < 48; ++i) io->out[lane][i] = dst[i];
}

EMU_TEST("kat.cp_async",
         "PTX ISA 9.0 §9.7.9.25.3.1 cp.async (src-size zero fill), §9.7.9.25.3.2 "
         "cp.async.commit_group, §9.7.9.25.3.3 cp.async.wait_group") {
  static CpAsyncIo io;
  for (int l = 0; l < 32; ++l)
    for (int i = 0; i < 48; ++i) io.src[l][i] = uint8_t(l * 48 + i + 1);
  FMHA_LAUNCH(cp_async_kernel, dim3(1), dim3(32), 32 * 48, nullptr, &io);
  for (int l = 0; l < 32; ++l) {
    if (!io.early_ok[l]) return fail("lane " + std::to_string(l) + ": group 1 not complete after wait_group 1");
    for (int i = 0; i < 48; ++i) {
      const uint8_t want = i < 16 ? io.src[l][i] : i < 24 ? io.src[l][i] : 0;
      if (io.out[l][i] != want)
        return fail("lane " + std::to_string(l) + " byte " + std::to_string(i) + ": got " +
                    std::to_string(io.out[l][i]) + ", expected " + std::to_string(want));
    }
  }
  return pass();
}

// ------------------------------------------------------------------------------ cvt
// PTX ISA 9.0 §9.7.9.21 cvt: .rn rounds to the nearest representable value, ties to even;
// NaN inputs produce the canonical NaN 0x7FFF (as cuda_fp16/cuda_bf16's host conversions).
// IEEE 754 binary16: 1 sign, 5 exponent (bias 15), 10 fraction bits; largest finite 65504,
// smallest subnormal 2^-24. bfloat16: the upper 16 bits of binary32.
struct CvtCase {
  uint32_t f32;
  uint16_t want;
};

float f32(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

__global__ void cvt_kernel(const float* in, uint16_t* h, uint16_t* bf, uint32_t* packed_h,
                           uint32_t* packed_bf, FloatPair* unpacked_h, FloatPair* unpacked_bf,
                           int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    h[i] = bits_of(from_float<half_t>(in[i]));
    bf[i] = bits_of(from_float<bf16_t>(in[i]));
    packed_h[i] = pack2<half_t>(in[i], -in[i]);
    packed_bf[i] = pack2<bf16_t>(in[i], -in[i]);
    unpacked_h[i] = unpack2<half_t>(packed_h[i]);
    unpacked_bf[i] = unpack2<bf16_t>(packed_bf[i]);
  }
}

// The value of 16-bit float bits, exactly (binary16, or bfloat16: binary32's upper half).
float decode16(uint16_t x, bool bf16) {
  if (bf16) return f32(uint32_t(x) << 16);
  const int e = (x >> 10) & 0x1F, m = x & 0x3FF;
  const float sign = (x & 0x8000u) ? -1.0f : 1.0f;
  if (e == 0x1F) return m ? std::numeric_limits<float>::quiet_NaN() : sign * INFINITY;
  return sign * std::ldexp(float(e ? m + 1024 : m), (e ? e : 1) - 25);
}

Result cvt_kat(bool bf16_case, std::initializer_list<CvtCase> cases) {
  std::vector<float> in;
  for (const CvtCase& c : cases) in.push_back(f32(c.f32));
  const int n = int(in.size());
  const size_t count = static_cast<size_t>(n);
  std::vector<uint16_t> h(count), bf(count);
  std::vector<uint32_t> ph(count), pb(count);
  std::vector<FloatPair> uh(count), ub(count);
  FMHA_LAUNCH(cvt_kernel, dim3(1), dim3(32), 0, nullptr, in.data(), h.data(), bf.data(),
              ph.data(), pb.data(), uh.data(), ub.data(), n);
  int i = 0;
  for (const CvtCase& c : cases) {
    const uint16_t got = bf16_case ? bf[size_t(i)] : h[size_t(i)];
    const uint32_t packed = bf16_case ? pb[size_t(i)] : ph[size_t(i)];
    char buf[200];
    if (got != c.want) {
      std::snprintf(buf, sizeof buf, "0x%08x (%g) -> 0x%04x, expected 0x%04x", c.f32,
                    double(f32(c.f32)), got, c.want);
      return fail(buf);
    }
    // cvt.rn.{f16x2,bf16x2}.f32 d, a, b puts a in the upper half: pack2(lo, hi).
    const uint16_t neg = (c.want & 0x7FFFu) > (bf16_case ? 0x7F80u : 0x7C00u)
                             ? c.want                      // NaN stays canonical
                             : uint16_t(c.want ^ 0x8000u);  // -x: the sign flips
    if ((packed & 0xFFFFu) != c.want || (packed >> 16) != neg) {
      std::snprintf(buf, sizeof buf, "pack2(0x%08x, -x) = 0x%08x, expected 0x%04x%04x", c.f32,
                    packed, neg, c.want);
      return fail(buf);
    }
    // unpack2 gives back both halves' values exactly, lo first (NaN as NaN).
    const FloatPair u = bf16_case ? ub[size_t(i)] : uh[size_t(i)];
    const float lo = decode16(c.want, bf16_case), hi = decode16(neg, bf16_case);
    auto same = [](float a, float b) {
      return std::isnan(a) ? std::isnan(b) : std::memcmp(&a, &b, 4) == 0;
    };
    if (!same(u.x, lo) || !same(u.y, hi)) {
      std::snprintf(buf, sizeof buf, "unpack2(0x%08x) = (%g, %g), expected (%g, %g)", packed,
                    double(u.x), double(u.y), double(lo), double(hi));
      return fail(buf);
    }
    ++i;
  }
  return pass();
}

EMU_TEST("kat.cvt_f16", "PTX ISA 9.0 §9.7.9.21 cvt (.rn.f16.f32, .rn.f16x2.f32); IEEE 754 binary16") {
  return cvt_kat(false, {
      {0x3F800000u, 0x3C00u},  // 1
      {0xC0000000u, 0xC000u},  // -2
      {0x00000000u, 0x0000u},  // +0
      {0x80000000u, 0x8000u},  // -0
      {0x477FE000u, 0x7BFFu},  // 65504, the largest finite
      {0x477FEFFFu, 0x7BFFu},  // just below 65520: rounds down
      {0x477FF000u, 0x7C00u},  // 65520: the tie between 65504 (odd) and 2^16 -> infinity
      {0x4E6E6B28u, 0x7C00u},  // 1e9 -> infinity
      {0x7F800000u, 0x7C00u},  // +inf
      {0xFF800000u, 0xFC00u},  // -inf
      {0x7FC00000u, 0x7FFFu},  // NaN -> canonical NaN
      {0xFFC00001u, 0x7FFFu},  // -NaN with payload -> canonical NaN
      {0x3F801000u, 0x3C00u},  // 1 + 2^-11: tie between 1 and 1 + 2^-10 -> even (1)
      {0x3F803000u, 0x3C02u},  // 1 + 3*2^-11: tie -> even (1 + 2^-9)
      {0x3F801001u, 0x3C01u},  // just above the tie: rounds up
      {0x38800000u, 0x0400u},  // 2^-14, the smallest normal
      {0x387FC000u, 0x03FFu},  // 2^-14 - 2^-24, the largest subnormal
      {0x387FE000u, 0x0400u},  // 2^-14 - 2^-25: tie between 0x3FF (odd) and 0x400 -> 0x400
      {0x33800000u, 0x0001u},  // 2^-24, the smallest subnormal
      {0x33000000u, 0x0000u},  // 2^-25: tie between 0 (even) and 2^-24 -> 0
      {0x33000001u, 0x0001u},  // just above 2^-25 -> 2^-24
      {0x33C00000u, 0x0002u},  // 1.5*2^-24: tie between 1 (odd) and 2 -> 2
      {0x34200000u, 0x0002u},  // 2.5*2^-24: tie between 2 (even) and 3 -> 2
      {0xB3C00000u, 0x8002u},  // -1.5*2^-24 -> -2*2^-24
      {0x00000001u, 0x0000u},  // the smallest f32 subnormal -> 0
      {0x80000001u, 0x8000u},  // ... keeps its sign
      {0x40490FDBu, 0x4248u},  // pi -> 3.140625
  });
}

EMU_TEST("kat.cvt_bf16", "PTX ISA 9.0 §9.7.9.21 cvt (.rn.bf16.f32, .rn.bf16x2.f32)") {
  return cvt_kat(true, {
      {0x3F800000u, 0x3F80u},  // 1
      {0xC0000000u, 0xC000u},  // -2
      {0x80000000u, 0x8000u},  // -0
      {0x3F808000u, 0x3F80u},  // 1 + 2^-8: tie -> even (1)
      {0x3F818000u, 0x3F82u},  // 1 + 3*2^-8: tie -> even (1 + 2^-6)
      {0x3F808001u, 0x3F81u},  // above the tie: up
      {0x3F807FFFu, 0x3F80u},  // below the tie: down
      {0x7F7F7FFFu, 0x7F7Fu},  // below the tie under the largest finite bf16
      {0x7F7F8000u, 0x7F80u},  // tie between 0x7F7F (odd) and infinity -> infinity
      {0x7F7FFFFFu, 0x7F80u},  // FLT_MAX -> infinity
      {0x7F800000u, 0x7F80u},  // +inf
      {0xFF800000u, 0xFF80u},  // -inf
      {0x7FC00000u, 0x7FFFu},  // NaN -> canonical NaN
      {0x7F800001u, 0x7FFFu},  // signalling NaN -> canonical NaN
      {0x00008000u, 0x0000u},  // subnormal tie -> even (0)
      {0x00018000u, 0x0002u},  // subnormal tie -> even (2)
      {0x00010000u, 0x0001u},  // a subnormal bf16 is kept, not flushed
      {0x40490FDBu, 0x4049u},  // pi -> 3.140625
  });
}

// f16 -> f32 and bf16 -> f32 are exact: every one of the 65536 encodings, decoded by the
// binary16 definition (value = (-1)^s * 2^(e-15) * (1 + f/1024); e = 0: f * 2^-24).
__global__ void widen_kernel(float* h, float* bf) {
  for (int i = threadIdx.x; i < 65536; i += blockDim.x) {
    h[i] = to_float(from_bits<half_t>(uint16_t(i)));
    bf[i] = to_float(from_bits<bf16_t>(uint16_t(i)));
  }
}
EMU_TEST("kat.widen", "IEEE 754 binary16 / bfloat16 decoding (cvt.f32.f16, cvt.f32.bf16, "
                      "PTX ISA 9.0 §9.7.9.21): exact for all 65536 encodings") {
  std::vector<float> h(65536), bf(65536);
  FMHA_LAUNCH(widen_kernel, dim3(1), dim3(256), 0, nullptr, h.data(), bf.data());
  for (int i = 0; i < 65536; ++i) {
    const int s = i >> 15, e = (i >> 10) & 31, f = i & 1023;
    double v;
    if (e == 31) v = f ? std::nan("") : std::numeric_limits<double>::infinity();
    else if (e == 0) v = std::ldexp(double(f), -24);
    else v = std::ldexp(1.0 + f / 1024.0, e - 15);
    if (s) v = -v;
    const float got = h[size_t(i)];
    if (std::isnan(v) ? !std::isnan(got) : double(got) != v || std::signbit(got) != bool(s))
      return fail(fmt("f16 bits -> %g, expected %g", got, v));
    const uint32_t wide = uint32_t(i) << 16;
    uint32_t gotb;
    std::memcpy(&gotb, &bf[size_t(i)], 4);
    if (gotb != wide) return fail(fmt("bf16 widening of %g wrong (%g)", double(i), double(gotb)));
  }
  return pass();
}

// ------------------------------------------------------------------------------ ex2
// PTX ISA 9.0 §9.7.3.21 ex2.approx.ftz.f32: 2^x, maximum relative error about 2^-22 in the
// normal range; ex2(-inf) = +0, ex2(+inf) = +inf, NaN -> NaN; .ftz: subnormal results are
// flushed to sign-preserving zero.
__global__ void ex2_kernel(const float* in, float* out, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = exp2_approx(in[i]);
}
EMU_TEST("kat.ex2", "PTX ISA 9.0 §9.7.3.21 ex2 (.approx.ftz.f32)") {
  std::vector<float> in = {0.0f, 1.0f, -1.0f, 10.0f, -126.0f, 127.0f, -127.0f, -140.0f, 128.0f,
                           -std::numeric_limits<float>::infinity(),
                           std::numeric_limits<float>::infinity(), std::nanf("")};
  for (int i = 0; i < 2000; ++i) in.push_back(-100.0f + 0.1f * float(i) + 0.0123f);
  std::vector<float> out(in.size());
  FMHA_LAUNCH(ex2_kernel, dim3(1), dim3(32), 0, nullptr, in.data(), out.data(), int(in.size()));
  const float exact[] = {1.0f, 2.0f, 0.5f, 1024.0f, std::ldexp(1.0f, -126), std::ldexp(1.0f, 127),
                         0.0f /* 2^-127 is subnormal: flushed */, 0.0f, 0.0f /* overflow: inf */,
                         0.0f};
  for (int i = 0; i < 10; ++i) {
    const float want = i == 8 ? std::numeric_limits<float>::infinity() : exact[i];
    if (out[size_t(i)] != want) return fail(fmt("ex2(%g) = %g", in[size_t(i)], out[size_t(i)]));
  }
  if (!(std::isinf(out[10]) && out[10] > 0)) return fail("ex2(+inf) is not +inf");
  if (!std::isnan(out[11])) return fail("ex2(NaN) is not NaN");
  for (size_t i = 12; i < in.size(); ++i) {
    const double want = std::exp2(double(in[i]));
    if (std::fabs(out[i] - want) > std::ldexp(want, -22))
      return fail(fmt("ex2(%g) relative error %g > 2^-22", in[i], std::fabs(out[i] - want) / want));
  }
  return pass();
}

// ------------------------------------------------------------------------------ atomics
// PTX ISA 9.0 §9.7.13.5 atom (.add.f32): an indivisible read-modify-write returning the old
// value. 256 threads in 2 blocks each add 1.0 to one counter: the counter ends at 256, and
// the old values the threads see are 0..255, each exactly once.
__global__ void atomic_kernel(float* counter, float* olds, float* halves) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  olds[i] = atomic_add(counter, 1.0f);
  atomic_add(&halves[threadIdx.x % 4], 0.5f);
}
EMU_TEST("kat.atomic_add", "PTX ISA 9.0 §9.7.13.5 atom (.add.f32)") {
  float counter = 0.0f, halves[4] = {0, 0, 0, 0};
  std::vector<float> olds(256);
  FMHA_LAUNCH(atomic_kernel, dim3(2), dim3(128), 0, nullptr, &counter, olds.data(), halves);
  if (counter != 256.0f) return fail(fmt("counter %g, expected %g", counter, 256));
  std::vector<int> seen(256, 0);
  for (float o : olds) {
    const int k = int(o);
    if (float(k) != o || k < 0 || k >= 256 || seen[size_t(k)]++) return fail("old values are not 0..255 once each");
  }
  for (float h : halves)
    if (h != 32.0f) return fail(fmt("per-slot sum %g, expected %g", h, 32));
  return pass();
}

}  // namespace
