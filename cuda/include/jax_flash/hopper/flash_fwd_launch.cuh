// Host side of the Hopper prefill kernel: which calls it takes, the TMA descriptors over the
// packed q / k / v tensors, and the persistent launch.
//
// The kernel has code only in an sm_90a build (CMake defines JAX_FLASH_HAS_SM90A when "90a" is
// among the CUDA architectures) and runs only on compute capability 9.0 devices; elsewhere
// flash_attention_hopper_supported is false and the dispatcher takes the mma.sync kernel.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <climits>
#include <cmath>
#include <cstdint>

#include "jax_flash/dtype.cuh"
#include "jax_flash/flash_attention_common.cuh"
#include "jax_flash/flash_params.h"
#include "jax_flash/hopper/flash_fwd_kernel.cuh"
#include "jax_flash/hopper/tile_config.cuh"
#include "jax_flash/hopper/tma_desc.cuh"
#include "jax_flash/launch.cuh"
#include "jax_flash/policy/flash.h"

namespace jax_flash {

// The calls the Hopper kernel computes exactly as the contract says: those of
// flash_tensor_core_call_supported (on the tile of policy::flash_hopper_tile_dim) with
// total_k > 0 and total_q > 0, in an sm_90a build on a compute capability 9.0 device.
inline bool flash_attention_hopper_supported(const FlashParams& p) {
  if (!flash_tensor_core_call_supported(p)) return false;
  if (p.total_k <= 0 || p.total_q <= 0) return false;
  return hopper::sm90a_code_runs_here();
}

namespace hopper {

template <typename T, class Tr, bool kSoftcap, class Kv = PackedKv>
cudaError_t launch_flash_hopper(const FlashParams& p, cudaStream_t stream, const Kv& kv = Kv{}) {
  // K / V boxes: whole key tiles, or PagedKv's box_rows (a page, or a tile's share of one).
  int kv_box_rows = Tr::kBlockN;
  if constexpr (Kv::kPaged) kv_box_rows = kv.box_rows;
  CUtensorMap tm_q, tm_k, tm_v;
  if (!make_tensor_map(&tm_q, p.q, p.dtype, p.head_dim, p.num_heads, p.total_q, p.q_row_stride,
                       Tr::kBlockM) ||
      !make_tensor_map(&tm_k, p.k, p.dtype, p.head_dim, p.num_heads_k, p.total_k, p.k_row_stride,
                       kv_box_rows) ||
      !make_tensor_map(&tm_v, p.v, p.dtype, p.head_dim_v, p.num_heads_k, p.total_k,
                       p.v_row_stride, kv_box_rows))
    return cudaErrorNotSupported;
  int dev = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (err != cudaSuccess) return err;
  // Work items: (query tile slot, head); a persistent CTA per SM strides over them.
  int64_t tiles = 0;
  if constexpr (Kv::kPaged)
    tiles = static_cast<int64_t>(p.batch) * ((p.max_seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM);
  else
    tiles = flash_num_tile_slots(p, Tr::kBlockM);
  const int64_t items = tiles * p.num_heads;
  const int grid = static_cast<int>(items < sms ? items : sms);
  // Work items from a counter (policy::flash_hopper_dynamic_items), zeroed here first; compiled
  // only for the tiles the policy can give it (packed calls).
  if constexpr (!Kv::kPaged && policy::flash_hopper_dynamic_items(Tr::kConsumers, INT64_MAX, 0)) {
    if (p.item_counter != nullptr &&
        policy::flash_hopper_dynamic_items(Tr::kConsumers, items, grid)) {
      err = cudaMemsetAsync(p.item_counter, 0, sizeof(*p.item_counter), stream);
      if (err != cudaSuccess) return err;
      return launch_with_smem<flash_fwd_hopper_kernel<T, Tr, kSoftcap, Kv, true>>(
          grid, Tr::kThreads, Tr::kSmemBytes, stream, p, tm_q, tm_k, tm_v, kv);
    }
  }
  return launch_with_smem<flash_fwd_hopper_kernel<T, Tr, kSoftcap, Kv>>(
      grid, Tr::kThreads, Tr::kSmemBytes, stream, p, tm_q, tm_k, tm_v, kv);
}

}  // namespace hopper

// Fused attention on the Hopper kernel for kHeadDim == policy::flash_hopper_tile_dim(p.head_dim,
// p.head_dim_v) (head dims below the tile width run zero-padded), T = __half or __nv_bfloat16,
// params accepted by flash_attention_hopper_supported. Writes o and lse for every
// row that some sequence owns (rows past max_seqlen_q excepted). Returns cudaErrorNotSupported,
// launching nothing, when the driver rejects a TMA descriptor (the caller then takes another
// kernel). Asynchronous on `stream`; never synchronizes or allocates.
template <typename T, int kHeadDim>
cudaError_t run_flash_attention_hopper(const FlashParams& p, cudaStream_t stream) {
  static_assert(kIsHalfOrBFloat16<T>, "float16 or bfloat16");
  const bool softcap = p.softcap > 0.f;
  // Tiles the policy may give three consumers (full attention is their widest use) compile that
  // variant too (HopperDefaultTraits<kHeadDim, 3>), and its causal one where the policy has it.
  if constexpr (policy::flash_hopper_consumers(kHeadDim, false, -1, -1, INT32_MAX) == 3) {
    if (policy::flash_hopper_consumers(kHeadDim, softcap, p.window_left, p.window_right,
                                       p.max_seqlen_q) == 3) {  // never with a soft cap
      if constexpr (policy::flash_hopper_causal_tile(kHeadDim, 3, 0)) {
        if (policy::flash_hopper_causal_tile(kHeadDim, 3, p.window_right))
          return hopper::launch_flash_hopper<
              T, typename hopper::HopperDefaultTraits<kHeadDim, 3, true>::type, false>(p, stream);
      }
      return hopper::launch_flash_hopper<
          T, typename hopper::HopperDefaultTraits<kHeadDim, 3>::type, false>(p, stream);
    }
  }
  using Tr = typename hopper::HopperDefaultTraits<kHeadDim>::type;
  return dispatch_bool(softcap, [&](auto softcap_c) {
    return hopper::launch_flash_hopper<T, Tr, decltype(softcap_c)::value>(p, stream);
  });
}

// Instantiated in the files flash_attention_hopper_{f16,bf16}.cu that
// cuda/src/instantiations.cmake generates.
extern template cudaError_t run_flash_attention_hopper<__half, 64>(const FlashParams&,
                                                                   cudaStream_t);
extern template cudaError_t run_flash_attention_hopper<__half, 80>(const FlashParams&,
                                                                   cudaStream_t);
extern template cudaError_t run_flash_attention_hopper<__half, 96>(const FlashParams&,
                                                                   cudaStream_t);
extern template cudaError_t run_flash_attention_hopper<__half, 112>(const FlashParams&,
                                                                    cudaStream_t);
extern template cudaError_t run_flash_attention_hopper<__half, 128>(const FlashParams&,
                                                                    cudaStream_t);
extern template cudaError_t run_flash_attention_hopper<__half, 192>(const FlashParams&,
                                                                    cudaStream_t);
extern template cudaError_t run_flash_attention_hopper<__half, 256>(const FlashParams&,
                                                                    cudaStream_t);
extern template cudaError_t run_flash_attention_hopper<__nv_bfloat16, 64>(const FlashParams&,
                                                                          cudaStream_t);
extern template cudaError_t run_flash_attention_hopper<__nv_bfloat16, 80>(const FlashParams&,
                                                                          cudaStream_t);
extern template cudaError_t run_flash_attention_hopper<__nv_bfloat16, 96>(const FlashParams&,
                                                                          cudaStream_t);
extern template cudaError_t run_flash_attention_hopper<__nv_bfloat16, 112>(const FlashParams&,
                                                                           cudaStream_t);
extern template cudaError_t run_flash_attention_hopper<__nv_bfloat16, 128>(const FlashParams&,
                                                                           cudaStream_t);
extern template cudaError_t run_flash_attention_hopper<__nv_bfloat16, 192>(const FlashParams&,
                                                                           cudaStream_t);
extern template cudaError_t run_flash_attention_hopper<__nv_bfloat16, 256>(const FlashParams&,
                                                                           cudaStream_t);

}  // namespace jax_flash
