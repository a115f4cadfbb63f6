// Device helpers of the paged decode kernels (CUDA-core, tensor-core, merge): PTX wrappers
// (exp2, cp.async with and without zero-fill, a wide multiply-add for addresses) and the
// conversions of cache words (int8, e4m3, 16-bit, float32) to float32.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace jax_flash {
namespace paged {

constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }
__device__ __forceinline__ float qnan() { return __int_as_float(0x7fffffff); }

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem),
               "r"(src_bytes));
}

__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, int src_bytes) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(gmem),
               "r"(src_bytes));
}

// The address a * b + c (one wide multiply-add: the compiler would otherwise re-associate the
// 64-bit additions).
__device__ __forceinline__ const void* mad_wide(uint32_t a, uint32_t b, uint64_t c) {
  uint64_t d;
  asm("mad.wide.u32 %0, %1, %2, %3;" : "=l"(d) : "r"(a), "r"(b), "l"(c));
  return reinterpret_cast<const void*>(d);
}

// The same copies with a zero-fill predicate: `zero` writes zeros and reads nothing (gmem must
// still be a valid address).
__device__ __forceinline__ void cp_async16_zfill(void* smem, const void* gmem, bool zero) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile(
      "{\n .reg .pred z;\n setp.ne.b32 z, %2, 0;\n"
      " cp.async.cg.shared.global [%0], [%1], 16, z;\n}\n" ::"r"(s),
      "l"(gmem), "r"(static_cast<int>(zero)));
}

__device__ __forceinline__ void cp_async4_zfill(void* smem, const void* gmem, bool zero) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile(
      "{\n .reg .pred z;\n setp.ne.b32 z, %2, 0;\n"
      " cp.async.ca.shared.global [%0], [%1], 4, z;\n}\n" ::"r"(s),
      "l"(gmem), "r"(static_cast<int>(zero)));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// 4 signed bytes -> 4 floats (exact): 0x4B0000xx is 2^23 + xx as a float.
__device__ __forceinline__ void s8x4_to_float(uint32_t w, float* f) {
  const uint32_t x = w ^ 0x80808080u;
  f[0] = __uint_as_float(__byte_perm(x, 0x4B000000u, 0x7440)) - 8388736.f;
  f[1] = __uint_as_float(__byte_perm(x, 0x4B000000u, 0x7441)) - 8388736.f;
  f[2] = __uint_as_float(__byte_perm(x, 0x4B000000u, 0x7442)) - 8388736.f;
  f[3] = __uint_as_float(__byte_perm(x, 0x4B000000u, 0x7443)) - 8388736.f;
}

// 4 e4m3 bytes (low first) -> two words of two float16 values (bytes 0, 1 -> lo; 2, 3 -> hi),
// exact: every e4m3 value is a float16 value. sm_89+ convert in hardware. Elsewhere the
// conversion library's fallback was half of the sm_80 compile time of the 8-bit-cache kernels
// (their SASS about the same length either way), so: a code's exponent and mantissa bits moved
// to float16's places make a float16 2^8 times smaller (a subnormal code a float16 subnormal of
// the same digits; both exact after the multiply by 2^8), and the NaN codes (low 7 bits all set,
// 480 after the multiply) become the library's float16 NaN (0x7fff).
// (The CPU kernel's scalar conversion to float32 is numeric.h's e4m3_to_float.)
__device__ __forceinline__ void e4m3x4_to_f16x2(uint32_t w, uint32_t& lo, uint32_t& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  const __half2_raw a = __nv_cvt_fp8x2_to_halfraw2(
      static_cast<__nv_fp8x2_storage_t>(w & 0xffffu), __NV_E4M3);
  const __half2_raw b = __nv_cvt_fp8x2_to_halfraw2(
      static_cast<__nv_fp8x2_storage_t>(w >> 16), __NV_E4M3);
  memcpy(&lo, &a, 4);
  memcpy(&hi, &b, 4);
#else
  const auto pair = [](uint32_t x) {  // x: the two codes in the high bytes of its halves
    const uint32_t h = (x & 0x80008000u) | ((x >> 1) & 0x3f803f80u);
    __half2 v;
    memcpy(&v, &h, 4);
    v = __hmul2(v, __half2(__ushort_as_half(0x5c00), __ushort_as_half(0x5c00)));  // 2^8
    uint32_t r;
    memcpy(&r, &v, 4);
    const uint32_t nan = __vcmpeq2(x & 0x7f007f00u, 0x7f007f00u);
    return (r & ~nan) | (nan & 0x7fff7fffu);  // the library's NaN, bit for bit
  };
  lo = pair(__byte_perm(w, 0, 0x1404));
  hi = pair(__byte_perm(w, 0, 0x3424));
#endif
}

// 4 e4m3 bytes -> 4 floats (exact).
__device__ __forceinline__ void e4m3x4_to_float(uint32_t w, float* f) {
  uint32_t lo, hi;
  e4m3x4_to_f16x2(w, lo, hi);
  __half2 a2, b2;
  memcpy(&a2, &lo, 4);
  memcpy(&b2, &hi, 4);
  const float2 a = __half22float2(a2);
  const float2 b = __half22float2(b2);
  f[0] = a.x;
  f[1] = a.y;
  f[2] = b.x;
  f[3] = b.y;
}

// Converts nwords 32-bit words of cache elements (1, 2 or 4 elements each) to floats. nwords is
// a compile-time constant at every call site (the loop unrolls).
template <typename TC>
__device__ __forceinline__ void cvt_words(const uint32_t* w, float* f, int nwords) {
#pragma unroll
  for (int i = 0; i < nwords; ++i) {
    if constexpr (std::is_same_v<TC, float>) {
      f[i] = __uint_as_float(w[i]);
    } else if constexpr (std::is_same_v<TC, __nv_bfloat16>) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    } else if constexpr (std::is_same_v<TC, __half>) {
      __half2 h;
      memcpy(&h, &w[i], 4);
      const float2 v = __half22float2(h);
      f[2 * i] = v.x;
      f[2 * i + 1] = v.y;
    } else if constexpr (std::is_same_v<TC, int8_t>) {
      s8x4_to_float(w[i], f + 4 * i);
    } else {
      e4m3x4_to_float(w[i], f + 4 * i);
    }
  }
}

// 4 consecutive elements of q (aligned to 4 elements) as floats.
template <typename TQ>
__device__ __forceinline__ float4 load4_q(const TQ* src) {
  if constexpr (std::is_same_v<TQ, float>) {
    return __ldg(reinterpret_cast<const float4*>(src));
  } else {
    const uint2 u = __ldg(reinterpret_cast<const uint2*>(src));
    const uint32_t w[2] = {u.x, u.y};
    float f[4];
    cvt_words<TQ>(w, f, 2);
    return make_float4(f[0], f[1], f[2], f[3]);
  }
}

}  // namespace paged
}  // namespace jax_flash
