// Host side of the Hopper attention backward: which calls it takes, the TMA descriptors over the
// packed q / k / v / dout tensors, and the launch (with the shared preprocessing and dQ
// conversion of flash_attention_bwd_common.cuh).
//
// The kernel has code only in an sm_90a build (CMake defines JAX_FLASH_HAS_SM90A when "90a" is
// among the CUDA architectures) and runs only on compute capability 9.0 devices; elsewhere
// flash_attention_bwd_hopper_supported is false and the handler takes the mma.sync backward.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "jax_flash/dtype.cuh"
#include "jax_flash/flash_attention_bwd_common.cuh"
#include "jax_flash/flash_attention_bwd_mma.cuh"
#include "jax_flash/flash_bwd_params.h"
#include "jax_flash/hopper/bwd_tile_config.cuh"
#include "jax_flash/hopper/bwd_wide_tile_config.cuh"
#include "jax_flash/hopper/flash_bwd_kernel.cuh"
#include "jax_flash/hopper/flash_bwd_wide_kernel.cuh"
#include "jax_flash/hopper/tma_desc.cuh"
#include "jax_flash/launch.cuh"
#include "jax_flash/policy/flash.h"

namespace jax_flash {

// The calls the Hopper backward computes exactly as the contract says: fp16/bf16 with the
// tensor-core layout (flash_bwd_tensor_core_layout_supported: 16-byte alignment and row strides,
// which TMA needs too; finite scales) and the head dims of
// policy::flash_bwd_hopper_head_dims_supported, total_q, total_k > 0, in an sm_90a build on a
// compute capability 9.0 device. (Whether a call that it takes runs it is the call's launch
// choice, the handler's hopper_kernel attribute.)
inline bool flash_attention_bwd_hopper_supported(const FlashBwdParams& p) {
  if (!policy::flash_bwd_hopper_head_dims_supported(p.fwd.head_dim, p.fwd.head_dim_v) ||
      !flash_bwd_tensor_core_layout_supported(p))
    return false;
  if (p.fwd.total_q <= 0 || p.fwd.total_k <= 0) return false;
  return hopper::sm90a_code_runs_here();
}

namespace hopper {

// The TMA descriptors both Hopper backward kernels use: Q and dO in boxes of block_m rows, K and
// V of block_n rows (64 columns a box), the workspace's lse (log2 units) and Delta rows
// ([2][num_heads][row_stride], Delta first) in boxes of rows_box entries of one head, and the
// float32 dQ accumulator [total_q, num_heads, head_dim] that the reduce-adds target, in boxes of
// 32 columns x dq_box_rows rows. All made before anything launches, so that a rejected one
// leaves the mma.sync backward a clean start: false when the driver rejects one.
struct BwdMaps {
  CUtensorMap q, k, v, dout, rows, dq;
};
inline bool make_bwd_maps(const FlashBwdParams& p, const FlashBwdWorkspace& ws_at, int block_m,
                          int block_n, int rows_box, int dq_box_rows, BwdMaps* m) {
  const FlashParams& f = p.fwd;
  return make_tensor_map(&m->q, f.q, f.dtype, f.head_dim, f.num_heads, f.total_q,
                         f.q_row_stride, block_m) &&
         make_tensor_map(&m->dout, p.dout, f.dtype, f.head_dim_v, f.num_heads, f.total_q,
                         p.dout_row_stride, block_m) &&
         make_tensor_map(&m->k, f.k, f.dtype, f.head_dim, f.num_heads_k, f.total_k,
                         f.k_row_stride, block_n) &&
         make_tensor_map(&m->v, f.v, f.dtype, f.head_dim_v, f.num_heads_k, f.total_k,
                         f.v_row_stride, block_n) &&
         make_tensor_map_rows_f32(&m->rows, ws_at.delta, f.total_q, f.num_heads, 2,
                                  ws_at.row_stride, rows_box) &&
         make_tensor_map_3d(&m->dq, ws_at.dq_accum, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4,
                            f.head_dim, f.num_heads, f.total_q,
                            static_cast<int64_t>(f.num_heads) * f.head_dim, 32, dq_box_rows);
}

// Both kernels' grid: x the key blocks of all sequences, y kv heads. The 128-wide kernel takes
// them in flash_bwd_cta_tile's order where its traits say (kLongestFirst: every sequence's block
// n before any block n + 1 when all have as many); otherwise sequence by sequence, lowest first.
// Either way the deterministic mode's turn-order predecessors of a block start before it.
inline dim3 bwd_grid(const FlashBwdParams& p, int block_n) {
  const int64_t tiles = tile_slots(p.fwd.total_k, p.fwd.batch, block_n);
  return dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(p.fwd.num_heads_k));
}

// Backward on the 64- or 128-wide kernel (flash_bwd_kernel.cuh), as
// run_flash_attention_bwd_hopper.
template <typename T, int kHeadDim>
cudaError_t run_flash_bwd_hopper(const FlashBwdParams& p, cudaStream_t stream) {
  using Tr = HopperBwdTraits<kHeadDim>;
  static_assert(Tr::kBlockM == kBwdMmaBlockM, "the workspace is sized with kBwdMmaBlockM");
  const FlashParams& f = p.fwd;
  // dQ's reduce-adds in boxes of kDqBoxRows rows (the call's mode's).
  const FlashBwdWorkspace ws_at = flash_bwd_workspace(p, Tr::kBlockM);
  BwdMaps in;
  if (!make_bwd_maps(p, ws_at, Tr::kBlockM, Tr::kBlockN, Tr::kRowsBox,
                     p.deterministic ? Tr::template kDqBoxRows<true>
                                     : Tr::template kDqBoxRows<false>,
                     &in))
    return cudaErrorNotSupported;
  const bool padded = f.head_dim != kHeadDim || f.head_dim_v != kHeadDim;
  return run_flash_bwd_accumulated<T>(
      p, Tr::kBlockM, stream, [&](const FlashBwdWorkspace& ws, auto softcap, auto deterministic) {
        return dispatch_bool(padded, [&](auto padded_c) {
          return launch_with_smem<
              flash_bwd_hopper_kernel<T, Tr, decltype(softcap)::value,
                                      decltype(deterministic)::value, decltype(padded_c)::value>>(
              bwd_grid(p, Tr::kBlockN), Tr::kThreads, Tr::kSmemBytes, stream, p, ws, in.q, in.k,
              in.v, in.dout, in.dq, in.rows);
        });
      });
}

// Backward on the 256-wide kernel (flash_bwd_wide_kernel.cuh; head dims past 128), as
// run_flash_attention_bwd_hopper.
template <typename T>
cudaError_t run_flash_bwd_hopper_wide(const FlashBwdParams& p, cudaStream_t stream) {
  using Tr = HopperBwdWideTraits;
  static_assert(Tr::kBlockM == kBwdMmaBlockM, "the workspace is sized with kBwdMmaBlockM");
  const FlashParams& f = p.fwd;
  const FlashBwdWorkspace ws_at = flash_bwd_workspace(p, Tr::kBlockM);
  BwdMaps in;
  if (!make_bwd_maps(p, ws_at, Tr::kBlockM, Tr::kBlockN, Tr::kRowsBox, Tr::kDqBoxRows, &in))
    return cudaErrorNotSupported;
  const bool padded = f.head_dim != Tr::kHeadDim || f.head_dim_v != Tr::kHeadDim;
  return run_flash_bwd_accumulated<T>(
      p, Tr::kBlockM, stream, [&](const FlashBwdWorkspace& ws, auto softcap, auto deterministic) {
        return dispatch_bool(padded, [&](auto padded_c) {
          return launch_with_smem<flash_bwd_hopper_wide_kernel<
              T, Tr, decltype(softcap)::value, decltype(deterministic)::value,
              decltype(padded_c)::value>>(bwd_grid(p, Tr::kBlockN), Tr::kThreads,
                                          Tr::kSmemBytes, stream, p, ws, in.q, in.k, in.v,
                                          in.dout, in.dq, in.rows);
        });
      });
}

}  // namespace hopper

