// The FFI result of the CUDA handlers of every op: a failed CUDA call becomes one form of
// internal error ("jax_flash.<op>: CUDA error: <description>"). CUDA handlers only (the CPU
// build has no CUDA runtime); invalid arguments are ffi_error.h's.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "xla/ffi/api/ffi.h"

namespace jax_flash {

// Success, or the kInternal error of op `op` (its public name) for `status`.
inline xla::ffi::Error cuda_status(const char* op, cudaError_t status) {
  if (status == cudaSuccess) return xla::ffi::Error::Success();
  return xla::ffi::Error(xla::ffi::ErrorCode::kInternal, std::string("jax_flash.") + op +
                                                             ": CUDA error: " +
                                                             cudaGetErrorString(status));
}

}  // namespace jax_flash
