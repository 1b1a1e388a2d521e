// Host side of the sm_90 forward (cuda/flash_fwd_sm90.cuh): which calls it takes, and the
// tensor maps of a launch. The launchers are compiled in the generated files
// csrc/cuda/instantiations/flash_fwd_sm90_*.cu (tools/generate_instantiations.py); the
// choice between this kernel and the sm_80 one is made in cuda/flash_fwd.cu.
#include <algorithm>
#include <cstdint>
#include <string>

#include "cuda/flash_fwd_sm90.cuh"
#include "cuda/launch.h"
#include "fmha/error.h"

namespace fmha {
namespace gpu {

#include "cuda/instantiations/flash_fwd_sm90_instantiations.inc"

// The combine of the sm_90 launchers' key splits (declared extern in cuda/flash_fwd_sm90.cuh).
template int run_flash_fwd_combine<half_t, 64>(const FwdParams&, const FwdLaunch&, Stream);
template int run_flash_fwd_combine<half_t, 128>(const FwdParams&, const FwdLaunch&, Stream);
template int run_flash_fwd_combine<half_t, 256>(const FwdParams&, const FwdLaunch&, Stream);
template int run_flash_fwd_combine<bf16_t, 64>(const FwdParams&, const FwdLaunch&, Stream);
template int run_flash_fwd_combine<bf16_t, 128>(const FwdParams&, const FwdLaunch&, Stream);
template int run_flash_fwd_combine<bf16_t, 256>(const FwdParams&, const FwdLaunch&, Stream);

// The tile: the smallest of 64, 128, 256 that holds both head dims and that this build
// compiled (FMHA_CUDA_HEAD_DIMS); 0 when none.
int flash_fwd_sm90_tile(const FwdParams& p) {
  const int d = std::max(p.head_dim, p.head_dim_v);
  for (int tile : {64, 128, 256})
    if (d <= tile && head_dim_tile_built(tile)) return tile;
  return 0;
}

namespace {

// A stride TMA accepts: a positive multiple of 16 bytes. A dimension of extent 1 is never
// stepped, so its stride (which may be anything, 0 included) is replaced by one that is.
bool tma_stride_ok(int64_t elements, int extent, int elem_bytes = 2) {
  return extent == 1 || (elements > 0 && (elements * elem_bytes) % 16 == 0);
}

}  // namespace

// The calls this kernel takes: 16-bit or e4m3 q/k/v, plain scores (no softcap, bias, ALiBi,
// masks, dropout: needs_extras), a positive scale, causal / sliding windows and varlen (16-bit:
// up to d = 128), GQA and split-KV;
// no KV cache or paged KV (the decode kernel's calls). TMA needs 16-byte aligned bases and
// strides that are positive multiples of 16 bytes, and a tensor with at least one row (e4m3:
// V is read by the pre-pass, with plain loads). Returns "" for a call it takes, else why not,
// naming the argument (the error of an e4m3 call, which no other kernel runs).
std::string flash_fwd_sm90_refusal(const FwdParams& p) {
  const bool fp8 = p.dtype == DType::kFloat8E4M3;
  if (p.dtype != DType::kFloat16 && p.dtype != DType::kBFloat16 && !fp8)
    return concat("dtype ", dtype_name(p.dtype), " is not taken");
  if (p.softcap > 0.0) return "softcap: not supported";
  if (p.bias.ptr) return "bias: not supported";
  if (p.mask.ptr) return "mask: not supported";
  if (p.block_mask.index) return "block_mask: not supported";
  if (p.alibi_slopes) return "alibi_slopes: not supported";
  if (p.dropout_p > 0.0) return "dropout_p: not supported";
  if (needs_extras(p)) return "a score extra is not supported";
  if (!(float(p.scale) * score::kLog2e > 0.0f))
    return concat("scale: must be > 0 (got ", p.scale, ")");
  if (p.cache_seqlens || p.k_new || p.block_table || p.kv_code != KvCode::kNone)
    return "cache_seqlens: KV caches run in the decode kernel";
  const int tile = flash_fwd_sm90_tile(p);
  if (tile == 0)
    return concat("head_dim: ", std::max(p.head_dim, p.head_dim_v),
                  " has no tile of 64, 128 or 256 in this build (FMHA_CUDA_HEAD_DIMS)");
  // The kernel that watches for the strong zero is built up to d = 128 (FlashFwdSm90ConfigBase::
  // kEdges): windows and varlen at d = 256 run in the sm_80 kernel.
  if (!fp8 && flash_fwd_sm90_edges(p) && tile > 128)
    return "window_left / cu_seqlens_q: windows and varlen at d = 256 run in the sm_80 kernel";
  const bool varlen = p.cu_seqlens_q != nullptr;
  const int rows_q = varlen ? p.total_q : p.seqlen_q, rows_k = varlen ? p.total_k : p.seqlen_k;
  if (rows_q < 1) return "q: no rows";
  // No key at all: the sm_80 kernel writes 16-bit calls' zeros; float8 calls run here with
  // stand-in maps (flash_fwd_sm90_maps) that no load reads.
  if (rows_k < 1 && !fp8) return "k: no keys (seqlen_k = 0)";
  const int batch = varlen ? 1 : p.batch;
  const int elem = fp8 ? 1 : 2;
  auto aligned = [&](const void* ptr, int64_t row, int64_t head, int64_t bat, int heads) {
    return reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && row > 0 && (row * elem) % 16 == 0 &&
           tma_stride_ok(head, heads, elem) && tma_stride_ok(bat, batch, elem);
  };
  const char* rows = ": TMA needs a 16-byte aligned base and positive strides that are "
                     "multiples of 16 bytes";
  if (!aligned(p.q, p.q_row_stride, p.q_head_stride, p.q_batch_stride, p.heads_q))
    return concat("q", rows);
  if (!aligned(p.k, p.k_row_stride, p.k_head_stride, p.k_batch_stride, p.heads_kv))
    return concat("k", rows);
  if (!fp8 && !aligned(p.v, p.v_row_stride, p.v_head_stride, p.v_batch_stride, p.heads_kv))
    return concat("v", rows);
  return "";
}

bool flash_fwd_sm90_claims(const FwdParams& p) { return flash_fwd_sm90_refusal(p).empty(); }

// Maps of (columns, rows, heads, batch) in boxes of box_cols columns (the swizzle's span,
// 128 bytes, or 64 for e4m3 at d = 64, which the kernel's wgmma descriptors read) x 64 (Q) or
// block_n (K, V) rows. Columns past the head dim and rows past the tensor read as zero.
Sm90Maps flash_fwd_sm90_maps(const FwdParams& p, int block_n, int box_cols, const uint8_t* vt,
                             int64_t vt_row, int tile) {
  const bool varlen = p.cu_seqlens_q != nullptr, fp8 = p.dtype == DType::kFloat8E4M3;
  const int batch = varlen ? 1 : p.batch;
  auto map = [&](DType type, const void* ptr, int cols, int rows, int heads, int64_t row_stride,
                 int64_t head_stride, int64_t batch_stride, int box_rows, int box_w) {
    const uint64_t e = type == DType::kFloat8E4M3 ? 1 : 2;
    const TmaDtype dtype = e == 1 ? TmaDtype::kU8
                           : type == DType::kFloat16 ? TmaDtype::kF16 : TmaDtype::kBF16;
    const uint64_t row_bytes = uint64_t(row_stride) * e;
    const uint64_t dims[4] = {uint64_t(cols), uint64_t(rows), uint64_t(heads), uint64_t(batch)};
    const uint64_t strides[3] = {row_bytes, heads == 1 ? row_bytes : uint64_t(head_stride) * e,
                                 batch == 1 ? row_bytes : uint64_t(batch_stride) * e};
    const uint32_t box[4] = {uint32_t(box_w), uint32_t(box_rows), 1, 1};
    const uint32_t element_strides[4] = {1, 1, 1, 1};
    return encode_tensor_map(dtype, 4, ptr, dims, strides, box, element_strides,
                             box_w * e == 128 ? SmemSwizzle::k128B : SmemSwizzle::k64B);
  };
  const int rows_q = varlen ? p.total_q : p.seqlen_q, rows_k = varlen ? p.total_k : p.seqlen_k;
  Sm90Maps maps;
  maps.q = map(p.dtype, p.q, p.head_dim, rows_q, p.heads_q, p.q_row_stride, p.q_head_stride,
               p.q_batch_stride, 64, box_cols);
  // A call without keys (float8 only: flash_fwd_sm90_refusal) visits no key block, so its K
  // and V^T maps are never read: they describe one row of Q's memory, a valid address.
  const bool no_keys = rows_k < 1;
  maps.k = no_keys ? map(p.dtype, p.q, p.head_dim, 1, p.heads_q, p.q_row_stride,
                         p.q_head_stride, p.q_batch_stride, block_n, box_cols)
                   : map(p.dtype, p.k, p.head_dim, rows_k, p.heads_kv, p.k_row_stride,
                         p.k_head_stride, p.k_batch_stride, block_n, box_cols);
  if (fp8) {
    // V^T (fp8_v_transpose_kernel): (keys, head_dim_v rows, kv heads, batch entries), one box
    // of block_n keys (128 bytes) x the tile's rows; rows past head_dim_v read as zero.
    const int64_t row = no_keys ? block_n : vt_row;
    if (no_keys) vt = static_cast<const uint8_t*>(p.q);
    const uint64_t dims[4] = {uint64_t(row), uint64_t(p.head_dim_v), uint64_t(p.heads_kv),
                              uint64_t(p.batch)};
    const uint64_t strides[3] = {uint64_t(row), uint64_t(p.head_dim_v) * row,
                                 uint64_t(p.heads_kv) * p.head_dim_v * row};
    const uint32_t box[4] = {uint32_t(block_n), uint32_t(tile), 1, 1};
    const uint32_t element_strides[4] = {1, 1, 1, 1};
    maps.vt = encode_tensor_map(TmaDtype::kU8, 4, vt, dims, strides, box, element_strides,
                                SmemSwizzle::k128B);
  } else {
    maps.v = map(p.dtype, p.v, p.head_dim_v, rows_k, p.heads_kv, p.v_row_stride,
                 p.v_head_stride, p.v_batch_stride, block_n, box_cols);
  }
  // O: dense calls whose rows TMA can address (the kernel stores the others itself).
  maps.o_tma = !varlen && reinterpret_cast<uintptr_t>(p.o) % 16 == 0 && p.o_row_stride > 0 &&
               p.o_row_stride % 8 == 0 && tma_stride_ok(p.o_head_stride, p.heads_q) &&
               tma_stride_ok(p.o_batch_stride, batch);
  if (maps.o_tma)
    maps.o = map(out_dtype(p), p.o, p.head_dim_v, p.seqlen_q, p.heads_q, p.o_row_stride,
                 p.o_head_stride, p.o_batch_stride, 16, 64);
  return maps;
}

int launch_flash_fwd_sm90(const FwdParams& p, void* stream_ptr) {
  const Stream stream = static_cast<Stream>(stream_ptr);
  int splits = 0;
  with_head_dim_tile(flash_fwd_sm90_tile(p), [&](auto tile_c) {
    constexpr int kTile = decltype(tile_c)::value;
    if constexpr (kTile == 64 || kTile == 128 || kTile == 256) {
      if (p.dtype == DType::kFloat8E4M3)
        splits = run_flash_fwd_sm90<e4m3_t, kTile>(p, stream);
      else if (p.dtype == DType::kFloat16)
        splits = run_flash_fwd_sm90<half_t, kTile>(p, stream);
      else
        splits = run_flash_fwd_sm90<bf16_t, kTile>(p, stream);
    }
  });
  return splits;
}

}  // namespace gpu
}  // namespace fmha
