// Decoding of the sample / top_k_top_p_filter FFI calls into SamplingParams, shared by the CPU
// and CUDA handlers.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "ffi_error.h"
#include "jax_flash/sampling_params.h"
#include "xla/ffi/api/ffi.h"

namespace jax_flash::ffi_impl {

namespace ffi = xla::ffi;

// Buffers:
//   logits [B, V] float32 | float16 | bfloat16; temperature, top_p, min_p [B] float32;
//   top_k [B] int32; seeds [B, 3] uint32 (sample only)
//   -> tokens [B] int32 (sample) or masked [B, V] (dtype of logits; filter)
inline ffi::Error make_sampling_params(const char* op, ffi::AnyBuffer logits,
                                       ffi::Buffer<ffi::F32> temperature,
                                       ffi::Buffer<ffi::S32> top_k, ffi::Buffer<ffi::F32> top_p,
                                       ffi::Buffer<ffi::F32> min_p, SamplingParams* p) {
  const auto ld = logits.dimensions();
  if (ld.size() != 2) return invalid(op, "logits must be [B, V], got " + dims_str(ld));
  const int64_t B = ld[0], V = ld[1];
  if (V < 1 || V > sampling::kMaxVocab)
    return invalid(op, "the vocabulary size must be in [1, 2^24 - 1], got " + std::to_string(V));
  const std::pair<const char*, int64_t> vectors[] = {{"temperature", temperature.element_count()},
                                                     {"top_k", top_k.element_count()},
                                                     {"top_p", top_p.element_count()},
                                                     {"min_p", min_p.element_count()}};
  for (const auto& [name, n] : vectors)
    if (n != B)
      return invalid(op, std::string(name) + " must have B = " + std::to_string(B) +
                             " elements, got " + std::to_string(n));
  switch (logits.element_type()) {
    case ffi::F32: p->dtype = DType::kFloat32; break;
    case ffi::F16: p->dtype = DType::kFloat16; break;
    case ffi::BF16: p->dtype = DType::kBFloat16; break;
    default: return invalid(op, "logits must be float32, float16 or bfloat16");
  }
  p->logits = logits.untyped_data();
  p->temperature = temperature.typed_data();
  p->top_k = top_k.typed_data();
  p->top_p = top_p.typed_data();
  p->min_p = min_p.typed_data();
  p->seeds = nullptr;
  p->tokens = nullptr;
  p->masked = nullptr;
  p->batch = B;
  p->vocab = static_cast<int32_t>(V);
  return ffi::Error::Success();
}

inline ffi::Error set_sample_outputs(ffi::Buffer<ffi::U32> seeds,
                                     ffi::Result<ffi::Buffer<ffi::S32>> tokens,
                                     SamplingParams* p) {
  const auto sd = seeds.dimensions();
  if (sd.size() != 2 || sd[0] != p->batch || sd[1] != 3)
    return invalid("sample", "seeds must be [B, 3], got " + dims_str(sd));
  if (tokens->element_count() != p->batch)
    return invalid("sample", "tokens must be [B], got " + dims_str(tokens->dimensions()));
  p->seeds = seeds.typed_data();
  p->tokens = tokens->typed_data();
  return ffi::Error::Success();
}

inline ffi::Error set_filter_output(ffi::AnyBuffer logits, ffi::Result<ffi::AnyBuffer> masked,
                                    SamplingParams* p) {
  const auto ld = logits.dimensions(), md = masked->dimensions();
  if (md.size() != 2 || md[0] != ld[0] || md[1] != ld[1] ||
      masked->element_type() != logits.element_type())
    return invalid("top_k_top_p_filter",
                   "the output must have the logits' shape and dtype, got " + dims_str(md));
  p->masked = masked->untyped_data();
  return ffi::Error::Success();
}

// The FFI signatures shared by both platforms (the CUDA ones bind the stream context first).
template <typename Binding>
auto sampling_inputs_binding(Binding&& binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()  // logits
      .template Arg<ffi::Buffer<ffi::F32>>()                 // temperature
      .template Arg<ffi::Buffer<ffi::S32>>()                 // top_k
      .template Arg<ffi::Buffer<ffi::F32>>()                 // top_p
      .template Arg<ffi::Buffer<ffi::F32>>();                // min_p
}

template <typename Binding>
auto sample_binding(Binding binding) {
  return sampling_inputs_binding(std::move(binding))
      .template Arg<ffi::Buffer<ffi::U32>>()  // seeds
      .template Ret<ffi::Buffer<ffi::S32>>();  // tokens
}

template <typename Binding>
auto filter_binding(Binding binding) {
  return sampling_inputs_binding(std::move(binding)).template Ret<ffi::AnyBuffer>();  // masked
}

}  // namespace jax_flash::ffi_impl
