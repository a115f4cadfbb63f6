// XLA FFI handler: jax_flash_flash_attention_cpu.
#include "flash_attention.h"  // cuda/cpu: the CPU kernel
#include "flash_attention_common.h"
#include "registry.h"

namespace jax_flash::ffi_impl {

static ffi::Error FlashAttentionCpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                    ffi::Buffer<ffi::S32> q_starts, ffi::Buffer<ffi::S32> q_ends,
                                    ffi::Buffer<ffi::S32> k_starts, ffi::Buffer<ffi::S32> k_ends,
                                    ffi::Result<ffi::AnyBuffer> o,
                                    ffi::Result<ffi::Buffer<ffi::F32>> lse, float softmax_scale,
                                    float softcap, int32_t window_left, int32_t window_right,
                                    int32_t max_seqlen_q, int32_t fill_uncovered) {
  FlashParams p;
  ffi::Error err = make_params(q, k, v, q_starts, q_ends, k_starts, k_ends, o, lse, softmax_scale,
                               softcap, window_left, window_right, max_seqlen_q, fill_uncovered,
                               &p);
  if (err.failure()) return err;
  flash_attention_cpu(p);
  return ffi::Error::Success();
}

}  // namespace jax_flash::ffi_impl

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashAttentionCpu, jax_flash::ffi_impl::FlashAttentionCpu,
                              jax_flash::ffi_impl::flash_attention_binding(xla::ffi::Ffi::Bind()));

JAX_FLASH_REGISTER_FFI("jax_flash_flash_attention_cpu", JaxFlashAttentionCpu);
