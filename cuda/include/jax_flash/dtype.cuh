// Device side of the element types of jax_flash/dtype.h: the CUDA type of each DType
// (DTypeOf), exact widening to float and round-to-nearest-even narrowing, and the 16-byte
// vector loads and stores the kernels of every op use. No XLA headers here.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "jax_flash/dtype.h"

namespace jax_flash {

// ---------------------------------------------------------------------------------------------
// element <-> float

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
struct DTypeOf;
template <>
struct DTypeOf<float> {
  static constexpr DType value = DType::kFloat32;
};
template <>
struct DTypeOf<__half> {
  static constexpr DType value = DType::kFloat16;
};
template <>
struct DTypeOf<__nv_bfloat16> {
  static constexpr DType value = DType::kBFloat16;
};

// The 16-bit float types, the only ones the tensor-core kernels take.
template <typename T>
constexpr bool kIsHalfOrBFloat16 = DTypeOf<T>::value != DType::kFloat32;

// Number of elements of T in 16 bytes.
template <typename T>
struct Vec16 {
  static constexpr int kElems = 16 / static_cast<int>(sizeof(T));
};

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
  } else if constexpr (DTypeOf<T>::value == DType::kBFloat16) {
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

}  // namespace jax_flash
