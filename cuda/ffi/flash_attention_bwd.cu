// XLA FFI handler: jax_flash_flash_attention_bwd_cuda. Picks the kernel for (dtype, head dim):
// the Hopper (wgmma) kernel on compute capability 9.0 where it applies, the tensor-core
// (mma.sync) kernel where it applies, the SIMT kernels otherwise (float32, other head dims).
// Its float32 workspace (Delta, the dQ accumulator, the deterministic mode's turn counters)
// comes from XLA's scratch allocator; the handler never synchronizes the stream.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cuda_status.h"
#include "flash_attention_bwd_common.h"
#include "registry.h"
#include "jax_flash/flash_attention_bwd_mma.cuh"
#include "jax_flash/flash_attention_bwd_simt.cuh"
#include "jax_flash/hopper/flash_bwd_launch.cuh"
#include "jax_flash/policy/flash.h"
#include "jax_flash/policy/limits.h"

namespace jax_flash::ffi_impl {
namespace {

template <typename T>
cudaError_t dispatch_bwd(const FlashBwdParams& p, bool hopper, bool strict, bool mma,
                         cudaStream_t stream) {
  if constexpr (!std::is_same_v<T, float>) {
    if (hopper) {
      // cudaErrorNotSupported: a TMA descriptor was rejected and nothing ran; the mma.sync
      // kernel (same workspace) or the SIMT kernel (its Delta at the workspace's start) takes
      // the call.
      cudaError_t status = cudaErrorNotSupported;
      switch (policy::flash_mma_tile_dim(p.fwd.head_dim, p.fwd.head_dim_v)) {
        case 64: status = run_flash_attention_bwd_hopper<T, 64>(p, stream); break;
        case 128: status = run_flash_attention_bwd_hopper<T, 128>(p, stream); break;
        case 256: status = run_flash_attention_bwd_hopper<T, 256>(p, stream); break;
        default: break;
      }
      if (status != cudaErrorNotSupported || strict) return status;
    }
    if (mma) {
      switch (policy::flash_bwd_mma_tile_dim(p.fwd.head_dim)) {
        case 64: return run_flash_attention_bwd_mma<T, 64>(p, stream);
        case 128: return run_flash_attention_bwd_mma<T, 128>(p, stream);
        case 256: return run_flash_attention_bwd_mma<T, 256>(p, stream);
        default: break;
      }
    }
  }
  const int d = p.fwd.head_dim > p.fwd.head_dim_v ? p.fwd.head_dim : p.fwd.head_dim_v;
  if (d <= 64) return run_flash_attention_bwd_simt<T, 64>(p, stream);
  if (d <= 128) return run_flash_attention_bwd_simt<T, 128>(p, stream);
  return run_flash_attention_bwd_simt<T, 256>(p, stream);
}

ffi::Error FlashAttentionBwdCuda(cudaStream_t stream, ffi::ScratchAllocator scratch,
                                 ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                 ffi::AnyBuffer o, ffi::Buffer<ffi::F32> lse, ffi::AnyBuffer dout,
                                 ffi::Buffer<ffi::F32> dlse, ffi::Buffer<ffi::S32> q_starts,
                                 ffi::Buffer<ffi::S32> q_ends, ffi::Buffer<ffi::S32> k_starts,
                                 ffi::Buffer<ffi::S32> k_ends, ffi::Result<ffi::AnyBuffer> dq,
                                 ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                                 float softmax_scale, float softcap, int32_t window_left,
                                 int32_t window_right, int32_t max_seqlen_q,
                                 int32_t fill_uncovered, int32_t deterministic,
                                 int32_t hopper_kernel) {
  FlashBwdParams p;
  ffi::Error err = make_bwd_params(q, k, v, o, lse, dout, dlse, q_starts, q_ends, k_starts,
                                   k_ends, dq, dk, dv, softmax_scale, softcap, window_left,
                                   window_right, max_seqlen_q, fill_uncovered, deterministic, &p);
  if (err.failure()) return err;
  constexpr int kMaxD = policy::kFlashMaxHeadDim;
  if (p.fwd.head_dim > kMaxD || p.fwd.head_dim_v > kMaxD)
    return invalid(kFlashBwdOp, "the CUDA kernel takes head dims up to " + std::to_string(kMaxD) +
                                    ", got " + std::to_string(p.fwd.head_dim) + "/" +
                                    std::to_string(p.fwd.head_dim_v));
  // The Hopper kernels take the mma.sync kernel's calls and the other head dims up to 256 (the
  // mma.sync kernel's workspace), unless the call's launch choice (hopper_kernel 0) keeps them
  // on the mma.sync / SIMT kernels.
  const bool hopper = hopper_kernel != 0 && flash_attention_bwd_hopper_supported(p);
  const bool strict = hopper_kernel == 2;  // a rejected TMA descriptor fails the call
  const bool mma = flash_attention_bwd_mma_supported(p);
  const int64_t bytes =
      flash_bwd_workspace_bytes(p.fwd, hopper || mma ? kBwdMmaBlockM : 0, p.deterministic);
  if (bytes > 0) {
    std::optional<void*> ws = scratch.Allocate(static_cast<size_t>(bytes), 16);
    if (!ws.has_value())
      return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                        "jax_flash.flash_attention (backward): could not allocate " +
                            std::to_string(bytes) + " bytes of workspace");
    p.workspace = *ws;
    p.workspace_bytes = bytes;
  }
  cudaError_t status = cudaSuccess;
  switch (p.fwd.dtype) {
    case DType::kFloat32: status = dispatch_bwd<float>(p, hopper, strict, mma, stream); break;
    case DType::kFloat16: status = dispatch_bwd<__half>(p, hopper, strict, mma, stream); break;
    case DType::kBFloat16:
      status = dispatch_bwd<__nv_bfloat16>(p, hopper, strict, mma, stream);
      break;
  }
  if (strict && hopper && status == cudaErrorNotSupported)
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "jax_flash.flash_attention (backward): the driver rejected the Hopper "
                      "backward's TMA descriptors (a strict launch does not fall back)");
  return cuda_status(kFlashBwdOp, status);
}

}  // namespace
}  // namespace jax_flash::ffi_impl

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlashAttentionBwdCuda, jax_flash::ffi_impl::FlashAttentionBwdCuda,
    jax_flash::ffi_impl::flash_attention_bwd_binding(
        xla::ffi::Ffi::Bind()
            .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
            .Ctx<xla::ffi::ScratchAllocator>()));

JAX_FLASH_REGISTER_FFI("jax_flash_flash_attention_bwd_cuda", JaxFlashAttentionBwdCuda);
