// Philox4x32-10 (Salmon, Moraes, Dror, Shaw: "Parallel random numbers: as easy as 1, 2, 3",
// SC 2011), the counter-based generator of Random123 and cuRAND, host and device usable.
//
// A counter-based generator is a keyed bijection of 128-bit counters: the random words of any
// position are computed directly, with no state carried between threads or calls, so every
// platform (CPU, CUDA, the jnp reference) produces the same words for the same (key, counter).
// Integer operations only. Checked against the Random123 known-answer vectors in
// tests/test_sampling.py (through the jnp copy in jax_flash/reference.py).
#pragma once

#include <cstdint>

#include "jax_flash/dtype.h"  // JAX_FLASH_HD

namespace jax_flash {
namespace philox {

struct Words {
  uint32_t w[4];
};

constexpr uint32_t kMul0 = 0xD2511F53u;  // round multipliers
constexpr uint32_t kMul1 = 0xCD9E8D57u;
constexpr uint32_t kWeyl0 = 0x9E3779B9u;  // key schedule increments (golden ratio, sqrt(3) - 1)
constexpr uint32_t kWeyl1 = 0xBB67AE85u;

JAX_FLASH_HD uint32_t mul_hi(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
#endif
}

// The 4 random words at counter c under key (k0, k1).
JAX_FLASH_HD Words philox4x32_10(Words c, uint32_t k0, uint32_t k1) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += kWeyl0;
      k1 += kWeyl1;
    }
    const uint32_t hi0 = mul_hi(kMul0, c.w[0]), lo0 = kMul0 * c.w[0];
    const uint32_t hi1 = mul_hi(kMul1, c.w[2]), lo1 = kMul1 * c.w[2];
    c = Words{{hi1 ^ c.w[1] ^ k0, lo1, hi0 ^ c.w[3] ^ k1, lo0}};
  }
  return c;
}

// A uniform float in the open interval (0, 1) from 32 random bits: u = (2m + 1) / 2^24 with m
// the top 23 bits. Exact in float32 (no rounding, so every platform agrees), symmetric about
// 1/2, never 0 or 1 (so log(u) and log(1 - u) are finite).
JAX_FLASH_HD float uniform_open01(uint32_t bits) {
  return static_cast<float>(((bits >> 9) << 1) | 1u) * 5.9604644775390625e-08f;  // 2^-24
}

}  // namespace philox
}  // namespace jax_flash
