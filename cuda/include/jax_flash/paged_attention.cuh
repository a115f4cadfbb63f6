// Paged decode attention on CUDA cores (see paged_params.h for the contract): one CTA per
// (sequence, kv head, split, query-row chunk). The CTA holds all query rows of its chunk (MT = 4,
// 8 or 16 rows: the query heads of the GQA group times the Sq query rows, row m = i * G + g), so
// every K/V row is read from device memory once and serves the whole group; G * Sq > 16 takes
// several chunks (several CTAs, each reading the K/V). MT = 16 runs two "m-groups" of 4 warps
// (256 threads) that share the copy pipeline.
//
// Pipeline: the K and V rows of a tile of TK keys are copied with 16-byte cp.async (L1 bypass)
// into a ring of 2-4 shared-memory stages (3 where two CTAs fit an SM), rows placed through the
// page table one by one (any page size; a tile may straddle pages; page offsets in int64). The
// page id of the row a thread places is loaded one tile ahead into a register and checked before
// use; the row offsets go to a ring in shared memory; per-token scales travel with their tile
// (4-byte cp.async). Rows past the key range are zero-filled (never read from memory). The
// whole-sequence check of the block table (bad data -> NaN) runs under the first copies.
//
// Compute, per warp and tile (each warp owns TK / 4 rows of the tile, with its own running
// max / sum / output, merged across warps at the end):
//   Q K^T: TPR lanes per K row, each lane 128 bytes of the row (16-byte shared loads, elements
//          converted to float32 in registers, int8 / e4m3 dequantised there), dotted with Q
//          (float32 in shared memory, pre-scaled by softmax_scale * log2(e) [/ softcap] and the
//          per-head K scale), reduced over the TPR lanes with shuffles.
//   softmax: scores in log2 units, exp2; the warp's running max per query row (shuffles over
//          rows); P (times the per-token V scale) goes to a per-warp shared buffer.
//   P V:   Dv / 8 lanes per V row, each owning 8 output columns of its m-group's rows.
// Shared-memory rows are XOR-swizzled in 16-byte units so that the cp.async writes, the Q K^T
// reads and the P V reads are free of bank conflicts.
//
// Split-KV (num_splits > 1): each split writes its normalised partial output and LSE to
// o_partial / lse_partial; paged_merge_kernel combines them (one CTA per output row, fixed
// order: deterministic), launched as a programmatic dependent launch on sm_90+.
//
// 16-bit q with a cache of q's dtype or an int8 / e4m3 cache goes to the tensor-core kernel of
// paged_attention_mma.cuh instead (policy::paged_kernel_choice; it also takes head dims other
// than 64 / 128 / 256 and D != Dv on a padded tile; it shares the page-table, bad-data and
// output helpers, the prologue and epilogue steps and the merge).
//
// The parts, one job each:
//   paged/ptx.cuh        PTX wrappers and cache-word conversions
//   paged/common.cuh     page-table, bad-data and output helpers; prologue / epilogue steps
//   paged/cuda_core.cuh  the CUDA-core kernel and its launcher per row count
//   paged_attention_mma.cuh  the tensor-core kernel and its launcher
//   paged/merge.cuh      the split-KV merge kernel and its launcher
//   paged/launch.cuh     programmatic dependent launch
//   policy/paged.h, policy/limits.h  kernel choice, split count, head dims, limits (host-only;
//                        also the `_cpu` module's `policy`, which Python calls)
//   this file            the CUDA-core launcher per (q dtype, cache dtype, head dim) and the
//                        dispatch (kernel, types, head dim or tile width)
//
// No XLA headers here.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "jax_flash/paged/cuda_core.cuh"
#include "jax_flash/paged/merge.cuh"
#include "jax_flash/paged_params.h"
#include "jax_flash/policy/limits.h"
#include "jax_flash/policy/paged.h"

