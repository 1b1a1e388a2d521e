// The amx level: CMake compiles this file with the avx512bf16 flags and, where the compiler
// takes them, -mamx-tile -mamx-bf16 (cmake/cpu_core.cmake); dispatch.cpp picks it at run time.
// Only the bfloat16 kernels are compiled here (forward.h and backward.h with
// FMHA_CPU_AMX_LEVEL: their products on tiles); every other call of the level -- float32,
// float16, float64, the probes -- runs the avx512bf16 level's code (docs/cpu_kernels.md, "The
// AMX kernels"). The AMX flags give this unit the tile intrinsics and nothing else: the
// compiler never emits a tile instruction of its own accord, so the code outside
// amx::HardwareTiles runs on any CPU with AVX512-BF16, as FMHA_CPU_ISA=amx through the model
// requires.
#define FMHA_CPU_ISA_NS amx_tiles
#define FMHA_CPU_AMX_LEVEL 1
#include "cpu/forward.h"
#include "cpu/backward.h"
