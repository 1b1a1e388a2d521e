// The AMX model (amx_model.h) and the tile-program interpreter of amx.h. Compiled once, with
// the core's portable flags: the model is plain C++ and runs on every host.
#include "cpu/amx_model.h"

#include <atomic>
#include <cfenv>
#include <cmath>
#include <cstring>
#include <memory>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#include "cpu/amx.h"
#include "fmha/error.h"

namespace fmha::cpu::amx {

namespace {
std::atomic<int> g_planted_fault{kPlantedNone};
}  // namespace
int planted_fault() { return g_planted_fault.load(std::memory_order_relaxed); }
void set_planted_fault(int fault) { g_planted_fault.store(fault, std::memory_order_relaxed); }

TileState& thread_tiles() {
  static thread_local TileState s;
  return s;
}

namespace {

[[noreturn]] void fault(const char* kind, const std::string& why) {
  throw InvalidArgument(concat("AMX model: ", kind, ": ", why));
}

void check_name(int t, const char* insn) {
  if (t < 0 || t >= kTiles) fault("#UD", concat(insn, ": tmm", t, " is not a tile of palette 1"));
}

void check_configured(const TileState& s, const char* insn) {
  if (!s.configured) fault("#UD", concat(insn, ": the tiles are not configured (LDTILECFG first)"));
}

// A tile the instruction reads or writes must be configured with rows and colsb (LDTILECFG
// marks a tile valid exactly when both are non-zero).
void check_valid(const TileState& s, int t, const char* insn) {
  check_name(t, insn);
  if (s.cfg.rows[t] == 0 || s.cfg.colsb[t] == 0)
    fault("#UD", concat(insn, ": tmm", t, " is not configured (rows or colsb 0)"));
}

void zero_rows_from(TileState& s, int t, int first) {  // the SDM's zero_upper_rows
  for (int r = first; r < kMaxRows; ++r) std::memset(s.data[t][r], 0, kMaxColsb);
}

// ---- numbers (TDPBF16PS) ----

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint32_t to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// DAZ and FTZ (SDM Vol. 1, 10.2.3.3-4): a denormal operand is read, and a denormal result
// written, as a zero of its sign. One bit operation serves both.
float flush(float x) {
  const uint32_t u = to_bits(x);
  return (u & 0x7f800000u) == 0 ? from_bits(u & 0x80000000u) : x;
}

// make_fp32 of the TDPBF16PS entry: the bfloat16 bits in the upper half of an fp32.
float make_fp32(uint16_t b) { return from_bits(uint32_t(b) << 16); }

uint16_t bf16_at(const TileState& s, int t, int row, int element) {
  uint16_t v;
  std::memcpy(&v, &s.data[t][row][2 * element], 2);
  return v;
}

// "MXCSR is not consulted nor updated" (TDPBF16PS): the model's float arithmetic runs under
// round-to-nearest-even with FTZ and DAZ off whatever the caller set (denormals are flushed
// explicitly by flush()), and the caller's state is restored afterwards. Elsewhere than x86
// only the rounding direction is pinned.
class NearestEven {
 public:
  NearestEven() {
#if defined(__x86_64__) || defined(__i386__)
    saved_ = _mm_getcsr();
    _mm_setcsr(0x1f80);  // all exceptions masked, round to nearest, FTZ = DAZ = 0
#else
    saved_ = std::fegetround();
    std::fesetround(FE_TONEAREST);
#endif
  }
  ~NearestEven() {
#if defined(__x86_64__) || defined(__i386__)
    _mm_setcsr(saved_);
#else
    std::fesetround(int(saved_));
#endif
  }
  NearestEven(const NearestEven&) = delete;
  NearestEven& operator=(const NearestEven&) = delete;

