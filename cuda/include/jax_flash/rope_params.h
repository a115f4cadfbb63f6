// Parameters and math of rotary position embeddings (apply_rope), shared by the CPU and CUDA
// kernels and by the fused RoPE + cache append (append_kv with positions / rope), so that both
// rotate alike, bit for bit.
//
// Token t (position pos_t) of x [tokens, heads, head_dim]: the first rotary_dim features of each
// head are rotated in pairs (a, b) by the angle pos_t * inv_freq[i], i < rotary_dim / 2:
//     a' = a cos - b sin,   b' = b cos + a sin
// with the pair (i, i + rotary_dim / 2) in the NeoX / Llama style (rotate_half of Hugging Face:
// out = x cos + rotate_half(x) sin, cos = cat(cos(freqs), cos(freqs))) and (2i, 2i + 1) in the
// GPT-J style (interleaved). Features past rotary_dim are copied. The angle is one float32
// product float(pos) * inv_freq[i] (as Hugging Face's `inv_freq @ position_ids` in float32);
// cos and sin are the accurate float32 functions (not the fast approximations), and the
// rotation runs in float32 before the result is rounded to the dtype of x. Each product of the
// rotation is rounded on its own (no fused multiply-add), on the host and on the device, so that
// every kernel that rotates computes the same bits whatever the compiler contracts elsewhere.
//
// inv_freq [rotary_dim / 2] float32 carries theta and any frequency scaling (Llama 3, linear);
// it is computed on the host (jax_flash.reference.rope_inv_freq), so the kernels know nothing
// of scaling schemes, and reaches them as an FFI attribute copied into this struct (passed to
// the CUDA kernel by value: no device buffer, and nothing for vmap to batch). Positions are
// int32 and may hold any value (not only 0..S-1); float(pos) is exact for |pos| < 2^24.
//
// No XLA headers here: the FFI handlers fill the struct, the kernels read it.
#pragma once

#include <cstdint>

#include "jax_flash/dtype.h"  // DType, JAX_FLASH_HD

namespace jax_flash {

enum class RopeStyle : int32_t { kNeox = 0, kGptj = 1 };

// Largest rotary_dim the kernels take.
constexpr int32_t kMaxRotaryDim = 512;

struct RopeParams {
  const void* x;             // [tokens, heads, head_dim] dtype
  const int32_t* positions;  // [tokens]
  void* out;                 // [tokens, heads, head_dim] dtype
  int64_t tokens;
  int32_t heads;
  int32_t head_dim;
  int32_t rotary_dim;  // even, in [2, min(head_dim, kMaxRotaryDim)]
  RopeStyle style;
  DType dtype;
  float inv_freq[kMaxRotaryDim / 2];  // [rotary_dim / 2] used
};

namespace rope {

// Feature indices of pair i (i < rotary_dim / 2) within one head.
JAX_FLASH_HD int32_t first_of_pair(RopeStyle style, int32_t i) {
  return style == RopeStyle::kNeox ? i : 2 * i;
}

JAX_FLASH_HD int32_t second_of_pair(RopeStyle style, int32_t i, int32_t rotary_dim) {
  return style == RopeStyle::kNeox ? i + rotary_dim / 2 : 2 * i + 1;
}

// The pair (index i < rotary_dim / 2) that feature d < rotary_dim belongs to.
JAX_FLASH_HD int32_t pair_of_feature(RopeStyle style, int32_t d, int32_t rotary_dim) {
  return style == RopeStyle::kNeox ? (d < rotary_dim / 2 ? d : d - rotary_dim / 2) : d / 2;
}

JAX_FLASH_HD float angle(int32_t position, float inv_freq) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(static_cast<float>(position), inv_freq);
#else
  return static_cast<float>(position) * inv_freq;
#endif
}

// (a, b) rotated by the angle whose cosine and sine are c and s. On the device the explicitly
// rounded intrinsics keep nvcc from contracting a product into an FMA (which one it would
// contract could differ between kernels); host code is compiled without FMA contraction of
// these lines (the generic x86-64 target, or one shared function: cpu/rope.h).
JAX_FLASH_HD void rotate(float a, float b, float c, float s, float* out_a, float* out_b) {
#if defined(__CUDA_ARCH__)
  *out_a = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
  *out_b = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
#else
  *out_a = a * c - b * s;
  *out_b = b * c + a * s;
#endif
}

}  // namespace rope
}  // namespace jax_flash
