// CUDA kernel of apply_rope. Semantics: jax_flash/rope_params.h.
//
// One thread per (token, group of kHeadsPerItem heads, pair): it computes the pair's cos/sin
// once (sincosf, float32) and rotates that pair in the group's heads; threads past the pairs
// copy the features beyond rotary_dim. Consecutive threads touch consecutive features of a
// head, so loads and stores coalesce. The op moves 2 * tokens * heads * head_dim elements and
// is bound by memory bandwidth.
//
// No XLA headers here.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "jax_flash/dtype.cuh"  // to_float, from_float
#include "jax_flash/rope_params.h"

namespace jax_flash {
namespace rope_cuda {

constexpr int kThreads = 256;

// The device code that rotates, shared by apply_rope and the fused RoPE + cache append
// (kv_cache_rope.cuh), so that both produce the same bits. Every floating-point step is
// context-free: the angle and the rotation use explicitly rounded operations (rope_params.h),
// sincosf's own arithmetic is explicit fma.rn / products that feed no addition, and the
// conversions are exact (to_float) or round-to-nearest-even (from_float).

// cos and sin of a pair's angle at `position` (accurate sincosf, float32).
__device__ __forceinline__ void pair_cos_sin(float inv_freq, int32_t position, float* c,
                                             float* s) {
  sincosf(rope::angle(position, inv_freq), s, c);
}

// Pair i of one head row x: its feature indices and rotated values, rounded to T (the values
// apply_rope stores).
template <typename T, RopeStyle kStyle>
__device__ __forceinline__ void rotate_pair(const T* x, int32_t i, int32_t rotary_dim, float c,
                                            float s, int32_t* ia, int32_t* ib, T* a, T* b) {
  *ia = rope::first_of_pair(kStyle, i);
  *ib = rope::second_of_pair(kStyle, i, rotary_dim);
  float fa, fb;
  rope::rotate(to_float(x[*ia]), to_float(x[*ib]), c, s, &fa, &fb);
  *a = from_float<T>(fa);
  *b = from_float<T>(fb);
}

// Heads one item covers: a thread loads the item's features of kHeadsPerItem heads, then
// stores them. (One head at a time would cost a memory round trip per head: no load can move
// above a store to out, which may alias x. A decode step's one token then took ~10 us for 32
// heads on an H100.)
constexpr int32_t kHeadsPerItem = 4;

// Items of one token: rotary_dim / 2 pairs and head_dim - rotary_dim pass-through features,
// each for every group of kHeadsPerItem of `heads` heads.
__host__ __device__ constexpr int64_t rope_items(int32_t rotary_dim, int32_t head_dim,
                                                 int32_t heads) {
  return (int64_t(rotary_dim / 2) + (head_dim - rotary_dim)) *
         ((int64_t(heads) + kHeadsPerItem - 1) / kHeadsPerItem);
}

// Where head h's row starts in x, in elements: apply_rope's x [heads, head_dim] (DenseHeads);
// the fused RoPE + cache write also reads rows at other strides (kv_cache_rope.cuh). out is
// always [heads, head_dim].
struct DenseHeads {
  __device__ __forceinline__ int64_t operator()(const RopeParams& p, int32_t h) const {
    return static_cast<int64_t>(h) * p.head_dim;
  }
};

// Pair i rotated in heads [h0, min(h0 + kHeadsPerItem, heads)) of x (rows at in_head) into out.
template <typename T, RopeStyle kStyle, class InHead = DenseHeads>
__device__ __forceinline__ void rotate_pair_heads(const RopeParams& p, int32_t i, float c,
                                                  float s, const T* x, T* out, int32_t h0,
                                                  int32_t heads, InHead in_head = {}) {
  const int32_t ia = rope::first_of_pair(kStyle, i);
  const int32_t ib = rope::second_of_pair(kStyle, i, p.rotary_dim);
  T xa[kHeadsPerItem], xb[kHeadsPerItem];
#pragma unroll
  for (int32_t k = 0; k < kHeadsPerItem; ++k) {
    if (h0 + k < heads) {
      const int64_t o = in_head(p, h0 + k);
      xa[k] = x[o + ia];
      xb[k] = x[o + ib];
    }
  }
#pragma unroll
  for (int32_t k = 0; k < kHeadsPerItem; ++k) {
    const int64_t o = static_cast<int64_t>(h0 + k) * p.head_dim;
    if (h0 + k < heads) {
      float fa, fb;
      rope::rotate(to_float(xa[k]), to_float(xb[k]), c, s, &fa, &fb);
      out[o + ia] = from_float<T>(fa);
      out[o + ib] = from_float<T>(fb);
    }
  }
}

// Pass-through feature d (>= rotary_dim) copied in heads [h0, min(h0 + kHeadsPerItem, heads)).
template <typename T, class InHead = DenseHeads>
__device__ __forceinline__ void copy_feature_heads(const RopeParams& p, int32_t d, const T* x,
                                                   T* out, int32_t h0, int32_t heads,
                                                   InHead in_head = {}) {
  T v[kHeadsPerItem];
#pragma unroll
  for (int32_t k = 0; k < kHeadsPerItem; ++k)
    if (h0 + k < heads) v[k] = x[in_head(p, h0 + k) + d];
#pragma unroll
  for (int32_t k = 0; k < kHeadsPerItem; ++k)
    if (h0 + k < heads) out[static_cast<int64_t>(h0 + k) * p.head_dim + d] = v[k];
}

// Rope item w of a token (w < rope_items(rotary_dim, head_dim, heads)): j = w % (rotary_dim / 2
// + head_dim - rotary_dim) in the heads of group w / that (consecutive items: consecutive
// features of a head, so loads and stores coalesce). j < rotary_dim / 2 rotates pair j (one
// sincosf shared by the group's heads); the others copy feature rotary_dim + (j - rotary_dim /
// 2).
template <typename T, RopeStyle kStyle, class InHead = DenseHeads>
__device__ __forceinline__ void rope_item(const RopeParams& p, int32_t position, int32_t w,
                                          const T* x, T* out, int32_t heads, InHead in_head = {}) {
  const int32_t half = p.rotary_dim / 2;
  const int32_t per_group = half + (p.head_dim - p.rotary_dim);
  const int32_t h0 = (w / per_group) * kHeadsPerItem;
  const int32_t j = w % per_group;
  if (j < half) {
    float c, s;
    pair_cos_sin(p.inv_freq[j], position, &c, &s);
    rotate_pair_heads<T, kStyle>(p, j, c, s, x, out, h0, heads, in_head);
  } else {
    copy_feature_heads(p, p.rotary_dim + (j - half), x, out, h0, heads, in_head);
  }
}

template <typename T, RopeStyle kStyle>
__global__ void __launch_bounds__(kThreads) rope_kernel(const RopeParams p) {
  const int64_t items = rope_items(p.rotary_dim, p.head_dim, p.heads);  // per token
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (g >= p.tokens * items) return;
  const int64_t t = g / items;
  const int32_t j = static_cast<int32_t>(g - t * items);
  const int64_t row = t * p.heads * p.head_dim;
  rope_item<T, kStyle>(p, p.positions[t], j, static_cast<const T*>(p.x) + row,
                       static_cast<T*>(p.out) + row, p.heads);
}

template <typename T>
cudaError_t launch_rope(const RopeParams& p, cudaStream_t stream) {
  const int64_t items = rope_items(p.rotary_dim, p.head_dim, p.heads);
  const int64_t blocks = (p.tokens * items + kThreads - 1) / kThreads;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  auto kernel = p.style == RopeStyle::kNeox ? rope_kernel<T, RopeStyle::kNeox>
                                            : rope_kernel<T, RopeStyle::kGptj>;
  kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace rope_cuda

// Runs apply_rope on `stream`, asynchronously; returns the launch status. Never allocates or
// synchronizes.
inline cudaError_t run_rope(const RopeParams& p, cudaStream_t stream) {
  if (p.tokens < 0 || p.heads < 0 || p.head_dim <= 0 || p.rotary_dim < 2 ||
      p.rotary_dim % 2 != 0 || p.rotary_dim > p.head_dim || p.rotary_dim > kMaxRotaryDim)
    return cudaErrorInvalidValue;
  if (p.tokens == 0 || p.heads == 0) return cudaSuccess;
  switch (p.dtype) {
    case DType::kFloat32: return rope_cuda::launch_rope<float>(p, stream);
    case DType::kFloat16: return rope_cuda::launch_rope<__half>(p, stream);
    case DType::kBFloat16: return rope_cuda::launch_rope<__nv_bfloat16>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace jax_flash