 private:
  unsigned saved_;
};

}  // namespace

// LDTILECFG (SDM Vol. 2, "LDTILECFG -- Load Tile Configuration", Operation).
void ldtilecfg(TileState& s, const void* config) {
  uint8_t buf[64];
  std::memcpy(buf, config, 64);
  TileConfig c;
  std::memcpy(&c, buf, 64);
  if (c.palette_id > 1) fault("#GP", concat("LDTILECFG: palette ", int(c.palette_id), " (only 0 and 1 exist)"));
  if (c.palette_id == 0) return tilerelease(s);
  for (int i = 2; i < 16; ++i)
    if (buf[i]) fault("#GP", concat("LDTILECFG: reserved byte ", i, " is not zero"));
  for (int i = 32; i < 48; ++i)  // the bytes per row of tmm8-15
    if (buf[i]) fault("#GP", concat("LDTILECFG: reserved byte ", i, " (tmm8-15) is not zero"));
  for (int i = 56; i < 64; ++i)  // the rows of tmm8-15
    if (buf[i]) fault("#GP", concat("LDTILECFG: reserved byte ", i, " (tmm8-15) is not zero"));
  for (int t = 0; t < kTiles; ++t) {
    if (c.colsb[t] > kMaxColsb) fault("#GP", concat("LDTILECFG: tmm", t, " colsb ", c.colsb[t], " > 64"));
    if (c.rows[t] > kMaxRows) fault("#GP", concat("LDTILECFG: tmm", t, " rows ", int(c.rows[t]), " > 16"));
    if ((c.rows[t] == 0) != (c.colsb[t] == 0))
      fault("#GP", concat("LDTILECFG: tmm", t, " has one of rows and colsb zero but not both"));
  }
  // Palette 1 leaves the tile data as it was (the pseudo-code zeroes it only for palette 0).
  s.cfg = c;
  s.configured = true;
}

// STTILECFG (SDM Vol. 2, "STTILECFG -- Store Tile Configuration", Operation).
void sttilecfg(const TileState& s, void* config) {
  TileConfig c;  // all zero
  if (s.configured) {
    c.palette_id = s.cfg.palette_id;
    c.start_row = s.cfg.start_row;
    for (int t = 0; t < kTiles; ++t) {
      c.colsb[t] = s.cfg.colsb[t];
      c.rows[t] = s.cfg.rows[t];
    }
  }
  std::memcpy(config, &c, 64);
}

// TILERELEASE (SDM Vol. 2, "TILERELEASE -- Release Tile"): the INIT state.
void tilerelease(TileState& s) {
  s.configured = false;
  s.cfg = TileConfig{};
  std::memset(s.data, 0, sizeof s.data);
}

// TILELOADD (SDM Vol. 2, "TILELOADD/TILELOADDT1 -- Load Tile", Operation).
void tileloadd(TileState& s, int t, const void* base, int64_t stride) {
  check_configured(s, "TILELOADD");
  check_valid(s, t, "TILELOADD");
  const int start = s.cfg.start_row, rows = s.cfg.rows[t], nbytes = s.cfg.colsb[t];
  zero_rows_from(s, t, start);
  for (int r = start; r < rows; ++r) {
    std::memcpy(s.data[t][r], static_cast<const uint8_t*>(base) + r * stride, size_t(nbytes));
    std::memset(s.data[t][r] + nbytes, 0, size_t(kMaxColsb - nbytes));  // write_row_and_zero
  }
  s.cfg.start_row = 0;  // zero_tilecfg_start
}

// TILESTORED (SDM Vol. 2, "TILESTORED -- Store Tile", Operation).
void tilestored(TileState& s, int t, void* base, int64_t stride) {
  check_configured(s, "TILESTORED");
  check_valid(s, t, "TILESTORED");
  for (int r = s.cfg.start_row; r < s.cfg.rows[t]; ++r)
    std::memcpy(static_cast<uint8_t*>(base) + r * stride, s.data[t][r], s.cfg.colsb[t]);
  s.cfg.start_row = 0;
}

// TILEZERO (SDM Vol. 2, "TILEZERO -- Zero Tile", Operation): the palette's whole tile.
void tilezero(TileState& s, int t) {
  check_configured(s, "TILEZERO");
  check_name(t, "TILEZERO");
  zero_rows_from(s, t, 0);
  s.cfg.start_row = 0;
}

namespace {

// On x86-64 Linux the steps below are compiled also for AVX-512 and AVX2 and the widest this
// CPU runs is picked once (GCC's target_clones): the same IEEE operations at any width -- an
// FMA the compiler may fuse from the product and the sum equals them, the product being exact
// -- so the model's results never depend on the host.
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__)
#define FMHA_AMX_MODEL_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define FMHA_AMX_MODEL_CLONES
#endif

// One row of TDPBF16PS's partial sums: for k = 0 .. K-1, temp[i] = FMA(a[2k + (i & 1)], b[k][i],
// temp[i]) for i < n2 (= 2N), each step rounded once and flushed. The product of two bf16
// values has at most 16 significant bits, so it is exact in fp32 unless it leaves fp32's normal
// range; then the fp32 product followed by the fp32 sum rounds once, exactly as the FMA does,
// and the loop is that vectorisable form. Returns whether some step's product of finite
// non-zero operands is not a normal fp32 (below 2^-126, or overflow; products in
// [FLT_MAX, 2^128) do not exist for 8-bit significands): the caller then redoes the row with
// std::fma, step by step in the same order.
FMHA_AMX_MODEL_CLONES
bool fma_steps(const float* a, const float (*b)[2 * kMaxColsb / 4], int K, int n2, float* temp) {
  int bad = 0;
  for (int k = 0; k < K; ++k) {
    alignas(64) float ak[2 * kMaxColsb / 4];
    for (int i = 0; i < n2; ++i) ak[i] = a[2 * k + (i & 1)];
    const float* bk = b[k];
    for (int i = 0; i < n2; ++i) {
      const float prod = ak[i] * bk[i];
      uint32_t ua, ub, up;
      std::memcpy(&ua, &ak[i], 4);
      std::memcpy(&ub, &bk[i], 4);
      std::memcpy(&up, &prod, 4);
      ua &= 0x7fffffffu;
      ub &= 0x7fffffffu;
      up &= 0x7fffffffu;
      bad |= int(ua != 0) & int(ub != 0) & int(ua < 0x7f800000u) & int(ub < 0x7f800000u) &
             (int(up < 0x00800000u) | int(up == 0x7f800000u));
      float sum = prod + temp[i];
      uint32_t us;
      std::memcpy(&us, &sum, 4);
      temp[i] = (us & 0x7f800000u) == 0 ? (us & 0x80000000u ? -0.0f : 0.0f) : sum;  // FTZ
    }
  }
  return bad != 0;
}

}  // namespace

