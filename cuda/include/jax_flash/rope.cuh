// CUDA kernel of apply_rope. Semantics: jax_flash/rope_params.h.
//
// One thread per (token, pair): it computes the pair's cos/sin once (sincosf, float32) and
// rotates that pair in every head; threads past the pairs copy the features beyond rotary_dim.
// Consecutive threads touch consecutive features of a head, so loads and stores coalesce. The
// op moves 2 * tokens * heads * head_dim elements and is bound by memory bandwidth.
//
// No XLA headers here.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "jax_flash/flash_attention_common.cuh"  // to_float, from_float
#include "jax_flash/rope_params.h"

namespace jax_flash {
namespace rope_cuda {

constexpr int kThreads = 256;

template <typename T, RopeStyle kStyle>
__global__ void __launch_bounds__(kThreads) rope_kernel(const RopeParams p) {
  const int32_t half = p.rotary_dim / 2;
  const int32_t items = half + (p.head_dim - p.rotary_dim);  // per token
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (g >= p.tokens * items) return;
  const int64_t t = g / items;
  const int32_t j = static_cast<int32_t>(g - t * items);
  const int64_t row = t * p.heads * p.head_dim;
  const T* x = static_cast<const T*>(p.x) + row;
  T* out = static_cast<T*>(p.out) + row;
  if (j < half) {
    float s, c;
    sincosf(rope::angle(p.positions[t], p.inv_freq[j]), &s, &c);
    const int32_t ia = rope::first_of_pair(kStyle, j);
    const int32_t ib = rope::second_of_pair(kStyle, j, p.rotary_dim);
    for (int32_t h = 0; h < p.heads; ++h) {
      const int64_t o = static_cast<int64_t>(h) * p.head_dim;
      float a, b;
      rope::rotate(to_float(x[o + ia]), to_float(x[o + ib]), c, s, &a, &b);
      out[o + ia] = from_float<T>(a);
      out[o + ib] = from_float<T>(b);
    }
  } else {
    const int32_t d = p.rotary_dim + (j - half);
    for (int32_t h = 0; h < p.heads; ++h) {
      const int64_t o = static_cast<int64_t>(h) * p.head_dim + d;
      out[o] = x[o];
    }
  }
}

template <typename T>
cudaError_t launch_rope(const RopeParams& p, cudaStream_t stream) {
  const int64_t items = p.rotary_dim / 2 + (p.head_dim - p.rotary_dim);
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
