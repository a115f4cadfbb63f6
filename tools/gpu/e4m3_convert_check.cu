// Checks paged::e4m3x4_to_f16x2, the 8-bit-cache kernels' e4m3 -> float16 conversion, against
// the CUDA library's conversion on all 2^16 pairs of codes, bit for bit (both words of the
// result; NaN codes included). Build it for the architecture whose path to check; a
// PTX-only build runs the sm_80 path (the bit manipulation) on a newer card through the JIT:
//   nvcc -std=c++17 -Icuda/include -gencode arch=compute_80,code=compute_80 \
//        tools/gpu/e4m3_convert_check.cu -o /tmp/e4m3_check && /tmp/e4m3_check
// Prints the __CUDA_ARCH__ the kernel ran and the count of mismatches; exits 1 on any.
// tests/test_e4m3_convert.py builds and runs it both ways where a GPU and nvcc are.
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdio>

#include "jax_flash/paged/ptx.cuh"

__global__ void check(unsigned* mismatches, int* arch, unsigned* first) {
  const uint32_t pair = blockIdx.x * blockDim.x + threadIdx.x;  // 2^16 threads
  if (pair == 0) {
#ifdef __CUDA_ARCH__
    *arch = __CUDA_ARCH__;
#endif
  }
  // The pair in both halves of the word, so that lo and hi are both checked.
  const uint32_t w = pair | (pair << 16);
  uint32_t lo, hi;
  jax_flash::paged::e4m3x4_to_f16x2(w, lo, hi);
  const __half2_raw ref =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair), __NV_E4M3);
  const uint32_t want = (uint32_t(ref.y) << 16) | ref.x;
  const bool ok = lo == want && hi == want;  // bit for bit, NaN codes included
  if (!ok && atomicAdd(mismatches, 1u) < 4) {
    const unsigned i = atomicAdd(first + 16, 1u) & 3;
    first[4 * i] = pair;
    first[4 * i + 1] = lo;
    first[4 * i + 2] = want;
  }
}

int main() {
  unsigned *d_mis, *d_first;  // d_first: up to 4 mismatches (pair, got, library, -), a count
  int* d_arch;
  cudaMalloc(&d_mis, sizeof(unsigned));
  cudaMalloc(&d_arch, sizeof(int));
  cudaMalloc(&d_first, 17 * sizeof(unsigned));
  cudaMemset(d_first, 0, 17 * sizeof(unsigned));
  cudaMemset(d_mis, 0, sizeof(unsigned));
  cudaMemset(d_arch, 0, sizeof(int));
  check<<<256, 256>>>(d_mis, d_arch, d_first);
  unsigned mis = 0;
  int arch = 0;
  cudaMemcpy(&mis, d_mis, sizeof(unsigned), cudaMemcpyDeviceToHost);
  cudaMemcpy(&arch, d_arch, sizeof(int), cudaMemcpyDeviceToHost);
  unsigned first[17];
  cudaMemcpy(first, d_first, sizeof(first), cudaMemcpyDeviceToHost);
  for (int i = 0; i < 4 && i < int(mis); ++i)
    std::printf("  codes 0x%04x: got 0x%08x, library 0x%08x\n", first[4 * i],
                first[4 * i + 1], first[4 * i + 2]);
  const cudaError_t err = cudaGetLastError();
  std::printf("e4m3 -> float16, __CUDA_ARCH__ %d: %u of 65536 pairs differ (%s)\n", arch, mis,
              cudaGetErrorString(err));
  return err == cudaSuccess && mis == 0 ? 0 : 1;
}
