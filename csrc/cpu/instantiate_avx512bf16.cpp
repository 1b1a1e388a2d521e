// One translation unit per instruction set: CMake compiles this file with the avx512bf16 flags,
// and dispatch.cpp picks it at run time.
#define FMHA_CPU_ISA_NS avx512bf16
#include "cpu/forward.h"
#include "cpu/backward.h"
#include "cpu/probes.h"
