// CUDA kernels of the sampling ops (sample, top_k_top_p_filter). Semantics, and every numeric
// decision they share with the CPU kernel: jax_flash/sampling_params.h.
//
// One CTA of 1024 threads per row; the row is streamed from global memory (L2 after the first
// pass) a few times, never sorted and never copied:
//   1. max pass: the first token of the order (argmax) and x_max;
//   2. top-k cut: a radix select over the 64-bit order keys, 11 bits per pass over the bits that
//      can differ between logits of the dtype (2 passes for 16-bit logits, at most 3 for float32),
//      stopping early when one token is left in the chosen bucket; ties of equal logits are then
//      resolved by one ordered pass (a block-wide prefix sum in index order);
//   3. top-p cut (when on): one pass sums the fixed-point masses of the top-k set, then the same
//      select with masses as weights. Tokens below top_p_mass_floor are skipped (usually all but
//      a few), so the histograms see few tokens;
//   4. the Gumbel-max draw over the kept tokens (Philox per group of 4 tokens, only where a token
//      is kept), or the masked logits for the filter.
// Histograms live in shared memory (2048 buckets of uint64 weight and uint32 count); lanes of a
// warp that hit the same bucket are combined first (__match_any_sync and a shuffle reduction), so
// heavily shared buckets (all logits in one exponent range) cost one atomic per warp, not 32.
// Sums are integers, so the result does not depend on the order of the atomics: a fixed key gives
// the same tokens on every run, and the same tokens as the CPU kernel.
//
// Measured (H100 80GB HBM3, B = 64, V = 131072 float32, benchmarks/sampling_bench.py, median of
// jitted calls including the JAX-side seed derivation): greedy 93 us, temperature only 194 us,
// top_k 50 337 us, top_k 50 + top_p 0.9 455 us, top_p 0.9 563 us; the jnp path (lax.top_k or a
// full sort, then jax.random.categorical) took 61, 142, 1247, 1244 and 1977 us. One CTA per row
// streams each pass at a single SM's bandwidth (B = 64 rows leave half the SMs idle), which is
// why greedy and temperature-only sampling trail XLA's fused argmax / categorical; splitting a
// row over a cluster of CTAs is the next step for small batches.
//
// No XLA headers here.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "jax_flash/dtype.cuh"  // to_float, from_float, raw16_to_float
#include "jax_flash/sampling_params.h"
#include "jax_flash/warp.cuh"

namespace jax_flash {
namespace sampling_cuda {

namespace sp = ::jax_flash::sampling;

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kDigitBits = 11;
constexpr int kBuckets = 1 << kDigitBits;
static_assert(kBuckets == 2 * kThreads, "each thread owns two buckets");
constexpr uint32_t kNoBucket = 0xffffffffu;
constexpr unsigned kFullMask = 0xffffffffu;

using u64 = unsigned long long;

struct Smem {
  u64 weight[kBuckets];          // weight per bucket of the current digit (weighted selects)
  unsigned int count[kBuckets];  // tokens per bucket of the current digit
  u64 partial[kWarps];           // per-warp values of block reductions and scans
  u64 result;                    // broadcast slot
  u64 above;                     // chosen bucket: weight of the buckets above it
  unsigned int bucket;           // chosen bucket
};

// One row of logits; tile t covers tokens [t * kThreads * kVec, (t + 1) * kThreads * kVec),
// thread i of the CTA loads its kVec consecutive tokens (16 bytes when kVec > 1).
template <typename T, int kVec>
struct Row {
  const T* x;  // [vocab]
  int32_t vocab;

  __device__ __forceinline__ int32_t num_tiles() const {
    return (vocab + kThreads * kVec - 1) / (kThreads * kVec);
  }
  __device__ __forceinline__ int32_t first(int32_t tile) const {
    return tile * kThreads * kVec + static_cast<int32_t>(threadIdx.x) * kVec;
  }
  // The kVec logits at i0 (vocab % kVec == 0 when kVec > 1); false past the end.
  __device__ __forceinline__ bool load(int32_t i0, float (&v)[kVec]) const {
    if (i0 >= vocab) return false;
    if constexpr (kVec == 1) {
      v[0] = to_float(x[i0]);
    } else {
      raw16_to_float<T>(load16_raw(x + i0), v);
    }
    return true;
  }
};

// ---------------------------------------------------------------------------------------------
// Block-wide reductions (every thread calls them; they end with a barrier, so their shared
// slots can be reused at once).

__device__ __forceinline__ u64 warp_max(u64 v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const u64 o = __shfl_xor_sync(kFullMask, v, off);
    v = o > v ? o : v;
  }
  return v;
}

__device__ __forceinline__ u64 warp_sum(u64 v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(kFullMask, v, off);
  return v;
}

template <bool kMax>
__device__ u64 block_reduce(u64 v, Smem& sm) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = kMax ? warp_max(v) : warp_sum(v);
  if (lane == 0) sm.partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = sm.partial[lane];
    v = kMax ? warp_max(v) : warp_sum(v);
    if (lane == 0) sm.result = v;
  }
  __syncthreads();
  v = sm.result;
  __syncthreads();
  return v;
}

