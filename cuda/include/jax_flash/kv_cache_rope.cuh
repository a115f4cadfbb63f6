// CUDA kernels of the fused RoPE + cache write (append_kv with positions and rope). Semantics:
// jax_flash/kv_cache_rope_params.h. One launch rotates the queries (when given) and writes the
// rotated keys and the values into the cache slots: the rotated keys never go through memory
// outside the cache. The new rows are read where they lie, as three arrays or as one packed
// q/k/v array (AppendKVRopeParams::qkv_group; NewRowLayout), so that a fused projection's
// output needs no slicing copies before the call.
//
// Bit-equality with apply_rope followed by append_kv comes from sharing their device code, not
// from copies of it: the rotation is rope.cuh's (pair_cos_sin / rotate_pair / rope_item: the
// same sincosf, the same explicitly rounded products, the same rounding to the input dtype), the
// quantisation kv_cache.cuh's and numeric.h's (quantize_row_warp, QuantElem, warp_amax).
//
// Unquantized caches: one thread per (token, item): apply_rope's items (rope_items: a pair or
// pass-through feature of a group of heads) for the Hq query heads, then for the Hkv key heads
// (written straight into the slot); the items past them copy v elements.
// Quantized caches: per token each block computes the cos/sin table of the pairs in shared
// memory, rotates query items from it, and runs one warp per (kv head, K|V) row: a K row is
// rotated from the table into a per-warp shared-memory row (the values apply_rope stores),
// which append_kv's own warp routine (quantize_row_warp) then quantises, as it does V rows.
//
// Bounds: a slot is used as an index only once it is known to be in [0, num_pages * page_size);
// positions are only ever used as numbers (the angle), so any value is safe. Offsets are int64.
// Launchers never synchronise and never allocate (CUDA-graph capturable). No XLA headers here.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "jax_flash/dtype.cuh"  // DTypeOf
#include "jax_flash/kv_cache.cuh"
#include "jax_flash/kv_cache_rope_params.h"
#include "jax_flash/policy/limits.h"
#include "jax_flash/rope.cuh"

