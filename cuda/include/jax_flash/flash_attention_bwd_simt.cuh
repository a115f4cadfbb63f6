// CUDA-core attention backward: every dtype (float32 included) and every head dim up to
// kMaxHeadDim (q/k and v may differ). Two kernels, neither with atomics, so results are
// bit-identical run to run whether or not the deterministic mode is asked for:
//   dK/dV: one warp per (key row, kv head) walks the query rows of every query head of its group
//          that see the key, recomputing P and dS (dot products reduced over the warp);
//   dQ:    one warp per (query row, head) walks the keys the row sees.
// Each lane holds head-dim elements lane, lane + 32, ... in float32. Rows that no sequence owns
// get zeros. Meant for what the tensor-core kernel does not take, not for speed.
//
// No XLA headers: the FFI layer fills FlashBwdParams and calls run_flash_attention_bwd_simt.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "jax_flash/dtype.cuh"
#include "jax_flash/flash_attention_bwd_common.cuh"
#include "jax_flash/flash_bwd_params.h"

namespace jax_flash {
namespace simt_bwd {

constexpr int kWarpsPerBlock = 4;

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// Lane's elements (lane, lane + 32, ...) of a row of n <= 32 * kE elements, as floats (0 past n).
template <typename T, int kE>
__device__ __forceinline__ void load_row(const T* row, int n, int lane, float (&x)[kE]) {
#pragma unroll
  for (int i = 0; i < kE; ++i) {
    const int d = lane + 32 * i;
    x[i] = d < n ? to_float(row[d]) : 0.f;
  }
}

template <int kE>
__device__ __forceinline__ float dot(const float (&a)[kE], const float (&b)[kE]) {
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < kE; ++i) s = fmaf(a[i], b[i], s);
  return warp_sum(s);
}

// The first sequence that owns row `row` of q (kQ) or of k: true and its extent, else false.
template <bool kQ>
__device__ __forceinline__ bool owner(const FlashParams& f, int32_t row, SeqExtent* out) {
  for (int b = 0; b < f.batch; ++b) {
    const SeqExtent e = flash_seq_extent_at(f, b);
    const int32_t start = kQ ? e.q_start : e.k_start;
    const int32_t len = kQ ? e.q_len : e.k_len;
    if (row >= start && row < start + len) {
      *out = e;
      return true;
    }
  }
  return false;
}

// P and dZ (dS times the soft cap's derivative) of query row i and key j, given s_raw = q.k.
struct ProbGrad {
  float p, dz;
};
__device__ __forceinline__ ProbGrad prob_grad(const FlashParams& f, float s_raw, float lse,
                                              float dp, float delta) {
  float x = s_raw * f.softmax_scale, deriv = 1.f;
  if (f.softcap > 0.f) {
    const float th = tanhf(x / f.softcap);
    x = f.softcap * th;
    deriv = 1.f - th * th;
  }
  const float p = lse == -INFINITY ? 0.f : expf(x - lse);
  return {p, p * (dp - delta) * deriv};
}

template <typename T, int kMaxHeadDim>
__global__ void __launch_bounds__(32 * kWarpsPerBlock)
    flash_bwd_dkdv_simt_kernel(const __grid_constant__ FlashBwdParams p,
                               const float* __restrict__ delta) {
  constexpr int kE = kMaxHeadDim / 32;
  const FlashParams& f = p.fwd;
  const int lane = threadIdx.x & 31;
  const int32_t j_row = blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5);
  const int kv_head = blockIdx.y;
  if (j_row >= f.total_k) return;
  const int group = f.num_heads / f.num_heads_k;
  float dk[kE], dv[kE];
#pragma unroll
  for (int i = 0; i < kE; ++i) dk[i] = dv[i] = 0.f;

  SeqExtent e;
  if (owner<false>(f, j_row, &e)) {
    const int32_t j = j_row - e.k_start;
    const T* q = static_cast<const T*>(f.q);
    const T* dout = static_cast<const T*>(p.dout);
    float kr[kE], vr[kE];
    load_row<T, kE>(static_cast<const T*>(f.k) + int64_t{j_row} * f.k_row_stride +
                        int64_t{kv_head} * f.head_dim,
                    f.head_dim, lane, kr);
    load_row<T, kE>(static_cast<const T*>(f.v) + int64_t{j_row} * f.v_row_stride +
                        int64_t{kv_head} * f.head_dim_v,
                    f.head_dim_v, lane, vr);
    for (int hg = 0; hg < group; ++hg) {
      const int h = kv_head * group + hg;
      for (int32_t i = 0; i < e.q_len; ++i) {
        int32_t lo, hi;
        visible_keys(f, i, e.q_len, e.k_len, &lo, &hi);
        if (j < lo || j >= hi) continue;
        const int64_t qrow = int64_t{e.q_start} + i;
        float qr[kE], dor[kE];
        load_row<T, kE>(q + qrow * f.q_row_stride + int64_t{h} * f.head_dim, f.head_dim, lane, qr);
        load_row<T, kE>(dout + qrow * p.dout_row_stride + int64_t{h} * f.head_dim_v,
                        f.head_dim_v, lane, dor);
        const int64_t at = int64_t{h} * f.total_q + qrow;
        const ProbGrad pg = prob_grad(f, dot(qr, kr), f.lse[at], dot(dor, vr), delta[at]);
#pragma unroll
        for (int c = 0; c < kE; ++c) {
          dv[c] = fmaf(pg.p, dor[c], dv[c]);
          dk[c] = fmaf(pg.dz, qr[c], dk[c]);
        }
      }
    }
  }
  T* dk_row = static_cast<T*>(p.dk) + int64_t{j_row} * p.dk_row_stride +
              int64_t{kv_head} * f.head_dim;
  T* dv_row = static_cast<T*>(p.dv) + int64_t{j_row} * p.dv_row_stride +
              int64_t{kv_head} * f.head_dim_v;
#pragma unroll
  for (int c = 0; c < kE; ++c) {
    const int d = lane + 32 * c;
    if (d < f.head_dim) dk_row[d] = from_float<T>(dk[c] * f.softmax_scale);
    if (d < f.head_dim_v) dv_row[d] = from_float<T>(dv[c]);
  }
}

