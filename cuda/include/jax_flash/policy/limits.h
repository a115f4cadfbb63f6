// Size limits of the CUDA kernels, in one place: the launchers and FFI handlers use them, and the
// `_cpu` module's `policy` submodule hands them to Python (jax_flash/primitives/*.py), so that a
// case the CUDA kernels cannot take is routed (or refused) the same way on both sides.
//
// Host-only and free of CUDA includes: built into the CPU module (always) and the CUDA module.
#pragma once

#include <cstdint>

namespace jax_flash::policy {

// Prefill attention (flash_attention): the largest head dim of q/k and of v.
constexpr int kFlashMaxHeadDim = 256;

// Paged decode attention: the head dims of the CUDA-core kernel (D == Dv). The tensor-core
// kernel takes more (policy/paged.h: paged_mma_head_dims_supported).
constexpr int kPagedHeadDims[] = {64, 128, 256};

inline bool paged_head_dim_supported(int64_t head_dim, int64_t head_dim_v) {
  if (head_dim != head_dim_v) return false;
  for (int d : kPagedHeadDims)
    if (head_dim == d) return true;
  return false;
}

// The tensor-core (mma.sync) tiles of prefill and paged decode: head dims D and Dv multiples of
// 16 (the k16 / n16 steps) from 16 to 256, run on the narrowest of the 64, 128 and 256 wide
// tiles that holds max(D, Dv). policy/flash.h and policy/paged.h name each kernel's use of them.
constexpr bool mma_tile_head_dims_supported(int64_t head_dim, int64_t head_dim_v) {
  return head_dim >= 16 && head_dim <= 256 && head_dim % 16 == 0 && head_dim_v >= 16 &&
         head_dim_v <= 256 && head_dim_v % 16 == 0;
}

constexpr int mma_tile_dim(int64_t head_dim, int64_t head_dim_v) {
  const int64_t d = head_dim > head_dim_v ? head_dim : head_dim_v;
  return d <= 64 ? 64 : (d <= 128 ? 128 : 256);
}

// Paged decode attention: the most splits the split-KV merge takes (it keeps one float per split
// in shared memory).
constexpr int kPagedMaxMergeSplits = 8192;

// Fused RoPE + cache write (append_kv_rope) with a quantized cache: the largest K row,
// head_dim * sizeof(input), staged per warp in shared memory (8 rows + the 2 KiB cos/sin table
// within the 48 KiB a block gets without opting in).
constexpr int64_t kRopeMaxQuantRowBytes = 5888;

}  // namespace jax_flash::policy
