// Decoding of the apply_rope FFI call into RopeParams, shared by the CPU and CUDA handlers.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "ffi_error.h"
#include "jax_flash/rope_params.h"
#include "xla/ffi/api/ffi.h"

namespace jax_flash::ffi_impl {

namespace ffi = xla::ffi;

// Buffers: x [T, H, D] float32 | float16 | bfloat16, positions [T] int32 -> out [T, H, D]
// (dtype of x). Attributes: style (0 NeoX, 1 GPT-J), rotary_dim (even, 2..min(D, 512)),
// inv_freq [rotary_dim / 2] float32. `op` names the call in the messages (the fused RoPE +
// append decodes its queries and rotation with this function too, as append_kv).
// The rotation of rows of head_dim features of T tokens: checks positions [T] and the
// attributes, fills p's positions, inv_freq, rotary_dim and style (make_rope_params, and the
// fused RoPE + append's packed rows, whose shape is not x's).
inline ffi::Error make_rope_rotation(const ffi::Buffer<ffi::S32>& positions, int64_t T,
                                     int64_t head_dim, int32_t style, int32_t rotary_dim,
                                     ffi::Span<const float> inv_freq, RopeParams* p,
                                     const char* op) {
  if (static_cast<int64_t>(positions.element_count()) != T)
    return invalid(op, "positions must be [T] with T = " + std::to_string(T) + ", got " +
                           dims_str(positions.dimensions()));
  if (rotary_dim < 2 || rotary_dim % 2 != 0 || rotary_dim > head_dim ||
      rotary_dim > kMaxRotaryDim)
    return invalid(op, "rotary_dim must be even and in [2, min(D, " +
                           std::to_string(kMaxRotaryDim) + ")] with D = " +
                           std::to_string(head_dim) + ", got " + std::to_string(rotary_dim));
  if (static_cast<int64_t>(inv_freq.size()) != rotary_dim / 2)
    return invalid(op, "inv_freq must have rotary_dim / 2 = " + std::to_string(rotary_dim / 2) +
                           " values, got " + std::to_string(inv_freq.size()));
  if (style != 0 && style != 1) return invalid(op, "style must be 0 (neox) or 1 (gptj)");
  p->positions = positions.typed_data();
  for (int32_t i = 0; i < rotary_dim / 2; ++i) p->inv_freq[i] = inv_freq[i];
  p->rotary_dim = rotary_dim;
  p->style = style == 0 ? RopeStyle::kNeox : RopeStyle::kGptj;
  return ffi::Error::Success();
}

inline ffi::Error make_rope_params(const ffi::AnyBuffer& x,
                                   const ffi::Buffer<ffi::S32>& positions,
                                   const ffi::AnyBuffer& out, int32_t style, int32_t rotary_dim,
                                   ffi::Span<const float> inv_freq, RopeParams* p,
                                   const char* op = "apply_rope") {
  const auto xd = x.dimensions();
  if (xd.size() != 3) return invalid(op, "x must be [T, H, D], got " + dims_str(xd));
  ffi::Error err =
      make_rope_rotation(positions, xd[0], xd[2], style, rotary_dim, inv_freq, p, op);
  if (err.failure()) return err;
  const auto od = out.dimensions();
  if (od.size() != 3 || od[0] != xd[0] || od[1] != xd[1] || od[2] != xd[2] ||
      out.element_type() != x.element_type())
    return invalid(op, "out must have x's shape and dtype, got " + dims_str(od));
  if (xd[1] > INT32_MAX || xd[2] > INT32_MAX) return invalid(op, "more than 2^31-1 heads");
  switch (x.element_type()) {
    case ffi::F32: p->dtype = DType::kFloat32; break;
    case ffi::F16: p->dtype = DType::kFloat16; break;
    case ffi::BF16: p->dtype = DType::kBFloat16; break;
    default: return invalid(op, "x must be float32, float16 or bfloat16");
  }
  p->x = x.untyped_data();
  p->out = out.untyped_data();
  p->tokens = xd[0];
  p->heads = static_cast<int32_t>(xd[1]);
  p->head_dim = static_cast<int32_t>(xd[2]);
  return ffi::Error::Success();
}

// The FFI signature shared by both platforms (the CUDA one binds the stream context first).
template <typename Binding>
auto rope_binding(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()  // x
      .template Arg<ffi::Buffer<ffi::S32>>()                 // positions
      .template Ret<ffi::AnyBuffer>()                        // out
      .template Attr<int32_t>("style")
      .template Attr<int32_t>("rotary_dim")
      .template Attr<ffi::Span<const float>>("inv_freq");
}

}  // namespace jax_flash::ffi_impl
