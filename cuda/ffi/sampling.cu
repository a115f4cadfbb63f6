// XLA FFI handlers: jax_flash_sample_cuda and jax_flash_top_k_top_p_filter_cuda. Never
// synchronize the stream and never allocate, so XLA may capture them in a CUDA graph.
#include <cuda_runtime.h>

#include "cuda_status.h"
#include "registry.h"
#include "sampling_common.h"
#include "jax_flash/sampling.cuh"

namespace jax_flash::ffi_impl {

static ffi::Error SampleCuda(cudaStream_t stream, ffi::AnyBuffer logits,
                             ffi::Buffer<ffi::F32> temperature, ffi::Buffer<ffi::S32> top_k,
                             ffi::Buffer<ffi::F32> top_p, ffi::Buffer<ffi::F32> min_p,
                             ffi::Buffer<ffi::U32> seeds,
                             ffi::Result<ffi::Buffer<ffi::S32>> tokens) {
  SamplingParams p;
  ffi::Error err = make_sampling_params("sample", logits, temperature, top_k, top_p, min_p, &p);
  if (err.failure()) return err;
  err = set_sample_outputs(seeds, tokens, &p);
  if (err.failure()) return err;
  return cuda_status("sample", run_sampling(p, /*filter=*/false, stream));
}

static ffi::Error TopKTopPFilterCuda(cudaStream_t stream, ffi::AnyBuffer logits,
                                     ffi::Buffer<ffi::F32> temperature,
                                     ffi::Buffer<ffi::S32> top_k, ffi::Buffer<ffi::F32> top_p,
                                     ffi::Buffer<ffi::F32> min_p,
                                     ffi::Result<ffi::AnyBuffer> masked) {
  SamplingParams p;
  ffi::Error err =
      make_sampling_params("top_k_top_p_filter", logits, temperature, top_k, top_p, min_p, &p);
  if (err.failure()) return err;
  err = set_filter_output(logits, masked, &p);
  if (err.failure()) return err;
  return cuda_status("top_k_top_p_filter", run_sampling(p, /*filter=*/true, stream));
}

}  // namespace jax_flash::ffi_impl

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlashSampleCuda, jax_flash::ffi_impl::SampleCuda,
    jax_flash::ffi_impl::sample_binding(
        xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlashTopKTopPFilterCuda, jax_flash::ffi_impl::TopKTopPFilterCuda,
    jax_flash::ffi_impl::filter_binding(
        xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});

JAX_FLASH_REGISTER_FFI("jax_flash_sample_cuda", JaxFlashSampleCuda);
JAX_FLASH_REGISTER_FFI("jax_flash_top_k_top_p_filter_cuda", JaxFlashTopKTopPFilterCuda);
