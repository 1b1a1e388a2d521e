// The instruction-set tag of the current translation unit (see csrc/cpu/instantiate_*.cpp);
// "generic" outside the per-ISA kernels.
#pragma once

#ifdef FMHA_CPU_ISA_NS
#define FMHA_ISA_TAG FMHA_CPU_ISA_NS
#else
#define FMHA_ISA_TAG generic
#endif
