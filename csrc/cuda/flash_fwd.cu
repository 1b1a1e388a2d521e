// Dispatch of the CUDA FlashAttention-2 forward (cuda/flash_fwd.cuh): runtime dtype and
// head_dim become template arguments here, once. Compiled by nvcc and, as host C++, for the
// emulator (fmha._cuda_emu).
//
// Instantiations: {half, bf16} x head_dim tile {64, 128} x extras {off, on}; a head_dim
// below a tile width runs in that tile, zero-padded (see flash_fwd.cuh). "extras" (softcap,
// bias, ALiBi, mask, dropout) is a template flag so plain attention pays nothing for them in
// registers.
//
// Registers (ptxas 13.0, sm_80 / sm_90), no spills: d=64 plain 168/137, extras 247/246;
// d=128 plain 220/185, extras 254/250 -- the d=128 extras kernel is at the limit.
// Tried: varlen (cu_seqlens read in the kernel, per-sequence sq/sk and bases) -- correct in
// the emulator but ptxas spilled 48 bytes (plain, d=128) to 152 bytes (extras, d=128) on
// sm_80, so it was taken out; the launcher rejects cu_seqlens.
#include <stdexcept>
#include <string>

#include "cuda/flash_fwd.cuh"

namespace fmha {
namespace gpu {

namespace {

[[noreturn]] void unsupported(const std::string& what) {
  throw std::invalid_argument("launch_flash_fwd: " + what);
}

// True when every 16-byte chunk of the rows of q, k, v starts 16-byte aligned, so tiles
// can move with cp.async; otherwise guarded element loads.
bool rows_aligned(const FwdParams& p) {
  auto ok = [](const void* ptr, int64_t row, int64_t head, int64_t batch) {
    return reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && row % 8 == 0 && head % 8 == 0 &&
           batch % 8 == 0;
  };
  return ok(p.q, p.q_row_stride, p.q_head_stride, p.q_batch_stride) &&
         ok(p.k, p.k_row_stride, p.k_head_stride, p.k_batch_stride) &&
         ok(p.v, p.v_row_stride, p.v_head_stride, p.v_batch_stride);
}

template <typename T, int kHeadDim, bool kExtras>
void run(const FwdParams& p, Stream stream) {
  using Cfg = FlashFwdConfig<kHeadDim>;
  auto kernel = &flash_fwd_kernel<T, Cfg, kExtras>;
  if (Cfg::kSmemBytes > 48 * 1024) set_max_dynamic_smem(kernel, Cfg::kSmemBytes);
  const dim3 grid((p.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM, p.heads_q, p.batch);
  FMHA_LAUNCH(kernel, grid, dim3(Cfg::kThreads), Cfg::kSmemBytes, stream, p, rows_aligned(p));
}

template <typename T, bool kExtras>
void run_head_dim(const FwdParams& p, Stream stream) {
  if (p.head_dim <= 64) return run<T, 64, kExtras>(p, stream);
  return run<T, 128, kExtras>(p, stream);
}

template <typename T>
void run_extras(const FwdParams& p, Stream stream) {
  const bool extras = p.softcap > 0.0 || p.bias.ptr || p.mask.ptr || p.alibi_slopes ||
                      p.dropout_p > 0.0;
  if (extras) return run_head_dim<T, true>(p, stream);
  return run_head_dim<T, false>(p, stream);
}

}  // namespace

void launch_flash_fwd(const FwdParams& p, void* stream_ptr) {
  if (p.dtype != DType::kFloat16 && p.dtype != DType::kBFloat16)
    unsupported(std::string("dtype ") + dtype_name(p.dtype) + ", expected float16 or bfloat16");
  if (p.head_dim < 1 || p.head_dim > 128)
    unsupported("head_dim " + std::to_string(p.head_dim) + ", expected 1..128");
  if (p.head_dim_v != p.head_dim)
    unsupported("head_dim_v " + std::to_string(p.head_dim_v) + " != head_dim " +
                std::to_string(p.head_dim));
  if (p.heads_kv < 1 || p.heads_q % p.heads_kv != 0)
    unsupported("heads_q " + std::to_string(p.heads_q) + " is not a multiple of heads_kv " +
                std::to_string(p.heads_kv));
  if (p.cu_seqlens_q || p.cu_seqlens_k) unsupported("varlen (cu_seqlens) is not implemented yet");
  if (!(p.dropout_p >= 0.0 && p.dropout_p < 1.0))
    unsupported("dropout_p " + std::to_string(p.dropout_p) + ", expected [0, 1)");
  if (!(p.softcap >= 0.0)) unsupported("softcap " + std::to_string(p.softcap) + ", expected >= 0");
  if (p.batch <= 0 || p.heads_q <= 0 || p.seqlen_q <= 0) return;  // nothing to write
  // seqlen_k == 0: the kernel visits no key block and writes out 0, lse -inf.
  const Stream stream = static_cast<Stream>(stream_ptr);
  if (p.dtype == DType::kFloat16) return run_extras<half_t>(p, stream);
  return run_extras<bf16_t>(p, stream);
}

}  // namespace gpu
}  // namespace fmha
