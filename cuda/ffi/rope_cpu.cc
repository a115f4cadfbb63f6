// XLA FFI handler: jax_flash_apply_rope_cpu.
#include "registry.h"
#include "rope.h"  // cuda/cpu: the CPU kernel
#include "rope_common.h"

namespace jax_flash::ffi_impl {

static ffi::Error ApplyRopeCpu(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> positions,
                               ffi::Result<ffi::AnyBuffer> out, int32_t style, int32_t rotary_dim,
                               ffi::Span<const float> inv_freq) {
  RopeParams p;
  ffi::Error err = make_rope_params(x, positions, *out, style, rotary_dim, inv_freq, &p);
  if (err.failure()) return err;
  apply_rope_cpu(p);
  return ffi::Error::Success();
}

}  // namespace jax_flash::ffi_impl

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashApplyRopeCpu, jax_flash::ffi_impl::ApplyRopeCpu,
                              jax_flash::ffi_impl::rope_binding(xla::ffi::Ffi::Bind()));

JAX_FLASH_REGISTER_FFI("jax_flash_apply_rope_cpu", JaxFlashApplyRopeCpu);
