// XLA FFI handler: jax_flash_apply_rope_cuda. Never synchronizes the stream and never allocates,
// so XLA may capture it in a CUDA graph.
#include <cuda_runtime.h>

#include "cuda_status.h"
#include "registry.h"
#include "rope_common.h"
#include "jax_flash/rope.cuh"

namespace jax_flash::ffi_impl {

static ffi::Error ApplyRopeCuda(cudaStream_t stream, ffi::AnyBuffer x,
                                ffi::Buffer<ffi::S32> positions, ffi::Result<ffi::AnyBuffer> out,
                                int32_t style, int32_t rotary_dim,
                                ffi::Span<const float> inv_freq) {
  RopeParams p;
  ffi::Error err = make_rope_params(x, positions, *out, style, rotary_dim, inv_freq, &p);
  if (err.failure()) return err;
  const cudaError_t status = run_rope(p, stream);
  return cuda_status("apply_rope", status);
}

}  // namespace jax_flash::ffi_impl

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlashApplyRopeCuda, jax_flash::ffi_impl::ApplyRopeCuda,
    jax_flash::ffi_impl::rope_binding(
        xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});

JAX_FLASH_REGISTER_FFI("jax_flash_apply_rope_cuda", JaxFlashApplyRopeCuda);