namespace jax_flash {
namespace paged {

// Whether the tensor-core kernel supports these parameters (policy::paged_mma_supported) and q
// is 16-byte aligned (it is read in 16-byte vectors).
inline bool paged_mma_supported(const PagedAttentionParams& p) {
  return policy::paged_mma_supported(p.dtype, p.cache_dtype, p.scale_mode, p.head_dim,
                                     p.head_dim_v, p.num_pages, p.page_size, p.num_heads_k) &&
         reinterpret_cast<uintptr_t>(p.q) % 16 == 0;
}

// The kernel that runs p (policy::paged_kernel_choice).
inline policy::PagedChoice paged_kernel_choice(const PagedAttentionParams& p) {
  return policy::paged_kernel_choice(paged_mma_supported(p), p.head_dim, p.head_dim_v,
                                     p.launch.kernel);
}

// Defined in paged_attention_mma.cuh, instantiated by cuda/src/instantiations.cmake. T: q's
// type (__half, __nv_bfloat16); D: the tile width (policy::paged_mma_tile_dim); TC: the
// cache's type (T, int8_t or __nv_fp8_e4m3); Cfg: void (the library's configuration) or a
// paged::MmaCfg to time instead (tools/paged_decode_sweep.cu).
template <typename T, int D, typename TC = T, class Cfg = void>
cudaError_t launch_paged_attention_mma(const PagedAttentionParams& p, cudaStream_t stream);

// Paged decode attention on the CUDA-core kernel for one (q dtype, cache element type, head
// dim); D == Dv. TC is float, __half, __nv_bfloat16 (equal to TQ), int8_t or __nv_fp8_e4m3. MT
// query rows per CTA (policy::paged_rows_per_cta: 4, 8 or 16 for float32 q, 16 for 16-bit q).
// Asynchronous on `stream`; never synchronizes or allocates; returns the launch status.
template <typename TQ, typename TC, int D>
cudaError_t launch_paged_attention(const PagedAttentionParams& p, cudaStream_t stream) {
  if constexpr (sizeof(TQ) == 2) {
    // 16-row CTAs only (policy::paged_rows_per_cta says why).
    static_assert(policy::paged_rows_per_cta(1, 2) == 16, "16-bit q: 16-row CTAs");
    return launch_paged_attention_mt<TQ, TC, D, 16>(p, stream);
  } else {
    const int64_t rows = static_cast<int64_t>(p.num_heads / p.num_heads_k) * p.seqlen_q;
    switch (policy::paged_rows_per_cta(rows, sizeof(TQ))) {
      case 4: return launch_paged_attention_mt<TQ, TC, D, 4>(p, stream);
      case 8: return launch_paged_attention_mt<TQ, TC, D, 8>(p, stream);
      default: return launch_paged_attention_mt<TQ, TC, D, 16>(p, stream);
    }
  }
}

}  // namespace paged

// Explicit instantiations: generated by cuda/src/instantiations.cmake.
#define JAX_FLASH_PAGED_FOR_EACH_D(X, TQ, TC) X(TQ, TC, 64) X(TQ, TC, 128) X(TQ, TC, 256)
#define JAX_FLASH_PAGED_FOR_EACH(X)                      \
  JAX_FLASH_PAGED_FOR_EACH_D(X, float, float)            \
  JAX_FLASH_PAGED_FOR_EACH_D(X, float, int8_t)           \
  JAX_FLASH_PAGED_FOR_EACH_D(X, float, __nv_fp8_e4m3)    \
  JAX_FLASH_PAGED_FOR_EACH_D(X, __half, __half)          \
  JAX_FLASH_PAGED_FOR_EACH_D(X, __half, int8_t)          \
  JAX_FLASH_PAGED_FOR_EACH_D(X, __half, __nv_fp8_e4m3)   \
  JAX_FLASH_PAGED_FOR_EACH_D(X, __nv_bfloat16, __nv_bfloat16) \
  JAX_FLASH_PAGED_FOR_EACH_D(X, __nv_bfloat16, int8_t)   \
  JAX_FLASH_PAGED_FOR_EACH_D(X, __nv_bfloat16, __nv_fp8_e4m3)

#define JAX_FLASH_PAGED_DECLARE(TQ, TC, D)                                         \
  extern template cudaError_t paged::launch_paged_attention<TQ, TC, D>(            \
      const PagedAttentionParams&, cudaStream_t);
JAX_FLASH_PAGED_FOR_EACH(JAX_FLASH_PAGED_DECLARE)
#undef JAX_FLASH_PAGED_DECLARE

// The tensor-core launchers (16-bit caches of q's type, int8 / e4m3 caches), generated by
// cuda/src/instantiations.cmake.
#define JAX_FLASH_PAGED_MMA_FOR_EACH_D(X, T, TC) X(T, 64, TC) X(T, 128, TC) X(T, 256, TC)
#define JAX_FLASH_PAGED_MMA_FOR_EACH(X)                     \
  JAX_FLASH_PAGED_MMA_FOR_EACH_D(X, __half, __half)         \
  JAX_FLASH_PAGED_MMA_FOR_EACH_D(X, __half, int8_t)         \
  JAX_FLASH_PAGED_MMA_FOR_EACH_D(X, __half, __nv_fp8_e4m3)  \
  JAX_FLASH_PAGED_MMA_FOR_EACH_D(X, __nv_bfloat16, __nv_bfloat16) \
  JAX_FLASH_PAGED_MMA_FOR_EACH_D(X, __nv_bfloat16, int8_t)  \
  JAX_FLASH_PAGED_MMA_FOR_EACH_D(X, __nv_bfloat16, __nv_fp8_e4m3)
#define JAX_FLASH_PAGED_MMA_DECLARE(T, D, TC)                                  \
  extern template cudaError_t paged::launch_paged_attention_mma<T, D, TC>(     \
      const PagedAttentionParams&, cudaStream_t);
JAX_FLASH_PAGED_MMA_FOR_EACH(JAX_FLASH_PAGED_MMA_DECLARE)
#undef JAX_FLASH_PAGED_MMA_DECLARE

namespace paged {

// The tensor-core kernel on its tile width where paged_kernel_choice picks it (16-bit q with a
// cache of q's type or an 8-bit one), else the CUDA-core kernel of the head dim.
template <typename TQ, typename TC>
cudaError_t dispatch_head_dim(const PagedAttentionParams& p, cudaStream_t stream) {
  if constexpr (sizeof(TQ) == 2 && (std::is_same_v<TQ, TC> || sizeof(TC) == 1)) {
    if (paged_kernel_choice(p) == policy::PagedChoice::kTensorCore) {
      switch (policy::paged_mma_tile_dim(p.head_dim, p.head_dim_v)) {
        case 64: return launch_paged_attention_mma<TQ, 64, TC>(p, stream);
        case 128: return launch_paged_attention_mma<TQ, 128, TC>(p, stream);
        default: return launch_paged_attention_mma<TQ, 256, TC>(p, stream);
      }
    }
  }
  switch (p.head_dim) {
    case 64: return launch_paged_attention<TQ, TC, 64>(p, stream);
    case 128: return launch_paged_attention<TQ, TC, 128>(p, stream);
    case 256: return launch_paged_attention<TQ, TC, 256>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename TQ>
cudaError_t dispatch_cache(const PagedAttentionParams& p, cudaStream_t stream) {
  switch (p.cache_dtype) {
    case CacheDType::kInt8: return dispatch_head_dim<TQ, int8_t>(p, stream);
    case CacheDType::kFloat8E4M3: return dispatch_head_dim<TQ, __nv_fp8_e4m3>(p, stream);
    default:
      // An unquantized cache has q's dtype.
      if (cache_elem_bytes(p.cache_dtype) != static_cast<int32_t>(sizeof(TQ)) ||
          (sizeof(TQ) == 2 && (p.cache_dtype == CacheDType::kBFloat16) !=
                                  std::is_same_v<TQ, __nv_bfloat16>))
        return cudaErrorInvalidValue;
      return dispatch_head_dim<TQ, TQ>(p, stream);
  }
}

}  // namespace paged

// True when a CUDA kernel takes these parameters (paged_kernel_choice: head dims, the kernel
// p.launch asks for) with a cache dtype that matches q or is int8 / e4m3 with a scale mode.
inline bool paged_attention_cuda_supported(const PagedAttentionParams& p) {
  const bool quant = p.cache_dtype == CacheDType::kInt8 || p.cache_dtype == CacheDType::kFloat8E4M3;
  return p.num_heads_k > 0 && p.num_heads % p.num_heads_k == 0 && p.page_size >= 1 &&
         p.num_splits >= 1 && (quant == (p.scale_mode != ScaleMode::kNone)) &&
         paged::paged_kernel_choice(p) != policy::PagedChoice::kNone;
}

// Paged decode attention (and the split-KV merge when p.num_splits > 1) on `stream`.
inline cudaError_t paged_attention_cuda(const PagedAttentionParams& p, cudaStream_t stream) {
  if (!paged_attention_cuda_supported(p)) return cudaErrorInvalidValue;
  if (p.batch <= 0 || p.seqlen_q <= 0 || p.num_heads <= 0) return cudaSuccess;
  switch (p.dtype) {
    case DType::kFloat32: return paged::dispatch_cache<float>(p, stream);
    case DType::kFloat16: return paged::dispatch_cache<__half>(p, stream);
    case DType::kBFloat16: return paged::dispatch_cache<__nv_bfloat16>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace jax_flash
