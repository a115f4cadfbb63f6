// Warp-wide collectives shared by the kernels of every op (every lane of the warp takes part).
// No XLA headers here.
#pragma once

#include <cuda_runtime.h>

namespace jax_flash {

// Inclusive prefix sum of v over the lanes of a warp: lane l gets v(0) + ... + v(l). I is an
// integer type (the tile schedulers count tiles in int or int64_t, sampling sums in 64 bits).
template <typename I>
__device__ __forceinline__ I warp_inclusive_sum(I v, int lane) {
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const I up = __shfl_up_sync(0xffffffffu, v, off);
    if (lane >= off) v += up;
  }
  return v;
}

}  // namespace jax_flash