// Sum of v over the threads before this one (thread order); *total: the sum over all threads.
__device__ u64 block_exclusive_sum(u64 v, u64* total, Smem& sm) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const u64 inc = warp_inclusive_sum(v, lane);
  if (lane == 31) sm.partial[warp] = inc;
  __syncthreads();
  if (warp == 0) sm.partial[lane] = warp_inclusive_sum(sm.partial[lane], lane);
  __syncthreads();
  const u64 before = warp > 0 ? sm.partial[warp - 1] : 0;
  *total = sm.partial[kWarps - 1];
  __syncthreads();
  return before + inc - v;
}

// ---------------------------------------------------------------------------------------------
// Radix select

// Sum of v over the lanes in `peers` (the lanes that hold this lane's bucket), complete in the
// lowest lane of the group: a tree over each group's ranks (Westphal's warp-aggregated atomics).
// All 32 lanes call it.
__device__ __forceinline__ u64 sum_over_peers(unsigned peers, u64 v) {
  const unsigned lane = threadIdx.x & 31;
  unsigned rank = __popc(peers & ((1u << lane) - 1u));
  unsigned rest = peers & (0xfffffffeu << lane);  // peers above this lane
  while (__any_sync(kFullMask, rest != 0)) {
    const int next = __ffs(rest);
    const u64 o = __shfl_sync(kFullMask, v, (next - 1) & 31);
    if (next) v += o;
    rest &= __ballot_sync(kFullMask, !(rank & 1u));
    rank >>= 1;
  }
  return v;
}

// Adds weight w to `bucket` (kNoBucket: nothing). All 32 lanes call it.
template <bool kUnit>
__device__ __forceinline__ void hist_add(uint32_t bucket, u64 w, Smem& sm) {
  if (!__any_sync(kFullMask, bucket != kNoBucket)) return;
  const unsigned peers = __match_any_sync(kFullMask, bucket);
  const bool leader = __ffs(peers) - 1 == static_cast<int>(threadIdx.x & 31);
  u64 sum = 0;
  if constexpr (!kUnit) sum = sum_over_peers(peers, w);
  if (leader && bucket != kNoBucket) {
    atomicAdd(&sm.count[bucket], static_cast<unsigned>(__popc(peers)));
    if constexpr (!kUnit) atomicAdd(&sm.weight[bucket], sum);
  }
}

// The bucket of the cut: the largest b whose suffix S(b) (weight of buckets >= b) reaches
// `remaining`. Returns it with S(b + 1) and its token count.
template <bool kUnit>
__device__ void choose_bucket(u64 remaining, Smem& sm, unsigned* bucket, u64* above,
                              unsigned* count) {
  const int b0 = 2 * threadIdx.x, b1 = b0 + 1;
  const u64 h0 = kUnit ? sm.count[b0] : sm.weight[b0];
  const u64 h1 = kUnit ? sm.count[b1] : sm.weight[b1];
  if (threadIdx.x == 0) {
    sm.bucket = 0;
    sm.above = 0;
  }
  u64 total;
  const u64 before = block_exclusive_sum(h0 + h1, &total, sm);
  const u64 s0 = total - before, s1 = s0 - h0, s2 = s1 - h1;
  if (s1 >= remaining && s2 < remaining) {
    sm.bucket = b1;
    sm.above = s2;
  } else if (s0 >= remaining && s1 < remaining) {
    sm.bucket = b0;
    sm.above = s1;
  }
  __syncthreads();
  *bucket = sm.bucket;
  *above = sm.above;
  *count = sm.count[*bucket];
  __syncthreads();
}

__device__ __forceinline__ bool prefix_matches(uint64_t key, uint64_t prefix, int hi) {
  return hi >= 64 || (key >> hi) == (prefix >> hi);
}