// TDPBF16PS (SDM Vol. 2, "TDPBF16PS -- Dot Product of BF16 Tiles Accumulated into Packed
// Single Precision Tile", Description and Operation). For each row m of C:
//   - two fp32 partial sums per output column n, temp[2n] and temp[2n+1], start at +0;
//   - for k = 0 .. K-1 in order, temp[2n+j] += A[m] bf16 element 2k+j * B[k] bf16 element
//     2n+j (j = 0, 1), each step one fused multiply-add rounded once to fp32, nearest-even,
//     inputs denormal-as-zero and a denormal result flushed to zero ("FP32 FMA with
//     DAZ=FTZ=1, RNE rounding");
//   - then C[m][n] := C[m][n] + (temp[2n] + temp[2n+1]), each of the two additions rounded to
//     fp32 nearest-even with DAZ and FTZ;
//   - the bytes of the row past C's colsb, and the rows past C's rows, are zeroed.
// The shapes must agree (M: C.rows = A.rows; K: A.colsb / 4 = B.rows; N: C.colsb = B.colsb;
// every colsb a multiple of 4) and the three tiles differ; otherwise the hardware raises #UD
// (SDM Vol. 2, 2.10, "Intel AMX Instruction Exception Classes").
void tdpbf16ps(TileState& s, int c, int a, int b) {
  static const char* kInsn = "TDPBF16PS";
  check_configured(s, kInsn);
  check_valid(s, c, kInsn);
  check_valid(s, a, kInsn);
  check_valid(s, b, kInsn);
  if (c == a || c == b || a == b)
    fault("#UD", concat(kInsn, ": tmm", c, ", tmm", a, ", tmm", b, " are not three tiles"));
  const TileConfig& g = s.cfg;
  if (g.colsb[c] % 4 || g.colsb[a] % 4 || g.colsb[b] % 4)
    fault("#UD", concat(kInsn, ": colsb not a multiple of 4 (", g.colsb[c], ", ", g.colsb[a], ", ",
                        g.colsb[b], ")"));
  const int M = g.rows[c], N = g.colsb[c] / 4, K = g.colsb[a] / 4;
  if (g.rows[a] != M) fault("#UD", concat(kInsn, ": A has ", int(g.rows[a]), " rows, C ", M));
  if (g.rows[b] != K) fault("#UD", concat(kInsn, ": B has ", int(g.rows[b]), " rows, A ", K, " pairs per row"));
  if (g.colsb[b] != g.colsb[c]) fault("#UD", concat(kInsn, ": B has ", g.colsb[b], " bytes per row, C ", g.colsb[c]));
  NearestEven rne;
  // The operands once, as fp32 with denormals read as zero: row m of A as its 2K elements,
  // row k of B as its 2N elements (the even and odd element of each column's pair).
  alignas(64) float av[kMaxRows][2 * kMaxColsb / 4], bv[kMaxRows][2 * kMaxColsb / 4];
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < 2 * K; ++i) av[m][i] = flush(make_fp32(bf16_at(s, a, m, i)));
  for (int k = 0; k < K; ++k)
    for (int i = 0; i < 2 * N; ++i) bv[k][i] = flush(make_fp32(bf16_at(s, b, k, i)));
  if (planted_fault() == kPlantedModelFault) {  // a test hook: the odd elements of A ignored
    for (int m = 0; m < M; ++m)
      for (int i = 1; i < 2 * K; i += 2) av[m][i] = 0.0f;
  }
  for (int m = 0; m < M; ++m) {
    alignas(64) float temp[2 * kMaxColsb / 4];
    for (int i = 0; i < 2 * N; ++i) temp[i] = 0.0f;
    // The steps in their vectorisable form, or, where a product is not exact, one std::fma
    // each (fma_steps).
    if (fma_steps(av[m], bv, K, 2 * N, temp)) {
      for (int i = 0; i < 2 * N; ++i) temp[i] = 0.0f;
      for (int k = 0; k < K; ++k)
        for (int i = 0; i < 2 * N; ++i)
          temp[i] = flush(std::fma(av[m][2 * k + (i & 1)], bv[k][i], temp[i]));
    }
    for (int n = 0; n < N; ++n) {
      float acc;
      std::memcpy(&acc, &s.data[c][m][4 * n], 4);
      const float pair = flush(temp[2 * n] + temp[2 * n + 1]);
      acc = flush(flush(acc) + pair);
      std::memcpy(&s.data[c][m][4 * n], &acc, 4);
    }
    std::memset(s.data[c][m] + 4 * N, 0, size_t(kMaxColsb - 4 * N));
  }
  zero_rows_from(s, c, M);
  s.cfg.start_row = 0;
}

