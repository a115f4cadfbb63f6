// CUDA kernels of the paged KV-cache writes: append_kv (with int8 / e4m3 quantisation) and
// copy_pages. Semantics: jax_flash/paged_params.h; quantisation: jax_flash/numeric.h (the same
// functions as the CPU kernels, so both produce the same bits).
//
// Launchers never synchronise and never allocate (CUDA-graph capturable). All offsets are int64.
// Work is spread with grid-stride loops: blockIdx.y walks tokens / page pairs, x their contents.
// No XLA headers here.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "jax_flash/numeric.h"
#include "jax_flash/paged_params.h"

namespace jax_flash {
namespace kv_cache_impl {

constexpr int kThreads = 256;
constexpr int kMaxGridY = 65535;
constexpr int kMaxGridX = 1 << 16;

// Largest power-of-two unit (<= 16 bytes) dividing every byte count and address of `n` items.
inline int copy_unit(const int64_t* bytes, const void* const* ptrs, int n) {
  int unit = 16;
  for (int i = 0; i < n; ++i) {
    while (unit > 1 && (bytes[i] % unit != 0 || reinterpret_cast<uintptr_t>(ptrs[i]) % unit != 0))
      unit /= 2;
  }
  return unit;
}

template <int kUnit>
struct UnitT;
template <>
struct UnitT<16> {
  using T = uint4;
};
template <>
struct UnitT<8> {
  using T = uint2;
};
template <>
struct UnitT<4> {
  using T = uint32_t;
};
template <>
struct UnitT<2> {
  using T = uint16_t;
};
template <>
struct UnitT<1> {
  using T = uint8_t;
};

// Up to four arrays copied per token / per page pair, each with its own row length in units.
struct Segments {
  const char* src[4];  // source base (per token for append; the array itself for copy)
  char* dst[4];        // destination base
  int64_t units[4];    // units per token / page
  int count;
  int64_t total;       // sum of units
};

// Segment of unit u (< seg.total): its source / destination bases, units per row and the offset
// of u in it. Unrolled with constant indices so that seg stays in the parameter space.
struct SegPos {
  const char* src;
  char* dst;
  int64_t units, offset;
};
__device__ __forceinline__ SegPos find_segment(const Segments& seg, int64_t u) {
  SegPos r{seg.src[0], seg.dst[0], seg.units[0], u};
  bool found = u < seg.units[0] || seg.count == 1;
#pragma unroll
  for (int a = 1; a < 4; ++a) {
    if (!found) {
      r.offset -= r.units;
      r.src = seg.src[a];
      r.dst = seg.dst[a];
      r.units = seg.units[a];
      found = r.offset < r.units || a == seg.count - 1;
    }
  }
  return r;
}

// ---------------------------------------------------------------------------------------------
// append_kv, unquantized: byte copy of each token's K and V rows into its slot.

template <int kUnit>
__global__ void __launch_bounds__(kThreads)
    append_copy_kernel(Segments seg, const int32_t* __restrict__ slots, int64_t num_tokens,
                       int64_t num_slots) {
  using U = typename UnitT<kUnit>::T;
  for (int64_t t = blockIdx.y; t < num_tokens; t += gridDim.y) {
    const int64_t s = slots[t];
    if (s < 0 || s >= num_slots) continue;
    for (int64_t u = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; u < seg.total;
         u += int64_t(gridDim.x) * blockDim.x) {
      const SegPos sp = find_segment(seg, u);
      const U* src = reinterpret_cast<const U*>(sp.src) + t * sp.units + sp.offset;
      U* dst = reinterpret_cast<U*>(sp.dst) + s * sp.units + sp.offset;
      *dst = __ldg(src);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// append_kv, quantized: one warp per (token, kv head, K|V) row. Per-token scales: amax by a
// warp reduction, scale = amax / qmax written by lane 0; per-head scales are read.

template <DType DT>
struct InElem;
template <>
struct InElem<DType::kFloat32> {
  using T = float;
  static __device__ __forceinline__ float load(T x) { return x; }
};
template <>
struct InElem<DType::kFloat16> {
  using T = uint16_t;
  static __device__ __forceinline__ float load(T x) { return __half2float(__ushort_as_half(x)); }
};
template <>
struct InElem<DType::kBFloat16> {
  using T = uint16_t;
  static __device__ __forceinline__ float load(T x) { return __uint_as_float(uint32_t(x) << 16); }
};

template <CacheDType CT>
struct QuantElem;
template <>
struct QuantElem<CacheDType::kInt8> {
  static constexpr float kMax = numeric::kInt8Max;
  static __device__ __forceinline__ uint8_t quantize(float x, float scale) {
    return static_cast<uint8_t>(numeric::quantize_int8(x, scale));
  }
};
template <>
struct QuantElem<CacheDType::kFloat8E4M3> {
  static constexpr float kMax = numeric::kE4M3Max;
  static __device__ __forceinline__ uint8_t quantize(float x, float scale) {
    return numeric::quantize_e4m3(x, scale);
  }
};

// kVec input elements per lane step: one 16-byte load when kVec elements fill 16 bytes (the
// launcher checks the alignment), else element loads.
template <DType DT, int kVec>
__device__ __forceinline__ void load_vec(const typename InElem<DT>::T* p, float (&x)[kVec]) {
  using T = typename InElem<DT>::T;
  if constexpr (kVec * sizeof(T) == 16) {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < kVec; ++i) x[i] = InElem<DT>::load(e[i]);
  } else {
#pragma unroll
    for (int i = 0; i < kVec; ++i) x[i] = InElem<DT>::load(p[i]);
  }
}

template <int kVec>
__device__ __forceinline__ void store_vec(uint8_t* p, const uint8_t (&q)[kVec]) {
  if constexpr (kVec == 8) {
    uint2 v;
    v.x = uint32_t(q[0]) | (uint32_t(q[1]) << 8) | (uint32_t(q[2]) << 16) | (uint32_t(q[3]) << 24);
    v.y = uint32_t(q[4]) | (uint32_t(q[5]) << 8) | (uint32_t(q[6]) << 16) | (uint32_t(q[7]) << 24);
    *reinterpret_cast<uint2*>(p) = v;
  } else if constexpr (kVec == 4) {
    *reinterpret_cast<uint32_t*>(p) =
        uint32_t(q[0]) | (uint32_t(q[1]) << 8) | (uint32_t(q[2]) << 16) | (uint32_t(q[3]) << 24);
  } else {
#pragma unroll
    for (int i = 0; i < kVec; ++i) p[i] = q[i];
  }
}

__device__ __forceinline__ float warp_amax(float m) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) m = numeric::amax_step(m, __shfl_xor_sync(0xffffffffu, m, o));
  return m;
}

struct AppendQuantArgs {
  const void* k_new;
  const void* v_new;
  const int32_t* slots;
  uint8_t* k_pages;
  uint8_t* v_pages;
  float* k_scale;
  float* v_scale;
  int64_t num_tokens, num_slots;
  int32_t num_heads_k, head_dim, head_dim_v;
  bool per_token;
};

// One warp quantises one row of n input values into dst (lane = the thread's lane). per_token:
// the scale is amax / qmax over the row, written to *scale by lane 0; else *scale is read.
// Shared by append_kv and the fused RoPE + append (its V rows).
template <DType DT, CacheDType CT, int kVec>
__device__ __forceinline__ void quantize_row_warp(const typename InElem<DT>::T* src, uint8_t* dst,
                                                  int64_t n, float* scale, bool per_token,
                                                  int lane) {
  using Q = QuantElem<CT>;
  float sc;
  if (per_token) {
    float amax = 0.0f;
#pragma unroll 1  // not unrolled (both loops): few registers live across the division's
                  // slow-path call, so that no caller of this routine spills
    for (int64_t d = int64_t(lane) * kVec; d < n; d += 32 * kVec) {
      float x[kVec];
      load_vec<DT, kVec>(src + d, x);
#pragma unroll
      for (int i = 0; i < kVec; ++i) amax = numeric::amax_step(amax, x[i]);
    }
    amax = warp_amax(amax);
    sc = numeric::per_token_scale(amax, Q::kMax);
    if (lane == 0) *scale = sc;
  } else {
    sc = *scale;
  }
#pragma unroll 1
  for (int64_t d = int64_t(lane) * kVec; d < n; d += 32 * kVec) {
    float x[kVec];
    uint8_t q[kVec];
    load_vec<DT, kVec>(src + d, x);
#pragma unroll
    for (int i = 0; i < kVec; ++i) q[i] = Q::quantize(x[i], sc);
    store_vec<kVec>(dst + d, q);
  }
}

template <DType DT, CacheDType CT, int kVec>
__global__ void __launch_bounds__(kThreads) append_quant_kernel(AppendQuantArgs a) {
  using T = typename InElem<DT>::T;
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.x * (kThreads / 32) + (threadIdx.x >> 5);  // in [0, 2 * Hkv)
  if (row >= 2 * a.num_heads_k) return;  // whole warp: no shuffle is left waiting
  const bool is_v = row >= a.num_heads_k;
  const int h = is_v ? row - a.num_heads_k : row;
  const int64_t n = is_v ? a.head_dim_v : a.head_dim;
  const T* src_base = static_cast<const T*>(is_v ? a.v_new : a.k_new);
  uint8_t* dst_base = is_v ? a.v_pages : a.k_pages;
  float* scales = is_v ? a.v_scale : a.k_scale;
  const int64_t H = a.num_heads_k;
  for (int64_t t = blockIdx.y; t < a.num_tokens; t += gridDim.y) {
    const int64_t s = a.slots[t];
    if (s < 0 || s >= a.num_slots) continue;  // uniform over the warp
    quantize_row_warp<DT, CT, kVec>(src_base + (t * H + h) * n, dst_base + (s * H + h) * n, n,
                                    a.per_token ? scales + s * H + h : scales + h, a.per_token,
                                    lane);
  }
}

inline dim3 grid_2d(int64_t x_blocks, int64_t y_items) {
  const int64_t x = x_blocks < 1 ? 1 : (x_blocks > kMaxGridX ? kMaxGridX : x_blocks);
  // Keep the total block count moderate: grid-stride over y covers the rest.
  int64_t y = y_items < 1 ? 1 : y_items;
  const int64_t y_cap = (int64_t(1) << 20) / x;
  if (y > y_cap) y = y_cap < 1 ? 1 : y_cap;
  if (y > kMaxGridY) y = kMaxGridY;
  return dim3(static_cast<unsigned>(x), static_cast<unsigned>(y));
}

template <DType DT, CacheDType CT>
cudaError_t launch_append_quant(const AppendKVParams& p, cudaStream_t stream) {
  using T = typename InElem<DT>::T;
  constexpr int kVec = 16 / sizeof(T);
  AppendQuantArgs a;
  a.k_new = p.k_new;
  a.v_new = p.v_new;
  a.slots = p.slot_mapping;
  a.k_pages = static_cast<uint8_t*>(p.k_pages);
  a.v_pages = static_cast<uint8_t*>(p.v_pages);
  a.k_scale = p.k_scale;
  a.v_scale = p.v_scale;
  a.num_tokens = p.num_tokens;
  a.num_slots = int64_t(p.num_pages) * p.page_size;
  a.num_heads_k = p.num_heads_k;
  a.head_dim = p.head_dim;
  a.head_dim_v = p.head_dim_v;
  a.per_token = p.scale_mode == ScaleMode::kPerToken;
  const int64_t rows = 2 * int64_t(p.num_heads_k);
  const dim3 grid = grid_2d((rows + kThreads / 32 - 1) / (kThreads / 32), p.num_tokens);
  // Vector path: every row starts on a 16-byte boundary of the input (kVec elements) and on a
  // kVec-byte boundary of the cache.
  const bool vec = p.head_dim % kVec == 0 && p.head_dim_v % kVec == 0 &&
                   reinterpret_cast<uintptr_t>(p.k_new) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(p.v_new) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(p.k_pages) % kVec == 0 &&
                   reinterpret_cast<uintptr_t>(p.v_pages) % kVec == 0;
  if (vec)
    append_quant_kernel<DT, CT, kVec><<<grid, kThreads, 0, stream>>>(a);
  else
    append_quant_kernel<DT, CT, 1><<<grid, kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

template <DType DT>
cudaError_t launch_append_quant_ct(const AppendKVParams& p, cudaStream_t stream) {
  return p.cache_dtype == CacheDType::kInt8
             ? launch_append_quant<DT, CacheDType::kInt8>(p, stream)
             : launch_append_quant<DT, CacheDType::kFloat8E4M3>(p, stream);
}

// ---------------------------------------------------------------------------------------------
// copy_pages: one block row (y) per pair, its K page, V page and per-token scales in x.

template <int kUnit>
__global__ void __launch_bounds__(kThreads)
    copy_pages_kernel(Segments seg, const int32_t* __restrict__ src_ids,
                      const int32_t* __restrict__ dst_ids, int64_t num_copies, int64_t num_pages) {
  using U = typename UnitT<kUnit>::T;
  for (int64_t i = blockIdx.y; i < num_copies; i += gridDim.y) {
    const int64_t s = src_ids[i], d = dst_ids[i];
    if (s < 0 || s >= num_pages || d < 0 || d >= num_pages || s == d) continue;
    for (int64_t u = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; u < seg.total;
         u += int64_t(gridDim.x) * blockDim.x) {
      const SegPos sp = find_segment(seg, u);
      const U* from = reinterpret_cast<const U*>(sp.src) + s * sp.units + sp.offset;
      U* to = reinterpret_cast<U*>(sp.dst) + d * sp.units + sp.offset;
      *to = *from;  // not __ldg: the array is written by this kernel
    }
  }
}

template <template <int> class Kernel, typename... Args>
cudaError_t launch_by_unit(int unit, dim3 grid, cudaStream_t stream, Args... args) {
  switch (unit) {
    case 16: Kernel<16>::launch(grid, stream, args...); break;
    case 8: Kernel<8>::launch(grid, stream, args...); break;
    case 4: Kernel<4>::launch(grid, stream, args...); break;
    case 2: Kernel<2>::launch(grid, stream, args...); break;
    default: Kernel<1>::launch(grid, stream, args...); break;
  }
  return cudaGetLastError();
}

template <int kUnit>
struct AppendCopyLaunch {
  static void launch(dim3 grid, cudaStream_t stream, Segments seg, const int32_t* slots,
                     int64_t num_tokens, int64_t num_slots) {
    append_copy_kernel<kUnit><<<grid, kThreads, 0, stream>>>(seg, slots, num_tokens, num_slots);
  }
};

template <int kUnit>
struct CopyPagesLaunch {
  static void launch(dim3 grid, cudaStream_t stream, Segments seg, const int32_t* src,
                     const int32_t* dst, int64_t num_copies, int64_t num_pages) {
    copy_pages_kernel<kUnit><<<grid, kThreads, 0, stream>>>(seg, src, dst, num_copies, num_pages);
  }
};

}  // namespace kv_cache_impl

// Writes p.k_new / p.v_new into the cache (paged_params.h). Invalid parameters: returns
// cudaErrorInvalidValue without launching.
inline cudaError_t append_kv_cuda(const AppendKVParams& p, cudaStream_t stream) {
  namespace I = kv_cache_impl;
  if (p.num_tokens < 0 || p.num_heads_k <= 0 || p.head_dim <= 0 || p.head_dim_v <= 0 ||
      p.num_pages < 0 || p.page_size <= 0)
    return cudaErrorInvalidValue;
  if (p.num_tokens == 0 || p.num_pages == 0) return cudaSuccess;
  const bool quantized =
      p.cache_dtype == CacheDType::kInt8 || p.cache_dtype == CacheDType::kFloat8E4M3;
  if (quantized != (p.scale_mode != ScaleMode::kNone)) return cudaErrorInvalidValue;
  const int64_t num_slots = int64_t(p.num_pages) * p.page_size;
  if (quantized) {
    if (p.k_scale == nullptr || p.v_scale == nullptr) return cudaErrorInvalidValue;
    switch (p.dtype) {
      case DType::kFloat32: return I::launch_append_quant_ct<DType::kFloat32>(p, stream);
      case DType::kFloat16: return I::launch_append_quant_ct<DType::kFloat16>(p, stream);
      case DType::kBFloat16: return I::launch_append_quant_ct<DType::kBFloat16>(p, stream);
    }
    return cudaErrorInvalidValue;
  }
  const int64_t eb = cache_elem_bytes(p.cache_dtype);
  const int64_t row_k = int64_t(p.num_heads_k) * p.head_dim * eb;
  const int64_t row_v = int64_t(p.num_heads_k) * p.head_dim_v * eb;
  const void* ptrs[4] = {p.k_new, p.v_new, p.k_pages, p.v_pages};
  const int64_t bytes4[4] = {row_k, row_v, row_k, row_v};
  const int unit = I::copy_unit(bytes4, ptrs, 4);
  I::Segments seg{};
  seg.src[0] = static_cast<const char*>(p.k_new);
  seg.src[1] = static_cast<const char*>(p.v_new);
  seg.dst[0] = static_cast<char*>(p.k_pages);
  seg.dst[1] = static_cast<char*>(p.v_pages);
  seg.units[0] = row_k / unit;
  seg.units[1] = row_v / unit;
  seg.count = 2;
  seg.total = seg.units[0] + seg.units[1];
  const dim3 grid = I::grid_2d((seg.total + I::kThreads - 1) / I::kThreads, p.num_tokens);
  return I::launch_by_unit<I::AppendCopyLaunch>(unit, grid, stream, seg, p.slot_mapping,
                                                int64_t(p.num_tokens), num_slots);
}

// Copies pages src[i] -> dst[i] (paged_params.h). Invalid parameters: cudaErrorInvalidValue.
inline cudaError_t copy_pages_cuda(const CopyPagesParams& p, cudaStream_t stream) {
  namespace I = kv_cache_impl;
  if (p.num_copies < 0 || p.num_pages < 0 || p.page_bytes_k < 0 || p.page_bytes_v < 0 ||
      p.scale_per_page < 0)
    return cudaErrorInvalidValue;
  if (p.num_copies == 0 || p.num_pages == 0) return cudaSuccess;
  I::Segments seg{};
  int64_t bytes[4];
  const void* ptrs[4];
  auto add = [&](void* base, int64_t page_bytes) {
    if (base == nullptr || page_bytes <= 0) return;
    seg.src[seg.count] = static_cast<const char*>(base);
    seg.dst[seg.count] = static_cast<char*>(base);
    bytes[seg.count] = page_bytes;
    ptrs[seg.count] = base;
    seg.units[seg.count] = page_bytes;  // in bytes until the unit is known
    ++seg.count;
  };
  add(p.k_pages, p.page_bytes_k);
  add(p.v_pages, p.page_bytes_v);
  if (p.k_scale != nullptr && p.v_scale != nullptr && p.scale_per_page > 0) {
    add(p.k_scale, int64_t(p.scale_per_page) * int64_t(sizeof(float)));
    add(p.v_scale, int64_t(p.scale_per_page) * int64_t(sizeof(float)));
  }
  if (seg.count == 0) return cudaSuccess;
  const int unit = I::copy_unit(bytes, ptrs, seg.count);
  seg.total = 0;
  for (int i = 0; i < seg.count; ++i) {
    seg.units[i] /= unit;
    seg.total += seg.units[i];
  }
  const dim3 grid = I::grid_2d((seg.total + I::kThreads - 1) / I::kThreads, p.num_copies);
  return I::launch_by_unit<I::CopyPagesLaunch>(unit, grid, stream, seg, p.src, p.dst,
                                               int64_t(p.num_copies), int64_t(p.num_pages));
}

}  // namespace jax_flash