namespace jax_flash {
namespace kv_cache_rope_impl {

namespace KV = kv_cache_impl;
using rope_cuda::copy_feature_heads;
using rope_cuda::pair_cos_sin;
using rope_cuda::rotate_pair;
using rope_cuda::rope_item;
using rope_cuda::rope_items;
using rope_cuda::rotate_pair_heads;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
static_assert(kThreads >= kMaxRotaryDim / 2, "one thread per pair fills the cos/sin table");
// Quantized caches stage each warp's rotated K row in shared memory: head_dim * sizeof(input)
// up to this (kWarps rows + the 2 KiB cos/sin table stay within the 48 KiB a block gets
// without opting in). jax_flash/primitives/kv_cache.py sends larger rows to the jnp reference.
constexpr int64_t kMaxQuantRowBytes = policy::kRopeMaxQuantRowBytes;
static_assert(kWarps * kMaxQuantRowBytes + 2 * 4 * (kMaxRotaryDim / 2) <= 48 * 1024, "smem");

// ---------------------------------------------------------------------------------------------
// Unquantized cache (of the input dtype T). One thread per (token, item), a flat grid as
// apply_rope's kernel, each item one call of apply_rope's rope_item: items [0, q_items) rotate
// the queries into q_out, items [q_items, q_items + k_items) the keys straight into the slot;
// item q_items + k_items + e copies element e of the token's v row [Hkv, Dv].

// The rows of the new-row arrays (NewRowLayout, either layout) as rope.cuh's in_head: query
// heads, and key rows at a fixed stride.
struct QueryHeads {
  NewRowLayout l;
  __device__ __forceinline__ int64_t operator()(const RopeParams&, int32_t h) const {
    return l.q_head(h);
  }
};
struct StridedHeads {
  int64_t stride;
  __device__ __forceinline__ int64_t operator()(const RopeParams&, int32_t h) const {
    return h * stride;
  }
};

template <typename T, RopeStyle kStyle>
__global__ void __launch_bounds__(kThreads)
    append_rope_plain_kernel(const AppendKVRopeParams p, const NewRowLayout l) {
  const RopeParams& r = p.rope;
  const int32_t H = p.kv.num_heads_k;
  const int64_t q_items = r.heads > 0 ? rope_items(r.rotary_dim, r.head_dim, r.heads) : 0;
  const int64_t k_items = rope_items(r.rotary_dim, r.head_dim, H);
  const int64_t per_token = q_items + k_items + int64_t(H) * p.kv.head_dim_v;
  const int64_t g = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (g >= int64_t(r.tokens) * per_token) return;
  const int64_t t = g / per_token;
  int64_t j = g - t * per_token;
  if (j < q_items) {
    rope_item<T, kStyle>(r, r.positions[t], static_cast<int32_t>(j),
                         static_cast<const T*>(l.q_src) + t * l.q_token,
                         static_cast<T*>(r.out) + t * r.heads * int64_t(r.head_dim), r.heads,
                         QueryHeads{l});
    return;
  }
  const int64_t s = p.kv.slot_mapping[t];
  if (s < 0 || s >= int64_t(p.kv.num_pages) * p.kv.page_size) return;  // skipped slot
  j -= q_items;
  if (j >= k_items) {  // element j - k_items of the token's v row [H, Dv]
    const int32_t e = static_cast<int32_t>(j - k_items), Dv = p.kv.head_dim_v, h = e / Dv;
    static_cast<T*>(p.kv.v_pages)[s * H * Dv + e] =
        static_cast<const T*>(l.v_src)[t * l.v_token + h * l.v_head + (e - h * Dv)];
    return;
  }
  rope_item<T, kStyle>(r, r.positions[t], static_cast<int32_t>(j),
                       static_cast<const T*>(l.k_src) + t * l.k_token,
                       static_cast<T*>(p.kv.k_pages) + s * H * r.head_dim, H,
                       StridedHeads{l.k_head});
}

// ---------------------------------------------------------------------------------------------
// Quantized cache (int8 / e4m3). Per token, each block first computes the cos/sin of every pair
// into shared memory (pair_cos_sin, one call per pair); its threads then rotate query items as
// apply_rope does, and its warps quantise K rows (rotated) and V rows as append_kv does.

// Feature d of the head row x after the rotation, as apply_rope stores it (rotate_pair's value
// of d's pair; the pass-through features as they are), with the token's cos/sin table.
template <typename T, RopeStyle kStyle>
__device__ __forceinline__ T rotated_feature(const RopeParams& r, const float* cos_t,
                                             const float* sin_t, const T* x, int32_t d) {
  if (d >= r.rotary_dim) return x[d];
  const int32_t i = rope::pair_of_feature(kStyle, d, r.rotary_dim);
  int32_t ia, ib;
  T a, b;
  rotate_pair<T, kStyle>(x, i, r.rotary_dim, cos_t[i], sin_t[i], &ia, &ib, &a, &b);
  return d == ia ? a : b;
}

template <typename T, RopeStyle kStyle, CacheDType CT>
__global__ void __launch_bounds__(kThreads)
    append_rope_quant_kernel(const AppendKVRopeParams p, const NewRowLayout l) {
  constexpr DType DT = DTypeOf<T>::value;
  using TI = typename KV::InElem<DT>::T;  // the storage type append_kv's quantisation reads
  __shared__ float cos_t[kMaxRotaryDim / 2], sin_t[kMaxRotaryDim / 2];
  extern __shared__ unsigned char rows_smem[];  // kWarps rotated K rows [head_dim] of T
  const RopeParams& r = p.rope;
  const int64_t t = blockIdx.x;  // one block per token (the launcher checks T < 2^31)
  const int32_t half = r.rotary_dim / 2;
  const int64_t s = p.kv.slot_mapping[t];
  const bool write = s >= 0 && s < int64_t(p.kv.num_pages) * p.kv.page_size;
  if (!write && r.heads == 0) return;  // uniform over the block
  if (static_cast<int32_t>(threadIdx.x) < half) {  // one pair per thread (kThreads >= pairs)
    float c, sn;
    pair_cos_sin(r.inv_freq[threadIdx.x], r.positions[t], &c, &sn);
    cos_t[threadIdx.x] = c;
    sin_t[threadIdx.x] = sn;
  }
  __syncthreads();
  if (r.heads > 0) {  // the queries, as apply_rope
    const T* q = static_cast<const T*>(l.q_src) + t * l.q_token;
    T* q_out = static_cast<T*>(r.out) + t * r.heads * int64_t(r.head_dim);
    const int32_t per_group = half + (r.head_dim - r.rotary_dim);
    const int32_t items = static_cast<int32_t>(rope_items(r.rotary_dim, r.head_dim, r.heads));
    for (int32_t w = threadIdx.x; w < items; w += kThreads) {
      const int32_t j = w % per_group, h0 = (w / per_group) * rope_cuda::kHeadsPerItem;
      if (j < half)
        rotate_pair_heads<T, kStyle>(r, j, cos_t[j], sin_t[j], q, q_out, h0, r.heads,
                                     QueryHeads{l});
      else
        copy_feature_heads(r, r.rotary_dim + (j - half), q, q_out, h0, r.heads, QueryHeads{l});
    }
  }
  if (!write) return;
  // K and V rows, one warp each: row and slot are uniform over a warp, so the shuffles of the
  // amax reduction see all 32 lanes.
  const int lane = threadIdx.x & 31;
  const int64_t H = p.kv.num_heads_k, D = p.kv.head_dim, Dv = p.kv.head_dim_v;
  const bool per_token = p.kv.scale_mode == ScaleMode::kPerToken;
  T* rotated = reinterpret_cast<T*>(rows_smem) + (threadIdx.x >> 5) * D;
  for (int64_t row = threadIdx.x >> 5; row < 2 * H; row += kWarps) {
    if (row < H) {
      // The row apply_rope would store, staged in shared memory, then quantised by append_kv's
      // own warp routine.
      const T* x = static_cast<const T*>(l.k_src) + t * l.k_token + row * l.k_head;
      for (int32_t d = lane; d < r.head_dim; d += 32)
        rotated[d] = rotated_feature<T, kStyle>(r, cos_t, sin_t, x, d);
      __syncwarp();
      float* scale = per_token ? p.kv.k_scale + s * H + row : p.kv.k_scale + row;
      KV::quantize_row_warp<DT, CT, 1>(reinterpret_cast<const TI*>(rotated),
                                       static_cast<uint8_t*>(p.kv.k_pages) + (s * H + row) * D,
                                       D, scale, per_token, lane);
      __syncwarp();  // the row is read before the warp's next row overwrites it
    } else {
      const int64_t h = row - H;
      float* scale = per_token ? p.kv.v_scale + s * H + h : p.kv.v_scale + h;
      const TI* v_row = static_cast<const TI*>(l.v_src) + t * l.v_token + h * l.v_head;
      KV::quantize_row_warp<DT, CT, 1>(v_row,
                                       static_cast<uint8_t*>(p.kv.v_pages) + (s * H + h) * Dv,
                                       Dv, scale, per_token, lane);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Launch.

template <typename T, RopeStyle kStyle>
cudaError_t launch_style(const AppendKVRopeParams& p, cudaStream_t stream) {
  const RopeParams& r = p.rope;
  const NewRowLayout l = new_row_layout(p);
  const int64_t T_ = p.kv.num_tokens;  // 0 < T < 2^31 (checked by the caller)
  const bool quantized =
      p.kv.cache_dtype == CacheDType::kInt8 || p.kv.cache_dtype == CacheDType::kFloat8E4M3;
  if (quantized) {
    const int64_t row_bytes = int64_t(r.head_dim) * sizeof(T);
    if (row_bytes > kMaxQuantRowBytes) return cudaErrorInvalidValue;
    const size_t smem = static_cast<size_t>(kWarps * row_bytes);
    if (p.kv.cache_dtype == CacheDType::kInt8)
      append_rope_quant_kernel<T, kStyle, CacheDType::kInt8>
          <<<static_cast<unsigned>(T_), kThreads, smem, stream>>>(p, l);
    else
      append_rope_quant_kernel<T, kStyle, CacheDType::kFloat8E4M3>
          <<<static_cast<unsigned>(T_), kThreads, smem, stream>>>(p, l);
  } else {
    // As the kernel counts: the query items (when q is rotated too), the key items, Hkv * Dv.
    const int64_t per_token =
        (r.heads > 0 ? rope_items(r.rotary_dim, r.head_dim, r.heads) : 0) +
        rope_items(r.rotary_dim, r.head_dim, p.kv.num_heads_k) +
        int64_t(p.kv.num_heads_k) * p.kv.head_dim_v;
    const int64_t blocks = (T_ * per_token + kThreads - 1) / kThreads;
    if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
    append_rope_plain_kernel<T, kStyle>
        <<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p, l);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch(const AppendKVRopeParams& p, cudaStream_t stream) {
  return p.rope.style == RopeStyle::kNeox ? launch_style<T, RopeStyle::kNeox>(p, stream)
                                          : launch_style<T, RopeStyle::kGptj>(p, stream);
}

}  // namespace kv_cache_rope_impl

// Rotates p.rope's queries and writes the rotated keys and the values into the cache
// (kv_cache_rope_params.h). Invalid parameters: cudaErrorInvalidValue without launching.
inline cudaError_t append_kv_rope_cuda(const AppendKVRopeParams& p, cudaStream_t stream) {
  namespace I = kv_cache_rope_impl;
  const AppendKVParams& kv = p.kv;
  if (kv.num_tokens < 0 || kv.num_heads_k <= 0 || kv.head_dim <= 0 || kv.head_dim_v <= 0 ||
      kv.num_pages < 0 || kv.page_size <= 0 || !rope_append_consistent(p))
    return cudaErrorInvalidValue;
  const bool quantized =
      kv.cache_dtype == CacheDType::kInt8 || kv.cache_dtype == CacheDType::kFloat8E4M3;
  if (quantized != (kv.scale_mode != ScaleMode::kNone)) return cudaErrorInvalidValue;
  if (quantized && (kv.k_scale == nullptr || kv.v_scale == nullptr)) return cudaErrorInvalidValue;
  const bool same_type = (kv.dtype == DType::kFloat32 && kv.cache_dtype == CacheDType::kFloat32) ||
                         (kv.dtype == DType::kFloat16 && kv.cache_dtype == CacheDType::kFloat16) ||
                         (kv.dtype == DType::kBFloat16 && kv.cache_dtype == CacheDType::kBFloat16);
  if (!quantized && !same_type) return cudaErrorInvalidValue;
  if (kv.num_tokens == 0) return cudaSuccess;
  switch (kv.dtype) {
    case DType::kFloat32: return I::launch<float>(p, stream);
    case DType::kFloat16: return I::launch<__half>(p, stream);
    case DType::kBFloat16: return I::launch<__nv_bfloat16>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace jax_flash
