// Decoding of the flash_attention FFI call into FlashParams, shared by the CPU and CUDA handlers.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "ffi_error.h"
#include "jax_flash/flash_params.h"
#include "xla/ffi/api/ffi.h"

namespace jax_flash::ffi_impl {

namespace ffi = xla::ffi;

// The op's name in error messages.
constexpr const char* kFlashOp = "flash_attention";

// Buffers (see flash_params.h for the layout):
//   q [Tq, Hq, D], k [Tk, Hkv, D], v [Tk, Hkv, Dv]      float32 | float16 | bfloat16
//   q_starts, q_ends, k_starts, k_ends [B]              int32
//   o [Tq, Hq, Dv] (dtype of q), lse [Hq, Tq] float32
inline ffi::Error make_params(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                              ffi::Buffer<ffi::S32> q_starts, ffi::Buffer<ffi::S32> q_ends,
                              ffi::Buffer<ffi::S32> k_starts, ffi::Buffer<ffi::S32> k_ends,
                              ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                              float softmax_scale, float softcap, int32_t window_left,
                              int32_t window_right, int32_t max_seqlen_q, int32_t fill_uncovered,
                              FlashParams* p) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 3) return invalid(kFlashOp, "q must be [Tq, Hq, D], got " + dims_str(qd));
  if (kd.size() != 3) return invalid(kFlashOp, "k must be [Tk, Hkv, D], got " + dims_str(kd));
  if (vd.size() != 3) return invalid(kFlashOp, "v must be [Tk, Hkv, Dv], got " + dims_str(vd));
  if (kd[2] != qd[2])
    return invalid(kFlashOp, "head_dim of k " + dims_str(kd) + " != q " + dims_str(qd));
  if (vd[0] != kd[0] || vd[1] != kd[1])
    return invalid(kFlashOp, "v " + dims_str(vd) + " does not match k " + dims_str(kd));
  if (kd[1] <= 0 || qd[1] % kd[1] != 0)
    return invalid(kFlashOp, "num_heads of q (" + std::to_string(qd[1]) +
                                 ") must be a multiple of num_heads of k (" +
                                 std::to_string(kd[1]) + ")");
  if (k.element_type() != q.element_type() || v.element_type() != q.element_type())
    return invalid(kFlashOp, "q, k and v must have the same dtype");
  DType dt;
  switch (q.element_type()) {
    case ffi::F32: dt = DType::kFloat32; break;
    case ffi::F16: dt = DType::kFloat16; break;
    case ffi::BF16: dt = DType::kBFloat16; break;
    default: return invalid(kFlashOp, "dtype must be float32, float16 or bfloat16");
  }
  const int64_t batch = q_starts.element_count();
  if (q_ends.element_count() != batch || k_starts.element_count() != batch ||
      k_ends.element_count() != batch)
    return invalid(kFlashOp, "q_starts, q_ends, k_starts, k_ends must all have the same length");
  const auto od = o->dimensions(), ld = lse->dimensions();
  if (od.size() != 3 || od[0] != qd[0] || od[1] != qd[1] || od[2] != vd[2])
    return invalid(kFlashOp, "o must be [Tq, Hq, Dv], got " + dims_str(od));
  if (ld.size() != 2 || ld[0] != qd[1] || ld[1] != qd[0])
    return invalid(kFlashOp, "lse must be [Hq, Tq], got " + dims_str(ld));
  if (qd[0] > INT32_MAX || kd[0] > INT32_MAX) return invalid(kFlashOp, "more than 2^31-1 rows");

  p->q = q.untyped_data();
  p->k = k.untyped_data();
  p->v = v.untyped_data();
  p->o = o->untyped_data();
  p->lse = lse->typed_data();
  p->q_starts = q_starts.typed_data();
  p->q_ends = q_ends.typed_data();
  p->k_starts = k_starts.typed_data();
  p->k_ends = k_ends.typed_data();
  p->q_row_stride = qd[1] * qd[2];
  p->k_row_stride = kd[1] * kd[2];
  p->v_row_stride = vd[1] * vd[2];
  p->o_row_stride = od[1] * od[2];
  p->batch = static_cast<int32_t>(batch);
  p->total_q = static_cast<int32_t>(qd[0]);
  p->total_k = static_cast<int32_t>(kd[0]);
  p->max_seqlen_q = max_seqlen_q < 0 ? p->total_q : max_seqlen_q;
  p->num_heads = static_cast<int32_t>(qd[1]);
  p->num_heads_k = static_cast<int32_t>(kd[1]);
  p->head_dim = static_cast<int32_t>(qd[2]);
  p->head_dim_v = static_cast<int32_t>(vd[2]);
  p->softmax_scale = softmax_scale;
  p->softcap = softcap;
  p->window_left = window_left;
  p->window_right = window_right;
  p->fill_uncovered = fill_uncovered != 0;
  p->dtype = dt;
  return ffi::Error::Success();
}

// The FFI signature shared by both platforms (the CUDA one binds the stream context first).
template <typename Binding>
auto flash_attention_binding(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()  // q
      .template Arg<ffi::AnyBuffer>()             // k
      .template Arg<ffi::AnyBuffer>()             // v
      .template Arg<ffi::Buffer<ffi::S32>>()      // q_starts
      .template Arg<ffi::Buffer<ffi::S32>>()      // q_ends
      .template Arg<ffi::Buffer<ffi::S32>>()      // k_starts
      .template Arg<ffi::Buffer<ffi::S32>>()      // k_ends
      .template Ret<ffi::AnyBuffer>()             // o
      .template Ret<ffi::Buffer<ffi::F32>>()      // lse
      .template Attr<float>("softmax_scale")
      .template Attr<float>("softcap")
      .template Attr<int32_t>("window_left")
      .template Attr<int32_t>("window_right")
      .template Attr<int32_t>("max_seqlen_q")
      .template Attr<int32_t>("fill_uncovered");
}

}  // namespace jax_flash::ffi_impl