template <typename T, int kMaxHeadDim>
__global__ void __launch_bounds__(32 * kWarpsPerBlock)
    flash_bwd_dq_simt_kernel(const __grid_constant__ FlashBwdParams p,
                             const float* __restrict__ delta) {
  constexpr int kE = kMaxHeadDim / 32;
  const FlashParams& f = p.fwd;
  const int lane = threadIdx.x & 31;
  const int32_t i_row = blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5);
  const int h = blockIdx.y;
  if (i_row >= f.total_q) return;
  const int kv_head = h / (f.num_heads / f.num_heads_k);
  float dq[kE];
#pragma unroll
  for (int i = 0; i < kE; ++i) dq[i] = 0.f;

  SeqExtent e;
  if (owner<true>(f, i_row, &e) && i_row - e.q_start < e.q_len) {
    const int32_t i = i_row - e.q_start;
    const int64_t at = int64_t{h} * f.total_q + i_row;
    const float lse = f.lse[at];
    const float dl = delta[at];
    float qr[kE], dor[kE];
    load_row<T, kE>(static_cast<const T*>(f.q) + int64_t{i_row} * f.q_row_stride +
                        int64_t{h} * f.head_dim,
                    f.head_dim, lane, qr);
    load_row<T, kE>(static_cast<const T*>(p.dout) + int64_t{i_row} * p.dout_row_stride +
                        int64_t{h} * f.head_dim_v,
                    f.head_dim_v, lane, dor);
    int32_t lo, hi;
    visible_keys(f, i, e.q_len, e.k_len, &lo, &hi);
    for (int32_t j = lo; j < hi; ++j) {
      const int64_t krow = int64_t{e.k_start} + j;
      float kr[kE], vr[kE];
      load_row<T, kE>(static_cast<const T*>(f.k) + krow * f.k_row_stride +
                          int64_t{kv_head} * f.head_dim,
                      f.head_dim, lane, kr);
      load_row<T, kE>(static_cast<const T*>(f.v) + krow * f.v_row_stride +
                          int64_t{kv_head} * f.head_dim_v,
                      f.head_dim_v, lane, vr);
      const ProbGrad pg = prob_grad(f, dot(qr, kr), lse, dot(dor, vr), dl);
#pragma unroll
      for (int c = 0; c < kE; ++c) dq[c] = fmaf(pg.dz, kr[c], dq[c]);
    }
  }
  T* dq_row = static_cast<T*>(p.dq) + int64_t{i_row} * p.dq_row_stride + int64_t{h} * f.head_dim;
#pragma unroll
  for (int c = 0; c < kE; ++c) {
    const int d = lane + 32 * c;
    if (d < f.head_dim) dq_row[d] = from_float<T>(dq[c] * f.softmax_scale);
  }
}

}  // namespace simt_bwd

// Backward for any head dims <= kMaxHeadDim (a multiple of 32), p.workspace of
// flash_bwd_workspace_bytes(p.fwd, 0, p.deterministic) bytes. Writes dq, dk, dv (zeros on rows
// no sequence owns). Asynchronous on `stream`; never synchronizes or allocates.
template <typename T, int kMaxHeadDim>
cudaError_t run_flash_attention_bwd_simt(const FlashBwdParams& p, cudaStream_t stream) {
  const FlashParams& f = p.fwd;
  const FlashBwdWorkspace ws = flash_bwd_workspace(p, 0);
  cudaError_t err = flash_bwd_delta<T>(p, ws, stream);  // delta only (rows of total_q entries)
  if (err != cudaSuccess) return err;
  constexpr int W = simt_bwd::kWarpsPerBlock;
  if (f.total_k > 0 && f.num_heads_k > 0) {
    const dim3 grid((f.total_k + W - 1) / W, f.num_heads_k);
    simt_bwd::flash_bwd_dkdv_simt_kernel<T, kMaxHeadDim><<<grid, 32 * W, 0, stream>>>(p, ws.delta);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  if (f.total_q > 0 && f.num_heads > 0) {
    const dim3 grid((f.total_q + W - 1) / W, f.num_heads);
    simt_bwd::flash_bwd_dq_simt_kernel<T, kMaxHeadDim><<<grid, 32 * W, 0, stream>>>(p, ws.delta);
    err = cudaGetLastError();
  }
  return err;
}

#define JAX_FLASH_BWD_SIMT_EXTERN(T)                                                       \
  extern template cudaError_t run_flash_attention_bwd_simt<T, 64>(const FlashBwdParams&,   \
                                                                  cudaStream_t);           \
  extern template cudaError_t run_flash_attention_bwd_simt<T, 128>(const FlashBwdParams&,  \
                                                                   cudaStream_t);          \
  extern template cudaError_t run_flash_attention_bwd_simt<T, 256>(const FlashBwdParams&,  \
                                                                   cudaStream_t);
JAX_FLASH_BWD_SIMT_EXTERN(float)
JAX_FLASH_BWD_SIMT_EXTERN(__half)
JAX_FLASH_BWD_SIMT_EXTERN(__nv_bfloat16)
#undef JAX_FLASH_BWD_SIMT_EXTERN

}  // namespace jax_flash
