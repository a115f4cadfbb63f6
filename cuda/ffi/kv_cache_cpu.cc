// XLA FFI handlers: jax_flash_append_kv_cpu, jax_flash_append_kv_rope_cpu (append_kv with the
// fused RoPE), jax_flash_append_qkv_rope_cpu (the same from packed q/k/v rows),
// jax_flash_copy_pages_cpu. The cache arguments are aliased to the results
// (input_output_aliases): the kernels update the result buffers in place.
#include <cstring>

#include "kv_cache.h"  // cuda/cpu: the CPU kernels
#include "kv_cache_rope_common.h"
#include "paged_common.h"
#include "registry.h"

namespace jax_flash::paged_ffi {

static void copy_unaliased(const AliasCopy* c, int n) {
  for (int i = 0; i < n; ++i) std::memmove(c[i].to, c[i].from, c[i].bytes);
}

static ffi::Error AppendKVCpu(ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                              ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                              ffi::AnyBuffer k_new, ffi::AnyBuffer v_new,
                              ffi::Buffer<ffi::S32> slot_mapping, ffi::Result<ffi::AnyBuffer> k_out,
                              ffi::Result<ffi::AnyBuffer> v_out,
                              ffi::Result<ffi::Buffer<ffi::F32>> ks_out,
                              ffi::Result<ffi::Buffer<ffi::F32>> vs_out, int32_t scale_mode) {
  AppendKVParams p;
  ffi::Error err = make_append_params(k_pages, v_pages, k_scale, v_scale, k_new, v_new,
                                      slot_mapping, *k_out, *v_out, *ks_out, *vs_out, scale_mode,
                                      &p);
  if (err.failure()) return err;
  AliasCopy c[4];
  copy_unaliased(c, unaliased(k_pages, v_pages, k_scale, v_scale, *k_out, *v_out, *ks_out,
                              *vs_out, c));
  append_kv_cpu(p);
  return ffi::Error::Success();
}

static ffi::Error AppendKVRopeCpu(
    ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages, ffi::Buffer<ffi::F32> k_scale,
    ffi::Buffer<ffi::F32> v_scale, ffi::AnyBuffer k_new, ffi::AnyBuffer v_new,
    ffi::Buffer<ffi::S32> slot_mapping, ffi::Buffer<ffi::S32> positions, ffi::AnyBuffer q,
    ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out,
    ffi::Result<ffi::Buffer<ffi::F32>> ks_out, ffi::Result<ffi::Buffer<ffi::F32>> vs_out,
    ffi::Result<ffi::AnyBuffer> q_out, int32_t scale_mode, int32_t style, int32_t rotary_dim,
    ffi::Span<const float> inv_freq) {
  AppendKVRopeParams p;
  ffi::Error err = make_append_rope_params(
      k_pages, v_pages, k_scale, v_scale, k_new, v_new, slot_mapping, positions, q, *k_out, *v_out,
      *ks_out, *vs_out, *q_out, scale_mode, style, rotary_dim, inv_freq, &p);
  if (err.failure()) return err;
  AliasCopy c[4];
  copy_unaliased(c, unaliased(k_pages, v_pages, k_scale, v_scale, *k_out, *v_out, *ks_out,
                              *vs_out, c));
  append_kv_rope_cpu(p);
  return ffi::Error::Success();
}

static ffi::Error AppendQkvRopeCpu(
    ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages, ffi::Buffer<ffi::F32> k_scale,
    ffi::Buffer<ffi::F32> v_scale, ffi::AnyBuffer qkv, ffi::Buffer<ffi::S32> slot_mapping,
    ffi::Buffer<ffi::S32> positions, ffi::Result<ffi::AnyBuffer> k_out,
    ffi::Result<ffi::AnyBuffer> v_out, ffi::Result<ffi::Buffer<ffi::F32>> ks_out,
    ffi::Result<ffi::Buffer<ffi::F32>> vs_out, ffi::Result<ffi::AnyBuffer> q_out,
    int32_t scale_mode, int32_t style, int32_t rotary_dim, ffi::Span<const float> inv_freq) {
  AppendKVRopeParams p;
  ffi::Error err = make_append_qkv_rope_params(
      k_pages, v_pages, k_scale, v_scale, qkv, slot_mapping, positions, *k_out, *v_out, *ks_out,
      *vs_out, *q_out, scale_mode, style, rotary_dim, inv_freq, &p);
  if (err.failure()) return err;
  AliasCopy c[4];
  copy_unaliased(c, unaliased(k_pages, v_pages, k_scale, v_scale, *k_out, *v_out, *ks_out,
                              *vs_out, c));
  append_kv_rope_cpu(p);
  return ffi::Error::Success();
}

static ffi::Error CopyPagesCpu(ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                               ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                               ffi::Buffer<ffi::S32> src, ffi::Buffer<ffi::S32> dst,
                               ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out,
                               ffi::Result<ffi::Buffer<ffi::F32>> ks_out,
                               ffi::Result<ffi::Buffer<ffi::F32>> vs_out, int32_t scale_mode) {
  CopyPagesParams p;
  ffi::Error err = make_copy_params(k_pages, v_pages, k_scale, v_scale, src, dst, *k_out, *v_out,
                                    *ks_out, *vs_out, scale_mode, &p);
  if (err.failure()) return err;
  AliasCopy c[4];
  copy_unaliased(c, unaliased(k_pages, v_pages, k_scale, v_scale, *k_out, *v_out, *ks_out,
                              *vs_out, c));
  copy_pages_cpu(p);
  return ffi::Error::Success();
}

}  // namespace jax_flash::paged_ffi

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashAppendKVCpu, jax_flash::paged_ffi::AppendKVCpu,
                              jax_flash::paged_ffi::append_kv_binding(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashAppendKVRopeCpu, jax_flash::paged_ffi::AppendKVRopeCpu,
                              jax_flash::paged_ffi::append_kv_rope_binding(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashAppendQkvRopeCpu, jax_flash::paged_ffi::AppendQkvRopeCpu,
                              jax_flash::paged_ffi::append_qkv_rope_binding(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashCopyPagesCpu, jax_flash::paged_ffi::CopyPagesCpu,
                              jax_flash::paged_ffi::copy_pages_binding(xla::ffi::Ffi::Bind()));

JAX_FLASH_REGISTER_FFI("jax_flash_append_kv_cpu", JaxFlashAppendKVCpu);
JAX_FLASH_REGISTER_FFI("jax_flash_append_kv_rope_cpu", JaxFlashAppendKVRopeCpu);
JAX_FLASH_REGISTER_FFI("jax_flash_append_qkv_rope_cpu", JaxFlashAppendQkvRopeCpu);
JAX_FLASH_REGISTER_FFI("jax_flash_copy_pages_cpu", JaxFlashCopyPagesCpu);
