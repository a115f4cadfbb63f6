// Decisions of the prefill attention (flash_attention) on CUDA, in one place: which kernel takes
// a call (tensor-core mma.sync or SIMT) and the tile width of the tensor-core kernel. The FFI
// handler (cuda/ffi/flash_attention.cu), flash_attention_mma_supported and the `_cpu` module's
// `policy` submodule (jax_flash.kernel_for, the lowering's fallback) call these functions.
//
// Host-only and free of CUDA includes: built into the CPU module (always) and the CUDA module.
#pragma once

#include <cmath>
#include <cstdint>

#include "jax_flash/dtype.h"
#include "jax_flash/policy/limits.h"

namespace jax_flash::policy {

// Head dims of the tensor-core kernels: D and Dv multiples of 16 from 16 to 256 (D != Dv too).
// The mma.sync kernel is compiled for three tile widths (64, 128, 256: flash_mma_tile_dim); a
// call whose max(D, Dv) is below its tile's width runs the tile's padded variant, which copies
// rows at their own width, zero-fills the tile's other columns in shared memory and skips the k16
// steps of Q K^T past D and the n16 column pairs of P V past Dv (so the tensor-core work follows
// D and Dv, not the tile). The Hopper kernel has four (flash_hopper_tile_dim), zero-padded by TMA.
constexpr bool flash_mma_head_dims_supported(int64_t head_dim, int64_t head_dim_v) {
  return mma_tile_head_dims_supported(head_dim, head_dim_v);
}

// The tile width (64, 128 or 256) of the mma.sync kernel for head dims D, Dv (supported).
constexpr int flash_mma_tile_dim(int64_t head_dim, int64_t head_dim_v) {
  return mma_tile_dim(head_dim, head_dim_v);
}

// The tile (64, 80, 96, 112, 128, 192 or 256: its compute width) of the Hopper (wgmma + TMA)
// prefill kernel, which takes every tensor-core call on compute capability 9.0 in builds with
// sm_90a code (flash_attention_hopper_supported), for head dims D, Dv (supported): the narrowest
// that holds max(D, Dv). The 192 tile serves max(D, Dv) in (128, 192], e.g. D 192 and DeepSeek's
// D/Dv 192/128, which the 256 tile would run with a quarter or more of its tensor-core work on
// zeros (measured in hopper/tile_config.cuh); 80, 96 and 112 are the 128 tile computing only
// that many columns (Phi-2's 80, Phi-3's 96; HopperTraits::kComputeDim). Paged multi-token
// queries keep the mma tiles (paged_mma_tile_dim): a 96-key tile would not take 64- or 128-row
// pages.
constexpr int flash_hopper_tile_dim(int64_t head_dim, int64_t head_dim_v) {
  const int64_t d = head_dim > head_dim_v ? head_dim : head_dim_v;
  if (d <= 64) return 64;
  if (d <= 112) return d <= 80 ? 80 : (d <= 96 ? 96 : 112);
  return d <= 128 ? 128 : (d <= 192 ? 192 : 256);
}

// Consumer warpgroups (64 query rows each) of the Hopper prefill kernel's tile for a dense or
// varlen call: 3 (192 query rows: two softmaxes run while a third warpgroup's GEMMs use the
// tensor cores, which short GEMMs need) on the 64 tile unless masking makes its taller tiles
// waste work (causal, i.e. window_right >= 0 without a left window, with max_seqlen_q < 1536),
// and on the 80 and 96 tiles (the 128 tile computing 80 / 96 columns) from max_seqlen_q 3072 /
// 2048; 2 with a sliding window (window_left >= 0; not measured) or a soft cap (its 3-consumer
// variant spills 184 bytes; not measured). The 112 tile and wider keep 2: with 512 threads
// ptxas serializes their wgmma, and 3 consumers on the 112 tile were slower everywhere. Paged
// multi-token queries keep 2. Measured on an H100 (bf16, 32/8 heads, standalone, 2 -> 3
// consumers, TFLOP/s): D 64 full 32 x 512 298 -> 330, 16 x 1k 348 -> 392, 4 x 4k 405 -> 487;
// causal 32 x 512 190 -> 173, 16 x 1k 260 -> 239, 2 x 1536 242 -> 258, 8 x 2k 323 -> 328,
// 4 x 4k 365 -> 398, 2 x 8k 398 -> 454, 1 x 16k 411 -> 469; D 128 4 x 4k causal 595 -> 246.
// D 96 (192 x 96 tiles, causal / full): 16 x 1k - / 413 -> 417, 8 x 2k 411 -> 416 / 483 -> 514,
// 6 x 3k 452 -> 497 / 525 -> 576, 4 x 4k 481 -> 494 / 523 -> 559, 2 x 8k 519 -> 568 / 518 -> 569,
// 1 x 16k causal 525 -> 586. D 80: 16 x 1k 309 -> 252 / 412 -> 363, 8 x 2k 380 -> 364 / 449 ->
// 443, 6 x 3k 411 -> 432 / 480 -> 501, 4 x 4k 431 -> 429 / 470 -> 484, 2 x 8k causal 461 -> 491,
// 1 x 16k causal 480 -> 514. D 112 (192 x 64 tiles, its best) 4 x 4k 532 -> 485 / 573 -> 536.
constexpr int flash_hopper_consumers(int tile_dim, bool softcap, int64_t window_left,
                                     int64_t window_right, int64_t max_seqlen_q) {
  if (softcap || window_left >= 0) return 2;
  if (tile_dim == 64) return window_right < 0 || max_seqlen_q >= 1536 ? 3 : 2;
  if (tile_dim == 80) return max_seqlen_q >= 3072 ? 3 : 2;
  if (tile_dim == 96) return max_seqlen_q >= 2048 ? 3 : 2;
  return 2;
}

// Whether a 3-consumer call runs the causal variant of its tile (HopperDefaultTraits<.., 3,
// true>): on the 64 tile, masks bounded on the right (causal) take 96-key tiles in a 4-deep
// ring, whose diagonal tiles waste fewer keys; full attention keeps 128-key tiles. Measured on an
// H100 (bf16, 32/8 heads, standalone, 192 x 128 -> 192 x 96, TFLOP/s): causal 16 x 1k 243 -> 259,
// 8 x 2k 351 -> 368, 6 x 3k 414 -> 434, 4 x 4k 417 -> 440, 2 x 8k 482 -> 500, 1 x 16k 507 ->
// 533; full 8 x 2k 462 -> 446, 6 x 3k 492 -> 511, 4 x 4k 487 -> 483, 2 x 8k 528 -> 533.
constexpr bool flash_hopper_causal_tile(int tile_dim, int consumers, int64_t window_right) {
  return tile_dim == 64 && consumers == 3 && window_right >= 0;
}

// Whether the Hopper prefill kernel's persistent CTAs take their work items from a global
// counter (the next untaken item to whichever CTA is free first; FlashParams::item_counter,
// zeroed on the stream before the launch) rather than a fixed stride: on the 192-row tiles
// (3 consumers), when there are more items than CTAs (else each CTA has one item and the zeroing
// buys nothing). Measured on an H100 (bf16, 32/8 heads, D 64, standalone, stride -> counter,
// TFLOP/s): causal 4 x 4k 396 -> 417, 2 x 8k 465 -> 478; 8 packed sequences of 512-4096 (16k
// rows) causal 360 -> 383, full 466 -> 479; dense full 4 x 4k 485 -> 488. The 2-consumer tiles
// keep the stride: handing items to their consumers costs registers those do not have
// (NOTES-hopper-prefill.md).
constexpr bool flash_hopper_dynamic_items(int consumers, int64_t items, int64_t ctas) {
  return consumers == 3 && items > ctas;
}

// Head dims of the Hopper backward kernels (hopper/flash_bwd_kernel.cuh for the 64 and 128 wide
// tiles, hopper/flash_bwd_wide_kernel.cuh for the 256 wide one), which take the fp16/bf16
// backward calls with these head dims on compute capability 9.0 devices in builds with sm_90a
// code (flash_attention_bwd_hopper_supported checks the device, the build and the layout): D and
// Dv multiples of 16 up to 256, run on the tile of flash_mma_tile_dim (columns past D and Dv are
// zeros). The other calls keep the mma.sync / SIMT backwards.
constexpr bool flash_bwd_hopper_head_dims_supported(int64_t head_dim, int64_t head_dim_v) {
  return mma_tile_head_dims_supported(head_dim, head_dim_v) &&
         mma_tile_dim(head_dim, head_dim_v) <= 256;
}

// Head dims of the mma.sync backward (flash_attention_bwd_mma.cuh), which takes the fp16/bf16
// backward calls the Hopper one does not (on compute capability 8.x, or D > 128): D == Dv, either
// 64 or 128 exactly (their tiles' widths), or a multiple of 16 in (128, 256], run zero-padded on
// the 256-wide tile, whose shared memory (145 KB) sm_86 / sm_89 do not have (the launcher checks
// the device). The other calls keep the SIMT backward.
constexpr bool flash_bwd_mma_head_dims_supported(int64_t head_dim, int64_t head_dim_v) {
  if (head_dim != head_dim_v) return false;
  if (head_dim == 64 || head_dim == 128) return true;
  return head_dim > 128 && mma_tile_head_dims_supported(head_dim, head_dim_v);
}

// The tile width (64, 128 or 256) of the mma.sync backward for head dim D (supported).
constexpr int flash_bwd_mma_tile_dim(int64_t head_dim) {
  return mma_tile_dim(head_dim, head_dim);
}

// The kernel that runs a flash_attention call on CUDA. kTensorCore: float16 / bfloat16 with
// head dims as flash_mma_head_dims_supported, softmax_scale finite and > 0 unless softcap > 0
// (the running max is kept in unscaled units), softcap finite (<= 0: off); the launcher also
// needs 16-byte aligned buffers and row strides (flash_attention_mma_supported; XLA's buffers
// and the ops' layouts are). kSimt: every other case with 1 <= D <= kFlashMaxHeadDim and
// 0 <= Dv <= kFlashMaxHeadDim (Dv = 0: only lse is computed). kNone: no
// CUDA kernel (implementation=None then runs the jnp reference, with a warning).
enum class FlashChoice : int32_t { kNone = 0, kSimt = 1, kTensorCore = 2 };

inline FlashChoice flash_kernel_choice(DType dtype, int64_t head_dim, int64_t head_dim_v,
                                       float softmax_scale, float softcap) {
  if (head_dim < 1 || head_dim_v < 0 || head_dim > kFlashMaxHeadDim ||
      head_dim_v > kFlashMaxHeadDim)
    return FlashChoice::kNone;
  const bool q16 = dtype == DType::kFloat16 || dtype == DType::kBFloat16;
  const bool scales_ok = std::isfinite(softmax_scale) && std::isfinite(softcap) &&
                         (softcap > 0.f || softmax_scale > 0.f);
  if (q16 && scales_ok && flash_mma_head_dims_supported(head_dim, head_dim_v))
    return FlashChoice::kTensorCore;
  return FlashChoice::kSimt;
}

}  // namespace jax_flash::policy
