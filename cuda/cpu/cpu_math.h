// Float helpers shared by the CPU kernels, written so that loops over them vectorise (no libm
// calls; selects as bit masks). Inlined into every ISA-specific copy of a kernel (isa.h).
#pragma once

#include <cstdint>

#include "jax_flash/numeric.h"  // f2u, u2f

#if defined(__GNUC__)
#define JF_INLINE inline __attribute__((always_inline))
#define JF_RESTRICT __restrict__
#else
#define JF_INLINE inline
#define JF_RESTRICT
#endif

namespace jax_flash {
namespace cpu {

JF_INLINE int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// exp for the softmax: Cephes expf polynomial, about 1 ulp relative error for x in [-87, 88].
// Exactly 0 for x < -87 (including -inf; the true value is below 1.7e-38 there), nan for nan.
// The final select is a bit mask rather than `cond ? 0 : r`: with the latter GCC sinks the
// (possibly trapping) float->int conversion into a branch and gives up vectorising the loop (a
// float clamp of t before the conversion would not be if-converted either; the vector
// conversion of out-of-range t gives INT_MIN, clamped below).
JF_INLINE float exp_approx(float x) {
  const float t = x * 1.44269504088896341f;
  int32_t n = static_cast<int32_t>(t + (t < 0.0f ? -0.5f : 0.5f));  // round to nearest
  n = n < -126 ? -126 : n;
  n = n > 127 ? 127 : n;
  const float fn = static_cast<float>(n);
  float r = x - fn * 0.693359375f;
  r = r - fn * -2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  const float e = y * numeric::u2f(static_cast<uint32_t>(n + 127) << 23);  // y * 2^n
  const uint32_t keep = 0u - static_cast<uint32_t>(!(x < -87.0f));
  return numeric::u2f(numeric::f2u(e) & keep);
}

// tanh for the logit soft-cap: Cephes tanhf polynomial for |x| < 0.625, (1 - e) / (1 + e) with
// e = exp(-2|x|) above.
JF_INLINE float tanh_approx(float x) {
  const float a = x < 0.0f ? -x : x;
  const float z = x * x;
  const float small =
      ((((-5.70498872745e-3f * z + 2.06390887954e-2f) * z - 5.37397155531e-2f) * z +
        1.33314422036e-1f) * z - 3.33332819422e-1f) * z * x + x;
  const float e = exp_approx(-2.0f * a);
  const float big = (1.0f - e) / (1.0f + e);  // tanh(|x|)
  const uint32_t big_signed = numeric::f2u(big) | (numeric::f2u(x) & 0x80000000u);
  const uint32_t use_small = 0u - static_cast<uint32_t>(a < 0.625f);
  return numeric::u2f((numeric::f2u(small) & use_small) | (big_signed & ~use_small));
}

}  // namespace cpu
}  // namespace jax_flash
