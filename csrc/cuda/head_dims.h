// The head-dim tiles of the CUDA kernels, and which of them this build compiled.
//
// kHeadDimTiles is the one list of tiles: cmake/cuda_config.cmake (FMHA_KNOWN_HEAD_DIM_TILES)
// and tools/generate_instantiations.py (the instantiation files) read it from this file,
// so keep its definition on one line. Every CUDA kernel is instantiated per tile; a head_dim
// runs in the smallest built tile >= head_dim, its extra columns zero-padded. CMake's
// FMHA_CUDA_HEAD_DIMS (e.g. "64;128") limits the build; it reaches the dispatchers as the
// bit mask FMHA_CUDA_HDIM_MASK (bit i = kHeadDimTiles[i]). Without it, every tile is built.
#pragma once

#include <type_traits>

namespace fmha {
namespace gpu {

constexpr int kHeadDimTiles[] = {32, 64, 96, 128, 256};
constexpr int kNumHeadDimTiles = int(sizeof(kHeadDimTiles) / sizeof(kHeadDimTiles[0]));

#ifdef FMHA_CUDA_HDIM_MASK
constexpr unsigned kBuiltHeadDimTiles = FMHA_CUDA_HDIM_MASK;
#else
constexpr unsigned kBuiltHeadDimTiles = ~0u;  // every tile
#endif

constexpr bool head_dim_tile_built(int tile) {
  for (int i = 0; i < kNumHeadDimTiles; ++i)
    if (kHeadDimTiles[i] == tile) return (kBuiltHeadDimTiles >> i) & 1;
  return false;
}

// The smallest built tile that holds head_dim and is at most max_tile; 0 when none.
inline int head_dim_tile(int head_dim, int max_tile = 256) {
  for (int i = 0; i < kNumHeadDimTiles; ++i)
    if (head_dim <= kHeadDimTiles[i] && kHeadDimTiles[i] <= max_tile &&
        ((kBuiltHeadDimTiles >> i) & 1))
      return kHeadDimTiles[i];
  return 0;
}

namespace detail {
template <int I, typename F>
bool with_head_dim_tile_from(int tile, F& f) {
  if constexpr (I == kNumHeadDimTiles) {
    return false;
  } else {
    constexpr int kTile = kHeadDimTiles[I];
    if constexpr (head_dim_tile_built(kTile)) {
      if (tile == kTile) {
        f(std::integral_constant<int, kTile>{});
        return true;
      }
    }
    return with_head_dim_tile_from<I + 1>(tile, f);
  }
}
}  // namespace detail

// The runtime tile -> a compile-time one: calls f(std::integral_constant<int, kTile>{}) for
// the built tile equal to `tile` and returns true; false when no built tile equals it.
// Only built tiles are ever passed to f, so a dispatcher never names the launcher of a tile
// whose instantiation file this build did not compile.
template <typename F>
bool with_head_dim_tile(int tile, F&& f) {
  return detail::with_head_dim_tile_from<0>(tile, f);
}

}  // namespace gpu
}  // namespace fmha