// Backward on the Hopper kernel for kHeadDim == policy::flash_mma_tile_dim(p.fwd.head_dim,
// p.fwd.head_dim_v) (head dims below the tile width run zero-padded), T = __half or
// __nv_bfloat16, params accepted by flash_attention_bwd_hopper_supported, p.workspace of
// flash_bwd_workspace_bytes(p.fwd, kBwdMmaBlockM, p.deterministic) bytes (the query tile is the
// mma.sync backward's, so the workspace is the same). Writes dq, dk, dv (zeros on rows no
// sequence owns). Returns cudaErrorNotSupported, launching nothing, when the driver rejects a
// TMA descriptor (the caller then takes the mma.sync backward). Asynchronous on `stream`; never
// synchronizes or allocates.
template <typename T, int kHeadDim>
cudaError_t run_flash_attention_bwd_hopper(const FlashBwdParams& p, cudaStream_t stream) {
  static_assert(kIsHalfOrBFloat16<T>, "float16 or bfloat16");
  if constexpr (kHeadDim == 256) {
    return hopper::run_flash_bwd_hopper_wide<T>(p, stream);
  } else {
    return hopper::run_flash_bwd_hopper<T, kHeadDim>(p, stream);
  }
}

// Instantiated in the files flash_attention_bwd_hopper_{f16,bf16}.cu (64, 128) and
// flash_attention_bwd_hopper_wide_{f16,bf16}.cu (256) that cuda/src/instantiations.cmake
// generates.
extern template cudaError_t run_flash_attention_bwd_hopper<__half, 64>(const FlashBwdParams&,
                                                                       cudaStream_t);
extern template cudaError_t run_flash_attention_bwd_hopper<__half, 128>(const FlashBwdParams&,
                                                                        cudaStream_t);
extern template cudaError_t run_flash_attention_bwd_hopper<__nv_bfloat16, 64>(
    const FlashBwdParams&, cudaStream_t);
extern template cudaError_t run_flash_attention_bwd_hopper<__nv_bfloat16, 128>(
    const FlashBwdParams&, cudaStream_t);
extern template cudaError_t run_flash_attention_bwd_hopper<__half, 256>(const FlashBwdParams&,
                                                                        cudaStream_t);
extern template cudaError_t run_flash_attention_bwd_hopper<__nv_bfloat16, 256>(
    const FlashBwdParams&, cudaStream_t);

}  // namespace jax_flash
