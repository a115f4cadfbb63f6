// Split-KV merge of the paged decode kernels (both write the same o_partial / lse_partial) and
// its launcher.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "jax_flash/dtype.cuh"  // store4_from_float
#include "jax_flash/paged/launch.cuh"
#include "jax_flash/paged/ptx.cuh"
#include "jax_flash/paged_params.h"
#include "jax_flash/policy/limits.h"

namespace jax_flash {
namespace paged {

// ---------------------------------------------------------------------------------------------
// Split-KV merge: one CTA of 128 threads per output row (b, i, h). D bounds the row's Dv
// columns (p.head_dim_v <= D: the tensor-core kernel's tile width). Thread t owns float4 column
// t % (D / 4) (if < Dv / 4) of the splits s = t / (D / 4) (mod kGroups); its first loads are issued before the
// weights are known, so a row costs about two memory round trips. Warp 0 computes the LSE and
// the weights exp(lse_s - lse) (dynamic shared memory, one float per split); the groups' sums
// are added in a fixed order (deterministic).
// ---------------------------------------------------------------------------------------------

constexpr int kMaxMergeSplits = policy::kPagedMaxMergeSplits;  // shared memory: 4 bytes per split

template <typename TQ, int D>
__global__ void __launch_bounds__(128) paged_merge_kernel(const PagedAttentionParams p) {
  constexpr int kQ = D / 4;            // float4 columns per row
  constexpr int kGroups = 128 / kQ;    // split groups: 8, 4 or 2
  // loads in flight per thread: 64 splits in one round for D 64 and 128 (D 256: 32)
  constexpr int kBatch = kGroups >= 8 ? 8 : 16;
  extern __shared__ float w_s[];       // [num_splits] lse_s, then weights
  __shared__ float4 red_s[kGroups][kQ];
  __shared__ float lse_s;
  __shared__ int mode_s;               // 0 normal, 1 all -inf (empty), 2 NaN

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Launched as a programmatic dependent of the attention grid: wait until it has completed
  // and its writes are visible (a no-op for an ordinary launch).
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int c = tid % kQ;
  const int g = tid / kQ;
  const int64_t row = blockIdx.x;  // (b * Sq + i) * Hq + h
  const int Hq = p.num_heads, Sq = p.seqlen_q;
  const int64_t rows = static_cast<int64_t>(p.batch) * Sq * Hq;
  const int h = static_cast<int>(row % Hq);
  const int i = static_cast<int>((row / Hq) % Sq);
  const int64_t b = row / (static_cast<int64_t>(Hq) * Sq);
  const int64_t l_idx = (b * Hq + h) * Sq + i;
  const int ns = p.num_splits;
  const int dv = p.head_dim_v;
  const bool col_on = c < dv / 4;  // a column of the row (D > Dv: the rest idle)
  const float4* src = reinterpret_cast<const float4*>(p.o_partial + row * dv) + c;
  const int64_t o_stride4 = rows * (dv / 4);  // float4 per split

  // first batch of partial outputs (independent of the weights)
  float4 pre[kBatch];
#pragma unroll
  for (int k = 0; k < kBatch; ++k) {
    const int s = g + k * kGroups;
    pre[k] = s < ns && col_on ? src[s * o_stride4] : make_float4(0.f, 0.f, 0.f, 0.f);
  }

  if (tid < 32) {
    float mx = neg_inf();
    bool nan = false;
    for (int s = lane; s < ns; s += 32) {
      const float v = p.lse_partial[s * rows + l_idx];
      w_s[s] = v;
      nan |= v != v;
      mx = fmaxf(mx, v);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, off));
    nan = __any_sync(kFull, nan);
    const int mode = nan ? 2 : (mx == neg_inf() ? 1 : 0);
    float lse = nan ? qnan() : neg_inf();
    if (mode == 0) {
      float sum = 0.f;
      for (int s = lane; s < ns; s += 32) sum += expf(w_s[s] - mx);
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(kFull, sum, off);
      lse = mx + logf(sum);
      // an empty split (-inf) gets weight 0; its partial output is 0
      for (int s = lane; s < ns; s += 32) w_s[s] = expf(w_s[s] - lse);
    }
    if (lane == 0) {
      lse_s = lse;
      mode_s = mode;
    }
  }
  __syncthreads();
  const int mode = mode_s;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  if (mode == 0) {
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int s = g + k * kGroups;
      if (s < ns) {
        const float w = w_s[s];
        acc.x = fmaf(w, pre[k].x, acc.x);
        acc.y = fmaf(w, pre[k].y, acc.y);
        acc.z = fmaf(w, pre[k].z, acc.z);
        acc.w = fmaf(w, pre[k].w, acc.w);
      }
    }
    for (int s0 = g + kBatch * kGroups; s0 < ns; s0 += kBatch * kGroups) {
      float4 v[kBatch];
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const int s = s0 + k * kGroups;
        v[k] = s < ns && col_on ? src[s * o_stride4] : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const int s = s0 + k * kGroups;
        const float w = s < ns ? w_s[s] : 0.f;
        acc.x = fmaf(w, v[k].x, acc.x);
        acc.y = fmaf(w, v[k].y, acc.y);
        acc.z = fmaf(w, v[k].z, acc.z);
        acc.w = fmaf(w, v[k].w, acc.w);
      }
    }
  }
  red_s[g][c] = acc;
  __syncthreads();
  if (g == 0 && col_on) {
    float4 o = red_s[0][c];
#pragma unroll
    for (int k = 1; k < kGroups; ++k) {
      const float4 t = red_s[k][c];
      o.x += t.x;
      o.y += t.y;
      o.z += t.z;
      o.w += t.w;
    }
    if (mode == 2) o = make_float4(qnan(), qnan(), qnan(), qnan());
    store4_from_float<TQ>(static_cast<TQ*>(p.o) + row * dv + 4 * c, o.x, o.y, o.z, o.w);
    if (c == 0) p.lse[l_idx] = lse_s;
  }
}

// The split-KV merge after an attention grid (nothing for num_splits <= 1, or when p.launch
// turns it off).
template <typename TQ, int D>
cudaError_t launch_paged_merge(const PagedAttentionParams& p, cudaStream_t stream) {
  if (p.num_splits <= 1 || !p.launch.merge) return cudaSuccess;
  const int64_t out_rows = static_cast<int64_t>(p.batch) * p.seqlen_q * p.num_heads;
  if (out_rows > 0x7fffffff || p.num_splits > kMaxMergeSplits)
    return cudaErrorInvalidConfiguration;
  // On sm_90+ the merge is a programmatic dependent launch (p.launch.merge_pdl): its launch
  // overlaps the attention grid, and griddepcontrol.wait orders its reads after that grid's
  // writes.
  return paged_launch_pdl(paged_merge_kernel<TQ, D>, dim3(static_cast<unsigned>(out_rows)),
                          dim3(128), static_cast<size_t>(p.num_splits) * sizeof(float), stream,
                          p.launch.merge_pdl, p);
}

}  // namespace paged
}  // namespace jax_flash