// The cut of a prefix filter: the largest order key K such that the tokens with key >= K that
// `weigh` admits carry a total weight >= target (1 <= target <= their total weight).
// weigh(key, x, &w) -> whether the token takes part, with its weight w > 0.
template <bool kUnit, typename T, int kVec, typename Weigh>
__device__ uint64_t select_cut(const Row<T, kVec>& row, int value_lo, u64 target, Weigh weigh,
                               Smem& sm) {
  uint64_t prefix = 0;  // bits [hi, 64) of the cut are decided
  int hi = 64;
  u64 remaining = target;  // weight still to be found within the tokens matching prefix
  unsigned count = 2;
  while (hi > value_lo && count > 1) {
    const int lo = hi - kDigitBits > value_lo ? hi - kDigitBits : value_lo;
    const uint64_t digit_mask = (1ull << (hi - lo)) - 1;
    sm.weight[2 * threadIdx.x] = sm.weight[2 * threadIdx.x + 1] = 0;
    sm.count[2 * threadIdx.x] = sm.count[2 * threadIdx.x + 1] = 0;
    __syncthreads();
    for (int32_t tile = 0; tile < row.num_tiles(); ++tile) {
      float v[kVec];
      const int32_t i0 = row.first(tile);
      const bool ok = row.load(i0, v);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        uint32_t bucket = kNoBucket;
        u64 w = 0;
        if (ok) {
          const uint64_t key = sp::order_key(sp::normalize_logit(v[j]), i0 + j);
          if (prefix_matches(key, prefix, hi) && weigh(key, v[j], &w))
            bucket = static_cast<uint32_t>((key >> lo) & digit_mask);
        }
        hist_add<kUnit>(bucket, w, sm);
      }
    }
    __syncthreads();
    unsigned b;
    u64 above;
    choose_bucket<kUnit>(remaining, sm, &b, &above, &count);
    remaining -= above;
    prefix |= static_cast<uint64_t>(b) << lo;
    hi = lo;
  }

  // The tokens left share the cut's logit (or only one is left): walk them in index order to the
  // one at which the running weight reaches `remaining`.
  u64 run = 0;  // weight of the tiles before this one
  for (int32_t tile = 0; tile < row.num_tiles(); ++tile) {
    float v[kVec];
    const int32_t i0 = row.first(tile);
    const bool ok = row.load(i0, v);
    u64 local = 0;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      u64 w = 0;
      const uint64_t key = sp::order_key(sp::normalize_logit(v[j]), i0 + j);
      if (ok && prefix_matches(key, prefix, hi) && weigh(key, v[j], &w)) local += w;
    }
    u64 tile_total;
    const u64 before = run + block_exclusive_sum(local, &tile_total, sm);
    if (before < remaining && before + local >= remaining) {
      u64 acc = before;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        u64 w = 0;
        const uint64_t key = sp::order_key(sp::normalize_logit(v[j]), i0 + j);
        if (prefix_matches(key, prefix, hi) && weigh(key, v[j], &w)) {
          acc += w;
          if (acc >= remaining) {
            sm.result = key;
            break;
          }
        }
      }
    }
    run += tile_total;
    if (run >= remaining) break;
  }
  __syncthreads();
  const uint64_t cut = sm.result;
  __syncthreads();
  return cut;
}

// ---------------------------------------------------------------------------------------------
// The kernel

