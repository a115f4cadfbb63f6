// Host launch helper of the paged decode kernels: programmatic dependent launch on sm_90+.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace jax_flash {
namespace paged {

// Launches kernel<<<grid, block, smem, stream>>>(args...), as a programmatic dependent launch
// (cudaLaunchAttributeProgrammaticStreamSerialization) when `pdl` and the device is sm_90+:
// the kernel must then run griddepcontrol.wait before reading anything an earlier kernel of
// the stream may write.
template <typename... KArgs, typename... Args>
cudaError_t paged_launch_pdl(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem,
                             cudaStream_t stream, bool pdl, Args... args) {
  int dev = 0, major = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  if (err != cudaSuccess) return err;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = (major >= 9 && pdl) ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, static_cast<KArgs>(args)...);
}

}  // namespace paged
}  // namespace jax_flash
