// Decoding of the flash_attention_bwd FFI call into FlashBwdParams, shared by the CPU and CUDA
// handlers. Target names: jax_flash_flash_attention_bwd_{cpu,cuda}.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "ffi_error.h"
#include "flash_attention_common.h"
#include "jax_flash/flash_bwd_params.h"
#include "xla/ffi/api/ffi.h"

namespace jax_flash::ffi_impl {

// The op's name in error messages.
constexpr const char* kFlashBwdOp = "flash_attention (backward)";

// Buffers (see flash_bwd_params.h):
//   q [Tq, Hq, D], k [Tk, Hkv, D], v [Tk, Hkv, Dv], o [Tq, Hq, Dv], do [Tq, Hq, Dv]   dtype
//   lse [Hq, Tq], dlse [Hq, Tq]                                                       float32
//   q_starts, q_ends, k_starts, k_ends [B]                                            int32
// Results: dq [Tq, Hq, D], dk [Tk, Hkv, D], dv [Tk, Hkv, Dv] (dtype of q).
// Attributes: the forward's, plus deterministic (int32) and hopper_kernel (int32, a launch
// choice the CUDA handler reads and the CPU one ignores: 1 runs the Hopper backward where it
// applies, 2 the same but fails where the driver rejects its TMA descriptors (1 then runs the
// mma.sync backward), 0 keeps the mma.sync backward on Hopper too).
inline ffi::Error make_bwd_params(
    ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer o,
    ffi::Buffer<ffi::F32> lse, ffi::AnyBuffer dout, ffi::Buffer<ffi::F32> dlse,
    ffi::Buffer<ffi::S32> q_starts, ffi::Buffer<ffi::S32> q_ends, ffi::Buffer<ffi::S32> k_starts,
    ffi::Buffer<ffi::S32> k_ends, ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
    ffi::Result<ffi::AnyBuffer> dv, float softmax_scale, float softcap, int32_t window_left,
    int32_t window_right, int32_t max_seqlen_q, int32_t fill_uncovered, int32_t deterministic,
    FlashBwdParams* p) {
  // The forward decoder checks q/k/v/o/lse; lse is an input here, which it reads only by shape.
  ffi::Error err = make_params(q, k, v, q_starts, q_ends, k_starts, k_ends, ffi::Result<ffi::AnyBuffer>(o),
                               ffi::Result<ffi::Buffer<ffi::F32>>(lse), softmax_scale, softcap, window_left,
                               window_right, max_seqlen_q, fill_uncovered, &p->fwd);
  if (err.failure()) return err;
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  const auto dod = dout.dimensions(), dld = dlse.dimensions();
  if (dout.element_type() != q.element_type() || dq->element_type() != q.element_type() ||
      dk->element_type() != q.element_type() || dv->element_type() != q.element_type())
    return invalid(kFlashBwdOp, "do, dq, dk and dv must have q's dtype");
  if (dod.size() != 3 || dod[0] != qd[0] || dod[1] != qd[1] || dod[2] != vd[2])
    return invalid(kFlashBwdOp, "do must be [Tq, Hq, Dv], got " + dims_str(dod));
  if (dld.size() != 2 || dld[0] != qd[1] || dld[1] != qd[0])
    return invalid(kFlashBwdOp, "dlse must be [Hq, Tq], got " + dims_str(dld));
  const auto dqd = dq->dimensions(), dkd = dk->dimensions(), dvd = dv->dimensions();
  if (dqd.size() != 3 || dqd[0] != qd[0] || dqd[1] != qd[1] || dqd[2] != qd[2])
    return invalid(kFlashBwdOp, "dq must be [Tq, Hq, D], got " + dims_str(dqd));
  if (dkd.size() != 3 || dkd[0] != kd[0] || dkd[1] != kd[1] || dkd[2] != kd[2])
    return invalid(kFlashBwdOp, "dk must be [Tk, Hkv, D], got " + dims_str(dkd));
  if (dvd.size() != 3 || dvd[0] != vd[0] || dvd[1] != vd[1] || dvd[2] != vd[2])
    return invalid(kFlashBwdOp, "dv must be [Tk, Hkv, Dv], got " + dims_str(dvd));
  p->dout = dout.untyped_data();
  p->dlse = dlse.typed_data();
  p->dq = dq->untyped_data();
  p->dk = dk->untyped_data();
  p->dv = dv->untyped_data();
  p->dout_row_stride = dod[1] * dod[2];
  p->dq_row_stride = dqd[1] * dqd[2];
  p->dk_row_stride = dkd[1] * dkd[2];
  p->dv_row_stride = dvd[1] * dvd[2];
  p->deterministic = deterministic != 0;
  p->workspace = nullptr;
  p->workspace_bytes = 0;
  return ffi::Error::Success();
}

// The FFI signature shared by both platforms (the CUDA one binds its contexts first).
template <typename Binding>
auto flash_attention_bwd_binding(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()  // q
      .template Arg<ffi::AnyBuffer>()             // k
      .template Arg<ffi::AnyBuffer>()             // v
      .template Arg<ffi::AnyBuffer>()             // o
      .template Arg<ffi::Buffer<ffi::F32>>()      // lse
      .template Arg<ffi::AnyBuffer>()             // do
      .template Arg<ffi::Buffer<ffi::F32>>()      // dlse
      .template Arg<ffi::Buffer<ffi::S32>>()      // q_starts
      .template Arg<ffi::Buffer<ffi::S32>>()      // q_ends
      .template Arg<ffi::Buffer<ffi::S32>>()      // k_starts
      .template Arg<ffi::Buffer<ffi::S32>>()      // k_ends
      .template Ret<ffi::AnyBuffer>()             // dq
      .template Ret<ffi::AnyBuffer>()             // dk
      .template Ret<ffi::AnyBuffer>()             // dv
      .template Attr<float>("softmax_scale")
      .template Attr<float>("softcap")
      .template Attr<int32_t>("window_left")
      .template Attr<int32_t>("window_right")
      .template Attr<int32_t>("max_seqlen_q")
      .template Attr<int32_t>("fill_uncovered")
      .template Attr<int32_t>("deterministic")
      .template Attr<int32_t>("hopper_kernel");
}

}  // namespace jax_flash::ffi_impl
