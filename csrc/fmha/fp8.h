// Float8 (e4m3) inputs on the CPU: the forward of the dequantised tensors (FwdParams, "FP8
// inputs"; docs/semantics.md, "FP8 inputs").
#pragma once

#include <cstdint>

#include "fmha/params.h"

namespace fmha {

// Widens n codes of the given KvCode at x into floats at y: the active level's decode of the
// 8-bit caches (cpu/dequant.h, decode_codes).
using DecodeCodes = void (*)(int code, const uint8_t* x, float* y, int64_t n);

// q, k and v widened into float32 copies and multiplied by their descale factors (one
// rounding each), the float32 forward (`forward_f32`, the active level's) into a float32
// out, and that out rounded to o_dtype; lse is the float32 forward's own. Float32 is the
// reference path of every float8 call: it neither quantises P nor reorders the sums as a
// GPU kernel does (docs/semantics.md gives both errors). p has passed check_params and has
// query and key rows.
void cpu_forward_fp8(const FwdParams& p, void (*forward_f32)(const FwdParams&),
                     DecodeCodes decode);

}  // namespace fmha
