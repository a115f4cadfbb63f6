// XLA FFI handlers: jax_flash_sample_cpu and jax_flash_top_k_top_p_filter_cpu.
#include "registry.h"
#include "sampling.h"  // cuda/cpu: the CPU kernels
#include "sampling_common.h"

namespace jax_flash::ffi_impl {

static ffi::Error SampleCpu(ffi::AnyBuffer logits, ffi::Buffer<ffi::F32> temperature,
                            ffi::Buffer<ffi::S32> top_k, ffi::Buffer<ffi::F32> top_p,
                            ffi::Buffer<ffi::F32> min_p, ffi::Buffer<ffi::U32> seeds,
                            ffi::Result<ffi::Buffer<ffi::S32>> tokens) {
  SamplingParams p;
  ffi::Error err = make_sampling_params("sample", logits, temperature, top_k, top_p, min_p, &p);
  if (err.failure()) return err;
  err = set_sample_outputs(seeds, tokens, &p);
  if (err.failure()) return err;
  sample_cpu(p);
  return ffi::Error::Success();
}

static ffi::Error TopKTopPFilterCpu(ffi::AnyBuffer logits, ffi::Buffer<ffi::F32> temperature,
                                    ffi::Buffer<ffi::S32> top_k, ffi::Buffer<ffi::F32> top_p,
                                    ffi::Buffer<ffi::F32> min_p,
                                    ffi::Result<ffi::AnyBuffer> masked) {
  SamplingParams p;
  ffi::Error err =
      make_sampling_params("top_k_top_p_filter", logits, temperature, top_k, top_p, min_p, &p);
  if (err.failure()) return err;
  err = set_filter_output(logits, masked, &p);
  if (err.failure()) return err;
  top_k_top_p_filter_cpu(p);
  return ffi::Error::Success();
}

}  // namespace jax_flash::ffi_impl

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashSampleCpu, jax_flash::ffi_impl::SampleCpu,
                              jax_flash::ffi_impl::sample_binding(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashTopKTopPFilterCpu, jax_flash::ffi_impl::TopKTopPFilterCpu,
                              jax_flash::ffi_impl::filter_binding(xla::ffi::Ffi::Bind()));

JAX_FLASH_REGISTER_FFI("jax_flash_sample_cpu", JaxFlashSampleCpu);
JAX_FLASH_REGISTER_FFI("jax_flash_top_k_top_p_filter_cpu", JaxFlashTopKTopPFilterCpu);
