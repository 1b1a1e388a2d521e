// The AMX tile instructions as the bfloat16 tile kernels call them: two backends with one
// interface, so that a kernel is written once as a template on its backend.
//   - ModelTiles: the software model (cpu/amx_model.h) on this thread's model tiles; runs on
//     every host, and is what the AMX level's correctness suite runs where there is no AMX.
//   - HardwareTiles: the instructions themselves, compiled only in a translation unit built
//     with -mamx-tile -mamx-bf16 (cmake/cpu_core.cmake: FMHA_CPU_HAVE_AMX_HW), and reached
//     only when fmha::amx_usable() (fmha/api.h): the CPU has AMX-TILE and AMX-BF16, the OS
//     saves the tile state, and Linux granted this process the tile data.
// Tile numbers are template parameters because the hardware encodes them in the instruction.
//
// Also here: the encoding of a "tile program" (a list of these instructions over one byte
// buffer) that the tests run through either backend to hold the model to its definition and
// the hardware to the model (tests/kernels/test_amx.py).
#pragma once

#include <cstdint>

#include "cpu/amx_model.h"
#include "fmha/isa_tag.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#endif

namespace fmha::cpu::amx {
// The inline code below is compiled in translation units with different ISA flags: each gets
// its own copy (fmha/isa_tag.h), so the linker never hands one unit another's.
inline namespace FMHA_ISA_TAG {

struct ModelTiles {
  static void load_config(const TileConfig& c) { ldtilecfg(thread_tiles(), &c); }
  static void store_config(TileConfig& c) { sttilecfg(thread_tiles(), &c); }
  static void release() { tilerelease(thread_tiles()); }
  template <int T>
  static void load(const void* base, int64_t stride) { tileloadd(thread_tiles(), T, base, stride); }
  template <int T>
  static void store(void* base, int64_t stride) { tilestored(thread_tiles(), T, base, stride); }
  template <int T>
  static void zero() { tilezero(thread_tiles(), T); }
  template <int C, int A, int B>
  static void dpbf16ps() {
    static_assert(C != A && C != B && A != B, "TDPBF16PS takes three different tiles");
    tdpbf16ps(thread_tiles(), C, A, B);
  }
};

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// The intrinsics of TILELOADD, TILESTORED, TILEZERO and TDPBF16PS paste their tile numbers into
// the instruction text, so they cannot take a template parameter: the same instructions are
// written here with the tile number as an immediate operand (%c: the bare constant). The memory
// operand is the SIB form these instructions require, (base, stride, 1).
struct HardwareTiles {
  static void load_config(const TileConfig& c) { _tile_loadconfig(&c); }
  static void store_config(TileConfig& c) { _tile_storeconfig(&c); }
  static void release() { _tile_release(); }
  template <int T>
  static void load(const void* base, int64_t stride) {
    asm volatile("tileloadd (%0,%1,1), %%tmm%c2" : : "r"(base), "r"(stride), "i"(T) : "memory");
  }
  template <int T>
  static void store(void* base, int64_t stride) {
    asm volatile("tilestored %%tmm%c2, (%0,%1,1)" : : "r"(base), "r"(stride), "i"(T) : "memory");
  }
  template <int T>
  static void zero() { asm volatile("tilezero %%tmm%c0" : : "i"(T)); }
  template <int C, int A, int B>
  static void dpbf16ps() {
    static_assert(C != A && C != B && A != B, "TDPBF16PS takes three different tiles");
    asm volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" : : "i"(C), "i"(A), "i"(B));
  }
};
#endif

// The peak probe's loop (cpu/probes.h), on either backend: four accumulators tmm0-3, each
// 16 x 16 fp32, fed by two A tiles (tmm4-5, 16 rows of 32 bf16) and two B tiles (tmm6-7,
// 16 pair rows of 16 columns), so that consecutive TDPBF16PS do not wait on each other; each
// is 16 * 16 * 32 * 2 FLOPs. a and b: 1024 bytes each; c: 4 x 1024 bytes out.
constexpr double kTdpbf16psFlops = 16.0 * 16 * 32 * 2;
template <class Tiles>
void tdpbf16ps_chain(long iters, const void* a, const void* b, float* c) {
  TileConfig cfg;
  cfg.palette_id = 1;
  for (int t = 0; t < kTiles; ++t) {
    cfg.rows[t] = kMaxRows;
    cfg.colsb[t] = kMaxColsb;
  }
  Tiles::load_config(cfg);
  Tiles::template zero<0>();
  Tiles::template zero<1>();
  Tiles::template zero<2>();
  Tiles::template zero<3>();
  Tiles::template load<4>(a, kMaxColsb);
  Tiles::template load<5>(a, kMaxColsb);
  Tiles::template load<6>(b, kMaxColsb);
  Tiles::template load<7>(b, kMaxColsb);
  for (long i = 0; i < iters; ++i) {
    Tiles::template dpbf16ps<0, 4, 6>();
    Tiles::template dpbf16ps<1, 4, 7>();
    Tiles::template dpbf16ps<2, 5, 6>();
    Tiles::template dpbf16ps<3, 5, 7>();
  }
  Tiles::template store<0>(c, kMaxColsb);
  Tiles::template store<1>(c + 256, kMaxColsb);
  Tiles::template store<2>(c + 512, kMaxColsb);
  Tiles::template store<3>(c + 768, kMaxColsb);
  Tiles::release();
}

}  // namespace FMHA_ISA_TAG

// ---- tile programs: kWordsPerInstr int64 words per instruction, {op, t0, t1, t2, offset,
// stride}; offsets are into one byte buffer. LDTILECFG / STTILECFG: the 64-byte image at
// offset. TILELOADD / TILESTORED: tile t0 at (offset, stride). TILEZERO: t0. TDPBF16PS:
// C = t0, A = t1, B = t2.
enum class TileOp : int64_t {
  kLdtilecfg = 1, kSttilecfg = 2, kTilerelease = 3, kTileloadd = 4, kTilestored = 5,
  kTilezero = 6, kTdpbf16ps = 7,
};
constexpr int kWordsPerInstr = 6;

// Runs a program on the model tiles `s`, checking first that every byte an instruction
// touches lies in mem[0, bytes) (InvalidArgument otherwise), as the model checks each
// instruction's own rules.
void run_tile_program(TileState& s, const int64_t* program, int64_t n, uint8_t* mem, int64_t bytes);
// The same on a fresh (INIT) model state.
void run_tile_program_model(const int64_t* program, int64_t n, uint8_t* mem, int64_t bytes);

}  // namespace fmha::cpu::amx

// The translation unit built with the AMX instructions (cpu/amx_hardware.cpp; present when
// FMHA_CPU_HAVE_AMX_HW): call only when fmha::amx_usable().
namespace fmha::cpu::amx_hw {
// A tile program on the hardware tiles, unchecked: run it through the model first.
void run_tile_program(const int64_t* program, int64_t n, uint8_t* mem);
double amx_bf16_peak_gflops(int threads);
}  // namespace fmha::cpu::amx_hw
