// One translation unit per instruction set: CMake compiles this file with the avx2 flags,
// and dispatch.cpp picks it at run time.
#define FMHA_CPU_ISA_NS avx2
#include "cpu/forward.h"
#include "cpu/backward.h"
#include "cpu/probes.h"
