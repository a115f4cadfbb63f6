// paged_attention's multi-token queries (chunked prefill against the paged cache) on the Hopper
// prefill kernel: the kernel with PagedKv (flash_fwd_kernel.cuh) reads the keys through the
// block tables by TMA, one box per page (or per tile's share of a page). Decode-sized queries
// and the quantised caches stay on the paged decode kernels (paged_attention.cuh).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "jax_flash/dtype.cuh"
#include "jax_flash/flash_params.h"
#include "jax_flash/hopper/flash_fwd_launch.cuh"
#include "jax_flash/paged_params.h"
#include "jax_flash/policy/paged.h"

namespace jax_flash {

// The paged calls the Hopper kernel takes (policy::paged_hopper_takes: the default launch
// choice, Sq large enough, a 16-bit cache of q's dtype, tensor-core head dims, page sizes its
// boxes fit), with 16-byte aligned buffers, fewer than 2^31 cache rows (TMA coordinates are
// 32-bit) and an sm_90a build on a compute capability 9.0 device.
inline bool paged_attention_hopper_supported(const PagedAttentionParams& p) {
  if (!policy::paged_hopper_takes(p.launch.kernel, p.dtype, p.cache_dtype, p.scale_mode,
                                  p.seqlen_q, p.head_dim, p.head_dim_v, p.page_size))
    return false;
  if (p.num_heads < 1 || p.num_heads_k < 1 || p.num_heads % p.num_heads_k != 0) return false;
  if (p.num_pages <= 0 || static_cast<int64_t>(p.num_pages) * p.page_size >= (int64_t{1} << 31))
    return false;
  auto aligned16 = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  if (!aligned16(p.q) || !aligned16(p.k_pages) || !aligned16(p.v_pages) || !aligned16(p.o) ||
      reinterpret_cast<uintptr_t>(p.lse) % 4 != 0)
    return false;
  return hopper::sm90a_code_runs_here();
}

// The call on the Hopper kernel of tile width kTile (policy::paged_mma_tile_dim of D, Dv),
// T = __half or __nv_bfloat16, params accepted by paged_attention_hopper_supported. Writes o and
// lse directly (o_partial / lse_partial untouched: no split-KV). Returns cudaErrorNotSupported,
// launching nothing, when the page size does not fit the tile's key boxes or the driver rejects
// a TMA descriptor (the caller then takes the decode kernels). Asynchronous; never allocates.
template <typename T, int kTile>
cudaError_t run_paged_attention_hopper(const PagedAttentionParams& pp, cudaStream_t stream) {
  static_assert(kIsHalfOrBFloat16<T>, "float16 or bfloat16");
  using Tr = typename hopper::HopperDefaultTraits<kTile>::type;
  constexpr int BN = Tr::kBlockN;
  const int box_rows = pp.page_size < BN ? pp.page_size : BN;
  if (box_rows % 16 != 0 || (pp.page_size < BN ? BN % pp.page_size : pp.page_size % BN) != 0)
    return cudaErrorNotSupported;
  FlashParams p{};
  p.q = pp.q;
  p.k = pp.k_pages;
  p.v = pp.v_pages;
  p.o = pp.o;
  p.lse = pp.lse;
  p.q_row_stride = static_cast<int64_t>(pp.num_heads) * pp.head_dim;
  p.k_row_stride = static_cast<int64_t>(pp.num_heads_k) * pp.head_dim;
  p.v_row_stride = static_cast<int64_t>(pp.num_heads_k) * pp.head_dim_v;
  p.o_row_stride = static_cast<int64_t>(pp.num_heads) * pp.head_dim_v;
  p.batch = pp.batch;
  p.total_q = pp.batch * pp.seqlen_q;
  p.total_k = pp.num_pages * pp.page_size;
  p.max_seqlen_q = pp.seqlen_q;
  p.num_heads = pp.num_heads;
  p.num_heads_k = pp.num_heads_k;
  p.head_dim = pp.head_dim;
  p.head_dim_v = pp.head_dim_v;
  p.softmax_scale = pp.softmax_scale;
  p.softcap = pp.softcap;
  p.window_left = pp.window_left;
  p.window_right = pp.window_right;
  p.fill_uncovered = false;
  p.dtype = pp.dtype;
  const hopper::PagedKv kv{pp.block_tables, pp.kv_lens, pp.max_pages, pp.page_size,
                           pp.num_pages,    box_rows};
  return dispatch_bool(p.softcap > 0.f, [&](auto softcap_c) {
    return hopper::launch_flash_hopper<T, Tr, decltype(softcap_c)::value, hopper::PagedKv>(
        p, stream, kv);
  });
}

// Instantiated in the files paged_attention_hopper_{f16,bf16}.cu that
// cuda/src/instantiations.cmake generates.
extern template cudaError_t run_paged_attention_hopper<__half, 64>(const PagedAttentionParams&,
                                                                   cudaStream_t);
extern template cudaError_t run_paged_attention_hopper<__half, 128>(const PagedAttentionParams&,
                                                                    cudaStream_t);
extern template cudaError_t run_paged_attention_hopper<__half, 256>(const PagedAttentionParams&,
                                                                    cudaStream_t);
extern template cudaError_t run_paged_attention_hopper<__nv_bfloat16, 64>(
    const PagedAttentionParams&, cudaStream_t);
extern template cudaError_t run_paged_attention_hopper<__nv_bfloat16, 128>(
    const PagedAttentionParams&, cudaStream_t);
extern template cudaError_t run_paged_attention_hopper<__nv_bfloat16, 256>(
    const PagedAttentionParams&, cudaStream_t);

// The call on the Hopper kernel, dispatched on q's dtype and the tile width (params accepted by
// paged_attention_hopper_supported); cudaErrorNotSupported as run_paged_attention_hopper.
inline cudaError_t paged_attention_hopper(const PagedAttentionParams& p, cudaStream_t stream) {
  const int tile = policy::paged_mma_tile_dim(p.head_dim, p.head_dim_v);
  auto run = [&](auto t) -> cudaError_t {
    using T = decltype(t);
    switch (tile) {
      case 64: return run_paged_attention_hopper<T, 64>(p, stream);
      case 128: return run_paged_attention_hopper<T, 128>(p, stream);
      case 256: return run_paged_attention_hopper<T, 256>(p, stream);
    }
    return cudaErrorNotSupported;
  };
  if (p.dtype == DType::kFloat16) return run(__half{});
  if (p.dtype == DType::kBFloat16) return run(__nv_bfloat16{});
  return cudaErrorNotSupported;
}

}  // namespace jax_flash
