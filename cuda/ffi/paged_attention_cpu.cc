// XLA FFI handler: jax_flash_paged_attention_cpu.
#include "paged_attention.h"  // cuda/cpu: the CPU kernel
#include "paged_common.h"
#include "registry.h"

namespace jax_flash::paged_ffi {

static ffi::Error PagedAttentionCpu(
    ffi::AnyBuffer q, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages, ffi::Buffer<ffi::F32> k_scale,
    ffi::Buffer<ffi::F32> v_scale, ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> kv_lens,
    ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::Buffer<ffi::F32>> lse,
    ffi::Result<ffi::Buffer<ffi::F32>> o_partial, ffi::Result<ffi::Buffer<ffi::F32>> lse_partial,
    float softmax_scale, float softcap, int32_t window_left, int32_t window_right,
    int32_t num_splits, int32_t scale_mode, int32_t kernel, int32_t pdl, int32_t merge_pdl) {
  PagedAttentionParams p{};
  // The CPU kernel picks its own split of the key range (o_partial / lse_partial are unused) and
  // has one kernel: the launch attributes are checked, not used.
  ffi::Error err = make_paged_attention_params(
      q, k_pages, v_pages, k_scale, v_scale, block_tables, kv_lens, o, lse, o_partial, lse_partial,
      softmax_scale, softcap, window_left, window_right, num_splits, scale_mode, kernel, pdl,
      merge_pdl, /*check_partials=*/false, &p);
  if (err.failure()) return err;
  paged_attention_cpu(p);
  return ffi::Error::Success();
}

}  // namespace jax_flash::paged_ffi

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashPagedAttentionCpu, jax_flash::paged_ffi::PagedAttentionCpu,
                              jax_flash::paged_ffi::paged_attention_binding(xla::ffi::Ffi::Bind()));

JAX_FLASH_REGISTER_FFI("jax_flash_paged_attention_cpu", JaxFlashPagedAttentionCpu);
