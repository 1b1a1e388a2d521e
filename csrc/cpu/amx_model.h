// A software model of the AMX instructions the bfloat16 tile kernels use (palette 1 of
// AMX-TILE, and AMX-BF16's TDPBF16PS), so that the code written for the tiles runs -- and is
// tested -- on every host, and so that the hardware has a reference to be held to bitwise.
//
// The semantics are the operation sections of the Intel 64 and IA-32 Architectures Software
// Developer's Manual, Volume 2 (instruction set reference), entries LDTILECFG, STTILECFG,
// TILERELEASE, TILELOADD/TILELOADDT1, TILESTORED, TILEZERO and TDPBF16PS; each function below
// names the entry it follows. The tile state is per thread, as on the hardware (the tile
// configuration and data are part of each thread's XSAVE state): thread_tiles() is this
// thread's.
//
// A fault the hardware raises (#GP from LDTILECFG, #UD from a tile instruction on unconfigured
// tiles or on shapes TDPBF16PS cannot multiply) is an InvalidArgument here, its message naming
// the rule; the hardware would kill the process instead.
#pragma once

#include <cstdint>

namespace fmha::cpu::amx {

// Palette 1 (LDTILECFG, "The only legal non-INIT value for palette_id is 1"): 8 tiles tmm0-7,
// each at most 16 rows of 64 bytes.
constexpr int kTiles = 8;
constexpr int kMaxRows = 16;
constexpr int kMaxColsb = 64;

// The 64-byte memory image LDTILECFG reads and STTILECFG writes (SDM, LDTILECFG, "Memory Area
// Layout"): palette, start_row, 14 reserved bytes, the bytes per row of tmm0-15 (16-bit each;
// 8-15 reserved under palette 1), the rows of tmm0-15 (8-15 reserved).
struct TileConfig {
  uint8_t palette_id = 0;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG reads 64 bytes");

// One thread's tile registers: the configuration (TILES_CONFIGURED and TILECFG in the SDM's
// pseudo-code) and the data of tmm0-7.
struct TileState {
  bool configured = false;
  TileConfig cfg;
  alignas(64) uint8_t data[kTiles][kMaxRows][kMaxColsb] = {};
};

// This thread's model tiles.
TileState& thread_tiles();

// LDTILECFG: checks the image as the SDM's pseudo-code does (#GP: palette > 1, a reserved
// byte set, colsb > 64 or rows > 16, one of a tile's rows and colsb zero but not the other);
// palette 0 returns to the INIT state (tiles unconfigured, all tile data zeroed).
void ldtilecfg(TileState& s, const void* config);
// STTILECFG: the configuration, or 64 zero bytes when the tiles are not configured.
void sttilecfg(const TileState& s, void* config);
// TILERELEASE: the INIT state, as LDTILECFG with palette 0.
void tilerelease(TileState& s);
// TILELOADD (TILELOADDT1 is the same load with a cache hint): rows start_row..rows-1 of tile t
// from base + row * stride, colsb bytes each; rows below start_row keep their data, the bytes
// past colsb and the rows past `rows` are zeroed; start_row is then reset to 0.
void tileloadd(TileState& s, int t, const void* base, int64_t stride);
// TILESTORED: rows start_row..rows-1 of tile t to base + row * stride, colsb bytes each.
void tilestored(TileState& s, int t, void* base, int64_t stride);
// TILEZERO: every byte of tile t (all 16 rows of 64 bytes).
void tilezero(TileState& s, int t);
// TDPBF16PS tmm_c, tmm_a, tmm_b: C (M x N fp32) += A (M x K bf16 pairs) . B (K x N bf16 pairs,
// the pair layout: B row k holds, for each column n, the pair (B[2k][n], B[2k+1][n])), in the
// order and rounding of the SDM's operation section -- see amx_model.cpp.
void tdpbf16ps(TileState& s, int c, int a, int b);

// Planted faults, for the tests that show the AMX level's suite catches a wrong model or a
// wrong kernel (tests/kernels/test_amx.py): set only through the testing build's probe
// fmha._C.amx_plant_fault; 0 (none) otherwise. kPlantedModelFault: the model's TDPBF16PS
// reads the odd element of each of A's pairs as zero. kPlantedRepackFault: the AMX forward
// swaps the two halves of P's pair words before P V (csrc/cpu/amx_gemm.h).
constexpr int kPlantedNone = 0, kPlantedModelFault = 1, kPlantedRepackFault = 2;
int planted_fault();
void set_planted_fault(int fault);

}  // namespace fmha::cpu::amx
