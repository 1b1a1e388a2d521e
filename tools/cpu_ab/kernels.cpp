// The CPU kernels of one source tree, compiled into the namespace FMHA_CPU_ISA_NS (abA for the
// base tree, abB for the changed one) with one ISA level's flags. tools/cpu_ab.py builds this
// file once per tree and links both into cpu_ab/main.cpp.
#include "cpu/forward.h"
#include "cpu/backward.h"
