// Score scaling shared by the fused attention kernels (the mma.sync and Hopper forwards, the
// mma.sync backward): the kernels keep scores in "raw" units x (q.k, or tanh(q.k * scale /
// softcap) with a soft cap) and the softmax in base-2 units, weight = exp2(x * scale_log2 - m).
#pragma once

#include "jax_flash/flash_params.h"
#include "jax_flash/mma_sync.cuh"

namespace jax_flash {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;  // lse = (m + log2(sum)) * kLn2 from base-2 units

// Lazy rescale threshold of the online softmax (forward kernels), log2 units: a row keeps its
// reference max until a score exceeds it by more than 2^kRescaleLog2 in weight, so weights stay
// <= 256 and O and the row sum are rescaled only then.
constexpr float kRescaleLog2 = 8.f;

// tanh(x) = 1 - 2 / (1 + e^{2x}): absolute error ~1e-7 (tanh.approx.f32's ~5e-4 would be
// multiplied by softcap); saturates to +-1 without NaN.
__device__ __forceinline__ float softcap_tanh(float x) {
  return 1.f - 2.f / (1.f + mma_detail::fast_exp2(x * (2.f * kLog2e)));
}

// scale_log2 turns raw scores into log2 units; softcap_in (soft cap only) is the factor inside
// the tanh: x = softcap_tanh(q.k * softcap_in), and softcap * x is the capped scaled score.
struct ScoreScale {
  float scale_log2;
  float softcap_in;
};

template <bool kSoftcap>
__device__ __forceinline__ ScoreScale score_scale(const FlashParams& p) {
  if constexpr (kSoftcap) return {p.softcap * kLog2e, p.softmax_scale / p.softcap};
  return {p.softmax_scale * kLog2e, 0.f};
}

}  // namespace jax_flash
