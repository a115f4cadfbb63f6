// Helpers shared by the fused prefill-attention kernels (SIMT fallback and tensor-core kernels):
// what both tensor-core kernels need of a call, the fill_uncovered launcher and the mapping of a
// linear q-tile index onto (sequence, q block) for packed/varlen calls. See flash_params.h for
// the contract.
//
// No XLA headers here.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "jax_flash/dtype.cuh"
#include "jax_flash/flash_params.h"
#include "jax_flash/launch.cuh"
#include "jax_flash/policy/flash.h"
#include "jax_flash/warp.cuh"

namespace jax_flash {

// What both tensor-core prefill kernels (mma.sync and Hopper) need of a call:
//  - policy::flash_kernel_choice picks them: dtype float16 or bfloat16; head_dim, head_dim_v
//    multiples of 16 up to 256; softmax_scale finite, and > 0 unless softcap > 0 (the running
//    max is kept in unscaled units); softcap finite (softcap <= 0 means off);
//  - num_heads >= 1, num_heads_k >= 1, num_heads % num_heads_k == 0;
//  - q, k, v, o 16-byte aligned and every row stride a multiple of 8 elements (16-byte cp.async
//    and stores, TMA's 16-byte strides); lse 4-byte aligned (or null: then no lse is written).
inline bool flash_tensor_core_call_supported(const FlashParams& p) {
  if (policy::flash_kernel_choice(p.dtype, p.head_dim, p.head_dim_v, p.softmax_scale,
                                  p.softcap) != policy::FlashChoice::kTensorCore)
    return false;
  if (p.num_heads < 1 || p.num_heads_k < 1 || p.num_heads % p.num_heads_k != 0) return false;
  auto aligned16 = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  if (!aligned16(p.q) || !aligned16(p.k) || !aligned16(p.v) || !aligned16(p.o)) return false;
  if (reinterpret_cast<uintptr_t>(p.lse) % 4 != 0) return false;
  return p.q_row_stride % 8 == 0 && p.k_row_stride % 8 == 0 && p.v_row_stride % 8 == 0 &&
         p.o_row_stride % 8 == 0;
}

// ---------------------------------------------------------------------------------------------
// Tile scheduling for packed/varlen calls
// ---------------------------------------------------------------------------------------------

// Number of q tiles of `block_m` rows of a clamped extent (0 for empty or negative lengths).
JAX_FLASH_HD int32_t flash_num_q_tiles(const SeqExtent& e, int32_t block_m) {
  return e.q_len > 0 ? (e.q_len + block_m - 1) / block_m : 0;
}

JAX_FLASH_HD SeqExtent flash_seq_extent_at(const FlashParams& p, int32_t b) {
#if defined(__CUDA_ARCH__)
  return seq_extent(p, __ldg(p.q_starts + b), __ldg(p.q_ends + b), __ldg(p.k_starts + b),
                    __ldg(p.k_ends + b));
#else
  return seq_extent(p, p.q_starts[b], p.q_ends[b], p.k_starts[b], p.k_ends[b]);
#endif
}

// Cursor of a monotone search over tile indices: `b` is the first sequence not yet passed,
// `base` the number of tiles in sequences [0, b). Start with {0, 0}; successive searches with
// non-decreasing tile indices continue from where the previous one stopped.
struct FlashTileCursor {
  int32_t b;
  int64_t base;
};

struct FlashTile {
  int32_t b;       // sequence
  int32_t m;       // q block within the sequence, 0 .. num_m - 1
  int32_t num_m;   // q blocks of this sequence
  SeqExtent ext;   // its clamped extent
};

// Finds the sequence and q block of linear tile `tile` (tiles numbered sequence by sequence,
// sum over b of ceil(q_len_b / block_m) in all). Single-thread version. Returns false when
// `tile` is past the last tile.
__device__ __forceinline__ bool flash_find_tile(const FlashParams& p, int32_t block_m,
                                                int64_t tile, FlashTileCursor& cur,
                                                FlashTile& out) {
  for (; cur.b < p.batch; ++cur.b) {
    const SeqExtent e = flash_seq_extent_at(p, cur.b);
    const int32_t n = flash_num_q_tiles(e, block_m);
    if (tile < cur.base + n) {
      out.b = cur.b;
      out.m = static_cast<int32_t>(tile - cur.base);
      out.num_m = n;
      out.ext = e;
      return true;
    }
    cur.base += n;
  }
  return false;
}

// Same, computed by a whole warp (all 32 lanes must call it with the same arguments; every lane
// gets the same answer). Scans 32 sequences per step.
__device__ __forceinline__ bool flash_find_tile_warp(const FlashParams& p, int32_t block_m,
                                                     int64_t tile, FlashTileCursor& cur,
                                                     FlashTile& out) {
  const int lane = threadIdx.x & 31;
  while (cur.b < p.batch) {
    const int32_t b = cur.b + lane;
    SeqExtent e{0, 0, 0, 0};
    int32_t n = 0;
    if (b < p.batch) {
      e = flash_seq_extent_at(p, b);
      n = flash_num_q_tiles(e, block_m);
    }
    const int64_t incl = warp_inclusive_sum<int64_t>(n, lane);
    const int64_t total = __shfl_sync(0xffffffffu, incl, 31);
    if (tile < cur.base + total) {
      const unsigned hit = __ballot_sync(0xffffffffu, b < p.batch && tile < cur.base + incl);
      const int src = __ffs(static_cast<int>(hit)) - 1;
      const int64_t excl = __shfl_sync(0xffffffffu, incl - n, src);
      out.b = cur.b + src;
      out.num_m = __shfl_sync(0xffffffffu, n, src);
      out.ext.q_start = __shfl_sync(0xffffffffu, e.q_start, src);
      out.ext.q_len = __shfl_sync(0xffffffffu, e.q_len, src);
      out.ext.k_start = __shfl_sync(0xffffffffu, e.k_start, src);
      out.ext.k_len = __shfl_sync(0xffffffffu, e.k_len, src);
      out.m = static_cast<int32_t>(tile - (cur.base + excl));
      cur.base += excl;
      cur.b = out.b;
      return true;
    }
    cur.base += total;
    cur.b += 32;
  }
  cur.b = p.batch;
  return false;
}

// The key tiles (of BN keys) that query tile [m0, m0 + BM) of sequence extent e visits, last to
// first: n in [n_first, n_last] (none when n_last < n_first), and which of them need a mask.
// Keys seen by any row of the tile: [lo(first row), hi(last row)), cut at k_len (the kernels'
// loads rely on no tile but n_last reaching past k_len). lo and hi grow with the row, so tile n
// needs no mask iff [n * BN, (n + 1) * BN) lies inside [lo(last row), hi(first row)), i.e. iff
// mask_below <= n < mask_from.
struct FlashKeyTiles {
  int n_first, n_last, mask_below, mask_from;
};

template <int BM, int BN>
__device__ __forceinline__ FlashKeyTiles flash_key_tiles(const FlashParams& p, const SeqExtent& e,
                                                         int m0) {
  const int rows = min(BM, e.q_len - m0);
  int lo_first, hi_first, lo_last, hi_last;
  visible_keys(p, m0, e.q_len, e.k_len, &lo_first, &hi_first);
  visible_keys(p, m0 + rows - 1, e.q_len, e.k_len, &lo_last, &hi_last);
  const int key_end = min(hi_last, e.k_len);
  FlashKeyTiles kt;
  kt.n_first = lo_first / BN;
  kt.n_last = key_end > lo_first ? (key_end - 1) / BN : kt.n_first - 1;
  kt.mask_below = (lo_last + BN - 1) / BN;
  kt.mask_from = hi_first > 0 ? hi_first / BN : 0;
  return kt;
}

// Grid size along the tile dimension for tiles of `block` of `total_rows` packed rows over
// `batch` sequences: ceil(total_rows / block) + batch, an upper bound on the tile count when
// sequences do not overlap (kernels loop over tiles with a stride of the grid size, so
// overlapping sequences are still all computed), at most 2^31 - 1.
inline int64_t tile_slots(int64_t total_rows, int32_t batch, int32_t block) {
  const int64_t n = (total_rows + block - 1) / block + batch;
  return n < 0x7fffffff ? n : 0x7fffffff;
}

// The same for query tiles of `block_m` rows.
inline int64_t flash_num_tile_slots(const FlashParams& p, int32_t block_m) {
  return tile_slots(p.total_q, p.batch, block_m);
}

// ---------------------------------------------------------------------------------------------
// fill_uncovered
// ---------------------------------------------------------------------------------------------

// Sets every o element (rows [0, total_q), heads, head_dim_v; row padding untouched) to 0 and
// every lse entry to -inf. Templated only so that the header can be included by several
// translation units.
template <int kUnused = 0>
__global__ void __launch_bounds__(256) flash_fill_uncovered_kernel(FlashParams p, int32_t elem_bytes,
                                                                   bool vec16) {
  const int64_t row_bytes = static_cast<int64_t>(p.num_heads) * p.head_dim_v * elem_bytes;
  const int64_t stride_bytes = p.o_row_stride * elem_bytes;
  char* o = static_cast<char*>(p.o);
  for (int64_t r = blockIdx.x; r < p.total_q; r += gridDim.x) {
    char* row = o + r * stride_bytes;
    if (vec16) {
      uint4* row16 = reinterpret_cast<uint4*>(row);
      for (int64_t c = threadIdx.x; c < row_bytes / 16; c += blockDim.x)
        row16[c] = make_uint4(0u, 0u, 0u, 0u);
    } else {
      uint16_t* row2 = reinterpret_cast<uint16_t*>(row);
      for (int64_t c = threadIdx.x; c < row_bytes / 2; c += blockDim.x) row2[c] = 0;
    }
  }
  const int64_t n = static_cast<int64_t>(p.num_heads) * p.total_q;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    p.lse[i] = -__int_as_float(0x7f800000);
}

inline cudaError_t flash_attention_fill_uncovered(const FlashParams& p, cudaStream_t stream) {
  // With head_dim_v 0 only lse is filled.
  if (p.total_q <= 0 || p.num_heads <= 0 || p.head_dim_v < 0) return cudaSuccess;
  const int32_t eb = dtype_size(p.dtype);
  const int64_t row_bytes = static_cast<int64_t>(p.num_heads) * p.head_dim_v * eb;
  const bool vec16 = (reinterpret_cast<uintptr_t>(p.o) % 16 == 0) &&
                     ((p.o_row_stride * eb) % 16 == 0) && (row_bytes % 16 == 0);
  const int64_t blocks = p.total_q < 8192 ? p.total_q : 8192;
  flash_fill_uncovered_kernel<0><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(p, eb, vec16);
  return cudaGetLastError();
}

}  // namespace jax_flash
