// XLA FFI handler: jax_flash_flash_attention_cuda. Picks the kernel for (dtype, head dim):
// the Hopper wgmma kernel on sm_90, else the mma.sync tensor-core kernel where it applies, the
// SIMT kernel otherwise (float32, odd head dims).
// Never synchronizes the stream and never allocates, so XLA may capture it in a CUDA graph; the
// Hopper kernel's work-item counter is a result buffer of the call (int32[2] of scratch, which the
// lowering adds and drops).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cuda_status.h"
#include "flash_attention_common.h"
#include "registry.h"
#include "jax_flash/flash_attention_common.cuh"
#include "jax_flash/flash_attention_mma.cuh"
#include "jax_flash/hopper/flash_fwd_launch.cuh"
#include "jax_flash/policy/limits.h"

namespace jax_flash {

// Defined by the explicit instantiations that cuda/src/instantiations.cmake generates.
template <typename T, int kMaxHeadDim>
cudaError_t run_flash_attention_simt(const FlashParams& p, cudaStream_t stream);

namespace {

template <typename T>
cudaError_t dispatch_head_dim(const FlashParams& p, cudaStream_t stream) {
  if constexpr (!std::is_same_v<T, float>) {
    // Hopper (sm_90a build, compute capability 9.0): the wgmma + TMA kernel; it declines (not
    // supported) when the driver rejects a TMA descriptor, and the mma.sync kernel runs instead.
    if (flash_attention_hopper_supported(p)) {
      cudaError_t status = cudaErrorNotSupported;
      switch (policy::flash_hopper_tile_dim(p.head_dim, p.head_dim_v)) {
        case 64: status = run_flash_attention_hopper<T, 64>(p, stream); break;
        case 80: status = run_flash_attention_hopper<T, 80>(p, stream); break;
        case 96: status = run_flash_attention_hopper<T, 96>(p, stream); break;
        case 112: status = run_flash_attention_hopper<T, 112>(p, stream); break;
        case 128: status = run_flash_attention_hopper<T, 128>(p, stream); break;
        case 192: status = run_flash_attention_hopper<T, 192>(p, stream); break;
        case 256: status = run_flash_attention_hopper<T, 256>(p, stream); break;
        default: break;
      }
      if (status != cudaErrorNotSupported) return status;
    }
    if (flash_attention_mma_supported(p)) {
      switch (policy::flash_mma_tile_dim(p.head_dim, p.head_dim_v)) {
        case 64: return run_flash_attention_mma<T, 64>(p, stream);
        case 128: return run_flash_attention_mma<T, 128>(p, stream);
        case 256: return run_flash_attention_mma<T, 256>(p, stream);
        default: break;
      }
    }
  }
  const int d = p.head_dim > p.head_dim_v ? p.head_dim : p.head_dim_v;
  if (d <= 64) return run_flash_attention_simt<T, 64>(p, stream);
  if (d <= 128) return run_flash_attention_simt<T, 128>(p, stream);
  return run_flash_attention_simt<T, 256>(p, stream);
}

}  // namespace

// Largest head dim (of q/k and of v) the CUDA kernels take.
constexpr int kMaxCudaHeadDim = policy::kFlashMaxHeadDim;

}  // namespace jax_flash

namespace jax_flash::ffi_impl {

static ffi::Error FlashAttentionCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                                     ffi::AnyBuffer v, ffi::Buffer<ffi::S32> q_starts,
                                     ffi::Buffer<ffi::S32> q_ends, ffi::Buffer<ffi::S32> k_starts,
                                     ffi::Buffer<ffi::S32> k_ends, ffi::Result<ffi::AnyBuffer> o,
                                     ffi::Result<ffi::Buffer<ffi::F32>> lse, float softmax_scale,
                                     float softcap, int32_t window_left, int32_t window_right,
                                     int32_t max_seqlen_q, int32_t fill_uncovered,
                                     ffi::Result<ffi::Buffer<ffi::S32>> item_counter) {
  FlashParams p;
  ffi::Error err = make_params(q, k, v, q_starts, q_ends, k_starts, k_ends, o, lse, softmax_scale,
                               softcap, window_left, window_right, max_seqlen_q, fill_uncovered,
                               &p);
  if (err.failure()) return err;
  // Scratch of the Hopper kernel's work-item counter (8 bytes; policy::flash_hopper_dynamic_items).
  if (item_counter->element_count() >= 2)
    p.item_counter = reinterpret_cast<unsigned long long*>(item_counter->typed_data());
  if (p.head_dim > kMaxCudaHeadDim || p.head_dim_v > kMaxCudaHeadDim)
    return invalid(kFlashOp, "the CUDA kernel takes head dims up to " +
                                 std::to_string(kMaxCudaHeadDim) + ", got " +
                                 std::to_string(p.head_dim) + "/" + std::to_string(p.head_dim_v));
  cudaError_t status = cudaSuccess;
  if (p.fill_uncovered) status = flash_attention_fill_uncovered(p, stream);
  if (status == cudaSuccess && p.batch > 0 && p.total_q > 0) {
    switch (p.dtype) {
      case DType::kFloat32: status = dispatch_head_dim<float>(p, stream); break;
      case DType::kFloat16: status = dispatch_head_dim<__half>(p, stream); break;
      case DType::kBFloat16: status = dispatch_head_dim<__nv_bfloat16>(p, stream); break;
    }
  }
  return cuda_status(kFlashOp, status);
}

}  // namespace jax_flash::ffi_impl

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlashAttentionCuda, jax_flash::ffi_impl::FlashAttentionCuda,
    jax_flash::ffi_impl::flash_attention_binding(
        xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>())
        .Ret<xla::ffi::Buffer<xla::ffi::S32>>(),  // item_counter: int32[2] of scratch
    {xla::ffi::Traits::kCmdBufferCompatible});

JAX_FLASH_REGISTER_FFI("jax_flash_flash_attention_cuda", JaxFlashAttentionCuda);
