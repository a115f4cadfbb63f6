// Scalar number formats shared by the CPU and CUDA kernels: float16 / bfloat16 / float8 e4m3
// conversions and the KV-cache quantisation of paged_params.h. Host and device usable
// (JAX_FLASH_HD); plain integer and float operations only, so that every platform computes the
// same bits. Quantisation must not be compiled with fast-math flags (it relies on IEEE division
// and on the default round-to-nearest-even mode).
#pragma once

#include <cstdint>

#include "jax_flash/dtype.h"  // JAX_FLASH_HD

#include <cmath>
#include <cstring>

namespace jax_flash {
namespace numeric {

// Largest magnitude of each quantized format (paged_params.h: qmax).
constexpr float kInt8Max = 127.0f;
constexpr float kE4M3Max = 448.0f;

JAX_FLASH_HD uint32_t f2u(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

JAX_FLASH_HD float u2f(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

// Round to nearest integer, ties to even (default rounding mode), as a float.
JAX_FLASH_HD float round_half_even(float x) {
#if defined(__CUDA_ARCH__)
  return rintf(x);
#else
  return std::nearbyint(x);
#endif
}

// ---------------------------------------------------------------------------------------------
// float16 / bfloat16 (stored as uint16_t bits)

// IEEE binary16 -> float32, exact for every input (subnormals, inf, nan); integer operations
// plus one exact subtraction of normal numbers, so flush-to-zero modes do not change it.
// Branch-free (bit-mask selects) so that loops over it vectorise.
JAX_FLASH_HD float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t mag = static_cast<uint32_t>(h & 0x7fffu) << 13;
  const uint32_t exp = mag & 0x0f800000u;
  const uint32_t normal = mag + ((127u - 15u) << 23);
  const uint32_t inf_nan = normal + ((128u - 16u) << 23);  // exponent all ones
  // zero / subnormal: 2^-14 * (1 + m/1024) - 2^-14 = m * 2^-24
  const uint32_t sub = f2u(u2f(normal + (1u << 23)) - u2f(113u << 23));
  const uint32_t is_inf = 0u - static_cast<uint32_t>(exp == 0x0f800000u);
  const uint32_t is_sub = 0u - static_cast<uint32_t>(exp == 0u);
  const uint32_t o = (inf_nan & is_inf) | (sub & is_sub) | (normal & ~(is_inf | is_sub));
  return u2f(o | sign);
}

// float32 -> IEEE binary16, round to nearest even; overflow -> inf, nan -> quiet nan.
JAX_FLASH_HD uint16_t float_to_half(float x) {
  uint32_t u = f2u(x);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  uint32_t o;
  if (u >= (143u << 23)) {  // |x| >= 65536 (or inf / nan)
    o = u > 0x7f800000u ? 0x7e00u : 0x7c00u;
  } else if (u < (113u << 23)) {  // |x| < 2^-14: half subnormal or zero
    // Adding 0.5 aligns the result's ulp (2^-24) with float's, so the FPU rounds (RNE).
    const float magic = u2f(126u << 23);
    o = f2u(u2f(u) + magic) - f2u(magic);
  } else {
    const uint32_t odd = (u >> 13) & 1u;
    u += ((15u - 127u) << 23) + 0xfffu;  // rebias and add the rounding bias
    u += odd;
    o = u >> 13;  // a carry out of the mantissa bumps the exponent (up to inf)
  }
  return static_cast<uint16_t>(o | (sign >> 16));
}

JAX_FLASH_HD float bf16_to_float(uint16_t h) { return u2f(static_cast<uint32_t>(h) << 16); }

// float32 -> bfloat16, round to nearest even; nan stays a (quiet) nan.
JAX_FLASH_HD uint16_t float_to_bf16(float x) {
  uint32_t u = f2u(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// ---------------------------------------------------------------------------------------------
// float8 e4m3 "fn" (1 sign, 4 exponent bits with bias 7, 3 mantissa bits; no infinities;
// 0x7f / 0xff are nan; largest finite 448; smallest subnormal 2^-9).

// e4m3 -> float32, exact. Branch-free (bit-mask selects) so that loops over it vectorise.
JAX_FLASH_HD float e4m3_to_float(uint8_t x) {
  const uint32_t em = x & 0x7fu;
  const uint32_t sign = static_cast<uint32_t>(x & 0x80u) << 24;
  const uint32_t normal = (em << 20) + (120u << 23);                           // exponent e >= 1
  const uint32_t sub = f2u(static_cast<float>(static_cast<int32_t>(em)) * 0.001953125f);  // m*2^-9
  const uint32_t is_sub = 0u - static_cast<uint32_t>(em < 8u);
  const uint32_t is_nan = 0u - static_cast<uint32_t>(em == 0x7fu);
  const uint32_t v = (sub & is_sub) | (normal & ~is_sub);
  return u2f(((v & ~is_nan) | (0x7fc00000u & is_nan)) | sign);
}

// float32 -> e4m3, round to nearest even, saturating to +-448; nan -> 0 (the nan encoding is
// never produced). -0 keeps its sign (0x80).
JAX_FLASH_HD uint8_t float_to_e4m3(float x) {
  const uint32_t u = f2u(x);
  const uint32_t sign = (u >> 24) & 0x80u;
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0;  // nan
  uint32_t code;
  if (a >= 0x43e00000u) {  // |x| >= 448 (or inf): saturate
    code = 0x7eu;
  } else if (a >= 0x3c800000u) {  // |x| >= 2^-6: normal; round the mantissa to 3 bits (RNE)
    a += 0x7ffffu + ((a >> 20) & 1u);
    code = (((a >> 23) - 120u) << 3) | ((a >> 20) & 7u);  // a carry bumps the exponent
    if (code > 0x7eu) code = 0x7eu;  // unreachable below 448; kept for safety
  } else {  // subnormal: m * 2^-9, m = rne(|x| * 2^9) in [0, 8]; 8 is 2^-6 = code 0x08
    code = static_cast<uint32_t>(round_half_even(u2f(a) * 512.0f));
  }
  return static_cast<uint8_t>(code | sign);
}

// ---------------------------------------------------------------------------------------------
// KV-cache quantisation (paged_params.h), bit-exact across platforms:
//   scale == 0 -> 0; else y = x / scale (IEEE), clamped to [-qmax, qmax] (nan -> 0), then
//   int8: round half to even; e4m3: round to nearest even.

JAX_FLASH_HD float clamp_nan0(float y, float qmax) {
  if (!(y == y)) return 0.0f;
  return y < -qmax ? -qmax : (y > qmax ? qmax : y);
}

JAX_FLASH_HD int8_t quantize_int8(float x, float scale) {
  if (scale == 0.0f) return 0;
  const float y = clamp_nan0(x / scale, kInt8Max);
  return static_cast<int8_t>(static_cast<int32_t>(round_half_even(y)));
}

JAX_FLASH_HD uint8_t quantize_e4m3(float x, float scale) {
  if (scale == 0.0f) return 0;
  return float_to_e4m3(clamp_nan0(x / scale, kE4M3Max));
}

// |x| folded into a running max; nan propagates (so that a nan input gives a nan scale).
JAX_FLASH_HD float amax_step(float m, float x) {
  const float a = x < 0.0f ? -x : x;
  return (a > m || !(a == a)) ? a : m;
}

// Per-token scale from the amax of one head's values.
JAX_FLASH_HD float per_token_scale(float amax, float qmax) { return amax / qmax; }

}  // namespace numeric
}  // namespace jax_flash
