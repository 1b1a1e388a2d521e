// The head-dim tiles of the CUDA kernels, and which of them this build compiled.
//
// Every CUDA kernel is instantiated per head-dim tile (32, 64, 96, 128, 256); a head_dim
// runs in the smallest built tile >= head_dim, its extra columns zero-padded. CMake's
// FMHA_CUDA_HEAD_DIMS (e.g. "64;128") limits the build; it reaches the dispatchers as the
// bit mask FMHA_CUDA_HDIM_MASK (bit i = kHeadDimTiles[i]). Without it, every tile is built.
#pragma once

#ifndef FMHA_CUDA_HDIM_MASK
#define FMHA_CUDA_HDIM_MASK 0x1F
#endif

namespace fmha {
namespace gpu {

constexpr int kHeadDimTiles[] = {32, 64, 96, 128, 256};
constexpr int kNumHeadDimTiles = 5;

constexpr bool head_dim_tile_built(int tile) {
  for (int i = 0; i < kNumHeadDimTiles; ++i)
    if (kHeadDimTiles[i] == tile) return (FMHA_CUDA_HDIM_MASK >> i) & 1;
  return false;
}

// The smallest built tile that holds head_dim and is at most max_tile; 0 when none.
inline int head_dim_tile(int head_dim, int max_tile = 256) {
  for (int i = 0; i < kNumHeadDimTiles; ++i)
    if (head_dim <= kHeadDimTiles[i] && kHeadDimTiles[i] <= max_tile &&
        ((FMHA_CUDA_HDIM_MASK >> i) & 1))
      return kHeadDimTiles[i];
  return 0;
}

}  // namespace gpu
}  // namespace fmha
