// Decisions of the paged decode attention on CUDA, in one place: which kernel takes a call
// (CUDA-core or tensor-core), how many query rows a CTA of each holds, how many CTAs fit an SM,
// and the split-KV count. The launchers (paged_attention.cuh) and the `_cpu` module's `policy`
// submodule (jax_flash/ops/paged_attention.py picks num_splits through it) call these functions.
//
// Host-only and free of CUDA includes: built into the CPU module (always) and the CUDA module.
#pragma once

#include <cstdint>

#include "jax_flash/paged_params.h"
#include "jax_flash/policy/limits.h"

namespace jax_flash::policy {

// Query rows per CTA of the CUDA-core kernel for a group of `rows` = G * Sq rows and q of
// `q_bytes`-byte elements (more rows take several CTAs): float32 q 4, 8 or 16; 16-bit q always 16.
// 16-bit q runs the CUDA-core kernel only when asked for (PagedLaunch kernel "cuda_core",
// JAX_FLASH_PAGED_MMA=0) or where the tensor-core kernel cannot take the call (q not 16-byte
// aligned, 2^32 cache rows of Hkv heads), so one row count is compiled for it: the 4- and 8-row
// variants were 2/3 of its kernels, ~220 s of the CPU time of a build for sm_80 + sm_90a (the
// three files of 16-bit q and 8-bit caches had been the slowest of the build, ~115 s each).
constexpr int paged_rows_per_cta(int64_t rows, int q_bytes) {
  return q_bytes == 2 || rows > 8 ? 16 : (rows > 4 ? 8 : 4);
}

// Query rows per CTA of the tensor-core kernel (one m16 tile).
constexpr int kPagedMmaRows = 16;

// Head dims of the tensor-core kernel: D and Dv multiples of 16 from 16 to 256 (D != Dv too).
// It is compiled for three tile widths (64, 128, 256: paged_mma_tile_dim) and runs a call on
// the narrowest tile that holds max(D, Dv): the cache rows are copied at their own width, the
// tile's columns past D (Dv) are zero in shared memory, and only Dv columns are stored. Head
// dims other than the tile widths thus cost no extra instantiation and no extra memory traffic,
// but a stage then holds fewer cache bytes (fewer in flight per SM; paged_mma_padded_stages).
// Measured on an H100 (bf16 32/8, page 16, GB/s, docs/benchmarks.md): 64 x 8k D 80 / 96 / 112
// at 84 / 90 / 90% of D 128's 3026, D 160 92%; 1 x 32k 82 / 88 / 90% of 2413, D 160 95%.
constexpr int kPagedMmaTileDims[] = {64, 128, 256};

constexpr bool paged_mma_head_dims_supported(int64_t head_dim, int64_t head_dim_v) {
  return mma_tile_head_dims_supported(head_dim, head_dim_v);
}

// The tile width (64, 128 or 256) of the tensor-core kernel for head dims D, Dv (supported).
constexpr int paged_mma_tile_dim(int64_t head_dim, int64_t head_dim_v) {
  return mma_tile_dim(head_dim, head_dim_v);
}

// CTAs of the tensor-core kernel per SM for a tile width (paged_mma_tile_dim) and a cache of
// elem_bytes per element (its shared memory is sized for this; checked by static_assert in
// paged_attention_mma.cuh): 16-bit caches 2, 2, 1 for tiles 64, 128, 256; 8-bit caches 3, 2, 1.
constexpr int paged_mma_ctas_per_sm(int tile_dim, int elem_bytes = 2) {
  return tile_dim <= 64 ? (elem_bytes == 1 ? 3 : 2) : (tile_dim <= 128 ? 2 : 1);
}

// Ring stages of the tensor-core kernel when max(D, Dv) is below its tile width (0: the tile's
// own ring, the deepest that fits). A padded row carries fewer cache bytes per stage; on the
// 16-bit 128-wide tile a 2-stage ring (same CTAs per SM) moved more of them in flight than 3
// stages in every padded case timed (tools/paged_decode_sweep.cu, H100, bf16 32/8, cache copies
// rotated out of L2): D 80 / 96 / 112 +0.8 / +0.1 / +8.2% at 64 x 8k, +2.2 / +3.2 / +4.2% at
// 1 x 32k, D 112 +0.9% at 1 x 8k. (D 128 itself keeps 3 stages: 2 lost 6% at 1 x 8k where the
// cache stays in L2.)
constexpr int paged_mma_padded_stages(int tile_dim, int elem_bytes = 2) {
  return tile_dim == 128 && elem_bytes == 2 ? 2 : 0;
}

// Whether the tensor-core kernel takes a call of these dtypes and shapes: q float16 or bfloat16
// with a cache of q's dtype (no scales) or an int8 / float8 e4m3 cache (per-head or per-token
// scales), D and Dv as paged_mma_head_dims_supported, a cache of at least one page (rows behind
// an invalid id read row 0: the output is NaN either way) and of fewer than 2^32 rows of Hkv
// heads (it indexes rows in 32 bits; 2^32 rows are over 256 GB). The launcher also needs q
// 16-byte aligned (it is read in 16-byte vectors; XLA's buffers are).
inline bool paged_mma_supported(DType dtype, CacheDType cache_dtype, ScaleMode scale_mode,
                                int64_t head_dim, int64_t head_dim_v, int64_t num_pages,
                                int64_t page_size, int64_t num_heads_k) {
  const bool f16 = dtype == DType::kFloat16 && cache_dtype == CacheDType::kFloat16;
  const bool bf16 = dtype == DType::kBFloat16 && cache_dtype == CacheDType::kBFloat16;
  const bool q16 = dtype == DType::kFloat16 || dtype == DType::kBFloat16;
  const bool c8 = cache_dtype == CacheDType::kInt8 || cache_dtype == CacheDType::kFloat8E4M3;
  const bool same = (f16 || bf16) && scale_mode == ScaleMode::kNone;
  const bool quant = q16 && c8 && scale_mode != ScaleMode::kNone;
  return (same || quant) && paged_mma_head_dims_supported(head_dim, head_dim_v) &&
         num_pages > 0 && num_pages * page_size * num_heads_k < (int64_t(1) << 32);
}

// The kernel that runs a paged_attention call on CUDA (the one place that decides it: the
// launcher, the FFI handler and Python's jax_flash.kernel_for ask here). mma_ok:
// paged_mma_supported; the CUDA-core kernel takes D == Dv in kPagedHeadDims
// (paged_head_dim_supported) for every dtype. kAuto: the tensor-core kernel where it takes the
// call (see paged_use_mma), else the CUDA-core one; kCudaCore / kTensorCore: that kernel only.
// kNone: no CUDA kernel takes the call (implementation=None then runs the jnp reference, with a
// warning; "cuda" raises).
enum class PagedChoice : int32_t { kNone = 0, kCudaCore = 1, kTensorCore = 2 };

inline PagedChoice paged_kernel_choice(bool mma_ok, int64_t head_dim, int64_t head_dim_v,
                                       PagedKernel kernel) {
  const bool cuda_core_ok = paged_head_dim_supported(head_dim, head_dim_v);
  if (kernel != PagedKernel::kCudaCore && mma_ok) return PagedChoice::kTensorCore;
  if (kernel != PagedKernel::kTensorCore && cuda_core_ok) return PagedChoice::kCudaCore;
  return PagedChoice::kNone;
}

// Whether the tensor-core kernel runs a call that it supports (mma_ok) under the requested
// kernel (PagedKernel in paged_params.h): kAuto takes it whenever supported (it is ahead of the
// CUDA-core kernel from one query row per kv head on, see below), kCudaCore never. kTensorCore
// takes it too; the FFI handler refuses a kTensorCore call it does not support, so that a test
// asking for a kernel gets that kernel or an error.
// Measured on an H100 (bf16, D 128, page 16, GB/s of K+V, CUDA-core -> tensor-core kernel):
// B=64 ctx 8k G=4 Sq=1 2943 -> 2996, G=4 Sq=4 1179 -> 2980, G=8 Sq=1 2194 -> 2992, G=8 Sq=4
// 589 -> 2765; B=1 ctx 32k G=4 Sq=1 1951 -> 2308, G=8 Sq=4 551 -> 2035. With 1-2 rows (MHA,
// G = 2) it is ahead too, although 14-15 of its 16 rows are padding (tools/paged_mma_check
// --mha, us, CUDA-core -> tensor-core): bf16 32/32 D128 64 x 8k 2905 -> 2809, 1 x 32k
// 197 -> 187, 8 x 8k 371 -> 357; 32/16 256 x 1k 730 -> 709; D64 32/16 8 x 8k 114 -> 103; e4m3
// per-token 32/32 64 x 8k 2160 -> 1717, 32/16 1 x 32k 98 -> 73.
inline bool paged_use_mma(bool mma_ok, PagedKernel kernel) {
  return mma_ok && kernel != PagedKernel::kCudaCore;
}

// Split count for the CUDA kernels: split only while the CTAs of one split (B * Hkv * chunks)
// fill less than 80% of one wave of `slots` CTAs (CUDA-core kernel: two per SM for 4- and 8-row
// CTAs, one for 16-row ones, paged_rows_per_cta; tensor-core kernel: paged_mma_ctas_per_sm),
// then to the largest power of two that keeps within one wave and at least 128 keys per split.
// max_ctx is the longest context (max_pages * page_size); `mma`: the tensor-core kernel runs the
// call (paged_use_mma); head_dim: max(D, Dv) (the tensor-core kernel's CTAs per SM follow its
// tile width); cache_bytes, q_bytes: the cache's and q's element sizes. B = 0 (no CTA) gives 1.
// Measured on an H100 SXM (132 SMs; bf16 Hq=32 Hkv=8 D=128 page 16, the CUDA-core kernel with
// 4-row CTAs, as float32 q still runs it; effective K+V GB/s by num_splits, best in brackets;
// D2D copy 3014 GB/s read + write):
//   B=1   ctx 4k:   s16 858, [s32 915], s48 639, s64 728
//   B=1   ctx 32k:  s16 1924, s24 1944, [s32 2119], s48 1768, s64 1953
//   B=1   ctx 128k: s16 2299, s24 2424, [s32 2717], s48 2282
//   B=2   ctx 16k:  s8 1929, s12 1951, [s16 2102], s32 1964
//   B=4   ctx 16k:  s4 2166, s6 2294, [s8 2494], s12 2073, s16 2397
//   B=8   ctx 8k:   s2 2190, s3 2293, [s4 2410], s6 2076, s8 2390
//   B=16  ctx 4k:   s1 2278, [s2 2399], s3 2092, s4 2374
//   B=16  ctx 1k:   [s1 1764], s2 1690
//   B=32  ctx 4k:   [s1 2777], s2 2583;  B=64 ctx 8k: [s1 2936], s2 2839
// i.e. about one wave of 2 CTAs per SM (B * Hkv * s = 256 of 264 slots). The merge adds 2.6-3.3
// us at B = 1 (4.6-5% at 1 x 32k, 19% at 1 x 8k; tools/paged_mma_check --merge) and ~1% from
// B = 8. Split counts 8-128 around this choice (B = 1-2; 32/8, 28/4, 32/2, 32/1 heads; D 64,
// 128): it is the best or within ~6% of it. Re-measured on the tensor-core kernel in the
// benchmark's jitted loop (bf16 32/8 D128 page 16, us per call for splits 4 / 8 / 16 / 32 / 64;
// docs/benchmarks.md): 1 x 8k 36.0 / 23.8 / 23.1 / [18.6] / 19.4, 1 x 32k 118.6 / 69.8 / 57.3 /
// [56.3] / 59.0, 2 x 8k 40.7 / 34.6 / [34.6] / 36.5 / 40.4, 4 x 8k 57.1 / [56.5] / 58.7 / 61.2 /
// 65.7, 8 x 8k [101.1] / 101.6 / 105.2 / 108.1 / 119.2: the choice is the best of them.
inline int paged_num_splits(int64_t batch, int64_t num_heads_k, int64_t group, int64_t seqlen_q,
                            int64_t max_ctx, int num_sms, int head_dim, bool mma,
                            int cache_bytes, int q_bytes) {
  const int64_t rows = group * seqlen_q;
  const int64_t mt = mma ? kPagedMmaRows : paged_rows_per_cta(rows, q_bytes);
  const int64_t ctas = batch * num_heads_k * ((rows + mt - 1) / mt);
  const int64_t per_sm =
      mma ? paged_mma_ctas_per_sm(paged_mma_tile_dim(head_dim, head_dim), cache_bytes)
          : (mt <= 8 ? 2 : 1);
  const int64_t slots = static_cast<int64_t>(num_sms) * per_sm;
  if (ctas <= 0 || ctas * 5 >= slots * 4) return 1;
  int64_t s = slots / ctas;
  const int64_t by_len = (max_ctx + 127) / 128;
  if (s > by_len) s = by_len;
  int64_t pow2 = 1;
  while (pow2 * 2 <= s) pow2 *= 2;
  return static_cast<int>(pow2);
}

// Multi-token queries (chunked prefill against the cache) on the Hopper prefill kernel
// (hopper/paged_prefill_launch.cuh): the smallest Sq that takes it. Below it (speculative
// decoding's few tokens) the decode kernels fold Sq x group rows into their tiles; a 128-row
// prefill tile would be mostly padding. Not yet measured on a GPU: a first guess.
constexpr int64_t kPagedHopperMinSq = 64;

// Whether the Hopper prefill kernel takes a paged call of these dtypes and shapes where the
// device and build have it: the default launch choice (kAuto: the explicit kernel choices keep
// their kernels), Sq >= kPagedHopperMinSq, q float16 / bfloat16 with a cache of its dtype (no
// scales), tensor-core head dims (paged_mma_head_dims_supported; the kernel's tile of
// paged_mma_tile_dim) and pages of a multiple of 16 rows (one TMA box each, 1024-byte aligned
// in shared memory; the launcher also needs a page to divide the key tile or the tile a page).
inline bool paged_hopper_takes(PagedKernel kernel, DType dtype, CacheDType cache_dtype,
                               ScaleMode scale_mode, int64_t seqlen_q, int64_t head_dim,
                               int64_t head_dim_v, int64_t page_size) {
  const bool f16 = dtype == DType::kFloat16 && cache_dtype == CacheDType::kFloat16;
  const bool bf16 = dtype == DType::kBFloat16 && cache_dtype == CacheDType::kBFloat16;
  return kernel == PagedKernel::kAuto && seqlen_q >= kPagedHopperMinSq && (f16 || bf16) &&
         scale_mode == ScaleMode::kNone && paged_mma_head_dims_supported(head_dim, head_dim_v) &&
         page_size >= 16 && page_size % 16 == 0;
}

}  // namespace jax_flash::policy
