// The AMX tile products of the bfloat16 kernels at the amx level (instantiate_amx.cpp), written
// once as templates on the tile backend (cpu/amx.h: ModelTiles or HardwareTiles). Included by
// every kernel translation unit so that forward.h names them in one source, but instantiated
// only by the amx level's.
//
// Tile plan (docs/cpu_kernels.md, "The AMX kernels"): every tile is configured as 16 rows of
// 64 bytes -- an A tile is 16 rows of 16 bf16 pairs (32 elements along the reduction), a B
// tile 16 pair rows of 16 columns, a C tile 16 x 16 fp32. A product runs in blocks of up to
// 2 x 2 C tiles (tmm0-3) fed by two A tiles (tmm4-5) and two B tiles (tmm6-7), so that the
// four TDPBF16PS of a step do not wait on each other.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu/amx.h"
#include "cpu/simd.h"
#include "fmha/numeric.h"

namespace fmha::cpu::FMHA_CPU_ISA_NS {

// The forward without tiles (every level below amx, and the amx level's other dtypes).
struct NoTiles {};

// Rows of 16 and pairs of 16 per tile.
constexpr int kTileRows = amx::kMaxRows;
constexpr int kTilePairs = amx::kMaxColsb / 4;
inline int tiles_for(int n) { return (n + kTileRows - 1) / kTileRows; }

// This thread's tiles configured for the kernel's products (all eight 16 x 64 bytes) for the
// scope of one task, and released at its end: a task never relies on, or leaves behind, tile
// state of another (the pool's threads run other work between tasks, and a thread whose
// tiles are released saves and restores no tile data on a context switch).
template <class Tiles>
class TileScope {
 public:
  TileScope() {
    amx::TileConfig cfg;
    cfg.palette_id = 1;
    for (int t = 0; t < amx::kTiles; ++t) {
      cfg.rows[t] = uint8_t(amx::kMaxRows);
      cfg.colsb[t] = uint16_t(amx::kMaxColsb);
    }
    Tiles::load_config(cfg);
  }
  ~TileScope() { Tiles::release(); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

// One block of MB x NB C tiles: C (+)= A B over kt steps of 16 pairs. A: MB * 16 rows of
// pair words, lda words apart; B: kt * 16 pair rows of NB * 16 words, ldb words apart; C: MB *
// 16 rows of NB * 16 floats, ldc apart. C tile (i, j) is tmm(2i + j).
template <class Tiles, int MB, int NB>
inline void tile_block(int kt, const uint32_t* A, int64_t lda, const uint32_t* B, int64_t ldb,
                       float* C, int64_t ldc, bool accumulate) {
  const int64_t sa = lda * 4, sb = ldb * 4, sc = ldc * 4;  // strides in bytes
  float* c1 = C + kTileRows;
  float* c2 = C + int64_t(kTileRows) * ldc;
  float* c3 = c2 + kTileRows;
  if (accumulate) {
    Tiles::template load<0>(C, sc);
    if constexpr (NB == 2) Tiles::template load<1>(c1, sc);
    if constexpr (MB == 2) Tiles::template load<2>(c2, sc);
    if constexpr (MB == 2 && NB == 2) Tiles::template load<3>(c3, sc);
  } else {
    Tiles::template zero<0>();
    if constexpr (NB == 2) Tiles::template zero<1>();
    if constexpr (MB == 2) Tiles::template zero<2>();
    if constexpr (MB == 2 && NB == 2) Tiles::template zero<3>();
  }
  for (int k = 0; k < kt; ++k) {
    const uint32_t* a = A + int64_t(k) * kTilePairs;
    const uint32_t* b = B + int64_t(k) * kTilePairs * ldb;
    Tiles::template load<4>(a, sa);
    if constexpr (MB == 2) Tiles::template load<5>(a + int64_t(kTileRows) * lda, sa);
    Tiles::template load<6>(b, sb);
    if constexpr (NB == 2) Tiles::template load<7>(b + kTileRows, sb);
    Tiles::template dpbf16ps<0, 4, 6>();
    if constexpr (NB == 2) Tiles::template dpbf16ps<1, 4, 7>();
    if constexpr (MB == 2) Tiles::template dpbf16ps<2, 5, 6>();
    if constexpr (MB == 2 && NB == 2) Tiles::template dpbf16ps<3, 5, 7>();
  }
  Tiles::template store<0>(C, sc);
  if constexpr (NB == 2) Tiles::template store<1>(c1, sc);
  if constexpr (MB == 2) Tiles::template store<2>(c2, sc);
  if constexpr (MB == 2 && NB == 2) Tiles::template store<3>(c3, sc);
}

// C (mt * 16 x nt * 16 fp32) (+)= A (mt * 16 rows x kt * 16 pair words) B (kt * 16 pair rows x
// nt * 16 words), in blocks of 2 x 2 tiles (and 2 x 1, 1 x 2, 1 x 1 at the edges). Every
// word of A and B in those ranges must hold finite values or zeros where they pad the true
// extent: tiles have no masks.
template <class Tiles>
inline void tile_gemm(int mt, int nt, int kt, const uint32_t* A, int64_t lda, const uint32_t* B,
                      int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  for (int i = 0; i < mt; i += 2) {
    const uint32_t* a = A + int64_t(i) * kTileRows * lda;
    float* c = C + int64_t(i) * kTileRows * ldc;
    for (int j = 0; j < nt; j += 2) {
      const bool two_m = i + 1 < mt, two_n = j + 1 < nt;
      const uint32_t* b = B + int64_t(j) * kTileRows;
      float* cj = c + int64_t(j) * kTileRows;
      if (two_m && two_n) tile_block<Tiles, 2, 2>(kt, a, lda, b, ldb, cj, ldc, accumulate);
      else if (two_m) tile_block<Tiles, 2, 1>(kt, a, lda, b, ldb, cj, ldc, accumulate);
      else if (two_n) tile_block<Tiles, 1, 2>(kt, a, lda, b, ldb, cj, ldc, accumulate);
      else tile_block<Tiles, 1, 1>(kt, a, lda, b, ldb, cj, ldc, accumulate);
    }
  }
}

// C (M x N fp32, row stride ldc) (+)= A B on tiles, for operands in the pair GEMM's layouts
// (gemm.h): A(i, kp) = A[i * a_rs + kp * a_cs] for K pair words per row, B's K pair rows of N
// words (ldb apart), N a multiple of 16. What the tiles cannot read in place -- A not row by
// row, a partial 16-row or 16-pair step -- is copied, zero-padded, into this thread's staging
// buffers; so is C when M is not a multiple of 16, so that no tile reads or writes past the
// operands' rows. The caller holds this thread's tiles configured (TileScope).
template <class Tiles, bool kAcc>
inline void tile_gemm_pairs(int M, int N, int K, const uint32_t* A, int64_t a_rs, int64_t a_cs,
                            const uint32_t* B, int64_t ldb, float* C, int64_t ldc) {
  thread_local std::vector<uint32_t> a_buf, b_buf;
  thread_local std::vector<float> c_buf;
  const int mt = tiles_for(M), kt = (K + kTilePairs - 1) / kTilePairs;
  const uint32_t* a = A;
  int64_t lda = a_rs;
  if (a_cs != 1 || M % kTileRows != 0 || K % kTilePairs != 0) {
    lda = int64_t(kt) * kTilePairs;
    a_buf.assign(size_t(mt * kTileRows * lda), 0u);
    for (int i = 0; i < M; ++i)
      for (int kp = 0; kp < K; ++kp) a_buf[size_t(i * lda + kp)] = A[i * a_rs + kp * a_cs];
    a = a_buf.data();
  }
  const uint32_t* b = B;
  int64_t ldb_t = ldb;
  if (K % kTilePairs != 0) {
    ldb_t = N;
    b_buf.assign(size_t(kt) * kTilePairs * N, 0u);
    for (int kp = 0; kp < K; ++kp)
      std::memcpy(b_buf.data() + int64_t(kp) * N, B + kp * ldb, size_t(N) * sizeof(uint32_t));
    b = b_buf.data();
  }
  float* c = C;
  int64_t ldc_t = ldc;
  if (M % kTileRows != 0) {
    ldc_t = N;
    c_buf.assign(size_t(mt) * kTileRows * N, 0.0f);
    if (kAcc)
      for (int i = 0; i < M; ++i)
        std::memcpy(c_buf.data() + int64_t(i) * N, C + i * ldc, size_t(N) * sizeof(float));
    c = c_buf.data();
  }
  tile_gemm<Tiles>(mt, N / kTileRows, kt, a, lda, b, ldb_t, c, ldc_t, kAcc);
  if (c != C)
    for (int i = 0; i < M; ++i)
      std::memcpy(C + i * ldc, c + int64_t(i) * N, size_t(N) * sizeof(float));
}

// K's key tile as the A operand of Sᵀ = K Qᵀ: rows [0, nc) of bf16 (rows, d) at row stride
// `stride`, as pair words along d. Read in place when the tiles' reads stay inside the rows
// (d a multiple of 32, whole 16-row tiles, even stride, 4-byte aligned); otherwise repacked
// once per key tile into `buf` (tiles_for(nc) * 16 rows of kpad words, ld kpad), zero past
// d and past nc. Returns the words; *ld receives their row stride in words.
inline const uint32_t* k_tile_words(const bf16_t* src, int64_t stride, int nc, int d, int kpad,
                                    uint32_t* buf, int64_t* ld) {
  if (d % (2 * kTilePairs) == 0 && nc % kTileRows == 0 && stride % 2 == 0 &&
      reinterpret_cast<uintptr_t>(src) % 4 == 0) {
    *ld = stride / 2;
    return reinterpret_cast<const uint32_t*>(src);
  }
  const int rows = tiles_for(nc) * kTileRows;
  for (int r = 0; r < rows; ++r) {
    uint32_t* out = buf + int64_t(r) * kpad;
    std::memset(out, 0, size_t(kpad) * 4);
    if (r < nc) std::memcpy(out, src + r * stride, size_t(d) * sizeof(bf16_t));
  }
  *ld = kpad;
  return buf;
}

// P's rows as the A operand of O += P V: P2 holds pair words along the keys in the GEMM's
// layout (P2[kp * ld2 + i]: rows i along a word row, pack_float_pairs), rounded exactly as the
// avx512bf16 level rounds P; out receives them row by row (out[i * ldo + kp]) for mt * 16
// rows and kt * 16 words, zero for rows i >= m and words kp >= kpn. P2 must have kt * 16 word
// rows of at least mt * 16 words: the padding is zeroed there first, then moved as 16 x 16
// word blocks (AVX-512: through registers).
inline void p_rows_words(uint32_t* P2, int ld2, int m, int kpn, int mt, int kt, uint32_t* out,
                         int ldo) {
  const int rows = mt * kTileRows, words = kt * kTilePairs;
  for (int kp = 0; kp < words; ++kp) {
    uint32_t* w = P2 + int64_t(kp) * ld2;
    std::memset(w + (kp < kpn ? m : 0), 0, size_t(rows - (kp < kpn ? m : 0)) * sizeof(uint32_t));
  }
  for (int i0 = 0; i0 < rows; i0 += kTileRows)
    for (int k0 = 0; k0 < words; k0 += kTilePairs) {
#if defined(FMHA_SIMD_AVX512)
      __m512 x[16];
      for (int j = 0; j < 16; ++j)
        x[j] = _mm512_loadu_ps(reinterpret_cast<const float*>(P2 + int64_t(k0 + j) * ld2 + i0));
      transpose16(x);
      for (int t = 0; t < 16; ++t)
        _mm512_storeu_ps(reinterpret_cast<float*>(out + int64_t(i0 + t) * ldo + k0), x[t]);
#else
      for (int t = 0; t < kTileRows; ++t)
        for (int j = 0; j < kTilePairs; ++j)
          out[int64_t(i0 + t) * ldo + k0 + j] = P2[int64_t(k0 + j) * ld2 + i0 + t];
#endif
    }
  if (amx::planted_fault() == amx::kPlantedRepackFault)  // a test hook (amx_model.h)
    for (int i = 0; i < m; ++i)
      for (int kp = 0; kp < kpn; ++kp) {
        uint32_t& w = out[int64_t(i) * ldo + kp];
        w = (w >> 16) | (w << 16);
      }
}

}  // namespace fmha::cpu::FMHA_CPU_ISA_NS
