// Parameters and semantics of the sampling ops (sample, top_k_top_p_filter), shared by the CPU
// and CUDA kernels. Everything a kernel decides is defined here, in host/device functions, so
// that both platforms decide the same way.
//
// Per row (logits x[V], temperature t, top_k k, top_p p, min_p m):
//  1. x is read in float32; NaN counts as -inf, +inf as 0x1.fep127 (~3.39e38, the largest
//     bfloat16, so that every value keeps the dtype's zero low bits), -0 as +0.
//  2. Order: tokens are ranked by x descending, ties by index ascending (a total order, encoded in
//     one 64-bit key per token: order_key). Every filter below keeps a prefix of this order.
//  3. Scaled logits d_i = (x_i - x_max) / t in [-inf, 0] (IEEE float32); probabilities are
//     softmax(d). A row with no finite logit has no token (sample gives -1, the filter all -inf).
//     t <= 0 (or NaN) is greedy: the first token of the order (argmax, lowest index on ties).
//  4. top_k (on when 0 < k < V): keep the first k tokens of the order (ties at the k-th value
//     are cut by index: exactly k tokens are kept).
//  5. top_p (on when p < 1): within the top-k set, keep the shortest prefix whose probability
//     mass, renormalised over the top-k set, is >= p (at least one token). Masses are fixed-point
//     integers, mass_i = floor(exp(d_i) * 2^40) (exp_nonpos below; the top token has exactly
//     2^40), summed exactly in uint64 (V < 2^24), so the cut does not depend on summation order:
//     the prefix of n tokens is kept for the smallest n with sum_{j<n} mass_j >= top_p_target.
//  6. min_p (on when m > 0): keep tokens with d_i >= log(min(m, 1)), i.e. p_i >= m * p_max.
//  7. The kept set is the intersection of these prefixes. sample draws from softmax(d) restricted
//     to it by the Gumbel-max trick: token = argmax over kept i of d_i - log(-log(u_i)), ties to
//     the lowest index, with u_i the uniform of token i (gumbel_uniform): exact sampling from the
//     renormalised distribution, no normalisation sum and no sort. The filter writes x_i / t for
//     kept tokens (x_i itself for a greedy row) and -inf elsewhere.
//
// exp and log are computed by exp_nonpos / log_pos below with IEEE add, mul and div only
// (no FMA contraction: CUDA uses the _rn intrinsics, the CPU kernel disables contraction), so
// masses, min-p bounds and Gumbel noise are bit-identical on CPU and CUDA, and so are the sampled
// tokens for the same seeds.
//
// No XLA headers here: the FFI handlers fill the struct, the kernels read it.
#pragma once

#include <cstdint>

#include "jax_flash/dtype.h"  // DType, JAX_FLASH_HD
#include "jax_flash/numeric.h"       // f2u, u2f
#include "jax_flash/philox.h"

#if !defined(__CUDA_ARCH__)
#include <cmath>
#endif

