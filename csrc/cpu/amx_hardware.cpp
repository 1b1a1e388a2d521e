// The only translation unit built with the AMX instructions (-mamx-tile -mamx-bf16 and no
// other ISA flag: whatever inline code the linker might take from here is baseline x86-64).
// Nothing here runs unless fmha::amx_usable() (fmha/dispatch.cpp checks before each call).
#define FMHA_CPU_ISA_NS amx_hw
#include "cpu/probes.h"

#include <array>
#include <utility>

#include "cpu/amx.h"

namespace fmha::cpu::amx_hw {
namespace {

using Hw = amx::HardwareTiles;
using Load = void (*)(const void*, int64_t);
using Store = void (*)(void*, int64_t);
using Zero = void (*)();
using Dot = void (*)();

// Tables from a run-time tile number to the instruction with that number encoded.
template <size_t... T>
constexpr std::array<Load, sizeof...(T)> loads(std::index_sequence<T...>) { return {&Hw::load<T>...}; }
template <size_t... T>
constexpr std::array<Store, sizeof...(T)> stores(std::index_sequence<T...>) { return {&Hw::store<T>...}; }
template <size_t... T>
constexpr std::array<Zero, sizeof...(T)> zeros(std::index_sequence<T...>) { return {&Hw::zero<T>...}; }

template <size_t I>
void dot() {
  constexpr int c = int(I / 64), a = int(I / 8 % 8), b = int(I % 8);
  if constexpr (c != a && c != b && a != b) Hw::dpbf16ps<c, a, b>();
}
template <size_t... I>
constexpr std::array<Dot, sizeof...(I)> dots(std::index_sequence<I...>) { return {&dot<I>...}; }

constexpr auto kLoad = loads(std::make_index_sequence<amx::kTiles>());
constexpr auto kStore = stores(std::make_index_sequence<amx::kTiles>());
constexpr auto kZero = zeros(std::make_index_sequence<amx::kTiles>());
constexpr auto kDot = dots(std::make_index_sequence<amx::kTiles * amx::kTiles * amx::kTiles>());

}  // namespace

void run_tile_program(const int64_t* program, int64_t n, uint8_t* mem) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t* w = program + amx::kWordsPerInstr * i;
    const int t0 = int(w[1]), t1 = int(w[2]), t2 = int(w[3]);
    uint8_t* p = mem + w[4];
    switch (amx::TileOp(w[0])) {
      case amx::TileOp::kLdtilecfg: _tile_loadconfig(p); break;
      case amx::TileOp::kSttilecfg: _tile_storeconfig(p); break;
      case amx::TileOp::kTilerelease: _tile_release(); break;
      case amx::TileOp::kTileloadd: kLoad[size_t(t0)](p, w[5]); break;
      case amx::TileOp::kTilestored: kStore[size_t(t0)](p, w[5]); break;
      case amx::TileOp::kTilezero: kZero[size_t(t0)](); break;
      case amx::TileOp::kTdpbf16ps: kDot[size_t(t0 * 64 + t1 * 8 + t2)](); break;
    }
  }
  _tile_release();  // leave this thread's tiles in the INIT state, as the model's run does
}

}  // namespace fmha::cpu::amx_hw