// ---- the tile-program interpreter (amx.h) ----

namespace {

// The bytes [lo, hi) must lie in mem[0, bytes).
void check_span(int64_t lo, int64_t hi, int64_t bytes, int64_t i) {
  FMHA_CHECK_ARG(lo >= 0 && hi <= bytes, "tile program instruction ", i, ": touches bytes [", lo,
                 ", ", hi, ") of a ", bytes, "-byte buffer");
}

// The rows a TILELOADD / TILESTORED of tile t at (offset, stride) touches.
void check_rows(const TileState& s, int t, int64_t offset, int64_t stride, int64_t bytes, int64_t i) {
  if (!s.configured || t < 0 || t >= kTiles) return;  // the model faults first
  for (int r = s.cfg.start_row; r < s.cfg.rows[t]; ++r)
    check_span(offset + r * stride, offset + r * stride + s.cfg.colsb[t], bytes, i);
}

}  // namespace

void run_tile_program(TileState& s, const int64_t* program, int64_t n, uint8_t* mem,
                      int64_t bytes) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t* w = program + kWordsPerInstr * i;
    const int t0 = int(w[1]), t1 = int(w[2]), t2 = int(w[3]);
    const int64_t offset = w[4], stride = w[5];
    switch (TileOp(w[0])) {
      case TileOp::kLdtilecfg: check_span(offset, offset + 64, bytes, i); ldtilecfg(s, mem + offset); break;
      case TileOp::kSttilecfg: check_span(offset, offset + 64, bytes, i); sttilecfg(s, mem + offset); break;
      case TileOp::kTilerelease: tilerelease(s); break;
      case TileOp::kTileloadd:
        check_rows(s, t0, offset, stride, bytes, i);
        tileloadd(s, t0, mem + offset, stride);
        break;
      case TileOp::kTilestored:
        check_rows(s, t0, offset, stride, bytes, i);
        tilestored(s, t0, mem + offset, stride);
        break;
      case TileOp::kTilezero: tilezero(s, t0); break;
      case TileOp::kTdpbf16ps: tdpbf16ps(s, t0, t1, t2); break;
      default: throw InvalidArgument(concat("tile program instruction ", i, ": unknown op ", w[0]));
    }
  }
}

void run_tile_program_model(const int64_t* program, int64_t n, uint8_t* mem, int64_t bytes) {
  auto s = std::make_unique<TileState>();  // a fresh INIT state for each program
  run_tile_program(*s, program, n, mem, bytes);
}

}  // namespace fmha::cpu::amx
