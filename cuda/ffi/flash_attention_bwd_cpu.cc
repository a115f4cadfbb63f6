// XLA FFI handler: jax_flash_flash_attention_bwd_cpu.
#include <string>

#include "flash_attention_bwd.h"  // cuda/cpu: the CPU kernel
#include "flash_attention_bwd_common.h"
#include "registry.h"

namespace jax_flash::ffi_impl {

static ffi::Error FlashAttentionBwdCpu(
    ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer o,
    ffi::Buffer<ffi::F32> lse, ffi::AnyBuffer dout, ffi::Buffer<ffi::F32> dlse,
    ffi::Buffer<ffi::S32> q_starts, ffi::Buffer<ffi::S32> q_ends, ffi::Buffer<ffi::S32> k_starts,
    ffi::Buffer<ffi::S32> k_ends, ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
    ffi::Result<ffi::AnyBuffer> dv, float softmax_scale, float softcap, int32_t window_left,
    int32_t window_right, int32_t max_seqlen_q, int32_t fill_uncovered, int32_t deterministic,
    int32_t /*hopper_kernel: a CUDA launch choice*/) {
  FlashBwdParams p;
  ffi::Error err = make_bwd_params(q, k, v, o, lse, dout, dlse, q_starts, q_ends, k_starts, k_ends,
                                   dq, dk, dv, softmax_scale, softcap, window_left, window_right,
                                   max_seqlen_q, fill_uncovered, deterministic, &p);
  if (err.failure()) return err;
  if (const char* why = flash_attention_bwd_cpu(p))
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      std::string("jax_flash.") + kFlashBwdOp + ": " + why);
  return ffi::Error::Success();
}

}  // namespace jax_flash::ffi_impl

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlashAttentionBwdCpu, jax_flash::ffi_impl::FlashAttentionBwdCpu,
    jax_flash::ffi_impl::flash_attention_bwd_binding(xla::ffi::Ffi::Bind()));

JAX_FLASH_REGISTER_FFI("jax_flash_flash_attention_bwd_cpu", JaxFlashAttentionBwdCpu);
