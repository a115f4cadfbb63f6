// Launch helpers shared by the CUDA kernels of every op. No XLA headers here.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <type_traits>

namespace jax_flash {

// Raises Kernel's dynamic shared-memory limit to `bytes` and asks for the max-shared carveout on
// the current device, once per device (again only for a larger size): cudaFuncSetAttribute costs
// host time on every call, which a jitted decode loop would pay per layer and step.
template <auto Kernel>
inline cudaError_t ensure_smem_attrs(size_t bytes) {
  constexpr int kMaxDevices = 64;
  static std::atomic<size_t> configured[kMaxDevices];  // bytes set so far (0: none)
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  const bool tracked = dev >= 0 && dev < kMaxDevices;
  if (tracked && configured[dev].load(std::memory_order_acquire) >= bytes) return cudaSuccess;
  err = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(bytes));
  if (err != cudaSuccess) return err;
  err = cudaFuncSetAttribute(Kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                             cudaSharedmemCarveoutMaxShared);
  if (err != cudaSuccess) return err;
  if (tracked) {
    size_t cur = configured[dev].load(std::memory_order_acquire);
    while (cur < bytes && !configured[dev].compare_exchange_weak(cur, bytes)) {
    }
  }
  return cudaSuccess;
}

// Launches Kernel with `smem_bytes` of dynamic shared memory, its limit raised first
// (ensure_smem_attrs), and returns the launch's status.
template <auto Kernel, typename... Args>
inline cudaError_t launch_with_smem(dim3 grid, dim3 block, size_t smem_bytes, cudaStream_t stream,
                                    const Args&... args) {
  cudaError_t err = ensure_smem_attrs<Kernel>(smem_bytes);
  if (err != cudaSuccess) return err;
  Kernel<<<grid, block, smem_bytes, stream>>>(args...);
  return cudaGetLastError();
}

// f(std::true_type{}) or f(std::false_type{}): turns a run-time flag into a template argument
// (decltype(flag)::value inside f), so that each kernel variant is written once at its call.
template <typename F>
inline decltype(auto) dispatch_bool(bool flag, F&& f) {
  if (flag) return f(std::true_type{});
  return f(std::false_type{});
}

}  // namespace jax_flash
