// XLA FFI handler: jax_flash_paged_attention_cuda. Paged decode attention (and, for
// num_splits > 1, the split-KV merge) on the CUDA kernels of jax_flash/paged_attention.cuh;
// multi-token queries on Hopper on the prefill kernel (hopper/paged_prefill_launch.cuh).
// Never synchronizes the stream and never allocates (the split-KV scratch comes in as the
// o_partial / lse_partial results), so XLA may capture it in a CUDA graph.
#include <cuda_runtime.h>

#include <string>

#include "cuda_status.h"
#include "paged_common.h"
#include "registry.h"
#include "jax_flash/hopper/paged_prefill_launch.cuh"
#include "jax_flash/paged_attention.cuh"

namespace jax_flash::paged_ffi {

static ffi::Error PagedAttentionCuda(
    cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
    ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
    ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> kv_lens,
    ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::Buffer<ffi::F32>> lse,
    ffi::Result<ffi::Buffer<ffi::F32>> o_partial, ffi::Result<ffi::Buffer<ffi::F32>> lse_partial,
    float softmax_scale, float softcap, int32_t window_left, int32_t window_right,
    int32_t num_splits, int32_t scale_mode, int32_t kernel, int32_t pdl, int32_t merge_pdl) {
  constexpr const char* op = "paged_attention";
  PagedAttentionParams p{};
  ffi::Error err = make_paged_attention_params(
      q, k_pages, v_pages, k_scale, v_scale, block_tables, kv_lens, o, lse, o_partial,
      lse_partial, softmax_scale, softcap, window_left, window_right, num_splits, scale_mode,
      kernel, pdl, merge_pdl, /*check_partials=*/true, &p);
  if (err.failure()) return err;
  const policy::PagedChoice choice = paged::paged_kernel_choice(p);
  if (choice == policy::PagedChoice::kNone && p.launch.kernel != PagedKernel::kTensorCore)
    return invalid(op, "no CUDA kernel takes q " + dims_str(q.dimensions()) + " (" +
                           dtype_name(q.element_type()) + ") with v_pages " +
                           dims_str(v_pages.dimensions()) + " (" +
                           dtype_name(v_pages.element_type()) + "; D = " +
                           std::to_string(p.head_dim) + ", Dv = " + std::to_string(p.head_dim_v) +
                           "): the tensor-core kernel takes float16 / bfloat16 q with D, Dv "
                           "multiples of 16 up to 256, the CUDA-core kernel D == Dv in 64, 128, "
                           "256");
  if (p.num_splits > paged::kMaxMergeSplits)
    return invalid(op, "the CUDA kernel takes num_splits <= " +
                           std::to_string(paged::kMaxMergeSplits) + ", got " +
                           std::to_string(p.num_splits));
  const int64_t rows = static_cast<int64_t>(p.num_heads / p.num_heads_k) * p.seqlen_q;
  const int64_t mt = policy::paged_rows_per_cta(rows, dtype_size(p.dtype));
  const int64_t chunks = (rows + mt - 1) / mt;
  if (static_cast<int64_t>(p.batch) * p.num_heads_k * p.num_splits * chunks > INT32_MAX)
    return invalid(op, "too many CTAs: B * Hkv * num_splits * ceil(Hq / Hkv * Sq / 16) must be "
                       "< 2^31, got q " + dims_str(q.dimensions()) + ", num_splits " +
                           std::to_string(p.num_splits));
  if (choice == policy::PagedChoice::kNone)
    return invalid(op, "the tensor-core kernel was asked for, but it takes only float16 / "
                       "bfloat16 q with a cache of q's dtype or a scaled int8 / float8_e4m3fn "
                       "cache, D and Dv multiples of 16 up to 256, 1 to 2^32 - 1 cache rows of "
                       "Hkv heads and q 16-byte aligned");
  if (!paged_attention_cuda_supported(p))
    return invalid(op, "unsupported combination of dtypes, head dims and scale mode");
  // Multi-token queries on Hopper: the prefill kernel over the pages (o and lse directly; it
  // declines, launching nothing, where its key boxes do not fit the page size).
  if (p.batch > 0 && paged_attention_hopper_supported(p)) {
    const cudaError_t status = paged_attention_hopper(p, stream);
    if (status != cudaErrorNotSupported) return cuda_status(op, status);
  }
  const cudaError_t status = paged_attention_cuda(p, stream);
  return cuda_status(op, status);
}

}  // namespace jax_flash::paged_ffi

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxPagedAttentionCuda, jax_flash::paged_ffi::PagedAttentionCuda,
    jax_flash::paged_ffi::paged_attention_binding(
        xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});

JAX_FLASH_REGISTER_FFI("jax_flash_paged_attention_cuda", JaxPagedAttentionCuda);