namespace jax_flash {

struct SamplingParams {
  const void* logits;        // [batch, vocab] dtype
  const float* temperature;  // [batch]; <= 0: greedy
  const int32_t* top_k;      // [batch]; <= 0 or >= vocab: off
  const float* top_p;        // [batch]; >= 1: off
  const float* min_p;        // [batch]; <= 0: off
  const uint32_t* seeds;     // [batch, 3]: Philox key (2 words), the row's stream id; sample only
  int32_t* tokens;           // [batch] sampled token, -1 for a row with no finite logit (sample)
  void* masked;              // [batch, vocab] dtype, the filtered logits (filter)
  int64_t batch;
  int32_t vocab;
  DType dtype;
};

namespace sampling {

// Fixed-point scale of the masses: mass = floor(p / p_max * 2^40). With vocab < 2^24 every sum of
// masses fits in uint64.
constexpr int kMassBits = 40;
constexpr int32_t kMaxVocab = (1 << 24) - 1;
constexpr float kPosInfLogit = 0x1.fep127f;  // bits 0x7f7f0000

// ---------------------------------------------------------------------------------------------
// IEEE float32 operations that no compiler fuses into an FMA.

JAX_FLASH_HD float add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

JAX_FLASH_HD float sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

JAX_FLASH_HD float mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

JAX_FLASH_HD float div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// exp(x) for x <= 0 (x = -inf gives 0): Cody-Waite reduction x = n ln2 + r, |r| <= ln2 / 2, and a
// degree-7 polynomial for e^r (Cephes coefficients), ~2 ulp. exp_nonpos(0) == 1 exactly. Results
// below 2^-125 (x <= -87) are 0: their 40-bit mass is 0 anyway.
JAX_FLASH_HD float exp_nonpos(float x) {
  if (!(x > -87.0f)) return 0.0f;
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float n = sub(add(mul(x, 1.44269504088896341f), shifter), shifter);
  float r = sub(x, mul(n, 0.693359375f));  // ln2 = 0.693359375 - 2.12194440e-4, n * hi exact
  r = sub(r, mul(n, -2.12194440e-4f));
  float e = 1.9875691500e-4f;
  e = add(mul(e, r), 1.3981999507e-3f);
  e = add(mul(e, r), 8.3334519073e-3f);
  e = add(mul(e, r), 4.1665795894e-2f);
  e = add(mul(e, r), 1.6666665459e-1f);
  e = add(mul(e, r), 5.0000001201e-1f);
  e = add(add(mul(mul(e, r), r), r), 1.0f);
  const int32_t ni = static_cast<int32_t>(n);  // in [-126, 0]
  return mul(e, numeric::u2f(static_cast<uint32_t>(ni + 127) << 23));
}

// log(x) for finite x > 0 (subnormals included): x = 2^k * m with m in [sqrt(2)/2, sqrt(2)),
// f = m - 1, log(1 + f) = f - f^2/2 + s (f^2/2 + R(s^2)), s = f / (2 + f), as fdlibm's logf;
// < 1 ulp. log_pos(1) == 0 exactly. Accurate near 1 (log(1 - 2^-24) != 0).
JAX_FLASH_HD float log_pos(float x) {
  const bool subnormal = numeric::f2u(x) < 0x00800000u;  // scale into the normal range (exact)
  x = mul(x, subnormal ? 33554432.0f : 1.0f);           // 2^25
  uint32_t ix = numeric::f2u(x);
  int32_t k = subnormal ? -25 : 0;
  ix += 0x3f800000u - 0x3f3504f3u;  // so that the exponent field gives k for m >= sqrt(2)/2
  k += static_cast<int32_t>(ix >> 23) - 127;
  ix = (ix & 0x007fffffu) + 0x3f3504f3u;
  const float f = sub(numeric::u2f(ix), 1.0f);  // exact
  const float s = div(f, add(2.0f, f));
  const float z = mul(s, s);
  const float w = mul(z, z);
  const float t1 = mul(w, add(0.40000972152f, mul(w, 0.24279078841f)));
  const float t2 = mul(z, add(0.66666662693f, mul(w, 0.28498786688f)));
  const float big_r = add(t2, t1);
  const float hfsq = mul(mul(0.5f, f), f);
  const float dk = static_cast<float>(k);
  float y = add(mul(s, add(hfsq, big_r)), mul(dk, 9.0580006145e-06f));  // ln2 low part
  y = add(sub(y, hfsq), f);
  return add(y, mul(dk, 6.9313812256e-01f));  // ln2 high part (dk * hi exact)
}

// ---------------------------------------------------------------------------------------------
// Order, masses and per-row decisions.

// NaN -> -inf, +inf -> kPosInfLogit, -0 -> +0 (step 1).
JAX_FLASH_HD float normalize_logit(float x) {
  x = x == x ? x : -INFINITY;
  x = x == INFINITY ? kPosInfLogit : x;
  return x == 0.0f ? 0.0f : x;
}

// Monotone map of non-NaN floats to uint32 (a < b <=> value_key(a) < value_key(b), -0 < +0).
JAX_FLASH_HD uint32_t value_key(float x) {
  const uint32_t u = numeric::f2u(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

JAX_FLASH_HD float key_value(uint32_t key) {
  return numeric::u2f((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// Position in the order of step 2: a larger key comes first. Distinct for distinct indices.
JAX_FLASH_HD uint64_t order_key(float x, uint32_t index) {
  return (static_cast<uint64_t>(value_key(x)) << 32) | static_cast<uint32_t>(~index);
}

JAX_FLASH_HD uint32_t key_index(uint64_t key) { return ~static_cast<uint32_t>(key); }

// High bits of value_key that can differ between values of the logits dtype (the others are the
// same for all tokens of one sign): float32 32, float16 19 (sign, 8 exponent, 10 mantissa bits
// after the conversion), bfloat16 16.
JAX_FLASH_HD int value_bits(DType dt) {
  return dt == DType::kFloat32 ? 32 : (dt == DType::kFloat16 ? 19 : 16);
}

// d = (x - x_max) / t (step 3); x and x_max normalised, t > 0.
JAX_FLASH_HD float scaled_logit(float x, float x_max, float temperature) {
  return div(sub(x, x_max), temperature);
}

// Fixed-point mass floor(exp(d) * 2^40) of a token with scaled logit d <= 0 (step 5).
JAX_FLASH_HD uint64_t mass(float d) {
  return static_cast<uint64_t>(mul(exp_nonpos(d), 1099511627776.0f));  // 2^40, truncated
}

// What the filters of one row do. greedy rows ignore the rest.
struct RowPlan {
  bool greedy;
  bool top_k_on;
  bool top_p_on;
  int32_t top_k;    // tokens kept by top-k: k when on, else vocab
  float top_p;
  float log_min_p;  // d >= log_min_p is kept; -inf when min-p is off
};

JAX_FLASH_HD RowPlan row_plan(float temperature, int32_t top_k, float top_p, float min_p,
                              int32_t vocab) {
  RowPlan plan;
  plan.greedy = !(temperature > 0.0f);
  plan.top_k_on = top_k > 0 && top_k < vocab;
  plan.top_k = plan.top_k_on ? top_k : vocab;
  plan.top_p_on = top_p < 1.0f;
  plan.top_p = top_p;
  plan.log_min_p = min_p > 0.0f ? log_pos(min_p < 1.0f ? min_p : 1.0f) : -INFINITY;
  return plan;
}

// Mass the top-p prefix must reach: ceil(p * total) in double, within [1, total].
JAX_FLASH_HD uint64_t top_p_target(float top_p, uint64_t total) {
  const double t = ceil(static_cast<double>(top_p) * static_cast<double>(total));
  if (!(t >= 1.0)) return 1;
  const uint64_t target = t >= 0x1p64 ? total : static_cast<uint64_t>(t);
  return target < total ? target : total;
}

// A mass below which a token lies after the top-p cut, so a kernel may skip it when it searches
// the cut (a speed-up only; the result is the same). With n tokens in the top-k set and the cut
// at token c: the tokens from c on hold more than (1 - p) * total of the mass and none of them
// has more than mass_c, so mass_c > (1 - p) * total / n; tokens before the cut have at least
// mass_c. Margins cover the rounding of the target, of exp_nonpos (not perfectly monotone, by
// a few ulp) and of the truncation to integers.
JAX_FLASH_HD uint64_t top_p_mass_floor(float top_p, uint64_t total, int32_t n) {
  const double rest = (1.0 - static_cast<double>(top_p)) * static_cast<double>(total);
  const double bound = ((rest * (1.0 - 0x1p-20) - 2.0) / n - 1.0) * (1.0 - 0x1p-14) - 2.0;
  return bound > 0.0 ? static_cast<uint64_t>(bound) : 0;
}

// The uniform u_i of token `index` for the row with seeds {k0, k1, stream}: word index % 4 of
// Philox4x32-10 at counter (index / 4, stream, 0, 0) under key (k0, k1).
JAX_FLASH_HD philox::Words gumbel_words(const uint32_t* seeds, uint32_t index) {
  return philox::philox4x32_10(philox::Words{{index >> 2, seeds[2], 0u, 0u}}, seeds[0], seeds[1]);
}

// d - log(-log(u)): the Gumbel-perturbed scaled logit of step 7.
JAX_FLASH_HD float gumbel_score(float d, uint32_t random_word) {
  const float u = philox::uniform_open01(random_word);
  return sub(d, log_pos(-log_pos(u)));
}

}  // namespace sampling
}  // namespace jax_flash
