// Device helpers shared by the fused prefill-attention kernels (SIMT fallback and tensor-core
// kernels): dtype conversion, the fill_uncovered launcher, and the mapping of a linear q-tile
// index onto (sequence, q block) for packed/varlen calls. See flash_params.h for the contract.
//
// No XLA headers here.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "jax_flash/flash_params.h"

namespace jax_flash {

// ---------------------------------------------------------------------------------------------
// dtype <-> float
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

template <typename T>
struct FlashDTypeOf;
template <>
struct FlashDTypeOf<float> {
  static constexpr DType value = DType::kFloat32;
};
template <>
struct FlashDTypeOf<__half> {
  static constexpr DType value = DType::kFloat16;
};
template <>
struct FlashDTypeOf<__nv_bfloat16> {
  static constexpr DType value = DType::kBFloat16;
};

inline int flash_dtype_size(DType t) { return t == DType::kFloat32 ? 4 : 2; }

// Number of elements of T in 16 bytes.
template <typename T>
struct Vec16 {
  static constexpr int kElems = 16 / static_cast<int>(sizeof(T));
};

// Loads 16 bytes (16-byte aligned) holding Vec16<T>::kElems elements, as floats.
template <typename T>
__device__ __forceinline__ void load16_to_float(const T* src, float* dst);

template <>
__device__ __forceinline__ void load16_to_float<float>(const float* src, float* dst) {
  const float4 v = __ldg(reinterpret_cast<const float4*>(src));
  dst[0] = v.x;
  dst[1] = v.y;
  dst[2] = v.z;
  dst[3] = v.w;
}

template <>
__device__ __forceinline__ void load16_to_float<__half>(const __half* src, float* dst) {
  const uint4 v = __ldg(reinterpret_cast<const uint4*>(src));
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __half2 h;
    memcpy(&h, &w[i], 4);
    const float2 f = __half22float2(h);
    dst[2 * i] = f.x;
    dst[2 * i + 1] = f.y;
  }
}

template <>
__device__ __forceinline__ void load16_to_float<__nv_bfloat16>(const __nv_bfloat16* src,
                                                               float* dst) {
  const uint4 v = __ldg(reinterpret_cast<const uint4*>(src));
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    // bf16 -> f32 is a shift: low half is element 2i, high half element 2i+1.
    dst[2 * i] = __uint_as_float(w[i] << 16);
    dst[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

// Raw 16-byte load (kept as bits so that many loads can be in flight before conversion).
__device__ __forceinline__ uint4 load16_raw(const void* src) {
  return __ldg(reinterpret_cast<const uint4*>(src));
}

// Converts 16 raw bytes holding Vec16<T>::kElems elements to floats.
template <typename T>
__device__ __forceinline__ void raw16_to_float(const uint4& v, float* dst) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  if constexpr (sizeof(T) == 4) {
#pragma unroll
    for (int i = 0; i < 4; ++i) dst[i] = __uint_as_float(w[i]);
  } else if constexpr (FlashDTypeOf<T>::value == DType::kBFloat16) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      dst[2 * i] = __uint_as_float(w[i] << 16);
      dst[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      __half2 h;
      memcpy(&h, &w[i], 4);
      const float2 f = __half22float2(h);
      dst[2 * i] = f.x;
      dst[2 * i + 1] = f.y;
    }
  }
}

// Stores 4 floats as 4 elements of T at dst (aligned to 4 * sizeof(T) bytes).
template <typename T>
__device__ __forceinline__ void store4_from_float(T* dst, float a, float b, float c, float d) {
  if constexpr (sizeof(T) == 4) {
    *reinterpret_cast<float4*>(dst) = make_float4(a, b, c, d);
  } else {
    const T e[4] = {from_float<T>(a), from_float<T>(b), from_float<T>(c), from_float<T>(d)};
    uint2 u;
    memcpy(&u, e, 8);
    *reinterpret_cast<uint2*>(dst) = u;
  }
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
    int64_t incl = n;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int64_t t = __shfl_up_sync(0xffffffffu, incl, off);
      if (lane >= off) incl += t;
    }
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

// Grid size along the tile dimension for tiles of `block_m` rows: ceil(total_q / block_m) +
// batch, an upper bound on the tile count when sequences do not overlap (kernels loop over
// tiles with a stride of the grid size, so overlapping sequences are still all computed).
inline int64_t flash_num_tile_slots(const FlashParams& p, int32_t block_m) {
  const int64_t n = (static_cast<int64_t>(p.total_q) + block_m - 1) / block_m + p.batch;
  return n < 0x7fffffff ? n : 0x7fffffff;
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
  if (p.total_q <= 0 || p.num_heads <= 0 || p.head_dim_v <= 0) return cudaSuccess;
  const int32_t eb = flash_dtype_size(p.dtype);
  const int64_t row_bytes = static_cast<int64_t>(p.num_heads) * p.head_dim_v * eb;
  const bool vec16 = (reinterpret_cast<uintptr_t>(p.o) % 16 == 0) &&
                     ((p.o_row_stride * eb) % 16 == 0) && (row_bytes % 16 == 0);
  const int64_t blocks = p.total_q < 8192 ? p.total_q : 8192;
  flash_fill_uncovered_kernel<0><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(p, eb, vec16);
  return cudaGetLastError();
}

#if defined(__CUDACC__)
// Raises Kernel's dynamic shared-memory limit to `bytes` and asks for the max-shared carveout on
// the current device, once per device (again only for a larger size): cudaFuncSetAttribute costs
// host time on every call, which a jitted decode loop would pay per layer and step.
template <auto Kernel>
inline cudaError_t ensure_smem_attrs(size_t bytes) {
  constexpr int kMaxDevices = 64;
  static std::atomic<size_t> configured[kMaxDevices];  // bytes set so far (0: none)
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  const bool tracked = dev >= 0 && dev < kMaxDevices;
  if (tracked && configured[dev].load(std::memory_order_acquire) >= bytes) return cudaSuccess;
  err = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(bytes));
  if (err != cudaSuccess) return err;
  err = cudaFuncSetAttribute(Kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                             cudaSharedmemCarveoutMaxShared);
  if (err != cudaSuccess) return err;
  if (tracked) {
    size_t cur = configured[dev].load(std::memory_order_acquire);
    while (cur < bytes && !configured[dev].compare_exchange_weak(cur, bytes)) {
    }
  }
  return cudaSuccess;
}
#endif

}  // namespace jax_flash
