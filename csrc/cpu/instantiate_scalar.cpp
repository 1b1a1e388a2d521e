// One translation unit per instruction set: CMake compiles this file with the scalar flags,
// and dispatch.cpp picks it at run time.
#define FMHA_CPU_ISA_NS scalar
#include "cpu/forward.h"
#include "cpu/backward.h"
#include "cpu/probes.h"
