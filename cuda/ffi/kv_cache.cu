// XLA FFI handlers: jax_flash_append_kv_cuda, jax_flash_append_kv_rope_cuda (append_kv with the
// fused RoPE), jax_flash_append_qkv_rope_cuda (the same from packed q/k/v rows),
// jax_flash_copy_pages_cuda. The cache arguments are aliased to the results
// (input_output_aliases): the kernels update the result buffers in place. Never synchronize the
// stream and never allocate, so XLA may capture them in a CUDA graph.
#include <cuda_runtime.h>

#include "cuda_status.h"
#include "jax_flash/kv_cache.cuh"
#include "jax_flash/kv_cache_rope.cuh"
#include "kv_cache_rope_common.h"
#include "paged_common.h"
#include "registry.h"

namespace jax_flash::paged_ffi {

// Result buffers that are not their argument buffers (never the case under XLA's aliasing)
// start as copies of the arguments.
static cudaError_t copy_unaliased(const AliasCopy* c, int n, cudaStream_t stream) {
  for (int i = 0; i < n; ++i) {
    const cudaError_t s =
        cudaMemcpyAsync(c[i].to, c[i].from, c[i].bytes, cudaMemcpyDeviceToDevice, stream);
    if (s != cudaSuccess) return s;
  }
  return cudaSuccess;
}

// Runs launch() on the result buffers after copy_unaliased; the status as an FFI error of `op`.
template <class Launch>
static ffi::Error in_place(const char* op, cudaStream_t stream, const ffi::AnyBuffer& k_pages,
                           const ffi::AnyBuffer& v_pages, const ffi::Buffer<ffi::F32>& k_scale,
                           const ffi::Buffer<ffi::F32>& v_scale, const ffi::AnyBuffer& k_out,
                           const ffi::AnyBuffer& v_out, const ffi::Buffer<ffi::F32>& ks_out,
                           const ffi::Buffer<ffi::F32>& vs_out, Launch launch) {
  AliasCopy c[4];
  cudaError_t status = copy_unaliased(
      c, unaliased(k_pages, v_pages, k_scale, v_scale, k_out, v_out, ks_out, vs_out, c), stream);
  if (status == cudaSuccess) status = launch();
  return cuda_status(op, status);
}

static ffi::Error AppendKVCuda(cudaStream_t stream, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                               ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                               ffi::AnyBuffer k_new, ffi::AnyBuffer v_new,
                               ffi::Buffer<ffi::S32> slot_mapping,
                               ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out,
                               ffi::Result<ffi::Buffer<ffi::F32>> ks_out,
                               ffi::Result<ffi::Buffer<ffi::F32>> vs_out, int32_t scale_mode) {
  AppendKVParams p;
  ffi::Error err = make_append_params(k_pages, v_pages, k_scale, v_scale, k_new, v_new,
                                      slot_mapping, *k_out, *v_out, *ks_out, *vs_out, scale_mode,
                                      &p);
  if (err.failure()) return err;
  return in_place("append_kv", stream, k_pages, v_pages, k_scale, v_scale, *k_out, *v_out,
                  *ks_out, *vs_out, [&] { return append_kv_cuda(p, stream); });
}

static ffi::Error AppendKVRopeCuda(
    cudaStream_t stream, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
    ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale, ffi::AnyBuffer k_new,
    ffi::AnyBuffer v_new, ffi::Buffer<ffi::S32> slot_mapping, ffi::Buffer<ffi::S32> positions,
    ffi::AnyBuffer q, ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out,
    ffi::Result<ffi::Buffer<ffi::F32>> ks_out, ffi::Result<ffi::Buffer<ffi::F32>> vs_out,
    ffi::Result<ffi::AnyBuffer> q_out, int32_t scale_mode, int32_t style, int32_t rotary_dim,
    ffi::Span<const float> inv_freq) {
  AppendKVRopeParams p;
  ffi::Error err = make_append_rope_params(
      k_pages, v_pages, k_scale, v_scale, k_new, v_new, slot_mapping, positions, q, *k_out, *v_out,
      *ks_out, *vs_out, *q_out, scale_mode, style, rotary_dim, inv_freq, &p);
  if (err.failure()) return err;
  return in_place("append_kv", stream, k_pages, v_pages, k_scale, v_scale, *k_out, *v_out,
                  *ks_out, *vs_out, [&] { return append_kv_rope_cuda(p, stream); });
}

static ffi::Error AppendQkvRopeCuda(
    cudaStream_t stream, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
    ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale, ffi::AnyBuffer qkv,
    ffi::Buffer<ffi::S32> slot_mapping, ffi::Buffer<ffi::S32> positions,
    ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out,
    ffi::Result<ffi::Buffer<ffi::F32>> ks_out, ffi::Result<ffi::Buffer<ffi::F32>> vs_out,
    ffi::Result<ffi::AnyBuffer> q_out, int32_t scale_mode, int32_t style, int32_t rotary_dim,
    ffi::Span<const float> inv_freq) {
  AppendKVRopeParams p;
  ffi::Error err = make_append_qkv_rope_params(
      k_pages, v_pages, k_scale, v_scale, qkv, slot_mapping, positions, *k_out, *v_out, *ks_out,
      *vs_out, *q_out, scale_mode, style, rotary_dim, inv_freq, &p);
  if (err.failure()) return err;
  return in_place("append_qkv", stream, k_pages, v_pages, k_scale, v_scale, *k_out, *v_out,
                  *ks_out, *vs_out, [&] { return append_kv_rope_cuda(p, stream); });
}

static ffi::Error CopyPagesCuda(cudaStream_t stream, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                                ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                                ffi::Buffer<ffi::S32> src, ffi::Buffer<ffi::S32> dst,
                                ffi::Result<ffi::AnyBuffer> k_out,
                                ffi::Result<ffi::AnyBuffer> v_out,
                                ffi::Result<ffi::Buffer<ffi::F32>> ks_out,
                                ffi::Result<ffi::Buffer<ffi::F32>> vs_out, int32_t scale_mode) {
  CopyPagesParams p;
  ffi::Error err = make_copy_params(k_pages, v_pages, k_scale, v_scale, src, dst, *k_out, *v_out,
                                    *ks_out, *vs_out, scale_mode, &p);
  if (err.failure()) return err;
  return in_place("copy_pages", stream, k_pages, v_pages, k_scale, v_scale, *k_out, *v_out,
                  *ks_out, *vs_out, [&] { return copy_pages_cuda(p, stream); });
}

}  // namespace jax_flash::paged_ffi

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlashAppendKVCuda, jax_flash::paged_ffi::AppendKVCuda,
    jax_flash::paged_ffi::append_kv_binding(
        xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlashAppendKVRopeCuda, jax_flash::paged_ffi::AppendKVRopeCuda,
    jax_flash::paged_ffi::append_kv_rope_binding(
        xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlashAppendQkvRopeCuda, jax_flash::paged_ffi::AppendQkvRopeCuda,
    jax_flash::paged_ffi::append_qkv_rope_binding(
        xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlashCopyPagesCuda, jax_flash::paged_ffi::CopyPagesCuda,
    jax_flash::paged_ffi::copy_pages_binding(
        xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});

JAX_FLASH_REGISTER_FFI("jax_flash_append_kv_cuda", JaxFlashAppendKVCuda);
JAX_FLASH_REGISTER_FFI("jax_flash_append_kv_rope_cuda", JaxFlashAppendKVRopeCuda);
JAX_FLASH_REGISTER_FFI("jax_flash_append_qkv_rope_cuda", JaxFlashAppendQkvRopeCuda);
JAX_FLASH_REGISTER_FFI("jax_flash_copy_pages_cuda", JaxFlashCopyPagesCuda);