template <typename T, int kVec, bool kFilter>
__global__ void __launch_bounds__(kThreads, 1) sampling_kernel(const SamplingParams p) {
  __shared__ Smem sm;
  const int64_t r = blockIdx.x;
  const Row<T, kVec> row{static_cast<const T*>(p.logits) + r * p.vocab, p.vocab};

  uint64_t top = 0;
  for (int32_t tile = 0; tile < row.num_tiles(); ++tile) {
    float v[kVec];
    const int32_t i0 = row.first(tile);
    if (!row.load(i0, v)) continue;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const uint64_t key = sp::order_key(sp::normalize_logit(v[j]), i0 + j);
      top = key > top ? key : top;
    }
  }
  top = block_reduce<true>(top, sm);
  const float x_max = sp::key_value(static_cast<uint32_t>(top >> 32));
  const bool any = x_max > -INFINITY;
  const float tau = p.temperature[r];
  const sp::RowPlan plan = sp::row_plan(tau, p.top_k[r], p.top_p[r], p.min_p[r], p.vocab);
  const int value_lo = 64 - sp::value_bits(p.dtype);

  uint64_t cut = top;  // greedy: the top token only
  if (any && !plan.greedy) {
    cut = 0;
    if (plan.top_k_on) {
      auto unit = [](uint64_t, float, u64* w) {
        *w = 1;
        return true;
      };
      cut = select_cut<true>(row, value_lo, static_cast<u64>(plan.top_k), unit, sm);
    }
    if (plan.top_p_on) {
      const uint64_t cut_k = cut;
      u64 local = 0;
      for (int32_t tile = 0; tile < row.num_tiles(); ++tile) {
        float v[kVec];
        const int32_t i0 = row.first(tile);
        if (!row.load(i0, v)) continue;
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          const float x = sp::normalize_logit(v[j]);
          if (sp::order_key(x, i0 + j) >= cut_k) local += sp::mass(sp::scaled_logit(x, x_max, tau));
        }
      }
      const u64 total = block_reduce<false>(local, sm);
      const u64 target = sp::top_p_target(plan.top_p, total);
      u64 min_mass = sp::top_p_mass_floor(plan.top_p, total, plan.top_k);
      min_mass = min_mass > 0 ? min_mass : 1;
      auto by_mass = [=](uint64_t key, float x, u64* w) {
        if (key < cut_k) return false;
        *w = sp::mass(sp::scaled_logit(sp::normalize_logit(x), x_max, tau));
        return *w >= min_mass;
      };
      cut = select_cut<false>(row, value_lo, target, by_mass, sm);
    }
  }

  if constexpr (kFilter) {
    T* out = static_cast<T*>(p.masked) + r * p.vocab;
    for (int32_t tile = 0; tile < row.num_tiles(); ++tile) {
      float v[kVec];
      const int32_t i0 = row.first(tile);
      if (!row.load(i0, v)) continue;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float x = sp::normalize_logit(v[j]);
        bool kept = any && sp::order_key(x, i0 + j) >= cut;
        if (kept && !plan.greedy) kept = sp::scaled_logit(x, x_max, tau) >= plan.log_min_p;
        const float y = plan.greedy ? v[j] : sp::div(v[j], tau);
        out[i0 + j] = from_float<T>(kept ? y : -INFINITY);
      }
    }
  } else {
    if (!any || plan.greedy) {
      if (threadIdx.x == 0) p.tokens[r] = any ? static_cast<int32_t>(sp::key_index(top)) : -1;
      return;
    }
    const uint32_t* seeds = p.seeds + 3 * r;
    uint64_t best = 0;
    for (int32_t tile = 0; tile < row.num_tiles(); ++tile) {
      float v[kVec];
      const int32_t i0 = row.first(tile);
      if (!row.load(i0, v)) continue;
      constexpr int kGroup = kVec < 4 ? kVec : 4;  // tokens sharing one Philox call
#pragma unroll
      for (int g = 0; g < kVec; g += kGroup) {
        float d[kGroup];
        bool kept[kGroup];
        bool any_kept = false;
#pragma unroll
        for (int j = 0; j < kGroup; ++j) {
          const float x = sp::normalize_logit(v[g + j]);
          d[j] = sp::scaled_logit(x, x_max, tau);
          kept[j] = sp::order_key(x, i0 + g + j) >= cut && d[j] >= plan.log_min_p;
          any_kept |= kept[j];
        }
        if (!any_kept) continue;
        const philox::Words words = sp::gumbel_words(seeds, i0 + g);
#pragma unroll
        for (int j = 0; j < kGroup; ++j) {
          if (!kept[j]) continue;
          const uint32_t i = i0 + g + j;
          const float score = sp::gumbel_score(d[j], words.w[i & 3]);
          const uint64_t key = sp::order_key(score, i);
          best = key > best ? key : best;
        }
      }
    }
    best = block_reduce<true>(best, sm);
    if (threadIdx.x == 0) p.tokens[r] = static_cast<int32_t>(sp::key_index(best));
  }
}

template <typename T, bool kFilter>
cudaError_t launch_sampling(const SamplingParams& p, cudaStream_t stream) {
  constexpr int kVec = Vec16<T>::kElems;
  const bool vec = p.vocab % kVec == 0 && reinterpret_cast<uintptr_t>(p.logits) % 16 == 0;
  auto kernel = vec ? sampling_kernel<T, kVec, kFilter> : sampling_kernel<T, 1, kFilter>;
  kernel<<<static_cast<unsigned>(p.batch), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace sampling_cuda

// Runs sample (filter = false: p.tokens) or top_k_top_p_filter (filter = true: p.masked) on
// `stream`, asynchronously; returns the launch status. Never allocates or synchronizes.
inline cudaError_t run_sampling(const SamplingParams& p, bool filter, cudaStream_t stream) {
  if (p.batch < 0 || p.batch > 0x7fffffff || p.vocab <= 0 || p.vocab > sampling::kMaxVocab)
    return cudaErrorInvalidValue;
  if (p.batch == 0) return cudaSuccess;
  switch (p.dtype) {
    case DType::kFloat32:
      return filter ? sampling_cuda::launch_sampling<float, true>(p, stream)
                    : sampling_cuda::launch_sampling<float, false>(p, stream);
    case DType::kFloat16:
      return filter ? sampling_cuda::launch_sampling<__half, true>(p, stream)
                    : sampling_cuda::launch_sampling<__half, false>(p, stream);
    case DType::kBFloat16:
      return filter ? sampling_cuda::launch_sampling<__nv_bfloat16, true>(p, stream)
                    : sampling_cuda::launch_sampling<__nv_bfloat16, false>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace jax_flash
